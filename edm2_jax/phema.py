"""Post-hoc EMA: any power-function EMA, after training, from saved snapshots
(paper Sec. 3.2 and App. C.3, Algorithm 3; SPEC section 5).

A power-function EMA with exponent `gamma` at time `t` (images seen) averages the
training weights with the profile `p_{t,gamma}(tau) = (gamma+1) tau^gamma / t^(gamma+1)`
on `0 <= tau <= t` (App. C.1; its width `sigma_rel`, Eq. 123). Training saves snapshots of a few such EMAs
(`sigma_rel` 0.05 and 0.10 every 8Mi in the paper). Any other profile is approximated,
in the least-squares sense over `tau`, by a linear combination of the snapshots'
profiles; the same combination of the snapshots' weights is the reconstructed EMA:

    A[i, j] = <p_i, p_j>,  B[i, k] = <p_i, p_out_k>,  A X = B,
    X[:, k] /= sum(X[:, k]),  theta_out_k = sum_i X[i, k] theta_i        (Algorithm 3)

`profile_inner_products` and `solve_weights` are the float64 NumPy solver;
`reconstruct` streams the snapshots from disk, reading each one once per batch of
outputs, tensor by tensor straight from its TensorStore array (Orbax's restore as a
fallback), copied in 8 MiB chunks into float32 accumulators on a JAX device; each output
is written from its accumulator, which is then freed. Memory: the outputs plus a few
tensors. Measured peak RSS above the baseline for 8 outputs from 64 EMAs (32 snapshot
files) of img512-xxs shapes (31M parameters, 125 MB a copy; benchmarks/phema_memory.py,
CPU): 1.10 GB = 8.8 parameter copies, 8 of them the outputs (it was 12.6 when
reading through Orbax: glibc kept what Orbax's reader threads freed, see
`_mmap_large_allocations`). Throughput on 2 CPU cores (benchmarks/phema_throughput.py):
~0.5 GB/s of float32 read, ~0.3 GB/s with one output accumulated, vs ~1.2 GB/s for a
cold plain read of the (zstd-compressed) files; writing the outputs costs about as much
again when there are as many outputs as snapshot EMAs.

Inputs (`find_snapshots`):
  * a training run: `WORKDIR/snapshots/<step>/` written by
    `checkpoint_train.TrainCheckpoints.save_snapshot` (Orbax Composite: `ema` =
    `{'power': {'0.050': params, ...}}`, `meta` = JSON with `nimg`, `sigma_rels`,
    `ema_keys`). One snapshot holds every tracked EMA at `nimg = meta['nimg']`.
    Net config: `WORKDIR/config.json['network']`; MPFourier buffers: the snapshot's
    `buffers` item when present, else the latest `WORKDIR/checkpoints/<step>`.
  * imported release snapshots: a directory whose sub-directories are network checkpoints
    (`checkpoint.save_network`), one per raw power-EMA snapshot of the release, e.g.
    written by `import_release_snapshots` from the published
    `edm2-img512-xs-0134217-0.050.pkl` files. Convention for each one's time and width:
    `meta['nimg']` and `meta['sigma_rel']` when the meta has them; otherwise parsed from
    the file name in `meta['source']` (what `convert` records), else from the
    sub-directory's name, with the release's pattern `...-<kimg>-<sigma_rel>[.ext]`
    (`RELEASE_NAME_RE`) and `nimg = 1000 * kimg`. The release writes `kimg = nimg // 1000`,
    so this time is short by < 1000 images (a relative 1e-4 at its first 8Mi snapshot;
    harmless, the solution is invariant to scaling all times). Network checkpoints whose
    meta has `phema: True` (outputs of this module) are never taken as inputs.

Outputs: network checkpoints `OUT_DIR/phema-<kimg:07d>-<sigma_rel:.3f>/` (default
`OUT_DIR = WORKDIR/phema`) loadable with `checkpoint.load_network`; their meta records
`sigma_rel`, `nimg`, the input snapshots and their weights, and `profile_error` (the
relative L2 distance between the reconstructed and the wanted profile).

Per-tensor post-hoc EMA: `per_tensor=[(regex, sigma_rel), ...]` gives the parameters
whose '/'-joined path (e.g. `'unet/enc_8x8_block0/conv_res0/weight'`,
`'unet/emb_label/weight'`) matches `regex` (`re.search`, first match wins) that
`sigma_rel` instead of the output's.

Command line (wired in main.py): `python -m edm2_jax.main --mode=phema --workdir=RUN
--sigma_rels=0.05,0.075,0.10 [--at_kimg=...] [--out_dir=...] [--per_tensor='emb=0.10']`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import json
import math
import os
import re
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np

from edm2_jax import ema as ema_lib

Array = jax.Array

# Release snapshot names: `edm2-img512-xs-0134217-0.050.pkl` -> kimg 134217, sigma_rel 0.050.
RELEASE_NAME_RE = re.compile(r"-(\d+)-(\d*\.\d+)(?:\.[A-Za-z0-9]+)?$")
# Reconstructions whose profile misses the wanted one by more than this (relative L2)
# get a warning: the snapshots cannot express that sigma_rel at that time.
PROFILE_ERROR_WARN = 0.2


# --------------------------------------------------------------------------------------
# Solver (float64 NumPy)


def profile_inner_products(t_a: Any, gamma_a: Any, t_b: Any, gamma_b: Any) -> np.ndarray:
    """Inner products `<p_a, p_b> = int_0^inf p_a(tau) p_b(tau) dtau` of power-function
    EMA profiles `p_{t,gamma}(tau) = (gamma+1) tau^gamma / t^(gamma+1)`, `tau <= t`
    (Algorithm 3, `p_dot_p`; Eq. 123):

        (g_a+1)(g_b+1) (t_a/t_b)^e / ((g_a+g_b+1) max(t_a, t_b)),
        e = g_b if t_a < t_b else -g_a.

    Args: times `t_a`, `t_b` (> 0, any common unit, e.g. nimg) and exponents `gamma_a`,
      `gamma_b` (> -1/2); broadcastable arrays.
    Returns: float64 array of the broadcast shape (units 1 / time).
    """
    t_a, g_a, t_b, g_b = np.broadcast_arrays(*(np.asarray(x, np.float64)
                                               for x in (t_a, gamma_a, t_b, gamma_b)))
    e = np.where(t_a < t_b, g_b, -g_a)
    return (g_a + 1) * (g_b + 1) * (t_a / t_b) ** e / ((g_a + g_b + 1) * np.maximum(t_a, t_b))


def _gammas(sigma_rel: np.ndarray, what: str) -> np.ndarray:
    try:
        return ema_lib.sigma_rel_to_gamma(sigma_rel)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def _describe_input(nimg: float, sigma_rel: float) -> str:
    return f"(kimg {nimg / 1000:g}, sigma_rel {sigma_rel:g})"


def _ill_conditioned(A: np.ndarray, cond: float, t: np.ndarray, s: np.ndarray,
                     t_out: float, max_cond: float) -> ValueError:
    d = np.sqrt(np.diag(A))
    cos = A / d[:, None] / d[None, :]  # cosine similarity of the input profiles
    np.fill_diagonal(cos, -np.inf)
    i, j = np.unravel_index(np.argmax(cos), cos.shape)
    return ValueError(
        f"post-hoc EMA at kimg {t_out / 1000:g}: the {len(t)} input profiles are nearly "
        f"linearly dependent (condition number {cond:.3g} > max_cond {max_cond:.3g}); the "
        f"closest pair {_describe_input(t[i], s[i])} and {_describe_input(t[j], s[j])} has "
        f"cosine similarity {cos[i, j]:.12f}. Pass each snapshot once, use EMAs whose "
        f"sigma_rels differ clearly (e.g. 0.05 and 0.10), drop snapshots that nearly "
        f"coincide in time, or raise max_cond.")


def solve_weights(in_nimg: Any, in_sigma_rel: Any, out_nimg: Any, out_sigma_rel: Any, *,
                  max_cond: float = 1e12) -> np.ndarray:
    """Coefficients of the snapshots for each wanted EMA (Algorithm 3), float64.

    For each output `k` only inputs with `in_nimg <= out_nimg[k]` take part: solve
    `A X = B` in the least-squares sense with `A[i, j] = <p_i, p_j>` and
    `B[i, k] = <p_i, p_out_k>` (`profile_inner_products`), then scale each column to sum 1
    so that a constant weight is reproduced exactly. Inputs after the output time get 0.

    Args:
      in_nimg, in_sigma_rel: `[num_in]` (broadcast together) time (images seen, > 0) and
        relative width of each snapshot.
      out_nimg, out_sigma_rel: `[num_out]` (broadcast together) the wanted EMAs.
      max_cond: largest accepted condition number of `A`.
    Returns: `X` float64 `[num_in, num_out]`, columns summing to 1.
    Raises ValueError, naming the fix, for: no inputs; a `sigma_rel` outside
    `(0, ema.SIGMA_REL_MAX ~ 0.300]`; a time <= 0; an output time before every snapshot;
    the same snapshot passed twice or profiles so alike that `cond(A) > max_cond`.
    """
    t_in, s_in = (np.ravel(x) for x in np.broadcast_arrays(np.asarray(in_nimg, np.float64),
                                                          np.asarray(in_sigma_rel, np.float64)))
    t_out, s_out = (np.ravel(x) for x in np.broadcast_arrays(np.asarray(out_nimg, np.float64),
                                                            np.asarray(out_sigma_rel, np.float64)))
    if t_in.size == 0:
        raise ValueError("post-hoc EMA needs at least one snapshot, got none; train with "
                         "snapshots enabled (config.snapshot_kimg) and pass their times and "
                         "sigma_rels")
    for name, t in (("in_nimg", t_in), ("out_nimg", t_out)):
        if not np.all(np.isfinite(t) & (t > 0)):
            raise ValueError(f"{name} must be finite and > 0 (images seen), got {t}")
    g_in = _gammas(s_in, "snapshot sigma_rel")
    g_out = _gammas(s_out, "wanted sigma_rel")

    key = np.stack([t_in, g_in], 1)
    uniq, counts = np.unique(key, axis=0, return_counts=True)
    if np.any(counts > 1):
        t, g = uniq[np.argmax(counts > 1)]
        raise ValueError(f"snapshot {_describe_input(t, float(ema_lib.gamma_to_sigma_rel(g)))} "
                         f"is passed {counts.max()} times; the system is singular. Pass each "
                         f"snapshot once.")

    X = np.zeros((t_in.size, t_out.size), np.float64)
    for t in np.unique(t_out):
        use = t_in <= t
        cols = t_out == t
        if not np.any(use):
            raise ValueError(f"no snapshot at or before the wanted time kimg {t / 1000:g}; "
                             f"the first is at kimg {t_in.min() / 1000:g}. Ask for a time at "
                             f"or after it (at_kimg >= {t_in.min() / 1000:g}).")
        ti, gi = t_in[use], g_in[use]
        A = profile_inner_products(ti[:, None], gi[:, None], ti[None, :], gi[None, :])
        cond = np.linalg.cond(A)
        if not cond <= max_cond:
            raise _ill_conditioned(A, cond, ti, s_in[use], t, max_cond)
        B = profile_inner_products(ti[:, None], gi[:, None], t_out[cols][None, :],
                                   g_out[cols][None, :])
        x = np.linalg.lstsq(A, B, rcond=None)[0]
        X[np.ix_(use, cols)] = x / np.sum(x, axis=0, keepdims=True)
    return X


def profile_error(in_nimg: Any, in_sigma_rel: Any, out_nimg: Any, out_sigma_rel: Any,
                  X: np.ndarray) -> np.ndarray:
    """Relative L2 distance `||sum_i X[i,k] p_i - p_out_k|| / ||p_out_k||` between the
    reconstructed and the wanted profile of each output (float64 `[num_out]`): 0 when a
    snapshot has exactly the wanted profile. In the paper's setting (0.05 and 0.10 every
    8Mi, 16 times) 0.0035 for sigma_rel 0.075, 0.023 for 0.20, 0.12 for the sharp 0.02;
    0.69 for 0.10 from a single 0.05 snapshot. Large values mean the snapshots cannot
    express the wanted EMA (too few, one sigma_rel only, or none near the wanted time)."""
    t_in, s_in = (np.ravel(x) for x in np.broadcast_arrays(np.asarray(in_nimg, np.float64),
                                                          np.asarray(in_sigma_rel, np.float64)))
    t_out, s_out = (np.ravel(x) for x in np.broadcast_arrays(np.asarray(out_nimg, np.float64),
                                                            np.asarray(out_sigma_rel, np.float64)))
    g_in, g_out = ema_lib.sigma_rel_to_gamma(s_in), ema_lib.sigma_rel_to_gamma(s_out)
    A = profile_inner_products(t_in[:, None], g_in[:, None], t_in[None, :], g_in[None, :])
    B = profile_inner_products(t_in[:, None], g_in[:, None], t_out[None, :], g_out[None, :])
    c = profile_inner_products(t_out, g_out, t_out, g_out)
    sq = np.einsum("ik,ij,jk->k", X, A, X) - 2 * np.einsum("ik,ik->k", X, B) + c
    return np.sqrt(np.maximum(sq, 0) / c)


# --------------------------------------------------------------------------------------
# Snapshot inputs


@dataclasses.dataclass(frozen=True)
class SnapshotFile:
    """One snapshot on disk, read in one go: one or more power EMAs at time `nimg`.

    `directory` is an Orbax PyTree checkpoint; EMA `i` lives at `tree_paths[i]` in it
    (`('power', '0.050')` in a training snapshot, `('params',)` in a network checkpoint).
    """
    label: str
    nimg: int
    sigma_rels: tuple[float, ...]
    tree_paths: tuple[tuple[str, ...], ...]
    directory: str


def parse_release_name(name: str) -> tuple[int, float] | None:
    """`(nimg, sigma_rel)` from a release snapshot name `...-<kimg>-<sigma_rel>[.ext]`
    (`edm2-img512-xs-0134217-0.050.pkl` -> `(134217000, 0.05)`), or None if it does not
    match. `nimg = 1000 kimg`; the release truncates nimg to kimg in its names."""
    m = RELEASE_NAME_RE.search(os.path.basename(os.path.normpath(name)))
    return (int(m.group(1)) * 1000, float(m.group(2))) if m else None


def _network_input(path: str) -> SnapshotFile | None:
    from edm2_jax.checkpoint import is_network_checkpoint
    if not is_network_checkpoint(path):
        return None
    with open(os.path.join(path, "network.json")) as f:
        meta = json.load(f).get("meta", {}) or {}
    if meta.get("phema"):
        return None
    if "nimg" in meta and "sigma_rel" in meta:
        nimg, sigma_rel = int(meta["nimg"]), float(meta["sigma_rel"])
    else:
        parsed = parse_release_name(str(meta.get("source", ""))) or parse_release_name(path)
        if parsed is None:
            raise ValueError(
                f"{path}: cannot tell the snapshot's time and sigma_rel: its meta has no "
                f"'nimg'/'sigma_rel' and neither meta['source'] ({meta.get('source')!r}) nor "
                f"the directory name matches the release's '...-<kimg>-<sigma_rel>.pkl'. "
                f"Convert the release's raw snapshot files under their original names "
                f"(import_release_snapshots) or rename the directory like "
                f"'edm2-img512-xs-0134217-0.050'.")
        nimg, sigma_rel = parsed
    return SnapshotFile(label=os.path.basename(os.path.normpath(path)), nimg=nimg,
                        sigma_rels=(sigma_rel,), tree_paths=(("params",),),
                        directory=os.path.join(path, "variables"))


def find_snapshots(workdir: str) -> tuple[str, list[SnapshotFile]]:
    """The snapshots in `workdir` (see the module docstring for the two layouts).

    Returns `(kind, files)` with kind `'run'` or `'networks'` and files sorted by nimg.
    Raises FileNotFoundError naming both layouts when there are none.
    """
    workdir = os.path.abspath(os.path.expanduser(workdir))
    snap_dir = os.path.join(workdir, "snapshots")
    if os.path.isdir(snap_dir) and os.listdir(snap_dir):
        from edm2_jax import checkpoint_train as ct
        files = []
        for step, meta in ct.list_snapshots(workdir):
            by_key = {ema_lib.ema_key(s): float(s) for s in meta["sigma_rels"]}
            keys = [k for k in meta["ema_keys"] if k in by_key]
            files.append(SnapshotFile(
                label=f"snapshots/{step}", nimg=int(meta["nimg"]),
                sigma_rels=tuple(by_key[k] for k in keys),
                tree_paths=tuple(("power", k) for k in keys),
                directory=os.path.join(snap_dir, str(step), "ema")))
        if files:
            return "run", sorted(files, key=lambda f: f.nimg)
    files = []
    if os.path.isdir(workdir):
        for name in sorted(os.listdir(workdir)):
            f = _network_input(os.path.join(workdir, name))
            if f is not None:
                files.append(f)
    if not files:
        hint = ""
        if glob.glob(os.path.join(workdir, "*.pkl")):
            hint = (" It holds .pkl files: convert them first with "
                    "phema.import_release_snapshots(WORKDIR, OUT) and pass OUT.")
        raise FileNotFoundError(
            f"no post-hoc EMA inputs in {workdir}: expected a training run with "
            f"snapshots/<step>/ (config.snapshot_kimg) or sub-directories that are network "
            f"checkpoints of release snapshots named like 'edm2-img512-xs-0134217-0.050'."
            + hint)
    return "networks", sorted(files, key=lambda f: (f.nimg, f.sigma_rels))


def import_release_snapshots(src_dir: str, out_dir: str) -> list[str]:
    """Convert every release raw snapshot in `src_dir` (`*-<kimg>-<sigma_rel>.pkl`, also
    `.pt` / `.npz`) into a network checkpoint `out_dir/<file name without extension>/`
    with `edm2_jax.convert.convert` (already converted ones are kept). `out_dir` is then
    a valid `workdir` for `reconstruct`. Returns the checkpoint paths, sorted. Raises
    FileNotFoundError if `src_dir` has no such files."""
    from edm2_jax import convert
    from edm2_jax.checkpoint import is_network_checkpoint
    srcs = sorted(p for p in glob.glob(os.path.join(src_dir, "*"))
                  if os.path.isfile(p) and parse_release_name(p)
                  and p.endswith((".pkl", ".pt", ".pth", ".npz")))
    if not srcs:
        raise FileNotFoundError(f"{src_dir}: no release snapshots named like "
                                f"'edm2-img512-xs-0134217-0.050.pkl'")
    out = []
    from tqdm import tqdm
    for src in tqdm(srcs, desc="import snapshots", unit="file"):
        dst = os.path.join(out_dir, os.path.splitext(os.path.basename(src))[0])
        out.append(dst if is_network_checkpoint(dst) else convert.convert(src, dst))
    return sorted(out)


# --------------------------------------------------------------------------------------
# Reading Orbax trees


def _quiet_orbax():
    """absl logging at ERROR at most: Orbax logs every restore and save at INFO/WARNING
    ('Metadata file does not exist', 'Skipping merge of OCDBT checkpoints'). (absl's
    verbosity grows with verbosity: ERROR -2 < WARNING -1 < INFO 0.)"""
    from absl import logging
    if logging.get_verbosity() > logging.ERROR:
        logging.set_verbosity(logging.ERROR)


def _tree_metadata(directory: str) -> dict:
    import orbax.checkpoint as ocp
    md = ocp.PyTreeCheckpointer().metadata(directory)
    md = getattr(md, "item_metadata", md)
    return dict(getattr(md, "tree", md))


def _subtree(tree: dict, path: tuple[str, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _restore_partial(directory: str, paths: Sequence[tuple[str, ...]],
                     md: dict | None = None) -> list:
    """The sub-trees at `paths` of the Orbax PyTree checkpoint `directory` as host numpy
    arrays (nothing else in the file is read). `md`: its `_tree_metadata`, if known."""
    import orbax.checkpoint as ocp
    md = md if md is not None else _tree_metadata(directory)
    item: dict = {}
    for path in paths:
        node = item
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = _subtree(md, path)
    restore_args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), item)
    r = ocp.PyTreeCheckpointer().restore(directory, args=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True))
    return [_subtree(r, path) for path in paths]


def _latest_step_dir(root: str) -> list[str]:
    steps = [int(n) for n in os.listdir(root) if n.isdigit()] if os.path.isdir(root) else []
    return [os.path.join(root, str(s)) for s in sorted(steps, reverse=True)]


def _run_network(workdir: str) -> tuple[dict, dict]:
    """`(net_config, buffers)` of a training run (numpy buffers)."""
    cfg_path = os.path.join(workdir, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{cfg_path} is missing; post-hoc EMA of a training run needs "
                                f"the run's config.json (written by train_and_evaluate)")
    with open(cfg_path) as f:
        net_config = json.load(f)["network"]
    for d in _latest_step_dir(os.path.join(workdir, "snapshots")):
        if os.path.isdir(os.path.join(d, "buffers")):
            return net_config, _restore_all(os.path.join(d, "buffers"))
    for d in _latest_step_dir(os.path.join(workdir, "checkpoints")):
        item = os.path.join(d, "default")
        if os.path.isdir(item) and "buffers" in _tree_metadata(item):
            return net_config, _restore_partial(item, [("buffers",)])[0]
    raise FileNotFoundError(
        f"no MPFourier buffers for the run in {workdir}: its snapshots carry none and "
        f"{workdir}/checkpoints holds no train state. Keep at least one state checkpoint "
        f"(or save snapshots with buffers=state['buffers']).")


def _restore_all(directory: str) -> dict:
    import orbax.checkpoint as ocp
    return jax.device_get(ocp.PyTreeCheckpointer().restore(directory))


def _networks_network(files: Sequence[SnapshotFile]) -> tuple[dict, dict]:
    """`(net_config, buffers)` shared by imported network checkpoints (from the first)."""
    path = os.path.dirname(files[0].directory)
    with open(os.path.join(path, "network.json")) as f:
        net_config = json.load(f)["network"]
    buffers = _restore_partial(files[0].directory, [("buffers",)])[0] \
        if "buffers" in _tree_metadata(files[0].directory) else {}
    return net_config, buffers


# --------------------------------------------------------------------------------------
# Streaming reconstruction


def parse_per_tensor(spec: str | Sequence | None) -> list[tuple[str, float]]:
    """`'REGEX=SIGMA_REL;REGEX=SIGMA_REL'` (`,` also separates items when the spec has no
    `;`) or a list of pairs -> `[(regex, sigma_rel), ...]`. Raises ValueError for a
    malformed item, a bad regex or a sigma_rel out of range."""
    if not spec:
        return []
    if isinstance(spec, str):
        items = [s for s in spec.split(";" if ";" in spec else ",") if s.strip()]
        pairs = []
        for it in items:
            if "=" not in it:
                raise ValueError(f"per_tensor item {it!r} is not REGEX=SIGMA_REL "
                                 f"(e.g. 'emb_label=0.10;enc_64x64=0.05')")
            regex, _, s = it.rpartition("=")
            try:
                pairs.append((regex.strip(), float(s)))
            except ValueError:
                raise ValueError(f"per_tensor item {it!r}: {s!r} is not a number") from None
    else:
        pairs = [(str(r), float(s)) for r, s in spec]
    for regex, s in pairs:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"per_tensor regex {regex!r} is invalid: {e}") from None
        _gammas(np.asarray(s), f"per_tensor sigma_rel for {regex!r}")
    return pairs


def _leaf_keys(tree: Any) -> list[tuple[str, ...]]:
    """Key path of each leaf of a nested dict, in `jax.tree.leaves` order."""
    return [tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _leaf_groups(paths: Sequence[str], per_tensor: Sequence[tuple[str, float]]) -> tuple:
    """Group of each leaf: 0 = the output's sigma_rel, j+1 = per_tensor[j] (first match)."""
    groups, used = [], [0] * len(per_tensor)
    for p in paths:
        g = 0
        for j, (regex, _) in enumerate(per_tensor):
            if re.search(regex, p):
                g = j + 1
                used[j] += 1
                break
        groups.append(g)
    unused = [per_tensor[j][0] for j, n in enumerate(used) if n == 0]
    if unused:
        raise ValueError(f"per_tensor regex(es) {unused} match no parameter (or only ones an "
                         f"earlier regex took); parameter paths look like {paths[:3]}")
    return tuple(groups)


