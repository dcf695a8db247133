"""`--mode=eval` and `--mode=ref` (the bodies: `evaluation.commands`).

  eval  metrics (`--metrics=fid,fd_dinov2,cls`) of `--images=DIR` or of `--net` generating
        `--num_images`; reference: `--ref=stats.pkl` or the dataset of `--config`;
        fd_dinov2 reads the DINOv2 ViT-L/14 weights from `--dinov2=PATH`.
  ref   reference statistics of `--images=DIR|ZIP` (or the `--ref_split` split of
        `--config`'s data) for `--metrics=fid,fd_dinov2`, written to `--ref=OUT.pkl` in
        the release's format (its `calculate_metrics.py ref`).

    python -m edm2_jax.main --mode=eval --net=nets/img64-s --ref=img64.pkl --num_images=50000

Defines the metric flags `--mode=phema_sweep` shares (`--metrics`, `--num_images`,
`--ref`, `--ref_split`, `--dinov2`); the network and sampler flags are `modes/generate.py`'s.
"""
from __future__ import annotations

import os

from absl import app, flags

from edm2_jax import paths
from edm2_jax.evaluation import commands as eval_commands
from edm2_jax.modes import common
from edm2_jax.modes import generate as generate_mode  # --net, --batch, the sampler's flags

FLAGS = flags.FLAGS
flags.DEFINE_string("images", None, "eval: folder of images to evaluate instead of --net.")
flags.DEFINE_integer("subset_seed", 0, "eval: seed of the random subset of --images when it holds "
                     "more than --num_images (the release's calculate_metrics.py --seed).")
flags.DEFINE_integer("num_images", 50000, "eval: number of images (error if fewer are available).")
flags.DEFINE_string("metrics", "fid", "eval: comma list of fid (Inception), fd_dinov2 (DINOv2 "
                    "ViT-L/14), cls (classifier FD/KID/PR).")
flags.DEFINE_string("ref", None, "eval: reference statistics (.pkl/.npz) for fid / fd_dinov2; "
                    "ref: the .pkl to write.")
flags.DEFINE_string("dinov2", None, "eval, ref, phema_sweep: DINOv2 ViT-L/14 weights for fd_dinov2 "
                    "(dinov2_vitl14_pretrain.pth of the official release, or a .safetensors).")
flags.DEFINE_string("out_json", None, "eval: append the results as one JSON line here.")
flags.DEFINE_string("ref_split", "test", "eval: split of the --config dataset used as reference.")
flags.DEFINE_string("data_split_images", None, "eval: evaluate N images of this split of the --config "
                    "dataset instead of --net/--images (the floor a perfect model reaches).")


def run_eval() -> None:
    """`--mode=eval` (`commands.main_eval`)."""
    seeds = FLAGS.seeds if FLAGS["seeds"].present else None
    common.check_output_file(FLAGS.out_json, "--out_json")  # before any work
    out_dir = os.path.dirname(paths.normalize(FLAGS.out_json or "."))
    if FLAGS.out_json and not paths.is_url(out_dir) and not os.path.isdir(out_dir):
        raise FileNotFoundError(f"--out_json={FLAGS.out_json}: its directory {out_dir} does "
                                f"not exist; create it or pass a file in an existing one")
    eval_commands.main_eval(
        images_dir=FLAGS.images, net_path=FLAGS.net,
        num_images=None if seeds and not FLAGS["num_images"].present else FLAGS.num_images,
        metrics=FLAGS.metrics, ref=FLAGS.ref, ref_split=FLAGS.ref_split,
        data_split_images=FLAGS.data_split_images, data_config=common.data_config(),
        ema=FLAGS.ema, batch_size=FLAGS.batch, out_json=FLAGS.out_json,
        class_idx=FLAGS.class_idx, seeds=seeds, subset_seed=FLAGS.subset_seed,
        guide_path=FLAGS.guide, guide_ema=FLAGS.guide_ema, guidance=FLAGS.guidance,
        dinov2=FLAGS.dinov2, vae_path=FLAGS.vae, **generate_mode.sampler_flags())


def run_ref() -> None:
    """`--mode=ref` (`commands.main_ref`)."""
    if not FLAGS.ref:
        raise app.UsageError("--mode=ref needs --ref=OUT.pkl (where to write the statistics)")
    common.check_output_file(FLAGS.ref, "--ref")  # before any work
    eval_commands.main_ref(
        dest=FLAGS.ref, images_dir=FLAGS.images, data_config=common.data_config(),
        split=FLAGS.ref_split, metrics=FLAGS.metrics, batch_size=FLAGS.batch,
        num_images=FLAGS.num_images if FLAGS["num_images"].present else None,
        dinov2=FLAGS.dinov2)
