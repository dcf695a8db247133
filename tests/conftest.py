"""What every test shares, set up once per pytest session.

- The XLA flags of the entry points (`edm2_jax/process.py`, `add_default_xla_flags`), set
  here before any test starts JAX's backend, so that tests time and compute what
  `python -m edm2_jax.main` does; likewise `platform_env` (JAX's CPU without libtpu's
  start-up lines where libtpu is installed on a host without a TPU).
- Every cache in a fresh folder of the session (`$EDM2_JAX_TEST_ROOT`), deleted at the
  end by the process that made it (with -n, the controller, once its workers have
  ended): nothing carries over from one session to the next, and nothing is written to
  the user's caches (`~/.cache/edm2_jax`: the classifier and reference statistics of
  `$EDM2_JAX_CACHE`, which the user's own evaluations would then use; nor the
  libraries' `$XDG_CACHE_HOME`, `$MPLCONFIGDIR`).
- One persistent XLA compilation cache for the session, in that folder, in this process
  and in every `python -m edm2_jax.main` (or other JAX program) a test starts: the tiny
  runs of many test files, their resumes and their CLI twins compile the same programs,
  and a cache hit returns the executable that the compile would have produced, so no
  result changes (`EDM2_JAX_TEST_XLA_CACHE=off` runs the suite without it, to check
  that).
- The tiny training runs that tests only read (`tiny_run`, `tiny_run_snapshots`), trained
  once; a test that changes a run copies it first. Their files are checked unchanged at
  the end of the session.
- Tests in parallel (pytest-xdist, `-n auto --dist worksteal` in pyproject.toml; `-n 0`
  runs them in this one process): one worker per CPU core, at most one per 6 GiB of
  memory (`pytest_xdist_auto_num_workers`). Each worker starts with a contiguous half of
  the tests, in file order, and takes over the tail of the other's when it runs out, so
  the tests that share a module-scoped fixture mostly run on one worker. Each worker has
  its own compilation cache and its own session fixtures.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from edm2_jax import process

process.add_default_xla_flags()
os.environ.update(process.platform_env())  # libtpu installed, no TPU: JAX's CPU, quietly

_CACHE_OFF = os.environ.get("EDM2_JAX_TEST_XLA_CACHE", "") == "off"
# The caches of a session live in one directory that the process which made it (the
# pytest process itself, or with -n its controller) removes at its end, after the
# workers have ended: a worker does nothing slow once it has reported its results, when
# pytest-xdist gives it 5 s to exit before sending it SIGINT (a KeyboardInterrupt in
# whatever runs then, e.g. the garbage collector's callbacks, printed as a warning).
# Worker processes and the programs tests start (a child that imports this file among
# them) inherit the directory.
_ROOT_ENV = "EDM2_JAX_TEST_ROOT"
_INHERITED = os.environ.get(_ROOT_ENV) if os.path.isdir(os.environ.get(_ROOT_ENV, "")) else None
_ROOT = _INHERITED or tempfile.mkdtemp(prefix="edm2-jax-tests-")
os.environ[_ROOT_ENV] = _ROOT
# The code's caches (classifiers, reference statistics: evaluation/classifier.py,
# ref_cache.py) and the libraries' (matplotlib's font list, anything under XDG's cache).
os.environ.update(EDM2_JAX_CACHE=os.path.join(_ROOT, "cache"),
                  XDG_CACHE_HOME=os.path.join(_ROOT, "xdg-cache"),
                  MPLCONFIGDIR=os.path.join(_ROOT, "matplotlib"))
_CACHE_DIR = None if _CACHE_OFF else tempfile.mkdtemp(prefix="process-", dir=_ROOT)
if _CACHE_DIR:
    # Read by JAX when it is imported (after this file), here and in subprocesses, which
    # inherit the environment; `process.enable_compilation_cache` keeps a directory set so.
    # Every program is cached, however small or quick to compile.
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_CACHE_DIR,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
else:
    os.environ[process.CACHE_ENV] = "off"  # nor the entry points' default ~/.cache one


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per CPU core this process may use, at most one per 6 GiB of
    memory (a worker with its subprocesses holds up to ~3 GiB)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = 6.0
    return max(1, min(cores or 1, int(mem_gib // 6)))


def pytest_unconfigure(config):
    if not _INHERITED:
        shutil.rmtree(_ROOT, ignore_errors=True)


@pytest.fixture
def standin_inception_weights(tmp_path, monkeypatch) -> Path:
    """For a test whose `fid` features are a stand-in: a stand-in Inception weights file
    (its path, size and modification time key the cached reference statistics,
    `evaluation/ref_cache.py`), so that the test runs without the optional weights
    installed, and the statistics cache in `tmp_path/cache`, not the user's
    ~/.cache/edm2_jax. Returns the weights file."""
    weights = tmp_path / "inception-standin.pt"
    weights.write_bytes(b"stand-in weights")
    monkeypatch.setenv("EDM2_INCEPTION_WEIGHTS", str(weights))
    monkeypatch.setenv("EDM2_JAX_CACHE", str(tmp_path / "cache"))
    return weights


@pytest.fixture(scope="session")
def xla_cache() -> str:
    """The session's compilation cache directory, for tests that start a program with an
    environment of their own ('' when `EDM2_JAX_TEST_XLA_CACHE=off`)."""
    return _CACHE_DIR or ""


# --------------------------------------------------------------------------------------
# Tiny runs trained once per session, read by many test files


def _sums(root: Path) -> dict:
    """sha256 of every file under `root` (relative path -> hex)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _trained_once(root: Path, data: Path, **overrides):
    """`{'data', 'run', 'result'}` of `train_and_evaluate(tiny_config(data, **overrides))`
    in `root/run`; afterwards, fails the session if a test changed any of its files."""
    from edm2_jax.training import loop
    from tests.test_train import tiny_config
    run = root / "run"
    result = loop.train_and_evaluate(tiny_config(data, **overrides), str(run))
    assert result["finished"], result
    before = _sums(run)
    yield dict(data=data, run=run, result=result)
    changed = sorted(set(before.items()) ^ set(_sums(run).items()))
    assert not changed, (f"a test changed the shared tiny run {run} (copy it first): "
                         f"{sorted({k for k, _ in changed})}")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """The shared runs' data: 16 random 8x8 grey PNGs in 2 classes
    (`test_train.make_image_folder`)."""
    from tests.test_train import make_image_folder
    return make_image_folder(tmp_path_factory.mktemp("tiny_data") / "data")


@pytest.fixture(scope="session")
def tiny_run(tiny_data, tmp_path_factory):
    """The 4-step tiny run of `test_train.tiny_config`: checkpoints 2 and 4, the EMA
    snapshot and sample grid at step 4. Read-only."""
    yield from _trained_once(tmp_path_factory.mktemp("tiny_run"), tiny_data)


@pytest.fixture(scope="session")
def tiny_run_snapshots(tiny_data, tmp_path_factory):
    """The same run with EMA snapshots (and sample grids) at steps 2 and 4. Read-only."""
    yield from _trained_once(tmp_path_factory.mktemp("tiny_run_snapshots"), tiny_data,
                             snapshot_kimg=0.016)
