"""Stage 01: tensors, autograd from scratch, optimizers by hand, and the first roofline.

Book chapters 1-3. The first stage of ten; everything later is built on what it shows:

  1. Tensors (chapter 2): shapes, the broadcasting rule, views and strides (a transpose is a view,
     `.contiguous()` copies), dtypes and the bytes they cost, devices.
  2. A reverse-mode autograd engine written from scratch (chapter 3): `Tensor`, a float64 numpy
     array with a `.grad`, that records each operation and runs the chain rule backwards in
     topological order. It is checked against torch.autograd on a small expression.
  3. Optimizers by hand (chapter 3): `SGD` (momentum, Nesterov, weight decay) and `AdamW`
     (decoupled weight decay, bias correction), checked step for step against torch.optim.
  4. A training loop (chapter 3): an `MLP` on the engine, trained with the hand-written AdamW on
     two interleaved spirals; the loss falls and the accuracy is printed.
  5. The first roofline (chapters 1-2): CPU matmul FLOP/s measured with torch and compared with
     this machine's rough peak (cores x clock x FLOPs per cycle) and its copy bandwidth.

Run:   python 01_tensors.py [--seed 0] [--steps 300] [--sizes 256 512 1024 2048]
Prints each section in turn: the tensor facts, the engine's largest gradient difference from
torch, the optimizers' largest difference from torch.optim, the training loss every few steps
with the final accuracy, and a table of matmul GFLOP/s with the fraction of peak. CPU only,
except the device part of section 1, which uses CUDA when it is present.
"""
import argparse
import os
import platform
import statistics
import time

import numpy as np
import torch


def banner(title):
    print(f"\n{'=' * 100}\n{title}\n{'=' * 100}")


# ------------------------------------------------------------------------------------------------
# Chapter 2: tensors -- shapes, broadcasting, views and strides, dtypes and memory, devices
# ------------------------------------------------------------------------------------------------

def broadcast_shape(*shapes):
    """The shape that `shapes` broadcast to, or a ValueError naming them.

    The rule: line the shapes up on the right; a missing leading dimension counts as 1; at each
    position the sizes must be equal or 1, and a size-1 dimension is stretched to match.
    """
    ndim = max(len(s) for s in shapes)
    result = []
    for i in range(1, ndim + 1):  # from the rightmost dimension leftwards
        sizes = {s[-i] for s in shapes if len(s) >= i} - {1}
        if len(sizes) > 1:
            raise ValueError(f"cannot broadcast shapes {', '.join(str(tuple(s)) for s in shapes)}: "
                             f"sizes {sorted(sizes)} meet at dimension -{i}")
        result.append(sizes.pop() if sizes else 1)
    return tuple(reversed(result))


