#!/usr/bin/env python3
"""GPT train step time, PyTorch CPU against partir: the same byte-level GPT (nn::Gpt of
include/partir/dsl/transformer.hpp, written again in torch below), same sizes, fp32 (or --precision bf16:
torch.autocast("cpu", torch.bfloat16) against partir's MixedPrecision bf16), Adam, one run each:

  torch, 1 thread           vs  partir, 1 device on 1 thread (build/examples/gpt_train, PARTIR_NUM_THREADS=1)
  torch, 2 threads          vs  partir, 1 device on 2 threads, and BP on 2 devices (threads backend; and 2 MPI
                                ranks when mpirun exists), each device on 1 thread

Each configuration runs in its own process with OPENBLAS_NUM_THREADS set, since torch.set_num_threads does not
bound OpenBLAS's pool; partir's thread budget is PARTIR_NUM_THREADS (its GEMM engine, oneDNN by default, and
OpenBLAS follow it). Step time is the median over the steps after --warmup. partir also runs with glibc's
malloc told to keep freed memory (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_): its kernels allocate a
fresh buffer per op, and by default glibc returns large ones to the kernel, so every step page-faults its
intermediates again; the "malloc kept" rows show what a buffer-reusing runtime would gain.

usage: /usr/bin/python3 bench/vs_pytorch_gpt.py [--build build] [--steps 30] [--batch 8 --seq 128 --dmodel 512 ...]
(Debian's python3-torch lives under /usr/bin/python3, not a pyenv or venv interpreter.)
"""
import argparse
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def torch_step_ms(a):
    """Median ms of a torch train step: runs in a process whose thread count is already fixed."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    V, S, D, H, L, B = 256, a.seq, a.dmodel, a.heads, a.layers, a.batch
    Dh = D // H

    def normal(*shape, std):
        return torch.nn.Parameter(torch.randn(*shape) * std)

    def zeros(*shape):
        return torch.nn.Parameter(torch.zeros(*shape))

    def ones(*shape):
        return torch.nn.Parameter(torch.ones(*shape))

    # Parameters and initialization as nn::Gpt: dense weights [in, out] ~ N(0, 1/in), no key bias, tied head.
    p = {"table": normal(V, D, std=1.0), "pos": normal(S, D, std=0.02), "lnf_g": ones(D), "lnf_b": zeros(D)}
    for i in range(L):
        for w, (fan_in, fan_out) in {"wq": (D, D), "wk": (D, D), "wv": (D, D), "wo": (D, D), "w1": (D, 4 * D),
                                     "w2": (4 * D, D)}.items():
            p[f"{i}/{w}"] = normal(fan_in, fan_out, std=1 / math.sqrt(fan_in))
        for b, n in {"bq": D, "bv": D, "bo": D, "b1": 4 * D, "b2": D}.items():
            p[f"{i}/{b}"] = zeros(n)
        for ln in ("ln1", "ln2"):
            p[f"{i}/{ln}_g"], p[f"{i}/{ln}_b"] = ones(D), zeros(D)
    mask = torch.triu(torch.full((S, S), -1e9), diagonal=1)

    def loss_fn(tokens, targets):
        x = p["table"][tokens] + p["pos"]
        for i in range(L):
            h = F.layer_norm(x, (D,), p[f"{i}/ln1_g"], p[f"{i}/ln1_b"], eps=1e-5)
            q = ((h @ p[f"{i}/wq"] + p[f"{i}/bq"]) / math.sqrt(Dh)).view(B, S, H, Dh).transpose(1, 2)
            k = (h @ p[f"{i}/wk"]).view(B, S, H, Dh).transpose(1, 2)
            v = (h @ p[f"{i}/wv"] + p[f"{i}/bv"]).view(B, S, H, Dh).transpose(1, 2)
            probs = torch.softmax(q @ k.transpose(-1, -2) + mask, dim=-1)
            context = (probs @ v).transpose(1, 2).reshape(B, S, D)
            x = x + context @ p[f"{i}/wo"] + p[f"{i}/bo"]
            h = F.layer_norm(x, (D,), p[f"{i}/ln2_g"], p[f"{i}/ln2_b"], eps=1e-5)
            x = x + F.gelu(h @ p[f"{i}/w1"] + p[f"{i}/b1"], approximate="tanh") @ p[f"{i}/w2"] + p[f"{i}/b2"]
        x = F.layer_norm(x, (D,), p["lnf_g"], p["lnf_b"], eps=1e-5)
        logits = (x / math.sqrt(D)) @ p["table"].t()
        return F.cross_entropy(logits.reshape(B * S, V), targets.reshape(B * S))

    opt = torch.optim.Adam(p.values(), lr=a.lr)
    times = []
    for _ in range(a.steps):
        tokens = torch.randint(0, V, (B, S))
        targets = torch.randint(0, V, (B, S))
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = loss_fn(tokens, targets)
        loss.backward()
        opt.step()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times[a.warmup:])


KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def partir_step_ms(a, mesh, schedule, launcher, malloc_env, threads):
    binary = pathlib.Path(a.build) / "examples" / "gpt_train"
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.json"
        cmd = launcher + [str(binary), "--steps", str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq),
                          "--dmodel", str(a.dmodel), "--heads", str(a.heads), "--layers", str(a.layers),
                          "--lr", str(a.lr), "--mesh", mesh, "--schedule", schedule, "--report", "json",
                          "--report-file", str(report), "--precision", a.precision]
        if launcher:
            cmd += ["--backend", "mpi"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(env_with_threads(1), PARTIR_NUM_THREADS=str(threads), **malloc_env))
        return statistics.median(json.loads(report.read_text())["step_ms"][a.warmup:])


def env_with_threads(n):
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(n), OMP_NUM_THREADS=str(n))
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_pml="ob1",
               OMPI_MCA_btl="self,vader")
    return env


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=str(ROOT / "build"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dmodel", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)  # set in the torch child
    a = parser.parse_args()
    if a.threads:
        print(torch_step_ms(a))
        return

    def torch_ms(threads):
        cmd = [sys.executable, __file__, "--threads", str(threads)] + sys.argv[1:]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env_with_threads(threads))
        return float(out.stdout.split()[-1])

    tokens = a.batch * a.seq
    def partir_rows(label, mesh, schedule, launcher, torch_row, threads):
        return [(label, partir_step_ms(a, mesh, schedule, launcher, {}, threads), torch_row),
                (label + ", malloc kept", partir_step_ms(a, mesh, schedule, launcher, KEEP_FREED_MEMORY, threads),
                 torch_row)]

    rows = [("torch, 1 thread", torch_ms(1), None)]
    rows += partir_rows("partir, 1 device, 1 thread", "batch=1", "none", [], 0, 1)
    rows.append(("torch, 2 threads", torch_ms(2), None))
    torch2 = len(rows) - 1
    rows += partir_rows("partir, 1 device, 2 threads", "batch=1", "none", [], torch2, 2)
    rows += partir_rows("partir, bp on 2 devices (threads)", "batch=2", "bp", [], torch2, 2)
    if shutil.which("mpirun"):
        rows += partir_rows("partir, bp on 2 MPI ranks", "batch=2", "bp", ["mpirun", "--oversubscribe", "-np", "2"],
                            torch2, 2)
    print(f"GPT train step: batch {a.batch}, seq {a.seq}, d_model {a.dmodel}, heads {a.heads}, layers {a.layers}, "
          f"vocab 256, {a.precision}, Adam; median of {a.steps - a.warmup} steps")
    print(f"{'run':<42}{'ms/step':>10}{'tokens/s':>12}{'torch/partir':>14}")
    for name, ms, torch_row in rows:
        ratio = f"{rows[torch_row][1] / ms:.2f}x" if torch_row is not None else ""
        print(f"{name:<42}{ms:>10.2f}{tokens / ms * 1e3:>12.0f}{ratio:>14}")
    print("torch/partir > 1 means partir is faster than PyTorch with as many threads.")


if __name__ == "__main__":
    main()
