"""The host allocator our command-line entry points run under (Linux, glibc).

Why. XLA's CPU client allocates each execution's temporary buffer (all of a training
step's activations, 368 MB for the Fashion-MNIST step at batch 64) with
`posix_memalign` from a worker thread. glibc serves an allocation that large from a
fresh `mmap` and returns it with `munmap` when the step ends (its mmap threshold cannot
be raised above 32 MB, and a thread's own arena maps any chunk larger than its 64 MB
heap), so every step faults in and zeroes ~90,000 new 4 KiB pages. Measured on 2 cores
of an AMD EPYC (benchmarks/README.md, "Session 7"): 545 -> ~445 ms per step, and
90,000 -> ~500 page faults per step, under either fix below. Nothing in jaxlib selects
another allocator, and both fixes must be in place when the process starts, so
`reexec()` restarts the process (same PID, same command line) with:

    tcmalloc  LD_PRELOAD=libtcmalloc_minimal.so.4 (Debian/Ubuntu `libtcmalloc-minimal4`,
              installed by the README's quick start): keeps freed spans for reuse; also
              the lowest peak RSS (1.4 vs 1.8 GiB for that step);
    thp       GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc >= 2.35; older ones ignore
              it): glibc's mapped chunks use transparent huge pages, 1 fault per 2 MiB.

`$EDM2_JAX_MALLOC` chooses: `auto` (default: tcmalloc where it is installed, else thp),
`tcmalloc`, `thp`, or `off` (the process keeps the allocator it was started with).
Only `python -m edm2_jax.main` and the benchmarks re-exec; importing the package never
does. The numerics do not depend on the allocator.
"""
from __future__ import annotations

import ctypes.util
import os
import platform
import sys

ENV = "EDM2_JAX_MALLOC"
MODES = ("auto", "tcmalloc", "thp", "off")
_APPLIED = "EDM2_JAX_MALLOC_APPLIED"  # set in the re-executed process: never loop
TCMALLOC = "tcmalloc_minimal"
THP_TUNABLE = "glibc.malloc.hugetlb=1"


def mode() -> str:
    """`$EDM2_JAX_MALLOC` (default 'auto'). Raises ValueError for another value."""
    m = (os.environ.get(ENV, "auto") or "auto").strip().lower()
    if m not in MODES:
        raise ValueError(f"{ENV}={m!r}: expected one of {', '.join(MODES)}")
    return m


def _tcmalloc_soname() -> str | None:
    return ctypes.util.find_library(TCMALLOC)  # e.g. 'libtcmalloc_minimal.so.4', or None


def in_effect(environ: dict | None = None) -> str:
    """Which allocator this process was started with: 'tcmalloc', 'thp' or 'glibc'
    (plain glibc malloc), judged from `environ` (default `os.environ`)."""
    env = os.environ if environ is None else environ
    if TCMALLOC in env.get("LD_PRELOAD", ""):
        return "tcmalloc"
    if THP_TUNABLE in env.get("GLIBC_TUNABLES", ""):
        return "thp"
    return "glibc"


def allocator_env(m: str | None = None, environ: dict | None = None) -> dict[str, str]:
    """The environment variables to add or change for mode `m` (default `mode()`), given
    the current `environ`; empty when nothing needs to change (mode 'off', not Linux
    with glibc, or the allocator already in effect). Raises FileNotFoundError for
    'tcmalloc' when libtcmalloc_minimal is not installed."""
    env = os.environ if environ is None else environ
    m = mode() if m is None else m
    if m == "off" or sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return {}
    if in_effect(env) != "glibc":
        return {}
    if m in ("auto", "tcmalloc"):
        so = _tcmalloc_soname()
        if so:
            pre = env.get("LD_PRELOAD", "")
            return {"LD_PRELOAD": f"{pre}:{so}" if pre else so,
                    # tcmalloc reports every allocation over 1 GiB on stderr by default.
                    "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}
        if m == "tcmalloc":
            raise FileNotFoundError(f"{ENV}=tcmalloc: libtcmalloc_minimal is not installed; "
                                    f"apt-get install libtcmalloc-minimal4, or set "
                                    f"{ENV}=thp (glibc huge pages) or {ENV}=off")
    tun = env.get("GLIBC_TUNABLES", "")
    return {"GLIBC_TUNABLES": f"{tun}:{THP_TUNABLE}" if tun else THP_TUNABLE}


def reexec(argv: list[str] | None = None) -> None:
    """Replace this process with itself under the allocator `mode()` names (see module
    doc), once: the same PID (signals and job schedulers see no change), the same
    command line (`argv`, default `sys.orig_argv`) and environment plus
    `allocator_env()`. Returns without doing anything when nothing needs to change or
    this process is already the re-executed one. Call it first thing in a `__main__`,
    before JAX starts threads. Raises ValueError for a bad `$EDM2_JAX_MALLOC`,
    FileNotFoundError for `tcmalloc` without the library."""
    if os.environ.get(_APPLIED):
        return
    add = allocator_env()
    if not add:
        return
    env = dict(os.environ, **add, **{_APPLIED: "1"})
    argv = list(sys.orig_argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)
