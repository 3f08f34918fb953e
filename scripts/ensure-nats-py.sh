# Sourced by scripts/test (and usable alone: `bash scripts/ensure-nats-py.sh`): makes `nats-py`
# importable by python3 for the NATS Agent Protocol conformance test, whose protocol client
# (tests/agents_protocol/client.py) is written from the protocol's documentation with plain
# nats-py, not from Flotilla's code. Never fails the caller: when it cannot be installed, it
# says so and the test skips with the reason.

ensure_nats_py() {
  command -v python3 >/dev/null 2>&1 || { echo "no python3: the agents-protocol test will skip" >&2; return 0; }
  python3 -c 'import nats' >/dev/null 2>&1 && return 0
  echo "Installing nats-py (pip install nats-py) for the agents-protocol test..." >&2
  python3 -m pip install --quiet --disable-pip-version-check 'nats-py>=2.9,<3' 2>/dev/null \
    || python3 -m pip install --quiet --disable-pip-version-check --user 'nats-py>=2.9,<3' 2>/dev/null \
    || python3 -m pip install --quiet --disable-pip-version-check --user --break-system-packages 'nats-py>=2.9,<3' 2>/dev/null \
    || echo "could not install nats-py with pip: the agents-protocol test will skip" >&2
  return 0
}

# Run directly: install now.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  ensure_nats_py
fi
