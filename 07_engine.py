"""Stage 07: serving Qwen3 (book chapters 16-19, 24-26, 31-34). The model with its tokenizer and
chat format; a KV cache and a first engine; fast decode on fused kernels and CUDA graphs; then the
engine as vLLM builds it: continuous batching over a paged KV cache with prefix caching, a sampler
with structured output, speculative decoding, and async scheduling.

    python 07_engine.py              # a tiny random Qwen3: every part, checked, on a CPU
    python 07_engine.py --model Qwen/Qwen3-0.6B --prompt "Why is the sky blue?" --chat
    python 07_engine.py --bench      # on a GPU: kernels and engine against torch and transformers

New since stage 06: all of it. Changed: rms_norm, swiglu and flash_attention are forward only
(rms_norm on a kernel of its own, a row a program); generate is engine v1 over a KV cache;
filter_logits takes a top-k and top-p per row, and min-p; bench_attention times the decode
kernels; DATA_FILES holds GPT-2's ranks only (main's demo tokenizer). Dropped, and kept in stage
06: GPT-2, its data and training; every backward kernel; the LayerNorm, softmax, GELU, matmul and
cross-entropy kernels; naive and tiled attention; the 05/06 benches.

Read top to bottom, the way a request flows (ENGINE.md). Each line: chapter, section, and the
definitions to read first.
    17      Qwen3: configuration and weights             Qwen3Config, load_qwen3
    17      its tokenizer and chat format                load_tokenizer, Tokenizer
    17      the model on its kernels: RMSNorm, SwiGLU,   Attention, Qwen3, flash_attention,
            RoPE, attention (prefill, decode, paged)     decode_attention, paged_decode_attention
    16      the KV cache                                 KVCache
    18      engine v1: prefill, decode, sample           generate
    19, 33  fast decode: fused kernels, CUDA graphs      forward_packed, DecodeGraphs
    24      a request                                    Sequence
    25, 31  the paged cache and prefix caching           BlockManager
    24      continuous batching                          Scheduler.schedule
    19, 33  the model runner                             ModelRunner.launch
    34      sampling                                     SamplingParams, Sampler
    24, 33  the engine's step, plain and overlapped      LLMEngine.plain_step, overlapped_step
    24      the entry point and its knobs                LLM, EngineConfig
    26      speculative decoding                         rejection_sample, Speculator
    34      structured output                            compile_grammar, TokenMasker
    44      the benches                                  bench_engine, bench_throughput
            the demos and main                           main
"""

