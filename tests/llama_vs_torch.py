#!/usr/bin/env python3
"""llama_train against a plain-PyTorch Llama, through safetensors both ways.
1. partir trains 20 steps under bp,mp,z3 (batch=2,model=2; f32, then bf16 compute) and saves its weights with
   --save-safetensors (every device writing its own pieces; the bf16 run in files of 20 kB and their index); torch loads them with the reader below and must
   compute the logits and loss that partir's --predict wrote for a held-out batch (max |diff| / max |torch|
   within 1e-5 in f32; within 1e-2 in bf16, torch computing in bf16 too), and in f32 every parameter's
   gradient torch's autograd computes (1e-4).
2. torch writes its own randomly initialised Llama (8 heads on 2 K/V heads, bf16 and f32 files) with the writer
   below; partir loads them onto another mesh (model=4: the K/V heads kept whole; batch=2,model=2) with
   --load-safetensors, at --lr 0 its predictions must equal torch's, and with a rate its loss falls (under
   mpirun where given: 4 ranks saving their pieces, which torch loads again).
Exits 77 (a skipped test) without torch. usage: llama_vs_torch.py LLAMA_TRAIN_EXE WORKDIR [MPIRUN]"""
import json
import re
import os
import shutil
import struct
import subprocess
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    if os.path.exists("/usr/bin/python3") and sys.executable != "/usr/bin/python3":  # Debian's python3-torch
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    print("SKIP: PyTorch is not installed (Debian: apt-get install python3-torch)")
    sys.exit(77)

exe, work = sys.argv[1], sys.argv[2]
mpirun = sys.argv[3] if len(sys.argv) > 3 else ""
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)

