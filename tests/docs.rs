//! The documentation, tested: every shell block of the README and the guides marked runnable
//! runs against a real deployment and its exit code is checked, so a documented command that
//! stops working fails here; every relative link and anchor of the Markdown documents resolves.
//!
//! A runnable block is a fenced block whose info string is `sh runnable`, with options:
//!
//! - `exit=N`: the exit code the block ends with (default 0);
//! - `offline`: it needs no deployment (say `flotilla init` before the deployment starts);
//! - `own-dir`: it runs in a fresh directory of its own, with no deployment (a one-shot
//!   `flotilla up --submit …`, which keeps its own data directory).
//!
//! Each document is one session, its blocks run in order by `bash` (`set -eo pipefail`) in
//! one working directory: a fresh directory holding a copy of the repository's `config/`
//! (so `config/examples/…` resolves and `./config/flotilla.toml` is the configuration, unless
//! a block writes `./flotilla.toml`), with the `flotilla` under test first on `PATH` and no
//! `FLOTILLA_*` variables. Before the first block that needs one, the session starts a
//! deployment there — `flotilla up --workers 2 --http-addr off`, plus the arguments of a
//! `<!-- runnable up: ARGS -->` comment in the document — and waits until `flotilla status`
//! says it is ready; commands of later blocks find it through `.flotilla/nats-url`. Blocks
//! that need a long-running process of their own or a model are not marked runnable.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long one block may take.
const BLOCK_TIMEOUT: Duration = Duration::from_secs(90);
/// How long a deployment may take to be ready.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root")
}

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_flotilla"))
}

// ---------------------------------------------------------------------------------------
// Fenced blocks

/// Where a runnable block runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// In the session's directory, with its deployment up.
    Deployment,
    /// In the session's directory; no deployment needed.
    Offline,
    /// In a fresh directory of its own, without a deployment.
    OwnDir,
}

#[derive(Debug, Clone)]
struct Fence {
    /// 1-based line of the opening fence.
    line: usize,
    /// The info string.
    info: String,
    body: String,
}

#[derive(Debug, Clone)]
struct Runnable {
    line: usize,
    exit: i32,
    place: Place,
    body: String,
}

/// The fenced code blocks of a Markdown text (backtick or tilde fences, indented ones too,
/// their indentation removed from the body).
fn fences(text: &str) -> Vec<Fence> {
    let mut out = Vec::new();
    let mut open: Option<(usize, char, usize, usize, String, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start().len();
        let trimmed = line.trim_start();
        let run = |c: char| trimmed.chars().take_while(|&x| x == c).count();
        match &mut open {
            None => {
                for c in ['`', '~'] {
                    let n = run(c);
                    if n >= 3 {
                        let info = trimmed[n..].trim().to_owned();
                        if c == '`' && info.contains('`') {
                            continue;
                        }
                        open = Some((i + 1, c, n, indent, info, String::new()));
                        break;
                    }
                }
            }
            Some((start, c, n, ind, info, body)) => {
                let m = run(*c);
                if m >= *n && trimmed[m..].trim().is_empty() {
                    out.push(Fence {
                        line: *start,
                        info: std::mem::take(info),
                        body: std::mem::take(body),
                    });
                    open = None;
                } else {
                    let cut = line
                        .char_indices()
                        .take_while(|&(k, ch)| k < *ind && ch == ' ')
                        .count();
                    body.push_str(&line[cut..]);
                    body.push('\n');
                }
            }
        }
    }
    out
}

/// The runnable blocks of a document, or what is wrong with their info strings.
fn runnables(text: &str) -> Result<Vec<Runnable>, String> {
    let mut out = Vec::new();
    for f in fences(text) {
        let mut words = f.info.split_whitespace();
        let lang = words.next().unwrap_or_default();
        let words: Vec<&str> = words.collect();
        if !words.contains(&"runnable") {
            continue;
        }
        if lang != "sh" {
            return Err(format!(
                "line {}: a runnable block is `sh runnable`, not `{}`",
                f.line, f.info
            ));
        }
        let mut block = Runnable {
            line: f.line,
            exit: 0,
            place: Place::Deployment,
            body: f.body,
        };
        for w in words {
            match w {
                "runnable" => {}
                "offline" => block.place = Place::Offline,
                "own-dir" => block.place = Place::OwnDir,
                _ => match w.strip_prefix("exit=").map(str::parse::<i32>) {
                    Some(Ok(code)) => block.exit = code,
                    _ => {
                        return Err(format!(
                            "line {}: unknown option {w:?} of a runnable block (exit=N, offline, own-dir)",
                            f.line
                        ));
                    }
                },
            }
        }
        out.push(block);
    }
    Ok(out)
}

