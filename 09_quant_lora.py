"""Stage 09: quantization and adapters (book chapters 20, 22, 38 and 39). Weights in 8 and 4 bits
on Triton kernels of their own, rounded to nearest or placed by GPTQ and AWQ; activations in 8
bits too, after SmoothQuant; GPTQ and AWQ checkpoints from the Hugging Face Hub; llama.cpp's GGUF
files, read and written; LoRA adapters in PEFT's file layout, and QLoRA's frozen base in 4-bit
NormalFloat. Fine-tuning itself (chapter 21: a classifier, instructions) and its bench come
next.

    python 09_quant_lora.py              # a small Qwen3 trained here, then every chapter on it
    python 09_quant_lora.py --model Qwen/Qwen3-0.6B --method gptq --prompt "Why is the sky blue?"
    python 09_quant_lora.py --model Qwen/Qwen3-0.6B --save-gguf qwen3-0.6b.gguf --type q4_k
    python 09_quant_lora.py --gguf qwen3-0.6b.gguf --prompt "Why is the sky blue?"
    python 09_quant_lora.py --bench      # on a GPU: decode, the kernels, GPTQ's time

It prints the quantized layers on their kernels against their torch twins, a quality table
(held-out perplexity and each layer's output error for int8, int4, GPTQ, AWQ, W8A8 and
SmoothQuant), GGUF files written and read back, LoRA and an NF4 base on the model, and --prompt
continued by the int4 model.

New since stage 07: chapter 20's int8 and int4 formats, their matrix-vector and matrix-matrix
kernels and W8A8's, the twin layers that replace a model's nn.Linear (Int8Linear, Int4Linear,
W8A8Linear), GPTQ, AWQ and SmoothQuant with their calibration; chapter 39's GPTQ and AWQ
checkpoints; chapter 38's GGUF; chapter 22's LoRALinear (apply_lora, merge_lora, save_adapter,
load_adapter) and NF4 (nf4_quantize, its dequantize kernel, NF4Linear); a quality section that
trains a small Qwen3. Changed: load_qwen3
(and read_weights) load GPTQ and AWQ checkpoints onto the twin layers; SamplingParams,
SamplingBatch, Sampler, generate and its checks sample plain tokens (structured output and
logprobs were the engine's); bytes_per_step counts a quantized layer's buffers; DATA_FILES holds
the-verdict.txt again; main and run_benches are this stage's. Dropped, and kept in 07_engine.py:
the engine (Sequence, BlockManager, Scheduler, ModelRunner, LLMEngine, LLM), the paged attention
kernels, the fused decode step (forward_packed, DecodeGraphs), speculative decoding, structured
output, 07's benches; the HTTP server is 08_serve.py. This stage starts from 07, not 08: its
lesson is `diff 07_engine.py 09_quant_lora.py`.

Read top to bottom. Each line: chapter, section, and the definitions to read first.
    17      Qwen3: configuration and weights             Qwen3Config, load_qwen3
    17      its tokenizer and chat format                load_tokenizer, Tokenizer
    17      the model on its kernels: RMSNorm, SwiGLU,   Attention, Qwen3, flash_attention,
            RoPE, attention (prefill, decode)            decode_attention
    16      the KV cache                                 KVCache
    18      engine v1: prefill, decode, sample           generate
    19      programmatic dependent launch                _wait_for_inputs
    34      sampling                                     SamplingParams, Sampler
    20      int8 and int4 weights, their kernels, W8A8   quantize_int4, int4_matvec, int4_matmul,
            and the twin layers                          int8_w8a8_matmul, Int4Linear
    20      calibration, GPTQ, AWQ, SmoothQuant          gptq_quantize, awq_search,
                                                         smoothquant_model
    22      LoRA: adapters, merged, in PEFT's files      LoRALinear, apply_lora, save_adapter
    22      QLoRA's base: NF4, double quantization       nf4_quantize, NF4Linear
    39      GPTQ and AWQ checkpoints, through load_qwen3 quantization_config, checkpoint_twin
    38      GGUF: the blocks, reading, writing, qwen3    ggml_quantize, read_gguf, qwen3_to_gguf
            quality: a small Qwen3 trained here          train_small_qwen3, quality_table
    44      the benches                                  bench_decode, bench_matvec, bench_matmul
            the demos and main                           main
"""

import argparse
import base64
import contextlib
import copy
import functools
import hashlib
import json
import logging
import math
import numbers
import os
import re
import struct
import sys
import tempfile
import time
import unicodedata
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
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
                # changed in 09: a quantized checkpoint's integer tensors keep their type
                state[name] = f.get_tensor(name).to(
                    device=device, dtype=dtype if expected[name].is_floating_point() else None)
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


def load_qwen3(model_dir, device=None, dtype=None, data_dir=None):  # changed in 09: GPTQ, AWQ
    """Qwen3 in eval mode from a Hugging Face directory or a Hub id (downloaded on first use).
    device and dtype: see _resolve_device_dtype. The Triton kernels are on for CUDA. A GPTQ or
    AWQ checkpoint (a quantization_config in config.json, chapter 39) loads onto the stage's
    quantized twins of the blocks' linears (Int4Linear, Int8Linear); its config is checked
    before any weight is read."""
    folder = model_folder(model_dir, data_dir)
    cfg = Qwen3Config.from_json(folder / "config.json")
    qconfig = quantization_config(folder / "config.json", cfg)  # None: a float checkpoint
    device, dtype = _resolve_device_dtype(folder, device, dtype)
    with torch.device("meta"):
        model = Qwen3(cfg)  # shapes only
    if qconfig is None:
        state = read_weights(folder, model.state_dict(), device, dtype)
    else:  # the packed tensors as stored, then repacked into the twins
        state = read_weights(folder, checkpoint_tensors(model, qconfig), device, dtype)
        state = load_quantized(model, state, qconfig, folder)
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
    params.stop_token_ids, or after max_tokens (None: up to the model's context).
    cuda_graph_decode: on a GPU, replay the decode steps from a CUDA graph."""
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
        tokens = sampler(logits, batch)  # changed in 09: (B,), the Sampler's tokens alone
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


def _check_v1_request(prompts, params, cfg):  # changed in 09: no structured output to refuse
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
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
# Chapter 19. Fast decode: the kernels' early launch
# ----------------------------------------------------------------------------------------------
# From 07's chapter 19, the early launch alone: 07's fused decode step (its matvec,
# forward_packed, DecodeGraphs) stays in 07. Here the decode attention kernel above and the
# matrix-vector kernels of chapter 20 launch early.

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


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _need(config, ok, name, what):
    """A config's check: a ValueError naming the field, its value and the rule it breaks."""
    if not ok:
        raise ValueError(f"{type(config).__name__}.{name} = {getattr(config, name)!r}: {what}")


@dataclass(frozen=True)
class SamplingParams:  # changed in 09: no n, stop strings, logprobs or structured output
    """How one request samples and when it stops. Checked on construction: a bad value is a
    ValueError naming the field, here, rather than a wrong result on the device later."""
    max_tokens: int | None = 16  # tokens to generate at most; None: up to the context limit
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW): greedy
    top_k: int = 0  # keep the k likeliest tokens (ties with the k-th kept too); 0: all
    top_p: float = 1.0  # keep the likeliest tokens until their probability reaches top_p; 1: all
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest; 0: none
    repetition_penalty: float = 1.0  # > 1: tokens of the prompt or the output become less likely
    presence_penalty: float = 0.0  # subtracted from the logit of every token in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    seed: int | None = None  # this request's own random stream; None: torch's global one
    stop_token_ids: tuple = ()  # ids that end the request ("stop"), besides the eos ids
    ignore_eos: bool = False  # do not stop at the eos ids

    def __post_init__(self):
        need = functools.partial(_need, self)
        need(self.max_tokens is None or _is_int(self.max_tokens) and self.max_tokens >= 1,
             "max_tokens", "must be a positive int, or None for up to the context limit")
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


class SamplingBatch:  # changed in 09: engine v1's one batch, no logprobs
    """The sampling state of a batch's rows, on the device: each row's parameters as (B,)
    tensors, a generator for each seeded row and, when a row has a penalty, which tokens each
    prompt holds and how often each token is in each output so far; `record` adds the step's
    tokens, with no host sync."""

    def __init__(self, params, prompts, vocab_size, device):
        # every row's values in one (7, B) table, sent to the device in one copy from pinned
        # memory: a copy from pageable memory would wait for the GPU's queue, and the engine
        # builds a batch each step while the GPU runs the last one
        table = np.array([sampling_row(p, vocab_size) for p in params],
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
        generators = [None if p.seed is None else torch.Generator(device).manual_seed(p.seed)
                      for p in params]
        self.generators = {row: g for row, g in enumerate(generators) if g is not None}
        self.counts = self.in_prompt = None
        if self.penalties:
            self.counts = torch.zeros(len(params), vocab_size, device=device)  # (B, V)
            self.in_prompt = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
            for row, ids in enumerate(prompts):
                self.in_prompt[row, torch.tensor(ids, device=device)] = True

    def record(self, tokens):
        """Count the step's tokens (B,) into each row's output, for the penalties."""
        if self.counts is not None:
            self.counts.scatter_add_(1, tokens[:, None], torch.ones_like(self.counts[:, :1]))


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

    def __call__(self, logits, batch):  # changed in 09: tokens alone, no masks or logprobs
        """logits (B, V) -> tokens (B,) int64."""
        logits = logits.float()
        if batch.penalties:
            logits = apply_penalties(logits, batch)
        tokens = logits.argmax(dim=-1)  # greedy rows keep this
        if not batch.all_greedy:
            sampled = draw(self.probs(logits, batch), batch.generators)
            tokens = torch.where(batch.greedy, tokens, sampled)
        batch.record(tokens)
        return tokens

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
# Chapter 20. Weight-only quantization: int8 and int4 weights, and W8A8
# ----------------------------------------------------------------------------------------------
# NEW in stage 09. A decode step reads every weight once for 2 FLOPs per token: Qwen3-8B's 16 GB
# of bf16 weights take about 5 ms a step at an H100's 3.35 TB/s, whatever the FLOPs. Weights in
# 8 bits halve those bytes, in 4 bits quarter them; the kernels below read the small integers and
# dequantize them in registers, so decode time falls with the bytes. Prefill is bound by FLOPs,
# not bytes: it gains nothing from small weights, and its kernel must only not lose much. W8A8
# quantizes the activations too, so that prefill runs on the int8 tensor cores (twice bf16's
# rate).
#
# Legend: x (M, K) the activations, M tokens; W (N, K) a weight as nn.Linear stores it (N out,
# K in); G the group size; y (M, N) = x W^T. Round to nearest (RTN) everywhere.

# ------------------------------------------------------------------------------------------------
# 20.1 The formats, and their torch references
# ------------------------------------------------------------------------------------------------
# int8: one scale per output row, s = max|W[n, :]| / 127, q = round(w / s) in -127..127 (8-bit
# GPTQ files, chapter 39, keep a scale per group of G columns instead: the kernels take both).
# int4: one scale and zero point per G consecutive columns of a row (G = 128: 1/32 byte of bf16
# scale and zero per weight, 6% on top of the 1/2 byte), q = clamp(round(w / s) + z, 0, 15):
#   asymmetric (default): s = (max - min) / 15, z = round(-min / s), with min <= 0 <= max forced
#     so that w = 0 is a grid point and stays exactly 0;
#   symmetric: s = max|w| / 7, z = 8, the grid -7..7 around zero (q = 1..15).
# Dequantized: w_hat = (q - z) * s, and RTN promises |w - w_hat| <= s / 2 for every weight.
#
# The packed layout, a worked example. Eight int4 values of a row, column 0 first,
#     q = 1 2 3 4 5 6 7 8
# go into one int32 word, column 8i + j into bits 4j .. 4j + 3 of word i (low nibble first):
#     word = 0x87654321 (bits 0-3 hold 1, bits 4-7 hold 2, ..., bits 28-31 hold 8).
# Read as an int32 this word is negative (-2023406815): its top bit is set. Unpacking shifts right
# and masks with 0xF, and the mask drops the copies of the sign bit an arithmetic shift brings in,
# so signed and logical shifts give the same nibbles.

_NIBBLE_SHIFTS = tuple(range(0, 32, 4))  # nibble j of a word sits at bit 4j


def _stored_scale(scale, dtype):
    """scale (fp32, > 0) in the model's dtype, rounded up, never down: a scale rounded down would
    stretch the range past the grid's last point (max|w| / s > 127, or a group wider than 15
    steps), where RTN could no longer keep |w - w_hat| <= s / 2. The price: in bf16 the largest
    |w| / s can fall to 126.5, so a row's top value may land on 126 rather than 127."""
    stored = scale.to(dtype)
    up = torch.nextafter(stored, torch.tensor(math.inf, dtype=dtype, device=scale.device))
    return torch.where(stored.float() < scale, up, stored)


def quantize_int8(w):
    """w (N, K) float -> qweight (N, K) int8 in -127..127, scales (N,) in w's dtype, per output
    row, symmetric: w[n, k] ~= qweight[n, k] * scales[n], within scales[n] / 2. A row of zeros
    gets scale 1. (-128 is never used, so that -q always exists.)"""
    _check_weight("quantize_int8", w)
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)  # (N,)
    scale = _stored_scale(torch.where(amax > 0, amax / 127, 1.0), w.dtype)
    q = torch.round(wf / scale.float()[:, None]).clamp(-127, 127)
    return q.to(torch.int8), scale


def dequantize_int8(qweight, scales):
    """qweight (N, K) int8, scales (N,) (a row's) or (N, K // G) (a group's) -> w_hat (N, K)
    float32."""
    N, K = qweight.shape
    s = scales.float().reshape(N, -1)  # (N, groups)
    return (qweight.float().reshape(N, s.shape[1], -1) * s[..., None]).reshape(N, K)


def pack_int4(q):
    """q (N, K) integer values 0..15, K a multiple of 8 -> (N, K // 8) int32: column 8i + j in
    bits 4j .. 4j + 3 of word i (see the worked example above)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype.is_floating_point \
            or q.dtype.is_complex or q.dtype == torch.bool:
        raise TypeError(f"pack_int4: q must be a 2-D integer tensor, got "
                        f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    N, K = q.shape
    if K % 8:
        raise ValueError(f"pack_int4: K = {K} columns is not a multiple of 8 (8 nibbles a word)")
    if q.numel() and (q.min() < 0 or q.max() > 15):
        raise ValueError(f"pack_int4: values must lie in 0..15, got "
                         f"{q.min().item()}..{q.max().item()}")
    shifts = torch.tensor(_NIBBLE_SHIFTS, device=q.device)
    words = (q.to(torch.int64).reshape(N, K // 8, 8) << shifts).sum(-1)  # (N, K/8) in 0..2^32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # same bits, as int32


def unpack_int4(qweight):
    """qweight (N, K // 8) int32 -> q (N, K) int32 in 0..15, pack_int4's inverse."""
    if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise TypeError("unpack_int4: qweight must be a 2-D int32 tensor")
    shifts = torch.tensor(_NIBBLE_SHIFTS, dtype=torch.int32, device=qweight.device)
    return ((qweight[:, :, None] >> shifts) & 0xF).reshape(qweight.shape[0], -1)  # (N, K)


def quantize_int4(w, group_size=128, symmetric=False):
    """w (N, K) float -> (qweight (N, K // 8) int32, scales (N, K // G), zeros (N, K // G)), the
    scales and zeros in w's dtype (the zeros whole numbers 0..15), RTN over groups of G columns:
    w[n, k] ~= (q[n, k] - zeros[n, k // G]) * scales[n, k // G], within that scale / 2."""
    _check_weight("quantize_int4", w)
    N, K = w.shape
    _check_group_size(group_size, K)
    wg = w.detach().float().reshape(N, K // group_size, group_size)  # (N, groups, G)
    if symmetric:
        scale = wg.abs().amax(-1) / 7
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)  # 0 inside every range
        scale = (hi - lo) / 15
    scale = _stored_scale(torch.where(scale > 0, scale, 1.0), w.dtype).float()  # (N, groups)
    zero = torch.full_like(scale, 8.0) if symmetric else torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(wg / scale[..., None]) + zero[..., None]).clamp(0, 15)  # (N, groups, G)
    return pack_int4(q.reshape(N, K).to(torch.int32)), scale.to(w.dtype), zero.to(w.dtype)


def dequantize_int4(qweight, scales, zeros, group_size):
    """The int4 weight as float32 (N, K): (q - zeros) * scales, a group's scale and zero for each
    of its G columns. Rounds as the kernels do: q - z is exact, then one fp32 product."""
    N, K = _int4_shapes("dequantize_int4", qweight, scales, zeros, group_size)
    q = unpack_int4(qweight).float().reshape(N, K // group_size, group_size)
    return ((q - zeros.float()[..., None]) * scales.float()[..., None]).reshape(N, K)


# ------------------------------------------------------------------------------------------------
# 20.2 Dequantizing in registers
# ------------------------------------------------------------------------------------------------
# Every kernel below gets its weights from _dequant_tile, as fp32 tiles shaped (BLOCK_N,
# BLOCK_K // 8, 8): word i of each row, then its 8 columns 8i + j. For int4 this shape is the
# packed layout itself: each int32 word is loaded once and shifted eight ways in registers, and
# its group's scale and zero are loaded once a word (G % 8 == 0: no word straddles two groups).
# The trick: an int -> float conversion (I2F) runs at a fraction of the FMA rate, and a kernel that
# must keep up with HBM at 4 bits a weight has ~5 ALU operations a weight to spend. But a small
# integer q written into the low mantissa bits of the float 2^23 (bits 0x4B000000) *is* the float
# 2^23 + q: an OR and a subtraction convert it, and the zero point folds into that same
# subtraction, (2^23 + q) - (2^23 + z) = q - z, exactly. int8 adds 128 first, to be non-negative.

@triton.jit
def _dequant_tile(W, S, Z, offs_n, k0, N, K, G: tl.constexpr, BITS: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    # W[offs_n, k0 : k0 + BLOCK_K] as fp32, (BLOCK_N, BLOCK_K // 8, 8); 0 past N and past K.
    # BITS 4: W (N, K // 8) int32, S and Z (N, K // G); BITS 8: W (N, K) int8, S (N, K // G)
    # (G = K: a scale a row), Z unused.
    rows = offs_n[:, None].to(tl.int64)  # (BN, 1)
    words = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # word i holds columns 8i .. 8i + 7
    mask = (offs_n < N)[:, None] & (words < K // 8)[None, :]  # (BN, BK/8)
    group = rows * (K // G) + (words * 8 // G)[None, :]  # (BN, BK/8): each word's group
    s = tl.load(S + group, mask=mask, other=0.0).to(tl.float32)
    if BITS == 4:
        packed = tl.load(W + rows * (K // 8) + words[None, :], mask=mask, other=0)  # (BN, BK/8)
        z = tl.load(Z + group, mask=mask, other=0.0).to(tl.float32)
        q = (packed[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 0xF  # (BN, BK/8, 8)
        q = (q | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + q
        return (q - (8388608.0 + z)[:, :, None]) * s[:, :, None]
    else:
        cols = words[:, None] * 8 + tl.arange(0, 8)[None, :]  # (BK/8, 8)
        q = tl.load(W + rows[:, :, None] * K + cols[None, :, :], mask=mask[:, :, None], other=0)
        q = (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True)  # 2^23 + 128 + q
        return (q - 8388736.0) * s[:, :, None]


# ------------------------------------------------------------------------------------------------
# 20.3 Decode: a split-K matrix-vector kernel
# ------------------------------------------------------------------------------------------------
# At M tokens a projection does 2*M*N*K FLOPs and reads N*K/2 bytes of int4 weights plus 4*N*K/G
# of bf16 scales and zeros. At M <= 16 that is at most 60 FLOPs a byte, far below an H100's ~300
# (990 TFLOP/s over 3.35 TB/s): time is bytes over bandwidth. Qwen3-8B's gate_proj (12288 x
# 4096) is 27 MB in int4, 8 us at 3.35 TB/s, against 101 MB and 30 us in bf16; the aim is >= 80%
# of the copy bandwidth on those bytes. Two things stand between a kernel and that:
# - Enough programs. q_proj (4096 x 4096) in 64-row tiles is 64 programs for 132 SMs, and an idle
#   SM pulls no bytes. So the kernel also cuts K into slices (split-K; matvec_splits picks how
#   many, about 4 programs an SM). Each slice writes fp32 partial sums, and a second small kernel
#   adds them in a fixed order: the same result every run, which atomics would not give.
# - Cheap arithmetic. One token: 2 FLOPs a weight fit the CUDA cores, and the MMA, whose smallest
#   tile has 16 rows, would waste 15 of them. 2..16 tokens: 2M FLOPs a weight would make the CUDA
#   cores the limit, so the tile goes to tl.dot, transposed: y^T = W x^T, the weight tile on the
#   MMA's M side (64 rows, what a Hopper warpgroup MMA takes), the tokens, padded to 16, on N.
# Each packed word, scale and zero is loaded once per program; x, 2 bytes a value, comes from L2.
# With programmatic dependent launch (PDL, 07's _wait_for_inputs) a kernel starts while the one
# before ends, and waits only before its first load. (07's matvec also loads its first weight tile
# before that wait, the weights being no earlier kernel's output; here that tile would have to be
# peeled off the K loop, a refinement for the bench to justify.)

MATVEC_MAX_ROWS = 16  # the decode kernel's most rows (tokens); the layers' switch to the matmul
_MATVEC_BLOCK_N = 32 if INTERPRET else 64  # weight rows a program (fixed: matvec_splits uses it)
_K_ALIGN = 64 if INTERPRET else 256  # K slices are whole multiples of this: of every BLOCK_K below
_WQ_MATVEC_CONFIGS = [triton.Config({"BLOCK_K": k}, num_warps=w, num_stages=s)
                      for k, w, s in ((64, 4, 4), (128, 4, 3), (128, 8, 3), (256, 8, 2))]
if INTERPRET:
    _WQ_MATVEC_CONFIGS = [triton.Config({"BLOCK_K": 64}, num_warps=4)]


@triton.autotune(configs=_WQ_MATVEC_CONFIGS, key=["N", "K", "K_SPLIT", "G", "BITS", "ONE_ROW"])
@triton.jit
def _wq_matvec_kernel(X, W, S, Z, OUT, M, N, K, K_SPLIT, G: tl.constexpr, BITS: tl.constexpr,
                      ONE_ROW: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (pid_n, split): OUT[split, :, rows] = x[:, slice] @ W[rows, slice]^T, x (M, K),
    # M <= 16, the slice K_SPLIT columns (a multiple of BLOCK_K). OUT is y (M, N) itself when
    # there is one slice, else fp32 partial sums (splits, M, N). ONE_ROW: M == 1, CUDA cores.
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    out = OUT + split.to(tl.int64) * M * N
    _wait_for_inputs(PDL)
    if ONE_ROW:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 8), tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w = _dequant_tile(W, S, Z, offs_n, k0, N, K, G, BITS, BLOCK_K)  # (BN, BK/8, 8)
            cols = k0 + 8 * tl.arange(0, BLOCK_K // 8)[:, None] + tl.arange(0, 8)[None, :]
            x = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)  # (BK/8, 8)
            acc += tl.sum(w * x[None, :, :], 2)
        tl.store(out + offs_n, tl.sum(acc, 1).to(OUT.dtype.element_ty), mask=offs_n < N)
    else:
        offs_m = tl.arange(0, 16)  # the tokens, padded to tl.dot's smallest side
        acc = tl.zeros((BLOCK_N, 16), tl.float32)  # y^T
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w = tl.reshape(_dequant_tile(W, S, Z, offs_n, k0, N, K, G, BITS, BLOCK_K),
                           (BLOCK_N, BLOCK_K))  # column 8i + j from word i, nibble j
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + offs_m[:, None] * K + cols[None, :],
                        mask=(offs_m < M)[:, None] & (cols < K)[None, :], other=0.0)  # (16, BK)
            if _INTERPRET:
                x = x.to(tl.float32)  # the interpreter multiplies bf16 tiles by their raw bits
            else:
                w = w.to(X.dtype.element_ty)  # the MMA's input type, as F.linear rounds W
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)  # (BN, 16)
        tl.store(out + offs_m[None, :] * N + offs_n[:, None], acc.to(OUT.dtype.element_ty),
                 mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])


@triton.jit
def _sum_splits_kernel(P, Y, size, SPLITS: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    # Y (size,) = the sum over s of P[s] (SPLITS, size) fp32, in order s = 0, 1, ...
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _wait_for_inputs(PDL)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(P + s * size + offs, mask=offs < size, other=0.0)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=offs < size)


def matvec_splits(N, K, n_sms):
    """How many K slices the decode kernel cuts: doubling until the grid holds about 4 programs
    an SM (loads enough in flight to keep HBM busy), while each slice keeps at least two of the
    widest K tiles (a slice's loop start costs as much as a tile)."""
    tiles, splits = triton.cdiv(N, _MATVEC_BLOCK_N), 1
    while tiles * splits < 4 * n_sms and K >= 2 * splits * 2 * _K_ALIGN:
        splits *= 2
    return splits


def _launch_matvec(x, qweight, scales, zeros, group_size, bits, N, K, split_k):
    M = x.shape[0]
    splits = matvec_splits(N, K, _num_sms(x.device)) if split_k is None else split_k
    k_split = triton.cdiv(triton.cdiv(K, splits), _K_ALIGN) * _K_ALIGN  # whole K tiles a slice
    splits = triton.cdiv(K, k_split)  # (rounding the slices up can leave fewer of them)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    out = y if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    pdl = _pdl(x.device)
    _wq_matvec_kernel[(triton.cdiv(N, _MATVEC_BLOCK_N), splits)](
        x, qweight, scales, zeros, out, M, N, K, k_split, G=group_size, BITS=bits,
        ONE_ROW=M == 1, DOT_PRECISION=_dot_precision(x.dtype), PDL=pdl,
        BLOCK_N=_MATVEC_BLOCK_N, launch_pdl=pdl)
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, 1024),)](out, y, M * N, SPLITS=splits, PDL=pdl,
                                                        BLOCK=1024, launch_pdl=pdl)
    return y


def int4_matvec(x, qweight, scales, zeros, group_size, split_k=None):
    """y (M, N) = x (M, K) @ W^T in x's dtype for M <= 16 rows (decode), W the int4 weight
    (20.1's layout) dequantized in registers, fp32 sums. split_k: how many K slices
    (None: matvec_splits' choice; fewer when K has too few tiles to cut)."""
    N, K = _check_quantized("int4_matvec", x, qweight, scales, zeros, group_size, split_k,
                            most_rows=MATVEC_MAX_ROWS)
    return _launch_matvec(x, qweight, scales, zeros, group_size, 4, N, K, split_k)


def int8_matvec(x, qweight, scales, split_k=None):
    """y (M, N) = x (M, K) @ W^T for M <= 16 rows, W (N, K) int8 times scales (N,) per row or
    (N, K // G) per group."""
    N, K = _check_quantized("int8_matvec", x, qweight, scales, None, None, split_k,
                            most_rows=MATVEC_MAX_ROWS)
    return _launch_matvec(x, qweight, scales, scales, K // _groups(scales), 8, N, K, split_k)


# ------------------------------------------------------------------------------------------------
# 20.4 Prefill: dequantized tiles into tl.dot
# ------------------------------------------------------------------------------------------------
# At M = 4096 tokens a projection does 8192 FLOPs a weight: compute-bound, so small weights save
# nothing and the kernel's job is to stay close to cuBLAS in bf16 (the aim: >= 0.7x). It is the
# Triton tutorial's tiled matmul (GROUP_M row tiles walk the column tiles together, so the tiles
# they share stay in L2) with one change: the weight tile is dequantized in registers, rounded to
# x's dtype and handed to tl.dot, which sums in fp32. Every row tile repeats the dequantization of
# its weight tiles, M / BLOCK_M times in all: ~5 ALU operations a weight each time, on units ~30x
# slower than the tensor cores, which is why the tiles are tall (128 to 256 rows). The plain
# alternative sets the bar: dequantize the whole matrix once (2.5 bytes a weight moved: 13 us for
# 4096 x 4096) and call cuBLAS (~170 us at M = 4096).

_MATMUL_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8},
                                 num_warps=w, num_stages=s)
                   for m, n, k, w, s in ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                                         (256, 128, 64, 8, 3), (128, 128, 128, 8, 3),
                                         (64, 128, 128, 4, 4))]
