"""Stage 05: Triton kernels against torch in float64, forward and backward, on awkward shapes.

Without CUDA the kernels run through Triton's interpreter at small sizes (conftest switches it on
before triton is imported); the @pytest.mark.gpu tests repeat the checks at real sizes on the GPU.
Tolerances are on ||out - ref|| / ||ref||, with the reference computed in float64 from the very
inputs the kernel saw: fp32 arithmetic lands near 1e-7 (bound 1e-5); outputs rounded to fp16 or
bf16 carry 2^-11 or 2^-8 relative error per element (bounds 2e-3 and 1e-2; Triton 3.6's
interpreter truncates instead of rounding to bf16, 2^-7, still inside the bound).
"""
import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, check_main, load_stage

DEVICE = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def s():
    return load_stage("05_triton")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def randn(gen, *shape, dtype=torch.float32, scale=1.0, device=DEVICE):
    """Normal values drawn in float64 on the CPU (reproducible), rounded to `dtype`, on `device`."""
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def rel_err(out, ref):
    assert not out.isnan().any(), "NaN in the output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_close(ours_fn, ref_fn, inputs, tol, gen, out_dtype=None):
    """Forward and backward (with a random upstream gradient) of ours against ref on float64 copies."""
    ours_in = [t.detach().clone().requires_grad_() for t in inputs]
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    out, ref = ours_fn(*ours_in), ref_fn(*ref_in)
    assert out.shape == ref.shape and out.dtype == (out_dtype or inputs[0].dtype)
    assert rel_err(out, ref) < tol, f"forward rel err {rel_err(out, ref):.2e}"
    dout = randn(gen, *ref.shape, dtype=torch.float64)
    out.backward(dout.to(out.dtype))
    ref.backward(dout)
    for i, (o, r) in enumerate(zip(ours_in, ref_in)):
        assert o.grad.dtype == o.dtype and o.grad.shape == o.shape
        assert rel_err(o.grad, r.grad) < tol, f"grad of input {i}: rel err {rel_err(o.grad, r.grad):.2e}"


