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
    WORKDIR/train.lock           the running trainer's host and pid (`RunLock`)
                                 (advisory on gs://: `RunLock`)
    <step>/_CHECKPOINT_METADATA  Orbax's per-step JSON; `custom_metadata.integrity` holds
                                 the step's integrity record (`integrity.digest_tree`:
                                 a checksum per array, NaN/inf, parameter RMS)
    <step>.corrupt, <step>.discarded   set aside (corrupt; after `--config.resume_step`)

Writers: `TrainCheckpoints` (the Orbax managers of checkpoints/ and snapshots/),
`write_config`, `StatsLogger`. Readers: `is_run`, `read_config`, `network_config`,
`step_dirs` (finalised steps, newest first), `restore_latest_state`, `run_buffers`,
`list_snapshots`, `restore_snapshot`, `snapshot_checker`, `step_record`; Orbax items
come back as host NumPy arrays (`checkpoint.restore_numpy`, re-exported here). Every
reader checks what it read against the step's integrity record (IntegrityError).

Orbax writes into a temporary directory and renames it when complete, so a run killed
mid-save never sees a half-written checkpoint; `restore_latest` and `step_dirs` only list
finalised ones. The integrity record is part of that rename (Orbax's step metadata), so
a checkpoint and its checksums appear together.

WORKDIR may be a `gs://` URL: every access goes through `paths.py` (etils epath) and
Orbax/TensorStore. There, `train.lock` is advisory (`RunLock`), `stats.jsonl` is
rewritten whole at each line and `tb/` copied from a local directory (`StatsLogger`),
and setting a checkpoint aside is a copy and a delete (`paths.rename`).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import threading
import time

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from edm2_jax.run import network_dir as ckpt_lib
from edm2_jax import paths
from edm2_jax.run import integrity
from edm2_jax.run.network_dir import restore_numpy  # noqa: F401 (part of this module's API)

CONFIG_JSON = "config.json"
CHECKPOINTS = "checkpoints"
SNAPSHOTS = "snapshots"
STATE_ITEM = "default"  # the item of a state checkpoint (Orbax's name for a single item)
LOCK = "train.lock"
COMMIT_SUCCESS = "commit_success.txt"  # Orbax's mark of a complete step on object storage
STEP_METADATA = "_CHECKPOINT_METADATA"  # Orbax's per-step JSON; ours under custom_metadata
# A checkpoint is healthy when finite and its params' RMS is within this factor of the
# run's initial RMS (forced weight normalisation keeps it near 1; a diverging run's grows
# by orders of magnitude before the loss turns NaN).
HEALTHY_RMS_FACTOR = 10.0


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
    return paths.isfile(config_path(path)) and paths.isdir(os.path.join(path, CHECKPOINTS))


def step_dirs(root: str) -> list[str]:
    """The finalised step directories `root/<step>` (e.g. of `WORKDIR/checkpoints`),
    newest first; [] when `root` does not exist. Orbax's temporary and set-aside
    (`<step>.corrupt`) directories are not steps. On object storage (`gs://`) Orbax
    writes into `<step>/` itself and marks it complete with `commit_success.txt`
    (its `CommitFileTemporaryPath`): only steps with that object are listed."""
    steps = [int(n) for n in paths.listdir(root) if n.isdigit()]
    dirs = [os.path.join(root, str(s)) for s in sorted(steps, reverse=True)]
    if paths.is_url(root):
        dirs = [d for d in dirs if paths.isfile(os.path.join(d, COMMIT_SUCCESS))]
    return dirs


# --------------------------------------------------------------------------------------
# config.json


def write_config(workdir: str, config: dict) -> None:
    """Write the run's config (a JSON-able dict), atomically (`paths.write_text_atomic`)."""
    paths.write_text_atomic(config_path(workdir), json.dumps(config, indent=2))


def read_config(workdir: str) -> dict | None:
    """The run's config.json as a dict, or None when there is none."""
    path = config_path(paths.normalize(workdir))
    if not paths.isfile(path):
        return None
    return json.loads(paths.read_text(path))


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
# One writer


class RunLockedError(RuntimeError):
    """Another process trains in this run directory."""


class RunLock:
    """`with RunLock(workdir):` one training process per run directory, for the life of
    the block: an exclusive OS file lock (`flock`) on `WORKDIR/train.lock`, which records
    the holder's host, pid and start time. The OS releases it when the process ends in
    any way (kill -9 included), so a stale lock never blocks. Local and NFSv4 disks;
    taken by process 0, its outcome shared with the others. Raises RunLockedError naming
    the holder and what to do.

    On a URL workdir (`gs://`) there is no file lock: one writer is NOT enforced there.
    `train.lock` is then an advisory object (host, pid, start time) written at the start
    and deleted at the end; a lock object found at the start (another trainer, or one
    that was killed before deleting it) is named in a warning on stderr and replaced,
    and training goes on. (GCS could refuse a second writer with a create-if-absent
    precondition, but a killed trainer's object would then block every restart, and the
    local emulator the tests use ignores preconditions, so it could not be tested.)"""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.path = os.path.join(workdir, LOCK)
        self.fd: int | None = None
        self.url_lock = False

    def _holder_record(self) -> str:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "since": time.strftime("%Y-%m-%d %H:%M:%S")})

    def _enter_url(self) -> "RunLock":
        if jax.process_index() == 0:
            if paths.exists(self.path):
                try:
                    holder = json.loads(paths.read_text(self.path) or "{}")
                except ValueError:
                    holder = {}
                print(f"warning: {self.path} exists (host {holder.get('host', '?')}, pid "
                      f"{holder.get('pid', '?')}, since {holder.get('since', '?')}): another "
                      f"trainer may be writing to this run, or one was killed before it "
                      f"removed the lock. One writer is not enforced on {self.workdir} "
                      f"(object storage has no file locks); make sure no other trainer "
                      f"runs.", file=sys.stderr, flush=True)
            paths.Path(self.path).write_text(self._holder_record())
            self.url_lock = True
        return self

    def __enter__(self) -> "RunLock":
        if paths.is_url(self.workdir):
            return self._enter_url()
        holder = None
        if jax.process_index() == 0:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                try:
                    holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
                except ValueError:
                    holder = {}
                os.close(fd)
            else:
                os.ftruncate(fd, 0)
                os.pwrite(fd, self._holder_record().encode(), 0)
                self.fd = fd
        if jax.process_count() > 1:
            locked = multihost_utils.broadcast_one_to_all(holder is not None)
            holder = holder or ({} if locked else None)
        if holder is not None:
            raise RunLockedError(
                f"{self.workdir} is in use by another training process (host "
                f"{holder.get('host', '?')}, pid {holder.get('pid', '?')}, since "
                f"{holder.get('since', '?')}; lock file {self.path}). Wait for it to finish, "
                f"or stop it (SIGTERM saves a checkpoint) and re-run; for a different run use "
                f"another --workdir.")
        return self

    def __exit__(self, *exc) -> None:
        if self.url_lock:
            self.url_lock = False
            try:
                paths.Path(self.path).unlink()
            except FileNotFoundError:
                pass
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# --------------------------------------------------------------------------------------
# Integrity records (integrity.py) saved with each checkpoint and snapshot


