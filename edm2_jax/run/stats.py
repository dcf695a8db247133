"""A run's logs: `WORKDIR/stats.jsonl` (one JSON line per status or evaluation) and the
same numbers as TensorBoard scalars in `WORKDIR/tb/`; written by `StatsLogger`, read by
`read_stats`.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import time

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


def _event_files(tb_dir: str) -> list[str]:
    return [os.path.join(tb_dir, name) for name in paths.listdir(tb_dir)
            if "tfevents" in name and not name.endswith(".tmp")]


def drop_events_after(tb_dir: str, nimg: int) -> None:
    """Rewrite the TensorBoard event files in `tb_dir` without their events at steps
    past `nimg` (a resumed run writes those steps again; `nimg` 0: all): each file whose
    events all stay is left as it is, the others replaced whole (a kill leaves the old
    file or the new one, and the next start drops the same events)."""
    from tensorboardX.proto.event_pb2 import Event
    for path in _event_files(tb_dir):
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


def _scalar_keys(row: dict) -> list[str]:
    """The keys of a stats row that TensorBoard shows: each number but `kimg`."""
    return [k for k, v in row.items() if isinstance(v, (int, float)) and k != "kimg"]


def _summary(row: dict):
    """The TensorBoard `Summary` of a stats row: a scalar per `_scalar_keys` (tags
    cleaned as tensorboardX cleans them)."""
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.summary import scalar
    return Summary(value=[scalar(k, float(row[k])).value[0] for k in _scalar_keys(row)])


def missing_scalars(tb_dir: str, rows: list[dict]) -> list[dict]:
    """The parts of the stats rows `rows` that the event files in `tb_dir` lack (a run
    killed after a row reached `stats.jsonl` and before its event was written): for each
    row with a scalar whose (tag, step) no event holds, that row with `kimg` and those
    scalars alone."""
    from tensorboardX.proto.event_pb2 import Event
    seen = set()
    for path in _event_files(tb_dir):
        for r in _records(paths.Path(path).read_bytes()):
            e = Event.FromString(r[12:-4])
            seen.update((v.tag, e.step) for v in e.summary.value)
    out = []
    for row in rows:
        step = int(round(row["kimg"] * 1000))
        tags = {k: v.tag for k, v in zip(_scalar_keys(row), _summary(row).value)}
        lacking = {k: row[k] for k, tag in tags.items() if (tag, step) not in seen}
        seen.update((tag, step) for tag in tags.values())
        if lacking:
            out.append(dict(kimg=row["kimg"], **lacking))
    return out


class EventWriter:
    """A TensorBoard event file of its own in `tb_dir` (a new name, never an existing
    file's), each event written and flushed to the OS before `write` returns: a process
    killed after `write` leaves the event whole, one killed during it leaves a last
    record cut short, which the readers here leave out."""

    def __init__(self, tb_dir: str):
        import socket
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.record_writer import RecordWriter
        os.makedirs(tb_dir, exist_ok=True)
        base = os.path.join(tb_dir, f"events.out.tfevents.{int(time.time())}."
                                    f"{socket.gethostname()}")
        path, n = base, 0
        while os.path.exists(path):
            n += 1
            path = f"{base}.{n}"
        self.path = path
        self.f = RecordWriter(path)
        self.write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write(self, event) -> None:
        self.f.write(event.SerializeToString())
        self.f.flush()

    def add_row(self, row: dict) -> None:
        """One event at step `kimg` * 1000 holding every scalar of the stats row `row`."""
        from tensorboardX.proto.event_pb2 import Event
        self.write(Event(wall_time=time.time(), step=int(round(row["kimg"] * 1000)),
                         summary=_summary(row)))

    def close(self) -> None:
        self.f.close()


class StatsLogger:
    """Appends status dicts to `stats.jsonl` and TensorBoard scalars in `tb/`, from a
    run that starts at `start_nimg`.

    Each row is written to `stats.jsonl`, then as one TensorBoard event holding all its
    scalars (`EventWriter`, written before `log` returns). A run killed between the two
    leaves a row that TensorBoard lacks in part or whole: the next start writes what
    the event files lack of the rows it keeps (`missing_scalars`), so every row of
    `stats.jsonl` is whole in TensorBoard too.

    Each step keeps one value: the rows of a run that went past `start_nimg` before it
    was stopped (its later checkpoints lost or set aside, or `resume_step` older) are
    dropped from `stats.jsonl` (rewritten by `paths.write_text_atomic`, so a crash
    leaves the old file or the new one) and their events from the TensorBoard event
    files (`drop_events_after`), so that neither holds a step twice; the rows at or
    before `start_nimg` are kept. A fresh start (`start_nimg` 0) keeps none.

    On a URL workdir (`gs://`, objects cannot be appended to): `stats.jsonl` is
    rewritten whole at every `log` (its earlier lines read once at the start), and the
    TensorBoard event file is written to a local temporary directory and copied to
    `WORKDIR/tb/` after every `log`."""

    def __init__(self, workdir: str, start_nimg: int):
        self.path = os.path.join(workdir, STATS_JSONL)
        self.tb_dir = os.path.join(workdir, TB)
        self.url = paths.is_url(workdir)
        old = paths.read_text(self.path) if paths.isfile(self.path) else ""
        kept = rows_up_to(old, start_nimg)
        if kept != old:
            paths.write_text_atomic(self.path, kept)
        drop_events_after(self.tb_dir, start_nimg)
        lacking = missing_scalars(self.tb_dir, [json.loads(x) for x in kept.splitlines()])
        if self.url:
            import tempfile
            self.lines = kept
            self.local_tb = tempfile.mkdtemp(prefix="edm2_jax_tb_")
            self.f = None
            self.tb = EventWriter(self.local_tb)
        else:
            self.f = open(self.path, "a")
            self.tb = EventWriter(self.tb_dir)
        for row in lacking:
            self.tb.add_row(row)
        if self.url and lacking:
            self._upload_tb()

    def log(self, stats: dict) -> None:
        """Append `stats` (with `kimg`, the TensorBoard step being `kimg` * 1000)."""
        if self.url:
            self.lines += json.dumps(stats) + "\n"
            paths.Path(self.path).write_text(self.lines)
        else:
            self.f.write(json.dumps(stats) + "\n")
            self.f.flush()
        self.tb.add_row(stats)
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
