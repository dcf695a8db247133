"""A run's logs: `WORKDIR/stats.jsonl` (one JSON line per status or evaluation) and the
same numbers as TensorBoard scalars in `WORKDIR/tb/`; written by `StatsLogger`, read by
`read_stats`.
"""
from __future__ import annotations

import json
import os
import shutil
import struct

from edm2_jax import paths
from edm2_jax.run.layout import STATS_JSONL, TB


def read_stats(workdir: str) -> list[dict]:
    """The records of `WORKDIR/stats.jsonl` in order (`StatsLogger`'s lines); a last line
    cut short by a killed run is skipped. Raises FileNotFoundError naming the file."""
    path = os.path.join(workdir, STATS_JSONL)
    if not paths.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: {workdir} is not a training run "
                                f"(or has not logged a status line yet)")
    records = []
    with paths.open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def rows_up_to(text: str, nimg: int) -> str:
    """The lines of `stats.jsonl` text `text` whose `kimg` is at most `nimg` / 1000 (all
    but a last line cut short by a killed run); none when `nimg` is 0."""
    kept = []
    for line in text.splitlines(keepends=True):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if nimg and int(round(row["kimg"] * 1000)) <= nimg:
            kept.append(line if line.endswith("\n") else line + "\n")
    return "".join(kept)


def _records(data: bytes) -> list[bytes]:
    """The framed TFRecords of an event file's bytes (length, its CRC, the record, its
    CRC), each whole; a last record cut short by a killed run is left out."""
    out, pos = [], 0
    while pos + 12 <= len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        if pos + 16 + n > len(data):
            break
        out.append(data[pos:pos + 16 + n])
        pos += 16 + n
    return out


def drop_events_after(tb_dir: str, nimg: int) -> None:
    """Rewrite the TensorBoard event files in `tb_dir` without their events at steps
    past `nimg` (a resumed run writes those steps again; `nimg` 0: all): each file whose
    events all stay is left as it is, the others replaced whole (a kill leaves the old
    file or the new one, and the next start drops the same events)."""
    from tensorboardX.proto.event_pb2 import Event
    for name in paths.listdir(tb_dir):
        path = os.path.join(tb_dir, name)
        if "tfevents" not in name or name.endswith(".tmp"):
            continue
        data = paths.Path(path).read_bytes()
        framed = _records(data)
        events = [Event.FromString(r[12:-4]) for r in framed]
        kept = [r for r, e in zip(framed, events)  # at 0, all but the file's header
                if (e.step <= nimg if nimg else not e.HasField("summary"))]
        if len(kept) == len(framed) and sum(map(len, framed)) == len(data):
            continue
        if paths.is_url(path):
            paths.Path(path).write_bytes(b"".join(kept))
        else:
            with open(path + ".tmp", "wb") as f:
                f.write(b"".join(kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)


class StatsLogger:
    """Appends status dicts to `stats.jsonl` and TensorBoard scalars in `tb/`
    (tensorboardX, no TensorFlow needed), from a run that starts at `start_nimg`.

    Each step keeps one value: the rows of a run that went past `start_nimg` before it
    was stopped (its later checkpoints lost or set aside, or `resume_step` older) are
    dropped from `stats.jsonl` (rewritten by `paths.write_text_atomic`, so a crash
    leaves the old file or the new one) and their events from the TensorBoard event
    files (`drop_events_after`), so that neither holds a step twice; the rows at or
    before `start_nimg` are kept. A fresh start (`start_nimg` 0) keeps none.

    On a URL workdir (`gs://`, objects cannot be appended to): `stats.jsonl` is
    rewritten whole at every `log` (its earlier lines read once at the start), and the
    TensorBoard event files are written to a local temporary directory and copied to
    `WORKDIR/tb/` after every `log` (tensorboardX's own GCS writer is not used)."""

    def __init__(self, workdir: str, start_nimg: int):
        # tensorboardX is required, but costs ~1.6 s to import (protobuf): paid by the
        # training process that logs, not by everything that reads a run (generate, phema).
        from tensorboardX import SummaryWriter
        self.path = os.path.join(workdir, STATS_JSONL)
        self.tb_dir = os.path.join(workdir, TB)
        self.url = paths.is_url(workdir)
        old = paths.read_text(self.path) if paths.isfile(self.path) else ""
        kept = rows_up_to(old, start_nimg)
        if kept != old:
            paths.write_text_atomic(self.path, kept)
        drop_events_after(self.tb_dir, start_nimg)
        if self.url:
            import tempfile
            self.lines = kept
            self.local_tb = tempfile.mkdtemp(prefix="edm2_jax_tb_")
            self.f = None
            self.tb = SummaryWriter(self.local_tb)
        else:
            self.f = open(self.path, "a")
            self.tb = SummaryWriter(self.tb_dir)

    def log(self, stats: dict) -> None:
        """Append `stats` (with `kimg`, the TensorBoard step being `kimg` * 1000)."""
        if self.url:
            self.lines += json.dumps(stats) + "\n"
            paths.Path(self.path).write_text(self.lines)
        else:
            self.f.write(json.dumps(stats) + "\n")
            self.f.flush()
        step = int(round(stats["kimg"] * 1000))
        for k, v in stats.items():
            if isinstance(v, (int, float)) and k not in ("kimg",):
                self.tb.add_scalar(k, v, step)
        self.tb.flush()
        if self.url:
            self._upload_tb()

    def _upload_tb(self) -> None:
        for name in os.listdir(self.local_tb):
            paths.copy_file(os.path.join(self.local_tb, name), os.path.join(self.tb_dir, name))

    def close(self) -> None:
        self.tb.close()
        if self.url:
            self._upload_tb()
            shutil.rmtree(self.local_tb, ignore_errors=True)
        else:
            self.f.close()
