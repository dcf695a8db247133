"""The shipped Fashion-MNIST classifier (edm2_jax/evaluation/weights/): its `_cls` metrics
of fixed real images match the golden values in tests/data/classifier_golden.json on any
CPU, a tampered weights file is refused, and another data set still trains its own.

The golden set: the first 500 test-split images (the "generated" side) against the first
2,000 train-split images (the reference), through `classifier_metrics.features_metrics`
with its defaults (KID: 100 subsets of 500; precision/recall: k = 3, 500 references drawn
with seed 0).

Tolerance, from float32 rounding-error analysis (not from a print of one machine). A
machine computes each feature with its own float32 summation order (XLA's CPU kernels,
vector widths, FMA), so its features differ from the exact ones by rounding errors.
The probabilistic model of Higham & Mary (SIAM J. Sci. Comput. 41(5), 2019): every
float32 operation's relative error is an independent mean-zero variable with
|delta| <= u = 2^-24 (variance <= u^2/3), in whatever order a kernel sums. Then an output
`y = b + sum_{k<=n} w_k x_k` of a convolution (n = 9 C_in) or of the feature layer
(n = 1024) computed from inputs with error variance v has

    Var(err y) <= sum_k w_k^2 v_k + (2n + 1) u^2 / 3 * (|b| + sum_k |w_k x_k|)^2

(its 2n + 1 roundings, each bounded by the partial sum, itself <= the sum of moduli);
ReLU and 2x2 max-pool pass at most the variance of their inputs; the input
`uint8 / 127.5 - 1` carries (3u)^2, the feature normalisation 2u|f|. `_feature_sigma`
evaluates this layer by layer, giving each feature's standard deviation sigma (about
1.5e-5 of the unit feature scale here, against ~5e-6 observed between two XLA programs).
Two machines differ by at most sqrt(2) sigma in standard deviation. To first order a
metric M moves by sum_i grad_i . err_i over the 2,500 images, whose errors are
independent (separate operations), so its standard deviation is at most
`sqrt(2) * sqrt(sum_i (sum_d |grad_id| sigma_id)^2)` (the triangle inequality inside an
image, where the errors of the 128 features are correlated). The tolerance is LAMBDA = 6
of those standard deviations (room for the model's independence assumption across the
layers; a Gaussian tail beyond 6 standard deviations is 2e-9). FD's gradient is exact (`_fd_grad`: the Bures-Wasserstein
gradient I - T of the covariance); KID's is the derivative of its cubic kernel over the
same 100 subsets. Precision/recall are counts: an image's in/out decision can flip only
if its margin (radius minus distance, whose error has standard deviation at most
4 sqrt(2) max_i |sigma_i|) is within LAMBDA of those, so the tolerance is the number of
such images over the set size (1 of 500 for each here: a step of 1/500 = 0.002, the
counts' resolution). FD's and KID's tolerances are also checked to be below half a unit
of the golden value's third significant digit: their agreement to 3 significant digits
on any machine follows from the model.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from edm2_jax import data as data_lib
from edm2_jax.evaluation import classifier, classifier_metrics

GOLDEN = Path(__file__).parent / "data" / "classifier_golden.json"
NUM_GEN, NUM_REF = 500, 2000
U = 2.0 ** -24   # float32 unit roundoff
LAMBDA = 6.0     # standard deviations of the tolerance


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The Fashion-MNIST splits and the classifier `get_classifier` gives for them (the
    shipped one: training would fail the test)."""
    train = data_lib.make_source({"source": "fashion_mnist", "split": "train"})
    test = data_lib.make_source({"source": "fashion_mnist", "split": "test"})
    saved = classifier.train_classifier
    def no_training(*a, **k):
        raise AssertionError("the shipped Fashion-MNIST classifier should be loaded, not trained")
    classifier.train_classifier = no_training
    try:
        clf, acc = classifier.get_classifier(
            train, test, cache_dir=str(tmp_path_factory.mktemp("cls-cache")), log=False)
    finally:
        classifier.train_classifier = saved
    return train, test, clf, acc


