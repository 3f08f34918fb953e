// Measurements of the console in headless Chromium, driven by `flotilla bench --only console`
// (crates/flotilla-bench/src/console.rs), which prints the figures: the runs page with every
// run the deployment holds (load, scrolling to the end), the lag from an event's timestamp to
// its row on a run page, and a run page with a large tree. Talks with the bench over stdin
// and stdout: prints OPEN (reads the run to follow), GO (reads a line once the run ended),
// TREE (reads the tree's run), then one JSON line `RESULT {...}`.

import { launch } from './common.mjs';
import { createInterface } from 'node:readline';

const url = process.env.CONSOLE_URL;
const input = createInterface({ input: process.stdin });
const nextLine = () => new Promise((resolve) => input.once('line', resolve));

const browser = await launch();
const result = {};
let step = 'start';
try {
  const ctx = await browser.newContext({ viewport: { width: 1440, height: 900 } });
  // In the page: the longest gap between two frames until `stop()` (a frozen page has one).
  await ctx.addInitScript(() => {
    window.longestFrame = (stop) => {
      let last = performance.now();
      let longest = 0;
      const tick = (t) => {
        longest = Math.max(longest, t - last);
        last = t;
        if (!stop()) requestAnimationFrame(tick);
      };
      requestAnimationFrame(tick);
      return () => Math.round(longest);
    };
  });
  const page = await ctx.newPage();
  page.setDefaultTimeout(120000);
  await page.goto(`${url}/?token=${process.env.CONSOLE_TOKEN}`);
  await page.waitForSelector('body[data-ready="1"]');

  // The runs page with every run: from navigation to the first rows, with the total.
  const expected = parseInt(process.env.RUNS, 10);
  const t0 = Date.now();
  await page.goto(`${url}/#/runs`);
  await page.reload();
  await page.waitForSelector('#runs .vrow a');
  result.runs_first_rows_ms = Date.now() - t0;
  const total = await page.evaluate(() => parseInt(document.querySelector('#runs-total').textContent, 10));
  result.runs_total = total;
  // Scroll to the end: the last page is fetched and drawn.
  const t1 = Date.now();
  await page.evaluate(() => { const l = document.querySelector('#runs'); l.scrollTop = l.scrollHeight; });
  await page.waitForSelector(`#runs [data-i="${total - 1}"] a`);
  result.runs_scroll_to_end_ms = Date.now() - t1;
  result.runs_dom_rows = await page.evaluate(() => document.querySelectorAll('#runs .vrow').length);
  // The page stays responsive: a frame right after.
  const t2 = Date.now();
  await page.evaluate(() => new Promise((r) => requestAnimationFrame(() => r())));
  result.runs_next_frame_ms = Date.now() - t2;
  if (total < expected) throw new Error(`the list has ${total} runs, not ${expected}`);

  // Lag: open the run page first, then the bench starts the run's work.
  step = 'lag';
  console.log('OPEN');
  const run = (await nextLine()).trim();
  await page.goto(`${url}/#/run/${run}?profile=debug&children=linked`);
  await page.waitForSelector('#events-state');
  await page.evaluate(() => {
    window.__lags = [];
    window.__handled = [];
    window.__longest = longestFrame(() => window.__done);
    window.addEventListener('flotilla:event', (e) => {
      const ts = Date.parse(e.detail.event.ts);
      window.__handled.push(Date.now() - ts);
      // Visible: after the next frame is drawn.
      requestAnimationFrame(() => window.__lags.push(Date.now() - ts));
    });
  });
  console.log('GO');
  await nextLine(); // the run ended
  await new Promise((r) => setTimeout(r, 1500));
  result.page_lags_ms = await page.evaluate(() => window.__lags);
  result.handled_lags_ms = await page.evaluate(() => window.__handled);
  result.events_longest_frame_ms = await page.evaluate(() => { window.__done = true; return window.__longest(); });

  // A run with a large tree: the tree drawn, virtualised, and the page's frames meanwhile.
  step = 'tree';
  console.log('TREE');
  const treeRun = (await nextLine()).trim();
  const t3 = Date.now();
  await page.goto(`${url}/#/run/${treeRun}`);
  await page.waitForSelector('#tree .node');
  await page.waitForFunction(() => /^\d+ run/.test(document.querySelector('#tree-count').textContent));
  result.tree_first_rows_ms = Date.now() - t3;
  result.tree_count = await page.evaluate(() => document.querySelector('#tree-count').textContent);
  result.tree_dom_rows = await page.evaluate(() => document.querySelectorAll('#tree .node').length);
  const rows = await page.evaluate(() => parseInt(document.querySelector('#tree-count').textContent, 10));
  step = 'tree scroll';
  const t4 = Date.now();
  await page.evaluate(() => { const t = document.querySelector('#tree'); t.scrollTop = t.scrollHeight; });
  await page.waitForSelector(`#tree [data-i="${rows - 1}"] .node`);
  result.tree_scroll_to_end_ms = Date.now() - t4;
  result.tree_longest_frame_ms = await page.evaluate(() => new Promise((resolve) => {
    window.__done = false;
    const longest = longestFrame(() => window.__done);
    setTimeout(() => { window.__done = true; resolve(longest()); }, 3000);
  }));
  console.log(`RESULT ${JSON.stringify(result)}`);
  await browser.close();
  process.exit(0);
} catch (e) {
  console.log(`FAILED at ${step}: ${String(e.stack || e).split('\n').slice(0, 3).join(' | ')}`);
  await browser.close();
  process.exit(1);
}
