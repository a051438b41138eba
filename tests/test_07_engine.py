"""Stage 07: Qwen3, its tokenizer, the KV cache, the sampler, structured output and the engine
(continuous batching, the paged cache and its kernels, prefix caching, speculative decoding), on
the CPU; the tests marked gpu run the same on the Triton kernels.

The references: transformers' Qwen3ForCausalLM (logits, greedy generate), built from tiny random
configs and saved in the Hugging Face layout to temporary directories; a full forward pass
without a cache (for the cached paths); float64 formulas written out here (kernels, sampling
filters, penalties); counts of many draws against exact probabilities (the sampler's draw).
Triton kernels run through the interpreter.

The tokenizer: byte-level BPEs trained here with the `tokenizers` library on a small generated
corpus (one with Qwen2/Qwen3's normalizer, pre-tokenizer regex and added tokens, one with GPT-2's
byte-level regex and a special token trained into its vocabulary, one whose regex leaves text
between its matches): ids and decoded text must equal tokenizers' exactly (one difference by
design: NFC follows Python's Unicode tables, newer than tokenizers'; see
test_nfc_uses_pythons_unicode_tables); the chat format must equal transformers' rendering of
Qwen3's own chat template, text and ids.

Structured output: the regex subset against Python's re, every JSON schema keyword against a
validator written here, the token masks against a per-token walk, generation with random logits
and then through the engine with a random model, which must always give valid output.

The engine: every output under batching, chunked prefill, preemption, prefix caching and
speculation against transformers' greedy continuation of each prompt alone; seeded samples
against the same request alone; the block manager against a reference model kept in the test;
paged attention against float64 attention gathered through the block tables here; the
rejection sampler's output distribution against the target's by a chi-square test.
"""
import argparse
import copy
import dataclasses
import functools
import hashlib
import json
import math
import random
import re
import subprocess
import sys
import unicodedata

import numpy as np
import pytest
import requests
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, ROOT, check_bad_flag, load_stage, public_names, small_cuda_model
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

DEVICE = "cuda" if HAS_CUDA else "cpu"  # where the Triton kernels run (the interpreter on a CPU)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def q7():
    return load_stage("07_engine")


def tiny_hf_qwen3(seed=0, vocab_size=131, hidden_size=48, intermediate_size=80, layers=2,
                  heads=4, kv_heads=2, head_dim=32, theta=500.0, tied=False, eps=0.05,
                  max_positions=64):
    """transformers' Qwen3ForCausalLM on a tiny config of odd sizes, every weight random (norm
    gains around 1, so that a skipped or swapped one shows), eager attention, fp32, eval mode.
    A large eps and a small RoPE theta make a misplaced eps or a wrong theta visible. Hq * D =
    128 differs from the hidden size 48, as in Qwen3."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size,
                      intermediate_size=intermediate_size, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=max_positions, rms_norm_eps=eps,
                      rope_parameters={"rope_type": "default", "rope_theta": theta},
                      tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None, attn_implementation="eager")
    model = Qwen3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.5 * noise if "embed" in name
                    else 0.3 * noise)
    return model


def save_hf(model, folder, **kwargs):
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """One tiny untied GQA model (4 query heads, 2 kv heads) and its directory."""
    hf = tiny_hf_qwen3()
    return hf, save_hf(hf, tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def llm(q7, hf_dir):
    return q7.LLM(hf_dir[1], device="cpu", max_model_len=40, max_num_seqs=4)


def random_ids(n, vocab=131, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [random_ids(7, seed=1), random_ids(3, seed=2), random_ids(11, seed=3)]


# ---------------------------------------------------------------------------------- the config

def write_config(folder, **changes):
    """Change config.json of a saved model (a value of None deletes the key)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return path


def test_config_from_json_reads_both_rope_spellings(q7, tmp_path):
    # transformers v5's rope_parameters; v4's top-level rope_theta with rope_scaling null; no
    # theta at all: transformers' default, 10,000; absent optional keys: their defaults
    path = write_config(save_hf(tiny_hf_qwen3(), tmp_path))
    cfg = q7.Qwen3Config.from_json(path)
    assert (cfg.rope_theta, cfg.head_dim, cfg.num_key_value_heads, cfg.rms_norm_eps) == (500.0, 32, 2, 0.05)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
            cfg.num_attention_heads, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (
        131, 48, 80, 2, 4, 64, False)
    write_config(tmp_path, rope_parameters=None, rope_theta=12345.0)
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "rope_scaling": None}))
    assert q7.Qwen3Config.from_json(path).rope_theta == 12345.0
    write_config(tmp_path, rope_theta=None, rms_norm_eps=None, max_position_embeddings=None,
                 tie_word_embeddings=None)
    cfg = q7.Qwen3Config.from_json(path)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (
        10000.0, 1e-6, 32768, False)


@pytest.mark.parametrize("change, message", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
     "rope_parameters asks for RoPE type 'yarn'"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling asks for RoPE type 'linear'"),
    (dict(model_type="qwen3_moe"), "model_type = 'qwen3_moe' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act = 'gelu' is not supported"),
    (dict(attention_bias=True), "attention_bias = True is not supported"),
    (dict(use_sliding_window=True), "use_sliding_window = True is not supported"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(num_key_value_heads=3), r"bad Qwen3Config .*multiple of num_key_value_heads \(3\)"),
    (dict(head_dim=0), r"bad Qwen3Config .*head_dim = 0"),
    (dict(hidden_size=None, head_dim=None), r"lacks \['hidden_size', 'head_dim'\]"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor = 0.5 is not supported"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
     "rotates part of each head only"),
])
def test_config_refuses_what_it_cannot_compute(q7, hf_dir, tmp_path, change, message):
    (tmp_path / "config.json").write_text((hf_dir[1] / "config.json").read_text())
    path = write_config(tmp_path, **change)
    with pytest.raises(q7.DataError, match=message) as err:
        q7.Qwen3Config.from_json(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("field, value", [("vocab_size", 0), ("head_dim", 7), ("rms_norm_eps", 0.0),
                                          ("rope_theta", float("nan")), ("num_hidden_layers", True),
                                          ("tie_word_embeddings", 1)])
def test_config_names_a_bad_field(q7, field, value):
    with pytest.raises(ValueError, match=rf"Qwen3Config\.{field} = "):
        q7.Qwen3Config(**{field: value})


# -------------------------------------------------------------------- logits against transformers

LOGIT_CASES = {  # name -> (tiny_hf_qwen3 arguments, how to save, config.json changes)
    "tied, Hkv=1": (dict(tied=True, kv_heads=1, theta=10000.0), {}, {}),
    "untied, Hkv=Hq, theta 77": (dict(kv_heads=4, theta=77.0, head_dim=64), {}, {}),
    "sharded, GQA 4/2": (dict(seed=5), dict(max_shard_size="40KB"), {}),
    "v4 config.json": (dict(seed=6, theta=3000.0), {}, dict(
        rope_parameters=None, rope_theta=3000.0, rope_scaling="NULL", dtype=None, torch_dtype="float32")),
}


@torch.no_grad()
@pytest.mark.parametrize("case", LOGIT_CASES)
def test_logits_match_transformers(q7, tmp_path, case):
    model_args, save_args, changes = LOGIT_CASES[case]
    hf = tiny_hf_qwen3(**model_args)
    folder = save_hf(hf, tmp_path, **save_args)
    if changes:
        text = json.dumps({**{k: v for k, v in json.loads((folder / "config.json").read_text()).items()
                              if changes.get(k, 0) is not None}, **{k: v for k, v in changes.items() if v}})
        (folder / "config.json").write_text(text.replace('"NULL"', "null"))
    if "sharded" in case:
        assert len(list(folder.glob("model-*.safetensors"))) > 2
        assert not (folder / "model.safetensors").exists()
    ours = q7.load_qwen3(folder, device="cpu")
    ids = torch.randint(0, 131, (2, 19), generator=torch.Generator().manual_seed(1))
    expected = hf(ids).logits
    logits = ours(ids)
    assert logits.shape == (2, 19, 131) and logits.dtype == torch.float32
    assert (logits - expected).abs().max().item() <= 1e-4
    assert expected.std() > 1  # logits of some size: a test on near-zero logits proves little


@torch.no_grad()
def test_bf16_forward_rounds_as_transformers_does(q7, hf_dir):
    """In bf16 the torch path computes every op as transformers does, rounding included: RMSNorm's
    statistics in fp32, then a rounding, then the weight (a norm computed in bf16 throughout
    differs), and a bf16 model's logits bitwise equal to transformers' own bf16 load (eager
    attention; RoPE's frequencies kept in fp32, as from_pretrained keeps them)."""
    from transformers import Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    x = (torch.randn(4, 7, 96, generator=torch.Generator().manual_seed(0)) * 5 + 2).bfloat16()
    ours, theirs = q7.RMSNorm(96, 1e-6).bfloat16(), Qwen3RMSNorm(96, eps=1e-6).bfloat16()
    theirs.weight.copy_(torch.rand(96, generator=torch.Generator().manual_seed(1)) + 0.5)
    ours.weight.copy_(theirs.weight)
    assert torch.equal(ours(x), theirs(x))
    hf = Qwen3ForCausalLM.from_pretrained(hf_dir[1], dtype=torch.bfloat16,
                                          attn_implementation="eager").eval()
    model = q7.load_qwen3(hf_dir[1], device="cpu", dtype=torch.bfloat16)
    ids = torch.tensor([PROMPTS[2] + PROMPTS[0]])
    assert torch.equal(model(ids), hf(ids).logits)


def test_load_reads_each_tensor_once_straight_to_its_dtype(q7, hf_dir, monkeypatch):
    reads = []
    real_open = q7.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_tensor(self, name):
            reads.append(name)
            return self.file.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.file, name)

    monkeypatch.setattr(q7, "safe_open", Spy)
    model = q7.load_qwen3(hf_dir[1], device="cpu", dtype=torch.bfloat16)
    names = set(model.state_dict())
    assert sorted(reads) == sorted(names)  # each tensor once, no other
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in model.state_dict().values())
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model.inv_freq.dtype == torch.float32  # RoPE's frequencies stay fp32
    assert not model.model.norm.kernels  # on the CPU: the torch path


def test_a_bad_checkpoint_names_the_tensor(q7, hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    good = load_file(hf_dir[1] / "model.safetensors")
    cases = {
        "missing": ({k: v for k, v in good.items() if k != "model.layers.1.mlp.up_proj.weight"},
                    r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"),
        "unexpected": ({**good, "model.layers.1.mlp.bias": torch.zeros(3)},
                       r"unexpected tensors \['model.layers.1.mlp.bias'\]"),
        "misshapen": ({**good, "model.norm.weight": torch.ones(47)},
                      r"tensor 'model.norm.weight' has shape \(47,\); config.json implies \(48,\)"),
        "not safetensors": (None, "not a readable safetensors file"),
    }
    for name, (state, message) in cases.items():
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        (folder / "config.json").write_text((hf_dir[1] / "config.json").read_text())
        if state is None:
            (folder / "model.safetensors").write_bytes(b"not weights" * 10)
        else:
            save_file(state, str(folder / "model.safetensors"))
        with pytest.raises(q7.DataError, match=message):
            q7.load_qwen3(folder, device="cpu")
    (tmp_path / "weightless").mkdir()
    (tmp_path / "weightless" / "config.json").write_text((hf_dir[1] / "config.json").read_text())
    with pytest.raises(q7.DataError, match="has neither model.safetensors nor"):
        q7.load_qwen3(tmp_path / "weightless", device="cpu")
    with pytest.raises(q7.DataError, match="neither a model directory"):
        q7.load_qwen3(tmp_path / "no" / "such" / "dir")


def test_a_tied_checkpoint_may_store_the_head_if_it_is_the_embedding(q7, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = tiny_hf_qwen3(tied=True, seed=3)
    folder = save_hf(hf, tmp_path)
    state = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in state
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()},
              str(folder / "model.safetensors"))
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert (q7.load_qwen3(folder, device="cpu")(ids) - hf(ids).logits).abs().max() <= 1e-4
    # another head: transformers would quietly untie them; here it is an error
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"] + 1},
              str(folder / "model.safetensors"))
    with pytest.raises(q7.DataError, match="ties the output layer to the embedding, but the stored "
                                           "lm_head.weight differs"):
        q7.load_qwen3(folder, device="cpu")


def test_saved_checkpoint_loads_in_transformers(q7, tmp_path):
    """main's random model is written by save_qwen3: transformers reads it to the same logits."""
    from transformers import Qwen3ForCausalLM

    folder = q7.random_checkpoint(tmp_path, seed=4)
    hf = Qwen3ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ours = q7.load_qwen3(folder, device="cpu")
    ids = torch.tensor([random_ids(9, vocab=512)])
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() <= 1e-4


# ------------------------------------------------------------------------- Hub ids, downloads

class FakeResponse:
    """Enough of requests.Response for the download helper."""

    def __init__(self, status, body=b"", headers=None, history=()):
        self.status_code, self.body, self.headers, self.history = status, body, headers or {}, list(history)
        self.reason = {200: "OK", 302: "Found", 404: "Not Found"}[status]

    def raise_for_status(self):
        if self.status_code >= 400:
            raise requests.HTTPError(f"{self.status_code}", response=self)

    def iter_content(self, chunk_size):
        return (self.body[i:i + chunk_size] for i in range(0, len(self.body), chunk_size))

    def close(self):
        pass


def fake_hub(served, requested):
    """requests.get serving the files of `served` at their Hub URLs; the weights with the sha256
    in the X-Linked-Etag header of a redirect, as the Hub does for large files."""
    def get(url, **kwargs):
        requested.append(url)
        repo, name = url.removeprefix("https://huggingface.co/").split("/resolve/main/")
        if repo != "Org/tiny-qwen3" or not (served / name).is_file():
            return FakeResponse(404)
        body = (served / name).read_bytes()
        history = []
        if name.endswith(".safetensors"):
            history = [FakeResponse(302, headers={"X-Linked-Etag": f'"{hashlib.sha256(body).hexdigest()}"'})]
        return FakeResponse(200, body, {"Content-Length": str(len(body))}, history)
    return get


@pytest.mark.parametrize("sharded", [False, True])
def test_a_hub_id_downloads_into_the_cache(q7, tmp_path, monkeypatch, sharded):
    hf = tiny_hf_qwen3(seed=7)
    served = save_hf(hf, tmp_path / "served", **({"max_shard_size": "40KB"} if sharded else {}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (served / name).write_text("{}")
    requested = []
    monkeypatch.setattr(q7.requests, "get", fake_hub(served, requested))
    model = q7.load_qwen3("Org/tiny-qwen3", device="cpu", data_dir=tmp_path / "cache")
    folder = tmp_path / "cache" / "hub" / "Org" / "tiny-qwen3"
    expected = {path.name for path in served.iterdir()}
    assert {path.name for path in folder.iterdir()} == expected
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() <= 1e-4
    requested.clear()
    q7.load_qwen3("Org/tiny-qwen3", device="cpu", data_dir=tmp_path / "cache")
    assert requested == []  # a complete folder needs no network


def test_a_hub_id_offline_names_the_files_to_place(q7, tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise requests.ConnectionError("no route to host")

    monkeypatch.setattr(q7.requests, "get", no_network)
    with pytest.raises(q7.DataError) as err:
        q7.LLM("Qwen/Qwen3-0.6B", device="cpu", data_dir=tmp_path)
    message = str(err.value)
    assert message.startswith("Qwen/Qwen3-0.6B cannot be downloaded (ConnectionError: no network?)")
    assert str(tmp_path / "hub" / "Qwen" / "Qwen3-0.6B") in message
    assert "https://huggingface.co/Qwen/Qwen3-0.6B/tree/main" in message
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors", "model.safetensors.index.json"):
        assert name in message
    assert list(tmp_path.iterdir()) == []  # nothing left behind


# ------------------------------------------------------------------------------ the tokenizer

# Qwen2 and Qwen3's pre-tokenizer regex, as their tokenizer.json declares it: GPT-4's, but digits
# one by one.
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3's added tokens (a subset), special or not as Qwen3 declares them.
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_TEXT_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                    "<think>", "</think>"]

# Qwen3's chat template, as Qwen/Qwen3-0.6B's tokenizer_config.json holds it (Apache-2.0), taken
# from llama.cpp's copy of it, models/templates/Qwen-Qwen3-0.6B.jinja. The reference, not our code.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def corpus(n_lines=3000):
    """Lines mixing what a tokenizer must handle: English with contractions and capitals, made-up
    words (so that many merges compete), numbers, code, whitespace runs, CJK, Korean, Arabic,
    emoji (with modifiers and joiners), accents written both composed and decomposed."""
    rng = random.Random(0)
    syllables = "ka to re sh ing tion ed er th qu an on es ly pr st ou al ch ix zo".split()
    pieces = ["The quick brown fox", "jumps over the lazy dog.", "I'm sure you'll see; they've",
              "IT'S DONE", "don't", "3.14159", "2024-01-01", "x = f(y) ** 2  # note", "\n\n",
              "    return None\n", "\t", "中文分词测试", "日本語のテキスト。", "한국어 텍스트",
              "مرحبا بالعالم", "👍🏽", "👨\u200d👩\u200d👧", "café", "cafe\u0301", "naïve résumé",
              "ﬁnal", "Ⅻ ²½"]

    def word():
        text = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
        return text.capitalize() if rng.random() < 0.2 else text

    return [" ".join(rng.choice(pieces) if rng.random() < 0.3 else word()
                     for _ in range(rng.randint(1, 12))) + rng.choice(["", "  ", "\n", "!"])
            + str(rng.randrange(10**6)) for _ in range(n_lines)]


def train(pre_tokenizer, normalizer=None, special_in_vocab=()):
    """A byte-level BPE of 1,200 ids trained on `corpus()`, the way Hugging Face builds them."""
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=1200, show_progress=False,
                                  special_tokens=list(special_in_vocab),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    return tok


def qwen_like():
    """Qwen3's tokenizer in miniature: its normalizer, pre-tokenizer and added tokens (ids after
    the vocabulary's), and added tokens for the rules Qwen3's own do not reach: "<|im", a prefix
    of two others, which loses to them (the longest match wins); "Ångström", normalized, so
    matched after NFC; "<|mask é|>", not normalized, with a character outside the byte map, so
    decoded as its UTF-8; "<|Ġsep|>", decoded through the byte map (to "<| sep|>")."""
    tok = train(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), normalizers.NFC())
    tok.add_tokens([AddedToken("<|im", special=False, normalized=False)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_TEXT_TOKENS])
    tok.add_tokens([AddedToken("Ångström", special=False, normalized=True)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|mask é|>", "<|Ġsep|>")])
    return tok


TOKENIZERS = {
    "qwen": qwen_like,
    # GPT-2's layout; its <|endoftext|> is trained into the vocabulary (id 0), as BpeTrainer does.
    "gpt2": lambda: train(pre_tokenizers.ByteLevel(add_prefix_space=False),
                          special_in_vocab=["<|endoftext|>"]),
    # A regex that matches only words and digits: tokenizers keeps the text between as chunks.
    "gaps": lambda: train(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{L}+|\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
}


def save_tokenizer(hf, directory, tokenizer_config=None, config=None, generation_config=None):
    """Write a Hugging Face model directory: tokenizer.json and the optional JSON files."""
    directory.mkdir(parents=True, exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))
    for name, content in (("tokenizer_config.json", tokenizer_config), ("config.json", config),
                          ("generation_config.json", generation_config)):
        if content is not None:
            (directory / name).write_text(json.dumps(content))
    return directory


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def pair(request, q7, tmp_path_factory):
    """(tokenizers' Tokenizer, ours loaded from its saved directory), for each kind above."""
    hf = TOKENIZERS[request.param]()
    directory = save_tokenizer(hf, tmp_path_factory.mktemp(request.param))
    if request.param == "qwen":  # Qwen's files write merges the older way, as "a b" strings
        spec = json.loads((directory / "tokenizer.json").read_text())
        spec["model"]["merges"] = [" ".join(pair) for pair in spec["model"]["merges"]]
        (directory / "tokenizer.json").write_text(json.dumps(spec))
    return hf, q7.load_tokenizer(directory)


@pytest.fixture(scope="module")
def qwen_hf():
    return qwen_like()


def assert_same_as_tokenizers(hf, tok, text):
    """Same ids, same decoded text (special tokens kept and skipped)."""
    ids = tok.encode(text)
    assert ids == hf.encode(text).ids, text
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


HARD_STRINGS = [
    "", " ", "  ", "a   b", "   leading", "trailing   ", "\t\t", "\t x", "\n\n\n", "\n\n  x",
    "x \n y", " \n", "a\u00a0b", "\u3000x\u3000\u3000y", "a\u2028b\u2029c", "\r\n", "x\r\n\r\n  y",
    "\x1c\x1d\x1e\x1f a\x1fb", "\x85x \x85 x", "\u200b zero width", "\x0b\x0c form feed",
    "I'm you'll they've she'd we're it's don't", "'S uppercase 'LL 'Re", "''s '' 's's", " 's",
    "it'\u017f", "12345 3.14159 1,000,000", "x1 1x 2024-01-01 0.5e-3", "\uff13\uff14\uff15",
    "\u0663\u0664 \u00b2\u00bd \u216b \u4e00", "👍🏽 family 👨\u200d👩\u200d👧", "flags 🇺🇸🇫🇷",
    "中文分词测试", "مرحبا بالعالم", "नमस्ते", "e\u0301 café cafe\u0301", "\u212a Kelvin \u2126",
    "\u1100\u1161\u11a8 jamo", "ß ẞ ﬁ", "日本語のテキスト、句読点。", "한국어 텍스트",
    "def f(x):\n    return x**2  # square\n", "<html>&amp;\"quoted\"</html>", "a--b...c!!!?",
    "new in Unicode 15-16: \u1c89\u1c8a x\U00031350y \U00010d40\U00010d41 a\U00010d4ab",
    "<|im_start|>user\nhi<|im_end|>\n", "<|im_start|><|im_start|>", "<|im_end", "<|im_end|>|>",
    "x<think>y</think>z", "<thinker> </think >", "<|endoftext|>after", " <|endoftext|> ",
    "<tool_call>\n{\"a\": 1}\n</tool_call>", "<|im<|im_end|><|im_", "<|Ġsep|> <|mask é|>x",
    "A\u030angstro\u0308m Ångström", "<|mask e\u0301|>",
]


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_hard_strings_match_tokenizers(pair, text):
    assert_same_as_tokenizers(*pair, text)


def test_random_strings_match_tokenizers(pair):
    """Random mixes of the pieces that interact: whitespace, contractions, digits, scripts,
    combining marks, and added tokens next to all of them."""
    pieces = (list("abcXYZ019 '.,!?-_\n\t\r") + ["   ", "\n\n", " \n ", "'s", "'LL", "'ve"]
              + list("\u00e9\u00df\u4e2d\u0639\u0301\u00a0\u3000\u2028\x85\u00b2\u216b\u0663")
              + ["\U0001f44d", "\U0001f3fd", "\u200d", "\u1100", "\u1161", "e\u0301"]
              + QWEN_SPECIAL + QWEN_TEXT_TOKENS + ["<|im", "Ångström", "<|mask é|>", "<|Ġsep|>"])
    rng = random.Random(0)
    for _ in range(300):
        assert_same_as_tokenizers(*pair, "".join(rng.choice(pieces)
                                                 for _ in range(rng.randint(0, 40))))


def test_random_code_points_match_tokenizers(pair):
    """A broad sample of the whole code space (assigned or not), between ASCII words and spaces.
    Texts whose NFC differs between Python's and tokenizers' Unicode tables are left out (a few
    percent here; see test_nfc_uses_pythons_unicode_tables)."""
    rng, nfc, left_out = random.Random(1), normalizers.NFC(), 0
    for _ in range(300):
        limits = [rng.choice((0x3400, 0x30000, 0x110000)) for _ in range(rng.randint(1, 12))]
        chars = [chr(rng.randrange(limit)) for limit in limits]
        text = "".join(c + rng.choice(("", "a", " ", "1", "!", " b", "\n")) for c in chars
                       if not 0xD800 <= ord(c) < 0xE000)
        if nfc.normalize_str(text) != unicodedata.normalize("NFC", text):
            left_out += 1
            continue
        assert_same_as_tokenizers(*pair, text)
    assert left_out < 15


def test_nfc_uses_pythons_unicode_tables(pair):
    """tokenizers' NFC tables predate Unicode 10, so it leaves combining marks assigned since then
    (here U+1DFA, Unicode 14) unordered, where Python's unicodedata orders them by combining
    class. Ours normalizes with Python's: its ids are tokenizers' ids of the Python-normalized
    text (and equal to tokenizers' own for tokenizers without a normalizer)."""
    hf, tok = pair
    text = "a\u0611\u1dfa b"
    assert normalizers.NFC().normalize_str(text) == text != unicodedata.normalize("NFC", text)
    assert tok.encode(text) == hf.encode(tok.normalize(text)).ids


def test_lone_surrogates_are_repaired_as_tiktoken_does(pair):
    """tokenizers refuses a str without UTF-8; ours encodes it as tiktoken does, with split
    surrogate pairs rejoined and lone halves as U+FFFD."""
    hf, tok = pair
    assert tok.encode("pair \ud83d\ude00, lone \ud800!") == hf.encode("pair 😀, lone \ufffd!").ids


def test_decode_across_utf8_boundaries(pair):
    """Random id sequences, many of them single bytes of multi-byte characters, so that token
    boundaries split characters and leave bytes that are not UTF-8: the same text as tokenizers
    (which decodes the whole sequence's bytes at once, invalid ones as U+FFFD)."""
    hf, tok = pair
    n = hf.get_vocab_size()
    high_bytes = [i for i, b in enumerate(tok.token_bytes[:n]) if len(b) == 1 and b[0] >= 0x80]
    rng = random.Random(2)
    for _ in range(500):
        ids = [rng.choice(high_bytes) if rng.random() < 0.6 else rng.randrange(n)
               for _ in range(rng.randint(1, 12))]
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False), ids
    ids = tok.encode("中文👍🏽é")
    assert [tok.decode([i]) for i in ids] == [hf.decode([i], False) for i in ids]
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids)  # the test does split characters


def test_ids_beyond_the_tokenizer_decode_to_nothing(pair):
    """Qwen3's model scores 151,936 ids, more than its tokenizer defines: sampling one of the others
    must not crash decoding; it decodes to nothing, as in tokenizers."""
    hf, tok = pair
    ids = tok.encode("hello world") + [len(tok.token_bytes), 151935, 10**9]
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False) == "hello world"
    assert tok.decode([-1, 151935]) == ""


# -- eos ids -----------------------------------------------------------------------------------

