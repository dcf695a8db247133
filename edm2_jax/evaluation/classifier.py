"""The project's small image classifier of a labelled data set, trained once and cached:
the feature space of the `cls` metrics (`classifier_metrics`) on small data sets where
Inception-v3 is a poor judge.

Inception-v3 was trained on 299x299 ImageNet photographs; on 32x32 grey-scale
Fashion-MNIST its features say little. Instead a small CNN (`SmallCNN`) is trained on the
data set's own train split, checked on the test split and cached; `Classifier.features`
gives its normalised penultimate features.

    from edm2_jax import data
    from edm2_jax.evaluation import classifier
    train = data.make_source({'source': 'fashion_mnist', 'split': 'train'})
    test = data.make_source({'source': 'fashion_mnist', 'split': 'test'})
    clf, acc = classifier.get_classifier(train, test)  # the shipped weights: no training
    feats = clf.features(images_uint8)                 # [N, 128] float32

The Fashion-MNIST classifier of the default settings ships with the package
(`weights/fashion_mnist_classifier.npz`, `FASHION_MNIST`): `get_classifier` of the
Fashion-MNIST splits loads it without training, after checking the file's SHA-256, so that
`_cls` figures of the same images are the same on every machine (a classifier trained
locally follows the float32 summation order of the CPU that trains it). The command that
trains it, on the default `TrainConfig`, rebuilds the file and prints its checksum:

    python -m edm2_jax.evaluation.classifier --rebuild [--data-path DIR] [--out FILE]

Any other data set or setting trains its own classifier once and caches it in
`~/.cache/edm2_jax/classifier-<source>-<hash>/` (override with the `cache_dir` argument or
the EDM2_JAX_CACHE environment variable); the hash covers the architecture, the training
settings and the bytes of both splits, so a different data set or setting trains a new
classifier instead of silently reusing an old one.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import math
import os
import re
import tempfile
import time
import zipfile
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

Array = jax.Array
CACHE_VERSION = 1  # bump when the architecture or training procedure changes meaning


# ---------------------------------------------------------------------------------------
# Network.

def _max_pool_2x2(x: Array) -> Array:
    """2x2 max-pool, stride 2, of non-negative (post-ReLU) `[N, H, W, C]`; odd sides are
    zero-padded, which cannot change a maximum of non-negative values. A reshape + max is
    several times faster to differentiate on XLA:CPU than `nn.max_pool`."""
    n, h, w, c = x.shape
    x = jnp.pad(x, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)))
    return x.reshape(n, (h + 1) // 2, 2, (w + 1) // 2, 2, c).max(axis=(2, 4))


def num_stages(resolution: int) -> int:
    """Conv + 2x2 max-pool stages that bring `resolution` down to at most 4 pixels
    (32 -> 3 stages: 16, 8, 4). Raises ValueError for resolution < 4."""
    if resolution < 4:
        raise ValueError(f"the classifier needs images of at least 4x4 pixels, got {resolution}")
    return max(1, math.ceil(math.log2(resolution / 4)))


class SmallCNN(nn.Module):
    """Small image classifier: `num_stages(H)` stages of [3x3 'same' conv with bias, ReLU,
    2x2 max-pool]
    with widths `min(base_width * 2^i, max_width)`, flatten, Dense(feature_dim) (the raw
    features: pre-activations, so that units ReLU silences on the data still carry
    information), ReLU, Dense(num_classes) (the logits).

    Input: float32 `[N, H, W, C]` in [-1, 1] (`uint8 / 127.5 - 1`). Output: `(logits
    [N, num_classes], raw features [N, feature_dim])`, float32.
    """
    num_classes: int
    base_width: int = 16
    max_width: int = 64
    feature_dim: int = 128

    @nn.compact
    def __call__(self, x: Array) -> tuple[Array, Array]:
        for i in range(num_stages(x.shape[1])):
            width = min(self.base_width * 2 ** i, self.max_width)
            x = _max_pool_2x2(nn.relu(nn.Conv(width, (3, 3), padding="SAME")(x)))
        x = x.reshape(x.shape[0], -1)
        feats = nn.Dense(self.feature_dim)(x)
        return nn.Dense(self.num_classes)(nn.relu(feats)), feats


def _to_float(images_uint8: Array) -> Array:
    return images_uint8.astype(jnp.float32) / 127.5 - 1.0


# ---------------------------------------------------------------------------------------
# Trained classifier and feature extraction.

@dataclasses.dataclass
class Classifier:
    """A trained `SmallCNN` with its parameters.

    Fields: `module` (SmallCNN), `params` (pytree), `resolution`, `num_channels`
    (the image shape it accepts), `test_accuracy` (fraction in [0, 1] on the test split),
    `info` (dict: training settings, wall time, cache directory), `feature_shift`
    (float32 `[feature_dim]`) and `feature_scale` (float): `features()` returns
    `(raw - feature_shift) / feature_scale`, fixed once from the training split (its mean
    and RMS standard deviation) so that a typical `x.y / D` is O(1) as KID's cubic kernel
    assumes; a translation plus one common scale leaves precision/recall unchanged and
    makes FD read in units of the average training-feature variance.
    """
    module: SmallCNN
    params: Any
    resolution: int
    num_channels: int
    test_accuracy: float
    info: dict
    feature_shift: Any = 0.0
    feature_scale: float = 1.0

    def __post_init__(self):
        self._apply = jax.jit(lambda p, x: self.module.apply({"params": p}, _to_float(x)))

    @property
    def feature_dim(self) -> int:
        return self.module.feature_dim

    def check_images(self, images, what: str = "images") -> np.ndarray:
        """uint8 `[N, H, W, C]` matching the classifier, else ValueError naming the fix."""
        images = np.asarray(images)
        want = (self.resolution, self.resolution, self.num_channels)
        if images.dtype != np.uint8:
            raise ValueError(f"{what} must be uint8 [N, H, W, C] (got dtype {images.dtype}); "
                             f"decode network outputs with clip(x * 127.5 + 128, 0, 255)"
                             f".astype(uint8)")
        if images.ndim != 4 or images.shape[1:] != want:
            raise ValueError(f"{what} must be uint8 [N, {want[0]}, {want[1]}, {want[2]}] "
                             f"(NHWC) for this classifier, got shape {images.shape}")
        return images

    def _batched(self, images, batch_size: int, index: int) -> np.ndarray:
        images = self.check_images(images)
        out = []
        for i in range(0, len(images), batch_size):
            chunk = images[i:i + batch_size]
            n = len(chunk)
            if n < batch_size:  # pad to a fixed shape: one compilation for every call
                chunk = np.concatenate([chunk, np.zeros((batch_size - n, *chunk.shape[1:]),
                                                        np.uint8)])
            out.append(np.asarray(self._apply(self.params, chunk)[index])[:n])
        if not out:
            width = self.feature_dim if index == 1 else self.module.num_classes
            return np.zeros((0, width), np.float32)
        return np.concatenate(out)

    def features(self, images_uint8, batch_size: int = 500) -> np.ndarray:
        """Normalised penultimate-layer features (see the class docstring): uint8
        `[N, H, W, C]` -> float32 `[N, feature_dim]`. Raises ValueError for a wrong dtype or
        shape."""
        raw = self._batched(images_uint8, batch_size, 1)
        return ((raw - self.feature_shift) / self.feature_scale).astype(np.float32)

    def logits(self, images_uint8, batch_size: int = 500) -> np.ndarray:
        """Class logits: uint8 `[N, H, W, C]` -> float32 `[N, num_classes]`."""
        return self._batched(images_uint8, batch_size, 0)

    def accuracy(self, images_uint8, labels) -> float:
        """Fraction of `images_uint8` whose arg-max logit equals `labels [N]` (int)."""
        pred = self.logits(images_uint8).argmax(axis=1)
        return float(np.mean(pred == np.asarray(labels)))


def source_arrays(source, max_items: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """All images and labels of a data `Source` (see `edm2_jax.data.base`) as uint8
    `[N, H, W, C]` and int64 `[N]`; the first `max_items` if given. Uses the in-memory
    arrays of `FashionMNIST` directly, otherwise reads `source[i]` one by one."""
    n = len(source) if max_items is None else min(int(max_items), len(source))
    images, labels = getattr(source, "images", None), getattr(source, "labels", None)
    if (isinstance(images, np.ndarray) and isinstance(labels, np.ndarray)
            and len(images) == len(source) and images.ndim == 4):
        return images[:n], labels[:n].astype(np.int64)
    items = [source[i] for i in range(n)]
    return (np.stack([im for im, _ in items]) if items else np.zeros((0, 1, 1, 1), np.uint8),
            np.array([lab for _, lab in items], np.int64))


def source_batches(source, batch_size: int = 500):
    """The images of a data `Source` as uint8 `[<= batch_size, H, W, C]` batches in index
    order (slices of the in-memory arrays of `FashionMNIST`, else `source[i]` stacked), so
    that features of a large split are extracted without holding every image twice."""
    images = getattr(source, "images", None)
    in_memory = isinstance(images, np.ndarray) and len(images) == len(source) and images.ndim == 4
    for a in range(0, len(source), batch_size):
        b = min(a + batch_size, len(source))
        yield images[a:b] if in_memory else np.stack([source[i][0] for i in range(a, b)])


# ---------------------------------------------------------------------------------------
# Training and cache.

@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Classifier training settings (all part of the cache key)."""
    epochs: int = 3
    batch_size: int = 128
    learning_rate: float = 2e-3       # Adam, cosine-decayed to 0 over the run
    seed: int = 0
    max_train: int | None = None     # use only the first max_train training images
    base_width: int = 16
    max_width: int = 64
    feature_dim: int = 128
    num_norm: int = 10000             # training images that fix the feature normalisation


