"""Process setup for the entry points: `python -m edm2_jax.main` and the scripts in
`benchmarks/` call `setup_entry_point()` first, before JAX starts; nothing else in the
package changes the process (importing the library changes no environment variable).

Environment variables read here, before JAX starts (each measured on 2 cores of an AMD
EPYC, `benchmarks/README.md`):

- **`EDM2_JAX_XLA_DEFAULTS`** (default `1`; `0` = off). Adds
  `--xla_cpu_experimental_ynn_fusion_type=dot` to `XLA_FLAGS` unless it is there already:
  XLA:CPU runs its matmuls through YNNPACK fusions. The Fashion-MNIST training step 1.2x
  faster (60 -> 72 img/s, `python benchmarks/train_throughput.py`); float32 throughout,
  golden-parity tests unchanged. Only for jaxlib >= 0.10.2 (older ones do not know the
  flag and would refuse to start). Never combined with several CPU devices: with the
  batch split over 2 CPU devices, programs that run many network evaluations (the
  32-step sampler, a few training steps) give wrong rows, up to 0.4 in [-1, 1] on
  jaxlib 0.10.2, while one device is exact (`tests/test_sampling_devices.py`; measured
  with `benchmarks/repro_sampler_devices.py` of commit fe06f58). So the flag is left out
  when `XLA_FLAGS` or `EDM2_JAX_CPU_DEVICES` ask for more than one CPU device, and `auto`
  devices is 1 while the flag is in effect; a user's `XLA_FLAGS` holding both get a
  warning. Sampling-only modes (`--mode=generate`, `--mode=eval`) leave the flag out and
  use 2 devices, which is faster there (`SAMPLING_MODES`).
- **`EDM2_JAX_MALLOC`**: the host allocator. glibc serves XLA:CPU's per-step temporary
  buffer (all activations: 368 MB for the Fashion-MNIST step) with a fresh `mmap` each
  step, faulting in ~90,000 pages: 544-595 ms per step under glibc, 414-511 ms under
  tcmalloc (`python benchmarks/train_throughput.py` under each value; figures and why in
  `benchmarks/README.md`). Values: `tcmalloc` (LD_PRELOAD of Debian's
  `libtcmalloc-minimal4`, in the README's quick start; the lowest peak RSS in training),
  `thp` (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, glibc >= 2.35: 1 fault per 2 MiB),
  `arena` (GLIBC_TUNABLES=glibc.malloc.arena_max=2: glibc with 2 malloc arenas instead
  of 8 per core, so that what one thread frees another reuses), `auto` (default:
  `arena` for `--mode=phema`, tcmalloc where installed for every other mode, else thp),
  `off`. Post-hoc EMA allocates and frees 8 MiB chunks in TensorStore's reader threads,
  which tcmalloc keeps: 8 outputs from 16 snapshots of 2 EMAs peak at 16.7 parameter
  copies above the baseline under tcmalloc, 9.8 under glibc, 9.0 under `arena`, which
  takes glibc's CPU time (`python benchmarks/phema_memory.py`; `PHEMA_MODES`). glibc
  with `mmap_threshold=1048576` holds as little (8.9) but doubles the CPU time.
- **`EDM2_JAX_CPU_DEVICES`**: the CPU backend split into this many devices
  (`--xla_force_host_platform_device_count`), the step data-parallel over them
  (`training/sharding.py`): two streams of kernels fill the gaps one leaves on two
  cores; the same step up to float32 summation order. Values: `auto` (default) = 1
  while the YNN flag is in effect, else 2 where 2 or more cores are usable; a number
  (the YNN flag is then left out); `off`. Not applied when `XLA_FLAGS` set a device
  count. A batch the devices do not divide trains on fewer of them (`usable_devices`,
  asked by the training loop through `TrainingSetup`).
- **`JAX_PLATFORMS`**: set to `cpu` where libtpu is installed but this host has no TPU
  chip and no GPU (`platform_env`), when the user has not set it: JAX would otherwise
  start libtpu's backend, which prints its failure to find a TPU (host bounds, worker
  hostnames, an `E0000` line) on every command before falling back to the CPU it picks
  anyway. `--mode=plan` compiles for TPUs through libtpu all the same.
- **`EDM2_JAX_COMPILATION_CACHE`** (read once JAX is imported, `enable_compilation_cache`):
  the persistent XLA cache directory, default `~/.cache/edm2_jax/xla`; `off` = none.

The allocator and the device count must be in place before the process starts, so
`reexec()` restarts it once (same PID, same command line) with them.

This module sets the process up; how it ends (Orbax's background noise summarised in one
line, an exit bounded in time) is `process_exit.py`'s.
"""
from __future__ import annotations

