"""A training run's directory: its layout, and everything that writes or reads it.

    WORKDIR/config.json          the run's config as JSON (`write_config`, `read_config`)
    WORKDIR/checkpoints/<step>/  full train state (Orbax item `default`) every
                                 `checkpoint_kimg`, written asynchronously, last N kept
    WORKDIR/snapshots/<step>/    every tracked EMA every `snapshot_kimg` (all kept): items
                                 `ema` ({'power': {'0.050': params, ...}}), `meta` (JSON
                                 {nimg, batch_size, sigma_rels, ema_keys, traditional}) and,
                                 when given, `buffers` (MPFourier): the input of post-hoc
                                 EMA reconstruction (`phema/`)
    WORKDIR/stats.jsonl          one JSON line per status / evaluation (`StatsLogger`)
    WORKDIR/tb/                  the same as TensorBoard scalars
    WORKDIR/samples/<tag>.png    sample grids (`samples_path`)

Writers: `TrainCheckpoints` (the Orbax managers of checkpoints/ and snapshots/),
`write_config`, `StatsLogger`. Readers: `is_run`, `read_config`, `network_config`,
`step_dirs` (finalised steps, newest first), `restore_latest_state`, `run_buffers`,
`list_snapshots`, `restore_snapshot`; Orbax items come back as host NumPy arrays
(`checkpoint.restore_numpy`, re-exported here).

Orbax writes into a temporary directory and renames it when complete, so a run killed
mid-save never sees a half-written checkpoint; `restore_latest` and `step_dirs` only list
finalised ones.
"""
from __future__ import annotations

import errno
import json
import os
import warnings

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from edm2_jax import checkpoint as ckpt_lib
from edm2_jax.checkpoint import restore_numpy  # noqa: F401 (part of this module's API)

CONFIG_JSON = "config.json"
CHECKPOINTS = "checkpoints"
SNAPSHOTS = "snapshots"
STATE_ITEM = "default"  # the item of a state checkpoint (Orbax's name for a single item)


# --------------------------------------------------------------------------------------
# Layout


def config_path(workdir: str) -> str:
    return os.path.join(workdir, CONFIG_JSON)


def state_item(workdir: str, step: int) -> str:
    """The Orbax item of state checkpoint `step`."""
    return os.path.join(workdir, CHECKPOINTS, str(step), STATE_ITEM)


def snapshot_item(workdir: str, step: int, item: str = "ema") -> str:
    """An Orbax item (`ema`, `buffers`) of EMA snapshot `step`."""
    return os.path.join(workdir, SNAPSHOTS, str(step), item)


def samples_path(workdir: str, tag: str) -> str:
    return os.path.join(workdir, "samples", f"{tag}.png")


def is_run(path: str) -> bool:
    """Whether `path` is a training run directory (config.json and checkpoints/)."""
    return os.path.isfile(config_path(path)) and os.path.isdir(os.path.join(path, CHECKPOINTS))


def step_dirs(root: str) -> list[str]:
    """The finalised step directories `root/<step>` (e.g. of `WORKDIR/checkpoints`),
    newest first; [] when `root` does not exist. Orbax's temporary and set-aside
    (`<step>.corrupt`) directories are not steps."""
    steps = [int(n) for n in os.listdir(root) if n.isdigit()] if os.path.isdir(root) else []
    return [os.path.join(root, str(s)) for s in sorted(steps, reverse=True)]


# --------------------------------------------------------------------------------------
# config.json


def write_config(workdir: str, config: dict) -> None:
    """Write the run's config (a JSON-able dict), atomically."""
    path = config_path(workdir)
    with open(path + ".tmp", "w") as f:
        json.dump(config, f, indent=2)
    os.replace(path + ".tmp", path)


