"""Outputs are checked where they are written, and written whole or not at all.

The claims:
- A network checkpoint (`network_dir.save_network`, what `--mode=convert` and post-hoc
  EMA write) is written under a temporary name of its writer's own and renamed whole: a
  writer stopped at any point leaves nothing under the output's name and no temporary
  directory; what a killed writer left is deleted by the next writer (naming it), a live
  writer's is left alone; one holding NaN/inf is refused before anything is written.
- Of two writers of one output, one completes it and the other sees that complete
  output: post-hoc EMA keeps it when it was made from the same snapshots (saying so),
  and refuses it in one line otherwise. Two `--mode=phema` processes on one `--outdir`,
  made to finish together, both exit 0 and leave complete outputs that load.
- An eval row is strict JSON of finite figures: a NaN figure is refused naming what to
  check, nothing appended, and the resumable state kept.
- A command never replaces a file it did not write: `--mode=generate --grid=` of a run's
  own sample grid and `--mode=ref --ref=` of existing statistics are refused in one line
  before any work, the file left byte-identical.
"""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edm2_jax.ema import outputs
from edm2_jax.evaluation import commands
from edm2_jax.run import integrity, network_dir
from tests.test_cli_errors import assert_one_error, run_cli
from tests.test_train import REPO

NET = {"img_resolution": 8, "img_channels": 1}


def _variables(seed: int = 0, n: int = 12) -> dict:
    rng = np.random.default_rng(seed)
    return {"params": {f"w{i}": rng.standard_normal((4, 3)).astype(np.float32)
                       for i in range(n)},
            "buffers": {"freqs": rng.standard_normal(5).astype(np.float32)}}


def _beside(path: Path) -> list[str]:
    """The names beside `path` that start with its name, itself included."""
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(path.name))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# --------------------------------------------------------------------------------------
# Network checkpoints: whole or absent


@pytest.mark.parametrize("where", ["orbax", "network.json"])
def test_a_writer_stopped_at_any_point_leaves_nothing(tmp_path, monkeypatch, where):
    out = tmp_path / "net"
    if where == "orbax":  # while the arrays are written
        import orbax.checkpoint as ocp

        def interrupted(self, directory, *a, **kw):
            Path(directory).mkdir(parents=True)
            (Path(directory) / "part").write_bytes(b"half")
            raise KeyboardInterrupt
        monkeypatch.setattr(ocp.Checkpointer, "save", interrupted)
    else:  # after the arrays, before network.json
        from edm2_jax import paths

        def interrupted(path, text):
            raise KeyboardInterrupt
        monkeypatch.setattr(paths, "write_text_atomic", interrupted)
    with pytest.raises(KeyboardInterrupt):
        network_dir.save_network(str(out), _variables(), NET)
    assert _beside(out) == []


def test_what_a_killed_writer_left_is_deleted_by_the_next_and_a_live_ones_is_kept(
        tmp_path, capsys):
    out = tmp_path / "net"
    dead = Path(network_dir.temporary_path(str(out)).rsplit("-", 2)[0]
                + f"-{_dead_pid()}-0badc0de")
    live = Path(network_dir.temporary_path(str(out)))   # this process: alive
    legacy = Path(str(out) + network_dir.UNFINISHED)    # the name of earlier versions
    for d in (dead, live, legacy):
        (d / "variables").mkdir(parents=True)
    assert sorted(network_dir.stale_temporaries(str(out))) == sorted(map(str, (dead, legacy)))
    network_dir.save_network(str(out), _variables(), NET)
    said = capsys.readouterr().out
    assert f"Removing {dead}: the unfinished output of an interrupted run" in said
    assert f"Removing {legacy}:" in said
    assert _beside(out) == sorted([out.name, live.name])
    assert len(network_dir.load_network(str(out))[1]["params"]) == 12


def test_a_network_with_nan_is_refused_before_anything_is_written(tmp_path):
    v = _variables()
    v["params"]["w3"][1, 2] = np.nan
    with pytest.raises(integrity.IntegrityError, match=r"not saving .*non-finite values "
                       r"\(NaN/inf\) in params/w3; check the network or snapshots"):
        network_dir.save_network(str(tmp_path / "net"), v, NET)
    assert list(tmp_path.iterdir()) == []


