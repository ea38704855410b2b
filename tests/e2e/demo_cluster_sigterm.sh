#!/bin/sh
# `kvferry demo --cluster`: a SIGTERM while the rank processes start ends the
# run at once, through its cleanup ("demo FAILED: interrupted"), instead of
# after each rank's 120 s start-up wait. The ranks here are stand-ins that
# never say `ready` (they end on their stdin's EOF, as a rank does).
# Usage: demo_cluster_sigterm.sh KVFERRY_CLI
cli=$1
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
printf '#!/bin/sh\nread x\n' >"$dir/peer"
chmod +x "$dir/peer"
KVFERRY_TESTPEER="$dir/peer" "$cli" demo --cluster 1x1 --short --transport tcp >"$dir/out" 2>&1 &
pid=$!
# Its handlers are set once it says it is starting the processes.
i=0
until grep -q 'starting the processes' "$dir/out"; do
  i=$((i + 1))
  if [ $i -gt 600 ] || ! kill -0 $pid 2>/dev/null; then
    echo "the demo did not start its processes:"; cat "$dir/out"; kill -KILL $pid 2>/dev/null; exit 1
  fi
  sleep 0.1
done
sleep 1 # into the wait for the first rank's `ready`
kill -TERM $pid
wait $pid
grep -q 'demo FAILED: interrupted' "$dir/out" || { echo "not ended as interrupted:"; cat "$dir/out"; exit 1; }
