#!/bin/sh
# Installs what partir needs on Debian 12 (when missing) and configures the Meson build in ./build.
# usage: tools/setup.sh [--tests] [extra meson options...]
#   --tests also installs what only tests need: PyTorch (python3-torch), the reference of `recipe vs torch`.
set -eu
cd "$(dirname "$0")/.."
packages="g++ meson ninja-build pkg-config cmake libeigen3-dev nlohmann-json3-dev libcli11-dev libopenmpi-dev openmpi-bin doctest-dev libopenblas-dev libdnnl-dev python3 librsvg2-bin iproute2"
if [ "${1:-}" = "--tests" ]; then
  packages="$packages python3-torch"
  shift
fi
missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing$missing"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
if [ -d build ]; then
  meson setup --reconfigure build "$@" >/dev/null
else
  # Meson finds nvcc (for the GPU backend) only on PATH: point it at CUDA_HOME's when PATH lacks one.
  nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
  if ! command -v nvcc >/dev/null 2>&1 && [ -x "$nvcc" ]; then
    mkdir -p build
    printf "[binaries]\ncuda = '%s'\n" "$nvcc" > build/cuda-native.ini
    set -- --native-file build/cuda-native.ini "$@"
  fi
  meson setup build "$@" >/dev/null
fi
echo "setup: build/ configured"
