// Measurements of the console in headless Chromium, started by `tests/console.rs`
// (`measurements`, ignored by default): the runs page with every run the deployment holds
// (load time, scrolling to the end), and the lag from an event's timestamp to its row on a
// run page. Prints one JSON line `RESULT {...}`; the test prints and documents the figures.

import { chromium } from 'playwright-core';
import { createInterface } from 'node:readline';

const url = process.env.CONSOLE_URL;
const input = createInterface({ input: process.stdin });
const nextLine = () => new Promise((resolve) => input.once('line', resolve));

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync'],
});
const result = {};
try {
  const ctx = await browser.newContext({ viewport: { width: 1440, height: 900 } });
  const page = await ctx.newPage();
  page.setDefaultTimeout(120000);
  await page.goto(`${url}/?token=${process.env.ALICE_TOKEN}`);
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

  // Lag: open the run page first, then the test starts the run's work.
  console.log('OPEN');
  const run = (await nextLine()).trim();
  await page.goto(`${url}/#/run/${run}?profile=debug&children=linked`);
  await page.waitForSelector('#events-state');
  await page.evaluate(() => {
    window.__lags = [];
    window.__handled = [];
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
  const handled = (await page.evaluate(() => window.__handled)).sort((a, b) => a - b);
  console.log(`handled lag p50 ${handled[Math.floor(handled.length / 2)]} p99 ${handled[Math.floor(handled.length * 0.99)]} of ${handled.length}`);
  console.log(`RESULT ${JSON.stringify(result)}`);
  await browser.close();
  process.exit(0);
} catch (e) {
  console.log(`FAILED: ${e.stack || e}`);
  await browser.close();
  process.exit(1);
}
