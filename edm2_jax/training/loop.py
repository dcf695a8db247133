"""EDM2 training: `train_and_evaluate`, the loop over steps and what it writes.

    from edm2_jax import configs
    from edm2_jax.training import loop
    loop.train_and_evaluate(configs.base_config(), "runs/fmnist")

The loop takes the set-up steps of `setup.py` (data, config check, evaluation, model,
state), then runs the jitted step of `step.py`, reports on `progress.py`'s schedule,
and at every snapshot writes the EMAs, a sample grid and the evaluation. What it writes
is `edm2_jax.run`'s; the resume check is `resume.py`'s, preemption `preemption.py`'s.
"""
from __future__ import annotations

import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from edm2_jax import configs
from edm2_jax import data as data_lib
from edm2_jax import paths
from edm2_jax.ema import power as ema_lib
from edm2_jax.model.networks import Precond
from edm2_jax.run import checkpoints, layout, lock
from edm2_jax.run.checkpoints import CheckpointSaveError  # noqa: F401 (raised by train_and_evaluate)
from edm2_jax.run.stats import StatsLogger
from edm2_jax.sampling import consistency
from edm2_jax.sampling import sampler as sampling
from edm2_jax.training import distill as distill_lib
from edm2_jax.training import preemption
from edm2_jax.training import probes
from edm2_jax.training import resume
from edm2_jax.training.rescue import (default_rate, optim_history, rescue_flags,  # noqa: F401
                                      rescue_hint)
from edm2_jax.training import setup
from edm2_jax.training import sharding as shard_lib
from edm2_jax.training import step as step_lib
from edm2_jax.training.progress import NonFiniteLossError, Schedule, StepMetrics, status_line

# --------------------------------------------------------------------------------------
# At each snapshot: sample grid and evaluation


def emas_on_host(state: dict, keys: list[str]) -> dict:
    """`{key: EMA variables}` as host arrays, each gathered once (a collective on every
    process, in the same order everywhere) however many consumers want it."""
    return {k: shard_lib.to_host({"params": state["ema"]["power"][k],
                                  "buffers": state["buffers"]})
            for k in dict.fromkeys(keys)}


def sampler_settings(config: ml_collections.ConfigDict) -> dict:
    """The sampler of the run's sample grids: the Heun sampler of `config.sample`, or a
    distillation run's few-step sampler (`distill.py`)."""
    if distill_lib.enabled(config):
        return consistency.sampler_kwargs(config.distill)
    return dict(num_steps=int(config.sample.num_steps))


def save_sample_grid(config: ml_collections.ConfigDict, net: Precond, variables: dict,
                     path: str) -> None:
    """A `config.sample` grid of images of `variables` (one class per column) at `path`."""
    rows, cols = int(config.sample.grid_rows), int(config.sample.grid_cols)
    seeds = np.arange(rows * cols) + int(config.sample.seed)
    labels = None
    if net.label_dim:
        labels = jax.nn.one_hot(np.arange(rows * cols) % net.label_dim, net.label_dim)
    imgs = sampling.sample_images(net, variables, sampling.split_seeds(seeds), labels,
                                  rng=str(config.sample.get("rng", "jax")),
                                  **sampler_settings(config))
    while not imgs.is_ready():  # waits in Python: a signal is acknowledged at once
        time.sleep(0.05)
    paths.write_through_local(  # PIL writes local files
        path, lambda local: sampling.save_image_grid(np.asarray(imgs), local, rows, cols))


def eval_line(nimg: int, ema_key: str, res: dict) -> str:
    """The log line of an evaluation's results `res` (`eval/<metric>` -> value)."""
    return (f"kimg {nimg / 1000:9.3f}  eval (EMA {ema_key}): " + "  ".join(
        f"{k[5:]} {v:.4g}" for k, v in res.items()
        if k != "eval/time_s" and not k.startswith("eval/num_"))
        + f"  [{res['eval/time_s']:.1f} s]")


