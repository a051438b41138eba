"""Shared test plumbing, and the rules every stage's tests keep.

Stages are named `02_gpt.py`, which Python cannot import by name, so `load_stage` loads one by
path. Tests that need CUDA carry `@pytest.mark.gpu` and are skipped on machines without it. On
such machines Triton kernels run through its interpreter, which must be switched on before
triton is first imported.

The rules (a test that cannot fail on the bug it is for is a defect):
- A test compares with an independent reference: torch in float64, transformers, tiktoken, or
  arithmetic the test does itself; never the code under test, or a copy of it not proven equal.
- A kernel test reaches every code path of the kernel: each branch of its launch logic (fused
  and streamed rows, one and several row blocks per program, masked and whole chunks), and
  extreme inputs (logits of +-1e4 and -inf, rows of tiny variance), where a missing max
  subtraction or a misplaced eps shows.
- Every definition a stage inherits is checked in every stage that carries it: unchanged, by
  `test_carried_forward.py::test_inherited_definitions_are_copies`; changed, by tests that run
  that stage's version (listed in that file's CHANGED).
- Each stage's `main()` runs end to end, and the checks it prints are asserted, not just its
  exit status.
"""
import dataclasses
import functools
import importlib.util
import inspect
import os
import pathlib
import random
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def load_stage(name):
    """Import `ROOT/<name>.py` (e.g. "02_gpt") as a module, once per test session."""
    mod_name = "stage_" + name
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, ROOT / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[mod_name]


def check_bad_flag(stage, argv, message, forbidden, monkeypatch, capsys, tmp_path):
    """stage.main(argv) exits with status 2 and `message` (a regex) in stderr before any of the
    stage's `forbidden` functions runs. "FILE" in argv stands for the path of a file."""
    (tmp_path / "file").write_text("x")
    argv = [str(tmp_path / "file") if arg == "FILE" else arg for arg in argv]
    for name in forbidden:
        monkeypatch.setattr(stage, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran"))
    with pytest.raises(SystemExit) as exit_:
        stage.main(argv)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def check_main(name, min_errors, tol, *args, prompt="Every effort moves you", timeout=600):
    """Run `python <name>.py --device cpu *args` as a reader would, Triton kernels through the
    interpreter, and check what it printed: exit status 0; at least `min_errors` relative errors
    ("rel err 1.2e-07", "backward 4.1e-07", "relative error 2.9e-07"), each below `tol` (a
    printed nan fails); generated text after the prompt. Returns what it printed."""
    proc = subprocess.run([sys.executable, f"{name}.py", "--device", "cpu", "--prompt", prompt, *args],
                          cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                          text=True, timeout=timeout)
    out = proc.stdout
    assert proc.returncode == 0, f"{name}.py exited {proc.returncode}:\n{out}\n{proc.stderr[-5000:]}"
    number = r"([-+]?\d[\d.]*(?:e[-+]?\d+)?|nan|inf)"
    errors = [float(x) for x in re.findall(rf"(?:rel err|relative error|backward) {number}", out)]
    assert len(errors) >= min_errors and all(e < tol for e in errors), out
    assert prompt in out and out.rsplit(prompt, 1)[1].strip(), f"no generated text:\n{out}"
    return out


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Run a test on one CPU thread. Tiny models gain nothing from a second thread, and on a shared
    2-core machine a busy second core makes every op wait for it (10x slower, measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_cuda_model(stage, dtype):
    """Stage 07's or 08's random Qwen3 with the real head size (D=128) and a GQA group of 4, on
    the GPU, its weights ten times the bench's, so that the logits are not all ~0."""
    cfg = stage.Qwen3Config(vocab_size=1000, hidden_size=256, intermediate_size=640,
                            num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                            max_position_embeddings=512, tie_word_embeddings=False)
    model = stage.random_model(cfg, torch.device("cuda"), dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(10)
    return model


def public_names(cls):
    """A class's own public methods and properties, and its dataclass fields."""
    names = {name for name, value in vars(cls).items() if not name.startswith("_") and (
        inspect.isfunction(value) or isinstance(value, (property, staticmethod, classmethod)))}
    return names | {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) \
        else names


def tiny_hf_gpt2(seed=0, n_layer=2, n_head=3, n_embd=48, n_positions=40, vocab_size=97):
    """transformers' GPT2LMHeadModel, the reference GPT-2, on a tiny config of odd sizes with every
    weight random: eager attention, no dropout, no special tokens, in eval mode.

    Hugging Face's init leaves layer-norm gains at 1 and every bias at 0, so a loader that swapped
    or skipped them would still match; here they are random too. Weights are wider than GPT-2's
    init so that greedy decoding does not collapse onto one repeated token at once.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions,
                     vocab_size=vocab_size, activation_function="gelu_new", resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
                     attn_implementation="eager")
    model = GPT2LMHeadModel(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # the tied lm_head comes once, as wte
            noise = torch.randn(p.shape, generator=gen)
            if ".ln_" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif ".wte." in name or ".wpe." in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.2 * noise)
    return model


@functools.cache
def learnable_tokens():
    """2,000 tokens of a Markov chain over 31 ids: the next id is a fixed permutation of the
    current one 90% of the time, uniform otherwise (a floor of ~0.65 nats against ln 31 = 3.43)."""
    rng = random.Random(0)
    perm = list(range(31))
    rng.shuffle(perm)
    tokens = [0]
    for _ in range(1999):
        tokens.append(perm[tokens[-1]] if rng.random() > 0.1 else rng.randrange(31))
    return tokens


def tiny_config(stage, **overrides):
    """A two-layer GPTConfig over learnable_tokens()' 31 ids, for the training tests."""
    return stage.GPTConfig(**{"vocab_size": 31, "context_length": 16, "n_embd": 32, "n_head": 2,
                              "n_layer": 2, **overrides})


def loaders(stage, tokens):
    """Train and validation loaders over a 90/10 split, (8, 16) batches, shuffled with seed 0."""
    split = len(tokens) * 9 // 10
    return (stage.create_dataloader(tokens[:split], 8, 16, seed=0),
            stage.create_dataloader(tokens[split:], 8, 16, shuffle=False, drop_last=False))
