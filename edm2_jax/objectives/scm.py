"""Continuous-time consistency models of EDM2 networks: sCD and sCT (Lu & Song 2024,
"Simplifying, Stabilizing and Scaling Continuous-Time Consistency Models",
arXiv:2410.11081, Algorithm 1; docs/distillation.md, "sCM").

TrigFlow. A clean image `x_0`, `z ~ N(0, sigma_data^2 I)` and a time `t` in `(0, pi/2)`:

    x_t = cos t x_0 + sin t z,      t = arctan(e^tau / sigma_data),  tau ~ N(P_mean, P_std^2)

so `x_t / cos t = x_0 + sigma z / sigma_data` is EDM's noisy image at `sigma = sigma_data
tan t` (`sigma = e^tau`: EDM2's log-normal noise levels). The consistency function is
`f(x_t, t) = cos t x_t - sigma_data sin t F(x_t / sigma_data, t)` and the PF-ODE
`dx_t/dt = sigma_data F_pretrain(x_t, t)`.

The EDM2 network as it is. With `D(x; sigma)` the EDM-preconditioned network (`Precond`)
the student's `F` is

    F(x_t, t) = (cos t x_t - D(x_t / cos t; sigma_data tan t)) / (sigma_data sin t)

(`trigflow_F`), and then `f(x_t, t) = D(x_t / cos t; sigma_data tan t)`: the consistency
function is the denoiser itself. In EDM's terms at that `sigma`, `c_in x = x_t /
sigma_data`, `c_skip x = cos t x_t`, `c_out = sigma_data sin t`, so `D = cos t x_t +
sigma_data sin t F_raw` and `F = -F_raw`: the raw U-Net output is `-F`, at `c_noise =
ln(sigma) / 4` (whose derivative along the rearranged time tangent `cos t sin t` is the
constant 1/4). Any network of this project (a run, a post-hoc EMA, a converted release
network) is therefore a teacher, or the starting student, without retraining; and a
student is sampled by any code that takes an EDM denoiser (`ScmSampler`).

One training example (Algorithm 1), `sg` the stopped gradient:

    dx_t/dt = sigma_data F_teacher(x_t, t)           sCD (the teacher frozen; optionally
                                                     guided, `distill.guidance`: by its
                                                     own unconditional slot, or by a
                                                     frozen guide, `distill.guide`)
            = cos t z - sin t x_0                    sCT (`distill.training=True`)
    (F-, cos t sin t dF-/dt) = jvp(F_sg(theta), (x_t, t), (cos t sin t dx_t/dt, cos t sin t))
    g     = -cos^2 t (sigma_data F- - dx_t/dt) - r (cos t sin t x_t + sigma_data cos t sin t dF-/dt)
    g     = g / (||g|| + c)                          (tangent normalisation, per image;
                                                     `distill.tangent_norm='rms'`: the
                                                     norm divided by sqrt(D))
    loss  = w e^{-u(t)} / D ||F_theta(x_t, t) - F- - g||^2 + u(t)

with `r = min(1, iters / H)` the tangent warmup (`iters` the steps taken, a counter the
train state keeps: `'iters'`), `D` the elements per image and `u` the network's own
learned uncertainty (EDM2's logvar head) as the paper's adaptive weight `-w_phi(t)`,
`w = 1` or, with `distill.prior_weighting=True`, the prior weighting `w = 1 / sigma`.
What the two settings do to the tangent's growth on Fashion-MNIST: docs/results.json,
entry `scm-weighting`. At
`r = 1` and without normalisation, `g = cos t df-/dt` along the ODE: its gradient drives
`f` to be constant along the teacher's trajectories (`tests/test_scm.py` checks `g`
against the closed form on Gaussian data). The jvp goes through the network computed
with `net.kernels.forward_mode()` (`mp.Kernels`), in the same training mode and dropout
as the student's forward pass, so `F-` is the value of `F_theta`.

Sampling (`ScmSampler`): `x = sigma_max n`, `x_0 = D(x; sigma_max)` (TrigFlow's
`t_max = arctan(sigma_max / sigma_data)`); for more steps, fresh per-seed noise `eps_k`
re-noises to the next time, `x = x_0 + sigma_data tan(t_k) eps_k` (TrigFlow's `x_t =
cos t x_0 + sin t sigma_data eps` divided by `cos t`), `t_1 = t_mid = 1.1` (the paper's).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from edm2_jax.objectives.base import Objective, StartNetwork, field
from edm2_jax.objectives.distill import teacher_line, teacher_network
from edm2_jax.sampling import solvers
from edm2_jax.sampling.guidance import Denoiser
from edm2_jax.sampling.schedule import SIGMA_MAX

Array = jax.Array
DenoiseFn = Callable[[Array, Array], Array]  # (x [B,H,W,C], sigma [B]) -> D [B,H,W,C]

# The proposal `tau ~ N(P_mean, P_std^2)` of the consistency models (the paper's tables of
# training settings: ImageNet 64x64 and ImageNet 512x512; CIFAR-10 is NVlabs/FastGen's
# sCM default). The section's default is ImageNet 64's.
PROPOSALS = {"img64": (-1.0, 1.6), "img512": (-0.8, 1.6), "cifar10": (-1.0, 1.4)}
# The intermediate time of 2-step sampling (the paper's sampling tables: 1.1 throughout).
T_MID = 1.1
# The tangent normalisation constant `c` and the warmup `H`: 10k iterations of batches
# of 2048 images (the paper's tables), in kimg.
TANGENT_C = 0.1
WARMUP_KIMG = 10_000 * 2048 / 1000


def _bcast(v: Array, x: Array) -> Array:
    v = jnp.asarray(v)
    return v.reshape(v.shape + (1,) * (x.ndim - v.ndim))


# --------------------------------------------------------------------------------------
# TrigFlow and the EDM denoiser

def trig_time(sigma: Array, sigma_data: float = 0.5) -> Array:
    """TrigFlow's time of EDM's noise level: `t = arctan(sigma / sigma_data)`, in
    `(0, pi/2)` for `sigma > 0`; float32 of `sigma`'s shape."""
    return jnp.arctan(jnp.asarray(sigma, jnp.float32) / sigma_data)


