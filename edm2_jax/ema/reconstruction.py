"""Post-hoc EMA reconstruction: solve for the wanted EMAs, stream the snapshots through
accumulators, write the outputs.

Owns `reconstruct` (and its CLI body `main_phema`), the per-tensor option
(`parse_per_tensor`) and the accumulators; the outputs' names and their writing are
`outputs.py`'s.

`reconstruct` finds the inputs (`inputs.find_snapshots`), solves for their weights
(`solver.solve_weights`), then reads each snapshot once per batch of outputs, tensor by
tensor (`streaming.make_reader`), copied in 8 MiB chunks into float32 accumulators on a
JAX device (`_Accumulators`); each output is written from its accumulator, which is then
freed. Memory: the outputs plus a few tensors (figures in benchmarks/README.md,
"Post-hoc EMA").

Outputs: network checkpoints `OUT_DIR/phema-<kimg:07d>-<sigma_rel:.3f>/` (default
`OUT_DIR = WORKDIR/phema`) loadable with `network_dir.load_network`; their meta records
`sigma_rel`, `nimg`, the input snapshots and their weights, and `profile_error` (the
relative L2 distance between the reconstructed and the wanted profile). Each is written
under a temporary name of its writer's own and renamed whole when complete
(`network_dir.save_network`); a re-run of an interrupted reconstruction deletes what it
left unfinished and keeps the complete ones, and of two runs on one `--outdir` the
second to finish keeps the first one's output (`outputs.save_output`).

Per-tensor post-hoc EMA: `per_tensor=[(regex, sigma_rel), ...]` gives the parameters
whose '/'-joined path (e.g. `'unet/enc_8x8_block0/conv_res0/weight'`,
`'unet/emb_label/weight'`) matches `regex` (`re.search`, first match wins) that
`sigma_rel` instead of the output's.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import sys
import time
import warnings
from typing import Callable, Sequence

import jax
import numpy as np
from tqdm import tqdm

from edm2_jax import nets, objectives
from edm2_jax.run import network_dir as ckpt_lib
from edm2_jax.ema import power as ema_lib
from edm2_jax import paths as paths_lib
from edm2_jax.ema import streaming
from edm2_jax.ema.inputs import (SnapshotFile, find_snapshots, input_checker,
                                 input_network, read_or_refuse)
from edm2_jax.ema.outputs import output_meta, output_paths, outputs_to_write, save_output
from edm2_jax.ema.solver import gammas, profile_error, solve_weights

Array = jax.Array

# Reconstructions whose profile misses the wanted one by more than this (relative L2)
# get a warning: the snapshots cannot express that sigma_rel at that time.
PROFILE_ERROR_WARN = 0.2


def parse_per_tensor(spec: str | Sequence | None) -> list[tuple[str, float]]:
    """`'REGEX=SIGMA_REL;REGEX=SIGMA_REL'` (`,` also separates items when the spec has no
    `;`) or a list of pairs -> `[(regex, sigma_rel), ...]`. Raises ValueError for a
    malformed item, a bad regex or a sigma_rel out of range."""
    if not spec:
        return []
    if isinstance(spec, str):
        items = [s for s in spec.split(";" if ";" in spec else ",") if s.strip()]
        pairs = []
        for it in items:
            if "=" not in it:
                raise ValueError(f"per_tensor item {it!r} is not REGEX=SIGMA_REL "
                                 f"(e.g. 'emb_label=0.10;enc_64x64=0.05')")
            regex, _, s = it.rpartition("=")
            try:
                pairs.append((regex.strip(), float(s)))
            except ValueError:
                raise ValueError(f"per_tensor item {it!r}: {s!r} is not a number") from None
    else:
        pairs = [(str(r), float(s)) for r, s in spec]
    for regex, s in pairs:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"per_tensor regex {regex!r} is invalid: {e}") from None
        gammas(np.asarray(s), f"per_tensor sigma_rel for {regex!r}")
    return pairs


class _Accumulators:
    """The flat float32 outputs of one batch on a JAX `device`: `add(offset, chunk, w)`
    does `acc[k][offset:offset + len(chunk)] += w[k] * chunk` for every output `k` with
    the jitted, donating `_axpy`, one chunk in flight (so the EMA is never held twice on
    the host). (NumPy in place on the host measured 1.4x slower than this on a CPU
    device, for ~0.3 parameter copies less memory.)"""

    def __init__(self, n: int, size: int, device):
        self.device = device
        self.acc = [jax.device_put(np.zeros(size, np.float32), device) for _ in range(n)]

    def weights(self, w: np.ndarray) -> Array:
        return jax.device_put(np.asarray(w, np.float32), self.device)

    def add(self, offset: int, chunk: np.ndarray, w: Array) -> None:
        self.acc = list(_axpy(tuple(self.acc), jax.device_put(chunk, self.device), w,
                              np.int32(offset)))
        jax.block_until_ready(self.acc)

    def pop_host(self, k: int) -> np.ndarray:
        """Output `k` on the host (a view of the accumulator on a CPU device, else one
        host copy); the accumulator is dropped."""
        flat, self.acc[k] = np.asarray(self.acc[k]), None
        return flat


@functools.partial(jax.jit, donate_argnums=0)
def _axpy(acc: tuple, x: Array, w: Array, offset: Array) -> tuple:
    """`acc[k][offset:offset + len(x)] += w[k] * x` for each output `k`, float32;
    `acc` is donated (updated in place)."""
    return tuple(jax.lax.dynamic_update_slice(
        a, jax.lax.dynamic_slice(a, (offset,), x.shape) + w[k] * x, (offset,))
        for k, a in enumerate(acc))


def _checked_reader(reader, checker, tree_path: tuple, layout) -> Callable:
    """`reader` (`get_leaf(n)`), each tensor checked against the snapshot's checksums and
    for NaN/inf as it is read (`integrity.LeafChecker`; raises IntegrityError, also for
    a tensor that cannot be read: a truncated or damaged file)."""
    def get_leaf(n: int) -> np.ndarray:
        name = "/".join(tuple(tree_path) + tuple(layout.keys[n]))
        try:
            x = reader(n)
        except Exception as e:  # noqa: BLE001 - tensorstore/orbax raise many types
            raise checker.unreadable(name, e) from None
        checker(name, x)
        return x
    return get_leaf


def _at_nimg(at_kimg: float, in_nimg: np.ndarray) -> float:
    """Output time for `--at_kimg`: `1000 at_kimg`, unless no snapshot is at that time and
    one's name-kimg (`nimg // 1000`) is `at_kimg` (release snapshots sit at multiples
    of 1024 images): then that snapshot's nimg."""
    nimg = float(at_kimg) * 1000
    if float(at_kimg).is_integer() and not np.any(in_nimg == nimg):
        named = np.unique(in_nimg[in_nimg // 1000 == float(at_kimg)])
        if len(named) == 1:
            return float(named[0])
    return nimg


def reconstruct(workdir: str, sigma_rels: Sequence[float], at_kimg: float | None = None,
                out_dir: str | None = None, batch_outputs: int = 8,
                per_tensor: Sequence[tuple[str, float]] | str | None = None, *,
                in_sigma_rels: Sequence[float] | None = None, max_cond: float = 1e12,
                device=None, exist_ok: bool = False, progress: bool = True) -> list[str]:
    """Reconstruct power-function EMAs of the given widths from the snapshots in
    `workdir` (Algorithm 3) and write each as a network checkpoint.

    Args:
      workdir: a training run or a directory of imported release snapshots
        (`inputs.find_snapshots`).
      sigma_rels: wanted widths, each in `(0, ema.SIGMA_REL_MAX]`.
      at_kimg: time of the outputs in kimg; default the last snapshot's. An integer kimg
        that names a snapshot as file names do (`nimg // 1000`, e.g. 6 for a snapshot at
        6144 images) means that snapshot's time, as in the release. Snapshots after
        it are not used (nor read).
      out_dir: where outputs go; default `WORKDIR/phema`.
      batch_outputs: outputs accumulated per pass over the snapshots (memory: this many
        parameter copies, float32, on `device`, plus a few tensors of one snapshot).
      per_tensor: `[(regex, sigma_rel), ...]` or `'REGEX=S;REGEX=S'` (`parse_per_tensor`):
        parameters whose path matches take that sigma_rel (first match wins).
      in_sigma_rels: use only snapshot EMAs of these widths (default all).
      max_cond: see `solver.solve_weights`.
      device: JAX device to accumulate on (default `jax.devices()[0]`).
      exist_ok: an output that already exists is kept (and returned, saying so) if its
        meta lists the same inputs, else FileExistsError; False: any existing output
        raises before anything is read. What an interrupted run left unfinished is
        deleted and written again (`outputs.remove_unfinished`): each output appears under its
        name only once complete (`save_output`).
      progress: tqdm bars.
    Returns: the output paths, in the order of `sigma_rels`.
    Raises FileNotFoundError (no snapshots, no config/buffers), FileExistsError, and the
    ValueErrors of `solve_weights` / `parse_per_tensor`.
    """
    streaming.quiet_orbax()
    workdir = paths_lib.normalize(workdir)  # local or gs://
    sigma_rels, per_tensor = _check_request(sigma_rels, per_tensor, batch_outputs)
    device = device or jax.devices()[0]

    # Find the snapshot EMAs and solve for their weights in each output.
    kind, files = find_snapshots(workdir)
    files = _select_emas(files, in_sigma_rels)
    sol = _solve(files, sigma_rels, per_tensor, at_kimg, workdir, max_cond)
    net_config, buffers = input_network(kind, workdir, files)
    objective = objectives.record(nets.run_config(workdir) or {})  # an edited one refused

    # Name the outputs; keep those an earlier run completed.
    out_dir = paths_lib.normalize(out_dir or os.path.join(workdir, "phema"))
    paths = output_paths(out_dir, sol.out_nimg, sigma_rels, per_tensor)
    todo = outputs_to_write(paths, sol.labels, exist_ok)

    # Stream the snapshots into a batch of outputs at a time, then write them.
    try:
        for b0 in range(0, len(todo), batch_outputs):
            batch = todo[b0:b0 + batch_outputs]
            desc = f"phema {b0 // batch_outputs + 1}/{math.ceil(len(todo) / batch_outputs)}"
            acc, layout = _accumulate(kind, workdir, files, sol, batch, device, desc, progress)
            # Write the outputs one at a time, each straight from its accumulator (views
            # of it on the host), and drop each accumulator as soon as it is written: the
            # first output costs no more than the accumulators themselves.
            for j, k in enumerate(batch):
                flat = acc.pop_host(j)
                save_output(paths[k], {"params": layout.unflatten(flat), "buffers": buffers},
                            net_config, output_meta(sol, k, workdir, objective))
                del flat
            del acc
    except KeyboardInterrupt as e:  # SIGTERM or SIGINT (`modes.common.Interrupted`)
        complete = sum(ckpt_lib.is_network_checkpoint(p) for p in paths)
        e.kept = (f"{complete} of the {len(paths)} outputs are complete in {out_dir} and "
                  f"kept (the output in progress is not there: outputs are renamed into "
                  f"place whole), and the same command writes the others")
        raise
    return paths


def _check_request(sigma_rels: Sequence[float], per_tensor: Sequence | str | None,
                   batch_outputs: int) -> tuple[list[float], list[tuple[str, float]]]:
    """`reconstruct`'s wanted widths as a list of floats and its `parse_per_tensor`ed
    groups. Raises: ValueError for no width, one out of range, a bad per-tensor spec or
    `batch_outputs < 1`."""
    sigma_rels = [float(s) for s in np.atleast_1d(sigma_rels)]
    if not sigma_rels:
        raise ValueError("reconstruct needs at least one sigma_rel")
    gammas(np.asarray(sigma_rels), "wanted sigma_rel")
    per_tensor = parse_per_tensor(per_tensor)
    if batch_outputs < 1:
        raise ValueError(f"batch_outputs must be >= 1, got {batch_outputs}")
    return sigma_rels, per_tensor


def _select_emas(files: list[SnapshotFile],
                 in_sigma_rels: Sequence[float] | None) -> list[SnapshotFile]:
    """The snapshot files with only their EMAs of widths `in_sigma_rels` (all for None);
    files left with none are dropped. Raises: ValueError when no EMA is left."""
    if in_sigma_rels is None:
        return files
    keep = {ema_lib.ema_key(s) for s in in_sigma_rels}
    files = [dataclasses.replace(
        f, sigma_rels=tuple(s for s in f.sigma_rels if ema_lib.ema_key(s) in keep),
        tree_paths=tuple(p for s, p in zip(f.sigma_rels, f.tree_paths)
                         if ema_lib.ema_key(s) in keep)) for f in files]
    files = [f for f in files if f.sigma_rels]
    if not files:
        raise ValueError(f"no snapshot EMA has sigma_rel in {list(in_sigma_rels)}")
    return files


@dataclasses.dataclass(frozen=True)
class _Solution:
    """The inputs (snapshot EMAs) of a reconstruction and their weights. Columns of `X`
    and `err`: the wanted `sigma_rels`, then one per `per_tensor` group."""
    sigma_rels: list[float]
    per_tensor: list[tuple[str, float]]
    inputs: list[tuple[int, int]]   # (file index, EMA index in that file) per input
    in_nimg: np.ndarray             # [inputs] float64
    in_sigma: np.ndarray            # [inputs] float64
    out_nimg: float
    X: np.ndarray                   # [inputs, columns] float64 weights (`solve_weights`)
    err: np.ndarray                 # [columns] profile errors (`profile_error`)
    used: np.ndarray                # the inputs with a nonzero weight in some column
    labels: list[str]               # '<snapshot label>:<sigma_rel>' of the used inputs


def _solve(files: list[SnapshotFile], sigma_rels: list[float],
           per_tensor: list[tuple[str, float]], at_kimg: float | None, workdir: str,
           max_cond: float) -> _Solution:
    """Weights of every snapshot EMA in each output (Algorithm 3, `solve_weights`) at the
    time `at_kimg` (`_at_nimg`; default the last snapshot's), warning for a profile that
    misses the wanted one by more than `PROFILE_ERROR_WARN`. Raises: ValueError for a
    time after the last snapshot, and those of `solve_weights`."""
    inputs = [(fi, j) for fi, f in enumerate(files) for j in range(len(f.sigma_rels))]
    in_nimg = np.array([files[fi].nimg for fi, _ in inputs], np.float64)
    in_sigma = np.array([files[fi].sigma_rels[j] for fi, j in inputs], np.float64)
    out_nimg = float(in_nimg.max()) if at_kimg is None else _at_nimg(at_kimg, in_nimg)
    if at_kimg is not None and not 0 < out_nimg <= float(in_nimg.max()) * (1 + 1e-9):
        raise ValueError(
            f"--at_kimg={at_kimg:g} is outside the snapshots of {workdir} (kimg "
            f"{in_nimg.min() / 1000:g}..{in_nimg.max() / 1000:g}): post-hoc EMA cannot "
            f"reconstruct a time after the last snapshot. Pass a value in (0, "
            f"{in_nimg.max() / 1000:g}], or leave it out for the last snapshot's time.")
    col_sigma = np.array(sigma_rels + [s for _, s in per_tensor], np.float64)
    X = solve_weights(in_nimg, in_sigma, out_nimg, col_sigma, max_cond=max_cond)
    err = profile_error(in_nimg, in_sigma, out_nimg, col_sigma, X)
    for s, e in zip(col_sigma, err):
        if e > PROFILE_ERROR_WARN:
            warnings.warn(
                f"post-hoc EMA sigma_rel {s:g} at kimg {out_nimg / 1000:g}: the snapshots "
                f"reproduce its profile only to a relative error of {e:.3f}; save snapshots "
                f"more often or nearer that time, or track two different sigma_rels that "
                f"bracket it", stacklevel=3)  # reconstruct's caller
    used = np.flatnonzero(np.any(X != 0, axis=1))
    labels = [f"{files[inputs[i][0]].label}:{in_sigma[i]:.3f}" for i in used]
    return _Solution(sigma_rels, per_tensor, inputs, in_nimg, in_sigma, out_nimg, X, err,
                     used, labels)


def _accumulate(kind: str, workdir: str, files: list[SnapshotFile], sol: _Solution,
                batch: list[int], device, desc: str,
                progress: bool) -> tuple[_Accumulators, streaming.FlatLayout]:
    """Outputs `batch` (indices of `sol.sigma_rels`) as float32 sums of the snapshot EMAs
    weighted by `sol.X`, each snapshot file read once, tensor by tensor: `(acc, layout)`,
    `acc.pop_host(j)` the flat parameters of output `batch[j]` (`layout.unflatten`)."""
    n_out = len(sol.sigma_rels)
    cols = np.array(batch + [n_out + j for j in range(len(sol.per_tensor))])
    acc, layout, nbytes, t0 = None, None, 0, time.time()  # acc[j]: flat output batch[j]
    active = [fi for fi in range(len(files))
              if any(np.any(sol.X[i, cols] != 0)
                     for i, (f2, _) in enumerate(sol.inputs) if f2 == fi)]
    bar = tqdm(active, desc=desc, unit="snapshot", disable=not progress, dynamic_ncols=True)
    for fi in bar:
        f = files[fi]
        rows = [i for i, (f2, _) in enumerate(sol.inputs) if f2 == fi]
        rows = [i for i in rows if np.any(sol.X[i, cols] != 0)]
        tree_keys = (streaming.orbax_tree_keys(f.directory)
                     if f.fmt == "orbax" else None)
        context = streaming.ts_context()  # one per file
        for i in rows:
            tree_path = f.tree_paths[sol.inputs[i][1]]
            if acc is None:  # the layout from the first EMA read
                tree = read_or_refuse(lambda: streaming.ema_tree(f, tree_path),
                                      input_checker(kind, workdir, f), "/".join(tree_path))
                layout = streaming.flat_layout(tree, sol.per_tensor)
                acc = _Accumulators(len(batch), layout.size, device)
            # Weights of this input in the batch's outputs per tensor group g (0: each
            # output's own sigma_rel, g > 0: per_tensor[g - 1]'s).
            w = [sol.X[i, batch]] + [np.full(len(batch), sol.X[i, n_out + g])
                                     for g in range(len(sol.per_tensor))]
            nbytes += _add_input(acc, layout, kind, workdir, f, tree_path, w, context,
                                 tree_keys)
        del context
        bar.set_postfix_str(f"{nbytes / max(time.time() - t0, 1e-9) / 1e9:.2f} GB/s")
    bar.close()
    return acc, layout


def _add_input(acc: _Accumulators, layout: streaming.FlatLayout, kind: str, workdir: str,
               f: SnapshotFile, tree_path: tuple, w: list[np.ndarray], context,
               tree_keys) -> int:
    """Add the EMA at `tree_path` of snapshot file `f`, read chunk by chunk and checked
    (`_checked_reader`), with weights `w[g]` per tensor group into `acc`. Returns the bytes
    read. Raises: ValueError when its tensors are not those of `layout`."""
    checker = input_checker(kind, workdir, f)
    try:
        reader = read_or_refuse(lambda: streaming.make_reader(
            f, tree_path, layout, context, tree_keys), checker, "/".join(tree_path),
            passed_on=(streaming.StructureError,))
    except streaming.StructureError as e:
        raise ValueError(
            f"{f.label}: the EMA at {'/'.join(tree_path)} has other tensors "
            f"than the first snapshot ({e}); all snapshots must come from the "
            f"same network") from None
    w = [acc.weights(wg) for wg in w]
    checked = _checked_reader(reader, checker, tree_path, layout)
    nbytes = 0
    for offset, g, chunk in layout.chunks(checked):
        acc.add(offset, chunk, w[g])
        nbytes += chunk.nbytes
        del chunk
    return nbytes


def main_phema(workdir: str, sigma_rels: Sequence[float], at_kimg: float | None = None,
               out_dir: str | None = None, per_tensor: str | None = None) -> list[str]:
    """CLI hook for `--mode=phema`: `reconstruct` (outputs complete from an earlier,
    interrupted run with the same inputs are kept), then print one line per output
    (sigma_rel, kimg, profile error, path) and one saying what the profile error is.
    Returns the paths."""
    kind, files = find_snapshots(workdir)
    n_ema = sum(len(f.sigma_rels) for f in files)
    print(f"Post-hoc EMA from {len(files)} snapshot file(s) ({n_ema} EMAs, kimg "
          f"{files[0].nimg / 1000:g}..{files[-1].nimg / 1000:g}) in {workdir}")
    with warnings.catch_warnings(record=True) as caught:  # one line each, no source line
        warnings.simplefilter("always")
        paths = reconstruct(workdir, sigma_rels, at_kimg=at_kimg, out_dir=out_dir,
                            per_tensor=per_tensor, exist_ok=True)  # a re-run keeps what is done
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr, flush=True)
    for p in paths:
        _, m = ckpt_lib.read_network_json(p)
        print(f"  sigma_rel {m['sigma_rel']:.3f}  kimg {m['kimg']:g}  profile error "
              f"{m['profile_error']:.4f}  {len(m['inputs'])} inputs  -> {p}")
    print(f"  (profile error: relative L2 distance of the weighted snapshots' EMA profile "
          f"from the wanted one; 0 = exact, above {PROFILE_ERROR_WARN:g} warned)")
    return paths
