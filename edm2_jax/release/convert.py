"""Import the authors' released EDM2 weights (NVlabs/edm2, PyTorch) into this project.

Sources understood by `load_release` / `load_state_dict`:

* the authors' network pickles (`edm2-img64-s-1073741-0.075.pkl`, training
  `network-snapshot-*.pkl`, post-hoc EMA outputs): `pickle.dump` of a dict
  (`dnnlib.EasyDict`) whose `'ema'` (or `'net'`) entry is the `Precond` module. Their
  classes are wrapped by the release's `torch_utils.persistence`, so every such object
  pickles as a call `_reconstruct_persistent_obj(meta)` with
  `meta = {type, version, module_src, class_name, state}` and `state` the object's
  `__dict__` (torch's `_parameters` / `_buffers` / `_modules` plus `_init_args` /
  `_init_kwargs`). A restricted unpickler maps those names to inert stand-ins, so the
  authors' code is never imported or executed; only `torch` is needed, for the tensors.
* a `torch.save`d `state_dict()` of their `Precond` (`.pt` / `.pth`), or a `torch.save`d
  dict holding one under `'ema'` / `'net'`.
* an `.npz` with the `state_dict` keys, optionally prefixed `w/` (the golden files).

State-dict keys are the release's (`unet.enc.8x8_block0.attn_qkv.weight`), arrays
float32 numpy in the release's layout (conv OIHW, dense `[out, in]`). In this project
(see `networks.py`) the same weights live at
`params['unet']['enc_8x8_block0']['attn_qkv']['weight']`, convs HWIO and dense
`[in, out]`; `MPFourier` `freqs` / `phases` go to the `'buffers'` collection. The
`attn_qkv` output channels keep the release's [head][channel-in-head][q, k, v] order
(docs/recipe.md §2), so the conversion is a renaming plus a transpose.

Like any pickle, a network pickle can run code when it is read by an unrestricted
unpickler; ours resolves only torch / numpy / container classes and maps every other
global to an inert placeholder, but the tensors themselves go through torch's own
loader, so convert files you trust.

Command line: `python -m edm2_jax.main --mode=convert --src=FILE --workdir=DIR`.
"""
from __future__ import annotations

import functools
import json
import math
import os
import pickle
import zipfile
from typing import Any, Mapping, NamedTuple

import numpy as np

# Precond kwargs that the weight shapes determine; the others must come from the pickle's
# recorded init kwargs / module attributes, from `net_overrides`, or stay at the defaults.
SHAPE_FIELDS = ("img_resolution", "img_channels", "label_dim", "model_channels",
                "channel_mult", "channel_mult_noise", "channel_mult_emb", "num_blocks",
                "attn_resolutions", "logvar_channels")
HIDDEN_FIELDS = ("channels_per_head", "dropout", "res_balance", "attn_balance", "clip_act",
                 "label_balance", "concat_balance", "sigma_data")
# Positional order of the release's Precond.__init__ (for pickles that recorded init_args).
_PRECOND_POSITIONAL = ("img_resolution", "img_channels", "label_dim", "use_fp16",
                       "sigma_data", "logvar_channels")
_TORCH_HINT = "pip install edm2-jax[torch]  (or: pip install torch)"


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
# Stand-ins for the release's pickled classes.

