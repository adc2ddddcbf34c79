#!/bin/sh
# Builds and runs tests/consumer against partir as a Meson subproject (with the GEMM engines found: oneDNN
# where libdnnl-dev is installed), header-only and with libpartir, and from an installed build with
# -Dgemm=eigen (on Eigen alone: no engine library to link) through partir.pc and partir-compiled.pc.
# Each run checks which GEMM engine it got; then the separately compiled mode's error for a TU that includes
# the kernels themselves.
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
expected=eigen
[ -f /usr/include/oneapi/dnnl/dnnl.hpp ] && expected=onednn
for dep in partir partir-compiled; do
  quiet meson setup "$work/sub/$dep" "$work/sub" -Dmode=subproject -Dpartir=$dep
  quiet ninja -C "$work/sub/$dep"
  "$work/sub/$dep/consumer" "$expected"
done

# 2. installed headers, libpartir, partir.pc and partir-compiled.pc
quiet meson setup "$work/partir-build" "$src" --prefix="$work/prefix" -Dtests=false -Dexamples=false -Dbench=false -Dmpi=disabled -Dnccl=disabled -Dgemm=eigen
quiet meson install -C "$work/partir-build"
pc=$(dirname "$(find "$work/prefix" -name partir.pc)")
cp -r "$src/tests/consumer" "$work/inst"
for dep in partir partir-compiled; do
  PKG_CONFIG_PATH="$pc" quiet meson setup "$work/inst/$dep" "$work/inst" -Dmode=installed -Dpartir=$dep
  quiet ninja -C "$work/inst/$dep"
  "$work/inst/$dep/consumer" eigen
done

# 3. separately compiled, a TU that includes the kernels' definitions gets partir's error, not duplicate symbols
printf '#include <partir/runtime/kernels/kernels.hpp>\n' > "$work/kernels_tu.cpp"
if ${CXX:-c++} -std=c++20 -E -DPARTIR_SEPARATE_COMPILATION -I"$src/include" -isystem /usr/include/eigen3 \
    "$work/kernels_tu.cpp" >/dev/null 2>"$work/log"; then
  echo "kernels.hpp under PARTIR_SEPARATE_COMPILATION preprocessed without the expected #error"; exit 1
fi
grep -q "kernels.hpp holds what libpartir compiles" "$work/log" || { cat "$work/log"; exit 1; }
echo "consumer: subproject ($expected GEMMs) and installed (eigen GEMMs), header-only and with libpartir: all build and run; kernels.hpp in a separately compiled TU: refused"
