"""The table of docs/scaling.md: every release preset at batch 2048 on the TPU slices people
rent, from XLA's TPU compiler on this machine (libtpu; `edm2_jax/analysis/plan.py`).

    python benchmarks/tpu_scaling.py > table.md                      # array sizes only: seconds
    python benchmarks/tpu_scaling.py --compile=img512-xxl:v5p-64:1:8 # one compiled row

Without `--compile`, for each preset (img64 xs-xl, img512 xxs-xxl) and chip (v5e, v6e, v4,
v5p): the parameters, the model flops per training image (`Objective.forward_passes`, 3 for
the EDM2 step, x the forward pass's convolutions and matmuls), the train state (params, Adam
moments, the two power EMAs) per chip unsplit, and the smallest slice of 8 or more chips (16
to 256) with the smallest `mesh.fsdp` that leaves the state at most half a chip's HBM (the
rest is for activations, which only a compile tells), with that slice's flops-bound img/s at
the chip's bf16 peak (a lower bound on the time, an upper bound on img/s).

`--compile=PRESET:SLICE:FSDP:BATCH_PER_DEVICE` compiles one run's step (no sampler) and
prints its row: HBM per chip of the compiled step and the compile time here. Real presets
compile for minutes to tens of minutes on 2 cores; run one at a time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from edm2_jax import process  # noqa: E402

PRESETS = [f"img64-{v}" for v in ("xs", "s", "m", "l", "xl")] + [
    f"img512-{v}" for v in ("xxs", "xs", "s", "m", "l", "xl", "xxl")]
SIZES = (8, 16, 32, 64, 128, 256)  # chips


def preset_config(name: str):
    from edm2_jax import configs
    from edm2_jax.analysis import plan
    config = plan.tpu_config(configs.preset_config(name))
    config.batch_size = 2048
    return config


def sizes_row(name: str) -> str:
    """The array-size row of preset `name` (module docstring)."""
    import jax
    from edm2_jax import objectives
    from edm2_jax.analysis import plan, tpu_slices
    from edm2_jax.model.networks import count_params
    from edm2_jax.training import optim, state as state_lib
    config = preset_config(name)
    net = state_lib.make_network(config)
    tx = optim.make_optimizer(config.optim, 2048)
    abstract = jax.eval_shape(lambda r: state_lib.init_train_state(config, net, tx, r),
                              jax.random.PRNGKey(0))
    per_image = objectives.from_config(config).forward_passes * plan.forward_flops(net, 1)
    cells = [name, f"{count_params(net) / 1e6:.0f}", f"{per_image / 1e9:.0f}",
             f"{plan.state_bytes(abstract, 1) / 2**30:.1f}"]
    for generation in ("v5e", "v6e", "v4", "v5p"):
        chip = tpu_slices.CHIPS[generation]
        devices_per_chip = 2 if generation == "v4" else 1  # libtpu's v4: one per TensorCore
        hbm = chip.hbm_gib * 2**30 / devices_per_chip
        cell = "-"
        for chips in SIZES:
            devices = chips * devices_per_chip
            fsdp = next((f for f in (1, 2, 4, 8, 16, 32, 64) if devices % f == 0
                         and plan.state_bytes(abstract, f) <= hbm / 2), None)
            if fsdp is not None and 2048 % devices == 0:
                img_s = chips * chip.peak_tflops * 1e12 / per_image
                cell = (f"{generation}-{chips * chip.cores_per_count}, fsdp {fsdp}: "
                        f"{img_s:,.0f} img/s")
                break
        cells.append(cell)
    return "| " + " | ".join(cells) + " |"


def compiled_row(spec: str) -> str:
    """The compiled row of `PRESET:SLICE:FSDP:BATCH_PER_DEVICE`."""
    from edm2_jax.analysis import plan, tpu_slices
    name, slice_name, fsdp, per_device = spec.split(":")
    config = preset_config(name)
    config.mesh.fsdp, config.batch_per_device = int(fsdp), int(per_device)
    topology = plan.open_topology(tpu_slices.parse_slice(slice_name))
    t = time.perf_counter()
    try:
        p = plan.plan_run(config, topology, sample_batch=0)
        step = p.step
        hbm = f"{step.peak / 2**30:.1f} of {topology.hbm_bytes / 2**30:.0f} GiB"
        bound = 2048 / (step.flops * len(topology.devices) / (
            topology.slice.chip.peak_tflops * 1e12 * topology.slice.chips))
        cells = [name, slice_name, fsdp, per_device, hbm, f"{bound:,.0f}",
                 f"{step.compile_s:.0f}"]
    except ValueError as e:
        cells = [name, slice_name, fsdp, per_device, f"does not fit: {e}", "-",
                 f"{time.perf_counter() - t:.0f}"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile", default="", help="PRESET:SLICE:FSDP:BATCH_PER_DEVICE")
    args = ap.parse_args()
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if args.compile:
        print(compiled_row(args.compile), flush=True)
        return
    print("| preset | params (M) | GFLOP per training image | train state per chip, "
          "unsplit (GiB) | v5e | v6e | v4 | v5p |")
    print("|---|---|---|---|---|---|---|---|")
    for name in PRESETS:
        print(sizes_row(name), flush=True)


if __name__ == "__main__":
    process.setup_entry_point()
    main()
