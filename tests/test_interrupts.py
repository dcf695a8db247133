"""Every command ends in one line, and a signal loses nothing complete.

The claims, on the command line (`python -m edm2_jax.main`) of the session's tiny run,
each process sent SIGTERM or SIGINT once its first batch is done (a line it prints on
stdout says so):
- `--mode=generate` exits 143 (SIGTERM) or 130 (SIGINT) with one `error:` line and no
  traceback, naming how many seeds' PNGs it kept; those are whole PNGs (the batch in
  flight's are deleted) and no grid is written.
- `--mode=eval` saves its partial state on SIGTERM as on SIGINT and exits with one line
  naming it; the same command resumes from it, stopped again by SIGINT, then finishes,
  with the figures of an uninterrupted run.
- `--mode=phema` stopped while it writes its second output keeps the first, complete,
  and leaves nothing of the second (no temporary directory); the same command keeps the
  first and writes the second.
- In-process: a signal during an update of the eval's statistics waits for it to end
  (`stream.signals_held`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from edm2_jax.evaluation import stream
from edm2_jax.run import network_dir
from tests.test_train import REPO

# The CLI under stand-ins: markers on stdout after each batch / output, a pause after
# them so that the signal comes while the command still works, and (eval) the channel
# means of the images as the features of `fid` (no Inception weights needed).
_DRIVER = """
import os, sys, time, runpy
from pathlib import Path
from edm2_jax.sampling import seed_images
from edm2_jax.run import network_dir
from edm2_jax.evaluation import metrics
import numpy as np

pause = float(os.environ.get("TEST_PAUSE_S", "0"))
real_generate = seed_images.generate_images

def generate_images(*a, **kw):
    for i, batch in enumerate(real_generate(*a, **kw)):
        yield batch
        print(f"BATCH {i} done", flush=True)
        time.sleep(pause)
seed_images.generate_images = generate_images

def features(params, images):
    images = np.asarray(images, np.float64)
    return np.concatenate([images.mean((1, 2)), images.std((1, 2))], axis=1)
metrics.feature_extractor = lambda metric, dinov2=None: (None, features)

real_write, writes = network_dir._write_network, []
def write_network(path, *a, **kw):
    writes.append(path)
    if len(writes) >= 2 and pause:  # the second output: cut short while it is written
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "partial").write_bytes(b"half an output")
        print("WRITING 2", flush=True)
        time.sleep(600)
    real_write(path, *a, **kw)
    print(f"SAVED {len(writes)}", flush=True)
network_dir._write_network = write_network

