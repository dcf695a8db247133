"""The samplers as values: each is a frozen (hashable) dataclass holding its settings,
called as `sampler(denoise, noise, labels, churn_noise=None) -> x_0` (and
`guidance_interval=` where it takes one), that the image
functions (`sampler.sample_images`, `seed_images.generate_images`) run without asking
which it is, and that an objective returns for its networks (`objectives`).

- `Heun`: the EDM sampler (Karras et al. 2022, Algorithms 1-2; `edm_sampler`, one
  `fori_loop` of network evaluations), with churn and the guidance interval. Beside it
  the same algorithm as the paper writes it: `heun_step` (one step, per image; also the
  teacher's step of consistency distillation, `objectives/distill.py`) and
  `heun_sampler_reference` (the plain loop `edm_sampler` is tested equal to).
- `FewStep`: `K` evaluations on a teacher's grid, a DDIM step to each segment end
  (`consistency.consistency_sampler`): a distilled student's or generator's sampler,
  or DDIM on any diffusion network.

`Sampler` is the interface both implement (and a sampler of your own: subclass it,
`register` it); `SAMPLERS` names the registered ones for the command line (`--sampler`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from edm2_jax.sampling import consistency
from edm2_jax.sampling.guidance import Denoiser, guided_steps
from edm2_jax.sampling.schedule import RHO, SIGMA_MAX, SIGMA_MIN, edm_sigma_steps

Array = jax.Array
DenoiseFn = Callable[[Array, Array], Array]  # (x [B,H,W,C], sigma [B] or []) -> D(x; sigma)


def edm_sampler(denoise: Denoiser, noise: Array, labels: Array | None = None, *,
                num_steps: int = 32, sigma_min: float = SIGMA_MIN, sigma_max: float = SIGMA_MAX,
                rho: float = RHO, S_churn: float = 0.0, S_min: float = 0.0,
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
    select: the arithmetic is Algorithm 1's as `heun_sampler_reference` writes it.

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
      guidance_interval: `(sigma_lo, sigma_hi)`: `denoise` as given on the steps with
        `sigma_lo < t_i <= sigma_hi` (`guided_steps`), `denoise(..., guided=False)` on
        the others; None: every step as `denoise`.
    Returns: `x_0` `[B, H, W, C]` float32.
    Raises: ValueError when `S_churn > 0` and neither `churn_noise` nor `rng` is given,
      or on a bad interval (`guided_steps`).
    """
    t_host = edm_sigma_steps(num_steps, sigma_min, sigma_max, rho)
    a, b = guided_steps(guidance_interval, t_host)
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
# Algorithm 1 as the paper writes it: Heun's step, and the sampler as a plain loop that
# `edm_sampler` is tested equal to.

def _bcast(v: Array, x: Array) -> Array:
    """`v` (a scalar or `[B]`) with trailing axes of size 1 to broadcast against `x`."""
    return v.reshape(v.shape + (1,) * (x.ndim - v.ndim))


def heun_step(D: DenoiseFn, x_t: Array, t: Array, r: Array) -> Array:
    """One step of the EDM sampler (Karras et al. 2022, Alg. 1) from `t` to `r < t`, per
    image (`[B]`) or for all (scalars): Heun's method on `dx/dsigma = (x - D(x; sigma)) /
    sigma`, Euler where `r = 0` (its correction would divide by 0; `D` is then evaluated
    at sigma 1 and the result discarded). Two evaluations of `D`; float32 like `x_t`."""
    d_t = (x_t - D(x_t, t)) / _bcast(t, x_t)
    x_e = x_t + _bcast(r - t, x_t) * d_t
    r_safe = jnp.where(r > 0, r, 1.0)
    d_r = (x_e - D(x_e, r_safe)) / _bcast(r_safe, x_t)
    x_h = x_t + _bcast(r - t, x_t) * (0.5 * d_t + 0.5 * d_r)
    return jnp.where(_bcast(r > 0, x_t), x_h, x_e)


