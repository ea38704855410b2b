#!/bin/sh
# Allocations per room on the hot path, in each process of `kvferry bench
# rooms` (the decode manager in the bench, the prefill in kvferry-testpeer):
# runs the same case with R and 3R rooms under bench/alloc_count.c and prints
# (calls at 3R - calls at R) / 2R per process and per call site (file:line).
# Usage: bench/alloc-per-room.sh [BUILD_DIR] [ROOMS] [INFLIGHT] [PAGES]
set -eu
build=${1:-build}
rooms=${2:-2000}
inflight=${3:-64}
pages=${4:-1}
work=$(mktemp -d /tmp/kvferry-alloc.XXXXXX)
cc -O2 -shared -fPIC -o "$work/alloc_count.so" "$(dirname "$0")/alloc_count.c" -ldl
for n in "$rooms" $((rooms * 3)); do
  mkdir -p "$work/$n"
  KVF_ALLOC_COUNT_DIR="$work/$n" KVFERRY_TRANSPORT=${KVFERRY_TRANSPORT:-tcp} LD_PRELOAD="$work/alloc_count.so" \
    "$build/kvferry" bench rooms --room-pages "$pages" --inflight "$inflight" --rooms "$n" --json >/dev/null
done
/usr/bin/python3 - "$work" "$rooms" <<'PY'
import collections, glob, os, subprocess, sys
work, rooms = sys.argv[1], int(sys.argv[2])
def load(d):
    out = {}
    for f in sorted(glob.glob(os.path.join(work, d, "alloc.*")), key=lambda p: int(p.rsplit(".", 1)[1])):
        sites = collections.Counter()
        for line in open(f):
            calls, obj, off = line.split()
            sites[(obj, off)] += int(calls)
        out[len(out)] = sites
    return out
lo, hi = load(str(rooms)), load(str(rooms * 3))
names = {0: "bench (decode manager)", 1: "kvferry-testpeer (prefill manager)"}
for p in sorted(hi):
    diff = {k: (hi[p][k] - lo.get(p, {}).get(k, 0)) / (2 * rooms) for k in hi[p]}
    print("%s: %.3f allocations per room" % (names.get(p, "process %d" % p), sum(diff.values())))
    for (obj, off), v in sorted(diff.items(), key=lambda kv: -kv[1]):
        if v < 0.05:
            break
        where = subprocess.run(["addr2line", "-f", "-e", obj, off], capture_output=True, text=True).stdout.split()
        print("  %5.2f  %s  %s" % (v, " ".join(where) or off, os.path.basename(obj)))
PY
rm -rf "$work"
