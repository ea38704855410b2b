#!/bin/sh
# Fails when libkvferry exports a name that could collide with another
# library in the same process.
#   scripts/check-symbols.sh BUILD_DIR            shared library: every dynamic
#                                                  symbol it defines starts with kvf_;
#                                                  and what ships carries no test code:
#                                                  libkvferry.so and the kvferry command
#                                                  hold no KVFERRY_TEST_ string, and the
#                                                  command neither imports nor contains
#                                                  an internal kvf__ symbol (it uses the
#                                                  public API of the shared library)
#   scripts/check-symbols.sh --static BUILD_DIR   static archive: every global
#                                                  symbol it defines starts with kvf_ or kvf__
set -eu
mode=shared
if [ "${1:-}" = "--static" ]; then
  mode=static
  shift
fi
dir=${1:?usage: check-symbols.sh [--static] BUILD_DIR}
if [ "$mode" = shared ]; then
  lib=$(ls "$dir"/libkvferry.so 2>/dev/null || true)
  [ -n "$lib" ] || { echo "check-symbols: no libkvferry.so in $dir" >&2; exit 2; }
  syms=$(nm -D --defined-only "$lib" | awk 'NF >= 3 {print $3}')
else
  lib=$(ls "$dir"/libkvferry.a 2>/dev/null || true)
  [ -n "$lib" ] || { echo "check-symbols: no libkvferry.a in $dir" >&2; exit 2; }
  # Global (upper-case type letter) defined symbols of every member.
  syms=$(nm -g --defined-only "$lib" | awk 'NF >= 3 && $2 ~ /^[A-Z]$/ {print $3}')
fi
[ -n "$syms" ] || { echo "check-symbols: $lib defines no symbols" >&2; exit 2; }
bad=$(printf '%s\n' "$syms" | grep -v '^kvf_' || true)
count=$(printf '%s\n' "$syms" | wc -l)
if [ -n "$bad" ]; then
  echo "check-symbols: $lib defines $(printf '%s\n' "$bad" | wc -l) of $count symbols without the kvf_ prefix:" >&2
  printf '  %s\n' $bad >&2
  exit 1
fi
echo "check-symbols: $lib: all $count symbols start with kvf_"
[ "$mode" = shared ] || exit 0

# No test hook in what ships (issue 23 item 4): tests arm theirs through the
# testing library, which only the test peer and test builds link.
cli=$dir/kvferry
[ -f "$cli" ] || { echo "check-symbols: no kvferry command in $dir" >&2; exit 2; }
for f in "$lib" "$cli"; do
  if grep -q KVFERRY_TEST_ "$f"; then
    echo "check-symbols: $f contains a KVFERRY_TEST_ string (a test hook in what ships)" >&2
    exit 1
  fi
done
internal=$(nm -D --undefined-only "$cli" | awk '{print $NF}' | grep '^kvf__' || true)
if [ -n "$internal" ]; then
  echo "check-symbols: $cli imports internal symbols:" >&2
  printf '  %s\n' $internal >&2
  exit 1
fi
linked=$(nm --defined-only "$cli" 2>/dev/null | awk 'NF >= 3 {print $3}' | grep '^kvf_' || true)
if [ -n "$linked" ]; then
  echo "check-symbols: $cli contains library code (link it with the shared library, public API only):" >&2
  printf '  %s\n' $linked | head -n 20 >&2
  exit 1
fi
echo "check-symbols: $lib and $cli: no test hook; the command uses the public API only"
