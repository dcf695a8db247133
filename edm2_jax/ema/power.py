"""Power-function EMA and traditional EMA of the training weights (paper Sec. 3, App. C).

A power-function EMA with exponent `gamma` averages the weights seen up to time `t` with
the profile `p_t(tau) ∝ tau^gamma`; its relative width is
`sigma_rel = sqrt((gamma+1) / ((gamma+2)^2 (gamma+3)))` (Eq. 123). Tracked during training
with `beta = (1 - dt/t)^(gamma+1)` (Eq. 127), `t` = images seen *after* the step and `dt` =
batch size, so the first update (t = dt) copies the weights.

The EMA state is a plain pytree of params-shaped trees:

    {'power': {'0.050': params_like, '0.100': params_like},   # keys '%.3f' % sigma_rel
     'traditional': params_like}                               # only if trad_halflife_kimg > 0

EMAs cover the trainable `params` only (the fixed MPFourier `buffers` are shared with the
online network) and are never force-normalised.

`sigma_rel_to_gamma` / `gamma_to_sigma_rel` are NumPy float64 (host, config time);
`power_ema_beta`, `traditional_ema_beta` and `update_ema` are jittable float32 JAX code.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# sigma_rel(gamma) peaks at gamma = (sqrt(5) - 3) / 2 (d/dgamma of Eq. 123 vanishes there);
# larger sigma_rel values have no power-function profile.
_GAMMA_AT_MAX = (math.sqrt(5.0) - 3.0) / 2.0


def gamma_to_sigma_rel(gamma: Any) -> np.ndarray:
    """Relative standard deviation of the power-function EMA profile (Eq. 123).

    `sigma_rel = sqrt((gamma+1) / ((gamma+2)^2 (gamma+3)))`; `gamma` scalar or array
    (> -1), returns float64 of the same shape.
    """
    g = np.asarray(gamma, np.float64)
    return np.sqrt((g + 1) / ((g + 2) ** 2 * (g + 3)))


SIGMA_REL_MAX = float(gamma_to_sigma_rel(_GAMMA_AT_MAX))  # ~0.3003


def sigma_rel_to_gamma(sigma_rel: Any) -> np.ndarray:
    """Exponent `gamma` of the power-function EMA with relative width `sigma_rel`
    (Eq. 126, Algorithm 2): the largest real root of
    `gamma^3 + 7 gamma^2 + (16 - sigma_rel^-2) gamma + (12 - sigma_rel^-2) = 0`.

    NumPy float64, scalar or array in, same shape out (e.g. 0.05 -> 16.97, 0.10 -> 6.94).
    Raises ValueError unless every `sigma_rel` is in `(0, SIGMA_REL_MAX ~ 0.3003]`.
    """
    s = np.asarray(sigma_rel, np.float64)
    if np.any(~np.isfinite(s)) or np.any(s <= 0) or np.any(s > SIGMA_REL_MAX * (1 + 1e-12)):
        raise ValueError(f"sigma_rel must be in (0, {SIGMA_REL_MAX:.4f}] (the widest "
                         f"power-function profile), got {sigma_rel}")
    c = s.reshape(-1) ** -2
    gamma = [np.roots([1.0, 7.0, 16.0 - ci, 12.0 - ci]).real.max() for ci in c]
    return np.asarray(gamma, np.float64).reshape(s.shape)


def ema_key(sigma_rel: float) -> str:
    """Key of a power EMA in the state dict and snapshot names: `'%.3f' % sigma_rel`."""
    return f"{sigma_rel:.3f}"


def _log_power_beta(nimg_after: Any, batch_size: Any, gamma: float) -> Array:
    t = jnp.asarray(nimg_after, jnp.float32)
    dt = jnp.asarray(batch_size, jnp.float32)
    # log1p keeps 1 - beta accurate in float32 when dt/t ~ 1e-6 late in training.
    return (gamma + 1.0) * jnp.log1p(-dt / t)


def _check_times(nimg_after: Any, batch_size: Any) -> None:
    if isinstance(nimg_after, jax.core.Tracer) or isinstance(batch_size, jax.core.Tracer):
        return
    t, dt = np.asarray(nimg_after), np.asarray(batch_size)
    if np.any(dt <= 0) or np.any(t < dt):
        raise ValueError(f"EMA update needs batch_size > 0 and nimg_after >= batch_size "
                         f"(nimg_after counts images seen after the step), got "
                         f"nimg_after={nimg_after}, batch_size={batch_size}")


def power_ema_beta(nimg_after: Any, batch_size: Any, gamma: float) -> Array:
    """EMA decay `beta = (1 - dt/t)^(gamma+1)` for a power-function EMA (Eq. 127).

    Args:
      nimg_after: `t`, training images seen after this step (>= batch_size); any numeric
        scalar or array, traced or not.
      batch_size: `dt`, images in this step.
      gamma: EMA exponent (static float; see `sigma_rel_to_gamma`).
    Returns: float32, broadcast shape of the inputs; 0 at `t = dt` (the first update copies).
    Raises ValueError for concrete `nimg_after < batch_size` or `batch_size <= 0`.
    """
    _check_times(nimg_after, batch_size)
    return jnp.exp(_log_power_beta(nimg_after, batch_size, gamma))


def _log_traditional_beta(nimg_after: Any, batch_size: Any, halflife_kimg: float,
                          rampup_ratio: float | None) -> Array:
    halflife = jnp.asarray(halflife_kimg * 1e3, jnp.float32)
    if rampup_ratio is not None:
        halflife = jnp.minimum(halflife, jnp.asarray(nimg_after, jnp.float32) * rampup_ratio)
    dt = jnp.asarray(batch_size, jnp.float32)
    return dt / jnp.maximum(halflife, 1e-8) * math.log(0.5)


def traditional_ema_beta(nimg_after: Any, batch_size: Any, halflife_kimg: float,
                         rampup_ratio: float | None = 0.09) -> Array:
    """Decay of the traditional (exponential) EMA, as the release's `TraditionalEMA`.

    Half-life `h = 1000 halflife_kimg` images, capped during ramp-up at
    `rampup_ratio * nimg_after` (None disables the cap); `beta = 0.5^(dt / max(h, 1e-8))`.
    Returns float32 of the broadcast input shape.
    """
    _check_times(nimg_after, batch_size)
    return jnp.exp(_log_traditional_beta(nimg_after, batch_size, halflife_kimg, rampup_ratio))


def _copy(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def init_ema_state(params: Any, sigma_rels: Sequence[float],
                   trad_halflife_kimg: float = 0.0) -> dict:
    """EMA state with every EMA initialised to a copy of `params`.

    Args:
      params: the online trainable params pytree.
      sigma_rels: relative widths of the tracked power EMAs (release default 0.05, 0.10).
      trad_halflife_kimg: half-life of a traditional EMA in kimg; <= 0 means none.
    Returns: `{'power': {ema_key(s): params_copy, ...}[, 'traditional': params_copy]}`.
    Raises ValueError if two sigma_rels share a key or one is out of range.
    """
    keys = [ema_key(s) for s in sigma_rels]
    if len(set(keys)) != len(keys):
        raise ValueError(f"sigma_rels {list(sigma_rels)} collide in their '%.3f' keys {keys}; "
                         "use sigma_rels that differ in the first 3 decimals")
    sigma_rel_to_gamma(list(sigma_rels))  # validates the range
    state = {"power": {k: _copy(params) for k in keys}}
    if trad_halflife_kimg > 0:
        state["traditional"] = _copy(params)
    return state


def _lerp(ema: Any, params: Any, weight: Array) -> Any:
    # ema + (1 - beta) (theta - ema) == beta ema + (1 - beta) theta, without rounding beta.
    return jax.tree.map(lambda e, p: (e + weight.astype(e.dtype) * (p.astype(e.dtype) - e)),
                        ema, params)


def update_ema(ema_state: dict, params: Any, nimg_after: Any, batch_size: Any, *,
               sigma_rels: Sequence[float], trad_halflife_kimg: float = 0.0,
               trad_rampup_ratio: float | None = 0.09) -> dict:
    """One EMA update with the post-Adam weights (pure, jittable; docs/recipe.md §5).

    `ema <- beta ema + (1 - beta) params` for each power EMA with
    `beta = power_ema_beta(nimg_after, batch_size, sigma_rel_to_gamma(sigma_rel))`, and for
    the traditional EMA with `traditional_ema_beta(...)`. `1 - beta` is evaluated as
    `-expm1(log beta)` so that late-training updates (`1 - beta ~ 1e-5`) stay accurate in
    float32.

    Args:
      ema_state: from `init_ema_state` (same `sigma_rels` / `trad_halflife_kimg`).
      params: online params after the optimiser step (same tree structure).
      nimg_after: images seen after this step (`nimg + batch_size`); may be traced.
      batch_size: images in this step.
      sigma_rels, trad_halflife_kimg, trad_rampup_ratio: static EMA settings (the fields of
        `configs.base_config().ema`, so `update_ema(..., **cfg.ema)` works).
    Returns: the new EMA state (same structure).
    Raises ValueError if `ema_state` keys do not match `sigma_rels` / `trad_halflife_kimg`.
    """
    _check_times(nimg_after, batch_size)
    want = sorted(ema_key(s) for s in sigma_rels)
    have = sorted(ema_state.get("power", {}))
    if want != have:
        raise ValueError(f"update_ema: ema_state has power EMAs {have} but sigma_rels give "
                         f"{want}; build the state with init_ema_state(params, sigma_rels)")
    if (trad_halflife_kimg > 0) != ("traditional" in ema_state):
        raise ValueError("update_ema: a traditional EMA is in ema_state iff "
                         "trad_halflife_kimg > 0; build the state with the same "
                         "trad_halflife_kimg")
    new = {"power": {}}
    for s in sigma_rels:
        gamma = float(sigma_rel_to_gamma(s))
        weight = -jnp.expm1(_log_power_beta(nimg_after, batch_size, gamma))
        new["power"][ema_key(s)] = _lerp(ema_state["power"][ema_key(s)], params, weight)
    if trad_halflife_kimg > 0:
        weight = -jnp.expm1(_log_traditional_beta(nimg_after, batch_size, trad_halflife_kimg,
                                                  trad_rampup_ratio))
        new["traditional"] = _lerp(ema_state["traditional"], params, weight)
    return new
