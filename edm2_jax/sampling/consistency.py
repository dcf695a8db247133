"""Few-step sampling of a multistep consistency student (docs/distillation.md).

A student distilled by `objectives.distill` (multistep consistency distillation, Heek,
Hoogeboom & Salimans 2024, arXiv:2403.06807; `K = 1` is the consistency distillation of
Song et al. 2023, arXiv:2303.01469) is an EDM `Precond` network whose output `x0_hat =
D_student(x_t; t)` is the clean image that, stepped by DDIM from `t` to the end `s` of
the segment holding `t`, lands where the teacher's probability-flow ODE lands:

    ddim_step(x_t, x0_hat, t, s) = x0_hat + (s / t) (x_t - x0_hat)       (DDIM, sigma form)

which is the Euler step of the PF-ODE `dx/dsigma = (x - D(x; sigma)) / sigma` (Karras et
al. 2022, Eq. 3 with `sigma(t) = t`, `s(t) = 1`) and is exact when `x0_hat` is the
student's. The noise levels are the teacher's sampler grid: `sigma_0 .. sigma_{N-1} =
edm_sigma_steps(N, sigma_min, sigma_max, rho)` (Karras et al. 2022, Eq. 5) and
`sigma_N = 0`; `K` segments end at the grid indices `b_k = round(k N / K)`
(`segment_bounds`). Sampling takes one network evaluation per segment
(`consistency_sampler`): `x <- ddim_step(x, D(x; sigma_{b_k}), sigma_{b_k},
sigma_{b_{k+1}})`, from `x = sigma_max * noise` to `sigma_N = 0`. It is deterministic: an
image depends on its seed alone.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from edm2_jax.sampling.guidance import Denoiser
from edm2_jax.sampling.schedule import RHO, SIGMA_MAX, SIGMA_MIN, edm_sigma_steps

Array = jax.Array


def grid_sigmas(teacher_steps: int = 32, sigma_min: float = SIGMA_MIN,
                sigma_max: float = SIGMA_MAX, rho: float = RHO) -> np.ndarray:
    """The teacher's noise levels `sigma_0 > ... > sigma_{N-1} = sigma_min > sigma_N = 0`,
    `N = teacher_steps`: the EDM sampler's schedule (Karras et al. 2022, Eq. 5).

    Returns host float64 `[N + 1]`. Raises ValueError as `schedule.edm_sigma_steps`
    (`N >= 2`, `0 < sigma_min < sigma_max`, `rho > 0`)."""
    return edm_sigma_steps(teacher_steps, sigma_min, sigma_max, rho)


def segment_bounds(steps: int, teacher_steps: int) -> np.ndarray:
    """Grid indices `b_0 = 0 < b_1 < ... < b_K = N` where the `K = steps` segments of the
    `N = teacher_steps` teacher steps begin and end (`b_k = round(k N / K)`, as even as
    the division allows). Host int64 `[K + 1]`.

    Raises ValueError unless `1 <= steps <= teacher_steps`."""
    if int(steps) != steps or not 1 <= steps <= teacher_steps:
        raise ValueError(f"steps={steps}: the few-step sampler takes 1 to teacher_steps="
                         f"{teacher_steps} steps (one per segment of the teacher's grid)")
    return np.round(np.arange(steps + 1) * teacher_steps / steps).astype(np.int64)


def segment_end(i: Array, bounds: np.ndarray) -> Array:
    """For grid indices `i` (int32, any shape, `0 <= i < N`), the index `b_{k+1}` that ends
    the segment `b_k <= i < b_{k+1}` holding each."""
    b = jnp.asarray(bounds[1:], jnp.int32)
    return b[jnp.searchsorted(b, i, side="right")]


def ddim_step(x_t: Array, x0_hat: Array, t: Array, s: Array) -> Array:
    """DDIM from noise level `t` to `s < t` given the clean-image estimate `x0_hat`:
    `x0_hat + (s / t) (x_t - x0_hat)` (the PF-ODE's Euler step; arXiv:2403.06807 Alg. 1 in
    the sigma parametrisation). `t`, `s`: scalars or `[B]` (broadcast over H, W, C)."""
    ratio = jnp.asarray(s / t)
    ratio = ratio.reshape(ratio.shape + (1,) * (x_t.ndim - ratio.ndim)) if ratio.ndim else ratio
    return x0_hat + ratio * (x_t - x0_hat)


def consistency_sampler(denoise: Denoiser, noise: Array, labels: Array | None = None, *,
                        num_steps: int = 4, teacher_steps: int = 32,
                        sigma_min: float = SIGMA_MIN, sigma_max: float = SIGMA_MAX,
                        rho: float = RHO) -> Array:
    """The multistep consistency sampler (arXiv:2403.06807, Algorithm 2, deterministic):
    `num_steps` network evaluations from `x = sigma_max * noise` to a clean image.

    Args:
      denoise: `denoise(x [B,H,W,C] f32, sigma scalar f32, labels) -> x0_hat` (the
        student, e.g. `guidance.make_denoiser`; guided if that denoiser is).
      noise: `[B, H, W, C]` unit Gaussian noise (e.g. `seeds.seed_noise`).
      labels: passed to `denoise` unchanged.
      num_steps: `K`, the number of segments (and evaluations).
      teacher_steps, sigma_min, sigma_max, rho: the grid the student was distilled on
        (`grid_sigmas`).
    Returns: `x_0` `[B, H, W, C]` float32.
    Raises: ValueError for a bad grid or `num_steps` (`grid_sigmas`, `segment_bounds`).
    """
    sigmas = grid_sigmas(teacher_steps, sigma_min, sigma_max, rho)
    bounds = segment_bounds(num_steps, teacher_steps)
    # The K segments' ends [K + 1]; a loop with one traced evaluation, whatever K.
    ends = jnp.asarray(np.asarray(sigmas, np.float32)[bounds])

    def step(k, x):
        t, s = ends[k], ends[k + 1]
        return ddim_step(x, denoise(x, t, labels).astype(jnp.float32), t, s)

    x = jnp.asarray(noise, jnp.float32) * ends[0]
    return jax.lax.fori_loop(0, num_steps, step, x)