import argparse
import base64
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import numbers
import os
import random
import re
import statistics
import sys
import tempfile
import time
import unicodedata
import warnings
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
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
# Both size their grids from host bounds (max_len, max_q_len); ragged lengths stay on the device.
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
@triton.jit(do_not_specialize=["N", "max_keys"])
def _paged_prefill_kernel(Q, K, V, BLOCK_TABLES, CU_SEQLENS_Q, LENGTHS, OUT, qk_scale, N,
                          max_keys, stride_qn, stride_qh, stride_kb, stride_kh, stride_kt,
                          stride_vb, stride_vh, stride_vt, stride_on, stride_oh, stride_tb,
                          Q_BUCKET, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                          PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (tile of new tokens, sequence b, kv head): row r of the tile is token
    r // BLOCK_H with query head r % BLOCK_H of the kv head's group (past GROUP: padding).
    Q, OUT (N, Hq, D): sequence b's new tokens at rows CU_SEQLENS_Q[b] .. CU_SEQLENS_Q[b + 1] - 1.
    K, V: pools viewed as (num_blocks, Hkv, PAGE, D), read through BLOCK_TABLES (B, max_blocks)
    int32. LENGTHS (B,): keys of each sequence, new ones included (clamped to max_keys = max_blocks
    * PAGE): new token t sits at position LENGTHS[b] - q_len + t and sees keys up to it. Unit
    last strides. qk_scale = sm_scale * log2(e). Q_BUCKET: an autotune key only."""
    BLOCK_Q: tl.constexpr = BLOCK_M // BLOCK_H  # tokens a tile
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # later tokens see more keys: start first
    b = tl.program_id(1).to(tl.int64)
    kvh = tl.program_id(2).to(tl.int64)
    q_start = tl.load(CU_SEQLENS_Q + b).to(tl.int64)
    q_len = tl.minimum(tl.load(CU_SEQLENS_Q + b + 1).to(tl.int64), N) - q_start
    if tile * BLOCK_Q >= q_len:  # the grid is sized for the longest sequence
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
    max_q_len: a host bound on the q_len_b. -> (N, Hq, D); rows no sequence claims unwritten."""
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
    _paged_prefill_kernel[lambda meta: (triton.cdiv(max_q_len, meta["BLOCK_M"] // block_h), B,
                                        Hkv)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, lengths, out, scale * LOG2E, N,
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
#   (DecodeGraphs) and replayed with one call, the batch padded to its bucket and attention
#   bounded by the longest sequence allowed.
# - No gap between kernels: the stage's kernels launch while the one before them ends
#   (programmatic dependent launch, below).
# What is left is the host's work between steps, which async scheduling overlaps (LLMEngine).

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


def forward_packed(model, ids, positions, kv, meta, attention):
    """Logits (S, V) of the rows meta.sample_rows of a step's packed tokens: ids, positions (N,)
    on the device, the tokens of several sequences side by side (whole prompts, chunks of them,
    or one token a sequence when decoding), each attending to its own sequence's cache. kv:
    (k, v) of the paged cache, (L, blocks, block_size, Hkv, D) each; every token's key and value
    are written at its slot first. On the fused kernels when model.kernels (then
    fuse_projections(model) first), else on the torch twins; attention: a backend above."""
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


class DecodeGraphs:
    """forward_packed of a decode step (one token a sequence) captured in a CUDA graph per
    batch-size bucket, over one paged cache. The caller pads a bucket's rows past the batch
    (length 0, the scratch slot): they read nothing and write where no sequence reads. Block
    tables are padded to the width of the longest sequence allowed, max_len, which bounds
    attention: a graph's launches never depend on the batch's lengths. The graphs share one
    memory pool: they never run at the same time."""

    def __init__(self, model, kv, max_len, attention):
        self.model, self.kv, self.max_len, self.attention = model, kv, max_len, attention
        self.width = triton.cdiv(max_len, kv[0].shape[2])  # blocks of the longest sequence
        self.graphs = {}  # bucket -> cuda_graph's replay
        self.pool = torch.cuda.graph_pool_handle()

    @torch.inference_mode()  # the graphs' buffers are inference tensors (ModelRunner's mode)
    def __call__(self, ids, positions, meta):
        """Logits (bucket, V) of the step; every input has the bucket's rows."""
        bucket = ids.shape[0]
        tables = F.pad(meta.block_tables, (0, self.width - meta.block_tables.shape[1]))
        if bucket not in self.graphs:
            fixed = meta.cu_seqlens_q, meta.sample_rows  # a decode bucket's: always the same

            def step(ids, positions, slots, lengths, tables):
                meta = AttentionMetadata(slots, fixed[0], lengths, tables, 1, self.max_len,
                                         fixed[1])
                return forward_packed(self.model, ids, positions, self.kv, meta, self.attention)
            self.graphs[bucket] = cuda_graph(step, ids, positions, meta.slots, meta.lengths,
                                             tables, pool=self.pool)
        return self.graphs[bucket](ids, positions, meta.slots, meta.lengths, tables)


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

class Scheduler:
    """Which sequences run in the next step, and how many of their tokens. Running sequences
    first, oldest first (a decode takes one token of the budget, a prompt being prefilled its
    next chunk); then waiting ones, first come first served, while the step has budget and a
    sequence slot left, the last one admitted possibly with a chunk of its prompt only. The
    step's tokens never exceed the budget; a preempted sequence resumes with the output it had.
    config: the EngineConfig (its budgets, max_num_seqs and max_num_batched_tokens)."""

    def __init__(self, block_manager, config, eos_token_ids):
        self.block_manager, self.block_size = block_manager, block_manager.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
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
        ones, cut to what the budget leaves."""
        budget, batch, preempted = self.max_num_batched_tokens, [], False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.num_output_tokens >= seq.max_tokens:
                continue  # preempted in this loop, or its last token is on its way
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
    paged KV cache, allocated once; decode steps replay CUDA graphs on a GPU (unless
    enforce_eager), other steps run forward_packed eagerly. launch() only queues the work and
    starts copying the sampled tokens back: the StepHandle's wait() waits for them."""

    def __init__(self, model, num_blocks, block_size, max_model_len, enforce_eager=False):
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
        self.graphs = (DecodeGraphs(self.model, self.kv, self.max_len, self.attention)
                       if graphed else None)
        self.sampler = Sampler()

    @torch.inference_mode()
    def warm_up(self, max_num_seqs, max_num_batched_tokens):
        """Compile, autotune and capture now what a step can need, as vLLM does before it serves,
        so that the first requests run as fast as later ones. A Triton kernel is tuned on its
        first call at each key, so each runs here on made-up steps like a busy engine's, every
        token reading and writing the scratch block only (no sequence's keys change): for each
        tile size the prefill kernel is tuned for (_seq_bucket of the longest chunk), a step of
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
        sizes = {min(2 ** i, max_num_batched_tokens)
                 for i in range(7, max(7, max_num_batched_tokens.bit_length()) + 1)}
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
        graphed = len(ids) == len(entries) and self.graphs is not None  # a decode step
        if graphed:  # padded to its graph's bucket: rows that read nothing, write the scratch slot
            pad = graph_bucket(len(ids)) - len(ids)
            ids, positions, lengths = ids + [0] * pad, positions + [0] * pad, lengths + [0] * pad
            slots += [self.scratch_slot] * pad
            cu += range(cu[-1] + 1, cu[-1] + pad + 1)
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
        for name in ("enable_prefix_caching", "enforce_eager", "async_scheduling", "debug"):
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
                             config.enforce_eager)
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
# Chapter 44. The benches (python 07_engine.py --bench)
# ----------------------------------------------------------------------------------------------
# Each bench prints a table, a row as soon as its figures are in, against a baseline measured in
# the same run: the copy bandwidth for the attention kernels, transformers for the engine. Weights
# are random in Qwen3-0.6B's and Qwen3-8B's shapes (no download): speed depends on shapes only.

_BENCH_BYTES = 256 * 2**20  # bytes per input tensor of the bandwidth benchmarks: far past the 50 MB L2


def _ms(fn):
    """Median milliseconds of fn() on the GPU; the first call (compiling, autotuning) is not timed."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _bench_copy_gbs():
    x = torch.randn(_BENCH_BYTES, device="cuda", dtype=torch.float32)  # 1 GiB
    y = torch.empty_like(x)
    gbs = 2 * x.nbytes / _ms(lambda: y.copy_(x)) / 1e6
    print(f"device-to-device copy: {gbs:,.0f} GB/s (bytes read + written); the bandwidth kernels' limit")
    return gbs


def _timed(fn):
    """Seconds of one call of fn after a first, untimed one (graph captures, compiling)."""
    fn()
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


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


def hf_qwen3(cfg, device):
    """transformers' Qwen3ForCausalLM with random bf16 weights of cfg's shape, the engine benches'
    baseline (the stage itself never imports transformers); None without transformers."""
    try:
        import transformers
    except ImportError:
        print("(transformers is not installed: its baseline figures are nan)")
        return None
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        try:
            return transformers.Qwen3ForCausalLM(
                transformers.Qwen3Config.from_dict(cfg.to_hf())).eval()
        finally:
            torch.set_default_dtype(torch.float32)


# -- attention: the decode and paged kernels against the copy bandwidth -------------------------

def _paged_copy(k, v, lengths, block_size, gen):
    """Contiguous caches k, v (B, Hkv, S, D) copied into pools (num_blocks, block_size, Hkv, D)
    of just the pages the rows' lengths need, in a random order -> k_cache, v_cache,
    block_tables (B, cdiv(S, block_size)) int32 (0 past a row's pages)."""
    B, Hkv, S, D = k.shape
    max_blocks = triton.cdiv(S, block_size)
    pages_of = (lengths.long() + block_size - 1) // block_size  # (B,)
    used = torch.arange(max_blocks, device=k.device)[None] < pages_of[:, None]  # (B, max_blocks)
    n = int(used.sum())
    tables = torch.zeros(B, max_blocks, dtype=torch.int32, device=k.device)
    tables[used] = torch.randperm(n, device=k.device, generator=gen).to(torch.int32)
    pools = []
    for x in (k, v):
        pages = F.pad(x, (0, 0, 0, max_blocks * block_size - S))  # (B, Hkv, max_blocks * bs, D)
        pages = pages.view(B, Hkv, max_blocks, block_size, D).permute(0, 2, 3, 1, 4)
        pool = x.new_empty(n, block_size, Hkv, D)
        pool[tables[used].long()] = pages[used]  # pages[used]: (n, block_size, Hkv, D)
        pools.append(pool)
    return pools[0], pools[1], tables


def bench_attention(device, head_dim=128, block_size=16):
    """Decode attention over a bf16 cache, one query a row: decode_attention (contiguous) and
    paged_decode_attention (the same keys paged in a random order) as a fraction of the copy
    bandwidth and against torch's SDPA, once the three agree. Returns {case: figures}, or None
    without a GPU."""
    if not gpu_only("attention", device):
        return None
    D, gen = head_dim, torch.Generator(device).manual_seed(0)
    copy_gbs = _bench_copy_gbs()
    full = lambda b: torch.full((b,), 4096, device=device, dtype=torch.int32)  # noqa: E731
    cases = {"batch 64, 4,096 keys, GQA 32/8": (full(64), 32, 8),
             "batch 64, 4,096 keys, GQA 16/8": (full(64), 16, 8),
             "batch 1, 4,096 keys, GQA 32/8": (full(1), 32, 8),
             "batch 256, 100..2,048 keys, GQA 16/8": (torch.randint(
                 100, 2049, (256,), device=device, generator=gen, dtype=torch.int32), 16, 8)}
    table = Table(f"decode attention, bf16, D={D}, against the copy bandwidth; paged: pages of "
                  f"{block_size} in a random order (targets: 80% of copy, paged 0.9x contiguous)",
                  [("case", 36, ""), ("MiB", 6, ",.0f"), ("splits", 6, "d"), ("rel err", 8, ".1e"),
                   ("contig µs", 10, ",.1f"), ("of copy", 7, ".0%"), ("paged µs", 9, ",.1f"),
                   ("of copy", 7, ".0%"), ("x contig", 8, ".2f"), ("x SDPA", 7, ".2f")])
    results = {}
    for label, (lengths, Hq, Hkv) in cases.items():
        B, S = lengths.shape[0], int(lengths.max())
        q, k, v = (torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=gen)
                   for shape in ((B, Hq, D), (B, Hkv, S, D), (B, Hkv, S, D)))
        k_cache, v_cache, tables = _paged_copy(k, v, lengths, block_size, gen)
        contiguous = functools.partial(decode_attention, q, k, v, lengths, S)
        paged = functools.partial(paged_decode_attention, q, k_cache, v_cache, tables, lengths, S)
        keys = torch.arange(S, device=device)[None, None, None] < lengths[:, None, None, None]
        sdpa = functools.partial(F.scaled_dot_product_attention, q[:, :, None], k, v,
                                 attn_mask=None if bool((lengths == S).all()) else keys,
                                 enable_gqa=True)  # (B, Hq, 1, D)
        expected = sdpa()[:, :, 0].float()
        err = max(((f().float() - expected).norm() / expected.norm()).item()
                  for f in (contiguous, paged))
        read = int(lengths.sum()) * Hkv * D * k.element_size() * 2  # bytes of K and V read
        c_ms, p_ms, s_ms = _ms(contiguous), _ms(paged), _ms(sdpa)
        of_copy = [read / ms / 1e6 / copy_gbs for ms in (c_ms, p_ms)]
        splits = decode_splits(B, Hkv, S, _num_sms(device))
        results[label] = dict(rel_err=err, contiguous_of_copy=of_copy[0], paged_of_copy=of_copy[1],
                              paged_vs_contiguous=c_ms / p_ms, contiguous_vs_sdpa=s_ms / c_ms)
        table.row(label, read / 2**20, splits, err, c_ms * 1e3, of_copy[0], p_ms * 1e3,
                  of_copy[1], c_ms / p_ms, s_ms / c_ms)
    return results


# -- structured output: compiling, a mask's first computation, a cached mask --------------------

QWEN3_VOCAB_SIZE = 151_936      # the model's vocabulary (rows of its embedding)
QWEN3_REGULAR_TOKENS = 151_643  # its tokenizer's BPE tokens; then <|endoftext|>, <|im_start|>, ...
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
        "score": {"type": "number"}, "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"]},
        "nickname": {"type": "string"}, "manager": {"type": "null"},
    },
    "required": ["name", "age", "role"],
}


