"""Every numeric flag has a declared range (`modes.common.FLAG_RANGES`), checked before
any work: values drawn from the whole float (and int) range are accepted exactly when
they are in range, and otherwise refused in one line naming the flag; seeds are 32-bit;
a sample that overflowed is never written as a PNG."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edm2_jax import main as main_lib
from edm2_jax.modes import common
from edm2_jax.sampling import seed_images

REPO = Path(__file__).resolve().parents[1]
# The mode that reads each flag.
MODE_OF = {"sample_batch": "plan", "at_kimg": "phema", "num_images": "eval",
           "subset_seed": "eval"}


def _check(name: str, text: str) -> str | None:
    """Parse `--mode=M --name=text` and run the checks before work: None when accepted,
    else the error's one line."""
    FLAGS = main_lib.FLAGS
    FLAGS.unparse_flags()
    try:
        FLAGS(["edm2_jax.main", f"--mode={MODE_OF.get(name, 'generate')}", f"--{name}={text}"])
        common.check_flags(FLAGS.mode)
        return None
    except (flags.Error, ValueError) as e:
        return " ".join(str(e).split())
    finally:
        FLAGS.unparse_flags()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(common.FLAG_RANGES)),
       value=st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                       st.integers(-2**70, 2**70)))
def test_every_numeric_flag_is_accepted_exactly_in_its_range(name, value):
    lo, hi, _ = common.FLAG_RANGES[name]
    is_int_flag = isinstance(main_lib.FLAGS[name].parser, flags.IntegerParser)
    text = repr(value) if isinstance(value, float) else str(value)
    error = _check(name, text)
    if is_int_flag and isinstance(value, float):
        assert error is not None  # not an integer: absl's parse error, one line
        return
    number = float(value)
    default = main_lib.FLAGS[name].default
    in_range = (math.isfinite(number) or number == default) and lo <= number <= hi
    if in_range:
        assert error is None, (name, value, error)
    else:
        assert error is not None and f"--{name}" in error, (name, value, error)


@pytest.mark.slow
@pytest.mark.ci
def test_the_hostile_values_are_refused_in_one_line(tmp_path):
    """Hostile values through the command line: exit 1, one
    `error:` line, nothing written."""
    cases = [["--guidance=1e300"], ["--guidance=1e30"], ["--sigma_max=1e300"],
             ["--S_noise=1e300", "--S_churn=10"], ["--S_churn=-1"], ["--batch=0"],
             ["--batch=-1"], ["--seeds=4294967296-4294967297"], ["--seeds=18446744073709551616"]]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for extra in cases:
        out = tmp_path / "png"
        r = subprocess.run([sys.executable, "-m", "edm2_jax.main", "--mode=generate",
                            "--net=nowhere", f"--outdir={out}", *extra], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=300)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error:"), (
            extra, r.stderr[-1500:])
        assert "Traceback" not in r.stderr and not out.exists()
    r = subprocess.run([sys.executable, "-m", "edm2_jax.main", "--mode=eval", "--net=nowhere",
                        "--batch=0"], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and r.stderr.strip().startswith("error: --batch=0")


def test_seeds_are_32_bit():
    assert seed_images.parse_seeds(f"{2**32 - 2}-{2**32 - 1}") == [2**32 - 2, 2**32 - 1]
    for spec in (f"{2**32}", f"0-{2**32}", "1" * 30):
        with pytest.raises(ValueError):
            seed_images.parse_seeds(spec)


def test_a_sample_that_overflowed_is_not_written(tmp_path, monkeypatch):
    """`generate_images` writes no PNG of a batch whose samples are not finite, and says
    which seeds and which flags to check."""
    import jax.numpy as jnp

    def overflowed(*args, return_finite=False, **kw):
        images = jnp.zeros((len(args[2]), 4, 4, 1), jnp.uint8)
        return images, jnp.array([True] + [False] * (len(args[2]) - 1))

    monkeypatch.setattr(seed_images, "sample_images", overflowed)
    with pytest.raises(ValueError, match=r"seeds \[1, 2\].*--guidance"):
        list(seed_images.generate_images(None, None, [0, 1, 2], outdir=str(tmp_path / "png"),
                                         batch_size=3, progress=False))
    assert not (tmp_path / "png").exists() or not list((tmp_path / "png").iterdir())
