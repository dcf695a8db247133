"""Forward-pass benchmark of `Precond` (eval mode) for a released preset.

    python benchmarks/forward.py --preset=img64-xs --batch=8
    python benchmarks/forward.py --preset=img512-s --batch=32 --dtype=bfloat16 --repeats=10

Builds the network of `edm2_jax.model.presets.NETWORK_PRESETS[preset]` with random N(0, 1)
weights (drawn on the device; Flax's init is not part of the benchmark), jits
`D(x, sigma, labels)` and prints one line: the jit compile time (lower + compile, s)
and the mean wall time of a forward pass over `--repeats` runs after one warm-up run
(s/batch, ms/img, img/s). Inputs: x ~ N(0, 1) NHWC, sigma log-uniform in [0.002, 80],
one-hot labels for conditional presets.
"""
from __future__ import annotations

import argparse
import time

if __name__ == "__main__":  # first, before JAX starts: the XLA flags of edm2_jax.main
    from edm2_jax import process
    process.add_default_xla_flags()

import math

import jax
import jax.numpy as jnp
import numpy as np

from edm2_jax.model.networks import Precond, init_variables, precond_from_config
from edm2_jax.model.presets import NETWORK_PRESETS


def random_variables(net: Precond, seed: int = 0) -> dict:
    """`{'params', 'buffers'}` of `net` with every leaf N(0, 1), drawn on the default
    device in one jitted call (shapes from `jax.eval_shape`, nothing initialised twice).
    One draw of all the elements, cut into the leaves: a draw per leaf would make XLA
    compile a random-number generator for each (8 s on 2 CPU cores for the tiny net of
    `gpu_table.py`, against 1 s)."""
    shapes = jax.eval_shape(lambda k: init_variables(net, k), jax.random.PRNGKey(0))
    leaves, treedef = jax.tree.flatten(dict(shapes))
    sizes = [math.prod(l.shape) for l in leaves]
    offsets = np.cumsum([0] + sizes)

    @jax.jit
    def fill(key):
        z = jax.random.normal(key, (int(offsets[-1]),), jnp.float32)
        return jax.tree.unflatten(treedef, [
            z[a:a + n].reshape(l.shape).astype(l.dtype)
            for a, n, l in zip(offsets[:-1].tolist(), sizes, leaves)])

    return fill(jax.random.PRNGKey(seed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="img64-xs", choices=sorted(NETWORK_PRESETS))
    ap.add_argument("--batch", type=int, default=8, help="images per forward pass")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="compute dtype of the convolutions / matmuls")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.batch < 1 or args.repeats < 1:
        ap.error("--batch and --repeats must be >= 1")

    net = precond_from_config(dict(NETWORK_PRESETS[args.preset], dtype=args.dtype))
    variables = random_variables(net, args.seed)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(variables["params"]))
    rng = np.random.default_rng(args.seed)
    r, c, L = net.img_resolution, net.img_channels, net.label_dim
    x = jnp.asarray(rng.standard_normal((args.batch, r, r, c)), jnp.float32)
    sigma = jnp.asarray(np.exp(rng.uniform(np.log(0.002), np.log(80.0), args.batch)), jnp.float32)
    labels = jnp.asarray(np.eye(L)[rng.integers(0, L, args.batch)], jnp.float32) if L else None

    forward = jax.jit(lambda v, x, sigma, labels: net.apply(v, x, sigma, labels, train=False))
    t = time.perf_counter()
    compiled = forward.lower(variables, x, sigma, labels).compile()
    compile_s = time.perf_counter() - t
    jax.block_until_ready(compiled(variables, x, sigma, labels))  # warm-up
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        jax.block_until_ready(compiled(variables, x, sigma, labels))
        times.append(time.perf_counter() - t)
    mean = float(np.mean(times))
    dev = jax.devices()[0]
    print(f"forward preset={args.preset} params={n_params:,} batch={args.batch} "
          f"dtype={args.dtype} device={dev.platform}:{dev.device_kind} "
          f"compile_s={compile_s:.2f} forward_s={mean:.4f} (min {min(times):.4f}, "
          f"{args.repeats} runs) ms_per_img={1e3 * mean / args.batch:.2f} "
          f"img_per_s={args.batch / mean:.1f}")


if __name__ == "__main__":
    main()
