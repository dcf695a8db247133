"""Reference statistics of a data set, computed once and cached (as the classifier is).

`fid` / `fd_dinov2` without `--ref` compare against the feature statistics of
`num_images` images of the `--config` data (`fid.stats_from_source_multi`): minutes on a
CPU for 2,000 images, the same figures every time. They are cached per metric in

    <cache>/refstats/<source>-<metric>-<hash>.npz      (cache: $EDM2_JAX_CACHE or ~/.cache/edm2_jax)

where the hash covers everything the statistics depend on (`cache_key`): the data
config (source, path, split, resolution, ...), the opened source (name, size, image
shape, and the name, size and modification time of every file under its path), the
VAE that decodes latent data, the number of images and the seed of their subset, the
metric, its feature network's weights file (path, size, modification time) and the
JAX backend. A different data set, subset or network computes new statistics instead
of reusing old ones.

Each file holds the statistics (`FeatureStats.state()`), the key they were computed
for and a SHA-256 of both; on read the key and the checksum are checked (and the
statistics' shapes and finiteness): a file that fails is not trusted, one line says
so, and the statistics are computed again and the file replaced. Files are written to
a temporary name and renamed, so a reader never sees half of one.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import zipfile
from typing import Any, Callable

import jax
import numpy as np

from edm2_jax import paths
from edm2_jax.evaluation import fid
from edm2_jax.evaluation.classifier import default_cache_dir
from edm2_jax.evaluation.stats import FeatureStats

CACHE_VERSION = 1  # bump when the statistics of the same key change meaning
SUBDIR = "refstats"
IRRELEVANT_DATA_FIELDS = ("num_workers",)  # data config fields that change no image


def file_identity(path: str | None) -> list:
    """`[relative name, size, mtime_ns]` of the file `path`, or of every file under the
    directory `path` (sorted); `[path]` for a URL; `[]` for None or a missing path."""
    if not path:
        return []
    if paths.is_url(str(path)):
        return [str(path)]
    path = os.path.abspath(os.path.expanduser(str(path)))
    if os.path.isfile(path):
        st = os.stat(path)
        return [[os.path.basename(path), st.st_size, st.st_mtime_ns]]
    out = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            st = os.stat(full)
            out.append([os.path.relpath(full, path), st.st_size, st.st_mtime_ns])
    return out


def source_identity(source: Any) -> dict:
    """What identifies the images of an opened data `source`: name, size, image shape,
    and the files (`file_identity`) of the source it wraps, if any (`XFlip`, a
    `DecodedSource`, whose VAE is added)."""
    base = source
    while getattr(base, "path", None) is None and getattr(base, "source", None) is not None:
        base = base.source
    path = getattr(base, "path", None)
    vae = getattr(source, "vae", None)
    out = {"name": str(getattr(source, "name", type(source).__name__)), "len": len(source),
           "resolution": getattr(base, "resolution", None),
           "channels": getattr(base, "num_channels", None),
           "encoder": getattr(base, "encoder", "none"),
           "path": os.path.abspath(path) if path and not paths.is_url(str(path)) else path,
           "files": file_identity(path)}
    if vae is not None:
        vae_path = getattr(vae, "path", None)
        out["vae"] = {"path": vae_path, "files": file_identity(vae_path)}
    return out


def cache_key(metric: str, weights: str | None, source: Any, data_config: Any,
              num_images: int | None, seed: int = 0) -> str:
    """The JSON text (sorted keys) of everything the `metric` statistics of `num_images`
    images of `source` depend on (see the module doc); `weights` is the feature
    network's weights file."""
    return json.dumps({
        "version": CACHE_VERSION, "metric": metric,
        "weights": {"path": os.path.abspath(weights) if weights else None,
                    "files": file_identity(weights)},
        "data_config": {k: v for k, v in dict(data_config or {}).items()
                        if k not in IRRELEVANT_DATA_FIELDS},
        "source": source_identity(source),
        "num_images": num_images, "seed": int(seed), "backend": jax.default_backend(),
    }, sort_keys=True, default=str)


