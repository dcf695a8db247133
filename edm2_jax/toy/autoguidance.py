"""The 2D toy of autoguidance: CFG against autoguidance on a thin, branching mixture.

Karras et al. 2024, "Guiding a Diffusion Model with a Bad Version of Itself"
(arXiv:2406.02507), Sec. 3 and Fig. 1: on a 2D distribution made of thin branches, a
denoiser guided by an unconditional model (classifier-free guidance, CFG) pushes samples
away from the other class and collapses them onto a few outer tips, while a denoiser
guided by a smaller, shorter-trained version of itself (autoguidance) pulls the samples
that the main model smears between branches back onto the branches and keeps their
variety. The guided denoiser is `D_w = D_g + w (D - D_g)` (Eq. 1), `guidance_lib.make_denoiser`.
CFG is also sampled with a guidance interval (Kynkaeaenniemi et al. 2024, arXiv:2404.07724):
guided only on the sampler steps with `sigma_lo < t_i <= sigma_hi`, unguided on the others.

In data-flow order (the modules of `edm2_jax.toy`):
- `data`: the data, two classes of binary trees, each branch a chain of elongated
  Gaussians (`tree_mixture`), with its exact noisy density `log_prob(x; sigma)` and
  ideal denoiser `ideal_denoiser(x; sigma) = x + sigma^2 grad log p_sigma(x)`.
- `denoiser`: `ToyDenoiser`, a magnitude-preserving MLP in EDM preconditioning, and
  `train_denoiser` (Adam, inverse-sqrt decay, forced weight normalisation, power EMA).
- here: `sample_points`, `sample_metrics`: the EDM Heun sampler on points; on-manifold
  fraction, coverage and mean log-likelihood under the true class density; `run`: all
  of it (the CLI and `colabs/toy_2d.ipynb` call this); `interval_sweep`: CFG over a grid
  of guidance intervals, and the one `ToySettings.guidance_interval` was chosen by.
- `plot`: `plot_guidance`, samples and score fields of unguided / CFG / autoguidance
  / CFG with the guidance interval.

    python -m edm2_jax.toy.autoguidance --out=toy_out         # 73 s of CPU time (2 cores: 2 min)
    python -m edm2_jax.toy.autoguidance --out=/tmp/toy --tiny # about a third of that, for tests
    python -m edm2_jax.toy.autoguidance --out=/tmp/toy --tiny --interval_sweep  # + 25 intervals
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from edm2_jax.sampling import guidance as guidance_lib
from edm2_jax.sampling import solvers
from edm2_jax.toy.data import Mixture, distance_to_branches, log_prob, sample_mixture, tree_mixture
from edm2_jax.toy.denoiser import ToyDenoiser, TrainSettings, train_denoiser
from edm2_jax.toy.plot import plot_guidance


# ---------------------------------------------------------------------------------------
# Sampling and what the samples show.

@functools.partial(jax.jit, static_argnames=("net", "guide_net", "num_steps", "sigma_max",
                                             "guidance_interval"))
def _sample(net, variables, guide_net, guide_variables, guidance, noise, labels, num_steps,
            sigma_max, guidance_interval=None):
    denoise = guidance_lib.make_denoiser(net, variables, guide_net, guide_variables,
                                     1.0 if guide_net is None else guidance)
    return solvers.edm_sampler(denoise, noise, labels, num_steps=num_steps, sigma_max=sigma_max,
                               guidance_interval=guidance_interval)


def sample_points(net: ToyDenoiser, variables: dict, n: int, cls: int | None = 0, *,
                  guide: tuple[ToyDenoiser, dict] | None = None, guidance: float = 1.0,
                  seed: int = 1, num_steps: int = 32, sigma_max: float = 5.0,
                  guidance_interval: tuple[float, float] | None = None) -> np.ndarray:
    """`n` points from the EDM Heun sampler (`solvers.edm_sampler`) with the guided
    denoiser `D_g + w (D - D_g)` (`guidance_lib.make_denoiser`; `guide=None` or `w = 1`:
    unguided). The guide gets the labels only if it is conditional (autoguidance); an
    unconditional guide gives CFG. `guidance_interval=(sigma_lo, sigma_hi)`: guided only
    on the steps with `sigma_lo < t_i <= sigma_hi` (`guidance_lib.guided_steps`).
    Returns `[n, 2]` float32 (NumPy).
    Raises: ValueError on a bad interval, or one without a guide or at `w = 1`."""
    interval = guidance_lib.check_guidance_interval(guidance_interval)
    if interval is not None and (guide is None or guidance == 1):
        raise ValueError(f"guidance_interval={interval} needs a guide and guidance != 1")
    noise = jax.random.normal(jax.random.PRNGKey(seed), (n, 2))
    labels = jax.nn.one_hot(jnp.full((n,), cls), net.label_dim) if net.label_dim else None
    guide_net, guide_vars = guide if guide is not None and guidance != 1 else (None, None)
    return np.asarray(_sample(net, variables, guide_net, guide_vars, jnp.float32(guidance),
                              noise, labels, num_steps, sigma_max, interval))


def sample_metrics(mix: Mixture, x: np.ndarray, cls: int = 0, *, near: float = 0.03,
                   radius: float = 0.05, num_ref: int = 4096, seed: int = 7) -> dict:
    """What a set of samples `x [B, 2]` of class `cls` shows:

    - `on_branches`: fraction within `near` of a branch centre line of the class (the
      data itself: about 0.97 at the defaults);
    - `coverage`: fraction of `num_ref` true draws of the class with a sample within
      `radius` (variety: samples piled on a few tips cover little);
    - `mean_logp`: mean `log p(x | cls)` under the true class density (nats).
    """
    x = np.asarray(x, np.float32)
    ref, _ = sample_mixture(mix, jax.random.PRNGKey(seed), num_ref, cls)
    ref = np.asarray(ref)
    d2 = np.min(np.sum(np.square(ref[:, None, :] - x[None, :, :]), -1), axis=1)
    return {"on_branches": float(np.mean(distance_to_branches(mix, x, cls) < near)),
            "coverage": float(np.mean(d2 < radius**2)),
            "mean_logp": float(np.mean(np.asarray(log_prob(mix, x, 0.0, cls))))}


# ---------------------------------------------------------------------------------------
# The whole toy.

@dataclasses.dataclass(frozen=True)
class ToySettings:
    """The toy's three denoisers and how they are sampled (`run`).

    main: conditional, `hidden` wide, `num_blocks` blocks, `main` training; CFG guide:
    the same net unconditional, same training; autoguide: conditional,
    `guide_hidden`/`guide_blocks`, the shorter `guide` training. All sampled at the same
    `guidance` weight; CFG also with the `guidance_interval` `(sigma_lo, sigma_hi)`, the
    one `interval_sweep` picks on the tiny run (docs/toy_2d.md).
    """

    hidden: int = 64
    num_blocks: int = 3
    guide_hidden: int = 32
    guide_blocks: int = 1
    main: TrainSettings = TrainSettings()
    guide: TrainSettings = TrainSettings(steps=384)
    guidance: float = 2.5
    guidance_interval: tuple[float, float] = (0.0, 0.02)
    num_samples: int = 4096
    num_steps: int = 32

    @classmethod
    def tiny(cls) -> "ToySettings":
        """Seconds on 2 CPU cores: fewer, smaller steps and samples (tests, CI)."""
        return cls(main=TrainSettings(steps=384, t_ref=128),
                   guide=TrainSettings(steps=96, t_ref=128),
                   num_samples=1024, num_steps=16)


def run(out: str | None = None, settings: ToySettings = ToySettings(), seed: int = 0,
        verbose: bool = True) -> dict:
    """Train the main, unconditional and guide denoisers, sample class 0 unguided, with
    CFG, with autoguidance and with CFG in the guidance interval, measure them
    (`sample_metrics`) and, with `out`, write `out/toy_2d.png` (`plot_guidance`) and
    `out/metrics.json`.

    Returns `{'mix', 'nets': {name: (net, variables)}, 'losses': {name: [steps]},
    'samples': {name: [n, 2]}, 'metrics': {name: dict}, 'guidance_interval', 'train_s',
    'plot'}`; the sample names are 'data', 'unguided', 'cfg', 'autoguidance',
    'cfg_interval'.
    """
    say = print if verbose else (lambda *a, **k: None)
    mix = tree_mixture(seed=seed)
    specs = {
        "main": (ToyDenoiser(label_dim=2, hidden=settings.hidden,
                             num_blocks=settings.num_blocks), settings.main),
        "uncond": (ToyDenoiser(label_dim=0, hidden=settings.hidden,
                               num_blocks=settings.num_blocks), settings.main),
        "guide": (ToyDenoiser(label_dim=2, hidden=settings.guide_hidden,
                              num_blocks=settings.guide_blocks), settings.guide),
    }
    nets, losses = {}, {}
    t0 = time.perf_counter()
    for i, (name, (net, ts)) in enumerate(specs.items()):
        t = time.perf_counter()
        variables, losses[name] = train_denoiser(net, mix, ts, seed=seed + i)
        nets[name] = (net, variables)
        say(f"trained {name:6s} ({ts.steps} steps of {ts.batch}): final loss "
            f"{np.mean(losses[name][-32:]):.4f}  [{time.perf_counter() - t:.1f} s]")
    train_s = time.perf_counter() - t0

    net, variables = nets["main"]
    n, w, k = settings.num_samples, settings.guidance, settings.num_steps
    samples = {
        "data": np.asarray(sample_mixture(mix, jax.random.PRNGKey(seed + 11), n, 0)[0]),
        "unguided": sample_points(net, variables, n, 0, num_steps=k, seed=seed + 1),
        "cfg": sample_points(net, variables, n, 0, guide=nets["uncond"], guidance=w,
                             num_steps=k, seed=seed + 1),
        "autoguidance": sample_points(net, variables, n, 0, guide=nets["guide"], guidance=w,
                                      num_steps=k, seed=seed + 1),
        "cfg_interval": sample_points(net, variables, n, 0, guide=nets["uncond"], guidance=w,
                                      num_steps=k, seed=seed + 1,
                                      guidance_interval=settings.guidance_interval),
    }
    metrics = {name: sample_metrics(mix, x, 0) for name, x in samples.items()}
    for name, m in metrics.items():
        say(f"{name:13s} on branches {m['on_branches']:.3f}  coverage {m['coverage']:.3f}  "
            f"mean log p {m['mean_logp']:.2f}")
    result = {"mix": mix, "nets": nets, "losses": losses, "samples": samples,
              "metrics": metrics, "guidance_interval": settings.guidance_interval,
              "train_s": train_s, "plot": None}
    if out:
        os.makedirs(out, exist_ok=True)
        result["plot"] = os.path.join(out, "toy_2d.png")
        plot_guidance(result, result["plot"], guidance=w)
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump({"guidance": w, "train_s": round(train_s, 1),
                       "settings": dataclasses.asdict(settings), "metrics": metrics}, f,
                      indent=1)
        say(f"wrote {result['plot']} and {os.path.join(out, 'metrics.json')}")
    return result


SWEEP_LO = (0.0, 0.01, 0.03, 0.1, 0.3)
SWEEP_HI = (0.02, 0.05, 0.1, 0.2, 0.3, 1.0, 5.0)


def interval_sweep(result: dict, settings: ToySettings, seed: int = 0,
                   lo: Sequence[float] = SWEEP_LO, hi: Sequence[float] = SWEEP_HI,
                   slack: float = 0.02) -> tuple[dict, tuple[float, float]]:
    """CFG at `settings.guidance` in every guidance interval `(l, h]` of the grid
    `lo x hi` (`l < h`), on the nets of a `run` (same noise as its samples).

    Returns `({(l, h): sample_metrics}, best)`: `best` has the highest `mean_logp` among
    the intervals whose coverage is at least the unguided one's minus `slack` (CFG's
    quality gain without its loss of variety); `(0, inf)` if none qualifies.
    """
    net, variables = result["nets"]["main"]
    grid = [(float(a), float(b)) for a in lo for b in hi if a < b]
    rows = {}
    for interval in tqdm(grid, desc="interval sweep", unit="interval", dynamic_ncols=True):
        x = sample_points(net, variables, settings.num_samples, 0, guide=result["nets"]["uncond"],
                          guidance=settings.guidance, num_steps=settings.num_steps,
                          seed=seed + 1, guidance_interval=interval)
        rows[interval] = sample_metrics(result["mix"], x, 0)
    floor = result["metrics"]["unguided"]["coverage"] - slack
    keep = [iv for iv, m in rows.items() if m["coverage"] >= floor]
    best = max(keep, key=lambda iv: rows[iv]["mean_logp"]) if keep else (0.0, float("inf"))
    return rows, best


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m edm2_jax.toy.autoguidance",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for toy_2d.png and metrics.json")
    parser.add_argument("--tiny", action="store_true", help="seconds-long settings (tests, CI)")
    parser.add_argument("--guidance", type=float, default=None,
                        help=f"guidance weight w (default {ToySettings.guidance:g})")
    parser.add_argument("--guidance_interval", default=None, metavar="LO,HI",
                        help="CFG guidance interval (sigma_lo, sigma_hi] (default "
                             f"{ToySettings.guidance_interval[0]:g},"
                             f"{ToySettings.guidance_interval[1]:g})")
    parser.add_argument("--interval_sweep", action="store_true",
                        help="also sample CFG in a grid of intervals (interval_sweep), print "
                             "them and the pick, and add them to metrics.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    settings = ToySettings.tiny() if args.tiny else ToySettings()
    if args.guidance is not None:
        settings = dataclasses.replace(settings, guidance=args.guidance)
    if args.guidance_interval is not None:
        try:
            lo, hi = (float(v) for v in args.guidance_interval.split(","))
        except ValueError:
            parser.error(f"--guidance_interval={args.guidance_interval}: give LO,HI, e.g. 0,0.02")
        try:
            guidance_lib.check_guidance_interval((lo, hi))
        except ValueError as e:
            parser.error(str(e))
        settings = dataclasses.replace(settings, guidance_interval=(lo, hi))
    import matplotlib
    matplotlib.use("Agg")
    t = time.perf_counter()
    result = run(args.out, settings, seed=args.seed)
    if args.interval_sweep:
        rows, best = interval_sweep(result, settings, seed=args.seed)
        for (lo, hi), m in rows.items():
            print(f"CFG in ({lo:g}, {hi:g}]".ljust(22) + f"on branches {m['on_branches']:.3f}  "
                  f"coverage {m['coverage']:.3f}  mean log p {m['mean_logp']:.2f}")
        print(f"best: ({best[0]:g}, {best[1]:g}] (highest mean log p with coverage >= "
              f"unguided - 0.02)")
        path = os.path.join(args.out, "metrics.json")
        with open(path) as f:
            saved = json.load(f)
        saved["interval_sweep"] = {"best": best, "rows": [
            {"interval": iv, **m} for iv, m in rows.items()]}
        with open(path, "w") as f:
            json.dump(saved, f, indent=1)
    print(f"total {time.perf_counter() - t:.1f} s (training {result['train_s']:.1f} s)")
    return result


if __name__ == "__main__":
    main()
