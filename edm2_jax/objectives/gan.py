"""DMD2's GAN head (Yin et al. 2024, arXiv:2405.14867, Sec. 4.3) for the distribution-
matching objective (`objectives/dmd.py`): a classifier of real against generated images
on the fake denoiser's bottleneck features of noisy images.

    E(x; t)   = the output of the fake denoiser's last encoder block at x (its
                bottleneck), read with flax's `capture_intermediates` (`features`)
    f(x; t)   = Head(E(x + t n; t))          the logit that x is a training image
    loss_cls  = softplus(-f(y; t_r)) + softplus(f(sg(x0); t_c))     (DMD2's
                `guidance_cls_loss`: trains the head and the fake denoiser's encoder)
    loss_gen  = softplus(-f(x0; t_g)), head and fake denoiser stopped    (DMD2's
                `gen_cls_loss`: reaches the generator through x0 alone)

with `y` a training image, `x0` the generator's image of the same label, the
non-saturating losses of Goodfellow et al. 2014 (Sec. 3) and `t_r`, `t_c`, `t_g` drawn
each on its own from one distribution (`gan_sigma`: uniform over the EDM schedule from 80
to 0.002, DMD2's "diffusion GAN" over all 1000 of its points, as its `compute_cls_logits`
draws them per call). `objectives/dmd.py` adds `N (gen_cls_loss_weight loss_gen +
guidance_cls_loss_weight loss_cls)` to each image's loss, `N` its elements: DMD2 weights
the GAN terms (means over images) against its distribution-matching and denoising losses
as means over elements, this objective sums those over each image's elements.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from edm2_jax.model.networks import Precond
from edm2_jax.objectives.base import field
from edm2_jax.sampling.schedule import RHO, SIGMA_MAX, SIGMA_MIN

Array = jax.Array

# The head's settings in `config.distill`, named as DMD2's training scripts name them
# (tianweiy/DMD2, experiments/imagenet/imagenet_gan_classifier_genloss3e-3_diffusion1000_
# lr2e-6_scratch.sh, its ImageNet-64 run): the generator's GAN weight 3e-3
# (`--gen_cls_loss_weight`), the classifier's 1e-2 (`--cls_loss_weight` there,
# `--guidance_cls_loss_weight` in its Stable Diffusion scripts), 5 updates of the fake
# denoiser and head per generator update (`--dfake_gen_update_ratio`, Sec. 4.2's two
# time-scale rule). `gan_head_lr`: the head's Adam learning rate, 0 for the fake
# denoiser's `fake_lr` (DMD2 trains both with one optimiser, `--guidance_lr`).
# `gan_features`: whose bottleneck the head reads, 'fake' (DMD2's: the fake denoiser,
# which `loss_cls` trains too) or 'teacher' (the frozen teacher's, as LADD's
# discriminator reads its teacher's features, Sauer et al. 2024, arXiv:2403.12015,
# Sec. 3.2: features that do not move under the head; `loss_cls` trains the head
# alone). `gan_sigma_max`: the highest noise level of the head's images (`gan_sigma`;
# DMD2's 80, its schedule's top, where half of the draws lie above 2.5). All but `gan`
# are read only with `gan=True`.
GAN_FIELDS = dict(gan=False, gen_cls_loss_weight=3e-3, guidance_cls_loss_weight=1e-2,
                  dfake_gen_update_ratio=5, gan_head_lr=0.0, gan_features="fake",
                  gan_sigma_max=SIGMA_MAX)
GAN_FEATURES = ("fake", "teacher")
# The U-Net encoder's share of its forward pass's flops (XLA's counts of the compiled
# passes on CPU: 0.263 for img64-s, 0.156 for configs/fashion_mnist.py's network), for the
# plan's flops of the head's encoder passes (`DistributionMatching.flops_per_image`).
ENCODER_SHARE = 0.26
# Draws per image the head adds to DMD's (`rnd_normal` [B, 3], `noise_unit` [B, 3, H, W,
# C]): the noise levels and noise of the real, the generated (stopped) and the
# generator's images.
NUM_DRAWS = 3


def check_gan(config: Any) -> None:
    """Raise ValueError naming the `--config.distill` flag where a setting of the head is
    not one: `gan` a bool, the weights numbers >= 0, the update ratio an int >= 1, the
    head's learning rate a number >= 0, `gan_features` one of `GAN_FEATURES`,
    `gan_sigma_max` a number above the schedule's lowest level."""
    d = field(config, "distill", {})

    def need(ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ValueError(f"--config.distill.{name}={d.get(name, GAN_FIELDS[name])!r}: "
                             f"{what}")

    def number(name: str) -> bool:
        v = d.get(name, GAN_FIELDS[name])
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0

    need(isinstance(d.get("gan", False), bool), "gan", "True or False (DMD2's GAN head)")
    for name in ("gen_cls_loss_weight", "guidance_cls_loss_weight"):
        need(number(name), name, f"a weight >= 0, e.g. {GAN_FIELDS[name]} (DMD2)")
    ratio = d.get("dfake_gen_update_ratio", GAN_FIELDS["dfake_gen_update_ratio"])
    need(isinstance(ratio, int) and not isinstance(ratio, bool) and ratio >= 1,
         "dfake_gen_update_ratio", "updates of the fake denoiser per generator update, "
         "an int >= 1, e.g. 5 (DMD2)")
    need(number("gan_head_lr"), "gan_head_lr",
         "the head's learning rate, >= 0 (0: distill.fake_lr)")
    need(d.get("gan_features", GAN_FIELDS["gan_features"]) in GAN_FEATURES, "gan_features",
         "whose bottleneck the head reads: " + " or ".join(map(repr, GAN_FEATURES)))
    need(number("gan_sigma_max") and d.get("gan_sigma_max", SIGMA_MAX) > SIGMA_MIN,
         "gan_sigma_max", f"the highest noise level of the head's images, > {SIGMA_MIN}, "
         f"e.g. {SIGMA_MAX} (DMD2)")


def gan_sigma(rnd_normal: Array, *, sigma_min: float = SIGMA_MIN,
              sigma_max: float = SIGMA_MAX, rho: float = RHO) -> Array:
    """Noise levels of the classifier: the EDM schedule (Karras et al. 2022, Eq. 5) at a
    time `u = Phi(z)` uniform over [0, 1] of standard normal draws `z`, the continuous
    form of DMD2's uniform draw over its 1000-point schedule. float32 of `rnd_normal`'s
    shape."""
    u = jax.scipy.special.ndtr(jnp.asarray(rnd_normal, jnp.float32))
    a, b = sigma_max ** (1 / rho), sigma_min ** (1 / rho)
    return (a + u * (b - a)) ** rho


def bottleneck(unet_params: Any) -> tuple[str, int]:
    """`(name, channels)` of the U-Net's last encoder block (`'enc_8x8_block2'` for img64),
    from the names and shapes of its weights `params['unet']` alone: the lowest
    resolution's last block, and its output channels (the last axis of its weights)."""
    def order(name: str) -> tuple[int, int]:   # enc_{r}x{r}_{conv|down|block<i>}
        res, kind = name[len("enc_"):].split("_", 1)
        return -int(res.split("x")[0]), int(kind[5:]) if kind.startswith("block") else -1
    name = max((k for k in unet_params if k.startswith("enc_")), key=order)
    block = unet_params[name]
    weight = block["conv_res1"]["weight"] if "conv_res1" in block else block["weight"]
    return name, int(weight.shape[-1])


def features(net: Precond, params: Any, buffers: Any, x: Array, sigma: Array,
             labels: Array | None, *, train: bool = False,
             rngs: dict | None = None) -> Array:
    """The output of the U-Net's last encoder block (`bottleneck`) at the noisy images
    `x` `[B, H, W, C]` of noise levels `sigma` `[B]`, in float32 (as DMD2 reads its
    bottleneck). The decoder's work is computed but unused: jit drops it."""
    name, _ = bottleneck(params["unet"])
    _, state = net.apply({"params": params, "buffers": buffers}, x, sigma, labels,
                         train=train, rngs=rngs or {}, mutable=["intermediates"],
                         capture_intermediates=lambda m, method: (
                             m.name == name and method == "__call__"))
    feats, = state["intermediates"]["unet"][name]["__call__"]
    return feats.astype(jnp.float32)


class Head(nn.Module):
    """The classifier on the bottleneck, plain flax in float32 (not the paper's MP
    network), DMD2's `cls_pred_branch`: a 4x4 convolution of stride 2 (8x8 -> 4x4),
    GroupNorm, SiLU; a convolution over the whole remaining map (DMD2's 4x4 of stride
    4: 4x4 -> 1x1), GroupNorm, SiLU; a 1x1 convolution (here a dense layer) to one
    logit. GroupNorm of DMD2's 32 groups where each holds at least 16 channels (its
    768 hold 24), else of 16 channels each: on the 1x1 map a group of 2 channels would
    normalise every output to +-1. Call: `[B, h, w, C]` -> `[B]` float32."""

    @nn.compact
    def __call__(self, x: Array) -> Array:
        x = jnp.asarray(x, jnp.float32)
        channels = x.shape[-1]
        groups = math.gcd(channels, max(1, min(32, channels // 16)))
        x = nn.Conv(channels, (4, 4), strides=(2, 2), padding="SAME")(x)
        x = nn.silu(nn.GroupNorm(num_groups=groups)(x))
        x = nn.Conv(channels, x.shape[1:3], padding="VALID")(x)
        x = nn.silu(nn.GroupNorm(num_groups=groups)(x))
        return nn.Dense(1)(x.reshape(x.shape[0], -1))[:, 0]


def init_head(unet_params: Any, rng: Array) -> Any:
    """The head's initial weights (flax's default initialisers) for the bottleneck of a
    U-Net of weights `unet_params` (its resolution read from the block's name,
    `enc_{r}x{r}_...`)."""
    name, channels = bottleneck(unet_params)
    r = int(name[len("enc_"):].split("x")[0])
    return Head().init(rng, jnp.zeros((1, r, r, channels), jnp.float32))["params"]


def classifier_loss(real_logits: Array, fake_logits: Array) -> Array:
    """`softplus(-f_real) + softplus(f_fake)` per image: the non-saturating classifier
    loss of real against generated logits, `[B]` each. float32 `[B]`."""
    return jax.nn.softplus(-real_logits) + jax.nn.softplus(fake_logits)


def generator_loss(fake_logits: Array) -> Array:
    """`softplus(-f(G))` per image: the non-saturating generator loss. float32 `[B]`."""
    return jax.nn.softplus(-fake_logits)


def gan_losses(net: Precond, buffers: Any, fake: Any, head: Any, x0: Array, images: Array,
               labels: Array | None, *, rnd_normal: Array, noise_unit: Array,
               dropout_rng: Array | None, sigma_max: float = SIGMA_MAX
               ) -> tuple[Array, Array, dict]:
    """`(loss_gen, loss_cls, aux)` of the module docstring, `[B]` float32 each.

    Args:
      net, buffers: the fake denoiser's `Precond` and `MPFourier` buffers.
      fake, head: the fake denoiser's and the head's weights; `loss_cls` trains both,
        `loss_gen` neither (stopped).
      x0: the generator's images `[B, H, W, C]` (gradient flows through `loss_gen`).
      images: training images `y` `[B, H, W, C]`, in the network's data scale.
      labels: `[B, label_dim]` or None, for the real and the generated images alike.
      rnd_normal: `[B, 3]` standard normal draws (`t_r`, `t_c`, `t_g`).
      noise_unit: `[B, 3, H, W, C]` unit Gaussian noise of the three.
      dropout_rng: the fake denoiser's dropout key for the three passes, or None.
      sigma_max: the highest of the noise levels (`gan_sigma`; DMD2's 80).
    Returns `aux = {'real_prob', 'fake_prob'}` `[B]`: the classifier's sigmoid of the real
    and the generated images.
    """
    sg = jax.lax.stop_gradient

    def logit(p_fake, p_head, x, i):
        t = gan_sigma(rnd_normal[:, i], sigma_max=sigma_max)
        rngs = ({"dropout": jax.random.fold_in(dropout_rng, i)} if dropout_rng is not None
                else None)
        x_t = x + t.reshape(-1, 1, 1, 1) * noise_unit[:, i]
        e = features(net, p_fake, buffers, x_t, t, labels, train=True, rngs=rngs)
        return Head().apply({"params": p_head}, e)

    x0 = jnp.asarray(x0, jnp.float32)
    real = logit(fake, head, jnp.asarray(images, jnp.float32), 0)
    generated = logit(fake, head, sg(x0), 1)
    gen = logit(sg(fake), sg(head), x0, 2)
    return (generator_loss(gen), classifier_loss(real, generated),
            {"real_prob": jax.nn.sigmoid(real), "fake_prob": jax.nn.sigmoid(generated)})