def _fingerprint(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _flatten(params, prefix="") -> dict:
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = np.asarray(v)
    return out


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for key, v in flat.items():
        *parents, leaf = key.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = jnp.asarray(v)
    return out


def default_cache_dir() -> str:
    return os.environ.get("EDM2_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                         "edm2_jax"))


def train_classifier(train_images: np.ndarray, train_labels: np.ndarray, num_classes: int,
                     config: TrainConfig = TrainConfig(), log: bool = True
                     ) -> tuple[SmallCNN, Any, float]:
    """Train `SmallCNN` with cross-entropy and Adam on uint8 `[N, H, W, C]` images and int
    labels `[N]` in `[0, num_classes)`. The last incomplete batch of an epoch is dropped.
    Returns `(module, params, wall_seconds)`. Raises ValueError on bad labels or too few
    images for one batch."""
    train_labels = np.asarray(train_labels, np.int64)
    if train_labels.min(initial=0) < 0 or train_labels.max(initial=0) >= num_classes:
        raise ValueError(f"classifier training needs labels in [0, {num_classes}); got range "
                         f"[{train_labels.min()}, {train_labels.max()}]. Open the source with "
                         f"use_labels=True")
    n, bs = len(train_images), config.batch_size
    if n < bs:
        raise ValueError(f"{n} training images is fewer than one batch of {bs}; lower "
                         f"batch_size")
    steps_per_epoch = n // bs
    total = steps_per_epoch * config.epochs
    module = SmallCNN(num_classes, config.base_width, config.max_width, config.feature_dim)
    t0 = time.time()
    params = module.init(jax.random.PRNGKey(config.seed),
                         jnp.zeros((1, *train_images.shape[1:]), jnp.float32))["params"]
    tx = optax.adam(optax.cosine_decay_schedule(config.learning_rate, total))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits, _ = module.apply({"params": p}, _to_float(x))
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(config.seed)
    if log:
        print(f"classifier: training SmallCNN on {n} images, {config.epochs} epochs of "
              f"{steps_per_epoch} steps", flush=True)
    # A bar over every step with its ETA (minutes on a CPU); a step is counted once the one
    # before it has finished, so the bar follows the computation, not the dispatch.
    bar = tqdm(total=total, unit="step", desc="classifier training", disable=not log,
               dynamic_ncols=True, mininterval=1.0)
    for epoch in range(config.epochs):
        perm = rng.permutation(n)
        losses = []
        for s in range(steps_per_epoch):
            idx = np.sort(perm[s * bs:(s + 1) * bs])
            params, opt_state, loss = step(params, opt_state, train_images[idx], train_labels[idx])
            if losses:
                losses[-1].block_until_ready()
                bar.update(1)
            losses.append(loss)
        losses[-1].block_until_ready()
        bar.update(1)
        if log:
            bar.write(f"classifier epoch {epoch + 1}/{config.epochs}: mean loss "
                      f"{float(np.mean(jax.device_get(losses))):.4f} ({time.time() - t0:.0f} s)")
    bar.close()
    params = jax.block_until_ready(params)
    return module, params, time.time() - t0


@dataclasses.dataclass(frozen=True)
class ShippedWeights:
    """A classifier whose weights ship with the package: `file` (a name under
    `WEIGHTS_DIR`), its `sha256` (hex, checked on every load) and `key` (`cache_key` of
    the data and settings it was trained on: `get_classifier` loads it for exactly those
    splits and that `TrainConfig`)."""
    file: str
    sha256: str
    key: str


WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")
REBUILD_COMMAND = "python -m edm2_jax.evaluation.classifier --rebuild"
# Fashion-MNIST (edm2_jax/data/fashion_mnist.py, the data of configs/fashion_mnist.py)
# with the default TrainConfig; written by `rebuild_fashion_mnist` (REBUILD_COMMAND).
FASHION_MNIST = ShippedWeights(
    file="fashion_mnist_classifier.npz",
    sha256="e2ddfcddb9b5267c54192cf46380cf014a3c3b59cc523e97b5c7aa017120fd71",
    key="59f74e9fb243539afb9732bde752eeb4f83221ed54cb188ca8e36b0ddc4bd9b9")
SHIPPED = (FASHION_MNIST,)


def cache_key(config: TrainConfig, num_classes: int, x_train, y_train, x_test, y_test) -> str:
    """SHA-256 (hex) of what a trained classifier depends on: the architecture's version,
    the training settings, the class count and the bytes of both splits' images and
    labels (from `source_arrays`)."""
    key = json.dumps({"version": CACHE_VERSION, "config": dataclasses.asdict(config),
                      "num_classes": num_classes, "train": _fingerprint(x_train, y_train),
                      "test": _fingerprint(x_test, y_test)}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()


def _sha256_file(path: str) -> tuple[str, bytes]:
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha256(data).hexdigest(), data


def save_weights(path: str, clf: "Classifier", meta: dict) -> str:
    """Write `clf` (parameters, feature normalisation) and `meta` (a JSON-able dict) to
    one `.npz` of plain arrays (no pickled objects; `meta` as a JSON string), with fixed
    zip timestamps so that the same weights always give the same bytes. Written to a
    temporary file and renamed. Returns the file's SHA-256 (hex)."""
    arrays = {f"params/{k}": v for k, v in _flatten(jax.device_get(clf.params)).items()}
    arrays.update(feature_shift=np.asarray(clf.feature_shift, np.float32),
                  feature_scale=np.asarray(clf.feature_scale, np.float64),
                  meta=np.asarray(json.dumps(meta, sort_keys=True)))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name in sorted(arrays):
            npy = io.BytesIO()
            np.lib.format.write_array(npy, np.array(arrays[name], order="C"),
                                      allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.create_system, info.external_attr = 3, 0o644 << 16
            z.writestr(info, npy.getvalue())
    data = buf.getvalue()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


def load_weights(path: str, sha256: str | None = None) -> "Classifier":
    """The classifier of a `save_weights` file. With `sha256`, the file's checksum must
    equal it: a ValueError names the file and how to rebuild it otherwise (a damaged,
    truncated or replaced file is never used). Reads arrays only (no pickle).
    `info` holds the file's `meta` with `cached=True`, `path`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"classifier weights {path} are missing: reinstall edm2-jax, "
                                f"or rebuild them with `{REBUILD_COMMAND}`")
    digest, data = _sha256_file(path)
    if sha256 is not None and digest != sha256:
        raise ValueError(
            f"classifier weights {path} have SHA-256 {digest}, not the expected {sha256}: "
            f"the file is damaged or not the one this version of edm2_jax ships. Reinstall "
            f"edm2-jax, or rebuild the file with `{REBUILD_COMMAND}` (minutes on a CPU) and "
            f"write the checksum it prints into edm2_jax/evaluation/classifier.py")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(arrays.pop("meta").item())
        shift, scale = arrays.pop("feature_shift"), float(arrays.pop("feature_scale").item())
        params = _unflatten({k[len("params/"):]: v for k, v in arrays.items()
                             if k.startswith("params/")})
        config = meta["config"]
        module = SmallCNN(int(meta["num_classes"]), config["base_width"], config["max_width"],
                          config["feature_dim"])
    except (ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        raise ValueError(f"classifier weights {path} are not a classifier file "
                         f"({type(e).__name__}: {e}); rebuild them with "
                         f"`{REBUILD_COMMAND}`") from e
    return Classifier(module, params, int(meta["resolution"]), int(meta["num_channels"]),
                      float(meta["test_accuracy"]), dict(meta, cached=True, path=path),
                      shift, scale)


def _train_and_measure(x_train, y_train, x_test, y_test, num_classes: int,
                       config: TrainConfig, log: bool) -> tuple["Classifier", dict]:
    """Train on the train split, measure on the test split, fix the feature
    normalisation. Returns `(classifier, meta)`; `meta['train_seconds']` is the wall
    time."""
    resolution, num_channels = x_train.shape[1], x_train.shape[3]
    module, params, seconds = train_classifier(x_train, y_train, num_classes, config, log)
    clf = Classifier(module, params, resolution, num_channels, 0.0, {})
    clf.test_accuracy = clf.accuracy(x_test, y_test)
    raw = clf.features(x_train[:config.num_norm])  # shift 0, scale 1 so far: raw features
    clf.feature_shift = raw.mean(axis=0)
    clf.feature_scale = float(np.sqrt(np.mean(raw.var(axis=0)))) or 1.0
    meta = {"test_accuracy": clf.test_accuracy, "train_seconds": seconds,
            "num_train": len(x_train), "num_test": len(x_test),
            "resolution": resolution, "num_channels": num_channels,
            "num_classes": num_classes, "config": dataclasses.asdict(config)}
    return clf, meta


def get_classifier(source_train, source_test, cache_dir: str | None = None,
                   config: TrainConfig = TrainConfig(), log: bool = True
                   ) -> tuple[Classifier, float]:
    """The project's classifier for a labelled data set: the shipped weights for the
    Fashion-MNIST splits with the default `config` (`SHIPPED`; checksum checked), else
    loaded from the cache, or trained on `source_train`, measured on `source_test` and
    cached.

    Args:
      source_train, source_test: data `Source`s with labels (`label_dim > 0`) and equal
        image shapes, e.g. `data.make_source({'source': 'fashion_mnist', 'split': 'train'})`.
      cache_dir: parent of the `classifier-<name>-<hash>/` directory; None = EDM2_JAX_CACHE
        or `~/.cache/edm2_jax`.
      config: `TrainConfig` (defaults: 3 epochs, batch 128, Adam 2e-3 with cosine decay).
    Returns: `(classifier, test_accuracy)`; `classifier.info['cached']` says whether it
      was loaded, `info.get('shipped')` whether it is the package's own.
    Raises ValueError for unlabelled sources, mismatched image shapes, or shipped weights
    whose checksum is wrong.
    """
    if not source_train.label_dim:
        raise ValueError(f"{source_train.name} has no labels (label_dim 0); the classifier "
                         f"needs a labelled source: open it with use_labels=True")
    x_train, y_train = source_arrays(source_train, config.max_train)
    x_test, y_test = source_arrays(source_test)
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"train images {x_train.shape[1:]} and test images "
                         f"{x_test.shape[1:]} differ in shape; use two splits of one data set")
    num_classes = int(source_train.label_dim)
    key = cache_key(config, num_classes, x_train, y_train, x_test, y_test)
    for shipped in SHIPPED:
        if shipped.key == key:
            clf = load_weights(os.path.join(WEIGHTS_DIR, shipped.file), shipped.sha256)
            clf.info["shipped"] = True
            if log:
                print(f"classifier: the shipped {shipped.file} (test accuracy "
                      f"{clf.test_accuracy:.4f})", flush=True)
            return clf, clf.test_accuracy
    resolution, num_channels = x_train.shape[1], x_train.shape[3]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(source_train.name).split("[")[0])
    path = os.path.join(cache_dir or default_cache_dir(), f"classifier-{name}-{key[:16]}")
    module = SmallCNN(num_classes, config.base_width, config.max_width, config.feature_dim)

    if os.path.isfile(os.path.join(path, "meta.json")):
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        with np.load(os.path.join(path, "params.npz")) as z:
            params = _unflatten({k: v for k, v in z.items() if not k.startswith("feature_")})
            shift, scale = z["feature_shift"], float(z["feature_scale"])
        clf = Classifier(module, params, resolution, num_channels, meta["test_accuracy"],
                         dict(meta, cached=True, path=path), shift, scale)
        return clf, clf.test_accuracy

    clf, meta = _train_and_measure(x_train, y_train, x_test, y_test, num_classes, config, log)
    meta["source"] = source_train.name
    seconds = meta["train_seconds"]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp", dir=os.path.dirname(path))
    np.savez(os.path.join(tmp, "params.npz"), **_flatten(jax.device_get(clf.params)),
             feature_shift=clf.feature_shift, feature_scale=clf.feature_scale)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    try:
        os.rename(tmp, path)  # atomic: readers never see a half-written cache
    except OSError:  # another process finished first; keep theirs
        pass
    clf.info = dict(meta, cached=False, path=path)
    if log:
        print(f"classifier: test accuracy {clf.test_accuracy:.4f} after {seconds:.0f} s; "
              f"cached in {path}", flush=True)
    return clf, clf.test_accuracy


def rebuild_fashion_mnist(out: str | None = None, data_path: str = "",
                          log: bool = True) -> tuple[str, str, dict]:
    """Train the shipped Fashion-MNIST classifier as `get_classifier` does (default
    `TrainConfig`, the splits of `edm2_jax.data.fashion_mnist` read from `data_path`, ''
    = the Debian package's directory) and write it to `out` (None = the package's
    `WEIGHTS_DIR/FASHION_MNIST.file`). The file holds no wall time, so one machine
    rebuilds the same bytes. Returns `(sha256, key, meta)`: write `sha256` and `key` into
    `FASHION_MNIST` when the file changes."""
    from edm2_jax.data.fashion_mnist import FashionMNIST
    config = TrainConfig()
    train, test = FashionMNIST("train", data_path), FashionMNIST("test", data_path)
    x_train, y_train = source_arrays(train, config.max_train)
    x_test, y_test = source_arrays(test)
    key = cache_key(config, int(train.label_dim), x_train, y_train, x_test, y_test)
    clf, meta = _train_and_measure(x_train, y_train, x_test, y_test, int(train.label_dim),
                                   config, log)
    del meta["train_seconds"]
    meta.update(source=train.name, key=key, cache_version=CACHE_VERSION)
    out = out or os.path.join(WEIGHTS_DIR, FASHION_MNIST.file)
    sha256 = save_weights(out, clf, meta)
    return sha256, key, meta


def main(argv: list[str] | None = None) -> int:
    """`python -m edm2_jax.evaluation.classifier --rebuild`: see `rebuild_fashion_mnist`."""
    parser = argparse.ArgumentParser(
        prog="python -m edm2_jax.evaluation.classifier",
        description="Rebuild the shipped Fashion-MNIST classifier (default TrainConfig; "
                    "minutes on a CPU) and print its checksum.")
    parser.add_argument("--rebuild", action="store_true", required=True,
                        help="train the classifier and write its weights file")
    parser.add_argument("--data-path", default="",
                        help="directory of the Fashion-MNIST IDX files (default: "
                             "/usr/share/datasets/fashion-mnist)")
    parser.add_argument("--out", default=None,
                        help=f"weights file to write (default: the package's "
                             f"{os.path.join(WEIGHTS_DIR, FASHION_MNIST.file)})")
    args = parser.parse_args(argv)
    sha256, key, meta = rebuild_fashion_mnist(args.out, args.data_path)
    out = args.out or os.path.join(WEIGHTS_DIR, FASHION_MNIST.file)
    print(f"wrote {out}: test accuracy {meta['test_accuracy']:.4f}\n"
          f"sha256 {sha256}\nkey    {key}")
    if (sha256, key) != (FASHION_MNIST.sha256, FASHION_MNIST.key):
        print("These differ from FASHION_MNIST in edm2_jax/evaluation/classifier.py; write "
              "them there to ship this file.")
    return 0


__all__ = ["Classifier", "FASHION_MNIST", "SHIPPED", "ShippedWeights", "SmallCNN",
           "TrainConfig", "WEIGHTS_DIR", "cache_key", "default_cache_dir", "get_classifier",
           "load_weights", "num_stages", "rebuild_fashion_mnist", "save_weights",
           "source_arrays", "source_batches", "train_classifier"]


if __name__ == "__main__":
    from edm2_jax import process
    process.setup_entry_point()  # as `python -m edm2_jax.main`: before JAX starts
    raise SystemExit(main())
