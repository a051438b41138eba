"""Stage 01: the autograd engine against torch.autograd, the optimizers against torch.optim, the
toy training run, the roofline arithmetic, and the script end to end. All on the CPU, in seconds.

Engine and optimizer comparisons run in float64 on both sides, where the only difference is the
order of floating-point operations, so they hold to rtol 1e-10 / atol 1e-12.
"""
import re

import numpy as np
import pytest
import torch

from conftest import load_stage

m = load_stage("01_tensors")
Tensor = m.Tensor
RTOL, ATOL = 1e-10, 1e-12  # float64 vs float64


# -- broadcasting ------------------------------------------------------------------------------

@pytest.mark.parametrize("shapes", [
    [(3, 1), (1, 5)], [(4, 5), (5,)], [(2, 1, 4), (3, 1)], [(5,), ()], [(0, 3), (1, 3)],
    [(4, 1, 1), (1, 6, 1), (7,)],
])
def test_broadcast_shape_matches_torch(shapes):
    assert m.broadcast_shape(*shapes) == tuple(torch.broadcast_shapes(*shapes))


@pytest.mark.parametrize("shapes", [[(3,), (4,)], [(2, 3), (3, 2)], [(0,), (2,)]])
def test_broadcast_shape_rejects_what_torch_rejects(shapes):
    with pytest.raises(RuntimeError):
        torch.broadcast_shapes(*shapes)
    with pytest.raises(ValueError, match="cannot broadcast shapes"):
        m.broadcast_shape(*shapes)


# -- the autograd engine against torch.autograd ------------------------------------------------

def assert_matches_torch(fn, *shapes, seed=0):
    """Run `fn` on our Tensor and on torch from the same random float64 inputs; compare the output
    and, after backpropagating the same random upstream gradient, every input's gradient."""
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(shape) for shape in shapes]
    ours = [Tensor(a, requires_grad=True) for a in arrays]
    ref = [torch.tensor(a, requires_grad=True) for a in arrays]
    out, out_ref = fn(*ours), fn(*ref)
    np.testing.assert_allclose(out.data, out_ref.detach().numpy(), rtol=RTOL, atol=ATOL)
    upstream = rng.standard_normal(tuple(out_ref.shape))
    out.backward(upstream)
    out_ref.backward(torch.tensor(upstream))
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.grad.shape == shapes[i]
        np.testing.assert_allclose(a.grad, b.grad.numpy(), rtol=RTOL, atol=ATOL, err_msg=f"input {i}")


def test_relu_gradient_at_zero_is_torchs():
    """At exactly 0 relu has no derivative; torch (and so our engine) uses 0 there."""
    x = np.array([-1.0, 0.0, 0.0, 2.0])
    ours = Tensor(x, requires_grad=True)
    ours.relu().backward(np.ones(4))
    ref = torch.tensor(x, requires_grad=True)
    ref.relu().backward(torch.ones(4))
    np.testing.assert_array_equal(ours.grad, ref.grad.numpy())
    np.testing.assert_array_equal(ours.grad, [0.0, 0.0, 0.0, 1.0])


CASES = {
    "add (3,1)+(1,5)": (lambda a, b: a + b, (3, 1), (1, 5)),
    "mul (4,5)*(5,)": (lambda a, b: a * b, (4, 5), (5,)),
    "mul (2,1,4)*(3,1)": (lambda a, b: a * b, (2, 1, 4), (3, 1)),
    "scalar-shaped operand": (lambda a, b: a * b + b, (3, 4), ()),
    "sub div pow neg": (lambda a, b: (a - b) / (b * b + 1) - a ** 3 + (-b), (4, 5), (4, 1)),
    "numbers on the left": (lambda a: 1 + 2 - 3 / (a * a + 0.5) * 1.5 * a, (6, 7)),
    "matmul chain": (lambda a, b, c: a @ b @ c, (3, 4), (4, 5), (5, 2)),
    "matmul matrix @ vector": (lambda a, b: a @ b, (4, 5), (5,)),
    "matmul vector @ matrix": (lambda a, b: a @ b, (5,), (5, 3)),
    "matmul vector @ vector": (lambda a, b: a @ b, (5,), (5,)),
    "matmul batched @ matrix": (lambda a, b: a @ b, (2, 3, 4), (4, 5)),
    "matmul broadcast batches": (lambda a, b: a @ b, (2, 1, 3, 4), (3, 4, 2)),
    "matmul vector @ batched": (lambda a, b: a @ b, (4,), (3, 4, 2)),
    "sum all": (lambda a: a.sum(), (3, 4, 5)),
    "sum axis 0": (lambda a: a.sum(axis=0), (3, 4, 5)),
    "sum axes (0, 2)": (lambda a: a.sum(axis=(0, 2)), (3, 4, 5)),
    "sum axis -1 keepdim": (lambda a: a.sum(axis=-1, keepdim=True), (3, 4, 5)),
    "mean axis 1": (lambda a: a.mean(axis=1), (3, 4, 5)),
    "exp log tanh relu": (lambda a, b: ((a @ b).tanh().relu() + a.sum(axis=1, keepdim=True).exp()).log(),
                          (4, 3), (3, 6)),
    "one input used many times": (lambda a: a * a.tanh() + a.exp() * a - a.relu(), (5, 3)),
    "demo_expression": (m.demo_expression, (5, 4), (4, 3), (3,), (5, 1)),
}


