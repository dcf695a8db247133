"""EDM2 training: `train_and_evaluate`, from a config to the run's last checkpoint.

    from edm2_jax import configs
    from edm2_jax.training import loop
    loop.train_and_evaluate(configs.base_config(), "runs/fmnist")

`train_and_evaluate` takes the run's lock and the signal handlers and calls
`training_loop`, one function that reads top to bottom under banners, as the release's
function of that name does: set up (`setup.py`: the data, the run's config, the model;
`snapshot_outputs.py`: the evaluation), restore the train state (or initialise it), read
the config once into the values the loop uses, then the loop over steps (the step of
`step.py`, status line, EMA snapshot with its sample grid and evaluation, checkpoint,
stop) and close. Its state is its own local variables; it calls libraries: when to report
is `progress.py`'s, what a snapshot makes besides the EMAs (the sample grid, the
evaluation) `snapshot_outputs.py`'s, what is written `edm2_jax.run`'s, the resume check
and the advice after a divergence `resume.py`'s, preemption `preemption.py`'s.
Nothing here asks which objective runs.
"""
from __future__ import annotations

import functools
import time
from typing import Any

import jax
import ml_collections
from tqdm import tqdm

from edm2_jax import configs
from edm2_jax import data as data_lib
from edm2_jax import paths
from edm2_jax.ema import power as ema_lib
from edm2_jax.run import checkpoints, layout, lock
from edm2_jax.run.stats import StatsLogger
from edm2_jax.training import preemption
from edm2_jax.training import probes
from edm2_jax.training import resume
from edm2_jax.training import setup
from edm2_jax.training import sharding as shard_lib
from edm2_jax.training import snapshot_outputs
from edm2_jax.training import step as step_lib
from edm2_jax.training.progress import NonFiniteLossError, Schedule, StepMetrics, status_line

# The checkpoint record's entry that keeps the running sums of the status interval.
STATUS_INTERVAL = "status_interval"


