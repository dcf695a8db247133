"""What a user meets when things go wrong: one `error:` line naming the problem and the fix,
no traceback, no library noise, and nothing lost.

- A missing `--config` file is one line whether or not `--config.FIELD` overrides follow.
- A truncated array file of a snapshot or checkpoint is refused by `--mode=phema` and
  `--mode=generate` with the line a checksum mismatch gives (naming the fix), not
  TensorStore's raw OUT_OF_RANGE.
- A run's config.json deleted or edited does not turn the same-run check off: a resume
  is compared with the copy of the config its checkpoints keep (and refused without
  either); an edited network section is refused by generate and post-hoc EMA too; an
  edited network.json (sigma_data, img_resolution=30000), or one whose integrity record
  is deleted, is refused by its readers.
- A checkpoint whose Orbax `_CHECKPOINT_METADATA` is missing brings no Orbax warning
  before our own lines.
- Images too large to be training data, in `dataset_tool convert` or an image folder.
- A full disk while a sample grid is written: one line naming the disk and its free
  space, no 0-byte grid left behind, the checkpoints intact, and the rerun finishes.
- A learning rate that diverges before any rate of the run has trained: the advice names
  one that trains (the config file's own), and following it trains.

The disks are real: tmpfs mounts (`mount`, root). The runs are the tiny run of
tests/test_train.py (in-process, with its compilation cache) and the CLI on copies of it.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edm2_jax.training import loop, resume
from tests.test_cli_errors import assert_one_error, run_cli, tmpfs  # noqa: F401
from tests.test_train import (FMNIST_CONFIG, REPO, TINY_OVERRIDES, _steps, make_image_folder,
                              tiny_config, xla_cache)  # noqa: F401


def _sums(root: Path) -> dict:
    """sha256 of every file under `root` (relative path -> hex), the lock file aside."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "train.lock"}


def _largest_array_file(item: Path) -> Path:
    files = [p for p in item.rglob("*") if p.is_file() and p.parent.name == "d"
             and "ocdbt.process" in str(p)]
    assert files, f"no array data files under {item}"
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(path: Path, size: int = 1000) -> None:
    assert path.stat().st_size > size, path
    with open(path, "r+b") as f:
        f.truncate(size)


def _error_lines(log: str) -> list[str]:
    return [x for x in log.splitlines() if x.startswith("error:")]