if INTERPRET:
    _MATMUL_CONFIGS = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2},
                                     num_warps=4)]


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # program -> (row tile, column tile), GROUP_M row tiles at a time along the column tiles
    tiles_n = tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * tiles_n) * GROUP_M
    rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    in_group = pid % (GROUP_M * tiles_n)
    return first_m + in_group % rows, in_group // rows


@triton.autotune(configs=_MATMUL_CONFIGS, key=["M_BUCKET", "N", "K", "G", "BITS"])
@triton.jit
def _wq_matmul_kernel(X, W, S, Z, Y, M, N, K, M_BUCKET, G: tl.constexpr, BITS: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Y (M, N) = X (M, K) @ dequant(W)^T, one (BLOCK_M, BLOCK_N) tile a program. M_BUCKET: an
    # autotune key only (M rounded up to a power of two), so prompts of every length tune once.
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + offs_m[:, None].to(tl.int64) * K + cols[None, :],
                    mask=(offs_m < M)[:, None] & (cols < K)[None, :], other=0.0)  # (BM, BK)
        w = tl.reshape(_dequant_tile(W, S, Z, offs_n, k0, N, K, G, BITS, BLOCK_K),
                       (BLOCK_N, BLOCK_K))
        if _INTERPRET:
            x = x.to(tl.float32)  # see _wq_matvec_kernel
        else:
            w = w.to(X.dtype.element_ty)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    tl.store(Y + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def _tile_grid(M, N):
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)


def _launch_matmul(x, qweight, scales, zeros, group_size, bits, N, K):
    M = x.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _wq_matmul_kernel[_tile_grid(M, N)](x, qweight, scales, zeros, y, M, N, K,
                                        triton.next_power_of_2(M), G=group_size, BITS=bits,
                                        DOT_PRECISION=_dot_precision(x.dtype))
    return y


def int4_matmul(x, qweight, scales, zeros, group_size):
    """y (M, N) = x (M, K) @ W^T in x's dtype, any M (prefill), W the int4 weight."""
    N, K = _check_quantized("int4_matmul", x, qweight, scales, zeros, group_size, None)
    return _launch_matmul(x, qweight, scales, zeros, group_size, 4, N, K)


def int8_matmul(x, qweight, scales):
    """y (M, N) = x (M, K) @ W^T, any M, W (N, K) int8 times scales (N,) or (N, K // G)."""
    N, K = _check_quantized("int8_matmul", x, qweight, scales, None, None, None)
    return _launch_matmul(x, qweight, scales, scales, K // _groups(scales), 8, N, K)


# ------------------------------------------------------------------------------------------------
# 20.5 W8A8: int8 activations times int8 weights
# ------------------------------------------------------------------------------------------------
# SmoothQuant's scheme: x is quantized per token at run time (s_x[t] = max|x[t, :]| / 127), W per
# output row (quantize_int8), and y[t, n] = s_x[t] * s_w[n] * sum_k qx[t, k] qw[n, k]. The sum
# runs on the int8 tensor cores (twice the bf16 rate) and is exact in int32: |sum| <= K * 127^2
# < 2^31 for K < 133,000. Only the product's end is floating point: one int32 -> fp32 conversion
# and two scalings a result.
# quantize_per_token is a kernel, not torch ops: torch's abs, amax, divide, round, clamp and cast
# pass over x five times or more (at M = K = 4096, 32 MB of bf16 a pass, ~10 us each on an H100,
# against ~90 us for the int8 product); the kernel reads x once and writes 1 byte a value. A row
# a program, in registers (Qwen3's widest input, 12,288 values, fits), as 07's rms_norm.
# Rounding: x / s is at most 127 in size, and adding then subtracting 1.5 * 2^23 rounds it to the
# nearest integer, ties to even, as torch.round does (the float's mantissa has no bits left for
# the fraction); the divisions are correctly rounded (div_rn), as torch's are, so the kernel and
# quantize_per_token_torch agree bit for bit.

_W8A8_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8},
                               num_warps=w, num_stages=s)
                 for m, n, k, w, s in ((128, 128, 128, 8, 3), (128, 256, 128, 8, 3),
                                       (64, 128, 128, 4, 4), (16, 64, 256, 4, 4))]
if INTERPRET:
    _W8A8_CONFIGS = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2},
                                   num_warps=4)]


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, BLOCK_K: tl.constexpr):
    # Q[row] (K,) int8 = round(X[row] / s), s = max|X[row]| / 127 (1 for a row of zeros) -> S[row]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x = tl.load(X + row * K + cols, mask=cols < K, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.max(tl.abs(x), 0), 127.0)
    scale = tl.where(scale > 0, scale, 1.0)
    q = (tl.math.div_rn(x, scale) + 12582912.0) - 12582912.0  # 1.5 * 2^23: round, ties to even
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(Q + row * K + cols, q.to(tl.int8), mask=cols < K)
    tl.store(S + row, scale)


def quantize_per_token(x):
    """x (M, K) float -> (x_int8 (M, K) int8 in -127..127, scales (M,) float32), symmetric per
    row (token): x ~= x_int8 * scales[:, None], within scales / 2."""
    _check_tensor("x", x)
    if x.dim() != 2:
        raise ValueError(f"quantize_per_token: x must be (M, K), got {tuple(x.shape)}")
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.int8, device=x.device)
    scales = torch.empty(M, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(K)
    _quantize_rows_kernel[(M,)](x, q, scales, K, BLOCK_K=block,
                                num_warps=min(16, max(1, block // 256)))
    return q, scales


def quantize_per_token_torch(x):
    """quantize_per_token in torch ops, the twin that runs everywhere (x (..., K))."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127
    scale = torch.where(scale > 0, scale, 1.0)
    return torch.round(xf / scale[..., None]).clamp(-127, 127).to(torch.int8), scale


@triton.autotune(configs=_W8A8_CONFIGS, key=["M_BUCKET", "N", "K"])
@triton.jit
def _w8a8_matmul_kernel(XQ, SX, WQ, SW, Y, M, N, K, M_BUCKET, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Y (M, N) = (XQ (M, K) @ WQ (N, K)^T in int32) * SX[:, None] * SW[None, :]
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(XQ + offs_m[:, None].to(tl.int64) * K + cols[None, :],
                    mask=(offs_m < M)[:, None] & (cols < K)[None, :], other=0)
        b = tl.load(WQ + offs_n[:, None].to(tl.int64) * K + cols[None, :],
                    mask=(offs_n < N)[:, None] & (cols < K)[None, :], other=0)
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
    sx = tl.load(SX + offs_m, mask=offs_m < M, other=0.0)
    sw = tl.load(SW + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    y = acc.to(tl.float32) * sx[:, None] * sw[None, :]
    tl.store(Y + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], y.to(Y.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def int8_w8a8_matmul(x_int8, x_scales, qweight, w_scales, dtype):
    """y (M, N) in dtype = (x_int8 (M, K) @ qweight (N, K)^T, summed exactly in int32)
    * x_scales (M,) float32 per row * w_scales (N,) per column."""
    _check_tensor("x_int8", x_int8, dtypes=(torch.int8,))
    dev = x_int8.device
    _check_tensor("x_scales", x_scales, dtypes=(torch.float32,), device=dev)
    _check_tensor("qweight", qweight, dtypes=(torch.int8,), device=dev)
    _check_tensor("w_scales", w_scales, device=dev)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"int8_w8a8_matmul: dtype {dtype} is not one of {_FLOAT_DTYPES}")
    if (x_int8.dim() != 2 or qweight.dim() != 2 or x_int8.shape[1] != qweight.shape[1]
            or x_scales.shape != x_int8.shape[:1] or w_scales.shape != qweight.shape[:1]):
        raise ValueError(f"int8_w8a8_matmul: x_int8 {tuple(x_int8.shape)}, x_scales "
                         f"{tuple(x_scales.shape)}, qweight {tuple(qweight.shape)} and w_scales "
                         f"{tuple(w_scales.shape)} do not fit ((M, K), (M,), (N, K), (N,))")
    (M, K), N = x_int8.shape, qweight.shape[0]
    y = torch.empty(M, N, dtype=dtype, device=dev)
    _w8a8_matmul_kernel[_tile_grid(M, N)](x_int8, x_scales, qweight, w_scales, y, M, N, K,
                                          triton.next_power_of_2(M))
    return y


# ------------------------------------------------------------------------------------------------
# 20.6 The twin layers, and quantizing a model
# ------------------------------------------------------------------------------------------------
# Each nn.Linear of a block gives way to a twin with the same call: the model's text does not
# change (05's twin classes). The quantized tensors are buffers, so .to(device) moves them and
# .to(dtype) casts only the float ones (scales, zeros). As in 07, `kernels` (set by
# Qwen3.use_kernels) picks the Triton kernels, on CUDA or under the interpreter; off, the torch
# twin dequantizes the whole weight and calls F.linear, which is slow and simple, the reference.
# With the kernels, up to MATVEC_MAX_ROWS tokens take the split-K matvec, more the matmul: the
# matvec is built for 1..16 rows and the matmul for many, and where between them the matmul
# starts to win is a number for the bench to measure (16 is the matvec's limit, not a result).
# Act-order (GPTQ's desc_act, chapter 39): perm (K,) int64 says the stored columns are W[:, perm],
# groups contiguous in that order; the kernels then read x[..., perm] to match them.

class _QuantizedLinear(nn.Module):
    """What the weight-only twins share: the forward pass, its choice of kernel, act-order."""

    def __init__(self, in_features, out_features, perm):
        super().__init__()
        if perm is not None and (
                not isinstance(perm, torch.Tensor) or perm.dtype != torch.int64
                or perm.shape != (in_features,) or not torch.equal(
                    perm.sort().values, torch.arange(in_features, device=perm.device))):
            raise ValueError(f"{type(self).__name__}: perm must be a permutation of "
                             f"0..{in_features - 1}, a ({in_features},) int64 tensor")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("perm", perm)  # (K,) int64, or None (then not in the state dict)
        self.kernels = False  # set by Qwen3.use_kernels (or quantize_model, from the model's)

    def forward(self, x):  # x (..., K) -> (..., N)
        rows = self._rows(x)  # (M, K)
        if not self.kernels:
            return F.linear(x, self.dequantize().to(x.dtype))
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)  # the stored columns' order
        rows = rows.contiguous()
        y = self._matvec(rows) if rows.shape[0] <= MATVEC_MAX_ROWS else self._matmul(rows)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantize(self):
        """The weight the layer computes with, W_hat (N, K) float32, its columns in the input's
        order (act-order's permutation undone): stored column i is column perm[i]."""
        w = self._stored()
        return w if self.perm is None else w[:, torch.argsort(self.perm)]

    @classmethod
    def from_linear(cls, linear):
        """The twin of an nn.Linear (no bias), rounded to nearest: each format its own."""
        raise NotImplementedError

    # each format's own: the weight as stored, (N, K) float32 in the stored columns' order, and
    # the kernels that read it, x (M, K) -> (M, N): the matvec for M <= MATVEC_MAX_ROWS
    def _stored(self):
        raise NotImplementedError

    def _matvec(self, x):
        raise NotImplementedError

    def _matmul(self, x):
        raise NotImplementedError

    def _rows(self, x):
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__}: x has {x.shape[-1]} features, expected "
                             f"{self.in_features}")
        return x.reshape(-1, self.in_features)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"act_order={self.perm is not None}")


class Int8Linear(_QuantizedLinear):
    """nn.Linear (no bias) with int8 weights: qweight (N, K), scales (N,), a row's
    (quantize_int8), or (N, K // G), a group's (8-bit GPTQ files)."""

    def __init__(self, qweight, scales, perm=None):
        N, K = _int8_shapes("Int8Linear", qweight, scales)
        super().__init__(K, N, perm)
        self.register_buffer("qweight", qweight)  # (N, K) int8
        self.register_buffer("scales", scales)  # (N,) or (N, K // G)

    @classmethod
    def from_linear(cls, linear):
        return cls(*quantize_int8(_linear_weight(linear)))

    def _stored(self):
        return dequantize_int8(self.qweight, self.scales)

    def _matvec(self, x):
        return int8_matvec(x, self.qweight, self.scales)

    def _matmul(self, x):
        return int8_matmul(x, self.qweight, self.scales)


class Int4Linear(_QuantizedLinear):
    """nn.Linear (no bias) with int4 weights in groups of group_size columns (20.1's layout)."""

    def __init__(self, qweight, scales, zeros, group_size, perm=None):
        N, K = _int4_shapes("Int4Linear", qweight, scales, zeros, group_size)
        super().__init__(K, N, perm)
        self.group_size = group_size
        self.register_buffer("qweight", qweight)  # (N, K // 8) int32
        self.register_buffer("scales", scales)  # (N, K // G)
        self.register_buffer("zeros", zeros)  # (N, K // G)

    @classmethod
    def from_linear(cls, linear, group_size=128, symmetric=False):
        return cls(*quantize_int4(_linear_weight(linear), group_size, symmetric), group_size)

    @classmethod
    def from_quantized(cls, qweight, scales, zeros, group_size, perm=None):
        """From tensors already quantized elsewhere (GPTQ, or a checkpoint's, chapter 39)."""
        return cls(qweight, scales, zeros, group_size, perm)

    def _stored(self):
        return dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size)

    def _matvec(self, x):
        return int4_matvec(x, self.qweight, self.scales, self.zeros, self.group_size)

    def _matmul(self, x):
        return int4_matmul(x, self.qweight, self.scales, self.zeros, self.group_size)

    def extra_repr(self):
        return f"{super().extra_repr()}, group_size={self.group_size}"


class W8A8Linear(Int8Linear):
    """Int8Linear's weights (a scale a row), and activations quantized per token at run time: an
    int8 x int8 product summed in int32, rescaled by s_x[t] * s_w[n] (SmoothQuant's W8A8)."""

    def __init__(self, qweight, scales):
        if not isinstance(scales, torch.Tensor) or scales.dim() != 1:
            raise ValueError("W8A8Linear: scales must be (N,), a scale per row: the product's "
                             "epilogue scales whole rows")
        super().__init__(qweight, scales)

    def forward(self, x):  # x (..., K) -> (..., N)
        rows = self._rows(x)  # (M, K)
        if self.kernels:
            y = int8_w8a8_matmul(*quantize_per_token(rows.contiguous()), self.qweight,
                                 self.scales, x.dtype)
        else:
            x_int8, x_scales = quantize_per_token_torch(rows)
            acc = (x_int8.double() @ self.qweight.double().T).float()  # exact integers, as int32's
            y = (acc * x_scales[:, None] * self.scales.float()).to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)


def quantize_model(model, method="int4", group_size=128, symmetric=False):
    """Replace every nn.Linear inside the model's blocks (model.model.layers) by its quantized
    twin, in place, rounding to nearest: method "int8" (Int8Linear), "int4" (Int4Linear,
    group_size and symmetric as in quantize_int4) or "w8a8" (W8A8Linear). The embedding and the
    output layer stay as they are. The twins take the model's choice of kernels. Returns the
    model."""
    builders = {"int8": Int8Linear.from_linear, "w8a8": W8A8Linear.from_linear,
                "int4": functools.partial(Int4Linear.from_linear, group_size=group_size,
                                          symmetric=symmetric)}
    if method not in builders:
        raise ValueError(f"quantize_model: method {method!r} is not one of {sorted(builders)}")
    if method == "int4":
        _check_group_size(group_size)
    return replace_block_linears(model, builders[method], "quantize_model")


def replace_block_linears(model, build, fn):
    """Replace every nn.Linear inside the model's blocks by build(linear), in place, each twin
    taking the model's choice of kernels; an error names the layer (and fn, the caller).
    Returns the model."""
    for i, block in enumerate(model.model.layers):
        for name, module in list(block.named_modules()):
            if type(module) is not nn.Linear:  # exactly nn.Linear: not a twin already
                continue
            try:
                replace_linear(block, name, build(module), model.kernels)
            except (TypeError, ValueError) as err:
                raise ValueError(f"{fn}: model.layers.{i}.{name}: {err}") from err
    return model


def replace_linear(parent, name, twin, kernels):
    """Put `twin` where parent's submodule `name` (e.g. "mlp.up_proj") is, kernels on or off."""
    twin.kernels = kernels
    owner, _, child = name.rpartition(".")
    setattr(parent.get_submodule(owner), child, twin)


