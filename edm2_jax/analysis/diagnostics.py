"""Training-dynamics analysis of runs trained with `config.diagnostics.enabled` (the
`diag/*` records of `training.probes`; Sec. 2, Figures 2-3): a run's plots, and the
comparison of runs (e.g. the ablation's configs C-G) as curves and a Markdown table.

    python -m edm2_jax.main --config=configs/ablation.py:c --workdir=runs/abl-c \
        --config.diagnostics.enabled=True
    python -m edm2_jax.analysis.diagnostics runs/abl-c          # -> runs/abl-c/diagnostics.png
    python -m edm2_jax.analysis.diagnostics --compare runs/abl-c runs/abl-d --out=cmp.png
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
from typing import Sequence

import numpy as np

from edm2_jax import paths
from edm2_jax.model import loss as loss_lib
from edm2_jax.run import stats
from edm2_jax.training.probes import sigma_tag

# Plots (Figure 2/3 style) from a run's stats.jsonl

_BLOCK = re.compile(r"(enc|dec)_(\d+)x\d+_(\w+)")


def _series(records: list[dict], prefix: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    keys = sorted({k for r in records for k in r if k.startswith(prefix)})
    out = {}
    for k in keys:
        pts = [(r["kimg"], r[k]) for r in records if k in r]
        out[k[len(prefix):]] = (np.array([p[0] for p in pts]), np.array([p[1] for p in pts]))
    return out


def _resolution_colors(names):
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional heavy import)
    res = sorted({int(m.group(2)) for n in names if (m := _BLOCK.search(n))}, reverse=True)
    cmap = plt.get_cmap("viridis")
    return {r: cmap(i / max(1, len(res) - 1)) for i, r in enumerate(res)}


def plot_run(workdir: str, out: str | None = None, act_sigma: float | None = None,
             title: str | None = None) -> str:
    """Draw a run's diagnostics to a PNG (default `WORKDIR/diagnostics.png`): activation
    RMS of the encoder and decoder blocks vs kimg (one line per block, coloured by
    resolution; Figure 2 top), the stored weights' RMS
    (Figure 2 bottom) and effective learning rates vs kimg (Figure 3), and the loss and
    logvar vs sigma at each logged time (lighter = later). Returns the path. Raises
    FileNotFoundError / ValueError when the run logged no diagnostics, naming the flag."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    records = [r for r in stats.read_stats(workdir) if any(k.startswith("diag/") for k in r)]
    if not records:
        raise ValueError(f"{workdir}/stats.jsonl holds no diagnostics; train with "
                         f"--config.diagnostics.enabled=True")
    acts = _series(records, "diag/act/")
    tags = sorted({k.split("/")[0] for k in acts}, key=lambda t: float(t[1:]))
    tag = sigma_tag(act_sigma) if act_sigma is not None else tags[len(tags) // 2]
    if tag not in tags:
        raise ValueError(f"no activations logged at sigma {act_sigma}; logged: "
                         f"{[float(t[1:]) for t in tags]}")
    colors = _resolution_colors(acts)
    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5))

    def lines(ax, series, side, ylabel, what, log=False):
        for name, (x, y) in series.items():
            m = _BLOCK.search(name)
            if not m or m.group(1) != side:
                continue
            if log:  # e.g. the effective learning rate at step 0 (ramp-up: lr = 0)
                x, y = x[y > 0], y[y > 0]
            ax.plot(x, y, color=colors.get(int(m.group(2)), "gray"), lw=1.2,
                    alpha=0.9, label=f"{int(m.group(2))}x{int(m.group(2))}")
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7, title="resolution", title_fontsize=7)
        ax.set(xlabel="kimg", ylabel=ylabel, title=f"{what}, {'encoder' if side == 'enc' else 'decoder'}")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)

    act = {k.split("/", 1)[1]: v for k, v in acts.items() if k.startswith(tag + "/")}
    lines(axes[0, 0], act, "enc", "activation RMS", f"activations (sigma={tag[1:]})")
    lines(axes[0, 1], act, "dec", "activation RMS", f"activations (sigma={tag[1:]})")
    wrms = _series(records, "diag/wrms/")
    lines(axes[1, 0], wrms, "enc", "weight RMS ||w_i||/sqrt(fan_in)", "stored weights")
    lines(axes[1, 1], wrms, "dec", "weight RMS ||w_i||/sqrt(fan_in)", "stored weights")
    eff = _series(records, "diag/efflr/")
    lines(axes[0, 2], eff, "enc", "||dw|| / ||w||", "effective learning rate", log=True)
    lines(axes[1, 2], eff, "dec", "||dw|| / ||w||", "effective learning rate", log=True)

    cmap = plt.get_cmap("plasma")
    for ax, prefix, ylabel in ((axes[0, 3], "diag/loss/", "loss (per element)"),
                               (axes[1, 3], "diag/logvar/", "logvar(sigma)")):
        for i, r in enumerate(records):
            pts = sorted((float(k[len(prefix) + 1:]), v) for k, v in r.items()
                         if k.startswith(prefix))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".",
                    color=cmap(0.85 * i / max(1, len(records) - 1)),
                    label=f"{r['kimg']:g} kimg" if i in (0, len(records) - 1) else None)
        ax.set(xscale="log", xlabel="sigma", ylabel=ylabel, title=f"{ylabel} vs sigma")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title or os.path.basename(paths.normalize(workdir)))
    fig.tight_layout()
    out = out or os.path.join(workdir, "diagnostics.png")
    with paths.open(out, "wb") as f:  # local or gs://
        fig.savefig(f, dpi=64, format="png")
    plt.close(fig)
    return out


