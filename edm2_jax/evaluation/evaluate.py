"""`--mode=eval`: metrics of an image folder or of a network (generating on the fly).

    # FID (Inception-v3, the release's protocol) of 50k images of a net vs reference stats:
    python -m edm2_jax.main --mode=eval --net=nets/img64-s --ref=img64.pkl --num_images=50000
    # Small-data metrics in a project-trained classifier's features (Fashion-MNIST):
    python -m edm2_jax.main --mode=eval --net=runs/fmnist --metrics=cls,fid --num_images=2000 \
        --config=configs/fashion_mnist.py
    # An image folder instead of a network:
    python -m edm2_jax.main --mode=eval --images=out/ --ref=img64.pkl
    # FD_DINOv2 (and FID) against the release's img512 statistics:
    python -m edm2_jax.main --mode=eval --images=out/ --metrics=fid,fd_dinov2 \
        --ref=img512.pkl --dinov2=dinov2_vitl14_pretrain.pth
    # Reference statistics of a dataset in the release's .pkl format (both metrics):
    python -m edm2_jax.main --mode=ref --images=imagenet512/ --ref=img512.pkl \
        --metrics=fid,fd_dinov2 --dinov2=dinov2_vitl14_pretrain.pth
    # Autoguidance, the seeds of the release's FID protocol:
    python -m edm2_jax.main --mode=eval --net=nets/img64-s --guide=nets/img64-xs \
        --guidance=1.4 --seeds=0-49999 --ref=img64.pkl
    # An image folder instead of a network (a random subset of 50000 when it holds more,
    # the same files as the release's `calculate_metrics.py --seed=0` picks):
    python -m edm2_jax.main --mode=eval --images=out/ --ref=img64.pkl --subset_seed=0

Metric names: `fid` (reported as `fid{N}` when N != 50000 — an FID of fewer images is
biased upward and is never to be compared with FID-50k), `fd_dinov2` (FD_DINOv2, the
Frechet distance in DINOv2 ViT-L/14 features, `metrics.dinov2`; `fd_dinov2{N}` likewise;
needs the weights file, `--dinov2=PATH`), `cls` (`fd_cls`, `kid_cls`, `precision_cls`,
`recall_cls` in the classifier's penultimate features; never FID).

Latent (img512) networks: their samples are decoded to RGB by the SD VAE (`--vae=PATH`,
`config.eval.vae` during training; `generate.check_vae`: a latent net without it fails
before anything heavy, naming `--vae`) and measured as uint8 RGB. Reference data from a
latent data set (no `--ref`) are the VAE's decodes of each stored latent's mean
(`DecodedSource`): reconstructions, not the original pixels; for the paper's figures give
`--ref` (statistics of the real images, `--mode=ref --images=...`).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator, Sequence

import numpy as np

from edm2_jax import paths

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def folder_subset(path: str, num_images: int, seed: int = 0) -> list[str]:
    """The image files of a folder (recursive; `IMAGE_SUFFIXES`) that an evaluation of
    `num_images` of them uses, in sorted order: all of them when there are exactly
    `num_images`, else the release's seeded random subset (`calculate_metrics.py --seed`:
    the sorted file list indexed by the sorted first `num_images` entries of
    `np.random.RandomState(seed mod 2^31).permutation(count)`).

    Raises ValueError when the folder holds fewer than `num_images` images.
    """
    if paths.is_url(path):  # gs://...: the same relative names, listed through epath
        root, todo, found = paths.Path(path), [paths.Path(path)], []
        while todo:  # breadth first: epath refuses `**` patterns on GCS
            for p in todo.pop().iterdir():
                if p.is_dir():
                    todo.append(p)
                elif p.name.lower().endswith(IMAGE_SUFFIXES):
                    found.append(str(p.relative_to(root)))
        files = sorted(found)
    else:
        files = sorted(os.path.relpath(os.path.join(r, f), path) for r, _, fs in os.walk(path)
                       for f in fs if f.lower().endswith(IMAGE_SUFFIXES))
    if len(files) < num_images:
        raise ValueError(f"{path} holds {len(files)} images, fewer than --num_images="
                         f"{num_images}; generate more or lower --num_images")
    idx = np.arange(len(files))
    if len(files) > num_images:
        idx = np.sort(np.random.RandomState(seed % (1 << 31)).permutation(len(files))[:num_images])
    return [f"{path.rstrip('/')}/{files[i]}" if paths.is_url(path) else os.path.join(path, files[i])
            for i in idx]


def folder_images(path: str, num_images: int, batch_size: int = 64,
                  seed: int = 0) -> Iterator[np.ndarray]:
    """uint8 NHWC batches of `num_images` images of a folder, the seeded random subset of
    `folder_subset`. Raises its ValueError."""
    import PIL.Image

    def read(f):
        if not paths.is_url(f):
            return np.asarray(PIL.Image.open(f))
        with paths.open(f, "rb") as fh:
            return np.asarray(PIL.Image.open(fh))

    files = folder_subset(path, num_images, seed)
    for i in range(0, num_images, batch_size):
        batch = [read(f) for f in files[i:i + batch_size]]
        yield np.stack([b[..., None] if b.ndim == 2 else b for b in batch])


def net_images(net_path: str, seeds: Sequence[int], batch_size: int = 64,
               ema: str | None = None, num_steps: int = 32, guide_path: str | None = None,
               guide_ema: str | None = None, guidance: float = 1.0, vae: Any = None,
               **gen_kw) -> Iterator[np.ndarray]:
    """uint8 NHWC batches of the images `net_path` generates for `seeds` (guided by
    `guide_path` with weight `guidance`; `generate.load_guide`), decoded to RGB by `vae`
    (an `SDVAE`, for a latent net; `generate.check_vae`); `gen_kw`: the other
    arguments of `generate.generate_images` (class_idx, sampler settings)."""
    from edm2_jax.sampling import generate
    net, variables, desc = generate.load_net(net_path, ema)
    guide = generate.load_guide(guide_path, guide_ema, guidance)
    print(f"Generating {len(seeds)} images from {desc}")
    for _, imgs in generate.generate_images(net, variables, list(seeds), batch_size=batch_size,
                                            num_steps=num_steps, guide=guide, guidance=guidance,
                                            vae=vae, **gen_kw):
        yield imgs


def fid_name(num_images: int) -> str:
    return "fid" if num_images == 50000 else f"fid{num_images}"


FD_METRICS = ("fid", "fd_dinov2")  # Frechet distances with reference statistics
METRICS = FD_METRICS + ("cls",)


def metric_key(metric: str, num_images: int) -> str:
    """The result key of a Frechet-distance metric of `num_images` images: `fid` /
    `fd_dinov2` for 50,000 (the papers' protocol), else `fid{N}` / `fd_dinov2{N}` (biased
    upward with fewer images; never compare them with the 50k values)."""
    return metric if num_images == 50000 else f"{metric}{num_images}"


def feature_extractor(metric: str, dinov2: str | None = None):
    """`(params, feature_fn)` of a Frechet-distance metric, for
    `metrics.fid.stats_from_images`: Inception-v3 pool_3 for `fid`, DINOv2 ViT-L/14's
    class token for `fd_dinov2` (weights from `dinov2` or $EDM2_DINOV2_WEIGHTS).
    Raises FileNotFoundError naming the weights to install / download."""
    if metric == "fid":
        from edm2_jax.evaluation import inception
        return inception.load_inception_params(), inception.features_uint8
    from edm2_jax.evaluation import dinov2 as dinov2_lib
    return dinov2_lib.load_dinov2(dinov2), dinov2_lib.features_uint8


class DecodedSource:
    """A latent data `Source` (`LatentFolder`) seen as uint8 RGB images: item `i` is the
    SD VAE's decode of its stored mean (`encode_latents(raw, noise=0)`), with its label;
    the reference images of metrics on a latent data set (reconstructions, not the
    original pixels). Decodes `chunk` items at a time and keeps the last chunk."""

    def __init__(self, source: Any, vae: Any, chunk: int = 64):
        self.source, self.vae, self.chunk = source, vae, int(chunk)
        self.name = f"{getattr(source, 'name', 'latents')} (VAE-decoded)"
        self.label_dim = getattr(source, "label_dim", 0)
        self._cache: tuple[int, np.ndarray, list] | None = None

    def __len__(self) -> int:
        return len(self.source)

    @property
    def num_images(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        from edm2_jax.model import vae as vae_lib
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for {self.name} with {len(self)} items")
        a = i - i % self.chunk
        if self._cache is None or self._cache[0] != a:
            items = [self.source[j] for j in range(a, min(a + self.chunk, len(self)))]
            raw = np.stack([x for x, _ in items]).astype(np.float32)
            x = vae_lib.encode_latents(raw, np.zeros(raw.shape[:-1] + (vae_lib.LATENT_CHANNELS,),
                                                     np.float32))
            self._cache = (a, self.vae.decode(x), [lab for _, lab in items])
        return self._cache[1][i - a], self._cache[2][i - a]


class Metrics:
    """The metrics `names` (`fid`, `cls`) of sets of `num_images` generated images, with
    the reference side (Inception statistics, or the classifier and its features of the
    reference split) prepared once at construction, so that repeated calls (evaluation
    during training, post-hoc EMA sweeps) only pay for the generated images.

    Args:
      names: metric names, any of `fid`, `fd_dinov2`, `cls`.
      num_images: generated images per call (names the result: `fid{N}`, see `metric_key`).
      ref: `fid` / `fd_dinov2` reference statistics (a release `.pkl` with both entries, or
        an `.npz` for `fid`); None = computed from `num_images` images of `data_config`'s
        `ref_split` split.
      dinov2: the DINOv2 ViT-L/14 weights file of `fd_dinov2` (`metrics.dinov2`).
      data_config: the data section of a training config (source, path, ...); needed by
        `cls` (a labelled dataset: the classifier trains on its train split once, then is
        cached) and by `fid` without `ref`.
      ref_split: the reference split (`test` by default; `train` for a dataset floor).
      classifier_config: `metrics.classifier.TrainConfig` (None = its defaults).
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
            from edm2_jax.evaluation import fid
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
            from edm2_jax.evaluation import classifier as cls_lib
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
            from edm2_jax.evaluation import fid
            t = time.time()
            gen = fid.stats_from_images([images[i:i + 64] for i in range(0, len(images), 64)],
                                        params, feature_fn)
            out[metric_key(metric, self.num_images)] = fid.fid_from_stats(gen, ref_stats, metric)
            out[f"time_{metric}_s"] = time.time() - t
        if "cls" in self.names:
            from edm2_jax.evaluation import classifier as cls_lib
            t = time.time()
            out.update(cls_lib.evaluate_features_metrics(images, self._cls_ref, self._clf))
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


