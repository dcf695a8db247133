"""EDM2 training: train state, the jitted sharded step, and the training loop.

    from edm2_jax import configs, train
    train.train_and_evaluate(configs.base_config(), "runs/fmnist")

The train state is one plain pytree (a dict):

    {'step': int32 [] optimiser steps taken (nimg = step * batch_size),
     'params': online weights, 'buffers': MPFourier buffers (never trained),
     'opt_state': optax state, 'ema': {'power': {'0.050': ..., '0.100': ...}[, 'traditional']},
     'rng': PRNG key}

One step (SPEC section 4): force-normalise the online weights -> EDM2 loss and gradients
(accumulated over micro-batches with `lax.scan` when `batch_per_device` is set) -> Adam
with the inverse-sqrt learning rate at the images seen *before* the step -> power EMAs
with the post-update weights at the images seen *after* it.
"""
from __future__ import annotations

import errno
import functools
import json
import math
import os
import signal
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from edm2_jax import checkpoint as ckpt_lib
from edm2_jax import data as data_lib
from edm2_jax import ema as ema_lib
from edm2_jax import loss as loss_lib
from edm2_jax import optim as optim_lib
from edm2_jax import sharding as shard_lib
from edm2_jax.mp import force_normalize
from edm2_jax.networks import Precond, init_variables, precond_from_config

Array = jax.Array


