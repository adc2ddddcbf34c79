#!/usr/bin/env python3
"""Runs mpi_rank_failure under mpirun with a timeout, in each of its modes: the job must end (no hang in a
collective) with a non-zero exit and rank 2's error message (or, killed, mpirun's word of it), and leave nothing
behind in /dev/shm.  usage: rank_failure.py MPIRUN PROGRAM"""
import os
import subprocess
import sys

mpirun, program = sys.argv[1], sys.argv[2]
cases = [
    ([], "error: rank 2: execute train_step (device 2): input 'x' expects f32[16,8], got f32[16,9]"),
    # Rank 2 fails with collectives on its communication stream; the message names the failing instruction.
    (["in-flight"], "error: rank 2: execute train_step (device 2): %"),
    # Rank 2 dies while the others spin in a shared-memory all_reduce waiting for it.
    (["killed"], "exited on signal 9"),
]
shm = "/dev/shm"
for args, expected in cases:
    before = set(os.listdir(shm)) if os.path.isdir(shm) else set()
    try:
        run = subprocess.run([mpirun, "--oversubscribe", "-np", "4", program] + args, capture_output=True, text=True,
                             timeout=60)
    except subprocess.TimeoutExpired:
        sys.exit(f"FAIL {args}: the job hung (still running after 60 s): one rank's error did not end the others")
    output = run.stdout + run.stderr
    print(output)
    if run.returncode == 0:
        sys.exit(f"FAIL {args}: exit status 0 although rank 2 failed")
    if expected not in output:
        sys.exit(f"FAIL {args}: the output lacks rank 2's message: " + expected)
    left = (set(os.listdir(shm)) if os.path.isdir(shm) else set()) - before
    if left:
        sys.exit(f"FAIL {args}: the job left {sorted(left)} in {shm}")
    print("ok", args, ": exit status", run.returncode, "with rank 2's message, nothing left in", shm)
