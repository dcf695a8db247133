"""The 2D toy's denoiser distilled by continuous-time consistency (sCD; sCT from the
data as an option): Lu & Song 2024, arXiv:2410.11081, with the pieces of
`objectives.scm` (docs/toy_2d.md, "Distilled into few steps"), beside the multistep
consistency students of `toy.distill` and the generators of `toy.dmd`.

The teacher is `toy.distill`'s (the toy's conditional main denoiser). The student is a
copy of it, initialised from its weights; the toy's `ToyDenoiser` is an EDM denoiser
`(x, sigma) -> D`, so TrigFlow's `F` is `objectives.scm.trigflow_F` of it and the
consistency function is the denoiser itself. One training example is
`objectives.scm.scm_loss_per_image` on the points seen as `[B, 1, 1, 2]` images:

    x_t      = cos t y + sin t z,     z ~ N(0, sigma_data^2 I),  y ~ the class's mixture
    dx_t/dt  = sigma_data F_teacher(x_t, t)                 sCD (the teacher unguided)
             = cos t z - sin t y                            sCT (`ScmSettings.training`)
    g        = the tangent of `scm_tangent` (the `jax.jvp` through the stopped student),
               warmed up (`r = min(1, step / warmup_steps)`), normalised (`c = 0.1`)
    loss     = |F_theta - F- - g|^2 / 2

The paper's settings adapted to the toy, as `toy.distill` and `toy.dmd` adapt theirs:
`tau ~ N(P_mean, P_std^2)` is the teacher's own proposal (`TrainSettings`: -2.0, 1.6,
weighted to low noise because the branches are thin); Adam with betas (0.9, 0.99) as the paper's, at `ref_lr`
1e-2, the teacher's and `toy.distill`'s rate, with the toy's inverse-sqrt decay after
`t_ref` steps, forced weight normalisation and power EMA 0.05 as the other toy students
(the paper's 1/100 of the teacher's rate, 1e-4, barely moves the student in the toy's
4096 steps, docs/toy_2d.md; the tangent's RMS falls after its warmup at every rate from
1e-4 to 3e-2); 4096 steps of 512 (the other students' budget); the tangent warmup over
the first 512 steps (the paper's: 10k iterations); tangent normalisation `c =
0.1` (the paper's); no adaptive weight (the toy's net has no learned uncertainty: `u =
0`, so every `t` counts alike). One student is trained and sampled with
`objectives.scm.ScmSampler` in 1 and 2 steps (`t_max = arctan(sigma_max / sigma_data)`
with the toy's `sigma_max = 5`, `t_mid = 1.1`); the points are measured as the other
students' (`autoguidance.sample_metrics`, the distance to the teacher's Heun point from
the same noise), beside the teacher's DDIM in 1 and 2 steps (`toy.distill`).

    python -m edm2_jax.toy.scm --out=toy_scm_out          # 4096 steps
    python -m edm2_jax.toy.scm --out=/tmp/ts --tiny        # the tiny toy, 512 steps
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from edm2_jax.ema import power as ema_lib
from edm2_jax.model import mp
from edm2_jax.objectives import scm
from edm2_jax.sampling import guidance as guidance_lib
from edm2_jax.toy.autoguidance import ToySettings, sample_points
from edm2_jax.toy.data import Mixture, sample_mixture, tree_mixture
from edm2_jax.toy.denoiser import ToyDenoiser, optimizer, optimizer_steps
from edm2_jax.toy.distill import SIGMA_MAX, consistency_points, score_samples, train_teacher

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ScmSettings:
    """The teacher (`toy`) and how the student trains (module docstring): `steps` Adam
    steps of `batch` points, `lr = ref_lr / sqrt(max(step / t_ref, 1))`, the returned
    weights a power EMA of width `ema_sigma_rel`; `tau ~ N(P_mean, P_std^2)`; the
    tangent's warmup over `warmup_steps` and normalisation `tangent_c`; sCT instead of
    sCD with `training`; sampled in each of `sample_steps` with `t_mid`."""

    toy: ToySettings = ToySettings()
    steps: int = 4096
    batch: int = 512
    ref_lr: float = 1e-2
    t_ref: int = 512
    ema_sigma_rel: float = 0.05
    P_mean: float = -2.0
    P_std: float = 1.6
    warmup_steps: int = 512
    tangent_c: float = scm.TANGENT_C
    training: bool = False
    sample_steps: tuple[int, ...] = (1, 2)
    t_mid: float = scm.T_MID
    chunk: int = 128

    @classmethod
    def tiny(cls, **kwargs: Any) -> "ScmSettings":
        """The tiny toy's teacher, 512 steps (tests)."""
        return cls(toy=ToySettings.tiny(), steps=512, t_ref=128, warmup_steps=128,
                   **kwargs)


