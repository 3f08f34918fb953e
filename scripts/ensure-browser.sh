# Sourced by scripts/test (and usable alone: `bash scripts/ensure-browser.sh`): makes what the
# console's browser tests need available — Debian's `chromium` (apt-get, when missing and
# allowed) and `playwright-core` from the npm registry, pinned by
# crates/flotilla-console/browser/package-lock.json (`npm ci`). Playwright's own browser
# download is not used. Never fails the caller: when something cannot be installed, it says
# so and the browser test skips with the reason.

ensure_browser() {
  local dir
  dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/crates/flotilla-console/browser"
  if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
      local sudo=""
      [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
      echo "Installing chromium (apt-get install chromium)..." >&2
      { $sudo apt-get install -y -qq chromium >/dev/null 2>&1 \
        || { $sudo apt-get update -qq >/dev/null 2>&1 && $sudo apt-get install -y -qq chromium >/dev/null 2>&1; }; } \
        || echo "could not install chromium: the console's browser test will skip" >&2
    else
      echo "no chromium and no apt-get: the console's browser test will skip" >&2
    fi
  fi
  if ! command -v npm >/dev/null 2>&1; then
    echo "no npm: the console's browser test will skip" >&2
    return 0
  fi
  if [ ! -d "$dir/node_modules/playwright-core" ]; then
    echo "Installing playwright-core for the console's browser test (npm ci)..." >&2
    (cd "$dir" && npm ci --no-audit --no-fund --silent >/dev/null 2>&1) \
      || echo "npm ci failed in $dir: the console's browser test will skip" >&2
  fi
  return 0
}

# Run directly: install now.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  ensure_browser
fi
