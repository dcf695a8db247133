"""EDM2 training: train state, the jitted sharded step, and the training loop.

    from edm2_jax import configs
    from edm2_jax.training import train
    train.train_and_evaluate(configs.base_config(), "runs/fmnist")

Owns the train state (`init_train_state`), the step (`make_train_step`,
`jit_train_step`) and `train_and_evaluate`: named setup steps (`setup_data`,
`setup_eval`, `setup_model`, `restore_or_init`), then one loop. What the loop writes is
`rundir.py`'s; the resume check is `resume.py`'s, preemption `preemption.py`'s, the loss
`loss.py`'s.

The train state is one plain pytree (a dict):

    {'step': int32 [] optimiser steps taken (nimg = step * batch_size),
     'params': online weights, 'buffers': MPFourier buffers (never trained),
     'opt_state': optax state, 'ema': {'power': {'0.050': ..., '0.100': ...}[, 'traditional']},
     'rng': PRNG key}

One step (docs/recipe.md §4): force-normalise the online weights -> EDM2 loss and
gradients (accumulated over micro-batches with `lax.scan` when `batch_per_device` is set)
-> Adam with the inverse-sqrt learning rate at the images seen *before* the step -> power
EMAs with the post-update weights at the images seen *after* it.
"""
from __future__ import annotations

import dataclasses
import math
import os
import resource
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from tqdm import tqdm

from edm2_jax import data as data_lib
from edm2_jax.ema import power as ema_lib
from edm2_jax import configs
from edm2_jax.analysis import diagnostics
from edm2_jax.evaluation import evaluate
from edm2_jax.run import integrity
from edm2_jax.model import loss as loss_lib
from edm2_jax.training import optim as optim_lib
from edm2_jax import paths
from edm2_jax.training import preemption
from edm2_jax.training import resume
from edm2_jax.run import rundir
from edm2_jax.sampling import sampler as sampling
from edm2_jax.training import sharding as shard_lib
from edm2_jax.model.mp import force_normalize
from edm2_jax.model.networks import Precond, init_variables, precond_from_config
from edm2_jax.run.rundir import CheckpointSaveError  # noqa: F401 (raised by train_and_evaluate)

Array = jax.Array


class NonFiniteLossError(RuntimeError):
    """The loss (or the state to be saved) became NaN or infinite; the checkpoints are
    kept and the message names the newest healthy one and how to resume from it."""


# --------------------------------------------------------------------------------------
# State and step


def make_network(config: ml_collections.ConfigDict) -> Precond:
    return precond_from_config(config.network.to_dict())


def init_train_state(config: ml_collections.ConfigDict, net: Precond, tx: optax.GradientTransformation,
                     rng: Array) -> dict:
    """Fresh train state: network init from `rng`, Adam state, EMAs equal to the weights."""
    init_rng, state_rng = jax.random.split(rng)
    variables = init_variables(net, init_rng)
    params = variables["params"]
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "buffers": variables.get("buffers", {}),
        "opt_state": tx.init(params),
        "ema": ema_lib.init_ema_state(params, tuple(config.ema.sigma_rels),
                                      float(config.ema.trad_halflife_kimg)),
        "rng": state_rng,
    }


def num_micro_batches(config: ml_collections.ConfigDict, num_devices: int) -> int:
    """Gradient-accumulation rounds per step; raises ValueError for inconsistent batches."""
    batch = int(config.batch_size)
    if batch % num_devices:
        raise ValueError(f"batch_size {batch} is not divisible by the {num_devices} devices")
    per_device = int(config.batch_per_device or 0) or batch // num_devices
    if batch % (per_device * num_devices):
        raise ValueError(f"batch_size {batch} is not a multiple of batch_per_device "
                         f"{per_device} x {num_devices} devices")
    return batch // (per_device * num_devices)