def tour_tensors():
    """Print the facts about tensors that every later stage relies on."""
    print("-- shapes --")
    B, T, C = 2, 3, 4  # batch, tokens, channels: the legend every later stage uses
    x = torch.arange(B * T * C, dtype=torch.float32).reshape(B, T, C)  # (B, T, C)
    print(f"x = arange(24).reshape(B, T, C): shape {tuple(x.shape)}, ndim {x.ndim}, numel {x.numel()}")
    print(f"x.reshape(B * T, C): {tuple(x.reshape(B * T, C).shape)}   "
          f"x.permute(0, 2, 1): {tuple(x.permute(0, 2, 1).shape)}   "
          f"x[:, -1]: {tuple(x[:, -1].shape)}   x.unsqueeze(1): {tuple(x.unsqueeze(1).shape)}")

    print("\n-- broadcasting --")
    print("rule: align shapes on the right; each pair of sizes must be equal or one of them 1 "
          "(missing = 1);\n      the 1 is stretched, without copying, to the other size")
    col = torch.arange(3.0).reshape(3, 1)  # (3, 1)
    row = torch.arange(4.0).reshape(1, 4)  # (1, 4)
    print(f"(3, 1) + (1, 4) -> {tuple((col + row).shape)} (ours: {broadcast_shape((3, 1), (1, 4))}):\n"
          f"{col + row}")
    bias = torch.ones(C)  # (C,)
    print(f"(B, T, C) + (C,) -> {tuple((x + bias).shape)}: one bias per channel, shared by every token")
    try:
        torch.ones(3) + torch.ones(4)
    except RuntimeError as e:
        print(f"(3,) + (4,) fails: torch says \"{e}\"")
    try:
        broadcast_shape((3,), (4,))
    except ValueError as e:
        print(f"                 ours says \"{e}\"")

    print("\n-- views and strides --")
    m = torch.arange(12.0).reshape(3, 4)  # (3, 4)
    mt = m.t()  # (4, 3)
    print(f"m = arange(12).reshape(3, 4): stride {m.stride()} (4 elements to the next row, 1 to the "
          f"next column), data_ptr {m.data_ptr():#x}")
    print(f"m.t(): shape {tuple(mt.shape)}, stride {mt.stride()}, data_ptr {mt.data_ptr():#x}: "
          f"same memory, strides swapped, contiguous={mt.is_contiguous()}")
    mt[0, 1] = 100.0
    print(f"writing m.t()[0, 1] = 100 changes m[1, 0] too: m[1, 0] = {m[1, 0].item():.0f}")
    col1 = m[:, 1]
    print(f"m[:, 1]: stride {col1.stride()}, storage_offset {col1.storage_offset()}: "
          "a slice is a view as well")
    mc = mt.contiguous()
    print(f"m.t().contiguous(): stride {mc.stride()}, data_ptr {mc.data_ptr():#x}: a copy in the new "
          f"order (new memory: {mc.data_ptr() != m.data_ptr()})")
    try:
        mt.view(12)
    except RuntimeError:
        print("m.t().view(12) raises: a view cannot reorder memory. m.t().reshape(12) works because "
              "reshape copies when it must")

    print("\n-- dtypes and memory --")
    print(f"{'dtype':<16}{'bytes':>6}{'eps':>12}{'max':>12}   1/3 stored as")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        info = torch.finfo(dtype)
        third = torch.tensor(1 / 3, dtype=dtype).item()
        print(f"{str(dtype):<16}{info.bits // 8:>6}{info.eps:>12.3g}{info.max:>12.3g}   {third:.10f}")
    info = torch.iinfo(torch.int8)
    print(f"{str(torch.int8):<16}{info.bits // 8:>6}{'-':>12}{info.max:>12}   "
          f"(integers {info.min}..{info.max})")
    w = torch.empty(1024, 1024, dtype=torch.bfloat16)
    print(f"a 1024 x 1024 bf16 tensor: element_size {w.element_size()} B, nbytes {w.nbytes / 2**20:.0f} MiB")
    n_params = 124_000_000  # GPT-2 small, built in stage 02
    print("GPT-2 small's 124M weights take " + ", ".join(
        f"{name} {n_params * torch.empty(0, dtype=d).element_size() / 1e6:.0f} MB"
        for name, d in (("float32", torch.float32), ("bf16", torch.bfloat16), ("int8", torch.int8))))

    print("\n-- devices --")
    a = torch.randn(256, 256)
    print(f"torch.randn(256, 256) lives on {a.device}")
    if not torch.cuda.is_available():
        print("CUDA: not available on this machine, so the GPU part is skipped (stages 04-06 need one)")
        return
    a_gpu = a.to("cuda")
    # The GPU runs kernels asynchronously; .cpu() waits for the matmul before copying back.
    diff = (a_gpu @ a_gpu).cpu().sub(a @ a).abs().max().item()
    print(f"CUDA: {torch.cuda.get_device_name()}; a.to('cuda') lives on {a_gpu.device}; "
          f"(a @ a) there matches the CPU to {diff:.1e} (float32, different summation order)")
    print(f"memory allocated on the GPU by this process: {torch.cuda.memory_allocated() / 2**10:.0f} KiB")


