"""Few-step students: multistep consistency distillation of an EDM2 network
(edm2_jax/objectives/distill.py, docs/distillation.md).

    # the quick start's run as teacher, a 4-step student (24 kimg; its figures: the
    # results entry mcd-4 of docs/results.json)
    python -m edm2_jax.main --config=configs/distill.py --workdir=runs/fmnist-4step \
        --config.distill.teacher=runs/fmnist
    python -m edm2_jax.main --mode=generate --net=runs/fmnist-4step --seeds=0-99 --grid=grid.png
    # a released network, converted first (--mode=convert), as teacher
    python -m edm2_jax.main --config=configs/distill.py:img64-s --workdir=runs/img64-s-2step \
        --config.distill.teacher=nets/img64-s --config.distill.steps=2
    python -m edm2_jax.main --config=configs/distill.py:tiny --workdir=/tmp/d \
        --config.distill.teacher=/tmp/t   # smoke test, from a fashion_mnist.py:tiny run
    # distribution matching (DMD2, objectives/dmd.py): a 1-step generator (32 kimg)
    python -m edm2_jax.main --config=configs/distill.py:dmd --workdir=runs/fmnist-dmd1 \
        --config.distill.teacher=runs/fmnist
    python -m edm2_jax.main --config=configs/distill.py:dmd-img64-s --workdir=runs/img64-s-dmd1 \
        --config.distill.teacher=nets/img64-s
    # with DMD2's GAN head (objectives/gan.py): a 1-step generator (128 kimg, read at
    # --ema=0.030; its figures: the results entry dmd-gan-1 of docs/results.json)
    python -m edm2_jax.main --config=configs/distill.py:dmd-gan --workdir=runs/fmnist-dmd1-gan \
        --config.distill.teacher=runs/fmnist
    python -m edm2_jax.main --config=configs/distill.py:dmd-gan-img64-s \
        --workdir=runs/img64-s-dmd1-gan --config.distill.teacher=nets/img64-s
    # continuous-time consistency (sCM, objectives/scm.py): a 2-step sCD student, an sCT one
    python -m edm2_jax.main --config=configs/distill.py:scm --workdir=runs/fmnist-scm2 \
        --config.distill.teacher=runs/fmnist
    python -m edm2_jax.main --config=configs/distill.py:sct --workdir=runs/fmnist-sct2 \
        --config.distill.teacher=runs/fmnist        # the network sCT starts from
    python -m edm2_jax.main --config=configs/distill.py:scm-img512-s \
        --workdir=runs/img512-s-scm2 --config.distill.teacher=nets/img512-s
    python -m edm2_jax.main --config=configs/distill.py:scm-tiny --workdir=/tmp/s \
        --config.distill.teacher=/tmp/t   # smoke test, from a fashion_mnist.py:tiny run

The student is the teacher's network (its architecture is read from the teacher; the
config's `network` is replaced), initialised from its weights; `distill.steps` is the
number of sampling steps it is trained for. Variants: 'fashion_mnist' (default), 'tiny',
'dmd' (Fashion-MNIST, distribution matching), 'dmd-tiny', a preset of configs/img64.py /
configs/img512.py ('img64-s', 'img512-xs', ...), 'dmd-' and a preset
('dmd-img64-s': distribution matching of that preset's network), and each 'dmd' variant
with DMD2's GAN head as 'dmd-gan', 'dmd-gan-tiny', 'dmd-gan-img64-s', ...; sCM:
'scm' (2-step sCD, Fashion-MNIST), 'scm-tiny', 'sct' (2-step sCT, Fashion-MNIST) and
'scm-' and a preset ('scm-img512-s': 2-step sCD of that preset's network, the paper's
settings).
"""
import os

import numpy as np

from edm2_jax import configs
from edm2_jax.model import presets
from edm2_jax.objectives import scm
from edm2_jax.training import optim


def _fashion_mnist_config(variant: str):
    return configs.config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "fashion_mnist.py"), variant)


def _distill(c):
    return configs.with_objective(c, "consistency")


