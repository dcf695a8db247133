"""Orbax items as host arrays, and the network checkpoint format.

Owns:
  * reading any Orbax PyTree item of this project as host NumPy arrays, whatever mesh and
    number of processes wrote it (`restore_numpy`, `restore_partial`, `tree_metadata`),
    and the key paths Orbax names its arrays by (`key_paths`, `subtree`);
  * network checkpoints (`save_network` / `load_network` / `read_network_json`): one set
    of network variables `{'params', 'buffers'}` plus the network config as JSON: what
    `convert` writes, what post-hoc EMA reconstruction outputs, and what `generate` /
    `eval` load. Layout of such a directory:

        DIR/network.json     {"network": {...Precond kwargs...}, "meta": {...},
                              "integrity": {digests of the arrays and of the sections}}
        DIR/variables/       Orbax PyTree checkpoint {'params', 'buffers'}

    written complete or not at all: under a temporary name of its writer's own
    (`temporary_path`) and renamed whole (`save_network`);

A training run's directory (config.json, checkpoints/, snapshots/, ...) is `layout.py`'s
(and its siblings', one per file).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from edm2_jax import paths
from edm2_jax.run import integrity

NETWORK_JSON = "network.json"
VARIABLES = "variables"
FIELDS_DIGEST = "fields_sha256"  # in network.json's integrity record: its other sections


# --------------------------------------------------------------------------------------
# Orbax items as host arrays


def key_paths(tree: Any) -> list[tuple[str, ...]]:
    """Key path of each leaf of `tree` (dicts, lists, named tuples; e.g. Orbax array
    metadata), as tuples of strings, in `jax.tree.leaves` order."""
    def name(k):
        return str(next(getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)))
    return [tuple(name(k) for k in path)
            for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def subtree(tree: dict, path: Sequence[str]) -> Any:
    """`tree[path[0]][path[1]]...`."""
    for p in path:
        tree = tree[p]
    return tree


def _item_metadata(directory: str):
    """The tree metadata of the Orbax PyTree item `directory`, read by the item's handler:
    a Checkpointer would also look for step metadata (`_CHECKPOINT_METADATA`), which
    lives one level up, and warn that it "does not exist"."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        md = handler.metadata(paths.Path(directory))
    finally:
        handler.close()
    return getattr(md, "tree", md)


def tree_metadata(directory: str) -> dict:
    """The tree of array metadata (shape, dtype) of the Orbax PyTree item `directory`."""
    return dict(_item_metadata(directory))


def restore_numpy(directory: str):
    """The Orbax checkpoint item `directory` (e.g. `RUN/checkpoints/<step>/default`) as
    host numpy arrays, whatever mesh and number of processes wrote it; a restore without
    a target would need the devices that saved it ("Topology mismatch"). Named tuples
    (Adam's state) come back as dicts and lists."""
    md = _item_metadata(directory)
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), md)
    return ocp.PyTreeCheckpointer().restore(
        directory, args=ocp.args.PyTreeRestore(restore_args=restore_args))


def restore_partial(directory: str, paths: Sequence[tuple[str, ...]],
                    md: dict | None = None) -> list:
    """The sub-trees at `paths` of the Orbax PyTree item `directory` as host numpy
    arrays (nothing else in the item is read). `md`: its `tree_metadata`, if known."""
    md = md if md is not None else tree_metadata(directory)
    item: dict = {}
    for path in paths:
        node = item
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = subtree(md, path)
    restore_args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), item)
    r = ocp.PyTreeCheckpointer().restore(directory, args=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True))
    return [subtree(r, path) for path in paths]


# --------------------------------------------------------------------------------------
# Network checkpoints


