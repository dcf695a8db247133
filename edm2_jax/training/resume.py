"""Resuming a run: the config a run was started with must not change under it, except
where a change leaves the train state's arrays as they are.

Owns the list of training-relevant config fields (`RESUME_FIELDS`), those of them that
may change on resume (`CHANGEABLE_ON_RESUME`: the optimiser's learning rate, schedule,
betas and clipping, so that a diverged run can be rescued from a healthy checkpoint with
a lower learning rate), their comparison (`check_config_matches`), and the record of the
config in the run's config.json (`check_config`, then `record_config` once every other
check has passed; `run.layout` writes it atomically) and in each checkpoint's record
(`KEPT_CONFIG`), which stands in for a deleted config.json (`saved_config`).

And the record of each start's learning rate and clip (`optim_history`, kept in
config.json), from which a run that diverged (the loss or the state NaN/inf) gets the
advice it ends with (`rescue_hint`): its newest healthy checkpoint and the lower rate to
resume it with.
"""
from __future__ import annotations

import json
import os

import ml_collections

from edm2_jax import configs, objectives
from edm2_jax.run import checkpoints, layout, records
from edm2_jax.run.records import KEPT_CONFIG  # kept in each checkpoint's record

# Fields that must not change when resuming in the same workdir (with the config
# section of every registered objective, `resume_fields`) ...
RESUME_FIELDS = ("network", "loss", "optim", "ema", "batch_size", "seed", "data.source",
                 "data.name", "data.split", "data.resolution", "data.use_labels", "objective")
# ... except these prefixes: they change no array of the train state (optim.make_optimizer
# keeps the state's structure whatever grad_clip is).
CHANGEABLE_ON_RESUME = ("optim.",)
# Fields added after runs existed: a config.json without one recorded this value (the
# ablation switches at config G, docs/ablation.md). A field added to an objective's
# section is read at its default (`Objective.section_fields`).
ADDED_FIELDS = {"network.mp_learned_layers": True, "network.group_norm": False,
                "network.mp_fixed_layers": True, "optim.forced_wn": True}