# Elements per accumulation call (8 MiB). The outputs are flat float32 vectors, each
# per-tensor group a contiguous range; a snapshot EMA is copied in chunk by chunk, so one
# jitted function of a few fixed shapes serves every tensor (a jitted function per tensor
# shape, or one over the whole tree, costs ~15 s of XLA:CPU compile for img512-xxs) and
# the EMA is never held twice.
_CHUNK = 1 << 21
# An EMA is read from its Orbax checkpoint in about this many parts (each at least one
# chunk), so that at most ~1/8 of it is in memory at a time (`_EmaReader`, the fallback).
_PARTS = 8
# `_TensorStoreReader` reads at most this many bytes of tensors ahead (at least one).
_PREFETCH = 1 << 24


@dataclasses.dataclass(frozen=True)
class _FlatLayout:
    """Where each tensor of a params tree lives in the flat output vectors.

    Tensor `n` (in `jax.tree.leaves` order, key path `keys[n]`) sits at `offsets[n]`;
    group `g` (0: each output's own sigma_rel, g > 0: per_tensor[g-1]) holds the tensors
    `members[g]` back to back from `starts[g]`; `size` elements in all.
    """
    treedef: Any
    keys: tuple
    shapes: tuple
    offsets: tuple
    members: tuple
    starts: tuple
    size: int

    def chunks(self, get_leaf: Callable[[int], np.ndarray]):
        """Yield `(offset, group, chunk)`: consecutive float32 pieces of the flat vector
        (`_CHUNK` long, shorter at the end of a group) filled from `get_leaf(n)`, which
        is called once per tensor, in layout order. The chunks are views of one buffer
        per group: use each before asking for the next."""
        for g, members in enumerate(self.members):
            size = sum(math.prod(self.shapes[n]) for n in members)
            if not size:
                continue
            offset, pos = self.starts[g], 0
            buf = np.empty(min(_CHUNK, size), np.float32)
            for n in members:
                flat, i = np.asarray(get_leaf(n)).reshape(-1), 0
                while i < flat.size:
                    take = min(len(buf) - pos, flat.size - i)
                    buf[pos:pos + take] = flat[i:i + take]
                    pos, i = pos + take, i + take
                    if pos == len(buf):
                        yield offset, g, buf
                        offset, pos = offset + pos, 0
                del flat
            if pos:
                yield offset, g, buf[:pos]
            del buf

    def unflatten(self, flat: np.ndarray) -> Any:
        """The params tree as views into the host vector `flat`."""
        return self.treedef.unflatten([
            flat[o:o + math.prod(shape)].reshape(shape)
            for o, shape in zip(self.offsets, self.shapes)])


