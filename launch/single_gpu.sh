#!/usr/bin/env bash
# Train on one host with all its local GPUs (data parallel over a 1-D mesh).
#
#   launch/single_gpu.sh --config=configs/img64.py:xs --workdir=runs/img64-xs [--dry-run] [-- --config.batch_per_device=64]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/common.sh
. launch/common.sh

CONFIG="" WORKDIR="" DRY_RUN=0 EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --config=*) CONFIG="${1#*=}" ;;
    --workdir=*) WORKDIR="${1#*=}" ;;
    --dry-run) DRY_RUN=1 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown argument $1 (see the header of $0)" ;;
  esac
  shift
done
export DRY_RUN
check_config "$CONFIG"
check_workdir "$WORKDIR"

# Let XLA take most of the GPU memory up front, as is usual for training.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
[ "$DRY_RUN" != 1 ] || { network_dtype "$CONFIG" "${EXTRA[@]}"; compilation_cache "on this host"; }
run python -m edm2_jax.main --config="$CONFIG" --workdir="$WORKDIR" "${EXTRA[@]}"
