"""Minimal reproduction: XLA:CPU with YNNPACK fusions, a batch split over 2 CPU devices:
the first rows of each device's share come out wrong.

    python benchmarks/repro_sampler_devices.py            # all four cases, 2-5 min
    python benchmarks/repro_sampler_devices.py --steps=16

The program: `x <- D(x; t_i)` for the `--steps` noise levels of the EDM schedule, one
`lax.fori_loop` (the tiny release net of `tests/data/edm2_ref`, 16x16x3, 10 labels),
batch 64. Each case runs in its own process (`XLA_FLAGS` is read when JAX starts) and is
compared row by row with the same loop on one device:

  spmd,   YNN      batch split over 2 devices, one program     -> rows 0, 1, 32, 33 wrong
  spmd,   no YNN   the same without `--xla_cpu_experimental_ynn_fusion_type=dot` -> equal
  per-device, YNN  the same program compiled for each device alone, both dispatched before
                   either is waited on (they run at the same time)    -> equal in this loop,
                   but not in general: `sample_images` done so, with a guide (guidance 1.5,
                   32 steps, batch 64), still gets rows 0, 1, 32, 33 wrong by 0.005-0.03
  unrolled, YNN    the loop unrolled in Python: still wrong, so not the while loop

Measured with jaxlib 0.10.2 on 2 cores of an AMD EPYC: 31 steps, max |error| 0.36 of
the output's scale in rows 0, 1, 32, 33 (others below 1e-6); 8 steps 7e-7 (equal); single
evaluations of `D` along the same trajectory, one jit each: equal; the same loop on one
device at batch 32 and at batch 2: bitwise equal. One device, or several without the YNN
flag, is exact; several devices with it are not (`tests/test_sampling_devices.py`).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
YNN = "--xla_cpu_experimental_ynn_fusion_type=dot"
CASES = {"spmd, YNN": ("spmd", True), "spmd, no YNN": ("spmd", False),
         "per-device, YNN": ("per-device", True), "unrolled, YNN": ("unrolled", True)}


def case(how: str, steps: int, batch: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, ROOT)
    from edm2_jax.sampling.schedule import edm_sigma_steps
    from tests.test_sampling import _load_release_net

    net, variables = _load_release_net("cond")
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((batch, 16, 16, 3)).astype(np.float32)
    labels = np.eye(10, dtype=np.float32)[rng.integers(0, 10, batch)]
    t = jnp.asarray(edm_sigma_steps(steps + 1), jnp.float32)

    def loop(x, lab, v):
        step = lambda i, x: net.apply(v, x, jnp.broadcast_to(t[i], x.shape[:1]), lab)  # noqa: E731
        x = x * t[0]
        if how == "unrolled":
            for i in range(steps):
                x = step(i, x)
            return x
        return jax.lax.fori_loop(0, steps, step, x)

    f = jax.jit(loop)
    ref = np.asarray(f(x0, labels, variables))  # one device
    devs = jax.devices()[:2]
    if how == "per-device":
        half = batch // 2
        outs = [f(*jax.device_put((x0[k * half:(k + 1) * half], labels[k * half:(k + 1) * half],
                                   variables), d)) for k, d in enumerate(devs)]
        out = np.concatenate([np.asarray(o) for o in outs])
    else:
        sh = jax.sharding.NamedSharding(jax.sharding.Mesh(np.asarray(devs), ("d",)),
                                        jax.sharding.PartitionSpec("d"))
        out = np.asarray(f(jax.device_put(x0, sh), jax.device_put(labels, sh), variables))
    err = np.abs(out - ref).reshape(batch, -1).max(1) / np.abs(ref).max()
    print(f"max error {err.max():.2g} of the output's scale, rows above 1e-4: "
          f"{np.flatnonzero(err > 1e-4).tolist()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=31)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        return case(args.case, args.steps, args.batch)
    for name, (how, ynn) in CASES.items():
        flags = "--xla_force_host_platform_device_count=2" + (f" {YNN}" if ynn else "")
        env = dict(os.environ, XLA_FLAGS=flags)
        r = subprocess.run([sys.executable, __file__, f"--case={how}", f"--steps={args.steps}",
                            f"--batch={args.batch}"], env=env, capture_output=True, text=True)
        line = r.stdout.strip().splitlines()[-1] if r.returncode == 0 else r.stderr[-500:]
        print(f"{name:16s} batch {args.batch} on 2 devices, {args.steps} steps: {line}")


if __name__ == "__main__":
    main()