def synthetic_vocab(base_tokens, size=QWEN3_VOCAB_SIZE, n_regular=QWEN3_REGULAR_TOKENS, seed=0):
    """A stand-in for Qwen3's vocabulary, no download needed: the 256 bytes, `base_tokens` (e.g.
    GPT-2's), then pairs of tokens joined, drawn with Zipf weights as BPE merges grow a vocabulary,
    up to `n_regular` tokens; the ids above have no bytes (special tokens, unused rows)."""
    rng = random.Random(seed)
    vocab = dict.fromkeys([bytes([b]) for b in range(256)] + list(base_tokens))  # an ordered set
    parts, weights = list(vocab), list(np.cumsum(1.0 / np.arange(1, len(vocab) + 1)))
    while len(vocab) < n_regular:
        vocab[b"".join(rng.choices(parts, cum_weights=weights, k=2))] = None
    return list(vocab)[:n_regular] + [None] * (size - n_regular)


def bench_structured(base_tokens, schema=BENCH_SCHEMA, size=QWEN3_VOCAB_SIZE,
                     n_regular=QWEN3_REGULAR_TOKENS, n_lookups=20_000, seed=0):
    """What structured output costs on a Qwen3-sized vocabulary, on the CPU where it runs:
    compiling `schema`, a state's mask the first time (every state of its automaton), and a
    state's mask once seen (random lookups). Returns the three medians, in seconds."""
    def timed(fn, *args):  # (seconds, result)
        start = time.perf_counter()
        result = fn(*args)
        return time.perf_counter() - start, result

    vocab_s, vocab = timed(synthetic_vocab, base_tokens, size, n_regular, seed)
    trie_s, trie = timed(TokenTrie, vocab)
    # _compile's cache is bypassed: this is the cost of a new schema
    compiles = [timed(lambda: determinize(ByteNFA(json_schema_to_tree(schema)))) for _ in range(5)]
    compile_times, dfa = [t for t, _ in compiles], compiles[-1][1]
    masker = TokenMasker(dfa, trie, eos_ids=[n_regular, n_regular + 2])  # as Qwen3's eos ids
    first = [timed(masker.mask, state)[0] for state in range(dfa.num_states)]
    rng, hits = random.Random(seed), []
    for state in (rng.randrange(dfa.num_states) for _ in range(n_lookups)):
        start = time.perf_counter_ns()  # integer ns around the call alone: a hit is a lookup
        masker.mask(state)
        hits.append((time.perf_counter_ns() - start) / 1e9)
    hits.sort()
    table = Table(f"structured output, {len(vocab):,}-token vocabulary (built in {vocab_s:.2f} s, "
                  f"its trie in {trie_s:.2f} s); the schema's DFA has {dfa.num_states} states",
                  [("", 24, ""), ("median", 10, ""), ("worst", 10, ""), ("target", 8, "")])
    table.row("compile schema", f"{statistics.median(compile_times) * 1e3:.1f} ms",
              f"{max(compile_times) * 1e3:.1f} ms", "200 ms")
    table.row("mask, first computation", f"{statistics.median(first) * 1e6:.1f} µs",
              f"{max(first) * 1e6:.0f} µs", "")
    table.row("mask, state seen before", f"{statistics.median(hits) * 1e6:.2f} µs",
              f"{hits[int(0.99 * len(hits))] * 1e6:.2f} µs", "100 µs")
    return statistics.median(compile_times), statistics.median(first), statistics.median(hits)


# -- decode: tokens/s and bandwidth, against transformers' generate -----------------------------
# A step's bytes (bytes_per_step) over its time, against the copy bandwidth, are the fraction of
# the hardware's limit reached. transformers runs the same shapes in the same process.

def bytes_per_step(model, batch, context):
    """Bytes a decode step reads at least: the weights (the embedding only when it is the output
    layer too: a lookup reads just its rows) and `context` cached positions of every row."""
    cfg = model.cfg
    weights = sum(p.nbytes for p in model.parameters())
    if not cfg.tie_word_embeddings:
        weights -= model.model.embed_tokens.weight.nbytes
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * context * batch
    return weights + kv * model.model.embed_tokens.weight.element_size()


