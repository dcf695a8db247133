"""EDM2 training: `train_and_evaluate`, the loop over steps and what it writes.

    from edm2_jax import configs
    from edm2_jax.training import loop
    loop.train_and_evaluate(configs.base_config(), "runs/fmnist")

`set_up` takes the set-up steps of `setup.py` (objective, data, the run's config, config
check, evaluation, model, state); `StepLoop` runs the jitted step of `step.py`, reports
on `progress.py`'s schedule, and at every snapshot writes the EMAs, a sample grid and
the evaluation (`snapshot_outputs.py`). Nothing here asks which objective runs. What it
writes is `edm2_jax.run`'s; the resume check is `resume.py`'s, preemption
`preemption.py`'s.
"""
from __future__ import annotations

import dataclasses
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
from edm2_jax.run import checkpoints, layout, lock
from edm2_jax.run.stats import StatsLogger
from edm2_jax.training import preemption
from edm2_jax.training import probes
from edm2_jax.training import resume
from edm2_jax.training.rescue import optim_history, rescue_hint
from edm2_jax.training import setup
from edm2_jax.training import sharding as shard_lib
from edm2_jax.training import step as step_lib
from edm2_jax.training.snapshot_outputs import grid_and_eval
from edm2_jax.training.progress import NonFiniteLossError, Schedule, StepMetrics, status_line

# The checkpoint record's entry that keeps the running sums of the status interval.
STATUS_INTERVAL = "status_interval"

# --------------------------------------------------------------------------------------
# Set-up


@dataclasses.dataclass
class Run:
    """What `set_up` makes for the step loop: the run's config as it trains, its model
    and train state, data, evaluation and checkpoint managers, and `current`, the
    config as config.json records it."""
    config: ml_collections.ConfigDict
    workdir: str
    is_main: bool
    model: setup.Model
    state: dict
    resumed: bool
    source: Any
    eval_key: str | None
    evaluator: Any
    managers: checkpoints.TrainCheckpoints
    current: dict


def set_up(config: ml_collections.ConfigDict, workdir: str, start: setup.Start,
           process_setup: Any) -> Run:
    """The set-up steps of `setup.py` after the objective (`start`), each failing before
    anything costly when its part of the config is wrong: the data (a broken dataset fails before
    anything is compiled); the run's config; the config check (same run, or a clear
    error before any step); the evaluation; the model and its state (checked against its
    checksums); the config recorded only then. Each stage that may take a while says so
    as it starts."""
    is_main = jax.process_index() == 0
    print(f"Loading the data ({config.data.source})...", flush=True)
    source = setup.setup_data(config)
    config = setup.run_config(config, workdir, start, source)
    print(f"Data: {data_lib.describe(source)}", flush=True)
    current = resume.check_config(workdir, config)
    # The run's record of its starts: config.json, else the copy the newest checkpoint
    # keeps, so that a config.json written again keeps every start's learning rate.
    recorded = resume.saved_config(workdir, quiet=True)
    eval_key, evaluator = setup.setup_eval(config, start.objective, is_main)
    num_devices = None
    if process_setup is not None:
        num_devices = process_setup.num_devices(
            int(config.batch_size), lambda d: step_lib.batch_splits(config, d))
    model = setup.setup_model(config, start, num_devices)
    print_model(config, model, process_setup)
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
    # config.json records the run's config and the learning rate of each start
    # (`optim_history`), which a rescue from divergence suggests.
    current = dict(current, optim_history=optim_history(recorded, current, int(state["step"])))
    if is_main:
        resume.record_config(workdir, current)
    return Run(config, workdir, is_main, model, state, resumed, source, eval_key, evaluator,
               managers, current)


def print_model(config: ml_collections.ConfigDict, model: setup.Model,
                process_setup: Any) -> None:
    """The start-up lines of the network, its precision, batch, mesh and EMAs."""
    n_params = sum(int(np.prod(x.shape)) for x in
                   jax.tree.leaves(model.abstract_state["params"]))
    print(f"Network: {n_params:,} parameters, {setup.precision(config.network.dtype)}; batch "
          f"{int(config.batch_size)} on {model.mesh.size} device(s) of "
          f"{jax.process_count()} process(es), mesh {dict(model.mesh.shape)}, "
          f"{model.num_accum} micro-batch(es) per step; EMAs "
          f"sigma_rel={list(config.ema.sigma_rels)}")
    line = process_setup.log_line() if process_setup is not None else None
    if line:
        print(line)


# --------------------------------------------------------------------------------------
# The step loop