def test_eos_token_ids_are_the_union_of_all_three_files(q7, qwen_hf, tmp_path):
    eot, im_end = qwen_hf.token_to_id("<|endoftext|>"), qwen_hf.token_to_id("<|im_end|>")
    tool_call = qwen_hf.token_to_id("<tool_call>")
    cases = [  # (tokenizer_config, config, generation_config, expected)
        ({"eos_token": "<|im_end|>"}, {"eos_token_id": im_end},
         {"eos_token_id": [im_end, eot]}, {im_end, eot}),  # Qwen3-0.6B's files
        ({"eos_token": {"content": "<tool_call>"}}, {"eos_token_id": eot},
         {"eos_token_id": 7}, {tool_call, eot, 7}),
        ({"eos_token": None}, {"eos_token_id": None}, None, set()),
        (None, None, None, set()),
    ]
    for k, (tokenizer_config, config, generation_config, expected) in enumerate(cases):
        directory = save_tokenizer(qwen_hf, tmp_path / str(k), tokenizer_config, config, generation_config)
        assert q7.load_tokenizer(directory).eos_token_ids == expected


@pytest.mark.parametrize("files, message", [
    ({"tokenizer_config": {"eos_token": "<|nope|>"}}, "eos_token '<|nope|>' is not a token"),
    ({"config": {"eos_token_id": "2"}}, "config.json: eos_token_id must be an id or a list of "
                                        "ids, got '2'"),
    ({"generation_config": {"eos_token_id": [1, None]}}, r"generation_config.json: .* got \[1, None\]"),
])
def test_bad_eos_is_an_error(q7, qwen_hf, tmp_path, files, message):
    with pytest.raises(q7.DataError, match=message):
        q7.load_tokenizer(save_tokenizer(qwen_hf, tmp_path, **files))


# -- the chat format ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_pair(q7, qwen_hf, tmp_path_factory):
    """(transformers' tokenizer with Qwen3's chat template, ours), ours loaded from the directory
    transformers v5 saves (the template in chat_template.jinja)."""
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_object=qwen_hf, eos_token="<|im_end|>",
                                        chat_template=QWEN3_CHAT_TEMPLATE)
    directory = tmp_path_factory.mktemp("chat")
    reference.save_pretrained(directory)
    assert (directory / "chat_template.jinja").is_file()
    return reference, q7.load_tokenizer(directory)


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "one user turn": [user("Hi")],
    "system and user": [SYSTEM, user("2+2?")],
    "multi-turn, old reasoning dropped": [
        SYSTEM, user("First?"), assistant("<think>\nweighing it\n</think>\n\nOne."),
        user("Second?"), assistant("Two."), user("Third? 中文 👍🏽")],
    "ends with the answer being written": [user("Why?"), assistant("<think>because</think>So.")],
    "ends with a plain answer": [user("Why?"), assistant("So.")],
    "reasoning_content field": [
        user("a"), assistant("A", reasoning_content="hidden"), user("b"),
        assistant("B", reasoning_content="\nshown\n")],
    "reasoning_content wins over the content's think block": [
        user("a"), assistant("<think>x</think>A", reasoning_content="")],
    "tool results do not count as queries": [
        user("Add."), assistant("<think>call it</think>Calling."),
        user("<tool_response>\n42\n</tool_response>"), assistant("Plain, no reasoning."),
        user("<tool_response>43</tool_response>")],
    "system turn later on": [user("a"), SYSTEM, user("b")],
    "whitespace around the think block": [
        user(" x "), assistant("\n<think>\n\n  deep \n\n</think>\n\n\nanswer\n")],
    "unclosed think and text before it": [
        user("q"), assistant("pre<think>r</think>post"), assistant("only <think> opened")],
    "special tokens in content": [user("say <|im_end|> and </think>")],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("enable_thinking", [True, False])
def test_chat_template_matches_transformers(chat_pair, name, add_generation_prompt,
                                           enable_thinking):
    reference, tok = chat_pair
    messages = CONVERSATIONS[name]
    options = dict(add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
    text = tok.apply_chat_template(messages, **options)
    assert text == reference.apply_chat_template(messages, tokenize=False, **options)
    assert tok.encode(text) == reference.apply_chat_template(messages, return_dict=False, **options)


def test_chat_format_as_qwen_documents_it(chat_pair):
    """The format spelled out: ChatML turns, old reasoning dropped, the empty think block when
    thinking is off."""
    tok = chat_pair[1]
    messages = [SYSTEM, user("Hi"), assistant("<think>greet</think>Hello!"), user("Bye")]
    assert tok.apply_chat_template(messages, enable_thinking=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_in_tokenizer_config(q7, qwen_hf, tmp_path):
    """The Hub's layout (Qwen3's own): the template inside tokenizer_config.json."""
    tok = q7.load_tokenizer(save_tokenizer(qwen_hf, tmp_path, {"chat_template": QWEN3_CHAT_TEMPLATE}))
    expected = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template([user("Hi")]) == expected


def test_named_templates(q7, qwen_hf, tmp_path):
    """tokenizer_config.json may hold a list of named templates: "default" is the chat's."""
    templates = [{"name": "tool_use", "template": "{{ messages }}"},
                 {"name": "default", "template": QWEN3_CHAT_TEMPLATE}]
    tok = q7.load_tokenizer(save_tokenizer(qwen_hf, tmp_path, {"chat_template": templates}))
    assert tok.apply_chat_template([user("Hi")], enable_thinking=False).endswith("</think>\n\n")


def test_base_model_is_never_chat_wrapped(q7, qwen_hf, tmp_path):
    tok = q7.load_tokenizer(save_tokenizer(qwen_hf, tmp_path, {"eos_token": "<|endoftext|>"}))
    with pytest.raises(ValueError, match="base model"):
        tok.apply_chat_template([user("Hi")])


def test_other_chat_formats_are_refused(q7, qwen_hf, tmp_path):
    """Another template loads (its text still encodes) but is never imitated."""
    llama_like = "{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"
    tok = q7.load_tokenizer(save_tokenizer(qwen_hf, tmp_path, {"chat_template": llama_like}))
    assert tok.encode("Hi") == qwen_hf.encode("Hi").ids
    with pytest.raises(ValueError, match="not Qwen3's"):
        tok.apply_chat_template([user("Hi")])


@pytest.mark.parametrize("messages, message", [
    ([], "messages is empty"),
    ([{"role": "tool", "content": "42"}], "role 'tool'"),
    ([{"role": "user"}], "str 'content'"),
    ([{"role": "user", "content": None}], "str 'content'"),
    (["hi"], "must be a dict"),
    ([assistant("x", tool_calls=[])], "tool_calls"),
    ([assistant("x", reasoning_content=1)], "reasoning_content"),
])
def test_bad_messages_are_errors(chat_pair, messages, message):
    with pytest.raises(ValueError, match=message):
        chat_pair[1].apply_chat_template(messages)


def test_switches_must_be_bools(chat_pair):
    """The template tests `enable_thinking is false`, so None or 0 would mean thinking on there
    and off in a plain `if`: neither is accepted."""
    for options in ({"enable_thinking": None}, {"add_generation_prompt": 0}):
        with pytest.raises(TypeError, match="must be True or False"):
            chat_pair[1].apply_chat_template([user("Hi")], **options)


# -- what tiktoken cannot represent is refused -------------------------------------------------

def edited(qwen_hf, edit):
    """tokenizer.json of the Qwen-like tokenizer, changed by `edit(spec)`."""
    spec = json.loads(qwen_hf.to_str())
    edit(spec)
    return spec


def swap_overlapping_merges(spec):
    """Swap the first two merges of ASCII letters that compete for one letter, (a, b) and (b, c),
    so that "abc" encodes as a + bc instead of ab + c; return "abc"."""
    merges = [tuple(m) for m in spec["model"]["merges"]]
    letters = [(i, m) for i, m in enumerate(merges)
               if all(len(p) == 1 and p.isascii() and p.isalpha() for p in m)]
    i, j = next((i, j) for i, (a, b) in letters for j, (c, _) in letters if j > i and c == b)
    merges[i], merges[j] = merges[j], merges[i]
    spec["model"]["merges"] = merges
    return merges[j][0] + merges[i][0] + merges[i][1]


def steps(spec):
    """The pre-tokenizer's steps: Split(regex), ByteLevel."""
    return spec["pre_tokenizer"]["pretokenizers"]


UNSUPPORTED = {
    "WordPiece": (lambda s: s["model"].update(type="WordPiece"), "model type 'WordPiece'"),
    "byte fallback": (lambda s: s["model"].update(byte_fallback=True), "not byte-level BPE"),
    "NFKC": (lambda s: s.update(normalizer={"type": "NFKC"}), "normalizer .* not supported"),
    "Metaspace": (lambda s: s.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁"}),
                  "not byte-level BPE's"),
    "prefix space": (lambda s: steps(s)[1].update(add_prefix_space=True), "add_prefix_space"),
    "Split removes": (lambda s: steps(s)[0].update(behavior="Removed"), "Isolated"),
    "two regexes": (lambda s: steps(s)[1].update(use_regex=True), "not supported"),
    "regex syntax": (lambda s: steps(s)[0].update(pattern={"Regex": "(?<"}),
                     "tiktoken cannot use the pre-tokenizer regex"),
    "decoder": (lambda s: s.update(decoder={"type": "Metaspace"}), "decoder 'Metaspace'"),
    "post-processor": (lambda s: s.update(post_processor={"type": "TemplateProcessing"}),
                       "post_processor 'TemplateProcessing'"),
    "merges out of order": (swap_overlapping_merges, "tiktoken merges in id order"),
    "unknown merge": (lambda s: s["model"]["merges"].append(["Ġ", "zzzz"]),
                      "not in the vocabulary"),
    "missing byte": (lambda s: s["model"]["vocab"].pop("Ā"), "255 of the 256 single bytes"),
    "not byte-level vocab": (lambda s: s["model"]["vocab"].update({"▁the": 5000}),
                             "'▁the' is not written in byte-level"),
    "lstrip": (lambda s: s["added_tokens"][0].update(lstrip=True), r"sets \['lstrip'\]"),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_tokenizers_are_errors(q7, qwen_hf, tmp_path, name):
    edit, message = UNSUPPORTED[name]
    (tmp_path / "tokenizer.json").write_text(json.dumps(edited(qwen_hf, edit)))
    with pytest.raises(q7.DataError, match=message):
        q7.load_tokenizer(tmp_path)


def test_real_non_byte_level_models_are_errors(q7, tmp_path):
    """WordPiece and Unigram tokenizers as the tokenizers library writes them."""
    for kind, model in (("wordpiece", models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
                        ("unigram", models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0))):
        save_tokenizer(Tokenizer(model), tmp_path / kind)
        with pytest.raises(q7.DataError, match="is not byte-level BPE"):
            q7.load_tokenizer(tmp_path / kind)


def test_out_of_order_merges_really_encode_differently(qwen_hf):
    """Why out-of-order merges are refused: with two swapped, tokenizers' ids change."""
    spec = json.loads(qwen_hf.to_str())
    text = swap_overlapping_merges(spec)
    swapped = Tokenizer.from_str(json.dumps(spec))
    assert swapped.encode(text).ids != qwen_hf.encode(text).ids


def test_missing_or_broken_files_are_named(q7, tmp_path):
    path = tmp_path / "tokenizer.json"
    for content, message in [(None, "tokenizer.json not found"),
                             ("{not json", "not a readable JSON config"),
                             ("[]", "expected a JSON object, got list"),
                             ('{"version": "1.0"}', r"lacks \['model'\]"),
                             ('{"model": []}', "model type None is not byte-level BPE"),
                             ('{"model": {"type": "BPE", "vocab": {}}}', "needs a vocab")]:
        if content is not None:
            path.write_text(content)
        with pytest.raises(q7.DataError, match=message) as err:
            q7.load_tokenizer(tmp_path)
        assert str(path) in str(err.value)


def test_encode_takes_text_only(pair):
    with pytest.raises(TypeError, match="text must be str"):
        pair[1].encode(b"bytes")


def test_nfc_really_matters(qwen_hf):
    """The hard strings exercise the normalizer: without NFC tokenizers' ids would differ."""
    raw = "cafe\u0301 \u212a"
    assert unicodedata.normalize("NFC", raw) != raw
    plain = Tokenizer.from_str(qwen_hf.to_str())
    plain.normalizer = None
    assert plain.encode(raw).ids != qwen_hf.encode(raw).ids

# -- main's tokenizer: GPT-2's ranks written as tokenizer.json --------------------------------

# GPT-2's pre-tokenizer regex, as OpenAI's encoder.py writes it: the reference for the demo's.
GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def test_demo_tokenizer_is_gpt2s(q7, tmp_path):
    """main's tokenizer: GPT-2's first ranks from data/gpt2.tiktoken, written as tokenizer.json
    with Qwen3's chat tokens. tokenizers reads that file to the ids tiktoken gives from the ranks
    themselves, and so does load_tokenizer; its short chat template renders in transformers as
    Qwen3's format does."""
    import tiktoken
    from transformers import PreTrainedTokenizerFast

    folder = q7.demo_tokenizer(tmp_path)
    ranks = {token: rank for token, rank in q7.read_ranks(q7.data_file("gpt2.tiktoken")).items()
             if rank < q7.DEMO_RANKS}
    added = {content: i for i, content, _ in q7.DEMO_ADDED_TOKENS}
    reference = tiktoken.Encoding("gpt2-head", pat_str=GPT2_REGEX, mergeable_ranks=ranks,
                                  special_tokens=added)
    hf, ours = Tokenizer.from_file(str(folder / "tokenizer.json")), q7.load_tokenizer(folder)
    assert hf.get_vocab_size() == len(ours.token_bytes) == q7.DEMO_RANKS + len(added)
    for text in HARD_STRINGS + corpus(300):
        ids = reference.encode(text, allowed_special="all")
        assert hf.encode(text).ids == ids and ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_ids == {added["<|im_end|>"], added["<|endoftext|>"]}
    rendering = PreTrainedTokenizerFast.from_pretrained(folder)
    for messages in ([user("Hi")], [SYSTEM, user("2+2?"), assistant("4"), user("and 3+3?")]):
        for thinking in (True, False):
            assert ours.apply_chat_template(messages, enable_thinking=thinking) == \
                rendering.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                              enable_thinking=thinking)


# --------------------------------------------------------------------------- the cached paths

@torch.no_grad()
def test_cached_steps_equal_full_recomputation(q7, hf_dir):
    """Through the model's cached path, as the runner drives it: a right-padded prefill of two
    prompts of different lengths, then single-token steps, then a 3-token step, each row at its
    own positions; every logit against one forward pass over the whole sequences."""
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    full_ids = torch.tensor([random_ids(16, seed=8), random_ids(16, seed=9)])
    full = model(full_ids)  # (2, 16, V): the reference, no cache
    cache = q7.KVCache(model.cfg, rows=3, length=20, device="cpu", dtype=torch.float32)
    lengths = [6, 3]
    prompts = full_ids.clone()
    prompts[1, 3:6] = 0  # row 1's padding
    h = model.hidden_states(prompts[:, :6], cache=cache)
    for row, n in enumerate(lengths):
        torch.testing.assert_close(model.logits(h[row, :n]), full[row, :n], rtol=0, atol=1e-5)
    pos = torch.tensor(lengths)
    for _ in range(5):  # one token a row, each at its own position
        ids = full_ids[torch.arange(2), pos][:, None]
        logits = model(ids, pos[:, None], cache, kv_len=int(pos.max()) + 1)[:, 0]
        torch.testing.assert_close(logits, full[torch.arange(2), pos], rtol=0, atol=1e-5)
        pos += 1
    chunk = pos[:, None] + torch.arange(3)  # (2, 3): three tokens a row at once
    logits = model(full_ids.gather(1, chunk), chunk, cache, kv_len=int(chunk.max()) + 1)
    torch.testing.assert_close(logits, full.gather(1, chunk[..., None].expand(-1, -1, 131)),
                               rtol=0, atol=1e-5)


@torch.no_grad()
def test_engine_v1_greedy_equals_transformers(q7, hf_dir):
    """Engine v1's static batch of ragged prompts (right-padded prefill, decode over the cache,
    each row at its own position) against transformers' greedy generate of each prompt alone;
    a stop id ends its row with the id included, the other rows run on."""
    hf, folder = hf_dir
    model = q7.load_qwen3(folder, device="cpu")
    prompts = [*PROMPTS, random_ids(1, seed=4)]
    expected = [hf_greedy(hf, p, 9) for p in prompts]
    greedy = q7.SamplingParams(temperature=0, max_tokens=9)
    assert q7.generate(model, prompts, greedy) == expected
    stop = expected[1][4]  # row 1's fifth token: it ends there, eos included
    ended = q7.generate(model, prompts, greedy, eos_token_ids=[stop])
    cut = [row[:row.index(stop) + 1] if stop in row else row for row in expected]
    assert ended == cut and len(ended[1]) <= 5
    ignored = q7.SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    assert q7.generate(model, prompts, ignored, eos_token_ids=[stop]) == expected


def test_engine_v1_samples_as_the_engine_does(q7, hf_dir):
    """Seeded sampling with penalties and filters: each row's tokens equal LLM.generate's for
    the same request (the same Sampler and per-request random stream), and a row drawn alone
    equals the same row in the batch."""
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    llm = q7.LLM(model, max_model_len=40)
    params = q7.SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.2,
                               presence_penalty=0.5, seed=7, max_tokens=10, ignore_eos=True)
    batch = q7.generate(model, PROMPTS, params)
    assert batch == [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
    assert q7.generate(model, PROMPTS[1:2], params) == batch[1:2]
    assert len(set(map(tuple, batch))) == 3


def test_engine_v1_refuses_what_it_cannot_do(q7, hf_dir):
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    cases = [([[1, 2]], q7.SamplingParams(regex="a+"), ValueError, "structured output and "
              "logprobs are the engine's"),
             ([[1, 2]], q7.SamplingParams(logprobs=1), ValueError, "logprobs are the engine's"),
             ([], None, ValueError, "prompts must be a non-empty list"),
             ([[]], None, ValueError, "prompts must be a non-empty list of non-empty lists"),
             ([[131]], None, ValueError, r"token ids in \[0, 131\)"),
             ([[1] * 60], q7.SamplingParams(max_tokens=5), ValueError,
              r"a prompt of 60 tokens \+ max_tokens 5 is beyond the model's context, 64"),
             ([[1]], {"temperature": 0}, TypeError, "params must be a SamplingParams")]
    for prompts, params, error, message in cases:
        with pytest.raises(error, match=message):
            q7.generate(model, prompts, params)


def test_model_checks_its_inputs(q7, hf_dir):
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 131\), got ids from 0 to 131"):
        model(torch.tensor([[0, 131]]))
    with pytest.raises(ValueError, match=r"input_ids must be a \(B, T\) tensor"):
        model(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="positions and kv_len go together, and with a cache"):
        model(torch.tensor([[1]]), torch.tensor([[3]]), kv_len=4)


# ------------------------------------------------------------------------- the Triton kernels

def gen64(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("shape, dtype, tol", [((3, 5, 32), torch.float32, 1e-6),  # (B, T, C)
                                               ((4, 1500), torch.float32, 1e-6),  # masked tail
                                               ((7, 96), torch.float16, 2e-3)])
def test_rms_norm_kernel(q7, shape, dtype, tol):
    x, w = gen64(*shape, seed=1) * 3 + 0.5, gen64(shape[-1], seed=2)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 0.05) * w
    y = q7.rms_norm(x.to(DEVICE, dtype), w.to(DEVICE, dtype), eps=0.05).cpu()
    assert y.dtype == dtype and y.shape == x.shape
    assert ((y.double() - expected).norm() / expected.norm()).item() < tol


def test_swiglu_kernel(q7):
    g, u = gen64(3, 7, 33, seed=3) * 4, gen64(3, 7, 33, seed=4)
    y = q7.swiglu(g.float().to(DEVICE), u.float().to(DEVICE)).cpu()
    assert ((y.double() - F.silu(g) * u).abs().max()).item() < 1e-5


def attention_float64(q, k, v, causal):
    """softmax(q k^T / sqrt(D)) v in float64, GQA heads by index, causal bottom-right."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    T, S = q.shape[2], k.shape[2]
    if causal:
        visible = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("B, Hq, Hkv, T, S, D, causal", [(2, 4, 2, 13, 13, 32, True),
                                                        (1, 4, 1, 5, 19, 32, True),
                                                        (1, 2, 2, 7, 9, 64, False)])
def test_flash_attention_forward(q7, B, Hq, Hkv, T, S, D, causal):
    q, k, v = gen64(B, Hq, T, D, seed=5), gen64(B, Hkv, S, D, seed=6), gen64(B, Hkv, S, D, seed=7)
    out = q7.flash_attention(*(x.float().to(DEVICE) for x in (q, k, v)), causal=causal).cpu()
    assert out.shape == (B, Hq, T, D)
    assert (out.double() - attention_float64(q, k, v, causal)).abs().max().item() < 1e-5


def test_the_kernels_refuse_bad_inputs(q7):
    ones = functools.partial(torch.ones, device=DEVICE)
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        q7.rms_norm(ones(2, 4, dtype=torch.float64), ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"weight has shape \(3,\); expected \(4,\)"):
        q7.rms_norm(ones(2, 4), ones(3))
    with pytest.raises(ValueError, match="gate .* and up .* differ"):
        q7.swiglu(ones(2, 4), ones(2, 5))
    with pytest.raises(ValueError, match="head size D=48 is not supported"):
        q7.flash_attention(*(ones(1, 2, 3, 48) for _ in range(3)))


@torch.no_grad()
def test_model_on_the_kernels_matches_its_torch_path(q7, hf_dir):
    """RMSNorm, SwiGLU and the prefill's flash attention on the kernels (interpreter) against
    the torch twins: logits, and the engine's greedy tokens."""
    model = q7.load_qwen3(hf_dir[1], device=DEVICE, dtype=torch.float32)
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2], PROMPTS[2] + PROMPTS[0]], device=DEVICE)  # (2, 18)
    reference = model.use_kernels(False)(ids)
    on_kernels = model.use_kernels(True)(ids)
    assert model.model.layers[1].self_attn.k_norm.kernels and model.model.layers[0].mlp.kernels
    assert (on_kernels - reference).abs().max().item() < 1e-4
    params = q7.SamplingParams(temperature=0, max_tokens=4)
    kernels = q7.LLM(model, max_model_len=40).generate(PROMPTS, params)
    torch_path = q7.LLM(model.use_kernels(False), max_model_len=40).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in kernels] == [o.outputs[0].token_ids for o in torch_path]


