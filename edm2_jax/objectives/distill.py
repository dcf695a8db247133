"""Few-step generation: multistep consistency distillation of an EDM2 network
(docs/distillation.md).

The student is the teacher's own `Precond` (same U-Net, same EDM preconditioning),
initialised from the teacher's weights and trained with the EDM2 step (forced weight
normalisation, Adam, power EMAs, learned uncertainty) on the objective of multistep
consistency distillation (Heek, Hoogeboom & Salimans 2024, arXiv:2403.06807, Alg. 1; one
segment is the consistency distillation of Song et al. 2023, arXiv:2303.01469, Eq. 7).

On the teacher's sampler grid `sigma_0 > ... > sigma_{N-1} > sigma_N = 0`
(`sampling.consistency.grid_sigmas`) cut into `K` segments (`segment_bounds`), one
training example is a clean image `y`, a grid index `i` (uniform over `0..N-1`), unit
noise `n` and

    t = sigma_i,  r = sigma_{i+1},  s = sigma_{b_{k+1}}  (the end of the segment of i)
    x_t      = y + t n
    x_r      = heun_step(D_teacher, x_t, t, r)               (the teacher's sampler step)
    x_s*     = ddim_step(x_r, sg D_student(x_r; r), r, s)    if r > s, else x_r
    x0_hat*  = (x_s* - (s/t) x_t) / (1 - s/t)                (the x0_hat whose DDIM step
                                                              from t lands on x_s*)
    loss     = lambda(t) / exp(u(t)) (D_student(x_t; t) - x0_hat*)^2 + u(t)

with `sg` the stop-gradient of the current student, `lambda(t)` the EDM weight and `u`
the network's learned uncertainty: the EDM2 loss (Eq. 21, `model.loss.uncertainty_loss`)
with `x0_hat*` in place of `y`. At the student that maps every `x_t` to the `x0_hat`
whose DDIM step reproduces the teacher's ODE to the segment end, the loss's squared
error is zero (up to the teacher's step error), and `consistency.consistency_sampler`
then reproduces the teacher's sampler in `K` evaluations.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from edm2_jax.model import loss as loss_lib
from edm2_jax.model.networks import CONFIG_FIELDS, Precond
from edm2_jax.objectives.base import Objective, StartNetwork, field
from edm2_jax.sampling import consistency, solvers
from edm2_jax.sampling.solvers import heun_step
from edm2_jax.sampling.schedule import RHO, SIGMA_MAX, SIGMA_MIN

Array = jax.Array
DenoiseFn = Callable[[Array, Array], Array]  # (x [B,H,W,C], sigma [B]) -> D [B,H,W,C]

# The settings of the student's grid in `config.distill` (and in a student network's
# metadata), which its sampler needs.
GRID_FIELDS = ("steps", "teacher_steps", "sigma_min", "sigma_max", "rho")


def grid_index(rnd_normal: Array, teacher_steps: int) -> Array:
    """Grid indices `i`, uniform over `0..N-1`, from standard normal draws `z` (the
    training step's noise-level draws): `i = floor(N Phi(z))`, `Phi` the normal CDF.
    int32 of `rnd_normal`'s shape."""
    u = jax.scipy.special.ndtr(jnp.asarray(rnd_normal, jnp.float32))
    return jnp.clip(jnp.floor(u * teacher_steps), 0, teacher_steps - 1).astype(jnp.int32)


def _bcast(v: Array, x: Array) -> Array:
    return v.reshape(v.shape + (1,) * (x.ndim - v.ndim))


def consistency_target(student_sg: DenoiseFn, x_t: Array, x_r: Array, t: Array, r: Array,
                       s: Array) -> Array:
    """The target `x0_hat*` of multistep consistency distillation (arXiv:2403.06807,
    Alg. 1): the stopped-gradient student's DDIM step from `(x_r, r)` to the segment end
    `s` (`x_r` itself where `r = s`), written as the clean image whose DDIM step from
    `(x_t, t)` lands there. `t > s >= 0` and `t > r >= s` per image (`[B]`); float32
    `[B, H, W, C]`, stopped gradient."""
    r_safe = jnp.where(r > s, r, 1.0)
    x_s = jnp.where(_bcast(r > s, x_t),
                    consistency.ddim_step(x_r, student_sg(x_r, r_safe), r_safe, s), x_r)
    ratio = _bcast(s / t, x_t)
    return jax.lax.stop_gradient((x_s - ratio * x_t) / (1 - ratio))


def consistency_draws(rnd_normal: Array, *, steps: int, teacher_steps: int,
                      sigma_min: float, sigma_max: float, rho: float
                      ) -> tuple[Array, Array, Array]:
    """`(t, r, s)` `[B]` float32 of the grid indices `grid_index(rnd_normal)`: the noise
    level, the teacher's next one and the end of the segment."""
    sigmas = jnp.asarray(consistency.grid_sigmas(teacher_steps, sigma_min, sigma_max, rho),
                         jnp.float32)
    bounds = consistency.segment_bounds(steps, teacher_steps)
    i = grid_index(rnd_normal, teacher_steps)
    return sigmas[i], sigmas[i + 1], sigmas[consistency.segment_end(i, bounds)]


def distill_loss_per_element(params: Any, buffers: Any, net: Precond, teacher_params: Any,
                             images: Array, labels: Array | None, *, rnd_normal: Array,
                             noise_unit: Array, dropout_rng: Array | None = None,
                             steps: int, teacher_steps: int, sigma_min: float,
                             sigma_max: float, rho: float, sigma_data: float = 0.5,
                             train: bool = True) -> tuple[Array, Array, Array]:
    """The per-element distillation loss of the module docstring.

    Args:
      params, buffers: the student's (force-normalised) weights and `MPFourier` buffers
        (shared with the teacher, which the student was initialised from).
      net: the `Precond` of both student and teacher.
      teacher_params: the teacher's weights (frozen; no gradient flows into them).
      images: clean images `y` `[B, H, W, C]` in the network's data scale.
      labels: `[B, label_dim]` or None; the teacher and the student see the same.
      rnd_normal: `[B]` standard normal draws, the grid indices (`grid_index`).
      noise_unit: `[B, H, W, C]` unit Gaussian noise `n`.
      dropout_rng: the student's dropout key (the target and the teacher run without).
      steps, teacher_steps, sigma_min, sigma_max, rho: `K` and the grid.
    Returns: `(loss [B,H,W,C], logvar [B], t [B])`, float32.
    """
    images = jnp.asarray(images, jnp.float32)
    t, r, s = consistency_draws(rnd_normal, steps=steps, teacher_steps=teacher_steps,
                                sigma_min=sigma_min, sigma_max=sigma_max, rho=rho)
    x_t = images + noise_unit.astype(jnp.float32) * _bcast(t, images)

    def apply(p):
        def D(x, sigma):
            return net.apply({"params": p, "buffers": buffers}, x, sigma,
                             labels).astype(jnp.float32)
        return D

    x_r = jax.lax.stop_gradient(heun_step(apply(teacher_params), x_t, t, r))
    target = consistency_target(apply(jax.lax.stop_gradient(params)), x_t, x_r, t, r, s)
    rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
    denoised, logvar = net.apply({"params": params, "buffers": buffers}, x_t, t, labels,
                                 train=train, return_logvar=True, rngs=rngs)
    loss = loss_lib.uncertainty_loss(denoised, target, t, logvar, sigma_data)
    return loss, logvar.astype(jnp.float32), t


def distill_objective(params: Any, buffers: Any, net: Precond, teacher_params: Any,
                      images: Array, labels: Array | None, *, batch_size: int | None = None,
                      **kwargs: Any) -> tuple[Array, dict[str, Array]]:
    """`sum(per-image loss) / batch_size` of `distill_loss_per_element` and the logged
    means (`loss`, `weighted_mse`, `logvar`, `sigma`, `log_sigma`, as
    `model.loss.edm2_loss`'s), for `jax.value_and_grad(..., has_aux=True)`."""
    loss, logvar, t = distill_loss_per_element(params, buffers, net, teacher_params, images,
                                               labels, **kwargs)
    per_image = jnp.sum(loss, axis=(1, 2, 3))
    n = per_image.shape[0] if batch_size is None else batch_size
    return jnp.sum(per_image) / n, loss_lib.loss_metrics(loss, logvar, t)


# --------------------------------------------------------------------------------------
# The objective

# The distillation objectives' config section `distill` (and a student network's record
# of it): the teacher (a run, snapshot, post-hoc EMA or converted network; `teacher_ema`
# a run's EMA, default its largest), the student's `steps` and the teacher's sampler
# grid of `teacher_steps` EDM steps of sigma_min, sigma_max, rho.
DISTILL_FIELDS = dict(teacher="", teacher_ema="", steps=4, teacher_steps=32,
                      sigma_min=SIGMA_MIN, sigma_max=SIGMA_MAX, rho=RHO)
TEACHER_FLAG = "--config.distill.teacher"


class ConsistencyDistillation(Objective):
    """Multistep consistency distillation (`config.objective='consistency'`): the student
    starts as the teacher `distill.teacher` (EMA `distill.teacher_ema`), whose weights
    the train state keeps frozen as `'teacher'`; the loss is `distill_objective` with
    `config.network.sigma_data`; its networks are sampled with the few-step sampler of its
    grid (`solvers.FewStep`)."""

    name = "consistency"
    section = "distill"

    @classmethod
    def section_fields(cls) -> dict:
        return dict(DISTILL_FIELDS)

    def check(self) -> None:
        """Raise ValueError naming the flag when the student's grid is not one."""
        check_distill(self.config)

    def start(self) -> StartNetwork:
        """The teacher: `distill.teacher`, `distill.teacher_ema`."""
        return teacher_network(self.config)

    def describe(self) -> str:
        return (teacher_line(self.config) + f"; student: {self.get('distill.steps')} step(s) "
                f"on a grid of {self.get('distill.teacher_steps')} Heun steps")

    def init_state(self, params: Any) -> dict:
        """The teacher's frozen weights: the student's initial `params`."""
        return {"teacher": params}

    def loss(self, params: Any, buffers: Any, net: Any, state: dict, images: Array,
             labels: Array | None, *, draws: dict, dropout_rng: Array | None,
             batch_size: int) -> tuple[Array, dict]:
        """`distill_objective` with the teacher `state['teacher']` on the grid."""
        return distill_objective(
            params, buffers, net, state["teacher"], images, labels,
            rnd_normal=draws["rnd_normal"], noise_unit=draws["noise_unit"],
            dropout_rng=dropout_rng, sigma_data=float(self.get("network.sigma_data", 0.5)),
            batch_size=batch_size, **grid_settings(self.config))

    def sampler(self, num_steps: int = 32) -> solvers.FewStep:
        """The student's few-step sampler (its own steps, whatever `num_steps`)."""
        return few_step_sampler(self.config)

    def flops_per_image(self, forward_flops: float) -> float:
        """The teacher's Heun step (2 passes), the stopped student at `x_r` (1; computed
        for every image, used where `r > s`), the student's forward and backward (3)."""
        return 6 * forward_flops


def check_distill(config: Any) -> None:
    """Raise ValueError naming the `--config.distill` flag when a field of the `distill`
    section is out of range or the few-step sampler's grid is not one."""
    d = field(config, "distill", {})

    def need(ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ValueError(f"--config.distill.{name}={d.get(name)!r}: {what}")

    def number(name: str) -> float | None:
        v = d.get(name)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    steps = d.get("steps")
    need(isinstance(steps, int) and steps >= 1, "steps",
         "a number of sampling steps >= 1, e.g. 4")
    need(isinstance(d.get("teacher_steps"), int) and d["teacher_steps"] >= max(2, steps),
         "teacher_steps", f"the teacher's Heun steps, >= 2 and >= distill.steps ({steps}), "
         f"e.g. 32")
    lo, hi = number("sigma_min"), number("sigma_max")
    need(lo is not None and lo > 0, "sigma_min", "a positive noise level, e.g. 0.002")
    need(hi is not None and hi > lo, "sigma_max",
         f"a noise level above distill.sigma_min ({lo}), e.g. 80")
    need((number("rho") or 0) > 0, "rho", "must be positive, e.g. 7")
    try:
        few_step_sampler(config)
    except ValueError as e:
        raise ValueError(f"--config.distill: {e} (distill.steps={steps}, "
                         f"distill.teacher_steps={d.get('teacher_steps')})") from None


def teacher_network(config: Any) -> StartNetwork:
    """The teacher a distillation run starts from (`distill.teacher`, `teacher_ema`)."""
    return StartNetwork(str(field(config, "distill.teacher", "")),
                        str(field(config, "distill.teacher_ema", "") or ""), "teacher",
                        TEACHER_FLAG)


def teacher_line(config: Any) -> str:
    """'Teacher: PATH (EMA X)', the first part of a distillation objective's description."""
    t = teacher_network(config)
    return f"Teacher: {t.path}" + (f" (EMA {t.ema})" if t.ema else "")


def grid_settings(config: Any) -> dict:
    """The student's sampler settings (`GRID_FIELDS`) of a config's `distill` section (a
    ConfigDict or the dict of a config.json/network.json)."""
    d = field(config, "distill", {})
    return {k: (int if k in ("steps", "teacher_steps") else float)(d[k]) for k in GRID_FIELDS}


def few_step_sampler(config: Any) -> solvers.FewStep:
    """The few-step sampler of a config's `distill` grid. Raises ValueError where the
    grid or the step count is none."""
    g = grid_settings(config)
    return solvers.FewStep(g.pop("steps"), **g)


def network_config(net: Precond) -> dict:
    """The network config (`CONFIG_FIELDS`, as config.json holds it) of a `Precond`."""
    cfg = {k: getattr(net, k) for k in CONFIG_FIELDS}
    cfg["dtype"] = jnp.dtype(cfg["dtype"]).name
    for k in ("channel_mult", "attn_resolutions"):
        cfg[k] = tuple(cfg[k])
    return cfg
