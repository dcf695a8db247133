"""The test suite, run as the README says (`python -m pytest -q`, in parallel), ends on its
summary line alone, and keeps its caches to itself.

pytest-xdist gives a worker 5 s to exit once it has reported its results, then sends it
SIGINT; whatever the worker still runs then is cut short by a KeyboardInterrupt (printed
as a warning, e.g. from inside the garbage collector's callbacks, and what it was doing
left undone). So a worker does nothing slow at its end: the compilation caches of the
session are removed by the process that made them (tests/conftest.py), after the
workers have ended. Here a session of two workers runs two quick tests on a disk made
slow on purpose (removing a directory takes 6 s).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_SLOW_DISK = """
import shutil, time
_rmtree = shutil.rmtree

def rmtree(path, *args, **kwargs):
    time.sleep(6.0)
    return _rmtree(path, *args, **kwargs)

shutil.rmtree = rmtree
"""


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_a_parallel_session_ends_on_its_summary_and_removes_its_caches(tmp_path):
    (tmp_path / "slow_disk.py").write_text(_SLOW_DISK)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "EDM2_JAX_TEST_", "JAX_COMPILATION_CACHE",
                                "JAX_PERSISTENT_CACHE"))}
    env.update(TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join(
        [str(tmp_path), str(REPO), env.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "slow_disk", "-p",
         "no:cacheprovider", "tests/test_architecture.py", "-k",
         "imports_flow_down or states_its_role"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    lines = [x for x in out.splitlines() if x.strip()]
    assert lines[-1].startswith("2 passed in "), out[-3000:]
    assert not any(w in out for w in ("Warning", "KeyboardInterrupt", "Exception ignored")), \
        out[-3000:]
    assert [p.name for p in tmp.iterdir() if p.name.startswith("edm2-jax-tests-")] == []


def test_the_session_keeps_every_cache_in_its_own_temporary_folder():
    """The suite writes nothing to the user's caches (the README's test command once
    trained the classifier that the user's later `cls` figures used): the classifier and
    reference-statistics cache, the compilation cache and the libraries' caches all lie
    in the session's temporary folder, which the session removes at its end."""
    import tempfile

    from edm2_jax.evaluation import classifier, ref_cache
    root = os.environ["EDM2_JAX_TEST_ROOT"]
    assert Path(root).is_dir() and Path(root).parent == Path(tempfile.gettempdir())
    caches = [classifier.default_cache_dir(), ref_cache.default_cache_dir(),
              os.environ["XDG_CACHE_HOME"], os.environ["MPLCONFIGDIR"]]
    if os.environ.get("EDM2_JAX_COMPILATION_CACHE") != "off":
        caches.append(os.environ["JAX_COMPILATION_CACHE_DIR"])
    for path in caches:
        assert Path(path).is_relative_to(root), (path, root)