def _flat_layout(tree: Any, per_tensor: Sequence[tuple[str, float]]) -> _FlatLayout:
    """Layout of `tree` (leaves with `.shape`: arrays or Orbax array metadata)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = _leaf_keys(tree)
    groups = _leaf_groups(["/".join(k) for k in keys], per_tensor)
    offsets, members, starts, pos = [0] * len(leaves), [], [], 0
    for g in range(1 + len(per_tensor)):
        starts.append(pos)
        members.append(tuple(n for n in range(len(leaves)) if groups[n] == g))
        for n in members[-1]:
            offsets[n] = pos
            pos += math.prod(leaves[n].shape)
    return _FlatLayout(treedef, tuple(keys), tuple(tuple(x.shape) for x in leaves),
                       tuple(offsets), tuple(members), tuple(starts), pos)


class _EmaReader:
    """`get_leaf(n)` for `_FlatLayout.chunks`: reads the EMA at `tree_path` of the Orbax
    checkpoint `directory` in about `_PARTS` parts, in layout order, and drops each tensor
    once handed out, so at most one part is in memory."""

    def __init__(self, directory: str, md: dict, tree_path: tuple, layout: _FlatLayout):
        self.directory, self.md, self.tree_path, self.layout = directory, md, tree_path, layout
        order = [n for members in layout.members for n in members]
        part = max(_CHUNK, -(-layout.size // _PARTS))
        self.part_of, p, filled = {}, 0, 0
        for n in order:
            if filled >= part:
                p, filled = p + 1, 0
            self.part_of[n] = p
            filled += math.prod(layout.shapes[n])
        self.loaded: dict = {}

    def __call__(self, n: int) -> np.ndarray:
        if n not in self.loaded:
            _release_free_memory()  # the previous part, freed in TensorStore's arenas
            part = [m for m, p in self.part_of.items() if p == self.part_of[n]]
            trees = _restore_partial(self.directory,
                                     [self.tree_path + self.layout.keys[m] for m in part],
                                     self.md)
            self.loaded.update(zip(part, trees))
        return self.loaded.pop(n)


def _ts_context():
    """A TensorStore context for `_TensorStoreReader`: no data cache (every tensor is read
    once), a small cache for OCDBT B-tree nodes, few threads (each keeps a glibc arena)."""
    import tensorstore as ts
    return ts.Context({"cache_pool": {"total_bytes_limit": 0},
                       "cache_pool#ocdbt": {"total_bytes_limit": 8 << 20},
                       "data_copy_concurrency": {"limit": 2},
                       "file_io_concurrency": {"limit": 4}})


def _orbax_tree_keys(directory: str) -> tuple[list[tuple[str, ...]], bool] | None:
    """`(key paths of the arrays, use_zarr3)` of the Orbax PyTree checkpoint `directory`,
    from its `_METADATA` file; None when that is missing or not understood. (Orbax's
    `metadata()` also opens every array, and keeps ~2.6 MB of memory per call for good:
    0.6 parameter copies of img512-xxs over 32 snapshot files.)"""
    try:
        with open(os.path.join(directory, "_METADATA")) as f:
            meta = json.load(f)
        keys = [tuple(str(k["key"]) for k in v["key_metadata"])
                for v in meta["tree_metadata"].values()]
        return keys, bool(meta.get("use_zarr3", False))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _orbax_array_spec(directory: str, name: str, use_zarr3: bool) -> dict:
    """TensorStore spec of the array Orbax stored as `name` ('.'-joined key path) in the
    PyTree checkpoint `directory`: zarr (v2, or v3 if `use_zarr3`) in its OCDBT
    key-value store (`manifest.ocdbt`) or, without one, in the sub-directory `name`."""
    directory = os.path.abspath(directory)
    if os.path.isfile(os.path.join(directory, "manifest.ocdbt")):
        kvstore = {"driver": "ocdbt", "base": "file://" + directory + "/", "path": name + "/",
                   "cache_pool": "cache_pool#ocdbt"}
    else:
        kvstore = {"driver": "file", "path": os.path.join(directory, name) + "/"}
    return {"driver": "zarr3" if use_zarr3 else "zarr", "kvstore": kvstore}


class _StructureError(ValueError):
    """A snapshot EMA whose tensors differ from the first snapshot's."""