@pytest.mark.parametrize("name", CASES)
def test_engine_matches_torch_autograd(name):
    fn, *shapes = CASES[name]
    for seed in range(3):
        assert_matches_torch(fn, *shapes, seed=seed)


def test_check_autograd_reports_agreement():
    assert m.check_autograd(seed=5) < 1e-12


def test_gradients_accumulate_across_backward_calls_like_torch():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4))
    ours, ref = Tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)
    for fn in (lambda x: (x * x).sum(), lambda x: x.tanh().sum()):
        fn(ours).backward()
        fn(ref).backward()
    np.testing.assert_allclose(ours.grad, ref.grad.numpy(), rtol=RTOL, atol=ATOL)


def test_numpy_array_on_the_left_uses_our_reflected_ops():
    # Without Tensor.__array_ufunc__ = None numpy would loop over the Tensor and build an object array.
    rng = np.random.default_rng(0)
    x, c = rng.standard_normal((6, 7)), rng.standard_normal(7)
    ours = Tensor(x, requires_grad=True)
    ref = torch.tensor(x, requires_grad=True)
    out = c * ours - c / (ours * ours + 1)
    assert isinstance(out, Tensor)
    out.sum().backward()
    (torch.tensor(c) * ref - torch.tensor(c) / (ref * ref + 1)).sum().backward()
    np.testing.assert_allclose(ours.grad, ref.grad.numpy(), rtol=RTOL, atol=ATOL)


def test_constants_get_no_gradient():
    w = Tensor(np.ones((2, 2)), requires_grad=True)
    c = Tensor(np.full((2, 2), 3.0))
    (w * c).sum().backward()
    assert c.grad is None
    np.testing.assert_array_equal(w.grad, np.full((2, 2), 3.0))