def step_record(step_dir: str) -> dict | None:
    """The integrity record saved with checkpoint or snapshot `step_dir` (in Orbax's
    `_CHECKPOINT_METADATA`, written atomically with the arrays), or None for one saved
    before records existed. Raises IntegrityError when that file is unreadable."""
    path = os.path.join(step_dir, STEP_METADATA)
    if not paths.isfile(path):
        return None
    try:
        md = json.loads(paths.read_text(path))
        record = (md.get("custom_metadata") or {}).get("integrity")
        if record is not None and not isinstance(record.get("digests"), dict):
            raise ValueError("no digests")
    except (ValueError, AttributeError, UnicodeDecodeError) as e:
        raise integrity.IntegrityError(f"{path} is unreadable ({e})") from None
    return record


def is_healthy(record: dict | None, reference_rms: dict | None) -> bool:
    """Whether a checkpoint's record says its arrays are finite and its parameters'
    RMS within `HEALTHY_RMS_FACTOR` of the run's initial RMS (`reference_rms`)."""
    if record is None or record.get("nonfinite"):
        return False
    ref = (reference_rms or record.get("reference_rms") or {}).get("params")
    value = record.get("rms", {}).get("params")
    return not ref or value is None or value <= HEALTHY_RMS_FACTOR * ref


