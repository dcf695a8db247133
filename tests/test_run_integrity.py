"""A run directory's integrity records cannot be turned off by losing a file, and the
files a run writes do not depend on what they should not.

The claims:
- Each checkpoint and snapshot has two copies of its integrity record: Orbax's
  `_CHECKPOINT_METADATA` and the run's own `records/<kind>/<step>.json`. With one copy
  lost, the other checks the arrays; with both lost, whatever the run's config.json
  says, the step is not trusted: a checkpoint is set aside and the one before is used
  (or the run stops naming `--config.start_over`), a snapshot is refused by post-hoc EMA
  and generate with one line naming it. Copies that disagree are not trusted either.
- An emptied `checkpoints/` beside the run's snapshots stops the run, naming
  `--config.start_over`, instead of starting a second run over the first one's outputs;
  restarted so (or when no checkpoint restores), a run that starts from another run (a student from its teacher) refuses
  that run's edited config.json as a fresh start does.
- Sample grids are named by the images trained on: none overwrites another.
- Reading a healthy run prints no Orbax warning.

The corruption is 16 bytes XOR 0x01 in an array data file: most such flips decode to
wrong but finite values, which only the checksums catch.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from edm2_jax.run import integrity, layout, records
from edm2_jax.training import loop
from tests.test_train import (FMNIST_CONFIG, REPO, TINY_OVERRIDES, _restore, _steps,
                              tiny_config, xla_cache)  # noqa: F401

# Runs stopped by an error leave Orbax's background event loop to be collected later.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

SNAPSHOT_EVERY_2 = {"snapshot_kimg": 0.016}  # snapshots (and sample grids) at steps 2 and 4


def _config(data, **overrides):
    return tiny_config(data, **SNAPSHOT_EVERY_2, **overrides)


@pytest.fixture(scope="module")
def full_run(tiny_run_snapshots):
    """The uninterrupted 4-step run: checkpoints and snapshots 2 and 4 (`_config`): the
    session's `tiny_run_snapshots` (tests/conftest.py), read-only: tests change a copy."""
    data, run = tiny_run_snapshots["data"], tiny_run_snapshots["run"]
    assert _steps(run) == [2, 4] and _steps(run, "snapshots") == [2, 4]
    return dict(data=data, run=run, final=_restore(run, 4)[1])


