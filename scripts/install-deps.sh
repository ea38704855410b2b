#!/usr/bin/env bash
# Installs the Debian packages kvferry needs to build and test, or, when not
# root, prints the exact command to run. Safe to call repeatedly: it does
# nothing when everything is present.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config clang libclang-rt-14-dev clang-format
  libzmq3-dev libmicrohttpd-dev libcurl4-openssl-dev libjansson-dev libcmocka-dev libsodium-dev libxxhash-dev
  libucx-dev ucx-utils
  python3 python3-zmq python3-pytest python3-requests python3-numpy python3-prometheus-client
  iproute2
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "kvferry: missing Debian packages: ${missing[*]}" >&2
if [ "$(id -u)" -eq 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "kvferry: run this as root, then retry:" >&2
  echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
