"""A run's state checkpoints, `WORKDIR/checkpoints/<step>/`, and the writer of both
checkpoints and EMA snapshots (`TrainCheckpoints`).

A state checkpoint is the whole train state (Orbax item `default`) every
`checkpoint_kimg`, saved asynchronously, the last `keep` kept, with its integrity record
(`records.py`); EMA snapshots go through the same object in the format of
`snapshots.py`. On restore every array is checked against the record: a checkpoint that
differs or is not finite is set aside as `<step>.corrupt` and the previous one is tried;
`--config.resume_step` sets the newer ones aside as `<step>.discarded`. A run whose
checkpoints are gone while its records say it had some (an emptied `checkpoints/`) is
not restarted from step 0 either.

Readers: `TrainCheckpoints.restore_latest` (onto a sharding, for training) and
`restore_latest_state` (host NumPy, any topology).
"""
from __future__ import annotations

import errno
import functools
import os
import sys
import threading

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from edm2_jax import paths
from edm2_jax.run import integrity
from edm2_jax.run import network_dir
from edm2_jax.run import records
from edm2_jax.run import snapshots
from edm2_jax.run.layout import CHECKPOINTS, RECORDS, SNAPSHOTS, STATE_ITEM, step_dirs
from edm2_jax.run.records import (HEALTHY_RMS_FACTOR, is_healthy, read_checked,
                                  step_metadata, step_record)


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (disk full, permissions, ...); earlier ones are intact."""


class NonFiniteStateError(RuntimeError):
    """The train state to be saved holds NaN/inf; it is not saved."""


class NoCheckpointError(RuntimeError):
    """The run has checkpoints, but none restores: it is not restarted silently."""


class TrainCheckpoints:
    """The two Orbax managers of a run: state checkpoints and EMA snapshots, each saved
    with its integrity record (`integrity.digest_tree`: a checksum per array, finiteness,
    the parameters' RMS) and checked against it on restore.

    `reference_rms`: the parameters' RMS at the run's start (`is_healthy`), carried in
    every checkpoint's record; set by `restore_latest` or by the caller for a new run.
    `restored`: the record of the checkpoint `restore_latest` restored (None: none), with
    the entries its caller gave `save_state(extra=)`."""

    @records.quiet_missing_step_metadata()
    def __init__(self, workdir: str, keep: int = 3):
        self.workdir, self.keep = workdir, keep
        self.last_step: int | None = None  # the step of the latest save (for error messages)
        self.in_flight: dict = {"checkpoint": None, "snapshot": None}  # async saves
        self.reference_rms: dict | None = None
        self.restored: dict | None = None
        self.unrecorded: dict = {"checkpoint": None, "snapshot": None}  # (step, record)
        self.state_mngr = ocp.CheckpointManager(
            os.path.join(workdir, CHECKPOINTS), item_handlers=ocp.StandardCheckpointHandler(),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=True,
                cleanup_tmp_directories=True, async_options=ocp.AsyncOptions(
                    post_finalization_callback=functools.partial(self._own_record,
                                                                 "checkpoint"))))
        self.snap_mngr = snapshots.writer(workdir, functools.partial(self._own_record,
                                                                     "snapshot"))

    def _own_record(self, kind: str) -> None:
        """Write the run's own copy of the record of the `kind` save in flight (Orbax calls
        this on its saving thread once the arrays and its metadata are written, just
        before the rename that completes the step); then drop the copies of checkpoints
        Orbax no longer keeps."""
        pending, self.unrecorded[kind] = self.unrecorded[kind], None
        if pending is None or jax.process_index() != 0:
            return
        step, record = pending
        root = CHECKPOINTS if kind == "checkpoint" else SNAPSHOTS
        records.save_record(os.path.join(self.workdir, root, str(step)), record)
        if kind == "checkpoint":
            records.prune_records(self.workdir, CHECKPOINTS, below=step)

    def _wait(self, kind: str) -> None:
        """Wait for the asynchronous save of `kind` in flight; its failure is raised as
        CheckpointSaveError naming that save's step."""
        mngr = self.state_mngr if kind == "checkpoint" else self.snap_mngr
        try:
            mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - re-raised with the fix named
            raise self._save_error(e, self.in_flight[kind], kind) from None
        self.in_flight[kind] = None

    def poll(self) -> None:
        """Raise CheckpointSaveError, naming the step and the disk, as soon as an
        asynchronous save has failed (call between steps); never waits for one."""
        for kind, mngr in (("checkpoint", self.state_mngr), ("snapshot", self.snap_mngr)):
            thread = getattr(mngr, "_finalize_thread", None)  # Orbax's saving thread
            if self.in_flight[kind] is not None and thread is not None and thread.map(
                    lambda t: t is None or not t.is_alive()):
                self._wait(kind)

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

    def save_state(self, step: int, state: dict, extra: dict | None = None) -> None:
        """Save the train state as checkpoint `step` (asynchronously; nothing if it exists),
        after the snapshots saved so far are complete: a checkpoint must not land before
        the EMA snapshots of its steps, or a run killed in between would resume past them
        and never write them. `extra`: JSON entries kept in the step's record (both
        copies), given back by `restore_latest` in `restored`. Raises CheckpointSaveError
        naming the cause, the step whose save failed and the fix, and
        NonFiniteStateError (nothing saved) when the state holds NaN/inf."""
        self.last_step = step
        self._wait("snapshot")
        self._wait("checkpoint")
        if step in (self.state_mngr.all_steps() or []):
            return
        record = self._record(state, "train state", step, "params")
        record.update(extra or {}, reference_rms=self.reference_rms or record["rms"])
        self.unrecorded["checkpoint"] = (step, record)
        try:
            self.state_mngr.save(step, args=ocp.args.StandardSave(state),
                                 custom_metadata=step_metadata(record))
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
        args, arrays = snapshots.save_args(nimg, ema, sigma_rels, batch_size, buffers)
        self._wait("snapshot")
        if step in (self.snap_mngr.all_steps() or []):
            return
        record = self._record(arrays, "EMA snapshot", step, "ema")
        self.unrecorded["snapshot"] = (step, record)
        try:
            self.snap_mngr.save(step, args=args, custom_metadata=step_metadata(record))
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

    @records.quiet_missing_step_metadata()
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
                                f"({integrity.one_line(e)})")
                errors.append(step)
                continue
            for s, _ in mismatched:  # newer than a good one with the right shapes
                self._set_aside(s, "corrupt", f"checkpoint {s}'s metadata names other arrays "
                                f"or shapes than checkpoint {step}")
            self.reference_rms = record.get("reference_rms") or actual["rms"]
            self.restored = record
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
        if not steps and not aside:
            self._refuse_lost_checkpoints()
        if errors or aside:
            raise NoCheckpointError(
                f"the run in {self.workdir} has checkpoints but none restores (set aside: "
                f"{', '.join(os.path.join(CHECKPOINTS, n) for n in aside)}); nothing was "
                f"trained. To start this run over from step 0 deliberately, re-run with "
                f"--config.start_over=True (moves checkpoints/, snapshots/, records/, "
                f"samples/, stats.jsonl and tb/ into {self.workdir}/discarded-<time>/), or use "
                f"a new --workdir.")
        return None

    def _refuse_lost_checkpoints(self) -> None:
        """Raise NoCheckpointError when the run has no checkpoint but its snapshots and the
        records of its checkpoints say it had some (checkpoints/ emptied or deleted):
        restarting from step 0 would mix a new run's snapshots with the old ones."""
        snaps = step_dirs(os.path.join(self.workdir, SNAPSHOTS))
        had = paths.listdir(os.path.join(self.workdir, RECORDS, CHECKPOINTS))
        if not snaps or not had:
            return
        names = ", ".join(os.path.relpath(d, self.workdir) for d in snaps[:3])
        raise NoCheckpointError(
            f"the run in {self.workdir} has no checkpoint left in {CHECKPOINTS}/ but has EMA "
            f"snapshots ({names}{', ...' if len(snaps) > 3 else ''}) and records of "
            f"{len(had)} checkpoint(s) in {RECORDS}/{CHECKPOINTS}/: its checkpoints were "
            f"removed; nothing was trained. Put them back to resume, or start this run over "
            f"from step 0 deliberately with --config.start_over=True (moves "
            f"checkpoints/, snapshots/, records/, samples/, stats.jsonl and tb/ into "
            f"{self.workdir}/discarded-<time>/), or use a new --workdir.")

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

    @records.quiet_missing_step_metadata()
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

    @records.quiet_missing_step_metadata()
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
            hint = f"the disk {paths.disk_free(self.workdir)} is full: free disk space"
        else:
            hint = f"fix that (disk {paths.disk_free(self.workdir)})"
        return CheckpointSaveError(
            code or errno.EIO,
            f"saving the {kind} of step {step} in {self.workdir} failed: "
            f"{type(cause).__name__}: {integrity.one_line(cause, 200)}. The complete earlier "
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
    return dict(zip(network_dir.key_paths(tree),
                    (tuple(x.shape) for x in jax.tree_util.tree_leaves(tree))))


def restore_latest_state(workdir: str) -> dict:
    """The newest complete train state of the run as host numpy arrays, verified
    against its integrity record. Raises FileNotFoundError when there is none and
    IntegrityError when it is corrupt, not finite or without the record its run keeps."""
    dirs = step_dirs(os.path.join(workdir, CHECKPOINTS))
    if not dirs:
        raise FileNotFoundError(f"no complete checkpoint in {os.path.join(workdir, CHECKPOINTS)}")
    step = os.path.basename(dirs[0])
    fix = (f"Re-run the run's training command in {workdir} (it sets a corrupt checkpoint "
           f"aside and resumes from the previous one), or use one of its EMA snapshots: "
           f"--net={workdir}/{SNAPSHOTS}/<step> (not {step}).")
    try:
        record = step_record(dirs[0])
    except integrity.IntegrityError as e:
        raise integrity.IntegrityError(f"checkpoint {e}. {fix}") from None
    return read_checked(lambda: network_dir.restore_numpy(os.path.join(dirs[0], STATE_ITEM)),
                        record, f"checkpoint {dirs[0]}", fix)