@torch.no_grad()
def test_async_scheduling_gives_the_same_outputs(q7, hf_dir, monkeypatch):
    """With async_scheduling each step is launched before the tokens of the step before it are
    read, fed with them on the device: the same tokens and logprobs as the plain loop, for
    greedy, seeded and stop-id rows that end at different steps, one of them at max_model_len
    while another goes on."""
    model = q7.load_qwen3(hf_dir[1], device=DEVICE, dtype=torch.float32).use_kernels(True)
    prompts = [random_ids(10, seed=11), random_ids(5, seed=12), random_ids(7, seed=13)]
    params = [q7.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1),
              q7.SamplingParams(temperature=1.0, seed=5, max_tokens=13, ignore_eos=True,
                                logprobs=0),
              q7.SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)]
    plain = q7.LLM(model, max_num_seqs=3, async_scheduling=False)
    stop = plain.generate(prompts, params)[2].outputs[0].token_ids[3]  # row 2 stops at its fourth token or before
    params[2] = q7.SamplingParams(temperature=0, max_tokens=13, stop_token_ids=[stop])
    expected = plain.generate(prompts, params)
    overlapped = q7.LLM(model, max_num_seqs=3, async_scheduling=True)
    launch = overlapped.engine.runner.launch
    previous = []  # how many launches read their ids from the step before

    def counted(batch, before=None):
        previous.append(before is not None)
        return launch(batch, before)

    monkeypatch.setattr(overlapped.engine.runner, "launch", counted)
    outputs = overlapped.generate(prompts, params)
    assert sum(previous) >= 10  # decode steps fed on the device
    assert [len(o.outputs[0].token_ids) for o in expected][:2] == [8, 13]  # 10 + 8 = 5 + 13: the cache's end
    assert expected[2].outputs[0].finish_reason == "stop" and len(expected[2].outputs[0].token_ids) <= 4
    for ours, theirs in zip(outputs, expected):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids and ours.outputs[0].finish_reason == theirs.outputs[0].finish_reason
        assert (ours.outputs[0].logprobs is None) == (theirs.outputs[0].logprobs is None)
        # equal up to float32 rounding: the two loops batch their steps differently, so sums
        # run in another order (one logprob 1.2e-6 apart under numpy 2.4.6's interpreter)
        for a, b in zip(ours.outputs[0].logprobs or (), theirs.outputs[0].logprobs or ()):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-5 for k in a)
    assert overlapped.generate(prompts[:1], params[0])[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


# -- decode attention: one query a row over the cache ------------------------------------------

def decode_float64(q, k, v, lengths):
    """q (B, Hq, D) over keys 0..lengths[b]-1 of k, v (B, Hkv, S, D) in float64, GQA heads by
    index; a row with no key gives 0."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (B, Hq, S, D)
    scores = torch.einsum("bhd,bhsd->bhs", q, k) / math.sqrt(q.shape[-1])
    visible = torch.arange(k.shape[2])[None, :] < lengths[:, None].cpu()  # (B, S)
    probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1).nan_to_num()
    return torch.einsum("bhs,bhsd->bhd", probs, v)


def cache_views(B, Hkv, S, D, seed):
    """k, v (B, Hkv, S, D) as the model passes them: views of a larger cache, strided as
    KVCache's (L, rows, Hkv, length, D) tensors are."""
    big = gen64(2, 2, B + 1, Hkv, S + 5, D, seed=seed)
    return big[0, 1, :B, :, :S], big[1, 1, :B, :, :S]


DECODE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DECODE_CASES = {  # name -> B, Hq, Hkv, D, S, lengths, num_splits, dtype, query scale
    # one split: the output written directly, no merge; scores up to ~+-100 (no max subtracted
    # would overflow exp)
    "mha-1-split": (3, 2, 2, 64, 40, [1, 40, 17], 1, torch.float32, 30.0),
    "gqa2-3-splits": (3, 4, 2, 128, 40, [40, 1, 33], 3, torch.float32, 1.0),
    # 8 splits of 16 keys over 37: the last five are empty for every row
    "gqa4-8-splits": (2, 8, 2, 64, 37, [37, 5], 8, torch.float16, 1.0),
    "16/8-bf16": (2, 16, 8, 128, 50, [50, 2], 2, torch.bfloat16, 1.0),
    # rows far shorter than S cut into 4 chunks of their own: 70 keys as 32 + 32 + 6 + nothing
    "short-rows-4-splits": (3, 4, 2, 64, 200, [200, 70, 33], 4, torch.float32, 1.0),
    "gqa16-1-split": (1, 16, 1, 64, 20, [20], 1, torch.float32, 1.0),
}


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_attention(q7, case):
    """Against float64 on cache views: ragged lengths from 1 to S, GQA groups of 1 to 16, D = 64
    and 128, one split, several, and splits with nothing to read."""
    B, Hq, Hkv, D, S, lengths, splits, dtype, scale = DECODE_CASES[case]
    q = gen64(B, Hq, D, seed=11) * scale
    k, v = cache_views(B, Hkv, S, D, seed=12)
    q, k, v = (x.to(DEVICE, dtype) for x in (q, k, v))
    lengths = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = q7.decode_attention(q, k, v, lengths, num_splits=splits)
    assert out.shape == (B, Hq, D) and out.dtype == dtype
    error = (out.cpu().double() - decode_float64(q, k, v, lengths)).abs().max().item()
    assert error < DECODE_TOL[dtype]


def test_decode_attention_split_rule_and_edges(q7, monkeypatch):
    """The split rule's count on an H200's 132 SMs (5 splits of 128 keys here); max_len below
    the cache's length (the engine's kv_len); a length past max_len (clamped to it); a row of
    length 0 (output 0); int64 lengths; a custom scale."""
    monkeypatch.setattr(q7, "_num_sms", lambda device: 132)
    q, (k, v) = gen64(3, 4, 64, seed=13), cache_views(3, 1, 620, 64, seed=14)
    lengths = torch.tensor([600, 0, 700])
    launched = []
    monkeypatch.setattr(q7, "_decode_merge_kernel", MergeSpy(q7._decode_merge_kernel, launched))
    out = q7.decode_attention(*(x.float().to(DEVICE) for x in (q, k, v)), lengths.to(DEVICE),
                              max_len=600, sm_scale=0.2)
    assert launched == [5]  # wanted: 4 * 132 / 3 programs; capped by 600 / 128 keys a split
    expected = decode_float64(q * 0.2 * math.sqrt(64), k, v, lengths.clamp(max=600))
    assert (out.cpu().double() - expected).abs().max().item() < 1e-5
    assert out[1].abs().max().item() == 0


class MergeSpy:
    """Stands in for the merge kernel: records its SPLITS argument, then launches it."""

    def __init__(self, kernel, record):
        self.kernel, self.record = kernel, record

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.record.append(args[6])
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_decode_split_rule(q7):
    """Four programs an SM, at least 128 keys a split, at most 64 splits (132 SMs)."""
    assert q7.decode_splits(64, 8, 4096, 132) == 2  # 512 programs < 528
    assert q7.decode_splits(128, 8, 4096, 132) == 1
    assert q7.decode_splits(1, 8, 4096, 132) == 32  # 128-key splits
    assert q7.decode_splits(1, 8, 272, 132) == 3
    assert q7.decode_splits(1, 8, 40960, 132) == 64  # 66 wanted
    assert q7.decode_splits(1, 8, 100, 132) == 1


DECODE_BAD = [  # (what changes, error, message)
    (dict(q=("shape", (2, 4, 1, 64))), ValueError, r"q must be \(B, Hq, D\)"),
    (dict(v_cache=("shape", (2, 2, 9, 64))), ValueError, r"one \(B, Hkv, S, D\) shape"),
    (dict(q=("shape", (3, 4, 64))), ValueError, "disagree on B or D"),
    (dict(lengths=("shape", (3,))), ValueError, "disagree on B or D"),
    (dict(q=("shape", (2, 3, 64))), ValueError,
     r"query heads \(3\) must be a multiple of kv heads \(2\)"),
    (dict(q=("shape", (2, 4, 48)), k_cache=("shape", (2, 2, 8, 48)),
          v_cache=("shape", (2, 2, 8, 48))), ValueError, "head size D=48 is not supported"),
    (dict(k_cache=("dtype", torch.float16)), TypeError, "k_cache has dtype torch.float16"),
    (dict(q=("dtype", torch.float64)), TypeError, "q has dtype torch.float64"),
    (dict(lengths=("dtype", torch.float32)), TypeError, "lengths has dtype torch.float32"),
    (dict(k_cache=("transpose",)), ValueError, "need a unit last stride"),
    (dict(max_len=9), ValueError, r"max_len must be an int in \[1, S=8\], got 9"),
    (dict(max_len=0), ValueError, r"max_len must be an int in \[1, S=8\], got 0"),
    (dict(max_len=4.0), ValueError, r"max_len must be an int"),
    (dict(num_splits=65), ValueError, r"num_splits must be an int in \[1, 64\] or None, got 65"),
    (dict(num_splits=0), ValueError, "num_splits must be an int"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale must be a positive number"),
]


@pytest.mark.parametrize("change, error, message", DECODE_BAD)
def test_decode_attention_refuses_bad_inputs(q7, change, error, message):
    args = dict(q=torch.ones(2, 4, 64), k_cache=torch.ones(2, 2, 8, 64),
                v_cache=torch.ones(2, 2, 8, 64), lengths=torch.ones(2, dtype=torch.int32))
    for name, how in change.items():
        if name not in args:
            args[name] = how
        elif how[0] == "shape":
            args[name] = torch.ones(how[1], dtype=args[name].dtype)
        elif how[0] == "dtype":
            args[name] = args[name].to(how[1])
        else:  # a view whose last stride is not 1
            args[name] = torch.ones(2, 2, 64, 8).transpose(-1, -2)
    args = {name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in args.items()}
    with pytest.raises(error, match=message):
        q7.decode_attention(**args)


@torch.no_grad()
def test_cached_decode_on_the_kernel_matches_the_torch_path(q7, hf_dir, monkeypatch):
    """The model's cached steps with kernels on (the decode kernel in every layer of every
    one-token step) against the torch path: a ragged prefill, then steps at each row's own
    position; logits within 1e-4."""
    model = q7.load_qwen3(hf_dir[1], device=DEVICE, dtype=torch.float32)
    seen = []
    kernel = q7.decode_attention
    monkeypatch.setattr(q7, "decode_attention",
                        lambda q, k, v, lengths, max_len: seen.append((lengths.tolist(), max_len))
                        or kernel(q, k, v, lengths, max_len, num_splits=2))
    ids = torch.tensor([random_ids(12, seed=8), random_ids(12, seed=9)], device=DEVICE)  # (2, 12)
    results = []
    for on in (False, True):
        model.use_kernels(on)
        cache = q7.KVCache(model.cfg, rows=2, length=16, device=DEVICE, dtype=torch.float32)
        model.hidden_states(ids[:, :7], cache=cache)  # row 1's prompt is 4 tokens, then padding
        pos = torch.tensor([7, 4], device=DEVICE)
        for _ in range(4):
            step = ids[torch.arange(2), pos][:, None]  # (2, 1)
            results.append(model(step, pos[:, None], cache, kv_len=int(pos.max()) + 1))
            pos += 1
    for torch_path, on_kernel in zip(results[:4], results[4:]):
        assert (on_kernel - torch_path).abs().max().item() < 1e-4
    layers = model.cfg.num_hidden_layers
    assert seen == [([8 + i, 5 + i], 8 + i) for i in range(4) for _ in range(layers)]


def test_the_gpu_benches_need_a_gpu(q7, monkeypatch, capsys):
    """--bench runs the attention, decode, throughput and speculation benches after the
    structured-output one; without CUDA each says so and times nothing."""
    monkeypatch.setattr(q7, "bench_structured", lambda *a, **k: print("structured bench ran"))
    monkeypatch.setattr(q7, "decode_attention", lambda *a, **k: pytest.fail("timed on a CPU"))
    monkeypatch.setattr(q7, "random_model", lambda *a, **k: pytest.fail("built on a CPU"))
    q7.main(["--bench", "--device", "cpu"])
    out = capsys.readouterr().out
    skipped = [out.index(f"{name} bench: needs a CUDA GPU (a CPU shows correctness, not speed); "
                         f"skipped") for name in ("attention", "decode", "throughput",
                                                  "speculative decoding")]
    assert out.index("structured bench ran") < skipped[0] and skipped == sorted(skipped)


# -- fast decode: fused kernels and CUDA graphs ------------------------------------------------

@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("add", [False, True])
def test_add_rms_norm_kernel(q7, dtype, tol, add):
    """x += r (rounded to x's dtype, as torch's add), then RMSNorm of the sum; odd width 48."""
    x, r, w = gen64(3, 48, seed=1) * 3 + 0.5, gen64(3, 48, seed=2), gen64(48, seed=3)
    x_in, r_in = x.to(DEVICE, dtype), r.to(DEVICE, dtype)
    total = (x_in + r_in if add else x_in).double().cpu()  # the stream as torch rounds it
    expected = total / torch.sqrt(total.pow(2).mean(-1, keepdim=True) + 0.05) * w
    y = q7.add_rms_norm(x_in, r_in if add else None, w.to(DEVICE, dtype), 0.05).cpu()
    # the residual stream, updated in place: exact, but for the interpreter's bf16 rounding (it
    # truncates where the GPU rounds to nearest: one unit in the last place)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 and q7.INTERPRET else 0.0
    torch.testing.assert_close(x_in.cpu().double(), total, rtol=ulp, atol=0)
    assert ((y.double() - expected).norm() / expected.norm()).item() < tol


def qk_norm_rope_float64(qkv, positions, inv_freq, q_w, k_w, eps, Hq, Hkv, D):
    """The model's path for one token a row, in float64: per-head RMSNorm, rotate-half RoPE."""
    heads = qkv.double().view(qkv.shape[0], Hq + 2 * Hkv, D)
    q, k, v = heads[:, :Hq], heads[:, Hq:Hq + Hkv], heads[:, Hq + Hkv:]

    def norm_rope(x, w):
        x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()
        angles = positions.double()[:, None] * inv_freq.double()  # (B, D/2)
        both = torch.cat((angles, angles), -1)[:, None]  # (B, 1, D): each angle for both halves
        cos, sin = both.cos(), both.sin()
        return x * cos + torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1) * sin

    return norm_rope(q, q_w), norm_rope(k, k_w), v


@pytest.mark.parametrize("Hq, Hkv", [(4, 2), (6, 2)])  # 8 heads a token; 10, in 16 rows
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_qk_norm_rope_kernel(q7, dtype, tol, Hq, Hkv):
    """Queries returned, keys and values written into a paged cache layer at each token's slot
    (every other slot untouched), against float64; the torch twin too."""
    N, D, eps = 3, 32, 0.05
    qkv = gen64(N, (Hq + 2 * Hkv) * D, seed=4) * 2
    q_w, k_w = gen64(D, seed=5) + 1, gen64(D, seed=6) + 1
    positions, slots = torch.tensor([0, 17, 5]), torch.tensor([9, 2, 30])
    inv_freq = 1.0 / 500.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    eq, ek, ev = qk_norm_rope_float64(qkv.to(dtype), positions, inv_freq, q_w.to(dtype),
                                      k_w.to(dtype), eps, Hq, Hkv, D)
    attn = argparse.Namespace(q_norm=q7.RMSNorm(D, eps), k_norm=q7.RMSNorm(D, eps))
    attn.q_norm.weight.data, attn.k_norm.weight.data = q_w.to(dtype), k_w.to(dtype)
    for kernel in (True, False):
        device = DEVICE if kernel else "cpu"
        cache = torch.zeros(2, 4, 8, Hkv, D, device=device, dtype=dtype)  # (k|v, blocks, 8, Hkv, D)
        args = qkv.to(device, dtype), positions.to(device), slots.to(device)
        if kernel:
            q = q7.qk_norm_rope(*args, inv_freq.to(device), q_w.to(device, dtype),
                                k_w.to(device, dtype), eps, cache[0], cache[1])
        else:
            q = q7.qk_norm_rope_torch(*args, attn, inv_freq, cache[0], cache[1])
        assert q.shape == (N, Hq, D) and q.dtype == dtype
        assert ((q.cpu().double() - eq).norm() / eq.norm()).item() < tol
        k, v = (c.cpu().view(-1, Hkv, D)[slots] for c in cache)  # (N, Hkv, D)
        assert ((k.double() - ek).norm() / ek.norm()).item() < tol
        assert torch.equal(v.double(), ev)
        written = torch.zeros(32, dtype=torch.bool)
        written[slots] = True
        assert cache.cpu().view(2, 32, -1)[:, ~written].abs().max() == 0  # nothing else written


def test_swiglu_halves_kernel(q7):
    gu = gen64(5, 2 * 1100, seed=7) * 4  # more than one block a row
    y = q7.swiglu_halves(gu.float().to(DEVICE)).cpu()
    g, u = gu[:, :1100], gu[:, 1100:]
    assert ((y.double() - F.silu(g) * u).abs().max()).item() < 1e-5


def matvec_float64(x, w, kind, r=None, nw=None, eps=0.05, dtype=torch.float32):
    """What matvec computes, in float64, rounding to dtype where the kernel rounds: the residual
    sum, the normalized row and silu(gate) * up; the product itself unrounded."""
    if kind == "swiglu":
        g, u = x.chunk(2, dim=-1)
        x = (F.silu(g) * u).to(dtype).double()
    elif kind != "plain":
        if kind == "add_norm":
            x = (x.to(dtype) + r.to(dtype)).double()
        x = (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * nw).to(dtype).double()
    return x @ w.T


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("kind", ["plain", "norm", "add_norm", "swiglu"])
@pytest.mark.parametrize("N, K", [(37, 100), (6, 20)])
def test_matvec_kernel(q7, dtype, tol, kind, N, K):
    """Each prologue of matvec against float64, at sizes that are no multiple of the tiles (the
    second narrower than one), so every mask counts; add_norm also returns x + r, rounded as
    torch's add."""
    x = gen64(1, 2 * K if kind == "swiglu" else K, seed=11) * 2
    r, w, nw = gen64(1, K, seed=12), gen64(N, K, seed=13), gen64(K, seed=14) + 1
    kwargs = {} if kind in ("plain", "swiglu") else dict(norm_weight=nw.to(DEVICE, dtype), eps=0.05)
    if kind == "add_norm":
        kwargs["residual"] = r.to(DEVICE, dtype)
    x_in = x.to(DEVICE, dtype)
    out = q7.matvec(x_in, w.to(DEVICE, dtype), swiglu=kind == "swiglu", **kwargs)
    y, stream = out if "norm" in kind else (out, None)
    expected = matvec_float64(x.to(dtype).double(), w.to(dtype).double(), kind, r,
                              nw.to(dtype).double(), dtype=dtype)
    assert y.shape == (1, N) and y.dtype == dtype
    assert ((y.cpu().double() - expected).norm() / expected.norm()).item() < tol
    if kind == "norm":
        assert stream is x_in  # no residual: the stream is x itself
    if kind == "add_norm":
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 and q7.INTERPRET else 0.0  # see add_rms_norm's
        torch.testing.assert_close(stream.cpu(), x_in.cpu() + r.to(dtype), rtol=ulp, atol=0)


def test_fused_kernels_refuse_bad_inputs(q7):
    ones = functools.partial(torch.ones, device=DEVICE)
    with pytest.raises(ValueError, match=r"residual \(2, 5\) and x \(2, 4\) differ"):
        q7.add_rms_norm(ones(2, 4), ones(2, 5), ones(4), 1e-6)
    with pytest.raises(TypeError, match="residual has dtype torch.float16"):
        q7.add_rms_norm(ones(2, 4), ones(2, 4, dtype=torch.float16), ones(4), 1e-6)
    cache, index = ones(2, 8, 2, 32), ones(2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"qkv \(2, 100\), positions \(2,\) and slots \(2,\) do not fit"):
        q7.qk_norm_rope(ones(2, 100), index, index, ones(16), ones(32), ones(32), 1e-6, cache, cache)
    with pytest.raises(ValueError, match=r"one \(blocks, block_size, Hkv, D\) shape"):
        q7.qk_norm_rope(ones(2, 256), index, index, ones(16), ones(32), ones(32), 1e-6, cache,
                        ones(2, 8, 32))
    with pytest.raises(ValueError, match=r"gate_up must be \(rows, 2n\)"):
        q7.swiglu_halves(ones(2, 5))
    with pytest.raises(ValueError, match=r"matvec: x \(5, 8\) and weight \(3, 8\) do not fit"):
        q7.matvec(ones(5, 8), ones(3, 8))  # one row only
    with pytest.raises(ValueError, match=r"x \(1, 8\) and weight \(3, 8\) do not fit .*2K"):
        q7.matvec(ones(1, 8), ones(3, 8), swiglu=True)
    with pytest.raises(ValueError, match="swiglu or norm_weight, not both"):
        q7.matvec(ones(1, 16), ones(3, 8), swiglu=True, norm_weight=ones(8))
    with pytest.raises(ValueError, match="give norm_weight too"):
        q7.matvec(ones(1, 8), ones(3, 8), residual=ones(1, 8))
    with pytest.raises(ValueError, match=r"norm_weight is \(9,\), expected \(8,\)"):
        q7.matvec(ones(1, 8), ones(3, 8), norm_weight=ones(9))
    with pytest.raises(TypeError, match="weight has dtype torch.float16"):
        q7.matvec(ones(1, 8), ones(3, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="weight is on meta"):
        q7.matvec(ones(1, 8), torch.ones(3, 8, device="meta"))


def test_fuse_projections_keeps_the_parameters(q7, hf_dir):
    """The fused weights are the parameters' own memory: same names, values and count; a
    replaced parameter is noticed and fused again."""
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    before = {name: p.clone() for name, p in model.state_dict().items()}
    count = model.num_params()
    q7.fuse_projections(model)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attn.qkv_weight.shape == (128 + 2 * 64, 48) and mlp.gate_up_weight.shape == (160, 48)
    assert attn.v_proj.weight.data_ptr() == attn.qkv_weight[192:].data_ptr()
    state = model.state_dict()
    assert state.keys() == before.keys() and model.num_params() == count
    assert all(torch.equal(state[name], before[name]) for name in before)
    fused = attn.qkv_weight
    assert q7.fuse_projections(model).model.layers[1].self_attn.qkv_weight is fused  # idempotent
    model.load_state_dict({name: t + 1 for name, t in before.items()}, assign=True)
    q7.fuse_projections(model)
    assert torch.equal(attn.qkv_weight[:128], before["model.layers.1.self_attn.q_proj.weight"] + 1)


@pytest.mark.parametrize("rows, mixed", [(1, False), (1, True), (3, False)])
@torch.no_grad()
def test_forward_packed_matches_the_model_path(q7, hf_dir, monkeypatch, rows, mixed):
    """forward_packed on the kernels (interpreter: the fused kernels and the paged prefill and
    decode kernels) and on its torch twin, against the model's own path without a cache:
    prompts of 12, 5 and 9 tokens packed side by side in one step over a paged cache of blocks
    of 4 (handed out in reverse), then three decode steps, each row's first token again at its
    next position; logits within 1e-4. One row decodes on matvec; mixed: the projections of the
    48-wide stream on matvec and o_proj and down_proj (128 and 80 columns) on torch's, as a
    model wider than _on_matvec's limit has some of each; three rows on add_rms_norm,
    swiglu_halves and torch's matmuls."""
    if mixed:
        monkeypatch.setattr(q7, "_on_matvec", lambda x, w: x.shape[0] == 1 and w.shape[1] <= 64)
    model = q7.load_qwen3(hf_dir[1], device=DEVICE, dtype=torch.float32)
    prompts = [random_ids(12, seed=8), random_ids(5, seed=9), random_ids(9, seed=10)][:rows]
    full = model.use_kernels(False)
    expected = [full(torch.tensor([p], device=DEVICE))[0] for p in prompts]  # (T, V) each
    for i in range(3):
        expected += [full(torch.tensor([p + [p[0]] * (i + 1)], device=DEVICE))[:, -1]
                     for p in prompts]
    expected = torch.cat(expected)
    for kernels in (False, True):
        got = q7.packed_logits(model.use_kernels(kernels), prompts, steps=3, block_size=4)
        assert (got - expected).abs().max().item() < 1e-4


def test_graph_buckets(q7):
    assert [q7.graph_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 100)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 24, 104]


def test_warm_up_makes_the_steps_a_first_request_would_wait_for(q7, monkeypatch):
    """warm_up's made-up steps, recorded on the CPU in place of the run: one a prefill tile size
    (128, 256, 512, then the budget), of that many tokens, an eighth of them decodes of
    CAPTURE_KEYS keys (cut to max_len) within max_num_seqs, the rest prompt chunks of at most
    max_len; then a decode step a batch bucket, largest first; every token in the scratch
    block. On the CPU there is nothing to do."""
    model = q7.random_model(q7.Qwen3Config.tiny(), torch.device("cpu"), torch.float32)
    runner = q7.ModelRunner(model, 64, 16, 256)
    assert runner.warm_up(8, 1000) == 0.0
    steps = []
    runner.graphs = object()  # (only whether there are graphs matters)
    monkeypatch.setattr(runner, "run", steps.append)
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    monkeypatch.setattr(model, "kernels", True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    runner.warm_up(8, 1000)
    sizes = [128, 256, 512, 1000]
    assert [sum(len(e[0]) for e in entries) for entries in steps[:4]] == sizes
    scratch = runner.scratch_slot // 16
    for tokens, entries in zip(sizes, steps):
        decodes = [e for e in entries if len(e[0]) == 1]
        assert len(decodes) == min(tokens // 8, 8 - -(-tokens // 256)) and len(entries) <= 8
        assert all(start == 255 for _, _, start, _, _ in decodes)
        for ids, _, start, table, _ in entries:
            assert start + len(ids) <= 256 and set(table) == {scratch}
            assert len(table) * 16 >= start + len(ids)
    assert [len(entries) for entries in steps[4:]] == [8, 4, 2, 1]
    for entries in steps[4:]:
        assert all(ids == [0] and start == 255 and set(table) == {scratch}
                   for ids, _, start, table, _ in entries)


# ------------------------------------------------------------------------------ generation

def hf_greedy(hf, prompt, max_new_tokens):
    """transformers' greedy continuation of one prompt (token ids), the new ids only."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def test_greedy_tokens_equal_transformers_generate(q7, hf_dir):
    """Four prompts, at most two running at once (max_num_seqs 2), against transformers' greedy
    generate, one prompt at a time."""
    hf, folder = hf_dir
    llm = q7.LLM(folder, device="cpu", max_model_len=40, max_num_seqs=2)
    prompts = [*PROMPTS, random_ids(1, seed=4)]
    outputs = llm.generate(prompts, q7.SamplingParams(temperature=0, max_tokens=12))
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)
        assert out.outputs[0].finish_reason == "length" and out.outputs[0].text is None
    assert len({tuple(out.outputs[0].token_ids) for out in outputs}) == 4


def test_generate_again_starts_clean(q7, llm):
    params = q7.SamplingParams(temperature=0, max_tokens=5)
    first = llm.generate(PROMPTS, params)
    llm.generate([PROMPTS[2]], params)
    again = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert not llm.engine.has_unfinished()


@torch.no_grad()
def test_logprobs_are_the_models(q7, hf_dir, llm):
    hf = hf_dir[0]
    params = q7.SamplingParams(temperature=0.9, seed=3, max_tokens=6, logprobs=3)
    out = llm.generate([PROMPTS[0], PROMPTS[1]], [params, q7.SamplingParams(max_tokens=2)])
    assert out[1].outputs[0].logprobs is None
    prompt, got = PROMPTS[0], out[0]
    logp = hf(torch.tensor([prompt + got.outputs[0].token_ids])).logits[0, len(prompt) - 1:-1].double().log_softmax(-1)
    assert len(got.outputs[0].logprobs) == 6
    for step, (token, entry) in enumerate(zip(got.outputs[0].token_ids, got.outputs[0].logprobs)):
        top = logp[step].topk(3)
        assert set(entry) == {token, *top.indices.tolist()}
        for token_id, value in entry.items():
            assert abs(value - logp[step, token_id].item()) < 1e-4


def test_finish_reasons_and_text(q7, qwen_dir, qwen_hf):
    """The eos or stop id that ends a request is not in its text, and neither are special tokens
    (vLLM's skip_special_tokens); the reference is tokenizers' decode. A special token is made to
    come out mid-text by giving it an output row twice that of a token greedy decoding picks."""
    model = q7.load_qwen3(qwen_dir, device="cpu")
    tokenizer = q7.load_tokenizer(qwen_dir)
    prompt = tokenizer.encode("the cat sat")
    greedy = q7.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = q7.LLM(model, max_model_len=40).generate([prompt], greedy)[0].outputs[0].token_ids
    im_start = qwen_hf.token_to_id("<|im_start|>")
    with torch.no_grad():
        model.lm_head.weight[im_start] = 2 * model.lm_head.weight[first[1]]
    tokens = q7.LLM(model, max_model_len=40).generate([prompt], greedy)[0].outputs[0].token_ids
    assert im_start in tokens[:-1]

    def text(ids):
        return qwen_hf.decode(ids, skip_special_tokens=True)

    out = q7.LLM(model, tokenizer=tokenizer, max_model_len=40).generate([prompt], greedy)[0]
    assert (out.outputs[0].token_ids, out.outputs[0].finish_reason, out.outputs[0].text) == (tokens, "length", text(tokens))
    assert out.outputs[0].text != qwen_hf.decode(tokens, skip_special_tokens=False)
    stop = tokens[3]
    ends_at_stop = copy.copy(tokenizer)
    ends_at_stop.eos_token_ids = frozenset({stop})
    end = tokens.index(stop)
    out = q7.LLM(model, tokenizer=ends_at_stop, max_model_len=40).generate(
        [prompt], q7.SamplingParams(temperature=0, max_tokens=10))[0]  # the eos id ends it
    assert (out.outputs[0].token_ids, out.outputs[0].finish_reason, out.outputs[0].text) == (tokens[:end + 1], "stop", text(tokens[:end]))
    other = next(t for t in tokens[4:] if t not in tokens[:4])
    end = tokens.index(other)
    out = q7.LLM(model, tokenizer=tokenizer, max_model_len=40).generate(  # a stop id
        [prompt], q7.SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[other],
                                    ignore_eos=True))[0]
    assert (out.outputs[0].token_ids, out.outputs[0].finish_reason, out.outputs[0].text) == (tokens[:end + 1], "stop", text(tokens[:end]))
    out = q7.LLM(model, tokenizer=tokenizer, max_model_len=40).generate(
        "the cat sat", q7.SamplingParams(max_tokens=None, seed=1, ignore_eos=True))[0]
    assert out.prompt_token_ids == qwen_hf.encode("the cat sat").ids
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40 and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text == text(out.outputs[0].token_ids)


def test_eos_ids_come_from_the_config_files(q7, hf_dir, tmp_path):
    tokens = q7.LLM(hf_dir[1], device="cpu", max_model_len=40).generate(
        [PROMPTS[1]], q7.SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    folder = save_hf(hf_dir[0], tmp_path)
    write_config(folder, eos_token_id=tokens[4])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokens[2], 130]}))
    assert q7.config_eos_token_ids(folder) == {tokens[4], tokens[2], 130}
    out = q7.LLM(folder, device="cpu", max_model_len=40).generate(
        [PROMPTS[1]], q7.SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.outputs[0].token_ids == tokens[:min(tokens.index(tokens[2]), tokens.index(tokens[4])) + 1]


# --------------------------------------------------------------------------------- sampling

def sampling_batch(q7, params, prompts=None, vocab=None):
    return q7.SamplingBatch(params, prompts or [[0]] * len(params), vocab, "cpu")


def expected_probs(logits, p):
    """The distribution a row samples from, by the definitions, in float64 Python."""
    z = [x / p.temperature for x in logits]
    keep = set(range(len(z)))
    if p.top_k:
        kth = sorted(z, reverse=True)[p.top_k - 1]
        keep = {i for i in keep if z[i] >= kth}

    def softmax(kept):
        m = max(z[i] for i in kept)
        e = {i: math.exp(z[i] - m) for i in kept}
        return {i: v / sum(e.values()) for i, v in e.items()}

    if p.top_p < 1:  # walk down the ranking until the mass reaches top_p (that token stays)
        probs, mass, kept = softmax(keep), 0.0, set()
        for i in sorted(keep, key=lambda i: -probs[i]):
            if mass >= p.top_p:
                break
            kept.add(i)
            mass += probs[i]
        keep = kept
    if p.min_p > 0:
        probs = softmax(keep)
        keep = {i for i in keep if probs[i] >= p.min_p * max(probs.values())}
    probs = softmax(keep)
    return [probs.get(i, 0.0) for i in range(len(z))]


def test_filters_match_their_definitions(q7):
    """Each row of one batch with its own temperature, top-k, top-p and min-p, against the
    definitions: the same support, the same probabilities."""
    P = q7.SamplingParams
    params = [P(temperature=0.7, top_k=5), P(temperature=1.3, top_p=0.6), P(min_p=0.2),
              P(temperature=0.5, top_k=12, top_p=0.9, min_p=0.05), P(temperature=2.0),
              P(top_k=1), P(top_p=0.05)]
    logits = gen64(len(params), 40, seed=11) * 2
    probs = q7.Sampler.probs(logits.float(), sampling_batch(q7, params, vocab=40))
    for row, p in enumerate(params):
        expected = torch.tensor(expected_probs(logits[row].tolist(), p))
        assert torch.equal(probs[row] > 0, expected > 0), f"row {row}: another support"
        assert (probs[row].double() - expected).abs().max().item() < 1e-6, f"row {row}"
    assert [int((probs[row] > 0).sum()) for row in (0, 5, 6)] == [5, 1, 1]


def test_greedy_rows_take_the_argmax(q7):
    """temperature 0, or one so small that logits / temperature would overflow, is greedy; a
    batch mixing them with sampled rows gives each row its own way."""
    P = q7.SamplingParams
    params = [P(temperature=0), P(temperature=1e-30), P(temperature=1e-4, seed=0), P(temperature=5.0, seed=1)]
    logits = (gen64(4, 30, seed=13) * 3).float()
    logits[2, 7] = logits[2].max() + 0.01  # at temperature 1e-4 a gap of 0.01 is decisive
    tokens, _ = q7.Sampler()(logits, sampling_batch(q7, params, vocab=30))
    assert tokens[:3].tolist() == [int(logits[0].argmax()), int(logits[1].argmax()), 7]
    assert torch.isfinite(q7.Sampler.probs(logits, sampling_batch(q7, params, vocab=30))).all()


def test_top_p_keeps_the_token_that_crosses(q7):
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    for top_p, kept in [(0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.96, 4), (1.0, 4)]:
        probs = q7.Sampler.probs(logits, sampling_batch(q7, [q7.SamplingParams(top_p=top_p)], vocab=4))
        assert int((probs > 0).sum()) == kept, top_p


def chi_square_limit(df, z=3.72):
    """The chi-square value that df degrees of freedom exceed with probability 1e-4 (z = 3.72)
    (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("seeded", [False, True])
def test_draws_follow_the_probabilities(q7, seeded):
    """20,000 draws of one filtered distribution: never a token outside it, and counts that a
    chi-square test accepts. Unseeded rows share torch's generator; seeded ones draw each from
    its own."""
    n, logits = 20000, gen64(1, 12, seed=12)[0] * 1.5
    p = q7.SamplingParams(temperature=0.8, top_k=9, top_p=0.95, min_p=0.02)
    expected = torch.tensor(expected_probs(logits.tolist(), p))
    rows = [q7.SamplingParams(temperature=0.8, top_k=9, top_p=0.95, min_p=0.02, seed=i)
            for i in range(n)] if seeded else [p] * n
    torch.manual_seed(0)
    tokens, _ = q7.Sampler()(logits.float().expand(n, -1), sampling_batch(q7, rows, vocab=12))
    counts = torch.bincount(tokens, minlength=12).double()
    support = expected > 0
    assert counts[~support].sum() == 0 and 3 <= int(support.sum()) < 12
    chi2 = ((counts[support] - n * expected[support]) ** 2 / (n * expected[support])).sum().item()
    assert chi2 < chi_square_limit(int(support.sum()) - 1), chi2


def test_penalties_match_their_definitions(q7):
    P = q7.SamplingParams
    params = [P(repetition_penalty=5.0, temperature=0), P(presence_penalty=0.7, frequency_penalty=-0.4),
              P(repetition_penalty=0.8, frequency_penalty=1.1)]
    # row 1's prompt holds 4, which its output never does: the presence and frequency
    # penalties count the output only (vLLM's), the repetition penalty the prompt too
    prompts = [[1, 2], [3, 4], [0, 4, 4]]
    batch = sampling_batch(q7, params, prompts, vocab=6)
    outputs = [[2, 5, 5], [3, 3, 1], [5, 0, 4]]
    for step in range(3):
        batch.record(torch.tensor([out[step] for out in outputs]))
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.3, -0.2, 1.0]] * 3)
    penalized = q7.apply_penalties(logits, batch)
    for row, p in enumerate(params):
        for token in range(6):
            x = logits[row, token].item()
            count = outputs[row].count(token)
            if token in prompts[row] or count:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            assert penalized[row, token].item() == pytest.approx(x, abs=1e-6), (row, token)
    batch = sampling_batch(q7, params[:1], prompts[:1], vocab=6)
    tokens, _ = q7.Sampler()(logits[:1], batch)
    assert tokens.tolist() == [5]  # greedy after the penalty: token 2 (in the prompt) drops to 0.4


def test_n_completions_of_a_prompt(q7, llm, hf_dir):
    """n completions: one RequestOutput a prompt (vLLM's shape), its outputs indexed 0..n-1;
    completion j is the prompt drawn with seed + j alone; greedy ones are all the greedy text.
    The engine itself runs one completion a request, and says so."""
    P = q7.SamplingParams
    results = llm.generate([PROMPTS[0], PROMPTS[1]], P(n=3, temperature=1.0, seed=5, max_tokens=6))
    assert [r.request_id for r in results] == [0, 1] and all(r.finished for r in results)
    for prompt, result in zip((PROMPTS[0], PROMPTS[1]), results):
        assert result.prompt_token_ids == prompt and [c.index for c in result.outputs] == [0, 1, 2]
        for j, completion in enumerate(result.outputs):
            alone = llm.generate([prompt], P(temperature=1.0, seed=5 + j, max_tokens=6))[0]
            assert completion.token_ids == alone.outputs[0].token_ids
        assert len({tuple(c.token_ids) for c in result.outputs}) > 1
    greedy = llm.generate([PROMPTS[2]], P(n=2, temperature=0, max_tokens=5))[0].outputs
    assert greedy[0].token_ids == greedy[1].token_ids == hf_greedy(hf_dir[0], PROMPTS[2], 5)
    with pytest.raises(ValueError, match="n = 2: the engine runs one completion a request"):
        llm.engine.add_request("x", PROMPTS[0], P(n=2))
    with pytest.raises(ValueError, match=r"SamplingParams.n = 0: must be a positive int"):
        P(n=0)


def test_stop_strings_are_stage_08s(q7):
    """Stop strings are matched on the streamed text (stage 08's Detokenizer): here a non-empty
    one is an error that says where they live and what to use instead."""
    assert q7.SamplingParams(stop=None).stop is None and not q7.SamplingParams(stop=[]).stop
    with pytest.raises(ValueError, match="stop strings are matched on the streamed text, stage "
                                         "08's work .* end a request with stop_token_ids"):
        q7.SamplingParams(stop=["\n\n"])


def test_a_seed_gives_the_same_tokens_in_any_batch(q7, llm):
    P = q7.SamplingParams
    seeded = P(temperature=1.0, top_p=0.9, seed=7, max_tokens=10)
    alone = llm.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids
    crowd = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[0]],
                         [P(temperature=1.0, max_tokens=12), seeded, P(temperature=0, max_tokens=3),
                          P(temperature=0.7, seed=8, top_k=20, max_tokens=10), seeded])
    assert crowd[1].outputs[0].token_ids == alone == crowd[4].outputs[0].token_ids  # two batches: 4 rows, then 1
    assert crowd[3].outputs[0].token_ids != alone  # another seed, another sample
    assert llm.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids == alone
    # the seed decides, not the global random state: a request's own stream
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        assert llm.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids == alone
    reseeded = dataclasses.replace(seeded, seed=8)  # nothing else changed
    assert llm.generate([PROMPTS[0]], reseeded)[0].outputs[0].token_ids != alone


