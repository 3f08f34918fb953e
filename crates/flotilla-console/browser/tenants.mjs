// A console of several tenants as a person of one of them sees it, started by
// tests/console_tenants.rs (`flotilla console --tenants a,b`): alice, of tenant a, signs in
// with her token and is taken to a's page; the tenant picker lists only a; the runs list has
// a's run and not b's; a's usage page shows the model's tokens by agent and model; b's page
// says she is not in it and shows nothing of b. No page answers an error. Writes
// docs/screenshots/console-tenants.png and console-tenant-usage.png.

import { launch, check } from './common.mjs';
import { join } from 'node:path';

const { CONSOLE_URL: url, ALICE_TOKEN: token, RUN_A: runA, RUN_B: runB, SCREENSHOTS: shots } = process.env;
const browser = await launch();
const errors = [];
const failed = [];
try {
  const page = await (await browser.newContext({ viewport: { width: 1440, height: 900 } })).newPage();
  page.on('pageerror', (e) => errors.push(String(e)));
  page.on('response', (r) => { if (r.status() >= 400) failed.push(`${r.status()} ${r.url()}`); });
  page.setDefaultTimeout(30000);

  // Signed in once, at the console's root: her first (and only) tenant's page opens.
  await page.goto(`${url}/?token=${token}`);
  await page.waitForURL((u) => u.pathname === '/t/a/');
  await page.waitForSelector('body[data-ready="1"]');
  check(true, `alice's sign-in opens her tenant's page: ${page.url()}`);
  check(await page.isVisible('#tenant-pick'), 'the tenant picker is shown');
  const options = await page.$$eval('#tenant option', (os) => os.map((o) => o.value));
  check(JSON.stringify(options) === '["a"]', `the picker lists only alice's tenant: ${JSON.stringify(options)}`);
  check((await page.textContent('#me')).includes('alice · operator'), 'she is named, an operator');

  await page.waitForSelector(`#runs .vrow a[href="#/run/${runA}"]`);
  const runs = await page.textContent('#runs');
  check(runs.includes('tenant-a-report'), "a's run is listed");
  check(!runs.includes('tenant-b-report') && !(await page.$(`a[href="#/run/${runB}"]`)), "b's run is not");
  await page.screenshot({ path: join(shots, 'console-tenants.png') });

  // a's usage: the model call of a's run, by agent and model.
  await page.click('[data-nav="usage"]');
  await page.waitForSelector('#usage tr[data-agent="analyst"][data-model="scripted-model"]');
  const row = await page.textContent('#usage tr[data-agent="analyst"]');
  check(row.includes('1,100'), `the analyst's tokens on scripted-model: ${row}`);
  check((await page.textContent('#usage-total')).includes('1,100'), 'the period\'s total');
  check((await page.textContent('#quotas')).includes('concurrent_runs'), 'the quotas and what is used');
  check(page.url().endsWith('/t/a/#/usage'), `the usage page has its URL: ${page.url()}`);
  await page.screenshot({ path: join(shots, 'console-tenant-usage.png') });

  // b's page: she is not in b, and nothing of b is shown (its API is never asked).
  await page.goto(`${url}/t/b/#/runs`);
  await page.waitForSelector('#no-tenant');
  const said = await page.textContent('#no-tenant');
  check(said.includes('not in tenant b') && said.includes('Your tenants: a'), `b's page says she is not in it: ${said}`);
  const body = await page.textContent('body');
  check(!body.includes(runB) && !body.includes('tenant-b-report'), "nothing of b's is on it");
  check(failed.length === 0, `no request answered an error ${failed.join('; ')}`);
  check(errors.length === 0, `no script errors in the page ${errors.join('; ')}`);
  await browser.close();
  process.exit(0);
} catch (e) {
  console.log(`FAILED: ${e.stack || e}`);
  await browser.close();
  process.exit(1);
}