class _TensorStoreReader:
    """`get_leaf(n)` for `_FlatLayout.chunks` that reads each tensor of the EMA at
    `tree_path` straight from its TensorStore array in the Orbax checkpoint `directory`
    (Orbax's restore reads a whole sub-tree at once, with many threads, and the memory
    they free stays in glibc's per-thread arenas). Tensors are requested in layout order,
    the next ones prefetched while the current one is accumulated, at most `_PREFETCH`
    bytes ahead, and dropped once handed out.

    Raises, before reading any data, `_StructureError` when a tensor has another shape
    than `layout` says, and ValueError when an array cannot be opened (`_make_reader`
    then falls back to Orbax)."""

    def __init__(self, directory: str, tree_path: tuple, layout: _FlatLayout, context,
                 use_zarr3: bool):
        import tensorstore as ts
        self.order = [n for members in layout.members for n in members]
        opens = [ts.open(_orbax_array_spec(directory, ".".join(tree_path + layout.keys[n]),
                                           use_zarr3),
                         open=True, read=True, context=context) for n in self.order]
        self.stores = {}
        for n, fut in zip(self.order, opens):
            try:
                store = fut.result()
            except Exception as e:  # noqa: BLE001 (TensorStore raises ValueError et al.)
                raise ValueError(f"{directory}: cannot open {'/'.join(layout.keys[n])} with "
                                 f"TensorStore: {e}") from e
            if tuple(store.shape) != tuple(layout.shapes[n]):
                raise _StructureError(f"{'/'.join(layout.keys[n])} has shape "
                                      f"{tuple(store.shape)}, not {layout.shapes[n]}")
            self.stores[n] = store
        self.next, self.pending, self.ahead = 0, {}, 0
        self.nbytes = {n: math.prod(layout.shapes[n]) * 4 for n in self.order}

    def _prefetch(self) -> None:
        while self.next < len(self.order) and (
                not self.pending or self.ahead + self.nbytes[self.order[self.next]] <= _PREFETCH):
            n = self.order[self.next]
            self.pending[n] = self.stores.pop(n).read()
            self.ahead += self.nbytes[n]
            self.next += 1

    def __call__(self, n: int) -> np.ndarray:
        self._prefetch()
        arr = self.pending.pop(n).result()
        self.ahead -= self.nbytes[n]
        self._prefetch()
        return arr


