#!/usr/bin/env python3
"""PyTorch running the fsdp.cpp model and training step: the other side of
`fsdp bench compare`.

    fsdp launch --nproc-per-node N -- PYTHON bench/fsdp2_reference.py --spec SPEC.json --out DIR
        [--mode fsdp2-parity|fsdp2|eager|compile]

Note [Reference modes]
  fsdp2-parity  FSDP2 doing fsdp.cpp's arithmetic: the optimizer steps with the spec's
                optimizer.implementation (fused -> torch.optim.*(fused=True), foreach ->
                foreach=True, per_tensor -> foreach=False), clipping is a per-tensor loop, the
                loss is all-reduced and read on the host every step. Losses agree with fsdp.cpp
                to fp32 rounding. The default of this script (not of `fsdp bench compare`).
  fsdp2         FSDP2 as torchtitan runs it: the same fully_shard units and
                MixedPrecisionPolicy, fused optimizer, foreach clipping, no host sync in the
                step (losses and norms stay on the device and are read once after the last
                step; on CUDA each step is timed by CUDA events).
  eager         one rank, no wrapper: the plain model, torch.autocast(bf16) when
                mixed_precision is bf16, fused optimizer, no host sync per step.
  compile       eager with torch.compile(model).
  The fast modes (fsdp2, eager, compile) agree with fsdp.cpp to a looser tolerance only.

The model (models/gpt.{h,cc}), the loss, the LR schedule (engine/schedule.cc), gradient
clipping (FsdpModel::ClipGradNorm) and the optimizers (AdamW / Adam / SGD) mirror the C++ code;
parameters come from the spec's init.safetensors and batches from its batches.bin. Sharding: torch.distributed.fsdp.fully_shard on each transformer block, then on the
root, over a DeviceMesh (1-D "shard" for full_shard / shard_grad_op, 2-D ("replicate", "shard")
for hybrid_shard and for no_shard, the latter with shard size 1).

Outputs: DIR/metrics.jsonl (rank 0, one line per step) and DIR/rank_stats/rank{r}.json.

Device: the spec's "device" (cpu, default; or cuda: one GPU per rank, LOCAL_RANK's, process
group on the spec's "backend": nccl unless it says gloo). On CUDA the step time ends with a
torch.cuda.synchronize() (the loss is read every step anyway), and rank_stats also holds
peak_tensor_bytes = torch.cuda.max_memory_allocated(), what fsdp.cpp reports from the same
caching allocator.

FSDP2 on Gloo/CPU (torch 2.11): CUDA streams and events are no-ops on CPU and FSDP2 issues its
collectives with async_op=False, so every all_gather_into_tensor (unshard, forward and the
backward prefetch), reduce_scatter_tensor (post-backward) and all_reduce (HSDP / replicate
post-backward) runs synchronously on the training thread: c10d issues the Gloo work and waits on
it inside the call. comm_wait_s is the wall time of those calls (plus any Work.wait() on works
issued with async_op=True, which FSDP2 does not do here); comm_bytes are their full buffers
(all-gather output, reduce-scatter input, all-reduce tensor). The clipping all-reduce and the
loss all-reduce of this script are not counted (as in fsdp.cpp's CommStats).

Development helpers (no launcher needed):
    --make-test-inputs DIR [--preset gpt|llama] [--world N] [--strategy S] ...   writes a spec,
        init.safetensors and batches.bin
    --reference --spec SPEC --out DIR   the same training in one process without FSDP, on the
        concatenation of every rank's micro-batch (the global batch); bf16 is emulated with
        bf16 copies of the parameters (agrees to bf16 precision only)
    --compare A/metrics.jsonl B/metrics.jsonl [--rtol R]   per-step loss / grad_norm difference
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def die(msg):
    rank = os.environ.get("RANK", "0")
    print(f"fsdp2_reference: [rank{rank}] error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


# --------------------------------------------------------------------------------------------
# The model: models/gpt.{h,cc}, same parameter names, shapes, registration order and ops.
# --------------------------------------------------------------------------------------------

class Config:
    def __init__(self, m):
        self.arch = m.get("arch", "gpt")
        self.vocab_size = int(m.get("vocab_size", 256))
        self.dim = int(m.get("dim", 128))
        self.n_layers = int(m.get("n_layers", 4))
        self.n_heads = int(m.get("n_heads", 4))
        self.n_kv_heads = int(m.get("n_kv_heads", 0)) or self.n_heads  # ModelArgs::kv_heads()
        self.seq_len = int(m.get("seq_len", 64))
        self.ffn_hidden = int(m.get("ffn_hidden", 0))
        self.norm = m.get("norm", "layernorm")
        self.activation = m.get("activation", "gelu")
        self.positions = m.get("positions", "learned")
        self.tie_embeddings = bool(m.get("tie_embeddings", True))
        self.norm_eps = float(m.get("norm_eps", 1e-5))
        self.rope_theta = float(m.get("rope_theta", 10000.0))
        if self.arch not in ("gpt", "llama", "mlp"):
            die(f"model.arch '{self.arch}' is not valid; valid: gpt, llama, mlp")
        if self.norm not in ("layernorm", "rmsnorm"):
            die(f"model.norm '{self.norm}' is not valid; valid: layernorm, rmsnorm")
        if self.activation not in ("gelu", "swiglu"):
            die(f"model.activation '{self.activation}' is not valid; valid: gelu, swiglu")
        if self.positions not in ("learned", "rope"):
            die(f"model.positions '{self.positions}' is not valid; valid: learned, rope")
        if self.dim % self.n_heads != 0:
            die(f"model.dim {self.dim} is not a multiple of model.n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            die(f"model.n_heads {self.n_heads} is not a multiple of model.n_kv_heads "
                f"{self.n_kv_heads}")

    def head_dim(self):
        return self.dim // self.n_heads

    def kv_dim(self):  # rows of wk and wv
        return self.n_kv_heads * self.head_dim()

    def ffn(self):  # GptConfig::ffn()
        if self.ffn_hidden > 0:
            return self.ffn_hidden
        if self.activation == "swiglu":
            return (8 * self.dim // 3 + 63) // 64 * 64
        return 4 * self.dim

    def attention(self):
        return self.arch != "mlp"

    def biases(self):
        return self.arch in ("gpt", "mlp")


def _param(module, name, shape):
    p = nn.Parameter(torch.zeros(shape, dtype=torch.float32))
    module.register_parameter(name, p)
    return p


def _linear(x, w, b):
    return F.linear(x, w, b)


def _rotate(x, cos, sin):  # Rotate(): x [batch, seq, heads, head_dim], pairs of the last dim
    t = x.size(1)
    c = cos.narrow(0, 0, t).view(1, t, 1, -1).to(x.dtype)
    s = sin.narrow(0, 0, t).view(1, t, 1, -1).to(x.dtype)
    pairs = x.unflatten(-1, (-1, 2))
    x1, x2 = pairs.select(-1, 0), pairs.select(-1, 1)
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)


class Norm(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.rms = c.norm == "rmsnorm"
        self.eps = c.norm_eps
        _param(self, "weight", (c.dim,))
        if not self.rms:
            _param(self, "bias", (c.dim,))

    def forward(self, x):
        if not self.rms:
            return F.layer_norm(x, (x.size(-1),), self.weight, self.bias, self.eps)
        xf = x.to(torch.float32)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim()
        for n, rows in (("wq", c.dim), ("wk", c.kv_dim()), ("wv", c.kv_dim()), ("wo", c.dim)):
            _param(self, n, (rows, c.dim))
        self.has_bias = c.biases()
        if self.has_bias:
            for n, rows in (("bq", c.dim), ("bk", c.kv_dim()), ("bv", c.kv_dim()), ("bo", c.dim)):
                _param(self, n, (rows,))

    def forward(self, x, cos, sin):
        b, t = x.size(0), x.size(1)
        bias = (lambda n: getattr(self, n)) if self.has_bias else (lambda n: None)
        q = _linear(x, self.wq, bias("bq")).view(b, t, self.n_heads, self.head_dim)
        k = _linear(x, self.wk, bias("bk")).view(b, t, self.n_kv_heads, self.head_dim)
        v = _linear(x, self.wv, bias("bv")).view(b, t, self.n_kv_heads, self.head_dim)
        if cos is not None:
            q = _rotate(q, cos, sin)
            k = _rotate(k, cos, sin)
        # Grouped-query attention as models/gpt/gpt.cc runs it: SDPA's enable_gqa maps query
        # head h to key/value head h // (n_heads // n_kv_heads).
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), None, 0.0, is_causal=True,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return _linear(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim),
                       self.wo, bias("bo"))


class FeedForward(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.swiglu = c.activation == "swiglu"
        _param(self, "w1", (c.ffn(), c.dim))
        _param(self, "w2", (c.dim, c.ffn()))
        if self.swiglu:
            _param(self, "w3", (c.ffn(), c.dim))
        self.has_bias = c.biases()
        if self.has_bias:
            _param(self, "b1", (c.ffn(),))
            _param(self, "b2", (c.dim,))

    def forward(self, x):
        b1 = self.b1 if self.has_bias else None
        b2 = self.b2 if self.has_bias else None
        if self.swiglu:
            h = F.silu(_linear(x, self.w1, b1)) * _linear(x, self.w3, None)
        else:
            h = F.gelu(_linear(x, self.w1, b1), approximate="tanh")
        return _linear(h, self.w2, b2)


class TransformerBlock(nn.Module):
    def __init__(self, c, rope):
        super().__init__()
        # The root's rope tables, shared and not registered here (as in the C++ block).
        self._rope = rope  # a list [cos, sin] or [None, None]; a list is not a registered buffer
        if c.attention():
            self.attention_norm = Norm(c)
            self.attention = Attention(c)
        else:
            self.attention_norm = None
            self.attention = None
        self.ffn_norm = Norm(c)
        self.feed_forward = FeedForward(c)

    def forward(self, x):
        h = x
        if self.attention is not None:
            h = h + self.attention(self.attention_norm(h), self._rope[0], self._rope[1])
        return h + self.feed_forward(self.ffn_norm(h))


class Gpt(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        # Registration order as in GptImpl (own parameters first in named_parameters()).
        _param(self, "tok_embeddings", (c.vocab_size, c.dim))
        self.has_pos = c.attention() and c.positions == "learned"
        if self.has_pos:
            _param(self, "pos_embeddings", (c.seq_len, c.dim))
        self.rope = [None, None]
        if c.attention() and c.positions == "rope":
            half = c.head_dim() // 2
            inv = torch.pow(c.rope_theta,
                            -torch.arange(half, dtype=torch.float64) * 2.0 / c.head_dim())
            angles = torch.outer(torch.arange(c.seq_len, dtype=torch.float64), inv)
            self.register_buffer("rope_cos", angles.cos().to(torch.float32))
            self.register_buffer("rope_sin", angles.sin().to(torch.float32))
            self.rope[0], self.rope[1] = self.rope_cos, self.rope_sin
        self.layers = nn.ModuleList([TransformerBlock(c, self.rope) for _ in range(c.n_layers)])
        self.norm = Norm(c)
        if not c.tie_embeddings:
            _param(self, "output", (c.vocab_size, c.dim))

    def forward(self, tokens):
        h = F.embedding(tokens, self.tok_embeddings)
        if self.has_pos:
            h = h + self.pos_embeddings.narrow(0, 0, tokens.size(1))
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        return F.linear(h, self.tok_embeddings if self.config.tie_embeddings else self.output)


# --------------------------------------------------------------------------------------------
# Spec, init, batches
# --------------------------------------------------------------------------------------------

def load_spec(path):
    if not os.path.isfile(path):
        die(f"spec file '{path}' does not exist")
    try:
        with open(path) as f:
            spec = json.load(f)
    except json.JSONDecodeError as e:
        die(f"spec file '{path}' is not valid JSON: {e}")
    for key in ("model", "training", "optimizer", "lr_scheduler", "parallelism", "init", "batches"):
        if key not in spec:
            die(f"spec file '{path}': missing key '{key}'")
    return spec


def load_init(model, path):
    """Copies init.safetensors into the full (unsharded) model; names and shapes must match."""
    from safetensors.torch import load_file
    if not os.path.isfile(path):
        die(f"init file '{path}' does not exist")
    try:
        tensors = load_file(path)
    except Exception as e:  # noqa: BLE001
        die(f"init file '{path}' cannot be read as safetensors: {e}")
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        lines = [f"init file '{path}' does not match the model's parameters"]
        if missing:
            lines.append(f"  missing from the file ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"  not parameters of the model ({len(unexpected)}): {', '.join(unexpected)}")
        die("\n".join(lines))
    bad = [f"{n}: file {tuple(tensors[n].shape)}, model {tuple(p.shape)}"
           for n, p in params.items() if tuple(tensors[n].shape) != tuple(p.shape)]
    if bad:
        die(f"init file '{path}': shapes differ from the model's:\n  " + "\n  ".join(bad))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n].to(torch.float32))


class Batches:
    """batches.bin: int32 [steps][grad_accum_steps][world_size][2][micro_batch][seq_len]."""

    def __init__(self, spec, world_size):
        b, t, m = spec["batches"], spec["training"], spec["model"]
        path = b.get("file", "")
        if not os.path.isfile(path):
            die(f"batches file '{path}' does not exist")
        self.steps = int(b["steps"])
        self.ga = int(b["grad_accum_steps"])
        self.world = int(b["world_size"])
        self.mb = int(b["micro_batch_size"])
        self.seq = int(b["seq_len"])
        checks = [("batches.grad_accum_steps", self.ga, "training.grad_accum_steps", int(t["grad_accum_steps"])),
                  ("batches.micro_batch_size", self.mb, "training.micro_batch_size", int(t["micro_batch_size"])),
                  ("batches.seq_len", self.seq, "model.seq_len", int(m["seq_len"])),
                  ("batches.world_size", self.world, "WORLD_SIZE", world_size)]
        for a, va, bname, vb in checks:
            if va != vb:
                die(f"{a} = {va} but {bname} = {vb}")
        if self.steps < int(t["steps"]):
            die(f"batches.steps = {self.steps} < training.steps = {t['steps']}")
        expected = self.steps * self.ga * self.world * 2 * self.mb * self.seq * 4
        actual = os.path.getsize(path)
        if actual != expected:
            die(f"batches file '{path}' has {actual} bytes; expected {expected} "
                f"(int32 [{self.steps}][{self.ga}][{self.world}][2][{self.mb}][{self.seq}])")
        self.data = np.memmap(path, dtype="<i4", mode="r",
                              shape=(self.steps, self.ga, self.world, 2, self.mb, self.seq))
        vocab = int(m["vocab_size"])
        lo, hi = int(self.data.min()), int(self.data.max())
        if lo < 0 or hi >= vocab:
            die(f"batches file '{path}': token ids in [{lo}, {hi}], outside [0, {vocab})")

    def get(self, step, m, rank, device):
        a = np.asarray(self.data[step, m, rank])
        return (torch.from_numpy(a[0].astype(np.int64)).to(device),
                torch.from_numpy(a[1].astype(np.int64)).to(device))

    def get_global(self, step, m, device):  # every rank's micro-batch, concatenated
        a = np.asarray(self.data[step, m])  # [world][2][mb][seq]
        x = a[:, 0].reshape(-1, self.seq).astype(np.int64)
        y = a[:, 1].reshape(-1, self.seq).astype(np.int64)
        return torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)


# --------------------------------------------------------------------------------------------
# LR schedule (engine/schedule.cc), optimizer (engine/trainer.cc), clipping (ClipGradNorm)
# --------------------------------------------------------------------------------------------

def learning_rate(s, peak_lr, step, total_steps):
    warmup = int(s.get("warmup_steps", 0))
    if step < warmup:
        return peak_lr * float(step + 1) / float(warmup)
    decay = s.get("decay", "cosine")
    if decay == "constant":
        return peak_lr
    min_lr = float(s.get("min_lr", 0.0))
    decay_steps = max(1, total_steps - warmup - 1)
    progress = min(max(float(step - warmup) / decay_steps, 0.0), 1.0)
    factor = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
    return min_lr + (peak_lr - min_lr) * factor


IMPLEMENTATIONS = ("fused", "foreach", "per_tensor")


def make_optimizer(o, params, implementation):
    """torch.optim's AdamW / Adam / SGD stepping as fsdp.cpp's optimizer.implementation says:
    fused -> fused=True (ATen's _fused_adamw_ / _fused_adam_ / _fused_sgd_, as engine/optimizer.cc
    calls them), foreach -> foreach=True, per_tensor -> foreach=False (libtorch's loop)."""
    name = o.get("name", "adamw")
    lr = float(o["lr"])
    wd = float(o.get("weight_decay", 0.0))
    betas = (float(o.get("beta1", 0.9)), float(o.get("beta2", 0.999)))
    eps = float(o.get("eps", 1e-8))
    if implementation not in IMPLEMENTATIONS:
        die(f"optimizer.implementation '{implementation}' is not valid; valid: "
            f"{', '.join(IMPLEMENTATIONS)}")
    how = {"fused": dict(fused=True), "foreach": dict(foreach=True),
           "per_tensor": dict(foreach=False)}[implementation]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=float(o.get("momentum", 0.0)),
                               weight_decay=wd, **how)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, weight_decay=wd, **how)
    if name == "adamw":
        # torch.optim.AdamW: p *= 1 - lr * wd, then the Adam update (as libtorch's AdamW).
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd, **how)
    die(f"optimizer.name '{name}' is not valid; valid: adamw, adam, sgd")


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def clip_grad_norm(params, max_norm, device, all_reduce_group=None, all_reduce_fn=None):
    """FsdpModel::ClipGradNorm: fp32 sum of squares over this rank's gradient shards, summed
    over the shard group (replicas hold identical shards), coef = min(max / (norm + 1e-6), 1)."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    sum_sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        sum_sq += g.to(torch.float32).pow(2).sum()
    if all_reduce_group is not None:
        all_reduce_fn(sum_sq, group=all_reduce_group)
    norm = sum_sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp_max(1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm


@torch.no_grad()
def clip_grad_norm_fast(params, max_norm, all_reduce_group=None, all_reduce_fn=None):
    """The same clipping with foreach kernels and no host sync (what torchtitan's
    clip_grad_norm_ does): one norm per gradient, their squares summed, one all-reduce."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    norms = torch._foreach_norm([g.to(torch.float32) for g in grads])
    sum_sq = torch.stack(norms).pow(2).sum()
    if all_reduce_group is not None:
        all_reduce_fn(sum_sq, group=all_reduce_group)
    norm = sum_sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp_max(1.0)
    torch._foreach_mul_(grads, coef)
    return norm


