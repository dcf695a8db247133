"""The 2D toy's denoiser distilled by distribution matching (DMD2, `objectives.dmd`;
docs/toy_2d.md, "Distilled into few steps"), with DMD2's GAN head (`objectives.gan`) as
an option, beside the consistency students of `toy.distill`.

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

With the GAN head (`DMDSettings.gan`; DMD2, Yin et al. 2024, arXiv:2405.14867, Sec. 4.3)
a classifier `ToyHead` reads a denoiser's last hidden layer (`features`: the `hidden`
features its output layer reads, the MLP's analogue of the U-Net's bottleneck) at noisy
points and learns the mixture's points `y` (of the generated points' classes) against
the generated ones:

    f(x; t)   = ToyHead(features(D_E, x + t n; t)),   t = gan.gan_sigma(z)
    loss_cls  = gan.classifier_loss(f(y; t_r), f(sg x0; t_c))     the head (and D_E)
    loss_gen  = gan.generator_loss(f(x0; t_g)), head and D_E stopped     the generator

and each point's loss gains `N (gen_cls_loss_weight loss_gen + guidance_cls_loss_weight
loss_cls)`, `N = 2` its elements, as `objectives.dmd.dmd_objective` adds them; the noise
levels are `gan_sigma`'s over the toy's range (`TOY_DM_SCHEDULE`). `D_E` is the frozen
teacher (`gan_features='teacher'`, the toy's default: LADD's discriminator on its
teacher's features, Sauer et al. 2024, arXiv:2403.12015, as `objectives.gan` offers;
`loss_cls` trains the head alone) or DMD2's fake denoiser (`'fake'`; `loss_cls` trains
it too). The generator and the fake denoiser both update on every step, as without the
head (DMD2's `dfake_gen_update_ratio` is not taken: the rows with and without the head
differ in the head alone).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from edm2_jax.ema import power as ema_lib
from edm2_jax.model import mp, presets
from edm2_jax.objectives import dmd, gan
from edm2_jax.objectives.distill import grid_index
from edm2_jax.sampling.schedule import RHO, SIGMA_MIN
from edm2_jax.toy.data import Mixture, sample_mixture
from edm2_jax.toy.denoiser import ToyDenoiser, optimizer, optimizer_steps

Array = jax.Array
# The noise levels of `dm_sigma` and `gan_sigma` on the toy: its sampler's range
# (`toy.distill`'s grid).
TOY_DM_SCHEDULE = dict(sigma_min=SIGMA_MIN, sigma_max=5.0, rho=RHO)


@dataclasses.dataclass(frozen=True)
class DMDSettings:
    """How each generator trains: `steps` Adam steps of `batch` points, `lr = ref_lr /
    sqrt(max(step / t_ref, 1))` for the generator, `fake_lr` (constant) for the fake
    denoiser (both Adam, betas (0.9, 0.99)), the generator's returned
    weights a power EMA of width `ema_sigma_rel`; one generator per `K` in `students`,
    on the grid of `teacher_steps` points from `sigma_max` to `sigma_min`.

    `gan`: with DMD2's GAN head (module docstring), its Adam at `gan_head_lr` (0:
    `fake_lr`, as DMD2 trains head and fake denoiser with one optimiser), reading the
    last hidden layer of `gan_features` ('teacher' or 'fake'). The defaults are those
    under which the head changes the toy's 1-step generator (docs/toy_2d.md, "The GAN
    head on the toy": seeds 0 to 2). On the fake denoiser's features, which move at its
    constant `fake_lr`, the classifier is at chance from the 512th step on; on the
    frozen teacher's it is not. The weights are not DMD2's 3e-3 and 1e-2
    (`gan.GAN_FIELDS`), set against images' losses: on the toy, at
    `gen_cls_loss_weight = 0.3` the norm of the GAN term's gradient in the generator's
    weights is 3% to 230% of `loss_G`'s (at 7 points of a 4096-step training of the
    1-step generator, seed 0), at DMD2's 3e-3 a hundredth of that, too little to move
    it; at 1 it pulls points off the branches again.
    `guidance_cls_loss_weight` only matters with 'fake' (with 'teacher' it scales the
    head's loss alone, which Adam undoes): at 1 the classifier's loss enters the fake
    denoiser's step at the size of its denoising loss (`2 ln 2 N = 2.8` at chance
    against about 1.2); at 30 the 1-step generator's coverage falls to 0.3 (the tiny
    setting, seed 0)."""

    students: tuple[int, ...] = (1, 2, 4)
    steps: int = 4096
    batch: int = 512
    ref_lr: float = 3e-3
    fake_lr: float = dmd.FAKE_LR
    t_ref: int = 512
    ema_sigma_rel: float = 0.05
    chunk: int = 128
    gan: bool = False
    gen_cls_loss_weight: float = 0.3
    guidance_cls_loss_weight: float = 1.0
    gan_head_lr: float = 0.0
    gan_features: str = "teacher"

    @classmethod
    def tiny(cls, **kwargs: Any) -> "DMDSettings":
        """512 steps (tests, CI)."""
        return cls(steps=512, t_ref=128, **kwargs)


# ---------------------------------------------------------------------------------------
# The GAN head.

def features(net: ToyDenoiser, params: Any, buffers: Any, x: Array, sigma: Array,
             labels: Array | None) -> Array:
    """The denoiser's last hidden layer at the noisy points `x` `[B, 2]` of noise levels
    `sigma` `[B]`: the input of its output layer `out_dense` (the residual stream after
    the last block), read by intercepting that layer's call as `gan.features` reads the
    U-Net's bottleneck. float32 `[B, net.hidden]`; the output layer's work is computed
    but unused (jit drops it)."""
    seen = []

    def read(next_fun, args, kwargs, context):
        if context.module.name == "out_dense" and context.method_name == "__call__":
            seen.append(args[0])
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(read):
        net.apply({"params": params, "buffers": buffers}, x, sigma, labels)
    return jnp.asarray(seen[-1], jnp.float32)


class ToyHead(nn.Module):
    """The classifier on `features`, plain flax in float32: DMD2's head (`gan.Head`: a
    layer, GroupNorm, SiLU, a layer to one logit) with dense layers for its convolutions
    and LayerNorm for its GroupNorm (a feature vector has no positions: groups of 2 of
    its 64 features would each normalise to +-1). Call: `[B, C]` -> `[B]` float32."""

    @nn.compact
    def __call__(self, x: Array) -> Array:
        x = jnp.asarray(x, jnp.float32)
        channels = x.shape[-1]
        x = nn.silu(nn.LayerNorm()(nn.Dense(channels)(x)))
        return nn.Dense(1)(x)[:, 0]


def init_head(net: ToyDenoiser, rng: Array) -> Any:
    """`ToyHead`'s initial weights (flax's default initialisers) for `net`'s features."""
    return jax.jit(ToyHead().init)(rng, jnp.zeros((1, net.hidden), jnp.float32))["params"]


