"""Chaos test of resumable training: kill a tiny run at random moments, flip bytes in its
checkpoints and snapshots, start a second trainer beside it, resume it each time, and
check that nothing is corrupt or lost, no corruption goes unnoticed, and that the result
is the same.

    python tests/chaos.py --workdir=/tmp/chaos --kills=12 --json=/tmp/chaos.json

1. Reference: the tiny run of tests/test_train.py (8x8 PNG folder, 8-channel U-Net,
   batch 8) for `--steps` steps, uninterrupted, through the CLI (`python -m
   edm2_jax.main`). A checkpoint every 2 steps (3 kept), an EMA snapshot every 8.
2. Chaos: the same command, killed `--kills` times with SIGKILL or SIGTERM (chosen at
   random) at a random moment: during start-up/restore/compilation (1 in 4) or during
   training, and restarted after each kill; then run to the end.
   With probability `--p_concurrent`, a second trainer is started on the same workdir
   during training first: it must exit 1 at once naming the running one (one writer per
   workdir) and leave it undisturbed. After a kill, with probability `--p_flip`, 16
   bytes are inverted in an array file of the newest checkpoint (the restart must set it
   aside as `<step>.corrupt` and resume from the one before) or of a random snapshot
   (its reader must refuse it; the bytes are then put back), at a place that changes a
   value read back unchecked (`flip_bytes`). With probability `--p_finite`, the flip is
   XOR 0x01 at a place where the values read back wrong but finite (only the checksums
   can tell); with probability `--p_delete_metadata`, the flipped step's record is
   deleted too: Orbax's `_CHECKPOINT_METADATA`, and half the time also the run's copy
   `records/<kind>/<step>.json` (`delete_records`): the corruption must still be caught.
   After every kill:
   - corrupt: a complete checkpoint (one of the newest `keep`) or EMA snapshot that does
     not restore, or whose arrays differ from their saved checksums or are not finite;
   - lost: the newest complete checkpoint is older than one seen before the kill, or a
     snapshot seen before is gone;
   - a SIGTERM during training must exit 0 with a checkpoint at the step it stopped;
   - the restart must resume from the newest complete checkpoint (after a flip: the one
     before the flipped one); silent: a flipped checkpoint restored without complaint, a
     flipped snapshot read without an IntegrityError.
3. The final checkpoint and every snapshot equal the reference's bitwise (CPU, same
   compiled programs from a persistent XLA cache).

Prints a JSON summary (also written to `--json`); exit status 1 if any check fails.
`tests/test_fault_tolerance.py::test_chaos_short` runs it with 4 kills.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

if __name__ == "__main__":  # first, before JAX starts: the XLA flags of edm2_jax.main
    from edm2_jax import process
    process.add_default_xla_flags()

from tests.test_train import FMNIST_CONFIG, TINY_OVERRIDES, make_image_folder  # noqa: E402

BATCH = TINY_OVERRIDES["batch_size"]
KEEP = 3


def run_overrides(data: Path, steps: int) -> dict:
    return {**TINY_OVERRIDES, "data.path": data, "total_kimg": steps * BATCH / 1000,
            "status_kimg": 2 * BATCH / 1000, "checkpoint_kimg": 2 * BATCH / 1000,
            "snapshot_kimg": 8 * BATCH / 1000, "keep_checkpoints": KEEP}


class Run:
    """One CLI training process; its output lines are collected by a thread."""

    def __init__(self, workdir: Path, overrides: dict, cache: str):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                   JAX_COMPILATION_CACHE_DIR=cache,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
        flags = [f"--config.{k}={v}" for k, v in overrides.items()]
        self.t0 = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edm2_jax.main", f"--config={FMNIST_CONFIG}:tiny",
             f"--workdir={workdir}", *flags],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        self.lines: list[str] = []
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self.events.put((time.time(), line))
        self.events.put((time.time(), None))

    def wait_for(self, text: str, timeout: float) -> float | None:
        """Time at which a line containing `text` appeared (None: exited/timeout)."""
        end = time.time() + timeout
        while time.time() < end:
            try:
                t, line = self.events.get(timeout=max(0.01, end - time.time()))
            except queue.Empty:
                return None
            if line is None:
                return None
            if text in line:
                return t
        return None

    def log(self) -> str:
        return "".join(self.lines)


def complete_steps(workdir: Path, sub: str) -> list[int]:
    d = workdir / sub
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def restore_state(workdir: Path, step: int):
    """Checkpoint `step` as NumPy, checked against its checksums and for NaN/inf
    (raises IntegrityError)."""
    from edm2_jax.run import integrity, layout, network_dir, records
    d = workdir / "checkpoints" / str(step)
    state = network_dir.restore_numpy(str(d / layout.STATE_ITEM))
    integrity.check(records.step_record(str(d)), integrity.digest_tree_numpy(state),
                    f"checkpoint {step}")
    return state


def flip_bytes(item: Path, rnd: random.Random, tries: int = 20, finite: bool = False) -> int:
    """Invert 16 bytes at a random place in the middle 90% of the largest array data file
    of the Orbax item `item`, at a place some value depends on: a flip that still reads
    back (unchecked) the same values, e.g. in an unreferenced tail of the append-only
    OCDBT file, is undone and another place is tried. `finite`: XOR 0x01 instead, at a
    place where every value still reads back finite (the data is compressed: most such
    flips decode to wrong finite values). Returns the tries it took."""
    from edm2_jax.run import network_dir
    files = [p for p in item.rglob("*") if p.is_file() and p.parent.name == "d"
             and "ocdbt.process" in str(p)]
    path = max(files, key=lambda p: p.stat().st_size)
    before = network_dir.restore_numpy(str(item))
    original = path.read_bytes()
    for attempt in range(1, tries + 1):
        b = bytearray(original)
        at = rnd.randrange(len(b) // 20, max(len(b) // 20 + 1, len(b) * 19 // 20 - 16))
        for i in range(at, min(at + 16, len(b))):
            b[i] ^= 0x01 if finite else 0xFF
        path.write_bytes(bytes(b))
        try:
            after = network_dir.restore_numpy(str(item))
            if not equal(after, before) and (not finite or all_finite(after)):
                return attempt
        except Exception:  # noqa: BLE001 - unreadable is a real corruption too
            if not finite:
                return attempt
        path.write_bytes(original)
    raise RuntimeError(f"no flip in {path} changed a value in {tries} tries")


def all_finite(tree) -> bool:
    import jax
    import numpy as np
    return all(np.isfinite(x).all() for x in jax.tree.leaves(tree)
               if np.issubdtype(np.asarray(x).dtype, np.inexact))


def delete_records(workdir: Path, kind: str, step: int, rnd: random.Random) -> dict:
    """Delete Orbax's `_CHECKPOINT_METADATA` of step `step` of `kind` ('checkpoints' or
    'snapshots') and, half the time, the run's own copy of its integrity record; returns
    `{path: bytes}` of what was deleted."""
    from edm2_jax.run import layout
    files = [workdir / kind / str(step) / layout.STEP_METADATA]
    if rnd.random() < 0.5:
        files.append(Path(layout.record_path(str(workdir), kind, step)))
    gone = {p: p.read_bytes() for p in files if p.exists()}
    for p in gone:
        p.unlink()
    return gone


def restore_snapshot(workdir: Path, step: int):
    from edm2_jax.run import snapshots
    return snapshots.restore_snapshot(str(workdir), step)[0]


def equal(a, b) -> bool:
    import jax
    import numpy as np
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def check_restorable(workdir: Path, skip: int | None = None
                     ) -> tuple[list[str], list[int], list[int]]:
    """(problems, complete checkpoint steps, complete snapshot steps) of a stopped run;
    checkpoint `skip` (flipped on purpose, not yet set aside) is not checked."""
    problems = []
    ckpts, snaps = complete_steps(workdir, "checkpoints"), complete_steps(workdir, "snapshots")
    # An older checkpoint than the newest KEEP may be one whose deletion was cut short.
    for step in [s for s in ckpts[-KEEP:] if s != skip]:
        try:
            restore_state(workdir, step)
        except Exception as e:  # noqa: BLE001 - any failure is a corrupt checkpoint
            problems.append(f"checkpoint {step} does not restore: {str(e)[:200]}")
    for step in snaps:
        try:
            restore_snapshot(workdir, step)
        except Exception as e:  # noqa: BLE001
            problems.append(f"snapshot {step} does not restore: {str(e)[:200]}")
    return problems, ckpts, snaps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, help="scratch directory (emptied first)")
    ap.add_argument("--kills", type=int, default=12, help="number of random kills")
    ap.add_argument("--steps", type=int, default=160, help="training steps of the run")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    ap.add_argument("--cache", default="", help="XLA compilation cache dir (default: in workdir)")
    ap.add_argument("--p_flip", type=float, default=0.5,
                    help="probability of a byte flip after each kill")
    ap.add_argument("--p_finite", type=float, default=0.5,
                    help="probability that a flip leaves every value finite (XOR 0x01)")
    ap.add_argument("--p_delete_metadata", type=float, default=0.5,
                    help="probability that a flipped step's record files are deleted too")
    ap.add_argument("--p_concurrent", type=float, default=0.25,
                    help="probability of a second trainer started during training")
    ap.add_argument("--json", default="", help="also write the summary here")
    args = ap.parse_args()
    from absl import logging
    logging.set_verbosity(logging.ERROR)  # Orbax's notes on read-only managers

    root = Path(args.workdir).resolve()
    if root.exists():
        for p in root.iterdir():
            if p.name != "xla_cache" and str(p) != args.json:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    root.mkdir(parents=True, exist_ok=True)
    cache = args.cache or str(root / "xla_cache")
    data = make_image_folder(root / "data")
    overrides = run_overrides(data, args.steps)
    rnd = random.Random(args.seed)

    # 1. Reference (also fills the compilation cache).
    t = time.time()
    ref = Run(root / "reference", overrides, cache)
    t_first = ref.wait_for("First step done", 900)
    rc = ref.proc.wait(timeout=900)
    t_end = time.time()
    if rc != 0 or t_first is None:
        sys.exit(f"reference run failed (rc {rc}):\n{ref.log()[-3000:]}")
    startup_s = t_first - ref.t0
    sec_per_step = (t_end - t_first) / max(args.steps - 1, 1)
    print(f"reference: {t_end - t:.1f} s, start-up {startup_s:.1f} s, "
          f"{sec_per_step * 1000:.0f} ms/step (with saves)", flush=True)

    # 2. Chaos.
    # An attempt also runs a step or two around the kill itself, hence the 3 per kill.
    chunk = max(1, args.steps // (3 * args.kills))
    work = root / "chaos"
    events, problems = [], []
    best_ckpt, seen_snaps = 0, set()
    kills = restarts = 0
    flips = {"checkpoint": 0, "snapshot": 0}
    concurrent = silent = 0
    flip_tries: list[int] = []  # per flip: places tried until one changed a value
    finite_flips = deleted_records = 0
    flipped_ckpt = None  # the checkpoint step flipped before this restart
    while True:
        expect = complete_steps(work, "checkpoints")
        if flipped_ckpt is not None:
            expect = [s for s in expect if s < flipped_ckpt]
        run = Run(work, overrides, cache)
        restarts += 1
        if kills >= args.kills:  # the final, uninterrupted run
            rc = run.proc.wait(timeout=900)
            run.wait_for("\0", 5)
            if rc != 0:
                problems.append(f"final run failed (rc {rc}): {run.log()[-2000:]}")
            resumed = re.search(r"(Resuming|Starting) in .* at step (\d+),", run.log())
            if flipped_ckpt is not None and (not resumed or int(resumed.group(2)) == flipped_ckpt):
                silent += 1
                problems.append(f"final run: flipped checkpoint {flipped_ckpt} was not set "
                                f"aside (silent corruption)")
            break
        sig = rnd.choice([signal.SIGKILL, signal.SIGTERM])
        in_startup = rnd.random() < 0.25
        if in_startup:
            time.sleep(rnd.uniform(0, startup_s))
            when = "start-up"
        else:
            if run.wait_for("First step done", 900) is None:
                if "already finished" in run.log():
                    break
                problems.append(f"restart {restarts} exited before its first step: "
                                f"{run.log()[-2000:]}")
                break
            # About `chunk` steps per attempt, so that the kills spread over the run.
            m = re.search(r"at step (\d+),", run.log())
            remaining = args.steps - (int(m.group(1)) if m else 0)
            # A second trainer on the same workdir, while the first has a start-up's
            # worth of steps to go (the second takes its lock before loading any data).
            if rnd.random() < args.p_concurrent and remaining * sec_per_step > startup_s:
                second = Run(work, overrides, cache)
                try:
                    rc2 = second.proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    second.proc.kill()
                    rc2 = second.proc.wait()
                second.wait_for("\0", 5)
                if run.proc.poll() is None or rc2 == 1:  # they did overlap
                    concurrent += 1
                    if rc2 != 1 or "in use by another training process" not in second.log():
                        problems.append(f"concurrent start {concurrent}: the second trainer "
                                        f"exited {rc2}: {second.log()[-1500:]}")
            time.sleep(rnd.uniform(0, min(2 * chunk, 0.8 * remaining) * sec_per_step))
            when = "training"
        if run.proc.poll() is not None:  # finished before the kill: the run is done
            events.append({"restart": restarts, "kill": None, "note": "finished first"})
            break
        run.proc.send_signal(sig)
        kills += 1
        try:
            rc = run.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            run.proc.kill()
            rc = run.proc.wait()
            problems.append(f"kill {kills}: SIGTERM did not stop the run within 300 s")
        run.wait_for("\0", 5)  # drain the output
        log = run.log()
        resumed = re.search(r"(Resuming|Starting) in .* at step (\d+),", log)
        if resumed and int(resumed.group(2)) != (expect[-1] if expect else 0):
            problems.append(f"restart {restarts} resumed at step {resumed.group(2)}, newest "
                            f"complete checkpoint was {expect[-1] if expect else None}")
        if flipped_ckpt is not None and resumed:  # the restart has read the flipped one
            if int(resumed.group(2)) == flipped_ckpt:
                silent += 1
                problems.append(f"restart {restarts}: flipped checkpoint {flipped_ckpt} was "
                                f"restored (silent corruption)")
            flipped_ckpt = None
        elif flipped_ckpt is not None and list((work / "checkpoints").glob(
                f"{flipped_ckpt}.corrupt*")):
            flipped_ckpt = None  # set aside by a restart killed before it resumed
        stopped = re.search(r"Stopped by signal 15 .* at step (\d+), .*; checkpoint", log)
        bad, ckpts, snaps = check_restorable(work, skip=flipped_ckpt)
        problems += [f"kill {kills}: {b}" for b in bad]
        if ckpts and ckpts[-1] < best_ckpt or not ckpts and best_ckpt:
            problems.append(f"kill {kills}: newest checkpoint {ckpts[-1:]} < {best_ckpt} (lost)")
        if seen_snaps - set(snaps):
            problems.append(f"kill {kills}: snapshots {sorted(seen_snaps - set(snaps))} lost")
        # A flipped checkpoint not yet read (the restart was killed first) is not progress.
        best_ckpt = max([best_ckpt, *(c for c in ckpts if c != flipped_ckpt)])
        seen_snaps = seen_snaps | set(snaps)
        if sig == signal.SIGTERM and "First step done" in log:
            if rc != 0:
                problems.append(f"kill {kills}: SIGTERM during training exited {rc}")
            elif stopped and int(stopped.group(1)) not in ckpts:
                problems.append(f"kill {kills}: stopped at step {stopped.group(1)} but no "
                                f"checkpoint there")
        flip = None
        if rnd.random() < args.p_flip:
            # A checkpoint only when there is one before it (a run whose only checkpoint
            # is corrupt stops with NoCheckpointError, by design) and none is pending.
            flip = "checkpoint" if len(ckpts) >= 2 and (not snaps or rnd.random() < 0.6) \
                else "snapshot"
            if flip == "snapshot" and not snaps:
                flip = None
            if flip == "checkpoint" and flipped_ckpt is not None:
                flip = "snapshot" if snaps else None  # one flipped checkpoint at a time
        finite = delete = False
        if flip:
            flips[flip] += 1
            finite = rnd.random() < args.p_finite
            delete = rnd.random() < args.p_delete_metadata
            finite_flips += finite
            deleted_records += delete
            if flip == "checkpoint":  # the restart must set it aside and go one back
                flipped_ckpt = ckpts[-1]
                flip_tries.append(flip_bytes(work / "checkpoints" / str(ckpts[-1]) / "default",
                                             rnd, finite=finite))
                if delete:
                    delete_records(work, "checkpoints", ckpts[-1], rnd)
                best_ckpt = max([0, *(c for c in ckpts if c < ckpts[-1])])
            else:  # its readers must refuse it; then the bytes are put back
                step = rnd.choice(snaps)
                item = work / "snapshots" / str(step) / "ema"
                saved = {p: p.read_bytes() for p in item.rglob("*") if p.is_file()}
                flip_tries.append(flip_bytes(item, rnd, finite=finite))
                if delete:
                    saved.update(delete_records(work, "snapshots", step, rnd))
                try:
                    restore_snapshot(work, step)
                    silent += 1
                    problems.append(f"kill {kills}: flipped snapshot {step} read without "
                                    f"an error (silent corruption)")
                except Exception as e:  # noqa: BLE001 - only IntegrityError is right
                    if type(e).__name__ != "IntegrityError":
                        problems.append(f"kill {kills}: flipped snapshot {step}: "
                                        f"{type(e).__name__}: {str(e)[:200]}")
                for p, b in saved.items():
                    p.write_bytes(b)
        events.append({"kill": kills, "signal": signal.Signals(sig).name, "phase": when,
                       "flip": flip, "finite": finite, "records_deleted": delete,
                       "rc": rc, "resumed_at": int(resumed.group(2)) if resumed else None,
                       "stopped_at": int(stopped.group(1)) if stopped else None,
                       "checkpoints": ckpts, "snapshots": snaps,
                       "tmp_dirs": sorted(p.name for p in (work / "checkpoints").glob("*tmp*"))
                       if (work / "checkpoints").exists() else []})
        print(json.dumps(events[-1]), flush=True)

    # 3. The result.
    ref_ckpt, ref_snaps = complete_steps(root / "reference", "checkpoints"), \
        complete_steps(root / "reference", "snapshots")
    ckpts, snaps = complete_steps(work, "checkpoints"), complete_steps(work, "snapshots")
    same = bool(ckpts) and ckpts[-1] == ref_ckpt[-1] == args.steps and equal(
        restore_state(work, ckpts[-1]), restore_state(root / "reference", ref_ckpt[-1]))
    lost_snaps = sorted(set(ref_snaps) - set(snaps))
    snaps_same = all(equal(restore_snapshot(work, s), restore_snapshot(root / "reference", s))
                     for s in ref_snaps if s in snaps)
    if lost_snaps:
        problems.append(f"snapshots {lost_snaps} of the reference are missing")
    if not same:
        problems.append("final state differs from the uninterrupted run")
    if not snaps_same:
        problems.append("a snapshot differs from the uninterrupted run's")
    if kills < args.kills:
        problems.append(f"only {kills} of {args.kills} kills happened")
    summary = {
        "faults": kills + sum(flips.values()) + concurrent,
        "kills": kills, "sigkill": sum(e.get("signal") == "SIGKILL" for e in events),
        "byte_flips_checkpoint": flips["checkpoint"], "byte_flips_snapshot": flips["snapshot"],
        "flip_tries": flip_tries, "finite_flips": finite_flips,
        "records_deleted": deleted_records,
        "concurrent_starts": concurrent, "silent_corruptions": silent,
        "sigterm": sum(e.get("signal") == "SIGTERM" for e in events),
        "during_startup": sum(e.get("phase") == "start-up" for e in events),
        "restarts": restarts, "steps": args.steps,
        "corrupt": sum("does not restore" in p for p in problems),
        "lost": sum("lost" in p or "missing" in p for p in problems),
        "bitwise_equal": bool(same and snaps_same), "problems": problems,
        "seconds": round(time.time() - t, 1)}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(summary, events=events), indent=1))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