class TrainingEval:
    """Evaluation during training: the `config.eval.metrics` of `config.eval.num_images`
    images generated by an EMA of the run at every snapshot, logged with the other stats
    under `eval/` (e.g. `eval/fd_cls`, `eval/fid1000`).

    `config.eval` fields: `metrics` ('' = off, or a comma list of 'cls', 'fid',
    'fd_dinov2'), `dinov2` (the DINOv2 weights file of 'fd_dinov2'), `num_images`,
    `sigma_rel` (the power EMA to evaluate, 0 = the largest tracked), `num_steps` (Heun
    steps), `batch_size`, `seed` (first seed; the same seeds at every snapshot),
    `ref_split`, `classifier_epochs`, `classifier_batch_size`, `vae` (the SD VAE that
    decodes a latent run's samples and reference latents to RGB before measuring;
    required when `data.encoder='sd-vae'`, refused otherwise).

    Construction prepares the references (and trains the classifier once if it is not
    cached), so a config error or a missing dataset fails before the first step.
    Raises ValueError for an unknown metric, an untracked `sigma_rel` or `num_images`
    below 4.
    """

    @staticmethod
    def ema_key_of(config: Any) -> str:
        """The EMA key (`ema.ema_key`) that `config.eval` evaluates. Raises ValueError
        when `eval.sigma_rel` is not tracked."""
        from edm2_jax.ema import power as ema_lib
        tracked = [float(s) for s in config.ema.sigma_rels]
        sigma_rel = float(config.eval.sigma_rel) or max(tracked)
        if not any(abs(sigma_rel - s) < 1e-9 for s in tracked):
            raise ValueError(f"eval.sigma_rel={sigma_rel} is not a tracked EMA "
                             f"(ema.sigma_rels={tracked}); pick one of them or 0 (largest)")
        return ema_lib.ema_key(sigma_rel)

    def __init__(self, config: Any, log: bool = True):
        from edm2_jax.evaluation import classifier as cls_lib
        e = config.eval
        self.num_images, self.num_steps = int(e.num_images), int(e.num_steps)
        self.batch_size, self.seed = int(e.batch_size), int(e.seed)
        if self.num_images < 4:
            raise ValueError(f"eval.num_images={self.num_images}: need at least 4 images")
        self.ema_key = self.ema_key_of(config)
        self.vae = self.vae_of(config)
        t = time.time()
        clf_config = cls_lib.TrainConfig(epochs=int(e.classifier_epochs),
                                         batch_size=int(e.classifier_batch_size))
        self.metrics = Metrics(str(e.metrics).split(","), self.num_images,
                               data_config=config.data, ref_split=str(e.ref_split),
                               classifier_config=clf_config, log=log,
                               dinov2=str(e.get("dinov2", "")) or None, vae=self.vae)
        if log:
            print(f"Evaluation during training: {self.metrics.names} of {self.num_images} "
                  f"images of EMA sigma_rel={self.ema_key} ({self.num_steps} steps) at every "
                  f"snapshot, vs the {e.ref_split} split [set up in {time.time() - t:.1f} s]")

    @staticmethod
    def vae_of(config: Any) -> Any:
        """The `SDVAE` of `config.eval.vae` for a latent run (`data.encoder='sd-vae'`),
        None for a pixel-space run. Raises ValueError when a latent run has none or a
        pixel-space run has one; `vae.load_vae`'s errors for a bad file."""
        from edm2_jax.model import vae as vae_lib
        path = str(config.eval.get("vae", "") or "")
        latent = str(config.data.get("encoder", "none") or "none") == "sd-vae"
        if latent and not path:
            raise ValueError(f"eval.metrics={config.eval.metrics!r} on a latent run "
                             f"(data.encoder='sd-vae'): its samples must be decoded to RGB "
                             f"before measuring; set --config.eval.vae=PATH (the SD VAE, as "
                             f"--vae; {vae_lib.SD_VAE_URL}) or --config.eval.metrics=''")
        if path and not latent:
            raise ValueError(f"eval.vae={path} given, but the run is in pixel space "
                             f"(data.encoder='none'); drop --config.eval.vae")
        return vae_lib.load_vae(path) if latent else None

    def __call__(self, net: Any, variables: dict) -> dict:
        """Generate (and decode, for a latent run) and measure; returns `{'eval/<metric>': float, ...}` including
        `eval/time_s` (generation and metrics)."""
        from edm2_jax.sampling import generate
        t = time.time()
        seeds = list(range(self.seed, self.seed + self.num_images))
        imgs = np.concatenate([b for _, b in generate.generate_images(
            net, variables, seeds, batch_size=self.batch_size, num_steps=self.num_steps,
            progress=False, all_processes=False, vae=self.vae)])
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


