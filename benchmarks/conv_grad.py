"""Which CPU weight-gradient path of the 3x3 convolutions trains faster on this machine.

    python benchmarks/conv_grad.py --config=configs/fashion_mnist.py --rounds=3

The CPU backend (`edm2_jax/backends/cpu.py`) computes the weight gradient of a 3x3
convolution with XLA's own filter-gradient convolution on operands relaid out outside
XLA's fusions (`relayout`, the default), with plain autodiff (`xla`: the same
convolution, relayouts fused with their producers) or with a custom VJP of shifted
matmuls (`matmul`); all are the same math. Which one is faster depends on the CPU and
the jaxlib, so this compiles the whole training step (`benchmarks/train_throughput.py`)
under each `config.backend.cpu_conv_grad` in one process, times them in alternated
rounds (`ab_env.alternate`), and prints the medians and the setting to use.
"""
from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":  # first: the XLA flags, allocator and CPU devices of edm2_jax.main
    from edm2_jax import process
    process.setup_entry_point()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
from ab_env import alternate  # noqa: E402
from train_throughput import compiled_step, load_config  # noqa: E402

MODES = ("relayout", "xla", "matmul")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/fashion_mnist.py")
    ap.add_argument("--batch", type=int, default=0, help="override config.batch_size (0 = keep)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runs = {}
    for mode in MODES:
        config = load_config(args.config)
        config.backend.kernels = "cpu"
        config.backend.cpu_conv_grad = mode
        if args.batch:
            config.batch_size = args.batch
        step, state, batch, _ = compiled_step(config)
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        runs[mode] = [step, state, batch]
    ms = alternate(runs, args.rounds, args.steps, int(config.batch_size),
                   {m: f"cpu_conv_grad={m}" for m in MODES})
    best = min(ms, key=ms.get)
    print(f"fastest: {best} ({max(ms.values()) / ms[best]:.2f}x the slowest)"
          f" -> --config.backend.cpu_conv_grad={best}")


if __name__ == "__main__":
    main()
