"""Throughput of the training data pipeline on the host: can it feed the accelerators?

    python benchmarks/data_pipeline.py --kinds=png,raw,latents --threads=1,2 --workers=1,2
    python benchmarks/data_pipeline.py --workers=1,2,4,8,16     # PNGs on a host before renting
    python benchmarks/data_pipeline.py --path=PATH/img64.zip --kinds=png,raw --out=d.json

What is timed is `edm2_jax.data.pipeline.make_iterator` over the sources training reads
(`data.source='folder'`): decode or gather, the uint8 -> [-1, 1] float32 conversion, the
one-hot labels (for latents, the per-use draw `mean + N(0, 1) std`), every batch handed to
the consumer; nothing trains, so a figure is what the host can deliver. Three kinds of data
(`--kinds`), each 8,192 stand-in items written once to `--workdir` (or `--path`):
  * `png`: a zip of 64x64 RGB PNGs as `dataset_tool convert` and the release's tool write
    them (compression level 0: every image decodes at the same cost), `ImageFolder`;
  * `raw`: the same images converted to this project's raw uint8 array
    (`dataset_tool convert --dest=NAME.npy`, `RawImages`), bit for bit the same batches;
  * `latents`: the img512 presets' data, `[8, 64, 64]` float32 .npy raw SD-VAE latents
    per item in a zip (`LatentFolder`, 128 KiB each).
Loaders per kind: `threads:T` for each T of `--threads` (none by default), the pool of T
Python threads that loaded batches before grain (`threaded_reference`, kept here as the
baseline), and `workers:W` for each W of `--workers`, grain's W worker processes
(`data.num_workers=W`). The defaults (PNGs, workers 1 and 2) are what
benchmarks/gpu_table.py asks for.
For `raw`, stored decoded, `make_iterator` gathers in the training process whatever
`num_workers` (`in-process`); `workers:W` there forces the worker processes to show what
they would cost.

Per row: img/s over `--batches` global batches of `--batch` after a warm-up (median of
`--repeats` consecutive windows of one iterator; the warm-up takes 2 batches per worker, by
when every worker runs, else 1), the CPU
seconds the loader's processes spent per image in those windows (the training process and
its workers, user + system), hence img/s per core (= images per CPU second), and the
loader's memory (the proportional set size of its processes together, MiB, at the end).
It prints first what writing fresh shared memory costs on the host (`fresh_shm_us_per_kib`):
the price of every batch a worker hands over.
The loader's floors are checked at the end: PNGs at 2 workers >= 1.8x 1 worker (on 2
cores), the raw format >= 5x PNGs per core. `--out` writes everything as JSON.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import io
import json
import os
import sys
import tempfile
import time
import zipfile

import numpy as np
import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from edm2_jax.data import dataset_tool, pipeline  # noqa: E402
from edm2_jax.data.image_folder import ImageFolder  # noqa: E402
from edm2_jax.data.latents import LatentFolder  # noqa: E402
from edm2_jax.data.raw_array import RawImages  # noqa: E402
from edm2_jax.encoders import vae  # noqa: E402

KINDS = ("png", "raw", "latents")


def write_standin(path: str, images: int, resolution: int, classes: int, seed: int = 0,
                  latents: bool = False) -> str:
    """A zip of `images` random RGB PNGs of `resolution` at compression level 0 (or with
    `latents`, float32 `[8, resolution, resolution]` .npy raw latents: N(0, 1) means,
    U(0.1, 1) stds) and a dataset.json with labels `i % classes`, as the dataset tools
    write them (module doc). Written to `path + '.part'` and renamed. Returns `path`."""
    import PIL.Image
    rng = np.random.default_rng(seed)
    tmp = path + ".part"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:
        labels = []
        for i in range(images):
            buf = io.BytesIO()
            if latents:
                shape = (4, resolution, resolution)
                np.save(buf, np.concatenate([rng.standard_normal(shape, np.float32),
                                             rng.uniform(0.1, 1, shape).astype(np.float32)]))
                name = f"{i // 1000:05d}/img-mean-std-{i:08d}.npy"
            else:
                img = rng.integers(0, 256, (resolution, resolution, 3), dtype=np.uint8)
                PIL.Image.fromarray(img).save(buf, format="png", compress_level=0,
                                              optimize=False)
                name = f"{i // 1000:05d}/img{i:08d}.png"
            zf.writestr(name, buf.getvalue())
            labels.append([name, i % classes])
        zf.writestr("dataset.json", json.dumps({"labels": labels}))
    os.replace(tmp, path)
    return path


def mean_file_bytes(path: str) -> float:
    """Mean size of the images (or latents) of a zip data set, in bytes."""
    with zipfile.ZipFile(path) as zf:
        sizes = [i.file_size for i in zf.infolist() if i.filename != "dataset.json"
                 and not i.filename.endswith("/")]
    return float(np.mean(sizes))


# ------------------------------------------------------------------------ the baseline

def _fill(source, indices, image, label, positions, seed) -> None:
    """The thread pool's per-image loop (data/pipeline.py before grain), unchanged."""
    shape = image.shape[1:]
    latent = getattr(source, "encoder", "none") == "sd-vae"
    u8 = None if latent else np.empty(image.shape, np.uint8)
    for j, i in enumerate(indices):
        img, lab = source[int(i)]
        if latent:
            image[j] = vae.encode_latents(img, pipeline.latent_noise(seed, int(positions[j]),
                                                                     shape))
        else:
            u8[j] = img
        if label.shape[1]:
            label[j, lab] = 1
    if not latent:
        np.subtract(u8.astype(np.float32) / np.float32(127.5), np.float32(1), out=image)


