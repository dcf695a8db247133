"""Feature statistics (Frechet distance, KID, precision/recall) against closed forms and
hand-evaluated examples, and the Fashion-MNIST classifier behind FD_classifier."""
import numpy as np
import pytest

from edm2_jax.evaluation import stats

# ---------------------------------------------------------------------------------------
# Streaming statistics.


def test_streaming_stats_equal_numpy_mean_and_n_minus_1_covariance():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 12)) * rng.uniform(0.1, 3, 12) + 1e4  # large mean
    s = stats.FeatureStats()
    for a, b in [(0, 1), (1, 1), (1, 300), (300, 301), (301, 1000)]:  # sizes 1, 0, 299, 1, ...
        s.append(x[a:b])
    assert s.num_items == 1000
    np.testing.assert_allclose(s.mean(), x.mean(axis=0), rtol=0, atol=1e-10)
    np.testing.assert_allclose(s.cov(), np.cov(x, rowvar=False, ddof=1), rtol=1e-10, atol=1e-10)


def test_streaming_stats_errors():
    s = stats.FeatureStats().append(np.zeros((1, 3)))
    with pytest.raises(ValueError, match="at least 2"):
        s.cov()
    with pytest.raises(ValueError, match="dimension"):
        s.append(np.zeros((2, 4)))
    with pytest.raises(ValueError, match="NaN"):
        s.append(np.full((2, 3), np.nan))


def test_streaming_stats_merge_and_state_round_trip():
    """Statistics of two sets merged (another process's share, a resumed run's) equal
    those of the union, to float64 rounding; `state()` / `from_state()` round-trip
    exactly, an empty set included."""
    rng = np.random.default_rng(6)
    x = rng.normal(size=(700, 5)) * rng.uniform(0.1, 3, 5) + 1e3  # large mean
    a = stats.FeatureStats.from_features(x[:123])
    b = stats.FeatureStats.from_features(x[123:])
    merged = stats.FeatureStats().merge(a).merge(stats.FeatureStats()).merge(b)
    assert merged.num_items == 700
    np.testing.assert_allclose(merged.mean(), x.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(merged.cov(), np.cov(x, rowvar=False), rtol=1e-9, atol=1e-9)
    again = stats.FeatureStats.from_state(merged.state())
    assert again.num_items == 700
    np.testing.assert_array_equal(again.cov(), merged.cov())
    np.testing.assert_array_equal(again.mean(), merged.mean())
    empty = stats.FeatureStats.from_state(stats.FeatureStats().state())
    assert empty.num_items == 0 and empty.merge(a).num_items == 123
    with pytest.raises(ValueError, match="dimensions differ"):
        a.merge(stats.FeatureStats.from_features(x[:3, :4]))
    with pytest.raises(ValueError, match="do not fit together"):
        stats.FeatureStats.from_state(dict(a.state(), mean=np.zeros(4)))


# ---------------------------------------------------------------------------------------
# Frechet distance.


def test_frechet_distance_diagonal_gaussians_closed_form():
    rng = np.random.default_rng(1)
    mu1, mu2 = rng.normal(size=6), rng.normal(size=6)
    s1, s2 = rng.uniform(0.1, 4, 6), rng.uniform(0.1, 4, 6)
    want = np.sum((mu1 - mu2) ** 2) + np.sum(s1 + s2 - 2 * np.sqrt(s1 * s2))
    got = stats.frechet_distance(mu1, np.diag(s1), mu2, np.diag(s2))
    assert got == pytest.approx(want, rel=1e-10)


def test_frechet_distance_commuting_covariances_closed_form():
    rng = np.random.default_rng(2)
    q, _ = np.linalg.qr(rng.normal(size=(5, 5)))
    a, b = rng.uniform(0.1, 3, 5), rng.uniform(0.1, 3, 5)
    mu1, mu2 = rng.normal(size=5), rng.normal(size=5)
    # Shared eigenvectors: FD = |mu1 - mu2|^2 + sum (sqrt(a) - sqrt(b))^2.
    want = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    got = stats.frechet_distance(mu1, q @ np.diag(a) @ q.T, mu2, q @ np.diag(b) @ q.T)
    assert got == pytest.approx(want, rel=1e-9)


def test_frechet_distance_general_covariances_via_symmetric_root():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(4, 4)), rng.normal(size=(4, 4))
    s1, s2 = a @ a.T + 0.1 * np.eye(4), b @ b.T + 0.1 * np.eye(4)
    # tr sqrt(S1 S2) = tr sqrt(S1^1/2 S2 S1^1/2), the latter symmetric PSD (eigh only).
    w, v = np.linalg.eigh(s1)
    r1 = v @ np.diag(np.sqrt(w)) @ v.T
    tr_root = np.sum(np.sqrt(np.linalg.eigvalsh(r1 @ s2 @ r1)))
    want = np.trace(s1) + np.trace(s2) - 2 * tr_root
    assert stats.frechet_distance(np.zeros(4), s1, np.zeros(4), s2) == pytest.approx(want,
                                                                                    rel=1e-9)


