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
from typing import Any, Iterator, Sequence

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


class Metrics:
    """The metrics `names` (`fid`, `cls`) of sets of `num_images` generated images, with
    the reference side (Inception statistics, or the classifier and its features of the
    reference split) prepared once at construction, so that repeated calls (evaluation
    during training, post-hoc EMA sweeps) only pay for the generated images.

    Args:
      names: metric names, any of `fid`, `cls`.
      num_images: generated images per call (names the FID: `fid{N}`, see `fid_name`).
      ref: `fid` reference statistics (a release `.pkl` / `.npz` path); None = computed
        from `num_images` images of `data_config`'s `ref_split` split.
      data_config: the data section of a training config (source, path, ...); needed by
        `cls` (a labelled dataset: the classifier trains on its train split once, then is
        cached) and by `fid` without `ref`.
      ref_split: the reference split (`test` by default; `train` for a dataset floor).
      classifier_config: `metrics.classifier.TrainConfig` (None = its defaults).
      log: print progress of the one-off preparation.
    Raises ValueError for an unknown metric name or when reference data is missing.
    """

    def __init__(self, names: Sequence[str], num_images: int, *, ref: str | None = None,
                 data_config: Any = None, ref_split: str = "test",
                 classifier_config: Any = None, log: bool = True):
        self.names = [n.strip() for n in names if n.strip()]
        unknown = sorted(set(self.names) - {"fid", "cls"})
        if unknown:
            raise ValueError(f"unknown metrics {unknown}; valid: fid, cls")
        self.num_images = int(num_images)
        self.info: dict = {}
        self._data_config, self._ref_split = data_config, ref_split
        if "fid" in self.names:
            from edm2_jax.metrics import fid, inception
            t = time.time()
            self._inception = inception.load_inception_params()
            self._fid_ref = ref or fid.stats_from_source(self._source(ref_split), self._inception,
                                                         num_images=self.num_images)
            self.info["time_fid_ref_s"] = time.time() - t
        if "cls" in self.names:
            from edm2_jax.metrics import classifier as cls_lib
            t = time.time()
            kw = {} if classifier_config is None else {"config": classifier_config}
            self._clf, acc = cls_lib.get_classifier(self._source("train"), self._source("test"),
                                                    log=log, **kw)
            self.info["classifier_test_accuracy"] = acc
            ref_imgs = cls_lib.source_arrays(self._source(ref_split), max_items=None)[0]
            self._cls_ref = self._clf.features(self._clf.check_images(ref_imgs, "reference"))
            self.info["time_cls_ref_s"] = time.time() - t

    def _source(self, split: str):
        from edm2_jax import data as data_lib
        if self._data_config is None:
            raise ValueError("this metric needs reference data: pass --config (its data "
                             "section) or --ref")
        return data_lib.make_source(dict(dict(self._data_config), split=split))

    def __call__(self, images: np.ndarray) -> dict:
        """Metrics of uint8 `[num_images, H, W, C]` images: a flat dict of floats with
        `fid{N}` and / or `fd_cls`, `kid_cls`, `precision_cls`, `recall_cls`, plus the
        wall time of each (`time_fid_s`, `time_cls_s`). Raises ValueError for another
        number of images."""
        if len(images) != self.num_images:
            raise ValueError(f"got {len(images)} images, the metrics were set up for "
                             f"{self.num_images}")
        out: dict = {}
        if "fid" in self.names:
            from edm2_jax.metrics import fid
            t = time.time()
            gen = fid.stats_from_images([images[i:i + 64] for i in range(0, len(images), 64)],
                                        self._inception)
            out[fid_name(self.num_images)] = fid.fid_from_stats(gen, self._fid_ref)
            out["time_fid_s"] = time.time() - t
        if "cls" in self.names:
            from edm2_jax.metrics import classifier as cls_lib
            t = time.time()
            out.update(cls_lib.evaluate_features_metrics(images, self._cls_ref, self._clf))
            out["time_cls_s"] = time.time() - t
        return out


def evaluate(images: Iterator[np.ndarray], num_images: int, metrics: list[str], *,
             ref: str | None = None, data_config: Any = None, ref_split: str = "test",
             classifier_config: Any = None) -> dict:
    """Compute `metrics` over `images` (uint8 NHWC batches, `num_images` in all).

    `fid` needs `ref` (a reference .pkl/.npz) or `data_config` (reference statistics are
    then computed from that dataset, `ref_split` split). `cls` needs a labelled
    `data_config` (the classifier trains on its train split once, then is cached; the
    reference set is `ref_split`; `classifier_config` a `classifier.TrainConfig`).
    Returns a flat dict of floats, plus wall times.
    Raises ValueError for an unknown metric or fewer than `num_images` images.
    """
    suite = Metrics(metrics, num_images, ref=ref, data_config=data_config, ref_split=ref_split,
                    classifier_config=classifier_config)
    results: dict = {"num_images": num_images, **suite.info}
    t = time.time()
    gen = np.concatenate(list(images))[:num_images]
    results["time_generate_s"] = time.time() - t
    if len(gen) < num_images:
        raise ValueError(f"only {len(gen)} images available, --num_images={num_images}")
    results.update(suite(gen))
    return results