def check_directional(fn, inputs, gen, h=1e-2):
    """gradcheck in one random direction: the central difference of L = <fn(x), w> along v against
    <grad L, v> from the kernels' backward. fp32 only, so h is large and the bound loose (1e-2)."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    w = randn(gen, *out.shape)
    (out * w).sum().backward()
    dirs = [randn(gen, *t.shape) for t in inputs]
    analytic = sum((t.grad.double() * d).sum() for t, d in zip(inputs, dirs)).item()
    with torch.no_grad():
        plus = (fn(*[t + h * d for t, d in zip(inputs, dirs)]).double() * w).sum()
        minus = (fn(*[t - h * d for t, d in zip(inputs, dirs)]).double() * w).sum()
    numeric = ((plus - minus) / (2 * h)).item()
    assert abs(numeric - analytic) <= 1e-2 * abs(analytic) + 1e-3, (numeric, analytic)


ROW_SHAPES = [(3, 17), (5, 67), (2, 3, 129), (4, 1000)]


# ------------------------------------------------------------------------------------------------
# vector add
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 1000, 4097])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vector_add(s, gen, n, dtype):
    x, y = randn(gen, n, dtype=dtype), randn(gen, n, dtype=dtype)
    out = s.vector_add(x, y)
    if dtype == torch.float32 or HAS_CUDA:
        assert torch.equal(out, x + y)  # one rounding of the same sum: bit-identical to torch
    else:
        # Triton 3.6's interpreter truncates when it rounds to bf16: up to one bf16 step (2^-7) off
        torch.testing.assert_close(out, x + y, rtol=2**-7, atol=0)


# ------------------------------------------------------------------------------------------------
# row kernels
# ------------------------------------------------------------------------------------------------

# the last three are streamed in bf16 (> 8,192 wide; whole chunks only at 12,288) and the last in fp32
@pytest.mark.parametrize("shape", ROW_SHAPES + [(2, 8200), (2, 12288), (3, 16411)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax(s, gen, shape, dtype):
    check_close(s.softmax, lambda x: torch.softmax(x, -1), [randn(gen, *shape, dtype=dtype, scale=3.0)], TOL[dtype], gen)


@pytest.mark.parametrize("n,dtype", [(67, torch.float32), (16411, torch.float32), (12288, torch.bfloat16)])
def test_softmax_masked_rows(s, gen, n, dtype):
    # a causal mask's -inf entries, including leading chunks that are all -inf in the streamed kernel
    x = randn(gen, 6, n, dtype=dtype)
    x[:, : n // 2] = float("-inf")
    x[0, n // 2 + 1:] = float("-inf")  # a row with a single finite entry
    check_close(s.softmax, lambda t: torch.softmax(t, -1), [x], TOL[dtype], gen)


# every narrow shape in both dtypes; then the streamed forward (fp32 from 1,024 columns, bf16 above
# 8,192) with whole chunks only (1,024 and 12,288) and a ragged last one (1,030, 3,000, 8,200) and a
# wide ragged bf16 row; the last three also take the streamed backward (> 8,192 columns)
NORM_CASES = [(shape, dtype) for shape in ROW_SHAPES for dtype in (torch.float32, torch.bfloat16)] + [
    ((2, 1024), torch.float32), ((2, 1030), torch.float32), ((3, 3000), torch.float32),
    ((3, 8200), torch.float32), ((2, 12288), torch.float32),
    ((2, 16411), torch.bfloat16)]


@pytest.mark.parametrize("shape,dtype", NORM_CASES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm(s, gen, shape, dtype, with_bias):
    n = shape[-1]
    # an offset mean, a large scale and a ramp along the row (chunks of a wide row then have different
    # means): catches a variance computed as E[x^2] - E[x]^2 or chunk statistics merged wrongly
    x = (randn(gen, *shape, dtype=torch.float64, scale=4.0) + 3.0 + torch.linspace(-8, 8, n, device=DEVICE)).to(dtype)
    w, b = randn(gen, n, dtype=dtype) + 1.0, randn(gen, n, dtype=dtype)
    inputs = [x, w, b] if with_bias else [x, w]
    check_close(lambda x, w, b=None: s.layer_norm(x, w, b), lambda x, w, b=None: F.layer_norm(x, (n,), w, b, 1e-5),
            inputs, TOL[dtype], gen)


@pytest.mark.parametrize("shape,dtype", NORM_CASES)
def test_rms_norm(s, gen, shape, dtype):
    n = shape[-1]
    x, w = randn(gen, *shape, dtype=dtype, scale=2.0), randn(gen, n, dtype=dtype) + 1.0
    check_close(s.rms_norm, lambda x, w: F.rms_norm(x, (n,), w, 1e-6), [x, w], TOL[dtype], gen)


@pytest.mark.parametrize("shape,dtype", [((5, 67), torch.bfloat16), ((2, 1024), torch.float32),
                                         ((3, 3000), torch.float32), ((2, 16411), torch.bfloat16)])
@pytest.mark.parametrize("rms", [False, True])
def test_norm_without_autograd(s, gen, shape, dtype, rms):
    # with no gradient to compute the forward skips storing mean and rstd: the output must not
    # change (fused and streamed kernels), and with only the weight wanting a gradient the
    # statistics are kept and the backward runs
    n = shape[-1]
    x, w, b = randn(gen, *shape, dtype=dtype, scale=2.0) + 1.0, randn(gen, n, dtype=dtype) + 1.0, randn(gen, n, dtype=dtype)
    fn = (lambda x, w: s.rms_norm(x, w, 1e-6)) if rms else (lambda x, w: s.layer_norm(x, w, b, 1e-6))
    ref = (F.rms_norm(x.double(), (n,), w.double(), 1e-6) if rms else
           F.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-6))
    plain = fn(x, w)
    assert rel_err(plain, ref) < TOL[dtype]
    with torch.no_grad():
        assert torch.equal(fn(x, w.requires_grad_()), plain)
    y = fn(x, w)  # w requires grad, x does not
    assert torch.equal(y.detach(), plain)
    y.float().square().sum().backward()
    xhat = F.rms_norm(x.double(), (n,), None, 1e-6) if rms else F.layer_norm(x.double(), (n,), None, None, 1e-6)
    dw_ref = (xhat * 2 * y.detach().double()).sum(0)  # d(sum y^2)/dw
    assert rel_err(w.grad, dw_ref) < 10 * TOL[dtype]


def test_layer_norm_mixed_dtypes(s, gen):
    # bf16 activations with fp32 parameters (the autocast layout): gradients in each input's dtype
    x, w, b = randn(gen, 5, 67, dtype=torch.bfloat16), randn(gen, 67) + 1.0, randn(gen, 67)
    check_close(lambda x, w, b: s.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (67,), w, b), [x, w, b],
            TOL[torch.bfloat16], gen)


@pytest.mark.parametrize("n", [67, 3000])
def test_layer_norm_out_dtype(s, gen, n):
    # fp32 activations, y written in bf16 (what TritonLayerNorm does under autocast), fused and
    # streamed rows: y is the fp32 result rounded once; gradients in the inputs' dtype
    x, w, b = randn(gen, 5, n, scale=2.0) + 1.0, randn(gen, n) + 1.0, randn(gen, n)
    check_close(lambda x, w, b: s.layer_norm(x, w, b, out_dtype=torch.bfloat16),
                lambda x, w, b: F.layer_norm(x, (n,), w, b), [x, w, b], TOL[torch.bfloat16], gen,
                out_dtype=torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# row kernels: every code path, tiny variances, extreme values
# ------------------------------------------------------------------------------------------------
# Under the interpreter _num_sms() is 1, and the tests above use at most 32 rows: each program of
# the norm backward then gets one row block, where overwriting its partial dw equals adding to it.
# Their variances near 1 hide eps, and exp() of randn * 3 never overflows, so a softmax that
# skipped subtracting the max would pass. The paths, and the test that takes each:
#   softmax: fused (N <= 16,384; ROWS rows a program, rows past the end clamped) or streamed
#     (online max over 4,096-column chunks, the last masked): test_softmax_extreme_logits
#   norm forward: fused (ROWS rows a program) or streamed (fp32 from 1,024 columns, 16-bit above
#     8,192; per-lane Welford over whole chunks, then a ragged one): test_norm_small_variance
#   norm backward: fused (N <= 8,192; ROWS rows a step, dw and db summed in registers) or streamed
#     (a row a step, added into the program's row of partials), each with several row blocks a
#     program and a last program whose run passes the end: test_norm_backward_sums_over_row_blocks
#   column sum: one pass (<= 256 rows, or rows that one program's group holds), or row groups
#     (several programs a column block, each several BLOCK_M-row steps, the last group short)
#     and a pass over the groups' sums: test_column_sum; how many groups, and the last pass's
#     tile: test_column_sum_fills_the_gpu

def record_launches(monkeypatch, module, name, run=True):
    """Launch module.<name>, a Triton kernel, as before, recording each launch: a list of
    (grid, {argument name: value}). run=False: record only (the outputs are left unwritten)."""
    kernel = getattr(module, name)
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, {**dict(zip(kernel.arg_names, args)), **kwargs}))
                return kernel[grid](*args, **kwargs) if run else None
            return launch

    monkeypatch.setattr(module, name, Recorder())
    return launches


@pytest.mark.parametrize("looped", [False, True])
@pytest.mark.parametrize("rms", [False, True])
def test_norm_backward_sums_over_row_blocks(s, gen, monkeypatch, looped, rms):
    # _num_sms() pinned to 1, the interpreter's count, so that a GPU splits the rows alike; and for
    # the streamed backward a threshold that 300 columns pass (at its real width, > 8,192, the
    # interpreter's streamed layer-norm forward takes a second a row). 45 and 7 rows then give each
    # program several row blocks and the last one a run past the end: an overwritten dw or db
    # keeps one block a program. The launch is checked, so that a new split cannot skip the path.
    monkeypatch.setattr(s, "_num_sms", lambda device: 1)
    if looped:
        monkeypatch.setattr(s, "_MAX_FUSED_BWD_N", 256)
    launches = record_launches(monkeypatch, s, "_norm_bwd_looped_kernel" if looped else "_norm_bwd_kernel")
    n = 300
    x, w, b = randn(gen, 7 if looped else 45, n, scale=2.0) + 1.0, randn(gen, n) + 1.0, randn(gen, n)
    if rms:
        check_close(s.rms_norm, lambda x, w: F.rms_norm(x, (n,), w, 1e-6), [x, w], TOL[torch.float32], gen)
    else:
        check_close(s.layer_norm, lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5), [x, w, b],
                    TOL[torch.float32], gen)
    [((programs,), args)] = launches
    run, block = args["rows_per_program"], args.get("ROWS", 1)
    assert programs >= 2 and run >= 2 * block and programs * run > args["n_rows"], (programs, run, block)


@pytest.mark.parametrize("rows,n", [(100, 300), (600, 300), (1000, 3), (5000, 3)])
def test_column_sum(s, gen, rows, n):
    # the norm backward's second kernel (and the matmul's bias gradient), on rows of a padded buffer
    x = randn(gen, rows, n + 5)[:, :n]
    for dtype in (torch.float32, torch.bfloat16):
        out = s._column_sum(x, dtype)
        assert out.dtype == dtype and out.shape == (n,)
        assert rel_err(out, x.double().sum(0)) < TOL[dtype]


@pytest.mark.parametrize("rows,n", [(1056, 768), (512, 768), (16384, 768), (16384, 3072), (256, 3072),
                                    (600, 3), (5000, 3)])
def test_column_sum_fills_the_gpu(s, gen, monkeypatch, rows, n):
    # On the H200's 132 SMs the first pass has about 4 programs an SM: within a factor of 2 of
    # 4 * 132, or of as many as its BLOCK_M-row steps allow where that is fewer (1,056 rows of a
    # LayerNorm's partial sums: one step a program). The last pass takes at most 2 steps of rows
    # where they are at most 256 (the partial sums' rows, or a single pass's); the longer single
    # passes here (a few columns), at most 8.
    # 16,384 rows would take the interpreter minutes, so their launches are only recorded; the
    # others are summed and checked.
    monkeypatch.setattr(s, "_num_sms", lambda device: 132)
    small = rows * n <= 10 ** 6
    launches = record_launches(monkeypatch, s, "_column_sum_kernel", run=small)
    x = randn(gen, rows, n) if small else torch.empty(1, n, device=DEVICE).expand(rows, n)
    out = s._column_sum(x, torch.float32)
    assert len(launches) == 1 if rows <= 256 else len(launches) in (1, 2)
    if len(launches) == 2:  # several groups of whole BLOCK_M-row steps, then a pass over their sums
        (grid_n, groups), args = launches[0]
        block_m = args["BLOCK_M"]
        target = min(4 * 132, grid_n * ((rows + block_m - 1) // block_m))
        assert target / 2 <= grid_n * groups <= 2 * target, (grid_n, groups, target)
        run = args["rows_per_program"]
        assert (groups - 1) * run < rows <= groups * run and run % block_m == 0
    (grid_n, one), args = launches[-1]
    last_rows = groups if len(launches) == 2 else rows
    assert one == 1 and args["n_rows"] == args["rows_per_program"] == last_rows
    assert grid_n * args["BLOCK_N"] >= n > (grid_n - 1) * args["BLOCK_N"]
    assert (last_rows + args["BLOCK_M"] - 1) // args["BLOCK_M"] <= (2 if last_rows <= 256 else 8)
    if small:
        assert rel_err(out, x.double().sum(0)) < TOL[torch.float32]


@pytest.mark.parametrize("n", [67, 1024])  # the fused forward; the streamed one (fp32, >= 1,024)
@pytest.mark.parametrize("rms", [False, True])
def test_norm_small_variance(s, gen, n, rms):
    # Rows of standard deviation 1e-4 to 1e-2, variance 1e-8 to 1e-4, beside eps = 1e-5 (1e-6 for
    # RMSNorm): eps placed outside the square root is off by O(1). RMSNorm rows are centred on 0
    # (an offset would swamp eps) and meet fp32 rounding alone (bound 1e-5). Layer-norm rows sit at
    # offsets from -1 to 1: the fp32 mean carries ~1e-7 absolute, up to 4e-5 of sqrt(var + eps) >=
    # 3e-3, and y, dx and dw inherit it (measured 2e-4 on the streamed path): bound 1e-3.
    std = torch.logspace(-4, -2, 5, dtype=torch.float64, device=DEVICE)[:, None]
    x = randn(gen, 5, n, dtype=torch.float64) * std
    w, b = randn(gen, n) + 1.0, randn(gen, n)
    if rms:
        check_close(s.rms_norm, lambda x, w: F.rms_norm(x, (n,), w, 1e-6), [x.float(), w], TOL[torch.float32], gen)
    else:
        x += torch.linspace(-1, 1, 5, dtype=torch.float64, device=DEVICE)[:, None]
        check_close(s.layer_norm, lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5), [x.float(), w, b], 1e-3, gen)


def extreme_rows(gen, n, big, dtype):
    """Six rows of n logits, randn * 3 about: +big (every 7th entry -inf); -big; +100; -100; -big
    on the first half and +big on the second (the max in the last chunks); +big, all -inf but the
    last eighth (whole leading chunks of -inf once n > 4,096 * 8 / 7). exp(89) overflows fp32."""
    x = randn(gen, 6, n, dtype=torch.float64, scale=3.0)
    x += torch.tensor([big, -big, 100.0, -100.0, 0.0, big], dtype=torch.float64, device=x.device)[:, None]
    x[4, : n // 2] -= big
    x[4, n // 2:] += big
    x[0, ::7] = float("-inf")
    x[5, : n - n // 8] = float("-inf")
    return x.to(dtype)


# Lanes past the end of a row hold 0 where the -big rows' exp(x - lse) is taken: numpy warns of
# the overflow in values that are never stored.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("n,dtype,big,tol", [
    (67, torch.float32, 1e4, TOL[torch.float32]),
    # the streamed kernel writes exp(x - lse) with lse rounded to fp32: at 1e4 half an ulp is
    # 2^-11 = 5e-4 absolute, and up to as much relative error in y (measured 2.3e-4)
    (16411, torch.float32, 1e4, 1e-3),
    # y and dx each rounded to bf16 (truncated by the interpreter, 2^-7), and a few entries carry
    # each row, so the norm-wise error no longer averages down (measured 6e-3)
    (67, torch.bfloat16, 3e4, 2e-2),
    (16411, torch.bfloat16, 3e4, 2e-2)])
def test_softmax_extreme_logits(s, gen, n, dtype, big, tol):
    check_close(s.softmax, lambda t: torch.softmax(t, -1), [extreme_rows(gen, n, big, dtype)], tol, gen)


# ------------------------------------------------------------------------------------------------
# elementwise
# ------------------------------------------------------------------------------------------------

def gelu_ref(x):
    return F.gelu(x, approximate="tanh")


@pytest.mark.parametrize("shape", [(1000,), (3, 17), (2, 3, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gelu(s, gen, shape, dtype):
    check_close(s.gelu, gelu_ref, [randn(gen, *shape, dtype=dtype, scale=3.0)], TOL[dtype], gen)


def test_gelu_extremes(s):
    x = torch.tensor([-1e4, -100.0, -20.0, -5.0, 0.0, 5.0, 20.0, 100.0, 1e4], device=DEVICE)
    assert rel_err(s.gelu(x), gelu_ref(x.double())) < 1e-6


@pytest.mark.parametrize("shape", [(1000,), (3, 17), (2, 3, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu(s, gen, shape, dtype):
    gate, up = randn(gen, *shape, dtype=dtype, scale=3.0), randn(gen, *shape, dtype=dtype)
    check_close(s.swiglu, lambda g, u: F.silu(g) * u, [gate, up], TOL[dtype], gen)


# ------------------------------------------------------------------------------------------------
# matmul
# ------------------------------------------------------------------------------------------------

def matmul_ref(a, b, bias=None, activation=None):
    out = a @ b if bias is None else a @ b + bias
    return gelu_ref(out) if activation == "gelu" else out


@pytest.mark.parametrize("m,k,n", [(33, 65, 47), (64, 64, 32), (1, 7, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_matmul(s, gen, m, k, n, dtype, activation):
    a, b = randn(gen, m, k, dtype=dtype), randn(gen, k, n, dtype=dtype, scale=k ** -0.5)
    bias = randn(gen, n, dtype=dtype)
    check_close(lambda a, b, bias: s.matmul(a, b, bias, activation), lambda a, b, bias: matmul_ref(a, b, bias, activation),
            [a, b, bias], TOL[dtype], gen)


@pytest.mark.parametrize("n", [47, 3])
def test_matmul_linear_layout(s, gen, n):
    # x (B, T, K) @ W.t() with W (N, K), as nn.Linear: leading dims flattened, the weight's grad in
    # its own layout; M = 600 rows also takes the two-launch bias reduction
    x, w, bias = randn(gen, 2, 300, 65), randn(gen, n, 65, scale=0.1), randn(gen, n)
    check_close(lambda x, w, bias: s.matmul(x, w.t(), bias), lambda x, w, bias: F.linear(x, w, bias), [x, w, bias],
            TOL[torch.float32], gen)


def tma_operands(s, gen, m, k, n, a_t, b_t, dtype, device=DEVICE):
    """a (m, k) and b (k, n) in bf16/fp16, stored transposed where asked (a.t() of a (k, m) tensor),
    with rows of whole 16-byte multiples: the layouts the TMA matmul kernel reads."""
    a = randn(gen, k, m, dtype=dtype, device=device).t() if a_t else randn(gen, m, k, dtype=dtype, device=device)
    b = (randn(gen, n, k, dtype=dtype, scale=k ** -0.5, device=device).t() if b_t
         else randn(gen, k, n, dtype=dtype, scale=k ** -0.5, device=device))
    assert s._tma_layout(a) is a_t and s._tma_layout(b) is b_t
    return a, b


@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
def test_matmul_tma_layouts(s, gen, a_t, b_t):
    # the forward on each of the four layouts; the backward then multiplies transposed views
    a, b = tma_operands(s, gen, 40, 48, 24, a_t, b_t, torch.bfloat16)
    bias = randn(gen, 24, dtype=torch.bfloat16)
    check_close(lambda a, b, bias: s.matmul(a, b, bias, "gelu"), lambda a, b, bias: matmul_ref(a, b, bias, "gelu"),
                [a, b, bias], TOL[torch.bfloat16], gen)


@pytest.mark.parametrize("programs,m,k,n,a_t,plan", [
    (2, 40, 4096, 24, True, (2, 1, 2)),  # 3 tiles of 16 x 32: 2 run whole, the third cut in two
    (2, 40, 4096, 24, False, (2, 1, 2)),  # the same with a row-major (a forward's input)
    (3, 80, 4096, 32, True, (5, 0, 1)),  # 5 tiles: 2 left for 3 programs are not worth cutting
    (3, 16, 4096, 32, True, (0, 1, 3)),  # 1 tile, cut in three
    (3, 64, 4096, 32, True, (3, 1, 3)),  # 4 tiles: 3 whole, the fourth cut in three
    (4, 48, 4096, 64, True, (4, 2, 2)),  # 6 tiles: 4 whole, two cut in two (summed by tile)
    (2, 40, 4100, 24, True, (2, 1, 2)),  # K not a multiple of the 32-wide k-step: the last reads zeros
])
def test_matmul_split_tail(s, gen, monkeypatch, programs, m, k, n, a_t, plan):
    # the forward through the whole tiles, the cut ones and the sum (the backward's products have a
    # short K and take the autotuned kernel), against float64
    monkeypatch.setattr(s, "_INTERPRET_PROGRAMS", programs)
    assert s._few_tiles_long_k(m, n, k, programs)
    tile = s._SPLIT_TILE_INTERPRET
    assert s._split_tail_plan(m, n, k, programs, tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]) == plan
    a, b = tma_operands(s, gen, m, k, n, a_t, False, torch.bfloat16)
    bias = randn(gen, n, dtype=torch.bfloat16)
    check_close(lambda a, b, bias: s.matmul(a, b, bias, "gelu"), lambda a, b, bias: matmul_ref(a, b, bias, "gelu"),
                [a, b, bias], TOL[torch.bfloat16], gen)


def test_split_tail_plans(s):
    # GPT-2 124M's weight gradients at 16,384 tokens (768 x N summed over the tokens) on 132 SMs
    assert s._few_tiles_long_k(768, 3072, 16384, 132) and s._few_tiles_long_k(768, 768, 16384, 132)
    assert not s._few_tiles_long_k(16384, 768, 3072, 132)  # 384 tiles of 128 x 256
    assert not s._few_tiles_long_k(4096, 4096, 4096, 132) and not s._few_tiles_long_k(1024, 1024, 1024, 132)
    # 144 tiles of 128 x 128: 132 whole, and the 12 left cut in 11 (one more wave of 132)
    assert s._split_tail_plan(3072, 768, 16384, 132, 128, 128, 64) == (132, 12, 11)
    assert s._split_tail_plan(768, 768, 16384, 132, 128, 128, 64) == (0, 36, 3)
    assert s._split_tail_plan(1536, 1408, 16384, 132, 128, 128, 64) == (132, 0, 1)  # whole waves
    assert s._split_tail_plan(128, 128, 1024, 132, 128, 128, 64) == (0, 1, 2)  # parts of 8 steps at least


def test_matmul_tma_declines(s):
    # what TMA cannot read goes to the pointer kernel: fp32, rows of 7 bf16 (14 bytes), no unit stride
    x = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert s._tma_layout(x.float()) is None
    assert s._tma_layout(torch.zeros(8, 7, dtype=torch.bfloat16)) is None
    assert s._tma_layout(x[:, ::2]) is None
    assert s._tma_layout(x[:, 1:]) is None  # base not 16-byte aligned


def test_matmul_tma_candidates(s):
    # the autotuner's candidates: large problems time only the 128 x 256 tiles; a small one keeps
    # the tiles that fit it; a thin one (K = 768) all of them
    import triton
    tiles = [(128, 256), (256, 128), (128, 128), (64, 128)]
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 64, "GROUP_M": 8}) for m, n in tiles]

    def kept(m, n, k):
        pruned = s._prune_tma_configs(configs, {"M": m, "N": n, "K": k})
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in pruned]
    assert kept(4096, 4096, 4096) == [(128, 256), (256, 128)]
    assert kept(8192, 4096, 8192) == [(128, 256), (256, 128)]
    assert kept(16384, 3072, 768) == tiles
    assert kept(100, 200, 4096) == [(128, 256), (128, 128), (64, 128)]


def test_float32_products_take_one_tile(s):
    # the pointer kernel's candidates: bf16 tunes every fitting tile; float32 ("ieee" products)
    # takes one, the last that fits, so a float32 GPT does not compile every tile in every
    # specialization before its first step
    import triton
    tiles = [(128, 256), (256, 128), (128, 128), (64, 128), (128, 64)]
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 64, "GROUP_M": 8}) for m, n in tiles]

    def kept(m, n, precision):
        pruned = s._prune_matmul_configs(configs, {"M": m, "N": n, "K": 64}, DOT_PRECISION=precision)
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in pruned]
    assert kept(4096, 4096, "tf32") == tiles
    assert kept(4096, 4096, "ieee") == [(128, 64)]
    assert kept(40, 100, "tf32") == [(64, 128)]  # the only tile within twice the problem
    assert kept(40, 100, "ieee") == [(64, 128)]
    assert kept(8, 8, "ieee") == [(64, 128)]  # nothing fits: the smallest tile (first of equals)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_pads_unaligned_rows(s, gen, dtype):
    # 47 values a row are not a whole number of 16-byte units: the caller gets a contiguous
    # (33, 47) tensor, unless it asks for padded rows (48), where nothing reads or writes the padding
    a, b, bias = randn(gen, 33, 40, dtype=dtype), randn(gen, 40, 47, dtype=dtype, scale=0.2), randn(gen, 47, dtype=dtype)
    out = s.matmul(a, b)
    assert out.shape == (33, 47) and out.is_contiguous()
    padded = s.matmul(a, b, pad_rows=True)
    assert padded.shape == (33, 47) and padded.stride() == (48, 1) and torch.equal(padded, out)
    assert s.matmul(a, b[:, :40], pad_rows=True).is_contiguous()  # 40 values: no padding
    for pad_rows in (False, True):
        check_close(lambda a, b, bias: s.matmul(a, b, bias, "gelu", pad_rows),
                    lambda a, b, bias: matmul_ref(a, b, bias, "gelu"), [a, b, bias], TOL[dtype], gen)


def test_matmul_transposed_upstream_gradient(s, gen):
    # out.t() hands the backward a gradient whose rows are not contiguous (the bias sum copies it)
    a, b, bias = randn(gen, 600, 24), randn(gen, 24, 16, scale=0.2), randn(gen, 16)
    check_close(lambda a, b, bias: s.matmul(a, b, bias).t(), lambda a, b, bias: matmul_ref(a, b, bias).t(),
                [a, b, bias], TOL[torch.float32], gen)


def test_cross_entropy_on_padded_logits(s, gen):
    # the training path: lm_head's matmul gives logits with padded rows (97 values), the in-place
    # loss writes their gradient in that layout, and the matmul's backward reads it
    x, w = randn(gen, 2, 5, 16), randn(gen, 97, 16, scale=0.3)
    targets = torch.randint(97, (2, 5), generator=gen).to(DEVICE)
    assert s.matmul(x, w.t(), pad_rows=True).stride() == (5 * 100, 100, 1)
    check_close(lambda x, w: s.cross_entropy(s.matmul(x, w.t(), pad_rows=True), targets,
                                             inplace_backward=True),
                lambda x, w: F.cross_entropy((x @ w.t()).flatten(0, 1), targets.flatten()), [x, w], 1e-5, gen)


def test_cross_entropy_broadcast_logits(s, gen):
    # rows that share memory (an expanded tensor, row stride 0) are copied apart first: written in
    # place, or into a gradient of the same layout, every row would land on the same values
    base, targets = randn(gen, 1, 300), torch.tensor([3, 7, 299, 0], device=DEVICE)
    check_close(lambda b: s.cross_entropy(b.expand(4, 300), targets),
                lambda b: F.cross_entropy(b.expand(4, 300), targets), [base], 1e-5, gen, out_dtype=torch.float32)


def test_matmul_no_bias_no_grad(s, gen):
    a, b = randn(gen, 17, 31), randn(gen, 31, 9)
    with torch.no_grad():
        assert rel_err(s.matmul(a, b, activation="gelu"), gelu_ref(a.double() @ b.double())) < 1e-5


# ------------------------------------------------------------------------------------------------
# cross-entropy
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(7, 1031), (2, 3, 5003)])  # 5,003 spans two 4,096 chunks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_cross_entropy(s, gen, shape, dtype, inplace):
    vocab = shape[-1]
    targets = torch.randint(vocab, shape[:-1], generator=gen).to(DEVICE)
    targets.view(-1)[1] = -100  # ignored: no loss, no gradient, not counted in the mean
    logits = randn(gen, *shape, dtype=dtype, scale=2.0)
    # a non-leaf input (as a model's logits are), so that the in-place backward may overwrite it
    check_close(lambda lg: s.cross_entropy(lg * 1, targets, inplace_backward=inplace),
            lambda lg: F.cross_entropy(lg.flatten(0, -2), targets.flatten()), [logits], TOL[dtype], gen,
            out_dtype=torch.float32)


def test_cross_entropy_inplace_overwrites_logits(s, gen):
    leaf = randn(gen, 5, 300).requires_grad_()
    logits = leaf * 1
    targets = torch.randint(300, (5,), generator=gen).to(DEVICE)
    s.cross_entropy(logits, targets, inplace_backward=True).backward()
    ref = leaf.detach().double().requires_grad_()
    F.cross_entropy(ref, targets).backward()
    assert rel_err(logits.detach(), ref.grad) < 1e-5  # the logits' buffer now holds the gradient
    assert rel_err(leaf.grad, ref.grad) < 1e-5


def test_cross_entropy_strided_targets(s, gen):
    # the training loop's targets are a view, y = tokens[:, 1:]: not contiguous
    tokens = torch.randint(77, (3, 12), generator=gen).to(DEVICE)
    logits = randn(gen, 3, 11, 77)
    targets = tokens[:, 1:]
    assert not targets.is_contiguous()
    ref = F.cross_entropy(logits.double().flatten(0, 1), targets.flatten())
    assert abs(s.cross_entropy(logits, targets).item() - ref.item()) <= 1e-5 * abs(ref.item())


def test_cross_entropy_int32_targets(s, gen):
    logits, targets = randn(gen, 9, 77), torch.randint(77, (9,), generator=gen).to(DEVICE)
    loss = s.cross_entropy(logits, targets.int())
    assert abs(loss.item() - F.cross_entropy(logits.double(), targets).item()) < 1e-5


# ------------------------------------------------------------------------------------------------
# cross-entropy: extreme logits
# ------------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # see test_softmax_extreme_logits
@pytest.mark.parametrize("stage", ["05_triton", "06_flash_attention"])  # 06 changes the wrapper
def test_cross_entropy_extreme_logits(gen, stage):
    # logits near +-1e4 and -inf over two chunks of 4,096 (the second ragged; row 5's first all
    # -inf), targets at the row's max or at its min. lse is kept in fp32: at 1e4 half an ulp is
    # 2^-11 = 5e-4 absolute, up to as much relative error in exp(x - lse), the gradient (measured
    # 5e-5), and absolute error in a row's loss, lse - x[target], whose own rounding at 2e4 adds
    # 2^-10: 1.5e-3 in all (measured 1.2e-3)
    ce = load_stage(stage).cross_entropy
    logits = extreme_rows(gen, 5003, 1e4, torch.float32)
    at_min = torch.tensor([False, True, False, True, True, False], device=DEVICE)  # rows free of -inf
    targets = torch.where(at_min, logits.argmin(-1), logits.argmax(-1))
    check_close(lambda lg: ce(lg * 1, targets), lambda lg: F.cross_entropy(lg, targets), [logits], 1e-3, gen,
                out_dtype=torch.float32)
    for i in range(len(targets)):  # each row's loss alone, the others ignored: the mean hides a small one
        alone = torch.full_like(targets, -100)
        alone[i] = targets[i]
        ref = F.cross_entropy(logits[i:i + 1].double(), targets[i:i + 1]).item()
        assert abs(ce(logits, alone).item() - ref) <= 2e-3, (i, ref)


# ------------------------------------------------------------------------------------------------
# gradcheck-style: finite differences, independent of torch autograd
# ------------------------------------------------------------------------------------------------

def test_directional_derivatives(s, gen):
    x, w, b = randn(gen, 5, 67), randn(gen, 67) + 1.0, randn(gen, 67)
    targets = torch.randint(67, (5,), generator=gen).to(DEVICE)
    check_directional(s.softmax, [x], gen)
    check_directional(s.layer_norm, [x, w, b], gen)
    check_directional(s.rms_norm, [x, w], gen)
    check_directional(s.gelu, [x], gen)
    check_directional(s.swiglu, [x, x.flip(0)], gen)
    check_directional(lambda a, b, c: s.matmul(a, b, c, activation="gelu"), [x, randn(gen, 67, 33, scale=0.1),
                                                                          randn(gen, 33)], gen)
    check_directional(lambda lg: s.cross_entropy(lg, targets), [x], gen)


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------

def test_bad_inputs(s, gen):
    x = randn(gen, 4, 8)
    with pytest.raises(TypeError, match="dtype"):
        s.softmax(x.double())
    with pytest.raises(TypeError, match="dtype"):
        s.gelu(torch.ones(4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="torch.Tensor"):
        s.softmax([1.0, 2.0])
    with pytest.raises(ValueError, match="contiguous"):
        s.softmax(x.t())
    with pytest.raises(ValueError, match="empty"):
        s.layer_norm(x[:0], x[0], x[0])
    with pytest.raises(ValueError, match="weight has shape"):
        s.layer_norm(x, x[0, :5], None)
    with pytest.raises(ValueError, match="bias has shape"):
        s.layer_norm(x, x[0], x[:, 0].contiguous()[:3])
    with pytest.raises(ValueError, match="differ"):
        s.swiglu(x, x[:2])
    with pytest.raises(ValueError, match="differ"):
        s.vector_add(x, x.half())
    with pytest.raises(ValueError, match="cannot multiply"):
        s.matmul(x, x)
    with pytest.raises(ValueError, match="cannot multiply"):
        s.matmul(x, x.view(8, 2, 2))
    with pytest.raises(TypeError, match="share a dtype"):
        s.matmul(x, x.t().bfloat16())
    with pytest.raises(ValueError, match="activation"):
        s.matmul(x, x.t(), activation="relu")
    with pytest.raises(ValueError, match="bias has shape"):
        s.matmul(x, x.t(), bias=x[0])
    targets = torch.tensor([0, 1, 2, 3], device=DEVICE)
    with pytest.raises(ValueError, match=r"lie in \[0, 8\)"):
        s.cross_entropy(x, torch.tensor([0, 1, 8, -100], device=DEVICE))
    with pytest.raises(TypeError, match="int64 or int32"):
        s.cross_entropy(x, targets.float())
    with pytest.raises(ValueError, match="targets have shape"):
        s.cross_entropy(x, targets[:3])
    scalar = x[0, 0]  # 0-dim: the row kernels have no last dimension to work along
    for call in (lambda: s.softmax(scalar), lambda: s.layer_norm(scalar, x[0], None),
                 lambda: s.rms_norm(scalar, x[0]), lambda: s.matmul(scalar, x),
                 lambda: s.cross_entropy(scalar, targets[0])):
        with pytest.raises(ValueError, match="is 0-dim; expected at least 1 dimension"):
            call()


@pytest.mark.gpu
def test_bad_device(s, gen):
    with pytest.raises(ValueError, match="CUDA tensors"):
        s.softmax(torch.randn(4, 8))
    with pytest.raises(ValueError, match="CUDA tensors"):
        s.layer_norm(randn(gen, 4, 8), torch.ones(8), None)


# ------------------------------------------------------------------------------------------------
# the GPT on the kernels
# ------------------------------------------------------------------------------------------------

def tiny_config(s, **overrides):
    return s.GPTConfig(**{"vocab_size": 97, "context_length": 16, "n_embd": 32, "n_head": 2, "n_layer": 2,
                          **overrides})


def train_losses(model, loss_fn, data, steps, autocast=False, lr=1e-2):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    losses = []
    for _ in range(steps):
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def twin_models(s, cfg):
    torch.manual_seed(0)
    ref = s.GPT(cfg).to(DEVICE)
    ours = s.GPT(cfg).to(DEVICE)
    ours.load_state_dict(ref.state_dict())
    return ref, s.use_triton_kernels(ours)


def test_use_triton_kernels_swaps_in_place(s):
    cfg = tiny_config(s)
    ref, ours = twin_models(s, cfg)
    kinds = {type(m) for m in ours.modules()}
    assert {s.TritonLayerNorm, s.TritonLinear, s.TritonMLP, s.TritonAttention} <= kinds
    assert not kinds & {s.LayerNorm, s.MultiHeadAttention, s.MLP, torch.nn.Linear}
    assert ours.lm_head.weight is ours.wte.weight  # tying survives the swap
    idx = torch.randint(cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        assert rel_err(ours(idx), ref(idx)) < 1e-5


def test_gpt_trains_like_torch(s):
    # fp32: the loss curves of the two paths agree to 1e-4 relative over the first steps
    cfg = tiny_config(s)
    ref, ours = twin_models(s, cfg)
    data = torch.randint(cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref_losses = train_losses(ref, s.loss_fn, data, 3)
    our_losses = train_losses(ours, s.triton_loss_fn, data, 3)
    assert ref_losses[-1] < ref_losses[0]  # it learns
    for r, o in zip(ref_losses, our_losses):
        assert abs(r - o) <= 1e-4 * abs(r), (ref_losses, our_losses)


def test_gpt_generates_like_torch(s):
    cfg = tiny_config(s)
    ref, ours = twin_models(s, cfg)
    prompt = torch.tensor([[5, 17, 3]], device=DEVICE)
    expected = s.generate(ref, prompt, max_new_tokens=5)
    assert torch.equal(s.generate(ours, prompt, max_new_tokens=5), expected)


# ------------------------------------------------------------------------------------------------
# the script, end to end
# ------------------------------------------------------------------------------------------------

def test_main_on_the_cpu():
    # `python 05_triton.py` as README runs it: the kernel table against float64 (8 kernels forward,
    # 7 backward), the GPT's logits on the kernels, generation. Triton 3.8's interpreter once
    # crashed it while every test above passed on 3.6. 3 new tokens, not 10: 30 s sooner.
    check_main("05_triton", 8 + 7 + 1, 1e-5, "--max-new-tokens", "3")


# ------------------------------------------------------------------------------------------------
# real sizes on the GPU
# ------------------------------------------------------------------------------------------------

def poison_cache(*tensors):
    """Fill the caching allocator's free blocks with NaN (allocate and free), so that an output
    element the kernel never writes shows up as NaN instead of a stale right answer."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    del tensors
    torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1000, 4096, 16384, 50257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_gpu(s, gen, n, dtype):
    rows = max(64, 2**24 // n)  # 16M elements
    x = randn(gen, rows, n, dtype=dtype, scale=3.0)
    w, b = randn(gen, n, dtype=dtype) + 1.0, randn(gen, n, dtype=dtype)
    poison_cache(x, x)
    check_close(s.softmax, lambda x: torch.softmax(x, -1), [x], TOL[dtype], gen)
    poison_cache(x, x)
    check_close(lambda x, w, b: s.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (n,), w, b), [x, w, b],
            TOL[dtype], gen)
    poison_cache(x, x)
    check_close(s.rms_norm, lambda x, w: F.rms_norm(x, (n,), w, 1e-6), [x, w], TOL[dtype], gen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_matmul_gpu(s, gen, dtype):
    m, k, n = 1023, 777, 2049
    a, w = randn(gen, m, k, dtype=dtype), randn(gen, n, k, dtype=dtype, scale=k ** -0.5)
    bias = randn(gen, n, dtype=dtype)
    poison_cache(a, w)
    check_close(lambda a, w, bias: s.matmul(a, w.t(), bias, "gelu"), lambda a, w, bias: matmul_ref(a, w.t(), bias, "gelu"),
            [a, w, bias], TOL[dtype], gen)
    b = randn(gen, k, n, dtype=dtype, scale=k ** -0.5)
    check_close(lambda a, b: s.matmul(a, b), lambda a, b: a @ b, [a, b], TOL[dtype], gen)


@pytest.mark.gpu
@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
def test_matmul_tma_gpu(s, gen, a_t, b_t):
    a, b = tma_operands(s, gen, 2000, 776, 2056, a_t, b_t, torch.bfloat16)  # 272 tiles of 128 x 128
    bias = randn(gen, 2056, dtype=torch.bfloat16)
    poison_cache(a, b)
    check_close(lambda a, b, bias: s.matmul(a, b, bias, "gelu"), lambda a, b, bias: matmul_ref(a, b, bias, "gelu"),
                [a, b, bias], TOL[torch.bfloat16], gen)


@pytest.mark.gpu
def test_matmul_split_tail_gpu(s, gen):
    # a weight's gradient in GPT-2 124M's training, dy.t() @ x: (3,072 x 16,384) @ (16,384 x 768),
    # 144 tiles of 128 x 128 on 132 SMs: 132 run whole, 12 are cut in K. With the fused epilogue,
    # backward, and the same bits on a second run (the parts are summed in a fixed order)
    dy = randn(gen, 16384, 3072, dtype=torch.bfloat16)
    x = randn(gen, 16384, 768, dtype=torch.bfloat16, scale=16384 ** -0.5)
    assert s._few_tiles_long_k(3072, 768, 16384, s._num_sms(dy.device))
    bias = randn(gen, 768, dtype=torch.bfloat16)
    check_close(lambda a, b, bias: s.matmul(a, b, bias, "gelu"), lambda a, b, bias: matmul_ref(a, b, bias, "gelu"),
                [dy.t(), x, bias], TOL[torch.bfloat16], gen)
    # a weight's gradient is written in its dtype; 768 x 768 has 36 tiles, none whole, cut in 3
    for a, out_dtype in ((dy.t(), torch.float32), (dy.t(), torch.bfloat16), (dy[:, :768].t(), torch.float32)):
        first, second = (s._mm(a, x, torch.empty(a.shape[0], 768, device=dy.device, dtype=out_dtype))
                         for _ in range(2))
        assert torch.equal(first, second)
        assert rel_err(first, a.double() @ x.double()) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_matmul_gpu_small_on_the_tma_kernel(s, gen, monkeypatch):
    # products with fewer tiles than SMs (1024^3: 64 of 128 x 128), and one of 64 rows, on the TMA kernel
    monkeypatch.setattr(s, "_matmul_kernel", None)  # any use of the pointer kernel fails
    for m, n, k in ((1024, 1024, 1024), (64, 8192, 1024)):
        a, b = randn(gen, m, k, dtype=torch.bfloat16), randn(gen, k, n, dtype=torch.bfloat16, scale=k ** -0.5)
        assert rel_err(s.matmul(a, b), a.double() @ b.double()) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_matmul_autotuning_waits_for_queued_work(s, gen):
    """The autotuner times its candidates on a stream of its own, and they write the call's output.
    Here that output takes the memory of x, freed while its last reader still waits behind a long
    kernel: the reader must see x, not a candidate's product (it saw the product before the timing
    waited for the caller's stream, and a check's reference came out wrong that way). Two shapes:
    in a fresh process the first round ran in order anyway (CUDA's first uses synchronize)."""
    for m in (1152, 1216):  # shapes no other test uses, so each call below autotunes
        a = randn(gen, m, 640, dtype=torch.bfloat16)
        b = randn(gen, 640, 1280, dtype=torch.bfloat16, scale=640 ** -0.5)
        s.matmul(a[:m - 128], b)  # tunes another shape of the same specialization: candidates compiled
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # so that x's block is the one free block of its size
        x = torch.full((m, 1280), 3.0, device="cuda", dtype=torch.bfloat16)
        x_ptr = x.data_ptr()
        torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time queued before the reader
        seen = x.float()
        del x
        out = s.matmul(a, b)
        assert out.data_ptr() == x_ptr, "the premise: the output took x's memory"
        torch.cuda.synchronize()
        assert (seen == 3).all(), f"M={m}: x's reader saw {seen.unique()[:4].tolist()}"
        assert rel_err(out, a.double() @ b.double()) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_matmul_gpu_large(s, gen):
    a, b = randn(gen, 4096, 4096, dtype=torch.bfloat16), randn(gen, 4096, 4096, dtype=torch.bfloat16, scale=1 / 64)
    poison_cache(a)
    assert rel_err(s.matmul(a, b), a.double() @ b.double()) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True])