def test_a_network_written_into_a_folder_of_other_files_is_complete_or_absent(tmp_path,
                                                                           monkeypatch):
    """Into a folder that holds other files, the variables are renamed in whole and
    network.json comes last: stopped before it, the folder holds no network checkpoint."""
    from edm2_jax import paths
    out = tmp_path / "net"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    def interrupted(path, text):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(paths, "write_text_atomic", interrupted)
        with pytest.raises(KeyboardInterrupt):
            network_dir.save_network(str(out), _variables(), NET)
    assert not network_dir.is_network_checkpoint(str(out)) and _beside(out) == [out.name]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "variables"]
    shutil.rmtree(out / "variables")
    network_dir.save_network(str(out), _variables(), NET)
    assert sorted(p.name for p in out.iterdir()) == ["network.json", "notes.txt", "variables"]


# --------------------------------------------------------------------------------------
# Two writers of one output


def _meta(inputs=("s4:0.050", "s4:0.100"), weights=(0.3, 0.7)) -> dict:
    return {"phema": True, "sigma_rel": 0.07, "nimg": 32.0, "inputs": list(inputs),
            "weights": list(weights)}


def test_the_second_writer_keeps_the_first_ones_output_or_refuses_it(tmp_path, capsys):
    out = tmp_path / "phema-0000000-0.070"
    outputs.save_output(str(out), _variables(0), NET, _meta())
    before = hashlib.sha256((out / "network.json").read_bytes()).hexdigest()
    outputs.save_output(str(out), _variables(0), NET, _meta())    # a second run, same inputs
    assert f"Kept {out}: complete, from the same snapshots (written meanwhile by another " \
           f"process)" in capsys.readouterr().out
    with pytest.raises(FileExistsError, match=rf"^{out} was written by another process "
                       r"meanwhile, from other snapshots .*choose another out_dir \(--outdir\)$"):
        outputs.save_output(str(out), _variables(1), NET, _meta(weights=(0.5, 0.5)))
    assert hashlib.sha256((out / "network.json").read_bytes()).hexdigest() == before
    assert _beside(out) == [out.name]


def _racer(path: str, seed: int, barrier, results) -> None:
    """One of two processes writing `path`, held at the rename until both are there."""
    from edm2_jax.run import network_dir as nd
    rename = nd._rename_whole

    def held(src, dst):
        barrier.wait(timeout=120)
        rename(src, dst)
    nd._rename_whole = held
    try:
        outputs.save_output(path, _variables(seed), NET, _meta())
        results.put((seed, "ok"))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put((seed, f"{type(e).__name__}: {e}"))


