"""Orbax checkpoints of this project.

Network checkpoints (`save_network` / `load_network`) hold one set of network
variables `{'params', 'buffers'}` plus the network config as JSON: what `convert`
writes, what post-hoc EMA reconstruction outputs, and what `generate` / `eval` load.
Layout of such a directory:

    DIR/network.json     {"network": {...Precond kwargs...}, "meta": {...}}
    DIR/variables/       Orbax StandardCheckpointer tree
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


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

    Refuses to overwrite an existing network checkpoint (raises FileExistsError).
    Returns the absolute path.
    """
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(os.path.join(path, "variables")):
        raise FileExistsError(f"{path} already holds a network checkpoint; choose another "
                              f"--workdir or delete it first")
    os.makedirs(path, exist_ok=True)
    variables = jax.tree_util.tree_map(np.asarray, dict(variables))
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)))
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(
        use_ocdbt=not low_memory, type_handler_registry=registry))
    ckptr.save(os.path.join(path, "variables"), args=ocp.args.PyTreeSave(variables))
    with open(os.path.join(path, "network.json"), "w") as f:
        json.dump({"network": _to_jsonable(dict(net_config)), "meta": _to_jsonable(meta or {})},
                  f, indent=2)
    return path


def is_network_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "network.json")) and os.path.isdir(
        os.path.join(path, "variables"))


def load_network(path: str) -> tuple[dict, dict, dict]:
    """Read a directory written by `save_network`.

    Returns `(net_config, variables, meta)` with numpy leaves. Raises
    FileNotFoundError naming the path when it is not a network checkpoint.
    """
    path = os.path.abspath(os.path.expanduser(path))
    if not is_network_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a network checkpoint (expected network.json and "
                                f"variables/ written by `--mode=convert` or post-hoc EMA)")
    with open(os.path.join(path, "network.json")) as f:
        info = json.load(f)
    variables = ocp.StandardCheckpointer().restore(os.path.join(path, "variables"))
    variables = jax.tree_util.tree_map(np.asarray, variables)
    return info["network"], variables, info.get("meta", {})
