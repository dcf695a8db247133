"""The released EDM2 weights (NVlabs/edm2, PyTorch) in this project's layout, and back.

State-dict keys are the release's (`unet.enc.8x8_block0.attn_qkv.weight`), arrays
float32 numpy in the release's layout (conv OIHW, dense `[out, in]`), as `pickle_io`
reads them. In this project (see `model/networks.py`) the same weights live at
`params['unet']['enc_8x8_block0']['attn_qkv']['weight']`, convs HWIO and dense
`[in, out]`; `MPFourier` `freqs` / `phases` go to the `'buffers'` collection. The
`attn_qkv` output channels keep the release's [head][channel-in-head][q, k, v] order
(docs/recipe.md §2), so the conversion is a renaming plus a transpose.

Owns the architecture read from shapes (`infer_network_config`), the key and layout
mapping (`release_key_to_path`, `to_jax_layout`, ... ; `state_dict_to_variables`,
`variables_to_state_dict`), the Precond kwargs of a release network
(`net_config_from_release`) and, last, `convert` / `main_convert`: a release network into
a network checkpoint (`run.network_dir`).

Command line: `python -m edm2_jax.main --mode=convert --src=FILE --workdir=DIR`.
"""
from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Mapping

import jax
import numpy as np

from edm2_jax import paths
from edm2_jax.model.networks import CONFIG_FIELDS, init_variables, precond_from_config
from edm2_jax.release.pickle_io import ReleaseWeights, load_release, strip_prefixes, to_numpy
from edm2_jax.run import layout
from edm2_jax.run.network_dir import save_network

# Precond kwargs that the weight shapes determine; the others must come from the pickle's
# recorded init kwargs / module attributes, from `net_overrides`, or stay at the defaults.
SHAPE_FIELDS = ("img_resolution", "img_channels", "label_dim", "model_channels",
                "channel_mult", "channel_mult_noise", "channel_mult_emb", "num_blocks",
                "attn_resolutions", "logvar_channels")
HIDDEN_FIELDS = ("channels_per_head", "dropout", "res_balance", "attn_balance", "clip_act",
                 "label_balance", "concat_balance", "sigma_data")


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
    sd = strip_prefixes({str(k): v for k, v in sd.items()})
    cfg = infer_network_config(sd, channels_per_head=net_config.get("channels_per_head", 64),
                               model_channels=net_config.get("model_channels"))
    cfg.update(net_config)
    for k in ("channel_mult", "attn_resolutions"):
        cfg[k] = [int(v) for v in cfg[k]]

    expected = expected_variable_shapes(cfg)
    got = {}
    for key, value in sd.items():
        collection, path = release_key_to_path(key)
        got[(collection,) + path] = to_jax_layout(to_numpy(value))

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
    fields = set(CONFIG_FIELDS)
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
    if layout.is_run(workdir) or paths.isdir(os.path.join(workdir, layout.CHECKPOINTS)):
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
