"""`--mode=eval`: metrics of an image folder or of a network (generating on the fly).

    # FID (Inception-v3, the release's protocol) of 50k images of a net vs reference stats:
    python -m edm2_jax.main --mode=eval --net=nets/img64-s --ref=img64.pkl --num_images=50000
    # Small-data metrics in a project-trained classifier's features (Fashion-MNIST):
    python -m edm2_jax.main --mode=eval --net=runs/fmnist --metrics=cls,fid --num_images=2000 \
        --config=configs/fashion_mnist.py
    # An image folder instead of a network:
    python -m edm2_jax.main --mode=eval --images=out/ --ref=img64.pkl

Metric names: `fid` (reported as `fid{N}` when N != 50000 — an FID of fewer images is
biased upward and is never to be compared with FID-50k), `cls` (`fd_cls`, `kid_cls`,
`precision_cls`, `recall_cls` in the classifier's penultimate features; never FID).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def folder_images(path: str, num_images: int, batch_size: int = 64) -> Iterator[np.ndarray]:
    """uint8 NHWC batches of the first `num_images` images (sorted, recursive) of a folder.

    Raises ValueError when the folder holds fewer than `num_images` images.
    """
    import PIL.Image
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs
                   if f.lower().endswith(IMAGE_SUFFIXES))
    if len(files) < num_images:
        raise ValueError(f"{path} holds {len(files)} images, fewer than --num_images="
                         f"{num_images}; generate more or lower --num_images")
    for i in range(0, num_images, batch_size):
        batch = [np.asarray(PIL.Image.open(f)) for f in files[i:i + batch_size]]
        yield np.stack([b[..., None] if b.ndim == 2 else b for b in batch])


def net_images(net_path: str, num_images: int, batch_size: int = 64, ema: str | None = None,
               seed0: int = 0, num_steps: int = 32, **gen_kw) -> Iterator[np.ndarray]:
    """uint8 NHWC batches of `num_images` images generated for seeds `seed0 ...`."""
    from edm2_jax import generate
    net, variables, desc = generate.load_net(net_path, ema)
    print(f"Generating {num_images} images from {desc}")
    for _, imgs in generate.generate_images(net, variables, list(range(seed0, seed0 + num_images)),
                                            batch_size=batch_size, num_steps=num_steps, **gen_kw):
        yield imgs


def fid_name(num_images: int) -> str:
    return "fid" if num_images == 50000 else f"fid{num_images}"


def evaluate(images: Iterator[np.ndarray], num_images: int, metrics: list[str], *,
             ref: str | None = None, data_config: Any = None, ref_split: str = "test") -> dict:
    """Compute `metrics` over `images` (uint8 NHWC batches, `num_images` in all).

    `fid` needs `ref` (a reference .pkl/.npz) or `data_config` (reference statistics are
    then computed from that dataset, `ref_split` split). `cls` needs a labelled
    `data_config` (the classifier trains on its train split once, then is cached; the
    reference set is `ref_split`). Returns a flat dict of floats, plus wall times.
    """
    from edm2_jax import data as data_lib
    results: dict = {"num_images": num_images}
    t = time.time()
    gen = np.concatenate(list(images))[:num_images]
    results["time_generate_s"] = time.time() - t
    if len(gen) < num_images:
        raise ValueError(f"only {len(gen)} images available, --num_images={num_images}")

    def source(split):
        if data_config is None:
            raise ValueError("this metric needs reference data: pass --config (its data "
                             "section) or --ref")
        cfg = dict(data_config)
        cfg["split"] = split
        return data_lib.make_source(cfg)

    if "fid" in metrics:
        from edm2_jax.metrics import fid, inception
        t = time.time()
        params = inception.load_inception_params()
        gen_stats = fid.stats_from_images([gen[i:i + 64] for i in range(0, len(gen), 64)], params)
        if ref:
            ref_stats = ref
        else:
            ref_stats = fid.stats_from_source(source(ref_split), params, num_images=num_images)
        results[fid_name(num_images)] = fid.fid_from_stats(gen_stats, ref_stats)
        results["time_fid_s"] = time.time() - t
    if "cls" in metrics:
        from edm2_jax.metrics import classifier as cls_lib
        t = time.time()
        clf, acc = cls_lib.get_classifier(source("train"), source("test"))
        results["classifier_test_accuracy"] = acc
        ref_src = source(ref_split)
        ref_imgs = cls_lib.source_arrays(ref_src, max_items=None)[0]
        results.update(cls_lib.evaluate_features_metrics(gen, ref_imgs, clf))
        results["time_cls_s"] = time.time() - t
    unknown = sorted(set(metrics) - {"fid", "cls"})
    if unknown:
        raise ValueError(f"unknown metrics {unknown}; valid: fid, cls")
    return results


def source_images(data_config: Any, split: str, num_images: int, seed: int = 0,
                  batch_size: int = 64) -> Iterator[np.ndarray]:
    """uint8 batches of `num_images` random images (seeded) of a dataset split."""
    from edm2_jax import data as data_lib
    if data_config is None:
        raise ValueError("--data_split_images needs --config (its data section)")
    src = data_lib.make_source(dict(data_config, split=split))
    if len(src) < num_images:
        raise ValueError(f"{src.name} has {len(src)} images, fewer than --num_images={num_images}")
    idx = np.sort(np.random.RandomState(seed).choice(len(src), num_images, replace=False))
    for i in range(0, num_images, batch_size):
        yield np.stack([src[j][0] for j in idx[i:i + batch_size]])


def main_eval(*, images_dir: str | None, net_path: str | None, num_images: int, metrics: str,
              ref: str | None, data_config: Any, ema: str | None = None, batch_size: int = 64,
              num_steps: int = 32, out_json: str | None = None, ref_split: str = "test",
              data_split_images: str | None = None, **gen_kw) -> dict:
    """CLI body of `--mode=eval` (see module doc). Prints and returns the results."""
    names = [m.strip() for m in metrics.split(",") if m.strip()]
    if sum(map(bool, (images_dir, net_path, data_split_images))) != 1:
        raise ValueError("--mode=eval needs exactly one of --images=DIR, --net=PATH or "
                         "--data_split_images=SPLIT")
    if data_split_images:
        imgs = source_images(data_config, data_split_images, num_images, batch_size=batch_size)
    elif images_dir:
        imgs = folder_images(images_dir, num_images, batch_size)
    else:
        imgs = net_images(net_path, num_images, batch_size, ema=ema, num_steps=num_steps, **gen_kw)
    res = evaluate(imgs, num_images, names, ref=ref, data_config=data_config, ref_split=ref_split)
    print(json.dumps(res, indent=2))
    if out_json:
        with open(out_json, "a") as f:
            f.write(json.dumps(dict(res, images=images_dir or data_split_images, net=net_path,
                                    ref_split=ref_split)) + "\n")
    return res
