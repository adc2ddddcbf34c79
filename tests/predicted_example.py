#!/usr/bin/env python3
"""mlp_train prints the simulator's prediction and the measured figures: under several schedules the
predicted peak memory per device equals the measured one (the simulator's liveness is the executor's), in
f32 and under the bf16 and f16 precision policies;
time is only checked to be printed (timings never gate a unit test).
usage: predicted_example.py MLP_TRAIN"""
import re
import subprocess
import sys

exe = sys.argv[1]
for mesh, schedule, precision in [("batch=1", "none", "f32"), ("batch=2", "bp", "f32"),
                                  ("batch=2,model=2", "bp,mp", "f32"), ("batch=4", "bp,z2", "f32"),
                                  ("batch=2,model=2", "bp,mp,z3", "f32"), ("batch=1", "none", "bf16"),
                                  ("batch=2,model=2", "bp,mp,z3", "bf16"), ("batch=4", "bp,z2", "f16")]:
    out = subprocess.run([exe, "--steps", "3", "--mesh", mesh, "--schedule", schedule, "--precision", precision],
                         capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        sys.exit(f"FAIL: {mesh} {schedule} {precision} exited {out.returncode}:\n{text}")
    if not re.search(r"^predicted \(profile cpu, .*\): step [0-9.]+ (us|ms|s), peak ", text, re.M):
        sys.exit(f"FAIL: {mesh} {schedule} {precision}: no prediction line:\n{text}")
    m = re.search(r"^measured: step .* predicted/measured: time ([0-9.e+-]+), memory ([0-9.e+-]+)$", text, re.M)
    if not m:
        sys.exit(f"FAIL: {mesh} {schedule} {precision}: no measured line:\n{text}")
    if float(m[2]) != 1.0:
        sys.exit(f"FAIL: {mesh} {schedule} {precision}: predicted peak memory / measured = {m[2]}, expected 1:\n{text}")
    print(f"ok: {mesh} {schedule} {precision}: predicted/measured time {m[1]}, memory {m[2]}")
