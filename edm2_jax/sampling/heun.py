"""Heun's method on the probability-flow ODE as Karras et al. 2022 write it
("Elucidating the Design Space of Diffusion-Based Generative Models", Algorithms 1-2):
one step (`heun_step`, per image; the teacher's step of consistency distillation,
`objectives/distill.py`) and the whole sampler as a plain loop (`heun_sampler_reference`,
the reference that `solvers.edm_sampler`, one `fori_loop` of network evaluations, is
tested equal to)."""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from edm2_jax.sampling.guidance import Denoiser, guided_steps
from edm2_jax.sampling.solvers import (_churn_gamma, _churn_source, _denoised, _raise_noise,
                                       _sampler_interval)
from edm2_jax.sampling.schedule import RHO, SIGMA_MAX, SIGMA_MIN, edm_sigma_steps

Array = jax.Array
DenoiseFn = Callable[[Array, Array], Array]  # (x [B,H,W,C], sigma [B] or []) -> D(x; sigma)


def _bcast(v: Array, x: Array) -> Array:
    return v.reshape(v.shape + (1,) * (x.ndim - v.ndim))


def heun_step(D: DenoiseFn, x_t: Array, t: Array, r: Array) -> Array:
    """One step of the EDM sampler (Karras et al. 2022, Alg. 1) from `t` to `r < t`, per
    image (`[B]`) or for all (scalars): Heun's method on `dx/dsigma = (x - D(x; sigma)) /
    sigma`, Euler where `r = 0` (its correction would divide by 0; `D` is then evaluated
    at sigma 1 and the result discarded). Two evaluations of `D`; float32 like `x_t`."""
    d_t = (x_t - D(x_t, t)) / _bcast(t, x_t)
    x_e = x_t + _bcast(r - t, x_t) * d_t
    r_safe = jnp.where(r > 0, r, 1.0)
    d_r = (x_e - D(x_e, r_safe)) / _bcast(r_safe, x_t)
    x_h = x_t + _bcast(r - t, x_t) * (0.5 * d_t + 0.5 * d_r)
    return jnp.where(_bcast(r > 0, x_t), x_h, x_e)


def _evaluate(denoise: Denoiser, x: Array, sigma: Array, *, labels, guided: bool) -> Array:
    return _denoised(denoise, x, sigma, labels, guided)


def heun_sampler_reference(denoise: Denoiser, noise: Array, labels: Array | None = None, *,
                           num_steps: int = 32, sigma_min: float = SIGMA_MIN,
                           sigma_max: float = SIGMA_MAX, rho: float = RHO, S_churn: float = 0.0,
                           S_min: float = 0.0, S_max: float = float("inf"),
                           S_noise: float = 1.0,
                           churn_noise: Callable[[Array], Array] | None = None,
                           rng: Array | None = None,
                           guidance_interval: tuple[float, float] | None = None) -> Array:
    """The EDM sampler as Karras et al. 2022 write it (Algorithm 2; Algorithm 1 at
    `S_churn = 0`): the plain reference that `edm_sampler` is tested equal to.

    For `i = 0 .. N-1` on `t = edm_sigma_steps(...)` (float32), from `x_0 = noise * t_0`:
      gamma_i = min(S_churn / N, sqrt(2) - 1) if S_min <= t_i <= S_max else 0
      t_hat = (1 + gamma_i) t_i;  x_hat = x_i + sqrt(t_hat^2 - t_i^2) S_noise eps_i
      d = (x_hat - D(x_hat; t_hat)) / t_hat;  x_{i+1} = x_hat + (t_{i+1} - t_hat) d
      if t_{i+1} != 0:  d' = (x_{i+1} - D(x_{i+1}; t_{i+1})) / t_{i+1}
                        x_{i+1} = x_hat + (t_{i+1} - t_hat) (d / 2 + d' / 2)
    with `D` guided on the steps `guided_steps(guidance_interval, t)` (both evaluations of
    a step) and the main net alone on the others. A Python loop: traced under `jax.jit` it
    holds `2 N - 1` copies of the network, which is why `edm_sampler` runs the same
    arithmetic as one `fori_loop`. Arguments, return value (`x_N` `[B, H, W, C]` float32)
    and errors are those of `edm_sampler`.
    """
    t_host = edm_sigma_steps(num_steps, sigma_min, sigma_max, rho)
    a, b = guided_steps(_sampler_interval(denoise, guidance_interval), t_host)
    t32 = t_host.astype(np.float32)
    t = jnp.asarray(t32)
    churn = _churn_source(S_churn, churn_noise, rng, noise.shape)
    x_next = jnp.asarray(noise, jnp.float32) * t[0]
    for i in range(num_steps):
        x_cur, t_cur, t_next, guided = x_next, t[i], t[i + 1], a <= i < b
        # Churn: raise the noise level to t_hat (gamma_i = 0 leaves x and t as they are).
        x_hat, t_hat = x_cur, t_cur
        if churn is not None and np.float32(S_min) <= t32[i] <= np.float32(S_max):
            gamma_i = jnp.float32(_churn_gamma(S_churn, num_steps))
            x_hat, t_hat = _raise_noise(x_cur, t_cur, gamma_i, churn(i).astype(jnp.float32),
                                        S_noise)
        D = functools.partial(_evaluate, denoise, labels=labels, guided=guided)
        if i < num_steps - 1:  # Heun's step from t_hat to t_{i+1}
            x_next = heun_step(D, x_hat, t_hat, t_next)
        else:  # Euler's to t_N = 0 (the correction would divide by 0)
            x_next = x_hat + (t_next - t_hat) * ((x_hat - D(x_hat, t_hat)) / t_hat)
    return x_next