def read_config(workdir: str) -> dict | None:
    """The run's config.json as a dict, or None when there is none."""
    path = config_path(os.path.abspath(os.path.expanduser(workdir)))
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def network_config(workdir: str) -> dict:
    """The `network` section of the run's config.json (the `Precond` kwargs). Raises
    FileNotFoundError when the run has no config.json."""
    config = read_config(workdir)
    if config is None:
        raise FileNotFoundError(f"{config_path(workdir)} is missing; a training run's network "
                                f"is described by its config.json (written by "
                                f"train.train_and_evaluate)")
    return config["network"]


# --------------------------------------------------------------------------------------
# Reading checkpoints and snapshots (host numpy, any topology)


def restore_latest_state(workdir: str) -> dict:
    """The newest complete train state of the run as host numpy arrays. Raises
    FileNotFoundError when there is none."""
    dirs = step_dirs(os.path.join(workdir, CHECKPOINTS))
    if not dirs:
        raise FileNotFoundError(f"no complete checkpoint in {os.path.join(workdir, CHECKPOINTS)}")
    return restore_numpy(os.path.join(dirs[0], STATE_ITEM))


def run_buffers(workdir: str) -> dict:
    """The run's MPFourier buffers (fixed at init, the same in every checkpoint) as host
    numpy arrays: from the newest snapshot that carries them, else from the newest state
    checkpoint (only its `buffers` are read). Raises FileNotFoundError when neither has
    them."""
    for d in step_dirs(os.path.join(workdir, SNAPSHOTS)):
        if os.path.isdir(os.path.join(d, "buffers")):
            return restore_numpy(os.path.join(d, "buffers"))
    for d in step_dirs(os.path.join(workdir, CHECKPOINTS)):
        item = os.path.join(d, STATE_ITEM)
        if os.path.isdir(item) and "buffers" in ckpt_lib.tree_metadata(item):
            return ckpt_lib.restore_partial(item, [("buffers",)])[0]
    raise FileNotFoundError(
        f"no MPFourier buffers for the run in {workdir}: its snapshots carry none and "
        f"{workdir}/checkpoints holds no train state. Keep at least one state checkpoint "
        f"(or save snapshots with buffers=state['buffers']).")


def _snapshot_manager(workdir: str) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(os.path.join(workdir, SNAPSHOTS),
                                 options=ocp.CheckpointManagerOptions(create=False))


def list_snapshots(workdir: str) -> list[tuple[int, dict]]:
    """`[(step, meta), ...]` of the complete EMA snapshots of a run, oldest first."""
    mngr = _snapshot_manager(workdir)
    out = []
    for step in sorted(mngr.all_steps() or []):
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        out.append((step, dict(meta)))
    mngr.close()
    return out


def restore_snapshot(workdir: str, step: int) -> tuple[dict, dict]:
    """`(ema_tree, meta)` of snapshot `step` as numpy arrays (on any devices)."""
    mngr = _snapshot_manager(workdir)
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    mngr.close()
    return restore_numpy(snapshot_item(workdir, step, "ema")), dict(meta)


