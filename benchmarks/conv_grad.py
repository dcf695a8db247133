"""Which CPU weight-gradient path of the 3x3 convolutions trains faster on this machine.

    python benchmarks/conv_grad.py --config=configs/fashion_mnist.py --rounds=3

`edm2_jax.model.mp.conv2d_same` computes the weight gradient of a 3x3 convolution on the CPU
backend with XLA's own filter-gradient convolution on operands relaid out outside XLA's
fusions (`relayout`, the default), with plain autodiff (`xla`: the same convolution,
relayouts fused with their producers) or with a custom VJP of shifted matmuls
(`matmul`); all are the same math. Which one is faster depends on the CPU and the
jaxlib, so this times the whole training step (`benchmarks/train_throughput.py`) under
each `EDM2_JAX_CPU_CONV_GRAD` value, alternating them in fresh processes, and prints the
medians and the setting to use.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(mode: str, args) -> float:
    env = dict(os.environ, EDM2_JAX_CPU_CONV_GRAD=mode)
    cmd = [sys.executable, os.path.join(HERE, "train_throughput.py"), f"--config={args.config}",
           f"--steps={args.steps}"] + ([f"--batch={args.batch}"] if args.batch else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    m = re.search(r"img_per_s=([0-9.]+)", out.stdout)
    if out.returncode or not m:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/fashion_mnist.py")
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    res = {"relayout": [], "xla": [], "matmul": []}
    for r in range(args.rounds):
        for mode in res:
            res[mode].append(run(mode, args))
            print(f"round {r} {mode}: {res[mode][-1]:.1f} img/s", flush=True)
    med = {m: statistics.median(v) for m, v in res.items()}
    best = max(med, key=med.get)
    print("median img/s: " + ", ".join(f"{m} {v:.1f}" for m, v in med.items())
          + f" -> export EDM2_JAX_CPU_CONV_GRAD={best}"
          f"  ({med[best] / min(med.values()):.2f}x the slowest)")


if __name__ == "__main__":
    main()
