"""Code that stages 03-06 all carry (the command line, the data files, the loaders), tested the
same way in every stage that has it: a copy that drifts or breaks fails here under its own name.

Everything runs on the CPU in seconds: no test here trains, and the work a bad flag must never
reach (downloads, training) is replaced by a function that fails the test if it is called.
"""
import re
import subprocess
import sys

import pytest
import requests
import torch
from safetensors.torch import save_file

from conftest import ROOT, load_stage

STAGES = ["03_train", "04_cuda_kernels", "05_triton", "06_flash_attention"]


@pytest.fixture(params=STAGES)
def stage(request):
    return load_stage(request.param)


def run_main(stage, monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", [f"{stage.__name__}.py", *argv])
    return stage.main()


def forbid(monkeypatch, stage, *names):
    """Make each named function of the stage fail the test if anything calls it."""
    for name in names:
        def called(*args, _name=name, **kwargs):
            raise AssertionError(f"{_name} ran before a bad flag was reported")
        monkeypatch.setattr(stage, name, called)


def train_flag(stage):
    """Stage 03 trains by default; from 04 on, training is asked for with --train."""
    return [] if stage.__name__.endswith("03_train") else ["--train"]


BAD_FLAGS = [  # (argv, what the error says); "TRAIN" stands for --train where a stage needs it
    (["TRAIN", "--save", "/nonexistent/dir/m.safetensors"], "directory /nonexistent/dir does not"),
    (["TRAIN", "--save", "TMP"], "is a directory"),
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "   "], "--prompt is empty"),
    (["TRAIN", "--epochs", "0"], "--epochs: must be a positive integer, got 0"),
    (["TRAIN", "--batch-size", "0"], "--batch-size: must be a positive integer"),
    (["TRAIN", "--context-length", "-4"], "--context-length: must be a positive integer"),
    (["TRAIN", "--lr", "0"], "--lr: must be a positive number"),
    (["TRAIN", "--lr", "nan"], "--lr: must be a positive number"),
    (["--max-new-tokens", "-3"], "--max-new-tokens: must be a positive integer"),
    (["--temperature", "-1"], "--temperature: must be a number >= 0"),
    (["--top-k", "0"], "--top-k: must be a positive integer"),
    (["--top-p", "1.5"], r"--top-p: must be in \(0, 1\]"),
    (["--gpt2", "124M", "--load", "x.safetensors"], "not allowed with argument"),
    (["--gpt2", "124M", "TRAIN", "--epochs", "2"], "--epochs only applies|--train trains a new"),
    (["--bench-steps", "5"], "--bench-steps only applies to --bench"),
    (["--data-dir", "FILE"], "is a file, not a directory"),
    (["--load", "/nonexistent/m.safetensors"], "no such file"),
    (["--gpt2-dir", "/nonexistent"], "no such directory"),
    (["--device", "tpu9"], "--device tpu9"),
]


