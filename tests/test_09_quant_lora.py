"""Stage 09, part 1: quantization. The int8 and int4 formats against hand-written words and the
rounding bound; every kernel against x @ W_hat^T in float64 (on a CPU through Triton's
interpreter); the twin layers and quantize_model; GPTQ against the plain Optimal Brain Surgeon
update, GPTQ and AWQ against round to nearest, SmoothQuant's folding; GPTQ and AWQ checkpoints
written here from the formats' descriptions and loaded by load_qwen3; GGUF against llama.cpp's
own `gguf` package (test-only: `pip install gguf`); the quality section on a small Qwen3 trained
here; engine v1 and sampling as 09 changed them; main end to end and its flags.
"""
import copy
import json
import math
import re
import statistics
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import HAS_CUDA, ROOT, check_bad_flag, check_main, load_stage
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from safetensors.torch import load_file, save_file

DEVICE = "cuda" if HAS_CUDA else "cpu"  # where the Triton kernels run (the interpreter on a CPU)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}  # relative-norm tolerances
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def q9():
    return load_stage("09_quant_lora")


def gen(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def ulp_factor(dtype):
    """1 + two units in the last place of dtype: how far above its formula a stored scale may be."""
    return 1 + 2 * torch.finfo(dtype).eps


def tiny_model(q9, seed=0, vocab_size=97, hidden=64, inter=128, head_dim=16, layers=2):
    """A Qwen3 with GQA (4 query heads on 2 kv heads), weights 10x random_model's (logits not
    all ~0), norm gains around 1 (a skipped or misplaced norm shows), float32, on the CPU."""
    cfg = q9.Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=head_dim, max_position_embeddings=64, tie_word_embeddings=False)
    model = q9.random_model(cfg, torch.device("cpu"), torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else 10 * p)
    return model


def batches(seed=1, n=4, vocab_size=97):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (2, 12), generator=g) for _ in range(n)]


def logits(model, ids):
    with torch.no_grad():
        return torch.cat([model(x) for x in ids])


def twins(q9, model):
    return {name: m for name, m in model.named_modules() if isinstance(m, q9._QuantizedLinear)}


# ------------------------------------------------------------------------------------------------
# 20.1 The formats: packing, and the RTN error bound |w - w_hat| <= scale / 2
# ------------------------------------------------------------------------------------------------

HAND_Q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0],
                       [0, 0, 0, 0, 0, 0, 0, 8, 15, 15, 15, 15, 15, 15, 15, 15]])
HAND_WORDS = torch.tensor([[0x87654321 - 2**32, 0x0FEDCBA9], [-2**31, -1]], dtype=torch.int32)