def training_loop(config: ml_collections.ConfigDict, workdir: str, start: setup.Start,
                  stop: preemption.StopRequest, outputs: layout.StartOutputs,
                  process_setup: Any = None, default_ref_lr: float | None = None) -> dict:
    """`train_and_evaluate`'s body, run holding the run's lock and the signal handlers
    (`stop`): set up, restore, the loop over steps, close. `start`: the objective and
    the network it starts from (`setup.setup_objective`). A start refused during the
    set-up removes what it made (`outputs`). Returns what `train_and_evaluate` does."""
    is_main = jax.process_index() == 0

    # Set up: each stage fails before anything costly when its part of the config is
    # wrong, and says so as it starts when it may take a while. ---------------------------
    try:
        print(f"Loading the data ({config.data.source})...", flush=True)
        source = setup.setup_data(config)  # a broken dataset fails before any compile
        config = setup.run_config(config, workdir, start, source)
        print(f"Data: {data_lib.describe(source)}", flush=True)
        current = resume.check_config(workdir, config)  # same run, or a clear error
        # The run's record of its starts: config.json, else the copy the newest checkpoint
        # keeps, so that a config.json written again keeps every start's learning rate.
        recorded = resume.saved_config(workdir, quiet=True)
        eval_key, evaluator = snapshot_outputs.setup_eval(config, start.objective, is_main)
        num_devices = None if process_setup is None else process_setup.num_devices(
            int(config.batch_size), lambda d: step_lib.batch_splits(config, d))
        model = setup.setup_model(config, start, num_devices)
        print(setup.network_line(model, dtype=config.network.dtype,
                                 batch_size=int(config.batch_size),
                                 sigma_rels=list(config.ema.sigma_rels)))
        line = process_setup.log_line() if process_setup is not None else None
        if line:
            print(line)

        # Restore the train state, or initialise it. --------------------------------------
        resume_step = setup.effective_resume_step(int(config.resume_step), workdir)
        managers = checkpoints.TrainCheckpoints(workdir, keep=int(config.keep_checkpoints))
        print(setup.restore_line(workdir, resume_step), flush=True)
        try:
            state, resumed, managers = setup.restore_or_init(
                config, model, managers, resume_step)
        except BaseException:
            managers.abandon()
            raise
        # config.json records the run's config and the learning rate of each start
        # (`optim_history`), which a rescue from divergence suggests; written only now
        # that every check has passed.
        current = dict(current, optim_history=resume.optim_history(recorded, current,
                                                                   int(state["step"])))
        if is_main:
            resume.record_config(workdir, current)
    except BaseException:
        outputs.remove()
        raise

    # The loop's settings, read from the config once. -----------------------------------
    batch_size, seed = int(config.batch_size), int(config.seed)
    sched = Schedule.of_kimg(batch_size, total_kimg=float(config.total_kimg),
                             status_kimg=float(config.status_kimg),
                             snapshot_kimg=float(config.snapshot_kimg),
                             checkpoint_kimg=float(config.checkpoint_kimg))
    sigma_rels = tuple(config.ema.sigma_rels)
    grid = snapshot_outputs.SampleGrid(
        rows=int(config.sample.grid_rows), cols=int(config.sample.grid_cols),
        seed=int(config.sample.seed), rng=str(config.sample.get("rng", "jax")),
        ema_key=ema_lib.ema_key(max(sigma_rels)),
        sampler=start.objective.sampler(int(config.sample.num_steps)))
    num_workers = int(config.data.num_workers)
    diagnostics = bool(config.get("diagnostics") and config.diagnostics.enabled)
    ref_lr, grad_clip = float(config.optim.ref_lr), float(config.optim.grad_clip)
    total_kimg = config.total_kimg

    step = step0 = stop.step = int(state["step"])
    if step >= sched.total_steps:
        print(f"Run in {workdir} is already finished at {step * batch_size / 1000:.3f} kimg "
              f"(total_kimg={total_kimg}). Nothing to do.")
        managers.close()
        return {"kimg": step * batch_size / 1000, "finished": True}
    print(f"{'Resuming' if resumed else 'Starting'} in {workdir} at step {step}, "
          f"{step * batch_size / 1000:.3f} kimg", flush=True)

    # Start the loop: the jitted step, the data from the run's position, the logs and the
    # probes of the fresh network. Whether to stop is decided by `consensus` alone, the
    # same on every process (`preemption.StopConsensus`). --------------------------------
    consensus = preemption.StopConsensus(stop, model.mesh)
    stopping, last, failed = False, {}, True
    it = logger = bar = None
    try:
        step_fn = model.train_step(config)
        it = data_lib.make_iterator(
            source, global_batch=batch_size, seed=seed, start_nimg=step * batch_size,
            process_index=jax.process_index(), process_count=jax.process_count(),
            num_workers=num_workers,
            put=functools.partial(shard_lib.global_batch, model.mesh))  # prefetched onto the mesh
        logger = StatsLogger(workdir, step * batch_size) if is_main else None
        diag = probes.Diagnostics(config, model.net, model.tx, source) if diagnostics else None
        if diag is not None and step == 0:  # the fresh network (every process)
            res = diag(state)
            if logger:
                logger.log(dict(kimg=0.0, step=0, **res))
        # A resumed run carries on the status interval its checkpoint kept.
        metrics_log = StepMetrics(batch_size, workdir, step * batch_size, interval=(
            (managers.restored or {}).get(STATUS_INTERVAL) if resumed else None))
        stopping = consensus.before_start()  # a signal during start-up
        if not stopping:
            print("Compiling the training step (the first step; up to ~1 min on CPU)...",
                  flush=True)

        while step < sched.total_steps and not stopping:
            # Train a step. ------------------------------------------------------------
            state, metrics = step_fn(state, next(it))
            step += 1
            stop.step, nimg, done = step, step * batch_size, step >= sched.total_steps
            stopping = consensus.after_step()
            metrics_log.add(metrics, step - 1)
            managers.poll()  # a failed asynchronous save, reported at once
            if bar is None:  # from the first step on: its ETA leaves the compile out
                bar = tqdm(total=sched.total_steps, initial=step, unit="step",
                           disable=not is_main, dynamic_ncols=True, mininterval=2.0)
            else:
                bar.update(1)

            # Report status, then the probes (their time left out of img/s). A stop
            # writes no status line: the checkpoint keeps the interval's running sums,
            # so the log has one row per status point, as an uninterrupted run's.
            if sched.status_due(step) or done:
                last = metrics_log.status(step)
                if logger:
                    logger.log(last)
                tqdm.write(status_line(last))
                if diag is not None:  # every process
                    with metrics_log.excluded():
                        res = diag(state)
                    if logger:
                        logger.log(dict(kimg=nimg / 1000, step=step, **res))

            # Save the EMA snapshot, then (unless stopping) the sample grid and the
            # evaluation. ----------------------------------------------------------------
            if sched.snapshot_due(step) or done:
                metrics_log.check()
                managers.save_snapshot(step, nimg, state["ema"], sigma_rels, batch_size,
                                       buffers=state["buffers"])
                if stopping and not done:  # the same decision on every process
                    tqdm.write(f"kimg {nimg / 1000:9.3f}  sample grid and evaluation "
                               f"skipped: stopping (the snapshot is saved)")
                else:
                    with metrics_log.excluded():
                        snapshot_outputs.grid_and_eval(
                            grid, model.net, state, workdir, nimg, step, stop,
                            eval_key, evaluator, logger, is_main)
                    # A signal during the grid: saved now (one process; with several,
                    # the next step's collective decides).
                    stopping = stopping or consensus.between_steps()

            # Save a checkpoint. --------------------------------------------------------
            if sched.checkpoint_due(step) or done or stopping:
                metrics_log.check()
                managers.save_state(step, state, extra={
                    STATUS_INTERVAL: metrics_log.interval(), resume.KEPT_CONFIG: current})
        failed = False
    except (NonFiniteLossError, checkpoints.NonFiniteStateError) as e:
        if is_main:  # the rescue's --config.resume_step is to be applied (again)
            layout.write_config(workdir, dict(current, resume_step=0))
        hint = resume.rescue_hint(managers, ref_lr, grad_clip, current["optim_history"],
                                  default_ref_lr)
        raise NonFiniteLossError(str(e) + hint) from None

    # Close: the bar, the iterator and the logs; the checkpoint managers closed (waiting
    # for the asynchronous saves) or, when failing, abandoned (the first error is the
    # one raised). -----------------------------------------------------------------------
    finally:
        if bar is not None:
            bar.close()
        if it is not None and hasattr(it, "close"):
            it.close()
        if logger:
            logger.close()
        if failed:
            managers.abandon()
        else:
            managers.close()

    # The last line. ---------------------------------------------------------------------
    nimg = step * batch_size
    if stopping and step < sched.total_steps:
        saved = f"checkpoint {step} saved" if step > step0 else "no new step to save"
        why = (f"signal {stop.signal} (received {stop.where(stop.received_at)})"
               if stop.signal else "a signal to another process")
        print(f"Stopped by {why} at step {step}, {nimg / 1000:.3f} kimg; {saved}. "
              f"Re-run the same command to resume.", flush=True)
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

    Devices: a mesh of shape `config.mesh` (`sharding.py`; `fsdp > 1` shards every
    network of the train state, the objective's too). Several hosts: one process per host, `jax.distributed` set up
    from the environment, each loading its slice of every batch; only process 0 writes
    logs and images; checkpoints are written by all (`workdir` must be shared).
    `process_setup`: what the entry point decides about its process, asked once JAX has
    started (`edm2_jax.process.TrainingSetup`): `num_devices(batch_size, fits)`, how
    many of the devices to train on (`fits(d)`: whether the step splits over `d`), and
    `log_line()`, a line to print about the process (or None). None: all devices.
    `default_ref_lr`: the config file's own `optim.ref_lr`, before overrides (the CLI
    passes it), which the advice after a divergence names when no lower rate of the run
    has trained (`resume.default_rate`).

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
    saved; config.json is (re)written only once every check has passed. A start refused
    before that (a data error, say) removes what it made (`layout.StartOutputs`): a
    workdir it made, or its lock file and empty directories in one that was there.

    Raises ValueError for a config that cannot train (`configs.validate`) or that does
    not match the run in `workdir` (`resume.py`; the optim.* fields may change), the data
    errors of `data.make_source`, RunLockedError when another process trains in
    `workdir`, NoCheckpointError when the run has checkpoints but none restores (unless
    `config.start_over`), NonFiniteLossError when the loss or the state becomes NaN/inf
    (naming the newest healthy checkpoint and `--config.resume_step`), and
    CheckpointSaveError when a checkpoint cannot be written (e.g. disk full; the earlier
    ones are intact).
    """
    objective = configs.validate(config)  # before anything is written
    # First, since jax.distributed installs its own SIGTERM handler (its preemption
    # notifier), which ours must replace.
    shard_lib.maybe_initialize_distributed()
    workdir = paths.normalize(workdir)  # a local path or a gs:// URL (paths.py)
    # The objective and the network it starts from, before the workdir is made: a teacher
    # that is not there leaves nothing behind.
    start = setup.setup_objective(objective, workdir)
    outputs = layout.StartOutputs(workdir)  # a refused start removes what it made
    paths.makedirs(workdir)
    try:
        with lock.RunLock(workdir), preemption.StopRequest() as stop:
            return training_loop(config, workdir, start, stop, outputs, process_setup,
                                 default_ref_lr)
    except BaseException:
        outputs.remove_empty_dirs()  # e.g. the lock refused: no other file is touched
        raise
