"""Stage 06: FlashAttention in Triton against a float64 reference.

On a machine without CUDA the kernels run through Triton's interpreter, in float32 and float16
(the 3.6 interpreter multiplies bfloat16 bit patterns as integers in tl.dot, so bfloat16 is
tested on the GPU only). Every result is compared with `naive_attention` run in float64, which
is itself checked against torch's scaled_dot_product_attention.
"""
import itertools
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, ROOT, check_main, load_stage


@pytest.fixture(scope="module")
def fa():
    return load_stage("06_flash_attention")


DEVICE = "cuda" if HAS_CUDA else "cpu"
# float32 errors: ~2e-7 through the interpreter (exact float32 products), ~1e-6 on the GPU
# (products as three tf32 products); a wrong result is off by O(1)
F32_TOL = 2e-5


def rel_err(x, ref):
    """||x - ref|| / ||ref|| over the finite entries of ref (the -inf lse of empty rows excluded),
    where ||ref|| is at least that of a unit-RMS tensor, the scale of the inputs and of dout.
    Some references are exactly 0 (dq of a query that sees one key, dk when S = 1: P is constant)
    and what is computed there is rounding, which only an absolute scale can judge."""
    x, ref = x.double(), ref.double()
    finite = torch.isfinite(ref)
    floor = max(int(finite.sum()), 1) ** 0.5
    return ((x[finite] - ref[finite]).norm() / ref[finite].norm().clamp_min(floor)).item()


def make_qkv(B, Hq, Hkv, T, S, D, dtype, device=DEVICE, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=gen)
    k = torch.randn(B, Hkv, S, D, generator=gen)
    v = torch.randn(B, Hkv, S, D, generator=gen)
    return [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v)]


def reference(fa, q, k, v, causal, sm_scale, dout, dtype=torch.float64):
    """out, lse and (dq, dk, dv) of the naive attention computed in `dtype`."""
    q64, k64, v64 = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out, lse = fa.naive_attention(q64, k64, v64, causal, sm_scale)
    out.backward(dout.to(dtype))
    return out, lse, (q64.grad, k64.grad, v64.grad)


def check_against_reference(fa, B, Hq, Hkv, T, S, D, causal, dtype, tol_out, tol_grad,
                            sm_scale=None):
    q, k, v = make_qkv(B, Hq, Hkv, T, S, D, dtype, seed=T * 1000 + S)
    out, lse = fa.flash_attention_with_lse(q, k, v, causal=causal, sm_scale=sm_scale)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_out, ref_lse, ref_grads = reference(fa, q, k, v, causal, sm_scale, dout)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (B, Hq, T)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows that see no key: lse -inf"
    assert rel_err(out, ref_out) < tol_out, f"out {rel_err(out, ref_out):.2e}"
    assert rel_err(lse, ref_lse) < tol_out, f"lse {rel_err(lse, ref_lse):.2e}"
    for name, ours, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref_grads):
        assert torch.isfinite(ours).all(), f"{name} has NaN or inf"
        assert rel_err(ours, ref) < tol_grad, f"{name} {rel_err(ours, ref):.2e}"


# ---------------------------------------------------------------------------- the references
# (B, Hq, Hkv, T, S, D, causal). GRID: every pair of the awkward lengths {1, 17, 67, 129, 300}
# for T and S under both masks (T < S: bottom-right causal; T > S: queries that see no key), with
# GQA ratios 1, 2, 4 in turn (Hq/Hkv = 2/2, 4/2, 4/1: two kv heads, so a wrong head mapping
# shows). CASES: batch 2, other head sizes, and S = 256 (a multiple of 128: the forward's
# single-loop path).
SIZES = (1, 17, 67, 129, 300)
HEADS = ((2, 2), (4, 2), (4, 1))  # (Hq, Hkv): GQA ratios 1, 2, 4
GRID = [(1, *HEADS[i % 3], T, S, 32, causal)
        for i, (T, S, causal) in enumerate(itertools.product(SIZES, SIZES, (True, False)))]
CASES = [
    (2, 4, 1, 17, 17, 32, True),
    (1, 4, 2, 67, 129, 32, True),
    (1, 2, 2, 129, 67, 32, True),
    (1, 4, 1, 1, 300, 32, True),
    (1, 2, 1, 300, 17, 64, False),
    (1, 4, 2, 67, 256, 32, False),
]


@pytest.mark.parametrize("case", CASES + [(1, 4, 4, 300, 300, 64, True)])
def test_naive_matches_torch_sdpa(fa, case):
    B, Hq, Hkv, T, S, D, causal = case
    q, k, v = (x.detach().double() for x in make_qkv(B, Hq, Hkv, T, S, D, torch.float64, "cpu"))
    out, _ = fa.naive_attention(q, k, v, causal)
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T) if causal else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    seen = slice(max(T - S, 0), T) if causal else slice(0, T)  # SDPA gives NaN for empty rows
    assert rel_err(out[:, :, seen], ref[:, :, seen]) < 1e-12
    assert (out[:, :, :seen.start] == 0).all()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_n", [16, 64])
def test_tiled_torch_matches_naive(fa, case, block_n):
    B, Hq, Hkv, T, S, D, causal = case
    q, k, v = (x.detach() for x in make_qkv(B, Hq, Hkv, T, S, D, torch.float64, "cpu"))
    out, lse = fa.tiled_attention_torch(q, k, v, causal, block_n=block_n)
    ref_out, ref_lse = fa.naive_attention(q, k, v, causal)
    assert rel_err(out, ref_out) < 1e-6 and rel_err(lse, ref_lse) < 1e-6  # its math runs in fp32
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))


# ----------------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("case", GRID + CASES)
def test_flash_float32_matches_float64(fa, case):
    check_against_reference(fa, *case, torch.float32, tol_out=F32_TOL, tol_grad=F32_TOL)


