"""Reading the authors' released EDM2 networks (NVlabs/edm2, PyTorch) without their code.

Files understood by `load_release` / `load_state_dict`:

* the authors' network pickles (`edm2-img64-s-1073741-0.075.pkl`, training
  `network-snapshot-*.pkl`, post-hoc EMA outputs): `pickle.dump` of a dict
  (`dnnlib.EasyDict`) whose `'ema'` (or `'net'`) entry is the `Precond` module. Their
  classes are wrapped by the release's `torch_utils.persistence`, so every such object
  pickles as a call `_reconstruct_persistent_obj(meta)`, `meta = {type, version,
  module_src, class_name, state}`, `state` the object's `__dict__` (`_parameters`,
  `_buffers`, `_modules`, `_init_args`, `_init_kwargs`).
* a `torch.save`d `state_dict()` of their `Precond` (`.pt` / `.pth`), or a `torch.save`d
  dict holding one under `'ema'` / `'net'`.
* an `.npz` with the `state_dict` keys, optionally prefixed `w/` (the golden files), read
  by `encoders.safe_arrays.read_npz`.
* our exports (`export.export_network_pickle`; `EXPORT_KWARGS`, `EXPORT_STATE_DICT`).

`unpickler.ReleaseUnpickler` reads the pickles, resolving only the globals these files
hold (`unpickler.RELEASE_GLOBALS`) to constructors of data: the authors' code is never
imported or run, any other global is refused with a ValueError naming it. Every array of
these files is made by `encoders.safe_arrays.array_from_bytes` (a plain numeric dtype,
exactly the bytes present).

What comes back (`ReleaseWeights`): the release's state dict (float32 numpy, conv OIHW,
dense `[out, in]`) and the Precond kwargs the pickle recorded; `convert.py` maps them to
this project's variables.
"""
from __future__ import annotations

import os
import zipfile
from typing import Any, Mapping, NamedTuple

import numpy as np

from edm2_jax.encoders import safe_arrays, torch_weights
from edm2_jax.release.unpickler import (
    PersistentObject,
    ReleaseUnpickler,
    TorchMissingError,  # noqa: F401 - modes/common.py's user errors import it from here
    import_torch,
    read_untrusted,
    torch_load,
)

# Positional order of the release's Precond.__init__ (for pickles that recorded init_args).
_PRECOND_POSITIONAL = ("img_resolution", "img_channels", "label_dim", "use_fp16",
                       "sigma_data", "logvar_channels")
# The state entries of a Precond written by `export.export_network_pickle`.
EXPORT_KWARGS = "edm2_jax_kwargs"
EXPORT_STATE_DICT = "edm2_jax_state_dict"


class ReleaseWeights(NamedTuple):
    """What `load_release` read from a file.

    state_dict: release key -> float32 numpy array (release layout).
    net_kwargs: Precond kwargs recorded in a network pickle (init kwargs and module
      attributes such as `sigma_data`, `dropout`, `channels_per_head`), already in this
      project's field names; `{}` for state dicts and npz files.
    info: provenance, e.g. `{'format': 'pickle', 'key': 'ema', 'class_name': 'Precond',
      'dtype': 'float16', 'use_fp16': True}`.
    """
    state_dict: dict
    net_kwargs: dict
    info: dict


# ---------------------------------------------------------------------------------------
# Reading files.

def to_numpy(value) -> np.ndarray:
    """A torch tensor, numpy array or scalar as a float32 numpy array (a copy for torch)."""
    if isinstance(value, np.ndarray) or np.isscalar(value):
        return np.asarray(value, np.float32)
    torch = import_torch()
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.float32).numpy().copy()
    raise TypeError(f"not an array: {type(value).__name__}")


def _is_array(value) -> bool:
    if isinstance(value, np.ndarray):
        return True
    t = type(value)
    return t.__module__.startswith("torch") and hasattr(value, "detach")


def _dtype_name(value) -> str:
    return str(value.dtype).replace("torch.", "")


def _module_state(obj) -> dict | None:
    """The `__dict__` of a torch module / persistent stand-in, or None."""
    if isinstance(obj, PersistentObject):
        return obj.state
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict) and "_parameters" in state:
        return state
    return None