def _check_host(tree: dict, record: dict | None, what: str, fix: str, prefix: str = "") -> None:
    try:
        integrity.check(record, integrity.digest_tree_numpy(tree), what, prefix)
    except integrity.IntegrityError as e:
        raise integrity.IntegrityError(f"{e}. {fix}") from None


# --------------------------------------------------------------------------------------
# Reading checkpoints and snapshots (host numpy, any topology)


def restore_latest_state(workdir: str) -> dict:
    """The newest complete train state of the run as host numpy arrays, verified
    against its integrity record. Raises FileNotFoundError when there is none and
    IntegrityError when it is corrupt or not finite."""
    dirs = step_dirs(os.path.join(workdir, CHECKPOINTS))
    if not dirs:
        raise FileNotFoundError(f"no complete checkpoint in {os.path.join(workdir, CHECKPOINTS)}")
    state = restore_numpy(os.path.join(dirs[0], STATE_ITEM))
    step = os.path.basename(dirs[0])
    _check_host(state, step_record(dirs[0]), f"checkpoint {dirs[0]}",
                f"Re-run the run's training command in {workdir} (it sets a corrupt "
                f"checkpoint aside and resumes from the previous one), or use one of its "
                f"EMA snapshots: --net={workdir}/{SNAPSHOTS}/<step> (not {step}).")
    return state


def run_buffers(workdir: str) -> dict:
    """The run's MPFourier buffers (fixed at init, the same in every checkpoint) as host
    numpy arrays: from the newest snapshot that carries them, else from the newest state
    checkpoint (only its `buffers` are read), checked against its integrity record.
    Raises FileNotFoundError when neither has them, IntegrityError when corrupt."""
    fix = "Move that directory aside (e.g. to <step>.corrupt) and retry."
    for d in step_dirs(os.path.join(workdir, SNAPSHOTS)):
        if paths.isdir(os.path.join(d, "buffers")):
            buffers = restore_numpy(os.path.join(d, "buffers"))
            _check_host(buffers, step_record(d), f"snapshot {d}", fix, prefix="buffers/")
            return buffers
    for d in step_dirs(os.path.join(workdir, CHECKPOINTS)):
        item = os.path.join(d, STATE_ITEM)
        if paths.isdir(item) and "buffers" in ckpt_lib.tree_metadata(item):
            buffers = ckpt_lib.restore_partial(item, [("buffers",)])[0]
            _check_host(buffers, step_record(d), f"checkpoint {d}", fix, prefix="buffers/")
            return buffers
    raise FileNotFoundError(
        f"no MPFourier buffers for the run in {workdir}: its snapshots carry none and "
        f"{workdir}/checkpoints holds no train state. Keep at least one state checkpoint "
        f"(or save snapshots with buffers=state['buffers']).")


def discard_outputs(workdir: str) -> str:
    """Move a run's checkpoints/, snapshots/, samples/, stats.jsonl and tb/ into
    `WORKDIR/discarded-<time>/` (`--config.start_over`); returns that directory."""
    dst = os.path.join(workdir, "discarded-" + time.strftime("%Y%m%d-%H%M%S"))
    if jax.process_index() == 0:
        paths.makedirs(dst)
        for name in (CHECKPOINTS, SNAPSHOTS, "samples", "stats.jsonl", "tb"):
            if paths.exists(os.path.join(workdir, name)):
                paths.rename(os.path.join(workdir, name), os.path.join(dst, name))
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("discard outputs")
    return dst


def _snapshot_manager(workdir: str) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(os.path.join(workdir, SNAPSHOTS),
                                 options=ocp.CheckpointManagerOptions(create=False))


def list_snapshots(workdir: str) -> list[tuple[int, dict]]:
    """`[(step, meta), ...]` of the complete EMA snapshots of a run, oldest first."""
    mngr = _snapshot_manager(workdir)
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


def snapshot_checker(workdir: str, step: int) -> integrity.LeafChecker:
    """Checks the EMA arrays of snapshot `step` one at a time as a streaming reader
    (post-hoc EMA) reads them: `checker('power/0.050/<param path>', array)`."""
    d = os.path.join(workdir, SNAPSHOTS, str(step))
    record = step_record(d)
    if record is not None:
        record = {"digests": {k[4:]: v for k, v in record["digests"].items()
                              if k.startswith("ema/")}}
    return integrity.LeafChecker(record, f"snapshot {d}", snapshot_fix(workdir, step))