def test_flash_float16(fa):
    # probabilities and gradients pass through float16 on their way into the matmuls
    check_against_reference(fa, 1, 4, 2, 67, 129, 64, True, torch.float16, tol_out=2e-3,
                            tol_grad=5e-3)


def test_flash_head_dims_and_scale(fa):
    for D in (128, 256):  # (on a GPU, float32 at D=256 runs on its float32_only tiles)
        check_against_reference(fa, 1, 2, 1, 17, 67, D, True, torch.float32, F32_TOL, F32_TOL,
                                sm_scale=0.3)


def test_warp_specialized_tile_only_on_the_one_loop_path(fa, monkeypatch):
    # Offered where the forward has one key loop (non-causal, S a multiple of 128): Triton 3.6
    # fails to compile a warp-specialized kernel with two. Pinned anyway, as here (where the
    # interpreter ignores the request), the kernel runs its loops plain and still agrees.
    ws = fa._config(32, 16, 4, 1, fa.HEAD_DIMS, warp_specialize=True)
    plain = fa._config(32, 16, 4, 1, fa.HEAD_DIMS)
    for causal, even_s, offered in [(False, True, True), (False, False, False), (True, True, False)]:
        kept = fa._prune_configs([plain, ws], None, D=64, CAUSAL=causal, EVEN_S=even_s)
        assert kept == ([plain, ws] if offered else [plain])
    assert fa._prune_configs([plain, ws], None, D=64, CAUSAL=False) == [plain]  # backward kernels
    monkeypatch.setattr(fa._flash_fwd_kernel, "configs", [ws])
    monkeypatch.setattr(fa._flash_fwd_kernel, "cache", {})
    for T, S, causal in [(40, 128, False), (40, 50, True)]:
        check_against_reference(fa, 1, 2, 1, T, S, 32, causal, torch.float32, F32_TOL, F32_TOL)


# Scripts that compile the flash kernels for an H100/H200 (sm_90) on any machine (TTGIR and PTX
# need no GPU), each run on 06 in a process of its own (compile_for_sm90).
SM90_PRELUDE = r"""
import importlib.util, math, re, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.tensor_descriptor import TensorDescriptor
spec = importlib.util.spec_from_file_location("fa", sys.argv[1])
fa = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fa)


def compile_sm90(kernel, config, consts, dtype):
    # kernel compiled for sm_90 with config, the constexprs in consts and tensors of dtype ("bf16"
    # or "fp32"); each descriptor's tile as the config's pre_hook (_tile_rows) sets it at launch
    D = consts["D"]
    x = torch.empty(1, 1, 128, D, dtype=dict(bf16=torch.bfloat16, fp32=torch.float32)[dtype])
    args = {name: TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, 1, D])
            for name in kernel.arg_names if name.endswith("_desc")}
    consts = {k: v for k, v in dict(consts, **config.kwargs).items() if k in kernel.arg_names}
    config.pre_hook({**args, **consts})
    sig = {name: "i32" for name in kernel.arg_names}
    sig.update({name: "tensordesc<%s[%s]>" % (dtype, ", ".join(map(str, d.block_shape)))
                for name, d in args.items()})
    types = dict(Q="*" + dtype, O="*" + dtype, LSE2="*fp32", DELTA="*fp32", qk_scale="fp32", sm_scale="fp32")
    sig.update({name: t for name, t in types.items() if name in sig})
    sig.update(dict.fromkeys(consts, "constexpr"))
    source = ASTSource(kernel, signature=sig, constexprs={
        (kernel.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(
        num_warps=config.num_warps, num_stages=config.num_stages))
"""
# The warp-specialized forward tiles: prints, per TMA copy, the elements of the descriptor's tile
# and of the shared-memory buffer it fills, and how the output leaves.
SM90_COPIES = SM90_PRELUDE + r"""
kernel = fa._flash_fwd_kernel.fn
for config in [c for c in fa._FWD_CONFIGS if c.kwargs.get("WARP_SPECIALIZE")]:
    consts = dict(D=max(config.head_dims), CAUSAL=False, EVEN_S=True, DOT_PRECISION="tf32")
    ttgir = compile_sm90(kernel, config, consts, "bf16").asm["ttgir"]
    print(config, "warp_specialize", "ttg.warp_specialize" in ttgir)
    for line in ttgir.splitlines():
        if "async_tma_copy_global_to_local" in line:
            tile = re.search(r"tensordesc<(?:tensor<)?([0-9x]+)x\w+", line).group(1)
            buffer = re.search(r"-> !ttg.memdesc<([0-9x]+)x\w+", line).group(1)
            print("copy", *(math.prod(map(int, dims.split("x"))) for dims in (tile, buffer)))
        if re.search(r"tt\.store .*: tensor<\d+x\d+x!tt\.ptr", line):
            print("2-D pointer store")
        if "async_tma_copy_local_to_global" in line:
            print("descriptor store")
"""


def compile_for_sm90(tmp_path, script_text):
    """Run one of the SM90_ scripts on 06 in a fresh process, Triton's interpreter off (it
    compiles for sm_90 without a GPU); its stdout."""
    pytest.importorskip("triton.backends.nvidia")
    script = tmp_path / "sm90.py"
    script.write_text(script_text)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, str(script), str(ROOT / "06_flash_attention.py")],
                         capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_warp_specialized_tile_copies_whole_tiles(tmp_path):
    """Triton 3.6 splits a warp-specialized tile's query block between two consumer warpgroups
    and copies each half through the query's descriptor. A host-built descriptor keeps the whole
    block's tile: the copy then fills twice what its barrier waits for, and the kernel hangs on
    the GPU (seen on the H200; Triton 3.8 refuses to compile it). Each TMA copy of the compiled
    forward must fill exactly its buffer. Its output, split the same way, gave wrong rows and an
    illegal address through a masked pointer store: it must leave through a descriptor store."""
    stdout = compile_for_sm90(tmp_path, SM90_COPIES)
    lines = stdout.splitlines()
    assert any(line.endswith("warp_specialize True") for line in lines), stdout
    copies = [tuple(map(int, line.split()[1:])) for line in lines if line.startswith("copy ")]
    assert len(copies) >= 3, stdout  # the query's, a key's and a value's
    assert all(tile == buffer for tile, buffer in copies), stdout
    assert "descriptor store" in lines and "2-D pointer store" not in lines, stdout


