"""The release's training states into edm2-jax runs, and edm2-jax networks into the
release's network pickles.

A release training state `training-state-<kimg>.pt` is a `torch.save`d dict (its
`CheckpointIO`): `state` = `{cur_nimg, total_elapsed_time}`, `net` = the online `Precond`
state dict, `optimizer` = `torch.optim.Adam.state_dict()` (per parameter index, in
`net.parameters()` order: `step`, `exp_avg`, `exp_avg_sq`; `param_groups` with betas and
eps), `ema` = `PowerFunctionEMA.state_dict()` (`stds`, one state dict per EMA in `emas`),
and `loss_fn`. `import_training_state` turns it into checkpoint `cur_nimg / batch_size` of
an edm2-jax run (`rundir.TrainCheckpoints`), with the train state of `train.init_train_state`:
the online params, Adam's moments and count (torch's `step`; both count the updates done,
optax's bias correction `1 - beta^count` is torch's), every power EMA under its sigma_rel,
and the run's `config.json`; `--mode=train` with the same config then continues the run.
Not carried over: the data order (the release's sampler and ours differ) and the
training RNG (drawn from `config.seed` as for a new run).

`export_network_pickle` writes a network as the release's network pickle (a dict whose
`'ema'` entry is its `Precond`), which its `generate_images.py` and
`reconstruct_phema.py` read. A release pickle holds each network as a
`torch_utils.persistence` object: the source of a module and a class name, executed on
load. Ours names a few lines of our own source (`_EXPORT_SRC`): a subclass of the
release's own `training.networks_edm2.Precond` that builds itself from the recorded
constructor arguments and loads the recorded state dict, so the pickle carries no code
of the release and loads wherever the release's code is importable.

Command lines:
    python -m edm2_jax.main --mode=convert --src=training-state-0134217.pt \
        --config=configs/img512.py:xs --workdir=runs/img512-xs    # then --mode=train
    python -m edm2_jax.main --mode=export --net=runs/img512-xs/phema/phema-0134217-0.100 \
        --dst=edm2-img512-xs-0134217-0.100.pkl
"""
from __future__ import annotations

import os
import pickle
import re
from typing import Mapping

import jax
import numpy as np
import optax

from edm2_jax.release import convert

TRAINING_STATE_RE = re.compile(r"training-state-(\d+)\.pt$")

# Precond fields of this project that are the release's constructor arguments too.
_RELEASE_KWARGS = ("img_resolution", "img_channels", "label_dim", "model_channels",
                   "channel_mult", "channel_mult_noise", "channel_mult_emb", "num_blocks",
                   "attn_resolutions", "label_balance", "concat_balance", "channels_per_head",
                   "dropout", "res_balance", "attn_balance", "clip_act", "sigma_data",
                   "logvar_channels")


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
    data = convert._torch_load(path)  # noqa: SLF001 - the one torch reader of the project
    missing = [k for k in ("state", "net", "optimizer", "ema") if not isinstance(data, dict)
               or k not in data or data[k] is None]
    if missing:
        raise ValueError(f"{path} is not a release training state: it has no {missing} "
                         f"(expected torch.save(dict(state, net, loss_fn, optimizer, ema)) of "
                         f"the release's training loop)")
    arr = convert._to_numpy  # noqa: SLF001 - torch tensor -> float32 numpy
    net = {k: arr(v) for k, v in data["net"].items()}
    keys = [k for k in net if convert.release_key_to_path(k)[0] == "params"]
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


def _variables(sd: Mapping, net_config: Mapping) -> dict:
    """Release state dict -> this project's variables, checked against the shapes of
    `net_config`'s Precond (`convert.state_dict_to_variables`)."""
    _, variables = convert.state_dict_to_variables(sd, net_config)
    return variables