def make_train_step(config: ml_collections.ConfigDict, net: Precond,
                    tx: optax.GradientTransformation, num_accum: int = 1) -> Callable:
    """Build `train_step(state, batch) -> (state, metrics)` (not yet jitted).

    `batch` = `{'image': f32 [B, H, W, C] in [-1, 1], 'label': f32 [B, L]}` with
    `B = config.batch_size`. Noise levels and noise are drawn for the whole global batch
    from the state's rng, so the result does not depend on device count or on
    `num_accum` (identical math, different summation order). Metrics are a flat dict of
    float32 scalars.
    """
    batch_size = int(config.batch_size)
    lc = config.loss
    sigma_rels = tuple(config.ema.sigma_rels)
    forced_wn = bool(config.optim.get("forced_wn", True))  # False: config D and before
    ema_kw = dict(sigma_rels=sigma_rels, trad_halflife_kimg=float(config.ema.trad_halflife_kimg),
                  trad_rampup_ratio=config.ema.trad_rampup_ratio)

    def objective(params, buffers, images, labels, rnd_normal, noise_unit, dropout_rng):
        return loss_lib.edm2_objective(
            params, buffers, net, images, labels if net.label_dim else None,
            P_mean=lc.P_mean, P_std=lc.P_std, sigma_data=lc.sigma_data, train=True,
            rnd_normal=rnd_normal, noise_unit=noise_unit, dropout_rng=dropout_rng,
            batch_size=batch_size)

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def train_step(state, batch):
        images, labels = batch["image"], batch["label"]
        rng, k_sigma, k_noise, k_drop = jax.random.split(state["rng"], 4)
        rnd_normal = jax.random.normal(k_sigma, (batch_size,), jnp.float32)
        noise_unit = jax.random.normal(k_noise, images.shape, jnp.float32)
        params = force_normalize(state["params"]) if forced_wn else state["params"]
        buffers = state["buffers"]

        if num_accum == 1:
            (loss, aux), grads = grad_fn(params, buffers, images, labels, rnd_normal, noise_unit, k_drop)
        else:
            def split(x):
                # Micro-batch k takes every num_accum-th image, so each device's shard of
                # the batch contributes equally to every micro-batch (no resharding).
                return jnp.swapaxes(x.reshape(batch_size // num_accum, num_accum, *x.shape[1:]), 0, 1)
            micro = jax.tree.map(split, (images, labels, rnd_normal, noise_unit))
            drop_keys = jax.random.split(k_drop, num_accum)

            def body(carry, xs):
                (img, lab, rnd, noi), dk = xs
                (l, a), g = grad_fn(params, buffers, img, lab, rnd, noi, dk)
                return (jax.tree.map(jnp.add, carry[0], g), carry[1] + l), a

            zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
            # On XLA:CPU a micro-batch loop left as a while loop ran 3.6-4x slower per
            # image than the same body unrolled (fashion_mnist net, batch 64 in 2 x 32,
            # benchmarks/README.md, session 5); unrolled, the sums are the same in the same
            # order. Elsewhere the loop stays rolled (compile time grows with unrolling).
            unroll = num_accum if jax.default_backend() == "cpu" else 1
            (grads, loss), auxs = jax.lax.scan(body, zeros, (micro, drop_keys), unroll=unroll)
            aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), auxs)

        nimg = state["step"].astype(jnp.float32) * batch_size
        updates, opt_state = tx.update(grads, state["opt_state"], params, nimg=nimg)
        new_params = optax.apply_updates(params, updates)
        nimg_after = nimg + batch_size
        ema = ema_lib.update_ema(state["ema"], new_params, nimg_after, batch_size, **ema_kw)
        lr = optim_lib.learning_rate(nimg, batch_size=batch_size, ref_lr=config.optim.ref_lr,
                                     t_ref=config.optim.t_ref, rampup_kimg=config.optim.rampup_kimg)
        metrics = {"objective": loss, "lr": jnp.asarray(lr, jnp.float32),
                   "grad_norm": optax.tree.norm(grads),
                   "update_norm": optax.tree.norm(updates),
                   "param_norm": optax.tree.norm(new_params),
                   **{f"loss/{k}": v for k, v in aux.items()}}
        new_state = dict(state, step=state["step"] + 1, params=new_params, opt_state=opt_state,
                         ema=ema, rng=rng)
        return new_state, metrics

    return train_step