class EasyDict(dict):
    """Stand-in for `dnnlib.util.EasyDict`: a dict with attribute access."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self[name] = value


class PersistentObject:
    """Stand-in for an object of a `torch_utils.persistence`-wrapped class.

    Holds what the pickle recorded: `class_name` (e.g. 'Precond', 'MPConv'),
    `module_src` (the authors' source, kept as text and never executed), `version` and
    `state` (the original `__dict__`: `_parameters`, `_buffers`, `_modules`,
    `_init_args`, `_init_kwargs`, plain attributes).
    """

    def __init__(self, meta: Mapping):
        self.class_name = str(meta.get("class_name", "?"))
        self.module_src = meta.get("module_src", "")
        self.version = meta.get("version")
        self.type = meta.get("type")
        self.state = dict(meta.get("state") or {})

    def __repr__(self):
        return f"<persistent {self.class_name}>"


def _reconstruct_persistent_obj(meta):
    return PersistentObject(meta)


class _Opaque:
    """Inert placeholder for any other global a pickle names (the authors' dataset or
    loss classes, functions, ...): records its arguments and state, runs nothing."""

    _global = "?"

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.items, self.list = args, kwargs, {}, []

    def __setstate__(self, state):
        self.__dict__["state"] = state

    def __setitem__(self, key, value):
        self.__dict__.setdefault("items", {})[key] = value

    def append(self, value):
        self.__dict__.setdefault("list", []).append(value)

    def extend(self, values):
        self.__dict__.setdefault("list", []).extend(values)

    def __repr__(self):
        return f"<opaque {self._global}>"


_opaque_types: dict = {}


def _opaque(module: str, name: str) -> type:
    key = f"{module}.{name}"
    if key not in _opaque_types:
        _opaque_types[key] = type(name, (_Opaque,), {"_global": key})
    return _opaque_types[key]


_SAFE_BUILTINS = {"set", "frozenset", "slice", "range", "complex", "bytearray", "bytes",
                  "object", "dict", "list", "tuple", "int", "float", "bool", "str"}


def _import_torch():
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise ImportError(f"reading PyTorch weights needs torch: {_TORCH_HINT}") from e
    return torch


class ReleaseUnpickler(pickle.Unpickler):
    """Unpickler for the release's network pickles without the authors' code.

    `torch_utils.persistence._reconstruct_persistent_obj` -> `PersistentObject`,
    `dnnlib[.util].EasyDict` -> `EasyDict`; torch, numpy, collections and a few safe
    builtins resolve normally (torch is imported on first use, ImportError naming
    `pip install edm2-jax[torch]` if absent); any other global becomes an inert
    `_Opaque` placeholder.
    """

    def find_class(self, module: str, name: str):
        root = module.split(".")[0]
        if root == "torch_utils" and name == "_reconstruct_persistent_obj":
            return _reconstruct_persistent_obj
        if root == "dnnlib" and name == "EasyDict":
            return EasyDict
        if root == "torch":
            _import_torch()
            return super().find_class(module, name)
        if root in ("numpy", "collections", "copyreg", "_codecs"):
            return super().find_class(module, name)
        if module in ("builtins", "__builtin__") and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        return _opaque(module, name)


class _PickleModule:
    """`pickle_module` for `torch.load` that uses `ReleaseUnpickler`."""
    __name__ = "edm2_jax_release_pickle"
    Unpickler = ReleaseUnpickler

    @staticmethod
    def load(f, **kwargs):
        return ReleaseUnpickler(f, **kwargs).load()


# ---------------------------------------------------------------------------------------
# Reading files.

def _to_numpy(value) -> np.ndarray:
    if isinstance(value, np.ndarray) or np.isscalar(value):
        return np.asarray(value, np.float32)
    torch = _import_torch()
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


def _strip_prefixes(sd: dict) -> dict:
    for prefix in ("w/", "module."):
        if sd and all(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix):]: v for k, v in sd.items()}
    return sd


def _is_export(obj) -> bool:
    """A Precond written by `release_state.export_network_pickle` (its state holds the
    constructor arguments and the state dict)."""
    return isinstance(obj, PersistentObject) and "edm2_jax_state_dict" in obj.state


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
        raw, net_kwargs = dict(net.state["edm2_jax_state_dict"]), dict(net.state["edm2_jax_kwargs"])
        info["class_name"] = net.class_name
    else:
        raw, modules = {}, {}
        _walk_module(net, "", raw, modules)
        net_kwargs = _net_kwargs_from_modules(modules)
        info["class_name"] = _class_name(net)
    raw = _strip_prefixes({str(k): v for k, v in raw.items()})
    dtypes = sorted({_dtype_name(v) for v in raw.values()})
    info["dtype"] = dtypes[0] if len(dtypes) == 1 else dtypes
    if "use_fp16" in net_kwargs:
        info["use_fp16"] = bool(net_kwargs.pop("use_fp16"))
    sd = {k: _to_numpy(v) for k, v in raw.items()}
    return ReleaseWeights(sd, net_kwargs, info)


def load_release(path: str) -> ReleaseWeights:
    """Read a released EDM2 network (pickle, torch state_dict, or npz; see module doc).

    Returns `ReleaseWeights(state_dict, net_kwargs, info)`; arrays float32 numpy in the
    release's layout (fp16 pickles are cast). Raises FileNotFoundError for a missing
    file, ImportError naming `pip install edm2-jax[torch]` when a PyTorch file needs
    torch, ValueError when the file holds no EDM2 Precond.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (expected an EDM2 .pkl, .pt/.pth or .npz)")
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
        if names and all(n.endswith(".npy") for n in names):
            with np.load(path) as d:
                arrays = {k: d[k] for k in d.files}
            if any(k.startswith("w/") for k in arrays):
                arrays = {k: v for k, v in arrays.items() if k.startswith("w/")}
            return _from_loaded(arrays, path, "npz")
        return _from_loaded(_torch_load(path), path, "torch")
    try:
        with open(path, "rb") as f:
            obj = ReleaseUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError,
            KeyError, UnicodeDecodeError, OverflowError) as e:
        raise ValueError(
            f"{path} is not a file this converter reads ({type(e).__name__}: {e}): expected "
            f"a released EDM2 network pickle (network-snapshot-*.pkl, edm2-*.pkl), a "
            f"torch.save'd Precond state_dict (.pt/.pth) or an .npz with the same keys; "
            f"check the file (a truncated download?)") from None
    if isinstance(obj, int) and obj == 0x1950A86A20F9469CFC6C:  # legacy torch.save format
        return _from_loaded(_torch_load(path), path, "torch")
    return _from_loaded(obj, path, "pickle")


