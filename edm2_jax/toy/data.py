"""The data of the 2D toy: two binary trees of thin Gaussians, in closed form.

Karras et al. 2024, "Guiding a Diffusion Model with a Bad Version of Itself"
(arXiv:2406.02507), Sec. 3 and Fig. 1: a 2D distribution made of thin branches, one tree
per class. Because it is a Gaussian mixture, its noisy density `log_prob(x; sigma)` (the
mixture convolved with N(0, sigma^2 I)) and its ideal denoiser
`ideal_denoiser(x; sigma) = x + sigma^2 grad log p_sigma(x)` (Tweedie) are exact, so the
toy's denoisers regress the ideal one and samples are scored under the true density.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

CLASS_ANGLES = (math.pi / 4, 5 * math.pi / 4)   # the trunks of class 0 and class 1


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["phi", "mu", "direction", "var_along", "var_across", "cls"],
                   meta_fields=[], drop_fields=["segments", "seg_cls"])
@dataclasses.dataclass(frozen=True)
class Mixture:
    """A 2D Gaussian mixture whose components are elongated along unit directions.

    Component `k` has weight `phi[k]` (summing to 1 over all classes), mean `mu[k]`,
    variance `var_along[k]` along `direction[k]` and `var_across[k]` across it, and
    belongs to class `cls[k]`. `segments[s] = (start, end)` are the branch centre lines,
    of class `seg_cls[s]` (the "manifold" that `distance_to_branches` measures to).
    Float32 (`cls`, `seg_cls` int32) NumPy; `phi [K]`, `mu [K, 2]`, `direction [K, 2]`,
    `segments [S, 2, 2]`. A pytree of the component arrays, so jitted functions take it
    as an argument (as closed-over constants XLA would fold its broadcasts, slowly).
    """

    phi: Any
    mu: Any
    direction: Any
    var_along: Any
    var_across: Any
    cls: Any
    segments: np.ndarray = dataclasses.field(default=None, compare=False)
    seg_cls: np.ndarray = dataclasses.field(default=None, compare=False)


def tree_mixture(depth: int = 6, comps_per_branch: int = 6, seed: int = 0) -> Mixture:
    """Two binary trees growing from near the origin in opposite directions (classes 0,
    1), each branch a chain of `comps_per_branch` thin Gaussians.

    A branch at `depth` d has length about `0.34 * 0.78^d` and splits at its end into two
    children turned by about `+-0.65 * 0.72^d` rad; its thickness shrinks with d and its
    mass is `length * 0.55^d` (deeper twigs are lighter, as in the paper's toy). Lengths
    and angles are jittered by 15 % from `seed`. The data spans roughly [-1.3, 1.3]^2.
    """
    rng = np.random.RandomState(seed)
    comps, segments = [], []

    def grow(c, d, start, angle):
        if d >= depth:
            return
        u = np.array([math.cos(angle), math.sin(angle)])
        length = 0.34 * 0.78**d * (1 + 0.15 * rng.randn())
        end = start + length * u
        segments.append((c, start, end))
        sd_along = 0.6 * length / comps_per_branch
        sd_across = 0.012 * 0.85**d
        for t in (np.arange(comps_per_branch) + 0.5) / comps_per_branch:
            comps.append((c, length * 0.55**d / comps_per_branch, start + t * length * u, u,
                          sd_along**2, sd_across**2))
        for side in (1, -1):
            turn = side * 0.65 * 0.72**d * (1 + 0.15 * rng.randn())
            grow(c, d + 1, end, angle + turn)

    for c, angle in enumerate(CLASS_ANGLES):
        grow(c, 0, 0.02 * np.array([math.cos(angle), math.sin(angle)]), angle)
    cls, phi, mu, u, va, vc = (np.array(v) for v in zip(*comps))
    f32 = lambda a: np.asarray(a, np.float32)
    return Mixture(phi=f32(phi / phi.sum()), mu=f32(mu), direction=f32(u), var_along=f32(va),
                   var_across=f32(vc), cls=cls.astype(np.int32),
                   segments=f32([(s, e) for _, s, e in segments]),
                   seg_cls=np.array([c for c, _, _ in segments], np.int32))


def _component_terms(mix: Mixture, x: Array, sigma: Array, cls: Array | None):
    """Per-component log-density `[B, K]` of `x [B, 2]` at noise `sigma [B]` (the
    mixture convolved with N(0, sigma^2 I)), and the components' scores `[B, K, 2]`.
    With `cls [B]` ints, components of other classes get weight 0 (log -inf)."""
    u = jnp.asarray(mix.direction)
    v = jnp.stack([-u[:, 1], u[:, 0]], axis=-1)          # across the branch
    s2 = jnp.square(sigma)[:, None]
    va = jnp.asarray(mix.var_along)[None] + s2             # [B, K]
    vc = jnp.asarray(mix.var_across)[None] + s2
    y = x[:, None, :] - jnp.asarray(mix.mu)[None]          # [B, K, 2]
    ya, yc = jnp.sum(y * u, -1), jnp.sum(y * v, -1)
    log_phi = jnp.log(jnp.asarray(mix.phi))[None]
    if cls is not None:
        same = jnp.asarray(mix.cls)[None] == cls[:, None]
        log_phi = jnp.where(same, log_phi, -jnp.inf)
    logp = (log_phi - 0.5 * (ya**2 / va + yc**2 / vc) - 0.5 * jnp.log(va * vc)
            - math.log(2 * math.pi))
    score = -(ya / va)[..., None] * u - (yc / vc)[..., None] * v
    return logp, score


def broadcast_sigma(sigma: Array | float, x: Array) -> Array:
    """`sigma` (scalar or `[B]`) as float32 `[B]`, `B = x.shape[0]`."""
    return jnp.broadcast_to(jnp.asarray(sigma, jnp.float32).reshape(-1), (x.shape[0],))


def log_prob(mix: Mixture, x: Array, sigma: Array | float = 0.0,
             cls: Array | int | None = None) -> Array:
    """`log p_sigma(x)` of the mixture (of class `cls` alone if given, renormalised):
    `x [B, 2]`, `sigma` scalar or `[B]`, `cls` int or `[B]` -> `[B]` float32."""
    x = jnp.asarray(x, jnp.float32)
    cls = None if cls is None else jnp.broadcast_to(jnp.asarray(cls, jnp.int32), x.shape[:1])
    logp, _ = _component_terms(mix, x, broadcast_sigma(sigma, x), cls)
    log_norm = 0.0
    if cls is not None:
        same = jnp.asarray(mix.cls)[None] == cls[:, None]
        log_norm = jnp.log(jnp.sum(jnp.where(same, jnp.asarray(mix.phi)[None], 0.0), -1))
    return jax.nn.logsumexp(logp, axis=-1) - log_norm


def ideal_denoiser(mix: Mixture, x: Array, sigma: Array | float,
                   cls: Array | int | None = None) -> Array:
    """`E[x_0 | x_0 + sigma n = x] = x + sigma^2 grad log p_sigma(x)` (Tweedie), the
    best possible denoiser of the mixture (of class `cls` if given): `[B, 2]` float32."""
    x = jnp.asarray(x, jnp.float32)
    sigma = broadcast_sigma(sigma, x)
    cls = None if cls is None else jnp.broadcast_to(jnp.asarray(cls, jnp.int32), x.shape[:1])
    logp, score = _component_terms(mix, x, sigma, cls)
    resp = jax.nn.softmax(logp, axis=-1)[..., None]
    return x + jnp.square(sigma)[:, None] * jnp.sum(resp * score, axis=1)


def sample_mixture(mix: Mixture, rng: Array, n: int, cls: int | Array | None = None,
                   sigma: Array | float = 0.0) -> tuple[Array, Array]:
    """`n` draws of the mixture (of class `cls` if given) plus N(0, sigma^2 I) noise.
    Returns `(x [n, 2] float32, class [n] int32)`."""
    k_comp, k_noise = jax.random.split(rng)
    log_phi = jnp.log(jnp.asarray(mix.phi))
    if cls is None:   # inverse CDF: no [n, K] array, so n may be large
        cdf = jnp.cumsum(jnp.asarray(mix.phi))
        k = jnp.searchsorted(cdf, jax.random.uniform(k_comp, (n,)) * cdf[-1])
        k = jnp.minimum(k, cdf.shape[0] - 1)
    else:
        cls = jnp.broadcast_to(jnp.asarray(cls, jnp.int32), (n,))
        k = jax.random.categorical(k_comp, jnp.where(
            jnp.asarray(mix.cls)[None] == cls[:, None], log_phi[None], -jnp.inf))
    u = jnp.asarray(mix.direction)[k]
    v = jnp.stack([-u[:, 1], u[:, 0]], axis=-1)
    s2 = jnp.square(jnp.broadcast_to(jnp.asarray(sigma, jnp.float32), (n,)))
    z = jax.random.normal(k_noise, (n, 2))
    x = (jnp.asarray(mix.mu)[k] + jnp.sqrt(jnp.asarray(mix.var_along)[k] + s2)[:, None] * z[:, :1] * u
         + jnp.sqrt(jnp.asarray(mix.var_across)[k] + s2)[:, None] * z[:, 1:] * v)
    return x, jnp.asarray(mix.cls)[k]


def distance_to_branches(mix: Mixture, x: np.ndarray, cls: int | None = None) -> np.ndarray:
    """Euclidean distance from each point `x [B, 2]` to the nearest branch centre line
    (of class `cls` if given): `[B]` float64 (NumPy)."""
    seg = mix.segments if cls is None else mix.segments[mix.seg_cls == cls]
    a, b = seg[None, :, 0].astype(np.float64), seg[None, :, 1].astype(np.float64)
    p = np.asarray(x, np.float64)[:, None]
    ab = b - a
    t = np.clip(np.sum((p - a) * ab, -1) / np.sum(ab * ab, -1), 0, 1)[..., None]
    return np.sqrt(np.min(np.sum(np.square(p - (a + t * ab)), -1), axis=1))
