#!/usr/bin/env python3
"""partir's training recipe against PyTorch's, in f64: AdamW (matrices decay, vectors do not) +
torch.nn.utils.clip_grad_norm_ + a warmup + cosine LambdaLR, 10 steps on the MLP and on a 2-layer GPT (nn::Gpt
written again in torch, as bench/vs_pytorch_gpt.py does), from the initial parameters and batches that
tests/recipe_reference.cpp writes. Every final parameter must match within 1e-5 relative (max |diff| / max
|torch|); the gradient norms too. Exits 77 (a skipped test) without torch.

usage: recipe_vs_torch.py RECIPE_REFERENCE_EXE
"""
import math
import os
import subprocess
import sys
import tempfile

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    if os.path.exists("/usr/bin/python3") and sys.executable != "/usr/bin/python3":  # Debian's python3-torch
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    print("SKIP: PyTorch is not installed (Debian: apt-get install python3-torch)")
    sys.exit(77)

torch.set_default_dtype(torch.float64)
STEPS, WARMUP, FINAL = 10, 3, 0.1


def scale(t):
    """The schedule of recipe_reference.cpp: LRSchedule::warmup(3).then_cosine(7, 0.1)."""
    if t < WARMUP:
        return (t + 1) / (WARMUP + 1)
    k, n = t - WARMUP, STEPS - WARMUP
    return FINAL if k >= n else FINAL + (1 - FINAL) * 0.5 * (1 + math.cos(math.pi * k / n))


def read(path):
    arrays = {}
    with open(path) as f:
        for line in f:
            head, values = line.split(" = ", 1)
            kind, step, name, dims = head.split()
            shape = [] if dims == "-" else [int(d) for d in dims.split(",")]
            data = torch.tensor([float(v) for v in values.split()]).reshape(shape)
            arrays[(kind, int(step), name)] = data
    return arrays


def mlp_loss(p, batch):
    x = torch.relu(batch["x"] @ p["params/mlp/w1"] + p["params/mlp/b1"])
    return torch.mean((x @ p["params/mlp/w2"] + p["params/mlp/b2"] - batch["y"]) ** 2)


def gpt_loss(p, batch, layers=2, heads=2):
    tokens, targets = batch["tokens"].long(), batch["targets"].long()
    B, S = tokens.shape
    D = p["params/pos_embed"].shape[1]
    V = p["params/tok_embed/table"].shape[0]
    Dh = D // heads
    mask = torch.triu(torch.full((S, S), -1e9), diagonal=1)
    x = p["params/tok_embed/table"][tokens] + p["params/pos_embed"]
    for i in range(layers):
        q_ = lambda n: p[f"params/layers/{i}/{n}"]
        h = F.layer_norm(x, (D,), q_("ln1/gamma"), q_("ln1/beta"), eps=1e-5)
        q = ((h @ q_("attn/wq") + q_("attn/bq")) / math.sqrt(Dh)).view(B, S, heads, Dh).transpose(1, 2)
        k = (h @ q_("attn/wk")).view(B, S, heads, Dh).transpose(1, 2)
        v = (h @ q_("attn/wv") + q_("attn/bv")).view(B, S, heads, Dh).transpose(1, 2)
        probs = torch.softmax(q @ k.transpose(-1, -2) + mask, dim=-1)
        context = (probs @ v).transpose(1, 2).reshape(B, S, D)
        x = x + context @ q_("attn/wo") + q_("attn/bo")
        h = F.layer_norm(x, (D,), q_("ln2/gamma"), q_("ln2/beta"), eps=1e-5)
        x = x + F.gelu(h @ q_("mlp/w1") + q_("mlp/b1"), approximate="tanh") @ q_("mlp/w2") + q_("mlp/b2")
    x = F.layer_norm(x, (D,), p["params/ln_f/gamma"], p["params/ln_f/beta"], eps=1e-5)
    logits = (x / math.sqrt(D)) @ p["params/tok_embed/table"].t()
    return F.cross_entropy(logits.reshape(B * S, V), targets.reshape(B * S))


def train(arrays, model, loss_fn, clip):
    prefix = model + ":"
    p = {k[2][len(prefix):]: torch.nn.Parameter(v.clone()) for k, v in arrays.items()
         if k[0] == "init" and k[2].startswith(prefix)}
    decay = [t for t in p.values() if t.dim() >= 2]
    rest = [t for t in p.values() if t.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, scale)
    worst, clipped = 0.0, 0
    for t in range(STEPS):
        batch = {k[2][len(prefix):]: v for k, v in arrays.items() if k[0] == "batch" and k[1] == t and k[2].startswith(prefix)}
        opt.zero_grad()
        loss = loss_fn(p, batch)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(list(p.values()), clip))
        clipped += norm > clip
        theirs = float(arrays[("grad_norm", t, prefix + "grad_norm")])
        worst = max(worst, abs(norm - theirs) / norm, abs(float(loss) - float(arrays[("loss", t, prefix + "loss")])) / float(loss))
        opt.step()
        sched.step()
    for name, param in p.items():
        ours = arrays[("final", STEPS, prefix + name)]
        worst = max(worst, float((param.detach() - ours).abs().max() / param.detach().abs().max()))
    return worst, clipped


def main():
    exe = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "reference.txt")
        subprocess.run([exe, out], check=True)
        arrays = read(out)
    ok = True
    for model, loss_fn, clip in (("mlp", mlp_loss, 0.5), ("gpt", gpt_loss, 1.0)):
        worst, clipped = train(arrays, model, loss_fn, clip)
        print(f"{model}: {STEPS} steps of AdamW + clip_grad_norm_({clip}) + warmup_cosine, clipped on {clipped}: "
              f"max relative difference to torch {worst:.3g}")
        ok = ok and worst < 1e-5 and clipped > 0
    sys.exit(0 if ok else 1)


main()