class threaded_reference:  # noqa: N801 - used like the function it replaces
    """Batches of `source` as the pool of `workers` threads made them before grain (the
    same stream as `make_iterator`: one process, start at 0), `prefetch` batches ahead."""

    def __init__(self, source, *, global_batch: int, seed: int, workers: int,
                 prefetch: int = 2):
        self.source, self.batch, self.seed, self.prefetch = source, global_batch, seed, prefetch
        self.order = pipeline.StreamOrder(len(source), seed)
        self.shape = (global_batch, source.resolution, source.resolution, source.num_channels)
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, "edm2-data")
        self.chunks, self.pending, self.step = 4 * workers, collections.deque(), 0

    def _submit(self) -> None:
        first = self.step * self.batch
        self.step += 1
        indices = self.order.indices(first, self.batch)
        positions = first + np.arange(self.batch, dtype=np.int64)
        batch = {"image": np.empty(self.shape, np.float32),
                 "label": np.zeros((self.batch, self.source.label_dim), np.float32)}
        bounds = np.linspace(0, self.batch, self.chunks + 1).astype(int)
        futures = [self.pool.submit(_fill, self.source, indices[a:b], batch["image"][a:b],
                                    batch["label"][a:b], positions[a:b], self.seed)
                   for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        self.pending.append((batch, futures))

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        while len(self.pending) < self.prefetch:
            self._submit()
        batch, futures = self.pending.popleft()
        for f in futures:
            f.result()
        return batch

    def close(self) -> None:
        for _, futures in self.pending:
            for f in futures:
                f.cancel()
        self.pool.shutdown(wait=True)


class _Undecoded:
    """`source` presented as one that decodes, so that `make_iterator` sends it to worker
    processes (the `raw` rows `workers:W`)."""

    decoded = False

    def __init__(self, source):
        self._s = source
        self.name, self.resolution, self.num_channels = source.name, source.resolution, \
            source.num_channels
        self.label_dim, self.encoder = source.label_dim, source.encoder

    def __len__(self):
        return len(self._s)

    def __getitem__(self, i):
        return self._s[i]

    def read_batch(self, indices):
        return self._s.read_batch(indices)


# --------------------------------------------------------------------------- measuring

def _family() -> list[psutil.Process]:
    me = psutil.Process()
    return [me] + me.children(recursive=True)


def _cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _pss_mib(procs: list[psutil.Process]) -> float:
    total = 0
    for p in procs:
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, AttributeError, psutil.AccessDenied):
            total += p.memory_info().rss
    return total / 2**20