def gpu_ops(fn):
    """How many kernels (and copies) one call of fn puts on the GPU, by the profiler."""
    fn()  # compiled and autotuned outside the count
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def kernels_per_step(model, batch):
    """GPU ops of a decode step: on the model's path (unfused) and on forward_packed (fused)."""
    device = _device_of(model)
    cache = KVCache(model.cfg, batch, 64, device, model.model.embed_tokens.weight.dtype)
    ids = torch.zeros(batch, dtype=torch.int64, device=device)
    pos = torch.full((batch,), 8, device=device)
    step = packed_stepper(model, batch, 64)
    with torch.inference_mode():
        plain = gpu_ops(lambda: model.logits(model.hidden_states(ids[:, None], pos[:, None], cache,
                                                                 kv_len=9)))
        fast = gpu_ops(lambda: step(ids, pos, torch.arange(batch, device=device)))
    return plain, fast


def engine_rate(model, batch, prompt_len, new_tokens, async_scheduling=True):
    """LLM.generate of `batch` random prompts, new_tokens each, greedy: (tokens/s end to end,
    seconds of a decode step: the time of new_tokens tokens less that of 1, over new_tokens - 1,
    ms of the step's graph replayed back to back: the GPU's share)."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens = {new_tokens}: a decode step's time needs at least 2")
    length = prompt_len + new_tokens
    llm = LLM(model, max_model_len=length, max_num_seqs=batch, async_scheduling=async_scheduling,
              num_kv_blocks=batch * triton.cdiv(length, 16))
    prompts = random_prompts(model.cfg.vocab_size, [prompt_len] * batch, seed=batch)

    def seconds(n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return _timed(lambda: llm.generate(prompts, params))

    total, first = seconds(new_tokens), seconds(1)
    graph = llm.engine.runner.graphs.graphs[graph_bucket(batch)].graph  # its last step's inputs
    return batch * new_tokens / total, (total - first) / (new_tokens - 1), _ms(graph.replay)


def transformers_rate(cfg, device, batch, prompt_len, new_tokens, cache_implementation):
    """The same with transformers' generate (random bf16 weights of cfg's shape)."""
    hf = hf_qwen3(cfg, device)
    if hf is None:
        return math.nan
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  cache_implementation=cache_implementation)
    with torch.inference_mode():
        return batch * new_tokens / _timed(lambda: hf.generate(ids, **kwargs))


def bench_engine(device, batches=(1, 16), prompt_len=16, new_tokens=256, hf_tokens=128):
    """For each shape of BENCH_MODELS and batch size: tokens/s end to end against transformers'
    generate; a decode step's time and the bandwidth it implies; the GPU's share of the step
    (its graph replayed): the rest is host time, which async scheduling overlaps with the GPU's
    ("plain": off). Returns {(model, batch): {"plain"|"async": {"tok_s", "of_copy", "step_us",
    "gpu_us"}, "transformers"|"transformers_static": tok/s}}, or None without a GPU."""
    if not gpu_only("decode", device):
        return None
    copy_gbs = _bench_copy_gbs()
    results = {}
    for name, cfg in BENCH_MODELS.items():
        model = random_model(cfg, device, torch.bfloat16)
        plain, fast = kernels_per_step(model, 1)
        table = Table(f"decode, {name} shape, bf16, random weights "
                      f"({model.num_params() / 1e9:.2f}B parameters; {plain} GPU ops a decode "
                      f"step on the model's path, {fast} on forward_packed): tok/s end to end, "
                      f"prefill included; step: one decode step and the GB/s it reads; GPU: its "
                      f"graph replayed alone",
                      [("batch", 5, "d"), ("engine", 6, ""), ("tok/s", 8, ",.0f"),
                       ("GB/s", 6, ",.0f"), ("of copy", 7, ".0%"), ("step µs", 8, ",.0f"),
                       ("GPU µs", 7, ",.0f"), ("HF tok/s", 9, ",.0f"), ("HF static", 9, ",.0f"),
                       ("x best HF", 9, ".1f")])
        context = prompt_len + new_tokens // 2  # the average row length over the run
        for batch in batches:
            row = results[name, batch] = {}
            for key, cache in (("transformers", None), ("transformers_static", "static")):
                row[key] = transformers_rate(cfg, device, batch, prompt_len, hf_tokens, cache)
                torch.cuda.empty_cache()
            best = max(row["transformers"], row["transformers_static"])
            for mode in ("plain", "async"):
                tok_s, step_s, replay_ms = engine_rate(model, batch, prompt_len, new_tokens,
                                                       mode == "async")
                gbs = bytes_per_step(model, batch, context) / step_s / 1e9
                row[mode] = dict(tok_s=tok_s, of_copy=gbs / copy_gbs, step_us=step_s * 1e6,
                                 gpu_us=replay_ms * 1e3)
                table.row(batch, mode, tok_s, gbs, gbs / copy_gbs, step_s * 1e6, replay_ms * 1e3,
                          row["transformers"], row["transformers_static"], tok_s / best)
        del model
        torch.cuda.empty_cache()
    return results


# -- offline throughput, prefix caching, the GPU's idle time --------------------------------------
# nano-vllm's benchmark workload on Qwen3-0.6B's shape: 256 requests, prompt and output lengths
# uniform in 100..1,024, temperature 0.6, ignore_eos. It is mostly decode steps of a couple of
# hundred sequences, each reading the weights and every sequence's cache: paged decode decides it.

def throughput_workload(vocab_size, n=256, low=100, high=1024, seed=0, shared=0.0):
    """[(prompt ids, output length)]: prompt and output lengths uniform in low..high. shared: the
    fraction of each prompt that is a prefix common to all (0: none)."""
    rng = random.Random(seed)
    common = [rng.randrange(vocab_size) for _ in range(high)]
    requests = []
    for _ in range(n):
        length, out = rng.randint(low, high), rng.randint(low, high)
        k = int(length * shared)
        requests.append((common[:k] + [rng.randrange(vocab_size) for _ in range(length - k)], out))
    return requests


def run_workload(llm, requests, temperature=0.6):
    """(seconds, output tokens, prompt tokens) of generating the requests, with ignore_eos."""
    params = [SamplingParams(temperature=temperature, max_tokens=out, ignore_eos=True)
              for _, out in requests]
    _sync()
    start = time.perf_counter()
    outputs = llm.generate([prompt for prompt, _ in requests], params)
    _sync()
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == out for o, (_, out) in zip(outputs, requests))
    return seconds, sum(out for _, out in requests), sum(len(p) for p, _ in requests)


def gpu_idle_fraction(llm, batch=128, prompt_len=256, new_tokens=64):
    """The fraction of the wall time the GPU runs no kernel, over the decode steps of `batch`
    sequences (torch.profiler's kernel intervals, merged)."""
    requests = [(p, new_tokens) for p in
                random_prompts(llm.model.cfg.vocab_size, [prompt_len] * batch, seed=1)]
    run_workload(llm, requests)  # warm-up: graphs, autotuning
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        seconds, _, _ = run_workload(llm, requests)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, -math.inf
    for lo, hi in spans:
        busy += max(0.0, hi - max(lo, end))
        end = max(end, hi)
    return 1.0 - busy / 1e6 / seconds


def transformers_throughput(cfg, device, requests, temperature=0.6):
    """The workload through transformers' own continuous batching (its paged attention over
    SDPA), random bf16 weights of cfg's shape: (seconds, output tokens)."""
    import transformers
    hf = hf_qwen3(cfg, device)
    hf.set_attn_implementation("paged|sdpa")
    config = transformers.GenerationConfig(do_sample=True, temperature=temperature, top_k=0,
                                           top_p=1.0, max_new_tokens=max(o for _, o in requests),
                                           eos_token_id=None, pad_token_id=0)
    manager = hf.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i, (prompt, out) in enumerate(requests):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=out)
        done, tokens = 0, 0
        while done < len(requests):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("transformers' continuous batching stalled for 60 s")
            if result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
        torch.cuda.synchronize()
        return time.perf_counter() - start, tokens
    finally:
        manager.stop(block=True)


