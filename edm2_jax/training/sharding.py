"""Device mesh and shardings: data parallelism, optionally with FSDP.

The mesh has two axes, `('data', 'fsdp')`, over every device of every host; its shape is
`config.mesh = {data: -1, fsdp: 1}` (-1 = all the devices the other axis leaves).

- The batch is split along both axes together (each device gets `B / num_devices`
  images), so FSDP devices are data-parallel too, as in ZeRO-3.
- The train state (`state_shardings`), one rule for every network in it: each array is
  split along `'fsdp'` on its largest axis divisible by the fsdp size (`fsdp_spec`); ties
  go to the later axis (output channels of HWIO / `[in, out]` weights), so forced weight
  normalisation over the fan-in stays local. Arrays with no such axis (gains, Adam's
  count) are replicated. The rule holds whatever entry holds the array: the params, Adam
  moments and EMAs, and the networks a training objective adds (a distillation's frozen
  `'teacher'`, DMD's `'fake'` denoiser and its Adam state `'fake_opt'`). XLA's SPMD
  partitioner inserts the all-gathers of weights and the reduce-scatters of gradients.
- The entries that are no network's (`REPLICATED_STATE_KEYS`: the step counter, the
  PRNG key, the MPFourier buffers) are replicated.

With `fsdp = 1` everything but the batch is replicated: plain data parallelism. The same
code runs on 1 CPU, 8 simulated CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`), a GPU box, several SLURM hosts or
a TPU slice (one process per host, `maybe_initialize_distributed`).
"""
from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA, FSDP = "data", "fsdp"
BATCH_AXES = (DATA, FSDP)  # the batch is split over the whole mesh

# The top-level entries of the train state that hold no network's weights or moments:
# the step counter, the PRNG key (whose 2 words an fsdp of 2 would split) and the
# MPFourier buffers (a few hundred numbers, read whole by every layer). Every other
# entry is split by `fsdp_spec`.
REPLICATED_STATE_KEYS = ("step", "rng", "buffers")


def maybe_initialize_distributed() -> None:
    """Call `jax.distributed.initialize()` when launched as one of several processes:
    SLURM with several tasks, TPU pod slices (both detected by JAX), or by hand with
    `JAX_COORDINATOR_ADDRESS=host:port JAX_NUM_PROCESSES=n JAX_PROCESS_ID=i` set in
    each process."""
    multi = (int(os.environ.get("SLURM_NTASKS", "1")) > 1
             or os.environ.get("JAX_COORDINATOR_ADDRESS")
             or os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0)
    if multi and not jax.distributed.is_initialized():
        kw = {}
        if os.environ.get("JAX_NUM_PROCESSES") and os.environ.get("JAX_PROCESS_ID"):
            kw = dict(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                      process_id=int(os.environ["JAX_PROCESS_ID"]))
        jax.distributed.initialize(**kw)