# --------------------------------------------------------------------------------------------
# Communication accounting: wraps the torch.distributed functions FSDP2 calls.
# --------------------------------------------------------------------------------------------

class CommMeter:
    KINDS = {"all_gather_into_tensor": "output_tensor", "reduce_scatter_tensor": "input",
             "all_reduce": "tensor"}
    POS = {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 1, "all_reduce": 0}

    def __init__(self):
        self.active = False
        self.wait_s = 0.0
        self.bytes = 0
        self.calls = {k: 0 for k in self.KINDS}
        self.orig = {}

    def reset(self):
        self.wait_s, self.bytes = 0.0, 0
        self.calls = {k: 0 for k in self.KINDS}

    def install(self):
        for name in self.KINDS:
            fn = getattr(dist, name)
            self.orig[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        # Work.wait() on works issued with async_op=True (FSDP2 does not issue any on CPU by
        # default; counted in case a configuration does).
        work_cls = dist.distributed_c10d.Work
        orig_wait = work_cls.wait
        meter = self

        def timed_wait(work, *args, **kwargs):
            if not meter.active:
                return orig_wait(work, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return orig_wait(work, *args, **kwargs)
            finally:
                meter.wait_s += time.perf_counter() - t0
        try:
            work_cls.wait = timed_wait
            self.orig["Work.wait"] = orig_wait
        except (TypeError, AttributeError):
            pass

    def _wrap(self, name, fn):
        meter, key, pos = self, self.KINDS[name], self.POS[name]

        def wrapper(*args, **kwargs):
            if not meter.active:
                return fn(*args, **kwargs)
            t = kwargs.get(key, args[pos] if len(args) > pos else None)
            group = kwargs.get("group")
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            t0 = time.perf_counter()
            # With async_op=True the wait is counted by the Work.wait() wrapper instead; the
            # wrapper of a synchronous call must not count it a second time.
            was_active = meter.active
            meter.active = False
            try:
                return fn(*args, **kwargs)
            finally:
                meter.active = was_active
                meter.wait_s += time.perf_counter() - t0
                if size > 1 and t is not None:
                    meter.bytes += t.numel() * t.element_size()
                    meter.calls[name] += 1
        return wrapper


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------

def peak_rss_bytes():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fmt_metric(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def set_threads():
    n = os.environ.get("OMP_NUM_THREADS")
    if n and n.isdigit() and int(n) > 0:
        torch.set_num_threads(int(n))


MODES = ("fsdp2-parity", "fsdp2", "eager", "compile")
ONE_RANK_MODES = ("eager", "compile")


def train(args, spec, reference=False):
    """Trains as `args.mode` says (see Note [Reference modes] in the module docstring).
    Returns True when a process group is left for the caller to abandon."""
    mode = args.mode
    if mode not in MODES:
        die(f"--mode '{mode}' is not valid; valid: {', '.join(MODES)}")
    fast = mode != "fsdp2-parity" and not reference
    single = mode in ONE_RANK_MODES and not reference
    t, o = spec["training"], spec["optimizer"]
    p = spec["parallelism"]
    keep_between = not bool(p.get("reshard_between_micro_batches", True))
    # parallelism.offload: params is FSDP2's CPUOffloadPolicy (sharded parameters, gradients
    # and the optimizer step on the host); FSDP2 has no optimizer-only offload.
    offload = p.get("offload", "none")
    if offload not in ("none", "params", "optimizer"):
        die(f"parallelism.offload '{offload}' is not valid; valid: none, optimizer, params")
    if offload == "optimizer" and not reference and mode not in ONE_RANK_MODES:
        die("parallelism.offload optimizer has no FSDP2 equivalent: CPUOffloadPolicy offloads "
            "the parameters, their gradients and the optimizer step (parallelism.offload params); "
            "compare that, or use --reference eager")
    cfg = Config(spec["model"])
    steps = int(t["steps"])
    ga = int(t["grad_accum_steps"])
    mb = int(t["micro_batch_size"])
    max_grad_norm = float(t.get("max_grad_norm", 0.0))
    mp = t.get("mixed_precision", "fp32")
    reduce_dtype_name = t.get("reduce_dtype", "fp32")
    if mp not in ("fp32", "bf16"):
        die(f"training.mixed_precision '{mp}' is not valid; valid: fp32, bf16")
    if reduce_dtype_name not in ("fp32", "bf16"):
        die(f"training.reduce_dtype '{reduce_dtype_name}' is not valid; valid: fp32, bf16")
    set_threads()

    device_type = spec.get("device", "cpu")
    if device_type not in ("cpu", "cuda"):
        die(f"device '{device_type}' is not valid; valid: cpu, cuda")
    on_cuda = device_type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        die("device cuda: torch.cuda.is_available() is false (no GPU, or a CPU-only torch)")
    device = torch.device("cpu")
    if on_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if reference:
        rank, world = 0, int(spec["batches"]["world_size"])
    elif single:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != 1:
            die(f"--mode {mode} runs the plain model on one rank; WORLD_SIZE is {world}")
        rank = 0
    else:
        for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                die(f"{var} is not set: run under a launcher "
                    "(fsdp launch --nproc-per-node N -- python bench/fsdp2_reference.py ...)")
        backend = "gloo"
        if on_cuda and spec.get("backend", "auto") != "gloo":
            backend = "nccl"
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
        rank, world = dist.get_rank(), dist.get_world_size()

    strategy = p.get("strategy", "full_shard")
    valid = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard", "ddp")
    if strategy not in valid:
        die(f"parallelism.strategy '{strategy}' is not valid; valid: {', '.join(valid)}")
    replicate, shard = int(p.get("replicate", 1)), int(p.get("shard", world))
    if strategy in ("full_shard", "shard_grad_op"):
        replicate, shard = 1, world
    elif strategy in ("no_shard", "ddp"):
        replicate, shard = world, 1
    else:
        if replicate == -1:
            replicate = world // shard
        if shard == -1:
            shard = world // replicate
    if replicate * shard != world:
        die(f"mesh replicate {replicate} x shard {shard} != world size {world}")

    batches = Batches(spec, world)
    torch.manual_seed(0)
    model = Gpt(cfg)
    load_init(model, spec["init"])
    model.to(device)
    model.rope[0], model.rope[1] = getattr(model, "rope_cos", None), getattr(model, "rope_sin", None)

    meter = CommMeter()
    orig_all_reduce = dist.all_reduce
    shard_group = None
    hsdp = replicate > 1 and shard > 1 and not reference and not single
    forward = model
    autocast = None
    if single:
        if mp == "bf16":  # the plain model's mixed precision: fp32 weights, bf16 matmuls
            autocast = lambda: torch.autocast(device_type, dtype=torch.bfloat16)  # noqa: E731
        if mode == "compile":
            forward = torch.compile(model)
    elif not reference:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        offload_kw = {}
        if offload == "params":
            offload_kw["offload_policy"] = CPUOffloadPolicy(pin_memory=on_cuda)
        if replicate == 1:
            mesh = init_device_mesh(device_type, (shard,), mesh_dim_names=("shard",))
            shard_group = mesh.get_group("shard") if shard > 1 else None
        else:
            mesh = init_device_mesh(device_type, (replicate, shard),
                                    mesh_dim_names=("replicate", "shard"))
            shard_group = mesh.get_group("shard") if shard > 1 else None
        reshard = strategy in ("full_shard", "hybrid_shard")
        reduce_dtype = torch.bfloat16 if reduce_dtype_name == "bf16" else torch.float32
        param_dtype = torch.bfloat16 if mp == "bf16" else None
        # fsdp.cpp casts each unit's floating inputs to param_dtype and only the root's output
        # to output_dtype: blocks get output_dtype=None, the root float32.
        block_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                        output_dtype=None)
        root_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                       output_dtype=torch.float32 if mp == "bf16" else None)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=block_mp,
                        **offload_kw)
        # The root unit stays unsharded from forward to backward (fsdp.cpp's PostForward, and
        # FSDP2's own default for the root).
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=root_mp,
                    **offload_kw)
        meter.install()
    ref_bf16 = reference and mp == "bf16"  # emulated: bf16 copies of the parameters

    params = list(model.parameters())
    # fsdp2-parity steps as fsdp.cpp does (optimizer.implementation); the fast modes as
    # torchtitan does (fused).
    optimizer = make_optimizer(o, params, "fused" if fast else o.get("implementation", "fused"))
    tokens_per_step = world * mb * ga * cfg.seq_len
    peak_lr = float(o["lr"])

    out = args.out
    metrics_file = None
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        metrics_file = open(os.path.join(out, "metrics.jsonl"), "w")
        what = ("reference (one process, no FSDP)" if reference else
                f"{mode}: the plain model{' + torch.compile' if mode == 'compile' else ''}, "
                f"fused {o.get('name', 'adamw')}, no host sync per step" if single else
                f"{mode}: FSDP2 on {world} rank(s), mesh (replicate={replicate}, shard={shard}), "
                f"strategy {strategy}, "
                + ("CPUOffloadPolicy, " if offload == "params" else "") + ("fused optimizer, no host sync per step" if fast else
                f"{o.get('implementation', 'fused')} optimizer, loss read every step"))
        nparams = sum(q.numel() for q in params)
        where = torch.cuda.get_device_name(device) if on_cuda else "cpu"
        print(f"fsdp2_reference: {what}, model {cfg.arch} ({nparams} parameters), "
              f"{mp}, {tokens_per_step} tokens/step, on {where}, torch {torch.__version__}",
              flush=True)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)

    comm_wait_total, comm_bytes_total = 0.0, 0
    clip = max_grad_norm if max_grad_norm > 0 else 1e30

    def record(step, lr, loss_v, norm_v, step_time, wait_s, nbytes):
        if rank == 0:
            rec = {"step": step + 1, "loss": fmt_metric(loss_v), "grad_norm": fmt_metric(norm_v),
                   "lr": lr, "step_time_s": step_time, "comm_wait_s": wait_s,
                   "comm_bytes": nbytes, "tokens_per_s": tokens_per_step / step_time}
            metrics_file.write(json.dumps(rec) + "\n")
            metrics_file.flush()
            print(f"step {step + 1}/{steps} loss {loss_v:.6f} grad_norm {norm_v:.4f} lr {lr:.3e} "
                  f"{step_time * 1e3:.1f} ms/step comm_wait {wait_s * 1e3:.1f} ms "
                  f"comm {nbytes / 2**20:.2f} MiB {tokens_per_step / step_time:.0f} tok/s",
                  flush=True)
        if not math.isfinite(loss_v) or not math.isfinite(norm_v):
            die(f"step {step + 1}: the loss or the gradient norm is not finite")

    # The fast modes keep every step's loss and norm on the device and read them once at the
    # end; their step times come from CUDA events on GPU (read after the final synchronize),
    # from the wall clock on CPU, where every op has finished when it returns.
    kept = []  # per step: (lr, loss, norm, t0 or start event, t1 or end event, wait_s, bytes)
    for step in range(steps):
        lr = learning_rate(spec["lr_scheduler"], peak_lr, step, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        meter.reset()
        if fast and on_cuda:
            t0 = torch.cuda.Event(enable_timing=True)
            t0.record()
        else:
            t0 = time.perf_counter()
        meter.active = True
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for m in range(ga):
            if hsdp:
                model.set_requires_all_reduce(m == ga - 1)
            if keep_between and not reference and not single:
                # parallelism.reshard_between_micro_batches: false, as fsdp.cpp keeps them (Note
                # [Keeping parameters across micro-batches]): no unit reshards after a forward,
                # only the step's last backward reshards. Set before every forward: set once
                # before the first, FSDP2's lazy initialisation left the blocks resharding after
                # forward (seen here as two all-gathers per block and micro-batch, not one per step).
                model.set_reshard_after_forward(False)
                model.set_reshard_after_backward(m == ga - 1)
            x, y = (batches.get_global(step, m, device) if reference
                    else batches.get(step, m, rank, device))
            if ref_bf16:
                # Forward on bf16 copies (autograd casts the gradients back to fp32), the
                # output cast to fp32, as FSDP2's MixedPrecisionPolicy does. Gradients are
                # those of the global batch in bf16, so this agrees only to bf16 precision.
                cast = {n: q.to(torch.bfloat16) for n, q in model.named_parameters()}
                logits = torch.func.functional_call(model, cast, (x,)).to(torch.float32)
            elif autocast is not None:
                with autocast():
                    logits = forward(x)
            else:
                logits = forward(x)
            loss = F.cross_entropy(logits.flatten(0, 1).to(torch.float32), y.flatten()) / float(ga)
            loss.backward()
            loss_sum += loss.detach()
        meter.active = False
        if fast:
            norm = clip_grad_norm_fast(params, clip, shard_group, orig_all_reduce)
        else:
            norm = clip_grad_norm(params, clip, device, shard_group, orig_all_reduce)
        optimizer.step()
        optimizer.zero_grad()
        comm_wait_total += meter.wait_s
        comm_bytes_total += meter.bytes
        if fast:
            if on_cuda:
                t1 = torch.cuda.Event(enable_timing=True)
                t1.record()
            else:
                t1 = time.perf_counter()
            kept.append((lr, loss_sum, norm, t0, t1, meter.wait_s, meter.bytes))
            continue
        loss64 = loss_sum.to(torch.float64)
        if not reference:
            orig_all_reduce(loss64)
            loss64 = loss64 / world
        if on_cuda:
            torch.cuda.synchronize(device)
        step_time = time.perf_counter() - t0
        record(step, lr, float(loss64.item()), float(norm.item()), step_time, meter.wait_s,
               meter.bytes)
    if fast:
        losses = torch.stack([k[1] for k in kept]).to(torch.float64)
        if not single:  # one all-reduce for every step's loss: the mean over ranks
            orig_all_reduce(losses)
            losses = losses / world
        norms = torch.stack([k[2] for k in kept]).to(torch.float64)
        if on_cuda:
            torch.cuda.synchronize(device)
        losses, norms = losses.tolist(), norms.tolist()
        for step, (lr, _, _, t0, t1, wait_s, nbytes) in enumerate(kept):
            step_time = t0.elapsed_time(t1) / 1e3 if on_cuda else t1 - t0
            record(step, lr, losses[step], norms[step], step_time, wait_s, nbytes)

    stats_dir = os.path.join(out, "rank_stats")
    os.makedirs(stats_dir, exist_ok=True)
    with open(os.path.join(stats_dir, f"rank{rank}.json"), "w") as f:
        stats = {"rank": rank, "peak_rss_bytes": peak_rss_bytes(), "steps": steps,
                 "comm_wait_s_total": comm_wait_total, "comm_bytes_total": comm_bytes_total,
                 "comm_calls_last_step": meter.calls,
                 "device": torch.cuda.get_device_name(device) if on_cuda else "cpu"}
        if on_cuda:
            stats["peak_tensor_bytes"] = torch.cuda.max_memory_allocated(device)
        json.dump(stats, f)
        f.write("\n")
    if metrics_file:
        metrics_file.close()
    if not reference and not single:
        # Every rank is past its last collective. Tearing the Gloo process group down
        # (destroy_process_group, or the interpreter's exit) can abort a rank with "terminate
        # called without an active exception" while a peer has already gone (seen 1 run in 4
        # on 2 CPU ranks); nothing is left to release, so the caller ends the process at once.
        dist.barrier()
        return True
    return False


# --------------------------------------------------------------------------------------------
# Development helpers: test inputs, comparison
# --------------------------------------------------------------------------------------------

PRESETS = {
    "gpt": dict(arch="gpt", norm="layernorm", activation="gelu", positions="learned",
                tie_embeddings=True),
    "llama": dict(arch="llama", norm="rmsnorm", activation="swiglu", positions="rope",
                  tie_embeddings=False),
    "mlp": dict(arch="mlp", norm="layernorm", activation="gelu", positions="learned",
                tie_embeddings=True),
}


def make_test_inputs(args):
    from safetensors.torch import save_file
    d = os.path.abspath(args.make_test_inputs)
    os.makedirs(d, exist_ok=True)
    model_spec = dict(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, seq_len=args.seq, ffn_hidden=0, norm_eps=1e-5,
                      rope_theta=10000.0, **PRESETS[args.preset])
    world = args.world
    replicate, shard = {"no_shard": (world, 1), "hybrid_shard": (2, world // 2),
                        "hybrid_shard_zero2": (2, world // 2)}.get(args.strategy, (1, world))
    spec = {
        "model": model_spec,
        "training": {"steps": args.steps, "micro_batch_size": args.mb,
                     "grad_accum_steps": args.ga, "max_grad_norm": args.max_grad_norm,
                     "mixed_precision": args.mp, "reduce_dtype": args.reduce_dtype},
        "optimizer": {"name": args.optimizer, "lr": 3e-3, "weight_decay": 0.1, "beta1": 0.9,
                      "beta2": 0.95, "eps": 1e-8, "momentum": 0.9},
        "lr_scheduler": {"warmup_steps": 3, "decay": "cosine", "min_lr": 3e-4},
        "parallelism": {"strategy": args.strategy, "replicate": replicate, "shard": shard},
        "init": os.path.join(d, "init.safetensors"),
        "batches": {"file": os.path.join(d, "batches.bin"), "steps": args.steps,
                    "grad_accum_steps": args.ga, "world_size": world,
                    "micro_batch_size": args.mb, "seq_len": args.seq},
    }
    cfg = Config(model_spec)
    model = Gpt(cfg)
    g = torch.Generator().manual_seed(args.seed)
    tensors = {}
    for name, prm in model.named_parameters():
        if "norm." in name:  # perturbed around 1 / 0 so that the norms' gradients matter
            base = 1.0 if name.endswith(".weight") else 0.0
            v = base + 0.05 * torch.randn(prm.shape, generator=g)
        elif name.split(".")[-1] in ("bq", "bk", "bv", "bo", "b1", "b2"):
            v = 0.01 * torch.randn(prm.shape, generator=g)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith((".wo", ".w2")) else 0.02
            v = std * torch.randn(prm.shape, generator=g)
        tensors[name] = v.to(torch.float32).contiguous()
    save_file(tensors, spec["init"])
    # A learnable stream: x[i+1] = (a x[i] + c) mod vocab, with 10% random tokens.
    rng = np.random.default_rng(args.seed)
    n_seq = args.steps * args.ga * world * args.mb
    total = args.seq + 1
    a = rng.integers(1, 8, size=(n_seq, 1))
    c = rng.integers(0, args.vocab, size=(n_seq, 1))
    s = np.zeros((n_seq, total), dtype=np.int64)
    s[:, 0] = rng.integers(0, args.vocab, size=n_seq)
    for i in range(1, total):
        s[:, i] = (a[:, 0] * s[:, i - 1] + c[:, 0]) % args.vocab
    noise = rng.random((n_seq, total)) < 0.1
    s[noise] = rng.integers(0, args.vocab, size=int(noise.sum()))
    s = s.reshape(args.steps, args.ga, world, args.mb, total)
    out = np.stack([s[..., :-1], s[..., 1:]], axis=3).astype("<i4")  # [st][ga][w][2][mb][seq]
    out.tofile(spec["batches"]["file"])
    with open(os.path.join(d, "spec.json"), "w") as f:
        json.dump(spec, f, indent=1)
    print(os.path.join(d, "spec.json"))


def read_metrics(path):
    if not os.path.isfile(path):
        die(f"metrics file '{path}' does not exist")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip() and '"loss"' in line]


def compare(a_path, b_path, rtol):
    a, b = read_metrics(a_path), read_metrics(b_path)
    if len(a) != len(b) or not a:
        print(f"compare: {a_path} has {len(a)} steps, {b_path} has {len(b)}")
        return 1
    worst = {"loss": 0.0, "grad_norm": 0.0}
    for ra, rb in zip(a, b):
        for k in worst:
            va, vb = ra[k], rb[k]
            if va is None or vb is None:
                print(f"compare: step {ra['step']}: {k} is not finite")
                return 1
            worst[k] = max(worst[k], abs(va - vb) / max(abs(vb), 1e-12))
    print(f"compare: {len(a)} steps, max relative difference: loss {worst['loss']:.3e}, "
          f"grad_norm {worst['grad_norm']:.3e} (rtol {rtol:g}); "
          f"final loss {a[-1]['loss']:.6f} vs {b[-1]['loss']:.6f}")
    if worst["loss"] > rtol or worst["grad_norm"] > rtol:
        print("compare: MISMATCH")
        return 1
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec")
    ap.add_argument("--out")
    ap.add_argument("--reference", action="store_true",
                    help="one process, no FSDP, on the global batch (verification)")
    ap.add_argument("--make-test-inputs", metavar="DIR")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--mode", default="fsdp2-parity", choices=MODES,
                    help="fsdp2-parity (the default here): fsdp.cpp's arithmetic step for step; "
                         "fsdp2: FSDP2 as torchtitan runs it; eager / compile: the plain model, "
                         "one rank (see the module docstring)")
    g = ap.add_argument_group("--make-test-inputs options")
    g.add_argument("--preset", choices=sorted(PRESETS), default="gpt")
    g.add_argument("--world", type=int, default=2)
    g.add_argument("--strategy", default="full_shard")
    g.add_argument("--steps", type=int, default=10)
    g.add_argument("--mb", type=int, default=4)
    g.add_argument("--ga", type=int, default=1)
    g.add_argument("--seq", type=int, default=32)
    g.add_argument("--vocab", type=int, default=256)
    g.add_argument("--dim", type=int, default=64)
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--mp", default="fp32")
    g.add_argument("--reduce-dtype", default="fp32")
    g.add_argument("--optimizer", default="adamw")
    g.add_argument("--max-grad-norm", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    if args.make_test_inputs:
        make_test_inputs(args)
        return 0
    if args.compare:
        return compare(args.compare[0], args.compare[1], args.rtol)
    if not args.spec or not args.out:
        ap.error("--spec and --out are required")
    spec = load_spec(args.spec)
    if train(args, spec, reference=args.reference):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # see the end of train(): no process-group teardown
    return 0


if __name__ == "__main__":
    sys.exit(main())
