// Screenshot of one console page, by hand: `node shot.mjs URL OUT.png [TAB]`, e.g. the demo's
// run as docs/screenshots/console-demo.png shows it (`flotilla up` in one terminal, then
// `flotilla submit config/examples/plans/earnings.json`):
//   node crates/flotilla-console/browser/shot.mjs "http://127.0.0.1:9480/#/run/RUN" docs/screenshots/console-demo.png ws
// CHROMIUM overrides /usr/bin/chromium.

import { chromium } from 'playwright-core';

const [url, out, tab] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync'],
});
const page = await (await browser.newContext({ viewport: { width: 1440, height: 900 } })).newPage();
await page.goto(url);
await page.waitForSelector('body[data-ready="1"]');
if (url.includes('#/run/')) await page.waitForSelector('#run-title [data-status]');
if (tab) {
  await page.click(`#tab-${tab}`);
  await page.waitForSelector(`#pane-${tab} table, #pane-${tab} p`);
}
await new Promise((r) => setTimeout(r, 500));
await page.screenshot({ path: out });
await browser.close();
