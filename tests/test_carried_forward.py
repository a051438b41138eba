"""Code that stages 03-06 all carry, and how this suite makes sure every copy is tested.

The rule (stages 07-10 follow it too): every definition a stage inherits is checked in every
stage that carries it, one of two ways.
- Unchanged: `test_inherited_definitions_are_copies` proves its text equals the previous
  stage's, so the tests of the stage that wrote it cover every later copy.
- Changed (CHANGED below names it, with the tests that check the new version): those tests run
  against this stage's own copy, usually by parametrizing over STAGES as the tests here do.

The command line, the data files, the loaders and the training loop are tested here in every
stage. Everything runs on the CPU in seconds; the work a bad flag must never reach (downloads,
training) is replaced by a function that fails the test if it is called.
"""
import argparse
import ast
import copy
import re
import subprocess
import sys

import pytest
import requests
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from conftest import ROOT, learnable_tokens, load_stage, loaders, tiny_config, tiny_hf_gpt2

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
    (["--bench-steps", "5"], "--bench-steps only applies to --bench|unrecognized arguments"),
    (["--train", "--bench"], "--train does not apply to --bench|unrecognized arguments|--train"),
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


def test_main_trains_saves_and_generates(stage, monkeypatch, capsys, tmp_path):
    """The training path of each stage's main() on a one-layer model, torch kernels (the Triton
    ones have their own training tests): it trains, saves a checkpoint that loads, generates."""
    monkeypatch.setitem(stage.TRAIN_PRESETS["tiny"], "model", dict(n_layer=1, n_head=2, n_embd=16))
    for demo in ("kernel_chapter", "demo_triton", "attention_chapter"):  # their own tests run them
        monkeypatch.setattr(stage, demo, lambda *args: True, raising=False)
    fast = {"05_triton": ["--kernels", "torch"],
            "06_flash_attention": ["--kernels", "torch", "--attention", "naive"]}
    ckpt = tmp_path / "m.safetensors"
    run_main(stage, monkeypatch, *train_flag(stage), *fast.get(stage.__name__[6:], []),
             "--epochs", "1", "--batch-size", "16", "--context-length", "32", "--save", str(ckpt),
             "--max-new-tokens", "3", "--device", "cpu")
    out = capsys.readouterr().out
    assert "step     9/9 | epoch 1" in out and f"saved {ckpt}" in out, out
    assert "\ngenerated (3 new tokens, greedy):\nEvery effort moves you" in out
    loaded = stage.load_checkpoint(ckpt)
    assert (loaded.cfg.n_layer, loaded.cfg.n_embd, loaded.cfg.context_length) == (1, 16, 32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_asking_for_cuda_without_a_gpu(stage, monkeypatch, capsys):
    forbid(monkeypatch, stage, "fetch", "train")
    with pytest.raises(SystemExit):
        run_main(stage, monkeypatch, "--device", "cuda")
    assert "this machine has no CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["01_tensors", "02_gpt", *STAGES, "07_engine", "08_serve",
                                  "09_quant_lora"])
def test_every_flag_has_help(name, monkeypatch, capsys):
    """`--help` of every stage says what each flag does."""
    stage, flags = load_stage(name), []
    original = argparse._ActionsContainer.add_argument  # parsers and their groups

    def record(parser, *args, **kwargs):
        flags.append((args[0], kwargs.get("help")))
        return original(parser, *args, **kwargs)

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", record)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    with pytest.raises(SystemExit):
        stage.main(["--help"]) if name == "01_tensors" else stage.main()
    assert len(flags) > 2 and [flag for flag, text in flags if not text and flag != "-h"] == []


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


# -- every inherited definition is a copy, or a change with its own tests ----------------------

CHAIN = ["02_gpt", "03_train", "04_cuda_kernels", "05_triton", "06_flash_attention", "07_engine",
         "08_serve"]
