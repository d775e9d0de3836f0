#!/usr/bin/env bash
# Assemble the DeepGEMM source tree bench/fp8/deepgemm.py builds on the GPU machine (which cannot
# download anything): DeepGEMM at the given commit plus the CUTLASS and {fmt} headers at the
# commits its submodules pin, as one tarball to carry. Nothing of it enters this repository.
#   bash bench/fp8/deepgemm_bundle.sh DEEPGEMM_GIT CUTLASS_GIT FMT_GIT [OUT.tar.gz] [REV]
# (git directories, bare or not, of the three projects; OUT defaults to .deepgemm/src.tar.gz,
# an ignored path; REV to DeepGEMM's HEAD). Then on the GPU machine, with .whl and .deepgemm
# carried: bash bench/fp8/run.sh deepgemm
set -euo pipefail
DG=$1 CUT=$2 FMT=$3 OUT=${4:-.deepgemm/src.tar.gz} REV=${5:-HEAD}
rev=$(git -C "$DG" rev-parse "$REV")
cut_rev=$(git -C "$DG" ls-tree "$rev" third-party/cutlass | awk '{print $3}')
fmt_rev=$(git -C "$DG" ls-tree "$rev" third-party/fmt | awk '{print $3}')
[[ -n "$cut_rev" && -n "$fmt_rev" ]] || { echo "no cutlass/fmt submodule commits in DeepGEMM $rev" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git -C "$DG" archive "$rev" | tar -x -C "$tmp"
mkdir -p "$tmp/third-party/cutlass" "$tmp/third-party/fmt"
git -C "$CUT" archive "$cut_rev" include | tar -x -C "$tmp/third-party/cutlass"
git -C "$FMT" archive "$fmt_rev" include | tar -x -C "$tmp/third-party/fmt"
echo "DeepGEMM $rev; CUTLASS $cut_rev; fmt $fmt_rev" > "$tmp/SOURCE"
mkdir -p "$(dirname "$OUT")"
tar -czf "$OUT" -C "$tmp" .
echo "$OUT: $(cat "$tmp/SOURCE"), $(du -h "$OUT" | cut -f1)"
