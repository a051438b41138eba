"""Stage 05: Triton kernels that the GPT trains on (book chapter 14).

What this stage teaches
    14. Triton: programs and blocks instead of threads, masks, constexpr block sizes and
        autotuning, shown on a vector add; then, each with a Triton backward where training needs
        it: the fused row softmax, layer norm (its weight/bias gradients reduced in parallel) and
        RMSNorm, GELU and SwiGLU, a matmul with grouped program order, autotuned tiles and a fused
        bias + GELU epilogue, and a cross-entropy that never materializes the softmax. Where a
        kernel has a tuned variant, the plain kernel comes first and the variant follows in its
        own section: the norms streamed for rows wider than registers hold (14.3b), and on Hopper
        the matmul made persistent and fed by TMA (14.8).
    The GPT trains on them (`--train --kernels triton`): every norm, activation, matmul in the
    blocks and the loss. Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1,
    set below before triton is imported) at small sizes.

New since stage 04: the Triton kernels take the slots of stage 04's CUDA kernels (softmax,
layer_norm, gelu, matmul), with rms_norm, swiglu and cross_entropy added. Changed: `train` and
`evaluate` take the loss function as an argument; stage 03's training bench (the plain model
and the GPT, eager and compiled), which stage 04 dropped, returns with a row for the Triton
kernels. Dropped: stage 04's CUDA kernels, roofline helpers and csrc/ counterparts (the
kernel chapter lives on in 04_cuda_kernels.py). Since 04's chapter is dropped, read this stage's
lesson as `diff 03_train.py 05_triton.py`.

Run
    python 05_triton.py                         # kernels vs torch in float64, GPT on the kernels
    python 05_triton.py --train --kernels triton  # stage 03's training run on Triton kernels
    python 05_triton.py --bench                 # kernels vs torch eager and torch.compile,
                                                # then GPT-2 124M training tokens/s against
                                                # the plain model
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

import requests
import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch.autograd.function import once_differentiable
from torch.utils.data import DataLoader, Dataset

try:
    import fcntl  # file locks, so that two processes never download into one file
except ImportError:  # Windows
    fcntl = None

# Triton reads TRITON_INTERPRET once, when it is first imported: without CUDA the interpreter
# must be on before that import, so every kernel below still runs (on the CPU, slowly).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402  (after the interpreter switch)
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

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
def evaluate(model, loader, device, max_batches=None, loss=loss_fn):  # changed in 05: loss
    """Mean loss over (at most max_batches of) a loader, with dropout off."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for x, y in loader:
        if max_batches is not None and n >= max_batches:
            break
        with autocast(device):
            total += loss(model(x.to(device)), y.to(device)).item()
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


def train(model, train_loader, val_loader, tcfg, device, log=print, loss=loss_fn):  # changed in 05
    """Train for tcfg.epochs; log and record (step, train loss, val loss) every eval_every steps.
    Returns the history as a list of dicts."""
    opt = make_optimizer(model, tcfg.lr, tcfg.weight_decay, device)
    total_steps = tcfg.epochs * len(train_loader)
    peak = peak_flops(device)
    history, step, window_loss, window_steps = [], 0, 0.0, 0
    t_last, tokens_last = time.time(), 0
    val = evaluate(model, val_loader, device, tcfg.eval_batches, loss)
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
                step_loss = loss(model(x), y)  # changed in 05: the loss argument
            opt.zero_grad(set_to_none=True)
            step_loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            opt.step()
            step += 1
            tokens_last += x.numel()
            window_loss += step_loss.detach()  # stays on the device: no host sync per step
            window_steps += 1
            if step % tcfg.eval_every == 0 or step == total_steps:
                train_loss = (window_loss / window_steps).item()
                val = evaluate(model, val_loader, device, tcfg.eval_batches, loss)
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


# ----------------------------------------------------------------------------------------------
# Chapter 14. Triton
# ----------------------------------------------------------------------------------------------

# NEW in stage 05: Triton kernels. Legend for this section: a "row" kernel sees its input as
# (rows, N), N the last dimension; matmul shapes are A (M, K) @ B (K, N) = C (M, N); cross-entropy
# sees logits (rows, V), V the vocabulary.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRET = tl.constexpr(INTERPRET)  # kernels can read module globals only when they are constexpr
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the kernels take
# The kernels' input checks (_check_tensor) and the interpreter patch are plumbing, at the end.


# ------------------------------------------------------------------------------------------------
# 14.1 The programming model, on a vector add
# ------------------------------------------------------------------------------------------------
# A CUDA kernel is written for one thread; a Triton kernel is written for one *program*, which
# handles a whole block of elements: `tl.arange(0, BLOCK)` is a vector of offsets, `tl.load` and
# `tl.store` move a block between memory and registers, and arithmetic works on whole blocks. The
# grid counts programs, not threads. The compiler spreads a block over the `num_warps` warps of its
# program, widens loads to 16 bytes when it can prove alignment, and stages data through shared
# memory: the work stage 04 did by hand. CUDA's `if (i < n)` becomes a mask on the load and the
# store. Block sizes are `tl.constexpr`: each value compiles its own kernel, so every shape is known
# to the compiler; `triton.autotune` times a list of such configurations the first time it meets a
# new key (here the length n) and keeps the fastest. The vector add moves 12 bytes per fp32 element
# and does one add: it is bound by memory bandwidth, like every kernel here except the matmul.

def _autotune_list(configs):
    # Under the interpreter there is nothing to time: keep one configuration (the autotuner then
    # runs it without timing).
    return configs[:1] if INTERPRET else configs


@triton.autotune(configs=_autotune_list([triton.Config({"BLOCK": b}, num_warps=w)
                                         for b, w in ((1024, 4), (2048, 4), (4096, 8), (8192, 8))]),
                 key=["n"])
@triton.jit
def _add_kernel(X, Y, OUT, n, BLOCK: tl.constexpr):
    # X, Y, OUT: n elements each. Program p owns elements [p * BLOCK, (p + 1) * BLOCK).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n  # the last program's tail
    x = tl.load(X + offs, mask=mask).to(tl.float32)
    y = tl.load(Y + offs, mask=mask).to(tl.float32)
    # 16-bit inputs are added in fp32 and rounded once, as torch does (Triton 3.6's interpreter
    # would add bf16 values as raw bits)
    tl.store(OUT + offs, (x + y).to(OUT.dtype.element_ty), mask=mask)


def vector_add(x, y):
    """x + y for two tensors of the same shape and dtype."""
    _check_tensor("x", x)
    _check_tensor("y", y, device=x.device)
    if x.shape != y.shape or x.dtype != y.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and y {tuple(y.shape)} {y.dtype} differ")
    out = torch.empty_like(x)
    n = x.numel()
    _add_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, out, n)
    return out


# ------------------------------------------------------------------------------------------------
# 14.2 Row kernels: softmax
# ------------------------------------------------------------------------------------------------
# Softmax over the last dimension written as torch ops (max, subtract, exp, sum, divide) reads and
# writes the tensor about five times; the floor is one read and one write. A program that holds
# its rows in registers does exactly that: load, reduce, normalize, store. Up to _MAX_FUSED_N
# columns a row fits in registers (16,384 fp32 over 16 warps is 32 values a thread); narrow rows
# are packed several to a program, so that each program still moves a few thousand elements and
# launches stay few. Wider rows are streamed in chunks of _CHUNK: an online pass computes the
# row's logsumexp, a second pass writes exp(x - lse), 1.5x the bytes of the fused kernel.

_MAX_FUSED_N = 16384  # widest row kept whole in registers (forward)
_MAX_FUSED_NORM_N = 8192  # the norms stream wider 16-bit rows, and fp32 rows from 1,024 (_Norm)
_MAX_FUSED_BWD_N = 8192  # the norm backward also keeps w, dw and db per program: half the width
_FUSED_ELEMS = 4096  # elements a backward program takes when rows are narrower than this
_FUSED_ELEMS_FWD = 1024  # the same for the forward kernels: one warp of 32 values a thread
_CHUNK = 4096  # chunk of a streamed (wide) row


@triton.jit
def _row_logsumexp(x_ptr, N, BLOCK_N: tl.constexpr):
    """logsumexp of the N values at x_ptr, in one pass over chunks of BLOCK_N (online max)."""
    m = -float("inf")  # running max
    s = 0.0  # running sum of exp(x - m)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + cols, mask=cols < N, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        # rescale the old sum to the new max; while every value so far is -inf, use 0 as the max
        # so that exp(-inf - -inf) never makes a NaN
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), 0)
        m = m_new
    return m + tl.log(s)


@triton.jit
def _softmax_fwd_kernel(X, Y, n_rows, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # X, Y: (n_rows, N). Program p owns rows [p * ROWS, (p + 1) * ROWS), whole, in registers.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    # rows past the end re-read the last row and are never stored: no lane is all -inf padding
    offs = tl.minimum(rows, n_rows - 1).to(tl.int64)[:, None] * N + cols[None, :]  # (ROWS, BLOCK_N)
    x = tl.load(X + offs, mask=cols[None, :] < N, other=-float("inf")).to(tl.float32)
    # subtracting the row max keeps every exp() <= 1 (no overflow) and leaves the result unchanged
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    y = e * (1.0 / tl.sum(e, axis=1))[:, None]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=(rows[:, None] < n_rows) & (cols[None, :] < N))


