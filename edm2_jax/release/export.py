"""Our networks as the release's network pickles (`export_network_pickle`).

The pickle is a dict whose `'ema'` entry is a `Precond`, as the release's
`generate_images.py` and `reconstruct_phema.py` read it. A release pickle holds each
network as a `torch_utils.persistence` object: the source of a module and a class name,
executed on load. Ours names a few lines of our own source (`_EXPORT_SRC`): a subclass of
the release's own `training.networks_edm2.Precond` that builds itself from the recorded
constructor arguments and loads the recorded state dict, so the pickle carries no code
of the release and loads wherever the release's code is importable. `pickle_io` reads it
back (its `EXPORT_KWARGS`, `EXPORT_STATE_DICT` name the two state entries).
"""
from __future__ import annotations

import os
import pickle
from typing import Mapping

import numpy as np

from edm2_jax.release.convert import variables_to_state_dict
from edm2_jax.release.pickle_io import EXPORT_KWARGS, EXPORT_STATE_DICT
from edm2_jax.release.unpickler import import_torch

# Precond fields of this project that are the release's constructor arguments too.
RELEASE_KWARGS = ("img_resolution", "img_channels", "label_dim", "model_channels",
                  "channel_mult", "channel_mult_noise", "channel_mult_emb", "num_blocks",
                  "attn_resolutions", "label_balance", "concat_balance", "channels_per_head",
                  "dropout", "res_balance", "attn_balance", "clip_act", "sigma_data",
                  "logvar_channels")


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
                    state={EXPORT_KWARGS: self.kwargs, EXPORT_STATE_DICT: self.state_dict})
        return (_release_loader, (meta,))


def _release_loader(meta):  # pragma: no cover - written by name, run by the release
    raise RuntimeError("an exported network pickle is read by the release's loader or by "
                       "edm2_jax.release.pickle_io")


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


def export_network_pickle(variables: Mapping, net_config: Mapping, path: str,
                          use_fp16: bool | None = None) -> str:
    """Write `{'params', 'buffers'}` of the Precond `net_config` as a release network
    pickle at `path` (`{'ema': Precond}`, float32; see the module docstring).
    `use_fp16`: the release's constructor argument (whether it runs the net in float16
    on CUDA), written when given; None leaves the release's default (True). Raises
    ImportError without torch, FileExistsError for an existing `path`."""
    torch = import_torch("writing the release's pickles")
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists; remove it or choose another --dst")
    kwargs = {k: (list(v) if isinstance(v, (list, tuple)) else v)
              for k, v in dict(net_config).items() if k in RELEASE_KWARGS}
    if use_fp16 is not None:
        kwargs["use_fp16"] = bool(use_fp16)
    sd = {k: torch.from_numpy(np.array(v, np.float32))
          for k, v in variables_to_state_dict(variables).items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        _ExportPickler(f, protocol=4).dump({"ema": _ExportedPrecond(kwargs, sd)})
    os.replace(tmp, path)
    return os.path.abspath(path)
