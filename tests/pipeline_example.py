#!/usr/bin/env python3
"""gpt_train pipelined: on the threads backend (GPipe, 1F1B, zb1, interleaved:2) and under mpirun (4 ranks:
stage=2,batch=2, 1F1B and zbv, 4 microbatches), its losses are those of one device accumulating the same 4
microbatches (relative 1e-3), and a checkpoint saved by the pipelined run resumes on one device.
usage: pipeline_example.py GPT_TRAIN WORKDIR [MPIRUN]"""
import re
import shutil
import subprocess
import sys

exe, work = sys.argv[1], sys.argv[2]
mpirun = sys.argv[3] if len(sys.argv) > 3 else None
shutil.rmtree(work, ignore_errors=True)
model = ["--layers", "4", "--dmodel", "32", "--seq", "32", "--batch", "8", "--microbatches", "4", "--eval-every", "3"]


def losses(*args, launcher=()):
    out = subprocess.run([*launcher, exe, *model, *args], capture_output=True, text=True, timeout=240)
    if out.returncode != 0:
        sys.exit("FAIL: " + " ".join(args) + " exited " + str(out.returncode) + ":\n" + out.stdout + out.stderr)
    text = out.stdout.replace("\x1b[K", "")  # mpirun gives ranks a terminal: the live progress line's redraws
    found = {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+) loss (\S+)", text, re.M)}
    if "pipeline bubble" not in out.stdout and "stage" in " ".join(args):
        sys.exit("FAIL: the pipelined run's prediction does not show its bubble:\n" + out.stdout)
    return found


def same(a, b, what):
    if a.keys() != b.keys() or any(abs(a[s] - b[s]) > 1e-3 * (1 + abs(b[s])) for s in b):
        sys.exit(f"FAIL: {what}: {a} vs one device's {b}")


single = losses("--steps", "6", "--log-every", "1")
for schedule in ["pp:gpipe", "pp:zb1", "pp:interleaved:2"]:
    same(losses("--steps", "6", "--log-every", "1", "--mesh", "stage=2", "--schedule", schedule), single, schedule + " stage=2 threads")
same(losses("--steps", "6", "--log-every", "1", "--mesh", "stage=2,batch=2", "--schedule", "pp,bp", "--checkpoint", work),
     single, "1f1b stage=2,batch=2 threads")
resumed = losses("--steps", "8", "--log-every", "1", "--checkpoint", work, "--resume")
if not {7, 8} <= resumed.keys():
    sys.exit(f"FAIL: resuming the pipelined checkpoint on one device: {resumed}")
if mpirun:
    mpi = losses("--steps", "6", "--log-every", "1", "--backend", "mpi", "--mesh", "stage=2,batch=2", "--schedule", "pp,bp",
                 launcher=(mpirun, "--oversubscribe", "-np", "4"))
    same(mpi, single, "1f1b stage=2,batch=2 under mpirun")
    zbv = losses("--steps", "6", "--log-every", "1", "--backend", "mpi", "--mesh", "stage=2,batch=2", "--schedule", "pp:zbv,bp",
                 launcher=(mpirun, "--oversubscribe", "-np", "4"))
    same(zbv, single, "zbv stage=2,batch=2 under mpirun")
shutil.rmtree(work, ignore_errors=True)
print("ok: pipelined losses match one device's", single)