def jit_train_step(train_step: Callable, mesh, state_sharding=None) -> Callable:
    """`jax.jit` the step over `mesh`: batch split over the whole mesh, state on
    `state_sharding` (one sharding or a pytree of them like the state, e.g.
    `sharding.state_shardings`; default replicated) and donated, metrics replicated."""
    rep = shard_lib.replicated(mesh)
    bs = shard_lib.batch_sharding(mesh)
    if state_sharding is None:
        state_sharding = rep
    return jax.jit(train_step, in_shardings=(state_sharding, bs),
                   out_shardings=(state_sharding, rep), donate_argnums=(0,))


# --------------------------------------------------------------------------------------
# Setup steps


def setup_data(config: ml_collections.ConfigDict
               ) -> tuple[data_lib.Source, ml_collections.ConfigDict]:
    """The data source, and a copy of `config` whose network matches the data
    (resolution, channels, label_dim; each change printed). Raises ValueError when the
    config wants labels the data lack, and the errors of `data.make_source`."""
    source = data_lib.make_source(config.data)
    src_kw = data_lib.network_kwargs(source)
    config = ml_collections.ConfigDict(config.to_dict())
    if config.data.use_labels and not source.label_dim:
        raise ValueError(f"the config wants labels (data.use_labels=True) but {source.name} has "
                         f"none; set --config.data.use_labels=False for an unconditional model")
    for k, v in src_kw.items():
        if k == "label_dim" and not config.data.use_labels:
            v = 0
        if config.network.get(k) != v:
            print(f"network.{k}: {config.network.get(k)} -> {v} (from the data)")
            config.network[k] = v
    return source, config


def setup_eval(config: ml_collections.ConfigDict, is_main: bool
               ) -> tuple[str | None, evaluate.TrainingEval | None]:
    """`(ema_key, evaluator)` of the evaluation at every snapshot (`config.eval`), or
    `(None, None)` when none is wanted. The key is checked on every process; only
    process 0 evaluates (`evaluator` None elsewhere). Raises ValueError for a bad eval
    config."""
    if not str(config.eval.metrics).strip():
        return None, None
    key = evaluate.TrainingEval.ema_key_of(config)
    return key, evaluate.TrainingEval(config) if is_main else None


@dataclasses.dataclass(frozen=True)
class Model:
    """What `setup_model` builds: the mesh, the network and optimiser, the micro-batches
    per step, and the train state's shapes and shardings."""
    mesh: jax.sharding.Mesh
    net: Precond
    tx: optax.GradientTransformation
    num_accum: int
    abstract_state: Any
    state_sharding: Any


def setup_model(config: ml_collections.ConfigDict) -> Model:
    """The device mesh of `config.mesh` and everything shaped by the config (nothing
    allocated). Raises ValueError for inconsistent batch sizes. On the CPU devices that
    `cpu_env` split the host into, a batch they do not divide trains on fewer of them."""
    from edm2_jax import process as cpu_env

    def fits(d: int) -> bool:
        try:
            num_micro_batches(config, d)
            return d % int((config.get("mesh") or {}).get("fsdp", 1)) == 0
        except ValueError:
            return False

    n_all = jax.device_count()
    n = cpu_env.usable_devices(int(config.batch_size), n_all, fits)
    mesh = shard_lib.mesh_from_config(config, None if n == n_all else n)
    num_accum = num_micro_batches(config, mesh.size)
    net = make_network(config)
    tx = optim_lib.make_optimizer(config.optim, int(config.batch_size))
    abstract_state = jax.eval_shape(lambda r: init_train_state(config, net, tx, r),
                                    jax.random.PRNGKey(config.seed))
    return Model(mesh, net, tx, num_accum, abstract_state,
                 shard_lib.state_shardings(mesh, abstract_state))


