#!/bin/sh
# Builds and runs tests/consumer against partir as a Meson subproject (with the GEMM engines found: oneDNN
# where libdnnl-dev is installed) and from an installed partir.pc built with -Dgemm=eigen (header-only on
# Eigen: no engine library to link). Each run checks which GEMM engine it got.
# usage: run.sh SOURCE_ROOT WORK_DIR
set -eu
src=$(cd "$1" && pwd)
work=$2
rm -rf "$work" && mkdir -p "$work"
quiet() { "$@" >"$work/log" 2>&1 || { cat "$work/log"; exit 1; }; }

# 1. subproject
cp -r "$src/tests/consumer" "$work/sub"
mkdir -p "$work/sub/subprojects"
ln -s "$src" "$work/sub/subprojects/partir"
quiet meson setup "$work/sub/build" "$work/sub" -Dmode=subproject
quiet ninja -C "$work/sub/build"
expected=eigen
[ -f /usr/include/oneapi/dnnl/dnnl.hpp ] && expected=onednn
"$work/sub/build/consumer" "$expected"

# 2. installed headers + partir.pc
quiet meson setup "$work/partir-build" "$src" --prefix="$work/prefix" -Dtests=false -Dexamples=false -Dbench=false -Dmpi=disabled -Dnccl=disabled -Dgemm=eigen
quiet meson install -C "$work/partir-build"
pc=$(dirname "$(find "$work/prefix" -name partir.pc)")
cp -r "$src/tests/consumer" "$work/inst"
PKG_CONFIG_PATH="$pc" quiet meson setup "$work/inst/build" "$work/inst" -Dmode=installed
quiet ninja -C "$work/inst/build"
"$work/inst/build/consumer" eigen
echo "consumer: subproject ($expected GEMMs) and installed partir.pc (eigen GEMMs) both build and run"