def bench_throughput(device, n=256, low=100, high=1024, max_num_batched_tokens=8192,
                     baseline_requests=64, runs=2):
    """Offline throughput on the workload above: output and total tokens/s (the best of `runs`);
    the same with half of each prompt shared, prefix caching on and off; the GPU's idle fraction
    over decode steps, async scheduling on and off; transformers' continuous batching on the first
    baseline_requests requests (all would take it minutes; 0: not run). None without a GPU."""
    if not gpu_only("throughput", device):
        return None
    cfg = BENCH_MODELS["Qwen3-0.6B"]
    model = random_model(cfg, device, torch.bfloat16)
    requests = throughput_workload(cfg.vocab_size, n, low, high)
    shared = throughput_workload(cfg.vocab_size, n, low, high, shared=0.5)
    # the warm-up: prompts as long, outputs short, so that every graph and tile size is ready
    warm_up = [(p, 1 + i) for i, (p, _) in enumerate(throughput_workload(cfg.vocab_size, n, low,
                                                                         high, seed=1))]
    knobs = dict(max_model_len=2 * high, max_num_batched_tokens=max_num_batched_tokens)
    table = Table(f"offline throughput: Qwen3-0.6B shape, bf16, random weights; {n} requests, "
                  f"prompt and output lengths uniform in {low}..{high:,}, temperature 0.6, "
                  f"ignore_eos; the best of {runs} runs",
                  [("", 36, ""), ("seconds", 8, ".2f"), ("output tok/s", 13, ",.0f"),
                   ("total tok/s", 12, ",.0f"), ("prefix hits", 12, ".0%")])
    results = {}
    for name, reqs, caching in (("engine", requests, True),
                                ("half of each prompt shared", shared, True),
                                ("the same, prefix caching off", shared, False)):
        llm = LLM(model, enable_prefix_caching=caching, **knobs)
        run_workload(llm, warm_up)
        blocks, best = llm.engine.block_manager, None
        for _ in range(runs):
            blocks.reset_prefix_cache()
            blocks.reset_stats()
            seconds, out, prompt = run_workload(llm, reqs)
            if best is None or seconds < best[0]:
                best = seconds, blocks.prefix_hit_rate
        seconds, hits = best
        results[name] = dict(seconds=seconds, output_tok_s=out / seconds,
                             total_tok_s=(out + prompt) / seconds, prefix_hit_rate=hits)
        table.row(name, seconds, out / seconds, (out + prompt) / seconds, hits)
        del llm, blocks
        torch.cuda.empty_cache()
    on, off = results["half of each prompt shared"], results["the same, prefix caching off"]
    print(f"  prefix caching: {off['seconds'] / on['seconds']:.2f}x the speed without it on the "
          f"shared-prefix workload")
    for mode in (True, False):
        llm = LLM(model, async_scheduling=mode, **knobs)
        idle = results[f"idle_async_{mode}"] = gpu_idle_fraction(llm)
        print(f"  GPU idle over decode steps of 128 sequences, async scheduling "
              f"{'on ' if mode else 'off'}: {idle:.1%}", flush=True)
        del llm
        torch.cuda.empty_cache()
    if baseline_requests:
        subset = requests[:baseline_requests]
        llm = LLM(model, **knobs)
        run_workload(llm, warm_up[:baseline_requests])
        seconds, out, _ = run_workload(llm, subset)
        ours = results["engine_subset"] = out / seconds
        del llm
        torch.cuda.empty_cache()
        try:
            seconds, out = transformers_throughput(cfg, device, subset)
            theirs = results["transformers"] = out / seconds
            print(f"  the first {len(subset)} requests: the engine {ours:,.0f} output tok/s, "
                  f"transformers' continuous batching (paged|sdpa) {theirs:,.0f} ({seconds:.0f} "
                  f"s): {ours / theirs:.1f}x")
        except Exception as e:  # a baseline that breaks must not hide the engine's figures
            print(f"  transformers' continuous batching failed: {type(e).__name__}: {e}")
    return results


# -- speculative decoding against plain decoding ------------------------------------------------

class RejectedProposer(Proposer):
    """n-gram lookup's worst case, for the bench: k random tokens a step, free to propose, which
    the target rejects (it accepts one in the vocabulary's size)."""

    def __init__(self, vocab_size, seed=0):
        self.vocab_size, self.rng = vocab_size, random.Random(seed)

    def propose(self, seqs, ks):
        for seq, k in zip(seqs, ks):
            seq.draft_tokens = [self.rng.randrange(self.vocab_size) for _ in range(k)]


def speculative_rate(model, prompts, params, speculative=None, proposer=None):
    """(output tokens/s, mean accepted drafts a verified sequence) of one LLM generating prompts,
    the best of two runs after a warm-up run; proposer: one in place of speculative's."""
    llm = LLM(model, max_model_len=1024, max_num_seqs=len(prompts), num_kv_blocks=len(prompts) * 64,
              speculative=speculative)
    if proposer is not None:
        llm.engine.speculator.proposer = proposer
    llm.generate(prompts, params)  # warm-up: graphs, tiles
    best = None
    for _ in range(2):
        before = dict(llm.engine.counts)
        _sync()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        _sync()
        rate = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
        counts = {k: v - before.get(k, 0) for k, v in llm.engine.counts.items()}
        accepted = counts.get("accepted", 0) / max(1, counts.get("verified", 0))
        if best is None or rate > best[0]:
            best = rate, accepted
    return best


