"""Frechet Inception Distance as the EDM2 release reports it (paper Sec. 5; docs/recipe.md §7).

FID (Heusel et al. 2017, Eq. 6) between generated images and a dataset is the Frechet
distance between Gaussians fitted to their Inception-v3 pool_3 features
(`inception.features_uint8`: uint8 RGB, TF1-bilinear resized to 299x299):
`|mu_g - mu_r|^2 + tr(sigma_g + sigma_r - 2 (sigma_g sigma_r)^(1/2))`, means and N - 1
covariances accumulated in float64 batch by batch (`stats.FeatureStats`), the square root
by `scipy.linalg.sqrtm`, real part (`stats.frechet_distance`). The paper reports the
minimum over three sets of 50,000 generated images.

Reference statistics come from a dataset (`stats_from_source`) or from the release's
files: `.pkl` as written by its `calculate_metrics.py ref` (`img64.pkl`, `img512.pkl` of
its `dataset-refs`: a dict `{'num_images': N, 'fid': {'mu': [2048], 'sigma': [2048, 2048]},
'fd_dinov2': {...}}`) or the EDM (v1) `.npz` with `mu` and `sigma`, their arrays made by
`encoders.safe_arrays` (plain numeric dtypes, exactly the bytes present).

    params = inception.load_inception_params()
    ref = load_ref_stats('img64.pkl')                     # (mu, sigma)
    fid = compute_fid(batches_of_uint8_nhwc, ref, params)
"""
from __future__ import annotations

import os
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
from tqdm import tqdm

from edm2_jax.encoders import safe_arrays
from edm2_jax.evaluation import inception
from edm2_jax.evaluation.stats import FeatureStats, check_covariance, frechet_distance

__all__ = ["FeatureStats", "compute_fid", "fid_from_stats", "frechet_distance",
           "load_ref_stats", "save_ref_stats", "stats_from_images", "stats_from_source",
           "stats_from_source_multi"]

RefStats = Any  # (mu, sigma) | FeatureStats | dict | str | os.PathLike


def _batch_images(batch) -> np.ndarray:
    """The images of one batch: an array, `{'image'|'images': array, ...}`, or
    `(images, labels)` (the forms the release's metric loop accepts)."""
    if isinstance(batch, dict):
        for key in ("image", "images"):
            if key in batch:
                return np.asarray(batch[key])
        raise ValueError(f"batch dict has no 'image' / 'images' entry (keys {list(batch)})")
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return np.asarray(batch[0])
    return np.asarray(batch)


def stats_from_images(batches: Iterable, params,
                      feature_fn: Callable = inception.features_uint8) -> FeatureStats:
    """Feature statistics of a stream of image batches.

    Args:
      batches: iterable of uint8 NHWC batches `[n, H, W, C]` (C = 3, or 1 for grayscale),
        optionally wrapped as dicts with 'image' or as `(images, labels)`.
      params: Inception params (`inception.load_inception_params()`).
      feature_fn: `(params, images) -> [n, D]`; default the FID features.
    Returns: `FeatureStats` (float64 mean and N - 1 covariance). A batch smaller than the
      first one (the last) is zero-padded to the first batch's size and the padding rows
      dropped, so the jitted extractor compiles once.
    Raises ValueError (from the extractor) on bad images; `FeatureStats.cov()` needs
      at least 2 images.
    """
    stats = FeatureStats()
    batch_size = None
    for batch in batches:
        images = _batch_images(batch)
        n = len(images)
        if n == 0:
            continue
        if batch_size is None:
            batch_size = n
        if n < batch_size:
            pad = np.zeros((batch_size - n,) + images.shape[1:], images.dtype)
            images = np.concatenate([images, pad])
        feats = np.asarray(feature_fn(params, images), np.float64)[:n]
        stats.append(feats)
    return stats


def stats_from_source(source, params, num_images: int | None = None, batch_size: int = 64,
                      seed: int = 0, feature_fn: Callable = inception.features_uint8,
                      progress: bool = True) -> FeatureStats:
    """Reference statistics of a dataset (any `edm2_jax.data` Source: `source[i]` is
    `(uint8 [H, W, C], label)`), like the release's `calculate_metrics.py ref`.

    Args: num_images: use a random subset of this many images (chosen with
      `np.random.RandomState(seed)`, then taken in index order), None = all; batch_size:
      images per extractor call; progress: a start line and a tqdm bar (img, ETA).
    Returns: `FeatureStats`.
    Raises ValueError if the source has fewer than 2 images or fewer than `num_images`.
    """
    return stats_from_source_multi(source, {"features": (params, feature_fn)}, num_images,
                                   batch_size, seed, progress)["features"]