import ctypes.util
import os
import platform
import sys
from importlib import metadata
from typing import Callable

MALLOC_ENV = "EDM2_JAX_MALLOC"
DEVICES_ENV = "EDM2_JAX_CPU_DEVICES"
XLA_DEFAULTS_ENV = "EDM2_JAX_XLA_DEFAULTS"
CACHE_ENV = "EDM2_JAX_COMPILATION_CACHE"
MALLOC_MODES = ("auto", "tcmalloc", "thp", "arena", "off")
APPLIED = "EDM2_JAX_CPU_ENV_APPLIED"  # set in the re-executed process: never loop
DEVICES_SET = "EDM2_JAX_CPU_DEVICES_SET"  # the device count reexec() chose
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type=dot"
TCMALLOC = "tcmalloc_minimal"
THP_TUNABLE = "glibc.malloc.hugetlb=1"
ARENA_TUNABLE = "glibc.malloc.arena_max=2"


def setup_entry_point(argv: list[str] | None = None) -> None:
    """Call first in a `__main__`, before JAX starts: the default XLA flags
    (`add_default_xla_flags`), then the allocator and CPU devices (`reexec`, which may
    replace the process with itself). Bad settings end the process with one `error:`
    line (exit status 1)."""
    try:
        if ynn_for_command(sys.orig_argv if argv is None else argv):
            add_default_xla_flags()
        if warning := ynn_with_devices_warning():
            print(warning, file=sys.stderr, flush=True)
        os.environ.update(platform_env())
        reexec(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


# --------------------------------------------------------------------------------------
# XLA flags

# Modes that only sample (no training step): on 2 cores they run faster split over 2 CPU
# devices without the YNN flag than on one device with it (the Heun sampler, 100 images,
# 32 steps: 12.7 vs 10.9 img/s, `python benchmarks/compare_release.py --work=sample`);
# training the other way round (176 vs 161 img/s, `--work=train`).
SAMPLING_MODES = ("generate", "eval")
# Modes whose peak memory is the host allocator's: `auto` gives them `arena` (module doc).
PHEMA_MODES = ("phema",)


def command_mode(argv: list[str]) -> str | None:
    """The `--mode` of command line `argv` (`--mode=X` or `--mode X`), None without one."""
    mode = next((a.split("=", 1)[1] for a in argv if a.startswith("--mode=")), None)
    if mode is None and "--mode" in argv and argv.index("--mode") + 1 < len(argv):
        mode = argv[argv.index("--mode") + 1]
    return mode


def ynn_for_command(argv: list[str], environ: dict | None = None) -> bool:
    """Whether the entry point adds the YNN flag for command line `argv`: not for a
    `--mode` in `SAMPLING_MODES` unless `$EDM2_JAX_XLA_DEFAULTS` or
    `$EDM2_JAX_CPU_DEVICES` is set (then `default_xla_flags` decides as for any mode)."""
    env = os.environ if environ is None else environ
    return (command_mode(argv) not in SAMPLING_MODES or XLA_DEFAULTS_ENV in env
            or DEVICES_ENV in env)


def default_xla_flags(environ: dict | None = None) -> dict[str, str]:
    """`{'XLA_FLAGS': ...}` with `YNN_FLAG` added (see module doc), or `{}` when
    `$EDM2_JAX_XLA_DEFAULTS` is `0`, the user's `XLA_FLAGS` already choose the fusion
    type, or jaxlib is older than 0.10.2 (or its version is unknown)."""
    env = os.environ if environ is None else environ
    if env.get(XLA_DEFAULTS_ENV, "1") == "0":
        return {}
    flags = env.get("XLA_FLAGS", "")
    if "xla_cpu_experimental_ynn_fusion_type" in flags or _jaxlib_version() < (0, 10, 2):
        return {}
    asked = (env.get(DEVICES_ENV, "") or "").strip()  # a number, or auto/off/unset
    if (flag_device_count(flags) or (int(asked) if asked.isdigit() else 0)) > 1:
        return {}  # wrong results with several CPU devices (module doc)
    return {"XLA_FLAGS": f"{flags} {YNN_FLAG}".strip()}


def flag_device_count(flags: str) -> int:
    """The CPU device count `flags` (an `XLA_FLAGS` value) sets, 0 when none."""
    for part in flags.split():
        if part.startswith(DEVICE_COUNT_FLAG + "="):
            value = part.split("=", 1)[1]
            return int(value) if value.isdigit() else 0
    return 0


def ynn_with_devices_warning(environ: dict | None = None) -> str | None:
    """A warning line when `XLA_FLAGS` hold both the YNN fusion flag and more than one
    CPU device (wrong results; module doc), else None."""
    flags = (os.environ if environ is None else environ).get("XLA_FLAGS", "")
    if YNN_FLAG in flags and flag_device_count(flags) > 1:
        return (f"warning: XLA_FLAGS hold {YNN_FLAG} and {flag_device_count(flags)} CPU "
                f"devices, which give wrong sampled images and training updates on "
                f"jaxlib 0.10.2; drop one of them (edm2_jax/process.py)")
    return None


def _jaxlib_version() -> tuple[int, ...]:
    """jaxlib's version (read without importing it), `()` when unknown."""
    try:
        return tuple(int(p) for p in metadata.version("jaxlib").split(".")[:3])
    except Exception:  # not installed as a distribution, or an unusual version string
        return ()


def add_default_xla_flags() -> None:
    """Set `default_xla_flags()` in this process's environment (JAX reads `XLA_FLAGS`
    when its backend starts)."""
    os.environ.update(default_xla_flags())


def enable_compilation_cache() -> None:
    """Persistent XLA cache: a resumed or repeated run skips its compiles. Directory
    `$EDM2_JAX_COMPILATION_CACHE` (`off` = none), default `~/.cache/edm2_jax/xla`; a
    cache directory already configured (e.g. `JAX_COMPILATION_CACHE_DIR`) is kept."""
    import jax  # here, not at the top: the settings above come before JAX is imported

    path = os.environ.get(CACHE_ENV,
                          os.path.join(os.path.expanduser("~"), ".cache", "edm2_jax", "xla"))
    if path != "off" and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)