# ---- safetensors, 20 lines: 8-byte length, JSON header, raw little-endian data ----
DTYPES = {"F32": (torch.float32, 4), "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2), "I32": (torch.int32, 4)}


def read_safetensors(path):
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        files = set(json.load(open(index))["weight_map"].values()) if os.path.exists(index) else {"model.safetensors"}
        return {k: v for f in files for k, v in read_safetensors(os.path.join(path, f)).items()}
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        dtype, _ = DTYPES[t["dtype"]]
        b, e = t["data_offsets"]
        raw = bytearray(data[8 + n + b:8 + n + e])
        out[name] = torch.frombuffer(raw, dtype=dtype).reshape(t["shape"]) if e > b else torch.zeros(t["shape"], dtype=dtype)
    return out


def write_safetensors(path, tensors):
    header, blobs, at = {}, [], 0
    for name, t in tensors.items():
        t = t.contiguous()
        raw = t.view(torch.int16).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        code = next(k for k, (d, _) in DTYPES.items() if d == t.dtype)
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


# ---- Llama in plain torch (Hugging Face's LlamaForCausalLM, its names, no library) ----
def rms_norm(x, w, eps=1e-6):  # statistics in f32, as Hugging Face's LlamaRMSNorm
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def llama_logits(w, tokens, heads, kv_heads, theta=10000.0):
    B, S = tokens.shape
    x = w["model.embed_tokens.weight"][tokens]
    D = x.shape[-1]
    Dh = D // heads
    inv_freq = 1.0 / (theta ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh))
    freqs = torch.outer(torch.arange(S, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    dtype = x.dtype
    cos, sin = emb.cos().to(dtype)[None, :, None, :], emb.sin().to(dtype)[None, :, None, :]
    mask = torch.full((S, S), float("-inf")).triu(1)
    layer = 0
    while f"model.layers.{layer}.input_layernorm.weight" in w:
        p = lambda name: w[f"model.layers.{layer}.{name}"]
        h = rms_norm(x, p("input_layernorm.weight"))
        q = (h @ p("self_attn.q_proj.weight").T).view(B, S, heads, Dh) / Dh ** 0.5
        k = (h @ p("self_attn.k_proj.weight").T).view(B, S, kv_heads, Dh)
        v = (h @ p("self_attn.v_proj.weight").T).view(B, S, kv_heads, Dh)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(heads // kv_heads, dim=2)  # repeat_kv
        v = v.repeat_interleave(heads // kv_heads, dim=2)
        scores = torch.einsum("bshd,bthd->bhst", q, k).float() + mask  # softmax in f32, as Hugging Face's
        ctx = torch.einsum("bhst,bthd->bshd", scores.softmax(-1).to(dtype), v).reshape(B, S, D)
        x = x + ctx @ p("self_attn.o_proj.weight").T
        h = rms_norm(x, p("post_attention_layernorm.weight"))
        x = x + (F.silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
        layer += 1
    x = rms_norm(x, w["model.norm.weight"])
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


def random_llama(vocab, d, layers, heads, kv_heads, ffn, gen):
    Dh = d // heads
    n = lambda *shape: torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
    w = {"model.embed_tokens.weight": n(vocab, d), "model.norm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
         "lm_head.weight": n(vocab, d)}
    for i in range(layers):
        w.update({f"model.layers.{i}.input_layernorm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
                  f"model.layers.{i}.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
                  f"model.layers.{i}.self_attn.q_proj.weight": n(heads * Dh, d),
                  f"model.layers.{i}.self_attn.k_proj.weight": n(kv_heads * Dh, d),
                  f"model.layers.{i}.self_attn.v_proj.weight": n(kv_heads * Dh, d),
                  f"model.layers.{i}.self_attn.o_proj.weight": n(d, heads * Dh),
                  f"model.layers.{i}.mlp.gate_proj.weight": n(ffn, d), f"model.layers.{i}.mlp.up_proj.weight": n(ffn, d),
                  f"model.layers.{i}.mlp.down_proj.weight": n(d, ffn)})
    return w


# ---- the runs ----
SEQ, BATCH = 32, 8
corpus = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "data", "corpus.txt"), "rb").read()
held_out = corpus[-(4 * (SEQ + 1)):]  # past the 90% llama_train trains on
tokens = torch.tensor([list(held_out[i * (SEQ + 1):i * (SEQ + 1) + SEQ]) for i in range(4)], dtype=torch.int32)
targets = torch.tensor([list(held_out[i * (SEQ + 1) + 1:(i + 1) * (SEQ + 1)]) for i in range(4)], dtype=torch.int32)
batch_file = os.path.join(work, "batch.safetensors")
write_safetensors(batch_file, {"tokens": tokens, "targets": targets})
failures = []


def run(label, args, launcher=()):
    cmd = [*launcher, exe, "--seq", str(SEQ), "--batch", str(BATCH), "--predict", batch_file, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        sys.exit(f"FAIL {label}: {' '.join(cmd)} exited {out.returncode}:\n{out.stdout}{out.stderr}")
    return out.stdout


def compare(label, weights, predictions, heads, kv_heads, tol, dtype=torch.float32):
    """torch computes in `dtype` (weights rounded to it, as partir's compute casts of its f32 master weights); in
    f32 every parameter's gradient (torch's autograd) must match partir's too (1e-4 relative per tensor)."""
    w = {k: v.float().to(dtype).requires_grad_() for k, v in read_safetensors(weights).items()}
    got = read_safetensors(predictions)
    logits = llama_logits(w, tokens.long(), heads, kv_heads).float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.long().reshape(-1))
    if dtype == torch.float32:
        loss.backward()
        worst = max((((got["grad." + k] - t.grad).abs().max() / t.grad.abs().max()).item(), k) for k, t in w.items())
        print(f"{label}: gradients of {len(w)} parameters, worst max|partir - torch|/max|torch| {worst[0]:.2e} ({worst[1]})")
        if not worst[0] <= 1e-4:
            failures.append(f"{label}: gradient of {worst[1]}: error {worst[0]:.2e} > 1e-4")
    logits = logits.detach()
    err = ((got["logits"].float() - logits).abs().max() / logits.abs().max()).item()
    loss_err = abs(got["loss"].item() - loss.item()) / abs(loss.item())
    print(f"{label}: logits max|partir - torch|/max|torch| {err:.2e}, loss {got['loss'].item():.6f} vs torch "
          f"{loss.item():.6f} ({loss_err:.1e})")
    if not (err <= tol and loss_err <= tol):
        failures.append(f"{label}: logits error {err:.2e}, loss error {loss_err:.2e} > {tol}")


small = ["--layers", "2", "--dmodel", "32"]
for precision in ["f32", "bf16"]:
    weights, predictions = os.path.join(work, "partir-" + precision), os.path.join(work, "partir-" + precision + ".safetensors")
    run("partir " + precision, [*small, "--heads", "4", "--kv-heads", "2", "--steps", "20", "--precision", precision,
                                "--mesh", "batch=2,model=2", "--schedule", "bp,mp,z3", "--save-safetensors", weights,
                                "--predict-out", predictions, *(["--safetensors-shard-mb", "0.02"] if precision == "bf16" else [])])
    if precision == "bf16" and not os.path.exists(os.path.join(weights, "model.safetensors.index.json")):
        failures.append("--safetensors-shard-mb 0.02 wrote no index")
    # --predict computes in the run's precision: bf16 against torch in bf16 (statistics and softmax in f32 in both).
    compare(f"partir's weights after 20 steps under bp,mp,z3 ({precision} compute)", weights, predictions, 4, 2,
            1e-5 if precision == "f32" else 1e-2, torch.float32 if precision == "f32" else torch.bfloat16)

gen = torch.Generator().manual_seed(0)
torch_weights = random_llama(256, 32, 2, 8, 2, 96, gen)
for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)]:
    name = str(dtype).split(".")[-1]
    written = os.path.join(work, f"torch-{name}.safetensors")
    write_safetensors(written, {k: v.to(dtype) for k, v in torch_weights.items()})
    for mesh, schedule in [("model=4", "mp"), ("batch=2,model=2", "bp,mp,z3")]:
        predictions = os.path.join(work, f"torch-{name}-{mesh}.safetensors")
        run("torch " + name, [*small, "--heads", "8", "--kv-heads", "2", "--ffn", "96", "--steps", "1", "--lr", "0",
                              "--mesh", mesh, "--schedule", schedule, "--load-safetensors", written,
                              "--predict-out", predictions])
        # bf16 weights widen to f32 exactly: torch compares with the same bf16 values.
        compare(f"torch's {name} weights loaded onto {mesh} {schedule}", written, predictions, 8, 2, tol)

trained, predictions = os.path.join(work, "trained-from-torch"), os.path.join(work, "trained-from-torch.safetensors")
out = run("train from torch's weights", [*small, "--heads", "8", "--kv-heads", "2", "--ffn", "96", "--steps", "10",
                                         "--log-every", "1", "--mesh", "batch=2,model=2", "--schedule", "bp,mp,z3",
                                         "--load-safetensors", os.path.join(work, "torch-float32.safetensors"),
                                         "--save-safetensors", trained, "--predict-out", predictions,
                                         *(["--backend", "mpi"] if mpirun else [])],
          (mpirun, "--oversubscribe", "-np", "4") if mpirun else ())
losses = [float(m[1]) for m in re.finditer(r"step \d+ loss (\S+)", out)]  # ranks on a pty redraw lines: no ^
print("losses from torch's weights" + (" under mpirun" if mpirun else "") + ":", losses)
if len(losses) != 10 or not losses[-1] < losses[0]:
    failures.append(f"training from torch's weights: losses {losses} do not fall")
compare("torch's weights trained 10 steps" + (" under mpirun" if mpirun else ""), trained, predictions, 8, 2, 1e-5)
if failures:
    sys.exit("FAIL:\n" + "\n".join(failures))
print("OK")