def bench_speculative(device, batches=(1, 32), k=4, prompt_len=128, new_tokens=256):
    """Speculative decoding on Qwen3-0.6B's shape, greedy and sampled, against plain decoding:
    a draft model that is the target (all accepted: the best case, less the draft's own steps),
    a random draft (none accepted: the worst case), n-gram lookup greedy (a random model's greedy
    text repeats itself: its best case), RejectedProposer (its worst) always on and self-switching,
    n-gram sampled (nothing repeats). Prints the break-even accepted drafts a step. Returns
    {(batch, case): (tok/s, accepted a step)}, or None without a GPU."""
    if not gpu_only("speculative decoding", device):
        return None
    cfg = BENCH_MODELS["Qwen3-0.6B"]
    model = random_model(cfg, device, torch.bfloat16)
    other = random_model(cfg, device, torch.bfloat16, seed=1)  # a draft that agrees with nothing
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True)
    always = dict(num_tokens=k, min_accepted=0)
    cases = [("plain, greedy", None, greedy),
             ("draft = target", {"method": "draft", "model": model, **always}, greedy),
             ("random draft (always on)", {"method": "draft", "model": other, **always}, greedy),
             ("n-gram, greedy", {"method": "ngram", "num_tokens": k}, greedy),
             ("n-gram rejected (always on)", {"method": "ngram", **always}, greedy),
             ("n-gram rejected", {"method": "ngram", "num_tokens": k}, greedy),
             ("plain, sampled", None, sampled),
             ("n-gram, sampled", {"method": "ngram", "num_tokens": k}, sampled)]
    table = Table(f"speculative decoding, Qwen3-0.6B shape, random bf16 weights, k = {k}, "
                  f"prompts of {prompt_len} random tokens, {new_tokens} new tokens each",
                  [("batch", 5, "d"), ("", 28, ""), ("tok/s", 8, ",.0f"), ("x plain", 8, ""),
                   ("accepted/step", 14, ".2f")])
    results = {}
    for batch in batches:
        prompts = random_prompts(cfg.vocab_size, [prompt_len] * batch, seed=batch)
        for name, spec, params in cases:
            proposer = RejectedProposer(cfg.vocab_size) if "rejected" in name else None
            rate, accepted = speculative_rate(model, prompts, params, spec, proposer)
            plain = results.get((batch, "plain, " + ("greedy" if params is greedy else "sampled")))
            results[batch, name] = (rate, accepted)
            table.row(batch, name, rate, f"{rate / plain[0]:.2f}x" if plain else "", accepted)
        plain = results[batch, "plain, greedy"][0]
        # a verified step costs what the worst case's does and yields 1 + a tokens
        print(f"  batch {batch}: break-even at accepted drafts a step of: draft model "
              f"{plain / results[batch, 'random draft (always on)'][0] - 1:.2f}, n-gram "
              f"{plain / results[batch, 'n-gram rejected (always on)'][0] - 1:.2f}", flush=True)
    return results


# ----------------------------------------------------------------------------------------------
# The demos and main
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


DEMO_PROMPTS = ("In 1908, Edith Wharton wrote", "def add(a, b):\n    return")


def demo_prompts(llm, args):
    """--prompt and two more, as token ids; with --chat each is a user turn in the chat format."""
    if llm.tokenizer is None:
        raise DataError(f"{args.model} has no tokenizer.json: this demo writes text prompts")
    texts = [args.prompt, *DEMO_PROMPTS]
    if args.chat:
        try:
            texts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
                     for text in texts]
        except ValueError as e:  # a base model, or another chat format than Qwen3's
            raise DataError(f"--chat: {e}") from None
    return [llm.tokenizer.encode(text) for text in texts]


def describe(llm, model):
    """Print what was loaded: the model's shape and the tokenizer's size."""
    cfg, tok = llm.model.cfg, llm.tokenizer
    print(f"Qwen3 from {model or 'a tiny random checkpoint'}: {cfg.num_hidden_layers} layers, "
          f"C={cfg.hidden_size}, {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads of "
          f"{cfg.head_dim}, V={cfg.vocab_size:,}; {llm.model.num_params() / 1e6:.1f}M parameters, "
          f"{next(llm.model.parameters()).dtype} on {_device_of(llm.model)}")
    if tok is not None:
        origin = "" if model else "GPT-2's first tokens and Qwen3's chat tokens, "
        print(f"tokenizer: {origin}{len(tok.token_bytes):,} ids, eos ids "
              f"{sorted(tok.eos_token_ids)}, chat template: "
              f"{'yes' if tok.chat_template else 'no (a base model)'}")
    blocks, size = llm.engine.block_manager.num_blocks, llm.config.block_size
    print(f"KV cache: {blocks:,} blocks of {size} tokens = {blocks * size:,} tokens, "
          f"{memory_size(llm.kv_cache_bytes)}")


def random_prompts(vocab_size, lengths, seed):
    """Prompts of random token ids, one of each length."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _device_of(model):
    return model.inv_freq.device


def check_against_recompute(llm, prompts, max_tokens):
    """The engine's greedy tokens and logprobs against one forward pass, without a cache, over
    each finished sequence. Prints and returns the largest logprob difference."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = [request.outputs[0] for request in llm.generate(prompts, params)]
    worst, same = 0.0, True
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor([prompt + out.token_ids], device=_device_of(llm.model))
            logp = llm.model(ids)[0, len(prompt) - 1:-1].float().log_softmax(-1)  # (n, V)
            expected = logp[torch.arange(len(out.token_ids)), out.token_ids].cpu()
            ours = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])
            worst = max(worst, (ours - expected).abs().max().item())
            same &= logp.argmax(-1).tolist() == out.token_ids
    print(f"engine (prefill, then decode over the KV cache) vs full recomputation: greedy tokens "
          f"{'identical' if same else 'DIFFERENT'}, logprobs max abs diff {worst:.1e}")
    return worst


def check_kernels(model, prompts, steps=2):
    """Logits on the Triton kernels against the torch twins: the model's path (a right-padded
    batch, then `steps` decode steps over the KV cache) and forward_packed (fused and paged
    kernels, the prompts packed side by side). Prints and returns the two relative errors."""
    device, dtype = _device_of(model), model.model.embed_tokens.weight.dtype
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # (B,)
    T = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=device)  # (B, T)
    was_on, logits = model.kernels, []
    with torch.inference_mode():
        for on, packed in ((False, False), (True, False), (False, True), (True, True)):
            model.use_kernels(on)
            if packed:
                logits.append(packed_logits(model, prompts, steps).float())
                continue
            cache = KVCache(model.cfg, len(prompts), T + steps, device, dtype)
            out = [model.logits(model.hidden_states(ids, cache=cache)).flatten(0, 1)]  # (B * T, V)
            for i in range(steps):  # each row's first token again, at the row's next position
                h = model.hidden_states(ids[:, :1], (lengths + i)[:, None], cache, kv_len=T + i + 1)
                out.append(model.logits(h[:, 0]))  # (B, V)
            logits.append(torch.cat(out).float())
    model.use_kernels(was_on)
    errors = [((logits[i + 1] - logits[i]).norm() / logits[i].norm()).item() for i in (0, 2)]
    where = "Triton's interpreter" if INTERPRET else torch.cuda.get_device_name(device)
    print(f"logits on the Triton kernels ({where}) vs the torch path: rel err {errors[0]:.1e} (a "
          f"prefill and {steps} decode steps); forward_packed on the fused and paged kernels vs "
          f"its torch twin: {errors[1]:.1e}")
    return errors


def packed_logits(model, prompts, steps, block_size=16):
    """forward_packed's logits (tokens, V) of every prompt token, the prompts packed in one step,
    then of `steps` decode steps, each row's first token again at its next position."""
    device, B = _device_of(model), len(prompts)
    step = packed_stepper(model, B, max(map(len, prompts)) + steps, block_size)
    rows = torch.cat([torch.full((len(p),), b, device=device) for b, p in enumerate(prompts)])
    positions = torch.cat([torch.arange(len(p), device=device) for p in prompts])
    out = [step(torch.tensor(sum(prompts, []), device=device), positions, rows)]
    first = torch.tensor([p[0] for p in prompts], device=device)
    for i in range(steps):
        lengths = torch.tensor([len(p) + i for p in prompts], device=device)
        out.append(step(first, lengths, torch.arange(B, device=device)))
    return torch.cat(out)


