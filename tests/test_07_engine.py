"""Stage 07, part 1: Qwen3, the KV cache, the sampler and the v1 engine, on the CPU.

The references: transformers' Qwen3ForCausalLM (logits, greedy generate), built from tiny random
configs and saved in the Hugging Face layout to temporary directories; a full forward pass
without a cache (for the cached paths); float64 formulas written out here (kernels, sampling
filters, penalties); counts of many draws against exact probabilities (the sampler's draw).
Triton kernels run through the interpreter. Prompts are token ids, except where a small
byte-level BPE from the `tokenizers` library stands in for chapter 16's tokenizer.
"""
import argparse
import functools
import hashlib
import json
import math
import re
import subprocess
import sys

import pytest
import requests
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, ROOT, load_stage

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
    return q7.LLM(hf_dir[1], device="cpu", max_model_len=40, max_batch_size=4)


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


@pytest.mark.parametrize("shape, dtype, tol", [((3, 5, 32), torch.float32, 1e-6),  # rows in registers
                                               ((4, 1500), torch.float32, 1e-6),  # streamed rows
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
    assert [o.token_ids for o in kernels] == [o.token_ids for o in torch_path]


# ------------------------------------------------------------------------------ generation

@torch.no_grad()
def test_greedy_tokens_equal_transformers_generate(q7, hf_dir):
    """Four prompts through two static batches (max_batch_size 2) against transformers' greedy
    generate, one prompt at a time."""
    hf, folder = hf_dir
    llm = q7.LLM(folder, device="cpu", max_model_len=40, max_batch_size=2)
    prompts = [*PROMPTS, random_ids(1, seed=4)]
    outputs = llm.generate(prompts, q7.SamplingParams(temperature=0, max_tokens=12))
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                               do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.prompt_token_ids == prompt
        assert out.token_ids == expected and out.finish_reason == "length" and out.text is None
    assert len({tuple(out.token_ids) for out in outputs}) == 4


def test_generate_again_starts_clean(q7, llm):
    params = q7.SamplingParams(temperature=0, max_tokens=5)
    first = llm.generate(PROMPTS, params)
    llm.generate([PROMPTS[2]], params)
    again = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert not llm.engine.has_unfinished()


@torch.no_grad()
def test_logprobs_are_the_models(q7, hf_dir, llm):
    hf = hf_dir[0]
    params = q7.SamplingParams(temperature=0.9, seed=3, max_tokens=6, logprobs=3)
    out = llm.generate([PROMPTS[0], PROMPTS[1]], [params, q7.SamplingParams(max_tokens=2)])
    assert out[1].logprobs is None
    prompt, got = PROMPTS[0], out[0]
    logp = hf(torch.tensor([prompt + got.token_ids])).logits[0, len(prompt) - 1:-1].double().log_softmax(-1)
    assert len(got.logprobs) == 6
    for step, (token, entry) in enumerate(zip(got.token_ids, got.logprobs)):
        top = logp[step].topk(3)
        assert set(entry) == {token, *top.indices.tolist()}
        for token_id, value in entry.items():
            assert abs(value - logp[step, token_id].item()) < 1e-4


class BPETokenizer:
    """Chapter 16's interface over a small byte-level BPE trained with `tokenizers` on one
    sentence: 32 ids, fewer than the model's 131 (the ids past them decode to nothing)."""

    def __init__(self):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        self.tok = Tokenizer(models.BPE())
        self.tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<|endoftext|>"])
        self.tok.train_from_iterator(["the cat sat on the mat, the dog sat on the log"] * 5, trainer)
        self.eos_token_ids = set()

    def encode(self, text):
        return self.tok.encode(text).ids

    def decode(self, ids):
        return self.tok.decode(ids)


class SpelledIds:
    """A tokenizer that knows every id: decode spells the ids out."""

    def __init__(self, eos_token_ids):
        self.eos_token_ids = set(eos_token_ids)

    def encode(self, text):
        return [int(word) for word in text.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_finish_reasons_and_text(q7, hf_dir):
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    greedy = q7.SamplingParams(temperature=0, max_tokens=10)
    tokens = q7.LLM(model, max_model_len=40).generate(PROMPTS[0], greedy)[0].token_ids
    stop = tokens[3]
    first = tokens.index(stop)
    spelled = SpelledIds(eos_token_ids=[stop])
    llm = q7.LLM(model, tokenizer=spelled, max_model_len=40)
    out = llm.generate([PROMPTS[0]], greedy)[0]  # the eos id ends it, and is not in the text
    assert (out.token_ids, out.finish_reason) == (tokens[:first + 1], "stop")
    assert out.text == spelled.decode(tokens[:first])
    out = llm.generate([PROMPTS[0]], q7.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert (out.token_ids, out.finish_reason, out.text) == (tokens, "length", spelled.decode(tokens))
    other = tokens[5] if tokens[5] != stop else tokens[6]
    out = q7.LLM(model, tokenizer=SpelledIds([]), max_model_len=40).generate(  # a stop id
        [PROMPTS[0]], q7.SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[other]))[0]
    end = tokens.index(other)
    assert (out.token_ids, out.finish_reason, out.text) == (tokens[:end + 1], "stop", spelled.decode(tokens[:end]))
    tokenizer = BPETokenizer()
    llm = q7.LLM(model, tokenizer=tokenizer, max_model_len=40)
    out = llm.generate("the cat sat", q7.SamplingParams(max_tokens=None, seed=1))[0]
    assert out.prompt_token_ids == tokenizer.encode("the cat sat")
    assert len(out.prompt_token_ids) + len(out.token_ids) == 40 and out.finish_reason == "length"
    assert out.text == tokenizer.decode(out.token_ids)


def test_eos_ids_come_from_the_config_files(q7, hf_dir, tmp_path):
    tokens = q7.LLM(hf_dir[1], device="cpu", max_model_len=40).generate(
        [PROMPTS[1]], q7.SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    folder = save_hf(hf_dir[0], tmp_path)
    write_config(folder, eos_token_id=tokens[4])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokens[2], 130]}))
    assert q7.config_eos_token_ids(folder) == {tokens[4], tokens[2], 130}
    out = q7.LLM(folder, device="cpu", max_model_len=40).generate(
        [PROMPTS[1]], q7.SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.token_ids == tokens[:min(tokens.index(tokens[2]), tokens.index(tokens[4])) + 1]


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
    prompts = [[1, 2], [3], [0, 4, 4]]
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


def test_a_seed_gives_the_same_tokens_in_any_batch(q7, llm):
    P = q7.SamplingParams
    seeded = P(temperature=1.0, top_p=0.9, seed=7, max_tokens=10)
    alone = llm.generate([PROMPTS[0]], seeded)[0].token_ids
    crowd = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[0]],
                         [P(temperature=1.0, max_tokens=12), seeded, P(temperature=0, max_tokens=3),
                          P(temperature=0.7, seed=8, top_k=20, max_tokens=10), seeded])
    assert crowd[1].token_ids == alone == crowd[4].token_ids  # two batches: 4 rows, then 1
    assert crowd[3].token_ids != alone  # another seed, another sample
    assert llm.generate([PROMPTS[0]], seeded)[0].token_ids == alone


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
    ("regex", 3, "must be a string"), ("choice", [], "must be a non-empty list of strings"),
    ("choice", ["a", 1], "list of strings"), ("json_schema", [1], "must be a dict"),
    ("json_schema", "{not json", "is not JSON"), ("json_schema", "[1]", "must be a dict"),
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
        ([[1]], P(regex="[ab]+"), NotImplementedError, "SamplingParams.regex: structured output"),
        ([[1]], P(json_schema={"type": "object"}), NotImplementedError, "json_schema"),
    ]