def restore_or_init(config: ml_collections.ConfigDict, model: Model,
                    managers: rundir.TrainCheckpoints, resume_step: int = 0
                    ) -> tuple[dict, bool, rundir.TrainCheckpoints]:
    """`(state, resumed, managers)`: the latest complete checkpoint (or checkpoint
    `resume_step`) on the model's shardings, checked against its integrity record
    (`rundir.TrainCheckpoints.restore_latest`), else a fresh state from `config.seed`.
    When the run has checkpoints but none restores, raises NoCheckpointError, unless
    `config.start_over`: then the run's outputs are moved aside and it starts from
    step 0 (with new managers, returned)."""
    try:
        state = managers.restore_latest(model.abstract_state, model.state_sharding,
                                        resume_step=resume_step)
    except rundir.NoCheckpointError:
        if not config.start_over:
            raise
        managers.close()
        moved = rundir.discard_outputs(managers.workdir)
        print(f"Starting over (--config.start_over=True): the run's former outputs are in "
              f"{moved}", flush=True)
        managers = rundir.TrainCheckpoints(managers.workdir, keep=managers.keep)
        state = None
    else:
        if config.start_over and state is not None:
            print(f"--config.start_over=True ignored: checkpoint {int(state['step'])} "
                  f"restores (to start over anyway, use a new --workdir)", flush=True)
    if state is not None:
        return state, True, managers
    init_fn = jax.jit(lambda r: init_train_state(config, model.net, model.tx, r),
                      out_shardings=model.state_sharding)
    state = init_fn(jax.random.PRNGKey(config.seed))
    managers.reference_rms = {"params": integrity.rms(state["params"])}
    return state, False, managers


def effective_resume_step(config: ml_collections.ConfigDict, workdir: str) -> int:
    """`config.resume_step`, or 0 when config.json records that an earlier run of this
    workdir applied it already (then the checkpoints after it are that run's progress,
    not the diverged ones it set aside)."""
    step = int(config.resume_step)
    saved = rundir.read_config(workdir) or {}
    newest = rundir.step_dirs(os.path.join(workdir, rundir.CHECKPOINTS))
    if step and saved.get("resume_step") == step and newest and int(
            os.path.basename(newest[0])) > step:
        print(f"--config.resume_step={step} was applied by an earlier run (config.json); "
              f"resuming from the newest checkpoint, {os.path.basename(newest[0])}", flush=True)
        return 0
    return step


def rescue_hint(managers: rundir.TrainCheckpoints, config: ml_collections.ConfigDict) -> str:
    """How to resume a diverged run: the newest checkpoint that is finite with a
    healthy parameter RMS (`rundir.is_healthy`), and the flags."""
    try:
        managers.close()  # the saves in flight complete (or fail) first
    except rundir.CheckpointSaveError:
        pass
    found = managers.newest_healthy()
    lr = float(config.optim.ref_lr)
    if found is None:
        return (" No checkpoint of this run is healthy (finite, parameter RMS within "
                f"{rundir.HEALTHY_RMS_FACTOR:g}x of the start): start a new run in a new "
                f"--workdir with a lower --config.optim.ref_lr (now {lr:g}).")
    step, record = found
    return (f" The newest healthy checkpoint is step {step} (finite; parameter RMS "
            f"{record['rms']['params']:.3g}). Resume from it with a lower learning rate: "
            f"re-run the same command with --config.resume_step={step} "
            f"--config.optim.ref_lr={lr / 10:g} (or --config.optim.grad_clip=1); the "
            f"optim.* fields may change on resume.")