def edm_point(x_t: Array, t: Array, sigma_data: float = 0.5) -> tuple[Array, Array]:
    """`(x_t / cos t, sigma_data tan t)`: TrigFlow's `(x_t, t)` as EDM's noisy image and
    noise level (`x_t` `[B, H, W, C]`, `t` `[B]`)."""
    return x_t / _bcast(jnp.cos(t), x_t), sigma_data * jnp.tan(t)


def trigflow_F(denoised: Array, x_t: Array, t: Array, sigma_data: float = 0.5) -> Array:
    """TrigFlow's `F = (cos t x_t - D) / (sigma_data sin t)` of the EDM denoiser's output
    `D = D(x_t / cos t; sigma_data tan t)` (`edm_point`); float32 `[B, H, W, C]`. With
    EDM preconditioning this is minus the raw network output (module docstring)."""
    denoised = jnp.asarray(denoised, jnp.float32)
    return ((_bcast(jnp.cos(t), x_t) * x_t - denoised)
            / _bcast(sigma_data * jnp.sin(t), x_t))


def trigflow_fn(D: DenoiseFn, sigma_data: float = 0.5) -> Callable[[Array, Array], Array]:
    """`F(x_t, t)` of an EDM denoiser `D(x, sigma)` (`trigflow_F` at `edm_point`)."""
    def F(x_t, t):
        return trigflow_F(D(*edm_point(x_t, t, sigma_data)), x_t, t, sigma_data)
    return F


def data_velocity(x_0: Array, z: Array, t: Array) -> Array:
    """sCT's `dx_t/dt = cos t z - sin t x_0` (the derivative of `x_t` at fixed `x_0`,
    `z`; its mean given `x_t` is the PF-ODE's velocity)."""
    return _bcast(jnp.cos(t), z) * z - _bcast(jnp.sin(t), x_0) * x_0


# --------------------------------------------------------------------------------------
# The tangent (Algorithm 1)

