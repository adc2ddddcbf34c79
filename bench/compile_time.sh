#!/bin/sh
# How long a user waits for the compiler: `#include <partir/partir.hpp>` with an empty main, and a small user
# program (tests/consumer/consumer.cpp: a train step, three tactics, explain, simulate, 4 threads), at -O2 and
# -O0, header-only (the default) and separately compiled (PARTIR_SEPARATE_COMPILATION: the kernels come from
# libpartir, compiled once: its own line), with the flags partir.pc gives and the GEMM engines this machine has.
# The last line links the separately compiled program and runs it, so the mode is checked, not only timed.
# usage: bench/compile_time.sh [CXX]     (from the source root; prints seconds per case)
set -eu
cxx=${1:-g++}
cd "$(dirname "$0")/.."
flags="-std=c++20 -march=native -Iinclude -isystem /usr/include/eigen3"
libs="-pthread"
if [ -f /usr/include/oneapi/dnnl/dnnl.hpp ]; then flags="$flags -DPARTIR_USE_ONEDNN"; libs="$libs -ldnnl -lgomp"; fi
if [ -d /usr/include/x86_64-linux-gnu/openblas-pthread ]; then
  flags="$flags -DPARTIR_USE_BLAS -I/usr/include/x86_64-linux-gnu/openblas-pthread"; libs="$libs -lopenblas"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '#include <partir/partir.hpp>\nint main() {}\n' > "$work/include_only.cpp"
# A tool that partitions and prints plans, no lowering or simulation: presets no longer pull in the search.
printf '#include <partir/tactics/partition.hpp>\n#include <partir/tactics/presets.hpp>\n#include <partir/dsl/nn.hpp>
#include <partir/autodiff/train_step.hpp>\n#include <iostream>\nint main() {
  partir::nn::Mlp m{"params/mlp", {8, 16, 8}};
  auto step = partir::train_step([&](partir::Tensor x, partir::Tensor y) { return partir::mse(m(x), y); },
                                 partir::Adam{1e-3}, {{"x", {4, 8}}, {"y", {4, 8}}});
  std::cout << partir::partition(step, partir::Mesh{{"batch", 2}}, {partir::data_parallel("batch"), partir::zero3("batch")}).program().name();
}\n' > "$work/presets_only.cpp"
seconds() {  # compile once into $work/$1, print the wall time
  out=$1
  shift
  start=$(date +%s%N)
  $cxx $flags "$@" -c -o "$work/$out"
  awk -v ns=$(($(date +%s%N) - start)) 'BEGIN { print ns / 1e9 }'
}
row() { printf "%-58s %8.1f\n" "$1" "$2"; }
sep=-DPARTIR_SEPARATE_COMPILATION
echo "compiler: $($cxx --version | head -1)"
printf "%-58s %8s\n" "case" "seconds"
row "header-only: include partir.hpp, empty main, -O2" "$(seconds a.o -O2 "$work/include_only.cpp")"
row "header-only: include partir.hpp, empty main, -O0" "$(seconds a.o -O0 "$work/include_only.cpp")"
row "header-only: small user program (consumer.cpp), -O2" "$(seconds a.o -O2 tests/consumer/consumer.cpp)"
row "header-only: small user program (consumer.cpp), -O0" "$(seconds a.o -O0 tests/consumer/consumer.cpp)"
row "  of it parsing and instantiation" "$(seconds a.o -fsyntax-only tests/consumer/consumer.cpp)"
row "libpartir (src/libpartir.cpp, -O2), once per build" "$(seconds kernels.o -O2 src/libpartir.cpp)"
row "separate: include partir.hpp, empty main, -O2" "$(seconds a.o $sep -O2 "$work/include_only.cpp")"
row "separate: include partir.hpp, empty main, -O0" "$(seconds a.o $sep -O0 "$work/include_only.cpp")"
row "separate: small user program (consumer.cpp), -O2" "$(seconds consumer.o $sep -O2 tests/consumer/consumer.cpp)"
row "separate: small user program (consumer.cpp), -O0" "$(seconds a.o $sep -O0 tests/consumer/consumer.cpp)"
row "  of it parsing and instantiation" "$(seconds a.o $sep -fsyntax-only tests/consumer/consumer.cpp)"
row "separate: presets + partition only (no simulate), -O0" "$(seconds a.o $sep -O0 "$work/presets_only.cpp")"
$cxx "$work/consumer.o" "$work/kernels.o" $libs -o "$work/consumer"
"$work/consumer" > "$work/run.log"
echo "separate: consumer linked with libpartir ran: $(tail -1 "$work/run.log")"