# ------------------------------------------------------------------------------------------------
# Chapter 3: a reverse-mode autograd engine, from scratch
# ------------------------------------------------------------------------------------------------

def _unbroadcast(grad, shape):
    """Sum `grad` down to `shape`: a value that was broadcast to many places gets the sum of their
    gradients (each place it was copied to contributed to the output)."""
    grad = grad.sum(axis=tuple(range(grad.ndim - len(shape))))  # leading dims that broadcasting added
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=stretched, keepdims=True)


def _lift(value):
    """Numbers and arrays in an expression become constant Tensors (no gradient)."""
    return value if isinstance(value, Tensor) else Tensor(value)


class Tensor:
    """A float64 numpy array that remembers the operation that made it, so gradients can flow back.

    Each operation returns a new Tensor holding its parents and a `_backward` function that maps
    the gradient of the output to the gradients of the parents (the local step of the chain rule,
    in the output's broadcast shape; `backward()` sums them back to each parent's shape).
    `backward()` visits the graph outputs-first, so a node's gradient is complete before it is
    passed on, and leaves that have `requires_grad=True` accumulate theirs in `.grad`, as torch does.
    The method names match torch's, so one expression runs on both (see `demo_expression`).
    """

    # Makes `numpy_array * tensor` call our __rmul__ instead of numpy looping over the Tensor.
    __array_ufunc__ = None

    def __init__(self, data, requires_grad=False, _parents=(), _backward=None):
        try:
            self.data = np.array(data, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"Tensor data must be numbers, got {type(data).__name__}: {e}") from None
        self.requires_grad = requires_grad
        self.grad = None
        self._parents = _parents
        self._backward = _backward

    @property
    def shape(self):
        return self.data.shape

    def __repr__(self):
        return f"Tensor({self.data}, requires_grad={self.requires_grad})"

    @staticmethod
    def _result(data, parents, backward):
        """A new node; it joins the graph only if some parent needs a gradient."""
        if any(p.requires_grad for p in parents):
            return Tensor(data, requires_grad=True, _parents=parents, _backward=backward)
        return Tensor(data)

    # -- elementwise arithmetic (broadcasting) --

    def __add__(self, other):
        other = _lift(other)
        broadcast_shape(self.shape, other.shape)
        return self._result(self.data + other.data, (self, other), lambda g: (g, g))

    def __mul__(self, other):
        other = _lift(other)
        broadcast_shape(self.shape, other.shape)
        a, b = self.data, other.data
        return self._result(a * b, (self, other), lambda g: (g * b, g * a))

    def __pow__(self, exponent):
        if not isinstance(exponent, (int, float)):
            raise TypeError(f"Tensor ** exponent needs a Python number, got {type(exponent).__name__}")
        x = self.data
        return self._result(x ** exponent, (self,), lambda g: (g * exponent * x ** (exponent - 1),))

    def __neg__(self):
        return self * -1.0

    def __sub__(self, other):
        return self + -_lift(other)

    def __truediv__(self, other):
        return self * _lift(other) ** -1

    def __radd__(self, other):
        return self + other

    def __rmul__(self, other):
        return self * other

    def __rsub__(self, other):
        return _lift(other) - self

    def __rtruediv__(self, other):
        return _lift(other) / self

    # -- matrix multiply --

    def __matmul__(self, other):
        other = _lift(other)
        a, b = self.data, other.data  # (..., M, K) @ (..., K, N); a 1-D side is a vector
        if a.ndim == 0 or b.ndim == 0:
            raise ValueError(f"matmul needs at least 1-D operands, got shapes {a.shape} @ {b.shape}")
        k_b = b.shape[0] if b.ndim == 1 else b.shape[-2]
        if a.shape[-1] != k_b:
            raise ValueError(f"matmul shape mismatch: {a.shape} @ {b.shape} "
                             f"(inner dimensions {a.shape[-1]} and {k_b} differ)")
        broadcast_shape(a.shape[:-2], b.shape[:-2])  # batch dimensions

        def backward(g):
            # Treat a vector as a one-row (left) or one-column (right) matrix, so one rule serves:
            # dA = dC @ B^T, dB = A^T @ dC.
            if b.ndim == 1:
                g = g[..., None]  # (..., M, 1)
            if a.ndim == 1:
                g = g[..., None, :]  # (..., 1, N)
            a2 = a[None, :] if a.ndim == 1 else a  # (..., M, K)
            b2 = b[:, None] if b.ndim == 1 else b  # (..., K, N)
            ga = g @ np.swapaxes(b2, -1, -2)  # (..., M, K)
            gb = np.swapaxes(a2, -1, -2) @ g  # (..., K, N)
            return (ga[..., 0, :] if a.ndim == 1 else ga), (gb[..., 0] if b.ndim == 1 else gb)

        return self._result(a @ b, (self, other), backward)

    # -- reductions --

    def sum(self, axis=None, keepdim=False):
        x = self.data
        axes = tuple(range(x.ndim)) if axis is None else (axis,) if isinstance(axis, int) else tuple(axis)
        if any(not -x.ndim <= ax < x.ndim for ax in axes):
            raise ValueError(f"sum axis {axis} is out of range for shape {x.shape}")
        axes = tuple(ax % x.ndim for ax in axes)

        def backward(g):
            # Every summed element got the same gradient: put the reduced axes back and stretch.
            g = g if keepdim else np.expand_dims(g, axes)
            return (np.broadcast_to(g, x.shape),)

        return self._result(x.sum(axis=axes, keepdims=keepdim), (self,), backward)

    def mean(self, axis=None, keepdim=False):
        total = self.sum(axis, keepdim)
        return total / (self.data.size / total.data.size)  # divide by how many were summed

    # -- elementwise functions --

    def exp(self):
        out = np.exp(self.data)
        return self._result(out, (self,), lambda g: (g * out,))

    def log(self):
        x = self.data
        return self._result(np.log(x), (self,), lambda g: (g / x,))

    def tanh(self):
        out = np.tanh(self.data)
        return self._result(out, (self,), lambda g: (g * (1.0 - out * out),))

    def relu(self):
        x = self.data
        return self._result(np.maximum(x, 0.0), (self,), lambda g: (g * (x > 0),))

    # -- the backward pass --

    def _topological_order(self):
        """Every node of the graph that needs a gradient, each one before all of its parents."""
        order, seen = [], set()
        stack = [(self, False)]
        while stack:  # an explicit stack rather than recursion, so deep graphs cannot overflow it
            node, parents_done = stack.pop()
            if parents_done:
                order.append(node)  # post-order: after all of its parents
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            stack.extend((p, False) for p in node._parents if p.requires_grad)
        return order[::-1]

    def backward(self, grad=None):
        """Accumulate d(self)/d(leaf) into `.grad` of every leaf with `requires_grad=True`.

        `grad` is the gradient of some final scalar with respect to `self`; it may be left out
        only when `self` has one element (then it is 1).
        """
        if not self.requires_grad:
            raise RuntimeError("backward() on a Tensor that does not require grad: "
                               "no leaf of its graph was made with requires_grad=True")
        if grad is None:
            if self.data.size != 1:
                raise ValueError(f"backward() without a gradient needs a one-element output, "
                                 f"got shape {self.shape}")
            grad = np.ones_like(self.data)
        grad = np.asarray(grad, dtype=np.float64)
        if grad.shape != self.shape:
            raise ValueError(f"backward() gradient has shape {grad.shape}, output has {self.shape}")

        grads = {id(self): grad}  # gradients gathered so far, by node
        for node in self._topological_order():
            g = grads.pop(id(node))
            if not node._parents:  # a leaf keeps its gradient, adding to earlier backward() calls
                node.grad = g.copy() if node.grad is None else node.grad + g
                continue
            for parent, parent_grad in zip(node._parents, node._backward(g)):
                if parent.requires_grad:
                    parent_grad = _unbroadcast(parent_grad, parent.shape)
                    earlier = grads.get(id(parent))  # a parent used twice gets the sum of both paths
                    grads[id(parent)] = parent_grad if earlier is None else earlier + parent_grad


