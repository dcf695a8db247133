"""In-process A/B of the training step on 1 device against the same step split
data-parallel over N CPU devices (`edm2_jax/process.py`, `EDM2_JAX_CPU_DEVICES`):

    python benchmarks/ab_devices.py --devices=2 --rounds=6
    python benchmarks/ab_devices.py --config=configs/fashion_mnist.py --net=ch64 --batch=32

Runs under the settings `python -m edm2_jax.main` re-executes itself with (the host
allocator; the device count is set here to `--devices`), compiles the step of
`--config` (as `train_throughput.py`: synthetic batch, random weights) over a mesh of 1
device and of `--devices` devices in one process, then alternates `--rounds` rounds of
`--steps` steps of each and prints ms/step per round and the medians.
"""
from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":  # first: the host allocator edm2_jax.main runs under
    _n = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--devices=")), "2")
    os.environ.setdefault("EDM2_JAX_CPU_DEVICES", _n)
    from edm2_jax import process
    process.setup_entry_point()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
from ab_env import alternate  # noqa: E402
from compare_release import NETS  # noqa: E402
from train_throughput import compiled_step, load_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/fashion_mnist.py")
    ap.add_argument("--net", default="", choices=["", *NETS], help="a named net instead")
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    cfg = load_config(args.config)
    if args.net:
        cfg.network.update(NETS[args.net])
    if args.batch:
        cfg.batch_size = args.batch
    if jax.device_count() < args.devices:
        raise SystemExit(f"only {jax.device_count()} devices: XLA_FLAGS sets another count")
    runs = {}
    for d in (1, args.devices):
        step, state, batch, info = compiled_step(cfg, d)
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        runs[d] = [step, state, batch]
    alternate(runs, args.rounds, args.steps, int(cfg.batch_size),
              {d: f"{d} device(s)" for d in runs})

if __name__ == "__main__":
    main()
