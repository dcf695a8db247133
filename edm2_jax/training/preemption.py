"""Preemption: SIGTERM/SIGINT as a request to stop after the current step, agreed by
every process.

Owns `StopRequest` (the signal handler: it only raises a flag) and `StopConsensus` (all
processes stop at the same step). The training loop finishes the step in flight, saves
a checkpoint and returns; a second signal ends the process at once (`stop_now`).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

import jax
from tqdm import tqdm

from edm2_jax.training import sharding as shard_lib


def stop_now(signum: int, where: str) -> None:
    """End the process at once on a second signal: one `error:` line on stderr, exit
    status 128 + `signum` (130 for SIGINT, 143 for SIGTERM: the shell's convention for
    a process ended by a signal), no traceback and no clean-up of this process. What
    it leaves is what a kill leaves: the complete checkpoints and snapshots are intact,
    an unfinished save is an Orbax temporary directory that the next start deletes, and
    the run's OS file lock goes with the process (on a `gs://` workdir the advisory
    `train.lock` object stays and the next start warns about it)."""
    msg = (f"\nerror: second signal {signum} {where}: stopped at once, without saving. The "
           f"complete checkpoints are intact (an unfinished save is deleted on the next "
           f"start); re-run the same command to resume from the latest.\n")
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - e.g. the signal came during a write to stdout
        pass
    os.write(2, msg.encode())  # unbuffered: never a reentrant write from a signal handler
    os._exit(128 + signum)


def _interactive() -> bool:
    """Whether this process is interactive (an IPython kernel, `python -i`)."""
    return "ipykernel" in sys.modules or hasattr(sys, "ps1")


class StopRequest:
    """SIGTERM/SIGINT as a request to stop after the current step (preemption).

    Within `with StopRequest() as stop:` the first signal sets `stop.signal` (its
    number) and `stop.received_at` (the value of `stop.step`, which the training loop
    sets once the state is restored and keeps current; None: during start-up); a second
    one ends the process at once (`stop_now`), or, in an interactive interpreter (a
    notebook's kernel), raises KeyboardInterrupt. The previous handlers come back on exit.
    Outside the main thread, where Python cannot catch signals, it changes nothing.

    The first signal is acknowledged at once with one line (through the progress bar,
    `tqdm.write`) saying what happens next: within `with stop.doing("the sample grid"):`
    that work is finished first, then the checkpoint saved.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal: int | None = None
        self.received_at: int | None = None
        self.step: int | None = None
        self.activity: str | None = None  # what the loop is doing besides a step
        self._old: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    @contextlib.contextmanager
    def doing(self, activity: str) -> Iterator[None]:
        """A block of work other than a step (e.g. 'the sample grid'), named by the line
        that acknowledges a signal received within it."""
        self.activity = activity
        try:
            yield
        finally:
            self.activity = None

    def where(self, step: int | None) -> str:
        """'at step N', or 'during start-up' before the state is restored."""
        return f"at step {step}" if step is not None else "during start-up"

    def _handle(self, signum, _frame) -> None:
        if self.signal is not None:
            if _interactive():  # a notebook's kernel or a REPL outlives the run
                raise KeyboardInterrupt(f"second signal {signum}: stopped without saving")
            stop_now(signum, self.where(self.step))
        self.signal, self.received_at = signum, self.step
        where, doing = self.where(self.step), "finishing this step"
        if self.activity:
            where, doing = f"{where} during {self.activity}", "finishing it"
        msg = (f"Received signal {signum} {where}: {doing}, then saving a checkpoint and "
               f"exiting (send it again to stop at once, without saving).")
        try:
            tqdm.write(msg)
            sys.stdout.flush()
        except RuntimeError:  # the signal came during a write to stdout (reentrant call)
            os.write(1, ("\n" + msg + "\n").encode())


class StopConsensus:
    """Whether every process stops after the current step: the processes OR their
    `StopRequest` flags (`sharding.any_process`), one collective per step, read one step
    later so that it never waits for the device (so all stop at the same step, at most
    one step after the signal). With one process, the local flag."""

    def __init__(self, stop: StopRequest, mesh):
        self.stop, self.mesh = stop, mesh
        self._flags: list = []

    def before_start(self) -> bool:
        """A signal during start-up: stop before the first step (one process only; with
        several, the first steps' collectives decide)."""
        return jax.process_count() == 1 and self.stop.signal is not None

    def between_steps(self) -> bool:
        """Whether to stop now, between the collectives of two steps (after a sample
        grid): the local flag with one process; False with several (the next step's
        collective decides, so that all stop at the same step)."""
        return jax.process_count() == 1 and self.stop.signal is not None

    def after_step(self) -> bool:
        """Call once after each step: whether all processes stop now."""
        local = self.stop.signal is not None
        if jax.process_count() == 1:
            return local
        self._flags.append(shard_lib.any_process(self.mesh, local))
        return len(self._flags) > 1 and bool(self._flags.pop(0))