class NonFiniteLossError(RuntimeError):
    pass


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (disk full, permissions, ...); earlier ones are intact."""


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
    ema_kw = dict(sigma_rels=sigma_rels, trad_halflife_kimg=float(config.ema.trad_halflife_kimg),
                  trad_rampup_ratio=config.ema.trad_rampup_ratio)

    def objective(params, buffers, images, labels, rnd_normal, noise_unit, dropout_rng):
        per_image, aux = loss_lib.edm2_loss(
            params, buffers, net, images, labels if net.label_dim else None,
            P_mean=lc.P_mean, P_std=lc.P_std, sigma_data=lc.sigma_data, train=True,
            rnd_normal=rnd_normal, noise_unit=noise_unit, dropout_rng=dropout_rng)
        return jnp.sum(per_image) / batch_size, aux

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def train_step(state, batch):
        images, labels = batch["image"], batch["label"]
        rng, k_sigma, k_noise, k_drop = jax.random.split(state["rng"], 4)
        rnd_normal = jax.random.normal(k_sigma, (batch_size,), jnp.float32)
        noise_unit = jax.random.normal(k_noise, images.shape, jnp.float32)
        params = force_normalize(state["params"])
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
            (grads, loss), auxs = jax.lax.scan(body, zeros, (micro, drop_keys))
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
# Config bookkeeping

# Fields that must not change when resuming in the same workdir.
_RESUME_FIELDS = ("network", "loss", "optim", "ema", "batch_size", "seed", "data.source",
                  "data.name", "data.split", "data.resolution", "data.use_labels")


def _lookup(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _normalise_json(x):
    return json.loads(json.dumps(x))


def check_config_matches(saved: dict, current: dict, workdir: str) -> None:
    """Raise ValueError listing every training-relevant field that differs from the config
    saved in `workdir` (a resumed run must be the same run)."""
    diffs = []
    for field in _RESUME_FIELDS:
        a, b = _normalise_json(_lookup(saved, field)), _normalise_json(_lookup(current, field))
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    diffs.append(f"{field}.{k}: checkpoint {a.get(k)!r} vs now {b.get(k)!r}")
        elif a != b:
            diffs.append(f"{field}: checkpoint {a!r} vs now {b!r}")
    if diffs:
        raise ValueError(
            f"the config does not match the run in {workdir}:\n  " + "\n  ".join(diffs)
            + "\nUse a new --workdir for a different run, or restore those settings to resume.")


# --------------------------------------------------------------------------------------
# The loop


def _memory_gib() -> float:
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            return stats["peak_bytes_in_use"] / 2**30
    except Exception:  # noqa: BLE001 - not every backend reports memory
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _save_error(e: Exception, step: int, workdir: str, managers) -> CheckpointSaveError:
    """The error to raise when saving the checkpoint or EMA snapshot of `step` failed
    with `e` (Orbax wraps the OSError of a full disk; it is found in the chain)."""
    cause, seen = e, set()
    while cause is not None and not isinstance(cause, OSError) and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    cause = cause if isinstance(cause, OSError) else e
    try:
        done = sorted(managers.state_mngr.all_steps(read=True) or [])
    except Exception:  # noqa: BLE001 - only for the message
        done = "?"
    hint = "free disk space" if getattr(cause, "errno", None) == errno.ENOSPC else "fix that"
    return CheckpointSaveError(
        getattr(cause, "errno", None) or errno.EIO,
        f"saving step {step} in {workdir} failed: {type(cause).__name__}: {cause}. The "
        f"complete earlier checkpoints {done} are intact (unfinished saves are deleted on the "
        f"next start); {hint} and re-run the same command to resume from the latest.")


def _ema_variables(state: dict, key: str) -> dict:
    return {"params": state["ema"]["power"][key], "buffers": state["buffers"]}


class StopRequest:
    """SIGTERM/SIGINT as a request to stop after the current step (preemption).

    Within `with StopRequest() as stop:` the first signal sets `stop.signal` (its
    number) and `stop.received_at` (the value of `stop.step`, which the training loop
    keeps current); a second one raises KeyboardInterrupt at once. The previous handlers
    come back on exit. Outside the main thread, where Python cannot catch signals, it
    changes nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal: int | None = None
        self.received_at: int | None = None
        self.step = 0
        self._old: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _handle(self, signum, _frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt(f"second signal {signum}: stopping without a checkpoint")
        self.signal, self.received_at = signum, self.step
        print(f"\nReceived signal {signum} at step {self.step}: finishing this step, saving a "
              f"checkpoint, exiting (send it again to stop at once).", flush=True)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Train to `config.total_kimg`, resuming from the latest checkpoint in `workdir`.

    Writes `config.json`, `checkpoints/` (full state every `checkpoint_kimg`, last
    `keep_checkpoints` kept), `snapshots/` (every tracked EMA every `snapshot_kimg`),
    `stats.jsonl`, TensorBoard scalars in `tb/`, and sample grids `samples/*.png`.
    Returns the last status dict (`finished` False when stopped by a signal).

    Devices: a mesh of shape `config.mesh` (`sharding.py`; `fsdp > 1` shards params,
    Adam state and EMAs). Several hosts: one process per host, `jax.distributed` set up
    from the environment, each loading its slice of every batch; only process 0 writes
    logs and images; checkpoints are written by all (`workdir` must be shared).

    Faults: SIGTERM/SIGINT finish the current step, save a checkpoint and return (all
    processes stop at the same step, at most one step later); a second signal
    interrupts at once. A run killed at any moment resumes from its last complete
    checkpoint (Orbax renames a checkpoint into place only when complete and deletes
    unfinished ones); a checkpoint that does not restore is set aside and the previous
    one is used.

    Raises ValueError for a config that does not match the run in `workdir`, the data
    errors of `data.make_source`, NonFiniteLossError when the loss becomes NaN/inf (the
    last good checkpoint is kept), and CheckpointSaveError when a checkpoint cannot be
    written (e.g. disk full; the earlier ones are intact).
    """
    # First, since jax.distributed installs its own SIGTERM handler (its preemption
    # notifier), which ours must replace.
    shard_lib.maybe_initialize_distributed()
    with StopRequest() as stop:
        return _train_and_evaluate(config, workdir, stop)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                        stop: StopRequest) -> dict:
    from edm2_jax import checkpoint_train as ct  # heavy orbax imports only when training
    from edm2_jax.sampling import sample_images, save_image_grid

    workdir = os.path.abspath(os.path.expanduser(workdir))
    is_main = jax.process_index() == 0
    os.makedirs(workdir, exist_ok=True)

    # Data first: a missing or broken dataset fails before anything is compiled.
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

    # Config bookkeeping: same run, or a clear error before any step.
    cfg_path = os.path.join(workdir, "config.json")
    current = json.loads(config.to_json_best_effort())
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            check_config_matches(json.load(f), current, workdir)
    if is_main:
        with open(cfg_path + ".tmp", "w") as f:
            json.dump(current, f, indent=2)
        os.replace(cfg_path + ".tmp", cfg_path)

    # Evaluation during training: process 0 generates and measures (the others wait at
    # their next collective); set up before the state so that a bad eval config fails at once.
    eval_wanted = bool(str(config.eval.metrics).strip())
    evaluator, evaluator_key = None, None
    if eval_wanted:
        from edm2_jax.evaluate import TrainingEval
        evaluator_key = TrainingEval.ema_key_of(config)  # checked on every process
        evaluator = TrainingEval(config) if is_main else None

    mesh = shard_lib.mesh_from_config(config)
    num_accum = num_micro_batches(config, mesh.size)
    batch_size = int(config.batch_size)
    net = make_network(config)
    tx = optim_lib.make_optimizer(config.optim, batch_size)
    abstract_state = jax.eval_shape(lambda r: init_train_state(config, net, tx, r),
                                    jax.random.PRNGKey(config.seed))
    state_sharding = shard_lib.state_shardings(mesh, abstract_state)
    init_fn = jax.jit(lambda r: init_train_state(config, net, tx, r),
                      out_shardings=state_sharding)

    managers = ct.TrainCheckpoints(workdir, keep=int(config.keep_checkpoints))
    state = managers.restore_latest(abstract_state, state_sharding)
    resumed = state is not None
    if state is None:
        state = init_fn(jax.random.PRNGKey(config.seed))
    step0 = int(state["step"])
    nimg = step0 * batch_size
    total_nimg = int(round(config.total_kimg * 1000))
    if nimg >= total_nimg:
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
          f"{dict(mesh.shape)}, {num_accum} micro-batch(es) per step; EMAs "
          f"sigma_rel={list(config.ema.sigma_rels)}")

    step_fn = jit_train_step(make_train_step(config, net, tx, num_accum), mesh, state_sharding)
    it = data_lib.make_iterator(source, global_batch=batch_size, seed=int(config.seed),
                                start_nimg=nimg, process_index=jax.process_index(),
                                process_count=jax.process_count(),
                                num_workers=int(config.data.num_workers))

    logger = ct.StatsLogger(workdir) if is_main else None
    kimg_to_steps = lambda kimg: max(1, int(round(kimg * 1000 / batch_size)))
    status_every = kimg_to_steps(config.status_kimg)
    ckpt_every = kimg_to_steps(config.checkpoint_kimg)
    snap_every = kimg_to_steps(config.snapshot_kimg)
    total_steps = math.ceil(total_nimg / batch_size)

    # Preemption: the signal handler (StopRequest) only raises a flag; the loop finishes
    # the step in flight, checkpoints and returns. Processes OR their flags
    # (sharding.any_process) so that all stop at the same step.
    stop.step = step0
    stop_flags: list = []

    def stop_agreed() -> bool:
        """Whether every process stops after this step (one collective per step, read
        one step later so that it never waits for the device)."""
        local = stop.signal is not None
        if jax.process_count() == 1:
            return local
        stop_flags.append(shard_lib.any_process(mesh, local))
        return len(stop_flags) > 1 and bool(stop_flags.pop(0))

    def save_state(step: int):
        try:
            # A checkpoint must not land before the EMA snapshots of its steps: a run
            # killed in between would resume past them and never write them.
            managers.snap_mngr.wait_until_finished()
            managers.save_state(step, state)
        except Exception as e:  # noqa: BLE001 - re-raised with the fix named
            raise _save_error(e, step, workdir, managers) from e

    host_emas: dict = {}  # EMA variables gathered to host at the current snapshot

    def ema_on_host(key: str) -> dict:
        """EMA `key` with the buffers as host arrays (a gather on every process), once per
        snapshot however many consumers (sample grid, evaluation) want it."""
        if key not in host_emas:
            host_emas[key] = shard_lib.to_host(_ema_variables(state, key))
        return host_emas[key]

    def save_samples(tag: str):
        key = ema_lib.ema_key(max(config.ema.sigma_rels))
        variables = ema_on_host(key)  # every process
        if not is_main:
            return
        rows, cols = int(config.sample.grid_rows), int(config.sample.grid_cols)
        seeds = np.arange(rows * cols) + int(config.sample.seed)
        labels = None
        if net.label_dim:
            labels = jax.nn.one_hot(np.arange(rows * cols) % net.label_dim, net.label_dim)
        t = time.time()
        imgs = sample_images(net, variables, seeds, labels, num_steps=int(config.sample.num_steps))
        path = os.path.join(workdir, "samples", f"{tag}.png")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_image_grid(np.asarray(imgs), path, rows, cols)
        print(f"Sample grid (EMA sigma_rel={key}, {config.sample.num_steps} steps, one class "
              f"per column): {path} [{time.time() - t:.1f} s]")

    def run_eval(step: int, nimg: int):
        variables = ema_on_host(evaluator_key)  # every process
        if evaluator is None:
            return
        res = evaluator(net, variables)
        if logger:
            logger.log(dict(kimg=nimg / 1000, step=step, **res))
        bar.write(f"kimg {nimg / 1000:9.1f}  eval (EMA {evaluator.ema_key}): " + "  ".join(
            f"{k[5:]} {v:.4g}" for k, v in res.items()
            if k != "eval/time_s" and not k.startswith("eval/num_"))
            + f"  [{res['eval/time_s']:.1f} s]")

    pending: list = []
    last = {}
    t_start = time.time()
    t_status, nimg_status = time.time(), nimg
    first_step_time = None
    from tqdm import tqdm
    bar = tqdm(total=total_steps, initial=step0, unit="step", disable=not is_main,
               dynamic_ncols=True, mininterval=2.0)

    def flush_metrics():
        """Bring pending metrics to host, stop on a non-finite loss."""
        nonlocal pending
        if not pending:
            return None
        host = jax.device_get(pending)
        pending = []
        for m in host:
            if not np.isfinite(m["objective"]):
                raise NonFiniteLossError(
                    f"non-finite loss ({m['objective']}) at step {m['_step']} "
                    f"(kimg {m['_step'] * batch_size / 1000:.1f}); stopping. The last good "
                    f"checkpoint in {workdir}/checkpoints is kept; lower optim.ref_lr or set "
                    f"optim.grad_clip, then resume.")
        return {k: float(np.mean([m[k] for m in host])) for k in host[0] if k != "_step"}

    try:
        # A signal during start-up (one process): stop before the first step.
        step, stopping = step0, jax.process_count() == 1 and stop.signal is not None
        while step < total_steps and not stopping:
            batch = shard_lib.global_batch(mesh, next(it))
            state, metrics = step_fn(state, batch)
            step += 1
            stop.step = step
            stopping = stop_agreed()
            metrics["_step"] = step - 1
            pending.append(metrics)
            if len(pending) >= 2:  # at most 2 steps in flight: honest progress and timings
                jax.block_until_ready(pending[-2]["objective"])
            if first_step_time is None:
                jax.block_until_ready(metrics["objective"])
                first_step_time = time.time() - t_start
                print(f"First step done {first_step_time:.1f} s after start (includes compile)")
            bar.update(1)
            nimg = step * batch_size
            done = step >= total_steps
            if step % status_every == 0 or done or stopping:
                means = flush_metrics()
                dt = time.time() - t_status
                kimg_done = (nimg - nimg_status) / 1000
                last = dict(kimg=nimg / 1000, step=step, **means,
                            sec_per_kimg=dt / max(kimg_done, 1e-9),
                            img_per_sec=kimg_done * 1000 / max(dt, 1e-9),
                            mem_gib=_memory_gib(), time=time.time() - t_start)
                t_status, nimg_status = time.time(), nimg
                if logger:
                    logger.log(last)
                bar.write(f"kimg {last['kimg']:9.1f}  loss {last['loss/loss']:.4f}  "
                          f"lr {last['lr']:.2e}  sec/kimg {last['sec_per_kimg']:.2f}  "
                          f"img/s {last['img_per_sec']:.1f}  mem {last['mem_gib']:.2f} GiB")
            if step % snap_every == 0 or done:
                flush_metrics()
                managers.save_snapshot(step, nimg, state["ema"], tuple(config.ema.sigma_rels),
                                       batch_size, buffers=state["buffers"])
                save_samples(f"{nimg // 1000:09d}")
                if eval_wanted:
                    run_eval(step, nimg)
                host_emas.clear()
            if step % ckpt_every == 0 or done or stopping:
                flush_metrics()
                save_state(step)
    finally:
        bar.close()
        it.close() if hasattr(it, "close") else None
        if logger:
            logger.close()
        try:
            managers.close()  # waits for async saves to finish
        except Exception as e:  # noqa: BLE001 - re-raised with the fix named
            raise _save_error(e, step, workdir, managers) from e

    if stopping and step < total_steps:
        saved = f"checkpoint {step} saved" if step > step0 else "no new step to save"
        why = (f"signal {stop.signal} (received at step {stop.received_at})" if stop.signal
               else "a signal to another process")
        print(f"Stopped by {why} at step {step}, {nimg / 1000:.3f} kimg; {saved}. Re-run the "
              f"same command to resume.", flush=True)
        return dict(last, finished=False, step=step)
    print(f"Training finished at {nimg / 1000:.1f} kimg in {time.time() - t_start:.0f} s.")
    return dict(last, finished=True)
