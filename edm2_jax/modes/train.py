"""`--mode=train` (the default): train `--config` in `--workdir`, resuming if it holds a
run (`training.loop.train_and_evaluate`).

    python -m edm2_jax.main --config=configs/fashion_mnist.py --workdir=runs/fmnist
    python -m edm2_jax.main --config=configs/fashion_mnist.py:tiny --workdir=runs/t \
        --config.total_kimg=1 --config.batch_size=32

Config fields are overridden with `--config.field=value` (all fields:
`edm2_jax/configs.py` `base_config`).
"""
from __future__ import annotations

from typing import Any

from absl import app

from edm2_jax.modes import common
from edm2_jax.training import loop


def run(process_setup: Any = None) -> dict:
    """`--mode=train`. `process_setup`: what the entry point decides about its process
    (`edm2_jax.process.TrainingSetup`: how many devices, a log line), asked by the loop
    once JAX has started; None = all devices. Returns the last status dict."""
    workdir = common.require_workdir()
    config = common.config()
    if config is None:
        raise app.UsageError("--mode=train needs --config=FILE.py[:VARIANT], e.g. "
                             "--config=configs/fashion_mnist.py")
    common.check_run_dir(workdir)  # before anything is read, compiled or written
    return loop.train_and_evaluate(
        config, workdir, process_setup=process_setup,
        default_ref_lr=common.config_file_value("optim.ref_lr"))
