"""benchmarks/scm_side_by_side.py without the fork: a missing or wrong --fork ends the
run with one `error:` line before any worker (or JAX) starts. Its timings are not tested."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "scm_side_by_side.py")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize("make", ["missing", "nodir", "empty", "other"])
def test_bad_fork_is_one_error_line(tmp_path, make):
    if make == "missing":
        args = []
    elif make == "nodir":
        args = [f"--fork={tmp_path / 'absent'}"]
    else:
        if make == "other":  # a checkout with the files but not the fork's loss
            for f in ("training/loss_scm.py", "training/networks_trigflow.py",
                      "torch_utils/persistence.py", "torch_utils/misc.py"):
                (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / f).write_text("# not the fork\n")
        args = [f"--fork={tmp_path}"]
    r = run(*args)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --fork"), r.stderr
    assert "READY" not in r.stdout


def test_bad_counts_refused():
    r = run("--fork=/nonexistent", "--steps=0")
    assert r.returncode != 0 and r.stderr.strip().startswith("error: --steps"), r.stderr
