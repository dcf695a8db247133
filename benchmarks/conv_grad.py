"""Which CPU weight-gradient path of the 3x3 convolutions trains faster on this machine.

    python benchmarks/conv_grad.py --config=configs/fashion_mnist.py --rounds=3

`edm2_jax.mp.conv2d_same` computes the weight gradient of a 3x3 convolution on the CPU
backend either with XLA's own filter-gradient convolution (`xla`, the default) or with a
custom VJP of shifted matmuls (`matmul`); both are the same math. Which one is faster
depends on the CPU and the jaxlib, so this times the whole training step
(`benchmarks/train_throughput.py`) under `EDM2_JAX_CPU_CONV_GRAD=xla` and `=matmul`,
alternating the two in fresh processes, and prints the medians and the setting to use.
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
    res = {"xla": [], "matmul": []}
    for r in range(args.rounds):
        for mode in res:
            res[mode].append(run(mode, args))
            print(f"round {r} {mode}: {res[mode][-1]:.1f} img/s", flush=True)
    med = {m: statistics.median(v) for m, v in res.items()}
    best = max(med, key=med.get)
    print(f"median img/s: xla {med['xla']:.1f}, matmul {med['matmul']:.1f} -> "
          f"export EDM2_JAX_CPU_CONV_GRAD={best}  ({max(med.values()) / min(med.values()):.2f}x)")


if __name__ == "__main__":
    main()