def _is_latent_data(data_config: Any) -> bool:
    return bool(data_config) and str(dict(data_config).get("encoder") or "none") == "sd-vae"


def _vae_for_data(vae_path: str | None, data_config: Any) -> Any:
    """Without a `--net`: the VAE that decodes latent reference / split data, or None.
    Raises ValueError for `--vae` with pixel data (nothing to decode)."""
    from edm2_jax.model import vae as vae_lib
    if not vae_path:
        return None
    if not _is_latent_data(data_config):
        raise ValueError(f"--vae={vae_path} decodes a latent net's samples or latent data, "
                         f"but there is neither here (no --net, and the --config data are "
                         f"pixels); drop --vae")
    return vae_lib.load_vae(vae_path)


def _decoded_batches(data_config: Any, split: str, num_images: int, vae: Any,
                     batch_size: int) -> Iterator[np.ndarray]:
    """`source_images` of a latent data set, decoded to RGB (`DecodedSource`)."""
    from edm2_jax import data as data_lib
    src = DecodedSource(data_lib.make_source(dict(data_config, split=split)), vae, batch_size)
    if len(src) < num_images:
        raise ValueError(f"{src.name} has {len(src)} images, fewer than --num_images={num_images}")
    idx = np.sort(np.random.RandomState(0).choice(len(src), num_images, replace=False))
    for i in range(0, num_images, batch_size):
        yield np.stack([src[j][0] for j in idx[i:i + batch_size]])


