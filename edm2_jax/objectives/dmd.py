"""Few-step generation by distribution matching: DMD2 (Yin et al. 2024, arXiv:2405.14867,
the regression-free objective of Sec. 4.1-4.2, on the distribution-matching gradient of
DMD, Yin et al. 2024, arXiv:2311.18828, Eq. 7-8), in EDM's sigma parametrisation
(docs/distillation.md), with its GAN head of Sec. 4.3 as an option (`distill.gan`,
`objectives/gan.py`).

Three networks, all the teacher's `Precond` (same U-Net and EDM preconditioning):

- the generator `G` (the student, the run's `params`), initialised from the teacher: from
  noise `x = sigma_max n` it returns a clean image in `K` steps of the few-step sampler
  (`sampling.consistency.consistency_sampler`: `x0 = G(x; t_k)`, then the DDIM step to
  the next segment end `t_{k+1}`, on the grid of `distill.teacher_steps` points);
- the real denoiser `D_real`: the teacher, frozen (`'teacher'` in the train state);
- the fake denoiser `D_fake`: initialised from the teacher and trained online on the
  generator's images with the EDM2 loss (Eq. 21 of the EDM2 paper,
  `model.loss.uncertainty_loss`), its own Adam (`'fake'`, `'fake_opt'`).

One training example: a label, unit noise `n_g`, `n`, `n_f`, a step index `k` (uniform
over `0..K-1`), noise levels `t`, `t_f` (`dm_sigma`: uniform in the rho-warped time of
the EDM schedule from 80 to 0.002, fractions 0.02 to 0.98, DMD's range), and

    x_k  = the sampler's state at step k, run from sigma_max n_g by the stopped-gradient
           generator (DMD2's backward simulation, Sec. 4.4: the generator trains on the
           inputs it samples from)
    x0   = G(x_k; t_k)
    x_t  = sg(x0) + t n
    g    = (D_fake(x_t; t) - D_real(x_t; t)) / mean|x0 - D_real(x_t; t)|       (DMD Eq. 8)
    loss_G = 1/2 (x0 - sg(x0 - g))^2                  (per element; its gradient in x0 is g)
    loss_F = lambda(t_f) / exp(u(t_f)) (D_fake(sg(x0) + t_f n_f; t_f) - sg(x0))^2 + u(t_f)

`g` is the gradient in `x0` of `KL(p_G,t || p_data,t)` (the score difference
`s_fake - s_real = (D_fake - D_real) / t^2`) with DMD's weight `t^2 / mean|x0 - D_real|`.
The step minimises `loss_G + loss_F`: `loss_G` reaches the generator only (the
denoisers and `g` are stopped), `loss_F` the fake denoiser only (`sg(x0)`), so one
backward pass gives both gradients and one jitted step updates both (the two time scales
are the fake's learning rate, `distill.fake_lr`). At `p_G = p_data` the fake denoiser
that minimises `loss_F` is the real one, `g = 0` for every draw, and the generator is a
fixed point.

With the GAN head (`distill.gan=True`, `objectives/gan.py`) a classifier `'gan_head'` on
the fake denoiser's bottleneck learns real training images against generated ones: each
image's loss gains `N (gen_cls_loss_weight loss_gen + guidance_cls_loss_weight
loss_cls)` (`N` its elements), `loss_cls` training the head and the fake denoiser,
`loss_gen` the generator; and the generator is updated on one step of
`dfake_gen_update_ratio` only (`trains_weights`), the fake denoiser and the head on every
step (DMD2's two time-scale rule, Sec. 4.2).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from edm2_jax.model import loss as loss_lib
from edm2_jax.model import presets
from edm2_jax.model.mp import force_normalize
from edm2_jax.model.networks import Precond
from edm2_jax.objectives import gan as gan_lib
from edm2_jax.objectives.base import Objective, StartNetwork
from edm2_jax.objectives.distill import (DISTILL_FIELDS, check_distill, few_step_sampler,
                                         grid_index, grid_settings, teacher_line,
                                         teacher_network)
from edm2_jax.sampling import consistency, solvers
from edm2_jax.sampling.schedule import RHO, SIGMA_MAX, SIGMA_MIN

Array = jax.Array
DenoiseFn = Callable[[Array, Array], Array]  # (x [B,H,W,C], sigma [B]) -> D [B,H,W,C]

# The noise levels of the distribution-matching gradient and of the fake denoiser's
# loss: fractions 0.02 to 0.98 of the rho-warped time of the EDM sampler's schedule from
# sigma 80 to 0.002, rho 7 (DMD, arXiv:2311.18828, Sec. 4: timesteps 20 to 980 of 1000),
# whatever the generator's own grid.
DM_RANGE = (0.02, 0.98)
DM_SCHEDULE = dict(sigma_min=SIGMA_MIN, sigma_max=SIGMA_MAX, rho=RHO)
# The smallest DMD normaliser (mean |x0 - D_real|): guards against division by zero.
MIN_SCALE = 1e-8
# Draws per image (`rnd_normal` [B, 3], `noise_unit` [B, 3, H, W, C]): the generator's
# (step index, input noise), the distribution-matching gradient's (t, n), the fake
# denoiser's loss (t_f, n_f).
NUM_DRAWS = 3


def _bcast(v: Array, x: Array) -> Array:
    return v.reshape(v.shape + (1,) * (x.ndim - v.ndim))


def dm_sigma(rnd_normal: Array, *, sigma_min: float = DM_SCHEDULE["sigma_min"],
             sigma_max: float = DM_SCHEDULE["sigma_max"],
             rho: float = DM_SCHEDULE["rho"]) -> Array:
    """Noise levels `t = (sigma_max^(1/rho) + u (sigma_min^(1/rho) - sigma_max^(1/rho)))^rho`
    with `u` uniform over `DM_RANGE` (`u = 0.02 + 0.96 Phi(z)` of standard normal draws
    `z`): the EDM sampler's schedule (Karras et al. 2022, Eq. 5) at uniform time. float32
    of `rnd_normal`'s shape."""
    u0, u1 = DM_RANGE
    u = u0 + (u1 - u0) * jax.scipy.special.ndtr(jnp.asarray(rnd_normal, jnp.float32))
    a, b = sigma_max ** (1 / rho), sigma_min ** (1 / rho)
    return (a + u * (b - a)) ** rho