def train_state_from_release(release: Mapping, config) -> tuple[int, dict]:
    """`(step, state)`: the train state of `train.init_train_state(config, ...)`'s
    structure and dtypes (host numpy) holding the release training state `release`
    (`read_training_state`), at `step = cur_nimg / config.batch_size`.

    Raises ValueError when the release state does not fit `config`: another network
    (listing the keys), EMA widths other than `config.ema.sigma_rels`, a traditional EMA
    in the config, Adam betas/eps other than `config.optim`'s, or a `cur_nimg` that is
    not a whole number of `config.batch_size` batches.
    """
    from edm2_jax.ema import power as ema_lib
    from edm2_jax.training import optim as optim_lib
    from edm2_jax.training import train

    batch = int(config.batch_size)
    if release["cur_nimg"] % batch:
        raise ValueError(f"the release state is at nimg {release['cur_nimg']}, not a whole "
                         f"number of --config.batch_size={batch} batches; use the release "
                         f"run's batch size")
    want = sorted(ema_lib.ema_key(s) for s in config.ema.sigma_rels)
    have = sorted(ema_lib.ema_key(s) for s in release["ema"])
    if want != have:
        raise ValueError(f"the release state tracks power EMAs {have}, the config "
                         f"ema.sigma_rels {want}; set --config.ema.sigma_rels to "
                         f"({', '.join(have)})")
    if float(config.ema.trad_halflife_kimg) > 0:
        raise ValueError("the release state has no traditional EMA; set "
                         "--config.ema.trad_halflife_kimg=0")
    adam = release["adam"]
    ours = (float(config.optim.beta1), float(config.optim.beta2), float(config.optim.eps))
    if not np.allclose(adam["betas"] + (adam["eps"],), ours, rtol=1e-6, atol=0):
        raise ValueError(f"the release state's Adam has betas {adam['betas']} and eps "
                         f"{adam['eps']}, the config optim.beta1/beta2/eps {ours}; set them to "
                         f"the release's")

    net_config = config.network.to_dict()
    variables = _variables(release["net"], net_config)
    params = variables["params"]
    buffers = {k: v for k, v in release["net"].items()
               if convert.release_key_to_path(k)[0] == "buffers"}
    mu = _variables({**buffers, **adam["exp_avg"]}, net_config)["params"]
    nu = _variables({**buffers, **adam["exp_avg_sq"]}, net_config)["params"]
    emas = {ema_lib.ema_key(s): _variables(sd, net_config)["params"]
            for s, sd in release["ema"].items()}

    net = train.make_network(config)
    tx = optim_lib.make_optimizer(config.optim, batch)
    abstract = jax.eval_shape(lambda r: train.init_train_state(config, net, tx, r),
                              jax.random.PRNGKey(config.seed))
    opt_state = tuple(
        s._replace(count=np.asarray(adam["step"], np.int32), mu=mu, nu=nu)
        if isinstance(s, optax.ScaleByAdamState) else s
        for s in jax.eval_shape(tx.init, params))
    state = {
        "step": np.asarray(release["cur_nimg"] // batch, np.int32),
        "params": params,
        "buffers": variables["buffers"],
        "opt_state": opt_state,
        "ema": {"power": emas},
        "rng": np.asarray(jax.random.split(jax.random.PRNGKey(config.seed))[1]),
    }
    try:
        state = jax.tree.map(lambda x, a: np.asarray(x, a.dtype).reshape(a.shape), state,
                             abstract)
    except ValueError as e:
        raise ValueError(f"the converted state does not have the arrays of the config's "
                         f"train state ({e})") from None
    return int(state["step"]), state


def import_training_state(src: str, workdir: str, config) -> int:
    """Convert the release training state `src` into checkpoint `step` of a new
    edm2-jax run in `workdir` trained with `config` (plus its config.json); returns the
    step. `config` is the one `--mode=train` will get: its network must be the release
    net's and fit the data (as the presets do; a data-adapted network is what
    `train.setup_data` returns). `--mode=train` with the same config continues from there. Raises
    FileExistsError when `workdir` already has checkpoints (nothing is overwritten) and
    what `read_training_state` / `train_state_from_release` raise."""
    from edm2_jax import paths
    from edm2_jax.run import integrity
    from edm2_jax.training import resume
    from edm2_jax.run import rundir

    if rundir.is_run(workdir) or rundir.step_dirs(os.path.join(workdir, rundir.CHECKPOINTS)):
        raise FileExistsError(f"{workdir} already holds a run; convert the training state "
                              f"into a new --workdir")
    step, state = train_state_from_release(read_training_state(src), config)
    paths.makedirs(workdir)  # local or gs://
    current = resume.check_config(workdir, config)
    managers = rundir.TrainCheckpoints(workdir, keep=int(config.keep_checkpoints))
    managers.reference_rms = {"params": integrity.rms(state["params"])}
    try:
        managers.save_state(step, state)
    finally:
        managers.close()
    resume.record_config(workdir, current)
    return step


def main_import_state(src: str, workdir: str, config) -> int:
    """CLI hook of `--mode=convert --src=training-state-*.pt --config=... --workdir=DIR`."""
    if config is None:
        raise ValueError("converting a release training state needs the run's --config "
                         "(e.g. --config=configs/img512.py:xs) to continue training with")
    step = import_training_state(src, workdir, config)
    print(f"Converted {src} into checkpoint {step} of the run {workdir} "
          f"({step * int(config.batch_size) / 1000:g} kimg); continue it with --mode=train "
          f"and the same --config")
    return step


# ---------------------------------------------------------------------------------------
# Export.

# Executed by the release's persistence loader (its `training/` importable): a subclass
# of its Precond that rebuilds itself from the recorded arguments and state dict; a
# state of the usual form (the release re-pickling such a net) loads as usual.
_EXPORT_SRC = '''\
import torch
from training import networks_edm2

class Precond(networks_edm2.Precond):
    def __setstate__(self, state):
        if "edm2_jax_state_dict" not in state:
            return torch.nn.Module.__setstate__(self, dict(state))
        type(self).__init__(self, **state["edm2_jax_kwargs"])
        self.load_state_dict(state["edm2_jax_state_dict"])
        self.eval().requires_grad_(False)
'''


class _ExportedPrecond:
    """Pickles as the release's persistence objects do: a call of its loader
    `torch_utils.persistence._reconstruct_persistent_obj` on
    `{type, version, module_src, class_name, state}` (`_ExportPickler` names it)."""

    def __init__(self, kwargs: dict, state_dict: dict):
        self.kwargs, self.state_dict = kwargs, state_dict

    def __reduce__(self):
        meta = dict(type="class", version=6, module_src=_EXPORT_SRC, class_name="Precond",
                    state={"edm2_jax_kwargs": self.kwargs,
                           "edm2_jax_state_dict": self.state_dict})
        return (_release_loader, (meta,))


def _release_loader(meta):  # pragma: no cover - written by name, run by the release
    raise RuntimeError("an exported network pickle is read by the release's loader or by "
                       "edm2_jax.release.convert")


class _ExportPickler(pickle._Pickler):  # noqa: SLF001 - the Python pickler's save_global
    """Writes `_release_loader` as the global `torch_utils.persistence.
    _reconstruct_persistent_obj` (the release's module, not importable here)."""

    def save_global(self, obj, name=None):
        if obj is _release_loader:
            self.save("torch_utils.persistence")
            self.save("_reconstruct_persistent_obj")
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)

    dispatch = dict(pickle._Pickler.dispatch)  # noqa: SLF001
    dispatch[type(_release_loader)] = save_global


