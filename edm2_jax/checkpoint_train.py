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
            os.path.join(workdir, "checkpoints"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=True))
        self.snap_mngr = ocp.CheckpointManager(
            os.path.join(workdir, "snapshots"),
            options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                                 enable_async_checkpointing=True))

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
        """Latest complete state checkpoint restored onto `sharding`, or None if there is
        none. A checkpoint that fails to restore is skipped with a warning (the previous
        one is tried); a structure mismatch (different config) raises ValueError."""
        steps = sorted(self.state_mngr.all_steps() or [], reverse=True)
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract_state)
        errors = []
        for step in steps:
            try:
                return self.state_mngr.restore(step, args=ocp.args.StandardRestore(target))
            except Exception as e:  # noqa: BLE001 - orbax raises many types
                msg = str(e)
                if "shape" in msg.lower() or "structure" in msg.lower() or "tree" in msg.lower():
                    raise ValueError(
                        f"checkpoint {step} in {self.workdir}/checkpoints does not match the "
                        f"current model/optimiser config ({msg.splitlines()[0][:300]}). Use a new "
                        f"--workdir or the config the run was started with.") from e
                warnings.warn(f"checkpoint {step} failed to restore ({msg[:200]}); trying the "
                              f"previous one")
                errors.append(step)
        if errors:
            raise RuntimeError(f"no checkpoint in {self.workdir}/checkpoints could be restored "
                               f"(tried steps {errors})")
        return None

    def close(self) -> None:
        self.state_mngr.wait_until_finished()
        self.snap_mngr.wait_until_finished()
        self.state_mngr.close()
        self.snap_mngr.close()


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
    """`(ema_tree, meta)` of snapshot `step` as numpy arrays."""
    mngr = ocp.CheckpointManager(os.path.join(workdir, "snapshots"),
                                 options=ocp.CheckpointManagerOptions(create=False))
    r = mngr.restore(step, args=ocp.args.Composite(ema=ocp.args.StandardRestore(),
                                                   meta=ocp.args.JsonRestore()))
    mngr.close()
    return jax.tree.map(lambda x: jax.device_get(x), r["ema"]), dict(r["meta"])


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
