#!/usr/bin/env bash
# Train on a TPU VM pod slice: the same command on every worker; each is one JAX
# process and jax.distributed.initialize() finds its peers from the TPU metadata.
#
#   launch/tpu_pod.sh --tpu=my-v5p-64 --zone=us-east5-a --config=configs/img64.py:m \
#       --workdir=gs://bucket/runs/img64-m [--repo_dir=edm2-jax] [--skip-install] [--dry-run] \
#       [--type=v5p-64] [-- --config.total_kimg=1000]
#
# --dry-run prints the commands instead of running them; with --type (the slice's
# accelerator type, e.g. v5p-64, v5e-16) it also compiles the run's training step for that
# slice here and says whether it fits and how fast it can go at best
# (`python -m edm2_jax.main --mode=plan`, which needs libtpu: pip install -e ".[tpu]").
#
# Install step (skipped with --skip-install, for a VM image that already has it): this
# checkout's committed tree (git archive HEAD) is copied to every worker, unpacked over
# ~/REPO_DIR (nothing there is deleted) and installed with `pip install -e` together with jax[tpu] (libtpu),
# with the `gcs` extra (gcsfs) for a gs:// workdir. An image for --skip-install needs the same:
# `pip install 'jax[tpu]' -e 'REPO_DIR[gcs]'`.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/common.sh
. launch/common.sh

TPU="" ZONE="" PROJECT="" CONFIG="" WORKDIR="" REPO_DIR="edm2-jax" TYPE=""  # REPO_DIR: relative to the remote home
DRY_RUN=0 INSTALL=1 EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tpu=*) TPU="${1#*=}" ;;
    --type=*) TYPE="${1#*=}" ;;
    --zone=*) ZONE="${1#*=}" ;;
    --project=*) PROJECT="${1#*=}" ;;
    --config=*) CONFIG="${1#*=}" ;;
    --workdir=*) WORKDIR="${1#*=}" ;;
    --repo_dir=*) REPO_DIR="${1#*=}" ;;
    --dry-run) DRY_RUN=1 ;;
    --skip-install) INSTALL=0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown argument $1 (see the header of $0)" ;;
  esac
  shift
done
export DRY_RUN
[ -n "$TPU" ] || die "--tpu=NAME is required"
[ -n "$ZONE" ] || die "--zone=ZONE is required"
check_config "$CONFIG"
check_workdir "$WORKDIR"
case "$WORKDIR" in gs://*) ;; *) echo "warning: $WORKDIR is not a gs:// path; every worker must see the same directory" >&2 ;; esac
if [ "$DRY_RUN" != 1 ]; then command -v gcloud >/dev/null || die "gcloud not found (install the Google Cloud SDK)"; fi

[ "$DRY_RUN" != 1 ] || { network_dtype "$CONFIG" "${EXTRA[@]}"; compilation_cache "on each worker"; }
# The workers keep their compiled programs where this shell's EDM2_JAX_COMPILATION_CACHE
# says (default: each worker's ~/.cache/edm2_jax/xla).
cache_env="${EDM2_JAX_COMPILATION_CACHE:+EDM2_JAX_COMPILATION_CACHE=$(printf '%q' "$EDM2_JAX_COMPILATION_CACHE") }"
remote="cd $REPO_DIR && ${cache_env}python -m edm2_jax.main --config=$CONFIG --workdir=$WORKDIR"
for arg in "${EXTRA[@]}"; do remote+=" $(printf '%q' "$arg")"; done
project_flag=()
[ -n "$PROJECT" ] && project_flag=(--project="$PROJECT")
if [ "$INSTALL" = 1 ]; then
  git rev-parse --git-dir >/dev/null 2>&1 \
    || die "the install step copies this git checkout (git archive HEAD); run from one, or pass --skip-install"
  tarball="${TMPDIR:-/tmp}/edm2-jax-$$.tar.gz"
  run git archive --format=tar.gz -o "$tarball" HEAD
  run gcloud compute tpus tpu-vm scp "$tarball" "$TPU:edm2-jax.tar.gz" --zone="$ZONE" \
    "${project_flag[@]}" --worker=all
  install="mkdir -p $REPO_DIR && tar xzf edm2-jax.tar.gz -C $REPO_DIR"  # overwrites, deletes nothing
  extras=""  # gs:// workdirs need gcsfs (edm2_jax/paths.py): the package's gcs extra
  case "$WORKDIR" in gs://*) extras="'[gcs]'" ;; esac
  install+=" && python -m pip install -q -U 'jax[tpu]' -e ./$REPO_DIR$extras"
  run gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" "${project_flag[@]}" --worker=all \
    --command="$install"
fi
run gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" "${project_flag[@]}" --worker=all --command="$remote"
if [ "$DRY_RUN" = 1 ]; then
  if [ -n "$TYPE" ]; then
    python -m edm2_jax.main --mode=plan --config="$CONFIG" --tpu="$TYPE" "${EXTRA[@]}"
  else
    echo "(--type=ACCELERATOR_TYPE, e.g. --type=v5p-64, also checks that the run fits the slice: --mode=plan)"
  fi
fi