def layer_errors(model_fp, model_q, input_ids, folds=None):
    """{name: ||x W^T - x W_hat^T|| / ||x W^T||} for each quantized layer of model_q, where x is
    what the same layer of the float model model_fp receives on input_ids. Every layer sees the
    float model's activations, so errors do not compound: each row is one layer's own doing.
    folds: {name: (s_in (K,) or None, s_out (N,) or None)}, the scales AWQ and SmoothQuant fold
    into a layer's input (it receives x / s_in) and rows (it returns y / s_out): its error is
    measured on x / s_in and scaled back, in the float model's terms."""
    quantized = {name: m for name, m in model_q.named_modules() if isinstance(m, _QuantizedLinear)}
    floats, folds = dict(model_fp.named_modules()), folds or {}
    missing = sorted(set(quantized) - set(floats))
    if missing:
        raise ValueError(f"layer_errors: model_fp has no layers named {missing}")
    errors = {}

    def measure(name):
        def hook(module, inputs, output):
            x, (s_in, s_out) = inputs[0], folds.get(name, (None, None))
            y = quantized[name](x if s_in is None else x / s_in.to(x.dtype)).double()
            wrong = (y if s_out is None else y * s_out.double()) - output.double()
            errors[name] = (wrong.norm() / output.double().norm()).item()
        return hook

    hooks = [floats[name].register_forward_hook(measure(name)) for name in quantized]
    try:
        with torch.no_grad():
            model_fp(input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return errors


# ------------------------------------------------------------------------------------------------
# 20.7 Input checks
# ------------------------------------------------------------------------------------------------

def _check_weight(fn, w):
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{fn}: w must be a 2-D float32, float16 or bfloat16 tensor, got "
                        f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    if w.numel() == 0 or not torch.isfinite(w).all():
        raise ValueError(f"{fn}: w must be non-empty and finite")


def _check_group_size(group_size, K=None):
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 8 \
            or group_size % 8:
        raise ValueError(f"group_size must be a positive multiple of 8 (a packed word's 8 columns "
                         f"share a group), got {group_size!r}")
    if K is not None and K % group_size:
        raise ValueError(f"K = {K} columns is not a multiple of group_size = {group_size}")


def _groups(scales):
    """How many groups a row of an int8 weight has: 1 for scales (N,)."""
    return scales.shape[1] if scales.dim() == 2 else 1


def _int8_shapes(fn, qweight, scales):
    """(N, K) of an int8 weight: qweight (N, K) int8, scales (N,) or (N, K // G) float, G a
    multiple of 8 (the kernels read 8 columns a step)."""
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"{fn}: qweight must be an (N, K) int8 tensor")
    N, K = qweight.shape
    if (not isinstance(scales, torch.Tensor) or scales.dtype not in _FLOAT_DTYPES
            or scales.dim() not in (1, 2) or scales.shape[0] != N or K % _groups(scales)):
        raise ValueError(f"{fn}: scales must be float, (N,) = ({N},) or (N, K // G), for qweight "
                         f"{tuple(qweight.shape)}; got {getattr(scales, 'dtype', None)} "
                         f"{tuple(getattr(scales, 'shape', ()))}")
    _check_group_size(K // _groups(scales), K)
    return N, K


def _int4_shapes(fn, qweight, scales, zeros, group_size):
    """(N, K) of an int4 weight whose three tensors fit 20.1's layout."""
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{fn}: {name} must be a 2-D tensor")
    if qweight.dtype != torch.int32:
        raise TypeError(f"{fn}: qweight has dtype {qweight.dtype}; expected torch.int32")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{fn}: {name} has dtype {t.dtype}; expected a float dtype")
    N, K = qweight.shape[0], qweight.shape[1] * 8
    _check_group_size(group_size, K)
    if scales.shape != (N, K // group_size) or zeros.shape != scales.shape:
        raise ValueError(f"{fn}: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} must "
                         f"be (N, K // group_size) = ({N}, {K // group_size})")
    return N, K


def _check_quantized(fn, x, qweight, scales, zeros, group_size, split_k, most_rows=None):
    """The kernels' checks: x (M, K), and an int4 (zeros given) or int8 weight; returns (N, K)."""
    _check_tensor("x", x)
    _check_tensor("qweight", qweight, dtypes=(torch.int8 if zeros is None else torch.int32,),
                  device=x.device)
    _check_tensor("scales", scales, device=x.device)
    if zeros is None:
        N, K = _int8_shapes(fn, qweight, scales)
    else:
        _check_tensor("zeros", zeros, device=x.device)
        N, K = _int4_shapes(fn, qweight, scales, zeros, group_size)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"{fn}: x {tuple(x.shape)} does not fit a weight of K = {K} columns "
                         f"(x must be (M, K))")
    if most_rows is not None and x.shape[0] > most_rows:
        raise ValueError(f"{fn}: x has {x.shape[0]} rows; at most {most_rows} (use the matmul)")
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int)
                                or split_k < 1):
        raise ValueError(f"{fn}: split_k must be a positive int or None, got {split_k!r}")
    return N, K


def _linear_weight(linear):
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"expected an nn.Linear, got {type(linear).__name__}")
    if linear.bias is not None:
        raise ValueError("a quantized twin has no bias (Qwen3's projections have none)")
    return linear.weight


# ----------------------------------------------------------------------------------------------
# Chapter 20, continued. Calibration: what the linears of a model see
# ----------------------------------------------------------------------------------------------
# NEW in stage 09. Round to nearest treats every weight alike. GPTQ, AWQ and SmoothQuant look at
# the inputs X of each linear on a few hundred calibration sequences, through forward hooks:
# GPTQ needs the Hessian of the layer-wise loss ||W X - W_hat X||^2, H = 2/n sum_t x_t x_t^T
# (K, K), which a hook accumulates as a running mean; AWQ needs X itself; SmoothQuant the largest
# |x| of each channel.
#
# Quantizing block i changes what block i+1 sees. So a model is quantized a block at a time, as
# GPTQ does: capture the inputs of block 0, calibrate and quantize its linears, run the block
# again, now on its quantized twins, and its outputs are block 1's calibration inputs. Later
# blocks then make up for the errors of earlier ones, and only one block's activations are held.
# GPTQ goes one step finer ("true sequential"): inside a block, o_proj is calibrated on what the
# quantized q, k, v produce, gate/up after o, and down after gate/up.

# A Qwen3 block's linears in the order data reaches them, each group with the op whose output it
# reads (o_proj reads attention's output, which mixes v_proj's rows channel by channel).
READING_ORDER = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)))
QWEN3_LINEARS = tuple(name for _, names in READING_ORDER for name in names)


def _hooked(module, names, on_input):
    """Forward hooks on module's submodules `names` that hand each one's input, flattened to
    (tokens, K), to on_input(name, x)."""
    def hook(name):
        def record(submodule, args, out):
            x = args[0].detach()
            on_input(name, x.reshape(-1, x.shape[-1]))
        return record
    return [module.get_submodule(name).register_forward_hook(hook(name)) for name in names]


@torch.no_grad()
def activation_absmax(model, batches):
    """{linear name: max |x| (K,) float32 of each input channel} for every linear of the blocks,
    over `batches` of ids (B, T): SmoothQuant's statistic, small enough for a real model."""
    seen = {}

    def record(name, x):
        x = x.float().abs().amax(0)
        seen[name] = torch.maximum(seen[name], x) if name in seen else x

    names = [f"model.layers.{i}.{name}" for i in range(len(model.model.layers))
             for name in QWEN3_LINEARS]
    hooks = _hooked(model, names, record)
    try:
        for ids in batches:
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


class _Stop(Exception):
    pass


@torch.no_grad()
def _block_inputs(model, batches):
    """The positional arguments (x, rope, cache, kv_len) that block 0 receives, one per batch: the
    model runs up to its first block and stops there."""
    captured = []

    def grab(module, args):
        captured.append(args)
        raise _Stop

    handle = model.model.layers[0].register_forward_pre_hook(grab)
    try:
        for ids in batches:
            try:
                model(ids)
            except _Stop:
                pass
    finally:
        handle.remove()
    return captured


@torch.no_grad()
def _run_block(block, inputs, names=(), on_input=None):
    """Run `block` on each (x, rope, ...) of inputs, on_input(name, x) seeing the input of each
    of its linears `names`; returns the arguments for the next block (its output in place of x)."""
    hooks = _hooked(block, names, on_input)
    try:
        return [(block(*args), *args[1:]) for args in inputs]
    finally:
        for h in hooks:
            h.remove()


def _blockwise(model, batches, quantize_block):
    """Quantize a model block by block: quantize_block(block, run) replaces the block's linears by
    their twins, where run(names, on_input) runs the block on its current calibration inputs (see
    _run_block); the block's quantized outputs feed the next block. quantize_block may return
    {name in block: value}; returns them all, {full module name: value}."""
    inputs, out = _block_inputs(model, batches), {}
    for i, block in enumerate(model.model.layers):
        done = quantize_block(block, functools.partial(_run_block, block, inputs)) or {}
        out.update({f"model.layers.{i}.{name}": value for name, value in done.items()})
        inputs = _run_block(block, inputs)
    return out


# ----------------------------------------------------------------------------------------------
# Chapter 20, continued. GPTQ (Frantar et al. 2022)
# ----------------------------------------------------------------------------------------------
# Quantize W one input column at a time and let the columns not yet quantized absorb the error.
# For the loss ||W X - W_hat X||^2 = tr(dW H dW^T), quantizing column k (error e = w_k - q_k)
# is best compensated by moving the remaining columns F by  -e * [H_F^-1]_kF / [H_F^-1]_kk
# (Optimal Brain Surgeon, row by row of W at once, since every row shares H). In a fixed column
# order the inverses of the shrinking H_F are all read off one matrix: the upper Cholesky factor
# U of H^-1 (H^-1 = U^T U) has row k equal to [H_F^-1]_kF / sqrt([H_F^-1]_kk), so
#     err = (w_k - q_k) / U[k, k],   W[:, k+1:] -= err (outer) U[k, k+1:].
# Lazy blocks: applying that rank-one update to all of W per column moves W through memory K
# times. Instead the update reaches only the columns of the current block of 128; the block's
# errors E (N, 128) reach the rest at once, W[:, end:] -= E @ U[block, end:], one matmul: the same
# arithmetic, compute-bound. Damping: H + lambda I, lambda = damp * mean(diag H), keeps the
# Cholesky stable. Dead columns (H_kk = 0: an input that was always 0) get H_kk = 1 and a zero
# weight. Act-order (desc_act): quantize the columns of largest H_kk (the loudest inputs) first,
# while many columns are still left to absorb their error; groups are then contiguous in that
# order, and the layer reads x[..., perm] (20.6).

