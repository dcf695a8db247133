"""Images from seeds: a network, its sampler (a value of `solvers`: the EDM Heun
sampler, or a few-step sampler) and guidance (docs/recipe.md §6).

The guidance form is the one shared by classifier-free guidance and autoguidance (Karras
et al. 2024, arXiv:2406.02507, Eq. 1): `D_w(x; sigma) = D_g(x; sigma) + w (D_main(x;
sigma) - D_g(x; sigma))`, optionally only on the steps inside a guidance interval
(Kynkaeaenniemi et al. 2024, arXiv:2404.07724; `guidance.py`).

Randomness is drawn per image from its integer seed (`seeds.seed_keys`; or, with
`rng='release'`, as the authors' release draws it, `release_rng.py`), so an image depends
only on its seed, never on the batch it was generated in or on the device count.

    net = precond_from_config(cfg.network); variables = load_network(...)
    images = sample_images(net, variables, seeds=range(16), sampler=solvers.Heun(32))  # uint8
    images = sample_images(net, variables, range(16), sampler=solvers.FewStep(2))
    save_image_grid(np.asarray(images), "grid.png", rows=4, cols=4)
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from edm2_jax.sampling import solvers
from edm2_jax.sampling.guidance import check_guidance_interval, make_denoiser
from edm2_jax.sampling.schedule import edm_sigma_steps
from edm2_jax.sampling.seeds import random_labels, seed_array, seed_churn_noise, seed_noise

Array = jax.Array


# ---------------------------------------------------------------------------------------
# Images.

def decode_uint8(x: Array) -> Array:
    """Images in [-1, 1] to uint8, `uint8(clip(x * 127.5 + 128, 0, 255))` (the +128 makes
    the truncating cast round to nearest): any shape float -> same shape uint8."""
    return jnp.clip(jnp.asarray(x, jnp.float32) * 127.5 + 128, 0, 255).astype(jnp.uint8)


def release_seed_draws(seeds: Sequence[int] | Array, shape: Sequence[int], label_dim: int,
                       sampler: solvers.Sampler) -> tuple:
    """The release's per-seed draws (`release_rng.release_draws`) for `sampler` (one of
    `release_draws`, on the EDM schedule of its `release_schedule()`): `(noise
    [B, *shape] f32, labels [B, label_dim] one-hot or None, churn_table
    [steps, B, *shape] or None)`, the table holding step `i`'s churn noise where the
    release draws it (a `stochastic` sampler with churn, `S_min <= t_i <= S_max`),
    zeros elsewhere. `seeds` must be concrete (host) values."""
    from edm2_jax.release import rng as release_rng
    num_steps, sigma_min, sigma_max, rho = sampler.release_schedule()
    t = edm_sigma_steps(num_steps, sigma_min, sigma_max, rho)[:-1].astype(np.float32)
    if sampler.stochastic and sampler.takes_churn:
        draws = np.flatnonzero((sampler.S_min <= t) & (t <= sampler.S_max))
    else:
        draws = np.zeros(0, int)
    noise, idx, churn = release_rng.release_draws(np.asarray(seeds).tolist(), shape, label_dim,
                                                  len(draws))
    labels = None if idx is None else np.eye(label_dim, dtype=np.float32)[idx]
    table = None
    if churn is not None:
        table = np.zeros((num_steps,) + noise.shape, np.float32)
        table[draws] = churn
    return noise, labels, table


@functools.partial(jax.jit, static_argnames=("net", "guide_net", "guidance", "sampler",
                                             "raw", "guidance_interval"))
def _sample(net, variables, guide_net, guide_variables, seeds, labels, guidance,
            sampler, noise=None, churn_table=None, raw=False, guidance_interval=None):
    shape = (net.img_resolution, net.img_resolution, net.img_channels)
    churn = seed_churn_noise(seeds, shape) if sampler.stochastic else None
    if churn_table is not None:
        churn = lambda i: churn_table[i]  # noqa: E731
    if noise is None:
        noise = seed_noise(seeds, shape)
    denoise = make_denoiser(net, variables, guide_net, guide_variables, guidance)
    interval = {} if guidance_interval is None else {"guidance_interval": guidance_interval}
    x = sampler(denoise, noise, labels, churn_noise=churn, **interval)
    finite = jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim)))
    return (x if raw else decode_uint8(x)), finite


def sample_images(net: Any, variables: Any, seeds: Sequence[int] | Array,
                  labels: Array | int | None = None, *, guide_net: Any = None,
                  guide_variables: Any = None, guidance: float = 1.0,
                  sampler: solvers.Sampler | None = None, rng: str = "jax",
                  raw: bool = False, guidance_interval: tuple[float, float] | None = None,
                  return_finite: bool = False) -> Array | tuple[Array, Array]:
    """Generate one pixel-space image per seed with `sampler` (guided), jitted.

    Noise, churn noise and random labels all come from each seed's own stream, so an
    image is the same whatever batch it is generated in: with `rng='jax'` (default,
    drawn on the device) a JAX key per seed; with `rng='release'` the release's
    per-seed torch generator, reproduced in NumPy on the host (`release_seed_draws`;
    a converted release net then gives the release's image for a seed). Decoding is
    that of images in [-1, 1]: `uint8(clip(x * 127.5 + 128, 0, 255))`; `raw=True`
    returns the sampler's float32 output instead (latent nets: `vae.SDVAE.decode` it).

    Args:
      net, variables: the main `Precond` and its `{'params', 'buffers'}`.
      seeds: `[B]` ints.
      labels: for a conditional net, None (a random class per seed), an int class index
        for every image, or `[B, label_dim]` one-hot; must be None for `label_dim == 0`.
      guide_net, guide_variables, guidance: see `make_denoiser`.
      sampler: a `solvers.Sampler` value (`solvers.Heun`, `solvers.FewStep`, one
        registered by a plugin, or what an objective's `sampler` returns); None:
        `solvers.Heun()` (32 steps).
      rng: `'jax'` or `'release'` (then `seeds` must be concrete values, not traced).
      guidance_interval: `(sigma_lo, sigma_hi)`: guidance only on the steps with
        `sigma_lo < t_i <= sigma_hi` (`guidance.guided_steps`); None: on every step.
    Returns: `[B, H, W, C]` uint8 (float32 with `raw`); with `return_finite`, also `[B]`
      bool: whether each sample was finite before decoding (a sample that overflowed is
      black or white once decoded; `seed_images.generate_images` refuses to write it).
    Raises: ValueError on labels that do not fit the net (the message names the fix),
      an unknown `rng` or one the sampler cannot follow, a guidance interval with a
      sampler that has none (`FewStep`), or a bad interval or one at `guidance == 1`
      (before compiling).
    """
    if sampler is None:
        sampler = solvers.Heun()
    _check_sample_options(sampler, guidance_interval, rng)
    noise = churn_table = None
    if rng == "release":
        noise, release_labels, churn_table = _release_inputs(net, seeds, sampler)
        if labels is None:
            labels = release_labels
    seeds = seed_array(seeds)
    labels = _label_array(net, labels, seeds)
    interval = check_guidance_interval(guidance_interval)
    if guidance == 1:
        if interval is not None:
            raise ValueError(f"guidance_interval={interval} with guidance=1 changes nothing; "
                             f"drop the interval or set guidance != 1 (with a guide)")
        guide_net = guide_variables = None
    elif guide_net is None or guide_variables is None:
        raise ValueError(f"guidance={guidance} needs guide_net and guide_variables")
    images, finite = _sample(net, variables, guide_net, guide_variables, seed_array(seeds),
                             labels, float(guidance), sampler, noise, churn_table, bool(raw),
                             interval)
    return (images, finite) if return_finite else images


def _check_sample_options(sampler: solvers.Sampler,
                          guidance_interval: tuple[float, float] | None, rng: str) -> None:
    """Raises: ValueError on a sampler that is not a `solvers.Sampler`, a guidance
    interval with a sampler without one, an unknown `rng`, or `rng='release'` with a
    sampler whose draws are not the release's (`sample_images`)."""
    if not isinstance(sampler, solvers.Sampler):
        raise ValueError(f"sampler={sampler!r}: pass a sampler value (a subclass of "
                         f"edm2_jax.sampling.solvers.Sampler; registered: "
                         f"{', '.join(sorted(solvers.SAMPLERS))})")
    if guidance_interval is not None and not sampler.takes_guidance_interval:
        raise ValueError(f"{sampler.describe()} has no guidance interval: drop "
                         f"guidance_interval")
    if rng not in ("jax", "release"):
        raise ValueError(f"rng={rng!r}: use 'jax' (JAX keys per seed) or 'release' (the "
                         f"release's per-seed torch generator)")
    if rng == "release" and not sampler.release_draws:
        raise ValueError(f"rng='release' follows the release's per-seed draws on an EDM "
                         f"schedule, which {sampler.describe()} does not take; use rng='jax'")


def _release_inputs(net: Any, seeds: Sequence[int] | Array, sampler: solvers.Sampler
                    ) -> tuple:
    """`release_seed_draws` for `net`'s image shape and labels, `(noise, labels or None,
    churn_table or None)`, the arrays split over devices as `seeds` are (when they carry
    a `NamedSharding`, from `split_seeds`)."""
    noise, labels, churn_table = release_seed_draws(
        seeds, (net.img_resolution, net.img_resolution, net.img_channels), net.label_dim,
        sampler)
    sharding = getattr(seeds, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):  # split as the seeds are
        noise = jax.device_put(noise, sharding)
        churn_table = None if churn_table is None else jax.device_put(
            churn_table, jax.sharding.NamedSharding(
                sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec)))
    return noise, labels, churn_table


def _label_array(net: Any, labels: Array | int | None, seeds: Array) -> Array | None:
    """`sample_images`' labels as `[B, label_dim]` one-hot float32 (None for an
    unconditional net): a random class per seed for None, one class for an int.
    Raises: ValueError on labels that do not fit the net (the message names the fix)."""
    batch = seeds.shape[0]
    if net.label_dim == 0:
        if labels is not None:
            raise ValueError("net is unconditional (label_dim=0); pass labels=None")
    elif labels is None:
        labels = random_labels(seeds, net.label_dim)
    elif isinstance(labels, (int, np.integer)):
        if not 0 <= labels < net.label_dim:
            raise ValueError(f"class index {labels} out of range [0, {net.label_dim})")
        labels = jnp.zeros((batch, net.label_dim), jnp.float32).at[:, labels].set(1)
    else:
        labels = jnp.asarray(labels, jnp.float32)
        if labels.shape != (batch, net.label_dim):
            raise ValueError(f"labels must be [{batch}, {net.label_dim}] one-hot, got "
                             f"{labels.shape}; or pass an int class index or None")
    return labels


def save_image_grid(images: np.ndarray, path: str, rows: int, cols: int) -> None:
    """Tile `images` uint8 `[N, H, W, C]` (C = 1 or 3) row-major into a `rows x cols`
    PNG/JPEG grid at `path` with Pillow; empty cells stay black. C = 4 (SD-VAE latents,
    e.g. a latent run's training grids, which have no VAE to decode them) is shown as a
    grey-scale preview, each image as its 4 channels in a 2x2 mosaic (`--mode=generate
    --vae=PATH` decodes them to RGB).

    Raises: ValueError on a wrong dtype/shape or when `N > rows * cols`.
    """
    import PIL.Image

    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] not in (1, 3, 4):
        raise ValueError(f"images must be uint8 [N, H, W, 1, 3 or 4], got {images.dtype} "
                         f"{images.shape}; decode with sample_images first")
    if images.shape[-1] == 4:
        n, h, w, _ = images.shape
        images = images.reshape(n, h, w, 2, 2).transpose(0, 3, 1, 4, 2).reshape(
            n, 2 * h, 2 * w, 1)
    n, h, w, c = images.shape
    if n > rows * cols:
        raise ValueError(f"{n} images do not fit a {rows}x{cols} grid; raise rows or cols")
    grid = np.zeros((rows * h, cols * w, c), np.uint8)
    for k in range(n):
        r, q = divmod(k, cols)
        grid[r * h:(r + 1) * h, q * w:(q + 1) * w] = images[k]
    PIL.Image.fromarray(grid[..., 0] if c == 1 else grid, "L" if c == 1 else "RGB").save(path)