def test_cross_entropy_gpu(s, gen, inplace):
    rows, vocab = 4096, 50257
    targets = torch.randint(vocab, (rows,), generator=gen).to(DEVICE)
    targets[::7] = -100
    logits = randn(gen, rows, vocab, dtype=torch.bfloat16, scale=2.0)
    poison_cache(logits)
    check_close(lambda lg: s.cross_entropy(lg * 1, targets, inplace_backward=inplace),
            lambda lg: F.cross_entropy(lg, targets), [logits], TOL[torch.bfloat16], gen, out_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast,tol", [(False, 1e-3), (True, 2e-2)])
def test_gpt_trains_like_torch_gpu(s, autocast, tol):
    # GPT-2's vocabulary and a narrow model, 10 AdamW steps. The paths round differently (cuBLAS and
    # Triton sum in other orders) and Adam rescales even tiny gradient differences to full steps,
    # so the curves agree to 1e-3 relative in fp32 and 2e-2 under bf16 autocast
    cfg = s.GPTConfig(context_length=128, n_embd=256, n_head=4, n_layer=4)
    ref, ours = twin_models(s, cfg)
    data = torch.randint(cfg.vocab_size, (8, cfg.context_length + 1), generator=torch.Generator().manual_seed(1))
    data = data.to(DEVICE)
    ref_losses = train_losses(ref, s.loss_fn, data, 10, autocast, lr=3e-3)
    our_losses = train_losses(ours, s.triton_loss_fn, data, 10, autocast, lr=3e-3)
    assert ref_losses[-1] < ref_losses[0]
    for r, o in zip(ref_losses, our_losses):
        assert abs(r - o) <= tol * abs(r), (ref_losses, our_losses)
