#!/usr/bin/env bash
# Shared helpers of the launch scripts (sourced, not run).

die() { echo "error: $*" >&2; exit 2; }

# run CMD...: print the command; execute it unless DRY_RUN=1.
run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [ "${DRY_RUN:-0}" != 1 ]; then "$@"; fi
}

check_config() {
  local cfg="${1%%:*}"
  [ -n "$1" ] || die "--config is required (e.g. configs/img64.py:s)"
  [ -f "$cfg" ] || die "config file $cfg not found (run from the repository root)"
}

check_workdir() {
  [ -n "$1" ] || die "--workdir is required (a directory every host can reach: gs://..., NFS or Lustre)"
}
