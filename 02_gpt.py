"""Stage 02: from text to a GPT (book chapters 4-6).

What this stage teaches
    4. Text as numbers: byte-level BPE written from scratch (`BPETokenizer`: `train_simple`, the
       plain algorithm, then `train`, the same merges learned incrementally; encode,
       decode, and `BPETokenizer.gpt2()`, which encodes exactly as tiktoken's GPT-2 encoding);
       `gpt2_tokenizer()`, the same vocabulary through tiktoken; a sliding-window dataset.
    5. Attention, built up as the book does: plain self-attention, then trainable weights, then
       the causal mask, then many heads at once.
    6. The transformer block and GPT: layer norm, GELU, the MLP, residual connections,
       `GPTConfig` (with GPT-2's four sizes) and `GPT`, and greedy generation.

New since stage 01: everything above; stage 01's tour, autograd engine and optimizers stay
behind (torch's own take over from here).

Run
    python 02_gpt.py                 # CPU is fine; well under a minute
    python 02_gpt.py --size 355M     # build a bigger GPT-2 shape

It prints the BPE trained on *The Verdict*, the GPT-2 tokenizer checked against tiktoken, a
batch from the data loader, the attention weights of a toy sentence, and the GPT's parameter
count, memory and a greedy continuation from the untrained model (gibberish, as it should be).
Data files are downloaded on first use into data/ (see data/README.md).
"""
import argparse
import base64
import collections
import contextlib
import functools
import hashlib
import heapq
import math
import os
import re
import sys
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import requests
import tiktoken
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

try:
    import fcntl  # file locks, so that two processes never download into one file
except ImportError:  # Windows
    fcntl = None

# ----------------------------------------------------------------------------------------------
# Chapter 4. Text as numbers
# ----------------------------------------------------------------------------------------------

# GPT-2 reads bytes, not characters: every string is its UTF-8 bytes, so no text is ever out of
# vocabulary. Byte-pair encoding (BPE) then glues frequent neighbours into longer tokens. A BPE
# vocabulary is fully described by its *ranks*: token bytes -> id, where the id also orders the
# merges (lower id = learned earlier = merged first). That is tiktoken's file format, one
# `base64(token bytes) rank` per line, so the same class trains its own vocabulary or loads GPT-2's.
#
# Before merging, GPT-2 cuts text into chunks with a regex, and merges only inside a chunk, so a
# token never glues a word to the punctuation after it:
#     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# `\s+(?!\S)` takes a whitespace run but, when a word follows, leaves its last character, so that a
# space can join the word through ` ?\p{L}+`: "a   b" -> "a", "  ", " b".
# Python's `re` has no \p{L} (letters) or \p{N} (numbers), so we spell them out as code point ranges
# read from `unicodedata`. To split exactly as tiktoken does (its regex engine is Rust's `regex`
# crate) two more details matter:
# - its \s is Unicode White_Space, 25 characters; Python's \s adds \x1c-\x1f;
# - its tables are Unicode 16.0, newer than the unicodedata of Python 3.11 (14.0) or 3.12 (15.0),
#   so the letters and numbers assigned by Unicode 15.0-16.0 are added to it.
# `_unicode_classes`, with the plumbing at the end of the file, builds these ranges.
@functools.cache
def gpt2_split_regex():
    """GPT-2's pre-tokenizer in Python `re`: `.findall(text)` gives the chunks BPE works within."""
    L, N, S = _unicode_classes()
    return re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{S}{L}{N}]+"
                      rf"|[{S}]+(?![^{S}])|[{S}]+")