def export_network_pickle(variables: Mapping, net_config: Mapping, path: str) -> str:
    """Write `{'params', 'buffers'}` of the Precond `net_config` as a release network
    pickle at `path` (`{'ema': Precond}`, float32; see the module docstring). Raises
    ImportError without torch, FileExistsError for an existing `path`."""
    torch = convert._import_torch()  # noqa: SLF001
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists; remove it or choose another --dst")
    kwargs = {k: (list(v) if isinstance(v, (list, tuple)) else v)
              for k, v in dict(net_config).items() if k in _RELEASE_KWARGS}
    sd = {k: torch.from_numpy(np.array(v, np.float32))
          for k, v in convert.variables_to_state_dict(variables).items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        _ExportPickler(f, protocol=4).dump({"ema": _ExportedPrecond(kwargs, sd)})
    os.replace(tmp, path)
    return os.path.abspath(path)


def main_export(net_path: str, dst: str, ema: str | None = None) -> str:
    """CLI hook of `--mode=export --net=PATH [--ema=KEY] --dst=FILE.pkl`: any network
    `generate.load_net` reads (network checkpoint, run, snapshot) as a release pickle."""
    from edm2_jax.sampling import generate
    if not dst:
        raise ValueError("--mode=export needs --dst=FILE.pkl")
    net, variables, desc = generate.load_net(net_path, ema)
    config = {k: getattr(net, k) for k in _RELEASE_KWARGS}
    path = export_network_pickle(jax.device_get(variables), config, dst)
    print(f"Exported {desc} -> {path} (the release's network pickle: generate_images.py "
          f"--net={path}, or a reconstruct_phema.py input when named "
          f"<prefix>-<kimg>-<sigma_rel>.pkl)")
    return path
