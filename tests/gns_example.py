#!/usr/bin/env python3
"""gns_train: with the edges split (bp) and the MLP features split (mp), alone and with ZeRO-3, on 4 and 8 threads
and under mpirun with 4 ranks, its final loss is one device's (relative 1e-3); splitting the edges communicates by
all_reduce only (the scatter-add's partial sums and the gradients), never by gathering node latents.
usage: gns_example.py GNS_TRAIN [MPIRUN]"""
import re
import subprocess
import sys

exe = sys.argv[1]
mpirun = sys.argv[2] if len(sys.argv) > 2 else None
model = ["--steps", "5", "--seed", "1", "--graphs", "2", "--particles", "8", "--width", "16"]


def run(*args, launcher=()):
    out = subprocess.run([*launcher, exe, *model, *args], capture_output=True, text=True, timeout=240)
    if out.returncode != 0:
        sys.exit("FAIL: " + " ".join(args) + " exited " + str(out.returncode) + ":\n" + out.stdout + out.stderr)
    final = re.search(r"^final loss (\S+)", out.stdout, re.M)
    if not final:
        sys.exit("FAIL: " + " ".join(args) + " printed no final loss:\n" + out.stdout)
    return float(final[1]), out.stdout


single, _ = run("--mesh", "batch=1", "--schedule", "none")
for mesh, schedule in (("batch=4", "bp"), ("batch=2,model=2", "bp,mp"), ("batch=2,model=2", "bp,mp,z3"),
                       ("batch=4,model=2", "bp,mp")):
    loss, text = run("--mesh", mesh, "--schedule", schedule)
    if abs(loss - single) > 1e-3 * (1 + abs(single)):
        sys.exit(f"FAIL: {schedule} on {mesh}: final loss {loss} vs one device's {single}")
    if schedule == "bp" and not re.search(r"^collectives per step: \d+ all_reduce \([^)]*\) per device", text, re.M):
        sys.exit("FAIL: splitting the edges should need all_reduces only:\n" + text)
if mpirun:
    loss, _ = run("--backend", "mpi", "--mesh", "batch=2,model=2", "--schedule", "bp,mp",
                  launcher=(mpirun, "--oversubscribe", "-np", "4"))
    if abs(loss - single) > 1e-3 * (1 + abs(single)):
        sys.exit(f"FAIL: bp,mp under mpirun -np 4: final loss {loss} vs one device's {single}")
print("ok: gns_train's final loss", single, "on one device and under every split")