# Slow (~10 s on 2 loaded cores): two processes that import JAX, made to rename together.
@pytest.mark.slow
@pytest.mark.ci
def test_two_writers_renaming_together_leave_one_complete_output(tmp_path):
    out = tmp_path / "phema-0000000-0.070"
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(str(out), 0, barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    got = [results.get(timeout=5) for _ in procs]
    assert got == [(0, "ok"), (0, "ok")], got
    _, v, meta = network_dir.load_network(str(out))   # complete: every array, checksummed
    assert len(v["params"]) == 12 and meta["inputs"] == _meta()["inputs"]
    assert _beside(out) == [out.name]                  # the loser's temporary deleted


_PHEMA_DRIVER = """
import os, sys, time
sys.argv = [sys.argv[0]] + sys.argv[1:]
from edm2_jax.run import network_dir
rename, flag = network_dir._rename_whole, sys.argv.pop(1)
def held(src, dst):  # both processes reach the rename before either renames
    open(flag + str(os.getpid()), "w").close()
    t = time.time()
    while len([f for f in os.listdir(os.path.dirname(flag)) if f.startswith(
            os.path.basename(flag))]) < 2 and time.time() - t < 120:
        time.sleep(0.05)
    rename(src, dst)
network_dir._rename_whole = held
import runpy
runpy.run_module("edm2_jax.main", run_name="__main__")
"""


# Slow (~20 s on 2 loaded cores, and the session's tiny run): two post-hoc EMA processes.
@pytest.mark.slow
@pytest.mark.ci
def test_two_phema_processes_on_one_outdir_both_leave_complete_outputs(tiny_run, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(_PHEMA_DRIVER)
    out = tmp_path / "out"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    argv = [sys.executable, str(driver), str(tmp_path / "at-rename-"), "--mode=phema",
            f"--workdir={tiny_run['run']}", "--sigma_rel=0.03", f"--outdir={out}"]
    procs = [subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    ends = [p.communicate(timeout=600) for p in procs]
    for p, (so, se) in zip(procs, ends):
        assert p.returncode == 0 and "Traceback" not in se, se[-3000:]
    assert sum("written meanwhile by another process" in so for so, _ in ends) == 1, ends
    name = "phema-0000000-0.030"
    assert sorted(p.name for p in out.iterdir()) == [name]
    _, v, meta = network_dir.load_network(str(out / name))
    want = {k for k in network_dir.tree_metadata(str(out / name / "variables"))["params"]}
    assert set(v["params"]) == want and meta["sigma_rel"] == 0.03


# --------------------------------------------------------------------------------------
# Eval rows


def test_an_eval_row_with_a_nan_figure_is_refused_and_nothing_is_appended(tmp_path,
                                                                          monkeypatch):
    from edm2_jax.evaluation import metrics as metrics_lib
    out_json = tmp_path / "eval.jsonl"
    out_json.write_text('{"fid": 3.1}\n')
    monkeypatch.setattr(metrics_lib, "evaluate",
                        lambda *a, **kw: {"fid": float("nan"), "num_images": 4})
    monkeypatch.setattr(commands.images, "folder_images", lambda *a, **kw: None)
    with pytest.raises(ValueError, match=rf"^the figures fid=nan are not finite, so no row is "
                       rf"appended to {out_json}: check --images=imgs$"):
        commands.main_eval(images_dir="imgs", net_path=None, num_images=4, metrics="cls",
                           ref=None, data_config=None, out_json=str(out_json))
    assert out_json.read_text() == '{"fid": 3.1}\n'
    with pytest.raises(ValueError, match="Out of range float values are not JSON"):
        commands._append_result(str(out_json), {"kid": [0.1, float("inf")]})
    assert commands._nonfinite_fields({"a": {"b": [1.0, float("-inf")]}, "c": None}) == [
        "a.b.1=-inf"]


# --------------------------------------------------------------------------------------
# A command never replaces a file it did not write


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_generate_refuses_a_grid_that_exists_before_any_work(tmp_path):
    import PIL.Image
    grid = tmp_path / "run" / "samples" / "000000000256.png"   # a run's own sample grid
    grid.parent.mkdir(parents=True)
    PIL.Image.fromarray(np.full((8, 16), 7, np.uint8)).save(grid)
    before = grid.read_bytes()
    r = run_cli("--mode=generate", f"--net={tmp_path / 'no-such-net'}", f"--grid={grid}")
    assert_one_error(r, f"--grid={grid} exists; give a new file name")
    assert grid.read_bytes() == before


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_ref_refuses_statistics_that_exist_before_any_work(tmp_path):
    ref = tmp_path / "existing.pkl"
    ref.write_bytes(b"statistics")
    r = run_cli("--mode=ref", f"--images={tmp_path / 'no-such-images'}", f"--ref={ref}")
    assert_one_error(r, f"--ref={ref} exists; give a new file name")
    assert ref.read_bytes() == b"statistics"


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_a_name_longer_than_the_file_system_allows_is_one_line_before_any_work(tmp_path):
    long = tmp_path / ("x" * 300)
    r = run_cli("--mode=generate", f"--net={tmp_path / 'no-such-net'}", f"--outdir={long}")
    assert_one_error(r, "--outdir=", "is 300 bytes long, more than the 255")


def test_a_network_checkpoint_reads_from_a_relative_path_and_a_trailing_slash(tmp_path,
                                                                             monkeypatch):
    """`load_network` takes the path as a user gives it (Orbax itself reads only absolute
    paths): relative, or ending in '/', it reads the same arrays, checksummed."""
    out = tmp_path / "net"
    network_dir.save_network(str(out), _variables(), NET)
    want = network_dir.load_network(str(out))[1]
    monkeypatch.chdir(tmp_path)
    for path in ("net", "net/", "./net"):
        got = network_dir.load_network(path)[1]
        assert _flat(got).keys() == _flat(want).keys()
        for k, v in _flat(want).items():
            np.testing.assert_array_equal(_flat(got)[k], v, err_msg=f"{path}: {k}")


def _flat(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix: np.asarray(tree)}
    return {k2: v2 for k, v in tree.items() for k2, v2 in _flat(v, f"{prefix}/{k}").items()}