# PCI ids of the TPU chips and the device files of GPUs, as JAX looks for them
# (jax/_src/hardware_utils.py); read here because JAX must not be imported yet.
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")
GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def has_tpu_chip(pci_root: str = "/sys/bus/pci/devices") -> bool:
    """Whether a TPU chip is attached to this host (a Google PCI device of a TPU id)."""
    def read(path):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return ""
    try:
        names = os.listdir(pci_root)
    except OSError:
        return False
    return any(read(os.path.join(pci_root, n, "vendor")) == GOOGLE_PCI_VENDOR
               and read(os.path.join(pci_root, n, "device")) in TPU_PCI_DEVICES for n in names)


def platform_env(environ: dict | None = None, libtpu: bool | None = None,
                 tpu_chip: bool | None = None, gpu: bool | None = None) -> dict[str, str]:
    """`{'JAX_PLATFORMS': 'cpu'}` where libtpu is installed (`libtpu`; default: the
    `libtpu` package is importable) but this host has neither a TPU chip (`tpu_chip`,
    default `has_tpu_chip()`) nor a GPU (`gpu`, default: a device file of one), and
    `environ` (default `os.environ`) sets no `JAX_PLATFORMS`; else `{}` (module doc)."""
    env = os.environ if environ is None else environ
    if "JAX_PLATFORMS" in env:
        return {}
    if libtpu is None:
        import importlib.util
        libtpu = importlib.util.find_spec("libtpu") is not None
    if not libtpu:
        return {}
    tpu_chip = has_tpu_chip() if tpu_chip is None else tpu_chip
    gpu = any(os.path.exists(d) for d in GPU_DEVICE_FILES) if gpu is None else gpu
    return {} if tpu_chip or gpu else {"JAX_PLATFORMS": "cpu"}


