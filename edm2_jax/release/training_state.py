"""The release's training states (`training-state-<kimg>.pt`): recognising and reading them.

A release training state is a `torch.save`d dict (its `CheckpointIO`): `state` =
`{cur_nimg, total_elapsed_time}`, `net` = the online `Precond` state dict, `optimizer` =
`torch.optim.Adam.state_dict()` (per parameter index, in `net.parameters()` order: `step`,
`exp_avg`, `exp_avg_sq`; `param_groups` with betas and eps), `ema` =
`PowerFunctionEMA.state_dict()` (`stds`, one state dict per EMA in `emas`), and
`loss_fn`. `read_training_state` reads its arrays (torch through `pickle_io`, never the
release's code).

The train state built from it is `training.from_release.train_state_from_release`'s;
the command line that carries it into a run (`--mode=convert --src=training-state-*.pt`)
is `modes/release.py`'s.
"""
from __future__ import annotations

import os
import re

from edm2_jax.release.convert import release_key_to_path
from edm2_jax.release.pickle_io import to_numpy
from edm2_jax.release.unpickler import torch_load

TRAINING_STATE_RE = re.compile(r"training-state-(\d+)\.pt$")


def is_training_state(path: str) -> bool:
    """Whether `path` is named like a release training state (`training-state-*.pt`)."""
    return TRAINING_STATE_RE.search(os.path.basename(str(path))) is not None


def read_training_state(path: str) -> dict:
    """The arrays of a release training state, as float32 numpy in the release's layout.

    Returns `{'cur_nimg': int, 'net': {key: array}, 'adam': {'step': int, 'betas': (b1,
    b2), 'eps': float, 'exp_avg': {key: array}, 'exp_avg_sq': {key: array}},
    'ema': {sigma_rel: {key: array}}}` with `net`'s parameter keys (not its MPFourier
    buffers) in `net.parameters()` order. Raises FileNotFoundError, ImportError without
    torch, ValueError for a file that is not a release training state.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (expected a release "
                                f"training-state-<kimg>.pt)")
    data = torch_load(path)
    missing = [k for k in ("state", "net", "optimizer", "ema") if not isinstance(data, dict)
               or k not in data or data[k] is None]
    if missing:
        raise ValueError(f"{path} is not a release training state: it has no {missing} "
                         f"(expected torch.save(dict(state, net, loss_fn, optimizer, ema)) of "
                         f"the release's training loop)")
    arr = to_numpy  # torch tensor -> float32 numpy
    net = {k: arr(v) for k, v in data["net"].items()}
    keys = [k for k in net if release_key_to_path(k)[0] == "params"]
    opt = data["optimizer"]
    group = opt["param_groups"][0]
    if len(opt["param_groups"]) != 1 or list(group["params"]) != list(range(len(keys))):
        raise ValueError(f"{path}: the optimizer state has parameter groups "
                         f"{[len(g['params']) for g in opt['param_groups']]} for the net's "
                         f"{len(keys)} parameters; expected one group over all of them")
    per = [opt["state"].get(i) for i in range(len(keys))]
    if any(p is None for p in per):
        raise ValueError(f"{path}: Adam has no moments for some parameters (a state saved "
                         f"before the first step?); start from the network instead "
                         f"(--mode=convert of a network pickle)")
    steps = {int(float(p["step"])) for p in per}
    if len(steps) != 1:
        raise ValueError(f"{path}: Adam's step differs between parameters ({sorted(steps)})")
    ema = data["ema"]
    if not isinstance(ema, dict) or "stds" not in ema:
        raise ValueError(f"{path}: its 'ema' is not the release's PowerFunctionEMA state "
                         f"(stds, emas); a traditional EMA cannot be converted")
    return {
        "cur_nimg": int(data["state"]["cur_nimg"]),
        "net": net,
        "adam": {"step": steps.pop(), "betas": tuple(float(b) for b in group["betas"]),
                 "eps": float(group["eps"]),
                 "exp_avg": {k: arr(p["exp_avg"]) for k, p in zip(keys, per)},
                 "exp_avg_sq": {k: arr(p["exp_avg_sq"]) for k, p in zip(keys, per)}},
        "ema": {float(s): {k: arr(v) for k, v in sd.items()}
                for s, sd in zip(ema["stds"], ema["emas"])},
    }

