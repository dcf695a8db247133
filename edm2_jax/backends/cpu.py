"""XLA:CPU kernels: the model's `mp_silu`, `clip_act` and 3x3 convolution, with their
gradients computed so that XLA:CPU's fusions run fast. Same functions as
`edm2_jax.model.mp` (values equal; gradients equal up to float32 rounding). `mp_silu` and
`clip_act` are `jax.custom_jvp`s (a forward-mode rule whose transpose is their backward);
the 3x3 convolutions `jax.custom_vjp`s, which a `jax.jvp` replaces by `mp.conv_same`
(`Kernels.forward_mode`).

Why. On the CPU backend XLA fuses the elementwise producers of a backward-pass operand
into the YNN fusion (matmul / convolution + epilogue) that consumes it, and a YNN fusion
cannot take scalar constants: each one becomes a broadcast materialised at activation
size every step (1 and 1/0.596 for SiLU's derivative), and the clip's gradient
recomputes the whole mp_sum chain. `barrier` computes a residual behind a `lax.cond` (a
fusion boundary XLA keeps; `optimization_barrier` is gone before fusion on CPU) so that
it is materialised once in the forward pass. Measured with
`python benchmarks/ab_env.py backend.cpu_barriers False True --rounds=10` on the
fashion_mnist step, 2 cores: 635.5 -> 569.1 ms/step (+12% img/s, benchmarks/README.md).

The weight gradient of a 3x3 convolution takes one of three paths (`CONV_GRADS`), the
same math; which is fastest depends on the CPU and the jaxlib (measure with
`python benchmarks/conv_grad.py`; on an AMD EPYC, 2 cores, jaxlib 0.10.2 the
fashion_mnist step takes relayout < xla < matmul, benchmarks/README.md; an older jaxlib
on another machine measured 'matmul' 3.6x faster per convolution):
  'relayout' (default): XLA's own filter-gradient convolution on operands copied to its
      layout outside any fusion (`conv_relayout`);
  'xla': plain autodiff of `mp.conv_same`, the relayouts fused with their producers;
  'matmul': kh*kw shifted matmuls (`conv_matmul`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from edm2_jax.model import mp
from edm2_jax.model.mp import Array, Kernels

CONV_GRADS = ("relayout", "xla", "matmul")
# The CPU kernels' defaults (benchmarks/README.md measures each choice).
DEFAULT_CONV_GRAD, DEFAULT_BARRIERS = "relayout", True


def barrier(fn, *args: Array, key: Array | None = None):
    """`fn(*args)`, computed behind a fusion boundary: a `lax.cond` whose two branches are
    both `fn`, so the value is `fn`'s whatever the predicate. The predicate is read from
    `key` (default `args[0]`): pass a replicated array (a weight) where one is at hand,
    so that a sharded run needs no collective for it."""
    key = args[0] if key is None else key
    return jax.lax.cond(jnp.isfinite(key.reshape(-1)[0]), fn, fn, *args)


# MP-SiLU (Eq. 81): its derivative kept as the residual, computed behind a barrier.

def _mp_silu_grad(x: Array) -> Array:
    s = jax.nn.sigmoid(x)
    return (s + x * (s * (1 - s))) / 0.596


@jax.custom_jvp
def mp_silu(x: Array) -> Array:
    """`mp.mp_silu`; its derivative `(s + x s (1 - s)) / 0.596`, `s = sigmoid(x)` (the
    formula autodiff takes, up to float32 rounding) is computed behind `barrier` and
    multiplies the tangent: in reverse mode (the transpose) it is the residual the
    forward pass keeps instead of `x`."""
    return mp.mp_silu(x)


@mp_silu.defjvp
def _mp_silu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return mp.mp_silu(x), t * barrier(_mp_silu_grad, x).astype(t.dtype)


# Activation clipping: `mp.clip_act` with its mask computed behind a barrier.

@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def clip_act(x: Array, limit: float) -> Array:
    """`mp.clip_act` (`torch.clamp`'s derivative, in both modes); the mask `-limit <= x
    <= limit` is computed behind `barrier` (the residual of the backward pass)."""
    return jnp.clip(x, -limit, limit)


@clip_act.defjvp
def _clip_act_jvp(limit, primals, tangents):
    (x,), (t,) = primals, tangents
    inside = barrier(lambda x: mp.clip_mask(x, limit), x)
    return jnp.clip(x, -limit, limit), mp.pass_inside(inside, t)


# 3x3 convolution: the weight gradient by 'relayout' or 'matmul'.

def _input_grad(x: Array, w: Array, dy: Array) -> Array:
    return jax.vjp(lambda x_: mp.conv_same(x_, w).astype(dy.dtype), x)[1](dy)[0]


def _conv_fwd(x, w):
    return mp.conv_same(x, w), (x, w)


@jax.custom_vjp
def conv_relayout(x: Array, w: Array) -> Array:
    """`mp.conv_same`; the weight gradient is XLA's filter-gradient convolution on
    operands relaid out outside any fusion."""
    return mp.conv_same(x, w)


def _conv_relayout_bwd(res, dy):
    # XLA:CPU computes the weight gradient as a convolution whose contraction runs over
    # the batch, so it copies x to [C_in, H, W, N] and dy to [H, W, N, C_out]. Left to
    # itself it fuses those copies with the elementwise ops that produced x and dy
    # (MP-SiLU, scaling, mp_sum), and a fused transpose is emitted as a plain loop that
    # reads its inputs with a stride of H*W*C: 5-10x slower than copying the
    # materialised array. Here the same convolution (the same kernels and float32 sums
    # as autodiff) runs on copies made behind a barrier.
    x, w = res
    kh, kw, _, _ = w.shape

    def relayout(x, dy):
        return jnp.transpose(x, (3, 1, 2, 0)), jnp.transpose(dy.astype(x.dtype), (1, 2, 0, 3))

    xt, dyt = barrier(relayout, x, dy, key=w)
    dw = jax.lax.conv_general_dilated(
        xt, dyt, window_strides=(1, 1), padding=((kh // 2, kh // 2), (kw // 2, kw // 2)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=x.dtype)
    dw = jnp.transpose(dw, (1, 2, 0, 3))  # [C_in, kh, kw, C_out] -> HWIO
    return _input_grad(x, w, dy).astype(x.dtype), dw.astype(w.dtype)


conv_relayout.defvjp(_conv_fwd, _conv_relayout_bwd)


@jax.custom_vjp
def conv_matmul(x: Array, w: Array) -> Array:
    """`mp.conv_same`; the weight gradient is kh*kw shifted matmuls (the same math as
    XLA's, summed in another order)."""
    return mp.conv_same(x, w)


def _conv_matmul_bwd(res, dy):
    x, w = res
    kh, kw, ci, co = w.shape
    n, h, wd, _ = x.shape
    xp = jnp.pad(x, ((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)))
    dyf = dy.reshape(-1, co).astype(x.dtype)
    dw = jnp.stack([
        jnp.matmul(xp[:, i:i + h, j:j + wd, :].reshape(-1, ci).T, dyf,
                   preferred_element_type=x.dtype)
        for i in range(kh) for j in range(kw)]).reshape(w.shape)
    return _input_grad(x, w, dy).astype(x.dtype), dw.astype(w.dtype)


conv_matmul.defvjp(_conv_fwd, _conv_matmul_bwd)


def kernels(conv_grad: str = DEFAULT_CONV_GRAD, barriers: bool = DEFAULT_BARRIERS) -> Kernels:
    """The CPU kernel set: the 3x3 convolution's weight gradient by `conv_grad` (one of
    `CONV_GRADS`), and with `barriers` the residuals of `mp_silu` and `clip_act`
    behind `barrier` (else the model's math). The 'relayout' and 'matmul' convolutions
    are `jax.custom_vjp`s (a hand-written weight gradient) named in `reverse_only`: a
    `jax.jvp` takes `Kernels.forward_mode()`, with `mp.conv_same` in their place. Raises
    ValueError for another `conv_grad`."""
    if conv_grad not in CONV_GRADS:
        raise ValueError(f"cpu_conv_grad={conv_grad!r}: expected one of {CONV_GRADS} "
                         "(python benchmarks/conv_grad.py says which is faster here)")
    conv = {"relayout": conv_relayout, "xla": mp.conv_same, "matmul": conv_matmul}[conv_grad]
    reverse_only = () if conv is mp.conv_same else ("conv",)
    if not barriers:
        return Kernels(conv=conv, reverse_only=reverse_only)
    return Kernels(mp_silu=mp_silu, clip_act=clip_act, conv=conv, reverse_only=reverse_only)