@triton.jit
def _softmax_fwd_looped_kernel(X, Y, N, BLOCK_N: tl.constexpr):
    # X, Y: (rows, N), one program per row, the row streamed in chunks of BLOCK_N.
    row = tl.program_id(0).to(tl.int64)
    lse = _row_logsumexp(X + row * N, N, BLOCK_N)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(X + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(Y + row * N + cols, tl.exp(x - lse).to(Y.dtype.element_ty), mask=cols < N)


@triton.jit
def _softmax_bwd_kernel(Y, DY, DX, n_rows, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # dx = y * (dy - sum(y * dy)): the softmax Jacobian applied without ever forming it.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]  # (ROWS, BLOCK_N)
    y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(y * dy, axis=1)[:, None])
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_looped_kernel(Y, DY, DX, N, BLOCK_N: tl.constexpr):
    # The same for wide rows: pass 1 sums y * dy over the row, pass 2 writes dx.
    row = tl.program_id(0).to(tl.int64)
    dot = 0.0
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        y = tl.load(Y + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
        dot += tl.sum(y * dy, 0)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        y = tl.load(Y + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(DX + row * N + cols, (y * (dy - dot)).to(DX.dtype.element_ty), mask=cols < N)


def _launch_rows(fused_kernel, looped_kernel, args, n_rows, n_cols, **meta):
    """Launch a row kernel: whole rows in registers when they fit, else streamed in chunks."""
    block_n = triton.next_power_of_2(n_cols)
    if block_n <= _MAX_FUSED_N:
        # 32 values a thread; narrow rows share a warp (at 1,024 columns one warp a row beat four
        # rows on four warps by 1-2% of copy bandwidth on the H200)
        rows = min(max(1, _FUSED_ELEMS_FWD // block_n), triton.next_power_of_2(n_rows))
        warps = min(16, max(1, rows * block_n // 1024))
        fused_kernel[(triton.cdiv(n_rows, rows),)](*args, n_rows, n_cols, ROWS=rows, BLOCK_N=block_n,
                                                   num_warps=warps, **meta)
    else:
        looped_kernel[(n_rows,)](*args, n_cols, BLOCK_N=_CHUNK, num_warps=8, **meta)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # x (rows, N)
        y = torch.empty_like(x)
        _launch_rows(_softmax_fwd_kernel, _softmax_fwd_looped_kernel, (x, y), *x.shape)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        dx = torch.empty_like(y)
        _launch_rows(_softmax_bwd_kernel, _softmax_bwd_looped_kernel, (y, dy.contiguous(), dx), *y.shape)
        return dx


def softmax(x):
    """Softmax over the last dimension of x (..., N), computed in fp32, returned in x's dtype."""
    _check_tensor("x", x, rows=True)
    return _Softmax.apply(x.view(-1, x.shape[-1])).view(x.shape)


# ------------------------------------------------------------------------------------------------
# 14.3 Row kernels: LayerNorm and RMSNorm, forward and backward
# ------------------------------------------------------------------------------------------------
# LayerNorm y = (x - mean) * rstd * w + b; RMSNorm y = x * rstd * w with rstd from the mean square
# alone. One kernel serves both (RMS is a constexpr: the compiler drops the branch not taken). The
# forward reads x once and writes y, plus two floats a row (mean, rstd) that the backward reuses,
# only where a backward can follow: with no gradient to compute they are skipped (they cost 2% of
# the bandwidth at 1,024 columns on the H200).
# The kernels here hold whole rows in registers; _Norm hands wider rows (and, in the forward, fp32
# rows from 1,024 columns) to the streamed kernels of 14.3b.
# The backward has two parts of different shape. dx is per row:
#     xhat = (x - mean) * rstd,  g = w * dy,  dx = rstd * (g - xhat * mean(xhat * g) - mean(g))
# (RMSNorm drops the last term). dw = sum over rows of dy * xhat and db = sum of dy are reductions
# over *all* rows: one program per row adding into dw would serialize on atomics. Instead a fixed
# number of programs (a few per SM) each takes a run of rows, keeps its partial dw and db in
# registers, and writes one row of a (programs, N) buffer; a second small kernel sums that buffer
# over its rows. Both passes are parallel and the result is deterministic.


@triton.jit
def _norm_fwd_kernel(X, W, B, Y, MEAN, RSTD, eps, n_rows, N: tl.constexpr, RMS: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # X, Y (n_rows, N); W, B (N,) (B may be None); MEAN, RSTD (n_rows,) fp32, None when not wanted
    # (MEAN always None for RMS). N is a compile-time constant: where N == BLOCK_N the column mask folds away.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]  # (ROWS, BLOCK_N)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)  # centered; masked lanes stay 0
        if MEAN is not None:
            tl.store(MEAN + rows, mean, mask=rows < n_rows)
    # the variance of centered values: no cancellation, unlike E[x^2] - E[x]^2
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    if RSTD is not None:
        tl.store(RSTD + rows, rstd, mask=rows < n_rows)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if B is not None:
        y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(X, W, DY, DX, MEAN, RSTD, DW_PART, DB_PART, n_rows, N, rows_per_program,
                     RMS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program p takes rows [p * rows_per_program, (p + 1) * rows_per_program), ROWS at a time: writes
    # their dx, and row p of DW_PART and DB_PART (programs, N), its partial sums of dw and db
    # (DB_PART is None when there is no bias).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    db = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for i in range(0, rows_per_program, ROWS):
        rows = pid * rows_per_program + i + tl.arange(0, ROWS)
        in_rows = rows < n_rows  # the last program's run may pass the end
        mask = in_rows[:, None] & (cols[None, :] < N)
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]  # (ROWS, BLOCK_N)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=in_rows, other=0.0)[:, None]
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(MEAN + rows, mask=in_rows, other=0.0)[:, None]) * rstd, 0.0)
        g = w * dy
        dx = g - xhat * (tl.sum(xhat * g, axis=1) / N)[:, None]
        if not RMS:
            dx -= (tl.sum(g, axis=1) / N)[:, None]
        tl.store(DX + offs, (dx * rstd).to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(DW_PART + pid * N + cols, tl.sum(dw, axis=0), mask=cols < N)
    if DB_PART is not None:
        tl.store(DB_PART + pid * N + cols, tl.sum(db, axis=0), mask=cols < N)


@triton.jit
def _column_sum_kernel(X, OUT, n_rows, N, stride_x, rows_per_program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # X (n_rows, N), rows stride_x apart -> OUT (programs along axis 1, N): program (j, g) sums rows
    # [g * rows_per_program, (g + 1) * rows_per_program) of columns block j, in fp32.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.program_id(1) * rows_per_program
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, rows_per_program, BLOCK_M):
        rows = first + i + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < n_rows) & (rows[:, None] < first + rows_per_program) & (cols[None, :] < N)
        acc += tl.load(X + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + tl.program_id(1) * N + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=cols < N)


def _column_sum(x, dtype):
    """x (rows, N) summed over its rows -> (N,) in `dtype`: partial sums of row groups, then their sum."""
    if x.stride(1) != 1:
        x = x.contiguous()
    n_rows, n_cols = x.shape
    if n_rows > 256:
        block_n = min(triton.next_power_of_2(n_cols), 256)
        block_m = 4096 // block_n  # a 4,096-element tile per step
        grid_n = triton.cdiv(n_cols, block_n)
        # rows in groups that give the first pass about 4 programs an SM, each a whole number of
        # BLOCK_M-row steps (fixed 256-row groups gave GPT-2's LayerNorm partial sums, (528, 768)
        # fp32, 9 programs on the H200's 132 SMs)
        groups = max(1, 4 * _num_sms(x.device) // grid_n)
        rows_per_program = triton.cdiv(triton.cdiv(n_rows, groups), block_m) * block_m
        groups = triton.cdiv(n_rows, rows_per_program)
        if groups > 1:
            part = torch.empty((groups, n_cols), device=x.device, dtype=torch.float32)
            _column_sum_kernel[(grid_n, groups)](x, part, n_rows, n_cols, x.stride(0), rows_per_program,
                                                 BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8)
            x, n_rows = part, groups
    # The last pass (the only one for at most 256 rows, or what one group holds): a program a
    # column block, its tile as tall as the rows (up to 128) and as narrow as that allows, so
    # that it takes few steps and the programs are many. With 256-column tiles here, GPT-2's bias
    # gradients (171 partial rows of 768) took 3 programs of 11 steps and its LayerNorm's
    # partials (512 x 768 fp32) 3 of 32: 0.89x and 1.7x the time of torch's sum (H200); with
    # these tiles 0.62x and 0.60x (H100).
    block_m = min(triton.next_power_of_2(n_rows), 128)
    block_n = min(triton.next_power_of_2(n_cols), max(4096 // block_m, 32))
    out = torch.empty(n_cols, device=x.device, dtype=dtype)
    _column_sum_kernel[(triton.cdiv(n_cols, block_n), 1)](x, out, n_rows, n_cols, x.stride(0), n_rows,
                                                          BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8)
    return out


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms, stats, out_dtype):  # x (rows, N); stats: keep mean, rstd for backward
        n_rows, n_cols = x.shape
        y = torch.empty_like(x, dtype=out_dtype)
        mean = None if rms or not stats else torch.empty(n_rows, device=x.device, dtype=torch.float32)
        rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32) if stats else None
        args = (x, weight, bias, y, mean, rstd, eps)
        block_n = triton.next_power_of_2(n_cols)
        if n_cols > _MAX_FUSED_NORM_N or (x.element_size() == 4 and n_cols >= 1024):
            # streamed where that is faster on the H200: fp32 rows from 1,024 columns, 16-bit rows
            # above 8,192. Chunks of half the row (at most _CHUNK), one 16-byte load a thread a
            # chunk: 4 warps for 512 fp32 values, 32 for 4,096 (more warps, or more values a
            # thread, were slower)
            chunk = min(_CHUNK, block_n // 2)
            _norm_fwd_looped_kernel[(n_rows,)](*args, n_cols, RMS=rms, BLOCK_N=chunk,
                                               num_warps=chunk * x.element_size() // (16 * 32))
        else:
            # whole rows in registers, 16 values a thread: at 1,024 bf16 columns two warps a row
            # are 0.5% of copy bandwidth faster than _launch_rows's one
            rows = min(max(1, 1024 // block_n), triton.next_power_of_2(n_rows))
            _norm_fwd_kernel[(triton.cdiv(n_rows, rows),)](*args, n_rows, n_cols, RMS=rms, ROWS=rows, BLOCK_N=block_n,
                                                           num_warps=min(16, max(1, rows * block_n // 512)))
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.rms = rms
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        n_rows, n_cols = x.shape
        dx = torch.empty_like(x)
        block_n = triton.next_power_of_2(n_cols)
        looped = block_n > _MAX_FUSED_BWD_N
        rows = 1 if looped else min(max(1, _FUSED_ELEMS // block_n), triton.next_power_of_2(n_rows))
        warps = 8 if looped else min(16, max(4, rows * block_n // 512))
        # enough programs to fill the GPU a few times over, each owning a run of rows (a multiple of ROWS)
        programs = min(triton.cdiv(n_rows, rows), _num_sms(x.device) * max(1, 32 // warps))
        rows_per_program = triton.cdiv(triton.cdiv(n_rows, programs), rows) * rows
        programs = triton.cdiv(n_rows, rows_per_program)
        new_part = torch.zeros if looped else torch.empty  # the looped kernel adds into its row
        dw_part = new_part((programs, n_cols), device=x.device, dtype=torch.float32)
        db_part = None if bias is None else new_part((programs, n_cols), device=x.device, dtype=torch.float32)
        args = (x, weight, dy.contiguous(), dx, mean, rstd, dw_part, db_part, n_rows, n_cols, rows_per_program)
        if looped:
            _norm_bwd_looped_kernel[(programs,)](*args, RMS=ctx.rms, BLOCK_N=_CHUNK, num_warps=warps)
        else:
            _norm_bwd_kernel[(programs,)](*args, RMS=ctx.rms, ROWS=rows, BLOCK_N=block_n, num_warps=warps)
        dw = _column_sum(dw_part, weight.dtype)
        db = None if bias is None else _column_sum(db_part, bias.dtype)
        return dx, dw, db, None, None, None, None


def _needs_stats(*tensors):
    # a backward can follow only if autograd is recording and some input wants a gradient
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _check_norm(x, weight, bias):
    _check_tensor("x", x, rows=True)
    _check_tensor("weight", weight, device=x.device)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected ({x.shape[-1]},) for x {tuple(x.shape)}")
    if bias is not None:
        _check_tensor("bias", bias, device=x.device)
        if bias.shape != x.shape[-1:]:
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({x.shape[-1]},)")


def layer_norm(x, weight, bias, eps=1e-5, out_dtype=None):
    """LayerNorm of x (..., N) over its last dimension, weight and bias (N,) (bias may be None).
    Statistics in fp32; y in out_dtype (default: x's). weight and bias may be in another float
    dtype than x."""
    _check_norm(x, weight, bias)
    stats = _needs_stats(x, weight, bias)
    return _Norm.apply(x.view(-1, x.shape[-1]), weight, bias, eps, False, stats, out_dtype).view(x.shape)


def rms_norm(x, weight, eps=1e-6):
    """RMSNorm of x (..., N): x / sqrt(mean(x^2) + eps) * weight, weight (N,)."""
    _check_norm(x, weight, None)
    stats = _needs_stats(x, weight)
    return _Norm.apply(x.view(-1, x.shape[-1]), weight, None, eps, True, stats, None).view(x.shape)


# ------------------------------------------------------------------------------------------------
# 14.3b Rows wider than registers hold: streaming the norms
# ------------------------------------------------------------------------------------------------
# A wide row held whole in registers leaves one or two programs per SM, whose loads stop while
# they reduce and store (layer norm at 16,384 columns: 85% of copy bandwidth on the H200). What
# streaming adds: one program a row, two passes over chunks of it. Pass 1 keeps running statistics
# per lane (Welford's update) and merges the lanes once, after the loop; pass 2 re-reads the row,
# the second time from L2, and writes y. What it buys: the program keeps loading, and the same
# layer norm reaches 95% of copy bandwidth. The backward streams rows wider than
# _MAX_FUSED_BWD_N the same way (its statistics come from the forward), adding its partial dw and
# db into the program's own row of the buffers instead of keeping them in registers.


@triton.jit
def _welford_merge(mean_a, m2_a, n_a, mean_b, m2_b, n_b):
    # Combine two partial (mean, m2, count) into one (Chan et al.); an empty side changes nothing.
    n = n_a + n_b
    frac_b = tl.where(n > 0, n_b / tl.maximum(n, 1.0), 0.0)
    delta = mean_b - mean_a
    return mean_a + delta * frac_b, m2_a + m2_b + delta * delta * n_a * frac_b, n


@triton.jit
def _norm_fwd_chunk(x_ptr, w_ptr, b_ptr, y_ptr, cols, mean, rstd, N, MASKED: tl.constexpr):
    # y = (x - mean) * rstd * w (+ b) for one chunk of a streamed row
    mask = cols < N if MASKED else None
    other = 0.0 if MASKED else None
    x = tl.load(x_ptr + cols, mask=mask, other=other, eviction_policy="evict_first").to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=other, eviction_policy="evict_last").to(tl.float32)
    y = (x - mean) * rstd * w
    if b_ptr is not None:
        y += tl.load(b_ptr + cols, mask=mask, other=other, eviction_policy="evict_last").to(tl.float32)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_fwd_looped_kernel(X, W, B, Y, MEAN, RSTD, eps, N: tl.constexpr, RMS: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    # Wide rows, one program per row, two passes over chunks of BLOCK_N. Pass 1 keeps running
    # statistics *per lane* (Welford's update, one value at a time for each of the BLOCK_N lanes)
    # and merges the lanes once, after the loop: no reduction across lanes, and so no barrier,
    # inside the loop. N is a compile-time constant (one compile per row width): the loops over
    # whole chunks have a known trip count, need no mask, and are unrolled, so the loads of
    # several chunks are in flight at once; a ragged last chunk is handled after each loop.
    # Pass 2 re-reads the row, which pass 1 asked L2 to keep, and writes y.
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * N
    y_row = Y + row * N
    FULL: tl.constexpr = N // BLOCK_N * BLOCK_N  # columns in whole chunks
    cols = tl.arange(0, BLOCK_N)
    mean = tl.zeros((BLOCK_N,), dtype=tl.float32)
    m2 = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum of squared deviations (of squares for RMS)
    for start in tl.range(0, FULL, BLOCK_N, loop_unroll_factor=4):
        x = tl.load(x_row + start + cols, eviction_policy="evict_last").to(tl.float32)
        if RMS:
            m2 += x * x
        else:
            delta = x - mean
            mean += delta * (1.0 / (start // BLOCK_N + 1))  # the lane's k-th value: 1/k of the way
            m2 += delta * (x - mean)
    count = tl.full((BLOCK_N,), FULL // BLOCK_N, tl.float32)  # values each lane has seen
    if FULL < N:  # the ragged last chunk: lanes inside the row take one more value
        seen = FULL + cols < N
        x = tl.load(x_row + FULL + cols, mask=seen, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if RMS:
            m2 += x * x
        else:
            count += seen.to(tl.float32)
            delta = tl.where(seen, x - mean, 0.0)
            mean += delta / tl.maximum(count, 1.0)  # a lane may have seen nothing yet
            m2 += delta * (x - mean)
    if RMS:
        row_mean = 0.0
        row_m2 = tl.sum(m2, axis=0)
    else:
        row_mean, row_m2, _ = tl.reduce((mean, m2, count), 0, _welford_merge)
        if MEAN is not None:
            tl.store(MEAN + row, row_mean)
    rstd = 1.0 / tl.sqrt(row_m2 / N + eps)
    if RSTD is not None:
        tl.store(RSTD + row, rstd)
    for start in tl.range(0, FULL, BLOCK_N, loop_unroll_factor=4):
        _norm_fwd_chunk(x_row + start, W + start, B + start if B is not None else None, y_row + start,
                        cols, row_mean, rstd, N, False)
    if FULL < N:
        _norm_fwd_chunk(x_row + FULL, W + FULL, B + FULL if B is not None else None, y_row + FULL,
                        cols, row_mean, rstd, N - FULL, True)


@triton.jit
def _norm_bwd_looped_kernel(X, W, DY, DX, MEAN, RSTD, DW_PART, DB_PART, n_rows, N, rows_per_program,
                            RMS: tl.constexpr, BLOCK_N: tl.constexpr):
    # The same for wide rows, chunk by chunk: pass 1 the two row sums, pass 2 dx. The partial dw
    # and db no longer fit in registers, so they are added into this program's own (zeroed) row of
    # DW_PART and DB_PART: a read and a write, and still no other program touches that row.
    pid = tl.program_id(0)
    # up to the last row: a bound, not a mask (Triton 3.9's interpreter rejects scalar & block)
    for i in range(0, tl.minimum(rows_per_program, n_rows - pid * rows_per_program)):
        row = pid * rows_per_program + i
        rstd = tl.load(RSTD + row)
        mean = 0.0
        if not RMS:
            mean = tl.load(MEAN + row)
        sum_xg = 0.0
        sum_g = 0.0
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            offs = row.to(tl.int64) * N + cols
            xhat = tl.where(mask, (tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) - mean) * rstd, 0.0)
            g = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) * \
                tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            sum_xg += tl.sum(xhat * g, 0)
            sum_g += tl.sum(g, 0)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            offs = row.to(tl.int64) * N + cols
            xhat = tl.where(mask, (tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) - mean) * rstd, 0.0)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) * dy
            dx = g - xhat * (sum_xg / N)
            if not RMS:
                dx -= sum_g / N
            tl.store(DX + offs, (dx * rstd).to(DX.dtype.element_ty), mask=mask)
            part = pid * N + cols
            tl.store(DW_PART + part, tl.load(DW_PART + part, mask=mask) + dy * xhat, mask=mask)
            if DB_PART is not None:
                tl.store(DB_PART + part, tl.load(DB_PART + part, mask=mask) + dy, mask=mask)


# ------------------------------------------------------------------------------------------------
# 14.4 Elementwise: GELU and SwiGLU
# ------------------------------------------------------------------------------------------------
# GPT-2's GELU, 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), is x * sigmoid(2u),
# since 0.5 (1 + tanh(u)) = sigmoid(2u): one exp, no tanh (Triton 3.6's interpreter cannot run
# libdevice's tanh, and sigmoid is as accurate). Its derivative is s + x s (1 - s) 2u' with
# s = sigmoid(2u). SwiGLU, silu(gate) * up, is the MLP activation of Llama-style models. As torch
# ops these read and write several temporaries; one kernel reads the inputs once and writes once.
# The backward kernels recompute the activation from the saved inputs instead of storing it.

_GELU_C = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_GELU_A = tl.constexpr(0.044715)
_ELEMENTWISE_BLOCK = 4096


@triton.jit
def _sigmoid(z):
    # below z = -88, exp(-z) overflows fp32: harmless on the GPU (1 / inf = 0), but the interpreter
    # warns; sigmoid(-80) = 2e-35 is as good as 0 for every use here
    return tl.sigmoid(tl.maximum(z, -80.0))


@triton.jit
def _gelu(x):
    # tensor on the left: Triton 3.7-3.9's interpreter mishandles `constexpr * tensor`
    return x * _sigmoid((x + x * x * x * _GELU_A) * (2.0 * _GELU_C))


@triton.jit
def _gelu_grad(x):
    s = _sigmoid((x + x * x * x * _GELU_A) * (2.0 * _GELU_C))
    return s + 2.0 * x * s * (1.0 - s) * _GELU_C * (1.0 + x * x * (3.0 * _GELU_A))


@triton.jit
def _gelu_fwd_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n).to(tl.float32)
    tl.store(Y + offs, _gelu(x).to(Y.dtype.element_ty), mask=offs < n)


@triton.jit
def _gelu_bwd_kernel(X, DY, DX, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n).to(tl.float32)
    dy = tl.load(DY + offs, mask=offs < n).to(tl.float32)
    tl.store(DX + offs, (dy * _gelu_grad(x)).to(DX.dtype.element_ty), mask=offs < n)


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(G + offs, mask=offs < n).to(tl.float32)
    u = tl.load(U + offs, mask=offs < n).to(tl.float32)
    tl.store(Y + offs, (g * _sigmoid(g) * u).to(Y.dtype.element_ty), mask=offs < n)


@triton.jit
def _swiglu_bwd_kernel(G, U, DY, DG, DU, n, BLOCK: tl.constexpr):
    # d/dg silu(g) = s (1 + g (1 - s)) with s = sigmoid(g)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(G + offs, mask=offs < n).to(tl.float32)
    u = tl.load(U + offs, mask=offs < n).to(tl.float32)
    dy = tl.load(DY + offs, mask=offs < n).to(tl.float32)
    s = _sigmoid(g)
    tl.store(DU + offs, (dy * g * s).to(DU.dtype.element_ty), mask=offs < n)
    tl.store(DG + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=offs < n)


def _launch_elementwise(kernel, *tensors):
    n = tensors[0].numel()
    kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](*tensors, n, BLOCK=_ELEMENTWISE_BLOCK, num_warps=8)


def _gelu_backward(x, dy):
    x = x.contiguous()  # a matmul's GELU input may have padded rows (see _empty_aligned_rows)
    dx = torch.empty_like(x)
    _launch_elementwise(_gelu_bwd_kernel, x, dy.contiguous(), dx)
    return dx


class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.empty_like(x)
        _launch_elementwise(_gelu_fwd_kernel, x, y)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return _gelu_backward(x, dy)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        y = torch.empty_like(gate)
        _launch_elementwise(_swiglu_fwd_kernel, gate, up, y)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        _launch_elementwise(_swiglu_bwd_kernel, gate, up, dy.contiguous(), dgate, dup)
        return dgate, dup


def gelu(x):
    """GPT-2's GELU (tanh form), elementwise, any shape."""
    _check_tensor("x", x)
    return _GELU.apply(x)


def swiglu(gate, up):
    """silu(gate) * up, elementwise; gate and up of one shape and dtype."""
    _check_tensor("gate", gate)
    _check_tensor("up", up, device=gate.device)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
    return _SwiGLU.apply(gate, up)


# ------------------------------------------------------------------------------------------------
# 14.5 Matmul: grouped ordering, autotuning, a fused epilogue
# ------------------------------------------------------------------------------------------------
# C = A @ B does 2MNK FLOPs on (MK + KN + MN) elements: at 4096^3 in bf16 that is 1,365 FLOPs a
# byte, far past the H200's ridge (790 TFLOP/s over 4.3 TB/s, ~185), so the tensor cores set the
# pace. Each program computes a BLOCK_M x BLOCK_N tile of C, walking K in steps of BLOCK_K; `tl.dot`
# on 16-bit tiles becomes Hopper's wgmma, and `num_stages` lets the compiler prefetch the next
# tiles while the current ones multiply (stage 04 wrote that double buffering by hand). Program
# order matters for L2: a program needs a row-panel of A and a column-panel of B; numbering
# programs row by row streams all of B through L2 for every row of tiles, so programs are numbered
# in groups of GROUP_M tile-rows, column by column inside the group, and programs that run
# together share panels. The epilogue adds the bias and applies GELU to the fp32 accumulator
# before the store: the MLP's Linear + GELU then writes its activations once (twice when training
# keeps the pre-GELU values for the backward) instead of write, read, write.
#
# This pointer kernel runs on any GPU and takes any operands. On Hopper, where the operands allow
# it, _mm runs the persistent TMA kernel of 14.8 instead.

def _matmul_configs():
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps): 8 warps are two warpgroups, each issuing
    # wgmma on half of the tile; tiles of 128 x 256 keep the tensor cores fed at large sizes, the
    # smaller ones fill the 132 SMs when M or N is small. A configuration that does not compile for
    # some input (shared memory) is skipped by the autotuner.
    if INTERPRET:  # few, wide programs: the interpreter pays per program, not per element
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 4})]
    tiles = [(128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 8),
             (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for m, n, k, s, w in tiles]


def _bench_in_graph(kernel_call, quantiles):
    """The autotuner's timing of one candidate, replayed from a CUDA graph. Timed as launched, a
    small product measures its launch from Python (about 25 us of host time a launch, against 5-6
    us of GPU work at 1024^3 on the H200), and the autotuner there chose 128 x 64 tiles (0.82x
    cuBLAS in a graph) over 64 x 128 (0.91x).
    do_bench_cudagraph runs on a stream of its own, which does not wait for the caller's. The
    candidates write the call's output, freshly allocated on the caller's stream, maybe in memory
    that work still queued there reads (a tensor freed a moment ago): wait for that work first."""
    torch.cuda.current_stream().synchronize()
    return triton.testing.do_bench_cudagraph(kernel_call, quantiles=quantiles)


def _prune_matmul_configs(configs, named_args, **kwargs):
    # a tile more than twice the problem in both directions is mostly padding: skip compiling and
    # timing those (small problems then keep one config, the smallest)
    M, N = named_args["M"], named_args["N"]
    fitting = [c for c in configs if c.kwargs["BLOCK_M"] <= 2 * M and c.kwargs["BLOCK_N"] <= 2 * N]
    kept = fitting or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]
    # float32 inputs, there for checking rather than speed, take one tile untuned: full-precision
    # products compile to FMA loops, 3-8 s a tile for sm_90 against about 1 s in bf16, and a small
    # float32 GPT launches the kernel in 7 specializations (bias, GELU, strides). Tuning all 6
    # tiles, its training test had not finished after 250 s on a fresh H200 machine.
    return kept[-1:] if kwargs.get("DOT_PRECISION") == "ieee" else kept


@triton.jit
def _grouped_tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row, column) of tile number `tile` in the grouped order: GROUP_M tile-rows at a time,
    column by column inside the group."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n  # tiles in one group of GROUP_M tile-rows
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)  # the last group may be shorter
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _matmul_epilogue(acc, C, BIAS, PRE, offs_m, offs_n, M, N, stride_cm, stride_cn, APPLY_GELU: tl.constexpr):
    """Store the fp32 tile acc (BLOCK_M, BLOCK_N) at rows offs_m, columns offs_n of C, after the
    bias; PRE, when not None, gets the value before the GELU."""
    if BIAS is not None:
        acc += tl.load(BIAS + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_offs = offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if PRE is not None:
        tl.store(PRE + c_offs, acc.to(PRE.dtype.element_ty), mask=c_mask)
    if APPLY_GELU:
        acc = _gelu(acc)
    tl.store(C + c_offs, acc.to(C.dtype.element_ty), mask=c_mask)


@triton.autotune(configs=_matmul_configs(), key=["M", "N", "K"],
                 prune_configs_by={"early_config_prune": _prune_matmul_configs},
                 do_bench=_bench_in_graph)
@triton.heuristics({"EVEN_K": lambda meta: meta["K"] % meta["BLOCK_K"] == 0})
@triton.jit
def _matmul_kernel(A, B, C, BIAS, PRE, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                   stride_cm, stride_cn, APPLY_GELU: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    # C (M, N) = A (M, K) @ B (K, N) [+ BIAS (N,)] [then GELU], accumulated in fp32. PRE, when not
    # None, receives the value before the GELU (its backward needs it) and has C's strides. Every
    # operand takes any strides, so transposed views (the weight's .t()) need no copy.
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows and columns past the edge wrap around onto valid ones, whose results are never stored:
    # the inner loop then needs no mask except on the K tail
    a_ptrs = A + (offs_m % M).to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + offs_k[:, None] * stride_bk + (offs_n % N).to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
        if _INTERPRET:
            # Triton 3.6's interpreter multiplies bf16 tiles by their raw bits; fp32 tiles give
            # the product the tensor cores compute (exact products, fp32 sums)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    _matmul_epilogue(acc, C, BIAS, PRE, offs_m, offs_n, M, N, stride_cm, stride_cn, APPLY_GELU)


def _mm(a, b, out, bias=None, pre=None, apply_gelu=False):
    """out (M, N) = a (M, K) @ b (K, N) [+ bias] [GELU], any strides; pre (like out) gets the value before GELU."""
    (M, K), N = a.shape, b.shape[1]
    # fp32 inputs: full-precision products, as torch's default for fp32 matmul (not TF32)
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    tiles = lambda meta: triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])  # noqa: E731
    a_tma, b_tma, c_tma = _tma_layout(a), _tma_layout(b), _tma_layout(out)
    programs = _INTERPRET_PROGRAMS if INTERPRET else _num_sms(a.device)
    split_tail = _few_tiles_long_k(M, N, K, programs)
    if a_tma is not None and b_tma is not None and _use_tma(a):
        # C_TMA: out's rows are contiguous (not a transposed view), so tiles leave by TMA stores
        layout = dict(A_T=a_tma, B_T=b_tma, C_TMA=c_tma is False, APPLY_GELU=apply_gelu)
        if split_tail:
            _mm_split_tail(a, b, out, bias, pre, programs, layout)
        else:
            a_desc, b_desc, c_desc, pre_desc = _tma_descs(a, b, out, pre, layout)
            _matmul_tma_kernel[lambda meta: (min(programs, tiles(meta)),)](  # (FIRST_TILE, TILES 0: all)
                a_desc, b_desc, out, c_desc, bias, pre, pre_desc, M, N, K, *out.stride(), 0, 0, **layout,
                SPLIT_K=1)
    else:
        _matmul_kernel[lambda meta: (tiles(meta),)](a, b, out, bias, pre, M, N, K, *a.stride(), *b.stride(),
                                                    *out.stride(), APPLY_GELU=apply_gelu, DOT_PRECISION=precision)
    return out


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, activation, pad_rows):  # a (M, K), b (K, N), bias (N,) or None
        M, N = a.shape[0], b.shape[1]
        out = _empty_aligned_rows(M, N, a) if pad_rows else a.new_empty(M, N)
        gelu_epilogue = activation == "gelu"
        # the GELU backward needs its input: keep it (written by the same epilogue, so in out's
        # layout) only if training
        pre = None
        if gelu_epilogue and any(ctx.needs_input_grad[:3]):
            pre = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device)
        _mm(a, b, out, bias, pre, gelu_epilogue)
        ctx.save_for_backward(a, b, pre)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        a, b, pre = ctx.saved_tensors
        dh = dout if pre is None else _gelu_backward(pre, dout)  # (M, N), gradient before the GELU
        da = db = dbias = None
        if ctx.needs_input_grad[0]:
            da = _mm(dh, b.t(), torch.empty(a.shape, device=a.device, dtype=a.dtype))  # (M, K)
        if ctx.needs_input_grad[1]:
            # written in b's own layout (a weight's .t() stays a .t()), so no transposing copy follows
            db = _mm(a.t(), dh, torch.empty_like(b))  # (K, N)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = _column_sum(dh, dh.dtype)
        return da, db, dbias, None, None


def matmul(a, b, bias=None, activation=None, pad_rows=False):
    """a (..., K) @ b (K, N) [+ bias (N,)], then activation None or "gelu": (..., N) in a's dtype,
    contiguous. fp32 accumulation; any strides (b may be a weight's .t()). Under torch.autocast the
    inputs are cast to the autocast dtype first, as autocast does for F.linear. pad_rows: where N
    values are not a whole number of 16-byte units, return instead a (..., N) view of rows padded
    to them (see _empty_aligned_rows), which keeps the backward on the TMA kernel."""
    if activation not in (None, "gelu"):
        raise ValueError(f"activation must be None or 'gelu', not {activation!r}")
    _check_tensor("a", a, contiguous=False, rows=True)
    _check_tensor("b", b, device=a.device, contiguous=False)
    if bias is not None:
        _check_tensor("bias", bias, device=a.device)
    if torch.is_autocast_enabled(a.device.type):
        dtype = torch.get_autocast_dtype(a.device.type)
        a, b = a.to(dtype), b.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if b.dim() != 2 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"cannot multiply a {tuple(a.shape)} by b {tuple(b.shape)}: need a (..., K) and b (K, N)")
    if bias is not None and bias.shape != (b.shape[1],):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({b.shape[1]},)")
    if b.dtype != a.dtype or (bias is not None and bias.dtype != a.dtype):
        raise TypeError(f"a, b and bias must share a dtype; got {a.dtype}, {b.dtype}"
                        + ("" if bias is None else f", {bias.dtype}"))
    out = _Matmul.apply(a.reshape(-1, a.shape[-1]), b, bias, activation, pad_rows)
    return out.view(*a.shape[:-1], b.shape[1])


# ------------------------------------------------------------------------------------------------
# 14.6 Cross-entropy over a 50,257-token vocabulary without the softmax in memory
# ------------------------------------------------------------------------------------------------
# torch's loss on logits (rows, V) writes log_softmax (rows, V), and its backward writes two more
# tensors of that size: at 8,192 tokens and V = 50,257 each is 0.8 GB in bf16. The loss needs only
# each row's logsumexp: loss = lse - x[target]. The forward streams each row once, chunk by chunk
# (the online max of 14.2), and keeps lse (one float a row). The gradient is
# (softmax(x) - onehot(target)) / n_valid: the backward streams each row again and writes it.
# With inplace_backward=True it writes into the logits' own buffer, which the loss no longer needs:
# the loss then costs no memory of size (rows, V) beyond the logits. That is safe when nothing else
# needs the logits after the loss, as in training, where lm_head's matmul keeps its inputs, not its
# output; after backward the logits tensor holds the gradient.


@triton.jit
def _cross_entropy_fwd_kernel(LOGITS, TARGETS, LOSS, LSE, V, stride, ignore_index, BLOCK_V: tl.constexpr):
    # LOGITS (rows, V), rows `stride` apart, TARGETS (rows,); LOSS, LSE (rows,) fp32. One program per row.
    row = tl.program_id(0).to(tl.int64)
    lse = _row_logsumexp(LOGITS + row * stride, V, BLOCK_V)
    target = tl.load(TARGETS + row)
    valid = target != ignore_index
    x_target = tl.load(LOGITS + row * stride + target, mask=valid, other=0.0).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - x_target, 0.0))
    tl.store(LSE + row, lse)


@triton.jit
def _cross_entropy_bwd_kernel(LOGITS, DLOGITS, TARGETS, LSE, SCALE, V, stride, ignore_index, BLOCK_V: tl.constexpr):
    # DLOGITS (rows, V), laid out as LOGITS or LOGITS itself: each element is read before this program writes it.
    # SCALE: one fp32, d(loss) / n_valid, read on the device so that the host never waits.
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGETS + row)
    scale = tl.where(target != ignore_index, tl.load(SCALE), 0.0)
    lse = tl.load(LSE + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(LOGITS + row * stride + cols, mask=cols < V, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(DLOGITS + row * stride + cols, grad.to(DLOGITS.dtype.element_ty), mask=cols < V)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index, inplace_backward):  # logits (rows, V), targets (rows,)
        n_rows, vocab = logits.shape  # rows logits.stride(0) apart, each contiguous
        losses = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
        lse = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
        _cross_entropy_fwd_kernel[(n_rows,)](logits, targets, losses, lse, vocab, logits.stride(0), ignore_index,
                                             BLOCK_V=_CHUNK, num_warps=8)
        n_valid = (targets != ignore_index).sum()
        ctx.save_for_backward(logits, targets, lse, n_valid)
        ctx.ignore_index, ctx.inplace_backward = ignore_index, inplace_backward
        return losses.sum() / n_valid

    @staticmethod
    @once_differentiable
    def backward(ctx, dloss):
        logits, targets, lse, n_valid = ctx.saved_tensors
        dlogits = logits if ctx.inplace_backward else torch.empty_strided(
            logits.shape, logits.stride(), device=logits.device, dtype=logits.dtype)
        scale = (dloss / n_valid).float()
        _cross_entropy_bwd_kernel[(logits.shape[0],)](logits, dlogits, targets, lse, scale, logits.shape[1],
                                                      logits.stride(0), ctx.ignore_index, BLOCK_V=_CHUNK,
                                                      num_warps=8)
        return dlogits, None, None, None


def cross_entropy(logits, targets, ignore_index=-100, inplace_backward=False):
    """Mean cross-entropy of logits (..., V) against integer targets (...), skipping targets equal
    to ignore_index; an fp32 scalar. inplace_backward=True writes the gradient over the logits
    (see above). Rows may be padded (a matmul's logits are, see _empty_aligned_rows), each row
    contiguous. Checking the targets' range reads one bool back from the GPU."""
    _check_tensor("logits", logits, contiguous=False, rows=True)
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be an int64 or int32 tensor, not {getattr(targets, 'dtype', type(targets))}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets have shape {tuple(targets.shape)}; expected {tuple(logits.shape[:-1])} "
                         f"for logits {tuple(logits.shape)}")
    # targets are small: a strided view (say y = x[:, 1:]) is copied rather than refused
    _check_tensor("targets", targets, dtypes=(torch.int64, torch.int32), device=logits.device,
           contiguous=False)
    vocab = logits.shape[-1]
    if (((targets < 0) | (targets >= vocab)) & (targets != ignore_index)).any():
        raise ValueError(f"targets must lie in [0, {vocab}) or equal ignore_index ({ignore_index})")
    rows = logits.reshape(-1, vocab)  # a view where the layout allows, else a copy
    if rows.stride(1) != 1 or rows.stride(0) < vocab:  # rows must be contiguous and must not overlap
        rows = rows.contiguous()
    return _CrossEntropy.apply(rows, targets.reshape(-1), ignore_index, inplace_backward)


# ------------------------------------------------------------------------------------------------
# 14.7 The GPT on Triton kernels
# ------------------------------------------------------------------------------------------------
# Each twin below is a subclass with no state of its own, so use_triton_kernels switches a module's
# class in place: parameters, buffers, weight tying and checkpoints are untouched, and the model
# code of stage 03 runs unchanged. The attention scores still come from torch's batched matmuls
# (stage 06 replaces the whole attention with one kernel); their softmax runs here.

class TritonLayerNorm(LayerNorm):
    def forward(self, x):
        # Under autocast only a matmul reads y, and it would cast y to bf16 first: write y in
        # bf16 at once, which saves that cast kernel and half of y's bytes
        dtype = torch.get_autocast_dtype("cuda") if x.is_cuda and torch.is_autocast_enabled("cuda") else None
        return layer_norm(x, self.weight, self.bias, self.eps, out_dtype=dtype)


class TritonGELU(GELU):
    def forward(self, x):
        return gelu(x)


class TritonLinear(nn.Linear):
    def forward(self, x):
        # padded rows: lm_head's 50,257 logits a row then keep its backward on the TMA kernel
        return matmul(x, self.weight.t(), self.bias, pad_rows=True)


class TritonMLP(MLP):
    def forward(self, x):  # x (B, T, C)
        h = matmul(x, self.c_fc.weight.t(), self.c_fc.bias, activation="gelu")  # (B, T, 4C), GELU fused
        return self.dropout(self.c_proj(h))


class TritonAttention(MultiHeadAttention):
    def attend(self, q, k, v):  # q, k, v (B, H, T, D)
        T, D = q.shape[-2:]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D)  # (B, H, T, T)
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        att = self.attn_dropout(softmax(att))
        return att @ v  # (B, H, T, D)


def use_triton_kernels(model):
    """Switch every LayerNorm, GELU, Linear, MLP and attention in `model` to its Triton twin, in place."""
    twins = {LayerNorm: TritonLayerNorm, GELU: TritonGELU, nn.Linear: TritonLinear, MLP: TritonMLP,
             MultiHeadAttention: TritonAttention}
    for module in model.modules():
        twin = twins.get(type(module))
        if twin is not None:
            module.__class__ = twin
    return model


def triton_loss_fn(logits, targets):
    """loss_fn on the Triton cross-entropy. Its backward overwrites the logits with their gradient
    (the training loop does not read them after the loss)."""
    return cross_entropy(logits, targets, inplace_backward=True)


# ------------------------------------------------------------------------------------------------
# 14.8 Going faster on Hopper: a persistent matmul fed by TMA
# ------------------------------------------------------------------------------------------------
# The matmul of 14.5 computes the address of every load in its threads and launches one program
# per tile. On Hopper (sm_90) a second kernel does better where the operands allow it. What it
# adds: its tiles arrive by TMA (the copy engine reads a whole tile into shared memory from a
# descriptor: base, shape, strides; no address arithmetic in the threads, and the edges come back
# zero-filled, so no masks), and it is persistent: one program per SM walks the tiles, so the
# epilogue of one tile overlaps the loads of the next and there is no tail wave. What it buys:
# with 128 x 256 tiles, 0.95x cuBLAS at 4096^3 on the H200 (_prune_tma_configs). TMA needs one
# unit stride and the other a multiple of 16 bytes: row-major operands or transposed ones (a
# weight's .t(), an activation's .t() in the backward), 16-bit types. _mm checks that
# (_tma_layout); the pointer kernel covers the rest (fp32, odd K or N, other strides, pre-Hopper
# GPUs). Rows whose N values are not whole 16-byte units are padded (_empty_aligned_rows) so that
# their products stay on this kernel.
#
# Split-K on the tail. A product with a small output and a long K, such as a weight's gradient in
# training (3,072 x 768 summed over 16,384 tokens), has too few tiles for the SMs: its 144 tiles of
# 128 x 128 are a wave of 132 and a wave of 12 (0.66x cuBLAS). Cutting every tile's K in 3 (72 tiles
# of 256 x 128: 216 items, 1.6 waves run as 2) gave 0.82x. Here the tiles that fill whole waves run
# whole, and the rest are cut along K into as many parts as fill one more wave (the 12 in 11 parts);
# each part writes its fp32 partial tile to a workspace, and a second kernel sums each tile's parts
# in a fixed order and applies the epilogue (_mm_split_tail). That gradient: 0.89x cuBLAS with an
# fp32 output, 0.96x bf16; 768 x 768 (36 tiles, all cut in 3): 1.05x, against 0.77x cut in 4.
# (Stream-K, which shares the (tile, k-step) iterations evenly so that a program may start and end
# inside a tile, needs a flat loop that Triton 3.6 pipelined at 0.6-0.68x the persistent kernel's
# speed on the same tiles.)

def _tma_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}, pre_hook=_tma_tiles)]
    # persistent programs hold one tile's accumulator and the load ring: 3 stages of 128 x 256
    # tiles (4 fit beside the half-tile epilogue buffer, but are no faster). Products too small to
    # fill the SMs take 64 x 128 tiles, a 128-deep step of K each: at 1024^3 (128 tiles) 0.94x
    # cuBLAS, against 0.87x with 64-deep steps and 0.90x for the pointer kernel's best tile
    tiles = [(128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 5, 4),
             (64, 128, 64, 4, 4), (64, 128, 128, 3, 4)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w,
                          pre_hook=_tma_tiles) for m, n, k, s, w in tiles]


def _tma_descs(a, b, out, pre, layout):
    """The TMA kernel's descriptors, built on the host once a call (built in the kernel, each
    program writes its own to global memory and fences before its first load): a and b over
    their storage (a transposed view's over the (K, M) or (N, K) matrix it views), out's and
    pre's where tiles leave by TMA stores, else None. Their tiles are set by _tma_tiles."""
    def desc(x, transposed=False):
        x = x.t() if transposed else x
        return TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [1, 1])
    c_tma = layout["C_TMA"]
    return (desc(a, layout["A_T"]), desc(b, layout["B_T"]), desc(out) if c_tma else None,
            desc(pre) if c_tma and pre is not None else None)