def packed_stepper(model, batch, length, block_size=16):
    """step(ids, positions, rows) -> logits of every token: forward_packed over a paged cache of
    `batch` sequences of up to `length` tokens, rows[i] the sequence of token i, whose blocks
    are handed out in reverse (so that no sequence's blocks are in order)."""
    device, dtype, cfg = _device_of(model), model.model.embed_tokens.weight.dtype, model.cfg
    width = triton.cdiv(length, block_size)
    shape = (cfg.num_hidden_layers, batch * width, block_size, cfg.num_key_value_heads,
             cfg.head_dim)
    kv = tuple(torch.zeros(shape, device=device, dtype=dtype) for _ in range(2))
    tables = torch.arange(batch * width, device=device, dtype=torch.int32).flip(0)
    tables = tables.view(batch, width)
    attention = triton_attention if model.kernels else torch_attention
    fuse_projections(model)

    def step(ids, positions, rows):
        counts = torch.bincount(rows, minlength=batch)  # (B,) new tokens of each sequence
        meta = AttentionMetadata(
            slots=(tables[rows, positions // block_size].long() * block_size
                   + positions % block_size),
            cu_seqlens_q=F.pad(counts.cumsum(0), (1, 0)).int(),
            lengths=torch.zeros(batch, dtype=torch.int64, device=device).scatter_reduce(
                0, rows, positions + 1, "amax").int(),
            block_tables=tables, max_q_len=int(counts.max()), max_len=width * block_size,
            sample_rows=torch.arange(len(ids), device=device))
        return forward_packed(model, ids, positions, kv, meta, attention)
    return step


def show_generations(llm, prompts, args):
    """Greedy generations, batched and one by one, then seeded samples, the first also alone."""
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    batched = [request.outputs[0] for request in llm.generate(prompts, greedy)]
    same = all(llm.generate([p], greedy)[0].outputs[0].token_ids == out.token_ids
               for p, out in zip(prompts, batched))
    print(f"\ngreedy, {len(prompts)} prompts in one batch "
          f"({'identical to' if same else 'DIFFERENT from'} one by one):")
    _print_outputs(llm, prompts, batched)
    sampled = [SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, seed=args.seed + i, max_tokens=args.max_tokens)
               for i in range(len(prompts))]
    outputs = [request.outputs[0] for request in llm.generate(prompts, sampled)]
    alone = llm.generate(prompts[:1], sampled[0])[0].outputs[0]
    print(f"\nsampled (temperature {args.temperature}, top-k {args.top_k or 'off'}, top-p "
          f"{args.top_p}, min-p {args.min_p}, seeds {args.seed}..{args.seed + len(prompts) - 1}; "
          f"the first drawn alone: "
          f"{'identical' if alone.token_ids == outputs[0].token_ids else 'DIFFERENT'}):")
    _print_outputs(llm, prompts, outputs)
    return same


def _print_outputs(llm, prompts, outputs):
    """Each prompt with its special tokens (a chat prompt shows its turns), and the text after."""
    for prompt, out in zip(prompts, outputs):
        print(f"  {llm.tokenizer.decode(prompt)!r} -> {out.text!r} ({out.finish_reason}, "
              f"{len(out.token_ids)} tokens)")


# Structured output for the demo: each kind once, none with a free string or number, so that
# even random weights end it well within STRUCTURED_MAX_TOKENS.
DEMO_SCHEMA = {"type": "object", "required": ["name", "admin"], "properties": {
    "name": {"enum": ["Ada", "Grace", "Linus"]}, "admin": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}}}
DEMO_CONSTRAINTS = (("choice", ("yes", "no", "maybe")), ("regex", r"\d{4}-\d{2}-\d{2}"),
                    ("json_schema", DEMO_SCHEMA))
STRUCTURED_MAX_TOKENS = 128


def show_structured(llm, prompt, args):
    """The first prompt under each of DEMO_CONSTRAINTS, sampled, each text checked by Python's re
    and json, which know nothing of the automaton. Returns whether every text is valid."""
    params = [SamplingParams(temperature=args.temperature, seed=args.seed + i,
                             max_tokens=STRUCTURED_MAX_TOKENS, **{kind: spec})
              for i, (kind, spec) in enumerate(DEMO_CONSTRAINTS)]
    outputs = [request.outputs[0] for request in llm.generate([prompt] * len(params), params)]
    print(f"\nstructured output (temperature {args.temperature}, seeds {args.seed}.."
          f"{args.seed + len(params) - 1}):")
    all_valid = True
    for (kind, spec), out in zip(DEMO_CONSTRAINTS, outputs):
        valid = out.finish_reason == "stop" and _valid(kind, spec, out.text)
        all_valid &= valid
        shown = spec if kind == "regex" else json.dumps(spec)
        print(f"  {kind} {shown}\n    -> {out.text!r} ({out.finish_reason}, "
              f"{len(out.token_ids)} tokens; {'valid' if valid else 'INVALID'})")
    return all_valid


def _valid(kind, spec, text):
    """Whether `text` is what the constraint asks for, by Python's own re and json."""
    if kind == "choice":
        return text in spec
    if kind == "regex":
        return re.fullmatch(spec, text, re.ASCII) is not None  # \d is [0-9] here, as re.ASCII
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict)
            and set(spec["required"]) <= set(value) <= set(spec["properties"]))


def show_continuous_batching(llm, seed, n=6):
    """n requests of mixed lengths through a small engine over llm's model, a step at a time,
    printing each step's batch (a request's letter and tokens: a prefill chunk, or 1 for a decode)
    and preemptions. Returns whether their greedy outputs equal each request's alone."""
    rng, vocab = random.Random(seed), llm.model.cfg.vocab_size
    requests = [([rng.randrange(vocab) for _ in range(rng.randint(4, 40))], rng.randint(2, 12))
                for _ in range(n)]
    small = LLM(llm.model, tokenizer=llm.tokenizer, max_model_len=64, block_size=4,
                num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=24, debug=True)
    engine = small.engine
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request("ABCDEFGHIJ"[i], prompt,
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    print(f"\ncontinuous batching: {n} requests (prompt+max_tokens: "
          f"{', '.join(f'{len(p)}+{m}' for p, m in requests)}), at most 4 sequences and 24 tokens "
          f"a step, {engine.block_manager.num_blocks} KV blocks of 4 tokens; each step: the "
          f"requests it ran and their tokens")
    outputs, lines = {}, []
    while engine.has_unfinished():
        preempted = engine.scheduler.num_preemptions
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0]
        ran = " ".join(f"{seq.request_id}{n}" for seq, n in engine.last_batch)
        preempted = engine.scheduler.num_preemptions - preempted
        lines.append(f"{ran:<24} waiting {len(engine.scheduler.waiting)}"
                     + (f", {preempted} preempted" if preempted else "")
                     + ("" if ran else "  (reads the last step's tokens: async scheduling runs "
                                       "a step ahead)"))
    for step, line in enumerate(lines):
        print(f"  step {step:>2}: {line}")
    alone = [small.generate([prompt], SamplingParams(temperature=0, max_tokens=m,
                                                     ignore_eos=True))[0].outputs[0]
             for prompt, m in requests]
    same = all(outputs["ABCDEFGHIJ"[i]].token_ids == a.token_ids for i, a in enumerate(alone))
    print(f"  their greedy outputs: {'identical to' if same else 'DIFFERENT from'} each request "
          f"alone; every block free at the end: {engine.block_manager.num_free_blocks == 16}")
    return same