def get_config(variant: str = "fashion_mnist"):
    variant = variant or "fashion_mnist"
    if variant.startswith("dmd-gan") and variant[len("dmd-gan"):] in (
            "", "-tiny", *(f"-{p}" for p in presets.NETWORK_PRESETS)):
        return _gan(get_config(variant.replace("dmd-gan", "dmd", 1)), variant)
    if variant in ("dmd", "dmd-tiny"):
        c = _dmd(get_config("tiny" if variant == "dmd-tiny" else "fashion_mnist"))
        if variant == "dmd":
            c.total_kimg = 32   # results entry dmd-1 (docs/results.json)
        return c
    if variant.startswith("dmd-") and variant[4:] in presets.NETWORK_PRESETS:
        return _dmd_preset(get_config(variant[4:]))
    if variant in ("scm", "scm-tiny", "sct"):
        return _scm(get_config("tiny" if variant == "scm-tiny" else "fashion_mnist"), variant)
    if variant.startswith("scm-") and variant[4:] in presets.NETWORK_PRESETS:
        return _scm_preset(get_config(variant[4:]), variant[4:])
    if variant in ("fashion_mnist", "tiny"):
        c = _distill(_fashion_mnist_config("tiny" if variant == "tiny" else "default"))
        # Fine-tuning from a trained network: the teacher's final learning rate after a
        # short ramp-up, then decaying as 1/sqrt(t) from 6 kimg (t_ref = 94 batches of
        # 64) to half of it at 24 kimg. Held constant instead, the 1- and 2-step students
        # learn far less (docs/distillation_measurements.md, "The learning rate").
        c.optim.update(ref_lr=0.005, t_ref=94, rampup_kimg=0.5)
        if variant == "tiny":
            c.optim.update(rampup_kimg=0.064, t_ref=0)
            return c
        # The teacher's Heun sampler keeps its quality down to 8 steps
        # (docs/distillation_measurements.md): the coarsest such grid bootstraps least.
        c.distill.teacher_steps = 8
        c.total_kimg = 24
        c.checkpoint_kimg = c.snapshot_kimg = 4
        return c
    if variant not in presets.NETWORK_PRESETS:
        raise ValueError(f"unknown variant {variant!r}; use 'fashion_mnist', 'tiny', 'dmd', "
                         f"'dmd-tiny', a preset or 'dmd-' and a preset, or any 'dmd' "
                         f"variant with 'dmd-gan' in place of 'dmd', 'scm', 'scm-tiny', "
                         f"'sct' or 'scm-' and a preset; presets: "
                         f"{', '.join(sorted(presets.NETWORK_PRESETS))}")
    c = _distill(configs.preset_config(variant))
    t = presets.TRAINING_PRESETS[variant]
    if variant.startswith("img512"):
        c.data.update(source="folder", encoder="sd-vae")
    else:
        c.data.update(source="tfds", name="imagenet2012")
    # The teacher's learning rate at the end of its training (`optim.learning_rate`),
    # held constant; 5 % of the teacher's training images.
    end_lr = float(optim.learning_rate(t["total_kimg"] * 1000, batch_size=t["batch_size"],
                                       ref_lr=t["ref_lr"], t_ref=t["t_ref"],
                                       rampup_kimg=t["rampup_kimg"], xp=np))
    c.optim.update(ref_lr=end_lr, t_ref=0, rampup_kimg=t["total_kimg"] / 1000)
    c.total_kimg = 0.05 * t["total_kimg"]
    return c


def _dmd(c):
    """Distribution matching (objectives/dmd.py): a 1-step generator from noise at sigma
    2.5 (the teacher's denoiser there depends on its input noise; at sigma 80 it gives
    nearly its class means, a collapsed start), on a grid of 8 points down to 0.002; the
    generator's learning rate 0.002 decaying from 6 kimg, the fake denoiser's 0.02
    (ten times: the fake must follow the generator)."""
    configs.with_objective(c, "dmd")
    c.distill.update(steps=1, sigma_max=2.5, fake_lr=0.02)
    c.optim.ref_lr = 0.002
    return c



def _dmd_preset(c):
    """Distribution matching of a release preset: a 1-step generator from noise at sigma
    2.5 (SiD's generator input level, Zhou et al. 2024, arXiv:2404.04057; DMD2 starts
    from 80, with its GAN head), the generator at the teacher's final learning rate and
    the fake denoiser at ten times it (the ratio measured on Fashion-MNIST; DMD2 gives
    the fake five updates per generator update instead), for the consistency presets'
    5 % of the teacher's training images (DMD2's ImageNet-64 generator: 200k iterations
    of batch 280, 56 M images, against the img64 teachers' 1 to 2 G)."""
    configs.with_objective(c, "dmd")
    c.distill.update(steps=1, sigma_max=2.5, fake_lr=10 * c.optim.ref_lr)
    return c


