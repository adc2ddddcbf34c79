#!/usr/bin/env python3
"""mlp_train prints the simulator's prediction and the measured figures: under several schedules the
predicted peak memory per device equals the measured one (the simulator's liveness is the executor's);
time is only checked to be printed (timings never gate a unit test).
usage: predicted_example.py MLP_TRAIN"""
import re
import subprocess
import sys

exe = sys.argv[1]
for mesh, schedule in [("batch=1", "none"), ("batch=2", "bp"), ("batch=2,model=2", "bp,mp"),
                       ("batch=4", "bp,z2"), ("batch=2,model=2", "bp,mp,z3")]:
    out = subprocess.run([exe, "--steps", "3", "--mesh", mesh, "--schedule", schedule],
                         capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        sys.exit(f"FAIL: {mesh} {schedule} exited {out.returncode}:\n{text}")
    if not re.search(r"^predicted \(profile cpu, .*\): step [0-9.]+ (us|ms|s), peak ", text, re.M):
        sys.exit(f"FAIL: {mesh} {schedule}: no prediction line:\n{text}")
    m = re.search(r"^measured: step .* predicted/measured: time ([0-9.e+-]+), memory ([0-9.e+-]+)$", text, re.M)
    if not m:
        sys.exit(f"FAIL: {mesh} {schedule}: no measured line:\n{text}")
    if float(m[2]) != 1.0:
        sys.exit(f"FAIL: {mesh} {schedule}: predicted peak memory / measured = {m[2]}, expected 1:\n{text}")
    print(f"ok: {mesh} {schedule}: predicted/measured time {m[1]}, memory {m[2]}")
