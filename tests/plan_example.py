#!/usr/bin/env python3
"""examples/plan: a cluster plan printed without running anything (a pipeline's microbatches replayed), its JSON,
a verdict that flips to DOES NOT FIT, and bad input as one error line.
usage: plan_example.py PLAN"""
import json
import re
import subprocess
import sys

plan = sys.argv[1]


def run(*args, code=0):
    out = subprocess.run([plan, *args], capture_output=True, text=True, timeout=240)
    if out.returncode != code:
        sys.exit(f"FAIL: {' '.join(args)} exited {out.returncode}, expected {code}:\n{out.stdout}{out.stderr}")
    return out.stdout + out.stderr


def expect(text, pattern, what):
    if not re.search(pattern, text, re.M):
        sys.exit(f"FAIL: {what}: no match for {pattern!r} in:\n{text}")


small = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128", "--batch", "64",
         "--microbatch-size", "1", "--mesh", "batch=2,stage=2,model=2", "--schedule", "bp,mp,pp", "--profile", "h100-sxm"]
text = run(*small)
expect(text, r"^32 microbatches a step; planned in [0-9.]+ s", "a pipeline's microbatches, replayed")
expect(text, r"MFU [0-9.]+%, HFU [0-9.]+%", "utilization")
expect(text, r"fits in 80\.00 GiB", "the verdict against the H100's 80 GB")
expect(text, r"pipeline: 2 stages, bubble [0-9.]+%, 32 microbatches replayed", "the replay said")
report = json.loads(run(*small, "--report", "json"))
if (not report["memory"]["fits"] or report["utilization"]["mfu"] <= 0 or report["profile"] != "h100-sxm" or
        report["pipeline"]["replayed_microbatches"] != 32):
    sys.exit(f"FAIL: JSON report: {json.dumps(report)[:400]}")
# A 2-layer model of width 8192 on one device: 64 sequences of 2048 in one pass do not fit in 80 GB.
big = run("--layers", "2", "--hidden", "8192", "--heads", "64", "--batch", "64", "--mesh", "batch=1", "--schedule", "bp",
          "--remat", "none")
expect(big, r"DOES NOT FIT", "the verdict")
expect(big, r"^fits with --(remat|schedule|microbatch-size) \S+: peak [0-9.]+ GiB, step ", "the change that would fit")
expect(run("--mesh", "batch=3x", code=2), r"^error: ", "a bad mesh is one error line")
expect(run("--schedule", "pq", code=2), r"^error: .*pq", "an unknown tactic is named")
print("plan example: OK")
