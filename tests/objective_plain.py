"""A training objective defined outside the package, as a researcher adds one: the EDM2
loss without its uncertainty term (paper Eq. 21 with `u(sigma) = 0`, the EDM loss of
Karras et al. 2022, Eq. 2 with its weight `lambda(sigma)`), registered in one line.
`tests/test_objective_recipe.py` runs it through training, resume, post-hoc EMA,
generation and the plan with no file of the package edited (docs/architecture.md,
"Your own objective and sampler")."""
from __future__ import annotations

import jax.numpy as jnp

from edm2_jax import objectives
from edm2_jax.model import loss as loss_lib


class PlainEDM(objectives.Objective):
    """`lambda(sigma) ||D(y + sigma n; sigma) - y||^2` per element, `ln sigma ~ N(P_mean,
    P_std^2)` of `config.loss`, `sigma_data` the network's; its uncertainty head gets no
    gradient."""

    name = "edm_plain"

    def loss(self, params, buffers, net, state, images, labels, *, draws, dropout_rng,
             batch_size):
        sigma = jnp.exp(draws["rnd_normal"] * self.get("loss.P_std") + self.get("loss.P_mean"))
        noisy = images + draws["noise_unit"] * sigma[:, None, None, None]
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
        denoised = net.apply({"params": params, "buffers": buffers}, noisy, sigma, labels,
                             train=True, rngs=rngs)
        weight = loss_lib.loss_weight(sigma, self.get("network.sigma_data"))
        per_element = weight[:, None, None, None] * jnp.square(denoised - images)
        return jnp.sum(per_element) / batch_size, {"loss": jnp.mean(per_element)}


objectives.register(PlainEDM)
