"""Entry point: `python -m edm2_jax.main --config=configs/fashion_mnist.py --workdir=runs/fmnist`.

Modes:
  train    (default) train `--config` in `--workdir`, resuming if it holds a run.
  convert  import released weights: `--mode=convert --src=edm2-img64-s-1073741-0.075.pkl
           --workdir=DIR` writes a network checkpoint that the rest of the project loads;
           `--src=training-state-<kimg>.pt --config=...` a run that --mode=train continues.
  export   `--net=PATH --dst=FILE.pkl`: a network as the release's network pickle.
  eval     metrics (`--metrics=fid,fd_dinov2,cls`) of `--images=DIR` or of `--net` generating
           `--num_images`; reference: `--ref=stats.pkl` or the dataset of `--config`;
           fd_dinov2 reads the DINOv2 ViT-L/14 weights from `--dinov2=PATH`.
  ref      reference statistics of `--images=DIR|ZIP` (or the `--ref_split` split of
           `--config`'s data) for `--metrics=fid,fd_dinov2`, written to `--ref=OUT.pkl` in
           the release's format (its `calculate_metrics.py ref`).
  phema    post-hoc EMA (Alg. 3): `--workdir=RUN --sigma_rel=0.05,0.1 [--at_kimg] [--per_tensor]`
           reconstructs network checkpoints from the run's EMA snapshots.
  phema_sweep  reconstruct each `--sigma_rel`, evaluate `--metrics` (one of cls, fid, fd_dinov2) on
           `--num_images`, write a CSV and plot, name the best; reference data: `--config`,
           else the run's config.json.
  generate images for `--seeds` from `--net` (network checkpoint, run dir or EMA snapshot)
           into `--outdir` and/or a `--grid` PNG; `--guide`/`--guidance` for (auto)guidance;
           a latent (img512) net's samples are decoded by the SD VAE of `--vae=PATH`.
Config fields are overridden with `--config.field=value`, e.g. `--config.total_kimg=100`.

Owns the flags and their dispatch to each mode's function (`train.train_and_evaluate`,
`convert.main_convert`, `evaluate.main_eval`, `evaluate.main_ref`, `phema.main_phema`,
`phema.main_sweep`,
`generate.main_generate`), the persistent compilation cache, and how the process ends:
the errors a user can act on (`USER_ERRORS`) as one `error:` message without a traceback
(exit 1), Orbax's background noise summarised in one line, and a bounded exit
(background threads still running `EXIT_GRACE_S` after the end are abandoned with one
line, never waited for).
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time
import traceback
import warnings

if __name__ == "__main__":
    # First, before JAX starts: the host allocator and CPU devices (edm2_jax/process.py).
    from edm2_jax import process as cpu_env
    try:
        cpu_env.reexec()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from edm2_jax.release import convert
from edm2_jax.evaluation import evaluate
from edm2_jax.sampling import generate
from edm2_jax.run import integrity
from edm2_jax.ema import posthoc as phema
from edm2_jax.release import training_state as release_state
from edm2_jax.run import rundir
from edm2_jax.training import train

# Errors whose message names the problem and the fix: printed alone, exit status 1.
USER_ERRORS = (ValueError, KeyError, FileNotFoundError, FileExistsError, NotADirectoryError,
               PermissionError, pickle.UnpicklingError, integrity.IntegrityError, rundir.CheckpointSaveError,
               rundir.RunLockedError, rundir.NoCheckpointError, rundir.NonFiniteStateError,
               train.NonFiniteLossError)
EXIT_GRACE_S = 30.0

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Training config file (configs/*.py[:variant]).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory of the run (checkpoints, logs, samples).")
flags.DEFINE_enum("mode", "train", ["train", "convert", "export", "generate", "eval", "ref",
                                    "phema",
                                    "phema_sweep"],
                  "What to do.")
flags.DEFINE_string("src", None, "convert: released network pickle / state_dict (.pkl, .pt, .npz).")
flags.DEFINE_string("dst", None, "export: the release network pickle to write from --net.")
flags.DEFINE_string("net_overrides", None, "convert: JSON of Precond kwargs that win over what is "
                    "read from --src, e.g. '{\"channel_mult\": [1, 2, 3, 4]}'.")
# generate
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
# phema
flags.DEFINE_string("sigma_rel", "0.05,0.10", "phema: comma list of EMA lengths sigma_rel.")
flags.DEFINE_float("at_kimg", None, "phema: reconstruct at this time (default: the last snapshot).")
flags.DEFINE_string("per_tensor", None, "phema: 'REGEX=SIGMA_REL;...' different sigma_rel per parameter path.")
# eval
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


def _enable_compilation_cache():
    """Persistent XLA cache: a resumed or repeated run skips its compiles. Disable with
    EDM2_JAX_COMPILATION_CACHE=off; default ~/.cache/edm2_jax/xla."""
    path = os.environ.get("EDM2_JAX_COMPILATION_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "edm2_jax", "xla"))
    if path != "off" and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:
        # Orbax logs every save at INFO and, after a failed save or restore, each of its
        # threads' errors: the error this process raises says it in one message.
        logging.set_verbosity(logging.WARNING)
        logging.get_absl_logger().addFilter(_drop_orbax_noise)
        sys.excepthook, sys.unraisablehook = _quiet_excepthook, _quiet_unraisablehook
        # ... and the writes a failed save left unawaited, reported at exit.
        warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)
    _enable_compilation_cache()
    rc = 0
    try:
        _dispatch()
    except app.UsageError:
        raise
    except USER_ERRORS as e:
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        if isinstance(e, rundir.CheckpointSaveError) and e.strerror:
            msg = e.strerror  # without OSError's "[Errno N]" prefix: the message names it
        print(f"error: {msg}", file=sys.stderr, flush=True)
        rc = 1
    except BaseException as e:  # noqa: BLE001 - printed, then the bounded exit
        traceback.print_exc()
        rc = 130 if isinstance(e, KeyboardInterrupt) else 1
    _exit_bounded(rc)
    return rc


def _drop_orbax_noise(record) -> bool:
    """absl log filter: Orbax's ERROR records (with their tracebacks) and any from
    background threads: the exception that reaches the user names the failure once."""
    return not (record.levelno >= 40 and (
        threading.current_thread() is not threading.main_thread()
        or f"{os.sep}orbax{os.sep}" in (record.pathname or "")))


_suppressed = {"n": 0}


def _closed_loop(value) -> bool:
    return isinstance(value, RuntimeError) and "Event loop is closed" in str(value)


def _quiet_unraisablehook(unraisable) -> None:
    """sys.unraisablehook: after a failed asynchronous save or restore, TensorStore's
    callbacks try to reach Orbax's closed event loop, and each prints a traceback
    ("Event loop is closed"), hundreds of them; those are counted (`_exit_bounded`
    reports them in one line), everything else is printed as usual."""
    if _closed_loop(unraisable.exc_value):
        _suppressed["n"] += 1
        return
    sys.__unraisablehook__(unraisable)


def _quiet_excepthook(kind, value, tb) -> None:
    """sys.excepthook: the same for the callbacks that report through it."""
    if _closed_loop(value):
        _suppressed["n"] += 1
        return
    sys.__excepthook__(kind, value, tb)


def _exit_bounded(rc: int) -> None:
    """Bound the process's exit: a daemon watchdog ends it (`os._exit(rc)`, with one line
    naming the threads still running) if the interpreter's shutdown, which joins the
    remaining non-daemon threads (Orbax's savers), takes more than `EXIT_GRACE_S`."""
    if _suppressed["n"]:
        print(f"({_suppressed['n']} 'Event loop is closed' errors of Orbax's background "
              f"threads suppressed)", file=sys.stderr, flush=True)

    def watchdog():
        time.sleep(EXIT_GRACE_S)
        alive = [t.name for t in threading.enumerate() if not t.daemon and t.is_alive()
                 and t is not threading.main_thread()]
        print(f"abandoning {len(alive)} background thread(s) still running {EXIT_GRACE_S:.0f} s "
              f"after the end ({', '.join(alive[:3])}); exiting with status {rc}",
              file=sys.stderr, flush=True)
        os._exit(rc)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()


def _config():
    """`--config` with its `--config.field=value` overrides, or an error that names the
    file (config_flags loads it lazily, on first use; unknown fields: `_parse_flags`)."""
    try:
        config = FLAGS.config
        if config is not None:
            config.get("seed")  # a file that failed to load raises here
        return config
    except OSError as e:
        cause = e.__cause__ or e
        raise FileNotFoundError(
            f"--config: {' '.join(str(cause).split())}. Give a config file and optional variant, "
            f"e.g. --config=configs/fashion_mnist.py:tiny or --config=configs/img64.py:xs"
        ) from None


def _dispatch():
    if FLAGS.mode == "generate":
        if not FLAGS.net:
            raise app.UsageError("--mode=generate needs --net=PATH")
        generate.main_generate(
            FLAGS.net, FLAGS.seeds, FLAGS.outdir, ema=FLAGS.ema, batch_size=FLAGS.batch,
            class_idx=FLAGS.class_idx, subdirs=FLAGS.subdirs, guide_path=FLAGS.guide,
            guide_ema=FLAGS.guide_ema, guidance=FLAGS.guidance, grid=FLAGS.grid,
            vae_path=FLAGS.vae, **_sampler_flags())
    elif FLAGS.mode == "export":
        if not FLAGS.net:
            raise app.UsageError("--mode=export needs --net=PATH and --dst=FILE.pkl")
        release_state.main_export(FLAGS.net, FLAGS.dst, FLAGS.ema)
    elif FLAGS.mode == "eval":
        seeds = FLAGS.seeds if FLAGS["seeds"].present else None
        evaluate.main_eval(
            images_dir=FLAGS.images, net_path=FLAGS.net,
            num_images=None if seeds and not FLAGS["num_images"].present else FLAGS.num_images,
            metrics=FLAGS.metrics, ref=FLAGS.ref, ref_split=FLAGS.ref_split,
            data_split_images=FLAGS.data_split_images, data_config=_data_config(),
            ema=FLAGS.ema, batch_size=FLAGS.batch, out_json=FLAGS.out_json,
            class_idx=FLAGS.class_idx, seeds=seeds, subset_seed=FLAGS.subset_seed,
            guide_path=FLAGS.guide, guide_ema=FLAGS.guide_ema, guidance=FLAGS.guidance,
            dinov2=FLAGS.dinov2, vae_path=FLAGS.vae, **_sampler_flags())
    elif FLAGS.mode == "ref":
        if not FLAGS.ref:
            raise app.UsageError("--mode=ref needs --ref=OUT.pkl (where to write the statistics)")
        evaluate.main_ref(
            dest=FLAGS.ref, images_dir=FLAGS.images, data_config=_data_config(),
            split=FLAGS.ref_split, metrics=FLAGS.metrics, batch_size=FLAGS.batch,
            num_images=FLAGS.num_images if FLAGS["num_images"].present else None,
            dinov2=FLAGS.dinov2)
    elif not FLAGS.workdir:
        raise app.UsageError("--workdir is required")
    elif FLAGS.mode == "phema":
        phema.main_phema(FLAGS.workdir, _sigma_rels(), FLAGS.at_kimg, FLAGS.outdir,
                         FLAGS.per_tensor)
    elif FLAGS.mode == "phema_sweep":
        phema.main_sweep(
            FLAGS.workdir, _sigma_rels(), metrics=FLAGS.metrics, num_images=FLAGS.num_images,
            batch_size=FLAGS.batch, num_steps=FLAGS.steps, ref=FLAGS.ref,
            ref_split=FLAGS.ref_split, data_config=_data_config(), at_kimg=FLAGS.at_kimg,
            out_dir=FLAGS.outdir, per_tensor=FLAGS.per_tensor, dinov2=FLAGS.dinov2,
            vae_path=FLAGS.vae)
    elif FLAGS.mode == "convert":
        if not FLAGS.src:
            raise app.UsageError("--mode=convert needs --src=FILE")
        if release_state.is_training_state(FLAGS.src):
            release_state.main_import_state(FLAGS.src, FLAGS.workdir, _config())
        else:
            convert.main_convert(FLAGS.src, FLAGS.workdir, _net_overrides())
    elif _config() is None:
        raise app.UsageError("--config is required, e.g. --config=configs/fashion_mnist.py")
    else:
        train.train_and_evaluate(_config(), FLAGS.workdir)


def _sampler_flags() -> dict:
    """The EDM sampler's settings from the flags (`generate.generate_images` kwargs)."""
    return dict(num_steps=FLAGS.steps, sigma_min=FLAGS.sigma_min, sigma_max=FLAGS.sigma_max,
                rho=FLAGS.rho, S_churn=FLAGS.S_churn, S_min=FLAGS.S_min, S_max=FLAGS.S_max,
                S_noise=FLAGS.S_noise, rng=FLAGS.rng)


def _net_overrides() -> dict | None:
    if not FLAGS.net_overrides:
        return None
    try:
        value = json.loads(FLAGS.net_overrides)
    except ValueError as e:
        raise ValueError(f"--net_overrides={FLAGS.net_overrides!r} is not JSON ({e}); e.g. "
                         f"--net_overrides='{{\"channel_mult\": [1, 2, 3, 4]}}'") from None
    if not isinstance(value, dict):
        raise ValueError("--net_overrides must be a JSON object of Precond kwargs")
    return value


def _sigma_rels() -> list[float]:
    return [float(x) for x in FLAGS.sigma_rel.split(",") if x.strip()]


def _data_config() -> dict | None:
    """The data section of `--config`, if given."""
    return _config().data.to_dict() if _config() else None


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with an unknown `--config.FIELD` (an AttributeError deep in
    ml_collections) reported as one `error:` line naming the field and the fix."""
    try:
        return app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError) as e:
        given = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")]
        print(f"error: unknown config field {str(e).strip(chr(34))} in the overrides {given}: "
              f"each --config.FIELD must be a field of the config file (see "
              f"edm2_jax/configs.py base_config for all fields, e.g. --config.total_kimg, "
              f"--config.optim.ref_lr)", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
