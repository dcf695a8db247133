"""The tables of docs/scaling.md: every release preset at batch 2048 on the TPU slices people
rent, trained by EDM2 and distilled (configs/distill.py), from XLA's TPU compiler on this
machine (libtpu; `edm2_jax/planner/plan.py`).

    python benchmarks/tpu_scaling.py > table.md                      # array sizes only: a minute
    python benchmarks/tpu_scaling.py --compile=img512-xxl:v5p-64:1:8 # one compiled row
    python benchmarks/tpu_scaling.py --compile=dmd-img512-s:v5e-8:4:4
    python benchmarks/tpu_scaling.py --compile=scm-img512-s:v5e-8:1:8

Without `--compile`, for each preset (img64 xs-xl, img512 xxs-xxl) and chip (v5e, v6e, v4,
v5p): the parameters, the model flops per training image (`Objective.flops_per_image`: 3
forward passes for the EDM2 step, x the forward pass's convolutions and matmuls), the train
state (params, Adam moments, the two power EMAs) per chip unsplit, and the smallest slice of
8 or more chips (16 to 256) with the smallest `mesh.fsdp` that leaves the state at most half
a chip's HBM (the rest is for activations, which only a compile tells), with that slice's
flops-bound img/s at the chip's bf16 peak (a lower bound on the time, an upper bound on
img/s). Then for each preset distilled (`DISTILLED`), on v5e and v5p: `consistency-PRESET`
(`configs/distill.py:PRESET`, a 4-step consistency student: the state adds the frozen
teacher), `dmd-PRESET` (`configs/distill.py:dmd-PRESET`, a 1-step DMD generator: the
teacher, the fake denoiser and its Adam moments) and `scm-PRESET`
(`configs/distill.py:scm-PRESET`, a 2-step sCD student: the teacher and the step counter of
the tangent warmup; 6 passes per image, the jvp's primal and tangent counted). Every network of a state splits by fsdp
(`sharding.state_spec`), the teacher's and the fake's as the generator's.

`--compile=CONFIG:SLICE:FSDP:BATCH_PER_DEVICE` (CONFIG a preset or a distilled one) compiles
one run's step (no sampler) and prints its row: HBM per chip of the compiled step, its
arguments (the train state and the chip's batch), and the compile time here. Real presets
compile for minutes to tens of minutes on 2 cores; run one at a time.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from edm2_jax import process  # noqa: E402

PRESETS = [f"img64-{v}" for v in ("xs", "s", "m", "l", "xl")] + [
    f"img512-{v}" for v in ("xxs", "xs", "s", "m", "l", "xl", "xxl")]
# The distilled configs: `KIND-PRESET` is `configs/distill.py:VARIANT`.
DISTILLED = {"consistency": "{preset}", "dmd": "dmd-{preset}", "scm": "scm-{preset}"}
SIZES = (8, 16, 32, 64, 128, 256)  # chips


def _preset(name: str) -> str:
    """The preset whose network config `name` trains ('dmd-img512-s': 'img512-s')."""
    kind, _, preset = name.partition("-")
    return preset if kind in DISTILLED and preset in PRESETS else name


def preset_config(name: str):
    """The TPU's config (`plan.tpu_config`) of `name` at batch 2048: a preset
    ('img512-s', `configs.preset_config`) or a distilled one ('dmd-img512-s', `DISTILLED`),
    without a teacher path (the plan takes the preset's network as the teacher's)."""
    from edm2_jax import configs
    from edm2_jax.planner import plan
    preset = _preset(name)
    if preset != name:
        variant = DISTILLED[name.partition("-")[0]].format(preset=preset)
        spec = importlib.util.spec_from_file_location(
            "distill_config", os.path.join(REPO, "configs", "distill.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config = module.get_config(variant)
    else:
        config = configs.preset_config(name)
    config = plan.tpu_config(config)
    config.batch_size = 2048
    return config


@functools.lru_cache(maxsize=None)
def _forward_flops(preset: str) -> float:
    """`plan.forward_flops` per image of the network of `preset`."""
    from edm2_jax.planner import plan
    from edm2_jax.training import state as state_lib
    return plan.forward_flops(state_lib.make_network(preset_config(preset)), 1)


def _sizes(name: str) -> tuple:
    """`(net, abstract train state, model flops per training image)` of config `name`."""
    import jax
    from edm2_jax import objectives
    from edm2_jax.training import optim, state as state_lib
    config = preset_config(name)
    objective = objectives.from_config(config)
    net = state_lib.make_network(config)
    tx = optim.make_optimizer(config.optim, 2048)
    abstract = jax.eval_shape(
        lambda r: state_lib.init_train_state(config, net, tx, r, objective=objective),
        jax.random.PRNGKey(0))
    return net, abstract, objective.flops_per_image(_forward_flops(_preset(name)))


def _fit_cell(abstract, per_image: float, generation: str) -> str:
    """The smallest slice of `generation` (8 chips or more) with the smallest fsdp that
    leaves the state at most half a device's HBM, and its flops-bound img/s; '-' if none."""
    from edm2_jax.planner import tpu_slices
    from edm2_jax.training import sharding as shard_lib
    chip = tpu_slices.CHIPS[generation]
    devices_per_chip = 2 if generation == "v4" else 1  # libtpu's v4: one per TensorCore
    hbm = chip.hbm_gib * 2**30 / devices_per_chip
    for chips in SIZES:
        devices = chips * devices_per_chip
        fsdp = next((f for f in (1, 2, 4, 8, 16, 32, 64) if devices % f == 0
                     and shard_lib.state_bytes(abstract, f) <= hbm / 2), None)
        if fsdp is not None and 2048 % devices == 0:
            img_s = chips * chip.peak_tflops * 1e12 / per_image
            return (f"{generation}-{chips * chip.cores_per_count}, fsdp {fsdp}: "
                    f"{img_s:,.0f} img/s")
    return "-"


