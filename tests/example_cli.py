#!/usr/bin/env python3
"""The examples' command line (CLI11 turned into partir's wording), their JSON reports, the --plot pictures and
the default profile (this machine's calibration, made once and cached).
usage: example_cli.py MLP_TRAIN GPT_INFER WORKDIR"""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET

mlp, gpt_infer, work = sys.argv[1], sys.argv[2], sys.argv[3]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
env = {k: v for k, v in os.environ.items() if k != "PARTIR_PROFILE"}
env["PARTIR_CACHE_DIR"] = os.path.join(work, "cache")


def run(exe, *args, code=0):
    out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=240, env=env)
    if out.returncode != code:
        sys.exit(f"FAIL: {' '.join(args)} exited {out.returncode}, expected {code}:\n{out.stdout}{out.stderr}")
    return out.stdout + out.stderr


def expect(text, pattern, what):
    if not re.search(pattern, text, re.M):
        sys.exit(f"FAIL: {what}: no match for {pattern!r} in:\n{text}")


# Bad command lines: one line, exit 2, before anything runs.
help_text = run(mlp, "--help")
expect(help_text, r"--steps INT:>=1=200", "--help shows each default")
expect(help_text, r"--plot", "--help lists --plot")
expect(run(mlp, "--stpes", "3", code=2), r"^error: unknown flag --stpes; did you mean --steps\? \(see --help\)$", "typo")
expect(run(mlp, "--steps=0", code=2), r"^error: --steps: expected a number >= 1, got 0", "range")
expect(run(mlp, "--backend", "gpu", code=2), r"^error: --backend: gpu not in \{threads,mpi,nccl\}", "choice")
expect(run(mlp, "--lr", "fast", code=2), r"^error: --lr: expected a number, got 'fast'", "number")
expect(run(mlp, "--steps", code=2), r"^error: --steps: 1 required", "missing value")
expect(run(mlp, "--prefetch-mb", "-2", code=2), r"^error: --prefetch-mb: Value -2 not in range", "prefetch range")
# A bad $PARTIR_ASYNC (runtime/comm/comm_stream.hpp) names the variable and what it takes.
bad = subprocess.run([mlp, "--steps", "1"], capture_output=True, text=True, timeout=240, env=dict(env, PARTIR_ASYNC="yes"))
expect(bad.stdout + bad.stderr if bad.returncode != 0 else "", r"PARTIR_ASYNC: expected 0 \(collectives inline\), 1 "
       r"\(streamed from 256 KiB\) or all \(every collective streamed\), got 'yes'", "bad PARTIR_ASYNC")

# A run with --flag=value, a report, pictures and the first calibration of this (cache) directory.
report, plots = os.path.join(work, "report.json"), os.path.join(work, "plots")
first = run(mlp, "--steps=6", "--mesh=batch=2", "--schedule", "bp", "--hidden", "64", "--no-check",
            "--report", "json", "--report-file", report, "--plot", plots)
expect(first, r"^calibrating the simulator on this machine", "the first run calibrates")
expect(first, r"^predicted \(profile calibrated, --profile picks another\)", "the prediction names its profile")
cached = [f for f in os.listdir(env["PARTIR_CACHE_DIR"]) if f.startswith("profile-") and f.endswith(".json")]
if len(cached) != 1:
    sys.exit(f"FAIL: expected one cached profile, found {cached}")
profile = json.load(open(os.path.join(env["PARTIR_CACHE_DIR"], cached[0])))
if "calibrated on" not in profile["source"] or profile["peak_flops"]["f32"] <= 0 or not profile["links"]:
    sys.exit(f"FAIL: the cached profile: {profile}")
second = run(mlp, "--steps", "2", "--mesh", "batch=2", "--schedule", "bp", "--hidden", "64", "--no-check")
if "calibrating" in second or "profile calibrated" not in second:
    sys.exit("FAIL: the second run should read the cached profile:\n" + second)
expect(run(mlp, "--steps", "2", "--mesh", "batch=1", "--schedule", "none", "--no-check", "--profile", "cpu"),
       r"^predicted \(profile cpu,", "--profile cpu")
short = ("--steps", "2", "--mesh", "batch=2", "--schedule", "bp", "--hidden", "64", "--no-check")
expect(run(mlp, *short, "--profile", "calibrate"), r"^calibrating the simulator", "--profile calibrate measures again")
cache_file = os.path.join(env["PARTIR_CACHE_DIR"], cached[0])
with open(cache_file, "w") as f:
    f.write('{"name": "damaged"')
run(mlp, *short)  # a damaged cache file is measured again and rewritten
if json.load(open(cache_file))["name"] != "calibrated" or len(os.listdir(env["PARTIR_CACHE_DIR"])) != 1:
    sys.exit("FAIL: the damaged cache file was not replaced: " + str(os.listdir(env["PARTIR_CACHE_DIR"])))

r = json.load(open(report))
for key, n in (("step_ms", 6), ("train_loss", 6), ("learning_rate", 6), ("peak_bytes_per_device", 2)):
    if len(r[key]) != n:
        sys.exit(f"FAIL: report {key} has {len(r[key])} entries, expected {n}: {r}")
if r["predicted"]["profile"] != "calibrated" or r["final_loss"] != r["train_loss"][-1]:
    sys.exit(f"FAIL: report: {r}")
if not r["collectives"] or any(not c["reason"] or c["kind"] not in ("all_reduce", "all_gather", "reduce_scatter",
                                                                    "all_to_all", "all_slice") for c in r["collectives"]):
    sys.exit(f"FAIL: report collectives: {r['collectives']}")


# The pictures: well-formed SVG, drawn as a person would see them (rsvg-convert to PNG).
def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        sys.exit(f"FAIL: {path} is not a PNG")
    return struct.unpack(">II", head[16:24])


ns = {"s": "http://www.w3.org/2000/svg"}
loss_svg = ET.parse(os.path.join(plots, "loss.svg")).getroot()
line = loss_svg.find("s:polyline", ns)
if line is None or len(line.get("points").split()) != 6:
    sys.exit("FAIL: loss.svg should draw the 6 training losses")
memory_svg = ET.parse(os.path.join(plots, "memory.svg")).getroot()
labels = [t.text for t in memory_svg.findall("s:text", ns)]
if not {"d0 sim", "d0 run", "d1 sim", "d1 run", "measured peak", "parameters"} <= set(labels):
    sys.exit(f"FAIL: memory.svg labels {labels}")
rsvg = shutil.which("rsvg-convert")
if rsvg:
    for name in ("loss", "memory"):
        png = os.path.join(plots, name + ".png")
        subprocess.run([rsvg, "-o", png, os.path.join(plots, name + ".svg")], check=True, timeout=60)
        if png_size(png) != (640, 400) or os.path.getsize(png) < 5000:
            sys.exit(f"FAIL: {png}: {png_size(png)}, {os.path.getsize(png)} bytes")
else:
    print("note: rsvg-convert not installed (librsvg2-bin): SVGs checked as XML only")

# gpt_infer's report.
infer = os.path.join(work, "infer.json")
run(gpt_infer, "--steps", "2", "--tokens", "2", "--prompts", "2", "--layers", "1", "--dmodel", "32", "--report=json",
    "--report-file", infer)
i = json.load(open(infer))
if i["tokens_per_s"] <= 0 or not i["collectives"] or "mesh {model=2}" not in i["run"]:
    sys.exit(f"FAIL: gpt_infer report: {i}")
shutil.rmtree(work, ignore_errors=True)
print("ok: flags, reports, plots and the cached profile")