# --------------------------------------------------------------------------------------
# Loop bookkeeping


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When the loop reports, snapshots and checkpoints, in steps."""
    total_steps: int
    status_every: int
    snapshot_every: int
    checkpoint_every: int

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> "Schedule":
        batch_size = int(config.batch_size)
        steps = lambda kimg: max(1, int(round(kimg * 1000 / batch_size)))  # noqa: E731
        return cls(total_steps=math.ceil(int(round(config.total_kimg * 1000)) / batch_size),
                   status_every=steps(config.status_kimg),
                   snapshot_every=steps(config.snapshot_kimg),
                   checkpoint_every=steps(config.checkpoint_kimg))


class StepMetrics:
    """The steps' metrics, kept on the device until a status line needs them (at most
    two steps in flight, so that progress and timings are honest), and the timings of
    the status lines. `flush` raises NonFiniteLossError on a NaN/inf loss."""

    def __init__(self, batch_size: int, workdir: str, nimg: int):
        self.batch_size, self.workdir = batch_size, workdir
        self.pending: list = []
        self.t_start = self.t_status = time.time()
        self.nimg_status = nimg
        self.first_step_time: float | None = None

    def add(self, metrics: dict, step: int) -> None:
        """The metrics of step `step` (0-based), still on the device."""
        metrics["_step"] = step
        self.pending.append(metrics)
        if len(self.pending) >= 2:
            jax.block_until_ready(self.pending[-2]["objective"])
        if self.first_step_time is None:
            jax.block_until_ready(metrics["objective"])
            self.first_step_time = time.time() - self.t_start
            print(f"First step done {self.first_step_time:.1f} s after start (includes "
                  f"compile)")

    def flush(self) -> dict | None:
        """The means of the pending metrics on the host (None if there are none)."""
        if not self.pending:
            return None
        host, self.pending = jax.device_get(self.pending), []
        for m in host:
            if not np.isfinite(m["objective"]):
                raise NonFiniteLossError(
                    f"non-finite loss ({m['objective']}) at step {m['_step']} "
                    f"(kimg {m['_step'] * self.batch_size / 1000:.1f}); stopping. The "
                    f"checkpoints in {self.workdir}/checkpoints are kept (lower "
                    f"optim.ref_lr or set optim.grad_clip, then resume).")
        return {k: float(np.mean([m[k] for m in host])) for k in host[0] if k != "_step"}

    def status(self, step: int) -> dict:
        """The status line's stats at `step`: metric means, speed, memory, time."""
        nimg = step * self.batch_size
        means = self.flush()
        dt = time.time() - self.t_status
        kimg_done = (nimg - self.nimg_status) / 1000
        stats = dict(kimg=nimg / 1000, step=step, **means,
                     sec_per_kimg=dt / max(kimg_done, 1e-9),
                     img_per_sec=kimg_done * 1000 / max(dt, 1e-9),
                     mem_gib=_memory_gib(), time=time.time() - self.t_start)
        self.t_status, self.nimg_status = time.time(), nimg
        return stats


def _memory_gib() -> float:
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            return stats["peak_bytes_in_use"] / 2**30
    except Exception:  # noqa: BLE001 - not every backend reports memory
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _status_line(s: dict) -> str:
    return (f"kimg {s['kimg']:9.1f}  loss {s['loss/loss']:.4f}  lr {s['lr']:.2e}  sec/kimg "
            f"{s['sec_per_kimg']:.2f}  img/s {s['img_per_sec']:.1f}  mem {s['mem_gib']:.2f} GiB")


# --------------------------------------------------------------------------------------
# At each snapshot: sample grid and evaluation


def _emas_on_host(state: dict, keys: list[str]) -> dict:
    """`{key: EMA variables}` as host arrays, each gathered once (a collective on every
    process, in the same order everywhere) however many consumers want it."""
    return {k: shard_lib.to_host({"params": state["ema"]["power"][k],
                                  "buffers": state["buffers"]})
            for k in dict.fromkeys(keys)}


def save_sample_grid(config: ml_collections.ConfigDict, net: Precond, variables: dict,
                     path: str) -> None:
    """A `config.sample` grid of images of `variables` (one class per column) at `path`."""
    rows, cols = int(config.sample.grid_rows), int(config.sample.grid_cols)
    seeds = np.arange(rows * cols) + int(config.sample.seed)
    labels = None
    if net.label_dim:
        labels = jax.nn.one_hot(np.arange(rows * cols) % net.label_dim, net.label_dim)
    imgs = sampling.sample_images(net, variables, sampling.split_seeds(seeds), labels,
                                  num_steps=int(config.sample.num_steps),
                                  rng=str(config.sample.get("rng", "jax")))
    paths.write_through_local(  # PIL writes local files
        path, lambda local: sampling.save_image_grid(np.asarray(imgs), local, rows, cols))


