"""Throughput of the training data pipeline on the host: can it feed the GPU?

    python benchmarks/data_pipeline.py                               # 64x64 RGB stand-in
    python benchmarks/data_pipeline.py --path=PATH/img64.zip --workers=1,2,4,8
    python benchmarks/data_pipeline.py --images=512 --batch=64 --batches=4 --out=d.json

The pipeline is `edm2_jax.data.pipeline.make_iterator` over an `ImageFolder`, exactly as
training reads `data.source='folder'` (a zip as the release's dataset_tool.py writes:
PNGs and dataset.json), with its loader threads (`data.num_workers`) and prefetching:
PNG decode, the uint8 -> [-1, 1] float32 conversion and the one-hot labels of each
global batch. Nothing trains: the consumer only takes batches, so the figure is what the
host can deliver, to compare with what the step consumes (`--target`, img/s per process;
600 is twice the img/s of the release's img64-s step on one H100).

Without `--path`, a stand-in data set is written first (to `--workdir`, reused when
present): `--images` random RGB PNGs of `--resolution` with `--classes` labels, stored
as `python -m edm2_jax.data.dataset_tool convert` and the release's dataset_tool.py store
them (PNG compression level 0, so every image decodes at the same cost whatever it
shows). The mean PNG size is printed. `--latents`: the img512 presets' data instead,
raw SD-VAE latents (`[8, R, R]` float32 .npy per image, means then stds, as
`dataset_tool encode` writes them; default `--resolution` then 64), from which the
pipeline draws each image's 4 latent channels anew (`data.pipeline`).

Prints, per worker count in `--workers`, the img/s over `--batches` global batches of
`--batch` after one warm-up batch (median of `--repeats`), img/s per worker, and whether
it meets `--target`; `--out` writes the figures as JSON.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
import zipfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from edm2_jax.data import pipeline  # noqa: E402
from edm2_jax.data.image_folder import ImageFolder  # noqa: E402
from edm2_jax.data.latents import LatentFolder  # noqa: E402


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


def measure(source: ImageFolder | LatentFolder, batch: int, batches: int, workers: int,
            prefetch: int = 2) -> float:
    """img/s of `make_iterator(source, num_workers=workers)` over `batches` batches of
    `batch`, after one warm-up batch (which starts the threads)."""
    it = pipeline.make_iterator(source, global_batch=batch, seed=0, num_workers=workers,
                                prefetch=prefetch)
    try:
        next(it)
        t = time.perf_counter()
        for _ in range(batches):
            b = next(it)
        seconds = time.perf_counter() - t
        assert b["image"].shape[0] == batch
    finally:
        it.close()
    return batch * batches / seconds


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default="", help="a data set (zip or folder); default: a stand-in")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "edm2_jax_data_bench"),
                    help="where the stand-in data set is written")
    ap.add_argument("--images", type=int, default=8192, help="stand-in: number of images")
    ap.add_argument("--resolution", type=int, default=64, help="stand-in: image size")
    ap.add_argument("--latents", action="store_true",
                    help="SD-VAE latents (the img512 presets' data) instead of images")
    ap.add_argument("--classes", type=int, default=1000, help="stand-in: number of classes")
    ap.add_argument("--batch", type=int, default=256, help="global batch (one process)")
    ap.add_argument("--batches", type=int, default=16, help="timed batches per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", default="1,2", help="loader thread counts, comma-separated")
    ap.add_argument("--target", type=float, default=600.0, help="img/s the step consumes")
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    if not workers or min(workers) < 1:
        sys.exit(f"error: --workers={args.workers!r} must list thread counts >= 1, e.g. 1,2,4")
    path = args.path
    if not path:
        os.makedirs(args.workdir, exist_ok=True)
        kind = "latents" if args.latents else "images"
        path = os.path.join(args.workdir, f"standin-{kind}-{args.images}x{args.resolution}-"
                                          f"{args.classes}.zip")
        if not os.path.exists(path):
            t = time.perf_counter()
            write_standin(path, args.images, args.resolution, args.classes,
                          latents=args.latents)
            print(f"Wrote the stand-in data set {path} in {time.perf_counter() - t:.0f} s",
                  flush=True)
    source = (LatentFolder if args.latents else ImageFolder)(path, use_labels=True)
    size = mean_file_bytes(path) if path.endswith(".zip") else float("nan")
    print(f"{source.name}: {len(source)} {'latents' if args.latents else 'images'} "
          f"{source.resolution}x{source.resolution}x{source.num_channels}, "
          f"{source.label_dim} classes, {size / 1024:.1f} KiB per file; batch {args.batch}, "
          f"{os.cpu_count()} CPUs", flush=True)
    rows = []
    for w in workers:
        rates = [measure(source, args.batch, args.batches, w) for _ in range(args.repeats)]
        rate = float(np.median(rates))
        rows.append(dict(workers=w, img_per_s=rate, img_per_s_per_worker=rate / w,
                         all=rates, meets_target=rate >= args.target))
        print(f"workers {w}: {rate:.0f} img/s ({rate / w:.0f} per worker; repeats "
              f"{', '.join(f'{r:.0f}' for r in rates)}): "
              f"{'meets' if rate >= args.target else 'below'} the target of "
              f"{args.target:.0f} img/s", flush=True)
    out = dict(data=path, latents=args.latents, images=len(source),
               resolution=source.resolution, file_bytes=size, batch=args.batch, batches=args.batches, target=args.target,
               cpus=os.cpu_count(), rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
