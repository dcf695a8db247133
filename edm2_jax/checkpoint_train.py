"""Orbax managers of a training run, and its stats log.

    WORKDIR/checkpoints/<step>/   full train state every `checkpoint_kimg` (async, last N kept)
    WORKDIR/snapshots/<step>/     every tracked EMA every `snapshot_kimg` (all kept), with
                                  JSON metadata {nimg, batch_size, sigma_rels, ema_keys}
                                  and optionally the MPFourier buffers: the input of
                                  post-hoc EMA reconstruction (phema.py)
    WORKDIR/stats.jsonl, WORKDIR/tb/

Orbax writes into a temporary directory and renames it when complete, so a run killed
mid-save never sees a half-written checkpoint; `restore_latest` only lists finalised ones.
"""
from __future__ import annotations

import json
import os
import warnings

import jax
import orbax.checkpoint as ocp


class TrainCheckpoints:
    """The two managers of a run (state and EMA snapshots)."""

    def __init__(self, workdir: str, keep: int = 3):
        self.workdir = workdir
        self.state_mngr = ocp.CheckpointManager(
            os.path.join(workdir, "checkpoints"), item_handlers=ocp.StandardCheckpointHandler(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=True,
                                                 cleanup_tmp_directories=True))
        self.snap_mngr = ocp.CheckpointManager(
            os.path.join(workdir, "snapshots"),
            options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                                 enable_async_checkpointing=True,
                                                 cleanup_tmp_directories=True))

    def save_state(self, step: int, state: dict) -> None:
        if step in (self.state_mngr.all_steps() or []):
            return
        self.state_mngr.save(step, args=ocp.args.StandardSave(state))

    def save_snapshot(self, step: int, nimg: int, ema: dict, sigma_rels, batch_size: int,
                      buffers: dict | None = None) -> None:
        """Save the EMAs (and, if given, the MPFourier `buffers`, which post-hoc EMA
        reconstruction writes into its network checkpoints) as snapshot `step`."""
        if step in (self.snap_mngr.all_steps() or []):
            return
        meta = {"nimg": int(nimg), "batch_size": int(batch_size),
                "sigma_rels": [float(s) for s in sigma_rels],
                "ema_keys": sorted(ema.get("power", {})),
                "traditional": "traditional" in ema}
        items = dict(ema=ocp.args.StandardSave(ema), meta=ocp.args.JsonSave(meta))
        if buffers:  # Orbax cannot save an empty tree
            items["buffers"] = ocp.args.StandardSave(buffers)
        self.snap_mngr.save(step, args=ocp.args.Composite(**items))

    def restore_latest(self, abstract_state, sharding) -> dict | None:
        """Latest complete state checkpoint restored onto `sharding` (one sharding, or a
        pytree of them like `abstract_state`), or None if there is none. A checkpoint
        that fails to restore is renamed `<step>.corrupt` with a warning (so that the
        resumed run can save that step again) and the previous one is tried; one whose
        metadata names other arrays or shapes (different config) raises ValueError."""
        steps = sorted(self.state_mngr.all_steps() or [], reverse=True)
        if isinstance(sharding, jax.sharding.Sharding):
            sharding = jax.tree.map(lambda _: sharding, abstract_state)
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state,
            sharding)
        errors = []
        want = _shapes(abstract_state)
        for step in steps:
            try:
                saved = _shapes(self.state_mngr.item_metadata(step))
                state = (self.state_mngr.restore(step, args=ocp.args.StandardRestore(target))
                         if saved == want else None)
            except Exception as e:  # noqa: BLE001 - orbax raises many types
                warnings.warn(f"checkpoint {step} failed to restore ({str(e)[:300]}); moved "
                              f"to {step}.corrupt, trying the previous one")
                self._set_aside(step)
                errors.append(step)
                continue
            if saved != want:
                diff = sorted(set(saved.items()) ^ set(want.items()))[:4]
                raise ValueError(
                    f"checkpoint {step} in {self.workdir}/checkpoints does not match the "
                    f"current model/optimiser config (differing (path, shape): {diff}). Use a "
                    f"new --workdir or the config the run was started with.")
            return state
        if errors:
            raise RuntimeError(f"no checkpoint in {self.workdir}/checkpoints could be restored "
                               f"(tried steps {errors})")
        return None

    def _set_aside(self, step: int) -> None:
        """Rename checkpoint `step` to `<step>.corrupt` (process 0; all wait for it)."""
        path = os.path.join(self.workdir, "checkpoints", str(step))
        if jax.process_index() == 0 and os.path.isdir(path):
            dst, n = f"{path}.corrupt", 1
            while os.path.exists(dst):
                dst, n = f"{path}.corrupt{n}", n + 1
            os.replace(path, dst)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
        self.state_mngr.reload()

    def close(self) -> None:
        self.state_mngr.wait_until_finished()
        self.snap_mngr.wait_until_finished()
        self.state_mngr.close()
        self.snap_mngr.close()


def _shapes(tree) -> dict:
    """`{path: shape}` of the arrays of a pytree (or of Orbax tree metadata, whose
    named tuples appear as dicts), path = tuple of key names."""
    def name(k):
        return str(next(getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)))
    return {tuple(name(k) for k in path): tuple(x.shape)
            for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def list_snapshots(workdir: str) -> list[tuple[int, dict]]:
    """`[(step, meta), ...]` of the complete EMA snapshots of a run, oldest first."""
    mngr = ocp.CheckpointManager(os.path.join(workdir, "snapshots"),
                                 options=ocp.CheckpointManagerOptions(create=False))
    out = []
    for step in sorted(mngr.all_steps() or []):
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        out.append((step, dict(meta)))
    mngr.close()
    return out


def restore_snapshot(workdir: str, step: int) -> tuple[dict, dict]:
    """`(ema_tree, meta)` of snapshot `step` as numpy arrays (on any devices)."""
    mngr = ocp.CheckpointManager(os.path.join(workdir, "snapshots"),
                                 options=ocp.CheckpointManagerOptions(create=False))
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    mngr.close()
    return restore_numpy(os.path.join(workdir, "snapshots", str(step), "ema")), dict(meta)


def restore_numpy(directory: str):
    """The Orbax checkpoint item `directory` (e.g. `RUN/checkpoints/<step>/default`) as
    host numpy arrays, whatever mesh and number of processes wrote it; a restore without
    a target would need the devices that saved it ("Topology mismatch"). Named tuples
    (Adam's state) come back as dicts and lists."""
    import numpy as np
    md = ocp.PyTreeCheckpointer().metadata(directory)
    md = getattr(md, "item_metadata", md)
    md = getattr(md, "tree", md)
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), md)
    return ocp.PyTreeCheckpointer().restore(
        directory, args=ocp.args.PyTreeRestore(restore_args=restore_args))


class StatsLogger:
    """Appends status dicts to `stats.jsonl` and TensorBoard scalars (tensorboardX, no
    TensorFlow needed)."""

    def __init__(self, workdir: str):
        from tensorboardX import SummaryWriter
        self.f = open(os.path.join(workdir, "stats.jsonl"), "a")
        self.tb = SummaryWriter(os.path.join(workdir, "tb"))

    def log(self, stats: dict) -> None:
        self.f.write(json.dumps(stats) + "\n")
        self.f.flush()
        step = int(round(stats["kimg"] * 1000))
        for k, v in stats.items():
            if isinstance(v, (int, float)) and k not in ("kimg",):
                self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def close(self) -> None:
        self.f.close()
        self.tb.close()
