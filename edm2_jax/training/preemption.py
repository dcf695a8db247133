"""Preemption: SIGTERM/SIGINT as a request to stop after the current step, agreed by
every process.

Owns `StopRequest` (the signal handler: it only raises a flag) and `StopConsensus` (all
processes stop at the same step). The training loop finishes the step in flight, saves
a checkpoint and returns; a second signal interrupts at once.
"""
from __future__ import annotations

import signal
import threading

import jax

from edm2_jax.training import sharding as shard_lib


class StopRequest:
    """SIGTERM/SIGINT as a request to stop after the current step (preemption).

    Within `with StopRequest() as stop:` the first signal sets `stop.signal` (its
    number) and `stop.received_at` (the value of `stop.step`, which the training loop
    keeps current); a second one raises KeyboardInterrupt at once. The previous handlers
    come back on exit. Outside the main thread, where Python cannot catch signals, it
    changes nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal: int | None = None
        self.received_at: int | None = None
        self.step = 0
        self._old: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _handle(self, signum, _frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt(f"second signal {signum}: stopping without a checkpoint")
        self.signal, self.received_at = signum, self.step
        print(f"\nReceived signal {signum} at step {self.step}: finishing this step, saving a "
              f"checkpoint, exiting (send it again to stop at once).", flush=True)


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

    def after_step(self) -> bool:
        """Call once after each step: whether all processes stop now."""
        local = self.stop.signal is not None
        if jax.process_count() == 1:
            return local
        self._flags.append(shard_lib.any_process(self.mesh, local))
        return len(self._flags) > 1 and bool(self._flags.pop(0))