def scm_tangent(F_sg: Callable[[Array, Array], Array], x_t: Array, t: Array, dxdt: Array,
                r: Array | float, sigma_data: float = 0.5) -> tuple[Array, Array]:
    """`(F-, g)`: the stopped student's `F-` at `(x_t, t)` and the tangent

        g = -cos^2 t (sigma_data F- - dx_t/dt) - r (cos t sin t x_t + sigma_data J)

    with `J = cos t sin t dF-/dt` the `jax.jvp` of `F_sg` in `(x_t, t)` at tangents
    `(cos t sin t dx_t/dt, cos t sin t)` (the paper's rearrangement: the product is
    formed inside the jvp, where `dF-/dt` alone grows as `t -> pi/2`). At `r = 1`,
    `g = cos t df-/dt` along `dx_t/dt`, `f- = cos t x_t - sigma_data sin t F-`.
    `F_sg(x_t [B,H,W,C], t [B]) -> [B,H,W,C]` (no gradient should reach its weights);
    `x_t`, `dxdt` `[B, H, W, C]`, `t` `[B]`; float32, unnormalised."""
    x_t, dxdt = jnp.asarray(x_t, jnp.float32), jnp.asarray(dxdt, jnp.float32)
    t = jnp.asarray(t, jnp.float32)
    cs = jnp.cos(t) * jnp.sin(t)
    F_minus, J = jax.jvp(F_sg, (x_t, t), (_bcast(cs, x_t) * dxdt, cs))
    F_minus = jax.lax.stop_gradient(F_minus.astype(jnp.float32))
    J = jax.lax.stop_gradient(J.astype(jnp.float32))
    g = (-_bcast(jnp.cos(t) ** 2, x_t) * (sigma_data * F_minus - dxdt)
         - r * (_bcast(cs, x_t) * x_t + sigma_data * J))
    return F_minus, g


# The tangent normalisation's norm: the paper's `||g||` over each image's elements, or
# their RMS `||g|| / sqrt(D)` (NVlabs/FastGen's default: the same `c` at any resolution).
TANGENT_NORMS = ("l2", "rms")


def normalize_tangent(g: Array, c: float = TANGENT_C, norm: str = "l2") -> Array:
    """Tangent normalisation `g / (||g|| + c)`, the norm over each image's elements
    (`g` `[B, ...]`); `norm='rms'`: `g / (||g|| / sqrt(D) + c)`, `D` the elements per
    image."""
    axes = tuple(range(1, g.ndim))
    total = jnp.sum(jnp.square(g), axis=axes, keepdims=True)
    if norm == "rms":
        total = total / math.prod(g.shape[1:])
    return g / (jnp.sqrt(total) + c)


def tangent_warmup(iters: Array, batch_size: int, warmup_kimg: float) -> Array:
    """`r = min(1, iters / H)` with `H` in images: `iters * batch_size / (1000
    warmup_kimg)`; 1 when `warmup_kimg = 0`. float32 scalar."""
    if warmup_kimg <= 0:
        return jnp.float32(1.0)
    kimg = jnp.asarray(iters, jnp.float32) * (batch_size / 1000)
    return jnp.minimum(jnp.float32(1.0), kimg / warmup_kimg)