class StepLoop:
    """The training steps of a `Run`, from its state to `config.total_kimg` or a stop:
    each step, then what is due after it (status line, snapshot with its sample grid
    and evaluation, checkpoint). Whether to stop is decided in `poll_stop` alone, the
    same on every process (`preemption.StopConsensus`)."""

    def __init__(self, run: Run, stop: preemption.StopRequest):
        config, model = run.config, run.model
        self.run, self.stop, self.config = run, stop, config
        self.state, self.batch_size = run.state, int(config.batch_size)
        self.step0 = self.step = stop.step = int(run.state["step"])
        self.sched = Schedule.from_config(config)
        self.sampler = model.start.objective.sampler(int(config.sample.num_steps))
        self.sample_key = ema_lib.ema_key(max(config.ema.sigma_rels))
        self.snapshot_keys = [self.sample_key] + ([run.eval_key] if run.eval_key else [])
        self.consensus = preemption.StopConsensus(stop, model.mesh)
        self.stopping, self.last, self.bar = False, {}, None
        self.it = self.logger = None

    @property
    def nimg(self) -> int:
        return self.step * self.batch_size

    def start(self) -> None:
        """The compiled step, the data iterator from the run's position, the logs, and
        the probes of the fresh network (step 0)."""
        run, config = self.run, self.config
        self.step_fn = run.model.train_step(config)
        self.it = data_lib.make_iterator(
            run.source, global_batch=self.batch_size, seed=int(config.seed),
            start_nimg=self.nimg, process_index=jax.process_index(),
            process_count=jax.process_count(), num_workers=int(config.data.num_workers))
        self.logger = StatsLogger(run.workdir, self.nimg) if run.is_main else None
        self.diag = (probes.Diagnostics(config, run.model.net, run.model.tx, run.source)
                     if config.get("diagnostics") and config.diagnostics.enabled else None)
        if self.diag is not None and self.step == 0:  # the fresh network (every process)
            self.log(dict(kimg=0.0, step=0, **self.diag(self.state)))
        # A resumed run carries on the status interval its checkpoint kept.
        self.metrics_log = StepMetrics(self.batch_size, run.workdir, self.nimg, interval=(
            run.managers.restored or {}).get(STATUS_INTERVAL) if run.resumed else None)

    def log(self, row: dict) -> None:
        if self.logger:
            self.logger.log(row)

    def poll_stop(self, point: str) -> bool:
        """Whether to stop, asked of every process at `point` ('start', 'step', or
        'grid': between steps, after a sample grid); once True, it stays True."""
        if not self.stopping:
            self.stopping = {"start": self.consensus.before_start,
                             "step": self.consensus.after_step,
                             "grid": self.consensus.between_steps}[point]()
        return self.stopping

    def steps(self) -> None:
        """Train until `total_kimg` or a stop."""
        if not self.poll_stop("start"):
            print("Compiling the training step (the first step; up to ~1 min on CPU)...",
                  flush=True)
        mesh = self.run.model.mesh
        while self.step < self.sched.total_steps and not self.stopping:
            batch = shard_lib.global_batch(mesh, next(self.it))
            self.state, metrics = self.step_fn(self.state, batch)
            self.step += 1
            self.stop.step = self.step
            self.poll_stop("step")
            self.metrics_log.add(metrics, self.step - 1)
            self.run.managers.poll()  # a failed asynchronous save, reported at once
            self.advance_bar()
            self.after_step()

    def advance_bar(self) -> None:
        """The progress bar, from the first step on (its ETA leaves the compile out)."""
        if self.bar is None:
            self.bar = tqdm(total=self.sched.total_steps, initial=self.step, unit="step",
                            disable=not self.run.is_main, dynamic_ncols=True, mininterval=2.0)
        else:
            self.bar.update(1)

    def after_step(self) -> None:
        """The status line, snapshot and checkpoint that are due after this step. A stop
        writes no status line: the checkpoint keeps the running sums of the status
        interval, so the log has one row per status point, as an uninterrupted run's."""
        done = self.step >= self.sched.total_steps
        if self.sched.status_due(self.step) or done:
            self.report()
        if self.sched.snapshot_due(self.step) or done:
            self.snapshot(done)
        if self.sched.checkpoint_due(self.step) or done or self.stopping:
            self.metrics_log.check()
            self.run.managers.save_state(self.step, self.state, extra={
                STATUS_INTERVAL: self.metrics_log.interval(),
                resume.KEPT_CONFIG: self.run.current})

    def report(self) -> None:
        """The status line after this step, then the probes (their time left out of img/s)."""
        self.last = stats = self.metrics_log.status(self.step)
        self.log(stats)
        tqdm.write(status_line(stats))
        if self.diag is not None:  # every process
            with self.metrics_log.excluded():
                res = self.diag(self.state)
            self.log(dict(kimg=self.nimg / 1000, step=self.step, **res))

    def snapshot(self, done: bool) -> None:
        """The EMAs saved, then (unless stopping) the sample grid and the evaluation."""
        run, config, nimg = self.run, self.config, self.nimg
        self.metrics_log.check()
        run.managers.save_snapshot(self.step, nimg, self.state["ema"],
                                   tuple(config.ema.sigma_rels), self.batch_size,
                                   buffers=self.state["buffers"])
        if self.stopping and not done:  # the same decision on every process
            tqdm.write(f"kimg {nimg / 1000:9.3f}  sample grid and evaluation "
                       f"skipped: stopping (the snapshot is saved)")
            return
        with self.metrics_log.excluded():
            grid_and_eval(config, run.model.net, self.state, run.workdir, nimg, self.step,
                          self.stop, self.sample_key, self.snapshot_keys, run.evaluator,
                          self.logger, run.is_main, self.sampler)
        # A signal during the grid: saved now (one process; with several, the next
        # step's collective decides).
        self.poll_stop("grid")

    def close(self, failed: bool) -> None:
        """The bar, the iterator and the logs closed; the checkpoint managers closed
        (waiting for the asynchronous saves) or, when failing, abandoned (the first
        error is the one raised)."""
        if self.bar is not None:
            self.bar.close()
        if self.it is not None and hasattr(self.it, "close"):
            self.it.close()
        if self.logger:
            self.logger.close()
        if failed:
            self.run.managers.abandon()
        else:
            self.run.managers.close()

    def ending(self) -> dict:
        """The last line, and `train_and_evaluate`'s result."""
        nimg = self.nimg
        if self.stopping and self.step < self.sched.total_steps:
            saved = (f"checkpoint {self.step} saved" if self.step > self.step0
                     else "no new step to save")
            stop = self.stop
            why = (f"signal {stop.signal} (received {stop.where(stop.received_at)})"
                   if stop.signal else "a signal to another process")
            print(f"Stopped by {why} at step {self.step}, {nimg / 1000:.3f} kimg; {saved}. "
                  f"Re-run the same command to resume.", flush=True)
            return dict(self.last, finished=False, step=self.step)
        print(f"Training finished at {nimg / 1000:.3f} kimg in "
              f"{time.time() - self.metrics_log.t_start:.0f} s.")
        return dict(self.last, finished=True)