@pytest.mark.parametrize("argv, message", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_a_bad_flag_stops_the_run_before_any_work(stage, monkeypatch, capsys, tmp_path, argv,
                                                   message):
    (tmp_path / "file").write_text("x")
    subs = {"TRAIN": train_flag(stage), "TMP": [str(tmp_path)], "FILE": [str(tmp_path / "file")]}
    argv = [word for arg in argv for word in subs.get(arg, [arg])]
    forbid(monkeypatch, stage, "fetch", "train", "load_gpt2", "load_checkpoint")
    with pytest.raises(SystemExit) as exit_:
        run_main(stage, monkeypatch, *argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_asking_for_cuda_without_a_gpu(stage, monkeypatch, capsys):
    forbid(monkeypatch, stage, "fetch", "train")
    with pytest.raises(SystemExit):
        run_main(stage, monkeypatch, "--device", "cuda")
    assert "this machine has no CUDA GPU" in capsys.readouterr().err


def test_a_prompt_longer_than_the_context_stops_before_training(stage, monkeypatch, capsys):
    forbid(monkeypatch, stage, "train")
    monkeypatch.setattr(stage, "demo_triton", lambda device: None, raising=False)
    monkeypatch.setattr(stage, "kernel_chapter", lambda: True, raising=False)
    with pytest.raises(SystemExit, match="the prompt is 12 tokens, longer than the model's "
                                         "context of 8"):
        run_main(stage, monkeypatch, *train_flag(stage), "--context-length", "8",
                 "--prompt", "one two three four five six seven eight nine ten eleven twelve")


def test_offline_the_error_names_every_missing_file(stage, monkeypatch, tmp_path):
    """No network: one message lists each file the run needs, its URL and where it goes, and
    nothing is left behind in the cache."""
    def no_network(*args, **kwargs):
        raise requests.ConnectionError("no route to host")

    monkeypatch.setattr(stage.requests, "get", no_network)
    forbid(monkeypatch, stage, "train")
    with pytest.raises(stage.DataError) as err:
        run_main(stage, monkeypatch, "--gpt2", "124M", "--data-dir", str(tmp_path))
    message = str(err.value)
    assert message.startswith("3 file(s) this run needs cannot be had")
    for path, url in [("gpt2.tiktoken", "r50k_base.tiktoken"),
                      ("gpt2-124M/config.json", "openai-community/gpt2/resolve/main/config.json"),
                      ("gpt2-124M/model.safetensors", "gpt2/resolve/main/model.safetensors")]:
        assert str(tmp_path / path) in message and url in message
    assert message.count("no network") == 3
    assert list(tmp_path.iterdir()) == []  # no empty gpt2-124M/ left behind


@pytest.fixture
def checkpoint(stage, tmp_path):
    torch.manual_seed(0)
    model = stage.GPT(stage.GPTConfig(vocab_size=50, context_length=8, n_embd=16, n_head=2,
                                      n_layer=1))
    path = tmp_path / "good.safetensors"
    stage.save_checkpoint(model, path)
    return path


def broken_copies(good, folder):
    """name -> (path of a broken copy of the checkpoint `good`, what the error must say)."""
    data = good.read_bytes()
    state = {"wte.weight": torch.zeros(2, 2)}
    cases = {
        "empty": (b"", "not a readable safetensors file"),
        "truncated": (data[:len(data) // 2], "not a readable safetensors file"),
        "text": (b"these are not the weights you are looking for\n" * 8,
                 "not a readable safetensors file"),
    }
    out = {}
    for name, (content, message) in cases.items():
        (folder / name).write_bytes(content)
        out[name] = (folder / name, message)
    for name, config, message in [("bad_json", "{n_embd: 16", "not JSON"),
                                  ("unknown_key", '{"n_embd": 16, "width": 3}', "width"),
                                  ("bad_value", '{"n_embd": 15, "n_head": 2}', "GPTConfig")]:
        save_file(state, str(folder / name), metadata={"config": config})
        out[name] = (folder / name, message)
    return out


def test_a_broken_checkpoint_is_named(stage, checkpoint, tmp_path):
    for name, (path, message) in broken_copies(checkpoint, tmp_path).items():
        with pytest.raises(stage.DataError, match=message) as err:
            stage.load_checkpoint(path)
        assert str(path) in str(err.value), name


@pytest.mark.parametrize("config, message", [
    ('{"n_embd": 48,', "not a readable JSON config"),
    ("[1, 2]", "expected a JSON object"),
    ('{"vocab_size": 97, "n_positions": 40, "n_head": 3, "n_layer": 2}', r"lacks \['n_embd'\]"),
    ('{"vocab_size": 97, "n_positions": 40, "n_embd": 47, "n_head": 3, "n_layer": 2}',
     "bad GPTConfig"),
])
def test_a_broken_hf_config_is_named(stage, tmp_path, config, message):
    (tmp_path / "config.json").write_text(config)
    save_file({"wte.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(stage.DataError, match=message) as err:
        stage.load_gpt2(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


@pytest.mark.parametrize("field, value", [("epochs", 0), ("lr", 0.0), ("lr", -1e-3),
                                          ("eval_every", 0), ("warmup_steps", -1),
                                          ("grad_clip", 0.0), ("weight_decay", -0.1)])
def test_train_config_names_the_bad_field(stage, field, value):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{field} = {value!r} is out of range"):
        stage.TrainConfig(**{field: value})


def test_the_script_reports_a_bad_file_in_one_line(tmp_path):
    """Run as a script, a DataError is one line on stderr and exit status 1, not a traceback."""
    (tmp_path / "m.safetensors").write_bytes(b"\0" * 100)
    result = subprocess.run([sys.executable, str(ROOT / "03_train.py"), "--load",
                             str(tmp_path / "m.safetensors")], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {tmp_path / 'm.safetensors'}: not a readable safetensors")
