"""The metrics of a set of generated images against a reference, by name.

Metric names: `fid` (reported as `fid{N}` when N != 50000 — an FID of fewer images is
biased upward and is never to be compared with FID-50k), `fd_dinov2` (FD_DINOv2, the
Frechet distance in DINOv2 ViT-L/14 features, `evaluation.dinov2`; `fd_dinov2{N}`
likewise; needs the weights file), `cls` (`fd_cls`, `kid_cls`, `precision_cls`,
`recall_cls` in the project classifier's penultimate features,
`evaluation.classifier_metrics`; never FID).

`Metrics` prepares the reference side once (statistics, or the classifier and the
reference features) so that repeated calls pay only for the generated images;
`GeneratedFeatures` accumulates the generated side batch by batch (float64 feature
statistics, the classifier's features), so that no image set is ever held whole;
`evaluate` measures a stream of batches.

Reference data from a latent data set are the SD VAE's decodes of each stored latent's
mean (`images.DecodedSource`): reconstructions, not the original pixels; for the paper's
figures give `ref` (statistics of the real images).
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Sequence

import numpy as np
from tqdm import tqdm

from edm2_jax import data as data_lib
from edm2_jax.evaluation import classifier as cls_lib
from edm2_jax.evaluation import classifier_metrics
from edm2_jax.evaluation import dinov2 as dinov2_lib
from edm2_jax.evaluation import fid
from edm2_jax.evaluation import inception
from edm2_jax.evaluation import ref_cache
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


def check_ref(ref: str, metric: str, dinov2: str | None = None) -> None:
    """Before any image is generated: the reference statistics file `ref` holds `metric`'s
    entry (`fid.load_ref_stats`, which checks it is a mean and covariance) and its
    dimension is that of the metric's features (2048 for `fid`'s Inception pool_3; for
    `fd_dinov2`, the width of the DINOv2 network of `dinov2`, loaded here). Raises
    ValueError naming the file, both dimensions and the fix, and what `load_ref_stats`
    and `dinov2.load_dinov2` raise."""
    if metric == "fd_dinov2":
        dim, what = dinov2_lib.load_dinov2(dinov2).feature_dim, "DINOv2 ViT-L/14"
    else:
        dim, what = inception.FEATURE_DIM, "Inception-v3 pool_3"
    mu, _ = fid.load_ref_stats(ref, metric)
    if mu.shape[0] != dim:
        raise ValueError(f"--ref={ref}: its {metric} statistics are of {mu.shape[0]}-dimensional "
                         f"features, but {metric} measures the {dim}-dimensional {what} "
                         f"features; give the reference statistics of {metric} (the release's "
                         f"dataset-refs, or --mode=ref --metrics={metric} --ref=OUT.pkl)")


def feature_weights(metric: str, dinov2: str | None = None) -> str:
    """The weights file of `feature_extractor(metric, dinov2)` (part of the key of
    cached reference statistics, `ref_cache`)."""
    if metric == "fid":
        return str(inception.weights_path())
    return str(dinov2_lib.weights_path(dinov2))


class GeneratedFeatures:
    """The generated side of a `Metrics` suite, accumulated batch by batch (`add`), so
    that no set of images is ever held whole: per Frechet-distance metric a float64
    `FeatureStats` (sums: the statistics of two sets merge exactly, `merge`), and for
    `cls` the classifier's float32 features (KID and precision/recall need every vector:
    50,000 x 128 float32 = 25.6 MB), each with the id (seed) of its image.

    Attributes: `stats` (`{metric: FeatureStats}`), `ids` (int64 `[N]`, the seeds or
    running indices added, in order), `num_items`, `seconds` (`{metric: extraction wall
    time}`). `state()` / `load_state()` convert to and from a flat dict of arrays (the
    partial state of a resumable evaluation, `evaluation.stream`).
    """

    def __init__(self, extractors: dict[str, tuple[Any, Any]], classifier: Any = None):
        self._extractors, self._clf = dict(extractors), classifier
        self.stats = {m: fid.FeatureStats() for m in self._extractors}
        self.seconds = {m: 0.0 for m in [*self._extractors, *(["cls"] if classifier else [])]}
        self._cls: list[np.ndarray] = []
        self._ids: list[np.ndarray] = []
        self._batch: int | None = None  # every extractor call padded to this: one compile

    @property
    def num_items(self) -> int:
        return int(sum(len(i) for i in self._ids))

    @property
    def ids(self) -> np.ndarray:
        return np.concatenate(self._ids) if self._ids else np.zeros(0, np.int64)

    def add(self, images: np.ndarray, ids: Sequence[int] | None = None) -> None:
        """Add uint8 `[n, H, W, C]` images with their ids (seeds; default the running
        index). Every feature is extracted before any statistic changes, so an exception
        (or Ctrl-C) while extracting leaves the accumulated state as it was.
        Raises ValueError for images the extractors refuse, or `len(ids) != n`."""
        images = np.asarray(images)
        n = len(images)
        ids = np.arange(self.num_items, self.num_items + n) if ids is None else ids
        ids = np.asarray(ids, np.int64)
        if ids.shape != (n,):
            raise ValueError(f"{n} images but {ids.shape} ids")
        if n == 0:
            return
        self._batch = self._batch or n
        padded = images
        if n < self._batch:
            padded = np.concatenate([images, np.zeros((self._batch - n, *images.shape[1:]),
                                                      images.dtype)])
        feats = {}
        for m, (params, feature_fn) in self._extractors.items():
            t = time.time()
            feats[m] = np.asarray(feature_fn(params, padded), np.float64)[:n]
            self.seconds[m] += time.time() - t
        if self._clf is not None:
            t = time.time()
            cls = self._clf.features(images, batch_size=max(self._batch, n))
            self.seconds["cls"] += time.time() - t
        for m, f in feats.items():
            self.stats[m].append(f)
        if self._clf is not None:
            self._cls.append(cls)
        self._ids.append(ids)

    def cls_features(self, order: Sequence[int] | None = None) -> np.ndarray:
        """The classifier features float32 `[N, D]`, in the order added or, with `order`
        (a list of every id), in that order. Raises ValueError when the ids are not
        exactly `order`'s."""
        feats = np.concatenate(self._cls) if self._cls else np.zeros((0, 0), np.float32)
        if order is None:
            return feats
        ids, order = self.ids, np.asarray(order, np.int64)
        if len(ids) != len(order) or not np.array_equal(np.sort(ids), np.sort(order)):
            raise ValueError(f"the features are of {len(ids)} ids, not the {len(order)} asked "
                             f"for (some missing or twice)")
        sorter = np.argsort(order, kind="stable")
        position = sorter[np.searchsorted(order, ids, sorter=sorter)]  # of each id in order
        return feats[np.argsort(position, kind="stable")]

    def merge(self, other: "GeneratedFeatures") -> "GeneratedFeatures":
        """Add another accumulator's images (another process's share, an earlier run's)."""
        for m in self.stats:
            self.stats[m].merge(other.stats[m])
            self.seconds[m] += other.seconds.get(m, 0.0)
        self._cls += other._cls
        self._ids += other._ids
        return self

    def state(self) -> dict[str, np.ndarray]:
        """Flat `{name: array}`: `ids`, `<metric>/num_items|mean|scatter` per Frechet
        metric, `cls/features` (float32 `[N, D]`) with `cls`."""
        out = {"ids": self.ids}
        for m, s in self.stats.items():
            out.update({f"{m}/{k}": v for k, v in s.state().items()})
        if self._clf is not None:
            out["cls/features"] = self.cls_features()
        return out

    def load_state(self, state: dict) -> "GeneratedFeatures":
        """Replace the accumulated images by those of `state()` (as read back from an
        `.npz`). Raises KeyError for a state of other metrics, ValueError for one whose
        counts disagree; `self` is then unchanged."""
        stats = {m: fid.FeatureStats.from_state({k: state[f"{m}/{k}"] for k in
                                                 ("num_items", "mean", "scatter")})
                 for m in self.stats}
        ids = np.asarray(state["ids"], np.int64)
        cls = [np.asarray(state["cls/features"], np.float32)] if self._clf else []
        if any(s.num_items != len(ids) for s in stats.values()) or (
                cls and len(cls[0]) != len(ids)):
            raise ValueError(f"a state of {len(ids)} ids with statistics of other counts")
        self.stats, self._ids, self._cls = stats, [ids], cls
        return self