# Each flash kernel's float32 tile at D=256: prints its wgmma and mma.sync instructions.
SM90_FLOAT32 = SM90_PRELUDE + r"""
for kernel, configs in [(fa._flash_fwd_kernel, fa._FWD_CONFIGS), (fa._flash_bwd_dkdv_kernel, fa._DKDV_CONFIGS),
                        (fa._flash_bwd_dq_kernel, fa._DQ_CONFIGS)]:
    (config,) = fa._prune_configs(configs, None, D=256, CAUSAL=True, DOT_PRECISION="tf32x3")
    consts = dict(D=256, CAUSAL=True, EVEN_S=False, WARP_SPECIALIZE=False, DOT_PRECISION="tf32x3")
    ptx = compile_sm90(kernel.fn, config, consts, "fp32").asm["ptx"]
    print(kernel.fn.__name__, "wgmma", ptx.count("wgmma.mma_async"), "mma.sync", ptx.count("mma.sync"))
"""


def test_float32_tiles_at_d256_avoid_wgmma(tmp_path):
    """float32 at D=256 on the 8-warp tiles compiled to wgmma products, and the dK/dV kernel then
    read outside shared memory on the H200 (compute-sanitizer). float32 inputs get a 4-warp tile
    of their own there (float32_only), which must compile to mma.sync, with no wgmma, in each of
    the three kernels."""
    stdout = compile_for_sm90(tmp_path, SM90_FLOAT32)
    counts = [line.split() for line in stdout.splitlines() if " wgmma " in line]
    assert len(counts) == 3, stdout
    assert all(int(c[2]) == 0 and int(c[4]) > 0 for c in counts), stdout


def test_float32_inputs_take_one_configuration(fa):
    # float32 inputs are for checking, and each of their compiles takes seconds: every flash
    # kernel gets DOT_PRECISION, "tf32x3" for them only, and the pruning keeps their first tile
    tiles = [fa._config(64, 64, 4, 2), fa._config(128, 64, 4, 3)]
    assert fa._dot_precision(torch.float32) == "tf32x3"
    for dtype in (torch.bfloat16, torch.float16):
        assert fa._dot_precision(dtype) != "tf32x3"
    for precision, kept in (("tf32x3", tiles[:1]), ("tf32", tiles)):
        assert fa._prune_configs(tiles, None, D=64, CAUSAL=True, DOT_PRECISION=precision) == kept
    # where their head size has a float32_only tile, they get that one, and other dtypes never do
    f32 = fa._config(32, 16, 4, 1, (64,), float32_only=True)
    for precision, kept in (("tf32x3", [f32]), ("tf32", tiles)):
        assert fa._prune_configs(tiles + [f32], None, D=64, CAUSAL=True,
                                 DOT_PRECISION=precision) == kept


def test_fully_masked_rows_give_zero_and_no_nan(fa):
    # causal with T > S: the first T - S queries see no key
    T, S = 67, 17
    q, k, v = make_qkv(1, 2, 1, T, S, 32, torch.float32)
    out, lse = fa.flash_attention_with_lse(q, k, v, causal=True)
    out.sum().backward()
    empty = slice(0, T - S)
    assert (out[:, :, empty] == 0).all() and (lse[:, :, empty] == float("-inf")).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, T - S:]).all()
    for grad in (q.grad, k.grad, v.grad):
        assert torch.isfinite(grad).all()
    assert (q.grad[:, :, empty] == 0).all()


# ------------------------------------------------------------ scores in the thousands
# Scores of randn inputs are O(1), where exp never overflows: a forward that skipped subtracting
# the running max would pass the tests above. Here q and k share one large coordinate, so each
# score is +-1e3 (the sign alternating by query row) plus O(1): the positive rows overflow exp
# without their max, and their max grows with every key block (k's coordinate ramps up along S);
# the negative rows underflow to a zero sum. The reference is torch's SDPA in float64 (lse by
# torch.logsumexp). fp32 holds a score of 1e3 to ~1e3 * 2^-24 = 6e-5, which exp turns into as
# much relative error of P (measured <= 6e-5, in dk, through the interpreter; the large coordinates
# are multiples of 1/16, exact in tf32, so the GPU's tf32x3 products of them are exact): bound
# 2e-3. An overflow gives inf or NaN.

def large_score_qkv(B, Hq, Hkv, T, S, D, peak=1e3):
    gen = torch.Generator().manual_seed(T * 1000 + S)
    q, k, v = (torch.randn(B, H, L, D, generator=gen, dtype=torch.float64)
               for H, L in ((Hq, T), (Hkv, S), (Hkv, S)))
    a = (peak * D**0.5) ** 0.5  # q_0 * k_0 * D^-0.5 = peak
    q[..., 0] = (a * torch.tensor([16.0, -16.0], dtype=torch.float64).repeat(T)[:T]).round() / 16
    k[..., 0] = (a * torch.linspace(15.84, 16.0, S, dtype=torch.float64)).round() / 16
    return [x.to(device=DEVICE, dtype=torch.float32).requires_grad_() for x in (q, k, v)]


