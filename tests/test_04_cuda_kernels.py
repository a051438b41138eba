"""Stage 04: CUDA kernels through load_inline, and their standalone twins in csrc/.

On any machine: the stage's kernel strings equal the text in csrc/, csrc/ compiles (when nvcc is
on PATH), the wrappers reject bad input with errors that name the problem, and the CPU parts
(roofline arithmetic, summation order) compute what they claim. On a GPU: every kernel against
torch in float64 on awkward sizes (1, 17, 1023, 4097, none a multiple of any tile) with outputs
poisoned with NaN first, so an element a kernel never writes fails; and the GPT's logits and
greedy generation on the kernels against the torch path.
"""
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, ROOT, load_stage

CSRC = ROOT / "csrc"
BEGIN, END = "// ---- BEGIN KERNELS ----", "// ---- END KERNELS ----"


@pytest.fixture(scope="module")
def stage():
    return load_stage("04_cuda_kernels")


def kernel_block(path):
    """The lines strictly between the BEGIN and END KERNELS lines of a csrc/ file."""
    lines = path.read_text().split("\n")
    return "\n".join(lines[lines.index(BEGIN) + 1 : lines.index(END)])


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)  # fresh random inputs per test, reproducible when one fails


def rel_err(got, ref):
    """||got - ref|| / ||ref|| in float64; NaN anywhere in got gives NaN, which fails any `<=`."""
    return ((got.double() - ref).norm() / ref.norm()).item()


