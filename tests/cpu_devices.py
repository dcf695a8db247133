"""Running a test's computation in a fresh process with simulated CPU devices: the device
count is fixed by `XLA_FLAGS` before JAX starts, so a pytest process cannot change its
own. The child saves a pytree's leaves with `np.savez(out, *leaves)`; the test reads them
back in the shape of its own result."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[1]


def tree_from_process(func: str, out: Path, like: Any, *args: Any,
                      num_devices: int = 8) -> Any:
    """Run `func(str(out), *args)` (`'tests.module:function'`; `args` Python literals) in
    a new Python process on `num_devices` simulated CPU devices, then return the leaves
    it saved to `out` (`np.savez(out, *jax.tree.leaves(tree))`) as a pytree shaped like
    `like`. Fails the test, with the child's stderr, when the process fails (10 min
    at most)."""
    module, name = func.split(":")
    call = ", ".join([repr(str(out))] + [repr(a) for a in args])
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from {module} import {name}
        {name}({call})
    """)
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}",
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with np.load(out) as f:
        leaves = [f[f"arr_{i}"] for i in range(len(f.files))]
    return jax.tree.unflatten(jax.tree.structure(like), leaves)