def _tma_tiles(args):
    """The TMA configurations' pre_hook, run before each launch: a descriptor carries the shape
    of its tile, and the kernel is compiled for it. a's and b's are a K step of the tile's rows
    and columns, as stored; C's and PRE's half a tile (_store_halves)."""
    bm, bn, bk = args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"]
    args["a_desc"].block_shape[:] = [bk, bm] if args["A_T"] else [bm, bk]
    args["b_desc"].block_shape[:] = [bn, bk] if args["B_T"] else [bk, bn]
    for name in ("c_desc", "pre_desc"):
        if args[name] is not None:
            args[name].block_shape[:] = [bm, bn // 2]


def _prune_tma_configs(configs, named_args, **kwargs):
    # The autotuner picks once per process, from one timing of each candidate, and at large sizes
    # that timing is noisy enough to pick a smaller tile. Pinned one at a time on the H200 at
    # 4096^3, the 128 x 256 tiles run at 0.95x cuBLAS and the smaller ones at 0.6-0.88x, so when
    # every side is at least 4,096 only the 128 x 256 tiles are timed.
    configs = _prune_matmul_configs(configs, named_args)
    if min(named_args["M"], named_args["N"], named_args["K"]) >= 4096:
        configs = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] == 128 * 256] or configs
    return configs