_warned_fallback = False


def _make_reader(f: SnapshotFile, tree_path: tuple, layout: _FlatLayout, context,
                 tree_keys: tuple | None):
    """A reader (`get_leaf`) of the EMA at `tree_path` in snapshot `f` after checking that
    it has `layout`'s tensors (else `_StructureError`): a `_TensorStoreReader`, or the
    Orbax `_EmaReader` (slower, more memory) when the arrays cannot be opened directly
    (an Orbax layout not known here; warns once). `tree_keys`: `_orbax_tree_keys(f)`."""
    global _warned_fallback
    if tree_keys is not None:
        n = len(tree_path)
        keys = sorted(k[n:] for k in tree_keys[0] if k[:n] == tree_path)
        if keys != sorted(layout.keys):
            raise _StructureError(f"{len(keys)} tensors, not the {len(layout.keys)} "
                                  f"expected, or other names")
        try:
            return _TensorStoreReader(f.directory, tree_path, layout, context, tree_keys[1])
        except _StructureError:
            raise
        except ValueError as e:
            if not _warned_fallback:
                _warned_fallback = True
                warnings.warn(f"post-hoc EMA: reading through Orbax's restore instead ({e})",
                              stacklevel=3)
    md = _tree_metadata(f.directory)
    ema_md = _subtree(md, tree_path)
    if _leaf_keys(ema_md) != list(layout.keys) or [
            tuple(m.shape) for m in jax.tree.leaves(ema_md)] != list(layout.shapes):
        raise _StructureError("other tensor names or shapes")
    return _EmaReader(f.directory, md, tree_path, layout)


