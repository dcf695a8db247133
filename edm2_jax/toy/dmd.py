"""The 2D toy's denoiser distilled by distribution matching (DMD2 without its GAN head,
`objectives.dmd`; docs/toy_2d.md, "Distilled into few steps"), beside the consistency
students of `toy.distill`.

The teacher is `toy.distill`'s (the toy's conditional main denoiser). A `K`-step
generator and its fake denoiser are both copies of it, initialised from its weights and
trained together with one Adam (`denoiser.optimizer`: per-weight, so each network's
updates are its own; forced weight normalisation; the generator's returned weights a
power EMA) on

    k, x0    = dmd.generator_images(G, sg G, n_g, k, ends)   the generator at step k
    x_t      = sg(x0) + t n,   t = dmd.dm_sigma(z)
    loss_G   = dm_loss(x0, dm_gradient(sg x0, D_teacher(x_t), sg D_fake(x_t)))
    loss_F   = lambda(t_f) |D_fake(sg(x0) + t_f n_f; t_f) - sg(x0)|^2

(`denoiser.denoiser_loss`'s weight: the toy's net has no learned uncertainty), the
class labels drawn from the mixture. Its points are sampled with the few-step sampler of
the consistency students (`toy.distill.consistency_points`) on the same grid.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from edm2_jax.ema import power as ema_lib
from edm2_jax.model import mp, presets
from edm2_jax.objectives import dmd
from edm2_jax.objectives.distill import grid_index
from edm2_jax.sampling.schedule import RHO, SIGMA_MIN
from edm2_jax.toy.data import Mixture, sample_mixture
from edm2_jax.toy.denoiser import ToyDenoiser, optimizer, optimizer_steps

Array = jax.Array
# The noise levels of `dm_sigma` on the toy: its sampler's range (`toy.distill`'s grid).
TOY_DM_SCHEDULE = dict(sigma_min=SIGMA_MIN, sigma_max=5.0, rho=RHO)


@dataclasses.dataclass(frozen=True)
class DMDSettings:
    """How each generator trains: `steps` Adam steps of `batch` points, `lr = ref_lr /
    sqrt(max(step / t_ref, 1))` for the generator, `fake_lr` (constant) for the fake
    denoiser (both Adam, betas (0.9, 0.99)), the generator's returned
    weights a power EMA of width `ema_sigma_rel`; one generator per `K` in `students`,
    on the grid of `teacher_steps` points from `sigma_max` to `sigma_min`."""

    students: tuple[int, ...] = (1, 2, 4)
    steps: int = 4096
    batch: int = 512
    ref_lr: float = 3e-3
    fake_lr: float = dmd.FAKE_LR
    t_ref: int = 512
    ema_sigma_rel: float = 0.05
    chunk: int = 128

    @classmethod
    def tiny(cls) -> "DMDSettings":
        """512 steps (tests, CI)."""
        return cls(steps=512, t_ref=128)


def dmd_losses(params: dict, buffers: Any, net: ToyDenoiser, teacher_params: Any,
               mix: Mixture, rng: Array, *, batch: int, steps: int, grid: dict
               ) -> tuple[Array, Array]:
    """`(loss_G, loss_F)` of the module docstring, means over `batch` fresh draws, for
    the `steps`-step generator `params['gen']` and its fake denoiser `params['fake']`:
    scalars float32. `grid`: `teacher_steps`, `sigma_min`, `sigma_max`, `rho`."""
    k_cls, k_k, k_g, k_t, k_n, k_tf, k_nf = jax.random.split(rng, 7)
    _, cls = sample_mixture(mix, k_cls, batch)
    labels = jax.nn.one_hot(cls, net.label_dim)

    def D(p):
        return lambda x, sigma: net.apply({"params": p, "buffers": buffers}, x, sigma, labels)

    ends = dmd.segment_sigmas(steps, **grid)
    k = grid_index(jax.random.normal(k_k, (batch,)), steps)
    x0, _ = dmd.generator_images(D(params["gen"]), D(jax.lax.stop_gradient(params["gen"])),
                                 jax.random.normal(k_g, (batch, 2)), k, ends)
    y = jax.lax.stop_gradient(x0)
    sig = TOY_DM_SCHEDULE
    t = dmd.dm_sigma(jax.random.normal(k_t, (batch,)), **sig)
    x_t = y + t[:, None] * jax.random.normal(k_n, y.shape)
    g = dmd.dm_gradient(y, D(teacher_params)(x_t, t),
                        D(jax.lax.stop_gradient(params["fake"]))(x_t, t))
    loss_g = jnp.mean(jnp.sum(dmd.dm_loss(x0, g), -1))
    t_f = dmd.dm_sigma(jax.random.normal(k_tf, (batch,)), **sig)
    x_f = y + t_f[:, None] * jax.random.normal(k_nf, y.shape)
    sd = net.sigma_data
    weight = (t_f**2 + sd**2) / (t_f * sd) ** 2
    loss_f = jnp.mean(weight * jnp.sum(jnp.square(D(params["fake"])(x_f, t_f) - y), -1))
    return loss_g, loss_f


@functools.partial(jax.jit, static_argnames=("net", "settings", "steps", "grid_items"))
def _dmd_chunk(net, settings, steps, grid_items, mix, teacher_params, carry, rngs):
    def grads_fn(params, buffers, rng):
        def objective(p):   # loss_G reaches the generator only, loss_F the fake only
            lg, lf = dmd_losses(p, buffers, net, teacher_params, mix, rng,
                                batch=settings.batch, steps=steps, grid=dict(grid_items))
            return lg + lf, jnp.stack([lg, lf])
        return jax.grad(objective, has_aux=True)(params)
    return optimizer_steps(grads_fn, _optimizer(settings), settings.batch,
                           settings.ema_sigma_rel, carry, rngs)


def _optimizer(settings: DMDSettings) -> optax.GradientTransformation:
    """The generator's `denoiser.optimizer`, the fake's Adam at `fake_lr`."""
    fake = optax.adam(settings.fake_lr, b1=presets.ADAM["beta1"], b2=presets.ADAM["beta2"],
                      eps=presets.ADAM["eps"])
    return optax.multi_transform({"gen": optimizer(settings), "fake": fake},
                                 {"gen": "gen", "fake": "fake"})


def train_generator(net: ToyDenoiser, teacher: dict, mix: Mixture, K: int, grid: dict,
                    settings: DMDSettings = DMDSettings(), seed: int = 0
                    ) -> tuple[dict, np.ndarray]:
    """A `K`-step generator of the teacher (`net` with `teacher`'s `{'params',
    'buffers'}`) trained with its fake denoiser for `settings.steps` steps. Returns the
    generator's EMA `{'params', 'buffers'}` and `[steps, 2]` float32 losses `(loss_G,
    loss_F)` (NumPy)."""
    w = mp.force_normalize(teacher["params"])
    params = {"gen": w, "fake": w}
    ema_state = ema_lib.init_ema_state(params, (settings.ema_sigma_rel,))
    carry = (params, _optimizer(settings).init(params), ema_state, teacher["buffers"],
             jnp.int32(0))
    rng, losses = jax.random.PRNGKey(seed), []
    for start in range(0, settings.steps, settings.chunk):
        n = min(settings.chunk, settings.steps - start)
        carry, loss = _dmd_chunk(net, settings, K, tuple(sorted(grid.items())), mix,
                                 teacher["params"], carry,
                                 jax.random.split(jax.random.fold_in(rng, start), n))
        losses.append(np.asarray(loss))
    ema = carry[2]["power"][ema_lib.ema_key(settings.ema_sigma_rel)]
    return {"params": ema["gen"], "buffers": teacher["buffers"]}, np.concatenate(losses)
