"""Stage 04: CUDA kernels for the GPT, measured against the roofline (book chapters 10-13).

What this stage teaches
    10. GPU performance: the roofline (peak FLOP/s and bandwidth, datasheet and measured),
        arithmetic intensity, and the floor each kernel below cannot beat.
    11. CUDA: grids, blocks and threads, coalescing, 16-byte loads, on a vector add; kernels are
        inline strings built once with torch.utils.cpp_extension.load_inline.
    12. Fast matrix multiplication, in steps to diff: naive -> shared-memory tiled ->
        register-tiled (fp32) -> tensor cores (bf16, mma.sync, fed by cp.async); then, going
        faster on Hopper, the same kernel fed by TMA -> wgmma.
    13. Reductions and numerics: atomics -> shared-memory tree -> warp shuffles, for sum and max;
        the online softmax, layer norm (Welford), GELU and the fused bias + GELU.
    Each kernel has a wrapper that checks its inputs; the stage-03 GPT runs its forward on the
    kernels (`--kernels cuda`) and its logits are checked against the torch path.
    csrc/ holds the same kernels as standalone CUDA C++ programs (make -C csrc run).

New since stage 03: chapters 10-13 and the `main()` below. Changed: `--bench` prints the kernel
table; with no flags the script runs the kernel chapter instead of training (`--train` trains as
stage 03 did). Dropped: stage 03's training-throughput bench with its baseline (`plain_twin`
and its twins) and the flags only it and a tuned training run used (`--bench-steps`,
`--compile`, `--eval-every`); they stay in 03.

Run
    python 04_cuda_kernels.py                 # kernels vs torch in float64, GPT on the kernels
    python 04_cuda_kernels.py --bench         # every kernel vs torch/cuBLAS, fraction of roofline
    python 04_cuda_kernels.py --gpt2 124M --kernels cuda --prompt "..."   # real weights
Without an NVIDIA GPU it says so in one line, runs the CPU parts (roofline arithmetic,
summation order, the GPT on torch) and exits 0.
"""

import argparse
import base64
import contextlib
import functools
import hashlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import requests
import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

try:
    import fcntl  # file locks, so that two processes never download into one file
except ImportError:  # Windows
    fcntl = None

# ----------------------------------------------------------------------------------------------
# Chapter 4. Text as numbers
# ----------------------------------------------------------------------------------------------

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT_ID = 50256  # <|endoftext|>


def read_ranks(path):
    """BPE ranks in tiktoken's format, one `base64(token bytes) rank` per line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"ranks file not found: {path}")
    ranks = {}
    for n, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:  # not two fields, bad base64 (binascii.Error) or a bad integer
            raise DataError(f"{path}, line {n}: expected '<base64 token> <rank>', got "
                            f"{line[:80]!r}") from None
    return ranks


def gpt2_tokenizer(data_dir=None):
    """GPT-2's tokenizer as a tiktoken Encoding, built from data/gpt2.tiktoken (no hidden download).
    The file is parsed here: tiktoken's own loader keeps a parsed copy in a temporary directory,
    keyed by the path, and would go on serving it after the file there is replaced."""
    ranks = read_ranks(data_file("gpt2.tiktoken", data_dir))
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT_ID})


class GPTDataset(Dataset):
    """Sliding windows over one long token stream: input ids[i:i+T], target ids[i+1:i+T+1]."""

    def __init__(self, token_ids, context_length, stride):
        if len(token_ids) < context_length + 1:
            raise ValueError(f"need at least {context_length + 1} tokens for one window of "
                             f"{context_length}, got {len(token_ids)}")
        if stride < 1:
            raise ValueError(f"stride must be positive, got {stride}")
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        starts = range(0, len(ids) - context_length, stride)
        self.inputs = torch.stack([ids[i:i + context_length] for i in starts])            # (N, T)
        self.targets = torch.stack([ids[i + 1:i + 1 + context_length] for i in starts])   # (N, T)

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, i):
        return self.inputs[i], self.targets[i]


def create_dataloader(token_ids, batch_size, context_length, stride=None, shuffle=True,
                      drop_last=True, seed=0):
    """Batches of (inputs, targets), each (B, T). stride defaults to T (no overlap)."""
    dataset = GPTDataset(token_ids, context_length,
                         context_length if stride is None else stride)
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                      generator=generator)


# ----------------------------------------------------------------------------------------------
# Chapter 5. Attention
# ----------------------------------------------------------------------------------------------

class MultiHeadAttention(nn.Module):
    """H causal heads computed at once: one projection to 3C, split into (B, H, T, D) heads.
    This is the attention the GPT uses; its names follow GPT-2's checkpoints."""

    def __init__(self, n_embd, n_head, context_length, dropout=0.0, bias=True):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # q, k, v for all heads
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)      # mixes the heads' outputs
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        mask = torch.ones(context_length, context_length, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)                      # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))                                 # 3 x (B, H, T, D)
        y = self.attend(q, k, v)                                       # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)               # (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def attend(self, q, k, v):
        """Causal attention with an explicit mask: materializes the (B, H, T, T) scores."""
        T = q.size(2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))      # (B, H, T, T)
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        att = torch.softmax(att, dim=-1)
        return self.attn_dropout(att) @ v                             # (B, H, T, D)


# ----------------------------------------------------------------------------------------------
# Chapter 6. The transformer block and GPT
# ----------------------------------------------------------------------------------------------

GPT2_SIZES = {  # name: (n_layer, n_head, n_embd), from the GPT-2 paper's table 2
    "124M": (12, 12, 768),
    "355M": (24, 16, 1024),
    "774M": (36, 20, 1280),
    "1558M": (48, 25, 1600),
}


@dataclass
class GPTConfig:
    vocab_size: int = 50257     # GPT-2's BPE: 50,000 merges + 256 bytes + <|endoftext|>
    context_length: int = 1024  # longest sequence; the position table has this many rows
    n_embd: int = 768           # C, the width of the residual stream
    n_head: int = 12            # H; each head has D = C // H dimensions
    n_layer: int = 12
    dropout: float = 0.0
    bias: bool = True           # biases in the Linear layers (GPT-2 has them)
    vocab_multiple: int = 1     # wte and lm_head get vocab_size rounded up to a multiple of this

    def __post_init__(self):
        for name in ("vocab_size", "context_length", "n_embd", "n_head", "n_layer",
                     "vocab_multiple"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got "
                                 f"{getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        # the rows of wte and lm_head: vocab_size rounded up; ids from vocab_size on are padding
        self.padded_vocab_size = -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @classmethod
    def gpt2(cls, size="124M", **overrides):
        if size not in GPT2_SIZES:
            raise ValueError(f"unknown GPT-2 size {size!r}; choose one of {list(GPT2_SIZES)}")
        n_layer, n_head, n_embd = GPT2_SIZES[size]
        return cls(**{"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd, **overrides})


class LayerNorm(nn.Module):
    """Normalize each position's C features to mean 0 and variance 1, then scale and shift."""

    def __init__(self, n_embd, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_embd))
        self.bias = nn.Parameter(torch.zeros(n_embd))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)  # biased, as GPT-2 was trained
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class GELU(nn.Module):
    """GPT-2's GELU: the tanh approximation of x * Phi(x)."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


class MLP(nn.Module):
    def __init__(self, n_embd, dropout=0.0, bias=True):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)    # (B, T, C) -> (B, T, 4C)
        self.act = GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)  # back to (B, T, C)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd)
        self.attn = MultiHeadAttention(cfg.n_embd, cfg.n_head, cfg.context_length,
                                       cfg.dropout, cfg.bias)
        self.ln_2 = LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg.n_embd, cfg.dropout, cfg.bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def check_token_ids(ids, vocab_size):
    """Raise a ValueError naming the range if any id lies outside [0, vocab_size). On a GPU this
    reads min and max back to the host, a sync that would stall every training step: GPT.forward
    checks GPU ids only outside training, and train() checks each batch while it is on the CPU."""
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got "
                         f"[{ids.min().item()}, {ids.max().item()}]")


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)  # token embeddings
        self.wpe = nn.Embedding(cfg.context_length, cfg.n_embd)  # learned absolute positions
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2: one (V, C) matrix
        self.apply(self._init_weights)
        # GPT-2 scales the init of the projections that write into the residual stream by
        # 1/sqrt(2 * n_layer), so the stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding=False):
        n = sum(p.numel() for p in self.parameters())  # the tied matrix is counted once
        return n - self.wpe.weight.numel() if non_embedding else n

    def forward(self, idx):
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError(f"idx must be a (B, T) tensor of int64 token ids, "
                             f"got {tuple(idx.shape)} {idx.dtype}")
        B, T = idx.shape
        if T > self.cfg.context_length:
            raise ValueError(f"sequence length {T} exceeds the context length "
                             f"{self.cfg.context_length}")
        if idx.device.type == "cpu" or not self.training:
            check_token_ids(idx, self.cfg.vocab_size)
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))             # (B, T, padded V)


@torch.no_grad()
def generate_greedy(model, idx, max_new_tokens):
    """Append the most likely next token max_new_tokens times. idx (B, T) -> (B, T + new)."""
    for _ in range(max_new_tokens):
        logits = model(idx[:, -model.cfg.context_length:])  # crop to what the model can see
        next_id = logits[:, -1, :model.cfg.vocab_size].argmax(dim=-1, keepdim=True)  # (B, 1)
        idx = torch.cat([idx, next_id], dim=1)
    return idx


# ----------------------------------------------------------------------------------------------
# Chapter 7. Training
# ----------------------------------------------------------------------------------------------

def loss_fn(logits, targets):
    """Mean next-token cross-entropy. logits (B, T, V), targets (B, T)."""
    # no .float(): CUDA autocast already runs log_softmax in fp32 (a copy torch.compile fuses away)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def autocast(device):
    """bf16 autocast on a GPU (matmuls in bf16, reductions in fp32); plain fp32 on the CPU."""
    on_gpu = torch.device(device).type == "cuda"
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu)


@torch.no_grad()
def evaluate(model, loader, device, max_batches=None):
    """Mean loss over (at most max_batches of) a loader, with dropout off."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for x, y in loader:
        if max_batches is not None and n >= max_batches:
            break
        with autocast(device):
            total += loss_fn(model(x.to(device)), y.to(device)).item()
        n += 1
    model.train(was_training)
    return total / max(n, 1)


def lr_at(step, max_lr, warmup_steps, total_steps, min_lr_ratio=0.1):
    """Linear warmup to max_lr, then cosine decay to min_lr_ratio * max_lr at total_steps."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return max_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, lr, weight_decay, device):
    """AdamW with weight decay on the matrices only (decaying biases and norm gains only hurts).
    On a GPU the fused implementation updates every parameter in one kernel launch."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = torch.device(device).type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused)


def flops_per_token(model, T):
    """Training FLOPs per token: 6 per weight (2 forward, 4 backward) plus 12 * n_layer * C * T
    for attention's scores and weighted sum (the count of the PaLM paper, appendix B)."""
    cfg = model.cfg
    return 6 * model.num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_embd * T


# Dense bf16 tensor-core peaks from the vendors' datasheets, for MFU.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "4090": 165e12}


def peak_flops(device):
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


@dataclass
class TrainConfig:
    epochs: int = 10
    lr: float = 1e-3            # peak learning rate, reached after warmup
    weight_decay: float = 0.1
    warmup_steps: int = 10
    grad_clip: float = 1.0      # max global gradient norm
    eval_every: int = 10        # steps between validation evaluations
    eval_batches: int = 10      # validation batches per evaluation (None: all)

    def __post_init__(self):
        for name, ok in (("epochs", self.epochs >= 1), ("lr", self.lr > 0),
                         ("weight_decay", self.weight_decay >= 0),
                         ("warmup_steps", self.warmup_steps >= 0),
                         ("grad_clip", self.grad_clip > 0), ("eval_every", self.eval_every >= 1),
                         ("eval_batches", self.eval_batches is None or self.eval_batches >= 1)):
            if not ok:
                raise ValueError(f"TrainConfig.{name} = {getattr(self, name)!r} is out of range")


def train(model, train_loader, val_loader, tcfg, device, log=print):
    """Train for tcfg.epochs; log and record (step, train loss, val loss) every eval_every steps.
    Returns the history as a list of dicts."""
    opt = make_optimizer(model, tcfg.lr, tcfg.weight_decay, device)
    total_steps = tcfg.epochs * len(train_loader)
    peak = peak_flops(device)
    history, step, window_loss, window_steps = [], 0, 0.0, 0
    t_last, tokens_last = time.time(), 0
    val = evaluate(model, val_loader, device, tcfg.eval_batches)
    log(f"step {0:>5}/{total_steps} | val loss {val:.3f} (untrained)")
    history.append({"step": 0, "train_loss": None, "val_loss": val})
    model.train()
    for epoch in range(tcfg.epochs):
        for x, y in train_loader:
            for ids in (x, y):  # still on the CPU: no host sync (see check_token_ids)
                check_token_ids(ids, model.cfg.vocab_size)
            lr = lr_at(step, tcfg.lr, tcfg.warmup_steps, total_steps)
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device):
                loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            opt.step()
            step += 1
            tokens_last += x.numel()
            window_loss += loss.detach()  # stays on the device: no host sync per step
            window_steps += 1
            if step % tcfg.eval_every == 0 or step == total_steps:
                train_loss = (window_loss / window_steps).item()
                val = evaluate(model, val_loader, device, tcfg.eval_batches)
                dt = time.time() - t_last
                tok_s = tokens_last / dt
                mfu = (f" | MFU {flops_per_token(model, x.size(1)) * tok_s / peak:.1%}"
                       if peak else "")
                log(f"step {step:>5}/{total_steps} | epoch {epoch + 1} | train loss "
                    f"{train_loss:.3f} | val loss {val:.3f} | lr {lr:.2e} | "
                    f"{tok_s:,.0f} tok/s{mfu}")
                history.append({"step": step, "train_loss": train_loss, "val_loss": val})
                window_loss, window_steps, tokens_last, t_last = 0.0, 0, 0, time.time()
    return history


# ----------------------------------------------------------------------------------------------
# Chapter 8. Generation
# ----------------------------------------------------------------------------------------------

def filter_logits(logits, top_k=None, top_p=None):
    """Set to -inf every logit that top-k and then top-p rule out. logits (B, V).

    top_k keeps the k largest. top_p keeps the smallest set of most likely tokens whose
    probabilities add up to at least top_p (the most likely token always survives).
    """
    if top_k is not None:
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive int, got {top_k!r}")
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if top_p is not None and top_p < 1.0:  # 1.0 keeps all (a float32 cumsum may reach 1 early)
        sorted_logits, order = logits.sort(dim=-1, descending=True)   # (B, V)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=0.0, top_k=None, top_p=None, eos_id=None,
             generator=None):
    """Extend idx (B, T) by up to max_new_tokens tokens. temperature 0 is greedy; otherwise
    sample from softmax(logits / temperature) after top-k / top-p filtering. With eos_id, a
    sequence that produced it keeps producing it, and the loop stops once all have."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        logits = model(idx[:, -model.cfg.context_length:])[:, -1]  # (B, padded V)
        logits = logits[:, :model.cfg.vocab_size].float()  # (B, V): never a padding id
        if temperature == 0.0:
            next_id = logits.argmax(dim=-1, keepdim=True)                      # (B, 1)
        else:
            probs = filter_logits(logits / temperature, top_k, top_p).softmax(dim=-1)
            next_id = torch.multinomial(probs, 1, generator=generator)
        if eos_id is not None:
            next_id = next_id.masked_fill(done[:, None], eos_id)
            done |= next_id[:, 0] == eos_id
        idx = torch.cat([idx, next_id], dim=1)
        if eos_id is not None and bool(done.all()):
            break
    return idx


def save_checkpoint(model, path):
    """Weights and config in one safetensors file. The tied lm_head is stored once (as wte)."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, str(path), metadata={"config": json.dumps(asdict(model.cfg))})


def load_state(model, state, source):
    """Copy `state` into model, naming any tensor that is missing, unexpected or misshapen."""
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DataError(f"{source}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise DataError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, the "
                            f"config expects {tuple(expected[name].shape)}")
    with torch.no_grad():
        for name, tensor in state.items():
            expected[name].copy_(tensor)
    return model