runpy.run_module("edm2_jax.main", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("interrupts")
    (root / "inception-standin.pt").write_bytes(b"stand-in weights")
    path = root / "driver.py"
    path.write_text(_DRIVER)
    return path


def _env(driver: Path, pause: float) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                TEST_PAUSE_S=str(pause), EDM2_JAX_CACHE=str(driver.parent / "cache"),
                EDM2_INCEPTION_WEIGHTS=str(driver.parent / "inception-standin.pt"),
                PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def _run(driver: Path, argv: list[str], marker: str | None = None, sig: int | None = None,
         pause: float = 0.0) -> tuple[int, str, str]:
    """`(returncode, stdout, stderr)` of the CLI under the driver; with `marker`, `sig`
    is sent as soon as stdout has a line starting with it."""
    p = subprocess.Popen([sys.executable, str(driver), *argv], env=_env(driver, pause),
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    try:
        if marker:
            deadline = time.time() + 600
            for line in p.stdout:
                out.append(line)
                if line.startswith(marker):
                    p.send_signal(sig)
                    break
                assert time.time() < deadline, "".join(out)[-3000:]
        rest, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, "".join(out) + rest, err


def _one_line(err: str) -> str:
    """The one `error:` line of stderr (lines cut by progress bars' returns too), and no
    traceback."""
    assert "Traceback" not in err, err[-3000:]
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def _pngs(folder: Path) -> list[int]:
    seeds = []
    for p in sorted(folder.glob("*.png")):
        with PIL.Image.open(p) as img:
            img.load()  # a PNG cut short fails here
        seeds.append(int(p.stem))
    return seeds


# Slow (~10-15 s each on 2 loaded cores): a CLI generate of the tiny run.
@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_generate_stopped_by_a_signal_keeps_whole_pngs_and_says_so_in_one_line(
        tiny_run, driver, tmp_path, sig):
    out, grid = tmp_path / "out", tmp_path / "grid.png"
    rc, so, err = _run(driver, ["--mode=generate", f"--net={tiny_run['run']}",
                                "--seeds=0-39", "--batch=2", "--steps=2", f"--outdir={out}",
                                f"--grid={grid}"], "BATCH 0 done", sig, pause=0.5)
    assert rc == 128 + sig, (rc, err[-3000:])
    line = _one_line(err)
    kept = _pngs(out)
    assert line == (f"error: stopped by {signal.Signals(sig).name}: the PNGs of the "
                    f"{len(kept)} of 40 seeds done are kept in {out} (--grid={grid} is "
                    f"written only once every image is done); re-run the same command to "
                    f"finish"), line
    assert 2 <= len(kept) < 40 and kept == list(range(len(kept)))
    assert not grid.exists() and not list(tmp_path.glob(".grid*"))


# Slow (~45 s on 2 loaded cores): four CLI evals of the tiny run.
@pytest.mark.slow
@pytest.mark.ci
def test_eval_stopped_by_sigterm_then_sigint_resumes_to_the_uninterrupted_figures(
        tiny_run, driver, tmp_path):
    argv = ["--mode=eval", f"--net={tiny_run['run']}", "--metrics=fid", "--num_images=16",
            "--batch=2", "--steps=2"]
    rc, so, err = _run(driver, argv + [f"--out_json={tmp_path / 'whole.jsonl'}"])
    assert rc == 0, err[-3000:]
    whole = json.loads((tmp_path / "whole.jsonl").read_text())

    results = tmp_path / "eval.jsonl"
    state = Path(stream.partial_path(str(results), 0))
    argv += [f"--out_json={results}"]
    rc, so, err = _run(driver, argv, "BATCH 1 done", signal.SIGTERM, pause=0.5)
    assert rc == 143, (rc, err[-3000:])
    line = _one_line(err)
    with np.load(state) as z:
        first = len(z["ids"])
    assert line == (f"error: stopped by SIGTERM: {first} of the 16 images are measured and "
                    f"kept in {state}, from which the same command resumes; re-run the "
                    f"same command to finish"), line
    assert 4 <= first < 16 and not results.exists()

    rc, so, err = _run(driver, argv, "BATCH 1 done", signal.SIGINT, pause=0.5)
    assert rc == 130, (rc, err[-3000:])
    assert f"Resuming from {state}: {first} of 16 images done" in so, so[-3000:]
    _one_line(err)
    with np.load(state) as z:
        second = len(z["ids"])
    assert first + 4 <= second < 16

    rc, so, err = _run(driver, argv)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert f"Resuming from {state}: {second} of 16 images done" in so, so[-3000:]
    row = json.loads(results.read_text())
    assert row["fid16"] == whole["fid16"] and row["images_generated"] == 16 - second
    assert not state.exists()


# Slow (~15 s on 2 loaded cores): two CLI post-hoc EMAs of the tiny run.
@pytest.mark.slow
@pytest.mark.ci
def test_phema_stopped_while_writing_keeps_the_complete_output_and_nothing_else(
        tiny_run, driver, tmp_path):
    out = tmp_path / "out"
    argv = ["--mode=phema", f"--workdir={tiny_run['run']}", "--sigma_rel=0.03,0.05",
            f"--outdir={out}"]
    rc, so, err = _run(driver, argv, "WRITING 2", signal.SIGTERM, pause=1.0)
    assert rc == 143, (rc, err[-3000:])
    line = _one_line(err)
    first, second = out / "phema-0000000-0.030", out / "phema-0000000-0.050"
    assert line == (f"error: stopped by SIGTERM: 1 of the 2 outputs are complete in {out} "
                    f"and kept (the output in progress is not there: outputs are renamed "
                    f"into place whole), and the same command writes the others; re-run the "
                    f"same command to finish"), line
    assert sorted(p.name for p in out.iterdir()) == [first.name]   # no temporary left
    network_dir.load_network(str(first))

    rc, so, err = _run(driver, argv)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert f"Kept {first}: complete" in so
    assert sorted(p.name for p in out.iterdir()) == [first.name, second.name]
    network_dir.load_network(str(second))


# --------------------------------------------------------------------------------------
# In-process


def test_a_signal_waits_for_the_statistics_update_in_progress():
    """Within `signals_held` a signal is acted on by the handler in place before only at
    its end: the update in progress is whole."""
    seen = []
    before = signal.signal(signal.SIGTERM, lambda s, f: seen.append(("handled", s)))
    try:
        with stream.signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            seen.append("update done")
        assert seen == ["update done", ("handled", signal.SIGTERM)]
    finally:
        signal.signal(signal.SIGTERM, before)