def test_bad_generate_calls_fail_before_any_work(q7, llm, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the engine ran before the bad input was reported")

    monkeypatch.setattr(llm.engine.runner, "run", no_work)
    for prompts, params, error, message in bad_generate_calls(q7):
        with pytest.raises(error, match=message):
            llm.generate(prompts, params)


def test_bad_llm_arguments(q7, hf_dir):
    model = q7.load_qwen3(hf_dir[1], device="cpu")
    with pytest.raises(ValueError, match="max_model_len = 65 must be an int from 2 to the model's "
                                         "max_position_embeddings, 64"):
        q7.LLM(model, max_model_len=65)
    with pytest.raises(ValueError, match="max_batch_size = 0 must be a positive int"):
        q7.LLM(model, max_batch_size=0)
    with pytest.raises(ValueError, match="a built Qwen3 is used as it is"):
        q7.LLM(model, device="cpu")
    with pytest.raises(TypeError, match="model must be a directory, a Hub id or a Qwen3"):
        q7.LLM(3)
    with pytest.raises(TypeError, match=r"tokenizer lacks \['decode', 'eos_token_ids'\]"):
        q7.LLM(model, tokenizer=type("T", (), {"encode": None})())
    with pytest.raises(ValueError, match="dtype torch.int8 is not supported"):
        q7.LLM(hf_dir[1], device="cpu", dtype=torch.int8)


# ----------------------------------------------------------------- structured output's hook

class EvenTokens:
    """A stand-in automaton: even ids only, done after three tokens."""

    def __init__(self):
        self.seen = []

    def allowed_tokens(self, vocab_size, device):
        return torch.arange(vocab_size, device=device) % 2 == 0

    def advance(self, token):
        self.seen.append(token)

    def is_done(self):
        return len(self.seen) == 3


def test_structured_output_plugs_in(q7, llm, monkeypatch):
    """The hook's route through the engine, with a stand-in automaton where the real one will
    be: masks applied, every token fed to it, the request ended when it is done."""
    automata = []

    def compile_constraint(params, tokenizer):
        if params.regex is None:
            return None
        automata.append(EvenTokens())
        return automata[-1]

    monkeypatch.setattr(q7, "compile_constraint", compile_constraint)
    P = q7.SamplingParams
    out = llm.generate(PROMPTS, [P(regex="x", max_tokens=8, seed=1), P(temperature=0, max_tokens=8),
                                 P(regex="x", temperature=0, max_tokens=8)])
    for i in (0, 2):
        assert all(t % 2 == 0 for t in out[i].token_ids) and out[i].finish_reason == "stop"
        assert len(out[i].token_ids) == 3
    assert [a.seen for a in automata] == [out[0].token_ids, out[2].token_ids]
    assert any(t % 2 for t in out[1].token_ids) and len(out[1].token_ids) == 8  # unconstrained


# ----------------------------------------------------------------------------------- main()

def run_main(q7, capsys, *argv):
    q7.main(list(argv))
    return capsys.readouterr().out


def test_main_on_a_tiny_random_model(q7, capsys):
    out = run_main(q7, capsys, "--device", "cpu", "--max-tokens", "5", "--batch-size", "3")
    diff = re.search(r"vs full recomputation: greedy tokens identical, logprobs max abs diff (\S+)", out)
    assert diff and float(diff[1]) < 1e-4, out
    if HAS_CUDA:  # --device cpu without the interpreter: the kernels cannot run there
        assert "(Triton kernels not checked: that needs a GPU" in out
    else:
        err = re.search(r"Triton kernels \(Triton's interpreter\) vs the torch path: rel err (\S+)", out)
        assert err and float(err[1]) < 1e-5, out
    assert "greedy, 3 prompts in one batch (identical to one by one)" in out
    assert "the first drawn alone: identical" in out
    lines = re.findall(r"^  \[[\d, ]+\] -> \[([\d, ]+)\] \(length\)$", out, re.MULTILINE)
    assert len(lines) == 6 and all(len(line.split(", ")) == 5 for line in lines), out
    speed = re.search(r"engine v1 on cpu: ([\d,]+) tokens/s \(3 sequences x 5 tokens", out)
    assert speed and int(speed[1].replace(",", "")) > 0, out


def test_main_with_a_model_directory(q7, hf_dir, capsys):
    out = run_main(q7, capsys, "--model", str(hf_dir[1]), "--device", "cpu", "--max-tokens", "3",
                   "--batch-size", "2", "--top-k", "5")
    assert f"Qwen3 from {hf_dir[1]}: 2 layers, C=48, 4/2 heads of 32, V=131" in out
    diff = re.search(r"greedy tokens identical, logprobs max abs diff (\S+)", out)
    assert diff and float(diff[1]) < 1e-4, out
    assert "(Triton kernels not checked: that needs a GPU, or on a CPU Triton's interpreter and " \
           "the built-in tiny model)" in out
    assert "top-k 5" in out


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
]


