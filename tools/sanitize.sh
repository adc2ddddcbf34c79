#!/bin/sh
# Sanitizer runs: ASan + UBSan over the unit tests, TSan over the tests that drive the threads backend.
# Builds only those tests (in build-asan/ and build-tsan/); MPI and the examples are left out.
#   tools/sanitize.sh [asan|tsan|all] [suite...]     (default: all, every suite)
# CI runs a subset (.ci/run): a sanitized build compiles ~5x slower, and 2 cores have 90 minutes.
set -eu
cd "$(dirname "$0")/.."
which=${1:-all}
[ $# -gt 0 ] && shift
common="-Dexamples=false -Dbench=false -Dmpi=disabled -Dnccl=disabled"
# The fuzzer runs fewer cases here: the sanitizers make each case ~10x slower.
export PARTIR_FUZZ_CASES=${PARTIR_FUZZ_CASES:-200}
# Every collective on the communication stream (runtime/comm/comm_stream.hpp), so the sanitizers see its threads.
export PARTIR_ASYNC=${PARTIR_ASYNC:-all}

run() {  # run DIR SANITIZER MESON_OPTION TESTS...
  dir=$1 sanitizer=$2 option=$3
  shift 3
  [ -d "$dir" ] || meson setup "$dir" -Db_sanitize="$sanitizer" $common $option
  targets=""
  for t in "$@"; do targets="$targets tests/test_$t"; done
  ninja -C "$dir" $targets
  meson test -C "$dir" --no-rebuild --print-errorlogs "$@"
}

export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
if [ "$which" = asan ] || [ "$which" = all ]; then
  run build-asan address,undefined -Dgemm=auto ${@:-ir autodiff sharding comm spmd runtime sim transformer errors fuzz checkpoint}
fi
# TSan cannot see the synchronization inside libgomp (not instrumented), so oneDNN's OpenMP teams would
# report false races: the TSan build runs OpenBLAS's GEMMs, which also makes it CI's build without oneDNN.
if [ "$which" = tsan ] || [ "$which" = all ]; then
  run build-tsan thread -Dgemm=openblas ${@:-comm spmd errors fuzz checkpoint}
fi
