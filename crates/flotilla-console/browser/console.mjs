// The console as a person uses it, in headless Chromium (Debian's, through playwright-core's
// protocol client). Started by `tests/console.rs` (in_a_real_browser) against real services:
// it prints `SUBMIT` when the runs page is open and reads the run id the test submitted.
// Checks: the run appears and its tree and DAG fill live; reload mid-run shows the same
// state; a task is paused for a chosen time and resumed from the tasks table; a viewer cannot
// approve (the button is off and the API refuses); the operator's approval in the page
// resumes the run. A second run (SUBMIT2): "always" refused for an action, a takeover for a
// chosen time, a plan edit refused then saved, both tasks completed by hand. A third
// (SUBMIT3): rejected as an incident. A fourth (SUBMIT4): a task a worker runs for long reads
// `running`, with its worker and the time it has run, and is cancelled. Then two runs of one
// task by two agents (SUBMIT5, answered with both ids) are compared from a run's page: the
// changed task is marked and its results' line diff shown; an unknown run is named. A
// two-task run (SUBMIT6: draft by the writer, then review by the checker) is forked from its
// review task: the form says what runs again and what is kept, an unknown agent is refused
// with the problem named in the form, and a fork with another agent and other instructions
// lands on the fork's page, which says what it forks, marks the kept task, and succeeds.
// What a person reads is checked as text in the page: a run waiting for an approval reads
// `waiting` (its page, with what for and how to answer; the runs list), runs are named by
// plan name and short id, times are ISO (UTC), a click on a task (DAG node, row) opens its
// panel (input, result, attempts, worker, timings, events), the inbox and the toast name the
// run and the task, the team's LAST INCIDENT is the trust record's, and no page, asset or
// favicon answers an error.
// Lines: SUBMIT, SUBMIT2, SUBMIT3, SUBMIT4, SUBMIT6 (the test answers with the run id),
// SUBMIT5 (two ids), CHECK3 (it answers once it has checked the incident), FORKED <id> (the
// fork made in the page, for the test to check; not answered).
// Writes docs/screenshots/console-*.png.

import { launch, check } from './common.mjs';
import { createInterface } from 'node:readline';
import { join } from 'node:path';
import { tmpdir } from 'node:os';

const url = process.env.CONSOLE_URL;
const shots = process.env.SCREENSHOTS;
const input = createInterface({ input: process.stdin });
const nextLine = () => new Promise((resolve) => input.once('line', resolve));


const browser = await launch();
const errors = [];
// Answers of 400 and more to anything but the API (whose refusals the test provokes): the
// page, its assets, the favicon a browser asks for.
const failed = [];
const icons = [];
const pages = [];
async function signIn(token) {
  const ctx = await browser.newContext({ viewport: { width: 1440, height: 900 } });
  const page = await ctx.newPage();
  pages.push(page);
  page.on('pageerror', (e) => errors.push(String(e)));
  page.on('response', (r) => {
    const path = new URL(r.url()).pathname;
    if (path.startsWith('/favicon')) icons.push(`${path} ${r.status()}`);
    if (r.status() >= 400 && !path.startsWith('/api/')) failed.push(`${r.status()} ${r.url()}`);
  });
  page.on('requestfailed', (r) => {
    if (!new URL(r.url()).pathname.startsWith('/api/')) failed.push(`failed ${r.url()}`);
  });
  page.setDefaultTimeout(30000);
  await page.goto(`${url}/?token=${token}`);
  await page.waitForSelector('body[data-ready="1"]');
  return page;
}
const shot = (page, name) => page.screenshot({ path: join(shots, `console-${name}.png`) });

