"""Stage 08: an OpenAI-compatible server on the stage-07 engine (book chapters 35-37). The text
boundary (incremental detokenization and stop strings); an HTTP server that any OpenAI client
uses unchanged, in a process of its own beside the engine's; speculative decoding across
concurrent requests.

    python 08_serve.py               # a tiny random Qwen3 served, sent a few requests, stopped
    python 08_serve.py --model Qwen/Qwen3-0.6B --api-key KEY --speculative ngram
    python 08_serve.py --bench       # on a GPU: the server under concurrent streaming clients
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hello!"}], "stream": true}'

New since stage 07: chapters 35-37, after stage 07's parts. Changed: a server's steps (prompts
arriving beside the decodes) replay CUDA graphs too (StepGraphs, captured ahead by
ModelRunner.warm_up), for which the paged prefill kernel's grid comes from the packed tokens and
forward_packed may stop before the output layer; EngineConfig.prefill_first (on in the server):
a step with prompt tokens to run runs those only; the command line serves a model. Dropped, and
kept in stage 07: its benches but for their harness, and main's demonstrations.

The stage's own parts (stage 07's header maps the engine's):
    35      the text boundary: ids to text, stop strings      Detokenizer
    36      requests, checked against the OpenAI API          generation_request
    36      two processes: the engine thread, the HTTP side   EngineThread, EngineLink
    36      metrics, in Prometheus' format                    Metrics
    36      HTTP: routes, streams, the chat page              Handler, Delivery, CHAT_PAGE
    36      the server, started and stopped                   serve, Server
    37      batched speculation (stage 07's, across requests) load_llm
    36, 44  the serving bench                                 bench_serve
            the demo and main                                 demo, main
"""

import argparse
import base64
import bisect
import codecs
import contextlib
import dataclasses
import functools
import hashlib
import heapq
import hmac
import http.client
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unicodedata
import urllib.parse
import uuid
import warnings
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import requests
import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

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
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRET = tl.constexpr(INTERPRET)  # kernels can read module globals only when they are constexpr
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the kernels take
LOG = logging.getLogger(Path(__file__).stem)  # the library logs; main() prints
# The kernels' input checks (_check_tensor) and the interpreter patch are plumbing, at the end.


# ----------------------------------------------------------------------------------------------
# Chapter 17. Qwen3: the configuration
# ----------------------------------------------------------------------------------------------
# NEW in stage 07: the model the rest of the book serves.
#
# Legend for the model and the engine: B sequences in a batch, T tokens each in this step, S
# positions of keys and values, C the hidden size, Hq query heads and Hkv key/value heads of D
# values each (GQA: G = Hq / Hkv query heads read one kv head), V the vocabulary, L layers.

@dataclass
class Qwen3Config:
    """The shape of a dense Qwen3; the defaults are Qwen3-0.6B's."""
    vocab_size: int = 151936  # V, the rows of the embedding: more than the tokenizer's 151,669
    hidden_size: int = 1024  # C
    intermediate_size: int = 3072  # the MLP's hidden width
    num_hidden_layers: int = 28  # L
    num_attention_heads: int = 16  # Hq
    num_key_value_heads: int = 8  # Hkv, a divisor of Hq
    head_dim: int = 128  # D: Qwen3 sets it apart from C / Hq (0.6B: 16 x 128 = 2,048 > 1,024)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # RoPE's base: pair i of a head turns at theta^(-2i/D)
    max_position_embeddings: int = 40960  # the longest sequence it was trained for
    tie_word_embeddings: bool = True  # the output layer reuses the embedding matrix

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Qwen3Config.{name} = {value!r} must be a positive int")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                    or not 0 < value < math.inf):
                raise ValueError(f"Qwen3Config.{name} = {value!r} must be a positive number")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"Qwen3Config: num_attention_heads ({self.num_attention_heads}) "
                             f"must be a multiple of num_key_value_heads "
                             f"({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Config.head_dim = {self.head_dim} must be even "
                             f"(RoPE turns pairs)")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"Qwen3Config.tie_word_embeddings = {self.tie_word_embeddings!r} "
                             f"must be a bool")

    @classmethod
    def tiny(cls):
        """Two layers: main's model on a CPU. Untied, since random tied embeddings repeat the last
        token; V = 8,256 rows hold demo_tokenizer's 8,197 ids and spare ones, as Qwen3's do."""
        return cls(vocab_size=8256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   max_position_embeddings=256, tie_word_embeddings=False)

    @classmethod
    def from_json(cls, path):
        """The config of a Hugging Face config.json. What this model does not implement (another
        architecture, RoPE scaling, sliding windows, biases) is an error naming the key."""
        # required: transformers' defaults for these (head_dim 128, 32 kv heads) fit no model
        shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim")
        hf = read_hf_config(path, shape)
        _check_supported(hf, path)
        values = {name: hf[name] for name in shape}
        # optional, with transformers' defaults
        values["rms_norm_eps"] = hf.get("rms_norm_eps", 1e-6)
        values["max_position_embeddings"] = hf.get("max_position_embeddings", 32768)
        values["tie_word_embeddings"] = hf.get("tie_word_embeddings", False)
        values["rope_theta"] = _rope_theta(hf, path)
        return config_from(cls, values, path)

    def to_hf(self):
        """This config as a Hugging Face config.json dict (transformers v5 spelling)."""
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings")
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                "attention_bias": False, **{key: getattr(self, key) for key in keys},
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta}}


def _rope_theta(hf, path):
    """RoPE's base from transformers v5's `rope_parameters` or the older top-level `rope_theta`.
    Only plain RoPE is implemented: a scaled variant (yarn, linear, dynamic, ...) is an error."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is None:
            continue
        if not isinstance(value, dict):
            raise DataError(f"{path}: {key} must be an object, got {value!r}")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind != "default":
            raise DataError(f"{path}: {key} asks for RoPE type {kind!r}; this stage implements "
                            f"plain RoPE only (remove it to run at the original context length)")
        if value.get("partial_rotary_factor", 1.0) != 1.0:
            raise DataError(f"{path}: {key} rotates part of each head only; this stage rotates all")
    if params is not None and "rope_theta" in params:
        return params["rope_theta"]
    return hf.get("rope_theta", 10000.0)


def _check_supported(hf, path):
    """Refuse what the dense Qwen3 below does not compute, naming the key."""
    refused = [
        ("model_type", hf.get("model_type", "qwen3") != "qwen3", "a dense Qwen3 is 'qwen3'"),
        ("hidden_act", hf.get("hidden_act", "silu") != "silu", "the MLP is SwiGLU (silu)"),
        ("attention_bias", bool(hf.get("attention_bias")), "the projections have no bias"),
        ("use_sliding_window", bool(hf.get("use_sliding_window")), "attention is full"),
        ("layer_types", any(kind != "full_attention" for kind in hf.get("layer_types") or ()),
         "every layer is full attention"),
        ("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0) != 1.0,
         "RoPE turns every pair of a head"),
    ]
    for key, bad, why in refused:
        if bad:
            raise DataError(f"{path}: {key} = {hf[key]!r} is not supported ({why})")


# ----------------------------------------------------------------------------------------------
# Chapter 17. Qwen3: the weights
# ----------------------------------------------------------------------------------------------
# A Hugging Face model directory holds config.json and model.safetensors, or shards named by
# model.safetensors.index.json. Loading into a randomly initialized model holds the weights twice
# (the model and the state dict). Here the model is built on the meta device (shapes only), each
# tensor goes from the memory-mapped file straight to its device and dtype, and
# `load_state_dict(assign=True)` keeps it as it is: one tensor in flight at a time.

HF_URL = "https://huggingface.co/{repo}/resolve/main/{file}"
WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
# what a Hub download fetches besides the weights (the tokenizer's files are for chapter 16)
HUB_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}  # float64: for checks only


def config_from(cls, values, source):
    """cls(**values), with any bad or missing field reported against the file it came from."""
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise DataError(f"{source}: bad {cls.__name__} ({e})") from None


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


def model_folder(model, data_dir=None):
    """The directory of `model`: a local Hugging Face directory as given, or a Hub id such as
    "Qwen/Qwen3-0.6B", downloaded on first use into <data dir>/hub/<id>."""
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists() or not HUB_ID.fullmatch(str(model)):
        raise DataError(f"{model}: neither a model directory (config.json and weights) nor a "
                        f"Hugging Face Hub id such as Qwen/Qwen3-0.6B")
    return download_model(str(model), data_dir)


def download_model(repo, data_dir=None, timeout=30.0):
    """Fetch a Hub model's config, tokenizer files and weights into <data dir>/hub/<repo> through
    `download` (resume, the sha256 of X-Linked-Etag); return the folder. Files there are kept."""
    folder = _data_dir(data_dir) / "hub" / repo
    weights = _hub_weight_files(repo, folder, timeout)
    fetch([(HF_URL.format(repo=repo, file=name), folder / name, None)
           for name in (*HUB_FILES, *weights)])
    return folder


def _hub_weight_files(repo, folder, timeout):
    """The weight files of a Hub model: its index and the shards it lists, or model.safetensors
    when asking for the index gets a 404."""
    if not (folder / WEIGHTS_INDEX).is_file() and not (folder / WEIGHTS).is_file():
        url = HF_URL.format(repo=repo, file=WEIGHTS_INDEX)
        try:
            response = requests.get(url, timeout=timeout, stream=True)
            response.close()
        except requests.RequestException as e:
            raise DataError(
                f"{repo} cannot be downloaded ({type(e).__name__}: no network?). Place these "
                f"files from https://huggingface.co/{repo}/tree/main in {folder}: "
                f"{', '.join(HUB_FILES)}, and {WEIGHTS} (or {WEIGHTS_INDEX} with the shards it "
                f"lists); or pass the directory that holds them instead of the Hub id") from None
        if response.status_code == 404:
            return [WEIGHTS]
        if response.status_code != 200:
            raise DataError(f"{url} answered {response.status_code} {response.reason}")
        download(url, folder / WEIGHTS_INDEX, timeout=timeout)
    if not (folder / WEIGHTS_INDEX).is_file():
        return [WEIGHTS]
    return [WEIGHTS_INDEX, *sorted(set(_weight_map(folder).values()))]


@contextlib.contextmanager
def _open_safetensors(path):
    """safe_open on `path` (memory-mapped), a missing or unreadable file a DataError naming it."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        f = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError has no public base class to catch
        raise DataError(f"{path}: not a readable safetensors file ({e})") from None
    with f:
        yield f


def _weight_map(folder):
    """tensor name -> the file of `folder` that holds it."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        weight_map = read_hf_config(index, ("weight_map",))["weight_map"]
        if not isinstance(weight_map, dict) or not all(
                isinstance(file, str) and "/" not in file for file in weight_map.values()):
            raise DataError(f"{index}: weight_map must map tensor names to file names")
        return dict(weight_map)
    if (folder / WEIGHTS).is_file():
        with _open_safetensors(folder / WEIGHTS) as f:
            return dict.fromkeys(f.keys(), WEIGHTS)
    raise DataError(f"{folder} has neither {WEIGHTS} nor {WEIGHTS_INDEX}")


def read_weights(folder, expected, device, dtype):
    """{name: tensor} for each of `expected` ({name: meta tensor}), read once, straight to
    `device` and `dtype`; a missing, unexpected or misshapen tensor is a DataError naming it."""
    where = _weight_map(folder)
    # tied, but the checkpoint stores the head as well: checked below to be the embedding
    stored_head = "lm_head.weight" not in expected and where.pop("lm_head.weight", None)
    missing, unexpected = sorted(set(expected) - set(where)), sorted(set(where) - set(expected))
    if missing or unexpected:
        raise DataError(f"{folder}: the weights do not match config.json: missing tensors "
                        f"{missing[:5]}, unexpected tensors {unexpected[:5]}")
    state = {}
    for file in sorted(set(where.values())):
        with _open_safetensors(folder / file) as f:
            stored = set(f.keys())
            for name in sorted(name for name, held_in in where.items() if held_in == file):
                if name not in stored:
                    raise DataError(f"{folder / file} lacks {name!r}, which {WEIGHTS_INDEX} "
                                    f"places there")
                shape = tuple(f.get_slice(name).get_shape())  # from the header: nothing read yet
                if shape != tuple(expected[name].shape):
                    raise DataError(f"{folder / file}: tensor {name!r} has shape {shape}; "
                                    f"config.json implies {tuple(expected[name].shape)}")
                state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    if stored_head:
        with _open_safetensors(folder / stored_head) as f:
            head = f.get_tensor("lm_head.weight").to(device=device, dtype=dtype)
        if not torch.equal(head, state["model.embed_tokens.weight"]):
            raise DataError(f"{folder}: config.json ties the output layer to the embedding, but "
                            f"the stored lm_head.weight differs from model.embed_tokens.weight")
    return state


def _resolve_device_dtype(folder, device, dtype):
    """device: as given, else CUDA when there is one. dtype: as given, else the checkpoint's own
    on a GPU (Qwen3 ships bf16) and float32 on a CPU, where bf16 matmuls are slow."""
    device = torch.device(device if device is not None
                          else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device}: this stage runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: this machine has no CUDA GPU")
    if dtype is None and device.type == "cuda":
        hf = read_hf_config(folder / "config.json", ())
        name = str(hf.get("dtype") or hf.get("torch_dtype") or "bfloat16")
        if name not in MODEL_DTYPES:
            raise DataError(f"{folder / 'config.json'}: dtype {name!r} is not one of "
                            f"{list(MODEL_DTYPES)}")
        dtype = MODEL_DTYPES[name]
    dtype = dtype or torch.float32
    if dtype not in MODEL_DTYPES.values():
        raise ValueError(f"dtype {dtype} is not supported; use one of {list(MODEL_DTYPES)}")
    return device, dtype


def load_qwen3(model_dir, device=None, dtype=None, data_dir=None):
    """Qwen3 in eval mode from a Hugging Face directory or a Hub id (downloaded on first use).
    device and dtype: see _resolve_device_dtype. The Triton kernels are on for CUDA."""
    folder = model_folder(model_dir, data_dir)
    cfg = Qwen3Config.from_json(folder / "config.json")
    device, dtype = _resolve_device_dtype(folder, device, dtype)
    with torch.device("meta"):
        model = Qwen3(cfg)  # shapes only
    state = read_weights(folder, model.state_dict(), device, dtype)
    model.load_state_dict(state, assign=True)  # the tensors just read become the parameters
    model.inv_freq = model.inv_freq.to(device)  # RoPE's frequencies: computed, not stored
    return model.use_kernels(device.type == "cuda").eval()


def save_qwen3(model, folder):
    """Write `model` as a Hugging Face directory that load_qwen3 and transformers read."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps({**model.cfg.to_hf(), "dtype": dtype}, indent=2))
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})
    return folder


# ----------------------------------------------------------------------------------------------
# Chapter 17. Qwen3's tokenizer and chat format
# ----------------------------------------------------------------------------------------------
# NEW in stage 07: the tokenizer of a Hugging Face model directory, on tiktoken.
#
# Qwen3's tokenizer is GPT-2's byte-level BPE (chapter 4), written as tokenizer.json: model.vocab
# (token -> id, each byte spelled as a printable character: a space is "Ġ"), model.merges (the
# learned pairs, first learned first), a normalizer (Qwen: NFC), the pre-tokenizer's regex, and
# added tokens (<|im_start|>, <think>, ...) matched whole before BPE ("special": decode may skip).
# tiktoken merges the pair whose joined bytes have the lowest id, tokenizers the pair learned
# first. In a vocabulary learned by BPE a token's id is the step that made it, so the two orders
# agree: the vocabulary is tiktoken's ranks, and encoding runs in tiktoken's Rust. load_tokenizer
# checks that order and refuses what tiktoken cannot represent; added tokens are matched here, in
# Python, the longest at a place, as tokenizers matches them.

# GPT-2's pre-tokenizer: what tokenizers' ByteLevel pre-tokenizer applies when its use_regex is on.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@functools.cache
def byte_level_alphabet():
    """GPT-2's byte <-> character map as {character: byte}: the 188 printable bytes stand for
    themselves, the other 68 (controls, space, 0x7F-0xA0, 0xAD) for chr(256), chr(257), ..."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


def _optional_json(path):
    """A JSON object from `path`, {} when the file is absent."""
    return read_hf_config(path, ()) if path.is_file() else {}


def _split_pattern(spec, source):
    """The regex that cuts normalized text into BPE's chunks, for tiktoken. The file's regex is
    Oniguruma's (tokenizers'); Qwen's reads the same in tiktoken's fancy-regex."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("add_prefix_space"):
        raise DataError(f"{source}: pre-tokenizer {pre} is not byte-level BPE's (a ByteLevel "
                        "step, without add_prefix_space, last)")
    *splits, byte_level = steps
    use_regex = byte_level.get("use_regex", True)  # tokenizers' default
    if not splits and use_regex:
        return GPT2_PATTERN
    split = splits[0] if len(splits) == 1 and not use_regex else {}
    regex = split.get("pattern", {}).get("Regex")
    if not (split.get("type") == "Split" and regex is not None
            and split.get("behavior") == "Isolated" and not split.get("invert")):
        raise DataError(f"{source}: pre-tokenizer {pre} is not supported: expected ByteLevel "
                        "alone, or Split(Regex, Isolated) then ByteLevel(use_regex false)")
    # tokenizers keeps the text between two matches as a chunk, tiktoken drops it: the second
    # alternative takes such a stretch (never with Qwen's regex, which matches everything)
    return f"(?:{regex})|(?:(?!{regex})[\\s\\S])+"


def _as_is(text):  # (a named function, not a lambda: a tokenizer pickles, for 08's server)
    return text


def _normalizer(spec, source):
    """What the tokenizer applies to text before splitting it: nothing, or NFC (Python's tables
    are newer than tokenizers': marks assigned since Unicode 10 may be ordered differently)."""
    normalizer = spec.get("normalizer")
    if normalizer is None:
        return _as_is
    if normalizer.get("type") == "NFC":
        return functools.partial(unicodedata.normalize, "NFC")
    raise DataError(f"{source}: normalizer {normalizer} is not supported (only none or NFC)")


def _check_byte_level_bpe(spec, source):
    """Refuse what is not byte-level BPE: tiktoken could not encode it as tokenizers does."""
    model = spec["model"] if isinstance(spec["model"], dict) else {}
    if model.get("type") != "BPE":
        raise DataError(f"{source}: model type {model.get('type')!r} is not byte-level BPE")
    if not isinstance(model.get("vocab"), dict) or not isinstance(model.get("merges"), list):
        raise DataError(f"{source}: a BPE model needs a vocab (an object) and merges (a list)")
    options = {k: model.get(k) for k in ("byte_fallback", "dropout", "continuing_subword_prefix",
                                         "end_of_word_suffix")}
    if any(options.values()):
        raise DataError(f"{source}: BPE with {options} is not byte-level BPE")
    for part in ("decoder", "post_processor"):
        kind = (spec.get(part) or {}).get("type")
        if kind != "ByteLevel" and (part == "decoder" or kind is not None):
            raise DataError(f"{source}: {part} {kind!r} is not supported (byte-level BPE has "
                            "ByteLevel)")


def _bpe_ranks(model, added_ids, source):
    """(ranks, vocab_bytes) of a BPE vocabulary and merges: ranks {bytes: id}, tiktoken's, holds
    the 256 single bytes and each token a merge makes; vocab_bytes {id: bytes} every token, for
    decoding. A token no merge makes stays out of the ranks: BPE can never produce it."""
    alphabet = byte_level_alphabet()
    vocab = model["vocab"]
    vocab_bytes = {}
    for token, token_id in vocab.items():
        if all(c in alphabet for c in token):
            vocab_bytes[token_id] = bytes(alphabet[c] for c in token)
        elif token_id not in added_ids:  # an added token has its own rule (see load_tokenizer)
            raise DataError(f"{source}: vocabulary token {token!r} is not written in byte-level "
                            "characters, so this is not byte-level BPE")
    singles = {b: i for i, b in vocab_bytes.items() if len(b) == 1}
    if len(singles) < 256:
        raise DataError(f"{source}: the vocabulary has {len(singles)} of the 256 single bytes; "
                        "byte-level BPE needs all of them")
    ranks, last = singles, -1
    for n, merge in enumerate(model["merges"]):
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token_id = vocab.get(left + right)
        if token_id is None or left not in vocab or right not in vocab:
            raise DataError(f"{source}: merge {n} ({left!r} + {right!r}) uses or makes a token "
                            "that is not in the vocabulary")
        if token_id <= last:
            raise DataError(f"{source}: merge {n} makes id {token_id}, after a merge made id "
                            f"{last}; tiktoken merges in id order, so it cannot encode this BPE")
        ranks[vocab_bytes[token_id]], last = token_id, token_id
    return ranks, vocab_bytes


def _added_tokens(spec, source):
    """tokenizer.json's added tokens as {content: (id, special, normalized)}."""
    added = {}
    for entry in spec.get("added_tokens", []):
        flags = [k for k in ("lstrip", "rstrip", "single_word") if entry.get(k)]
        if flags:
            raise DataError(f"{source}: added token {entry['content']!r} sets {flags}, which this "
                            "loader does not implement")
        special = entry.get("special", False)  # tokenizers' defaults where a file omits them
        added[entry["content"]] = (entry["id"], special, entry.get("normalized", not special))
    return added


def _chat_template(model_dir, tok_config):
    """The chat template the directory declares, None for a base model. Transformers v5 writes it
    to chat_template.jinja, older versions into tokenizer_config.json."""
    path = model_dir / "chat_template.jinja"
    template = path.read_text("utf-8") if path.is_file() else tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def config_eos_token_ids(folder):
    """The ids that config.json and generation_config.json (each optional) name as eos_token_id
    (an int or a list of ints, or null), as a set."""
    ids = set()
    for name in ("config.json", "generation_config.json"):
        value = _optional_json(folder / name).get("eos_token_id")
        values = value if isinstance(value, list) else [] if value is None else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise DataError(f"{folder / name}: eos_token_id must be an id or a list of ids, "
                            f"got {value!r}")
        ids.update(values)
    return ids


def _eos_token_ids(model_dir, tok_config, token_id):
    """The eos ids that config.json, generation_config.json and tokenizer_config.json name, all
    of them: Qwen3 ends a turn with <|im_end|> but may emit <|endoftext|>, and each names some."""
    ids = config_eos_token_ids(model_dir)
    token = tok_config.get("eos_token")
    if isinstance(token, dict):  # an AddedToken written out in full
        token = token.get("content")
    if token is not None:
        if token not in token_id:
            raise DataError(f"{model_dir / 'tokenizer_config.json'}: eos_token {token!r} is not "
                            "a token of tokenizer.json")
        ids.add(token_id[token])
    return frozenset(ids)


def load_tokenizer(model_dir):
    """The Tokenizer of a Hugging Face model directory: tokenizer.json on tiktoken, with the eos
    ids and chat template the directory's other (optional) files declare."""
    model_dir = Path(model_dir)
    source = model_dir / "tokenizer.json"
    if not source.is_file():
        raise DataError(f"{source} not found: a Hugging Face model directory holds its tokenizer "
                        "there")
    spec = read_hf_config(source, ("model",))
    _check_byte_level_bpe(spec, source)
    added = _added_tokens(spec, source)
    ranks, vocab_bytes = _bpe_ranks(spec["model"], {i for i, _, _ in added.values()}, source)
    pattern = _split_pattern(spec, source)
    try:
        bpe = tiktoken.Encoding(name=model_dir.name or "tokenizer", pat_str=pattern,
                                mergeable_ranks=ranks, special_tokens={})
    except ValueError as e:  # a regex in a syntax tiktoken's engine (fancy-regex) does not read
        raise DataError(f"{source}: tiktoken cannot use the pre-tokenizer regex {pattern!r} "
                        f"({e})") from None
    # an added token decodes as tokenizers' ByteLevel decoder does: through the byte map when all
    # its characters are in it, as its UTF-8 otherwise
    alphabet = byte_level_alphabet()
    for content, (token_id, _, _) in added.items():
        in_map = all(c in alphabet for c in content)
        vocab_bytes[token_id] = bytes(alphabet[c] for c in content) if in_map else content.encode()
    token_bytes = [vocab_bytes.get(i, b"") for i in range(max(vocab_bytes) + 1)]
    tok_config = _optional_json(model_dir / "tokenizer_config.json")
    token_id = {**spec["model"]["vocab"], **{c: i for c, (i, _, _) in added.items()}}
    return Tokenizer(bpe, token_bytes, added, _normalizer(spec, source),
                     _eos_token_ids(model_dir, tok_config, token_id),
                     _chat_template(model_dir, tok_config))


def _one_piece(text):  # (named, not a lambda: see _as_is)
    return [text]


class Tokenizer:
    """Text <-> ids, the same ids as Hugging Face tokenizers' on every text. Built by
    load_tokenizer from bpe (tiktoken's Encoding of the BPE alone), token_bytes (id -> bytes, b""
    where undefined), added ({content: (id, special, normalized)}: matched whole before BPE,
    normalized ones in the normalized text), normalize, eos_token_ids (they end generation) and
    chat_template (the Jinja template, only checked to be Qwen3's; None for a base model)."""

    def __init__(self, bpe, token_bytes, added, normalize, eos_token_ids, chat_template):
        self.bpe, self.token_bytes, self.normalize = bpe, token_bytes, normalize
        self.eos_token_ids, self.chat_template = frozenset(eos_token_ids), chat_template
        self.special_ids = frozenset(i for i, special, _ in added.values() if special)
        self._added_id = {content: i for content, (i, _, _) in added.items()}
        self._raw = self._splitter([c for c, (_, _, norm) in added.items() if not norm])
        self._normalized = self._splitter([c for c, (_, _, norm) in added.items() if norm])

    @staticmethod
    def _splitter(tokens):
        """A function that cuts text at these tokens into [text, token, text, ..., text], the
        longest winning at one position, as in tokenizers."""
        if not tokens:
            return _one_piece
        alternation = "|".join(map(re.escape, sorted(tokens, key=len, reverse=True)))
        return re.compile(f"({alternation})").split  # the group keeps the tokens in the list

    def encode(self, text):
        """The ids of `text`, added tokens included, special or not (so the chat format's control
        tokens encode). Lone surrogates become U+FFFD, as in tiktoken."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        ids = []
        for k, raw in enumerate(self._raw(text)):  # odd pieces are added tokens
            if k % 2:
                ids.append(self._added_id[raw])
                continue
            for j, piece in enumerate(self._normalized(self.normalize(raw))):
                ids.extend([self._added_id[piece]] if j % 2 else self.bpe.encode_ordinary(piece))
        return ids

    def decode_bytes(self, ids, skip_special_tokens=False):
        """The bytes `ids` spell; ids the tokenizer does not define (the model scores more ids
        than the tokenizer has) decode to nothing."""
        table, n = self.token_bytes, len(self.token_bytes)
        skip = self.special_ids if skip_special_tokens else ()
        return b"".join(table[i] for i in ids if 0 <= i < n and i not in skip)

    def decode(self, ids, skip_special_tokens=False):
        """The text of `ids`, decoded from all their bytes at once (a token may hold part of a
        character); bytes that are not UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, enable_thinking=True):
        """Qwen3's chat format as text (`encode` it for the ids, as transformers does):
            <|im_start|>system\\n{content}<|im_end|>\\n     (the same for user turns)
            <|im_start|>assistant\\n{content}<|im_end|>\\n
            <|im_start|>assistant\\n                       (the generation prompt)
        messages: dicts with "role" (system, user or assistant) and "content" (str); an assistant
            turn's reasoning (its "reasoning_content", else the <think>...</think> in its content)
            shows only after the last user query. enable_thinking=False appends an empty think
            block to the generation prompt: answer without reasoning."""
        if self.chat_template is None:
            raise ValueError("this is a base model (no chat template in its tokenizer_config.json "
                             "or chat_template.jinja): give it plain text, not chat messages")
        if not ("<|im_start|>" in self.chat_template and "enable_thinking" in self.chat_template):
            raise ValueError("this model's chat template is not Qwen3's (ChatML turns and the "
                             "enable_thinking switch), the one chat format written here")
        if not isinstance(add_generation_prompt, bool) or not isinstance(enable_thinking, bool):
            raise TypeError("add_generation_prompt and enable_thinking must be True or False")
        _check_messages(messages)
        # the last query: the last user turn that is not a tool result passed back
        last_query, turns = len(messages) - 1, []
        for i, message in enumerate(messages):
            text = message["content"]
            if message["role"] == "user" and not (text.startswith("<tool_response>")
                                                  and text.endswith("</tool_response>")):
                last_query = i
        for i, message in enumerate(messages):
            content = message["content"]
            if message["role"] == "assistant":
                content = _assistant_text(message, i > last_query, i == len(messages) - 1)
            turns.append(f"<|im_start|>{message['role']}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            turns.append("<|im_start|>assistant\n" + ("" if enable_thinking else
                                                      "<think>\n\n</think>\n\n"))
        return "".join(turns)


def _check_messages(messages):
    """Chat messages must be what the template renders: Qwen3's tool turns are not written here."""
    if not messages:
        raise ValueError("messages is empty")
    for n, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"message {n} must be a dict with a str 'content', got {message!r}")
        if message.get("role") not in ("system", "user", "assistant"):
            raise ValueError(f"message {n}: role {message.get('role')!r} is not system, user or "
                             "assistant (tool turns are not supported)")
        if "tool_calls" in message:
            raise ValueError(f"message {n}: tool_calls are not supported")
        if not isinstance(message.get("reasoning_content", ""), (str, type(None))):
            raise ValueError(f"message {n}: reasoning_content must be a str")


def _assistant_text(message, after_last_query, is_last):
    """An assistant turn's text: its reasoning in a think block only after the last query (in
    the last turn, an empty block when there was none)."""
    content, reasoning = message["content"], message.get("reasoning_content")
    if reasoning is None:
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    if after_last_query and (is_last or reasoning):
        reasoning, content = reasoning.strip("\n"), content.lstrip("\n")
        return f"<think>\n{reasoning}\n</think>\n\n{content}"
    return content


# The other way, for a tokenizer that exists only as tiktoken ranks (main's demo uses GPT-2's).

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


def _bpe_parts(token, ranks, below):
    """The pieces BPE makes of `token`'s bytes with the merges of rank < below only, lowest rank
    first (tiktoken's rule)."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, below), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank >= below:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def byte_level_bpe_json(ranks, added):
    """A tiktoken BPE with GPT-2's pre-tokenizer as a tokenizer.json dict: the inverse of
    load_tokenizer. added: (id, content, special) of each added token. Ranks store no merges: a
    token's merge is the two pieces BPE makes of its bytes with the lower ranks alone."""
    to_char = {b: c for c, b in byte_level_alphabet().items()}

    def spell(data):
        return "".join(to_char[b] for b in data)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            parts = _bpe_parts(token, ranks, rank)
            if len(parts) != 2:
                raise DataError(f"token {token!r} (rank {rank}) is no merge of two lower ranks")
            merges.append([spell(parts[0]), spell(parts[1])])
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    # tokenizers' defaults are byte-level BPE's; an added token must spell out all its flags
    return {"version": "1.0", "normalizer": None, "pre_tokenizer": byte_level,
            "decoder": byte_level,
            "added_tokens": [{"id": i, "content": content, "special": special, "normalized": False,
                              "single_word": False, "lstrip": False, "rstrip": False}
                             for i, content, special in added],
            "model": {"type": "BPE", "vocab": {spell(token): rank for token, rank in ranks.items()},
                      "merges": merges}}


# ----------------------------------------------------------------------------------------------
# Chapter 17. Qwen3: the model, on its kernels
# ----------------------------------------------------------------------------------------------
# A Qwen3 block is Llama's plus one thing: x + attention(rmsnorm(x)), then x + mlp(rmsnorm(x)),
# where attention normalizes each query and key head with its own RMSNorm (q/k norm, which keeps
# the logits in range) before RoPE, and the MLP is SwiGLU. Every op rounds as transformers'
# Qwen3ForCausalLM does, so fp32 logits agree to 1e-4. On a GPU, RMSNorm, SwiGLU and attention
# run on the Triton kernels of stages 05 and 06 (forward only); each has a torch twin that runs
# everywhere and checks them (`Qwen3.use_kernels`).

# ------------------------------------------------------------------------------------------------
# 17.1 RMSNorm
# ------------------------------------------------------------------------------------------------
# RMSNorm y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps): the kernel reads x and writes y
# once, a row a program (a Qwen3 row, 128 to 5,120 values, fits in registers, so stage 05's loop
# over wide rows is gone). ADD fuses the residual add in front (chapter 19).

@triton.jit
def _rms_norm_kernel(X, R, W, Y, eps, N: tl.constexpr, BLOCK_N: tl.constexpr, ADD: tl.constexpr):
    # ADD: x += r first, rounded to x's dtype as torch rounds it and written back (x is the
    # residual stream); then y = x * rstd * w in fp32, rounded once
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0)
    if ADD:
        r = tl.load(R + row * N + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(X + row * N + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


def _launch_rms_norm(x, residual, weight, eps):
    n_rows, n = x.view(-1, x.shape[-1]).shape
    y = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(n_rows,)](x, residual, weight, y, eps, N=n, BLOCK_N=block,
                                ADD=residual is not None, num_warps=min(16, max(1, block // 256)))
    return y


def _check_norm(x, weight, bias):
    _check_tensor("x", x, rows=True)
    _check_tensor("weight", weight, device=x.device)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected ({x.shape[-1]},) for x {tuple(x.shape)}")
    if bias is not None:
        _check_tensor("bias", bias, device=x.device)
        if bias.shape != x.shape[-1:]:
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({x.shape[-1]},)")


def rms_norm(x, weight, eps=1e-6):  # changed in 07: forward only, a row a program
    """RMSNorm of x (..., N): x / sqrt(mean(x^2) + eps) * weight, weight (N,)."""
    _check_norm(x, weight, None)
    return _launch_rms_norm(x, None, weight, eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension. The torch twin rounds as transformers does (normalized in
    fp32, rounded, then scaled); the kernel rounds once, so in bf16 they differ by a rounding."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = False  # set by Qwen3.use_kernels

    def forward(self, x):
        if self.kernels:
            return rms_norm(x, self.weight, self.eps)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


# ------------------------------------------------------------------------------------------------
# 17.2 The SwiGLU MLP, on stage 05's elementwise kernel
# ------------------------------------------------------------------------------------------------
# The MLP is down(silu(gate(x)) * up(x)), silu(g) = g * sigmoid(g). As torch ops it writes
# silu(gate) and reads it back; the kernel reads gate and up once and writes the product once.

_ELEMENTWISE_BLOCK = 4096


@triton.jit
def _sigmoid(z):
    # below z = -88, exp(-z) overflows fp32: harmless on the GPU (1 / inf = 0), but the interpreter
    # warns; sigmoid(-80) = 2e-35 is as good as 0 for every use here
    return tl.sigmoid(tl.maximum(z, -80.0))


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(G + offs, mask=offs < n).to(tl.float32)
    u = tl.load(U + offs, mask=offs < n).to(tl.float32)
    tl.store(Y + offs, (g * _sigmoid(g) * u).to(Y.dtype.element_ty), mask=offs < n)


def _launch_elementwise(kernel, *tensors):
    n = tensors[0].numel()
    kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](*tensors, n, BLOCK=_ELEMENTWISE_BLOCK, num_warps=8)


def swiglu(gate, up):  # changed in 07: forward only
    """silu(gate) * up, elementwise; gate and up of one shape and dtype."""
    _check_tensor("gate", gate)
    _check_tensor("up", up, device=gate.device)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
                         f"{up.dtype} differ")
    y = torch.empty_like(gate)
    _launch_elementwise(_swiglu_fwd_kernel, gate, up, y)
    return y


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.kernels = False
        self.gate_up_weight = None  # gate|up weights in one tensor, for forward_packed

    def forward(self, x):  # x (B, T, C)
        gate, up = self.gate_proj(x), self.up_proj(x)  # (B, T, I) each
        return self.down_proj(swiglu(gate, up) if self.kernels else F.silu(gate) * up)


# ------------------------------------------------------------------------------------------------
# 17.3 Rotary position embeddings
# ------------------------------------------------------------------------------------------------
# RoPE rotates each query and key by position: pair i of a head turns by position *
# theta^(-2i/D), so a score depends on the difference of positions only. Qwen3 pairs value i with
# i + D/2 ("rotate half"). Angles stay fp32 until cos and sin: 40,000 radians in bf16 would be off
# by more than a turn.

def rope_inv_freq(cfg):
    """(D/2,) fp32: theta^(-2i/D), pair i's angle per position; on the CPU, as transformers
    computes it (pow's last bit may differ on another device)."""
    D = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32, device="cpu") / D))


def rope_cos_sin(inv_freq, positions, dtype):
    """cos and sin (B, T, D) of the angles of tokens at positions (B, T), rounded to `dtype`."""
    freqs = positions[..., None].float() * inv_freq  # (B, T, D/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (B, T, D): values i and i + D/2 share an angle
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x (B, H, T, D) with each pair (x_i, x_{i + D/2}) rotated by its angle; cos, sin (B, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (-x2, x1)
    return x * cos[:, None] + rotated * sin[:, None]


# ------------------------------------------------------------------------------------------------
# 17.4 Attention: stage 06's flash forward for the prefill, and the torch twin
# ------------------------------------------------------------------------------------------------
# A prefill attends causally over the prompt: stage 06's flash_attention forward, unchanged but
# for its autograd wrapper. Decoding attends one query a row over the cache, each row up to its
# own length: decode_attention below. The torch twin is transformers' eager attention (scores in
# the inputs' dtype, the softmax in fp32 rounded back).

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E)
HEAD_DIMS = (32, 64, 128, 256)


def _expand_kv(q, k, v):
    """Repeat each kv head for the G query heads that share it: (B, Hkv, S, D) -> (B, Hq, S, D)."""
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


# Stage 06's forward kernel (06 explains its tiles and descriptors; diff 06 against 07). Tiles
# move through tensor descriptors built on the host (_desc); O leaves by a masked store, since a
# host-built descriptor of O would need a reshape that does not compile. The warp-specialized
# tile, split between two consumer warpgroups, builds its own descriptors of q and O
# (_head_desc): there a host-built q hangs the kernel and a masked store writes wrong rows.
# Autotuned per sequence-length bucket (_seq_bucket): prompts of every length tune a few times.


def _seq_bucket(n):
    return min(max(triton.next_power_of_2(n), 128), 16384)


def _bench_or_skip(kernel_call, quantiles):
    """Autotuner timing that scores a configuration the compiler rejects as infinitely slow
    instead of ending the search. If every configuration
    fails, the launch that follows raises the compiler's error."""
    try:
        return triton.testing.do_bench(kernel_call, quantiles=quantiles)
    except triton.runtime.errors.OutOfResources:
        raise  # the autotuner skips these itself, quietly
    except Exception as err:  # noqa: BLE001 (any compile failure of one configuration)
        lines = str(err).strip().splitlines()
        warnings.warn(f"flash attention autotune: skipping a configuration "
                      f"({type(err).__name__}: {lines[0] if lines else ''})")
        return [float("inf")] * len(quantiles)


def _tile_rows(args):
    """The configurations' pre_hook, run before each launch: a descriptor (_desc) carries its
    tile's shape, and the kernel is compiled for it. Those of keys and values and their
    gradients take BLOCK_N rows a tile, those of queries, dO and dQ BLOCK_M."""
    for name, value in args.items():
        if isinstance(value, TensorDescriptor):
            key_side = name in ("k_desc", "v_desc", "dk_desc", "dv_desc")
            value.block_shape[2] = args["BLOCK_N" if key_side else "BLOCK_M"]


def _config(block_m, block_n, warps, stages, head_dims=(32, 64, 128), warp_specialize=False,
            float32_only=False):
    """A launch configuration, offered for the head sizes in head_dims only. warp_specialize
    (forward only): the key loop is warp-specialized, which only the one-loop path allows.
    float32_only: offered to float32 inputs only, which then get it alone (_prune_configs)."""
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n}
    if warp_specialize:
        meta["WARP_SPECIALIZE"] = True
    config = triton.Config(meta, num_warps=warps, num_stages=stages, pre_hook=_tile_rows)
    config.head_dims, config.float32_only = head_dims, float32_only
    return config


def _prune_configs(configs, named_args, **kwargs):
    """The configurations made for this head size, and the warp-specialized ones only for the
    forward's one-loop path (non-causal, S a multiple of 128). float32 inputs, there for checking
    rather than speed, get one configuration untuned (each of their compiles takes seconds): the
    float32_only one for this head size if there is one, else the first."""
    one_loop = not kwargs["CAUSAL"] and kwargs.get("EVEN_S", False)
    kept = [c for c in configs if kwargs["D"] in c.head_dims
            and (one_loop or not c.kwargs.get("WARP_SPECIALIZE", False))]
    if kwargs.get("DOT_PRECISION") == "tf32x3":  # float32 inputs (_dot_precision)
        return ([c for c in kept if c.float32_only] or kept)[:1]
    return [c for c in kept if not c.float32_only]


# Stage 06's tiles, each kept because it fits shared memory and spills (almost) no registers:
# 128 query rows on one warpgroup, 64 or 128 keys a step. The warp-specialized 128 x 128 tile (a
# producer warpgroup issues the K/V loads, two consumers do the math) serves only the one-loop
# path (non-causal, S a multiple of 128); float32 at D=256 gets a 32-row mma.sync tile alone.
_FWD_CONFIGS = (
    [_config(128, 128, 4, 2, (128,), warp_specialize=True)]
    + [_config(128, 64, 4, 2), _config(64, 64, 4, 3), _config(128, 128, 8, 3, (128,))]
    + [_config(64, 128, 4, 2, (32, 64)), _config(128, 128, 4, 3, (32, 64)),
       _config(128, 64, 4, 3, (32, 64))]
    + [_config(64, n, 8, 2, (256,)) for n in (32, 64)]
    + [_config(32, 32, 4, 2, (256,), float32_only=True)]
)
if INTERPRET:
    _FWD_CONFIGS = [_config(32, 16, 4, 1, HEAD_DIMS)]


@triton.jit
def _visible(i, j, T, S, CAUSAL: tl.constexpr):
    """Query i may attend key j: both inside their sequences, and j <= i + (S - T) if causal.
    i and j broadcast: (M, 1) and (1, N) give an (M, N) mask."""
    keep = (i < T) & (j < S)
    if CAUSAL:
        keep = keep & (j <= i + (S - T))
    return keep


@triton.jit
def _fwd_kv_loop(acc, m_i, l_i, q, k_desc, v_desc, b, kvh, lo, hi, offs_m, T, S, qk_scale,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 WARP_SPECIALIZE: tl.constexpr = False):
    """Online softmax over the key blocks [lo, hi) of kv head kvh of batch b, for one query
    block. m_i, l_i: running max and sum, base 2; acc (BLOCK_M, D): the unnormalized output.
    MASKED=False is for blocks where every query sees every key: no mask arithmetic, and one FMA
    per score."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([b, kvh, start_n, 0]).reshape([BLOCK_N, D])
        qk = tl.dot(q, k.T, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) raw scores
        if MASKED:
            keep = _visible(offs_m[:, None], (start_n + offs_n)[None, :], T, S, CAUSAL)
            s = tl.where(keep, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row with no visible key so far keeps m = -inf: subtract 0, so exp2 gives 0
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_sub[:, None])
        else:
            # the scale is positive, so it commutes with the max; qk * scale - m is one FMA
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_new
            p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = v_desc.load([b, kvh, start_n, 0]).reshape([BLOCK_N, D])
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# The forward's prologue: its program's query block and heads, and the keys it walks.
@triton.jit
def _query_block_program(Hq, GROUP, CAUSAL: tl.constexpr):
    """This program's query block and (batch, query head, kv head). Causal: later query blocks see
    more keys, so they start first and the short ones fill the last wave."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    return pid_m, pid_bh, b, h, h // GROUP


@triton.jit
def _head_desc(base, b, h, stride_b, stride_h, rows, stride_row, D: tl.constexpr,
               BLOCK: tl.constexpr):
    """Tensor descriptor of head h of batch b, a (rows, D) matrix read BLOCK rows at a time."""
    return tl.make_tensor_descriptor(base + b * stride_b + h * stride_h, shape=[rows, D],
                                     strides=[stride_row, 1], block_shape=[BLOCK, D])


@triton.jit
def _key_range(start_m, T, S, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(full, hi) for the query block at start_m: keys [0, full) are visible to every row of the
    block; [full, hi) need the mask (the diagonal and the ragged end of S); keys from hi on are
    visible to none and are skipped. full is a whole number of key blocks."""
    if CAUSAL:
        hi = tl.minimum(S, tl.maximum(start_m + BLOCK_M + (S - T), 0))
        full = tl.minimum(S, tl.maximum(start_m + 1 + (S - T), 0))
    else:
        hi = S
        full = S
    return full // BLOCK_N * BLOCK_N, hi


@triton.autotune(configs=_FWD_CONFIGS, key=["T_BUCKET", "S_BUCKET", "D", "CAUSAL", "EVEN_S"],
                 prune_configs_by={"early_config_prune": _prune_configs}, do_bench=_bench_or_skip)
@triton.jit(do_not_specialize=["T", "S"])
def _flash_fwd_kernel(Q, stride_qb, stride_qh, stride_qt, q_desc, k_desc, v_desc,
                      O, stride_ob, stride_oh, stride_ot, LSE2, qk_scale,
                      Hq, GROUP, T, S, T_BUCKET, S_BUCKET,
                      D: tl.constexpr, CAUSAL: tl.constexpr, EVEN_S: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      WARP_SPECIALIZE: tl.constexpr = False):
    """One program per (query block, batch * query head).
    Q, O (B, Hq, T, D): any strides, unit last stride; descriptors (_desc) of q, in tiles of
    BLOCK_M rows, and of k, v (B, Hkv, S, D), of BLOCK_N. LSE2 (B, Hq, T) float32:
    the log-sum-exp in base 2. qk_scale = sm_scale * log2(e). GROUP = Hq // Hkv: query head h
    reads kv head h // GROUP. EVEN_S: S is a multiple of 128, so without the causal mask
    no key block needs masking. T_BUCKET, S_BUCKET: autotune keys only. WARP_SPECIALIZE: the
    key loop is warp-specialized where there is one loop (see _FWD_CONFIGS)."""
    pid_m, pid_bh, b, h, kvh = _query_block_program(Hq, GROUP, CAUSAL)
    if WARP_SPECIALIZE:  # q and O through descriptors of the kernel's own: see above
        q_own = _head_desc(Q, b, h, stride_qb, stride_qh, T, stride_qt, D, BLOCK_M)
        o_own = _head_desc(O, b, h, stride_ob, stride_oh, T, stride_ot, D, BLOCK_M)
    else:
        o_head = O + b * stride_ob + h * stride_oh  # in int64, before the cast below
    b, h, kvh = b.to(tl.int32), h.to(tl.int32), kvh.to(tl.int32)  # a descriptor's coordinates
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if WARP_SPECIALIZE:
        q = q_own.load([start_m, 0])  # (BLOCK_M, D), stays on chip for the whole loop
    else:
        q = q_desc.load([b, h, start_m, 0]).reshape([BLOCK_M, D])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    full, hi = _key_range(start_m, T, S, CAUSAL, BLOCK_M, BLOCK_N)
    acc, m_i, l_i = _fwd_kv_loop(acc, m_i, l_i, q, k_desc, v_desc, b, kvh, 0, full, offs_m, T,
                                 S, qk_scale, D, BLOCK_N, CAUSAL, False, DOT_PRECISION,
                                 WARP_SPECIALIZE and not CAUSAL and EVEN_S)
    if CAUSAL or not EVEN_S:
        acc, m_i, l_i = _fwd_kv_loop(acc, m_i, l_i, q, k_desc, v_desc, b, kvh, full, hi, offs_m,
                                     T, S, qk_scale, D, BLOCK_N, CAUSAL, True, DOT_PRECISION)
    empty = l_i == 0.0  # rows that saw no key: output 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = (acc / l_safe[:, None]).to(q.dtype)
    if WARP_SPECIALIZE:
        o_own.store([start_m, 0], out)  # rows past T are dropped
    else:
        offs_d = tl.arange(0, D)
        o_ptrs = o_head + offs_m[:, None].to(tl.int64) * stride_ot + offs_d[None, :]
        tl.store(o_ptrs, out, mask=offs_m[:, None] < T)  # not a descriptor's: see the note
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
    tl.store(LSE2 + pid_bh.to(tl.int64) * T + offs_m, lse2, mask=offs_m < T)


# Python wrappers: check, allocate, launch.
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(q, k, v, causal, sm_scale):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"flash_attention: {name} must be a torch.Tensor, "
                            f"got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"flash_attention: {name} must be 4-D (B, H, T, D), "
                             f"got shape {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"flash_attention: k and v must have the same shape, "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    (B, Hq, T, D), (Bk, Hkv, S, Dk) = q.shape, k.shape
    if B != Bk:
        raise ValueError(f"flash_attention: batch sizes differ: q has {B}, k and v have {Bk}")
    if D != Dk:
        raise ValueError(f"flash_attention: head sizes differ: q has D={D}, k and v have D={Dk}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"flash_attention: query heads ({Hq}) must be a multiple of "
                         f"kv heads ({Hkv})")
    if D not in HEAD_DIMS:
        raise ValueError(f"flash_attention: head size D={D} is not supported; "
                         f"use one of {HEAD_DIMS}")
    if q.numel() == 0 or k.numel() == 0:
        raise ValueError(f"flash_attention: empty input (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"flash_attention: q, k, v must share a dtype, "
                        f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"flash_attention: dtype {q.dtype} is not supported; "
                        f"use float16, bfloat16 or float32")
    if not q.device == k.device == v.device:
        raise ValueError(f"flash_attention: q, k, v must be on one device, "
                         f"got {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda" and not (q.device.type == "cpu" and INTERPRET):
        raise ValueError(f"flash_attention: tensors on {q.device} need a CUDA device (or, on the "
                         f"CPU, Triton's interpreter: TRITON_INTERPRET=1 before triton loads)")
    if not isinstance(causal, bool):  # a string such as "no" would be truthy
        raise TypeError(f"flash_attention: causal must be True or False, got {causal!r}")
    if sm_scale is not None:
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
            raise TypeError(f"flash_attention: sm_scale must be a number or None, got {sm_scale!r}")
        if not (math.isfinite(sm_scale) and sm_scale > 0):
            raise ValueError(f"flash_attention: sm_scale must be positive and finite, got {sm_scale}")


def _kernel_ready(x):
    """The kernels take any strides, but a tensor descriptor needs a unit last stride and a
    16-byte aligned start and row strides: anything else is copied once."""
    size = x.element_size()
    aligned = x.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in x.stride()[:-1])
    return x if x.stride(-1) == 1 and aligned else x.contiguous()


def _dot_precision(dtype):
    """float32 inputs: each product as three tf32 tensor-core products (hi*hi + hi*lo + lo*hi),
    good to about 1e-6, where plain tf32 (Triton's default) keeps 10 mantissa bits and "ieee"
    leaves the tensor cores. float16 and bfloat16 ignore the setting."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _scratch(size, alignment, stream):
    """Global memory for the tensor descriptors a kernel builds (Triton asks via set_allocator)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _launch(kernel, grid, *args, **meta):
    """Launch. Tensor descriptors built inside a kernel live in a small global scratch buffer,
    which Triton allocates through set_allocator. A head size that fits no tile configuration
    in this GPU's shared memory becomes a clear error."""
    triton.set_allocator(_scratch)
    try:
        kernel[grid](*args, **meta)
    except triton.runtime.errors.OutOfResources as err:
        dtype = getattr(args[0], "base", args[0]).dtype  # a tensor, or a TensorDescriptor's
        raise ValueError(f"flash_attention: D={meta['D']} does not fit this GPU's shared memory "
                         f"in {dtype} ({err}); use a smaller head size or bf16/fp16") from err


def _desc(x):
    """A tensor descriptor of x (B, H, T, D), built on the host. Its tile, (1, 1, rows, D), gets
    its rows from the kernel's configuration (_tile_rows)."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, 1, x.shape[-1]])


def _flash_forward(q, k, v, causal, sm_scale):
    """q (B, Hq, T, D), k, v (B, Hkv, S, D) -> out (B, Hq, T, D), lse2 (B, Hq, T) float32."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    # Allocated as (B, T, Hq, D) and viewed as (B, Hq, T, D): the model merges the heads back
    # into (B, T, C) right after, and from this layout that merge is a view, not a copy.
    out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse2 = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    _launch(_flash_fwd_kernel, lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * Hq),
            q, *q.stride()[:3], _desc(q), _desc(k), _desc(v), out, *out.stride()[:3], lse2,
            sm_scale * LOG2E, Hq, Hq // Hkv, T, S, _seq_bucket(T), _seq_bucket(S),
            D=D, CAUSAL=causal, EVEN_S=S % 128 == 0, DOT_PRECISION=_dot_precision(q.dtype))
    return out, lse2


def flash_attention(q, k, v, causal=True, sm_scale=None):  # changed in 07: forward only
    """softmax(sm_scale * q k^T, masked) v: q (B, Hq, T, D), k, v (B, Hkv, S, D) -> (B, Hq, T, D).
    Hq a multiple of Hkv: query head h attends with kv head h // (Hq // Hkv). D in {32, 64, 128,
    256}. float16, bfloat16 or float32. CUDA tensors, or CPU ones under the interpreter. causal:
    query i sees key j iff j <= i + (S - T), the mask aligned to the bottom-right corner. sm_scale
    defaults to 1/sqrt(D). Queries that see no key (causal with T > S: the first T - S) get 0."""
    _check_inputs(q, k, v, causal, sm_scale)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    q, k, v = _kernel_ready(q), _kernel_ready(k), _kernel_ready(v)
    return _flash_forward(q, k, v, causal, scale)[0]


def attention_torch(q, k, v, positions):
    """Causal attention by position: the query of row b at positions[b, t] sees keys 0 through
    positions[b, t] of its row. q (B, Hq, T, D); k, v (B, Hkv, S, D), S > every position
    -> (B, Hq, T, D)."""
    k, v = _expand_kv(q, k, v)  # (B, Hq, S, D)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, Hq, T, S)
    keys = torch.arange(k.shape[2], device=q.device)
    visible = keys[None, None, :] <= positions[:, :, None]  # (B, T, S)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype) @ v


# ------------------------------------------------------------------------------------------------
# 17.4 continued: decode attention over a long cache, flash-decoding (chapter 19)
# ------------------------------------------------------------------------------------------------
# NEW in stage 07. A decode step attends one new query a row over the row's whole cache. Per row
# and kv head the cache holds 2 * S * D numbers, read once, and the G query heads that share them
# do 4 * G * S * D FLOPs: in bf16, G FLOPs a byte (4 for Qwen3-8B), where an H200 turns
# compute-bound only past ~200. The roofline is bandwidth: read the cache once, at copy speed.
# - The heads. One program per query head (the flash kernel's shape) reads each kv head's cache G
#   times. Here one program serves a kv head and its G query heads: each key tile is loaded once
#   and multiplied by a (G, D) query block, padded to 16 rows (the smallest tl.dot).
# - The grid. One program per (row, kv head) leaves most SMs idle at small batches while each
#   program streams thousands of keys. So the keys are split into chunks (FlashDecoding, Dao et
#   al. 2023): kernel 1 runs one chunk's online softmax and writes its normalized partial and
#   log-sum-exp; kernel 2 merges a head's partials with weights exp(lse_s - lse). The partials
#   cost 2G / S of the cache's bytes a split.
# Ragged lengths stay on the device: the number of splits comes from max_len, a host bound, and
# each row cuts its own keys into that many chunks, so a row far shorter than max_len still
# spreads over every split; a split past its row's end writes an empty partial (lse = -inf). No
# host sync, so a CUDA graph can hold the launch (a graph passes the longest length allowed).

# Keys a step (BLOCK_N), warps and stages: the usual candidates for a memory-bound loop, autotuned
# per head size, chunk bucket and dtype.
_DECODE_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
                   for n, w, s in ((32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2),
                                   (128, 8, 2))]
if INTERPRET:
    _DECODE_CONFIGS = [triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=1)]
_DECODE_ALIGN = max(c.kwargs["BLOCK_N"] for c in _DECODE_CONFIGS)  # chunks are whole tiles
# below this a split's fixed costs (its query load, its partial) show: at batch 1 over 272 keys
# 3 splits took 5.7 us against 7.1 us for 2
_MIN_SPLIT_KEYS = 128
_MAX_SPLITS = 64  # the merge holds a head's partials in registers: (64, D) fp32


@triton.jit
def _attend_keys(acc, m_i, l_i, q, K, V, BLOCK_TABLES, b, lo, hi, last, qk_scale,
                 stride_kb, stride_kt, stride_vb, stride_vt, D: tl.constexpr,
                 PAGED: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr,
                 BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax of the query rows q (M, D) over keys [lo, hi) of row b, for the decode and
    paged kernels. m_i, l_i (M,): running max (base 2) and sum; acc (M, D): the unnormalized
    output. K, V point at this kv head. Key j is position j of row b of a (B, S) cache or, PAGED,
    slot j % PAGE of page BLOCK_TABLES[j // PAGE] (row b's table). MASKED: row i sees keys <=
    last[i] only (last: a scalar or an (M, 1) column); else [lo, hi) is whole tiles, all seen."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for start in tl.range(lo, hi, BLOCK_N):
        keys = start + offs_n  # (BLOCK_N,)
        valid = keys < hi  # the ragged end of the range: never read past the row or its table
        if PAGED:
            # a table entry per key (the repeats hit L1); a key row is D contiguous values
            page = tl.load(BLOCK_TABLES + keys // PAGE, mask=valid, other=0).to(tl.int64)
            slot = keys % PAGE
        else:
            page = b
            slot = keys
        k_rows = page * stride_kb + slot * stride_kt  # (BLOCK_N,)
        v_rows = page * stride_vb + slot * stride_vt
        k = tl.load(K + k_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + v_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        if _INTERPRET:
            # the interpreter multiplies bf16 tiles by their raw bits; fp32 gives the tensor
            # cores' product (exact products, fp32 sums)
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k.T, input_precision=DOT_PRECISION) * qk_scale  # (M, BLOCK_N)
        if MASKED:
            s = tl.where(keys[None, :] <= last, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no visible key so far keeps m = -inf: subtract 0, so exp2 gives 0, not nan
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)  # rescales what was summed under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.autotune(configs=_DECODE_CONFIGS, key=["CHUNK_BUCKET", "D", "BLOCK_H", "PAGED", "PAGE"])
@triton.jit(do_not_specialize=["max_len"])  # a new bound each step, not a new compile
def _decode_split_kernel(Q, K, V, BLOCK_TABLES, LENGTHS, OUT, O_PART, LSE_PART, qk_scale,
                         max_len, stride_qb, stride_qh, stride_kb, stride_kh, stride_kt,
                         stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_tb,
                         CHUNK_BUCKET, ALIGN: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                         BLOCK_H: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
                         DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """Kernel 1, one program per (row b, kv head, split s): keys [s * chunk, (s + 1) * chunk) of
    row b (chunk: its length / splits, rounded up to whole ALIGN tiles), against the GROUP query
    heads of the kv head. Q (B, Hq, D); K, V (B, Hkv, S, D), or PAGED (chapter 25) pools viewed
    as (num_blocks, Hkv, PAGE, D) read through BLOCK_TABLES (B, max_blocks) int32 (else None);
    unit last strides. LENGTHS (B,), clamped to max_len so a wrong one reads nothing past the
    cache. qk_scale = sm_scale * log2(e). DIRECT (one split): the output to OUT (B, Hq, D); else
    the partial to O_PART (B, Hq, splits, D) and its base-2 log-sum-exp to LSE_PART
    (B, Hq, splits), fp32. PDL: see _wait_for_inputs."""
    _wait_for_inputs(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    length = tl.minimum(tl.load(LENGTHS + b), max_len)
    chunk = tl.cdiv(tl.cdiv(length, tl.num_programs(2)), ALIGN) * ALIGN
    lo = split * chunk
    hi = tl.minimum(lo + chunk, length)  # hi <= lo: an empty split, the loop runs no step
    offs_g = tl.arange(0, BLOCK_H)  # the query block: rows 0..GROUP-1 real, the rest padding
    heads = kvh * GROUP + offs_g  # (BLOCK_H,) query heads that read kv head kvh
    is_head = offs_g < GROUP
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=is_head[:, None], other=0.0)  # (BLOCK_H, D), on chip for the whole loop
    if _INTERPRET:
        q = q.to(tl.float32)  # see _attend_keys
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, base 2
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_H, D], tl.float32)  # unnormalized output
    if PAGED:
        BLOCK_TABLES += b * stride_tb  # row b's block table
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, K + kvh * stride_kh, V + kvh * stride_vh,
                                 BLOCK_TABLES, b, lo, hi, hi - 1, qk_scale, stride_kb, stride_kt,
                                 stride_vb, stride_vt, D, PAGED, PAGE, True, BLOCK_N,
                                 DOT_PRECISION)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty split: output 0, and lse -inf from m_i
    out = acc / l_safe[:, None]  # (BLOCK_H, D)
    if DIRECT:
        tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=is_head[:, None])
    else:
        part = (b * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2) + split  # (BLOCK_H,)
        tl.store(LSE_PART + part, m_i + tl.math.log2(l_safe), mask=is_head)
        tl.store(O_PART + part[:, None] * D + offs_d[None, :], out, mask=is_head[:, None])


@triton.jit
def _decode_merge_kernel(O_PART, LSE_PART, OUT, stride_ob, stride_oh, Hq, SPLITS,
                         D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """Kernel 2, one program per (row b, query head h): out = sum_s w_s o_s / sum_s w_s with
    w_s = exp2(lse_s - max lse), over the SPLITS partials of O_PART (B, Hq, SPLITS, D) and
    LSE_PART (B, Hq, SPLITS). A row with no key at all (length 0) gets 0."""
    _wait_for_inputs(PDL)
    pid = tl.program_id(0).to(tl.int64)  # b * Hq + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    lse = tl.load(LSE_PART + pid * SPLITS + offs_s, mask=offs_s < SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # (BLOCK_S,), 0 if empty
    o = tl.load(O_PART + (pid * SPLITS + offs_s)[:, None] * D + offs_d[None, :],
                mask=(offs_s < SPLITS)[:, None], other=0.0)  # (BLOCK_S, D)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)  # (D,)
    tl.store(OUT + (pid // Hq) * stride_ob + (pid % Hq) * stride_oh + offs_d,
             out.to(OUT.dtype.element_ty))


def decode_splits(batch, kv_heads, max_len, n_sms):
    """How many chunks each row's keys are cut into: enough for about four programs an SM
    (their loads in flight together, the extra ones evening out the last wave), with at least
    _MIN_SPLIT_KEYS keys a split and at most _MAX_SPLITS splits."""
    wanted = triton.cdiv(4 * n_sms, batch * kv_heads)
    return max(1, min(wanted, triton.cdiv(max_len, _MIN_SPLIT_KEYS), _MAX_SPLITS))


def decode_attention(q, k_cache, v_cache, lengths, max_len=None, sm_scale=None, num_splits=None):
    """Attention of one new query a row over a KV cache: q (B, Hq, D), k_cache and v_cache
    (B, Hkv, S, D) (any strides, unit last stride), lengths (B,) int32 or int64 on q's device:
    row b attends to keys 0..lengths[b]-1 -> (B, Hq, D). max_len: a host bound on lengths
    (default S); lengths stay on the device, clamped to it. sm_scale defaults to 1/sqrt(D).
    num_splits forces the split count (for tests); by default decode_splits picks it."""
    max_len = _check_decode_inputs(q, k_cache, v_cache, lengths, max_len, sm_scale, num_splits)
    return _split_decode(q, k_cache, v_cache, None, lengths, max_len, sm_scale, num_splits)


def _split_decode(q, k, v, block_tables, lengths, max_len, sm_scale, num_splits):
    """The launches of decode_attention and, with block_tables, paged_decode_attention (k, v the
    pools viewed as (num_blocks, Hkv, block_size, D)), on checked inputs -> (B, Hq, D)."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    splits = num_splits or decode_splits(B, Hkv, max_len, _num_sms(q.device))
    chunk = triton.cdiv(triton.cdiv(max_len, splits), _DECODE_ALIGN) * _DECODE_ALIGN  # the longest
    if num_splits is None:
        splits = triton.cdiv(max_len, chunk)  # after rounding up, no split past max_len
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    o_part = torch.empty(B, Hq, splits, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device)
    pdl = _pdl(q.device)
    paged = block_tables is not None
    _decode_split_kernel[(B, Hkv, splits)](
        q, k, v, block_tables, lengths, out, o_part, lse_part, scale * LOG2E, max_len,
        *q.stride()[:2], *k.stride()[:3], *v.stride()[:3], *out.stride()[:2],
        block_tables.stride(0) if paged else 0, _seq_bucket(chunk), ALIGN=_DECODE_ALIGN,
        GROUP=Hq // Hkv, D=D,
        BLOCK_H=max(16, triton.next_power_of_2(Hq // Hkv)),  # the group, padded for tl.dot
        PAGED=paged, PAGE=k.shape[2] if paged else 1, DIRECT=splits == 1,
        DOT_PRECISION=_dot_precision(q.dtype), PDL=pdl, launch_pdl=pdl)
    if splits > 1:
        _decode_merge_kernel[(B * Hq,)](o_part, lse_part, out, *out.stride()[:2], Hq, splits,
                                        D=D, BLOCK_S=triton.next_power_of_2(splits), PDL=pdl,
                                        launch_pdl=pdl)
    return out


def _check_decode_inputs(q, k_cache, v_cache, lengths, max_len, sm_scale, num_splits):
    """Raise a clear error for anything decode_attention cannot take; returns max_len."""
    _check_tensor("q", q, contiguous=False)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, x, dtypes=(q.dtype,), device=q.device, contiguous=False)
    _check_tensor("lengths", lengths, dtypes=(torch.int32, torch.int64), device=q.device,
                  contiguous=False)
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"decode_attention: q must be (B, Hq, D) and k_cache, v_cache one "
                         f"(B, Hkv, S, D) shape, got {tuple(q.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    (B, Hq, D), (Bk, Hkv, S, Dk) = q.shape, k_cache.shape
    if B != Bk or D != Dk or lengths.shape != (B,):
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} "
                         f"and lengths {tuple(lengths.shape)} disagree on B or D")
    _check_group("decode_attention", Hq, Hkv)
    _check_kernel_heads("decode_attention", q, k_cache, v_cache, sm_scale)
    return _check_splits("decode_attention", max_len, S, f"S={S}", num_splits)


# Shared by the checks of the decode and the paged kernels.
def _check_group(fn, Hq, Hkv):
    if Hq % Hkv:
        raise ValueError(f"{fn}: query heads ({Hq}) must be a multiple of kv heads ({Hkv})")


def _check_kernel_heads(fn, q, k_cache, v_cache, sm_scale):
    """What the attention kernels' loads and scale need."""
    D = q.shape[-1]
    if D not in HEAD_DIMS:
        raise ValueError(f"{fn}: head size D={D} is not supported; use one of {HEAD_DIMS}")
    if any(x.stride(-1) != 1 for x in (q, k_cache, v_cache)):
        raise ValueError(f"{fn}: q, k_cache and v_cache need a unit last stride")
    if sm_scale is not None and (isinstance(sm_scale, bool)
                                 or not isinstance(sm_scale, numbers.Real)
                                 or not (math.isfinite(sm_scale) and sm_scale > 0)):
        raise ValueError(f"{fn}: sm_scale must be a positive number, got {sm_scale!r}")


def _is_count(x, most):
    """x is an int (not a bool) in [1, most]."""
    return not isinstance(x, bool) and isinstance(x, int) and 1 <= x <= most


def _check_splits(fn, max_len, most, most_name, num_splits):
    """max_len (default `most`, the keys a row can hold) and num_splits; returns max_len."""
    max_len = most if max_len is None else max_len
    if not _is_count(max_len, most):
        raise ValueError(f"{fn}: max_len must be an int in [1, {most_name}], got {max_len!r}")
    if num_splits is not None and not _is_count(num_splits, _MAX_SPLITS):
        raise ValueError(f"{fn}: num_splits must be an int in [1, {_MAX_SPLITS}] or None, got "
                         f"{num_splits!r}")
    return max_len


# ------------------------------------------------------------------------------------------------
# 17.4 continued: paged attention (chapter 25)
# ------------------------------------------------------------------------------------------------
# NEW in stage 07. KVCache (chapter 16) reserves max_len slots a row up front: a short row holds
# memory no other can use, and rows cannot share a prompt's keys. A paged cache (vLLM's
# PagedAttention, Kwon et al. 2023) cuts each layer's pools, k_cache and v_cache (num_blocks,
# block_size, Hkv, D), into pages handed out as a sequence grows. A sequence's block table lists
# its pages in order: key j of row b is slot j % block_size of page block_tables[b, j //
# block_size]. The kernels pay a 4-byte table entry per key and gather key rows instead of
# loading tiles, but a key row is D contiguous values (whole cache lines), so the roofline holds.
# - Decode: the flash-decoding kernels above with PAGED on, looking each key up in the table.
# - Prefill and extend: the new tokens of several sequences packed in one (N, Hq, D) tensor
#   (cu_seqlens_q marks where each starts), their keys already in the pool, each query seeing its
#   sequence's keys up to its own position (bottom-right causal). Stage 06's shape, a program per
#   tile of queries, with the decode kernel's GQA trick: a tile holds BLOCK_M // BLOCK_H tokens
#   times the G query heads of one kv head (BLOCK_H = G rounded up to a power of two), so each
#   K/V tile is loaded once for the G heads; unmasked keys first, then the diagonal, masked.
# Their grids come from what the host knows (max_len; the packed tokens and the number of
# sequences); ragged lengths stay on the device.
# paged_attention_torch is the plain version, for the CPU engine and the tests.

# The prefill's tiles: BLOCK_M rows (tokens x heads of a group), 2 stages (the loads are gathers,
# not TMA copies); smaller than stage 06's, as the gathers' addresses take registers: each one
# kept spills none (compiled for sm_90a).
_PAGED_PREFILL_CONFIGS = (
    [_config(m, n, w, 2, (32, 64)) for m, n, w in ((16, 32, 4), (32, 32, 4), (64, 32, 8),
                                                   (64, 64, 8), (128, 32, 8))]
    + [_config(m, n, w, 2, (128,)) for m, n, w in ((16, 32, 4), (32, 16, 4), (32, 32, 8),
                                                   (64, 16, 4), (128, 16, 8), (32, 64, 4),
                                                   (64, 64, 4), (64, 64, 8))]
    + [_config(m, n, 4, 2, (256,)) for m, n in ((16, 16), (16, 32), (32, 16))]
)
if INTERPRET:
    _PAGED_PREFILL_CONFIGS = [_config(16, 16, 4, 1, HEAD_DIMS)]


def _prune_paged_prefill_configs(configs, named_args, **kwargs):
    """The configurations for this head size that hold a token (BLOCK_M >= BLOCK_H), else one of
    one token; float32 inputs get one untuned (as _prune_configs)."""
    kept = [c for c in configs
            if kwargs["D"] in c.head_dims and c.kwargs["BLOCK_M"] >= kwargs["BLOCK_H"]]
    if not kept:
        kept = [_config(kwargs["BLOCK_H"], 16, 8, 1, HEAD_DIMS)]
    if named_args and named_args["Q"].dtype == torch.float32:
        kept = kept[:1]
    return kept


@triton.autotune(configs=_PAGED_PREFILL_CONFIGS, key=["Q_BUCKET", "D", "BLOCK_H", "PAGE"],
                 prune_configs_by={"early_config_prune": _prune_paged_prefill_configs})
@triton.jit(do_not_specialize=["N", "B", "max_keys"])
def _paged_prefill_kernel(Q, K, V, BLOCK_TABLES, CU_SEQLENS_Q, LENGTHS, OUT, qk_scale, N, B,
                          max_keys, stride_qn, stride_qh, stride_kb, stride_kh, stride_kt,
                          stride_vb, stride_vh, stride_vt, stride_on, stride_oh, stride_tb,
                          Q_BUCKET, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                          PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (tile of new tokens of some sequence b, kv head): row r of the tile is
    token r // BLOCK_H with query head r % BLOCK_H of the kv head's group (past GROUP: padding).
    The grid's first axis is cdiv(N, BLOCK_Q) + B tiles, from the packed tokens, not from the
    longest sequence: sequence b owns tiles CU_SEQLENS_Q[b] // BLOCK_Q + b on (room for its
    tokens and the tile its start cuts), so a program finds b by a binary search over those
    starts, and the grid depends on N and B only, as a CUDA graph needs.
    Q, OUT (N, Hq, D): sequence b's new tokens at rows CU_SEQLENS_Q[b] .. CU_SEQLENS_Q[b + 1] - 1.
    K, V: pools viewed as (num_blocks, Hkv, PAGE, D), read through BLOCK_TABLES (B, max_blocks)
    int32. LENGTHS (B,): keys of each sequence, new ones included (clamped to max_keys = max_blocks
    * PAGE): new token t sits at position LENGTHS[b] - q_len + t and sees keys up to it. Unit
    last strides. qk_scale = sm_scale * log2(e). Q_BUCKET: an autotune key only."""
    BLOCK_Q: tl.constexpr = BLOCK_M // BLOCK_H  # tokens a tile
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # later tokens see more keys: start first
    kvh = tl.program_id(1).to(tl.int64)
    # b: the last sequence whose first tile is at most pid, first(lo) <= pid < first(hi)
    lo, hi = tl.full([], 0, tl.int32), B
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(CU_SEQLENS_Q + mid) // BLOCK_Q + mid <= pid:
            lo = mid
        else:
            hi = mid
    b = lo.to(tl.int64)
    q_start = tl.load(CU_SEQLENS_Q + b).to(tl.int64)
    q_len = tl.minimum(tl.load(CU_SEQLENS_Q + b + 1).to(tl.int64), N) - q_start
    tile = pid - (q_start // BLOCK_Q + b)
    if tile * BLOCK_Q >= q_len:  # a tile past b's tokens (each sequence has room for one)
        return
    length = tl.minimum(tl.load(LENGTHS + b), max_keys)
    first = length - q_len + tile * BLOCK_Q  # the tile's first token's position
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    t = tile * BLOCK_Q + offs_m // BLOCK_H  # (BLOCK_M,) each row's token, 0..q_len-1
    heads = kvh * GROUP + offs_m % BLOCK_H  # (BLOCK_M,) each row's query head
    is_row = (t < q_len) & (offs_m % BLOCK_H < GROUP)
    q_ptrs = (q_start + t)[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(Q + q_ptrs, mask=is_row[:, None], other=0.0)  # (BLOCK_M, D)
    if _INTERPRET:
        q = q.to(tl.float32)  # see _attend_keys
    last = first + offs_m // BLOCK_H  # (BLOCK_M,) each row's position: it sees keys 0..last
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # keys [0, full): seen by every row (whole tiles); [full, hi): the diagonal; none past hi
    full = tl.maximum(first + 1, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(first + BLOCK_Q, length)
    K += kvh * stride_kh
    V += kvh * stride_vh
    BLOCK_TABLES += b * stride_tb
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, K, V, BLOCK_TABLES, b, 0, full, last[:, None],
                                 qk_scale, stride_kb, stride_kt, stride_vb, stride_vt, D, True,
                                 PAGE, False, BLOCK_N, DOT_PRECISION)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, K, V, BLOCK_TABLES, b, full, hi,
                                 last[:, None], qk_scale, stride_kb, stride_kt, stride_vb,
                                 stride_vt, D, True, PAGE, True, BLOCK_N, DOT_PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a query that saw no key: 0
    o_ptrs = (q_start + t)[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(OUT + o_ptrs, out.to(OUT.dtype.element_ty), mask=is_row[:, None])


def paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, max_len=None,
                           sm_scale=None, num_splits=None):
    """decode_attention over a paged cache: q (B, Hq, D); k_cache, v_cache (num_blocks,
    block_size, Hkv, D), block_size a power of two; block_tables (B, max_blocks) int32 (entries
    past a row's last page are never read); lengths (B,) int32 or int64 -> (B, Hq, D). One
    device, unit last strides. max_len defaults to max_blocks * block_size; max_len, sm_scale and
    num_splits as decode_attention's."""
    fn = "paged_decode_attention"
    _check_paged_inputs(fn, q, k_cache, v_cache, block_tables, lengths, sm_scale)
    (B, max_blocks), page = block_tables.shape, k_cache.shape[1]
    if q.shape[0] != B:
        raise ValueError(f"{fn}: q has {q.shape[0]} rows but block_tables {B}")
    max_len = _check_splits(fn, max_len, max_blocks * page,
                            f"max_blocks * block_size={max_blocks * page}", num_splits)
    return _split_decode(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), block_tables,
                         lengths, max_len, sm_scale, num_splits)  # pools as (blocks, Hkv, page, D)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, lengths, max_q_len,
                            sm_scale=None):
    """Causal attention of the new tokens of B sequences over a paged cache that already holds
    their keys and values: q (N, Hq, D), sequence b's q_len_b tokens at rows cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1] - 1 (cu_seqlens_q (B + 1,) int32, from 0); lengths (B,) int32 or int64,
    keys of each sequence with its new ones: new token t at position lengths[b] - q_len_b + t
    sees keys 0 through it. k_cache, v_cache, block_tables as paged_decode_attention's;
    max_q_len: a host bound on the q_len_b (it picks the tuned tiles). -> (N, Hq, D); rows no
    sequence claims unwritten."""
    fn = "paged_prefill_attention"
    _check_paged_inputs(fn, q, k_cache, v_cache, block_tables, lengths, sm_scale)
    B, N = block_tables.shape[0], q.shape[0]
    _check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), device=q.device)
    if cu_seqlens_q.shape != (B + 1,):
        raise ValueError(f"{fn}: cu_seqlens_q must be (B + 1,) = ({B + 1},) for B={B} block "
                         f"table rows, got {tuple(cu_seqlens_q.shape)}")
    if not _is_count(max_q_len, N):
        raise ValueError(f"{fn}: max_q_len must be an int in [1, N={N}], got {max_q_len!r}")
    Hq, D = q.shape[1:]
    page, Hkv = k_cache.shape[1:3]
    block_h = triton.next_power_of_2(Hq // Hkv)
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _paged_prefill_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_M"] // block_h) + B, Hkv)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, lengths, out, scale * LOG2E, N, B,
        block_tables.shape[1] * page, *q.stride()[:2], k_cache.stride(0), k_cache.stride(2),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(2), v_cache.stride(1),
        *out.stride()[:2], block_tables.stride(0), _seq_bucket(max_q_len), GROUP=Hq // Hkv, D=D,
        BLOCK_H=block_h, PAGE=page, DOT_PRECISION=_dot_precision(q.dtype))
    return out


def _check_paged_inputs(fn, q, k_cache, v_cache, block_tables, lengths, sm_scale):
    """The checks the two paged kernels share: tensors, shapes, heads, scale."""
    _check_tensor("q", q, contiguous=False)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, x, dtypes=(q.dtype,), device=q.device, contiguous=False)
    _check_tensor("block_tables", block_tables, dtypes=(torch.int32,), device=q.device,
                  contiguous=False)
    _check_tensor("lengths", lengths, dtypes=(torch.int32, torch.int64), device=q.device)
    _check_paged_shapes(fn, q, k_cache, v_cache, block_tables, lengths)
    if block_tables.stride(-1) != 1:
        raise ValueError(f"{fn}: block_tables needs a unit last stride")
    _check_kernel_heads(fn, q, k_cache, v_cache, sm_scale)


def _check_paged_shapes(fn, q, k_cache, v_cache, block_tables, lengths):
    """Shapes that agree, for the kernels and the torch version alike."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{fn}: q must be (rows, Hq, D) and k_cache, v_cache one (num_blocks, "
                         f"block_size, Hkv, D) shape, got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if block_tables.dim() != 2 or lengths.shape != block_tables.shape[:1]:
        raise ValueError(f"{fn}: block_tables must be (B, max_blocks) and lengths (B,), got "
                         f"{tuple(block_tables.shape)} and {tuple(lengths.shape)}")
    (_, Hq, D), (_, page, Hkv, Dk) = q.shape, k_cache.shape
    if D != Dk:
        raise ValueError(f"{fn}: head sizes differ: q has D={D}, the caches D={Dk}")
    _check_group(fn, Hq, Hkv)
    if page & (page - 1):
        raise ValueError(f"{fn}: block_size must be a power of two, got {page}")


def paged_attention_torch(q, k_cache, v_cache, block_tables, cu_seqlens_q, lengths):
    """paged_prefill_attention in plain torch, one sequence at a time, in fp32 (decodes too:
    cu_seqlens_q = arange(B + 1)). Reads cu_seqlens_q and lengths on the host: for the CPU
    engine and the tests, not for a CUDA graph. -> (N, Hq, D) in q's dtype."""
    fn = "paged_attention_torch"
    _check_paged_shapes(fn, q, k_cache, v_cache, block_tables, lengths)
    page = k_cache.shape[1]
    starts, lengths = cu_seqlens_q.tolist(), lengths.tolist()
    if len(starts) != len(lengths) + 1:
        raise ValueError(f"{fn}: cu_seqlens_q must hold B + 1 = {len(lengths) + 1} offsets, got "
                         f"{len(starts)}")
    out = torch.zeros_like(q)
    for b, length in enumerate(lengths):
        q_b = q[starts[b]:starts[b + 1]]  # (T, Hq, D): this sequence's new tokens
        T = q_b.shape[0]
        if not T <= length <= block_tables.shape[1] * page:
            raise ValueError(f"{fn}: sequence {b} has {T} new tokens and {length} keys (at most "
                             f"{block_tables.shape[1] * page}): need q_len <= length <= that")
        if T == 0:
            continue
        pages = block_tables[b, :triton.cdiv(length, page)].long()  # its pages only
        k, v = (x[pages].flatten(0, 1)[:length].transpose(0, 1)[None].float()  # (1, Hkv, S, D)
                for x in (k_cache, v_cache))
        positions = torch.arange(length - T, length, device=q.device)[None]  # (1, T)
        o = attention_torch(q_b.transpose(0, 1)[None].float(), k, v, positions)  # (1, Hq, T, D)
        out[starts[b]:starts[b + 1]] = o[0].transpose(0, 1).to(q.dtype)
    return out


class Attention(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        C, Hq, Hkv, D = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                         cfg.head_dim)
        self.q_proj = nn.Linear(C, Hq * D, bias=False)
        self.k_proj = nn.Linear(C, Hkv * D, bias=False)
        self.v_proj = nn.Linear(C, Hkv * D, bias=False)
        self.o_proj = nn.Linear(Hq * D, C, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)  # over each head's D values, before RoPE
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.head_dim, self.layer = D, layer  # layer: which of the cache's layers is this one's
        self.kernels = False
        self.qkv_weight = None  # q|k|v weights in one tensor, for forward_packed (fuse_projections)

    def forward(self, x, rope, cache=None, kv_len=None):
        """x (B, T, C) -> (B, T, C). rope: (cos, sin, positions) of the tokens. cache, kv_len: see
        Qwen3.hidden_states."""
        B, T, _ = x.shape
        cos, sin, positions = rope
        # q (B, Hq, T, D); k, v (B, Hkv, T, D)
        q = self.q_norm(self.q_proj(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            cache.write(self.layer, k, v, positions)
        if kv_len is not None:  # continuing sequences: attend over the cache
            k, v = cache.read(self.layer, B, kv_len)  # (B, Hkv, kv_len, D)
            if self.kernels and T == 1:  # one query a row: the decode kernel (19)
                lengths = positions[:, 0] + 1  # (B,), on the device: keys 0..positions[b]
                out = decode_attention(q[:, :, 0], k, v, lengths, kv_len)  # (B, Hq, D)
                out = out[:, :, None]  # (B, Hq, 1, D)
            else:
                out = attention_torch(q, k, v, positions)
        elif self.kernels:  # whole sequences from position 0: plain causal attention
            out = flash_attention(q, k, v, causal=True)
        else:
            out = attention_torch(q, k, v, positions)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # heads merged: (B, T, Hq * D)


# ------------------------------------------------------------------------------------------------
# 17.5 The model
# ------------------------------------------------------------------------------------------------

class Block(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg, layer):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, cache=None, kv_len=None):  # x (B, T, C)
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, kv_len)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3(nn.Module):
    """Qwen3ForCausalLM, dense. Its parameters have the checkpoint's names
    (model.layers.0.self_attn.q_proj.weight, ...), so loading renames nothing. With tied
    embeddings there is no lm_head: the output layer is the embedding matrix itself."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
            layers=nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers)),
            norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)))
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.kernels = False  # set by use_kernels; forward_packed takes the kernels then

    def use_kernels(self, on=True):
        """Run RMSNorm, SwiGLU and the prefill's attention on the Triton kernels (CUDA tensors, or
        CPU ones under the interpreter), or on their torch twins. Returns the model."""
        for module in self.modules():
            if hasattr(module, "kernels"):
                module.kernels = on
        return self

    def forward(self, input_ids, positions=None, cache=None, kv_len=None):
        """logits (B, T, V) for input_ids (B, T), in the model's dtype; the other arguments as in
        hidden_states. The ids are checked against the vocabulary, which reads two numbers back
        from the device; the engine, which checks prompts on the host, calls hidden_states."""
        _check_ids(input_ids, self.cfg.vocab_size)
        return self.logits(self.hidden_states(input_ids, positions, cache, kv_len))

    def hidden_states(self, input_ids, positions=None, cache=None, kv_len=None):
        """The final normalized hidden states (B, T, C) of input_ids (B, T).
        Without a cache: whole sequences, token t at position t.
        With a cache (a KVCache of at least B rows), the keys and values of token t of row b are
        also written to the cache's row b at the token's position, and either
          kv_len is None: a prefill: whole sequences from position 0, attending to each other;
          kv_len is given, with positions (B, T): the tokens continue the sequences in the cache,
            each attending to every cached position up to its own (all below kv_len)."""
        if (positions is None) != (kv_len is None) or (kv_len is not None and cache is None):
            raise ValueError("positions and kv_len go together, and with a cache")
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)  # (B, T, D) each
        for block in self.model.layers:
            x = block(x, (cos, sin, positions), cache, kv_len)
        return self.model.norm(x)

    def logits(self, h):
        """h (..., C) -> logits (..., V)."""
        return F.linear(h, self.output_weight())

    def output_weight(self):
        """The output layer's (V, C) weight: the embedding matrix when they are tied."""
        tied = self.cfg.tie_word_embeddings
        return self.model.embed_tokens.weight if tied else self.lm_head.weight

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


def _check_ids(ids, vocab_size):
    if (not isinstance(ids, torch.Tensor) or ids.dim() != 2
            or ids.dtype not in (torch.int64, torch.int32)):
        raise ValueError(f"input_ids must be a (B, T) tensor of int64 or int32 token ids, got "
                         f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__} "
                         f"{tuple(getattr(ids, 'shape', ()))}")
    capturing = ids.is_cuda and torch.cuda.is_current_stream_capturing()  # nothing reads back then
    if ids.numel() and not capturing:
        low, high = (int(x) for x in torch.aminmax(ids))
        if low < 0 or high >= vocab_size:
            raise ValueError(f"token ids must be in [0, {vocab_size}), got ids from {low} to "
                             f"{high}")


# ----------------------------------------------------------------------------------------------
# Chapter 16. The KV cache
# ----------------------------------------------------------------------------------------------
# Without a cache, token n recomputes the keys and values of the n - 1 tokens before it: O(n^2)
# work for n tokens. They never change (a causal model's token t depends on tokens <= t only),
# so each is computed once and kept, and a decode step runs the model on one token a row. A token
# takes 2 * L * Hkv * D values (112 KiB in Qwen3-0.6B, bf16), kept small by grouped-query
# attention's few kv heads. The cache is allocated once, for the batch's longest sequence, and
# each step writes into it (transformers' default cache grows by a concatenation every step).
# This is the model's own cache; the engine's is paged (chapter 25).

class KVCache:
    """Keys and values of every layer for `rows` sequences of up to `length` positions:
    k and v are (L, rows, Hkv, length, D). Row b is the batch's sequence b, and position p of a
    row holds the key and value of that sequence's token p."""

    def __init__(self, cfg, rows, length, device, dtype):
        shape = (cfg.num_hidden_layers, rows, cfg.num_key_value_heads, length, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def rows(self):
        return self.k.shape[1]

    @property
    def length(self):
        return self.k.shape[3]

    def write(self, layer, k, v, positions):
        """Store k, v (B, Hkv, T, D) of `layer` into rows 0..B-1, token t of row b at position
        positions[b, t]."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
        # indexing (rows, :, positions) addresses a (B, T, Hkv, D) block of the layer's cache
        self.k[layer][rows, :, positions] = k.transpose(1, 2)
        self.v[layer][rows, :, positions] = v.transpose(1, 2)

    def read(self, layer, batch, kv_len):
        """Views, no copy: the first kv_len positions of rows 0..batch-1,
        (batch, Hkv, kv_len, D)."""
        return self.k[layer, :batch, :, :kv_len], self.v[layer, :batch, :, :kv_len]


# ----------------------------------------------------------------------------------------------
# Chapter 18. Engine v1: prefill, then decode over the cache
# ----------------------------------------------------------------------------------------------
# The simplest engine serves one static batch. The prompts, padded on the right to one length,
# are prefilled in one forward pass that writes every token's keys and values into a KVCache (a
# row's padding is overwritten by its own later tokens); then each decode step runs one token a
# row, at the row's own position. Tokens are sampled on the device (the Sampler, chapter 34) and
# read back once at the end, so no step waits for the host: a row that meets an eos runs on until
# every row has (checked every EOS_CHECK_STEPS steps). That waste, and a new request's wait for
# the batch to end, are what continuous batching removes (chapter 24). On a GPU the decode step
# is replayed from a CUDA graph: one launch instead of a few hundred from Python. A graph replays
# fixed shapes, so its attention reads the whole cache, each row masked past its own position.

EOS_CHECK_STEPS = 16


def cuda_graph(fn, *args, pool=None):
    """fn(*args), tensors in and out, captured in a CUDA graph. Returns replay(*args), which
    copies its arguments into the graph's own input buffers, replays the graph (replay.graph)
    and returns its output (overwritten by the next replay). A run on the first arguments
    before the capture compiles and autotunes the kernels, which a capture may not do: whatever
    it writes, the first replay writes again. pool: a memory pool shared with other graphs."""
    inputs, device = [x.clone() for x in args], args[0].device
    side = torch.cuda.Stream(device)  # torch's rule: the warm-up before a capture on a side stream
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn(*inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn(*inputs)

    def replay(*xs):
        for buffer, x in zip(inputs, xs):
            buffer.copy_(x)
        graph.replay()
        return output
    replay.graph = graph
    return replay


@torch.inference_mode()
def generate(model, prompts, params=None, eos_token_ids=(), cuda_graph_decode=True):
    """Engine v1: the ids generated for each prompt (a list of token ids), the eos or stop id
    that ended it included, sampled as `params` asks (default: greedy, 16 tokens), each row with
    its own random stream when seeded. A row ends at one of eos_token_ids (unless ignore_eos) or
    params.stop_token_ids, or after max_tokens (None: up to the model's context). Structured
    output and logprobs are the engine's (LLM.generate). cuda_graph_decode: on a GPU, replay the
    decode steps from a CUDA graph."""
    params = SamplingParams(temperature=0) if params is None else params
    cfg, device = model.cfg, _device_of(model)
    _check_v1_request(prompts, params, cfg)
    lengths = [len(p) for p in prompts]
    max_tokens = params.max_tokens or cfg.max_position_embeddings - max(lengths)
    B, T = len(prompts), max(lengths)
    cache = KVCache(cfg, B, T + max_tokens, device, model.model.embed_tokens.weight.dtype)
    ids = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=device)  # (B, T)
    h = model.hidden_states(ids, cache=cache)  # the prefill: (B, T, C)
    rows, last = torch.arange(B, device=device), torch.tensor(lengths, device=device) - 1
    logits = model.logits(h[rows, last])  # (B, V): each row's next token after its prompt

    def decode(tokens, positions):  # (B,) each -> logits (B, V): one token a row
        h = model.hidden_states(tokens[:, None], positions[:, None], cache, kv_len=cache.length)
        return model.logits(h[:, 0])

    sampler, batch = Sampler(), SamplingBatch([params] * B, prompts, cfg.vocab_size, device)
    stop = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
    stop = torch.tensor(stop, dtype=torch.int64, device=device)
    out = torch.empty(B, max_tokens, dtype=torch.int64, device=device)
    ended = torch.zeros(B, dtype=torch.bool, device=device)
    for i in range(max_tokens):
        tokens = sampler(logits, batch)[0]  # (B,)
        out[:, i] = tokens
        ended |= torch.isin(tokens, stop)
        if i + 1 == max_tokens or (i + 1) % EOS_CHECK_STEPS == 0 and bool(ended.all()):
            break
        if i == 0 and device.type == "cuda" and cuda_graph_decode:
            decode = cuda_graph(decode, tokens, last + 1)
        logits = decode(tokens, last + 1 + i)
    generated, stop = [], set(stop.tolist())
    for row in out[:, :i + 1].tolist():  # the one read back
        end = next((j + 1 for j, t in enumerate(row) if t in stop), len(row))
        generated.append(row[:end])
    return generated


def _check_v1_request(prompts, params, cfg):
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
    if any(getattr(params, name) is not None for name in (*STRUCTURED_FIELDS, "logprobs")):
        raise ValueError("engine v1 samples plain tokens: structured output and logprobs are "
                         "the engine's (LLM.generate)")
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(
            isinstance(p, (list, tuple)) and p and all(_is_int(t) and 0 <= t < cfg.vocab_size
                                                       for t in p) for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of non-empty lists of token ids in "
                         f"[0, {cfg.vocab_size})")
    longest, limit = max(map(len, prompts)), cfg.max_position_embeddings
    if longest + (params.max_tokens or 1) > limit:
        raise ValueError(f"a prompt of {longest} tokens + max_tokens {params.max_tokens} is "
                         f"beyond the model's context, {limit} positions")


# ----------------------------------------------------------------------------------------------
# Chapter 19. Fast decode: fewer kernels, replayed from a CUDA graph
# ----------------------------------------------------------------------------------------------
# NEW in stage 07. A decode step at batch 1 reads each weight once (Qwen3-0.6B: 1.2 GB, a
# quarter of a millisecond at copy bandwidth), but the model's own path launches 851 kernels from
# Python to do it, each costing the host more than the GPU. Three changes close much of the gap:
# - Fewer kernels. q, k and v are projected by one matmul over their concatenated weights
#   (fuse_projections), gate and up by another; the q/k norms, RoPE and the cache write are one
#   kernel (qk_norm_rope); at batch 1 the projections run on a matrix-vector kernel (matvec)
#   that takes in the residual add and RMSNorm, or the SwiGLU, in front of it. forward_packed is
#   the step on them, over the tokens of many sequences packed side by side (chapter 24 packs
#   prompts in too): 171 GPU ops at batch 1. Each kernel computes in fp32 and rounds once, so the
#   step equals the model's path up to rounding.
# - No Python between kernels: the step is captured in a CUDA graph per batch-size bucket
#   (StepGraphs) and replayed with one call, the batch padded to its bucket and attention
#   bounded by the longest sequence allowed.
# - No gap between kernels: the stage's kernels launch while the one before them ends
#   (programmatic dependent launch, below).
# What is left is the host's work between steps, which async scheduling overlaps (LLMEngine).
#
# NEW in stage 08: a server's steps. Requests arrive while others decode, so many steps carry
# a prompt beside the decodes, and run eagerly such a step spends more time launching its
# kernels from Python than the GPU spends running them. So StepGraphs captures those steps
# too, a graph per tokens bucket, stopping before the output layer (run on the rows that
# sample), every one captured before a server is ready (ModelRunner.warm_up).

# Programmatic dependent launch (PDL, Hopper on). Even inside a graph a kernel starts only after
# the previous one has ended, and its first loads then take their time while the GPU waits.
# Launched with launch_pdl, the stage's kernels start early: each calls _wait_for_inputs before
# it reads (or writes) anything an earlier kernel touches, and matvec loads its first weight
# tile before that, so the weights are on their way while the previous kernel finishes. A
# kernel that waited also waited for those before it, so every early kernel must wait, in every
# program, even one that reads no earlier output.
@functools.lru_cache(maxsize=None)
def _pdl(device):
    """Whether kernels on `device` launch early (programmatic dependent launch): sm_90 and up."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def _wait_for_inputs(PDL: tl.constexpr):
    # PDL: let the next kernel start launching, then wait for the previous kernel to end and its
    # writes to be visible. Without PDL there is nothing to wait for: the launch itself waited.
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


def add_rms_norm(x, residual, weight, eps):
    """x += residual (in place; residual None: nothing added), then RMSNorm(x) * weight -> a new
    tensor. x, residual (rows, N) contiguous, weight (N,)."""
    _check_norm(x, weight, None)
    if residual is not None:
        _check_tensor("residual", residual, dtypes=(x.dtype,), device=x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
    return _launch_rms_norm(x, residual, weight, eps)


@triton.jit
def _qk_norm_rope_kernel(QKV, POS, SLOTS, INV_FREQ, QW, KW, Q, K, V, eps, stride_ks, stride_kh,
                         Hq: tl.constexpr, Hkv: tl.constexpr, D: tl.constexpr,
                         BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    # One program per token n, all its heads at once (H = Hq + 2 Hkv, padded to BLOCK_H rows),
    # so that its cos and sin are computed once, not once a head. Query heads go to Q (N, Hq, D);
    # key and value heads into the layer's paged cache K, V (slots, Hkv, D) at slot SLOTS[n].
    # Queries and keys are normalized and rotated (rotate-half: value i pairs with i + D/2) at
    # position POS[n]; values pass through.
    _wait_for_inputs(PDL)
    n = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D // 2
    H: tl.constexpr = Hq + 2 * Hkv
    offs = tl.arange(0, HALF)[None, :]  # (1, D/2)
    head = tl.arange(0, BLOCK_H)[:, None]  # (BLOCK_H, 1)
    is_head = head < H
    src = QKV + n * H * D + head * D + offs
    x1 = tl.load(src, mask=is_head, other=0.0).to(tl.float32)  # values 0..D/2-1 of each head
    x2 = tl.load(src + HALF, mask=is_head, other=0.0).to(tl.float32)  # values D/2..D-1
    is_q = head < Hq
    w1 = tl.where(is_q, tl.load(QW + offs), tl.load(KW + offs)).to(tl.float32)
    w2 = tl.where(is_q, tl.load(QW + HALF + offs), tl.load(KW + HALF + offs)).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
    y1 = x1 * rstd[:, None] * w1
    y2 = x2 * rstd[:, None] * w2
    angle = tl.load(POS + n).to(tl.float32) * tl.load(INV_FREQ + offs)  # fp32, as rope_cos_sin
    cos, sin = tl.cos(angle), tl.sin(angle)
    rotated = head < Hq + Hkv  # queries and keys; values pass through
    x1, x2 = (tl.where(rotated, y1 * cos - y2 * sin, x1),
              tl.where(rotated, y2 * cos + y1 * sin, x2))
    slot = tl.load(SLOTS + n)
    is_k = rotated & ~is_q
    is_v = is_head & ~rotated
    q_dst = Q + (n * Hq + head) * D + offs
    k_dst = K + slot * stride_ks + (head - Hq) * stride_kh + offs
    v_dst = V + slot * stride_ks + (head - Hq - Hkv) * stride_kh + offs
    tl.store(q_dst, x1.to(Q.dtype.element_ty), mask=is_q)
    tl.store(q_dst + HALF, x2.to(Q.dtype.element_ty), mask=is_q)
    tl.store(k_dst, x1.to(K.dtype.element_ty), mask=is_k)
    tl.store(k_dst + HALF, x2.to(K.dtype.element_ty), mask=is_k)
    tl.store(v_dst, x1.to(V.dtype.element_ty), mask=is_v)
    tl.store(v_dst + HALF, x2.to(V.dtype.element_ty), mask=is_v)


def qk_norm_rope(qkv, positions, slots, inv_freq, q_weight, k_weight, eps, k_cache, v_cache):
    """qkv (N, (Hq + 2 Hkv) * D) from the fused projection; positions and slots (N,) on the
    device. Normalizes and rotates the queries (returned, (N, Hq, D)) and keys, and writes keys
    and values into k_cache, v_cache (num_blocks, block_size, Hkv, D), one layer of the paged
    cache, at each token's slot: block * block_size + offset in the block."""
    _check_tensor("qkv", qkv)
    for name, t in (("positions", positions), ("slots", slots)):
        _check_tensor(name, t, dtypes=(torch.int32, torch.int64), device=qkv.device)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t, dtypes=(qkv.dtype,), device=qkv.device)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"qk_norm_rope: k_cache and v_cache must be one (blocks, block_size, "
                         f"Hkv, D) shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    N, (Hkv, D) = qkv.shape[0], k_cache.shape[2:]
    Hq = qkv.shape[1] // D - 2 * Hkv if qkv.dim() == 2 else 0
    if (Hq < 1 or qkv.shape[1] != (Hq + 2 * Hkv) * D or positions.shape != (N,)
            or slots.shape != (N,)):
        raise ValueError(f"qk_norm_rope: qkv {tuple(qkv.shape)}, positions "
                         f"{tuple(positions.shape)} and slots {tuple(slots.shape)} do not fit a "
                         f"cache of {Hkv} heads of {D}")
    q = torch.empty(N, Hq, D, dtype=qkv.dtype, device=qkv.device)
    k_slots, v_slots = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)  # (slots, Hkv, D)
    pdl = _pdl(qkv.device)
    _qk_norm_rope_kernel[(N,)](qkv, positions, slots, inv_freq, q_weight, k_weight, q, k_slots,
                               v_slots, eps, *k_slots.stride()[:2], Hq=Hq, Hkv=Hkv, D=D,
                               BLOCK_H=triton.next_power_of_2(Hq + 2 * Hkv), PDL=pdl,
                               launch_pdl=pdl, num_warps=4)
    return q


def qk_norm_rope_torch(qkv, positions, slots, attn, inv_freq, k_cache, v_cache):
    """The torch twin of qk_norm_rope, through the layer's own modules (attn: its Attention)."""
    N, (Hkv, D) = qkv.shape[0], k_cache.shape[2:]
    q, k, v = qkv.view(N, -1, D).split([qkv.shape[1] // D - 2 * Hkv, Hkv, Hkv], dim=1)
    cos, sin = rope_cos_sin(inv_freq, positions[None], qkv.dtype)  # (1, N, D)
    q, k = (apply_rope(norm(x).transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)  # (N, H, D)
            for norm, x in ((attn.q_norm, q), (attn.k_norm, k)))
    k_cache.view(-1, Hkv, D)[slots] = k
    v_cache.view(-1, Hkv, D)[slots] = v
    return q


@triton.jit
def _swiglu_halves_kernel(GU, Y, n, BLOCK: tl.constexpr):
    # GU (rows, 2n): gate | up side by side, as the fused projection writes them -> Y (rows, n)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(GU + row * 2 * n + offs, mask=offs < n).to(tl.float32)
    u = tl.load(GU + row * 2 * n + n + offs, mask=offs < n).to(tl.float32)
    tl.store(Y + row * n + offs, (g * _sigmoid(g) * u).to(Y.dtype.element_ty), mask=offs < n)


def swiglu_halves(gate_up):
    """silu(gate) * up for gate_up (rows, 2n) holding gate then up in each row -> (rows, n)."""
    _check_tensor("gate_up", gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be (rows, 2n), got {tuple(gate_up.shape)}")
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    _swiglu_halves_kernel[(rows, triton.cdiv(n, 1024))](gate_up, y, n, BLOCK=1024, num_warps=4)
    return y


# Matrix-vector products. At batch 1 a projection reads each weight once for two FLOPs: only
# bandwidth counts, and cuBLAS's kernels for one row leave much of it unused (o_proj 12.8 us on
# cuBLAS, 2.8 here). Each program streams BLOCK_N weight rows in BLOCK_K-wide tiles through the
# CUDA cores (one row is too little for the tensor cores) into an fp32 accumulator, summed once
# at the end; many small programs keep loads in flight. The kernel also takes in the work before
# the product: NORM, RMSNorm of x (after ADD, x + residual, which program 0 writes back as the
# residual stream; every program recomputes the row's norm from L2), or SWIGLU, silu(gate) * up
# of x = gate | up. Each rounds where add_rms_norm and swiglu_halves round. Batches of 2 and
# more stay on cuBLAS, where a many-row version lost.
_MATVEC_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
                   for n, k, w in ((2, 1024, 4), (4, 512, 4), (4, 1024, 8), (8, 512, 8),
                                   (16, 512, 4), (16, 512, 8))]
if INTERPRET:
    _MATVEC_CONFIGS = [triton.Config({"BLOCK_N": 4, "BLOCK_K": 32}, num_warps=4)]


@triton.autotune(configs=_MATVEC_CONFIGS, key=["N", "K", "NORM", "ADD", "SWIGLU"])
@triton.jit
def _matvec_kernel(X, R, X_OUT, NORM_W, W, Y, eps, N, K: tl.constexpr, NORM: tl.constexpr,
                   ADD: tl.constexpr, SWIGLU: tl.constexpr, PDL: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Y (N,) = W (N, K) @ x, x read from X (K,), or (2K,) under SWIGLU. NORM: x = RMSNorm(X
    # [+ R]) * NORM_W; ADD: X + R rounded to X's dtype, also written to X_OUT. K is a constexpr:
    # the loops unroll, and the first weight tile is loaded before anything else.
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    w_mask = (offs_n < N)[:, None]
    w = tl.load(w_ptrs, mask=w_mask & (offs_k < K)[None, :], other=0.0)
    _wait_for_inputs(PDL)  # the weights are no earlier kernel's output, the rest may be
    rstd = 0.0
    if NORM:  # a first pass over the row for its rms
        sum_sq = tl.zeros([BLOCK_K], tl.float32)
        for k in tl.static_range(0, K, BLOCK_K):
            x = _matvec_input(X, R, k + offs_k, K, ADD)
            if ADD and pid == 0:
                tl.store(X_OUT + k + offs_k, x, mask=k + offs_k < K)
            sum_sq += x.to(tl.float32) * x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, 0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in tl.static_range(0, K, BLOCK_K):
        cols = k + offs_k
        if k > 0:
            w = tl.load(w_ptrs + k, mask=w_mask & (cols < K)[None, :], other=0.0)
        if SWIGLU:
            g = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)
            u = tl.load(X + K + cols, mask=cols < K, other=0.0).to(tl.float32)
            x = (g * _sigmoid(g) * u).to(W.dtype.element_ty)
        else:
            x = _matvec_input(X, R, cols, K, ADD)
            if NORM:
                nw = tl.load(NORM_W + cols, mask=cols < K, other=0.0).to(tl.float32)
                x = (x.to(tl.float32) * rstd * nw).to(W.dtype.element_ty)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(Y + offs_n, tl.sum(acc, 1).to(Y.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _matvec_input(X, R, cols, K, ADD: tl.constexpr):
    # columns cols of X, plus R's when ADD, rounded as torch's add rounds
    x = tl.load(X + cols, mask=cols < K, other=0.0)
    if ADD:
        r = tl.load(R + cols, mask=cols < K, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
    return x


def matvec(x, weight, *, residual=None, norm_weight=None, eps=1e-6, swiglu=False):
    """x (1, K) @ weight (N, K)^T -> (1, N) on _matvec_kernel, with the elementwise work before
    it fused in:
      norm_weight: the product reads RMSNorm(x') * norm_weight, x' = x + residual (residual
        given) or x; returns (y, x'): x' is the new residual stream (x itself without residual);
      swiglu: x is (1, 2K), gate | up, and the product reads silu(gate) * up."""
    _check_tensor("x", x)
    _check_tensor("weight", weight, dtypes=(x.dtype,), device=x.device)
    if swiglu and norm_weight is not None:
        raise ValueError("matvec: swiglu or norm_weight, not both")
    N, K = weight.shape if weight.dim() == 2 else (0, 0)
    if x.shape != (1, 2 * K if swiglu else K) or weight.dim() != 2:
        raise ValueError(f"matvec: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit "
                         f"(x (1, {'2K' if swiglu else 'K'}), weight (N, K))")
    if residual is not None and norm_weight is None:
        raise ValueError("matvec: residual is added before the norm; give norm_weight too")
    for name, t, shape in (("residual", residual, x.shape), ("norm_weight", norm_weight, (K,))):
        if t is not None:
            _check_tensor(name, t, dtypes=(x.dtype,), device=x.device)
            if t.shape != shape:
                raise ValueError(f"matvec: {name} is {tuple(t.shape)}, expected {tuple(shape)}")
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    x_out = torch.empty_like(x) if residual is not None else x
    pdl = _pdl(x.device)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _matvec_kernel[grid](x, residual, x_out, norm_weight, weight, y, eps, N, K=K,
                         NORM=norm_weight is not None, ADD=residual is not None, SWIGLU=swiglu,
                         PDL=pdl, launch_pdl=pdl)
    return (y, x_out) if norm_weight is not None else y


def _concatenate(*linears):
    """One weight tensor for several nn.Linear that read the same input; each layer's weight
    becomes a view of its rows, so the values, names and memory stay the same."""
    with torch.no_grad():
        fused = torch.cat([linear.weight for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(fused[start:start + rows], linear.weight.requires_grad)
        start += rows
    return fused


def fuse_projections(model):
    """Give every layer one q|k|v weight and one gate|up weight (the parameters become views of
    them). Idempotent; done again where a parameter was replaced since (load_state_dict with
    assign=True, .to() to another device or dtype). Returns the model."""
    for block in model.model.layers:
        attn, mlp = block.self_attn, block.mlp
        if attn.qkv_weight is None or attn.q_proj.weight.data_ptr() != attn.qkv_weight.data_ptr():
            attn.qkv_weight = _concatenate(attn.q_proj, attn.k_proj, attn.v_proj)
        gate_up = mlp.gate_up_weight
        if gate_up is None or mlp.gate_proj.weight.data_ptr() != gate_up.data_ptr():
            mlp.gate_up_weight = _concatenate(mlp.gate_proj, mlp.up_proj)
    return model


def _on_matvec(x, weight):
    """Whether x @ weight^T runs on matvec: a single row of up to 3,072 columns (all of
    Qwen3-0.6B's). cuBLAS streams longer rows better: Qwen3-8B's step was faster on it."""
    return x.shape[0] == 1 and weight.shape[1] <= 3072


def norm_linear(x, residual, norm, weight):
    """norm(x + residual) @ weight^T and x + residual, the new residual stream (residual None:
    x itself); norm: an RMSNorm. On the kernels: one matvec where _on_matvec says so, else
    add_rms_norm (which adds in place) and cuBLAS."""
    if not norm.kernels:  # the torch twin
        x = x if residual is None else x + residual
        return F.linear(norm(x), weight), x
    if _on_matvec(x, weight):
        return matvec(x, weight, residual=residual, norm_weight=norm.weight, eps=norm.eps)
    return F.linear(add_rms_norm(x, residual, norm.weight, norm.eps), weight), x


def linear(x, weight, kernels, swiglu=False):
    """x @ weight^T (swiglu: silu(gate) * up of x = gate | up). On the kernels: matvec where
    _on_matvec says so, else cuBLAS (after swiglu_halves)."""
    if not kernels:
        if swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        return F.linear(x, weight)
    if _on_matvec(x, weight):
        return matvec(x, weight, swiglu=swiglu)
    return F.linear(swiglu_halves(x) if swiglu else x, weight)


@dataclass
class AttentionMetadata:
    """Where a step's packed tokens sit, for the cache writes and attention (all on the device
    but the two bounds). Sequence b's q_len_b new tokens are rows cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1] - 1, its last positions lengths[b] - q_len_b .. lengths[b] - 1; its keys
    are read through row b of block_tables."""
    slots: torch.Tensor  # (N,) int64: each token's slot in the paged cache, block * size + offset
    cu_seqlens_q: torch.Tensor  # (B + 1,) int32
    lengths: torch.Tensor  # (B,) int32: each sequence's keys, this step's included
    block_tables: torch.Tensor  # (B, W) int32
    max_q_len: int  # bounds on the host: the longest q_len, 1 for a decode step,
    max_len: int  # and the longest length
    sample_rows: torch.Tensor  # (S,) int64: the rows whose logits the step needs


# Attention backends (chapter 32): attention(q, k_cache, v_cache, meta) -> (N, Hq, D) for the
# packed queries q (N, Hq, D) over one layer's paged cache, this step's keys already written. The
# Triton one runs a decode step on the paged decode kernel and any other on the paged prefill
# kernel; the torch one gathers each sequence's blocks for plain attention (the CPU's engine).

def triton_attention(q, k_cache, v_cache, meta):
    if meta.max_q_len == 1:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.lengths,
                                      meta.max_len)
    return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                   meta.lengths, meta.max_q_len)


def torch_attention(q, k_cache, v_cache, meta):
    return paged_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                 meta.lengths)


def forward_packed(model, ids, positions, kv, meta, attention, head=True):
    """Logits (S, V) of the rows meta.sample_rows of a step's packed tokens: ids, positions (N,)
    on the device, the tokens of several sequences side by side (whole prompts, chunks of them,
    or one token a sequence when decoding), each attending to its own sequence's cache. kv:
    (k, v) of the paged cache, (L, blocks, block_size, Hkv, D) each; every token's key and value
    are written at its slot first. On the fused kernels when model.kernels (then
    fuse_projections(model) first), else on the torch twins; attention: a backend above.
    head=False stops before the output layer: -> (x, h), the residual stream and what the last
    sub-block adds, (N, C) each."""
    N, kernels = ids.shape[0], model.kernels
    x = model.model.embed_tokens(ids)  # (N, C): the residual stream
    h = None  # what the last sub-block adds to x
    for layer, block in enumerate(model.model.layers):
        attn, mlp = block.self_attn, block.mlp
        k_cache, v_cache = kv[0][layer], kv[1][layer]  # (blocks, block_size, Hkv, D)
        qkv, x = norm_linear(x, h, block.input_layernorm, attn.qkv_weight)
        if kernels:
            q = qk_norm_rope(qkv, positions, meta.slots, model.inv_freq, attn.q_norm.weight,
                             attn.k_norm.weight, attn.q_norm.eps, k_cache, v_cache)
        else:
            q = qk_norm_rope_torch(qkv, positions, meta.slots, attn, model.inv_freq, k_cache,
                                   v_cache)
        out = attention(q, k_cache, v_cache, meta)  # (N, Hq, D)
        h = linear(out.view(N, -1), attn.o_proj.weight, kernels)  # (N, C)
        gate_up, x = norm_linear(x, h, block.post_attention_layernorm, mlp.gate_up_weight)
        h = linear(gate_up, mlp.down_proj.weight, kernels, swiglu=True)
    if not head:
        return x, h
    if meta.sample_rows.shape[0] != N:  # only the rows that sample need the output layer
        if meta.sample_rows.shape[0] == 0:  # a step of prompt chunks that all go on
            return x.new_empty(0, model.cfg.vocab_size)
        x, h = x[meta.sample_rows], h[meta.sample_rows]
    return norm_linear(x, h, model.model.norm, model.output_weight())[0]


CAPTURE_KEYS = 512  # the keys of each decode in ModelRunner.warm_up's made-up steps


def graph_bucket(batch):
    """The batch size a graph is captured for: 1, 2, 4, 8, then multiples of 8 (vLLM's buckets),
    so that a few graphs serve every batch and padding wastes at most 7 rows."""
    return triton.next_power_of_2(batch) if batch <= 8 else triton.cdiv(batch, 8) * 8


def token_bucket(tokens):
    """The packed tokens a graph of other steps is captured for: 16, 24, 32, 48, 64, 96, ... (two
    a doubling), so that 19 graphs cover 8,192 tokens and padding wastes under a third."""
    size = triton.next_power_of_2(max(tokens, 16))
    return size * 3 // 4 if 16 < tokens <= size * 3 // 4 else size


class StepGraphs:
    """forward_packed of a step captured in a CUDA graph per shape, over one paged cache. A
    decode step (one token a sequence) has a graph per batch-size bucket, the batch padded with
    rows of their own (length 0, the scratch slot). Any other step (prompts, chunks of them, and
    the decodes beside them: a server's steps) has one per tokens bucket over `rows` sequences,
    padded with tokens of no sequence (the scratch slot) and sequences of no tokens; its graph
    stops before the output layer, which the caller runs on the rows that sample, so neither
    their number nor the batch's is part of its shape. Attention is bounded by max_len, and the
    prefill kernel's grid by the graph's tokens and rows: a graph's launches never depend on the
    step's lengths. The graphs share one memory pool: they never run at the same time."""

    def __init__(self, model, kv, max_len, attention, rows):
        self.model, self.kv, self.max_len, self.attention = model, kv, max_len, attention
        self.rows = rows  # the sequences of a graph of other steps
        self.width = triton.cdiv(max_len, kv[0].shape[2])  # blocks of the longest sequence
        self.graphs = {}  # (tokens, decode) -> cuda_graph's replay
        self.pool = torch.cuda.graph_pool_handle()

    @torch.inference_mode()  # the graphs' buffers are inference tensors (ModelRunner's mode)
    def __call__(self, ids, positions, meta):
        """A decode step: its logits (bucket, V); another step: (x, h), forward_packed's residual
        stream and what its last sub-block adds, (tokens, C) each. Every input has its graph's
        shape."""
        decode = meta.max_q_len == 1
        tables = F.pad(meta.block_tables, (0, self.width - meta.block_tables.shape[1]))
        inputs = (ids, positions, meta.slots, meta.lengths, meta.cu_seqlens_q, tables)
        key = (ids.shape[0], decode)
        if key not in self.graphs:
            sample_rows = meta.sample_rows if decode else None

            def step(ids, positions, slots, lengths, cu_seqlens_q, tables):
                meta = AttentionMetadata(slots, cu_seqlens_q, lengths, tables,
                                         1 if decode else ids.shape[0], self.max_len, sample_rows)
                return forward_packed(self.model, ids, positions, self.kv, meta, self.attention,
                                      head=decode)
            self.graphs[key] = cuda_graph(step, *inputs, pool=self.pool)
        return self.graphs[key](*inputs)


# ----------------------------------------------------------------------------------------------
# Chapter 24. The engine, part by part: a request (Sequence)
# ----------------------------------------------------------------------------------------------
# Engine v1 runs one static batch to its end. The engine from here on serves requests as they
# come, through small parts with vLLM's names (ENGINE.md), one way: a prompt becomes a Sequence,
# the Scheduler picks the sequences of the next step and how many tokens each runs, the
# BlockManager hands out the blocks of the paged KV cache they need, the ModelRunner packs them
# into one forward pass and the Sampler picks their tokens, each Sequence takes its new tokens,
# and the requests that advanced come back as RequestOutputs. The model never sees a Sequence and
# the scheduler never sees a tensor. LLMEngine.step is the loop's body; LLM.generate runs it
# until every request is done, and stage 08's server calls it from its own loop.

class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request: its token ids (the prompt, then the output), its sampling rules and where it
    stands. Its status goes WAITING -> RUNNING -> FINISHED, back to WAITING when it is
    preempted, changed by the scheduler only. The keys and values of its first
    num_computed_tokens tokens are in the cache (or being written by a launched step), in the
    blocks of block_table; under async scheduling num_pending more tokens were sampled on the
    device and are not read back yet."""

    def __init__(self, request_id, prompt_token_ids, params, max_tokens, vocab_size, grammar=None,
                 generator=None):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.max_tokens = max_tokens  # params.max_tokens, or what the context leaves
        self.grammar = grammar  # structured output's TokenMasker, or None
        self.grammar_state = None if grammar is None else grammar.start  # its automaton's state
        self.generator = generator  # a seeded request's own random stream
        self.sampling_row = sampling_row(params, vocab_size)  # its numbers, for SamplingBatch
        # its next step needs its last token on the host (LLMEngine._needs_tokens)
        self.needs_tokens = grammar is not None or params.has_penalties
        self.status = SequenceStatus.WAITING
        self.finish_reason = None
        self.stop_token_id = None  # the eos or stop id that ended it, if one did: not text
        self.logprobs = [] if params.logprobs is not None else None  # one {id: logprob} a token
        self.block_table = []
        self.num_computed_tokens = 0
        self.num_pending = 0
        # speculative decoding: the tokens proposed for the next step (and a draft model's
        # probabilities for them, (k, V)), the positions the draft model has in its cache, and
        # the mean number of drafts accepted a step (a moving average, from all k accepted)
        self.draft_tokens, self.draft_probs = [], None
        self.num_draft_computed = 0
        self.mean_accepted = math.inf

    @property
    def num_tokens(self):
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self):
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self):
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self):
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self):
        return self.status is SequenceStatus.FINISHED

    def append(self, token, logprobs=None):
        self.token_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
        if self.grammar is not None:
            self.grammar_state = self.grammar.next_state(self.grammar_state, token)
            assert self.grammar_state != DEAD, f"token {token} was sampled against its mask"

    def step_tokens(self, budget):
        """How many tokens the next step runs for this sequence, at most `budget`: those whose
        keys are not in the cache yet, then its draft tokens (speculative decoding), the drafts
        cut to what the budget leaves."""
        needed = self.num_tokens - self.num_computed_tokens
        self.draft_tokens = self.draft_tokens[:max(0, budget - needed)]
        return min(needed + len(self.draft_tokens), budget)

    def settle_drafts(self, num_new):
        """A step verified this sequence's drafts and gave it num_new tokens: num_new - 1 drafts
        accepted. The rejected drafts' positions are computed again later, and the draft model's
        cache past here holds drafts that were not accepted."""
        if self.draft_tokens:
            self.num_computed_tokens -= len(self.draft_tokens) - (num_new - 1)
            self.draft_tokens, self.draft_probs = [], None
        self.num_draft_computed = min(self.num_draft_computed, self.num_computed_tokens)


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's name): index j of its n."""
    index: int
    token_ids: list  # the generated ids, the eos or stop id that ended it included
    text: str | None  # their text, without that final eos or stop id and (vLLM's default,
    #                   skip_special_tokens) without special tokens; None without a tokenizer,
    #                   and until it ends
    finish_reason: str | None  # "stop": an eos or stop id, or structured output complete;
    #                            "length": max_tokens or the context limit; "abort"; None: running
    logprobs: list | None = None  # when asked: a {id: logprob} a token, the sampled id's and the
    #                               top ones


@dataclass
class RequestOutput:
    """A request's result (vLLM's shape): what LLM.generate returns for a prompt, its n
    completions in `outputs`, and what LLMEngine.step returns for each request that advanced
    (one completion, its tokens so far)."""
    request_id: object
    prompt_token_ids: list
    outputs: list  # CompletionOutput, n of them

    @property
    def finished(self):
        return all(out.finish_reason is not None for out in self.outputs)


# ----------------------------------------------------------------------------------------------
# Chapters 25 and 31. The paged KV cache (BlockManager): blocks, block tables, prefix caching
# ----------------------------------------------------------------------------------------------
# The model runner's cache is a pool of num_blocks blocks of block_size token slots, and each
# sequence owns a block table: the ids of its blocks, in token order (tokens [i * block_size,
# (i + 1) * block_size) live in block table[i]). No sequence reserves its longest possible length
# up front: it takes a block when it needs one, and the only waste is its last block's tail.
#
# Sequences whose prompts start alike (a system prompt, a chat's earlier turns) share the blocks
# of that prefix (chapter 31), so a block counts the tables that hold it. A full block is named
# by a chained hash of its tokens and its parent block's hash, because its keys and values depend
# on every token before it. A cached block whose count falls to 0 keeps its contents and name for
# a later prompt to find; it is reused for other tokens only when the free list is empty, least
# recently freed first (LRU).

def block_hash(parent, token_ids):
    """The 16-byte chained hash of a full block: its parent block's hash (None for a sequence's
    first block) and its token ids. blake2b makes a hit mean the same tokens after the same
    prefix, not merely the same bucket."""
    data = (parent or bytes(16)) + np.asarray(token_ids, dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


class BlockManager:
    """The bookkeeping of the paged KV cache, no tensors: which blocks are free, which sequences
    hold which, and which full blocks can be found again by their contents. A block is in exactly
    one of three places: the free list, the evictable LRU (reference count 0, still cached), or
    in use (held by at least one block table)."""

    def __init__(self, num_blocks, block_size=16, enable_prefix_caching=True):
        if not _is_int(num_blocks) or num_blocks < 1:
            raise ValueError(f"BlockManager: num_blocks = {num_blocks!r} must be a positive int")
        if not _is_int(block_size) or block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"BlockManager: block_size = {block_size!r} must be a positive int "
                             "and a power of two (the attention kernels tile by it)")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"BlockManager: enable_prefix_caching = {enable_prefix_caching!r} "
                             "must be True or False")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks = deque(range(num_blocks))  # count 0, nothing cached in them
        self.ref_counts = [0] * num_blocks
        self.hashes = [None] * num_blocks  # a full block's chained hash, registered or not
        self.cached = {}  # hash -> the one block registered under it
        self.evictable = OrderedDict()  # cached blocks of count 0, least recently freed first
        self.reset_stats()

    @property
    def num_free_blocks(self):
        return len(self.free_blocks) + len(self.evictable)

    @property
    def prefix_hit_rate(self):
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def reset_stats(self):
        self.hit_tokens = self.query_tokens = 0

    def blocks_needed(self, table, num_tokens):
        return max(0, -(-num_tokens // self.block_size) - len(table))

    def allocate_prefix(self, table, token_ids):
        """At admission: append the cached blocks that begin token_ids to the empty table and
        return how many tokens they hold. The last token is never covered, so its logits are
        computed and the sequence's first write lands in a block of its own."""
        assert not table, "allocate_prefix starts a block table, it does not extend one"
        if not self.enable_prefix_caching:
            return 0
        bs, parent = self.block_size, None
        for i in range((len(token_ids) - 1) // bs):
            parent = block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            block = self.cached.get(parent)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
            table.append(block)
        self.query_tokens += len(token_ids)
        self.hit_tokens += len(table) * bs
        return len(table) * bs

    def grow(self, table, num_tokens):
        """Append fresh blocks until the table holds num_tokens slots: all of them, or, when too
        few blocks are free, none (False)."""
        needed = self.blocks_needed(table, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            if self.free_blocks:
                block = self.free_blocks.popleft()
            else:  # evict: new tokens will overwrite its contents, so its name must go too
                block, _ = self.evictable.popitem(last=False)
                del self.cached[self.hashes[block]]
                self.hashes[block] = None
            assert self.ref_counts[block] == 0 and self.hashes[block] is None, (
                f"block {block} handed out while held or named")
            self.ref_counts[block] = 1
            table.append(block)
        return True

    def reset_prefix_cache(self):
        """Forget every cached block no sequence holds (vLLM's reset_prefix_cache): each goes
        back to the free list, nameless. For benchmarks, whose runs must not find the last
        run's prompts."""
        for block in self.evictable:
            self.hashes[block] = None
            self.free_blocks.append(block)
        self.evictable.clear()
        self.cached = {h: b for h, b in self.cached.items() if self.ref_counts[b] > 0}

    def cache_full_blocks(self, table, token_ids, start, end):
        """Tokens [start, end) now have their keys and values in the cache: name each block that
        became full, so that later prompts can find it. Only those blocks are touched, since
        this runs for every sequence every step."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        assert 0 <= start <= end <= len(token_ids) and end <= len(table) * bs, (start, end)
        for i in range(start // bs, end // bs):
            parent = self.hashes[table[i - 1]] if i else None
            assert i == 0 or parent is not None, f"block {i} is cached before its parent"
            h = block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            block = table[i]
            assert self.hashes[block] in (None, h), f"block {block}'s tokens changed"
            # Two sequences may have computed the same block; the first stays the one found,
            # the second keeps its hash so that its own children chain from it.
            self.hashes[block] = h
            self.cached.setdefault(h, block)

    def free(self, table):
        """A finished or preempted sequence lets go of its blocks. Its last block goes first, so
        that under eviction a shared prefix loses its tail before its head."""
        for block in reversed(table):
            assert self.ref_counts[block] > 0, f"block {block} freed more often than taken"
            self.ref_counts[block] -= 1
            if self.ref_counts[block]:
                continue
            if self.cached.get(self.hashes[block]) == block:
                self.evictable[block] = None
            else:
                self.hashes[block] = None
                self.free_blocks.append(block)
        table.clear()

    def verify(self, tables):
        """Assert the invariants, given the block table of every live sequence."""
        held = Counter()
        for table in tables:
            assert len(set(table)) == len(table), f"a block table holds a block twice: {table}"
            held.update(table)
        free, evictable = set(self.free_blocks), set(self.evictable)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        assert not free & evictable, f"blocks both free and evictable: {free & evictable}"
        assert not (free | evictable) & held.keys(), (
            f"blocks free or evictable but held by a table: {(free | evictable) & held.keys()}")
        assert len(free) + len(evictable) + len(held) == self.num_blocks, (
            f"free {len(free)} + evictable {len(evictable)} + used {len(held)} != "
            f"{self.num_blocks} blocks")
        unknown = (free | evictable | held.keys()) - set(range(self.num_blocks))
        assert not unknown, f"block ids outside the pool: {unknown}"
        for block, count in enumerate(self.ref_counts):
            assert count == held[block], (
                f"block {block}: reference count {count}, but {held[block]} tables hold it")
        for h, block in self.cached.items():
            assert self.hashes[block] == h, f"the hash map names block {block} for another hash"
        for block in evictable:
            assert self.cached.get(self.hashes[block]) == block, f"evictable {block} not cached"
        for block in free:
            assert self.hashes[block] is None, f"free block {block} still has a hash"
        assert self.enable_prefix_caching or not self.cached, "cached blocks without caching"


# ----------------------------------------------------------------------------------------------
# Chapter 24. Continuous batching: the Scheduler
# ----------------------------------------------------------------------------------------------
# A static batch runs until its longest request ends: a request that finishes early leaves its
# row idle, and a new one waits for the whole batch. Continuous batching (Orca, Yu et al. 2022)
# decides every step which sequences run: one that finishes leaves at once, and a waiting one
# joins the next step. A step then mixes kinds of work: decodes of running sequences (one token
# each) and prefills of new ones (many tokens), packed side by side into one forward pass
# (forward_packed). Two budgets bound a step: max_num_seqs sequences and max_num_batched_tokens
# tokens. A long prompt does not stall the decodes for a whole step of its own: it is
# prefilled in chunks of what the budget leaves after them (chunked prefill, Agrawal et al.
# 2023), one chunk a step. The blocks of the paged cache are the third limit: when none is left
# for a running sequence's next token, the latest admitted sequence is preempted (vLLM's
# recompute policy): its blocks are freed and it waits at the head of the queue, to be
# prefilled again with everything it has generated so far.

# NEW in stage 08: prefill_first, for a server's time to first token (TTFT). A prompt packed
# beside the running decodes waits for the whole mixed step (Qwen3-0.6B, a 512-token prompt:
# 2.7 ms alone, 4.9 ms beside 63 decodes). With prefill_first a step with prompt tokens to run
# runs those only, and the decodes wait a step (the order of vLLM's first scheduler); the
# server turns it on. So that a stream of arrivals cannot starve the decodes, they wait at most
# MAX_DECODE_WAIT steps in a row.

MAX_DECODE_WAIT = 4  # a burst of 64 prompts of 512 tokens is 4 steps of 8,192 tokens


class Scheduler:
    """Which sequences run in the next step, and how many of their tokens. Running sequences
    first, oldest first (a decode takes one token of the budget, a prompt being prefilled its
    next chunk); then waiting ones, first come first served, while the step has budget and a
    sequence slot left, the last one admitted possibly with a chunk of its prompt only. The
    step's tokens never exceed the budget; a preempted sequence resumes with the output it had.
    config: the EngineConfig (its budgets, max_num_seqs and max_num_batched_tokens, and
    prefill_first)."""

    def __init__(self, block_manager, config, eos_token_ids):
        self.block_manager, self.block_size = block_manager, block_manager.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefill_first = config.prefill_first
        self.decodes_waited = 0  # steps in a row that ran prompts only while sequences decode
        self.waiting = deque()
        self.running = []  # in the order of admission: the last one is preempted first
        self.num_preemptions = 0

    def enqueue(self, seq):
        self.waiting.append(seq)

    def has_work(self):
        return bool(self.waiting or self.running)

    def schedule(self):
        """[(sequence, its new tokens this step)], and each sequence's num_computed_tokens moved
        past them. A decode's draft tokens (speculative decoding) count as new tokens, the last
        ones, cut to what the budget leaves. With prefill_first, a step with prompt tokens to
        run (a prompt waiting that fits, or one being prefilled in chunks) runs those only,
        unless the decodes have already waited MAX_DECODE_WAIT steps."""
        if (self.prefill_first and self.decodes_waited < MAX_DECODE_WAIT
                and self._prompts_ready()):
            decoding = any(seq.num_tokens - seq.num_computed_tokens <= 1
                           and seq.num_output_tokens < seq.max_tokens for seq in self.running)
            batch = self._batch(decodes=False)
            if batch:
                self.decodes_waited += decoding
                return batch
            # (empty: the waiting prompt found no KV blocks, and the decodes must run to free some)
        self.decodes_waited = 0
        return self._batch(decodes=True)

    def _prompts_ready(self):
        return bool(self.waiting and not self.waiting[0].num_pending
                    and len(self.running) < self.max_num_seqs) or any(
            seq.num_tokens - seq.num_computed_tokens > 1 for seq in self.running)

    def _batch(self, decodes):
        budget, batch, preempted = self.max_num_batched_tokens, [], False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.num_output_tokens >= seq.max_tokens:
                continue  # preempted in this loop, or its last token is on its way
            if seq.num_tokens - seq.num_computed_tokens <= 1 and not decodes:
                continue
            n = seq.step_tokens(budget)
            while (seq.num_computed_tokens + n > len(seq.block_table) * self.block_size
                   and not self.block_manager.grow(seq.block_table, seq.num_computed_tokens + n)):
                preempted = True
                self.preempt(self.running[-1])
                if seq.status is not SequenceStatus.RUNNING:
                    break
            if seq.status is SequenceStatus.RUNNING:
                batch.append((seq, n))
                budget -= n
        while (self.waiting and budget and len(self.running) < self.max_num_seqs
               and not preempted and not self.waiting[0].num_pending):
            seq = self.waiting[0]
            cached = self.block_manager.allocate_prefix(seq.block_table, seq.token_ids)
            n = min(seq.num_tokens - cached, budget)
            if not self.block_manager.grow(seq.block_table, cached + n):
                self.block_manager.free(seq.block_table)
                break
            self.waiting.popleft()
            seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, cached
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        for seq, n in batch:
            seq.num_computed_tokens += n
        return batch

    def preempt(self, seq):
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
        seq.draft_tokens, seq.draft_probs, seq.num_draft_computed = [], None, 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq, reason):
        """End a sequence wherever it is (a queue or the running batch) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def update(self, seqs, tokens, logprobs):
        """Give each sequence its new tokens (a list each) and find the ones they end. Returns
        the sequences that advanced, and [(sequence, finish reason)] of those to finish once the
        step's blocks are registered (LLMEngine._hand_over)."""
        advanced, ended = [], []
        for seq, new, new_logprobs in zip(seqs, tokens, logprobs):
            seq.num_pending -= 1
            seq.settle_drafts(len(new))
            if seq.is_finished:  # ended (by eos, or aborted) while this step ran
                continue
            for token, token_logprobs in zip(new, new_logprobs):
                seq.append(token, token_logprobs)
                reason = self._finish_reason(seq, token)
                if reason is not None:
                    if reason == "stop" and not self._grammar_finished(seq):
                        seq.stop_token_id = token
                    ended.append((seq, reason))
                    break
            advanced.append(seq)
        return advanced, ended

    def register_computed(self, spans):
        """Blocks that a step filled become reusable by later prompts (prefix caching): the one
        place where they are named. spans: [(sequence, start, end)], the positions the step
        computed; their tokens are all known by now. A sequence preempted since then has lost
        those blocks; one that the step ends is finished only after this, so that the next
        request with the same prompt finds them."""
        bs = self.block_size
        for seq, start, end in spans:
            end = min(end, seq.num_computed_tokens)  # (rejected drafts are not computed)
            if seq.status is SequenceStatus.RUNNING and end // bs > start // bs:  # a block filled
                self.block_manager.cache_full_blocks(seq.block_table, seq.token_ids, start, end)

    def _finish_reason(self, seq, token):
        # Under a grammar the mask allows eos only where the text is complete, and there eos ends
        # the request even with ignore_eos: the text can only be finished, not continued.
        eos_ends = not seq.params.ignore_eos or seq.grammar is not None
        if token in seq.params.stop_token_ids or (eos_ends and token in self.eos_token_ids):
            return "stop"
        if self._grammar_finished(seq):  # the automaton accepts, and nothing may follow
            return "stop"
        if len(seq.token_ids) - seq.num_prompt_tokens >= seq.max_tokens:
            return "length"
        return None

    @staticmethod
    def _grammar_finished(seq):
        return seq.grammar is not None and seq.grammar.is_complete(seq.grammar_state)


# ----------------------------------------------------------------------------------------------
# Chapters 19 and 33. The ModelRunner: a step's tensors, its forward pass, its CUDA graphs
# ----------------------------------------------------------------------------------------------

class StepHandle:
    """A launched step: the positions it computed, and the tokens it sampled on their way to the
    host, which wait() waits for (once: a second call returns the same lists)."""

    def __init__(self, spans, seqs, tokens, copied):
        self.spans = spans  # [(sequence, start, end)]: the positions computed, as scheduled
        self.seqs = seqs  # the sequences that sampled
        self.rows = {seq: row for row, seq in enumerate(seqs)}  # a sequence's row in tokens
        self.num_drafts = [len(seq.draft_tokens) for seq in seqs]  # drafts each one verifies
        self.tokens = tokens  # (S,) on the device: one token a sequence (no speculation)
        self._copied, self._tokens = copied, None

    def wait(self):
        """(new tokens, logprobs): a list of each per sequence."""
        if self._tokens is None:
            self._tokens = self._copied()
        return self._tokens


class ModelRunner:
    """Turns a step's packed sequences into tensors, runs the model and samples. It owns the
    paged KV cache, allocated once; on a GPU (unless enforce_eager) its steps replay CUDA
    graphs (StepGraphs), else run forward_packed eagerly. launch() only queues the work and
    starts copying the sampled tokens back: the StepHandle's wait() waits for them."""

    def __init__(self, model, num_blocks, block_size, max_model_len, enforce_eager=False,
                 max_num_seqs=256):
        self.model = fuse_projections(model)
        cfg = model.cfg
        self.device, self.dtype = _device_of(model), model.model.embed_tokens.weight.dtype
        self.vocab_size, self.block_size = cfg.vocab_size, block_size
        self.max_len = triton.cdiv(max_model_len, block_size) * block_size  # the blocks' reach
        self.attention = triton_attention if model.kernels else torch_attention
        # one block more than the manager hands out: the scratch block, where a graph's padding
        # rows write their keys and values
        shape = (cfg.num_hidden_layers, num_blocks + 1, block_size, cfg.num_key_value_heads,
                 cfg.head_dim)
        self.kv = (torch.zeros(shape, device=self.device, dtype=self.dtype),
                   torch.zeros(shape, device=self.device, dtype=self.dtype))
        self.scratch_slot = num_blocks * block_size
        graphed = self.device.type == "cuda" and model.kernels and not enforce_eager
        self.graphs = (StepGraphs(self.model, self.kv, self.max_len, self.attention,
                                  max_num_seqs) if graphed else None)
        self.sampler = Sampler()

    @torch.inference_mode()
    def warm_up(self, max_num_seqs, max_num_batched_tokens):
        """Compile, autotune and capture now what a step can need, as vLLM does before it serves,
        so that the first requests run as fast as later ones. A Triton kernel is tuned on its
        first call at each key, so each runs here on made-up steps like a busy engine's, every
        token reading and writing the scratch block only (no sequence's keys change): for each
        tokens bucket of StepGraphs (changed in 08: a graph each), a step of
        that many tokens, an eighth of them decodes of CAPTURE_KEYS keys and the rest a prompt
        (tuned on a prompt alone its tiles come out wide, and a decode's token then fills a
        sliver of each); then a decode step of each batch bucket up to max_num_seqs, rows of
        CAPTURE_KEYS keys, its graph captured (largest first: the smaller ones reuse its
        memory). On a GPU with the kernels; a speculative step's wider buckets are captured when
        first met. Returns the seconds it took."""
        if self.device.type != "cuda" or not self.model.kernels:
            return 0.0
        start, bs = time.perf_counter(), self.block_size
        scratch, keys = self.scratch_slot // bs, min(CAPTURE_KEYS, self.max_len)
        decode = ([0], None, keys - 1, [scratch] * triton.cdiv(keys, bs), 1)
        sizes = {token_bucket(n) for n in range(2, max_num_batched_tokens + 1)}
        for tokens in sorted(sizes):
            decodes = max(0, min(tokens // 8, max_num_seqs - triton.cdiv(tokens, self.max_len)))
            rest = tokens - decodes
            chunks = [min(self.max_len, rest - at) for at in range(0, rest, self.max_len)]
            entries = [decode] * decodes + [([0] * n, None, 0, [scratch] * triton.cdiv(n, bs), 1)
                                            for n in chunks]
            if len(entries) <= max_num_seqs:  # (more: a step the scheduler never makes)
                self.run(entries)
        if self.graphs is not None:
            for batch in sorted({graph_bucket(b) for b in range(1, max_num_seqs + 1)},
                                reverse=True):
                self.run([decode] * batch)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    @torch.inference_mode()
    def launch(self, batch, previous=None):
        """Queue one step: batch = [(sequence, its new tokens)] as scheduled (num_computed_tokens
        already past them, a sequence's draft tokens last). A new token not yet on the host is
        the one `previous` (a StepHandle) sampled: it is read on the device. Returns a
        StepHandle."""
        entries, seqs, spans = [], [], []
        for seq, n in batch:
            end, k = seq.num_computed_tokens, len(seq.draft_tokens)
            start = end - n
            ids, from_previous = seq.token_ids[start:end - k], None
            if len(ids) < n - k:  # the last one is on its way from the previous step
                ids, from_previous = ids + [0], previous.rows[seq]
            samples = 0
            if end - k == seq.num_tokens:  # all its tokens are in: it samples (k + 1 rows)
                samples = k + 1
                seqs.append(seq)
            if k and len(ids) == 1:
                # a decode and its drafts: k + 1 entries of one token each, at successive
                # positions over the same blocks, as k + 1 decodes; each layer writes all their
                # keys before any attends, so token i still sees tokens < i. The step is then
                # decode-shaped, and its CUDA graph replays it
                entries += [([t], None, start + i, seq.block_table, 1)
                            for i, t in enumerate(ids + seq.draft_tokens)]
            else:
                entries.append((ids + seq.draft_tokens, from_previous, start, seq.block_table,
                                samples))
            spans.append((seq, start, end))
        logits = self.run(entries, previous.tokens if previous is not None else None)
        plain = [seq for seq in seqs if not seq.draft_tokens]
        tokens = logprobs = None
        if plain:
            if len(plain) < len(seqs):  # a speculative step: the plain rows' logits, one each
                ends = np.cumsum([len(seq.draft_tokens) + 1 for seq in seqs]) - 1
                logits_plain = logits[self._to_device(
                    [end for end, seq in zip(ends, seqs) if not seq.draft_tokens], torch.int64)]
            else:
                logits_plain = logits
            masks = [None if s.grammar is None else s.grammar.mask(s.grammar_state) for s in plain]
            tokens, logprobs = self.sampler(logits_plain, self.sampling_batch(plain), masks)
        read_plain = self._read_back(tokens, logprobs)
        read_spec = self._verify(seqs, logits) if len(plain) < len(seqs) else None

        def lists():
            """A list of new tokens and one of logprobs per sequence, in seqs' order."""
            tokens_list, logprobs_tensors = read_plain()
            new = [[t] for t in tokens_list]
            logprobs_list = [[x] for x in self.logprobs_lists(plain, tokens_list, logprobs_tensors)]
            if read_spec is None:
                return new, logprobs_list
            per_seq = dict(zip(plain, zip(new, logprobs_list)))
            per_seq.update(read_spec())
            new = [per_seq[seq] for seq in seqs]
            return [t for t, _ in new], [lp for _, lp in new]
        return StepHandle(spans, seqs, tokens, lists)

    def sampling_batch(self, seqs, repeat=1):
        """The SamplingBatch of the sequences, each in `repeat` rows (one per verified position).
        The prompts and outputs (copies) only where a penalty needs them."""
        seqs = [seq for seq in seqs for _ in range(repeat)]
        params = [s.params for s in seqs]
        penalties = any(s.needs_tokens and s.params.has_penalties for s in seqs)
        return SamplingBatch(params, [s.prompt_token_ids for s in seqs] if penalties else None,
                             self.vocab_size, self.device,
                             outputs=[s.output_token_ids for s in seqs] if penalties else None,
                             generators=[s.generator for s in seqs] if repeat == 1 else None,
                             rows=[s.sampling_row for s in seqs])

    @torch.inference_mode()
    def run(self, entries, previous_tokens=None):
        """One packed forward pass. entries: [(ids, from_previous, start, block_table, samples)]:
        a sequence's new token ids (a list) at positions start.., the last one taken on the
        device from previous_tokens[from_previous] when that is not None; `samples`: how many
        of its last rows need logits. Returns those logits (rows, V), in order."""
        bs = self.block_size
        ids, pending, positions, slots, lengths, tables, sample_rows = [], [], [], [], [], [], []
        cu = [0]
        for tokens, from_previous, start, table, samples in entries:
            end = start + len(tokens)
            if from_previous is not None:
                pending.append((len(ids) + len(tokens) - 1, from_previous))
            ids += tokens
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            lengths.append(end)
            tables.append(table)
            cu.append(len(ids))
            sample_rows += range(len(ids) - samples, len(ids))
        decode = len(ids) == len(entries)
        graphed = self.graphs is not None and (decode or len(entries) <= self.graphs.rows)
        if graphed and decode:  # padded to its bucket: rows that read nothing, write the scratch
            pad = graph_bucket(len(ids)) - len(ids)
            ids, positions, lengths = ids + [0] * pad, positions + [0] * pad, lengths + [0] * pad
            slots += [self.scratch_slot] * pad
            cu += range(cu[-1] + 1, cu[-1] + pad + 1)
        elif graphed:  # token rows of no sequence, sequences of no tokens
            pad = token_bucket(len(ids)) - len(ids)
            ids, positions = ids + [0] * pad, positions + [0] * pad
            slots += [self.scratch_slot] * pad
            lengths += [0] * (self.graphs.rows - len(entries))
            cu += [cu[-1]] * (self.graphs.rows - len(entries))
        table_array = np.zeros((len(lengths), max(map(len, tables))), dtype=np.int32)
        for row, table in enumerate(tables):
            table_array[row, :len(table)] = table
        # two copies to the device, of the int64 inputs and of the int32 ones, not one an input:
        # each copy costs the host tens of microseconds, while the GPU runs the last step
        dst, src = zip(*pending) if pending else ((), ())
        ids_d, positions_d, slots_d, rows_d, dst, src = self._ints_to_device(
            torch.int64, ids, positions, slots, sample_rows, dst, src)
        cu_d, lengths_d, tables_d = self._ints_to_device(torch.int32, cu, lengths,
                                                         table_array.ravel())
        if pending:
            ids_d[dst] = previous_tokens[src]
        meta = AttentionMetadata(
            slots=slots_d, cu_seqlens_q=cu_d, lengths=lengths_d,
            block_tables=tables_d.view(table_array.shape),
            max_q_len=max(len(e[0]) for e in entries), max_len=table_array.shape[1] * bs,
            sample_rows=rows_d)
        if not graphed:
            return forward_packed(self.model, ids_d, positions_d, self.kv, meta, self.attention)
        if not decode:  # the output layer on the rows that sample, outside the graph
            x, h = self.graphs(ids_d, positions_d, meta)
            if not sample_rows:  # a step of prompt chunks that all go on
                return x.new_empty(0, self.vocab_size)
            return norm_linear(x[rows_d], h[rows_d], self.model.model.norm,
                               self.model.output_weight())[0]
        meta.sample_rows = torch.arange(len(ids), device=self.device)
        logits = self.graphs(ids_d, positions_d, meta)  # (bucket, V)
        return logits if len(sample_rows) == len(ids) else logits[rows_d]

    def _verify(self, seqs, logits):
        """Speculative decoding's check of the sequences of a step that carry draft tokens:
        logits holds k + 1 rows for each of seqs (1 for one without drafts, skipped here). The
        target's distribution at each position, then rejection_sample. Returns a function that
        waits for the result: {sequence: (new tokens, logprobs)}."""
        index, start, drafted = [], 0, []
        K = max(len(seq.draft_tokens) for seq in seqs)
        for seq in seqs:
            k = len(seq.draft_tokens)
            if k:  # (K + 1) rows of logits, the last one repeated past k
                index.append([start + min(i, k) for i in range(K + 1)])
                drafted.append(seq)
            start += k + 1
        index = self._to_device(index, torch.int64)
        probs = Sampler.probs(logits[index.flatten()].float(), self.sampling_batch(
            drafted, repeat=K + 1)).view(len(drafted), K + 1, -1)  # (B, K + 1, V)
        drafts = self._to_device(  # (B, K)
            [s.draft_tokens + [0] * (K - len(s.draft_tokens)) for s in drafted], torch.int64)
        num_draft = self._to_device([len(s.draft_tokens) for s in drafted], torch.int64)
        draft_probs = None
        if drafted[0].draft_probs is not None:  # a draft model's, (k, V) a sequence: zero-padded
            draft_probs = torch.zeros(len(drafted), K, probs.shape[-1], device=self.device)
            for row, seq in enumerate(drafted):
                k = len(seq.draft_tokens)  # (the budget may have cut the draft short)
                draft_probs[row, :k] = seq.draft_probs[:k]
        greedy = self._to_device([s.params.temperature < GREEDY_BELOW for s in drafted], torch.bool)
        generators = {row: s.generator for row, s in enumerate(drafted) if s.generator is not None}
        tokens, accepted = rejection_sample(probs, drafts, num_draft, draft_probs, greedy,
                                            generators)
        read = self._read_back(tokens, (accepted,))

        def wait():
            tokens_list, (accepted_t,) = read()
            return {seq: (row[:a + 1], [None] * (a + 1))
                    for seq, row, a in zip(drafted, tokens_list, accepted_t.tolist())}
        return wait

    def _to_device(self, data, dtype):
        """A host list or array on the device: from pinned memory, without waiting for the GPU."""
        t = torch.as_tensor(np.asarray(data), dtype=dtype)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _ints_to_device(self, dtype, *arrays):
        """Host lists or arrays of ints, one dimension each, on the device in one copy: views of
        one tensor."""
        sizes = [len(a) for a in arrays]
        packed, at = np.empty(sum(sizes), dtype=np.int64), 0
        for a, size in zip(arrays, sizes):
            packed[at:at + size] = a
            at += size
        return self._to_device(packed, dtype).split(sizes)

    def _read_back(self, tokens, logprobs):
        """Start copying the sampled tokens (and logprobs) to the host; the function returned waits
        for these copies only, not for what is queued on the GPU after them, and returns
        (tokens as a list, logprobs)."""
        if tokens is None:
            return lambda: ([], None)
        tensors = [tokens, *(logprobs or ())]
        copied = None
        if self.device.type == "cuda":
            tensors = [t.to("cpu", non_blocking=True) for t in tensors]  # into pinned memory
            copied = torch.cuda.Event()
            copied.record()

        def wait():
            if copied is not None:
                copied.synchronize()
            return tensors[0].tolist(), (tuple(tensors[1:]) if logprobs is not None else None)
        return wait

    @staticmethod
    def logprobs_lists(seqs, tokens, logprobs):
        """Per row, {id: logprob} of the sampled id and the row's top ones, or None."""
        if logprobs is None:
            return [None] * len(seqs)
        sampled, top_values, top_ids = (x.tolist() for x in logprobs)
        out = []
        for row, seq in enumerate(seqs):
            k = seq.params.logprobs
            if k is None:
                out.append(None)
                continue
            top = dict(zip(top_ids[row][:k], top_values[row][:k]))
            out.append({tokens[row]: sampled[row], **top})
        return out


# ----------------------------------------------------------------------------------------------
# Chapter 34. Sampling
# ----------------------------------------------------------------------------------------------
# The logits of a step become tokens in vLLM's order: penalties on the raw logits, then
# temperature, then the filters top-k, top-p and min-p, then a draw; temperature 0 takes the
# argmax after the penalties instead. Every row of a batch has its own values, held as (B,)
# tensors, so the whole batch goes through one sequence of kernels and nothing is read back to
# the host until the engine reads the tokens. Stage 03's filter_logits grows into the per-row
# version below.
#
# The draw is the exponential race: with E_i ~ Exp(1) independent, argmax_i p_i / E_i is token i
# with probability p_i (E_i / p_i is the time an Exp(p_i) clock rings, and the first of several
# independent clocks is clock i with probability p_i / sum p). Its noise is one tensor a row,
# which is what a seed needs: a seeded row draws its noise from its own generator, and gets the
# same tokens whatever else is in the batch (torch.multinomial consumes one stream for the batch).

NEG_INF = float("-inf")
GREEDY_BELOW = 1e-5  # temperatures below this are greedy, as in vLLM: logits / 1e-30 overflow
STRUCTURED_FIELDS = ("regex", "choice", "json_schema")  # structured output: one at most


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _need(config, ok, name, what):
    """A config's check: a ValueError naming the field, its value and the rule it breaks."""
    if not ok:
        raise ValueError(f"{type(config).__name__}.{name} = {getattr(config, name)!r}: {what}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. Checked on construction: a bad value is a
    ValueError naming the field, here, rather than a wrong result on the device later."""
    max_tokens: int | None = 16  # tokens to generate at most; None: up to the context limit
    n: int = 1  # completions of the prompt (LLM.generate; with a seed, completion j uses seed + j)
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW): greedy
    top_k: int = 0  # keep the k likeliest tokens (ties with the k-th kept too); 0: all
    top_p: float = 1.0  # keep the likeliest tokens until their probability reaches top_p; 1: all
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest; 0: none
    repetition_penalty: float = 1.0  # > 1: tokens of the prompt or the output become less likely
    presence_penalty: float = 0.0  # subtracted from the logit of every token in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    seed: int | None = None  # this request's own random stream; None: torch's global one
    stop_token_ids: tuple = ()  # ids that end the request ("stop"), besides the eos ids
    # Stop strings are matched on the text as it streams, held back until they are decided:
    # stage 08's Detokenizer (chapter 35). Here a non-empty one is an error saying so.
    stop: tuple | None = None
    ignore_eos: bool = False  # do not stop at the eos ids
    logprobs: int | None = None  # report the sampled token's logprob and this many top ones
    regex: str | None = None  # structured output: the text must match this regex,
    choice: tuple | None = None  # or be one of these strings,
    json_schema: dict | str | None = None  # or be JSON valid against this schema

    def __post_init__(self):
        need = functools.partial(_need, self)
        need(self.max_tokens is None or _is_int(self.max_tokens) and self.max_tokens >= 1,
             "max_tokens", "must be a positive int, or None for up to the context limit")
        need(_is_int(self.n) and self.n >= 1, "n", "must be a positive int")
        need(not self.stop, "stop", "stop strings are matched on the streamed text, stage 08's "
             "work (its Detokenizer and server); here, end a request with stop_token_ids")
        need(_is_number(self.temperature) and self.temperature >= 0, "temperature",
             "must be a finite number >= 0 (0 is greedy)")
        need(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an int >= 0 (0 keeps all)")
        need(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
             "repetition_penalty", "must be a finite number > 0 (1 is none)")
        for name in ("presence_penalty", "frequency_penalty"):
            need(_is_number(getattr(self, name)) and -2 <= getattr(self, name) <= 2, name,
                 "must be in [-2, 2]")
        need(self.seed is None or _is_int(self.seed) and 0 <= self.seed < 2**64, "seed",
             "must be an int in [0, 2**64) or None")
        ids = self.stop_token_ids
        need(not isinstance(ids, (str, bytes)) and isinstance(ids, Iterable) and all(
            _is_int(i) and i >= 0 for i in ids), "stop_token_ids", "must be a list of token ids")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be True or False")
        need(self.logprobs is None or _is_int(self.logprobs) and self.logprobs >= 0, "logprobs",
             "must be None or an int >= 0: how many top logprobs besides the sampled token's")
        self._check_structured(need)

    @property
    def has_penalties(self):
        return self.repetition_penalty != 1 or bool(self.presence_penalty or self.frequency_penalty)

    def _check_structured(self, need):
        given = [name for name in STRUCTURED_FIELDS if getattr(self, name) is not None]
        try:  # compiled here (and cached), so that a bad constraint fails right away
            compile_grammar(**{name: getattr(self, name) for name in given})
        except GrammarError as e:
            if len(given) > 1:
                raise ValueError(f"SamplingParams: {e}") from None
            need(False, given[0], str(e))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))


def filter_logits(logits, top_k, top_p, min_p):  # changed in 07: one value per row, and min-p
    """Set to -inf every logit that top-k, then top-p, then min-p rule out, each row with its own
    values. logits (B, V); top_k (B,) int64 (V keeps all), top_p (B,) in (0, 1] (1 keeps all),
    min_p (B,) in [0, 1] (0 keeps all).

    top_k keeps the k largest (and any tied with the k-th). top_p keeps the smallest set of most
    likely tokens whose probabilities add up to at least top_p: the token that crosses it stays,
    and so does the most likely one. min_p drops the tokens less likely than min_p times the most
    likely one. top-p and min-p see the distribution that the filters before them left.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    kth = sorted_logits.gather(-1, (top_k.clamp(1, logits.shape[-1]) - 1)[:, None])  # (B, 1)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
    # top_p = 1 keeps all: a float32 cumsum may reach 1 before the last token
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    # min-p: p_i < min_p * p_max <=> logit_i < logit_max + log(min_p), a ratio that the
    # renormalization after top-k and top-p leaves unchanged; log(0) = -inf drops nothing
    drop |= sorted_logits < sorted_logits[:, :1] + torch.log(min_p)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    return torch.full_like(logits, NEG_INF).scatter(-1, order, sorted_logits)


class SamplingBatch:
    """The sampling state of one step's rows, on the device: each row's parameters as (B,)
    tensors, a generator for each seeded row and, when a row has a penalty, which tokens each
    prompt holds and how often each token is in each output so far. Built each step from its
    rows' requests (the engine's rows change from step to step); `record` adds the step's tokens,
    with no host sync. outputs: each row's output ids so far (for the penalties; default none);
    generators: each row's torch.Generator or None (default: a new one per seeded row); rows:
    each row's sampling_row(params, vocab_size), if already at hand."""

    def __init__(self, params, prompts, vocab_size, device, outputs=None, generators=None,
                 rows=None):
        # every row's values in one (7, B) table, sent to the device in one copy from pinned
        # memory: a copy from pageable memory would wait for the GPU's queue, and the engine
        # builds a batch each step while the GPU runs the last one
        table = np.array(rows or [sampling_row(p, vocab_size) for p in params],
                         dtype=np.float32).T  # (7, B): numpy's, 4x faster than torch.tensor's
        temperature, top_p, min_p, repetition, presence, frequency, top_k = table
        # which stages the batch needs, decided here on the host (from the values the device
        # gets): a greedy batch skips the sort of 151,936 logits a row, a batch without
        # penalties their (B, V) bookkeeping
        self.all_greedy = bool((temperature < GREEDY_BELOW).all())
        self.filters = bool(((top_k < vocab_size) | (top_p < 1) | (min_p > 0)).any())
        self.penalties = bool(((repetition != 1) | (presence != 0) | (frequency != 0)).any())
        table = torch.from_numpy(np.ascontiguousarray(table))
        if torch.device(device).type == "cuda":
            table = table.pin_memory().to(device, non_blocking=True)
        (self.temperature, self.top_p, self.min_p, self.repetition_penalty, self.presence_penalty,
         self.frequency_penalty, top_k) = table
        self.top_k = top_k.long()
        self.greedy = self.temperature < GREEDY_BELOW  # (B,) bool
        self.top_logprobs = max((p.logprobs for p in params if p.logprobs is not None),
                                default=None)
        if generators is None:
            generators = [None if p.seed is None else torch.Generator(device).manual_seed(p.seed)
                          for p in params]
        self.generators = {row: g for row, g in enumerate(generators) if g is not None}
        self.counts = self.in_prompt = None
        if self.penalties:
            self.counts = torch.zeros(len(params), vocab_size, device=device)  # (B, V)
            self.in_prompt = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
            for row, ids in enumerate(prompts):
                self.in_prompt[row, torch.tensor(ids, device=device)] = True
            for row, ids in enumerate(outputs or ()):
                if ids:
                    self.record_row(row, torch.tensor(ids, device=device))

    def record(self, tokens):
        """Count the step's tokens (B,) into each row's output, for the penalties."""
        if self.counts is not None:
            self.counts.scatter_add_(1, tokens[:, None], torch.ones_like(self.counts[:, :1]))

    def record_row(self, row, ids):
        self.counts[row].scatter_add_(0, ids, torch.ones_like(ids, dtype=self.counts.dtype))


def sampling_row(params, vocab_size):
    """A request's numbers, in the order of SamplingBatch's table."""
    return (params.temperature, params.top_p, params.min_p, params.repetition_penalty,
            params.presence_penalty, params.frequency_penalty, params.top_k or vocab_size)


def apply_penalties(logits, batch):
    """vLLM's penalties, each row its own: the repetition penalty divides the positive logits (and
    multiplies the negative ones) of every token seen in the prompt or the output; the frequency
    penalty subtracts once per occurrence in the output, the presence penalty once if present."""
    counts = batch.counts  # (B, V)
    in_output = counts > 0
    r = batch.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / r, logits * r)
    logits = torch.where(batch.in_prompt | in_output, penalized, logits)
    logits = logits - batch.frequency_penalty[:, None] * counts
    return logits - batch.presence_penalty[:, None] * in_output


def _row_uniforms(B, n, generators, device):
    """(B, n) uniforms in [0, 1): a seeded row's from its own generator, so that its draws do not
    depend on the other rows; the rest from torch's global one."""
    u = torch.rand(B, n, device=device) if len(generators) < B else torch.empty(B, n, device=device)
    for row, generator in generators.items():
        u[row] = torch.rand(n, generator=generator, device=device)
    return u


def draw(probs, generators):
    """One token a row from probs (B, V) by the exponential race; generators: {row: generator}
    for the seeded rows, the others use torch's global generator."""
    u = _row_uniforms(*probs.shape, generators, probs.device)
    # E = -log(u) with u in [0, 1) lies in (0, inf]: never 0, so p / E is never 0 / 0
    return (probs / -torch.log(u)).argmax(dim=-1)


class Sampler:
    """logits -> tokens, each row by its own SamplingParams."""

    def __call__(self, logits, batch, masks=None):
        """logits (B, V) -> (tokens (B,) int64, logprobs). masks: None, or per row the (V,) bool
        mask of the tokens its structured output allows (None for a free row), applied first
        and in place, on the device (see apply_token_masks). logprobs: None, or when a row asks,
        (sampled (B,), top values (B, k), top ids (B, k)) of the log-softmax of the raw logits,
        before any mask, penalty or filter (vLLM's default)."""
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if batch.top_logprobs is not None else None
        if masks is not None:
            apply_token_masks(logits, masks)
        if batch.penalties:
            logits = apply_penalties(logits, batch)
        tokens = logits.argmax(dim=-1)  # greedy rows keep this
        if not batch.all_greedy:
            sampled = draw(self.probs(logits, batch), batch.generators)
            tokens = torch.where(batch.greedy, tokens, sampled)
        batch.record(tokens)
        logprobs = None
        if raw_logprobs is not None:
            top = raw_logprobs.topk(batch.top_logprobs, dim=-1)
            logprobs = (raw_logprobs.gather(-1, tokens[:, None])[:, 0], top.values, top.indices)
        return tokens, logprobs

    @staticmethod
    def probs(logits, batch):
        """softmax(filtered(logits / temperature)) (B, V): what each sampled row draws from (greedy
        rows get temperature 1 here; their draw is not used). logits: after the penalties."""
        temperature = torch.where(batch.greedy, 1.0, batch.temperature)
        logits = logits / temperature[:, None]
        if batch.filters:
            logits = filter_logits(logits, batch.top_k, batch.top_p, batch.min_p)
        return logits.softmax(dim=-1)


# ----------------------------------------------------------------------------------------------
# Chapters 24 and 33. The LLMEngine: requests in, a step at a time, outputs out
# ----------------------------------------------------------------------------------------------

class LLMEngine:
    """Requests in, one step at a time, outputs out: add_request, step, abort. Stage 08's server
    drives these from its engine thread. A step is plain_step, or overlapped_step under async
    scheduling; speculative decoding enters the plain step in one place (Speculator.after_step).

    config: the EngineConfig (max_model_len resolved against the model); speculator: a
    Speculator, or None."""

    def __init__(self, runner, block_manager, config, *, eos_token_ids, tokenizer=None,
                 speculator=None):
        self.runner, self.block_manager, self.config = runner, block_manager, config
        self.scheduler = Scheduler(block_manager, config, eos_token_ids)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len, self.tokenizer = config.max_model_len, tokenizer
        self.speculator = speculator
        self.grammars = None  # the GrammarCache, built at the first structured request
        self.requests = {}  # request_id -> Sequence, until it ends
        self.aborted = []  # sequences aborted since the last step: it reports them
        self.num_needing_tokens = 0  # of the requests, those under structured output or penalties
        self.in_flight = None  # the StepHandle that overlapped_step launched and did not read
        self.last_batch = []  # [(sequence, its new tokens)] of the last step scheduled
        self.counts = Counter()  # steps, those overlapped; sequences verified, drafts, accepted
        self.num_steps = 0  # calls of step(): the clock of speculation's probes

    def add_request(self, request_id, prompt, params=None):
        """Queue a request: prompt a string (with a tokenizer) or a list of token ids; params a
        SamplingParams (None: the defaults). Checked here: a bad request raises ValueError and
        leaves the engine as it was."""
        self.add_sequence(self.new_sequence(request_id, prompt, params))

    def new_sequence(self, request_id, prompt, params=None):
        """The request as a Sequence, every check done, not queued yet."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"request {request_id!r}: n = {params.n}: the engine runs one "
                             f"completion a request; LLM.generate runs n as n requests")
        ids = self._prompt_ids(request_id, prompt)
        max_tokens = self._check_request(request_id, ids, params)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.runner.device).manual_seed(params.seed)
        return Sequence(request_id, ids, params, max_tokens, self.runner.vocab_size,
                        self._grammar(request_id, params), generator)

    def add_sequence(self, seq):
        self.requests[seq.request_id] = seq
        self.num_needing_tokens += seq.needs_tokens
        self.scheduler.enqueue(seq)

    def abort(self, request_id):
        """End a request wherever it is (waiting, being prefilled or decoding); its blocks are
        freed at once, and the next step reports it (finish_reason "abort"). An unknown or
        finished id is ignored (it may have just finished)."""
        seq = self.requests.get(request_id)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            self._forget(seq)
            self.aborted.append(seq)

    def reset(self):
        """Abort every request, and wait for the step in flight."""
        for request_id in list(self.requests):
            self.abort(request_id)
        if self.in_flight is not None:
            self.in_flight.wait()
            self.in_flight = None
        self.aborted.clear()

    def has_unfinished(self):
        return self.scheduler.has_work() or self.in_flight is not None or bool(self.aborted)

    @property
    def num_unfinished(self):
        return len(self.requests)

    # -- the step

    def step(self):
        """One turn of the loop: a RequestOutput for every request that advanced, and for each
        one aborted since the last step."""
        return [self.output(seq) for seq in self.step_sequences()]

    def step_sequences(self):
        """step() without building its outputs (each a copy of a request's tokens so far): the
        sequences that advanced or were aborted. A step overlaps the next one unless its tokens
        are needed on the host before the next can start (_needs_tokens)."""
        self.num_steps += 1
        aborted, self.aborted = self.aborted, []
        overlap = self.config.async_scheduling and not self._needs_tokens()
        self.counts["overlapped"] += overlap
        advanced = self.overlapped_step() if overlap else self.plain_step()
        if self.config.debug:
            self.check()
        return aborted + advanced

    def plain_step(self):
        """Schedule, run the model and sample, wait for the tokens and hand them over: the
        algorithm as it reads. Then speculative decoding checks the drafts this step verified
        and proposes the next step's."""
        advanced = self._hand_over(self.in_flight)  # (left by an overlapped step, if any)
        self.in_flight = None
        handle = self._launch(self._schedule())
        advanced += self._hand_over(handle)
        if self.speculator is not None:
            self.speculator.after_step(handle, self, self.num_steps)
        return advanced

    def overlapped_step(self):
        """Async scheduling: launch step n + 1 while step n runs, each sequence's last token read
        on the device from step n's output, then read step n's tokens, so that the host's work
        (scheduling, the inputs, the outputs) runs while the GPU computes. A sequence that step
        n ends runs one step more, whose token nobody reads."""
        previous = self.in_flight
        self.in_flight = self._launch(self._schedule(previous), previous)
        return self._hand_over(previous)

    def _schedule(self, in_flight=None):
        """The next batch. An empty one while no step is in flight and requests remain could
        never change anything: an engine bug, reported rather than looped on forever."""
        batch = self.last_batch = self.scheduler.schedule()
        if not batch and in_flight is None and self.scheduler.has_work():
            stuck = [seq.request_id for seq in [*self.scheduler.running, *self.scheduler.waiting]]
            raise RuntimeError(
                f"the engine is stuck: {len(stuck)} requests ({', '.join(map(repr, stuck[:8]))}"
                f"{', ...' if len(stuck) > 8 else ''}) can be neither scheduled nor finished, "
                f"with {self.block_manager.num_free_blocks} of {self.block_manager.num_blocks} "
                f"KV blocks free")
        return batch

    def _launch(self, batch, previous=None):
        """Queue a scheduled batch on the device (None for an empty one); each sequence that
        samples has a token on its way."""
        if not batch:
            return None
        handle = self.runner.launch(batch, previous)
        for seq in handle.seqs:
            seq.num_pending += 1
        return handle

    def _hand_over(self, handle):
        """Wait for a launched step's tokens and hand them over: each sequence takes its new
        tokens, the blocks the step filled become findable (prefix caching), and the sequences
        that ended are finished, their blocks freed."""
        if handle is None:
            return []
        tokens, logprobs = handle.wait()
        self.counts["steps"] += 1
        advanced, ended = self.scheduler.update(handle.seqs, tokens, logprobs)
        self.scheduler.register_computed(handle.spans)
        for seq, reason in ended:
            self.scheduler.finish(seq, reason)
            self._forget(seq)
        return advanced

    def _forget(self, seq):
        if self.requests.pop(seq.request_id, None) is not None:
            self.num_needing_tokens -= seq.needs_tokens

    def _needs_tokens(self):
        """Whether this step needs the last step's tokens on the host before it starts: for
        structured output's masks or penalties, or for speculation (to verify drafts, or to
        propose after it)."""
        return self.num_needing_tokens > 0 or (
            self.speculator is not None
            and self.speculator.needs_tokens(self.scheduler.running, self.num_steps))

    # -- a request's checks

    def _prompt_ids(self, request_id, prompt):
        """The prompt as a list of token ids, checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {request_id!r} is text, but this LLM has no tokenizer: "
                                 f"pass token ids, or LLM(..., tokenizer=...)")
            prompt = self.tokenizer.encode(prompt)
        elif not isinstance(prompt, (list, tuple)) or not all(
                type(t) is int or _is_int(t) for t in prompt):  # (the common case first)
            raise ValueError(f"prompt {request_id!r} must be a string or a list of token ids")
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {request_id!r} is empty: generation needs a token to "
                             f"continue")
        vocab = self.runner.vocab_size
        outside = [t for t in ids if not 0 <= t < vocab]
        if outside:
            raise ValueError(f"prompt {request_id!r} holds token id {outside[0]}, outside the "
                             f"model's vocabulary [0, {vocab})")
        return ids

    def _check_request(self, i, ids, params):
        """How many tokens prompt i may generate, checked against max_model_len and the KV pool;
        its params checked against the vocabulary."""
        n, limit = len(ids), self.max_model_len
        if n > limit:
            raise ValueError(f"prompt {i!r} is {n} tokens, longer than max_model_len {limit}")
        if n == limit:
            raise ValueError(f"prompt {i!r} is {n} tokens, all of max_model_len {limit}: no room "
                             f"to generate")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ValueError(f"prompt {i!r}: {n} prompt tokens + max_tokens {params.max_tokens} = "
                             f"{n + params.max_tokens}, beyond max_model_len {limit}")
        max_tokens = limit - n if params.max_tokens is None else params.max_tokens
        blocks = self.block_manager
        if triton.cdiv(n + max_tokens, blocks.block_size) > blocks.num_blocks:
            raise ValueError(f"prompt {i!r}: {n} prompt tokens + {max_tokens} to generate need "
                             f"more than the KV pool's {blocks.num_blocks} blocks of "
                             f"{blocks.block_size} tokens: lower max_tokens or max_model_len")
        vocab = self.runner.vocab_size
        outside = [t for t in params.stop_token_ids if t >= vocab]
        if outside:
            raise ValueError(f"SamplingParams.stop_token_ids of prompt {i!r} holds {outside[0]}, "
                             f"outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"SamplingParams.logprobs of prompt {i!r} asks for {params.logprobs} "
                             f"top logprobs, more than the vocabulary's {vocab} tokens")
        return max_tokens

    def _grammar(self, i, params):
        """The TokenMasker of prompt i's regex, choice or JSON schema, or None. The masks are
        the model's width: its ids past the tokenizer's write no text, so they are never allowed."""
        if all(getattr(params, name) is None for name in STRUCTURED_FIELDS):
            return None
        if self.tokenizer is None:
            raise ValueError(f"prompt {i!r} asks for structured output, which needs a tokenizer "
                             f"(each token's bytes): LLM(..., tokenizer=...)")
        if self.grammars is None:
            vocab = grammar_vocab(self.tokenizer, self.runner.vocab_size)
            self.grammars = GrammarCache(vocab, self.eos_token_ids, self.runner.device)
        masker = self.grammars.get(regex=params.regex, choice=params.choice,
                                   json_schema=params.json_schema)
        if masker.is_complete(masker.start):
            raise ValueError(f"the structured output of prompt {i!r} allows only the empty text: "
                             f"there is nothing to generate")
        return masker

    # -- what it reports

    @property
    def stats(self):
        """The engine's counters since it was built: steps, preemptions, the prefix cache's hit
        rate (of prompt tokens looked up, those found cached), and speculative decoding's draft
        tokens, accepted ones and mean accepted a verified sequence."""
        counts = self.counts
        return dict(steps=counts["steps"], preemptions=self.scheduler.num_preemptions,
                    prefix_hit_rate=self.block_manager.prefix_hit_rate,
                    draft_tokens=counts["drafted"], accepted_tokens=counts["accepted"],
                    mean_accepted=counts["accepted"] / max(1, counts["verified"]))

    def check(self):
        """The invariants (debug mode, and the tests): every live sequence is in exactly one
        queue with its status, and the block manager's counts match the block tables."""
        queued = list(self.scheduler.waiting) + self.scheduler.running
        assert len(queued) == len(set(map(id, queued))), "a sequence is in two queues"
        assert all(s.status is SequenceStatus.WAITING for s in self.scheduler.waiting)
        assert all(s.status is SequenceStatus.RUNNING for s in self.scheduler.running)
        self.block_manager.verify([seq.block_table for seq in queued])

    def output(self, seq):
        """The RequestOutput of a sequence as it stands."""
        return RequestOutput(seq.request_id, seq.prompt_token_ids, [self.completion(seq)])

    def completion(self, seq, index=0):
        """A sequence's CompletionOutput as it stands."""
        ids = seq.output_token_ids
        text = None
        if self.tokenizer is not None and seq.is_finished:  # the ending eos or stop id: no text
            text_ids = ids if seq.stop_token_id is None else ids[:-1]
            text = self.tokenizer.decode(text_ids, skip_special_tokens=True)
        return CompletionOutput(index, ids, text, seq.finish_reason,
                                None if seq.logprobs is None else list(seq.logprobs))


# ----------------------------------------------------------------------------------------------
# Chapter 24. The entry point: LLM, its knobs (EngineConfig) and the KV pool's size
# ----------------------------------------------------------------------------------------------

@dataclass
class EngineConfig:
    """The engine's knobs, with vLLM's names, checked once, here: a bad value is an error naming
    the knob. LLM(model, **knobs) builds one."""
    max_model_len: int | None = None  # the longest prompt + output; None: the model's context
    max_num_seqs: int = 256  # sequences in one step at most
    max_num_batched_tokens: int = 8192  # tokens in one step at most (a long prompt goes in chunks)
    block_size: int = 16  # tokens a KV block holds
    num_kv_blocks: int | None = None  # the KV pool; None: as kv_blocks_for_memory sizes it
    gpu_memory_utilization: float = 0.9  # of the GPU's memory: the weights, a step, the pool
    enable_prefix_caching: bool = True
    speculative: dict | None = None  # speculative decoding, as make_speculator reads it:
    #   {"method": "ngram"} (prompt lookup) or {"method": "draft", "model": a smaller Qwen3, a
    #   directory or a Hub id}, with "num_tokens" k (default 4), "min_accepted" (0: always on)
    enforce_eager: bool = False  # no CUDA graphs
    async_scheduling: bool = True  # launch each step before the last one's tokens reach the
    #                                host (SGLang's overlap scheduler): the same outputs
    debug: bool = False  # check the engine's invariants after every step
    prefill_first: bool = False  # a step with prompt tokens to run runs only those (Scheduler);
    #                              the server's default: the same outputs

    def __post_init__(self):
        need = functools.partial(_need, self)
        need(self.max_model_len is None or _is_int(self.max_model_len) and self.max_model_len >= 2,
             "max_model_len", "must be an int >= 2, or None for the model's context")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            need(_is_int(getattr(self, name)) and getattr(self, name) >= 1, name,
                 "must be a positive int")
        need(self.block_size & (self.block_size - 1) == 0, "block_size", "must be a power of two "
             "(the attention kernels split a position into block and offset with a shift)")
        need(self.num_kv_blocks is None or _is_int(self.num_kv_blocks) and self.num_kv_blocks >= 1,
             "num_kv_blocks", "must be a positive int or None")
        need(_is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1,
             "gpu_memory_utilization", "must be in (0, 1]")
        for name in ("enable_prefix_caching", "enforce_eager", "async_scheduling", "debug",
                     "prefill_first"):
            need(isinstance(getattr(self, name), bool), name, "must be True or False")
        if self.speculative is not None:
            _check_speculative(self.speculative)


def _check_speculative(spec):
    if not isinstance(spec, dict):
        raise TypeError(f"speculative must be a dict such as {{'method': 'ngram', 'num_tokens': "
                        f"4}}, not {type(spec).__name__}")
    known = {"method", "num_tokens", "model", "max_n", "min_accepted"}
    if set(spec) - known:
        raise ValueError(f"speculative: unknown keys {sorted(set(spec) - known)}; known: "
                         f"{sorted(known)}")
    method, k = spec.get("method"), spec.get("num_tokens", 4)
    min_accepted, max_n = spec.get("min_accepted", 0), spec.get("max_n", 4)
    if method not in ("ngram", "draft"):
        raise ValueError(f"speculative: method = {method!r} must be 'ngram' or 'draft'")
    if not _is_int(k) or not 1 <= k <= 16:
        raise ValueError(f"speculative: num_tokens = {k!r} must be an int from 1 to 16")
    if not _is_number(min_accepted) or min_accepted < 0:
        raise ValueError(f"speculative: min_accepted = {min_accepted!r} must be a number >= 0")
    if method == "ngram" and "model" in spec:
        raise ValueError("speculative: n-gram lookup takes no model")
    if method == "ngram" and (not _is_int(max_n) or max_n < 1):
        raise ValueError(f"speculative: max_n = {max_n!r} must be a positive int")
    if method == "draft" and not isinstance(spec.get("model"), (Qwen3, str, os.PathLike)):
        raise ValueError("speculative: 'draft' needs a model: a Qwen3, a directory or a Hub id")


class LLM:
    """The entry point: LLM(model, **knobs).generate(prompts, sampling_params), one
    RequestOutput per prompt, in the prompts' order; llm.engine is the LLMEngine, for requests
    one at a time.

    model: a Hugging Face Qwen3 directory, a Hub id (downloaded into data/hub/ on first use) or a
    built Qwen3 (used as it is: its device, dtype and kernel setting). tokenizer: a Tokenizer
    (load_tokenizer); by default a directory's own, read from its tokenizer.json with the
    weights. Without one (a built Qwen3, or a directory with no tokenizer.json) prompts are token
    ids, outputs have no text, structured output is off, and a sequence stops at the eos ids of
    the directory's config files (none for a built Qwen3); with one, at the tokenizer's eos ids.
    device, dtype: as load_qwen3's. knobs: EngineConfig's fields.
    """

    def __init__(self, model, *, tokenizer=None, device=None, dtype=None, data_dir=None, **knobs):
        unknown = sorted(set(knobs) - {f.name for f in dataclasses.fields(EngineConfig)})
        if unknown:
            raise TypeError(f"LLM: unknown knob {unknown[0]!r}; the knobs are EngineConfig's: "
                            f"{', '.join(f.name for f in dataclasses.fields(EngineConfig))}")
        config = EngineConfig(**knobs)  # every knob checked before anything loads
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a Tokenizer (see load_tokenizer), not "
                            f"{type(tokenizer).__name__}")
        if isinstance(model, Qwen3):
            if device is not None or dtype is not None:
                raise ValueError("a built Qwen3 is used as it is: move it with .to() instead of "
                                 "passing device or dtype")
            self.model, eos_token_ids = model.eval(), set()
        elif isinstance(model, (str, os.PathLike)):
            folder = model_folder(model, data_dir)
            self.model = load_qwen3(folder, device, dtype)
            eos_token_ids = config_eos_token_ids(folder)
            if tokenizer is None and (folder / "tokenizer.json").is_file():
                tokenizer = load_tokenizer(folder)
        else:
            raise TypeError(f"model must be a directory, a Hub id or a Qwen3, not "
                            f"{type(model).__name__}")
        if tokenizer is not None:
            eos_token_ids = tokenizer.eos_token_ids  # config files and tokenizer_config.json
        self.tokenizer = tokenizer
        limit = self.model.cfg.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len = {config.max_model_len!r}: must be an int from 2 to "
                             f"the model's max_position_embeddings, {limit}")
        config = dataclasses.replace(config, max_model_len=config.max_model_len or limit)
        self.config = config
        self.max_model_len = config.max_model_len
        speculative = config.speculative
        draft = speculative.get("model") if speculative else None
        if isinstance(draft, (str, os.PathLike)):  # loaded before the pool is sized
            draft = load_qwen3(model_folder(draft, data_dir), _device_of(self.model),
                               self.model.model.embed_tokens.weight.dtype)
            speculative = {**speculative, "model": draft.use_kernels(self.model.kernels)}
        models = [self.model] + ([draft] if isinstance(draft, Qwen3) else [])
        num_blocks = config.num_kv_blocks or kv_blocks_for_memory(models, config)
        self.kv_cache_bytes = num_blocks * config.block_size * kv_bytes_per_token(models)
        LOG.info("KV cache: %s blocks of %d tokens = %s tokens, %s", f"{num_blocks:,}",
                 config.block_size, f"{num_blocks * config.block_size:,}",
                 memory_size(self.kv_cache_bytes))
        speculator = speculative and make_speculator(
            speculative, self.model, num_blocks, config.block_size, config.max_model_len,
            config.enforce_eager)
        runner = ModelRunner(self.model, num_blocks, config.block_size, config.max_model_len,
                             config.enforce_eager, config.max_num_seqs)
        blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.warm_up_seconds = runner.warm_up(config.max_num_seqs, config.max_num_batched_tokens)
        if self.warm_up_seconds:
            LOG.info("warm-up (kernels compiled and tuned, CUDA graphs captured): %.1f s",
                     self.warm_up_seconds)
        self.engine = LLMEngine(runner, blocks, config, eos_token_ids=eos_token_ids,
                                tokenizer=tokenizer, speculator=speculator)

    def generate(self, prompts, sampling_params=None):
        """Generate for each prompt: a string (with a tokenizer) or a list of token ids, or a list
        of them. sampling_params: one SamplingParams for all, one per prompt, or None for the
        defaults. A prompt's n completions are n requests to the engine, completion j seeded
        seed + j (so that they differ, and each can be drawn again alone). Every prompt and its
        limits are checked before any work starts."""
        prompts = self._prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        engine = self.engine
        engine.reset()  # a fresh start, even after an interrupted call
        seqs = [[engine.new_sequence(i if p.n == 1 else (i, j), prompt, dataclasses.replace(
                    p, n=1, seed=None if p.seed is None else p.seed + j)) for j in range(p.n)]
                for i, (prompt, p) in enumerate(zip(prompts, params))]
        for seq in (seq for group in seqs for seq in group):
            engine.add_sequence(seq)
        while engine.has_unfinished():
            engine.step_sequences()
        return [RequestOutput(i, group[0].prompt_token_ids,
                              [engine.completion(seq, j) for j, seq in enumerate(group)])
                for i, group in enumerate(seqs)]

    @staticmethod
    def _prompt_list(prompts):
        """One prompt (a string or a list of ids) is a batch of one."""
        if isinstance(prompts, str) or isinstance(prompts, (list, tuple)) and prompts and all(
                _is_int(t) for t in prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a string or a list of token ids, or a non-empty "
                             "list of them")
        return prompts

    @staticmethod
    def _params_per_prompt(sampling_params, n):
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params or SamplingParams()] * n
        if isinstance(sampling_params, (list, tuple)) and all(
                isinstance(p, SamplingParams) for p in sampling_params):
            if len(sampling_params) != n:
                raise ValueError(f"{len(sampling_params)} SamplingParams for {n} prompts: give "
                                 f"one for all, or one per prompt")
            return list(sampling_params)
        raise TypeError("sampling_params must be a SamplingParams, a list of them, or None")


def kv_bytes_per_token(models):
    """Bytes of keys and values one token takes in the pool: every layer's, of the target and of
    a draft model whose cache shares the blocks."""
    return sum(2 * m.cfg.num_hidden_layers * m.cfg.num_key_value_heads * m.cfg.head_dim
               * m.model.embed_tokens.weight.element_size() for m in models)


def kv_blocks_for_memory(models, config):
    """The pool's size in blocks. On a GPU, vLLM's rule: of gpu_memory_utilization x the GPU's
    memory, what is left after what is in use now (the weights, the CUDA context, other
    processes) and the peak of a profiled step of max_num_batched_tokens tokens; but no more
    than max_num_seqs sequences of max_model_len tokens fill, with as much again for prefix
    caching to keep. On a CPU, room for max_num_seqs sequences of max_model_len tokens, at most
    1 GiB. models: the target, and a draft model whose cache shares the blocks."""
    per_token, device = kv_bytes_per_token(models), _device_of(models[0])
    block_size, max_len = config.block_size, config.max_model_len
    if device.type != "cuda":
        tokens = min(config.max_num_seqs * max_len, max(max_len, 2**30 // per_token))
        return triton.cdiv(tokens, block_size)
    peak = profile_step_memory(models[0], block_size, config.max_num_seqs,
                               config.max_num_batched_tokens)
    free, total = torch.cuda.mem_get_info(device)
    budget = config.gpu_memory_utilization * total - (total - free) - peak
    most = 2 * config.max_num_seqs * triton.cdiv(max_len, block_size)
    blocks = min(int(budget // (per_token * block_size)), most)
    if blocks < triton.cdiv(max_len, block_size):
        raise ValueError(f"gpu_memory_utilization {config.gpu_memory_utilization} leaves room for "
                         f"{max(blocks, 0)} KV blocks, fewer than one sequence of max_model_len "
                         f"{max_len} needs: raise it, or lower max_model_len")
    return blocks


def memory_size(nbytes):
    """Bytes as GiB, or as MiB below one GiB (a tiny model's pool is not 0.00 GiB)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


@torch.inference_mode()
def profile_step_memory(model, block_size, max_num_seqs, max_num_batched_tokens):
    """Bytes a step's activations take at their peak, beyond what is allocated now: a prefill of
    max_num_batched_tokens tokens (one sequence) that samples max_num_seqs rows, over a cache of
    just its own blocks (not counted)."""
    fuse_projections(model)
    cfg, device = model.cfg, _device_of(model)
    dtype = model.model.embed_tokens.weight.dtype
    N = max_num_batched_tokens
    blocks = triton.cdiv(N, block_size)
    shape = (cfg.num_hidden_layers, blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    kv = tuple(torch.zeros(shape, device=device, dtype=dtype) for _ in range(2))
    meta = AttentionMetadata(
        slots=torch.arange(N, device=device),
        lengths=torch.tensor([N], device=device, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, N], device=device, dtype=torch.int32),
        block_tables=torch.arange(blocks, device=device, dtype=torch.int32)[None],
        max_q_len=N, max_len=blocks * block_size,
        sample_rows=torch.arange(N - min(N, max_num_seqs), N, device=device))
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    attention = triton_attention if model.kernels else torch_attention
    logits = forward_packed(model, torch.zeros(N, dtype=torch.int64, device=device),
                            torch.arange(N, device=device), kv, meta, attention)
    Sampler()(logits, SamplingBatch([SamplingParams(temperature=1.0, top_p=0.9)] * logits.shape[0],
                                    [[0]] * logits.shape[0], cfg.vocab_size, device))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del kv, logits
    torch.cuda.empty_cache()
    return peak


# ----------------------------------------------------------------------------------------------
# Chapter 26. Speculative decoding: proposing k tokens, verifying them in one forward
# ----------------------------------------------------------------------------------------------
# A decode step is memory-bound: it reads every weight and the KV cache for one token a
# sequence, and scoring k + 1 positions reads the same bytes. So a cheap proposer (an n-gram
# lookup in the context, or a small draft model) guesses k tokens, the target scores them in one
# forward, and the step emits the guesses it accepts plus one token of its own.
# Why the output keeps the target's distribution p exactly (Leviathan et al. 2023, Chen et al.
# 2023): x drawn from the draft's q is accepted with probability min(1, p(x) / q(x)), and a
# rejection draws from the residual (p - q)+ / sum (p - q)+. As sum (p - q)+ = 1 - sum min(p, q),
#   P(y) = min(p(y), q(y)) + (1 - sum min(p, q)) (p(y) - q(y))+ / sum (p - q)+
#        = min(p(y), q(y)) + (p(y) - q(y))+ = p(y).
# An n-gram proposal is a point mass q = 1 at x: accept with probability p(x), else draw from p
# without x. Greedy rows accept x iff it is the argmax, so they reproduce greedy decoding.
# Shapes: B rows, K draft positions, V the vocabulary.


def ngram_propose(token_ids, k, max_n=4, min_n=1):
    """Prompt lookup: the up to k tokens that followed an earlier occurrence of the last n tokens,
    for the largest n in min_n..max_n that recurs; [] when none does. The occurrence is the most
    recent one that k tokens follow, else the earliest (in a run of one repeated token, the most
    recent is followed by a single token). token_ids: a list of ints or a 1-D integer array."""
    ids = np.asarray(token_ids, dtype=np.int64)
    last = len(ids) - 1
    if last < 1 or k < 1:
        return []
    # The ends of the 1-gram matches; each longer n keeps those whose n-th token back matches
    # too: one pass over the sequence, then a few over a handful of candidates.
    ends = np.flatnonzero(ids[:last] == ids[last])  # (C,) ascending
    match = None
    for n in range(1, max_n + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[ids[ends - (n - 1)] == ids[last - (n - 1)]]
        if ends.size == 0:
            break
        if n >= min_n:  # the longest n-gram so far
            full = ends[ends + k <= last]  # occurrences that k tokens follow
            match = full[-1] if full.size else ends[0]
    return [] if match is None else ids[match + 1:match + 1 + k].tolist()


def rejection_sample(target_probs, draft_tokens, num_draft, draft_probs=None, greedy=None,
                     generators=None):
    """Accept a prefix of each row's draft and add one token, so that the tokens follow the
    target's distribution exactly (the derivation above). No host sync.

    target_probs (B, K+1, V): the target's distribution at each position (i: after the first i
    draft tokens). draft_tokens (B, K) int64, anything past num_draft (B,) int64 in 0..K, on the
    device. draft_probs (B, K, V), or None for a point mass at each draft token (n-gram). greedy
    (B,) bool or None: rows that take the argmax. generators: {row: generator} for seeded rows,
    as in `draw` (a seeded row draws K uniforms, then V for its last token).
    Returns tokens (B, K+1) int64 (the accepted drafts, the drawn token, then -1) and
    num_accepted (B,) int64: row b emits num_accepted[b] + 1 tokens."""
    B, K1, V = target_probs.shape
    K, device = K1 - 1, target_probs.device
    rows, positions = torch.arange(B, device=device), torch.arange(K, device=device)
    proposed = positions < num_draft[:, None]  # (B, K)
    drafts = torch.where(proposed, draft_tokens, 0)  # (B, K), the padding made a valid index
    p_x = target_probs[:, :K].gather(-1, drafts[..., None])[..., 0]  # (B, K)
    q_x = 1.0 if draft_probs is None else draft_probs.gather(-1, drafts[..., None])[..., 0]
    # u < p/q has probability min(1, p/q); u * q < p never divides, and never accepts p(x) = 0
    accept = _row_uniforms(B, K, generators or {}, device) * q_x < p_x  # (B, K)
    if greedy is not None:
        is_argmax = drafts == target_probs[:, :K].argmax(dim=-1)  # (B, K)
        accept = torch.where(greedy[:, None], is_argmax, accept)
    # the accepted prefix ends at the first rejection, or at the first position not proposed
    num_accepted = (accept & proposed).long().cumprod(dim=1).sum(dim=1)  # (B,)

    p = target_probs[rows, num_accepted]  # (B, V): where the last token comes from
    weights = p
    if K > 0:
        rejected = num_accepted < num_draft  # (B,): else every draft was accepted, p is the bonus
        at = num_accepted.clamp(max=K - 1)  # (B,) a valid index where no draft was rejected
        if draft_probs is None:  # a point mass: the residual is p without the rejected token
            residual = p.scatter(-1, drafts[rows, at][:, None], 0.0)  # (B, V)
        else:
            residual = (p - draft_probs[rows, at]).clamp(min=0)  # (B, V)
        # The race takes weights, so the residual stays unnormalized. Rounding can leave it all
        # zero (p <= q everywhere means p = q), and a race over zeros returns token 0: use p.
        weights = torch.where(rejected[:, None] & (residual.sum(-1, keepdim=True) > 0), residual, p)
    last = draw(weights, generators or {})  # (B,)
    if greedy is not None:
        last = torch.where(greedy, p.argmax(dim=-1), last)

    tokens = torch.cat([drafts, drafts.new_zeros(B, 1)], dim=1)  # (B, K+1)
    tokens = torch.where(torch.arange(K1, device=device) < num_accepted[:, None], tokens, -1)
    return tokens.scatter(1, num_accepted[:, None], last[:, None]), num_accepted


# When speculation pays. A verified step costs more than a plain one: it waits for its tokens
# (no overlap with the next step) and runs k + 1 rows a sequence. So a sequence whose mean
# accepted drafts a step falls below min_accepted stops proposing, and probes again every
# SPEC_PROBE_STEPS steps; n-gram lookup with k = 4 broke even near 1.2 (bench_speculative),
# hence SPEC_MIN_ACCEPTED. A draft model's own k steps raise that bar (make_speculator). And a
# proposing step holds back the whole batch: speculation runs only while the gains above
# min_accepted add up to SPEC_SYNC_COST tokens a sequence of the batch.
SPEC_MIN_ACCEPTED = 1.0
SPEC_PROBE_STEPS = 32
SPEC_SYNC_COST = 0.7
SPEC_SPLIT_CATCH_UP = 8  # a draft's catch-up of up to this many tokens runs as one-token rows


class Proposer:
    """Sets each given sequence's draft_tokens (at most its k) and, for drafts drawn from a
    distribution, draft_probs (k, V), which rejection_sample needs."""

    def propose(self, seqs, ks):
        raise NotImplementedError


class NgramProposer(Proposer):
    """Prompt lookup (ngram_propose): no model and no cache."""

    def __init__(self, max_n=4):
        self.max_n = max_n

    def propose(self, seqs, ks):
        for seq, k in zip(seqs, ks):
            seq.draft_tokens = ngram_propose(np.asarray(seq.token_ids), k, self.max_n)


class DraftProposer(Proposer):
    """A smaller model over the same vocabulary proposes k tokens, one decode step at a time,
    each drawn from its distribution q (the argmax for a greedy request). Its ModelRunner shares
    the target's block tables (a block id names slots in each model's pool), and each proposal
    first catches it up on the tokens it has not seen, in one packed step."""

    def __init__(self, runner):
        self.runner = runner

    @torch.inference_mode()
    def propose(self, seqs, ks):
        runner, previous = self.runner, None
        entries = []
        for seq in seqs:  # a catch-up of a few tokens as one-token entries: a decode-shaped step
            start = seq.num_draft_computed
            ids = seq.token_ids[start:]
            if len(ids) <= SPEC_SPLIT_CATCH_UP:
                entries += [([t], None, start + i, seq.block_table, int(i == len(ids) - 1))
                            for i, t in enumerate(ids)]
            else:
                entries.append((ids, None, start, seq.block_table, 1))
        drafts, probs, active = [[] for _ in seqs], [[] for _ in seqs], list(range(len(seqs)))
        for _ in range(max(ks)):
            logits = runner.run(entries, previous)  # (B, V): each active sequence's next
            batch = runner.sampling_batch([seqs[i] for i in active])
            q = Sampler.probs(logits.float(), batch)  # (B, V)
            tokens = torch.where(batch.greedy, q.argmax(dim=-1), draw(q, batch.generators))
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                probs[i].append(q[row])
            entries, rows, previous = [], [], tokens  # the next step reads its ids on the device
            for row, i in enumerate(active):
                if len(drafts[i]) < ks[i]:
                    seq = seqs[i]
                    entries.append(([0], len(rows), seq.num_tokens + len(drafts[i]) - 1,
                                    seq.block_table, 1))
                    rows.append(row)
            if not entries:
                break
            previous = tokens[self.runner._to_device(rows, torch.int64)]
            active = [i for i in active if len(drafts[i]) < ks[i]]
        for seq, draft, q in zip(seqs, drafts, probs):
            seq.draft_tokens = torch.stack(draft).tolist()
            seq.draft_probs = torch.stack(q)  # (k, V)
            seq.num_draft_computed = seq.num_tokens + len(draft) - 1


class Speculator:
    """After each step: the drafts verified update each sequence's acceptance, and the sequences
    that speculate propose for the next step, which ModelRunner._verify checks with the rest."""

    def __init__(self, proposer, num_tokens, min_accepted):
        self.proposer, self.num_tokens, self.min_accepted = proposer, num_tokens, min_accepted

    def after_step(self, handle, engine, step):
        """handle: the step just read (None if it ran nothing); step: the engine's step count."""
        if handle is not None:
            tokens, _ = handle.wait()
            for seq, new, k in zip(handle.seqs, tokens, handle.num_drafts):
                if k:
                    engine.counts.update(verified=1, drafted=k, accepted=len(new) - 1)
                    seq.mean_accepted = (0.7 * min(seq.mean_accepted, self.num_tokens)
                                         + 0.3 * (len(new) - 1))
        self.draft_next_step(engine.scheduler.running, engine.block_manager, step)

    def needs_tokens(self, running, step):
        """Whether the step needs its tokens on the host: to verify drafts, or to propose."""
        return any(seq.draft_tokens for seq in running) or bool(self.speculating(running, step))

    def speculating(self, running, step):
        """Who proposes after this step: not sequences under structured output, penalties or
        logprobs (verification samples without them), nor, outside probe steps, those below
        min_accepted; none unless the gains pay SPEC_SYNC_COST; with min_accepted = 0, all."""
        probe = step % SPEC_PROBE_STEPS == 0
        seqs = [seq for seq in running if seq.grammar is None and not seq.params.has_penalties
                and seq.params.logprobs is None
                and (probe or seq.mean_accepted >= self.min_accepted)]
        gain = sum(min(seq.mean_accepted, self.num_tokens) - self.min_accepted for seq in seqs)
        always = probe or self.min_accepted == 0
        return seqs if always or gain >= SPEC_SYNC_COST * len(running) else []

    def draft_next_step(self, running, block_manager, step):
        """Drafts, and the blocks they need, for the next step of each sequence that speculates."""
        seqs, ks = [], []
        for seq in self.speculating(running, step):
            if seq.num_computed_tokens != seq.num_tokens - 1 or seq.draft_tokens:
                continue  # (still holding drafts: it sat this step out, and they wait for the next)
            k = min(self.num_tokens, seq.max_tokens - seq.num_output_tokens - 1)
            if k >= 1 and block_manager.grow(seq.block_table, seq.num_tokens + k):
                seqs.append(seq)
                ks.append(k)
        if seqs:
            self.proposer.propose(seqs, ks)
        for seq in seqs:
            if not seq.draft_tokens:  # nothing to propose: speculation gained nothing this step
                seq.mean_accepted = 0.7 * min(seq.mean_accepted, self.num_tokens)


def make_speculator(spec, model, num_blocks, block_size, max_model_len, enforce_eager):
    """The Speculator of EngineConfig.speculative (checked there): {"method": "ngram" | "draft",
    "num_tokens": k (4), "model": a Qwen3 (LLM loads a directory or a Hub id), "max_n" (ngram;
    4), "min_accepted" (SPEC_MIN_ACCEPTED, plus k times the draft's size over the target's)}."""
    k, min_accepted = spec.get("num_tokens", 4), spec.get("min_accepted", SPEC_MIN_ACCEPTED)
    if spec["method"] == "ngram":
        return Speculator(NgramProposer(spec.get("max_n", 4)), k, min_accepted)
    draft = spec["model"]
    if not isinstance(draft, Qwen3):
        raise ValueError("speculative: 'draft' needs a model: a Qwen3, a directory or a Hub id")
    if draft.cfg.vocab_size != model.cfg.vocab_size or _device_of(draft) != _device_of(model):
        raise ValueError(f"speculative: the draft model must share the target's vocabulary "
                         f"({model.cfg.vocab_size}) and device ({_device_of(model)}), not "
                         f"{draft.cfg.vocab_size} on {_device_of(draft)}")
    if "min_accepted" not in spec:  # each draft step costs about its share of a target step
        share = sum(p.numel() for p in draft.parameters()) / sum(
            p.numel() for p in model.parameters())
        min_accepted += k * share
    runner = ModelRunner(draft.eval(), num_blocks, block_size, max_model_len, enforce_eager)
    return Speculator(DraftProposer(runner), k, min_accepted)


# ----------------------------------------------------------------------------------------------
# Chapter 34. Structured output: a regex, a choice or a JSON schema as a mask over the vocabulary
# ----------------------------------------------------------------------------------------------
# A constraint is compiled once into a deterministic automaton over BYTES; at every decode step
# the sampler forbids each token whose bytes would walk that automaton off its live states:
#
#   regex / choice / json_schema ──parse──▶ tree of character sets (Chars, Concat, Alt, Repeat)
#       ──Thompson──▶ NFA over bytes (each character set spelled out as its UTF-8 byte ranges)
#       ──subset construction──▶ ByteDFA: trans[state, byte] → next state, or DEAD
#       ──TokenMasker──▶ per state, the bool mask of allowed tokens (a trie walk, then cached)
#
# Why bytes: a byte-level BPE token may end inside a character ("é" is two bytes and a token
# may hold only the first), so the automaton must be able to stop between a character's bytes.
# Why a DFA: a request's grammar state is then one int, advancing it is a table lookup, and a
# mask can be cached per state.
# In the engine: SamplingParams compiles its constraint (compile_grammar, cached), so a bad one
# fails at once; GrammarCache hands each request its TokenMasker; a Sequence advances its state
# with each token; the Sampler applies the masks first (apply_token_masks); the Scheduler stops
# a request whose automaton is finished (accepting, and no byte may follow).

DEAD = -1  # the automaton's "no match possible any more" state
MAX_CODE_POINT = 0x10FFFF
MAX_REPEAT = 1000  # {m,n} beyond this would build NFAs of millions of states
MAX_DFA_STATES = 20_000


class GrammarError(ValueError):
    """A regex, choice or JSON schema this stage cannot compile; the message says what."""


# The tree every constraint is parsed into: a character is a set of code points; the rest is
# concatenation, alternation, repetition, and Separated for a JSON object's body.

@dataclass(frozen=True)
class Chars:
    ranges: tuple  # ((lo, hi), ...) code points: sorted, disjoint, no surrogates; () = nothing


@dataclass(frozen=True)
class Concat:
    parts: tuple  # one after the other; () matches the empty string


@dataclass(frozen=True)
class Alt:
    options: tuple


@dataclass(frozen=True)
class Repeat:
    node: object
    lo: int
    hi: int | None  # None: unbounded


@dataclass(frozen=True)
class Separated:
    """Items in order, each (node, required), with `sep` between those present: a JSON object
    whose optional properties may be left out. With Concat and Alt, each property would repeat
    once per choice of the first one present; as a node of its own, the NFA holds it once."""
    items: tuple
    sep: object


def char_set(ranges, negate=False):
    """Chars from (lo, hi) code point pairs in any order, overlapping or not; `negate` takes the
    complement. The surrogates U+D800..U+DFFF are dropped: UTF-8 cannot encode them."""
    merged = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    if negate:  # the gaps: before the first range, between two, after the last
        bounds = [-1, *(x for pair in merged for x in pair), MAX_CODE_POINT + 1]
        merged = [(hi + 1, lo - 1) for hi, lo in zip(bounds[::2], bounds[1::2])]
    # each range minus the surrogates: the pieces below and above them (empty ones dropped)
    pieces = [p for lo, hi in merged for p in ((lo, min(hi, 0xD7FF)), (max(lo, 0xE000), hi))]
    return Chars(tuple((lo, hi) for lo, hi in pieces if lo <= hi))


def chars(text):
    """One character out of those in `text`."""
    return char_set([(ord(c), ord(c)) for c in text])


def literal(text):
    """Exactly `text`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise GrammarError(f"{text!r} holds a lone surrogate, which UTF-8 cannot encode") from None
    return Concat(tuple(chars(c) for c in text))


def optional(node):
    return Repeat(node, 0, 1)


# ----------------------------------------------------------------------------------------------
# Regex → tree: REGEX_SUBSET, matched in full (as re.fullmatch); '.' is any but a newline, and
# \d \w \s mean what they mean under re.ASCII. Anything else (anchors, lookaround, backreferences,
# flags, lazy quantifiers, a bare '{', other escapes) is an error that quotes it.
# ----------------------------------------------------------------------------------------------

REGEX_SUBSET = (r"characters, ., \d \w \s \D \W \S \n \t \r \xhh \uhhhh, escaped punctuation, "
                r"[...] and [^...] of those, (...), (?:...), |, ? * + {m} {m,} {m,n}")
ASCII_CLASSES = {"d": [(0x30, 0x39)], "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
                 "s": [(0x09, 0x0D), (0x20, 0x20)]}
CHAR_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D}
HEX_ESCAPES = {"x": 2, "u": 4}  # the escape letter → how many hex digits follow
HEX_DIGITS = "0123456789abcdefABCDEF"
QUANTIFIER = re.compile(r"[*+?]|\{(\d+)(,?)(\d*)\}")
ANY_BUT_NEWLINE = char_set([(0x0A, 0x0A)], negate=True)


class RegexParser:
    """Recursive descent over the subset above, one method per rule:
        alternation   := concatenation ('|' concatenation)*
        concatenation := repetition*
        repetition    := atom [quantifier]
        atom          := character | '.' | escape | '[' class ']' | '(' ['?:'] alternation ')'
    """

    def __init__(self, pattern):
        self.pattern, self.pos = pattern, 0

    def parse(self):
        node = self.alternation()
        if self.pos < len(self.pattern):  # only an unmatched ')' stops the top alternation early
            raise self.error("unbalanced ')'")
        return node

    def error(self, what):
        return GrammarError(f"regex {self.pattern!r}, position {self.pos}: {what}")

    def unsupported(self, start):
        self.pos = start
        return self.error(f"{self.pattern[start:start + 4]!r} is not supported (the subset: "
                          f"{REGEX_SUBSET})")

    def peek(self, k=0):
        i = self.pos + k
        return self.pattern[i] if i < len(self.pattern) else ""

    def take(self):
        if self.pos >= len(self.pattern):
            raise self.error("unexpected end of pattern")
        self.pos += 1
        return self.pattern[self.pos - 1]

    def alternation(self):
        options = [self.concatenation()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.concatenation())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def concatenation(self):
        parts = []
        while self.peek() not in ("", "|", ")"):
            parts.append(self.repetition())
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def repetition(self):
        node = self.atom()
        m = QUANTIFIER.match(self.pattern, self.pos)
        if m is None:
            return node
        if m[1] is None:  # * + ?
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[m[0]]
        else:  # {m}, {m,} or {m,n}
            lo = int(m[1])
            hi = lo if not m[2] else int(m[3]) if m[3] else None
            if hi is not None and hi < lo:
                raise self.error(f"min repeat {lo} is greater than max repeat {hi}")
            if max(lo, hi or 0) > MAX_REPEAT:
                raise self.error(f"repeat count above {MAX_REPEAT}")
        self.pos = m.end()
        if self.peek() in ("*", "+", "?", "{"):  # lazy, possessive, or a repeat of a repeat
            raise self.unsupported(self.pos)
        return Repeat(node, lo, hi)

    def atom(self):
        start, c = self.pos, self.take()
        if c == "(":
            if self.peek() == "?":
                if self.peek(1) != ":":
                    raise self.unsupported(start)
                self.pos += 2
            node = self.alternation()
            if self.peek() != ")":
                raise self.error("missing ')'")
            self.pos += 1
            return node
        if c == "[":
            return self.char_class()
        if c == ".":
            return ANY_BUT_NEWLINE
        if c == "\\":
            got = self.escape()
            return got if isinstance(got, Chars) else char_set([(got, got)])
        if c in "*+?{^$":
            raise self.unsupported(start)
        return chars(c)

    def char_class(self):
        negate = self.peek() == "^"
        self.pos += negate
        ranges, first = [], self.pos
        while self.peek() != "]" or self.pos == first:  # a ']' right after '[' or '[^' is literal
            if self.pos >= len(self.pattern):
                raise self.error("unterminated character class")
            lo = self.class_member()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                hi = self.class_member()
                if isinstance(lo, Chars) or isinstance(hi, Chars) or hi < lo:
                    raise self.error("bad character range")
                ranges.append((lo, hi))
            else:
                ranges.extend(lo.ranges if isinstance(lo, Chars) else [(lo, lo)])
        self.pos += 1
        return char_set(ranges, negate)

    def class_member(self):
        """A code point, or Chars for a class escape such as \\d."""
        c = self.take()
        return self.escape() if c == "\\" else ord(c)

    def escape(self):
        """What a backslash starts: Chars for \\d \\w \\s and their negations, else a code point."""
        start, c = self.pos - 1, self.take()
        if c.lower() in ASCII_CLASSES:
            return char_set(ASCII_CLASSES[c.lower()], negate=c.isupper())
        if c in CHAR_ESCAPES:
            return CHAR_ESCAPES[c]
        if c in HEX_ESCAPES:
            digits = self.pattern[self.pos:self.pos + HEX_ESCAPES[c]]
            if len(digits) < HEX_ESCAPES[c] or not all(d in HEX_DIGITS for d in digits):
                raise self.error(f"bad escape \\{c}{digits}")
            self.pos += len(digits)
            return int(digits, 16)
        if c.isascii() and c.isalnum():
            raise self.unsupported(start)
        return ord(c)


# ----------------------------------------------------------------------------------------------
# JSON schema → tree. The subset (JSON_SUBSET): "type" object, array, string, integer, number,
# boolean or null, nested at any depth; "enum" and "const", alone or with a matching "type".
# Annotations and additionalProperties are ignored (no property beyond "properties" is
# written); any other keyword is an error naming it. The output is compact JSON: no whitespace,
# properties in declared order, strings escaping '"', '\' and controls, no surrogate \u escapes.
# ----------------------------------------------------------------------------------------------

JSON_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                              "$comment"})
JSON_TYPE_KEYWORDS = {"object": {"properties", "required", "additionalProperties"},
                      "array": {"items"}, "string": set(), "integer": set(), "number": set(),
                      "boolean": set(), "null": set()}
JSON_SUBSET = ("'type', 'enum', 'const'; 'properties', 'required' with type object; 'items' "
               "with type array")

HEX = chars(HEX_DIGITS)
DIGITS = Repeat(chars("0123456789"), 1, None)
JSON_STRING_CHAR = Alt((
    char_set([(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)], negate=True),  # as is: not " \ controls
    Concat((literal("\\"), chars('"\\/bfnrt'))),
    Concat((literal("\\u"), chars("0123456789abcABCefEF"), HEX, HEX, HEX)),  # \u, not D800-DFFF
    Concat((literal("\\u"), chars("dD"), chars("01234567"), HEX, HEX)),
))
JSON_INTEGER = Concat((optional(literal("-")),
                       Alt((literal("0"), Concat((chars("123456789"), optional(DIGITS)))))))
JSON_SCALARS = {
    "string": Concat((literal('"'), Repeat(JSON_STRING_CHAR, 0, None), literal('"'))),
    "integer": JSON_INTEGER,
    "number": Concat((JSON_INTEGER, optional(Concat((literal("."), DIGITS))),
                      optional(Concat((chars("eE"), optional(chars("+-")), DIGITS))))),
    "boolean": Alt((literal("true"), literal("false"))),
    "null": literal("null"),
}


def json_text(value):
    """`value` as compact JSON, the way the grammar writes it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def json_type_matches(value, kind):
    """Whether a Python value parsed from JSON has JSON schema type `kind` (bool is no integer)."""
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    python_types = {"object": dict, "array": list, "string": str, "integer": int,
                    "number": (int, float), "boolean": bool, "null": type(None)}
    return isinstance(value, python_types[kind])


def json_schema_to_tree(schema, where="schema"):
    """The tree of every compact JSON text this schema allows; `where` locates errors."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{where}: a schema must be a JSON object, got {schema!r}")
    kind = schema.get("type")
    if kind is not None and (not isinstance(kind, str) or kind not in JSON_TYPE_KEYWORDS):
        raise GrammarError(f"{where}: 'type' {kind!r} is not supported (one of "
                           f"{', '.join(JSON_TYPE_KEYWORDS)}; no lists of types)")
    keywords = set(schema) - JSON_ANNOTATIONS
    unknown = keywords - {"type", "enum", "const"} - JSON_TYPE_KEYWORDS.get(kind, set())
    if unknown:
        raise GrammarError(f"{where}: keyword {', '.join(map(repr, sorted(unknown)))} is not "
                           f"supported{f' with type {kind!r}' if kind else ''} (the subset: "
                           f"{JSON_SUBSET})")
    if "enum" in keywords or "const" in keywords:
        return json_values(schema, keywords, where)
    if kind == "object":
        return json_object(schema, where)
    if kind == "array":
        if "items" not in schema:
            raise GrammarError(f"{where}: an array needs 'items'")
        item = json_schema_to_tree(schema["items"], f"{where}.items")
        items = optional(Concat((item, Repeat(Concat((literal(","), item)), 0, None))))
        return Concat((literal("["), items, literal("]")))
    if kind is None:
        raise GrammarError(f"{where}: needs 'type', 'enum' or 'const'")
    return JSON_SCALARS[kind]


def json_values(schema, keywords, where):
    """enum / const: exactly the listed values, each written as compact JSON."""
    if keywords - {"type", "enum", "const"} or {"enum", "const"} <= keywords:
        raise GrammarError(f"{where}: 'enum' / 'const' combine only with 'type', got "
                           f"{', '.join(sorted(keywords))}")
    values = [schema["const"]] if "const" in schema else schema["enum"]
    if not isinstance(values, list) or not values:
        raise GrammarError(f"{where}: 'enum' must be a non-empty list")
    for value in values:
        if "type" in schema and not json_type_matches(value, schema["type"]):
            raise GrammarError(f"{where}: value {value!r} is not of type {schema['type']!r}")
    return Alt(tuple(literal(json_text(v)) for v in values))


def json_object(schema, where):
    props, required = schema.get("properties"), schema.get("required", [])
    if not isinstance(props, dict):
        raise GrammarError(f"{where}: an object needs 'properties' (free-form objects are not "
                           "supported)")
    if not isinstance(required, list) or any(name not in props for name in required):
        raise GrammarError(f"{where}: 'required' must list names from 'properties', got "
                           f"{required!r}")
    members = tuple((Concat((literal(json_text(name) + ":"),
                             json_schema_to_tree(sub, f"{where}.properties.{name}"))),
                     name in required) for name, sub in props.items())
    return Concat((literal("{"), Separated(members, literal(",")), literal("}")))


# ----------------------------------------------------------------------------------------------
# Tree → NFA over bytes (Thompson's construction), then → DFA (subset construction)
# ----------------------------------------------------------------------------------------------

UTF8_LENGTH_LIMITS = (0x7F, 0x7FF, 0xFFFF, MAX_CODE_POINT)  # the last code point of 1..4 bytes


def utf8_sequences(lo, hi):
    """The UTF-8 encodings of code points lo..hi as byte-range sequences ((b0lo, b0hi), ...):
    lo..hi is split until, within each piece, every byte position takes every value of its
    range independently. E.g. U+0080..U+07FF is one piece: [C2-DF][80-BF]."""
    for limit in UTF8_LENGTH_LIMITS:  # first: pieces of one encoded length each
        if lo <= limit < hi:
            return utf8_sequences(lo, limit) + utf8_sequences(limit + 1, hi)
        if hi <= limit:
            break
    for k in range(1, len(chr(hi).encode())):  # then: a piece whose last k bytes do not span
        low = (1 << (6 * k)) - 1                # their whole range 80..BF must split there
        if lo & ~low != hi & ~low:
            if lo & low:
                return utf8_sequences(lo, lo | low) + utf8_sequences((lo | low) + 1, hi)
            if hi & low != low:
                return utf8_sequences(lo, (hi & ~low) - 1) + utf8_sequences(hi & ~low, hi)
    return [tuple(zip(chr(lo).encode(), chr(hi).encode()))]


class ByteNFA:
    """States are ints; eps[s] lists the states reachable from s without reading a byte, and
    edges[s] holds (lo, hi, t): a byte in lo..hi moves from s to t."""

    def __init__(self, tree):
        self.eps, self.edges = [], []
        self.start = self.new_state()
        self.accept = self.add_node(tree, self.start)

    def new_state(self):
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def join(self, states):
        """A new state that each of `states` (None: absent) leads to without reading a byte."""
        end = self.new_state()
        for s in states:
            if s is not None:
                self.eps[s].append(end)
        return end

    def add_node(self, node, start):
        """Add `node`'s states, entered at `start`; returns the state where the node is matched.
        No construction loops back to its `start`, so alternatives may share it."""
        if isinstance(node, Chars):
            return self.add_chars(node, start)
        if isinstance(node, Concat):
            for part in node.parts:
                start = self.add_node(part, start)
            return start
        if isinstance(node, Repeat):
            return self.add_repeat(node, start)
        if isinstance(node, Separated):
            return self.add_separated(node, start)
        return self.join([self.add_node(option, start) for option in node.options])

    def add_chars(self, node, start):
        """One character as UTF-8: a byte-range chain per sequence; chains with the same tail
        share its states (the continuation bytes), which keeps the DFA small."""
        end, tails = self.new_state(), {}

        def reading(rest):  # the state from which the byte ranges `rest` lead to `end`
            if not rest:
                return end
            if rest not in tails:
                tails[rest] = self.new_state()
                self.edges[tails[rest]].append((*rest[0], reading(rest[1:])))
            return tails[rest]

        for lo, hi in node.ranges:
            for seq in utf8_sequences(lo, hi):
                self.edges[start].append((*seq[0], reading(seq[1:])))
        return end

    def add_repeat(self, node, start):
        for _ in range(node.lo):
            start = self.add_node(node.node, start)
        if node.hi is None:  # a fresh loop state, so the loop cannot re-enter what led here
            loop = self.join([start])
            self.eps[self.add_node(node.node, loop)].append(loop)
            return loop
        stops = []  # x{0,3} as (x(x(x)?)?)?: each place the match may stop leads to the end
        for _ in range(node.hi - node.lo):
            stops.append(start)
            start = self.add_node(node.node, start)
        return self.join(stops + [start])

    def add_separated(self, node, start):
        """Two states per item boundary: `empty` (nothing written yet: no separator needed) and
        `some` (an item written: the next needs a separator). Each item is built once."""
        empty, some = start, None
        for item, required in node.items:
            after_sep = None if some is None else self.add_node(node.sep, some)
            done = self.add_node(item, self.join([empty, after_sep]))
            if required:
                empty, some = None, done
            else:  # skipping the item keeps both states; writing it leads to `some`
                some = self.join([done, some])
        return self.join([empty, some])


class ByteDFA:
    """A deterministic automaton over bytes. trans[s, b] is the state after byte b in state s, or
    DEAD when no match can follow; every state kept can still reach an accepting one, so a
    walk that never meets DEAD can always be completed. The start state is 0."""

    def __init__(self, trans, accepting):
        self.trans = trans            # (S, 256) int32
        self.accepting = accepting    # (S,) bool
        self.finished = accepting & (trans < 0).all(axis=1)  # accepting, and no byte may follow
        self.rows = trans.tolist()    # advancing byte by byte through lists beats numpy scalars

    @property
    def num_states(self):
        return len(self.trans)

    def walk(self, state, data):
        """The state after reading the bytes `data` from `state` (DEAD once a byte is refused)."""
        rows = self.rows
        for byte in data:
            state = rows[state][byte]
            if state < 0:
                return DEAD
        return state

    def matches(self, data):
        state = self.walk(0, data)
        return state != DEAD and bool(self.accepting[state])


def determinize(nfa):
    """Subset construction: a DFA state is the set of NFA states the bytes so far can reach.
    The bytes leaving a set are cut at every edge's ends into intervals that all move alike."""
    @functools.cache
    def closure(states):  # the DFA state of a frozenset of NFA states: all they reach by eps
        seen, stack = set(states), list(states)
        while stack:
            for t in nfa.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)

    sets = [closure(frozenset([nfa.start]))]
    index, rows = {sets[0]: 0}, []
    while len(rows) < len(sets):
        edges = [e for s in sets[len(rows)] for e in nfa.edges[s]]
        cuts = sorted({lo for lo, _, _ in edges} | {hi + 1 for _, hi, _ in edges})
        row = [DEAD] * 256
        for a, b in zip(cuts, cuts[1:]):
            targets = [t for lo, hi, t in edges if lo <= a <= hi]
            if targets:
                target = closure(frozenset(targets))
                if target not in index:
                    if len(sets) == MAX_DFA_STATES:
                        raise GrammarError(f"the automaton exceeds {MAX_DFA_STATES:,} states; "
                                           "simplify the constraint")
                    index[target] = len(sets)
                    sets.append(target)
                row[a:b] = [index[target]] * (b - a)
        rows.append(row)
    accepting = np.array([nfa.accept in s for s in sets])
    return trim(np.array(rows, dtype=np.int32), accepting)


def trim(trans, accepting):
    """Remove the states from which no accepting state can be reached (their bytes become
    DEAD), so that a token is allowed only if its text can still be completed to a match."""
    preds = [[] for _ in trans]
    for s, row in enumerate(trans.tolist()):
        for t in set(row) - {DEAD}:
            preds[t].append(s)
    live = accepting.copy()
    stack = list(np.flatnonzero(live))
    while stack:
        for s in preds[stack.pop()]:
            if not live[s]:
                live[s] = True
                stack.append(s)
    if not live[0]:
        raise GrammarError("the constraint matches no text at all")
    # old state → new state, DEAD for a removed one; a last DEAD for trans's DEAD (-1) to index
    new_id = np.append(np.where(live, np.cumsum(live) - 1, DEAD), DEAD).astype(np.int32)
    return ByteDFA(new_id[trans][live], accepting[live])


def constraint_key(regex=None, choice=None, json_schema=None):
    """(kind, text) naming at most one constraint, checked; None if none is given. The text is
    the regex, or the choice list or schema as JSON (dict order kept: it is the output's)."""
    given = [(k, v) for k, v in (("regex", regex), ("choice", choice), ("json_schema", json_schema))
             if v is not None]
    if len(given) > 1:
        raise GrammarError(f"{' and '.join(k for k, _ in given)} exclude each other; give one")
    if not given:
        return None
    kind, spec = given[0]
    if kind == "regex" and not isinstance(spec, str):
        raise GrammarError(f"regex must be a string, got {type(spec).__name__}")
    if kind == "choice" and (not isinstance(spec, (list, tuple)) or not spec
                             or not all(isinstance(c, str) for c in spec)):
        raise GrammarError(f"choice must be a non-empty list of strings, got {spec!r}")
    try:
        if kind == "json_schema" and isinstance(spec, str):
            spec = json.loads(spec)
        return kind, spec if kind == "regex" else json.dumps(spec)
    except (TypeError, ValueError) as e:  # not JSON text, or not JSON-serializable
        raise GrammarError(f"{kind} is not valid JSON: {e}") from None


def compile_grammar(regex=None, choice=None, json_schema=None):
    """The ByteDFA of exactly one of: a regex (full match), a choice (a list of strings, one of
    which is the whole output) or a JSON schema (a dict or its JSON text); None if none given.
    Cached: the engine's compile of a constraint that SamplingParams validated is free."""
    key = constraint_key(regex, choice, json_schema)
    return None if key is None else _compile(*key)


@functools.lru_cache(maxsize=64)
def _compile(kind, text):
    if kind == "regex":
        tree = RegexParser(text).parse()
    elif kind == "choice":
        tree = Alt(tuple(literal(c) for c in json.loads(text)))
    else:
        tree = json_schema_to_tree(json.loads(text))
    return determinize(ByteNFA(tree))


# ----------------------------------------------------------------------------------------------
# Token masks: which tokens each automaton state allows, by walking a trie of the vocabulary
# ----------------------------------------------------------------------------------------------
# Walking the 151,936 tokens one by one through the DFA in Python costs 50-120 ms a state. A
# trie shares the work of common prefixes, and a level-by-level walk with numpy makes a level a
# few array operations over its live nodes; a subtree whose prefix dies is never visited.

class TokenTrie:
    """The vocabulary's byte strings as a trie, stored level by level. Level d holds the distinct
    prefixes of d+1 bytes, sorted, so that the children of one node are a run of the next level:
        byte[d][n]                           the node's last byte
        first_child[d][n], n_children[d][n]  its children, in level d+1
        token[d][n]                          the token whose bytes end here, or V if none does
    An id that spells the same bytes as an earlier one (alias_ids) takes its verdict (alias_of).
    Built once per vocabulary, shared by every grammar."""

    def __init__(self, vocab):
        self.vocab, self.V = vocab, len(vocab)
        first, aliases = {}, []  # bytes → the first id that spells them; (later id, first id)
        for i, data in enumerate(vocab):
            if data and first.setdefault(bytes(data), i) != i:
                aliases.append((i, first[bytes(data)]))
        # every byte a token of its own (as in byte-level BPE): no live state's mask is empty
        missing = sorted(set(range(256)) - {t[0] for t in first if len(t) == 1})
        if missing:
            raise GrammarError(f"the vocabulary lacks single-byte tokens for bytes {missing[:8]}"
                               f"{'...' if len(missing) > 8 else ''}")
        aliases = np.array(aliases, dtype=np.int64).reshape(-1, 2)
        self.alias_ids, self.alias_of = aliases[:, 0], aliases[:, 1]
        levels, longer = [], list(first)
        while longer:
            levels.append(sorted({t[:len(levels) + 1] for t in longer}))
            longer = [t for t in longer if len(t) > len(levels)]
        self.byte = [np.array([p[-1] for p in level], dtype=np.int64) for level in levels]
        self.token = [np.array([first.get(p, self.V) for p in level], dtype=np.int64)
                      for level in levels]
        self.first_child, self.n_children = [], []
        for level, below in zip(levels, levels[1:] + [[]]):
            counts = Counter(p[:-1] for p in below)
            n = np.array([counts[p] for p in level], dtype=np.int64)
            self.first_child.append(np.cumsum(n) - n)
            self.n_children.append(n)

    def allowed(self, trans, state):
        """(V + 1,) bool: the tokens whose every byte moves the DFA `trans` from `state` to a
        live state (the last slot collects the nodes that end no token)."""
        allowed = np.zeros(self.V + 1, dtype=bool)
        nodes = np.arange(len(self.byte[0]))
        states = trans[state, self.byte[0]]                        # (level-0 nodes,)
        for d in range(len(self.byte)):
            live = states >= 0
            nodes, states = nodes[live], states[live]
            allowed[self.token[d][nodes]] = True
            if d + 1 == len(self.byte) or not len(nodes):
                break
            counts = self.n_children[d][nodes]
            # the children of every live node, in order: a "ragged arange" of runs
            ends = np.cumsum(counts)
            children = np.repeat(self.first_child[d][nodes] - ends + counts, counts) \
                + np.arange(ends[-1])
            states = trans[np.repeat(states, counts), self.byte[d + 1][children]]
            nodes = children
        allowed[self.alias_ids] = allowed[self.alias_of]
        return allowed


class TokenMasker:
    """One constraint over one vocabulary: a request's grammar state is one int, from `start`.
    A state's (V,) bool mask is computed when first met, then cached on `device`."""

    start = 0

    def __init__(self, dfa, trie, eos_ids, device="cpu"):
        self.dfa, self.trie, self.device = dfa, trie, device
        self.eos_ids = sorted(set(eos_ids))
        self.masks = {}  # state → (V,) bool tensor on the device

    def mask(self, state):
        """(V,) bool, True for the tokens allowed in `state`: those whose bytes keep the
        automaton alive, and end-of-sequence only where the text so far is a full match."""
        if state not in self.masks:
            if state == DEAD:
                raise ValueError("the dead state allows no token")
            allowed = self.trie.allowed(self.dfa.trans, state)[:-1]
            allowed[self.eos_ids] = self.dfa.accepting[state]
            mask, on_gpu = torch.from_numpy(allowed), torch.device(self.device).type == "cuda"
            # pinned and non_blocking: the copy queues behind the running forward; no host wait
            self.masks[state] = (mask.pin_memory() if on_gpu else mask).to(self.device,
                                                                            non_blocking=on_gpu)
        return self.masks[state]

    def next_state(self, state, token_id):
        """The state after `token_id`: DEAD if the mask did not allow it. End-of-sequence leaves
        an accepting state as it is (the request is over)."""
        if state == DEAD:
            return DEAD
        if token_id in self.eos_ids:
            return state if self.dfa.accepting[state] else DEAD
        data = self.trie.vocab[token_id]
        return self.dfa.walk(state, data) if data else DEAD

    def is_accepting(self, state):
        return state != DEAD and bool(self.dfa.accepting[state])

    def is_complete(self, state):
        """Accepting with no byte that may follow: generation stops here, without sampling."""
        return state != DEAD and bool(self.dfa.finished[state])


def apply_token_masks(logits, masks):
    """Forbid, in place, what each row's grammar forbids. logits (B, V); masks: B entries, each
    a TokenMasker mask on logits' device or None (unconstrained). Reads nothing back."""
    if all(m is None for m in masks):
        return logits
    everything = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
    allowed = torch.stack([everything if m is None else m for m in masks])     # (B, V)
    return logits.masked_fill_(~allowed, float("-inf"))


class GrammarCache:
    """The vocabulary's trie, built once, and the TokenMaskers of the `capacity` most recent
    constraints, shared by their requests (each keeps its own, so an eviction disturbs none)."""

    def __init__(self, vocab, eos_ids, device="cpu", capacity=32):
        self.trie, self.eos_ids, self.device = TokenTrie(vocab), eos_ids, device
        self.capacity, self.maskers = capacity, OrderedDict()

    def get(self, regex=None, choice=None, json_schema=None):
        """The TokenMasker of this constraint, or None when there is none."""
        key = constraint_key(regex, choice, json_schema)
        if key is None:
            return None
        if key not in self.maskers:
            self.maskers[key] = TokenMasker(_compile(*key), self.trie, self.eos_ids, self.device)
            if len(self.maskers) > self.capacity:
                self.maskers.popitem(last=False)  # the least recently used
        self.maskers.move_to_end(key)
        return self.maskers[key]


def grammar_vocab(tokenizer, vocab_size):
    """Each of the model's vocab_size ids as the bytes it writes, or None where it writes none:
    special tokens (decode skips them) and ids past the tokenizer's (Qwen3 pads its embedding rows).
    Whatever an eos id's bytes, the masks allow it exactly where the text is complete."""
    table = tokenizer.token_bytes[:vocab_size]
    vocab = [None if i in tokenizer.special_ids or not data else data
             for i, data in enumerate(table)]
    return vocab + [None] * (vocab_size - len(vocab))


# ----------------------------------------------------------------------------------------------
# Chapter 35. The text boundary: token ids become text, a piece at a time
# ----------------------------------------------------------------------------------------------
# NEW in stage 08. A stream sends text as the tokens arrive, but a byte-level BPE token may end
# inside a UTF-8 character ("€" is three bytes, maybe three tokens). An incremental UTF-8 decoder
# holds the bytes of an unfinished character until the rest comes (decoding all the tokens again
# each step would cost O(n^2)), so the pieces add up to the decode of all the tokens at once.
#
# Stop strings are matched in the text, not the tokens ("STOP" may come as "ST" + "OP"): a tail
# that may begin one is held back until the next tokens decide. Once one is found, nothing after
# it is sent, and the request ends with finish_reason "stop" (the server aborts it in the engine,
# which knows nothing of text).

def _token_data(token_bytes, token_id):
    """The bytes a token writes: b"" past the tokenizer's ids (Qwen3's model has more rows)."""
    return token_bytes[token_id] if token_id < len(token_bytes) else b""


class Detokenizer:
    """One request's token ids -> text, a piece at a time (see above); special tokens write none.
    stop: strings that end the text just before the first one to appear (`stopped`); of several
    that one token completes, the one that starts first."""

    def __init__(self, token_bytes, special_ids, stop=()):
        self.token_bytes, self.special_ids = token_bytes, special_ids
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = [s for s in stop if s]
        self.held = ""  # decoded text not emitted yet: it may begin a stop string
        self.stopped = False  # a stop string was found: nothing more is emitted

    def decode_next(self, token_id):
        """The text this token makes final ('' if none yet)."""
        if self.stopped:
            return ""
        data = b"" if token_id in self.special_ids else _token_data(self.token_bytes, token_id)
        return self._release(self.held + self.utf8.decode(data))

    def decode_next_many(self, token_ids):
        """decode_next of each token, joined. Without stop strings their bytes decode at once,
        which saves a fast stream its per-token Python."""
        if self.stop or self.stopped:
            return "".join([self.decode_next(token_id) for token_id in token_ids])
        special, table = self.special_ids, self.token_bytes
        data = b"".join([b"" if i in special else _token_data(table, i) for i in token_ids])
        return self._release(self.held + self.utf8.decode(data))

    def flush(self):
        """At the end of the request: what was held back (an unfinished character as U+FFFD)."""
        if self.stopped:
            return ""
        text, self.held = self.held + self.utf8.decode(b"", final=True), ""
        return self._cut_at_stop(text)[0]

    def _release(self, text):
        text, found = self._cut_at_stop(text)
        if found:
            return text
        keep = self._longest_stop_prefix(text)  # the tail that may yet become a stop string
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def _cut_at_stop(self, text):
        """(text up to the earliest stop string, True), or (text, False) when there is none."""
        starts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if not starts:
            return text, False
        self.stopped, self.held = True, ""
        return text[:min(starts)], True

    def _longest_stop_prefix(self, text):
        """The length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


def token_text(token_bytes, token_id):
    """A token as logprobs name it: its text, or "bytes:" + its bytes escaped if not UTF-8 alone."""
    data = _token_data(token_bytes, token_id)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


# ----------------------------------------------------------------------------------------------
# Chapter 36. The server: requests, checked
# ----------------------------------------------------------------------------------------------
# NEW in stage 08. The server speaks the OpenAI API, so that any OpenAI client works unchanged
# (vLLM's behaviour where OpenAI's is silent). A missing, mistyped, unknown or out-of-range field
# is a 400 naming it, in OpenAI's envelope {"error": {"message", "type", "param", "code"}}, before
# the engine hears of it. n choices of a prompt are n engine requests (with a seed, choice j uses
# seed + j, so each can be drawn again alone). The engine checks the rest (lengths against the
# context, ids against the vocabulary); its ValueError is a 400 as well.

MAX_CHOICES = 128  # prompts x n in one request
MAX_STOP = 4  # stop strings in one request (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # as vLLM's default max_logprobs
# A schema compiles on the request's thread, holding the interpreter lock away from every stream
# meanwhile (one of 500 properties took 1.2 s on a 2-core CPU).
MAX_SCHEMA_BYTES = 8192


class APIError(Exception):
    """An error answered with `status` in OpenAI's envelope. param: the field it is about."""

    def __init__(self, message, status=400, param=None, code=None, headers=()):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers

    def body(self):
        kind = "server_error" if self.status >= 500 else "invalid_request_error"  # as OpenAI's
        return {"error": {"message": str(self), "type": kind, "param": self.param,
                          "code": self.code}}


def _short(value):
    """A JSON value, cut for an error message."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_bool(x):
    return isinstance(x, bool)


def _is_str(x):
    return isinstance(x, str)


def _is_object(x):
    return isinstance(x, dict)


def _is_real(x):
    """_is_number (stage 07's), but an integer beyond a float's range (JSON allows 1 followed by
    400 zeros) is not a number rather than an OverflowError from math.isfinite (a 500)."""
    return not (_is_int(x) and abs(x) > sys.float_info.max) and _is_number(x)


def _is_ids(x):
    # (type is int, not _is_int: the same on JSON's values, and far cheaper on a long prompt)
    return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)


def field(body, name, ok, what, default=None, where=""):
    """body[name] if the predicate ok accepts it, `default` when it is absent or null; anything
    else is a 400 naming the field (`where` prefixes a nested field's name)."""
    value = body.get(name)
    if value is None:
        return default
    if not ok(value):
        raise APIError(f"'{where}{name}' must be {what}, got {_short(value)}", param=where + name)
    return value


def check_text(text, param):
    """text, if it is Unicode text. A lone surrogate ("\\ud800" is legal JSON) has no UTF-8: the
    tokenizer would read it as U+FFFD, and the model answer a prompt the client did not send."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise APIError(f"'{param}' holds a lone surrogate, U+{ord(text[e.start]):04X} at "
                       f"character {e.start}: not text", param=param) from None
    return text


def check_fields(body, known, where=""):
    """An unknown field is an error, not ignored: its client expects something this server does
    not do (as OpenAI answers)."""
    unknown = sorted(set(body) - known)
    if unknown:
        raise APIError(f"unknown or unsupported field '{where}{unknown[0]}'",
                       param=where + unknown[0])


COMMON_FIELDS = frozenset({
    "model", "n", "stop", "seed", "stream", "stream_options", "max_tokens", "temperature",
    "top_p", "presence_penalty", "frequency_penalty", "response_format", "user", "logit_bias",
    "top_k", "min_p", "repetition_penalty", "ignore_eos"})  # the last four: vLLM's extras
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                               "chat_template_kwargs"}
# accepted with the value that asks for nothing only
NOTHING_ASKED = {"echo": (None, False), "suffix": (None, ""), "logit_bias": (None, {})}


def _json_object_regex(depth):
    """response_format json_object as a regex for stage 07's structured output: a compact JSON
    object whose values nest at most `depth` more objects or arrays. JSON of bounded depth is a
    regular language; its automaton grows fourfold a level (depth 2: 2,182 states)."""
    string = r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
    scalar = rf"(?:{string}|-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null)"

    def members(value):
        return rf"\{{(?:{string}:{value}(?:,{string}:{value})*)?\}}"

    value = scalar
    for _ in range(depth):
        value = rf"(?:{scalar}|{members(value)}|\[(?:{value}(?:,{value})*)?\])"
    return members(value)


JSON_OBJECT_REGEX = _json_object_regex(depth=2)


@dataclass
class Generation:
    """A generation request, checked: what the engine runs, and how the answer is written."""
    chat: bool
    prompts: list  # each prompt's token ids
    params: list  # each choice's SamplingParams: prompt i's choice j is choice i * n + j
    n: int
    stop: tuple  # stop strings
    stream: bool
    include_usage: bool  # (streams) a last chunk with the usage
    logprobs: int | None  # top logprobs a token; None: no logprobs


def generation_request(body, chat, tokenizer, vocab_size):
    """The Generation of a (chat) completion body; an APIError (400) names the first bad field."""
    check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    for name, nothing in NOTHING_ASKED.items():
        if body.get(name) not in nothing:
            raise APIError(f"'{name}' is not supported by this server", param=name)
    integer = (_is_int, "an integer")
    if chat:
        prompts = [tokenizer.encode(chat_prompt(body, tokenizer))]
        max_tokens = field(body, "max_completion_tokens", *integer,  # default: up to the context
                           field(body, "max_tokens", *integer))
        logprobs = chat_logprobs_asked(body)
    else:
        prompts = completion_prompts(body, tokenizer)
        max_tokens = field(body, "max_tokens", *integer, 16)  # OpenAI's default
        logprobs = field(body, "logprobs", lambda x: _is_int(x) and 0 <= x <= MAX_TOP_LOGPROBS,
                         f"an integer from 0 to {MAX_TOP_LOGPROBS}")
    n = field(body, "n", lambda x: _is_int(x) and x >= 1, "a positive integer", 1)
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(f"{len(prompts)} prompts x n = {n} choices: at most {MAX_CHOICES}",
                       param="n")
    stream = field(body, "stream", _is_bool, "true or false", False)
    options = field(body, "stream_options", _is_object, "an object")
    if options is not None and not stream:
        raise APIError("'stream_options' is allowed only with 'stream': true",
                       param="stream_options")
    check_fields(options or {}, {"include_usage"}, "stream_options.")
    include_usage = field(options or {}, "include_usage", _is_bool, "true or false", False,
                          "stream_options.")
    seed = field(body, "seed", *integer)
    kwargs = dict(max_tokens=max_tokens, logprobs=logprobs,
                  **sampling_fields(body, vocab_size), **structured_output(body))
    try:
        params = [SamplingParams(**kwargs, seed=None if seed is None else seed + j)
                  for _ in prompts for j in range(n)]
    except (ValueError, RecursionError) as e:  # (a schema nested deeper than Python recurses)
        named = re.match(r"SamplingParams\.(\w+)", str(e))
        param = named and ("response_format" if named[1] in STRUCTURED_FIELDS else named[1])
        if param == "max_tokens" and chat and body.get("max_completion_tokens") is not None:
            param = "max_completion_tokens"  # the field the client sent
        raise APIError(str(e), param=param) from None
    return Generation(chat, prompts, params, n, stop_strings(body), stream, include_usage, logprobs)


def sampling_fields(body, vocab_size):
    """The sampling fields of both endpoints, typed here; their ranges are SamplingParams'."""
    number = (_is_real, "a number in a float's range")
    top_k = field(body, "top_k", _is_int, "an integer", 0)
    return dict(
        temperature=field(body, "temperature", *number, 1.0),
        top_p=field(body, "top_p", *number, 1.0),
        top_k=0 if top_k == -1 or top_k >= vocab_size else top_k,  # -1: all, as in vLLM
        min_p=field(body, "min_p", *number, 0.0),
        repetition_penalty=field(body, "repetition_penalty", *number, 1.0),
        presence_penalty=field(body, "presence_penalty", *number, 0.0),
        frequency_penalty=field(body, "frequency_penalty", *number, 0.0),
        ignore_eos=field(body, "ignore_eos", _is_bool, "true or false", False))


def structured_output(body):
    """response_format as stage 07's structured output: text (none), json_object or json_schema."""
    fmt = field(body, "response_format", _is_object, "an object")
    if fmt is None or fmt.get("type") == "text":
        return {}
    check_fields(fmt, {"type", "json_schema"}, "response_format.")
    if fmt.get("type") == "json_object":
        return {"regex": JSON_OBJECT_REGEX}
    if fmt.get("type") != "json_schema":
        raise APIError(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', "
                       f"got {_short(fmt.get('type'))}", param="response_format.type")
    where = "response_format.json_schema."
    spec = field(fmt, "json_schema", _is_object, "an object", {}, "response_format.")
    check_fields(spec, {"name", "schema", "strict", "description"}, where)
    schema = field(spec, "schema", _is_object, "a JSON schema (an object)", where=where)
    if schema is None:
        raise APIError(f"'{where}schema' is required", param=where + "schema")
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise APIError(f"'{where}schema' is {size:,} bytes of JSON, over the limit of "
                       f"{MAX_SCHEMA_BYTES:,}", param=where + "schema")
    return {"json_schema": schema}


def stop_strings(body):
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not (isinstance(stop, list) and len(stop) <= MAX_STOP
            and all(isinstance(s, str) and s for s in stop)):
        raise APIError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP}, got "
                       f"{_short(body['stop'])}", param="stop")
    return tuple(check_text(s, "stop") for s in stop)


def completion_prompts(body, tokenizer):
    """Each prompt's token ids; prompt: a string, a list of ids, or a list of either (a batch)."""
    prompt = body.get("prompt")
    batch = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else prompt
    if not (isinstance(batch, list) and batch and all(_is_str(p) or _is_ids(p) for p in batch)):
        raise APIError(f"'prompt' must be a string, a list of token ids, or a non-empty list of "
                       f"those, got {_short(prompt)}", param="prompt")
    return [tokenizer.encode(check_text(p, "prompt")) if isinstance(p, str) else p for p in batch]


def chat_prompt(body, tokenizer):
    """The messages in the model's chat format (stage 07's apply_chat_template). A content is a
    string or a list of text parts; enable_thinking comes in vLLM's chat_template_kwargs."""
    messages = field(body, "messages", lambda x: isinstance(x, list) and bool(x),
                     "a non-empty list of messages")
    if messages is None:
        raise APIError("'messages' is required", param="messages")
    turns = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]."
        if not isinstance(message, dict):
            raise APIError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        check_fields(message, {"role", "content", "name"}, where)
        role = field(message, "role", _is_str, "a string", where=where)
        content = message.get("content")
        if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                             and _is_str(part.get("text")) for part in content):
            content = "".join(part["text"] for part in content)
        if not _is_str(content):
            raise APIError(f"'{where}content' must be a string or a list of text parts "
                           f"({{\"type\": \"text\", \"text\": ...}})", param=where + "content")
        turns.append({"role": role, "content": check_text(content, where + "content")})
    options = field(body, "chat_template_kwargs", _is_object, "an object", {})
    check_fields(options, {"enable_thinking"}, "chat_template_kwargs.")
    thinking = field(options, "enable_thinking", _is_bool, "true or false", True,
                     "chat_template_kwargs.")
    try:
        return tokenizer.apply_chat_template(turns, enable_thinking=thinking)
    except ValueError as e:  # a role it does not know, or a model without a chat template
        raise APIError(str(e), param="messages") from None


def chat_logprobs_asked(body):
    """Chat's logprobs (a bool) and top_logprobs (how many): top logprobs a token, or None."""
    wanted = field(body, "logprobs", _is_bool, "true or false", False)
    top = field(body, "top_logprobs", lambda x: _is_int(x) and 0 <= x <= MAX_TOP_LOGPROBS,
                f"an integer from 0 to {MAX_TOP_LOGPROBS}")
    if top is not None and not wanted:
        raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


# ----------------------------------------------------------------------------------------------
# Chapter 36. The server: two processes, one engine thread
# ----------------------------------------------------------------------------------------------
# NEW in stage 08. One engine thread owns the engine (which is not thread-safe) and alone calls
# add, abort and step. Python runs one thread of a process at a time (the GIL), so the HTTP
# threads run in a process of their own, as vLLM's API server does (sharing the engine's, the
# server reached 0.85-0.93x LLM.generate's tokens/s at 64 streams; apart, 0.96x).
#
# One pipe joins the two (a socket pair; each message a pickle; from the HTTP side plain data
# only, which the engine's process reads whatever name it gave this module):
# - HTTP -> engine: ("add", job id, choices a prompt, [(engine request id, prompt ids,
#   SamplingParams as a dict)]), ("abort", [engine request ids]), ("idle", bool), ("ready",).
# - engine -> HTTP: ("ready", tokenizer, max_model_len, vocab_size), ("load failed", message),
#   ("engine failed",), ("stop",), and ("events", [...], the engine's state), the events being
#   ("accepted", job id), ("refused", job id, message), ("failed", job id, status, message) and
#   ("tokens", engine request id, new ids, their logprobs, finish_reason, eos or stop id).

class Job:
    """One HTTP request's choices, each an engine request, and the queue of the engine's events
    about it (see above, less the job id; "tokens" carries the choice's index)."""

    def __init__(self, request_id, prompts, params):
        self.id = request_id  # (the engine's request ids are this id, "-", the choice's index)
        self.n = len(params) // len(prompts)  # choices a prompt
        self.requests = [(f"{request_id}-{i}", prompts[i // self.n], p)
                         for i, p in enumerate(params)]
        self.replies = queue.SimpleQueue()
        self.arrival = time.perf_counter()  # the clock of time to first token
        self.ending = False  # a choice's last reply (or a failure) is queued: deliver it now


@dataclass(eq=False)
class Choice:
    """The HTTP process's record of one live engine request."""
    job: Job
    index: int  # in job.requests
    sent: int = 0  # output tokens forwarded so far
    first: float = 0.0  # when its first token was forwarded (perf_counter)
    last: float = 0.0  # and its last


class EngineThread:
    """The thread that owns an LLM's engine: it takes the HTTP process's commands from `conn`,
    steps while the engine has work, and sends each step's events back in one message."""

    def __init__(self, llm, conn, send, on_ready):
        self.engine, self.conn, self.send, self.on_ready = llm.engine, conn, send, on_ready
        self.live = {}  # engine request id -> [its job's id, output tokens sent], until it ends
        self.state_sent = None  # the engine's state as the HTTP process last heard it
        self.http_idle, self.stopping = True, threading.Event()
        self.wake_reader, self.wake_writer = socket.socketpair()  # (stop() wakes a blocked wait)
        self.idle, self.idle_changed = False, threading.Condition()
        self.thread = threading.Thread(target=self.serve_pipe, name="engine", daemon=True)
        self.thread.start()

    def stop(self, timeout):
        """Fail every open job (503) and end the thread."""
        self.stopping.set()
        with contextlib.suppress(OSError):
            self.wake_writer.send(b"x")
        self.thread.join(timeout)

    def wait_until_idle(self, timeout=None):
        with self.idle_changed:  # (a command in the pipe that the thread has not read: not idle)
            return self.idle_changed.wait_for(lambda: self.idle and not self.conn.poll(), timeout)

    def _set_idle(self, idle):
        with self.idle_changed:
            self.idle = idle
            self.idle_changed.notify_all()

    def serve_pipe(self):
        with torch.inference_mode():  # (grad mode is per thread)
            while not self.stopping.is_set():
                events = []
                try:
                    commands = self._next_commands()
                except (EOFError, OSError):  # the HTTP process is gone: nothing to serve
                    LOG.error("the HTTP process has ended; the engine thread stops")
                    self._fail_all(events, 503, "the server is shutting down")
                    self._set_idle(True)
                    return
                for command in commands:
                    try:  # each command alone: a bug in one fails its job only
                        getattr(self, "_cmd_" + command[0])(events, *command[1:])
                    except Exception:
                        LOG.exception("the engine thread failed on a %r command", command[0])
                        if command[0] == "add":
                            events.append(("failed", command[1], 500, "internal error in the "
                                           "engine (logged by the server)"))
                self._send_events(events)  # before the step: a stream's headers go out first
                events = []
                try:
                    if self.engine.has_unfinished():
                        self._step(events)
                except Exception:  # a bug: end the requests it touched, keep serving the rest
                    LOG.exception("the engine failed; its requests end with an error")
                    if not self._fail_all(events, 500, "internal error in the engine (logged "
                                                       "by the server)"):
                        self._send_events(events)
                        self.send(("engine failed",))  # one that cannot be reset would fail
                        break  # every step: the thread ends, and the HTTP process answers 503
                self._send_events(events)
            else:
                events = []
                self._fail_all(events, 503, "the server is shutting down")
                self._send_events(events)
        self._set_idle(True)

    def _next_commands(self):
        """The commands waiting; while the engine has nothing to do, block for one."""
        if not self.engine.has_unfinished() and not self.conn.poll():
            self._set_idle(self.http_idle)
            if self.wake_reader in multiprocessing.connection.wait([self.conn, self.wake_reader]):
                self.wake_reader.recv(4096)
            if self.stopping.is_set():
                return []
        commands = []
        if self.conn.poll():
            if self.idle:  # (before the commands leave the pipe: see wait_idle)
                self._set_idle(False)
            while self.conn.poll():
                commands.append(self.conn.recv())
        elif self.idle and self.engine.has_unfinished():
            self._set_idle(False)
        return commands

    def _send_events(self, events):
        """Send the events with the engine's state; without events, the state alone if it has
        changed (an abort with no step after it must still show in /metrics)."""
        state = self._state()
        if events or state != self.state_sent:
            self.send(("events", events, state))
            self.state_sent = state

    def _cmd_idle(self, events, idle):
        self.http_idle = idle

    def _cmd_ready(self, events):
        self.on_ready()

    def _cmd_add(self, events, job_id, n, requests):
        seqs = []  # every choice checked before any is queued: a job runs whole or not at all
        for index, (request_id, prompt, params) in enumerate(requests):
            try:
                seqs.append(self.engine.new_sequence(request_id, prompt, SamplingParams(**params)))
            except ValueError as e:  # its message names the engine's request id: the client's
                name = "the prompt" if len(requests) == n else f"prompt {index // n}"
                events.append(("refused", job_id, str(e).replace(f"prompt {request_id!r}", name)))
                return
        for seq in seqs:
            self.engine.add_sequence(seq)
            self.live[seq.request_id] = [job_id, 0]  # (and the output tokens sent so far)
        events.append(("accepted", job_id))

    def _cmd_abort(self, events, request_ids):
        for request_id in request_ids:
            if self.live.pop(request_id, None) is not None:  # (it may have ended meanwhile)
                self.engine.abort(request_id)

    def _step(self, events):
        for seq in self.engine.step_sequences():
            entry = self.live.get(seq.request_id)
            if entry is None:
                continue
            sent = entry[1]  # the output tokens sent before: only those past them go
            new = seq.token_ids[seq.num_prompt_tokens + sent:]
            entry[1] += len(new)
            events.append(("tokens", seq.request_id, new,
                           None if seq.logprobs is None else seq.logprobs[sent:],
                           seq.finish_reason, seq.stop_token_id))
            if seq.is_finished:
                del self.live[seq.request_id]

    def _fail_all(self, events, status, message):
        """End every live request (each job hears once) and clear the engine; whether it could."""
        for job_id in dict.fromkeys(job_id for job_id, _ in self.live.values()):
            events.append(("failed", job_id, status, message))
        self.live.clear()
        try:
            self.engine.reset()  # aborts what is left, and waits for the step in flight
            return True
        except Exception:
            LOG.exception("the engine could not be reset")
            return False

    def _state(self):
        """The engine's state, for /metrics."""
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        stats = self.engine.stats
        return dict(running=len(scheduler.running), waiting=len(scheduler.waiting),
                    blocks_used=blocks.num_blocks - blocks.num_free_blocks,
                    blocks_total=blocks.num_blocks, prefix_hit_rate=stats["prefix_hit_rate"],
                    draft_tokens=stats["draft_tokens"], accepted_tokens=stats["accepted_tokens"])


class EngineLink:
    """The HTTP process's end of the pipe, on a thread of its own: it hears of the HTTP threads'
    jobs (submit) and forwards their ends (end_job), turns the engine's events into each job's
    replies, and serves the deliveries. It ends when the engine does."""

    def __init__(self, conn, app):
        self.conn, self.app, self.metrics = conn, app, app.metrics
        self.pipe_lock = threading.RLock()  # (the HTTP threads send their adds themselves)
        self.commands = queue.SimpleQueue()
        self.wake_reader, self.wake_writer = socket.socketpair()  # (a command wakes the wait)
        self.jobs = {}  # job id -> Job, from add until the engine accepts or refuses it
        self.dropped = {}  # job id -> its engine request ids: aborted before the engine answered
        self.live = {}  # engine request id -> Choice, until it ends
        self.deliveries = {}  # job -> its Delivery, until it is done
        self.checked = time.monotonic()  # when _serve_deliveries last looked for clients gone
        self.open = False  # whether the engine was last told that a request is open here
        self.gone = None  # why the engine serves no more (it failed, or stopped), or None
        self.thread = threading.Thread(target=self.relay, name="link", daemon=True)

    def submit(self, job, delivery):
        """Send the job to the engine; the link's thread then serves it (Delivery). The HTTP
        thread sends the add itself, as the link, busy with other streams' chunks, delayed it
        (p99 TTFT at 64 streams: 13-18 ms through it, 11-12 ms sent here). The link hears of the
        job first: it runs its commands before it reads each message."""
        self.commands.put(("_record_job", job, delivery))
        with self.pipe_lock:
            if not self.open:  # (before the add: the engine's wait_idle must not see both idle)
                self.open = True
                self._send_to_engine(("idle", False))
            if self.gone is None:
                self._send_to_engine(("add", job.id, job.n, [
                    (request_id, prompt, dataclasses.asdict(params))
                    for request_id, prompt, params in job.requests]))
                return
        self._wake()  # (no answer will come: _add fails it)

    def end_job(self, job, choices=None, reason="abort"):
        """End a job's choices (default: all) in the engine; reason: "stop" or "abort"."""
        self._put(("_end_choices", job, choices, reason))

    def _put(self, command):
        self.commands.put(command)
        self._wake()

    def _wake(self):
        with contextlib.suppress(OSError):
            self.wake_writer.send(b"x")

    def relay(self):
        while True:
            ready = multiprocessing.connection.wait(
                [self.conn, self.wake_reader], POLL_SECONDS if self.deliveries else None)
            if self.wake_reader in ready:
                self.wake_reader.recv(4096)
            self._run_commands()
            try:
                while self.conn.poll():
                    message = self.conn.recv()
                    self._run_commands()  # (the add that this message answers, if it is one)
                    if message[0] == "stop":
                        self._end_all("the server is shutting down")
                        return
                    getattr(self, "_on_" + message[0].replace(" ", "_"))(*message[1:])
            except (EOFError, OSError):  # the engine's process has ended
                self._end_all("the engine has stopped")
                return
            self._serve_deliveries()
            open_ = bool(self.jobs or self.live or self.deliveries)
            if open_ != self.open:
                with self.pipe_lock:  # (an add whose news is queued is open: it comes next)
                    if open_ or self.commands.empty():
                        self.open = open_
                        self._send_to_engine(("idle", not open_))

    def _run_commands(self):
        while not self.commands.empty():
            command = self.commands.get()
            try:
                getattr(self, command[0])(*command[1:])
            except Exception:
                LOG.exception("the link failed on a %r command", command[0])
                if command[0] == "_record_job":  # (its HTTP thread waits on the delivery)
                    job = command[1]
                    self.deliveries.pop(job, None)
                    self.jobs.pop(job.id, None)  # (the engine has it: ended when it answers)
                    self.dropped[job.id] = [request_id for request_id, _, _ in job.requests]
                    command[2].error = APIError("internal error (logged by the server)", 500)
                    command[2].done.set()

    def _send_to_engine(self, message):
        # (an OSError: the engine's side is gone, and the next wait sees the pipe closed)
        with contextlib.suppress(OSError), self.pipe_lock:
            self.conn.send(message)

    def _serve_deliveries(self):
        """Serve every open Delivery (its text, a stream's chunks; every POLL_SECONDS, whether its
        client is there), and end those done: finished, failed, or gone (aborted). A bug in one
        ends that one only. On one thread, as many HTTP threads each taking the interpreter lock
        for their own chunks would keep it waiting. A stream waits until its next write is due,
        so that a few steps' replies become text at once; new streams go first."""
        now = time.monotonic()
        check = now - self.checked >= POLL_SECONDS
        if check:
            self.checked = now
        # (next_write: 0 until a stream's first chunk is queued)
        for job, delivery in sorted(self.deliveries.items(),
                                    key=lambda item: item[1].next_write > 0):
            if not (check or delivery.due(now)):
                continue
            try:
                delivery.take_replies(lambda index: self._end_choices(job, [index], "stop"))
                if delivery.stream:
                    delivery.write_stream(now)
                if not delivery.complete and not (check and delivery.client_gone(now)):
                    continue
                delivery.gone = not delivery.complete
            except APIError as e:
                delivery.error = e
            except (ClientGone, OSError):
                delivery.gone = True
            except Exception:
                LOG.exception("a request's delivery failed")
                delivery.error = APIError("internal server error (the server logged it)", 500)
            del self.deliveries[job]
            if not delivery.complete:
                self._end_choices(job, None, "abort")
            delivery.done.set()

    # -- commands of the HTTP threads

    def _record_job(self, job, delivery):  # (submit has sent it to the engine)
        self.deliveries[job] = delivery
        if self.gone is not None:  # (the engine has failed: no request runs any more)
            job.replies.put(("failed", 503, self.gone))
            return
        self.jobs[job.id] = job

    def _end_choices(self, job, choices, reason):
        if choices is None and self.jobs.pop(job.id, None) is not None:
            self.dropped[job.id] = [request_id for request_id, _, _ in job.requests]
        ended = []
        for index in range(len(job.requests)) if choices is None else choices:
            request_id = job.requests[index][0]
            choice = self.live.pop(request_id, None)
            if choice is not None:  # (it may have ended in the meantime)
                ended.append(request_id)
                self._ended(choice, reason)
        if ended:
            self._send_to_engine(("abort", ended))

    # -- the engine's messages

    def _on_ready(self, tokenizer, max_model_len, vocab_size):
        self.app.tokenizer, self.app.max_model_len = tokenizer, max_model_len
        self.app.vocab_size = vocab_size
        self.app.ready.set()
        self._send_to_engine(("ready",))

    def _on_load_failed(self, message):
        self.app.load_error = message

    def _on_engine_failed(self):
        self._end_all("the engine has stopped (the server logged why)")

    def _on_events(self, events, state):
        now, generated = time.perf_counter(), 0
        for event in events:
            if event[0] == "tokens":
                generated += self._tokens(now, *event[1:])
            elif event[0] == "accepted":
                job = self.jobs.pop(event[1], None)
                if job is None:  # aborted while the engine took it: it ends here
                    self._send_to_engine(("abort", self.dropped.pop(event[1], [])))
                    continue
                for index, (request_id, prompt, _) in enumerate(job.requests):
                    self.live[request_id] = Choice(job, index)
                with self.metrics.lock:
                    self.metrics.prompt_tokens += sum(len(p) for _, p, _ in job.requests)
                job.replies.put(("accepted",))
            else:  # refused (before it ran), or failed (a bug): every choice of the job ends
                self.dropped.pop(event[1], None)
                job = self.jobs.pop(event[1], None) or next(
                    (c.job for c in self.live.values() if c.job.id == event[1]), None)
                if job is None:
                    continue
                job.replies.put(("refused", event[2]) if event[0] == "refused"
                                else ("failed", event[2], event[3]))
                job.ending = True
                for request_id, _, _ in job.requests:
                    choice = self.live.pop(request_id, None)
                    if choice is not None:
                        self._ended(choice, "abort")
        with self.metrics.lock:
            self.metrics.generation_tokens += generated
            self.metrics.engine = state

    def _tokens(self, now, request_id, new, logprobs, finish_reason, stop_token_id):
        choice = self.live.get(request_id)
        if choice is None:  # aborted here meanwhile
            return 0
        if choice.sent == 0:
            choice.first = now
            with self.metrics.lock:
                self.metrics.ttft.observe(now - choice.job.arrival)
        choice.sent += len(new)
        choice.last = now
        choice.job.replies.put(("tokens", choice.index, new, logprobs, finish_reason,
                                stop_token_id))
        if finish_reason is not None:
            choice.job.ending = True
            del self.live[request_id]
            self._ended(choice, finish_reason)
        return len(new)

    def _ended(self, choice, reason):
        with self.metrics.lock:
            self.metrics.finished[reason] += 1
            if choice.sent > 1:
                self.metrics.tpot.observe((choice.last - choice.first) / (choice.sent - 1))

    def _end_all(self, message):
        """The engine serves no more: every open job and delivery fails with a 503 and `message`."""
        self.gone = message
        jobs = {id(job): job for job in self.jobs.values()}
        jobs.update((id(choice.job), choice.job) for choice in self.live.values())
        for job in jobs.values():
            job.replies.put(("failed", 503, message))
            job.ending = True
        for choice in self.live.values():
            self._ended(choice, "abort")
        self.jobs.clear()
        self.live.clear()
        while not self.commands.empty():  # (a job added meanwhile ends too)
            command = self.commands.get()
            if command[0] == "_record_job":
                self.deliveries[command[1]] = command[2]
                command[1].replies.put(("failed", 503, message))
        self._serve_deliveries()  # each open delivery takes its job's failure, and ends
        for delivery in self.deliveries.values():  # (none should be left)
            delivery.error = APIError(message, 503)
            delivery.done.set()
        self.deliveries.clear()


# ----------------------------------------------------------------------------------------------
# Chapter 36. The server: metrics
# ----------------------------------------------------------------------------------------------
# NEW in stage 08. GET /metrics in Prometheus' text format (0.0.4): the engine's state after its
# last step, counters since the start, and histograms of the two latencies a serving benchmark
# reports: time to first token (from the request's arrival) and time per output token after it.

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0)  # seconds, vLLM's
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5)
FINISH_REASONS = ("stop", "length", "abort")


class Histogram:
    """Prometheus' histogram: a count per bucket (observations <= its bound), their sum."""

    def __init__(self, bounds):
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, value):
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name):
        total, lines = 0, []
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            total += count  # Prometheus' buckets are cumulative
            lines.append(f'{name}_bucket{{le="{"+Inf" if bound == math.inf else bound}"}} {total}')
        return lines + [f"{name}_sum {self.sum}", f"{name}_count {total}"]


class Metrics:
    """The server's numbers: written by the EngineLink, read by /metrics, under `lock`."""

    def __init__(self):
        self.lock = threading.Lock()
        self.engine = dict(running=0, waiting=0, blocks_used=0, blocks_total=0,
                           prefix_hit_rate=0.0, draft_tokens=0, accepted_tokens=0)
        self.prompt_tokens = self.generation_tokens = 0
        self.finished = Counter()  # finish_reason -> engine requests
        self.ttft, self.tpot = Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS)

    def render(self):
        """The text of GET /metrics."""
        with self.lock:
            e = self.engine
            metrics = [  # (name, type, help, [(labels, value)] or a Histogram)
                ("num_requests_running", "gauge", "Requests in the engine's running batch.",
                 e["running"]),
                ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
                 e["waiting"]),
                ("kv_cache_blocks_used", "gauge", "KV cache blocks in use.", e["blocks_used"]),
                ("kv_cache_blocks_total", "gauge", "KV cache blocks in the pool.",
                 e["blocks_total"]),
                ("prefix_cache_hit_rate", "gauge",
                 "Of the prompt tokens looked up, those found in the prefix cache.",
                 e["prefix_hit_rate"]),
                ("prompt_tokens_total", "counter", "Prompt tokens of the requests accepted.",
                 self.prompt_tokens),
                ("generation_tokens_total", "counter", "Tokens generated.",
                 self.generation_tokens),
                ("request_success_total", "counter", "Engine requests ended, by finish reason.",
                 [(f'finished_reason="{r}"', self.finished[r]) for r in FINISH_REASONS]),
                ("spec_decode_draft_tokens_total", "counter", "Speculative tokens proposed.",
                 e["draft_tokens"]),
                ("spec_decode_accepted_tokens_total", "counter", "Speculative tokens accepted.",
                 e["accepted_tokens"]),
                ("time_to_first_token_seconds", "histogram",
                 "From a request's arrival to its first token.", self.ttft),
                ("time_per_output_token_seconds", "histogram",
                 "Between the tokens of a request after its first.", self.tpot)]
            lines = []
            for name, kind, help_text, value in metrics:
                name = "serve_" + name
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
                if isinstance(value, Histogram):
                    lines += value.lines(name)
                elif isinstance(value, list):
                    lines += [f"{name}{{{labels}}} {v}" for labels, v in value]
                else:
                    lines.append(f"{name} {value}")
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Chapter 36. The server: HTTP
# ----------------------------------------------------------------------------------------------
# NEW in stage 08. The standard library's ThreadingHTTPServer: a thread per connection, HTTP/1.1
# with keep-alive (the openai client reuses its connections). A broken or hostile client is
# bounded: the request line, headers and body have size limits (414, 431, 413), and every socket
# read and write times out (`timeout`), also the time a whole request has to arrive (408). A
# stream is server-sent events (`data: {json}\n\n` a chunk, `data: [DONE]` last), chunked.
#
# A generation's HTTP thread checks the body and sends the Job through the EngineLink, whose
# thread serves it (Delivery): each choice's tokens become text (ChoiceText), a stream's chunks
# go out as they come (Answer writes OpenAI's objects), and whatever ends a choice early (a stop
# string, a client gone, an error) aborts it in the engine.

SERVE_FILE = os.path.abspath(__file__)  # what the HTTP process runs (Server)
POLL_SECONDS = 0.05  # how often a request waiting for tokens checks that its client is there
STREAM_INTERVAL = 0.02  # a stream's writes at most: fewer, larger ones leave the link more time
MAX_PENDING_BYTES = 4 << 20  # of a stream, not read by its client yet (the client is dropped)
MAX_CONNECTIONS = 1024  # open at once, a thread each (serve's max_connections; a 503 beyond)
MAX_REQUEST_LINE = 8192  # bytes of "POST /v1/completions HTTP/1.1" (414 beyond)
MAX_HEADER_BYTES = 64 << 10  # of all the header lines together (431 beyond)
LINGER_SECONDS, LINGER_BYTES = 2.0, 16 << 20  # what a refused client may still send (finish)
ROUTES = {"/": {"GET": "page"}, "/health": {"GET": "health"}, "/metrics": {"GET": "metrics"},
          "/v1/models": {"GET": "models"}, "/v1/models/{model}": {"GET": "model"},
          "/v1/completions": {"POST": "completions"},
          "/v1/chat/completions": {"POST": "chat_completions"},
          "/tokenize": {"POST": "tokenize"}, "/detokenize": {"POST": "detokenize"}}
# No API key: the page (which asks for it), the health check, and the metrics (as vLLM's)
OPEN_ROUTES = ("/", "/health", "/metrics")

# The chat page, style and script inline: it sends the whole conversation each time (the API is
# stateless), reads the stream with fetch (EventSource can only GET), and sets only textContent.
CHAT_PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>08_serve chat</title>
<!-- no icon: without one the browser asks for /favicon.ico, a 404 in its console -->
<link rel="icon" href="data:,">
<style>
  body { font: 15px/1.5 system-ui, sans-serif; max-width: 46rem; margin: 0 auto; padding: 1rem; }
  h1 { font-size: 1.2rem; margin: 0 0 .5rem; }
  details { margin-bottom: .5rem; }
  details label { display: block; margin: .25rem 0; }
  textarea, input { font: inherit; }
  textarea { width: 100%; box-sizing: border-box; }
  #log { display: flex; flex-direction: column; gap: .5rem; margin: 1rem 0; }
  .user, .assistant { white-space: pre-wrap; padding: .5rem .75rem; border-radius: .5rem;
                      max-width: 85%; overflow-wrap: anywhere; }
  .user { align-self: flex-end; background: #dbeafe; }
  .assistant { align-self: flex-start; background: #f1f5f9; }
  #error { color: #b91c1c; white-space: pre-wrap; margin-bottom: .5rem; }
  #error:empty { display: none; }
</style>
</head>
<body>
<h1>Chat with <span id="model">the server</span></h1>
<details id="settings">
  <summary>Settings</summary>
  <label>System prompt <textarea id="system" rows="2"></textarea></label>
  <label>Temperature <input id="temperature" type="number" min="0" max="2" step="0.1" value="0.7">
  </label>
  <label>Max tokens <input id="max-tokens" type="number" min="1" value="1024"
                           placeholder="up to the context"></label>
  <label>API key <input id="api-key" type="password" autocomplete="off"
                        placeholder="only if the server was started with --api-key"></label>
</details>
<div id="log"></div>
<div id="error" role="alert"></div>
<textarea id="message" rows="3" placeholder="Message (Enter sends, Shift+Enter starts a new line)"
          autofocus></textarea>
<button id="send">Send</button>
<button id="stop" disabled>Stop</button>
<button id="new">New chat</button>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const conversation = [];  // the finished turns, {role, content} (the system prompt apart)
let model = null;  // the served model's name, from /v1/models
let controller = null;  // the AbortController of the reply streaming now; null when idle

// The API key is kept in the browser (localStorage) and sent only when set.
const key = $("api-key");
key.value = localStorage.getItem("api-key") || "";
key.addEventListener("change", () => { localStorage.setItem("api-key", key.value); loadModel(); });

function headers() {
  const h = {"Content-Type": "application/json"};
  if (key.value) h.Authorization = "Bearer " + key.value;
  return h;
}

function showError(text) { $("error").textContent = text; }

// An error response carries the OpenAI envelope {"error": {"message", ...}}; show its message
// with the status, or the body as it came when it is not one. A 401's message tells a program
// which header to send; a person enters the key here instead.
async function failure(response) {
  const body = await response.text();
  let message = body || response.statusText;
  try { message = JSON.parse(body).error.message; } catch (e) { /* not the envelope */ }
  if (response.status === 401) {
    message = "wrong or missing API key: enter the server's key under Settings → API key";
    $("settings").open = true;
  }
  return new Error(`HTTP ${response.status}: ${message}`);
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = role;
  div.textContent = text;
  $("log").append(div);
  return div;
}

function busy(on) {
  $("send").disabled = on;
  $("new").disabled = on;
  $("stop").disabled = !on;
}

async function loadModel() {  // at the start, and again when the API key changes
  showError("");
  try {
    const response = await fetch("/v1/models", {headers: headers()});
    if (!response.ok) throw await failure(response);
    const card = (await response.json()).data[0];
    // Max tokens' default cannot fit beside any prompt in a context of that many tokens or
    // fewer: there it is left empty, which the server reads as "up to the context".
    const maxTokens = $("max-tokens");
    if (maxTokens.value === maxTokens.defaultValue
        && card.max_model_len <= Number(maxTokens.defaultValue)) maxTokens.value = "";
    model = card.id;
    $("model").textContent = model;
  } catch (e) {
    showError(`/v1/models: ${e.message}`);
  }
}

// The reply comes as server-sent events, "data: {json}" and a blank line each, in network
// chunks that may end anywhere, even inside a UTF-8 character: the streaming TextDecoder keeps
// characters whole, and the text after the last blank line waits for the next chunk.
async function* events(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    const parts = buffer.split(/\r?\n\r?\n/);
    buffer = parts.pop();  // the event not finished yet
    for (const part of parts) {
      const data = part.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

async function send() {
  const text = $("message").value;
  if (!text.trim() || controller) return;
  controller = new AbortController();
  busy(true);
  showError("");
  $("message").value = "";
  const user = bubble("user", text);
  const reply = bubble("assistant", "");
  const system = $("system").value.trim();
  const body = {stream: true, messages: [...(system ? [{role: "system", content: system}] : []),
                                         ...conversation, {role: "user", content: text}]};
  if (model) body.model = model;
  const temperature = $("temperature").value, maxTokens = $("max-tokens").value;
  if (temperature !== "") body.temperature = Number(temperature);
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal});
    if (!response.ok) throw await failure(response);
    for await (const data of events(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(`the reply ended in an error: ${chunk.error.message}`);
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        reply.textContent += delta;
        reply.scrollIntoView({block: "end"});
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") showError(e.message);  // Stop is not an error
  } finally {
    controller = null;
    busy(false);
  }
  // What arrived (also before Stop, or before an error mid-reply) is the assistant's turn; a
  // request that brought nothing is taken back, its text put back in the box to send again.
  if (reply.textContent) {
    conversation.push({role: "user", content: text},
                      {role: "assistant", content: reply.textContent});
  } else {
    user.remove();
    reply.remove();
    $("message").value = text;
  }
}

$("message").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {  // not while an IME composes a word
    e.preventDefault();
    send();
  }
});
$("send").addEventListener("click", send);
$("stop").addEventListener("click", () => controller?.abort());
$("new").addEventListener("click", () => {
  conversation.length = 0;
  $("log").replaceChildren();
  showError("");
});
loadModel();
</script>
</body>
</html>
"""


class ChoiceText:
    """One choice of a request: its tokens become text (a Detokenizer, with the request's stop
    strings) and logprob entries; it counts them (usage) and knows how it ended."""

    def __init__(self, index, tokenizer, stop, logprobs):
        self.index = index
        self.detokenizer = Detokenizer(tokenizer.token_bytes, tokenizer.special_ids, stop)
        self.with_logprobs = logprobs is not None
        self.pieces, self.entries = [], []  # its text so far; (token id, {id: logprob}) a token
        self.num_tokens = 0  # generated, the eos that ended it included (usage)
        self.finish_reason = None
        self.offset = 0  # completions' text_offset: characters of the tokens' texts so far

    def add_tokens(self, tokens, logprobs, finish_reason, stop_token_id):
        """New tokens (one or more steps'); returns their text and logprob entries. The eos or stop
        id that ended the request counts as a token, and writes neither text nor a logprob."""
        pieces, entries = [], []
        if not self.detokenizer.stop:  # every token counts, and their text comes at once
            self.num_tokens += len(tokens)
            texts = tokens[:-1] if tokens and tokens[-1] == stop_token_id else tokens
            pieces.append(self.detokenizer.decode_next_many(texts))
            if self.with_logprobs:
                entries = list(zip(texts, logprobs))
        for i, token in enumerate(tokens if self.detokenizer.stop else ()):
            self.num_tokens += 1
            if token == stop_token_id and i == len(tokens) - 1:
                break
            pieces.append(self.detokenizer.decode_next(token))
            if self.with_logprobs:
                entries.append((token, logprobs[i]))
            if self.detokenizer.stopped:  # the tokens after it were never part of the answer
                break
        if self.detokenizer.stopped:
            self.finish_reason = "stop"
        elif finish_reason is not None:
            pieces.append(self.detokenizer.flush())
            self.finish_reason = finish_reason
        text = "".join(pieces)
        self.pieces.append(text)
        self.entries += entries
        return text, entries


class Answer:
    """OpenAI's objects for the choices of a Generation: the response, or a stream's chunks."""

    def __init__(self, request, model_name, token_bytes):
        self.request, self.model, self.token_bytes = request, model_name, token_bytes
        self.id = ("chatcmpl-" if request.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.chunk_object = "chat.completion.chunk" if request.chat else "text_completion"

    def _object(self, kind, choices, **extra):
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def response(self, choices):
        """The whole answer, without a stream."""
        items = []
        for c in choices:
            text = "".join(c.pieces)
            content = {"message": {"role": "assistant", "content": text}} if self.request.chat \
                else {"text": text}
            items.append({"index": c.index, **content, "logprobs": self.logprobs(c, c.entries),
                          "finish_reason": c.finish_reason})
        kind = "chat.completion" if self.request.chat else "text_completion"
        return self._object(kind, items, usage=self.usage(choices))

    def role_chunk(self, choice):
        """A chat stream's first chunk of a choice."""
        return self._object(self.chunk_object, [{
            "index": choice.index, "delta": {"role": "assistant", "content": ""},
            "logprobs": None, "finish_reason": None}])

    def chunk(self, choice, text, entries):
        """A stream's chunk of one choice: its new text and logprobs (finish_reason on its last)."""
        item = {"index": choice.index}
        if self.request.chat:
            item["delta"] = {"content": text} if text or choice.finish_reason is None else {}
        else:
            item["text"] = text
        item.update(logprobs=self.logprobs(choice, entries), finish_reason=choice.finish_reason)
        return self._object(self.chunk_object, [item])

    def usage_chunk(self, choices):
        """include_usage: the stream's last chunk, the only one with a usage."""
        return self._object(self.chunk_object, [], usage=self.usage(choices))

    def usage(self, choices):
        prompt = sum(map(len, self.request.prompts))  # a prompt counts once, whatever its n
        completion = sum(c.num_tokens for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def logprobs(self, choice, entries):
        """OpenAI's logprobs of these entries, or None when not asked for: chat's a list of token
        objects, completions' parallel lists, whose top_logprobs are keyed by text (the legacy
        format), so that two ids of one text are one entry."""
        k = self.request.logprobs
        if k is None:
            return None
        if self.request.chat:
            return {"content": [{**self._token(t, lps[t]), "top_logprobs": [
                self._token(i, lp) for i, lp in _likeliest(lps)[:k]]} for t, lps in entries]}
        tokens, offsets = [token_text(self.token_bytes, t) for t, _ in entries], []
        for text in tokens:
            offsets.append(choice.offset)
            choice.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lps[t] for t, lps in entries],
                "top_logprobs": [{token_text(self.token_bytes, i): lp for i, lp in _likeliest(lps)}
                                 for _, lps in entries],
                "text_offset": offsets}

    def _token(self, token_id, logprob):
        return {"token": token_text(self.token_bytes, token_id), "logprob": logprob,
                "bytes": list(_token_data(self.token_bytes, token_id))}


def _likeliest(logprobs):
    """The engine's {id: logprob} of a token (the sampled id and the top ones), likeliest first."""
    return sorted(logprobs.items(), key=lambda item: -item[1])


def _json_bytes(value):
    """JSON in UTF-8. A lone surrogate a client sent, which an error message repeats, has no
    UTF-8: backslashreplace writes it as the escape \\ud800, which is the JSON for it."""
    return json.dumps(value, ensure_ascii=False).encode(errors="backslashreplace")


def sse_bytes(events, done, chunked):
    """Server-sent events, one `data:` line each; done: then `data: [DONE]` (and, chunked, the
    last chunk). chunked: the bytes as one chunk of HTTP/1.1's chunked transfer encoding."""
    data = b"".join(b"data: " + _json_bytes(event) + b"\n\n" for event in events) + (
        b"data: [DONE]\n\n" if done else b"")
    if chunked:
        data = (b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + (
            b"0\r\n\r\n" if done else b"")
    return data


class Delivery:
    """A generation request from the moment it is sent to the engine, as the link's thread
    serves it: a refusal raises its APIError, an acceptance queues a stream's `head`; then the
    replies go through the choices' ChoiceText and, for a stream, out at most every `interval`
    seconds. Its HTTP thread waits (done), then sends what is left: a non-streamed answer, an
    error, or the stream's last bytes. (The link starts the stream, so a link that ends ends
    every stream that began.) The socket is non-blocking meanwhile, so that no client holds the
    link: unread bytes wait in `pending`, and a client that reads nothing for `timeout` seconds,
    or falls MAX_PENDING_BYTES behind, is dropped like one that hung up (`gone`)."""

    def __init__(self, job, answer, choices, head, sock, chunked, interval, timeout):
        self.job, self.answer, self.choices, self.head = job, answer, choices, head
        self.accepted = False  # the engine took the request
        self.started = False  # a stream's head is queued (an error is then a last event)
        self.sock, self.chunked = sock, chunked
        self.stream, self.interval, self.timeout = answer.request.stream, interval, timeout
        self.news = {}  # a stream's choice index -> ([text], [logprob entries]) not sent yet
        self.pending = bytearray()  # a stream's bytes that the socket has not taken yet
        self.ended = False  # its last events are written (to pending, at least)
        self.next_write = self.progress = 0.0  # (time.monotonic) the socket last took bytes
        self.error = None  # the APIError that ended it
        self.gone = False  # its client hung up, or stopped reading
        self.done = threading.Event()
        # (a client is looked for only POLL_SECONDS in: one that half-closed gets a fast answer)
        self.since = time.monotonic()

    @property
    def complete(self):
        return all(choice.finish_reason is not None for choice in self.choices)

    def due(self, now):
        """Whether its replies should be taken now: for a stream, when a write is due, bytes wait,
        or its end is queued (a stop string is then found up to `interval` late)."""
        return not self.stream or now >= self.next_write or bool(self.pending) or self.job.ending

    def take_replies(self, stop):
        """The replies come so far, as text, a choice's replies of several steps as one;
        stop(index): a stop string ended that choice. A failure raises its APIError."""
        replies, queued = [], self.job.replies
        while not queued.empty():
            replies.append(queued.get())
        merged = {}  # choice index -> [tokens, logprobs or None, finish_reason, stop_token_id]
        for reply in replies:
            if reply[0] == "failed":
                raise APIError(reply[2], reply[1])
            if reply[0] == "refused":  # (the engine's ValueError: a 400 before any byte went)
                raise APIError(reply[1])
            if reply[0] == "accepted":
                self.accepted = True
                continue
            _, index, tokens, logprobs, finish_reason, stop_token_id = reply
            if index not in merged:
                merged[index] = [list(tokens), None if logprobs is None else list(logprobs),
                                 finish_reason, stop_token_id]
            else:
                entry = merged[index]
                entry[0] += tokens
                if logprobs is not None:
                    entry[1] += logprobs
                entry[2:] = finish_reason, stop_token_id
        for index, (tokens, logprobs, finish_reason, stop_token_id) in merged.items():
            choice = self.choices[index]
            if choice.finish_reason is not None:  # a stop string ended it already
                continue
            text, entries = choice.add_tokens(tokens, logprobs, finish_reason, stop_token_id)
            if choice.finish_reason is not None and finish_reason is None:
                stop(index)
            if self.stream and (text or entries or choice.finish_reason):
                pieces, all_entries = self.news.setdefault(index, ([], []))
                pieces.append(text)
                all_entries += entries

    def write_stream(self, now):
        """A stream's head once accepted, its chunks when due, its end once finished; then what
        the socket takes of `pending` without waiting. ClientGone or OSError: drop the client."""
        if self.accepted and not self.started:
            self._queue(self.head, now)
            self.started = True
        finished = self.complete and not self.ended
        if finished or (self.news and now >= self.next_write and not self.ended):
            events = [self.answer.chunk(self.choices[i], "".join(pieces), entries)
                      for i, (pieces, entries) in self.news.items()]
            if finished and self.answer.request.include_usage:
                events.append(self.answer.usage_chunk(self.choices))
            self._queue(sse_bytes(events, finished, self.chunked), now)
            self.news, self.next_write, self.ended = {}, now + self.interval, finished
        if self.pending:
            try:
                sent = self.sock.send(self.pending)
            except BlockingIOError:  # its buffer is full: the client has not read
                sent = 0
            del self.pending[:sent]
            if sent:
                self.progress = now
            elif now - self.progress > self.timeout or len(self.pending) > MAX_PENDING_BYTES:
                raise ClientGone()

    def _queue(self, data, now):
        if not self.pending:
            self.progress = now  # (the clock of a client that reads nothing)
        self.pending += data

    def client_gone(self, now):
        """Whether the client has closed its end: a peek at the (non-blocking) socket."""
        if now - self.since < POLL_SECONDS:
            return False
        try:
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:  # nothing to read: still there
            return False
        except OSError:
            return True


def _refuse_constant(name):
    raise ValueError(f"{name} is not JSON")


class ClientGone(Exception):
    """The client closed its connection while its request ran."""


class HeadersTooLong(Exception):
    """The header lines together are over MAX_HEADER_BYTES (a 431)."""


class RequestCut(Exception):
    """The request line or headers ended before their line break (the deadline, or the client)."""


class _HeaderLimit:
    """The request's file while http.server reads the headers: past MAX_HEADER_BYTES in all it
    raises HeadersTooLong, at the end of the stream RequestCut (http.server would take the end
    for the end of the headers, and run a GET that never finished them)."""

    def __init__(self, rfile):
        self.rfile, self.left = rfile, MAX_HEADER_BYTES

    def readline(self, size=-1):
        line = self.rfile.readline(self.left + 1 if size < 0 else min(size, self.left + 1))
        self.left -= len(line)
        if self.left < 0:
            raise HeadersTooLong()
        if not line.endswith(b"\n"):  # (within the limit: the stream ended)
            raise RequestCut()
        return line


class Handler(BaseHTTPRequestHandler):
    """One connection's requests, one after another (HTTP/1.1 keep-alive); self.app is the
    HTTPSide. Every request goes through route(); any error is answered in OpenAI's envelope."""
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # not 0.9: a garbled request line gets a status line
    server_version = "08_serve"
    disable_nagle_algorithm = True  # a stream's small writes leave at once, not 40 ms later

    def setup(self):
        self.app = self.server.app
        self.timeout = self.app.timeout  # every read and write on the socket (socketserver's)
        self.linger = False
        super().setup()

    def finish(self):
        """A socket closed with unread bytes is reset, which can destroy an error response not yet
        read: first drop what the client sends, for a bounded while (a "lingering close")."""
        if self.linger:
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_WR)
                deadline, left = time.monotonic() + LINGER_SECONDS, LINGER_BYTES
                while left > 0 and time.monotonic() < deadline:
                    self.connection.settimeout(deadline - time.monotonic())
                    data = self.connection.recv(65536)
                    if not data:
                        break
                    left -= len(data)
        super().finish()

    def handle_one_request(self):
        """BaseHTTPRequestHandler's, with a shorter request line, a deadline for the whole
        request, and every method routed by route() (an unknown one is a 405 or 404, not 501)."""
        self.late = self.watchdog = None
        try:
            if self.rfile.peek(1):  # a request begins (or the client closed: b"")
                self.start_deadline()
            self.raw_requestline = self.rfile.readline(MAX_REQUEST_LINE + 1)
            if not self.raw_requestline:
                self.close_connection = True
            elif len(self.raw_requestline) > MAX_REQUEST_LINE:
                self.requestline = self.request_version = self.command = ""
                self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG,
                                f"the request line is over {MAX_REQUEST_LINE:,} bytes")
            elif not self.raw_requestline.endswith(b"\n"):  # (the headers would read as none)
                self.requestline = self.request_version = self.command = ""
                self.cut_short()
            elif self.parse_request():
                if self.command != "POST":  # (no body to wait for)
                    self.stop_deadline()
                self.route()
        except OSError:  # the client went away, or stalled past the timeout
            self.close_connection = True
        finally:
            self.stop_deadline()

    def start_deadline(self):
        """A client that trickles bytes never lets a read time out: the whole request gets
        `timeout` seconds too, then the socket's reading side is shut (writing still works)."""
        def expire():
            self.late = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RD)
        self.late = False
        self.watchdog = self.server.deadlines.call_after(self.timeout, expire)

    def stop_deadline(self):
        if self.watchdog is not None:
            self.server.deadlines.cancel(self.watchdog)
            self.watchdog = None
            if self.late:  # the request's bytes stopped coming: nothing more can be read
                self.close_connection = True

    def parse_request(self):
        rfile, self.rfile = self.rfile, _HeaderLimit(self.rfile)
        try:
            return super().parse_request()
        except HeadersTooLong:
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                            f"the headers are over {MAX_HEADER_BYTES:,} bytes")
        except RequestCut:
            self.cut_short()
        finally:
            self.rfile = rfile
        return False

    def cut_short(self):
        """Answer a request whose line or headers stopped short, which never runs: a 408 when its
        time ran out, a 400 when its client closed its side; the connection closes."""
        if self.late:
            self.send_error(HTTPStatus.REQUEST_TIMEOUT,
                            f"the request did not arrive within {self.timeout} s")
        else:
            self.send_error(HTTPStatus.BAD_REQUEST, "the client closed its side of the "
                            "connection before the request's headers ended")

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (a malformed request line or headers), in the envelope."""
        self.close_connection = self.linger = True
        text = message or self.responses.get(code, ("error",))[0]
        self.send_json(code, APIError(f"{text}: {explain}" if explain else text, code).body())

    def log_message(self, format, *args):
        LOG.info("%s %s", self.address_string(), format % args)

    def route(self):
        with self.server.connections_lock:
            self.server.requests_running += 1
        try:
            self._route()
        finally:
            with self.server.connections_lock:
                self.server.requests_running -= 1

    def _route(self):
        self.body_state, self.streaming = "unread", False  # "unread", "reading", "read"
        path = self.path.split("?", 1)[0]
        try:
            if path != "/health" and not self.app.ready.is_set():
                raise self.app.not_ready()
            methods = ROUTES.get(path)
            if methods is None and path.startswith("/v1/models/"):
                methods = ROUTES["/v1/models/{model}"]
            if methods is None:
                raise APIError(f"no route {path}", 404)
            if self.command not in methods:
                raise APIError(f"{self.command} is not allowed on {path}", 405,
                               headers=[("Allow", ", ".join(methods))])
            if path not in OPEN_ROUTES and not self.authorized():
                raise APIError("wrong or missing API key: send 'Authorization: Bearer KEY'", 401,
                               code="invalid_api_key")
            getattr(self, methods[self.command])()
        except APIError as e:
            self.fail(e)
        except (ClientGone, OSError):  # a failed read or write: the client left or stalled
            self.close_connection = True
        except Exception:
            LOG.exception("%s %s", self.command, path)
            self.fail(APIError("internal server error (the server logged it)", 500))

    def fail(self, error):
        """Answer an error: a response with its status or, once a stream began, a last event."""
        try:
            if self.streaming:
                self.write_events([error.body()], done=True)
                return
            if self.command == "POST" and self.body_state != "read":  # (still on the socket)
                self.close_connection = True
                self.linger = self.body_state == "unread"  # (not after a body that timed out)
            self.send_json(error.status, error.body(), error.headers)
        except OSError:
            self.close_connection = True

    def authorized(self):
        key, given = self.app.api_key, self.headers.get("Authorization", "")
        # compare_digest: the time taken does not tell how much of a guess was right
        return key is None or hmac.compare_digest(given.encode("latin-1"),
                                                  b"Bearer " + key.encode())

    def send_body(self, status, data, content_type, headers=()):
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_json(self, status, value, headers=()):
        self.send_body(status, _json_bytes(value), "application/json", headers)

    def read_json(self):
        """The body, a JSON object, within the limits: its size is known before it is read."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise APIError("send the body with a Content-Length, not chunked", 411)
        length = self.headers.get("Content-Length")
        if length is None:
            raise APIError("a POST needs a Content-Length header", 411)
        if not re.fullmatch(r"[0-9]{1,20}", length.strip()):
            raise APIError(f"Content-Length {_short(length)} is not a number of bytes")
        size, limit = int(length), self.app.max_body_bytes
        if size > limit:
            raise APIError(f"the body is {size:,} bytes, over the limit of {limit:,}", 413)
        self.body_state = "reading"
        try:
            data = self.rfile.read(size)
        except TimeoutError:
            raise APIError(f"the body did not arrive within {self.timeout} s", 408) from None
        self.stop_deadline()
        if self.late:
            self.body_state = "timed out"
            raise APIError(f"the request did not arrive within {self.timeout} s", 408)
        if len(data) < size:
            raise APIError(f"the body ended after {len(data):,} of its {size:,} bytes")
        self.body_state = "read"
        try:
            body = json.loads(data, parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as e:
            raise APIError(f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError("the body must be a JSON object")
        return body

    def check_model(self, body):
        model = field(body, "model", _is_str, "a string")
        if model is not None and model != self.app.model_name:
            raise self.model_not_found(model)

    def model_not_found(self, name):
        return APIError(f"the model '{name}' does not exist; this server serves "
                        f"'{self.app.model_name}'", 404, "model", "model_not_found")

    # -- the routes

    def page(self):
        self.send_body(200, CHAT_PAGE.encode(), "text/html; charset=utf-8")

    def health(self):
        if not self.app.ready.is_set():
            raise self.app.not_ready()
        self.send_json(200, {"status": "ok"})

    def metrics(self):
        self.send_body(200, self.app.metrics.render().encode(),
                       "text/plain; version=0.0.4; charset=utf-8")

    def models(self):
        self.send_json(200, {"object": "list", "data": [self.app.model_card()]})

    def model(self):
        """GET /v1/models/{model}: the served model's card. The name is percent-decoded: the
        openai client sends a Hub id's "/" as %2F, curl as is."""
        name = urllib.parse.unquote(self.path.split("?", 1)[0].removeprefix("/v1/models/"))
        if name != self.app.model_name:
            raise self.model_not_found(name)
        self.send_json(200, self.app.model_card())

    def tokenize(self):
        body = self.read_json()
        check_fields(body, {"model", "prompt", "messages"})
        self.check_model(body)
        tokenizer = self.app.tokenizer
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise APIError("give either 'prompt' or 'messages'")
        text = (chat_prompt(body, tokenizer) if body.get("prompt") is None
                else check_text(field(body, "prompt", _is_str, "a string"), "prompt"))
        ids = tokenizer.encode(text)
        self.send_json(200, {"tokens": ids, "count": len(ids),
                             "max_model_len": self.app.max_model_len})

    def detokenize(self):
        body = self.read_json()
        check_fields(body, {"model", "tokens"})
        self.check_model(body)
        vocab = self.app.vocab_size
        ids = field(body, "tokens", lambda x: isinstance(x, list) and all(
            _is_int(t) and 0 <= t < vocab for t in x), f"a list of token ids in [0, {vocab})")
        if ids is None:
            raise APIError("'tokens' is required", param="tokens")
        self.send_json(200, {"prompt": self.app.tokenizer.decode(ids)})

    def completions(self):
        self.serve_generation(chat=False)

    def chat_completions(self):
        self.serve_generation(chat=True)

    def serve_generation(self, chat):
        body = self.read_json()
        self.check_model(body)
        tokenizer, engine = self.app.tokenizer, self.app.engine
        request = generation_request(body, chat, tokenizer, self.app.vocab_size)
        answer = Answer(request, self.app.model_name, tokenizer.token_bytes)
        job = Job(answer.id, request.prompts, request.params)
        choices = [ChoiceText(i, tokenizer, request.stop, request.logprobs)
                   for i in range(len(request.params))]
        head = b""  # a stream's first bytes, sent by the link's thread once the engine accepts
        if request.stream:
            head = self.stream_head()
            if chat:
                head += sse_bytes([answer.role_chunk(choice) for choice in choices], False,
                                  self.chunked)
        # from here the link's thread serves the request (see Delivery); this thread waits
        delivery = Delivery(job, answer, choices, head, self.connection,
                            request.stream and self.chunked, self.app.stream_interval,
                            self.timeout)
        self.connection.setblocking(False)
        try:
            engine.submit(job, delivery)
            # (rarely awake: many threads waking often take the interpreter lock from the link)
            while not delivery.done.wait(1.0):
                if not engine.thread.is_alive():  # (a job added as the link ended: its last)
                    delivery.error = APIError(engine.gone or "the link to the engine has "
                                              "failed (the server logged why)", 503)
                    break
        finally:
            self.connection.settimeout(self.timeout)
            if not delivery.complete:  # whatever ended it early: its choices end in the engine
                engine.end_job(job)
        if delivery.gone:
            raise ClientGone()
        if delivery.started:  # the status line is out (or pending): an error is an event now
            self.streaming = True
            self.log_request(200)
        self.wfile.write(delivery.pending)  # a stream's bytes the socket had not taken
        if delivery.error is not None:
            raise delivery.error
        if not request.stream:
            self.send_json(200, answer.response(choices))

    def stream_head(self):
        """A stream's status line and headers, as bytes (send_response would write them)."""
        self.chunked = self.request_version == "HTTP/1.1"
        lines = [f"{self.protocol_version} 200 OK", f"Server: {self.version_string()}",
                 f"Date: {self.date_time_string()}",
                 "Content-Type: text/event-stream; charset=utf-8", "Cache-Control: no-cache"]
        if self.chunked:
            lines.append("Transfer-Encoding: chunked")
        else:  # HTTP/1.0 has no chunks: the end of the stream is the end of the connection
            self.close_connection = True
        return "".join(line + "\r\n" for line in lines + [""]).encode("latin-1")

    def write_events(self, events, done=False):
        """Server-sent events in one write (sse_bytes); done: `data: [DONE]` and the end."""
        self.wfile.write(sse_bytes(events, done, self.chunked))


class Deadlines:
    """One thread that runs each action when its time comes, unless cancelled first: every
    request's deadline (Handler.start_deadline). A threading.Timer a request would start a
    thread each, and a start waits for the new thread to take the interpreter lock."""

    def __init__(self):
        self.heap, self.added = [], 0  # [when (time.monotonic), order added, action or None]
        self.changed = threading.Condition()
        threading.Thread(target=self.watch, name="deadlines", daemon=True).start()

    def call_after(self, seconds, action):
        with self.changed:
            self.added += 1
            entry = [time.monotonic() + seconds, self.added, action]
            heapq.heappush(self.heap, entry)
            if self.heap[0] is entry:  # (sooner than what the thread waits for)
                self.changed.notify()
        return entry

    def cancel(self, entry):
        """The action does not run after this (it may have run already)."""
        with self.changed:
            entry[2] = None

    def watch(self):
        with self.changed:
            while True:
                now = time.monotonic()
                while self.heap and self.heap[0][0] <= now:
                    action = heapq.heappop(self.heap)[2]
                    if action is not None:
                        try:
                            action()
                        except Exception:
                            LOG.exception("a deadline's action failed")
                self.changed.wait(self.heap[0][0] - now if self.heap else None)


class _HTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a thread a connection, up to max_connections (a 503 beyond). No
    accept loop hands connections to threads, whose wake-ups would wait for the interpreter lock:
    the idle threads all wait in accept(), and the one the kernel gives a connection serves it. A
    thread starts when the last idle one takes a connection, so that one always waits."""
    request_queue_size = 128  # the listen backlog: a burst of clients may connect at once

    def __init__(self, sock, handler, max_connections):
        """sock: the listening socket, bound by the engine's process (Server)."""
        super().__init__(sock.getsockname(), handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        sock.setblocking(True)  # (the idle threads wait in accept())
        self.max_connections, self.connections = max_connections, 0
        self.requests_running = 0  # (the HTTP process waits for them when it stops)
        self.connections_lock = threading.Lock()
        self.threads = self.idle_threads = 0  # connection threads, and those in accept()
        self.stopping = False
        self.deadlines = Deadlines()

    def serve_forever(self, poll_interval=None):
        """Take connections on this thread, and more as needed, until shutdown() (no polling)."""
        with self.connections_lock:
            self.threads += 1
        self.connection_thread()

    def shutdown(self):
        """No connection is taken any more: accept() fails in every waiting thread, which ends
        (on Linux; elsewhere they wait on as daemon threads, and end with the process)."""
        self.stopping = True
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)

    def connection_thread(self):
        """Take a connection, serve it (or refuse it), and again, until shutdown()."""
        while True:
            with self.connections_lock:
                self.idle_threads += 1
            try:
                request, client_address = self.socket.accept()
            except OSError:
                with self.connections_lock:
                    self.idle_threads -= 1
                if self.stopping:
                    with self.connections_lock:
                        self.threads -= 1
                    return
                LOG.exception("accept() failed")  # (out of file descriptors, say)
                time.sleep(0.1)
                continue
            with self.connections_lock:
                self.idle_threads -= 1
                full = self.connections >= self.max_connections
                self.connections += not full
                grow = self.idle_threads == 0 and self.threads <= self.max_connections
                self.threads += grow
            if grow:  # (a daemon thread: a client that stays connected keeps no exit waiting)
                try:
                    threading.Thread(target=self.connection_thread, name="connection",
                                     daemon=True).start()
                except RuntimeError:  # ("can't start new thread": this one serves on)
                    with self.connections_lock:
                        self.threads -= 1
                    LOG.exception("no connection thread could start")
            if full:
                self.refuse(request)
                continue
            try:
                self.process_request_thread(request, client_address)  # (handles it, closes it)
            finally:
                with self.connections_lock:
                    self.connections -= 1

    def refuse(self, request):
        """A 503 at once, and the connection closed: max_connections are open."""
        body = _json_bytes(APIError(f"the server has {self.max_connections} connections open, "
                                    f"its limit: retry later", 503).body())
        response = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n%s"
                    % (len(body), body))
        with contextlib.suppress(OSError):
            request.setblocking(False)  # (the thread that takes connections must not wait on one)
            request.send(response)
        self.shutdown_request(request)


class HTTPSide:
    """What the HTTP threads share (Handler's self.app): settings, metrics, link, tokenizer."""

    def __init__(self, api_key, model_name, max_body_bytes, timeout, stream_interval, created):
        self.api_key, self.model_name, self.created = api_key, model_name, created
        self.max_body_bytes, self.timeout = max_body_bytes, timeout
        self.stream_interval = stream_interval
        self.metrics = Metrics()
        self.ready = threading.Event()
        self.load_error, self.engine = None, None
        self.tokenizer = self.max_model_len = self.vocab_size = None

    def not_ready(self):
        if self.load_error is not None:
            return APIError(f"the model failed to load: {self.load_error}", 503)
        return APIError("the model is loading", 503)

    def model_card(self):
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "08_serve", "max_model_len": self.max_model_len}


def http_process(listen_fd, pipe_fd):
    """The HTTP process (08_serve.py --http-process LISTEN_FD PIPE_FD, started by Server): the
    HTTP server on the socket that Server bound, the link on the pipe, until the engine stops."""
    conn = multiprocessing.connection.Connection(pipe_fd)
    settings = conn.recv()
    # the tokenizer comes pickled under the engine's name for this file's module
    sys.modules.setdefault(settings.pop("module"), sys.modules[__name__])
    if settings.pop("log_level") is not None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    max_connections = settings.pop("max_connections")
    app = HTTPSide(**settings)
    app.engine = EngineLink(conn, app)
    httpd = _HTTPServer(socket.socket(fileno=listen_fd), Handler, max_connections)
    httpd.app = app
    app.engine.thread.start()
    threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()
    app.engine.thread.join()
    httpd.shutdown()  # no connection is accepted any more
    httpd.server_close()
    deadline = time.monotonic() + app.timeout  # the requests still answering write their ends
    while httpd.requests_running and time.monotonic() < deadline:
        time.sleep(0.01)


class Server:
    """A running server (see serve): url, port, model_name, llm (None while loading), wait_ready,
    wait_idle, shutdown. The model stays in this process; the HTTP runs in http_process."""

    def __init__(self, llm, host, port, api_key, served_model_name, max_body_bytes, timeout,
                 stream_interval=STREAM_INTERVAL, max_connections=MAX_CONNECTIONS):
        if isinstance(llm, LLM):
            if llm.tokenizer is None:
                raise ValueError("serve needs an LLM with a tokenizer: the API is text in, "
                                 "text out")
        elif not callable(llm):
            raise TypeError(f"llm must be an LLM or a function that returns one, not "
                            f"{type(llm).__name__}")
        if api_key is not None and not (isinstance(api_key, str) and api_key):
            raise ValueError(f"api_key = {api_key!r} must be a non-empty string or None")
        if not _is_int(max_body_bytes) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes = {max_body_bytes!r} must be a positive int")
        if not _is_number(timeout) or timeout <= 0:
            raise ValueError(f"timeout = {timeout!r} must be a positive number of seconds")
        if not _is_int(max_connections) or max_connections < 1:
            raise ValueError(f"max_connections = {max_connections!r} must be a positive int")
        if not _is_number(stream_interval) or stream_interval < 0:
            raise ValueError(f"stream_interval = {stream_interval!r} must be a number of seconds "
                             f">= 0")
        self.api_key, self.max_body_bytes, self.timeout = api_key, max_body_bytes, timeout
        self.stream_interval = stream_interval
        self.model_name = served_model_name or "qwen3"
        self.llm = self.engine = self.load_error = None
        self.ready, self.loaded = threading.Event(), threading.Event()
        self.stopped, self.lock, self.send_lock = False, threading.Lock(), threading.Lock()
        listener = socket.create_server((host, port), backlog=_HTTPServer.request_queue_size)
        self.port = listener.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        ours, theirs = socket.socketpair()
        with listener, theirs:  # (the child has its own copies of both)
            self.process = subprocess.Popen(
                [sys.executable, SERVE_FILE, "--http-process", str(listener.fileno()),
                 str(theirs.fileno())], pass_fds=(listener.fileno(), theirs.fileno()),
                start_new_session=True)  # (a Ctrl-C reaches this process only: it stops both)
        self.conn = multiprocessing.connection.Connection(ours.detach())
        self._send_to_http(dict(
            module=__name__, api_key=api_key, model_name=self.model_name,
            max_body_bytes=max_body_bytes, timeout=timeout, stream_interval=stream_interval,
            max_connections=max_connections, created=int(time.time()),
            log_level=LOG.getEffectiveLevel() if logging.getLogger().handlers else None))
        if isinstance(llm, LLM):
            try:
                self._start(llm)
                while not self.ready.wait(0.1):  # the HTTP process has the tokenizer
                    if self.process.poll() is not None:
                        raise RuntimeError(f"the HTTP process exited with status "
                                           f"{self.process.returncode} before it was ready")
            except BaseException:
                self.shutdown()
                raise
        else:
            threading.Thread(target=self._load, args=(llm,), name="load", daemon=True).start()

    def _send_to_http(self, message):
        with self.send_lock:  # (the engine thread sends too)
            self.conn.send(message)

    def _load(self, load):
        try:
            llm = load()
            if not isinstance(llm, LLM) or llm.tokenizer is None:
                raise TypeError(f"the model loader returned {llm!r}, not an LLM with a tokenizer")
            self._start(llm)
        except Exception as e:
            if isinstance(e, DataError):  # a known failure: its message says what to do
                LOG.error("the model failed to load: %s", e)
            else:
                LOG.exception("the model failed to load")
            self.load_error = e
            with contextlib.suppress(OSError):
                self._send_to_http(("load failed", str(e)))
            self.loaded.set()

    def _start(self, llm):  # (LLM() has compiled, tuned and captured what a step needs)
        with self.lock:
            if self.stopped:
                return
            self.llm = llm
            self.engine = EngineThread(llm, self.conn, self._send_to_http, self._on_http_ready)
            self._send_to_http(("ready", llm.tokenizer, llm.max_model_len,
                                llm.model.cfg.vocab_size))

    def _on_http_ready(self):  # (the HTTP process has the tokenizer: every route is served)
        self.ready.set()
        self.loaded.set()

    def wait_ready(self, timeout=None):
        """Wait until the model is loaded (or failed to load); whether the server is ready."""
        self.loaded.wait(timeout)
        return self.ready.is_set()

    def wait_idle(self, timeout=None):
        """Wait until no request is left on either side; False: timed out."""
        return self.engine is None or self.engine.wait_until_idle(timeout)

    def shutdown(self, timeout=10.0):
        """Stop accepting, abort every running request (open streams end with an error event),
        stop the engine thread and the HTTP process. Calling it again does nothing."""
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
        if self.engine is not None:
            self.engine.stop(timeout)  # (its last events fail the open requests)
        with contextlib.suppress(OSError):
            self._send_to_http(("stop",))
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            LOG.error("the HTTP process did not stop within %s s: killed", timeout)
            self.process.kill()
            self.process.wait()
        self.conn.close()


def serve(llm, host="127.0.0.1", port=0, *, api_key=None, served_model_name=None,
          max_body_bytes=1 << 20, timeout=30.0, stream_interval=STREAM_INTERVAL,
          max_connections=MAX_CONNECTIONS):
    """Serve the OpenAI API on an LLM (with a tokenizer) at http://host:port (port 0: a free one).
    llm may be a function that returns the LLM: it loads on a thread, every route answering 503
    meanwhile. api_key: required on every route but /, /health and /metrics ("Authorization:
    Bearer KEY"). served_model_name: the model's name in the API (default "qwen3").
    max_body_bytes: the largest body (413 beyond); timeout: seconds any read or write on a
    client's socket may take. stream_interval: a stream writes at most every so many seconds (0:
    every step). max_connections: open connections at most, a thread each (503 beyond). Returns
    the Server once its socket is bound."""
    return Server(llm, host, port, api_key, served_model_name, max_body_bytes, timeout,
                  stream_interval, max_connections)


# ----------------------------------------------------------------------------------------------
# Chapters 36 and 44. The benches: the server under concurrent streaming clients
# ----------------------------------------------------------------------------------------------
# Stage 07's bench harness, kept for the serving bench (gpu_only, Table; the random
# models in Qwen3's shapes); its benches stay in stage 07.

def gpu_only(name, device):
    """Whether a GPU bench can run; says why not when it cannot."""
    if device.type != "cuda":
        print(f"{name} bench: needs a CUDA GPU (a CPU shows correctness, not speed); skipped")
    return device.type == "cuda"


class Table:
    """A bench's table, a row printed as it comes. columns: (heading, width, format) each, e.g.
    ("tok/s", 8, ",.0f"); a value that is a string is printed as it is."""

    def __init__(self, title, columns):
        self.columns = columns
        print(f"\n{title}")
        print("  " + " ".join(f"{heading:>{width}}" for heading, width, _ in columns))

    def row(self, *values):
        cells = [f"{v:>{width}}" if isinstance(v, str) else f"{v:>{width}{fmt}}"
                 for v, (_, width, fmt) in zip(values, self.columns)]
        print("  " + " ".join(cells), flush=True)


BENCH_MODELS = {"Qwen3-0.6B": Qwen3Config(),
                "Qwen3-8B": Qwen3Config(hidden_size=4096, intermediate_size=12288,
                                        num_hidden_layers=36, num_attention_heads=32,
                                        tie_word_embeddings=False)}


def random_model(cfg, device, dtype, seed=0):
    """A Qwen3 of shape cfg with random weights (std 0.02, norms 1), built on the device."""
    with torch.device("meta"):
        model = Qwen3(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.use_kernels(device.type == "cuda").eval()


# NEW in stage 08. vLLM's `bench serve` in small: the server runs in this process on Qwen3-0.6B's
# shape (random bf16 weights), and c clients send it streaming /v1/completions over loopback HTTP.
# Per request: the time to first token (TTFT: sent -> first chunk with text) and the time per
# output token after it (TPOT); per concurrency: output tokens/s, and TTFT and TPOT at p50 and
# p99. LLM.generate on the same requests, and the engine alone under the same clients, show what
# the server costs. A wave of c requests arriving together waits for all their prefills, so TTFT
# is measured again at the highest concurrency with the arrivals spread (send_requests).
#
# The clients run in processes of their own (in the server's, they take the GIL from it for
# every chunk: at 64 streams the server fell to 22% of the engine's rate), and in several, as
# threads of one process wait for each other's lock, and a chunk is timed when its thread has it.

CLIENT_PROCESSES = 8


def percentile(values, q):
    """The q-th percentile (q in 0..100), interpolated linearly as numpy's and vLLM's bench do."""
    xs = sorted(values)
    if not xs or not 0 <= q <= 100:
        raise ValueError(f"percentile {q} of {len(xs)} values: needs values, and q in 0..100")
    position = (len(xs) - 1) * q / 100
    below = math.floor(position)
    above = min(below + 1, len(xs) - 1)
    return xs[below] + (xs[above] - xs[below]) * (position - below)


def sse_data(chunks):
    """The data of each server-sent event in a byte stream cut anywhere. Lines are cut at b"\\n"
    and decoded whole (no multi-byte UTF-8 character holds 0x0A); a blank line ends an event,
    whose "data:" lines join with "\\n"; other lines are skipped (the SSE format)."""
    buffer, data = b"", []
    for chunk in chunks:
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            line = line.removesuffix(b"\r")
            if not line:
                if data:
                    yield "\n".join(data)
                data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                data.append((value[1:] if value.startswith(b" ") else value).decode("utf-8"))


def stream_completion(port, body, timeout):
    """Send one streaming completion (body: JSON bytes) on a connection of its own. Returns
    (seconds to the first chunk with text, seconds from it to the end, output tokens)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        start = time.perf_counter()  # before connecting, as vLLM's client starts its clock
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        first = usage = None
        for data in sse_data(iter(lambda: response.read1(1 << 16), b"")):  # as the bytes come
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"the stream ended in an error: {chunk['error']}")
            if first is None and any(c.get("text") for c in chunk.get("choices") or ()):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
        else:
            raise RuntimeError("the stream ended without data: [DONE]")
        end = time.perf_counter()
    finally:
        conn.close()
    if first is None or usage is None:
        raise RuntimeError(f"the stream had {'no text' if first is None else 'no usage chunk'}")
    return first - start, end - first, usage["completion_tokens"]


def send_requests(port, bodies, concurrency, timeout, spread=0.0, clients=None):
    """(wall seconds, [stream_completion's result a request]) of `concurrency` client threads,
    client i sending bodies i, i + concurrency, ... one after another from i * spread /
    concurrency seconds in (spread 0: vLLM's --max-concurrency; one request's duration: a steady
    state). clients: the client numbers this call runs (default all; the others' are None)."""
    results = [None] * len(bodies)

    def client(i):
        time.sleep(i * spread / concurrency)
        for j in range(i, len(bodies), concurrency):
            results[j] = stream_completion(port, bodies[j], timeout)

    clients = range(concurrency) if clients is None else clients
    start = time.perf_counter()
    with ThreadPoolExecutor(len(clients)) as pool:
        list(pool.map(client, clients))  # (list: a client's exception raises here)
    return time.perf_counter() - start, results


def serve_requests(server, prompts, concurrency, output_len, temperature, timeout=120.0,
                   clients=None, processes=1, spread=0.0):
    """Each prompt as a streaming completion from send_requests' clients, here or, given an
    executor `clients`, spread over `processes` of its processes. Returns the wall seconds (the
    longest process's) and, per request, (TTFT, TPOT) in seconds."""
    bodies = [json.dumps({"model": server.model_name, "prompt": prompt, "max_tokens": output_len,
                          "ignore_eos": True, "temperature": temperature, "stream": True,
                          "stream_options": {"include_usage": True}}).encode()
              for prompt in prompts]
    args = (server.port, bodies, concurrency, timeout, spread)
    if clients is None:
        seconds, results = send_requests(*args)
    else:
        parts = [clients.submit(send_requests, *args, range(p, concurrency, processes))
                 for p in range(min(processes, concurrency))]
        seconds, results = 0.0, [None] * len(bodies)
        for part in parts:
            part_seconds, part_results = part.result()
            seconds = max(seconds, part_seconds)
            results = [r if r is not None else mine for r, mine in zip(results, part_results)]
    wrong = [n for _, _, n in results if n != output_len]
    if wrong:  # ignore_eos: every request runs to max_tokens, or the rates below mean nothing
        raise RuntimeError(f"{len(wrong)} requests reported {wrong[0]} output tokens, not "
                           f"{output_len}: is ignore_eos honoured?")
    return seconds, [(ttft, rest / (output_len - 1)) for ttft, rest, _ in results]


def offline_rate(llm, prompts, params, concurrency):
    """Output tokens/s of LLM.generate on the prompts in waves of `concurrency` (the server's
    workload without the HTTP), and the mean seconds until a wave has all its first tokens."""
    waves = [prompts[i:i + concurrency] for i in range(0, len(prompts), concurrency)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = sum(len(out.outputs[0].token_ids) for wave in waves
                 for out in llm.generate(wave, params))
    torch.cuda.synchronize()
    rate = tokens / (time.perf_counter() - start)
    llm.engine.block_manager.reset_prefix_cache()  # or the prefills below would be cache hits
    first = SamplingParams(max_tokens=1, temperature=params.temperature, ignore_eos=True)
    start = time.perf_counter()
    for wave in waves:
        llm.generate(wave, first)
    torch.cuda.synchronize()
    return rate, (time.perf_counter() - start) / len(waves)


def offline_ttft(llm, prompts, params, concurrency, spread=0.0):
    """The engine alone under send_requests' clients, a request that arrives during a step added
    before the next. Returns per prompt (arrival, first token, end) in seconds from the start:
    the server's TTFT without its HTTP and the engine thread's chores."""
    engine, start = llm.engine, time.perf_counter()
    # client -> (when its next prompt arrives, which one); a request's id is its prompt's index
    due = {c: (start + c * spread / concurrency, c) for c in range(min(concurrency, len(prompts)))}
    times = [None] * len(prompts)  # per prompt: [arrival, first token, end]
    while due or engine.has_unfinished():
        now = time.perf_counter()
        for client, (at, i) in list(due.items()):
            if at <= now:
                engine.add_request(i, prompts[i], params)
                times[i] = [at, None, None]
                del due[client]
        if not engine.has_unfinished():  # (clients yet to start)
            time.sleep(max(0.0, min(at for at, _ in due.values()) - time.perf_counter()))
            continue
        for seq in engine.step_sequences():
            now, i = time.perf_counter(), seq.request_id
            if times[i][1] is None:
                times[i][1] = now
            if seq.is_finished:
                times[i][2] = now
                if i + concurrency < len(prompts):  # the client's next prompt, at once
                    due[i % concurrency] = (now, i + concurrency)
    return [(a - start, f - start, e - start) for a, f, e in times]


def bench_tokenizer(vocab_size, eos_token_ids=(151643, 151645)):
    """A Tokenizer in which each of vocab_size ids writes a word the size of a real token: a
    space and i in base 26 with a..z (" a", ..., " ba", ...). With a real tokenizer some of a
    random model's ids would write nothing, and a chunk carry no text. encode is byte by byte
    (no merges): the bench sends token ids."""
    def word(i):
        digits = ""
        while True:
            i, d = divmod(i, 26)
            digits = chr(ord("a") + d) + digits
            if i == 0:
                return (" " + digits).encode()

    bpe = tiktoken.Encoding(name="bench", pat_str=r"\S+|\s+", special_tokens={},
                            mergeable_ranks={bytes([b]): b for b in range(256)})
    return Tokenizer(bpe, [word(i) for i in range(vocab_size)], {}, _as_is, eos_token_ids, None)


def latencies(timings):
    """p50 and p99 of TTFT and TPOT in ms, from serve_requests' (TTFT, TPOT) seconds."""
    ttft, tpot = [1e3 * t for t, _ in timings], [1e3 * t for _, t in timings]
    return dict(ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
                tpot_p50_ms=percentile(tpot, 50), tpot_p99_ms=percentile(tpot, 99))


def bench_serve(device, concurrency=(1, 16, 64), prompt_len=512, output_len=256,
                temperature=0.6, stream_interval=STREAM_INTERVAL, prefill_first=True):
    """The server over HTTP against the engine alone (see above) at each concurrency: prompts of
    prompt_len random ids, output_len tokens each (ignore_eos), temperature 0.6 (Qwen3's
    recommended sampling). Checks two targets: p99 TTFT at the highest concurrency, arrivals
    spread, within twice the lowest's; output tokens/s at the highest at least 0.8 of the
    engine's alone. Returns the figures, or None without a GPU."""
    if not gpu_only("serving", device):
        return None
    if output_len < 2:
        raise ValueError(f"output_len = {output_len}: TPOT needs at least 2 output tokens")
    # a fresh server first, in a process of its own, so that nothing here has tuned a kernel yet
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        first = fresh.submit(first_bursts, device, prompt_len, output_len,
                             (min(16, max(concurrency)), max(concurrency)), temperature).result()
    cfg = BENCH_MODELS["Qwen3-0.6B"]
    llm = LLM(random_model(cfg, device, torch.bfloat16), tokenizer=bench_tokenizer(cfg.vocab_size),
              max_model_len=prompt_len + output_len, prefill_first=prefill_first)
    params = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True)
    # Two waves of c requests at least (so that some arrive while others decode), 32 at least
    # (for c = 1's percentiles); a seed for each level, so that no prefix-cache block is shared.
    prompts = {c: random_prompts(cfg.vocab_size, [prompt_len] * max(2 * c, 32), seed=c)
               for c in concurrency}
    top, low = max(concurrency), min(concurrency)
    warm_up = random_prompts(cfg.vocab_size, [prompt_len] * top, seed=0)
    # Warm-up (LLM() has compiled and captured every step's kernels and graphs): top prompts
    # with outputs of 1..top tokens, decode batches of every size on real lengths.
    llm.generate(warm_up, [SamplingParams(max_tokens=1 + i, temperature=temperature,
                                          ignore_eos=True) for i in range(top)])
    # The engine alone first: once serve() has it, only the server's engine thread may call it.
    offline = {c: offline_rate(llm, prompts[c], params, c) for c in concurrency}
    # Its TTFT under the clients of the server's rows below (lowest concurrency, and highest
    # with arrivals spread): what the server adds is its HTTP, and the pipe between its processes.
    steady = random_prompts(cfg.vocab_size, [prompt_len] * (8 * top), seed=1 << 20)
    alone = {}
    for c, some, spread in ((low, prompts[low], 0.0),
                            (top, steady, top * output_len / offline[top][0])):
        llm.engine.block_manager.reset_prefix_cache()
        times = offline_ttft(llm, some, params, c, spread)[c if spread else 0:]
        alone[c] = [1e3 * (first - arrival) for arrival, first, _ in times]
    llm.engine.block_manager.reset_prefix_cache()  # the server must not find these prompts
    server = serve(llm, port=0, stream_interval=stream_interval)
    # spawn, not fork: a forked child of a process with CUDA and running threads may hang
    clients = ProcessPoolExecutor(CLIENT_PROCESSES, mp_context=multiprocessing.get_context("spawn"))
    processes = dict(clients=clients, processes=CLIENT_PROCESSES)
    results = {}
    try:
        if not server.wait_ready(timeout=60):
            raise RuntimeError("the server did not become ready in 60 s")
        # the HTTP path, and the client processes started (spawning each imports this file)
        serve_requests(server, warm_up, top, 16, temperature, **processes)
        table = Table(f"serving bench: Qwen3-0.6B shape, bf16, random weights; streaming "
                      f"/v1/completions over loopback HTTP, prompt {prompt_len} and output "
                      f"{output_len} tokens (ignore_eos), temperature {temperature}; against "
                      f"LLM.generate on the same requests",
                      [("concurrency", 11, "d"), ("arrivals", 25, ""), ("requests", 8, "d"),
                       ("output tok/s", 12, ",.0f"), ("engine", 8, ",.0f"), ("ratio", 6, ".0%"),
                       ("TTFT p50", 9, ".1f"), ("p99 ms", 7, ".1f"), ("engine", 7, ".1f"),
                       ("TPOT p50", 9, ".2f"), ("p99 ms", 7, ".2f")])
        for c in concurrency:
            seconds, timings = serve_requests(server, prompts[c], c, output_len, temperature,
                                              **processes)
            rate, (engine_rate, engine_ttft) = len(timings) * output_len / seconds, offline[c]
            results[c] = r = dict(requests=len(timings), seconds=seconds, output_tok_s=rate,
                                  offline_tok_s=engine_rate, offline_ttft_ms=1e3 * engine_ttft,
                                  **latencies(timings))
            table.row(c, "at once", r["requests"], rate, engine_rate, rate / engine_rate,
                      r["ttft_p50_ms"], r["ttft_p99_ms"], r["offline_ttft_ms"], r["tpot_p50_ms"],
                      r["tpot_p99_ms"])

        def spread_row(label, some):
            """The top concurrency, arrivals spread over a request's duration (a steady state),
            each client's first request left out; eight a client, for a steadier p99."""
            duration = results[top]["seconds"] * top / results[top]["requests"]
            _, timings = serve_requests(server, some, top, output_len, temperature, **processes,
                                        spread=duration)
            r = dict(requests=7 * top, **latencies(timings[top:]))
            table.row(top, label, r["requests"], "", "", "", r["ttft_p50_ms"], r["ttft_p99_ms"],
                      "", r["tpot_p50_ms"], r["tpot_p99_ms"])
            return r

        results["steady"] = spread_row("spread", steady)
        if prefill_first:  # what it buys: the same once more, prompts packed beside the decodes
            server.wait_idle()
            llm.engine.scheduler.prefill_first = False  # (read by the engine thread each step)
            results["steady_mixed"] = spread_row("spread, prefill_first off", random_prompts(
                cfg.vocab_size, [prompt_len] * (8 * top), seed=1 << 21))
            llm.engine.scheduler.prefill_first = True
        results["engine_alone"] = r = dict(
            requests=len(alone[top]), ttft_p50_ms=percentile(alone[top], 50),
            ttft_p99_ms=percentile(alone[top], 99), low_ttft_p99_ms=percentile(alone[low], 99))
        table.row(top, "spread, the engine alone", r["requests"], "", "", "", r["ttft_p50_ms"],
                  r["ttft_p99_ms"])
    finally:
        clients.shutdown()
        server.shutdown()
    ttft_ratio = results["steady"]["ttft_p99_ms"] / results[low]["ttft_p99_ms"]
    engine_alone = results["engine_alone"]
    alone_ratio = engine_alone["ttft_p99_ms"] / engine_alone["low_ttft_p99_ms"]
    rate_ratio = results[top]["output_tok_s"] / results[top]["offline_tok_s"]
    targets = dict(ttft_p99_ratio=ttft_ratio, ttft_met=ttft_ratio <= 2,
                   engine_ttft_p99_ratio=alone_ratio,
                   throughput_ratio=rate_ratio, throughput_met=rate_ratio >= 0.8)
    print(f"  target: p99 TTFT at concurrency {top} (arrivals spread) within 2x of concurrency "
          f"{low}'s: {results['steady']['ttft_p99_ms']:.1f} ms vs "
          f"{results[low]['ttft_p99_ms']:.1f} ms, {ttft_ratio:.2f}x: "
          f"{'met' if targets['ttft_met'] else 'missed'} (the engine alone: "
          f"{engine_alone['ttft_p99_ms']:.1f} ms vs {engine_alone['low_ttft_p99_ms']:.1f} ms, "
          f"{alone_ratio:.2f}x)")
    print(f"  target: output tok/s at concurrency {top} at least 80% of the engine's alone: "
          f"{results[top]['output_tok_s']:,.0f} vs {results[top]['offline_tok_s']:,.0f}, "
          f"{rate_ratio:.0%}: {'met' if targets['throughput_met'] else 'missed'}")
    return dict(concurrency=results, targets=targets, first_bursts=first)


def first_bursts(device, prompt_len, output_len, concurrency, temperature):
    """A fresh process's first requests, as a user's server meets them (call it in a process of
    its own): the LLM built (its start-up timed, warm-up included), served, then at each
    concurrency two bursts of as many streams all at once, the second with new prompts. Prints
    a table and checks the target: the first burst's p99 TTFT and output tokens/s within 2x of
    the second's. Returns the figures."""
    cfg = BENCH_MODELS["Qwen3-0.6B"]
    model = random_model(cfg, device, torch.bfloat16)
    start = time.perf_counter()
    llm = LLM(model, tokenizer=bench_tokenizer(cfg.vocab_size),
              max_model_len=prompt_len + output_len, prefill_first=True)
    startup = time.perf_counter() - start
    server = serve(llm, port=0)
    clients = ProcessPoolExecutor(CLIENT_PROCESSES, mp_context=multiprocessing.get_context("spawn"))
    processes = dict(clients=clients, processes=CLIENT_PROCESSES)
    table = Table(f"a fresh server's first bursts: LLM() took {startup:.1f} s (warm-up "
                  f"{llm.warm_up_seconds:.1f} s); prompt {prompt_len}, output {output_len} "
                  f"tokens, all streams at once", [("concurrency", 11, "d"), ("burst", 6, "d"),
                  ("output tok/s", 12, ",.0f"), ("TTFT p50", 9, ".1f"), ("p99 ms", 7, ".1f")])
    results = dict(startup_seconds=startup, warm_up_seconds=llm.warm_up_seconds)
    try:
        if not server.wait_ready(timeout=60):
            raise RuntimeError("the server did not become ready in 60 s")
        list(clients.map(abs, range(4 * CLIENT_PROCESSES)))  # the clients' processes up
        for c in concurrency:
            results[c] = []
            for burst in (1, 2):
                prompts = random_prompts(cfg.vocab_size, [prompt_len] * c, seed=(c << 4) + burst)
                seconds, timings = serve_requests(server, prompts, c, output_len, temperature,
                                                  **processes)
                r = dict(output_tok_s=c * output_len / seconds, **latencies(timings))
                results[c].append(r)
                table.row(c, burst, r["output_tok_s"], r["ttft_p50_ms"], r["ttft_p99_ms"])
    finally:
        clients.shutdown()
        server.shutdown()
    worst = max(max(first["ttft_p99_ms"] / second["ttft_p99_ms"],
                    second["output_tok_s"] / first["output_tok_s"])
                for first, second in (results[c] for c in concurrency))
    results["worst_ratio"] = worst
    print(f"  target: each first burst's p99 TTFT and output tok/s within 2x of the second's: "
          f"at worst {worst:.2f}x: {'met' if worst <= 2 else 'missed'}", flush=True)
    return results


# ----------------------------------------------------------------------------------------------
# The demo and main
# ----------------------------------------------------------------------------------------------

def random_checkpoint(folder, seed):
    """Qwen3Config.tiny() with random weights, written in the Hugging Face layout: main's model
    when no --model is given. Embeddings of std 0.25 give logits of a few units, so that sampling
    has choices to make; norm weights other than 1 make a skipped norm show."""
    torch.manual_seed(seed)
    model = Qwen3(Qwen3Config.tiny())
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.25)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.8, 1.2)
    return save_qwen3(model, folder)


# main's tokenizer: GPT-2's first 8,192 tokens (the 256 bytes and 7,936 merges, a byte-level BPE
# in its own right, at a sixth of the full vocabulary's output layer), then <|endoftext|> and
# Qwen3's chat tokens. The chat template is a short form of Qwen3's: the stage writes the chat
# format itself and reads a template only to know that it is Qwen3's (load_tokenizer).
DEMO_RANKS = 8192
DEMO_ADDED_TOKENS = [(DEMO_RANKS + i, content, special) for i, (content, special) in enumerate(
    [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<think>", False),
     ("</think>", False)])]
DEMO_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is "
    "false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def demo_tokenizer(folder, data_dir=None):
    """Write main's random model's tokenizer into `folder` (see DEMO_RANKS): GPT-2's ranks from
    data/gpt2.tiktoken (downloaded on first use; Qwen3's own would be a far larger download) as a
    byte-level BPE, a chat template, and <|im_end|>, <|endoftext|> as eos ids. Returns folder."""
    folder = Path(folder)
    ranks = read_ranks(data_file("gpt2.tiktoken", data_dir))
    spec = byte_level_bpe_json({token: rank for token, rank in ranks.items() if rank < DEMO_RANKS},
                               DEMO_ADDED_TOKENS)
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    config = {"eos_token": "<|im_end|>", "chat_template": DEMO_CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    eos_ids = [DEMO_RANKS + 2, DEMO_RANKS]  # <|im_end|>, <|endoftext|>, as Qwen3's files name them
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return folder


def random_prompts(vocab_size, lengths, seed):
    """Prompts of random token ids, one of each length."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _device_of(model):
    return model.inv_freq.device


def positive_int(text):
    """argparse type: an integer >= 1 (0 is not a way to ask for the default)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


# NEW in stage 08: the command line serves a model (main's demonstrations stay in stage 07).

def port_number(text):
    """argparse type: a TCP port, 0 for a free one."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text}")
    return value


def non_negative_seconds(text):
    """argparse type: a number of seconds >= 0."""
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def parse_args(argv=None):
    # the docstring's first paragraph (its first line ends mid-sentence), which argparse rewraps
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", help="a Hugging Face Qwen3 directory, or a Hub id such as "
                        "Qwen/Qwen3-0.6B (default: a tiny random Qwen3, which the server sends a "
                        "few requests to before it stops)")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: "
                        "%(default)s, this machine only; 0.0.0.0 for every network)")
    parser.add_argument("--port", type=port_number,
                        help="default: 8000 with --model, a free port without")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route "
                        "but /, /health and /metrics (open, as vLLM's: a Prometheus scraper "
                        "sends no key)")
    parser.add_argument("--served-model-name", help="the model's name in the API (default: "
                        "--model as given, a Hub id or a path, as vLLM's)")
    parser.add_argument("--max-connections", type=positive_int, default=MAX_CONNECTIONS,
                        help="open connections at most, a thread each; a client beyond them gets "
                        "a 503 (default: %(default)s)")
    parser.add_argument("--stream-interval", type=non_negative_seconds, default=STREAM_INTERVAL,
                        help="a stream writes at most every so many seconds, a chunk with the "
                        "tokens since the last; 0: every engine step (default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="default: the checkpoint's on a GPU, float32 on a CPU")
    parser.add_argument("--max-model-len", type=positive_int,
                        help="the longest prompt + output (default: the model's)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=256,
                        help="requests in the running batch at most (default: %(default)s)")
    parser.add_argument("--speculative", choices=["ngram", "draft"],
                        help="speculative decoding across the batch: n-gram lookup in each "
                        "request's context, or a draft model (--draft-model)")
    parser.add_argument("--draft-model", help="with --speculative draft: a smaller Qwen3 with the "
                        "same vocabulary, a directory or a Hub id")
    parser.add_argument("--num-speculative-tokens", type=positive_int,
                        help="with --speculative: tokens proposed a step (default: 4)")
    parser.add_argument("--prefill-first", action=argparse.BooleanOptionalAction, default=True,
                        help="a step with prompt tokens to run runs only those, the decodes "
                        "waiting a step (at most %d in a row): a shorter time to first token "
                        "under load (default: on)" % MAX_DECODE_WAIT)
    parser.add_argument("--bench", action="store_true", help="instead, on a GPU: the server "
                        "under concurrent streaming clients (time to first token, time per "
                        "output token, tokens/s) against LLM.generate on the same requests")
    parser.add_argument("--data-dir", help="download cache for Hub ids and GPT-2's tokenizer, "
                        "the random model's (default: data/)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser, args):
    """Every flag checked before any work (a download, a load) starts."""
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        parser.error(f"--device {args.device}: {e}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: this stage runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA GPU")
    if args.data_dir is not None:
        check_data_dir(parser, args.data_dir)
    for flag, value in (("--host", args.host), ("--api-key", args.api_key),
                        ("--served-model-name", args.served_model_name)):
        if value is not None and not value.strip():
            parser.error(f"{flag} is empty")
    if args.bench and args.model is not None:
        parser.error("--model does not apply to --bench, which builds its own model")
    if (args.speculative == "draft") != (args.draft_model is not None):
        parser.error("--speculative draft and --draft-model go together")
    if args.num_speculative_tokens is not None:
        if args.speculative is None:
            parser.error("--num-speculative-tokens applies only with --speculative")
        if args.num_speculative_tokens > 16:
            parser.error(f"--num-speculative-tokens {args.num_speculative_tokens}: at most 16")
    for flag, model in (("--model", args.model), ("--draft-model", args.draft_model)):
        if model is None:
            continue
        path = Path(model)
        if path.exists() and not path.is_dir():
            parser.error(f"{flag} {model} is a file; give the directory that holds it")
        if not path.exists() and not HUB_ID.fullmatch(model):
            parser.error(f"{flag} {model}: no such directory, and not a Hub id such as "
                         f"Qwen/Qwen3-0.6B")


def check_data_dir(parser, data_dir):
    """--data-dir must be a directory, or one that can be made: made to see, then removed (a
    download makes it again, when it has something to put there)."""
    path = Path(data_dir)
    if path.exists() and not path.is_dir():
        parser.error(f"--data-dir {data_dir} is a file, not a directory")
    made = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--data-dir {data_dir}: cannot be made ({e.strerror or e})")
    for folder in made:
        folder.rmdir()


def load_llm(args, source):
    """The LLM the flags ask for, on the model `source`. Speculation (chapter 37) is stage 07's,
    switched on for the whole batch: the engine speculates for the requests where it pays."""
    speculative = None
    if args.speculative is not None:
        speculative = {"method": args.speculative}
        if args.draft_model is not None:
            speculative["model"] = args.draft_model
        if args.num_speculative_tokens is not None:
            speculative["num_tokens"] = args.num_speculative_tokens
    return LLM(source, device=args.device, dtype=MODEL_DTYPES.get(args.dtype),
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               speculative=speculative, prefill_first=args.prefill_first, data_dir=args.data_dir)


def serve_flags(args, llm, port, served_model_name):
    """serve(llm) as the flags ask. An address it cannot listen on (a port taken, a host that is
    not this machine's or no address at all) is a one-line error, not a traceback."""
    try:
        return serve(llm, args.host, port, api_key=args.api_key,
                     served_model_name=served_model_name, stream_interval=args.stream_interval,
                     max_connections=args.max_connections)
    except OSError as e:
        sys.exit(f"error: cannot listen on {args.host}:{port}: {e}")


def http_request(url, method, path, body=None, api_key=None, timeout=60.0):
    """(status, body bytes) of one request to the server at url, with http.client."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        connection.request(method, path, None if body is None else json.dumps(body), headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def sse_events(data):
    """The JSON events of a server-sent event stream's bytes, up to `data: [DONE]`."""
    events = []
    for block in data.decode().split("\n\n"):
        if block == "data: [DONE]":
            break
        if block.startswith("data: "):
            events.append(json.loads(block[len("data: "):]))
    return events


def demo(args):
    """Without --model: a tiny random Qwen3 served on a free port, a few requests to it over HTTP
    printed as they come back, then a clean stop. On a CPU the tiny model runs on one thread, as
    stage 07's demo does: a second gains it nothing, and on a busy machine makes it wait."""
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:  # the random model's files, read once and gone
        llm = load_llm(args, random_checkpoint(demo_tokenizer(tmp, args.data_dir), seed=0))
    server = serve_flags(args, llm, args.port or 0, args.served_model_name or "tiny-random-qwen3")
    print(f"serving a tiny random Qwen3 at {server.url}; over HTTP:")
    post = functools.partial(http_request, server.url, "POST", api_key=args.api_key)
    try:
        prompt = "Every effort moves you"
        status, data = post("/v1/completions", {"prompt": prompt, "max_tokens": 12,
                                                 "temperature": 0})
        out = json.loads(data)
        print(f"  POST /v1/completions {status}: {prompt!r} -> {out['choices'][0]['text']!r} "
              f"({out['choices'][0]['finish_reason']}, usage {out['usage']})")
        chat = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12,
                "temperature": 0}
        status, data = post("/v1/chat/completions",
                            {**chat, "stream": True, "stream_options": {"include_usage": True}})
        events = sse_events(data)
        streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        whole = json.loads(post("/v1/chat/completions", chat)[1])["choices"][0]["message"]
        print(f"  POST /v1/chat/completions, streamed {status}: {len(events)} events -> "
              f"{streamed!r} ({events[-2]['choices'][0]['finish_reason']}, usage "
              f"{events[-1]['usage']}); the same request unstreamed: "
              f"{'identical' if whole['content'] == streamed else 'DIFFERENT'}")
        status, data = post("/v1/completions", {"prompt": prompt, "max_tokens": 1000})
        error = json.loads(data)["error"]
        print(f"  POST /v1/completions with max_tokens 1000: {status} {error['type']}: "
              f"{error['message']}")
    finally:
        server.shutdown()
    print("stopped")


def main(argv=None):
    args = parse_args(argv)
    if args.bench:
        bench_serve(torch.device(args.device), stream_interval=args.stream_interval,
                    prefill_first=args.prefill_first)
        return
    if args.model is None:
        demo(args)
        return
    stop = threading.Event()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, lambda *_: stop.set())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    port = 8000 if args.port is None else args.port
    server = serve_flags(args, functools.partial(load_llm, args, args.model), port,
                         args.served_model_name or args.model)
    print(f"loading {args.model}; until it is ready, {server.url}/health answers 503", flush=True)
    while not server.wait_ready(timeout=0.2):  # (a signal stops the wait too)
        if server.load_error is not None or stop.is_set():
            break
    if server.load_error is not None:  # (logged: a DataError in words, a bug with its traceback)
        server.shutdown()
        sys.exit("error: the model failed to load (the log above says why)")
    if not stop.is_set():
        key = ' -H "Authorization: Bearer $API_KEY"' if args.api_key else ""
        request = json.dumps({"model": server.model_name,
                              "messages": [{"role": "user", "content": "Hello!"}]})
        print(f"serving {server.model_name} at {server.url}: the OpenAI API under /v1, and "
              f"/health, /metrics, a chat page at /. Try:\n  curl {server.url}/v1/chat/"
              f"completions -H 'Content-Type: application/json'{key} -d '{request}'\n"
              f"Ctrl-C stops it.", flush=True)
        stop.wait()
    print("stopping: no new connections; running requests aborted", flush=True)
    server.shutdown()


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
    # Triton 3.6's interpreter makes loop bounds ints with int() of 1-element arrays, which NumPy
    # >= 2.4 refuses (triton-lang/triton#9171, fixed after 3.6): convert through .item() instead.
    from triton.runtime import interpreter as _interpreter
    _patch_lang_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor_item(tensor, scope):
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    _interpreter._patch_lang_tensor = _patch_lang_tensor_item


# ----------------------------------------------------------------------------------------------
# Plumbing: downloads into data/, checked by sha256
# ----------------------------------------------------------------------------------------------

DATA_DIR = Path(__file__).resolve().parent / "data"

# name -> (url, sha256). data/README.md lists the same files with their sizes and licences.
DATA_FILES = {  # changed in 07: GPT-2's ranks only, the tokenizer of main's random model
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


if __name__ == "__main__":
    if sys.argv[1:2] == ["--http-process"]:  # a server's HTTP side (Server starts it)
        http_process(int(sys.argv[2]), int(sys.argv[3]))
        sys.exit()
    try:
        main()
    except DataError as e:  # a missing or broken file: the message says which and what to do
        sys.exit(f"error: {e}")
