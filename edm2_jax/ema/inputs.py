"""The inputs of post-hoc EMA: which snapshots a directory holds, their times and widths,
and the network (config and MPFourier buffers) they belong to.

Owns `find_snapshots` (three layouts, below), the release's snapshot naming and its
kimg -> nimg rule (`RELEASE_NAME_RE`, `parse_release_name`, `release_kimg_to_nimg`),
reading a release pickle as a snapshot (`release_pickle_variables`),
`import_release_snapshots` and `input_network`.

  * a training run (`run/snapshots.py`): `WORKDIR/snapshots/<step>/` written by
    `checkpoints.TrainCheckpoints.save_snapshot` (Orbax Composite: `ema` =
    `{'power': {'0.050': params, ...}}`, `meta` = JSON with `nimg`, `sigma_rels`,
    `ema_keys`). One snapshot holds every tracked EMA at `nimg = meta['nimg']`.
    Net config: `WORKDIR/config.json['network']`; MPFourier buffers: the snapshot's
    `buffers` item when present, else the latest `WORKDIR/checkpoints/<step>`
    (`snapshots.run_buffers`).
  * imported release snapshots: a directory whose sub-directories are network checkpoints
    (`network_dir.save_network`), one per raw power-EMA snapshot of the release, e.g.
    written by `import_release_snapshots` from the published
    `edm2-img512-xs-0134217-0.050.pkl` files. Convention for each one's time and width:
    `meta['nimg']` and `meta['sigma_rel']` when the meta has them; otherwise parsed from
    the file name in `meta['source']` (what `convert` records), else from the
    sub-directory's name, with the release's pattern `...-<kimg>-<sigma_rel>[.ext]`
    (`RELEASE_NAME_RE`, `parse_release_name`). Network checkpoints whose meta has
    `phema: True` (outputs of post-hoc EMA) are never taken as inputs.
  * a release run directory (or a folder of downloaded raw snapshots): network pickles
    `<prefix>-<kimg>-<sigma_rel>.pkl` (`network-snapshot-0008388-0.050.pkl`,
    `edm2-img512-xs-0134217-0.050.pkl`), read directly, one at a time (torch is needed
    to read them, as for `convert`).

The release's names hold `kimg = nimg // 1000` of a time that its training loop keeps a
multiple of 1024 images (`snapshot_nimg = 8<<20`); like its `reconstruct_phema.py`, the
time is the multiple of 1024 with that kimg (`release_kimg_to_nimg`: 0008388 ->
8388608 = 8Mi), and snapshots at nimg 0 (the release writes one when a run starts) are
skipped: an EMA at time 0 is the initialisation and has no profile.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
from typing import Any, Callable, Sequence

from tqdm import tqdm

from edm2_jax.run import network_dir as ckpt_lib
from edm2_jax.release import convert, pickle_io
from edm2_jax.ema import power as ema_lib
from edm2_jax import paths
from edm2_jax.run import integrity
from edm2_jax.run import layout
from edm2_jax.run import records
from edm2_jax.run import snapshots

# Release snapshot names: `edm2-img512-xs-0134217-0.050.pkl` -> kimg 134217, sigma_rel 0.050.
RELEASE_NAME_RE = re.compile(r"-(\d+)-(\d*\.\d+)(?:\.[A-Za-z0-9]+)?$")
# The network pickles a release run directory holds (the release's own input pattern).
RELEASE_PICKLE_RE = re.compile(r"(.*)-(\d+)-(\d+\.\d+)\.pkl")


@dataclasses.dataclass(frozen=True)
class SnapshotFile:
    """One snapshot on disk, read in one go: one or more power EMAs at time `nimg`.

    `directory` is an Orbax PyTree checkpoint (`fmt='orbax'`) or a release network
    pickle file (`fmt='pickle'`, read with `release_pickle_variables`); EMA `i` lives at
    `tree_paths[i]` in it (`('power', '0.050')` in a training snapshot, `('params',)` in
    a network checkpoint or pickle).
    """
    label: str
    nimg: int
    sigma_rels: tuple[float, ...]
    tree_paths: tuple[tuple[str, ...], ...]
    directory: str
    fmt: str = "orbax"


def release_kimg_to_nimg(kimg: int) -> int:
    """The training time (images) of a release file name's `kimg`: the multiple of 1024
    images whose `nimg // 1000` is `kimg` (the release snapshots only at multiples of
    1024; 134217 -> 134217728 = 128Mi, 6 -> 6144). Raises ValueError for a kimg that no
    multiple of 1024 has (e.g. 42: 41984 // 1000 = 41, 43008 // 1000 = 43)."""
    kimg = int(kimg)
    nimg = -(-kimg * 1000 // 1024) * 1024
    if nimg // 1000 != kimg:
        raise ValueError(
            f"kimg {kimg} in a release file name is not the kimg (nimg // 1000) of any "
            f"multiple of 1024 images, and the release saves snapshots only at such times; "
            f"was the file renamed? Name it with its true kimg, or convert it and record "
            f"meta['nimg'].")
    return nimg


def parse_release_name(name: str) -> tuple[int, float] | None:
    """`(nimg, sigma_rel)` from a release snapshot name `...-<kimg>-<sigma_rel>[.ext]`
    (`edm2-img512-xs-0134217-0.050.pkl` -> `(134217728, 0.05)`; nimg from
    `release_kimg_to_nimg`), or None if it does not match. Raises its ValueError."""
    m = RELEASE_NAME_RE.search(os.path.basename(os.path.normpath(name)))
    return (release_kimg_to_nimg(int(m.group(1))), float(m.group(2))) if m else None


@functools.lru_cache(maxsize=1)
def release_pickle_variables(path: str) -> tuple[dict, dict]:
    """`(net_config, variables)` of the release network pickle `path` (its `'ema'`
    network, float32 numpy, this project's layout; `pickle_io.load_release` and
    `convert.state_dict_to_variables`). The last file read is cached: post-hoc EMA asks
    for one snapshot's layout, then its tensors. Raises what those raise (ImportError
    without torch)."""
    weights = pickle_io.load_release(path)
    return convert.state_dict_to_variables(weights.state_dict,
                                           convert.net_config_from_release(weights))


def _release_pickles(workdir: str) -> list[SnapshotFile]:
    """The release network pickles in `workdir` (`RELEASE_PICKLE_RE`), nimg 0 left out."""
    files = []
    for name in paths.listdir(workdir):
        path = os.path.join(workdir, name)
        m = RELEASE_PICKLE_RE.fullmatch(name)
        if m is None or not paths.isfile(path):
            continue
        nimg = release_kimg_to_nimg(int(m.group(2)))
        if nimg > 0:
            files.append(SnapshotFile(label=name, nimg=nimg, sigma_rels=(float(m.group(3)),),
                                      tree_paths=(("params",),), directory=path, fmt="pickle"))
    return files


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
    """The snapshots in `workdir` (see the module docstring for the three layouts).

    Returns `(kind, files)` with kind `'run'`, `'networks'` or `'pickles'` and files
    sorted by nimg (then sigma_rel); snapshots at nimg 0 are left out. Raises
    FileNotFoundError naming the layouts when there are none.
    """
    workdir = paths.normalize(workdir)  # local or gs:// (paths.py)
    snap_dir = os.path.join(workdir, layout.SNAPSHOTS)
    if paths.listdir(snap_dir):
        files = []
        for step, meta in snapshots.list_snapshots(workdir):
            by_key = {ema_lib.ema_key(s): float(s) for s in meta["sigma_rels"]}
            keys = [k for k in meta["ema_keys"] if k in by_key]
            files.append(SnapshotFile(
                label=f"{layout.SNAPSHOTS}/{step}", nimg=int(meta["nimg"]),
                sigma_rels=tuple(by_key[k] for k in keys),
                tree_paths=tuple(("power", k) for k in keys),
                directory=layout.snapshot_item(workdir, step, "ema")))
        if files:
            return "run", sorted(files, key=lambda f: f.nimg)
    files = []
    if paths.isdir(workdir):
        for name in paths.listdir(workdir):
            f = _network_input(os.path.join(workdir, name))
            if f is not None and f.nimg > 0:
                files.append(f)
        if files:
            return "networks", sorted(files, key=lambda f: (f.nimg, f.sigma_rels))
        files = _release_pickles(workdir)
        if files:
            return "pickles", sorted(files, key=lambda f: (f.nimg, f.sigma_rels))
    hint = ""
    if any(n.endswith(".pkl") and not n.startswith(".") for n in paths.listdir(workdir)):
        hint = (" Its .pkl files are not named like the release's snapshots "
                "'<prefix>-<kimg>-<sigma_rel>.pkl' after nimg 0.")
    raise FileNotFoundError(
        f"no post-hoc EMA inputs in {workdir}: expected a training run with "
        f"snapshots/<step>/ (config.snapshot_kimg), release network pickles named like "
        f"'network-snapshot-0008388-0.050.pkl' (a release run directory), or "
        f"sub-directories that are network checkpoints of release snapshots named like "
        f"'edm2-img512-xs-0134217-0.050'." + hint)


def input_network(kind: str, workdir: str, files: Sequence[SnapshotFile]) -> tuple[dict, dict]:
    """`(net_config, buffers)` (numpy buffers) of the snapshots `find_snapshots` found:
    a run's (`run.snapshots`), or, for network checkpoints and pickles, the first one's."""
    if kind == "run":
        return records.run_network_config(workdir), snapshots.run_buffers(workdir)
    if kind == "pickles":
        net_config, variables = release_pickle_variables(files[0].directory)
        return net_config, variables["buffers"]
    directory = files[0].directory
    net_config, _ = ckpt_lib.read_network_json(os.path.dirname(directory))
    buffers = ckpt_lib.restore_partial(directory, [("buffers",)])[0] \
        if "buffers" in ckpt_lib.tree_metadata(directory) else {}
    return net_config, buffers


def input_checker(kind: str, workdir: str, f: SnapshotFile):
    """`checker(name, array)` (`integrity.LeafChecker`) of snapshot `f`'s arrays, named
    `'/'.join(tree_path + key path)`: its recorded checksums and finiteness."""
    if kind == "run":
        return snapshots.snapshot_checker(workdir, int(f.label.rsplit("/", 1)[1]))
    if kind == "pickles":  # no checksums recorded: finiteness only
        return integrity.LeafChecker(None, f.directory, "Re-download or re-copy the file.")
    return ckpt_lib.network_checker(os.path.dirname(f.directory))


def read_or_refuse(read: Callable[[], Any], checker, name: str,
                   passed_on: tuple[type[BaseException], ...] = ()) -> Any:
    """`read()` of a snapshot file's metadata or arrays; whatever a damaged file makes the
    readers raise (TensorStore's DATA_LOSS, Orbax's errors), except `passed_on`, becomes
    the file's one IntegrityError (`checker.unreadable`: the snapshot, `name`, the fix)."""
    try:
        return read()
    except passed_on:
        raise
    except Exception as e:  # noqa: BLE001 - TensorStore/Orbax raise many types
        raise checker.unreadable(name, e) from None


def import_release_snapshots(src_dir: str, out_dir: str) -> list[str]:
    """Convert every release raw snapshot in `src_dir` (`*-<kimg>-<sigma_rel>.pkl`, also
    `.pt` / `.npz`) into a network checkpoint `out_dir/<file name without extension>/`
    with `edm2_jax.release.convert.convert` (already converted ones are kept). `out_dir` is then
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