def poisoned(shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def rand(*shape, dtype=torch.float32, lo=-1.0, hi=1.0):
    return (torch.rand(*shape, device="cuda") * (hi - lo) + lo).to(dtype)


# ---------------------------------------------------------------------------------------------
# CPU: csrc/ and the strings, bad input, the CPU parts
# ---------------------------------------------------------------------------------------------

def test_kernel_strings_equal_csrc(stage):
    assert set(stage.CUDA_SOURCES) == {p.name for p in CSRC.glob("*.cu")} | {"common.cuh"}
    for name, text in stage.CUDA_SOURCES.items():
        assert kernel_block(CSRC / name) == text.strip("\n"), f"csrc/{name} and its string in the stage differ"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_csrc_compiles(tmp_path):
    result = subprocess.run(["make", "-C", str(CSRC), "-j2", f"BUILD={tmp_path}"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert {p.name for p in tmp_path.iterdir()} == {p.stem for p in CSRC.glob("*.cu")}


def gpu_listed():
    """Whether nvidia-smi lists a GPU: without one, the csrc/ programs must say so and stop."""
    if shutil.which("nvidia-smi") is None:
        return False
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return result.returncode == 0 and "GPU" in result.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.skipif(HAS_CUDA or gpu_listed(), reason="checks the message of a machine without a GPU")
def test_csrc_run_says_no_gpu(tmp_path):
    # the two smallest programs (a few seconds each to build): the first names the problem and
    # exits 2 (EXIT_NO_GPU), where the runtime alone would say "CUDA driver version is
    # insufficient", and `make run` stops there instead of repeating it for the second
    result = subprocess.run(["make", "-C", str(CSRC), "-j2", "run", f"BUILD={tmp_path}",
                             "PROGRAMS=vector_add gelu"], capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert "vector_add: no CUDA GPU found (cudaGetDeviceCount: " in output, output
    assert "these programs need an NVIDIA GPU" in output, output
    assert "Error 2" in output and f"== {tmp_path}/gelu" not in output, output
    assert result.returncode != 0
    program = subprocess.run([str(tmp_path / "vector_add"), "--check"], capture_output=True, text=True)
    assert program.returncode == 2 and "no CUDA GPU found" in program.stderr, program


X = torch.randn(4, 8)  # float32, contiguous, 2-D: right in every way but its device (the CPU)
BAD_INPUTS = {
    "cpu tensor": (lambda s: s.vector_add(X, X), ValueError, "CUDA tensors"),
    "not a tensor": (lambda s: s.softmax([1.0, 2.0]), TypeError, "torch.Tensor"),
    "wrong dtype": (lambda s: s.vector_add(X, X.double()), TypeError, "float32"),
    "shape mismatch": (lambda s: s.vector_add(X, torch.randn(4, 9)), ValueError, "one shape"),
    "non-contiguous": (lambda s: s.softmax(X.t()), ValueError, "contiguous"),
    "empty": (lambda s: s.gelu(torch.empty(0)), ValueError, "empty"),
    "0-dim softmax": (lambda s: s.softmax(torch.tensor(1.0)), ValueError, "at least one dimension"),
    "0-dim layer_norm": (lambda s: s.layer_norm(torch.tensor(1.0), torch.ones(1), torch.zeros(1)),
                         ValueError, "at least one dimension"),
    "matmul rank": (lambda s: s.matmul_naive(torch.randn(2, 4, 8), X), ValueError, "2-D"),
    "matmul inner dims": (lambda s: s.matmul_tiled(X, torch.randn(9, 3)), ValueError, "columns"),
    "matmul bias length": (lambda s: s.matmul_register_tiled(X, torch.randn(8, 5), bias=torch.randn(4)),
                           ValueError, "bias"),
    "tensor core dtype": (lambda s: s.matmul_tensor_core(X, torch.randn(8, 8)), TypeError, "bfloat16"),
    "tensor core N % 8": (lambda s: s.matmul_tensor_core(X.bfloat16(), torch.randn(8, 12).bfloat16()),
                          ValueError, "multiples of 8"),
    "tensor core alignment": (lambda s: s.matmul_tensor_core(torch.randn(129).bfloat16()[1:].view(16, 8),
                                                             torch.randn(8, 8).bfloat16()), ValueError, "aligned"),
    "tensor core loads": (lambda s: s.matmul_tensor_core(X.bfloat16(), X.bfloat16().t().contiguous(), loads="tmem"),
                          ValueError, "loads"),
    "wgmma operand": (lambda s: s.matmul_wgmma(X.bfloat16(), torch.randn(8, 16).bfloat16()), ValueError, "K columns"),
    "reduce method": (lambda s: s.reduce_sum(X, method="magic"), ValueError, "method"),
    "norm weight": (lambda s: s.layer_norm(X, torch.ones(7), torch.zeros(8)), ValueError, "weight"),
    "bias dtype": (lambda s: s.bias_gelu(X, torch.zeros(8, dtype=torch.float16)), TypeError, "bias"),
    "out shape": (lambda s: s.softmax(X, out=torch.empty(3, 8)), ValueError, "out"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_raises_a_clear_error(stage, case):
    call, error, message = BAD_INPUTS[case]
    with pytest.raises(error, match=message):
        call(stage)


def test_use_cuda_kernels_needs_a_gpu_model(stage):
    model = stage.GPT(stage.GPTConfig(vocab_size=64, context_length=16, n_embd=32, n_head=2, n_layer=1))
    with pytest.raises(ValueError, match="GPU"):
        stage.use_cuda_kernels(model)


def test_roofline_terms(stage):
    limits = stage.Limits(copy_gbps=4000.0, fp32_tflops=50.0, bf16_tflops=800.0, source="test")
    # a vector add of 1e9 floats: 2e-5 s of fp32 arithmetic, 12 GB moved in 3 ms at 4 TB/s
    assert stage.roofline_ms(1e9, 12e9, "copy", limits) == pytest.approx((0.02, 3.0))
    # a 4096^3 matmul is 137 GFLOP: 2.75 ms at 50 TFLOP/s in fp32, 0.17 ms at 800 in bf16
    flops = 2 * 4096**3
    assert stage.roofline_ms(flops, 3 * 4 * 4096**2, "fp32", limits) == pytest.approx((flops / 50e9, 0.050331648))
    assert stage.roofline_ms(flops, 3 * 2 * 4096**2, "bf16", limits) == pytest.approx((flops / 800e9, 0.025165824))


def test_kernel_work_counts_every_byte_once(stage):
    """The minimum traffic of each kernel, counted here: every input read once, every output
    written once (float32 = 4 bytes, bf16 = 2)."""
    n, R, C, S = stage.BENCH_N, stage.BENCH_ROWS, stage.BENCH_COLS, stage.BENCH_MM
    rows = R * C * 4  # one float32 (R, C) tensor
    expected = {  # name: (FLOPs, bytes)
        "vector_add": (n, 3 * n * 4),                        # a + b -> c
        "matmul fp32": (2 * S**3, 3 * S * S * 4),            # A, B -> C; a multiply and an add
        "matmul bf16": (2 * S**3, 3 * S * S * 2),
        "reduce_sum": (R * C, rows + R * 4),                  # x -> one value a row
        "reduce_max": (R * C, rows + R * 4),
        "softmax": (5 * R * C, 2 * rows),                     # x -> y
        "layer_norm": (8 * R * C, 2 * rows + 2 * C * 4),      # x, weight, bias -> y
        "gelu": (10 * R * C, 2 * rows),
        "bias_gelu": (11 * R * C, 2 * rows + C * 4),          # x, bias -> y
    }
    work = stage.kernel_work()
    assert work.keys() == expected.keys()
    for name, (flops, nbytes) in expected.items():
        assert work[name][1:3] == (flops, nbytes), name


def test_summation_order_demo(stage, capsys):
    stage.summation_order_demo(n=1 << 20)
    out = capsys.readouterr().out
    running, tree, maximum = (float(v) for v in re.findall(r"(\d\.\de[-+]\d\d)", out))
    assert tree < running / 10  # the tree's error grows with log n, the running sum's with n
    assert maximum == 0.0


@pytest.mark.skipif(HAS_CUDA, reason="checks the message printed without a GPU")
def test_script_runs_without_a_gpu(stage):
    """The CPU path end to end: the roofline on the datasheet it names, the summation-order demo,
    and a labelled generation from the untrained GPT; --bench says in one line that it needs a GPU."""
    result = subprocess.run([sys.executable, str(ROOT / "04_cuda_kernels.py"), "--max-new-tokens", "5"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "the CUDA kernels need an NVIDIA GPU; running the CPU parts only" in out
    assert "roofline (H200 SXM datasheet): 4800 GB/s, 67 TFLOP/s fp32, 989 TFLOP/s bf16" in out
    for name, (size, flops, nbytes, _) in stage.kernel_work().items():
        assert re.search(rf"{re.escape(name)} +{re.escape(size)} +{flops / 1e9:.2f} +{nbytes / 1e6:.1f} ", out), name
    assert "pairwise tree (block reduction)" in out
    assert "\ngenerated (5 new tokens, greedy):\nEvery effort moves you" in out
    result = subprocess.run([sys.executable, str(ROOT / "04_cuda_kernels.py"), "--bench"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().splitlines() == [
        "--bench times the CUDA kernels: it needs an NVIDIA GPU (--device cuda)"]


@pytest.mark.gpu
def test_script_runs_on_a_gpu():
    """The GPU path end to end: every self-check line ok, the GPT's logits on the kernels close to
    torch's, and a labelled generation."""
    result = subprocess.run([sys.executable, str(ROOT / "04_cuda_kernels.py"), "--max-new-tokens", "5"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checks = re.findall(r"err (\S+)  tol (\S+)  (ok|FAIL)", result.stdout)
    assert len(checks) > 50 and all(verdict == "ok" for _, _, verdict in checks)
    err = float(re.search(r"GPT logits on the CUDA kernels vs torch: relative error (\S+)", result.stdout)[1])
    assert err <= 1e-4  # fp32 kernels against fp32 torch, as test_gpt_logits_on_kernels
    assert "\ngenerated (5 new tokens, greedy):\nEvery effort moves you" in result.stdout


# ---------------------------------------------------------------------------------------------
# GPU: every kernel against float64, outputs poisoned with NaN
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 17, 1023, 4097, 1_000_003])
def test_vector_add(stage, n):
    a, b = rand(n), rand(n)
    got = stage.vector_add(a, b, out=poisoned((n,)))
    assert rel_err(got, a.double() + b.double()) <= 1e-7


FP32_SHAPES = [(1, 1, 1), (17, 4097, 33), (1023, 17, 4097), (4097, 1023, 17), (300, 516, 1024)]


# fp32 dot products of length K err by ~eps * sqrt(K): ~3e-6 at K = 4097; TF32 would give ~3e-4
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["matmul_naive", "matmul_tiled", "matmul_register_tiled"])
@pytest.mark.parametrize("M,N,K", FP32_SHAPES)
def test_fp32_matmul(stage, name, M, N, K):
    a, b = rand(M, K), rand(K, N)
    got = getattr(stage, name)(a, b, out=poisoned((M, N)))
    assert rel_err(got, a.double() @ b.double()) <= 2e-5


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", FP32_SHAPES)
def test_register_tiled_matmul_bias(stage, M, N, K):
    a, b, bias = rand(M, K), rand(K, N), rand(N)
    got = stage.matmul_register_tiled(a, b, bias=bias, out=poisoned((M, N)))
    assert rel_err(got, a.double() @ b.double() + bias.double()) <= 2e-5


TENSOR_CORE_SHAPES = [(1, 8, 8), (17, 1032, 4096), (1023, 264, 72), (4097, 520, 1000), (129, 256, 4104)]


HOPPER = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


# bf16 inputs, fp32 accumulation, bf16 output: the output rounding (~2e-3) dominates
@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", TENSOR_CORE_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("loads", ["cp.async", pytest.param("tma", marks=pytest.mark.skipif(
    not HOPPER, reason="TMA needs sm_90"))])
def test_tensor_core_matmul(stage, M, N, K, with_bias, loads):
    a, b = rand(M, K, dtype=torch.bfloat16), rand(K, N, dtype=torch.bfloat16)
    bias = rand(N, dtype=torch.bfloat16) if with_bias else None
    got = stage.matmul_tensor_core(a, b, bias=bias, out=poisoned((M, N), torch.bfloat16), loads=loads)
    ref = a.double() @ b.double() + (bias.double() if with_bias else 0.0)
    assert rel_err(got, ref) <= 5e-3


ROW_SHAPES = [(1,), (4097,), (17, 1023), (1023, 17), (3, 4097), (4, 4096), (5, 8193), (2, 3, 1023)]


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["atomic", "tree", "shuffle"])
@pytest.mark.parametrize("shape", ROW_SHAPES + [(2, 100_003)])  # the last one reduces in two passes
def test_reduce_sum(stage, method, shape):
    x = rand(*shape)
    got = stage.reduce_sum(x, method=method, out=poisoned(shape[:-1]))
    # rounding scales with sum |x| whatever the order: a relative measure immune to cancellation
    err = (got.double() - x.double().sum(-1)).abs() / x.double().abs().sum(-1)
    assert err.max().item() <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["atomic", "tree", "shuffle"])
@pytest.mark.parametrize("shape", ROW_SHAPES + [(2, 100_003)])
def test_reduce_max_is_exact(stage, method, shape):
    x = rand(*shape)
    got = stage.reduce_max(x, method=method, out=poisoned(shape[:-1]))
    assert torch.equal(got, x.amax(-1))


@pytest.mark.gpu
# 16384 is the widest row held in registers; 50257 is streamed
@pytest.mark.parametrize("shape", ROW_SHAPES + [(3, 16384), (2, 50257)])
@pytest.mark.parametrize("scale", [1.0, 100.0])  # at 100, exp() overflows unless the max is subtracted
def test_softmax(stage, shape, scale):
    x = rand(*shape, lo=-scale, hi=scale)
    got = stage.softmax(x, out=poisoned(shape))
    assert rel_err(got, torch.softmax(x.double(), -1)) <= 1e-5


@pytest.mark.gpu
def test_softmax_causal_mask(stage):
    T = 37
    x = rand(3, T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool, device="cuda").tril(), float("-inf"))
    got = stage.softmax(x, out=poisoned((3, T, T)))
    assert rel_err(got, torch.softmax(x.double(), -1)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1023, 50257])  # held in registers; streamed
def test_softmax_extreme_rows(stage, n):
    # exp() overflows float32 past 89 and underflows below -103. Rows of uniform +-3 about: +1e4
    # (every 7th entry -inf); -1e4; +100; -100; -1e4 on the first half and +1e4 on the second (the
    # max comes last); +1e4 with all but the last eighth -inf (a long -inf prefix)
    x = rand(6, n, lo=-3.0, hi=3.0) + torch.tensor([1e4, -1e4, 100.0, -100.0, 0.0, 1e4], device="cuda")[:, None]
    x[4, : n // 2] -= 1e4
    x[4, n // 2:] += 1e4
    x[0, ::7] = float("-inf")
    x[5, : n - n // 8] = float("-inf")
    got = stage.softmax(x, out=poisoned((6, n)))
    assert rel_err(got, torch.softmax(x.double(), -1)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ROW_SHAPES + [(3, 16384), (2, 20011)])
@pytest.mark.parametrize("offset", [0.0, 1000.0])  # at 1000, E[x^2] - E[x]^2 would lose the variance
def test_layer_norm(stage, shape, offset):
    x = rand(*shape, lo=offset - 1, hi=offset + 1)
    w, b = rand(shape[-1]), rand(shape[-1])
    got = stage.layer_norm(x, w, b, eps=1e-5, out=poisoned(shape))
    ref = F.layer_norm(x.double(), shape[-1:], w.double(), b.double(), 1e-5)
    # near 1000 the float32 running mean holds ~6e-5 absolute: 1e-4 of the std
    assert rel_err(got, ref) <= (1e-5 if offset == 0.0 else 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(17, 1023), (5, 20011)])  # held in registers; streamed
def test_layer_norm_small_variance(stage, shape):
    # rows of std 1e-4 to 1e-2 (variance 1e-8 to 1e-4) beside eps = 1e-5: eps outside the square
    # root is off by O(1). At offsets from -1 to 1 the float32 mean holds ~1e-7 absolute, up to
    # 4e-5 of sqrt(var + eps) >= 3e-3, which y inherits: bound 1e-3
    rows, n = shape
    std = torch.logspace(-4, -2, rows, device="cuda")[:, None]
    x = torch.linspace(-1, 1, rows, device="cuda")[:, None] + std * torch.randn(rows, n, device="cuda")
    w, b = rand(n), rand(n)
    got = stage.layer_norm(x, w, b, eps=1e-5, out=poisoned(shape))
    ref = F.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
    assert rel_err(got, ref) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_gelu_and_bias_gelu(stage, shape):
    # Element-wise with an absolute floor: for x << 0 GELU is a tiny difference (1 + tanh(...)),
    # so float32 can only be near it in absolute terms (~eps * |x|), and a one-element tensor
    # makes a norm-wise relative error element-wise too. A wrong formula errs by >= 1e-4.
    x, bias = rand(*shape, lo=-6.0, hi=6.0), rand(shape[-1])
    got = stage.gelu(x, out=poisoned(shape))
    torch.testing.assert_close(got.double(), F.gelu(x.double(), approximate="tanh"),
                               rtol=1e-6, atol=1e-6)
    got = stage.bias_gelu(x, bias, out=poisoned(shape))
    torch.testing.assert_close(got.double(), F.gelu(x.double() + bias.double(), approximate="tanh"),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_kernels_refuse_autograd(stage):
    with pytest.raises(RuntimeError, match="no_grad"):
        stage.gelu(rand(8).requires_grad_())


# ---------------------------------------------------------------------------------------------
# GPU: the GPT on the kernels
# ---------------------------------------------------------------------------------------------

VOCAB = 1001  # odd: the tensor-core path pads N to a multiple of 8


def small_gpt(stage):
    torch.manual_seed(0)
    config = stage.GPTConfig(vocab_size=VOCAB, context_length=64, n_embd=96, n_head=4, n_layer=2)  # head dim 24
    return stage.GPT(config).cuda().eval()


# fp32 kernels match torch's fp32 to rounding; bf16 Linear layers to bf16's ~4e-3 per layer
@pytest.mark.gpu
@pytest.mark.parametrize("tensor_cores,tol", [(False, 1e-4), (True, 3e-2)])
def test_gpt_logits_on_kernels(stage, tensor_cores, tol):
    model = small_gpt(stage)
    idx = torch.randint(0, VOCAB, (3, 37), device="cuda")
    with torch.no_grad(), stage.fp32_matmul_precision("highest"):  # no TF32 on the torch side
        ref = model(idx)
        stage.use_cuda_kernels(model, tensor_cores=tensor_cores)
        got = model(idx)
    assert isinstance(model.h[0].mlp, stage.CudaMLP) and isinstance(model.lm_head, stage.CudaLinear)
    assert rel_err(got, ref.double()) <= tol


@pytest.mark.gpu
def test_generation_on_kernels(stage):
    model = small_gpt(stage)
    idx = torch.randint(0, VOCAB, (2, 5), device="cuda")
    with torch.no_grad(), stage.fp32_matmul_precision("highest"):
        ref = stage.generate(model, idx, max_new_tokens=12)
        stage.use_cuda_kernels(model)
        got = stage.generate(model, idx, max_new_tokens=12)
    assert torch.equal(got, ref)


# Last in the file: the newest kernel. A fault in it would end the CUDA context for what follows.
@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="wgmma needs sm_90")
@pytest.mark.parametrize("M,N,K", TENSOR_CORE_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_wgmma_matmul(stage, M, N, K, with_bias):
    a, w = rand(M, K, dtype=torch.bfloat16), rand(N, K, dtype=torch.bfloat16)  # w is (N, K): a @ w.T
    bias = rand(N, dtype=torch.bfloat16) if with_bias else None
    got = stage.matmul_wgmma(a, w, bias=bias, out=poisoned((M, N), torch.bfloat16))
    ref = a.double() @ w.double().T + (bias.double() if with_bias else 0.0)
    assert rel_err(got, ref) <= 5e-3