def grid_and_eval(config: ml_collections.ConfigDict, net: Precond, state: dict, workdir: str,
                  nimg: int, step: int, stop: preemption.StopRequest, sample_key: str,
                  snapshot_keys: list[str], evaluator: Any, logger: Any, is_main: bool
                  ) -> None:
    """At a snapshot: the sample grid of EMA `sample_key` (process 0) and the evaluation
    (`evaluator`, process 0, when configured), each announced as it starts, through the
    bar. A signal meanwhile is acknowledged at once (`stop.doing`): the grid or the
    evaluation in progress finishes, the evaluation not yet begun is skipped."""
    host = emas_on_host(state, snapshot_keys)  # every process
    if is_main:
        t, n = time.time(), int(config.sample.grid_rows) * int(config.sample.grid_cols)
        steps = sampler_settings(config)["num_steps"]
        tqdm.write(f"Sample grid: {n} images of EMA sigma_rel={sample_key}, "
                   f"{steps} steps...")
        path = layout.samples_path_at(workdir, nimg)
        with stop.doing("the sample grid"):
            save_sample_grid(config, net, host[sample_key], path)
        tqdm.write(f"Sample grid (EMA sigma_rel={sample_key}, {steps} "
                   f"steps, one class per column): {path} [{time.time() - t:.1f} s]")
    if evaluator is not None:
        if stop.signal is not None:
            tqdm.write(f"kimg {nimg / 1000:9.3f}  evaluation skipped: stopping")
            return
        tqdm.write(f"Evaluation (EMA {evaluator.ema_key}): {evaluator.metrics.names} of "
                   f"{evaluator.num_images} images...")
        with stop.doing("the evaluation"):
            res = evaluator(net, host[evaluator.ema_key])
        if logger:
            logger.log(dict(kimg=nimg / 1000, step=step, **res))
        tqdm.write(eval_line(nimg, evaluator.ema_key, res))


# --------------------------------------------------------------------------------------
# The loop