# ----------------------------------------------------------------------- structured output

# -- references written here: a JSON schema validator for the subset, a per-token mask ---------

def json_equal(a, b):
    """Equality of parsed JSON values, where true is not 1 and 1 is not "1"."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def has_type(value, kind):
    if isinstance(value, bool):
        return kind == "boolean"
    return {"object": isinstance(value, dict), "array": isinstance(value, list),
            "string": isinstance(value, str), "integer": isinstance(value, int),
            "number": isinstance(value, (int, float)), "boolean": False,
            "null": value is None}[kind]


def validate(value, schema, strict=False):
    """JSON schema validation for the subset; `strict` also demands what the grammar's policy
    writes: no properties beyond 'properties', in their declared order."""
    if "type" in schema and not has_type(value, schema["type"]):
        return False
    if "const" in schema:
        return json_equal(value, schema["const"])
    if "enum" in schema:
        return any(json_equal(value, v) for v in schema["enum"])
    if isinstance(value, dict):
        props = schema["properties"]
        if strict and list(value) != [k for k in props if k in value]:
            return False
        return all(k in value for k in schema.get("required", [])) and \
            all(validate(v, props[k], strict) for k, v in value.items() if k in props)
    if isinstance(value, list):
        return all(validate(v, schema["items"], strict) for v in value)
    return True


def brute_force_mask(dfa, vocab, eos_ids, state):
    """Token by token: allowed if every byte keeps dfa.trans off -1; eos only where accepting."""
    allowed = np.zeros(len(vocab), dtype=bool)
    for i, data in enumerate(vocab):
        if i in eos_ids:
            allowed[i] = dfa.accepting[state]
            continue
        s = state
        for byte in data or b"":
            s = dfa.trans[s, byte]
            if s < 0:
                break
        allowed[i] = bool(data) and s >= 0
    return allowed


def sample_accepted(dfa, rng, stop=0.3, limit=40):
    """A random text the DFA accepts: a random walk over live bytes, stopping at an accepting
    state with probability `stop` (None if the walk got too long)."""
    state, out = 0, bytearray()
    while len(out) < limit:
        if dfa.accepting[state] and (rng.random() < stop or (dfa.trans[state] < 0).all()):
            return bytes(out)
        byte = rng.choice(np.flatnonzero(dfa.trans[state] >= 0).tolist())
        out.append(byte)
        state = dfa.trans[state, byte]
    return None


def small_vocab(seed=0):
    """~700 tokens: the 256 bytes, JSON and word pieces, tokens that cut UTF-8 characters, random
    byte strings, a duplicate, ids with no bytes, and two eos ids (one with bytes of its own)."""
    rng = random.Random(seed)
    words = ['{"', '":', '":"', '","', '"}', '},', ',"', '[', '],', '"]', '[]', '{}', 'true',
             'false', 'null', 'name', 'na', 'me', 'age', 'tags', 'city', '12', '007', '3.5',
             'e+', 'E-', '-0', '.5', 'yes', 'no', 'maybe', 'ab', 'abc', 'cd', 'é', 'né', '€',
             '😀', '\\n', '\\"', '\\u00', '\\u0041', '\\ud8', 'x', 'xyz', 'a-b', '42,', ' ']
    pieces = [w.encode() for w in words]
    pieces += ["é".encode()[:1], "€".encode()[:2], "€".encode()[1:], "😀".encode()[:3],
               "😀".encode()[1:], "😀".encode()[2:], b"\xff", b"\xc0\x80", b'\x01"']
    alphabet = b'abcxyz0123456789-.,:"{}[]\\ e' + "é€😀".encode()
    pieces += [bytes(rng.choice(alphabet) for _ in range(rng.randint(2, 6))) for _ in range(400)]
    vocab = [bytes([b]) for b in range(256)] + list(dict.fromkeys(pieces))
    vocab += [b"name", None, None, b"", None, b"<eos>"]  # a duplicate, no bytes, then eos ids
    return vocab, [len(vocab) - 2, len(vocab) - 1]


VOCAB, EOS = small_vocab()


@pytest.fixture(scope="module")
def grammar_cache(q7):
    return q7.GrammarCache(VOCAB, EOS)


def generate_with_random_logits(q7, masker, gen, max_steps=4000):
    """Random-logit sampling under the masks: (the output's bytes, how it ended)."""
    state, out = masker.start, bytearray()
    for _ in range(max_steps):
        if masker.is_complete(state):
            return bytes(out), "finished"
        logits = 3 * torch.randn(1, len(VOCAB), generator=gen)
        q7.apply_token_masks(logits, [masker.mask(state)])
        token = torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen).item()
        state = masker.next_state(state, token)
        assert state != q7.DEAD, f"token {token} {VOCAB[token]!r} was allowed but is dead"
        if token in EOS:
            return bytes(out), "eos"
        out += VOCAB[token]
    raise AssertionError(f"no end after {max_steps} steps: {bytes(out)[:200]!r}")


# -- regex: the subset against re.fullmatch (ASCII classes, as documented) ---------------------

PATTERNS = [
    r"abc", r"a|b|", r"(ab|cd)*e?", r"a+b*c?", r"x{3}", r"x{2,}", r"x{1,3}y",
    r"(?:ab){2,3}", r"[a-cx-z]+", r"[^a-c]", r"[^\n]*", r"[]a]", r"[^]a]", r"[a-]", r"[-a]",
    r"\d+\.\d*", r"\w+\s\W", r"\D\S", r"[\d\s]+", r"[^\w]", r"\x41\u00e9😀",
    r"\.\*\+\?\(\)\[\]\{\}\|\\\^\$", r"\n\t\r", r".", r"..?", r"é+€?", r"[é-ë😀]+",
    r"[^é]", r"((a|b)(c|))*", r"()", r"(|a)+", r"-?(0|[1-9]\d*)(\.\d+)?",
    r"[^\x00-\x1f\"\\]{0,3}", r"}]", r"a{0}b",
]
ALPHABET = "abcdexyz019_- .\n\t\r\x0b\x0c\x07\x08{}[]()|*+?.\\$^AéêëÉ€😀\x00\x1f\"]"


def check_against_re(q7, pattern, rng, n_random=150, n_accepted=60):
    dfa = q7.compile_grammar(regex=pattern)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))
             for _ in range(n_random)]
    for _ in range(n_accepted):
        data = sample_accepted(dfa, rng)
        if data is not None:
            texts.append(data.decode("utf-8"))  # an accepted walk must be whole UTF-8 text
    accepted = 0
    for text in texts:
        expected = re.fullmatch(pattern, text, re.ASCII) is not None
        assert dfa.matches(text.encode()) == expected, (pattern, text)
        accepted += expected
    return accepted


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_agrees_with_re(q7, pattern):
    rng = random.Random(pattern)
    assert check_against_re(q7, pattern, rng) > 0, "no accepted text was checked"


REGEX_ATOMS = ["a", "b", "é", "€", "😀", r"\d", r"\w", r"\s", r"\D", r"\W", ".", "[a-c]", "[^ab]",
               r"[\d_]", r"\.", r"\n", r"\x41", r"\u00e9", "[é-ë]", r"[^\w]", "[^é€]"]
REGEX_QUANTIFIERS = ["*", "+", "?", "{2}", "{1,3}", "{2,}", "{0,1}"]


def random_regex(rng, depth=3):
    roll = rng.random()
    if depth == 0 or roll < 0.3:
        return rng.choice(REGEX_ATOMS)
    if roll < 0.55:
        return "".join(random_regex(rng, depth - 1) for _ in range(rng.randint(2, 3)))
    if roll < 0.75:
        options = "|".join(random_regex(rng, depth - 1) for _ in range(rng.randint(2, 3)))
        return rng.choice(["(", "(?:"]) + options + ")"
    return "(?:" + random_regex(rng, depth - 1) + ")" + rng.choice(REGEX_QUANTIFIERS)


def test_random_regexes_agree_with_re(q7):
    rng = random.Random(0)
    accepted = sum(check_against_re(q7, random_regex(rng), rng, 60, 20) for _ in range(120))
    assert accepted > 1000


def test_utf8_every_one_and_two_byte_string_and_sampled_longer_ones(q7):
    """'.' accepts exactly the UTF-8 encodings of one character other than a newline: checked
    on all byte strings of one and two bytes and on random ones of three and four."""
    dfa = q7.compile_grammar(regex=".")
    rng = random.Random(1)
    candidates = [bytes([a]) for a in range(256)] + [bytes([a, b]) for a in range(256)
                                                      for b in range(256)]
    candidates += [bytes(rng.choice([rng.randrange(256), rng.randrange(0x80, 0xC0)])
                         for _ in range(n)) for n in (3, 4) for _ in range(30_000)]
    candidates += [chr(c).encode() for c in (0x7FF, 0x800, 0xD7FF, 0xE000, 0xFFFF, 0x10000,
                                             0x10FFFF)] + [b"\xed\xa0\x80", b"\xf4\x90\x80\x80"]
    for data in candidates:
        try:
            text = data.decode("utf-8")
            expected = len(text) == 1 and text != "\n"
        except UnicodeDecodeError:
            expected = False
        assert dfa.matches(data) == expected, data


# Outside the subset: each is one error that quotes the construct.
UNSUPPORTED_REGEXES = [
    ("^a", "'^a'"), ("a$", "'$'"), (r"\bfoo", r"'\\bfo'"), (r"\Aa", r"'\\Aa'"),
    (r"(a)\1", r"'\\1'"), ("(?=a)", "'(?=a'"), ("(?<!a)b", "'(?<!'"), ("(?P<x>a)", "'(?P<'"), ("(?i)a", "'(?i)'"),
    ("a**", "'*'"), ("a{2}*", "'*'"), ("a*+", "'+'"), ("a*?", "'?'"), ("*a", "'*a'"),
    ("a|+", "'+'"), (r"\q", r"'\\q'"), (r"\p{L}", r"'\\p{L'"), (r"[\b]", r"'\\b]'"),
    (r"\U0001F600", r"'\\U00'"), (r"\f", r"'\\f'"), ("a{", "'{'"), ("{2}", "'{2}'"),
    ("x{,2}", "'{,2}'"),
]


@pytest.mark.parametrize("pattern, message", [
    *((pattern, quoted + " is not supported (the subset: ") for pattern, quoted in UNSUPPORTED_REGEXES),
    ("(a", "missing ')'"), ("a)", "unbalanced ')'"),
    ("[a", "unterminated character class"), ("[z-a]", "bad character range"),
    (r"[\d-z]", "bad character range"), ("a{3,2}", "greater than max"),
    ("a{5000}", "repeat count"), (r"\xZZ", "bad escape"), ("a\\", "unexpected end"),
    ("[^\x00-\U0010ffff]", "matches no text"), ("(a|b)*a(a|b){15}", "states"),
])
def test_regex_errors_name_the_construct(q7, pattern, message):
    with pytest.raises(q7.GrammarError, match=re.escape(message)):
        q7.compile_grammar(regex=pattern)


# -- JSON schema: every keyword, against the validator above -----------------------------------

KEYWORD_SCHEMAS = {
    "object/properties/required": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}},
        "required": ["b"]},
    "object/all optional": {"type": "object", "properties": {
        "x": {"type": "null"}, "y": {"type": "number"}}},
    "object/no properties": {"type": "object", "properties": {}},
    "object/additionalProperties+annotations": {
        "type": "object", "title": "T", "description": "d", "$schema": "x", "default": {},
        "properties": {"k": {"type": "string", "examples": ["e"]}}, "required": ["k"],
        "additionalProperties": False},
    "array/items": {"type": "array", "items": {"type": "integer"}},
    "string": {"type": "string"},
    "string/enum": {"type": "string", "enum": ["red", "green", "é\"\n"]},
    "string/const": {"type": "string", "const": "fixed"},
    "integer": {"type": "integer"},
    "number": {"type": "number"},
    "boolean": {"type": "boolean"},
    "null": {"type": "null"},
    "enum/mixed": {"enum": [1, "1", True, None, [1, {"a": 2}], {"b": [], "c": 1.5}]},
    "const/object": {"const": {"k": [1, 2], "v": "x"}},
    "nested": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "integer"}, "tag": {"enum": ["a", "b"]}}, "required": ["id"]}},
        "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                 "required": ["ok"]}}, "required": ["meta"]},
}

STRING_POOL = ["", "a", "ab", "abc", "abcd", "abcde", "é", "😀x", 'q"', "back\\", "\n", "\x01",
               "\x7f", " ", "red", "green", "é\"\n", "fixed", "1"]


def random_value(schema, rng, depth=0):
    """A value shaped by `schema`, with random mistakes: anything at all, missing or extra or
    reordered properties, out-of-bounds lengths, numbers of the wrong kind."""
    if rng.random() < 0.12 or depth > 4:
        return rng.choice([None, True, False, 0, -7, 2.5, 1e20, "s", [], {}, [1], {"a": 1}])
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        value = {k: random_value(s, rng, depth + 1) for k, s in props.items()
                 if k in schema.get("required", []) and rng.random() < 0.95 or rng.random() < 0.5}
        if rng.random() < 0.1:
            value["extra"] = 1
        if rng.random() < 0.15:
            value = dict(reversed(value.items()))
        return value
    if kind == "array":
        return [random_value(schema["items"], rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "string":
        return rng.choice(STRING_POOL)
    return rng.choice({"integer": [0, -1, 42, -9007199254740993, 10 ** 30, 3.0],
                       "number": [0, -0.0, 1.5, -2.25e-7, 1e100, 123456789, -3],
                       "boolean": [True, False, 0], "null": [None, 0, ""]}[kind])


@pytest.mark.parametrize("name", list(KEYWORD_SCHEMAS))
def test_json_schema_keyword_accepts_exactly_valid_values(q7, name):
    """For random values written as compact JSON: the automaton accepts exactly those the
    validator (with the documented policy: declared order, no extra properties) accepts."""
    schema = KEYWORD_SCHEMAS[name]
    dfa = q7.compile_grammar(json_schema=schema)
    rng = random.Random(name)
    verdicts = set()
    for _ in range(400):
        value = random_value(schema, rng)
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        expected = validate(value, schema, strict=True)
        assert dfa.matches(text.encode()) == expected, (text, expected)
        verdicts.add(expected)
    assert verdicts == {True, False}


@pytest.mark.parametrize("schema, accepted, rejected", [
    ({"type": "integer"}, ["0", "-0", "-12", "907"], ["01", "+1", "1.0", "1e3", "-", "", " 1"]),
    ({"type": "number"}, ["0", "-0.0e+10", "1.5E-3", "12e7", "0.25"],
     ["1.", ".5", "1e", "+1", "01.5", "1.5.2", "NaN", "Infinity", "0x1"]),
    ({"type": "string"}, ['""', '"\\u0041\\/\\b\\f\\n\\r\\t\\"\\\\"', '"é😀\x7f"', '"\\uFFFF"'],
     ['"\x01"', '"\n"', '"\\x"', '"\\u12"', '"\\ud800"', '"\\uDFFF"', '"a', "'a'", '"\\"']),
    ({"type": "boolean"}, ["true", "false"], ["True", "1", "tru", "truefalse"]),
    ({"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "null"}}},
     ["{}", '{"a":null}', '{"b":null}', '{"a":null,"b":null}'],
     ['{"b":null,"a":null}', '{,"b":null}', '{"a":null,}', '{"a": null}', '{ }']),
    ({"type": "array", "items": {"type": "integer"}},
     ["[]", "[1]", "[1,2,3,4]"], ["[1,]", "[,1,2]", "[1, 2]", "[1", "[[1]]"]),
])
def test_json_edge_texts(q7, schema, accepted, rejected):
    """Hand-picked texts, including valid JSON the policy refuses (whitespace, surrogate
    escapes) and near-misses of the number and string grammars."""
    dfa = q7.compile_grammar(json_schema=schema)
    for text in accepted:
        json.loads(text)
        assert dfa.matches(text.encode()), text
    for text in rejected:
        assert not dfa.matches(text.encode()), text


@pytest.mark.parametrize("schema, message", [
    ({"type": "integer", "minimum": 0}, "'minimum'"),
    ({"type": "string", "pattern": "a+"}, "'pattern'"),
    ({"type": "string", "format": "date"}, "'format'"),
    ({"$ref": "#/$defs/x"}, "'$ref'"),
    ({"anyOf": [{"type": "null"}]}, "'anyOf'"),
    ({"oneOf": [{"type": "null"}], "allOf": []}, "'allOf', 'oneOf'"),
    ({"type": ["string", "null"]}, "no lists of types"),
    ({"type": "date"}, "'type' 'date'"),
    ({"type": "object"}, "needs 'properties'"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "required": ["b"]}, "'required'"),
    ({"type": "array"}, "needs 'items'"),
    ({"type": "string", "maxLength": 4}, "keyword 'maxLength' is not supported"),
    ({"type": "array", "items": {}, "minItems": 1}, "'minItems' is not supported"),
    ({"type": "string", "items": {}}, "keyword 'items' is not supported with type 'string'"),
    ({"type": "integer", "const": "a"}, "not of type 'integer'"),
    ({"enum": []}, "non-empty"),
    ({"enum": [1], "const": 1}, "combine only with 'type'"),
    ({"description": "no type"}, "needs 'type', 'enum' or 'const'"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "number", "multipleOf": 2}}}}}, "schema.properties.a.properties.b"),
    (True, "must be a JSON object"),
    ("{not json", "not valid JSON"),
])
def test_json_schema_errors_name_the_keyword(q7, schema, message):
    with pytest.raises(q7.GrammarError, match=re.escape(message)):
        q7.compile_grammar(json_schema=schema)


@pytest.mark.parametrize("kwargs, message", [
    ({"choice": []}, "non-empty list"), ({"choice": "yes"}, "non-empty list"),
    ({"choice": ["a", 1]}, "non-empty list"), ({"choice": ["\ud800"]}, "surrogate"),
    ({"regex": 5}, "must be a string"), ({"regex": "a", "choice": ["a"]}, "exclude each other"),
])
def test_constraint_errors(q7, kwargs, message):
    with pytest.raises(q7.GrammarError, match=re.escape(message)):
        q7.compile_grammar(**kwargs)


