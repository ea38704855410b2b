#!/bin/sh
# Installs the build in BUILD_DIR into a temporary prefix, then builds and
# runs the consumer program against that install: with
# `pkg-config --cflags --libs kvferry` (and the static archive with the
# dependencies kvferry.pc lists), and with a CMake project that calls
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
# The static archive with its dependencies as kvferry.pc names them
# (Requires.private modules, linked as shared libraries: Debian's static
# .pc chains are incomplete, e.g. libcurl's, so `--static` cannot be used
# here, and Libs.private).
requires=$(pkg-config --print-requires-private kvferry | awk '{print $1}' | tr '\n' ' ')
test -n "$requires"
# shellcheck disable=SC2086
dep_libs=$(pkg-config --libs $requires)
libs_private=$(sed -n 's/^Libs.private: //p' "$pc")
# shellcheck disable=SC2086
"$cc" -std=c11 -Wall -Wextra -Werror -o "$tmp/consumer_pc_static" "$here/consumer.c" \
  $(pkg-config --cflags kvferry) "$libdir/libkvferry.a" $dep_libs $libs_private
"$tmp/consumer_pc_static"

echo "== find_package"
cmake -S "$here" -B "$tmp/cmake" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_BUILD_RPATH="$libdir" >"$tmp/cmake.log" || { cat "$tmp/cmake.log"; exit 1; }
cmake --build "$tmp/cmake" >"$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }
"$tmp/cmake/consumer_shared"
"$tmp/cmake/consumer_static"
echo "run.sh: install consumer OK (pkg-config shared and static, find_package shared and static)"
