#!/usr/bin/env bash
# Strip machine-specific paths from benchmark result files before they are committed:
#   bash bench/sanitize_results.sh bench/*/results/*
# (the interpreter's path -> python3, the device's output folder -> $OUT, temp prefixes -> <tmp>)
for f in "$@"; do
  [ -f "$f" ] || continue
  sed -i -E -e 's#/opt/[^" ]*/site-packages/#<site-packages>/#g' -e 's#/opt/[^" ]*/bin/python3?#python3#g' -e 's#/root/out#$OUT#g' \
    -e 's#/work/[A-Za-z0-9_.-]+/#<repo>/#g' -e 's#/tmp/site#<site>#g' "$f"
done
