"""The metrics of a set of generated images against a reference, by name.

Metric names: `fid` (reported as `fid{N}` when N != 50000 — an FID of fewer images is
biased upward and is never to be compared with FID-50k), `fd_dinov2` (FD_DINOv2, the
Frechet distance in DINOv2 ViT-L/14 features, `evaluation.dinov2`; `fd_dinov2{N}`
likewise; needs the weights file), `cls` (`fd_cls`, `kid_cls`, `precision_cls`,
`recall_cls` in the project classifier's penultimate features,
`evaluation.classifier_metrics`; never FID).

`Metrics` prepares the reference side once (statistics, or the classifier and the
reference features) so that repeated calls pay only for the generated images;
`evaluate` is one call of it on a stream of batches.

Reference data from a latent data set are the SD VAE's decodes of each stored latent's
mean (`images.DecodedSource`): reconstructions, not the original pixels; for the paper's
figures give `ref` (statistics of the real images).
"""
from __future__ import annotations

import time
from typing import Any, Iterator, Sequence

import numpy as np

from edm2_jax import data as data_lib
from edm2_jax.evaluation import classifier as cls_lib
from edm2_jax.evaluation import classifier_metrics
from edm2_jax.evaluation import dinov2 as dinov2_lib
from edm2_jax.evaluation import fid
from edm2_jax.evaluation import inception
from edm2_jax.evaluation.images import DecodedSource

FD_METRICS = ("fid", "fd_dinov2")  # Frechet distances with reference statistics
METRICS = FD_METRICS + ("cls",)


def metric_key(metric: str, num_images: int) -> str:
    """The result key of a Frechet-distance metric of `num_images` images: `fid` /
    `fd_dinov2` for 50,000 (the papers' protocol), else `fid{N}` / `fd_dinov2{N}` (biased
    upward with fewer images; never compare them with the 50k values)."""
    return metric if num_images == 50000 else f"{metric}{num_images}"


def feature_extractor(metric: str, dinov2: str | None = None):
    """`(params, feature_fn)` of a Frechet-distance metric, for
    `fid.stats_from_images`: Inception-v3 pool_3 for `fid`, DINOv2 ViT-L/14's
    class token for `fd_dinov2` (weights from `dinov2` or $EDM2_DINOV2_WEIGHTS).
    Raises FileNotFoundError naming the weights to install / download."""
    if metric == "fid":
        return inception.load_inception_params(), inception.features_uint8
    return dinov2_lib.load_dinov2(dinov2), dinov2_lib.features_uint8