@pytest.mark.parametrize("scale", [30, 1000])  # 1000: exp() overflows float64 without the max shift
def test_cross_entropy_matches_torch(scale):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((7, 3)) * scale  # large logits: the max shift keeps exp() finite
    targets = rng.integers(0, 3, size=7)
    ours = Tensor(logits, requires_grad=True)
    ref = torch.tensor(logits, requires_grad=True)
    loss = m.cross_entropy(ours, targets)
    loss_ref = torch.nn.functional.cross_entropy(ref, torch.tensor(targets))
    loss.backward()
    loss_ref.backward()
    np.testing.assert_allclose(loss.data, loss_ref.item(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ours.grad, ref.grad.numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("call, error, message", [
    (lambda: Tensor(np.ones((3, 4))) @ Tensor(np.ones((5, 2))), ValueError, r"\(3, 4\) @ \(5, 2\)"),
    (lambda: Tensor(np.ones(3)) @ Tensor(2.0), ValueError, "at least 1-D"),
    (lambda: Tensor(np.ones((2, 3, 4))) @ Tensor(np.ones((5, 4, 2))), ValueError, "cannot broadcast"),
    (lambda: Tensor(np.ones(3)) + Tensor(np.ones(4)), ValueError, r"cannot broadcast shapes \(3,\), \(4,\)"),
    (lambda: Tensor(np.ones((2, 3))).sum(axis=2), ValueError, "out of range"),
    (lambda: Tensor(np.ones(3)) ** Tensor(2.0), TypeError, "Python number"),
    (lambda: Tensor("abc"), TypeError, "numbers"),
    (lambda: (Tensor(np.ones(3), requires_grad=True) * 2).backward(), ValueError, "one-element"),
    (lambda: (Tensor(np.ones(3), requires_grad=True) * 2).backward(np.ones(4)), ValueError, "shape"),
    (lambda: Tensor(1.0).backward(), RuntimeError, "requires_grad"),
])
def test_engine_bad_input_raises(call, error, message):
    with pytest.raises(error, match=message):
        call()


# -- optimizers against torch.optim ------------------------------------------------------------

def run_against_torch(ours_cls, torch_cls, kwargs, dtype=torch.float64, steps=7, seed=0):
    """Step ours and torch's optimizer on copies of the same parameters with the same gradients;
    the last parameter gets no gradient on odd steps (as when it is unused), which both skip.
    Returns the largest parameter difference seen over all steps."""
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(shape, generator=gen, dtype=dtype) for shape in ((3, 5), (7,), (2, 1, 3))]
    ours_params = [p.clone() for p in init]
    ref_params = [p.clone().requires_grad_() for p in init]
    ours, ref = ours_cls(ours_params, **kwargs), torch_cls(ref_params, **kwargs)
    worst = 0.0
    for step in range(steps):
        ours.zero_grad()
        ref.zero_grad()
        for i, (a, b) in enumerate(zip(ours_params, ref_params)):
            if i == len(init) - 1 and step % 2:
                continue
            a.grad = torch.randn(a.shape, generator=gen, dtype=dtype)
            b.grad = a.grad.clone()
        ours.step()
        ref.step()
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(ours_params, ref_params)))
    # The parameters moved, so the comparison compared something.
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(ours_params, init))
    return worst


SGD_SETTINGS = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, weight_decay=0.2),
    dict(lr=0.05, momentum=0.8, weight_decay=0.1, nesterov=True),
    dict(lr=0.3, weight_decay=0.5),
]
ADAMW_SETTINGS = [
    dict(lr=0.01),
    dict(lr=0.1, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.3),
    dict(lr=0.05, weight_decay=0.0),
]


@pytest.mark.parametrize("kwargs", SGD_SETTINGS, ids=str)
def test_sgd_matches_torch(kwargs):
    assert run_against_torch(m.SGD, torch.optim.SGD, kwargs) < 1e-12


@pytest.mark.parametrize("kwargs", ADAMW_SETTINGS, ids=str)
def test_adamw_matches_torch(kwargs):
    assert run_against_torch(m.AdamW, torch.optim.AdamW, kwargs, steps=10) < 1e-12


def test_adamw_matches_torch_in_float32():
    # float32: different operation order costs a few ulps per step of a number of size ~1.
    assert run_against_torch(m.AdamW, torch.optim.AdamW, ADAMW_SETTINGS[1], dtype=torch.float32) < 1e-5


@pytest.mark.parametrize("ours_cls, torch_cls, kwargs", [
    (m.SGD, torch.optim.SGD, SGD_SETTINGS[3]), (m.AdamW, torch.optim.AdamW, ADAMW_SETTINGS[1])])
def test_optimizer_drives_engine_tensors_like_torch(ours_cls, torch_cls, kwargs):
    """The same optimizer code updates this file's Tensor (numpy) exactly as torch.optim updates torch."""
    rng = np.random.default_rng(0)
    init = [rng.standard_normal((4, 3)), rng.standard_normal(5)]
    ours_params = [Tensor(a, requires_grad=True) for a in init]
    ref_params = [torch.tensor(a, requires_grad=True) for a in init]
    ours, ref = ours_cls(ours_params, **kwargs), torch_cls(ref_params, **kwargs)
    for _ in range(6):
        for a, b in zip(ours_params, ref_params):
            a.grad = rng.standard_normal(a.shape)
            b.grad = torch.tensor(a.grad)
        ours.step()
        ref.step()
    for a, b in zip(ours_params, ref_params):
        np.testing.assert_allclose(a.data, b.detach().numpy(), rtol=RTOL, atol=ATOL)
    ours.zero_grad()
    assert all(p.grad is None for p in ours_params)