def segment_sigmas(steps: int, teacher_steps: int, sigma_min: float, sigma_max: float,
                   rho: float) -> np.ndarray:
    """The generator's noise levels `t_0 = sigma_max > ... > t_{K-1}` and `t_K = 0`: the
    few-step sampler's segment ends on the grid (`consistency.segment_bounds`). Host
    float32 `[K + 1]`."""
    sigmas = consistency.grid_sigmas(teacher_steps, sigma_min, sigma_max, rho)
    return np.asarray(sigmas, np.float32)[consistency.segment_bounds(steps, teacher_steps)]


def generator_images(G: DenoiseFn, G_sg: DenoiseFn, noise: Array, k: Array,
                     ends: np.ndarray) -> tuple[Array, Array]:
    """`(x0, t_k)`: the generator's output at step `k` (int32 `[B]`, `0 <= k < K`) of the
    few-step sampler from `x = ends[0] noise`, the steps before `k` taken by the
    stopped-gradient generator `G_sg` (DMD2's backward simulation) and the last by `G`
    (gradient flows through it alone). `ends`: `segment_sigmas` `[K + 1]`. At `k = K - 1`
    for every image, `x0` is `consistency_sampler`'s image of the same noise. float32
    `[B, H, W, C]` and `[B]`."""
    ends = jnp.asarray(ends, jnp.float32)
    x = jnp.asarray(noise, jnp.float32) * ends[0]
    for j in range(len(ends) - 2):   # K - 1 steps, masked per image by j < k
        t, s = ends[j], ends[j + 1]
        x_next = consistency.ddim_step(x, G_sg(x, jnp.full(k.shape, t)), t, s)
        x = jnp.where(_bcast(j < k, x), jax.lax.stop_gradient(x_next), x)
    t_k = ends[k]
    return G(x, t_k).astype(jnp.float32), t_k


