"""The noise levels of the EDM sampler (Karras et al. 2022, Eq. 5): the one definition,
shared by the Heun sampler (`sampler.py`) and the few-step sampler's grid
(`consistency.py`)."""
from __future__ import annotations

import numpy as np

# The EDM schedule's defaults (Karras et al. 2022, Table 1: sigma_min 0.002, sigma_max 80,
# rho 7), the one source of these values for every sampler and grid.
SIGMA_MIN, SIGMA_MAX, RHO = 0.002, 80.0, 7.0


def edm_sigma_steps(num_steps: int = 32, sigma_min: float = SIGMA_MIN,
                    sigma_max: float = SIGMA_MAX, rho: float = RHO) -> np.ndarray:
    """Noise levels of the EDM sampler (Karras et al. 2022, Eq. 5), with `t_N = 0`.

    `t_i = (sigma_max^(1/rho) + i / (N-1) (sigma_min^(1/rho) - sigma_max^(1/rho)))^rho`
    for `i = 0..N-1`, so `t_0 = sigma_max`, `t_{N-1} = sigma_min`, then `t_N = 0`.

    Returns: host float64 array `[num_steps + 1]`, decreasing.
    Raises: ValueError if `num_steps < 2` (the formula divides by `N - 1`) or unless
      `0 < sigma_min < sigma_max` and `rho > 0`.
    """
    if int(num_steps) != num_steps or num_steps < 2:
        raise ValueError(f"num_steps must be an integer >= 2, got {num_steps}")
    if not 0 < sigma_min < sigma_max:
        raise ValueError(f"need 0 < sigma_min < sigma_max, got {sigma_min}, {sigma_max}")
    if not rho > 0:
        raise ValueError(f"rho must be > 0, got {rho}")
    i = np.arange(num_steps, dtype=np.float64)
    a, b = sigma_max ** (1 / rho), sigma_min ** (1 / rho)
    t = (a + i / (num_steps - 1) * (b - a)) ** rho
    return np.concatenate([t, [0.0]])