def _walk_module(obj, prefix: str, out: dict, modules: dict) -> None:
    """Flatten parameters and persistent buffers of a module tree into `out` (as
    torch's `state_dict` would name them); record `modules[prefix] = obj`."""
    state = _module_state(obj)
    if state is None:
        raise ValueError(f"{prefix or 'root'}: expected a torch module, got {type(obj).__name__}")
    modules[prefix] = obj
    skip = set(state.get("_non_persistent_buffers_set") or ())
    for group in ("_parameters", "_buffers"):
        for name, value in (state.get(group) or {}).items():
            if value is None or name in skip:
                continue
            out[prefix + name] = value
    for name, child in (state.get("_modules") or {}).items():
        if child is not None:
            _walk_module(child, f"{prefix}{name}.", out, modules)


def _class_name(obj) -> str:
    return obj.class_name if isinstance(obj, PersistentObject) else type(obj).__name__


def _net_kwargs_from_modules(modules: dict) -> dict:
    """Precond kwargs recorded in a pickled module tree: the root's `_init_kwargs` /
    `_init_args` and the attributes the release keeps on Precond, UNet and Block."""
    root = _module_state(modules[""])
    kw: dict = {}
    for name, value in zip(_PRECOND_POSITIONAL, root.get("_init_args") or ()):
        kw[name] = value
    kw.update(dict(root.get("_init_kwargs") or root.get("init_kwargs") or {}))
    kw.pop("class_name", None)
    for name in ("img_resolution", "img_channels", "label_dim", "use_fp16", "sigma_data"):
        if name in root:
            kw[name] = root[name]
    unet = _module_state(modules["unet."]) if "unet." in modules else None
    for name in ("label_balance", "concat_balance"):
        if unet and name in unet:
            kw[name] = unet[name]
    blocks = [(p, s) for p, s in ((p, _module_state(m)) for p, m in modules.items())
              if "res_balance" in s]
    for name in ("dropout", "res_balance", "attn_balance", "clip_act", "resample_filter"):
        values = {repr(s[name]) for _, s in blocks if name in s}
        if len(values) > 1:
            raise ValueError(f"the pickle's blocks disagree on {name}: {sorted(values)}; "
                             f"edm2_jax.model.networks.Precond uses one value for all blocks")
        if values:
            kw[name] = next(s[name] for _, s in blocks if name in s)
    if "channels_per_head" not in kw:
        heads = [(s["out_channels"], s["num_heads"]) for _, s in blocks
                 if s.get("num_heads") and s.get("out_channels")]
        if heads:
            candidates = [64] + [c // h for c, h in heads]
            for cph in candidates:
                if all(c // cph == h for c, h in heads):
                    kw["channels_per_head"] = cph
                    break
            else:
                raise ValueError(f"cannot find one channels_per_head giving the pickle's "
                                 f"(channels, heads) {sorted(set(heads))}")
    return kw


def _select_network(obj, path: str, key: str = "") -> tuple[Any, str] | None:
    """Find the Precond inside a loaded object: prefer `'ema'`, then `'net'`."""
    if _module_state(obj) is not None:
        return obj, key
    if isinstance(obj, Mapping):
        if obj and all(_is_array(v) for v in obj.values()):
            return obj, key
        for k in ("ema", "net", "model", "state_dict"):
            if k in obj:
                found = _select_network(obj[k], path, f"{key}.{k}" if key else k)
                if found is not None and _looks_like_precond(found[0]):
                    return found
    return None


def _looks_like_precond(obj) -> bool:
    if isinstance(obj, Mapping):
        return any(str(k).startswith(("unet.", "module.unet.")) for k in obj)
    if _is_export(obj):
        return True
    state = _module_state(obj)
    return state is not None and "unet" in (state.get("_modules") or {})


def strip_prefixes(sd: dict) -> dict:
    """`sd` without a `w/` (golden npz) or `module.` (DataParallel) prefix on every key."""
    for prefix in ("w/", "module."):
        if sd and all(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix):]: v for k, v in sd.items()}
    return sd


