"""Magnitude-preserving (MP) primitives of EDM2 (Karras et al., CVPR 2024, Appendix B).

Also the standard counterparts the paper's ablation (Sec. 2, configs C-F) starts from:
`plain_sum`, `plain_cat`, `group_rms_norm`, `MPConv(normalize_weight=False)` (a standard
bias-free layer with He's uniform init) and `MPFourier(magnitude_preserving=False)`;
`networks.py` picks them by its config switches (docs/ablation.md).

Arrays are NHWC. Convolution weights are stored HWIO (`[kh, kw, in, out]`), dense
weights `[in, out]`; the output unit is always the last axis, so "fan-in axes" are all
the others. Everything here is a pure function or a parameter-holding `linen` module
with no training logic; forced weight normalisation (`force_normalize`) is a pure
function over the params pytree that the training step applies to the online weights.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import flax.linen as nn

Array = jax.Array
DType = Any

BUFFERS = "buffers"  # Variable collection of fixed, never-trained arrays (MPFourier).


def normalize(x: Array, axis: int | Sequence[int] | None = None, eps: float = 1e-4) -> Array:
    """Scale `x` to unit RMS over `axis` (Eq. 47 / 66 normalisation).

    Computes `x / (eps + ||x||_axis / sqrt(n))` with `n` the number of elements reduced
    over. The norm is taken in float32; the result keeps `x.dtype`.

    Args:
      x: any shape and float dtype.
      axis: axes to reduce; `None` means all axes but the first (per-example).
      eps: added to the RMS to avoid division by zero.
    Returns:
      array of `x.shape` and `x.dtype`.
    """
    if axis is None:
        axis = tuple(range(1, x.ndim))
    elif isinstance(axis, int):
        axis = (axis,)
    axis = tuple(a % x.ndim for a in axis)
    n = math.prod(x.shape[a] for a in axis)
    x32 = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(jnp.square(x32), axis=axis, keepdims=True))
    norm = eps + norm / math.sqrt(n)
    return (x32 / norm).astype(x.dtype)


def pixel_norm(x: Array, eps: float = 1e-4) -> Array:
    """Pixel normalisation: `normalize` over the channel (last) axis of NHWC `x`."""
    return normalize(x, axis=-1, eps=eps)


# On the CPU backend XLA fuses the elementwise producers of a backward-pass operand into
# the YNN fusion (matmul / convolution + epilogue) that consumes it, and a YNN fusion
# cannot take scalar constants: each one becomes a broadcast materialised at activation
# size every step (1 and 1/0.596 for SiLU's derivative), and the clip's gradient
# recomputes the whole mp_sum chain. `_cpu_barrier` computes a residual behind a
# `lax.cond` (a fusion boundary XLA keeps; both branches are the same function of
# traced data, so the value is the function's) so that it is materialised once in the
# forward pass. Measured in benchmarks/README.md (session 6); `EDM2_JAX_CPU_BARRIERS=0`
# restores plain autodiff (the same values up to float32 rounding).
CPU_BARRIERS_ENV = "EDM2_JAX_CPU_BARRIERS"


def _cpu_barrier(fn, *args: Array, key: Array | None = None):
    """`fn(*args)`, computed behind a fusion boundary (a `lax.cond`; see above). The
    cond's predicate is read from `key` (default `args[0]`): pass a replicated array
    (a weight) where one is at hand, so that a sharded run needs no collective for it."""
    key = args[0] if key is None else key
    return jax.lax.cond(jnp.isfinite(key.reshape(-1)[0]), fn, fn, *args)


def _mp_silu(x: Array) -> Array:
    return jax.nn.silu(x) / 0.596


def _mp_silu_grad(x: Array) -> Array:
    s = jax.nn.sigmoid(x)
    return (s + x * (s * (1 - s))) / 0.596


def _barriers_on() -> bool:
    return jax.default_backend() == "cpu" and os.environ.get(CPU_BARRIERS_ENV, "1") != "0"


def mp_silu(x: Array) -> Array:
    """Magnitude-preserving SiLU, `silu(x) / 0.596` (Eq. 81).

    On CPU its gradient, `(s + x s (1 - s)) / 0.596` with `s = sigmoid(x)` (the formula
    autodiff takes, up to float32 rounding), is computed in the forward pass behind
    `_cpu_barrier` and kept as the residual instead of `x`; elsewhere plain autodiff.
    """
    return _mp_silu_cpu(x) if _barriers_on() else _mp_silu(x)


@jax.custom_vjp
def _mp_silu_cpu(x: Array) -> Array:
    return _mp_silu(x)


def _mp_silu_fwd(x):
    return _mp_silu(x), _cpu_barrier(_mp_silu_grad, x)


def _mp_silu_bwd(g, dy):
    return (dy * g.astype(dy.dtype),)


_mp_silu_cpu.defvjp(_mp_silu_fwd, _mp_silu_bwd)


def clip_act(x: Array, limit: float) -> Array:
    """`x` clipped to `[-limit, limit]` (the blocks' activation clipping, `clip_act`).

    On CPU the gradient is taken from a mask `-limit <= x <= limit` computed in the
    forward pass behind `_cpu_barrier` (the gradient of `torch.clamp`, the release's);
    elsewhere `jnp.clip`'s autodiff. The two differ only where `x` equals a limit
    exactly (`jnp.clip` passes half of the gradient there).
    """
    return _clip_act_cpu(x, limit) if _barriers_on() else jnp.clip(x, -limit, limit)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _clip_act_cpu(x: Array, limit: float) -> Array:
    return jnp.clip(x, -limit, limit)


def _clip_act_fwd(x, limit):
    inside = _cpu_barrier(lambda x: (x >= -limit) & (x <= limit), x)
    return jnp.clip(x, -limit, limit), inside


def _clip_act_bwd(limit, inside, dy):
    return (jnp.where(inside, dy, jnp.zeros_like(dy)),)


_clip_act_cpu.defvjp(_clip_act_fwd, _clip_act_bwd)


def mp_sum(a: Array, b: Array, t: float = 0.5) -> Array:
    """Magnitude-preserving sum `((1-t) a + t b) / sqrt((1-t)^2 + t^2)` (Eq. 88).

    `t` is the weight of `b` (the residual "balance"); unit-variance independent
    inputs give a unit-variance output.
    """
    return ((1 - t) * a + t * b) / math.sqrt((1 - t) ** 2 + t**2)


def mp_cat(a: Array, b: Array, t: float = 0.5, axis: int = -1) -> Array:
    """Magnitude-preserving concatenation along `axis` (Eq. 103).

    With `Na`, `Nb` channels, `C = sqrt((Na + Nb) / ((1-t)^2 + t^2))` and the output is
    `concat(C (1-t) / sqrt(Na) a, C t / sqrt(Nb) b)`: unit-RMS inputs give a unit-RMS
    output, and `t` sets the relative contribution of `b`.
    """
    na, nb = a.shape[axis], b.shape[axis]
    c = math.sqrt((na + nb) / ((1 - t) ** 2 + t**2))
    wa = c / math.sqrt(na) * (1 - t)
    wb = c / math.sqrt(nb) * t
    return jnp.concatenate([wa * a, wb * b], axis=axis)


def plain_sum(a: Array, b: Array, t: float = 0.5) -> Array:
    """Standard (not magnitude-preserving) counterpart of `mp_sum`: `a + t / (1-t) b`.

    The same relative weight of `b` as `mp_sum(a, b, t)` without the normalisation, so a
    plain sum `a + b` at `t = 0.5`; `t = 0.3` is the paper's weakened residual path
    (config F, Sec. 2.4). Raises ValueError for `t >= 1`.
    """
    if t >= 1:
        raise ValueError(f"plain_sum: t={t} must be < 1 (the weight of b relative to a is t / (1-t))")
    return a + (t / (1 - t)) * b if t != 0.5 else a + b


def plain_cat(a: Array, b: Array, t: float = 0.5, axis: int = -1) -> Array:
    """Standard counterpart of `mp_cat`: `concatenate([a, b], axis)` (`t` is ignored)."""
    del t
    return jnp.concatenate([a, b], axis=axis)


def group_rms_norm(x: Array, eps: float = 1e-4, max_groups: int = 32) -> Array:
    """Group normalisation of configs C-E (paper Sec. 2.2): NHWC `x` divided per example
    and per channel group by its RMS over (H, W, channels in the group), with the mean
    subtraction and the learned scale removed, as config C simplified ADM's GroupNorm.

    Groups: `gcd(max_groups, C)` (32 as ADM where C allows). The RMS is taken in float32;
    the result keeps `x.dtype` and `x.shape`.
    """
    n, h, w, c = x.shape
    groups = math.gcd(max_groups, c)
    g = normalize(x.reshape(n, h, w, groups, c // groups), axis=(1, 2, 4), eps=eps)
    return g.reshape(x.shape)


def resample(x: Array, mode: str = "keep") -> Array:
    """Resampling with the [1,1] filter on NHWC `x`.

    `mode='down'`: 2x2 average pooling, stride 2 (H and W must be even).
    `mode='up'`: nearest-neighbour 2x upsampling. `mode='keep'`: identity.
    Raises ValueError for any other mode.
    """
    if mode == "keep":
        return x
    if mode == "down":
        n, h, w, c = x.shape
        return x.reshape(n, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))
    if mode == "up":
        return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
    raise ValueError(f"resample: unknown mode {mode!r}; expected 'keep', 'down' or 'up'")


def _xla_conv(x: Array, w: Array) -> Array:
    return jax.lax.conv_general_dilated(
        x, w, window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        preferred_element_type=jnp.float32)


@jax.custom_vjp
def _conv_cpu(x: Array, w: Array) -> Array:
    return _xla_conv(x, w)


def _conv_cpu_fwd(x, w):
    return _xla_conv(x, w), (x, w)


def _conv_cpu_bwd(res, dy):
    # The weight gradient as kh*kw shifted matmuls. Exact same math as XLA's.
    x, w = res
    kh, kw, ci, co = w.shape
    n, h, wd, _ = x.shape
    dx = jax.vjp(lambda x_: _xla_conv(x_, w).astype(dy.dtype), x)[1](dy)[0]
    xp = jnp.pad(x, ((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)))
    dyf = dy.reshape(-1, co).astype(x.dtype)
    dw = jnp.stack([
        jnp.matmul(xp[:, i:i + h, j:j + wd, :].reshape(-1, ci).T, dyf,
                   preferred_element_type=jnp.float32)
        for i in range(kh) for j in range(kw)]).reshape(w.shape)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_conv_cpu.defvjp(_conv_cpu_fwd, _conv_cpu_bwd)


@jax.custom_vjp
def _conv_cpu_relayout(x: Array, w: Array) -> Array:
    return _xla_conv(x, w)


def _conv_cpu_relayout_bwd(res, dy):
    # XLA's own filter-gradient convolution, i.e. the same kernels and the same float32
    # sums as plain autodiff, with its operands relaid out up front. XLA:CPU computes the
    # weight gradient as a convolution whose contraction runs over the batch, so it copies
    # x to [C_in, H, W, N] and dy to [H, W, N, C_out]. Left to itself it fuses those
    # copies with the elementwise ops that produced x and dy (MP-SiLU, scaling, mp_sum),
    # and a fused transpose is emitted as a plain loop that reads its inputs with a
    # stride of H*W*C: 5-10x slower than copying the materialised array. A `cond` is a
    # fusion boundary XLA keeps (`optimization_barrier` is gone before fusion on CPU); its
    # predicate is traced and both branches are the same function, so the value is
    # unchanged whatever it reads. Measured in benchmarks/README.md ("relayout").
    x, w = res
    kh, kw, _, _ = w.shape

    def relayout(x, dy):
        return jnp.transpose(x, (3, 1, 2, 0)), jnp.transpose(dy.astype(x.dtype), (1, 2, 0, 3))

    xt, dyt = _cpu_barrier(relayout, x, dy, key=w)
    dw = jax.lax.conv_general_dilated(
        xt, dyt, window_strides=(1, 1), padding=((kh // 2, kh // 2), (kw // 2, kw // 2)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=jnp.float32)
    dw = jnp.transpose(dw, (1, 2, 0, 3))  # [C_in, kh, kw, C_out] -> HWIO
    dx = jax.vjp(lambda x_: _xla_conv(x_, w).astype(dy.dtype), x)[1](dy)[0]
    return dx.astype(x.dtype), dw.astype(w.dtype)


_conv_cpu_relayout.defvjp(_conv_cpu_fwd, _conv_cpu_relayout_bwd)


# How 3x3 convolutions get their weight gradient on the CPU backend:
#   'relayout' (default): XLA's own filter-gradient convolution on operands copied to
#       its layout outside any fusion (the custom VJP above);
#   'xla': plain autodiff, XLA's filter-gradient convolution with the relayouts fused;
#   'matmul': the shifted-matmul custom VJP.
# All three are the same math. Which is fastest depends on the CPU and the jaxlib:
# measure with `python benchmarks/conv_grad.py`. On an AMD EPYC (2 cores, jaxlib
# 0.10.2) the fashion_mnist step takes relayout < xla < matmul (benchmarks/README.md);
# an older jaxlib on another machine measured 'matmul' 3.6x faster per convolution.
CPU_CONV_GRAD_ENV = "EDM2_JAX_CPU_CONV_GRAD"
_CPU_CONV_GRADS = ("relayout", "xla", "matmul")


def cpu_conv_grad() -> str:
    """The CPU weight-gradient path in force: `$EDM2_JAX_CPU_CONV_GRAD` or 'relayout'.

    Read when a network is traced. Raises ValueError for a value other than
    'relayout', 'xla' or 'matmul' (the same math; 'relayout' and 'xla' run the same
    convolution, 'matmul' differs from them in float32 summation order only).
    """
    mode = os.environ.get(CPU_CONV_GRAD_ENV, "relayout") or "relayout"
    if mode not in _CPU_CONV_GRADS:
        raise ValueError(f"{CPU_CONV_GRAD_ENV}={mode!r}: expected one of {_CPU_CONV_GRADS} "
                         "(python benchmarks/conv_grad.py says which is faster here)")
    return mode


def conv2d_same(x: Array, w: Array) -> Array:
    """NHWC x HWIO convolution, stride 1, 'same' zero padding, float32 output.

    1x1 kernels are matmuls. On the CPU backend the weight gradient of larger kernels
    takes the path `cpu_conv_grad()` names (identical math, see above); on other
    backends XLA's convolution and its own gradient.
    """
    kh, kw, ci, co = w.shape
    if kh == kw == 1:
        return jnp.matmul(x, w.reshape(ci, co), preferred_element_type=jnp.float32)
    if jax.default_backend() == "cpu":
        mode = cpu_conv_grad()
        if mode == "matmul":
            return _conv_cpu(x, w)
        if mode == "relayout":
            return _conv_cpu_relayout(x, w)
    return _xla_conv(x, w)


class MPFourier(nn.Module):
    """Magnitude-preserving Fourier features of a scalar (Eq. 75).

    Buffers `freqs = 2 pi N(0,1) bandwidth` and `phases = 2 pi U(0,1)` live in the
    non-trainable `'buffers'` collection; they are drawn once from the `'params'` init
    rng and must be saved with checkpoints. Input `x` `[N]` (any float dtype) ->
    `sqrt(2) cos(outer(x, freqs) + phases)`, `[N, num_channels]` float32.
    `magnitude_preserving=False` drops the `sqrt(2)` (standard Fourier features, RMS
    `1/sqrt(2)`; configs C-F of the paper's Sec. 2).
    """

    num_channels: int
    bandwidth: float = 1.0
    magnitude_preserving: bool = True

    @nn.compact
    def __call__(self, x: Array) -> Array:
        freqs = self.variable(
            BUFFERS, "freqs",
            lambda: 2 * jnp.pi * self.bandwidth
            * jax.random.normal(self.make_rng("params"), (self.num_channels,), jnp.float32))
        phases = self.variable(
            BUFFERS, "phases",
            lambda: 2 * jnp.pi
            * jax.random.uniform(self.make_rng("params"), (self.num_channels,), jnp.float32))
        y = jnp.outer(x.astype(jnp.float32), freqs.value.astype(jnp.float32))
        if not self.magnitude_preserving:
            return jnp.cos(y + phases.value.astype(jnp.float32))
        return jnp.sqrt(2.0) * jnp.cos(y + phases.value.astype(jnp.float32))


class MPConv(nn.Module):
    """Magnitude-preserving convolution / dense layer without bias (Eq. 47, 66).

    The stored weight `W` (`[*kernel, in, out]`, init N(0,1)) is normalised per output
    unit over its fan-in axes, then scaled by `gain / sqrt(fan_in)`, so unit-RMS inputs
    give unit-RMS outputs at gain 1. 3x3 convs use 'same' zero padding. The weight is
    normalised and scaled in float32 and cast to `dtype` together with the input; the
    output is returned as float32.

    With `normalize_weight=False` it is the standard bias-free layer of the paper's
    config C (Sec. 2.2): `y = x * (gain W)` with `W` initialised by He's uniform init,
    `U(-sqrt(6 / fan_in), sqrt(6 / fan_in))`, and used as stored.

    Attributes:
      in_channels, out_channels: channel counts (last axis of input / output).
      kernel: `()` for dense, `(k, k)` for a conv.
      dtype: compute dtype of the matmul / convolution (float32 or bfloat16).
      normalize_weight: True (configs D-G): the weight normalisation of Eq. 47/66 in
        the forward pass; False (config C): a standard layer.
    Call: `x` `[..., in]` (dense) or `[N, H, W, in]` (conv), scalar `gain` -> float32.
    """

    in_channels: int
    out_channels: int
    kernel: tuple[int, ...] = ()
    dtype: DType = jnp.float32
    normalize_weight: bool = True

    @nn.compact
    def __call__(self, x: Array, gain: Array | float = 1.0) -> Array:
        shape = (*self.kernel, self.in_channels, self.out_channels)
        if self.normalize_weight:
            weight = self.param("weight", nn.initializers.normal(stddev=1.0), shape, jnp.float32)
            fan_in = math.prod(shape[:-1])
            w = normalize(weight.astype(jnp.float32), axis=tuple(range(weight.ndim - 1)))
            w = (w * (gain / math.sqrt(fan_in))).astype(self.dtype)
        else:
            weight = self.param("weight", nn.initializers.he_uniform(), shape, jnp.float32)
            w = weight if isinstance(gain, float) and gain == 1.0 else weight * gain
            w = w.astype(self.dtype)
        x = x.astype(self.dtype)
        if not self.kernel:
            y = jnp.matmul(x, w, preferred_element_type=jnp.float32)
        else:
            y = conv2d_same(x, w)
        return y.astype(jnp.float32)


def _is_mp_weight(path: tuple, leaf: Array) -> bool:
    last = path[-1]
    name = getattr(last, "key", getattr(last, "name", last))
    return name == "weight" and getattr(leaf, "ndim", 0) >= 2


def force_normalize(params: Any) -> Any:
    """Forced weight normalisation (paper Sec. 2.3, Eq. 66): a pure function.

    Returns `params` with every `MPConv` weight (a leaf named `weight` of rank >= 2)
    replaced by `normalize(W)` over its fan-in axes, so each output unit's stored
    weight has L2 norm `sqrt(fan_in)` (up to the 1e-4 eps). Idempotent up to that
    eps. Apply to the online training weights before each forward; never to EMAs.
    """
    def fn(path, leaf):
        if _is_mp_weight(path, leaf):
            return normalize(leaf, axis=tuple(range(leaf.ndim - 1))).astype(leaf.dtype)
        return leaf
    return jax.tree_util.tree_map_with_path(fn, params)
