#!/usr/bin/env bash
# Check that every C source and header under src/, include/ and tests/
# (plus bench/, if it holds any) is formatted as .clang-format says.
# Prints each difference as a clang-format warning and exits non-zero if
# there is any; changes nothing. To fix a file: clang-format -i FILE.
# CLANG_FORMAT selects the binary (default: clang-format).
set -euo pipefail
cd "$(dirname "$0")/.."
cf=${CLANG_FORMAT:-clang-format}
if ! command -v "$cf" >/dev/null 2>&1; then
  echo "check-format: $cf not found (Debian: apt-get install clang-format)" >&2
  exit 2
fi
dirs=()
for d in src include tests bench; do [ -d "$d" ] && dirs+=("$d"); done
mapfile -t files < <(find "${dirs[@]}" -type f \( -name '*.c' -o -name '*.h' \) | sort)
if [ "${#files[@]}" -eq 0 ]; then
  echo "check-format: no C files found" >&2
  exit 2
fi
bad=()
for f in "${files[@]}"; do
  "$cf" --style=file --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ "${#bad[@]}" -ne 0 ]; then
  # Show the warnings of the first few files, then the full list.
  for f in "${bad[@]:0:3}"; do "$cf" --style=file --dry-run -Werror "$f" 2>&1 | head -n 20 || true; done
  printf 'check-format: %d of %d files differ from .clang-format:\n' "${#bad[@]}" "${#files[@]}" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "check-format: fix with: clang-format -i FILE..." >&2
  exit 1
fi
echo "check-format: ${#files[@]} files ok"
