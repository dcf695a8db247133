"""The sigma_rel sweep: reconstruct a range of EMA lengths, measure each, plot, name the
best (the paper's Fig. 5a).

Owns `sweep` (any metric function; CSV and plot), `main_sweep` (the body of
`--mode=phema_sweep`: the metric, its reference data, the metric function over generated
images), `net_sampler` (the sampler it generates them with: the network's own,
`nets.net_sampler`) and `run_data_config` (a run's reference data when no `--config` is given).
"""
from __future__ import annotations

import csv
import io
import os
import sys
import warnings
from typing import Callable, Sequence

import numpy as np

from edm2_jax.run import network_dir as ckpt_lib
from edm2_jax.evaluation import metrics as metrics_lib
from edm2_jax.evaluation.images import net_images
from edm2_jax.run import layout
from edm2_jax import nets
from edm2_jax import paths as paths_lib
from edm2_jax.ema.reconstruction import reconstruct
from edm2_jax.sampling import solvers


def run_data_config(workdir: str) -> dict | None:
    """The `data` section of a training run's `WORKDIR/config.json` (the reference data
    of a sweep's metric when no `--config` is given), or None when there is none."""
    config = layout.read_config(workdir)
    data = config.get("data") if config is not None else None
    return dict(data) if isinstance(data, dict) and data.get("source") else None


def sweep(workdir: str, sigma_rels: Sequence[float], metric_fn: Callable[[str], float], *,
          at_kimg: float | None = None, out_dir: str | None = None,
          metric_name: str = "metric", per_tensor=None) -> tuple[str, str]:
    """Reconstruct each sigma_rel (reusing matching outputs already on disk), evaluate
    `metric_fn(network_checkpoint_path) -> float` on each, and write
    `OUT_DIR/sweep-<kimg>-<metric_name>.csv` (columns sigma_rel, kimg, metric_name,
    profile_error, path) and a `.png` plot of the metric against sigma_rel (the paper's
    Fig. 5a style, lower assumed better; the best point is marked) and print the best.

    Returns `(csv_path, png_path)`.
    """
    with warnings.catch_warnings(record=True) as caught:  # one line each, no source line
        warnings.simplefilter("always")
        paths = reconstruct(workdir, sigma_rels, at_kimg=at_kimg, out_dir=out_dir,
                            per_tensor=per_tensor, exist_ok=True)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr, flush=True)
    rows = []
    for s, p in zip(sigma_rels, paths):
        value = float(metric_fn(p))
        _, m = ckpt_lib.read_network_json(p)
        rows.append({"sigma_rel": float(s), "kimg": m["kimg"], metric_name: value,
                     "profile_error": m["profile_error"], "path": p})
        print(f"  sigma_rel {s:.3f}  {metric_name} {value:.6g}")
    base = os.path.join(os.path.dirname(paths[0]),
                        f"sweep-{int(rows[0]['kimg']):07d}-{metric_name}")
    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    paths_lib.write_text_atomic(base + ".csv", text.getvalue())  # local or gs://
    best_row = min(rows, key=lambda r: r[metric_name])
    edge = best_row["sigma_rel"] in (min(sigma_rels), max(sigma_rels)) and len(rows) > 2
    print(f"best sigma_rel {best_row['sigma_rel']:.3f} ({metric_name} "
          f"{best_row[metric_name]:.6g})"
          + (" at the edge of the swept range: extend it to find the minimum" if edge else ""))
    _plot(rows, metric_name, base + ".png")
    return base + ".csv", base + ".png"


def _plot(rows: list[dict], metric_name: str, path: str) -> None:
    """The metric against sigma_rel, the best point marked, as a PNG at `path`."""
    # matplotlib is a required dependency, imported here rather than at the top: it takes
    # ~1.5 s to import, which every import of this module (the CLI's `--mode=phema` too,
    # through modes/phema.py) would pay for a plot only the sweep draws.
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs = [r["sigma_rel"] for r in rows]
    ys = [r[metric_name] for r in rows]
    order = np.argsort(xs)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(np.asarray(xs)[order], np.asarray(ys)[order], "o-")
    best = int(np.argmin(ys))
    ax.plot([xs[best]], [ys[best]], "r*", ms=12, label=f"best sigma_rel {xs[best]:.3f}")
    ax.set_xlabel("EMA length sigma_rel")
    ax.set_ylabel(metric_name)
    ax.set_title(f"post-hoc EMA sweep at kimg {rows[0]['kimg']:g}")
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format="png")
    plt.close(fig)
    tmp = path + ".tmp"  # complete or absent: written whole, then renamed
    with paths_lib.open(tmp, "wb") as f:
        f.write(buf.getvalue())
    paths_lib.rename(tmp, path)


