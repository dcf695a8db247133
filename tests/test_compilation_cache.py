"""The persistent compilation cache: a second start of the same config compiles nothing.

On one H200 the img64-s training step compiles in 306 s and loads from the cache in 8 s
(benchmarks/README.md), so a resumed or requeued run starts in seconds only if a new
process traces the same program, byte for byte, as the one that filled the cache.
Anything in the traced step that varied between processes (an id, a set's iteration
order, a path, a time) would make every start a cold compile without a word; this test
is what keeps it from happening."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The entry points' cache (`process.enable_compilation_cache`) around the training step of
# benchmarks/train_throughput.py.
SCRIPT = """
import sys
sys.path.insert(0, "benchmarks")
from edm2_jax import process
process.add_default_xla_flags()
process.enable_compilation_cache()
import jax
# Every program enters, however fast its compile: which ones pass the entry points'
# 2 s threshold depends on the machine's load, and the test is about their keys.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
from train_throughput import compiled_step, load_config
config = load_config("configs/fashion_mnist.py")
config.batch_size = 16
compiled_step(config)
"""


@pytest.mark.slow
@pytest.mark.ci
def test_a_second_process_loads_the_training_step_from_the_cache(tmp_path):
    cache = tmp_path / "xla"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.update(JAX_PLATFORMS="cpu", EDM2_JAX_COMPILATION_CACHE=str(cache))
    entries = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        entries.append(sorted(p.name for p in cache.iterdir()))
    assert any(name.startswith("jit_train_step-") for name in entries[0]), entries[0]
    # The second process compiled no program that the first had not left in the cache.
    assert entries[1] == entries[0]
