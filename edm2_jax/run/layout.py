"""A training run's directory: where each file lives, and its config.json.

    WORKDIR/config.json          the run's config as JSON (`write_config`, `read_config`)
    WORKDIR/checkpoints/<step>/  full train state (Orbax item `default`) every
                                 `checkpoint_kimg`, written asynchronously, last N kept
                                 (`checkpoints.TrainCheckpoints`)
    WORKDIR/snapshots/<step>/    every tracked EMA every `snapshot_kimg` (all kept): items
                                 `ema` ({'power': {'0.050': params, ...}}), `meta` (JSON
                                 {nimg, batch_size, sigma_rels, ema_keys, traditional}) and,
                                 when given, `buffers` (MPFourier): the input of post-hoc
                                 EMA reconstruction (`snapshots.py`)
    WORKDIR/stats.jsonl          one JSON line per status / evaluation (`stats.StatsLogger`)
    WORKDIR/tb/                  the same as TensorBoard scalars
    WORKDIR/samples/<nimg>.png   sample grids, named by the images trained on, 12 digits
                                 (`samples_path_at`)
    WORKDIR/train.lock           the running trainer's host and pid (`lock.RunLock`)
    WORKDIR/eval.jsonl           results of `--mode=eval` of the run or of one of its
                                 snapshots, one JSON line each, and while it runs its
                                 resumable state `eval.jsonl.partial.p<process>.npz`
                                 (`eval_results_path`; `evaluation.commands`)
    <step>/_CHECKPOINT_METADATA  Orbax's per-step JSON; `custom_metadata.integrity` holds
                                 the step's integrity record (`records.py`)
    WORKDIR/records/<kind>/<step>.json   the run's own copy of that record, `kind`
                                 `checkpoints` or `snapshots` (`record_path`)
    <step>.corrupt, <step>.discarded   set aside (corrupt; after `--config.resume_step`)

Who writes and reads what, one module per file: this module the paths, config.json and
`discard_outputs`; `lock.py` train.lock; `records.py` the integrity records of the steps;
`checkpoints.py` the state checkpoints (`TrainCheckpoints`, which also saves the
snapshots in the format `snapshots.py` defines and reads); `stats.py` stats.jsonl and tb/.
Orbax items come back as host NumPy arrays (`network_dir.restore_numpy`); every reader
checks what it read against the step's integrity record (IntegrityError).

Orbax writes into a temporary directory and renames it when complete, so a run killed
mid-save never sees a half-written checkpoint; `step_dirs` lists only finalised ones. The
integrity record is part of that rename (Orbax's step metadata), so a checkpoint and its
checksums appear together; the run's own copy in `records/` is written just before that
rename. Every step has a record: a step without one is not trusted.

WORKDIR may be a `gs://` URL: every access goes through `paths.py` (etils epath) and
Orbax/TensorStore. There, `train.lock` is advisory (`lock.RunLock`), `stats.jsonl` is
rewritten whole at each line and `tb/` copied from a local directory
(`stats.StatsLogger`), and setting a checkpoint aside is a copy and a delete
(`paths.rename`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time

import jax
from jax.experimental import multihost_utils

from edm2_jax import paths

CONFIG_JSON = "config.json"
CHECKPOINTS = "checkpoints"
SNAPSHOTS = "snapshots"
SAMPLES = "samples"
STATS_JSONL = "stats.jsonl"
EVAL_JSONL = "eval.jsonl"
TB = "tb"
STATE_ITEM = "default"  # the item of a state checkpoint (Orbax's name for a single item)
LOCK = "train.lock"
COMMIT_SUCCESS = "commit_success.txt"  # Orbax's mark of a complete step on object storage
STEP_METADATA = "_CHECKPOINT_METADATA"  # Orbax's per-step JSON; ours under custom_metadata
RECORDS = "records"  # the run's own copies of the integrity records


# --------------------------------------------------------------------------------------
# Paths


def config_path(workdir: str) -> str:
    return os.path.join(workdir, CONFIG_JSON)


def snapshot_of(path: str) -> tuple[str, int] | None:
    """`(run_dir, step)` when `path` (normalised) names one EMA snapshot of a run,
    `RUN/snapshots/<step>`; else None. The one reader of a snapshot's path."""
    snap = re.fullmatch(rf"(.*)/{SNAPSHOTS}/(\d+)/?", path)
    return (snap.group(1), int(snap.group(2))) if snap else None


