"""A run's EMA snapshots, `WORKDIR/snapshots/<step>/`: their format and their readers.

Each snapshot is an Orbax Composite checkpoint with the items

    ema      {'power': {'0.050': params, ...}[, 'traditional': params]}
    meta     JSON {nimg, batch_size, sigma_rels, ema_keys, traditional}
    buffers  the network's MPFourier buffers (when given; post-hoc EMA writes them into
             its network checkpoints)

and the integrity record of `records.py`, with a copy of the run's config.json beside it
in the step metadata (`records.with_kept_config`), so that what the network of a
snapshot is stays with it. `checkpoints.TrainCheckpoints.save_snapshot`
saves what `save_args` builds through the manager `writer` makes; the readers here
(`list_snapshots`, `restore_snapshot`, `snapshot_checker`, `run_buffers`) are the only
ones of that format. Every snapshot is kept: they are the input of post-hoc EMA
reconstruction (`edm2_jax.ema`).
"""
from __future__ import annotations

import os
from typing import Callable

import orbax.checkpoint as ocp

from edm2_jax import paths
from edm2_jax.run import integrity
from edm2_jax.run import network_dir
from edm2_jax.run import layout
from edm2_jax.run.layout import CHECKPOINTS, SNAPSHOTS, STATE_ITEM, snapshot_item, step_dirs
from edm2_jax.run.records import (quiet_missing_step_metadata, read_checked, step_record,
                                  with_kept_config)


# --------------------------------------------------------------------------------------
# Writing (through TrainCheckpoints)


class _Writer(ocp.CheckpointManager):
    """Orbax's manager, each snapshot saved with a copy of the run's config.json in its
    step metadata beside the integrity record (`records.with_kept_config`): what the
    network of the snapshot is, kept with it."""

    def __init__(self, workdir: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._workdir = workdir

    def save(self, step, *args, custom_metadata=None, **kwargs):
        try:
            config = layout.read_config(self._workdir)
        except (OSError, ValueError):  # unreadable: the checkpoints keep their own copy
            config = None
        if config is not None:
            custom_metadata = with_kept_config(custom_metadata, config)
        return super().save(step, *args, custom_metadata=custom_metadata, **kwargs)


def writer(workdir: str, on_saved: Callable[[], None] | None = None
           ) -> ocp.CheckpointManager:
    """The Orbax manager that saves the snapshots of `workdir` (asynchronously, all kept),
    each with a copy of the run's config (`_Writer`); `on_saved` is called on its saving
    thread once a snapshot is written, just before the rename that completes it."""
    return _Writer(
        workdir, os.path.join(workdir, SNAPSHOTS),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=None, create=True, enable_async_checkpointing=True,
            cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=on_saved)))


def save_args(nimg: int, ema: dict, sigma_rels, batch_size: int,
              buffers: dict | None = None) -> tuple[ocp.args.Composite, dict]:
    """`(args, arrays)` of a snapshot: the Orbax save args of its items and the tree of
    its arrays (`{'ema': ...[, 'buffers': ...]}`) that its integrity record covers."""
    meta = {"nimg": int(nimg), "batch_size": int(batch_size),
            "sigma_rels": [float(s) for s in sigma_rels],
            "ema_keys": sorted(ema.get("power", {})),
            "traditional": "traditional" in ema}
    items = dict(ema=ocp.args.StandardSave(ema), meta=ocp.args.JsonSave(meta))
    arrays = {"ema": ema}
    if buffers:  # Orbax cannot save an empty tree
        items["buffers"] = ocp.args.StandardSave(buffers)
        arrays["buffers"] = buffers
    return ocp.args.Composite(**items), arrays


# --------------------------------------------------------------------------------------
# Reading (host numpy, any topology)


@quiet_missing_step_metadata()
def _reader(workdir: str) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(os.path.join(workdir, SNAPSHOTS),
                                 options=ocp.CheckpointManagerOptions(create=False))


