#!/bin/sh
# Installs the build in BUILD_DIR into a temporary prefix, then builds and
# runs the consumer program against that install twice: with
# `pkg-config --cflags --libs kvferry` and with a CMake project that calls
# find_package(kvferry) (shared and static targets). Nothing outside the
# temporary directory is touched.
#   run.sh BUILD_DIR CONSUMER_DIR [CC]
set -eu
build=$(cd "$1" && pwd)
here=$(cd "$2" && pwd)
cc=${3:-cc}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvferry-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; exit 1; }
test -f "$prefix/include/kvferry.h"
pc=$(find "$prefix" -name kvferry.pc | head -n 1)
test -n "$pc" || { echo "run.sh: kvferry.pc not installed" >&2; exit 1; }
libdir=$(dirname "$(dirname "$pc")")

echo "== pkg-config"
export PKG_CONFIG_PATH="$(dirname "$pc")${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
flags=$(pkg-config --cflags --libs kvferry)
echo "pkg-config --cflags --libs kvferry: $flags"
# shellcheck disable=SC2086
"$cc" -std=c11 -Wall -Wextra -Werror -o "$tmp/consumer_pc" "$here/consumer.c" $flags -Wl,-rpath,"$libdir"
"$tmp/consumer_pc"

echo "== find_package"
cmake -S "$here" -B "$tmp/cmake" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_BUILD_RPATH="$libdir" >"$tmp/cmake.log" || { cat "$tmp/cmake.log"; exit 1; }
cmake --build "$tmp/cmake" >"$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }
"$tmp/cmake/consumer_shared"
"$tmp/cmake/consumer_static"
echo "run.sh: install consumer OK (pkg-config, find_package shared and static)"
