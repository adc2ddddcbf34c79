#!/usr/bin/env python3
"""A training example under several plans ends with one device's final loss (relative 1e-3): each --case
'MESH SCHEDULE' on the threads backend, each --mpi-case under mpirun with one rank per device; a case may add
'| REGEX' that its printed output must match (e.g. the collectives of its plan).
usage: example_differential.py EXE [--mpirun MPIRUN] --model 'ARGS' [--case 'MESH SCHEDULE[ | REGEX]']...
       [--mpi-case 'MESH SCHEDULE']..."""
import argparse
import re
import shlex
import subprocess
import sys

parser = argparse.ArgumentParser()
parser.add_argument("exe")
parser.add_argument("--mpirun", default="")
parser.add_argument("--model", default="")
parser.add_argument("--case", action="append", default=[])
parser.add_argument("--mpi-case", action="append", default=[])
args = parser.parse_args()
model = shlex.split(args.model)


def run(mesh, schedule, launcher=(), backend="threads"):
    cmd = [*launcher, args.exe, *model, "--mesh", mesh, "--schedule", schedule, "--backend", backend]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if out.returncode != 0:
        sys.exit("FAIL: " + " ".join(cmd) + " exited " + str(out.returncode) + ":\n" + out.stdout + out.stderr)
    final = re.search(r"^final loss (\S+)", out.stdout, re.M)
    if not final:
        sys.exit("FAIL: " + " ".join(cmd) + " printed no final loss:\n" + out.stdout)
    return float(final[1]), out.stdout


single, _ = run("batch=1", "none")
cases = [(c, ()) for c in args.case]
if args.mpirun:
    cases += [(c, (args.mpirun, "--oversubscribe", "-np")) for c in args.mpi_case]
for case, launcher in cases:
    plan, _, pattern = case.partition("|")
    mesh, schedule = plan.split()
    devices = 1
    for axis in mesh.split(","):
        devices *= int(axis.split("=")[1])
    loss, text = run(mesh, schedule, (*launcher, str(devices)) if launcher else (), "mpi" if launcher else "threads")
    where = f"{schedule} on {mesh}" + (" under mpirun" if launcher else "")
    if abs(loss - single) > 1e-3 * (1 + abs(single)):
        sys.exit(f"FAIL: {where}: final loss {loss} vs one device's {single}")
    if pattern.strip() and not re.search(pattern.strip(), text, re.M):
        sys.exit(f"FAIL: {where}: the output does not match {pattern.strip()!r}:\n{text}")
    print(f"ok: {where}: final loss {loss} (one device: {single})")