def dm_gradient(x0: Array, real: Array, fake: Array) -> Array:
    """The distribution-matching gradient in `x0` (DMD, arXiv:2311.18828, Eq. 7 with the
    weight of Eq. 8): `(fake - real) / mean|x0 - real|`, the mean over each image's
    elements. `x0` the generator's images, `real`, `fake` the two denoisers at the
    noised images; all `[B, H, W, C]`. float32, stopped gradient."""
    x0, real, fake = (jax.lax.stop_gradient(jnp.asarray(v, jnp.float32))
                      for v in (x0, real, fake))
    scale = jnp.mean(jnp.abs(x0 - real), axis=tuple(range(1, x0.ndim)), keepdims=True)
    return (fake - real) / jnp.maximum(scale, MIN_SCALE)


def dm_loss(x0: Array, grad: Array) -> Array:
    """`1/2 (x0 - sg(x0 - grad))^2` per element: its value is `grad^2 / 2` and its
    gradient in `x0` is `grad` (DMD's surrogate of the KL, arXiv:2311.18828, Eq. 7).
    float32 `[B, H, W, C]`."""
    x0 = jnp.asarray(x0, jnp.float32)
    return 0.5 * jnp.square(x0 - jax.lax.stop_gradient(x0 - grad))


def dmd_loss_per_element(params: Any, buffers: Any, net: Precond, extras: dict,
                         labels: Array | None, *, rnd_normal: Array, noise_unit: Array,
                         dropout_rng: Array | None, steps: int, teacher_steps: int,
                         sigma_min: float, sigma_max: float, rho: float,
                         sigma_data: float = 0.5) -> tuple[Array, Array, dict]:
    """The per-element losses of the module docstring.

    Args:
      params: the generator's (force-normalised) weights; `extras['teacher']` the real
        denoiser's (frozen), `extras['fake']` the fake denoiser's (trained by `loss_F`).
      buffers: the `MPFourier` buffers the three networks share.
      net: the `Precond` of all three.
      labels: `[B, label_dim]` or None, seen by all three.
      rnd_normal: `[B, NUM_DRAWS]` standard normal draws (step index, `t`, `t_f`).
      noise_unit: `[B, NUM_DRAWS, H, W, C]` unit Gaussian noise (`n_g`, `n`, `n_f`).
      dropout_rng: the generator's and the fake denoiser's dropout key, or None.
      steps, teacher_steps, sigma_min, sigma_max, rho: `K` and the sampler's grid.
    Returns: `(loss_G, loss_F, aux)`: float32 `[B, H, W, C]` each, and
      `aux = {'logvar', 't', 't_f', 'scale'}` `[B]` (the fake's logvar at `t_f`, the DMD
      normaliser) and `aux['x0']`, the generator's images (gradient flows through them).
    """
    def apply(p, train=False, rngs=None):
        def D(x, sigma):
            return net.apply({"params": p, "buffers": buffers}, x, sigma, labels,
                             train=train, rngs=rngs or {}).astype(jnp.float32)
        return D

    k_gen, k_fake = (jax.random.split(dropout_rng) if dropout_rng is not None
                     else (None, None))
    grid = dict(sigma_min=sigma_min, sigma_max=sigma_max, rho=rho)
    ends = segment_sigmas(steps, teacher_steps, **grid)
    k = grid_index(rnd_normal[:, 0], steps)
    G = apply(params, train=True, rngs={"dropout": k_gen} if k_gen is not None else None)
    x0, _ = generator_images(G, apply(jax.lax.stop_gradient(params)), noise_unit[:, 0], k,
                             ends)
    y = jax.lax.stop_gradient(x0)
    t = dm_sigma(rnd_normal[:, 1])
    x_t = y + _bcast(t, y) * noise_unit[:, 1]
    real = apply(extras["teacher"])(x_t, t)
    fake = apply(jax.lax.stop_gradient(extras["fake"]))(x_t, t)
    loss_g = dm_loss(x0, dm_gradient(y, real, fake))

    t_f = dm_sigma(rnd_normal[:, 2])
    rngs = {"dropout": k_fake} if k_fake is not None else {}
    denoised, logvar = net.apply({"params": extras["fake"], "buffers": buffers},
                                 y + _bcast(t_f, y) * noise_unit[:, 2], t_f, labels,
                                 train=True, return_logvar=True, rngs=rngs)
    loss_f = loss_lib.uncertainty_loss(denoised, y, t_f, logvar, sigma_data)
    scale = jnp.mean(jnp.abs(y - real), axis=(1, 2, 3))
    return loss_g, loss_f, {"logvar": logvar.astype(jnp.float32), "t": t, "t_f": t_f,
                            "scale": scale, "x0": x0}


