"""`--mode=phema` and `--mode=phema_sweep`: post-hoc EMA (the paper's Sec. 3, Alg. 3) of a
training run's EMA snapshots (the bodies: `ema.reconstruction`, `ema.sweep`).

  phema        `--workdir=RUN --sigma_rel=0.05,0.1 [--at_kimg] [--per_tensor]`
               reconstructs network checkpoints from the run's EMA snapshots.
  phema_sweep  reconstruct each `--sigma_rel`, evaluate `--metrics` (one of cls, fid,
               fd_dinov2) on `--num_images`, write a CSV and plot, name the best;
               reference data: `--config`, else the run's config.json.

    python -m edm2_jax.main --mode=phema --workdir=runs/fmnist --sigma_rel=0.05,0.10
"""
from __future__ import annotations

import os

from absl import flags

from edm2_jax import paths
from edm2_jax.ema import reconstruction, sweep
from edm2_jax.ema import power as ema_power
from edm2_jax.modes import common
from edm2_jax.modes import evaluate as evaluate_mode  # noqa: F401 (--metrics, --num_images, --ref)
from edm2_jax.modes import generate as generate_mode  # --batch, --steps, --vae, --outdir

FLAGS = flags.FLAGS
flags.DEFINE_string("sigma_rel", "0.05,0.10", "phema: comma list of EMA lengths sigma_rel.")
flags.DEFINE_float("at_kimg", None, "phema: reconstruct at this time (default: the last snapshot).")
flags.DEFINE_string("per_tensor", None, "phema: 'REGEX=SIGMA_REL;...' different sigma_rel per parameter path.")


def sigma_rels() -> list[float]:
    """`--sigma_rel` as a list of floats. Raises ValueError naming the flag for an item
    that is not a number in (0, `ema.SIGMA_REL_MAX`] (NaN and inf included)."""
    try:
        values = [float(x) for x in FLAGS.sigma_rel.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v <= ema_power.SIGMA_REL_MAX for v in values):
        raise ValueError(f"--sigma_rel={FLAGS.sigma_rel}: give EMA widths in "
                         f"(0, {ema_power.SIGMA_REL_MAX:.3f}], e.g. --sigma_rel=0.05,0.10")
    return values


def check_phema_dirs(workdir: str) -> None:
    """Before any snapshot is read: a `gs://` run's bucket reachable, and the outputs'
    directory (`--outdir`, default `WORKDIR/phema`) writable, with names its file system
    takes."""
    if paths.is_url(workdir):
        common.check_output_dir(workdir, "--workdir")
    if FLAGS.outdir:
        common.check_output_dir(FLAGS.outdir, "--outdir")
        generate_mode.check_output_name(FLAGS.outdir, "--outdir")
    elif paths.isdir(workdir):  # a missing run is named by the reader
        try:
            common.check_output_dir(os.path.join(workdir, "phema"), "--outdir")
        except paths.OutputLocationError as e:
            raise paths.OutputLocationError(f"{e} (--outdir defaults to WORKDIR/phema)") from None


def run_phema() -> None:
    """`--mode=phema` (`reconstruction.main_phema`)."""
    workdir = common.require_workdir()
    widths = sigma_rels()
    check_phema_dirs(workdir)
    reconstruction.main_phema(workdir, widths, FLAGS.at_kimg, FLAGS.outdir, FLAGS.per_tensor)


def run_sweep() -> None:
    """`--mode=phema_sweep` (`sweep.main_sweep`)."""
    workdir = common.require_workdir()
    widths = sigma_rels()
    check_phema_dirs(workdir)
    sweep.main_sweep(
        workdir, widths, metrics=FLAGS.metrics, num_images=FLAGS.num_images,
        batch_size=FLAGS.batch, num_steps=FLAGS.steps if FLAGS["steps"].present else None,
        ref=FLAGS.ref,
        ref_split=FLAGS.ref_split, data_config=common.data_config(), at_kimg=FLAGS.at_kimg,
        out_dir=FLAGS.outdir, per_tensor=FLAGS.per_tensor, dinov2=FLAGS.dinov2,
        vae_path=FLAGS.vae)
