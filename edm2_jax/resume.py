"""Resuming a run: the config a run was started with must not change under it.

Owns the list of training-relevant config fields (`RESUME_FIELDS`), their comparison
(`check_config_matches`) and `check_and_record_config`, which compares the current config
with the run's config.json before any step and then (re)writes it (`rundir`).
"""
from __future__ import annotations

import json

import ml_collections

from edm2_jax import rundir

# Fields that must not change when resuming in the same workdir.
RESUME_FIELDS = ("network", "loss", "optim", "ema", "batch_size", "seed", "data.source",
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
    for field in RESUME_FIELDS:
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


def check_and_record_config(workdir: str, config: ml_collections.ConfigDict, *,
                            write: bool) -> None:
    """Same run, or a clear error before any step: compare `config` with the run's
    config.json when there is one (`check_config_matches`), then write it there when
    `write` (process 0). The record is untouched when they differ."""
    current = json.loads(config.to_json_best_effort())
    saved = rundir.read_config(workdir)
    if saved is not None:
        check_config_matches(saved, current, workdir)
    if write:
        rundir.write_config(workdir, current)
