"""EDM2 training loss with the learned uncertainty weighting (paper Sec. 2, Eq. 14-16, 21).

For a clean image `y`, noise level `sigma` and unit Gaussian noise `n`, the per-element
loss is

    weight = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2          (EDM lambda(sigma))
    loss   = weight / exp(logvar(sigma)) * (D(y + n sigma, sigma) - y)^2 + logvar(sigma)

with `ln sigma ~ N(P_mean, P_std^2)` and `logvar` the network's uncertainty head. The
training objective is the per-image sum of `loss` over pixels and channels, averaged over
the batch (`objective = mean(per_image_loss)`, i.e. `sum(loss) / batch` as in the release).

Owns the loss and the training objective: `uncertainty_loss` (Eq. 21 of the network's
outputs) and its inverse `weighted_mse`, `edm2_loss_per_element` (the one signature:
variables, network, images, labels and the random draws), `edm2_loss` (per image, with
the logged means) and `edm2_objective` (the scalar the training step differentiates).

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


def sample_sigma(rng: Array, n: int, P_mean: float, P_std: float) -> Array:
    """Draw `n` training noise levels with `ln sigma ~ N(P_mean, P_std^2)` (Eq. 14 setting).

    Returns `[n]` float32, `sigma = exp(P_mean + P_std * N(0, 1))`.
    """
    rnd_normal = jax.random.normal(rng, (n,), jnp.float32)
    return jnp.exp(rnd_normal * P_std + P_mean)


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


def weighted_mse(loss: Any, logvar: Any) -> Any:
    """The weighted MSE `weight * (D - y)^2` that a value of the Eq. 21 loss holds:
    `(loss - logvar) * exp(logvar)`, for `loss` and `logvar` of broadcastable shapes. JAX
    arrays give JAX arrays; NumPy arrays and Python floats (logged records) stay NumPy,
    in their own precision."""
    exp = jnp.exp if isinstance(loss, jax.Array) or isinstance(logvar, jax.Array) else np.exp
    return (loss - logvar) * exp(logvar)


def edm2_loss_per_element(
    params: Any,
    buffers: Any,
    net: Any,
    images: Array,
    labels: Array | None,
    rng: Array | None = None,
    *,
    P_mean: float,
    P_std: float,
    sigma_data: float = 0.5,
    train: bool = True,
    rnd_normal: Array | None = None,
    noise_unit: Array | None = None,
    dropout_rng: Array | None = None,
) -> tuple[Array, Array, Array]:
    """Per-element EDM2 loss (Eq. 21 of the paper's appendix; release `EDM2Loss`).

    Args:
      params, buffers: the `Precond` variables (`{'params': params, 'buffers': buffers}`);
        pass the force-normalised online weights during training.
      net: a `networks.Precond` module.
      images: clean images `y`, `[B, H, W, C]`, any float dtype (cast to float32), in the
        network's data scale (pixels in [-1, 1] or latents).
      labels: `[B, label_dim]` one-hot / soft labels, or None (unconditional).
      rng: PRNG key; split into (sigma, noise, dropout) keys. Needed unless both
        `rnd_normal` and `noise_unit` are given (and, for a net with dropout in training,
        `dropout_rng`).
      P_mean, P_std: log-normal noise-level distribution, `ln sigma ~ N(P_mean, P_std^2)`.
      sigma_data: data standard deviation (0.5).
      train: forwarded to the net (enables dropout).
      rnd_normal: optional `[B]` (or any shape with B elements) standard normal draws;
        `sigma = exp(rnd_normal * P_std + P_mean)`. Injected by tests / golden parity.
      noise_unit: optional `[B, H, W, C]` unit Gaussian noise; `noise = noise_unit * sigma`.
      dropout_rng: optional key for the `'dropout'` rng stream (default: split of `rng`).

    Returns:
      `(loss, logvar, sigma)`: `loss` `[B, H, W, C]` float32 per element, `logvar` `[B]`
      float32, `sigma` `[B]` float32.

    Raises:
      ValueError: a draw is missing and `rng` is None, or an injected draw has the wrong
        shape.
    """
    images = jnp.asarray(images, jnp.float32)
    if images.ndim != 4:
        raise ValueError(f"edm2_loss: images must be NHWC [B, H, W, C], got shape {images.shape}")
    batch = images.shape[0]
    if rng is None and (rnd_normal is None or noise_unit is None):
        raise ValueError("edm2_loss: pass `rng`, or both `rnd_normal` and `noise_unit` "
                         "(the injected draws)")
    if rng is not None:
        k_sigma, k_noise, k_dropout = jax.random.split(rng, 3)
        if dropout_rng is None:
            dropout_rng = k_dropout

    if rnd_normal is None:
        rnd_normal = jax.random.normal(k_sigma, (batch,), jnp.float32)
    rnd_normal = jnp.asarray(rnd_normal, jnp.float32)
    if rnd_normal.size != batch:
        raise ValueError(f"edm2_loss: rnd_normal must have B={batch} elements, "
                         f"got shape {rnd_normal.shape}")
    sigma = jnp.exp(rnd_normal.reshape(batch) * P_std + P_mean)

    if noise_unit is None:
        noise_unit = jax.random.normal(k_noise, images.shape, jnp.float32)
    noise_unit = jnp.asarray(noise_unit, jnp.float32)
    if noise_unit.shape != images.shape:
        raise ValueError(f"edm2_loss: noise_unit must have the images' shape {images.shape} "
                         f"(NHWC), got {noise_unit.shape}")

    s = sigma[:, None, None, None]
    rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
    denoised, logvar = net.apply(
        {"params": params, "buffers": buffers}, images + noise_unit * s, sigma, labels,
        train=train, return_logvar=True, rngs=rngs)
    loss = uncertainty_loss(denoised, images, sigma, logvar, sigma_data)
    return loss, logvar.astype(jnp.float32), sigma


def edm2_loss(params: Any, buffers: Any, net: Any, images: Array, labels: Array | None,
              rng: Array | None = None, **kwargs: Any) -> tuple[Array, dict[str, Array]]:
    """EDM2 loss per image: the per-element loss summed over H, W, C.

    Arguments as in `edm2_loss_per_element` (keyword-only ones passed through). The
    training objective (`edm2_objective`) is `sum(per_image_loss) / global batch size`.

    Returns:
      `(per_image_loss, aux)`: `per_image_loss` `[B]` float32; `aux` a flat dict of float32
      scalars (means over this batch): `loss` (per-element loss, the release's
      `Loss/loss`), `weighted_mse` (`weight * (D - y)^2` per element), `logvar`,
      `sigma` (mean noise level), `log_sigma`.
    """
    loss, logvar, sigma = edm2_loss_per_element(params, buffers, net, images, labels, rng,
                                                **kwargs)
    return jnp.sum(loss, axis=(1, 2, 3)), loss_metrics(loss, logvar, sigma)


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


def edm2_objective(params: Any, buffers: Any, net: Any, images: Array, labels: Array | None,
                   rng: Array | None = None, *, batch_size: int | None = None,
                   **kwargs: Any) -> tuple[Array, dict[str, Array]]:
    """The scalar training objective `sum(per_image_loss) / batch_size` and `edm2_loss`'s
    `aux`, ready for `jax.value_and_grad(edm2_objective, has_aux=True)`; the training
    step differentiates this.

    `batch_size`: the global batch size, default this batch's (then the objective is
    `mean(per_image_loss)`). With micro-batch gradient accumulation pass the global one:
    the micro-batches' objectives then sum to the batch's. Other arguments as in
    `edm2_loss_per_element`.
    """
    per_image, aux = edm2_loss(params, buffers, net, images, labels, rng, **kwargs)
    n = per_image.shape[0] if batch_size is None else batch_size
    return jnp.sum(per_image) / n, aux
