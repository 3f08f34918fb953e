// The demo's run followed in the console, as a person does it: started by tests/demo_console.rs
// with the URL `flotilla up --submit … --stay` printed. Opens the runs list, waits for the
// earnings-analysis run, opens it and checks its four tasks succeeded and the workspace
// topic they share; writes docs/screenshots/console-demo.png.

import { launch, check } from './common.mjs';
import { join } from 'node:path';

const [url, shots] = process.argv.slice(2);
const browser = await launch();
const errors = [];
try {
  const page = await (await browser.newContext({ viewport: { width: 1440, height: 900 } })).newPage();
  page.on('pageerror', (e) => errors.push(String(e)));
  page.setDefaultTimeout(60000);
  await page.goto(`${url}#/runs`);
  await page.waitForSelector('body[data-ready="1"]');
  await page.waitForSelector('#runs .vrow a[href^="#/run/"]');
  check((await page.textContent('#runs')).includes('earnings-analysis'), 'the demo\'s run is in the list');
  // The row is redrawn as the run moves (a fresh element each time): click by selector.
  await page.click('#runs .vrow a[href^="#/run/"]');
  await page.waitForSelector('#run-title [data-status="succeeded"]');
  for (const task of ['fetch_data', 'calc_growth', 'calc_margin', 'synthesis']) {
    await page.waitForSelector(`#dag g[data-task="${task}"][data-state="succeeded"]`);
  }
  check(true, 'its four tasks succeeded, in the DAG');
  await page.waitForSelector('#tasks [data-task="synthesis"]');
  check((await page.textContent('#result')).includes('ACME quarterly earnings report'), 'the report is shown');
  await page.click('#tab-ws');
  await page.waitForSelector('#ws table');
  // The topic the tasks share (`quarterly figures`, normalised), one entry per quarter.
  let ws = '';
  for (let i = 0; i < 100 && !(ws.includes('quarterly_figures') && ws.includes('2026-Q3')); i++) {
    await new Promise((r) => setTimeout(r, 100));
    ws = await page.textContent('#ws');
  }
  check(ws.includes('quarterly_figures') && ws.includes('2026-Q3'), `the workspace has the topic the tasks share: ${ws.slice(0, 300)}`);
  await page.screenshot({ path: join(shots, 'console-demo.png') });
  check(errors.length === 0, `no script errors in the page ${errors.join('; ')}`);
  await browser.close();
  process.exit(0);
} catch (e) {
  console.log(`FAILED: ${e.stack || e}`);
  await browser.close();
  process.exit(1);
}