def gan_losses(net: ToyDenoiser, buffers: Any, reads: Any, head: Any, x0: Array, y: Array,
               labels: Array, rng: Array) -> tuple[Array, Array, dict]:
    """`(loss_gen, loss_cls, aux)` of the module docstring, `[B]` float32 each, as
    `gan.gan_losses` on images: `reads` the weights of the denoiser `D_E` whose
    `features` the head reads, `head` the head's (`loss_cls` trains both, `loss_gen`
    neither), `x0` the generator's points
    `[B, 2]` (gradient flows through `loss_gen`), `y` mixture points `[B, 2]` of the
    same `labels` `[B, label_dim]`. `aux = {'real_prob', 'fake_prob'}` `[B]`: the
    classifier's sigmoid of the mixture's and the generated points."""
    sg = jax.lax.stop_gradient
    k_t, k_n = jax.random.split(rng)
    z = jax.random.normal(k_t, (x0.shape[0], 3))
    noise = jax.random.normal(k_n, (x0.shape[0], 3, 2))

    def logit(p_reads, p_head, x, i):
        t = gan.gan_sigma(z[:, i], **TOY_DM_SCHEDULE)
        e = features(net, p_reads, buffers, x + t[:, None] * noise[:, i], t, labels)
        return ToyHead().apply({"params": p_head}, e)

    real = logit(reads, head, y, 0)
    generated = logit(reads, head, sg(x0), 1)
    gen = logit(sg(reads), sg(head), x0, 2)
    return (gan.generator_loss(gen), gan.classifier_loss(real, generated),
            {"real_prob": jax.nn.sigmoid(real), "fake_prob": jax.nn.sigmoid(generated)})


# ---------------------------------------------------------------------------------------
# Training.

def dmd_losses(params: dict, buffers: Any, net: ToyDenoiser, teacher_params: Any,
               mix: Mixture, rng: Array, *, batch: int, steps: int, grid: dict,
               gan_weights: tuple[float, float] | None = None,
               gan_features: str = DMDSettings.gan_features) -> tuple[Array, Array, dict]:
    """`(loss_G, loss_F, gan_terms)` of the module docstring, means over `batch` fresh
    draws, for the `steps`-step generator `params['gen']` and its fake denoiser
    `params['fake']`: scalars float32. `grid`: `teacher_steps`, `sigma_min`,
    `sigma_max`, `rho`. With `gan_weights = (gen_cls_loss_weight,
    guidance_cls_loss_weight)` and the head `params['head']`, `loss_G` gains `N
    gen_cls_loss_weight loss_gen` and `loss_F` `N guidance_cls_loss_weight loss_cls`
    (their means), and `gan_terms` holds the means of `gan_losses`' `loss_gen`,
    `loss_cls`, `real_prob` and `fake_prob`; without, it is empty. `gan_features`:
    'fake' (the head reads `params['fake']`) or 'teacher' (`teacher_params`, stopped)."""
    k_cls, k_k, k_g, k_t, k_n, k_tf, k_nf = jax.random.split(rng, 7)
    y_real, cls = sample_mixture(mix, k_cls, batch)
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
    if gan_weights is None:
        return loss_g, loss_f, {}
    reads = params["fake"] if gan_features == "fake" else jax.lax.stop_gradient(teacher_params)
    gen, cls_loss, probs = gan_losses(net, buffers, reads, params["head"], x0, y_real, labels,
                                      jax.random.fold_in(rng, 7))
    w_gen, w_cls = gan_weights
    n = x0.shape[-1]
    terms = {"loss_gen": jnp.mean(gen), "loss_cls": jnp.mean(cls_loss),
             **{name: jnp.mean(v) for name, v in probs.items()}}
    return (loss_g + n * w_gen * terms["loss_gen"], loss_f + n * w_cls * terms["loss_cls"],
            terms)