def _train(config: ml_collections.ConfigDict, workdir: str, stop: preemption.StopRequest,
           process_setup: Any, default_ref_lr: float | None) -> dict:
    """`train_and_evaluate`'s body, run holding the run's lock and the signal handlers."""
    is_main = jax.process_index() == 0

    # Set-up, each step failing before anything costly when its part of the config is
    # wrong: the compute dtype made concrete; the data (a broken dataset fails before
    # anything is compiled); the config check (same run, or a clear error before any
    # step); the evaluation; the model and its state (checked against its checksums);
    # the config recorded only then. Each stage that may take a while says so as it starts.
    config = setup.setup_precision(config, workdir)
    config = setup.setup_teacher(config)
    print(f"Loading the data ({config.data.source})...", flush=True)
    source, config = setup.setup_data(config)
    print(f"Data: {data_lib.describe(source)}", flush=True)
    current = resume.check_config(workdir, config)
    eval_key, evaluator = setup.setup_eval(config, is_main)
    batch_size = int(config.batch_size)
    num_devices = None
    if process_setup is not None:
        num_devices = process_setup.num_devices(
            batch_size, lambda d: step_lib.batch_splits(config, d))
    model = setup.setup_model(config, num_devices)
    mesh, net = model.mesh, model.net
    n_params = sum(int(np.prod(x.shape)) for x in
                   jax.tree.leaves(model.abstract_state["params"]))
    print(f"Network: {n_params:,} parameters, {setup.precision(config.network.dtype)}; batch "
          f"{batch_size} on {mesh.size} device(s) of {jax.process_count()} process(es), mesh "
          f"{dict(mesh.shape)}, {model.num_accum} micro-batch(es) per step; EMAs "
          f"sigma_rel={list(config.ema.sigma_rels)}")
    line = process_setup.log_line() if process_setup is not None else None
    if line:
        print(line)
    resume_step = setup.effective_resume_step(config, workdir)
    managers = checkpoints.TrainCheckpoints(workdir, keep=int(config.keep_checkpoints))
    which = f"checkpoint {resume_step}" if resume_step else "the newest checkpoint"
    print(f"Train state: restoring {which}..." if layout.step_dirs(os.path.join(
        workdir, layout.CHECKPOINTS)) else "Train state: initialising the network (compiles "
          "its initialisation first)...", flush=True)
    try:
        state, resumed, managers = setup.restore_or_init(config, model, managers, resume_step)
    except BaseException:
        managers.abandon()
        raise
    step0 = stop.step = int(state["step"])
    # config.json records the run's config and the learning rate of each start
    # (`optim_history`), which a rescue from divergence suggests.
    current = dict(current, optim_history=optim_history(layout.read_config(workdir), current,
                                                        step0))
    if is_main:
        resume.record_config(workdir, current)
    sched = Schedule.from_config(config)

    nimg = step0 * batch_size
    if step0 >= sched.total_steps:
        print(f"Run in {workdir} is already finished at {nimg / 1000:.3f} kimg "
              f"(total_kimg={config.total_kimg}). Nothing to do.")
        managers.close()
        return {"kimg": nimg / 1000, "finished": True}
    print(f"{'Resuming' if resumed else 'Starting'} in {workdir} at step {step0}, "
          f"{nimg / 1000:.3f} kimg", flush=True)

    step_fn = step_lib.jit_train_step(
        step_lib.make_train_step(config, net, model.tx, model.num_accum), mesh,
        model.state_sharding)
    it = data_lib.make_iterator(source, global_batch=batch_size, seed=int(config.seed),
                                start_nimg=nimg, process_index=jax.process_index(),
                                process_count=jax.process_count(),
                                num_workers=int(config.data.num_workers))
    logger = StatsLogger(workdir, nimg) if is_main else None  # rows past nimg dropped
    sample_key = ema_lib.ema_key(max(config.ema.sigma_rels))
    snapshot_keys = [sample_key] + ([eval_key] if eval_key else [])
    consensus = preemption.StopConsensus(stop, mesh)
    diag = (probes.Diagnostics(config, net, model.tx, source)
            if config.get("diagnostics") and config.diagnostics.enabled else None)
    if diag is not None and step0 == 0:  # the fresh network (every process)
        res = diag(state)
        if logger:
            logger.log(dict(kimg=0.0, step=0, **res))
    metrics_log = StepMetrics(batch_size, workdir, nimg)
    last: dict = {}
    step = step0
    stopping = consensus.before_start()
    if not stopping:
        print("Compiling the training step (the first step; up to ~1 min on CPU)...",
              flush=True)
    bar = None  # from the first step on (its ETA leaves the compile out); lines: tqdm.write

    def report() -> dict:
        """The status line after `step`, then the probes (their time left out of img/s)."""
        stats = metrics_log.status(step)
        if logger:
            logger.log(stats)
        tqdm.write(status_line(stats))
        if diag is not None:  # every process
            with metrics_log.excluded():
                res = diag(state)
            if logger:
                logger.log(dict(kimg=nimg / 1000, step=step, **res))
        return stats

    try:
        while step < sched.total_steps and not stopping:
            state, metrics = step_fn(state, shard_lib.global_batch(mesh, next(it)))
            step += 1
            stop.step = step
            stopping = consensus.after_step()
            metrics_log.add(metrics, step - 1)
            if bar is None:
                bar = tqdm(total=sched.total_steps, initial=step, unit="step",
                           disable=not is_main, dynamic_ncols=True, mininterval=2.0)
            else:
                bar.update(1)
            nimg = step * batch_size
            done = step >= sched.total_steps

            reported = sched.status_due(step) or done or stopping
            if reported:
                last = report()

            if sched.snapshot_due(step) or done:
                metrics_log.check()
                managers.save_snapshot(step, nimg, state["ema"], tuple(config.ema.sigma_rels),
                                       batch_size, buffers=state["buffers"])
                if stopping and not done:  # the same decision on every process
                    tqdm.write(f"kimg {nimg / 1000:9.3f}  sample grid and evaluation "
                               f"skipped: stopping (the snapshot is saved)")
                else:
                    with metrics_log.excluded():
                        grid_and_eval(config, net, state, workdir, nimg, step, stop,
                                      sample_key, snapshot_keys, evaluator, logger, is_main)
                    # A signal during the grid: saved now (one process; with several,
                    # the next step's collective decides).
                    stopping = stopping or consensus.between_steps()
                    if stopping and not reported:
                        last = report()

            if sched.checkpoint_due(step) or done or stopping:
                metrics_log.check()
                managers.save_state(step, state)
    except (NonFiniteLossError, checkpoints.NonFiniteStateError) as e:
        failed = e
        if is_main:  # the rescue's --config.resume_step is to be applied (again)
            layout.write_config(workdir, dict(current, resume_step=0))
        raise NonFiniteLossError(
            str(e) + rescue_hint(managers, config, current["optim_history"],
                                 default_ref_lr)) from None
    except BaseException:
        failed = True
        raise
    else:
        failed = None
    finally:
        if bar is not None:
            bar.close()
        it.close() if hasattr(it, "close") else None
        if logger:
            logger.close()
        if failed is None:
            managers.close()  # waits for the asynchronous saves
        else:  # already failing: the first error is the one raised
            managers.abandon()

    if stopping and step < sched.total_steps:
        saved = f"checkpoint {step} saved" if step > step0 else "no new step to save"
        why = (f"signal {stop.signal} (received {stop.where(stop.received_at)})" if stop.signal
               else "a signal to another process")
        print(f"Stopped by {why} at step {step}, {nimg / 1000:.3f} kimg; {saved}. Re-run the "
              f"same command to resume.", flush=True)
        return dict(last, finished=False, step=step)
    print(f"Training finished at {nimg / 1000:.3f} kimg in "
          f"{time.time() - metrics_log.t_start:.0f} s.")
    return dict(last, finished=True)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       process_setup: Any = None, default_ref_lr: float | None = None) -> dict:
    """Train to `config.total_kimg`, resuming from the latest checkpoint in `workdir`.

    Writes `config.json` (with `optim_history`, the learning rate and clip of each
    start, which the advice after a divergence draws on), `checkpoints/` (full state
    every `checkpoint_kimg`, last `keep_checkpoints` kept), `snapshots/` (every tracked
    EMA every `snapshot_kimg`), `stats.jsonl` (each status line's figures: the means
    over the steps since the previous one), TensorBoard scalars in `tb/`, and sample
    grids `samples/*.png` (`edm2_jax.run`). Returns the last status dict (`finished`
    False when stopped by a signal).

    Devices: a mesh of shape `config.mesh` (`sharding.py`; `fsdp > 1` shards params,
    Adam state and EMAs). Several hosts: one process per host, `jax.distributed` set up
    from the environment, each loading its slice of every batch; only process 0 writes
    logs and images; checkpoints are written by all (`workdir` must be shared).
    `process_setup`: what the entry point decides about its process, asked once JAX has
    started (`edm2_jax.process.TrainingSetup`): `num_devices(batch_size, fits)`, how
    many of the devices to train on (`fits(d)`: whether the step splits over `d`), and
    `log_line()`, a line to print about the process (or None). None: all devices.
    `default_ref_lr`: the config file's own `optim.ref_lr`, before overrides (the CLI
    passes it), which the advice after a divergence names when no lower rate of the run
    has trained (`default_rate`).

    Faults: SIGTERM/SIGINT finish the current step (or sample grid; a snapshot's grid not
    yet begun is skipped), save a checkpoint and return (all processes stop at the same
    step, at most one step later; `preemption.py`); a second
    signal ends the process at once without saving: one `error:` line, exit status
    128 + the signal's number (130 SIGINT, 143 SIGTERM; in a notebook,
    KeyboardInterrupt), the unfinished save deleted on the next start. A run killed at
    any moment resumes from its last complete checkpoint (Orbax renames a checkpoint
    into place only when complete and deletes unfinished ones); a checkpoint that does
    not restore is set aside and the previous one is used.

    Integrity (`run/checkpoints.py`, `integrity.py`): one training process per workdir
    (an OS file lock, `lock.RunLock`); every checkpoint and snapshot is saved with a checksum
    per array and checked on restore, along with finiteness (a corrupt one is set aside
    as `<step>.corrupt` and the previous one used); a state holding NaN/inf is never
    saved; config.json is (re)written only once every check has passed.

    Raises ValueError for a config that cannot train (`configs.validate`) or that does
    not match the run in `workdir` (`resume.py`; the optim.* fields may change), the data
    errors of `data.make_source`, RunLockedError when another process trains in
    `workdir`, NoCheckpointError when the run has checkpoints but none restores (unless
    `config.start_over`), NonFiniteLossError when the loss or the state becomes NaN/inf
    (naming the newest healthy checkpoint and `--config.resume_step`), and
    CheckpointSaveError when a checkpoint cannot be written (e.g. disk full; the earlier
    ones are intact).
    """
    configs.validate(config)  # before anything is written
    # First, since jax.distributed installs its own SIGTERM handler (its preemption
    # notifier), which ours must replace.
    shard_lib.maybe_initialize_distributed()
    workdir = paths.normalize(workdir)  # a local path or a gs:// URL (paths.py)
    paths.makedirs(workdir)
    with lock.RunLock(workdir), preemption.StopRequest() as stop:
        return _train(config, workdir, stop, process_setup, default_ref_lr)