class BPETokenizer:
    """Byte-level BPE with GPT-2's pre-tokenizer.

    ranks: token bytes -> id, ids 0..len(ranks)-1, all 256 single bytes included; the id is also
        the merge priority (lower merges first).
    special_tokens: string -> id for tokens such as "<|endoftext|>", which never come from merges:
        `encode` emits them only when allowed (see there).
    Build one with `BPETokenizer.train(text, vocab_size)` or `BPETokenizer.gpt2()`.
    """

    def __init__(self, ranks, special_tokens=None):
        self.ranks = dict(ranks)
        self.special_tokens = dict(special_tokens or {})
        if sorted(self.ranks.values()) != list(range(len(self.ranks))):
            raise ValueError("ranks must number the tokens 0..len(ranks)-1, each id once")
        missing = [b for b in range(256) if bytes([b]) not in self.ranks]
        if missing:
            raise ValueError(f"ranks lack {len(missing)} single bytes (first: {missing[0]}); "
                             "byte-level BPE needs all 256 to encode any text")
        special_ids = sorted(self.special_tokens.values())
        below_ranks = special_ids and special_ids[0] < len(self.ranks)
        if below_ranks or len(set(special_ids)) < len(special_ids):
            raise ValueError(f"special token ids {special_ids} must be distinct and >= len(ranks) "
                             f"= {len(self.ranks)}")
        self.vocab = {i: b for b, i in self.ranks.items()}  # id -> bytes, for decoding
        self.vocab.update((i, s.encode("utf-8")) for s, i in self.special_tokens.items())
        self._split = gpt2_split_regex()
        # Text repeats its words, so most chunks have been merged before: cache their ids.
        self._encode_chunk = functools.lru_cache(maxsize=1 << 16)(self._bpe)

    @property
    def n_vocab(self):
        """Number of ids, special tokens included (50257 for GPT-2)."""
        return len(self.vocab)

    # ---- training -------------------------------------------------------------------------------
    @staticmethod
    def _chunks(text, vocab_size, special_tokens):
        """The text's chunks, counted: {chunk: occurrences}, and the number of merges to learn."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        n_merges = vocab_size - 256 - len(special_tokens)
        if n_merges < 0:
            raise ValueError(f"vocab_size={vocab_size} is below 256 bytes + "
                             f"{len(special_tokens)} special tokens")
        # Special tokens in the text are boundaries, never material for merges.
        pieces = [text]
        if special_tokens:
            pieces = re.split("|".join(map(re.escape, special_tokens)), text)
        split = gpt2_split_regex()
        return collections.Counter(c for piece in pieces for c in split.findall(piece)), n_merges

    @classmethod
    def train_simple(cls, text, vocab_size, special_tokens=("<|endoftext|>",)):
        """BPE training in its plainest form: count every adjacent pair of ids in the text, merge
        the most frequent one everywhere into a new id (ties: the pair of smaller ids), repeat.
        Each merge recounts the whole text; `train` below learns the same merges faster."""
        chunk_counts, n_merges = cls._chunks(text, vocab_size, special_tokens)
        words = {tuple(chunk.encode("utf-8")): n for chunk, n in chunk_counts.items()}
        token_bytes = [bytes([b]) for b in range(256)]  # id -> bytes
        ranks = {b: i for i, b in enumerate(token_bytes)}
        while len(token_bytes) < 256 + n_merges:
            pair_counts = collections.Counter()
            for word, n in words.items():
                for pair in zip(word, word[1:]):
                    pair_counts[pair] += n
            if not pair_counts:
                raise ValueError(f"text too short: no pairs left after {len(token_bytes) - 256} "
                                 f"of {n_merges} merges")
            pair = min(pair_counts, key=lambda p: (-pair_counts[p], p))
            new_bytes = token_bytes[pair[0]] + token_bytes[pair[1]]
            if new_bytes not in ranks:  # two pairs may spell the same bytes ("a"+"bc", "ab"+"c")
                ranks[new_bytes] = len(token_bytes)
                token_bytes.append(new_bytes)
            merged = collections.Counter()
            for word, n in words.items():
                out, i = [], 0
                while i < len(word):
                    if word[i:i + 2] == pair:
                        out.append(ranks[new_bytes])
                        i += 2
                    else:
                        out.append(word[i])
                        i += 1
                merged[tuple(out)] += n
            words = merged
        return cls(ranks, {s: len(ranks) + k for k, s in enumerate(special_tokens)})

    @classmethod
    def train(cls, text, vocab_size, special_tokens=("<|endoftext|>",), verbose=False):
        """The merges of `train_simple`, learned without recounting the text after every merge.

        Chunks are counted once and pairs weighted by chunk frequency, as there; in addition an
        index from each pair to the chunks that contain it means a merge updates only those
        chunks and the pair counts they change, and a heap finds the next most frequent pair
        (stale entries, whose count has changed since, are skipped when popped).
        """
        chunk_counts, n_merges = cls._chunks(text, vocab_size, special_tokens)
        words = [list(chunk.encode("utf-8")) for chunk in chunk_counts]  # each chunk as token ids
        freqs = list(chunk_counts.values())

        pair_counts = collections.Counter()        # (id, id) -> occurrences in the text
        where = collections.defaultdict(set)       # (id, id) -> indices of words containing it
        for w, (word, freq) in enumerate(zip(words, freqs)):
            for pair in zip(word, word[1:]):
                pair_counts[pair] += freq
                where[pair].add(w)
        heap = [(-count, pair) for pair, count in pair_counts.items()]
        heapq.heapify(heap)

        token_bytes = [bytes([b]) for b in range(256)]  # id -> bytes
        ranks = {b: i for i, b in enumerate(token_bytes)}
        while len(token_bytes) < 256 + n_merges:
            if not heap:
                raise ValueError(f"text too short: no pairs left after {len(token_bytes) - 256} "
                                 f"of {n_merges} merges")
            neg_count, pair = heapq.heappop(heap)
            if pair_counts.get(pair) != -neg_count:
                continue  # stale heap entry: the count changed since it was pushed
            new_bytes = token_bytes[pair[0]] + token_bytes[pair[1]]
            # Two different pairs can spell the same bytes ("a"+"bc", "ab"+"c"): keep one id.
            is_new = new_bytes not in ranks
            new_id = ranks.setdefault(new_bytes, len(token_bytes))
            if is_new:
                token_bytes.append(new_bytes)
            changed = set()
            for w in where.pop(pair):
                word, freq = words[w], freqs[w]
                merged, i = [], 0
                while i < len(word):
                    if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
                        merged.append(new_id)
                        i += 2
                    else:
                        merged.append(word[i])
                        i += 1
                for old in zip(word, word[1:]):
                    pair_counts[old] -= freq
                    changed.add(old)
                for new in zip(merged, merged[1:]):
                    pair_counts[new] += freq
                    where[new].add(w)
                    changed.add(new)
                words[w] = merged
            for p in changed:
                if pair_counts[p] > 0:
                    heapq.heappush(heap, (-pair_counts[p], p))
                else:
                    del pair_counts[p]
            done = len(token_bytes) - 256
            if verbose and is_new and (done % max(1, n_merges // 10) == 0 or done == n_merges):
                print(f"merge {done:5d}/{n_merges}: {token_bytes[pair[0]]!r} + "
                      f"{token_bytes[pair[1]]!r} -> id {new_id} ({-neg_count} times)")
        specials = {s: len(ranks) + k for k, s in enumerate(special_tokens)}
        return cls(ranks, specials)

    # ---- GPT-2's vocabulary ---------------------------------------------------------------------
    @classmethod
    def gpt2(cls, path=None, data_dir=None):
        """GPT-2's 50,000 merges from its ranks file (tiktoken format; default: the cached
        data/gpt2.tiktoken, downloaded on first use); <|endoftext|> = 50256."""
        path = Path(path) if path is not None else data_file("gpt2.tiktoken", data_dir)
        ranks = read_ranks(path)
        if len(ranks) != 50256:
            raise DataError(f"{path}: {len(ranks)} ranks, GPT-2 has 50256")
        return cls(ranks, {"<|endoftext|>": 50256})

    # ---- encoding and decoding ------------------------------------------------------------------
    def _bpe(self, chunk):
        """Ids of one pre-tokenized chunk: repeatedly merge the adjacent pair whose joined bytes
        have the lowest rank (the leftmost such pair on ties), as GPT-2's encoder does."""
        data = chunk.encode("utf-8")
        if data in self.ranks:  # most words are one token: skip the merging (as tiktoken does)
            return (self.ranks[data],)
        # Rescanning every pair after each merge is quadratic (100,000 "a"s took 9 minutes), so:
        # a min-heap of (rank, position) over the adjacent pairs pops the next merge in O(log n),
        # ties going to the smaller position, the leftmost; and a linked list of the parts lets a
        # merge touch only its neighbours. A merge changes just the pairs on either side of it:
        # they are pushed anew, and stale entries are skipped when popped, not hunted down.
        ranks, n = self.ranks, len(data)
        # The linked list, indexed by start byte: parts[i] is the part that starts at byte i (b""
        # once merged into its left neighbour), prev[i] and next_[i] its neighbours (-1, n: none).
        parts = [data[i:i + 1] for i in range(n)]
        prev = list(range(-1, n - 1))
        next_ = list(range(1, n + 1))
        heap = []

        def push(i):  # the pair that starts at part i, if it has a rank
            rank = ranks.get(parts[i] + parts[next_[i]]) if next_[i] < n else None
            if rank is not None:
                heapq.heappush(heap, (rank, i))

        for i in range(n - 1):
            push(i)
        while heap:
            rank, i = heapq.heappop(heap)
            j = next_[i]
            if not parts[i] or j == n or ranks.get(parts[i] + parts[j]) != rank:
                continue  # stale: part i was merged away, or its pair has grown since the push
            parts[i], parts[j] = parts[i] + parts[j], b""
            next_[i] = next_[j]
            if next_[i] < n:
                prev[next_[i]] = i
            if prev[i] >= 0:
                push(prev[i])
            push(i)
        return tuple(ranks[p] for p in parts if p)

    def encode_ordinary(self, text):
        """Ids of `text`, special-token strings included as plain text."""
        ids = []
        for chunk in self._split.findall(text):
            ids.extend(self._encode_chunk(chunk))
        return ids

    def encode(self, text, allowed_special=(), disallowed_special="all"):
        """Ids of `text`, with tiktoken's rules for special tokens:

        allowed_special: special tokens ("all" or a collection) that become their own id.
        disallowed_special: special tokens ("all" = every one not allowed, or a collection) whose
            appearance in `text` raises ValueError; pass () to encode them as plain text.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        for name, value in (("allowed_special", allowed_special),
                            ("disallowed_special", disallowed_special)):
            if isinstance(value, str) and value != "all":
                raise TypeError(f'{name} must be "all" or a collection of strings, got {value!r}')
        allowed = set(self.special_tokens if allowed_special == "all" else allowed_special)
        unknown = allowed - self.special_tokens.keys()
        if unknown:
            raise ValueError(f"allowed_special names unknown special tokens {sorted(unknown)}")
        disallowed = (self.special_tokens.keys() - allowed if disallowed_special == "all"
                      else set(disallowed_special))
        for token in disallowed:
            if token in text:
                raise ValueError(f"text contains the special token {token!r}: pass "
                                 f"allowed_special={{{token!r}}} to encode it as its id, or "
                                 "disallowed_special=() to encode it as plain text")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates (say, from JSON "\ud83d" escapes) have no UTF-8; tiktoken repairs the
            # text this way (split pairs rejoin, lone halves become U+FFFD), and so do we.
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        if not allowed:
            return self.encode_ordinary(text)
        # Split around allowed special tokens (longest first); odd pieces are the tokens.
        pattern = "|".join(map(re.escape, sorted(allowed, key=len, reverse=True)))
        ids = []
        for k, piece in enumerate(re.split(f"({pattern})", text)):
            if k % 2:
                ids.append(self.special_tokens[piece])
            else:
                ids.extend(self.encode_ordinary(piece))
        return ids

    def decode_bytes(self, ids):
        """The bytes that `ids` spell (a token may hold part of a multi-byte character)."""
        try:
            return b"".join(self.vocab[int(i)] for i in ids)
        except KeyError as err:
            raise ValueError(f"token id {err.args[0]} is not in the vocabulary of "
                             f"{self.n_vocab}") from None

    def decode(self, ids):
        """Text of `ids`; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


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