# --------------------------------------------------------------------------------------
# Host allocator and CPU devices


def malloc_mode(environ: dict | None = None, argv: list[str] | None = None) -> str:
    """`$EDM2_JAX_MALLOC` (default 'auto'), with 'auto' made 'arena' for a `--mode` of
    `PHEMA_MODES` in command line `argv` (default `sys.orig_argv`). Raises ValueError
    for another value."""
    env = os.environ if environ is None else environ
    m = (env.get(MALLOC_ENV, "auto") or "auto").strip().lower()
    if m not in MALLOC_MODES:
        raise ValueError(f"{MALLOC_ENV}={m!r}: expected one of {', '.join(MALLOC_MODES)}")
    if m == "auto" and command_mode(sys.orig_argv if argv is None else argv) in PHEMA_MODES:
        return "arena"
    return m


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_devices(environ: dict | None = None, cores: int | None = None) -> int:
    """The CPU device count `$EDM2_JAX_CPU_DEVICES` asks for: 'auto' (default) = 1
    when `XLA_FLAGS` hold the YNN fusion flag, else `min(2, cores)` (`cores`: those
    this process may run on); 'off' = 1, or a number >= 1. Raises ValueError for
    anything else."""
    env = os.environ if environ is None else environ
    v = (env.get(DEVICES_ENV, "auto") or "auto").strip().lower()
    if v == "auto":
        if YNN_FLAG in env.get("XLA_FLAGS", ""):
            return 1  # the YNN fusion flag and several CPU devices: wrong results
        return min(2, _usable_cores() if cores is None else cores)
    if v == "off":
        return 1
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"{DEVICES_ENV}={v!r}: expected 'auto', 'off' or a device count >= 1")
    return int(v)


def _glibc_linux() -> bool:
    return sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def malloc_in_effect(environ: dict | None = None) -> str:
    """The allocator a process with `environ` (default `os.environ`) was started with:
    'tcmalloc', 'thp', 'arena' or 'glibc'."""
    env = os.environ if environ is None else environ
    if TCMALLOC in env.get("LD_PRELOAD", ""):
        return "tcmalloc"
    if THP_TUNABLE in env.get("GLIBC_TUNABLES", ""):
        return "thp"
    if ARENA_TUNABLE in env.get("GLIBC_TUNABLES", ""):
        return "arena"
    return "glibc"


