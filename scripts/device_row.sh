#!/usr/bin/env bash
# One issue-35 row of scripts/search_yield.py in one call of the device tool, its whole output tarred
# into $OUT (the tool brings back at most 8 files, two folders deep):
#
#   git rev-parse --short HEAD > .gpu_commit     # here, before the call (git-ignored through .git/info/exclude)
#   source .whl/env.sh && bash scripts/device_row.sh NAME MODEL [search_yield options] -- [autotune search options]
#
# e.g. bash scripts/device_row.sh gpt2 hf:gpt2 --plain-recipe-batch 64 -- --seq-len 1024
# Environment: BUDGET (default 5m), ROW_TIMEOUT (seconds, default 500: a 5-minute row took 413-520 s on
# an H100, its hand loop and `autotune verify` included). Leaves $OUT/NAME.tgz and $OUT/NAME.log; prints
# the commit (the device's copy of the tree carries an older git HEAD, which results.md then names).
set -u
name=$1; model=$2; shift 2
sy=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do sy+=("$1"); shift; done
[ $# -gt 0 ] && shift
echo "row $name: commit $(cat .gpu_commit 2>/dev/null || echo unknown)"
timeout "${ROW_TIMEOUT:-500}" python3 scripts/search_yield.py --models "$model" --budgets "${BUDGET:-5m}" --verify 1 \
  --out "$OUT/sy" "${sy[@]}" -- "$@" > "$OUT/$name.log" 2>&1
echo "row $name: exit $?"
tail -25 "$OUT/$name.log" | cut -c1-300
tar czf "$OUT/$name.tgz" -C "$OUT" sy "$name.log" && rm -rf "$OUT/sy"
