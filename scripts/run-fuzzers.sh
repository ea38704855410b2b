#!/usr/bin/env bash
# Runs every libFuzzer target in BUILD_DIR/fuzz/ for SECONDS each, starting from its
# kept corpus (tests/fuzz/corpus/<name>/, regression inputs included). New
# corpus entries go to a scratch folder so the tree stays clean.
set -euo pipefail
build=$(cd "${1:-build-fuzz}" && pwd)
seconds=${2:-20}
root=$(cd "$(dirname "$0")/.." && pwd)
status=0
for bin in "$build"/fuzz/fuzz_*; do
  [ -x "$bin" ] || continue
  name=$(basename "$bin")
  corpus="$root/tests/fuzz/corpus/$name"
  scratch=$(mktemp -d)
  mkdir -p "$corpus"
  echo "== $name: ${seconds}s"
  if ! (cd "$scratch" && "$bin" -max_total_time="$seconds" -timeout=5 -rss_limit_mb=2048 \
        -print_final_stats=1 "$scratch" "$corpus" 2>"$scratch/log"); then
    tail -50 "$scratch/log"
    echo "== $name FAILED (crash input saved in $scratch)"
    status=1
  else
    grep -E "stat::number_of_executed_units|Done" "$scratch/log" | tail -2 || true
    rm -rf "$scratch"
  fi
done
exit $status