def stats_from_source_multi(source, extractors: dict[str, tuple[Any, Callable]],
                            num_images: int | None = None, batch_size: int = 64,
                            seed: int = 0, progress: bool = True) -> dict[str, FeatureStats]:
    """`stats_from_source` for several feature extractors in one pass over the data
    (the release's `ref` computes FID and FD_DINOv2 statistics together).

    Args: extractors: `{metric: (params, feature_fn)}`, e.g. `{'fid': (inception params,
      inception.features_uint8), 'fd_dinov2': (net, dinov2.features_uint8)}`; the rest as
      `stats_from_source`.
    Returns: `{metric: FeatureStats}`. Raises ValueError as `stats_from_source`.
    """
    n = len(source)
    idx = np.arange(n)
    if num_images is not None:
        if num_images > n:
            raise ValueError(f"{getattr(source, 'name', 'source')} has {n} images, fewer than "
                             f"num_images={num_images}")
        if num_images < n:
            np.random.RandomState(seed % (1 << 31)).shuffle(idx)
            idx = np.sort(idx[:num_images])
    if len(idx) < 2:
        raise ValueError(f"reference statistics need at least 2 images, got {len(idx)}")
    stats = {m: FeatureStats() for m in extractors}
    name = getattr(source, "name", type(source).__name__)
    if progress:
        print(f"Reference statistics ({', '.join(extractors)}) of {len(idx)} images of "
              f"{name}", flush=True)
    bar = tqdm(total=len(idx), unit="img", desc="reference", disable=not progress,
               dynamic_ncols=True)
    for start in range(0, len(idx), batch_size):
        images = np.stack([source[int(i)][0] for i in idx[start:start + batch_size]])
        if len(images) < batch_size and start > 0:  # pad: one compilation per extractor
            pad = np.zeros((batch_size - len(images),) + images.shape[1:], images.dtype)
            padded = np.concatenate([images, pad])
        else:
            padded = images
        for m, (params, feature_fn) in extractors.items():
            feats = np.asarray(feature_fn(params, padded), np.float64)[:len(images)]
            stats[m].append(feats)
        bar.update(len(images))
    bar.close()
    return stats


class _ForbiddenGlobal(pickle.UnpicklingError, ValueError):
    """A statistics pickle names a class outside `_StatsUnpickler._ALLOWED`."""


class _StatsUnpickler(pickle.Unpickler):
    """Reads statistics pickles: dicts (builtin types, which no BUILD changes) and numpy
    arrays made by `safe_arrays.NUMPY_GLOBALS` (plain numeric dtypes, exactly the bytes
    present); nothing executable."""
    _ALLOWED = {**safe_arrays.NUMPY_GLOBALS, ("collections", "OrderedDict"): OrderedDict,
                ("builtins", "dict"): dict, ("dnnlib.util", "EasyDict"): dict}

    def find_class(self, module, name):
        found = self._ALLOWED.get((module, name))
        if found is None:
            raise _ForbiddenGlobal(f"statistics pickle refers to {str(module)[:80]}."
                                   f"{str(name)[:80]}; only dicts of numpy arrays are read")
        return found