@quiet_missing_step_metadata()
def list_snapshots(workdir: str) -> list[tuple[int, dict]]:
    """`[(step, meta), ...]` of the complete EMA snapshots of a run, oldest first. Raises
    IntegrityError when a snapshot's meta is unreadable."""
    mngr = _reader(workdir)
    out = []
    try:
        for step in sorted(mngr.all_steps() or []):
            try:
                meta = mngr.restore(step, args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore()))["meta"]
            except Exception as e:  # noqa: BLE001 - orbax raises many types
                raise integrity.IntegrityError(
                    f"snapshot {step} in {workdir}/{SNAPSHOTS} is unreadable "
                    f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__}). "
                    f"{snapshot_fix(workdir, step)}") from None
            snapshot_record(workdir, step)  # a missing record fails here, before any work
            out.append((step, dict(meta)))
    finally:
        mngr.close()
    return out


def snapshot_fix(workdir: str, step: int) -> str:
    """What to do about a corrupt snapshot."""
    path = os.path.join(workdir, SNAPSHOTS, str(step))
    return (f"Move it aside (mv {path} {path}.corrupt) and re-run: post-hoc EMA then "
            f"uses the other snapshots, and a training run that has not passed step {step} "
            f"writes it again.")


def snapshot_record(workdir: str, step: int) -> dict:
    """The integrity record of snapshot `step` (`records.step_record`). Raises
    IntegrityError naming the snapshot and the fix when it is unreadable or missing."""
    try:
        return step_record(os.path.join(workdir, SNAPSHOTS, str(step)))
    except integrity.IntegrityError as e:
        raise integrity.IntegrityError(f"snapshot {e}. {snapshot_fix(workdir, step)}") from None


def snapshot_checker(workdir: str, step: int) -> integrity.LeafChecker:
    """Checks the EMA arrays of snapshot `step` one at a time as a streaming reader
    (post-hoc EMA) reads them: `checker('power/0.050/<param path>', array)`."""
    d = os.path.join(workdir, SNAPSHOTS, str(step))
    record = snapshot_record(workdir, step)
    record = {"digests": {k[4:]: v for k, v in record["digests"].items()
                          if k.startswith("ema/")}}
    return integrity.LeafChecker(record, f"snapshot {d}", snapshot_fix(workdir, step))


@quiet_missing_step_metadata()
def restore_snapshot(workdir: str, step: int) -> tuple[dict, dict]:
    """`(ema_tree, meta)` of snapshot `step` as numpy arrays (on any devices), verified
    against its integrity record. Raises IntegrityError when corrupt or not finite."""
    record = snapshot_record(workdir, step)
    mngr = _reader(workdir)
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    mngr.close()
    d = os.path.join(workdir, SNAPSHOTS, str(step))
    ema = read_checked(lambda: network_dir.restore_numpy(snapshot_item(workdir, step, "ema")),
                       record, f"snapshot {d}", snapshot_fix(workdir, step), prefix="ema/")
    return ema, dict(meta)


def run_buffers(workdir: str) -> dict:
    """The run's MPFourier buffers (fixed at init, the same in every checkpoint) as host
    numpy arrays: from the newest snapshot that carries them, else from the newest state
    checkpoint (only its `buffers` are read), checked against its integrity record.
    Raises FileNotFoundError when neither has them, IntegrityError when corrupt."""
    fix = "Move that directory aside (e.g. to <step>.corrupt) and retry."
    for d in step_dirs(os.path.join(workdir, SNAPSHOTS)):
        if paths.isdir(os.path.join(d, "buffers")):
            record = snapshot_record(workdir, int(os.path.basename(d)))
            return read_checked(lambda: network_dir.restore_numpy(os.path.join(d, "buffers")),
                                record, f"snapshot {d}", fix, prefix="buffers/")
    for d in step_dirs(os.path.join(workdir, CHECKPOINTS)):
        item = os.path.join(d, STATE_ITEM)
        if paths.isdir(item) and "buffers" in network_dir.tree_metadata(item):
            try:
                record = step_record(d)
            except integrity.IntegrityError as e:
                raise integrity.IntegrityError(f"checkpoint {e}. {fix}") from None
            return read_checked(lambda: network_dir.restore_partial(item, [("buffers",)])[0],
                                record, f"checkpoint {d}", fix, prefix="buffers/")
    raise FileNotFoundError(
        f"no MPFourier buffers for the run in {workdir}: its snapshots carry none and "
        f"{workdir}/checkpoints holds no train state. Keep at least one state checkpoint "
        f"(or save snapshots with buffers=state['buffers']).")