def main_eval(*, images_dir: str | None, net_path: str | None, num_images: int | None,
              metrics: str, ref: str | None, data_config: Any, ema: str | None = None,
              batch_size: int = 64, num_steps: int = 32, out_json: str | None = None,
              ref_split: str = "test", data_split_images: str | None = None,
              classifier_config: Any = None, seeds: str | Sequence[int] | None = None,
              subset_seed: int = 0, dinov2: str | None = None, vae_path: str | None = None,
              **gen_kw) -> dict:
    """CLI body of `--mode=eval` (see module doc). Prints and returns the results.

    `seeds` (`'0-49999'` or ints; default `0 .. num_images - 1`) are the seeds a `--net`
    generates; `num_images` None means `len(seeds)`. `subset_seed` picks the random
    subset of an `--images` folder (`folder_subset`). `vae_path`: `--vae`, the SD VAE that
    decodes a latent net's samples (checked first, `generate.check_vae`) and latent
    reference data. `gen_kw`: `net_images`'s (guide_path, guide_ema, guidance, class_idx,
    sampler settings). Raises ValueError when `seeds` and `num_images` disagree, for a
    latent net without `--vae` or a pixel-space net with one."""
    from edm2_jax.sampling import generate
    names = [m.strip() for m in metrics.split(",") if m.strip()]
    if net_path:  # before anything heavy: a latent net needs --vae, an RGB net refuses it
        vae = generate.check_vae(net_path, vae_path, gen_kw.get("guide_path"))
    else:
        vae = _vae_for_data(vae_path, data_config)
    if seeds is not None:
        seeds = generate.parse_seeds(seeds) if isinstance(seeds, str) else list(seeds)
        if not net_path:
            raise ValueError("--seeds chooses the seeds a --net generates; for --images the "
                             "random subset is chosen by --subset_seed")
        num_images = len(seeds) if num_images is None else num_images
        if len(seeds) != num_images:
            raise ValueError(f"--seeds gives {len(seeds)} seeds but --num_images={num_images}; "
                             f"give one of them, or make them agree")
    num_images = 50000 if num_images is None else num_images
    if num_images < 2:
        raise ValueError(f"--num_images={num_images}: the metrics need at least 2 images "
                         f"(FID-50k: --num_images=50000)")
    for metric in (m for m in FD_METRICS if m in names):
        # A bad file fails now, not after generating the images.
        if ref:
            from edm2_jax.evaluation import fid
            fid.load_ref_stats(ref, metric)
        if metric == "fd_dinov2":
            from edm2_jax.evaluation import dinov2 as dinov2_lib
            dinov2_lib.load_dinov2(dinov2)
    if sum(map(bool, (images_dir, net_path, data_split_images))) != 1:
        raise ValueError("--mode=eval needs exactly one of --images=DIR, --net=PATH or "
                         "--data_split_images=SPLIT")
    if data_split_images:
        imgs = source_images(data_config, data_split_images, num_images, batch_size=batch_size)
    elif images_dir:
        imgs = folder_images(images_dir, num_images, batch_size, seed=subset_seed)
    else:
        imgs = net_images(net_path, seeds or range(num_images), batch_size, ema=ema,
                          num_steps=num_steps, vae=vae, **gen_kw)
    if data_split_images and vae is None and _is_latent_data(data_config):
        raise ValueError(f"--data_split_images={data_split_images}: the --config data are "
                         f"SD-VAE latents; pass --vae=PATH to decode them to RGB")
    if data_split_images and vae is not None:
        imgs = (b for b in _decoded_batches(data_config, data_split_images, num_images, vae,
                                            batch_size))
    res = evaluate(imgs, num_images, names, ref=ref, data_config=data_config, ref_split=ref_split,
                   classifier_config=classifier_config, dinov2=dinov2, vae=vae)
    print(json.dumps(res, indent=2))
    if out_json:
        line = json.dumps(dict(res, images=images_dir or data_split_images, net=net_path,
                               ref_split=ref_split, guide=gen_kw.get("guide_path"),
                               guidance=gen_kw.get("guidance", 1.0))) + "\n"
        if paths.is_url(out_json):  # object storage cannot append: rewrite the object
            before = paths.read_text(out_json) if paths.exists(out_json) else ""
            paths.write_text_atomic(out_json, before + line)
        else:
            with open(out_json, "a") as f:
                f.write(line)
    return res


