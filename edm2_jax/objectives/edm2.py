"""The EDM2 objective: the denoising loss with learned uncertainty (paper Eq. 21,
`model/loss.py`), noise levels `ln(sigma) ~ N(P_mean, P_std^2)`; sampled with the EDM
Heun sampler."""
from __future__ import annotations

from typing import Any

import jax

from edm2_jax.model import loss as loss_lib

Array = jax.Array


class EDM2:
    """The `Objective` of an EDM2 training run (`objectives.Objective`).

    `loss_config`: a mapping with `P_mean`, `P_std`, `sigma_data` (`config.loss`)."""

    name = "edm2"
    state_keys: tuple[str, ...] = ()
    trained_keys: tuple[str, ...] = ()
    num_draws = 1
    metadata_key = None
    init_role = init_flag = None
    forward_passes = 3   # the network's forward and backward pass

    def __init__(self, loss_config: Any):
        self.loss_config = loss_config

    def check(self) -> None:
        """Nothing beyond `configs.validate`."""

    def init_network(self) -> None:
        """A freshly initialised network."""
        return None

    def describe(self) -> None:
        return None

    def state_extras(self, params: Any) -> dict:
        return {}

    def loss(self, params: Any, buffers: Any, net: Any, extras: dict, images: Array,
             labels: Array | None, *, rnd_normal: Array, noise_unit: Array,
             dropout_rng: Array | None, batch_size: int) -> tuple[Array, dict]:
        """`model.loss.edm2_objective` at the step's draws (`rnd_normal` `[B]` the noise
        levels' normal draws, `noise_unit` `[B, H, W, C]`)."""
        lc = self.loss_config
        return loss_lib.edm2_objective(
            params, buffers, net, images, labels, P_mean=lc["P_mean"], P_std=lc["P_std"],
            sigma_data=lc["sigma_data"], train=True, rnd_normal=rnd_normal,
            noise_unit=noise_unit, dropout_rng=dropout_rng, batch_size=batch_size)

    def apply_gradients(self, extras: dict, grads: dict, nimg: Any) -> tuple[dict, dict]:
        """Nothing: no train-state entry of its own is trained."""
        return {}, {}

    def sampler_kwargs(self, heun_steps: int) -> dict:
        """The EDM Heun sampler of `heun_steps` steps."""
        return {"num_steps": int(heun_steps)}
