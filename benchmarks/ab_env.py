"""In-process A/B of an environment switch read when the step is traced, e.g. the CPU
fusion barriers of `edm2_jax.model.mp` (`EDM2_JAX_CPU_BARRIERS`):

    python benchmarks/ab_env.py EDM2_JAX_CPU_BARRIERS 0 1 --rounds=10

Compiles the training step of `--config` (as `train_throughput.py`: synthetic batch,
random weights) once with `VAR=A` and once with `VAR=B` in one process, then alternates
`--rounds` rounds of `--steps` steps of each and prints ms/step per round and the medians.
One process and alternation cancel most of the machine's drift, which between separate
processes on a shared 2-core machine is larger than the effects measured here.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __name__ == "__main__":  # first: the host allocator and CPU devices of edm2_jax.main
    from edm2_jax import process as cpu_env
    cpu_env.reexec()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import numpy as np  # noqa: E402
from train_throughput import compiled_step, load_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("var")
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--config", default="configs/fashion_mnist.py")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    cfg = load_config(args.config)
    runs = {}
    for v in (args.a, args.b):
        os.environ[args.var] = v
        step, state, batch, _ = compiled_step(cfg)
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        runs[v] = [step, state, batch]
    alternate(runs, args.rounds, args.steps, int(cfg.batch_size),
              {v: f"{args.var}={v}" for v in runs})


def alternate(runs: dict, rounds: int, steps: int, batch_size: int, labels: dict) -> None:
    """Time the compiled steps of `runs` (`{key: [step, state, batch]}`, states chained)
    in `rounds` alternated rounds of `steps` steps each; print ms/step per round and the
    medians, each under `labels[key]`."""
    ms = {k: [] for k in runs}
    for r in range(rounds):
        for k in runs:
            step, state, batch = runs[k]
            t = time.perf_counter()
            for _ in range(steps):
                state, _ = step(state, batch)
            jax.block_until_ready(state)
            ms[k].append((time.perf_counter() - t) / steps * 1e3)
            runs[k][1] = state
        print(f"round {r}: " + "  ".join(f"{labels[k]}: {ms[k][-1]:.1f} ms" for k in ms),
              flush=True)
    for k in ms:
        med = float(np.median(ms[k]))
        print(f"{labels[k]}: median {med:.1f} ms/step, {batch_size * 1e3 / med:.1f} img/s")

if __name__ == "__main__":
    main()
