"""The denoiser of the 2D toy and its training.

`ToyDenoiser`: a magnitude-preserving MLP (`mp.MPConv` dense layers, `mp_silu`, `mp_sum`,
`MPFourier` noise embedding) inside the EDM preconditioning of `networks.Precond`
(docs/recipe.md §1, §3); same call signature as `Precond`, so the sampler of
`sampling.sampler` guides it unchanged.

`train_denoiser`: Adam, the inverse-sqrt learning rate of `training.optim.learning_rate`,
forced weight normalisation, a power EMA (docs/recipe.md §4, §5), regressing the ideal
denoiser of `data` (no sampling noise in the target: the toy trains in seconds).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from edm2_jax.ema import power as ema_lib
from edm2_jax.model import mp
from edm2_jax.model import networks, presets
from edm2_jax.toy.data import Mixture, broadcast_sigma, ideal_denoiser, sample_mixture
from edm2_jax.training import optim

Array = jax.Array


class ToyDenoiser(nn.Module):
    """Magnitude-preserving MLP denoiser of 2D points in EDM preconditioning.

    `D(x; sigma) = c_skip x + c_out F(c_in x, c_noise, labels)` with the coefficients of
    `networks.Precond` (docs/recipe.md §3). `F`: the input `[c_in x, 1]` through an MP
    dense layer to `hidden` features, then `num_blocks` residual blocks
    `h = mp_sum(h, dense(mp_silu(dense(mp_silu(h)) * (1 + emb_gain dense(emb)))), 0.3)`
    (the EDM2 block of Figure 21 without convolutions), then an MP dense layer to 2 with
    a learned output gain initialised to 0 (so the untrained `D` is `c_skip x`, the
    ideal denoiser of N(0, sigma_data^2 I)). `emb = mp_silu(dense(MPFourier(c_noise)))`,
    mixed with a label embedding by `mp_sum(., ., 0.5)` when `label_dim > 0`.

    Call: `x [B, 2]`, `sigma` scalar or `[B]` (> 0), `labels [B, label_dim]` one-hot or
    None (zeros: the unconditional slot) -> `D [B, 2]` float32. Same signature as
    `Precond`, so `sampling.guidance.make_denoiser` guides it.
    """

    label_dim: int = 0
    hidden: int = 64
    num_blocks: int = 3
    noise_channels: int = 32
    sigma_data: float = 0.5
    res_balance: float = 0.3

    @nn.compact
    def __call__(self, x: Array, sigma: Array, labels: Array | None = None) -> Array:
        x = jnp.asarray(x, jnp.float32)
        sigma = broadcast_sigma(sigma, x)
        c_skip, c_out, c_in, c_noise = networks.precond_coefficients(
            sigma, self.sigma_data, x.ndim)

        emb = mp.MPConv(self.noise_channels, self.hidden, name="emb_noise")(
            mp.MPFourier(self.noise_channels, name="emb_fourier")(c_noise))
        if self.label_dim:
            if labels is None:
                labels = jnp.zeros((x.shape[0], self.label_dim), jnp.float32)
            lab = mp.MPConv(self.label_dim, self.hidden, name="emb_label")(
                jnp.asarray(labels, jnp.float32) * math.sqrt(self.label_dim))
            emb = mp.mp_sum(emb, lab, 0.5)
        emb = mp.mp_silu(emb)

        h = mp.MPConv(3, self.hidden, name="in_dense")(
            jnp.concatenate([c_in * x, jnp.ones_like(x[:, :1])], axis=-1))
        for i in range(self.num_blocks):
            emb_gain = self.param(f"block{i}_emb_gain", nn.initializers.zeros, ())
            y = mp.MPConv(self.hidden, self.hidden, name=f"block{i}_dense0")(mp.mp_silu(h))
            c = mp.MPConv(self.hidden, self.hidden, name=f"block{i}_emb")(emb, gain=emb_gain) + 1
            y = mp.MPConv(self.hidden, self.hidden, name=f"block{i}_dense1")(mp.mp_silu(y * c))
            h = mp.mp_sum(h, y, self.res_balance)
        out_gain = self.param("out_gain", nn.initializers.zeros, ())
        F = mp.MPConv(self.hidden, 2, name="out_dense")(h, gain=out_gain)
        return c_skip * x + c_out * F


def init_denoiser(net: ToyDenoiser, rng: Array) -> dict:
    """`{'params', 'buffers'}` of `net`."""
    x, sigma = jnp.zeros((1, 2)), jnp.ones((1,))
    labels = jnp.zeros((1, net.label_dim)) if net.label_dim else None
    return dict(jax.jit(lambda r: net.init({"params": r}, x, sigma, labels))(rng))


# ---------------------------------------------------------------------------------------
# Training.

@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """How one toy denoiser trains.

    `steps` Adam steps of `batch` points; `lr = ref_lr / sqrt(max(step / t_ref, 1))`
    (`training.optim.learning_rate` without ramp-up);
    `ln sigma ~ N(P_mean, P_std^2)` (weighted to low noise: the branches are thin); the
    returned weights are a power EMA of width `ema_sigma_rel` (docs/recipe.md §5).
    """

    steps: int = 1536
    batch: int = 512
    ref_lr: float = 0.01
    t_ref: int = 256
    P_mean: float = -2.0
    P_std: float = 1.6
    ema_sigma_rel: float = 0.05
    chunk: int = 128   # steps per jitted `lax.scan` call


def denoiser_loss(params: Any, buffers: Any, net: ToyDenoiser, mix: Mixture, rng: Array,
                  batch: int, P_mean: float, P_std: float) -> Array:
    """EDM-weighted squared error to the ideal denoiser,
    `mean lambda(sigma) |D(x + sigma n; sigma) - D*(x + sigma n; sigma)|^2`,
    `lambda = 1 / c_out^2` (so the loss is `|F - F*|^2`: 0 for a perfect denoiser; 0.88 for
    `F = 0` conditional, 0.54 unconditional, at the default noise levels). A conditional
    net sees class labels, an unconditional one (`label_dim` 0) the whole mixture.
    Scalar float32."""
    k_x, k_sigma, k_n = jax.random.split(rng, 3)
    x0, cls = sample_mixture(mix, k_x, batch)
    sigma = jnp.exp(P_mean + P_std * jax.random.normal(k_sigma, (batch,)))
    x = x0 + sigma[:, None] * jax.random.normal(k_n, (batch, 2))
    labels = jax.nn.one_hot(cls, net.label_dim) if net.label_dim else None
    target = ideal_denoiser(mix, x, sigma, cls if net.label_dim else None)
    D = net.apply({"params": params, "buffers": buffers}, x, sigma, labels)
    sd = net.sigma_data
    weight = (sigma**2 + sd**2) / (sigma * sd) ** 2
    return jnp.mean(weight * jnp.sum(jnp.square(D - target), -1))


def _learning_rate(settings: TrainSettings, step: Array) -> Array:
    """`optim.learning_rate` after `step` Adam steps (`nimg = step * batch`), no ramp-up."""
    return optim.learning_rate(step * settings.batch, batch_size=settings.batch,
                               ref_lr=settings.ref_lr, t_ref=settings.t_ref, rampup_kimg=0)


def optimizer(settings) -> optax.GradientTransformation:
    """Adam, betas (0.9, 0.99), with `_learning_rate(settings, step)` (docs/recipe.md §4).
    `settings`: a `TrainSettings`, or any settings with `batch`, `ref_lr` and `t_ref`."""
    return optax.adam(functools.partial(_learning_rate, settings), b1=presets.ADAM["beta1"],
                      b2=presets.ADAM["beta2"], eps=presets.ADAM["eps"])


def optimizer_steps(grads_fn, tx: optax.GradientTransformation, batch: int,
                    ema_sigma_rel: float, carry: tuple, rngs: Array) -> tuple[tuple, Any]:
    """`len(rngs)` training steps in one `lax.scan`: forced weight normalisation (Eq. 66),
    the gradient `grads_fn(params, buffers, rng) -> (grads, out)`, the update of `tx`,
    the power-function EMA of `ema_sigma_rel` after `batch` images a step.
    `carry = (params, opt_state, ema_state, buffers, step)`; returns the new carry and
    each step's `out`, stacked."""
    def step(carry, rng):
        params, opt_state, ema_state, buffers, t = carry
        params = mp.force_normalize(params)   # forced weight normalisation (Eq. 66)
        grads, out = grads_fn(params, buffers, rng)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        ema_state = ema_lib.update_ema(ema_state, params, (t + 1) * batch, batch,
                                       sigma_rels=(ema_sigma_rel,))
        return (params, opt_state, ema_state, buffers, t + 1), out
    return jax.lax.scan(step, carry, rngs)