def scm_loss_per_image(student: Callable, student_sg: DenoiseFn, teacher: DenoiseFn | None,
                       images: Array, *, rnd_normal: Array, noise_unit: Array,
                       r: Array | float, P_mean: float, P_std: float,
                       tangent_c: float = TANGENT_C, tangent_norm: str = "l2",
                       prior_weighting: bool = False, sigma_data: float = 0.5
                       ) -> tuple[Array, dict[str, Array]]:
    """The per-image sCM loss of the module docstring (Algorithm 1).

    Args:
      student: `(x, sigma) -> (D, logvar)`, the student's denoiser (gradient flows) and
        its uncertainty `[B]`.
      student_sg: `(x, sigma) -> D`, the same network at stopped weights, differentiable
        in forward mode in `(x, sigma)` (the jvp).
      teacher: `(x, sigma) -> D`, the teacher's (guided) denoiser (sCD), or None (sCT:
        the data's velocity).
      images: clean images `x_0` `[B, H, W, C]`.
      rnd_normal: `[B]` standard normal draws: `tau = P_mean + P_std rnd_normal`.
      noise_unit: `[B, H, W, C]` unit Gaussian noise: `z = sigma_data noise_unit`.
      r: the tangent warmup (`tangent_warmup`), `tangent_c`: the normalisation's `c`,
        `tangent_norm` its norm (`normalize_tangent`).
      prior_weighting: the squared error weighted by `1 / sigma = 1 / (sigma_data tan t)`
        besides `e^{-u}` (the paper's prior weighting, NVlabs/FastGen's default).
    Returns: `(loss [B], aux)`, float32; `aux`: `logvar`, `sigma` (`e^tau`), `mse`
      (`||F_theta - F- - g||^2 / D`) and `g_rms` (the unnormalised tangent's RMS), `[B]`.
    """
    x_0 = jnp.asarray(images, jnp.float32)
    sigma = jnp.exp(P_mean + P_std * jnp.asarray(rnd_normal, jnp.float32))
    t = trig_time(sigma, sigma_data)
    z = sigma_data * jnp.asarray(noise_unit, jnp.float32)
    x_t = _bcast(jnp.cos(t), x_0) * x_0 + _bcast(jnp.sin(t), z) * z
    if teacher is None:
        dxdt = data_velocity(x_0, z, t)
    else:
        dxdt = sigma_data * trigflow_fn(teacher, sigma_data)(x_t, t)
    dxdt = jax.lax.stop_gradient(dxdt)
    _, g = scm_tangent(trigflow_fn(student_sg, sigma_data), x_t, t, dxdt, r, sigma_data)
    g_rms = jnp.sqrt(jnp.mean(jnp.square(g), axis=(1, 2, 3)))
    g = normalize_tangent(g, tangent_c, tangent_norm)
    denoised, logvar = student(*edm_point(x_t, t, sigma_data))
    F_theta = trigflow_F(denoised, x_t, t, sigma_data)
    # The residual's value is -g; its gradient in the weights is F_theta's.
    mse = jnp.mean(jnp.square(F_theta - jax.lax.stop_gradient(F_theta) - g), axis=(1, 2, 3))
    logvar = jnp.asarray(logvar, jnp.float32)
    weight = jnp.exp(-logvar) / sigma if prior_weighting else jnp.exp(-logvar)
    loss = weight * mse + logvar
    return loss, {"logvar": logvar, "sigma": sigma, "mse": mse, "g_rms": g_rms}


def forward_mode(net: Any) -> Any:
    """`net` computed with kernels a `jax.jvp` goes through (`mp.Kernels.forward_mode`);
    a network without a kernel set (a stand-in of `Precond`'s call signature) as it is."""
    kernels = getattr(net, "kernels", None)
    return net if kernels is None else net.clone(kernels=kernels.forward_mode())


# --------------------------------------------------------------------------------------
# The sampler

@solvers.register
@dataclasses.dataclass(frozen=True)
class ScmSampler(solvers.Sampler):
    """The sCM sampler: `num_steps` evaluations of the consistency function (the EDM
    denoiser) at TrigFlow times `t_0 = t_max = arctan(sigma_max / sigma_data)` and, for
    more steps, `t_k = t_mid (K - k) / (K - 1)`, `k = 1 .. K-1` (`t_1 = t_mid`, the
    paper's 1.1; the others evenly below it, this project's rule), re-noised between
    steps with fresh noise of each seed (`churn_noise(k)`): `x = sigma_max n`, then
    `x_0 = D(x; sigma_k)`, `x = x_0 + sigma_{k+1} eps_k`, `sigma_k = sigma_data tan t_k`.
    Raises ValueError at construction for settings that are none."""

    name = "scm"
    num_steps: int = 2
    sigma_max: float = SIGMA_MAX
    t_mid: float = T_MID
    sigma_data: float = 0.5

    def check(self) -> None:
        super().check()
        if not self.sigma_data > 0:
            raise ValueError(f"sigma_data={self.sigma_data}: must be positive, e.g. 0.5")
        if not self.sigma_max > 0:
            raise ValueError(f"sigma_max={self.sigma_max}: must be positive, e.g. 80")
        t_max = math.atan(self.sigma_max / self.sigma_data)
        if self.num_steps > 1 and not 0 < self.t_mid < t_max:
            raise ValueError(f"t_mid={self.t_mid}: a TrigFlow time in (0, t_max = "
                             f"arctan(sigma_max / sigma_data) = {t_max:.4f}), e.g. {T_MID}")

    def times(self) -> np.ndarray:
        """The TrigFlow times `t_0 > ... > t_{K-1}`, host float64 `[K]`."""
        K = self.num_steps
        t_max = math.atan(self.sigma_max / self.sigma_data)
        return np.array([t_max] + [self.t_mid * (K - k) / (K - 1) for k in range(1, K)])

    def sigmas(self) -> np.ndarray:
        """EDM's noise levels of `times()` and a final 0: `sigma_max, sigma_data tan t_1,
        ..., 0`, host float32 `[K + 1]` (the first exactly `sigma_max`)."""
        s = self.sigma_data * np.tan(self.times())
        s[0] = self.sigma_max
        return np.append(s, 0.0).astype(np.float32)

    @property
    def stochastic(self) -> bool:
        return self.num_steps > 1

    def describe(self) -> str:
        t = ", ".join(f"{v:.3f}" for v in self.times())
        return f"the sCM sampler, {self.num_steps} step(s) at t = {t}"

    def __call__(self, denoise: Denoiser, noise: Array, labels: Array | None = None, *,
                 churn_noise: Callable[[Array], Array] | None = None) -> Array:
        """`x_0` `[B, H, W, C]` float32 from unit noise `[B, H, W, C]`; `churn_noise(k)`
        (unit noise of step `k`, per seed) is needed for more than one step. Raises
        ValueError without it."""
        if self.stochastic and churn_noise is None:
            raise ValueError(f"the sCM sampler of {self.num_steps} steps re-noises between "
                             f"steps: pass churn_noise (seeds.seed_churn_noise)")
        sigmas = jnp.asarray(self.sigmas())

        def step(k, x):
            x_0 = denoise(x, sigmas[k], labels).astype(jnp.float32)
            if churn_noise is None:
                return x_0
            # The last step's next level is 0: x_0 itself.
            return x_0 + sigmas[k + 1] * churn_noise(k).astype(jnp.float32)

        x = jnp.asarray(noise, jnp.float32) * sigmas[0]
        return jax.lax.fori_loop(0, self.num_steps, step, x)


