"""The figure of the 2D toy: samples and guided score fields, unguided / CFG / autoguidance
/ CFG in a guidance interval.

matplotlib is imported when a figure is drawn, so that the toy's numbers need no
plotting package.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from edm2_jax.sampling import guidance as guidance_lib
from edm2_jax.toy.data import ideal_denoiser, log_prob


def plot_guidance(result: dict, path: str | None = None, guidance: float = 3.0,
                  sigma_field: float = 0.1, center: tuple[float, float] = (0.45, 0.45),
                  view: float = 0.95, grid: int = 24) -> Any:
    """Samples (top row) and the guided score field `(D_w(x; sigma) - x) / sigma^2` at
    `sigma_field` (bottom row) for the data, unguided, CFG, autoguidance and, when
    `result` has them ('cfg_interval' samples, `result['guidance_interval']`), CFG in the
    guidance interval `(sigma_lo, sigma_hi]` (its field: CFG's if `sigma_field` is inside,
    else the unguided one, as on the sampler's steps there), over the true class-0
    density (shaded) and class 1 (grey), in the square of half-size `view` around
    `center`. Saves a PNG at `path` if given; returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    mix, nets, samples, metrics = (result[k] for k in ("mix", "nets", "samples", "metrics"))
    (cx, cy), v = center, view
    gx, gy = np.meshgrid(np.linspace(cx - v, cx + v, 240), np.linspace(cy - v, cy + v, 240))
    pts = np.stack([gx.ravel(), gy.ravel()], -1).astype(np.float32)
    density = jax.jit(log_prob)
    dens = [np.asarray(density(mix, pts, 0.0, c)).reshape(gx.shape) for c in (0, 1)]
    ax_, ay_ = np.meshgrid(np.linspace(cx - v, cx + v, grid), np.linspace(cy - v, cy + v, grid))
    apts = np.stack([ax_.ravel(), ay_.ravel()], -1).astype(np.float32)
    labels = jax.nn.one_hot(jnp.zeros(len(apts), jnp.int32), 2)
    net, variables = nets["main"]

    def field(guide):
        denoise = jax.jit(guidance_lib.make_denoiser(net, variables, *(guide or (None, None)),
                                                 guidance if guide else 1.0))
        return (np.asarray(denoise(apts, sigma_field, labels)) - apts) / sigma_field**2

    fields = {"data": (np.asarray(ideal_denoiser(mix, apts, sigma_field, 0)) - apts)
              / sigma_field**2,
              "unguided": field(None), "cfg": field(nets["uncond"]),
              "autoguidance": field(nets["guide"])}
    titles = {"data": "data (class 0)", "unguided": "unguided",
              "cfg": f"CFG, w={guidance:g}", "autoguidance": f"autoguidance, w={guidance:g}"}
    field_notes = {}
    if "cfg_interval" in samples:
        lo, hi = result["guidance_interval"]
        inside = lo < sigma_field <= hi
        fields["cfg_interval"] = fields["cfg" if inside else "unguided"]
        titles["cfg_interval"] = f"CFG, w={guidance:g}, guidance interval ({lo:g}, {hi:g}]"
        field_notes["cfg_interval"] = (f"\nCFG's: sigma={sigma_field:g} is inside the interval"
                                       if inside else f"\nunguided: sigma={sigma_field:g} is "
                                       f"outside the interval")
    fig, axes = plt.subplots(2, len(titles), figsize=(4 * len(titles), 8.8))
    for j, name in enumerate(titles):
        for ax in axes[:, j]:
            ax.contourf(gx, gy, dens[1], levels=[-1.0, 50], colors=["#e4e4e4"])
            ax.contourf(gx, gy, dens[0], levels=[-1.0, 50], colors=["#f6d7b8"])
            ax.set_xlim(cx - v, cx + v), ax.set_ylim(cy - v, cy + v)
            ax.set_aspect("equal"), ax.set_xticks([]), ax.set_yticks([])
        x = samples[name]
        axes[0, j].plot(x[:, 0], x[:, 1], ".", ms=1.5, alpha=0.35, color="k")
        m = metrics[name]
        axes[0, j].set_title(f"{titles[name]}\non branches {m['on_branches']:.2f}, "
                             f"coverage {m['coverage']:.2f}, log p {m['mean_logp']:.1f}",
                             fontsize=10)
        f = fields[name]
        norm = np.linalg.norm(f, axis=-1, keepdims=True)
        axes[1, j].quiver(apts[:, 0], apts[:, 1], *(f / np.maximum(norm, 1e-6)).T,
                          np.log1p(norm[:, 0]), cmap="viridis", scale=30, width=3e-3)
        axes[1, j].set_title(f"score field at sigma={sigma_field:g} (direction; colour: "
                             f"log(1+|score|)){field_notes.get(name, '')}", fontsize=9)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=80)
    return fig
