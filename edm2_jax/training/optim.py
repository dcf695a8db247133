"""EDM2 optimiser: force-finite, optional global-norm clipping, Adam, inverse-sqrt schedule.

Paper Sec. 2.4 / docs/recipe.md §4: Adam with betas (0.9, 0.99), eps 1e-8, no weight decay;
learning rate `lr = ref_lr / sqrt(max(t / t_ref, 1))` with `t = nimg / batch_size` (in
batches), times a linear ramp-up `min(nimg / rampup_nimg, 1)`.

The learning rate is a function of `nimg` (training images seen *before* the step, as in
the release's loop), passed explicitly to every update as an optax extra argument:

    tx = make_optimizer(cfg.optim, cfg.batch_size)
    opt_state = tx.init(params)
    ...
    params = mp.force_normalize(params)                   # forced weight normalisation
    grads = jax.grad(objective)(params)                   # at the normalised weights
    updates, opt_state = tx.update(grads, opt_state, params, nimg=nimg)
    params = optax.apply_updates(params, updates)         # Adam step on normalised weights
    ema_state = ema.update_ema(ema_state, params, nimg + batch_size, batch_size, ...)
    nimg += batch_size

It never uses optax's own step counter for the schedule, so it is exact for resumed runs
and for any batch-size history. (Adam's bias correction does use its own count, which
is the number of optimiser steps taken, as in torch.optim.Adam.)
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from edm2_jax.model import presets

Array = jax.Array


def learning_rate(nimg: Any, *, batch_size: int, ref_lr: float, t_ref: float,
                  rampup_kimg: float, xp: Any = jnp) -> Array:
    """EDM2 learning-rate schedule (paper Eq. 13 region, Sec. 2.4; release
    `learning_rate_schedule`).

    `lr = ref_lr / sqrt(max(t / t_ref, 1)) * min(nimg / (1000 rampup_kimg), 1)` with
    `t = nimg / batch_size`. `t_ref <= 0` disables the decay, `rampup_kimg <= 0` the
    ramp-up. At `nimg = 0` with a ramp-up the learning rate is 0.

    Args:
      nimg: training images seen before this step; Python/NumPy number or a (traced) JAX
        scalar of any numeric dtype (computed in float32; note int32 `nimg` overflows at
        2^31 images, so keep it int64 on the host or float32 on device for long runs).
      batch_size: images per optimiser step (global batch).
      ref_lr: base learning rate (alpha_ref).
      t_ref: decay start in batches (70k for img512, 35k for img64).
      rampup_kimg: ramp-up length in kimg (the release uses 10 Mimg = 10,000 kimg).
      xp: `jax.numpy` (the step's float32 schedule) or `numpy` (the same formula in
        float64 on the host, e.g. a config's learning rate at a given image count).
    Returns: float32 scalar (JAX array); with `xp=numpy` a float64 NumPy scalar.
    """
    if batch_size <= 0:
        raise ValueError(f"learning_rate: batch_size must be positive, got {batch_size}")
    dtype = xp.float32 if xp is jnp else xp.float64
    nimg = xp.asarray(nimg, dtype)
    lr = xp.asarray(ref_lr, dtype)
    if t_ref > 0:
        lr = lr / xp.sqrt(xp.maximum(nimg / (float(t_ref) * batch_size), 1.0))
    if rampup_kimg > 0:
        lr = lr * xp.minimum(nimg / (float(rampup_kimg) * 1e3), 1.0)
    return lr


def force_finite() -> optax.GradientTransformation:
    """Replace every non-finite gradient entry (NaN, +inf, -inf) by 0 (release
    `force_finite`, `nan_to_num(nan=0, posinf=0, neginf=0)`). Stateless.

    (`optax.zero_nans` only handles NaN, hence this transform.)
    """
    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        updates = jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, jnp.zeros_like(g)),
                               updates)
        return updates, state

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_nimg_schedule(lr_fn: Callable[[Any], Array]) -> optax.GradientTransformationExtraArgs:
    """Multiply updates by `-lr_fn(nimg)`, where `nimg` is a required keyword extra argument
    of `update` (`tx.update(grads, state, params, nimg=nimg)`). Stateless.

    Raises ValueError from `update` if `nimg` is not given.
    """
    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, nimg=None, **extra_args):
        del params, extra_args
        if nimg is None:
            raise ValueError("EDM2 optimiser: call tx.update(grads, opt_state, params, nimg=nimg) "
                             "with nimg = training images seen before this step")
        lr = lr_fn(nimg)
        updates = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates)
        return updates, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _get(cfg: Any, key: str, default: Any) -> Any:
    try:
        return cfg[key]
    except (KeyError, AttributeError):
        return default


def _stateless_update(tx: optax.GradientTransformation) -> Callable:
    """`update_fn` of a chain of stateless transforms behind one EmptyState."""
    def update_fn(updates, state, params=None):
        return tx.update(updates, tx.init(updates), params)[0], state
    return update_fn


def learning_rate_schedule(optim_cfg: Any, batch_size: int) -> Callable[[Any], Array]:
    """`nimg -> learning rate` of `optim_cfg` (`learning_rate` with its `ref_lr`, `t_ref`,
    `rampup_kimg`): the schedule `make_optimizer`'s chain applies, and the training step
    logs. Raises KeyError naming a missing field."""
    for key in ("ref_lr", "t_ref", "rampup_kimg"):
        if _get(optim_cfg, key, None) is None:
            raise KeyError(f"make_optimizer: optim config needs {key!r} "
                           "(see configs.base_config().optim)")
    ref_lr = float(optim_cfg["ref_lr"])
    t_ref = float(optim_cfg["t_ref"])
    rampup_kimg = float(optim_cfg["rampup_kimg"])

    def lr_fn(nimg):
        return learning_rate(nimg, batch_size=batch_size, ref_lr=ref_lr, t_ref=t_ref,
                             rampup_kimg=rampup_kimg)

    return lr_fn


def make_optimizer(optim_cfg: Any, batch_size: int,
                   lr_fn: Callable[[Any], Array] | None = None
                   ) -> optax.GradientTransformationExtraArgs:
    """The EDM2 optimiser as one optax chain.

    Chain: `force_finite()` -> `clip_by_global_norm(grad_clip)` (only if `grad_clip > 0`;
    both in one stateless element, so the state's arrays do not depend on `grad_clip`) ->
    `scale_by_adam(beta1, beta2, eps)` -> `scale_by_nimg_schedule(learning_rate_schedule)`.
    Force-finite comes first so that a single inf/NaN entry cannot turn the global norm
    (and thus every clipped gradient) non-finite.

    Args:
      optim_cfg: mapping / ConfigDict with `ref_lr`, `t_ref` (batches), `rampup_kimg`, and
        optionally `beta1` (0.9), `beta2` (0.99), `eps` (1e-8), `grad_clip` (0 = off).
      batch_size: global batch size (images per step), for `t = nimg / batch_size`.
      lr_fn: the schedule to apply (default `learning_rate_schedule(optim_cfg,
        batch_size)`): the training set-up passes the one the step logs.
    Returns:
      `optax.GradientTransformationExtraArgs`; use
      `updates, opt_state = tx.update(grads, opt_state, params, nimg=nimg)`, then
      `optax.apply_updates(params, updates)`. `nimg` = images seen before the step.
    Raises:
      KeyError naming a missing required field.
    """
    lr_fn = lr_fn or learning_rate_schedule(optim_cfg, batch_size)
    grad_clip = float(_get(optim_cfg, "grad_clip", 0.0) or 0.0)

    # The clip, when on, is chained *inside* one stateless element: the optimiser state
    # then has the same arrays whatever grad_clip is, so that it may change on resume
    # (`resume.CHANGEABLE_ON_RESUME`; the rescue of a diverged run).
    first = force_finite()
    if grad_clip > 0:
        first = optax.chain(first, optax.clip_by_global_norm(grad_clip))
        first = optax.GradientTransformation(lambda params: optax.EmptyState(),
                                             _stateless_update(first))
    chain = [first]
    adam = {k: float(_get(optim_cfg, k, v)) for k, v in presets.ADAM.items()}
    chain.append(optax.scale_by_adam(b1=adam["beta1"], b2=adam["beta2"], eps=adam["eps"]))
    chain.append(scale_by_nimg_schedule(lr_fn))
    return optax.chain(*chain)
