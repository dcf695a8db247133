"""Sampling throughput of the EDM Heun sampler (2N-1 network evaluations per image).

    python benchmarks/sampling.py --preset=img64-xs --batch=8 --steps=32
    python benchmarks/sampling.py --config=configs/fashion_mnist.py --batch=100 --steps=32
    python benchmarks/sampling.py --preset=img64-xs --guidance=2 --guidance_interval=0.28,1.61

Random N(0, 1) weights (throughput does not depend on them); with `--guidance`, a guide
of the same architecture with other random weights (4N-2 evaluations per image, fewer
with `--guidance_interval`, whose unguided steps skip the guide); prints one line: compile
time (s) and img/s over `--repeats` batches after a warm-up batch, for comparison with
the release's generate_images.py on the same hardware.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

if __name__ == "__main__":  # first: the host allocator and CPU devices of edm2_jax.main
    from edm2_jax import process
    process.setup_entry_point()

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.forward import random_variables  # noqa: E402
from edm2_jax.model.networks import precond_from_config  # noqa: E402
from edm2_jax.model.presets import NETWORK_PRESETS  # noqa: E402
from edm2_jax.sampling.sampler import sample_images  # noqa: E402
from edm2_jax.sampling.solvers import Heun  # noqa: E402


def network_config(args) -> dict:
    if args.config:
        path, _, variant = args.config.partition(":")
        spec = importlib.util.spec_from_file_location("cfg", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.get_config(variant or "default").network.to_dict()
    return dict(NETWORK_PRESETS[args.preset])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="img64-xs", choices=sorted(NETWORK_PRESETS))
    p.add_argument("--config", default=None, help="configs/FILE.py[:variant] instead of --preset")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--guidance", type=float, default=1.0, help="!= 1: guided by a second net")
    p.add_argument("--guidance_interval", default=None, help="LO,HI: guide only there")
    args = p.parse_args()

    cfg = network_config(args)
    cfg["dtype"] = args.dtype
    net = precond_from_config(cfg)
    variables = random_variables(net)
    # Small out_gain so that the random net does not blow the trajectory up.
    variables["params"]["unet"]["out_gain"] = variables["params"]["unet"]["out_gain"] * 0 + 0.1
    seeds = np.arange(args.batch)
    labels = 0 if net.label_dim else None
    guide = {}
    if args.guidance != 1:
        guide_vars = random_variables(net, seed=1)
        guide_vars["params"]["unet"]["out_gain"] = guide_vars["params"]["unet"]["out_gain"] * 0 + 0.1
        interval = (tuple(float(v) for v in args.guidance_interval.split(","))
                    if args.guidance_interval else None)
        guide = dict(guide_net=net, guide_variables=guide_vars, guidance=args.guidance,
                     guidance_interval=interval)
    t = time.time()
    jax.block_until_ready(sample_images(net, variables, seeds, labels, sampler=Heun(args.steps),
                                        **guide))
    compile_s = time.time() - t
    t = time.time()
    for r in range(args.repeats):
        jax.block_until_ready(sample_images(net, variables, seeds + (r + 1) * args.batch, labels,
                                            sampler=Heun(args.steps), **guide))
    dt = (time.time() - t) / args.repeats
    name = args.config or args.preset
    if guide:
        name += f" guidance {args.guidance:g}" + (f" interval ({args.guidance_interval}]"
                                                  if args.guidance_interval else "")
    print(f"{name} {args.dtype} batch {args.batch} steps {args.steps} ({2 * args.steps - 1} NFE): "
          f"first batch (incl. compile) {compile_s:.1f} s, {dt:.2f} s/batch, "
          f"{args.batch / dt:.2f} img/s on {jax.devices()[0].platform} x{jax.device_count()}")


if __name__ == "__main__":
    main()