def _eval_line(nimg: int, ema_key: str, res: dict) -> str:
    return (f"kimg {nimg / 1000:9.1f}  eval (EMA {ema_key}): " + "  ".join(
        f"{k[5:]} {v:.4g}" for k, v in res.items()
        if k != "eval/time_s" and not k.startswith("eval/num_"))
        + f"  [{res['eval/time_s']:.1f} s]")


# --------------------------------------------------------------------------------------
# The loop


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Train to `config.total_kimg`, resuming from the latest checkpoint in `workdir`.

    Writes `config.json`, `checkpoints/` (full state every `checkpoint_kimg`, last
    `keep_checkpoints` kept), `snapshots/` (every tracked EMA every `snapshot_kimg`),
    `stats.jsonl`, TensorBoard scalars in `tb/`, and sample grids `samples/*.png`
    (`rundir.py`). Returns the last status dict (`finished` False when stopped by a
    signal).

    Devices: a mesh of shape `config.mesh` (`sharding.py`; `fsdp > 1` shards params,
    Adam state and EMAs). Several hosts: one process per host, `jax.distributed` set up
    from the environment, each loading its slice of every batch; only process 0 writes
    logs and images; checkpoints are written by all (`workdir` must be shared).

    Faults: SIGTERM/SIGINT finish the current step, save a checkpoint and return (all
    processes stop at the same step, at most one step later; `preemption.py`); a second
    signal interrupts at once. A run killed at any moment resumes from its last complete
    checkpoint (Orbax renames a checkpoint into place only when complete and deletes
    unfinished ones); a checkpoint that does not restore is set aside and the previous
    one is used.

    Integrity (`rundir.py`, `integrity.py`): one training process per workdir (an OS
    file lock, `rundir.RunLock`); every checkpoint and snapshot is saved with a checksum
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
    with rundir.RunLock(workdir), preemption.StopRequest() as stop:
        return _train(config, workdir, stop)


