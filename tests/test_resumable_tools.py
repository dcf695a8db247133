"""Tools that are stopped part-way leave nothing half-written under a final name, and a
re-run finishes the job.

The claims:
- `--mode=phema` writes each output as `<name>.unfinished` and renames it when
  complete; a re-run after a kill keeps the complete outputs (saying so), deletes the
  unfinished one (naming it) and writes it again, equal to an uninterrupted run. A
  directory of something else under an output's name is refused with one `error:` line
  naming it and `--outdir`, before anything is read or written.
- `dataset_tool convert` stopped by a corrupt image exits 1 with one `error:` line and
  leaves no data set (zip or folder) and no temporary file; what a killed run left at
  the temporary name is deleted by the next run.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from edm2_jax.run import network_dir
from tests.test_train import REPO

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def _sums(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "train.lock"}


def _errors(stderr: str) -> list[str]:
    """The lines of stderr that are not tqdm's progress bar nor absl/JAX warnings."""
    return [x for x in stderr.splitlines() if x.strip() and "%|" not in x
            and not x.startswith(("W0", "I0", "WARNING"))]


# --------------------------------------------------------------------------------------
# --mode=phema


@pytest.fixture(scope="module")
def run(tiny_run_snapshots):
    """A tiny run with EMA snapshots at steps 2 and 4: the session's `tiny_run_snapshots`
    (tests/conftest.py), read-only (`--mode=phema` only reads it)."""
    workdir = tiny_run_snapshots["run"]
    assert sorted(p.name for p in (workdir / "snapshots").iterdir() if p.name.isdigit()) \
        == ["2", "4"]
    return workdir


def _phema(workdir: Path, outdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edm2_jax.main", "--mode=phema", f"--workdir={workdir}",
         "--sigma_rel=0.05,0.09", f"--outdir={outdir}"],
        env=ENV, capture_output=True, text=True, cwd=REPO, timeout=600)


# Slow (~30 s on 2 cores): three post-hoc EMA processes, one killed.
@pytest.mark.slow
@pytest.mark.ci
def test_phema_rerun_after_a_kill_keeps_the_complete_outputs_and_redoes_the_rest(
        run, tmp_path):
    out = tmp_path / "out"
    r = _phema(run, out)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = out / "phema-0000000-0.050", out / "phema-0000000-0.090"
    assert sorted(p.name for p in out.iterdir()) == [first.name, second.name]
    done = _sums(first)
    want = network_dir.load_network(str(second))[1]

    # What a kill -9 while writing the second output leaves: its unfinished directory
    # (no network.json yet), and nothing under its name.
    unfinished = out / (second.name + ".unfinished")
    second.rename(unfinished)
    (unfinished / "network.json").unlink()
    r = _phema(run, out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"Kept {first}: complete" in r.stdout, r.stdout
    assert f"Removing {unfinished}: the unfinished output" in r.stdout, r.stdout
    assert _sums(first) == done
    assert not unfinished.exists()
    got = network_dir.load_network(str(second))[1]
    for a, b in zip(jax_leaves(want), jax_leaves(got)):
        np.testing.assert_array_equal(a, b)

    # An output written in place (object storage) that a kill cut short: variables/ only.
    shutil.rmtree(second / "variables" / "params", ignore_errors=True)
    (second / "network.json").unlink()
    r = _phema(run, out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"Removing {second}: the unfinished output" in r.stdout, r.stdout
    assert network_dir.is_network_checkpoint(str(second))


# Slow (~20 s on 2 cores): a run trained for post-hoc EMA processes started on it.
@pytest.mark.slow
@pytest.mark.ci
def test_phema_refuses_a_foreign_directory_under_an_output_name(run, tmp_path):
    out = tmp_path / "out"
    (out / "phema-0000000-0.090").mkdir(parents=True)
    (out / "phema-0000000-0.090" / "notes.txt").write_text("mine")
    before = _sums(tmp_path)
    r = _phema(run, out)
    assert r.returncode == 1, r.stderr[-3000:]
    lines = _errors(r.stderr)
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[0].startswith(f"error: {out / 'phema-0000000-0.090'} exists and is not a "
                               f"network checkpoint"), lines
    assert "--outdir" in lines[0] and "exist_ok" not in lines[0]
    assert _sums(tmp_path) == before


def jax_leaves(tree) -> list:
    import jax
    return jax.tree.leaves(tree)


# --------------------------------------------------------------------------------------
# dataset_tool convert


def _source_with_a_corrupt_image(root: Path) -> Path:
    src = root / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        PIL.Image.fromarray(rng.integers(0, 256, (8, 8, 3), np.uint8)).save(src / f"{i}.png")
    (src / "5.png").write_bytes(b"\x89PNG garbage")
    return src


def _convert(src: Path, dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edm2_jax.data.dataset_tool", "convert",
                           f"--source={src}", f"--dest={dest}", "--quiet"],
                          env=ENV, capture_output=True, text=True, cwd=REPO, timeout=300)


@pytest.mark.parametrize("name", ["out.zip", "outdir"])
def test_convert_stopped_by_a_corrupt_image_leaves_no_data_set(tmp_path, name):
    src = _source_with_a_corrupt_image(tmp_path)
    dest = tmp_path / name
    before = _sums(tmp_path)
    r = _convert(src, dest)
    assert r.returncode == 1, r.stderr
    lines = _errors(r.stderr)
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "5.png" in lines[0] and f"nothing was written to {dest}" in lines[0], lines
    assert not dest.exists() and not Path(str(dest) + ".unfinished").exists()
    assert _sums(tmp_path) == before

    # The same with an empty destination folder: it stays, empty.
    if name == "outdir":
        dest.mkdir()
        assert _convert(src, dest).returncode == 1
        assert dest.is_dir() and not list(dest.iterdir())


def test_convert_after_a_kill_deletes_the_leftover_and_writes_the_whole_set(tmp_path):
    src = _source_with_a_corrupt_image(tmp_path)
    (src / "5.png").unlink()
    dest = tmp_path / "out.zip"
    leftover = Path(str(dest) + ".unfinished")
    leftover.write_bytes(b"PK half a zip")  # what a kill -9 mid-write leaves
    r = _convert(src, dest)
    assert r.returncode == 0, r.stderr
    assert not leftover.exists()
    with zipfile.ZipFile(dest) as z:
        names = z.namelist()
        labels = json.loads(z.read("dataset.json"))
    assert len([n for n in names if n.endswith(".png")]) == 7 and "dataset.json" in names
    assert labels == {"labels": None}
