"""When the training loop reports, snapshots and checkpoints (`Schedule`), and what it
reports: the steps' metrics gathered from the devices (`StepMetrics`, which stops a run
whose loss is NaN/inf) and the status line.
"""
from __future__ import annotations

import dataclasses
import math
import resource
import time

import jax
import ml_collections
import numpy as np


class NonFiniteLossError(RuntimeError):
    """The loss (or the state to be saved) became NaN or infinite; the checkpoints are
    kept and the message names the newest healthy one and how to resume from it."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When the loop reports, snapshots and checkpoints, in steps."""
    total_steps: int
    status_every: int
    snapshot_every: int
    checkpoint_every: int

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> "Schedule":
        batch_size = int(config.batch_size)
        steps = lambda kimg: max(1, int(round(kimg * 1000 / batch_size)))  # noqa: E731
        return cls(total_steps=math.ceil(int(round(config.total_kimg * 1000)) / batch_size),
                   status_every=steps(config.status_kimg),
                   snapshot_every=steps(config.snapshot_kimg),
                   checkpoint_every=steps(config.checkpoint_kimg))


class StepMetrics:
    """The steps' metrics, kept on the device until they are needed (at most two steps
    in flight, so that progress and timings are honest), and the timings of the status
    lines. A status line's figures are the means over every step since the previous
    status line, whatever was saved in between (`check` at a save moves the metrics to
    the host without ending the interval). `check` and `status` raise
    NonFiniteLossError on a NaN/inf loss."""

    def __init__(self, batch_size: int, workdir: str, nimg: int):
        self.batch_size, self.workdir = batch_size, workdir
        self.pending: list = []  # on the device
        self.checked: list = []  # on the host, finite, since the last status line
        self.t_start = self.t_status = time.time()
        self.nimg_status = nimg
        self.first_step_time: float | None = None

    def add(self, metrics: dict, step: int) -> None:
        """The metrics of step `step` (0-based), still on the device."""
        metrics["_step"] = step
        self.pending.append(metrics)
        if len(self.pending) >= 2:
            jax.block_until_ready(self.pending[-2]["objective"])
        if self.first_step_time is None:
            jax.block_until_ready(metrics["objective"])
            self.first_step_time = time.time() - self.t_start
            print(f"First step done {self.first_step_time:.1f} s after start (includes "
                  f"compile)")

    def check(self) -> None:
        """Move the pending metrics to the host and check their loss (before a save);
        they stay in the current status interval. Raises NonFiniteLossError."""
        if not self.pending:
            return
        host, self.pending = jax.device_get(self.pending), []
        for m in host:
            if not np.isfinite(m["objective"]):
                raise NonFiniteLossError(
                    f"non-finite loss ({m['objective']}) at step {m['_step']} "
                    f"(kimg {m['_step'] * self.batch_size / 1000:.1f}); stopping. The "
                    f"checkpoints in {self.workdir}/checkpoints are kept (lower "
                    f"optim.ref_lr or set optim.grad_clip, then resume).")
        self.checked.extend(host)

    def means(self) -> dict | None:
        """The means of the metrics since the last status line (None if there are none);
        starts a new interval."""
        self.check()
        host, self.checked = self.checked, []
        if not host:
            return None
        return {k: float(np.mean([m[k] for m in host])) for k in host[0] if k != "_step"}

    def status(self, step: int) -> dict:
        """The status line's stats at `step`: metric means, speed, memory, time."""
        nimg = step * self.batch_size
        means = self.means() or {}
        dt = time.time() - self.t_status
        kimg_done = (nimg - self.nimg_status) / 1000
        stats = dict(kimg=nimg / 1000, step=step, **means,
                     sec_per_kimg=dt / max(kimg_done, 1e-9),
                     img_per_sec=kimg_done * 1000 / max(dt, 1e-9),
                     mem_gib=memory_gib(), time=time.time() - self.t_start)
        self.t_status, self.nimg_status = time.time(), nimg
        return stats


def memory_gib() -> float:
    """Peak memory in GiB: the first local device's peak bytes in use where the backend
    reports it (e.g. GPU), else the host's peak RSS."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            return stats["peak_bytes_in_use"] / 2**30
    except Exception:  # noqa: BLE001 - not every backend reports memory
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def status_line(s: dict) -> str:
    """The status line of `StepMetrics.status`'s stats."""
    return (f"kimg {s['kimg']:9.1f}  loss {s['loss/loss']:.4f}  lr {s['lr']:.2e}  sec/kimg "
            f"{s['sec_per_kimg']:.2f}  img/s {s['img_per_sec']:.1f}  mem {s['mem_gib']:.2f} GiB")