def _copy(full_run, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(full_run["run"], run)
    return run


def _sums(root: Path) -> dict:
    """sha256 of every file under `root` (relative path -> hex), the lock file aside."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "train.lock"}


def _under(sums: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in sums.items() if k.startswith(prefix)}


def _equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


def _finite_flip(item: Path) -> None:
    """XOR 0x01 into 16 bytes in the middle of the largest array data file of Orbax item
    `item` (compressed data: the values decode wrong but, mostly, finite)."""
    files = [p for p in item.rglob("*") if p.is_file() and p.parent.name == "d"
             and "ocdbt.process" in str(p)]
    path = max(files, key=lambda p: p.stat().st_size)
    b = bytearray(path.read_bytes())
    for i in range(len(b) // 2, len(b) // 2 + 16):
        b[i] ^= 0x01
    path.write_bytes(bytes(b))


def _lose_records(run: Path, kind: str, step: int, which: str) -> None:
    """Delete Orbax's copy of a step's record (`which` 'orbax') or both copies ('both')."""
    (run / kind / str(step) / layout.STEP_METADATA).unlink()
    if which == "both":
        Path(layout.record_path(str(run), kind, step)).unlink()


def _cli(args: list[str], cache: str, log_compiles: bool = True
         ) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               JAX_LOG_COMPILES="1" if log_compiles else "0", JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    return subprocess.run([sys.executable, "-m", "edm2_jax.main", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def _train_args(run: Path, data) -> list[str]:
    flags = {**TINY_OVERRIDES, **SNAPSHOT_EVERY_2, "data.path": data}
    return [f"--config={FMNIST_CONFIG}:tiny", f"--workdir={run}",
            *[f"--config.{k}={v}" for k, v in flags.items()]]


def _one_error(r: subprocess.CompletedProcess, pattern: str, compiles: bool = False) -> str:
    """The run failed with exit status 1 and exactly one `error:` line matching
    `pattern`, no traceback; nothing compiled, or (`compiles`: a training start, which
    reads checkpoints onto the model's shardings) no training step."""
    log = r.stdout + r.stderr
    assert r.returncode == 1, log[-3000:]
    errors = [x for x in log.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), log[-3000:]
    assert "Traceback" not in log and "First step" not in log, log[-3000:]
    assert compiles or "Compiling" not in log, log[-3000:]
    return errors[0]


# --------------------------------------------------------------------------------------
# Checkpoints


@pytest.mark.parametrize("lost, flipped, set_aside", [
    # The run's copy still checks the arrays. The flipped bytes fall in compressed data:
    # most often they decode to wrong finite values, which the checksum catches; where
    # they hit a compressed block's header (where they land depends on how Orbax packed
    # the arrays into OCDBT's data file; both occur) the reader fails first. Either way
    # the checkpoint is set aside in one line.
    ("orbax", True, r"checksum mismatch|corrupt or unreadable \(Encountered error while "
                    r"reading"),
    ("both", True, r"has no integrity record"),    # not trusted: set aside
    ("both", False, r"has no integrity record"),   # not trusted, even if intact
    ("orbax", False, None),                        # intact, checked by the run's copy
])
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_checkpoint_whose_record_is_lost_is_checked_or_set_aside(full_run, tmp_path, capsys,
                                                                 lost, flipped, set_aside):
    run = _copy(full_run, tmp_path)
    _lose_records(run, "checkpoints", 4, lost)
    if flipped:
        _finite_flip(run / "checkpoints" / "4" / "default")
    before = _sums(run)

    r = loop.train_and_evaluate(_config(full_run["data"]), str(run))
    out = capsys.readouterr()
    assert r["finished"]
    after = _sums(run)
    for part in ("checkpoints/2/", "snapshots/", "records/snapshots/", "samples/"):
        assert _under(after, part) == _under(before, part), part
    if set_aside is None:
        assert "Nothing to do" in out.out and not (run / "checkpoints" / "4.corrupt").exists()
        del after["config.json"], before["config.json"]  # rewritten by every start
        assert after == before
        return
    lines = [x for x in out.err.splitlines() if "checkpoint 4 is corrupt" in x]
    assert len(lines) == 1 and re.search(set_aside, lines[0]), out.err
    assert "moved to checkpoints/4.corrupt" in lines[0]
    assert f"Resuming in {run} at step 2," in out.out and "at step 4," not in out.out
    assert _under(after, "checkpoints/4.corrupt/") == _under(before, "checkpoints/4/")
    assert _equal(_restore(run, 4)[1], full_run["final"])  # trained again from step 2
    assert records.step_record(str(run / "checkpoints" / "4"))["digests"]  # both copies
    assert Path(layout.record_path(str(run), "checkpoints", 4)).is_file()


def test_records_that_disagree_are_not_trusted(full_run, tmp_path, capsys):
    """The run's copy of checkpoint 4's record altered (one checksum): set aside."""
    run = _copy(full_run, tmp_path)
    own = Path(layout.record_path(str(run), "checkpoints", 4))
    rec = json.loads(own.read_text())
    name = sorted(rec["digests"])[0]
    rec["digests"][name][0] ^= 1
    own.write_text(json.dumps(rec))
    with pytest.raises(integrity.IntegrityError, match="differs from the run's copy"):
        records.step_record(str(run / "checkpoints" / "4"))
    r = loop.train_and_evaluate(_config(full_run["data"]), str(run))
    err = capsys.readouterr().err
    assert r["finished"] and (run / "checkpoints" / "4.corrupt").is_dir()
    assert re.search(r"checkpoint 4 is corrupt .*differs from the run's copy", err), err
    assert _equal(_restore(run, 4)[1], full_run["final"])


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_cli_no_checkpoint_with_a_record_exits_1_naming_start_over(full_run, tmp_path,
                                                                   xla_cache):
    """Both checkpoints without records and flipped: exit 1 naming start_over; nothing
    resumed or trained; the checkpoints' bytes kept under `<step>.corrupt`."""
    run = _copy(full_run, tmp_path)
    for step in (2, 4):
        _lose_records(run, "checkpoints", step, "both")
        _finite_flip(run / "checkpoints" / str(step) / "default")
    before = _sums(run)
    r = _cli(_train_args(run, full_run["data"]), xla_cache)
    _one_error(r, r"none restores \(set aside: checkpoints/2\.corrupt, checkpoints/4\.corrupt"
                  r"\); nothing was trained.*--config\.start_over=True", compiles=True)
    assert "Resuming" not in r.stdout and "Starting" not in r.stdout
    after = _sums(run)
    assert {k: v for k, v in after.items() if not k.startswith("checkpoints/")} == \
        {k: v for k, v in before.items() if not k.startswith("checkpoints/")}
    for step in (2, 4):
        assert (_under(after, f"checkpoints/{step}.corrupt/")
                == _under(before, f"checkpoints/{step}/"))


# --------------------------------------------------------------------------------------
# Snapshots


def test_cli_phema_refuses_a_snapshot_without_its_record(full_run, tmp_path, xla_cache):
    from edm2_jax import nets
    run = _copy(full_run, tmp_path)
    _lose_records(run, "snapshots", 4, "both")
    _finite_flip(run / "snapshots" / "4" / "ema")
    before = _sums(run)
    out = tmp_path / "phema"
    r = _cli(["--mode=phema", f"--workdir={run}", "--sigma_rel=0.07", f"--outdir={out}"],
             xla_cache)
    _one_error(r, rf"snapshot {run}/snapshots/4 has no integrity record .*its run records "
                  rf"one for every step.*mv {run}/snapshots/4 {run}/snapshots/4\.corrupt")
    assert not out.exists() or not any(out.iterdir())
    assert _sums(run) == before
    # Every other reader of that snapshot refuses it the same way.
    from edm2_jax.run import snapshots
    for read in (lambda: snapshots.restore_snapshot(str(run), 4),
                 lambda: snapshots.snapshot_checker(str(run), 4),
                 lambda: snapshots.run_buffers(str(run)),
                 lambda: nets.load_net(str(run / "snapshots" / "4"))):
        with pytest.raises(integrity.IntegrityError, match="snapshots/4 has no integrity"):
            read()


def test_snapshot_with_one_copy_of_its_record_is_still_checked(full_run, tmp_path):
    from edm2_jax.ema.reconstruction import reconstruct
    run = _copy(full_run, tmp_path)
    _lose_records(run, "snapshots", 4, "orbax")
    [net] = reconstruct(str(run), [0.07], out_dir=str(tmp_path / "ok"), progress=False)
    assert Path(net).is_dir()  # intact: read through the run's copy
    # The flipped bytes fall in compressed data: they decode to wrong values, which the
    # run's copy of the record catches, or (where they hit a compressed block's header,
    # as Orbax packed the arrays) the reader fails first; refused in one line either way.
    _finite_flip(run / "snapshots" / "4" / "ema")
    with pytest.raises(integrity.IntegrityError,
                       match=r"snapshots/4.*(checksum mismatch|is unreadable)"):
        reconstruct(str(run), [0.07], out_dir=str(tmp_path / "bad"), progress=False)


def test_a_step_without_its_record_is_refused_whatever_config_json_says(full_run, tmp_path):
    """Both copies of the records of checkpoint 4 and snapshot 4 deleted, and config.json
    without an `integrity_records` entry: neither step is read unchecked. Every step is
    saved with its record, so a step without one is refused by its readers, naming it,
    whatever config.json holds."""
    from edm2_jax import nets
    from edm2_jax.run import checkpoints
    run = _copy(full_run, tmp_path)
    config = json.loads((run / "config.json").read_text())
    config.pop("integrity_records", None)
    (run / "config.json").write_text(json.dumps(config))
    assert records.step_record(str(run / "snapshots" / "4"))["digests"]
    for kind in ("checkpoints", "snapshots"):
        _lose_records(run, kind, 4, "both")
        with pytest.raises(integrity.IntegrityError, match=f"{kind}/4 has no integrity record"):
            records.step_record(str(run / kind / "4"))
    with pytest.raises(integrity.IntegrityError,
                       match="checkpoint .*checkpoints/4 has no integrity record"):
        checkpoints.restore_latest_state(str(run))
    with pytest.raises(integrity.IntegrityError,
                       match="snapshot .*snapshots/4 has no integrity record"):
        nets.load_net(str(run / "snapshots" / "4"))


# --------------------------------------------------------------------------------------
# Run directory: emptied checkpoints, sample grid names, a quiet reader


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_cli_emptied_checkpoints_exit_1_naming_start_over(full_run, tmp_path, xla_cache):
    run = _copy(full_run, tmp_path)
    for p in (run / "checkpoints").iterdir():
        shutil.rmtree(p)
    before = _sums(run)
    r = _cli(_train_args(run, full_run["data"]), xla_cache)
    _one_error(r, rf"the run in {run} has no checkpoint left in checkpoints/ but has EMA "
                  rf"snapshots \(snapshots/4, snapshots/2\) and records of 2 checkpoint.*"
                  rf"--config\.start_over=True", compiles=True)
    assert "Starting" not in r.stdout and "Resuming" not in r.stdout
    assert _sums(run) == before
    r = loop.train_and_evaluate(_config(full_run["data"], start_over=True), str(run))
    assert r["finished"] and _steps(run) == [2, 4]
    [old] = run.glob("discarded-*")
    assert _under(_sums(old), "snapshots/") == _under(before, "snapshots/")
    assert _under(_sums(old), "records/") == _under(before, "records/")
    assert _equal(_restore(run, 4)[1], full_run["final"])


@pytest.mark.parametrize("kind", ["run", "snapshot"])
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_start_over_refuses_an_edited_config_json_of_the_run_it_starts_from(
        full_run, tmp_path, kind):
    """A distillation student whose teacher is a run (or its snapshot), its checkpoint
    corrupt, restarted with `--config.start_over`: the teacher's config.json edited
    (`network.sigma_data`) is refused as a fresh start refuses it, in one message naming
    the field and both values, before the teacher's arrays are read; nothing trained."""
    teacher = _copy(full_run, tmp_path)
    path = teacher / "snapshots" / "4" if kind == "snapshot" else teacher
    config = _config(full_run["data"], objective="consistency", total_kimg=0.016,
                     **{"distill.teacher": str(path), "distill.steps": 2,
                        "distill.teacher_steps": 4})
    student = tmp_path / "student"
    assert loop.train_and_evaluate(config, str(student))["finished"]
    assert _steps(student) == [2]
    _finite_flip(student / "checkpoints" / "2" / "default")  # none restores: start over
    with open(teacher / "config.json") as f:
        edited = json.load(f)
    edited["network"]["sigma_data"] = 0.25
    (teacher / "config.json").write_text(json.dumps(edited))
    message = (f"{teacher}/config.json differs from the copy of the run's config that "
               f"checkpoint 4 keeps (network.sigma_data: checkpoint 0.5 vs now 0.25): it was "
               f"edited, and the run's networks were not trained with it. Put those "
               f"settings back in config.json.")
    with pytest.raises(integrity.IntegrityError) as e:  # a fresh start, refused at set-up
        loop.train_and_evaluate(config, str(tmp_path / "fresh"))
    assert str(e.value) == message
    config.start_over = True
    with pytest.raises(integrity.IntegrityError) as e:
        loop.train_and_evaluate(config, str(student))
    assert str(e.value) == message, "start_over trusted the teacher's edited config.json"
    assert _steps(student) == [] and not (tmp_path / "fresh" / "checkpoints").exists()


def test_snapshots_before_the_first_checkpoint_restart_normally(full_run, tmp_path, capsys):
    """A run killed after a snapshot but before its first checkpoint completed (no
    checkpoint, no record of one): it starts again from step 0 as before."""
    run = _copy(full_run, tmp_path)
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(run / "records" / "checkpoints")
    r = loop.train_and_evaluate(_config(full_run["data"]), str(run))
    assert r["finished"] and f"Starting in {run} at step 0," in capsys.readouterr().out
    assert _equal(_restore(run, 4)[1], full_run["final"])


def test_sample_grids_below_1_kimg_are_all_kept(full_run):
    assert sorted(p.name for p in (full_run["run"] / "samples").iterdir()) == [
        "000000000016.png", "000000000032.png"]
    assert layout.samples_path_at("w", 2_147_483_648) == "w/samples/002147483648.png"


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_cli_generate_from_a_healthy_run_prints_no_orbax_warning(full_run, tmp_path,
                                                                 xla_cache):
    run = _copy(full_run, tmp_path)
    before = _sums(run)
    r = _cli(["--mode=generate", f"--net={run}", "--seeds=0-1", "--steps=2",
              f"--outdir={tmp_path / 'out'}"], xla_cache, log_compiles=False)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert "does not exist" not in log and not re.search(r"^(W\d{4} |WARNING)", log, re.M), log
    assert len(list((tmp_path / "out").glob("*.png"))) == 2
    assert _sums(run) == before