# keys past S read as 0 and score 0, far above a negative row's lse: the backward's exp2 overflows
# there before the mask zeroes it, and numpy warns
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
# (B, Hq, Hkv, T, S, D, causal): causal with GQA, both key loops; then S % 128 == 0 without the
# mask, the forward's unmasked loop alone
@pytest.mark.parametrize("case", [(1, 2, 1, 67, 129, 32, True), (1, 2, 2, 40, 128, 32, False)])
def test_flash_large_scores(fa, case):
    B, Hq, Hkv, T, S, D, causal = case
    q, k, v = large_score_qkv(B, Hq, Hkv, T, S, D)
    out, lse = fa.flash_attention_with_lse(q, k, v, causal=causal)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out.backward(dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T) if causal else None
    ref = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, enable_gqa=True)
    ref.backward(dout.double())
    scores = (q64 @ k64.repeat_interleave(Hq // Hkv, dim=1).transpose(-2, -1)).detach() * D**-0.5
    scores = scores if mask is None else scores.masked_fill(~mask, float("-inf"))
    assert scores.amax() > 900 and scores.amin() < -900
    for name, ours, want in (("out", out, ref), ("lse", lse, torch.logsumexp(scores, dim=-1)),
                             ("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad),
                             ("dv", v.grad, v64.grad)):
        assert torch.isfinite(ours).all(), f"{name} has NaN or inf"
        assert rel_err(ours, want) < 2e-3, f"{name} {rel_err(ours, want):.2e}"


def test_gpt_layout_views(fa):
    # flash_attention on the GPT's views of one (B, T, 3C) projection: (B, H, T, D) with strides
    # (3TC, D, 3C, 1), the output read back as (B, T, C) (FlashAttention takes the projection
    # whole: test_flash_attention_hands_back_one_qkv_gradient)
    B, T, H, D = 2, 67, 2, 32
    qkv = torch.randn(B, T, 3 * H * D, device=DEVICE, requires_grad=True)
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
    out = fa.flash_attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_out, _, ref_grads = reference(fa, q, k, v, True, None, dout)
    assert rel_err(out, ref_out) < F32_TOL
    assert out.transpose(1, 2).is_contiguous()  # merging heads back to (B, T, C) is a view
    ref_qkv_grad = torch.cat([g.transpose(1, 2).reshape(B, T, H * D) for g in ref_grads], dim=2)
    assert rel_err(qkv.grad, ref_qkv_grad) < F32_TOL
    # the gradients come back in the same (B, T, H, D) order, so the head split's backward is views
    _, lse = fa.flash_attention_with_lse(q, k, v, causal=True)
    grads = fa._flash_backward(dout, q, k, v, out, lse / fa.LN2, True, D ** -0.5)
    assert all(g.transpose(1, 2).is_contiguous() for g in grads)
    assert fa._empty_grad(torch.empty(B, H, T, D)).is_contiguous()  # other layouts: contiguous


def test_flash_attention_hands_back_one_qkv_gradient(fa, monkeypatch):
    # The GPT's FlashAttention takes its (B, T, 3C) projection whole: the backward kernels write
    # dq, dk, dv into the thirds of one gradient, which reaches c_attn as it is, with no copy
    # (autograd's backward of the split would concatenate three). It equals bit for bit the one
    # through flash_attention on the split's views (the same kernels), and the float64 reference.
    B, T, H, D = 2, 67, 2, 32
    torch.manual_seed(0)
    attn = fa.FlashAttention(H * D, H, context_length=T).to(DEVICE)
    x, dy = torch.randn(2, B, T, H * D, device=DEVICE)
    qkv_grads, written = [], []  # what c_attn's output receives; the kernels' dq, dk, dv
    backward = fa._flash_backward

    def keep_qkv_grad(module, inputs, qkv):
        qkv.register_hook(qkv_grads.append)

    def flash_backward(*args):
        written.extend(backward(*args))
        return written[-3:]

    attn.c_attn.register_forward_hook(keep_qkv_grad)
    monkeypatch.setattr(fa, "_flash_backward", flash_backward)
    attn(x).backward(dy)
    [grad] = qkv_grads
    assert [g.data_ptr() for g in written] == [
        grad.data_ptr() + i * H * D * grad.element_size() for i in range(3)]

    def attention_then_c_proj(qkv, attention):  # MultiHeadAttention.forward after c_attn
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
        y = attention(q, k, v).transpose(1, 2).reshape(B, T, H * D)  # causal; (B, T, C)
        return F.linear(y, attn.c_proj.weight.to(qkv.dtype), attn.c_proj.bias.to(qkv.dtype))

    qkv = attn.c_attn(x).detach().requires_grad_()
    attention_then_c_proj(qkv, fa.flash_attention).backward(dy)
    assert torch.equal(grad, qkv.grad)
    qkv64 = qkv.detach().double().requires_grad_()
    attention_then_c_proj(qkv64, lambda *qkv: fa.naive_attention(*qkv)[0]).backward(dy.double())
    assert rel_err(grad, qkv64.grad) < F32_TOL


@pytest.mark.parametrize("bad, error, match", [
    (lambda q, k, v: (q[0], k, v), ValueError, "4-D"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch"),
    (lambda q, k, v: (q, k, v[:, :, :5]), ValueError, "same shape"),
    (lambda q, k, v: (q[:, :3], k[:, :2], v[:, :2]), ValueError, "multiple of kv heads"),
    (lambda q, k, v: (q[..., :48], k[..., :48], v[..., :48]), ValueError, "head size"),
    (lambda q, k, v: (q[..., :16], k, v), ValueError, "head sizes differ"),
    (lambda q, k, v: (q, k.half(), v), TypeError, "share a dtype"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "not supported"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, "not supported"),
    (lambda q, k, v: (q.numpy(), k, v), TypeError, "torch.Tensor"),
    (lambda q, k, v: (q[:, :, :0], k, v), ValueError, "empty"),
])
def test_bad_inputs_raise(fa, bad, error, match):
    q, k, v = (x.detach().cpu() for x in make_qkv(2, 4, 2, 17, 17, 64, torch.float32, "cpu"))
    with pytest.raises(error, match=match):
        fa.flash_attention(*bad(q, k, v))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"sm_scale": 0.0}, ValueError, "sm_scale must be positive and finite"),
    ({"sm_scale": -0.5}, ValueError, "sm_scale must be positive and finite"),
    ({"sm_scale": float("inf")}, ValueError, "sm_scale must be positive and finite"),
    ({"sm_scale": float("nan")}, ValueError, "sm_scale must be positive and finite"),
    ({"sm_scale": "0.1"}, TypeError, "sm_scale must be a number or None"),
    ({"sm_scale": torch.tensor(0.1)}, TypeError, "sm_scale must be a number or None"),
    ({"sm_scale": True}, TypeError, "sm_scale must be a number or None"),
    ({"causal": "yes"}, TypeError, "causal must be True or False"),
    ({"causal": 1}, TypeError, "causal must be True or False"),
    ({"causal": None}, TypeError, "causal must be True or False"),
])
def test_bad_causal_or_scale_raises(fa, kwargs, error, match):
    q, k, v = make_qkv(1, 2, 2, 17, 17, 32, torch.float32)
    with pytest.raises(error, match=match):
        fa.flash_attention(q, k, v, **kwargs)


