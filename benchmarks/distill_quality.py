"""Few-step students of a Fashion-MNIST teacher: distil, measure, draw
(docs/distillation.md's table and figure).

    # the quick start's run (64 kimg, EMA sigma_rel 0.10) as teacher; ~1.5 h on 2 cores
    python benchmarks/distill_quality.py --teacher=runs/fmnist --workdir=runs/distill \
        --out=docs/distillation_table.md --figure=docs/distillation_grids.png
    # distribution-matching (DMD2) students at 1 and 2 steps, the student rows only
    python benchmarks/distill_quality.py --teacher=runs/fmnist --workdir=runs/dmd \
        --variant=dmd --steps=1,2 --kimg=32 --heun_steps=32 --metrics=cls

For each `--steps` K it runs `configs/distill.py` with `--config.distill.steps=K` for
`--kimg` (a run like any other: resumable, re-running this script skips what is done),
then evaluates with `--mode=eval` (`--num_images` images of seeds 0.., `--metrics`
against the test split, the classifier of `_cls` shared by all rows):

  student K        the student's few-step sampler, K evaluations;
  teacher, DDIM K  the teacher with the same sampler (DDIM on the same K segments of its
                   grid): the teacher at the students' number of evaluations;
  teacher, Heun N  the teacher's EDM sampler, 2N - 1 evaluations (`--heun_steps`; N = 32
                   is its own setting, 63 evaluations).

Every evaluation appends a JSON line to WORKDIR/results.jsonl; a row there already is not
measured again. The table gives fd_cls, FID-`num_images` (where measured), the network
evaluations, and the distillation's cost (kimg, wall seconds of its training steps from
stats.jsonl). The figure puts the last sample grid of each student (one class per
column, the grid seeds of the run) beside the teacher's at 32 Heun steps.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(args: list[str], log: str) -> None:
    """Run `python -m edm2_jax.main ARGS`, its output to `log`; raise on failure."""
    cmd = [sys.executable, "-m", "edm2_jax.main", *args]
    print("  $ " + " ".join(cmd[1:]), flush=True)
    with open(log, "a") as f:
        if subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=os.getcwd()):
            raise SystemExit(f"error: the command above failed; see {log}")


def results(path: str) -> dict:
    out = {}
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            out[r["row"]] = r
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", required=True, help="the teacher (a run, e.g. runs/fmnist)")
    p.add_argument("--workdir", required=True, help="students' runs, results.jsonl, logs")
    p.add_argument("--steps", default="1,2,4,8", help="students' step counts")
    p.add_argument("--kimg", type=float, default=16.0, help="distillation length per student")
    p.add_argument("--variant", default="",
                   help="configs/distill.py variant of the students ('dmd': distribution "
                        "matching; default the consistency students)")
    p.add_argument("--heun_steps", default="32,2,4", help="teacher Heun rows (N steps)")
    p.add_argument("--num_images", type=int, default=2000)
    p.add_argument("--metrics", default="cls,fid", help="for students and teacher Heun 32")
    p.add_argument("--baseline_metrics", default="cls,fid",
                   help="for the other teacher rows (DDIM K, Heun N < 32)")
    p.add_argument("--config", default=os.path.join(REPO, "configs", "fashion_mnist.py"),
                   help="the data config of the evaluation")
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--figure", default=None, help="write the figure of grids here")
    a = p.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    steps = [int(k) for k in a.steps.split(",")]
    log = os.path.join(a.workdir, "log.txt")
    res_path = os.path.join(a.workdir, "results.jsonl")

    cost = {}
    for k in steps:
        run = os.path.join(a.workdir, f"k{k}")
        print(f"Student K={k}: {run}", flush=True)
        t = time.time()
        variant = f":{a.variant}" if a.variant else ""
        sh([f"--config={os.path.join(REPO, 'configs', 'distill.py')}{variant}", f"--workdir={run}",
            f"--config.distill.teacher={a.teacher}", f"--config.distill.steps={k}",
            f"--config.total_kimg={a.kimg}"], log)
        stats = [json.loads(line) for line in open(os.path.join(run, "stats.jsonl"))]
        cost[k] = dict(kimg=stats[-1]["kimg"], train_s=stats[-1]["time"],
                       img_per_s=sum(s["img_per_sec"] for s in stats[1:]) / max(len(stats) - 1, 1))
        print(f"  {cost[k]['kimg']:.3f} kimg, {cost[k]['train_s']:.0f} s of training "
              f"[{time.time() - t:.0f} s now]", flush=True)

    rows = []  # (row name, net, extra flags, metrics, evaluations)
    for n in [int(x) for x in a.heun_steps.split(",")]:
        rows.append((f"teacher, Heun {n}", a.teacher, ["--sampler=heun", f"--steps={n}"],
                     a.metrics if n == 32 else a.baseline_metrics, 2 * n - 1))
    for k in steps:
        rows.append((f"teacher, DDIM {k}", a.teacher, ["--sampler=few_step", f"--steps={k}"],
                     a.baseline_metrics, k))
        rows.append((f"student {k}", os.path.join(a.workdir, f"k{k}"), [], a.metrics, k))
    ref = []
    if "fid" in (a.metrics + "," + a.baseline_metrics).split(","):
        # One set of reference statistics for every row (the eval's own choice of test
        # images: a seeded subset of num_images), computed once.
        ref_path = os.path.join(a.workdir, f"fid_ref_{a.num_images}.npz")
        if not os.path.exists(ref_path):
            sh(["--mode=ref", f"--ref={ref_path}", f"--config={a.config}", "--metrics=fid",
                "--ref_split=test", f"--num_images={a.num_images}", "--batch=100"], log)
        ref = [f"--ref={ref_path}"]
    done = results(res_path)
    for name, net, extra, metrics, nfe in rows:
        if name in done and set(done[name]["metrics_asked"].split(",")) >= set(metrics.split(",")):
            continue
        print(f"Evaluating {name} ({nfe} evaluations): {metrics}", flush=True)
        tmp = os.path.join(a.workdir, "one.jsonl")
        if os.path.exists(tmp):
            os.remove(tmp)
        t = time.time()
        sh(["--mode=eval", f"--net={net}", f"--metrics={metrics}",
            f"--num_images={a.num_images}", f"--config={a.config}", "--batch=100",
            f"--out_json={tmp}", *(ref if "fid" in metrics else []), *extra], log)
        r = json.loads(open(tmp).read().splitlines()[-1])
        r.update(row=name, metrics_asked=metrics, evaluations=nfe, eval_wall_s=time.time() - t)
        with open(res_path, "a") as f:
            f.write(json.dumps(r) + "\n")
        os.remove(tmp)
    done = results(res_path)

    fid_key = "fid" if a.num_images == 50000 else f"fid{a.num_images}"

    def fmt(r, key, f="{:.2f}"):
        v = r.get(key)
        return f.format(v) if isinstance(v, (int, float)) else "–"

    lines = [f"| sampler | network evaluations | fd_cls | FID-{a.num_images} | distillation |",
             "|---|---|---|---|---|"]
    for name, _, _, _, nfe in rows:
        r = done[name]
        c = ""
        if name.startswith("student"):
            k = int(name.split()[-1])
            c = (f"{cost[k]['kimg']:.0f} kimg, {cost[k]['train_s'] / 60:.1f} min "
                 f"({cost[k]['img_per_s']:.0f} img/s)")
        lines.append(f"| {name} | {nfe} | {fmt(r, 'fd_cls')} | {fmt(r, fid_key, '{:.1f}')} | {c} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            f.write(table + "\n")
    if a.figure:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import PIL.Image

        def last_grid(run: str) -> str:
            d = os.path.join(run, "samples")
            return os.path.join(d, sorted(os.listdir(d))[-1])
        panels = [(f"teacher, Heun 32 steps (63 evaluations)", last_grid(a.teacher))]
        panels += [(f"student, {k} step{'s' if k > 1 else ''}",
                    last_grid(os.path.join(a.workdir, f"k{k}"))) for k in steps]
        fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.6))
        for ax, (title, path) in zip(axes, panels):
            ax.imshow(PIL.Image.open(path), cmap="gray")
            ax.set_title(title, fontsize=9)
            ax.axis("off")
        fig.tight_layout()
        fig.savefig(a.figure, dpi=110)
        print(f"Figure -> {a.figure}")


if __name__ == "__main__":
    main()
