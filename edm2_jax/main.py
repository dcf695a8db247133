"""Entry point: `python -m edm2_jax.main --config=configs/fashion_mnist.py --workdir=runs/fmnist`.

Modes:
  train    (default) train `--config` in `--workdir`, resuming if it holds a run.
  convert  import released weights: `--mode=convert --src=edm2-img64-s-1073741-0.075.pkl
           --workdir=DIR` writes a network checkpoint that the rest of the project loads.
Config fields are overridden with `--config.field=value`, e.g. `--config.total_kimg=100`.
"""
from __future__ import annotations

from absl import app, flags, logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Training config file (configs/*.py[:variant]).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory of the run (checkpoints, logs, samples).")
flags.DEFINE_enum("mode", "train", ["train", "convert"], "What to do.")
flags.DEFINE_string("src", None, "convert: released network pickle / state_dict (.pkl, .pt, .npz).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    if not FLAGS.workdir:
        raise app.UsageError("--workdir is required")
    if FLAGS.mode == "convert":
        if not FLAGS.src:
            raise app.UsageError("--mode=convert needs --src=FILE")
        from edm2_jax import convert
        convert.main_convert(FLAGS.src, FLAGS.workdir)
        return
    if FLAGS.config is None:
        raise app.UsageError("--config is required, e.g. --config=configs/fashion_mnist.py")
    from edm2_jax import train
    train.train_and_evaluate(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
    app.run(main)
