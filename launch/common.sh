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

# network_dtype CONFIG [OVERRIDES...]: print the compute dtype a run of CONFIG
# (FILE.py[:VARIANT]) with the trainer's OVERRIDES trains in: the last
# --config.network.dtype= of OVERRIDES, else the config file's (read with Python). 'auto'
# (the img64/img512 presets) is resolved by the trainer at start-up
# (edm2_jax/configs.py resolve_dtype).
network_dtype() {
  local config="$1" dtype="" arg
  shift
  for arg in "$@"; do
    case "$arg" in --config.network.dtype=*) dtype="${arg#*=}" ;; esac
  done
  if [ -z "$dtype" ]; then
    dtype=$(python -c 'import importlib.util, sys
path, _, variant = sys.argv[1].partition(":")
spec = importlib.util.spec_from_file_location("config", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print((module.get_config(variant) if variant else module.get_config()).network.dtype)' \
      "$config" 2>/dev/null) || dtype="the config's (python here cannot load $config)"
  fi
  case "$dtype" in
    auto) echo "network.dtype: auto (bfloat16 on GPU/TPU, float32 on CPU; a resumed run keeps its own)" ;;
    *) echo "network.dtype: $dtype" ;;
  esac
}