def net_sampler(net_path: str, num_steps: int | None = None) -> solvers.Sampler:
    """The sampler the sweep generates the network at `net_path` with: its own
    (`nets.net_sampler`: a distilled student's few-step sampler, its post-hoc EMAs being
    students too, else the Heun sampler of 32 steps); `num_steps` (`--steps`), when
    given, replaces the steps of either."""
    sampler = nets.net_sampler(net_path)
    return sampler if num_steps is None else sampler.with_steps(num_steps)


def main_sweep(workdir: str, sigma_rels: Sequence[float], *, metrics: str = "fid",
               num_images: int = 50000, batch_size: int = 64, num_steps: int | None = None,
               ref: str | None = None, ref_split: str = "test",
               data_config: dict | None = None, at_kimg: float | None = None,
               out_dir: str | None = None, per_tensor: str | None = None,
               dinov2: str | None = None, vae_path: str | None = None) -> tuple[str, str]:
    """CLI body of `--mode=phema_sweep`: reconstruct each sigma_rel, generate
    `num_images` from it (with the run's own sampler, `net_sampler`: a distillation
    run's few-step sampler, else Heun; `num_steps` None keeps its steps) and measure the
    first of `metrics` (`cls`: FD in the
    classifier's features; `fid`: FID, `fd_dinov2`: FD_DINOv2 (weights file `dinov2`),
    each against `ref` or the data), then `sweep`'s CSV and plot. Reference data:
    `data_config` (the `--config`'s data section), else the run's config.json
    (`run_data_config`). `vae_path` (`--vae`): the SD VAE that decodes a latent run's
    samples (and latent reference data) to RGB before measuring; a latent run without it
    (or a pixel-space run with it) fails before any reconstruction. Raises ValueError for an unknown metric or when there is no
    reference data (and, for fid / fd_dinov2, no `ref`). Returns `(csv_path, png_path)`."""
    metric = metrics.split(",")[0].strip()
    if metric not in metrics_lib.METRICS:
        raise ValueError(f"--metrics={metric}: the sweep measures one of "
                         f"{', '.join(metrics_lib.METRICS)}")
    key = "fd_cls" if metric == "cls" else metrics_lib.metric_key(metric, num_images)
    has_ref = metric in metrics_lib.FD_METRICS and ref
    data_config = data_config if data_config is not None else run_data_config(workdir)
    if data_config is None and not has_ref:
        raise ValueError(f"--metrics={metric} needs reference data: pass --config "
                         f"(its data section)"
                         f"{' or --ref' if metric in metrics_lib.FD_METRICS else ''}; "
                         f"{workdir} has no config.json with a data section")
    vae = nets.check_vae(workdir, vae_path)  # latent run: --vae, before anything heavy
    if has_ref:  # a file of other features fails now, not after the first reconstruction
        metrics_lib.check_ref(ref, metric, dinov2)
    # References (Inception / DINOv2 stats, classifier features) once for the whole sweep.
    suite = metrics_lib.Metrics([metric], num_images, ref=ref, data_config=data_config,
                                ref_split=ref_split, dinov2=dinov2, vae=vae)

    def metric_fn(net_path: str) -> float:
        imgs = net_images(net_path, range(num_images), batch_size, vae=vae,
                          sampler=net_sampler(net_path, num_steps))
        return suite(np.concatenate(list(imgs)))[key]

    csv_path, png = sweep(workdir, sigma_rels, metric_fn, at_kimg=at_kimg, out_dir=out_dir,
                          metric_name=key, per_tensor=per_tensor)
    print(f"Sweep -> {csv_path} {png}")
    return csv_path, png