@triton.jit
def _store_halves(desc, pid_m, pid_n, acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """TMA-store the fp32 tile acc in desc's dtype, in two (BLOCK_M, BLOCK_N / 2) halves: the
    staging buffer in shared memory is half a tile, and the first half is on its way while the
    second is converted. Against one whole-tile store, with GROUP_M 8: as fast at 4096^3, 5%
    faster at 8192^3."""
    left, right = acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
    desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], left.to(desc.dtype))
    desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], right.to(desc.dtype))


@triton.autotune(configs=_tma_configs(), key=["M", "N", "K", "A_T", "B_T", "C_TMA", "SPLIT_K"],
                 prune_configs_by={"early_config_prune": _prune_tma_configs},
                 do_bench=_bench_in_graph)
@triton.jit
def _matmul_tma_kernel(a_desc, b_desc, C, c_desc, BIAS, PRE, pre_desc, M, N, K, stride_cm, stride_cn, FIRST_TILE,
                       TILES, A_T: tl.constexpr, B_T: tl.constexpr, C_TMA: tl.constexpr, APPLY_GELU: tl.constexpr,
                       SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # The same product, persistent, with TMA loads (descriptors from _tma_descs). A is stored
    # (M, K) row-major, or when A_T its transpose is: (K, M). B likewise: (K, N), or (N, K) when
    # B_T (an nn.Linear weight). C_TMA: C (and PRE) are row-major, so tiles leave by TMA stores
    # through c_desc (and pre_desc), which drop the rows and columns past the edge themselves.
    # The rest is as for _matmul_kernel.
    # The programs take the TILES tiles from FIRST_TILE on (TILES 0: all of them). SPLIT_K > 1:
    # work item i is tile FIRST_TILE + i % TILES over part i // TILES of K, and C is the fp32
    # workspace (SPLIT_K, TILES, BLOCK_M, BLOCK_N) of the partial tiles (no bias, GELU or PRE here).
    num_tiles = tl.where(TILES > 0, TILES, tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N))
    k_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)  # steps of BLOCK_K in one part of K
    # flatten: one software pipeline over the (tile, k) pairs, so the next tile's first loads are
    # in flight while this tile finishes
    for item in tl.range(tl.program_id(0), num_tiles * SPLIT_K, tl.num_programs(0), flatten=True):
        tile = FIRST_TILE + (item % num_tiles if SPLIT_K > 1 else item)
        part = item // num_tiles
        pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # the loop counts from 0 and offsets by k_first: with a runtime lower bound the flattened
        # pipeline compiled to other code (1,106 PTX lines against 1,450 before split-K)
        k_first = part * k_steps if SPLIT_K > 1 else 0
        for kk in range(0, k_steps):  # past K the loads are zeros: no tail mask
            k = k_first + kk
            if A_T:
                a = a_desc.load([k * BLOCK_K, pid_m * BLOCK_M]).T
            else:
                a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            if B_T:
                b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T
            else:
                b = b_desc.load([k * BLOCK_K, pid_n * BLOCK_N])
            if _INTERPRET:  # as in _matmul_kernel
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if SPLIT_K > 1:
            slot = C + (part * num_tiles + tile - FIRST_TILE).to(tl.int64) * BLOCK_M * BLOCK_N
            tl.store(slot + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], acc)
        elif C_TMA:
            if BIAS is not None:
                acc += tl.load(BIAS + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            if PRE is not None:
                _store_halves(pre_desc, pid_m, pid_n, acc, BLOCK_M, BLOCK_N)
            if APPLY_GELU:
                acc = _gelu(acc)
            _store_halves(c_desc, pid_m, pid_n, acc, BLOCK_M, BLOCK_N)
        else:
            _matmul_epilogue(acc, C, BIAS, PRE, offs_m, offs_n, M, N, stride_cm, stride_cn, APPLY_GELU)


@triton.jit
def _split_k_sum_kernel(WS, C, BIAS, PRE, M, N, stride_cm, stride_cn, FIRST_TILE, TILES, SPLIT_K: tl.constexpr,
                        APPLY_GELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        GROUP_M: tl.constexpr, SUB_M: tl.constexpr, SUB_N: tl.constexpr):
    """Tile FIRST_TILE + program_id(0) of C = the sum of its SPLIT_K partial tiles in WS (see
    _matmul_tma_kernel), through the epilogue, in the fixed order 0, 1, ...: the same result on
    every run. One program a (SUB_M, SUB_N) block, so that a few tiles are summed by many programs."""
    t = tl.program_id(0)
    rows = tl.program_id(1) // (BLOCK_N // SUB_N) * SUB_M + tl.arange(0, SUB_M)
    cols = tl.program_id(1) % (BLOCK_N // SUB_N) * SUB_N + tl.arange(0, SUB_N)
    offs = rows[:, None] * BLOCK_N + cols[None, :]
    acc = tl.zeros((SUB_M, SUB_N), dtype=tl.float32)
    for part in tl.static_range(SPLIT_K):
        acc += tl.load(WS + (part * TILES + t).to(tl.int64) * BLOCK_M * BLOCK_N + offs)
    pid_m, pid_n = _grouped_tile(FIRST_TILE + t, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    _matmul_epilogue(acc, C, BIAS, PRE, pid_m * BLOCK_M + rows, pid_n * BLOCK_N + cols, M, N, stride_cm,
                     stride_cn, APPLY_GELU)


def _few_tiles_long_k(M, N, K, programs):
    """Whether the product takes the split tail (_mm_split_tail): fewer 128 x 256 tiles of the
    output than SMs, and a K long enough (4,096) that its parts are worth their partial tiles."""
    return triton.cdiv(M, 128) * triton.cdiv(N, 256) < programs and K >= 4096


def _split_tail_plan(M, N, K, programs, block_m, block_n, block_k):
    """(tiles run whole, tiles left, parts of K to cut those into): the tiles that fill whole waves
    of `programs` run whole; the rest are cut into as many parts as fill one more wave, each at
    least 8 steps of K long. Where that is one part, all run whole."""
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    whole = tiles // programs * programs
    left = tiles - whole
    split = min(programs // left, triton.cdiv(K, block_k) // 8) if left else 1
    return (whole, left, split) if split > 1 else (tiles, 0, 1)


def _mm_split_tail(a, b, out, bias, pre, programs, layout):
    (M, K), N = a.shape, b.shape[1]
    tile = _SPLIT_TILE_INTERPRET if INTERPRET else _SPLIT_TILE  # one tile size for both launches
    bm, bn = tile["BLOCK_M"], tile["BLOCK_N"]
    whole, left, split = _split_tail_plan(M, N, K, programs, bm, bn, tile["BLOCK_K"])
    kernel = _matmul_tma_kernel.fn  # the kernel under the autotuner, launched with `tile`
    descs = dict(zip(("a_desc", "b_desc", "c_desc", "pre_desc"), _tma_descs(a, b, out, pre, layout)))
    _tma_tiles({**descs, **layout, **tile})  # the autotuner's pre_hook, which this launch bypasses
    if whole:
        kernel[(programs,)](descs["a_desc"], descs["b_desc"], out, descs["c_desc"], bias, pre, descs["pre_desc"],
                            M, N, K, *out.stride(), 0, whole, **layout, SPLIT_K=1, **tile)
    if left:
        parts = torch.empty(split, left, bm, bn, device=a.device, dtype=torch.float32)
        kernel[(min(programs, left * split),)](descs["a_desc"], descs["b_desc"], parts, None, None, None, None,
                                               M, N, K, *out.stride(), whole, left, **layout, SPLIT_K=split,
                                               **tile)
        sub_m, sub_n = min(bm, 32), min(bn, 64)
        _split_k_sum_kernel[(left, (bm // sub_m) * (bn // sub_n))](
            parts, out, bias, pre, M, N, *out.stride(), whole, left, SPLIT_K=split,
            APPLY_GELU=layout["APPLY_GELU"], BLOCK_M=bm, BLOCK_N=bn, GROUP_M=tile["GROUP_M"], SUB_M=sub_m,
            SUB_N=sub_n)


# the autotuner's choice for GPT-2's 768 x 768 and 768 x 2,304 weight gradients at 16,384 tokens;
# pinned, 1.00x cuBLAS on 1,536 x 1,408 x 16,384 (132 whole tiles) on the H200
_SPLIT_TILE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_stages": 5, "num_warps": 4}
_SPLIT_TILE_INTERPRET = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}
_INTERPRET_PROGRAMS = 2  # persistent programs under the interpreter (tests set others)


def _tma_layout(x):
    """Whether TMA reads the 2-D operand x transposed: False if its rows are contiguous, True if
    its columns are (x is a transposed view), None if TMA cannot read it."""
    if x.dtype not in (torch.float16, torch.bfloat16) or x.data_ptr() % 16:
        return None
    for transposed, unit, other in ((False, 1, 0), (True, 0, 1)):
        if x.stride(unit) == 1 and (x.stride(other) * x.element_size()) % 16 == 0 and x.stride(other) > 0:
            return transposed
    return None


def _use_tma(a):
    return INTERPRET or torch.cuda.get_device_capability(a.device)[0] >= 9


def _empty_aligned_rows(m, n, like):
    """An empty (m, n) tensor like `like` whose row stride is a whole number of 16-byte units, as
    TMA requires. GPT-2's 50,257 logits a row are not (100,514 bytes in bf16), so they get a row
    stride of 50,264 (7 unused values a row): a strided view, not a contiguous tensor. The in-place
    cross-entropy writes the logits' gradient in the same layout, so both backward products with
    that gradient keep the TMA kernel (with unpadded rows they fall to the pointer kernel, at a
    quarter of its speed on the H200)."""
    per_16_bytes = 16 // like.element_size()
    stride = triton.cdiv(n, per_16_bytes) * per_16_bytes
    return torch.empty((m, stride), device=like.device, dtype=like.dtype)[:, :n]


# ------------------------------------------------------------------------------------------------
# 14.9 Checks and benchmarks
# ------------------------------------------------------------------------------------------------

def demo_triton(device):
    """Each kernel once at small awkward sizes, forward and backward, against torch in float64."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=torch.float32)

    def rel_err(ours, ref):
        return ((ours.double() - ref).norm() / ref.norm()).item()

    x, w, b = randn(5, 67), randn(67), randn(67)
    a, m, bias = randn(33, 65), randn(65, 47), randn(47)
    logits, targets = randn(7, 1031), torch.randint(1031, (7,), generator=gen).to(device)
    targets[3] = -100
    cases = [
        ("vector_add", lambda t: vector_add(t[0], t[1]), lambda t: t[0] + t[1], (x, x.flip(0))),
        ("softmax", lambda t: softmax(t[0]), lambda t: torch.softmax(t[0], -1), (x,)),
        ("layer_norm", lambda t: layer_norm(*t), lambda t: F.layer_norm(t[0], t[0].shape[-1:], t[1], t[2]), (x, w, b)),
        ("rms_norm", lambda t: rms_norm(*t), lambda t: F.rms_norm(t[0], t[0].shape[-1:], t[1], 1e-6), (x, w)),
        ("gelu", lambda t: gelu(t[0]), lambda t: F.gelu(t[0], approximate="tanh"), (x,)),
        ("swiglu", lambda t: swiglu(*t), lambda t: F.silu(t[0]) * t[1], (x, x.flip(1))),
        ("matmul+bias+gelu", lambda t: matmul(*t, activation="gelu"),
         lambda t: F.gelu(t[0] @ t[1] + t[2], approximate="tanh"), (a, m, bias)),
        ("cross_entropy", lambda t: cross_entropy(t[0], targets), lambda t: F.cross_entropy(t[0], targets), (logits,)),
    ]
    print(f"Triton kernels on {device}{' (interpreter)' if INTERPRET else ''}, against torch in float64:")
    for name, ours_fn, ref_fn, inputs in cases:
        ours_in = [t.detach().clone().requires_grad_() for t in inputs]
        ref_in = [t.detach().double().requires_grad_() for t in inputs]
        ours, ref = ours_fn(ours_in), ref_fn(ref_in)
        weights = torch.randn(ref.shape, generator=gen, dtype=torch.float64).to(device)
        line = f"  {name:<18} forward rel err {rel_err(ours, ref):.1e}"
        if name != "vector_add":
            (ours * weights.float()).sum().backward()
            (ref * weights).sum().backward()
            line += f"   backward {max(rel_err(o.grad, r.grad) for o, r in zip(ours_in, ref_in)):.1e}"
        print(line)


_BENCH_BYTES = 256 * 2**20  # bytes per input tensor of the bandwidth benchmarks: far past the 50 MB L2


def _ms(fn):
    """Median milliseconds of fn() on the GPU; the first call (compiling, autotuning) is not timed."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _extra_peak_mib(fn):
    """MiB that fn() allocates on the GPU at its peak, above what was allocated before it ran."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _bench_copy_gbs():
    x = torch.randn(_BENCH_BYTES, device="cuda", dtype=torch.float32)  # 1 GiB
    y = torch.empty_like(x)
    gbs = 2 * x.nbytes / _ms(lambda: y.copy_(x)) / 1e6
    print(f"device-to-device copy: {gbs:,.0f} GB/s (bytes read + written); the bandwidth kernels' limit")
    return gbs


def _bench_bandwidth(copy_gbs, rows=(1024, 4096, 16384), flat=(4096,)):
    """Row kernels (rows of each width in `rows`) and elementwise kernels: GB/s against torch eager
    and torch.compile, on _BENCH_BYTES per input tensor."""
    ops = [  # name, torch, ours (each a function of x, w, b, other), tensors of x's size moved, widths
        ("softmax", lambda x, w, b, o: torch.softmax(x, -1), lambda x, w, b, o: softmax(x), 2, rows),
        ("layer_norm", lambda x, w, b, o: F.layer_norm(x, x.shape[-1:], w, b),
         lambda x, w, b, o: layer_norm(x, w, b), 2, rows),
        ("rms_norm", lambda x, w, b, o: F.rms_norm(x, x.shape[-1:], w, 1e-6),
         lambda x, w, b, o: rms_norm(x, w), 2, rows),
        ("gelu", lambda x, w, b, o: F.gelu(x, approximate="tanh"), lambda x, w, b, o: gelu(x), 2, flat),
        ("swiglu", lambda x, w, b, o: F.silu(x) * o, lambda x, w, b, o: swiglu(x, o), 3, flat),
        ("vector_add", lambda x, w, b, o: x + o, lambda x, w, b, o: vector_add(x, o), 3, flat),
    ]
    print(f"\n{'kernel':<11}{'dtype':<9}{'N':>6} | {'torch GB/s':>15} {'compile GB/s':>15} {'triton GB/s':>15}"
          f" | triton/compile   (% of copy bandwidth)")
    results = []
    for name, torch_fn, ours_fn, passes, widths in ops:
        for dtype in (torch.float32, torch.bfloat16):
            for n in widths:
                x = torch.randn(_BENCH_BYTES // (n * torch.finfo(dtype).bits // 8), n, device="cuda", dtype=dtype)
                w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
                o = torch.randn_like(x) if passes == 3 else None
                torch.compiler.reset()
                compiled = torch.compile(torch_fn, dynamic=False)
                gbs = {label: passes * x.nbytes / _ms(lambda f=f: f(x, w, b, o)) / 1e6
                       for label, f in (("torch", torch_fn), ("compile", compiled), ("triton", ours_fn))}
                cells = " ".join(f"{gbs[k]:>7,.0f} ({gbs[k] / copy_gbs:>4.0%})" for k in ("torch", "compile", "triton"))
                print(f"{name:<11}{str(dtype)[6:]:<9}{n:>6} | {cells} | {gbs['triton'] / gbs['compile']:.2f}x")
                results.append({"kernel": name, "dtype": str(dtype)[6:], "N": n, **gbs, "copy": copy_gbs})
                del x, w, b, o
    return results


# (M, N, K), how a and b are stored (t: as the transpose of a row-major tensor), fused bias + GELU
_MATMUL_SHAPES = [((n, n, n), "nn", False) for n in (1024, 2048, 4096, 8192)] + [
    ((16384, 3072, 768), "nt", True),   # GPT-2's MLP up-projection at 16,384 tokens: x @ W.t()
    ((16384, 768, 3072), "nt", False),  # its down-projection,
    ((16384, 3072, 768), "nn", False),  # the down-projection's input gradient: dy @ W,
    ((3072, 768, 16384), "tn", False),  # and its weight gradient: dy.t() @ x (split tail)
]


def _bench_matmul(shapes=_MATMUL_SHAPES, rounds=3):
    """bf16 matmul against cuBLAS (and, with the fused bias + GELU epilogue, against compiled
    torch), launched from Python and replayed in a CUDA graph. Launched, a call spends longer in
    Python than a small product takes on the GPU (Triton's autotuner lookup and launch, the TMA
    descriptors, _mm's layout checks and allocation, matmul's checks; at 1024^3 on the H200, one
    run timed 270 us a call launched, 6 us in a graph, and 9 us for cuBLAS launched), which caps
    the rate of small products whatever the kernel does; in a graph only the GPU's time counts.
    Each contender is timed `rounds` times, interleaved, and its median kept: one timing of
    cuBLAS at 4096^3 can move by 10% between back-to-back calls of do_bench."""
    print(f"\n{'matmul (bf16)':<30} | {'cuBLAS':>7} {'compile':>7} {'triton':>7} {'x':>5} | "
          f"{'in a CUDA graph:':>16} {'cuBLAS':>7} {'triton':>7} {'x':>5}   (TFLOP/s)")
    results = []
    for (m, n, k), layout, epilogue in shapes:
        a = torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t() if layout[0] == "t" else \
            torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if layout[1] == "t" else
             torch.randn(k, n, device="cuda", dtype=torch.bfloat16)) / math.sqrt(k)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        if epilogue:
            torch_fn = lambda: F.gelu(torch.addmm(bias, a, b), approximate="tanh")  # noqa: E731
            ours_fn = lambda: matmul(a, b, bias, activation="gelu")  # noqa: E731
        else:
            torch_fn, ours_fn = (lambda: a @ b), (lambda: matmul(a, b))
        torch.compiler.reset()
        compiled = torch.compile(torch_fn) if epilogue else None  # plain matmul: compile calls cuBLAS too
        fns = {label: f for label, f in (("cublas", torch_fn), ("compile", compiled), ("triton", ours_fn)) if f}
        times = {label: [] for label in [*fns, "cublas graph", "triton graph"]}
        for _ in range(rounds):
            for label, f in fns.items():
                times[label].append(_ms(f))
            for label in ("cublas", "triton"):
                times[label + " graph"].append(triton.testing.do_bench_cudagraph(fns[label], return_mode="median"))
        tflops = {label: 2 * m * n * k / statistics.median(t) / 1e9 for label, t in times.items()}
        label = f"{m}x{n}x{k} {layout}" + (" +bias+GELU" if epilogue else "")
        print(f"{label:<30} | {tflops['cublas']:>7,.0f} {tflops.get('compile', float('nan')):>7,.0f} "
              f"{tflops['triton']:>7,.0f} {tflops['triton'] / tflops['cublas']:>4.2f}x | {'':>16} "
              f"{tflops['cublas graph']:>7,.0f} {tflops['triton graph']:>7,.0f} "
              f"{tflops['triton graph'] / tflops['cublas graph']:>4.2f}x")
        results.append({"shape": label, **tflops})
    return results


def _bench_cross_entropy(n_rows=8192, vocab=50257):
    """Loss forward + backward over bf16 logits: time and peak memory against torch's loss."""
    base = torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(vocab, (n_rows,), device="cuda")
    logits_mib = base.nbytes / 2**20

    def step(loss_fn):
        logits = base.view(n_rows, vocab)  # a non-leaf view, as a model's logits are
        (grad,) = torch.autograd.grad(loss_fn(logits, targets), logits)
        return grad

    torch.compiler.reset()
    variants = [("torch F.cross_entropy", F.cross_entropy), ("torch.compile", torch.compile(F.cross_entropy)),
                ("triton", cross_entropy),
                # last: it overwrites `base` with gradients, which the timing does not mind
                ("triton inplace_backward", lambda lg, t: cross_entropy(lg, t, inplace_backward=True))]
    print(f"\ncross-entropy fwd+bwd, {n_rows} x {vocab} bf16 logits ({logits_mib:,.0f} MiB) | "
          f"{'ms':>6} {'peak MiB incl. logits':>22} {'vs torch':>9}")
    results = []
    for label, fn in variants:
        ms = _ms(lambda: step(fn))
        peak = logits_mib + _extra_peak_mib(lambda: step(fn))
        results.append({"variant": label, "ms": ms, "peak_mib": peak})
        print(f"{label:<63} | {ms:>6.2f} {peak:>22,.0f} {results[0]['peak_mib'] / peak:>8.1f}x")
    return results


def bench_kernels():
    """--bench: every kernel against torch eager and torch.compile in one run."""
    if not torch.cuda.is_available():
        print("--bench needs a CUDA GPU (the interpreter shows correctness, not speed); skipped.")
        return {}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    copy_gbs = _bench_copy_gbs()
    return {"copy_gbs": copy_gbs, "bandwidth": _bench_bandwidth(copy_gbs), "matmul": _bench_matmul(),
            "cross_entropy": _bench_cross_entropy()}


# ----------------------------------------------------------------------------------------------
# Plumbing for the Triton kernels: input checks, SM count, the interpreter patch
# ----------------------------------------------------------------------------------------------

def _check_tensor(name, t, *, dtypes=_FLOAT_DTYPES, device=None, contiguous=True, rows=False):
    """Raise a clear error unless `t` is a tensor these kernels can take. rows: the kernel reads `t`
    as rows along its last dimension, so `t` needs one."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {', '.join(map(str, dtypes))}")
    if t.device.type != "cuda" and not (t.device.type == "cpu" and INTERPRET):
        raise ValueError(f"{name} is on {t.device}: the Triton kernels take CUDA tensors (CPU tensors "
                         "only under the interpreter, TRITON_INTERPRET=1 set before triton is imported)")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")
    if rows and t.dim() == 0:
        raise ValueError(f"{name} is 0-dim; expected at least 1 dimension (the kernel works along the last)")


@functools.lru_cache(maxsize=None)
def _num_sms(device):
    """Streaming multiprocessors of `device`; 1 for the interpreter, which runs programs one by one."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


if INTERPRET:
    # Triton 3.6's interpreter hands scalar arguments to a kernel as 1-element arrays and turns loop
    # bounds into ints with int(array), which NumPy >= 2.4 refuses (triton-lang/triton#9171, fixed
    # after 3.6). Convert through .item() instead; every other piece of the interpreter is untouched.
    from triton.runtime import interpreter as _interpreter

    _patch_lang_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor_item(tensor, scope):
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    _interpreter._patch_lang_tensor = _patch_lang_tensor_item


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


# The baseline of --bench: nanoGPT's GPT-2, which is this GPT on torch's fused ops (F.layer_norm,
# F.gelu(approximate="tanh"), scaled_dot_product_attention) with its loss compiled together with
# the model. The twins below are swapped in by class (the way stages 04-06 swap in their kernels)
# rather than written out as a second model: parameters, names, init and weight tying stay the
# GPT's, so from one seed both start from the same weights and two rows differ only in their ops.

class TorchLayerNorm(LayerNorm):
    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class TorchGELU(GELU):
    def forward(self, x):
        return F.gelu(x, approximate="tanh")


class SDPAAttention(MultiHeadAttention):
    def attend(self, q, k, v):
        """attend on torch's fused scaled_dot_product_attention: the baseline."""
        p = self.attn_dropout.p if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


def plain_twin(model):
    """Switch every LayerNorm, GELU and attention of the GPT to its torch twin, in place."""
    twins = {LayerNorm: TorchLayerNorm, GELU: TorchGELU, MultiHeadAttention: SDPAAttention}
    for module in model.modules():
        twin = twins.get(type(module))
        if twin is not None:
            module.__class__ = twin
    return model


def bench(args, device):
    """Training throughput on random tokens: the plain model (plain_twin) eager and compiled with
    its loss, then this stage's GPT eager, compiled and on the Triton kernels. Every row starts from
    the same weights and runs the same batch, steps and AdamW; each is also given as a fraction of
    plain compiled."""
    T = args.context_length or (1024 if device.type == "cuda" else 128)
    B = args.batch_size or (16 if device.type == "cuda" else 4)
    preset = args.model or ("124M" if device.type == "cuda" else "tiny")
    steps = 20
    peak = peak_flops(device)
    print(f"training throughput: GPT-2 {preset} shape, B={B}, T={T}, {steps} steps, "
          f"{'bf16 autocast, fused AdamW' if device.type == 'cuda' else 'fp32'} on {device}")
    rows = {}
    for mode in ("plain eager", "plain compiled", "GPT eager", "GPT compiled",
                 "triton kernels"):  # changed in 05: a Triton row
        torch.manual_seed(args.seed)
        model = GPT(build_config(preset, T, 0.0)).to(device)
        if mode.startswith("plain"):
            plain_twin(model)
        if mode == "triton kernels":
            use_triton_kernels(model)
        step_model = torch.compile(model) if mode == "GPT compiled" else model
        step_loss = triton_loss_fn if mode == "triton kernels" else loss_fn
        opt = make_optimizer(model, 1e-4, 0.1, device)
        x = torch.randint(0, model.cfg.vocab_size, (B, T + 1), device=device)

        def model_loss(batch):
            return step_loss(step_model(batch[:, :-1]), batch[:, 1:])

        if mode == "plain compiled":  # the model and its loss in one compiled function
            model_loss = torch.compile(model_loss)

        def one_step():
            with autocast(device):
                loss = model_loss(x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return loss

        for _ in range(3):  # warm-up: compilation, allocator, cuBLAS heuristics
            one_step()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = one_step()
        sync()
        tok_s = B * T * steps / (time.perf_counter() - t0)
        mfu = flops_per_token(model, T) * tok_s / peak if peak else None
        rows[mode] = (tok_s, mfu, loss.item())
        del model, step_model, opt, model_loss
    base = rows["plain compiled"][0]
    print(f"{'mode':<16}{'tokens/s':>12}{'MFU':>8}{'loss':>8}{'vs plain compiled':>19}")
    for mode, (tok_s, mfu, loss) in rows.items():
        print(f"{mode:<16}{tok_s:>12,.0f}{(f'{mfu:.1%}' if mfu else 'n/a'):>8}{loss:>8.3f}"
              f"{tok_s / base:>18.2f}x")


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
                        help="model shape to train (default: tiny; --bench on a GPU: 124M)")
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
    parser.add_argument("--kernels", choices=["torch", "triton"], default="triton",
                        help="run the GPT (forward and backward) on torch or on Triton kernels")
    parser.add_argument("--prompt", help='text to continue (default: "Every effort moves you")')
    parser.add_argument("--max-new-tokens", type=positive_int,
                        help="tokens to generate (default: 40; 10 on Triton's CPU interpreter)")
    parser.add_argument("--temperature", type=non_negative_float, help="0 = greedy (the default)")
    parser.add_argument("--top-k", type=positive_int, help="sample from the k likeliest tokens")
    parser.add_argument("--top-p", type=probability, help="sample from the smallest set of "
                        "tokens whose probabilities add up to p")
    parser.add_argument("--bench", action="store_true",
                        help="time every kernel against torch, then GPT training throughput")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--data-dir", default=None, help="download cache (default: data/)")
    parser.add_argument("--seed", type=int, default=123, help="seed of the weights, the data "
                        "order and sampling")
    args = parser.parse_args()
    check_args(parser, args)
    # the defaults, filled in after the checks (which need to know what was given)
    args.prompt = args.prompt or "Every effort moves you"
    slow = INTERPRET and args.kernels == "triton"  # changed in 05: the interpreter is slow
    args.max_new_tokens = args.max_new_tokens or (10 if slow else 40)
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
    if not args.train and not args.bench:  # --bench reads the model's shape and batch too
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
    if args.kernels == "triton":  # changed in 05: train on the Triton kernels
        use_triton_kernels(model)
    loss = triton_loss_fn if args.kernels == "triton" else loss_fn
    train(model, train_loader, val_loader, tcfg, device, loss=loss)
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
    """The GPT's logits for the prompt on torch, then on the Triton kernels."""
    idx = torch.tensor([tokenizer.encode(args.prompt)], device=device)
    with torch.no_grad():
        ref = model(idx).float()
        use_triton_kernels(model)
        ours = model(idx).float()
    err = ((ours - ref).norm() / ref.norm()).item()
    print(f"GPT logits on the Triton kernels vs torch: relative error {err:.2e}")


def main():
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left over
    torch.manual_seed(args.seed)
    if args.bench and device.type != "cuda":  # GPU-only: say so in one line, as every stage does
        return print("--bench needs a CUDA GPU (the interpreter shows correctness, not speed)")
    if args.bench:
        bench_kernels()
        return bench(args, device)
    # every download this run needs, before any work: a missing file stops it here, all named
    files = [data_entry("gpt2.tiktoken", args.data_dir)]
    if args.gpt2:
        files += gpt2_files(args.gpt2, args.data_dir)
    elif args.train:
        files.append(data_entry("the-verdict.txt", args.data_dir))
    fetch(files)
    demo_triton(device)
    tokenizer = gpt2_tokenizer(args.data_dir)
    if args.load or args.gpt2 or args.gpt2_dir:
        model = load_model(args, device)
    elif args.train:
        model = train_model(args, device, tokenizer)
    else:  # an untrained GPT is enough to compare the two paths
        # changed in 05: the interpreter is slow, so on a CPU a small GPT
        cfg = (GPTConfig.gpt2("124M") if device.type == "cuda" else
               GPTConfig(n_layer=2, n_head=2, n_embd=64, context_length=64))
        model = GPT(cfg).to(device).eval()
        print(f"untrained GPT, {model.num_params() / 1e6:.1f}M parameters "
              f"(pass --gpt2 124M for the real weights)")
    if args.kernels == "triton" and not args.train:
        compare_on_kernels(model, tokenizer, args, device)
    sample(model, tokenizer, args, device)


if __name__ == "__main__":
    try:
        main()
    except DataError as e:  # a missing or broken file: the message says which and what to do
        sys.exit(f"error: {e}")