def _to_jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable(v) for v in obj]
    if isinstance(obj, (np.generic,)):
        return obj.item()
    if hasattr(obj, "to_dict"):
        return _to_jsonable(obj.to_dict())
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def save_network(path: str, variables: dict, net_config: dict, meta: dict | None = None, *,
                 low_memory: bool = False) -> str:
    """Write network `variables` (`{'params', 'buffers'}`) and `net_config` to `path`.

    The save is synchronous and reads the arrays in place (numpy leaves are not copied;
    device arrays are fetched to the host once). With `low_memory`, each array goes to its
    own file (Orbax's non-OCDBT layout, read back the same way by `load_network`) instead
    of one OCDBT store, whose writer holds the whole compressed checkpoint in memory
    until it commits: the save then needs about one tensor of extra memory instead of
    about one parameter copy (what post-hoc EMA uses for its outputs).

    Complete or absent: on a local disk the checkpoint is written into a directory of
    its own beside `path` (`temporary_path`: unique to this writer, so that two writers
    never share one) and renamed to `path` whole; a kill leaves nothing under `path`,
    and what it left beside it is deleted by the next save of `path` on this host
    (`remove_stale_temporaries`). Where `path` is a folder that already holds other
    files, the variables are renamed into it whole, network.json last. On object storage
    (no rename of directories) it is written in place, network.json last: a directory
    without network.json is no network checkpoint.

    Refuses to overwrite a network checkpoint: raises FileExistsError when `path`
    holds one, also one that another writer renamed into place while this one wrote
    (the loser of a race deletes what it wrote). Raises IntegrityError, before anything
    is written, when an array holds NaN/inf. Returns the absolute path (or the URL:
    `path` may be `gs://...`, `paths.py`).
    """
    path = paths.normalize(path)
    if paths.exists(os.path.join(path, VARIABLES)):
        raise FileExistsError(f"{path} already holds a network checkpoint; choose another "
                              f"--workdir or delete it first")
    variables = jax.tree_util.tree_map(np.asarray, dict(variables))
    record = integrity.digest_tree_numpy(variables)
    if record["nonfinite"]:
        raise integrity.IntegrityError(
            f"not saving {path}: non-finite values (NaN/inf) in "
            f"{', '.join(record['nonfinite'][:4])}; check the network or snapshots it was "
            f"made from")
    info = {"network": _to_jsonable(dict(net_config)), "meta": _to_jsonable(meta or {})}
    record[FIELDS_DIGEST] = _fields_digest(info)
    if paths.is_url(path):
        _write_network(path, variables, dict(info, integrity=record), low_memory)
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    remove_stale_temporaries(path)
    in_place = os.path.isdir(path) and bool(os.listdir(path))
    tmp = temporary_path(path)
    try:
        if in_place:  # a folder of other files: the variables renamed in whole, then the json
            _write_network(path, variables, dict(info, integrity=record), low_memory,
                           variables_tmp=tmp)
        else:
            _write_network(tmp, variables, dict(info, integrity=record), low_memory)
            _rename_whole(tmp, path)
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_network(path: str, variables: dict, info: dict, low_memory: bool,
                   variables_tmp: str | None = None) -> None:
    """The variables (Orbax) then network.json (atomically: written last, it marks the
    checkpoint complete) into the directory `path`; with `variables_tmp`, the variables
    are saved there first and renamed to `path/variables` whole (`_rename_whole`)."""
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)))
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(
        use_ocdbt=not low_memory, type_handler_registry=registry))
    paths.makedirs(path)
    target = os.path.join(path, VARIABLES)
    ckptr.save(variables_tmp or target, args=ocp.args.PyTreeSave(variables))
    if variables_tmp:
        _rename_whole(variables_tmp, target)
    paths.write_text_atomic(os.path.join(path, NETWORK_JSON), json.dumps(info, indent=2))


def _rename_whole(src: str, dst: str) -> None:
    """Rename the local directory `src` to `dst` in one step (`rename(2)`: atomic, and
    refused when `dst` is a directory that is not empty). Raises FileExistsError naming
    `dst` when it is there already: another writer completed it first."""
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        raise FileExistsError(f"{dst} was written by another process while this one wrote "
                              f"it; remove it or choose another --workdir/--outdir") from None


# A writer's temporary directory beside its output: `<path>.unfinished-<host>-<pid>-<hex>`
# (the bare `<path>.unfinished` of earlier versions is one too).
UNFINISHED = ".unfinished"
_TEMPORARY = re.compile(r"\.unfinished(?:-(?P<host>[A-Za-z0-9._]*)-(?P<pid>\d+)-[0-9a-f]+)?")


def temporary_path(path: str) -> str:
    """Where one writer writes output `path` (a local directory) until it is complete: a
    name beside it no other writer uses, naming this host and process so that what a
    killed writer left can be told from what a live one writes."""
    host = re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname())[:32]
    return f"{path}{UNFINISHED}-{host}-{os.getpid()}-{secrets.token_hex(4)}"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host is running (another user's counts as running):
    an unfinished output of a dead writer may be removed, a live one's is kept."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def stale_temporaries(path: str) -> list[str]:
    """The temporary directories of output `path` (`temporary_path`) whose writers are
    gone: a process of this host that no longer runs, or a name of earlier versions
    (`<path>.unfinished`). Those of live writers, and of other hosts (which cannot be
    asked), are not listed."""
    parent, name = os.path.split(paths.normalize(path))
    host = re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname())[:32]
    out = []
    for other in paths.listdir(parent):
        m = _TEMPORARY.fullmatch(other[len(name):]) if other.startswith(name) else None
        if m and (m["pid"] is None or m["host"] == host and not pid_alive(int(m["pid"]))):
            out.append(os.path.join(parent, other))
    return out