def _lookup(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _normalise_json(x):
    return json.loads(json.dumps(x))


def config_differences(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """`(refused, allowed)`: the training-relevant fields that differ between the
    `saved` and `current` config dicts, as `'field: checkpoint A vs now B'` lines, split
    by `CHANGEABLE_ON_RESUME`. Of the objective's config section (`current`'s objective's),
    the fields it reads are compared: a field only the saved config holds (a section
    another objective shares) is none of this run's."""
    diffs = []
    added = dict(ADDED_FIELDS)
    fields = list(RESUME_FIELDS)
    section = objectives.from_config(current).section
    if section:
        fields.append(section)
        added.update({f"{section}.{k}": v for k, v in
                      objectives.REGISTRY[objectives.name_of(current)].section_fields().items()})
    for field in fields:
        a, b = _normalise_json(_lookup(saved, field)), _normalise_json(_lookup(current, field))
        if a is None and isinstance(b, dict):  # a section added after the run started
            a = {}
        if isinstance(a, dict) and isinstance(b, dict):
            keys = set(b)   # the fields this run reads (e.g. not a removed loss.sigma_data)
            for k in sorted(keys):
                va = a.get(k, added.get(f"{field}.{k}"))
                if va != b.get(k):
                    diffs.append((f"{field}.{k}", va, b.get(k)))
        elif a != b:
            diffs.append((field, a, b))
    lines = [(f, f"{f}: checkpoint {a!r} vs now {b!r}") for f, a, b in diffs]
    allowed = [line for f, line in lines if f.startswith(CHANGEABLE_ON_RESUME)]
    refused = [line for f, line in lines if not f.startswith(CHANGEABLE_ON_RESUME)]
    return refused, allowed


def check_config_matches(saved: dict, current: dict, workdir: str) -> list[str]:
    """Raise ValueError listing every training-relevant field that differs from the config
    saved in `workdir` and may not change (a resumed run must be the same run). Returns
    the changes that are allowed (`CHANGEABLE_ON_RESUME`)."""
    refused, allowed = config_differences(saved, current)
    if refused:
        raise ValueError(
            f"the config does not match the run in {workdir} ({'; '.join(refused)}). Use a "
            f"new --workdir for a different run, or restore those settings to resume (the "
            f"optim.* fields may change on resume).")
    return allowed


def saved_config(workdir: str, quiet: bool = False) -> dict | None:
    """The config of the run in `workdir`: its config.json, else (config.json deleted;
    a line says so unless `quiet`) the copy its newest checkpoint keeps (`KEPT_CONFIG`
    in the checkpoint's record, with the `optim_history` of the start that saved it), or
    None for a new run. Raises ValueError when the run has checkpoints but neither (the
    same-run check cannot be made, and a changed config would go unnoticed), and when
    config.json differs from that copy in a field that may not change (it was edited)."""
    saved = layout.read_config(workdir)
    kept = records.kept_entry(workdir, KEPT_CONFIG)
    if saved is not None:
        refused = config_differences(kept[1], saved)[0] if kept is not None else []
        if refused:
            raise ValueError(
                f"{layout.config_path(workdir)} differs from the copy of the run's config "
                f"that checkpoint {kept[0]} keeps ({'; '.join(refused)}): it was edited, "
                f"and the run's state was not trained with it; nothing was trained. Put "
                f"those settings back in config.json to resume, or use a new --workdir.")
        return saved
    if kept is not None:
        if not quiet:
            print(f"{layout.config_path(workdir)} is missing: checking the config against "
                  f"the copy checkpoint {kept[0]} keeps (config.json is written again)",
                  flush=True)
        return kept[1]
    steps = layout.step_dirs(os.path.join(workdir, layout.CHECKPOINTS))
    if steps:
        raise ValueError(
            f"{layout.config_path(workdir)} is missing and the checkpoints of the run "
            f"({', '.join(os.path.basename(d) for d in steps)}) keep no copy of its config, "
            f"so whether this config is the run's cannot be checked; nothing was trained. "
            f"Put the run's config.json back to resume it, or use a new --workdir.")
    return None


def check_config(workdir: str, config: ml_collections.ConfigDict) -> dict:
    """Same run, or a clear error before any step: compare `config` with the run's
    config.json when there is one (`check_config_matches`) and print each allowed
    change. Returns the config as a JSON-able dict, for `record_config`. Writes
    nothing."""
    current = json.loads(config.to_json_best_effort())
    saved = saved_config(workdir)
    if saved is not None:
        for line in check_config_matches(saved, current, workdir):
            print(f"Config change on resume (allowed: changes no array of the train state): "
                  f"{line}", flush=True)
    return current


def record_config(workdir: str, current: dict) -> None:
    """Write `current` (from `check_config`) as the run's config.json, atomically; call
    it once every check has passed (process 0)."""
    layout.write_config(workdir, current)


# The rescue of a diverged run. ------------------------------------------------------

def optim_history(saved: dict | None, current: dict, step0: int) -> list[dict]:
    """The learning rate and clip each start of the run trained with, from `step0` on:
    `[{"step", "ref_lr", "grad_clip"}, ...]` by step, as the run records it (`saved`, the
    record before this start: config.json, or the copy of it the newest checkpoint keeps,
    `saved_config`; a record without a history counts its optim.* from step 0). The
    starts at or after `step0` trained nothing that is kept; this start (`current`) is
    appended."""
    def entry(step: int, optim: dict) -> dict:
        return {"step": int(step), "ref_lr": float(optim["ref_lr"]),
                "grad_clip": float(optim.get("grad_clip", 0.0))}
    saved = saved or {}
    history = list(saved.get("optim_history") or
                   ([entry(0, saved["optim"])] if isinstance(saved.get("optim"), dict) else []))
    return [h for h in history if h["step"] < step0] + [entry(step0, current["optim"])]


def default_rate(lr: float, default_ref_lr: float | None) -> tuple[float, str]:
    """`(rate, why)`: the learning rate to name after `lr` diverged when no lower rate of
    the run has trained: the first below `lr` of `default_ref_lr` (the config file's own,
    before overrides) and `configs.base_config()`'s (the release's img64-xs rate; every
    released preset's is within 2x of it), else a tenth of `lr`."""
    for rate, what in ((default_ref_lr, "the config file's own ref_lr"),
                       (configs.base_config().optim.ref_lr, "the default ref_lr of "
                                                            "edm2_jax/configs.py")):
        if rate is not None and float(rate) < lr:
            return float(rate), f"{what}; {lr:g} diverged before any lower rate trained"
    return lr / 10, f"a tenth of {lr:g}, which diverged"


def rescue_flags(step: int, history: list[dict], lr: float, grad_clip: float,
                 default_ref_lr: float | None = None) -> tuple[list[str], str]:
    """`(flags, why)`: how to resume a run that diverged at learning rate `lr` (its
    `optim.ref_lr`) and clip `grad_clip` (`optim.grad_clip`, 0 = none) from its healthy
    checkpoint `step`: the most recent learning rate in `history` (`optim_history`) that
    trained steps before `step` and is lower than `lr`, else `default_rate`'s; a
    gradient clip only where none is set (as a second resort, in `why`)."""
    trained = [h for h in history if h["step"] < step and h["ref_lr"] < lr]
    if trained:
        rate = trained[-1]["ref_lr"]
        why = f"the rate that trained from step {trained[-1]['step']}"
    else:
        rate, why = default_rate(lr, default_ref_lr)
    flags = [f"--config.resume_step={step}", f"--config.optim.ref_lr={rate:g}"]
    if not grad_clip:
        why += "; should it diverge again, also add --config.optim.grad_clip=1"
    return flags, why


def rescue_hint(managers: checkpoints.TrainCheckpoints, lr: float, grad_clip: float,
                history: list[dict], default_ref_lr: float | None = None) -> str:
    """How to resume a run that diverged at learning rate `lr` and clip `grad_clip`: the
    newest checkpoint that is finite with a healthy parameter RMS (`records.is_healthy`),
    and the flags (`rescue_flags`); with none, a new run at `default_rate`'s learning
    rate."""
    try:
        managers.close()  # the saves in flight complete (or fail) first
    except checkpoints.CheckpointSaveError:
        pass
    found = managers.newest_healthy()
    if found is None:
        rate, why = default_rate(lr, default_ref_lr)
        return (" No checkpoint of this run is healthy (finite, parameter RMS within "
                f"{records.HEALTHY_RMS_FACTOR:g}x of the start): start a new run in a new "
                f"--workdir with --config.optim.ref_lr={rate:g} ({why}).")
    step, record = found
    flags, why = rescue_flags(step, history, lr, grad_clip, default_ref_lr)
    return (f" The newest healthy checkpoint is step {step} (finite; parameter RMS "
            f"{record['rms']['params']:.3g}). Resume from it with a lower learning rate: "
            f"re-run the same command with {' '.join(flags)} ({why}); the optim.* fields "
            f"may change on resume.")