# ------------------------------------------------------------------------------- the model
def test_gpt_with_flash_attention_matches_attend(fa):
    # The same small GPT, once with the explicit-mask attend and once with the flash kernel:
    # logits and every parameter gradient agree.
    torch.manual_seed(0)
    cfg = fa.GPTConfig(vocab_size=97, context_length=40, n_embd=64, n_head=2, n_layer=2)
    model = fa.GPT(cfg).to(DEVICE)
    idx = torch.randint(0, cfg.vocab_size, (2, 37), device=DEVICE)
    targets = torch.randint(0, cfg.vocab_size, (2, 37), device=DEVICE)

    def run():
        model.zero_grad()
        logits = model(idx)
        fa.loss_fn(logits, targets).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_logits, ref_grads = run()
    fa.use_flash_attention(model)
    logits, grads = run()
    assert rel_err(logits, ref_logits) < F32_TOL
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) < F32_TOL, name


def test_flash_attend_refuses_dropout(fa):
    cfg = fa.GPTConfig(vocab_size=97, context_length=40, n_embd=64, n_head=2, n_layer=1,
                       dropout=0.1)
    model = fa.use_flash_attention(fa.GPT(cfg).to(DEVICE))
    with pytest.raises(ValueError, match="dropout"):
        model(torch.zeros(1, 5, dtype=torch.long, device=DEVICE))
    model.eval()
    assert model(torch.zeros(1, 5, dtype=torch.long, device=DEVICE)).shape == (1, 5, 97)


def test_matmul_under_autocast_keeps_gradient_dtypes(fa):
    """Under bf16 autocast, matmul of fp32 a, weight and bias: the output is bf16, and the
    gradients come back in fp32 straight from the kernels' fp32 sums, not rounded to bf16 and
    cast back (which is what autocast outside the function would give: about 2e-3 off). Against
    the same product in fp32 on the bf16-rounded inputs, whose products are exact in fp32."""
    gen = torch.Generator().manual_seed(0)
    a, w, dout = (torch.randn(*shape, generator=gen).to(DEVICE) for shape in ((40, 48), (24, 48),
                                                                              (40, 24)))
    bias = torch.randn(24, generator=gen).to(DEVICE)
    leaves = [t.clone().requires_grad_() for t in (a, w, bias)]
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        out = fa.matmul(leaves[0], leaves[1].t(), leaves[2])
    dout = dout.to(torch.bfloat16)
    out.backward(dout)
    a16, w16, b16 = (t.to(torch.bfloat16).float() for t in (a, w, bias))
    assert out.dtype == torch.bfloat16
    # one unit in bf16's last place (the interpreter truncates to bf16, the GPU rounds)
    torch.testing.assert_close(out.float(), a16 @ w16.t() + b16, rtol=2 ** -7, atol=1e-5)
    for leaf, ref in zip(leaves, (dout.float() @ w16, dout.float().t() @ a16, dout.float().sum(0))):
        assert leaf.grad.dtype == torch.float32 and leaf.grad.shape == leaf.shape
        assert rel_err(leaf.grad, ref) < 1e-5