def _train_chunk(net, settings, tx, mix, carry, rngs):
    def grads_fn(params, buffers, rng):
        loss, grads = jax.value_and_grad(denoiser_loss)(
            params, buffers, net, mix, rng, settings.batch, settings.P_mean, settings.P_std)
        return grads, loss
    return optimizer_steps(grads_fn, tx, settings.batch, settings.ema_sigma_rel, carry, rngs)


def train_denoiser(net: ToyDenoiser, mix: Mixture, settings: TrainSettings = TrainSettings(),
                   seed: int = 0) -> tuple[dict, np.ndarray]:
    """Train `net` on `mix` (docs/recipe.md §4: Adam betas (0.9, 0.99), inverse-sqrt
    learning rate, forced weight normalisation before each step; §5: power EMA).

    Returns `(variables, losses)`: the EMA's `{'params', 'buffers'}` and the loss of
    every step `[steps]` float32 (NumPy).
    """
    rng_init, rng_train = jax.random.split(jax.random.PRNGKey(seed))
    variables = init_denoiser(net, rng_init)
    params = mp.force_normalize(variables["params"])
    tx = optimizer(settings)
    ema_state = ema_lib.init_ema_state(params, (settings.ema_sigma_rel,))
    carry = (params, tx.init(params), ema_state, variables["buffers"], jnp.int32(0))
    chunk = jax.jit(functools.partial(_train_chunk, net, settings, tx))
    losses = []
    for start in range(0, settings.steps, settings.chunk):
        n = min(settings.chunk, settings.steps - start)
        rngs = jax.random.split(jax.random.fold_in(rng_train, start), n)
        carry, loss = chunk(mix, carry, rngs)
        losses.append(np.asarray(loss))
    ema_params = carry[2]["power"][ema_lib.ema_key(settings.ema_sigma_rel)]
    return {"params": ema_params, "buffers": carry[3]}, np.concatenate(losses)


def eval_loss(net: ToyDenoiser, variables: dict | None, mix: Mixture, seed: int = 123,
              n: int = 8192, P_mean: float = -2.0, P_std: float = 1.6) -> float:
    """`denoiser_loss` on `n` fresh draws; `variables=None` measures the trivial denoiser
    `D = c_skip x` (`F = 0`, the ideal denoiser of N(0, sigma_data^2 I))."""
    rng = jax.random.PRNGKey(seed)
    if variables is None:
        variables = init_denoiser(net, rng)   # its output gain starts at 0: D = c_skip x
    return float(denoiser_loss(variables["params"], variables["buffers"], net, mix, rng, n,
                               P_mean, P_std))