def dmd_objective(params: Any, buffers: Any, net: Precond, extras: dict,
                  labels: Array | None, *, batch_size: int | None = None,
                  images: Array | None = None, gan_weights: tuple[float, float] | None = None,
                  gan_features: str = "fake", gan_sigma_max: float = gan_lib.SIGMA_MAX,
                  **kwargs: Any) -> tuple[Array, dict[str, Array]]:
    """`sum(per-image loss_G + loss_F) / batch_size` of `dmd_loss_per_element` and the
    logged means: `loss` (per element, of both), `dm` (`loss_G`), the fake denoiser's
    `fake_loss`, `weighted_mse`, `logvar`, `sigma` and `log_sigma` (of `t_f`), and
    `dm_scale` (DMD's normaliser).

    With `gan_weights = (gen_cls_loss_weight, guidance_cls_loss_weight)` (the GAN head,
    `extras['gan_head']`, on the training `images`; draws `NUM_DRAWS + gan.NUM_DRAWS`
    per image) each image's loss gains `N (w_gen loss_gen + w_cls loss_cls)` of
    `gan.gan_losses` on the bottleneck of `extras[gan_features]` ('fake' or the frozen
    'teacher') at noise levels up to `gan_sigma_max`, `N` its elements, logged as
    `gen_cls`, `guidance_cls`, and the classifier's mean `real_prob` and `fake_prob`."""
    rnd_normal, noise_unit = kwargs.pop("rnd_normal"), kwargs.pop("noise_unit")
    loss_g, loss_f, aux = dmd_loss_per_element(
        params, buffers, net, extras, labels, rnd_normal=rnd_normal[:, :NUM_DRAWS],
        noise_unit=noise_unit[:, :NUM_DRAWS], **kwargs)
    per_image = jnp.sum(loss_g + loss_f, axis=(1, 2, 3))
    n = per_image.shape[0] if batch_size is None else batch_size
    fake = loss_lib.loss_metrics(loss_f, aux["logvar"], aux["t_f"])
    metrics = {"loss": jnp.mean(loss_g + loss_f), "dm": jnp.mean(loss_g),
               "fake_loss": fake.pop("loss"), "dm_scale": jnp.mean(aux["scale"]), **fake}
    if gan_weights is not None:
        dropout_rng = kwargs.get("dropout_rng")
        gen, cls, probs = gan_lib.gan_losses(
            net, buffers, extras[gan_features], extras["gan_head"], aux["x0"], images, labels,
            rnd_normal=rnd_normal[:, NUM_DRAWS:], noise_unit=noise_unit[:, NUM_DRAWS:],
            dropout_rng=None if dropout_rng is None else jax.random.split(dropout_rng)[1],
            sigma_max=gan_sigma_max)
        w_gen, w_cls = gan_weights
        per_image = per_image + loss_g[0].size * (w_gen * gen + w_cls * cls)
        metrics.update(gen_cls=jnp.mean(gen), guidance_cls=jnp.mean(cls),
                       **{k: jnp.mean(v) for k, v in probs.items()})
    return jnp.sum(per_image) / n, metrics


def fake_optimizer(fake_lr: float, beta1: float = presets.ADAM["beta1"],
                   beta2: float = presets.ADAM["beta2"],
                   eps: float = presets.ADAM["eps"]) -> optax.GradientTransformation:
    """The fake denoiser's optimiser: non-finite gradient entries set to 0, then Adam at
    the constant learning rate `fake_lr` (by default the EDM2 optimiser's betas and eps)."""
    finite = optax.stateless(lambda g, _: jax.tree.map(
        lambda x: jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x)), g))
    return optax.chain(finite, optax.scale_by_adam(b1=beta1, b2=beta2, eps=eps),
                       optax.scale(-float(fake_lr)))


