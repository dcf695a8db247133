"""What the training loop reports and advises, and how it stops.

The claims:
- The logged figures of a status line are the means over every step since the previous
  status line: two runs that differ only in how often they checkpoint log the same loss
  at the same steps.
- Status lines (and snapshots, checkpoints) land at the first step whose image count
  reaches each whole multiple of their interval, also where the batch size does not
  divide it, and print the exact kimg; their img/s counts training time only (sample
  grids, evaluations and probes left out).
- A signal during a sample grid is acknowledged at once, naming the grid; the grid
  finishes and the checkpoint of that step is saved; a signal before a snapshot's grid
  skips the grid (the snapshot is saved).
- After a divergence, the printed advice resumes and trains when followed exactly: the
  learning rate that trained the healthy checkpoint (not a tenth of the one that
  diverged), and a gradient clip only when none is set.
- A second SIGTERM ends training at once: one `error:` line, exit status 143, no
  traceback; the next start deletes the unfinished save and resumes from the last
  complete checkpoint. A signal before the state is restored is reported as "during
  start-up", never as step 0 of a resumed run.
- `--mode=export` writes the recorded `use_fp16` of a network into the release pickle.

The runs are the tiny run of tests/test_train.py (with its compilation cache).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest

from edm2_jax.training import loop, preemption, resume, snapshot_outputs
from edm2_jax.training.progress import NonFiniteLossError, Schedule, StepMetrics, status_line
from tests.test_train import (FMNIST_CONFIG, REPO, TINY_OVERRIDES, _steps, make_image_folder,
                              tiny_config, xla_cache)  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _stats(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "stats.jsonl").read_text().splitlines() if x.strip()]


def _sums(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "train.lock"}


@pytest.fixture(scope="module")
def data(tmp_path_factory, xla_cache):
    return make_image_folder(tmp_path_factory.mktemp("figures") / "data")


# --------------------------------------------------------------------------------------
# Status lines independent of the checkpoint cadence


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_logged_loss_does_not_depend_on_the_checkpoint_cadence(data, tmp_path):
    """6 steps, a status line every 3: checkpoints every step or only at the end give
    the same logged loss (the mean of the 3 steps) at steps 3 and 6."""
    common = {"total_kimg": 0.048, "status_kimg": 0.024, "snapshot_kimg": 0.048}
    logged = {}
    for every in (0.008, 0.048):
        run = tmp_path / f"ck{every}"
        loop.train_and_evaluate(tiny_config(data, checkpoint_kimg=every, **common), str(run))
        logged[every] = [(s["step"], s["loss/loss"]) for s in _stats(run) if "loss/loss" in s]
    assert [s for s, _ in logged[0.008]] == [3, 6]
    assert logged[0.008] == logged[0.048], logged


def _schedule(batch_size: int, total_kimg: float, status_kimg: float) -> Schedule:
    return Schedule.of_kimg(batch_size, total_kimg=total_kimg, status_kimg=status_kimg,
                            snapshot_kimg=status_kimg, checkpoint_kimg=status_kimg)


def test_status_lines_land_at_whole_multiples_of_status_kimg():
    """Each status line at the first step whose image count reaches k * status_kimg
    (k = 1, 2, ...): the smallest n with n * batch >= k * interval, ceil(k * interval /
    batch), worked out per multiple; where the batch divides the interval, every
    interval / batch steps (the release's `nimg % status_nimg == 0`)."""
    # Fashion-MNIST's default: batch 64, status every 4 kimg, 64 kimg in all.
    sched = _schedule(64, 64, 4)
    due = [n for n in range(1, sched.total_steps + 1) if sched.status_due(n)]
    assert due == [math.ceil(k * 4000 / 64) for k in range(1, 17)]
    assert due[:4] == [63, 125, 188, 250] and due[-1] == sched.total_steps == 1000
    kimg = [n * 64 / 1000 for n in due]
    assert all(k * 4 <= x < k * 4 + 0.064 for k, x in enumerate(kimg, 1))  # never drifts
    # A batch that divides the interval: the release's rule.
    sched = _schedule(50, 10, 1)
    assert [n for n in range(1, 201) if sched.status_due(n)] == \
        [n for n in range(1, 201) if n * 50 % 1000 == 0]
    # An interval smaller than a batch: every step.
    sched = _schedule(64, 1, 0.016)
    assert all(sched.status_due(n) for n in range(1, 20))
    # The status line prints the exact kimg.
    stats = dict(kimg=63 * 64 / 1000, **{"loss/loss": 1.5}, lr=1e-2, sec_per_kimg=5.0,
                 img_per_sec=200.0, mem_gib=1.0)
    assert status_line(stats).startswith("kimg     4.032  loss 1.5000")


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_img_per_sec_counts_training_time_only(capsys):
    """4 steps of 8 images, 1 s each, and a 100 s sample grid in between: the status line
    says 32 / 4 = 8 img/s and 4 s / 0.032 kimg = 125 sec/kimg (by hand); the next
    interval counts from there, without the grid."""
    clock = _Clock()
    log = StepMetrics(batch_size=8, workdir="run", nimg=0, clock=clock)
    for step in range(4):
        clock.t += 1.0
        log.add({"objective": np.float32(1.0), "loss/loss": np.float32(2.0)}, step)
        if step == 1:
            with log.excluded():
                clock.t += 100.0
    s = log.status(4)
    assert (s["img_per_sec"], s["sec_per_kimg"], s["loss/loss"]) == (8.0, 125.0, 2.0)
    assert s["time"] == 104.0  # the wall time since the start includes the grid
    assert "First step done 1.0 s after start" in capsys.readouterr().out
    clock.t += 2.0
    log.add({"objective": np.float32(1.0), "loss/loss": np.float32(2.0)}, 4)
    assert log.status(5)["img_per_sec"] == 4.0  # 8 images in 2 s


# --------------------------------------------------------------------------------------
# The rescue advice after a divergence


def _advised_flags(message: str) -> dict:
    """The `--config.FIELD=VALUE` flags of "re-run the same command with ..." in the
    message, as `{field: value}`."""
    m = re.search(r"re-run the same command with ((?:--config\.\S+=\S+ ?)+)", message)
    assert m, message
    out = {}
    for flag in m.group(1).split():
        field, value = flag[len("--config."):].split("=", 1)
        out[field] = float(value) if "." in value or "e" in value else int(value)
    return out


def _apply(config: ml_collections.ConfigDict, flags: dict) -> ml_collections.ConfigDict:
    for field, value in flags.items():
        *parents, leaf = field.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[leaf] = type(node[leaf])(value)
    return config


@pytest.mark.slow
@pytest.mark.ci
def test_following_the_rescue_advice_resumes_and_trains(data, tmp_path):
    """Healthy to step 2 at ref_lr 0.01, then ref_lr=1e30: diverges; the advice names
    checkpoint 2 and the rate that trained it (0.01), and the clip (not set); the same
    command with exactly the advised flags trains to the end with a finite loss."""
    run = tmp_path / "run"
    loop.train_and_evaluate(tiny_config(data, total_kimg=0.016), str(run))
    assert _steps(run) == [2]
    bad = {"optim.ref_lr": 1e30, "total_kimg": 0.048}
    with pytest.raises(NonFiniteLossError) as e:
        loop.train_and_evaluate(tiny_config(data, **bad), str(run))
    msg = str(e.value)
    flags = _advised_flags(msg)
    assert flags == {"resume_step": 2, "optim.ref_lr": 0.01}, msg
    assert "--config.optim.grad_clip=1" in msg, msg
    r = loop.train_and_evaluate(_apply(tiny_config(data, **bad), flags), str(run))
    assert r["finished"] and _steps(run)[-1] == 6
    assert all(np.isfinite(s["loss/loss"]) for s in _stats(run) if "loss/loss" in s)


def test_rescue_advice_never_repeats_what_diverged():
    """`rescue_flags`: the most recent lower rate that trained before the healthy step;
    without one, a tenth of the rate; the clip only when none is set."""
    history = [{"step": 0, "ref_lr": 0.01, "grad_clip": 0.0},
               {"step": 12, "ref_lr": 1e30, "grad_clip": 1.0}]
    flags, why = resume.rescue_flags(12, history, lr=1e30, grad_clip=1.0)
    assert flags == ["--config.resume_step=12", "--config.optim.ref_lr=0.01"]
    assert "grad_clip" not in why
    # The rate itself trained to the healthy checkpoint, then diverged: a tenth of it.
    flags, why = resume.rescue_flags(16, history[:1], lr=0.01, grad_clip=0.0)
    assert flags == ["--config.resume_step=16", "--config.optim.ref_lr=0.001"]
    assert "--config.optim.grad_clip=1" in why
    # A history with a start after the healthy step: that start trained nothing kept.
    assert resume.optim_history({"optim_history": history}, {"optim": {"ref_lr": 0.02}}, 12) \
        == [history[0], {"step": 12, "ref_lr": 0.02, "grad_clip": 0.0}]
    # A config.json from before the history counts its rate from step 0.
    assert resume.optim_history({"optim": {"ref_lr": 0.01}}, {"optim": {"ref_lr": 1e30}}, 8) \
        == [{"step": 0, "ref_lr": 0.01, "grad_clip": 0.0},
            {"step": 8, "ref_lr": 1e30, "grad_clip": 0.0}]


# --------------------------------------------------------------------------------------
# Signals


def _popen(workdir: Path, overrides: dict, cache: str) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    return subprocess.Popen(
        [sys.executable, "-m", "edm2_jax.main", f"--config={FMNIST_CONFIG}:tiny",
         f"--workdir={workdir}", *[f"--config.{k}={v}" for k, v in overrides.items()]],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _no_bar(text: str) -> list[str]:
    """The non-empty lines of `text` that are not tqdm's progress bar."""
    return [x for x in re.split(r"[\r\n]", text)
            if x.strip() and not re.search(r"\d+%\||step/s|s/step", x)]


@pytest.mark.slow
@pytest.mark.ci
def test_second_sigterm_stops_at_once_with_one_line_and_the_rerun_resumes(
        data, tmp_path, xla_cache):
    run = tmp_path / "run"
    overrides = {**TINY_OVERRIDES, "data.path": data, "total_kimg": 8.0,
                 "checkpoint_kimg": 0.008, "snapshot_kimg": 8.0}
    proc = _popen(run, overrides, xla_cache)
    out = []
    for line in proc.stdout:
        out.append(line)
        if "First step done" in line:  # signal once a checkpoint is complete
            deadline = time.time() + 120
            while not _steps(run) and time.time() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
        if line.startswith("Received signal 15 at step"):
            time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            break
    rest, err = proc.communicate(timeout=300)
    log = "".join(out) + rest
    assert proc.returncode == 143, (log[-2000:], err[-3000:])
    assert "Traceback" not in err + log and "Exception ignored" not in err + log, err[-3000:]
    lines = _no_bar(err)
    assert len(lines) == 1, err[-3000:]
    assert re.fullmatch(r"error: second signal 15 at step \d+: stopped at once, without "
                        r"saving\. .*re-run the same command to resume from the latest\.",
                        lines[0]), lines
    complete = _steps(run)
    assert complete, log[-2000:]

    # The next start deletes an unfinished save and resumes from the newest checkpoint.
    (run / "checkpoints" / f"{complete[-1] + 1}.orbax-checkpoint-tmp-1").mkdir()
    more = {**overrides, "total_kimg": (complete[-1] + 2) * 8 / 1000}
    proc = _popen(run, more, xla_cache)
    log, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (log[-2000:], err[-3000:])
    assert f"Resuming in {run} at step {complete[-1]}," in log, log[-2000:]
    assert not list(run.glob("*/*orbax-checkpoint-tmp*"))
    assert _steps(run)[-1] == complete[-1] + 2


def test_a_signal_before_the_state_is_restored_is_reported_as_start_up(capsys):
    """The step of a signal is the restored state's, not 0 of a resumed run."""
    with preemption.StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    assert stop.signal == signal.SIGINT and stop.received_at is None
    assert "Received signal 2 during start-up" in capsys.readouterr().out
    assert stop.where(stop.received_at) == "during start-up"
    with preemption.StopRequest() as stop:
        stop.step = 12
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    assert stop.received_at == 12 and "Received signal 2 at step 12" in capsys.readouterr().out


def test_a_signal_during_the_sample_grid_is_acknowledged_at_once_then_saved(
        data, tmp_path, monkeypatch, capsys):
    """SIGINT sent while step 2's sample grid samples (4 steps, a snapshot at step 2, a
    checkpoint only at step 4): the line acknowledging it, naming the grid, comes before
    the grid's own line; the grid is written, then checkpoint 2, and the run stops
    there."""
    grid = snapshot_outputs.save_sample_grid

    def grid_with_a_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        grid(*args, **kwargs)
        print("<grid returned>")

    monkeypatch.setattr(snapshot_outputs, "save_sample_grid", grid_with_a_signal)
    run = tmp_path / "run"
    cfg = tiny_config(data, snapshot_kimg=0.016, checkpoint_kimg=0.032)
    r = loop.train_and_evaluate(cfg, str(run))
    out = capsys.readouterr().out
    assert not r["finished"] and r["step"] == 2
    ack = ("Received signal 2 at step 2 during the sample grid: finishing it, then saving a "
           "checkpoint and exiting")
    assert ack in out and out.index(ack) < out.index("<grid returned>"), out
    assert (run / "samples" / "000000000016.png").exists()
    assert _steps(run) == [2] and _steps(run, "snapshots") == [2]
    assert [s["step"] for s in _stats(run)] == [2]


def test_a_signal_before_a_snapshot_skips_its_grid(data, tmp_path, monkeypatch, capsys):
    """SIGINT while step 2 (a snapshot step) trains: the snapshot and checkpoint 2 are
    saved, the grid is skipped and says so."""
    make_iterator = loop.data_lib.make_iterator

    def signalling_iterator(*args, **kwargs):
        for i, batch in enumerate(make_iterator(*args, **kwargs)):
            if i == 1:
                os.kill(os.getpid(), signal.SIGINT)
            yield batch

    monkeypatch.setattr(loop.data_lib, "make_iterator", signalling_iterator)
    run = tmp_path / "run"
    r = loop.train_and_evaluate(tiny_config(data, snapshot_kimg=0.016), str(run))
    out = capsys.readouterr().out
    assert not r["finished"] and r["step"] == 2
    assert "Received signal 2 at step 1: finishing this step" in out, out
    assert "sample grid and evaluation skipped: stopping (the snapshot is saved)" in out
    assert not (run / "samples").exists() or not list((run / "samples").iterdir())
    assert _steps(run) == [2] and _steps(run, "snapshots") == [2]


# --------------------------------------------------------------------------------------
# Export


# Slow (~15-25 s on 2 cores): a run trained and exported through the command line.
@pytest.mark.slow
@pytest.mark.ci
def test_export_writes_the_recorded_use_fp16(tmp_path):
    """A network checkpoint recorded as `use_fp16: false` (converted from a release
    pickle that ran in float32) exports with use_fp16=False, and converting the export
    back records it again; without a record the release's default is left alone."""
    pytest.importorskip("torch")
    from edm2_jax.model import networks
    from edm2_jax.modes import release as release_mode
    from edm2_jax.release import convert, pickle_io
    from edm2_jax.run import network_dir
    cfg = dict(img_resolution=8, img_channels=2, label_dim=3, model_channels=4,
               channel_mult=[1, 2], num_blocks=1, attn_resolutions=[4], channels_per_head=4,
               logvar_channels=8)
    net = networks.precond_from_config(cfg)
    variables = jax.device_get(networks.init_variables(net, jax.random.PRNGKey(0)))
    for use_fp16 in (False, True, None):
        meta = {} if use_fp16 is None else {"use_fp16": use_fp16}
        src = network_dir.save_network(str(tmp_path / f"net-{use_fp16}"), variables, cfg, meta)
        pkl = release_mode.main_export(src, str(tmp_path / f"net-{use_fp16}.pkl"))
        weights = pickle_io.load_release(pkl)
        assert weights.info.get("use_fp16") == use_fp16, weights.info
        if use_fp16 is False:
            back = convert.convert(pkl, str(tmp_path / "back"))
            assert network_dir.read_network_json(back)[1]["use_fp16"] is False
