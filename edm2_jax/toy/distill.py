"""Few-step generation on the 2D toy: its denoiser distilled into 1, 2, 4 and 8-step
students (docs/toy_2d.md, "Distilled into few steps").

Multistep consistency distillation (Heek, Hoogeboom & Salimans 2024, arXiv:2403.06807,
Alg. 1; `K = 1` is the consistency distillation of Song et al. 2023, arXiv:2303.01469,
Eq. 7) in EDM's sigma parametrisation, with the pieces of `objectives.distill` and the
sampler of `sampling.consistency`. The teacher is the toy's conditional main denoiser
(`autoguidance.run`'s 'main': same net, training and seed); each student is a copy of it,
initialised from its weights and trained with Adam (inverse-sqrt decay, forced weight
normalisation, power EMA, as `denoiser.train_denoiser`) on

    t, r, s  = consistency_draws(z)          grid point, the teacher's next one, segment end
    x_t      = y + t n                       y ~ the class's mixture, n ~ N(0, I)
    x_r      = heun_step(D_teacher, x_t, t, r)
    x0_hat*  = consistency_target(sg D_student, x_t, x_r, t, r, s)
    loss     = lambda(t) |D_student(x_t; t) - x0_hat*|^2,   lambda(t) = (t^2 + sigma_data^2)
                                                                        / (t sigma_data)^2

(`denoiser.denoiser_loss`'s weight: the toy's net has no learned uncertainty). The
grid is the teacher's sampler: `num_steps` Heun steps from `sigma_max = 5` to
`sigma_min = 0.002`, `rho = 7`. Class-0 samples of each student with
`consistency_sampler` at `K` evaluations are measured (`autoguidance.sample_metrics`: on-branch
fraction, coverage, mean log-likelihood under the true density) against the teacher's
Heun sampler (`2 num_steps - 1` evaluations) and the teacher under the same `K`-step
sampler (DDIM on the same segments), all from the same noise, and by the distance of each
point to the teacher's Heun point from that noise (what distillation drives to 0).
Beside them, 1, 2 and 4-step generators distilled by distribution matching (`toy.dmd`,
DMD2 without its GAN head) and the same with DMD2's GAN head (`DMDSettings.gan`, on the
teacher's features), sampled with the same few-step sampler from the same noise.

    python -m edm2_jax.toy.distill --out=toy_distill_out  # 492 s of CPU time
    python -m edm2_jax.toy.distill --out=/tmp/td --tiny    # 150 s, for tests

(2 cores shared with other jobs, load average 3.4 to 5.4.)
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
from edm2_jax.objectives import distill
from edm2_jax.sampling import consistency
from edm2_jax.sampling import guidance as guidance_lib
from edm2_jax.sampling.schedule import RHO, SIGMA_MIN
from edm2_jax.sampling.solvers import heun_step
from edm2_jax.toy.autoguidance import ToySettings, sample_metrics, sample_points
from edm2_jax.toy.data import Mixture, log_prob, sample_mixture, tree_mixture
from edm2_jax.toy.denoiser import ToyDenoiser, optimizer, optimizer_steps, train_denoiser
from edm2_jax.toy.dmd import DMDSettings, train_generator

Array = jax.Array

# The toy's sampler grid (`autoguidance.sample_points`: `edm_sampler` from sigma_max = 5 with its
# defaults sigma_min = 0.002, rho = 7), which the students are distilled on.
SIGMA_MAX = 5.0


@dataclasses.dataclass(frozen=True)
class DistillSettings:
    """The teacher (`toy`: its main net, training, `num_samples` and `num_steps`, the
    teacher's Heun steps and so the grid's `N`) and how each student trains: `steps`
    Adam steps of `batch` points, `lr = ref_lr / sqrt(max(step / t_ref, 1))`, returned
    weights a power EMA of width `ema_sigma_rel`; one student per `K` in `students`."""

    toy: ToySettings = ToySettings()
    students: tuple[int, ...] = (1, 2, 4, 8)
    steps: int = 4096
    batch: int = 512
    ref_lr: float = 1e-2
    t_ref: int = 512
    ema_sigma_rel: float = 0.05
    chunk: int = 128   # steps per jitted `lax.scan` call
    dmd: DMDSettings = DMDSettings()   # the distribution-matching generators beside them
    gan_head: bool = True   # and the same generators with DMD2's GAN head (`dmd` with gan)

    @classmethod
    def tiny(cls) -> "DistillSettings":
        """The tiny toy (16 Heun steps), 256 distillation steps and 512 of distribution
        matching: 150 s of CPU time (tests, CI)."""
        return cls(toy=ToySettings.tiny(), steps=256, t_ref=64, dmd=DMDSettings.tiny())


# ---------------------------------------------------------------------------------------
# The teacher and the students' training.

def train_teacher(mix: Mixture, settings: ToySettings, seed: int = 0
                  ) -> tuple[ToyDenoiser, dict, np.ndarray]:
    """The toy's main denoiser as `autoguidance.run` trains it (conditional, `settings.hidden`
    wide, `settings.num_blocks` blocks, `settings.main` training, seed `seed`): `(net,
    variables, losses [steps])`."""
    net = ToyDenoiser(label_dim=2, hidden=settings.hidden, num_blocks=settings.num_blocks)
    variables, losses = train_denoiser(net, mix, settings.main, seed=seed)
    return net, variables, losses


def distill_losses(params: dict[int, Any], buffers: Any, net: ToyDenoiser,
                   teacher_params: Any, mix: Mixture, rng: Array, *, batch: int,
                   teacher_steps: int) -> Array:
    """The distillation loss of the module docstring for each student `params[K]` (a
    `K`-step student's weights), on `batch` fresh draws that all students share (data,
    class labels, grid points, noise and so the teacher's Heun step; the segment end `s`
    is each `K`'s own): float32 `[len(params)]` in the order of `params`. A student's
    loss is 0 where its DDIM step from every `(x_t, t)` lands where the teacher's Heun
    step and its own steps to the segment end land; no student's loss depends on
    another's weights. (`params` is a pytree: traced, its keys come in sorted order.)"""
    k_y, k_i, k_n = jax.random.split(rng, 3)
    y, cls = sample_mixture(mix, k_y, batch)
    labels = jax.nn.one_hot(cls, net.label_dim)
    z = jax.random.normal(k_i, (batch,))
    grid = dict(teacher_steps=teacher_steps, sigma_min=SIGMA_MIN, sigma_max=SIGMA_MAX, rho=RHO)
    t, r, _ = distill.consistency_draws(z, steps=1, **grid)   # t, r: the same for every K
    x_t = y + t[:, None] * jax.random.normal(k_n, (batch, 2))

    def D(p):
        return lambda x, sigma: net.apply({"params": p, "buffers": buffers}, x, sigma, labels)

    x_r = heun_step(D(teacher_params), x_t, t, r)
    sd = net.sigma_data
    weight = (t**2 + sd**2) / (t * sd) ** 2
    losses = []
    for K, p in params.items():
        _, _, s = distill.consistency_draws(z, steps=K, **grid)
        target = distill.consistency_target(D(jax.lax.stop_gradient(p)), x_t, x_r, t, r, s)
        losses.append(jnp.mean(weight * jnp.sum(jnp.square(D(p)(x_t, t) - target), -1)))
    return jnp.stack(losses)


@functools.partial(jax.jit, static_argnames=("net", "settings"))
def _distill_chunk(net, settings, mix, teacher_params, carry, rngs):
    # Adam per weight, so one optimizer over all students' weights is each student's own.
    def grads_fn(params, buffers, rng):
        def objective(p):   # the sum's gradient w.r.t. p[K] is that of student K's loss
            losses = distill_losses(p, buffers, net, teacher_params, mix, rng,
                                    batch=settings.batch, teacher_steps=settings.toy.num_steps)
            return jnp.sum(losses), losses
        return jax.grad(objective, has_aux=True)(params)
    return optimizer_steps(grads_fn, optimizer(settings), settings.batch,
                           settings.ema_sigma_rel, carry, rngs)


def distill_students(net: ToyDenoiser, teacher: dict, mix: Mixture,
                     settings: DistillSettings = DistillSettings(), seed: int = 0,
                     steps: int | None = None) -> tuple[dict[int, dict], dict[int, np.ndarray]]:
    """Distil the teacher (`net` with `teacher`'s `{'params', 'buffers'}`) into a `K`-step
    student for each `K` in `settings.students`: the same net initialised from the
    teacher's weights, trained on `distill_losses` for `steps` (default `settings.steps`)
    Adam steps (`denoiser.optimizer`; forced weight normalisation before each step;
    power EMA).
    The students train side by side on shared draws, so the teacher is evaluated once
    per draw for all of them; each one's updates are those of its own loss.

    Returns `({K: variables}, {K: losses})`: each EMA's `{'params', 'buffers'}` and its
    loss at every step `[steps]` float32 (NumPy). Raises
    ValueError unless `1 <= K <= settings.toy.num_steps` (`consistency.segment_bounds`).
    """
    for K in settings.students:
        consistency.segment_bounds(K, settings.toy.num_steps)
    steps = settings.steps if steps is None else steps
    params = {K: mp.force_normalize(teacher["params"]) for K in settings.students}
    ema_state = ema_lib.init_ema_state(params, (settings.ema_sigma_rel,))
    carry = (params, optimizer(settings).init(params), ema_state, teacher["buffers"],
             jnp.int32(0))
    rng = jax.random.PRNGKey(seed)
    losses = []
    for start in range(0, steps, settings.chunk):
        n = min(settings.chunk, steps - start)
        carry, loss = _distill_chunk(net, settings, mix, teacher["params"], carry,
                                     jax.random.split(jax.random.fold_in(rng, start), n))
        losses.append(np.asarray(loss))
    ema_params = carry[2]["power"][ema_lib.ema_key(settings.ema_sigma_rel)]
    losses = np.concatenate(losses or [np.zeros((0, len(settings.students)), np.float32)])
    return ({K: {"params": ema_params[K], "buffers": teacher["buffers"]}
             for K in settings.students},
            {K: losses[:, j] for j, K in enumerate(sorted(settings.students))})


# ---------------------------------------------------------------------------------------
# Sampling and the whole comparison.

@functools.partial(jax.jit, static_argnames=("net", "num_steps", "teacher_steps"))
def _consistency_sample(net, variables, noise, labels, num_steps, teacher_steps):
    return consistency.consistency_sampler(
        guidance_lib.make_denoiser(net, variables), noise, labels, num_steps=num_steps,
        teacher_steps=teacher_steps, sigma_min=SIGMA_MIN, sigma_max=SIGMA_MAX, rho=RHO)


def consistency_points(net: ToyDenoiser, variables: dict, n: int, cls: int = 0, *,
                       num_steps: int, teacher_steps: int, seed: int = 1) -> np.ndarray:
    """`n` points of class `cls` from `consistency.consistency_sampler` at `num_steps`
    evaluations on the grid of `teacher_steps` (a student's few-step sampler; for the
    teacher, DDIM over the same segments), from the noise of `autoguidance.sample_points` at the
    same `seed`. Returns `[n, 2]` float32 (NumPy)."""
    noise = jax.random.normal(jax.random.PRNGKey(seed), (n, 2))
    labels = jax.nn.one_hot(jnp.full((n,), cls), net.label_dim)
    return np.asarray(_consistency_sample(net, variables, noise, labels, num_steps,
                                          teacher_steps))


def score_samples(mix: Mixture, samples: dict[str, np.ndarray], evaluations: dict[str, int],
                  say=print, width: int = 11) -> tuple[dict, dict]:
    """The toy students' table: `sample_metrics` of each set of points `[n, 2]` (class
    0) and, for all but 'data' and 'heun', the mean distance of each point to the
    teacher's Heun point of the same noise; one line each through `say`. Returns
    `(metrics, to_heun)`."""
    metrics = {name: sample_metrics(mix, x, 0) for name, x in samples.items()}
    to_heun = {name: float(np.mean(np.linalg.norm(x - samples["heun"], axis=-1)))
               for name, x in samples.items() if name not in ("data", "heun")}
    for name, m in metrics.items():
        say(f"{name:{width}s} ({evaluations[name]:2d} evaluations) on branches "
            f"{m['on_branches']:.3f}  coverage {m['coverage']:.3f}  "
            f"mean log p {m['mean_logp']:6.2f}"
            + (f"  to Heun's point {to_heun[name]:.4f}" if name in to_heun else ""))
    return metrics, to_heun


def run(out: str | None = None, settings: DistillSettings = DistillSettings(),
        seed: int = 0, verbose: bool = True) -> dict:
    """Train the teacher, distil a student per `K` in `settings.students`, sample class 0
    with the teacher's Heun sampler, the teacher's `K`-step DDIM and each `K`-step
    student (noise seed `seed + 1`, as `autoguidance.run`), measure them (`autoguidance.sample_metrics`)
    and, with `out`, write `out/toy_2d_distill.png` (`plot_distill`), `out/metrics.json`
    and `out/samples.npz`.

    Returns `{'mix', 'teacher': (net, variables), 'students': {K: variables},
    'generators', 'gan_generators': {K: variables}, 'losses': {'teacher' | K: [steps],
    'dmd_K' | 'dmd_gan_K': [steps, columns]}, 'samples': {name: [n, 2]}, 'metrics':
    {name: dict}, 'to_heun': {name: float}, 'evaluations': {name: int}, 'train_s':
    {'teacher' | 'students' | 'dmd' | 'dmd_gan': s}, 'plot'}`; the sample names are
    'data', 'heun', 'ddim_K', 'student_K', 'dmd_K' (the distribution-matching generators
    of `settings.dmd`, `toy.dmd`) and, with `settings.gan_head`, 'dmd_gan_K' (the same
    with DMD2's GAN head: same seeds and draws; `gan_generators` is empty without).
    `to_heun`: for the few-step samples, the mean distance from each point to the
    teacher's Heun point from the same noise (0 for a student that reproduces the
    teacher's ODE map, which distillation aims at). metrics.json's `final_loss`: each
    loss's mean over the last 32 steps, a list of its columns (`train_generator`'s).
    """
    say = print if verbose else (lambda *a, **k: None)
    toy_settings = settings.toy
    N, n = toy_settings.num_steps, toy_settings.num_samples
    mix = tree_mixture(seed=seed)
    t0 = time.perf_counter()
    net, teacher, losses = train_teacher(mix, toy_settings, seed=seed)
    train_s = {"teacher": time.perf_counter() - t0}
    losses = {"teacher": losses}
    say(f"trained teacher ({toy_settings.main.steps} steps of {toy_settings.main.batch}): "
        f"final loss {np.mean(losses['teacher'][-32:]):.4f}  [{train_s['teacher']:.1f} s]")
    t0 = time.perf_counter()
    students, student_losses = distill_students(net, teacher, mix, settings, seed=seed + 100)
    train_s["students"] = time.perf_counter() - t0
    losses.update(student_losses)
    for K in settings.students:
        say(f"distilled K={K} ({settings.steps} steps of {settings.batch}): loss "
            f"{np.mean(losses[K][:32]):.4f} -> {np.mean(losses[K][-32:]):.4f}")
    say(f"[{train_s['students']:.1f} s for the {len(settings.students)} students]")
    t0 = time.perf_counter()
    grid = dict(teacher_steps=N, sigma_min=SIGMA_MIN, sigma_max=SIGMA_MAX, rho=RHO)
    generators = {}
    for K in settings.dmd.students:   # distribution matching (toy.dmd), the same grid
        generators[K], losses[f"dmd_{K}"] = train_generator(net, teacher, mix, K, grid,
                                                            settings.dmd, seed=seed + 200 + K)
    train_s["dmd"] = time.perf_counter() - t0
    say(f"[{train_s['dmd']:.1f} s for the {len(generators)} distribution-matching generators]")
    gan_generators = {}
    if settings.gan_head:   # the same, seeds and draws, with the GAN head
        t0 = time.perf_counter()
        gan_settings = dataclasses.replace(settings.dmd, gan=True)
        for K in settings.dmd.students:
            gan_generators[K], losses[f"dmd_gan_{K}"] = train_generator(
                net, teacher, mix, K, grid, gan_settings, seed=seed + 200 + K)
        train_s["dmd_gan"] = time.perf_counter() - t0
        say(f"[{train_s['dmd_gan']:.1f} s for the {len(gan_generators)} generators with "
            f"the GAN head]")

    samples = {"data": np.asarray(sample_mixture(mix, jax.random.PRNGKey(seed + 11), n, 0)[0]),
               "heun": sample_points(net, teacher, n, 0, num_steps=N, sigma_max=SIGMA_MAX,
                                     seed=seed + 1)}
    evaluations = {"data": 0, "heun": 2 * N - 1}
    for K in settings.students:
        for name, variables in ((f"ddim_{K}", teacher), (f"student_{K}", students[K])):
            samples[name] = consistency_points(net, variables, n, 0, num_steps=K,
                                               teacher_steps=N, seed=seed + 1)
            evaluations[name] = K
    for prefix, gens in (("dmd", generators), ("dmd_gan", gan_generators)):
        for K, variables in gens.items():
            samples[f"{prefix}_{K}"] = consistency_points(net, variables, n, 0, num_steps=K,
                                                          teacher_steps=N, seed=seed + 1)
            evaluations[f"{prefix}_{K}"] = K
    metrics, to_heun = score_samples(mix, samples, evaluations, say, width=11)
    result = {"mix": mix, "teacher": (net, teacher), "students": students,
              "generators": generators, "gan_generators": gan_generators, "losses": losses,
              "samples": samples, "metrics": metrics, "to_heun": to_heun,
              "evaluations": evaluations, "train_s": train_s, "plot": None}
    if out:
        os.makedirs(out, exist_ok=True)
        result["plot"] = os.path.join(out, "toy_2d_distill.png")
        plot_distill(result, result["plot"])
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump({"seed": seed, "settings": dataclasses.asdict(settings),
                       "grid": {"teacher_steps": N, "sigma_min": SIGMA_MIN,
                                "sigma_max": SIGMA_MAX, "rho": RHO},
                       "train_s": {str(k): round(v, 1) for k, v in train_s.items()},
                       "final_loss": {str(k): np.mean(v[-32:], axis=0).tolist()
                                      for k, v in losses.items()},
                       "evaluations": evaluations, "metrics": metrics,
                       "to_heun": to_heun}, f, indent=1)
        np.savez(os.path.join(out, "samples.npz"), **samples)
        say(f"wrote {result['plot']}, metrics.json and samples.npz in {out}")
    return result


def plot_distill(result: dict, path: str | None = None,
                 center: tuple[float, float] = (0.45, 0.45), view: float = 0.95) -> Any:
    """Class-0 samples over the true class-0 density (shaded) and class 1 (grey), as
    `plot.plot_guidance`: top row the teacher's Heun sampler, then its `K`-step DDIM
    for each `K`; second row the data, then the `K`-step students below their teacher's
    DDIM (`K` steps: `K` evaluations); then, where `result` has them, the
    distribution-matching generators (`dmd_K`) and those with the GAN head (`dmd_gan_K`).
    Each title gives `autoguidance.sample_metrics`. Saves a PNG at `path` if given;
    returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    mix, samples, metrics, evals = (result[k] for k in ("mix", "samples", "metrics",
                                                        "evaluations"))
    Ks = sorted(result["students"])
    (cx, cy), v = center, view
    gx, gy = np.meshgrid(np.linspace(cx - v, cx + v, 240), np.linspace(cy - v, cy + v, 240))
    pts = np.stack([gx.ravel(), gy.ravel()], -1).astype(np.float32)
    density = jax.jit(log_prob)
    dens = [np.asarray(density(mix, pts, 0.0, c)).reshape(gx.shape) for c in (0, 1)]
    heun_steps = (evals["heun"] + 1) // 2
    steps = {K: f"{K} step{'s' * (K > 1)}" for K in Ks}
    panels = [[("heun", f"teacher, Heun, {heun_steps} steps ({evals['heun']} evaluations)")]
              + [(f"ddim_{K}", f"teacher, DDIM, {steps[K]}") for K in Ks],
              [("data", "data (class 0)")]
              + [(f"student_{K}", f"student, {steps[K]}") for K in Ks]]
    for prefix, what in (("dmd", "distribution matching"),   # third and fourth rows
                         ("dmd_gan", "distribution matching + GAN head")):
        if any(f"{prefix}_{K}" in samples for K in Ks):
            panels.append([None] + [(f"{prefix}_{K}", f"{what}, {steps[K]}")
                                    if f"{prefix}_{K}" in samples else None for K in Ks])
    fig, axes = plt.subplots(len(panels), len(Ks) + 1,
                             figsize=(4 * (len(Ks) + 1), 4.5 * len(panels)))
    for i, row in enumerate(panels):
        for j, panel in enumerate(row):
            ax = axes[i, j]
            if panel is None:
                ax.axis("off")
                continue
            name, title = panel
            ax.contourf(gx, gy, dens[1], levels=[-1.0, 50], colors=["#e4e4e4"])
            ax.contourf(gx, gy, dens[0], levels=[-1.0, 50], colors=["#f6d7b8"])
            ax.set_xlim(cx - v, cx + v), ax.set_ylim(cy - v, cy + v)
            ax.set_aspect("equal"), ax.set_xticks([]), ax.set_yticks([])
            x, m = samples[name], metrics[name]
            ax.plot(x[:, 0], x[:, 1], ".", ms=1.5, alpha=0.35, color="k")
            ax.set_title(f"{title}\non branches {m['on_branches']:.2f}, coverage "
                         f"{m['coverage']:.2f}, log p {m['mean_logp']:.1f}", fontsize=10)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=80)
    return fig


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m edm2_jax.toy.distill",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True,
                        help="directory for toy_2d_distill.png, metrics.json, samples.npz")
    parser.add_argument("--tiny", action="store_true", help="seconds-long settings (tests, CI)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    settings = DistillSettings.tiny() if args.tiny else DistillSettings()
    import matplotlib
    matplotlib.use("Agg")
    t = time.perf_counter()
    result = run(args.out, settings, seed=args.seed)
    print(f"total {time.perf_counter() - t:.1f} s "
          f"(training {sum(result['train_s'].values()):.1f} s)")
    return result


if __name__ == "__main__":
    main()