def scm_losses(params: Any, buffers: Any, net: ToyDenoiser, teacher_params: Any | None,
               mix: Mixture, rng: Array, r: Array, settings: ScmSettings
               ) -> tuple[Array, Array]:
    """`(loss, g_rms)`: the mean over `settings.batch` fresh draws of
    `scm.scm_loss_per_image` for the student `params` (sCD of `teacher_params`, or sCT
    with None) at tangent warmup `r`, and the mean RMS of the unnormalised tangent;
    scalars float32."""
    k_y, k_t, k_n = jax.random.split(rng, 3)
    y, cls = sample_mixture(mix, k_y, settings.batch)
    labels = jax.nn.one_hot(cls, net.label_dim)

    def D(p):   # the toy's points as [B, 1, 1, 2] images
        def denoise(x, sigma):
            out = net.apply({"params": p, "buffers": buffers}, x.reshape(-1, 2), sigma, labels)
            return out.reshape(x.shape)
        return denoise

    stopped = D(jax.lax.stop_gradient(params))
    teacher = None
    if teacher_params is not None:
        frozen = D(jax.lax.stop_gradient(teacher_params))
        teacher = lambda x, sigma: jax.lax.stop_gradient(frozen(x, sigma))   # noqa: E731
    student = D(params)
    loss, aux = scm.scm_loss_per_image(
        lambda x, sigma: (student(x, sigma), jnp.zeros(x.shape[0])), stopped, teacher,
        y.reshape(-1, 1, 1, 2), rnd_normal=jax.random.normal(k_t, (settings.batch,)),
        noise_unit=jax.random.normal(k_n, (settings.batch, 1, 1, 2)), r=r,
        P_mean=settings.P_mean, P_std=settings.P_std, tangent_c=settings.tangent_c,
        sigma_data=net.sigma_data)
    return jnp.mean(loss), jnp.mean(aux["g_rms"])


def _chunk_fn(net: ToyDenoiser, settings: ScmSettings):
    tx = optimizer(settings)
    warmup_kimg = settings.warmup_steps * settings.batch / 1000

    @jax.jit
    def chunk(mix, teacher_params, carry, rngs):
        # `optimizer_steps` passes (params, buffers, x) for each x of `rngs`: here the
        # pair (rng, step), so the warmup sees the step.
        def grads_fn(params, buffers, rng_step):
            rng, step = rng_step
            r = scm.tangent_warmup(step, settings.batch, warmup_kimg)

            def objective(p):
                loss, g_rms = scm_losses(p, buffers, net, teacher_params, mix, rng, r,
                                         settings)
                return loss, jnp.stack([loss, g_rms])
            return jax.grad(objective, has_aux=True)(params)
        return optimizer_steps(grads_fn, tx, settings.batch, settings.ema_sigma_rel,
                               carry, rngs)
    return chunk


def train_student(net: ToyDenoiser, teacher: dict, mix: Mixture,
                  settings: ScmSettings = ScmSettings(), seed: int = 0,
                  steps: int | None = None) -> tuple[dict, np.ndarray]:
    """The sCM student of the teacher (`net` with `teacher`'s `{'params', 'buffers'}`):
    its weights trained for `steps` (default `settings.steps`) Adam steps on
    `scm_losses` (sCD, or sCT with `settings.training`, started from the teacher's
    weights either way). Returns the EMA's `{'params', 'buffers'}` and `[steps, 2]`
    float32 (NumPy): each step's loss and the unnormalised tangent's RMS."""
    steps = settings.steps if steps is None else steps
    params = mp.force_normalize(teacher["params"])
    teacher_params = None if settings.training else teacher["params"]
    ema_state = ema_lib.init_ema_state(params, (settings.ema_sigma_rel,))
    carry = (params, optimizer(settings).init(params), ema_state, teacher["buffers"],
             jnp.int32(0))
    chunk = _chunk_fn(net, settings)
    rng = jax.random.PRNGKey(seed)
    losses = []
    for start in range(0, steps, settings.chunk):
        n = min(settings.chunk, steps - start)
        rngs = (jax.random.split(jax.random.fold_in(rng, start), n),
                jnp.arange(start, start + n, dtype=jnp.int32))
        carry, loss = chunk(mix, teacher_params, carry, rngs)
        losses.append(np.asarray(loss))
    ema = carry[2]["power"][ema_lib.ema_key(settings.ema_sigma_rel)]
    return ({"params": ema, "buffers": teacher["buffers"]},
            np.concatenate(losses or [np.zeros((0, 2), np.float32)]))


@functools.partial(jax.jit, static_argnames=("net", "sampler"))
def _scm_sample(net, variables, sampler, noise, churn, labels):
    return sampler(guidance_lib.make_denoiser(net, variables), noise, labels,
                   churn_noise=(lambda k: churn[k]) if sampler.stochastic else None)


