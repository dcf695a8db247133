"""Guidance: the guided denoiser and the guidance interval (docs/recipe.md §6).

Classifier-free guidance and autoguidance share one form (Karras et al. 2024,
"Guiding a Diffusion Model with a Bad Version of Itself", arXiv:2406.02507, Eq. 1),
`D_w(x; sigma) = D_g(x; sigma) + w (D_main(x; sigma) - D_g(x; sigma))`: `make_denoiser`.
Kynkaeaenniemi et al. 2024, "Applying Guidance in a Limited Interval Improves Sample and
Distribution Quality in Diffusion Models" (arXiv:2404.07724), apply it only on the sampler
steps of a middle range of noise levels and use the main net alone on the others:
`guided_steps` says which steps of a schedule those are; the sampler it is given to
(`solvers.edm_sampler(guidance_interval=...)`) runs them.

    denoise = make_denoiser(net, variables, guide_net, guide_variables, guidance=2.0)
    x0 = edm_sampler(denoise, noise, labels, guidance_interval=(0.28, 1.61))
    # guided on steps 17-22 of 32 only
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Denoiser = Callable[[Array, Array, "Array | None"], Array]


def guided_steps(guidance_interval: tuple[float, float] | None,
                 t_steps: np.ndarray) -> tuple[int, int]:
    """The sampler steps that use guidance, `range(a, b)` of step indices, as `(a, b)`.

    Guidance interval (arXiv:2404.07724, Sec. 3 and the authors' sampler): step `i` (from
    `t_i` to `t_{i+1}`) uses the guided denoiser for both of its evaluations (at `t_hat_i`
    and the Heun correction at `t_{i+1}`, even when `t_{i+1} <= sigma_lo`) iff

        sigma_lo < t_i <= sigma_hi,

    with `t_i` the step's noise level before churn, in float64 as `edm_sigma_steps` gives
    it; every other step uses the main net alone. The authors give the interval as step
    indices of the default 32-step schedule (`sigma_min=0.002, sigma_max=80, rho=7`): their
    EDM2-XXL FID setting, steps [17, 22], is `(0.28, 1.61]` (`t_16 = 2.174`,
    `t_17 = 1.6086`, `t_22 = 0.2830`, `t_23 = 0.1886`); their FD_DINOv2 setting, steps
    [13, 19], is `(0.60, 5.0]` (`t_12 = 6.464`, `t_13 = 4.9991`, `t_19 = 0.8446`,
    `t_20 = 0.5977`). On a decreasing schedule the guided steps are one contiguous range.

    Args:
      guidance_interval: `(sigma_lo, sigma_hi)`, `0 <= sigma_lo < sigma_hi` (`sigma_hi`
        may be inf; `(0, inf)` guides every step); None guides every step.
      t_steps: the decreasing schedule `[N + 1]` (`edm_sigma_steps`), `t_N = 0`.
    Returns: `(a, b)` ints, `0 <= a <= b <= N`; `a == b` when no step is guided.
    Raises: ValueError unless the interval is two numbers with `0 <= sigma_lo < sigma_hi`.
    """
    n = len(t_steps) - 1
    if guidance_interval is None:
        return 0, n
    lo, hi = check_guidance_interval(guidance_interval)
    t = np.asarray(t_steps[:n], np.float64)
    idx = np.flatnonzero((lo < t) & (t <= hi))
    if len(idx) and np.any(np.diff(idx) != 1):
        raise ValueError("guided_steps needs a decreasing schedule (edm_sigma_steps)")
    return (int(idx[0]), int(idx[-1]) + 1) if len(idx) else (0, 0)


def check_guidance_interval(guidance_interval: Any) -> tuple[float, float] | None:
    """`(sigma_lo, sigma_hi)` as a hashable tuple of two Python floats, or None for None.
    Raises: ValueError unless two numbers with `0 <= sigma_lo < sigma_hi` (NaN fails)."""
    if guidance_interval is None:
        return None
    try:
        lo, hi = (float(v) for v in guidance_interval)
    except (TypeError, ValueError):
        raise ValueError(f"guidance_interval={guidance_interval!r}: give two noise levels "
                         f"(sigma_lo, sigma_hi), e.g. (0.28, 1.61)") from None
    if not 0 <= lo < hi:
        raise ValueError(f"guidance_interval=({lo:g}, {hi:g}) needs 0 <= sigma_lo < sigma_hi; "
                         f"e.g. (0.28, 1.61) guides steps 17-22 of the default 32")
    return lo, hi


def make_denoiser(net: Any, variables: Any, guide_net: Any = None, guide_variables: Any = None,
                  guidance: float = 1.0) -> Denoiser:
    """Guided denoiser `D_g + w (D_main - D_g)` (arXiv:2406.02507, Eq. 1), `w = guidance`.

    `net`, `guide_net` are `Precond` modules with their `{'params', 'buffers'}`. The guide
    gets the labels only if it is conditional (`label_dim > 0`, autoguidance with a
    smaller / less-trained version of the main model); an unconditional guide
    (`label_dim == 0`) gives classifier-free guidance. With a Python `guidance == 1` (or
    no guide) the result is the main model alone and the guide is never evaluated;
    `guidance` may also be a scalar array (e.g. traced, to sweep it without recompiling).

    Returns: `denoise(x [B,H,W,C], sigma scalar or [B], labels [B,L] | None, guided=True)
      -> D` float32; `guided=False` (a Python bool) gives the main model alone without
      evaluating the guide (the unguided steps of a guidance interval, which the sampler
      is given: `solvers.edm_sampler(guidance_interval=...)`).
    Raises: ValueError when `guidance != 1` without a guide, or a guide without variables.
    """
    static_w = isinstance(guidance, (int, float))  # else an array: traced, no recompiles
    use_guide = guide_net is not None and (not static_w or guidance != 1)
    if guide_net is None and (not static_w or guidance != 1):
        raise ValueError(f"guidance={guidance} needs a guide: pass guide_net and "
                         "guide_variables, or use guidance=1.0")
    if guide_net is not None and guide_variables is None:
        raise ValueError("guide_net given without guide_variables; pass both")

    def denoise(x, sigma, labels=None, guided=True):
        sigma = jnp.broadcast_to(jnp.asarray(sigma, jnp.float32).reshape(-1), (x.shape[0],))
        D = net.apply(variables, x, sigma, labels).astype(jnp.float32)
        if not (use_guide and guided):
            return D
        g_labels = labels if guide_net.label_dim else None
        D_g = guide_net.apply(guide_variables, x, sigma, g_labels).astype(jnp.float32)
        return D_g + guidance * (D - D_g)

    return denoise
