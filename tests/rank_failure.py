#!/usr/bin/env python3
"""Runs mpi_rank_failure under mpirun with a timeout: the job must end (no hang in a collective) with a
non-zero exit and rank 2's error message.  usage: rank_failure.py MPIRUN PROGRAM"""
import subprocess
import sys

mpirun, program = sys.argv[1], sys.argv[2]
expected = "error: rank 2: execute train_step (device 2): input 'x' expects f32[16,8], got f32[16,9]"
try:
    run = subprocess.run([mpirun, "--oversubscribe", "-np", "4", program], capture_output=True, text=True, timeout=60)
except subprocess.TimeoutExpired:
    sys.exit("FAIL: the job hung (still running after 60 s): one rank's error did not end the others")
output = run.stdout + run.stderr
print(output)
if run.returncode == 0:
    sys.exit("FAIL: exit status 0 although rank 2 failed")
if expected not in output:
    sys.exit("FAIL: the output lacks rank 2's message: " + expected)
print("ok: exit status", run.returncode, "with rank 2's message")
