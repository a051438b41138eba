"""Stage 03: training the GPT, generating text, and loading GPT-2's real weights (chapters 7-9).

What this stage teaches
    7. Training: next-token cross-entropy, AdamW with warmup and cosine decay, gradient clipping,
       evaluation on held-out text, and the numbers to watch (loss, tokens/s, MFU on a GPU,
       where bf16 autocast and fused AdamW are used).
    8. Generation: temperature, top-k and top-p (nucleus) sampling and an end-of-text stop, in
       `generate(model, idx, max_new_tokens, temperature=0.0, top_k=None, top_p=None, eos_id=None)`;
       checkpoints saved and loaded with safetensors.
    9. Real weights: `load_gpt2(path_or_size)` maps GPT-2's Hugging Face checkpoint onto our GPT
       (a local directory with config.json + model.safetensors, or a size it downloads).

New since stage 02: sections 7-9 and a `main()` that trains; `--bench`, which times training
steps of the GPT against `plain_twin`, the same weights on torch's fused ops (nanoGPT's model).
Changed: `GPTConfig.vocab_multiple` pads wte and lm_head, and the training presets pad GPT-2's
50,257 ids to 50,304 (generation never picks a padding id; loaded GPT-2 stays unpadded);
`GPT.forward` checks token ids with `check_token_ids` only where that costs no host sync (ids on
the CPU, or outside training), and `train` checks each batch while it is still on the CPU.
Dropped: the from-scratch BPETokenizer (tiktoken's GPT-2 encoding takes over) and the attention
warm-ups of chapter 5 (the GPT keeps MultiHeadAttention).

Run
    python 03_train.py                          # tiny GPT on The Verdict, ~2 min on a 2-core CPU
    python 03_train.py --model 124M --epochs 10 # the book's run (GPT-2 124M shape, context 256)
    python 03_train.py --gpt2 124M --prompt "Every effort moves you"   # real weights
    python 03_train.py --bench                  # training tokens/s (124M, T=1024 on a GPU),
                                                # the GPT against the plain model, each eager
                                                # and compiled

Training prints the train and validation loss as they fall, tokens/s (and MFU on a GPU), then
a sample from the trained model.
"""

import argparse
import base64
import contextlib
import hashlib
import json
import math
import os
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
    # NEW in stage 03: a padded vocabulary (build_config says why; loaded GPT-2 keeps 1)
    vocab_multiple: int = 1     # wte and lm_head get vocab_size rounded up to a multiple of this

    def __post_init__(self):
        for name in ("vocab_size", "context_length", "n_embd", "n_head", "n_layer",
                     "vocab_multiple"):  # changed in 03
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got "
                                 f"{getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        # NEW in stage 03: padded_vocab_size
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
        # changed in 03: wte and lm_head have padded_vocab_size rows
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
        # changed in 03: the range is checked only where that costs no host sync (check_token_ids)
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
        # changed in 03: the argmax over the real vocabulary, never a padding id
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
    its loss, then this stage's GPT eager and compiled. Every row starts from the same weights and
    runs the same batch, steps and AdamW; each is also given as a fraction of plain compiled."""
    T = args.context_length or (1024 if device.type == "cuda" else 128)
    B = args.batch_size or (16 if device.type == "cuda" else 4)
    preset = args.model or ("124M" if device.type == "cuda" else "tiny")
    steps = args.bench_steps
    peak = peak_flops(device)
    print(f"training throughput: GPT-2 {preset} shape, B={B}, T={T}, {steps} steps, "
          f"{'bf16 autocast, fused AdamW' if device.type == 'cuda' else 'fp32'} on {device}")
    rows = {}
    for mode in ("plain eager", "plain compiled", "GPT eager", "GPT compiled"):
        torch.manual_seed(args.seed)
        model = GPT(build_config(preset, T, 0.0)).to(device)
        if mode.startswith("plain"):
            plain_twin(model)
        step_model = torch.compile(model) if mode == "GPT compiled" else model
        opt = make_optimizer(model, 1e-4, 0.1, device)
        x = torch.randint(0, model.cfg.vocab_size, (B, T + 1), device=device)

        def model_loss(batch):
            return loss_fn(step_model(batch[:, :-1]), batch[:, 1:])

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
    parser.add_argument("--eval-every", type=positive_int,
                        help="steps between evaluations (default: 10)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--save", help="write the trained model to this .safetensors file")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--load", help="generate from a checkpoint instead of training")
    source.add_argument("--gpt2", choices=list(GPT2_REPOS), metavar="SIZE",
                        help="generate with GPT-2's real weights (124M, 355M, 774M, 1558M)")
    source.add_argument("--gpt2-dir", help="generate with GPT-2 weights from this HF directory")
    parser.add_argument("--prompt", help='text to continue (default: "Every effort moves you")')
    parser.add_argument("--max-new-tokens", type=positive_int,
                        help="tokens to generate (default: 40)")
    parser.add_argument("--temperature", type=non_negative_float, help="0 = greedy (the default)")
    parser.add_argument("--top-k", type=positive_int, help="sample from the k likeliest tokens")
    parser.add_argument("--top-p", type=probability, help="sample from the smallest set of "
                        "tokens whose probabilities add up to p")
    parser.add_argument("--bench", action="store_true", help="measure training throughput")
    parser.add_argument("--bench-steps", type=positive_int,
                        help="timed steps of --bench (default: 20)")
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
    args.bench_steps = args.bench_steps or 20
    return args


TRAINING_FLAGS = ("model", "epochs", "batch_size", "context_length", "lr", "eval_every",
                  "compile", "save")
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
        refuse(("epochs", "lr", "eval_every", "compile", "save", "load", "gpt2", "gpt2_dir",
                *SAMPLING_FLAGS), "does not apply to --bench")
    else:
        refuse(("bench_steps",), "only applies to --bench")
    if loading:
        refuse(TRAINING_FLAGS, "only applies to training, not with --load, --gpt2 or --gpt2-dir")
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
    tcfg = TrainConfig(epochs=args.epochs or preset["epochs"], lr=args.lr or preset["lr"],
                       eval_every=args.eval_every or 10)
    print(f"training GPT ({model.num_params() / 1e6:.1f}M parameters, {model.cfg}) on "
          f"The Verdict: {split:,} train / {len(ids) - split:,} val tokens, "
          f"{len(train_loader)} steps per epoch, {tcfg.epochs} epochs, on {device}")
    step_model = torch.compile(model) if args.compile else model
    train(step_model, train_loader, val_loader, tcfg, device)
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


def main():
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left over
    torch.manual_seed(args.seed)
    if args.bench:
        return bench(args, device)
    # every download this run needs, before any work: a missing file stops it here, all named
    files = [data_entry("gpt2.tiktoken", args.data_dir)]
    if args.gpt2:
        files += gpt2_files(args.gpt2, args.data_dir)
    elif not (args.load or args.gpt2_dir):
        files.append(data_entry("the-verdict.txt", args.data_dir))
    fetch(files)
    tokenizer = gpt2_tokenizer(args.data_dir)
    if args.load or args.gpt2 or args.gpt2_dir:
        model = load_model(args, device)
    else:
        model = train_model(args, device, tokenizer)
    sample(model, tokenizer, args, device)


if __name__ == "__main__":
    try:
        main()
    except DataError as e:  # a missing or broken file: the message says which and what to do
        sys.exit(f"error: {e}")
