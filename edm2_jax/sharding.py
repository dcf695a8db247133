"""Device mesh and shardings for data-parallel training.

One mesh axis, `'data'`, over every device of every host; the batch is split along it
and params, optimiser state and EMAs are replicated. The same code runs on 1 CPU, 8
simulated CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`), a GPU box
or a TPU slice.
"""
from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA = "data"


def maybe_initialize_distributed() -> None:
    """Call `jax.distributed.initialize()` when launched as one of several processes
    (SLURM with several tasks, TPU pod slices, or JAX_COORDINATOR_ADDRESS set)."""
    multi = (int(os.environ.get("SLURM_NTASKS", "1")) > 1
             or os.environ.get("JAX_COORDINATOR_ADDRESS")
             or os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0)
    if multi and not jax.distributed.is_initialized():
        jax.distributed.initialize()


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D `Mesh` with axis `'data'` over the first `num_devices` (default all) devices."""
    devices = jax.devices()
    if num_devices is not None:
        if num_devices > len(devices):
            raise ValueError(f"asked for {num_devices} devices, only {len(devices)} available")
        devices = devices[:num_devices]
    return Mesh(np.asarray(devices), (DATA,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, leading_unsharded: int = 0) -> NamedSharding:
    """Shard axis `leading_unsharded` of an array along `'data'` (earlier axes unsplit)."""
    return NamedSharding(mesh, P(*([None] * leading_unsharded), DATA))


def global_batch(mesh: Mesh, local: dict) -> dict:
    """Assemble a global batch (sharded along `'data'`) from this process's slice."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in local.items()}