def read_safetensors(path, device="cpu"):
    """(tensors, metadata) of a safetensors file; a missing, truncated or foreign file is a
    DataError that names it rather than the library's bare message."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except Exception as e:  # SafetensorError has no public base class to catch
        raise DataError(f"{path}: not a readable safetensors file ({e})") from None


def config_from(cls, values, source):
    """cls(**values), with any bad or missing field reported against the file it came from."""
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise DataError(f"{source}: bad {cls.__name__} ({e})") from None


def load_checkpoint(path, device="cpu"):
    """Rebuild a GPT saved by save_checkpoint."""
    state, meta = read_safetensors(path, device)
    if "config" not in meta:
        raise DataError(f"{path} has no GPT config in its metadata; was it written by "
                        f"save_checkpoint?")
    try:
        values = json.loads(meta["config"])
    except ValueError as e:
        raise DataError(f"{path}: the config in its metadata is not JSON ({e})") from None
    model = GPT(config_from(GPTConfig, values, path)).to(device)
    return load_state(model, state, str(path))


# ----------------------------------------------------------------------------------------------
# Chapter 9. Real weights: GPT-2 from the Hugging Face layout
# ----------------------------------------------------------------------------------------------

GPT2_REPOS = {"124M": "openai-community/gpt2", "355M": "openai-community/gpt2-medium",
              "774M": "openai-community/gpt2-large", "1558M": "openai-community/gpt2-xl"}
HF_URL = "https://huggingface.co/{repo}/resolve/main/{file}"


def gpt2_files(size, data_dir=None):
    """(url, path, sha256) of a GPT-2 size's config.json and model.safetensors in
    data/gpt2-<size>/, for `fetch`. No pinned sha256: the Hub names it while downloading."""
    folder = _data_dir(data_dir) / f"gpt2-{size}"
    return [(HF_URL.format(repo=GPT2_REPOS[size], file=file), folder / file, None)
            for file in ("config.json", "model.safetensors")]


def download_gpt2(size, data_dir=None):
    """Fetch config.json and model.safetensors of a GPT-2 size; return their folder."""
    return fetch(gpt2_files(size, data_dir))[0].parent


def read_hf_config(path, keys):
    """A Hugging Face config.json as a dict, with every key in `keys` present."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, or not JSON
        raise DataError(f"{path}: not a readable JSON config ({e})") from None
    if not isinstance(config, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(config).__name__}")
    missing = [key for key in keys if key not in config]
    if missing:
        raise DataError(f"{path} lacks {missing}")
    return config