def remove_stale_temporaries(path: str) -> None:
    """Delete what killed writers of output `path` left beside it (`stale_temporaries`),
    saying so."""
    for p in stale_temporaries(path):
        print(f"Removing {p}: the unfinished output of an interrupted run (it is written "
              f"again)")
        paths.Path(p).rmtree()


def _fields_digest(info: dict) -> str:
    """The SHA-256 of network.json's `network` and `meta` sections (canonical JSON)."""
    text = json.dumps({k: info.get(k) for k in ("network", "meta")}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def is_network_checkpoint(path: str) -> bool:
    return paths.isfile(os.path.join(path, NETWORK_JSON)) and paths.isdir(
        os.path.join(path, VARIABLES))


def variables_dir(path: str) -> str:
    """The Orbax item of a network checkpoint's variables."""
    return os.path.join(path, VARIABLES)


def _network_json(path: str) -> dict:
    """network.json of `path`, with its integrity record (`integrity`: the digests of the
    arrays, and `FIELDS_DIGEST` of the `network` and `meta` sections, which
    `save_network` writes into every network.json) and those sections checked against
    it. Raises IntegrityError when the file is unreadable, edited, or without its record:
    a network that cannot be checked is not read."""
    file = os.path.join(path, NETWORK_JSON)
    try:
        info = json.loads(paths.read_text(file))
        if not isinstance(info.get("network"), dict):
            raise ValueError("no 'network' section")
        record = info.get("integrity")
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise integrity.IntegrityError(
            f"{file} is unreadable ({e}); it is written last by --mode=convert and post-hoc "
            f"EMA: write that network checkpoint again") from None
    if not (isinstance(record, dict) and isinstance(record.get("digests"), dict)
            and record.get(FIELDS_DIGEST)):
        raise integrity.IntegrityError(
            f"{file} has no integrity record (the checksums of its arrays and sections, "
            f"which every network checkpoint is saved with): it was deleted or damaged, so "
            f"the network cannot be checked; write that network checkpoint again "
            f"(--mode=convert or post-hoc EMA)")
    if record[FIELDS_DIGEST] != _fields_digest(info):
        raise integrity.IntegrityError(
            f"{file}: its network config or meta differs from what was saved (checksum "
            f"mismatch: the file was edited or damaged), so the network it describes is not "
            f"the one trained; write that network checkpoint again (--mode=convert or "
            f"post-hoc EMA)")
    return info


def read_network_json(path: str) -> tuple[dict, dict]:
    """`(net_config, meta)` of the network checkpoint `path`, without reading its
    variables (the one reader of `network.json`). Raises IntegrityError when the file
    is unreadable, edited or without its integrity record (`_network_json`)."""
    info = _network_json(path)
    return info["network"], info.get("meta", {}) or {}


def network_checker(path: str) -> integrity.LeafChecker:
    """Checks the arrays of network checkpoint `path` one at a time as a streaming
    reader reads them (`checker('params/<param path>', array)`) against the checksums
    its network.json records."""
    return integrity.LeafChecker(_network_json(path)["integrity"],
                                 f"network checkpoint {path}",
                                 "Write it again (--mode=convert or post-hoc EMA).")


def load_network(path: str) -> tuple[dict, dict, dict]:
    """Read a directory written by `save_network`.

    Returns `(net_config, variables, meta)` with numpy leaves, checked against the
    checksums recorded in network.json and for NaN/inf. Raises FileNotFoundError naming
    the path when it is not a network checkpoint, IntegrityError when it is corrupt.
    """
    path = paths.normalize(path)
    if not is_network_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a network checkpoint (expected network.json and "
                                f"variables/ written by `--mode=convert` or post-hoc EMA)")
    info = _network_json(path)  # read once: the network, its meta and their checksums
    try:
        variables = ocp.StandardCheckpointer().restore(variables_dir(path))
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
        raise integrity.IntegrityError(
            f"network checkpoint {path} is unreadable ({' '.join(str(e).split())[:300]}). "
            f"Write it again (--mode=convert or post-hoc EMA).") from None
    variables = jax.tree_util.tree_map(np.asarray, variables)
    try:
        integrity.check(info["integrity"],
                        integrity.digest_tree_numpy(variables), f"network checkpoint {path}")
    except integrity.IntegrityError as e:
        raise integrity.IntegrityError(f"{e}. Write it again (--mode=convert or post-hoc "
                                       f"EMA).") from None
    return info["network"], variables, info.get("meta", {}) or {}