@functools.lru_cache(maxsize=None)
def _libc():
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def _release_free_memory() -> None:
    """Hand freed heap memory back to the OS (glibc `malloc_trim`; no-op elsewhere).
    Orbax/TensorStore read with many threads, and glibc keeps what they free in
    per-thread arenas: without this the RSS grows by ~0.7 of an EMA per snapshot read
    through Orbax's restore."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


# glibc `mallopt` parameter number of M_MMAP_THRESHOLD (malloc.h); the threshold while
# reading snapshots, and glibc's ceiling for its dynamic one, restored afterwards.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 20
_MMAP_THRESHOLD_MAX = 32 << 20


@contextlib.contextmanager
def _mmap_large_allocations():
    """While reading snapshots, let glibc serve allocations of >= 1 MiB with their own
    mmap (M_MMAP_THRESHOLD; no-op elsewhere), so that the tensors TensorStore's threads
    decode go back to the OS when freed instead of fragmenting per-thread arenas (reading
    32 snapshot EMAs of img512-xxs, the RSS crept up by ~0.4 parameter copies without
    this, ~0.05 with it). A fixed 1 MiB costs a page fault per 4 KiB of each fresh large
    buffer, small next to decoding it, but would slow XLA's per-step temporaries later
    on; glibc's dynamic threshold (128 KiB rising to 32 MiB with use) cannot be switched
    back on, so afterwards the threshold is set to its usual steady state, 32 MiB."""
    libc = _libc()
    ok = libc is not None and hasattr(libc, "mallopt")
    if ok:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    try:
        yield
    finally:
        if ok:
            libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)


class _Accumulators:
    """The flat float32 outputs of one batch on a JAX `device`: `add(offset, chunk, w)`
    does `acc[k][offset:offset + len(chunk)] += w[k] * chunk` for every output `k` with
    the jitted, donating `_axpy`, one chunk in flight (so the EMA is never held twice on
    the host). (NumPy in place on the host measured 1.4x slower than this on a CPU
    device, for ~0.3 parameter copies less memory.)"""

    def __init__(self, n: int, size: int, device):
        self.device = device
        self.acc = [jax.device_put(np.zeros(size, np.float32), device) for _ in range(n)]

    def weights(self, w: np.ndarray) -> Array:
        return jax.device_put(np.asarray(w, np.float32), self.device)

    def add(self, offset: int, chunk: np.ndarray, w: Array) -> None:
        self.acc = list(_axpy(tuple(self.acc), jax.device_put(chunk, self.device), w,
                              np.int32(offset)))
        jax.block_until_ready(self.acc)

    def pop_host(self, k: int) -> np.ndarray:
        """Output `k` on the host (a view of the accumulator on a CPU device, else one
        host copy); the accumulator is dropped."""
        flat, self.acc[k] = np.asarray(self.acc[k]), None
        return flat


@functools.partial(jax.jit, donate_argnums=0)
def _axpy(acc: tuple, x: Array, w: Array, offset: Array) -> tuple:
    """`acc[k][offset:offset + len(x)] += w[k] * x` for each output `k`, float32;
    `acc` is donated (updated in place)."""
    return tuple(jax.lax.dynamic_update_slice(
        a, jax.lax.dynamic_slice(a, (offset,), x.shape) + w[k] * x, (offset,))
        for k, a in enumerate(acc))


def output_name(nimg: float, sigma_rel: float, per_tensor: Sequence = ()) -> str:
    """`phema-<kimg:07d>-<sigma_rel:.3f>` (the release's naming), plus
    `-pt<hash of per_tensor>` for per-tensor reconstructions."""
    name = f"phema-{int(nimg // 1000):07d}-{sigma_rel:.3f}"
    if per_tensor:
        h = hashlib.sha1(json.dumps([list(p) for p in per_tensor]).encode()).hexdigest()[:8]
        name += f"-pt{h}"
    return name


def reconstruct(workdir: str, sigma_rels: Sequence[float], at_kimg: float | None = None,
                out_dir: str | None = None, batch_outputs: int = 8,
                per_tensor: Sequence[tuple[str, float]] | str | None = None, *,
                in_sigma_rels: Sequence[float] | None = None, max_cond: float = 1e12,
                device=None, exist_ok: bool = False, progress: bool = True) -> list[str]:
    """Reconstruct power-function EMAs of the given widths from the snapshots in
    `workdir` (Algorithm 3) and write each as a network checkpoint.

    Args:
      workdir: a training run or a directory of imported release snapshots (module doc).
      sigma_rels: wanted widths, each in `(0, ema.SIGMA_REL_MAX]`.
      at_kimg: time of the outputs in kimg; default the last snapshot's. Snapshots after
        it are not used (nor read).
      out_dir: where outputs go; default `WORKDIR/phema`.
      batch_outputs: outputs accumulated per pass over the snapshots (memory: this many
        parameter copies, float32, on `device`, plus a few tensors of one snapshot).
      per_tensor: `[(regex, sigma_rel), ...]` or `'REGEX=S;REGEX=S'` (`parse_per_tensor`):
        parameters whose path matches take that sigma_rel (first match wins).
      in_sigma_rels: use only snapshot EMAs of these widths (default all).
      max_cond: see `solve_weights`.
      device: JAX device to accumulate on (default `jax.devices()[0]`).
      exist_ok: an output that already exists is kept (and returned) if its meta lists
        the same inputs, else FileExistsError; False: any existing output raises before
        anything is read.
      progress: tqdm bars.
    Returns: the output paths, in the order of `sigma_rels`.
    Raises FileNotFoundError (no snapshots, no config/buffers), FileExistsError, and the
    ValueErrors of `solve_weights` / `parse_per_tensor`.
    """
    from tqdm import tqdm

    from edm2_jax.checkpoint import is_network_checkpoint, save_network

    _quiet_orbax()
    workdir = os.path.abspath(os.path.expanduser(workdir))
    sigma_rels = [float(s) for s in np.atleast_1d(sigma_rels)]
    if not sigma_rels:
        raise ValueError("reconstruct needs at least one sigma_rel")
    _gammas(np.asarray(sigma_rels), "wanted sigma_rel")
    per_tensor = parse_per_tensor(per_tensor)
    if batch_outputs < 1:
        raise ValueError(f"batch_outputs must be >= 1, got {batch_outputs}")
    device = device or jax.devices()[0]

    kind, files = find_snapshots(workdir)
    if in_sigma_rels is not None:
        keep = {ema_lib.ema_key(s) for s in in_sigma_rels}
        files = [dataclasses.replace(
            f, sigma_rels=tuple(s for s in f.sigma_rels if ema_lib.ema_key(s) in keep),
            tree_paths=tuple(p for s, p in zip(f.sigma_rels, f.tree_paths)
                             if ema_lib.ema_key(s) in keep)) for f in files]
        files = [f for f in files if f.sigma_rels]
        if not files:
            raise ValueError(f"no snapshot EMA has sigma_rel in {list(in_sigma_rels)}")
    inputs = [(fi, j) for fi, f in enumerate(files) for j in range(len(f.sigma_rels))]
    in_nimg = np.array([files[fi].nimg for fi, _ in inputs], np.float64)
    in_sigma = np.array([files[fi].sigma_rels[j] for fi, j in inputs], np.float64)
    out_nimg = float(in_nimg.max()) if at_kimg is None else float(at_kimg) * 1000

    # Columns: the wanted sigma_rels, then one per per-tensor group.
    col_sigma = np.array(sigma_rels + [s for _, s in per_tensor], np.float64)
    X = solve_weights(in_nimg, in_sigma, out_nimg, col_sigma, max_cond=max_cond)
    err = profile_error(in_nimg, in_sigma, out_nimg, col_sigma, X)
    for s, e in zip(col_sigma, err):
        if e > PROFILE_ERROR_WARN:
            warnings.warn(
                f"post-hoc EMA sigma_rel {s:g} at kimg {out_nimg / 1000:g}: the snapshots "
                f"reproduce its profile only to a relative error of {e:.3f}; save snapshots "
                f"more often or nearer that time, or track two different sigma_rels that "
                f"bracket it", stacklevel=2)
    net_config, buffers = _run_network(workdir) if kind == "run" else _networks_network(files)

    out_dir = os.path.abspath(os.path.expanduser(out_dir or os.path.join(workdir, "phema")))
    names = [output_name(out_nimg, s, per_tensor) for s in sigma_rels]
    if len(set(names)) != len(names):
        raise ValueError(f"sigma_rels {sigma_rels} give clashing output names {names}; pass "
                         f"values that differ in the first 3 decimals")
    paths = [os.path.join(out_dir, n) for n in names]
    used = np.flatnonzero(np.any(X != 0, axis=1))
    labels = [f"{files[inputs[i][0]].label}:{in_sigma[i]:.3f}" for i in used]

    def meta_of(k: int) -> dict:
        groups = [{"regex": r, "sigma_rel": s, "weights": X[used, len(sigma_rels) + j].tolist(),
                   "profile_error": float(err[len(sigma_rels) + j])}
                  for j, (r, s) in enumerate(per_tensor)]
        return {"phema": True, "sigma_rel": sigma_rels[k], "nimg": out_nimg,
                "kimg": out_nimg / 1000, "source": workdir, "inputs": labels,
                "input_nimg": in_nimg[used].tolist(), "input_sigma_rel": in_sigma[used].tolist(),
                "weights": X[used, k].tolist(), "profile_error": float(err[k]),
                "per_tensor": groups}

    todo = []
    for k, p in enumerate(paths):
        if is_network_checkpoint(p):
            if not exist_ok:
                raise FileExistsError(f"{p} already exists; remove it, choose another "
                                      f"out_dir, or pass exist_ok=True to keep it")
            if load_network_meta(p).get("inputs") != labels:
                raise FileExistsError(f"{p} exists but was made from other snapshots; remove "
                                      f"it or choose another out_dir")
        else:
            todo.append(k)

    with _mmap_large_allocations():
        for b0 in range(0, len(todo), batch_outputs):
            batch = todo[b0:b0 + batch_outputs]
            cols = np.array(batch + [len(sigma_rels) + j for j in range(len(per_tensor))])
            acc, nbytes, t0 = None, 0, time.time()  # acc[j]: flat output batch[j]
            active = [fi for fi in range(len(files))
                      if any(np.any(X[i, cols] != 0)
                             for i, (f2, _) in enumerate(inputs) if f2 == fi)]
            bar = tqdm(active, desc=f"phema {b0 // batch_outputs + 1}/"
                       f"{math.ceil(len(todo) / batch_outputs)}", unit="snapshot",
                       disable=not progress, dynamic_ncols=True)
            for fi in bar:
                f = files[fi]
                rows = [i for i, (f2, _) in enumerate(inputs) if f2 == fi]
                rows = [i for i in rows if np.any(X[i, cols] != 0)]
                tree_keys = _orbax_tree_keys(f.directory)
                context = _ts_context()  # one per file: a shared one grows by ~0.4 MB a file
                for i in rows:
                    tree_path = f.tree_paths[inputs[i][1]]
                    if acc is None:  # the layout from the first EMA read
                        layout = _flat_layout(_subtree(_tree_metadata(f.directory), tree_path),
                                              per_tensor)
                        acc = _Accumulators(len(batch), layout.size, device)
                    try:
                        reader = _make_reader(f, tree_path, layout, context, tree_keys)
                    except _StructureError as e:
                        raise ValueError(
                            f"{f.label}: the EMA at {'/'.join(tree_path)} has other tensors "
                            f"than the first snapshot ({e}); all snapshots must come from the "
                            f"same network") from None
                    # w[g]: weights of this input in the batch's outputs for tensor group g
                    # (0: each output's own sigma_rel, g > 0: per_tensor[g - 1]'s).
                    w = [X[i, batch]] + [np.full(len(batch), X[i, len(sigma_rels) + g])
                                         for g in range(len(per_tensor))]
                    w = [acc.weights(wg) for wg in w]
                    for offset, g, chunk in layout.chunks(reader):
                        acc.add(offset, chunk, w[g])
                        nbytes += chunk.nbytes
                        del chunk
                    del reader
                    _release_free_memory()
                del context
                bar.set_postfix_str(f"{nbytes / max(time.time() - t0, 1e-9) / 1e9:.2f} GB/s")
            bar.close()
            # Write the outputs one at a time, each straight from its accumulator (views of
            # it on the host), and drop each accumulator as soon as it is written: the first
            # output costs no more than the accumulators themselves.
            for j, k in enumerate(batch):
                flat = acc.pop_host(j)
                save_network(paths[k], {"params": layout.unflatten(flat), "buffers": buffers},
                             net_config, meta_of(k), low_memory=True)
                del flat
                _release_free_memory()
            del acc
    return paths


def load_network_meta(path: str) -> dict:
    with open(os.path.join(path, "network.json")) as f:
        return json.load(f).get("meta", {}) or {}


def main_phema(workdir: str, sigma_rels: Sequence[float], at_kimg: float | None = None,
               out_dir: str | None = None, per_tensor: str | None = None) -> list[str]:
    """CLI hook for `--mode=phema`: `reconstruct`, then print one line per output
    (sigma_rel, kimg, profile error, path). Returns the paths."""
    kind, files = find_snapshots(workdir)
    n_ema = sum(len(f.sigma_rels) for f in files)
    print(f"Post-hoc EMA from {len(files)} snapshot file(s) ({n_ema} EMAs, kimg "
          f"{files[0].nimg / 1000:g}..{files[-1].nimg / 1000:g}) in {workdir}")
    paths = reconstruct(workdir, sigma_rels, at_kimg=at_kimg, out_dir=out_dir,
                        per_tensor=per_tensor)
    for p in paths:
        m = load_network_meta(p)
        print(f"  sigma_rel {m['sigma_rel']:.3f}  kimg {m['kimg']:g}  profile error "
              f"{m['profile_error']:.4f}  {len(m['inputs'])} inputs  -> {p}")
    return paths


# --------------------------------------------------------------------------------------
# Sweep


def run_data_config(workdir: str) -> dict | None:
    """The `data` section of a training run's `WORKDIR/config.json` (the reference data
    of a sweep's metric when no `--config` is given), or None when there is none."""
    path = os.path.join(os.path.abspath(os.path.expanduser(workdir)), "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        data = json.load(f).get("data")
    return dict(data) if isinstance(data, dict) and data.get("source") else None


def sweep(workdir: str, sigma_rels: Sequence[float], metric_fn: Callable[[str], float], *,
          at_kimg: float | None = None, out_dir: str | None = None,
          metric_name: str = "metric", per_tensor=None) -> tuple[str, str]:
    """Reconstruct each sigma_rel (reusing matching outputs already on disk), evaluate
    `metric_fn(network_checkpoint_path) -> float` on each, and write
    `OUT_DIR/sweep-<kimg>-<metric_name>.csv` (columns sigma_rel, kimg, metric_name,
    profile_error, path) and a `.png` plot of the metric against sigma_rel (the paper's
    Fig. 5a style, lower assumed better; the best point is marked) and print the best.

    Returns `(csv_path, png_path)`; `png_path` is None, with a warning naming
    `pip install matplotlib`, when matplotlib is missing.
    """
    import csv
    paths = reconstruct(workdir, sigma_rels, at_kimg=at_kimg, out_dir=out_dir,
                        per_tensor=per_tensor, exist_ok=True)
    rows = []
    for s, p in zip(sigma_rels, paths):
        value = float(metric_fn(p))
        m = load_network_meta(p)
        rows.append({"sigma_rel": float(s), "kimg": m["kimg"], metric_name: value,
                     "profile_error": m["profile_error"], "path": p})
        print(f"  sigma_rel {s:.3f}  {metric_name} {value:.6g}")
    base = os.path.join(os.path.dirname(paths[0]),
                        f"sweep-{int(rows[0]['kimg']):07d}-{metric_name}")
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    best_row = min(rows, key=lambda r: r[metric_name])
    edge = best_row["sigma_rel"] in (min(sigma_rels), max(sigma_rels)) and len(rows) > 2
    print(f"best sigma_rel {best_row['sigma_rel']:.3f} ({metric_name} "
          f"{best_row[metric_name]:.6g})"
          + (" at the edge of the swept range: extend it to find the minimum" if edge else ""))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn(f"sweep wrote {base}.csv but no plot: pip install matplotlib",
                      stacklevel=2)
        return base + ".csv", None
    xs = [r["sigma_rel"] for r in rows]
    ys = [r[metric_name] for r in rows]
    order = np.argsort(xs)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(np.asarray(xs)[order], np.asarray(ys)[order], "o-")
    best = int(np.argmin(ys))
    ax.plot([xs[best]], [ys[best]], "r*", ms=12, label=f"best sigma_rel {xs[best]:.3f}")
    ax.set_xlabel("EMA length sigma_rel")
    ax.set_ylabel(metric_name)
    ax.set_title(f"post-hoc EMA sweep at kimg {rows[0]['kimg']:g}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=100)
    plt.close(fig)
    return base + ".csv", base + ".png"
