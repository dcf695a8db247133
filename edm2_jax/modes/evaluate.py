"""`--mode=eval` and `--mode=ref` (the bodies: `evaluation.commands`).

  eval  metrics (`--metrics=fid,fd_dinov2,cls`) of `--images=DIR` or of `--net` generating
        `--num_images`; reference: `--ref=stats.pkl` or the dataset of `--config`;
        fd_dinov2 reads the DINOv2 ViT-L/14 weights from `--dinov2=PATH`.
  ref   reference statistics of `--images=DIR|ZIP` (or the `--ref_split` split of
        `--config`'s data) for `--metrics=fid,fd_dinov2`, written to `--ref=OUT.pkl` in
        the release's format (its `calculate_metrics.py ref`).

    python -m edm2_jax.main --mode=eval --net=nets/img64-s --ref=img64.pkl --num_images=50000
    python -m edm2_jax.main --mode=eval --preset=edm2-img64-s-autog-fid --models=models/

With `--preset=NAME --models=DIR` (`modes/generate.py`) the preset's networks, guidance
and interval generate the images; `--metrics` defaults to the figure the preset reports
(fid or fd_dinov2), and `--ref` to the release's reference statistics of its data
(`img512.pkl` / `img64.pkl`) in DIR when there (else the `--config` data set, if given).

Defines the metric flags `--mode=phema_sweep` shares (`--metrics`, `--num_images`,
`--ref`, `--ref_split`, `--dinov2`); the network and sampler flags are `modes/generate.py`'s.
"""
from __future__ import annotations

import os

from absl import app, flags

from edm2_jax import paths
from edm2_jax.ema import sweep
from edm2_jax.run import layout
from edm2_jax.evaluation import commands as eval_commands
from edm2_jax.evaluation import metrics as metrics_lib
from edm2_jax.modes import common
from edm2_jax.modes import generate as generate_mode  # --net, --preset, the sampler's flags
from edm2_jax.sampling import presets
from edm2_jax.training import sharding

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


def _preset_metrics_ref(preset: presets.Preset) -> tuple[str, str | None]:
    """`--metrics` and `--ref` of an eval of `preset`: the flags when given, else the
    metric the preset reports and the release's reference statistics of its data in
    `--models` (None: the `--config` data set). Raises FileNotFoundError naming the
    file and where to get it when neither is there."""
    if FLAGS.images or FLAGS.data_split_images:
        raise ValueError(f"--preset={preset.name} generates the images to evaluate; drop "
                         f"--images / --data_split_images (or drop --preset)")
    metrics = FLAGS.metrics if FLAGS["metrics"].present else preset.metric
    names = {m.strip() for m in metrics.split(",")}
    if FLAGS.ref or not names & set(metrics_lib.FD_METRICS):
        return metrics, FLAGS.ref
    ref = os.path.join(FLAGS.models, preset.ref)
    if os.path.isfile(ref):
        return metrics, ref
    if common.config() is not None:
        return metrics, None
    raise FileNotFoundError(f"--preset={preset.name} is evaluated against the release's "
                            f"{preset.ref}, which --models={FLAGS.models} does not hold: "
                            f"download {presets.REFS_URL}{preset.ref} into it, or give "
                            f"--ref=PATH")


def _data_config() -> dict | None:
    """The reference data of the metrics: `--config`'s data section, else, for a `--net`
    that is a training run, the data section its config.json records."""
    given = common.data_config()
    if given is not None or not FLAGS.net or not layout.is_run(paths.normalize(FLAGS.net)):
        return given
    return sweep.run_data_config(paths.normalize(FLAGS.net))


def run_eval() -> None:
    """`--mode=eval` (`commands.main_eval`), of `--images`, a data split, `--net` or
    `--preset`."""
    sharding.maybe_initialize_distributed()  # one of several hosts: each takes its share
    seeds = FLAGS.seeds if FLAGS["seeds"].present else None
    common.check_output_file(FLAGS.out_json, "--out_json")  # before any work
    out_dir = os.path.dirname(paths.normalize(FLAGS.out_json or "."))
    if FLAGS.out_json and not paths.is_url(out_dir) and not os.path.isdir(out_dir):
        raise FileNotFoundError(f"--out_json={FLAGS.out_json}: its directory {out_dir} does "
                                f"not exist; create it or pass a file in an existing one")
    preset = generate_mode.check_preset()
    metrics, ref = FLAGS.metrics, FLAGS.ref
    if preset:  # before the conversion
        metrics, ref = _preset_metrics_ref(preset)
        common.check_output_dir(FLAGS.outdir, "--outdir")
    resolved = generate_mode.resolve_preset(preset)
    eval_commands.main_eval(
        images_dir=FLAGS.images,
        num_images=None if seeds and not FLAGS["num_images"].present else FLAGS.num_images,
        metrics=metrics, ref=ref, ref_split=FLAGS.ref_split,
        data_split_images=FLAGS.data_split_images, data_config=_data_config(),
        batch_size=FLAGS.batch, out_json=FLAGS.out_json,
        class_idx=FLAGS.class_idx, seeds=seeds, subset_seed=FLAGS.subset_seed,
        dinov2=FLAGS.dinov2, vae_path=FLAGS.vae, preset=resolved.name if resolved else None,
        outdir=FLAGS.outdir, **generate_mode.network_flags(resolved),
        **generate_mode.sampler_flags(resolved))


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
