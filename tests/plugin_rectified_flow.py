"""A method of a researcher's own, defined outside the package and never installed with
it: rectified flow (Liu et al. 2023, arXiv:2209.03003) with its Euler ODE sampler.
`tests/test_plugins.py` copies this file into a directory of its own, puts that on
PYTHONPATH, allows it with `EDM2_JAX_PLUGINS=rf_plugin`, and runs it through the
command line: train, resume, phema, generate (`--sampler=rf_euler`), eval and plan.

- Interpolation `x_t = (1 - t) x_0 + t n`, `n ~ N(0, I)`, `t = sigmoid(u)`, `u ~ N(0, 1)`
  (logit-normal), squeezed into `[T_MIN, 1]`.
- The network is read at noise level `sigma = t` as a predictor of `x_0`:
  `v(x_t, t) = (x_t - D(x_t; t)) / t`, the velocity of the straight path from data to
  noise; the loss is rectified flow's `||v - (n - x_0)||^2` per element.
- The sampler integrates `dx/dt = v(x, t)` from `t = 1` (`x = n`) to `t = 0` with
  `num_steps` uniform Euler steps.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from edm2_jax import objectives
from edm2_jax.sampling import solvers

T_MIN = 1e-3


@solvers.register
@dataclasses.dataclass(frozen=True)
class RectifiedFlowEuler(solvers.Sampler):
    """`num_steps` Euler steps of `dx/dt = (x - D(x; t)) / t` on `t_i = t_max (1 - i/N)`."""

    name = "rf_euler"
    num_steps: int = 8
    t_max: float = 1.0

    def __call__(self, denoise, noise, labels=None, *, churn_noise=None):
        x = jnp.asarray(noise, jnp.float32)
        t = [self.t_max * (1 - i / self.num_steps) for i in range(self.num_steps + 1)]
        for t_cur, t_next in zip(t[:-1], t[1:]):
            sigma = jnp.float32(t_cur)
            v = (x - denoise(x, sigma, labels).astype(jnp.float32)) / sigma
            x = x + (t_next - t_cur) * v
        return x


@objectives.register
class RectifiedFlow(objectives.Objective):
    name = "rectified_flow"

    def draws(self, keys, images_shape):
        k_t, k_noise = keys
        u = jax.random.normal(k_t, images_shape[:1], jnp.float32)
        return {"t": T_MIN + (1 - T_MIN) * jax.nn.sigmoid(u),
                "noise": jax.random.normal(k_noise, images_shape, jnp.float32)}

    def loss(self, params, buffers, net, state, images, labels, *, draws, dropout_rng,
             batch_size):
        t = draws["t"][:, None, None, None]
        x_t = (1 - t) * images + t * draws["noise"]
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
        denoised = net.apply({"params": params, "buffers": buffers}, x_t, draws["t"], labels,
                             train=True, rngs=rngs)
        v = (x_t - denoised) / t
        per_element = jnp.square(v - (draws["noise"] - images))
        return jnp.sum(per_element) / batch_size, {"loss": jnp.mean(per_element)}

    def sampler(self, num_steps=32):
        return RectifiedFlowEuler(num_steps)

    def flops_per_image(self, forward_flops):
        return 3 * forward_flops