def json_valid(text, kind):
    """Python's json module as the oracle: whether `text` is one JSON value of schema type
    `kind` (NaN and Infinity refused; a \\u escape of a surrogate refused, as the grammar does)."""
    def refuse(name):
        raise ValueError(name)
    try:
        value = json.loads(text, parse_constant=refuse)
    except ValueError:
        return False
    if isinstance(value, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        return False
    return has_type(value, kind)


BOUNDARY_CHARS = [0x00, 0x08, 0x09, 0x0A, 0x1E, 0x1F, 0x20, 0x21, 0x22, 0x23, 0x2F, 0x30, 0x39,
                  0x3A, 0x40, 0x41, 0x46, 0x47, 0x5B, 0x5C, 0x5D, 0x60, 0x61, 0x66, 0x67, 0x7E,
                  0x7F, 0x80, 0x7FF, 0x800, 0xD7FF, 0xE000, 0xFFFF, 0x10000, 0x10FFFF]


def test_json_character_classes_at_every_boundary(q7):
    """Every boundary of each character class the JSON grammar uses, against Python's json:
    a string's raw characters (controls end at U+001F, then '"' and '\\'), its escapes (the
    letters after a backslash, the hex digits of \\u, surrogates), and numbers' digits, signs,
    point and exponent."""
    texts = {"string": [], "number": [], "integer": []}
    for c in BOUNDARY_CHARS:
        texts["string"].append('"' + chr(c) + '"')
        if c < 0x80:
            texts["string"].append('"\\' + chr(c) + '"')
            for at in range(4):
                texts["string"].append('"\\u' + "0041"[:at] + chr(c) + "0041"[at + 1:] + '"')
    for prefix in ("d7ff", "d800", "dbff", "dc00", "dfff", "e000", "D800", "DFFF"):
        texts["string"].append('"\\u' + prefix + '"')
    for c in "+-./0189:eE":
        for text in (c, "1" + c, c + "1", "1" + c + "1", "0" + c, "-" + c, "1.5" + c + "2",
                     "1e" + c + "2", "1E" + c):
            texts["number"].append(text)
            texts["integer"].append(text)
    for kind, candidates in texts.items():
        dfa = q7.compile_grammar(json_schema={"type": kind})
        for text in candidates:
            data = text.encode("utf-8", "surrogatepass")
            assert dfa.matches(data) == json_valid(text, kind), (kind, text)


def test_choice_accepts_exactly_its_strings(q7):
    choices = ["yes", "no", "né", "", "yes!", "😀"]
    dfa = q7.compile_grammar(choice=choices)
    rng = random.Random(0)
    texts = choices + ["ye", "yes!!", "n", "nó", "noo", " yes"] + \
        ["".join(rng.choice("yesnoé!😀") for _ in range(rng.randint(0, 4))) for _ in range(300)]
    for text in texts:
        assert dfa.matches(text.encode()) == (text in choices), text


# -- token masks, the trie walk and the engine-facing API --------------------------------------

MASK_CONSTRAINTS = [{"regex": r"(ab|cd)*[xyz]{1,3}"}, {"regex": r"[^\x00-\x1f]{2,5}é"},
                    {"regex": r"\d+(\.\d+)?"}, {"choice": ["yes", "no", "maybe", "né", "😀"]},
                    {"json_schema": KEYWORD_SCHEMAS["nested"]},
                    {"json_schema": KEYWORD_SCHEMAS["string"]}]


@pytest.mark.parametrize("constraint", MASK_CONSTRAINTS, ids=str)
def test_masks_equal_a_per_token_walk_in_every_state(grammar_cache, constraint):
    masker = grammar_cache.get(**constraint)
    for state in range(masker.dfa.num_states):
        mask = masker.mask(state)
        assert mask.dtype == torch.bool and mask.shape == (len(VOCAB),)
        expected = brute_force_mask(masker.dfa, VOCAB, EOS, state)
        assert np.array_equal(mask.numpy(), expected), state
        assert mask.any(), "a live state allows no token"
        assert masker.mask(state) is mask  # cached


def test_masks_on_a_deeper_vocabulary(q7):
    """5,000 random tokens of 1..24 bytes from a small alphabet: deep, bushy trie levels."""
    rng = random.Random(3)
    vocab = [bytes([b]) for b in range(256)] + list(dict.fromkeys(
        bytes(rng.choice(b'ab"{}:,0123456789\\') for _ in range(rng.randint(2, 24)))
        for _ in range(5000)))
    trie = q7.TokenTrie(vocab)
    dfa = q7.compile_grammar(json_schema={"type": "object", "properties": {
        "a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}}})
    masker = q7.TokenMasker(dfa, trie, eos_ids=[])
    for state in range(dfa.num_states):
        expected = brute_force_mask(dfa, vocab, [], state)
        assert np.array_equal(masker.mask(state).numpy(), expected), state


def test_advance_finish_and_eos(q7, grammar_cache):
    masker = grammar_cache.get(choice=["ab", "abc"])
    assert masker.next_state(masker.start, EOS[0]) == q7.DEAD  # eos before a full match
    after_ab = masker.next_state(masker.start, VOCAB.index(b"ab"))
    assert masker.is_accepting(after_ab) and not masker.is_complete(after_ab)
    assert masker.mask(after_ab)[EOS].all()          # "ab" may end here or go on with "c"
    assert masker.next_state(after_ab, EOS[1]) == after_ab
    done = masker.next_state(masker.start, VOCAB.index(b"abc"))
    assert masker.is_complete(done)
    assert masker.mask(done).nonzero().flatten().tolist() == EOS  # only eos is left
    assert masker.next_state(done, VOCAB.index(b"a")) == q7.DEAD
    assert masker.next_state(masker.start, VOCAB.index(b"x")) == q7.DEAD
    assert masker.next_state(masker.start, len(VOCAB) - 4) == q7.DEAD  # an id with no bytes
    assert not masker.is_accepting(q7.DEAD) and not masker.is_complete(q7.DEAD)
    with pytest.raises(ValueError):
        masker.mask(q7.DEAD)


def test_utf8_split_tokens_and_aliases(q7, grammar_cache):
    """A token holding half a character moves to a state inside the character; a duplicate
    token (two ids, the same bytes) gets the same mask bit as its twin."""
    masker = grammar_cache.get(choice=["né"])
    n = masker.next_state(masker.start, VOCAB.index(b"n"))
    half = masker.next_state(n, VOCAB.index("é".encode()[:1]))
    assert half != q7.DEAD and not masker.is_accepting(half)
    assert masker.is_complete(masker.next_state(half, VOCAB.index("é".encode()[1:])))
    allowed = grammar_cache.get(regex="name|x").mask(0)
    twin_ids = [i for i, v in enumerate(VOCAB) if v == b"name"]
    assert len(twin_ids) == 2 and allowed[twin_ids].all()


def test_vocabulary_must_hold_every_byte(q7):
    with pytest.raises(q7.GrammarError, match="single-byte tokens"):
        q7.TokenTrie([bytes([b]) for b in range(255)] + [b"ab"])


def test_grammar_cache_shares_maskers(grammar_cache):
    schema = {"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "null"}}}
    first = grammar_cache.get(json_schema=schema)
    assert grammar_cache.get(json_schema=json.dumps(schema)) is first  # a dict or its JSON text
    swapped = {"type": "object", "properties": {"b": {"type": "null"}, "a": {"type": "null"}}}
    assert grammar_cache.get(json_schema=swapped) is not first  # the order is the output's
    assert grammar_cache.get() is None


def test_apply_token_masks_against_a_loop(q7):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, generator=gen)
    masks = [torch.rand(10, generator=gen) > 0.5, None, torch.rand(10, generator=gen) > 0.5]
    expected = logits.clone()
    for row, mask in enumerate(masks):
        if mask is not None:
            expected[row][~mask] = float("-inf")
    assert torch.equal(q7.apply_token_masks(logits, masks), expected)
    unchanged = logits.clone()
    assert torch.equal(q7.apply_token_masks(logits, [None] * 3), unchanged)


# -- always valid: random logits, masked, must give output that matches and ends by itself -----

GENERATION_SCHEMAS = [
    KEYWORD_SCHEMAS["nested"],
    {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "score": {"type": "number"}, "role": {"enum": ["admin", "user", None, 7]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "fixed": {"const": {"k": [1, "é"]}}, "ok": {"type": "boolean"}},
     "required": ["name", "role", "fixed"]},
    {"type": "array", "items": {"type": "number"}},
]


@pytest.mark.parametrize("schema", GENERATION_SCHEMAS, ids=range(len(GENERATION_SCHEMAS)))
def test_generation_always_valid_json(q7, grammar_cache, schema):
    masker, gen = grammar_cache.get(json_schema=schema), torch.Generator().manual_seed(0)
    for _ in range(12):
        out, _ = generate_with_random_logits(q7, masker, gen)
        assert validate(json.loads(out.decode("utf-8")), schema), out


@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"(ab|cd)*e?[xyz]{1,3}",
                                     r"[^\x00-\x1f]{2,5}é", r"-?(0|[1-9]\d*)(\.\d+)?",
                                     r"(yes|no|n\w+)!?"])
def test_generation_always_matches_regex(q7, grammar_cache, pattern):
    masker, gen = grammar_cache.get(regex=pattern), torch.Generator().manual_seed(1)
    for _ in range(15):
        out, _ = generate_with_random_logits(q7, masker, gen)
        assert re.fullmatch(pattern, out.decode("utf-8"), re.ASCII), out


def test_generation_choice_stops_when_nothing_may_follow(q7, grammar_cache):
    choices = ["yes", "no", "maybe", "né", "😀"]
    masker, gen = grammar_cache.get(choice=choices), torch.Generator().manual_seed(2)
    endings = set()
    for _ in range(30):
        out, ending = generate_with_random_logits(q7, masker, gen)
        assert out.decode("utf-8") in choices
        endings.add(ending)
    assert endings == {"finished"}  # no choice is a prefix of another: no eos is ever needed


def test_bench_runs_and_cached_masks_are_faster(q7, capsys):
    base = [v for v in VOCAB[256:] if v]
    compile_s, first_s, hit_s = q7.bench_structured(base, schema=KEYWORD_SCHEMAS["nested"],
                                                   size=3000, n_regular=2900, n_lookups=2000)
    printed = capsys.readouterr().out
    assert all(line in printed for line in ("compile schema", "first computation", "seen before"))
    assert 0 < hit_s < first_s and compile_s > 0

# ----------------------------------------------------------------- structured output in the engine

@pytest.fixture(scope="module")
def qwen_dir(q7, qwen_hf, tmp_path_factory):
    """A tiny random Qwen3 with the Qwen-like tokenizer, Qwen3's chat template and eos ids, in one
    Hugging Face directory. Its 1,280 rows exceed the tokenizer's 1,213 ids, as Qwen3's 151,936
    exceed its 151,669: random weights emit the ids past the tokenizer's all the time."""
    torch.manual_seed(0)
    model = q7.Qwen3(q7.Qwen3Config(
        vocab_size=1280, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=False))
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.5)  # logits of a few units
    folder = q7.save_qwen3(model, tmp_path_factory.mktemp("qwen_dir"))
    eos = [qwen_hf.token_to_id("<|im_end|>"), qwen_hf.token_to_id("<|endoftext|>")]
    return save_tokenizer(qwen_hf, folder, {"eos_token": "<|im_end|>",
                                            "chat_template": QWEN3_CHAT_TEMPLATE},
                          generation_config={"eos_token_id": eos})


@pytest.fixture(scope="module")
def chat_llm(q7, qwen_dir):
    return q7.LLM(qwen_dir, device="cpu", max_model_len=256)


def test_llm_reads_the_tokenizer_with_the_weights(q7, chat_llm, qwen_hf, chat_pair):
    """LLM(directory) loads its tokenizer: text prompts, the chat format's ids, eos ids from the
    tokenizer's files, and text that leaves out special tokens, as tokenizers' decode does."""
    eos = {qwen_hf.token_to_id("<|im_end|>"), qwen_hf.token_to_id("<|endoftext|>")}
    assert chat_llm.engine.eos_token_ids == eos
    messages = [SYSTEM, user("Hi")]
    prompt = chat_llm.tokenizer.apply_chat_template(messages)
    out = chat_llm.generate(prompt, q7.SamplingParams(max_tokens=30, seed=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == chat_pair[0].apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False)
    assert max(out.outputs[0].token_ids) >= qwen_hf.get_vocab_size()  # ids past the tokenizer: no text
    assert out.outputs[0].text == qwen_hf.decode(out.outputs[0].token_ids, skip_special_tokens=True)


STRUCTURED = [("regex", r"\d{3}-\d{4}"), ("regex", r"(ab|cd)*e?[xyz]{1,3}"),
              ("regex", r"[^\x00-\x1f]{2,5}é"), ("choice", ["yes", "no", "maybe", "né", "😀"]),
              ("json_schema", KEYWORD_SCHEMAS["nested"]), ("json_schema", GENERATION_SCHEMAS[2]),
              ("json_schema", {"type": "object", "required": ["name", "tags"], "properties": {
                  "name": {"type": "string", "enum": ["Ada", "é\"😀"]}, "ok": {"type": "boolean"},
                  "tags": {"type": "array", "items": {"enum": ["a", "é", None]}}}})]


def is_valid(kind, spec, text):
    """By Python's re and json and the validator above, which know nothing of the automaton."""
    if kind == "regex":
        return re.fullmatch(spec, text, re.ASCII) is not None
    if kind == "choice":
        return text in spec
    try:
        return validate(json.loads(text), spec, strict=True)
    except ValueError:
        return False


def test_structured_generation_is_always_valid(q7, chat_llm, qwen_hf):
    """Through the whole engine, random weights sampled at temperature 1: each constraint with
    four seeds (one of them with ignore_eos), batched with free rows. Every text is valid, every
    constrained request stops by itself ("stop": its automaton finished, or eos where the text
    was complete), and the text is tokenizers' decode of the ids before the eos."""
    P = q7.SamplingParams
    cases = [(kind, spec, seed) for kind, spec in STRUCTURED for seed in range(4)]
    params = [P(seed=seed, max_tokens=120, ignore_eos=seed == 3, **{kind: spec})
              for kind, spec, seed in cases] + [P(seed=1, max_tokens=12)] * 2
    outputs = chat_llm.generate(["The answer:"] * len(params), params)
    assert chat_llm.engine.grammars.trie.V == 1280  # masks as wide as the model's rows
    eos, ended_by_eos = chat_llm.engine.eos_token_ids, 0
    for (kind, spec, seed), out in zip(cases, outputs):
        assert out.outputs[0].finish_reason == "stop" and is_valid(kind, spec, out.outputs[0].text), (kind, spec, out)
        ids = out.outputs[0].token_ids[:-1] if out.outputs[0].token_ids[-1] in eos else out.outputs[0].token_ids
        ended_by_eos += len(ids) < len(out.outputs[0].token_ids)
        assert out.outputs[0].text == qwen_hf.decode(ids, skip_special_tokens=True)
        assert not set(ids) & (eos | {qwen_hf.token_to_id(t) for t in QWEN_SPECIAL})
    assert 0 < ended_by_eos < len(cases)
    assert [out.outputs[0].finish_reason for out in outputs[-2:]] == ["length"] * 2  # the free rows


def test_a_constraint_with_nothing_to_generate_is_an_error(q7, chat_llm, monkeypatch):
    monkeypatch.setattr(chat_llm.engine.runner, "launch", lambda *a: pytest.fail("the engine ran"))
    with pytest.raises(ValueError, match="allows only the empty text: there is nothing to"):
        chat_llm.generate(["x", "y"], [q7.SamplingParams(), q7.SamplingParams(choice=[""])])


# ------------------------------------------------------------------------------ bad inputs

@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, "must be a positive int"), ("max_tokens", 2.0, "must be a positive int"),
    ("temperature", -0.1, "must be a finite number >= 0"), ("temperature", float("inf"), ">= 0"),
    ("temperature", "1", ">= 0"), ("top_k", -1, "must be an int >= 0"), ("top_k", 1.5, "int >= 0"),
    ("top_p", 0.0, r"must be in \(0, 1\]"), ("top_p", 1.01, r"\(0, 1\]"),
    ("min_p", -0.01, r"must be in \[0, 1\]"), ("min_p", 1.5, r"\[0, 1\]"),
    ("repetition_penalty", 0.0, "must be a finite number > 0"),
    ("presence_penalty", 2.5, r"must be in \[-2, 2\]"), ("frequency_penalty", -3, r"\[-2, 2\]"),
    ("seed", -1, r"must be an int in \[0, 2\*\*64\) or None"), ("seed", True, "an int"),
    ("stop_token_ids", "12", "must be a list of token ids"), ("stop_token_ids", [1, -2], "token ids"),
    ("ignore_eos", 1, "must be True or False"), ("logprobs", -1, "must be None or an int >= 0"),
    ("regex", 3, "regex must be a string"), ("choice", [], "must be a non-empty list of strings"),
    ("choice", ["a", 1], "list of strings"), ("json_schema", [1], "must be a JSON object"),
    ("json_schema", "{not json", "is not valid JSON"), ("json_schema", "[1]", "a JSON object"),
    ("regex", "^a", "'\\^a' is not supported"), ("regex", "(a", "missing '\\)'"),
    ("json_schema", {"type": "integer", "minimum": 0}, "keyword 'minimum' is not supported"),
    ("choice", ["\ud800"], "lone surrogate"),
])
def test_bad_sampling_params_name_the_field(q7, field, value, message):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} = .*: .*{message}"):
        q7.SamplingParams(**{field: value})


def test_sampling_params_normalize_and_exclude(q7):
    p = q7.SamplingParams(stop_token_ids=[3, 4], choice=["yes", "no"])
    assert p.stop_token_ids == (3, 4) and p.choice == ("yes", "no")
    with pytest.raises(ValueError, match="regex and choice exclude each other"):
        q7.SamplingParams(regex="a+", choice=["a"])
    with pytest.raises(AttributeError):
        p.temperature = -1.0  # frozen: a checked value stays checked


def bad_generate_calls(q7):
    P = q7.SamplingParams
    return [  # (prompts, sampling_params, error, message)
        (list(range(41)), None, ValueError, "prompt 0 is 41 tokens, longer than max_model_len 40"),
        ([[1, 2], list(range(40))], None, ValueError, "prompt 1 is 40 tokens, all of max_model_len 40"),
        ([[1], list(range(30))], P(max_tokens=11), ValueError,
         "prompt 1: 30 prompt tokens \\+ max_tokens 11 = 41, beyond max_model_len 40"),
        ([], None, ValueError, "non-empty list"),
        ([[1], []], None, ValueError, "prompt 1 is empty"),
        ([[1, 131]], None, ValueError, r"prompt 0 holds token id 131, outside the model's vocabulary \[0, 131\)"),
        ([[-1]], None, ValueError, "token id -1"),
        (["hello"], None, ValueError, "prompt 0 is text, but this LLM has no tokenizer"),
        ([[1], [2.5]], None, ValueError, "prompt 1 must be a string or a list of token ids"),
        ([[1], [2], [3]], [P(), P()], ValueError, "2 SamplingParams for 3 prompts"),
        ([[1]], {"temperature": 0}, TypeError, "sampling_params must be a SamplingParams"),
        ([[1]], P(stop_token_ids=[131]), ValueError, "stop_token_ids of prompt 0 holds 131"),
        ([[1]], P(logprobs=132), ValueError, "asks for 132 top logprobs, more than the vocabulary's 131"),
        ([[1], [2]], [P(), P(regex="[ab]+")], ValueError,
         "prompt 1 asks for structured output, which needs a tokenizer"),
    ]


def test_bad_generate_calls_fail_before_any_work(q7, llm, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the engine ran before the bad input was reported")

    monkeypatch.setattr(llm.engine.runner, "launch", no_work)
    for prompts, params, error, message in bad_generate_calls(q7):
        with pytest.raises(error, match=message):
            llm.generate(prompts, params)


def test_bad_llm_arguments(q7, hf_dir):
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    with pytest.raises(ValueError, match="max_model_len = 65: must be an int from 2 to the model's "
                                         "max_position_embeddings, 64"):
        q7.LLM(model, max_model_len=65)
    with pytest.raises(ValueError, match="max_num_seqs = 0: must be a positive int"):
        q7.LLM(model, max_num_seqs=0)
    with pytest.raises(ValueError, match="a built Qwen3 is used as it is"):
        q7.LLM(model, device="cpu")
    with pytest.raises(TypeError, match="model must be a directory, a Hub id or a Qwen3"):
        q7.LLM(3)
    with pytest.raises(TypeError, match="tokenizer must be a Tokenizer \\(see load_tokenizer\\), not T"):
        q7.LLM(model, tokenizer=type("T", (), {"encode": None})())
    with pytest.raises(ValueError, match="dtype torch.int8 is not supported"):
        q7.LLM(hf_dir[1], device="cpu", dtype=torch.int8)
    with pytest.raises(ValueError, match="device meta: this stage runs on cpu or cuda"):
        q7.LLM(hf_dir[1], device="meta")
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="device cuda: this machine has no CUDA GPU"):
            q7.LLM(hf_dir[1], device="cuda")
    with pytest.raises(ValueError, match="enforce_eager = 1: must be True or False"):
        q7.LLM(model, enforce_eager=1)
    with pytest.raises(ValueError, match="async_scheduling = 'yes': must be True or False"):
        q7.LLM(model, async_scheduling="yes")


# ----------------------------------------------------------------------------------- main()

def run_main(q7, capsys, *argv):
    q7.main(list(argv))
    return capsys.readouterr().out


def test_main_on_a_tiny_random_model(q7, capsys):
    out = run_main(q7, capsys, "--device", "cpu", "--max-tokens", "5", "--batch-size", "3")
    assert "V=8,256" in out and "tokenizer: GPT-2's first tokens and Qwen3's chat tokens, 8,197 " \
                                "ids, eos ids [8192, 8194], chat template: yes" in out
    diff = re.search(r"vs full recomputation: greedy tokens identical, logprobs max abs diff (\S+)", out)
    assert diff and float(diff[1]) < 1e-4, out
    if HAS_CUDA:  # --device cpu without the interpreter: the kernels cannot run there
        assert "(Triton kernels not checked: that needs a GPU" in out
    else:
        err = re.search(r"Triton kernels \(Triton's interpreter\) vs the torch path: rel err (\S+) "
                        r".*paged kernels vs its torch twin: (\S+)", out)
        assert err and float(err[1]) < 1e-5 and float(err[2]) < 1e-5, out
    assert "greedy, 3 prompts in one batch (identical to one by one)" in out
    assert "the first drawn alone: identical" in out
    lines = re.findall(r"^  ('Every effort moves you'|.*) -> .* \(length, 5 tokens\)$", out, re.MULTILINE)
    assert len(lines) == 6 and lines.count("'Every effort moves you'") == 2, out
    structured = re.findall(r"^  (choice|regex|json_schema) .*\n    -> .* \(stop, \d+ tokens; valid\)$",
                            out, re.MULTILINE)
    assert structured == ["choice", "regex", "json_schema"], out
    steps = re.findall(r"^  step +\d+: ((?:[A-F]\d+ )+) +waiting (\d)(?:, (\d) preempted)?$", out,
                       re.MULTILINE)
    assert len(steps) > 6 and all(sum(int(n) for n in re.findall(r"\d+", ran)) <= 24 and
                                  len(ran.split()) <= 4 for ran, _, _ in steps), out
    assert sum(int(n or 0) for _, _, n in steps) >= 1, out  # the small pool preempts
    assert "their greedy outputs: identical to each request alone; every block free at the end: " \
           "True" in out
    speed = re.search(r"engine on cpu: ([\d,]+) tokens/s \(3 sequences x 5 tokens", out)
    assert speed and int(speed[1].replace(",", "")) > 0, out