def scm_points(net: ToyDenoiser, variables: dict, n: int, cls: int = 0, *,
               num_steps: int, seed: int = 1, sigma_max: float = SIGMA_MAX,
               t_mid: float = scm.T_MID) -> np.ndarray:
    """`n` points of class `cls` from `scm.ScmSampler` in `num_steps` steps from
    `sigma_max` (the toy's 5), from the noise of `autoguidance.sample_points` at the same
    `seed` (and fresh noise of the seed between steps). Returns `[n, 2]` float32."""
    sampler = scm.ScmSampler(num_steps, sigma_max=sigma_max, t_mid=t_mid,
                             sigma_data=net.sigma_data)
    key = jax.random.PRNGKey(seed)
    noise = jax.random.normal(key, (n, 2))
    churn = jax.random.normal(jax.random.fold_in(key, 1), (num_steps, n, 2))
    labels = jax.nn.one_hot(jnp.full((n,), cls), net.label_dim)
    return np.asarray(_scm_sample(net, variables, sampler, noise, churn, labels))


def run(out: str | None = None, settings: ScmSettings = ScmSettings(), seed: int = 0,
        verbose: bool = True) -> dict:
    """Train the teacher (`distill.train_teacher`, as `toy.distill.run`), its sCM student,
    sample class 0 (noise seed `seed + 1`) with the teacher's Heun sampler, its DDIM and
    the student in each of `settings.sample_steps`, measure them and, with `out`, write
    `out/metrics.json` and `out/samples.npz`.

    Returns `{'mix', 'teacher': (net, variables), 'student', 'losses': {'teacher':
    [steps], 'scm': [steps, 2] (loss, g_rms)}, 'samples', 'metrics', 'to_heun',
    'evaluations', 'train_s'}`; the sample names are 'data', 'heun', 'ddim_K', 'scm_K'
    and 'teacher_scm_K' (the teacher under the student's sampler: the student before
    training)."""
    say = print if verbose else (lambda *a, **k: None)
    N, n = settings.toy.num_steps, settings.toy.num_samples
    mix = tree_mixture(seed=seed)
    t0 = time.perf_counter()
    net, teacher, teacher_losses = train_teacher(mix, settings.toy, seed=seed)
    train_s = {"teacher": time.perf_counter() - t0}
    t0 = time.perf_counter()
    student, losses = train_student(net, teacher, mix, settings, seed=seed + 300)
    train_s["scm"] = time.perf_counter() - t0
    what = "sCT" if settings.training else "sCD"
    say(f"{what} ({settings.steps} steps of {settings.batch}): loss "
        f"{losses[:32, 0].mean():.4f} -> {losses[-32:, 0].mean():.4f}, tangent RMS "
        f"{losses[:32, 1].mean():.4f} -> {losses[-32:, 1].mean():.4f}  "
        f"[{train_s['scm']:.1f} s]")
    samples = {"data": np.asarray(sample_mixture(mix, jax.random.PRNGKey(seed + 11), n, 0)[0]),
               "heun": sample_points(net, teacher, n, 0, num_steps=N, sigma_max=SIGMA_MAX,
                                     seed=seed + 1)}
    evaluations = {"data": 0, "heun": 2 * N - 1}
    for K in settings.sample_steps:
        samples[f"ddim_{K}"] = consistency_points(net, teacher, n, 0, num_steps=K,
                                                  teacher_steps=N, seed=seed + 1)
        for name, variables in ((f"teacher_scm_{K}", teacher), (f"scm_{K}", student)):
            samples[name] = scm_points(net, variables, n, 0, num_steps=K, seed=seed + 1,
                                       t_mid=settings.t_mid)
        for name in (f"ddim_{K}", f"teacher_scm_{K}", f"scm_{K}"):
            evaluations[name] = K
    metrics, to_heun = score_samples(mix, samples, evaluations, say, width=14)
    result = {"mix": mix, "teacher": (net, teacher), "student": student,
              "losses": {"teacher": teacher_losses, "scm": losses}, "samples": samples,
              "metrics": metrics, "to_heun": to_heun, "evaluations": evaluations,
              "train_s": train_s}
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump({"seed": seed, "settings": dataclasses.asdict(settings),
                       "train_s": {k: round(v, 1) for k, v in train_s.items()},
                       "final_loss": losses[-32:].mean(0).tolist(),
                       "evaluations": evaluations, "metrics": metrics,
                       "to_heun": to_heun}, f, indent=1)
        np.savez(os.path.join(out, "samples.npz"), **samples)
        say(f"wrote metrics.json and samples.npz in {out}")
    return result


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m edm2_jax.toy.scm",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="directory for metrics.json, samples.npz")
    parser.add_argument("--tiny", action="store_true", help="the tiny toy, 512 steps (tests)")
    parser.add_argument("--sct", action="store_true", help="sCT (from the data) instead of sCD")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    settings = ScmSettings.tiny() if args.tiny else ScmSettings()
    settings = dataclasses.replace(settings, training=args.sct)
    t = time.perf_counter()
    result = run(args.out, settings, seed=args.seed)
    print(f"total {time.perf_counter() - t:.1f} s "
          f"(training {sum(result['train_s'].values()):.1f} s)")
    return result


if __name__ == "__main__":
    main()