# (stage, the stage it starts from): each of CHAIN from the one before; 09 from 07, not 08 (08's
# server is a stage of its own, 09 carries 07's slim core)
PAIRS = [*zip(CHAIN, CHAIN[1:]), ("07_engine", "09_quant_lora")]
# stage -> {name: tests (file::function) that check that stage's changed version}
CHANGED = {
    "03_train": {
        "main": ["test_03_train.py::test_main_trains_saves_and_samples"],
        # a padded vocabulary; the range check off the training hot path on a GPU
        "GPTConfig": ["test_carried_forward.py::test_padded_vocabulary",
                      "test_03_train.py::test_checkpoint_round_trip_is_exact"],
        "GPT": ["test_carried_forward.py::test_padded_vocabulary",
                "test_carried_forward.py::test_out_of_range_ids_are_refused",
                "test_carried_forward.py::test_each_stages_gpt_matches_transformers",
                "test_03_train.py::test_gpu_gpt_checks_ids_only_outside_training"],
        "generate_greedy": [
            "test_03_train.py::test_generation_never_picks_a_padding_id",
            "test_03_train.py::test_greedy_generate_past_the_context_matches_generate_greedy"],
    },
    "04_cuda_kernels": {
        name: ["test_carried_forward.py::test_a_bad_flag_stops_the_run_before_any_work",
               "test_carried_forward.py::test_main_trains_saves_and_generates",
               "test_04_cuda_kernels.py::test_script_runs_without_a_gpu"]
        for name in ("main", "parse_args", "check_args", "TRAINING_FLAGS", "train_model")},
    "05_triton": {
        **{name: ["test_carried_forward.py::test_a_bad_flag_stops_the_run_before_any_work",
                  "test_carried_forward.py::test_main_trains_saves_and_generates",
                  "test_05_triton.py::test_main_on_the_cpu"]
           for name in ("main", "parse_args", "check_args", "compare_on_kernels", "train_model")},
        # stage 04's CUDA kernels, redone in Triton under the same names
        "vector_add": ["test_05_triton.py::test_vector_add"],
        "softmax": ["test_05_triton.py::test_softmax"],
        "layer_norm": ["test_05_triton.py::test_layer_norm"],
        "gelu": ["test_05_triton.py::test_gelu"],
        "evaluate": ["test_carried_forward.py::test_evaluate_is_the_mean_cross_entropy"],
        "train": ["test_carried_forward.py::test_train_steps_like_a_plain_adamw_loop",
                  "test_carried_forward.py::test_out_of_range_ids_are_refused"],
        "bench_kernels": ["GPU only: run by --bench"],
    },
    "06_flash_attention": {
        **{name: ["test_carried_forward.py::test_a_bad_flag_stops_the_run_before_any_work",
                  "test_carried_forward.py::test_main_trains_saves_and_generates",
                  "test_06_flash_attention.py::test_main_on_the_cpu"]
           for name in ("main", "parse_args", "check_args", "compare_on_kernels", "train_model")},
        # skips its range check while a CUDA graph is captured
        "cross_entropy": ["test_06_flash_attention.py::test_gpt_and_loss_still_check_ranges",
                          "test_06_flash_attention.py::test_gpu_cuda_graph_step_matches_launched_steps",
                          "test_05_triton.py::test_cross_entropy_extreme_logits"],
        "make_optimizer": ["test_carried_forward.py::test_optimizer_decays_matrices_only"],
        # autocast's casts inside the autograd function: gradients in the inputs' dtypes
        "matmul": ["test_06_flash_attention.py::test_matmul_under_autocast_keeps_gradient_dtypes"],
        # and, after a GELU epilogue, the bias gradient summed in the GELU backward's pass
        "_Matmul": ["test_06_flash_attention.py::test_matmul_under_autocast_keeps_gradient_dtypes",
                    "test_06_flash_attention.py::test_gelu_backward_sums_the_bias_gradient",
                    "test_06_flash_attention.py::test_matmul_gelu_bias_gradient"],
        "bench": ["GPU only: run by --bench"],
        # the residual add fused into the norm after it (add_layer_norm, TritonGPT)
        **{name: ["test_06_flash_attention.py::test_add_layer_norm",
                  "test_06_flash_attention.py::test_triton_gpt_fuses_the_residual_adds"]
           for name in ("_norm_fwd_kernel", "_norm_bwd_kernel", "_Norm", "TritonLayerNorm",
                        "use_triton_kernels")},
    },
    "07_engine": {
        **{name: ["test_07_engine.py::test_main_on_a_tiny_random_model",
                  "test_07_engine.py::test_a_bad_flag_stops_main_before_any_work"]
           for name in ("main", "parse_args", "check_args")},
        # Qwen3's MLP and block, which share only their names with GPT-2's
        "MLP": ["test_07_engine.py::test_logits_match_transformers"],
        "Block": ["test_07_engine.py::test_logits_match_transformers"],
        # forward only
        "rms_norm": ["test_07_engine.py::test_rms_norm_kernel"],
        "swiglu": ["test_07_engine.py::test_swiglu_kernel"],
        "flash_attention": ["test_07_engine.py::test_flash_attention_forward"],
        # one top-k / top-p per row, and min-p
        "filter_logits": ["test_07_engine.py::test_filters_match_their_definitions",
                          "test_07_engine.py::test_top_p_keeps_the_token_that_crosses"],
        # GPT-2's ranks only, for main's tokenizer
        "DATA_FILES": ["test_07_engine.py::test_demo_tokenizer_is_gpt2s"],
        # engine v1: a static batch over the model's KV cache, sampled by the Sampler
        "generate": ["test_07_engine.py::test_engine_v1_greedy_equals_transformers",
                     "test_07_engine.py::test_engine_v1_samples_as_the_engine_does"],
        # the decode and paged attention kernels, not 06's flash attention
        "bench_attention": ["GPU only: run by --bench"],
    },
    "08_serve": {
        # the command line serves a model; without one, a demo that sends itself requests
        **{name: ["test_08_serve.py::test_main_serves_a_demo_and_stops",
                  "test_08_serve.py::test_a_bad_flag_stops_main_before_any_work",
                  "test_08_serve.py::test_main_serves_a_model_until_sigterm"]
           for name in ("main", "parse_args", "check_args")},
        # a server's steps that are not decodes replay CUDA graphs too: the prefill kernel's
        # grid from the packed tokens, the forward that stops before the output layer, the
        # runner's graphs of every step, captured ahead (ModelRunner.warm_up)
        **{name: ["test_08_serve.py::test_paged_prefill_tiles_come_from_the_packed_tokens"]
           for name in ("_paged_prefill_kernel", "paged_prefill_attention")},
        "forward_packed": ["test_08_serve.py::test_completions_equal_the_engines_greedy_outputs",
                           "test_08_serve.py::test_gpu_mixed_step_graphs_equal_eager"],
        "ModelRunner": ["test_08_serve.py::test_warm_up_makes_a_step_for_every_bucket",
                        "test_08_serve.py::test_gpu_mixed_step_graphs_equal_eager",
                        "test_08_serve.py::test_gpu_engine_with_mixed_graphs_equals_enforce_eager"],
        "LLM": ["test_08_serve.py::test_warm_up_makes_a_step_for_every_bucket",
                "test_08_serve.py::test_gpu_engine_with_mixed_graphs_equals_enforce_eager",
                "test_08_serve.py::test_prefill_first_runs_prompts_alone"],
        # prefill_first: a step with prompt tokens to run runs those only (the server's default)
        **{name: ["test_08_serve.py::test_prefill_first_runs_prompts_alone",
                  "test_08_serve.py::test_prefill_first_never_stalls_on_a_prompt_without_blocks"]
           for name in ("Scheduler", "EngineConfig")},
    },
    "09_quant_lora": {  # from 07_engine (PAIRS)
        # the command line: the chapters on a small model trained here, --model, GGUF in and out
        **{name: ["test_09_quant_lora.py::test_main_on_the_cpu",
                  "test_09_quant_lora.py::test_a_bad_flag_stops_main_before_any_work",
                  "test_09_quant_lora.py::test_a_models_config_is_checked_before_its_weights",
                  "test_09_quant_lora.py::test_main_writes_a_gguf_file_and_generates_from_it",
                  "test_09_quant_lora.py::test_main_with_a_model_directory_and_a_gptq_checkpoint"]
           for name in ("main", "parse_args", "check_args")},
        "run_benches": ["GPU only: run by --bench",
                        "test_09_quant_lora.py::test_bench_without_a_gpu_prints_one_line"],
        # GPTQ and AWQ checkpoints onto the quantized twins; integer tensors read as stored
        **{name: ["test_09_quant_lora.py::test_load_qwen3_reads_gptq_and_awq_checkpoints",
                  "test_09_quant_lora.py::test_a_bad_quantization_config_names_the_file_and_field",
                  "test_09_quant_lora.py::test_a_broken_checkpoint_is_named",
                  "test_09_quant_lora.py::test_load_qwen3_still_loads_a_float_checkpoint"]
           for name in ("load_qwen3", "read_weights")},
        # engine v1 samples plain tokens: no n, stop strings, logprobs or structured output
        **{name: ["test_09_quant_lora.py::test_engine_v1_greedy_equals_full_recomputation",
                  "test_09_quant_lora.py::test_sampler_draws_what_its_parameters_say",
                  "test_09_quant_lora.py::test_sampling_params_are_checked_and_plain"]
           for name in ("generate", "_check_v1_request", "SamplingParams", "SamplingBatch",
                        "Sampler")},
        # a quantized layer's weights are buffers
        "bytes_per_step": ["test_09_quant_lora.py::test_bytes_per_step_counts_quantized_buffers"],
        # the-verdict.txt again: the quality section trains on it
        "DATA_FILES": ["test_09_quant_lora.py::test_the_verdict_is_a_checked_data_file"],
        # main's model is trained, not random (its docstring)
        "demo_tokenizer": [
            "test_09_quant_lora.py::test_a_tokenizer_read_back_from_gguf_encodes_alike",
            "test_09_quant_lora.py::test_main_on_the_cpu"],
    },
}


