"""The outputs of post-hoc EMA: network checkpoints named as the release names them
(`output_name`), each complete or absent (`save_output`: `network_dir.save_network`
writes it under a temporary name of its own and renames it whole; on object storage in
place, network.json last), and which of them a re-run writes again (`outputs_to_write`:
what an interrupted run left is deleted, a complete output from the same snapshots kept;
one that another process completed meanwhile likewise, `save_output`)."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

from edm2_jax import paths as paths_lib
from edm2_jax.run import network_dir as ckpt_lib


def output_name(nimg: float, sigma_rel: float, per_tensor: Sequence = ()) -> str:
    """`phema-<kimg:07d>-<sigma_rel:.3f>` (the release's naming), plus
    `-pt<hash of per_tensor>` for per-tensor reconstructions."""
    name = f"phema-{int(nimg // 1000):07d}-{sigma_rel:.3f}"
    if per_tensor:
        h = hashlib.sha1(json.dumps([list(p) for p in per_tensor]).encode()).hexdigest()[:8]
        name += f"-pt{h}"
    return name


def remove_unfinished(path: str) -> None:
    """Delete what interrupted runs left of output `path` (saying so): the temporary
    directories of writers that are gone (`network_dir.stale_temporaries`; a live
    writer's is left alone), or `path` itself without network.json (written last; on
    object storage outputs are written in place). Raises FileExistsError when `path`
    holds anything else."""
    ckpt_lib.remove_stale_temporaries(path)
    if not paths_lib.exists(path):
        return
    names = set(paths_lib.listdir(path))
    if not names <= {ckpt_lib.VARIABLES, ckpt_lib.NETWORK_JSON + ".tmp"}:
        raise FileExistsError(f"{path} exists and is not a network checkpoint (it holds "
                              f"{sorted(names)[:4]}); remove it or choose another "
                              f"out_dir (--outdir)")
    print(f"Removing {path}: the unfinished output of an interrupted run (it is written "
          f"again)")
    paths_lib.Path(path).rmtree()


def save_output(path: str, variables: dict, net_config: dict, meta: dict) -> None:
    """Write output `path` so that it exists only once complete (`network_dir.
    save_network`, one tensor at a time). When another process completed `path` while
    this one computed it (two runs on one `--outdir`), its output is kept if it was made
    from the same snapshots (`meta['inputs']`, saying so) and what this one wrote is
    deleted. Raises FileExistsError naming `path` and the fix when it holds anything
    else."""
    try:
        ckpt_lib.save_network(path, variables, net_config, meta, low_memory=True)
    except FileExistsError:
        if not _same_output(path, meta):
            raise FileExistsError(f"{path} was written by another process meanwhile, from "
                                  f"other snapshots (or is not a complete network "
                                  f"checkpoint); remove it or choose another out_dir "
                                  f"(--outdir)") from None
        print(f"Kept {path}: complete, from the same snapshots (written meanwhile by "
              f"another process)")


def _same_output(path: str, meta: dict) -> bool:
    """Whether `path` is a complete network checkpoint made from `meta['inputs']` with
    the same weights (what `meta` would write)."""
    if not ckpt_lib.is_network_checkpoint(path):
        return False
    try:
        theirs = ckpt_lib.read_network_json(path)[1]
    except ValueError:  # IntegrityError: unreadable or edited
        return False
    return all(theirs.get(k) == json.loads(json.dumps(meta.get(k)))
               for k in ("inputs", "weights", "sigma_rel", "nimg"))


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
