"""The 2D toy of autoguidance: CFG against autoguidance on a thin, branching mixture.

Karras et al. 2024, "Guiding a Diffusion Model with a Bad Version of Itself"
(arXiv:2406.02507), Sec. 3 and Fig. 1: on a 2D distribution made of thin branches, a
denoiser guided by an unconditional model (classifier-free guidance, CFG) pushes samples
away from the other class and collapses them onto a few outer tips, while a denoiser
guided by a smaller, shorter-trained version of itself (autoguidance) pulls the samples
that the main model smears between branches back onto the branches and keeps their
variety. The guided denoiser is `D_w = D_g + w (D - D_g)` (Eq. 1), `sampling.make_denoiser`.

What is here, in data-flow order:
- `tree_mixture`: the data, two classes of binary trees, each branch a chain of
  elongated Gaussians. Its exact noisy density `log_prob(x; sigma)` and ideal denoiser
  `ideal_denoiser(x; sigma) = x + sigma^2 grad log p_sigma(x)` are closed-form.
- `ToyDenoiser`: a magnitude-preserving MLP (`mp.MPConv` dense layers, `mp_silu`,
  `mp_sum`, `MPFourier` noise embedding) inside the EDM preconditioning of
  `networks.Precond` (docs/recipe.md §1, §3); same call signature as `Precond`, so the
  sampler of `sampling.py` guides it unchanged.
- `train_denoiser`: Adam, inverse-sqrt decay, forced weight normalisation, a power EMA
  (docs/recipe.md §4, §5), regressing the ideal denoiser (no sampling noise in the
  target: the toy trains in seconds).
- `sample_points`, `sample_metrics`: the EDM Heun sampler on points; on-manifold
  fraction, coverage and mean log-likelihood under the true class density.
- `plot_guidance`: samples and score fields of unguided / CFG / autoguidance.
- `run`: all of it (the CLI and `colabs/toy_2d.ipynb` call this).

    python -m edm2_jax.analysis.toy --out=toy_out          # 105 s of CPU time (2 cores: 1-2.6 min)
    python -m edm2_jax.analysis.toy --out=/tmp/toy --tiny  # about a third of that, for tests
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import time
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from edm2_jax.ema import power as ema_lib
from edm2_jax.model import mp
from edm2_jax.model import networks
from edm2_jax.sampling import sampler as sampling

Array = jax.Array

CLASS_ANGLES = (math.pi / 4, 5 * math.pi / 4)   # the trunks of class 0 and class 1


# ---------------------------------------------------------------------------------------
# The data: a mixture of elongated Gaussians along the branches of two binary trees.

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


def _broadcast_sigma(sigma, x):
    return jnp.broadcast_to(jnp.asarray(sigma, jnp.float32).reshape(-1), (x.shape[0],))


def log_prob(mix: Mixture, x: Array, sigma: Array | float = 0.0,
             cls: Array | int | None = None) -> Array:
    """`log p_sigma(x)` of the mixture (of class `cls` alone if given, renormalised):
    `x [B, 2]`, `sigma` scalar or `[B]`, `cls` int or `[B]` -> `[B]` float32."""
    x = jnp.asarray(x, jnp.float32)
    cls = None if cls is None else jnp.broadcast_to(jnp.asarray(cls, jnp.int32), x.shape[:1])
    logp, _ = _component_terms(mix, x, _broadcast_sigma(sigma, x), cls)
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
    sigma = _broadcast_sigma(sigma, x)
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


# ---------------------------------------------------------------------------------------
# The denoiser: an MP MLP inside EDM preconditioning.

class ToyDenoiser(nn.Module):
    """Magnitude-preserving MLP denoiser of 2D points in EDM preconditioning.

    `D(x; sigma) = c_skip x + c_out F(c_in x, c_noise, labels)` with the coefficients of
    `networks.Precond` (docs/recipe.md §3). `F`: the input `[c_in x, 1]` through an MP
    dense layer to `hidden` features, then `num_blocks` residual blocks
    `h = mp_sum(h, dense(mp_silu(dense(mp_silu(h)) * (1 + emb_gain dense(emb)))), 0.3)`
    (the EDM2 block of Figure 21 without convolutions), then an MP dense layer to 2 with
    a learned output gain initialised to 0 (so the untrained `D` is `c_skip x`, the
    ideal denoiser of N(0, sigma_data^2 I)). `emb = mp_silu(dense(MPFourier(c_noise)))`,
    mixed with a label embedding by `mp_sum(., ., 0.5)` when `label_dim > 0`.

    Call: `x [B, 2]`, `sigma` scalar or `[B]` (> 0), `labels [B, label_dim]` one-hot or
    None (zeros: the unconditional slot) -> `D [B, 2]` float32. Same signature as
    `Precond`, so `sampling.make_denoiser` guides it.
    """

    label_dim: int = 0
    hidden: int = 64
    num_blocks: int = 3
    noise_channels: int = 32
    sigma_data: float = 0.5
    res_balance: float = 0.3

    @nn.compact
    def __call__(self, x: Array, sigma: Array, labels: Array | None = None) -> Array:
        x = jnp.asarray(x, jnp.float32)
        sigma = _broadcast_sigma(sigma, x)
        c_skip, c_out, c_in, c_noise = networks.precond_coefficients(
            sigma, self.sigma_data, x.ndim)

        emb = mp.MPConv(self.noise_channels, self.hidden, name="emb_noise")(
            mp.MPFourier(self.noise_channels, name="emb_fourier")(c_noise))
        if self.label_dim:
            if labels is None:
                labels = jnp.zeros((x.shape[0], self.label_dim), jnp.float32)
            lab = mp.MPConv(self.label_dim, self.hidden, name="emb_label")(
                jnp.asarray(labels, jnp.float32) * math.sqrt(self.label_dim))
            emb = mp.mp_sum(emb, lab, 0.5)
        emb = mp.mp_silu(emb)

        h = mp.MPConv(3, self.hidden, name="in_dense")(
            jnp.concatenate([c_in * x, jnp.ones_like(x[:, :1])], axis=-1))
        for i in range(self.num_blocks):
            emb_gain = self.param(f"block{i}_emb_gain", nn.initializers.zeros, ())
            y = mp.MPConv(self.hidden, self.hidden, name=f"block{i}_dense0")(mp.mp_silu(h))
            c = mp.MPConv(self.hidden, self.hidden, name=f"block{i}_emb")(emb, gain=emb_gain) + 1
            y = mp.MPConv(self.hidden, self.hidden, name=f"block{i}_dense1")(mp.mp_silu(y * c))
            h = mp.mp_sum(h, y, self.res_balance)
        out_gain = self.param("out_gain", nn.initializers.zeros, ())
        F = mp.MPConv(self.hidden, 2, name="out_dense")(h, gain=out_gain)
        return c_skip * x + c_out * F


def init_denoiser(net: ToyDenoiser, rng: Array) -> dict:
    """`{'params', 'buffers'}` of `net`."""
    x, sigma = jnp.zeros((1, 2)), jnp.ones((1,))
    labels = jnp.zeros((1, net.label_dim)) if net.label_dim else None
    return dict(jax.jit(lambda r: net.init({"params": r}, x, sigma, labels))(rng))


# ---------------------------------------------------------------------------------------
# Training.

@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """How one toy denoiser trains.

    `steps` Adam steps of `batch` points; `lr = ref_lr / sqrt(max(step / t_ref, 1))`;
    `ln sigma ~ N(P_mean, P_std^2)` (weighted to low noise: the branches are thin); the
    returned weights are a power EMA of width `ema_sigma_rel` (docs/recipe.md §5).
    """

    steps: int = 1536
    batch: int = 512
    ref_lr: float = 0.01
    t_ref: int = 256
    P_mean: float = -2.0
    P_std: float = 1.6
    ema_sigma_rel: float = 0.05
    chunk: int = 128   # steps per jitted `lax.scan` call


def denoiser_loss(params: Any, buffers: Any, net: ToyDenoiser, mix: Mixture, rng: Array,
                  batch: int, P_mean: float, P_std: float) -> Array:
    """EDM-weighted squared error to the ideal denoiser,
    `mean lambda(sigma) |D(x + sigma n; sigma) - D*(x + sigma n; sigma)|^2`,
    `lambda = 1 / c_out^2` (so the loss is `|F - F*|^2`: 0 for a perfect denoiser; 0.88 for
    `F = 0` conditional, 0.54 unconditional, at the default noise levels). A conditional net sees class labels, an unconditional one (`label_dim`
    0) the whole mixture. Scalar float32."""
    k_x, k_sigma, k_n = jax.random.split(rng, 3)
    x0, cls = sample_mixture(mix, k_x, batch)
    sigma = jnp.exp(P_mean + P_std * jax.random.normal(k_sigma, (batch,)))
    x = x0 + sigma[:, None] * jax.random.normal(k_n, (batch, 2))
    labels = jax.nn.one_hot(cls, net.label_dim) if net.label_dim else None
    target = ideal_denoiser(mix, x, sigma, cls if net.label_dim else None)
    D = net.apply({"params": params, "buffers": buffers}, x, sigma, labels)
    sd = net.sigma_data
    weight = (sigma**2 + sd**2) / (sigma * sd) ** 2
    return jnp.mean(weight * jnp.sum(jnp.square(D - target), -1))


def _train_chunk(net, settings, tx, mix, carry, rngs):
    def step(carry, rng):
        params, opt_state, ema_state, buffers, t = carry
        params = mp.force_normalize(params)   # forced weight normalisation (Eq. 66)
        loss, grads = jax.value_and_grad(denoiser_loss)(
            params, buffers, net, mix, rng, settings.batch, settings.P_mean, settings.P_std)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        ema_state = ema_lib.update_ema(ema_state, params, (t + 1) * settings.batch,
                                       settings.batch, sigma_rels=(settings.ema_sigma_rel,))
        return (params, opt_state, ema_state, buffers, t + 1), loss
    return jax.lax.scan(step, carry, rngs)


def train_denoiser(net: ToyDenoiser, mix: Mixture, settings: TrainSettings = TrainSettings(),
                   seed: int = 0) -> tuple[dict, np.ndarray]:
    """Train `net` on `mix` (docs/recipe.md §4: Adam betas (0.9, 0.99), inverse-sqrt
    learning rate, forced weight normalisation before each step; §5: power EMA).

    Returns `(variables, losses)`: the EMA's `{'params', 'buffers'}` and the loss of
    every step `[steps]` float32 (NumPy).
    """
    rng_init, rng_train = jax.random.split(jax.random.PRNGKey(seed))
    variables = init_denoiser(net, rng_init)
    params = mp.force_normalize(variables["params"])
    lr = lambda t: settings.ref_lr / jnp.sqrt(jnp.maximum(t / settings.t_ref, 1.0))
    tx = optax.adam(lr, b1=0.9, b2=0.99, eps=1e-8)
    ema_state = ema_lib.init_ema_state(params, (settings.ema_sigma_rel,))
    carry = (params, tx.init(params), ema_state, variables["buffers"], jnp.int32(0))
    chunk = jax.jit(functools.partial(_train_chunk, net, settings, tx))
    losses = []
    for start in range(0, settings.steps, settings.chunk):
        n = min(settings.chunk, settings.steps - start)
        rngs = jax.random.split(jax.random.fold_in(rng_train, start), n)
        carry, loss = chunk(mix, carry, rngs)
        losses.append(np.asarray(loss))
    ema_params = carry[2]["power"][ema_lib.ema_key(settings.ema_sigma_rel)]
    return {"params": ema_params, "buffers": carry[3]}, np.concatenate(losses)


def eval_loss(net: ToyDenoiser, variables: dict | None, mix: Mixture, seed: int = 123,
              n: int = 8192, P_mean: float = -2.0, P_std: float = 1.6) -> float:
    """`denoiser_loss` on `n` fresh draws; `variables=None` measures the trivial denoiser
    `D = c_skip x` (`F = 0`, the ideal denoiser of N(0, sigma_data^2 I))."""
    rng = jax.random.PRNGKey(seed)
    if variables is None:
        variables = init_denoiser(net, rng)   # its output gain starts at 0: D = c_skip x
    return float(denoiser_loss(variables["params"], variables["buffers"], net, mix, rng, n,
                               P_mean, P_std))


# ---------------------------------------------------------------------------------------
# Sampling and what the samples show.

@functools.partial(jax.jit, static_argnames=("net", "guide_net", "num_steps", "sigma_max"))
def _sample(net, variables, guide_net, guide_variables, guidance, noise, labels, num_steps,
            sigma_max):
    denoise = sampling.make_denoiser(net, variables, guide_net, guide_variables,
                                     1.0 if guide_net is None else guidance)
    return sampling.edm_sampler(denoise, noise, labels, num_steps=num_steps, sigma_max=sigma_max)


def sample_points(net: ToyDenoiser, variables: dict, n: int, cls: int | None = 0, *,
                  guide: tuple[ToyDenoiser, dict] | None = None, guidance: float = 1.0,
                  seed: int = 1, num_steps: int = 32, sigma_max: float = 5.0) -> np.ndarray:
    """`n` points from the EDM Heun sampler (`sampling.edm_sampler`) with the guided
    denoiser `D_g + w (D - D_g)` (`sampling.make_denoiser`; `guide=None` or `w = 1`:
    unguided). The guide gets the labels only if it is conditional (autoguidance); an
    unconditional guide gives CFG. Returns `[n, 2]` float32 (NumPy)."""
    noise = jax.random.normal(jax.random.PRNGKey(seed), (n, 2))
    labels = jax.nn.one_hot(jnp.full((n,), cls), net.label_dim) if net.label_dim else None
    guide_net, guide_vars = guide if guide is not None and guidance != 1 else (None, None)
    return np.asarray(_sample(net, variables, guide_net, guide_vars, jnp.float32(guidance),
                              noise, labels, num_steps, sigma_max))


def sample_metrics(mix: Mixture, x: np.ndarray, cls: int = 0, *, near: float = 0.03,
                   radius: float = 0.05, num_ref: int = 4096, seed: int = 7) -> dict:
    """What a set of samples `x [B, 2]` of class `cls` shows:

    - `on_branches`: fraction within `near` of a branch centre line of the class (the
      data itself: about 0.97 at the defaults);
    - `coverage`: fraction of `num_ref` true draws of the class with a sample within
      `radius` (variety: samples piled on a few tips cover little);
    - `mean_logp`: mean `log p(x | cls)` under the true class density (nats).
    """
    x = np.asarray(x, np.float32)
    ref, _ = sample_mixture(mix, jax.random.PRNGKey(seed), num_ref, cls)
    ref = np.asarray(ref)
    d2 = np.min(np.sum(np.square(ref[:, None, :] - x[None, :, :]), -1), axis=1)
    return {"on_branches": float(np.mean(distance_to_branches(mix, x, cls) < near)),
            "coverage": float(np.mean(d2 < radius**2)),
            "mean_logp": float(np.mean(np.asarray(log_prob(mix, x, 0.0, cls))))}


# ---------------------------------------------------------------------------------------
# The whole toy.

@dataclasses.dataclass(frozen=True)
class ToySettings:
    """The toy's three denoisers and how they are sampled (`run`).

    main: conditional, `hidden` wide, `num_blocks` blocks, `main` training; CFG guide:
    the same net unconditional, same training; autoguide: conditional,
    `guide_hidden`/`guide_blocks`, the shorter `guide` training. All sampled at the same
    `guidance` weight.
    """

    hidden: int = 64
    num_blocks: int = 3
    guide_hidden: int = 32
    guide_blocks: int = 1
    main: TrainSettings = TrainSettings()
    guide: TrainSettings = TrainSettings(steps=384)
    guidance: float = 2.5
    num_samples: int = 4096
    num_steps: int = 32

    @classmethod
    def tiny(cls) -> "ToySettings":
        """Seconds on 2 CPU cores: fewer, smaller steps and samples (tests, CI)."""
        return cls(main=TrainSettings(steps=384, t_ref=128),
                   guide=TrainSettings(steps=96, t_ref=128),
                   num_samples=1024, num_steps=16)


def run(out: str | None = None, settings: ToySettings = ToySettings(), seed: int = 0,
        verbose: bool = True) -> dict:
    """Train the main, unconditional and guide denoisers, sample class 0 unguided, with
    CFG and with autoguidance, measure them (`sample_metrics`) and, with `out`, write
    `out/toy_2d.png` (`plot_guidance`) and `out/metrics.json`.

    Returns `{'mix', 'nets': {name: (net, variables)}, 'losses': {name: [steps]},
    'samples': {name: [n, 2]}, 'metrics': {name: dict}, 'train_s', 'plot'}`; the sample
    names are 'data', 'unguided', 'cfg', 'autoguidance'.
    """
    say = print if verbose else (lambda *a, **k: None)
    mix = tree_mixture(seed=seed)
    specs = {
        "main": (ToyDenoiser(label_dim=2, hidden=settings.hidden,
                             num_blocks=settings.num_blocks), settings.main),
        "uncond": (ToyDenoiser(label_dim=0, hidden=settings.hidden,
                               num_blocks=settings.num_blocks), settings.main),
        "guide": (ToyDenoiser(label_dim=2, hidden=settings.guide_hidden,
                              num_blocks=settings.guide_blocks), settings.guide),
    }
    nets, losses = {}, {}
    t0 = time.perf_counter()
    for i, (name, (net, ts)) in enumerate(specs.items()):
        t = time.perf_counter()
        variables, losses[name] = train_denoiser(net, mix, ts, seed=seed + i)
        nets[name] = (net, variables)
        say(f"trained {name:6s} ({ts.steps} steps of {ts.batch}): final loss "
            f"{np.mean(losses[name][-32:]):.4f}  [{time.perf_counter() - t:.1f} s]")
    train_s = time.perf_counter() - t0

    net, variables = nets["main"]
    n, w, k = settings.num_samples, settings.guidance, settings.num_steps
    samples = {
        "data": np.asarray(sample_mixture(mix, jax.random.PRNGKey(seed + 11), n, 0)[0]),
        "unguided": sample_points(net, variables, n, 0, num_steps=k, seed=seed + 1),
        "cfg": sample_points(net, variables, n, 0, guide=nets["uncond"], guidance=w,
                             num_steps=k, seed=seed + 1),
        "autoguidance": sample_points(net, variables, n, 0, guide=nets["guide"], guidance=w,
                                      num_steps=k, seed=seed + 1),
    }
    metrics = {name: sample_metrics(mix, x, 0) for name, x in samples.items()}
    for name, m in metrics.items():
        say(f"{name:13s} on branches {m['on_branches']:.3f}  coverage {m['coverage']:.3f}  "
            f"mean log p {m['mean_logp']:.2f}")
    result = {"mix": mix, "nets": nets, "losses": losses, "samples": samples,
              "metrics": metrics, "train_s": train_s, "plot": None}
    if out:
        os.makedirs(out, exist_ok=True)
        result["plot"] = os.path.join(out, "toy_2d.png")
        plot_guidance(result, result["plot"], guidance=w)
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump({"guidance": w, "train_s": round(train_s, 1),
                       "settings": dataclasses.asdict(settings), "metrics": metrics}, f,
                      indent=1)
        say(f"wrote {result['plot']} and {os.path.join(out, 'metrics.json')}")
    return result


def plot_guidance(result: dict, path: str | None = None, guidance: float = 3.0,
                  sigma_field: float = 0.1, center: tuple[float, float] = (0.45, 0.45),
                  view: float = 0.95, grid: int = 24) -> Any:
    """Samples (top row) and the guided score field `(D_w(x; sigma) - x) / sigma^2` at
    `sigma_field` (bottom row) for the data, unguided, CFG and autoguidance, over the
    true class-0 density (shaded) and class 1 (grey), in the square of half-size `view`
    around `center`. Saves a PNG at `path` if given;
    returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    mix, nets, samples, metrics = (result[k] for k in ("mix", "nets", "samples", "metrics"))
    (cx, cy), v = center, view
    gx, gy = np.meshgrid(np.linspace(cx - v, cx + v, 240), np.linspace(cy - v, cy + v, 240))
    pts = np.stack([gx.ravel(), gy.ravel()], -1).astype(np.float32)
    density = jax.jit(log_prob)
    dens = [np.asarray(density(mix, pts, 0.0, c)).reshape(gx.shape) for c in (0, 1)]
    ax_, ay_ = np.meshgrid(np.linspace(cx - v, cx + v, grid), np.linspace(cy - v, cy + v, grid))
    apts = np.stack([ax_.ravel(), ay_.ravel()], -1).astype(np.float32)
    labels = jax.nn.one_hot(jnp.zeros(len(apts), jnp.int32), 2)
    net, variables = nets["main"]

    def field(guide):
        denoise = jax.jit(sampling.make_denoiser(net, variables, *(guide or (None, None)),
                                                 guidance if guide else 1.0))
        return (np.asarray(denoise(apts, sigma_field, labels)) - apts) / sigma_field**2

    fields = {"data": (np.asarray(ideal_denoiser(mix, apts, sigma_field, 0)) - apts)
              / sigma_field**2,
              "unguided": field(None), "cfg": field(nets["uncond"]),
              "autoguidance": field(nets["guide"])}
    titles = {"data": "data (class 0)", "unguided": "unguided",
              "cfg": f"CFG, w={guidance:g}", "autoguidance": f"autoguidance, w={guidance:g}"}
    fig, axes = plt.subplots(2, 4, figsize=(16, 8.4))
    for j, name in enumerate(titles):
        for ax in axes[:, j]:
            ax.contourf(gx, gy, dens[1], levels=[-1.0, 50], colors=["#e4e4e4"])
            ax.contourf(gx, gy, dens[0], levels=[-1.0, 50], colors=["#f6d7b8"])
            ax.set_xlim(cx - v, cx + v), ax.set_ylim(cy - v, cy + v)
            ax.set_aspect("equal"), ax.set_xticks([]), ax.set_yticks([])
        x = samples[name]
        axes[0, j].plot(x[:, 0], x[:, 1], ".", ms=1.5, alpha=0.35, color="k")
        m = metrics[name]
        axes[0, j].set_title(f"{titles[name]}\non branches {m['on_branches']:.2f}, "
                             f"coverage {m['coverage']:.2f}, log p {m['mean_logp']:.1f}",
                             fontsize=10)
        f = fields[name]
        norm = np.linalg.norm(f, axis=-1, keepdims=True)
        axes[1, j].quiver(apts[:, 0], apts[:, 1], *(f / np.maximum(norm, 1e-6)).T,
                          np.log1p(norm[:, 0]), cmap="viridis", scale=30, width=3e-3)
        axes[1, j].set_title(f"score field at sigma={sigma_field:g} (direction; colour: "
                             f"log(1+|score|))", fontsize=9)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=80)
    return fig


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m edm2_jax.analysis.toy", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for toy_2d.png and metrics.json")
    parser.add_argument("--tiny", action="store_true", help="seconds-long settings (tests, CI)")
    parser.add_argument("--guidance", type=float, default=None, help="guidance weight w (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    settings = ToySettings.tiny() if args.tiny else ToySettings()
    if args.guidance is not None:
        settings = dataclasses.replace(settings, guidance=args.guidance)
    import matplotlib
    matplotlib.use("Agg")
    t = time.perf_counter()
    result = run(args.out, settings, seed=args.seed)
    print(f"total {time.perf_counter() - t:.1f} s (training {result['train_s']:.1f} s)")
    return result


if __name__ == "__main__":
    main()