def gptq_quantize(w, H, bits=4, group_size=128, damp=0.01, act_order=False, block=128,
                  symmetric=False):
    """GPTQ of one linear: w (N, K), H (K, K) = 2/n sum x x^T of its inputs -> its twin. bits=4:
    an Int4Linear, groups of group_size input columns (-1: one group a row), asymmetric or
    symmetric, act-order's perm when act_order. bits=8: an Int8Linear, a scale per output row
    (group_size must be -1; symmetric does not apply). Each group's scale and zero point are set
    when the group starts, from the weights as updated by then, on quantize_int4's (or
    quantize_int8's) grid: scales in w's dtype, so the twin computes with the scale GPTQ fitted."""
    N, K = w.shape
    G = K if group_size == -1 else group_size
    if bits not in (4, 8) or K % G or (bits == 4 and G % 8) or (bits == 8 and G != K):
        raise ValueError(f"gptq_quantize: bits={bits}, group_size={group_size} for K={K}: "
                         f"4 bits with groups dividing K (multiples of 8), or 8 bits per channel")
    W, H = w.detach().float().clone(), H.detach().float().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(H.diagonal(), descending=True, stable=True) if act_order else None
    if act_order:
        W, H = W[:, perm], H[perm][:, perm]
    H.diagonal().add_(damp * H.diagonal().mean())
    try:
        U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    except torch.linalg.LinAlgError:
        raise ValueError(f"gptq_quantize: H + {damp} * mean(diag H) is not positive definite; "
                         f"raise damp or calibrate on more tokens") from None
    # a group starts either at a block's start or wholly inside one: then its weights are final
    block = G * max(1, block // G) if G <= block else math.gcd(G, block)
    lo, hi = (0, 15) if bits == 4 else (-127, 127)
    Q = torch.empty(N, K, dtype=torch.int32, device=w.device)
    scales = torch.empty(N, K // G, dtype=w.dtype, device=w.device)
    zeros = torch.zeros_like(scales)  # int8: no zero point
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        Wb, E = W[:, b0:b1].clone(), torch.empty(N, b1 - b0, device=w.device)  # (N, block) each
        for j in range(b1 - b0):
            k = b0 + j
            if k % G == 0:  # a group starts: its grid from the weights as they are now
                src = (Wb[:, j:j + G] if G <= b1 - b0 else W[:, k:k + G]).to(w.dtype)  # (N, G)
                if bits == 4:
                    _, s, z = quantize_int4(src, G, symmetric)  # (N, 1) each
                    scales[:, k // G], zeros[:, k // G] = s[:, 0], z[:, 0]
                else:
                    scales[:, 0] = quantize_int8(src)[1]
            s, z = scales[:, k // G].float(), zeros[:, k // G].float()  # (N,) each
            q = (torch.round(Wb[:, j] / s) + z).clamp(lo, hi)
            Q[:, k] = q.int()
            err = (Wb[:, j] - (q - z) * s) / U[k, k]  # (N,)
            Wb[:, j + 1:] -= err[:, None] * U[k, k + 1:b1][None, :]  # within the block: at once
            E[:, j] = err
        W[:, b1:] -= E @ U[b0:b1, b1:]  # the rest of W: one matmul per block (lazy update)
    if bits == 8:  # per channel: no groups to keep contiguous, so back to the original order
        Q = Q if perm is None else Q[:, torch.argsort(perm)]
        return Int8Linear(Q.to(torch.int8), scales[:, 0].contiguous())
    return Int4Linear.from_quantized(pack_int4(Q), scales, zeros, G, perm)


def gptq_quantize_model(model, batches, bits=4, group_size=128, damp=0.01, act_order=False,
                        symmetric=False):
    """GPTQ of every linear in the blocks, a block at a time (see _blockwise), in place: each
    block's Hessians come from the outputs of the blocks before it, already quantized, and each
    group of linears' from the quantized linears before it in the block. Returns the model."""
    def quantize_block(block, run):
        for _, names in READING_ORDER:
            H, n = {}, {}

            def accumulate(name, x):  # running H = 2/n sum x x^T, in float32
                x, m = x.float(), x.shape[0]
                if name not in H:
                    H[name], n[name] = torch.zeros(x.shape[1], x.shape[1], device=x.device), 0
                H[name].mul_(n[name] / (n[name] + m)).addmm_(x.T, x, alpha=2 / (n[name] + m))
                n[name] += m

            run(names, accumulate)
            for name in names:
                twin = gptq_quantize(block.get_submodule(name).weight, H[name], bits, group_size,
                                     damp, act_order, symmetric=symmetric)
                replace_linear(block, name, twin, model.kernels)

    _blockwise(model, batches, quantize_block)
    return model


# ----------------------------------------------------------------------------------------------
# Chapter 20, continued. Where a scale can hide: folding per-channel scales into the op before
# ----------------------------------------------------------------------------------------------
# AWQ and SmoothQuant both rescale the input channels of a linear: W x = (W diag(s)) (x / s).
# The 1/s must come for free, so it is folded into whatever produced x (READING_ORDER):
#   q, k, v_proj  read input_layernorm:          its weight (C,) /= s
#   gate, up_proj read post_attention_layernorm:  its weight (C,) /= s
#   down_proj     reads silu(gate) * up:          up_proj's rows /= s (the product is linear in up)
#   o_proj        reads attention's output:       v_proj's rows /= s (the output mixes values
#                                                 linearly, per channel)
# (q_norm and k_norm act on q_proj's and k_proj's outputs, which do not change.) The last has a
# catch under GQA: o_proj's input channel h * D + d is value channel d of kv head h // G (G =
# Hq / Hkv query heads share a kv head), and v_proj has one row for all G of them. So the G
# channels that share a v row must share a scale: `tied` maps each channel of o_proj's input to
# its v row, and the statistics are pooled over the channels that share one.

def _gqa_tie(block):
    """(Hq * D,) int64: the v_proj row that each input channel of o_proj reads."""
    attn = block.self_attn
    D, device = attn.head_dim, attn.o_proj.weight.device
    Hq, Hkv = attn.o_proj.in_features // D, attn.v_proj.out_features // D
    heads = torch.arange(Hq, device=device) // (Hq // Hkv)  # query head h reads kv head h // G
    return (heads[:, None] * D + torch.arange(D, device=device)).flatten()


def _pool(v, tied, reduce):
    """v (K,) pooled ("mean" or "amax") over the channels that `tied` maps to one slot."""
    if tied is None:
        return v
    slots = torch.zeros(int(tied.max()) + 1, dtype=v.dtype, device=v.device)
    return slots.scatter_reduce(0, tied, v, reduce, include_self=False)[tied]


@torch.no_grad()
def fold_scales(prev, linears, s, tied=None):
    """Divide prev's output channels by s and multiply the linears' input columns by s (K,): the
    block computes the same function. prev: an RMSNorm (weight (C,)) or a Linear (rows). Returns
    the scale of each of prev's output channels (s itself, or s gathered back to v_proj's rows)."""
    s_prev = s if tied is None else s.new_empty(prev.weight.shape[0]).scatter_(0, tied, s)
    prev.weight.div_(s_prev.to(prev.weight.dtype).view(-1, *[1] * (prev.weight.dim() - 1)))
    for linear in linears:
        linear.weight.mul_(s.to(linear.weight.dtype))
    return s_prev


def _smooth_block(block, scales_of):
    """Fold scales into each group of READING_ORDER, in order: scales_of(names, w, tied)
    -> (s (K,), W diag(s) to keep or None), w (sum of N, K) the group's weights stacked; a kept
    W diag(s) (AWQ's, clipped) replaces the folded one, before a later group folds its scales
    into v_proj's or up_proj's rows. Returns {linear name: (s_in, s_out)}: the scale each
    linear's input was divided by and, for v_proj and up_proj, the one its rows were divided by
    (layer_errors' folds)."""
    s_in, s_out = {}, {}
    for prev, names in READING_ORDER:
        linears = [block.get_submodule(name) for name in names]
        tied = _gqa_tie(block) if prev == "self_attn.v_proj" else None
        s, kept = scales_of(names, torch.cat([linear.weight for linear in linears]), tied)
        s_prev = fold_scales(block.get_submodule(prev), linears, s, tied)
        if kept is not None:
            for linear, part in zip(linears, kept.split([m.out_features for m in linears])):
                linear.weight.copy_(part)
        s_in.update(dict.fromkeys(names, s))
        if prev in QWEN3_LINEARS:
            s_out[prev] = s_prev
    return {name: (s_in[name], s_out.get(name)) for name in QWEN3_LINEARS}


# ----------------------------------------------------------------------------------------------
# Chapter 20, continued. AWQ: activation-aware weight quantization (Lin et al. 2023)
# ----------------------------------------------------------------------------------------------
# A few input channels carry large activations; the weights they multiply matter most. Scaling
# those columns up by s before rounding (and the input down by s, folded away) shrinks their
# relative rounding error. s = mean|x|^alpha per channel, normalized (sqrt(max * min) = 1);
# alpha from a grid over [0, 1) minimizing the output error ||W X - Q(W diag(s)) diag(s)^-1 X||
# on the calibration inputs (alpha = 0 is plain RTN, so the search never does worse there). Then,
# optionally, clipping: shrink each group's range to a fraction of its max |w| (1 down to 0.5),
# trading a clipped outlier weight for a finer grid, keeping per (row, group) the fraction with the
# least error on that group's share of the output.

def _rtn(w, group_size):
    """Round to nearest on the int4 grid, dequantized: w (N, K) -> (N, K)."""
    return dequantize_int4(*quantize_int4(w, group_size), group_size)


@torch.no_grad()
def awq_search(w, x, group_size=128, grid=20, clip=True, tied=None):
    """AWQ for linears reading one input: w (N, K) (their rows stacked), x (n, K) calibration
    inputs -> (s (K,), w_awq (N, K)): fold 1/s into the previous op (fold_scales) and quantize
    w_awq = W diag(s), clipped when clip. tied: channels that must share a scale (o_proj)."""
    w, x = w.float(), x.float()
    xtx = x.T @ x  # (K, K): ||x D^T||^2 = tr(D x^T x D^T), cheaper than x D^T when n > K

    def error(w_hat):
        d = w - w_hat
        return ((d @ xtx) * d).sum()

    act = _pool(x.abs().mean(0), tied, "mean")  # (K,)
    best = (math.inf, None)
    for i in range(grid):
        s = act.pow(i / grid).clamp(min=1e-4)  # alpha = i / grid
        s = s / (s.max() * s.min()).sqrt()
        err = error(_rtn(w * s, group_size) / s).item()
        if err < best[0]:
            best = (err, s)
    s = best[1]
    w_awq = w * s
    if clip:
        w_awq = _clip_search(w_awq, x / s, group_size, grid)
    return s, w_awq


def _clip_search(w, x, group_size, grid, min_shrink=0.5):
    """w (N, K) with each (row, group) clamped to +-r * max|w| of the group, r from a grid over
    [min_shrink, 1], the r of least error on the group's own share of the output, x (n, K)."""
    N, K = w.shape
    ng = K // group_size
    xg = x.view(-1, ng, group_size)
    Hg = torch.einsum("tgi,tgj->gij", xg, xg)  # (ng, G, G): each group's own X^T X
    wg = w.view(N, ng, group_size)
    amax = wg.abs().amax(-1, keepdim=True)  # (N, ng, 1)
    best_err, best_max = torch.full((N, ng), math.inf, device=w.device), amax.clone()
    for i in range(int(grid * (1 - min_shrink)) + 1):
        m = amax * (1 - i / grid)
        d = wg - _rtn(wg.clamp(-m, m).view(N, K), group_size).view(N, ng, group_size)
        err = torch.einsum("ngi,gij,ngj->ng", d, Hg, d)  # (N, ng)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better[..., None], m, best_max)
    return wg.clamp(-best_max, best_max).view(N, K)


@torch.no_grad()
def awq_quantize_model(model, batches, group_size=128, grid=20, clip=True):
    """AWQ of every linear in the blocks, block by block, in place: search each group's scales on
    the block's calibration inputs, fold them (function unchanged), clip, then round to nearest
    into Int4Linear twins. Returns the folds, {name: (s_in, s_out)}, for layer_errors."""
    def quantize_block(block, run):
        xs = {}  # each group's input: what its first linear reads
        firsts = [names[0] for _, names in READING_ORDER]
        run(firsts, lambda name, x: xs.setdefault(name, []).append(x.float()))
        # each group's scales, and its clipped W diag(s) kept in place of the folded one
        folds = _smooth_block(block, lambda names, w, tied: awq_search(
            w, torch.cat(xs[names[0]]), group_size, grid, clip, tied))
        for name in QWEN3_LINEARS:
            twin = Int4Linear.from_linear(block.get_submodule(name), group_size)
            replace_linear(block, name, twin, model.kernels)
        return folds

    return _blockwise(model, batches, quantize_block)


# ----------------------------------------------------------------------------------------------
# Chapter 20, continued. SmoothQuant (Xiao et al. 2022): W8A8
# ----------------------------------------------------------------------------------------------
# W8A8 quantizes the activations too, per token at run time (s_x = max|x_t| / 127). An outlier
# channel 100x the others sets s_x, and every other channel of the token rounds to a few levels.
# Weights are easy to quantize, activations hard: SmoothQuant moves difficulty from x to W with
#     s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)     (per input channel j; alpha = 0.5)
# x / s has its outliers flattened, W diag(s) its columns grown where x was loud, folded away
# exactly as AWQ's scales are. Then weights per output channel and activations per token in int8.

def smooth_scales(act_absmax, w, alpha=0.5, tied=None):
    """s (K,) from the calibration max |x_j| (K,) and w (N, K) (the rows of every linear that
    reads x). tied: channels that must share a scale (o_proj), pooled by their max."""
    a = _pool(act_absmax.float(), tied, "amax").clamp(min=1e-5)
    m = _pool(w.float().abs().amax(0), tied, "amax").clamp(min=1e-5)
    return a.pow(alpha) / m.pow(1 - alpha)


@torch.no_grad()
def smoothquant_model(model, batches, alpha=0.5):
    """Fold SmoothQuant's scales into every block (function unchanged), then replace each linear
    by a W8A8Linear (quantize_model's "w8a8"), in place. Returns the folds, {name: (s_in,
    s_out)}, for layer_errors."""
    absmax, folds = activation_absmax(model, batches), {}
    for i, block in enumerate(model.model.layers):
        def scales_of(names, w, tied):
            return smooth_scales(absmax[f"model.layers.{i}.{names[0]}"], w, alpha, tied), None

        folds.update({f"model.layers.{i}.{name}": fold
                      for name, fold in _smooth_block(block, scales_of).items()})
    quantize_model(model, "w8a8")
    return folds


# ------------------------------------------------------------------------------------------------
# Chapter 22. LoRA: low-rank adapters (Hu et al., 2021)
# ------------------------------------------------------------------------------------------------
# NEW in stage 09, part 2. Fine-tuning moves a weight W (N, K) by some dW. LoRA bets that dW has
# low rank and writes it as B A, with A (r, K) and B (N, r), r << min(N, K): the layer computes
#     y = x W^T + (alpha / r) * x A^T B^T,
# W frozen, only A and B trained: r (N + K) numbers a layer instead of N K. B starts at zero, so
# the adapted model starts as the base model exactly; A starts random (kaiming-uniform, a = sqrt(5),
# nn.Linear's own init and PEFT's default), or B's gradient, x A^T, would be zero too. alpha / r
# keeps the update's size roughly steady as r changes, so a learning rate tuned at one rank carries
# over. Dropout acts on the input of A only: the frozen path sees x as it is.
#
# LoRALinear is one more twin (05, 20.6): it stands where the nn.Linear was and calls it, so the
# base can as well be a quantized twin (QLoRA: the base in 4 bits, the adapters in float). After
# training, B A folds into W (merge): the adapted model is again a plain model, no slower than the
# base. The adapter alone is saved in PEFT's layout, which `peft` and other tools read.

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PeftModel.base_model (a LoraModel), .model (transformers')


class LoRALinear(nn.Module):
    """base(x) + B(A(dropout(x))) * alpha / r, base frozen. base: an nn.Linear (no bias) or one of
    20.6's quantized twins. The adapter's parameters take the base's float dtype and device."""

    def __init__(self, base, r, alpha, dropout=0.0):
        super().__init__()
        N, K = base.out_features, base.in_features
        _check_lora(r, alpha, dropout, N, K)
        like = next(t for t in (*base.parameters(), *base.buffers()) if t.is_floating_point())
        # (the name base_layer is PEFT's: the state dict reads the same in both)
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.Linear(K, r, bias=False, device=like.device, dtype=like.dtype)  # (r, K)
        self.lora_B = nn.Linear(r, N, bias=False, device=like.device, dtype=like.dtype)  # (N, r)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.r, self.alpha, self.scale = r, alpha, alpha / r
        self.in_features, self.out_features = K, N
        self.merged = False

    def forward(self, x):  # x (..., K) -> (..., N)
        y = self.base_layer(x)
        if self.merged:  # B A is inside W already
            return y
        a = self.lora_A(self.dropout(x.to(self.lora_A.weight.dtype)))  # (..., r)
        return y + (self.lora_B(a) * self.scale).to(y.dtype)

    def delta_weight(self):
        """scale * B A, (N, K), computed in float32 and returned in the base weight's dtype."""
        dw = self.lora_B.weight.float() @ self.lora_A.weight.float()  # (N, r) @ (r, K)
        return (dw * self.scale).to(self._float_base("delta_weight").weight.dtype)

    @torch.no_grad()
    def merge(self):
        """W += scale * B A: then forward is one matmul. Exact up to rounding of the sum."""
        if not self.merged:
            self._float_base("merge").weight += self.delta_weight()
            self.merged = True
        return self

    @torch.no_grad()
    def unmerge(self):
        """W -= scale * B A, to go on training (W comes back up to rounding of the difference)."""
        if self.merged:
            self._float_base("unmerge").weight -= self.delta_weight()
            self.merged = False
        return self

    def _float_base(self, what):
        if type(self.base_layer) is not nn.Linear:
            raise TypeError(
                f"LoRALinear.{what}: the base is {type(self.base_layer).__name__}, quantized; B A "
                f"cannot be added to its codes without rounding the adapter away. QLoRA merges by "
                f"dequantizing: nn.Linear with weight base.dequantize(), then merge (and quantize "
                f"again if wanted)")
        return self.base_layer

    def extra_repr(self):
        return f"r={self.r}, alpha={self.alpha}, merged={self.merged}"


def _check_lora(r, alpha, dropout, N, K):
    """LoRALinear's arguments for a base of N outputs and K inputs."""
    if not _is_int(r) or not 1 <= r <= min(N, K):
        raise ValueError(f"LoRALinear: rank {r!r} must be an integer from 1 to "
                         f"min(out, in) = {min(N, K)}: a higher rank adds nothing a full "
                         f"update of this ({N}, {K}) layer would not")
    if not _is_number(alpha) or alpha <= 0:
        raise ValueError(f"LoRALinear: alpha {alpha!r} must be a positive number")
    if not _is_number(dropout) or not 0 <= dropout < 1:
        raise ValueError(f"LoRALinear: dropout {dropout!r} must be in [0, 1)")


def _block_linears(model):
    """{path: layer} for every linear inside the blocks, nn.Linear or quantized twin, e.g.
    "model.layers.0.self_attn.q_proj": the checkpoint's (and so PEFT's) module paths."""
    found = {}
    for i, block in enumerate(model.model.layers):
        for name, m in block.named_modules():
            inside = name.rpartition(".")[0]  # an adapter's own A, B and base are not targets
            if (isinstance(m, (nn.Linear, _QuantizedLinear, LoRALinear))
                    and not isinstance(block.get_submodule(inside), LoRALinear)):
                found[f"model.layers.{i}.{name}"] = m
    return found


def _targets(model, target_modules, fn):
    """The module paths that target_modules selects: "all-linear", or names matched as PEFT
    matches a list, a path equal to the name or ending in "." + name ("q_proj" picks every
    block's; "model.layers.0.self_attn.q_proj", as PEFT 0.22 saves "all-linear", one)."""
    linears = _block_linears(model)
    known = sorted({path.rpartition(".")[2] for path in linears})
    if isinstance(target_modules, str):
        target_modules = known if target_modules == "all-linear" else [target_modules]
    names = list(target_modules)

    def picks(path, name):
        return path == name or path.endswith("." + name)
    unknown = [name for name in names if not any(picks(path, name) for path in linears)]
    if not names or unknown:
        raise ValueError(f"{fn}: target modules {unknown or names!r} are not among the blocks' "
                         f"linears {known} (or \"all-linear\")")
    return [path for path in linears if any(picks(path, name) for name in names)]


def apply_lora(model, r, alpha, target_modules, dropout=0.0):
    """Wrap the blocks' linears named by target_modules ("q_proj", "v_proj", ..., or
    "all-linear") in LoRALinear, in place; freeze every other parameter. Returns the model."""
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("apply_lora: the model has adapters already (merge_lora first)")
    paths = _targets(model, target_modules, "apply_lora")
    for path in paths:  # all checked before the model changes
        base = model.get_submodule(path)
        try:
            _check_lora(r, alpha, dropout, base.out_features, base.in_features)
        except ValueError as err:
            raise ValueError(f"apply_lora: {path}: {err}") from err
    model.requires_grad_(False)
    for path in paths:
        owner, _, child = path.rpartition(".")
        setattr(model.get_submodule(owner), child,
                LoRALinear(model.get_submodule(path), r, alpha, dropout))
    return model


def lora_layers(model):
    """{module path: LoRALinear} of the model, in the model's order."""
    return {path: m for path, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model):
    """Fold every adapter into its base weight and put the base back in its place: a plain model
    again, as fast as the base (its weights stay frozen). Returns the model."""
    for path, layer in lora_layers(model).items():
        layer.merge()
        owner, _, child = path.rpartition(".")
        setattr(model.get_submodule(owner), child, layer.base_layer)
    return model


def trainable_parameters(model):
    """(trainable, total) parameter counts. A quantized twin's weight is a buffer of codes; it
    counts as the N K weights it stands for, so the total is the model's whichever its format."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    total += sum(m.in_features * m.out_features for m in model.modules()
                 if isinstance(m, _QuantizedLinear))
    return trainable, total


def trainable_summary(model):
    """"trainable: 1.2M of 596M (0.20%)"."""
    def count(n):
        return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n:,}"
    trainable, total = trainable_parameters(model)
    return f"trainable: {count(trainable)} of {count(total)} ({100 * trainable / total:.2f}%)"


# ------------------------------------------------------------------------------------------------
# 22.2 The adapter file, in PEFT's layout
# ------------------------------------------------------------------------------------------------
# A PeftModel wraps the transformers model twice (PeftModel.base_model is a LoraModel, whose .model
# is the transformers model), so its saved keys are "base_model.model." + the module's path in the
# transformers model + ".lora_A.weight" (A, (r, K)) or ".lora_B.weight" (B, (N, r)), the adapter's
# name ("default") dropped. The stage's module paths are the checkpoint's, so they are the same.
# adapter_config.json holds LoraConfig's fields; the ones this stage does not implement (rsLoRA's
# alpha / sqrt(r), DoRA, per-layer ranks, biases) must be off, or load_adapter refuses the file.

def save_adapter(model, folder, base_model_name_or_path=None):
    """Write the model's adapters (not its weights) to folder: adapter_model.safetensors and
    adapter_config.json, as peft's save_pretrained does. Returns the folder."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("save_adapter: the model has no adapters (apply_lora first)")
    if any(layer.merged for layer in layers.values()):
        raise ValueError("save_adapter: some adapters are merged into their weights; unmerge "
                         "them first, or the file would hold them twice over once loaded")
    settings = {(layer.r, layer.alpha, getattr(layer.dropout, "p", 0.0))
                for layer in layers.values()}
    if len(settings) != 1:
        raise ValueError(f"save_adapter: one rank, alpha and dropout for every adapter, "
                         f"found {sorted(settings)}")
    (r, alpha, dropout), = settings
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, layer in layers.items():
        tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = layer.lora_A.weight.detach().contiguous()
        tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = layer.lora_B.weight.detach().contiguous()
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = dict(
        peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=base_model_name_or_path,
        r=r, lora_alpha=alpha, lora_dropout=dropout,
        target_modules=sorted({path.rpartition(".")[2] for path in layers}),
        bias="none", fan_in_fan_out=False, use_rslora=False, use_dora=False,
        init_lora_weights=True, inference_mode=True, modules_to_save=None,
        layers_to_transform=None, layers_pattern=None, rank_pattern={}, alpha_pattern={},
        revision=None)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return folder


def _adapter_config(path):
    """adapter_config.json's r, lora_alpha, lora_dropout, target_modules, checked."""
    if not path.is_file():
        raise DataError(f"{path}: no such file; an adapter folder holds {ADAPTER_CONFIG} and "
                        f"{ADAPTER_WEIGHTS} (save_adapter, or peft's save_pretrained, writes them)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not JSON ({err})") from err
    if not isinstance(config, dict):
        raise DataError(f"{path}: not a JSON object")
    off = {"peft_type": "LORA", "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
           "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
           "modules_to_save": None, "lora_bias": False, "exclude_modules": None,
           "target_parameters": None, "layer_replication": None, "use_qalora": False}
    for field, want in off.items():
        got = config.get(field, want if field != "peft_type" else None)
        if got != want and not (want in (None, {}) and not got):
            raise DataError(f"{path}: {field} is {got!r}; this stage reads LoRA adapters with "
                            f"{field} {want!r} only")
    r, alpha, dropout = (config.get(k) for k in ("r", "lora_alpha", "lora_dropout"))
    if not _is_int(r) or r < 1:
        raise DataError(f"{path}: r is {r!r}, expected a positive integer")
    if not _is_number(alpha) or alpha <= 0:
        raise DataError(f"{path}: lora_alpha is {alpha!r}, expected a positive number")
    if not _is_number(dropout) or not 0 <= dropout < 1:
        raise DataError(f"{path}: lora_dropout is {dropout!r}, expected a number in [0, 1)")
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        raise DataError(f"{path}: target_modules is the pattern {targets!r}; this stage reads a "
                        f"list of module names (or \"all-linear\")")
    if not (targets == "all-linear" or isinstance(targets, list) and targets
            and all(isinstance(t, str) for t in targets)):
        raise DataError(f"{path}: target_modules is {targets!r}, expected a list of names")
    return r, alpha, dropout, targets


def load_adapter(model, folder):
    """Apply the adapter in folder (save_adapter's, or peft's save_pretrained's) to the model: its
    config and every tensor checked against the model before anything changes. A model that has
    adapters already must have them with the same rank and targets; they are overwritten.
    Returns the model."""
    folder = Path(folder)
    cfg_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    r, alpha, dropout, targets = _adapter_config(cfg_path)
    try:
        paths = _targets(model, targets, "load_adapter")
    except ValueError as err:
        raise DataError(f"{cfg_path}: target_modules: {err}") from err
    with _open_safetensors(weights_path) as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    linears = _block_linears(model)
    expected = {}
    for path in paths:
        N, K = linears[path].out_features, linears[path].in_features
        expected[f"{PEFT_PREFIX}{path}.lora_A.weight"] = (r, K)
        expected[f"{PEFT_PREFIX}{path}.lora_B.weight"] = (N, r)
    missing, extra = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or extra:
        raise DataError(f"{weights_path}: does not match target_modules {targets} of "
                        f"{cfg_path.name} on this model: missing {missing[:3]}, "
                        f"unexpected {extra[:3]}")
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != shape:
            raise DataError(f"{weights_path}: {key} is {tuple(tensors[key].shape)}, expected "
                            f"{shape} (r = {r} in {cfg_path.name}, and this model's layer)")
    present = lora_layers(model)
    if present:
        have = {(path, layer.r) for path, layer in present.items()}
        if have != {(path, r) for path in paths}:
            raise DataError(f"{cfg_path}: r = {r}, target_modules {targets} do not match the "
                            f"model's adapters (r = {sorted({x for _, x in have})} on "
                            f"{sorted({p.rpartition('.')[2] for p, _ in have})})")
    else:
        apply_lora(model, r, alpha, targets, dropout)
    with torch.no_grad():
        for path, layer in lora_layers(model).items():
            layer.unmerge()
            layer.lora_A.weight.copy_(tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"])
            layer.lora_B.weight.copy_(tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"])
            layer.alpha, layer.scale = alpha, alpha / r
    return model


# ----------------------------------------------------------------------------------------------
# Chapter 22, continued. QLoRA: a frozen base in 4-bit NormalFloat (Dettmers et al. 2023)
# ----------------------------------------------------------------------------------------------
# NEW in stage 09. LoRA trains small adapters beside a frozen base; QLoRA stores that base in 4
# bits, so a model that needs 2 bytes a weight in bf16 needs about half a byte. Three pieces:
# NF4, a 4-bit code whose 16 values sit where a normal distribution's mass is; a scale (absmax)
# for every 64 weights; and double quantization, which stores those scales in 8 bits. The
# forward dequantizes the weight to bf16 and multiplies as usual: the adapters, the activations
# and their gradients stay in bf16, and no gradient ever reaches the 4-bit weight.
#
# Legend: n the weights of a tensor, flattened row-major; b = 64 the weights of a block (one
# absmax each); b2 = 256 the absmaxes of a second-level block (one fp32 scale each).

# ------------------------------------------------------------------------------------------------
# 22.3 The NF4 code book
# ------------------------------------------------------------------------------------------------
# A pretrained weight block is close to normal, so the best 4-bit code for it (each code equally
# likely) puts the codes at quantiles of N(0, 1), scaled to [-1, 1] by the block's absmax. Plain
# quantiles of 16 equal bins have no exact 0, and a 0 that stays 0 matters (padding, pruned
# weights). The paper's construction: 8 quantiles of the upper half, 7 of the lower, and 0,
#     positive: Phi^-1(p), p = 9 evenly spaced points from 0.5 to 1 - delta, all but the first,
#     negative: -Phi^-1(p), p = 8 evenly spaced points from 0.5 to 1 - delta, all but the first,
#     delta = (1/30 + 1/32) / 2 (so that the outer quantile is finite, between the 15- and the
#     16-bin choice), each divided by Phi^-1(1 - delta) so that the ends are exactly -1 and 1.
# Sorted, index 7 is the 0. The published table (bitsandbytes' get_4bit_type("nf4"), the
# constants of its csrc/kernels.cu; the QLoRA paper, appendix E) was made in float32 from the
# offset 0.9677083 (rounded 1 - delta): it differs from this float64 construction by < 2e-7.

NF4_BLOCK = 64  # weights a block, one absmax each (the paper's and bitsandbytes' default)
NF4_BLOCK2 = 256  # absmaxes a second-level block, one fp32 scale each (double quantization)


def nf4_code_book():
    """The 16 NF4 values, ascending, float32: -1 = code[0] < ... < code[7] = 0 < ... < code[15]
    = 1 (22.3's construction, computed in float64)."""
    delta = (1 / 30 + 1 / 32) / 2
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
    upper = normal.icdf(torch.linspace(0.5, 1 - delta, 9, dtype=torch.float64)[1:])  # (8,)
    lower = -normal.icdf(torch.linspace(0.5, 1 - delta, 8, dtype=torch.float64)[1:])  # (7,)
    code = torch.cat([lower.flip(0), torch.zeros(1, dtype=torch.float64), upper])  # (16,)
    return (code / upper[-1]).float()


NF4_CODE = nf4_code_book()  # (16,) float32, CPU: moved to the weight's device when used

# ------------------------------------------------------------------------------------------------
# 22.4 Block quantization and double quantization, in torch
# ------------------------------------------------------------------------------------------------
# Each block of 64 weights is divided by its absmax c (fp32) into [-1, 1] and each value goes to
# its nearest code: its index, 0..15, is the count of midpoints between neighbouring codes that
# lie below it (a value exactly on a midpoint takes the lower code, as bitsandbytes does).
# Dequantized, w_hat = code[q] * c, and nearest rounding promises |w / c - code[q]| <= half the
# gap between the two codes around w / c: 0.5 * 0.304 = 0.152 at the ends (-1 .. -0.696), about
# 0.04 near 0 (the codes crowd where the weights do).
#
# The packed layout: value 2j in the high nibble of byte j, value 2j + 1 in its low nibble
# (bitsandbytes' order; chapter 20's int4 words put the first column in the low nibble). Worked
# example: indices 3 12 -> byte 0x3C. A tensor whose n is not a multiple of 64 gets a last
# block padded with zeros (index 7): n values take ceil(n / 64) * 32 bytes.
#
# Double quantization. An fp32 absmax a block costs 32 / 64 = 0.5 bit a weight. The absmaxes
# are positive and similar, so they are stored as 8-bit codes: their mean m (one fp32 for the
# whole tensor) is subtracted, and the rest goes, in blocks of 256, to symmetric linear int8:
#     s2 = max|c - m| / 127 over the 256-block (fp32), q2 = round((c - m) / s2) in -127..127,
#     c_hat = q2 * s2 + m   (an fp32 product, then an fp32 sum: the kernel does the same two).
# (bitsandbytes uses its dynamic 8-bit map instead of a linear one: finer near 0, where it
# hardly matters after the mean is gone.) The absmax error is |c - c_hat| <= s2 / 2, an
# absolute error; a weight then errs by at most
#     |w - w_hat| <= c * gap(w / c) / 2 + |code[q]| * s2 / 2   (plus fp32 rounding).
# The codes are chosen from the exact c, not c_hat (bitsandbytes' order too): a weight's index
# does not depend on how its scale is stored.
# Stored bits a weight: 4 (the index) + 8 / 64 (q2) + 32 / (64 * 256) (s2) = 4.127 (the paper's
# figure), against 4 + 32 / 64 = 4.5 without double quantization; the mean is 32 bits a tensor.


@dataclass
class NF4Tensor:
    """A float tensor in NF4 (nf4_quantize): `packed` (ceil(n / block) * block / 2,) uint8, two
    indices a byte, the first in the high nibble; `absmax` (blocks,): fp32, or int8 codes with
    double quantization, then `absmax_scale` (ceil(blocks / 256),) fp32 and `absmax_mean` () fp32
    (None without). `shape` the original shape, `dtype` its float dtype."""
    packed: torch.Tensor
    absmax: torch.Tensor
    absmax_scale: torch.Tensor | None
    absmax_mean: torch.Tensor | None
    shape: tuple
    dtype: torch.dtype
    block: int = NF4_BLOCK

    @property
    def numel(self):
        return math.prod(self.shape)

    def nbytes(self):
        """Bytes stored, every tensor counted (the mean too)."""
        parts = (self.packed, self.absmax, self.absmax_scale, self.absmax_mean)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def bits_per_weight(self):
        return 8 * self.nbytes() / self.numel

    def block_absmax(self):
        """The absmax of every block as the dequantization uses it, (blocks,) fp32: c, or c_hat =
        q2 * s2 + m (double quantization)."""
        if self.absmax_scale is None:
            return self.absmax
        s2 = self.absmax_scale.repeat_interleave(NF4_BLOCK2)[:self.absmax.numel()]  # (blocks,)
        return self.absmax.float() * s2 + self.absmax_mean

    def to(self, device):
        moved = [None if t is None else t.to(device)
                 for t in (self.packed, self.absmax, self.absmax_scale, self.absmax_mean)]
        return NF4Tensor(*moved, self.shape, self.dtype, self.block)


def nf4_quantize(w, block=NF4_BLOCK, double_quant=True):
    """w float (any shape) -> NF4Tensor: absmax a block of `block` consecutive values (row-major),
    each value the index of its nearest code; double_quant: the absmaxes in 8 bits (22.4)."""
    if not isinstance(w, torch.Tensor) or w.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"nf4_quantize: w must be a float32, float16 or bfloat16 tensor, got "
                        f"{getattr(w, 'dtype', type(w).__name__)}")
    if w.numel() == 0 or not torch.isfinite(w).all():
        raise ValueError("nf4_quantize: w must be non-empty and finite")
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block % 2:
        raise ValueError(f"nf4_quantize: block must be an even int >= 2 (two values a byte), "
                         f"got {block!r}")
    flat = w.detach().reshape(-1).float()
    n, blocks = flat.numel(), -(-flat.numel() // block)
    wb = F.pad(flat, (0, blocks * block - n)).view(blocks, block)  # (blocks, b), zero padded
    absmax = wb.abs().amax(1)  # (blocks,)
    x = wb / torch.where(absmax > 0, absmax, 1.0)[:, None]  # (blocks, b) in [-1, 1]
    code = NF4_CODE.to(w.device)
    q = torch.bucketize(x, (code[1:] + code[:-1]) / 2).to(torch.uint8).view(-1)  # (blocks * b,)
    packed = (q[0::2] << 4) | q[1::2]  # (blocks * b / 2,): the first value in the high nibble
    scale = mean = None
    if double_quant:
        mean = absmax.mean()
        centred = F.pad(absmax - mean, (0, -blocks % NF4_BLOCK2)).view(-1, NF4_BLOCK2)
        amax2 = centred.abs().amax(1)  # (blocks2,)
        scale = torch.where(amax2 > 0, amax2 / 127, 1.0)
        absmax = torch.round(centred / scale[:, None]).clamp(-127, 127).view(-1)[:blocks]
        absmax = absmax.to(torch.int8)
    return NF4Tensor(packed, absmax, scale, mean, tuple(w.shape), w.dtype, block)


def nf4_dequantize(t, dtype=torch.float32):
    """NF4Tensor -> the tensor code[q] * c_hat, shape t.shape, in `dtype` (rounded from fp32)."""
    q = torch.stack([t.packed >> 4, t.packed & 0xF], dim=1).view(-1).long()  # (blocks * b,)
    values = NF4_CODE.to(t.packed.device)[q].view(-1, t.block)  # (blocks, b) fp32
    w = (values * t.block_absmax()[:, None]).view(-1)[:t.numel]
    return w.view(t.shape).to(dtype)


# ------------------------------------------------------------------------------------------------
# 22.5 The dequantize kernel
# ------------------------------------------------------------------------------------------------
# QLoRA's forward dequantizes each weight before its matmul, and its backward again (the input's
# gradient needs W): the kernel is pure data movement. Per weight it reads 1/2 byte of indices
# and 1/64 byte of q2 (s2 and m: 4/16384 byte), and writes 2 bytes of bf16: 2.52 bytes a weight,
# against 4 for a bf16 copy of the same tensor (read 2, write 2). A torch dequantize moves ~10x
# that (the unpacked int64 indices, the fp32 gather, the fp32 product, the cast: each a full
# pass). The target on a GPU is the copy's bandwidth: >= 80% of a device-to-device copy's GB/s,
# measured on the 2.52 bytes.
# The table lookup is in registers: the 16 codes are loaded once a program as scalars, and an
# index picks its code through a tree of selects on its 4 bits (15 selects, no memory access,
# no shared memory). A program takes BLOCK_BYTES bytes, (BLOCK_BYTES, 2) values: column 0 the
# high nibble, so the store of the tile is contiguous. Its absmax: q2 of the byte's block (one
# load a 32-byte group, from L1), times s2 of the block's 256-block, plus m.

_NF4_BLOCK_BYTES = 1024  # bytes a program: 2,048 weights, 32 blocks of 64


@triton.jit
def _nf4_lookup(q, CODE):
    # q (any shape) int32 in 0..15 -> CODE[q] fp32: a select on bit 0, then bit 1, 2 and 3
    b0, b1, b2, b3 = (q & 1) != 0, (q & 2) != 0, (q & 4) != 0, (q & 8) != 0
    c01 = tl.where(b0, tl.load(CODE + 1), tl.load(CODE + 0))
    c23 = tl.where(b0, tl.load(CODE + 3), tl.load(CODE + 2))
    c45 = tl.where(b0, tl.load(CODE + 5), tl.load(CODE + 4))
    c67 = tl.where(b0, tl.load(CODE + 7), tl.load(CODE + 6))
    c89 = tl.where(b0, tl.load(CODE + 9), tl.load(CODE + 8))
    cab = tl.where(b0, tl.load(CODE + 11), tl.load(CODE + 10))
    ccd = tl.where(b0, tl.load(CODE + 13), tl.load(CODE + 12))
    cef = tl.where(b0, tl.load(CODE + 15), tl.load(CODE + 14))
    c03, c47 = tl.where(b1, c23, c01), tl.where(b1, c67, c45)
    c8b, ccf = tl.where(b1, cab, c89), tl.where(b1, cef, ccd)
    return tl.where(b3, tl.where(b2, ccf, c8b), tl.where(b2, c47, c03))


@triton.jit
def _nf4_dequant_kernel(P, A, S2, MEAN, CODE, Y, n, n_bytes, BLOCK: tl.constexpr,
                        DOUBLE: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    # P (n_bytes,) uint8 packed; A (blocks,) int8 q2 (DOUBLE) or fp32 absmax; S2 (blocks2,) fp32
    # and MEAN (1,) fp32 (DOUBLE only); CODE (16,) fp32; Y (n,) out, its dtype the output's.
    j = tl.program_id(0).to(tl.int64) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)  # (BB,) bytes
    byte = tl.load(P + j, mask=j < n_bytes, other=0).to(tl.int32)
    blk = j // (BLOCK // 2)  # each byte's block: both its values share it (BLOCK is even)
    if DOUBLE:
        q2 = tl.load(A + blk, mask=j < n_bytes, other=0).to(tl.float32)
        s2 = tl.load(S2 + blk // 256, mask=j < n_bytes, other=0.0)
        c = q2 * s2
        c = c + tl.load(MEAN)  # two roundings, as torch's: kept apart, see nf4_dequantize_triton
    else:
        c = tl.load(A + blk, mask=j < n_bytes, other=0.0)
    q = (byte[:, None] >> (4 - 4 * tl.arange(0, 2))[None, :]) & 0xF  # (BB, 2): high, low
    w = _nf4_lookup(q, CODE) * c[:, None]  # (BB, 2) fp32
    idx = 2 * j[:, None] + tl.arange(0, 2)[None, :]  # (BB, 2): value 2j, 2j + 1
    if _INTERPRET and Y.dtype.element_ty == tl.bfloat16:
        # the interpreter casts fp32 to bf16 by truncation (a GPU rounds to nearest even, as
        # torch does): round by hand, adding 0x7FFF plus the kept part's last bit, then cut
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        w = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    tl.store(Y + idx, w.to(Y.dtype.element_ty), mask=idx < n)


def nf4_dequantize_triton(t, dtype=torch.bfloat16):
    """NF4Tensor -> t's tensor in `dtype` on the kernel: the same fp32 operations as
    nf4_dequantize, so the same values to the bit."""
    if not isinstance(t, NF4Tensor):
        raise TypeError(f"nf4_dequantize_triton: expected an NF4Tensor, got {type(t).__name__}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"nf4_dequantize_triton: dtype must be one of {_FLOAT_DTYPES}, got {dtype}")
    double = t.absmax_scale is not None
    _check_tensor("packed", t.packed, dtypes=(torch.uint8,))
    dev = t.packed.device
    _check_tensor("absmax", t.absmax, dtypes=(torch.int8,) if double else (torch.float32,),
                  device=dev)
    if double:
        _check_tensor("absmax_scale", t.absmax_scale, dtypes=(torch.float32,), device=dev)
        _check_tensor("absmax_mean", t.absmax_mean.reshape(1), dtypes=(torch.float32,), device=dev)
    y = torch.empty(t.shape, dtype=dtype, device=dev)
    n_bytes = t.packed.numel()
    dummy = t.absmax  # S2 and MEAN when not DOUBLE: never read
    grid = (triton.cdiv(n_bytes, _NF4_BLOCK_BYTES),)
    # enable_fp_fusion=False: a GPU compile would fuse q2 * s2 + m into one FMA (one rounding),
    # and the values would no longer be torch's (two roundings). The cost is nil: one a byte.
    options = {} if INTERPRET else {"enable_fp_fusion": False}
    _nf4_dequant_kernel[grid](t.packed, t.absmax, t.absmax_scale if double else dummy,
                              t.absmax_mean.reshape(1) if double else dummy,
                              NF4_CODE.to(dev), y, t.numel, n_bytes, BLOCK=t.block,
                              DOUBLE=double, BLOCK_BYTES=_NF4_BLOCK_BYTES, num_warps=4, **options)
    return y


def bench_nf4_dequantize(n=1 << 28, device="cuda"):
    """(GB/s of the kernel on its 2.52 bytes a weight, GB/s of a bf16 device copy), n weights."""
    t = nf4_quantize(torch.randn(n, device=device, dtype=torch.bfloat16))
    ms = triton.testing.do_bench(lambda: nf4_dequantize_triton(t))
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms_copy = triton.testing.do_bench(lambda: dst.copy_(src))
    moved = t.nbytes() + 2 * n  # read what is stored, write bf16
    return moved / ms / 1e6, 4 * n / ms_copy / 1e6


# ------------------------------------------------------------------------------------------------
# 22.6 The frozen NF4 layer, and a model's base in NF4
# ------------------------------------------------------------------------------------------------
# NF4Linear is chapter 20's twin again: the NF4 weight is a set of buffers (never a parameter:
# nothing can train it), dequantized at every forward into the input's dtype, then F.linear. The
# bf16 weight lives only while its matmul runs; autograd keeps x for the weight's gradient, which
# nobody asks for, and the dequantized W for x's gradient, which the adapters need.

class NF4Linear(_QuantizedLinear):
    """nn.Linear (no bias) with a frozen NF4 weight (nf4_quantize's layout, 22.4)."""

    def __init__(self, weight):
        if not isinstance(weight, NF4Tensor) or len(weight.shape) != 2:
            raise TypeError("NF4Linear: weight must be an NF4Tensor of an (N, K) weight")
        N, K = weight.shape
        super().__init__(K, N, None)
        self.shape, self.block, self.dtype = weight.shape, weight.block, weight.dtype
        self.register_buffer("packed", weight.packed)  # (N * K / 2,) uint8
        self.register_buffer("absmax", weight.absmax)  # (blocks,) int8 or fp32
        self.register_buffer("absmax_scale", weight.absmax_scale)  # (blocks2,) fp32, or None
        self.register_buffer("absmax_mean", weight.absmax_mean)  # () fp32, or None

    @classmethod
    def from_linear(cls, linear, block=NF4_BLOCK, double_quant=True):
        return cls(nf4_quantize(_linear_weight(linear), block, double_quant))

    def weight_nf4(self):
        # the buffers as they are now (.to(device) moved them; .to(dtype) would cast the float
        # ones, which nf4_dequantize_triton refuses: keep an NF4 model's buffers fp32)
        return NF4Tensor(self.packed, self.absmax, self.absmax_scale, self.absmax_mean,
                         self.shape, self.dtype, self.block)

    def forward(self, x):  # x (..., K) -> (..., N), in x's dtype
        self._rows(x)  # the feature check
        t = self.weight_nf4()
        if self.kernels and (x.is_cuda or INTERPRET):
            w = nf4_dequantize_triton(t, x.dtype)
        else:
            w = nf4_dequantize(t, x.dtype)
        return F.linear(x, w)

    def _stored(self):
        return nf4_dequantize(self.weight_nf4())

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block={self.block}, double_quant={self.absmax_scale is not None}")


def quantize_model_nf4(model, block=NF4_BLOCK, double_quant=True):
    """Replace every nn.Linear inside the model's blocks by NF4Linear, in place (the embedding,
    the norms and the output layer stay as they are); the twins take the model's choice of
    kernels. Returns the model."""
    build = functools.partial(NF4Linear.from_linear, block=block, double_quant=double_quant)
    return replace_block_linears(model, build, "quantize_model_nf4")


# ----------------------------------------------------------------------------------------------
# Chapter 39. Quantized checkpoints from the Hub: GPTQ and AWQ files, through load_qwen3
# ----------------------------------------------------------------------------------------------
# NEW in stage 09. A file format is for interchange, a runtime layout for one kernel. GPTQ and AWQ
# files store W^T, (K, N), packed into int32 words of 32 / bits values (low bits first); this
# stage's kernels read W, (N, K), 8 input columns a word (20.1). So loading unpacks and repacks,
# once:
#   GPTQ (AutoGPTQ / GPTQModel, quant_method "gptq"):
#     qweight (K * bits / 32, N) int32: packed along the INPUT dim, value j of word r is row
#             r * 32/bits + j;   qzeros (K / G, N * bits / 32) int32: packed along the OUTPUT dim;
#     scales (K / G, N) fp16;   g_idx (K,) int32, the group of each input row (k // G unless
#     desc_act). W^T[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n], where checkpoint_format
#     "gptq" (v1) stores z - 1 (the +1 comes back on load) and "gptq_v2" stores z itself.
#     group_size -1: one group, G = K. v1 cannot store a zero point of 0 (it wraps to -1).
#   AWQ GEMM (AutoAWQ, quant_method "awq", version "gemm", zero_point true, 4 bits):
#     qweight (K, N / 8) int32: packed along the OUTPUT dim, nibble i of word c holding output
#     column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i] (the order its GEMM kernel dequantizes in);
#     qzeros (K / G, N / 8) the same way, stored as is; scales (K / G, N).
#     W^T[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n].
# Act-order files keep W's columns in the original order with a scattered g_idx. The runtime
# wants groups contiguous: a stable sort of g_idx gives perm (groups in order, G columns each),
# the stored columns become W[:, perm], and the layer reads x[..., perm] (20.6).
# 8 bits: an Int8Linear holds q - z in an int8 when z = 128 for every group, which is what a
# symmetric file ("sym": true, Qwen's own GPTQ-Int8 checkpoints) stores; an asymmetric 8-bit zero
# point makes q - z a 9-bit number, and such a file is refused by name.

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ word holds column AWQ_ORDER[i] of 8


def quantization_config(path, cfg):
    """The quantization_config of the config.json at `path` (cfg: its Qwen3Config), checked
    against what this stage loads -> None for a float checkpoint, else {"method", "bits",
    "group_size" (-1: a row), "zero_offset" (what v1 files subtracted from the zero points)}.
    What it cannot load is a DataError naming the file and the field."""
    q = read_hf_config(path, ()).get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise DataError(f"{path}: quantization_config must be an object, got {q!r}")

    def bad(field, why):
        return DataError(f"{path}: quantization_config.{field} = {q.get(field)!r} {why}")

    method = q.get("quant_method")
    if method not in ("gptq", "awq"):
        raise bad("quant_method", "is not supported (this stage loads 'gptq' and 'awq')")
    bits, supported = q.get("bits"), (4, 8) if method == "gptq" else (4,)
    if isinstance(bits, bool) or bits not in supported:
        raise bad("bits", f"is not supported: {method} files load at {supported} bits")
    G = q.get("group_size")
    if isinstance(G, bool) or not isinstance(G, int) or (G != -1 and (G < 8 or G % 8)):
        raise bad("group_size", "must be a positive multiple of 8, or -1 (one group a row)")
    sizes = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
             "num_attention_heads * head_dim": cfg.num_attention_heads * cfg.head_dim,
             "num_key_value_heads * head_dim": cfg.num_key_value_heads * cfg.head_dim}
    for what, size in sizes.items():
        if G != -1 and what != "num_key_value_heads * head_dim" and size % G:
            raise bad("group_size", f"does not divide {what} = {size}, the input size of "
                                    f"some linears")
        if size % 8:
            raise DataError(f"{path}: {what} = {size} is not a multiple of 8, which a packed "
                            f"int32 word spans")
    if method == "gptq":
        if q.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
            raise bad("checkpoint_format", "is not supported (this stage loads 'gptq', 'gptq_v2')")
        if q.get("pack_dtype", "int32") != "int32":
            raise bad("pack_dtype", "is not supported (values packed into int32 words only)")
        if q.get("dynamic"):
            raise bad("dynamic", "is not supported (per-module bits and group sizes)")
        if q.get("lm_head"):
            raise bad("lm_head", "is not supported (the output layer stays in float)")
        if bits == 8 and q.get("sym", True) is not True:
            raise bad("sym", "is not supported at 8 bits: an asymmetric zero point makes q - z a "
                             "9-bit number, and this stage's 8-bit layer holds int8 values")
        zero_offset = 1 if q.get("checkpoint_format", "gptq") == "gptq" else 0
    else:
        if str(q.get("version", "gemm")).lower() != "gemm":
            raise bad("version", "is not supported (GEMV and others pack differently; GEMM only)")
        if q.get("zero_point", True) is not True:
            raise bad("zero_point", "is not supported (files without zero points)")
        if q.get("modules_to_not_convert"):
            raise bad("modules_to_not_convert", "is not supported (every linear of the blocks "
                                                "must be quantized)")
        zero_offset = 0
    return {"method": method, "bits": bits, "group_size": G, "zero_offset": zero_offset}


def checkpoint_tensors(model, qconfig):
    """What read_weights must find in a GPTQ or AWQ checkpoint of `model` (on the meta device):
    {name: meta tensor of the stored shape and kind}, the model's float tensors (embeddings,
    norms, output layer) and each block linear's packed ones."""
    linears = {f"model.layers.{i}.{name}": block.get_submodule(name)
               for i, block in enumerate(model.model.layers) for name in QWEN3_LINEARS}
    expected = {name: t for name, t in model.state_dict().items()
                if name.removesuffix(".weight") not in linears}
    pf = 32 // qconfig["bits"]  # values a word
    for prefix, linear in linears.items():
        N, K = linear.out_features, linear.in_features
        groups = 1 if qconfig["group_size"] == -1 else K // qconfig["group_size"]
        shapes = ({"qweight": (K // pf, N), "qzeros": (groups, N // pf), "scales": (groups, N),
                   "g_idx": (K,)} if qconfig["method"] == "gptq" else
                  {"qweight": (K, N // pf), "qzeros": (groups, N // pf), "scales": (groups, N)})
        for suffix, shape in shapes.items():
            kind = torch.float32 if suffix == "scales" else torch.int32  # int: read as stored
            expected[f"{prefix}.{suffix}"] = torch.empty(shape, dtype=kind, device="meta")
    return expected


def _unpack_words(words, bits, dim):
    """int32 words -> unsigned values, 32 / bits a word, low bits first, spread along `dim`."""
    shifts = torch.arange(0, 32, bits, device=words.device)
    v = (words.long().unsqueeze(dim + 1) >> shifts.view(-1, *[1] * (words.dim() - dim - 1)))
    v = v & (2**bits - 1)  # long: an arithmetic shift, but the mask keeps the low bits only
    return v.flatten(dim, dim + 1)


def checkpoint_twin(stored, qconfig, source):
    """The Int4Linear or Int8Linear of one linear from its checkpoint tensors {"qweight",
    "qzeros", "scales", and "g_idx" for GPTQ} (shapes checked by read_weights; source names
    the linear in errors): unpacked, put in (N, K) order with groups contiguous, repacked."""
    for suffix in ("qweight", "qzeros", "g_idx"):
        if suffix in stored and stored[suffix].dtype != torch.int32:
            raise DataError(f"{source}.{suffix} is {stored[suffix].dtype}; a "
                            f"{qconfig['method']} file stores int32")
    bits, scales = qconfig["bits"], stored["scales"]  # (groups, N)
    (groups, N), device = scales.shape, scales.device
    if qconfig["method"] == "gptq":
        q = _unpack_words(stored["qweight"], bits, 0)  # (K, N): along the input dim
        z = _unpack_words(stored["qzeros"], bits, 1) + qconfig["zero_offset"]  # (groups, N)
        g_idx = stored["g_idx"].long()
    else:
        reverse = torch.argsort(torch.tensor(AWQ_ORDER, device=device))  # m: in nibble reverse[m]
        q = _unpack_words(stored["qweight"], 4, 1).view(-1, N // 8, 8)[..., reverse].reshape(-1, N)
        z = _unpack_words(stored["qzeros"], 4, 1).view(groups, N // 8, 8)[..., reverse]
        z = z.reshape(groups, N)
        g_idx = torch.arange(q.shape[0], device=device) // (q.shape[0] // groups)
    K = q.shape[0]
    if (g_idx.min() < 0 or g_idx.max() >= groups
            or (torch.bincount(g_idx, minlength=groups) != K // groups).any()):
        raise DataError(f"{source}.g_idx does not give each of the {groups} groups "
                        f"{K // groups} input columns")
    perm = torch.argsort(g_idx, stable=True)  # groups contiguous: stored column i is column perm[i]
    if torch.equal(perm, torch.arange(K, device=device)):
        perm = None
    q = (q if perm is None else q[perm]).T  # (N, K), the runtime's orientation
    scales = scales.T.contiguous()  # (N, groups)
    if bits == 4:
        return Int4Linear(pack_int4(q), scales, z.T.to(scales.dtype).contiguous(), K // groups,
                          perm)
    if (z != 128).any():  # symmetric (quantization_config): q - 128 is the int8 value
        raise DataError(f"{source}.qzeros: zero points other than 128 in a symmetric 8-bit file")
    return Int8Linear((q - 128).to(torch.int8).contiguous(), scales, perm)


def load_quantized(model, state, qconfig, folder):
    """Replace each linear of model's blocks by the twin its checkpoint tensors (in `state`, as
    read_weights returned them for checkpoint_tensors) describe; return the state dict that
    model.load_state_dict then takes: the float tensors as read, and the twins' buffers."""
    for i, block in enumerate(model.model.layers):
        for name in QWEN3_LINEARS:
            prefix = f"model.layers.{i}.{name}"
            stored = {key.rsplit(".", 1)[1]: state.pop(key) for key in list(state)
                      if key.rsplit(".", 1)[0] == prefix}
            twin = checkpoint_twin(stored, qconfig, f"{folder}: {prefix}")
            replace_linear(block, name, twin, kernels=False)  # use_kernels decides, after
    return {**state, **{name: t for name, t in model.state_dict().items() if not t.is_meta}}


# ----------------------------------------------------------------------------------------------
# Chapter 38. GGUF and GGML: llama.cpp's file and its quantized blocks
# ----------------------------------------------------------------------------------------------
# NEW in stage 09: the format llama.cpp (and ollama, LM Studio, ...) loads, read and written from
# the spec (github.com/ggml-org/ggml/blob/master/docs/gguf.md) without llama.cpp's code.
#
# A GGUF file is one self-describing file: the model's hyperparameters and tokenizer as key-values,
# then its tensors, each aligned so that llama.cpp can mmap the file and run its kernels straight
# on the bytes. Every number is little-endian. Version 3:
#
#   header         "GGUF"   u32 version (3)   u64 tensor_count   u64 kv_count
#   kv_count x     string key   u32 value_type   value
#   tensor_count x string name  u32 n_dims  u64 dims[n_dims]  u32 ggml_type  u64 offset
#   zero padding to the alignment (general.alignment, 32 unless the metadata says otherwise)
#   data           tensor i at data start + offset i (a multiple of the alignment), padded to it
#
# A string is a u64 byte count and UTF-8; an array is a u32 element type, a u64 count and the
# elements (an element may itself be an array). dims are innermost first, as ggml's ne[] are: a
# torch weight (N, K), N rows of K values, is stored with dims [K, N], the reverse of its shape.
# A tensor of a ggml type is its rows cut into blocks of that type's size, each a fixed number of
# bytes; a row must be whole blocks.

GGUF_VALUE_TYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool",
                    "string", "array", "uint64", "int64", "float64")  # in the order of their codes
_NUMPY_TYPES = {"uint8": "<u1", "int8": "<i1", "uint16": "<u2", "int16": "<i2", "uint32": "<u4",
                "int32": "<i4", "float32": "<f4", "bool": "?", "uint64": "<u8", "int64": "<i8",
                "float64": "<f8"}
GGUF_ALIGNMENT = 32  # the spec's default
MAX_TENSOR_NAME = 63  # bytes: ggml stores a tensor's name in a char[64]


@dataclass(frozen=True)
class GGMLType:
    code: int  # its number in a tensor info
    block: int  # values per block
    nbytes: int  # bytes per block


# The types read and written here: llama.cpp's popular Q4_K_M files mix Q4_K and Q6_K matrices
# with F32 norms.
GGML_TYPES = {"F32": GGMLType(0, 1, 4), "F16": GGMLType(1, 1, 2), "Q4_0": GGMLType(2, 32, 18),
              "Q8_0": GGMLType(8, 32, 34), "Q4_K": GGMLType(12, 256, 144),
              "Q6_K": GGMLType(14, 256, 210), "BF16": GGMLType(30, 1, 2)}
_TYPE_NAMES = {t.code: name for name, t in GGML_TYPES.items()}


# ------------------------------------------------------------------------------------------------
# 38.1 The blocks: each type's encoder (n blocks of values -> (n, bytes) uint8) and decoder
# ------------------------------------------------------------------------------------------------
# Legend: n blocks; x (n, values per block) float32; b (n, bytes per block) uint8. A scale stored
# as fp16 is rounded before the values are fitted to it, so they fit the scale the decoder reads.

def _fp16(b):
    """(n, 2) bytes -> (n, 1) float32: a block's fp16 field."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _fp16_up(v):
    """v (float32) as float16 rounded up, never below v, so a range derived from it covers v."""
    h = v.astype(np.float16)
    return np.where(h.astype(np.float32) < v, np.nextafter(h, np.float16(np.inf)), h)


def _ratio(x, scale):
    """x / scale, 0 where the scale is 0 (a block of zeros)."""
    return np.divide(x, scale, out=np.zeros(np.broadcast_shapes(x.shape, scale.shape), np.float32),
                     where=scale != 0)


def _fit(x, scale, lo, hi):
    """The levels nearest x / scale, clamped to lo..hi."""
    return np.clip(np.rint(_ratio(x, scale)), lo, hi)


def _join(*fields):
    """A block's fields, each (n, bytes) or an (n,) / (n, 1) fp16 array, side by side."""
    return np.concatenate([f.astype("<f2").reshape(-1, 1).view(np.uint8) if f.dtype == np.float16
                           else f for f in fields], axis=1)


# F32, F16, BF16: a "block" of one value. BF16 is float32's top 16 bits, rounded to nearest even.
def _encode_f16(x):
    if np.abs(x).max(initial=0) > 65504:
        raise ValueError(f"a value of {np.abs(x).max():.4g} is beyond F16's range (65504)")
    return x.astype("<f2").view(np.uint8)


def _encode_bf16(x):
    bits = x.astype("<f4").view("<u4")
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").view(np.uint8)


# Q8_0, 34 bytes: fp16 d, then 32 int8 q. x = d * q, d = max|x| / 127.
def _encode_q8_0(x):
    d = (np.abs(x).max(1, keepdims=True) / 127).astype(np.float16)  # (n, 1)
    q = _fit(x, d.astype(np.float32), -127, 127).astype(np.int8)  # (n, 32)
    return _join(d, q.view(np.uint8))


def _decode_q8_0(b):
    return _fp16(b[:, :2]) * b[:, 2:].view(np.int8)


# Q4_0, 18 bytes: fp16 d, then 16 bytes of 4-bit q: byte j holds value j in its low nibble and
# value 16 + j in its high one. x = (q - 8) * d. d = -far / 8, where far is the value of largest
# magnitude: far lands exactly on the level -8, and the other sign reaches only 7|d|.
def _encode_q4_0(x):
    far = np.take_along_axis(x, np.abs(x).argmax(1)[:, None], axis=1)  # (n, 1), signed
    d = (far / -8).astype(np.float16)
    q = (_fit(x, d.astype(np.float32), -8, 7) + 8).astype(np.uint8)  # (n, 32) in 0..15
    return _join(d, q[:, :16] | q[:, 16:] << 4)


def _decode_q4_0(b):
    qs = b[:, 2:]  # (n, 16)
    q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int8) - 8  # (n, 32)
    return _fp16(b[:, :2]) * q


# Q4_K, 144 bytes for a super-block of 256 values, 8 sub-blocks of 32: fp16 d, fp16 dmin, 12 bytes
# of 6-bit scales sc[8] and mins m[8], 128 bytes of 4-bit q. Value i of sub-block j:
#     x = d * sc[j] * q - dmin * m[j]
# Bytes 32c..32c+31 of q hold sub-block 2c in their low nibbles and 2c+1 in their high ones. Two
# levels of scales: each sub-block has its own step and min, stored in 6 bits as multiples of the
# super-block's fp16 d and dmin, so 4.5 bits a value in all. The mins are stored as positive
# numbers subtracted, so a sub-block's min is taken at most 0.
def _pack_scales(sc, m):
    """sc, m (n, 8) 6-bit -> (n, 12): sub-blocks 0-3 whole in bytes 0-3 (sc) and 4-7 (m);
    sub-blocks 4-7 as low nibbles in bytes 8-11 (sc low, m high), top 2 bits in the spare top
    bits of bytes 0-3 (sc) and 4-7 (m)."""
    return np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                           (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1)


def _unpack_scales(s):
    """(n, 12) -> sc, m (n, 8): the inverse of _pack_scales."""
    sc = np.concatenate([s[:, :4] & 63, (s[:, 8:] & 15) | (s[:, :4] >> 6) << 4], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:] >> 4) | (s[:, 4:8] >> 6) << 4], axis=1)
    return sc, m


def _encode_q4_k(x):
    xs = x.reshape(-1, 8, 32)  # (n, sub-blocks, values)
    lo = np.minimum(xs.min(2), 0)  # (n, 8)
    step = (xs.max(2) - lo) / 15  # 16 levels span each sub-block
    d = _fp16_up(step.max(1, keepdims=True) / 63)  # (n, 1): 63 d >= every step
    dmin = _fp16_up(-lo.min(1, keepdims=True) / 63)  # (up: never 0 below a min that is not)
    # steps round up, so the levels still span the sub-block; mins round to nearest
    sc = np.clip(np.ceil(_ratio(step, d.astype(np.float32))), 0, 63).astype(np.uint8)
    m = _fit(-lo, dmin.astype(np.float32), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32) * sc  # (n, 8): the step and min the decoder will use
    low = dmin.astype(np.float32) * m
    q = _fit(xs + low[..., None], scale[..., None], 0, 15).astype(np.uint8)  # (n, 8, 32)
    q = q.reshape(-1, 4, 2, 32)  # (n, byte groups, nibble, byte)
    return _join(d, dmin, _pack_scales(sc, m), (q[:, :, 0] | q[:, :, 1] << 4).reshape(-1, 128))


def _decode_q4_k(b):
    d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])  # (n, 1) each
    sc, m = _unpack_scales(b[:, 4:16])  # (n, 8) each
    qs = b[:, 16:].reshape(-1, 4, 1, 32)
    q = (qs >> np.array([0, 4], np.uint8)[:, None]) & 15  # (n, 4, 2, 32): low, high nibbles
    x = (d * sc)[..., None] * q.reshape(-1, 8, 32) - (dmin * m)[..., None]  # (n, 8, 32)
    return x.reshape(-1, 256)


# Q6_K, 210 bytes for 256 values, 16 sub-blocks of 16: 128 bytes ql (low 4 bits of each q), 64
# bytes qh (its high 2 bits), 16 int8 scales sc, fp16 d. x = d * sc[j] * (q - 32), q 6 bits.
# Each half h of 128 values keeps value 32k + l (k = 0..3, l = 0..31) in ql[64h + 32(k % 2) + l]
# (the low nibble for k < 2, the high one after) and qh[32h + l], bits 2k and 2k + 1.
def _encode_q6_k(x):
    xs = x.reshape(-1, 16, 16)  # (n, sub-blocks, values)
    step = np.abs(xs).max(2) / 31  # (n, 16): symmetric levels -31..31
    d = _fp16_up(step.max(1, keepdims=True) / 127)  # (n, 1): 127 d >= every step
    sc = np.clip(np.ceil(_ratio(step, d.astype(np.float32))), 0, 127).astype(np.int8)
    scale = d.astype(np.float32) * sc  # (n, 16), rounded up: no value falls outside -31..31
    q = (_fit(xs, scale[..., None], -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = np.concatenate([q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4,
                         q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4], axis=2)  # (n, 2, 64)
    qh = (q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4
          | (q[:, :, 3] >> 4) << 6)  # (n, 2, 32)
    return _join(ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d)


def _decode_q6_k(b):
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 1, 32)
    sc, d = b[:, 192:208].view(np.int8), _fp16(b[:, 208:210])  # (n, 16), (n, 1)
    low = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4],
                   axis=2)  # (n, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # (n, 2, 4, 32)
    q = (low | high << 4).astype(np.int8).reshape(-1, 16, 16) - 32
    return ((d * sc)[..., None] * q).reshape(-1, 256)


_CODECS = {  # type: (encode, decode)
    "F32": (lambda x: x.astype("<f4").view(np.uint8), lambda b: b.view("<f4")),
    "F16": (_encode_f16, lambda b: b.view("<f2").astype(np.float32)),
    "BF16": (_encode_bf16, lambda b: (b.view("<u2").astype("<u4") << 16).view("<f4")),
    "Q8_0": (_encode_q8_0, _decode_q8_0), "Q4_0": (_encode_q4_0, _decode_q4_0),
    "Q4_K": (_encode_q4_k, _decode_q4_k), "Q6_K": (_encode_q6_k, _decode_q6_k)}


def _ggml_type(name):
    if name not in GGML_TYPES:
        raise ValueError(f"ggml type {name!r} is not one of {list(GGML_TYPES)}")
    return GGML_TYPES[name]


def ggml_quantize(x, ggml_type):
    """x (..., K), a tensor or array, K whole blocks of ggml_type -> its blocks: (x.numel() /
    block, bytes per block) uint8, as a GGUF file stores them."""
    t = _ggml_type(ggml_type)
    x = x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, "<f4")
    if x.ndim == 0 or x.shape[-1] % t.block:
        raise ValueError(f"{ggml_type}: rows of {x.shape[-1:]} values are not whole blocks of "
                         f"{t.block}")
    if not np.isfinite(x).all():
        raise ValueError(f"{ggml_type}: the values hold inf or nan")
    return _CODECS[ggml_type][0](x.reshape(-1, t.block))


def ggml_dequantize(blocks, ggml_type, shape):
    """blocks (n, bytes per block) uint8 of ggml_type -> a float32 tensor of `shape` (torch's
    order)."""
    t = _ggml_type(ggml_type)
    if blocks.shape != (math.prod(shape) // t.block, t.nbytes):
        raise ValueError(f"{ggml_type} blocks {blocks.shape} do not hold shape {tuple(shape)}")
    return torch.from_numpy(_CODECS[ggml_type][1](blocks).reshape(shape).astype(np.float32))


# ------------------------------------------------------------------------------------------------
# 38.2 Reading a GGUF file
# ------------------------------------------------------------------------------------------------
# The reader memory-maps the file and checks all of it that is not tensor data (header, key-values,
# tensor infos, that each tensor lies inside the file) before it returns: a broken file is an
# error naming the file and the field, and no tensor is decoded from it.

@dataclass
class GGUFTensor:
    """A tensor as the file holds it."""
    type: str  # a key of GGML_TYPES
    shape: tuple  # torch's order, outermost first: the file's dims reversed
    blocks: np.ndarray  # (n, bytes per block) uint8, a view of the memory-mapped file


class _Cursor:
    """Reads a GGUF file's fields in order; a read past the end is a DataError naming the field."""

    def __init__(self, path, buf):
        self.path, self.buf, self.pos = path, buf, 0

    def take(self, n, field):
        if n > len(self.buf) - self.pos:
            raise DataError(f"{self.path}: truncated: {field} needs {n} bytes at byte {self.pos}, "
                            f"but the file ends at byte {len(self.buf)}")
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def numbers(self, value_type, count, field):  # (count,) array
        dtype = np.dtype(_NUMPY_TYPES[value_type])
        return np.frombuffer(self.take(count * dtype.itemsize, field), dtype)

    def number(self, value_type, field):
        return self.numbers(value_type, 1, field)[0].item()

    def string(self, field):
        data = self.take(self.number("uint64", field), field)
        try:
            return str(data, "utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{self.path}: {field} is not UTF-8") from None

    def value_type(self, field):
        code = self.number("uint32", field)
        if code >= len(GGUF_VALUE_TYPES):
            raise DataError(f"{self.path}: {field} has value type {code}, which is not a GGUF "
                            f"type (0-{len(GGUF_VALUE_TYPES) - 1})")
        return GGUF_VALUE_TYPES[code]

    def value(self, field):
        """A key's value as (type, value); an array as (element type, [elements])."""
        t = self.value_type(field)
        if t == "array":
            return self.array(field)
        return t, self.string(field) if t == "string" else self.number(t, field)

    def array(self, field):
        t, n = self.value_type(field), self.number("uint64", field)
        if t == "array":  # each element an array of its own type
            return t, [self.array(f"{field}[{i}]") for i in range(n)]
        if t == "string":
            return t, [self.string(f"{field}[{i}]") for i in range(n)]
        return t, self.numbers(t, n, field).tolist()


def _align(n, alignment):
    return -(-n // alignment) * alignment


def read_gguf_raw(path):
    """(metadata, tensors) of a GGUF file, nothing decoded. metadata {key: (type, value)}, an
    array (element type, [elements]), an array of arrays ("array", [(type, [...]), ...]);
    tensors {name: GGUFTensor}. Reads versions 2 and 3 (the same layout; 3 allows big-endian
    files, which are refused here)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    size = path.stat().st_size
    data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    r = _Cursor(path, memoryview(data))
    magic = bytes(r.take(4, "the magic number"))
    if magic != b"GGUF":
        raise DataError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    version = r.number("uint32", "the version")
    if version not in (2, 3):
        endian = " (a big-endian file?)" if version > 0xFFFF else ""
        raise DataError(f"{path}: GGUF version {version}{endian}: this reader reads versions 2 "
                        f"and 3, little-endian")
    n_tensors = r.number("uint64", "the tensor count")
    n_kv = r.number("uint64", "the metadata count")
    metadata = {}
    for i in range(n_kv):
        key = r.string(f"metadata key {i}")
        if key in metadata:
            raise DataError(f"{path}: metadata key {key!r} appears twice")
        metadata[key] = r.value(f"metadata key {key!r}")
    align_type, alignment = metadata.get("general.alignment", ("uint32", GGUF_ALIGNMENT))
    if align_type != "uint32" or alignment < 8 or alignment & (alignment - 1):
        raise DataError(f"{path}: general.alignment must be a uint32 power of two >= 8, got "
                        f"{align_type} {alignment}")
    infos = []
    for i in range(n_tensors):
        name = r.string(f"tensor info {i}")
        field = f"tensor {name!r}"
        n_dims = r.number("uint32", field)
        dims = r.numbers("uint64", n_dims, field).tolist()  # innermost first
        infos.append((name, dims, r.number("uint32", field), r.number("uint64", field)))
    start = _align(r.pos, alignment)  # the data section
    tensors = {}
    for name, dims, code, offset in infos:
        if name in tensors:
            raise DataError(f"{path}: tensor {name!r} appears twice")
        if code not in _TYPE_NAMES:
            raise DataError(f"{path}: tensor {name!r} has ggml type {code}, which this reader "
                            f"does not implement (it reads {', '.join(GGML_TYPES)})")
        t = GGML_TYPES[_TYPE_NAMES[code]]
        if not dims or dims[0] % t.block:
            raise DataError(f"{path}: tensor {name!r} has dims {dims}: its rows are not whole "
                            f"{_TYPE_NAMES[code]} blocks of {t.block}")
        if offset % alignment:
            raise DataError(f"{path}: tensor {name!r} is at offset {offset}, not a multiple of "
                            f"the alignment {alignment}")
        begin, nbytes = start + offset, math.prod(dims) // t.block * t.nbytes
        if begin + nbytes > size:
            raise DataError(f"{path}: tensor {name!r} ({nbytes} bytes from byte {begin}) runs "
                            f"past the end of the file ({size} bytes)")
        blocks = data[begin:begin + nbytes].reshape(-1, t.nbytes)
        tensors[name] = GGUFTensor(_TYPE_NAMES[code], tuple(reversed(dims)), blocks)
    return metadata, tensors


def _plain(value_type, value):
    """A typed metadata value as plain Python: a str, bool, int, float or (nested) list."""
    return [_plain(*item) for item in value] if value_type == "array" else value


def read_gguf(path):
    """(metadata {key: plain value}, tensors {name: float32 tensor in torch's shape})."""
    metadata, tensors = read_gguf_raw(path)
    return ({key: _plain(*value) for key, value in metadata.items()},
            {name: ggml_dequantize(t.blocks, t.type, t.shape) for name, t in tensors.items()})


# ------------------------------------------------------------------------------------------------
# 38.3 Writing a GGUF file
# ------------------------------------------------------------------------------------------------
# A metadata value is typed as gguf-py (llama.cpp's Python package) types it: str -> string,
# bool -> bool, int -> int32, float -> float32, list -> array of its elements' one type. Another
# type is named: ("uint32", 7) is a uint32, ("float64", [0.5]) an array of float64, and
# ("array", [("int32", [1]), ("string", ["a"])]) an array of arrays, the form read_gguf_raw
# returns. llama.cpp checks the types of the keys it reads (qwen3.block_count must be a uint32).

def _typed(value, key):
    """value as (type, value), an array as (element type, [elements])."""
    if isinstance(value, tuple):
        if len(value) != 2 or value[0] not in GGUF_VALUE_TYPES:
            raise ValueError(f"metadata {key!r}: {value!r} is not a (GGUF type, value) pair")
        if value[0] != "array":
            return value
        items = [_typed(item, key) for item in value[1]] if isinstance(value[1], list) else None
        if items is None or not all(isinstance(v, list) for _, v in items):
            raise ValueError(f"metadata {key!r}: an array of arrays is ('array', [(type, [...]), "
                             f"...])")
        return "array", items
    if isinstance(value, str):
        return "string", value
    if isinstance(value, bool):
        return "bool", value
    if isinstance(value, numbers.Integral):
        return "int32", value
    if isinstance(value, numbers.Real):
        return "float32", value
    if isinstance(value, list):
        items = [_typed(item, key) for item in value]
        kinds = {"array" if isinstance(v, list) else t for t, v in items}
        if len(kinds) != 1:
            raise ValueError(f"metadata {key!r}: a list of element types {sorted(kinds)} (or "
                             f"none): give its type as (type, [...])")
        kind = kinds.pop()
        return kind, items if kind == "array" else [v for _, v in items]
    raise ValueError(f"metadata {key!r}: a {type(value).__name__} has no GGUF type")


def _string(s, key):
    if not isinstance(s, str):
        raise ValueError(f"metadata {key!r}: {s!r} is not a str")
    data = s.encode()
    return struct.pack("<Q", len(data)) + data


def _numbers(value_type, values, key):
    """values as little-endian numbers of value_type; a value it cannot hold is an error."""
    try:
        array = np.array(values, dtype=_NUMPY_TYPES[value_type])
    except (OverflowError, TypeError, ValueError):
        array = None
    if array is None or (not value_type.startswith("float") and array.tolist() != list(values)):
        raise ValueError(f"metadata {key!r}: {values[:4]!r} do not fit GGUF type {value_type}")
    return array.tobytes()


def _array(value_type, items, key):
    """An array's bytes after its type code: element type, count, elements."""
    head = struct.pack("<IQ", GGUF_VALUE_TYPES.index(value_type), len(items))
    if value_type == "array":
        return head + b"".join(_array(t, v, key) for t, v in items)
    if value_type == "string":
        return head + b"".join(_string(s, key) for s in items)
    return head + _numbers(value_type, items, key)


def _key_value(key, value):
    value_type, value = _typed(value, key)
    if isinstance(value, list):
        body = struct.pack("<I", GGUF_VALUE_TYPES.index("array")) + _array(value_type, value, key)
    else:
        body = struct.pack("<I", GGUF_VALUE_TYPES.index(value_type)) + (
            _string(value, key) if value_type == "string" else _numbers(value_type, [value], key))
    return _string(key, key) + body


def write_gguf(path, metadata, tensors):
    """Write a GGUF v3 file. metadata {key: value} (typed as above; general.alignment, if given,
    sets the alignment); tensors {name: (tensor (..., K), ggml type name)}, each quantized as it
    is written. Metadata, names, shapes and types are checked before the file is opened (values a
    type cannot hold, when that tensor is quantized); the file is written under a temporary name
    beside `path` and renamed at the end, so an error leaves no half-written file."""
    path, metadata = Path(path), dict(metadata)
    alignment = metadata.get("general.alignment", GGUF_ALIGNMENT)
    if not (isinstance(alignment, int) and alignment >= 8 and not alignment & (alignment - 1)):
        raise ValueError(f"general.alignment = {alignment!r} must be a power of two >= 8")
    if "general.alignment" in metadata:
        metadata["general.alignment"] = ("uint32", alignment)  # the type the spec requires
    kv = b"".join(_key_value(key, value) for key, value in metadata.items())
    infos, offset = [], 0
    for name, (x, type_name) in tensors.items():
        t = _ggml_type(type_name)
        shape = tuple(x.shape)  # torch's order; the file's dims are its reverse
        if not shape or shape[-1] % t.block:
            raise ValueError(f"tensor {name!r} {shape}: rows are not whole {type_name} blocks "
                             f"of {t.block} values")
        if len(name.encode()) > MAX_TENSOR_NAME:
            raise ValueError(f"tensor {name!r}: llama.cpp takes names of {MAX_TENSOR_NAME} bytes "
                             f"at most")
        infos.append(_string(name, name) + struct.pack(f"<I{len(shape)}QIQ", len(shape),
                                                       *reversed(shape), t.code, offset))
        offset += _align(math.prod(shape) // t.block * t.nbytes, alignment)
    head = struct.pack("<4sIQQ", b"GGUF", 3, len(tensors), len(metadata)) + kv + b"".join(infos)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head + bytes(_align(len(head), alignment) - len(head)))
            for name, (x, type_name) in tensors.items():  # one tensor's blocks at a time
                try:
                    blocks = ggml_quantize(x, type_name)
                except ValueError as e:
                    raise ValueError(f"tensor {name!r}: {e}") from None
                f.write(blocks.tobytes() + bytes(_align(blocks.nbytes, alignment) - blocks.nbytes))
        os.chmod(temp, 0o644)  # mkstemp makes a file only its owner can read
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path


# ------------------------------------------------------------------------------------------------
# 38.4 Qwen3 as llama.cpp's "qwen3"
# ------------------------------------------------------------------------------------------------
# llama.cpp names tensors its own way (token_embd, blk.N.attn_q, ...) and reads the shape from
# qwen3.* keys. No weight is rearranged: llama.cpp's converter (convert_hf_to_gguf.py) permutes
# the q and k rows of LlamaModel (its `undo_permute`), because llama.cpp's "llama" RoPE turns
# adjacent pairs (x_2i, x_2i+1) while Hugging Face's Llama turns halves (x_i, x_i+D/2). Its
# Qwen3Model (a Qwen2Model) permutes nothing: llama.cpp runs qwen3 with NEOX RoPE, which turns
# halves, as 07's apply_rope does.

_QWEN3_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                "model.norm.weight": "output_norm.weight"}
_QWEN3_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down"}
_CONTROL, _USER_DEFINED, _NORMAL, _UNUSED = 3, 4, 1, 5  # llama.cpp's token types


def gguf_tensor_name(name):
    """A Qwen3 parameter's llama.cpp name (model.layers.3.mlp.up_proj.weight ->
    blk.3.ffn_up.weight)."""
    if name in _QWEN3_NAMES:
        return _QWEN3_NAMES[name]
    layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
    if layer is None or layer[2] not in _QWEN3_LAYER_NAMES:
        raise ValueError(f"{name!r} is not a Qwen3 parameter")
    return f"blk.{layer[1]}.{_QWEN3_LAYER_NAMES[layer[2]]}.weight"


def _qwen3_metadata(cfg):
    return {"general.architecture": "qwen3",
            "qwen3.context_length": ("uint32", cfg.max_position_embeddings),
            "qwen3.embedding_length": ("uint32", cfg.hidden_size),
            "qwen3.block_count": ("uint32", cfg.num_hidden_layers),
            "qwen3.feed_forward_length": ("uint32", cfg.intermediate_size),
            "qwen3.attention.head_count": ("uint32", cfg.num_attention_heads),
            "qwen3.attention.head_count_kv": ("uint32", cfg.num_key_value_heads),
            "qwen3.attention.key_length": ("uint32", cfg.head_dim),
            "qwen3.attention.value_length": ("uint32", cfg.head_dim),
            "qwen3.rope.freq_base": ("float32", float(cfg.rope_theta)),
            "qwen3.attention.layer_norm_rms_epsilon": ("float32", float(cfg.rms_norm_eps))}


# The tokenizer goes in as tokenizer.ggml.* keys: llama.cpp's "gpt2" model is byte-level BPE, its
# tokens spelled in GPT-2's byte characters as tokenizer.json spells them, with the merges;
# tokenizer.ggml.pre names the split regex ("gpt2": GPT-2's, main's demo tokenizer; "qwen2":
# Qwen's, after NFC). A file read back rebuilds the tokenizer.json those keys describe and loads
# it as chapter 17 does (gguf_tokenizer).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS = {  # tokenizer.ggml.pre -> tokenizer.json's normalizer and pre_tokenizer
    "gpt2": (None, {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": True}),
    "qwen2": ({"type": "NFC"}, {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
         "use_regex": False}]})}


def _pre_tokenizer_name(tokenizer):
    """tokenizer.ggml.pre for a Tokenizer: the _PRE_TOKENIZERS entry it was built from."""
    for name, (normalizer, pre_tokenizer) in _PRE_TOKENIZERS.items():
        pattern = _split_pattern({"pre_tokenizer": pre_tokenizer}, name)
        # tiktoken keeps the regex an Encoding was built with as _pat_str
        if tokenizer.bpe._pat_str == pattern and (normalizer is None) == (
                tokenizer.normalize is _as_is):
            return name
    raise ValueError(f"the tokenizer's pre-tokenizer is none of llama.cpp's "
                     f"{sorted(_PRE_TOKENIZERS)} (as this stage writes them)")


def gguf_tokenizer_metadata(tokenizer, vocab_size):
    """llama.cpp's tokenizer.ggml.* keys for a Tokenizer (chapter 17) over a model of vocab_size
    ids. An added token is written as its text, an id the tokenizer lacks as "[PAD<id>]" of type
    unused, as llama.cpp's converter does. The merges are recovered from the BPE ranks (tiktoken
    keeps no merges)."""
    to_char = {b: c for c, b in byte_level_alphabet().items()}
    added = {i: content for content, i in tokenizer._added_id.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        data = tokenizer.token_bytes[i] if i < len(tokenizer.token_bytes) else b""
        if i in added:
            tokens.append(added[i])
            types.append(_CONTROL if i in tokenizer.special_ids else _USER_DEFINED)
        elif data:
            tokens.append("".join(to_char[b] for b in data))
            types.append(_NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(_UNUSED)
    bpe = tokenizer.bpe
    ranks = {token: bpe.encode_single_token(token) for token in bpe.token_byte_values()}
    merges = [f"{a} {b}" for a, b in byte_level_bpe_json(ranks, [])["model"]["merges"]]
    metadata = {"tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": _pre_tokenizer_name(tokenizer),
                "tokenizer.ggml.tokens": ("string", tokens),
                "tokenizer.ggml.token_type": ("int32", types),
                "tokenizer.ggml.merges": ("string", merges),
                "tokenizer.ggml.add_bos_token": False}  # encode adds no bos, nor does Qwen
    if tokenizer.eos_token_ids:
        # Qwen3's files name every eos id, <|endoftext|> and <|im_end|>; GGUF has one: the
        # latter, their tokenizer_config.json's eos_token (llama.cpp ends generation at either:
        # it knows both by their text)
        metadata["tokenizer.ggml.eos_token_id"] = ("uint32", max(tokenizer.eos_token_ids))
    if tokenizer.chat_template is not None:
        metadata["tokenizer.chat_template"] = tokenizer.chat_template
    return metadata


def gguf_tokenizer(metadata, path):
    """The Tokenizer a GGUF file's tokenizer.ggml.* keys describe (metadata as read_gguf_raw
    returns it): written out as the tokenizer.json and tokenizer_config.json they stand for, in a
    temporary folder, and loaded as chapter 17 loads a model directory's."""
    def get(key):
        if key not in metadata:
            raise DataError(f"{path}: metadata key {key!r} is missing: the file holds no "
                            f"tokenizer this stage reads")
        return _plain(*metadata[key])

    if get("tokenizer.ggml.model") != "gpt2" or get("tokenizer.ggml.pre") not in _PRE_TOKENIZERS:
        raise DataError(f"{path}: tokenizer {get('tokenizer.ggml.model')!r} with pre-tokenizer "
                        f"{get('tokenizer.ggml.pre')!r}: this stage reads byte-level BPE ('gpt2') "
                        f"with the pre-tokenizers {sorted(_PRE_TOKENIZERS)}")
    tokens, types = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.token_type")
    if len(types) != len(tokens):
        raise DataError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for "
                        f"{len(tokens)} tokens")
    normalizer, pre_tokenizer = _PRE_TOKENIZERS[get("tokenizer.ggml.pre")]
    special = {_CONTROL: True, _USER_DEFINED: False}
    spec = {"normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
            "decoder": {"type": "ByteLevel"},
            "added_tokens": [{"id": i, "content": token, "special": special[kind],
                              "normalized": False} for i, (token, kind) in
                             enumerate(zip(tokens, types)) if kind in special],
            "model": {"type": "BPE", "merges": get("tokenizer.ggml.merges"),
                      "vocab": {token: i for i, (token, kind) in enumerate(zip(tokens, types))
                                if kind == _NORMAL}}}
    config = {}
    if "tokenizer.ggml.eos_token_id" in metadata:
        config["eos_token"] = tokens[get("tokenizer.ggml.eos_token_id")]
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = get("tokenizer.chat_template")
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
        (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        try:
            return load_tokenizer(folder)
        except DataError as e:
            raise DataError(f"{path}: its tokenizer.ggml.* keys: {e}") from None


def float_weights(model):
    """The model's weights by name, a quantized linear's dequantized (its name + ".weight")."""
    twins = {name: m for name, m in model.named_modules() if isinstance(m, _QuantizedLinear)}
    weights = {name: t for name, t in model.state_dict().items()
               if name.rsplit(".", 1)[0] not in twins}
    return {**weights, **{f"{name}.weight": m.dequantize() for name, m in twins.items()}}


def qwen3_to_gguf(model, tokenizer, path, ggml_type="F16"):
    """Write a Qwen3 (and its tokenizer, unless None) as a GGUF file llama.cpp runs, every matrix
    in ggml_type (a quantized linear from its dequantized weight). Norms (1-D) stay F32 whatever
    the type, as llama.cpp keeps them; a matrix whose rows are not whole blocks of ggml_type
    falls back to F16, with a warning. Returns {tensor name: type written}."""
    block = _ggml_type(ggml_type).block
    tensors, fallback = {}, []
    for name, w in float_weights(model).items():
        kind = "F32" if w.dim() == 1 else ggml_type
        if w.shape[-1] % GGML_TYPES[kind].block:
            kind = "F16"
            fallback.append(name)
        tensors[gguf_tensor_name(name)] = (w, kind)
    if fallback:
        warnings.warn(f"{len(fallback)} matrices have rows that are not whole {ggml_type} blocks "
                      f"of {block} values, and are written as F16: {', '.join(fallback)}")
    metadata = _qwen3_metadata(model.cfg)
    if tokenizer is not None:
        metadata.update(gguf_tokenizer_metadata(tokenizer, model.cfg.vocab_size))
    write_gguf(path, metadata, tensors)
    return {name: kind for name, (_, kind) in tensors.items()}


def _qwen3_config(metadata, path, vocab_size, tied):
    """The Qwen3Config a qwen3 GGUF's metadata describes; defaults as llama.cpp's."""
    def get(key, default=None):
        if key not in metadata and default is None:
            raise DataError(f"{path}: metadata key {key!r} is missing (a qwen3 file has it)")
        value_type, value = metadata.get(key, ("", default))
        # a float32 reads back as its shortest decimal: 1e-06, not 9.999999974752427e-07
        return float(str(np.float32(value))) if value_type == "float32" else value

    arch = get("general.architecture")
    if arch != "qwen3":
        raise DataError(f"{path}: general.architecture is {arch!r}; this loader reads 'qwen3'")
    if get("qwen3.rope.scaling.type", "none") != "none":
        raise DataError(f"{path}: qwen3.rope.scaling.type is set; this model implements plain "
                        f"RoPE only")
    hidden, heads = get("qwen3.embedding_length"), get("qwen3.attention.head_count")
    head_dim = get("qwen3.attention.key_length", hidden // heads)
    if get("qwen3.attention.value_length", head_dim) != head_dim:
        raise DataError(f"{path}: qwen3.attention.value_length differs from key_length")
    try:
        return Qwen3Config(
            vocab_size=vocab_size, hidden_size=hidden,
            intermediate_size=get("qwen3.feed_forward_length"),
            num_hidden_layers=get("qwen3.block_count"), num_attention_heads=heads,
            num_key_value_heads=get("qwen3.attention.head_count_kv", heads), head_dim=head_dim,
            rms_norm_eps=get("qwen3.attention.layer_norm_rms_epsilon"),
            rope_theta=get("qwen3.rope.freq_base", 10000.0),
            max_position_embeddings=get("qwen3.context_length"), tie_word_embeddings=tied)
    except ValueError as e:  # a value Qwen3Config refuses (it names the field)
        raise DataError(f"{path}: {e}") from None


def qwen3_from_gguf(path, device=None, dtype=None):
    """A Qwen3 in eval mode from a qwen3 GGUF file, its weights dequantized to `dtype` (default:
    float32 on a CPU, bfloat16 on a GPU) on `device` (default: CUDA when there is one). The
    tokenizer keys are not read: 07's tokenizer loads from tokenizer.json."""
    metadata, stored = read_gguf_raw(path)
    if "token_embd.weight" not in stored:
        raise DataError(f"{path}: no tensor 'token_embd.weight'")
    cfg = _qwen3_config(metadata, path, stored["token_embd.weight"].shape[0],
                        tied="output.weight" not in stored)
    device = torch.device(device if device is not None
                          else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    with torch.device("meta"):
        model = Qwen3(cfg)  # shapes only
    names = {gguf_tensor_name(name): name for name in model.state_dict()}
    missing, unexpected = sorted(set(names) - set(stored)), sorted(set(stored) - set(names))
    if missing or unexpected:
        raise DataError(f"{path}: the tensors do not match the metadata's shape: missing "
                        f"{missing[:5]}, unexpected {unexpected[:5]}")
    state = {}
    for gguf_name, name in names.items():  # one tensor dequantized at a time
        t, expected = stored[gguf_name], tuple(model.state_dict()[name].shape)
        if t.shape != expected:
            raise DataError(f"{path}: tensor {gguf_name!r} has shape {t.shape}; the metadata "
                            f"implies {expected}")
        state[name] = ggml_dequantize(t.blocks, t.type, t.shape).to(device=device, dtype=dtype)
    model.load_state_dict(state, assign=True)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.use_kernels(device.type == "cuda").eval()
# ----------------------------------------------------------------------------------------------
# Quality, measured: a small Qwen3 trained here, and what each method costs it
# ----------------------------------------------------------------------------------------------
# NEW in stage 09. Random weights have no outliers and random inputs no structure: every method
# rounds them about equally badly. So quality is measured on a model that has learned something,
# a small Qwen3 trained here on the-verdict.txt (the story stages 02-06 train on): 90% of its
# tokens to train on and to calibrate with, the last 10% held out. Each method quantizes a copy;
# the table gives its held-out perplexity and each layer's output error ||W X - W_hat X|| / ||W X||
# on held-out activations (layer_errors). With --model the same table runs on a real Qwen3. On
# the CPU's small model (a few hundred held-out tokens, a model that has learned little that 4
# bits lose) the perplexities move by less than their noise: there the layer errors are the
# measure. The training loop is the least that trains (AdamW, warmup then cosine decay,
# clipping); part 2 of this stage brings back stage 03's loop for fine-tuning.

# the model trained here and how: seconds on a CPU, a few minutes on a GPU. Every input size
# (C, Hq * D, I) is a multiple of 128, the default group size.
QUALITY_RUNS = {
    "cpu": dict(cfg=Qwen3Config(vocab_size=8256, hidden_size=128, intermediate_size=384,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=32, max_position_embeddings=256,
                                tie_word_embeddings=False),
                steps=100, context=64, batch=8, lr=3e-3),
    "cuda": dict(cfg=Qwen3Config(vocab_size=8256, hidden_size=512, intermediate_size=1536,
                                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                 head_dim=64, max_position_embeddings=512,
                                 tie_word_embeddings=False),
                 steps=300, context=128, batch=16, lr=1e-3),
}
MODEL_CONTEXT = 128  # tokens a window of a real model (--model): the-verdict is ~4,500 of Qwen3's
# --method: what it makes of a model's linears (quantize_with); "w8a8-rtn" shows what smoothing buys
METHODS = {"int8": "int8, RTN", "int4": "int4, RTN", "gptq": "int4, GPTQ", "awq": "int4, AWQ",
           "w8a8-rtn": "W8A8, RTN", "w8a8": "W8A8, SmoothQuant"}


def verdict_tokens(tokenizer, data_dir=None):
    """the-verdict.txt (downloaded on first use) as token ids, a 1-D int64 tensor."""
    text = data_file("the-verdict.txt", data_dir).read_text(encoding="utf-8")
    return torch.tensor(tokenizer.encode(text))


def windows(tokens, length):
    """tokens (n,) cut into whole windows of `length`: (n // length, length)."""
    n = len(tokens) // length
    return tokens[:n * length].view(n, length)


def train_small_qwen3(tokens, cfg, steps, context, batch, lr, device, seed=0):
    """A Qwen3 of shape cfg, from random_model's weights, trained on random windows of tokens
    (1-D int64) for `steps` steps of `batch` windows of `context` tokens: AdamW, 10 steps of
    linear warmup, cosine decay to lr / 10, gradients clipped at norm 1. Float32, eval mode."""
    model = random_model(cfg, device, torch.float32, seed).use_kernels(False).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    start, losses = time.perf_counter(), torch.zeros(steps, device=device)  # read back once
    for step in range(steps):
        starts = torch.randint(0, len(tokens) - context, (batch,), generator=gen)
        xy = torch.stack([tokens[s:s + context + 1] for s in starts.tolist()]).to(device)
        decay = 0.5 * (1 + math.cos(math.pi * step / steps))  # 1 -> 0
        for group in opt.param_groups:
            group["lr"] = lr * min(1, (step + 1) / 10) * (0.1 + 0.9 * decay)
        loss = F.cross_entropy(model(xy[:, :-1]).flatten(0, 1), xy[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses[step] = loss.detach()
    seconds, losses = time.perf_counter() - start, losses.tolist()
    print(f"trained {steps} steps of {batch} x {context} tokens in {seconds:.1f} s "
          f"({steps * batch * context / seconds:,.0f} tokens/s): loss {losses[0]:.2f} -> "
          f"{sum(losses[-10:]) / len(losses[-10:]):.2f}")
    return model.use_kernels(device.type == "cuda").eval()


@torch.no_grad()
def perplexity(model, held_out):
    """exp(mean cross-entropy) of each token of held_out (n, T + 1) after the ones before it."""
    logits = model(held_out[:, :-1])  # (n, T, V)
    return math.exp(F.cross_entropy(logits.float().flatten(0, 1), held_out[:, 1:].flatten()))


def quantize_with(model, method, group_size, calibration):
    """Quantize `model` in place by one of METHODS (calibration: batches of ids (B, T) for GPTQ,
    AWQ and SmoothQuant). Returns the folds layer_errors needs, or None."""
    if method in ("int8", "int4"):
        quantize_model(model, method, group_size)
    elif method == "w8a8-rtn":
        quantize_model(model, "w8a8")
    elif method == "gptq":
        gptq_quantize_model(model, calibration, group_size=group_size)
    elif method == "awq":
        return awq_quantize_model(model, calibration, group_size)
    elif method == "w8a8":
        return smoothquant_model(model, calibration)
    else:
        raise ValueError(f"method {method!r} is not one of {list(METHODS)}")
    return None


def quality_table(model, calibration, held_out, group_size, keep, per_layer=True):
    """Quantize a copy of `model` by each of METHODS, calibrating on `calibration` (batches of
    ids), and print one table: held-out perplexity (held_out (n, T + 1)) and the mean and
    largest output error of the layers on held-out activations; then, with per_layer, each
    layer's error by method. Returns ({method: {"perplexity", "errors": {layer: error}}}, the
    copy quantized by `keep`)."""
    results = {"float": {"perplexity": perplexity(model, held_out), "errors": {}}}
    kept = None
    for method in METHODS:
        start = time.perf_counter()
        quantized = copy.deepcopy(model)
        folds = quantize_with(quantized, method, group_size, calibration)
        results[method] = {"perplexity": perplexity(quantized, held_out), "seconds":
                           time.perf_counter() - start,
                           "errors": layer_errors(model, quantized, held_out[:, :-1], folds)}
        kept = quantized if method == keep else kept
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    table = Table(f"held-out perplexity ({held_out[:, 1:].numel():,} tokens) and each layer's "
                  f"output error on held-out activations; int4 in groups of {group_size}",
                  [("method", 21, ""), ("perplexity", 10, ",.2f"), ("layer error: mean", 17, ".4f"),
                   ("max", 7, ".4f"), ("seconds", 7, ".1f")])
    table.row(f"{dtype}, unquantized", results["float"]["perplexity"], "", "", "")
    for method, label in METHODS.items():
        r = results[method]
        errors = list(r["errors"].values())
        table.row(label, r["perplexity"], sum(errors) / len(errors), max(errors), r["seconds"])
    if per_layer:
        table = Table("each layer's output error, by method",
                      [("layer", 22, "")] + [(method, 8, ".4f") for method in METHODS])
        for name in results["int8"]["errors"]:
            table.row(name.removeprefix("model.layers."),
                      *(results[method]["errors"][name] for method in METHODS))
    return results, kept


# ----------------------------------------------------------------------------------------------
# Chapter 44. The benches (python 09_quant_lora.py --bench)
# ----------------------------------------------------------------------------------------------
# Each bench prints a table, a row as soon as its figures are in, against a baseline measured in
# the same run: the copy bandwidth and cuBLAS in bf16 for the kernels, the bf16 model for decode.
# Weights are random in Qwen3-0.6B's and Qwen3-8B's shapes (no download): speed depends on shapes
# only.

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


def bytes_per_step(model, batch, context):
    """Bytes a decode step reads at least: the weights (the embedding only when it is the output
    layer too: a lookup reads just its rows) and `context` cached positions of every row."""
    cfg = model.cfg
    # changed in 09: a quantized layer's weights are buffers (integers, scales, zeros)
    weights = sum(t.nbytes for t in model.state_dict().values())
    if not cfg.tie_word_embeddings:
        weights -= model.model.embed_tokens.weight.nbytes
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * context * batch
    return weights + kv * model.model.embed_tokens.weight.element_size()


# -- decode: a step of the same generate loop in bf16, int8 and int4 ----------------------------
# NEW in stage 09. At batch 1 a step reads every weight once: int8 halves those bytes and int4
# quarters them, so the step should shrink with them until the rest of the step (the cache, the
# norms, attention, the host's launch of the graph) is what is left.

def decode_step_seconds(model, prompt_len=16, steps=(32, 160)):
    """Seconds of one decode step of generate at batch 1 (greedy, its decode replayed from a CUDA
    graph): the time of steps[1] tokens less that of steps[0], over the difference, so that the
    prefill and the graph's capture, in both, cancel."""
    prompts = random_prompts(model.cfg.vocab_size, [prompt_len], seed=0)

    def seconds(n):
        return _timed(lambda: generate(model, prompts, SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True)))

    return (seconds(steps[1]) - seconds(steps[0])) / (steps[1] - steps[0])


def bench_decode(device, copy_gbs, name="Qwen3-8B", group_size=128):
    """Batch-1 decode at the shape of BENCH_MODELS[name], random weights, through generate: bf16,
    then the same weights quantized to int8 and to int4 (RTN). Returns {method: step seconds}."""
    cfg, results = BENCH_MODELS[name], {}
    table = Table(f"decode at batch 1, {name} shape, random weights, generate's loop (CUDA graph): "
                  f"a step's time and the bytes it reads (weights, cache) against the copy "
                  f"bandwidth; int4 in groups of {group_size}",
                  [("weights", 8, ""), ("GB", 6, ".2f"), ("step µs", 8, ",.0f"),
                   ("tok/s", 7, ",.0f"), ("GB/s", 7, ",.0f"), ("of copy", 7, ".0%"),
                   ("x bf16", 6, ".2f")])
    for method in ("bf16", "int8", "int4"):
        model = random_model(cfg, device, torch.bfloat16)
        if method != "bf16":
            quantize_model(model, method, group_size)
        step = results[method] = decode_step_seconds(model)
        nbytes = bytes_per_step(model, 1, 16 + 96)  # the average context of the timed steps
        table.row(method, nbytes / 1e9, step * 1e6, 1 / step, nbytes / step / 1e9,
                  nbytes / step / 1e9 / copy_gbs, results["bf16"] / step)
        del model
        torch.cuda.empty_cache()
    return results


# -- the int4 matrix-vector kernel against the copy bandwidth, cuBLAS and GemLite ---------------

BENCH_SHAPES = {"q_proj, o_proj": (4096, 4096), "k_proj, v_proj": (1024, 4096),
                "gate_proj, up_proj": (12288, 4096), "down_proj": (4096, 12288)}  # 8B's (N, K)


def _gemlite_ms(x, qweight, scales, zeros, group_size):
    """Milliseconds of GemLite's int4 layer (a peer's Triton kernels) on the same weights and x,
    or why there are none: the gemlite package is not installed, or it failed."""
    try:
        from gemlite.helper import A16Wn
    except ImportError:
        return "not installed (pip install gemlite, a pure-Python wheel)"
    try:
        q = unpack_int4(qweight).to(torch.uint8)  # (N, K), its format: hqq's (q - zero) * scale
        layer = A16Wn(device=qweight.device, dtype=scales.dtype).from_weights(
            q, scales, zeros, W_nbits=4, group_size=group_size)
        return _ms(lambda: layer(x))
    except Exception as err:  # noqa: BLE001 (a peer's failure is reported, not ours to fix)
        return f"failed ({type(err).__name__}: {str(err).splitlines()[0][:80]})"


def bench_matvec(device, copy_gbs, group_size=128):
    """At batch 1 on Qwen3-8B's projections: int4_matvec's time and the bytes it reads (packed
    weights, scales, zeros, x and y) against the copy bandwidth; int8_matvec's; cuBLAS bf16's;
    GemLite's int4 kernel on the same weights, and its time over int4_matvec's. Returns {shape
    name: int4's fraction of the copy bandwidth}."""
    table = Table(f"matrix-vector at batch 1 (decode), Qwen3-8B's projections, int4 in groups of "
                  f"{group_size}: µs, and the fraction of the copy bandwidth on the bytes each "
                  f"reads",
                  [("layer", 18, ""), ("N x K", 12, ""), ("int4 µs", 7, ".1f"),
                   ("of copy", 7, ".0%"), ("int8 µs", 7, ".1f"), ("of copy", 7, ".0%"),
                   ("bf16 µs", 7, ".1f"), ("of copy", 7, ".0%"), ("GemLite µs", 10, ""),
                   ("/ int4", 6, "")])
    results, why = {}, None
    for name, (N, K) in BENCH_SHAPES.items():
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, K, device=device, dtype=torch.bfloat16)
        int4, int8 = quantize_int4(w, group_size), quantize_int8(w)
        io = (K + N) * 2  # x read, y written
        t4 = _ms(lambda: int4_matvec(x, *int4, group_size)) / 1e3
        t8 = _ms(lambda: int8_matvec(x, *int8)) / 1e3
        tb = _ms(lambda: F.linear(x, w)) / 1e3
        b4, b8 = sum(t.nbytes for t in int4) + io, sum(t.nbytes for t in int8) + io
        gemlite = _gemlite_ms(x, *int4, group_size)
        results[name] = b4 / t4 / 1e9 / copy_gbs
        if isinstance(gemlite, str):
            why, gemlite = gemlite, ("-", "-")
        else:
            gemlite = (f"{gemlite * 1e3:.1f}", f"{gemlite / 1e3 / t4:.2f}")
        table.row(name, f"{N} x {K}", t4 * 1e6, results[name], t8 * 1e6,
                  b8 / t8 / 1e9 / copy_gbs, tb * 1e6, (w.nbytes + io) / tb / 1e9 / copy_gbs,
                  *gemlite)
    if why is not None:
        print(f"  (GemLite: {why})")
    return results


# -- prefill: the int4 matrix-matrix kernel against cuBLAS in bf16 ------------------------------

def bench_matmul(device, tokens=4096, group_size=128):
    """At `tokens` rows (a long prompt) on Qwen3-8B's projections: TFLOP/s of cuBLAS in bf16,
    int4_matmul, int8_matmul and W8A8 (its activations quantized in the same call), and each
    against cuBLAS. Returns {shape name: int4 / cuBLAS}."""
    table = Table(f"matrix-matrix at {tokens:,} tokens (prefill), Qwen3-8B's projections: "
                  f"TFLOP/s, and x cuBLAS bf16",
                  [("layer", 18, ""), ("N x K", 12, ""), ("bf16", 6, ".0f"), ("int4", 6, ".0f"),
                   ("x bf16", 6, ".2f"), ("int8", 6, ".0f"), ("x bf16", 6, ".2f"),
                   ("W8A8", 6, ".0f"), ("x bf16", 6, ".2f")])
    results = {}
    for name, (N, K) in BENCH_SHAPES.items():
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02
        x = torch.randn(tokens, K, device=device, dtype=torch.bfloat16)
        int4, int8 = quantize_int4(w, group_size), quantize_int8(w)
        flop = 2 * tokens * N * K / 1e9  # TFLOP per ms
        tb = _ms(lambda: F.linear(x, w))
        t4 = _ms(lambda: int4_matmul(x, *int4, group_size))
        t8 = _ms(lambda: int8_matmul(x, *int8))
        tw = _ms(lambda: int8_w8a8_matmul(*quantize_per_token(x), *int8, x.dtype))
        results[name] = tb / t4
        table.row(name, f"{N} x {K}", flop / tb, flop / t4, tb / t4, flop / t8, tb / t8,
                  flop / tw, tb / tw)
    return results


# -- GPTQ's own time ------------------------------------------------------------------------------

def bench_gptq(device, name="Qwen3-0.6B", sequences=16, length=512, group_size=128):
    """Seconds of gptq_quantize_model on a random model of BENCH_MODELS[name]'s shape in bf16,
    calibrated on `sequences` random sequences of `length` tokens (the time depends on shapes)."""
    cfg = BENCH_MODELS[name]
    gen = torch.Generator(device).manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (4, length), generator=gen, device=device)
               for _ in range(sequences // 4)]
    seconds = _timed(lambda: gptq_quantize_model(random_model(cfg, device, torch.bfloat16),
                                                 batches, group_size=group_size))
    print(f"\nGPTQ, {name} shape ({cfg.num_hidden_layers} blocks x 7 linears), int4 in groups of "
          f"{group_size}, {sequences} x {length} calibration tokens: {seconds:.1f} s (the model's "
          f"random weights made in that time too)")
    return seconds


# ----------------------------------------------------------------------------------------------
# The demos and main
# ----------------------------------------------------------------------------------------------

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


def demo_tokenizer(folder, data_dir=None):  # changed in 09: main's model is trained here
    """Write main's model's tokenizer into `folder` (see DEMO_RANKS): GPT-2's ranks from
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


def demo_model(args):
    """(model, tokenizer, the-verdict.txt's ids in that tokenizer) of --model, or of the small
    Qwen3 trained here (QUALITY_RUNS) with main's demo tokenizer, the last 10% of the ids held
    out of its training. On a CPU, one thread: a second gains a small model nothing and can make
    it wait."""
    device = torch.device(args.device)
    if args.model is not None:
        folder = model_folder(args.model, args.data_dir)
        model = load_qwen3(folder, device, MODEL_DTYPES.get(args.dtype))
        tokenizer = load_tokenizer(folder)
        cfg = model.cfg
        print(f"Qwen3 from {args.model}: {cfg.num_hidden_layers} layers, C={cfg.hidden_size}, "
              f"{model.num_params() / 1e6:,.0f}M parameters in float, "
              f"{next(model.parameters()).dtype} on {device}")
        return model, tokenizer, verdict_tokens(tokenizer, args.data_dir)
    if device.type == "cpu":
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = load_tokenizer(demo_tokenizer(tmp, args.data_dir))
    tokens = verdict_tokens(tokenizer, args.data_dir)
    run, split = QUALITY_RUNS[device.type], len(tokens) * 9 // 10
    cfg = run["cfg"]
    print(f"a small Qwen3 ({cfg.num_hidden_layers} layers, C={cfg.hidden_size}, "
          f"I={cfg.intermediate_size}, {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads "
          f"of {cfg.head_dim}, V={cfg.vocab_size:,}) trained on the first {split:,} of "
          f"the-verdict.txt's {len(tokens):,} tokens (main's tokenizer: GPT-2's first tokens)")
    model = train_small_qwen3(tokens[:split], **run, device=device, seed=args.seed)
    return model, tokenizer, tokens


def check_quantized_kernels(model, ids, group_size):
    """The twins' Triton kernels against their torch paths, inside the model: logits of a prompt
    ids (1, T), T > MATVEC_MAX_ROWS (the matmul), and of its first token alone (the matvec), for
    int8, int4 and W8A8 (RTN). Prints and returns the largest relative error."""
    where = "Triton's interpreter" if INTERPRET else torch.cuda.get_device_name(ids.device)
    errors = {}
    with torch.no_grad():
        for method in ("int8", "int4", "w8a8"):
            quantized = quantize_model(copy.deepcopy(model), method, group_size)
            twins = [m for m in quantized.modules() if isinstance(m, _QuantizedLinear)]
            logits = []
            for on in (False, True):
                for twin in twins:
                    twin.kernels = on
                logits.append(torch.cat([quantized(ids)[0], quantized(ids[:, :1])[0]]).float())
            errors[method] = ((logits[1] - logits[0]).norm() / logits[0].norm()).item()
    print(f"the quantized layers on their Triton kernels ({where}) vs their torch paths, logits "
          f"of a {ids.shape[1]}-token prompt (matmul) and of 1 token (matvec): " +
          ", ".join(f"{method} rel err {error:.1e}" for method, error in errors.items()))
    return max(errors.values())


def show_gguf(model, tokenizer, args):
    """Chapter 38: the model (and its tokenizer) written as GGUF files of a few types, read back:
    each file's size, its logits against the model's, whether it generates the model's greedy
    tokens, and the tokenizer read back from the file encoding --prompt alike."""
    ids = tokenizer.encode(args.prompt)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    device, dtype = _device_of(model), next(model.parameters()).dtype
    with torch.no_grad():
        logits, tokens = model(torch.tensor([ids], device=device)), generate(model, [ids], params)
    print(f"\nGGUF files of this model, written and read back ({len(ids)}-token prompt, "
          f"{args.max_tokens} greedy tokens):")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("F16", "Q8_0", "Q4_0"):
            path = Path(tmp) / f"model-{kind}.gguf"
            qwen3_to_gguf(model, tokenizer, path, kind)
            loaded = qwen3_from_gguf(path, device, dtype)
            with torch.no_grad():
                error = ((loaded(torch.tensor([ids], device=device)) - logits).norm()
                         / logits.norm()).item()
            same = generate(loaded, [ids], params) == tokens
            print(f"  {kind:5} {path.stat().st_size / 1e6:6.2f} MB  logits off by {error:.1e} "
                  f"(relative), greedy tokens {'identical' if same else 'DIFFERENT'}")
        read_back = gguf_tokenizer(read_gguf_raw(path)[0], path)
        print(f"  its tokenizer, read back from the file: --prompt encodes "
              f"{'alike' if read_back.encode(args.prompt) == ids else 'DIFFERENTLY'}")


def show_generation(model, tokenizer, args, label):
    """Greedy tokens for --prompt through generate, printed as text, with the rate."""
    ids = tokenizer.encode(args.prompt)
    start = time.perf_counter()
    out = generate(model, [ids], SamplingParams(temperature=0, max_tokens=args.max_tokens),
                   eos_token_ids=tokenizer.eos_token_ids)[0]
    seconds = time.perf_counter() - start
    print(f"\ngenerated by the {label} model ({len(out)} tokens, greedy, {len(out) / seconds:,.0f} "
          f"tokens/s on {_device_of(model)}):\n  {args.prompt!r} -> {tokenizer.decode(out)!r}")


def show_quantization(model, tokenizer, tokens, args):
    """Chapters 20, 38 and 22 on the model: the kernels checked, the quality table of every
    method (calibrated on the first 90% of tokens, measured on the rest), GGUF files and the
    adapters (the small model only), and --prompt continued by the --method model. A GPTQ or AWQ checkpoint (chapter 39)
    has no float weights to compare: its perplexity, then its generation."""
    device, method = _device_of(model), args.method or "int4"
    context = QUALITY_RUNS[device.type]["context"] if args.model is None else MODEL_CONTEXT
    split = len(tokens) * 9 // 10
    held_out = windows(tokens[split:], context + 1).to(device)  # (n, T + 1)
    kinds = sorted({type(m).__name__ for m in model.modules() if isinstance(m, _QuantizedLinear)})
    if kinds:
        print(f"a quantized checkpoint, its layers {', '.join(kinds)}: held-out perplexity "
              f"{perplexity(model, held_out):,.2f}")
        show_generation(model, tokenizer, args, "checkpoint's")
        return
    group_size = args.group_size or 128
    calibration = list(windows(tokens[:split], context).to(device).split(8))  # batches (8, T)
    if device.type == "cuda" or (INTERPRET and args.model is None):
        check_quantized_kernels(model, held_out[:1, :MATVEC_MAX_ROWS + 8], group_size)
    else:  # the interpreter would take minutes on a real model
        print("(the Triton kernels not checked: that needs a GPU, or on a CPU Triton's "
              "interpreter and the small model trained here)")
    results, quantized = quality_table(model, calibration, held_out, group_size, method,
                                       per_layer=args.model is None)
    rtn = results["int4"]["errors"]
    for better in ("gptq", "awq"):
        errors = results[better]["errors"]
        wins = sum(errors[name] < rtn[name] for name in rtn)
        print(f"{METHODS[better]} against {METHODS['int4']}: mean layer error "
              f"{sum(errors.values()) / sum(rtn.values()):.2f}x, lower in {wins} of {len(rtn)} "
              f"layers")
    if args.model is None:
        show_gguf(model, tokenizer, args)
        show_adapters(model, held_out[:, :-1])
    show_generation(quantized, tokenizer, args, METHODS[method])


def show_adapters(model, ids, r=8):
    """Chapter 22 on the model (on copies): LoRA on every linear (B random, as after some
    training), what it trains, and its merge against the adapters' own forward; the base in NF4
    (QLoRA's) and its logits against the float model's."""
    def relative(a, b):
        return ((a - b).norm() / b.norm()).item()

    with torch.no_grad():
        lora = apply_lora(copy.deepcopy(model), r, 2 * r, "all-linear")
        for layer in lora_layers(lora).values():
            layer.lora_B.weight.normal_(0.0, 0.02)
        trained, adapted = trainable_summary(lora), lora(ids)
        merged = merge_lora(lora)(ids)
        nf4 = quantize_model_nf4(copy.deepcopy(model))
        base, reference = nf4(ids), model(ids)
    bits = next(m for m in nf4.modules() if isinstance(m, NF4Linear)).weight_nf4()
    print(f"\nLoRA, r = {r} on every linear ({trained}): merged into the weights against the "
          f"adapters' forward, rel err {relative(merged, adapted):.1e}")
    print(f"QLoRA's base in NF4 ({bits.bits_per_weight():.3f} bits a weight with double "
          f"quantization): logits {relative(base, reference):.1e} (relative) from the float "
          f"model's")


def save_gguf(model, tokenizer, args):
    """--save-gguf: the model and its tokenizer as a GGUF file of --type (written whole or not
    at all: write_gguf)."""
    kind = (args.type or "f16").upper()
    types = qwen3_to_gguf(model, tokenizer, args.save_gguf, kind)
    counts = Counter(types.values())
    print(f"wrote {args.save_gguf}: {Path(args.save_gguf).stat().st_size / 1e6:,.1f} MB, "
          f"{len(types)} tensors ({', '.join(f'{n} {t}' for t, n in counts.items())}) and the "
          f"tokenizer")


def generate_from_gguf(args):
    """--gguf: a Qwen3 and its tokenizer from a GGUF file, and --prompt continued."""
    device = torch.device(args.device)
    model = qwen3_from_gguf(args.gguf, device, MODEL_DTYPES.get(args.dtype))
    tokenizer = gguf_tokenizer(read_gguf_raw(args.gguf)[0], args.gguf)
    cfg = model.cfg
    print(f"Qwen3 from {args.gguf}: {cfg.num_hidden_layers} layers, C={cfg.hidden_size}, "
          f"V={cfg.vocab_size:,}, dequantized to {next(model.parameters()).dtype} on {device}")
    show_generation(model, tokenizer, args, "GGUF file's")


def positive_int(text):
    """argparse type: an integer >= 1 (0 is not a way to ask for the default)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face Qwen3 directory (float, or a GPTQ or AWQ "
                        "checkpoint), or a Hub id such as Qwen/Qwen3-0.6B (default: a small Qwen3 "
                        "trained here on the-verdict.txt)")
    parser.add_argument("--method", choices=list(METHODS),
                        help="how the model that continues --prompt is quantized: "
                        + ", ".join(f"{m} ({label})" for m, label in METHODS.items())
                        + " (default: int4); the quality table shows every method")
    parser.add_argument("--group-size", type=positive_int, help="int4's group of input columns, "
                        "a multiple of 8 dividing every input size of the model (default: 128)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="of --model or --gguf (default: the checkpoint's on a GPU, float32 on "
                        "a CPU)")
    parser.add_argument("--max-tokens", type=positive_int, default=16,
                        help="tokens to generate (default: 16)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed of the small model's training (its weights and batches)")
    parser.add_argument("--prompt", default="Every effort moves you",
                        help="the text to continue (default: %(default)r)")
    parser.add_argument("--save-gguf", metavar="PATH", help="instead: write the model (--model's, "
                        "or the small one trained here) and its tokenizer as a GGUF file")
    parser.add_argument("--type", choices=[name.lower() for name in GGML_TYPES],
                        help="--save-gguf's tensor type for the matrices (default: f16; norms "
                        "stay f32)")
    parser.add_argument("--gguf", metavar="PATH", help="instead: continue --prompt with the Qwen3 "
                        "and tokenizer of a GGUF file")
    parser.add_argument("--bench", action="store_true", help="instead, on a GPU: batch-1 decode "
                        "of Qwen3-8B's shape in bf16, int8 and int4; the int4 matrix-vector "
                        "kernel against the copy bandwidth, cuBLAS and GemLite; the int4 "
                        "matrix-matrix kernel against cuBLAS at 4,096 tokens; GPTQ's time on "
                        "Qwen3-0.6B's shape")
    parser.add_argument("--data-dir", help="download cache for Hub ids, the-verdict.txt and "
                        "GPT-2's tokenizer (default: data/)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser, args):
    """Every flag checked before any work (a download, a load, training) starts."""
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
    modes = [flag for flag, on in (("--bench", args.bench), ("--gguf", args.gguf is not None),
                                   ("--save-gguf", args.save_gguf is not None)) if on]
    if len(modes) > 1:
        parser.error(f"{modes[0]} and {modes[1]} do not go together")
    if args.type is not None and args.save_gguf is None:
        parser.error("--type applies to --save-gguf only")
    given = [flag for flag, value in (("--model", args.model), ("--method", args.method),
                                      ("--group-size", args.group_size)) if value is not None]
    if (args.bench or args.gguf is not None) and given:
        parser.error(f"{given[0]} does not apply to {modes[0]}")
    if args.save_gguf is not None and (args.method or args.group_size):
        parser.error(f"{'--method' if args.method else '--group-size'} does not apply to "
                     f"--save-gguf, which writes the float model (GGUF's types quantize it: "
                     f"--type)")
    if args.gguf is not None:
        check_gguf(parser, args)
    if args.save_gguf is not None:
        path = Path(args.save_gguf)
        if path.is_dir():
            parser.error(f"--save-gguf {path} is a directory; give the file to write")
        if not path.parent.is_dir():
            parser.error(f"--save-gguf {path}: directory {path.parent} does not exist")
    if args.model is not None:
        check_model(parser, args)
    elif not (args.bench or args.gguf is not None):
        cfg = QUALITY_RUNS[device.type]["cfg"]
        check_group_size(parser, args.group_size, cfg, "the small model trained here")
        check_max_tokens(parser, args.max_tokens, cfg.max_position_embeddings)


def check_model(parser, args):
    """--model: a directory or a Hub id; a directory's config.json (read, no weights) decides
    --max-tokens, and the group size (--method and --group-size do not apply to a checkpoint
    already quantized)."""
    if not args.model.strip():
        parser.error("--model is empty: give a directory or a Hub id, or leave it out for the "
                     "small model trained here")
    path = Path(args.model)
    if path.exists() and not path.is_dir():
        parser.error(f"--model {args.model} is a file; give the directory that holds it")
    if not path.exists() and not HUB_ID.fullmatch(args.model):
        parser.error(f"--model {args.model}: no such directory, and not a Hub id such as "
                     f"Qwen/Qwen3-0.6B")
    if path.is_dir() and (path / "config.json").is_file():
        cfg = Qwen3Config.from_json(path / "config.json")
        qconfig = quantization_config(path / "config.json", cfg)
        if qconfig is None:
            check_group_size(parser, args.group_size, cfg, args.model)
        elif args.method or args.group_size:
            parser.error(f"{'--method' if args.method else '--group-size'} does not apply to "
                         f"{args.model}, a {qconfig['method']} checkpoint already quantized")
        check_max_tokens(parser, args.max_tokens, cfg.max_position_embeddings)


def check_gguf(parser, args):
    """--gguf: a GGUF file whose context (from its metadata; a broken file is a DataError naming
    it) holds --max-tokens."""
    path = Path(args.gguf)
    if not path.is_file():
        parser.error(f"--gguf {path}: no such file")
    context = read_gguf_raw(path)[0].get("qwen3.context_length")
    if context is not None:
        check_max_tokens(parser, args.max_tokens, context[1])


def check_group_size(parser, group_size, cfg, what):
    """--group-size (default 128): a multiple of 8 (8 columns a packed word) that divides every
    input size of the model's linears."""
    group_size = group_size or 128
    sizes = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
             "num_attention_heads * head_dim": cfg.num_attention_heads * cfg.head_dim}
    bad = [f"{name} = {size}" for name, size in sizes.items() if size % group_size]
    if group_size % 8 or bad:
        parser.error(f"--group-size {group_size}: must be a multiple of 8 dividing every input "
                     f"size of {what}'s linears" + (f" ({', '.join(bad)})" if bad else ""))


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


def run_benches(args):
    device = torch.device(args.device)
    if device.type != "cuda":
        print("--bench: the benches time kernels on a CUDA GPU; a CPU shows correctness, not speed "
              "(run without --bench): nothing measured")
        return
    copy_gbs = _bench_copy_gbs()
    bench_decode(device, copy_gbs)
    bench_matvec(device, copy_gbs)
    bench_matmul(device)
    bench_gptq(device)


def main(argv=None):
    args = parse_args(argv)
    if args.bench:
        run_benches(args)
    elif args.gguf is not None:
        generate_from_gguf(args)
    else:
        model, tokenizer, tokens = demo_model(args)
        if args.save_gguf is not None:
            save_gguf(model, tokenizer, args)
        else:
            show_quantization(model, tokenizer, tokens, args)


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
DATA_FILES = {  # changed in 09: the-verdict.txt again, the quality section's training text
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


if __name__ == "__main__":
    try:
        main()
    except DataError as e:  # a missing or broken file: the message says which and what to do
        sys.exit(f"error: {e}")