def _train(config: ml_collections.ConfigDict, workdir: str, start: setup.Start,
           stop: preemption.StopRequest, process_setup: Any,
           default_ref_lr: float | None, outputs: layout.StartOutputs) -> dict:
    """`train_and_evaluate`'s body, run holding the run's lock and the signal handlers; a
    start refused in `set_up` removes what it made (`outputs`)."""
    try:
        run = set_up(config, workdir, start, process_setup)
    except BaseException:
        outputs.remove()
        raise
    loop = StepLoop(run, stop)
    if loop.step >= loop.sched.total_steps:
        print(f"Run in {workdir} is already finished at {loop.nimg / 1000:.3f} kimg "
              f"(total_kimg={run.config.total_kimg}). Nothing to do.")
        run.managers.close()
        return {"kimg": loop.nimg / 1000, "finished": True}
    print(f"{'Resuming' if run.resumed else 'Starting'} in {workdir} at step {loop.step}, "
          f"{loop.nimg / 1000:.3f} kimg", flush=True)
    try:
        loop.start()
        loop.steps()
    except (NonFiniteLossError, checkpoints.NonFiniteStateError) as e:
        if run.is_main:  # the rescue's --config.resume_step is to be applied (again)
            layout.write_config(workdir, dict(run.current, resume_step=0))
        hint = rescue_hint(run.managers, run.config, run.current["optim_history"],
                           default_ref_lr)
        loop.close(failed=True)
        raise NonFiniteLossError(str(e) + hint) from None
    except BaseException:
        loop.close(failed=True)
        raise
    loop.close(failed=False)
    return loop.ending()


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
    has trained (`rescue.default_rate`).

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
    configs.validate(config)  # before anything is written
    # First, since jax.distributed installs its own SIGTERM handler (its preemption
    # notifier), which ours must replace.
    shard_lib.maybe_initialize_distributed()
    workdir = paths.normalize(workdir)  # a local path or a gs:// URL (paths.py)
    # The objective and the network it starts from, before the workdir is made: a teacher
    # that is not there leaves nothing behind.
    start = setup.setup_objective(config, workdir)
    outputs = layout.StartOutputs(workdir)  # a refused start removes what it made
    paths.makedirs(workdir)
    try:
        with lock.RunLock(workdir), preemption.StopRequest() as stop:
            return _train(config, workdir, start, stop, process_setup, default_ref_lr,
                          outputs)
    except BaseException:
        outputs.remove_empty_dirs()  # e.g. the lock refused: no other file is touched
        raise
