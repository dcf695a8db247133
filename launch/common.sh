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

# compilation_cache [WHERE]: print where the run keeps its compiled programs, the
# persistent XLA cache of edm2_jax/process.py ($EDM2_JAX_COMPILATION_CACHE, default
# ~/.cache/edm2_jax/xla; `off` = none). A resumed, requeued or repeated run of the same
# config and code loads its step from there in seconds instead of compiling it for
# minutes (img64-s, one H200: 8.1 s against 306 s; benchmarks/README.md).
compilation_cache() {
  local dir="${EDM2_JAX_COMPILATION_CACHE:-~/.cache/edm2_jax/xla}"
  if [ "$dir" = off ]; then
    echo "compilation cache: off (EDM2_JAX_COMPILATION_CACHE=off: every start compiles)"
  else
    echo "compilation cache: $dir${1:+ $1} (a resumed run compiles in seconds; EDM2_JAX_COMPILATION_CACHE)"
  fi
}
