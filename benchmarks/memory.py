"""Device memory the compiled training step and sampler need, from XLA's buffer assignment
(`compiled.memory_analysis()`): no weights are allocated, nothing runs, so it measures a
GPU-sized network on any machine, the CPU included.

    python benchmarks/memory.py                                   # img64-s, bf16, batch 128 / 64
    python benchmarks/memory.py --preset=img512-s --dtype=float32 --batch=64
    python benchmarks/memory.py --work=sample --sample_batch=64 --guided

Prints one line per program: temp (the intermediates: activations kept for the backward
pass, their gradients, workspace), arguments (train state and batch; the sampler's
weights), outputs, and the bytes outputs share with donated arguments (the train state
is donated, so the step's new state reuses the old one's buffers). Peak device memory is
about arguments + temp + outputs - aliased. The figures depend on the backend that
compiles (XLA:CPU fuses and converts bfloat16 differently from XLA:GPU): compare a
change on one backend. `--kernels=xla` (default) compiles the network GPUs and TPUs run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def _line(name: str, compiled, seconds: float) -> dict:
    m = compiled.memory_analysis()
    gib = {k: getattr(m, f"{k}_size_in_bytes") / 2**30
           for k in ("temp", "argument", "output", "alias")}
    gib["peak"] = gib["argument"] + gib["temp"] + gib["output"] - gib["alias"]
    print(f"{name}: temp {gib['temp']:.2f} GiB, arguments {gib['argument']:.2f} GiB, outputs "
          f"{gib['output']:.2f} GiB, aliased {gib['alias']:.2f} GiB -> about {gib['peak']:.2f} "
          f"GiB at peak (compiled in {seconds:.0f} s)", flush=True)
    return gib


def step_memory(preset: str, batch: int, dtype: str, kernels: str = "xla") -> dict:
    """`memory_analysis` of the jitted training step of `preset` at `batch` (GiB)."""
    import jax
    import jax.numpy as jnp
    from gpu_table import build_config
    from train_throughput import random_train_state
    from edm2_jax.training import optim as optim_lib
    from edm2_jax.training import sharding as shard_lib
    from edm2_jax.training import state as state_lib
    from edm2_jax.training import step as step_lib
    config = build_config(preset, batch, dtype)
    config.backend.kernels = kernels
    net = state_lib.make_network(config)
    tx = optim_lib.make_optimizer(config.optim, batch)
    mesh = shard_lib.make_mesh(1)
    state = jax.eval_shape(lambda: random_train_state(config, net, tx))
    r, c, L = net.img_resolution, net.img_channels, net.label_dim
    data = {"image": jax.ShapeDtypeStruct((batch, r, r, c), jnp.float32),
            "label": jax.ShapeDtypeStruct((batch, L), jnp.float32)}
    fn = step_lib.jit_train_step(step_lib.make_train_step(config, net, tx, 1), mesh)
    t = time.perf_counter()
    compiled = fn.lower(state, data).compile()
    return _line(f"train step {preset} batch {batch} {dtype}", compiled, time.perf_counter() - t)


def sampler_memory(preset: str, batch: int, dtype: str, steps: int = 32,
                   guided: bool = False, kernels: str = "xla") -> dict:
    """`memory_analysis` of the jitted sampler (`sampler._sample`) of `preset` (GiB)."""
    import jax
    import jax.numpy as jnp
    from gpu_table import build_config
    from edm2_jax.model.networks import init_variables
    from edm2_jax.sampling import sampler as sampler_lib
    from edm2_jax.training import state as state_lib
    config = build_config(preset, batch, dtype)
    config.backend.kernels = kernels
    net = state_lib.make_network(config)
    v = jax.eval_shape(lambda: init_variables(net, jax.random.PRNGKey(0)))
    seeds = jax.ShapeDtypeStruct((batch,), jnp.uint32)
    labels = (jax.ShapeDtypeStruct((batch, net.label_dim), jnp.float32) if net.label_dim
              else None)
    t = time.perf_counter()
    compiled = sampler_lib._sample.lower(
        net, v, net if guided else None, v if guided else None, seeds, labels,
        2.0 if guided else 1.0, (("num_steps", steps),)).compile()
    return _line(f"sampler {preset} batch {batch} {dtype}{' guided' if guided else ''}",
                 compiled, time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="img64-s", help="a release preset, or 'tiny'")
    ap.add_argument("--batch", type=int, default=128, help="training batch")
    ap.add_argument("--sample_batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="sampler steps")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--guided", action="store_true", help="the sampler with a guide of the same size")
    ap.add_argument("--work", default="train,sample", help="train, sample or both")
    ap.add_argument("--kernels", default="xla", choices=["xla", "cpu"])
    args = ap.parse_args()
    work = [w.strip() for w in args.work.split(",") if w.strip()]
    if "train" in work:
        step_memory(args.preset, args.batch, args.dtype, args.kernels)
    if "sample" in work:
        sampler_memory(args.preset, args.sample_batch, args.dtype, args.steps, args.guided,
                       args.kernels)


if __name__ == "__main__":
    main()
