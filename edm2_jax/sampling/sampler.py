"""EDM sampler with guidance (docs/recipe.md §6).

Deterministic 2nd-order Heun sampler of Karras et al. 2022, "Elucidating the Design
Space of Diffusion-Based Generative Models" (Algorithm 2, with the optional stochastic
"churn"), on the rho-schedule of their Eq. 5, together with the guidance form shared by
classifier-free guidance and autoguidance (Karras et al. 2024, arXiv:2406.02507, Eq. 1):
`D_w(x; sigma) = D_g(x; sigma) + w (D_main(x; sigma) - D_g(x; sigma))`, optionally only
on the steps inside a guidance interval (Kynkaeaenniemi et al. 2024, arXiv:2404.07724):
`guidance.make_denoiser`, `guidance.guided_steps`, re-exported here.

Randomness is drawn per image from its integer seed (`seed_keys`; or, with
`rng='release'`, as the authors' release draws it, `release_rng.py`), so an image depends
only on its seed, never on the batch it was generated in or on the device count.

    net = precond_from_config(cfg.network); variables = load_network(...)
    images = sample_images(net, variables, seeds=range(16), num_steps=32)   # uint8 NHWC
    save_image_grid(np.asarray(images), "grid.png", rows=4, cols=4)
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from edm2_jax.sampling import consistency
from edm2_jax.sampling.schedule import edm_sigma_steps  # noqa: F401 (re-exported)
from edm2_jax.sampling.guidance import (Denoiser, check_guidance_interval,  # noqa: F401
                                        guided_steps, make_denoiser)
from edm2_jax.sampling.seeds import (random_labels, seed_array, seed_churn_noise,  # noqa: F401
                                     seed_keys, seed_noise, split_seeds)

Array = jax.Array


# ---------------------------------------------------------------------------------------
# Time steps and the sampler.

def edm_sampler(denoise: Denoiser, noise: Array, labels: Array | None = None, *,
                num_steps: int = 32, sigma_min: float = 0.002, sigma_max: float = 80.0,
                rho: float = 7.0, S_churn: float = 0.0, S_min: float = 0.0,
                S_max: float = float("inf"), S_noise: float = 1.0,
                churn_noise: Callable[[Array], Array] | None = None,
                rng: Array | None = None,
                guidance_interval: tuple[float, float] | None = None) -> Array:
    """EDM Heun sampler (Karras et al. 2022, Algorithms 1 and 2) from unit noise to `x_0`.

    Starts at `x = noise * t_0` and integrates the probability-flow ODE
    `dx/dt = (x - D(x; t)) / t` over `edm_sigma_steps(...)` with Heun's 2nd-order method;
    the last step (to `t_N = 0`) is a plain Euler step, so `denoise` is evaluated
    `2 N - 1` times. Steps with `S_min <= t_i <= S_max` first raise the noise level to
    `t_hat = (1 + gamma) t_i`, `gamma = min(S_churn / N, sqrt(2) - 1)`, by adding
    `sqrt(t_hat^2 - t_i^2) S_noise eps`, `eps ~ N(0, I)` (`S_churn = 0`: deterministic).
    The `2 N - 1` evaluations are one `lax.fori_loop` whose body evaluates `denoise` once
    (even iterations: the Euler predictor of step `i`, odd: Heun's corrector), so the
    compiled program holds one copy of the network; with a guidance interval
    (`guided_steps`), one loop for each of the up to three ranges unguided / guided /
    unguided, and the unguided ones call `denoise(..., guided=False)` (the main net alone:
    the guide is not evaluated there). A predictor and a corrector differ only in what they
    select: the arithmetic is Algorithm 1's as `heun.heun_sampler_reference` writes it.

    Args:
      denoise: `denoise(x [B,H,W,C] f32, sigma scalar f32, labels) -> D [B,H,W,C]`,
        e.g. from `make_denoiser`; with an interval that leaves steps unguided it must
        also take `guided=False` (the main net alone), as `make_denoiser`'s do.
      noise: `[B, H, W, C]` unit Gaussian noise (e.g. `seed_noise`).
      labels: passed through to `denoise` unchanged (`[B, label_dim]` one-hot or None).
      num_steps, sigma_min, sigma_max, rho: the schedule `N`, see `edm_sigma_steps`.
      S_churn, S_min, S_max, S_noise: stochasticity (Karras et al. 2022, Sec. 4).
      churn_noise: `churn_noise(i int32 scalar) -> eps` of `noise.shape` for step `i`
        (e.g. `seed_churn_noise`, independent of batch size); or else
      rng: a PRNG key; step `i` then draws from `fold_in(rng, i)` for the whole batch.
      guidance_interval: `(sigma_lo, sigma_hi)` (`guided_steps`), by default that of
        `denoise` (`make_denoiser(guidance_interval=...)`); None: every step as `denoise`.
    Returns: `x_0` `[B, H, W, C]` float32.
    Raises: ValueError when `S_churn > 0` and neither `churn_noise` nor `rng` is given,
      on a bad interval (`guided_steps`), or one other than `denoise`'s.
    """
    t_host = edm_sigma_steps(num_steps, sigma_min, sigma_max, rho)
    a, b = guided_steps(_sampler_interval(denoise, guidance_interval), t_host)
    t_steps = jnp.asarray(t_host, jnp.float32)
    churn = _churn_source(S_churn, churn_noise, rng, noise.shape)

    def increase_noise(i, x_cur, t_cur):
        if churn is None:
            return x_cur, t_cur
        gamma_i = jnp.where((S_min <= t_cur) & (t_cur <= S_max),
                            _churn_gamma(S_churn, num_steps), 0.0)
        return _raise_noise(x_cur, t_cur, gamma_i, churn(i).astype(jnp.float32), S_noise)

    def evaluation(e, carry, guided=True):
        # Evaluation e of the 2N-1: the predictor of step i = e // 2 when e is even (from
        # x = x_i; also the last step's Euler step), its corrector when e is odd (at the
        # predictor's x = x_{i+1}^Euler). Carry: x (x_i, or the predictor's Euler estimate
        # after a predictor), x_hat, t_hat and d_cur of step i's predictor.
        x, x_hat, t_hat, d_cur = carry
        i, corrector = e // 2, e % 2 == 1
        t_cur, t_next = t_steps[i], t_steps[i + 1]
        x_hat_i, t_hat_i = increase_noise(i, x, t_cur)
        x_hat = jnp.where(corrector, x_hat, x_hat_i)
        t_hat = jnp.where(corrector, t_hat, t_hat_i)
        x_in = jnp.where(corrector, x, x_hat)
        t_in = jnp.where(corrector, t_next, t_hat)
        d = (x_in - _denoised(denoise, x_in, t_in, labels, guided)) / t_in  # or d_prime
        euler = x_hat + (t_next - t_hat) * d
        heun = x_hat + (t_next - t_hat) * (0.5 * d_cur + 0.5 * d)
        return (jnp.where(corrector, heun, euler), x_hat, t_hat,
                jnp.where(corrector, d_cur, d))

    x = jnp.asarray(noise, jnp.float32) * t_steps[0]
    carry = (x, x, t_steps[0], jnp.zeros_like(x))
    evaluations = 2 * num_steps - 1  # the last step (to t_N = 0) is Euler only
    for start, stop, guided in ((0, 2 * a, False), (2 * a, 2 * b, True),
                                (2 * b, evaluations, False)):
        if min(stop, evaluations) > start:
            carry = jax.lax.fori_loop(start, min(stop, evaluations), functools.partial(
                evaluation, guided=guided), carry)
    return carry[0]


def _sampler_interval(denoise: Denoiser,
                      guidance_interval: tuple[float, float] | None) -> Any:
    """The sampler's guidance interval: the one given, else the denoiser's own
    (`make_denoiser(guidance_interval=...)`). Raises: ValueError when both are given and
    differ."""
    own = getattr(denoise, "guidance_interval", None)
    if guidance_interval is None:
        return own
    if own is not None and check_guidance_interval(guidance_interval) != own:
        raise ValueError(f"guidance_interval={guidance_interval} but the denoiser's is {own}; "
                         f"pass it once (to make_denoiser)")
    return guidance_interval


def _churn_source(S_churn: float, churn_noise: Callable[[Array], Array] | None,
                  rng: Array | None, shape: Sequence[int]) -> Callable[[Array], Array] | None:
    """`i -> eps` of `shape`, the unit noise of step `i`'s churn: `churn_noise` if given,
    else drawn from `fold_in(rng, i)`; None when `S_churn <= 0` (a deterministic sampler).
    Raises: ValueError when `S_churn > 0` and neither is given."""
    if not S_churn > 0:
        return None
    if churn_noise is not None:
        return churn_noise
    if rng is None:
        raise ValueError("S_churn > 0 needs churn noise: pass churn_noise="
                         "seed_churn_noise(seeds, shape) or rng=jax.random.PRNGKey(...)")
    return lambda i: jax.random.normal(jax.random.fold_in(rng, i), shape)


def _churn_gamma(S_churn: float, num_steps: int) -> float:
    """`gamma = min(S_churn / N, sqrt(2) - 1)` (Karras et al. 2022, Algorithm 2)."""
    return min(S_churn / num_steps, math.sqrt(2) - 1)


def _raise_noise(x: Array, t: Array, gamma_i: Array, eps: Array,
                 S_noise: float) -> tuple[Array, Array]:
    """Churn (Karras et al. 2022, Algorithm 2): `(x_hat, t_hat)`, `t_hat = (1 + gamma_i) t`
    and `x_hat = x + sqrt(t_hat^2 - t^2) S_noise eps`; `x`, `eps` `[B, H, W, C]`, `t`,
    `gamma_i` float32 scalars."""
    t_hat = t + gamma_i * t
    # sqrt(t_hat^2 - t^2) written without the cancellation, which under XLA's fused
    # multiply-adds can go slightly negative (NaN) when gamma_i = 0.
    std = t * jnp.sqrt(gamma_i * (2 + gamma_i))
    return x + std * S_noise * eps, t_hat


def _denoised(denoise: Denoiser, x: Array, sigma: Array, labels: Array | None,
              guided: bool) -> Array:
    """`D(x; sigma)` as float32: guided, or (`guided=False`, a Python bool) the main net
    alone, `denoise(..., guided=False)`."""
    out = denoise(x, sigma, labels) if guided else denoise(x, sigma, labels, guided=False)
    return out.astype(jnp.float32)


# ---------------------------------------------------------------------------------------
# Images.

def decode_uint8(x: Array) -> Array:
    """Images in [-1, 1] to uint8, `uint8(clip(x * 127.5 + 128, 0, 255))` (the +128 makes
    the truncating cast round to nearest): any shape float -> same shape uint8."""
    return jnp.clip(jnp.asarray(x, jnp.float32) * 127.5 + 128, 0, 255).astype(jnp.uint8)


def release_seed_draws(seeds: Sequence[int] | Array, shape: Sequence[int], label_dim: int,
                       num_steps: int = 32, sigma_min: float = 0.002, sigma_max: float = 80.0,
                       rho: float = 7.0, S_churn: float = 0.0, S_min: float = 0.0,
                       S_max: float = float("inf"), **_) -> tuple:
    """The release's per-seed draws (`release_rng.release_draws`) for `edm_sampler`:
    `(noise [B, *shape] f32, labels [B, label_dim] one-hot or None, churn_table
    [num_steps, B, *shape] or None)`, the table holding step `i`'s churn noise where
    the release draws it (`S_churn > 0` and `S_min <= t_i <= S_max`), zeros elsewhere.
    `seeds` must be concrete (host) values."""
    from edm2_jax.release import rng as release_rng
    t = edm_sigma_steps(num_steps, sigma_min, sigma_max, rho)[:-1].astype(np.float32)
    draws = np.flatnonzero((S_min <= t) & (t <= S_max)) if S_churn > 0 else np.zeros(0, int)
    noise, idx, churn = release_rng.release_draws(np.asarray(seeds).tolist(), shape, label_dim,
                                                  len(draws))
    labels = None if idx is None else np.eye(label_dim, dtype=np.float32)[idx]
    table = None
    if churn is not None:
        table = np.zeros((num_steps,) + noise.shape, np.float32)
        table[draws] = churn
    return noise, labels, table


@functools.partial(jax.jit, static_argnames=("net", "guide_net", "guidance", "sampler_kwargs",
                                             "raw", "guidance_interval"))
def _sample(net, variables, guide_net, guide_variables, seeds, labels, guidance,
            sampler_kwargs, noise=None, churn_table=None, raw=False, guidance_interval=None):
    kw = dict(sampler_kwargs)
    shape = (net.img_resolution, net.img_resolution, net.img_channels)
    churn = seed_churn_noise(seeds, shape) if kw.get("S_churn", 0) > 0 else None
    if churn_table is not None:
        churn = lambda i: churn_table[i]  # noqa: E731
    if noise is None:
        noise = seed_noise(seeds, shape)
    denoise = make_denoiser(net, variables, guide_net, guide_variables, guidance,
                            guidance_interval)
    if kw.pop("sampler", "heun") == "consistency":
        x = consistency.consistency_sampler(denoise, noise, labels, **kw)
    else:
        x = edm_sampler(denoise, noise, labels, churn_noise=churn, **kw)
    return x if raw else decode_uint8(x)


def sample_images(net: Any, variables: Any, seeds: Sequence[int] | Array,
                  labels: Array | int | None = None, *, guide_net: Any = None,
                  guide_variables: Any = None, guidance: float = 1.0, num_steps: int = 32,
                  sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0,
                  S_churn: float = 0.0, S_min: float = 0.0, S_max: float = float("inf"),
                  S_noise: float = 1.0, rng: str = "jax", raw: bool = False,
                  guidance_interval: tuple[float, float] | None = None,
                  sampler: str = "heun", teacher_steps: int = 32) -> Array:
    """Generate one pixel-space image per seed with the (guided) EDM sampler, jitted.

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
      num_steps ... S_noise: see `edm_sampler`.
      rng: `'jax'` or `'release'` (then `seeds` must be concrete values, not traced).
      guidance_interval: `(sigma_lo, sigma_hi)`: guidance only on the steps with
        `sigma_lo < t_i <= sigma_hi` (`guidance.guided_steps`); None: on every step.
      sampler: `'heun'` (the EDM sampler, `edm_sampler`) or `'consistency'` (a few-step
        student, `consistency.consistency_sampler`: `num_steps` evaluations on the grid
        of `teacher_steps` teacher steps of `sigma_min`, `sigma_max`, `rho`; no churn,
        no guidance interval).
    Returns: `[B, H, W, C]` uint8 (float32 with `raw`).
    Raises: ValueError on labels that do not fit the net (the message names the fix),
      an unknown `rng` or `sampler`, churn or a guidance interval with the consistency
      sampler, or a bad interval or one at `guidance == 1` (before compiling).
    """
    _check_sample_options(sampler, S_churn, guidance_interval, rng)
    noise = churn_table = None
    if rng == "release":
        noise, release_labels, churn_table = _release_inputs(
            net, seeds, teacher_steps if sampler == "consistency" else num_steps, sigma_min,
            sigma_max, rho, S_churn, S_min, S_max)
        if labels is None:
            labels = release_labels
    seeds = seed_array(seeds)
    labels = _label_array(net, labels, seeds)
    sampler_kwargs = _sampler_kwargs(sampler, num_steps, teacher_steps, sigma_min, sigma_max,
                                     rho, S_churn, S_min, S_max, S_noise)
    interval = check_guidance_interval(guidance_interval)
    if guidance == 1:
        if interval is not None:
            raise ValueError(f"guidance_interval={interval} with guidance=1 changes nothing; "
                             f"drop the interval or set guidance != 1 (with a guide)")
        guide_net = guide_variables = None
    elif guide_net is None or guide_variables is None:
        raise ValueError(f"guidance={guidance} needs guide_net and guide_variables")
    return _sample(net, variables, guide_net, guide_variables, seed_array(seeds), labels,
                   float(guidance), sampler_kwargs, noise, churn_table, bool(raw), interval)


def _check_sample_options(sampler: str, S_churn: float,
                          guidance_interval: tuple[float, float] | None, rng: str) -> None:
    """Raises: ValueError on an unknown `sampler` or `rng`, or churn or a guidance interval
    with the consistency sampler (`sample_images`)."""
    if sampler not in ("heun", "consistency"):
        raise ValueError(f"sampler={sampler!r}: use 'heun' (the EDM sampler) or "
                         f"'consistency' (a few-step student)")
    if sampler == "consistency" and (S_churn > 0 or guidance_interval is not None):
        raise ValueError("the consistency sampler is deterministic and evaluates the "
                         "student once per segment: drop S_churn and guidance_interval")
    if rng not in ("jax", "release"):
        raise ValueError(f"rng={rng!r}: use 'jax' (JAX keys per seed) or 'release' (the "
                         f"release's per-seed torch generator)")


def _release_inputs(net: Any, seeds: Sequence[int] | Array, num_steps: int, sigma_min: float,
                    sigma_max: float, rho: float, S_churn: float, S_min: float,
                    S_max: float) -> tuple:
    """`release_seed_draws` for `net`'s image shape and labels, `(noise, labels or None,
    churn_table or None)`, the arrays split over devices as `seeds` are (when they carry
    a `NamedSharding`, from `split_seeds`)."""
    noise, labels, churn_table = release_seed_draws(
        seeds, (net.img_resolution, net.img_resolution, net.img_channels), net.label_dim,
        num_steps, sigma_min, sigma_max, rho, S_churn, S_min, S_max)
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


def check_schedule(sampler: str, num_steps: int, teacher_steps: int | None,
                   sigma_min: float, sigma_max: float, rho: float) -> None:
    """Raise ValueError unless the settings make a schedule: the Heun sampler's
    (`edm_sigma_steps`), or for `sampler='consistency'` a student's `num_steps` segments
    of the teacher's grid of `teacher_steps` (`consistency.segment_bounds`,
    `grid_sigmas`). Host arithmetic only: settings are checked before any work."""
    if sampler == "consistency":
        consistency.segment_bounds(num_steps, teacher_steps)
        consistency.grid_sigmas(teacher_steps, sigma_min, sigma_max, rho)
    else:
        edm_sigma_steps(num_steps, sigma_min, sigma_max, rho)


def _sampler_kwargs(sampler: str, num_steps: int, teacher_steps: int, sigma_min: float,
                    sigma_max: float, rho: float, S_churn: float, S_min: float, S_max: float,
                    S_noise: float) -> tuple:
    """The sampler's settings as a hashable tuple of `(name, value)` for `_sample`, the
    schedule validated outside of jit (`check_schedule`). Raises: ValueError on a bad
    schedule."""
    check_schedule(sampler, num_steps, teacher_steps, sigma_min, sigma_max, rho)
    if sampler == "consistency":
        return tuple(dict(sampler=sampler, num_steps=int(num_steps),
                          teacher_steps=int(teacher_steps), sigma_min=float(sigma_min),
                          sigma_max=float(sigma_max), rho=float(rho)).items())
    return tuple(dict(num_steps=int(num_steps), sigma_min=float(sigma_min),
                      sigma_max=float(sigma_max), rho=float(rho), S_churn=float(S_churn),
                      S_min=float(S_min), S_max=float(S_max), S_noise=float(S_noise)).items())


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