// Polls `fn(arg)` in the page until it is true (page.waitForFunction would evaluate a string,
// which the console's Content-Security-Policy forbids).
async function until(page, fn, arg, timeout = 30000) {
  const end = Date.now() + timeout;
  for (;;) {
    if (await page.evaluate(fn, arg).catch(() => false)) return;
    if (Date.now() > end) throw new Error(`timed out waiting for ${fn}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

// What a person sees of a run: its status, the DAG's task states, the tree, the events.
// A run's short id: its last hex digits (8 unless two runs shown share them).
const shortOf = (id) => id.replace(/-/g, '').slice(-8);
const ISO = /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/;

const seen = (page) => page.evaluate(() => ({
  status: document.querySelector('#run-title [data-status]')?.dataset.status,
  tasks: [...document.querySelectorAll('#dag g[data-task]')].map((g) => `${g.dataset.task}:${g.dataset.state}`).join(','),
  tree: [...document.querySelectorAll('#tree .node')].map((n) => n.dataset.run).join(','),
  events: parseInt(document.querySelector('#events-state')?.textContent || '0', 10),
}));

try {
  const alice = await signIn(process.env.ALICE_TOKEN);
  check((await alice.textContent('#me')).includes('alice · operator'), 'alice is signed in as an operator');
  await alice.waitForSelector('#runs-total');

  console.log('SUBMIT');
  const run = (await nextLine()).trim();
  // The run appears in the list without a reload.
  const t0 = Date.now();
  await alice.waitForSelector(`#runs a[href="#/run/${run}"]`);
  console.log(`ok: the run appeared in the list ${Date.now() - t0} ms after submission`);
  await alice.waitForSelector(`#runs [data-status="running"], #runs [data-status="accepted"]`);

  // Its page: the tree and the DAG fill live until `publish` waits for a person.
  await alice.click(`#runs a[href="#/run/${run}"]`);
  await alice.waitForSelector(`#tree .node[data-run="${run}"]`);
  await alice.waitForSelector('#dag g[data-task="research"]');
  await alice.waitForSelector('#dag g[data-task="publish"][data-state="awaiting_approval"]', { timeout: 60000 });
  await alice.waitForSelector('#dag g[data-task="draft"][data-state="succeeded"]');
  // The survey workflow's two steps are child runs: the tree has them, with their agents.
  await until(alice, () => document.querySelectorAll('#tree .node').length >= 3);
  check(true, 'the tree (with the workflow\'s child runs) and the DAG filled live');
  await alice.waitForSelector('#run-inbox .approval[data-approval]');
  // A run waiting for a person reads `waiting`, says what for and how to answer it.
  await alice.waitForSelector('#run-title [data-status="waiting"]');
  const title = await alice.textContent('#run-title');
  check(title.includes('quarterly-report') && title.includes(shortOf(run)), `the run is named by its plan and short id: ${title}`);
  check(title.includes('(the run is running)'), 'the header reads waiting, the run\'s own status beside it');
  const wait = await alice.textContent('#run-waits .wait[data-wait-kind="approval"][data-task="publish"]');
  check(wait.includes('approve, reject or edit its input in the request below') && /flotilla approvals approve [0-9a-f-]{36} \S+ \(or reject\)/.test(wait),
    `the wait says what it waits for and how to answer, here or with the CLI: ${wait.trim()}`);
  // The timeline: draft ran and succeeded, publish waits for a person.
  await alice.waitForSelector('#timeline g[data-task="draft"] rect.a-succeeded');
  await alice.waitForSelector('#timeline g[data-task="publish"] rect.w');
  check(true, 'the timeline has each task\'s attempts and the wait for a person');
  // A click on a task (its DAG node) opens its panel: input, result, attempts, worker,
  // timings, events; the panel is in the URL.
  await alice.click('#dag g[data-task="draft"]');
  await alice.waitForSelector('#task-panel[data-task="draft"] #task-result');
  await until(alice, () => (document.querySelector('#task-result')?.textContent || '').includes('draft done'))
    .catch(() => {});
  const draft = await alice.textContent('#task-panel');
  check((await alice.textContent('#task-result')).includes('draft done'), 'the panel has the task\'s result');
  check(draft.includes('write the report'), 'the panel has what the plan asked');
  check((await alice.textContent('#task-facts [data-worker]')).trim().length > 0, 'the panel names the worker');
  check(await alice.isVisible('#task-attempts') && /succeeded/.test(await alice.textContent('#task-attempts')), 'the panel lists the attempts');
  const times = await alice.$$eval('#task-facts .mono', (els) => els.map((e) => e.textContent.trim()).filter((t) => t.includes('T')));
  check(times.length >= 3 && times.every((t) => ISO.test(t)), `queued, started and ended, in ISO (UTC): ${times}`);
  const taskEvents = await alice.textContent('#task-events');
  check(/task_started draft on \S+/.test(taskEvents) && /task_succeeded draft/.test(taskEvents), `the panel has the task's events: ${taskEvents}`);
  check((await alice.evaluate(() => location.hash)).includes('task=draft'), 'the open panel is in the URL');
  await shot(alice, 'task');
  await alice.click('#task-close');
  await alice.waitForSelector('#task-panel', { state: 'hidden' });
  // … and a click on its row in the tasks table.
  await alice.click('#tasks [data-task="research"] .mono');
  await alice.waitForSelector('#task-panel[data-task="research"] #task-result');
  // The panel fills once the task's details arrive (slower on a loaded machine).
  await until(alice, () => (document.querySelector('#task-result')?.textContent || '').includes('Revenue was 1250'))
    .catch(() => {});
  check((await alice.textContent('#task-panel')).includes('Gather the quarter\'s figures.') && (await alice.textContent('#task-result')).includes('Revenue was 1250'),
    'a click on a task\'s row opens its panel');
  await alice.click('#task-close');
  await alice.waitForSelector('#task-panel', { state: 'hidden' });
  check(!(await alice.evaluate(() => location.hash)).includes('task='), 'closing the panel leaves the URL');
  await until(alice, () => parseInt(document.querySelector('#events-state').textContent, 10) > 0);
  // The analyst's tool call (with its arguments) and its streamed reply, in full once final.
  const lines = () => alice.evaluate(() => [...document.querySelectorAll('#events .ev span')].map((e) => e.title).join('\n'));
  await until(alice, () => [...document.querySelectorAll('#events .ev span')].some((e) => e.title.includes('says: Revenue was 1250 this quarter')));
  const text = await lines();
  check(text.split('\n').every((l) => /^\d\d:\d\d:\d\d\.\d{3}Z /.test(l)), 'event lines carry ISO times (UTC)');
  check(text.includes('→ workspace_write {"entry":{"revenue":1250},"topic":"figures"}') || text.includes('→ workspace_write {"topic":"figures","entry":{"revenue":1250}}'), 'the tool call shows with its arguments');
  check(/← workspace_write ok in \d+ ms/.test(text), `the tool call shows its duration:\n${text}`);
  check(text.includes('says: Revenue was 1250 this quarter, up 6.7% on the last one.'), 'the model reply is shown in full');
  const userEvents = (await seen(alice)).events;

  // The debug profile (chosen in the page, kept in the URL) shows more of the same stream.
  await alice.selectOption('#profile', 'debug');
  await until(alice, () => location.hash.includes('profile=debug'));
  await until(alice, (n) => parseInt(document.querySelector('#events-state').textContent, 10) > n, userEvents);
  await alice.waitForSelector('#dag g[data-task="publish"][data-state="awaiting_approval"]');
  check(true, 'the debug profile shows more events than the user profile');
  const tops = await alice.evaluate(() => [...document.querySelectorAll('#events .ev')].map((e) => e.getBoundingClientRect().top));
  check(new Set(tops).size === tops.length && tops.length > 1, `event rows are laid out one under another (${tops.length})`);
  await alice.waitForTimeout(300);

  // Reload mid-run: the same state.
  const before = await seen(alice);
  await alice.reload();
  await alice.waitForSelector('body[data-ready="1"]');
  await alice.waitForSelector('#dag g[data-task="publish"]');
  await until(alice, (n) => parseInt(document.querySelector('#events-state').textContent, 10) >= n, before.events);
  const after = await seen(alice);
  check(JSON.stringify(before) === JSON.stringify(after), `reload shows the same state ${JSON.stringify(after)}`);
  check(await alice.inputValue('#profile') === 'debug', 'the profile survives the reload');
  await shot(alice, 'run');
  // The run's workspace, mailboxes and session state are browsable (this run has none).
  await alice.click('#tab-ws');
  await alice.waitForSelector('#ws table');
  check((await alice.textContent('#ws')).includes('figures'), 'the workspace shows the analyst\'s topic');
  await alice.click('#tab-mbox');
  await alice.waitForSelector('#mbox p, #mbox table');
  await alice.click('#tab-state');
  await until(alice, () => document.querySelector('#state-keys').textContent.length > 0);
  await alice.fill('#state-key', 'draft');
  await alice.click('#state-get');
  await alice.waitForSelector('#state p, #state pre');
  check(true, 'workspace, mailboxes and session state answer');
  await alice.click('#tab-events');
  // One task paused (for a chosen 5 minutes) and resumed from the tasks table
  // (`run.pause`/`run.resume` with `task_id` and `timeout_ms`).
  alice.once('dialog', (d) => d.accept('5'));
  await alice.click('#tasks [data-task="announce"] button[data-task-action="pause"]');
  await until(alice, () => /paused until/.test(document.querySelector('#tasks [data-task="announce"]').textContent));
  const pausedFor = await alice.evaluate(async (r) => {
    const { view } = await (await fetch(`/api/runs/${r}`)).json();
    return Date.parse(view.tasks.find((t) => t.task_id === 'announce').paused_until) - Date.now();
  }, run);
  check(pausedFor > 4 * 60000 && pausedFor <= 5 * 60000, `the task is paused for the 5 minutes chosen (${Math.round(pausedFor / 1000)} s left)`);
  await alice.click('#tasks [data-task="announce"] button[data-task-action="resume"]');
  await alice.waitForSelector('#tasks [data-task="announce"] button[data-task-action="pause"]');
  check(!/paused until/.test(await alice.textContent('#tasks [data-task="announce"]')), 'a task is paused and resumed from the tasks table');

  // A viewer sees the request but cannot approve it: the buttons are off and the API refuses.
  const bob = await signIn(process.env.BOB_TOKEN);
  check((await bob.textContent('#me')).includes('bob · viewer'), 'bob is signed in as a viewer');
  // The runs list: the run reads `waiting`, named by plan and short id, started in ISO.
  const listed = `#runs .vrow:has(a[href="#/run/${run}"])`;
  await bob.waitForSelector(`${listed} [data-status="waiting"]`);
  const rowText = await bob.textContent(`${listed} .c-run`);
  check(rowText.includes('quarterly-report') && rowText.includes(shortOf(run)) && !rowText.includes(run), `the list names the run by plan and short id: ${rowText.trim()}`);
  check(ISO.test((await bob.textContent(`${listed} .c-started`)).trim()), 'the list\'s start time is ISO (UTC)');
  check(true, 'the runs list reads waiting for the run waiting for an approval');
  await bob.goto(`${url}/#/inbox`);
  const card = await bob.waitForSelector('#inbox .approval');
  const approval = await card.getAttribute('data-approval');
  check(await bob.isDisabled('#inbox .approval button[data-decision="approve"]'), 'the viewer\'s Approve button is disabled');
  check(await bob.isDisabled('#inbox .approval input.always') && await bob.isDisabled('#inbox .approval input.incident'), 'the viewer\'s always and incident boxes are disabled');
  const refused = await bob.evaluate(async ([r, a]) => {
    const res = await fetch(`/api/approvals/${r}/${a}`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', 'X-Flotilla-Console': '1' },
      body: JSON.stringify({ decision: 'approve' }),
    });
    return [res.status, (await res.json()).error];
  }, [run, approval]);
  check(refused[0] === 403 && refused[1] === 'not_operator', `the viewer's approval is refused (${refused})`);
  check(await alice.isVisible('#dag g[data-task="publish"][data-state="awaiting_approval"]'), 'the run still waits');

  // The operator approves in the inbox; the run resumes and succeeds.
  await alice.goto(`${url}/#/inbox`);
  await alice.waitForSelector(`#inbox .approval[data-approval="${approval}"]`);
  const cardText = await alice.textContent(`#inbox .approval[data-approval="${approval}"] div`);
  check(cardText.includes(`task publish of run quarterly-report · ${shortOf(run)}`), `the inbox card names the task and the run: ${cardText.trim().slice(0, 160)}`);
  await shot(alice, 'inbox');
  await alice.fill(`#inbox .approval[data-approval="${approval}"] input.comment`, 'checked in the console');
  await alice.click(`#inbox .approval[data-approval="${approval}"] button[data-decision="approve"]`);
  await alice.waitForSelector('#inbox-empty');
  check(true, 'the approval left the inbox');
  const said = await alice.textContent('#toast');
  check(said.includes(`approved task publish of run quarterly-report · ${shortOf(run)}, by alice`), `the toast names the task and the run: ${said}`);
  await alice.goto(`${url}/#/run/${run}`);
  await alice.waitForSelector('#run-title [data-status="succeeded"]', { timeout: 60000 });
  await alice.waitForSelector('#dag g[data-task="announce"][data-state="succeeded"]');
  await until(alice, () => /ended/.test(document.querySelector('#events-state').textContent));
  check(true, 'the approved run resumed and succeeded');
  await until(alice, () => document.querySelector('[data-action="pause"]').disabled);
  check(await alice.isDisabled('[data-action="takeover"]') && await alice.isDisabled('[data-action="cancel"]'), 'an ended run\'s controls are disabled');
  await shot(alice, 'run-done');
  // Children flattened into the stream: the workflow's child runs' events, attributed.
  await alice.selectOption('#children', 'flatten');
  await until(alice, () => location.hash.includes('children=flatten'));
  await until(alice, () => [...document.querySelectorAll('#events .ev span')].some((e) => /\[(writer|checker)·[0-9a-f]{8,}\]/.test(e.title)));
  check(true, 'children=flatten shows the child runs\' events, attributed to their agents');

  // A second run, in a session: `always` is refused for an action (it approves a tool for
  // the session; the page says why), the operator takes the run over for 5 minutes, a bad
  // plan edit is refused with its problems, a good one is recorded, and she completes both
  // tasks by hand.
  console.log('SUBMIT2');
  const run2 = (await nextLine()).trim();
  await alice.goto(`${url}/#/run/${run2}`);
  const card2 = await alice.waitForSelector('#run-inbox .approval[data-approval]');
  await alice.check('#run-inbox .approval input.always');
  await alice.click('#run-inbox .approval button[data-decision="approve"]');
  await until(alice, () => /always_not_applicable|approves a tool for the session/.test(document.querySelector('#toast').textContent));
  check(await card2.isVisible(), '"always" on an action is refused and the request still waits');
  await alice.fill('#hold-min', '5');
  await alice.click('[data-action="takeover"]');
  await alice.waitForSelector('#run-title[data-run-status="human_control"] [data-status="waiting"]');
  check((await alice.textContent('#run-waits')).includes('takeover'), 'a run taken over reads waiting, for its takeover');
  await alice.waitForSelector('[data-action="edit"]:not([hidden])');
  check(true, 'the run is taken over and its plan can be edited');
  await alice.click('[data-action="edit"]');
  const planText = await alice.inputValue('#plan-text');
  const plan2 = JSON.parse(planText);
  await alice.fill('#plan-text', JSON.stringify({ ...plan2, subtasks: plan2.subtasks.slice(1) }));
  await alice.click('#plan-save');
  await until(alice, () => document.querySelector('#plan-problems').textContent.length > 0);
  check(!await alice.isHidden('#edit-plan'), `a plan edit that drops a task is refused: ${await alice.textContent('#plan-problems')}`);
  plan2.subtasks.find((t) => t.id === 'announce').description = 'tell everyone, edited in the console';
  await alice.fill('#plan-text', JSON.stringify(plan2, null, 2));
  await alice.click('#plan-save');
  await alice.waitForSelector('#edit-plan', { state: 'hidden' });
  check(true, 'the edited plan is saved');
  alice.once('dialog', (d) => d.accept('published by hand'));
  await alice.click('#tasks [data-task="publish"] button[data-task-action="complete"]');
  await alice.waitForSelector('#tasks [data-task="announce"] button[data-task-action="complete"]');
  alice.once('dialog', (d) => d.accept('announced by hand'));
  await alice.click('#tasks [data-task="announce"] button[data-task-action="complete"]');
  await alice.waitForSelector('#run-title [data-status="succeeded"]', { timeout: 60000 });
  check(true, 'both tasks completed by hand: the run succeeded');

  // A third run: rejected as an incident (recorded in the writer's trust).
  console.log('SUBMIT3');
  const run3 = (await nextLine()).trim();
  await alice.goto(`${url}/#/run/${run3}`);
  await alice.waitForSelector('#run-inbox .approval[data-approval]');
  await alice.fill('#run-inbox .approval input.comment', 'not this one');
  await alice.check('#run-inbox .approval input.incident');
  await alice.click('#run-inbox .approval button[data-decision="reject"]');
  await alice.waitForSelector('#run-title [data-status="failed"]', { timeout: 60000 });
  check(true, 'rejected as an incident: the run failed');
  console.log('CHECK3');
  await nextLine();

  // A fourth run: a task a worker runs for long reads `running`, with its worker and the
  // time it has run (in the tasks, the DAG and its panel); then it is cancelled.
  console.log('SUBMIT4');
  const run4 = (await nextLine()).trim();
  await alice.goto(`${url}/#/run/${run4}`);
  await alice.waitForSelector('#dag g[data-task="crunch"][data-state="running"]');
  await alice.waitForSelector('#run-title [data-status="running"]');
  const ran = async () => {
    const t = await alice.textContent('#tasks [data-task="crunch"]');
    const m = /on (\S+) for ([\d.]+) s/.exec(t);
    return m ? [m[1], parseFloat(m[2]), t] : [null, 0, t];
  };
  const [worker, first, row4] = await ran();
  check(worker && (await alice.textContent('#tasks [data-task="crunch"] [data-status]')) === 'running', `the task reads running on its worker: ${row4}`);
  await until(alice, () => /running · [\d.]+ s/.test(document.querySelector('#dag g[data-task="crunch"]').textContent));
  await alice.waitForTimeout(2500);
  const [, later] = await ran();
  check(later > first, `the time it has run goes on (${first} s, then ${later} s)`);
  await alice.click('#dag g[data-task="crunch"]');
  await alice.waitForSelector('#task-panel[data-task="crunch"] #task-attempts');
  check((await alice.textContent('#task-facts [data-worker]')).trim() === worker && /running/.test(await alice.textContent('#task-attempts')),
    'its panel names the worker and the running attempt');
  await alice.waitForSelector('#timeline g[data-task="crunch"] rect.a-running');
  await shot(alice, 'running');
  await alice.click('#task-close');
  alice.once('dialog', (d) => d.accept());
  await alice.click('[data-action="cancel"]');
  await alice.waitForSelector('#run-title [data-status="cancelled"]', { timeout: 60000 });
  check(true, 'the long task is cancelled');

  // Two runs compared: the same one-task plan run by two agents (the test answers with both
  // ids once both ended). From the first run's page, "compare" with the second's id.
  console.log('SUBMIT5');
  const [ca, cb] = (await nextLine()).trim().split(' ');
  await alice.goto(`${url}/#/run/${ca}`);
  await alice.waitForSelector('#run-title [data-status="succeeded"]');
  await alice.fill('#compare-with', cb);
  await alice.click('#compare button');
  await alice.waitForSelector('#diff-tasks tr[data-task="check"]');
  check(new URL(alice.url()).hash === `#/diff/${ca}/${cb}`, `the comparison has its own address: ${alice.url()}`);
  const counted = (await alice.textContent('#diff-count')).trim();
  check(counted === '1 of 1 task(s) changed', `the changed tasks are counted: ${counted}`);
  check(await alice.getAttribute('#diff-tasks tr[data-task="check"]', 'data-changed') === 'true', 'the changed task is marked');
  const del = await alice.$$eval('pre.diff[data-task="check"] .del', (s) => s.map((x) => x.textContent));
  const add = await alice.$$eval('pre.diff[data-task="check"] .add', (s) => s.map((x) => x.textContent));
  check(del.includes('-check done') && add.includes('+checked'), `the results' line diff: ${JSON.stringify({ del, add })}`);
  const tasksCell = await alice.textContent('.diff-runs tr:nth-child(4) td:nth-child(2)');
  check(/1 \(1 ok, 0 failed\)/.test(tasksCell), `each run's totals: ${tasksCell}`);
  await shot(alice, 'diff');
  // A run that does not exist is named.
  const ghost = '00000000-0000-7000-8000-000000000000';
  await alice.goto(`${url}/#/diff/${ca}/${ghost}`);
  await until(alice, (g) => (document.querySelector('#diff')?.textContent || '').includes(`run ${g} does not exist`), ghost);
  check(true, 'comparing with a run that does not exist names it');

  // A run forked from a task: a two-task run (the test answers once it succeeded) forked at
  // `review`, with another agent and other instructions; `draft` keeps its result.
  console.log('SUBMIT6');
  const run6 = (await nextLine()).trim();
  await alice.goto(`${url}/#/run/${run6}`);
  await alice.waitForSelector('#run-title [data-status="succeeded"]');
  await alice.waitForSelector('#tasks [data-task="review"] button[data-task-action="fork"]');
  check(await alice.isEnabled('#tasks [data-task="draft"] button[data-task-action="fork"]'), 'each task of an ended run has "fork from here"');
  // A viewer's button is off, and the API refuses their fork.
  await bob.goto(`${url}/#/run/${run6}`);
  await bob.waitForSelector('#tasks [data-task="review"] button[data-task-action="fork"]');
  check(await bob.isDisabled('#tasks [data-task="review"] button[data-task-action="fork"]'), 'the viewer\'s "fork from here" is disabled');
  const viewerFork = await bob.evaluate(async (r) => {
    const res = await fetch(`/api/runs/${r}/fork`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', 'X-Flotilla-Console': '1' },
      body: JSON.stringify({ at: 'review' }),
    });
    return [res.status, (await res.json()).error];
  }, run6);
  check(viewerFork[0] === 403 && viewerFork[1] === 'not_operator', `the viewer's fork is refused (${viewerFork})`);
  await alice.click('#tasks [data-task="review"] button[data-task-action="fork"]');
  await alice.waitForSelector('#fork-form:not([hidden])');
  const forkWhat = await alice.textContent('#fork-what');
  check(forkWhat.includes('review runs again') && forkWhat.includes('draft keeps this run\'s result'), `the form says what runs again and what is kept: ${forkWhat}`);
  // An agent the deployment does not have: refused, the problem named in the form.
  await alice.fill('#fork-agent', 'nobody');
  await alice.click('#fork-submit');
  await until(alice, () => document.querySelector('#fork-problems li[data-code="unknown_agent"]'));
  const problem = await alice.textContent('#fork-problems');
  check(problem.includes('invalid_plan') && problem.includes('agent "nobody" is not defined') && problem.includes('subtasks[1].agent'),
    `an unknown agent is refused, its problem named in the form: ${problem}`);
  check(new URL(alice.url()).hash.startsWith(`#/run/${run6}`), 'a refused fork stays on the run');
  await alice.fill('#fork-agent', 'writer');
  await alice.fill('#fork-description', 'review it again, as the writer');
  await alice.click('#fork-submit');
  await until(alice, (r) => /^#\/run\/[0-9a-f-]{36}$/.test(location.hash.split('?')[0]) && !location.hash.includes(r), run6);
  const forked = new URL(alice.url()).hash.split('?')[0].slice('#/run/'.length);
  console.log(`FORKED ${forked}`);
  check(true, 'the fork is accepted and the page follows it');
  await alice.waitForSelector(`#run-fork a[href="#/run/${run6}"]`);
  const forkLine = (await alice.textContent('#run-fork')).trim();
  check(forkLine === `fork of draft-review · ${shortOf(run6)} at review (1 result kept)`, `the fork says what it forks: ${forkLine}`);
  await alice.waitForSelector('#run-title [data-status="succeeded"]', { timeout: 60000 });
  await alice.waitForSelector('#tasks [data-task="draft"] .kept');
  const keptTitle = await alice.getAttribute('#tasks [data-task="draft"] span[title^="kept"]', 'title');
  check(keptTitle === `kept the result of run draft-review · ${shortOf(run6)} (${run6})` && !(await alice.$('#tasks [data-task="review"] .kept')),
    `the kept task says whose result it has, the task run again does not: ${keptTitle}`);
  // The fork's review ran with the writer (its reply: "review done", not the checker's).
  await alice.click('#tasks [data-task="review"] .mono');
  await alice.waitForSelector('#task-panel[data-task="review"] #task-result');
  await until(alice, () => (document.querySelector('#task-result')?.textContent || '').includes('review done'));
  check((await alice.textContent('#task-panel')).includes('review it again, as the writer'), 'the fork point ran with the new agent and instructions');
  await alice.click('#task-close');
  await alice.waitForSelector('#task-panel', { state: 'hidden' });
  await shot(alice, 'fork');
  // The line leads back to the original.
  await alice.click(`#run-fork a[href="#/run/${run6}"]`);
  await until(alice, (r) => (document.querySelector('#run-title .run-id')?.textContent || '') === r, run6);
  check(await alice.textContent('#run-fork') === '', 'the original is not a fork');

  // The runs list again: the run succeeded, with its agent. It is the oldest run, at the end
  // of the list (newest first), so the list is scrolled to it: only the rows in view exist.
  await alice.goto(`${url}/#/runs`);
  await alice.waitForSelector('#runs .vrow');
  await until(alice, (r) => {
    const list = document.querySelector('#runs');
    list.scrollTop = list.scrollHeight;
    return !!document.querySelector(`#runs a[href="#/run/${r}"]`);
  }, run);
  await alice.waitForSelector('#runs [data-status="succeeded"]');
  // Its tokens come from the run's usage events (read for the rows in view).
  await until(alice, () => [...document.querySelectorAll('#runs .vrow .c-tokens')].some((c) => c.textContent.trim() !== ''));
  await until(alice, () => [...document.querySelectorAll('#runs .vrow .c-agent')].some((c) => c.textContent.trim() !== ''));
  // A column is shown when some run has a value in it: the agents and tokens are; no run
  // here has labels or a cost, so those columns are not shown.
  const heads = await alice.$$eval('#runs-head span', (s) => s.filter((x) => x.offsetParent !== null).map((x) => x.dataset.col));
  check(heads.includes('agent') && heads.includes('tokens') && !heads.includes('labels') && !heads.includes('cost'), `the columns shown are the filled ones: ${heads}`);
  const agents = await alice.textContent(`#runs .vrow:has(a[href="#/run/${run}"]) .c-agent`);
  check(agents.includes('analyst') && agents.includes('survey'), `a run of several tasks lists its agents: ${agents}`);
  await alice.evaluate(() => { document.querySelector('#runs').scrollTop = 0; });
  await shot(alice, 'runs');

  // The team and the workers.
  await alice.goto(`${url}/#/team`);
  await alice.waitForSelector('#team tr[data-member="writer"]');
  // Presence follows the worker registry (the page re-reads the roster every 2 s).
  const present = await alice.waitForSelector('#team tr[data-member="writer"] [data-status="idle"]', { timeout: 15000 })
    .then(() => true, () => false);
  console.log(present ? 'ok: the writer is idle on the roster' : 'note: the roster still says the writer is offline');
  // LAST INCIDENT: the rejection recorded as an incident, as `flotilla trust show` reports it.
  await until(alice, () => /rejected by alice as an incident/.test(document.querySelector('#team tr[data-member="writer"] .incident')?.textContent || ''));
  check(ISO.test((await alice.textContent('#team tr[data-member="writer"] .incident .mono')).trim()), `the team's last incident is the writer's trust incident: ${(await alice.textContent('#team tr[data-member="writer"] .incident')).trim()}`);
  await shot(alice, 'team');
  await alice.goto(`${url}/#/workers`);
  await alice.waitForSelector('#workers tr.worker');
  await alice.waitForSelector('#pools tr[data-pool="default"]');
  await shot(alice, 'workers');

  check(errors.length === 0, `no script errors in the page ${errors.join('; ')}`);
  // The favicon answers (whether or not headless Chromium asked for it on its own).
  const icon = await alice.evaluate(async () => [(await fetch('/favicon.ico')).status, (await fetch('/favicon.svg')).status]);
  check(icon[0] === 200 && icon[1] === 200, `the favicon answers (${icon}; asked by the browser: ${icons.join(', ') || 'none'})`);
  check(failed.length === 0, `no page, asset or favicon answered an error: ${failed.join('; ')}`);
  await browser.close();
  input.close();
  process.exit(0);
} catch (e) {
  console.log(`FAILED: ${e.stack || e}`);
  if (errors.length) console.log(`page errors: ${errors.join('; ')}`);
  // What the operator's page showed when it failed (not a documentation screenshot).
  const at = join(tmpdir(), 'flotilla-console-failure.png');
  if (pages[0]) await pages[0].screenshot({ path: at }).then(() => console.log(`the page when it failed: ${at}`), () => {});
  await browser.close();
  process.exit(1);
}