def test_main_with_a_model_directory(q7, qwen_dir, qwen_hf, capsys):
    out = run_main(q7, capsys, "--model", str(qwen_dir), "--device", "cpu", "--max-tokens", "3",
                   "--batch-size", "2", "--top-k", "5", "--chat", "--prompt", "Hi there")
    assert f"Qwen3 from {qwen_dir}: 2 layers, C=64, 4/2 heads of 32, V=1,280" in out
    eos = sorted(qwen_hf.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>"))
    assert f"tokenizer: {qwen_hf.get_vocab_size():,} ids, eos ids {eos}, chat template: yes" in out
    diff = re.search(r"greedy tokens identical, logprobs max abs diff (\S+)", out)
    assert diff and float(diff[1]) < 1e-4, out
    assert "(Triton kernels not checked: that needs a GPU, or on a CPU Triton's interpreter and " \
           "the built-in tiny model)" in out
    assert "top-k 5" in out
    chat = r"^  '<\|im_start\|>user\\nHi there<\|im_end\|>\\n<\|im_start\|>assistant\\n' -> "
    assert len(re.findall(chat, out, re.MULTILINE)) == 2, out  # greedy and sampled
    assert len(re.findall(r"^    -> .* tokens; valid\)$", out, re.MULTILINE)) == 3, out


def test_main_needs_a_tokenizer_and_a_chat_template_for_chat(q7, hf_dir, qwen_dir, tmp_path):
    with pytest.raises(q7.DataError, match="has no tokenizer.json: this demo writes text prompts"):
        q7.main(["--model", str(hf_dir[1]), "--device", "cpu"])
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_bytes((qwen_dir / name).read_bytes())
    with pytest.raises(q7.DataError, match="--chat: this is a base model"):
        q7.main(["--model", str(tmp_path), "--device", "cpu", "--chat"])


def test_main_offline_names_gpt2s_ranks(q7, tmp_path, monkeypatch):
    """The random model's tokenizer is written from data/gpt2.tiktoken: offline, without that
    file, main stops before any work, naming the file, its URL and where to place it."""
    def no_network(*args, **kwargs):
        raise requests.ConnectionError("no route to host")

    monkeypatch.setattr(q7.requests, "get", no_network)
    for name in ("LLM", "random_checkpoint"):
        monkeypatch.setattr(q7, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran"))
    with pytest.raises(q7.DataError) as err:
        q7.main(["--device", "cpu", "--data-dir", str(tmp_path / "cache")])
    message = str(err.value)
    assert message.startswith("1 file(s) this run needs cannot be had")
    assert str(tmp_path / "cache" / "gpt2.tiktoken") in message and "r50k_base.tiktoken" in message
    assert list(tmp_path.iterdir()) == []  # no empty cache folder left behind


def test_main_bench(q7, monkeypatch, capsys):
    """--bench runs bench_structured on GPT-2's tokens (here on a small vocabulary: the full
    151,936 tokens take seconds) and nothing else."""
    monkeypatch.setattr(q7, "bench_structured", functools.partial(
        q7.bench_structured, size=3000, n_regular=2900, n_lookups=2000))
    monkeypatch.setattr(q7, "LLM", lambda *a, **k: pytest.fail("--bench loaded a model"))
    out = run_main(q7, capsys, "--bench")
    assert "structured output, 3,000-token vocabulary" in out
    assert all(line in out for line in ("compile schema", "first computation", "seen before"))


BAD_FLAGS = [
    (["--model", "FILE"], "is a file; give the directory"),
    (["--model", "/no/such/dir"], "no such directory, and not a Hub id"),
    (["--device", "tpu9"], "--device tpu9"),
    (["--device", "meta"], "this stage runs on cpu or cuda"),
    (["--data-dir", "FILE"], "is a file, not a directory"),
    (["--dtype", "int8"], "invalid choice"),
    (["--max-tokens", "0"], "must be a positive integer"),
    (["--batch-size", "-2"], "must be a positive integer"),
    (["--temperature", "-1"], "must be a number >= 0"),
    (["--top-k", "-1"], "must be an integer >= 0"),
    (["--top-p", "0"], r"must be in \(0, 1\]"),
    (["--min-p", "1.5"], r"must be in \[0, 1\]"),
    (["--seed", "-3"], "must be an integer >= 0"),
    (["--prompt", " "], "--prompt is empty"),
    (["--bench", "--model", "/no/such/dir"], "--model does not apply to --bench"),
    (["--model", ""], "--model is empty"),
    (["--model", " "], "--model is empty"),
    (["--max-tokens", "100000"], "--max-tokens 100000: the model's context is 256 positions"),
    (["--device", "tpu"], r"--device tpu: this stage runs on cpu or cuda \(cuda:N"),
    (["--device", "cuda:x"], "--device cuda:x: not a device"),
    (["--data-dir", "/dev/null/cache"], "--data-dir /dev/null/cache: cannot be made"),
]


@pytest.mark.parametrize("argv, message", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_a_bad_flag_stops_main_before_any_work(q7, monkeypatch, capsys, tmp_path, argv, message):
    never = ("LLM", "random_checkpoint", "download_model", "bench_structured", "fetch")
    check_bad_flag(q7, argv, message, never, monkeypatch, capsys, tmp_path)


def test_max_tokens_is_checked_against_a_models_context_before_its_weights(q7, hf_dir,
                                                                           monkeypatch, capsys):
    monkeypatch.setattr(q7, "load_qwen3", lambda *a, **k: pytest.fail("the weights loaded"))
    with pytest.raises(SystemExit):
        q7.main(["--model", str(hf_dir[1]), "--device", "cpu", "--max-tokens", "64"])
    assert "--max-tokens 64: the model's context is 64 positions" in capsys.readouterr().err


def test_help_describes_the_stage_in_whole_sentences(q7, capsys):
    with pytest.raises(SystemExit):
        q7.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    first = " ".join(q7.__doc__.split("\n\n")[0].split())
    assert first in help_text and first.endswith(".")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_main_asks_for_cuda_without_a_gpu(q7, capsys):
    with pytest.raises(SystemExit):
        q7.main(["--device", "cuda"])
    assert "this machine has no CUDA GPU" in capsys.readouterr().err


def test_the_script_reports_a_bad_model_in_one_line(tmp_path):
    """Run as a script, a DataError is one line on stderr and exit status 1, not a traceback."""
    (tmp_path / "config.json").write_text('{"vocab_size": ')
    result = subprocess.run([sys.executable, str(ROOT / "07_engine.py"), "--model", str(tmp_path),
                             "--device", "cpu"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {tmp_path / 'config.json'}: not a readable JSON config")


# --------------------------------------- the engine: continuous batching, paged cache, speculation

def hf_greedy_all(hf, prompts, max_tokens):
    """transformers' greedy continuation of each prompt alone: the reference of every engine test
    below (the engine's batching, chunking, caching, preemption and speculation must not show)."""
    return [hf_greedy(hf, prompt, m) for prompt, m in zip(prompts, max_tokens)]


def mixed_requests(n, seed, vocab=131, shared=12, max_len=40):
    """n prompts of mixed lengths (1 to 24 tokens), half of them starting with one shared
    12-token prefix, and max_tokens that keep each within max_len."""
    rng = random.Random(seed)
    common = [rng.randrange(vocab) for _ in range(shared)]
    prompts, max_tokens = [], []
    for i in range(n):
        length = rng.randint(1, 24)
        head = common[:min(length, shared)] if i % 2 else []
        prompts.append(head + [rng.randrange(vocab) for _ in range(length - len(head))])
        max_tokens.append(rng.randint(1, max_len - length))
    return prompts, max_tokens


def assert_all_free(engine):
    """Nothing left: no request, every block back in the pool with no reference."""
    assert not engine.has_unfinished() and engine.num_unfinished == 0
    blocks = engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(count == 0 for count in blocks.ref_counts)
    engine.check()


ENGINE_SETTINGS = {  # name -> LLM keywords: each forces another path of the scheduler
    "roomy": dict(),
    "plain loop": dict(async_scheduling=False),
    "chunked prefill": dict(max_num_batched_tokens=7, max_num_seqs=5),
    "preemption": dict(num_kv_blocks=14, block_size=4, max_num_seqs=6),
    "everything at once": dict(num_kv_blocks=12, block_size=4, max_num_batched_tokens=9,
                               max_num_seqs=4),
    "no prefix caching": dict(num_kv_blocks=14, block_size=4, enable_prefix_caching=False),
    "n-gram speculation": dict(speculative={"method": "ngram", "num_tokens": 3, "min_accepted": 0}),
    "n-gram under pressure": dict(speculative={"method": "ngram", "num_tokens": 3, "max_n": 2,
                                               "min_accepted": 0},
                                  num_kv_blocks=14, block_size=4, max_num_batched_tokens=9),
}


PUBLIC_NAMES = {  # part -> its public methods, properties and dataclass fields
    "Qwen3Config": (
        "from_json head_dim hidden_size intermediate_size max_position_embeddings "
        "num_attention_heads num_hidden_layers num_key_value_heads rms_norm_eps rope_theta "
        "tie_word_embeddings tiny to_hf vocab_size"),
    "Qwen3": "forward hidden_states logits num_params output_weight use_kernels",
    "Tokenizer": "apply_chat_template decode decode_bytes encode",
    "KVCache": "length read rows write",
    "DecodeGraphs": "",
    "Sequence": (
        "append is_finished num_output_tokens num_tokens output_token_ids prompt_token_ids "
        "settle_drafts step_tokens"),
    "CompletionOutput": "finish_reason index logprobs text token_ids",
    "RequestOutput": "finished outputs prompt_token_ids request_id",
    "BlockManager": (
        "allocate_prefix blocks_needed cache_full_blocks free grow num_free_blocks "
        "prefix_hit_rate reset_prefix_cache reset_stats verify"),
    "Scheduler": "enqueue finish has_work preempt register_computed schedule update",
    "StepHandle": "wait",
    "ModelRunner": "launch logprobs_lists run sampling_batch warm_up",
    "SamplingParams": (
        "choice frequency_penalty has_penalties ignore_eos json_schema logprobs max_tokens "
        "min_p n presence_penalty regex repetition_penalty seed stop stop_token_ids temperature "
        "top_k top_p"),
    "SamplingBatch": "record record_row",
    "Sampler": "probs",
    "LLMEngine": (
        "abort add_request add_sequence check completion has_unfinished new_sequence "
        "num_unfinished output overlapped_step plain_step reset stats step step_sequences"),
    "EngineConfig": (
        "async_scheduling block_size debug enable_prefix_caching enforce_eager "
        "gpu_memory_utilization max_model_len max_num_batched_tokens max_num_seqs num_kv_blocks "
        "speculative"),
    "LLM": "generate",
    "Speculator": "after_step draft_next_step needs_tokens speculating",
    "TokenMasker": "is_accepting is_complete mask next_state",
    "GrammarCache": "get",
}


@pytest.mark.parametrize("part", list(PUBLIC_NAMES))
def test_each_part_keeps_its_public_names(q7, part):
    """The names a reader, stage 08 and the tests use, part by part (ENGINE.md's parts and the
    engine's): a rename is deliberate when this list changes with it."""
    assert public_names(getattr(q7, part)) == set(PUBLIC_NAMES[part].split())


@pytest.mark.parametrize("setting", ENGINE_SETTINGS)
@torch.no_grad()
def test_engine_outputs_equal_one_request_at_a_time(q7, hf_dir, setting):
    """16 greedy requests of mixed lengths, half with a shared prefix, through the engine under
    each setting: every output equals transformers' greedy continuation of its prompt alone;
    the debug checks hold after every step, and at the end every block is free. The settings
    force chunked prefills, preemption (a pool of 14 blocks of 4 tokens for 16 sequences of up
    to 40), prefix hits and speculation."""
    hf, folder = hf_dir
    prompts, max_tokens = mixed_requests(16, seed=5)
    llm = q7.LLM(folder, device="cpu", max_model_len=40, debug=True, **ENGINE_SETTINGS[setting])
    params = [q7.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_all(hf, prompts, max_tokens)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    stats = llm.engine.stats
    if "preemption" in setting or setting == "everything at once":
        assert stats["preemptions"] > 0
    if "speculation" in setting:
        assert stats["draft_tokens"] > 0
    if setting == "no prefix caching":
        assert stats["prefix_hit_rate"] == 0
    elif setting == "preemption":  # a preempted sequence finds its own blocks again
        assert stats["prefix_hit_rate"] > 0
    assert_all_free(llm.engine)


def test_the_scheduler_keeps_its_budgets(q7, hf_dir):
    """Every step's tokens within max_num_batched_tokens and its sequences within max_num_seqs;
    a sequence that is decoding runs in every step (a long prompt never starves it: its chunks
    take what the decodes leave), and long prompts are cut into chunks."""
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    llm = q7.LLM(model, max_model_len=40, max_num_batched_tokens=6, max_num_seqs=3, debug=True,
                 async_scheduling=False)
    engine = llm.engine
    prompts, max_tokens = mixed_requests(8, seed=6)
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(i, prompt, q7.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    chunks = 0
    while engine.has_unfinished():
        decoding = {s for s in engine.scheduler.running if s.num_computed_tokens >= s.num_prompt_tokens}
        engine.step()
        batch = engine.last_batch
        assert sum(n for _, n in batch) <= 6 and len(batch) <= 3
        assert decoding <= {seq for seq, _ in batch}
        chunks += sum(1 for seq, n in batch if seq.num_computed_tokens < seq.num_prompt_tokens)
    assert chunks > 0
    assert_all_free(engine)


def test_preempted_sequences_resume_with_the_same_sample(q7, hf_dir):
    """Seeded sampling under preemption and chunking: each request's tokens equal those it draws
    alone in a roomy engine (its own random stream, whatever the batch or the recomputation)."""
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    prompts, max_tokens = mixed_requests(10, seed=7)
    params = [q7.SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=m, ignore_eos=True)
              for i, m in enumerate(max_tokens)]
    tight = q7.LLM(model, max_model_len=40, num_kv_blocks=12, block_size=4,
                   max_num_batched_tokens=8, debug=True)
    outputs = tight.generate(prompts, params)
    assert tight.engine.stats["preemptions"] > 0
    roomy = q7.LLM(model, max_model_len=40)
    for prompt, p, out in zip(prompts, params, outputs):
        assert roomy.generate([prompt], p)[0].outputs[0].token_ids == out.outputs[0].token_ids
    assert_all_free(tight.engine)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_abort_anywhere_frees_everything(q7, hf_dir, async_scheduling):
    """Abort a waiting request, one in the middle of its chunked prefill and one decoding: the
    next step reports each once, with finish_reason "abort" and its tokens so far, and nothing
    after; the others finish as they would alone, and afterwards every block is free."""
    hf, folder = hf_dir
    model = q7.load_qwen3(folder, device="cpu")
    llm = q7.LLM(model, max_model_len=40, max_num_batched_tokens=8, max_num_seqs=2, debug=True,
                 async_scheduling=async_scheduling)
    engine = llm.engine
    prompts = [random_ids(5, seed=20), random_ids(20, seed=21), random_ids(6, seed=22),
               random_ids(4, seed=23)]
    greedy = q7.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for name, prompt in zip("abcd", prompts):
        engine.add_request(name, prompt, greedy)
    engine.step()  # a prefilled (5 tokens), b started (3 of 20)
    seqs = {seq.request_id: seq for seq in engine.scheduler.running + list(engine.scheduler.waiting)}
    assert 0 < seqs["b"].num_computed_tokens < 20 and seqs["c"].status.value == "waiting"
    engine.abort("b")  # prefilling
    engine.abort("c")  # waiting
    outputs = {}
    first = engine.step()
    assert {(o.request_id, o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in first
            if o.request_id in "bc"} == {("b", "abort", 0), ("c", "abort", 0)}
    for out in first:
        outputs.setdefault(out.request_id, []).append(out)
    for _ in range(2):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    a_before = len(outputs["a"])
    engine.abort("a")  # decoding
    engine.abort("zz")  # unknown: ignored
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert len(outputs["b"]) == len(outputs["c"]) == 1  # reported once, nothing after
    assert len(outputs["a"]) == a_before + 1 and outputs["a"][-1].outputs[0].finish_reason == "abort"
    assert outputs["a"][-1].outputs[0].token_ids == seqs["a"].output_token_ids
    assert len(seqs["a"].output_token_ids) < 12 and "zz" not in outputs
    assert outputs["d"][-1].outputs[0].token_ids == hf_greedy(hf_dir[0], prompts[3], 12)
    assert outputs["d"][-1].finished and outputs["d"][-1].request_id == "d"
    assert_all_free(engine)


def test_step_reports_each_request_as_it_advances(q7, hf_dir):
    """step() returns a RequestOutput per request that advanced: token ids so far, then a finish
    reason at the last; a bad request is refused with nothing queued, and an id in use too."""
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    engine = q7.LLM(model, max_model_len=40).engine
    engine.add_request("x", PROMPTS[0], q7.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match="request id 'x' is already in use"):
        engine.add_request("x", PROMPTS[1])
    with pytest.raises(ValueError, match="prompt 'y' holds token id 131"):
        engine.add_request("y", [131])
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        engine.add_request("y", [1], {"temperature": 0})
    assert engine.num_unfinished == 1
    seen = []
    while engine.has_unfinished():
        seen += [(o.request_id, list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in engine.step()]
    assert [len(t) for _, t, _ in seen] == [1, 2, 3, 4]
    assert [r for _, _, r in seen] == [None, None, None, "length"]
    assert all(seen[i][1] == seen[-1][1][:i + 1] for i in range(4))


def leak_freed_blocks(q7, engine, monkeypatch):
    monkeypatch.setattr(engine.block_manager, "free", lambda table: table.clear())  # lost


def keep_finished_running(q7, engine, monkeypatch):
    finish = engine.scheduler.finish

    def finish_but_keep(seq, reason):
        running = seq in engine.scheduler.running
        finish(seq, reason)
        if running and reason != "abort":
            engine.scheduler.running.append(seq)
    monkeypatch.setattr(engine.scheduler, "finish", finish_but_keep)


def never_reach_max_tokens(q7, engine, monkeypatch):
    reason = engine.scheduler._finish_reason
    monkeypatch.setattr(engine.scheduler, "_finish_reason",
                        lambda seq, token: None if reason(seq, token) == "length" else
                        reason(seq, token))


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("bug", [leak_freed_blocks, keep_finished_running,
                                 never_reach_max_tokens])
def test_an_engine_that_cannot_progress_raises(q7, hf_dir, monkeypatch, bug, async_scheduling):
    """A step that schedules nothing while no step is in flight and requests remain can never
    change anything: with each of three planted engine bugs (a freed block lost, a finished
    sequence left running, max_tokens never reached), generate raises an error that names the
    stuck requests and the free blocks instead of spinning forever."""
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    llm = q7.LLM(model, max_model_len=40, num_kv_blocks=6, block_size=4, max_num_seqs=2,
                 async_scheduling=async_scheduling)
    bug(q7, llm.engine, monkeypatch)
    greedy = q7.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pytest.raises(RuntimeError, match=r"the engine is stuck: \d+ requests \(\d+.*\) can be "
                                           r"neither scheduled nor finished, with \d+ of 6 KV "
                                           r"blocks free"):
        llm.generate([random_ids(9, seed=s) for s in range(4)], greedy)


def test_a_request_larger_than_the_pool_is_refused(q7, hf_dir):
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    llm = q7.LLM(model, max_model_len=40, num_kv_blocks=3, block_size=4)
    with pytest.raises(ValueError, match="need more than the KV pool's 3 blocks of 4 tokens"):
        llm.generate([[1] * 10], q7.SamplingParams(max_tokens=5))
    assert len(llm.generate([[1] * 6], q7.SamplingParams(max_tokens=6))[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(block_size=12), ValueError, "block_size = 12: must be a power of two"),
    (dict(block_size=0), ValueError, "block_size = 0: must be a positive int"),
    (dict(num_kv_blocks=0), ValueError, "num_kv_blocks = 0: must be a positive int or None"),
    (dict(gpu_memory_utilization=1.5), ValueError, r"gpu_memory_utilization = 1.5: must be in \(0, 1\]"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs = 0: must be a positive int"),
    (dict(max_num_batched_tokens=2.5), ValueError, "max_num_batched_tokens = 2.5: must be a positive int"),
    (dict(enable_prefix_caching="yes"), ValueError, "enable_prefix_caching = 'yes': must be True or False"),
    (dict(speculative="ngram"), TypeError, "speculative must be a dict"),
    (dict(speculative={"method": "medusa"}), ValueError, "method = 'medusa' must be 'ngram' or 'draft'"),
    (dict(speculative={"method": "ngram", "k": 3}), ValueError, r"unknown keys \['k'\]"),
    (dict(speculative={"method": "ngram", "num_tokens": 0}), ValueError, "num_tokens = 0 must be an int from 1 to 16"),
    (dict(speculative={"method": "draft"}), ValueError, "'draft' needs a model"),
])
def test_bad_engine_knobs(q7, hf_dir, kwargs, error, message):
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    with pytest.raises(error, match=message):
        q7.LLM(model, max_model_len=40, **kwargs)


def test_the_cpu_pool_default_and_report(q7, hf_dir, capsys, caplog):
    """Without num_kv_blocks a CPU engine's pool holds max_num_seqs sequences of max_model_len
    tokens, and logs so (a library prints nothing), in MiB when under a GiB: 2 layers, 2 kv heads
    of 32 values, keys and values, float32, 200 tokens."""
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    with caplog.at_level("INFO", logger="07_engine"):
        llm = q7.LLM(model, max_model_len=40, max_num_seqs=5, block_size=8)
    assert llm.engine.block_manager.num_blocks == 25  # 5 x 40 tokens / 8
    assert llm.kv_cache_bytes == 200 * 2 * 2 * 2 * 32 * 4
    assert "KV cache: 25 blocks of 8 tokens = 200 tokens, 0.2 MiB" in caplog.text
    assert capsys.readouterr().out == ""


def test_prefix_caching_reuses_a_shared_prompt(q7, hf_dir):
    """A second request sharing 3 full blocks with a finished first one computes only the rest:
    its hit rate is 3 blocks of its prompt, and its output is still the model's."""
    hf, folder = hf_dir
    model = q7.load_qwen3(folder, device="cpu")
    llm = q7.LLM(model, max_model_len=40, block_size=4)
    first, second = random_ids(14, seed=30), random_ids(14, seed=30)[:12] + random_ids(5, seed=31)
    greedy = q7.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([first], greedy)
    blocks = llm.engine.block_manager
    blocks.reset_stats()
    out = llm.generate([second], greedy)[0]
    assert blocks.prefix_hit_rate == 12 / 17
    assert out.outputs[0].token_ids == hf_greedy(hf, second, 3)
    blocks.reset_stats()
    llm.generate([first[:12]], greedy)  # whole prompt cached: its last block is recomputed
    assert blocks.prefix_hit_rate == 8 / 12


def test_prefix_caching_keeps_the_blocks_of_a_request_s_last_step(q7, hf_dir):
    """The blocks filled by the step that ends a request are cached too: a prompt whose request
    ends at its first token (max_tokens 1), and the block that a request's last decode fills."""
    hf, folder = hf_dir
    model = q7.load_qwen3(folder, device="cpu")
    llm = q7.LLM(model, max_model_len=40, block_size=4)
    blocks = llm.engine.block_manager
    prompt = random_ids(14, seed=32)
    greedy = lambda n: q7.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    llm.generate([prompt], greedy(1))
    blocks.reset_stats()
    out = llm.generate([prompt], greedy(3))[0]  # its 3 full blocks were cached by the first
    assert blocks.prefix_hit_rate == 12 / 14
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 3)
    # that request's last decode computed position 15, which filled its 4th block
    longer = prompt + out.outputs[0].token_ids[:2] + random_ids(3, seed=33)
    blocks.reset_stats()
    assert llm.generate([longer], greedy(2))[0].outputs[0].token_ids == hf_greedy(hf, longer, 2)
    assert blocks.prefix_hit_rate == 16 / 19


def test_speculation_follows_its_acceptance(q7, hf_dir):
    """n-gram speculation on a prompt whose greedy continuation repeats itself (this tiny model
    writes one token 34 times after it: lookup finds the run) accepts most of what it proposes;
    on a prompt whose continuation does not repeat, a sequence stops proposing once its mean
    acceptance falls below min_accepted, only probes every SPEC_PROBE_STEPS steps, and its
    other steps overlap as they do without speculation; a batch speculates only while its
    sequences' gains together pay for the wait."""
    hf, folder = hf_dir
    model = q7.load_qwen3(folder, device="cpu")
    spec = q7.LLM(model, max_model_len=64, speculative={"method": "ngram", "num_tokens": 4})
    repeats = random_ids(4, seed=49)
    out = spec.generate([repeats], q7.SamplingParams(temperature=0, max_tokens=34, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, repeats, 34)
    stats = spec.engine.stats
    assert stats["accepted_tokens"] >= 0.8 * stats["draft_tokens"] > 15
    assert stats["steps"] < 20  # 34 tokens in fewer steps
    never = q7.LLM(model, max_model_len=64,
                   speculative={"method": "ngram", "num_tokens": 4, "min_accepted": 10})
    never.generate([random_ids(5, seed=41)], q7.SamplingParams(temperature=0, max_tokens=40,
                                                              ignore_eos=True))
    # min_accepted 10 > k: after its first verification it only probes: 1 + 39 // 16 at most;
    # between probes its steps overlap again (async scheduling), as without speculation
    assert never.engine.stats["steps"] - 1 >= 36 and never.engine.counts["verified"] <= 3
    assert never.engine.counts["overlapped"] >= 30
    # beside 7 sequences whose text does not repeat, the repeating one's gains do not pay for
    # the wait that speculating puts on all 8 (SPEC_SYNC_COST): the batch overlaps its steps
    batch = q7.LLM(model, max_model_len=64, speculative={"method": "ngram", "num_tokens": 4})
    prompts = [repeats] + [random_ids(5, seed=41 + i) for i in range(7)]
    outs = batch.generate(prompts, q7.SamplingParams(temperature=0, max_tokens=34, ignore_eos=True))
    assert outs[0].outputs[0].token_ids == hf_greedy(hf, repeats, 34)
    assert batch.engine.stats["steps"] >= 34 and batch.engine.counts["overlapped"] >= 25


def test_speculation_thresholds(q7):
    """min_accepted by default: SPEC_MIN_ACCEPTED for n-gram lookup; for a draft model, plus k
    times its share of the target's parameters (counted here independently), since each of its
    k steps reads its weights as a target step reads the target's; a given one is kept."""
    target = q7.Qwen3(q7.Qwen3Config.tiny())
    small = q7.Qwen3(dataclasses.replace(q7.Qwen3Config.tiny(), num_hidden_layers=1))
    size = {m: sum(p.numel() for _, p in m.named_parameters()) for m in (target, small)}
    assert size[small] < size[target]

    def threshold(spec):
        return q7.make_speculator(spec, target, 8, 16, 64, True).min_accepted
    base = q7.SPEC_MIN_ACCEPTED
    assert threshold({"method": "ngram", "num_tokens": 3}) == base
    assert threshold({"method": "draft", "model": target, "num_tokens": 3}) == pytest.approx(
        base + 3)
    assert threshold({"method": "draft", "model": small, "num_tokens": 5}) == pytest.approx(
        base + 5 * size[small] / size[target])
    assert threshold({"method": "draft", "model": small, "min_accepted": 0.25}) == 0.25


@torch.no_grad()
def test_draft_model_speculation(q7, hf_dir):
    """The target itself as the draft: every draft accepted, greedy and sampled (q = p), so each
    step verifies k + 1 tokens; greedy output equals the target's own; a different draft
    model (random weights) gets few accepted, and the output is still the target's. (Always on:
    by default a draft as large as the target would need more than k accepted to pay.)"""
    hf, folder = hf_dir
    model = q7.load_qwen3(folder, device="cpu")
    prompts, max_tokens = mixed_requests(6, seed=8)
    params = [q7.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    same = q7.LLM(model, max_model_len=40, debug=True,
                  speculative={"method": "draft", "model": model, "num_tokens": 3,
                               "min_accepted": 0})
    expected = hf_greedy_all(hf, prompts, max_tokens)
    assert [o.outputs[0].token_ids for o in same.generate(prompts, params)] == expected
    stats = same.engine.stats
    assert stats["accepted_tokens"] == stats["draft_tokens"] > 0
    sampled = [q7.SamplingParams(temperature=0.8, seed=i, max_tokens=m, ignore_eos=True)
               for i, m in enumerate(max_tokens)]
    same.generate(prompts, sampled)
    assert same.engine.stats["accepted_tokens"] == same.engine.stats["draft_tokens"]
    other = q7.Qwen3(model.cfg).eval()  # random weights: another model of the same vocabulary
    llm = q7.LLM(model, max_model_len=40, debug=True,
                 speculative={"method": "draft", "model": other, "num_tokens": 3, "min_accepted": 0})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.stats["accepted_tokens"] < llm.engine.stats["draft_tokens"]
    assert_all_free(llm.engine)
    # a budget of 6 tokens for several sequences of 1 + 3: the last ones' drafts are cut short
    tight = q7.LLM(model, max_model_len=40, debug=True, max_num_batched_tokens=6,
                   speculative={"method": "draft", "model": model, "num_tokens": 3,
                               "min_accepted": 0})
    outputs = tight.generate(prompts, sampled)
    assert [len(o.outputs[0].token_ids) for o in outputs] == max_tokens
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == expected
    assert_all_free(tight.engine)


@pytest.mark.parametrize("budget", [5, 6, 7])
def test_draft_speculation_under_a_tight_budget(q7, hf_dir, budget):
    """Five sequences decoding at once, drafts of 3 from the target itself, 5-7 tokens a step:
    the budget cuts the drafts of some sequences (all of them, at times) and leaves others out
    of the step with their drafts, which wait for the next. Every draft is still the target's
    own choice (all accepted) and the outputs are the target's greedy ones. (Proposing again
    over waiting drafts, or past drafts that were cut, once fed the draft model rows of other
    sequences, and crashed the step.)"""
    hf, folder = hf_dir
    model = q7.load_qwen3(folder, device="cpu")
    prompts = [[5], [9], [11], [13], [17]]
    llm = q7.LLM(model, max_model_len=40, debug=True, max_num_batched_tokens=budget,
                 speculative={"method": "draft", "model": model, "num_tokens": 3,
                              "min_accepted": 0})
    params = q7.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_all(hf, prompts, [10] * 5)
    stats = llm.engine.stats
    assert stats["accepted_tokens"] == stats["draft_tokens"] > 0
    assert_all_free(llm.engine)


# --------------------------------------------- speculative decoding: proposals, rejection sampling

def ngram_reference(ids, k, max_n, min_n):
    """Prompt lookup by its definition: each n from the longest; the most recent earlier start
    that k tokens follow, else the earliest start; compared as lists."""
    for n in range(max_n, min_n - 1, -1):
        starts = [s for s in range(len(ids) - n) if ids[s:s + n] == ids[len(ids) - n:]]
        if starts:
            full = [s for s in starts if s + n + k <= len(ids)]
            start = full[-1] if full else starts[0]
            return ids[start + n:start + n + k]
    return []


def test_ngram_propose_matches_its_definition(q7):
    """3,000 random short sequences over 2 to 4 symbols (many repeats, many partial matches),
    random k, max_n and min_n, as lists and as arrays."""
    rng = random.Random(0)
    for case in range(3000):
        ids = [rng.randrange(rng.randint(2, 4)) for _ in range(rng.randint(0, 30))]
        k, max_n = rng.randint(1, 5), rng.randint(1, 5)
        min_n = rng.randint(1, max_n)
        given = ids if case % 2 else np.array(ids, dtype=np.int32)
        assert q7.ngram_propose(given, k, max_n, min_n) == ngram_reference(ids, k, max_n, min_n), \
            (ids, k, max_n, min_n)


def test_ngram_propose_by_hand(q7):
    propose = q7.ngram_propose
    assert propose([1, 2, 3], 3) == [] and propose([], 3) == [] and propose([7], 3) == []
    assert propose([1, 2, 3, 4, 5, 1], 2) == [2, 3]  # truncated by k
    assert propose([1, 2, 1], 5) == [2, 1]  # truncated by the end of the sequence
    assert propose([1, 2, 9, 3, 2, 8, 1, 2], 1) == [9]  # the 2-gram [1, 2] beats the later [2]
    assert propose([1, 2, 9, 3, 2, 8, 1, 2], 1, max_n=1) == [8]
    assert propose([1, 5, 1, 6, 1], 1) == [6]  # the most recent occurrence
    assert propose([1, 5, 1, 6, 1], 3) == [5, 1, 6]  # ... that k tokens follow
    assert propose([1, 2, 9, 3, 2, 8, 5, 2], 2, min_n=2) == []  # [5, 2] never occurred before
    assert propose([4, 4, 4, 4], 3) == [4]  # the suffix itself is no match; [4, 4, 4] at 0 is
    assert propose([4] * 9, 3) == [4, 4, 4]  # a run: an earlier occurrence that 3 tokens follow


def target_and_draft(T, V, seed):
    """A context-free target P (T, V) (position t's distribution, whatever came before) and a
    draft Q (T, V), each with one token of probability 0 that the other allows."""
    g = torch.Generator().manual_seed(seed)
    zero = torch.randint(0, V, (T, 1), generator=g)
    P = (torch.rand(T, V, generator=g, dtype=torch.float64) + 0.2).scatter(1, zero, 0.0)
    Q = (torch.rand(T, V, generator=g, dtype=torch.float64) + 0.2).scatter(1, (zero + 1) % V, 0.0)
    return (P / P.sum(1, keepdim=True)).float(), (Q / Q.sum(1, keepdim=True)).float()


def speculate(q7, P, Q, n, total, K, draft_probs=True, told=None):
    """Generate `total` tokens for each of n rows with speculative steps against the context-free
    target P: each step a row proposes a random number (0..K) of tokens drawn from Q, and the
    tokens it emits are checked for their layout. rejection_sample is told Q (or `told`, when
    the test feigns a bug), or nothing with draft_probs=False: the point-mass form."""
    out = torch.full((n, total + K + 1), -1)
    length = torch.zeros(n, dtype=torch.long)
    while (length < total).any():
        rows = (length < total).nonzero()[:, 0]
        m, pos = len(rows), length[rows, None] + torch.arange(K + 1)  # (m, K+1)
        drafts = torch.multinomial(Q[pos[:, :K]].flatten(0, 1), 1).view(m, K)
        num_draft = torch.randint(0, K + 1, (m,))
        probs = (Q if told is None else told)[pos[:, :K]] if draft_probs else None
        tokens, accepted = q7.rejection_sample(P[pos], drafts, num_draft, probs)
        kept = torch.arange(K) < accepted[:, None]  # (m, K): the accepted drafts
        assert (accepted <= num_draft).all() and torch.equal(tokens[:, :K][kept], drafts[kept])
        assert torch.equal(tokens >= 0, torch.arange(K + 1) <= accepted[:, None])  # then -1s
        out[rows[:, None], pos] = tokens
        length[rows] += accepted + 1
    return out[:, :total]


def joint_chi_square(tokens, P):
    """The chi-square of the rows' tokens (n, T) against T independent tokens with marginals
    P[:T], over the cells of positive probability, and the value it exceeds with probability
    1e-4; a count in a cell of probability 0 fails the test."""
    n, T = tokens.shape
    V = P.shape[1]
    cell = functools.reduce(lambda c, t: c * V + t, tokens.unbind(1))  # (n,) first token highest
    counts = torch.bincount(cell, minlength=V ** T).double()
    expected = n * functools.reduce(lambda a, b: torch.outer(a, b).flatten(), P[:T].double())
    support = expected > 0
    assert counts[~support].sum() == 0, "a token the target rules out"
    chi2 = ((counts - expected)[support] ** 2 / expected[support]).sum().item()
    return chi2, chi_square_limit(int(support.sum()) - 1)


@pytest.mark.parametrize("draft_probs", [True, False])
def test_speculative_tokens_follow_the_target(q7, draft_probs):
    """The key property: 200,000 rows generate 3 tokens each by speculative steps (K = 2, each
    step proposing 0, 1 or 2 tokens), and the joint of the 3 tokens (64 cells) must be the
    target's, independent tokens with marginals P[0], P[1], P[2], whatever the draft: tokens
    drawn from another distribution Q, with Q given, or in the point-mass form without (exact
    for any draft tokens; a uniform draft would hide a residual that keeps the draft token)."""
    P, Q = target_and_draft(6, 5, seed=3)
    torch.manual_seed(0)
    chi2, limit = joint_chi_square(speculate(q7, P, Q, 200_000, 3, 2, draft_probs), P)
    assert chi2 < limit, (chi2, limit)


def test_speculative_statistics_catch_a_wrong_draft_distribution(q7):
    """The test above can fail: drafts drawn from Q while rejection_sample is told they came from
    the uniform distribution (accepting with min(1, 5 p(x)) and drawing the residual from
    p - 1/5) bias the tokens, and the chi-square sees it at once."""
    P, Q = target_and_draft(6, 5, seed=3)
    torch.manual_seed(0)
    tokens = speculate(q7, P, Q, 200_000, 3, 2, told=torch.full_like(Q, 0.2))
    chi2, limit = joint_chi_square(tokens, P)
    assert chi2 > 10 * limit, (chi2, limit)


def test_speculative_acceptance_rates(q7):
    """A draft equal to the target has every token accepted. Otherwise a token is accepted with
    probability sum_x min(p(x), q(x)), or sum_x q(x) p(x) in the point-mass form; with a
    context-free target the two steps are independent, so both are accepted with the product.
    Within 5 standard errors of 200,000 rows."""
    K, n = 2, 200_000
    P, Q = target_and_draft(K + 1, 6, seed=4)
    torch.manual_seed(1)
    num_draft = torch.randint(0, K + 1, (1000,))
    drafts = torch.multinomial(P[:K].repeat(1000, 1), 1).view(1000, K)
    _, accepted = q7.rejection_sample(P.expand(1000, -1, -1), drafts, num_draft,
                                      P[:K].expand(1000, -1, -1))
    assert torch.equal(accepted, num_draft)
    drafts = torch.multinomial(Q[:K].repeat(n, 1), 1).view(n, K)
    num_draft = torch.full((n,), K)
    for probs, a in [(Q[:K].expand(n, -1, -1), torch.minimum(P[:K], Q[:K]).sum(1)),
                     (None, (P[:K] * Q[:K]).sum(1))]:
        _, accepted = q7.rejection_sample(P.expand(n, -1, -1), drafts, num_draft, probs)
        for got, rate in [((accepted >= 1).double().mean(), a[0]),
                          ((accepted == 2).double().mean(), a[0] * a[1])]:
            assert abs(got - rate) < 5 * math.sqrt(rate * (1 - rate) / n), (got, rate)


def greedy_reference(P, drafts, num_draft):
    """Greedy decoding with a draft, one row and one position at a time: accept while the draft
    token is the argmax, then the argmax; -1 after."""
    B, K1, _ = P.shape
    rows = []
    for b in range(B):
        n = 0
        while n < num_draft[b] and drafts[b, n] == P[b, n].argmax():
            n += 1
        rows.append(drafts[b, :n].tolist() + [int(P[b, n].argmax())] + [-1] * (K1 - 1 - n))
    return torch.tensor(rows)


@pytest.mark.parametrize("draft_probs", [True, False])
def test_speculative_greedy_rows_equal_greedy_decoding(q7, draft_probs):
    """Greedy rows (all of a batch, then half of one, the others sampled) give the argmax chain
    exactly, with drafts that are the argmax three times in four and ragged num_draft."""
    B, K, V = 300, 4, 7
    g = torch.Generator().manual_seed(5)
    P = (torch.randn(B, K + 1, V, generator=g) * 2).softmax(-1)
    guess = torch.randint(0, V, (B, K), generator=g)
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.75, P[:, :K].argmax(-1), guess)
    num_draft = torch.randint(0, K + 1, (B,), generator=g)
    probs = torch.rand(B, K, V, generator=g).softmax(-1) if draft_probs else None
    expected = greedy_reference(P, drafts, num_draft)
    for greedy in (torch.ones(B, dtype=torch.bool), torch.rand(B, generator=g) < 0.5):
        tokens, accepted = q7.rejection_sample(P, drafts, num_draft, probs, greedy=greedy)
        assert torch.equal(tokens[greedy], expected[greedy])
        assert torch.equal(accepted[greedy], (expected[greedy] >= 0).sum(1) - 1)
    assert 0.2 < (accepted[greedy] > 0).double().mean() < 0.9  # both outcomes are exercised


def test_speculative_rows_without_drafts(q7):
    """Targets sure of each token: a num_draft = 0 row (and every row when K = 0) draws its one
    token from position 0, whatever the padding of its draft holds (even ids outside the
    vocabulary); a row with the target's own drafts keeps all and adds the bonus token; a row
    with a wrong second draft keeps the first and takes the target's token there."""
    V = 9
    sure = torch.tensor([[2, 0, 0, 0], [5, 1, 7, 4], [5, 4, 7, 0]])  # (3, 4): the target's tokens
    P = torch.zeros(3, 4, V).scatter(-1, sure[..., None], 1.0)  # (3, 4, V)
    drafts = torch.tensor([[-1, 10**9, 4], [5, 1, 7], [5, 3, 7]])
    num_draft = torch.tensor([0, 3, 2])
    for probs in (None, torch.full((3, 3, V), 1 / V)):
        tokens, accepted = q7.rejection_sample(P, drafts, num_draft, probs)
        assert tokens.tolist() == [[2, -1, -1, -1], [5, 1, 7, 4], [5, 4, -1, -1]]
        assert accepted.tolist() == [0, 3, 1]
    tokens, accepted = q7.rejection_sample(P[:, :1], drafts[:, :0], torch.zeros_like(num_draft))
    assert tokens.tolist() == [[2], [5], [5]] and accepted.tolist() == [0] * 3


def test_speculative_residual_of_zero_falls_back_to_the_target(q7):
    """A draft distribution above the target everywhere (q = 2p, as rounding could leave a tiny
    excess) rejects half the time with a residual (p - q)+ of 0: the token then comes from p,
    never from an arbitrary argmax over zeros (token 0) or a NaN."""
    P = torch.zeros(1000, 2, 6).index_fill(-1, torch.tensor([3]), 1.0)  # (1000, 2, 6), all on 3
    torch.manual_seed(2)
    tokens, accepted = q7.rejection_sample(P, torch.full((1000, 1), 3),
                                           torch.ones(1000, dtype=torch.long), 2 * P[:, :1])
    assert 300 < int((accepted == 0).sum()) < 700
    assert (tokens[accepted == 0, 0] == 3).all() and (tokens[accepted == 1, :2] == 3).all()


def test_speculative_seeded_rows_repeat_in_any_batch(q7):
    """A seeded row gets the same tokens alone, or at another index among other rows (seeded or
    not) after another global seed; other seeds give other tokens."""
    B, K, V = 6, 4, 50
    g = torch.Generator().manual_seed(6)
    P = (torch.randn(B, K + 1, V, generator=g) * 0.5).softmax(-1)
    Q = (torch.randn(B, K, V, generator=g) * 0.5).softmax(-1)
    drafts = torch.multinomial(Q.flatten(0, 1), 1, generator=g).view(B, K)
    num_draft = torch.tensor([4, 3, 0, 4, 2, 4])

    def run(rows, seeds, global_seed):
        torch.manual_seed(global_seed)
        generators = {i: torch.Generator().manual_seed(s)
                      for i, s in enumerate(seeds) if s is not None}
        tokens, _ = q7.rejection_sample(P[rows], drafts[rows], num_draft[rows], Q[rows],
                                        generators=generators)
        return tokens.tolist()

    for seed in range(8):
        alone = run([0], [seed], 0)[0]
        assert run([3, 1, 0, 5], [None, 11, seed, None], 1)[2] == alone
        assert run([0, 0], [None, seed], 2)[1] == alone
    assert len({tuple(run([0], [seed], 0)[0]) for seed in range(8)}) > 1
    assert len({tuple(run([0], [None], seed)[0]) for seed in range(8)}) > 1


# ------------------------------------------------------------------------------- the block manager
class ReferenceBlocks:
    """The block manager's rules kept the plain way, as the tests' reference: a cached block is
    named by the tuple of every token up to its end (no hashing), the evictable blocks are a
    list, oldest first, and the free blocks a set."""

    def __init__(self, num_blocks, block_size):
        self.block_size, self.counts = block_size, [0] * num_blocks
        self.free, self.lru, self.named = set(range(num_blocks)), [], {}  # named: prefix -> block
        self.hits = self.queries = 0

    def prefix(self, token_ids):
        """The named blocks that begin token_ids, stopping short of its last token."""
        blocks = []
        for end in range(self.block_size, len(token_ids), self.block_size):
            if tuple(token_ids[:end]) not in self.named:
                break
            blocks.append(self.named[tuple(token_ids[:end])])
        return blocks

    def take(self, block):
        if self.counts[block] == 0:
            self.lru.remove(block)
        self.counts[block] += 1

    def fresh(self, needed):
        """The blocks grow must hand out, in order where it is determined: the free set (any
        order) and then the oldest evictable blocks, whose names are dropped."""
        from_free = min(needed, len(self.free))
        evicted, self.lru = self.lru[:needed - from_free], self.lru[needed - from_free:]
        self.named = {p: b for p, b in self.named.items() if b not in evicted}
        return from_free, evicted

    def release(self, table):
        for block in reversed(table):
            self.counts[block] -= 1
            if self.counts[block] == 0 and block in self.named.values():
                self.lru.append(block)
            elif self.counts[block] == 0:
                self.free.add(block)


def grow_and_compare(m, ref, table, num_tokens):
    """m.grow against the reference: success exactly when enough blocks are free or evictable,
    the new blocks from the free list first, then the least recently freed cached ones."""
    before, needed = list(table), max(0, -(-num_tokens // m.block_size) - len(table))
    ok = m.grow(table, num_tokens)
    assert ok == (needed <= len(ref.free) + len(ref.lru))
    if not ok:
        assert table == before
        return False
    new = table[len(before):]
    from_free, evicted = ref.fresh(needed)
    assert len(new) == needed and set(new[:from_free]) <= ref.free
    assert len(set(new[:from_free])) == from_free and new[from_free:] == evicted
    ref.free -= set(new)
    for block in new:
        ref.counts[block] = 1
    return True


@pytest.mark.parametrize("seed, num_blocks, block_size", [(0, 24, 4), (1, 40, 2), (2, 12, 1),
                                                          (3, 30, 8)])
def test_block_manager_against_a_reference_model(q7, seed, num_blocks, block_size):
    """Many random engine-like operations (admit with prefix lookup, chunked prefill, decode
    token by token, finish, preempt and resume), prompts built from a few shared beginnings over
    a 3-token alphabet so that equal blocks after different prefixes are common; after each one
    the manager's state equals the reference's and check() passes."""
    rng = random.Random(seed)
    m, ref = q7.BlockManager(num_blocks, block_size), ReferenceBlocks(num_blocks, block_size)
    bases = [[rng.randrange(3) for _ in range(5 * block_size)] for _ in range(3)]
    waiting, running = [], []  # each sequence: {"tokens", "table", "computed"}
    admitted = preempted = hit_admissions = 0
    for _ in range(1500):
        op = rng.random()
        if op < 0.15 or not (waiting or running):
            base = rng.choice(bases)
            tokens = base[:rng.randrange(len(base))] + [rng.randrange(3)
                                                        for _ in range(rng.randrange(1, 9))]
            waiting.append({"tokens": tokens, "table": [], "computed": 0})
        elif op < 0.35 and waiting:
            seq = waiting.pop(rng.randrange(len(waiting)))
            expected = ref.prefix(seq["tokens"])
            cached = m.allocate_prefix(seq["table"], seq["tokens"])
            assert seq["table"] == expected and cached == len(expected) * block_size
            for block in expected:
                ref.take(block)
            ref.hits, ref.queries = ref.hits + cached, ref.queries + len(seq["tokens"])
            hit_admissions += bool(expected)
            if grow_and_compare(m, ref, seq["table"], len(seq["tokens"])):
                seq["computed"] = cached
                running.append(seq)
                admitted += 1
            else:  # no room: give back what the lookup took, and wait
                ref.release(expected)
                m.free(seq["table"])
                waiting.append(seq)
        elif op < 0.85 and running:
            seq = rng.choice(running)
            tokens, table, start = seq["tokens"], seq["table"], seq["computed"]
            if start < len(tokens):  # a forward pass: a prefill chunk or the decoded token
                end = rng.randint(start + 1, len(tokens))
                m.cache_full_blocks(table, tokens, start, end)
                for i in range(start // block_size, end // block_size):
                    ref.named.setdefault(tuple(tokens[:(i + 1) * block_size]), table[i])
                seq["computed"] = end
            else:  # sampling: one more token, which needs a slot
                tokens.append(rng.randrange(3))
                if not grow_and_compare(m, ref, table, len(tokens)):
                    running.remove(seq)
                    ref.release(table)
                    m.free(table)
                    seq["computed"] = 0
                    waiting.append(seq)
                    preempted += 1
        elif running:  # finish or preempt
            seq = running.pop(rng.randrange(len(running)))
            ref.release(seq["table"])
            m.free(seq["table"])
            assert seq["table"] == []
            if rng.random() < 0.3:
                seq["computed"] = 0
                waiting.append(seq)
        m.verify([seq["table"] for seq in running])
        assert m.ref_counts == ref.counts and set(m.free_blocks) == ref.free
        assert list(m.evictable) == ref.lru and m.num_free_blocks == len(ref.free) + len(ref.lru)
        assert sorted(m.cached.values()) == sorted(ref.named.values())
        assert m.prefix_hit_rate == (ref.hits / ref.queries if ref.queries else 0.0)
    assert admitted > 100 and preempted > 0 and hit_admissions > 20  # every path was taken
    for seq in running:
        m.free(seq["table"])
    m.verify([])
    assert m.num_free_blocks == num_blocks


def cached_sequence(m, token_ids):
    """A sequence admitted, prefilled and cached in one go, as the engine would; its table."""
    table = []
    cached = m.allocate_prefix(table, token_ids)
    assert m.grow(table, len(token_ids))
    m.cache_full_blocks(table, token_ids, cached, len(token_ids))
    return table


def test_block_manager_prefix_reuse(q7):
    """Shared beginnings get the same block ids, and only beginnings: a block is found by its
    tokens and everything before them. New blocks are never the shared ones."""
    m = q7.BlockManager(32, block_size=4)
    a = list(range(100, 114))  # 3 full blocks and 2 tokens
    first = cached_sequence(m, a)
    second = []
    assert m.allocate_prefix(second, a[:12] + [7, 8, 9, 10, 11]) == 12 and second == first[:3]
    assert m.grow(second, 17) and not set(second[3:]) & set(first)
    for other in ([0] + a[1:], a[:4] + [0] + a[5:]):  # differ in block 0, in block 1
        table = []
        assert m.allocate_prefix(table, other) == (0 if other[0] == 0 else 4)
        m.free(table)
    # Blocks 1 and 2 of `a` again, at the start of a prompt: other tokens before them, no hit.
    assert m.allocate_prefix([], a[4:]) == 0
    m.verify([first, second])


def test_block_manager_duplicate_blocks(q7):
    """Two sequences that compute the same blocks side by side: the first one's stay the ones
    found, the second one's keep their hashes so that its later blocks chain from them, and a
    prompt whose beginning was evicted finds nothing, though a later block of it is cached."""
    m = q7.BlockManager(6, block_size=4)
    p = [1] * 4 + [2] * 4 + [3]
    ta, tb = [], []
    for table in (ta, tb):  # both admitted before either has computed anything
        assert m.allocate_prefix(table, p) == 0 and m.grow(table, len(p))
    for table in (ta, tb):
        m.cache_full_blocks(table, p, 0, 9)
    probe = []
    assert m.allocate_prefix(probe, p) == 8 and probe == ta[:2]
    m.free(probe)
    first, longer = list(ta), p + [4, 4, 4]
    m.free(ta)  # ta[2] is free, ta[1] and ta[0] evictable
    assert m.grow(tb, len(longer))
    m.cache_full_blocks(tb, longer, 9, 12)  # tb's block 2 chains from its unregistered block 1
    assert m.allocate_prefix(probe, longer + [5]) == 12 and probe == first[:2] + tb[2:]
    m.free(probe)
    d = []
    assert m.grow(d, 12) and d == first[2:] + first[1::-1]  # the free one, then evictions
    assert m.allocate_prefix(probe, longer + [5]) == 0 and probe == []
    m.verify([tb, d])


@pytest.mark.parametrize("length, blocks", [(8, 1), (9, 2), (12, 2)])
def test_block_manager_recomputes_the_last_token(q7, length, blocks):
    """The same prompt again reuses its full blocks except one that would hold its last token:
    that token's logits are needed, so it is computed again."""
    m = q7.BlockManager(16, block_size=4)
    tokens = [3 * i + 1 for i in range(length)]
    first = cached_sequence(m, tokens)
    again = []
    assert m.allocate_prefix(again, tokens) == 4 * blocks and again == first[:blocks]
    assert m.grow(again, length) and len(again) == len(first)
    m.verify([first, again])


def test_block_manager_evicts_the_least_recently_freed_first(q7):
    """Freed cached blocks stay findable until the free list runs out; then the least recently
    freed go first, a sequence's tail before its head, and an evicted block is found no more."""
    m = q7.BlockManager(10, block_size=4)
    a, b, c = ([k] * 9 for k in (1, 2, 3))  # 3 blocks each, the last one not full
    ta, tb, tc = (cached_sequence(m, p) for p in (a, b, c))
    lru = [tc[1], tc[0], tb[1], tb[0], ta[1], ta[0]]  # free clears the tables
    m.free(ta)
    m.free(tc)
    again = []  # a hit on a's two full blocks makes them the most recently freed, below
    assert m.allocate_prefix(again, a) == 8 and again == lru[:-3:-1]
    m.free(tb)
    m.free(again)
    assert m.num_free_blocks == 10
    # Free: the unused block and the three partial blocks. Evictable, oldest first: c's 1, 0,
    # b's 1, 0, a's 1, 0 (each sequence's tail went first).
    d = []
    assert m.grow(d, 4 * 4) and not set(d) & set(lru)
    for taken in range(1, 4):
        assert m.grow(d, 4 * (4 + taken)) and d[4:] == lru[:taken]
    assert m.num_free_blocks == 3
    for prompt, cached in ((c, 0), (b, 4), (a, 8)):  # c lost both, b its tail, a nothing
        table = []
        assert m.allocate_prefix(table, prompt) == cached
        m.free(table)
    m.verify([d])


def test_block_manager_grow_is_all_or_nothing(q7):
    """grow takes every block it needs or none; blocks_needed is the shortfall in whole blocks."""
    m = q7.BlockManager(5, block_size=4)
    for have, tokens in ((0, 0), (0, 1), (0, 4), (0, 5), (2, 8), (2, 9), (3, 2)):
        assert m.blocks_needed([0] * have, tokens) == max(0, len(range(0, tokens, 4)) - have)
    table = cached_sequence(m, [5] * 6)  # 2 blocks, the first cached
    m.free(table)  # 4 on the free list, 1 evictable
    held = []
    assert m.grow(held, 4)
    assert not m.grow(held, 4 * 6) and len(held) == 1 and m.num_free_blocks == 4
    m.verify([held])
    assert m.grow(held, 4 * 5) and len(held) == 5 and m.num_free_blocks == 0
    assert not m.grow(held, 4 * 5 + 1) and len(held) == 5
    m.verify([held])


def test_block_manager_without_prefix_caching(q7):
    """With prefix caching off no prompt is ever found and every freed block is free again."""
    m = q7.BlockManager(8, block_size=2, enable_prefix_caching=False)
    tokens = [4, 5, 6, 7, 8, 9, 1]
    first = cached_sequence(m, tokens)
    table = []
    assert m.allocate_prefix(table, tokens) == 0 and table == []
    m.free(first)
    assert m.allocate_prefix(table, tokens) == 0 and table == []
    assert m.num_free_blocks == 8 and not m.evictable and m.prefix_hit_rate == 0.0
    m.verify([])


def test_block_manager_hit_rate(q7):
    """prefix_hit_rate: tokens found over tokens asked for, counted here prompt by prompt."""
    m = q7.BlockManager(64, block_size=4)
    assert m.prefix_hit_rate == 0.0
    base = list(range(20))
    hits = queries = 0
    for prompt, cached in ((base, 0), (base[:13], 12), (base[:5], 4), (base + [1, 2], 20),
                           ([9] + base, 0), (base[:4], 0)):
        table = cached_sequence(m, prompt)
        hits, queries = hits + cached, queries + len(prompt)
        assert m.prefix_hit_rate == pytest.approx(hits / queries)
        m.free(table)
    m.reset_stats()
    assert m.prefix_hit_rate == 0.0


@pytest.mark.parametrize("kwargs, message", [
    ({"num_blocks": 0}, "num_blocks = 0 must be a positive int"),
    ({"num_blocks": 8.0}, "num_blocks = 8.0 must be a positive int"),
    ({"num_blocks": True}, "num_blocks = True must be a positive int"),
    ({"num_blocks": 8, "block_size": 0}, "block_size = 0 must be a positive int and a power"),
    ({"num_blocks": 8, "block_size": 12}, "block_size = 12 must be a positive int and a power"),
    ({"num_blocks": 8, "block_size": "16"}, "block_size = '16' must be a positive int"),
    ({"num_blocks": 8, "enable_prefix_caching": 1}, "enable_prefix_caching = 1 must be True or"),
])
def test_block_manager_bad_arguments(q7, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        q7.BlockManager(**kwargs)


def corrupt_count(m, tables):
    m.ref_counts[tables[0][0]] += 1


def corrupt_twice(m, tables):
    tables[0].append(tables[0][0])


def corrupt_free_but_held(m, tables):
    tables[0].append(m.free_blocks[0])


def corrupt_leak(m, tables):
    m.free_blocks.popleft()


def corrupt_hash_map(m, tables):
    m.cached[next(iter(m.cached))] = tables[1][-1]


def corrupt_evictable_unnamed(m, tables):
    m.cached.clear()


def corrupt_unknown_id(m, tables):
    tables[0][0] = 99


@pytest.mark.parametrize("corrupt, message", [
    (corrupt_count, "reference count 2, but 1 tables hold it"),
    (corrupt_twice, "a block table holds a block twice"),
    (corrupt_free_but_held, "free or evictable but held by a table"),
    (corrupt_leak, "!= 8 blocks"),
    (corrupt_hash_map, "the hash map names block"),
    (corrupt_evictable_unnamed, "not cached"),
    (corrupt_unknown_id, "block ids outside the pool: {99}"),
])
def test_block_manager_verify_catches_corruption(q7, corrupt, message):
    m = q7.BlockManager(8, block_size=2)
    gone = cached_sequence(m, [1, 2, 3, 4, 5])
    m.free(gone)  # two evictable blocks
    tables = [cached_sequence(m, [6, 7, 8]), cached_sequence(m, [9, 9, 9])]
    m.verify(tables)
    corrupt(m, tables)
    with pytest.raises(AssertionError, match=re.escape(message)):
        m.verify(tables)


# --------------------------------------------------------------------------------- paged attention

def paged_pool(lengths, Hkv, D, page, seed, spare=3):
    """Pools k, v (num_blocks, page, Hkv, D) float64 holding rows of the given lengths, and block
    tables (B, most pages + 1) int32. Pages are handed out in a shuffled order; every slot no
    row's key owns is NaN (the spare pages and the tail of each row's last page), so a kernel
    that reads one shows it; table entries past a row's last page are garbage: -1, 2**30, or a
    spare (NaN) page."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lengths]
    order = torch.randperm(sum(pages) + spare, generator=gen)  # the last `spare` stay unused
    pools = torch.full((2, len(order), page, Hkv, D), float("nan"), dtype=torch.float64)
    tables = torch.empty(len(lengths), max(pages) + 1, dtype=torch.int32)
    taken = 0
    for b, (n, own) in enumerate(zip(lengths, pages)):
        tables[b, :own] = order[taken:taken + own]
        tables[b, own:] = (-1, 2**30, int(order[-1]))[b % 3]
        taken += own
        keys = torch.arange(n)
        pools[:, tables[b, keys // page].long(), keys % page] = gen64(2, n, Hkv, D, seed=seed + b)
    return pools[0], pools[1], tables


def gathered(pool, table, length):
    """Keys 0..length-1 of one row, read through its block table: (length, Hkv, D)."""
    keys = torch.arange(length)
    return pool[table[keys // pool.shape[1]].long(), keys % pool.shape[1]]


def paged_float64(q, k_pool, v_pool, tables, q_lens, lengths):
    """q (N, Hq, D), q_lens[b] new tokens of row b packed in order, each seeing its row's keys up
    to its own position (the last q_lens[b] of lengths[b]): float64 attention over keys gathered
    through the block tables, GQA heads by index, causal bottom-right -> (N, Hq, D)."""
    out, start = [], 0
    for b, (T, S) in enumerate(zip(q_lens, lengths)):
        k, v = (gathered(x.cpu(), tables[b].cpu(), S).transpose(0, 1)[None]  # (1, Hkv, S, D)
                for x in (k_pool, v_pool))
        q_b = q[start:start + T].cpu().transpose(0, 1)[None]  # (1, Hq, T, D)
        out.append(attention_float64(q_b, k, v, causal=True)[0].transpose(0, 1))
        start += T
    return torch.cat(out)


def paged_inputs(lengths, Hq, Hkv, D, page, dtype, q_rows, seed):
    """q (q_rows, Hq, D), pools and tables on DEVICE in dtype; lengths int32."""
    k_pool, v_pool, tables = paged_pool(lengths, Hkv, D, page, seed)
    q = gen64(q_rows, Hq, D, seed=seed + 100)
    q, k_pool, v_pool = (x.to(DEVICE, dtype) for x in (q, k_pool, v_pool))
    return (q, k_pool, v_pool, tables.to(DEVICE),
            torch.tensor(lengths, dtype=torch.int32, device=DEVICE))


PAGED_DECODE_CASES = {  # name -> lengths, Hq, Hkv, D, page, num_splits, max_len, dtype
    # lengths 1, a page exactly, a page +- 1; odd page counts
    "mha-page16-1-split": ([1, 16, 17, 15, 40], 4, 4, 32, 16, 1, None, torch.float32),
    "gqa2-page4-2-splits-max_len": ([33, 1, 8, 7, 9], 4, 2, 64, 4, 2, 33, torch.float32),
    "gqa4-page16-3-splits-bf16": ([47, 32, 1], 8, 2, 128, 16, 3, None, torch.bfloat16),
    # pages larger than the interpreter's 16-key tiles, the split rule's count (3 splits), a
    # group of 3 (padded to 16 rows)
    "gqa3-page32-rule-fp16": ([300, 3], 6, 2, 32, 32, None, None, torch.float16),
    "mqa-page1-2-splits": ([5, 1, 3], 2, 1, 32, 1, 2, None, torch.float32),
}


@pytest.mark.parametrize("case", PAGED_DECODE_CASES)
def test_paged_decode_attention(q7, case, monkeypatch):
    """Against float64 over keys gathered through shuffled block tables with garbage past each
    row's pages and NaN in every slot no key owns: ragged lengths, GQA groups 1 to 4, pages of
    1 to 32 keys, 1 to 3 splits and the split rule's count (on an H200's 132 SMs)."""
    monkeypatch.setattr(q7, "_num_sms", lambda device: 132)
    lengths, Hq, Hkv, D, page, splits, max_len, dtype = PAGED_DECODE_CASES[case]
    q, k_pool, v_pool, tables, lens = paged_inputs(lengths, Hq, Hkv, D, page, dtype,
                                                   len(lengths), seed=21)
    out = q7.paged_decode_attention(q, k_pool, v_pool, tables, lens, max_len=max_len,
                                    num_splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    expected = paged_float64(q, k_pool, v_pool, tables, [1] * len(lengths), lengths)
    assert (out.cpu().double() - expected).abs().max().item() < DECODE_TOL[dtype]


@pytest.mark.parametrize("dtype, splits", [(torch.float32, 1), (torch.bfloat16, 3)])
def test_paged_decode_equals_decode_attention_on_a_contiguous_copy(q7, dtype, splits):
    """The same rows laid out contiguously (NaN past each row's length) through decode_attention:
    the same split, the same tiles, so the same numbers up to the order of fp32 sums."""
    lengths, Hq, Hkv, D, page = [37, 1, 16, 20], 8, 2, 64, 4
    q, k_pool, v_pool, tables, lens = paged_inputs(lengths, Hq, Hkv, D, page, dtype, 4, seed=22)
    S = max(lengths)
    k, v = (torch.stack([F.pad(gathered(x.cpu(), tables[b].cpu(), n).transpose(0, 1),
                               (0, 0, 0, S - n), value=float("nan"))
                         for b, n in enumerate(lengths)]).to(DEVICE)  # (B, Hkv, S, D)
            for x in (k_pool, v_pool))
    paged = q7.paged_decode_attention(q, k_pool, v_pool, tables, lens, S, num_splits=splits)
    contiguous = q7.decode_attention(q, k, v, lens, S, num_splits=splits)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # one bf16 rounding of an output near 1
    assert (paged.cpu().float() - contiguous.cpu().float()).abs().max().item() <= tol


PAGED_PREFILL_CASES = {  # name -> q_lens, lengths, Hq, Hkv, D, page, dtype
    # a decode, a whole prompt (q_len == length, twice), a chunk after a 13-key prefix
    "gqa2-page4-mix": ([1, 5, 17, 12], [9, 5, 30, 12], 4, 2, 32, 4, torch.float32),
    # tiles of 16 tokens from position 30: the first's key 31 is one past the unmasked keys
    "mha-page16": ([17, 1, 3], [47, 16, 20], 4, 4, 64, 16, torch.float32),
    # a chunk of 20 after 63 keys, ragged at both ends of the pages
    "gqa4-page16-chunked-bf16": ([20, 1], [83, 50], 8, 2, 128, 16, torch.bfloat16),
    # a group of 3 query heads in tiles of 4 (rows of the 4th head are padding)
    "gqa3-page4-fp16": ([6, 2, 9], [6, 17, 9], 6, 2, 32, 4, torch.float16),
}


@pytest.mark.parametrize("case", PAGED_PREFILL_CASES)
def test_paged_prefill_attention(q7, case):
    """Ragged sequences in one launch, q lengths 1 to 20 over prefixes that are not whole pages,
    against float64 (same tables, garbage and NaN as the decode test)."""
    q_lens, lengths, Hq, Hkv, D, page, dtype = PAGED_PREFILL_CASES[case]
    q, k_pool, v_pool, tables, lens = paged_inputs(lengths, Hq, Hkv, D, page, dtype,
                                                   sum(q_lens), seed=23)
    cu = torch.tensor(np.cumsum([0] + q_lens), dtype=torch.int32, device=DEVICE)
    out = q7.paged_prefill_attention(q, k_pool, v_pool, tables, cu, lens, max(q_lens))
    assert out.shape == q.shape and out.dtype == dtype
    expected = paged_float64(q, k_pool, v_pool, tables, q_lens, lengths)
    assert (out.cpu().double() - expected).abs().max().item() < DECODE_TOL[dtype]


@pytest.mark.parametrize("case", ["decode", *PAGED_PREFILL_CASES])
def test_paged_attention_torch(q7, case):
    """The torch version against the same float64 reference, decodes and prefills (CPU)."""
    if case == "decode":
        lengths, Hq, Hkv, D, page, *_, dtype = PAGED_DECODE_CASES["gqa2-page4-2-splits-max_len"]
        q_lens = [1] * len(lengths)
    else:
        q_lens, lengths, Hq, Hkv, D, page, dtype = PAGED_PREFILL_CASES[case]
    k_pool, v_pool, tables = paged_pool(lengths, Hkv, D, page, seed=24)
    q = gen64(sum(q_lens), Hq, D, seed=25)
    q, k_pool, v_pool = (x.to(dtype) for x in (q, k_pool, v_pool))
    cu = torch.tensor(np.cumsum([0] + q_lens), dtype=torch.int32)
    out = q7.paged_attention_torch(q, k_pool, v_pool, tables, cu, torch.tensor(lengths))
    assert out.shape == q.shape and out.dtype == dtype
    expected = paged_float64(q, k_pool, v_pool, tables, q_lens, lengths)
    assert (out.double() - expected).abs().max().item() < DECODE_TOL[dtype]


def ints(*values):
    return torch.tensor(values, dtype=torch.int32)


PAGED_BAD = [  # (functions, what changes, error, message)
    ("dpt", dict(q=torch.ones(2, 4, 1, 32)), ValueError, r"q must be \(rows, Hq, D\)"),
    ("dpt", dict(v_cache=torch.ones(6, 4, 2, 64)), ValueError,
     r"one \(num_blocks, block_size, Hkv, D\) shape"),
    ("dpt", dict(block_tables=ints(0, 1)), ValueError, r"block_tables must be \(B, max_blocks\)"),
    ("dpt", dict(lengths=ints(1, 1, 1)), ValueError,
     r"and lengths \(B,\), got \(2, 3\) and \(3,\)"),
    ("dpt", dict(q=torch.ones(2, 3, 32)), ValueError,
     r"query heads \(3\) must be a multiple of kv heads \(2\)"),
    ("dpt", dict(q=torch.ones(2, 4, 64)), ValueError, "head sizes differ: q has D=64"),
    ("dpt", dict(k_cache=torch.ones(6, 6, 2, 32), v_cache=torch.ones(6, 6, 2, 32)), ValueError,
     "block_size must be a power of two, got 6"),
    ("dp", dict(q=torch.ones(2, 4, 48), k_cache=torch.ones(6, 4, 2, 48),
                v_cache=torch.ones(6, 4, 2, 48)), ValueError, "head size D=48 is not supported"),
    ("dp", dict(q=torch.ones(2, 4, 32, dtype=torch.float64)), TypeError, "q has dtype"),
    ("dp", dict(k_cache=torch.ones(6, 4, 2, 32, dtype=torch.float16)), TypeError,
     "k_cache has dtype torch.float16"),
    ("dp", dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)), TypeError,
     "block_tables has dtype torch.int64"),
    ("dp", dict(lengths=torch.ones(2)), TypeError, "lengths has dtype torch.float32"),
    ("dp", dict(k_cache=torch.ones(6, 4, 32, 2).transpose(-1, -2)), ValueError,
     "q, k_cache and v_cache need a unit last stride"),
    ("dp", dict(block_tables=torch.zeros(3, 2, dtype=torch.int32).t()), ValueError,
     "block_tables needs a unit last stride"),
    ("dp", dict(sm_scale=0.0), ValueError, "sm_scale must be a positive number, got 0.0"),
    ("d", dict(q=torch.ones(3, 4, 32)), ValueError, "q has 3 rows but block_tables 2"),
    ("d", dict(max_len=13), ValueError,
     r"max_len must be an int in \[1, max_blocks \* block_size=12\], got 13"),
    ("d", dict(max_len=4.0), ValueError, "max_len must be an int"),
    ("d", dict(num_splits=0), ValueError, r"num_splits must be an int in \[1, 64\] or None"),
    ("p", dict(cu_seqlens_q=ints(0, 1, 2).long()), TypeError, "cu_seqlens_q has dtype torch.int64"),
    ("p", dict(cu_seqlens_q=ints(0, 2)), ValueError, r"cu_seqlens_q must be \(B \+ 1,\) = \(3,\)"),
    ("p", dict(max_q_len=3), ValueError, r"max_q_len must be an int in \[1, N=2\], got 3"),
    ("p", dict(max_q_len=True), ValueError, "max_q_len must be an int"),
    ("t", dict(lengths=ints(1, 13)), ValueError, r"sequence 1 has 1 new tokens and 13 keys"),
    ("t", dict(cu_seqlens_q=ints(0, 2, 2)), ValueError, "sequence 0 has 2 new tokens and 1 keys"),
]


@pytest.mark.parametrize("functions, change, error, message", PAGED_BAD)
def test_paged_attention_refuses_bad_inputs(q7, functions, change, error, message):
    """Each bad input, to each function that must refuse it ("d" decode, "p" prefill, "t" the
    torch version): a clear error before any launch."""
    args = dict(q=torch.ones(2, 4, 32), k_cache=torch.ones(6, 4, 2, 32),
                v_cache=torch.ones(6, 4, 2, 32), block_tables=torch.zeros(2, 3, dtype=torch.int32),
                lengths=ints(1, 1), cu_seqlens_q=ints(0, 1, 2), max_q_len=1, max_len=None,
                num_splits=None, sm_scale=None)
    args.update(change)
    args = {name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in args.items()}
    tensors = [args[name] for name in ("q", "k_cache", "v_cache", "block_tables")]
    calls = {"d": lambda: q7.paged_decode_attention(
                 *tensors, args["lengths"], args["max_len"], args["sm_scale"], args["num_splits"]),
             "p": lambda: q7.paged_prefill_attention(
                 *tensors, args["cu_seqlens_q"], args["lengths"], args["max_q_len"],
                 args["sm_scale"]),
             "t": lambda: q7.paged_attention_torch(*tensors, args["cu_seqlens_q"],
                                                   args["lengths"])}
    for function in functions:
        with pytest.raises(error, match=message):
            calls[function]()


@pytest.mark.gpu
def test_gpu_paged_kernels_at_realistic_sizes(q7):
    """Both paged kernels on an H200-sized problem against float64: bf16, D=128, Qwen3-8B's
    32/8 heads, pages of 16, 8 rows ragged up to 3,000 keys, the split rule's own count, and
    prefill chunks of 1 to 640 tokens over long prefixes."""
    lengths = [3000, 1, 17, 1024, 2049, 640, 16, 2999]
    q_lens = [64, 1, 17, 1, 300, 640, 5, 1]
    q, k_pool, v_pool, tables, lens = paged_inputs(lengths, 32, 8, 128, 16, torch.bfloat16,
                                                   sum(q_lens), seed=26)
    out = q7.paged_decode_attention(q[:8], k_pool, v_pool, tables, lens)
    expected = paged_float64(q[:8], k_pool, v_pool, tables, [1] * 8, lengths)
    assert (out.cpu().double() - expected).abs().max().item() < DECODE_TOL[torch.bfloat16]
    cu = torch.tensor(np.cumsum([0] + q_lens), dtype=torch.int32, device=DEVICE)
    out = q7.paged_prefill_attention(q, k_pool, v_pool, tables, cu, lens, max(q_lens))
    expected = paged_float64(q, k_pool, v_pool, tables, q_lens, lengths)
    assert (out.cpu().double() - expected).abs().max().item() < DECODE_TOL[torch.bfloat16]


# ------------------------------------------------------------------------------ on the GPU

@pytest.mark.gpu
@torch.no_grad()
def test_gpu_engine_matches_transformers(q7, hf_dir):
    """On CUDA the model runs on the Triton kernels (flash prefill, RMSNorm, SwiGLU): in fp32 its
    logits and greedy tokens match transformers' on the CPU; in bf16, logits within bf16's
    rounding of the fp32 ones."""
    hf, folder = hf_dir
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # fp32 products, whatever ran before
    try:
        check_on_the_gpu(q7, hf, folder)
    finally:
        torch.set_float32_matmul_precision(precision)


def check_on_the_gpu(q7, hf, folder):
    llm = q7.LLM(folder, device="cuda", dtype=torch.float32, max_model_len=40)
    assert llm.model.model.norm.kernels and llm.model.model.layers[0].self_attn.kernels
    ids = torch.tensor([PROMPTS[2] + PROMPTS[0]])
    expected = hf(ids).logits
    assert (llm.model(ids.cuda()).cpu() - expected).abs().max().item() < 1e-3
    outputs = llm.generate(PROMPTS, q7.SamplingParams(temperature=0, max_tokens=10))
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 10)
    # engine v1 on the kernels, its decode steps replayed from a CUDA graph
    v1 = q7.generate(llm.model, PROMPTS, q7.SamplingParams(temperature=0, max_tokens=10))
    assert v1 == [out.outputs[0].token_ids for out in outputs]
    bf16 = q7.load_qwen3(folder, device="cuda", dtype=torch.bfloat16)
    logits = bf16(torch.tensor([PROMPTS[2] + PROMPTS[0]], device="cuda")).float().cpu()
    assert ((logits - expected).norm() / expected.norm()).item() < 3e-2


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_decode_attention_at_scale(q7):
    """The bench's shape: batch 64, context 4,096, GQA 32/8, D=128, bf16, ragged rows (1 and
    4,096 among them), with the split rule's count and forced ones, against torch's SDPA in
    float32 on the same bf16 numbers."""
    B, Hq, Hkv, S, D = 64, 32, 8, 4096, 128
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    lengths = torch.randint(1, S + 1, (B,), device="cuda", dtype=torch.int32, generator=gen)
    lengths[:2] = torch.tensor([1, S])
    visible = torch.arange(S, device="cuda") < lengths[:, None]  # (B, S)
    expected = F.scaled_dot_product_attention(q.float()[:, :, None], k.float(), v.float(),
                                              attn_mask=visible[:, None, None],
                                              enable_gqa=True)[:, :, 0]  # (B, Hq, D)
    for splits in (None, 1, 7, 64):
        out = q7.decode_attention(q, k, v, lengths, num_splits=splits).float()
        assert ((out - expected).norm() / expected.norm()).item() < 1e-2, splits


@pytest.mark.gpu
def test_gpu_engine_v1_graph_equals_its_plain_loop(q7):
    """Engine v1's decode steps replayed from a CUDA graph give its plain loop's tokens exactly,
    greedy and seeded (bf16, the real head size, ragged prompts)."""
    model = small_cuda_model(q7, torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (20, 3, 17, 9)]
    for params in (q7.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                   q7.SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=24,
                                     ignore_eos=True)):
        graphed = q7.generate(model, prompts, params)
        assert graphed == q7.generate(model, prompts, params, cuda_graph_decode=False)
        assert all(len(row) == 24 for row in graphed)


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_graph_replay_equals_eager(q7):
    """A ModelRunner replaying DecodeGraphs against one running forward_packed eagerly, over
    twin pools: six sequences prefilled together (ragged, blocks out of order), then decode
    steps at batch 6 (bucket 8), 3 (bucket 4, a padded row) and 1 (matvec): bitwise equal
    logits and pools; and the engine's step no further from the model's torch path in float32
    than that path is in bf16."""
    model = small_cuda_model(q7, torch.bfloat16)
    runners = [q7.ModelRunner(model, 64, 16, 256, enforce_eager=eager) for eager in (False, True)]
    assert runners[0].graphs is not None and runners[1].graphs is None
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(64, generator=gen)[:6 * 4].view(6, 4).tolist()  # 4 blocks a sequence
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (20, 3, 17, 9, 33, 16)]
    for runner in runners:
        runner.run([(p, None, 0, t, 1) for p, t in zip(prompts, tables)])
    fp32 = copy.deepcopy(model).float().use_kernels(False)
    lengths = [len(p) for p in prompts]
    for batch, steps in ((6, 2), (3, 3), (1, 2)):
        for _ in range(steps):
            entries = [([prompts[b][0]], None, lengths[b], tables[b], 1) for b in range(batch)]
            graphed, eager = (runner.run(entries) for runner in runners)
            assert torch.equal(graphed, eager)
            for b in range(batch):
                prompts[b] = prompts[b] + [prompts[b][0]]
                lengths[b] += 1
    assert sorted(runners[0].graphs.graphs) == [1, 4, 8]
    for a, b in zip(runners[0].kv, runners[1].kv):
        assert torch.equal(a[:, :64], b[:, :64])  # (the scratch block differs: eager has no padding)
    ids = torch.tensor([prompts[0]], device="cuda")
    expected = fp32(ids)[0, -1].float()
    model.use_kernels(False)
    torch_bf16 = model(ids)[0, -1].float()
    model.use_kernels(True)
    errors = [((x - expected).norm() / expected.norm()).item() for x in (eager[0].float(), torch_bf16)]
    assert errors[0] < 1.5 * errors[1] + 1e-3, errors


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_engine_with_graphs_equals_enforce_eager(q7):
    """LLM.generate with CUDA graphs, with and without async scheduling, against enforce_eager
    on the same model: identical tokens and logprobs, greedy and seeded, over batches that fill
    a bucket and that do not."""
    model = small_cuda_model(q7, torch.bfloat16)
    prompts = [random_ids(n, vocab=1000, seed=n) for n in (5, 17, 9)]
    graphed = q7.LLM(model, max_num_seqs=3, num_kv_blocks=64, async_scheduling=False)
    overlapped = q7.LLM(model, max_num_seqs=3, num_kv_blocks=64, async_scheduling=True)
    eager = q7.LLM(model, max_num_seqs=3, num_kv_blocks=64, enforce_eager=True,
                   async_scheduling=False)
    for params in (q7.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
                   [q7.SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=12,
                                      ignore_eos=True, logprobs=0) for i in range(3)]):
        for batch in (prompts, prompts[:1]):
            rows = params if isinstance(params, q7.SamplingParams) else params[:len(batch)]
            theirs = eager.generate(batch, rows)
            for llm in (graphed, overlapped):
                ours = llm.generate(batch, rows)
                assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
                assert [o.outputs[0].logprobs for o in ours] == [o.outputs[0].logprobs for o in theirs]
    assert graphed.engine.runner.graphs is not None and eager.engine.runner.graphs is None


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_warm_up_leaves_nothing_for_the_first_requests(q7):
    """LLM() compiles, tunes and captures what its steps need: a graph per decode batch bucket
    before any request, and then prompts short and long, in chunks beside decodes, at every
    batch size, add no graph and no tuned kernel configuration."""
    model = small_cuda_model(q7, torch.bfloat16)
    kernels = (q7._paged_prefill_kernel, q7._decode_split_kernel, q7._matvec_kernel)
    llm = q7.LLM(model, max_num_seqs=5, num_kv_blocks=128, max_num_batched_tokens=300)
    graphs = llm.engine.runner.graphs.graphs
    assert sorted(graphs) == [1, 2, 4, 8] and llm.warm_up_seconds > 0
    tuned = [dict(kernel.cache) for kernel in kernels]
    prompts = [random_ids(n, vocab=1000, seed=n) for n in (5, 250, 17, 400, 2, 90, 140)]
    llm.generate(prompts, [q7.SamplingParams(max_tokens=1 + 9 * i, ignore_eos=True)
                           for i in range(len(prompts))])
    assert sorted(graphs) == [1, 2, 4, 8]
    assert [dict(kernel.cache) for kernel in kernels] == tuned


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ENGINE_SETTINGS)
@torch.no_grad()
def test_gpu_engine_outputs_equal_one_request_at_a_time(q7, hf_dir, setting):
    """The CPU test's requests and settings on the GPU, through the Triton kernels (the paged
    prefill and decode kernels, the fused step, CUDA graphs) in float32: every output equals
    transformers' greedy continuation of its prompt alone, and every block is free at the end."""
    hf, folder = hf_dir
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        prompts, max_tokens = mixed_requests(16, seed=5)
        llm = q7.LLM(folder, device="cuda", dtype=torch.float32, max_model_len=40, debug=True,
                     **ENGINE_SETTINGS[setting])
        assert llm.engine.runner.attention is q7.triton_attention
        params = [q7.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outputs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_all(hf, prompts, max_tokens)
        assert_all_free(llm.engine)
    finally:
        torch.set_float32_matmul_precision(precision)


@pytest.mark.gpu
def test_gpu_bench_engine_runs(q7, monkeypatch, capsys):
    """bench_engine end to end on a small shape: every column filled, rates positive, and the
    bandwidth below what the copy reached (it is a lower bound on bytes moved)."""
    monkeypatch.setattr(q7, "BENCH_MODELS", {"small": small_cuda_model(q7, torch.bfloat16).cfg})
    results = q7.bench_engine(torch.device("cuda"), batches=(1, 2), new_tokens=32, hf_tokens=4)
    out = capsys.readouterr().out
    assert "GPU ops a decode step on the model's path" in out
    for row in results.values():
        assert row["transformers"] > 0 and row["transformers_static"] > 0
        for mode in ("plain", "async"):
            assert row[mode]["tok_s"] > 0 and 0 < row[mode]["of_copy"] < 1.2
            assert 0 < row[mode]["gpu_us"] < row[mode]["step_us"] * 1.5


@pytest.mark.gpu
def test_gpu_bench_throughput_runs(q7, monkeypatch, capsys):
    """bench_throughput end to end on a small shape and few requests, transformers included:
    rates positive, prefix hits on the shared workload only, idle fractions in [0, 1)."""
    monkeypatch.setattr(q7, "BENCH_MODELS", {"Qwen3-0.6B": small_cuda_model(q7, torch.bfloat16).cfg})
    results = q7.bench_throughput(torch.device("cuda"), n=12, low=20, high=200, runs=1,
                                  baseline_requests=4,
                                  max_num_batched_tokens=256)  # admissions spread over steps
    out = capsys.readouterr().out
    assert "offline throughput" in out and "failed" not in out
    assert results["engine"]["output_tok_s"] > 0 and results["transformers"] > 0
    assert results["engine_subset"] > 0
    assert results["half of each prompt shared"]["prefix_hit_rate"] > 0
    assert results["the same, prefix caching off"]["prefix_hit_rate"] == 0
    assert all(0 <= results[f"idle_async_{m}"] < 1 for m in (True, False))