MARKER = re.compile(r"# (?:changed in|NEW in stage) (\d\d)\b")


def top_level_definitions(stage_name):
    """name -> source text of each function, class and assignment at the top of a stage file,
    without its change markers (`# changed in 05: ...`), which only the stage that made the
    change carries."""
    source = (ROOT / f"{stage_name}.py").read_text()
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                node.targets[0], ast.Name):
            name = node.targets[0].id
        else:
            continue
        lines = ast.get_source_segment(source, node).splitlines()
        lines = [line[:m.start()].rstrip() if (m := MARKER.search(line)) else line for line in lines]
        found[name] = "\n".join(line for line in lines if line.strip() or not lines)
    return found


@pytest.mark.parametrize("stage_name", [*CHAIN, "09_quant_lora"])
def test_change_markers_name_their_own_stage(stage_name):
    """A marker says which stage made the change. From stage 08 on, a stage keeps the markers it
    copies (so that its diff against the one before shows its own lesson only); before, a stage
    dropped them."""
    source = (ROOT / f"{stage_name}.py").read_text()
    stages = {m[1] for m in MARKER.finditer(source)}
    if stage_name >= "08":
        assert all(stage <= stage_name[:2] for stage in stages), stages
    else:
        assert stages <= {stage_name[:2]}
    assert not re.search(r"# changed(?! in \d\d)\b", source), "an unnumbered change marker"


