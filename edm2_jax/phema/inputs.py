"""The inputs of post-hoc EMA: which snapshots a directory holds, their times and widths,
and the network (config and MPFourier buffers) they belong to.

Owns `find_snapshots` (two layouts, below), the release's snapshot naming
(`RELEASE_NAME_RE`, `parse_release_name`), `import_release_snapshots` and
`input_network`.

  * a training run (`rundir.py`): `WORKDIR/snapshots/<step>/` written by
    `rundir.TrainCheckpoints.save_snapshot` (Orbax Composite: `ema` =
    `{'power': {'0.050': params, ...}}`, `meta` = JSON with `nimg`, `sigma_rels`,
    `ema_keys`). One snapshot holds every tracked EMA at `nimg = meta['nimg']`.
    Net config: `WORKDIR/config.json['network']`; MPFourier buffers: the snapshot's
    `buffers` item when present, else the latest `WORKDIR/checkpoints/<step>`
    (`rundir.run_buffers`).
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
    meta has `phema: True` (outputs of post-hoc EMA) are never taken as inputs.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Sequence

from tqdm import tqdm

from edm2_jax import checkpoint as ckpt_lib
from edm2_jax import convert
from edm2_jax import ema as ema_lib
from edm2_jax import rundir

# Release snapshot names: `edm2-img512-xs-0134217-0.050.pkl` -> kimg 134217, sigma_rel 0.050.
RELEASE_NAME_RE = re.compile(r"-(\d+)-(\d*\.\d+)(?:\.[A-Za-z0-9]+)?$")


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
    if not ckpt_lib.is_network_checkpoint(path):
        return None
    _, meta = ckpt_lib.read_network_json(path)
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
                        directory=ckpt_lib.variables_dir(path))


def find_snapshots(workdir: str) -> tuple[str, list[SnapshotFile]]:
    """The snapshots in `workdir` (see the module docstring for the two layouts).

    Returns `(kind, files)` with kind `'run'` or `'networks'` and files sorted by nimg.
    Raises FileNotFoundError naming both layouts when there are none.
    """
    workdir = os.path.abspath(os.path.expanduser(workdir))
    snap_dir = os.path.join(workdir, rundir.SNAPSHOTS)
    if os.path.isdir(snap_dir) and os.listdir(snap_dir):
        files = []
        for step, meta in rundir.list_snapshots(workdir):
            by_key = {ema_lib.ema_key(s): float(s) for s in meta["sigma_rels"]}
            keys = [k for k in meta["ema_keys"] if k in by_key]
            files.append(SnapshotFile(
                label=f"{rundir.SNAPSHOTS}/{step}", nimg=int(meta["nimg"]),
                sigma_rels=tuple(by_key[k] for k in keys),
                tree_paths=tuple(("power", k) for k in keys),
                directory=rundir.snapshot_item(workdir, step, "ema")))
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


def input_network(kind: str, workdir: str, files: Sequence[SnapshotFile]) -> tuple[dict, dict]:
    """`(net_config, buffers)` (numpy buffers) of the snapshots `find_snapshots` found:
    a run's (`rundir`), or, for imported network checkpoints, the first one's."""
    if kind == "run":
        return rundir.network_config(workdir), rundir.run_buffers(workdir)
    directory = files[0].directory
    net_config, _ = ckpt_lib.read_network_json(os.path.dirname(directory))
    buffers = ckpt_lib.restore_partial(directory, [("buffers",)])[0] \
        if "buffers" in ckpt_lib.tree_metadata(directory) else {}
    return net_config, buffers


def input_checker(kind: str, workdir: str, f: SnapshotFile):
    """`checker(name, array)` (`integrity.LeafChecker`) of snapshot `f`'s arrays, named
    `'/'.join(tree_path + key path)`: its recorded checksums and finiteness."""
    if kind == "run":
        return rundir.snapshot_checker(workdir, int(f.label.rsplit("/", 1)[1]))
    return ckpt_lib.network_checker(os.path.dirname(f.directory))


def import_release_snapshots(src_dir: str, out_dir: str) -> list[str]:
    """Convert every release raw snapshot in `src_dir` (`*-<kimg>-<sigma_rel>.pkl`, also
    `.pt` / `.npz`) into a network checkpoint `out_dir/<file name without extension>/`
    with `edm2_jax.convert.convert` (already converted ones are kept). `out_dir` is then
    a valid `workdir` for `reconstruct`. Returns the checkpoint paths, sorted. Raises
    FileNotFoundError if `src_dir` has no such files."""
    srcs = sorted(p for p in glob.glob(os.path.join(src_dir, "*"))
                  if os.path.isfile(p) and parse_release_name(p)
                  and p.endswith((".pkl", ".pt", ".pth", ".npz")))
    if not srcs:
        raise FileNotFoundError(f"{src_dir}: no release snapshots named like "
                                f"'edm2-img512-xs-0134217-0.050.pkl'")
    out = []
    for src in tqdm(srcs, desc="import snapshots", unit="file"):
        dst = os.path.join(out_dir, os.path.splitext(os.path.basename(src))[0])
        out.append(dst if ckpt_lib.is_network_checkpoint(dst) else convert.convert(src, dst))
    return sorted(out)