def test_pack_int4_bit_order(q9):
    """Column 8i + j in bits 4j..4j+3 of word i, the words' top bits making them negative."""
    for dtype in (torch.int32, torch.uint8, torch.int64):
        assert torch.equal(q9.pack_int4(HAND_Q.to(dtype)), HAND_WORDS)
    assert torch.equal(q9.unpack_int4(HAND_WORDS), HAND_Q.int())
    q = torch.randint(0, 16, (5, 48), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    q[0, :8] = 15  # a word of all ones: -1 as an int32
    assert q9.pack_int4(q).shape == (5, 6) and torch.equal(q9.unpack_int4(q9.pack_int4(q)), q)


def test_dequantize_on_hand_examples(q9):
    w = q9.dequantize_int4(HAND_WORDS[:1, :1], torch.tensor([[2.0]]), torch.tensor([[3.0]]), 8)
    assert torch.equal(w, torch.tensor([[-4.0, -2, 0, 2, 4, 6, 8, 10]]))  # (q - 3) * 2
    w = q9.dequantize_int8(torch.tensor([[-127, 0, 5]], dtype=torch.int8), torch.tensor([0.5]))
    assert torch.equal(w, torch.tensor([[-63.5, 0, 2.5]]))
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, -1, -2, -3, -4, -5, -6, -7, -8]], dtype=torch.int8)
    w = q9.dequantize_int8(q, torch.tensor([[0.5, 2.0]]))  # a scale per group of 8 (GPTQ's)
    assert torch.equal(w, torch.cat([q[:, :8] * 0.5, q[:, 8:] * 2.0], 1).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_int8_error_bound(q9, dtype):
    """|w - q s| <= s / 2 (RTN); s the fp32 max|w| / 127 rounded up to dtype (so at most two ulps
    above it); every non-zero row reaching the grid's top; a zero row: scale 1, q 0."""
    w = gen(7, 40, seed=1, dtype=dtype)
    w[3] = 0
    w[5, 7] = 30  # an outlier
    q, s = q9.quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and s.dtype == dtype and s.shape == (7,)
    wd, sd = w.double(), s.double()
    assert ((wd - q.double() * sd[:, None]).abs() <= sd[:, None] / 2 * (1 + 1e-6)).all()
    formula = (w.float().abs().amax(1) / 127).double()  # in fp32, then rounded up to dtype
    nonzero = formula > 0
    assert (sd[nonzero] >= formula[nonzero]).all()
    assert (sd[nonzero] <= formula[nonzero] * ulp_factor(dtype)).all()
    # the top of the grid is used: 127, or 126 where rounding s up (2^-8 in bf16) left the
    # largest |w| / s just under 126.5
    assert (q[nonzero].abs().amax(1) >= 126).all() and q.abs().max() <= 127
    assert s[3] == 1 and (q[3] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size", [8, 32])
def test_quantize_int4_error_bound(q9, dtype, symmetric, group_size):
    """|w - (q - z) s| <= s / 2 per element, with w_hat built here from unpack_int4 (checked on
    hand-written words above); scales at most two ulps above their formula; asymmetric: zero
    points whole numbers in 0..15 and w = 0 exactly 0 after the round trip; symmetric: z = 8, q in
    1..15; a group of zeros: scale 1."""
    N, K, G = 6, 64, group_size
    w = gen(N, K, seed=2, dtype=dtype)
    w[0, :G] = 0  # a group of zeros
    w[1, :G] = w[1, :G].abs() + 0.5  # all positive: min is forced down to 0
    w[2, ::5] = 0  # exact zeros inside groups
    qweight, s, z = q9.quantize_int4(w, G, symmetric)
    assert qweight.shape == (N, K // 8) and qweight.dtype == torch.int32
    assert s.shape == z.shape == (N, K // G) and s.dtype == z.dtype == dtype
    q = q9.unpack_int4(qweight).double().view(N, K // G, G)
    sd, zd = s.double()[..., None], z.double()[..., None]
    wd = w.double().view(N, K // G, G)
    w_hat = (q - zd) * sd
    assert ((wd - w_hat).abs() <= sd / 2 * (1 + 1e-6)).all()
    wf = w.float().view(N, K // G, G)  # the formulas in fp32, then rounded up to dtype
    if symmetric:
        formula = (wf.abs().amax(-1) / 7).double()
        assert (z == 8).all() and q.min() >= 1
    else:
        formula = ((wf.amax(-1).clamp(min=0) - wf.amin(-1).clamp(max=0)) / 15).double()
        assert (z == z.round()).all() and z.min() >= 0 and z.max() <= 15
        assert (w_hat[wd == 0] == 0).all() and z[1, 0] == 0
    nonzero = formula > 0
    assert (s.double()[nonzero] >= formula[nonzero]).all()
    assert (s.double()[nonzero] <= formula[nonzero] * ulp_factor(dtype)).all()
    assert s[0, 0] == 1
    assert torch.equal(q9.dequantize_int4(qweight, s, z, G), w_hat.float().view(N, K))


# ------------------------------------------------------------------------------------------------
# 20.3-20.5 The kernels against the references, on shapes that are no multiple of the tiles
# ------------------------------------------------------------------------------------------------
# Under the interpreter the matvec's tiles are 32 rows by 64 columns, the matmul's 32 x 32 by 64,
# and K slices whole multiples of 64: N = 37 ends in a ragged row tile, K = 96 in a ragged K tile,
# M = 40 spans two row tiles, and split_k 2 or 3 on K = 96 cuts two slices.

SHAPES = [(37, 96, 32, False), (6, 40, 8, True)]  # (N, K, G, symmetric)
PATHS = [("matvec", 1, None), ("matvec", 1, 3), ("matvec", 5, 2), ("matvec", 16, None),
         ("matmul", 40, None)]  # (kernel, M, split_k): one row on CUDA cores, several on tl.dot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel, M, split_k", PATHS)
@pytest.mark.parametrize("N, K, G, symmetric", SHAPES)
def test_int4_kernels(q9, dtype, kernel, M, split_k, N, K, G, symmetric):
    """int4_matvec and int4_matmul against x @ dequantize_int4(W)^T in float64."""
    qweight, s, z = q9.quantize_int4(gen(N, K, seed=3, dtype=dtype), G, symmetric)
    x = gen(M, K, seed=4, dtype=dtype)
    expected = x.double() @ q9.dequantize_int4(qweight, s, z, G).double().T
    args = [t.to(DEVICE) for t in (x, qweight, s, z)] + [G]
    y = (q9.int4_matvec(*args, split_k=split_k) if kernel == "matvec" else q9.int4_matmul(*args))
    assert y.shape == (M, N) and y.dtype == dtype
    assert rel(y, expected) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel, M, split_k", PATHS)
@pytest.mark.parametrize("N, K, groups", [(37, 96, 1), (37, 96, 3), (6, 40, 5)])
def test_int8_kernels(q9, dtype, kernel, M, split_k, N, K, groups):
    """int8_matvec and int8_matmul against x @ dequantize_int8(W)^T in float64: a scale a row
    (quantize_int8's), or a scale per group of K / groups columns (8-bit GPTQ files')."""
    qweight, s = q9.quantize_int8(gen(N, K, seed=5, dtype=dtype))
    if groups > 1:
        s = (torch.rand(N, groups, generator=torch.Generator().manual_seed(6)) + 0.5).to(dtype)
    x = gen(M, K, seed=6, dtype=dtype)
    expected = x.double() @ q9.dequantize_int8(qweight, s).double().T
    args = [t.to(DEVICE) for t in (x, qweight, s)]
    y = q9.int8_matvec(*args, split_k=split_k) if kernel == "matvec" else q9.int8_matmul(*args)
    assert y.shape == (M, N) and y.dtype == dtype
    assert rel(y, expected) < TOL[dtype]


@pytest.mark.parametrize("n_sms", [1, 132])
def test_matvec_splits(q9, n_sms):
    """Qwen3-8B's decode shapes: the grid reaches 4 programs an SM unless the K slices would
    drop below two of the widest tiles; never more slices than that needs."""
    block_n, align = q9._MATVEC_BLOCK_N, q9._K_ALIGN
    for N, K in [(4096, 4096), (1024, 4096), (12288, 4096), (24576, 4096), (4096, 12288)]:
        splits, tiles = q9.matvec_splits(N, K, n_sms), -(-N // block_n)
        assert splits & (splits - 1) == 0 and K // splits >= 2 * align
        assert tiles * splits >= 4 * n_sms or K // (2 * splits) < 2 * align
        assert splits == 1 or tiles * splits // 2 < 4 * n_sms


def test_quantize_per_token(q9):
    """The kernel equals the torch twin bit for bit, and both: |x - q s| <= s / 2, s = max|x| /
    127, ties rounded to even, a zero row's scale 1."""
    x = gen(9, 50, seed=7) * 3
    x[2] = 0
    x[4, :8] = torch.tensor([127, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, 3])  # max 127: s = 1
    x[4, 8:] = 0
    q, s = q9.quantize_per_token(x.to(DEVICE))
    q_t, s_t = q9.quantize_per_token_torch(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (9,)
    assert torch.equal(q.cpu(), q_t) and torch.equal(s.cpu(), s_t)
    assert q[4, :8].tolist() == [127, 0, 2, 2, -2, 0, 126, 3] and s[4] == 1
    assert s[2] == 1 and (q[2] == 0).all()
    amax = x.double().abs().amax(1)
    assert torch.allclose(s.double().cpu()[amax > 0], amax[amax > 0] / 127, rtol=1e-7, atol=0)
    assert ((x.double() - q_t.double() * s_t.double()[:, None]).abs()
            <= s_t.double()[:, None] / 2 * (1 + 1e-6)).all()
    for dtype in (torch.bfloat16, torch.float16):  # the kernel reads half types too
        q, s = q9.quantize_per_token(x.to(DEVICE, dtype))
        q_t, s_t = q9.quantize_per_token_torch(x.to(dtype))
        assert torch.equal(q.cpu(), q_t) and torch.equal(s.cpu(), s_t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_matmul(q9, dtype):
    """The integer product against int64 arithmetic, then the scaling in float64; and a long K
    whose partial sums pass 2^24 before cancelling, exact only when summed in integers."""
    g = torch.Generator().manual_seed(8)
    M, N, K = 40, 37, 96
    xq = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    xq[0], wq[0] = 127, -127  # the extremes
    sx, sw = torch.rand(M, generator=g) + 0.1, (torch.rand(N, generator=g) + 0.1).to(dtype)
    exact = xq.long() @ wq.long().T
    expected = (exact.double() * sx.double()[:, None] * sw.double()[None, :]).to(dtype)
    y = q9.int8_w8a8_matmul(xq.to(DEVICE), sx.to(DEVICE), wq.to(DEVICE), sw.to(DEVICE), dtype)
    assert y.shape == (M, N) and y.dtype == dtype
    torch.testing.assert_close(y.cpu().double(), expected.double(), rtol=2 * torch.finfo(dtype).eps,
                               atol=0)
    # K = 2112: the products are 126 * 127 = 16002 (even) but the first, 127 * 127 (odd); +127
    # weights for the first half, -127 for the second. Partial sums reach 16,898,239 > 2^24,
    # odd, which fp32 cannot hold, however the sum is cut into tiles; the exact total is 127.
    K = 2112
    xq = torch.full((3, K), 126, dtype=torch.int8)
    xq[:, 0] = 127
    wq = torch.full((16, K), -127, dtype=torch.int8)
    wq[:, :K // 2] = 127
    ones = torch.ones(3), torch.ones(16, dtype=dtype)
    y = q9.int8_w8a8_matmul(xq.to(DEVICE), ones[0].to(DEVICE), wq.to(DEVICE), ones[1].to(DEVICE),
                            torch.float32)
    assert (y.cpu() == 127).all()


# ------------------------------------------------------------------------------------------------
# 20.6 The twin layers, quantize_model and layer_errors
# ------------------------------------------------------------------------------------------------

def linear(K=96, N=37, seed=9):
    layer = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        layer.weight.copy_(gen(N, K, seed=seed))
    return layer


TWINS = [("Int8Linear", {}, 1e-2), ("Int4Linear", {"group_size": 32}, 0.15),
         ("Int4Linear", {"group_size": 32, "symmetric": True}, 0.15), ("W8A8Linear", {}, 2e-2)]


@pytest.mark.parametrize("cls, kwargs, tol", TWINS)
def test_twin_layers(q9, cls, kwargs, tol):
    """Each twin against its float layer, within its format's error (8 bits: ~0.5%; 4 bits in
    groups of 32: ~8%), and on the kernels, for one row, a decode batch and a prefill (3-D
    input: 21 rows), against its own torch path at fp32 precision."""
    float_layer = linear()
    twin = getattr(q9, cls).from_linear(float_layer, **kwargs).to(DEVICE)
    x = gen(3, 7, 96, seed=10).to(DEVICE)
    with torch.no_grad():
        assert 1e-4 < rel(twin(x), float_layer.to(DEVICE)(x)) < tol
        for rows in (x[:1, :1], x[1, :5], x):  # 1, 5 and 21 rows: matvec, matvec, matmul
            twin.kernels = False
            expected = twin(rows)
            twin.kernels = True
            out = twin(rows)
            assert out.shape == rows.shape[:-1] + (37,) and rel(out, expected) < 1e-5


@pytest.mark.parametrize("rows", [1, 21])
def test_act_order(q9, rows):
    """perm: the stored columns are W[:, perm]; the kernels read x[..., perm]; dequantize() gives
    W_hat with its columns back in their own order, and the torch path computes with it."""
    N, K, G = 37, 96, 32
    w = gen(N, K, seed=11)
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(12))
    qweight, s, z = q9.quantize_int4(w[:, perm], G)
    w_hat = torch.empty(N, K, dtype=torch.float64)
    w_hat[:, perm] = q9.dequantize_int4(qweight, s, z, G).double()  # un-permuted
    x = gen(rows, K, seed=13)
    expected = x.double() @ w_hat.T
    assert rel(w_hat, w) < 0.15  # the quantized weight is near the original, columns in place
    q8, s8 = q9.quantize_int8(w[:, perm])
    w8 = torch.empty(N, K, dtype=torch.float64)
    w8[:, perm] = q9.dequantize_int8(q8, s8).double()
    for layer, want in ((q9.Int4Linear.from_quantized(qweight, s, z, G, perm=perm), w_hat),
                        (q9.Int8Linear(q8, s8, perm=perm), w8)):
        assert torch.equal(layer.dequantize().double(), want)
        layer.to(DEVICE)
        for kernels in (False, True):
            layer.kernels = kernels
            assert rel(layer(x.to(DEVICE)), x.double() @ want.T) < 1e-5
    assert rel(expected, x.double() @ w.double().T) < 0.15


def test_twins_hold_buffers(q9):
    """The quantized tensors are buffers: in the state dict, moved by .to(); .to(dtype) casts the
    scales and zeros, never the integers."""
    layer = q9.Int4Linear.from_linear(linear(), group_size=32)
    assert set(layer.state_dict()) == {"qweight", "scales", "zeros"}  # perm None: not saved
    layer.to(torch.bfloat16)
    assert layer.qweight.dtype == torch.int32 and layer.scales.dtype == torch.bfloat16
    assert layer.zeros.dtype == torch.bfloat16
    assert layer(gen(2, 96, seed=14, dtype=torch.bfloat16)).dtype == torch.bfloat16
    int8 = q9.W8A8Linear.from_linear(linear()).to(torch.float16)
    assert int8.qweight.dtype == torch.int8 and int8.scales.dtype == torch.float16
    assert set(int8.state_dict()) == {"qweight", "scales"}


@pytest.fixture(scope="module")
def tiny(q9):
    """Qwen3Config.tiny() (C = 64, I = 192, Hq * D = 128: K of 64, 128 and 192), fp32, random
    weights of std 0.02, and 2 x 9 token ids."""
    model = q9.random_model(q9.Qwen3Config.tiny(), torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 8256, (2, 9), generator=torch.Generator().manual_seed(15))
    return model, ids


# Measured on this model (relative norm of the logits' error): int8 1.0%, W8A8 1.3%, int4 in
# groups of 32 14% (asymmetric) and 15% (symmetric), from layer errors of ~0.6%, ~1% and ~8%.
# The tolerances leave about 2x; a wrong nibble order or zero point gives errors of order 1.
METHODS = [("int8", {}, 2e-2), ("int4", {"group_size": 32}, 0.25),
           ("int4", {"group_size": 32, "symmetric": True}, 0.25), ("w8a8", {}, 3e-2)]


@pytest.mark.parametrize("method, kwargs, tol", METHODS)
def test_quantize_model(q9, tiny, method, kwargs, tol):
    """Every nn.Linear of the blocks gives way to its twin, the embedding and the output layer
    stay; the logits stay within tol (relative norm) of the float model's; and the kernels give
    the torch twins' logits within 1e-4, at 9 tokens (matvec) and 18 (matmul)."""
    model, ids = tiny
    twin_class = {"int8": q9.Int8Linear, "int4": q9.Int4Linear, "w8a8": q9.W8A8Linear}[method]
    quantized = q9.quantize_model(copy.deepcopy(model), method, **kwargs)
    assert not any(type(m) is nn.Linear for m in quantized.model.layers.modules())
    layers = twins(q9, quantized).values()
    assert len(layers) == 7 * 2 and all(type(m) is twin_class for m in layers)
    assert type(quantized.model.embed_tokens) is nn.Embedding
    assert type(quantized.lm_head) is nn.Linear
    assert torch.equal(quantized.lm_head.weight, model.lm_head.weight)
    with torch.no_grad():
        expected, out = model(ids), quantized(ids)
        assert 1e-4 < rel(out, expected) < tol
        for twin in layers:
            twin.kernels = True
        assert rel(quantized(ids[:1]), out[:1]) < 1e-4  # 9 rows
        assert rel(quantized(ids), out) < 1e-4  # 18 rows
    on = q9.quantize_model(copy.deepcopy(model).use_kernels(True), method, **kwargs)
    assert all(m.kernels for m in twins(q9, on).values())  # the model's choice of kernels


def test_layer_errors(q9, tiny):
    """A row for each quantized layer, each error in its format's range (int8: 1e-3..2e-2, int4
    in groups of 32: 1e-2..0.2); one row recomputed here from the float model's activations; a
    fold's scales undone (the layer fed x / s_in, its output times s_out)."""
    model, ids = tiny
    for method, lo, hi in (("int8", 1e-3, 2e-2), ("int4", 1e-2, 0.2)):
        quantized = q9.quantize_model(copy.deepcopy(model), method, group_size=32)
        errors = q9.layer_errors(model, quantized, ids)
        assert set(errors) == set(twins(q9, quantized)) and len(errors) == 14
        assert all(lo < e < hi for e in errors.values()), errors
    name = "model.layers.0.self_attn.q_proj"
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        want = model.model.layers[0].self_attn.q_proj(x)
        got = quantized.model.layers[0].self_attn.q_proj(x)
        assert errors[name] == pytest.approx(rel(got, want), rel=1e-9)
        s_in, s_out = torch.rand(64) + 0.5, torch.rand(128) + 0.5  # a fold, made up
        layer = nn.Linear(64, 128, bias=False)  # the folded float layer: W diag(s_in) / s_out
        layer.weight.copy_(model.get_submodule(name).weight * s_in / s_out[:, None])
        q9.replace_linear(quantized, name, q9.Int4Linear.from_linear(layer, 32), False)
        folded = q9.layer_errors(model, quantized, ids, {name: (s_in, s_out)})[name]
        got = quantized.get_submodule(name)(x / s_in) * s_out
        assert folded == pytest.approx(rel(got, want), rel=1e-6) and folded < 0.2
    with pytest.raises(ValueError, match="model_fp has no layers named"):
        q9.layer_errors(nn.Sequential(), quantized, ids)


def test_bad_inputs(q9, tiny):
    w = gen(5, 64, seed=16)
    with pytest.raises(ValueError, match="K = 64 columns is not a multiple of group_size = 48"):
        q9.quantize_int4(w, 48)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 8"):
        q9.quantize_int4(w, 12)
    with pytest.raises(TypeError, match="quantize_int8: w must be a 2-D float32"):
        q9.quantize_int8(w.int())
    with pytest.raises(ValueError, match="must be non-empty and finite"):
        q9.quantize_int8(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="K = 12 columns is not a multiple of 8"):
        q9.pack_int4(torch.zeros(2, 12, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"values must lie in 0..15, got 0..16"):
        q9.pack_int4(torch.tensor([[16, 0, 0, 0, 0, 0, 0, 0]]))
    with pytest.raises(TypeError, match="q must be a 2-D integer tensor"):
        q9.pack_int4(torch.zeros(2, 8))

    qweight, s, z = (t.to(DEVICE) for t in q9.quantize_int4(w, 32))
    x = gen(2, 64, seed=17).to(DEVICE)
    with pytest.raises(TypeError, match="x has dtype torch.int32"):
        q9.int4_matvec(x.int(), qweight, s, z, 32)
    with pytest.raises(TypeError, match="qweight has dtype torch.float32"):
        q9.int4_matvec(x, qweight.float(), s, z, 32)
    with pytest.raises(ValueError, match="x has 17 rows; at most 16"):
        q9.int4_matvec(gen(17, 64, seed=18).to(DEVICE), qweight, s, z, 32)
    with pytest.raises(ValueError, match=r"x \(2, 32\) does not fit a weight of K = 64"):
        q9.int4_matmul(x[:, :32].contiguous(), qweight, s, z, 32)
    with pytest.raises(ValueError, match=r"scales \(5, 1\) and zeros \(5, 2\) must be"):
        q9.int4_matmul(x, qweight, s[:, :1].contiguous(), z, 32)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 8"):
        q9.int4_matvec(x, qweight, s, z, 20)
    with pytest.raises(ValueError, match="K = 64 columns is not a multiple of group_size = 128"):
        q9.int4_matvec(x, qweight, s, z, 128)
    with pytest.raises(ValueError, match="split_k must be a positive int or None"):
        q9.int4_matvec(x, qweight, s, z, 32, split_k=0)
    with pytest.raises(ValueError, match="x must be contiguous"):
        q9.int4_matvec(gen(64, 2, seed=19).to(DEVICE).T, qweight, s, z, 32)
    with pytest.raises(ValueError, match="x is on meta"):
        q9.int4_matvec(x.to("meta"), qweight, s, z, 32)
    q8, s8 = (t.to(DEVICE) for t in q9.quantize_int8(w))
    with pytest.raises(ValueError, match=r"scales must be float, \(N,\) = \(5,\)"):
        q9.int8_matmul(x, q8, s8[:4].contiguous())
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 8.*got 12"):
        q9.int8_matmul(x[:, :48].contiguous(), q8[:, :48].contiguous(), torch.ones(5, 4))
    with pytest.raises(ValueError, match="do not fit"):
        q9.int8_w8a8_matmul(q8[:2], s8[:2].float(), q8[:, :32].contiguous(), s8, torch.float32)
    with pytest.raises(TypeError, match="x_scales has dtype torch.float16"):
        q9.int8_w8a8_matmul(q8[:2], s8[:2].half(), q8, s8, torch.float32)
    with pytest.raises(ValueError, match=r"quantize_per_token: x must be \(M, K\)"):
        q9.quantize_per_token(x[0])

    with pytest.raises(ValueError, match="perm must be a permutation of 0..63"):
        q9.Int4Linear.from_quantized(*q9.quantize_int4(w, 32), 32, perm=torch.zeros(64).long())
    with pytest.raises(ValueError, match=r"Int8Linear: qweight must be an \(N, K\) int8 tensor"):
        q9.Int8Linear(torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(ValueError, match="Int8Linear: scales must be float"):
        q9.Int8Linear(torch.zeros(4, 8, dtype=torch.int8), torch.ones(5))
    with pytest.raises(ValueError, match=r"W8A8Linear: scales must be \(N,\)"):
        q9.W8A8Linear(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1))
    with pytest.raises(ValueError, match="a quantized twin has no bias"):
        q9.Int8Linear.from_linear(nn.Linear(8, 4))
    with pytest.raises(ValueError, match="Int4Linear: x has 63 features, expected 64"):
        q9.Int4Linear.from_quantized(*q9.quantize_int4(w, 32), 32)(gen(1, 63, seed=20))
    model, _ = tiny
    with pytest.raises(ValueError, match="method 'int3' is not one of"):
        q9.quantize_model(copy.deepcopy(model), "int3")
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj: K = 64 columns is "
                                         r"not a multiple of group_size = 128"):
        q9.quantize_model(copy.deepcopy(model), "int4")  # tiny's hidden size is 64


# ------------------------------------------------------------------------------------------------
# GPTQ, AWQ and SmoothQuant on a structured problem: correlated activations (low rank plus
# noise) with a few outlier channels 20x the rest, weights with a low-rank part. (Gaussian x and
# W make every method look alike.)
# ------------------------------------------------------------------------------------------------

def structured(K=256, N=128, rank=24, outliers=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(rank, K, generator=g)
    loud = torch.randperm(K, generator=g)[:outliers]

    def acts(n):
        x = torch.randn(n, rank, generator=g) @ mix + 0.1 * torch.randn(n, K, generator=g)
        x[:, loud] *= 20
        return x

    w = (0.3 * torch.randn(N, 8, generator=g) @ torch.randn(8, K, generator=g)
         + torch.randn(N, K, generator=g))
    return w, acts(2048), acts(2048)  # weights, calibration inputs, held-out inputs


def rtn4(w, G=128):
    """Round to nearest on the asymmetric int4 grid, written here from 20.1's formulas."""
    N, K = w.shape
    g = w.double().view(N, K // G, G)
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    s = (hi - lo) / 15
    s[s == 0] = 1
    z = torch.round(-lo / s).clamp(0, 15)
    return ((torch.round(g / s) + z).clamp(0, 15) - z).mul(s).view(N, K)


def rel_err(w, w_hat, x):
    """||x W^T - x W_hat^T|| / ||x W^T||: a layer's output error on inputs x (n, K)."""
    w, w_hat, x = w.double(), w_hat.double(), x.double()
    return ((x @ (w - w_hat).T).norm() / (x @ w.T).norm()).item()


def hessian(x):
    return 2 / len(x) * x.T @ x


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_at_int4_group_128(q9, act_order):
    w, xc, xt = structured()
    twin = q9.gptq_quantize(w, hessian(xc), bits=4, group_size=128, act_order=act_order)
    gptq, rtn = rel_err(w, twin.dequantize(), xt), rel_err(w, rtn4(w), xt)
    assert gptq < 0.5 * rtn  # measured: RTN 0.110, GPTQ 0.025, act-order 0.007
    assert type(twin) is q9.Int4Linear and twin.qweight.shape == (128, 32)
    assert (twin.perm is not None) == act_order
    if act_order:  # decreasing diag(H), a permutation
        d = hessian(xc).diagonal()[twin.perm]
        assert (d[:-1] >= d[1:]).all() and sorted(twin.perm.tolist()) == list(range(256))


def gptq_reference(w, H, G, perm=None, damp=0.01):
    """GPTQ as Optimal Brain Surgeon says it, in float64: after quantizing column k, move the
    remaining columns F by -err * [H_F^-1]_k / [H_F^-1]_kk with H_F^-1 inverted afresh. No
    Cholesky factor, no lazy blocks: what those tricks must reproduce."""
    W, H = w.double().clone(), H.double().clone()
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    H += damp * H.diagonal().mean() * torch.eye(len(H), dtype=H.dtype)
    Q = torch.empty_like(W)
    for k in range(W.shape[1]):
        if k % G == 0:  # 20.1's asymmetric grid, from the group's weights as they are now
            lo = W[:, k:k + G].amin(1).clamp(max=0)
            s = (W[:, k:k + G].amax(1).clamp(min=0) - lo) / 15
            z = torch.round(-lo / s).clamp(0, 15)
        Q[:, k] = ((torch.round(W[:, k] / s) + z).clamp(0, 15) - z) * s
        Hinv = torch.linalg.inv(H[k:, k:])
        W[:, k:] -= ((W[:, k] - Q[:, k]) / Hinv[0, 0])[:, None] * Hinv[0][None, :]
    return Q if perm is None else Q[:, torch.argsort(perm)]


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_matches_the_plain_obs_update(q9, act_order):
    # G = 16 inside lazy blocks of 32: groups start mid-block and blocks hand their errors on
    w, xc, xt = structured(K=64, N=32, rank=10)
    H = hessian(xc)
    twin = q9.gptq_quantize(w, H, group_size=16, block=32, act_order=act_order)
    ref = gptq_reference(w, H, 16, twin.perm)
    same = ((twin.dequantize().double() - ref).abs() < 1e-5).float().mean().item()
    assert same > 0.99, same  # float32 against float64: a rare rounding tie goes the other way
    assert rel_err(w, twin.dequantize(), xt) == pytest.approx(rel_err(w, ref, xt), rel=0.02)


def test_gptq_with_huge_damping_is_rtn(q9):
    # H + lambda I with lambda >> H: H^-1 ~ I / lambda, its Cholesky factor diagonal, so no error
    # reaches other columns: GPTQ reduces to round to nearest, bit for bit.
    w, xc, _ = structured()
    twin = q9.gptq_quantize(w, hessian(xc), damp=1e8)
    qweight, scales, zeros = q9.quantize_int4(w, 128)
    assert torch.equal(twin.qweight, qweight) and torch.equal(twin.zeros, zeros)
    assert torch.equal(twin.scales, scales)
    assert torch.allclose(twin.dequantize().double(), rtn4(w), atol=1e-6)
    assert not torch.equal(q9.gptq_quantize(w, hessian(xc)).dequantize(), twin.dequantize())


@pytest.mark.parametrize("K, G, act_order", [(256, 32, False), (256, 32, True), (192, 64, False),
                                              (256, -1, False), (256, 256, True)])
def test_gptq_group_sizes_and_dead_columns(q9, K, G, act_order):
    w, xc, xt = structured(K=K, N=40)
    dead = torch.tensor([3, 100, 150])
    xc[:, dead] = 0
    xt[:, dead] = 0
    twin = q9.gptq_quantize(w, hessian(xc), group_size=G, act_order=act_order)
    w_hat = twin.dequantize()
    G = K if G == -1 else G
    assert twin.group_size == G and twin.scales.shape == (40, K // G)
    assert torch.isfinite(w_hat).all() and (w_hat[:, dead] == 0).all()
    assert rel_err(w, w_hat, xt) < 0.5 * rel_err(w, rtn4(w, G), xt)


def test_gptq_int8_per_channel_in_the_weights_dtype(q9):
    """8 bits, a scale a row: an Int8Linear in the original column order, its scales those of
    quantize_int8's grid in w's dtype (bf16 here: the scale GPTQ fitted is the one stored)."""
    w, xc, xt = structured()
    s = w.abs().amax(1, keepdim=True) / 127
    rtn8 = torch.round(w / s).clamp(-127, 127) * s
    for act_order in (False, True):
        twin = q9.gptq_quantize(w, hessian(xc), bits=8, group_size=-1, act_order=act_order)
        assert type(twin) is q9.Int8Linear and twin.perm is None and twin.scales.shape == (128,)
        assert twin.qweight.min() >= -127 and torch.allclose(twin.scales, s[:, 0])
        assert rel_err(w, twin.dequantize(), xt) < 0.5 * rel_err(w, rtn8, xt)
    twin = q9.gptq_quantize(w.bfloat16(), hessian(xc), group_size=128)
    assert twin.scales.dtype == torch.bfloat16
    assert rel_err(w, twin.dequantize(), xt) < 0.5 * rel_err(w, rtn4(w), xt)
    with pytest.raises(ValueError, match="8 bits per channel"):
        q9.gptq_quantize(w, hessian(xc), bits=8, group_size=128)


@pytest.mark.parametrize("clip", [False, True])
def test_awq_beats_rtn(q9, clip):
    w, xc, xt = structured()
    s, w_awq = q9.awq_search(w, xc, group_size=128, clip=clip)
    assert s.shape == (256,) and (s > 0).all()
    awq, rtn = rel_err(w, rtn4(w_awq) / s, xt), rel_err(w, rtn4(w), xt)
    assert awq < 0.7 * rtn  # measured: RTN 0.110, AWQ 0.061 (clip 0.058)
    if not clip:
        assert torch.allclose(w_awq, w * s)


def inputs_of(model, ids, names):
    """{name: X (tokens, K)}: what each named linear receives over the batches `ids`, by hooks."""
    seen = {}
    hooks = [model.get_submodule(name).register_forward_hook(
        lambda m, args, out, name=name: seen.setdefault(name, []).append(
            args[0].detach().reshape(-1, args[0].shape[-1]))) for name in names]
    logits(model, ids)
    for hook in hooks:
        hook.remove()
    return {name: torch.cat(xs) for name, xs in seen.items()}


def all_linears(q9, layers=2):
    return [f"model.layers.{i}.{name}" for i in range(layers) for name in q9.QWEN3_LINEARS]


def test_folding_keeps_the_function_and_ties_gqa_heads(q9):
    """Random scales folded into every READING_ORDER group keep the logits; o_proj's input
    channel h * D + d shares v_proj's row (h // G) * D + d (D = 16, G = 2); the same scales
    under a wrong tie (query head h on kv head h % Hkv) change the logits."""
    model, ids = tiny_model(q9), batches()
    before = logits(model, ids)
    tied = q9._gqa_tie(model.model.layers[0])
    assert tied[0] == 0 and tied[16] == 0 and tied[32] == 16 and tied[63] == 31 and len(tied) == 64
    g = torch.Generator().manual_seed(2)
    for block in model.model.layers:
        for prev, names in q9.READING_ORDER:
            linears = [block.get_submodule(name) for name in names]
            tie = tied if prev == "self_attn.v_proj" else None
            K = linears[0].in_features
            s = torch.exp(torch.randn(K if tie is None else 32, generator=g))
            q9.fold_scales(block.get_submodule(prev), linears, s if tie is None else s[tie], tie)
    assert rel(logits(model, ids), before) < 1e-5
    model = tiny_model(q9)
    block = model.model.layers[0]
    wrong = ((torch.arange(4) % 2)[:, None] * 16 + torch.arange(16)).flatten()
    q9.fold_scales(block.self_attn.v_proj, [block.self_attn.o_proj],
                   torch.exp(torch.randn(32, generator=g))[wrong], wrong)
    assert rel(logits(model, ids), before) > 1e-3


def test_awq_scales_fold_without_changing_the_float_model(q9):
    model, ids = tiny_model(q9), batches()
    before = logits(model, ids)
    xs = inputs_of(model, ids, all_linears(q9))
    assert xs["model.layers.0.self_attn.q_proj"].shape == (4 * 2 * 12, 64)
    for i, block in enumerate(model.model.layers):
        def scales_of(names, w, tied):
            s, _ = q9.awq_search(w, xs[f"model.layers.{i}.{names[0]}"], 32, clip=False,
                                 tied=tied)
            assert not torch.allclose(s, torch.ones_like(s))
            return s, None

        q9._smooth_block(block, scales_of)
    assert rel(logits(model, ids), before) < 1e-5


def rtn_logits_error(q9, held, before):
    """The relative logit error of tiny_model, every block linear rounded to nearest (int4 in
    groups of 32)."""
    model = q9.quantize_model(tiny_model(q9), "int4", 32)
    return rel(logits(model, held), before)


def test_awq_quantize_model(q9):
    """Int4Linear twins in every block; the folds it returns undo themselves in layer_errors
    (each layer's error then below RTN's in most layers); held-out logits closer than RTN's."""
    model, held = tiny_model(q9), batches(seed=100)
    before = logits(model, held)
    folds = q9.awq_quantize_model(model, batches(seed=10, n=8), group_size=32)
    assert set(folds) == set(all_linears(q9)) == set(twins(q9, model))
    assert all(type(m) is q9.Int4Linear and m.group_size == 32 for m in twins(q9, model).values())
    assert all((s_out is not None) == name.endswith(("v_proj", "up_proj"))
               for name, (_, s_out) in folds.items())
    awq, rtn = rel(logits(model, held), before), rtn_logits_error(q9, held, before)
    assert awq < 0.95 * rtn  # measured 0.278 against 0.313
    float_model, rtn_model = tiny_model(q9), q9.quantize_model(tiny_model(q9), "int4", 32)
    errors = q9.layer_errors(float_model, model, held[0], folds)
    rtn_errors = q9.layer_errors(float_model, rtn_model, held[0])
    assert sum(errors[n] < rtn_errors[n] for n in errors) >= 10, (errors, rtn_errors)
    assert max(errors.values()) < 0.2  # a fold's scales not undone would give errors of order 1


def test_gptq_quantize_model_calibrates_each_block_on_quantized_outputs(q9, monkeypatch):
    model, ids = tiny_model(q9), batches()
    float_inputs = inputs_of(tiny_model(q9), ids, all_linears(q9))
    seen_H, gptq = {}, q9.gptq_quantize

    def recording(w, H, *args, **kwargs):  # the Hessian each linear is quantized with
        seen_H[next(n for n, m in model.named_modules() if getattr(m, "weight", None) is w)] = H
        return gptq(w, H, *args, **kwargs)

    monkeypatch.setattr(q9, "gptq_quantize", recording)
    q9.gptq_quantize_model(model, ids, group_size=32)
    monkeypatch.undo()
    assert set(seen_H) == set(float_inputs) == set(twins(q9, model))
    # each linear's inputs with everything upstream of it quantized, the block before and the
    # linears before it in its own block (GPTQ's true sequential): the quantized model's inputs
    quant_inputs = inputs_of(model, ids, all_linears(q9))
    for name in seen_H:
        H = hessian(quant_inputs[name].double())
        assert torch.allclose(seen_H[name].double(), H, rtol=1e-4, atol=1e-5 * H.abs().max())
        if not name.startswith("model.layers.0.self_attn.") or name.endswith("o_proj"):
            H = hessian(float_inputs[name].double())  # then the float model's inputs differ
            assert not torch.allclose(seen_H[name].double(), H, rtol=1e-3,
                                      atol=1e-3 * H.abs().max())
    # act-order GPTQ beats round to nearest on held-out logits
    model, held = tiny_model(q9), batches(seed=100)
    before = logits(model, held)
    q9.gptq_quantize_model(model, batches(seed=10, n=8), group_size=32, act_order=True)
    assert rel(logits(model, held), before) < 0.95 * rtn_logits_error(q9, held, before)
    # huge damping: every linear is RTN of its original weight
    model, original = tiny_model(q9), tiny_model(q9)
    q9.gptq_quantize_model(model, ids, group_size=32, damp=1e8)
    for name, twin in twins(q9, model).items():
        assert torch.equal(twin.qweight, q9.quantize_int4(original.get_submodule(name).weight,
                                                          32)[0])


def w8a8(x, qweight, scales):
    """W8A8 written here: activations per token, symmetric int8; an integer matmul; rescaled."""
    sx = x.double().abs().amax(-1, keepdim=True) / 127
    qx = torch.round(x.double() / sx).clamp(-127, 127)
    return (qx @ qweight.double().T) * sx * scales.double()


def test_smoothquant_beats_plain_w8a8_on_outlier_activations(q9):
    w, xc, xt = structured(K=256, N=128)
    xc[:, :4] *= 5  # outliers 100x the rest, as in the paper's OPT activations
    xt[:, :4] *= 5
    a = xc.abs().amax(0)
    s = q9.smooth_scales(a, w, alpha=0.5)
    assert torch.allclose(s, a.sqrt() / w.abs().amax(0).sqrt())  # max|X_j|^a / max|W_j|^(1-a)
    assert torch.allclose(q9.smooth_scales(a, w, alpha=0.75), a**0.75 / w.abs().amax(0) ** 0.25)
    ref = xt.double() @ w.double().T
    plain = (w8a8(xt, *q9.quantize_int8(w)) - ref).norm() / ref.norm()
    smooth = (w8a8(xt / s, *q9.quantize_int8(w * s)) - ref).norm() / ref.norm()
    assert smooth < 0.5 * plain


def test_smoothquant_model(q9):
    """W8A8Linear twins whose weights are the original ones times the folds (s_in on the
    columns, 1 / s_out on the rows) within half a scale; logits near the float model's."""
    model, ids, original = tiny_model(q9), batches(), tiny_model(q9)
    before = logits(model, ids)
    folds = q9.smoothquant_model(model, ids)
    assert set(folds) == set(twins(q9, model)) == set(all_linears(q9))
    for name, twin in twins(q9, model).items():
        s_in, s_out = folds[name]
        w = original.get_submodule(name).weight * s_in
        w = w if s_out is None else w / s_out[:, None]
        assert type(twin) is q9.W8A8Linear
        assert (twin.dequantize() - w).abs().max() <= twin.scales.max() / 2 * (1 + 1e-5)
    assert rel(logits(model, ids), before) < 0.05


# ------------------------------------------------------------------------------------------------
# Chapter 39. GPTQ and AWQ checkpoints, packed here from the formats' descriptions (AutoGPTQ's
# QuantLinear.pack, GPTQModel's v1/v2 zero points, AutoAWQ's WQLinear_GEMM), never by inverting
# the loader, and loaded through load_qwen3
# ------------------------------------------------------------------------------------------------

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_rows(q, bits):
    """(R * 32/bits, C) unsigned values -> (R, C) int32: value j of word r is row r*32/bits + j."""
    pf = 32 // bits
    words = np.zeros((q.shape[0] // pf, q.shape[1]), dtype=np.uint32)
    for j in range(pf):
        words |= q[j::pf].astype(np.uint32) << np.uint32(bits * j)
    return torch.from_numpy(words.view(np.int32))


def pack_awq(q):
    """(R, C) 4-bit values -> (R, C / 8) int32: nibble i of word c is column 8c + AWQ_ORDER[i]."""
    words = np.zeros((q.shape[0], q.shape[1] // 8), dtype=np.uint32)
    for i, col in enumerate(AWQ_ORDER):
        words |= q[:, col::8].astype(np.uint32) << np.uint32(4 * i)
    return torch.from_numpy(words.view(np.int32))


def test_packers_follow_the_documented_bit_order():
    def word(t):
        return t.item() & 0xFFFFFFFF  # the int32's bits

    assert word(pack_rows(np.arange(1, 9)[:, None], 4)) == 0x87654321
    assert word(pack_rows(np.arange(1, 5)[:, None] * 16, 8)) == 0x40302010
    assert word(pack_awq(np.arange(8)[None, :])) == 0x75316420


CFG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=97, hidden_size=64,
           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
SHAPES_NK = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64),
             "self_attn.v_proj": (32, 64), "self_attn.o_proj": (64, 64),
             "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64), "mlp.down_proj": (64, 128)}


def write_checkpoint(folder, qconfig, seed=0, vocab_size=97):
    """A tiny Qwen3 in a Hub quantized layout (config.json with quantization_config, one
    model.safetensors); returns {name: tensor}, the float model it stands for: each linear's W
    (N, K) by the documented formula W^T[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]."""
    g, V = torch.Generator().manual_seed(seed), vocab_size
    bits, G = qconfig["bits"], qconfig["group_size"]
    v1 = qconfig["quant_method"] == "gptq" and qconfig.get("checkpoint_format", "gptq") == "gptq"
    maxq = 2**bits - 1
    floats = {"model.embed_tokens.weight": torch.randn(V, 64, generator=g),
              "model.norm.weight": 1 + 0.1 * torch.randn(64, generator=g),
              "lm_head.weight": torch.randn(V, 64, generator=g) * 0.3}
    for i in range(2):
        for name, size in (("input_layernorm", 64), ("post_attention_layernorm", 64),
                           ("self_attn.q_norm", 16), ("self_attn.k_norm", 16)):
            floats[f"model.layers.{i}.{name}.weight"] = 1 + 0.1 * torch.randn(size, generator=g)
    tensors, model = dict(floats), dict(floats)
    for i in range(2):
        for name, (N, K) in SHAPES_NK.items():
            p = f"model.layers.{i}.{name}"
            Gk = K if G == -1 else G
            q = torch.randint(0, maxq + 1, (K, N), generator=g)
            if qconfig.get("sym"):
                z = torch.full((K // Gk, N), 2 ** (bits - 1))
            else:  # v1 cannot store a zero point of 0 (it subtracts 1 before packing)
                z = torch.randint(1 if v1 else 0, maxq + 1, (K // Gk, N), generator=g)
            s = (0.001 + 0.01 * torch.rand(K // Gk, N, generator=g)).half()
            if qconfig.get("desc_act"):
                g_idx = torch.empty(K, dtype=torch.long)
                g_idx[torch.randperm(K, generator=g)] = torch.arange(K) // Gk
            else:
                g_idx = torch.arange(K) // Gk
            model[p + ".weight"] = ((q - z[g_idx]).float() * s[g_idx].float()).T
            if qconfig["quant_method"] == "gptq":
                tensors[p + ".qweight"] = pack_rows(q.numpy(), bits)  # along the input dim
                tensors[p + ".qzeros"] = pack_rows((z - int(v1)).T.numpy(), bits).T.contiguous()
                tensors[p + ".g_idx"] = g_idx.int()
            else:
                tensors[p + ".qweight"] = pack_awq(q.numpy())  # along the output dim
                tensors[p + ".qzeros"] = pack_awq(z.numpy())
            tensors[p + ".scales"] = s
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**CFG, "vocab_size": V,
                                                    "quantization_config": qconfig}))
    save_file(tensors, str(folder / "model.safetensors"))
    return model


GPTQ_CASES = [dict(quant_method="gptq", bits=bits, group_size=G, desc_act=desc, sym=sym,
                   checkpoint_format=fmt)
              for fmt in ("gptq", "gptq_v2") for desc in (False, True)
              for bits, G, sym in ((4, 32, True), (4, 32, False), (8, 32, True))] + [
    dict(quant_method="gptq", bits=4, group_size=-1, desc_act=False, sym=True),  # v1 by default
    dict(quant_method="gptq", bits=8, group_size=-1, desc_act=True, sym=True,
         checkpoint_format="gptq_v2")]
AWQ_CASES = [dict(quant_method="awq", bits=4, group_size=32, version="gemm", zero_point=True),
             dict(quant_method="awq", bits=4, group_size=64, version="GEMM", zero_point=True)]


@pytest.mark.parametrize("qconfig", GPTQ_CASES + AWQ_CASES, ids=lambda c: "-".join(
    f"{v}" for v in c.values()))
def test_load_qwen3_reads_gptq_and_awq_checkpoints(q9, qconfig, tmp_path):
    """Each linear becomes the twin of its bits (Int4Linear, or Int8Linear for 8-bit files),
    act-order files with a perm; each twin's weight equals the documented formula's exactly; the
    model's logits equal those of the float Qwen3 holding those weights (within float rounding),
    on the torch path and on the kernels."""
    weights = write_checkpoint(tmp_path, qconfig)
    model = q9.load_qwen3(tmp_path, "cpu", torch.float32)
    reference = q9.Qwen3(model.cfg)
    reference.load_state_dict(weights)
    for name, twin in twins(q9, model).items():
        N, K = SHAPES_NK[name.split(".", 3)[3]]
        G = K if qconfig["group_size"] == -1 else qconfig["group_size"]
        assert type(twin) is (q9.Int4Linear if qconfig["bits"] == 4 else q9.Int8Linear)
        assert twin.scales.shape in ((N, K // G),) and twin.scales.dtype == torch.float32
        assert (twin.perm is not None) == bool(qconfig.get("desc_act")) or G == K
        assert torch.equal(twin.dequantize(), weights[name + ".weight"]), name
    assert len(twins(q9, model)) == 14
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.eval()(ids)
        assert rel(model(ids), expected) < 1e-5
        for twin in twins(q9, model).values():
            twin.kernels = True
        assert rel(model(ids), expected) < 1e-5


def test_a_broken_checkpoint_is_named(q9, tmp_path):
    write_checkpoint(tmp_path, GPTQ_CASES[0])
    tensors = load_file(str(tmp_path / "model.safetensors"))
    broken = dict(tensors)
    del broken["model.layers.1.mlp.up_proj.qzeros"]
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(q9.DataError, match=r"missing tensors \['model\.layers\.1\.mlp\.up_proj"
                                           r"\.qzeros'\]"):
        q9.load_qwen3(tmp_path, "cpu")
    broken = {**tensors, "model.layers.0.mlp.up_proj.g_idx": torch.zeros(64, dtype=torch.int32)}
    save_file(broken, str(tmp_path / "model.safetensors"))  # every column in group 0
    with pytest.raises(q9.DataError, match=r"model\.layers\.0\.mlp\.up_proj\.g_idx does not "
                                           r"give each of the 2 groups 32 input columns"):
        q9.load_qwen3(tmp_path, "cpu")
    broken = {**tensors, "model.layers.0.mlp.up_proj.qweight": torch.zeros(8, 128)}
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(q9.DataError, match=r"up_proj\.qweight is torch\.float32; a gptq file "
                                           r"stores int32"):
        q9.load_qwen3(tmp_path, "cpu")
    broken = {**tensors, "model.layers.0.mlp.up_proj.scales": torch.ones(3, 128)}
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(q9.DataError, match=r"up_proj\.scales' has shape \(3, 128\); config\.json "
                                           r"implies \(2, 128\)"):
        q9.load_qwen3(tmp_path, "cpu")
    write_checkpoint(tmp_path, {**GPTQ_CASES[2], "sym": True})
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.qzeros"] += 1  # zero points 129: not symmetric
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(q9.DataError, match=r"o_proj\.qzeros: zero points other than 128"):
        q9.load_qwen3(tmp_path, "cpu")


@pytest.mark.parametrize("change, field", [
    (dict(bits=3), "bits"), (dict(bits=2), "bits"),
    (dict(quant_method="bitsandbytes"), "quant_method"),
    (dict(group_size=48), "group_size"), (dict(group_size=4), "group_size"),
    (dict(group_size=0), "group_size"), (dict(checkpoint_format="marlin"), "checkpoint_format"),
    (dict(bits=8, sym=False), "sym"), (dict(dynamic={"a": 1}), "dynamic"),
    (dict(lm_head=True), "lm_head"),
    (dict(quant_method="awq", bits=8, version="gemm"), "bits"),
    (dict(quant_method="awq", version="gemv"), "version"),
    (dict(quant_method="awq", zero_point=False), "zero_point"),
    (dict(quant_method="awq", modules_to_not_convert=["mlp"]), "modules_to_not_convert"),
    (dict(pack_dtype="int16"), "pack_dtype")])
def test_a_bad_quantization_config_names_the_file_and_field(q9, change, field, tmp_path,
                                                             monkeypatch):
    """An unsupported quantization_config is a DataError naming config.json and the field,
    raised before any weight is read."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CFG, "quantization_config": {**GPTQ_CASES[0], **change}}))
    monkeypatch.setattr(q9, "read_weights", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(q9.DataError) as e:
        q9.load_qwen3(tmp_path, "cpu")
    assert str(path) in str(e.value) and f"quantization_config.{field} = " in str(e.value)


# ------------------------------------------------------------------------------------------------
# Chapter 38. GGUF, against llama.cpp's gguf package: its GGUFReader reads what write_gguf writes,
# its GGUFWriter writes what read_gguf reads, its dequantize is the reference for every block type
# ------------------------------------------------------------------------------------------------

TYPES = ["F32", "F16", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "BF16"]


def test_ggml_types_are_llama_cpps(q9):
    """Each type's number, values a block and bytes a block, as gguf names them."""
    assert list(q9.GGML_TYPES) == TYPES
    for name, t in q9.GGML_TYPES.items():
        assert (t.code, t.block, t.nbytes) == (Q[name].value, *gguf.GGML_QUANT_SIZES[Q[name]])


def shapes(type_name):
    """Awkward shapes of whole rows for a type: odd row counts, 1-D and 3-D."""
    block = gguf.GGML_QUANT_SIZES[Q[type_name]][0]
    row = 3 * block if block > 1 else 37
    return [(7, row), (3, 5, block if block > 1 else 11), (row,)]


def random_values(shape, seed):
    """Normal values with a spread of block scales, and blocks of zeros, of one sign, with an
    outlier, and a quiet one, where a fit of min, max or scale goes wrong first."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    flat = x.view(-1)[:x.numel() // 32 * 32].view(-1, 32)  # whole groups of 32 (a view)
    flat *= torch.logspace(-3, 2, flat.shape[0], dtype=torch.float64)[:, None]
    flat[0] = 0
    if flat.shape[0] >= 16:
        flat[1], flat[2] = flat[1].abs(), -flat[2].abs()
        flat[3, 5] *= 40
        flat[8:16] = flat[8:16].abs()  # a super-block of 256 positive values (no mins) ...
        flat[12] *= 3e-3  # ... one sub-block quiet: its step is a fraction of d
    return x


def gguf_dequantize(tensor):
    """gguf's dequantization of a GGUFReader tensor, in torch's shape."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(values, np.float32)).reshape(
        tuple(reversed(tensor.shape.tolist())))


# -- (a) what write_gguf writes, gguf.GGUFReader reads -------------------------------------------

@pytest.mark.parametrize("type_name", TYPES)
def test_gguf_reader_reads_our_tensors(q9, type_name, tmp_path):
    """Every tensor of every type reads in GGUFReader with our name, type and (reversed) dims, and
    gguf's dequantization of its blocks equals ours exactly."""
    tensors = {f"t{i}": (random_values(shape, i), type_name)
               for i, shape in enumerate(shapes(type_name))}
    path = q9.write_gguf(tmp_path / "a.gguf", {"general.architecture": "test"}, tensors)
    reader = gguf.GGUFReader(path)
    _, ours = q9.read_gguf(path)
    assert [t.name for t in reader.tensors] == list(tensors)
    for t in reader.tensors:
        assert t.tensor_type == Q[type_name]
        assert tuple(reversed(t.shape.tolist())) == tuple(tensors[t.name][0].shape)
        assert torch.equal(gguf_dequantize(t), ours[t.name]), t.name


METADATA = {  # one key of each GGUF type, typed and plain, arrays, nested arrays
    "t.uint8": ("uint8", 255), "t.int8": ("int8", -128), "t.uint16": ("uint16", 65535),
    "t.int16": ("int16", -32768), "t.uint32": ("uint32", 2**32 - 1), "t.int32": ("int32", -2**31),
    "t.float32": ("float32", 0.1), "t.bool": ("bool", True), "t.string": ("string", "héllo ✓"),
    "t.uint64": ("uint64", 2**64 - 1), "t.int64": ("int64", -2**63), "t.float64": ("float64", 0.1),
    "t.array.uint16": ("uint16", [1, 2, 65535]), "t.array.float64": ("float64", [0.5, -1e300]),
    "t.array.bool": ("bool", [True, False]), "t.array.string": ("string", ["a", "", "ü"]),
    "t.array.empty": ("int8", []),
    "t.nested": ("array", [("int32", [1, 2]), ("int32", [3])]),
    "t.nested.mixed": ("array", [("string", ["x"]), ("array", [("uint8", [7])])]),
    "plain.str": "abc", "plain.bool": False, "plain.int": -7, "plain.float": 1.5,
    "plain.list": [1, 2, 3], "plain.nested": [["a"], ["b", "c"]]}
# what each reads back as: (type, value), float32 values rounded to float32
EXPECTED = {**METADATA, "t.float32": ("float32", float(np.float32(0.1))),
            "plain.str": ("string", "abc"), "plain.bool": ("bool", False),
            "plain.int": ("int32", -7), "plain.float": ("float32", 1.5),
            "plain.list": ("int32", [1, 2, 3]),
            "plain.nested": ("array", [("string", ["a"]), ("string", ["b", "c"])])}


def test_every_metadata_type_round_trips(q9, tmp_path):
    """Each value type, scalar and array, reads back from our file in GGUFReader with its type
    and value, and in read_gguf_raw as the (type, value) it was written as."""
    path = q9.write_gguf(tmp_path / "m.gguf", METADATA, {})
    reader = gguf.GGUFReader(path)
    for key, (value_type, value) in EXPECTED.items():
        field = reader.fields[key]
        if isinstance(value, list):
            assert field.types[0] == V.ARRAY, key
            if value_type != "array":
                assert field.types[1:] == ([V[value_type.upper()]] if value else []), key
                assert field.contents() == (value if value else []), key
        else:
            assert field.types == [V[value_type.upper()]], key
            assert field.contents() == value, key
    nested = reader.fields["t.nested"]  # gguf-py flattens an array of arrays
    assert nested.types == [V.ARRAY, V.ARRAY, V.INT32] and nested.contents() == [1, 2, 3]
    metadata, tensors = q9.read_gguf_raw(path)
    assert metadata == EXPECTED and tensors == {}
    plain, _ = q9.read_gguf(path)
    assert plain["t.nested.mixed"] == [["x"], [[7]]] and plain["plain.list"] == [1, 2, 3]


# -- (b) what gguf.GGUFWriter writes, read_gguf reads ----------------------------------------------

def random_k_blocks(type_name, rows, blocks_per_row, rng):
    """Random bytes for Q4_K or Q6_K blocks, their fp16 scales set to finite values: every bit
    pattern of the rest is a valid block."""
    nbytes = gguf.GGML_QUANT_SIZES[Q[type_name]][1]
    data = rng.integers(0, 256, (rows, blocks_per_row, nbytes), dtype=np.uint8)
    fp16_fields = [slice(0, 2), slice(2, 4)] if type_name == "Q4_K" else [slice(208, 210)]
    for field in fp16_fields:
        scales = (rng.standard_normal((rows, blocks_per_row, 1)) * 0.01).astype(np.float16)
        data[..., field] = scales.view(np.uint8)
    return data.reshape(rows, blocks_per_row * nbytes)


def test_read_gguf_reads_gguf_writers_files(q9, tmp_path):
    """A file of GGUFWriter's, a 64-byte alignment and tensors of all seven types (the legacy ones
    quantized by gguf.quants.quantize, the k-quants random valid blocks): read_gguf returns its
    metadata and gguf's dequantization of every tensor."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(tmp_path / "w.gguf", "test")
    writer.add_custom_alignment(64)
    writer.add_uint32("t.u32", 7)
    writer.add_float64("t.f64", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "qwen3")
    writer.add_array("t.strings", ["a", "b"])
    writer.add_key_value("t.i16s", [-1, 2], V.ARRAY, sub_type=V.INT16)
    for type_name in ("F32", "F16", "BF16", "Q8_0", "Q4_0"):
        x = rng.standard_normal((5, 96)).astype(np.float32)
        if type_name == "F32":
            writer.add_tensor(type_name, x)
        elif type_name == "F16":
            writer.add_tensor(type_name, x.astype(np.float16))
        else:
            writer.add_tensor(type_name, gguf.quants.quantize(x, Q[type_name]),
                              raw_dtype=Q[type_name])
    for type_name in ("Q4_K", "Q6_K"):
        writer.add_tensor(type_name, random_k_blocks(type_name, 3, 2, rng), raw_dtype=Q[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = {t.name: gguf_dequantize(t) for t in gguf.GGUFReader(tmp_path / "w.gguf").tensors}
    metadata, tensors = q9.read_gguf(tmp_path / "w.gguf")
    assert {k: metadata[k] for k in ("general.architecture", "general.alignment", "t.u32",
                                     "t.f64", "t.bool", "t.str", "t.strings", "t.i16s")} == {
        "general.architecture": "test", "general.alignment": 64, "t.u32": 7, "t.f64": 0.25,
        "t.bool": True, "t.str": "qwen3", "t.strings": ["a", "b"], "t.i16s": [-1, 2]}
    assert list(tensors) == list(expected) == ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"]
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
    raw = q9.read_gguf_raw(tmp_path / "w.gguf")[1]
    assert raw["Q6_K"].type == "Q6_K" and raw["Q6_K"].shape == (3, 512)
    assert raw["Q6_K"].blocks.shape == (6, 210)


# -- (c) quantization error bounds -----------------------------------------------------------------
# Each element's |x - dequantize(quantize(x))|, against x in float64, is within a bound computed
# from x alone (plus 2^-20 |x| for the decoder's float32 arithmetic). e(v) = max(2^-11 |v|, 2^-25)
# is fp16's rounding error at v (half a unit: 2^-10 relative, 2^-24 absolute below 2^-14); a
# scale rounded up may move by 2 e(v).
#   F32: exact. F16: e(x). BF16: 2^-8 |x| (8 bits of mantissa).
#   Q8_0: d = amax / 127, amax the block's max |x|; rounding errs by d16 / 2 <= (d + e(d)) / 2,
#     and a value clamped at 127 (d16 < d) by at most 127 e(d).
#   Q4_0: d = far / -8 puts the largest-magnitude value `far` on the level -8, so the levels span
#     -8|d|..7|d| on far's side. Rounding errs by (|d| + e(d)) / 2 = amax / 16 + ...; far itself
#     by 8 e(d); a value of the other sign beyond 7|d| clamps to 7|d16|, an error up to
#     |d| + 7 e(d) = amax / 8 + ... (the asymmetry of Q4_0).
#   Q4_K: a sub-block's step is s = (max - min) / 15 over 16 levels (min forced <= 0); its 6-bit
#     multiple of d = max(s) / 63 is rounded up, so the step used lies in s..s + d16 and the
#     levels span the sub-block but for the min's rounding to a multiple of dmin = max(-min) / 63
#     (rounded up too): at most max((s + d + 2 e(d)) / 2, (dmin + 2 e(dmin)) / 2).
#   Q6_K: s = max|x| / 31 per sub-block of 16 (levels -31..31), its int8 multiple of
#     d = max(s) / 127 rounded up: at most (s + d + 2 e(d)) / 2.

def fp16_error(v):
    return torch.maximum(v.abs() * 2.0**-11, torch.tensor(2.0**-25, dtype=v.dtype))


def error_bound(type_name, x):
    """The bound above for each element of x (rows, K) float64."""
    if type_name == "F32":
        return torch.zeros_like(x)
    if type_name in ("F16", "BF16"):
        return fp16_error(x) if type_name == "F16" else x.abs() * 2.0**-8
    if type_name in ("Q8_0", "Q4_0"):
        xb = x.reshape(-1, 32)
        amax = xb.abs().amax(1, keepdim=True)
        if type_name == "Q8_0":
            d = amax / 127
            bound = torch.maximum((d + fp16_error(d)) / 2, 127 * fp16_error(d))
            return bound.expand_as(xb).reshape(x.shape)
        d, far = amax / 8, xb.gather(1, xb.abs().argmax(1, keepdim=True))
        e = fp16_error(d)
        clamped = (xb * far < 0) & (xb.abs() > 7 * d)
        bound = torch.where(clamped, d + 7 * e, torch.maximum((d + e) / 2, 8 * e))
        return bound.reshape(x.shape)
    if type_name == "Q4_K":
        xs = x.reshape(-1, 8, 32)
        low = xs.amin(2).clamp(max=0)
        s = (xs.amax(2) - low) / 15  # (n, 8)
        d = s.amax(1, keepdim=True) / 63
        dmin = (-low).amax(1, keepdim=True) / 63
        bound = torch.maximum((s + d + 2 * fp16_error(d)) / 2,
                              ((dmin + 2 * fp16_error(dmin)) / 2).expand_as(s))
        return bound[..., None].expand_as(xs).reshape(x.shape)
    xs = x.reshape(-1, 16, 16)  # Q6_K
    s = xs.abs().amax(2) / 31
    d = s.amax(1, keepdim=True) / 127
    return ((s + d + 2 * fp16_error(d)) / 2)[..., None].expand_as(xs).reshape(x.shape)


@pytest.mark.parametrize("type_name", TYPES)
def test_quantization_error_within_bound(q9, type_name):
    x = random_values((9, 512), seed=3)
    back = q9.ggml_dequantize(q9.ggml_quantize(x.float(), type_name), type_name, x.shape).double()
    x = x.float().double()  # what quantize sees
    err, bound = (back - x).abs(), error_bound(type_name, x)
    if type_name != "F32":
        bound = bound + 2.0**-20 * x.abs()  # the decoder's float32 arithmetic
    worst = (err - bound).max().item()
    assert worst <= 0, f"{type_name}: error exceeds its bound by {worst:.3g}"
    if type_name not in ("F32", "F16", "BF16"):  # the fit uses its levels: far from the bound
        assert err.pow(2).mean().sqrt() < 0.8 * bound.pow(2).mean().sqrt()


# -- (d) Qwen3 to GGUF and back --------------------------------------------------------------------

@pytest.fixture
def tiny_qwen3(q9):
    """07's tiny Qwen3 (untied) with weights 10x the init's (so that greedy decoding does not
    repeat one token), rounded to fp16: an F16 file holds them exactly."""
    model = q9.random_model(q9.Qwen3Config.tiny(), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(10)
            p.copy_(p.half().float())
    return model


PROMPT = torch.tensor([[1, 50, 300, 7, 4000, 12, 99, 8000]])


def greedy(q9, model, n=12):
    return q9.generate(model, PROMPT.tolist(), q9.SamplingParams(temperature=0, max_tokens=n))


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_f16_round_trip(q9, tiny_qwen3, tied, tmp_path):
    """At F16 the file holds the (fp16-exact) weights exactly: the model loaded back has the same
    config and logits, and decodes the same greedy tokens. The file has llama.cpp's tensor names
    (gguf's own map from Hugging Face's names for the qwen3 architecture) and its hyperparameter
    keys and types."""
    model = tiny_qwen3
    if tied:
        cfg = q9.Qwen3Config(**{**vars(model.cfg), "tie_word_embeddings": True})
        model = q9.random_model(cfg, torch.device("cpu"), torch.float32)
        model.load_state_dict({k: v for k, v in tiny_qwen3.state_dict().items()
                               if k != "lm_head.weight"})
    types = q9.qwen3_to_gguf(model, None, tmp_path / "q.gguf", "F16")
    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    llama_cpp_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, model.cfg.num_hidden_layers)
    assert [t.name for t in reader.tensors] == list(types) == [
        llama_cpp_names.get_name(name, try_suffixes=(".weight",)) for name in model.state_dict()]
    assert ("output.weight" in types) != tied
    assert all(types[t.name] == ("F32" if len(t.shape) == 1 else "F16") for t in reader.tensors)
    keys = {gguf.Keys.LLM.CONTEXT_LENGTH: 256, gguf.Keys.LLM.EMBEDDING_LENGTH: 64,
            gguf.Keys.LLM.BLOCK_COUNT: 2, gguf.Keys.LLM.FEED_FORWARD_LENGTH: 192,
            gguf.Keys.Attention.HEAD_COUNT: 4, gguf.Keys.Attention.HEAD_COUNT_KV: 2,
            gguf.Keys.Attention.KEY_LENGTH: 32, gguf.Keys.Attention.VALUE_LENGTH: 32}
    for key, value in keys.items():
        field = reader.fields[key.format(arch="qwen3")]
        assert field.types == [V.UINT32] and field.contents() == value, key
    for key, value in {gguf.Keys.Rope.FREQ_BASE: 1e6,
                       gguf.Keys.Attention.LAYERNORM_RMS_EPS: 1e-6}.items():
        field = reader.fields[key.format(arch="qwen3")]
        assert field.types == [V.FLOAT32] and field.contents() == np.float32(value), key
    assert reader.fields["general.architecture"].contents() == "qwen3"

    loaded = q9.qwen3_from_gguf(tmp_path / "q.gguf", "cpu", torch.float32)
    assert loaded.cfg == model.cfg
    with torch.no_grad():
        assert torch.equal(loaded(PROMPT), model(PROMPT))
    tokens = greedy(q9, model)
    assert greedy(q9, loaded) == tokens and len(set(tokens[0])) > 3


def test_qwen3_q8_0_logits_close(q9, tiny_qwen3, tmp_path):
    """At Q8_0 each weight errs by at most amax / 254 of its block (0.54% of the weights' norm
    here); through two layers at this model's gain the logits err by ~2% (relative, in norm). The
    bound: 3%, and no more than 1.25x the error of the same weights through llama.cpp's own Q8_0
    quantizer (gguf.quants.quantize). Norms stay F32; token_embd and every matrix are Q8_0."""
    types = q9.qwen3_to_gguf(tiny_qwen3, None, tmp_path / "q.gguf", "Q8_0")
    assert all(t == ("F32" if "norm" in name else "Q8_0") for name, t in types.items())
    loaded = q9.qwen3_from_gguf(tmp_path / "q.gguf", "cpu", torch.float32)
    reference = q9.random_model(tiny_qwen3.cfg, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        for p, w in zip(reference.parameters(), tiny_qwen3.parameters()):
            if p.dim() == 2:
                w = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), Q.Q8_0), Q.Q8_0)
            p.copy_(torch.as_tensor(w).reshape(p.shape))
        ref, out, theirs = tiny_qwen3(PROMPT), loaded(PROMPT), reference(PROMPT)
    rel, rel_theirs = [((y - ref).norm() / ref.norm()).item() for y in (out, theirs)]
    assert 1e-3 < rel < min(0.03, 1.25 * rel_theirs), (rel, rel_theirs)


def test_qwen3_k_quant_falls_back_to_f16(q9, tiny_qwen3, tmp_path):
    """The tiny model's rows (64 and 192 values) are not whole Q4_K blocks of 256: every matrix
    falls back to F16, with a warning naming them, and the file still loads."""
    with pytest.warns(UserWarning, match="written as F16: model.embed_tokens.weight"):
        types = q9.qwen3_to_gguf(tiny_qwen3, None, tmp_path / "q.gguf", "Q4_K")
    assert set(types.values()) == {"F16", "F32"}
    assert q9.qwen3_from_gguf(tmp_path / "q.gguf", "cpu").cfg == tiny_qwen3.cfg


def test_qwen3_tokenizer_metadata(q9, tiny_qwen3, tmp_path):
    """07's demo tokenizer (GPT-2's first 8,192 ranks and Qwen3's chat tokens) written with the
    model: the tokens, merges and token types are those of the tokenizer.json it was loaded
    from, the ids it lacks up to the model's vocabulary are unused "[PAD<id>]" tokens, and the
    eos id is <|im_end|>'s."""
    folder = q9.demo_tokenizer(tmp_path)
    tokenizer = q9.load_tokenizer(folder)
    q9.qwen3_to_gguf(tiny_qwen3, tokenizer, tmp_path / "q.gguf", "F16")
    spec = json.loads((folder / "tokenizer.json").read_text("utf-8"))
    vocab = {i: token for token, i in spec["model"]["vocab"].items()}
    vocab.update({a["id"]: a["content"] for a in spec["added_tokens"]})
    special = {a["id"]: a["special"] for a in spec["added_tokens"]}
    n_vocab = tiny_qwen3.cfg.vocab_size
    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    f = reader.fields
    assert f["tokenizer.ggml.model"].contents() == "gpt2"
    assert f["tokenizer.ggml.pre"].contents() == "gpt2"  # the demo's split regex is GPT-2's
    assert f["tokenizer.ggml.tokens"].contents() == [vocab.get(i, f"[PAD{i}]")
                                                      for i in range(n_vocab)]
    assert f["tokenizer.ggml.token_type"].types == [V.ARRAY, V.INT32]
    T = gguf.TokenType
    assert f["tokenizer.ggml.token_type"].contents() == [
        (T.CONTROL if special[i] else T.USER_DEFINED) if i in special
        else T.NORMAL if i in vocab else T.UNUSED for i in range(n_vocab)]
    merges = f["tokenizer.ggml.merges"].contents()
    assert merges == [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    # BPE as llama.cpp runs it, from the file alone: merge the adjacent pair that comes first in
    # the merges until none is left, then look the pieces up in the tokens. Each word of a text
    # gets 07's ids.
    ranks = {tuple(m.split(" ")): rank for rank, m in enumerate(merges)}
    ids = {token: i for i, token in enumerate(f["tokenizer.ggml.tokens"].contents())}
    to_char = {b: c for c, b in q9.byte_level_alphabet().items()}
    words = (ROOT / "data" / "the-verdict.txt").read_text("utf-8").split()[:400]
    for word in {" " + w for w in words if w.isalpha()}:
        parts = [to_char[b] for b in word.encode()]
        while len(parts) > 1:
            rank, i = min((ranks.get(pair, math.inf), i) for i, pair in
                          enumerate(zip(parts, parts[1:])))
            if rank == math.inf:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        assert [ids[p] for p in parts] == tokenizer.encode(word), word
    added = {a["content"]: a["id"] for a in spec["added_tokens"]}
    assert f["tokenizer.ggml.eos_token_id"].contents() == added["<|im_end|>"]
    assert f["tokenizer.ggml.add_bos_token"].contents() is False
    assert f["tokenizer.chat_template"].contents() == tokenizer.chat_template


# -- (e) bad input ---------------------------------------------------------------------------------
# A small file whose layout the tests spell out (the spec's, 32-byte alignment):
#   0   header: "GGUF", u32 3, u64 1 tensor, u64 1 key
#   24  key "k": u64 length 1, "k" (32), u32 value type 4 = uint32 (33), u32 value 1 (37)
#   41  tensor "w": u64 length 1, "w" (49), u32 n_dims 2 (50), u64 dims 32, 1 (54), u32 ggml
#       type 8 = Q8_0 (70), u64 offset 0 (74); the infos end at 82
#   96  data (82 aligned to 32): one Q8_0 block of 34 bytes, padded to 64: 160 bytes in all

def small_file(q9, tmp_path):
    path = tmp_path / "s.gguf"
    q9.write_gguf(path, {"k": ("uint32", 1)}, {"w": (torch.ones(1, 32), "Q8_0")})
    data = bytearray(path.read_bytes())
    assert len(data) == 160 and data[33:37] == struct.pack("<I", 4) and data[50:51] == b"\x02"
    return path, data


def patched(path, data, at, fmt, value):
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("at, fmt, value, message", [
    (0, "<4s", b"GGML", r"not a GGUF file \(it starts with b'GGML'"),
    (4, "<I", 4, "GGUF version 4: this reader reads versions 2 and 3"),
    (4, ">I", 3, "version 50331648 \\(a big-endian file\\?\\)"),
    (33, "<I", 13, "metadata key 'k' has value type 13, which is not a GGUF type"),
    (70, "<I", 13, "tensor 'w' has ggml type 13, which this reader does not implement"),
    (70, "<I", 99, "tensor 'w' has ggml type 99"),
    (74, "<Q", 64, r"tensor 'w' \(34 bytes from byte 160\) runs past the end of the file"),
    (74, "<Q", 8, "tensor 'w' is at offset 8, not a multiple of the alignment 32"),
    (54, "<Q", 33, "tensor 'w' has dims \\[33, 1\\]: its rows are not whole Q8_0 blocks"),
])
def test_bad_file_is_an_error_naming_file_and_field(q9, tmp_path, monkeypatch, at, fmt, value,
                                                    message):
    """Each broken field is a DataError naming the file and the field, raised before any tensor
    is decoded."""
    path, data = small_file(q9, tmp_path)
    patched(path, data, at, fmt, value)
    monkeypatch.setattr(q9, "ggml_dequantize", lambda *a: pytest.fail("a tensor was decoded"))
    with pytest.raises(q9.DataError, match=message) as error:
        q9.read_gguf(path)
    assert str(error.value).startswith(f"{path}: ")


@pytest.mark.parametrize("size, field", [
    (0, "the magic number"), (6, "the version"), (20, "the metadata count"),
    (30, "metadata key 0"), (36, "metadata key 'k'"), (39, "metadata key 'k'"),
    (60, "tensor 'w'"), (80, "tensor 'w'"), (120, r"tensor 'w' \(34 bytes from byte 96\) runs "
                                                 r"past the end of the file \(120 bytes\)")])
def test_truncated_file_is_an_error_naming_the_field(q9, tmp_path, size, field):
    path, data = small_file(q9, tmp_path)
    path.write_bytes(data[:size])
    with pytest.raises(q9.DataError, match=field) as error:
        q9.read_gguf_raw(path)
    assert str(error.value).startswith(f"{path}: ")
    if size < 96:
        assert "truncated" in str(error.value)


def test_huge_counts_are_truncation_not_memory(q9, tmp_path):
    """A corrupt count (an array of 2^60 strings) is a truncation error, not an attempt to read."""
    path = q9.write_gguf(tmp_path / "c.gguf", {"k": ["a", "b"]}, {})
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, 24 + 9 + 4 + 4, 2**60)  # key, ARRAY, element type; then count
    path.write_bytes(data)
    with pytest.raises(q9.DataError, match="truncated: metadata key 'k'"):
        q9.read_gguf_raw(path)


@pytest.mark.parametrize("metadata, tensors, message", [
    ({}, {"w": (torch.ones(2, 48), "Q8_0")}, r"'w' \(2, 48\): rows are not whole Q8_0 blocks"),
    ({}, {"w": (torch.ones(2, 32), "Q5_K")}, "ggml type 'Q5_K' is not one of"),
    ({}, {"x" * 64: (torch.ones(1), "F32")}, "names of 63 bytes at most"),
    ({}, {"w": (torch.full((1, 32), math.inf), "Q4_0")}, "'w': Q4_0: the values hold inf or nan"),
    ({}, {"w": (torch.full((2,), 7e4), "F16")}, "'w': a value of 7e\\+04 is beyond F16's range"),
    ({"k": ("uint8", 256)}, {}, "'k'.*do not fit GGUF type uint8"),
    ({"k": ("int32", [1, 2.5])}, {}, "'k'.*do not fit GGUF type int32"),
    ({"k": [1, "a"]}, {}, "'k': a list of element types"),
    ({"k": []}, {}, "'k': a list of element types"),
    ({"k": ("string", 3)}, {}, "'k': 3 is not a str"),
    ({"k": ("array", [1])}, {}, "'k': an array of arrays"),
    ({"k": None}, {}, "'k': a NoneType has no GGUF type"),
    ({"general.alignment": 12}, {}, "must be a power of two"),
])
def test_bad_input_to_the_writer_writes_nothing(q9, tmp_path, metadata, tensors, message):
    with pytest.raises(ValueError, match=message):
        q9.write_gguf(tmp_path / "x.gguf", metadata, tensors)
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_the_old_file(q9, tmp_path, monkeypatch):
    """An error while tensors are written (here, in the second one) leaves the file that was there
    untouched and no temporary file beside it."""
    path = tmp_path / "x.gguf"
    path.write_bytes(b"old")
    calls = []

    def failing(x, type_name):
        calls.append(type_name)
        if len(calls) == 2:
            raise RuntimeError("disk full")
        return quantize(x, type_name)

    quantize = q9.ggml_quantize
    monkeypatch.setattr(q9, "ggml_quantize", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        q9.write_gguf(path, {}, {"a": (torch.ones(32), "Q8_0"), "b": (torch.ones(32), "Q8_0")})
    assert path.read_bytes() == b"old" and list(tmp_path.iterdir()) == [path]


def test_qwen3_from_gguf_errors(q9, tiny_qwen3, tmp_path):
    """A file of another architecture, without a required key or without a tensor is a DataError
    naming the file and what is wrong."""
    tensors = {name: (w, "F32") for name, w in
               ((q9.gguf_tensor_name(n), w) for n, w in tiny_qwen3.state_dict().items())}
    metadata = q9._qwen3_metadata(tiny_qwen3.cfg)
    cases = [({**metadata, "general.architecture": "llama"}, tensors,
              "general.architecture is 'llama'; this loader reads 'qwen3'"),
             ({k: v for k, v in metadata.items() if k != "qwen3.block_count"}, tensors,
              "metadata key 'qwen3.block_count' is missing"),
             (metadata, {k: v for k, v in tensors.items() if k != "blk.1.ffn_up.weight"},
              r"missing \['blk.1.ffn_up.weight'\]"),
             ({**metadata, "qwen3.attention.head_count_kv": ("uint32", 3)}, tensors,
              "num_attention_heads \\(4\\) must be a multiple of num_key_value_heads \\(3\\)")]
    for i, (meta, tens, message) in enumerate(cases):
        path = q9.write_gguf(tmp_path / f"{i}.gguf", meta, tens)
        with pytest.raises(q9.DataError, match=message) as error:
            q9.qwen3_from_gguf(path, "cpu")
        assert str(error.value).startswith(f"{path}: ")


TEXTS = ["Every effort moves you", " Hello  world\n\n3.14159 and 2024!", "café naïve ﬁne Ω ≈ 😀",
         "<|im_start|>user\nHi<|im_end|>\n", "don't    stop\t\tnow?!  "]


@pytest.mark.parametrize("pre", ["gpt2", "qwen2"])
def test_a_tokenizer_read_back_from_gguf_encodes_alike(q9, tmp_path, pre):
    """main's demo tokenizer ("gpt2": GPT-2's split regex, no normalizer) and the same ranks
    with Qwen's split regex after NFC ("qwen2"), written as tokenizer.ggml.* keys and read back
    by gguf_tokenizer: the same ids for every text, the same eos ids, chat template and special
    ids."""
    folder = q9.demo_tokenizer(tmp_path)
    if pre == "qwen2":
        spec = json.loads((folder / "tokenizer.json").read_text("utf-8"))
        spec["normalizer"], spec["pre_tokenizer"] = q9._PRE_TOKENIZERS["qwen2"]
        (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    tokenizer = q9.load_tokenizer(folder)
    metadata = q9.gguf_tokenizer_metadata(tokenizer, 8256)
    assert metadata["tokenizer.ggml.pre"] == pre
    path = q9.write_gguf(tmp_path / "t.gguf", metadata, {})
    read_back = q9.gguf_tokenizer(q9.read_gguf_raw(path)[0], path)
    text = (ROOT / "data" / "the-verdict.txt").read_text("utf-8")[:3000]
    for t in [text, *TEXTS]:
        assert read_back.encode(t) == tokenizer.encode(t), t
    assert read_back.eos_token_ids == {8194}  # GGUF keeps one: <|im_end|>
    assert read_back.chat_template == tokenizer.chat_template
    assert read_back.special_ids == tokenizer.special_ids
    assert read_back.decode(tokenizer.encode(text)) == text
    no_tokenizer = q9.write_gguf(tmp_path / "n.gguf", {"general.architecture": "qwen3"}, {})
    with pytest.raises(q9.DataError, match="metadata key 'tokenizer.ggml.model' is missing"):
        q9.gguf_tokenizer(q9.read_gguf_raw(no_tokenizer)[0], no_tokenizer)


# ------------------------------------------------------------------------------------------------
# Quality: a small Qwen3 trained here, and GPTQ and AWQ against round to nearest
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(q9, tmp_path_factory):
    """QUALITY_RUNS["cpu"]'s model trained for 60 steps on the first 90% of the-verdict.txt in the
    demo tokenizer, its calibration batches and held-out windows (main's split and sizes)."""
    tokenizer = q9.load_tokenizer(q9.demo_tokenizer(tmp_path_factory.mktemp("tokenizer")))
    tokens = q9.verdict_tokens(tokenizer)
    run, split = {**q9.QUALITY_RUNS["cpu"], "steps": 60}, len(tokens) * 9 // 10
    torch.set_num_threads(1)
    model = q9.train_small_qwen3(tokens[:split], **run, device=torch.device("cpu"))
    calibration = list(q9.windows(tokens[:split], run["context"]).split(8))
    return model, calibration, q9.windows(tokens[split:], run["context"] + 1)


def test_gptq_and_awq_beat_rtn_on_the_trained_model(q9, trained, capsys):
    """The quality table at small size. The model's input sizes (C = 128, Hq * D = 128, I = 384)
    are all multiples of 128, so int4 runs in groups of 128, as on a real model: GPTQ's and AWQ's
    output error on held-out activations is below round to nearest's on average and in most
    layers. Training lowered the held-out perplexity far below the vocabulary's 8,256, every
    method's stays within 2% of the float model's, and the float row is exp of the mean
    cross-entropy computed here."""
    model, calibration, held_out = trained
    results, kept = q9.quality_table(model, calibration, held_out, 128, keep="gptq",
                                     per_layer=False)
    out = capsys.readouterr().out
    assert "int4 in groups of 128" in out and "W8A8, SmoothQuant" in out
    rtn = results["int4"]["errors"]
    for method in ("gptq", "awq"):
        errors = results[method]["errors"]
        assert sum(errors.values()) < 0.95 * sum(rtn.values()), (method, errors, rtn)
        assert sum(errors[name] < rtn[name] for name in rtn) >= 11, (method, errors, rtn)
    with torch.no_grad():
        nll = F.cross_entropy(model(held_out[:, :-1]).flatten(0, 1), held_out[:, 1:].flatten())
    assert results["float"]["perplexity"] == pytest.approx(math.exp(nll.item()), rel=1e-5)
    assert results["float"]["perplexity"] < 1000
    for method in q9.METHODS:
        assert results[method]["perplexity"] == pytest.approx(results["float"]["perplexity"],
                                                              rel=0.02), method
    assert all(type(m) is q9.Int4Linear for m in twins(q9, kept).values())  # GPTQ's copy
    assert not twins(q9, model)  # the float model itself untouched


# ------------------------------------------------------------------------------------------------
# What 09 changed of 07's: engine v1 and sampling (plain tokens), bytes_per_step, DATA_FILES
# ------------------------------------------------------------------------------------------------

def test_engine_v1_greedy_equals_full_recomputation(q9):
    """generate's greedy tokens (a right-padded batch of three prompts, prefill then decode over
    the KV cache) are the argmax of the full model run on prompt + tokens so far, for the float
    model and its int4 twin; a row stops at an eos id, which it keeps."""
    prompts = [[5, 17, 33, 2, 90], [1, 2, 3, 4, 5, 6, 7, 8, 9], [60, 61, 62]]
    for model in (tiny_model(q9), q9.quantize_model(tiny_model(q9), "int4", 32)):
        out = q9.generate(model, prompts, q9.SamplingParams(temperature=0, max_tokens=6))
        with torch.no_grad():
            for prompt, tokens in zip(prompts, out):
                seq = prompt + tokens
                full = model(torch.tensor([seq]))[0, len(prompt) - 1:-1].argmax(-1)
                assert full.tolist() == tokens and len(tokens) == 6
        eos = out[0][2]
        stopped = q9.generate(model, prompts[:1], q9.SamplingParams(temperature=0, max_tokens=6),
                              eos_token_ids=[eos])[0]
        assert stopped == out[0][:out[0].index(eos) + 1]
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        q9.generate(model, prompts, {"temperature": 0})
    with pytest.raises(ValueError, match=r"token ids in \[0, 97\)"):
        q9.generate(model, [[3, 97]])


def test_sampler_draws_what_its_parameters_say(q9):
    """One logits row repeated 4,000 times: greedy rows take the argmax; top-k 3 at temperature 1,
    each row seeded with its own seed, draws only the three likeliest, as often as their
    renormalized softmax says (within 4 standard deviations), and the same tokens again; a
    repetition penalty of 2 on a prompt holding the argmax halves its logit: the next one wins."""
    base = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, -1.0])
    logits = base.repeat(4000, 1)

    def sample(params):
        return q9.Sampler()(logits, q9.SamplingBatch(params, [[0]] * len(params), 6, "cpu"))

    assert (sample([q9.SamplingParams(temperature=0)] * 4000) == 0).all()
    seeded = [q9.SamplingParams(temperature=1.0, top_k=3, seed=i) for i in range(4000)]
    tokens = sample(seeded)
    p = base[:3].softmax(0)
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[3:].sum() == 0
    assert ((counts[:3] / 4000 - p).abs() <= 4 * (p * (1 - p) / 4000).sqrt()).all(), counts
    assert torch.equal(sample(seeded), tokens)
    penalized = sample([q9.SamplingParams(temperature=0, repetition_penalty=2.0)] * 4000)
    assert (penalized == 1).all()  # 3 / 2 = 1.5 < 2.5


def test_sampling_params_are_checked_and_plain(q9):
    """A bad value names its field; 07's engine-only fields are gone (n, stop strings, logprobs,
    structured output)."""
    for field, value in (("temperature", -1), ("top_p", 0), ("top_k", -2), ("max_tokens", 0),
                         ("seed", -1), ("stop_token_ids", "ab")):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field} = "):
            q9.SamplingParams(**{field: value})
    for field in ("n", "stop", "logprobs", "regex", "choice", "json_schema"):
        with pytest.raises(TypeError, match=field):
            q9.SamplingParams(**{field: None})
    assert q9.SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_bytes_per_step_counts_quantized_buffers(q9):
    """A decode step's bytes, by hand: the int4 linears' packed words (half a byte a weight) and
    fp32 scales and zeros (2 x 4 bytes a group of 32), the output layer, the norms, the cache;
    not the embedding, of which a step reads one row."""
    model = q9.quantize_model(tiny_model(q9), "int4", 32)
    linears = sum(N * K // 2 + 2 * N * (K // 32) * 4 for N, K in SHAPES_NK.values()) * 2
    norms = 2 * (64 + 64 + 16 + 16) * 4 + 64 * 4
    cache = 2 * 2 * 2 * 16 * 10 * 4  # k and v, 2 layers, 2 kv heads of 16, 10 positions
    assert q9.bytes_per_step(model, 1, 10) == linears + 97 * 64 * 4 + norms + cache


def test_the_verdict_is_a_checked_data_file(q9):
    """DATA_FILES names the-verdict.txt with data/README.md's sha256; a copy in data/ is that."""
    url, path, sha256 = q9.data_entry("the-verdict.txt")
    readme = (ROOT / "data" / "README.md").read_text()
    assert f"| `the-verdict.txt` | 20,479 | `{sha256}` |" in readme and url in readme
    if path.is_file():
        assert q9._sha256(path) == sha256


def test_load_qwen3_still_loads_a_float_checkpoint(q9, tmp_path):
    """read_weights and load_qwen3, changed for quantized files, load a float directory (written
    by save_qwen3, read by transformers too) as 07 did: the same logits as transformers'."""
    from transformers import Qwen3ForCausalLM
    model = tiny_model(q9)
    q9.save_qwen3(model, tmp_path)
    loaded = q9.load_qwen3(tmp_path, "cpu", torch.float32)
    hf = Qwen3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
        assert rel(loaded(ids), hf(ids).logits) < 1e-5
    assert not twins(q9, loaded)


# ------------------------------------------------------------------------------------------------
# main: the chapters end to end, GGUF files in and out, a quantized checkpoint, the flags
# ------------------------------------------------------------------------------------------------

def test_main_on_the_cpu():
    """python 09_quant_lora.py --device cpu: the quantized kernels (Triton's interpreter) against
    their torch paths, the quality table with GPTQ and AWQ below RTN, GGUF files read back,
    the tokenizer read back, LoRA merged equal to its adapters, an NF4 base, the int4 model's
    text."""
    out = check_main("09_quant_lora", 4, 1e-5, timeout=300)
    assert re.search(r"trained 100 steps of 8 x 64 tokens .* loss 9\.\d+ -> [345]\.\d+", out), out
    for method in ("int8", "int4", "w8a8"):
        assert f"{method} rel err" in out
    assert "held-out perplexity (576 tokens)" in out and "int4 in groups of 128" in out
    for label in ("int4, GPTQ", "int4, AWQ"):
        line = re.search(rf"^{label} against int4, RTN: mean layer error (\S+)x, lower in (\d+) "
                         rf"of 14 layers$", out, re.MULTILINE)
        assert line and float(line[1]) < 0.95 and int(line[2]) >= 11, out
    for kind in ("F16", "Q8_0"):
        assert re.search(rf"^  {kind} .* greedy tokens identical$", out, re.MULTILINE), out
    assert "its tokenizer, read back from the file: --prompt encodes alike" in out
    assert "generated by the int4, RTN model (16 tokens, greedy" in out
    assert re.search(r"^LoRA, r = 8 on every linear \(trainable: [\d,]+ of [\d.]+M \([\d.]+%\)\): "
                     r"merged into the weights against the adapters' forward, rel err", out, re.M)
    nf4 = re.search(r"^QLoRA's base in NF4 \(4\.1\d\d bits a weight .*\): logits (\S+) ", out, re.M)
    assert nf4 and 1e-4 < float(nf4[1]) < 0.1, out  # 4 bits move the logits, a little


@pytest.fixture
def quick(q9, monkeypatch):
    """main's small model trained for 3 steps: enough to write and read a file."""
    monkeypatch.setitem(q9.QUALITY_RUNS["cpu"], "steps", 3)
    return q9


def test_main_writes_a_gguf_file_and_generates_from_it(quick, tmp_path, capsys, monkeypatch):
    q9, path = quick, tmp_path / "small.gguf"
    q9.main(["--device", "cpu", "--save-gguf", str(path), "--type", "q8_0"])
    out = capsys.readouterr().out
    assert f"wrote {path}: " in out and "25 tensors (16 Q8_0, 9 F32) and the tokenizer" in out
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "qwen3"
    assert {t.tensor_type for t in reader.tensors} == {Q.Q8_0, Q.F32}
    q9.main(["--device", "cpu", "--gguf", str(path), "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert f"Qwen3 from {path}: 2 layers, C=128, V=8,256" in out
    assert "generated by the GGUF file's model (4 tokens, greedy" in out
    assert out.rsplit("Every effort moves you", 1)[1].strip()
    calls = []

    def failing(x, type_name, real=q9.ggml_quantize):  # the disk fills at the third tensor
        calls.append(type_name)
        if len(calls) == 3:
            raise OSError("no space left on device")
        return real(x, type_name)

    monkeypatch.setattr(q9, "ggml_quantize", failing)
    with pytest.raises(OSError, match="no space left"):
        q9.main(["--device", "cpu", "--save-gguf", str(tmp_path / "half.gguf")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.gguf"]  # nothing half-written


def test_main_with_a_model_directory_and_a_gptq_checkpoint(q9, tmp_path, capsys):
    """--model: a float directory runs the quality table on its weights (the tiny model's hidden
    size is 64: groups of 32) and generates with --method's model; a GPTQ checkpoint (with main's
    demo tokenizer) prints its held-out perplexity and generates on its quantized layers."""
    model = q9.random_model(q9.Qwen3Config.tiny(), torch.device("cpu"), torch.float32)
    float_dir = q9.save_qwen3(model, tmp_path / "float")
    q9.demo_tokenizer(float_dir)
    q9.main(["--model", str(float_dir), "--device", "cpu", "--group-size", "32", "--method",
             "awq", "--max-tokens", "3"])
    out = capsys.readouterr().out
    assert f"Qwen3 from {float_dir}: 2 layers, C=64" in out and "int4 in groups of 32" in out
    assert "(the Triton kernels not checked" in out and "output error, by method" not in out
    assert "generated by the int4, AWQ model (3 tokens, greedy" in out
    gptq_dir = tmp_path / "gptq"
    write_checkpoint(gptq_dir, GPTQ_CASES[1], vocab_size=8256)
    q9.demo_tokenizer(gptq_dir)
    q9.main(["--model", str(gptq_dir), "--device", "cpu", "--max-tokens", "3"])
    out = capsys.readouterr().out
    assert re.search(r"a quantized checkpoint, its layers Int4Linear: held-out perplexity "
                     r"[\d,.]+", out), out
    assert "generated by the checkpoint's model (3 tokens, greedy" in out


def test_bench_without_a_gpu_prints_one_line(q9, capsys):
    q9.main(["--bench", "--device", "cpu"])
    assert capsys.readouterr().out.count("\n") == 1


BAD_FLAGS = [
    (["--model", "FILE"], "is a file; give the directory"),
    (["--model", "/no/such/dir"], "no such directory, and not a Hub id"),
    (["--model", " "], "--model is empty"),
    (["--device", "tpu9"], "--device tpu9"),
    (["--device", "cuda:x"], "--device cuda:x: not a device"),
    (["--data-dir", "FILE"], "is a file, not a directory"),
    (["--dtype", "int8"], "invalid choice"),
    (["--method", "int3"], "invalid choice"),
    (["--group-size", "0"], "must be a positive integer"),
    (["--group-size", "12"], "--group-size 12: must be a multiple of 8 dividing"),
    (["--group-size", "256"], r"--group-size 256: .* \(hidden_size = 128, intermediate_size ="),
    (["--max-tokens", "0"], "must be a positive integer"),
    (["--max-tokens", "100000"], "--max-tokens 100000: the model's context is 256 positions"),
    (["--seed", "-3"], "must be an integer >= 0"),
    (["--prompt", " "], "--prompt is empty"),
    (["--bench", "--model", "/no/such/dir"], "--model does not apply to --bench"),
    (["--bench", "--gguf", "FILE"], "--bench and --gguf do not go together"),
    (["--gguf", "FILE", "--save-gguf", "x.gguf"], "--gguf and --save-gguf do not go together"),
    (["--gguf", "FILE", "--method", "gptq"], "--method does not apply to --gguf"),
    (["--gguf", "/no/such.gguf"], "--gguf /no/such.gguf: no such file"),
    (["--type", "q4_k"], "--type applies to --save-gguf only"),
    (["--save-gguf", "x.gguf", "--type", "q5_k"], "invalid choice"),
    (["--save-gguf", "/no/such/dir/x.gguf"], "directory /no/such/dir does not exist"),
    (["--save-gguf", "DIR"], "is a directory; give the file to write"),
    (["--save-gguf", "x.gguf", "--method", "int4"], "--method does not apply to --save-gguf"),
]


@pytest.mark.parametrize("argv, message", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_a_bad_flag_stops_main_before_any_work(q9, monkeypatch, capsys, tmp_path, argv, message):
    never = ("train_small_qwen3", "load_qwen3", "download_model", "fetch", "qwen3_from_gguf",
             "run_benches", "write_gguf")
    argv = [str(tmp_path) if arg == "DIR" else arg for arg in argv]
    check_bad_flag(q9, argv, message, never, monkeypatch, capsys, tmp_path)


def test_a_models_config_is_checked_before_its_weights(q9, tmp_path, monkeypatch, capsys):
    """--model's config.json decides before any weight loads: a group size that does not divide
    its sizes, --max-tokens past its context, --method on a quantized checkpoint; an unsupported
    quantization_config is a one-line error naming the file and field (as a script: exit 1)."""
    write_checkpoint(tmp_path, GPTQ_CASES[0])
    monkeypatch.setattr(q9, "load_qwen3", lambda *a, **k: pytest.fail("the weights loaded"))
    for argv, message in ((["--max-tokens", "64"], "the model's context is 64 positions"),
                          (["--method", "int8"], "--method does not apply to .*, a gptq "
                                                 "checkpoint already quantized"),
                          (["--group-size", "32"], "--group-size does not apply to .*, a gptq "
                                                   "checkpoint already quantized")):
        with pytest.raises(SystemExit):
            q9.main(["--model", str(tmp_path), "--device", "cpu", *argv])
        assert re.search(message, capsys.readouterr().err)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = subprocess.run([sys.executable, str(ROOT / "09_quant_lora.py"), "--model",
                             str(tmp_path), "--device", "cpu"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: {tmp_path / 'config.json'}: "
                                    f"quantization_config.bits = 3 is not supported")


def test_help_describes_the_stage_in_whole_sentences(q9, capsys):
    with pytest.raises(SystemExit):
        q9.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    first = " ".join(q9.__doc__.split("\n\n")[0].split())
    assert first in help_text and first.endswith(".")


# ------------------------------------------------------------------------------------------------
# On a GPU: the kernels at Qwen3-8B's shapes, generate on the int4 model's CUDA graph, GPTQ
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("N, K", [(4096, 4096), (1024, 4096), (4096, 12288)])
def test_gpu_kernels_at_qwen3_8b_shapes(q9, N, K):
    """bf16, groups of 128: the matvec at 1 and 16 rows, the matmul at 333, int8's, and W8A8's
    against float64 references."""
    w = gen(N, K, seed=21).cuda().bfloat16() * 0.02
    int4, int8 = q9.quantize_int4(w, 128), q9.quantize_int8(w)
    w4, w8 = q9.dequantize_int4(*int4, 128).double(), q9.dequantize_int8(*int8).double()
    for M in (1, 16, 333):
        x = gen(M, K, seed=M).cuda().bfloat16()
        fn4 = q9.int4_matvec if M <= 16 else q9.int4_matmul
        fn8 = q9.int8_matvec if M <= 16 else q9.int8_matmul
        assert rel(fn4(x, *int4, 128), x.double() @ w4.T) < 1e-2
        assert rel(fn8(x, *int8), x.double() @ w8.T) < 1e-2
        xq, sx = q9.quantize_per_token(x)
        exact = (xq.double() @ int8[0].double().T) * sx.double()[:, None] * int8[1].double()
        assert rel(q9.int8_w8a8_matmul(xq, sx, *int8, torch.bfloat16), exact) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["int8", "int4", "w8a8"])
def test_gpu_generate_on_quantized_twins_replays_its_graph(q9, method):
    """generate on a quantized model, its decode replayed from a CUDA graph, equals the eager
    decode; the twins ran their kernels (the model is on CUDA)."""
    model = q9.random_model(q9.Qwen3Config(vocab_size=1000, hidden_size=256,
                                           intermediate_size=768, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=64, max_position_embeddings=256,
                                           tie_word_embeddings=False),
                            torch.device("cuda"), torch.bfloat16)
    q9.quantize_model(model, method, 128)
    assert all(m.kernels for m in twins(q9, model).values())
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    params = q9.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert q9.generate(model, prompts, params) == q9.generate(model, prompts, params,
                                                               cuda_graph_decode=False)


@pytest.mark.gpu
def test_gpu_gptq_and_awq_on_cuda_equal_the_cpus(q9):
    """GPTQ and AWQ run on the device of the model (calibration, Hessians, scales there): the
    twins they make on CUDA hold the CPU's integers, but for rounding ties."""
    ids = [x.cuda() for x in batches()]
    for quantize in (lambda m, b: q9.gptq_quantize_model(m, b, group_size=32),
                     lambda m, b: q9.awq_quantize_model(m, b, group_size=32)):
        cpu, gpu = tiny_model(q9, head_dim=32), tiny_model(q9, head_dim=32).cuda().use_kernels()
        quantize(cpu, batches())
        quantize(gpu, ids)
        for name, twin in twins(q9, cpu).items():
            other = twins(q9, gpu)[name]
            same = (q9.unpack_int4(twin.qweight) == q9.unpack_int4(other.qweight.cpu()))
            assert same.float().mean() > 0.98, name


# ----------------------------------------------------------------------- chapter 22: LoRA
# The oracle is the `peft` package on a transformers Qwen3ForCausalLM of the same tiny config.

LORA_CFG = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
           rms_norm_eps=1e-6, tie_word_embeddings=False)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]



@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random transformers Qwen3ForCausalLM, saved."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(**LORA_CFG, dtype=torch.float32)).eval()
    folder = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(folder)
    return folder


def hf_model(hf_dir):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()


def randomize_b(model, q9, seed=1):
    """Non-zero B (B = 0 would make every adapter invisible, and the oracle vacuous)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in q9.lora_layers(model).values():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.1)
    return model


IDS = torch.randint(0, 1000, (2, 13), generator=torch.Generator().manual_seed(3))


def test_lora_linear_forward_init_and_merge(q9):
    """forward = x W^T + scale x A^T B^T against float64; B starts at zero (the base exactly); A
    has nn.Linear's kaiming-uniform bound 1/sqrt(K); merge/unmerge give the same outputs."""
    torch.manual_seed(0)
    base = nn.Linear(37, 53, bias=False)
    x = torch.randn(3, 5, 37)
    layer = q9.LoRALinear(base, r=6, alpha=12)
    assert torch.equal(layer(x), base(x))  # B = 0: the base model exactly
    bound = 1 / 37 ** 0.5
    largest = layer.lora_A.weight.abs().max()
    assert 0.8 * bound < largest <= bound
    nn.init.normal_(layer.lora_B.weight)
    w0 = base.weight.detach().clone()
    A, B = layer.lora_A.weight.double(), layer.lora_B.weight.double()
    want = x.double() @ (w0.double() + 2.0 * B @ A).T
    y = layer(x)
    assert rel(y, want) < 1e-6
    assert layer.merge().merged and rel(base.weight, w0) > 1e-3
    assert rel(layer(x), y) < 1e-6 and rel(base(x), want) < 1e-6  # merged: the base alone
    layer.unmerge()
    assert not layer.merged and (base.weight - w0).abs().max() < 1e-6
    assert rel(layer(x), y) < 1e-6


def test_dropout_acts_on_the_adapter_input_only(q9):
    torch.manual_seed(0)
    layer = q9.LoRALinear(nn.Linear(16, 16, bias=False), r=4, alpha=4, dropout=0.5).train()
    x = torch.randn(200, 16)
    assert torch.equal(layer(x), layer.base_layer(x))  # B = 0: dropout changes nothing yet
    nn.init.normal_(layer.lora_B.weight)
    torch.manual_seed(1)
    y1 = layer(x)
    torch.manual_seed(2)
    assert not torch.allclose(y1, layer(x))  # training: the adapter's input dropped at random
    layer.eval()
    assert torch.equal(layer(x), layer(x))


def test_quantized_base_forward_and_merge_refused(q9):
    torch.manual_seed(0)
    q = q9.Int8Linear.from_linear(nn.Linear(64, 32, bias=False))
    layer = q9.LoRALinear(q, r=4, alpha=8)
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(4, 64)
    want = x.double() @ (q.dequantize().double()
                         + 2 * layer.lora_B.weight.double() @ layer.lora_A.weight.double()).T
    assert rel(layer(x), want) < 1e-6
    with pytest.raises(TypeError, match="Int8Linear, quantized.*QLoRA merges by dequantizing"):
        layer.merge()


def test_apply_lora_freezes_all_but_adapters_and_counts(q9):
    model = q9.Qwen3(q9.Qwen3Config.tiny())
    total0 = model.num_params()
    assert q9.apply_lora(model, 4, 8, ["q_proj", "v_proj"]) is model
    paths = sorted(q9.lora_layers(model))
    assert paths == sorted(f"model.layers.{i}.self_attn.{n}" for i in
                           range(model.cfg.num_hidden_layers) for n in ("q_proj", "v_proj"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{p}.lora_{ab}.weight" for p in paths for ab in "AB"}
    C, D = model.cfg.hidden_size, model.cfg.head_dim
    Hq, Hkv = model.cfg.num_attention_heads, model.cfg.num_key_value_heads
    per_block = 4 * (C + Hq * D) + 4 * (C + Hkv * D)  # r (K + N) for q_proj, then v_proj
    want = model.cfg.num_hidden_layers * per_block
    assert q9.trainable_parameters(model) == (want, total0 + want)
    n, t = want, total0 + want
    assert q9.trainable_summary(model) == f"trainable: {n:,} of {t / 1e6:.3g}M ({100 * n / t:.2f}%)"
    loss = model(torch.randint(0, model.cfg.vocab_size, (1, 7))).square().mean()
    loss.backward()  # every adapter gets a gradient (A's is zero while B = 0), nothing else
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())


def test_quantized_base_counts_as_its_weights(q9):
    model = q9.quantize_model(q9.Qwen3(q9.Qwen3Config.tiny()), "int8")
    dense = q9.Qwen3(q9.Qwen3Config.tiny()).num_params()
    q9.apply_lora(model, 2, 4, "all-linear")
    trainable, total = q9.trainable_parameters(model)
    assert total == dense + trainable  # a code counts as the weight it stands for
    assert len(q9.lora_layers(model)) == 7 * model.cfg.num_hidden_layers


def test_merge_lora_gives_a_plain_model_with_the_same_logits(q9, hf_dir):
    model = randomize_b(q9.apply_lora(q9.load_qwen3(hf_dir, "cpu", torch.float32), 8, 16,
                                      "all-linear"), q9)
    with torch.no_grad():
        before = model(IDS)
        q9.merge_lora(model)
        after = model(IDS)
    assert not q9.lora_layers(model)
    assert all(type(m) is nn.Linear for m in q9._block_linears(model).values())
    assert rel(after, before) < 1e-5
    base = q9.load_qwen3(hf_dir, "cpu", torch.float32)
    with torch.no_grad():
        assert rel(base(IDS), before) > 1e-3  # the adapters mattered


def test_bad_arguments(q9):
    model = q9.Qwen3(q9.Qwen3Config.tiny())
    C = model.cfg.hidden_size
    kv = model.cfg.num_key_value_heads * model.cfg.head_dim
    with pytest.raises(ValueError, match="rank 0 must be"):
        q9.apply_lora(model, 0, 8, ["q_proj"])
    width = min(C, kv)  # k_proj (kv, C)
    with pytest.raises(ValueError, match=rf"layers.0.self_attn.k_proj: LoRALinear: rank "
                                         rf"{width + 1} .* = {width}"):
        q9.apply_lora(model, width + 1, 8, ["k_proj"])
    q9.apply_lora(q9.Qwen3(model.cfg), width, 8, ["k_proj"])  # the width itself is allowed
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] are not among"):
        q9.apply_lora(model, 2, 8, ["q_proj", "qkv_proj"])
    with pytest.raises(ValueError, match="alpha"):
        q9.apply_lora(model, 2, 0, ["q_proj"])
    with pytest.raises(ValueError, match="dropout"):
        q9.apply_lora(model, 2, 2, ["q_proj"], dropout=1.0)
    assert not q9.lora_layers(model) and all(p.requires_grad for p in model.parameters())
    q9.apply_lora(model, 2, 2, ["q_proj"])
    with pytest.raises(ValueError, match="adapters already"):
        q9.apply_lora(model, 2, 2, ["v_proj"])


def test_save_load_round_trip_and_file_layout(q9, hf_dir, tmp_path):
    model = randomize_b(q9.apply_lora(q9.load_qwen3(hf_dir, "cpu", torch.float32), 4, 8,
                                      ["q_proj", "down_proj"], dropout=0.05), q9)
    q9.save_adapter(model, tmp_path, base_model_name_or_path=str(hf_dir))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout",
                                   "target_modules", "bias", "fan_in_fan_out")} == dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.05,
        target_modules=["down_proj", "q_proj"], bias="none", fan_in_fan_out=False)
    from safetensors.torch import load_file
    keys = set(load_file(tmp_path / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys and len(keys) == 8
    fresh = q9.load_adapter(q9.load_qwen3(hf_dir, "cpu", torch.float32), tmp_path)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(IDS), model.eval()(IDS))
    layer = fresh.get_submodule("model.layers.0.self_attn.q_proj")
    assert layer.r == 4 and layer.scale == 2 and layer.dropout.p == 0.05


def test_load_adapter_refuses_mismatches(q9, hf_dir, tmp_path):
    model = randomize_b(q9.apply_lora(q9.load_qwen3(hf_dir, "cpu", torch.float32), 4, 8,
                                      ["v_proj"]), q9)
    q9.save_adapter(model, tmp_path)
    cfg_path = tmp_path / "adapter_config.json"
    good = json.loads(cfg_path.read_text())

    def refused(match, target=None, **changes):
        cfg_path.write_text(json.dumps({**good, **changes}))
        target = target or q9.load_qwen3(hf_dir, "cpu", torch.float32)
        with pytest.raises(q9.DataError, match=match):
            q9.load_adapter(target, tmp_path)

    refused(r"v_proj.lora_A.weight is \(4, 64\), expected \(8, 64\) \(r = 8 in adapter_config", r=8)
    refused(r"does not match target_modules \['q_proj'\]", target_modules=["q_proj"])
    refused(r"adapter_config.json: target_modules: .*'qkv'", target_modules=["qkv"])
    refused(r"adapter_config.json: use_dora is True", use_dora=True)
    refused(r"adapter_config.json: r is 0", r=0)
    other = q9.apply_lora(q9.load_qwen3(hf_dir, "cpu", torch.float32), 2, 8, ["v_proj"])
    refused(r"r = 4, target_modules \['v_proj'\] do not match the model's adapters \(r = \[2\]",
            target=other)
    cfg_path.unlink()
    with pytest.raises(q9.DataError, match="adapter_config.json: no such file"):
        q9.load_adapter(model, tmp_path)


def test_peft_loads_the_stage_adapter(q9, hf_dir, tmp_path):
    """ORACLE: peft's PeftModel.from_pretrained reads save_adapter's folder onto transformers'
    Qwen3 and gives the stage's logits."""
    from peft import PeftModel
    model = randomize_b(q9.apply_lora(q9.load_qwen3(hf_dir, "cpu", torch.float32), 4, 8,
                                      ["q_proj", "v_proj", "o_proj", "up_proj"]), q9).eval()
    q9.save_adapter(model, tmp_path, base_model_name_or_path=str(hf_dir))
    peft_model = PeftModel.from_pretrained(hf_model(hf_dir), tmp_path).eval()
    with torch.no_grad():
        ours, theirs, base = model(IDS), peft_model(IDS).logits, hf_model(hf_dir)(IDS).logits
    assert rel(base, theirs) > 1e-3  # the adapter was applied by peft, and it matters
    assert rel(ours, theirs) < 1e-5


def test_stage_loads_a_peft_adapter(q9, hf_dir, tmp_path):
    """ORACLE, the other way: an adapter made and saved by peft (random B, all-linear) loads with
    load_adapter and gives peft's logits."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(5)
    peft_model = get_peft_model(hf_model(hf_dir), LoraConfig(
        r=4, lora_alpha=16, target_modules="all-linear", lora_dropout=0.1, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    peft_model.save_pretrained(tmp_path)
    model = q9.load_adapter(q9.load_qwen3(hf_dir, "cpu", torch.float32), tmp_path).eval()
    assert sorted({p.rpartition(".")[2] for p in q9.lora_layers(model)}) == sorted(LORA_TARGETS)
    with torch.no_grad():
        theirs = peft_model.eval()(IDS).logits
        ours = model(IDS)
        assert rel(ours, theirs) < 1e-5
        assert rel(q9.load_qwen3(hf_dir, "cpu", torch.float32)(IDS), theirs) > 1e-3


# ----------------------------------------------------------------------- chapter 22: QLoRA's NF4
# References: the published NF4 table, statistics.NormalDist (not torch), the test's own
# nearest-code search and dequantization, and bitsandbytes where its CPU path runs.

# bitsandbytes' NF4 table: bitsandbytes.functional.get_4bit_type("nf4") (0.50.2), the same
# constants as csrc/kernels.cu's dDequantizeNF4; the QLoRA paper's appendix E lists these values.
PUBLISHED = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
             -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
             0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
             0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def weights(shape, seed):
    """Normal weights whose rows differ in scale by up to 30x: block absmaxes far apart, so the
    double quantization's absolute error on small absmaxes shows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    return w * torch.logspace(-1.5, 0, shape[0])[:, None] if len(shape) == 2 else w


def unpack(packed):  # the test's own: byte j holds value 2j high, 2j + 1 low
    return torch.stack([packed.long() // 16, packed.long() % 16], dim=1).reshape(-1)


def test_code_book(q9):
    """NF4_CODE: the published table to 2e-7 (bitsandbytes built it in float32 from the rounded
    offset 0.9677083: its values differ from the float64 construction by up to 1.9e-7), and the
    paper's construction recomputed with statistics.NormalDist to float32 rounding; an exact 0 at
    index 7, exact ends -1 and 1, ascending."""
    code = q9.NF4_CODE
    assert code.dtype == torch.float32 and code.shape == (16,)
    assert (code.double() - torch.tensor(PUBLISHED, dtype=torch.float64)).abs().max() <= 2e-7
    delta = (1 / 30 + 1 / 32) / 2
    inv = statistics.NormalDist().inv_cdf
    upper = [inv(0.5 + (0.5 - delta) * i / 8) for i in range(1, 9)]
    lower = [-inv(0.5 + (0.5 - delta) * i / 7) for i in range(1, 8)]
    mine = [v / upper[-1] for v in lower[::-1] + [0.0] + upper]
    assert (code.double() - torch.tensor(mine, dtype=torch.float64)).abs().max() <= 6e-8
    assert code[7] == 0 and code[0] == -1 and code[15] == 1 and (code.diff() > 0).all()


def _reference(w, block, double_quant):
    """The test's own NF4: block absmax, nearest code by search over all 16, the absmaxes as
    22.2 stores them; returns (indices, c, c_hat, s2 of each block)."""
    code = torch.tensor(PUBLISHED, dtype=torch.float64)
    flat = w.reshape(-1).double()
    n, blocks = flat.numel(), math.ceil(flat.numel() / block)
    wb = torch.cat([flat, flat.new_zeros(blocks * block - n)]).view(blocks, block)
    c = wb.abs().amax(1)  # (blocks,)
    x = wb / torch.where(c > 0, c, 1)[:, None]
    idx = (x[..., None] - code).abs().argmin(-1).reshape(-1)
    if not double_quant:
        return idx, c, c, torch.zeros_like(c)
    m = c.mean()
    s2 = torch.zeros_like(c)
    for b0 in range(0, blocks, 256):
        s2[b0:b0 + 256] = (c[b0:b0 + 256] - m).abs().max() / 127 or 1.0  # all equal: 1
    c_hat = torch.round((c - m) / s2).clamp(-127, 127) * s2 + m
    return idx, c, c_hat, s2


@pytest.mark.parametrize("shape, double_quant", [((37, 203), True), ((37, 203), False),
                                                 ((640, 130), True), ((5,), True)])
def test_quantize_error_bound(q9, shape, double_quant):
    """Indices: the nearest code, in bitsandbytes' nibble order (the test's own search); every
    weight within c * (half the gap of its two neighbouring codes) + |code| * s2 / 2 (22.2's
    bound; s2 = 0 without double quantization), plus fp32 rounding; the bound reached (within
    0.9x of it somewhere): a looser code, a wrong gap or a lost absmax would show. (640, 130):
    1,300 blocks, six 256-blocks of absmaxes, the last one partial."""
    w = weights(shape, seed=sum(shape))
    t = q9.nf4_quantize(w, double_quant=double_quant)
    idx, c, c_hat, s2 = _reference(w, 64, double_quant)
    n = w.numel()
    assert torch.equal(unpack(t.packed)[:n], idx[:n])
    assert torch.allclose(t.block_absmax().double(), c_hat, rtol=1e-6, atol=0)
    w_hat = q9.nf4_dequantize(t)
    assert w_hat.shape == w.shape and w_hat.dtype == torch.float32
    code = torch.tensor(PUBLISHED, dtype=torch.float64)
    half_gap = torch.cat([code.diff(), code.new_zeros(1)]) / 2  # between code k and k + 1
    blk = torch.arange(n) // 64
    x = w.reshape(-1).double() / c[blk]
    k = torch.bucketize(x, code).clamp(1, 15) - 1  # x in [code[k], code[k + 1]]
    bound = c[blk] * half_gap[k] + code[idx[:n]].abs() * s2[blk] / 2
    err = (w_hat.reshape(-1).double() - w.reshape(-1).double()).abs()
    assert (err <= bound + 1e-6 * c[blk]).all()
    if n > 1000:
        assert (err / bound).max() > 0.9
    if double_quant and n > 1000:
        print(f"NF4 {shape}: max |w - w_hat| / c {(err / c[blk]).max():.4f}, absmax relative "
              f"error max {((c_hat - c).abs() / c).max():.2e}")


def test_nibble_order_worked_example(q9):
    """22.2's example: indices 3 and 12 first in a block make byte 0x3C (first value high)."""
    code = q9.NF4_CODE
    w = torch.zeros(64)
    w[0], w[1], w[2] = code[3], code[12], -1.0  # absmax 1: the codes themselves
    t = q9.nf4_quantize(w, double_quant=False)
    assert t.packed[0].item() == 0x3C and t.packed[1].item() == 0x07  # -1 then 0 (index 7)


def test_bits_per_weight(q9):
    """The stored bits a weight, counted from the container's tensors: 4 + 8 / 64 + 32 / 16,384
    + 32 / n = 4.127 with double quantization (the paper's figure), 4 + 32 / 64 = 4.5 without."""
    w = weights((256, 128), seed=3)  # n = 32,768: 512 blocks, two 256-blocks
    n = w.numel()
    bits = q9.nf4_quantize(w).bits_per_weight()
    assert bits == pytest.approx(4 + 8 / 64 + 32 / (64 * 256) + 32 / n, abs=1e-12)
    assert round(4 + 8 / 64 + 32 / (64 * 256), 3) == 4.127 and abs(bits - 4.127) < 0.002
    assert q9.nf4_quantize(w, double_quant=False).bits_per_weight() == pytest.approx(4.5)


@pytest.mark.parametrize("shape", [(1,), (3, 5), (37, 203), (64 * 300 + 7,)])
@pytest.mark.parametrize("double_quant", [True, False])
def test_triton_equals_torch(q9, shape, double_quant):
    """The kernel gives nf4_dequantize's values bit for bit, in fp32, bf16 (rounded to nearest
    even) and fp16, on sizes that are not multiples of 64, a zero block (absmax 0), and 19,207
    values (10 programs, 301 blocks: two 256-blocks of absmaxes)."""
    w = weights(shape, seed=7) * 4
    if w.numel() >= 128:
        w.view(-1)[64:128] = 0  # a whole block of zeros
    t = q9.nf4_quantize(w, double_quant=double_quant)
    expected = q9.nf4_dequantize(t)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = q9.nf4_dequantize_triton(t, dtype)
        assert got.dtype == dtype and got.shape == w.shape
        assert torch.equal(got, expected.to(dtype)), dtype


def test_triton_rejects(q9):
    t = q9.nf4_quantize(torch.randn(64))
    with pytest.raises(TypeError, match="NF4Tensor"):
        q9.nf4_dequantize_triton(t.packed)
    with pytest.raises(TypeError, match="absmax"):
        q9.nf4_dequantize_triton(q9.NF4Tensor(t.packed, t.absmax.float(), t.absmax_scale,
                                              t.absmax_mean, t.shape, t.dtype))
    with pytest.raises(ValueError, match="finite"):
        q9.nf4_quantize(torch.tensor([1.0, math.nan]))
    with pytest.raises(ValueError, match="block"):
        q9.nf4_quantize(torch.randn(64), block=63)


def test_nf4_model(q9):
    """quantize_model_nf4 on Qwen3Config.tiny(): every block linear an NF4Linear with no
    parameters (frozen), the embedding and lm_head untouched; the logits equal those of the float
    model with each weight replaced by the test's own dequantization (to 1e-5), stay within 10% of
    the float model's within 0.3 (measured 15%, as int4 in groups of 32 in 09's tests; random
    weights of std 0.02 are not what NF4 is tuned to, so this is a loose check),
    and the kernels (interpreter) give the torch path's logits."""
    model = q9.random_model(q9.Qwen3Config.tiny(), torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 8256, (2, 9), generator=torch.Generator().manual_seed(15))
    quantized = q9.quantize_model_nf4(copy.deepcopy(model))
    layers = {n: m for n, m in quantized.model.layers.named_modules()
              if isinstance(m, q9._QuantizedLinear)}
    assert len(layers) == 7 * 2 and all(type(m) is q9.NF4Linear for m in layers.values())
    assert not any(type(m) is nn.Linear for m in quantized.model.layers.modules())
    assert not any(p.numel() for m in layers.values() for p in m.parameters())
    assert torch.equal(quantized.lm_head.weight, model.lm_head.weight)
    reference = copy.deepcopy(model)
    for name, module in reference.model.layers.named_modules():
        if type(module) is nn.Linear:
            w = module.weight.detach()
            idx, c, c_hat, _ = _reference(w, 64, True)
            code = torch.tensor(PUBLISHED, dtype=torch.float64)
            w_hat = (code[idx].view(-1, 64) * c_hat[:, None]).reshape(w.shape)
            module.weight.data = w_hat.float()
    with torch.no_grad():
        out, expected, exact = quantized(ids), model(ids), reference(ids)
        assert rel(out, exact) < 1e-5
        err = rel(out, expected)
        print(f"NF4 logits vs float: relative error {err:.4f}")
        assert 1e-3 < err < 0.3
        quantized.use_kernels(True)
        assert all(m.kernels for m in layers.values())
        assert rel(quantized(ids), out) < 1e-5


def test_bitsandbytes(q9):
    """bitsandbytes' CPU path (functional.quantize_4bit, quant_type "nf4", blocksize 64): the
    same packed bytes (so the same nibble order and nearest codes), the same fp32 absmaxes, the
    same dequantized values to 3.2e-7 x absmax (its table's 1.9e-7, and fp32 rounding); with compress_statistics, the same
    mean subtracted (its offset), and both dequantizations within 1% (relative norm) of the
    fp32-absmax one (its 8-bit map, dynamic, is not ours, linear)."""
    try:
        bnbf = pytest.importorskip("bitsandbytes.functional")
        w = weights((37, 192), seed=11)
        packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                           compress_statistics=False)
        theirs = bnbf.dequantize_4bit(packed, state)
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"bitsandbytes' NF4 does not run on the CPU here: {err}")
    t = q9.nf4_quantize(w, double_quant=False)
    assert torch.equal(packed.reshape(-1), t.packed)
    assert torch.equal(state.absmax, t.absmax)
    blk = torch.arange(w.numel()) // 64  # per weight: the tables' 1.9e-7 and two roundings
    assert ((theirs - q9.nf4_dequantize(t)).abs().reshape(-1) <= 3.2e-7 * t.absmax[blk]).all()
    packed2, state2 = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                         compress_statistics=True)
    t2 = q9.nf4_quantize(w)
    assert torch.equal(packed2.reshape(-1), t2.packed)
    assert state2.offset.item() == pytest.approx(t2.absmax_mean.item(), rel=1e-6)
    ours, theirs2 = q9.nf4_dequantize(t2), bnbf.dequantize_4bit(packed2, state2)
    exact = q9.nf4_dequantize(t)  # the fp32 absmaxes: what only the 8-bit maps disturb
    print(f"double quant, relative error vs fp32 absmax: ours (linear int8) "
          f"{rel(ours, exact):.2e}, bitsandbytes (dynamic map) {rel(theirs2, exact):.2e}")
    assert 0 < rel(ours, exact) < 1e-2 and 0 < rel(theirs2, exact) < 1e-2
