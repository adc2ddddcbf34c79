#!/bin/sh
# Packs what tools/gpu_check.sh needs to build on a GPU machine that has CUDA, a C++ compiler, Meson and ninja
# but none of partir's header-only dependencies and no network (the device tool's machines): Eigen,
# nlohmann-json, CLI11 and doctest headers with pkg-config files relative to themselves, and pkgconf itself.
# Run here after tools/setup.sh; it writes .devdeps/ (ignored by git), which gpu_check.sh puts on its paths.
set -eu
cd "$(dirname "$0")/.."
rm -rf .devdeps
mkdir -p .devdeps/include .devdeps/pkgconfig .devdeps/bin .devdeps/lib
cp -r /usr/include/eigen3 /usr/include/nlohmann /usr/include/CLI /usr/include/doctest .devdeps/include/
rm -rf .devdeps/include/eigen3/unsupported  # not used; a third of Eigen's size
pc() {  # name version cflags
  printf 'prefix=${pcfiledir}/..\nName: %s\nDescription: %s for partir on the GPU machine\nVersion: %s\nCflags: %s\n' \
    "$1" "$1" "$2" "$3" > ".devdeps/pkgconfig/$1.pc"
}
pc eigen3 "$(pkg-config --modversion eigen3)" '-I${prefix}/include/eigen3'
pc nlohmann_json "$(pkg-config --modversion nlohmann_json)" '-I${prefix}/include'
pc CLI11 "$(pkg-config --modversion CLI11)" '-I${prefix}/include'
pc doctest "$(awk '/^#define DOCTEST_VERSION_(MAJOR|MINOR|PATCH) / {v = v (v == "" ? "" : ".") $3} END {print v}' /usr/include/doctest/doctest.h)" '-I${prefix}/include'
cp "$(command -v pkgconf)" .devdeps/bin/pkg-config
cp "$(ldd "$(command -v pkgconf)" | awk '/libpkgconf/ {print $3}')" .devdeps/lib/
du -sh .devdeps