# --------------------------------------------------------------------------------------
# Writing checkpoints and snapshots


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (disk full, permissions, ...); earlier ones are intact."""


class TrainCheckpoints:
    """The two Orbax managers of a run: state checkpoints and EMA snapshots."""

    def __init__(self, workdir: str, keep: int = 3):
        self.workdir = workdir
        self.last_step: int | None = None  # the step of the latest save (for error messages)
        self.state_mngr = ocp.CheckpointManager(
            os.path.join(workdir, CHECKPOINTS), item_handlers=ocp.StandardCheckpointHandler(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=True,
                                                 cleanup_tmp_directories=True))
        self.snap_mngr = ocp.CheckpointManager(
            os.path.join(workdir, SNAPSHOTS),
            options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                                 enable_async_checkpointing=True,
                                                 cleanup_tmp_directories=True))

    def save_state(self, step: int, state: dict) -> None:
        """Save the train state as checkpoint `step` (asynchronously; nothing if it exists),
        after the snapshots saved so far are complete: a checkpoint must not land before
        the EMA snapshots of its steps, or a run killed in between would resume past them
        and never write them. Raises CheckpointSaveError naming the cause and the fix."""
        self.last_step = step
        try:
            self.snap_mngr.wait_until_finished()
            if step in (self.state_mngr.all_steps() or []):
                return
            self.state_mngr.save(step, args=ocp.args.StandardSave(state))
        except Exception as e:  # noqa: BLE001 - re-raised with the fix named
            raise self._save_error(e, step) from e

    def save_snapshot(self, step: int, nimg: int, ema: dict, sigma_rels, batch_size: int,
                      buffers: dict | None = None) -> None:
        """Save the EMAs (and, if given, the MPFourier `buffers`, which post-hoc EMA
        reconstruction writes into its network checkpoints) as snapshot `step`
        (asynchronously; nothing if it exists). Raises CheckpointSaveError."""
        self.last_step = step
        meta = {"nimg": int(nimg), "batch_size": int(batch_size),
                "sigma_rels": [float(s) for s in sigma_rels],
                "ema_keys": sorted(ema.get("power", {})),
                "traditional": "traditional" in ema}
        items = dict(ema=ocp.args.StandardSave(ema), meta=ocp.args.JsonSave(meta))
        if buffers:  # Orbax cannot save an empty tree
            items["buffers"] = ocp.args.StandardSave(buffers)
        try:
            if step in (self.snap_mngr.all_steps() or []):
                return
            self.snap_mngr.save(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - re-raised with the fix named
            raise self._save_error(e, step) from e

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
        path = os.path.join(self.workdir, CHECKPOINTS, str(step))
        if jax.process_index() == 0 and os.path.isdir(path):
            dst, n = f"{path}.corrupt", 1
            while os.path.exists(dst):
                dst, n = f"{path}.corrupt{n}", n + 1
            os.replace(path, dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
        self.state_mngr.reload()

    def _save_error(self, e: Exception, step: int | None) -> CheckpointSaveError:
        """The error to raise when saving the checkpoint or EMA snapshot of `step` failed
        with `e` (Orbax wraps the OSError of a full disk; it is found in the chain)."""
        cause, seen = e, set()
        while cause is not None and not isinstance(cause, OSError) and id(cause) not in seen:
            seen.add(id(cause))
            cause = cause.__cause__ or cause.__context__
        cause = cause if isinstance(cause, OSError) else e
        try:
            done = sorted(self.state_mngr.all_steps(read=True) or [])
        except Exception:  # noqa: BLE001 - only for the message
            done = "?"
        hint = "free disk space" if getattr(cause, "errno", None) == errno.ENOSPC else "fix that"
        return CheckpointSaveError(
            getattr(cause, "errno", None) or errno.EIO,
            f"saving step {step} in {self.workdir} failed: {type(cause).__name__}: {cause}. "
            f"The complete earlier checkpoints {done} are intact (unfinished saves are deleted "
            f"on the next start); {hint} and re-run the same command to resume from the "
            f"latest.")

    def close(self) -> None:
        """Wait for the saves in flight and close the managers. Raises
        CheckpointSaveError when an asynchronous save failed."""
        try:
            self.state_mngr.wait_until_finished()
            self.snap_mngr.wait_until_finished()
            self.state_mngr.close()
            self.snap_mngr.close()
        except Exception as e:  # noqa: BLE001 - re-raised with the fix named
            raise self._save_error(e, self.last_step) from e


def _shapes(tree) -> dict:
    """`{path: shape}` of the arrays of a pytree (or of Orbax tree metadata, whose
    named tuples appear as dicts), path = tuple of key names."""
    return dict(zip(ckpt_lib.key_paths(tree),
                    (tuple(x.shape) for x in jax.tree_util.tree_leaves(tree))))


# --------------------------------------------------------------------------------------
# Logs


class StatsLogger:
    """Appends status dicts to `stats.jsonl` and TensorBoard scalars in `tb/`
    (tensorboardX, no TensorFlow needed)."""

    def __init__(self, workdir: str):
        # tensorboardX is required, but costs ~1.6 s to import (protobuf): paid by the
        # training process that logs, not by everything that reads a run (generate, phema).
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