def _gan(c, variant: str):
    """DMD2's GAN head (objectives/gan.py; DMD2's weights of the classifier's terms).
    A preset's generator as DMD2's ImageNet-64 one: from noise at sigma 80, one learning
    rate (the teacher's final) for it, the fake denoiser and the head, 5 updates of the
    fake and the head per generator update. On Fashion-MNIST, the one-step generator
    measured in docs/distillation_measurements.md ("One step at its teacher"): 'dmd''s time scales
    (the fake at ten times the generator's rate, both updated on every step: 5 updates
    per generator update would leave it 100 in 32 kimg), the head at the generator's
    rate (a plain flax head at the fake's 0.02 moves by its weights' own scale per step)
    on the frozen teacher's bottleneck, the generator's GAN weight 0.3 (the best of 0.03,
    0.3 and 1.0 at 16 kimg), batches of 32 (twice the updates of 64 in the same time)
    for 128 kimg: the results entry dmd-gan-1 (docs/results.json); 'dmd-gan-tiny' keeps
    the ratio of 5, so a smoke run holds
    the generator on 4 steps of 5."""
    c.distill.gan = True
    if variant == "dmd-gan":
        c.distill.update(dfake_gen_update_ratio=1, gan_head_lr=c.optim.ref_lr,
                         gen_cls_loss_weight=0.3, gan_features="teacher")
        c.batch_size = 32
        c.total_kimg = 128
        c.snapshot_kimg = 16
        c.ema.sigma_rels = (0.03, 0.10)   # read at 0.03: the higher recall in all three seeds
    elif variant != "dmd-gan-tiny":
        c.distill.update(sigma_max=80.0, fake_lr=c.optim.ref_lr)
    return c


def _scm(c, variant: str):
    """Continuous-time consistency (objectives/scm.py) on Fashion-MNIST: 2 steps, sCD
    through t_mid = 1.45 (sigma 4.1: objectives/scm.py's default, the paper's 1.1,
    measures worse here, results entry `scm-t-mid`), sCT through 1.1; batches of 64 at
    1e-3 (the teacher's 0.01 / 10), sCD for 192 kimg with the rate decaying as 1/sqrt(t)
    from 48 kimg (t_ref = 750 batches; to half of it at 192), sCT for 48 kimg at a
    constant rate; the tangent warmed up over the
    first 2 kimg (the paper's 10k of 200k-400k iterations is 2.5-5 % of its training; a
    short run takes more), normalised by its RMS with the error weighted by 1 / sigma
    (NVlabs/FastGen's settings; with the paper's L2 norm the tangent grows at these
    rates), and a wide proposal, P_mean 0.4, P_std 2.0, which trains the large noise
    levels the first step starts from (the CIFAR-10 proposal, -1.0, 1.4, leaves them as
    the teacher had them). Measured: results entries `scm-1`, `scm-2`, `scm-length`,
    `scm-longer`, `scm-proposal`, `sct-2`, `scm-t-mid` and `scm-settings`
    (docs/results.json). 'sct': the same as sCT, started from the network
    `distill.teacher` names."""
    configs.with_objective(c, "scm")
    c.distill.update(steps=2, P_mean=0.4, P_std=2.0, training=variant == "sct",
                     tangent_norm="rms", prior_weighting=True)
    if variant == "scm-tiny":
        c.distill.warmup_kimg = 0.064
        return c
    c.distill.warmup_kimg = 2.0
    c.optim.ref_lr = 0.001
    if variant == "scm":  # sCD: 192 kimg, the rate decaying from 48 kimg
        c.distill.t_mid = 1.45
        c.optim.t_ref, c.total_kimg = 750, 192
        c.snapshot_kimg = c.checkpoint_kimg = 32
    else:  # sCT: 48 kimg at a constant rate
        c.optim.t_ref, c.total_kimg = 0, 48
    return c


def _scm_preset(c, preset: str):
    """sCD of a release preset (2 steps), the paper's settings for its consistency
    models: the proposal (ImageNet 64x64: P_mean -1.0, P_std 1.6; 512x512: -0.8, 1.6),
    c = 0.1, the tangent warmed up over 10k iterations of 2048 images, Adam's eps 1e-11,
    the learning rate 1/100 of the teacher's (1e-4 for S) with the teacher's decay
    `t_ref`, and the sCD iterations (img64: 400k, img512: 200k batches of 2048). The
    teacher unguided: the paper's teachers learn an unconditional slot (label dropout),
    which the release's networks do not (their guide is another network)."""
    configs.with_objective(c, "scm")
    t = presets.TRAINING_PRESETS[preset]
    P_mean, P_std = scm.PROPOSALS["img512" if preset.startswith("img512") else "img64"]
    c.distill.update(steps=2, P_mean=P_mean, P_std=P_std, warmup_kimg=scm.WARMUP_KIMG)
    c.optim.update(ref_lr=round(t["ref_lr"] / 100, 12), t_ref=t["t_ref"], rampup_kimg=0.0, eps=1e-11)
    iterations = 200_000 if preset.startswith("img512") else 400_000
    c.total_kimg = iterations * t["batch_size"] / 1000
    return c
