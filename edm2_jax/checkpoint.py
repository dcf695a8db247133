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


def save_network(path: str, variables: dict, net_config: dict, meta: dict | None = None) -> str:
    """Write network `variables` (`{'params', 'buffers'}`) and `net_config` to `path`.

    Refuses to overwrite an existing network checkpoint (raises FileExistsError).
    Returns the absolute path.
    """
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(os.path.join(path, "variables")):
        raise FileExistsError(f"{path} already holds a network checkpoint; choose another "
                              f"--workdir or delete it first")
    os.makedirs(path, exist_ok=True)
    variables = jax.tree_util.tree_map(np.asarray, dict(variables))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(path, "variables"), variables)
    ckptr.wait_until_finished()
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