def demo_expression(x, w, b, c):
    """A small expression using every op; it runs unchanged on `Tensor` and on torch tensors."""
    h = (x @ w + b).tanh()  # (N, K) @ (K, M) + (M,) -> (N, M)
    z = (h * c).relu() + (h - c).exp() / 2 - 0.5 * h ** 2  # c (N, 1) broadcasts over columns
    return (z.sum(axis=1, keepdim=True) + 1).log().mean()


def check_autograd(seed=0):
    """Run `demo_expression` on both engines (float64) and return the largest gradient difference."""
    rng = np.random.default_rng(seed)
    shapes = {"x": (5, 4), "w": (4, 3), "b": (3,), "c": (5, 1)}
    arrays = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    ours = {name: Tensor(a, requires_grad=True) for name, a in arrays.items()}
    theirs = {name: torch.tensor(a, requires_grad=True) for name, a in arrays.items()}
    loss_ours, loss_theirs = demo_expression(**ours), demo_expression(**theirs)
    loss_ours.backward()
    loss_theirs.backward()
    print(f"loss: ours {loss_ours.data.item():.12f}  torch {loss_theirs.item():.12f}")
    worst = abs(loss_ours.data.item() - loss_theirs.item())
    for name in arrays:
        diff = np.abs(ours[name].grad - theirs[name].grad.numpy()).max()
        print(f"d loss / d {name} {str(shapes[name]):<8} max |ours - torch| = {diff:.1e}")
        worst = max(worst, diff)
    return worst


