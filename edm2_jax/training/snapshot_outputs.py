"""What a training run makes at each snapshot besides the EMAs: the sample grid of its
largest EMA (`samples/<nimg>.png`, `SampleGrid`) and the evaluation during training, both
sampled with the run's objective's sampler; the loop's snapshot calls `grid_and_eval`."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from edm2_jax import paths
from edm2_jax.model.networks import Precond
from edm2_jax.run import layout
from edm2_jax.sampling import sampler as sampling
from edm2_jax.sampling import solvers
from edm2_jax.sampling.seeds import split_seeds
from edm2_jax.training import preemption
from edm2_jax.training import sharding as shard_lib


def emas_on_host(state: dict, keys: list[str]) -> dict:
    """`{key: EMA variables}` as host arrays, each gathered once (a collective on every
    process, in the same order everywhere) however many consumers want it."""
    return {k: shard_lib.to_host({"params": state["ema"]["power"][k],
                                  "buffers": state["buffers"]})
            for k in dict.fromkeys(keys)}


@dataclasses.dataclass(frozen=True)
class SampleGrid:
    """The sample grid of a run (`config.sample`): `rows` x `cols` images of the seeds
    from `seed` (one class per column), noise drawn by `rng` ('jax', or 'release': the
    release's per-seed draws), sampled from EMA `ema_key` with `sampler` (the
    objective's, `Objective.sampler`)."""
    rows: int
    cols: int
    seed: int
    rng: str
    ema_key: str
    sampler: solvers.Sampler


def save_sample_grid(grid: SampleGrid, net: Precond, variables: dict, path: str) -> None:
    """The sample grid `grid` of the network `variables` at `path` (a PNG)."""
    seeds = np.arange(grid.rows * grid.cols) + grid.seed
    labels = None
    if net.label_dim:
        labels = jax.nn.one_hot(np.arange(grid.rows * grid.cols) % net.label_dim,
                                net.label_dim)
    imgs = sampling.sample_images(net, variables, split_seeds(seeds), labels, rng=grid.rng,
                                  sampler=grid.sampler)
    while not imgs.is_ready():  # waits in Python: a signal is acknowledged at once
        time.sleep(0.05)
    paths.write_through_local(  # PIL writes local files
        path, lambda local: sampling.save_image_grid(np.asarray(imgs), local, grid.rows,
                                                     grid.cols))


def eval_line(nimg: int, ema_key: str, res: dict) -> str:
    """The log line of an evaluation's results `res` (`eval/<metric>` -> value)."""
    return (f"kimg {nimg / 1000:9.3f}  eval (EMA {ema_key}): " + "  ".join(
        f"{k[5:]} {v:.4g}" for k, v in res.items()
        if k != "eval/time_s" and not k.startswith("eval/num_"))
        + f"  [{res['eval/time_s']:.1f} s]")


def grid_and_eval(grid: SampleGrid, net: Precond, state: dict, workdir: str, nimg: int,
                  step: int, stop: preemption.StopRequest, eval_key: str | None,
                  evaluator: Any, logger: Any, is_main: bool) -> None:
    """At a snapshot: the sample grid `grid` (process 0) and the evaluation of EMA
    `eval_key` (`evaluator`, process 0, when configured; `eval_key` None: none), each
    announced as it starts, through the bar; the EMAs are gathered on every process.
    A signal meanwhile is acknowledged at once (`stop.doing`): the grid or the
    evaluation in progress finishes, the evaluation not yet begun is skipped. `logger`
    (a `StatsLogger`, or None) gets the evaluation's row."""
    host = emas_on_host(state, [grid.ema_key] + ([eval_key] if eval_key else []))
    if is_main:
        t, steps = time.time(), grid.sampler.num_steps
        tqdm.write(f"Sample grid: {grid.rows * grid.cols} images of EMA "
                   f"sigma_rel={grid.ema_key}, {steps} steps...")
        path = layout.samples_path_at(workdir, nimg)
        with stop.doing("the sample grid"):
            save_sample_grid(grid, net, host[grid.ema_key], path)
        tqdm.write(f"Sample grid (EMA sigma_rel={grid.ema_key}, {steps} "
                   f"steps, one class per column): {path} [{time.time() - t:.1f} s]")
    if evaluator is not None:
        if stop.signal is not None:
            tqdm.write(f"kimg {nimg / 1000:9.3f}  evaluation skipped: stopping")
            return
        tqdm.write(f"Evaluation (EMA {evaluator.ema_key}): {evaluator.metrics.names} of "
                   f"{evaluator.num_images} images...")
        with stop.doing("the evaluation"):
            res = evaluator(net, host[evaluator.ema_key])
        if logger:
            logger.log(dict(kimg=nimg / 1000, step=step, **res))
        tqdm.write(eval_line(nimg, evaluator.ema_key, res))