def measure(make, batch: int, batches: int, repeats: int, warmup: int = 1) -> dict:
    """img/s, CPU seconds per image and memory of the iterator `make()` (module doc),
    after `warmup` batches."""
    it = make()
    try:
        for _ in range(warmup):  # the workers start here, one after the other
            assert next(it)["image"].shape[0] == batch
        rates, cpu = [], []
        for _ in range(repeats):
            procs = _family()
            c, t = _cpu_s(procs), time.perf_counter()
            for _ in range(batches):
                next(it)
            seconds = time.perf_counter() - t
            rates.append(batch * batches / seconds)
            cpu.append((_cpu_s(procs) - c) / (batch * batches))
        memory = _pss_mib(_family())
    finally:
        it.close()
    cpu_per_img = float(np.median(cpu))
    return dict(img_per_s=float(np.median(rates)), all=rates, cpu_s_per_img=cpu_per_img,
                img_per_core_s=1 / cpu_per_img if cpu_per_img > 0 else float("inf"),
                processes=len(procs), memory_mib=memory)


def fresh_shm_us_per_kib(mib: int = 64, repeats: int = 3) -> float:
    """What writing fresh shared memory costs here, in microseconds per KiB (median of
    `repeats` segments of `mib` MiB): the price of each batch a worker hands over (its
    pages are new every batch), which some virtual machines make 10-30x that of the same
    write into memory already touched."""
    from multiprocessing import shared_memory
    times = []
    for _ in range(repeats):
        shm = shared_memory.SharedMemory(create=True, size=mib * 2**20)
        try:
            view = np.frombuffer(shm.buf, np.uint8)
            t = time.perf_counter()
            view[:] = 1
            times.append(time.perf_counter() - t)
            del view
        finally:
            shm.close()
            shm.unlink()
    return float(np.median(times)) * 1e6 / (mib * 1024)


def _loaders(kind: str, source, args) -> list[tuple[str, object]]:
    """(row name, iterator factory) of each loader measured for `kind`."""
    kw = dict(global_batch=args.batch, seed=0)
    rows = [(f"threads:{t}", lambda t=t: threaded_reference(source, workers=t, **kw))
            for t in args.threads]
    if kind == "raw":
        rows.append(("in-process", lambda: pipeline.make_iterator(source, num_workers=1, **kw)))
    forked = _Undecoded(source) if kind == "raw" else source
    rows += [(f"workers:{w}", lambda w=w: pipeline.make_iterator(forked, num_workers=w, **kw))
             for w in args.workers]
    return rows


def _data(kind: str, args) -> str:
    """The path of `kind`'s data set: written once to `--workdir`, from `--path` for raw."""
    os.makedirs(args.workdir, exist_ok=True)
    stem = os.path.join(args.workdir, f"standin-{args.images}x{args.resolution}-{args.classes}")
    png = args.path or stem + "-images.zip"
    raw = os.path.join(args.workdir, os.path.splitext(os.path.basename(png))[0] + ".npy")
    path = {"png": png, "raw": raw, "latents": stem + "-latents.zip"}[kind]
    if not os.path.exists(path):
        t = time.perf_counter()
        if kind == "raw":
            dataset_tool.convert(_data("png", args), path, quiet=True)
        else:
            write_standin(path, args.images, args.resolution, args.classes,
                          latents=kind == "latents")
        print(f"Wrote {path} in {time.perf_counter() - t:.0f} s", flush=True)
    return path


def _open(kind: str, path: str):
    return {"png": ImageFolder, "raw": RawImages, "latents": LatentFolder}[kind](path)


def floors(rows: list[dict]) -> dict:
    """The loader's floors from the rows measured (None where a row is missing)."""
    by = {(r["kind"], r["loader"]): r for r in rows}
    png1, png2 = by.get(("png", "workers:1")), by.get(("png", "workers:2"))
    raw = by.get(("raw", "in-process"))
    png_core = max((r["img_per_core_s"] for r in rows if r["kind"] == "png"
                    and r["loader"].startswith("workers")), default=None)
    out = {"png_2_over_1_workers": png2["img_per_s"] / png1["img_per_s"]
           if png1 and png2 else None,
           "raw_over_png_per_core": raw["img_per_core_s"] / png_core
           if raw and png_core else None}
    out["meets"] = {"png_2_over_1_workers >= 1.8": out["png_2_over_1_workers"] is not None
                    and out["png_2_over_1_workers"] >= 1.8,
                    "raw_over_png_per_core >= 5": out["raw_over_png_per_core"] is not None
                    and out["raw_over_png_per_core"] >= 5}
    return out