def test_frechet_distance_of_identical_stats_is_zero_even_rank_deficient():
    x = np.random.default_rng(4).normal(size=(10, 32))  # 10 samples: covariance rank 9 < 32
    mu, sigma = stats.FeatureStats.from_features(x).mean_cov()
    assert abs(stats.frechet_distance(mu, sigma, mu, sigma)) < 1e-6
    with pytest.raises(ValueError, match=r"mu \[D\] and sigma \[D, D\]"):
        stats.frechet_distance(mu, sigma, mu[:5], sigma)


# ---------------------------------------------------------------------------------------
# KID.


def test_reference_statistics_that_are_no_covariance_are_refused_when_read(tmp_path):
    """`--ref` statistics are checked as they are read: finite, sigma symmetric and
    positive semi-definite within float tolerance (an .npz with sigma = -I gave an FID of
    -1550 before); a covariance rounded through float32 passes."""
    from edm2_jax.evaluation import fid
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 8))
    good = np.cov(x, rowvar=False).astype(np.float32).astype(np.float64)  # float32 rounding
    np.savez(tmp_path / "good.npz", mu=x.mean(0), sigma=good)
    mu, sigma = fid.load_ref_stats(tmp_path / "good.npz")
    np.testing.assert_array_equal(sigma, good)
    low_rank = np.outer(x[0], x[0])  # PSD with 7 zero eigenvalues (rounding may be < 0)
    np.savez(tmp_path / "rank1.npz", mu=x[0], sigma=low_rank)
    fid.load_ref_stats(tmp_path / "rank1.npz")
    for name, sigma, words in [("neg", -np.eye(8), "not positive semi-definite"),
                               ("asym", np.eye(8) + np.triu(np.ones((8, 8)), 1) * 0.1,
                                "not symmetric"),
                               ("nan", np.where(np.eye(8) > 0, np.nan, 0.0), "NaN or Inf")]:
        np.savez(tmp_path / f"{name}.npz", mu=np.zeros(8), sigma=sigma)
        with pytest.raises(ValueError, match=words):
            fid.load_ref_stats(tmp_path / f"{name}.npz")


def test_a_negative_frechet_distance_is_an_error_never_a_result():
    """FD >= 0 for covariances; statistics that are none (here sigma = -I, which the
    readers refuse) give an error rather than a negative figure; rounding below 0 is 0."""
    d = 4
    with pytest.raises(ValueError, match="not covariances"):
        stats.frechet_distance(np.zeros(d), -np.eye(d), np.zeros(d), np.eye(d) * 1e-3)
    a = np.diag([1.0, 2.0, 3.0, 4.0])
    assert stats.frechet_distance(np.ones(d), a, np.ones(d), a) >= 0.0


def test_kid_equals_hand_computed_mmd():
    # D = 1, k(x, y) = (x y + 1)^3; a = {0, 1}, b = {1, 2}, m = 2 (every subset is the set):
    # within a: k(0,1) = 1; within b: k(1,2) = 27; cross: (1 + 1 + 8 + 27) * 2 / 4 = 18.5.
    a, b = np.array([[0.0], [1.0]]), np.array([[1.0], [2.0]])
    assert stats.kid(a, b, num_subsets=3, subset_size=2) == pytest.approx(1 + 27 - 18.5)


