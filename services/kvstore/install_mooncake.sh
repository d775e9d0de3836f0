#!/usr/bin/env bash
# Make sure the Mooncake Store tier can run: apt `libibverbs1 ibverbs-providers libnuma1` (the
# transfer engine links them even over TCP) and the pip extra `.[kv]`
# (mooncake-transfer-engine-non-cuda: the CPU wheel; the default CUDA wheel needs libcudart/libcuda).
# Idempotent: a no-op when `mooncake_master` is on the venv's PATH and `import mooncake.store` works.
# Called by tests (tests/test_kvstore_mooncake.py) and the launcher; usable by hand or in CI:
#
#   bash services/kvstore/install_mooncake.sh [PYTHON]     prints the mooncake_master path on stdout
#
# PYTHON defaults to the repo's .venv/bin/python (else python3). Exit status: 0 ready, 3 cannot
# install here (no apt-get or no pip: callers skip naming this reason), 1 an install failed.
# Several developers share a machine: installs run under a lock.
set -euo pipefail

log() { echo "[install_mooncake] $*" >&2; }
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${1:-}
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=$(command -v python3); fi
fi
BIN=$(dirname "$PY")

ready() {
  [ -x "$BIN/mooncake_master" ] && "$PY" -c "from mooncake.store import MooncakeDistributedStore" >/dev/null 2>&1
}
libs_ok() { ldconfig -p | grep -q libibverbs.so.1 && ldconfig -p | grep -q libnuma.so.1; }

if ready && libs_ok; then
  echo "$BIN/mooncake_master"
  exit 0
fi
LOG=${TMPDIR:-/tmp}/relay-install-mooncake.log
exec 9>"${TMPDIR:-/tmp}/relay-install-mooncake.lock"
flock 9
if ! libs_ok; then
  if ! command -v apt-get >/dev/null; then
    log "libibverbs/libnuma missing and apt-get unavailable: cannot install"
    exit 3
  fi
  log "installing libibverbs1 ibverbs-providers libnuma1 with apt-get (log: $LOG)"
  export DEBIAN_FRONTEND=noninteractive
  PKGS="libibverbs1 ibverbs-providers libnuma1"
  apt-get install -y -qq $PKGS >"$LOG" 2>&1 || {
    apt-get update -qq >>"$LOG" 2>&1 && apt-get install -y -qq $PKGS >>"$LOG" 2>&1
  } || { log "apt-get install failed, see $LOG"; tail -5 "$LOG" >&2; exit 1; }
fi
if ! ready; then
  if ! "$PY" -m pip --version >/dev/null 2>&1; then
    log "no pip for $PY: cannot install the kv extra"
    exit 3
  fi
  log "installing the kv extra (mooncake-transfer-engine-non-cuda) into $PY (log: $LOG)"
  "$PY" -m pip install -q -e "$ROOT[kv]" >>"$LOG" 2>&1 \
    || { log "pip install failed, see $LOG"; tail -5 "$LOG" >&2; exit 1; }
fi
ready || { log "installed, but mooncake_master or mooncake.store is still missing"; exit 1; }
echo "$BIN/mooncake_master"
