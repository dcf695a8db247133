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

`Kernels` names the four ops whose computation a backend may replace (`mp_silu`,
`clip_act`, the spatial convolution, attention) by the same function computed another way;
its defaults are the math of this module, plain autodiff (`edm2_jax.backends`), and
`Kernels.forward_mode()` the set a `jax.jvp` through the network takes.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import flax.linen as nn

Array = jax.Array
DType = Any

BUFFERS = "buffers"  # Variable collection of fixed, never-trained arrays (MPFourier).


# Normalisation (Equations 47 and 66).

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
    return _normalize(x, axis, eps)


@functools.partial(jax.checkpoint, static_argnums=(1, 2))
def _normalize(x: Array, axis: tuple[int, ...], eps: float) -> Array:
    # Rematerialised: the backward pass keeps `x` alone, in its own dtype, and recomputes
    # its float32 copy and norm, where autodiff would keep float32 copies of the input
    # (twice the bytes of a bfloat16 activation). The same operations either way.
    n = math.prod(x.shape[a] for a in axis)
    x32 = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(jnp.square(x32), axis=axis, keepdims=True))
    norm = eps + norm / math.sqrt(n)
    return (x32 / norm).astype(x.dtype)


def pixel_norm(x: Array, eps: float = 1e-4) -> Array:
    """Pixel normalisation: `normalize` over the channel (last) axis of NHWC `x`."""
    return normalize(x, axis=-1, eps=eps)


# Magnitude-preserving SiLU (Equation 81).

@jax.checkpoint
def mp_silu(x: Array) -> Array:
    """`silu(x) / 0.596` (Eq. 81): unit variance for unit-variance Gaussian `x`.
    Any shape and float dtype; the result keeps both. Rematerialised: the backward pass
    keeps `x` alone and recomputes `sigmoid(x)` (half the bytes autodiff would keep)."""
    return jax.nn.silu(x) / 0.596


# Activation clipping (the blocks' `clip_act`).

@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def clip_act(x: Array, limit: float) -> Array:
    """`x` clipped to `[-limit, limit]`, with the gradient of the release's `torch.clamp`.

    The derivative is 1 where `-limit <= x <= limit` (the limits included) and 0
    elsewhere, in forward mode (the tangent masked) and reverse mode (the cotangent
    masked: the transpose of the same rule); `jnp.clip`'s autodiff would pass half of it
    at a limit. `limit` is a Python float; `x` any shape and float dtype, kept.
    """
    return jnp.clip(x, -limit, limit)


def clip_mask(x: Array, limit: float) -> Array:
    """Where `clip_act(x, limit)` passes the gradient: `-limit <= x <= limit` (bool)."""
    return (x >= -limit) & (x <= limit)


@jax.checkpoint
def pass_inside(inside: Array, t: Array) -> Array:
    """`t` where `inside` (bool, `t`'s shape), 0 elsewhere: the clip's derivative applied
    to a tangent. Rematerialised: a backward pass keeps `inside`, not an array of zeros."""
    return jnp.where(inside, t, jnp.zeros_like(t))


@clip_act.defjvp
def _clip_act_jvp(limit, primals, tangents):
    # The mask is packed, 8 elements a byte along the last axis, and unpacked inside a
    # rematerialised function of the tangent: the backward pass keeps the packed bytes
    # alone (a bool array would be half the bytes of the bfloat16 activation it clips).
    (x,), (t,) = primals, tangents
    return jnp.clip(x, -limit, limit), _unpack_inside(jnp.packbits(clip_mask(x, limit), -1), t)


@jax.checkpoint
def _unpack_inside(packed: Array, t: Array) -> Array:
    return pass_inside(jnp.unpackbits(packed, -1, count=t.shape[-1]).astype(jnp.bool_), t)


# Magnitude-preserving sum (Equation 88).

def mp_sum(a: Array, b: Array, t: float = 0.5) -> Array:
    """`((1-t) a + t b) / sqrt((1-t)^2 + t^2)` (Eq. 88): `t` is the weight of `b` (the
    residual "balance"); unit-variance independent inputs give a unit-variance output."""
    return ((1 - t) * a + t * b) / math.sqrt((1 - t) ** 2 + t**2)


# Magnitude-preserving concatenation (Equation 103).

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


# The standard layers of the ablation's configs C-F (Sec. 2).

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


# Resampling with the [1, 1] filter (Figure 21).

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


# Convolution (the spatial kernel of MPConv).

def conv_same(x: Array, w: Array) -> Array:
    """NHWC `x` [N, H, W, in] * HWIO `w` [kh, kw, in, out] -> [N, H, W, out]: stride 1,
    'same' zero padding (odd kernels), XLA's convolution and its autodiff.

    `x` and `w` share one dtype, the compute dtype, and so does the result (the
    precision policy of `MPConv`): bfloat16 operands give a bfloat16 result, accumulated
    in float32 inside the kernel by GPUs and TPUs, and their autodiff is bfloat16 too.
    """
    return jax.lax.conv_general_dilated(
        x, w, window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        preferred_element_type=x.dtype)


# Multi-head attention (the blocks' self-attention, Figure 21).