def make_mesh(num_devices: int | None = None, *, data: int = -1, fsdp: int = 1,
              devices: list | None = None) -> Mesh:
    """A `Mesh` with axes `('data', 'fsdp')` of shape `(data, fsdp)`.

    Args:
      num_devices: use the first `num_devices` devices (default: all, of all hosts).
      data: size of the data-parallel axis; -1 = `num_devices // fsdp`.
      fsdp: size of the axis that the train state's networks (weights, optimiser
        states, EMAs) are split along.
      devices: the devices to choose from (default `jax.devices()`); e.g. those of a TPU
        topology compiled for without a TPU (`jax.experimental.topologies`).

    Raises ValueError when the sizes do not multiply to the device count, or do not lay
    out on a TPU slice's torus (naming the fsdp sizes that do).
    """
    given = devices
    devices = list(jax.devices() if devices is None else devices)
    if num_devices is not None:
        if num_devices > len(devices):
            raise ValueError(f"asked for {num_devices} devices, only {len(devices)} available")
        devices = devices[:num_devices]
    n = len(devices)
    data, fsdp = int(data), int(fsdp)
    if fsdp < 1 or n % fsdp:
        raise ValueError(f"mesh.fsdp={fsdp} must be >= 1 and divide the {n} devices; set "
                         f"--config.mesh.fsdp to a divisor of {n}")
    if data == -1:
        data = n // fsdp
    if data * fsdp != n:
        raise ValueError(f"mesh data={data} x fsdp={fsdp} = {data * fsdp} devices, but there "
                         f"are {n}; set --config.mesh.data=-1 to use them all")
    # jax.make_mesh orders the devices for the interconnect (process-major on CPU and
    # GPU, so host p's devices hold batch rows [p B/P, (p+1) B/P), the slice its data
    # iterator loads); global_batch places each host's rows on its own devices.
    axis_types = (jax.sharding.AxisType.Auto,) * 2
    try:
        return jax.make_mesh((data, fsdp), (DATA, FSDP), devices=devices,
                             axis_types=axis_types)
    except AssertionError:
        if given is None:
            raise
        # A topology described with one device per TensorCore (libtpu's v4 without a
        # TPU) has no physical mesh in JAX, which wants one per chip: the given order.
        return Mesh(np.array(devices).reshape(data, fsdp), (DATA, FSDP), axis_types=axis_types)
    except NotImplementedError:  # a TPU torus whose axes the mesh's sizes do not tile
        fits = [f for f in range(1, n + 1) if n % f == 0 and _tiles(devices, n // f, f)]
        raise ValueError(f"mesh data={data} x fsdp={fsdp} does not lay out on this TPU "
                         f"slice's torus (each mesh axis must be a product of its axes' "
                         f"sizes); set --config.mesh.fsdp to one of {fits}") from None


def _tiles(devices: list, data: int, fsdp: int) -> bool:
    """Whether JAX lays a `(data, fsdp)` mesh out on `devices`."""
    try:
        jax.make_mesh((data, fsdp), (DATA, FSDP), devices=devices)
        return True
    except NotImplementedError:
        return False


def mesh_from_config(config: Any, num_devices: int | None = None,
                     devices: list | None = None) -> Mesh:
    """`make_mesh` over the first `num_devices` of `devices` (default all of
    `jax.devices()`) with the sizes of `config.mesh` (default `{data: -1, fsdp: 1}`)."""
    m = config.get("mesh") or {}
    return make_mesh(num_devices, data=m.get("data", -1), fsdp=m.get("fsdp", 1),
                     devices=devices)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, leading_unsharded: int = 0) -> NamedSharding:
    """Split axis `leading_unsharded` of an array over the whole mesh (earlier axes
    unsplit)."""
    return NamedSharding(mesh, P(*([None] * leading_unsharded), BATCH_AXES))


def fsdp_spec(shape: tuple[int, ...], fsdp: int) -> P:
    """`PartitionSpec` splitting the largest axis of `shape` divisible by `fsdp` along
    `'fsdp'` (the last such axis among equals), or replicated (`P()`) if none is or
    `fsdp == 1`."""
    if fsdp == 1:
        return P()
    best = None
    for axis, size in enumerate(shape):
        if size % fsdp == 0 and (best is None or size >= shape[best]):
            best = axis
    if best is None:
        return P()
    return P(*([None] * best), FSDP)


def state_spec(path: tuple, shape: tuple[int, ...], fsdp: int) -> P:
    """The `PartitionSpec` of the train-state array at `path` (a key path from
    `jax.tree_util.tree_map_with_path`, its first key the state's top-level entry) of
    `shape`: replicated in the entries of `REPLICATED_STATE_KEYS`, else `fsdp_spec`."""
    top = path[0].key if path and hasattr(path[0], "key") else None
    return P() if top in REPLICATED_STATE_KEYS else fsdp_spec(tuple(shape), fsdp)


def state_shardings(mesh: Mesh, state: Any) -> Any:
    """Pytree of `NamedSharding`s like `state` (arrays or `ShapeDtypeStruct`s), each
    array's by `state_spec`: every network's arrays split over `'fsdp'`, the counter,
    key and buffers replicated."""
    fsdp = mesh.shape[FSDP]
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, state_spec(path, x.shape, fsdp)), state)


def state_bytes(state: Any, fsdp: int) -> int:
    """Bytes per device of a train state (arrays or `ShapeDtypeStruct`s, e.g. of
    `jax.eval_shape`) split over `fsdp` devices by `state_spec`, as `state_shardings`
    splits it."""
    total = 0

    def add(path, x):
        nonlocal total
        split = state_spec(path, x.shape, fsdp) != P()
        total += int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize // (fsdp if split else 1)

    jax.tree_util.tree_map_with_path(add, state)
    return total


def global_batch(mesh: Mesh, local: dict) -> dict:
    """Assemble a global batch (split over the mesh) from this process's slice."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in local.items()}


def to_host(tree: Any) -> Any:
    """Numpy copy of a pytree of (possibly sharded, possibly multi-host) arrays. A
    collective when some array spans several processes: every process must call it."""
    leaves = jax.tree.leaves(tree)
    if all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(tree, tiled=True)


@functools.lru_cache(maxsize=None)
def _jit_any(mesh: Mesh):
    return jax.jit(jnp.any, out_shardings=replicated(mesh))


def any_process(mesh: Mesh, flag: bool) -> jax.Array:
    """Dispatch the OR of this process's `flag` over all processes, without waiting: a
    replicated bool scalar to read (`bool(...)`) later. A collective: every process must
    call it, the same number of times."""
    local = np.full((len(mesh.local_devices),), bool(flag))
    arr = jax.make_array_from_process_local_data(NamedSharding(mesh, P(BATCH_AXES)), local,
                                                 (mesh.size,))
    return _jit_any(mesh)(arr)
