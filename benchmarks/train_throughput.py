"""Training-step throughput of a config on synthetic data (no data loading, no saving).

    python benchmarks/train_throughput.py --config=configs/fashion_mnist.py --steps=10
    python benchmarks/train_throughput.py --config=configs/img64.py:xs --batch=256 --steps=20
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python benchmarks/train_throughput.py --config=configs/fashion_mnist.py:tiny
    python benchmarks/train_throughput.py --config=configs/img64.py:s --batch=512 --dtype=bfloat16

Times the step that `loop.train_and_evaluate` runs: `step.make_train_step` (forced
weight normalisation, EDM2 loss and gradients with `lax.scan` accumulation when
`batch_per_device` asks for it, Adam, power EMAs) jitted over a data-parallel mesh of all
devices by `step.jit_train_step`. Weights are random N(0, 1) (drawn on the device; Flax's
init is not timed); the batch is one fixed synthetic batch already on the devices
(uniform pixels in [-1, 1], random one-hot labels). Prints one line: compile time (lower
+ compile, s), sec/step (mean over `--steps` after one warm-up step), img/s — the
number to compare with the training speed the release reports — and peak memory (the
device's peak bytes in use where the backend reports it, e.g. GPU; else host peak RSS)
and the host's minor page faults per step (`edm2_jax/process.py` says why they matter).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import sys
import time

if __name__ == "__main__":  # first: the host allocator and CPU devices of edm2_jax.main
    from edm2_jax import process
    process.setup_entry_point()

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from forward import random_variables  # noqa: E402

from edm2_jax import configs  # noqa: E402
from edm2_jax.ema import power as ema_lib  # noqa: E402
from edm2_jax.training import optim as optim_lib  # noqa: E402
from edm2_jax.training import sharding as shard_lib  # noqa: E402
from edm2_jax.training import progress  # noqa: E402
from edm2_jax.training import state as state_lib  # noqa: E402
from edm2_jax.training import step as step_lib  # noqa: E402


def load_config(spec: str):
    """`path/to/config.py[:variant]` -> `get_config(variant)` (big_vision style), its
    `network.dtype` 'auto' resolved for this platform (`configs.resolve_dtype`)."""
    path, _, variant = spec.partition(":")
    if not os.path.isfile(path):
        raise SystemExit(f"--config: no such file {path!r} (e.g. configs/fashion_mnist.py:tiny)")
    mod_spec = importlib.util.spec_from_file_location("bench_config", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    config = mod.get_config(variant) if variant else mod.get_config()
    return configs.resolve_dtype(config, jax.default_backend())


def random_train_state(config, net, tx, seed: int = 0) -> dict:
    """A train state with the structure of `state.init_train_state`, random weights, made
    in one jitted call (op by op, Adam's and the EMAs' initialisers would compile a small
    program for each leaf shape: 42 of them, 10 s on 2 CPU cores, for the tiny net)."""
    sigma_rels, halflife = tuple(config.ema.sigma_rels), float(config.ema.trad_halflife_kimg)

    def build() -> dict:
        v = random_variables(net, seed)
        return {"step": jnp.zeros((), jnp.int32), "params": v["params"],
                "buffers": v["buffers"], "opt_state": tx.init(v["params"]),
                "ema": ema_lib.init_ema_state(v["params"], sigma_rels, halflife),
                "rng": jax.random.PRNGKey(seed + 1)}

    return jax.jit(build)()


def compiled_step(config, devices: int = 0, seed: int = 0):
    """The jitted, compiled training step of `config` over a data-parallel mesh of
    `devices` devices (0 = all), with a random train state and one fixed synthetic batch
    on the devices. Returns `(compiled, state, batch, info)`; `info` holds `net`, `mesh`,
    `num_accum`, `n_params` and `compile_s` (lower + compile, s). `compiled` donates its
    state: chain `state, metrics = compiled(state, batch)`."""
    mesh = shard_lib.make_mesh(devices or None)
    num_accum = step_lib.num_micro_batches(config, mesh.size)
    batch_size = int(config.batch_size)
    net = state_lib.make_network(config)
    tx = optim_lib.make_optimizer(config.optim, batch_size)

    state = jax.device_put(random_train_state(config, net, tx, seed),
                           shard_lib.replicated(mesh))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))
    rng = np.random.default_rng(seed)
    r, c, L = net.img_resolution, net.img_channels, net.label_dim
    batch = shard_lib.global_batch(mesh, {
        "image": rng.uniform(-1, 1, (batch_size, r, r, c)).astype(np.float32),
        "label": np.eye(L, dtype=np.float32)[rng.integers(0, L, batch_size)] if L
        else np.zeros((batch_size, 0), np.float32)})

    step_fn = step_lib.jit_train_step(step_lib.make_train_step(config, net, tx, num_accum), mesh)
    t = time.perf_counter()
    compiled = step_fn.lower(state, batch).compile()
    info = dict(net=net, mesh=mesh, num_accum=num_accum, n_params=n_params,
                compile_s=time.perf_counter() - t)
    return compiled, state, batch, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/fashion_mnist.py",
                    help="config file[:variant], as for edm2_jax.main")
    ap.add_argument("--steps", type=int, default=10, help="timed steps after one warm-up step")
    ap.add_argument("--batch", type=int, default=0, help="override config.batch_size (0 = keep)")
    ap.add_argument("--batch_per_device", type=int, default=-1,
                    help="override config.batch_per_device (-1 = keep, 0 = no accumulation)")
    ap.add_argument("--devices", type=int, default=0, help="mesh size (0 = all devices)")
    ap.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"],
                    help="override config.network.dtype (compute precision; state stays float32)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be >= 1")

    config = load_config(args.config)
    if args.batch:
        config.batch_size = args.batch
    if args.batch_per_device >= 0:
        config.batch_per_device = args.batch_per_device
    if args.dtype:
        config.network.dtype = args.dtype
    batch_size = int(config.batch_size)
    compiled, state, batch, info = compiled_step(config, args.devices, args.seed)
    mesh, num_accum, n_params, compile_s = (info["mesh"], info["num_accum"], info["n_params"],
                                            info["compile_s"])
    state, metrics = compiled(state, batch)  # warm-up (state is donated: chain it)
    jax.block_until_ready(metrics)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    sec_per_step = (time.perf_counter() - t) / args.steps
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
    if not np.isfinite(float(metrics["objective"])):
        print("warning: non-finite loss on synthetic data", file=sys.stderr)
    dev = jax.devices()[0]
    print(f"train_step config={args.config} params={n_params:,} batch={batch_size} "
          f"devices={mesh.size}x{dev.platform}:{dev.device_kind} micro_batches={num_accum} "
          f"compile_s={compile_s:.2f} sec_per_step={sec_per_step:.4f} "
          f"img_per_s={batch_size / sec_per_step:.1f} sec_per_kimg={1000 * sec_per_step / batch_size:.2f} "
          f"dtype={config.network.dtype} peak_mem_gib={progress.memory_gib():.2f} "
          f"page_faults_per_step={faults:.0f}")


if __name__ == "__main__":
    main()