def measure_throughput(llm, batch_size, max_tokens, seed):
    """Tokens a second of the engine: batch_size prompts of 16 tokens, max_tokens each."""
    device = _device_of(llm.model)
    prompts = random_prompts(llm.model.cfg.vocab_size, [16] * batch_size, seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2))  # warm-up: kernels, graphs
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    sync()
    elapsed = time.perf_counter() - start
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    print(f"\nengine on {device}: {tokens / elapsed:,.0f} tokens/s ({batch_size} sequences x "
          f"{max_tokens} tokens in {elapsed:.2f} s, prefill included)")


def positive_int(text):
    """argparse type: an integer >= 1 (0 is not a way to ask for the default)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
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


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def fraction(text):
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face Qwen3 directory, or a Hub id such as "
                        "Qwen/Qwen3-0.6B (default: a tiny random Qwen3 in a temporary directory)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="default: the checkpoint's on a GPU, float32 on a CPU")
    parser.add_argument("--max-tokens", type=positive_int, default=16,
                        help="tokens to generate per prompt (default: 16)")
    parser.add_argument("--batch-size", type=positive_int, default=8,
                        help="sequences in the throughput run, and the engine's max_num_seqs")
    parser.add_argument("--temperature", type=non_negative_float, default=0.8,
                        help="of the sampled generations (default: 0.8)")
    parser.add_argument("--top-k", type=non_negative_int, default=0,
                        help="sample from the k likeliest tokens (default: 0, all)")
    parser.add_argument("--top-p", type=probability, default=0.95,
                        help="sample from the likeliest tokens up to this mass (default: 0.95)")
    parser.add_argument("--min-p", type=fraction, default=0.0,
                        help="drop tokens less likely than this times the likeliest (default: 0)")
    parser.add_argument("--seed", type=non_negative_int, default=123,
                        help="seed of the random model, the prompts and the sampling")
    parser.add_argument("--prompt", default="Every effort moves you",
                        help="the first prompt of the generations (default: %(default)r)")
    parser.add_argument("--chat", action="store_true",
                        help="give each prompt as a user turn in Qwen3's chat format")
    parser.add_argument("--bench", action="store_true", help="instead: what structured output "
                        "costs on a Qwen3-sized vocabulary and, on a GPU, the attention kernels "
                        "against copy bandwidth and SDPA, decode tokens/s of Qwen3-0.6B and 8B "
                        "shapes against transformers, offline throughput against transformers' "
                        "continuous batching, and speculative decoding")
    parser.add_argument("--data-dir", help="download cache for Hub ids and GPT-2's tokenizer, "
                        "the random model's (default: data/)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser, args):
    """Every flag checked before any work (a download, a load) starts."""
    if args.device.split(":")[0] not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: this stage runs on cpu or cuda (cuda:N for a GPU "
                     f"of several)")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device}: not a device; this stage runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA GPU")
    if args.data_dir is not None:
        check_data_dir(parser, args.data_dir)
    if not args.prompt.strip():
        parser.error("--prompt is empty")
    if args.bench and args.model is not None:
        parser.error("--model does not apply to --bench, which needs no model")
    if args.model is not None:
        if not args.model.strip():
            parser.error("--model is empty: give a directory or a Hub id, or leave it out for "
                         "the tiny random model")
        path = Path(args.model)
        if path.exists() and not path.is_dir():
            parser.error(f"--model {args.model} is a file; give the directory that holds it")
        if not path.exists() and not HUB_ID.fullmatch(args.model):
            parser.error(f"--model {args.model}: no such directory, and not a Hub id such as "
                         f"Qwen/Qwen3-0.6B")
        if path.is_dir() and (path / "config.json").is_file():  # its context, before the weights
            context = Qwen3Config.from_json(path / "config.json").max_position_embeddings
            check_max_tokens(parser, args.max_tokens, context)
    else:
        check_max_tokens(parser, args.max_tokens, Qwen3Config.tiny().max_position_embeddings)


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


def check_max_tokens(parser, max_tokens, context):
    if max_tokens >= context:
        parser.error(f"--max-tokens {max_tokens}: the model's context is {context:,} positions, "
                     f"prompt included")


def demo_llm(args):
    """The LLM of --model, or of a tiny random Qwen3 (with demo_tokenizer's tokenizer) in a
    temporary directory, on one CPU thread: a second gains it nothing and can make it wait."""
    device = torch.device(args.device)
    if args.model is None and device.type == "cpu":
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:  # the random model's files, read once and gone
        source = args.model or random_checkpoint(demo_tokenizer(tmp, args.data_dir), args.seed)
        return LLM(source, device=device, dtype=MODEL_DTYPES.get(args.dtype),
                   max_num_seqs=args.batch_size, data_dir=args.data_dir)


def show_the_model(llm, prompts, args):
    """Chapters 16-19: what was loaded; the engine's cached path against full recomputation;
    engine v1 against the engine; the Triton kernels against their torch twins."""
    describe(llm, args.model)
    check_against_recompute(llm, prompts, args.max_tokens)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    v1 = generate(llm.model, prompts, greedy)
    same = v1 == [out.outputs[0].token_ids for out in llm.generate(prompts, greedy)]
    print(f"engine v1 (a static batch over a KVCache) vs the engine (a paged cache, "
          f"continuous batching): greedy tokens {'identical' if same else 'DIFFERENT'}")
    if _device_of(llm.model).type == "cuda" or (INTERPRET and args.model is None):
        check_kernels(llm.model, prompts)
    else:  # the interpreter would take minutes on a real model
        print("(Triton kernels not checked: that needs a GPU, or on a CPU Triton's interpreter and "
              "the built-in tiny model)")


def run_benches(args):
    device = torch.device(args.device)
    bench_structured(read_ranks(data_file("gpt2.tiktoken", args.data_dir)))
    bench_attention(device)
    bench_engine(device)
    bench_throughput(device)
    bench_speculative(device)


def main(argv=None):
    args = parse_args(argv)
    if args.bench:
        run_benches(args)
        return
    llm = demo_llm(args)
    prompts = demo_prompts(llm, args)
    show_the_model(llm, prompts, args)
    show_generations(llm, prompts, args)
    show_structured(llm, prompts[0], args)
    show_continuous_batching(llm, args.seed)
    measure_throughput(llm, args.batch_size, args.max_tokens, args.seed)


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
    try:
        main()
    except DataError as e:  # a missing or broken file: the message says which and what to do
        sys.exit(f"error: {e}")