class Metrics:
    """The metrics `names` (`fid`, `fd_dinov2`, `cls`) of sets of `num_images` generated
    images, with the reference side (Inception / DINOv2 statistics, or the classifier and
    its features of the reference split) prepared once at construction, so that repeated
    calls (evaluation during training, post-hoc EMA sweeps) only pay for the generated
    images.

    Args:
      names: metric names, any of `fid`, `fd_dinov2`, `cls`.
      num_images: generated images per call (names the result: `fid{N}`, see `metric_key`).
      ref: `fid` / `fd_dinov2` reference statistics (a release `.pkl` with both entries, or
        an `.npz` for `fid`); None = computed from `num_images` images of `data_config`'s
        `ref_split` split.
      dinov2: the DINOv2 ViT-L/14 weights file of `fd_dinov2` (`evaluation.dinov2`).
      data_config: the data section of a training config (source, path, ...); needed by
        `cls` (a labelled dataset: the classifier trains on its train split once, then is
        cached) and by `fid` without `ref`.
      ref_split: the reference split (`test` by default; `train` for a dataset floor).
      classifier_config: `classifier.TrainConfig` (None = its defaults).
      log: print progress of the one-off preparation.
      vae: an `SDVAE`; reference data from a latent data set are decoded by it
        (`DecodedSource`). Required for reference data of a latent data set.
    Raises ValueError for an unknown metric name, when reference data is missing or the
    reference file lacks a metric's entry; FileNotFoundError without the DINOv2 weights.
    """

    def __init__(self, names: Sequence[str], num_images: int, *, ref: str | None = None,
                 data_config: Any = None, ref_split: str = "test",
                 classifier_config: Any = None, log: bool = True,
                 dinov2: str | None = None, vae: Any = None):
        self.vae = vae
        self.names = [n.strip() for n in names if n.strip()]
        unknown = sorted(set(self.names) - set(METRICS))
        if unknown:
            raise ValueError(f"unknown metrics {unknown}; valid: {', '.join(METRICS)}")
        self.num_images = int(num_images)
        self.info: dict = {}
        self._data_config, self._ref_split = data_config, ref_split
        self._fd: dict = {}  # metric -> (params, feature_fn, reference statistics)
        for metric in (m for m in FD_METRICS if m in self.names):
            t = time.time()
            params, feature_fn = feature_extractor(metric, dinov2)
            if ref:
                fid.load_ref_stats(ref, metric)  # a missing entry fails now
                ref_stats = ref
            else:
                ref_stats = fid.stats_from_source(self._source(ref_split), params,
                                                  num_images=self.num_images,
                                                  feature_fn=feature_fn)
            self._fd[metric] = (params, feature_fn, ref_stats)
            self.info[f"time_{metric}_ref_s"] = time.time() - t
        if "cls" in self.names:
            t = time.time()
            kw = {} if classifier_config is None else {"config": classifier_config}
            self._clf, acc = cls_lib.get_classifier(self._source("train"), self._source("test"),
                                                    log=log, **kw)
            self.info["classifier_test_accuracy"] = acc
            ref_imgs = cls_lib.source_arrays(self._source(ref_split), max_items=None)[0]
            self._cls_ref = self._clf.features(self._clf.check_images(ref_imgs, "reference"))
            self.info["time_cls_ref_s"] = time.time() - t

    def _source(self, split: str):
        if self._data_config is None:
            raise ValueError("this metric needs reference data: pass --config (its data "
                             "section) or --ref")
        src = data_lib.make_source(dict(dict(self._data_config), split=split))
        if getattr(src, "encoder", "none") == "sd-vae":
            if self.vae is None:
                raise ValueError(f"the reference data {src.path} are SD-VAE latents: decoding "
                                 f"them needs the VAE (--vae=PATH, or config.eval.vae during "
                                 f"training), or give --ref statistics of the real images")
            return DecodedSource(src, self.vae)
        return src

    def __call__(self, images: np.ndarray) -> dict:
        """Metrics of uint8 `[num_images, H, W, C]` images: a flat dict of floats with
        `fid{N}`, `fd_dinov2{N}` and / or `fd_cls`, `kid_cls`, `precision_cls`,
        `recall_cls`, plus the wall time of each (`time_fid_s`, `time_fd_dinov2_s`,
        `time_cls_s`). Raises ValueError for another number of images."""
        if len(images) != self.num_images:
            raise ValueError(f"got {len(images)} images, the metrics were set up for "
                             f"{self.num_images}")
        out: dict = {}
        for metric, (params, feature_fn, ref_stats) in self._fd.items():
            t = time.time()
            gen = fid.stats_from_images([images[i:i + 64] for i in range(0, len(images), 64)],
                                        params, feature_fn)
            out[metric_key(metric, self.num_images)] = fid.fid_from_stats(gen, ref_stats, metric)
            out[f"time_{metric}_s"] = time.time() - t
        if "cls" in self.names:
            t = time.time()
            out.update(classifier_metrics.evaluate_features_metrics(images, self._cls_ref,
                                                                    self._clf))
            out["time_cls_s"] = time.time() - t
        return out


def evaluate(images: Iterator[np.ndarray], num_images: int, metrics: list[str], *,
             ref: str | None = None, data_config: Any = None, ref_split: str = "test",
             classifier_config: Any = None, dinov2: str | None = None,
             vae: Any = None) -> dict:
    """Compute `metrics` over `images` (uint8 NHWC batches, `num_images` in all).

    `fid` / `fd_dinov2` need `ref` (a reference .pkl/.npz) or `data_config` (reference
    statistics are then computed from that dataset, `ref_split` split); `fd_dinov2` also
    the DINOv2 weights file `dinov2`. `cls` needs a labelled
    `data_config` (the classifier trains on its train split once, then is cached; the
    reference set is `ref_split`; `classifier_config` a `classifier.TrainConfig`).
    Returns a flat dict of floats, plus wall times.
    Raises ValueError for an unknown metric or fewer than `num_images` images.
    """
    suite = Metrics(metrics, num_images, ref=ref, data_config=data_config, ref_split=ref_split,
                    classifier_config=classifier_config, dinov2=dinov2, vae=vae)
    results: dict = {"num_images": num_images, **suite.info}
    t = time.time()
    gen = np.concatenate(list(images))[:num_images]
    results["time_generate_s"] = time.time() - t
    if len(gen) < num_images:
        raise ValueError(f"only {len(gen)} images available, --num_images={num_images}")
    results.update(suite(gen))
    return results