def test_kid_is_unbiased_for_equal_distributions_and_positive_for_shifted():
    rng = np.random.default_rng(5)
    m, d, draws = 40, 8, 300
    unbiased, biased = [], []
    for i in range(draws):
        x, y = rng.normal(size=(m, d)), rng.normal(size=(m, d))
        unbiased.append(stats.kid(x, y, num_subsets=1, subset_size=m, seed=i))
        k = lambda p, q: (p @ q.T / d + 1) ** 3  # noqa: E731
        biased.append(k(x, x).mean() + k(y, y).mean() - 2 * k(x, y).mean())  # V-statistic
    unbiased, biased = np.array(unbiased), np.array(biased)
    se = unbiased.std() / np.sqrt(draws)
    assert abs(unbiased.mean()) < 3 * se
    assert (unbiased < 0).any()  # an unbiased estimate of 0 must sometimes be negative
    assert biased.mean() > 10 * se  # the estimator with the diagonal would fail the test above
    x, y = rng.normal(size=(500, d)), rng.normal(size=(500, d)) + 0.5
    assert stats.kid(x, y, num_subsets=5, subset_size=200) > 20 * se


# ---------------------------------------------------------------------------------------
# Precision and recall.


def test_precision_recall_hand_example_1d():
    # k = 1: real radii are all 1, so only 0.5 of {0.5, 10, 20} is inside -> precision 1/3.
    # Generated radii are 9.5, 9.5, 10: every real point lies within 9.5 of 0.5 -> recall 1.
    real = np.array([[0.0], [1.0], [2.0], [3.0], [4.0]])
    gen = np.array([[0.5], [10.0], [20.0]])
    p, r = stats.precision_recall(real, gen, k=1)
    assert (p, r) == (pytest.approx(1 / 3), 1.0)
    np.testing.assert_allclose(stats.knn_radii_sq(gen, k=1), [9.5 ** 2, 9.5 ** 2, 10.0 ** 2])


def test_precision_recall_identical_far_and_batched():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(300, 16))
    assert stats.precision_recall(x, x.copy()) == (1.0, 1.0)
    assert stats.precision_recall(x, x + 100.0) == (0.0, 0.0)
    y = rng.normal(size=(200, 16)) * 1.5
    assert stats.precision_recall(x, y, batch_size=7) == stats.precision_recall(x, y)
    d = np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))
    brute = np.sort(d, axis=1)[:, 3]  # 3rd nearest other point (column 0 is the point itself)
    np.testing.assert_allclose(np.sqrt(stats.knn_radii_sq(x, 3, batch_size=64)), brute,
                               rtol=1e-9)
    with pytest.raises(ValueError, match="1 <= k"):
        stats.precision_recall(x[:3], y, k=3)


# ---------------------------------------------------------------------------------------
# Classifier features (Fashion-MNIST; skipped when the data set is not installed).


class _Subset:
    """The first n images of a source, as an in-memory source."""

    def __init__(self, source, n):
        self.images, self.labels = source.images[:n], source.labels[:n]
        self.name, self.label_dim = source.name, source.label_dim
        self.resolution, self.num_channels = source.resolution, source.num_channels

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


@pytest.fixture(scope="module")
def fmnist():
    from edm2_jax import data
    # Missing files fail here, naming the package that installs them.
    train = data.make_source({"source": "fashion_mnist", "split": "train"})
    test = data.make_source({"source": "fashion_mnist", "split": "test"})
    return _Subset(train, 2000), _Subset(test, 1000)