/// The arguments a document's `<!-- runnable up: ARGS -->` comment adds to `flotilla up`.
fn up_args(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            l.trim()
                .strip_prefix("<!-- runnable up:")
                .and_then(|r| r.strip_suffix("-->"))
        })
        .flat_map(|r| r.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        .collect()
}

// ---------------------------------------------------------------------------------------
// Running blocks

/// A directory like a checkout's for the commands the documents show: a copy of `config/`.
fn workdir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("flotilla-docs-")
        .tempdir()
        .expect("a temporary directory");
    copy_dir(&root().join("config"), &dir.path().join("config")).expect("config/ copied");
    dir
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// A command in `dir` with the binary under test first on `PATH` and no `FLOTILLA_*`
/// variables (`FLOTILLA_CONFIG` among them), in a process group of its own.
fn command(program: &Path, dir: &Path) -> Command {
    let mut cmd = Command::new(program);
    let bin_dir = bin().parent().expect("the binary's directory").to_owned();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![bin_dir];
    paths.extend(std::env::split_paths(&path));
    cmd.current_dir(dir)
        .env("PATH", std::env::join_paths(paths).expect("PATH"))
        .stdin(Stdio::null())
        .process_group(0);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("FLOTILLA_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

fn kill_group(child: &Child, signal: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(child.id() as i32), signal);
}

/// What a finished command said.
struct Said {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `cmd` with its output in files of `logs`, killing its process group after `timeout`.
fn run(mut cmd: Command, logs: &Path, timeout: Duration) -> Said {
    let out = logs.join("stdout");
    let err = logs.join("stderr");
    cmd.stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"));
    let mut child = cmd.spawn().expect("the command starts");
    let deadline = Instant::now() + timeout;
    let code = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status.code();
        }
        if Instant::now() > deadline {
            kill_group(&child, nix::sys::signal::Signal::SIGKILL);
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // What the block left running in its group goes with it.
    kill_group(&child, nix::sys::signal::Signal::SIGKILL);
    Said {
        code,
        stdout: std::fs::read_to_string(&out).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err).unwrap_or_default(),
    }
}

/// A deployment started by a session: `flotilla up` in the session's directory.
struct Deployment {
    child: Child,
    log: PathBuf,
}

impl Deployment {
    fn start(dir: &Path, logs: &Path, extra: &[String]) -> Result<Self, String> {
        let log = logs.join("up.log");
        let file = std::fs::File::create(&log).expect("log file");
        let mut cmd = command(&bin(), dir);
        cmd.args(["up", "--workers", "2", "--http-addr", "off"])
            .args(extra)
            .stderr(file.try_clone().expect("log file"))
            .stdout(file);
        let child = cmd.spawn().map_err(|e| format!("flotilla up: {e}"))?;
        let mut up = Self { child, log };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = up.child.try_wait().expect("wait") {
                return Err(format!("flotilla up exited ({status}):\n{}", up.log()));
            }
            if dir.join(".flotilla/nats-url").exists() {
                let said = run(
                    {
                        let mut c = command(&bin(), dir);
                        c.arg("status");
                        c
                    },
                    logs,
                    Duration::from_secs(30),
                );
                if said.code == Some(0) {
                    return Ok(up);
                }
                if Instant::now() > deadline {
                    return Err(format!(
                        "the deployment never read ready in `flotilla status`:\n{}{}\n{}",
                        said.stdout,
                        said.stderr,
                        up.log()
                    ));
                }
            } else if Instant::now() > deadline {
                return Err(format!("flotilla up never started:\n{}", up.log()));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn log(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let from = lines.len().saturating_sub(40);
        lines[from..].join("\n")
    }
}

impl Drop for Deployment {
    /// Stops `up` as Ctrl-C would (it stops its own NATS server), then whatever of its
    /// process group is left.
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        kill_group(&self.child, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

/// Runs every runnable block of `doc` (relative to the repository root) in order; returns
/// how many ran.
fn run_document(doc: &str) -> usize {
    let text = std::fs::read_to_string(root().join(doc)).expect("the document");
    let blocks = runnables(&text).unwrap_or_else(|e| panic!("{doc}: {e}"));
    assert!(!blocks.is_empty(), "{doc} has no runnable block");
    let extra = up_args(&text);
    let logs = tempfile::tempdir().expect("a temporary directory");
    let session = workdir();
    let mut deployment: Option<Deployment> = None;
    for block in &blocks {
        let own;
        let dir = match block.place {
            Place::OwnDir => {
                own = workdir();
                own.path().to_owned()
            }
            Place::Offline => session.path().to_owned(),
            Place::Deployment => {
                if deployment.is_none() {
                    deployment = Some(
                        Deployment::start(session.path(), logs.path(), &extra)
                            .unwrap_or_else(|e| panic!("{doc}:{}: {e}", block.line)),
                    );
                }
                session.path().to_owned()
            }
        };
        let started = Instant::now();
        let mut cmd = command(Path::new("bash"), &dir);
        cmd.args(["--noprofile", "--norc", "-c"])
            .arg(format!("set -eo pipefail\n{}", block.body));
        let said = run(cmd, logs.path(), BLOCK_TIMEOUT);
        if said.code != Some(block.exit) {
            panic!(
                "{doc}:{}: the block ended {} (expected exit {}) after {:.1?}\n--- block\n{}--- stdout\n{}--- stderr\n{}{}",
                block.line,
                said.code
                    .map_or("killed (timeout or signal)".to_owned(), |c| format!(
                        "with exit {c}"
                    )),
                block.exit,
                started.elapsed(),
                block.body,
                said.stdout,
                said.stderr,
                deployment
                    .as_ref()
                    .map(|d| format!("--- flotilla up (last lines)\n{}\n", d.log()))
                    .unwrap_or_default()
            );
        }
        eprintln!(
            "{doc}:{}: exit {} in {:.1?}",
            block.line,
            block.exit,
            started.elapsed()
        );
    }
    blocks.len()
}

/// The documents whose runnable blocks run, each by a test of its own.
macro_rules! documents {
    ($($test:ident => $doc:literal),* $(,)?) => {
        const DOCUMENTS: &[&str] = &[$($doc),*];
        $(
            #[test]
            fn $test() {
                run_document($doc);
            }
        )*
    };
}

documents! {
    readme => "README.md",
    guide_getting_started => "docs/guide/getting-started.md",
    guide_running => "docs/guide/running.md",
    guide_plans => "docs/guide/plans.md",
    guide_agents => "docs/guide/agents.md",
    guide_collaboration => "docs/guide/collaboration.md",
    guide_team => "docs/guide/team.md",
    guide_humans_in_the_loop => "docs/guide/humans-in-the-loop.md",
    guide_controls => "docs/guide/controls.md",
    guide_agent_protocol => "docs/guide/agent-protocol.md",
    guide_deploy => "docs/guide/deploy.md",
    guide_watching => "docs/guide/watching.md",
    guide_operations => "docs/guide/operations.md",
    guide_forking => "docs/guide/forking.md",
    guide_evaluating => "docs/guide/evaluating.md",
    guide_tenants => "docs/guide/tenants.md",
}

/// Every document with a runnable block — the README and every guide — is run by a test
/// above, and each block's options are known.
#[test]
fn every_document_with_runnable_blocks_is_run() {
    let mut docs = vec!["README.md".to_owned()];
    for entry in std::fs::read_dir(root().join("docs/guide")).expect("docs/guide") {
        let name = entry
            .expect("entry")
            .file_name()
            .to_string_lossy()
            .into_owned();
        if name.ends_with(".md") {
            docs.push(format!("docs/guide/{name}"));
        }
    }
    let mut total = 0;
    for doc in &docs {
        let text = std::fs::read_to_string(root().join(doc)).expect("the document");
        let blocks = runnables(&text).unwrap_or_else(|e| panic!("{doc}: {e}"));
        total += blocks.len();
        assert!(
            blocks.is_empty() || DOCUMENTS.contains(&doc.as_str()),
            "{doc} has {} runnable block(s) but no test runs it: add it to `documents!` in tests/docs.rs",
            blocks.len()
        );
    }
    assert!(total >= 30, "only {total} runnable blocks in all");
}

#[test]
fn runnable_blocks_are_parsed_with_their_options() {
    let text = "intro\n\n```sh runnable\nflotilla status\n```\n\n```sh\nflotilla up\n```\n\n  ```sh runnable exit=1 own-dir\n  flotilla plan validate x.json\n  ```\n```text\nnot runnable\n```\n<!-- runnable up: --config config/x.toml -->\n";
    let blocks = runnables(text).expect("parsed");
    assert_eq!(blocks.len(), 2);
    assert_eq!(
        (blocks[0].line, blocks[0].exit, blocks[0].place),
        (3, 0, Place::Deployment)
    );
    assert_eq!(blocks[0].body, "flotilla status\n");
    assert_eq!(
        (blocks[1].line, blocks[1].exit, blocks[1].place),
        (11, 1, Place::OwnDir)
    );
    assert_eq!(blocks[1].body, "flotilla plan validate x.json\n");
    assert_eq!(up_args(text), ["--config", "config/x.toml"]);
    assert!(runnables("```sh runnable quick\nx\n```\n").is_err());
    assert!(runnables("```text runnable\nx\n```\n").is_err());
}

// ---------------------------------------------------------------------------------------
// Links

/// The Markdown documents whose links are checked.
fn linked_documents() -> Vec<PathBuf> {
    let mut out = vec![
        root().join("README.md"),
        root().join("CONTRIBUTING.md"),
        root().join("CHANGELOG.md"),
        root().join("helm/flotilla/README.md"),
    ];
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .expect("a directory")
            .map(|e| e.expect("entry").path())
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|e| e == "md") {
                out.push(p);
            }
        }
    }
    walk(&root().join("docs"), &mut out);
    out
}

/// `text` with fenced blocks and code spans blanked out (same lengths of lines), so links
/// and headings are read from prose only.
fn prose(text: &str) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let mut open: Option<(char, usize)> = None;
    for line in &mut lines {
        let trimmed = line.trim_start();
        let run = |c: char| trimmed.chars().take_while(|&x| x == c).count();
        match open {
            None => {
                for c in ['`', '~'] {
                    let n = run(c);
                    if n >= 3 && !(c == '`' && trimmed[n..].contains('`')) {
                        open = Some((c, n));
                        line.clear();
                        break;
                    }
                }
            }
            Some((c, n)) => {
                let m = run(c);
                if m >= n && trimmed[m..].trim().is_empty() {
                    open = None;
                }
                line.clear();
            }
        }
    }
    let joined = lines.join("\n");
    // Code spans: a run of n backticks up to the next run of exactly n.
    let chars: Vec<char> = joined.chars().collect();
    let mut out = String::with_capacity(joined.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let n = chars[i..].iter().take_while(|&&c| c == '`').count();
        let mut j = i + n;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let m = chars[j..].iter().take_while(|&&c| c == '`').count();
                if m == n {
                    close = Some(j);
                    break;
                }
                j += m;
            } else {
                j += 1;
            }
        }
        match close {
            Some(j) => {
                // Keep the span's text for headings' slugs, marked so links inside are not
                // read: backticks become a character no link contains.
                for &c in &chars[i..j + n] {
                    out.push(match c {
                        '\n' => '\n',
                        '`' => '\u{1}',
                        '[' | ']' | '(' | ')' => '\u{2}',
                        c => c,
                    });
                }
                i = j + n;
            }
            None => {
                for _ in 0..n {
                    out.push('`');
                }
                i += n;
            }
        }
    }
    out
}

