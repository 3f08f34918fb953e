//! What the browser test needs from this machine: the browser tests' directory, Chromium,
//! Node and playwright-core (`scripts/ensure-browser.sh` installs them).

use std::path::{Path, PathBuf};

/// Where the browser tests live.
pub(crate) fn browser_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("browser")
}

/// Chromium, when installed: `$FLOTILLA_CHROMIUM`, else `chromium` or
/// `chromium-browser` on the PATH.
pub(crate) fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FLOTILLA_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| [d.join("chromium"), d.join("chromium-browser")])
        .find(|p| p.is_file())
}

/// Why the browser test cannot run here, if it cannot.
pub(crate) fn browser_missing() -> Option<String> {
    if chromium().is_none() {
        return Some("no chromium on the PATH (scripts/ensure-browser.sh installs it)".into());
    }
    if std::process::Command::new("node")
        .arg("--version")
        .output()
        .is_err()
    {
        return Some("no node on the PATH".into());
    }
    if !browser_dir().join("node_modules/playwright-core").is_dir() {
        return Some(format!(
            "playwright-core is not installed in {} (scripts/ensure-browser.sh runs npm ci there)",
            browser_dir().display()
        ));
    }
    None
}
