"""When the training loop reports, snapshots and checkpoints (`Schedule`), and what it
reports: the steps' metrics gathered from the devices (`StepMetrics`, which stops a run
whose loss is NaN/inf) and the status line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import resource
import time
from typing import Callable, Iterator

import jax
import numpy as np
from tqdm import tqdm


class NonFiniteLossError(RuntimeError):
    """The loss (or the state to be saved) became NaN or infinite; the checkpoints are
    kept and the message names the newest healthy one and how to resume from it."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When the loop reports, snapshots and checkpoints: each at the first step whose
    image count reaches a whole multiple of its interval (`due`). The intervals are in
    images (`*_nimg`, from the config's kimg); where the batch size divides an interval,
    that is every `interval / batch_size` steps (as in the release, which requires it);
    where it does not, a report lands up to one batch past the multiple (batch 64,
    status_kimg 4: steps 63, 125, 188, ... at kimg 4.032, 8.000, 12.032, ...), never
    drifting away from it, and the status line prints the exact kimg."""
    batch_size: int
    total_steps: int
    status_nimg: int
    snapshot_nimg: int
    checkpoint_nimg: int

    @classmethod
    def of_kimg(cls, batch_size: int, *, total_kimg: float, status_kimg: float,
                snapshot_kimg: float, checkpoint_kimg: float) -> "Schedule":
        """The schedule of a run of `total_kimg` at batch `batch_size` that reports every
        `status_kimg`, snapshots every `snapshot_kimg`, checkpoints every
        `checkpoint_kimg` (the config's fields of those names)."""
        nimg = lambda kimg: max(1, int(round(float(kimg) * 1000)))  # noqa: E731
        return cls(batch_size=batch_size,
                   total_steps=math.ceil(int(round(total_kimg * 1000)) / batch_size),
                   status_nimg=nimg(status_kimg), snapshot_nimg=nimg(snapshot_kimg),
                   checkpoint_nimg=nimg(checkpoint_kimg))

    def due(self, interval_nimg: int, step: int) -> bool:
        """Whether step `step` (1-based: the image count is `step * batch_size` after it)
        is the first to reach a multiple `k * interval_nimg`, k >= 1, that the step
        before it had not reached."""
        b = self.batch_size
        return step >= 1 and (step * b) // interval_nimg > ((step - 1) * b) // interval_nimg

    def status_due(self, step: int) -> bool:
        """A status line after step `step` (`due`; the loop adds the last step and a stop)."""
        return self.due(self.status_nimg, step)

    def snapshot_due(self, step: int) -> bool:
        """EMA snapshot, sample grid and evaluation after step `step` (`due`)."""
        return self.due(self.snapshot_nimg, step)

    def checkpoint_due(self, step: int) -> bool:
        """A checkpoint after step `step` (`due`)."""
        return self.due(self.checkpoint_nimg, step)


class StepMetrics:
    """The steps' metrics, kept on the device until they are needed (at most two steps
    in flight, so that progress and timings are honest), and the timings of the status
    lines. A status line's figures are the means over every step since the previous
    status line, whatever was saved or stopped in between: `check` at a save moves the
    metrics to the host, adding them to the interval's running sums (float64, in step
    order) without ending the interval; `interval()` is what a checkpoint keeps of them
    and `interval=` (a resumed run) carries them on, so that a run stopped anywhere logs
    the figures of an uninterrupted one. Its speed (sec/kimg, img/s) counts the training
    time of this process only: the time spent within `excluded()` (sample grids,
    evaluations, probes) is left out. `check` and `status` raise NonFiniteLossError on a
    NaN/inf loss."""

    def __init__(self, batch_size: int, workdir: str, nimg: int,
                 clock: Callable[[], float] = time.time, interval: dict | None = None):
        self.batch_size, self.workdir, self.clock = batch_size, workdir, clock
        self.pending: list = []  # on the device
        interval = interval or {}
        self.sums: dict = dict(interval.get("sums", {}))  # since the last status line
        self.count: int = int(interval.get("count", 0))
        self.t_start = self.t_status = clock()
        self.excluded_s = 0.0  # time within `excluded()` since the last status line
        self.nimg_status = nimg
        self.first_step_time: float | None = None

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """A block whose wall time the next status line's speed leaves out (a sample
        grid, an evaluation); the pending steps are waited for first, so that their
        time stays counted."""
        if self.pending:
            jax.block_until_ready(self.pending[-1]["objective"])
        t = self.clock()
        try:
            yield
        finally:
            self.excluded_s += self.clock() - t

    def add(self, metrics: dict, step: int) -> None:
        """The metrics of step `step` (0-based), still on the device."""
        metrics["_step"] = step
        self.pending.append(metrics)
        if len(self.pending) >= 2:
            jax.block_until_ready(self.pending[-2]["objective"])
        if self.first_step_time is None:
            jax.block_until_ready(metrics["objective"])
            self.first_step_time = self.clock() - self.t_start
            tqdm.write(f"First step done {self.first_step_time:.1f} s after start (includes "
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
                    f"(kimg {m['_step'] * self.batch_size / 1000:.3f}); stopping. The "
                    f"checkpoints in {self.workdir}/checkpoints are kept (lower "
                    f"optim.ref_lr or set optim.grad_clip, then resume).")
            for k, v in m.items():
                if k != "_step":
                    self.sums[k] = self.sums.get(k, 0.0) + float(v)
            self.count += 1

    def interval(self) -> dict:
        """The running sums of the current status interval (JSON: `{count, sums}`), after
        `check`: what a checkpoint keeps so that a resumed run's next status line is the
        uninterrupted run's."""
        return {"count": self.count, "sums": dict(self.sums)}

    def means(self) -> dict | None:
        """The means of the metrics since the last status line (None if there are none);
        starts a new interval."""
        self.check()
        sums, count, self.sums, self.count = self.sums, self.count, {}, 0
        if not count:
            return None
        return {k: v / count for k, v in sums.items()}

    def status(self, step: int) -> dict:
        """The status line's stats at `step`: metric means, speed over the training time
        since the last status line (`excluded()` time left out), memory, wall time."""
        nimg = step * self.batch_size
        means = self.means() or {}
        now = self.clock()
        dt = now - self.t_status - self.excluded_s
        kimg_done = (nimg - self.nimg_status) / 1000
        stats = dict(kimg=nimg / 1000, step=step, **means,
                     sec_per_kimg=dt / max(kimg_done, 1e-9),
                     img_per_sec=kimg_done * 1000 / max(dt, 1e-9),
                     mem_gib=memory_gib(), time=now - self.t_start)
        self.t_status, self.nimg_status, self.excluded_s = now, nimg, 0.0
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
    return (f"kimg {s['kimg']:9.3f}  loss {s['loss/loss']:.4f}  lr {s['lr']:.2e}  sec/kimg "
            f"{s['sec_per_kimg']:.2f}  img/s {s['img_per_sec']:.1f}  mem {s['mem_gib']:.2f} GiB")