# --------------------------------------------------------------------------------------
# The objective

# The section `distill` of an sCM run (and a student network's record of it): the
# teacher (sCD) or the network sCT starts from (`teacher`, `teacher_ema`; sCT may start
# from a fresh network: `teacher=''`), sCT or sCD (`training`), the proposal, the
# tangent's `tangent_c` and warmup, the teacher's guidance (1 = off: by its own
# unconditional slot, `D_u + w (D_c - D_u)`, or with `guide` (`guide_ema`), a network of
# the teacher's architecture, by autoguidance, `D_g + w (D - D_g)`), and the sampler's
# steps, `t_mid`, `sigma_max`.
SCM_FIELDS = dict(teacher="", teacher_ema="", guide="", guide_ema="", training=False,
                  P_mean=PROPOSALS["img64"][0], P_std=PROPOSALS["img64"][1],
                  tangent_c=TANGENT_C, tangent_norm="l2", prior_weighting=False,
                  warmup_kimg=WARMUP_KIMG, guidance=1.0,
                  steps=2, t_mid=T_MID, sigma_max=SIGMA_MAX)


class ContinuousConsistency(Objective):
    """sCM (`config.objective='scm'`): sCD of the teacher `distill.teacher` (EMA
    `distill.teacher_ema`, frozen in the train state as `'teacher'`), or sCT
    (`distill.training=True`: the student starts from that network, or from a fresh one
    without it, and learns from the data's velocity); the loss is `scm_loss_per_image`
    summed over the batch / `batch_size`; the step count of the tangent warmup is the
    state's `'iters'`; its networks are sampled with `ScmSampler` of `distill.steps`."""

    name = "scm"
    section = "distill"

    @classmethod
    def section_fields(cls) -> dict:
        return dict(SCM_FIELDS)

    @property
    def training(self) -> bool:
        return self.get("distill.training", False) is True

    @property
    def sigma_data(self) -> float:
        # A network.json's record holds no network section: EDM2's 0.5 there.
        return float(self.get("network.sigma_data", 0.5))

    def setting(self, name: str) -> Any:
        return self.get(f"distill.{name}", SCM_FIELDS[name])

    def check(self) -> None:
        """Raise ValueError naming the flag when a setting is not one (`check_scm`)."""
        check_scm(self.config)
        self.sampler()

    def start(self) -> StartNetwork | None:
        """sCD: the teacher. sCT: the network named by `distill.teacher`, or None."""
        network = teacher_network(self.config)
        if not self.training:
            return network
        if not network.path:
            return None
        return dataclasses.replace(network, role="pretrained network")

    def frozen_networks(self) -> dict[str, StartNetwork]:
        """sCD autoguided (`distill.guide`): the guide, frozen as `'guide'`."""
        if self.training or not self.setting("guide"):
            return {}
        return {"guide": StartNetwork(str(self.setting("guide")),
                                      str(self.setting("guide_ema") or ""), "guide",
                                      "--config.distill.guide")}

    def describe(self) -> str:
        steps = f"a {self.setting('steps')}-step student"
        if self.training:
            start = self.start()
            return (f"sCT (continuous-time consistency training) from "
                    f"{start.path if start else 'a fresh network'}: {steps}")
        w = float(self.setting("guidance"))
        guide = self.setting("guide")
        guided = ("" if w == 1 else f", the teacher autoguided by {guide} at {w}" if guide
                  else f", the teacher guided at {w}")
        return (teacher_line(self.config) + f"; sCD (continuous-time consistency "
                f"distillation): {steps}{guided}")

    def init_state(self, params: Any) -> dict:
        """`'iters'`, the steps taken (int32, 0), and for sCD the teacher's frozen
        weights (the student's initial `params`)."""
        state = {"iters": jnp.zeros((), jnp.int32)}
        if not self.training:
            state["teacher"] = params
        return state

    def update(self, state: dict, grads: dict, nimg: Array) -> tuple[dict, dict]:
        """`'iters'` + 1."""
        return {"iters": state["iters"] + 1}, {}

    def loss(self, params: Any, buffers: Any, net: Any, state: dict, images: Array,
             labels: Array | None, *, draws: dict, dropout_rng: Array | None,
             batch_size: int) -> tuple[Array, dict]:
        """`sum(scm_loss_per_image) / batch_size` and the logged means (`loss`, `mse`,
        `g_rms`, `logvar`, `sigma`, `log_sigma`, `tangent_warmup`)."""
        variables = {"params": params, "buffers": buffers}
        stopped = {"params": jax.lax.stop_gradient(params), "buffers": buffers}
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
        fwd = forward_mode(net)

        def student(x, sigma):
            return net.apply(variables, x, sigma, labels, train=True, return_logvar=True,
                             rngs=rngs)

        def student_sg(x, sigma):   # the same dropout: F- is F_theta's value
            return fwd.apply(stopped, x, sigma, labels, train=True, rngs=rngs)

        teacher = None if self.training else guided_teacher(
            net, {"params": state["teacher"], "buffers": buffers}, labels,
            float(self.setting("guidance")), guide=state.get("guide"))
        r = tangent_warmup(state["iters"], batch_size, float(self.setting("warmup_kimg")))
        loss, aux = scm_loss_per_image(
            student, student_sg, teacher, images, rnd_normal=draws["rnd_normal"],
            noise_unit=draws["noise_unit"], r=r, P_mean=float(self.setting("P_mean")),
            P_std=float(self.setting("P_std")), tangent_c=float(self.setting("tangent_c")),
            tangent_norm=self.setting("tangent_norm"),
            prior_weighting=bool(self.setting("prior_weighting")), sigma_data=self.sigma_data)
        metrics = {"loss": jnp.mean(loss), "mse": jnp.mean(aux["mse"]),
                   "g_rms": jnp.mean(aux["g_rms"]), "logvar": jnp.mean(aux["logvar"]),
                   "sigma": jnp.mean(aux["sigma"]),
                   "log_sigma": jnp.mean(jnp.log(aux["sigma"])), "tangent_warmup": r}
        return jnp.sum(loss) / batch_size, metrics

    def sampler(self, num_steps: int = 32) -> ScmSampler:
        """The student's sampler of `distill.steps` (its own steps, whatever `num_steps`)."""
        return ScmSampler(int(self.setting("steps")),
                          sigma_max=float(self.setting("sigma_max")),
                          t_mid=float(self.setting("t_mid")), sigma_data=self.sigma_data)

    def flops_per_image(self, forward_flops: float) -> float:
        """The student's forward and backward pass (3), the jvp (primal and tangent: 2),
        and for sCD the teacher's forward pass (1; 2 guided)."""
        passes = 5
        if not self.training:
            passes += 2 if float(self.setting("guidance")) != 1 else 1
        return passes * forward_flops