def _cli(argv: list[str], cache: str, driver: Path | None = None
         ) -> subprocess.CompletedProcess:
    """`python -m edm2_jax.main *argv` (or `python driver *argv`) with the tests'
    compilation cache, as test_fault_tolerance's CLI runs, and this checkout's edm2_jax
    first on the path (a driver's directory is not the checkout)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    head = [str(driver)] if driver else ["-m", "edm2_jax.main"]
    return subprocess.run([sys.executable, *head, *argv], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, xla_cache):
    """The 4-step tiny run (checkpoints 2 and 4, snapshot 4) and its data."""
    root = tmp_path_factory.mktemp("hostile")
    data = make_image_folder(root / "data")
    run = root / "run"
    loop.train_and_evaluate(tiny_config(data), str(run))
    assert _steps(run) == [2, 4] and _steps(run, "snapshots") == [4]
    return dict(data=data, run=run)


def _copy(tiny_run, tmp_path: Path, name: str = "run") -> Path:
    run = tmp_path / name
    shutil.copytree(tiny_run["run"], run)
    return run


def _train_flags(tiny_run) -> list[str]:
    """The CLI flags of the tiny run (`--workdir` not included)."""
    return [f"--config={FMNIST_CONFIG}:tiny"] + [
        f"--config.{k}={v}" for k, v in {**TINY_OVERRIDES,
                                         "data.path": tiny_run["data"]}.items()]


# --------------------------------------------------------------------------------------
# A missing config file


@pytest.mark.parametrize("overrides", [[], ["--config.total_kimg=1"],
                                       ["--config.total_kimg=1", "--config.optim.ref_lr=0.1"]])
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_missing_config_file_is_one_line_with_or_without_overrides(tmp_path, overrides):
    missing = tmp_path / "nope.py"
    r = run_cli(f"--config={missing}:tiny", f"--workdir={tmp_path / 'run'}", *overrides)
    assert_one_error(r, "--config: ", str(missing), "No such file",
                     "e.g. --config=configs/fashion_mnist.py:tiny")
    assert "Traceback" not in r.stdout + r.stderr
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------
# A truncated snapshot or checkpoint


@pytest.mark.parametrize("cut", ["largest_array_file", "manifest"])
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_truncated_snapshot_is_refused_by_phema_and_generate_naming_the_fix(tiny_run, tmp_path,
                                                                            cut):
    """The largest array file of snapshot 4 cut to 1000 bytes, or its OCDBT manifest cut
    to 10: `--mode=phema` and `--mode=generate --net=RUN/snapshots/4` each end with one
    `error:` line naming the snapshot, that it is unreadable, and the fix a checksum
    mismatch names (move it aside); nothing is written and the run is unchanged."""
    from edm2_jax.run.snapshots import snapshot_fix
    run = _copy(tiny_run, tmp_path)
    ema = run / "snapshots" / "4" / "ema"
    if cut == "manifest":
        _truncate(ema / "manifest.ocdbt", 10)
    else:
        _truncate(_largest_array_file(ema))
    before = _sums(run)
    fix = snapshot_fix(str(run), 4)
    for argv in (["--mode=phema", f"--workdir={run}", "--sigma_rel=0.07",
                  f"--outdir={tmp_path / 'ph'}"],
                 ["--mode=generate", f"--net={run}/snapshots/4", "--seeds=0-1",
                  f"--outdir={tmp_path / 'gen'}"]):
        r = run_cli(*argv)
        log = r.stdout + r.stderr
        assert r.returncode == 1 and "Traceback" not in log, (argv, log[-3000:])
        [line] = _error_lines(r.stderr)
        assert re.match(rf"error: snapshot {run}/snapshots/4(: array \S+)? is unreadable ",
                        line), line
        assert line.endswith(fix), (line, fix)
    assert not any((tmp_path / "ph").glob("*/network.json"))
    assert not any((tmp_path / "gen").rglob("*.png"))
    assert _sums(run) == before


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_truncated_checkpoint_is_refused_by_generate_naming_the_fix(tiny_run, tmp_path):
    """The largest array file of checkpoint 4 cut to 1000 bytes: `--mode=generate
    --net=RUN` ends with one `error:` line naming the checkpoint and the fix (the
    training command sets it aside; or a snapshot), as for a checksum mismatch."""
    run = _copy(tiny_run, tmp_path)
    _truncate(_largest_array_file(run / "checkpoints" / "4" / "default"))
    before = _sums(run)
    r = run_cli("--mode=generate", f"--net={run}", "--seeds=0-1", f"--outdir={tmp_path / 'gen'}")
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    [line] = _error_lines(r.stderr)
    assert line.startswith(f"error: checkpoint {run}/checkpoints/4 is unreadable "), line
    assert "Re-run the run's training command" in line and "--net=" in line, line
    assert not any((tmp_path / "gen").rglob("*.png"))
    assert _sums(run) == before


# --------------------------------------------------------------------------------------
# A run's config.json deleted; a network.json edited


def test_a_changed_config_is_refused_with_config_json_deleted(tiny_run, tmp_path):
    """config.json deleted alone, the run resumed with another `loss.P_mean`: one
    `error:` line naming the field, both values and the fix (the checkpoints keep a copy
    of the config), exit 1, nothing written, config.json not made again."""
    run = _copy(tiny_run, tmp_path)
    shutil.rmtree(run / "checkpoints" / "4")
    (run / "config.json").unlink()
    before = _sums(run)
    r = run_cli(*_train_flags(tiny_run), f"--workdir={run}", "--config.loss.P_mean=-0.5")
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    [line] = _error_lines(r.stderr)
    assert re.fullmatch(rf"error: the config does not match the run in {run} \(loss\.P_mean: "
                        r"checkpoint -0\.8 vs now -0\.5\)\. Use a new --workdir for a "
                        r"different run, or restore those settings to resume .*", line), line
    assert _sums(run) == before and not (run / "config.json").exists()


def test_a_run_without_config_json_nor_a_copy_of_it_is_refused(tiny_run, tmp_path):
    """config.json deleted and the checkpoints' records without the copy of the config
    (a run that kept none): refused before anything is compiled, naming the fix;
    nothing written. With config.json back, the run resumes."""
    import json
    from edm2_jax.training import resume
    run = _copy(tiny_run, tmp_path)
    config_json = (run / "config.json").read_text()
    (run / "config.json").unlink()
    for step in (2, 4):
        for path in (run / "records" / "checkpoints" / f"{step}.json",
                     run / "checkpoints" / str(step) / "_CHECKPOINT_METADATA"):
            meta = json.loads(path.read_text())
            record = meta["custom_metadata"]["integrity"] if "custom_metadata" in meta else meta
            del record[resume.KEPT_CONFIG]
            path.write_text(json.dumps(meta))
    before = _sums(run)
    with pytest.raises(ValueError, match=rf"{run}/config.json is missing and the checkpoints "
                                         r"of the run \(4, 2\) keep no copy of its config.* "
                                         r"Put the run's config.json back to resume it, or use "
                                         r"a new --workdir\."):
        loop.train_and_evaluate(tiny_config(tiny_run["data"]), str(run))
    assert _sums(run) == before
    (run / "config.json").write_text(config_json)
    assert loop.train_and_evaluate(tiny_config(tiny_run["data"]), str(run))["finished"]


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_config_json_written_again_after_deletion_keeps_every_start(tiny_run, tmp_path):
    """A run of two starts (step 0 at the config's learning rate, step 2 at a lower one),
    config.json deleted: the next start writes it again with the learning rate of every
    start (`optim_history`, from the copy the newest checkpoint keeps), not the last
    alone, so the advice after a divergence still names the rates that trained."""
    import json
    run = _copy(tiny_run, tmp_path)
    for kind in ("checkpoints", "snapshots"):
        shutil.rmtree(run / kind / "4")
    lr = json.loads((run / "config.json").read_text())["optim"]["ref_lr"]
    lower = tiny_config(tiny_run["data"], **{"optim.ref_lr": lr / 2})
    assert loop.train_and_evaluate(lower, str(run))["finished"]
    history = json.loads((run / "config.json").read_text())["optim_history"]
    assert [(h["step"], h["ref_lr"]) for h in history] == [(0, lr), (2, lr / 2)]

    (run / "config.json").unlink()
    assert loop.train_and_evaluate(lower, str(run))["finished"]  # finished: trains nothing
    history = json.loads((run / "config.json").read_text())["optim_history"]
    assert [(h["step"], h["ref_lr"]) for h in history] == [(0, lr), (2, lr / 2), (4, lr / 2)]


def test_an_edited_config_json_is_refused(tiny_run, tmp_path):
    """config.json's `loss.P_mean` edited and the run resumed with the edited value: the
    checkpoints' copy of the config says otherwise, so the resume is refused naming the
    field, both values and the fix; nothing written."""
    import json
    run = _copy(tiny_run, tmp_path)
    shutil.rmtree(run / "checkpoints" / "4")
    config = json.loads((run / "config.json").read_text())
    config["loss"]["P_mean"] = -0.5
    (run / "config.json").write_text(json.dumps(config, indent=2))
    before = _sums(run)
    with pytest.raises(ValueError, match=rf"{run}/config.json differs from the copy of the "
                                         r"run's config that checkpoint 2 keeps \(loss\.P_mean: "
                                         r"checkpoint -0\.8 vs now -0\.5\): it was edited.* Put "
                                         r"those settings back in config.json to resume"):
        loop.train_and_evaluate(tiny_config(tiny_run["data"], **{"loss.P_mean": -0.5}),
                                str(run))
    assert _sums(run) == before


def test_an_edited_network_config_of_a_run_is_refused_by_its_readers(tiny_run, tmp_path):
    """config.json's `network.sigma_data` edited in a run: post-hoc EMA's reader of the
    run refuses it, and `--mode=generate` of its snapshot ends with one `error:` line,
    naming the file, the field, both values and the fix (the checkpoints keep the
    config); nothing is written."""
    import json
    run = _copy(tiny_run, tmp_path)
    config = json.loads((run / "config.json").read_text())
    config["network"]["sigma_data"] = 0.25
    (run / "config.json").write_text(json.dumps(config, indent=2))
    before = _sums(run)
    message = (f"{run}/config.json differs from the copy of the run's config that checkpoint "
               f"4 keeps (network.sigma_data: checkpoint 0.5 vs now 0.25): it was edited, and "
               f"the run's networks were not trained with it. Put those settings back in "
               f"config.json.")
    from edm2_jax.ema import inputs
    from edm2_jax.run.integrity import IntegrityError
    with pytest.raises(IntegrityError) as e:  # what post-hoc EMA reads of a run
        inputs.input_network("run", str(run), [])
    assert str(e.value) == message
    r = run_cli("--mode=generate", f"--net={run}/snapshots/4", "--seeds=0-1",
                f"--outdir={tmp_path / 'gen'}")
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    assert _error_lines(r.stderr) == [f"error: {message}"]
    assert not (tmp_path / "gen").exists() or not any((tmp_path / "gen").rglob("*.png"))
    assert _sums(run) == before


def test_an_edited_objective_of_a_run_is_refused_where_it_is_sampled(tiny_run, tmp_path):
    """config.json's `objective` or its objective's section edited in a run (a diffusion
    run made a 1-step generator; a distillation's `distill.sigma_max` moved): the sampler
    of its networks is refused, naming the field, both values and the fix (the
    checkpoints keep the config), instead of sampling them otherwise than trained."""
    import json
    from edm2_jax import nets
    from edm2_jax.run.integrity import IntegrityError
    run = _copy(tiny_run, tmp_path)
    config = json.loads((run / "config.json").read_text())
    config["objective"] = "consistency"
    config["distill"] = {"teacher": "t", "sigma_max": 2.5}
    (run / "config.json").write_text(json.dumps(config, indent=2))
    for path in (run, run / "snapshots" / "4"):
        with pytest.raises(IntegrityError, match="objective: checkpoint 'edm2' vs now "
                           "'consistency'.*put those settings back"):
            nets.net_sampler(str(path))


def _without_checkpoints(tiny_run, tmp_path: Path) -> Path:
    """A copy of the tiny run without checkpoints/ (pruned, or copied without them) and
    their records: only its snapshot keeps a copy of the config."""
    run = _copy(tiny_run, tmp_path)
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(run / "records" / "checkpoints")
    return run


def _edit(path: Path, edit) -> None:
    import json
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))


@pytest.mark.parametrize("field,value,was", [("network.sigma_data", 0.25, 0.5),
                                             ("data.encoder", "sd-vae", "none")])
def test_a_run_without_checkpoints_refuses_an_edited_config_json(tiny_run, tmp_path, field,
                                                                 value, was):
    """config.json edited in a run whose checkpoints are gone: its snapshot keeps the
    copy, so `--mode=generate` of the snapshot and post-hoc EMA refuse it in one line
    naming the field and both values (an edited `data.encoder` is refused, not advised
    to pass --vae); nothing is written."""
    from edm2_jax.ema import reconstruction
    from edm2_jax.run.integrity import IntegrityError
    run = _without_checkpoints(tiny_run, tmp_path)
    section, key = field.split(".")
    _edit(run / "config.json", lambda c: c[section].__setitem__(key, value))
    before = _sums(run)
    message = (f"{run}/config.json differs from the copy of the run's config that snapshot "
               f"4 keeps ({field}: snapshot {was!r} vs now {value!r}): it was edited, and "
               f"the run's networks were not trained with it. Put those settings back in "
               f"config.json.")
    r = run_cli("--mode=generate", f"--net={run}/snapshots/4", "--seeds=0-1",
                f"--outdir={tmp_path / 'gen'}")
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    assert _error_lines(r.stderr) == [f"error: {message}"]
    with pytest.raises(IntegrityError) as e:
        reconstruction.reconstruct(str(run), [0.05], progress=False)
    assert str(e.value) == message
    assert not (tmp_path / "gen").exists() and _sums(run) == before


def test_phema_never_launders_an_edited_objective_section(tiny_run, tmp_path):
    """A distillation run (its snapshot's copy names the objective and its
    `distill.sigma_max`) without checkpoints, config.json's `distill.sigma_max` edited:
    the sampler of its snapshot and post-hoc EMA refuse it, naming the field and both
    values, so no network checkpoint is written with the edit."""
    import json
    from edm2_jax import nets
    from edm2_jax.ema import reconstruction
    from edm2_jax.run.integrity import IntegrityError
    run = _without_checkpoints(tiny_run, tmp_path)
    def distill(config: dict, sigma_max: float) -> None:
        config.update(objective="consistency", distill={"teacher": "t", "sigma_max": sigma_max})
    metadata = run / "snapshots" / "4" / "_CHECKPOINT_METADATA"   # as a distillation saved it
    kept = json.loads(metadata.read_text())
    distill(kept["custom_metadata"]["config"], 80.0)
    metadata.write_text(json.dumps(kept))
    _edit(run / "config.json", lambda c: distill(c, 2.5))           # the edit
    match = (rf"{run}/config.json differs from the copy of the run's config that snapshot 4 "
             r"keeps \(distill\.sigma_max: snapshot 80\.0 vs now 2\.5\): it was edited.*put "
             r"those settings back")
    with pytest.raises(IntegrityError, match=match):
        nets.net_sampler(str(run / "snapshots" / "4"))
    with pytest.raises(IntegrityError, match=match):
        reconstruction.reconstruct(str(run), [0.05], progress=False)
    assert not (run / "phema").exists()


@pytest.fixture(scope="module")
def network(tiny_run, tmp_path_factory) -> Path:
    """A network checkpoint (network.json + variables/) of the tiny run's EMA."""
    from edm2_jax import nets
    from edm2_jax.run import network_dir
    path = tmp_path_factory.mktemp("network") / "net"
    snapshot = str(tiny_run["run"] / "snapshots" / "4")
    _, variables, _ = nets.load_net(snapshot)
    network_dir.save_network(str(path), variables, nets.net_config(snapshot), {"nimg": 32})
    return path


@pytest.mark.parametrize("field,value,cli", [("sigma_data", 0.25, False),
                                             ("img_resolution", 30000, True)])
def test_an_edited_network_json_is_refused_in_one_line(network, tmp_path, field, value, cli):
    """A field of network.json edited (the sigma_data of the preconditioning; an
    img_resolution of 30000, a 43-line Flax traceback before): its reader refuses it
    naming the file and the fix, and `--mode=generate` ends with that one `error:` line;
    no image is written."""
    import json
    from edm2_jax import nets
    from edm2_jax.run.integrity import IntegrityError
    net = tmp_path / "net"
    shutil.copytree(network, net)
    info = json.loads((net / "network.json").read_text())
    assert info["network"][field] != value
    info["network"][field] = value
    (net / "network.json").write_text(json.dumps(info, indent=2))
    message = (f"{net}/network.json: its network config or meta differs from what was saved "
               f"(checksum mismatch: the file was edited or damaged), so the network it "
               f"describes is not the one trained; write that network checkpoint again "
               f"(--mode=convert or post-hoc EMA)")
    with pytest.raises(IntegrityError) as e:
        nets.load_net(str(net))
    assert str(e.value) == message
    if cli:
        r = run_cli("--mode=generate", f"--net={net}", "--seeds=0-1",
                    f"--outdir={tmp_path / 'gen'}")
        assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
        assert _error_lines(r.stderr) == [f"error: {message}"]
        assert not any((tmp_path / "gen").rglob("*.png"))


@pytest.mark.parametrize("deleted", ["integrity", "integrity.fields_sha256",
                                     "integrity.digests"])
def test_a_network_json_without_its_integrity_record_is_refused(network, tmp_path, deleted):
    """network.json's integrity record deleted, or the digest of its sections or of its
    arrays: each reader refuses the network naming the file and the fix, before any
    array is read, instead of reading its arrays and sections unchecked."""
    import json
    from edm2_jax import nets
    from edm2_jax.run import network_dir
    from edm2_jax.run.integrity import IntegrityError
    net = tmp_path / "net"
    shutil.copytree(network, net)
    info = json.loads((net / "network.json").read_text())
    if deleted == "integrity":
        del info["integrity"]
    else:
        del info["integrity"][deleted.split(".")[1]]
    (net / "network.json").write_text(json.dumps(info, indent=2))
    message = (f"{net}/network.json has no integrity record (the checksums of its arrays "
               f"and sections, which every network checkpoint is saved with): it was deleted "
               f"or damaged, so the network cannot be checked; write that network checkpoint "
               f"again (--mode=convert or post-hoc EMA)")
    for read in (nets.load_net, nets.net_sampler, nets.net_config,
                 network_dir.network_checker):
        with pytest.raises(IntegrityError) as e:
            read(str(net))
        assert str(e.value) == message, read


# --------------------------------------------------------------------------------------
# Orbax's step metadata missing


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_missing_step_metadata_brings_no_orbax_warning(tiny_run, tmp_path):
    """Both checkpoints without `_CHECKPOINT_METADATA` and without the run's own copy of
    their records: the trainer sets each aside with one line and ends with one `error:`
    line, and none of Orbax's "Metadata file does not exist" warnings."""
    run = _copy(tiny_run, tmp_path)
    for step in (2, 4):
        (run / "checkpoints" / str(step) / "_CHECKPOINT_METADATA").unlink()
        (run / "records" / "checkpoints" / f"{step}.json").unlink()
    r = run_cli(*_train_flags(tiny_run), f"--workdir={run}")
    log = r.stdout + r.stderr
    assert r.returncode == 1, log[-3000:]
    assert "Metadata file does not exist" not in log and "checkpoint.py:" not in log, log
    assert len([x for x in r.stderr.splitlines() if "has no integrity record" in x]) == 2, log
    [line] = _error_lines(r.stderr)
    assert "has checkpoints but none restores" in line, line


# --------------------------------------------------------------------------------------
# A full disk while a sample grid is written


def test_grid_on_a_full_disk_names_its_free_space_and_leaves_the_old_file(tmpfs):
    """`paths.write_through_local` (how grids are written) on a real full tmpfs: an
    OutputLocationError naming the disk and its free space and the fix; the grid
    already at that path is unchanged and no temporary file is left."""
    import numpy as np

    from edm2_jax import paths
    from edm2_jax.sampling.sampler import save_image_grid
    d = tmpfs.mount("full", "1m")
    grid = d / "samples" / "000000000032.png"
    grid.parent.mkdir()
    grid.write_bytes(b"the grid of an earlier run")
    tmpfs.fill(d)
    images = np.random.default_rng(0).integers(0, 256, (4, 64, 64, 3), np.uint8)
    with pytest.raises(paths.OutputLocationError,
                       match=rf"writing {grid} failed: the disk mounted at {d} \(\d+ B free of "
                             rf"1\.0 MiB\) is full; free space there and re-run"):
        paths.write_through_local(str(grid), lambda p: save_image_grid(images, p, 2, 2))
    assert sorted(os.listdir(grid.parent)) == [grid.name]
    assert grid.read_bytes() == b"the grid of an earlier run"


_FULL_AT_GRID = """
import os, runpy, sys, time
from edm2_jax.sampling import sampler
save = sampler.save_image_grid

def fill_then_save(images, path, rows, cols):
    # The snapshot of this step complete first, then the disk filled: the grid is the
    # first write to meet the full disk.
    snapshot = os.path.join(os.environ["WORKDIR"], "snapshots", "4")
    t0 = time.time()
    while not os.path.isdir(snapshot) and time.time() - t0 < 120:
        time.sleep(0.1)
    fd = os.open(os.path.join(os.environ["FILLER_DIR"], "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, bytes(1 << 16)):
            pass
    except OSError:
        pass
    os.close(fd)
    return save(images, path, rows, cols)

sampler.save_image_grid = fill_then_save
sys.argv = ["edm2_jax.main"] + sys.argv[1:]
runpy.run_module("edm2_jax.main", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.ci
def test_cli_disk_full_at_the_sample_grid_is_one_line_and_loses_nothing(tiny_run, tmp_path,
                                                                       tmpfs, xla_cache):
    """The tiny run resumed from checkpoint 2 on a real tmpfs that fills just before the
    grid of step 4 is written: exit 1 with one `error:` line naming the grid, the disk
    and its free space, and the fix; no traceback; no grid file (no 0-byte PNG);
    checkpoint 2 and snapshot 4 intact. With the space freed, the same command finishes
    and writes the grid."""
    d = tmpfs.mount("disk", "16m")
    run = _copy(tiny_run, d)
    shutil.rmtree(run / "checkpoints" / "4")
    shutil.rmtree(run / "samples")
    ck2 = _sums(run / "checkpoints" / "2")
    driver = tmp_path / "full_at_grid.py"
    driver.write_text(_FULL_AT_GRID)
    os.environ.update(WORKDIR=str(run), FILLER_DIR=str(d))
    try:
        r = _cli(_train_flags(tiny_run) + [f"--workdir={run}"], xla_cache, driver)
    finally:
        del os.environ["WORKDIR"], os.environ["FILLER_DIR"]
    log = r.stdout + r.stderr
    assert r.returncode == 1, log[-3000:]
    assert "Traceback" not in log and "Errno" not in log, log[-3000:]
    [line] = _error_lines(r.stderr)
    assert re.fullmatch(rf"error: writing {run}/samples/000000000032\.png failed: the disk "
                        rf"mounted at {d} \(\d+ B free of 16\.0 MiB\) is full; free space "
                        rf"there and re-run the same command", line), line
    assert list((run / "samples").iterdir()) == []
    assert _sums(run / "checkpoints" / "2") == ck2 and _steps(run) == [2]
    assert _steps(run, "snapshots") == [4]

    (d / "filler").unlink()
    r = _cli(_train_flags(tiny_run) + [f"--workdir={run}"], xla_cache)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert _steps(run) == [2, 4]
    assert (run / "samples" / "000000000032.png").stat().st_size > 0


# --------------------------------------------------------------------------------------
# A learning rate that diverges from the first step


def test_rescue_advice_names_the_config_files_rate_when_no_rate_of_the_run_trained():
    """Only 1e30 ever trained (and diverged): the advice names the config file's own
    rate, else the default of configs.py; a rate that trained still comes first."""
    from edm2_jax import configs
    diverged = dict(lr=1e30, grad_clip=0.0)  # optim.ref_lr and optim.grad_clip
    only = [{"step": 0, "ref_lr": 1e30, "grad_clip": 0.0}]
    flags, why = resume.rescue_flags(2, only, **diverged, default_ref_lr=0.01)
    assert flags == ["--config.resume_step=2", "--config.optim.ref_lr=0.01"], flags
    assert "config file's own" in why, why
    flags, _ = resume.rescue_flags(2, only, **diverged)
    assert flags[1] == f"--config.optim.ref_lr={configs.base_config().optim.ref_lr:g}"
    trained = [{"step": 0, "ref_lr": 0.003, "grad_clip": 0.0}, {**only[0], "step": 2}]
    flags, _ = resume.rescue_flags(2, trained, **diverged, default_ref_lr=0.01)
    assert flags[1] == "--config.optim.ref_lr=0.003"


@pytest.mark.slow
@pytest.mark.ci
def test_cli_following_the_advice_after_ref_lr_1e30_trains(tiny_run, tmp_path, xla_cache):
    """`--config.optim.ref_lr=1e30` on a new run: one `error:` line whose advice names a
    rate that trains; the same command with the flags it prints (in a new --workdir when
    it says so) trains to the end with a finite loss."""
    command = _train_flags(tiny_run) + ["--config.optim.ref_lr=1e30"]
    r = _cli(command + [f"--workdir={tmp_path / 'first'}"], xla_cache)
    assert r.returncode == 1, (r.stdout + r.stderr)[-3000:]
    [line] = _error_lines(r.stderr)
    advice = re.findall(r"--config\.[\w.]+=[^\s;,()]+", line)
    assert advice == ["--config.optim.ref_lr=0.01"], line  # the config file's own rate
    workdir = tmp_path / ("second" if "new --workdir" in line else "first")
    r = _cli(command + advice + [f"--workdir={workdir}"], xla_cache)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "Training finished" in r.stdout and _steps(workdir) == [2, 4]
    import json
    import math
    losses = [json.loads(x).get("loss/loss") for x in
              (workdir / "stats.jsonl").read_text().splitlines()]
    assert losses and all(math.isfinite(v) for v in losses if v is not None), losses


def _png_claiming(path: Path, width: int, height: int) -> Path:
    """A small PNG file whose header claims `width x height` RGB pixels (a decompression
    bomb's header; its one row of data is all the file holds)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
                     + chunk(b"IDAT", zlib.compress(b"\x00" * (1 + 3 * 16)))
                     + chunk(b"IEND", b""))
    return path


def test_decompression_bomb_in_dataset_tool_convert_is_one_line(tmp_path):
    """A PNG claiming 30000x30000 pixels given to `dataset_tool convert` is refused in one
    `error:` line naming it (PIL's DecompressionBombError was a 28-line traceback), and
    nothing is written."""
    src = tmp_path / "src"
    src.mkdir()
    _png_claiming(src / "bomb.png", 30000, 30000)
    out = tmp_path / "out.zip"
    r = subprocess.run([sys.executable, "-m", "edm2_jax.data.dataset_tool", "convert",
                        f"--source={src}", f"--dest={out}"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    lines = _error_lines(r.stderr)
    assert r.returncode != 0 and len(lines) == 1 and "bomb.png" in lines[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and not out.exists()


def test_images_over_the_largest_training_resolution_are_refused_when_opened(tmp_path):
    """A folder of 30000x30000 PNGs as training data is refused when the data set is
    opened (it set img_resolution 30000 into config.json, compiled, then died allocating
    107 GiB), naming the image and the limit; nothing is written to the workdir."""
    from edm2_jax import data as data_lib
    from edm2_jax.data.image_folder import MAX_RESOLUTION
    folder = tmp_path / "huge"
    folder.mkdir()
    for i in range(2):
        _png_claiming(folder / f"{i}.png", 30000, 30000)
    config = tiny_config(folder, **{"data.use_labels": False})
    with pytest.raises(ValueError, match=rf"30000x30000, larger than the {MAX_RESOLUTION}"):
        data_lib.make_source(config.data)
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match="larger than"):
        loop.train_and_evaluate(config, str(workdir))
    assert not (workdir / "config.json").exists()


# --------------------------------------------------------------------------------------
# Sizes a file declares: bounded before any network is built or memory allocated


@pytest.mark.parametrize("label", [10**12, 2**70])
def test_a_label_beyond_what_a_network_embeds_is_refused_when_opened(tmp_path, label):
    """A data set whose dataset.json gives one image the class 10**12 (a network of 32
    trillion parameters, then a 128 TB allocation) or 2**70 (an OverflowError) is refused
    when it is opened, naming the file, the image and the bound."""
    import json
    from edm2_jax import data as data_lib
    from edm2_jax.data.image_folder import MAX_LABEL_DIM
    data = make_image_folder(tmp_path / "data")
    table = json.loads((data / "dataset.json").read_text())
    table["labels"][3][1] = label
    (data / "dataset.json").write_text(json.dumps(table))
    with pytest.raises(ValueError, match=rf"{data}/dataset.json: label of img003.png is "
                       rf"{label}, more classes than a network's label embedding takes "
                       rf"\(indices below {MAX_LABEL_DIM:,}"):
        data_lib.make_source(tiny_config(data).data)


def test_cli_a_label_of_10_to_the_12_is_one_line_before_any_network_is_built(tmp_path):
    import json
    data = make_image_folder(tmp_path / "data")
    table = json.loads((data / "dataset.json").read_text())
    table["labels"][0][1] = 10**12
    (data / "dataset.json").write_text(json.dumps(table))
    flags = [f"--config={FMNIST_CONFIG}:tiny"] + [
        f"--config.{k}={v}" for k, v in {**TINY_OVERRIDES, "data.path": data}.items()]
    r = run_cli(*flags, f"--workdir={tmp_path / 'run'}")
    assert_one_error(r, f"{data}/dataset.json: label of img000.png is 1000000000000")
    assert "Traceback" not in r.stdout + r.stderr and not (tmp_path / "run").exists()


def _npy_header_only(path: Path, shape: tuple, dtype: str = "<f4", tail: bytes = b"") -> Path:
    """A `.npy` file whose header declares `shape` and whose data is only `tail`."""
    import io
    import numpy as np
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False,
                                               "shape": shape})
    path.write_bytes(buf.getvalue() + tail)
    return path


@pytest.mark.parametrize("shape,words", [
    ((8, 1 << 20, 1 << 20), "larger than the 512 a side"),
    ((8, 64, 64), "its header declares float32 (8, 64, 64) (131,200 bytes with the header), "
                  "but the file holds 144 bytes")])
def test_latents_whose_header_declares_too_much_are_refused_when_opened(tmp_path, shape,
                                                                        words):
    """A latent `.npy` declaring a side of 2**20 (the network would be built at that
    size), or more bytes than the file holds (read only when its batch comes), is
    refused when the data set is opened, naming the file."""
    import numpy as np
    from edm2_jax.data.latents import LatentFolder
    folder = tmp_path / "latents"
    folder.mkdir()
    np.save(folder / "a.npy", np.zeros((8, 64, 64), np.float32))
    _npy_header_only(folder / "0.npy", shape, tail=b"\0" * 16)   # the first in order
    with pytest.raises(ValueError, match=re.escape(f"latent {folder}/0.npy")) as e:
        LatentFolder(str(folder), use_labels=False)
    assert words in str(e.value)


def test_a_nan_latent_is_a_data_error_naming_the_file(tmp_path):
    """A latent holding a NaN is refused as it is read, naming the file (it reached the
    loss, and the run was advised to lower its learning rate)."""
    import numpy as np
    from edm2_jax.data.latents import LatentFolder
    folder = tmp_path / "latents"
    folder.mkdir()
    np.save(folder / "a.npy", np.zeros((8, 8, 8), np.float32))
    bad = np.zeros((8, 8, 8), np.float32)
    bad[2, 3, 4] = np.nan
    np.save(folder / "b.npy", bad)
    source = LatentFolder(str(folder), use_labels=False)
    assert np.isfinite(source[0][0]).all()
    with pytest.raises(ValueError, match=rf"latent {folder}/b.npy holds 1 NaN or infinite "
                       r"values \(of 512\); re-encode it"):
        source[1]


def test_cli_a_network_whose_zarray_shape_is_transposed_is_one_line(tiny_run, tmp_path):
    """A post-hoc EMA output (one directory per array) whose `.zarray` of one weight
    declares the transposed shape reads as bytes its checksums accept: `--mode=generate`
    refuses it in one line naming the array and both shapes (it was 47 lines of
    traceback after "Generating"), before anything is generated."""
    import json
    from edm2_jax import nets
    from edm2_jax.run import network_dir
    snapshot = str(tiny_run["run"] / "snapshots" / "4")
    _, variables, _ = nets.load_net(snapshot)
    net = tmp_path / "net"
    network_dir.save_network(str(net), variables, nets.net_config(snapshot), {"nimg": 32},
                             low_memory=True)
    zarray = net / "variables" / "params.unet.dec_8x8_block0.conv_skip.weight" / ".zarray"
    meta = json.loads(zarray.read_text())
    meta["shape"], meta["chunks"] = meta["shape"][::-1], meta["chunks"][::-1]
    zarray.write_text(json.dumps(meta))
    r = run_cli("--mode=generate", f"--net={net}", "--seeds=0-1", f"--outdir={tmp_path / 'o'}")
    assert_one_error(r, f"network checkpoint {net} is not the network its config describes "
                        f"(params/unet/dec_8x8_block0/conv_skip/weight: (8, 16, 1, 1) where its "
                        f"network config builds (1, 1, 16, 8))")
    assert not (tmp_path / "o").exists()


def test_a_path_name_too_long_for_its_file_system_is_one_line_in_every_mode(tmp_path,
                                                                            capsys):
    """A name of 300 characters where a command writes (`--outdir`, `--out_json`, ...)
    found when it is made: one `error:` line naming it, exit status 1 (`report_errors`);
    `--mode=generate` and `--mode=phema` refuse it before any work (test_outputs_atomic)."""
    from edm2_jax.modes import common
    long = tmp_path / ("z" * 300)
    assert common.report_errors(lambda: os.makedirs(long / "out")) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: {long}: a name in this path is longer than its file "
                                f"system allows; give a shorter one"], err
