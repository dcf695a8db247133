"""When the loss becomes NaN: the advice a diverged run ends with (`loop.train_and_evaluate`
raises NonFiniteLossError with it), drawn from the learning rate of each start of the run
(`optim_history`, recorded in config.json) and the run's newest healthy checkpoint."""
from __future__ import annotations

from edm2_jax import configs
from edm2_jax.run import checkpoints, records


def optim_history(saved: dict | None, current: dict, step0: int) -> list[dict]:
    """The learning rate and clip each start of the run trained with, from `step0` on:
    `[{"step", "ref_lr", "grad_clip"}, ...]` by step, as the run records it (`saved`, the
    record before this start: config.json, or the copy of it the newest checkpoint keeps,
    `resume.saved_config`; a record without a history counts its optim.* from step 0). The starts at or after `step0` trained nothing that is kept; this start
    (`current`) is appended."""
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
