"""Peak host memory of post-hoc EMA reconstruction (`ema.reconstruction.reconstruct`).

Writes a synthetic training run (Orbax snapshots exactly as training writes them) whose
EMAs have the parameter shapes of a released preset (default img512-xxs, 31M parameters,
124 MB per float32 copy), then reconstructs `--outputs` EMAs in one batch in a fresh
process and reports its peak RSS above the baseline (process with JAX and the reader
ready) in units of one parameter copy: both the 20 ms samples' maximum and the kernel's
high-water mark (VmHWM). The budget is the outputs plus one snapshot file (two EMAs):
outputs + 2 copies; phema reads a few tensors at a time, so it needs about outputs + 1.
The host allocator is the process's (run this script under the allocator to measure).
Measured (2 CPU cores, `--snapshots=16 --outputs=8`): 9.5-9.9 copies under glibc, 9.0
with `GLIBC_TUNABLES=glibc.malloc.arena_max=2` (what `--mode=phema` runs under,
`edm2_jax/process.py`), 9.0 with `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1048576`,
16.7 under tcmalloc (`LD_PRELOAD=libtcmalloc_minimal.so.4`).

    python benchmarks/phema_memory.py                          # 16 snapshots x 2 EMAs, 8 outputs
    python benchmarks/phema_memory.py --snapshots=4 --outputs=2 --preset=img64-xs

Needs about snapshots x 2 x copy + outputs x copy of free disk in --dir (4.9 GB by
default; the run is deleted afterwards unless --keep). CPU only (JAX_PLATFORMS=cpu).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

if __name__ == "__main__":  # first, before JAX starts: the XLA flags of edm2_jax.main
    from edm2_jax import process
    process.add_default_xla_flags()

SIGMA_RELS = (0.05, 0.10)


def param_shapes(preset: str) -> dict:
    """Params / buffers ShapeDtypeStructs of a released preset (nothing allocated)."""
    import jax
    from edm2_jax.model import presets
    from edm2_jax.model.networks import init_variables, precond_from_config
    net_config = dict(presets.NETWORK_PRESETS[preset])
    net = precond_from_config(net_config)
    shapes = jax.eval_shape(lambda r: init_variables(net, r), jax.random.PRNGKey(0))
    return net_config, shapes


def write_synthetic_run(workdir: str, preset: str, n_snapshots: int, seed: int = 0) -> dict:
    """A run directory with `n_snapshots` Orbax EMA snapshots (sigma_rel 0.05 and 0.10,
    random float32 weights of `preset`'s shapes, one every 8Mi images), config.json and
    buffers in the snapshots. Returns {'num_params', 'bytes_per_copy', 'snapshot_bytes'}."""
    import jax
    import numpy as np
    from edm2_jax.run import checkpoints
    from edm2_jax.ema import power as ema
    net_config, shapes = param_shapes(preset)
    rng = np.random.default_rng(seed)
    base = {s: jax.tree.map(lambda x: rng.standard_normal(x.shape, np.float32), shapes["params"])
            for s in SIGMA_RELS}
    buffers = jax.tree.map(lambda x: rng.standard_normal(x.shape, np.float32), shapes["buffers"])
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump({"network": net_config}, f)
    mngrs = checkpoints.TrainCheckpoints(workdir)
    for k in range(1, n_snapshots + 1):
        # Distinct contents per snapshot without drawing 31M normals each time.
        power = {ema.ema_key(s): jax.tree.map(lambda x: x * np.float32(1 + 0.01 * k), base[s])
                 for s in SIGMA_RELS}
        mngrs.save_snapshot(k, k * 8 * 2**20, {"power": power}, SIGMA_RELS, 2048, buffers=buffers)
        mngrs.snap_mngr.wait_until_finished()
        print(f"  wrote snapshot {k}/{n_snapshots}", flush=True)
    mngrs.close()
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))
    return {"num_params": n, "bytes_per_copy": 4 * n,
            "snapshot_bytes": 4 * n * len(SIGMA_RELS) * n_snapshots}


def _rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _hwm() -> int:
    """Peak RSS of this process image: VmHWM from /proc, ru_maxrss only where that is
    missing (on Linux, after fork + exec, ru_maxrss starts from the parent's peak: here
    that of the process that wrote the synthetic run, ~1.5 GB)."""
    return _rss("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(workdir: str, sigma_rels: list[float], out_dir: str) -> dict:
    """Run in a fresh process: baseline RSS, then reconstruct and sample RSS every 20 ms."""
    import jax
    from edm2_jax.ema.inputs import find_snapshots
    from edm2_jax.ema.reconstruction import reconstruct
    jax.devices()
    find_snapshots(workdir)  # Orbax and the metadata reader loaded
    jax.numpy.zeros(1).block_until_ready()
    baseline = _rss()
    peak = {"rss": baseline}
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            peak["rss"] = max(peak["rss"], _rss())
            time.sleep(0.02)

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    t0 = time.time()
    paths = reconstruct(workdir, sigma_rels, out_dir=out_dir, batch_outputs=len(sigma_rels),
                        progress=True)
    seconds = time.time() - t0
    stop.set()
    th.join()
    return {"baseline_rss": baseline, "peak_rss_sampled": peak["rss"], "vm_hwm": _hwm(),
            "seconds": seconds, "outputs": paths}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="img512-xxs")
    ap.add_argument("--snapshots", type=int, default=16, help="snapshot files (2 EMAs each)")
    ap.add_argument("--outputs", type=int, default=8)
    ap.add_argument("--dir", default=None, help="where to write the synthetic run (tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic run")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse a run left in --dir by --keep (same --preset/--snapshots)")
    ap.add_argument("--_measure", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sigma_rels = [round(0.03 + 0.15 * k / max(args.outputs - 1, 1), 4)
                  for k in range(args.outputs)]
    if args._measure:
        r = measure(args._measure, sigma_rels, os.path.join(args._measure, "phema_out"))
        print("RESULT " + json.dumps(r))
        return

    root = args.dir or tempfile.mkdtemp(prefix="phema_mem_")
    workdir = os.path.join(root, "run")
    try:
        os.makedirs(root, exist_ok=True)
        free = shutil.disk_usage(root).free
        _, shapes = param_shapes(args.preset)
        import numpy as np
        import jax
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))
        need = 4 * n * (2 * args.snapshots + args.outputs)
        print(f"{args.preset}: {n / 1e6:.1f}M parameters, {4 * n / 1e6:.0f} MB per copy; "
              f"need {need / 1e9:.1f} GB of disk, {free / 1e9:.1f} GB free in {root}")
        if need > 0.9 * free:
            sys.exit(f"not enough free disk in {root}; pass --dir or fewer --snapshots")
        t0 = time.time()
        if args.reuse and os.path.isdir(os.path.join(workdir, "snapshots")):
            info = {"num_params": n, "bytes_per_copy": 4 * n,
                    "snapshot_bytes": 4 * n * len(SIGMA_RELS) * args.snapshots}
            shutil.rmtree(os.path.join(workdir, "phema_out"), ignore_errors=True)
            print(f"reusing the run in {workdir}")
        else:
            info = write_synthetic_run(workdir, args.preset, args.snapshots)
            print(f"wrote {args.snapshots} snapshots ({info['snapshot_bytes'] / 1e9:.2f} GB) "
                  f"in {time.time() - t0:.0f} s")
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        out = subprocess.run([sys.executable, __file__, "--_measure", workdir,
                              f"--outputs={args.outputs}"], env=env, check=True,
                             capture_output=True, text=True)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        r = json.loads(line[len("RESULT "):])
        copy = info["bytes_per_copy"]
        extra = r["peak_rss_sampled"] - r["baseline_rss"]
        extra_hwm = r["vm_hwm"] - r["baseline_rss"]
        print(f"reconstructed {args.outputs} outputs from {2 * args.snapshots} EMAs in "
              f"{r['seconds']:.1f} s ({info['snapshot_bytes'] / r['seconds'] / 1e9:.2f} GB/s of "
              f"snapshot data, outputs written included)")
        print(f"baseline RSS {r['baseline_rss'] / 1e9:.2f} GB; peak RSS above baseline "
              f"{extra / 1e9:.2f} GB (sampled every 20 ms) / {extra_hwm / 1e9:.2f} GB (VmHWM) = "
              f"{extra / copy:.1f} / {extra_hwm / copy:.1f} parameter copies "
              f"(budget: {args.outputs} outputs + one snapshot of 2 EMAs = "
              f"{args.outputs + 2})")
    finally:
        if not args.keep:
            shutil.rmtree(root if args.dir is None else workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