@pytest.mark.parametrize("argv, message", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_a_bad_flag_stops_main_before_any_work(q7, monkeypatch, capsys, tmp_path, argv, message):
    (tmp_path / "file").write_text("x")
    argv = [str(tmp_path / "file") if arg == "FILE" else arg for arg in argv]
    for name in ("LLM", "random_checkpoint", "download_model"):
        monkeypatch.setattr(q7, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran"))
    with pytest.raises(SystemExit) as exit_:
        q7.main(argv)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_main_asks_for_cuda_without_a_gpu(q7, capsys):
    with pytest.raises(SystemExit):
        q7.main(["--device", "cuda"])
    assert "this machine has no CUDA GPU" in capsys.readouterr().err


def test_every_flag_has_help(q7, monkeypatch):
    flags = []
    original = argparse._ActionsContainer.add_argument

    def record(parser, *args, **kwargs):
        flags.append((args[0], kwargs.get("help")))
        return original(parser, *args, **kwargs)

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", record)
    with pytest.raises(SystemExit):
        q7.main(["--help"])
    assert len(flags) > 5 and [flag for flag, text in flags if not text and flag != "-h"] == []
    assert sys.argv  # untouched: main took its own argv


def test_the_script_reports_a_bad_model_in_one_line(tmp_path):
    """Run as a script, a DataError is one line on stderr and exit status 1, not a traceback."""
    (tmp_path / "config.json").write_text('{"vocab_size": ')
    result = subprocess.run([sys.executable, str(ROOT / "07_engine.py"), "--model", str(tmp_path),
                             "--device", "cpu"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {tmp_path / 'config.json'}: not a readable JSON config")


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
        ids = torch.tensor([prompt])
        reference = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == reference
    bf16 = q7.load_qwen3(folder, device="cuda", dtype=torch.bfloat16)
    logits = bf16(torch.tensor([PROMPTS[2] + PROMPTS[0]], device="cuda")).float().cpu()
    assert ((logits - expected).norm() / expected.norm()).item() < 3e-2