def restore_snapshot(workdir: str, step: int) -> tuple[dict, dict]:
    """`(ema_tree, meta)` of snapshot `step` as numpy arrays (on any devices), verified
    against its integrity record. Raises IntegrityError when corrupt or not finite."""
    mngr = _snapshot_manager(workdir)
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    mngr.close()
    d = os.path.join(workdir, SNAPSHOTS, str(step))
    ema = restore_numpy(snapshot_item(workdir, step, "ema"))
    _check_host(ema, step_record(d), f"snapshot {d}", snapshot_fix(workdir, step),
                prefix="ema/")
    return ema, dict(meta)


# --------------------------------------------------------------------------------------
# Writing checkpoints and snapshots


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (disk full, permissions, ...); earlier ones are intact."""


class NonFiniteStateError(RuntimeError):
    """The train state to be saved holds NaN/inf; it is not saved."""


class NoCheckpointError(RuntimeError):
    """The run has checkpoints, but none restores: it is not restarted silently."""


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:limit] + ("..." if len(text) > limit else "")


def _disk(path: str) -> str:
    """`mount point (X GiB free of Y GiB)` of the disk holding `path` (a URL: itself)."""
    if paths.is_url(path):
        return path
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    mount = p
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    try:
        u = shutil.disk_usage(p)
        return f"{mount} ({u.free / 2**30:.2f} GiB free of {u.total / 2**30:.2f} GiB)"
    except OSError:
        return mount


class TrainCheckpoints:
    """The two Orbax managers of a run: state checkpoints and EMA snapshots, each saved
    with its integrity record (`integrity.digest_tree`: a checksum per array, finiteness,
    the parameters' RMS) and checked against it on restore.

    `reference_rms`: the parameters' RMS at the run's start (`is_healthy`), carried in
    every checkpoint's record; set by `restore_latest` or by the caller for a new run."""

    def __init__(self, workdir: str, keep: int = 3):
        self.workdir, self.keep = workdir, keep
        self.last_step: int | None = None  # the step of the latest save (for error messages)
        self.in_flight: dict = {"checkpoint": None, "snapshot": None}  # async saves
        self.reference_rms: dict | None = None
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

    def _wait(self, kind: str) -> None:
        """Wait for the asynchronous save of `kind` in flight; its failure is raised as
        CheckpointSaveError naming that save's step."""
        mngr = self.state_mngr if kind == "checkpoint" else self.snap_mngr
        try:
            mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - re-raised with the fix named
            raise self._save_error(e, self.in_flight[kind], kind) from None
        self.in_flight[kind] = None

    def _record(self, tree: dict, what: str, step: int, rms_of: str) -> dict:
        """`tree`'s integrity record; raises NonFiniteStateError when it holds NaN/inf or
        the RMS of `tree[rms_of]` has grown beyond `HEALTHY_RMS_FACTOR` times the run's
        initial parameter RMS (a diverged run, whose loss may still be finite: forced
        weight normalisation rescales the weights the loss sees)."""
        record = integrity.digest_tree(tree, rms_of=(rms_of,))
        if record["nonfinite"]:
            raise NonFiniteStateError(
                f"the {what} at step {step} holds NaN/inf values (in "
                f"{', '.join(record['nonfinite'][:3])}); it was not saved.")
        ref = (self.reference_rms or {}).get("params")
        value = record["rms"].get(rms_of)
        if ref and value is not None and not value <= HEALTHY_RMS_FACTOR * ref:
            raise NonFiniteStateError(
                f"training has diverged: the RMS of the {what}'s {rms_of} at step {step} is "
                f"{value:.3g}, more than {HEALTHY_RMS_FACTOR:g}x the run's initial parameter "
                f"RMS {ref:.3g}; it was not saved.")
        return record

    def save_state(self, step: int, state: dict) -> None:
        """Save the train state as checkpoint `step` (asynchronously; nothing if it exists),
        after the snapshots saved so far are complete: a checkpoint must not land before
        the EMA snapshots of its steps, or a run killed in between would resume past them
        and never write them. Raises CheckpointSaveError naming the cause, the step whose
        save failed and the fix, and NonFiniteStateError (nothing saved) when the state
        holds NaN/inf."""
        self.last_step = step
        self._wait("snapshot")
        self._wait("checkpoint")
        if step in (self.state_mngr.all_steps() or []):
            return
        record = self._record(state, "train state", step, "params")
        record["reference_rms"] = self.reference_rms or record["rms"]
        try:
            self.state_mngr.save(step, args=ocp.args.StandardSave(state),
                                 custom_metadata={"integrity": record})
        except Exception as e:  # noqa: BLE001 - re-raised with the fix named
            raise self._save_error(e, step, "checkpoint") from None
        self.in_flight["checkpoint"] = step

    def save_snapshot(self, step: int, nimg: int, ema: dict, sigma_rels, batch_size: int,
                      buffers: dict | None = None) -> None:
        """Save the EMAs (and, if given, the MPFourier `buffers`, which post-hoc EMA
        reconstruction writes into its network checkpoints) as snapshot `step`
        (asynchronously; nothing if it exists). Raises CheckpointSaveError and
        NonFiniteStateError (nothing saved) when an EMA holds NaN/inf."""
        self.last_step = step
        meta = {"nimg": int(nimg), "batch_size": int(batch_size),
                "sigma_rels": [float(s) for s in sigma_rels],
                "ema_keys": sorted(ema.get("power", {})),
                "traditional": "traditional" in ema}
        items = dict(ema=ocp.args.StandardSave(ema), meta=ocp.args.JsonSave(meta))
        arrays = {"ema": ema}
        if buffers:  # Orbax cannot save an empty tree
            items["buffers"] = ocp.args.StandardSave(buffers)
            arrays["buffers"] = buffers
        self._wait("snapshot")
        if step in (self.snap_mngr.all_steps() or []):
            return
        record = self._record(arrays, "EMA snapshot", step, "ema")
        try:
            self.snap_mngr.save(step, args=ocp.args.Composite(**items),
                                custom_metadata={"integrity": record})
        except Exception as e:  # noqa: BLE001 - re-raised with the fix named
            raise self._save_error(e, step, "snapshot") from None
        self.in_flight["snapshot"] = step

    def newest_healthy(self) -> tuple[int, dict] | None:
        """`(step, record)` of the newest complete checkpoint whose record says it is
        finite and healthy (`is_healthy`), from the records alone (no arrays read)."""
        for d in step_dirs(os.path.join(self.workdir, CHECKPOINTS)):
            try:
                record = step_record(d)
            except integrity.IntegrityError:
                continue
            if is_healthy(record, self.reference_rms):
                return int(os.path.basename(d)), record
        return None

    def restore_latest(self, abstract_state, sharding, resume_step: int = 0) -> dict | None:
        """Latest complete state checkpoint (or checkpoint `resume_step` when > 0; the
        newer ones and the snapshots after it are then set aside as `<step>.discarded`)
        restored onto `sharding` (one sharding, or a pytree of them like
        `abstract_state`) and checked against its integrity record, or None if the run
        has no checkpoint. A checkpoint that fails to restore, or whose arrays differ
        from their checksums or hold NaN/inf, is renamed `<step>.corrupt` with one line
        on stderr (so that the resumed run can save that step again) and the previous
        one is tried. Raises ValueError when no checkpoint has the arrays and shapes of
        `abstract_state` (different config), NoCheckpointError when checkpoints exist
        (or were set aside as corrupt) but none restores."""
        steps = sorted(self.state_mngr.all_steps() or [], reverse=True)
        if resume_step:
            steps = self._go_back_to(resume_step, steps)
        if isinstance(sharding, jax.sharding.Sharding):
            sharding = jax.tree.map(lambda _: sharding, abstract_state)
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state,
            sharding)
        errors, mismatched = [], []
        want = _shapes(abstract_state)
        for step in steps:
            try:
                saved = _shapes(self.state_mngr.item_metadata(step))
                if saved != want:
                    mismatched.append((step, saved))
                    continue
                record = step_record(os.path.join(self.workdir, CHECKPOINTS, str(step)))
                state = self.state_mngr.restore(step, args=ocp.args.StandardRestore(target))
                actual = integrity.digest_tree(state)
                integrity.check(record, actual, f"checkpoint {step}")
            except Exception as e:  # noqa: BLE001 - orbax raises many types
                self._set_aside(step, "corrupt", f"checkpoint {step} is corrupt or unreadable "
                                f"({_one_line(e)})")
                errors.append(step)
                continue
            for s, _ in mismatched:  # newer than a good one with the right shapes
                self._set_aside(s, "corrupt", f"checkpoint {s}'s metadata names other arrays "
                                f"or shapes than checkpoint {step}")
            self.reference_rms = (record or {}).get("reference_rms") or actual["rms"]
            return state
        if mismatched:
            step, saved = mismatched[0]
            diff = sorted(set(saved.items()) ^ set(want.items()))[:4]
            raise ValueError(
                f"checkpoint {step} in {self.workdir}/checkpoints does not match the "
                f"current model/optimiser config (differing (path, shape): {diff}). Use a "
                f"new --workdir or the config the run was started with.")
        aside = [n for n in paths.listdir(os.path.join(self.workdir, CHECKPOINTS))
                 if ".corrupt" in n]
        if errors or aside:
            raise NoCheckpointError(
                f"the run in {self.workdir} has checkpoints but none restores (set aside: "
                f"{', '.join(os.path.join(CHECKPOINTS, n) for n in aside)}); nothing was "
                f"trained. To start this run over from step 0 deliberately, re-run with "
                f"--config.start_over=True (moves checkpoints/, snapshots/, samples/, "
                f"stats.jsonl and tb/ into {self.workdir}/discarded-<time>/), or use a new "
                f"--workdir.")
        return None

    def _go_back_to(self, resume_step: int, steps: list[int]) -> list[int]:
        """Set aside the checkpoints and snapshots after `resume_step` (`--config.
        resume_step`); returns `[resume_step]`. Raises ValueError if it is not a complete
        checkpoint."""
        if resume_step not in steps:
            raise ValueError(f"--config.resume_step={resume_step}: {self.workdir}/checkpoints "
                             f"has no complete checkpoint {resume_step}; complete ones: "
                             f"{sorted(steps)}. Pass one of them (0 = the newest).")
        newer = [s for s in steps if s > resume_step]
        snaps = [int(os.path.basename(d)) for d in step_dirs(os.path.join(self.workdir,
                                                                          SNAPSHOTS))]
        for s in newer:
            self._set_aside(s, "discarded")
        for s in [s for s in snaps if s > resume_step]:
            self._set_aside(s, "discarded", root=SNAPSHOTS)
        if newer:
            print(f"Resuming from checkpoint {resume_step} (--config.resume_step): checkpoints "
                  f"{newer} and the snapshots after it moved to <step>.discarded", flush=True)
        return [resume_step]

    def _set_aside(self, step: int, why: str, message: str | None = None,
                   root: str = CHECKPOINTS) -> None:
        """Rename `root/<step>` to `<step>.<why>` (process 0; all wait for it), printing
        `message` and where it went."""
        path = os.path.join(self.workdir, root, str(step))
        dst, n = f"{path}.{why}", 1
        while paths.exists(dst):
            dst, n = f"{path}.{why}{n}", n + 1
        if jax.process_index() == 0 and paths.isdir(path):
            paths.rename(path, dst)
        if message and jax.process_index() == 0:
            print(f"{message}; moved to {os.path.relpath(dst, self.workdir)}, trying the "
                  f"previous one", file=sys.stderr, flush=True)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"set aside {root} {step}")
        (self.state_mngr if root == CHECKPOINTS else self.snap_mngr).reload()

    def _save_error(self, e: Exception, step: int | None, kind: str) -> CheckpointSaveError:
        """The error to raise when saving the checkpoint or EMA snapshot of `step` failed
        with `e` (Orbax wraps the OSError of a full disk; it is found in the chain)."""
        cause, seen = e, set()
        while cause is not None and not isinstance(cause, OSError) and id(cause) not in seen:
            seen.add(id(cause))
            cause = cause.__cause__ or cause.__context__
        cause = cause if isinstance(cause, OSError) else e
        try:
            self.state_mngr.reload()
            done = sorted(self.state_mngr.all_steps() or [])
        except Exception:  # noqa: BLE001 - only for the message
            done = "?"
        code = getattr(cause, "errno", None)
        if code in (errno.ENOSPC, errno.EDQUOT):
            hint = f"the disk {_disk(self.workdir)} is full: free disk space"
        else:
            hint = f"fix that (disk {_disk(self.workdir)})"
        return CheckpointSaveError(
            code or errno.EIO,
            f"saving the {kind} of step {step} in {self.workdir} failed: "
            f"{type(cause).__name__}: {_one_line(cause, 200)}. The complete earlier "
            f"checkpoints {done} are intact (unfinished saves are deleted on the next "
            f"start); {hint} and re-run the same command to resume from the latest.")

    def close(self) -> None:
        """Wait for the saves in flight and close the managers. Raises
        CheckpointSaveError when an asynchronous save failed."""
        try:
            self._wait("checkpoint")
            self._wait("snapshot")
        finally:
            self.abandon()

    def abandon(self, timeout_s: float = 60.0) -> None:
        """Close the managers without raising, on a failure path: wait at most
        `timeout_s` for their threads, then leave them (daemon) to the process's exit;
        an unfinished save is deleted on the next start."""
        def close():
            for mngr in (self.state_mngr, self.snap_mngr):
                try:
                    mngr.close()
                except Exception:  # noqa: BLE001 - already failing; the first error is raised
                    pass
        t = threading.Thread(target=close, name="abandon-checkpoints", daemon=True)
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            print(f"checkpoint writers did not stop within {timeout_s:.0f} s; abandoning "
                  f"them (unfinished saves are deleted on the next start)", file=sys.stderr,
                  flush=True)