def _counts(text: str, flag: str, least: int) -> list[int]:
    counts = [int(w) for w in text.split(",") if w.strip()]
    if any(c < least for c in counts):
        sys.exit(f"error: --{flag}={text!r} must list counts >= {least}, e.g. 1,2,4")
    return counts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="png", help="of png, raw, latents, comma-separated")
    ap.add_argument("--path", default="", help="a PNG zip (default: the stand-in); raw is "
                                               "converted from it")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "edm2_jax_data_bench"),
                    help="where the stand-in data sets are written")
    ap.add_argument("--images", type=int, default=8192, help="stand-in: number of items")
    ap.add_argument("--resolution", type=int, default=64, help="stand-in: image (latent) side")
    ap.add_argument("--classes", type=int, default=1000, help="stand-in: number of classes")
    ap.add_argument("--batch", type=int, default=256, help="global batch (one process)")
    ap.add_argument("--batches", type=int, default=16, help="timed batches per window")
    ap.add_argument("--repeats", type=int, default=3, help="timed windows")
    ap.add_argument("--workers", default="1,2", help="worker process counts, comma-separated")
    ap.add_argument("--threads", default="", help="baseline thread counts, e.g. 1,2 ('': none)")
    ap.add_argument("--target", type=float, default=600.0, help="img/s the step consumes")
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    args.workers = _counts(args.workers, "workers", 1)
    args.threads = _counts(args.threads, "threads", 1)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or set(kinds) - set(KINDS):
        sys.exit(f"error: --kinds={args.kinds!r}: choose from {','.join(KINDS)}")
    load, shm_cost = os.getloadavg()[0], fresh_shm_us_per_kib()
    print(f"{os.cpu_count()} CPUs, load average {load:.2f} before the run; fresh shared "
          f"memory {shm_cost:.2f} us per KiB written; batch {args.batch}, {args.repeats} "
          f"windows of {args.batches} batches", flush=True)
    rows, data = [], {}
    for kind in kinds:
        path = data[kind] = _data(kind, args)
        source = _open(kind, path)
        size = os.path.getsize(path) / len(source) if kind == "raw" else mean_file_bytes(path)
        print(f"{kind}: {path}: {len(source)} items {source.resolution}x{source.resolution}x"
              f"{source.num_channels}, {source.label_dim} classes, {size / 1024:.1f} KiB per "
              f"item", flush=True)
        for name, make in _loaders(kind, source, args):
            warmup = 2 * int(name.split(":")[1]) if name.startswith("workers:") else 1
            row = dict(kind=kind, loader=name, item_bytes=size,
                       workers=int(name.split(":")[1]) if name.startswith("workers:") else None,
                       **measure(make, args.batch, args.batches, args.repeats, warmup))
            row["meets_target"] = row["img_per_s"] >= args.target
            rows.append(row)
            print(f"  {name:>11}: {row['img_per_s']:8,.0f} img/s (windows "
                  f"{', '.join(f'{r:,.0f}' for r in row['all'])}); "
                  f"{row['img_per_core_s']:8,.0f} img/s per core; {row['processes']} "
                  f"processes, {row['memory_mib']:,.0f} MiB", flush=True)
    checks = floors(rows)
    for name, ok in checks["meets"].items():
        value = checks[name.split(" ")[0]]
        print(f"floor {name}: {'n/a' if value is None else f'{value:.2f}'} "
              f"{'met' if ok else 'NOT met'}")
    out = dict(data=data, images=args.images, resolution=args.resolution, batch=args.batch,
               batches=args.batches, repeats=args.repeats, target=args.target,
               cpus=os.cpu_count(), load_average_before=load, fresh_shm_us_per_kib=shm_cost,
               rows=rows, floors=checks)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