class Metrics:
    """The metrics `names` (`fid`, `fd_dinov2`, `cls`) of sets of `num_images` generated
    images, with the reference side (Inception / DINOv2 statistics, or the classifier and
    its features of the reference split) prepared once at construction, so that repeated
    calls (evaluation during training, post-hoc EMA sweeps) only pay for the generated
    images. `features()` starts an accumulator of generated images (`GeneratedFeatures`)
    and `results()` measures it: the streamed form of a call.

    Args:
      names: metric names, any of `fid`, `fd_dinov2`, `cls`.
      num_images: generated images per call (names the result: `fid{N}`, see `metric_key`).
      ref: `fid` / `fd_dinov2` reference statistics (a release `.pkl` with both entries, or
        an `.npz` for `fid`); None = computed from `num_images` images of `data_config`'s
        `ref_split` split, once: they are cached (`ref_cache`).
      dinov2: the DINOv2 ViT-L/14 weights file of `fd_dinov2` (`evaluation.dinov2`).
      data_config: the data section of a training config (source, path, ...); needed by
        `cls` (a labelled dataset: the classifier trains on its train split once, then is
        cached) and by `fid` without `ref`.
      ref_split: the reference split (`test` by default; `train` for a dataset floor).
      classifier_config: `classifier.TrainConfig` (None = its defaults).
      log: print a line as each one-off stage starts, and tqdm bars where they loop.
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
        self._data_config, self._ref_split, self._log = data_config, ref_split, log
        self._extractors: dict = {}  # metric -> (params, feature_fn)
        self._ref: dict = {}  # metric -> reference statistics (a file or FeatureStats)
        for metric in (m for m in FD_METRICS if m in self.names):
            t = time.time()
            self._say(f"Loading the {metric} feature network"
                      + (f" {dinov2}" if metric == "fd_dinov2" and dinov2 else ""))
            self._extractors[metric] = feature_extractor(metric, dinov2)
            if ref:
                fid.load_ref_stats(ref, metric)  # a missing entry fails now
                self._ref[metric] = ref
            self.info[f"time_{metric}_ref_s"] = time.time() - t
        todo = {m: e for m, e in self._extractors.items() if m not in self._ref}
        if todo:  # cached, or one pass over the reference data for every metric
            t = time.time()
            self._ref.update(ref_cache.cached_stats_from_source(
                self._source(ref_split), todo,
                {m: feature_weights(m, dinov2) for m in todo},
                dict(dict(self._data_config), split=ref_split), self.num_images,
                progress=log, log=self._say))
            for m in todo:
                self.info[f"time_{m}_ref_s"] += time.time() - t
        if "cls" in self.names:
            t = time.time()
            kw = {} if classifier_config is None else {"config": classifier_config}
            self._clf, acc = cls_lib.get_classifier(self._source("train"), self._source("test"),
                                                    log=log, **kw)
            self.info["classifier_test_accuracy"] = acc
            src = self._source(ref_split)
            self._say(f"Classifier features of the {len(src)} reference images of {src.name}")
            feats = []
            with tqdm(total=len(src), unit="img", desc="classifier reference",
                      disable=not log, dynamic_ncols=True) as bar:
                for batch in cls_lib.source_batches(src):
                    feats.append(self._clf.features(self._clf.check_images(batch, "reference")))
                    bar.update(len(batch))
            self._cls_ref = np.concatenate(feats)
            self.info["time_cls_ref_s"] = time.time() - t

    def _say(self, line: str) -> None:
        if self._log:
            tqdm.write(line)

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
            self._say(f"The reference latents of {src.path} are decoded by the SD VAE")
            return DecodedSource(src, self.vae)
        return src

    def features(self) -> GeneratedFeatures:
        """An empty accumulator of generated images for `results`."""
        return GeneratedFeatures(self._extractors, self._clf if "cls" in self.names else None)

    def results(self, gen: GeneratedFeatures, order: Sequence[int] | None = None) -> dict:
        """Metrics of the `num_images` images accumulated in `gen`: a flat dict of floats
        with `fid{N}`, `fd_dinov2{N}` and / or `fd_cls`, `kid_cls`, `precision_cls`,
        `recall_cls`, plus the wall time of each (`time_fid_s`, `time_fd_dinov2_s`,
        `time_cls_s`: feature extraction and distance). `order`: the ids (seeds) in the
        order whose classifier features KID's random subsets index (default: as added).
        Raises ValueError for another number of images."""
        if gen.num_items != self.num_images:
            raise ValueError(f"got {gen.num_items} images, the metrics were set up for "
                             f"{self.num_images}")
        out: dict = {}
        for metric, ref_stats in self._ref.items():
            t = time.time()
            out[metric_key(metric, self.num_images)] = fid.fid_from_stats(
                gen.stats[metric], ref_stats, metric)
            out[f"time_{metric}_s"] = gen.seconds[metric] + time.time() - t
        if "cls" in self.names:
            t = time.time()
            out.update(classifier_metrics.features_metrics(gen.cls_features(order),
                                                           self._cls_ref))
            out["time_cls_s"] = gen.seconds["cls"] + time.time() - t
        return out

    def __call__(self, images: np.ndarray) -> dict:
        """`results` of uint8 `[num_images, H, W, C]` images (fed in batches of 64).
        Raises ValueError for another number of images."""
        if len(images) != self.num_images:
            raise ValueError(f"got {len(images)} images, the metrics were set up for "
                             f"{self.num_images}")
        gen = self.features()
        for i in range(0, len(images), 64):
            gen.add(images[i:i + 64])
        return self.results(gen)


def evaluate(images: Iterable[np.ndarray], num_images: int, metrics: list[str], *,
             ref: str | None = None, data_config: Any = None, ref_split: str = "test",
             classifier_config: Any = None, dinov2: str | None = None,
             vae: Any = None, log: bool = True, what: str = "") -> dict:
    """Compute `metrics` over `images` (uint8 NHWC batches, at least `num_images` in all;
    the first `num_images` count), batch by batch: features accumulate
    (`GeneratedFeatures`), the images are never all in memory; a tqdm bar (img, ETA)
    with `log`, after a line naming `what` (e.g. the folder).

    `fid` / `fd_dinov2` need `ref` (a reference .pkl/.npz) or `data_config` (reference
    statistics are then computed from that dataset, `ref_split` split); `fd_dinov2` also
    the DINOv2 weights file `dinov2`. `cls` needs a labelled
    `data_config` (the classifier trains on its train split once, then is cached; the
    reference set is `ref_split`; `classifier_config` a `classifier.TrainConfig`).
    Returns a flat dict of floats, plus wall times (`time_features_s`: reading the images
    and extracting their features).
    Raises ValueError for an unknown metric or fewer than `num_images` images.
    """
    suite = Metrics(metrics, num_images, ref=ref, data_config=data_config, ref_split=ref_split,
                    classifier_config=classifier_config, dinov2=dinov2, vae=vae, log=log)
    results: dict = {"num_images": num_images, **suite.info}
    t = time.time()
    gen = suite.features()
    if log:
        tqdm.write(f"Features of {num_images} images" + (f" of {what}" if what else ""))
    with tqdm(total=num_images, unit="img", desc="features", disable=not log,
              dynamic_ncols=True) as bar:
        for batch in images:
            batch = np.asarray(batch)[:num_images - gen.num_items]
            gen.add(batch)
            bar.update(len(batch))
            if gen.num_items == num_images:
                break
    results["time_features_s"] = time.time() - t
    if gen.num_items < num_images:
        raise ValueError(f"only {gen.num_items} images available, --num_images={num_images}")
    results.update(suite.results(gen))
    return results