def attention(q: Array, k: Array, v: Array) -> Array:
    """`softmax(q k^T / sqrt(c)) v` over the keys, per head: `q`, `k`, `v` `[N, L, heads,
    c]` of one dtype (the compute dtype) -> `[N, L, heads, c]` of it.

    Both matmuls take and give that dtype (float32 accumulation inside): the logits
    `q (k / sqrt(c))^T` in it, the softmax over the keys in float32, its weights cast
    back for the second matmul (`_attend`).
    """
    c = q.shape[-1]
    logits = jnp.einsum("nqhc,nkhc->nhqk", q, k / jnp.asarray(math.sqrt(c), k.dtype),
                        preferred_element_type=q.dtype)
    return _attend(logits, v)


@jax.checkpoint
def _attend(logits: Array, v: Array) -> Array:
    """`softmax(logits) v`: the softmax over the keys taken in float32, its weights cast
    to `logits.dtype` for the matmul (float32 accumulation inside), the result in that
    dtype. `logits` `[N, heads, q, k]`, `v` `[N, k, heads, c]` -> `[N, q, heads, c]`.
    Rematerialised: the backward pass keeps the logits and `v` and recomputes the
    weights for both gradients (autodiff would keep the weights beside the logits, or
    their float32 copy: one or two more arrays of attention-map size)."""
    weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(logits.dtype)
    return jnp.einsum("nhqk,nkhc->nqhc", weights, v, preferred_element_type=logits.dtype)


# The ops a backend may compute its own way.

@dataclasses.dataclass(frozen=True)
class Kernels:
    """The ops of the network that a backend may replace, with their signatures.

    A replacement computes the same function: the same values, gradients equal up to
    float32 summation order. The defaults are this module's math (plain autodiff, and
    `clip_act`'s mask), differentiable in both modes; `edm2_jax.backends.select` builds
    the other sets.

    Attributes:
      mp_silu: `x -> silu(x) / 0.596` (Eq. 81), any shape.
      clip_act: `(x, limit) -> clip(x, -limit, limit)` with `torch.clamp`'s gradient.
      conv: `(x [N, H, W, in], w [kh, kw, in, out]) -> [N, H, W, out]` in the dtype of
        `x` and `w` (the compute dtype, `conv_same`), stride 1, 'same' padding; called for
        kernels larger than 1x1 (1x1 is a matmul).
      attention: `(q, k, v [N, L, heads, c]) -> [N, L, heads, c]`, `softmax(q k^T /
        sqrt(c)) v` in the compute dtype (`attention`).
      reverse_only: the names of the kernels above that have a hand-written backward
        and no forward-mode rule (a `jax.custom_vjp`): `forward_mode` replaces them.
    """

    mp_silu: Callable[[Array], Array] = mp_silu
    clip_act: Callable[[Array, float], Array] = clip_act
    conv: Callable[[Array, Array], Array] = conv_same
    attention: Callable[[Array, Array, Array], Array] = attention
    reverse_only: tuple[str, ...] = ()

    def forward_mode(self) -> Kernels:
        """The kernel set a `jax.jvp` through the network takes (`model/jvp.py`): this
        one with each kernel of `reverse_only` replaced by the model's math, the same
        function, differentiable in forward mode. The others have a forward-mode rule
        whose transpose is their backward; training keeps `self`, unchanged."""
        return dataclasses.replace(self, reverse_only=(), **{
            name: getattr(MODEL_MATH, name) for name in self.reverse_only})


MODEL_MATH = Kernels()


# Magnitude-preserving Fourier features (Equation 75).

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


# Magnitude-preserving convolution and dense layer (Equations 47 and 66).

class MPConv(nn.Module):
    """Magnitude-preserving convolution / dense layer without bias (Eq. 47, 66).

    The stored weight `W` (`[*kernel, in, out]`, init N(0,1)) is normalised per output
    unit over its fan-in axes, then scaled by `gain / sqrt(fan_in)`, so unit-RMS inputs
    give unit-RMS outputs at gain 1. 3x3 convs use 'same' zero padding. The weight is
    normalised and scaled in float32 and cast to `dtype` together with the input; the
    output is returned in `dtype` (float32 accumulation inside the kernel: the precision
    policy of `edm2_jax/analysis/precision.py`).

    With `normalize_weight=False` it is the standard bias-free layer of the paper's
    config C (Sec. 2.2): `y = x * (gain W)` with `W` initialised by He's uniform init,
    `U(-sqrt(6 / fan_in), sqrt(6 / fan_in))`, and used as stored.

    Attributes:
      in_channels, out_channels: channel counts (last axis of input / output).
      kernel: `()` for dense, `(k, k)` for a conv (1x1 is computed as a matmul).
      dtype: compute and output dtype (float32, bfloat16 or float16).
      normalize_weight: True (configs D-G): the weight normalisation of Eq. 47/66 in
        the forward pass; False (config C): a standard layer.
      conv: the spatial convolution (`Kernels.conv`; default `conv_same`).
    Call: `x` `[..., in]` (dense) or `[N, H, W, in]` (conv), any float dtype, scalar
    `gain` -> `[..., out]` / `[N, H, W, out]` of `dtype`.
    """

    in_channels: int
    out_channels: int
    kernel: tuple[int, ...] = ()
    dtype: DType = jnp.float32
    normalize_weight: bool = True
    conv: Callable[[Array, Array], Array] = conv_same

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
        if math.prod(self.kernel) == 1:  # dense, or a 1x1 conv
            return jnp.matmul(x, w.reshape(self.in_channels, self.out_channels),
                              preferred_element_type=self.dtype)
        return self.conv(x, w)


# Forced weight normalisation (Section 2.3, Equation 66).

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