# ------------------------------------------------------------------------------------------------
# Chapter 3: optimizers by hand
# ------------------------------------------------------------------------------------------------

class Optimizer:
    """What SGD and AdamW share: a list of parameters and a `zero_grad`.

    A parameter is anything with `.data` and `.grad`: a torch tensor or this file's `Tensor`.
    The update only reads `.grad` and writes `.data` in place, so the same code serves both
    engines. Parameters whose `.grad` is None are skipped, as torch.optim skips them.
    """

    def __init__(self, params, lr):
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        for p in self.params:
            if not isinstance(p, (torch.Tensor, Tensor)):
                raise TypeError(f"parameters must be torch tensors or Tensor, got {type(p).__name__}")
            if isinstance(p, torch.Tensor) and not p.is_floating_point():
                raise TypeError(f"parameters must be floating point, got {p.dtype}")
        if lr < 0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        self.lr = lr
        self.state = [{} for _ in self.params]  # per parameter, created on its first step

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class SGD(Optimizer):
    """Stochastic gradient descent, as torch.optim.SGD computes it (without dampening).

    g = grad + weight_decay * p              (L2 weight decay, folded into the gradient)
    v = g on the first step, else momentum * v + g
    p -= lr * (g + momentum * v if nesterov else v)
    """

    def __init__(self, params, lr=1e-3, momentum=0.0, weight_decay=0.0, nesterov=False):
        super().__init__(params, lr)
        if momentum < 0 or weight_decay < 0:
            raise ValueError(f"momentum and weight_decay must be >= 0, got {momentum}, {weight_decay}")
        if nesterov and momentum == 0:
            raise ValueError("nesterov momentum needs momentum > 0")
        self.momentum, self.weight_decay, self.nesterov = momentum, weight_decay, nesterov

    def step(self):
        for p, state in zip(self.params, self.state):
            if p.grad is None:
                continue
            g = p.grad + self.weight_decay * p.data
            if self.momentum:
                v = g if "velocity" not in state else self.momentum * state["velocity"] + g
                state["velocity"] = v
                g = g + self.momentum * v if self.nesterov else v
            p.data -= self.lr * g


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov and Hutter), as torch.optim.AdamW computes it.

    p *= 1 - lr * weight_decay               (decay the weight itself, not through the gradient)
    m = beta1 * m + (1 - beta1) * g          (running mean of gradients)
    v = beta2 * v + (1 - beta2) * g^2        (running mean of squared gradients)
    p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    m and v start at zero, so early on they underestimate; dividing by (1 - beta^t) corrects that.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, lr)
        if not all(0.0 <= beta < 1.0 for beta in betas) or len(betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay

    def step(self):
        beta1, beta2 = self.betas
        for p, state in zip(self.params, self.state):
            if p.grad is None:
                continue
            g = p.grad
            t = state["step"] = state.get("step", 0) + 1
            m = state["m"] = beta1 * state.get("m", 0.0) + (1 - beta1) * g
            v = state["v"] = beta2 * state.get("v", 0.0) + (1 - beta2) * g * g
            p.data *= 1 - self.lr * self.weight_decay
            denom = v ** 0.5 / (1 - beta2 ** t) ** 0.5 + self.eps
            p.data -= self.lr / (1 - beta1 ** t) * m / denom


def check_optimizers(steps=8, seed=0):
    """Drive ours and torch.optim with the same gradients; return the largest parameter difference."""
    configs = [
        ("SGD", SGD, torch.optim.SGD, dict(lr=0.1)),
        ("SGD momentum", SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
        ("SGD nesterov + wd", SGD, torch.optim.SGD,
         dict(lr=0.1, momentum=0.9, weight_decay=0.1, nesterov=True)),
        ("AdamW", AdamW, torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1)),
    ]
    worst = 0.0
    for name, ours_cls, torch_cls, kwargs in configs:
        gen = torch.Generator().manual_seed(seed)
        init = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((3, 5), (7,))]
        ours_params = [p.clone() for p in init]
        torch_params = [p.clone().requires_grad_() for p in init]
        ours, ref = ours_cls(ours_params, **kwargs), torch_cls(torch_params, **kwargs)
        diff = 0.0
        for _ in range(steps):
            for a, b in zip(ours_params, torch_params):
                a.grad = torch.randn(a.shape, generator=gen, dtype=torch.float64)
                b.grad = a.grad.clone()
            ours.step()
            ref.step()
            diff = max(diff, max((a - b).abs().max().item() for a, b in zip(ours_params, torch_params)))
        settings = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        print(f"{name:<18} ({settings}): {steps} steps, max |ours - torch.optim| = {diff:.1e}")
        worst = max(worst, diff)
    return worst


