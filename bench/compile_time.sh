#!/bin/sh
# How long a user waits for the compiler: `#include <partir/partir.hpp>` with an empty main, and a small user
# program (tests/consumer/consumer.cpp: a train step, three tactics, explain, simulate, 4 threads), at -O2 and
# -O0, header-only (today's only mode), with the flags partir.pc gives and the GEMM engines this machine has.
# usage: bench/compile_time.sh [CXX]     (from the source root; prints seconds per case)
set -eu
cxx=${1:-g++}
cd "$(dirname "$0")/.."
flags="-std=c++20 -march=native -Iinclude -isystem /usr/include/eigen3"
[ -f /usr/include/oneapi/dnnl/dnnl.hpp ] && flags="$flags -DPARTIR_USE_ONEDNN"
[ -d /usr/include/x86_64-linux-gnu/openblas-pthread ] &&
  flags="$flags -DPARTIR_USE_BLAS -I/usr/include/x86_64-linux-gnu/openblas-pthread"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '#include <partir/partir.hpp>\nint main() {}\n' > "$work/include_only.cpp"
seconds() {  # compile once, print the wall time
  start=$(date +%s%N)
  $cxx $flags "$@" -c -o "$work/out.o"
  awk -v ns=$(($(date +%s%N) - start)) 'BEGIN { print ns / 1e9 }'
}
echo "compiler: $($cxx --version | head -1)"
printf "%-40s %8s\n" "case" "seconds"
printf "%-40s %8.1f\n" "include partir.hpp, empty main, -O2" "$(seconds -O2 "$work/include_only.cpp")"
printf "%-40s %8.1f\n" "include partir.hpp, empty main, -O0" "$(seconds -O0 "$work/include_only.cpp")"
printf "%-40s %8.1f\n" "small user program (consumer.cpp), -O2" "$(seconds -O2 tests/consumer/consumer.cpp)"
printf "%-40s %8.1f\n" "small user program (consumer.cpp), -O0" "$(seconds -O0 tests/consumer/consumer.cpp)"
printf "%-40s %8.1f\n" "  of it parsing and instantiation" "$(seconds -fsyntax-only tests/consumer/consumer.cpp)"
