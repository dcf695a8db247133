"""Reading snapshot EMAs tensor by tensor, in bounded memory, for post-hoc EMA.

Owns:
  * `FlatLayout`: where each tensor of a params tree sits in the flat float32 output
    vectors (grouped by per-tensor sigma_rel), and the fixed-size chunks (`_CHUNK`) an
    EMA is copied in;
  * the readers of one snapshot EMA (`ema_tree` gives its tensors' shapes):
    `_TensorStoreReader` opens each tensor's array
    straight from its TensorStore (zarr in OCDBT, or Orbax's per-array layout) and reads
    them in layout order with a bounded prefetch (`_PREFETCH`); `_EmaReader`, the
    fallback, reads through Orbax's restore in about `_PARTS` parts; `_PickleReader`
    serves a release network pickle, read whole; `make_reader` checks the EMA's tensors
    against the layout and picks one.

The library leaves the process's allocator alone; how the host allocator affects the
memory of reading many snapshots is for the entry point (`edm2_jax/process.py`).

Measured memory and throughput: benchmarks/README.md, "Post-hoc EMA".
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np
import tensorstore as ts
from absl import logging

from edm2_jax.run import network_dir as ckpt_lib
from edm2_jax import paths
from edm2_jax.ema.inputs import SnapshotFile, release_pickle_variables

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


def quiet_orbax():
    """absl logging at ERROR at most: Orbax logs every restore and save at INFO/WARNING
    ('Metadata file does not exist', 'Skipping merge of OCDBT checkpoints'). (absl's
    verbosity grows with verbosity: ERROR -2 < WARNING -1 < INFO 0.)"""
    if logging.get_verbosity() > logging.ERROR:
        logging.set_verbosity(logging.ERROR)


# --------------------------------------------------------------------------------------
# Layout of the flat outputs


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


@dataclasses.dataclass(frozen=True)
class FlatLayout:
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


def flat_layout(tree: Any, per_tensor: Sequence[tuple[str, float]]) -> FlatLayout:
    """Layout of `tree` (leaves with `.shape`: arrays or Orbax array metadata)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = ckpt_lib.key_paths(tree)
    groups = _leaf_groups(["/".join(k) for k in keys], per_tensor)
    offsets, members, starts, pos = [0] * len(leaves), [], [], 0
    for g in range(1 + len(per_tensor)):
        starts.append(pos)
        members.append(tuple(n for n in range(len(leaves)) if groups[n] == g))
        for n in members[-1]:
            offsets[n] = pos
            pos += math.prod(leaves[n].shape)
    return FlatLayout(treedef, tuple(keys), tuple(tuple(x.shape) for x in leaves),
                      tuple(offsets), tuple(members), tuple(starts), pos)


# --------------------------------------------------------------------------------------
# Readers


class _EmaReader:
    """`get_leaf(n)` for `FlatLayout.chunks`: reads the EMA at `tree_path` of the Orbax
    checkpoint `directory` in about `_PARTS` parts, in layout order, and drops each tensor
    once handed out, so at most one part is in memory."""

    def __init__(self, directory: str, md: dict, tree_path: tuple, layout: FlatLayout):
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
            part = [m for m, p in self.part_of.items() if p == self.part_of[n]]
            trees = ckpt_lib.restore_partial(
                self.directory, [self.tree_path + self.layout.keys[m] for m in part], self.md)
            self.loaded.update(zip(part, trees))
        return self.loaded.pop(n)


def ts_context():
    """A TensorStore context for `_TensorStoreReader`: no data cache (every tensor is read
    once), a small cache for OCDBT B-tree nodes, few threads (each keeps a glibc arena).
    Use one per snapshot file: a shared one grows by ~0.4 MB a file."""
    return ts.Context({"cache_pool": {"total_bytes_limit": 0},
                       "cache_pool#ocdbt": {"total_bytes_limit": 8 << 20},
                       "data_copy_concurrency": {"limit": 2},
                       "file_io_concurrency": {"limit": 4}})


def orbax_tree_keys(directory: str) -> tuple[list[tuple[str, ...]], bool] | None:
    """`(key paths of the arrays, use_zarr3)` of the Orbax PyTree checkpoint `directory`,
    from its `_METADATA` file; None when that is missing or not understood. (Orbax's
    `metadata()` also opens every array, and keeps ~2.6 MB of memory per call for good:
    0.6 parameter copies of img512-xxs over 32 snapshot files.)"""
    try:
        meta = json.loads(paths.read_text(os.path.join(directory, "_METADATA")))
        keys = [tuple(str(k["key"]) for k in v["key_metadata"])
                for v in meta["tree_metadata"].values()]
        return keys, bool(meta.get("use_zarr3", False))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _orbax_array_spec(directory: str, name: str, use_zarr3: bool) -> dict:
    """TensorStore spec of the array Orbax stored as `name` ('.'-joined key path) in the
    PyTree checkpoint `directory`: zarr (v2, or v3 if `use_zarr3`) in its OCDBT
    key-value store (`manifest.ocdbt`) or, without one, in the sub-directory `name`."""
    directory = paths.normalize(directory)
    url = directory if paths.is_url(directory) else "file://" + directory  # gs:// as is
    if paths.isfile(os.path.join(directory, "manifest.ocdbt")):
        kvstore = {"driver": "ocdbt", "base": url + "/", "path": name + "/",
                   "cache_pool": "cache_pool#ocdbt"}
    elif paths.is_url(directory):
        kvstore = os.path.join(directory, name) + "/"
    else:
        kvstore = {"driver": "file", "path": os.path.join(directory, name) + "/"}
    return {"driver": "zarr3" if use_zarr3 else "zarr", "kvstore": kvstore}