def _torch_load(path: str):
    torch = _import_torch()
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # Not plain tensors (e.g. a pickled module): fall back to the restricted unpickler.
        return torch.load(path, map_location="cpu", weights_only=False,
                          pickle_module=_PickleModule)


def load_state_dict(path: str) -> dict[str, np.ndarray]:
    """Release `state_dict` of the Precond in `path`: key -> float32 numpy array, conv
    weights OIHW, dense `[out, in]`, as the release keeps them. See `load_release`."""
    return load_release(path).state_dict


# ---------------------------------------------------------------------------------------
# Architecture from shapes.

def _parse_res(name: str) -> int:
    res = name.split("_")[0].split("x")
    return int(res[0])


def infer_network_config(sd: Mapping[str, Any], channels_per_head: int = 64,
                         model_channels: int | None = None) -> dict:
    """Precond kwargs of a release state dict, read from its key names and shapes.

    Fields: img_resolution (top `enc.{R}x{R}_conv`), img_channels (`out_conv` outputs),
    label_dim (`emb_label` inputs, 0 without it), channel widths per level (outputs of
    each level's first decoder block) expressed as `model_channels * channel_mult`,
    channel_mult_noise / channel_mult_emb (only when they differ from the defaults
    `cblock[0]` / `max(cblock)`), num_blocks (encoder blocks at the top level),
    attn_resolutions (levels whose `_block`s have `attn_qkv`, high to low),
    logvar_channels (`logvar_fourier.freqs` length), and `channels_per_head` as given
    (it is not visible from shapes).

    `model_channels` fixes the base width when known (a pickle's init kwargs); otherwise
    it is the gcd of all widths, which gives the same network. Raises ValueError when
    the keys are not those of an EDM2 Precond or `model_channels` does not divide them.
    """
    shape = {k: tuple(np.shape(v)) for k, v in sd.items()}

    def need(key):
        if key not in shape:
            raise ValueError(f"state dict has no {key!r}: not an EDM2 Precond state_dict "
                             f"(keys like 'unet.enc.64x64_conv.weight' expected)")
        return shape[key]

    convs = [k for k in shape if k.startswith("unet.enc.") and k.endswith("_conv.weight")]
    if len(convs) != 1:
        raise ValueError(f"expected exactly one 'unet.enc.<R>x<R>_conv.weight', found {convs}: "
                         f"not an EDM2 Precond state_dict")
    top = _parse_res(convs[0][len("unet.enc."):])
    img_channels = need("unet.out_conv.weight")[0]
    dec_names = {k.split(".")[2] for k in shape if k.startswith("unet.dec.")}
    enc_names = {k.split(".")[2] for k in shape if k.startswith("unet.enc.")}
    resolutions = sorted({_parse_res(n) for n in dec_names | enc_names}, reverse=True)
    cblock = [need(f"unet.dec.{r}x{r}_block0.conv_res1.weight")[0] for r in resolutions]
    if resolutions[0] != top or any(r != top >> i for i, r in enumerate(resolutions)):
        raise ValueError(f"resolutions {resolutions} are not {top} halved per level")
    cnoise = need("unet.emb_fourier.freqs")[0]
    cemb = need("unet.emb_noise.weight")[0]
    widths = cblock + [cnoise, cemb]
    mc = model_channels or math.gcd(*widths)
    if any(w % mc for w in widths):
        raise ValueError(f"model_channels={mc} does not divide the widths in the weights "
                         f"(levels {cblock}, noise {cnoise}, embedding {cemb})")
    num_blocks = sum(1 for n in enc_names if n.startswith(f"{top}x{top}_block"))
    attn = sorted({_parse_res(k.split(".")[2]) for k in shape
                   if k.startswith(("unet.enc.", "unet.dec.")) and "_block" in k.split(".")[2]
                   and k.endswith(".attn_qkv.weight")}, reverse=True)
    label = shape.get("unet.emb_label.weight")
    cfg = dict(img_resolution=top, img_channels=img_channels,
               label_dim=label[1] if label else 0, model_channels=mc,
               channel_mult=[c // mc for c in cblock], num_blocks=num_blocks,
               attn_resolutions=attn, logvar_channels=need("logvar_fourier.freqs")[0],
               channels_per_head=channels_per_head)
    if cnoise != cblock[0]:
        cfg["channel_mult_noise"] = cnoise // mc
    if cemb != max(cblock):
        cfg["channel_mult_emb"] = cemb // mc
    return cfg


# ---------------------------------------------------------------------------------------
# Key and layout mapping.

def release_key_to_path(key: str) -> tuple[str, tuple[str, ...]]:
    """`'unet.enc.8x8_block0.conv_res0.weight'` ->
    `('params', ('unet', 'enc_8x8_block0', 'conv_res0', 'weight'))`; MPFourier
    `freqs` / `phases` go to `'buffers'`."""
    parts = key.split(".")
    if len(parts) >= 3 and parts[0] == "unet" and parts[1] in ("enc", "dec"):
        parts = [parts[0], f"{parts[1]}_{parts[2]}"] + parts[3:]
    collection = "buffers" if parts[-1] in ("freqs", "phases") else "params"
    return collection, tuple(parts)


def path_to_release_key(path: tuple[str, ...]) -> str:
    """Inverse of `release_key_to_path` (the collection is implied by the leaf name)."""
    parts = list(path)
    if len(parts) >= 2 and parts[0] == "unet" and parts[1][:4] in ("enc_", "dec_"):
        parts = [parts[0], parts[1][:3], parts[1][4:]] + parts[2:]
    return ".".join(parts)


def to_jax_layout(a: np.ndarray) -> np.ndarray:
    """Release -> this project: conv OIHW -> HWIO, dense `[out, in]` -> `[in, out]`."""
    a = np.asarray(a, np.float32)
    if a.ndim == 4:
        return np.ascontiguousarray(a.transpose(2, 3, 1, 0))
    if a.ndim == 2:
        return np.ascontiguousarray(a.T)
    return a


def to_release_layout(a) -> np.ndarray:
    """This project -> release: conv HWIO -> OIHW, dense `[in, out]` -> `[out, in]`."""
    a = np.asarray(a, np.float32)
    if a.ndim == 4:
        return np.ascontiguousarray(a.transpose(3, 2, 0, 1))
    if a.ndim == 2:
        return np.ascontiguousarray(a.T)
    return a


def _release_shape(jax_shape: tuple) -> tuple:
    s = tuple(jax_shape)
    if len(s) == 4:
        return (s[3], s[2], s[0], s[1])
    if len(s) == 2:
        return (s[1], s[0])
    return s


def _flatten(tree: Mapping, prefix: tuple = ()) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, prefix + (str(k),)))
        else:
            out[prefix + (str(k),)] = v
    return out