def main_ref(*, dest: str, images_dir: str | None, data_config: Any, split: str,
             metrics: str = "fid,fd_dinov2", num_images: int | None = None,
             batch_size: int = 64, dinov2: str | None = None, seed: int = 0) -> dict:
    """CLI body of `--mode=ref`: reference statistics of a dataset, written to `dest` in
    the release's format (`calculate_metrics.py ref`: a `.pkl` `{'num_images': N, 'fid':
    {'mu', 'sigma'}, 'fd_dinov2': {'mu', 'sigma'}}`, readable by the release and by
    `--ref`).

    Args: dest: `.pkl` (or `.npz` for `fid` alone); images_dir: a folder of images, else
      the `split` split of `data_config`; metrics: comma list of `fid`, `fd_dinov2`;
      num_images: a random subset (seeded) of this many images, None = all (the release
      uses all); dinov2: the DINOv2 weights file.
    Returns `{'num_images': N, 'time_s': seconds}`.
    Raises ValueError for another metric, a missing source or too few images;
    FileNotFoundError for missing weights.
    """
    from edm2_jax.evaluation import fid
    names = [m.strip() for m in metrics.split(",") if m.strip()]
    bad = sorted(set(names) - set(FD_METRICS))
    if bad or not names:
        raise ValueError(f"--mode=ref computes statistics of {', '.join(FD_METRICS)}; got "
                         f"--metrics={metrics}")
    if not dest.lower().endswith((".pkl", ".npz")):
        raise ValueError(f"--ref={dest}: the statistics are written to a .pkl (the release's "
                         f"format) or an .npz (fid only)")
    t = time.time()
    # The source is checked (missing, latent) before any weights load, so that its error
    # is the one the user sees; the extractors then load before any image is read.
    if images_dir:
        from edm2_jax import data as data_lib
        source = data_lib.make_source({"source": "folder", "path": images_dir,
                                       "use_labels": False})
    elif data_config is not None:
        from edm2_jax import data as data_lib
        source = data_lib.make_source(dict(dict(data_config), split=split))
        if getattr(source, "encoder", "none") == "sd-vae":
            raise ValueError(f"{source.path} holds SD-VAE latents; reference statistics are of "
                             f"the real RGB images: give --images=the PNG data set they were "
                             f"encoded from (dataset_tool convert's output)")
    else:
        raise ValueError("--mode=ref needs the dataset: --images=DIR|ZIP or --config")
    extractors = {m: feature_extractor(m, dinov2) for m in names}
    stats = fid.stats_from_source_multi(source, extractors, num_images=num_images,
                                        batch_size=batch_size, seed=seed)
    fid.save_ref_stats(dest, stats)
    n = next(iter(stats.values())).num_items
    print(f"Reference statistics of {n} images ({', '.join(names)}) -> {dest}")
    return {"num_images": n, "time_s": time.time() - t}
