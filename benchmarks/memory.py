"""Device memory the compiled training step and sampler need, from XLA's buffer assignment
(`compiled.memory_analysis()`): no weights are allocated, nothing runs, so it measures a
GPU-sized network on any machine, the CPU included.

    python benchmarks/memory.py                                   # img64-s, bf16, batch 128 / 64
    python benchmarks/memory.py --preset=img512-s --dtype=float32 --batch=64
    python benchmarks/memory.py --work=sample --sample_batch=64 --guided
    python benchmarks/memory.py --work=saved --release=/path/to/edm2   # vs the release

Prints one line per program: temp (the intermediates: activations kept for the backward
pass, their gradients, workspace), arguments (train state and batch; the sampler's
weights), outputs, and the bytes outputs share with donated arguments (the train state
is donated, so the step's new state reuses the old one's buffers). Peak device memory is
about arguments + temp + outputs - aliased. The figures depend on the backend that
compiles (XLA:CPU fuses and converts bfloat16 differently from XLA:GPU): compare a
change on one backend. `--kernels=xla` (default) compiles the network GPUs and TPUs run.

`--work=saved` prints what any backend must hold between the forward and the backward
pass of the training loss: the per-example arrays autodiff keeps (the residuals of
`jax.vjp`, by `jax.eval_shape`: nothing compiled or run), the bulk of a step's peak.
With `--release=PATH` (torch installed) it prints the same for the authors' release,
the tensors its autograd saves (`saved_tensors_hooks`, one count per storage) in a
float32 forward on the CPU at batch 2, scaled to `--batch` (its fp16 mode needs a CUDA
device), beside ours in float32.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def memory_gib(compiled) -> dict:
    """`compiled.memory_analysis()` in GiB: temp, argument, output, alias, and the peak
    they give (arguments + temp + outputs - aliased)."""
    m = compiled.memory_analysis()
    gib = {k: getattr(m, f"{k}_size_in_bytes") / 2**30
           for k in ("temp", "argument", "output", "alias")}
    gib["peak"] = gib["argument"] + gib["temp"] + gib["output"] - gib["alias"]
    return gib


def _line(name: str, compiled, seconds: float) -> dict:
    gib = memory_gib(compiled)
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


def saved_for_backward(net, batch: int) -> list:
    """Shapes and dtypes (`jax.ShapeDtypeStruct`) of what the EDM2 training loss of `net`
    (a `Precond`) at `batch` keeps for its backward pass: the residuals of `jax.vjp`, by
    `jax.eval_shape` (nothing compiled or run)."""
    import jax
    import jax.numpy as jnp
    from edm2_jax.model import loss as loss_lib
    from edm2_jax.model.networks import init_variables
    r, c, L = net.img_resolution, net.img_channels, net.label_dim

    def residuals(key):
        v = init_variables(net, key)
        x = jnp.zeros((batch, r, r, c), jnp.float32)

        def loss(params):
            return loss_lib.edm2_loss(
                params, v["buffers"], net, x, jnp.zeros((batch, L), jnp.float32),
                rnd_normal=jnp.zeros((batch,)), noise_unit=x, P_mean=-0.4, P_std=1.0,
                sigma_data=0.5, train=True, dropout_rng=key, batch_size=batch)[0]
        return jax.tree.leaves(jax.vjp(loss, v["params"])[1])

    return jax.eval_shape(residuals, jax.random.PRNGKey(0))


def saved_activations(preset: str, batch: int, dtype: str, kernels: str = "xla") -> float:
    """GiB of the per-example arrays (leading axis `batch`) the training loss of
    `preset` keeps for its backward pass (`saved_for_backward`)."""
    import numpy as np
    from gpu_table import build_config
    from edm2_jax.training import state as state_lib
    config = build_config(preset, batch, dtype)
    config.backend.kernels = kernels
    kept = saved_for_backward(state_lib.make_network(config), batch)
    gib = sum(np.prod(a.shape) * a.dtype.itemsize for a in kept
              if a.ndim >= 2 and a.shape[0] == batch) / 2**30
    print(f"saved for the backward pass, {preset} batch {batch} {dtype}: {gib:.2f} GiB of "
          f"per-example arrays", flush=True)
    return gib


def release_saved_activations(release: str, preset: str, batch: int) -> float:
    """GiB of the per-example tensors the release's autograd saves in its training loss
    (`EDM2Loss`) of `preset`, float32 on the CPU at batch 2, scaled to `batch`."""
    import torch
    from compare_release import RELEASE_NET_KEYS
    from edm2_jax.model.presets import NETWORK_PRESETS
    sys.path.insert(0, os.path.abspath(release))
    from training import networks_edm2, training_loop
    kw = {k: (list(v) if isinstance(v, tuple) else v) for k, v in NETWORK_PRESETS[preset].items()
          if k in RELEASE_NET_KEYS}
    small = 2
    torch.manual_seed(0)
    net = networks_edm2.Precond(**kw).train()
    r, c, L = kw["img_resolution"], kw["img_channels"], kw.get("label_dim", 0)
    images = torch.rand(small, c, r, r) * 2 - 1
    labels = torch.eye(L)[torch.zeros(small, dtype=torch.long)] if L else None
    storages = {}

    def pack(t):
        if t.dim() >= 2 and t.shape[0] == small:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        training_loop.EDM2Loss(P_mean=-0.4, P_std=1.0)(net=net, images=images, labels=labels)
    gib = sum(storages.values()) * batch / small / 2**30
    print(f"saved for the backward pass, the release's {preset} batch {batch} float32: "
          f"{gib:.2f} GiB of per-example tensors", flush=True)
    return gib


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="img64-s", help="a release preset, or 'tiny'")
    ap.add_argument("--batch", type=int, default=128, help="training batch")
    ap.add_argument("--sample_batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="sampler steps")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--guided", action="store_true", help="the sampler with a guide of the same size")
    ap.add_argument("--work", default="train,sample",
                    help="comma-separated: train, sample, saved (what the loss keeps for "
                         "its backward pass)")
    ap.add_argument("--release", default="",
                    help="with --work=saved: also the release's, from this checkout of "
                         "NVlabs/edm2 (float32, on the CPU)")
    ap.add_argument("--kernels", default="xla", choices=["xla", "cpu"])
    args = ap.parse_args()
    work = [w.strip() for w in args.work.split(",") if w.strip()]
    if "train" in work:
        step_memory(args.preset, args.batch, args.dtype, args.kernels)
    if "saved" in work:
        saved_activations(args.preset, args.batch, args.dtype, args.kernels)
        if args.release:
            if args.dtype != "float32":
                saved_activations(args.preset, args.batch, "float32", args.kernels)
            release_saved_activations(args.release, args.preset, args.batch)
    if "sample" in work:
        sampler_memory(args.preset, args.sample_batch, args.dtype, args.steps, args.guided,
                       args.kernels)


if __name__ == "__main__":
    main()