# ------------------------------------------------------------------------------------------------
# Chapter 3: a small network and its training loop
# ------------------------------------------------------------------------------------------------

def make_spirals(n_per_class=200, noise=0.15, seed=0):
    """Two interleaved spirals in the plane: inputs (N, 2) and labels (N,) in {0, 1}."""
    rng = np.random.default_rng(seed)
    t = np.sqrt(rng.uniform(0.05, 1.0, n_per_class)) * 3 * np.pi  # angle; sqrt spreads points evenly
    arm = np.stack([t * np.cos(t), t * np.sin(t)], axis=1) / (3 * np.pi)  # (n, 2), radius <= 1
    x = np.concatenate([arm, -arm]) + noise * rng.standard_normal((2 * n_per_class, 2)) / 3
    y = np.concatenate([np.zeros(n_per_class, dtype=np.int64), np.ones(n_per_class, dtype=np.int64)])
    return x, y


class MLP:
    """Fully connected layers with tanh between them, on this file's `Tensor`.

    sizes=(2, 32, 32, 2) maps 2 inputs through two hidden layers of 32 to 2 logits. Weights start
    at normal(0, 1/fan_in), so each layer keeps its inputs' scale; biases start at zero.
    """

    def __init__(self, sizes, seed=0):
        rng = np.random.default_rng(seed)
        self.layers = [(Tensor(rng.standard_normal((n_in, n_out)) / np.sqrt(n_in), requires_grad=True),
                        Tensor(np.zeros(n_out), requires_grad=True))
                       for n_in, n_out in zip(sizes[:-1], sizes[1:])]

    def __call__(self, x):
        for i, (w, b) in enumerate(self.layers):
            x = x @ w + b  # (N, n_in) @ (n_in, n_out) + (n_out,) -> (N, n_out)
            if i < len(self.layers) - 1:
                x = x.tanh()
        return x  # (N, classes) logits

    def parameters(self):
        return [p for layer in self.layers for p in layer]


