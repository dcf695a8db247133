"""One trainer per run directory: `WORKDIR/train.lock` (`RunLock`).

The lock file records the holder's host, pid and start time; on a local or NFSv4 disk it
is held with an OS file lock for the life of the training process, on object storage
(`gs://`) it is advisory.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time

import jax
from jax.experimental import multihost_utils

from edm2_jax import paths
from edm2_jax.run.layout import LOCK


class RunLockedError(RuntimeError):
    """Another process trains in this run directory."""


class RunLock:
    """`with RunLock(workdir):` one training process per run directory, for the life of
    the block: an exclusive OS file lock (`flock`) on `WORKDIR/train.lock`, which records
    the holder's host, pid and start time. The OS releases it when the process ends in
    any way (kill -9 included), so a stale lock never blocks. Local and NFSv4 disks;
    taken by process 0, its outcome shared with the others. Raises RunLockedError naming
    the holder and what to do, `paths.OutputLocationError` when the disk refuses the lock
    file (read-only, full: named with its free space, no permission).

    On a URL workdir (`gs://`) there is no file lock: one writer is NOT enforced there.
    `train.lock` is then an advisory object (host, pid, start time) written at the start
    and deleted at the end; a lock object found at the start (another trainer, or one
    that was killed before deleting it) is named in a warning on stderr and replaced,
    and training goes on. (GCS could refuse a second writer with a create-if-absent
    precondition, but a killed trainer's object would then block every restart, and the
    local emulator the tests use ignores preconditions, so it could not be tested.)"""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.path = os.path.join(workdir, LOCK)
        self.fd: int | None = None
        self.url_lock = False

    def _holder_record(self) -> str:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "since": time.strftime("%Y-%m-%d %H:%M:%S")})

    def _enter_url(self) -> "RunLock":
        if jax.process_index() == 0:
            if paths.exists(self.path):
                try:
                    holder = json.loads(paths.read_text(self.path) or "{}")
                except ValueError:
                    holder = {}
                print(f"warning: {self.path} exists (host {holder.get('host', '?')}, pid "
                      f"{holder.get('pid', '?')}, since {holder.get('since', '?')}): another "
                      f"trainer may be writing to this run, or one was killed before it "
                      f"removed the lock. One writer is not enforced on {self.workdir} "
                      f"(object storage has no file locks); make sure no other trainer "
                      f"runs.", file=sys.stderr, flush=True)
            paths.Path(self.path).write_text(self._holder_record())
            self.url_lock = True
        return self

    def _unwritable(self, e: OSError) -> paths.OutputLocationError:
        """The error for a lock file the disk refuses (read-only, full, no permission)."""
        fix = "free space there" if e.errno in paths.FULL_DISK else "make it writable"
        return paths.OutputLocationError(
            f"cannot write the lock file {self.path}: {paths.write_problem(self.path, e)}; "
            f"{fix} or pass a --workdir on a writable disk")

    def __enter__(self) -> "RunLock":
        if paths.is_url(self.workdir):
            return self._enter_url()
        holder = None
        if jax.process_index() == 0:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise self._unwritable(e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                try:
                    holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
                except ValueError:
                    holder = {}
                os.close(fd)
            else:
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, self._holder_record().encode(), 0)
                except OSError as e:
                    os.close(fd)
                    raise self._unwritable(e) from None
                self.fd = fd
        if jax.process_count() > 1:
            locked = multihost_utils.broadcast_one_to_all(holder is not None)
            holder = holder or ({} if locked else None)
        if holder is not None:
            raise RunLockedError(
                f"{self.workdir} is in use by another training process (host "
                f"{holder.get('host', '?')}, pid {holder.get('pid', '?')}, since "
                f"{holder.get('since', '?')}; lock file {self.path}). Wait for it to finish, "
                f"or stop it (SIGTERM saves a checkpoint) and re-run; for a different run use "
                f"another --workdir.")
        return self

    def __exit__(self, *exc) -> None:
        if self.url_lock:
            self.url_lock = False
            try:
                paths.Path(self.path).unlink()
            except FileNotFoundError:
                pass
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