/// GitHub's anchor of a heading's text.
fn slug(heading: &str) -> String {
    // Links in a heading read as their text.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        text.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after.find("](") {
            Some(close) if after[close + 2..].contains(')') => {
                text.push_str(&after[..close]);
                let tail = &after[close + 2..];
                rest = &tail[tail.find(')').map_or(0, |p| p + 1)..];
            }
            _ => {
                text.push('[');
                rest = after;
            }
        }
    }
    text.push_str(rest);
    text.chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_lowercase().collect::<String>())
            } else if c == ' ' {
                Some("-".to_owned())
            } else {
                None
            }
        })
        .collect()
}

/// The anchors of a document: its headings' slugs (repeats numbered as GitHub does) and the
/// ids of its HTML anchors.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for line in prose(text).lines() {
        let t = line.trim_start();
        let hashes = t.chars().take_while(|&c| c == '#').count();
        if (1..=6).contains(&hashes) && t[hashes..].starts_with(' ') {
            let heading = t[hashes..].trim().trim_end_matches('#').trim();
            let heading: String = heading
                .chars()
                .filter(|&c| c != '\u{1}' && c != '*')
                .map(|c| if c == '\u{2}' { '(' } else { c })
                .collect();
            let base = slug(&heading);
            let n = seen.entry(base.clone()).or_insert(0);
            out.insert(if *n == 0 {
                base.clone()
            } else {
                format!("{base}-{n}")
            });
            *n += 1;
        }
        for attr in ["id=\"", "name=\""] {
            let mut rest = line;
            while let Some(p) = rest.find(attr) {
                let after = &rest[p + attr.len()..];
                if let Some(end) = after.find('"') {
                    out.insert(after[..end].to_owned());
                }
                rest = after;
            }
        }
    }
    out
}