def launch_env(environ: dict | None = None, cores: int | None = None,
               argv: list[str] | None = None) -> dict[str, str]:
    """The environment variables to add or change, given `environ` (default
    `os.environ`) and command line `argv` (default `sys.orig_argv`): the allocator of
    `malloc_mode` (only on Linux with glibc, and only
    when none of ours is in effect) and the device count of `cpu_devices` (only when
    `XLA_FLAGS` sets none and it is > 1). Empty when nothing needs to change.
    Raises ValueError for bad settings, FileNotFoundError for `tcmalloc` where
    libtcmalloc_minimal is not installed."""
    env = os.environ if environ is None else environ
    add: dict[str, str] = {}
    m = malloc_mode(env, argv)
    if m != "off" and _glibc_linux() and malloc_in_effect(env) == "glibc":
        so = ctypes.util.find_library(TCMALLOC) if m in ("auto", "tcmalloc") else None
        if so:
            pre = env.get("LD_PRELOAD", "")
            add["LD_PRELOAD"] = f"{pre}:{so}" if pre else so
            # tcmalloc reports each allocation over 1 GiB on stderr by default.
            add["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] = str(1 << 40)
        elif m == "tcmalloc":
            raise FileNotFoundError(f"{MALLOC_ENV}=tcmalloc: libtcmalloc_minimal is not "
                                    f"installed; apt-get install libtcmalloc-minimal4, or set "
                                    f"{MALLOC_ENV}=thp (glibc huge pages) or {MALLOC_ENV}=off")
        else:
            tunable = ARENA_TUNABLE if m == "arena" else THP_TUNABLE
            tun = env.get("GLIBC_TUNABLES", "")
            add["GLIBC_TUNABLES"] = f"{tun}:{tunable}" if tun else tunable
    n = cpu_devices(env, cores)
    flags = env.get("XLA_FLAGS", "")
    if n > 1 and DEVICE_COUNT_FLAG not in flags:
        add["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={n}".strip()
        add[DEVICES_SET] = str(n)
    return add


def describe(environ: dict | None = None) -> str:
    """One line for logs: the allocator and the device count this process runs with."""
    env = os.environ if environ is None else environ
    n = env.get(DEVICES_SET)
    flags = env.get("XLA_FLAGS", "")
    if n:
        dev = f"{n} CPU devices (${DEVICES_ENV})"
    elif YNN_FLAG in flags and not flag_device_count(flags):
        dev = f"1 CPU device with YNN fusions (${XLA_DEFAULTS_ENV})"
    else:
        dev = "CPU devices as XLA_FLAGS / JAX set them"
    return f"host allocator {malloc_in_effect(env)} (${MALLOC_ENV}), {dev}; edm2_jax/process.py"


def usable_devices(batch_size: int, num_devices: int, fits: Callable[[int], bool]) -> int:
    """How many of the `num_devices` devices to train on: all of them unless the device
    count is the one `reexec()` chose (`$EDM2_JAX_CPU_DEVICES_SET`, not the user's) and
    the batch does not split over them; then the most that `fits(d)` (True when a batch
    of `batch_size` splits over `d` devices) accepts, at least 1."""
    if os.environ.get(DEVICES_SET) != str(num_devices) or fits(num_devices):
        return num_devices
    return next((d for d in range(num_devices - 1, 0, -1) if fits(d)), 1)


def reexec(argv: list[str] | None = None) -> None:
    """Replace this process with itself under `launch_env()` (see module doc), once: the
    same PID (signals and job schedulers see no change), the same command line (`argv`,
    default `sys.orig_argv`). Where only `XLA_FLAGS` changes, it is set in this process
    instead (JAX reads it when its backend starts). Returns without doing anything when
    nothing needs to change or this process is already the re-executed one. Call it
    first in a `__main__`, before JAX starts. Raises what `launch_env` raises."""
    if os.environ.get(APPLIED):
        return
    add = launch_env(argv=argv)
    if not add:
        return
    if set(add) <= {"XLA_FLAGS", DEVICES_SET}:
        os.environ.update(add)
        return
    env = dict(os.environ, **add, **{APPLIED: "1"})
    argv = list(sys.orig_argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)


class TrainingSetup:
    """What the training loop asks the entry point once JAX has started (after
    `jax.distributed` is set up): `training.loop.train_and_evaluate(..., setup=...)`."""

    def num_devices(self, batch_size: int, fits: Callable[[int], bool]) -> int:
        """How many of JAX's devices to train on (`usable_devices`)."""
        import jax
        return usable_devices(batch_size, jax.device_count(), fits)

    def log_line(self) -> str | None:
        """The line the run prints about this process: on the CPU backend, `describe()`."""
        import jax
        return f"CPU: {describe()}" if jax.default_backend() == "cpu" else None