def cross_entropy(logits, targets):
    """Mean negative log-probability of integer `targets` (N,) under softmax(`logits` (N, K))."""
    n, k = logits.shape
    # Softmax is unchanged by shifting a row; subtracting the row max (a constant, no gradient)
    # keeps exp() from overflowing.
    shifted = logits - logits.data.max(axis=1, keepdims=True)  # (N, K)
    log_probs = shifted - shifted.exp().sum(axis=1, keepdim=True).log()  # (N, K)
    one_hot = np.eye(k)[targets]  # (N, K), picks each row's target column
    return -(log_probs * one_hot).sum() / n


def train_toy(steps=300, lr=0.02, seed=0, log_every=0):
    """Train an MLP with our AdamW on two spirals; return (losses per step, held-out accuracy)."""
    x, y = make_spirals(seed=seed)
    x_test, y_test = make_spirals(seed=seed + 1)  # fresh points from the same spirals
    model = MLP((2, 32, 32, 2), seed=seed)
    opt = AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    inputs = Tensor(x)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        loss = cross_entropy(model(inputs), y)  # full batch: N = 400 points
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.data.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - start
    train_accuracy = (model(inputs).data.argmax(axis=1) == y).mean()
    accuracy = (model(Tensor(x_test)).data.argmax(axis=1) == y_test).mean()
    if log_every:
        print(f"{steps} steps in {seconds:.2f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}; accuracy "
              f"{train_accuracy:.1%} on the training points, {accuracy:.1%} on {len(y_test)} held-out ones")
    return losses, accuracy


# ------------------------------------------------------------------------------------------------
# Chapters 1-2: the first roofline -- how fast can this machine multiply, and how fast can it move?
# ------------------------------------------------------------------------------------------------

def flops_per_cycle(cpu_flags):
    """fp32 FLOPs one core can start per cycle, from its vector instruction set, with a reason."""
    if "avx512f" in cpu_flags:
        return 64, "AVX-512: 2 FMA units x 16 fp32 lanes x 2 FLOPs (multiply + add)"
    if "avx2" in cpu_flags and "fma" in cpu_flags:
        return 32, "AVX2 + FMA: 2 FMA units x 8 fp32 lanes x 2 FLOPs"
    return 16, "no AVX2/AVX-512 flags seen (e.g. ARM NEON): assume 2 FMA units x 4 lanes x 2 FLOPs"