def load_gpt2(path_or_size, device="cpu", data_dir=None):
    """GPT-2 weights from a directory holding config.json + model.safetensors (the Hugging Face
    layout), or from a size name ("124M", "355M", "774M", "1558M"), downloaded on first use."""
    if str(path_or_size) in GPT2_REPOS:
        folder = download_gpt2(str(path_or_size), data_dir)
    else:
        folder = Path(path_or_size)
        if not folder.is_dir():
            raise DataError(f"{folder} is neither a GPT-2 size {list(GPT2_REPOS)} nor a "
                            f"directory with config.json and model.safetensors")
    missing = [file for file in ("config.json", "model.safetensors")
               if not (folder / file).is_file()]
    if missing:
        raise DataError(f"{folder} lacks {' and '.join(missing)}")
    hf = read_hf_config(folder / "config.json", ("vocab_size", "n_positions", "n_embd",
                                                  "n_head", "n_layer"))
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise DataError(f"unsupported activation {hf['activation_function']!r}: this GPT "
                        f"uses GELU's tanh form")
    if abs(hf.get("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12:
        raise DataError(f"unsupported layer_norm_epsilon {hf['layer_norm_epsilon']}")
    sizes = dict(vocab_size=hf["vocab_size"], context_length=hf["n_positions"],
                 n_embd=hf["n_embd"], n_head=hf["n_head"], n_layer=hf["n_layer"])
    cfg = config_from(GPTConfig, sizes, folder / "config.json")
    state = {}
    tensors, _ = read_safetensors(folder / "model.safetensors")
    for key, tensor in tensors.items():
        name = key.removeprefix("transformer.")  # newer saves nest the body one level down
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue  # old causal-mask buffers; the head is tied to wte
        # GPT-2's Conv1D layers store their weights as (in, out); nn.Linear wants (out, in).
        if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            tensor = tensor.t()
        state[name] = tensor
    model = load_state(GPT(cfg), state, str(folder / "model.safetensors"))
    return model.to(device).eval()


# =============================================================================================
# NEW in stage 04. Chapter 10: GPU performance. The roofline: two ceilings, and which one a
# kernel hits
# =============================================================================================
# A kernel that does FLOPS floating-point operations and must move BYTES through device memory
# cannot finish faster than max(FLOPS / peak rate, BYTES / bandwidth): that is its floor. Their
# ratio, FLOPS / BYTES, is the kernel's arithmetic intensity; the ridge point peak / bandwidth
# (on an H200 about 15 FLOP/byte for fp32 FMAs, about 200 for bf16 tensor cores) separates the
# two regimes. Every kernel of this stage except matmul sits far left of the ridge:
#   vector add  1 FLOP per 12 bytes (two loads, one store)        -> bandwidth-bound
#   reductions  1 FLOP per 4 bytes                                -> bandwidth-bound
#   softmax, layer norm, GELU: ~5-20 FLOPs per 8 bytes            -> bandwidth-bound
#   matmul (S, S, S): 2 S^3 FLOPs over 3 S^2 elements, S/6 FLOP/byte in fp32 -> compute-bound
# so the memory-bound kernels are judged in GB/s against a measured copy, and the matmuls in
# TFLOP/s against cuBLAS on the same chip.

# H200 SXM datasheet, dense (no sparsity). Leads, not limits: measure_limits() times the real ones.
H200_DATASHEET = {"copy_gbps": 4800.0, "fp32_tflops": 67.0, "bf16_tflops": PEAK_BF16_FLOPS["H200"] / 1e12}

BENCH_N = 1 << 26                      # vector add: 3 arrays of 256 MB, far past the L2 cache
BENCH_ROWS, BENCH_COLS = 16384, 4096   # row kernels (reductions, softmax, norms, GELU): 256 MB in
BENCH_MM = 4096                        # matmuls: 4096^3


@dataclass
class Limits:
    copy_gbps: float    # device-to-device copy, bytes read + bytes written per second
    fp32_tflops: float  # fp32 matmul without tensor cores (cuBLAS, TF32 off)
    bf16_tflops: float  # bf16 matmul on tensor cores (cuBLAS)
    source: str         # where the figures come from: the datasheet, or the GPU they were measured on


@contextlib.contextmanager
def fp32_matmul_precision(precision):
    """torch.set_float32_matmul_precision for a block ("highest": no TF32), then back."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def time_ms(fn, budget_ms=300.0):
    """Median time of fn() in ms: CUDA events around each run, after a warm-up, with the L2
    cache flushed before each run so no run finds its inputs already on chip."""
    fn()
    torch.cuda.synchronize()
    flush = torch.empty(1 << 26, dtype=torch.float32, device="cuda")  # 256 MB, more than L2 holds
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = max(3, min(50, int(budget_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(reps):
        flush.zero_()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_limits():
    """Time the two ceilings on this GPU (a 1 GiB device-to-device copy; cuBLAS matmuls at
    8192^3 in fp32 with TF32 off and in bf16) and print them beside the datasheet."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() * 4 / time_ms(lambda: dst.copy_(src)) / 1e6
    del src, dst
    S = 8192
    a, b = torch.randn(S, S, device="cuda"), torch.randn(S, S, device="cuda")
    with fp32_matmul_precision("highest"):  # no TF32: the fp32 kernels do true fp32 FMAs
        fp32_tflops = 2 * S**3 / time_ms(lambda: a @ b) / 1e9
    a, b = a.bfloat16(), b.bfloat16()
    bf16_tflops = 2 * S**3 / time_ms(lambda: a @ b) / 1e9
    limits = Limits(copy_gbps, fp32_tflops, bf16_tflops, f"measured on {torch.cuda.get_device_name()}")
    print(f"limits of {torch.cuda.get_device_name()}: datasheet (H200 SXM) vs measured")
    rows = [("copy_gbps", "copy bandwidth", "GB/s"), ("fp32_tflops", "fp32 FMA (cuBLAS, TF32 off)", "TFLOP/s"),
            ("bf16_tflops", "bf16 tensor cores (cuBLAS)", "TFLOP/s")]
    for key, label, unit in rows:
        sheet, got = H200_DATASHEET[key], getattr(limits, key)
        print(f"  {label:30s} {sheet:8.0f} {got:8.0f} {unit:8s} ({got / sheet:.0%} of the datasheet)")
    return limits


def kernel_work():
    """Each kernel at the bench sizes: (size, FLOPs, minimum bytes moved, limiting unit).
    Minimum bytes: every input read once, every output written once."""
    n, R, C, S = BENCH_N, BENCH_ROWS, BENCH_COLS, BENCH_MM
    rc = f"{R}x{C}"
    return {
        "vector_add": (f"n={n}", n, 12 * n, "copy"),
        "matmul fp32": (f"{S}^3", 2 * S**3, 3 * 4 * S * S, "fp32"),
        "matmul bf16": (f"{S}^3", 2 * S**3, 3 * 2 * S * S, "bf16"),
        "reduce_sum": (rc, R * C, 4 * R * C + 4 * R, "copy"),  # one result a row
        "reduce_max": (rc, R * C, 4 * R * C + 4 * R, "copy"),
        "softmax": (rc, 5 * R * C, 8 * R * C, "copy"),         # max, subtract, exp, sum, scale
        "layer_norm": (rc, 8 * R * C, 8 * R * C + 8 * C, "copy"),
        "gelu": (rc, 10 * R * C, 8 * R * C, "copy"),           # tanh counted as a few FLOPs
        "bias_gelu": (rc, 11 * R * C, 8 * R * C + 4 * C, "copy"),
    }


def roofline_ms(flops, nbytes, unit, limits):
    """(FLOPs / peak, bytes / bandwidth) in ms: the larger is the floor no implementation beats."""
    peak = limits.bf16_tflops if unit == "bf16" else limits.fp32_tflops
    return flops / peak / 1e9, nbytes / limits.copy_gbps / 1e6


def describe_roofline(limits=None):
    """Print each kernel's arithmetic intensity and floor (datasheet numbers without a GPU)."""
    if limits is None:
        limits = Limits(**H200_DATASHEET, source="H200 SXM datasheet")
    ridge_fp32, ridge_bf16 = (peak * 1e3 / limits.copy_gbps for peak in (limits.fp32_tflops, limits.bf16_tflops))
    print(f"roofline ({limits.source}): {limits.copy_gbps:.0f} GB/s, {limits.fp32_tflops:.0f} TFLOP/s fp32, "
          f"{limits.bf16_tflops:.0f} TFLOP/s bf16; ridge at {ridge_fp32:.0f} FLOP/byte (fp32), {ridge_bf16:.0f} (bf16)")
    print(f"  {'kernel':12s} {'size':>12s} {'GFLOP':>9s} {'MB':>8s} {'FLOP/B':>7s} {'floor ms':>9s}  bound")
    for name, (size, flops, nbytes, unit) in kernel_work().items():
        compute_ms, memory_ms = roofline_ms(flops, nbytes, unit, limits)
        print(f"  {name:12s} {size:>12s} {flops / 1e9:9.2f} {nbytes / 1e6:8.1f} {flops / nbytes:7.2f} "
              f"{max(compute_ms, memory_ms):9.3f}  {'compute' if compute_ms > memory_ms else 'memory'}")


def summation_order_demo(n=1 << 24, seed=0):
    """Float32 addition is not associative, so a sum's rounding depends on its order. Against a
    float64 sum: one running float32 sum (the order of a single thread, or of a chain of atomics
    in whatever order they land), and a pairwise tree (numpy's float32 sum; our block reductions
    are trees too). The running sum's error grows with n; the tree's with log2(n). A max is exact
    in any order. Runs on the CPU."""
    x = np.random.default_rng(seed).random(n, dtype=np.float32)  # [0, 1): no cancellation, pure rounding
    exact = x.astype(np.float64).sum()
    running = np.add.accumulate(x)[-1]  # one float32 addition after another
    tree = x.sum()                      # numpy sums float32 pairwise
    print(f"sum of {n} uniform [0, 1) float32 values, relative error against float64:")
    print(f"  running sum (sequential, or atomics)  {abs(running - exact) / exact:.1e}")
    print(f"  pairwise tree (block reduction)       {abs(tree - exact) / exact:.1e}")
    print(f"  max, any order                        {abs(float(x.max()) - x.astype(np.float64).max()):.1e}")


# =============================================================================================
# Chapters 11-13: CUDA kernels, compiled at run time with torch.utils.cpp_extension.load_inline
# =============================================================================================
# Each string below is, byte for byte, the text between the "---- BEGIN KERNELS ----" and
# "---- END KERNELS ----" lines of a file in csrc/, where the same kernels build as standalone
# programs (make -C csrc) to profile with ncu and check with compute-sanitizer;
# tests/test_04_cuda_kernels.py fails if the two drift. Each family also carries its host-side
# launch_* function (grid size, block size, which variant), so csrc/ tests the very launch logic
# used here. All kernels are float32 except the tensor-core matmuls (bf16 in and out). The matmul
# steps, each timed against the last by bench_kernels(): naive -> shared-memory tiles ->
# register tiles (fp32) -> tensor cores with mma.sync (bf16, fed by cp.async); then, going faster
# on Hopper, the same kernel fed by TMA -> wgmma (bf16).

COMMON_CU = r"""
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>

inline __host__ __device__ size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// An "Op" is a struct with static identity() and combine(a, b). The reductions below regroup
// combine() freely, so it must be associative (floating-point addition is, up to rounding).
__device__ __forceinline__ float shfl_xor(float v, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}

// Butterfly over the 32 lanes of a warp: five register exchanges, no shared memory, no barrier,
// and afterwards every lane holds the result.
template <class Op, class T>
__device__ __forceinline__ T warp_allreduce(T v) {
#pragma unroll
    for (int lane_mask = 16; lane_mask > 0; lane_mask /= 2) v = Op::combine(v, shfl_xor(v, lane_mask));
    return v;
}

// Reduction over a block (blockDim.x a multiple of 32): each warp reduces its 32 values with
// shuffles, one value per warp passes through shared memory, and every warp then reduces those
// partials, so all threads return the block's result.
template <class Op, class T>
__device__ T block_allreduce(T v) {
    __shared__ T partial[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_allreduce<Op>(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : Op::identity();
    v = warp_allreduce<Op>(v);
    __syncthreads();  // a second call may overwrite `partial` only after everyone has read it
    return v;
}

// Calls f(i, row[i]) for this thread's share of row[0, n): thread t takes elements t,
// t + blockDim.x, ... (float4 groups when vec), so at every step the warp reads one contiguous
// span and the loads coalesce. vec needs n % 4 == 0 and a 16-byte-aligned row.
template <class F>
__device__ __forceinline__ void row_for_each(const float* row, int n, bool vec, F f) {
    if (vec) {
        const float4* row4 = reinterpret_cast<const float4*>(row);
#pragma unroll 4
        for (int j = threadIdx.x; j < n / 4; j += blockDim.x) {
            const float4 v = row4[j];
            f(4 * j, v.x);
            f(4 * j + 1, v.y);
            f(4 * j + 2, v.z);
            f(4 * j + 3, v.w);
        }
    } else {
#pragma unroll 4
        for (int i = threadIdx.x; i < n; i += blockDim.x) f(i, row[i]);
    }
}

// out[i] = g(i, in[i]) over a row, with the access pattern of row_for_each: the second pass of
// the kernels that stream rows too long for registers.
template <class G>
__device__ __forceinline__ void row_map(const float* in, float* out, int n, bool vec, G g) {
    if (vec) {
        const float4* in4 = reinterpret_cast<const float4*>(in);
        float4* out4 = reinterpret_cast<float4*>(out);
        for (int j = threadIdx.x; j < n / 4; j += blockDim.x) {
            const float4 v = in4[j];
            out4[j] = make_float4(g(4 * j, v.x), g(4 * j + 1, v.y), g(4 * j + 2, v.z), g(4 * j + 3, v.w));
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = g(i, in[i]);
    }
}

// The softmax and layer-norm kernels hold a whole row in registers between reading it and writing
// the result: thread t of the row's block owns float4 groups t, t + blockDim.x, ... (ROW_CHUNKS
// of them), loaded before any arithmetic, so each thread has ROW_CHUNKS 16-byte loads in flight.
// That depth is what reaches the bandwidth: on the H200 a softmax over 16384 x 4096 floats ran at
// 46%, 75%, 95% and 95% of copy bandwidth with 1, 2, 4 and 8 groups a thread.
constexpr int ROW_CHUNKS = 8;                     // 32 floats a thread
constexpr int ROW_THREADS_MAX = 512;              // at most 128 registers a thread for 512 threads
constexpr int ROW_REG_MAX = 4 * ROW_CHUNKS * ROW_THREADS_MAX;  // 16384: longer rows are streamed

// Threads per block for a row of n <= ROW_REG_MAX floats held in registers: whole warps.
inline int row_block_threads(int n) {
    const int threads = static_cast<int>(ceil_div(ceil_div(n, 4 * ROW_CHUNKS), 32)) * 32;
    return threads < 32 ? 32 : threads;
}

// Group j of a row: elements 4j .. 4j + 3 (pad past n). vec: n % 4 == 0 and a 16-byte-aligned
// row, so a group is one float4 load or store.
__device__ __forceinline__ void load_group(const float* row, int n, bool vec, int j, float* g, float pad) {
    if (vec) {
        const float4 q = 4 * j < n ? reinterpret_cast<const float4*>(row)[j] : make_float4(pad, pad, pad, pad);
        g[0] = q.x;
        g[1] = q.y;
        g[2] = q.z;
        g[3] = q.w;
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) g[e] = 4 * j + e < n ? row[4 * j + e] : pad;
    }
}

__device__ __forceinline__ void store_group(float* row, int n, bool vec, int j, const float* g) {
    if (vec) {
        if (4 * j < n) reinterpret_cast<float4*>(row)[j] = make_float4(g[0], g[1], g[2], g[3]);
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (4 * j + e < n) row[4 * j + e] = g[e];
    }
}

// v = this thread's ROW_CHUNKS groups of row[0, n): v[4c .. 4c + 3] is group threadIdx.x + c * blockDim.x.
__device__ __forceinline__ void load_row(const float* row, int n, bool vec, float (&v)[4 * ROW_CHUNKS], float pad) {
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) load_group(row, n, vec, threadIdx.x + c * blockDim.x, v + 4 * c, pad);
}
"""

VECTOR_ADD_CU = r"""
// c = a + b over n floats. Thread t of the grid owns elements 4t..4t+3: one 16-byte load from
// each input and one 16-byte store, so a warp moves 512 contiguous bytes per instruction (fully
// coalesced) and the kernel issues a quarter of the memory instructions of a float-at-a-time
// version. vec is false when a pointer is not 16-byte aligned; the last thread's group may run
// past n, so it takes the scalar path.
__global__ void vector_add_kernel(const float* a, const float* b, float* c, size_t n, bool vec) {
    const size_t i = 4 * (blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x);
    if (vec && i + 3 < n) {
        const float4 x = *reinterpret_cast<const float4*>(a + i);
        const float4 y = *reinterpret_cast<const float4*>(b + i);
        *reinterpret_cast<float4*>(c + i) = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    } else {
        for (size_t j = i; j < i + 4 && j < n; ++j) c[j] = a[j] + b[j];
    }
}

constexpr int VECTOR_ADD_THREADS = 256;

cudaError_t launch_vector_add(const float* a, const float* b, float* c, size_t n, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    const bool vec = aligned16(a) && aligned16(b) && aligned16(c);
    const size_t blocks = ceil_div(ceil_div(n, 4), VECTOR_ADD_THREADS);
    vector_add_kernel<<<blocks, VECTOR_ADD_THREADS, 0, stream>>>(a, b, c, n, vec);
    return cudaGetLastError();
}
"""

MATMUL_CU = r"""
#include <cuda.h>          // CUtensorMap, for TMA (steps 4 and 5)
#include <cudaTypedefs.h>  // the type of the driver's cuTensorMapEncodeTiled
// C = A @ B for row-major A (M, K), B (K, N) and C (M, N), any M, N, K: every load outside the
// matrices reads zero and every store outside them is skipped. Each step below does the same
// 2 M N K FLOPs; what changes is how often each input byte is fetched, and from where.

// Step 1, naive: one thread per element of C computes a dot product straight from global
// memory, two 4-byte loads per FMA (0.25 FLOP per byte loaded). The threads of a warp take
// consecutive columns, so their B loads coalesce and their A load is a single broadcast, but every
// element of A is fetched N times and every element of B M times; L2 absorbs most of it, and the
// load units still cap the kernel at a few TFLOP/s.
__global__ void matmul_naive_kernel(const float* A, const float* B, float* C, int M, int N, int K) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    const int row = blockIdx.y * blockDim.y + threadIdx.y;
    if (row >= M || col >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += A[static_cast<size_t>(row) * K + k] * B[static_cast<size_t>(k) * N + col];
    C[static_cast<size_t>(row) * N + col] = acc;
}

// Step 2, shared-memory tiles: a 32x32 block of threads stages a 32x32 tile of A and one of B in
// shared memory, one element per thread, then each thread runs 32 FMAs out of shared memory.
// Every global element is now fetched 32x less often; the limit moves to shared memory, two
// loads per FMA. As[ty][k] is one address per warp (a broadcast) and Bs[k][tx] 32 consecutive
// words (32 banks): no bank conflicts.
constexpr int TILE = 32;

__global__ void matmul_tiled_kernel(const float* A, const float* B, float* C, int M, int N, int K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        As[ty][tx] = row < M && k0 + tx < K ? A[static_cast<size_t>(row) * K + k0 + tx] : 0.0f;
        Bs[ty][tx] = k0 + ty < K && col < N ? B[static_cast<size_t>(k0 + ty) * N + col] : 0.0f;
        __syncthreads();  // the tiles are complete before anyone reads them
#pragma unroll
        for (int k = 0; k < TILE; ++k) acc += As[ty][k] * Bs[k][tx];
        __syncthreads();  // everyone is done with the tiles before they are overwritten
    }
    if (row < M && col < N) C[static_cast<size_t>(row) * N + col] = acc;
}

// Step 3, register tiles: a block of 256 threads computes a 128x128 tile of C, each thread an
// 8x8 sub-tile held in 64 registers. Per k, a thread loads 8 values of A and 8 of B from shared
// memory (four 16-byte loads) and does 64 FMAs with them: 16 FMAs per shared-memory
// instruction instead of 0.5. The A tile is stored transposed (As[k][m]), so a thread's 8 A
// values for one k are contiguous. A thread's rows are 4ty..4ty+3 and 64+4ty..64+4ty+3 (columns
// likewise): the 16 threads of a half-warp then read 256 contiguous bytes of Bs, the minimum two
// shared-memory wavefronts. Double buffering: the next k-tile is loaded from global memory into
// registers while the FMAs run on the current one, then stored to the other shared buffer, so
// there is one barrier per k-tile and the load latency hides behind arithmetic.
constexpr int RT_BM = 128, RT_BN = 128, RT_BK = 16;  // block tile of C, and the k-step
constexpr int RT_THREADS = 256;                      // 16 x 16 threads, 8 x 8 outputs each
constexpr int RT_PAD = 4;  // pads As rows by a float4: the transposed stores collide 2-way, not 4-way

// p[row][col .. col+3] of a rows x cols row-major matrix, zeros outside it. VEC: one 16-byte load
// (needs cols % 4 == 0 and a 16-byte-aligned p, so the four are all inside or all outside).
template <bool VEC>
__device__ __forceinline__ float4 load_float4(const float* p, int row, int col, int rows, int cols) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (row >= rows) return v;
    const float* q = p + static_cast<size_t>(row) * cols + col;
    if (VEC) {
        if (col < cols) v = *reinterpret_cast<const float4*>(q);
    } else {
        if (col < cols) v.x = q[0];
        if (col + 1 < cols) v.y = q[1];
        if (col + 2 < cols) v.z = q[2];
        if (col + 3 < cols) v.w = q[3];
    }
    return v;
}

// bias (N floats) may be null; it is added to every row of C.
template <bool VEC>
__global__ void __launch_bounds__(RT_THREADS, 2)
    matmul_register_tiled_kernel(const float* A, const float* B, const float* bias, float* C, int M, int N, int K) {
    __shared__ __align__(16) float As[2][RT_BK][RT_BM + RT_PAD];  // A tile, transposed: As[k][m]
    __shared__ __align__(16) float Bs[2][RT_BK][RT_BN];
    const int tid = threadIdx.x;
    const int row0 = blockIdx.y * RT_BM, col0 = blockIdx.x * RT_BN;

    // Staging: the A tile (128 x 16) is 512 float4, two per thread (rows a_row and a_row + 64,
    // k a_k..a_k+3); the B tile (16 x 128) too (k rows b_k and b_k + 8, columns b_col..b_col+3).
    const int a_row = tid / 4, a_k = 4 * (tid % 4);
    const int b_k = tid / 32, b_col = 4 * (tid % 32);
    float4 a_next[2], b_next[2];
    auto load_tile = [&](int k0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            a_next[h] = load_float4<VEC>(A, row0 + a_row + 64 * h, k0 + a_k, M, K);
            b_next[h] = load_float4<VEC>(B, k0 + b_k + 8 * h, col0 + b_col, K, N);
        }
    };
    auto store_tile = [&](int buf) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int m = a_row + 64 * h;
            As[buf][a_k + 0][m] = a_next[h].x;
            As[buf][a_k + 1][m] = a_next[h].y;
            As[buf][a_k + 2][m] = a_next[h].z;
            As[buf][a_k + 3][m] = a_next[h].w;
            *reinterpret_cast<float4*>(&Bs[buf][b_k + 8 * h][b_col]) = b_next[h];
        }
    };

    const int ty = tid / 16, tx = tid % 16;
    float acc[8][8] = {};
    const int k_tiles = static_cast<int>(ceil_div(K, RT_BK));
    load_tile(0);
    store_tile(0);
    __syncthreads();
    for (int t = 0; t < k_tiles; ++t) {
        const int buf = t % 2;
        if (t + 1 < k_tiles) load_tile((t + 1) * RT_BK);  // in flight during the FMAs below
#pragma unroll
        for (int k = 0; k < RT_BK; ++k) {
            const float4 a0 = *reinterpret_cast<const float4*>(&As[buf][k][4 * ty]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[buf][k][64 + 4 * ty]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[buf][k][4 * tx]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[buf][k][64 + 4 * tx]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        // the other buffer was last read in iteration t - 1, before the barrier that ended it
        if (t + 1 < k_tiles) store_tile(buf ^ 1);
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int row = row0 + (i < 4 ? 4 * ty + i : 64 + 4 * ty + i - 4);
        if (row >= M) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int col = col0 + 64 * h + 4 * tx;
            float v[4] = {acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2], acc[i][4 * h + 3]};
            float* out = C + static_cast<size_t>(row) * N + col;
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (bias != nullptr && col + j < N) v[j] += bias[col + j];
            if (VEC) {
                if (col < N) *reinterpret_cast<float4*>(out) = make_float4(v[0], v[1], v[2], v[3]);
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (col + j < N) out[j] = v[j];
            }
        }
    }
}

// Step 4, tensor cores (bf16 in, fp32 accumulate, bf16 out). One mma.sync.m16n8k16 instruction
// is a warp-wide 16x8x16 product, 4096 FLOPs, where an FFMA is 64 per warp. Feeding it is now
// the whole job:
//  - A ring of 3 shared-memory stages keeps two k-tiles in flight while the tensor cores work
//    on a third. cp.async (sm_80 and newer) fills it: every thread copies its share of 16-byte
//    chunks global -> shared, with no register round trip, and waits for its own copies. (The
//    template argument TMA swaps in Hopper's copy engine: "Going faster on Hopper", below.)
//  - ldmatrix loads a warp's operand fragments from shared memory in the exact register layout
//    mma expects (.trans transposes B, stored k-major, on the way); the fragments of the next
//    k-step of 16 are loaded while the mma of this one run.
//  - Shared tiles are rows of 64 bf16 (128 bytes), 16-byte chunk c of row r stored at
//    c ^ (r % 8) (an XOR swizzle, the same as TMA's 128-byte mode): the 8 rows one ldmatrix reads
//    then sit in 8 different bank groups instead of one. A's tile is 128 such rows; B's 64x256
//    tile is 4 panels of 64 columns.
//  - A block computes a 128x256 tile of C with 8 warps, each a 64x64 tile: per k-step of 16 a
//    warp loads 4 A and 8 B fragments with 8 ldmatrix and issues 32 mma.
//  - Blocks walk the tiles in groups of 8 block-rows (grouped_tile below).
// At 4096^3 on the H200 this kernel runs at about 0.4x cuBLAS.
// Needs K % 8 == 0, N % 8 == 0 and 16-byte-aligned A and B (whole 16-byte chunks per row, and
// TMA's rule for strides and addresses); M is free. Needs sm_80 or newer.
constexpr int TC_BM = 128, TC_BN = 256, TC_BK = 64;  // block tile of C, and the k-step (one 128-byte row)
constexpr int TC_STAGES = 3;                         // depth of the ring
constexpr int TC_THREADS = 256;                      // 8 warps: 2 (m) x 4 (n), 64 x 64 of C each
constexpr int TC_A_BYTES = TC_BM * TC_BK * 2, TC_PANEL_BYTES = TC_BK * 64 * 2;  // A's tile; one panel of B's
constexpr int TC_STAGE_BYTES = TC_A_BYTES + TC_BK * TC_BN * 2;
constexpr int TC_SMEM_BYTES = TC_STAGES * TC_STAGE_BYTES + 1024;  // 145 KB (+ room to align the ring to 1024)

// Blocks walk the tiles of C in groups of 8 block-rows (Triton's grouped ordering): block b's
// tile (row0, col0), going down a group's 8 block-rows before the next column, so the A rows and
// B columns that neighbouring blocks share are still in L2.
// (block is unsigned, as blockIdx.x is: the divisions by group stay unsigned, which take fewer
// instructions than signed ones.)
__device__ __forceinline__ int2 grouped_tile(unsigned block, int M, int N, int BM, int BN) {
    const int grid_m = static_cast<int>(ceil_div(M, BM)), grid_n = static_cast<int>(ceil_div(N, BN));
    const int group = 8 * grid_n, first_m = block / group * 8, group_m = min(grid_m - first_m, 8);
    return make_int2((first_m + block % group % group_m) * BM, block % group / group_m * BN);
}

// 16 bytes global -> shared, asynchronously; src_bytes 0 (pred false) writes zeros instead.
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(pred ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most `pending` of this thread's committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
}

// Four 8x8 bf16 matrices: lane l gives the address of row l % 8 of matrix l / 8 and receives,
// in r[j], two elements of matrix j (row l / 4, columns 2 (l % 4) and +1); .trans transposes.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr)
                 : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr)
                 : "memory");
}

// d (16x8 fp32) += a (16x16 bf16, row-major fragment) * b (16x8 bf16, column-major fragment).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of 16-byte chunk `chunk` (0-7) of row `row` in a tile of 128-byte rows.
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
    return static_cast<uint32_t>(row * 8 + (chunk ^ (row % 8))) * 16;
}

// The primitives of the Hopper feed, used only when the kernel's template argument TMA is true
// ("Going faster on Hopper", below, says what they buy).
// TMA and mbarriers exist from sm_90 on; built for an older GPU these compile to nothing, and
// the launchers never pick the TMA kernels there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define HAS_TMA 1
#endif

// An mbarrier is a 64-bit shared-memory word that counts arrivals and, for TMA, bytes. Each
// stage of a ring has one, used over and over: use u of it completes phase u, whose parity
// (u % 2) is what a waiter names.
__device__ __forceinline__ void mbarrier_init(uint32_t bar0, int count) {  // `count` barriers, one arrival each
#ifdef HAS_TMA
    if (threadIdx.x == 0) {
        for (int s = 0; s < count; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar0 + 8 * s) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
    }
#endif
    __syncthreads();
}

// The one arrival, which also announces `bytes` of TMA writes still to come: the phase
// completes when they have all landed.
__device__ __forceinline__ void mbarrier_expect_bytes(uint32_t bar, int bytes) {
#ifdef HAS_TMA
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void mbarrier_wait(uint32_t bar, int parity) {
#ifdef HAS_TMA
    uint32_t done = 0;
    while (!done)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
#endif
}

// The box at coordinates (x = column, y = row) of the matrix `map` describes -> shared memory
// at dst, swizzled as the map says; elements outside the matrix arrive as zeros, and all the
// box's bytes count on the barrier.
__device__ __forceinline__ void tma_load_box(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
#ifdef HAS_TMA
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
        : "memory");
#endif
}

// With TMA the tensor maps describe A and B (the pointers are unused), without it the pointers
// are read. bias (N values) may be null; it is added to every row of C before the rounding to bf16.
template <bool TMA>
__global__ void __launch_bounds__(TC_THREADS, 1)
    matmul_tensor_core_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                              const __nv_bfloat16* A, const __nv_bfloat16* B, const __nv_bfloat16* bias,
                              __nv_bfloat16* C, int M, int N, int K) {
    extern __shared__ float4 dynamic_smem[];
    __shared__ alignas(8) uint64_t landed[TC_STAGES];  // TMA: one mbarrier a stage, complete when its tiles are in
    const uint32_t smem = (static_cast<uint32_t>(__cvta_generic_to_shared(dynamic_smem)) + 1023) & ~1023u;
    const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(landed));

    const int2 tile = grouped_tile(blockIdx.x, M, N, TC_BM, TC_BN);
    const int row0 = tile.x, col0 = tile.y;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int warp_row = warp / 4 * 64, warp_col = warp % 4 * 64;  // this warp's 64x64 of the tile
    if (TMA) mbarrier_init(bar0, TC_STAGES);

    // Stage s holds the A tile (128 rows x 8 chunks), then B's 4 panels (64 rows x 8 chunks each).
    auto load_stage = [&](int stage, int k0) {
        const uint32_t a_tile = smem + stage * TC_STAGE_BYTES, b_tile = a_tile + TC_A_BYTES;
        if constexpr (TMA) {
            if (tid == 0) {
                const uint32_t bar = bar0 + 8 * stage;
                mbarrier_expect_bytes(bar, TC_STAGE_BYTES);
                tma_load_box(a_tile, &map_a, k0, row0, bar);
#pragma unroll
                for (int p = 0; p < TC_BN / 64; ++p)
                    tma_load_box(b_tile + p * TC_PANEL_BYTES, &map_b, col0 + 64 * p, k0, bar);
            }
        } else {
#pragma unroll
            for (int i = 0; i < TC_BM * TC_BK / 8 / TC_THREADS; ++i) {
                const int id = tid + i * TC_THREADS, r = id / 8, c = id % 8;
                const bool inside = row0 + r < M && k0 + 8 * c < K;
                const __nv_bfloat16* src = inside ? A + static_cast<size_t>(row0 + r) * K + k0 + 8 * c : A;
                cp_async_16(a_tile + swizzled(r, c), src, inside);
            }
#pragma unroll
            for (int i = 0; i < TC_BK * TC_BN / 8 / TC_THREADS; ++i) {
                const int id = tid + i * TC_THREADS, r = id / 32, c = id % 32;  // chunk c of the 256 columns
                const bool inside = k0 + r < K && col0 + 8 * c < N;
                const __nv_bfloat16* src = inside ? B + static_cast<size_t>(k0 + r) * N + col0 + 8 * c : B;
                cp_async_16(b_tile + c / 8 * TC_PANEL_BYTES + swizzled(r, c % 8), src, inside);
            }
        }
    };

    float acc[4][8][4] = {};  // [16-row slice][8-column slice][mma accumulator fragment]
    const int k_tiles = static_cast<int>(ceil_div(K, TC_BK));
#pragma unroll
    for (int s = 0; s < TC_STAGES - 1; ++s) {
        if (s < k_tiles) load_stage(s, s * TC_BK);
        if (!TMA) cp_async_commit();  // empty groups too, so that every thread counts the same groups
    }
    for (int t = 0; t < k_tiles; ++t) {
        if (TMA)
            mbarrier_wait(bar0 + 8 * (t % TC_STAGES), t / TC_STAGES % 2);  // tile t has landed
        else
            cp_async_wait<TC_STAGES - 2>();  // this thread's copies of tile t have landed
        __syncthreads();                     // everyone's have, and everyone is done with tile t - 1
        const int next = t + TC_STAGES - 1;
        if (next < k_tiles) load_stage(next % TC_STAGES, next * TC_BK);  // refills tile t - 1's stage
        if (!TMA) cp_async_commit();

        const uint32_t a_tile = smem + (t % TC_STAGES) * TC_STAGE_BYTES, b_tile = a_tile + TC_A_BYTES;
        uint32_t a[2][4][4], b[2][8][2];  // two sets of fragments: k-step kk + 1's load while kk's mma run
        auto load_fragments = [&](int set, int kk) {
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                // matrices: rows 0-7 / 8-15 of the slice (lanes 0-15) at k 0-7, then at k 8-15 (lanes 16-31)
                const int r = warp_row + 16 * mi + lane % 16, c = 2 * kk + lane / 16;
                ldmatrix_x4(a[set][mi], a_tile + swizzled(r, c));
            }
#pragma unroll
            for (int nj = 0; nj < 4; ++nj) {
                // matrices: k 0-7 / 8-15 (lanes 0-7 / 8-15) of columns 16nj..+7, then of +8..+15
                const int r = 16 * kk + lane % 8 + 8 * (lane / 8 % 2), c = (warp_col + 16 * nj) / 8 + lane / 16;
                uint32_t q[4];
                ldmatrix_x4_trans(q, b_tile + c / 8 * TC_PANEL_BYTES + swizzled(r, c % 8));
                b[set][2 * nj][0] = q[0];
                b[set][2 * nj][1] = q[1];
                b[set][2 * nj + 1][0] = q[2];
                b[set][2 * nj + 1][1] = q[3];
            }
        };
        load_fragments(0, 0);
#pragma unroll
        for (int kk = 0; kk < TC_BK / 16; ++kk) {
            if (kk + 1 < TC_BK / 16) load_fragments((kk + 1) % 2, kk + 1);
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int ni = 0; ni < 8; ++ni)
                    mma_bf16_16816(acc[mi][ni], a[kk % 2][mi], b[kk % 2][ni][0], b[kk % 2][ni][1]);
        }
    }
    if (!TMA) cp_async_wait<0>();

    // Accumulator fragment: lane l holds rows l / 4 and l / 4 + 8, columns 2 (l % 4) and +1.
#pragma unroll
    for (int ni = 0; ni < 8; ++ni) {
        const int col = col0 + warp_col + 8 * ni + 2 * (lane % 4);
        if (col >= N) continue;  // N % 8 == 0, so col + 1 < N too
        const float bias0 = bias != nullptr ? __bfloat162float(bias[col]) : 0.0f;
        const float bias1 = bias != nullptr ? __bfloat162float(bias[col + 1]) : 0.0f;
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row0 + warp_row + 16 * mi + lane / 4 + 8 * h;
                if (row < M)
                    *reinterpret_cast<__nv_bfloat162*>(C + static_cast<size_t>(row) * N + col) =
                        __floats2bfloat162_rn(acc[mi][ni][2 * h] + bias0, acc[mi][ni][2 * h + 1] + bias1);
            }
    }
}

// ---- Going faster on Hopper (sm_90) ----
// Fed by cp.async, step 4 reaches about 0.4x cuBLAS, and all 256 of its threads compute the
// address of every 16-byte chunk they copy. Hopper adds two things:
// (a) TMA, the Tensor Memory Accelerator, feeding the same kernel (template argument TMA, which
//     launch_matmul_tensor_core picks on sm_90): one thread asks it for whole 2-D boxes,
//     described by "tensor maps" built on the host (make_tensor_map, with the launchers); they
//     land already swizzled and count their bytes on an mbarrier, which everyone waits on. The
//     other 255 threads issue no copies and compute no addresses. It reaches 0.55x cuBLAS.
// (b) wgmma, step 5: a warpgroup issues 64x256x16 products that the tensor cores read straight
//     from shared memory, asynchronously, with no ldmatrix and no register fragments. Fed by TMA
//     it reaches 0.88x cuBLAS.

// Step 5 (Hopper only, sm_90a), wgmma: a warpgroup (4 warps, 128 threads) issues one
// asynchronous 64x256x16 product straight from shared memory, 524288 FLOPs per instruction,
// no ldmatrix: the tensor cores read the operands themselves through 64-bit "matrix
// descriptors" (address, strides, swizzle mode). Both operands must be K-major in shared memory,
// so this kernel takes B transposed, as W (N, K) row-major (the layout of nn.Linear's weight)
// and computes C = A @ W^T. A block is 2 warpgroups, each a 64x256 slice of a 128x256 tile of C
// (128 fp32 accumulators per thread). Tiles arrive by TMA as in (a), in the layout the tensor
// cores read: rows of 64 bf16 (128 bytes), 16-byte chunk c of row r at c ^ (r % 8), 8-row groups
// 1024 bytes apart, each stage 1024-byte aligned. The ring has 4 stages but prefetches only 2
// ahead, so one k-tile's wgmmas can still be running when the next k-tile's are issued: the
// stage refilled was read by wgmmas two k-tiles back, already complete. (Fed by cp.async instead,
// as in step 4, this kernel reached 0.64x cuBLAS; with TMA 0.88x.) Needs K % 8 == 0,
// N % 8 == 0 and 16-byte-aligned A and W.
constexpr int WG_BM = 128, WG_BN = 256, WG_BK = 64;  // block tile of C, and the k-step (one 128-byte row)
constexpr int WG_STAGES = 4, WG_AHEAD = WG_STAGES - 2;  // ring depth; k-tiles loaded ahead
constexpr int WG_THREADS = 256;  // 2 warpgroups
constexpr int WG_A_BYTES = WG_BM * WG_BK * 2, WG_STAGE_BYTES = (WG_BM + WG_BN) * WG_BK * 2;
constexpr int WG_SMEM_BYTES = WG_STAGES * WG_STAGE_BYTES + 1024;  // + room to align the ring to 1024 bytes

// Descriptor of a K-major tile in the 128-byte swizzled layout starting at smem_addr: start
// address, leading offset (unused for this layout, 1 by convention), stride offset 1024 bytes
// between 8-row groups, swizzle mode 1 (128 bytes). Fields are in 16-byte units.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t smem_addr) {
    return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | static_cast<uint64_t>(1) << 16 |
           static_cast<uint64_t>(1024 >> 4) << 32 | static_cast<uint64_t>(1) << 62;
}

// d (64x256 fp32 per warpgroup) += A (64x16 bf16) * B (16x256 bf16), both from shared memory.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, accumulate, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
          "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),
          "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
          "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]),
          "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]),
          "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]),
          "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),
          "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
          "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(1));  // accumulate: d = a b + d (0 would drop d)
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Wait until at most `pending` of this warpgroup's committed wgmma groups are still running.
template <int pending>
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
#endif
}

// The accumulators change behind the compiler's back until the wait: pin every access to them
// on both sides of the asynchronous region, so none is moved across it.
__device__ __forceinline__ void fence_registers(float (&d)[128]) {
#pragma unroll
    for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// C = A @ W^T (+ bias): A (M, K), W (N, K), C (M, N), bf16, read through the tensor maps of A
// (boxes of 128 rows) and W (boxes of 256 rows); bias (N values) may be null.
__global__ void __launch_bounds__(WG_THREADS, 1)
    matmul_wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w,
                        const __nv_bfloat16* bias, __nv_bfloat16* C, int M, int N, int K) {
    extern __shared__ float4 dynamic_smem[];
    __shared__ alignas(8) uint64_t landed[WG_STAGES];
    const uint32_t smem = (static_cast<uint32_t>(__cvta_generic_to_shared(dynamic_smem)) + 1023) & ~1023u;
    const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(landed));

    const int2 tile = grouped_tile(blockIdx.x, M, N, WG_BM, WG_BN);
    const int row0 = tile.x, col0 = tile.y;
    const int tid = threadIdx.x, warpgroup = tid / 128;
    mbarrier_init(bar0, WG_STAGES);

    // Stage s: the A tile (128 rows), then the W tile (256 rows), rows of 8 chunks of 16 bytes.
    auto load_stage = [&](int stage, int k0) {  // thread 0 only
        const uint32_t tile = smem + stage * WG_STAGE_BYTES, bar = bar0 + 8 * stage;
        mbarrier_expect_bytes(bar, WG_STAGE_BYTES);
        tma_load_box(tile, &map_a, k0, row0, bar);
        tma_load_box(tile + WG_A_BYTES, &map_w, k0, col0, bar);
    };

    float d[128] = {};
    const int k_tiles = static_cast<int>(ceil_div(K, WG_BK));
    if (tid == 0)
        for (int s = 0; s < WG_AHEAD && s < k_tiles; ++s) load_stage(s, s * WG_BK);
    for (int t = 0; t < k_tiles; ++t) {
        mbarrier_wait(bar0 + 8 * (t % WG_STAGES), t / WG_STAGES % 2);  // tile t has landed
        __syncthreads();  // and the wgmmas of tile t - 2 have completed, in both warpgroups
        const int next = t + WG_AHEAD;
        if (tid == 0 && next < k_tiles) load_stage(next % WG_STAGES, next * WG_BK);  // refills tile t - 2's stage

        const uint32_t a_tile = smem + (t % WG_STAGES) * WG_STAGE_BYTES + warpgroup * 64 * 128;
        const uint32_t w_tile = smem + (t % WG_STAGES) * WG_STAGE_BYTES + WG_A_BYTES;
        fence_registers(d);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < WG_BK / 16; ++kk)  // the next 16 k are 32 bytes further along each row
            wgmma_m64n256k16(d, wgmma_desc(a_tile + 32 * kk), wgmma_desc(w_tile + 32 * kk));
        wgmma_commit();
        wgmma_wait<1>();  // tile t's wgmmas may run on; tile t - 1's are done
        fence_registers(d);
    }
    wgmma_wait<0>();
    fence_registers(d);

    // Accumulator layout: warp w of the warpgroup holds rows 16w..16w+15 of its 64-row slice;
    // d[4j + q] is row lane / 4 (+ 8 for q >= 2), column 8j + 2 (lane % 4) (+ 1 for odd q).
    const int lane = tid % 32, row_base = row0 + warpgroup * 64 + (tid % 128) / 32 * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        const int col = col0 + 8 * j + 2 * (lane % 4);
        if (col >= N) continue;
        const float bias0 = bias != nullptr ? __bfloat162float(bias[col]) : 0.0f;
        const float bias1 = bias != nullptr ? __bfloat162float(bias[col + 1]) : 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row_base + 8 * h;
            if (row < M)
                *reinterpret_cast<__nv_bfloat162*>(C + static_cast<size_t>(row) * N + col) =
                    __floats2bfloat162_rn(d[4 * j + 2 * h] + bias0, d[4 * j + 2 * h + 1] + bias1);
        }
    }
}

// The launchers: C = A @ B (+ bias), everything row-major and contiguous.
cudaError_t launch_matmul_naive(const float* A, const float* B, float* C, int M, int N, int K, cudaStream_t stream) {
    if (M == 0 || N == 0) return cudaSuccess;
    const dim3 block(32, 8), grid(ceil_div(N, 32), ceil_div(M, 8));
    matmul_naive_kernel<<<grid, block, 0, stream>>>(A, B, C, M, N, K);
    return cudaGetLastError();
}

cudaError_t launch_matmul_tiled(const float* A, const float* B, float* C, int M, int N, int K, cudaStream_t stream) {
    if (M == 0 || N == 0) return cudaSuccess;
    const dim3 block(TILE, TILE), grid(ceil_div(N, TILE), ceil_div(M, TILE));
    matmul_tiled_kernel<<<grid, block, 0, stream>>>(A, B, C, M, N, K);
    return cudaGetLastError();
}

cudaError_t launch_matmul_register_tiled(const float* A, const float* B, const float* bias, float* C, int M, int N,
                                         int K, cudaStream_t stream) {
    if (M == 0 || N == 0) return cudaSuccess;
    const dim3 grid(ceil_div(N, RT_BN), ceil_div(M, RT_BM));
    if (K % 4 == 0 && N % 4 == 0 && aligned16(A) && aligned16(B) && aligned16(C))
        matmul_register_tiled_kernel<true><<<grid, RT_THREADS, 0, stream>>>(A, B, bias, C, M, N, K);
    else
        matmul_register_tiled_kernel<false><<<grid, RT_THREADS, 0, stream>>>(A, B, bias, C, M, N, K);
    return cudaGetLastError();
}

// A tensor map describes a row-major (rows, cols) bf16 matrix to TMA: its address, sizes and
// row stride, the box one copy fetches (box_rows x 64 columns: 128 bytes a row, the width of the
// swizzle) and the 128-byte swizzle. The encoder lives in the driver (libcuda); the runtime looks
// it up by name, so nothing more is linked. False if the driver has none or refuses the matrix.
static bool make_tensor_map(CUtensorMap* map, const void* ptr, int rows, int cols, int box_rows) {
    static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
        const cudaError_t err =
            cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
        const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
        const bool ok = err == cudaSuccess && found == cudaDriverEntryPointSuccess;
        return ok ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn) : nullptr;
    }();
    if (encode == nullptr) return false;
    const cuuint64_t sizes[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};  // innermost first
    const cuuint64_t row_stride[1] = {static_cast<cuuint64_t>(cols) * 2};                           // bytes
    const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)}, element_strides[2] = {1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), sizes, row_stride, box,
                  element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

static cudaError_t compute_capability_major(int* major) {
    int device = 0;
    const cudaError_t err = cudaGetDevice(&device);
    return err != cudaSuccess ? err : cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device);
}

// loads: 0 cp.async, 1 TMA (sm_90 and a driver with the tensor-map encoder, else
// cudaErrorNotSupported), -1 TMA where the GPU has it, else cp.async.
cudaError_t launch_matmul_tensor_core(const __nv_bfloat16* A, const __nv_bfloat16* B, const __nv_bfloat16* bias,
                                      __nv_bfloat16* C, int M, int N, int K, int loads, cudaStream_t stream) {
    if (M == 0 || N == 0) return cudaSuccess;
    int major = 0;
    cudaError_t err = compute_capability_major(&major);
    if (err != cudaSuccess) return err;
    // A in boxes of 128 rows x 64 k, B in boxes of 64 k x 64 columns; K == 0 loads nothing (C = bias)
    // and has no matrix to describe
    CUtensorMap map_a{}, map_b{};
    const bool tma = loads != 0 && major >= 9 &&
                     (K == 0 || (make_tensor_map(&map_a, A, M, K, TC_BM) && make_tensor_map(&map_b, B, K, N, TC_BK)));
    if (loads == 1 && !tma) return cudaErrorNotSupported;
    const auto kernel = tma ? matmul_tensor_core_kernel<true> : matmul_tensor_core_kernel<false>;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, TC_SMEM_BYTES);
    if (err != cudaSuccess) return err;
    const size_t blocks = ceil_div(M, TC_BM) * ceil_div(N, TC_BN);
    kernel<<<blocks, TC_THREADS, TC_SMEM_BYTES, stream>>>(map_a, map_b, A, B, bias, C, M, N, K);
    return cudaGetLastError();
}

// C = A @ W^T (+ bias). Hopper only: the kernel is empty unless built for sm_90a.
cudaError_t launch_matmul_wgmma(const __nv_bfloat16* A, const __nv_bfloat16* W, const __nv_bfloat16* bias,
                                __nv_bfloat16* C, int M, int N, int K, cudaStream_t stream) {
    if (M == 0 || N == 0) return cudaSuccess;
    int major = 0;
    cudaError_t err = compute_capability_major(&major);
    if (err != cudaSuccess) return err;
    CUtensorMap map_a{}, map_w{};  // A in boxes of 128 rows x 64 k, W in boxes of 256 rows x 64 k
    const bool maps = K == 0 || (make_tensor_map(&map_a, A, M, K, WG_BM) && make_tensor_map(&map_w, W, N, K, WG_BN));
    if (major != 9 || !maps) return cudaErrorNotSupported;
    err = cudaFuncSetAttribute(matmul_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, WG_SMEM_BYTES);
    if (err != cudaSuccess) return err;
    const size_t blocks = ceil_div(M, WG_BM) * ceil_div(N, WG_BN);
    matmul_wgmma_kernel<<<blocks, WG_THREADS, WG_SMEM_BYTES, stream>>>(map_a, map_w, bias, C, M, N, K);
    return cudaGetLastError();
}
"""

REDUCE_CU = r"""
struct SumOp {
    __device__ static float identity() { return 0.0f; }
    __device__ static float combine(float a, float b) { return a + b; }
    __device__ static void atomic_combine(float* dst, float v) { atomicAdd(dst, v); }
};

struct MaxOp {
    __device__ static float identity() { return -INFINITY; }
    __device__ static float combine(float a, float b) { return fmaxf(a, b); }
    // There is no float atomicMax, but floats of one sign order like their bit patterns: as signed
    // ints when the sign bit is clear, in reverse as unsigned ints when it is set.
    __device__ static void atomic_combine(float* dst, float v) {
        if (__float_as_int(v) >= 0) atomicMax(reinterpret_cast<int*>(dst), __float_as_int(v));
        else atomicMin(reinterpret_cast<unsigned int*>(dst), __float_as_uint(v));
    }
};

constexpr int REDUCE_THREADS = 256;  // a power of two: the tree halves it
constexpr int REDUCE_CHUNK = 8192;   // elements one block reduces: 8 float4 loads per thread

template <class Op>
__global__ void reduce_init_kernel(float* out, size_t rows) {
    const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    if (i < rows) out[i] = Op::identity();
}

// Method "atomic": one thread per element, each combined straight into out[row] with an atomic.
// Simple and correct, but all the threads of a row queue on one address in L2, and the order of
// the additions (so the rounding of a sum) changes from run to run.
template <class Op>
__global__ void reduce_atomic_kernel(const float* x, float* out, size_t total, int n) {
    const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    if (i < total) Op::atomic_combine(&out[i / n], x[i]);
}

// Method "tree": the block's values go to shared memory and are halved in log2(256) = 8 steps,
// a barrier after each; sequential addressing (thread t adds t + stride) keeps the warps' accesses
// free of bank conflicts.
template <class Op>
__device__ float block_reduce_tree(float v) {
    __shared__ float buf[REDUCE_THREADS];
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) buf[threadIdx.x] = Op::combine(buf[threadIdx.x], buf[threadIdx.x + stride]);
        __syncthreads();
    }
    return buf[0];
}

// Methods "tree" and "shuffle" share this kernel: block b reduces chunk (b % chunks) of row
// (b / chunks), REDUCE_CHUNK elements, into out[b]. Each thread first folds its own elements in
// registers (16-byte coalesced loads, several in flight); only the last step, 256 values to one,
// differs: shared-memory tree or warp shuffles (5 register exchanges per warp, one barrier).
template <class Op, bool SHUFFLE>
__global__ void __launch_bounds__(REDUCE_THREADS) reduce_rows_kernel(const float* x, float* out, int n, bool vec) {
    const int chunks = static_cast<int>(ceil_div(n, REDUCE_CHUNK));
    const size_t row = blockIdx.x / chunks;
    const int start = (blockIdx.x % chunks) * REDUCE_CHUNK;
    const int len = min(REDUCE_CHUNK, n - start);
    float acc = Op::identity();
    row_for_each(x + row * n + start, len, vec, [&](int, float v) { acc = Op::combine(acc, v); });
    if constexpr (SHUFFLE) acc = block_allreduce<Op>(acc);
    else acc = block_reduce_tree<Op>(acc);
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

enum ReduceMethod { REDUCE_ATOMIC = 0, REDUCE_TREE = 1, REDUCE_SHUFFLE = 2 };

// A row longer than REDUCE_CHUNK is reduced in passes: rows x chunks partial results, then those
// reduced again, until one value per row is left. The partials need this many floats of workspace.
inline size_t reduce_workspace_floats(size_t rows, int n) {
    size_t floats = 0;
    for (size_t chunks = ceil_div(n, REDUCE_CHUNK); chunks > 1; chunks = ceil_div(chunks, REDUCE_CHUNK))
        floats += rows * chunks;
    return floats;
}

template <class Op>
cudaError_t launch_reduce_op(const float* x, float* out, float* workspace, size_t rows, int n, int method,
                             cudaStream_t stream) {
    if (method == REDUCE_ATOMIC) {
        const size_t total = rows * n;
        reduce_init_kernel<Op><<<ceil_div(rows, REDUCE_THREADS), REDUCE_THREADS, 0, stream>>>(out, rows);
        reduce_atomic_kernel<Op><<<ceil_div(total, REDUCE_THREADS), REDUCE_THREADS, 0, stream>>>(x, out, total, n);
        return cudaGetLastError();
    }
    const float* src = x;
    for (;;) {
        const int chunks = static_cast<int>(ceil_div(n, REDUCE_CHUNK));
        float* dst = chunks == 1 ? out : workspace;
        const bool vec = n % 4 == 0 && aligned16(src);
        const size_t blocks = rows * chunks;
        if (method == REDUCE_TREE)
            reduce_rows_kernel<Op, false><<<blocks, REDUCE_THREADS, 0, stream>>>(src, dst, n, vec);
        else
            reduce_rows_kernel<Op, true><<<blocks, REDUCE_THREADS, 0, stream>>>(src, dst, n, vec);
        if (chunks == 1) break;
        src = dst;
        workspace += rows * chunks;
        n = chunks;
    }
    return cudaGetLastError();
}

// out[r] = sum (or max) of x[r, 0:n] for r < rows; workspace: reduce_workspace_floats(rows, n).
cudaError_t launch_reduce(const float* x, float* out, float* workspace, size_t rows, int n, bool max, int method,
                          cudaStream_t stream) {
    if (rows == 0 || n == 0) return cudaSuccess;
    return max ? launch_reduce_op<MaxOp>(x, out, workspace, rows, n, method, stream)
               : launch_reduce_op<SumOp>(x, out, workspace, rows, n, method, stream);
}
"""

SOFTMAX_CU = r"""
// softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m) with m = max_j x_j: subtracting the maximum
// keeps every exp() in (0, 1], so large logits cannot overflow to inf (exp(89) already does in
// float32). The online form (Milakov and Gimelshein, 2018) finds m and the sum in one pass: it
// keeps a running maximum and rescales the sum so far by exp(m_old - m_new) whenever it grows.
struct MaxSum {
    float m;  // running maximum
    float s;  // sum of exp(x - m) over the values seen
};

__device__ __forceinline__ MaxSum shfl_xor(MaxSum v, int lane_mask) {
    return {shfl_xor(v.m, lane_mask), shfl_xor(v.s, lane_mask)};
}

struct OnlineSoftmaxOp {
    __device__ static MaxSum identity() { return {-INFINITY, 0.0f}; }
    __device__ static MaxSum combine(MaxSum a, MaxSum b) {
        const float m = fmaxf(a.m, b.m);
        if (m == -INFINITY) return {m, 0.0f};  // nothing seen on either side: avoid exp(-inf + inf) = NaN
        return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
    }
};

// One block per row, the row held in registers (n <= ROW_REG_MAX): each thread takes the max of
// its own values and the sum of exp(x - max) over them, the block merges the threads' (m, s)
// pairs with the online rule, and each thread writes exp(x - m) / s from its registers. One read
// and one write of the row, the minimum.
__global__ void __launch_bounds__(ROW_THREADS_MAX) softmax_kernel(const float* x, float* y, int n, bool vec) {
    const float* xr = x + static_cast<size_t>(blockIdx.x) * n;
    float* yr = y + static_cast<size_t>(blockIdx.x) * n;
    float v[4 * ROW_CHUNKS];
    load_row(xr, n, vec, v, -INFINITY);  // exp(-inf - m) = 0: the padding adds nothing
    float m = -INFINITY, s = 0.0f;
#pragma unroll
    for (int k = 0; k < 4 * ROW_CHUNKS; ++k) m = fmaxf(m, v[k]);
    if (m != -INFINITY) {
#pragma unroll
        for (int k = 0; k < 4 * ROW_CHUNKS; ++k) s += expf(v[k] - m);
    }
    const MaxSum t = block_allreduce<OnlineSoftmaxOp>(MaxSum{m, s});
    const float inv_sum = 1.0f / t.s;
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) {
        float out[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) out[e] = expf(v[4 * c + e] - t.m) * inv_sum;
        store_group(yr, n, vec, threadIdx.x + c * blockDim.x, out);
    }
}

// Rows longer than ROW_REG_MAX: pass 1 streams the row into the online (m, s), one element at a
// time; pass 2 reads it again (mostly from L2) and writes. 1.5x the minimum traffic.
__global__ void softmax_streamed_kernel(const float* x, float* y, int n, bool vec) {
    const float* xr = x + static_cast<size_t>(blockIdx.x) * n;
    float* yr = y + static_cast<size_t>(blockIdx.x) * n;
    MaxSum t = OnlineSoftmaxOp::identity();
    row_for_each(xr, n, vec, [&](int, float v) {
        if (v > t.m) {  // a new maximum: rescale the sum so far (one exp per element either way)
            t.s = t.s * expf(t.m - v) + 1.0f;
            t.m = v;
        } else if (t.m != -INFINITY) {
            t.s += expf(v - t.m);
        }
    });
    t = block_allreduce<OnlineSoftmaxOp>(t);
    const float inv_sum = 1.0f / t.s;
    row_map(xr, yr, n, vec, [&](int, float v) { return expf(v - t.m) * inv_sum; });
}

// y[r, :] = softmax(x[r, :]) for r < rows. A row of only -inf gives NaN, as torch.softmax does.
cudaError_t launch_softmax(const float* x, float* y, size_t rows, int n, cudaStream_t stream) {
    if (rows == 0 || n == 0) return cudaSuccess;
    const bool vec = n % 4 == 0 && aligned16(x) && aligned16(y);
    if (n <= ROW_REG_MAX) softmax_kernel<<<rows, row_block_threads(n), 0, stream>>>(x, y, n, vec);
    else softmax_streamed_kernel<<<rows, 1024, 0, stream>>>(x, y, n, vec);
    return cudaGetLastError();
}
"""

LAYERNORM_CU = r"""
// Welford's algorithm keeps (count, mean, M2 = sum of squared deviations from the mean) and
// updates it one value at a time. It never forms E[x^2] - E[x]^2, the difference of two large,
// nearly equal numbers that loses every digit of the variance when |mean| >> std. Two partial
// states merge exactly (Chan et al.), so the block combines its threads' states with the same
// shuffle reduction as a sum.
struct Welford {
    float n, mean, m2;
};

__device__ __forceinline__ Welford shfl_xor(Welford v, int lane_mask) {
    return {shfl_xor(v.n, lane_mask), shfl_xor(v.mean, lane_mask), shfl_xor(v.m2, lane_mask)};
}

struct WelfordOp {
    __device__ static Welford identity() { return {0.0f, 0.0f, 0.0f}; }
    __device__ static Welford combine(Welford a, Welford b) {
        const float n = a.n + b.n;
        if (n == 0.0f) return a;
        const float delta = b.mean - a.mean, wb = b.n / n;
        return {n, a.mean + delta * wb, a.m2 + b.m2 + delta * delta * a.n * wb};
    }
};

// One block per row, the row held in registers (n <= ROW_REG_MAX). Each thread's (count, mean, M2)
// comes from its own values in two passes over registers (mean first, then squared deviations
// from it: no cancellation); the block merges them with the Welford/Chan rule, and each thread
// writes (x - mean) / sqrt(var + eps) * weight + bias, with the biased variance that torch and
// GPT-2 use. weight and bias are read group by group as the output is written (every block reads
// them, so they come from L1/L2): holding them in registers too would cost occupancy.
__global__ void __launch_bounds__(ROW_THREADS_MAX)
    layer_norm_kernel(const float* x, const float* weight, const float* bias, float* y, int n, float eps, bool vec,
                      bool vec_wb) {
    const float* xr = x + static_cast<size_t>(blockIdx.x) * n;
    float* yr = y + static_cast<size_t>(blockIdx.x) * n;
    float v[4 * ROW_CHUNKS];
    load_row(xr, n, vec, v, 0.0f);
    float count = 0.0f, sum = 0.0f;
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) {
        const int j = threadIdx.x + c * blockDim.x;
        count += static_cast<float>(max(0, min(4, n - 4 * j)));  // the padding is 0: it adds nothing to sum
#pragma unroll
        for (int e = 0; e < 4; ++e) sum += v[4 * c + e];
    }
    const float mean_t = count > 0.0f ? sum / count : 0.0f;
    float m2 = 0.0f;
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) {
        const int j = threadIdx.x + c * blockDim.x;
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (4 * j + e < n) m2 += (v[4 * c + e] - mean_t) * (v[4 * c + e] - mean_t);
    }
    const Welford stats = block_allreduce<WelfordOp>(Welford{count, mean_t, m2});
    const float mean = stats.mean, rstd = rsqrtf(stats.m2 / stats.n + eps);
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) {
        const int j = threadIdx.x + c * blockDim.x;
        if (4 * j >= n) break;
        float w[4], b[4], out[4];
        load_group(weight, n, vec_wb, j, w, 0.0f);
        load_group(bias, n, vec_wb, j, b, 0.0f);
#pragma unroll
        for (int e = 0; e < 4; ++e) out[e] = (v[4 * c + e] - mean) * rstd * w[e] + b[e];
        store_group(yr, n, vec, j, out);
    }
}

// Rows longer than ROW_REG_MAX: pass 1 streams the row into the thread's Welford state, one value
// at a time; pass 2 reads it again (mostly from L2) and writes.
__global__ void layer_norm_streamed_kernel(const float* x, const float* weight, const float* bias, float* y, int n,
                                           float eps, bool vec) {
    const float* xr = x + static_cast<size_t>(blockIdx.x) * n;
    float* yr = y + static_cast<size_t>(blockIdx.x) * n;
    Welford stats = WelfordOp::identity();
    row_for_each(xr, n, vec, [&](int, float v) {
        stats.n += 1.0f;
        const float delta = v - stats.mean;
        stats.mean += delta / stats.n;
        stats.m2 += delta * (v - stats.mean);
    });
    stats = block_allreduce<WelfordOp>(stats);
    const float mean = stats.mean, rstd = rsqrtf(stats.m2 / stats.n + eps);
    row_map(xr, yr, n, vec, [&](int i, float v) { return (v - mean) * rstd * weight[i] + bias[i]; });
}

// y[r, :] = layer_norm(x[r, :]) * weight + bias for r < rows; weight and bias hold n floats.
cudaError_t launch_layer_norm(const float* x, const float* weight, const float* bias, float* y, size_t rows, int n,
                              float eps, cudaStream_t stream) {
    if (rows == 0 || n == 0) return cudaSuccess;
    const bool vec = n % 4 == 0 && aligned16(x) && aligned16(y);
    if (n <= ROW_REG_MAX)
        layer_norm_kernel<<<rows, row_block_threads(n), 0, stream>>>(x, weight, bias, y, n, eps, vec,
                                                                     vec && aligned16(weight) && aligned16(bias));
    else
        layer_norm_streamed_kernel<<<rows, 1024, 0, stream>>>(x, weight, bias, y, n, eps, vec);
    return cudaGetLastError();
}
"""

GELU_CU = r"""
// GPT-2's GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
__device__ __forceinline__ float gelu_tanh(float x) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    return 0.5f * x * (1.0f + tanhf(k0 * (x + k1 * x * x * x)));
}

// y = gelu(x + bias[column]) over a (rows, cols) matrix of n floats; bias may be null (plain
// GELU). Unfused, `h = x + bias; y = gelu(h)` reads and writes the matrix twice (16 bytes per
// element); fused, the sum stays in a register: 8 bytes per element, half the time for a
// memory-bound op. Thread t owns elements 4t..4t+3 with 16-byte loads and stores, as in
// vector_add; vec needs aligned pointers and cols % 4 == 0 (the four share a row).
__global__ void bias_gelu_kernel(const float* x, const float* bias, float* y, size_t n, int cols, bool vec) {
    const size_t i = 4 * (blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x);
    if (vec && i + 3 < n) {
        float4 v = *reinterpret_cast<const float4*>(x + i);
        if (bias != nullptr) {
            const float4 b = *reinterpret_cast<const float4*>(bias + i % cols);
            v = make_float4(v.x + b.x, v.y + b.y, v.z + b.z, v.w + b.w);
        }
        *reinterpret_cast<float4*>(y + i) = make_float4(gelu_tanh(v.x), gelu_tanh(v.y), gelu_tanh(v.z), gelu_tanh(v.w));
    } else {
        for (size_t j = i; j < i + 4 && j < n; ++j) y[j] = gelu_tanh(x[j] + (bias != nullptr ? bias[j % cols] : 0.0f));
    }
}

constexpr int GELU_THREADS = 256;

cudaError_t launch_bias_gelu(const float* x, const float* bias, float* y, size_t n, int cols, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    const bool vec = aligned16(x) && aligned16(y) && (bias == nullptr || (aligned16(bias) && cols % 4 == 0));
    bias_gelu_kernel<<<ceil_div(ceil_div(n, 4), GELU_THREADS), GELU_THREADS, 0, stream>>>(x, bias, y, n, cols, vec);
    return cudaGetLastError();
}
"""

CUDA_SOURCES = {  # csrc/ file -> its kernel text, in build order (the shared helpers first)
    "common.cuh": COMMON_CU,
    "vector_add.cu": VECTOR_ADD_CU,
    "matmul.cu": MATMUL_CU,
    "reduce.cu": REDUCE_CU,
    "softmax.cu": SOFTMAX_CU,
    "layer_norm.cu": LAYERNORM_CU,
    "gelu.cu": GELU_CU,
}

# Torch-facing launchers: tensors in, raw pointers out to the launch_* functions above, on the
# current CUDA stream of the tensors' device. The Python wrappers below have already checked
# devices, dtypes, shapes and contiguity, so these stay thin.
LAUNCH_CU = r"""
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>

namespace {
cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

template <class T>
T* ptr(const at::Tensor& t) {
    return static_cast<T*>(t.data_ptr());
}

template <class T>
const T* ptr_or_null(const std::optional<at::Tensor>& t) {
    return t.has_value() ? ptr<T>(*t) : nullptr;
}
}  // namespace

void vector_add(const at::Tensor& a, const at::Tensor& b, at::Tensor out) {
    const c10::cuda::CUDAGuard guard(a.device());
    C10_CUDA_CHECK(launch_vector_add(ptr<float>(a), ptr<float>(b), ptr<float>(out), a.numel(), stream()));
}

void matmul_naive(const at::Tensor& a, const at::Tensor& b, at::Tensor out) {
    const c10::cuda::CUDAGuard guard(a.device());
    C10_CUDA_CHECK(launch_matmul_naive(ptr<float>(a), ptr<float>(b), ptr<float>(out), a.size(0), b.size(1), a.size(1),
                                       stream()));
}

void matmul_tiled(const at::Tensor& a, const at::Tensor& b, at::Tensor out) {
    const c10::cuda::CUDAGuard guard(a.device());
    C10_CUDA_CHECK(launch_matmul_tiled(ptr<float>(a), ptr<float>(b), ptr<float>(out), a.size(0), b.size(1), a.size(1),
                                       stream()));
}

void matmul_register_tiled(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                           at::Tensor out) {
    const c10::cuda::CUDAGuard guard(a.device());
    C10_CUDA_CHECK(launch_matmul_register_tiled(ptr<float>(a), ptr<float>(b), ptr_or_null<float>(bias), ptr<float>(out),
                                                a.size(0), b.size(1), a.size(1), stream()));
}

void matmul_tensor_core(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                        at::Tensor out, int64_t loads) {
    const c10::cuda::CUDAGuard guard(a.device());
    C10_CUDA_CHECK(launch_matmul_tensor_core(ptr<__nv_bfloat16>(a), ptr<__nv_bfloat16>(b),
                                             ptr_or_null<__nv_bfloat16>(bias), ptr<__nv_bfloat16>(out), a.size(0),
                                             b.size(1), a.size(1), static_cast<int>(loads), stream()));
}

void matmul_wgmma(const at::Tensor& a, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor out) {
    const c10::cuda::CUDAGuard guard(a.device());
    C10_CUDA_CHECK(launch_matmul_wgmma(ptr<__nv_bfloat16>(a), ptr<__nv_bfloat16>(w), ptr_or_null<__nv_bfloat16>(bias),
                                       ptr<__nv_bfloat16>(out), a.size(0), w.size(0), a.size(1), stream()));
}

void reduce(const at::Tensor& x, at::Tensor out, bool is_max, int64_t method) {  // x (rows, n) -> out (rows,)
    const c10::cuda::CUDAGuard guard(x.device());
    const size_t rows = x.size(0);
    const int n = x.size(1);
    const at::Tensor workspace = at::empty({static_cast<int64_t>(reduce_workspace_floats(rows, n))}, x.options());
    C10_CUDA_CHECK(launch_reduce(ptr<float>(x), ptr<float>(out), ptr<float>(workspace), rows, n, is_max,
                                 static_cast<int>(method), stream()));
}

void softmax(const at::Tensor& x, at::Tensor out) {  // x, out (rows, n)
    const c10::cuda::CUDAGuard guard(x.device());
    C10_CUDA_CHECK(launch_softmax(ptr<float>(x), ptr<float>(out), x.size(0), x.size(1), stream()));
}

void layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, at::Tensor out, double eps) {
    const c10::cuda::CUDAGuard guard(x.device());
    C10_CUDA_CHECK(launch_layer_norm(ptr<float>(x), ptr<float>(weight), ptr<float>(bias), ptr<float>(out), x.size(0),
                                     x.size(1), static_cast<float>(eps), stream()));
}

void bias_gelu(const at::Tensor& x, const std::optional<at::Tensor>& bias, at::Tensor out) {  // x (rows, cols)
    const c10::cuda::CUDAGuard guard(x.device());
    C10_CUDA_CHECK(launch_bias_gelu(ptr<float>(x), ptr_or_null<float>(bias), ptr<float>(out), x.numel(), x.size(1),
                                    stream()));
}
"""

LAUNCH_DECLS = r"""
void vector_add(const at::Tensor& a, const at::Tensor& b, at::Tensor out);
void matmul_naive(const at::Tensor& a, const at::Tensor& b, at::Tensor out);
void matmul_tiled(const at::Tensor& a, const at::Tensor& b, at::Tensor out);
void matmul_register_tiled(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                           at::Tensor out);
void matmul_tensor_core(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                        at::Tensor out, int64_t loads);
void matmul_wgmma(const at::Tensor& a, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor out);
void reduce(const at::Tensor& x, at::Tensor out, bool is_max, int64_t method);
void softmax(const at::Tensor& x, at::Tensor out);
void layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, at::Tensor out, double eps);
void bias_gelu(const at::Tensor& x, const std::optional<at::Tensor>& bias, at::Tensor out);
"""

KERNEL_FUNCTIONS = [
    "vector_add", "matmul_naive", "matmul_tiled", "matmul_register_tiled",
    "matmul_tensor_core", "matmul_wgmma", "reduce", "softmax", "layer_norm", "bias_gelu",
]


@functools.cache
def kernels():
    """The compiled kernel module: built on first use (about a minute), for this GPU's
    architecture; torch caches the build on disk and rebuilds only when a source changes."""
    if not torch.cuda.is_available():
        raise RuntimeError("the stage-04 CUDA kernels need an NVIDIA GPU with CUDA")
    from torch.utils.cpp_extension import load_inline

    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        raise RuntimeError(f"the stage-04 kernels need compute capability 8.0+ (cp.async, bf16 mma): {major}.{minor}")
    # sm_90a, not sm_90: the "a" target unlocks Hopper-only instructions such as wgmma.
    arch = f"{major}{minor}{'a' if major == 9 else ''}"
    print(f"loading CUDA kernels for sm_{arch} (the first build takes about a minute)", flush=True)
    return load_inline(
        name=f"book04_kernels_sm{arch}",
        cpp_sources=LAUNCH_DECLS,
        cuda_sources="\n".join(CUDA_SOURCES.values()) + LAUNCH_CU,
        functions=KERNEL_FUNCTIONS,
        extra_cuda_cflags=["-O3", "-lineinfo", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
    )


# ---------------------------------------------------------------------------------------------
# Python wrappers: check, allocate, launch
# ---------------------------------------------------------------------------------------------
# Every check that needs no GPU (type, dtype, shape, layout) runs first, so bad input gets the
# same clear error on any machine; the device check comes last, then the build.

def _check(t, name, dtype, dim=None, scalar_ok=False):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.dim() == 0 and not scalar_ok:
        raise ValueError(f"{name} must have at least one dimension")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def _check_vector(t, name, dtype, length):
    _check(t, name, dtype, dim=1)
    if t.numel() != length:
        raise ValueError(f"{name} must have {length} elements (the last dimension), got {t.numel()}")


def _prepare(inputs, out, shape, dtype):
    """Check `out` if given (tests pass one filled with NaN: an element the kernel skips stays NaN)
    and the devices, then build the module; returns (module, out)."""
    if out is not None:
        _check(out, "out", dtype, scalar_ok=len(shape) == 0)  # a reduction of a 1-D tensor gives a 0-d one
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    tensors = [t for t in inputs if t is not None] + ([out] if out is not None else [])
    device = tensors[0].device
    for t in tensors:
        if t.device.type != "cuda":
            raise ValueError(f"the stage-04 kernels need CUDA tensors (an NVIDIA GPU), got a tensor on {t.device}")
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError("the stage-04 kernels have no backward pass: call them under torch.no_grad()")
    module = kernels()
    return module, torch.empty(shape, dtype=dtype, device=device) if out is None else out


def _rows(x):
    """x (..., n) as a (rows, n) view: the row kernels give each row one block."""
    if x.shape[-1] >= 2**31:
        raise ValueError(f"the last dimension must be below 2^31, got {x.shape[-1]}")
    return x.view(-1, x.shape[-1])


def vector_add(a, b, out=None):
    """a + b, elementwise, for float32 CUDA tensors of one shape."""
    _check(a, "a", torch.float32)
    _check(b, "b", torch.float32)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    module, out = _prepare([a, b], out, a.shape, torch.float32)
    module.vector_add(a, b, out)
    return out


def _matmul_shape(a, b, dtype):
    _check(a, "a", dtype, dim=2)
    _check(b, "b", dtype, dim=2)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a's columns must equal b's rows")
    if max(a.shape[0], a.shape[1], b.shape[1]) >= 2**31:
        raise ValueError("matrix dimensions must be below 2^31")
    return a.shape[0], b.shape[1]


def matmul_naive(a, b, out=None):
    """a (M, K) @ b (K, N) -> (M, N), float32: one thread per output, straight from memory."""
    M, N = _matmul_shape(a, b, torch.float32)
    module, out = _prepare([a, b], out, (M, N), torch.float32)
    module.matmul_naive(a, b, out)
    return out


def matmul_tiled(a, b, out=None):
    """a (M, K) @ b (K, N) -> (M, N), float32: 32x32 tiles staged in shared memory."""
    M, N = _matmul_shape(a, b, torch.float32)
    module, out = _prepare([a, b], out, (M, N), torch.float32)
    module.matmul_tiled(a, b, out)
    return out


def matmul_register_tiled(a, b, bias=None, out=None):
    """a (M, K) @ b (K, N) (+ bias (N,)) -> (M, N), float32: 128x128 block tiles, 8x8 outputs
    per thread in registers, float4 loads, double-buffered shared memory."""
    M, N = _matmul_shape(a, b, torch.float32)
    if bias is not None:
        _check_vector(bias, "bias", torch.float32, N)
    module, out = _prepare([a, b, bias], out, (M, N), torch.float32)
    module.matmul_register_tiled(a, b, bias, out)
    return out


def _tensor_core_operands(N, K, bias, operands):
    # cp.async moves whole 16-byte chunks (8 bf16) of each row; TMA wants 16-byte strides and addresses
    if K % 8 or N % 8:
        raise ValueError(f"the tensor-core matmuls need K and N to be multiples of 8 (16-byte rows), got {K=}, {N=}")
    for t, name in operands:
        if t is not None and t.data_ptr() % 16:
            raise ValueError(f"{name}'s data must be 16-byte aligned (a view at an odd offset? pass .clone())")
    if bias is not None:
        _check_vector(bias, "bias", torch.bfloat16, N)


TENSOR_CORE_LOADS = {"auto": -1, "cp.async": 0, "tma": 1}


def matmul_tensor_core(a, b, bias=None, out=None, loads="auto"):
    """a (M, K) @ b (K, N) (+ bias (N,)) -> (M, N), bfloat16 in and out, float32 accumulation,
    on tensor cores (mma.sync, ldmatrix). K and N must be multiples of 8 and a and b 16-byte
    aligned; M is free. loads: how tiles reach shared memory, "cp.async" (sm_80+), "tma"
    (Hopper) or "auto" (TMA where the GPU has it)."""
    if loads not in TENSOR_CORE_LOADS:
        raise ValueError(f"loads must be one of {list(TENSOR_CORE_LOADS)}, got {loads!r}")
    M, N = _matmul_shape(a, b, torch.bfloat16)
    _tensor_core_operands(N, a.shape[1], bias, [(a, "a"), (b, "b"), (out, "out")])
    module, out = _prepare([a, b, bias], out, (M, N), torch.bfloat16)
    if loads == "tma" and torch.cuda.get_device_capability(a.device)[0] < 9:
        raise RuntimeError("loads='tma' needs a Hopper GPU or newer (sm_90: H100, H200)")
    module.matmul_tensor_core(a, b, bias, out, TENSOR_CORE_LOADS[loads])
    return out


def matmul_wgmma(a, w, bias=None, out=None):
    """a (M, K) @ w.T (+ bias (N,)) -> (M, N) for w (N, K), bfloat16, with Hopper's wgmma (H100,
    H200). w is B transposed, the layout of nn.Linear's weight, because wgmma reads both operands
    K-major. K and N must be multiples of 8 and a and w 16-byte aligned; M is free."""
    _check(a, "a", torch.bfloat16, dim=2)
    _check(w, "w", torch.bfloat16, dim=2)
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"a is {tuple(a.shape)} and w is {tuple(w.shape)}: both need K columns (w is (N, K))")
    M, N = a.shape[0], w.shape[0]
    _tensor_core_operands(N, a.shape[1], bias, [(a, "a"), (w, "w"), (out, "out")])
    module, out = _prepare([a, w, bias], out, (M, N), torch.bfloat16)
    if torch.cuda.get_device_capability(a.device) != (9, 0):
        raise RuntimeError("matmul_wgmma needs a Hopper GPU (sm_90a: H100, H200)")
    module.matmul_wgmma(a, w, bias, out)
    return out


REDUCE_METHODS = {"atomic": 0, "tree": 1, "shuffle": 2}  # in the order of chapter 13


def _reduce(x, method, out, is_max):
    _check(x, "x", torch.float32)
    if method not in REDUCE_METHODS:
        raise ValueError(f"method must be one of {list(REDUCE_METHODS)}, got {method!r}")
    rows = _rows(x)
    module, out = _prepare([x], out, x.shape[:-1], torch.float32)
    module.reduce(rows, out.view(-1), is_max, REDUCE_METHODS[method])
    return out


def reduce_sum(x, method="shuffle", out=None):
    """Sum over the last dimension of a float32 tensor: (..., n) -> (...). method "atomic" (every
    element atomically added to its row's total), "tree" (shared-memory halving) or "shuffle"
    (warp shuffles). Rounding depends on the order of the additions: the tree methods err by
    ~log2(n) ulps of sum |x|, and "atomic" by up to ~n, differently on every run."""
    return _reduce(x, method, out, is_max=False)


def reduce_max(x, method="shuffle", out=None):
    """Maximum over the last dimension of a float32 tensor: (..., n) -> (...); exact, whatever the
    method or order. Methods as for reduce_sum."""
    return _reduce(x, method, out, is_max=True)


def softmax(x, out=None):
    """Softmax over the last dimension of a float32 tensor (online max-and-sum merge, one read and
    one write of each row up to 16,384 columns, held in registers). A row of only -inf gives NaN,
    as in torch."""
    _check(x, "x", torch.float32)
    rows = _rows(x)
    module, out = _prepare([x], out, x.shape, torch.float32)
    module.softmax(rows, out.view(rows.shape))
    return out


def layer_norm(x, weight, bias, eps=1e-5, out=None):
    """Layer norm over the last dimension C of a float32 tensor, with weight and bias of shape (C,)
    and the biased variance (as torch and GPT-2); per-thread mean and variance merged by the
    Welford/Chan rule."""
    _check(x, "x", torch.float32)
    _check_vector(weight, "weight", torch.float32, x.shape[-1])
    _check_vector(bias, "bias", torch.float32, x.shape[-1])
    rows = _rows(x)
    module, out = _prepare([x, weight, bias], out, x.shape, torch.float32)
    module.layer_norm(rows, weight, bias, out.view(rows.shape), float(eps))
    return out


def gelu(x, out=None):
    """GPT-2's GELU, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), on a float32 tensor."""
    _check(x, "x", torch.float32)
    rows = _rows(x)
    module, out = _prepare([x], out, x.shape, torch.float32)
    module.bias_gelu(rows, None, out)
    return out


def bias_gelu(x, bias, out=None):
    """gelu(x + bias) in one pass, bias (C,) added along the last dimension C: the fusion saves
    the write and re-read of x + bias, half the traffic of doing the two apart."""
    _check(x, "x", torch.float32)
    _check_vector(bias, "bias", torch.float32, x.shape[-1])
    rows = _rows(x)
    module, out = _prepare([x, bias], out, x.shape, torch.float32)
    module.bias_gelu(rows, bias, out)
    return out


def self_check(seed=0):
    """Every kernel against torch in float64 on awkward sizes (1, 17, 1023, 4097; no multiple of
    any tile), outputs poisoned with NaN first; one line per case, printed as it runs (wgmma, the
    newest code, last). Returns True if all pass."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    failures = 0

    def rand(*shape, dtype=torch.float32, lo=-1.0, hi=1.0):
        return (torch.rand(*shape, generator=g, device="cuda") * (hi - lo) + lo).to(dtype)

    def run(fn, *args, shape, dtype=torch.float32, **kwargs):
        return fn(*args, out=torch.full(shape, float("nan"), dtype=dtype, device="cuda"), **kwargs)

    def rel(got, ref):  # absolute where ref is all zeros (gelu of a very negative x): 0/0 would be NaN
        err, scale = (got.double() - ref).norm().item(), ref.norm().item()
        return err / scale if scale > 0 else err

    def case(name, err, tol):
        nonlocal failures
        passed = err <= tol  # NaN fails
        failures += not passed
        print(f"  {name:44s} err {err:.2e}  tol {tol:.0e}  {'ok' if passed else 'FAIL'}", flush=True)

    for n in [1, 17, 1023, 4097, 1_000_003]:
        a, b = rand(n), rand(n)
        case(f"vector_add n={n}", rel(run(vector_add, a, b, shape=(n,)), a.double() + b.double()), 1e-7)
    for M, N, K in [(1, 1, 1), (17, 33, 1023), (1023, 17, 4097), (129, 4097, 17), (300, 516, 1024)]:
        a, b, bias = rand(M, K), rand(K, N), rand(N)
        ref = a.double() @ b.double()
        for fn in (matmul_naive, matmul_tiled, matmul_register_tiled):
            case(f"{fn.__name__} {M}x{N}x{K}", rel(run(fn, a, b, shape=(M, N)), ref), 2e-5)
        got = run(matmul_register_tiled, a, b, bias=bias, shape=(M, N))
        case(f"matmul_register_tiled+bias {M}x{N}x{K}", rel(got, ref + bias.double()), 2e-5)
    tensor_core_shapes = [(1, 8, 8), (17, 1032, 4096), (1023, 264, 72), (4097, 520, 1000)]
    tensor_core_loads = ["cp.async"] + (["tma"] if torch.cuda.get_device_capability()[0] >= 9 else [])
    for M, N, K in tensor_core_shapes:
        a, b, bias = rand(M, K, dtype=torch.bfloat16), rand(K, N, dtype=torch.bfloat16), rand(N, dtype=torch.bfloat16)
        for loads in tensor_core_loads:
            got = run(matmul_tensor_core, a, b, bias=bias, shape=(M, N), dtype=torch.bfloat16, loads=loads)
            case(f"matmul_tensor_core+bias {loads} {M}x{N}x{K}", rel(got, a.double() @ b.double() + bias.double()),
                 5e-3)
    for rows, n in [(1, 1), (17, 1023), (3, 4097), (1023, 17), (2, 100_003)]:
        x = rand(rows, n)
        for method in REDUCE_METHODS:
            got = run(reduce_sum, x, method=method, shape=(rows,))
            err = ((got.double() - x.double().sum(-1)).abs() / x.double().abs().sum(-1)).max().item()
            case(f"reduce_sum {method} {rows}x{n}", err, 1e-6)
            got = run(reduce_max, x, method=method, shape=(rows,))
            case(f"reduce_max {method} {rows}x{n}", (got.double() - x.double().amax(-1)).abs().max().item(), 0.0)
    for rows, n in [(1, 1), (17, 1023), (3, 4097), (1023, 17), (5, 8193), (2, 50257)]:
        x, w, b = rand(rows, n, lo=-10.0, hi=10.0), rand(n), rand(n)
        case(f"softmax {rows}x{n}", rel(run(softmax, x, shape=(rows, n)), torch.softmax(x.double(), -1)), 1e-5)
        ref = F.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
        case(f"layer_norm {rows}x{n}", rel(run(layer_norm, x, w, b, shape=(rows, n)), ref), 1e-5)
        case(f"gelu {rows}x{n}", rel(run(gelu, x, shape=(rows, n)), F.gelu(x.double(), approximate="tanh")), 1e-6)
        ref = F.gelu(x.double() + w.double(), approximate="tanh")
        case(f"bias_gelu {rows}x{n}", rel(run(bias_gelu, x, w, shape=(rows, n)), ref), 1e-6)
    if torch.cuda.get_device_capability() == (9, 0):
        for M, N, K in tensor_core_shapes:
            a, w = rand(M, K, dtype=torch.bfloat16), rand(N, K, dtype=torch.bfloat16)  # w (N, K): a @ w.T
            bias = rand(N, dtype=torch.bfloat16)
            got = run(matmul_wgmma, a, w, bias=bias, shape=(M, N), dtype=torch.bfloat16)
            case(f"matmul_wgmma+bias {M}x{N}x{K}", rel(got, a.double() @ w.double().T + bias.double()), 5e-3)
    return failures == 0


# ---------------------------------------------------------------------------------------------
# The GPT on the kernels
# ---------------------------------------------------------------------------------------------
# NEW in stage 04: subclasses whose forward calls the kernels. use_cuda_kernels() swaps them in
# place, so the model code above stays exactly as stage 03 wrote it.

class CudaLayerNorm(LayerNorm):
    def forward(self, x):
        return layer_norm(x, self.weight, self.bias, self.eps)


class CudaGELU(GELU):
    def forward(self, x):
        return gelu(x)


class CudaLinear(nn.Linear):
    """nn.Linear on the fp32 register-tiled matmul, or in bf16 on the tensor-core kernel."""

    def prepare(self, tensor_cores):
        # The kernels take b as (in, out) row-major; nn.Linear stores its weight as (out, in).
        # Transpose once here: the kernels are for inference, so the weights stay fixed.
        self.tensor_cores = tensor_cores
        w_t = self.weight.detach().t()  # (in, out)
        if tensor_cores:
            pad = -self.out_features % 8  # the tensor-core kernel needs N % 8 == 0 (GPT-2's vocab is odd)
            self.w_t = F.pad(w_t, (0, pad)).to(torch.bfloat16).contiguous()
            self.b_t = None if self.bias is None else F.pad(self.bias.detach(), (0, pad)).to(torch.bfloat16)
        else:
            self.w_t = w_t.contiguous()
            self.b_t = None if self.bias is None else self.bias.detach()

    def project(self, x, with_bias=True):
        """x (..., in) -> (rows, out) float32."""
        x = x.reshape(-1, self.in_features)  # (B*T, in)
        bias = self.b_t if with_bias else None
        if self.tensor_cores:
            return matmul_tensor_core(x.to(torch.bfloat16), self.w_t, bias)[:, : self.out_features].float()
        return matmul_register_tiled(x.contiguous(), self.w_t, bias)

    def forward(self, x):
        return self.project(x).view(*x.shape[:-1], self.out_features)


class CudaMLP(MLP):
    """The MLP with c_fc's bias add and the GELU fused into one kernel."""

    def forward(self, x):
        h = self.c_fc.project(x, with_bias=False)  # (B*T, 4C), bias not yet added
        h = gelu(h) if self.c_fc.bias is None else bias_gelu(h, self.c_fc.bias)  # one pass, not two
        return self.dropout(self.c_proj(h.view(*x.shape[:-1], -1)))


class CudaAttention(MultiHeadAttention):
    def attend(self, q, k, v):
        """Causal attention with an explicit mask, its softmax on the online-softmax kernel."""
        T = q.size(2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))      # (B, H, T, T)
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        att = softmax(att)                                    # changed in 04: the CUDA kernel
        return self.attn_dropout(att) @ v                             # (B, H, T, D)


def use_cuda_kernels(model, tensor_cores=False):
    """Run the model's LayerNorms, GELUs, MLPs (bias + GELU fused), attention softmax and Linear
    layers on the CUDA kernels, in place; returns the model. tensor_cores: Linear layers in bf16 on
    the tensor-core kernel (faster, bf16-level error) rather than fp32. Inference only."""
    if not next(model.parameters()).is_cuda:
        raise ValueError("move the model to the GPU first: model.to('cuda')")
    swaps = {LayerNorm: CudaLayerNorm, GELU: CudaGELU, MLP: CudaMLP, MultiHeadAttention: CudaAttention,
             nn.Linear: CudaLinear}
    for module in model.modules():
        if type(module) in swaps:
            # Reassigning __class__ changes only which forward runs: parameters, buffers and the
            # tie between lm_head and wte stay exactly as they were.
            module.__class__ = swaps[type(module)]
        if isinstance(module, CudaLinear):
            module.prepare(tensor_cores)
    return model


# ---------------------------------------------------------------------------------------------
# --bench: every kernel beside its torch/cuBLAS baseline, in one run (stage 03's bench() timed
# training; stage 04's --bench prints this table)
# ---------------------------------------------------------------------------------------------

def bench_kernels():
    """Print, per kernel at the kernel_work() sizes: time, GB/s or TFLOP/s, the fraction of the
    measured limit (copy bandwidth, or cuBLAS at 8192^3 for matmuls), and torch's time."""
    limits = measure_limits()
    describe_roofline(limits)
    work = kernel_work()
    cuda = dict(device="cuda")
    print(f"{'kernel':30s} {'size':>11s} {'ms':>8s} {'rate':>14s} {'of limit':>8s} {'torch ms':>9s} {'vs torch':>8s}")

    def report(label, key, ours, theirs):
        size, flops, nbytes, unit = work[key]
        ms, torch_ms = time_ms(ours), time_ms(theirs)
        if unit == "copy":
            rate, limit, text = nbytes / ms / 1e6, limits.copy_gbps, f"{nbytes / ms / 1e6:8.0f} GB/s"
        else:
            rate = flops / ms / 1e9
            limit = limits.bf16_tflops if unit == "bf16" else limits.fp32_tflops
            text = f"{rate:6.1f} TFLOP/s"
        print(f"{label:30s} {size:>11s} {ms:8.3f} {text:>14s} {rate / limit:8.0%} {torch_ms:9.3f} "
              f"{torch_ms / ms:7.2f}x")

    with torch.no_grad():
        a, b = torch.randn(BENCH_N, **cuda), torch.randn(BENCH_N, **cuda)
        c = torch.empty_like(a)
        report("vector_add", "vector_add", lambda: vector_add(a, b, out=c), lambda: torch.add(a, b, out=c))
        del a, b, c

        S = BENCH_MM
        a, b = torch.randn(S, S, **cuda), torch.randn(S, S, **cuda)
        with fp32_matmul_precision("highest"):
            for fn in (matmul_naive, matmul_tiled, matmul_register_tiled):
                report(fn.__name__, "matmul fp32", lambda: fn(a, b), lambda: a @ b)
        a, b = a.bfloat16(), b.bfloat16()
        report("matmul_tensor_core (cp.async)", "matmul bf16", lambda: matmul_tensor_core(a, b, loads="cp.async"),
               lambda: a @ b)
        if torch.cuda.get_device_capability()[0] >= 9:
            report("matmul_tensor_core (TMA)", "matmul bf16", lambda: matmul_tensor_core(a, b, loads="tma"),
                   lambda: a @ b)

        x = torch.randn(BENCH_ROWS, BENCH_COLS, **cuda)
        w, bias = torch.randn(BENCH_COLS, **cuda), torch.randn(BENCH_COLS, **cuda)
        for method in REDUCE_METHODS:
            report(f"reduce_sum ({method})", "reduce_sum", lambda: reduce_sum(x, method), lambda: x.sum(-1))
        for method in REDUCE_METHODS:
            report(f"reduce_max ({method})", "reduce_max", lambda: reduce_max(x, method), lambda: x.amax(-1))
        report("softmax", "softmax", lambda: softmax(x), lambda: torch.softmax(x, -1))
        report("layer_norm", "layer_norm", lambda: layer_norm(x, w, bias),
               lambda: F.layer_norm(x, (BENCH_COLS,), w, bias))
        report("gelu", "gelu", lambda: gelu(x), lambda: F.gelu(x, approximate="tanh"))
        report("bias_gelu (fused)", "bias_gelu", lambda: bias_gelu(x, bias),
               lambda: F.gelu(x + bias, approximate="tanh"))
        del x

        if torch.cuda.get_device_capability() == (9, 0):  # last: the newest kernel
            w = b.t().contiguous()  # (N, K): wgmma's operand layout
            report("matmul_wgmma", "matmul bf16", lambda: matmul_wgmma(a, w), lambda: a @ b)


def kernel_chapter(run_bench=False):
    """What stage 04 adds to `python 04_cuda_kernels.py`: on a GPU, the kernels' self-check (and
    with --bench the table); without one, a one-line notice and the parts that run on a CPU.
    Returns False if a self-check failed."""
    if not torch.cuda.is_available():
        print("the CUDA kernels need an NVIDIA GPU; running the CPU parts only (roofline arithmetic, summation order)")
        describe_roofline()
        summation_order_demo()
        return True
    summation_order_demo()
    print("kernels against torch in float64, on awkward sizes:")
    ok = self_check()
    if run_bench:
        bench_kernels()
    return ok


# ----------------------------------------------------------------------------------------------
# Plumbing: data files, downloaded once into data/ and checked by sha256
# ----------------------------------------------------------------------------------------------

DATA_DIR = Path(__file__).resolve().parent / "data"

# name -> (url, sha256). data/README.md lists the same files with their sizes and licences.
DATA_FILES = {
    "the-verdict.txt": (
        "https://raw.githubusercontent.com/rasbt/LLMs-from-scratch/main/ch02/"
        "01_main-chapter-code/the-verdict.txt",
        "b41e41a68f0398a3154ae69e2e4c0e2694e17fe0d66730536837f1b01935b31f",
    ),
    "gpt2.tiktoken": (
        "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken",
        "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
    ),
}


class DataError(RuntimeError):
    """A file the run needs is missing, cannot be downloaded, or is not what it should be. The
    message names the file and what to do; `main` prints it without a traceback."""


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _server_sha256(response):
    """The Hugging Face Hub names a large file's sha256 in the X-Linked-Etag header of the
    redirect it answers with; use it when no checksum is pinned."""
    for r in [*response.history, response]:
        etag = r.headers.get("X-Linked-Etag", "").strip('"').removeprefix("W/").strip('"')
        if len(etag) == 64 and all(c in "0123456789abcdef" for c in etag):
            return etag
    return None


def _check_placed(dest, url, sha256):
    """A file already in the cache may have been put there by hand: check it like a download."""
    if not dest.is_file():
        raise DataError(f"{dest} is not a file; remove it so that {url} can be downloaded there")
    if sha256 is not None and _sha256(dest) != sha256:
        raise DataError(f"{dest} ({dest.stat().st_size:,} bytes) is not the expected file: its "
                        f"sha256 should be {sha256}. Delete it to download it again, or replace "
                        f"it with the file from {url}")


@contextlib.contextmanager
def _download_lock(dest):
    """Hold an exclusive lock next to `dest`: a second process fetching the same file waits here
    instead of appending to the first one's `.part`. (No lock on Windows, which lacks fcntl.)"""
    if fcntl is None:
        yield
        return
    with open(dest.with_name(dest.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"  waiting for another process downloading {dest.name}", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def download(url, dest, sha256=None, timeout=30.0):
    """Download `url` to `dest` unless it is already there; return the path.

    The bytes go to `dest.part` first and are renamed into place only once complete and
    checked, so the cache never holds a partial or corrupt file. An interrupted download keeps
    its `.part` and the next call resumes it with an HTTP Range request. The check is `sha256`
    when given, else the checksum the server names, else the announced size. A file already at
    `dest` is checked against `sha256` too. Failures raise DataError naming the file and URL.
    """
    dest = Path(dest)
    if dest.exists():
        _check_placed(dest, url, sha256)
        return dest
    created = [p for p in reversed(dest.parents) if not p.exists()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _download_lock(dest):
            if dest.exists():  # another process finished it while we waited
                _check_placed(dest, url, sha256)
            else:
                _fetch(url, dest, sha256, timeout)
    finally:
        dest.with_name(dest.name + ".lock").unlink(missing_ok=True)
        for folder in reversed(created):  # leave no empty folder behind a failed download
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
    return dest


def _fetch(url, dest, sha256, timeout):
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    # identity: a compressed body would not match Content-Length or resume at a byte offset
    headers = {"Accept-Encoding": "identity", **({"Range": f"bytes={have}-"} if have else {})}
    try:
        response = requests.get(url, stream=True, timeout=timeout, headers=headers)
        if have and response.status_code == 416:  # the .part is stale: start over
            part.unlink()
            return _fetch(url, dest, sha256, timeout)
        response.raise_for_status()
    except requests.HTTPError as e:
        raise DataError(f"{dest}: missing, and {url} answered {e.response.status_code} "
                        f"{e.response.reason}") from None
    except requests.RequestException as e:
        raise DataError(f"{dest}: missing, and {url} cannot be reached "
                        f"({type(e).__name__}: no network?)") from None
    if response.status_code != 206:  # the server ignored the Range header: start over
        have = 0
    sha256 = sha256 or _server_sha256(response)
    remaining = int(response.headers.get("Content-Length", 0))
    total = have + remaining if remaining else None
    done, last_print, start = have, 0.0, time.time()
    try:
        with open(part, "ab" if have else "wb") as f:
            for block in response.iter_content(chunk_size=1 << 20):
                f.write(block)
                done += len(block)
                if time.time() - last_print > 0.5 or (total and done == total):
                    last_print = time.time()
                    rate = (done - have) / max(last_print - start, 1e-9) / 1e6
                    of = f"/{total / 1e6:.1f}" if total else ""
                    print(f"\r  {dest.name}: {done / 1e6:.1f}{of} MB, {rate:.1f} MB/s",
                          end="", file=sys.stderr, flush=True)
    except requests.RequestException as e:
        raise DataError(f"download of {url} was interrupted after {done} bytes ({e}); "
                        f"run again to resume from {part}") from None
    finally:
        if done > have:
            print(file=sys.stderr)  # end the progress line
    if total is not None and done != total:
        raise DataError(f"download of {url} stopped at {done} of {total} bytes; "
                        f"run again to resume from {part}")
    if sha256 is not None and _sha256(part) != sha256:
        part.unlink()
        raise DataError(f"checksum mismatch for {url}: expected sha256 {sha256}; "
                        f"the download was deleted")
    os.replace(part, dest)  # atomic: the file appears complete or not at all


def fetch(files):
    """Download every (url, dest, sha256) in `files` that is not cached yet; return the paths.
    Every file that cannot be had is named in one DataError, so an offline user learns the
    whole list at once rather than one file per run."""
    paths, problems = [], []
    for url, dest, sha256 in files:
        try:
            paths.append(download(url, dest, sha256))
        except DataError as e:
            problems.append(str(e))
    if problems:
        raise DataError("\n  ".join([
            f"{len(problems)} file(s) this run needs cannot be had:", *problems,
            "Place each at the path shown (fetched from its URL where there is a network), or "
            "point --data-dir at a folder that holds them."]))
    return paths


def _data_dir(data_dir):
    folder = Path(data_dir or DATA_DIR)
    if folder.exists() and not folder.is_dir():
        raise DataError(f"the data directory {folder} is a file, not a directory")
    return folder


def data_entry(name, data_dir=None):
    """(url, cache path, sha256) of a known data file (see DATA_FILES), for `fetch`."""
    if name not in DATA_FILES:
        raise KeyError(f"unknown data file {name!r}; known: {sorted(DATA_FILES)}")
    url, sha256 = DATA_FILES[name]
    return url, _data_dir(data_dir) / name, sha256


def data_file(name, data_dir=None):
    """Path of a known data file, downloaded into the cache on first use."""
    return fetch([data_entry(name, data_dir)])[0]


# ----------------------------------------------------------------------------------------------
# Putting it together
# ----------------------------------------------------------------------------------------------

# Model shapes and training defaults. "tiny" shows a clearly falling loss on a laptop CPU in
# about two minutes; the GPT-2 sizes use the book's settings (context 256, batch 2, lr 4e-4).
TRAIN_PRESETS = {
    "tiny": dict(model=dict(n_layer=4, n_head=4, n_embd=256), context_length=128, batch_size=8,
                 epochs=15, lr=1e-3, dropout=0.0),
    **{size: dict(model={}, context_length=256, batch_size=2, epochs=10, lr=4e-4, dropout=0.1)
       for size in GPT2_SIZES},
}


def build_config(preset, context_length, dropout):
    """The GPTConfig of a training preset, its vocabulary padded to a multiple of 64."""
    # GPT-2's 50,257 is odd, so lm_head's bf16 rows are not 16-byte aligned and cuBLAS falls back
    # to slow align1 kernels; padded to 50,304 (nanoGPT's choice) they fill whole tensor-core tiles.
    if preset == "tiny":
        return GPTConfig(context_length=context_length, dropout=dropout, vocab_multiple=64,
                         **TRAIN_PRESETS["tiny"]["model"])
    return GPTConfig.gpt2(preset, context_length=context_length, dropout=dropout,
                          vocab_multiple=64)


def positive_int(text):
    """argparse type: an integer >= 1 (0 is not a way to ask for the default)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text):
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text):
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def probability(text):
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=list(TRAIN_PRESETS),
                        help="model shape to train (default: tiny)")
    parser.add_argument("--epochs", type=positive_int, help="default: the preset's")
    parser.add_argument("--batch-size", type=positive_int, help="default: the preset's")
    parser.add_argument("--context-length", type=positive_int, help="default: the preset's")
    parser.add_argument("--lr", type=positive_float,
                        help="peak learning rate (default: the preset's)")
    parser.add_argument("--train", action="store_true", help="train first, as stage 03 does")
    parser.add_argument("--save", help="write the trained model to this .safetensors file")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--load", help="generate from a checkpoint instead of training")
    source.add_argument("--gpt2", choices=list(GPT2_REPOS), metavar="SIZE",
                        help="generate with GPT-2's real weights (124M, 355M, 774M, 1558M)")
    source.add_argument("--gpt2-dir", help="generate with GPT-2 weights from this HF directory")
    parser.add_argument("--kernels", choices=["torch", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "torch",
                        help="run the GPT's forward on torch or on this stage's CUDA kernels")
    parser.add_argument("--tensor-cores", action="store_true",
                        help="with --kernels cuda: Linear layers in bf16 on the tensor-core kernel")
    parser.add_argument("--prompt", help='text to continue (default: "Every effort moves you")')
    parser.add_argument("--max-new-tokens", type=positive_int,
                        help="tokens to generate (default: 40)")
    parser.add_argument("--temperature", type=non_negative_float, help="0 = greedy (the default)")
    parser.add_argument("--top-k", type=positive_int, help="sample from the k likeliest tokens")
    parser.add_argument("--top-p", type=probability, help="sample from the smallest set of "
                        "tokens whose probabilities add up to p")
    parser.add_argument("--bench", action="store_true", help="time every kernel against torch")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--data-dir", default=None, help="download cache (default: data/)")
    parser.add_argument("--seed", type=int, default=123, help="seed of the weights, the data "
                        "order and sampling")
    args = parser.parse_args()
    check_args(parser, args)
    # the defaults, filled in after the checks (which need to know what was given)
    args.prompt = args.prompt or "Every effort moves you"
    args.max_new_tokens = args.max_new_tokens or 40
    args.temperature = args.temperature or 0.0
    return args


TRAINING_FLAGS = ("model", "epochs", "batch_size", "context_length", "lr", "save")
SAMPLING_FLAGS = ("prompt", "max_new_tokens", "temperature", "top_k", "top_p")


def check_args(parser, args):
    """Every flag checked before any work starts, so that a bad one never costs a training run."""
    given = {name for name, value in vars(args).items() if value not in (None, False)}

    def refuse(flags, why):
        clash = [flag for flag in flags if flag in given]
        if clash:
            parser.error(f"--{clash[0].replace('_', '-')} {why}")

    loading = args.load or args.gpt2 or args.gpt2_dir
    if args.bench:
        refuse(("train", "epochs", "lr", "save", "load", "gpt2", "gpt2_dir", *SAMPLING_FLAGS),
               "does not apply to --bench")
    if not args.train:  # changed in 04: training is opt-in (--train)
        refuse(TRAINING_FLAGS, "only applies with --train")
    elif loading:
        parser.error("--train trains a new model; it does not go with --load, --gpt2 or --gpt2-dir")
    if args.prompt is not None and not args.prompt.strip():
        parser.error("--prompt is empty: generation needs at least one token to continue")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        parser.error(f"--device {args.device}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA GPU")
    if args.kernels == "cuda" and device.type != "cuda":
        parser.error("--kernels cuda needs an NVIDIA GPU (--device cuda)")
    if args.tensor_cores and args.kernels != "cuda":
        parser.error("--tensor-cores only applies with --kernels cuda")
    if args.data_dir and Path(args.data_dir).exists() and not Path(args.data_dir).is_dir():
        parser.error(f"--data-dir {args.data_dir} is a file, not a directory")
    if args.load and not Path(args.load).is_file():
        parser.error(f"--load {args.load}: no such file")
    if args.gpt2_dir and not Path(args.gpt2_dir).is_dir():
        parser.error(f"--gpt2-dir {args.gpt2_dir}: no such directory")
    if args.save:
        save = Path(args.save)
        if save.is_dir():
            parser.error(f"--save {args.save} is a directory; name the file to write")
        if not save.parent.is_dir():
            parser.error(f"--save {args.save}: the directory {save.parent} does not exist")
        if not os.access(save.parent, os.W_OK):
            parser.error(f"--save {args.save}: cannot write in {save.parent}")


def check_prompt(ids, context_length):
    if len(ids) > context_length:
        sys.exit(f"error: the prompt is {len(ids)} tokens, longer than the model's context of "
                 f"{context_length}")


def train_model(args, device, tokenizer):
    """Stage 03's run: a GPT of the chosen preset trained on The Verdict."""
    name = args.model or "tiny"
    preset = TRAIN_PRESETS[name]
    T = args.context_length or preset["context_length"]
    check_prompt(tokenizer.encode(args.prompt), T)
    model = GPT(build_config(name, T, preset["dropout"])).to(device)
    text = data_file("the-verdict.txt", args.data_dir).read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    split = int(0.9 * len(ids))
    B = args.batch_size or preset["batch_size"]
    train_loader = create_dataloader(ids[:split], B, T, seed=args.seed)
    val_loader = create_dataloader(ids[split:], B, T, shuffle=False, drop_last=False)
    tcfg = TrainConfig(epochs=args.epochs or preset["epochs"], lr=args.lr or preset["lr"])
    print(f"training GPT ({model.num_params() / 1e6:.1f}M parameters, {model.cfg}) on "
          f"The Verdict: {split:,} train / {len(ids) - split:,} val tokens, "
          f"{len(train_loader)} steps per epoch, {tcfg.epochs} epochs, on {device}")
    train(model, train_loader, val_loader, tcfg, device)
    if args.save:
        save_checkpoint(model, args.save)
        print(f"saved {args.save}")
    return model.eval()


def load_model(args, device):
    if args.load:
        model = load_checkpoint(args.load, device).eval()
    else:
        model = load_gpt2(args.gpt2 or args.gpt2_dir, device, args.data_dir)
    print(f"loaded {model.num_params() / 1e6:.0f}M parameters")
    return model


def sample(model, tokenizer, args, device):
    """Continue the prompt and print it, with how it was generated."""
    ids = tokenizer.encode(args.prompt)
    check_prompt(ids, model.cfg.context_length)
    out = generate(model, torch.tensor([ids], device=device), args.max_new_tokens,
                   args.temperature, args.top_k, args.top_p, eos_id=EOT_ID)
    how = "greedy"
    if args.temperature:
        how = ", ".join(f"{name} {value}" for name, value in (
            ("temperature", args.temperature), ("top-k", args.top_k), ("top-p", args.top_p))
            if value is not None)
    print(f"\ngenerated ({out.size(1) - len(ids)} new tokens, {how}):\n"
          f"{tokenizer.decode(out[0].tolist())}")


def compare_on_kernels(model, tokenizer, args, device):
    """NEW in stage 04: the GPT's logits for the prompt on torch, then on our CUDA kernels."""
    idx = torch.tensor([tokenizer.encode(args.prompt)], device=device)
    with torch.no_grad(), fp32_matmul_precision("highest"):
        ref = model(idx).float()
        use_cuda_kernels(model, tensor_cores=args.tensor_cores)
        ours = model(idx).float()
    err = ((ours - ref).norm() / ref.norm()).item()
    print(f"GPT logits on the CUDA kernels vs torch: relative error {err:.2e}")


def main():
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left over
    torch.manual_seed(args.seed)
    if args.bench and device.type != "cuda":  # GPU-only: say so in one line, as every stage does
        return print("--bench times the CUDA kernels: it needs an NVIDIA GPU (--device cuda)")
    if args.bench:
        return bench_kernels()
    # every download this run needs, before any work: a missing file stops it here, all named
    files = [data_entry("gpt2.tiktoken", args.data_dir)]
    if args.gpt2:
        files += gpt2_files(args.gpt2, args.data_dir)
    elif args.train:
        files.append(data_entry("the-verdict.txt", args.data_dir))
    fetch(files)
    if not kernel_chapter():
        sys.exit("a kernel failed its self-check")
    tokenizer = gpt2_tokenizer(args.data_dir)
    if args.load or args.gpt2 or args.gpt2_dir:
        model = load_model(args, device)
    elif args.train:
        model = train_model(args, device, tokenizer)
    else:  # NEW in stage 04: an untrained GPT-2 124M is enough to compare the two paths
        model = GPT(GPTConfig.gpt2("124M")).to(device).eval()
        print("untrained GPT-2 124M shape (pass --gpt2 124M for the real weights)")
    if args.kernels == "cuda":
        compare_on_kernels(model, tokenizer, args, device)
    sample(model, tokenizer, args, device)


if __name__ == "__main__":
    try:
        main()
    except DataError as e:  # a missing or broken file: the message says which and what to do
        sys.exit(f"error: {e}")