# The logged columns after `(loss_G, loss_F)` with the head.
GAN_COLUMNS = ("loss_gen", "loss_cls", "real_prob", "fake_prob")


def _gan_weights(settings: DMDSettings) -> tuple[float, float] | None:
    return ((settings.gen_cls_loss_weight, settings.guidance_cls_loss_weight)
            if settings.gan else None)


@functools.partial(jax.jit, static_argnames=("net", "settings", "steps", "grid_items"))
def _dmd_chunk(net, settings, steps, grid_items, mix, teacher_params, carry, rngs):
    def grads_fn(params, buffers, rng):
        def objective(p):   # loss_G reaches the generator only, loss_F the fake (and head)
            lg, lf, terms = dmd_losses(p, buffers, net, teacher_params, mix, rng,
                                       batch=settings.batch, steps=steps,
                                       grid=dict(grid_items),
                                       gan_weights=_gan_weights(settings),
                                       gan_features=settings.gan_features)
            return lg + lf, jnp.stack([lg, lf, *(terms[k] for k in GAN_COLUMNS if terms)])
        return jax.grad(objective, has_aux=True)(params)
    return optimizer_steps(grads_fn, _optimizer(settings), settings.batch,
                           settings.ema_sigma_rel, carry, rngs)


def _optimizer(settings: DMDSettings) -> optax.GradientTransformation:
    """The generator's `denoiser.optimizer`, the fake's (and the head's) Adam at
    `fake_lr`."""
    def adam(lr):
        return optax.adam(lr, b1=presets.ADAM["beta1"], b2=presets.ADAM["beta2"],
                          eps=presets.ADAM["eps"])
    txs = {"gen": optimizer(settings), "fake": adam(settings.fake_lr)}
    if settings.gan:
        txs["head"] = adam(settings.gan_head_lr or settings.fake_lr)
    return optax.multi_transform(txs, {name: name for name in txs})


def train_generator(net: ToyDenoiser, teacher: dict, mix: Mixture, K: int, grid: dict,
                    settings: DMDSettings = DMDSettings(), seed: int = 0
                    ) -> tuple[dict, np.ndarray]:
    """A `K`-step generator of the teacher (`net` with `teacher`'s `{'params',
    'buffers'}`) trained with its fake denoiser (and, with `settings.gan`, the head,
    initialised from `seed`) for `settings.steps` steps. Returns the generator's EMA
    `{'params', 'buffers'}` and the losses of every step (NumPy float32): `[steps, 2]`
    `(loss_G, loss_F)`, with the head `[steps, 6]`, then the `GAN_COLUMNS`. Raises
    ValueError where `settings.gan_features` is not one of `gan.GAN_FEATURES`."""
    if settings.gan and settings.gan_features not in gan.GAN_FEATURES:
        raise ValueError(f"gan_features={settings.gan_features!r}: one of "
                         f"{gan.GAN_FEATURES}")
    w = mp.force_normalize(teacher["params"])
    params = {"gen": w, "fake": w}
    rng = jax.random.PRNGKey(seed)
    if settings.gan:
        params["head"] = init_head(net, jax.random.split(rng)[1])
    ema_state = ema_lib.init_ema_state(params, (settings.ema_sigma_rel,))
    carry = (params, _optimizer(settings).init(params), ema_state, teacher["buffers"],
             jnp.int32(0))
    losses = []
    for start in range(0, settings.steps, settings.chunk):
        n = min(settings.chunk, settings.steps - start)
        carry, loss = _dmd_chunk(net, settings, K, tuple(sorted(grid.items())), mix,
                                 teacher["params"], carry,
                                 jax.random.split(jax.random.fold_in(rng, start), n))
        losses.append(np.asarray(loss))
    ema = carry[2]["power"][ema_lib.ema_key(settings.ema_sigma_rel)]
    return {"params": ema["gen"], "buffers": teacher["buffers"]}, np.concatenate(losses)