def cpu_peak_flops(cpuinfo=None, threads=None):
    """A rough fp32 peak: threads x clock x FLOPs per cycle. Returns (FLOP/s, explanation).

    `cpuinfo` is the text of /proc/cpuinfo (read when None); the clock is its highest "cpu MHz",
    the current clock, which turbo may exceed and heavy AVX-512 work may fall below.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    threads = threads or torch.get_num_threads()
    mhz = [float(line.split(":")[1]) for line in cpuinfo.splitlines() if line.startswith("cpu MHz")]
    flags = next((line.split(":")[1].split() for line in cpuinfo.splitlines()
                  if line.startswith(("flags", "Features"))), [])
    ghz, clock_note = (max(mhz) / 1e3, "from /proc/cpuinfo") if mhz else (3.0, "assumed, no /proc/cpuinfo")
    per_cycle, isa_note = flops_per_cycle(flags)
    peak = threads * ghz * 1e9 * per_cycle
    return peak, (f"{threads} threads x {ghz:.2f} GHz ({clock_note}) x {per_cycle} FLOP/cycle "
                  f"({isa_note}) = {peak / 1e9:.0f} GFLOP/s")


def _median_seconds(fn, warmup, repeats):
    """Median wall time of `fn()`; the warm-up runs absorb one-off costs (allocation, thread start)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_matmul_flops(n, dtype=torch.float32, warmup=2, repeats=5):
    """FLOP/s of an (n, n) @ (n, n) torch matmul on the CPU: 2 n^3 FLOPs (a multiply and an add per term)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)  # written in place each time, so no allocation is timed
    seconds = _median_seconds(lambda: torch.matmul(a, b, out=out), warmup, repeats)
    return 2 * n ** 3 / seconds


def measure_copy_bandwidth(nbytes=256 * 2**20, warmup=1, repeats=5):
    """Bytes/s of copying one large buffer into another: each byte is read once and written once."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), warmup, repeats)


def roofline(sizes):
    """Print measured matmul FLOP/s against the peak and against what bandwidth alone allows."""
    peak, how = cpu_peak_flops()
    bandwidth = measure_copy_bandwidth()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs; "
          f"torch uses {torch.get_num_threads()} threads")
    print(f"rough peak: {how}")
    print(f"measured copy bandwidth: {bandwidth / 1e9:.1f} GB/s (256 MiB buffer, read + write)")
    print(f"ridge point: peak / bandwidth = {peak / bandwidth:.0f} FLOP/byte; a kernel doing fewer FLOPs "
          "per byte moved is bandwidth-bound")
    # An n x n float32 matmul reads two matrices and writes one, 12 n^2 bytes at the least,
    # for 2 n^3 FLOPs: n / 6 FLOP per byte. The roof is min(peak, intensity x bandwidth).
    print(f"\n{'n':>6}{'FLOP/byte':>11}{'roof GFLOP/s':>14}{'ms':>10}{'GFLOP/s':>10}{'of roof':>9}")
    for n in sizes:
        roof = min(peak, n / 6 * bandwidth)
        flops = measure_matmul_flops(n)
        print(f"{n:>6}{n / 6:>11.1f}{roof / 1e9:>14.0f}{2 * n ** 3 / flops * 1e3:>10.2f}"
              f"{flops / 1e9:>10.1f}{flops / roof:>9.1%}")


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seed for the random checks and the toy data")
    parser.add_argument("--steps", type=int, default=300, help="training steps for the toy MLP")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048],
                        help="matrix sizes n for the roofline's n x n matmuls")
    args = parser.parse_args(argv)
    if args.steps < 1 or min(args.sizes) < 1:
        parser.error("--steps and --sizes must be positive")
    torch.manual_seed(args.seed)

    banner("1. Tensors (chapter 2)")
    tour_tensors()
    banner("2. Autograd from scratch, checked against torch.autograd (chapter 3)")
    check_autograd(args.seed)
    banner("3. SGD and AdamW by hand, checked against torch.optim (chapter 3)")
    check_optimizers(seed=args.seed)
    banner("4. Training an MLP on two spirals with our engine and our AdamW (chapter 3)")
    train_toy(args.steps, seed=args.seed, log_every=max(1, args.steps // 10))
    banner("5. The first roofline: CPU matmul against this machine's peak (chapters 1-2)")
    roofline(args.sizes)


if __name__ == "__main__":
    main()