@pytest.mark.parametrize("make, error", [
    (lambda p: m.SGD(p, lr=-0.1), ValueError),
    (lambda p: m.SGD(p, lr=0.1, momentum=-0.5), ValueError),
    (lambda p: m.SGD(p, lr=0.1, nesterov=True), ValueError),
    (lambda p: m.AdamW(p, betas=(0.9, 1.0)), ValueError),
    (lambda p: m.AdamW(p, eps=-1.0), ValueError),
    (lambda p: m.AdamW([]), ValueError),
    (lambda p: m.AdamW([np.ones(3)]), TypeError),
    (lambda p: m.SGD([torch.ones(3, dtype=torch.int64)]), TypeError),
])
def test_optimizer_bad_input_raises(make, error):
    with pytest.raises(error):
        make([torch.zeros(3, requires_grad=True)])


# -- training, roofline, the script ------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
def test_toy_training_learns_the_spirals(seed):
    losses, accuracy = m.train_toy(steps=300, seed=seed)
    assert losses[-1] < 0.1 * losses[0]  # the loss falls at least tenfold
    assert accuracy >= 0.95  # on held-out points; chance is 0.5


def test_cpu_peak_flops_arithmetic():
    cpuinfo = ("processor : 0\ncpu MHz : 2000.000\nflags : fpu avx avx2 fma\n\n"
               "processor : 1\ncpu MHz : 2500.000\nflags : fpu avx avx2 fma\n")
    peak, how = m.cpu_peak_flops(cpuinfo, threads=4)
    assert peak == pytest.approx(4 * 2.5e9 * 32) and "AVX2" in how
    peak, _ = m.cpu_peak_flops(cpuinfo.replace("avx2", "avx2 avx512f"), threads=1)
    assert peak == pytest.approx(2.5e9 * 64)
    peak, how = m.cpu_peak_flops("", threads=2)
    assert peak == pytest.approx(2 * 3.0e9 * 16) and "assumed" in how


def test_flops_per_cycle_needs_fma_for_avx2():
    """Two FLOPs a lane per cycle need fused multiply-add: AVX2 without FMA is not 32."""
    assert m.flops_per_cycle(["avx", "avx2", "fma"])[0] == 2 * 8 * 2  # units x lanes x FLOPs
    assert m.flops_per_cycle(["avx", "avx2"])[0] == 16
    assert m.flops_per_cycle(["avx512f", "fma"])[0] == 2 * 16 * 2


def test_roofline_counts_flops_and_bytes(monkeypatch, capsys):
    """The roofline's arithmetic against the test's own: with every timing fixed at 0.25 s, an
    n x n matmul runs 2 n^3 / 0.25 FLOP/s, a copy of B bytes moves 2 B / 0.25 bytes/s, and the
    roof is min(peak, n / 6 FLOP per byte x bandwidth)."""
    monkeypatch.setattr(m, "_median_seconds", lambda fn, warmup, repeats: 0.25)
    monkeypatch.setattr(m, "cpu_peak_flops", lambda: (1e12, "test peak"))
    assert m.measure_matmul_flops(96) == 2 * 96**3 / 0.25
    assert m.measure_copy_bandwidth(nbytes=1 << 20) == 2 * (1 << 20) / 0.25
    m.roofline([600])
    out = capsys.readouterr().out
    bandwidth = 2 * 256 * 2**20 / 0.25
    roof = min(1e12, 600 / 6 * bandwidth)
    flops = 2 * 600**3 / 0.25
    assert f"measured copy bandwidth: {bandwidth / 1e9:.1f} GB/s" in out
    row = re.search(r"^ +600 +(\S+) +(\S+) +(\S+) +(\S+) +(\S+)%$", out, re.MULTILINE).groups()
    assert [float(v) for v in row] == pytest.approx(
        [100.0, round(roof / 1e9), 250.0, round(flops / 1e9, 1), round(100 * flops / roof, 1)])


def test_measured_matmul_flops_is_plausible():
    peak, _ = m.cpu_peak_flops()
    flops = m.measure_matmul_flops(192, repeats=3)
    assert 1e7 < flops < 4 * peak  # at most a few times the nominal-clock peak (turbo), never more


def test_main_runs_end_to_end(capsys):
    m.main(["--steps", "30", "--sizes", "64", "--seed", "2"])
    out = capsys.readouterr().out
    for heading in ("1. Tensors", "2. Autograd", "3. SGD and AdamW", "4. Training", "5. The first roofline"):
        assert heading in out
    assert "held-out" in out and "GFLOP/s" in out


def test_main_rejects_bad_flags():
    with pytest.raises(SystemExit):
        m.main(["--steps", "0"])
