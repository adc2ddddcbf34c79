#!/bin/sh
# The GPU backend's checks on a machine with an NVIDIA GPU (written for the one H200 the device tool lends;
# about 8 minutes with 16 cores). Builds only what it runs, in build-gpu/, then:
#   1. the GPU tests (test_gpu --host, then every kernel against the Eigen kernel, and an Adam MLP step);
#   2. bench/collectives --backend nccl on every GPU present (one GPU: a group of 1, so busbw is 0 and
#      the times are NCCL's local-copy latency);
#   3. gpt_train on the GPU against the same run on CPU threads (same seed: the losses must agree);
#   4. mlp_train with large GEMMs on the GPU, fp32 and TF32: step time and achieved TFLOP/s.
# Logs and a summary go to $OUT (the device tool's folder) or gpu-check-out/.
# usage: tools/gpu_check.sh [extra meson options]
set -u
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
jobs="$(nproc 2>/dev/null || echo 4)"

say "# gpu_check $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$summary"

# 1. build (meson + ninja + eigen + doctest must be installed; there is no network on the device machine)
for tool in meson ninja nvcc; do
  command -v "$tool" >/dev/null || { say "FAIL: $tool is not installed"; exit 1; }
done
if [ -d build-gpu ]; then
  meson setup --reconfigure build-gpu -Dnccl=enabled "$@" > "$out/setup.log" 2>&1
else
  meson setup build-gpu -Dnccl=enabled "$@" > "$out/setup.log" 2>&1
fi || { say "FAIL: meson setup (see setup.log)"; tail -20 "$out/setup.log"; exit 1; }
start=$(date +%s)
timeout 300 ninja -C build-gpu -j"$jobs" tests/test_gpu bench/collectives examples/gpt_train examples/mlp_train \
  > "$out/build.log" 2>&1 || { say "FAIL: build (see build.log)"; tail -30 "$out/build.log"; exit 1; }
say "build: $(( $(date +%s) - start )) s"

status=0
# 2. tests
timeout 60 build-gpu/tests/test_gpu --host > "$out/test_gpu_host.log" 2>&1
say "test_gpu --host: exit $? ($(tail -2 "$out/test_gpu_host.log" | head -1))"
timeout 180 build-gpu/tests/test_gpu > "$out/test_gpu.log" 2>&1
rc=$?
say "test_gpu: exit $rc ($(grep -E 'test cases:' "$out/test_gpu.log"))"
[ $rc -eq 0 ] || { status=1; grep -E "ERROR|CHECK|error" "$out/test_gpu.log" | head -20 | tee -a "$summary"; }

# 3. collectives on every GPU present
timeout 120 build-gpu/bench/collectives --backend nccl -b 8 -e 256M -f 4 -o all -n 20 -w 5 -r 2 \
  --json "$out/collectives_nccl.json" > "$out/collectives_nccl.txt" 2>&1
say "collectives --backend nccl: exit $?"
grep -E "^  (all_reduce|all_gather)" "$out/collectives_nccl.txt" | tail -4 | tee -a "$summary"

# 4. gpt_train: GPU vs CPU threads, same seed and steps
steps=60
timeout 90 build-gpu/examples/gpt_train --backend nccl --steps $steps --log-every 1 --report json \
  --report-file "$out/gpt_nccl.json" > "$out/gpt_nccl.txt" 2>&1
say "gpt_train --backend nccl: exit $? ($(tail -1 "$out/gpt_nccl.txt"))"
timeout 120 build-gpu/examples/gpt_train --backend threads --steps $steps --log-every 1 --report json \
  --report-file "$out/gpt_cpu.json" > "$out/gpt_cpu.txt" 2>&1
say "gpt_train --backend threads: exit $? ($(tail -1 "$out/gpt_cpu.txt"))"
gpu_loss=$(awk '/^final loss/ {print $3}' "$out/gpt_nccl.txt")
cpu_loss=$(awk '/^final loss/ {print $3}' "$out/gpt_cpu.txt")
if [ -n "$gpu_loss" ] && [ -n "$cpu_loss" ]; then
  verdict=$(awk -v g="$gpu_loss" -v c="$cpu_loss" 'BEGIN { d = g - c; if (d < 0) d = -d;
    printf "|gpu - cpu| = %.2e (%s, tolerance 1e-2 relative)", d, d <= 1e-2 * (c < 0 ? -c : c) ? "agree" : "DIFFER" }')
  say "gpt_train final loss: gpu $gpu_loss, cpu $cpu_loss: $verdict"
  echo "$verdict" | grep -q DIFFER && status=1
else
  status=1
fi
for f in gpt_nccl gpt_cpu; do  # median step time after the first 5 steps
  awk '/^step / && $2 > 5 {print $6}' "$out/$f.txt" | sort -n | awk -v f=$f '{a[NR]=$1} END { if (NR) print f " median step ms " a[int((NR+1)/2)] }' | tee -a "$summary"
done

# 5. MLP with large GEMMs: features 1024, hidden 4096, batch 4096: 6 * batch * (f*h + h*h + h*f) flops a step.
# Step times include copying parameters and Adam state to and from the host (the executor's inputs and
# outputs are host arrays), so TFLOP/s is a lower bound on the kernels' rate.
flops=$(awk 'BEGIN { b = 4096; f = 1024; h = 4096; printf "%.0f", 6 * b * (f*h + h*h + h*f) }')
for tf32 in 0 1; do
  PARTIR_CUBLAS_TF32=$tf32 timeout 90 build-gpu/examples/mlp_train --backend nccl --mesh batch=1 --schedule none --no-check --steps 12 --batch 4096 \
    --features 1024 --hidden 4096 > "$out/mlp_tf32_$tf32.txt" 2>&1
  rc=$?
  awk '/^step / && $2 > 2 {print $6}' "$out/mlp_tf32_$tf32.txt" | sort -n |
    awk -v fl="$flops" -v t=$tf32 -v rc=$rc '{a[NR]=$1} END { if (NR) { m = a[int((NR+1)/2)];
      printf "mlp_train (tf32=%d, exit %d): median step %.2f ms, %.1f TFLOP/s (H200 peak: 67 fp32, 495 tf32 dense)\n", t, rc, m, fl / (m / 1e3) / 1e12 }
      else printf "mlp_train (tf32=%d): exit %d, no steps\n", t, rc }' | tee -a "$summary"
done

say "gpu_check: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