@pytest.fixture(scope="module")
def tiny_classifier(fmnist, tmp_path_factory):
    from edm2_jax.evaluation import classifier
    cache = str(tmp_path_factory.mktemp("clf_cache"))
    config = classifier.TrainConfig(epochs=1, batch_size=100)
    clf, acc = classifier.get_classifier(*fmnist, cache_dir=cache, config=config, log=False)
    return clf, acc, cache, config


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_classifier_learns_fashion_mnist_well_above_chance(tiny_classifier):
    clf, acc, _, _ = tiny_classifier
    assert acc > 0.5  # 10 classes: chance is 0.1; 20 Adam steps on 2000 images
    assert not clf.info["cached"]


def test_classifier_cache_loads_without_training(tiny_classifier, fmnist, monkeypatch):
    from edm2_jax.evaluation import classifier
    clf, acc, cache, config = tiny_classifier

    def no_training(*args, **kwargs):
        raise AssertionError("the cached classifier should have been loaded")
    monkeypatch.setattr(classifier, "train_classifier", no_training)
    clf2, acc2 = classifier.get_classifier(*fmnist, cache_dir=cache, config=config, log=False)
    assert clf2.info["cached"] and acc2 == acc
    images = fmnist[1].images[:50]
    np.testing.assert_array_equal(clf2.features(images), clf.features(images))
    # A different training setting is a different classifier, not a cache hit.
    with pytest.raises(AssertionError, match="cached classifier"):
        classifier.get_classifier(*fmnist, cache_dir=cache, log=False,
                                  config=classifier.TrainConfig(epochs=2, batch_size=100))


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_classifier_training_shows_a_bar_with_its_eta(capsys):
    """The classifier's training (minutes on a CPU, the first time `cls` is measured) is a
    progress bar over all its steps with an ETA, not a silence between epoch lines."""
    import re

    from edm2_jax.evaluation import classifier
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 8, 8, 1), dtype=np.uint8)
    config = classifier.TrainConfig(epochs=2, batch_size=16, base_width=4, max_width=8,
                                    feature_dim=8)
    classifier.train_classifier(images, np.arange(64) % 2, 2, config, log=True)
    out, err = capsys.readouterr()
    assert re.search(r"classifier training: 100%.*\b8/8 \[\d\d:\d\d<00:00", err), err
    assert "classifier epoch 2/2" in out  # the epoch lines, above the bar


def test_features_metrics_of_a_set_against_itself(tiny_classifier, fmnist):
    from edm2_jax.evaluation import classifier_metrics
    clf = tiny_classifier[0]
    images = fmnist[1].images[:300]
    feats = clf.features(images)
    assert feats.shape == (300, clf.feature_dim) and feats.dtype == np.float32
    m = classifier_metrics.evaluate_features_metrics(images, images, clf, kid_subsets=3)
    assert abs(m["fd_cls"]) < 1e-6
    assert m["precision_cls"] == 1.0 and m["recall_cls"] == 1.0
    # Held-out real images score far better against the training images than noise does.
    noise = np.random.default_rng(0).integers(0, 256, images.shape, dtype=np.uint8)
    far = classifier_metrics.evaluate_features_metrics(noise, fmnist[0], clf, kid_subsets=3)
    near = classifier_metrics.evaluate_features_metrics(images, fmnist[0], clf, kid_subsets=3)
    assert far["fd_cls"] > 10 * near["fd_cls"] and far["kid_cls"] > 10 * abs(near["kid_cls"])
    assert near["precision_cls"] > far["precision_cls"] + 0.5
    assert near["recall_cls"] > far["recall_cls"] + 0.5
    assert far["num_ref"] == len(fmnist[0]) and "fid" not in far
    ref_feats = clf.features(fmnist[0].images)  # reference features extracted once
    assert classifier_metrics.evaluate_features_metrics(images, ref_feats, clf,
                                                        kid_subsets=3) == near
    with pytest.raises(ValueError, match="uint8"):
        clf.features(images.astype(np.float32))
    with pytest.raises(ValueError, match=r"\[N, 32, 32, 1\]"):
        clf.features(np.zeros((2, 28, 28, 1), np.uint8))


def test_classifier_depth_follows_resolution():
    from edm2_jax.evaluation.classifier import num_stages
    assert [num_stages(r) for r in (4, 8, 28, 32, 64, 512)] == [1, 1, 3, 3, 4, 7]