/// The link targets of a document's prose, with their lines: inline links and images, and
/// reference definitions.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in prose(text).lines().enumerate() {
        let mut rest = line;
        while let Some(p) = rest.find("](") {
            let after = &rest[p + 2..];
            let end = after.find([')', ' ']).unwrap_or(after.len());
            let target = after[..end].trim_start_matches('<').trim_end_matches('>');
            out.push((i + 1, target.to_owned()));
            rest = &after[end..];
        }
        let t = line.trim_start();
        if let Some(label) = t.strip_prefix('[')
            && let Some(p) = label.find("]: ")
            && !label[..p].contains(']')
        {
            let target = label[p + 3..].split_whitespace().next().unwrap_or_default();
            out.push((i + 1, target.to_owned()));
        }
    }
    out
}

/// What is wrong with the relative links of `doc`.
fn broken_links(doc: &Path, cache: &mut BTreeMap<PathBuf, BTreeSet<String>>) -> Vec<String> {
    let text = std::fs::read_to_string(doc).expect("the document");
    let shown = doc
        .strip_prefix(root())
        .unwrap_or(doc)
        .display()
        .to_string();
    let mut broken = Vec::new();
    for (line, target) in links(&text) {
        if target.is_empty()
            || target.contains("://")
            || target.starts_with("mailto:")
            || target.contains('\u{1}')
            || target.contains('\u{2}')
        {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (target.as_str(), None),
        };
        let file = if path.is_empty() {
            doc.to_owned()
        } else {
            doc.parent().expect("a directory").join(path)
        };
        if !file.exists() {
            broken.push(format!("{shown}:{line}: {target}: no such file"));
            continue;
        }
        let Some(anchor) = anchor else { continue };
        if file.extension().is_none_or(|e| e != "md") {
            continue;
        }
        let file = file.canonicalize().expect("an existing file");
        let known = cache.entry(file.clone()).or_insert_with(|| {
            anchors(&std::fs::read_to_string(&file).expect("the linked document"))
        });
        if !known.contains(anchor) {
            broken.push(format!(
                "{shown}:{line}: {target}: no heading has anchor #{anchor}"
            ));
        }
    }
    broken
}

