"""The integrity record saved with each checkpoint and EMA snapshot of a run.

A step's record is `integrity.digest_tree` of what was saved (a checksum per array, the
paths of NaN/inf arrays, the parameters' RMS; a state checkpoint's also carries the run's
initial RMS, `reference_rms`). It lives in Orbax's per-step `_CHECKPOINT_METADATA` under
`custom_metadata.integrity` (`step_metadata` writes it there, `step_record` reads it
back), so Orbax renames it into place atomically with the arrays.
"""
from __future__ import annotations

import json
import os

from edm2_jax import paths
from edm2_jax.run import integrity
from edm2_jax.run.layout import STEP_METADATA

# A checkpoint is healthy when finite and its params' RMS is within this factor of the
# run's initial RMS (forced weight normalisation keeps it near 1; a diverging run's grows
# by orders of magnitude before the loss turns NaN).
HEALTHY_RMS_FACTOR = 10.0


def step_metadata(record: dict) -> dict:
    """The Orbax `custom_metadata` of a step saved with integrity record `record`."""
    return {"integrity": record}


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


def check_host_tree(tree: dict, record: dict | None, what: str, fix: str,
                    prefix: str = "") -> None:
    """Check the host NumPy arrays `tree` against `record` (the arrays under `prefix` of
    what was saved). Raises IntegrityError naming `what` and ending with `fix` when they
    differ or are not finite."""
    try:
        integrity.check(record, integrity.digest_tree_numpy(tree), what, prefix)
    except integrity.IntegrityError as e:
        raise integrity.IntegrityError(f"{e}. {fix}") from None