def sizes_row(name: str) -> str:
    """The array-size row of preset `name` (module docstring)."""
    from edm2_jax.model.networks import count_params
    from edm2_jax.training import sharding as shard_lib
    net, abstract, per_image = _sizes(name)
    cells = [name, f"{count_params(net) / 1e6:.0f}", f"{per_image / 1e9:.0f}",
             f"{shard_lib.state_bytes(abstract, 1) / 2**30:.1f}"]
    cells += [_fit_cell(abstract, per_image, g) for g in ("v5e", "v6e", "v4", "v5p")]
    return "| " + " | ".join(cells) + " |"


def distilled_row(name: str) -> str:
    """The array-size row of distilled config `name` ('dmd-img512-s'): the entries its
    objective adds to the train state, the model flops per training image, the train
    state per chip unsplit, and the v5e and v5p cells of `sizes_row`."""
    from edm2_jax.training import sharding as shard_lib
    from edm2_jax.training import state as state_lib
    _, abstract, per_image = _sizes(name)
    added = ", ".join(k for k in abstract if k not in state_lib.BASE_KEYS)
    cells = [name, added, f"{per_image / 1e9:.0f}",
             f"{shard_lib.state_bytes(abstract, 1) / 2**30:.1f}"]
    cells += [_fit_cell(abstract, per_image, g) for g in ("v5e", "v5p")]
    return "| " + " | ".join(cells) + " |"


def compiled_row(spec: str) -> str:
    """The compiled row of `CONFIG:SLICE:FSDP:BATCH_PER_DEVICE`."""
    from edm2_jax.planner import plan, tpu_slices
    name, slice_name, fsdp, per_device = spec.split(":")
    config = preset_config(name)
    config.mesh.fsdp, config.batch_per_device = int(fsdp), int(per_device)
    topology = plan.open_topology(tpu_slices.parse_slice(slice_name))
    t = time.perf_counter()
    try:
        p = plan.plan_run(config, topology, sample_batch=0, log=lambda line: None)
        step = p.step
        hbm = (f"{step.peak / 2**30:.1f} of {topology.hbm_bytes / 2**30:.0f} GiB (arguments "
               f"{step.arguments / 2**30:.2f}, of which train state {p.state / 2**30:.2f})")
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
    ap.add_argument("--compile", default="", help="CONFIG:SLICE:FSDP:BATCH_PER_DEVICE")
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
    print()
    print("| distilled | added to the train state | GFLOP per training image | train state "
          "per chip, unsplit (GiB) | v5e | v5p |")
    print("|---|---|---|---|---|---|")
    for kind in DISTILLED:
        for preset in PRESETS:
            print(distilled_row(f"{kind}-{preset}"), flush=True)


if __name__ == "__main__":
    process.setup_entry_point()
    main()