def simple_self_attention(x):
    """No weights yet: each token's output is the average of all tokens, weighted by
    softmax(dot-product similarity). x (T, C) -> (T, C)."""
    scores = x @ x.T                          # (T, T)
    weights = torch.softmax(scores, dim=-1)   # each row sums to 1
    return weights @ x                        # (T, C)


class SelfAttention(nn.Module):
    """Trainable query, key and value projections, scaled dot products. x (B, T, C) -> (B, T, D)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)

    def scores(self, x):
        q, k = self.W_query(x), self.W_key(x)                 # (B, T, D)
        # Dividing by sqrt(D) keeps the dot products' variance near 1, so softmax does not
        # saturate into a one-hot vector with vanishing gradients as D grows.
        return q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))  # (B, T, T)

    def forward(self, x):
        return torch.softmax(self.scores(x), dim=-1) @ self.W_value(x)


class CausalAttention(SelfAttention):
    """Self-attention where token t sees only tokens 0..t: the scores above the diagonal are set
    to -inf before the softmax, so their weights are exactly 0."""

    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__(d_in, d_out)
        self.dropout = nn.Dropout(dropout)
        mask = torch.ones(context_length, context_length, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)  # True = may attend

    def forward(self, x):
        T = x.size(1)
        scores = self.scores(x).masked_fill(~self.mask[:T, :T], float("-inf"))
        return self.dropout(torch.softmax(scores, dim=-1)) @ self.W_value(x)


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

    def __post_init__(self):
        for name in ("vocab_size", "context_length", "n_embd", "n_head", "n_layer"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got "
                                 f"{getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

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


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)      # token embeddings
        self.wpe = nn.Embedding(cfg.context_length, cfg.n_embd)  # learned absolute positions
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
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
        if idx.numel() and (idx.min() < 0 or idx.max() >= self.cfg.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size}), got "
                             f"[{idx.min().item()}, {idx.max().item()}]")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))             # (B, T, V)


@torch.no_grad()
def generate_greedy(model, idx, max_new_tokens):
    """Append the most likely next token max_new_tokens times. idx (B, T) -> (B, T + new)."""
    for _ in range(max_new_tokens):
        logits = model(idx[:, -model.cfg.context_length:])  # crop to what the model can see
        next_id = logits[:, -1, :].argmax(dim=-1, keepdim=True)  # (B, 1)
        idx = torch.cat([idx, next_id], dim=1)
    return idx


# ----------------------------------------------------------------------------------------------
# Plumbing: data files (downloaded once into data/, checked by sha256) and Unicode tables
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


_WHITE_SPACE = r"\t-\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_LETTERS_SINCE_14 = (  # (first, last) code points, general category L*, new in Unicode 15.0-16.0
    (0x1C89, 0x1C8A), (0xA7CB, 0xA7CD), (0xA7DA, 0xA7DC), (0x105C0, 0x105F3), (0x10D4A, 0x10D65),
    (0x10D6F, 0x10D85), (0x10EC2, 0x10EC4), (0x1123F, 0x11240), (0x11380, 0x11389),
    (0x1138B, 0x1138B), (0x1138E, 0x1138E), (0x11390, 0x113B5), (0x113B7, 0x113B7),
    (0x113D1, 0x113D1), (0x113D3, 0x113D3), (0x11BC0, 0x11BE0), (0x11F02, 0x11F02),
    (0x11F04, 0x11F10), (0x11F12, 0x11F33), (0x1342F, 0x1342F), (0x13441, 0x13446),
    (0x13460, 0x143FA), (0x16100, 0x1611D), (0x16D40, 0x16D6C), (0x18CFF, 0x18CFF),
    (0x1B132, 0x1B132), (0x1B155, 0x1B155), (0x1DF25, 0x1DF2A), (0x1E030, 0x1E06D),
    (0x1E4D0, 0x1E4EB), (0x1E5D0, 0x1E5ED), (0x1E5F0, 0x1E5F0), (0x2B739, 0x2B739),
    (0x2EBF0, 0x2EE5D), (0x31350, 0x323AF),
)
_NUMBERS_SINCE_14 = (  # general category N*, new in Unicode 15.0-16.0
    (0x10D40, 0x10D49), (0x116D0, 0x116E3), (0x11BF0, 0x11BF9), (0x11F50, 0x11F59),
    (0x16130, 0x16139), (0x16D70, 0x16D79), (0x1CCF0, 0x1CCF9), (0x1D2C0, 0x1D2D3),
    (0x1E4F0, 0x1E4F9), (0x1E5F1, 0x1E5FA),
)


@functools.cache
def _unicode_classes():
    """Regex class bodies (letters, numbers, white space): tiktoken's \\p{L}, \\p{N}, \\s.

    Scanning all 1.1M code points takes ~0.3 s, so it happens once, on first use.
    """
    letters, numbers = set(), set()
    for cp in range(0x110000):
        major = unicodedata.category(chr(cp))[0]
        if major == "L":
            letters.add(cp)
        elif major == "N":
            numbers.add(cp)
    for table, found in ((_LETTERS_SINCE_14, letters), (_NUMBERS_SINCE_14, numbers)):
        for first, last in table:
            found.update(range(first, last + 1))

    def ranges(code_points):  # {65, 66, 67, 97} -> r"\U00000041-\U00000043\U00000061-\U00000061"
        spans = []
        for cp in sorted(code_points):
            if spans and spans[-1][1] == cp - 1:
                spans[-1][1] = cp
            else:
                spans.append([cp, cp])
        return "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in spans)

    return ranges(letters), ranges(numbers), _WHITE_SPACE



# ----------------------------------------------------------------------------------------------
# The tour
# ----------------------------------------------------------------------------------------------

def show_text_as_numbers(story, args):
    """Chapter 4: BPE trained here, plain and incremental; GPT-2's BPE from scratch against
    tiktoken; the first batch of the data loader. Returns the GPT-2 Encoding."""
    print("== 4. Text as numbers ==")
    text = story.read_text(encoding="utf-8")
    t0 = time.time()
    simple = BPETokenizer.train_simple(text, args.vocab)
    t1 = time.time()
    bpe = BPETokenizer.train(text, args.vocab)
    t2 = time.time()
    ids = bpe.encode(text)
    print(f"BPE trained on The Verdict ({len(text):,} chars) to {args.vocab} tokens: the plain "
          f"algorithm in {t1 - t0:.2f}s, the incremental one in {t2 - t1:.2f}s, same merges: "
          f"{simple.ranks == bpe.ranks}")
    print(f"  {len(ids):,} tokens, {len(text.encode()) / len(ids):.2f} bytes/token; round trip "
          f"exact: {bpe.decode(ids) == text}")
    ours = BPETokenizer.gpt2(data_dir=args.data_dir)
    ref = gpt2_tokenizer(args.data_dir)
    sample = "Hello, world! It's 2024 -- naïve café 😀\n\n   <|endoftext|> next"
    a = ours.encode(sample, allowed_special={"<|endoftext|>"})
    b = ref.encode(sample, allowed_special={"<|endoftext|>"})
    print(f"GPT-2 BPE from scratch {a[:12]}... equals tiktoken: {a == b}; "
          f"whole story equal: {ours.encode(text) == ref.encode(text)}")
    token_ids = ref.encode(text)
    loader = create_dataloader(token_ids, batch_size=2, context_length=8, shuffle=False)
    x, y = next(iter(loader))
    print(f"{len(token_ids):,} GPT-2 tokens; first batch inputs {tuple(x.shape)}:\n{x}\n"
          f"targets (inputs shifted by one):\n{y}")
    return ref


def show_attention():
    """Chapter 5: plain self-attention, then the causal weights of a six-word sentence."""
    print("\n== 5. Attention ==")
    words = "Your journey starts with one step".split()
    emb = torch.randn(len(words), 3)                          # (T, C) toy embeddings
    print(f"plain self-attention output (T, C) = {tuple(simple_self_attention(emb).shape)}")
    causal = CausalAttention(3, 2, context_length=len(words))
    weights = torch.softmax(causal.scores(emb[None]).masked_fill(
        ~causal.mask, float("-inf")), dim=-1)[0]
    print("causal attention weights (row t attends to tokens 0..t):")
    for word, row in zip(words, weights):
        print(f"  {word:>8} " + " ".join(f"{w:.2f}" for w in row.tolist()))


def show_gpt(size, tokenizer):
    """Chapter 6: a GPT-2 shape with random weights, its size, and its greedy continuation."""
    print("\n== 6. GPT ==")
    cfg = GPTConfig.gpt2(size)
    model = GPT(cfg).eval()
    n = model.num_params()
    print(f"GPT-2 {size}: {cfg}\n  {n / 1e6:.1f}M parameters "
          f"({model.num_params(non_embedding=True) / 1e6:.1f}M without position embeddings), "
          f"{n * 4 / 2**20:.0f} MiB in float32")
    prompt = "Hello, I am"
    out = generate_greedy(model, torch.tensor([tokenizer.encode(prompt)]), max_new_tokens=10)
    print(f"greedy continuation of {prompt!r} from the untrained model: "
          f"{tokenizer.decode(out[0].tolist())!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="124M", choices=list(GPT2_SIZES),
                        help="GPT-2 shape to build (random weights)")
    parser.add_argument("--vocab", type=int, default=400, help="vocabulary of the BPE trained here")
    parser.add_argument("--data-dir", default=None, help="download cache (default: data/)")
    parser.add_argument("--seed", type=int, default=123, help="seed of the random weights")
    args = parser.parse_args()
    if args.vocab < 257:
        parser.error(f"--vocab {args.vocab}: needs at least 256 bytes + 1 special token")
    torch.manual_seed(args.seed)
    # every file this run reads, fetched before any work: a missing one stops it at once
    story, _ = fetch([data_entry(name, args.data_dir)
                      for name in ("the-verdict.txt", "gpt2.tiktoken")])
    tokenizer = show_text_as_numbers(story, args)
    show_attention()
    show_gpt(args.size, tokenizer)


if __name__ == "__main__":
    try:
        main()
    except DataError as e:  # a missing or broken file: the message says which and what to do
        sys.exit(f"error: {e}")
