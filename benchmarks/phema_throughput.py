"""Throughput of post-hoc EMA reconstruction vs a plain read of the same snapshot files.

For the snapshots of a run (`--workdir`, read only; outputs go to a temporary directory)
or of a synthetic run written here (`--preset`, `--snapshots`, as in phema_memory.py):

  read      `cat`-like sequential read of every file under snapshots/*/ema (on-disk bytes)
  orbax     Orbax restore of every EMA to host numpy, nothing else
  reader    phema's reader (TensorStore, tensor by tensor) into float32 chunks, nothing else
  phema K   `reconstruct` of K outputs (reading, accumulating, writing the outputs)
  phema K nw  the same with the outputs not written (reading and accumulating only)

each cold (the files' pages evicted with posix_fadvise(DONTNEED) first) and warm (page
cache hot). GB/s are given both in on-disk bytes (Orbax compresses with zstd) and in
float32 parameter bytes decoded.

    python benchmarks/phema_throughput.py                               # img512-xxs x 4
    python benchmarks/phema_throughput.py --workdir=/work/runs_fmnist --outputs=1,8
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

if __name__ == "__main__":  # first, before JAX starts: the XLA flags of edm2_jax.main
    from edm2_jax import process
    process.add_default_xla_flags()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def snapshot_files(workdir: str) -> list[str]:
    root = os.path.join(workdir, "snapshots")
    out = []
    for dirpath, _, names in os.walk(root):
        if os.sep + "ema" in dirpath[len(root):]:
            out += [os.path.join(dirpath, n) for n in names]
    return sorted(out)


def evict(paths: list[str]) -> None:
    """Drop the files' pages from the page cache (only these files; no root needed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(paths: list[str], block: int = 16 << 20) -> int:
    n = 0
    buf = bytearray(block)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                k = f.readinto(buf)
                if not k:
                    break
                n += k
    return n


def restore_all(workdir: str) -> int:
    """Orbax restore of every EMA (float32 bytes decoded)."""
    import numpy as np
    import jax
    from edm2_jax.run import network_dir as checkpoint
    from edm2_jax.ema.inputs import find_snapshots
    from edm2_jax.ema import streaming
    streaming.quiet_orbax()
    _, files = find_snapshots(workdir)
    n = 0
    for f in files:
        for path in f.tree_paths:
            (tree,) = checkpoint.restore_partial(f.directory, [path])
            n += sum(np.asarray(x).size * 4 for x in jax.tree.leaves(tree))
            del tree
    return n


def read_all(workdir: str) -> int:
    """`reconstruct`'s reader over every EMA, chunks discarded (float32 bytes)."""
    from edm2_jax.run import network_dir as checkpoint
    from edm2_jax.ema.inputs import find_snapshots
    from edm2_jax.ema import streaming
    streaming.quiet_orbax()
    _, files = find_snapshots(workdir)
    layout, n = None, 0
    for f in files:
        keys, context = streaming.orbax_tree_keys(f.directory), streaming.ts_context()
        for path in f.tree_paths:
            if layout is None:
                layout = streaming.flat_layout(
                    checkpoint.subtree(checkpoint.tree_metadata(f.directory), path), [])
            reader = streaming.make_reader(f, path, layout, context, keys)
            n += sum(chunk.nbytes for _, _, chunk in layout.chunks(reader))
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None, help="an existing run (read only)")
    ap.add_argument("--preset", default="img512-xxs")
    ap.add_argument("--snapshots", type=int, default=4)
    ap.add_argument("--outputs", default="1,8", help="comma-separated output counts")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="phema_tp_")
    try:
        workdir = args.workdir
        if workdir is None:
            from phema_memory import write_synthetic_run
            workdir = os.path.join(tmp, "run")
            write_synthetic_run(workdir, args.preset, args.snapshots)
        from edm2_jax.run import network_dir as checkpoint
        from edm2_jax.ema.reconstruction import reconstruct
        from edm2_jax.ema import streaming
        streaming.quiet_orbax()
        paths = snapshot_files(workdir)
        disk = sum(os.path.getsize(p) for p in paths)
        rows = []

        def timed(name, fn, decoded=None):
            for state in ("cold", "warm"):
                if state == "cold":
                    evict(paths)
                else:
                    plain_read(paths)
                t = time.time()
                out = fn()
                dt = time.time() - t
                dec = decoded if decoded is not None else out
                rows.append((name, state, dt, disk / dt / 1e9, (dec or 0) / dt / 1e9))
                print(f"{name:10s} {state}: {dt:7.2f} s  {disk / dt / 1e9:6.3f} GB/s on disk"
                      + (f"  {dec / dt / 1e9:6.3f} GB/s float32" if dec else ""), flush=True)
            return out

        print(f"{len(paths)} files, {disk / 1e9:.2f} GB on disk in {workdir}/snapshots; "
              f"{os.cpu_count()} CPUs, load average {_load()}", flush=True)
        timed("read", lambda: plain_read(paths), decoded=0)
        decoded = timed("orbax", lambda: restore_all(workdir))
        timed("reader", lambda: read_all(workdir))
        for k in [int(x) for x in args.outputs.split(",")]:
            sig = [round(0.03 + 0.15 * j / max(k - 1, 1), 4) for j in range(k)]

            def run():
                out = os.path.join(tmp, "out")
                shutil.rmtree(out, ignore_errors=True)
                reconstruct(workdir, sig, out_dir=out, batch_outputs=k, progress=False)
            timed(f"phema {k}", run, decoded=decoded)
            # The same without writing the outputs: reading + accumulating only.
            real_save = checkpoint.save_network
            checkpoint.save_network = lambda path, *a, **kw: path
            try:
                timed(f"phema {k} nw", run, decoded=decoded)
            finally:
                checkpoint.save_network = real_save
        print(f"load average at the end {_load()} (a load above the CPU count slows every "
              f"row, the reading ones more than the plain read)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