def _put(tree: dict, path: tuple, value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def expected_variable_shapes(net_config: Mapping) -> dict:
    """`{(collection, *path): shape}` of `Precond(**net_config)`, via `jax.eval_shape`
    (nothing is allocated; cached per config: post-hoc EMA converts one pickle per
    snapshot, all of the same network)."""
    cfg = {k: v for k, v in dict(net_config).items() if k != "dtype"}  # shapes do not depend on it
    return dict(_expected_shapes(json.dumps(cfg, sort_keys=True)))


@functools.lru_cache(maxsize=8)
def _expected_shapes(net_config_json: str) -> tuple:
    import jax
    from edm2_jax.model.networks import init_variables, precond_from_config

    net = precond_from_config(json.loads(net_config_json))
    shapes = jax.eval_shape(lambda r: init_variables(net, r), jax.random.PRNGKey(0))
    return tuple((path, tuple(leaf.shape)) for path, leaf in _flatten(shapes).items())


def _fmt(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def state_dict_to_variables(sd: Mapping[str, Any], net_config: Mapping | None = None
                            ) -> tuple[dict, dict]:
    """Release state dict -> `(net_config, variables)` of this project's `Precond`.

    `net_config` (Precond kwargs, may be partial) overrides what `infer_network_config`
    reads from the shapes; fields not visible from shapes (channels_per_head, dropout,
    balances, sigma_data, ...) keep the defaults unless given. The converted tree is
    checked against `jax.eval_shape(init_variables(precond_from_config(cfg)))`.

    Returns `net_config` (a plain JSON-able dict) and `variables`
    `{'params': ..., 'buffers': ...}` with float32 numpy leaves in this project's
    layout. Raises one ValueError listing every missing, unexpected and mis-shaped key
    (release names, release layout, expected vs got).
    """
    net_config = dict(net_config or {})
    sd = _strip_prefixes({str(k): v for k, v in sd.items()})
    cfg = infer_network_config(sd, channels_per_head=net_config.get("channels_per_head", 64),
                               model_channels=net_config.get("model_channels"))
    cfg.update(net_config)
    for k in ("channel_mult", "attn_resolutions"):
        cfg[k] = [int(v) for v in cfg[k]]

    expected = expected_variable_shapes(cfg)
    got = {}
    for key, value in sd.items():
        collection, path = release_key_to_path(key)
        got[(collection,) + path] = to_jax_layout(_to_numpy(value))

    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    wrong = sorted(p for p in set(expected) & set(got) if tuple(got[p].shape) != expected[p])
    if missing or extra or wrong:
        lines = [f"release weights do not fit Precond({_describe(cfg)}):"]
        for p in missing:
            lines.append(f"  missing     {path_to_release_key(p[1:])}: expected "
                         f"{_fmt(_release_shape(expected[p]))}")
        for p in extra:
            lines.append(f"  unexpected  {path_to_release_key(p[1:])}: "
                         f"{_fmt(_release_shape(got[p].shape))}")
        for p in wrong:
            lines.append(f"  wrong shape {path_to_release_key(p[1:])}: expected "
                         f"{_fmt(_release_shape(expected[p]))}, got "
                         f"{_fmt(_release_shape(got[p].shape))}")
        lines.append("(shapes in the release's layout: conv OIHW, dense [out, in].) Fix: "
                     "check that the file is an EDM2 Precond, or correct the architecture "
                     "with --net_overrides='{\"channel_mult\": [1, 2, 3, 4]}' "
                     "(convert.convert(..., net_overrides=...) in Python).")
        raise ValueError("\n".join(lines))

    variables: dict = {"params": {}, "buffers": {}}
    for p, value in got.items():
        _put(variables[p[0]], p[1:], value)
    return cfg, variables


def variables_to_state_dict(variables: Mapping) -> dict[str, np.ndarray]:
    """This project's `{'params', 'buffers'}` -> release state dict (float32 numpy,
    conv OIHW, dense `[out, in]`), the inverse of `state_dict_to_variables`."""
    sd = {}
    for collection in ("params", "buffers"):
        for path, value in _flatten(dict(variables.get(collection, {}))).items():
            sd[path_to_release_key(path)] = to_release_layout(value)
    return sd


def _describe(cfg: Mapping) -> str:
    return ", ".join(f"{k}={list(v) if isinstance(v, tuple) else v}" for k, v in cfg.items())


# ---------------------------------------------------------------------------------------
# Conversion to a network checkpoint.

def net_config_from_release(weights: ReleaseWeights, net_overrides: Mapping | None = None
                            ) -> dict:
    """Partial Precond kwargs to pass to `state_dict_to_variables` for `weights`.

    Precedence: shapes (applied later by `state_dict_to_variables`) < what the pickle
    recorded (the fields hidden from shapes, see `HIDDEN_FIELDS`, and the base
    `model_channels`) < `net_overrides`. Raises ValueError for recorded kwargs this
    project's Precond cannot express (e.g. a resample filter other than [1, 1]).
    """
    from edm2_jax.model.networks import Precond

    fields = {f for f in Precond.__dataclass_fields__ if f not in ("parent", "name")}
    recorded = dict(weights.net_kwargs)
    rf = recorded.pop("resample_filter", [1, 1])
    if list(rf) != [1, 1]:
        raise ValueError(f"the pickle's network uses resample_filter={list(rf)}; "
                         f"edm2_jax implements only the [1, 1] filter of the release")
    unknown = sorted(set(recorded) - fields)
    if unknown:
        raise ValueError(f"the pickle's Precond was built with {({k: recorded[k] for k in unknown})}, "
                         f"which edm2_jax.model.networks.Precond has no field for; it is not a "
                         f"network this project can reproduce")
    cfg = {k: v for k, v in recorded.items() if k in HIDDEN_FIELDS}
    if "model_channels" in recorded:
        cfg["model_channels"] = int(recorded["model_channels"])
    cfg.update(dict(net_overrides or {}))
    return cfg


def _count(tree: Mapping) -> int:
    return sum(int(np.size(v)) for v in _flatten(dict(tree)).values())


def _convert(src: str, workdir: str, net_overrides: Mapping | None):
    from edm2_jax import paths
    from edm2_jax.run import rundir
    from edm2_jax.run.network_dir import save_network

    if rundir.is_run(workdir) or paths.isdir(os.path.join(workdir, rundir.CHECKPOINTS)):
        raise FileExistsError(
            f"{workdir} is a training run directory; a network converted into it would "
            f"stand in for the run (--mode=generate --net={workdir}). Choose another "
            f"--workdir for the converted network.")
    weights = load_release(src)
    cfg, variables = state_dict_to_variables(weights.state_dict,
                                             net_config_from_release(weights, net_overrides))
    meta = dict(source=os.path.abspath(os.fspath(src)), converter="edm2_jax.release.convert",
                num_params=_count(variables["params"]),
                release_keys=len(weights.state_dict), **weights.info)
    return save_network(workdir, variables, cfg, meta=meta), cfg, variables, meta


def convert(src: str, workdir: str, net_overrides: Mapping | None = None) -> str:
    """Convert the released network `src` into a network checkpoint at `workdir`
    (written by `edm2_jax.run.network_dir.save_network`, read by `load_network`; its meta
    records the source path, format, pickle key, stored dtype and parameter count).

    `net_overrides`: Precond kwargs that win over everything read from the file (the
    weights must still fit them). Returns the absolute checkpoint path. Raises what
    `load_release` and `state_dict_to_variables` raise, and FileExistsError when
    `workdir` already holds a network checkpoint.
    """
    return _convert(src, workdir, net_overrides)[0]


def main_convert(src: str, workdir: str, net_overrides: Mapping | None = None) -> str:
    """CLI hook for `--mode=convert --src=FILE --workdir=DIR`: `convert`, then print
    what was read, the architecture and the parameter count. Returns the path."""
    path, cfg, variables, meta = _convert(src, workdir, net_overrides)
    key = f", key {meta['key']!r}" if meta.get("key") else ""
    print(f"Converted {src}")
    print(f"  read:         {meta['format']} ({meta['class_name']}{key}, "
          f"dtype {meta['dtype']} -> float32)")
    print(f"  architecture: Precond({_describe(cfg)})")
    print(f"  parameters:   {meta['num_params']:,} "
          f"(+ {_count(variables['buffers']):,} Fourier buffer values)")
    print(f"  written to:   {path}")
    return path