@pytest.mark.parametrize("layout", ["contiguous", "padded rows", "transposed dy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_backward_sums_the_bias_gradient(fa, layout, dtype):
    """dh = dy * gelu'(x) and the bias gradient, dh's column sums, from one pass over x and dy
    (_gelu_backward_with_bias), against float64 torch (the tanh GELU's derivative): 37 x 300 (one
    row tile, ragged in both directions), 130 x 300 in buffers with padded rows (a matmul's GELU
    input may be, see _empty_aligned_rows), and a transposed dy. Bounds as stage 05's: 1e-5 in
    fp32, 1e-2 in bf16 (dh rounded to 8 bits; the sums add the rounded values)."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    gen = torch.Generator().manual_seed(0)
    rows = 37 if layout == "contiguous" else 130
    x, dy = ((torch.randn(rows, 307, generator=gen) * 2).to(DEVICE, dtype)[:, :300]
             for _ in range(2))  # rows 307 values apart
    if layout == "contiguous":
        x, dy = x.contiguous(), dy.contiguous()
    if layout == "transposed dy":
        dy = dy.t().contiguous().t()  # strides (1, 130)
    x64 = x.double().requires_grad_()
    F.gelu(x64, approximate="tanh").backward(dy.double())
    for bias_dtype in (torch.float32, dtype):
        dh, dbias = fa._gelu_backward_with_bias(x, dy, bias_dtype)
        assert dh.dtype == dtype and dh.is_contiguous() and dbias.dtype == bias_dtype
        assert rel_err(dh, x64.grad) < tol, f"dh {rel_err(dh, x64.grad):.2e}"
        assert rel_err(dbias, x64.grad.sum(0)) < tol, f"dbias {rel_err(dbias, x64.grad.sum(0)):.2e}"


def test_matmul_gelu_bias_gradient(fa, monkeypatch):
    """matmul's GELU epilogue with a bias (rows padded to 16 bytes, 301 fp32 values to 304): every
    gradient matches float64 torch, the bias's through _gelu_backward_with_bias; without the
    bias's gradient, through the plain GELU backward."""
    gen = torch.Generator().manual_seed(0)
    a, w, bias, dout = (torch.randn(*shape, generator=gen).to(DEVICE)
                        for shape in ((45, 48), (48, 301), (301,), (45, 301)))
    calls = []
    with_bias = fa._gelu_backward_with_bias
    monkeypatch.setattr(fa, "_gelu_backward_with_bias",
                        lambda *args: calls.append(1) or with_bias(*args))
    for bias_grad in (True, False):
        ours = [a.clone().requires_grad_(), w.clone().requires_grad_(),
                bias.clone().requires_grad_(bias_grad)]
        out = fa.matmul(*ours, activation="gelu", pad_rows=True)
        assert out.stride(0) == 304
        out.backward(dout)
        ref = [t.double().requires_grad_() for t in (a, w, bias)]
        F.gelu(ref[0] @ ref[1] + ref[2], approximate="tanh").backward(dout.double())
        for o, r in zip(ours, ref):
            assert (o.grad is None) == (o is ours[2] and not bias_grad)
            assert o.grad is None or rel_err(o.grad, r.grad) < F32_TOL
        assert len(calls) == 1  # the first run's


@pytest.mark.parametrize("n, r_dtype", [(48, torch.float32), (48, torch.bfloat16),
                                        (1100, torch.float32)])  # 1,100: the unfused path
def test_add_layer_norm(fa, n, r_dtype):
    """(x + r, layer_norm(x + r)) and the gradients of x, r, weight and bias, with both outputs
    used and with one only, against the same sum and norm done apart (torch's add, layer_norm):
    the same to fp32 rounding (bitwise under the interpreter; the H200's compiled kernels differ
    in the last bits), but for a bf16 r's gradient: one unit in its last place, as the fp32
    value it is rounded from may differ in its last bits (and the interpreter's bf16 rounding
    truncates where the GPU's rounds to nearest)."""
    gen = torch.Generator().manual_seed(n)
    x, r, ds, dy = (torch.randn(5, 3, n, generator=gen).to(DEVICE) for _ in range(4))
    w, b = (torch.randn(n, generator=gen).to(DEVICE) for _ in range(2))
    ulp = 2.0 ** -7 if r_dtype == torch.bfloat16 else 0.0
    for used in ("both", "sum", "norm"):
        results = []
        for fused in (True, False):
            leaves = [t.detach().clone().requires_grad_() for t in (x, r.to(r_dtype), w, b)]
            if fused:
                s, y = fa.add_layer_norm(*leaves, 1e-5)
            else:
                s = leaves[0] + leaves[1]
                y = fa.layer_norm(s, *leaves[2:], 1e-5)
            loss = (s * ds).sum() * (used != "norm") + (y * dy).sum() * (used != "sum")
            loss.backward()
            results.append([s, y] + [t.grad for t in leaves])
        for name, ours, ref in zip(("s", "y", "dx", "dr", "dw", "db"), *results):
            if ref is None:
                assert ours is None or not ours.any(), name
            elif name == "dr":
                torch.testing.assert_close(ours, ref, rtol=max(ulp, 1e-5), atol=1e-6,
                                           msg=f"dr, {used} used")
            else:
                torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6,
                                           msg=f"{name}, {used} used")
    with pytest.raises(ValueError, match="must have x's shape"):
        fa.add_layer_norm(x, r[:2], w, b)
    with pytest.raises(ValueError, match="a dtype that x's"):
        fa.add_layer_norm(x.to(torch.float16), r, w, b)


def test_triton_gpt_fuses_the_residual_adds(fa, monkeypatch):
    """use_triton_kernels makes a GPT a TritonGPT, whose residual adds are done by the norms:
    2 per block and ln_f's, less the first block's ln_1 (no add before it). Its logits and
    gradients equal, to fp32 rounding, the same Triton twins run through GPT.forward, one add
    at a time, and torch's own model's."""
    cfg = fa.GPTConfig(vocab_size=97, context_length=16, n_embd=32, n_head=2, n_layer=2,
                       dropout=0.0)
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    torch.manual_seed(0)
    plain = fa.GPT(cfg).to(DEVICE)
    fused, apart = (fa.use_triton_kernels(fa.GPT(cfg).to(DEVICE)) for _ in range(2))
    fused.load_state_dict(plain.state_dict())
    apart.load_state_dict(plain.state_dict())
    apart.__class__ = fa.GPT  # the twins' layers, GPT.forward's adds
    assert type(fused) is fa.TritonGPT
    calls = []
    add_layer_norm = fa.add_layer_norm
    monkeypatch.setattr(fa, "add_layer_norm",
                        lambda *a, **k: calls.append(1) or add_layer_norm(*a, **k))
    outputs = []
    for model in (fused, apart, plain):
        logits = model(idx)
        logits.square().mean().backward()
        outputs.append([logits] + [p.grad for p in model.parameters()])
    assert len(calls) == 2 * cfg.n_layer
    for ours, same, ref in zip(*outputs):
        torch.testing.assert_close(ours, same, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_main_on_the_cpu():
    # `python 06_flash_attention.py` as README runs it: stage 05's kernel table (8 kernels forward,
    # 7 backward), the GPT's logits on the Triton kernels and flash attention, generation
    # and chapter 15: the online softmax of one row, then naive, tiled and flash attention
    out = check_main("06_flash_attention", 8 + 7 + 1, F32_TOL, "--max-new-tokens", "3")
    diff = re.search(r"exp\(x - m\) / l vs torch.softmax: max abs diff (\S+)", out)
    assert diff and float(diff[1]) < 1e-6, out
    table = dict(re.findall(r"^  (naive|tiled|flash) +(\S+ +\S+ +\S+ +\S+ +\S+)$", out, re.MULTILINE))
    assert table.keys() == {"naive", "tiled", "flash"}, out
    assert all(float(e) < 1e-5 for row in table.values() for e in row.split()), table


# ------------------------------------------------------------------------------- on the GPU
# bf16/fp16 against the naive attention in float32 on the same (rounded) inputs. Tolerances:
# bf16 keeps 8 bits of mantissa, so rounding P to bf16 before P @ V and the output to bf16 gives
# ~4e-3 relative error; gradients, which sum T or S such terms, ~1e-2.
GPU_TOL = {torch.bfloat16: (1.5e-2, 3e-2), torch.float16: (3e-3, 6e-3)}
GPU_CASES = [  # (B, Hq, Hkv, T, S, D, causal)
    (2, 8, 2, 1000, 1000, 128, True),
    (2, 8, 2, 1000, 1000, 128, False),
    (2, 8, 8, 1000, 1500, 64, True),
    (2, 8, 4, 1500, 1000, 128, True),
    (2, 8, 1, 1024, 1024, 64, False),
    (1, 4, 2, 777, 2048, 32, False),
    (1, 4, 4, 1, 4096, 128, True),
    (1, 4, 2, 300, 300, 256, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_matches_float32_reference(fa, case, dtype):
    B, Hq, Hkv, T, S, D, causal = case
    q, k, v = make_qkv(B, Hq, Hkv, T, S, D, dtype, seed=T + S + D)
    out, lse = fa.flash_attention_with_lse(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_out, ref_lse, ref_grads = reference(fa, q, k, v, causal, None, dout, torch.float32)
    tol_out, tol_grad = GPU_TOL[dtype]
    assert rel_err(out, ref_out) < tol_out and rel_err(lse, ref_lse) < 1e-4
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    for ours, ref in zip((q.grad, k.grad, v.grad), ref_grads):
        assert torch.isfinite(ours).all() and rel_err(ours, ref) < tol_grad


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(2, 8, 2, 1000, 1000, 128, True), (1, 4, 1, 129, 300, 64, False)])
def test_gpu_float32_is_precise(fa, case):
    # at real sizes, and where plain tf32 products would give ~1e-3
    check_against_reference(fa, *case, torch.float32, tol_out=F32_TOL, tol_grad=F32_TOL)


@pytest.mark.gpu
def test_gpu_cuda_graph_step_keeps_its_tensors(fa):
    """A caller that keeps only the replay: the tensors the step was captured on stay alive, so
    new tensors do not get their memory (which the replays would read, and overwrite)."""
    def make():
        w, x = torch.randn(2, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        return fa.cuda_graph_step(lambda: (w * x).sum(), warmup=1), (w * x).sum().item()

    replay, expected = make()
    junk = [torch.full((4096,), float("nan"), device="cuda") for _ in range(64)]
    assert replay().item() == expected and all(t.isnan().all() for t in junk)


@pytest.mark.gpu
def test_gpu_cuda_graph_step_matches_launched_steps(fa):
    # a whole training step (Triton kernels, flash attention, loss, fused AdamW) replayed from a
    # CUDA graph, with new batches copied into its input: the losses and weights of the same
    # steps launched from Python. A replay that read stale inputs or skipped the update is off by
    # O(0.1) after a few steps at this learning rate.
    # sequences that count up from a random start: a pattern the model starts to learn at once
    starts = torch.randint(0, 97, (6, 4, 1), generator=torch.Generator().manual_seed(0))
    data = ((starts + torch.arange(65)) % 97).to(DEVICE)

    def train(graphed):
        torch.manual_seed(0)
        cfg = fa.GPTConfig(vocab_size=97, context_length=64, n_embd=64, n_head=2, n_layer=2)
        model = fa.use_flash_attention(fa.use_triton_kernels(fa.GPT(cfg).to(DEVICE)))
        opt = fa.make_optimizer(model, 3e-3, 0.1, DEVICE, capturable=graphed)
        x = data[0].clone()

        def step():
            with fa.autocast(DEVICE):
                loss = fa.triton_loss_fn(model(x[:, :-1]), x[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss

        if graphed:
            step = fa.cuda_graph_step(step)  # three warm-up steps on data[0], then the capture
        else:
            for _ in range(3):
                step()
        losses = []
        for batch in data[1:]:
            x.copy_(batch)
            losses.append(step().item())
        return losses, [p.detach().clone() for p in model.parameters()]

    ref_losses, ref_params = train(False)
    losses, params = train(True)
    assert ref_losses[-1] < ref_losses[0] - 0.05  # the steps learn
    for loss, ref in zip(losses, ref_losses):
        assert abs(loss - ref) < 2e-3 * abs(ref)
    for p, ref in zip(params, ref_params):
        assert rel_err(p, ref) < 2e-3


# Each tile configuration the autotuner may pick, pinned alone: a wrong tile shows only at real
# sizes, and the autotuner would hide it behind a faster one (one configuration of Triton's
# warp-specialized loop returned NaN on the H200). Forward tiles on both of the forward's paths
# (S a multiple of 128, non-causal: one key loop; ragged T and S, causal: two), each on the paths
# it is offered for; backward tiles on the ragged causal case, with GQA. D = the largest head
# size the tile is made for, up to 128. A warp-specialized tile must compile to a specialized
# kernel (ttg.warp_specialize in its TTGIR): Triton drops the request silently when its
# conditions do not hold, and the tile is then plain code that spills.
@pytest.mark.gpu
@pytest.mark.parametrize("kernel, configs", [("_flash_fwd_kernel", "_FWD_CONFIGS"),
                                             ("_flash_bwd_dkdv_kernel", "_DKDV_CONFIGS"),
                                             ("_flash_bwd_dq_kernel", "_DQ_CONFIGS")])
def test_gpu_every_tile_configuration(fa, monkeypatch, kernel, configs):
    tuner = getattr(fa, kernel)
    forward = kernel == "_flash_fwd_kernel"
    cases = [(1024, 1024, False), (1000, 1500, True)] if forward else [(1000, 1500, True)]
    compiled = []
    run = tuner.fn.run
    monkeypatch.setattr(tuner.fn, "run", lambda *a, **kw: compiled.append(run(*a, **kw)) or compiled[-1])
    for config in getattr(fa, configs):
        monkeypatch.setattr(tuner, "configs", [config])
        monkeypatch.setattr(tuner, "cache", {})
        D = max(d for d in config.head_dims if d <= 128) if min(config.head_dims) <= 128 else 256
        for T, S, causal in cases:
            if not fa._prune_configs([config], None, D=D, CAUSAL=causal, EVEN_S=S % 128 == 0):
                continue
            q, k, v = make_qkv(1, 4, 2, T, S, D, torch.bfloat16, seed=T + D)
            out = fa.flash_attention(q, k, v, causal=causal)
            dout = torch.randn_like(out)
            ref_out, _, ref_grads = reference(fa, q, k, v, causal, None, dout, torch.float32)
            where = f"{config} D={D} T={T} S={S} causal={causal}"
            assert rel_err(out, ref_out) < GPU_TOL[torch.bfloat16][0], where
            if not forward:
                out.backward(dout)
                for ours, ref in zip((q.grad, k.grad, v.grad), ref_grads):
                    assert torch.isfinite(ours).all() and rel_err(ours, ref) < GPU_TOL[torch.bfloat16][1], where
            specialized = "ttg.warp_specialize" in compiled[-1].asm["ttgir"]
            assert specialized == config.kwargs.get("WARP_SPECIALIZE", False), where


@pytest.mark.gpu
def test_gpu_fully_masked_rows(fa):
    q, k, v = make_qkv(2, 4, 2, 1000, 300, 128, torch.bfloat16)
    out, lse = fa.flash_attention_with_lse(q, k, v, causal=True)
    out.float().sum().backward()
    assert (out[:, :, :700] == 0).all() and (lse[:, :, :700] == float("-inf")).all()
    assert all(torch.isfinite(g).all() for g in (out, q.grad, k.grad, v.grad))


@pytest.mark.gpu
def test_gpu_device_mismatch_raises(fa):
    q, k, v = make_qkv(1, 2, 2, 17, 17, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="one device"):
        fa.flash_attention(q, k.detach().cpu(), v)


def test_attention_flops_convention(fa):
    # 4*B*H*T*S*D forward, half of it under the causal mask
    assert fa.attention_flops(4, 16, 4096, 4096, 128, False) == 4 * 4 * 16 * 4096 * 4096 * 128
    assert fa.attention_flops(4, 16, 4096, 4096, 128, True) == 2 * 4 * 16 * 4096 * 4096 * 128


@pytest.mark.skipif(HAS_CUDA, reason="the chapter's float32 case runs on the CPU, interpreted")
def test_attention_chapter_errors_and_prints(fa, capsys):
    # float32 through the interpreter: every error is ~1e-7 to 1e-6 (the online softmax ~1e-8);
    # a missing rescale or a wrong scale is off by 1e-2 or more
    errors = fa.attention_chapter(torch.device("cpu"))
    names = [f"{method}_{col}" for method in ("naive", "tiled", "flash")
             for col in ("out", "lse", "dq", "dk", "dv")]
    assert set(errors) == {"online_softmax", *names}
    assert errors["online_softmax"] < 1e-6
    for name in names:
        assert errors[name] < 1e-5, f"{name} {errors[name]:.2e}"
    printed = capsys.readouterr().out
    for part in ("online softmax", "alpha", "naive", "tiled", "flash", "memory", "B*Hq*T*S"):
        assert part in printed, part


def test_gpt_and_loss_still_check_ranges(fa):
    """06 lets a CUDA graph capture skip cross_entropy's token-range check (GPT.forward, from
    stage 03 on, checks none in training on a GPU); outside a capture both still refuse
    out-of-range ids."""
    gpt = fa.GPT(fa.GPTConfig(vocab_size=11, context_length=8, n_embd=16, n_head=2, n_layer=1))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 11\)"):
        gpt(torch.tensor([[3, 11]]))
    logits = torch.randn(2, 11, device=DEVICE)  # the Triton loss: interpreted, or on the GPU
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 11\)"):
        fa.cross_entropy(logits, torch.tensor([1, 11], device=DEVICE))
    assert fa.cross_entropy(logits, torch.tensor([1, -100], device=DEVICE)).isfinite()
