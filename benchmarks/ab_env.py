"""In-process A/B of a switch read when the step is traced: a config field such as the
CPU fusion barriers (`backend.cpu_barriers`, `edm2_jax/backends/cpu.py`), or an
environment variable:

    python benchmarks/ab_env.py backend.cpu_barriers False True --rounds=10
    python benchmarks/ab_env.py backend.cpu_conv_grad relayout matmul
    python benchmarks/ab_env.py SOME_ENV_VAR 0 1

A name with a dot is a config field (its values are Python literals, else strings); any
other name an environment variable. Compiles the training step of `--config` (as
`train_throughput.py`: synthetic batch, random weights) once with the switch at A and
once at B in one process, then alternates `--rounds` rounds of `--steps` steps of each
and prints ms/step per round and the medians. One process and alternation cancel most of
the machine's drift, which between separate processes on a shared 2-core machine is
larger than the effects measured here.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
import time

if __name__ == "__main__":  # first: the XLA flags, allocator and CPU devices of edm2_jax.main
    from edm2_jax import process
    process.setup_entry_point()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import numpy as np  # noqa: E402
from train_throughput import compiled_step, load_config  # noqa: E402


def parse_value(text: str):
    """`'False'` -> False, `'3'` -> 3, `'relayout'` -> 'relayout' (a Python literal, else
    the string itself)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def set_field(config, dotted: str, value) -> None:
    """`config.<dotted> = value` (e.g. 'backend.cpu_barriers'). Raises SystemExit naming
    the field when the config has no such field."""
    *parents, leaf = dotted.split(".")
    node = config
    for p in parents:
        if p not in node:
            raise SystemExit(f"the config has no field {dotted!r}")
        node = node[p]
    if leaf not in node:
        raise SystemExit(f"the config has no field {dotted!r}")
    node[leaf] = value


def compiled_with(config_path: str, name: str, value: str):
    """`compiled_step` of `config_path` with the switch `name` (a dotted config field or an
    environment variable) at `value`."""
    config = load_config(config_path)
    if "." in name:
        set_field(config, name, parse_value(value))
    else:
        os.environ[name] = value
    return config, compiled_step(config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("var", help="a dotted config field (backend.cpu_barriers) or an environment variable")
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--config", default="configs/fashion_mnist.py")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    runs = {}
    for v in (args.a, args.b):
        cfg, (step, state, batch, _) = compiled_with(args.config, args.var, v)
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        runs[v] = [step, state, batch]
    alternate(runs, args.rounds, args.steps, int(cfg.batch_size),
              {v: f"{args.var}={v}" for v in runs})


def alternate(runs: dict, rounds: int, steps: int, batch_size: int, labels: dict) -> dict:
    """Time the compiled steps of `runs` (`{key: [step, state, batch]}`, states chained)
    in `rounds` alternated rounds of `steps` steps each; print ms/step per round and the
    medians, each under `labels[key]`. Returns `{key: median ms/step}`."""
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
    medians = {k: float(np.median(v)) for k, v in ms.items()}
    for k, med in medians.items():
        print(f"{labels[k]}: median {med:.1f} ms/step, {batch_size * 1e3 / med:.1f} img/s")
    return medians


if __name__ == "__main__":
    main()