def probe_wmse(record: dict) -> dict[float, float]:
    """The probe batch's weighted MSE `weight * (D - y)^2` per sigma of one diagnostics
    record, recovered from the logged EDM2 loss `wmse / exp(logvar) + logvar` (Eq. 21)
    by `loss.weighted_mse`, in float64. The learned-uncertainty loss of configs with
    different learning rates is not comparable; this is (the same images, noise and
    weighting in every config)."""
    out = {}
    for k, loss in record.items():
        if k.startswith("diag/loss/s") and f"diag/logvar/{k[10:]}" in record:
            logvar = record[f"diag/logvar/{k[10:]}"]
            out[float(k[11:])] = float(loss_lib.weighted_mse(loss, logvar))
    return out


def ranking_stable_since(kimgs: Sequence[float], values: np.ndarray) -> float | None:
    """The earliest time from which the order of the configs no longer changes.

    `values[i, t]` is config i's metric at `kimgs[t]` (lower is better). Returns the
    first kimg whose ranking equals the final one and stays equal at every later time,
    or None with fewer than two times."""
    if len(kimgs) < 2:
        return None
    orders = [tuple(np.argsort(values[:, t], kind="stable")) for t in range(len(kimgs))]
    t = len(orders) - 1
    while t > 0 and orders[t - 1] == orders[-1]:
        t -= 1
    return float(kimgs[t])


def _smooth(y: np.ndarray, n: int) -> np.ndarray:
    """Trailing mean over up to `n` points (a noisy training loss, one value per status)."""
    c = np.cumsum(np.insert(np.asarray(y, np.float64), 0, 0.0))
    i = np.arange(1, len(y) + 1)
    lo = np.maximum(0, i - n)
    return (c[i] - c[lo]) / (i - lo)


def _read_sweeps(workdir: str) -> list[dict]:
    """The rows of the newest-kimg post-hoc EMA sweep CSVs (`sweep-<kimg>-<metric>.csv`
    in `WORKDIR/phema*/`, e.g. a first sweep and an extension of its range), merged by
    sigma_rel (a later file wins); [] when there is none."""
    found = []
    for d in sorted(n for n in (paths.listdir(workdir) if paths.isdir(workdir) else [])
                    if n.startswith("phema")):
        d = os.path.join(workdir, d)
        if paths.isdir(d):
            found += [os.path.join(d, n) for n in paths.listdir(d)
                      if n.startswith("sweep-") and n.endswith(".csv")]
    if not found:
        return []
    newest = max(os.path.basename(f).split("-")[1] for f in found)  # zero-padded kimg
    rows: dict[float, dict] = {}
    for f in sorted(f for f in found if os.path.basename(f).split("-")[1] == newest):
        with paths.open(f) as fh:
            rows.update({float(r["sigma_rel"]): r for r in csv.DictReader(fh)})
    return [rows[k] for k in sorted(rows)]