def _train(config: ml_collections.ConfigDict, workdir: str,
           stop: preemption.StopRequest) -> dict:
    is_main = jax.process_index() == 0

    # Set-up, each step failing before anything costly when its part of the config is
    # wrong: data first (a missing or broken dataset fails before anything is compiled),
    # then the config check (same run, or a clear error before any step), then the
    # evaluation, then the model and its state (checked against its checksums); the
    # config is recorded only then.
    source, config = setup_data(config)
    current = resume.check_config(workdir, config)
    eval_key, evaluator = setup_eval(config, is_main)
    model = setup_model(config)
    mesh, net, batch_size = model.mesh, model.net, int(config.batch_size)
    resume_step = effective_resume_step(config, workdir)
    managers = rundir.TrainCheckpoints(workdir, keep=int(config.keep_checkpoints))
    try:
        state, resumed, managers = restore_or_init(config, model, managers, resume_step)
    except BaseException:
        managers.abandon()
        raise
    if is_main:
        resume.record_config(workdir, current)
    sched = Schedule.from_config(config)

    step0 = int(state["step"])
    nimg = step0 * batch_size
    if step0 >= sched.total_steps:
        print(f"Run in {workdir} is already finished at {nimg / 1000:.1f} kimg "
              f"(total_kimg={config.total_kimg}). Nothing to do.")
        managers.close()
        return {"kimg": nimg / 1000, "finished": True}
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))
    print(f"{'Resuming' if resumed else 'Starting'} in {workdir} at step {step0}, "
          f"{nimg / 1000:.1f} kimg", flush=True)
    print(f"Data: {data_lib.describe(source)}")
    print(f"Network: {n_params:,} parameters ({config.network.dtype} compute); batch "
          f"{batch_size} on {mesh.size} device(s) of {jax.process_count()} process(es), mesh "
          f"{dict(mesh.shape)}, {model.num_accum} micro-batch(es) per step; EMAs "
          f"sigma_rel={list(config.ema.sigma_rels)}")
    if jax.default_backend() == "cpu":
        from edm2_jax import process as cpu_env
        print(f"CPU: {cpu_env.describe()}")

    step_fn = jit_train_step(make_train_step(config, net, model.tx, model.num_accum), mesh,
                             model.state_sharding)
    it = data_lib.make_iterator(source, global_batch=batch_size, seed=int(config.seed),
                                start_nimg=nimg, process_index=jax.process_index(),
                                process_count=jax.process_count(),
                                num_workers=int(config.data.num_workers))
    logger = rundir.StatsLogger(workdir) if is_main else None
    sample_key = ema_lib.ema_key(max(config.ema.sigma_rels))
    snapshot_keys = [sample_key] + ([eval_key] if eval_key else [])
    consensus = preemption.StopConsensus(stop, mesh)
    diag = (diagnostics.Diagnostics(config, net, model.tx, source)
            if config.get("diagnostics") and config.diagnostics.enabled else None)
    if diag is not None and step0 == 0:  # the fresh network (every process)
        res = diag(state)
        if logger:
            logger.log(dict(kimg=0.0, step=0, **res))
    metrics_log = StepMetrics(batch_size, workdir, nimg)
    last: dict = {}
    bar = tqdm(total=sched.total_steps, initial=step0, unit="step", disable=not is_main,
               dynamic_ncols=True, mininterval=2.0)

    stop.step = step = step0
    stopping = consensus.before_start()
    try:
        while step < sched.total_steps and not stopping:
            state, metrics = step_fn(state, shard_lib.global_batch(mesh, next(it)))
            step += 1
            stop.step = step
            stopping = consensus.after_step()
            metrics_log.add(metrics, step - 1)
            bar.update(1)
            nimg = step * batch_size
            done = step >= sched.total_steps

            if step % sched.status_every == 0 or done or stopping:
                last = metrics_log.status(step)
                if logger:
                    logger.log(last)
                bar.write(_status_line(last))
                if diag is not None:  # every process; its time counts in the next img/s
                    res = diag(state)
                    if logger:
                        logger.log(dict(kimg=nimg / 1000, step=step, **res))

            if step % sched.snapshot_every == 0 or done:
                metrics_log.flush()
                managers.save_snapshot(step, nimg, state["ema"], tuple(config.ema.sigma_rels),
                                       batch_size, buffers=state["buffers"])
                host = _emas_on_host(state, snapshot_keys)  # every process
                if is_main:
                    t = time.time()
                    path = rundir.samples_path(workdir, f"{nimg // 1000:09d}")
                    save_sample_grid(config, net, host[sample_key], path)
                    print(f"Sample grid (EMA sigma_rel={sample_key}, {config.sample.num_steps} "
                          f"steps, one class per column): {path} [{time.time() - t:.1f} s]")
                if evaluator is not None:
                    res = evaluator(net, host[eval_key])
                    if logger:
                        logger.log(dict(kimg=nimg / 1000, step=step, **res))
                    bar.write(_eval_line(nimg, evaluator.ema_key, res))
                del host

            if step % sched.checkpoint_every == 0 or done or stopping:
                metrics_log.flush()
                managers.save_state(step, state)
    except (NonFiniteLossError, rundir.NonFiniteStateError) as e:
        failed = e
        if is_main:  # the rescue's --config.resume_step is to be applied (again)
            rundir.write_config(workdir, dict(current, resume_step=0))
        raise NonFiniteLossError(str(e) + rescue_hint(managers, config)) from None
    except BaseException:
        failed = True
        raise
    else:
        failed = None
    finally:
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
        why = (f"signal {stop.signal} (received at step {stop.received_at})" if stop.signal
               else "a signal to another process")
        print(f"Stopped by {why} at step {step}, {nimg / 1000:.3f} kimg; {saved}. Re-run the "
              f"same command to resume.", flush=True)
        return dict(last, finished=False, step=step)
    print(f"Training finished at {nimg / 1000:.1f} kimg in "
          f"{time.time() - metrics_log.t_start:.0f} s.")
    return dict(last, finished=True)