@pytest.mark.parametrize("before, after", PAIRS)
def test_inherited_definitions_are_copies(before, after):
    old, new = top_level_definitions(before), top_level_definitions(after)
    changed = sorted(name for name in old.keys() & new.keys() if old[name] != new[name])
    assert changed == sorted(CHANGED.get(after, {})), (
        f"{after} changes {changed} of {before}: copy them unchanged, or list each in CHANGED "
        f"with the tests that check the new version")
    for name, tests in CHANGED.get(after, {}).items():
        for test in tests:
            if test.startswith("GPU only"):
                continue
            file, function = test.split("::")
            assert re.search(rf"^def {function}\(", (ROOT / "tests" / file).read_text(),
                             re.MULTILINE), f"{after}.{name}: no test {test}"


@pytest.mark.parametrize("stage_name", ["07_engine", "08_serve", "09_quant_lora"])
def test_one_name_a_role(stage_name):
    """No method name is defined by two classes of an engine stage unless one overrides it: a
    name shared by unrelated classes (an engine's advance and a grammar's advance) loses the
    reader and the tools. An override (of nn.Module.forward, of http.server's finish, of a
    Proposer's propose) keeps the name its base chose."""
    stage = load_stage(stage_name)
    owners = {}
    for cls in vars(stage).values():
        if not (isinstance(cls, type) and cls.__module__ == stage.__name__):
            continue
        for name, value in vars(cls).items():
            if (name.startswith("__") or not callable(getattr(value, "__get__", None))
                    or any(hasattr(base, name) for base in cls.__mro__[1:])):
                continue
            owners.setdefault(name, []).append(cls.__name__)
    assert {name: classes for name, classes in owners.items() if len(classes) > 1} == {}


