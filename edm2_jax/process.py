"""The process settings our command-line entry points run the CPU backend under.

Two settings, each measured on 2 cores of an AMD EPYC (benchmarks/README.md, "Session
7"), each needing to be in place before the process (or JAX's CPU backend) starts, so
`reexec()` restarts the process once (same PID, same command line) with them:

1. **Host allocator** (`$EDM2_JAX_MALLOC`). XLA's CPU client allocates each execution's
   temporary buffer (all of a training step's activations: 368 MB for the Fashion-MNIST
   step at batch 64) with `posix_memalign` from a worker thread. glibc serves a block
   that large with a fresh `mmap` and unmaps it when the step ends (its mmap threshold
   cannot go above 32 MB, and a thread arena maps any block larger than its 64 MB heap),
   so every step faulted in and zeroed ~90,000 new 4 KiB pages: 545 -> ~445 ms per step
   once fixed, 90,000 -> under 3,000 faults per step. Values:
     `tcmalloc`  LD_PRELOAD=libtcmalloc_minimal.so.4 (Debian/Ubuntu `libtcmalloc-minimal4`,
                 in the README's quick start): keeps freed spans for reuse; the lowest
                 peak RSS (1.4-1.5 vs 1.8 GiB for that step);
     `thp`       GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc >= 2.35; older ones ignore
                 it): glibc's mapped blocks use transparent huge pages, 1 fault per 2 MiB;
     `auto`      (default) tcmalloc where it is installed, else thp;  `off`  unchanged.
2. **CPU devices** (`$EDM2_JAX_CPU_DEVICES`). The CPU backend is split into this many
   devices (`--xla_force_host_platform_device_count`) and the training step runs data-
   parallel over them (`sharding.py`, each device half the batch): two streams of
   operations keep both cores busy where one leaves gaps between XLA's kernels. The same
   step (mean gradient over the same batch, the same random draws) up to float32
   summation order. 465 -> 421 ms per step (Fashion-MNIST net, batch 64) and 2.78 ->
   2.52 s (the 9.8M-parameter ch64 net, batch 32). Values: `auto` (default) = 2 where
   the process may use 2 or more cores, else unchanged; a number; `off`. Not applied
   when `XLA_FLAGS` already sets the device count. A batch the devices do not divide
   trains on fewer of them (`usable_devices`).

Only `python -m edm2_jax.main` and the benchmarks re-exec; importing the package never
does. Neither setting changes the numerics beyond float32 summation order.
"""
from __future__ import annotations

import ctypes.util
import os
import platform
import sys

MALLOC_ENV = "EDM2_JAX_MALLOC"
DEVICES_ENV = "EDM2_JAX_CPU_DEVICES"
MALLOC_MODES = ("auto", "tcmalloc", "thp", "off")
APPLIED = "EDM2_JAX_CPU_ENV_APPLIED"  # set in the re-executed process: never loop
DEVICES_SET = "EDM2_JAX_CPU_DEVICES_SET"  # the device count reexec() chose
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
TCMALLOC = "tcmalloc_minimal"
THP_TUNABLE = "glibc.malloc.hugetlb=1"


def malloc_mode(environ: dict | None = None) -> str:
    """`$EDM2_JAX_MALLOC` (default 'auto'). Raises ValueError for another value."""
    env = os.environ if environ is None else environ
    m = (env.get(MALLOC_ENV, "auto") or "auto").strip().lower()
    if m not in MALLOC_MODES:
        raise ValueError(f"{MALLOC_ENV}={m!r}: expected one of {', '.join(MALLOC_MODES)}")
    return m


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_devices(environ: dict | None = None, cores: int | None = None) -> int:
    """The CPU device count `$EDM2_JAX_CPU_DEVICES` asks for: 'auto' (default) =
    `min(2, cores)` (`cores`: those this process may run on), 'off' = 1, or a number
    >= 1. Raises ValueError for anything else."""
    env = os.environ if environ is None else environ
    v = (env.get(DEVICES_ENV, "auto") or "auto").strip().lower()
    if v == "auto":
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
    'tcmalloc', 'thp' or 'glibc'."""
    env = os.environ if environ is None else environ
    if TCMALLOC in env.get("LD_PRELOAD", ""):
        return "tcmalloc"
    if THP_TUNABLE in env.get("GLIBC_TUNABLES", ""):
        return "thp"
    return "glibc"


def launch_env(environ: dict | None = None, cores: int | None = None) -> dict[str, str]:
    """The environment variables to add or change, given `environ` (default
    `os.environ`): the allocator of `malloc_mode` (only on Linux with glibc, and only
    when none of ours is in effect) and the device count of `cpu_devices` (only when
    `XLA_FLAGS` sets none and it is > 1). Empty when nothing needs to change.
    Raises ValueError for bad settings, FileNotFoundError for `tcmalloc` where
    libtcmalloc_minimal is not installed."""
    env = os.environ if environ is None else environ
    add: dict[str, str] = {}
    m = malloc_mode(env)
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
            tun = env.get("GLIBC_TUNABLES", "")
            add["GLIBC_TUNABLES"] = f"{tun}:{THP_TUNABLE}" if tun else THP_TUNABLE
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
    dev = (f"{n} CPU devices (${DEVICES_ENV})" if n else "CPU devices as XLA_FLAGS / JAX set them")
    return f"host allocator {malloc_in_effect(env)} (${MALLOC_ENV}), {dev}; edm2_jax/process.py"


def usable_devices(batch_size: int, num_devices: int, fits) -> int:
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
    add = launch_env()
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
