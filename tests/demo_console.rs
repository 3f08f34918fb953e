//! The demo's run followed in the web console, as a person sees it: `flotilla up --submit
//! config/examples/plans/earnings.json --stay` (what `./scripts/demo --stay` runs) prints the
//! console's URL before the run starts; headless Chromium
//! (`crates/flotilla-console/browser/demo.mjs`) opens it, finds the run, sees its four tasks
//! succeed, the report and the workspace topic the tasks share, and writes
//! `docs/screenshots/console-demo.png`; then an interrupt stops `up`, which exits with the
//! run's status. Without a browser (scripts/ensure-browser.sh installs one) it says why and
//! passes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn browser_dir() -> PathBuf {
    repo().join("crates/flotilla-console/browser")
}

/// Chromium, when installed: `$FLOTILLA_CHROMIUM`, else `chromium` on the PATH.
fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FLOTILLA_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .flat_map(|d| [d.join("chromium"), d.join("chromium-browser")])
        .find(|p| p.is_file())
}

#[tokio::test]
async fn the_demos_run_is_followed_in_the_console() -> anyhow::Result<()> {
    let Some(chromium) = chromium() else {
        eprintln!("SKIPPED: no chromium on the PATH (scripts/ensure-browser.sh installs it)");
        return Ok(());
    };
    if !browser_dir().join("node_modules/playwright-core").is_dir()
        || std::process::Command::new("node")
            .arg("--version")
            .output()
            .is_err()
    {
        eprintln!("SKIPPED: node or playwright-core missing (scripts/ensure-browser.sh)");
        return Ok(());
    }
    let data = tempfile::tempdir()?;
    let mut up = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .current_dir(repo())
        .args(["up", "--workers", "2", "--http-addr", "off", "--data-dir"])
        .arg(data.path())
        .args(["--submit", "config/examples/plans/earnings.json", "--stay"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut stderr = BufReader::new(up.stderr.take().expect("piped")).lines();
    // The console's line comes before the run starts.
    let url = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = stderr.next_line().await? {
            if let Some(rest) = line.strip_prefix("Console: ") {
                return anyhow::Ok(
                    rest.split_whitespace()
                        .next()
                        .unwrap_or_default()
                        .to_owned(),
                );
            }
        }
        anyhow::bail!("up ended without printing the console's URL")
    })
    .await??;
    // The rest of stderr: progress, then the line that says `up` stays.
    let (stays_tx, stays) = tokio::sync::oneshot::channel();
    let log = tokio::spawn(async move {
        let mut all = String::new();
        let mut stays_tx = Some(stays_tx);
        while let Ok(Some(line)) = stderr.next_line().await {
            if line.contains("Flotilla stays up")
                && let Some(tx) = stays_tx.take()
            {
                let _ = tx.send(());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let shots = repo().join("docs/screenshots");
    let browser = tokio::process::Command::new("node")
        .arg(browser_dir().join("demo.mjs"))
        .arg(&url)
        .arg(&shots)
        .env("CHROMIUM", chromium)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(180), browser).await??;
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{said}");
    anyhow::ensure!(out.status.success(), "the browser: {said}");
    tokio::time::timeout(Duration::from_secs(60), stays).await??;
    // Ctrl-C: up stops, with the run's status.
    let pid = up.id().expect("running").to_string();
    std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status()?;
    let status = tokio::time::timeout(Duration::from_secs(60), up.wait()).await??;
    let log = log.await?;
    anyhow::ensure!(status.code() == Some(0), "up exited {status}:\n{log}");
    let mut report = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut up.stdout.take().expect("piped"), &mut report)
        .await?;
    anyhow::ensure!(
        report.contains("ACME quarterly earnings report"),
        "{report}"
    );
    Ok(())
}
