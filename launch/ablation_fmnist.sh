#!/usr/bin/env bash
# The small-scale ablation of docs/ablation.md: configs C-G (configs/ablation.py) on
# Fashion-MNIST at one budget, each with its post-hoc EMA at the best sigma_rel of one
# sweep, then the classifier metrics and FID-N of that EMA on the same N images.
#
#   bash launch/ablation_fmnist.sh                 # all five letters, runs/abl32-<letter>
#   KIMG=16 LETTERS="c g" bash launch/ablation_fmnist.sh
#
# Environment (defaults): KIMG=32 (training budget per config), SWEEP="0.03,0.05,0.075,0.1,0.15,0.2"
# (sigma_rel), SWEEP_N=500 (images per sweep point, classifier FD), EVAL_N=1000 (images of
# the final evaluation: fd_cls/kid/precision/recall and fid<EVAL_N>), LETTERS="c d e f g",
# RUNS=runs, BASE= (configs/ablation.py's base: empty = the Fashion-MNIST network, `tiny`
# for a seconds-long smoke run). Each step is skipped when its output exists, so a rerun
# resumes. Then `python -m edm2_jax.analysis.diagnostics --compare RUNS/abl<KIMG>-{c,d,e,f,g}`
# prints the table (docs/ablation.md).
# Writes RUNS/abl<KIMG>-<L>/{stats.jsonl,diagnostics.png,phema/sweep-*.csv,eval.jsonl}.
set -euo pipefail

KIMG=${KIMG:-32}
SWEEP=${SWEEP:-0.03,0.05,0.075,0.1,0.15,0.2}
SWEEP_N=${SWEEP_N:-500}
EVAL_N=${EVAL_N:-1000}
LETTERS=${LETTERS:-c d e f g}
RUNS=${RUNS:-runs}
BASE=${BASE:-}
PY=${PYTHON:-python}

ref="$RUNS/fmnist-test-fid${EVAL_N}.pkl"
if [[ ! -f $ref ]]; then
  # Inception statistics of EVAL_N test images, shared by every config's FID-N.
  "$PY" -m edm2_jax.main --mode=ref --config=configs/fashion_mnist.py --metrics=fid \
      --num_images="$EVAL_N" --ref="$ref"
fi

for L in $LETTERS; do
  run="$RUNS/abl$KIMG-$L"
  cfg="configs/ablation.py:$L${BASE:+,$BASE}"
  echo "=== config ${L^^}: $run"
  # Training (resumes from the last checkpoint; a finished run returns at once).
  "$PY" -m edm2_jax.main --config="$cfg" --workdir="$run" \
      --config.total_kimg="$KIMG" --config.status_kimg=1 --config.snapshot_kimg=4 \
      --config.checkpoint_kimg=8 --config.diagnostics.enabled=True
  "$PY" -m edm2_jax.analysis.diagnostics "$run" --out="$run/diagnostics.png" --title="config ${L^^}, $KIMG kimg"
  # One post-hoc EMA sweep (classifier FD of SWEEP_N images per sigma_rel).
  csv=$(find "$run/phema" -name "sweep-*-fd_cls.csv" 2>/dev/null | sort | tail -n 1 || true)
  if [[ -z $csv ]]; then
    "$PY" -m edm2_jax.main --mode=phema_sweep --workdir="$run" --config="$cfg" \
        --sigma_rel="$SWEEP" --metrics=cls --num_images="$SWEEP_N" --batch=100 \
        --outdir="$run/phema"
    csv=$(find "$run/phema" -name "sweep-*-fd_cls.csv" | sort | tail -n 1)
  fi
  best=$("$PY" -c "import csv,sys; r=min(csv.DictReader(open(sys.argv[1])), key=lambda r: float(r['fd_cls'])); print(r['path'])" "$csv")
  # The best EMA: classifier metrics and FID-N of EVAL_N images.
  if [[ ! -f $run/eval.jsonl ]]; then
    "$PY" -m edm2_jax.main --mode=eval --net="$best" --config="$cfg" --metrics=cls,fid \
        --num_images="$EVAL_N" --ref="$ref" --batch=100 --out_json="$run/eval.jsonl"
  fi
done
