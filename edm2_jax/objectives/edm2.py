"""The EDM2 objective: the denoising loss with learned uncertainty (paper Eq. 21,
`model/loss.py`), noise levels `ln(sigma) ~ N(P_mean, P_std^2)`; sampled with the EDM
Heun sampler."""
from __future__ import annotations

from typing import Any

import jax

from edm2_jax.model.loss import edm2_loss
from edm2_jax.objectives.base import Objective

Array = jax.Array


class EDM2(Objective):
    """The objective of an EDM2 training run: `model.loss.edm2_loss` with the settings of
    `config.loss` (`P_mean`, `P_std`) and `network.sigma_data`. Everything else is the interface's
    default (`base.Objective`)."""

    name = "edm2"

    def loss(self, params: Any, buffers: Any, net: Any, state: dict, images: Array,
             labels: Array | None, *, draws: dict, dropout_rng: Array | None,
             batch_size: int) -> tuple[Array, dict]:
        """`model.loss.edm2_loss` at the step's draws (`rnd_normal` `[B]` the noise
        levels' normal draws, `noise_unit` `[B, H, W, C]`)."""
        return edm2_loss(
            params, buffers, net, images, labels, rnd_normal=draws["rnd_normal"],
            noise_unit=draws["noise_unit"], P_mean=self.get("loss.P_mean"),
            P_std=self.get("loss.P_std"), sigma_data=self.get("network.sigma_data"),
            train=True, dropout_rng=dropout_rng, batch_size=batch_size)
