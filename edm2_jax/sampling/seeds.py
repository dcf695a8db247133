"""Per-seed randomness of the samplers: every draw of an image (its initial noise, its
churn noise, its random label) comes from its own integer seed (`seed_keys`), on its
own sub-stream, so that an image depends only on its seed, never on the batch it was
generated in or on the device count; `split_seeds` spreads the seeds over this
process's devices. Import them from here (`sampler.sample_images` draws its images'
noise, churn and labels with them)."""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# Sub-streams of a seed's key, so that adding a new random draw never changes old ones.
_NOISE_STREAM, _LABEL_STREAM, _CHURN_STREAM = 0, 1, 2


def split_seeds(seeds: Sequence[int] | np.ndarray) -> np.ndarray | Array:
    """`seeds` as a uint32 array split over this process's devices (a 1-D mesh) when
    there are several and they divide the count, so that `sample_images` runs data-parallel
    over them (e.g. the 2 CPU devices of `edm2_jax/process.py`); else a NumPy array. Images
    are per seed either way, up to float32 summation order."""
    seeds = np.asarray(seeds).astype(np.uint32)
    n_dev = jax.local_device_count()
    if n_dev == 1 or seeds.ndim != 1 or seeds.shape[0] % n_dev:
        return seeds
    mesh = jax.sharding.Mesh(np.asarray(jax.local_devices()), ("data",))
    return jax.device_put(seeds, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))


def seed_array(seeds: Sequence[int] | Array) -> Array:
    """Seeds as a `[B]` uint32 array (taken mod 2^32); ValueError unless 1-D integers."""
    if isinstance(seeds, jax.Array):  # possibly traced
        if seeds.ndim != 1 or not jnp.issubdtype(seeds.dtype, jnp.integer):
            raise ValueError(f"seeds must be a 1-D integer array, got {seeds.dtype} {seeds.shape}")
        return seeds.astype(jnp.uint32)
    seeds = np.asarray(seeds if isinstance(seeds, np.ndarray) else list(seeds))
    if seeds.ndim != 1 or not np.issubdtype(seeds.dtype, np.integer):
        raise ValueError(f"seeds must be a 1-D sequence of ints, got {seeds!r}")
    return jnp.asarray((seeds.astype(np.int64) % 2**32).astype(np.uint32))


def seed_keys(seeds: Sequence[int] | Array) -> Array:
    """One legacy PRNG key per seed, `PRNGKey(seed mod 2^32)`: `[B] ints -> [B, 2] uint32`."""
    return jax.vmap(jax.random.PRNGKey)(seed_array(seeds))


def seed_noise(seeds: Sequence[int] | Array, shape: Sequence[int]) -> Array:
    """Initial unit Gaussian noise per seed: `[B] ints, (H, W, C) -> [B, H, W, C]` float32."""
    keys = seed_keys(seeds)
    return jax.vmap(lambda k: jax.random.normal(
        jax.random.fold_in(k, _NOISE_STREAM), tuple(shape), jnp.float32))(keys)


def seed_churn_noise(seeds: Sequence[int] | Array,
                     shape: Sequence[int]) -> Callable[[Array], Array]:
    """Churn noise per seed for `edm_sampler(churn_noise=...)`: returns `i -> [B, *shape]`,
    the unit noise of step `i` drawn from each seed's own key."""
    keys = seed_keys(seeds)

    def churn_noise(i):
        return jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(
            jax.random.fold_in(k, _CHURN_STREAM), i), tuple(shape), jnp.float32))(keys)

    return churn_noise


def random_labels(seeds: Sequence[int] | Array, label_dim: int) -> Array:
    """Uniformly random class per seed as one-hot: `[B] ints -> [B, label_dim]` float32."""
    if label_dim < 1:
        raise ValueError(f"label_dim must be >= 1, got {label_dim}")
    keys = seed_keys(seeds)
    idx = jax.vmap(lambda k: jax.random.randint(
        jax.random.fold_in(k, _LABEL_STREAM), (), 0, label_dim))(keys)
    return jax.nn.one_hot(idx, label_dim, dtype=jnp.float32)