def _is_export(obj) -> bool:
    """A Precond written by `export.export_network_pickle` (its state holds the
    constructor arguments and the state dict)."""
    return isinstance(obj, PersistentObject) and EXPORT_STATE_DICT in obj.state


def _from_loaded(obj, path: str, fmt: str) -> ReleaseWeights:
    found = _select_network(obj, path)
    if found is None:
        what = (f"a {type(obj).__name__} with keys {sorted(map(str, obj))[:8]}"
                if isinstance(obj, Mapping) else f"a {type(obj).__name__}")
        raise ValueError(f"{path}: found {what}, not an EDM2 Precond; expected a network "
                         f"pickle holding 'ema' (or 'net'), or a Precond state_dict")
    net, key = found
    info = dict(format=fmt, key=key or None)
    if isinstance(net, Mapping):
        raw, net_kwargs = dict(net), {}
        info["class_name"] = "state_dict"
    elif _is_export(net):
        raw, net_kwargs = dict(net.state[EXPORT_STATE_DICT]), dict(net.state[EXPORT_KWARGS])
        info["class_name"] = net.class_name
    else:
        raw, modules = {}, {}
        _walk_module(net, "", raw, modules)
        net_kwargs = _net_kwargs_from_modules(modules)
        info["class_name"] = _class_name(net)
    raw = strip_prefixes({str(k): v for k, v in raw.items()})
    dtypes = sorted({_dtype_name(v) for v in raw.values()})
    info["dtype"] = dtypes[0] if len(dtypes) == 1 else dtypes
    if "use_fp16" in net_kwargs:
        info["use_fp16"] = bool(net_kwargs.pop("use_fp16"))
    sd = {k: to_numpy(v) for k, v in raw.items()}
    return ReleaseWeights(sd, net_kwargs, info)


def load_release(path: str) -> ReleaseWeights:
    """Read a released EDM2 network (pickle, torch state_dict, or npz; see module doc).

    Returns `ReleaseWeights(state_dict, net_kwargs, info)`; arrays float32 numpy in the
    release's layout (fp16 pickles are cast). Raises FileNotFoundError for a missing
    file, ImportError naming `pip install -e ".[torch]"` when a PyTorch file needs
    torch, `unpickler.RefusedGlobalError` (a ValueError) naming a global outside
    `unpickler.RELEASE_GLOBALS`, ValueError for a damaged file or one that holds no EDM2
    Precond.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (expected an EDM2 .pkl, .pt/.pth or .npz)")
    if zipfile.is_zipfile(path):
        names = read_untrusted(path, lambda: zipfile.ZipFile(path).namelist())
        if names and all(n.endswith(".npy") for n in names):
            arrays = read_untrusted(path, lambda: safe_arrays.read_npz(path, "the .npz"))
            if any(k.startswith("w/") for k in arrays):
                arrays = {k: v for k, v in arrays.items() if k.startswith("w/")}
            return _from_loaded(arrays, path, "npz")
        return _network(torch_load(path), path, "torch")

    def unpickle():
        with open(path, "rb") as f:
            return ReleaseUnpickler(f).load()

    obj = read_untrusted(path, unpickle)
    if isinstance(obj, int) and obj == torch_weights.LEGACY_MAGIC:  # legacy torch.save format
        return _network(torch_load(path), path, "torch")
    return _network(obj, path, "pickle")


def _network(obj, path: str, fmt: str) -> ReleaseWeights:
    """`_from_loaded`, its errors on a malformed structure one ValueError naming `path`."""
    try:
        return _from_loaded(obj, path, fmt)
    except ValueError:
        raise
    except (TypeError, AttributeError, KeyError, IndexError, RecursionError) as e:
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise ValueError(f"{path} holds no EDM2 Precond this converter reads ({why}); "
                         f"expected a network pickle holding 'ema' (or 'net'), or a "
                         f"Precond state_dict") from None


def load_state_dict(path: str) -> dict[str, np.ndarray]:
    """Release `state_dict` of the Precond in `path`: key -> float32 numpy array, conv
    weights OIHW, dense `[out, in]`, as the release keeps them. See `load_release`."""
    return load_release(path).state_dict