def heun_sampler_reference(denoise: Denoiser, noise: Array, labels: Array | None = None, *,
                           num_steps: int = 32, sigma_min: float = SIGMA_MIN,
                           sigma_max: float = SIGMA_MAX, rho: float = RHO, S_churn: float = 0.0,
                           S_min: float = 0.0, S_max: float = float("inf"),
                           S_noise: float = 1.0,
                           churn_noise: Callable[[Array], Array] | None = None,
                           rng: Array | None = None,
                           guidance_interval: tuple[float, float] | None = None) -> Array:
    """The EDM sampler as Karras et al. 2022 write it (Algorithm 2; Algorithm 1 at
    `S_churn = 0`): the plain reference that `edm_sampler` is tested equal to.

    For `i = 0 .. N-1` on `t = edm_sigma_steps(...)` (float32), from `x_0 = noise * t_0`:
      gamma_i = min(S_churn / N, sqrt(2) - 1) if S_min <= t_i <= S_max else 0
      t_hat = (1 + gamma_i) t_i;  x_hat = x_i + sqrt(t_hat^2 - t_i^2) S_noise eps_i
      d = (x_hat - D(x_hat; t_hat)) / t_hat;  x_{i+1} = x_hat + (t_{i+1} - t_hat) d
      if t_{i+1} != 0:  d' = (x_{i+1} - D(x_{i+1}; t_{i+1})) / t_{i+1}
                        x_{i+1} = x_hat + (t_{i+1} - t_hat) (d / 2 + d' / 2)
    with `D` guided on the steps `guided_steps(guidance_interval, t)` (both evaluations of
    a step) and the main net alone on the others. A Python loop: traced under `jax.jit` it
    holds `2 N - 1` copies of the network, which is why `edm_sampler` runs the same
    arithmetic as one `fori_loop`. Arguments, return value (`x_N` `[B, H, W, C]` float32)
    and errors are those of `edm_sampler`.
    """
    t_host = edm_sigma_steps(num_steps, sigma_min, sigma_max, rho)
    a, b = guided_steps(guidance_interval, t_host)
    t32 = t_host.astype(np.float32)
    t = jnp.asarray(t32)
    churn = _churn_source(S_churn, churn_noise, rng, noise.shape)
    x_next = jnp.asarray(noise, jnp.float32) * t[0]
    for i in range(num_steps):
        x_cur, t_cur, t_next, guided = x_next, t[i], t[i + 1], a <= i < b
        # Churn: raise the noise level to t_hat (gamma_i = 0 leaves x and t as they are).
        x_hat, t_hat = x_cur, t_cur
        if churn is not None and np.float32(S_min) <= t32[i] <= np.float32(S_max):
            gamma_i = jnp.float32(_churn_gamma(S_churn, num_steps))
            x_hat, t_hat = _raise_noise(x_cur, t_cur, gamma_i, churn(i).astype(jnp.float32),
                                        S_noise)
        D = functools.partial(_denoised, denoise, labels=labels, guided=guided)
        if i < num_steps - 1:  # Heun's step from t_hat to t_{i+1}
            x_next = heun_step(D, x_hat, t_hat, t_next)
        else:  # Euler's to t_N = 0 (the correction would divide by 0)
            x_next = x_hat + (t_next - t_hat) * ((x_hat - D(x_hat, t_hat)) / t_hat)
    return x_next


# ---------------------------------------------------------------------------------------
# The samplers as values.

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


