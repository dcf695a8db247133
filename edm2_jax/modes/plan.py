"""`--mode=plan`: before renting a TPU slice, whether `--config` fits it and how fast it can
go at best, from XLA's TPU compiler on this machine (libtpu; no TPU needed):
`edm2_jax/planner/plan.py`.

    python -m edm2_jax.main --mode=plan --config=configs/img512.py:xxl --tpu=v5p-64
    python -m edm2_jax.main --mode=plan --config=configs/img64.py:s --tpu=v5e-16 \
        --config.mesh.fsdp=4 --config.batch_per_device=16 --sample_batch=0

Prints, per chip, the HBM the training step and the sampler need against the chip's, the
model flops of a step and the time they take at the chip's peak (a lower bound), and the
compile times; a run that does not fit is one `error:` line naming the fix.
"""
from __future__ import annotations

import os

import jax
import ml_collections
from absl import app, flags

from edm2_jax import paths
from edm2_jax.run import records

from edm2_jax.planner import plan, tpu_slices
from edm2_jax.modes import common

FLAGS = flags.FLAGS
flags.DEFINE_string("tpu", None, f"--mode=plan: the TPU slice, as Cloud TPU names it "
                    f"({tpu_slices.EXAMPLES}).")
flags.DEFINE_integer("sample_batch", None, "--mode=plan: the sampler's batch (default the "
                     "config's eval.batch_size, rounded up to a multiple of the devices; "
                     "0 = no sampler).")


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a training run in `workdir` records (its config.json), to plan as it
    trains. Raises FileNotFoundError when `workdir` holds no run."""
    recorded = records.run_config(paths.normalize(workdir))
    if recorded is None:
        raise FileNotFoundError(f"--workdir={workdir} holds no training run (config.json); "
                                f"give --config=FILE.py[:VARIANT] or a run's directory")
    return ml_collections.ConfigDict(recorded)


def run() -> plan.Plan:
    """`--mode=plan`. Returns the plan it printed."""
    config = common.config()
    if config is None and FLAGS.workdir:
        config = run_config(FLAGS.workdir)
    if config is None:
        raise app.UsageError("--mode=plan needs --config=FILE.py[:VARIANT], e.g. "
                             "--config=configs/img512.py:xxl, or --workdir=RUN (a run's "
                             "config.json)")
    if not FLAGS.tpu:
        raise app.UsageError(f"--mode=plan needs --tpu=SLICE, e.g. --tpu=v5p-64 (a Cloud TPU "
                             f"accelerator type: {tpu_slices.EXAMPLES})")
    tpu_slice = tpu_slices.parse_slice(FLAGS.tpu)
    # This process compiles for a TPU it does not have: no metadata server to ask, other
    # compiling processes may hold libtpu's lock file, and libtpu's log files (by default
    # in /tmp/tpu_logs) are nobody's to read; set before libtpu loads, a user's own
    # settings kept.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_LOG_DIR", "disabled")
    # A program compiled for a topology without its devices is written to JAX's
    # persistent cache but cannot be loaded from it ("PjRtCompiler must be constructed
    # with a Client"): a repeated plan would only warn and compile again.
    jax.config.update("jax_enable_compilation_cache", False)
    topology = plan.open_topology(tpu_slice)
    result = plan.plan_run(config, topology, FLAGS.sample_batch,
                           log=lambda line: print(line, flush=True))
    print("\n".join(result.lines()), flush=True)
    return result
