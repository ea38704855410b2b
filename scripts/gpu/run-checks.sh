#!/bin/bash
# The GPU checks, on a machine with an NVIDIA GPU, from the repository root,
# with the bundle scripts/gpu/bundle.sh made (default .gpu). Each step is
# bounded; logs go to stdout and, when OUT is set, to $OUT/<step>.log.
#
#   scripts/gpu/run-checks.sh [BUNDLE] [steps...]
#
# steps (default: all): tests python bench
#   tests   engine_test_gpu with Debian's UCX (no CUDA: the device-memory
#           refusals, with real device memory) and with the CUDA UCX
#           (host->device, device->device, device->host between processes)
#   python  scripts/gpu/kv_device_memory.py: whole KV rooms (prefill and
#           decode managers) into and out of torch CUDA tensors
#   bench   the issue-22 benchmarks on this machine's cores (Debian UCX)
set -u
B=${1:-.gpu}
shift || true
steps=${*:-tests python bench}
deb="$B/ucx-deb:$B/lib:$B/bin"
cuda="$B/ucx-cuda:$B/lib:$B/bin"
log() { if [ -n "${OUT:-}" ]; then tee -a "$OUT/$1.log"; else cat; fi; }
step() {
  local name=$1 limit=$2 lib=$3
  shift 3
  echo "=== $name (limit ${limit}s): $*" | log "$name"
  local t0=$SECONDS
  LD_LIBRARY_PATH=$lib timeout -k 5 "$limit" "$@" 2>&1 | log "$name"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | log "$name"
}
echo "=== machine: $(nproc) cores, $(uname -r); $(nvidia-smi -L 2>&1 | head -2 | tr '\n' ' ')"
for s in $steps; do
  case $s in
  tests)
    step ucx-info 30 "$cuda" sh -c "$B/ucx-cuda/ucx_info -v; $B/ucx-cuda/ucx_info -d | grep -E 'Transport|Memory domain|memory types'"
    step gpu-tests-deb-ucx 90 "$deb" "$B/bin/engine_test_gpu"
    step gpu-tests-cuda-ucx 120 "$cuda" "$B/bin/engine_test_gpu"
    # Without kvferry giving its threads a CUDA context (ucx_cuda.c), to see
    # whether UCX's CUDA transports need it.
    step gpu-tests-cuda-ucx-no-ctx 90 "$cuda" env KVFERRY_UCX_CUDA_CTX=0 \
      KVF_TEST_CASE='*_over_ucx' "$B/bin/engine_test_gpu"
    ;;
  python)
    py="env PYTHONPATH=python KVFERRY_LIB=$B/bin/libkvferry.so python3 -u scripts/gpu/kv_device_memory.py"
    step py-host-to-cuda 60 "$cuda" $py --prefill-device cpu --decode-device cuda
    step py-cuda-to-cuda 60 "$cuda" $py --prefill-device cuda --decode-device cuda
    step py-cuda-to-host 60 "$cuda" $py --prefill-device cuda --decode-device cpu
    step py-cuda-tcp-refused 60 "$cuda" $py --prefill-device cpu --decode-device cuda --transport tcp --requests 2
    ;;
  bench)
    k="$B/bin/kvferry"
    step bench-e2e-verify 120 "$deb" "$k" bench e2e --verify --json
    step bench-fanout 60 "$deb" "$k" bench rooms --fanout-only --json
    step bench-rooms64 60 "$deb" "$k" bench rooms --room-pages 1 --inflight 64 --rooms 30000 --json
    step bench-layerwise 60 "$deb" "$k" bench layerwise --idle-compute --json
    step bench-engine 120 "$deb" "$k" bench engine --json
    ;;
  esac
done