@dataclasses.dataclass(frozen=True)
class Sampler:
    """The interface every sampler implements: a frozen dataclass of its settings (equal
    settings, equal hashes: a sampler is a static argument of the jitted sampling
    functions), called as `sampler(denoise, noise, labels, churn_noise=None) -> x_0`.

    `denoise(x [B,H,W,C] f32, sigma f32 scalar, labels, guided=True) -> [B,H,W,C]` is
    the (guided) network at noise level `sigma` (`guidance.make_denoiser`); `noise` is
    `[B, H, W, C]` unit Gaussian noise per seed; the result is the float32 sample.
    A sampler is registered (`register`) under its `name`, which `--sampler` names; its
    dataclass fields are its settings, each reachable from the command line
    (`--sampler_opts=FIELD=VALUE,...`; `num_steps` is `--steps`; a field named like a
    flag of `--mode=generate`, e.g. `sigma_max`, is also set by that flag).

    What it can do is stated apart, each a class attribute the callers read:
    - `takes_churn`: it has the fields `S_churn`, `S_min`, `S_max`, `S_noise` (EDM
      Sec. 4) and uses `churn_noise(i) -> eps` of step `i` when `stochastic`;
    - `takes_guidance_interval`: its call also takes `guidance_interval=(sigma_lo,
      sigma_hi)` and calls `denoise(..., guided=False)` on the steps outside it
      (`guidance.guided_steps`); the image functions pass it only to such a sampler;
    - `release_draws`: the release's per-seed random draws apply (`rng='release'`): the
      sampler is on the EDM schedule of its `release_schedule()`.
    """

    name: ClassVar[str] = ""
    takes_churn: ClassVar[bool] = False
    takes_guidance_interval: ClassVar[bool] = False
    release_draws: ClassVar[bool] = False
    num_steps: int = 1

    def __post_init__(self):
        for f in dataclasses.fields(self):
            cast = _TYPES.get(f.type if isinstance(f.type, str) else f.type.__name__)
            if cast is not None:
                object.__setattr__(self, f.name, cast(getattr(self, f.name)))
        self.check()

    def check(self) -> None:
        """Raise ValueError naming the setting when the settings are not a sampler (run at
        construction, after the fields are cast to their types). Default: `num_steps >= 1`."""
        if self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps}: a sampler takes at least 1 step")

    @property
    def evaluations(self) -> int:
        """Network evaluations per image (default: one per step)."""
        return self.num_steps

    @property
    def stochastic(self) -> bool:
        """Whether it draws noise beyond the seed's initial noise (`churn_noise`)."""
        return False

    def with_steps(self, num_steps: int) -> "Sampler":
        """A copy with `num_steps` steps."""
        return dataclasses.replace(self, num_steps=int(num_steps))

    def describe(self) -> str:
        """The sampler in words, for the messages of generation and evaluation."""
        return f"the {self.name} sampler, {self.num_steps} steps ({self.evaluations} evaluations)"

    def release_schedule(self) -> tuple[int, float, float, float]:
        """`(steps, sigma_min, sigma_max, rho)`: the EDM schedule whose steps the release's
        per-seed churn draws follow (`release_draws` samplers)."""
        raise NotImplementedError(f"{self.name} has no release schedule")

    def settings(self) -> dict:
        """`{'sampler': name, **fields}`: the sampler as JSON (records, resumable state)."""
        return {"sampler": self.name, **dataclasses.asdict(self)}

    @classmethod
    def options(cls) -> dict[str, type]:
        """Its settings, `{field: type}` (what `--sampler_opts` may set)."""
        return {f.name: _TYPES.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
                for f in dataclasses.fields(cls)}

    def __call__(self, denoise: Denoiser, noise: Array, labels: Array | None = None, *,
                 churn_noise: Callable[[Array], Array] | None = None) -> Array:
        raise NotImplementedError


# The samplers by name (`--sampler`), built-in and registered.
SAMPLERS: dict[str, type[Sampler]] = {}


def register(cls: type[Sampler]) -> type[Sampler]:
    """Make `cls` (a frozen dataclass subclass of `Sampler`) selectable as
    `--sampler=cls.name` (usable as a decorator). Raises ValueError for a class that is
    not a `Sampler` dataclass, has no name, or a name taken by another class."""
    if not (isinstance(cls, type) and issubclass(cls, Sampler)
            and dataclasses.is_dataclass(cls)):
        raise ValueError(f"{cls!r}: a sampler is a frozen dataclass subclass of "
                         f"edm2_jax.sampling.solvers.Sampler")
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name: set its class attribute `name`")
    if SAMPLERS.get(cls.name, cls) is not cls:
        raise ValueError(f"sampler name {cls.name!r} is taken by {SAMPLERS[cls.name].__name__}")
    SAMPLERS[cls.name] = cls
    return cls