def compare_runs(workdirs: Sequence[str], labels: Sequence[str] | None = None,
                 out: str | None = None, act_sigma: float = 1.0, smooth: int = 4) -> list[dict]:
    """Compare training runs (e.g. the ablation's configs C-G) from their stats.jsonl.

    Per run: the training loss and weighted MSE (trailing mean of the last `smooth`
    status lines), the probe weighted MSE at the last diagnostics record (mean over the
    probe sigmas, and at sigma = 1; `probe_wmse`), the mean activation RMS of the encoder
    and decoder blocks at `act_sigma` (first -> last record, and the largest block at any
    time), and, where the run holds them, the post-hoc EMA sweep (`phema/sweep-*.csv`:
    best sigma_rel) and the final evaluation (`eval.jsonl`: fd_cls, kid_cls,
    precision/recall, fid<N>). Also `stable_since`: the kimg from which the order of the
    runs by probe weighted MSE (and by smoothed training weighted MSE) stops changing
    (`ranking_stable_since`). With `out`, draws the curves (both weighted MSEs and the
    mean activation RMS per side vs kimg, one line per run) to that PNG.
    Returns one dict per run. Raises ValueError when a run has no diagnostics."""
    labels = list(labels) if labels else [os.path.basename(os.path.normpath(w)) for w in workdirs]
    tag = sigma_tag(act_sigma)
    rows, curves = [], []
    for w, label in zip(workdirs, labels):
        recs = stats.read_stats(w)
        diag = [r for r in recs if any(k.startswith("diag/loss/") for k in r)]
        train = [r for r in recs if "loss/weighted_mse" in r]
        if not diag or not train:
            raise ValueError(f"{w}: no diagnostics or no status lines in stats.jsonl; train "
                             f"with --config.diagnostics.enabled=True")
        pk = np.array([r["kimg"] for r in diag])
        pw = [probe_wmse(r) for r in diag]
        probe = np.array([np.mean(list(p.values())) for p in pw])
        tk = np.array([r["kimg"] for r in train])
        twmse = _smooth(np.array([r["loss/weighted_mse"] for r in train]), smooth)
        tloss = _smooth(np.array([r["loss/loss"] for r in train]), smooth)
        act = {}
        for side in ("enc", "dec"):
            keys = [k for k in diag[0] if k.startswith(f"diag/act/{tag}/{side}_")]
            if not keys:
                raise ValueError(f"{w}: no activations logged at sigma {act_sigma}")
            act[side] = np.array([np.mean([r[k] for k in keys]) for r in diag])
            act[side + "_max"] = max(r[k] for r in diag for k in keys)
        row = {"run": label, "workdir": w, "kimg": float(tk[-1]),
               "train_loss": float(tloss[-1]), "train_wmse": float(twmse[-1]),
               "probe_wmse": float(probe[-1]), "probe_wmse_s1": float(pw[-1].get(1.0, np.nan)),
               "act_enc": (float(act["enc"][0]), float(act["enc"][-1])), "act_enc_max": float(act["enc_max"]),
               "act_dec": (float(act["dec"][0]), float(act["dec"][-1])), "act_dec_max": float(act["dec_max"])}
        sweep = _read_sweeps(w)
        if sweep:
            metric = [k for k in sweep[0] if k not in ("sigma_rel", "kimg", "profile_error", "path")][0]
            best = min(sweep, key=lambda r: float(r[metric]))
            row.update(best_sigma_rel=float(best["sigma_rel"]), sweep_metric=metric,
                       sweep={float(r["sigma_rel"]): float(r[metric]) for r in sweep})
        ev = os.path.join(w, "eval.jsonl")
        if paths.isfile(ev):
            with paths.open(ev) as f:
                last = [json.loads(line) for line in f if line.strip()][-1]
            row["eval"] = {k: v for k, v in last.items()
                           if k.startswith(("fd_cls", "kid_cls", "precision_cls", "recall_cls", "fid", "num_images"))}
        rows.append(row)
        curves.append((label, tk, twmse, pk, probe, act["enc"], act["dec"]))
    # The order's stability, on the times every run logged.
    for name, col_k, col_v in (("probe", 3, 4), ("train", 1, 2)):
        common = sorted(set.intersection(*[set(np.round(c[col_k], 3)) for c in curves]))
        vals = np.array([[c[col_v][np.argmin(np.abs(c[col_k] - k))] for k in common] for c in curves])
        since = ranking_stable_since(common, vals)
        order = [labels[i] for i in np.argsort(vals[:, -1], kind="stable")] if common else []
        for r in rows:
            r[f"stable_since_{name}"], r[f"order_{name}"] = since, order
    if out:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
        for label, tk, twmse, pk, probe, enc, dec in curves:
            axes[0].plot(tk, twmse, label=label)
            axes[1].plot(pk, probe, marker=".", label=label)
            axes[2].plot(pk, enc, label=label)
            axes[3].plot(pk, dec, label=label)
        titles = (f"training weighted MSE (mean of {smooth} status lines)",
                  "probe weighted MSE (fixed images and noise)",
                  f"mean activation RMS, encoder (sigma={act_sigma:g})",
                  f"mean activation RMS, decoder (sigma={act_sigma:g})")
        for ax, t in zip(axes, titles):
            ax.set(xlabel="kimg", title=t)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0].set_yscale("log")
        axes[1].set_yscale("log")
        fig.tight_layout()
        with paths.open(out, "wb") as f:
            fig.savefig(f, dpi=64, format="png")
        plt.close(fig)
    return rows


