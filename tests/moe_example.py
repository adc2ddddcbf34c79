#!/usr/bin/env python3
"""moe_train: under expert parallelism (threads, and mpirun with 4 ranks: batch=2,expert=2, bp,ep) its final loss
is one device's (relative 1e-3), for top-1 and top-2 routing, and the printed plan has two all_to_alls per MoE
layer and pass.
usage: moe_example.py MOE_TRAIN [MPIRUN]"""
import re
import subprocess
import sys

exe = sys.argv[1]
mpirun = sys.argv[2] if len(sys.argv) > 2 else None
model = ["--steps", "5", "--seed", "1", "--layers", "2", "--dmodel", "32", "--seq", "32", "--batch", "8"]


def run(*args, launcher=()):
    out = subprocess.run([*launcher, exe, *model, *args], capture_output=True, text=True, timeout=240)
    if out.returncode != 0:
        sys.exit("FAIL: " + " ".join(args) + " exited " + str(out.returncode) + ":\n" + out.stdout + out.stderr)
    final = re.search(r"^final loss (\S+)", out.stdout, re.M)
    if not final:
        sys.exit("FAIL: " + " ".join(args) + " printed no final loss:\n" + out.stdout)
    return float(final[1]), out.stdout


def same(a, b, what):
    if abs(a - b) > 1e-3 * (1 + abs(b)):
        sys.exit(f"FAIL: {what}: final loss {a} vs one device's {b}")


for top_k in ("1", "2"):
    single, _ = run("--top-k", top_k, "--mesh", "batch=1", "--schedule", "none")
    loss, text = run("--top-k", top_k, "--mesh", "batch=2,expert=2", "--schedule", "bp,ep")
    same(loss, single, f"top-{top_k} bp,ep on 4 threads")
    # 2 layers x (2 forward + 2 backward)
    if not re.search(r"collectives per step:.* 8 all_to_all ", text):
        sys.exit("FAIL: the bp,ep plan does not show 8 all_to_alls for 2 MoE layers:\n" + text)
    loss, _ = run("--top-k", top_k, "--mesh", "expert=2,model=2", "--schedule", "ep,mp")
    same(loss, single, f"top-{top_k} ep,mp on 4 threads")
    if mpirun:
        loss, _ = run("--top-k", top_k, "--backend", "mpi", "--mesh", "batch=2,expert=2", "--schedule", "bp,ep",
                      launcher=(mpirun, "--oversubscribe", "-np", "4"))
        same(loss, single, f"top-{top_k} bp,ep under mpirun -np 4")
    print(f"ok: top-{top_k} final loss {single} on one device and under expert parallelism")