class StructureError(ValueError):
    """A snapshot EMA whose tensors differ from the first snapshot's."""


class _TensorStoreReader:
    """`get_leaf(n)` for `FlatLayout.chunks` that reads each tensor of the EMA at
    `tree_path` straight from its TensorStore array in the Orbax checkpoint `directory`
    (Orbax's restore reads a whole sub-tree at once, with many threads, and the memory
    they free stays in glibc's per-thread arenas). Tensors are requested in layout order,
    the next ones prefetched while the current one is accumulated, at most `_PREFETCH`
    bytes ahead, and dropped once handed out.

    Raises, before reading any data, `StructureError` when a tensor has another shape
    than `layout` says, and ValueError when an array cannot be opened (`make_reader`
    then falls back to Orbax)."""

    def __init__(self, directory: str, tree_path: tuple, layout: FlatLayout, context,
                 use_zarr3: bool):
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
                raise StructureError(f"{'/'.join(layout.keys[n])} has shape "
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


def ema_tree(f: SnapshotFile, tree_path: tuple) -> Any:
    """The EMA at `tree_path` of snapshot `f` as a tree whose leaves have `.shape`: Orbax
    array metadata, or (a release pickle, held in memory anyway) the arrays."""
    if f.fmt == "pickle":
        return ckpt_lib.subtree(release_pickle_variables(f.directory)[1], tree_path)
    return ckpt_lib.subtree(ckpt_lib.tree_metadata(f.directory), tree_path)


class _PickleReader:
    """`get_leaf(n)` of the EMA at `tree_path` of a release network pickle, read whole
    (as the release does; `inputs.release_pickle_variables`). Raises `StructureError`
    when its tensors differ from `layout`'s."""

    def __init__(self, path: str, tree_path: tuple, layout: FlatLayout):
        tree = ckpt_lib.subtree(release_pickle_variables(path)[1], tree_path)
        keys = ckpt_lib.key_paths(tree)
        shapes = [tuple(x.shape) for x in jax.tree.leaves(tree)]
        if keys != list(layout.keys) or shapes != list(layout.shapes):
            raise StructureError("other tensor names or shapes")
        self.leaves = jax.tree.leaves(tree)

    def __call__(self, n: int) -> np.ndarray:
        return self.leaves[n]


_warned_fallback = False


def make_reader(f: SnapshotFile, tree_path: tuple, layout: FlatLayout, context,
                tree_keys: tuple | None):
    """A reader (`get_leaf`) of the EMA at `tree_path` in snapshot `f` after checking that
    it has `layout`'s tensors (else `StructureError`): a `_TensorStoreReader`, or the
    Orbax `_EmaReader` (slower, more memory) when the arrays cannot be opened directly
    (an Orbax layout not known here; warns once); a `_PickleReader` for a release pickle.
    `tree_keys`: `orbax_tree_keys(f)`; `context`: `ts_context()`."""
    global _warned_fallback
    if f.fmt == "pickle":
        return _PickleReader(f.directory, tree_path, layout)
    if tree_keys is not None:
        n = len(tree_path)
        keys = sorted(k[n:] for k in tree_keys[0] if k[:n] == tree_path)
        if keys != sorted(layout.keys):
            raise StructureError(f"{len(keys)} tensors, not the {len(layout.keys)} "
                                 f"expected, or other names")
        try:
            return _TensorStoreReader(f.directory, tree_path, layout, context, tree_keys[1])
        except StructureError:
            raise
        except ValueError as e:
            if not _warned_fallback:
                _warned_fallback = True
                warnings.warn(f"post-hoc EMA: reading through Orbax's restore instead ({e})",
                              stacklevel=3)
    md = ckpt_lib.tree_metadata(f.directory)
    ema_md = ckpt_lib.subtree(md, tree_path)
    if ckpt_lib.key_paths(ema_md) != list(layout.keys) or [
            tuple(m.shape) for m in jax.tree.leaves(ema_md)] != list(layout.shapes):
        raise StructureError("other tensor names or shapes")
    return _EmaReader(f.directory, md, tree_path, layout)
