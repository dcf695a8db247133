"""`--mode=generate`: images for `--seeds` from `--net` (network checkpoint, run dir or EMA
snapshot) into `--outdir` and/or a `--grid` PNG; `--guide`/`--guidance` for
(auto)guidance; a latent (img512) net's samples are decoded by the SD VAE of `--vae`.

    python -m edm2_jax.main --mode=generate --net=runs/fmnist --seeds=0-63 --grid=grid.png

Also defines the flags of the network and the sampler that `--mode=eval` and
`--mode=phema_sweep` share (`--net`, `--ema`, `--batch`, `--steps`, the schedule).
"""
from __future__ import annotations

from absl import app, flags

from edm2_jax.sampling import generate

FLAGS = flags.FLAGS
flags.DEFINE_string("net", None, "generate: network checkpoint, training run dir or RUN/snapshots/<step>.")
flags.DEFINE_string("ema", None, "generate: which EMA of a run ('0.100', 'online'); default largest sigma_rel.")
flags.DEFINE_string("seeds", "0-63", "generate/eval: seeds, e.g. '0-49999' or '1,5,7-9' (eval "
                    "default: 0..num_images-1).")
flags.DEFINE_string("outdir", None, "generate: directory for PNGs.")
flags.DEFINE_bool("subdirs", False, "generate: one subdirectory per 1000 seeds.")
flags.DEFINE_string("grid", None, "generate: also write all images as one grid PNG here.")
flags.DEFINE_integer("class_idx", None, "generate: class for every image (default random per seed).")
flags.DEFINE_integer("batch", 64, "generate: images per batch (split over devices).")
flags.DEFINE_integer("steps", 32, "generate: sampler steps N (2N-1 network evaluations).")
flags.DEFINE_string("vae", None, "generate, eval, phema_sweep: the SD VAE that decodes a latent (img512) net's "
                    "samples: its diffusion_pytorch_model.safetensors / .bin or diffusers folder.")
flags.DEFINE_string("guide", None, "generate/eval: guide network (unconditional for CFG, smaller/earlier for autoguidance).")
flags.DEFINE_string("guide_ema", None, "generate: which EMA of the guide run.")
flags.DEFINE_float("guidance", 1.0, "generate/eval: guidance weight w in D_g + w (D - D_g).")
flags.DEFINE_float("S_churn", 0.0, "generate: stochastic churn.")
flags.DEFINE_float("S_min", 0.0, "generate: churn lower sigma.")
flags.DEFINE_float("S_max", float("inf"), "generate: churn upper sigma.")
flags.DEFINE_float("S_noise", 1.0, "generate: churn noise scale.")
flags.DEFINE_float("sigma_min", 0.002, "generate/eval: lowest noise level of the sampler's schedule.")
flags.DEFINE_float("sigma_max", 80.0, "generate/eval: highest noise level of the sampler's schedule.")
flags.DEFINE_enum("rng", "jax", ["jax", "release"], "generate/eval: per-seed noise and labels "
                  "from JAX keys, or drawn as the release's per-seed torch generator does "
                  "(a converted release net then gives the release's image for a seed).")
flags.DEFINE_float("rho", 7.0, "generate/eval: time-step exponent of the schedule (EDM Eq. 5).")


def sampler_flags() -> dict:
    """The EDM sampler's settings from the flags (`generate.generate_images` kwargs)."""
    return dict(num_steps=FLAGS.steps, sigma_min=FLAGS.sigma_min, sigma_max=FLAGS.sigma_max,
                rho=FLAGS.rho, S_churn=FLAGS.S_churn, S_min=FLAGS.S_min, S_max=FLAGS.S_max,
                S_noise=FLAGS.S_noise, rng=FLAGS.rng)


def run() -> None:
    """`--mode=generate` (`generate.main_generate`)."""
    if not FLAGS.net:
        raise app.UsageError("--mode=generate needs --net=PATH")
    generate.main_generate(
        FLAGS.net, FLAGS.seeds, FLAGS.outdir, ema=FLAGS.ema, batch_size=FLAGS.batch,
        class_idx=FLAGS.class_idx, subdirs=FLAGS.subdirs, guide_path=FLAGS.guide,
        guide_ema=FLAGS.guide_ema, guidance=FLAGS.guidance, grid=FLAGS.grid,
        vae_path=FLAGS.vae, **sampler_flags())
