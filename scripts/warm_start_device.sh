#!/usr/bin/env bash
# One search of issue 59's GPU run in one call of the device tool, with autotune's cache under runs/cache, which a
# warm device machine keeps between calls (runs/ is git-ignored), so the next call's search of the same workload
# starts warm:
#
#   source .whl/env.sh && bash scripts/warm_start_device.sh NAME [autotune search options]
#
# Leaves $OUT/NAME.log (the console) and $OUT/NAME.tgz (the output folder without its compile archives and
# logs/: the tool brings back at most 8 files of 16 MiB); then `scripts/warm_start_bench.py runs/NAME` and
# `scripts/warm_start_compare.py runs/FIRST runs/SECOND` read runs/ in the same or a later call.
set -u
name=$1; shift
export AUTOTUNE_CACHE_DIR=$PWD/runs/cache
python3 -m autotune search "$@" --out "runs/$name" > "$OUT/$name.log" 2>&1
echo "$name: exit $?"
tar czf "$OUT/$name.tgz" --exclude='*.zip' --exclude=logs -C runs "$name"
tail -40 "$OUT/$name.log" | cut -c1-300