def format_table(rows: list[dict]) -> str:
    """`compare_runs`' rows as a Markdown table (missing entries as '-')."""
    def num(v, fmt="{:.3f}"):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)
    lines = ["| run | kimg | train loss | train wMSE | probe wMSE | probe wMSE, sigma=1 | "
             "act. RMS encoder | act. RMS decoder | best sigma_rel | fd_cls | kid_cls | "
             "prec. / rec. | FID-N |",
             "|" + "---|" * 13]
    for r in rows:
        ev = r.get("eval", {})
        fid = [(k, v) for k, v in ev.items() if k.startswith("fid")]
        lines.append(
            f"| {r['run']} | {r['kimg']:g} | {num(r['train_loss'])} | {num(r['train_wmse'])} | "
            f"{num(r['probe_wmse'])} | {num(r['probe_wmse_s1'])} | "
            f"{r['act_enc'][0]:.2f} -> {r['act_enc'][1]:.2f} (max {r['act_enc_max']:.2f}) | "
            f"{r['act_dec'][0]:.2f} -> {r['act_dec'][1]:.2f} (max {r['act_dec_max']:.2f}) | "
            f"{num(r.get('best_sigma_rel'), '{:g}')} | {num(ev.get('fd_cls'), '{:.2f}')} | "
            f"{num(ev.get('kid_cls'), '{:.3f}')} | "
            f"{num(ev.get('precision_cls'), '{:.2f}')} / {num(ev.get('recall_cls'), '{:.3f}')} | "
            + (f"{fid[0][1]:.1f} ({fid[0][0]})" if fid else "-") + " |")
    r = rows[0]
    lines.append("")
    lines.append(f"Order by probe wMSE at the end: {' < '.join(r['order_probe'])} "
                 f"(unchanged since {num(r['stable_since_probe'], '{:g}')} kimg); by training "
                 f"wMSE: {' < '.join(r['order_train'])} (since {num(r['stable_since_train'], '{:g}')} kimg).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edm2_jax.analysis.diagnostics",
                                description="Plot a run's training-dynamics diagnostics.")
    p.add_argument("workdir", nargs="+",
                   help="a training run trained with --config.diagnostics.enabled=True "
                        "(several with --compare)")
    p.add_argument("--out", default=None, help="PNG path (default WORKDIR/diagnostics.png; "
                                               "with --compare: no plot unless given)")
    p.add_argument("--act_sigma", type=float, default=None,
                   help="the sigma of the activation panels (default: the middle one logged; "
                        "1 with --compare)")
    p.add_argument("--title", default=None)
    p.add_argument("--compare", action="store_true",
                   help="compare the runs: a Markdown table (losses, probe wMSE, activations, "
                        "best sigma_rel and eval.jsonl metrics), the order's stability, and "
                        "the curves to --out")
    p.add_argument("--labels", default=None, help="--compare: comma list of run names")
    args = p.parse_args(argv)
    try:
        if args.compare:
            rows = compare_runs(args.workdir, args.labels.split(",") if args.labels else None,
                                args.out, 1.0 if args.act_sigma is None else args.act_sigma)
            print(format_table(rows))
            return 0
        if len(args.workdir) != 1:
            p.error("one workdir (or --compare)")
        path = plot_run(args.workdir[0], args.out, args.act_sigma, args.title)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