# --------------------------------------------------------------------------------------
# The objective, and the fake denoiser's learning rate by default (`distill.fake_lr`).
FAKE_LR = 0.01


class DistributionMatching(Objective):
    """DMD2's distribution matching (`config.objective='dmd'`): the generator starts as
    the teacher `distill.teacher` (EMA `distill.teacher_ema`), whose weights the train
    state keeps frozen as `'teacher'`; the fake denoiser `'fake'` starts as the teacher
    too and is trained by the same loss with its Adam state `'fake_opt'`
    (`fake_optimizer` at `distill.fake_lr`, the betas and eps of `config.optim`); the
    loss is `dmd_objective`; its networks are sampled with the few-step sampler of its
    grid. With `distill.gan=True`, DMD2's GAN head `'gan_head'` (`gan.Head`) and its Adam
    state `'gan_head_opt'` (at `distill.gan_head_lr`, else `fake_lr`) join the state, and
    the generator is trained on one step of `distill.dfake_gen_update_ratio`."""

    name = "dmd"
    section = "distill"
    trained = ("fake",)

    def __init__(self, config: Any):
        super().__init__(config)
        adam = {k: float(self.get(f"optim.{k}", v)) for k, v in presets.ADAM.items()}
        self.tx = fake_optimizer(self.fake_lr, **adam)
        self.gan = self.gan_setting("gan") is True
        if self.gan:
            self.trained = ("fake", "gan_head")
            head_lr = float(self.gan_setting("gan_head_lr")) or self.fake_lr
            self.head_tx = fake_optimizer(head_lr, **adam)

    @property
    def fake_lr(self) -> float:
        return float(self.get("distill.fake_lr", FAKE_LR))

    def gan_setting(self, name: str) -> Any:
        """`distill.<name>`, a setting of the GAN head, or its default (`GAN_FIELDS`)."""
        return self.get(f"distill.{name}", gan_lib.GAN_FIELDS[name])

    @property
    def update_ratio(self) -> int:
        """Steps per generator update: `dfake_gen_update_ratio` with the head, else 1."""
        return int(self.gan_setting("dfake_gen_update_ratio")) if self.gan else 1

    @classmethod
    def section_fields(cls) -> dict:
        return dict(DISTILL_FIELDS, fake_lr=FAKE_LR, **gan_lib.GAN_FIELDS)

    def check(self) -> None:
        """Raise ValueError naming the flag when the sampler's grid is not one, the
        fake denoiser's learning rate is not positive or a setting of the GAN head is
        not one (`gan.check_gan`)."""
        check_distill(self.config)
        v = self.get("distill.fake_lr", FAKE_LR)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
            raise ValueError(f"--config.distill.fake_lr={v!r}: the fake denoiser's "
                             f"learning rate, positive, e.g. {FAKE_LR}")
        gan_lib.check_gan(self.config)

    def start(self) -> StartNetwork:
        """The teacher: `distill.teacher`, `distill.teacher_ema`."""
        return teacher_network(self.config)

    def describe(self) -> str:
        head = (f"; GAN head (weights {self.gan_setting('gen_cls_loss_weight')} generator, "
                f"{self.gan_setting('guidance_cls_loss_weight')} classifier), the "
                f"generator trained on 1 step of {self.update_ratio}" if self.gan else "")
        return (teacher_line(self.config) + f"; distribution matching (DMD2): a "
                f"{self.get('distill.steps')}-step generator, fake denoiser at learning "
                f"rate {self.fake_lr}" + head)

    def init_state(self, params: Any) -> dict:
        """The teacher's frozen weights (the generator's initial `params`), the fake
        denoiser (the same, force-normalised) and its Adam state; with the GAN head, its
        weights (`gan.init_head`, drawn from `config.seed`) and its Adam state."""
        fake = force_normalize(params)
        state = {"teacher": params, "fake": fake, "fake_opt": self.tx.init(fake)}
        if self.gan:
            head = gan_lib.init_head(params["unet"],
                                     jax.random.PRNGKey(int(self.get("seed", 0))))
            state.update(gan_head=head, gan_head_opt=self.head_tx.init(head))
        return state

    def draws(self, keys: tuple[Array, Array], images_shape: tuple[int, ...]) -> dict:
        """`NUM_DRAWS` per image, and `gan.NUM_DRAWS` more with the head: `rnd_normal`
        `[B, 3]`, `noise_unit` `[B, 3, H, W, C]` (3 -> 6)."""
        k_sigma, k_noise = keys
        shape = (images_shape[0], NUM_DRAWS + (gan_lib.NUM_DRAWS if self.gan else 0))
        return {"rnd_normal": jax.random.normal(k_sigma, shape, jnp.float32),
                "noise_unit": jax.random.normal(k_noise, shape + tuple(images_shape[1:]),
                                                jnp.float32)}

    def loss(self, params: Any, buffers: Any, net: Any, state: dict, images: Array,
             labels: Array | None, *, draws: dict, dropout_rng: Array | None,
             batch_size: int) -> tuple[Array, dict]:
        """`dmd_objective`; the clean `images` are read by the GAN head alone (without it
        the generator and the fake denoiser see only generated images, of the data's labels)."""
        gan_weights = (tuple(float(self.gan_setting(k)) for k in (
            "gen_cls_loss_weight", "guidance_cls_loss_weight")) if self.gan else None)
        return dmd_objective(params, buffers, net, state, labels,
                             rnd_normal=draws["rnd_normal"], noise_unit=draws["noise_unit"],
                             dropout_rng=dropout_rng,
                             sigma_data=float(self.get("network.sigma_data", 0.5)),
                             batch_size=batch_size, images=images, gan_weights=gan_weights,
                             gan_features=str(self.gan_setting("gan_features")),
                             gan_sigma_max=float(self.gan_setting("gan_sigma_max")),
                             **grid_settings(self.config))

    def update(self, state: dict, grads: dict, nimg: Array) -> tuple[dict, dict]:
        """The fake denoiser's Adam step on its gradient `grads['fake']`, its weights
        force-normalised after it (so that the next loss sees normalised weights, as
        the generator's step does, EDM2 Eq. 66), and the GAN head's Adam step (its
        weights as they are). Returns the new `'fake'`, `'fake_opt'` (`'gan_head'`,
        `'gan_head_opt'`) and the logged `fake_grad_norm` (`gan_head_grad_norm`)."""
        updates, opt = self.tx.update(grads["fake"], state["fake_opt"], state["fake"])
        fake = force_normalize(optax.apply_updates(state["fake"], updates))
        entries = {"fake": fake, "fake_opt": opt}
        metrics = {"fake_grad_norm": optax.tree.norm(grads["fake"])}
        if self.gan:
            updates, opt = self.head_tx.update(grads["gan_head"], state["gan_head_opt"],
                                               state["gan_head"])
            entries.update(gan_head=optax.apply_updates(state["gan_head"], updates),
                           gan_head_opt=opt)
            metrics["gan_head_grad_norm"] = optax.tree.norm(grads["gan_head"])
        return entries, metrics

    def trains_weights(self, step: Array) -> bool | Array:
        """With the GAN head, whether the step after `step` steps updates the generator:
        `step % dfake_gen_update_ratio == 0` (DMD2's `COMPUTE_GENERATOR_GRADIENT`, the
        first step one), the fake denoiser and the head being updated on every step;
        else True (every step)."""
        if self.update_ratio == 1:
            return True
        return jnp.asarray(step) % self.update_ratio == 0

    def sampler(self, num_steps: int = 32) -> solvers.FewStep:
        """The generator's few-step sampler (its own steps, whatever `num_steps`)."""
        return few_step_sampler(self.config)

    def flops_per_image(self, forward_flops: float) -> float:
        """The generator's `K - 1` stopped steps (computed for every image, masked) and
        its forward and backward pass (3), the real and the fake denoiser at `x_t` (2),
        the fake's forward and backward pass (3): `K + 7` passes; with the GAN head,
        the fake denoiser's encoder's forward and backward pass for each of its three
        terms (9 encoder passes, `gan.ENCODER_SHARE` of a network's each; the head's own
        flops left out, under 1 % of the U-Net's at img64)."""
        passes = int(self.get("distill.steps")) + 7
        if self.gan:
            passes += 3 * 3 * gan_lib.ENCODER_SHARE
        return passes * forward_flops
