"""The outputs of post-hoc EMA: network checkpoints named as the release names them
(`output_name`), each written as `<name>.unfinished` and renamed when complete
(`save_output`; on object storage in place, network.json last), and which of them a
re-run writes again (`outputs_to_write`: what an interrupted run left is deleted, a
complete output from the same snapshots kept)."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

from edm2_jax import paths as paths_lib
from edm2_jax.run import network_dir as ckpt_lib

# Suffix of an output being written (`save_output`); a re-run deletes it and writes again.
UNFINISHED = ".unfinished"


def output_name(nimg: float, sigma_rel: float, per_tensor: Sequence = ()) -> str:
    """`phema-<kimg:07d>-<sigma_rel:.3f>` (the release's naming), plus
    `-pt<hash of per_tensor>` for per-tensor reconstructions."""
    name = f"phema-{int(nimg // 1000):07d}-{sigma_rel:.3f}"
    if per_tensor:
        h = hashlib.sha1(json.dumps([list(p) for p in per_tensor]).encode()).hexdigest()[:8]
        name += f"-pt{h}"
    return name


def unfinished_path(path: str) -> str:
    """Where output `path` is written until complete (a local disk: then renamed)."""
    return path + UNFINISHED


def remove_unfinished(path: str) -> None:
    """Delete what an interrupted run left of output `path` (saying so): its
    `unfinished_path`, or `path` itself without network.json (written last; on object
    storage outputs are written in place). Raises FileExistsError when `path` holds
    anything else."""
    for p in (unfinished_path(path), path):
        if not paths_lib.exists(p):
            continue
        names = set(paths_lib.listdir(p))
        if p == path and not names <= {ckpt_lib.VARIABLES, ckpt_lib.NETWORK_JSON + ".tmp"}:
            raise FileExistsError(f"{path} exists and is not a network checkpoint (it holds "
                                  f"{sorted(names)[:4]}); remove it or choose another "
                                  f"out_dir (--outdir)")
        print(f"Removing {p}: the unfinished output of an interrupted run (it is written "
              f"again)")
        paths_lib.Path(p).rmtree()


def save_output(path: str, variables: dict, net_config: dict, meta: dict) -> None:
    """Write output `path` so that it exists only once complete: on a local disk under
    `unfinished_path`, renamed when written; on object storage (no renaming of
    directories) in place, with network.json written last (`remove_unfinished`)."""
    if paths_lib.is_url(path):
        ckpt_lib.save_network(path, variables, net_config, meta, low_memory=True)
        return
    tmp = unfinished_path(path)
    ckpt_lib.save_network(tmp, variables, net_config, meta, low_memory=True)
    os.replace(tmp, path)


def output_paths(out_dir: str, out_nimg: float, sigma_rels: list[float],
                  per_tensor: list[tuple[str, float]]) -> list[str]:
    """`out_dir/<output_name>` per wanted width. Raises: ValueError when two names clash."""
    names = [output_name(out_nimg, s, per_tensor) for s in sigma_rels]
    if len(set(names)) != len(names):
        raise ValueError(f"sigma_rels {sigma_rels} give clashing output names {names}; pass "
                         f"values that differ in the first 3 decimals")
    return [os.path.join(out_dir, n) for n in names]


def outputs_to_write(paths: list[str], labels: list[str], exist_ok: bool) -> list[int]:
    """Indices of the `paths` to write, deleting what an interrupted run left of them
    (`remove_unfinished`); a complete output from the same inputs is kept (`exist_ok`).
    Raises: FileExistsError for an existing output without `exist_ok`, or one from
    other inputs."""
    todo = []
    for k, p in enumerate(paths):
        if not ckpt_lib.is_network_checkpoint(p):
            remove_unfinished(p)
            todo.append(k)
        elif not exist_ok:
            raise FileExistsError(f"{p} already exists; remove it, choose another out_dir "
                                  f"(--outdir), or pass exist_ok=True to keep it")
        elif ckpt_lib.read_network_json(p)[1].get("inputs") != labels:
            raise FileExistsError(f"{p} exists but was made from other snapshots; remove "
                                  f"it or choose another out_dir (--outdir)")
        else:
            print(f"Kept {p}: complete, from the same snapshots (written by an earlier run)")
    return todo


def output_meta(sol: Any, k: int, workdir: str, objective: dict) -> dict:
    """The meta of output `k` of the solution `sol` (`reconstruction._Solution`): its
    width and time, the inputs it uses with their weights and its profile error, those
    of each per-tensor group, and `objective`, the run's objective (`objectives.record`:
    what its sampler needs, read from this network alone)."""
    n_out, used = len(sol.sigma_rels), sol.used
    groups = [{"regex": r, "sigma_rel": s, "weights": sol.X[used, n_out + j].tolist(),
               "profile_error": float(sol.err[n_out + j])}
              for j, (r, s) in enumerate(sol.per_tensor)]
    return {"phema": True, "sigma_rel": sol.sigma_rels[k], "nimg": sol.out_nimg,
            "kimg": sol.out_nimg / 1000, "source": workdir, "inputs": sol.labels,
            "input_nimg": sol.in_nimg[used].tolist(),
            "input_sigma_rel": sol.in_sigma[used].tolist(),
            "weights": sol.X[used, k].tolist(), "profile_error": float(sol.err[k]),
            "per_tensor": groups, **objective}
