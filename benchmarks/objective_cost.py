"""What each training objective costs per training image: the EDM2 step, the multistep
consistency student's, the distribution-matching generator's and sCM's (edm2_jax/objectives/),
in speed on this machine and in device memory from the compiled program.

    python benchmarks/objective_cost.py                       # img/s, configs/fashion_mnist.py, batch 64
    python benchmarks/objective_cost.py --work=memory --preset=img64-s --batch=128 --dtype=bfloat16

`--work=speed` times the jitted training step of each objective on the config's network
(random weights, one fixed synthetic batch, after a warm-up step; the teacher, and the
fake denoiser of distribution matching, random too): sec/step and img/s, and the ratio
to the EDM2 step. `--work=memory` compiles the same steps for a release preset without
allocating anything and prints `compiled.memory_analysis()` per training image: the
temporaries (activations kept for the backward pass, gradients, workspace) and the
arguments (train state: for a distillation run the frozen teacher, and for distribution
matching the fake denoiser with its Adam moments). `--kernels=xla` (default) compiles
the network a GPU or TPU runs; XLA:CPU's buffer assignment differs from XLA:GPU's, so
compare the objectives with each other, on one backend.

`--objectives` picks them: `edm2`, `consistency:K` (K sampling steps), `dmd:K`,
`dmd:K:gan` (with DMD2's GAN head; its step trains the fake denoiser and the head on
every step and computes the generator's gradient whatever the update ratio, so its cost
per step does not depend on `distill.dfake_gen_update_ratio`), and `scm` (sCD: the
student's forward and backward pass, its jvp and the teacher's forward pass; its
sampling steps change nothing of the step, so it takes no K), and `sct` (sCT: the same
without the teacher, whose tangent comes from the data).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __name__ == "__main__":  # first: the host allocator and CPU devices of edm2_jax.main
    from edm2_jax import process
    process.setup_entry_point()

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_table import build_config  # noqa: E402
from memory import memory_gib  # noqa: E402
from train_throughput import load_config, random_train_state  # noqa: E402

from edm2_jax import configs, objectives  # noqa: E402
from edm2_jax.training import optim as optim_lib  # noqa: E402
from edm2_jax.training import sharding as shard_lib  # noqa: E402
from edm2_jax.training import state as state_lib  # noqa: E402
from edm2_jax.training import step as step_lib  # noqa: E402


def objective_config(config, spec: str):
    """`config` set for the objective `spec` ('NAME', 'NAME:K', 'dmd:K:gan' or 'sct', NAME
    any registered objective, `objectives.REGISTRY`): an objective that starts from a
    network gets a teacher path the step never opens (its weights are the train
    state's), with K `distill.steps` K on a grid of at least K points, and with ':gan'
    DMD2's GAN head (`distill.gan`, its other settings the config's)."""
    sct = spec == "sct"
    name, _, rest = ("scm", "", "") if sct else spec.partition(":")
    k, _, head = rest.partition(":")
    if name not in objectives.REGISTRY or head not in ("", "gan") or (head and name != "dmd"):
        raise SystemExit(f"error: --objectives: unknown {spec!r}; use one of "
                         f"{', '.join(sorted(objectives.REGISTRY))}, with ':K' for K steps "
                         f"(and 'dmd:K:gan' for DMD2's GAN head, 'sct' for sCT)")
    c = config.copy_and_resolve_references()
    configs.with_objective(c, name)
    if sct:
        c.distill.training = True
    if objectives.from_config(c).start() is not None:
        c.distill.teacher = "(random weights)"
    if k:
        steps = int(k)
        c.distill.update(steps=steps, teacher_steps=max(int(c.distill.teacher_steps), steps))
    if head:
        c.distill.gan = True
    return c


def objective_step(config, spec: str, abstract: bool):
    """`(jitted step, state, batch)` of the objective `spec` on `config`'s network; with
    `abstract`, state and batch are `jax.ShapeDtypeStruct`s (nothing allocated)."""
    config = objective_config(config, spec)
    objective = objectives.from_config(config)
    batch_size = int(config.batch_size)
    net = state_lib.make_network(config)
    tx = optim_lib.make_optimizer(config.optim, batch_size)
    mesh = shard_lib.make_mesh(1)

    def build():
        state = random_train_state(config, net, tx)
        return {**state, **objective.init_state(state["params"])}

    r, c, L = net.img_resolution, net.img_channels, net.label_dim
    rng = np.random.default_rng(0)
    batch = {"image": rng.uniform(-1, 1, (batch_size, r, r, c)).astype(np.float32),
             "label": np.eye(max(L, 1), dtype=np.float32)[rng.integers(0, max(L, 1), batch_size)][:, :L]}
    if abstract:
        state = jax.eval_shape(build)
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    else:
        state = jax.device_put(jax.jit(build)(), shard_lib.replicated(mesh))
        batch = shard_lib.global_batch(mesh, batch)
    num_accum = step_lib.num_micro_batches(config, mesh.size)
    fn = step_lib.jit_train_step(
        step_lib.make_train_step(config, net, tx, num_accum, objective=objective), mesh)
    return fn, state, batch


def speed(config, spec: str, steps: int) -> float:
    """sec/step of the objective's compiled training step (mean of `steps` after one)."""
    fn, state, batch = objective_step(config, spec, abstract=False)
    compiled = fn.lower(state, batch).compile()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    t = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    if not np.isfinite(float(metrics["objective"])):
        print(f"warning: {spec}: non-finite loss on synthetic data", file=sys.stderr)
    return (time.perf_counter() - t) / steps


