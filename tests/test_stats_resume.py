"""A run's logs after a resume (`run/stats.py`): each step has one value.

The claims:
- A run resumed from a checkpoint older than its last status line (the newer
  checkpoint lost) replaces the rows past that checkpoint in `stats.jsonl`: one row per
  step, the rows up to the checkpoint kept as they were, the rows after it equal to
  those of an uninterrupted run; the TensorBoard event files hold one value per step
  too (their events past the checkpoint are dropped, not hidden).
- A run stopped by a signal between two status points writes no row for the stop, and
  once resumed logs the rows of an uninterrupted run (the checkpoint keeps the running
  sums of the status interval), in stats.jsonl and in TensorBoard.
- The rewrite is crash-safe: a kill before its rename leaves the old file whole.
- A row of `stats.jsonl` is whole in TensorBoard: written there before `log` returns,
  and a row a kill left without its scalars (or with some) gets them at the next start.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from pathlib import Path

import pytest

from edm2_jax import paths
from edm2_jax.run import stats as stats_lib
from edm2_jax.training import loop
from tests.test_train import make_image_folder, tiny_config, xla_cache  # noqa: F401

# What differs between two runs of the same steps: wall-clock figures.
TIMING = ("sec_per_kimg", "img_per_sec", "mem_gib", "time")


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "stats.jsonl").read_text().splitlines()]


def _tensorboard_scalars(tb: Path) -> dict:
    """`{tag: [(step, value), ...]}` of every event in the raw event files in `tb`, in
    file-name order: nothing hidden (no purge rule applied), so a step written twice
    appears twice."""
    from tensorboardX.proto.event_pb2 import Event
    seen: dict = {}
    for path in sorted(tb.iterdir()):
        data, pos = path.read_bytes(), 0
        while pos < len(data):  # TFRecord: length, its CRC, the record, its CRC
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for value in event.summary.value:
                seen.setdefault(value.tag, []).append((event.step, value.simple_value))
    return seen


def _without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_a_stop_between_status_points_logs_what_an_uninterrupted_run_logs(
        tmp_path, xla_cache, monkeypatch):
    """6 steps, a status line every 3, checkpoints every 2: SIGINT during step 5 stops the
    run after step 5 (a checkpoint, no status line); the resumed run's row at step 6 is
    the uninterrupted run's (the mean of steps 4-6), in stats.jsonl and TensorBoard."""
    data = make_image_folder(tmp_path / "data")
    config = tiny_config(data, total_kimg=0.048, status_kimg=0.024, snapshot_kimg=0.048)
    full, run = tmp_path / "full", tmp_path / "run"
    loop.train_and_evaluate(config, str(full))
    reference = _rows(full)
    assert [r["step"] for r in reference] == [3, 6]

    make_iterator = loop.data_lib.make_iterator

    def signalling_iterator(*args, **kwargs):
        for i, batch in enumerate(make_iterator(*args, **kwargs)):
            if i == 4:
                os.kill(os.getpid(), signal.SIGINT)
            yield batch

    with monkeypatch.context() as m:
        m.setattr(loop.data_lib, "make_iterator", signalling_iterator)
        r = loop.train_and_evaluate(config, str(run))
    assert not r["finished"] and r["step"] == 5
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [2, 4, 5]
    assert [x["step"] for x in _rows(run)] == [3]  # no row for the stop

    r = loop.train_and_evaluate(config, str(run))
    assert r["finished"] and r["step"] == 6
    assert _without_timing(_rows(run)) == _without_timing(reference)
    assert _tensorboard_scalars(run / "tb")["loss/loss"] == \
        _tensorboard_scalars(full / "tb")["loss/loss"]


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_resume_from_an_older_checkpoint_keeps_one_row_per_step(tmp_path, xla_cache):
    """4 steps with a status line at every step and checkpoints at 2 and 4; checkpoint 4
    lost (a kill after the status line of step 4, before its checkpoint), the rerun
    resumes from 2: rows 1-2 kept as written, rows 3-4 those of the uninterrupted run."""
    data = make_image_folder(tmp_path / "data")
    full, run = tmp_path / "full", tmp_path / "run"
    config = tiny_config(data, status_kimg=0.008)  # a status line every step of 8 images
    loop.train_and_evaluate(config, str(full))
    shutil.copytree(full, run)
    shutil.rmtree(run / "checkpoints" / "4")
    shutil.rmtree(run / "snapshots" / "4")
    before = _rows(run)
    assert [r["step"] for r in before] == [1, 2, 3, 4]

    r = loop.train_and_evaluate(config, str(run))
    assert r["finished"] and r["step"] == 4
    rows, reference = _rows(run), _rows(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[:2] == before[:2]
    for got, want in zip(rows[2:], reference[2:]):
        assert {k: v for k, v in got.items() if k not in TIMING} == \
            {k: v for k, v in want.items() if k not in TIMING}
    assert stats_lib.read_stats(str(run)) == rows

    scalars = _tensorboard_scalars(run / "tb")
    assert [s for s, _ in scalars["loss/loss"]] == [8, 16, 24, 32]
    assert [v for _, v in scalars["loss/loss"]] == pytest.approx(
        [r["loss/loss"] for r in reference], rel=1e-6)  # float32 in the event file


def test_rows_past_the_start_are_dropped_crash_safely(tmp_path, monkeypatch):
    """`StatsLogger(workdir, start_nimg)` keeps the rows up to `start_nimg` (not the
    last line cut short by a kill) and drops the later ones; a kill before the rename
    of the rewritten file leaves the old file whole; a fresh start keeps none."""
    text = "".join(json.dumps(dict(kimg=k / 1000, step=k // 8, loss=k)) + "\n"
                   for k in (8, 16, 24, 32)) + '{"kimg": 0.04'
    (tmp_path / "stats.jsonl").write_text(text)

    def killed(src, dst):
        raise KeyboardInterrupt("killed before the rename")
    with monkeypatch.context() as m:
        m.setattr(paths.os, "replace", killed)
        with pytest.raises(KeyboardInterrupt):
            stats_lib.StatsLogger(str(tmp_path), 16)
    assert (tmp_path / "stats.jsonl").read_text() == text

    logger = stats_lib.StatsLogger(str(tmp_path), 16)
    logger.log(dict(kimg=0.024, step=3, loss=-24.0))
    logger.close()
    assert [(r["step"], r["loss"]) for r in _rows(tmp_path)] == [(1, 8), (2, 16), (3, -24.0)]

    stats_lib.StatsLogger(str(tmp_path), 0).close()
    assert (tmp_path / "stats.jsonl").read_text() == ""
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_logged_row_is_in_the_event_file_before_log_returns(tmp_path):
    """A kill -9 at any moment after `log` returns (the logger never closed) leaves every
    scalar of the row in the event files."""
    logger = stats_lib.StatsLogger(str(tmp_path), 0)
    row = dict(kimg=0.016, step=2, **{f"loss/x{i}": float(i) for i in range(15)})
    logger.log(row)
    scalars = _tensorboard_scalars(tmp_path / "tb")  # read before close, as after a kill
    assert scalars == {k: [(16, float(v))] for k, v in row.items() if k != "kimg"}
    logger.close()


def test_a_row_killed_before_its_scalars_is_completed_on_resume(tmp_path):
    """A run killed after the row of step 16 reached stats.jsonl and 10 of its 15 scalars
    reached TensorBoard: the resumed logger writes the other 5 (and the whole row 8 a
    kill left out), once; the rows past the start are still dropped."""
    from tensorboardX import SummaryWriter
    rows = [dict(kimg=k / 1000, **{f"m/x{i}": float(k + i) for i in range(15)})
            for k in (8, 16, 24)]
    (tmp_path / "stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = SummaryWriter(str(tmp_path / "tb"))
    for i in range(10):
        w.add_scalar(f"m/x{i}", float(16 + i), 16)
    for i in range(15):
        w.add_scalar(f"m/x{i}", float(24 + i), 24)
    w.close()

    stats_lib.StatsLogger(str(tmp_path), 16).close()
    scalars = {t: sorted(v) for t, v in _tensorboard_scalars(tmp_path / "tb").items()}
    assert scalars == {f"m/x{i}": [(8, 8.0 + i), (16, 16.0 + i)] for i in range(15)}, scalars
    stats_lib.StatsLogger(str(tmp_path), 16).close()  # complete already: nothing added
    assert {t: sorted(v) for t, v in _tensorboard_scalars(tmp_path / "tb").items()} == scalars