/// Every relative link of the README, the guides and the other documents names a file that
/// exists, and every anchor a heading (or an HTML anchor) of it.
#[test]
fn relative_links_and_anchors_resolve() {
    let mut cache = BTreeMap::new();
    let mut broken = Vec::new();
    let docs = linked_documents();
    for doc in &docs {
        broken.extend(broken_links(doc, &mut cache));
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(docs.len() >= 10, "{docs:?}");
}

#[test]
fn a_missing_file_or_anchor_is_a_broken_link() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::write(
        dir.path().join("a.md"),
        "# A\n\n[ok](b.md#the-b), [gone](c.md), [bad](b.md#nope), [here](#a), [web](https://x.org/y#z)\n",
    )
    .expect("written");
    std::fs::write(dir.path().join("b.md"), "## The B\n").expect("written");
    let broken = broken_links(&dir.path().join("a.md"), &mut BTreeMap::new());
    assert_eq!(broken.len(), 2, "{broken:?}");
    assert!(broken[0].ends_with("c.md: no such file"), "{broken:?}");
    assert!(
        broken[1].ends_with("no heading has anchor #nope"),
        "{broken:?}"
    );
}

#[test]
fn slugs_are_githubs() {
    assert_eq!(
        slug("Approvals: a person decides"),
        "approvals-a-person-decides"
    );
    assert_eq!(
        slug("LLM agents (`flotilla-llm`)"),
        "llm-agents-flotilla-llm"
    );
    assert_eq!(
        slug("The team: roster, presence, failure records"),
        "the-team-roster-presence-failure-records"
    );
    assert_eq!(
        slug("`ws.append`: append a workspace entry"),
        "wsappend-append-a-workspace-entry"
    );
    assert_eq!(slug("Pause — and resume"), "pause--and-resume");
    assert_eq!(slug("See [the guide](guide/x.md) now"), "see-the-guide-now");
    let text = "# A\n## A\n```\n# not a heading\n```\n## `b_c`\n<a id=\"here\"></a>\n";
    let found = anchors(text);
    assert_eq!(
        found,
        ["a", "a-1", "b_c", "here"]
            .map(str::to_owned)
            .into_iter()
            .collect()
    );
    let text = "See [x](a.md#b) and `[not](a link)` and ![pic](p.png).\n\n```\n[no](c.md)\n```\n[ref]: d.md#e\n";
    let found: Vec<String> = links(text).into_iter().map(|(_, t)| t).collect();
    assert_eq!(found, ["a.md#b", "p.png", "d.md#e"]);
}
