"""Stage 03: load_gpt2 against transformers' GPT-2 (saved in the Hugging Face and the original
OpenAI layouts), generation against transformers' greedy search and brute-force top-k / top-p
sets, checkpoints bit for bit, the schedule against its formula, a short training run that has
to learn, the FLOP count, and the script end to end. All on the CPU, in seconds; one GPU test.

Tolerances: logits of size ~3 in float32 on both sides, rtol and atol 1e-4 (the CPU's BLAS sums
in its own order), and exactly (1e-10) in float64; sampling checks are exact (the distribution
generate() draws from, set membership) or statistical at 5 standard errors with a fixed seed.
"""
import copy
import dataclasses
import functools
import json
import math
import re
import shutil
import sys
import types

import pytest
import torch
from safetensors.torch import save_file

from conftest import learnable_tokens, load_stage, loaders, tiny_config, tiny_hf_gpt2

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def stage():
    return load_stage("03_train")


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_gpt2(seed=1)


@pytest.fixture(scope="module")
def hf_dir(hf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_gpt2")
    hf.save_pretrained(folder)  # config.json + model.safetensors, keys "transformer.h.0...."
    return folder


@pytest.fixture(scope="module")
def model(stage, hf_dir):
    return stage.load_gpt2(hf_dir)


def random_ids(shape, seed, vocab=97):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# -- chapter 9: GPT-2 weights from the Hugging Face layout -------------------------------------

@pytest.mark.parametrize("B, T", [(3, 37), (1, 40)])
@torch.no_grad()
def test_load_gpt2_matches_transformers(hf, model, B, T):
    ids = random_ids((B, T), seed=T)
    expected = hf(ids).logits
    assert expected.std() > 0.3
    # float32 sums in a CPU-dependent order: relative tolerance here, exactness in float64
    torch.testing.assert_close(model(ids), expected, rtol=1e-4, atol=1e-4)
    expected64 = copy.deepcopy(hf).double()(ids).logits
    torch.testing.assert_close(copy.deepcopy(model).double()(ids), expected64, rtol=0, atol=1e-10)


def write_hf_dir(folder, config, state):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def hf_files(hf, hf_dir):
    """config.json as a dict and the saved tensors (no lm_head: it is tied to wte)."""
    state = {k: v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    return json.loads((hf_dir / "config.json").read_text()), state


@torch.no_grad()
def test_load_gpt2_reads_the_original_openai_layout(stage, hf, hf_files, tmp_path):
    """openai-community/gpt2's own file: no "transformer." prefix, and each layer's causal mask
    saved as a (1, 1, P, P) buffer named attn.bias (plus attn.masked_bias in some copies)."""
    config, state = hf_files
    P = config["n_positions"]
    old = {k.removeprefix("transformer."): v for k, v in state.items()}
    for i in range(config["n_layer"]):
        old[f"h.{i}.attn.bias"] = torch.ones(P, P).tril().view(1, 1, P, P)
        old[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    loaded = stage.load_gpt2(write_hf_dir(tmp_path / "openai", config, old))
    ids = random_ids((2, 23), seed=8)
    torch.testing.assert_close(loaded(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)


def edit_config(key, value):
    return lambda config, state: ({**config, key: value}, state)


def edit_tensor(name, edit):
    """Replace tensor `name` by edit(tensor), or drop it where edit gives None."""
    def change(config, state):
        state = dict(state)
        new = edit(state.pop(name))
        return config, state if new is None else {**state, name: new.clone()}
    return change


@pytest.mark.parametrize("change, message", [
    (edit_config("n_positions", 50), r"'wpe\.weight' has shape \(40, 48\).*\(50, 48\)"),
    (edit_tensor("transformer.h.1.mlp.c_fc.bias", lambda t: t[:-1]), r"'h\.1\.mlp\.c_fc\.bias'"),
    (edit_tensor("transformer.h.0.ln_2.weight", lambda t: None), r"missing tensors \['h\.0\.ln_2"),
    (edit_config("activation_function", "relu"), "unsupported activation 'relu'"),
])
def test_load_gpt2_names_what_does_not_fit(stage, hf_files, tmp_path, change, message):
    config, state = change(*hf_files)
    with pytest.raises(stage.DataError, match=message):
        stage.load_gpt2(write_hf_dir(tmp_path / "bad", config, state))


def test_load_gpt2_missing_files(stage, hf_dir, tmp_path):
    with pytest.raises(stage.DataError, match="neither a GPT-2 size"):
        stage.load_gpt2(tmp_path / "nowhere")
    folder = tmp_path / "empty"
    folder.mkdir()
    with pytest.raises(stage.DataError, match=r"lacks config\.json and model\.safetensors"):
        stage.load_gpt2(folder)
    shutil.copy(hf_dir / "config.json", folder)
    with pytest.raises(stage.DataError, match=r"lacks model\.safetensors"):
        stage.load_gpt2(folder)


# -- chapter 8: generation ----------------------------------------------------------------------

def test_greedy_generate_matches_transformers(stage, hf, model):
    ids = random_ids((3, 9), seed=6)
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=25,
                           do_sample=False, pad_token_id=0)
    assert expected.shape == (3, 34)
    assert torch.equal(stage.generate(model, ids, 25, temperature=0.0), expected)


def test_greedy_generate_past_the_context_matches_generate_greedy(stage, model):
    ids = random_ids((2, 36), seed=7)  # 36 + 10 tokens > 40: both crop to the last 40
    assert torch.equal(stage.generate(model, ids, 10), stage.generate_greedy(model, ids, 10))


def test_generate_stops_at_eos(stage, model):
    """Two rows reach eos at different steps: the first keeps emitting eos until the second
    gets there, then generation stops early."""
    ids = random_ids((2, 7), seed=0)
    free = stage.generate(model, ids, 20)[:, 7:].tolist()  # greedy, no eos
    firsts = {}  # token -> first step at which each row emits it
    for token in set(free[0]) & set(free[1]):
        a, b = free[0].index(token), free[1].index(token)
        if a != b:
            firsts[token] = (a, b)
    eos = min(firsts, key=lambda t: max(firsts[t]))
    stop = max(firsts[eos]) + 1
    assert stop < 20
    expected = [row[:first + 1] + [eos] * (stop - first - 1)
                for row, first in zip(free, firsts[eos])]
    out = stage.generate(model, ids, 20, eos_id=eos)
    assert torch.equal(out[:, :7], ids) and out[:, 7:].tolist() == expected


def keep_top_k(row, k):
    """Indices of the k largest of a list of distinct floats."""
    return set(sorted(range(len(row)), key=lambda i: row[i], reverse=True)[:k])


def keep_top_p(row, p, among=None):
    """The smallest set of most likely indices (of `among`, default all) whose probability,
    a softmax over `among` in float64, reaches p."""
    order = sorted(among if among is not None else range(len(row)), key=lambda i: row[i],
                   reverse=True)
    weights = [math.exp(row[i] - row[order[0]]) for i in order]
    kept, mass = set(), 0.0
    for i, w in zip(order, weights):
        kept.add(i)
        mass += w / sum(weights)
        if mass >= p:
            break
    return kept


def allowed(row, top_k, top_p):
    kept = keep_top_k(row, top_k) if top_k else set(range(len(row)))
    return keep_top_p(row, top_p, kept) if top_p else kept


@pytest.mark.parametrize("top_k, top_p", [(5, None), (None, 0.7), (8, 0.6)])
@torch.no_grad()
def test_sampling_picks_only_allowed_tokens(stage, hf, model, top_k, top_p):
    ids = random_ids((4, 5), seed=9)
    temperature = 1.3
    out = stage.generate(model, ids, 15, temperature, top_k, top_p,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (4, 20)
    for t in range(5, 20):
        logits = (hf(out[:, :t]).logits[:, -1] / temperature).tolist()
        for b, row in enumerate(logits):
            assert out[b, t].item() in allowed(row, top_k, top_p), (b, t)


class FixedLogits(torch.nn.Module):
    """A stand-in model whose next-token logits are always `logits` (V,), whatever the input;
    with vocab_size < V, the logits from vocab_size on are a padded vocabulary's."""

    def __init__(self, logits, context_length=16, vocab_size=None):
        super().__init__()
        self.logits = logits
        self.cfg = types.SimpleNamespace(context_length=context_length,
                                         vocab_size=vocab_size or len(logits))

    def forward(self, idx):
        return self.logits.expand(*idx.shape, -1)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
@pytest.mark.parametrize("top_k, top_p", [(None, None), (5, None), (None, 0.6), (8, 0.6),
                                          (3, 0.95), (None, 0.999)])
def test_sampling_distribution_is_exact(stage, monkeypatch, temperature, top_k, top_p):
    """The distribution generate() draws from, caught at torch.multinomial, against the one
    written out here in float64: divide by the temperature first, then keep the top k, then the
    top-p nucleus of what is left, then renormalize. The order matters: the nucleus of the
    tempered distribution is not that of the untempered one."""
    row = (torch.randn(40, generator=torch.Generator().manual_seed(7)) * 2).tolist()
    drawn = []

    def multinomial(probs, n, generator=None):
        drawn.append(probs.double().clone())
        return probs.argmax(dim=-1, keepdim=True)

    monkeypatch.setattr(stage.torch, "multinomial", multinomial)
    stage.generate(FixedLogits(torch.tensor(row)), torch.zeros(1, 3, dtype=torch.long), 1,
                   temperature, top_k, top_p)
    tempered = [x / temperature for x in row]
    kept = keep_top_k(tempered, top_k) if top_k else set(range(len(row)))
    kept = keep_top_p(tempered, top_p, kept) if top_p else kept
    expected = torch.zeros(len(row), dtype=torch.float64)
    total = sum(math.exp(tempered[i]) for i in kept)
    for i in kept:
        expected[i] = math.exp(tempered[i]) / total
    assert len(drawn) == 1
    torch.testing.assert_close(drawn[0][0], expected, rtol=1e-5, atol=1e-7)


def test_generation_never_picks_a_padding_id(stage):
    """A padded vocabulary's extra logits are never picked, however large: greedy (generate and
    generate_greedy) takes the argmax of the real ids, sampling draws among them only."""
    real = torch.randn(40, generator=torch.Generator().manual_seed(8))
    model = FixedLogits(torch.cat([real, torch.full((24,), 100.0)]), vocab_size=40)
    prompt = torch.zeros(3, 2, dtype=torch.long)
    best = real.argmax().item()
    assert (stage.generate(model, prompt, 4)[:, 2:] == best).all()
    assert (stage.generate_greedy(model, prompt, 4)[:, 2:] == best).all()
    for top_k, top_p in [(None, None), (50, None), (None, 0.999)]:
        out = stage.generate(model, prompt[:1].expand(500, -1), 1, 5.0, top_k, top_p,
                             generator=torch.Generator().manual_seed(0))
        assert out[:, 2:].max() < 40 and len(out[:, 2:].unique()) > 10  # drawn among many


def test_sampling_is_reproducible(stage, model):
    ids = random_ids((3, 4), seed=10)

    def sample(seed):
        return stage.generate(model, ids, 12, 0.9, top_k=20, top_p=0.95,
                              generator=torch.Generator().manual_seed(seed))

    assert torch.equal(sample(1), sample(1)) and not torch.equal(sample(1), sample(2))
    greedy = stage.generate(model, ids, 12)
    assert torch.equal(stage.generate(model, ids, 12, 2.0, top_k=1), greedy)
    assert torch.equal(stage.generate(model, ids, 12, 2.0, top_p=1e-9), greedy)


@pytest.mark.parametrize("temperature, top_k", [(0.7, None), (1.5, 3)])
@torch.no_grad()
def test_sampling_follows_the_tempered_distribution(stage, hf, model, temperature, top_k):
    """One step for N copies of a prompt: token frequencies against softmax(logits / temperature)
    (renormalized over the top k), within 5 standard errors."""
    N = 4000
    prompt = random_ids((1, 6), seed=11)
    out = stage.generate(model, prompt.expand(N, -1), 1, temperature, top_k,
                         generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(out[:, -1], minlength=97).double()
    logits = hf(prompt).logits[0, -1].double() / temperature
    if top_k:
        logits[list(set(range(97)) - keep_top_k(logits.tolist(), top_k))] = float("-inf")
    p = logits.softmax(-1)
    assert (counts[p == 0] == 0).all()
    z = (counts / N - p).abs() / ((p * (1 - p) / N).sqrt() + 1e-12)
    assert z[p > 0].max() < 5


# -- filter_logits against brute force ----------------------------------------------------------

def random_logits(B, V, seed, scale=3.0):
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * scale
    assert all(len(set(row)) == V for row in logits.tolist())  # no ties: the sets are unique
    return logits


def assert_keeps(out, logits, kept_rows):
    for o, x, kept in zip(out, logits, kept_rows):
        mask = torch.zeros_like(o, dtype=torch.bool)
        mask[list(kept)] = True
        assert torch.equal(o[mask], x[mask]) and torch.isneginf(o[~mask]).all()


@pytest.mark.parametrize("B, V", [(1, 7), (4, 50), (3, 101)])
@pytest.mark.parametrize("k", [1, 5, "V", "V+3"])
def test_top_k_keeps_the_k_largest(stage, B, V, k):
    k = {"V": V, "V+3": V + 3}.get(k, k)
    logits = random_logits(B, V, seed=V)
    out = stage.filter_logits(logits, top_k=k)
    assert_keeps(out, logits, [keep_top_k(row, k) for row in logits.tolist()])


@pytest.mark.parametrize("B, V", [(1, 7), (4, 50), (3, 101)])
@pytest.mark.parametrize("p", [1e-9, 0.3, 0.75, 0.95])
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_top_p_keeps_the_smallest_prefix_reaching_p(stage, B, V, p, scale):
    logits = random_logits(B, V, seed=V + 1, scale=scale)
    out = stage.filter_logits(logits, top_p=p)
    kept = [keep_top_p(row, p) for row in logits.tolist()]
    if p < 1e-6:
        assert all(len(s) == 1 for s in kept)  # only the argmax
    assert_keeps(out, logits, kept)


@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_top_p_of_one_keeps_everything(stage, scale):
    logits = random_logits(4, 101, seed=12, scale=scale)
    assert torch.equal(stage.filter_logits(logits, top_p=1.0), logits)


@pytest.mark.parametrize("k, p", [(5, 0.5), (20, 0.9), (3, 1e-9)])
def test_top_k_then_top_p(stage, k, p):
    logits = random_logits(3, 61, seed=k)
    out = stage.filter_logits(logits, top_k=k, top_p=p)
    assert_keeps(out, logits, [allowed(row, k, p) for row in logits.tolist()])


@pytest.mark.parametrize("kwargs", [dict(top_k=0), dict(top_k=-2), dict(top_k=2.5),
                                    dict(top_p=0.0), dict(top_p=1.5), dict(top_p=-0.1)])
def test_filter_logits_rejects_bad_arguments(stage, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        stage.filter_logits(torch.zeros(2, 5), **kwargs)


def test_generate_rejects_negative_temperature(stage, model):
    with pytest.raises(ValueError, match="temperature"):
        stage.generate(model, random_ids((1, 3), seed=0), 2, temperature=-0.5)


# -- checkpoints --------------------------------------------------------------------------------

@pytest.fixture(params=["loaded GPT-2", "dropout, no biases, padded vocabulary"])
def any_model(request, stage, model):
    if request.param == "loaded GPT-2":
        return model
    torch.manual_seed(0)
    cfg = stage.GPTConfig(vocab_size=53, context_length=12, n_embd=24, n_head=2, n_layer=3,
                          dropout=0.1, bias=False, vocab_multiple=16)  # 64 rows
    return stage.GPT(cfg).eval()


@torch.no_grad()
def test_checkpoint_round_trip_is_exact(stage, any_model, tmp_path):
    path = tmp_path / "ckpt.safetensors"
    stage.save_checkpoint(any_model, path)
    loaded = stage.load_checkpoint(path).eval()
    assert loaded.cfg == any_model.cfg
    assert loaded.wte.weight.shape[0] == any_model.cfg.padded_vocab_size  # 97, or 64 padded
    before, after = any_model.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert loaded.lm_head.weight.data_ptr() == loaded.wte.weight.data_ptr()  # still tied
    ids = random_ids((2, 9), seed=13, vocab=any_model.cfg.vocab_size)
    assert torch.equal(loaded(ids), any_model(ids))


def test_load_checkpoint_errors(stage, model, tmp_path):
    with pytest.raises(stage.DataError, match="missing.safetensors: no such file"):
        stage.load_checkpoint(tmp_path / "missing.safetensors")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "bare.safetensors"))
    with pytest.raises(stage.DataError, match="metadata"):
        stage.load_checkpoint(tmp_path / "bare.safetensors")
    config = json.dumps({**dataclasses.asdict(model.cfg), "context_length": 41})
    save_file(state, str(tmp_path / "longer.safetensors"), metadata={"config": config})
    with pytest.raises(stage.DataError, match=r"'wpe\.weight'"):
        stage.load_checkpoint(tmp_path / "longer.safetensors")
    state["h.0.attn.c_attn.bias"] = state["h.0.attn.c_attn.bias"][:-2].clone()
    config = json.dumps(dataclasses.asdict(model.cfg))
    save_file(state, str(tmp_path / "short.safetensors"), metadata={"config": config})
    with pytest.raises(stage.DataError, match=r"'h\.0\.attn\.c_attn\.bias'"):
        stage.load_checkpoint(tmp_path / "short.safetensors")


# -- chapter 7: training ------------------------------------------------------------------------

def test_lr_schedule_points(stage):
    top, low = 3e-3, 3e-4  # min_lr_ratio 0.1 by default

    def lr(step, warmup=10, total=110):
        return stage.lr_at(step, top, warmup, total)

    assert lr(0) == pytest.approx(top / 10) and lr(4) == pytest.approx(top / 2)
    warmup = [lr(s) for s in range(10)]
    assert all(b - a == pytest.approx(top / 10) for a, b in zip(warmup, warmup[1:]))  # linear
    assert lr(9) == pytest.approx(top) and lr(10) == pytest.approx(top)  # the peak
    assert lr(35) == pytest.approx(low + (top - low) * (1 + math.cos(math.pi / 4)) / 2)
    assert lr(60) == pytest.approx((top + low) / 2)  # half way down the cosine
    assert lr(110) == pytest.approx(low) and lr(500) == pytest.approx(low)
    decay = [lr(s) for s in range(10, 111)]
    assert all(b <= a for a, b in zip(decay, decay[1:]))
    assert stage.lr_at(0, top, 0, 50) == pytest.approx(top)  # no warmup: start at the peak


def test_training_loss_falls(stage):
    torch.manual_seed(0)
    gpt = stage.GPT(tiny_config(stage))
    train_loader, val_loader = loaders(stage, learnable_tokens())
    assert len(train_loader) == 14
    lines = []
    tcfg = stage.TrainConfig(epochs=3, lr=1e-2, warmup_steps=5, eval_every=10)
    history = stage.train(gpt, train_loader, val_loader, tcfg, "cpu", log=lines.append)
    assert [h["step"] for h in history] == [0, 10, 20, 30, 40, 42] and len(lines) == len(history)
    assert history[0]["train_loss"] is None
    assert history[0]["val_loss"] == pytest.approx(math.log(31), abs=0.15)  # untrained: uniform
    assert history[-1]["train_loss"] < 0.4 * math.log(31)
    assert history[-1]["val_loss"] < 0.4 * math.log(31)


@pytest.mark.parametrize("T", [1, 16, 40])
def test_flops_per_token(stage, model, T):
    V, P, C, L = 97, 40, 48, 2
    state = model.state_dict()
    counted = sum(math.prod(t.shape) for name, t in state.items()
                  if name not in ("lm_head.weight", "wpe.weight"))  # tied head: once, as wte
    assert counted == V * C + L * (12 * C * C + 13 * C) + 2 * C
    assert stage.flops_per_token(model, T) == 6 * counted + 12 * L * C * T


# -- inherited code and the script -------------------------------------------------------------

def test_main_trains_saves_and_samples(stage, monkeypatch, capsys, tmp_path):
    """The training path on a one-layer model (the tiny preset takes minutes on a CPU), then
    sampling from the saved checkpoint, which must print what generate() gives for the seed."""
    monkeypatch.setitem(stage.TRAIN_PRESETS["tiny"], "model", dict(n_layer=1, n_head=2, n_embd=16))
    ckpt = str(tmp_path / "tiny.safetensors")
    common = ["--device", "cpu", "--max-new-tokens", "6"]
    monkeypatch.setattr(sys, "argv", ["03_train.py", "--epochs", "1", "--batch-size", "16",
                                      "--eval-every", "4", "--context-length", "32",
                                      "--save", ckpt, *common])
    stage.main()
    out = capsys.readouterr().out
    assert "step     9/9 | epoch 1" in out and f"saved {ckpt}" in out
    assert "\ngenerated (6 new tokens, greedy):\nEvery effort moves you" in out

    args = ["--load", ckpt, "--temperature", "0.8", "--top-k", "5", "--prompt", "Every effort"]
    monkeypatch.setattr(sys, "argv", ["03_train.py", *args, *common])
    stage.main()
    out = capsys.readouterr().out
    assert "generated (6 new tokens, temperature 0.8, top-k 5):" in out
    torch.manual_seed(123)  # main's default seed, set before it builds the model
    loaded = stage.load_checkpoint(ckpt).eval()
    tok = stage.gpt2_tokenizer()
    ids = stage.generate(loaded, torch.tensor([tok.encode("Every effort")]), 6, 0.8, 5,
                         eos_id=stage.EOT_ID)
    assert out.endswith(tok.decode(ids[0].tolist()) + "\n")


def test_bench_rows_start_from_the_same_weights(stage, monkeypatch, capsys):
    """--bench on the CPU at a tiny size, torch.compile on its aot_eager backend (the same
    tracing, no code generation): the plain model and the GPT, eager and compiled, each row from
    the same weights with the same batch, steps and optimizer, so their losses agree; each row's
    tokens/s is also given as a fraction of plain compiled's."""
    monkeypatch.setitem(stage.TRAIN_PRESETS["tiny"], "model", dict(n_layer=1, n_head=2, n_embd=16))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    first, kinds, make_optimizer = [], [], stage.make_optimizer

    def recording_make_optimizer(model, *args):  # each row's model as its training starts
        weights = [p.detach().clone() for p in model.parameters()]
        if not first:
            first.extend(weights)
        assert all(torch.equal(a, b) for a, b in zip(weights, first, strict=True))
        kinds.append({type(m).__name__ for m in model.modules()} & {"LayerNorm", "TorchLayerNorm"})
        return make_optimizer(model, *args)

    monkeypatch.setattr(stage, "make_optimizer", recording_make_optimizer)
    monkeypatch.setattr(sys, "argv", ["03_train.py", "--bench", "--bench-steps", "2",
                                      "--batch-size", "2", "--context-length", "16",
                                      "--device", "cpu"])
    stage.main()
    out = capsys.readouterr().out
    assert "GPT-2 tiny shape, B=2, T=16, 2 steps, fp32 on cpu" in out
    rows = re.findall(r"^(\w+ \w+) +[\d,]+ +n/a +([\d.]+) +([\d.]+)x$", out, re.MULTILINE)
    assert [mode for mode, _, _ in rows] == ["plain eager", "plain compiled", "GPT eager",
                                             "GPT compiled"], out
    assert kinds == [{"TorchLayerNorm"}] * 2 + [{"LayerNorm"}] * 2
    assert first[0].shape == (50304, 16)  # wte, padded as in training
    losses = [float(loss) for _, loss, _ in rows]
    assert max(losses) - min(losses) <= 0.0015, out
    assert rows[1][2] == "1.00"


def test_main_rejects_bad_flags(stage, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["03_train.py", "--model", "7B"])
    with pytest.raises(SystemExit):
        stage.main()


# -- on a GPU -----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_gpt_checks_ids_only_outside_training(stage):
    """In training mode on a GPU, GPT.forward and the loss read nothing back to the host (sync
    debug mode turns any such read into an error); in eval mode a bad id is still refused."""
    gpt = stage.GPT(tiny_config(stage)).cuda()
    ids = random_ids((4, 16), seed=15, vocab=31).cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with stage.autocast("cuda"):
            loss = stage.loss_fn(gpt(ids), ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert loss.isfinite()
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 31\)"):
        gpt.eval()(torch.full((1, 4), 31, device="cuda"))


@pytest.mark.gpu
def test_cuda_logits_and_bf16_training(stage, hf, hf_dir):
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # TF32 matmuls would be off by ~1e-3
    try:
        gpt2 = stage.load_gpt2(hf_dir, device="cuda")
        ids = random_ids((3, 37), seed=14).cuda()
        with torch.no_grad():
            expected = copy.deepcopy(hf).cuda()(ids).logits
            torch.testing.assert_close(gpt2(ids), expected, rtol=0, atol=1e-4)
            with stage.autocast("cuda"):
                assert gpt2(ids).dtype == torch.bfloat16
    finally:
        torch.set_float32_matmul_precision(precision)
    assert stage.make_optimizer(gpt2, 1e-3, 0.1, "cuda").defaults["fused"]

    torch.manual_seed(0)
    gpt = stage.GPT(tiny_config(stage)).cuda()
    train_loader, val_loader = loaders(stage, learnable_tokens())
    tcfg = stage.TrainConfig(epochs=2, lr=1e-2, warmup_steps=5, eval_every=7)
    history = stage.train(gpt, train_loader, val_loader, tcfg, torch.device("cuda"),
                          log=lambda line: None)
    assert history[-1]["step"] == 28
    assert history[-1]["train_loss"] < 0.7 * history[0]["val_loss"]
