"""Whether a run's arrays fit a TPU slice, before anything compiles (`plan.py` compiles):
the network the run trains, read without its weights (`plan_start`), its train state's
bytes per device as the run splits it (`sharding.state_bytes`: every network of the
state split by `mesh.fsdp`, the teacher's and a fake denoiser's as the params), and the
refusal, naming the fix, of a state that with its gradients is over a device's HBM.

    config, start = plan_start(config, objective)
    model = setup.setup_model(config, start, devices=list(topology.devices))
    state = check_state_fits(config, topology, model.abstract_state)   # or ValueError

`topology`: a `plan.Topology` (its `devices`, `hbm_bytes` per device and `slice`).
"""
from __future__ import annotations

from typing import Any, Callable

import ml_collections

from edm2_jax import nets, objectives
from edm2_jax.training import setup
from edm2_jax.training import sharding as shard_lib
from edm2_jax.training import state as state_lib

GIB = 2**30


def plan_start(config: ml_collections.ConfigDict, objective: objectives.Objective,
               log: Callable[[str], None] = print
               ) -> tuple[ml_collections.ConfigDict, setup.Start]:
    """`(config, start)`: the run's start and its config with the network it trains, no
    weights read. The network the objective starts from (a teacher, `Objective.start()`)
    from its metadata (`nets.net_config`) in `config.network`'s dtype, as
    `setup.run_config` sets it; where it is not given or not on this machine, the
    config's own network (a preset's: its teacher's). Either said in one `log` line."""
    network = objective.start()
    if network is None:
        return config, setup.Start(objective)
    try:
        net_config = dict(nets.net_config(network.path)) if network.path else None
    except FileNotFoundError:
        net_config = None
    if net_config is None:
        where = (f"{network.flag}={network.path} is not on this machine" if network.path
                 else "is not given")
        log(f"The {network.role} {where}: planned with the config's network (config."
            f"network, model_channels={config.network.model_channels}) as the "
            f"{network.role}'s; no weights are read")
        return config, setup.Start(objective, network)
    config = ml_collections.ConfigDict(config.to_dict())
    config.network = ml_collections.ConfigDict(dict(net_config, dtype=config.network.dtype))
    log(f"The {network.role}'s network: {network.path} (model_channels="
        f"{net_config.get('model_channels')}, from its metadata; no weights are read)")
    return config, setup.Start(objective, network, net_config)


def floor_bytes(abstract_state: Any, fsdp: int, trained: tuple[str, ...] = ("params",)
                ) -> int:
    """The least a training step holds per device, bytes: the train state split over
    `fsdp` devices (`sharding.state_bytes`) and the gradients of the networks it trains
    (the entries `trained`, one float32 copy each, split as they are), before
    activations."""
    return sum(shard_lib.state_bytes(tree, fsdp) for tree in
               (abstract_state, {k: abstract_state[k] for k in trained}))


def state_words(abstract_state: Any) -> str:
    """What a train state holds, for messages: 'params, Adam moments, EMAs' and the
    entries its objective adds ('teacher', 'fake', 'fake_opt')."""
    return ", ".join(["params, Adam moments, EMAs"]
                     + [k for k in abstract_state if k not in state_lib.BASE_KEYS])


def check_state_fits(config: ml_collections.ConfigDict, topology: Any,
                     abstract_state: Any) -> int:
    """The train state's bytes per device. Raises ValueError, before anything compiles,
    where the state and its gradients (`floor_bytes`: of the params and of the
    objective's `trained` networks) alone exceed the device's HBM, naming the smallest
    `mesh.fsdp` that leaves half the HBM for activations (else the smallest that fits
    them at all, else a larger slice)."""
    n, fsdp = len(topology.devices), int((config.get("mesh") or {}).get("fsdp", 1))
    trained = ("params",) + tuple(objectives.from_config(config).trained)
    hbm = topology.hbm_bytes
    need = floor_bytes(abstract_state, fsdp, trained)
    if need <= hbm:
        return shard_lib.state_bytes(abstract_state, fsdp)
    sizes = [f for f in range(fsdp + 1, n + 1) if n % f == 0]
    half = [f for f in sizes if floor_bytes(abstract_state, f, trained) <= hbm / 2]
    full = [f for f in sizes if floor_bytes(abstract_state, f, trained) <= hbm]
    if half or full:
        f = (half or full)[0]
        fix = (f"set --config.mesh.fsdp={f} (then "
               f"{floor_bytes(abstract_state, f, trained) / GIB:.1f} GiB each"
               f"{', half the HBM left for activations' if half else ''})")
    else:
        fix = "use a larger slice or chips of more HBM (v5p: 95 GiB)"
    raise ValueError(f"{topology.slice.name}: the train state ({state_words(abstract_state)}) "
                     f"and its gradients alone need {need / GIB:.1f} GiB per "
                     f"device with mesh.fsdp={fsdp}, over the device's {hbm / GIB:.1f} GiB "
                     f"HBM; {fix}")


def fixes(config: ml_collections.ConfigDict, topology: Any, per_device: int) -> str:
    """The changes that lower the memory a device needs, as flags, best first (for a
    compiled program over the HBM; `per_device`: images per device per micro-batch)."""
    n, fsdp = len(topology.devices), int((config.get("mesh") or {}).get("fsdp", 1))
    out = []
    if per_device > 1:
        out.append(f"a smaller --config.batch_per_device (micro-batches of "
                   f"{max(1, per_device // 2)} images per device; the same step)")
    if fsdp * 2 <= n:
        out.append(f"--config.mesh.fsdp={fsdp * 2} (more FSDP: the train state split "
                   f"over more devices)")
    bigger = (topology.slice.chip.generation, 2 * topology.slice.chips
              * topology.slice.chip.cores_per_count)
    out.append(f"a larger slice ({bigger[0]}-{bigger[1]}) or chips of more HBM (v5p)")
    return "; or ".join(out)
