#!/bin/sh
# Packs what the GPU checks (scripts/gpu/run-checks.sh) need on a machine
# that has a GPU but none of kvferry's dependencies: the built programs, the
# Debian libraries they load, Debian's UCX (no CUDA) and, when given, a UCX
# built with CUDA (scripts/gpu/README.md says how to build one).
#
#   scripts/gpu/bundle.sh BUILD_DIR OUT_DIR [UCX_CUDA_PREFIX [CUDART_DIR]]
#
# OUT_DIR/bin: engine_test_gpu, kvferry, kvferry-testpeer, libkvferry.so*
# OUT_DIR/lib: the shared libraries they need, but glibc's and UCX's
# OUT_DIR/ucx-deb: this machine's UCX with its transport modules (ucx/)
# OUT_DIR/ucx-cuda: the CUDA-enabled UCX and libcudart.so.* from CUDART_DIR
set -eu
build=$1 out=$2 ucx_cuda=${3:-} cudart=${4:-}
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/ucx-deb/ucx"
cp -a "$build"/tests/engine_test_gpu "$build"/kvferry "$build"/kvferry-testpeer "$build"/libkvferry.so* "$out/bin/"
# Shared libraries of the programs and of Debian's UCX modules, but the C
# library's own (the GPU machine has a newer glibc) and UCX's (below).
deps() { ldd "$@" 2>/dev/null | awk '$3 ~ /^\// {print $3}' | sort -u; }
for l in $(deps "$out"/bin/engine_test_gpu "$out"/bin/kvferry "$out"/bin/kvferry-testpeer \
  /usr/lib/x86_64-linux-gnu/ucx/*.so.0); do
  case $(basename "$l") in
  libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | ld-linux* | libgcc_s.so* | libstdc++.so*) ;;
  libresolv.so* | libucp.so* | libucs.so* | libuct.so* | libucm.so* | libuct_*.so* | libkvferry.so*) ;;
  *) cp -L "$l" "$out/lib/" ;;
  esac
done
for n in ucp ucs uct ucm; do cp -L /usr/lib/x86_64-linux-gnu/lib$n.so.0 "$out/ucx-deb/"; done
cp -L /usr/lib/x86_64-linux-gnu/ucx/*.so.0 "$out/ucx-deb/ucx/"
if [ -n "$ucx_cuda" ]; then
  mkdir -p "$out/ucx-cuda/ucx"
  for n in ucp ucs uct ucm; do cp -L "$ucx_cuda/lib/lib$n.so.0" "$out/ucx-cuda/"; done
  cp -L "$ucx_cuda"/lib/ucx/*.so.0 "$out/ucx-cuda/ucx/"
  cp -L "$ucx_cuda/bin/ucx_info" "$out/ucx-cuda/"
  [ -z "$cudart" ] || cp -L "$cudart"/libcudart.so.* "$out/ucx-cuda/" 2>/dev/null || true
fi
du -sh "$out"