class TrainingEval:
    """Evaluation during training: the `config.eval.metrics` of `config.eval.num_images`
    images generated by an EMA of the run at every snapshot, logged with the other stats
    under `eval/` (e.g. `eval/fd_cls`, `eval/fid1000`).

    `config.eval` fields: `metrics` ('' = off, 'cls', 'fid' or 'cls,fid'), `num_images`,
    `sigma_rel` (the power EMA to evaluate, 0 = the largest tracked), `num_steps` (Heun
    steps), `batch_size`, `seed` (first seed; the same seeds at every snapshot),
    `ref_split`, `classifier_epochs`, `classifier_batch_size`.

    Construction prepares the references (and trains the classifier once if it is not
    cached), so a config error or a missing dataset fails before the first step.
    Raises ValueError for an unknown metric, an untracked `sigma_rel` or `num_images`
    below 4.
    """

    @staticmethod
    def ema_key_of(config: Any) -> str:
        """The EMA key (`ema.ema_key`) that `config.eval` evaluates. Raises ValueError
        when `eval.sigma_rel` is not tracked."""
        from edm2_jax import ema as ema_lib
        tracked = [float(s) for s in config.ema.sigma_rels]
        sigma_rel = float(config.eval.sigma_rel) or max(tracked)
        if not any(abs(sigma_rel - s) < 1e-9 for s in tracked):
            raise ValueError(f"eval.sigma_rel={sigma_rel} is not a tracked EMA "
                             f"(ema.sigma_rels={tracked}); pick one of them or 0 (largest)")
        return ema_lib.ema_key(sigma_rel)

    def __init__(self, config: Any, log: bool = True):
        from edm2_jax.metrics import classifier as cls_lib
        e = config.eval
        self.num_images, self.num_steps = int(e.num_images), int(e.num_steps)
        self.batch_size, self.seed = int(e.batch_size), int(e.seed)
        if self.num_images < 4:
            raise ValueError(f"eval.num_images={self.num_images}: need at least 4 images")
        self.ema_key = self.ema_key_of(config)
        t = time.time()
        clf_config = cls_lib.TrainConfig(epochs=int(e.classifier_epochs),
                                         batch_size=int(e.classifier_batch_size))
        self.metrics = Metrics(str(e.metrics).split(","), self.num_images,
                               data_config=config.data, ref_split=str(e.ref_split),
                               classifier_config=clf_config, log=log)
        if log:
            print(f"Evaluation during training: {self.metrics.names} of {self.num_images} "
                  f"images of EMA sigma_rel={self.ema_key} ({self.num_steps} steps) at every "
                  f"snapshot, vs the {e.ref_split} split [set up in {time.time() - t:.1f} s]")

    def __call__(self, net: Any, variables: dict) -> dict:
        """Generate and measure; returns `{'eval/<metric>': float, ...}` including
        `eval/time_s` (generation and metrics)."""
        from edm2_jax import generate
        t = time.time()
        seeds = list(range(self.seed, self.seed + self.num_images))
        imgs = np.concatenate([b for _, b in generate.generate_images(
            net, variables, seeds, batch_size=self.batch_size, num_steps=self.num_steps,
            progress=False, all_processes=False)])
        res = self.metrics(imgs)
        out = {f"eval/{k}": float(v) for k, v in res.items() if not k.startswith("time_")}
        out["eval/time_s"] = time.time() - t
        return out


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
              data_split_images: str | None = None, classifier_config: Any = None,
              **gen_kw) -> dict:
    """CLI body of `--mode=eval` (see module doc). Prints and returns the results."""
    names = [m.strip() for m in metrics.split(",") if m.strip()]
    if num_images < 2:
        raise ValueError(f"--num_images={num_images}: the metrics need at least 2 images "
                         f"(FID-50k: --num_images=50000)")
    if ref and "fid" in names:  # a bad file fails now, not after generating the images
        from edm2_jax.metrics import fid
        fid.load_ref_stats(ref)
    if sum(map(bool, (images_dir, net_path, data_split_images))) != 1:
        raise ValueError("--mode=eval needs exactly one of --images=DIR, --net=PATH or "
                         "--data_split_images=SPLIT")
    if data_split_images:
        imgs = source_images(data_config, data_split_images, num_images, batch_size=batch_size)
    elif images_dir:
        imgs = folder_images(images_dir, num_images, batch_size)
    else:
        imgs = net_images(net_path, num_images, batch_size, ema=ema, num_steps=num_steps, **gen_kw)
    res = evaluate(imgs, num_images, names, ref=ref, data_config=data_config, ref_split=ref_split,
                   classifier_config=classifier_config)
    print(json.dumps(res, indent=2))
    if out_json:
        with open(out_json, "a") as f:
            f.write(json.dumps(dict(res, images=images_dir or data_split_images, net=net_path,
                                    ref_split=ref_split)) + "\n")
    return res
