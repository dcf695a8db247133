"""The EDM2 training loss with learned uncertainty (paper Sec. 2, Eqs. 14-16 and 21).

For a clean image `y`, noise level `sigma` with `ln sigma ~ N(P_mean, P_std^2)` and unit
Gaussian noise `n`, the per-element loss is

    weight = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2          (EDM lambda(sigma))
    loss   = weight / exp(logvar(sigma)) * (D(y + n sigma, sigma) - y)^2 + logvar(sigma)

with `logvar` the network's uncertainty head. What a run minimises is the per-image sum
of `loss` over pixels and channels, summed over the batch and divided by the global batch
size (the release's `EDM2Loss`, `sum(loss) / batch`).

`uncertainty_loss` is Eq. 21 of the network's outputs (also the distillation objectives'
loss) and `weighted_mse` its inverse; `edm2_loss` is the whole EDM2 loss, from the
network, the images and the step's random draws to the scalar the training step
differentiates; `loss_metrics` the means it logs.

Everything here is a pure function. Forced weight normalisation is *not* applied here:
the training step calls `edm2_jax.model.mp.force_normalize(params)` first and differentiates
the loss at the normalised weights (docs/recipe.md §4, "order inside one step").
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def loss_weight(sigma: Array, sigma_data: float = 0.5) -> Array:
    """EDM loss weight `lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2`
    (= 1 / c_out^2, which gives the network target unit variance). Same shape as `sigma`."""
    return (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2


def uncertainty_loss(denoised: Array, images: Array, sigma: Array, logvar: Array,
                     sigma_data: float = 0.5) -> Array:
    """The per-element loss with learned uncertainty (Eq. 21),
    `weight(sigma) / exp(logvar) * (D - y)^2 + logvar`, of the denoised images `D` and
    the clean images `y` (`[B, H, W, C]`), the noise levels `sigma` and the network's
    `logvar` (`[B]`). Returns float32 `[B, H, W, C]`."""
    lv = logvar.astype(jnp.float32)[:, None, None, None]
    weight = loss_weight(sigma[:, None, None, None], sigma_data)
    return weight / jnp.exp(lv) * jnp.square(denoised.astype(jnp.float32) - images) + lv


def edm2_loss(params: Any, buffers: Any, net: Any, images: Array, labels: Array | None, *,
              rnd_normal: Array, noise_unit: Array, P_mean: float, P_std: float,
              sigma_data: float = 0.5, train: bool = True, dropout_rng: Array | None = None,
              batch_size: int | None = None) -> tuple[Array, dict[str, Array]]:
    """The EDM2 loss (Eqs. 14-16 and 21; the release's `EDM2Loss`): the noise level
    `sigma = exp(rnd_normal P_std + P_mean)` (Eq. 14's `ln sigma ~ N(P_mean, P_std^2)`),
    the network at `y + noise_unit sigma`, its per-element Eq. 21 loss
    (`uncertainty_loss`), summed over pixels, channels and the batch and divided by
    `batch_size`. Ready for `jax.value_and_grad(edm2_loss, has_aux=True)`.

    Args:
      params, buffers: the `Precond` variables (`{'params': params, 'buffers': buffers}`);
        pass the force-normalised online weights during training.
      net: a `networks.Precond` module.
      images: clean images `y`, `[B, H, W, C]`, any float dtype (cast to float32), in the
        network's data scale (pixels in [-1, 1] or latents).
      labels: `[B, label_dim]` one-hot / soft labels, or None (unconditional).
      rnd_normal: `[B]` (or any shape with B elements) standard normal draws of the noise
        levels (`Objective.draws`).
      noise_unit: `[B, H, W, C]` unit Gaussian noise; `noise = noise_unit * sigma`.
      P_mean, P_std: log-normal noise-level distribution, `ln sigma ~ N(P_mean, P_std^2)`.
      sigma_data: data standard deviation (0.5).
      train: forwarded to the net (enables dropout).
      dropout_rng: key of the net's `'dropout'` rng stream, or None (no dropout draws).
      batch_size: the global batch size, default this batch's (the objective is then the
        mean per-image loss). With micro-batch gradient accumulation the global one: the
        micro-batches' losses then sum to the batch's.

    Returns:
      `(objective, aux)`: `objective` a float32 scalar; `aux` `loss_metrics`' means
      over this batch.

    Raises:
      ValueError: images not NHWC, or a draw of the wrong shape.
    """
    images = jnp.asarray(images, jnp.float32)
    if images.ndim != 4:
        raise ValueError(f"edm2_loss: images must be NHWC [B, H, W, C], got shape {images.shape}")
    batch = images.shape[0]
    rnd_normal = jnp.asarray(rnd_normal, jnp.float32)
    if rnd_normal.size != batch:
        raise ValueError(f"edm2_loss: rnd_normal must have B={batch} elements, "
                         f"got shape {rnd_normal.shape}")
    sigma = jnp.exp(rnd_normal.reshape(batch) * P_std + P_mean)
    noise_unit = jnp.asarray(noise_unit, jnp.float32)
    if noise_unit.shape != images.shape:
        raise ValueError(f"edm2_loss: noise_unit must have the images' shape {images.shape} "
                         f"(NHWC), got {noise_unit.shape}")

    rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
    denoised, logvar = net.apply(
        {"params": params, "buffers": buffers}, images + noise_unit * sigma[:, None, None, None],
        sigma, labels, train=train, return_logvar=True, rngs=rngs)
    loss = uncertainty_loss(denoised, images, sigma, logvar, sigma_data)
    per_image = jnp.sum(loss, axis=(1, 2, 3))
    aux = loss_metrics(loss, logvar.astype(jnp.float32), sigma)
    n = batch if batch_size is None else batch_size
    return jnp.sum(per_image) / n, aux


def weighted_mse(loss: Any, logvar: Any) -> Any:
    """The weighted MSE `weight * (D - y)^2` that a value of the Eq. 21 loss holds:
    `(loss - logvar) * exp(logvar)`, for `loss` and `logvar` of broadcastable shapes. JAX
    arrays give JAX arrays; NumPy arrays and Python floats (logged records) stay NumPy,
    in their own precision."""
    exp = jnp.exp if isinstance(loss, jax.Array) or isinstance(logvar, jax.Array) else np.exp
    return (loss - logvar) * exp(logvar)


def loss_metrics(loss: Array, logvar: Array, sigma: Array) -> dict[str, Array]:
    """The logged means of a batch's Eq. 21 loss: `loss` (per element, the release's
    `Loss/loss`), `weighted_mse` (`weight * (D - y)^2` per element), `logvar`, `sigma`
    (mean noise level), `log_sigma`; from the per-element `loss` `[B, H, W, C]`, the
    per-image `logvar` `[B]` and noise levels `sigma` `[B]`. float32 scalars."""
    return {
        "loss": jnp.mean(loss),
        "weighted_mse": jnp.mean(weighted_mse(loss, logvar[:, None, None, None])),
        "logvar": jnp.mean(logvar),
        "sigma": jnp.mean(sigma),
        "log_sigma": jnp.mean(jnp.log(sigma)),
    }