def _shapes(tree) -> dict:
    """`{path: shape}` of the arrays of a pytree (or of Orbax tree metadata, whose
    named tuples appear as dicts), path = tuple of key names."""
    return dict(zip(ckpt_lib.key_paths(tree),
                    (tuple(x.shape) for x in jax.tree_util.tree_leaves(tree))))


# --------------------------------------------------------------------------------------
# Logs


def read_stats(workdir: str) -> list[dict]:
    """The records of `WORKDIR/stats.jsonl` in order (`StatsLogger`'s lines); a last line
    cut short by a killed run is skipped. Raises FileNotFoundError naming the file."""
    path = os.path.join(workdir, "stats.jsonl")
    if not paths.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: {workdir} is not a training run "
                                f"(or has not logged a status line yet)")
    records = []
    with paths.open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


class StatsLogger:
    """Appends status dicts to `stats.jsonl` and TensorBoard scalars in `tb/`
    (tensorboardX, no TensorFlow needed).

    On a URL workdir (`gs://`, objects cannot be appended to): `stats.jsonl` is
    rewritten whole at every `log` (its earlier lines read once at the start), and the
    TensorBoard event files are written to a local temporary directory and copied to
    `WORKDIR/tb/` after every `log` (tensorboardX's own GCS writer is not used)."""

    def __init__(self, workdir: str):
        # tensorboardX is required, but costs ~1.6 s to import (protobuf): paid by the
        # training process that logs, not by everything that reads a run (generate, phema).
        from tensorboardX import SummaryWriter
        self.path = os.path.join(workdir, "stats.jsonl")
        self.tb_dir = os.path.join(workdir, "tb")
        self.url = paths.is_url(workdir)
        if self.url:
            import tempfile
            self.lines = paths.read_text(self.path) if paths.isfile(self.path) else ""
            if self.lines and not self.lines.endswith("\n"):  # a killed run's last line
                self.lines = self.lines[:self.lines.rfind("\n") + 1]
            self.local_tb = tempfile.mkdtemp(prefix="edm2_jax_tb_")
            self.f = None
            self.tb = SummaryWriter(self.local_tb)
        else:
            self.f = open(self.path, "a")
            self.tb = SummaryWriter(self.tb_dir)

    def log(self, stats: dict) -> None:
        if self.url:
            self.lines += json.dumps(stats) + "\n"
            paths.Path(self.path).write_text(self.lines)
        else:
            self.f.write(json.dumps(stats) + "\n")
            self.f.flush()
        step = int(round(stats["kimg"] * 1000))
        for k, v in stats.items():
            if isinstance(v, (int, float)) and k not in ("kimg",):
                self.tb.add_scalar(k, v, step)
        self.tb.flush()
        if self.url:
            self._upload_tb()

    def _upload_tb(self) -> None:
        for name in os.listdir(self.local_tb):
            paths.copy_file(os.path.join(self.local_tb, name), os.path.join(self.tb_dir, name))

    def close(self) -> None:
        self.tb.close()
        if self.url:
            self._upload_tb()
            shutil.rmtree(self.local_tb, ignore_errors=True)
        else:
            self.f.close()
