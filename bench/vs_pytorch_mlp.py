#!/usr/bin/env python3
"""PyTorch half of bench/vs_pytorch_mlp: the MLP train step of partir's nn::Mlp (x @ w1 + b1, ReLU, @ w2 + b2,
MSE, plain SGD), fp32 or under torch.autocast("cpu", torch.bfloat16) (--autocast bf16), written with the usual
torch modules, timed as the median of --reps steps after
--warmup steps. bench/vs_pytorch_mlp runs it in a child process with OPENBLAS_NUM_THREADS set (torch's
set_num_threads does not bound OpenBLAS's pool). Prints one line `torch_step_ms <ms>` (and a description
line), or `skip: <why>` with exit status 0 when torch is not installed.

usage: /usr/bin/python3 bench/vs_pytorch_mlp.py [--batch 256 --inputs 1024 --hidden 4096 --reps 10 --threads 2]
                                                 [--autocast bf16]
"""
import argparse
import os
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--inputs", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--autocast", choices=["none", "bf16"], default="none")
    a = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"skip: PyTorch is not installed ({e}); on Debian: apt-get install python3-torch libopenblas0-pthread")
        return 0
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(a.inputs, a.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(a.hidden, a.inputs))
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    loss_fn = torch.nn.MSELoss()
    x = torch.rand(a.batch, a.inputs) * 2 - 1
    y = torch.rand(a.batch, a.inputs) * 2 - 1

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.autocast == "bf16"):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(a.warmup):
        step()
    ms = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1e3)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, autocast {a.autocast}")
    print(f"torch_step_ms {statistics.median(ms):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
