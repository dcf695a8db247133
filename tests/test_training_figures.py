"""What the training loop reports and advises, and how it stops.

The claims:
- The logged figures of a status line are the means over every step since the previous
  status line: two runs that differ only in how often they checkpoint log the same loss
  at the same steps.
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
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest

from edm2_jax.training import loop, preemption
from edm2_jax.training.progress import NonFiniteLossError
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


def test_rescue_advice_never_repeats_what_diverged(data):
    """`rescue_flags`: the most recent lower rate that trained before the healthy step;
    without one, a tenth of the rate; the clip only when none is set."""
    history = [{"step": 0, "ref_lr": 0.01, "grad_clip": 0.0},
               {"step": 12, "ref_lr": 1e30, "grad_clip": 1.0}]
    cfg = tiny_config(data, **{"optim.ref_lr": 1e30, "optim.grad_clip": 1.0})
    flags, why = loop.rescue_flags(12, history, cfg)
    assert flags == ["--config.resume_step=12", "--config.optim.ref_lr=0.01"]
    assert "grad_clip" not in why
    # The rate itself trained to the healthy checkpoint, then diverged: a tenth of it.
    cfg = tiny_config(data, **{"optim.ref_lr": 0.01})
    flags, why = loop.rescue_flags(16, history[:1], cfg)
    assert flags == ["--config.resume_step=16", "--config.optim.ref_lr=0.001"]
    assert "--config.optim.grad_clip=1" in why
    # A history with a start after the healthy step: that start trained nothing kept.
    assert loop.optim_history({"optim_history": history}, {"optim": {"ref_lr": 0.02}}, 12) \
        == [history[0], {"step": 12, "ref_lr": 0.02, "grad_clip": 0.0}]
    # A config.json from before the history counts its rate from step 0.
    assert loop.optim_history({"optim": {"ref_lr": 0.01}}, {"optim": {"ref_lr": 1e30}}, 8) \
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


# --------------------------------------------------------------------------------------
# Export


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
