#!/usr/bin/env python3
"""mlp_train --checkpoint DIR --resume: a run stopped after step 3 and resumed prints the losses of steps 4-6
that an uninterrupted run prints (exactly on the same mesh and schedule, to 1e-5 on another one, and with
AdamW, clipping and a learning-rate schedule).
usage: resume_example.py MLP_TRAIN WORKDIR"""
import re
import shutil
import subprocess
import sys

exe, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
plan = ["--mesh", "batch=2,model=2", "--schedule", "bp,mp,z3"]


def losses(*args):
    out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        sys.exit("FAIL: " + " ".join(args) + " exited " + str(out.returncode) + ":\n" + out.stdout + out.stderr)
    return {int(m[1]): m[2] for m in re.finditer(r"^step (\d+) loss (\S+)", out.stdout, re.M)}


straight = losses("--steps", "6", *plan)
losses("--steps", "3", *plan, "--checkpoint", work)
resumed = losses("--steps", "6", *plan, "--checkpoint", work + "-unused", "--resume")  # nothing there: from step 1
if resumed != straight:
    sys.exit(f"FAIL: --resume without a checkpoint should start at step 1: {resumed} vs {straight}")
resumed = losses("--steps", "6", *plan, "--checkpoint", work, "--resume")
if resumed != {s: straight[s] for s in (4, 5, 6)}:
    sys.exit(f"FAIL: resumed losses {resumed} differ from the uninterrupted run's {straight}")
shutil.rmtree(work)
losses("--steps", "3", *plan, "--checkpoint", work)
moved = losses("--steps", "6", "--mesh", "batch=4", "--schedule", "bp,z2", "--checkpoint", work, "--resume")
for s in (4, 5, 6):
    if abs(float(moved[s]) - float(straight[s])) > 1e-5 * (1 + abs(float(straight[s]))):
        sys.exit(f"FAIL: resumed on batch=4 bp,z2, step {s} loss {moved[s]} vs {straight[s]}")
# The recipe: AdamW's state and the schedule's position (the step) come back. A 3-step run's first 3 rates equal
# a 6-step run's (warmup over steps 1-2, then the cosine's first step at the full rate), so it can stand for
# the 6-step run stopped after step 3; resumed, steps 4-6 must take the 6-step run's decayed rates.
shutil.rmtree(work)
recipe = [*plan, "--optimizer", "adamw", "--clip", "0.5", "--lr-schedule", "warmup_cosine", "--warmup", "2"]
straight_recipe = losses("--steps", "6", *recipe)
losses("--steps", "3", *recipe, "--checkpoint", work)
resumed_recipe = losses("--steps", "6", *recipe, "--checkpoint", work, "--resume")
if resumed_recipe != {s: straight_recipe[s] for s in (4, 5, 6)}:
    sys.exit(f"FAIL: resumed recipe losses {resumed_recipe} differ from the uninterrupted run's {straight_recipe}")
shutil.rmtree(work, ignore_errors=True)
shutil.rmtree(work + "-unused", ignore_errors=True)
print("ok: resumed losses", resumed, "match; on another mesh", moved, "; with AdamW, clipping and a schedule",
      resumed_recipe)