def cache_path(metric: str, key: str, source: Any, cache_dir: str | None = None) -> str:
    """The file of the `metric` statistics of `key` (`cache_key`) of `source`."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(getattr(source, "name", "data")).split("[")[0])
    return os.path.join(cache_dir or default_cache_dir(), SUBDIR, f"{name}-{metric}-{digest}.npz")


def _checksum(key: str, state: dict) -> str:
    h = hashlib.sha256(key.encode())
    for k in ("num_items", "mean", "scatter"):
        a = np.ascontiguousarray(state[k])
        h.update(f"{k}{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def save(path: str, key: str, stats: FeatureStats) -> None:
    """Write `stats` computed for `key` to `path` (temporary file, then rename)."""
    state = stats.state()
    buf = io.BytesIO()
    np.savez(buf, key=np.asarray(key), checksum=np.asarray(_checksum(key, state)), **state)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: str, key: str) -> FeatureStats:
    """The statistics cached at `path` for `key`. Raises ValueError naming what is wrong
    when the file is unreadable, of another key, fails its checksum or holds statistics
    that are not finite or do not fit together."""
    try:
        with np.load(path) as z:
            saved = {k: z[k] for k in z.files}
        saved_key, checksum = str(saved.pop("key")), str(saved.pop("checksum"))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"unreadable ({type(e).__name__})") from None
    if saved_key != key:
        raise ValueError("computed for other data or settings")
    if _checksum(key, saved) != checksum:
        raise ValueError("checksum mismatch")
    stats = FeatureStats.from_state(saved)
    if stats.num_items < 2 or not np.all(np.isfinite(saved["scatter"])):
        raise ValueError("statistics not finite or of fewer than 2 images")
    return stats


def cached_stats_from_source(source: Any, extractors: dict[str, tuple[Any, Callable]],
                             weights: dict[str, str | None], data_config: Any,
                             num_images: int | None, seed: int = 0, progress: bool = True,
                             log: Callable[[str], Any] = print,
                             cache_dir: str | None = None) -> dict[str, FeatureStats]:
    """`fid.stats_from_source_multi(source, extractors, num_images, seed=seed)`, each
    metric's statistics read from the cache when there and sound, the others computed in
    one pass over the data and cached. `weights`: `{metric: weights file}` of each
    extractor; `data_config`: the data section `source` was opened from (with its
    split). One line per metric says where its statistics come from (or, for a cache
    file that fails its checks, why it is replaced; for a cache that cannot be written,
    why they are not kept)."""
    out: dict[str, FeatureStats] = {}
    todo: dict[str, tuple[str, str]] = {}
    for metric in extractors:
        key = cache_key(metric, weights.get(metric), source, data_config, num_images, seed)
        path = cache_path(metric, key, source, cache_dir)
        if os.path.isfile(path):
            try:
                out[metric] = load(path, key)
                log(f"Reference statistics ({metric}) of {out[metric].num_items} images of "
                    f"{getattr(source, 'name', 'the data')}: read from the cache {path}")
                continue
            except ValueError as e:
                log(f"Reference statistics cache {path} is not trusted ({e}); computing them "
                    f"again")
        todo[metric] = (key, path)
    if todo:
        computed = fid.stats_from_source_multi(
            source, {m: extractors[m] for m in todo}, num_images=num_images, seed=seed,
            progress=progress)
        for metric, (key, path) in todo.items():
            try:
                save(path, key, computed[metric])
                log(f"Reference statistics ({metric}) cached in {path}")
            except OSError as e:  # a read-only or full cache costs the next eval, not this
                log(f"Reference statistics ({metric}) not cached ({e}); set $EDM2_JAX_CACHE "
                    f"to a writable directory to keep them")
        out.update(computed)
    return {m: out[m] for m in extractors}