def guided_teacher(net: Any, variables: Any, labels: Array | None,
                   guidance: float, guide: Any = None) -> DenoiseFn:
    """The teacher's denoiser `(x, sigma) -> D` (float32 `[B, H, W, C]`), stopped; with
    `guidance = w != 1`, guided: without `guide`, classifier-free guidance by its own
    unconditional slot (labels None: zeros), `D_u + w (D_c - D_u)` (meaningful for a
    teacher trained with label dropout); with `guide` (the `{'params', 'buffers'}` of a
    network of `net`'s architecture, given the same labels), autoguidance (Karras et
    al. 2024, Eq. 1), `D_g + w (D - D_g)`."""
    def D(x, sigma):
        d = net.apply(variables, x, sigma, labels).astype(jnp.float32)
        if guidance != 1:
            u = (net.apply(variables, x, sigma, None) if guide is None
                 else net.apply(guide, x, sigma, labels)).astype(jnp.float32)
            d = u + guidance * (d - u)
        return jax.lax.stop_gradient(d)
    return D


def check_scm(config: Any) -> None:
    """Raise ValueError naming the `--config.distill` flag when a field of an sCM run's
    `distill` section is not a setting (before anything is built)."""
    d = field(config, "distill", {})

    def value(name):
        return d.get(name, SCM_FIELDS[name])

    def need(ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ValueError(f"--config.distill.{name}={value(name)!r}: {what}")

    def number(name: str) -> float | None:
        v = value(name)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return float(v) if ok else None

    need(isinstance(value("training"), bool), "training",
         "True (sCT: from the data) or False (sCD: from the teacher)")
    steps = value("steps")
    need(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1, "steps",
         "the student's sampling steps, >= 1, e.g. 2")
    need(number("P_mean") is not None, "P_mean",
         f"the mean of the proposal's tau, e.g. {PROPOSALS['img64'][0]}")
    need((number("P_std") or 0) > 0, "P_std",
         f"the proposal's standard deviation, positive, e.g. {PROPOSALS['img64'][1]}")
    need((number("tangent_c") or 0) > 0, "tangent_c",
         f"the tangent normalisation's constant, positive, e.g. {TANGENT_C}")
    need(value("tangent_norm") in TANGENT_NORMS, "tangent_norm",
         f"the tangent normalisation's norm, one of {', '.join(TANGENT_NORMS)}")
    need(isinstance(value("prior_weighting"), bool), "prior_weighting",
         "True (the error weighted by 1 / sigma) or False")
    w = number("warmup_kimg")
    need(w is not None and w >= 0, "warmup_kimg",
         "the tangent warmup in kimg, >= 0 (0: none), e.g. 20480 (10k steps of 2048)")
    need((number("sigma_max") or 0) > 0, "sigma_max",
         "the sampler's first noise level, positive, e.g. 80")
    sd = float(field(config, "network.sigma_data", 0.5))
    t_max = math.atan(float(value("sigma_max")) / sd)
    t_mid = number("t_mid")
    need(t_mid is not None and 0 < t_mid < t_max, "t_mid",
         f"the 2-step sampler's intermediate time, in (0, arctan(sigma_max / sigma_data) "
         f"= {t_max:.4f}), e.g. {T_MID}")
    g = number("guidance")
    need(g is not None and g >= 1, "guidance",
         "the teacher's guidance weight, >= 1 (1: off), e.g. 1.5")
    need(g == 1 or value("training") is False, "guidance",
         "sCT (distill.training=True) has no teacher to guide: set distill.guidance=1")
    guide = value("guide")
    need(isinstance(guide, str), "guide", "a path (a network of the teacher's "
         "architecture: a run, snapshot or network checkpoint) or '' (none)")
    need(isinstance(value("guide_ema"), str), "guide_ema",
         "the guide's EMA (e.g. '0.100'), or '' (its default)")
    need(not guide or value("training") is False, "guide",
         "sCT (distill.training=True) has no teacher to guide: set distill.guide=''")
    need(not guide or g != 1, "guide", "a guide needs distill.guidance > 1, e.g. 1.5 "
         "(or set distill.guide='')")
    need(g == 1 or bool(guide) or field(config, "data.use_labels", True) is not False,
         "guidance", "guidance without distill.guide needs a conditional teacher "
         "(data.use_labels=True): its unconditional slot is the guide")
    need(isinstance(value("teacher"), str), "teacher", "a path (a run, snapshot or "
         "network checkpoint)")