def _feature_sigma(clf, images: np.ndarray) -> np.ndarray:
    """The standard deviation of each feature's float32 rounding error under the model
    of the module docstring: float `[N, feature_dim]` (units of the normalised features)."""
    import jax
    import jax.numpy as jnp
    p = jax.device_get(clf.params)
    conv = lambda a, k: np.asarray(jax.lax.conv_general_dilated(  # noqa: E731
        jnp.asarray(a), jnp.asarray(k), (1, 1), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC")), np.float64)
    x = images.astype(np.float32) / 127.5 - 1
    v = np.full(x.shape, (3 * U) ** 2)
    i = 0
    while f"Conv_{i}" in p:
        w, b = np.asarray(p[f"Conv_{i}"]["kernel"]), np.asarray(p[f"Conv_{i}"]["bias"])
        n = w.shape[0] * w.shape[1] * w.shape[2]
        y = conv(x, w) + b
        s = conv(np.abs(x), np.abs(w)) + np.abs(b)
        v = conv(v, w * w) + (2 * n + 1) / 3 * U * U * s * s
        a = np.maximum(y, 0)  # ReLU: the error at most the input's
        m, h, wd, c = a.shape
        def pool(q):  # the max's error is one of its window's
            q = np.pad(q, ((0, 0), (0, h % 2), (0, wd % 2), (0, 0)))
            return q.reshape(m, (h + 1) // 2, 2, (wd + 1) // 2, 2, c).max(axis=(2, 4))
        x, v = pool(a), pool(v)
        i += 1
    x, v = x.reshape(len(x), -1), v.reshape(len(v), -1)
    w, b = np.asarray(p["Dense_0"]["kernel"], np.float64), np.asarray(p["Dense_0"]["bias"])
    n = w.shape[0]
    raw = x @ w + b
    s = np.abs(x) @ np.abs(w) + np.abs(b)
    v = v @ (w * w) + (2 * n + 1) / 3 * U * U * s * s
    f = (raw - clf.feature_shift) / clf.feature_scale
    return np.sqrt(v) / clf.feature_scale + 2 * U * np.abs(f)


def _sqrt_psd(a: np.ndarray) -> np.ndarray:
    lam, vec = np.linalg.eigh((a + a.T) / 2)
    return (vec * np.sqrt(np.maximum(lam, 0))) @ vec.T


def _transport(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """T = A^-1/2 (A^1/2 B A^1/2)^1/2 A^-1/2: d tr((A^1/2 B A^1/2)^1/2) / dA = T / 2."""
    lam, vec = np.linalg.eigh(a)
    ih = (vec / np.sqrt(lam)) @ vec.T
    h = (vec * np.sqrt(lam)) @ vec.T
    return ih @ _sqrt_psd(h @ b @ h) @ ih


def _fd_grad(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """d FD / d x_i of the Frechet distance of the Gaussian fits of x and y (unbiased
    covariances): 2 (mu_x - mu_y) / N + 2 (I - T) (x_i - mu_x) / (N - 1)."""
    mx, my = x.mean(0), y.mean(0)
    cx, cy = np.cov(x, rowvar=False), np.cov(y, rowvar=False)
    g = np.eye(len(mx)) - _transport(cx, cy)
    return 2 * (mx - my) / len(x) + 2 * (x - mx) @ g / (len(x) - 1)


def _kid_grads(gen: np.ndarray, ref: np.ndarray, subsets: int = 100, size: int = 1000,
               seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """d KID / d features of both sets over the subsets `stats.kid` draws (its rng)."""
    m, d = min(len(gen), len(ref), size), gen.shape[1]
    rng = np.random.default_rng(seed)
    dg, dr = np.zeros_like(gen), np.zeros_like(ref)
    dk = lambda a, b: 3 * (a @ b.T / d + 1) ** 2 / d  # noqa: E731 (k'(x.y) / d)
    for _ in range(subsets):
        ia, ib = rng.choice(len(gen), m, replace=False), rng.choice(len(ref), m, replace=False)
        x, y = gen[ia], ref[ib]
        kxx, kyy, kxy = dk(x, x), dk(y, y), dk(x, y)
        np.fill_diagonal(kxx, 0)
        np.fill_diagonal(kyy, 0)
        np.add.at(dg, ia, 2 * kxx @ x / (m * (m - 1)) - 2 * kxy @ y / m ** 2)
        np.add.at(dr, ib, 2 * kyy @ y / (m * (m - 1)) - 2 * kxy.T @ x / m ** 2)
    return dg / subsets, dr / subsets


def _ambiguous(manifold: np.ndarray, probes: np.ndarray, slack: float, k: int = 3) -> int:
    """Probes whose inside/outside decision of the k-NN manifold is within `slack` (in
    distance) of flipping."""
    dist = lambda a, b: np.sqrt(np.maximum(  # noqa: E731
        (a * a).sum(1)[:, None] + (b * b).sum(1)[None] - 2 * a @ b.T, 0))
    radii = np.sort(dist(manifold, manifold), axis=1)[:, k]
    margin = (radii[None, :] - dist(probes, manifold)).max(axis=1)
    return int(np.sum(np.abs(margin) <= slack))


def _half_unit_of_third_digit(x: float) -> float:
    return 0.5 * 10.0 ** (math.floor(math.log10(abs(x))) - 2)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_shipped_classifier_cls_metrics_match_the_golden_values(shipped):
    train, test, clf, acc = shipped
    golden = json.loads(GOLDEN.read_text())
    assert clf.info["shipped"] and clf.info["cached"], clf.info
    assert acc == clf.test_accuracy == pytest.approx(golden["test_accuracy"], abs=1e-4)
    assert clf.info["config"] == golden["train_config"]

    gen_img, ref_img = test.images[:NUM_GEN], train.images[:NUM_REF]
    gen, ref = clf.features(gen_img), clf.features(ref_img)
    got = classifier_metrics.features_metrics(gen, ref)
    assert (got["num_gen"], got["num_ref"]) == (NUM_GEN, NUM_REF)

    sg, sr = _feature_sigma(clf, gen_img), _feature_sigma(clf, ref_img)
    gen64, ref64 = gen.astype(np.float64), ref.astype(np.float64)
    def metric_std(grad_g, grad_r):  # of the difference of two machines' values
        per_image = np.concatenate([np.sum(np.abs(grad_g) * sg, 1),
                                    np.sum(np.abs(grad_r) * sr, 1)])
        return math.sqrt(2) * float(np.sqrt(np.sum(per_image ** 2)))
    tol = {"fd_cls": LAMBDA * metric_std(_fd_grad(gen64, ref64), _fd_grad(ref64, gen64)),
           "kid_cls": LAMBDA * metric_std(*_kid_grads(gen64, ref64))}
    # Precision: generated probes in the manifold of the 500 references features_metrics
    # draws (seed 0); recall: those references in the generated manifold.
    pr_ref = ref64[np.random.default_rng(0).choice(NUM_REF, NUM_GEN, replace=False)]
    slack = LAMBDA * math.sqrt(2) * 4 * float(np.linalg.norm(np.concatenate([sg, sr]),
                                                             axis=1).max())
    tol["precision_cls"] = _ambiguous(pr_ref, gen64, slack) / NUM_GEN
    tol["recall_cls"] = _ambiguous(gen64, pr_ref, slack) / NUM_GEN

    for key in ("fd_cls", "kid_cls", "precision_cls", "recall_cls"):
        want = golden["metrics"][key]
        if key in ("fd_cls", "kid_cls"):  # the model's bound implies 3 significant digits
            assert tol[key] < _half_unit_of_third_digit(want), (key, tol[key], want)
        assert abs(got[key] - want) <= tol[key] + 1e-9 * abs(want), (key, got[key], want, tol)


def test_a_tampered_weights_file_is_refused(shipped, tmp_path, monkeypatch):
    """One flipped byte: the checksum differs and the loader says which file and how to
    rebuild it, through `get_classifier` as through `load_weights`."""
    train, test, _, _ = shipped
    weights = tmp_path / "weights"
    weights.mkdir()
    src = Path(classifier.WEIGHTS_DIR) / classifier.FASHION_MNIST.file
    bad = weights / classifier.FASHION_MNIST.file
    shutil.copy(src, bad)
    blob = bytearray(bad.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    bad.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="SHA-256") as e:
        classifier.load_weights(str(bad), classifier.FASHION_MNIST.sha256)
    assert str(bad) in str(e.value) and classifier.REBUILD_COMMAND in str(e.value)
    monkeypatch.setattr(classifier, "WEIGHTS_DIR", str(weights))
    with pytest.raises(ValueError, match="--rebuild"):
        classifier.get_classifier(train, test, cache_dir=str(tmp_path / "cache"), log=False)
    # The untouched file passes the same check.
    assert classifier.load_weights(str(src), classifier.FASHION_MNIST.sha256).test_accuracy > 0.85


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_another_data_set_trains_and_caches_its_own_classifier(tmp_path):
    from tests.test_train import make_image_folder
    folder = make_image_folder(tmp_path / "data", n=32)
    source = data_lib.make_source({"source": "folder", "path": str(folder),
                                   "use_labels": True})
    config = classifier.TrainConfig(epochs=1, batch_size=8)
    cache = tmp_path / "cache"
    clf, _ = classifier.get_classifier(source, source, cache_dir=str(cache), config=config,
                                       log=False)
    assert not clf.info["cached"] and "shipped" not in clf.info
    assert Path(clf.info["path"]).parent == cache and os.listdir(cache)
    again, _ = classifier.get_classifier(source, source, cache_dir=str(cache), config=config,
                                         log=False)
    assert again.info["cached"] and again.info["path"] == clf.info["path"]
    images = classifier.source_arrays(source)[0]
    np.testing.assert_array_equal(again.features(images), clf.features(images))