def eval_results_path(net_path: str) -> str:
    """Where `--mode=eval` of the network at `net_path` writes its results when no
    `--out_json` is given: beside what was evaluated, `eval.jsonl` in the run directory
    (for a run or one of its snapshots, `RUN/snapshots/<step>`) or in the network
    directory (`network_dir`)."""
    path = paths.normalize(net_path)
    snap = snapshot_of(path)
    return os.path.join(snap[0] if snap else path, EVAL_JSONL)


def snapshot_item(workdir: str, step: int, item: str = "ema") -> str:
    """An Orbax item (`ema`, `buffers`) of EMA snapshot `step`."""
    return os.path.join(workdir, SNAPSHOTS, str(step), item)


def samples_path(workdir: str, tag: str) -> str:
    return os.path.join(workdir, SAMPLES, f"{tag}.png")


def samples_path_at(workdir: str, nimg: int) -> str:
    """The sample grid after `nimg` training images: `samples/<nimg, 12 digits>.png`, one
    file per snapshot however small `snapshot_kimg` is, in training order when sorted."""
    return samples_path(workdir, f"{int(nimg):012d}")


def record_path(workdir: str, kind: str, step: int) -> str:
    """The run's own copy of the integrity record of step `step` of `kind`
    (`CHECKPOINTS` or `SNAPSHOTS`)."""
    return os.path.join(workdir, RECORDS, kind, f"{int(step)}.json")


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


def discard_outputs(workdir: str) -> str:
    """Move a run's checkpoints/, snapshots/, records/, samples/, stats.jsonl and tb/ into
    `WORKDIR/discarded-<time>/` (`--config.start_over`); returns that directory."""
    dst = os.path.join(workdir, "discarded-" + time.strftime("%Y%m%d-%H%M%S"))
    if jax.process_index() == 0:
        paths.makedirs(dst)
        for name in (CHECKPOINTS, SNAPSHOTS, RECORDS, SAMPLES, STATS_JSONL, TB):
            if paths.exists(os.path.join(workdir, name)):
                paths.rename(os.path.join(workdir, name), os.path.join(dst, name))
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("discard outputs")
    return dst


class StartOutputs:
    """What one training start makes in `workdir`, noted before it makes anything, so
    that a refused start (one that stops before its config.json is written) removes what
    it made and nothing that was there: `remove` (with the run's lock held, process 0)
    removes a workdir that did not exist, else the `train.lock` it made and the empty
    directories it made at the top of the workdir; `remove_empty_dirs` (lock not held:
    another trainer may hold it) only the directories it made that are still empty.
    Local workdirs only (on `gs://` directories are implied and the lock object is
    deleted at the end)."""

    def __init__(self, workdir: str):
        self.workdir = os.path.abspath(workdir) if not paths.is_url(workdir) else None
        self.made = []  # the directories that do not exist yet, outermost first
        self.before = None  # the names at the top of an existing workdir
        if self.workdir is None:
            return
        d = self.workdir
        while not os.path.lexists(d) and os.path.dirname(d) != d:
            self.made.insert(0, d)
            d = os.path.dirname(d)
        if not self.made and os.path.isdir(self.workdir):
            self.before = set(os.listdir(self.workdir))

    def remove_empty_dirs(self) -> None:
        for d in reversed(self.made):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                continue
            except OSError:  # not empty: left as it is, with the folders above it
                return

    def remove(self) -> None:
        if self.workdir is None or jax.process_index() != 0:
            return
        if self.made:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.remove_empty_dirs()
            return
        for name in sorted(set(os.listdir(self.workdir)) - (self.before or set())):
            path = os.path.join(self.workdir, name)
            if name == LOCK and os.path.isfile(path):
                os.remove(path)
            elif os.path.isdir(path) and not os.path.islink(path):
                for d, _, _ in sorted(os.walk(path), reverse=True):  # deepest first
                    try:
                        os.rmdir(d)
                    except OSError:  # holds a file: kept, with what leads to it
                        pass


# --------------------------------------------------------------------------------------
# config.json


def write_config(workdir: str, config: dict) -> None:
    """Write the run's config (a JSON-able dict), atomically (`paths.write_text_atomic`)."""
    paths.write_text_atomic(config_path(workdir), json.dumps(config, indent=2))


def read_config(workdir: str) -> dict | None:
    """The run's config.json as a dict, or None when there is none (`paths` normalises
    the path as it reads)."""
    path = config_path(workdir)
    if not paths.isfile(path):
        return None
    return json.loads(paths.read_text(path))