# -- each stage's GPT against transformers: the reference the kernel tests compare with --------

@pytest.fixture(scope="module")
def hf_gpt2_dir(tmp_path_factory):
    hf = tiny_hf_gpt2(seed=3)
    folder = tmp_path_factory.mktemp("hf_gpt2")
    hf.save_pretrained(folder)
    return hf, folder


@torch.no_grad()
def test_each_stages_gpt_matches_transformers(stage, hf_gpt2_dir):
    """05's and 06's kernel tests compare with the stage's own torch GPT: anchor that copy (06
    changes GPT.forward) to transformers, in float32 and exactly in float64."""
    hf, folder = hf_gpt2_dir
    ours = stage.load_gpt2(folder)
    ids = torch.randint(0, 97, (2, 33), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(copy.deepcopy(ours).double()(ids),
                               copy.deepcopy(hf).double()(ids).logits, rtol=0, atol=1e-10)


def test_padded_vocabulary(stage):
    """Training pads wte and lm_head to a multiple of 64 rows; GPT-2's own shapes stay unpadded.
    The real ids' logits are those of the unpadded GPT with the same weights."""
    assert stage.build_config("124M", 1024, 0.0).padded_vocab_size == 50304
    assert stage.build_config("tiny", 128, 0.0).padded_vocab_size == 50304
    assert stage.GPTConfig.gpt2("124M").padded_vocab_size == 50257
    for bad in (0, -64, 2.0):
        with pytest.raises(ValueError, match="vocab_multiple"):
            tiny_config(stage, vocab_multiple=bad)
    torch.manual_seed(5)
    padded = stage.GPT(tiny_config(stage, vocab_multiple=24)).eval()  # 31 ids -> 48 rows
    assert padded.wte.weight.shape == (48, 32) and padded.lm_head.weight is padded.wte.weight
    plain = stage.GPT(tiny_config(stage)).eval()
    plain.load_state_dict({name: t[:31] if name in ("wte.weight", "lm_head.weight") else t
                           for name, t in padded.state_dict().items()})
    ids = torch.randint(0, 31, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits = padded(ids)
        assert logits.shape == (2, 16, 48)
        torch.testing.assert_close(logits[..., :31], plain(ids), rtol=1e-6, atol=1e-6)


def test_out_of_range_ids_are_refused(stage):
    """GPT.forward refuses ids outside the real vocabulary (a padding row's id too) for ids on
    the CPU in both modes (on a GPU in eval mode only: test_03_train's GPU test); train() checks
    every batch, targets included, before the step, where a GPU would not check them."""
    gpt = stage.GPT(tiny_config(stage, vocab_multiple=64))
    for training in (True, False):
        for bad in ([[3, 31]], [[-1, 0]]):
            with pytest.raises(ValueError, match=r"token ids must be in \[0, 31\)"):
                gpt.train(training)(torch.tensor(bad))
    train_loader, val_loader = loaders(stage, learnable_tokens())
    x, y = next(iter(train_loader))
    before = copy.deepcopy(gpt.state_dict())
    for batch in [(x, y.masked_fill(y == y[0, 0], 31)), (x.masked_fill(x == x[0, 0], -1), y)]:
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 31\)"):
            stage.train(gpt, [batch], val_loader, stage.TrainConfig(epochs=1), "cpu",
                        log=lambda line: None)
    assert all(torch.equal(t, gpt.state_dict()[name]) for name, t in before.items())


@pytest.mark.parametrize("name", ["03_train", "05_triton", "06_flash_attention"])  # not 04: no bench
def test_plain_twin_is_the_same_function(name):
    """--bench's baseline: plain_twin switches the GPT's LayerNorms, GELUs and attentions to
    torch's fused ops in place (weights and tying untouched); in float32 its logits, loss and
    gradients are the stage GPT's."""
    stage = load_stage(name)
    torch.manual_seed(7)
    gpt = stage.GPT(tiny_config(stage, vocab_multiple=64))
    twin = stage.plain_twin(copy.deepcopy(gpt))
    kinds = {type(m) for m in twin.modules()}
    assert {stage.TorchLayerNorm, stage.TorchGELU, stage.SDPAAttention} <= kinds
    assert not kinds & {stage.LayerNorm, stage.GELU, stage.MultiHeadAttention}
    assert twin.lm_head.weight is twin.wte.weight
    x, y = next(iter(loaders(stage, learnable_tokens())[0]))

    def run(model):
        logits = model(x)
        loss = stage.loss_fn(logits, y)
        loss.backward()
        return [logits, loss, *(p.grad for p in model.parameters())]

    for ours, ref in zip(run(twin), run(gpt), strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


# -- the training loop, in every stage (05 gives train and evaluate a loss argument) ------------

def test_evaluate_is_the_mean_cross_entropy(stage):
    """With dropout on in training, evaluate() must switch it off (its result is the eval-mode
    loss) and put the model back in whichever mode it found it."""
    torch.manual_seed(1)
    gpt = stage.GPT(tiny_config(stage, dropout=0.5))
    _, val_loader = loaders(stage, learnable_tokens())
    batches = list(val_loader)
    assert len(batches) == 2

    def mean_nll(x, y):  # float64, by hand, in eval mode
        logp = gpt.eval()(x).double().log_softmax(-1)
        return -logp.gather(-1, y[..., None]).mean().item()

    with torch.no_grad():
        by_hand = [mean_nll(x, y) for x, y in batches]
    for training in (True, False):
        gpt.train(training)
        assert stage.evaluate(gpt, val_loader, "cpu") == pytest.approx(sum(by_hand) / 2, abs=1e-5)
        assert stage.evaluate(gpt, val_loader, "cpu", max_batches=1) == pytest.approx(
            by_hand[0], abs=1e-5)
        assert gpt.training == training  # evaluate puts the mode back


def test_train_steps_like_a_plain_adamw_loop(stage):
    """train() against the loop written out with torch.optim.AdamW: the same parameters after
    8 steps of warmup and decay, with clipping active and weight decay on the matrices only."""
    torch.manual_seed(2)
    gpt = stage.GPT(tiny_config(stage))
    ref = copy.deepcopy(gpt)
    tcfg = stage.TrainConfig(epochs=2, lr=5e-3, warmup_steps=3, grad_clip=0.5, eval_every=100)
    stage.train(gpt, *loaders(stage, learnable_tokens()[:600]), tcfg, "cpu", log=lambda line: None)

    ref_loader, _ = loaders(stage, learnable_tokens()[:600])  # a fresh loader: the same order
    assert len(ref_loader) == 4
    opt = torch.optim.AdamW([
        {"params": [p for p in ref.parameters() if p.dim() == 2], "weight_decay": 0.1},
        {"params": [p for p in ref.parameters() if p.dim() == 1], "weight_decay": 0.0},
    ], lr=tcfg.lr, betas=(0.9, 0.95))
    step, clipped = 0, 0
    for _ in range(2):
        for x, y in ref_loader:
            for group in opt.param_groups:
                group["lr"] = stage.lr_at(step, tcfg.lr, 3, 8)
            loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            clipped += torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item() > 0.5
            opt.step()
            step += 1
    assert clipped > 0
    for (name, a), b in zip(gpt.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_optimizer_decays_matrices_only(stage):
    model = stage.GPT(tiny_config(stage))
    opt = stage.make_optimizer(model, 1e-3, 0.1, "cpu")
    decayed, plain = (group["params"] for group in opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert {id(p) for p in decayed} == {id(p) for p in model.parameters() if p.dim() == 2}
    assert {id(p) for p in plain} == {id(p) for p in model.parameters() if p.dim() == 1}
    assert len(decayed) + len(plain) == len(list(model.parameters()))  # the tied matrix once
    assert not opt.defaults["fused"]