def memory(config, spec: str) -> dict:
    """`memory_analysis()` of the objective's compiled step, GiB."""
    fn, state, batch = objective_step(config, spec, abstract=True)
    t = time.perf_counter()
    compiled = fn.lower(state, batch).compile()
    gib = {**memory_gib(compiled), "compile_s": time.perf_counter() - t}
    return gib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="speed", choices=["speed", "memory"])
    ap.add_argument("--objectives", default="edm2,consistency:1,consistency:4,dmd:1,dmd:4,scm",
                    help="comma list of edm2, consistency:K, dmd:K, dmd:K:gan, scm, sct")
    ap.add_argument("--config", default="configs/fashion_mnist.py",
                    help="--work=speed: config file[:variant] (the quick start's by default)")
    ap.add_argument("--preset", default="img64-s", help="--work=memory: a release preset")
    ap.add_argument("--batch", type=int, default=0,
                    help="training batch (0: the config's for speed, 128 for memory)")
    ap.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"],
                    help="compute dtype ('' = the config's for speed, bfloat16 for memory)")
    ap.add_argument("--kernels", default="xla", choices=["xla", "cpu"],
                    help="--work=memory: the network's kernels")
    ap.add_argument("--steps", type=int, default=5, help="--work=speed: timed steps")
    args = ap.parse_args()
    specs = [s.strip() for s in args.objectives.split(",") if s.strip()]
    for s in specs:
        objective_config(load_config("configs/fashion_mnist.py:tiny"), s)  # names checked first
    if args.work == "speed":
        config = load_config(args.config)
        if args.batch:
            config.batch_size = args.batch
        if args.dtype:
            config.network.dtype = args.dtype
        config.batch_per_device = 0
        batch, base = int(config.batch_size), None
        print(f"{args.config}, batch {batch}, {config.network.dtype}, "
              f"{jax.device_count()} {jax.default_backend()} device(s), {os.cpu_count()} cores")
        for s in specs:
            sec = speed(config, s, args.steps)
            base = base or (sec if s == "edm2" else None)
            ratio = f", {sec / base:.2f}x the EDM2 step's time" if base else ""
            print(f"{s:14s} {sec:.3f} s/step, {batch / sec:7.1f} img/s{ratio}", flush=True)
    else:
        batch = args.batch or 128
        config = build_config(args.preset, batch, args.dtype or "bfloat16")
        config.backend.kernels = args.kernels
        print(f"{args.preset}, batch {batch}, {config.network.dtype}, kernels "
              f"{args.kernels}, compiled by XLA:{jax.default_backend().upper()}")
        base = None
        for s in specs:
            g = memory(config, s)
            base = base or (g if s == "edm2" else None)
            ratio = f", {g['peak'] / base['peak']:.2f}x the EDM2 step's" if base else ""
            print(f"{s:14s} temp {g['temp']:.2f} GiB ({1024 * g['temp'] / batch:.1f} MiB "
                  f"per image), arguments {g['argument']:.2f} GiB, peak about "
                  f"{g['peak']:.2f} GiB{ratio} (compiled in {g['compile_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