@register
@dataclasses.dataclass(frozen=True)
class Heun(Sampler):
    """The EDM Heun sampler (`edm_sampler`) of `num_steps` steps, `2 num_steps - 1`
    network evaluations, on the schedule `sigma_min`, `sigma_max`, `rho` (EDM Eq. 5),
    with churn `S_churn`, `S_min`, `S_max`, `S_noise` (EDM Sec. 4; 0: deterministic).
    Raises ValueError at construction for a schedule that is none (`edm_sigma_steps`)."""

    name = "heun"
    takes_churn = True
    takes_guidance_interval = True
    release_draws = True
    num_steps: int = 32
    sigma_min: float = SIGMA_MIN
    sigma_max: float = SIGMA_MAX
    rho: float = RHO
    S_churn: float = 0.0
    S_min: float = 0.0
    S_max: float = float("inf")
    S_noise: float = 1.0

    def check(self) -> None:
        edm_sigma_steps(self.num_steps, self.sigma_min, self.sigma_max, self.rho)

    @property
    def evaluations(self) -> int:
        """Network evaluations per image: two per step, one for the last."""
        return 2 * self.num_steps - 1

    @property
    def stochastic(self) -> bool:
        return self.S_churn > 0

    def release_schedule(self) -> tuple[int, float, float, float]:
        return self.num_steps, self.sigma_min, self.sigma_max, self.rho

    def describe(self) -> str:
        return (f"the Heun sampler, {self.num_steps} steps ({self.evaluations} "
                f"evaluations)")

    def __call__(self, denoise: Denoiser, noise: Array, labels: Array | None = None, *,
                 churn_noise: Callable[[Array], Array] | None = None,
                 guidance_interval: tuple[float, float] | None = None) -> Array:
        """`edm_sampler` with these settings and `guidance_interval`: `[B, H, W, C]`
        float32."""
        return edm_sampler(denoise, noise, labels, churn_noise=churn_noise,
                           guidance_interval=guidance_interval, **dataclasses.asdict(self))


@register
@dataclasses.dataclass(frozen=True)
class FewStep(Sampler):
    """The few-step sampler (`consistency.consistency_sampler`): `num_steps` network
    evaluations, a DDIM step to each of the segment ends of the grid of `teacher_steps`
    EDM steps of `sigma_min`, `sigma_max`, `rho`. Deterministic; no guidance interval.
    Raises ValueError at construction for a grid or a step count that is none."""

    name = "few_step"
    release_draws = True
    num_steps: int = 4
    teacher_steps: int = 32
    sigma_min: float = SIGMA_MIN
    sigma_max: float = SIGMA_MAX
    rho: float = RHO

    def check(self) -> None:
        consistency.segment_bounds(self.num_steps, self.teacher_steps)
        consistency.grid_sigmas(self.teacher_steps, self.sigma_min, self.sigma_max, self.rho)

    def release_schedule(self) -> tuple[int, float, float, float]:
        return self.teacher_steps, self.sigma_min, self.sigma_max, self.rho

    def describe(self) -> str:
        return f"the few-step sampler, {self.num_steps} evaluation(s)"

    def __call__(self, denoise: Denoiser, noise: Array, labels: Array | None = None, *,
                 churn_noise: Any = None) -> Array:
        """`consistency.consistency_sampler` with these settings: `[B, H, W, C]` float32."""
        return consistency.consistency_sampler(denoise, noise, labels,
                                               **dataclasses.asdict(self))


def settings(sampler: Sampler) -> dict:
    """`{'sampler': name, **fields}`: a sampler as JSON (records, resumable state)."""
    return sampler.settings()


def from_settings(record: dict) -> Sampler:
    """The sampler of a `settings` record. Raises ValueError naming an unregistered
    sampler or a field it does not have."""
    record = dict(record)
    name = record.pop("sampler", None)
    if name not in SAMPLERS:
        raise ValueError(f"sampler {name!r} is not registered; registered: "
                         f"{', '.join(sorted(SAMPLERS))}")
    cls = SAMPLERS[name]
    unknown = sorted(set(record) - set(cls.options()))
    if unknown:
        raise ValueError(f"sampler {name!r} has no setting {', '.join(unknown)}")
    return cls(**record)
