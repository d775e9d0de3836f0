#!/usr/bin/env bash
# Make sure bubblewrap (bwrap), the sandbox's isolation boundary, is installed, with what the
# per-session disk quota and cgroups use: mkfs.ext4 (e2fsprogs) and setpriv (util-linux).
# Idempotent: a no-op when all are on PATH; otherwise `apt-get install` the missing packages (after
# `apt-get update` if the first try fails). Called by tests (tests/conftest.py fixture `bwrap`) and usable by hand or in CI:
#
#   bash services/sandbox/install_bwrap.sh     prints the bwrap path on stdout
#
# Exit status: 0 installed (or already there), 3 missing and no apt-get to install it (tests skip,
# naming this reason), 1 apt-get failed. Several developers share a machine: apt runs under a lock.
set -euo pipefail

log() { echo "[install_bwrap] $*" >&2; }

# command -> the Debian package that provides it
declare -A PACKAGE=([bwrap]=bubblewrap [mkfs.ext4]=e2fsprogs [setpriv]=util-linux)
missing() {
  local out=()
  for c in "${!PACKAGE[@]}"; do
    command -v "$c" >/dev/null || PATH="$PATH:/usr/sbin:/sbin" command -v "$c" >/dev/null || out+=("${PACKAGE[$c]}")
  done
  echo "${out[@]}"
}

if [ -z "$(missing)" ]; then
  command -v bwrap
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  log "$(missing) missing and apt-get unavailable: cannot install"
  exit 3
fi
LOG=${TMPDIR:-/tmp}/relay-install-bwrap.log
exec 9>"${TMPDIR:-/tmp}/relay-install-bwrap.lock"
flock 9
PKGS=$(missing)
if [ -n "$PKGS" ]; then
  log "installing $PKGS with apt-get (log: $LOG)"
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086 - one word per package
  apt-get install -y -qq $PKGS >"$LOG" 2>&1 || {
    apt-get update -qq >>"$LOG" 2>&1 && apt-get install -y -qq $PKGS >>"$LOG" 2>&1
  } || { log "apt-get install failed, see $LOG"; tail -5 "$LOG" >&2; exit 1; }
fi
command -v bwrap