def _mu_sigma(entry, where: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        mu, sigma = np.asarray(entry["mu"], np.float64), np.asarray(entry["sigma"], np.float64)
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{where}: expected 'mu' and 'sigma' entries") from e
    if mu.ndim != 1 or sigma.shape != (mu.size, mu.size):
        raise ValueError(f"{where}: mu must be [D] and sigma [D, D], got {mu.shape}, "
                         f"{sigma.shape}")
    if not (np.all(np.isfinite(mu)) and np.all(np.isfinite(sigma))):
        raise ValueError(f"{where}: mu or sigma holds NaN or Inf; re-download or recompute "
                         f"the reference statistics")
    check_covariance(sigma, where)
    return mu, sigma


def load_ref_stats(path: str | os.PathLike,
                   metric: str = "fid") -> tuple[np.ndarray, np.ndarray]:
    """Read reference statistics `(mu float64 [D], sigma float64 [D, D])`.

    `.pkl`: the release's layout `{'fid': {'mu', 'sigma'}, ...}` (entry `metric`) or a
    plain `{'mu', 'sigma'}` dict; `.npz`: arrays `mu` and `sigma` (EDM v1 refs). Local
    files only (download the release's refs, e.g. `dataset-refs/img64.pkl`, yourself).
    Raises FileNotFoundError, or ValueError for another suffix, a missing `metric`
    entry, or malformed arrays.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reference statistics file {path} not found")
    suffix = path.suffix.lower()
    if suffix not in (".npz", ".pkl"):
        raise ValueError(f"reference statistics must be .pkl or .npz, got {path}")
    try:
        if suffix == ".npz":
            data = safe_arrays.read_npz(path, "the .npz")
        else:
            with open(path, "rb") as f:
                data = _StatsUnpickler(f).load()
    except _ForbiddenGlobal as e:
        raise _ForbiddenGlobal(f"{path}: {e}") from None
    except (pickle.UnpicklingError, EOFError, OSError, ValueError, TypeError, KeyError,
            IndexError, UnicodeDecodeError, zipfile.BadZipFile, RecursionError) as e:
        raise ValueError(
            f"reference statistics file {path} is unreadable ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:400]}): expected the release's dataset-refs .pkl or "
            f"an .npz with arrays mu and sigma; re-download or recompute it (--mode=eval "
            f"without --ref computes them from --config's data)") from None
    if suffix == ".npz":
        return _mu_sigma(data, str(path))
    if isinstance(data, dict) and metric in data:
        return _mu_sigma(data[metric], f"{path}[{metric!r}]")
    if isinstance(data, dict) and "mu" in data:
        return _mu_sigma(data, str(path))
    keys = list(data) if isinstance(data, dict) else type(data).__name__
    raise ValueError(f"{path} has no {metric!r} statistics (found {keys}); compute them with "
                     f"--mode=ref --metrics={metric} --ref=OUT.pkl, or drop --ref to compute "
                     f"them from --config's data")


def save_ref_stats(path: str | os.PathLike, stats: FeatureStats | dict[str, FeatureStats],
                   metric: str = "fid") -> None:
    """Write statistics in the release's layout (what its `calculate_metrics.py ref`
    writes and `load_ref_stats` reads): `.pkl` -> `{'num_images': N, metric: {'mu': float64
    [D], 'sigma': float64 [D, D]}, ...}`, `.npz` -> arrays `mu`, `sigma` (one metric only).

    Args: stats: one `FeatureStats` (stored under `metric`) or `{metric: FeatureStats}`
      for several (e.g. `{'fid': ..., 'fd_dinov2': ...}`, the release's `img512.pkl`).
    Raises ValueError for another suffix, several metrics in an `.npz`, statistics of
    different image counts, or fewer than 2 images.
    """
    path = Path(path)
    by_metric = dict(stats) if isinstance(stats, dict) else {metric: stats}
    counts = {m: s.num_items for m, s in by_metric.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"statistics of different image counts {counts} cannot share one file")
    entries = {m: dict(zip(("mu", "sigma"), s.mean_cov())) for m, s in by_metric.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".npz":
        if len(entries) != 1:
            raise ValueError(f"an .npz holds one metric's mu and sigma; write {sorted(entries)} "
                             f"to a .pkl instead")
        np.savez(path, **next(iter(entries.values())))
    elif path.suffix.lower() == ".pkl":
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            pickle.dump({"num_images": next(iter(counts.values())), **entries}, f)
        os.replace(tmp, path)  # never a half-written reference file
    else:
        raise ValueError(f"save_ref_stats writes .pkl or .npz, got {path}")


def _as_mu_sigma(ref: RefStats, metric: str = "fid") -> tuple[np.ndarray, np.ndarray]:
    if isinstance(ref, (str, os.PathLike)):
        return load_ref_stats(ref, metric)
    if isinstance(ref, FeatureStats):
        return ref.mean_cov()
    if isinstance(ref, dict):
        return _mu_sigma(ref.get(metric, ref), "reference statistics dict")
    mu, sigma = ref
    return np.asarray(mu, np.float64), np.asarray(sigma, np.float64)


def fid_from_stats(stats: RefStats, ref: RefStats, metric: str = "fid") -> float:
    """Frechet distance between two sets of statistics, each a `(mu, sigma)` pair, a
    `FeatureStats`, a stats dict, or a `.pkl` / `.npz` path (its `metric` entry: `fid`,
    or `fd_dinov2` for FD_DINOv2). Raises ValueError on mismatched shapes."""
    return frechet_distance(*_as_mu_sigma(stats, metric), *_as_mu_sigma(ref, metric))


def compute_fid(gen_images: Iterable, ref: RefStats, params) -> float:
    """FID of generated images against reference statistics.

    Args: gen_images: iterable of uint8 NHWC batches (see `stats_from_images`); ref:
      reference statistics (see `fid_from_stats`); params: Inception params.
    Returns: FID as a Python float. The paper uses 50,000 generated images; fewer give a
      biased (higher) value.
    """
    return fid_from_stats(stats_from_images(gen_images, params), ref)
