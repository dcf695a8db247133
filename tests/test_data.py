"""Training data: sources (Fashion-MNIST, image folder / zip, tfds) and the batch stream."""
from __future__ import annotations

import gzip
import io
import json
import os
import sys
import types
import zipfile

import ml_collections
import numpy as np
import PIL.Image
import pytest

from edm2_jax import configs, data

FMNIST = "/usr/share/datasets/fashion-mnist"
have_fmnist = pytest.mark.skipif(
    not os.path.isfile(os.path.join(FMNIST, "t10k-images-idx3-ubyte.gz")),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")


# --- helpers ------------------------------------------------------------------------------

class ArraySource:
    """In-memory source whose image i is filled with the value 20 * i, so a batch reveals
    which dataset indices it holds; label i % 3."""

    name, resolution, num_channels, label_dim = "array", 4, 1, 3

    def __init__(self, n: int = 10):
        self.n = n

    def __len__(self):
        return self.n

    @property
    def num_images(self):
        return self.n

    def __getitem__(self, i):
        return np.full((4, 4, 1), 20 * i, np.uint8), i % 3


def indices_of(batch) -> np.ndarray:
    """Dataset indices held by a batch of ArraySource images (inverts x = u8 / 127.5 - 1)."""
    u8 = np.rint((batch["image"][:, 0, 0, 0] + 1) * 127.5).astype(int)
    return u8 // 20


def take(it, k):
    return [next(it) for _ in range(k)]


def write_idx(path, name, array, magic):
    header = np.array([magic, *array.shape], ">i4").tobytes()
    with gzip.open(os.path.join(path, name + ".gz"), "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def png_bytes(array, fmt="png"):
    buf = io.BytesIO()
    PIL.Image.fromarray(array).save(buf, format=fmt)
    return buf.getvalue()


def make_image_set(root, arrays, labels=None, as_zip=False, fmt="png", extra=None,
                   compression=zipfile.ZIP_STORED):
    """Write `arrays` in the release layout (00000/img%08d.png) under root/ds or root/ds.zip;
    `labels` -> dataset.json; `extra` maps more names to raw bytes. Returns the path."""
    files = {f"00000/img{k:08d}.{fmt}": png_bytes(a, "jpeg" if fmt == "jpg" else fmt)
             for k, a in enumerate(arrays)}
    if labels is not None:
        files["dataset.json"] = json.dumps(
            {"labels": [[n, l] for n, l in zip(sorted(files), labels)]}).encode()
    files.update(extra or {})
    os.makedirs(root, exist_ok=True)
    if as_zip:
        path = os.path.join(root, "ds.zip")
        with zipfile.ZipFile(path, "w", compression=compression) as z:
            for n, b in files.items():
                z.writestr(n, b)
        return path
    path = os.path.join(root, "ds")
    for n, b in files.items():
        os.makedirs(os.path.dirname(os.path.join(path, n)), exist_ok=True)
        with open(os.path.join(path, n), "wb") as f:
            f.write(b)
    return path


def rgb_images(n, size=8, seed=0):
    return [np.random.default_rng(seed + k).integers(0, 256, (size, size, 3), np.uint8)
            for k in range(n)]


# --- Fashion-MNIST ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fmnist_test():
    return data.FashionMNIST("test")


@have_fmnist
def test_fashion_mnist_is_28x28_zero_padded_to_32x32(fmnist_test):
    s = fmnist_test
    assert (len(s), s.num_images, s.resolution, s.num_channels) == (10000, 10000, 32, 1)
    assert s.label_dim == 10
    with gzip.open(os.path.join(FMNIST, "t10k-images-idx3-ubyte.gz")) as f:
        raw = np.frombuffer(f.read(), np.uint8, offset=16).reshape(10000, 28, 28)
    for i in (0, 1, 4321, 9999):
        image, label = s[i]
        assert image.dtype == np.uint8 and image.shape == (32, 32, 1)
        np.testing.assert_array_equal(image[2:30, 2:30, 0], raw[i])
    border = np.ones((32, 32), bool)
    border[2:30, 2:30] = False
    assert s.images[:, border].max() == 0  # black padding, 2 px on every side
    assert s.images[:, 2:30, 2:30].max() == 255


@have_fmnist
def test_fashion_mnist_labels_match_published_facts(fmnist_test):
    # First test labels (Ankle boot, Pullover, Trouser, ...) and 1000 images per class.
    assert [fmnist_test[i][1] for i in range(10)] == [9, 2, 1, 1, 6, 1, 4, 6, 5, 7]
    assert np.bincount(fmnist_test.labels).tolist() == [1000] * 10
    train = data.make_source(configs.base_config().data)  # the offline default
    assert data.describe(train) == "fashion_mnist[train]: 60000 images, 32x32x1, 10 classes"
    assert [train[i][1] for i in range(10)] == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    assert np.bincount(train.labels).tolist() == [6000] * 10


@have_fmnist
def test_fashion_mnist_batches_scale_to_minus_one_one_with_one_hot_labels(fmnist_test):
    it = data.make_iterator(fmnist_test, global_batch=64, seed=3, num_workers=2)
    batch = next(it)
    it.close()
    assert batch["image"].dtype == np.float32 and batch["image"].shape == (64, 32, 32, 1)
    idx = data.epoch_permutation(3, 0, 10000)[:64]
    expected = fmnist_test.images[idx].astype(np.float64) / 127.5 - 1  # x = uint8 / 127.5 - 1
    np.testing.assert_allclose(batch["image"], expected, atol=1e-6)
    assert batch["image"].min() == -1.0 and batch["image"].max() <= 1.0
    assert np.all(batch["image"][:, :2] == -1.0)  # the black padding
    lab = batch["label"]
    assert lab.dtype == np.float32 and lab.shape == (64, 10)
    assert np.all(lab.sum(1) == 1) and set(np.unique(lab)) == {0.0, 1.0}
    np.testing.assert_array_equal(lab.argmax(1), fmnist_test.labels[idx])


def test_fashion_mnist_missing_files_error_gives_install_command(tmp_path):
    cfg = configs.base_config().data
    cfg.path = str(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        data.make_source(cfg)
    assert "apt-get install dataset-fashion-mnist" in str(e.value)
    assert "data.path" in str(e.value) and "train-images-idx3-ubyte.gz" in str(e.value)


def test_fashion_mnist_reads_idx_files_from_path_override(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (5, 28, 28), np.uint8)
    write_idx(tmp_path, "t10k-images-idx3-ubyte", images, 2051)
    write_idx(tmp_path, "t10k-labels-idx1-ubyte", np.array([3, 1, 4, 1, 5]), 2049)
    s = data.FashionMNIST("test", path=str(tmp_path))
    assert len(s) == 5 and [s[i][1] for i in range(5)] == [3, 1, 4, 1, 5]
    np.testing.assert_array_equal(s[2][0][2:30, 2:30, 0], images[2])
    assert data.FashionMNIST("test", path=str(tmp_path), use_labels=False)[0][1] == data.NO_LABEL
    with pytest.raises(ValueError, match="split"):
        data.FashionMNIST("valid", path=str(tmp_path))
    write_idx(tmp_path, "t10k-labels-idx1-ubyte", np.array([3, 1, 4]), 2051)  # wrong magic
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.gz"):
        data.FashionMNIST("test", path=str(tmp_path))


# --- the batch stream ---------------------------------------------------------------------

def test_each_epoch_is_the_seeded_permutation():
    it = data.make_iterator(ArraySource(10), global_batch=5, seed=7, num_workers=0)
    got = np.concatenate([indices_of(b) for b in take(it, 6)])
    for e in range(3):
        np.testing.assert_array_equal(got[10 * e:10 * (e + 1)],
                                      np.random.default_rng((7, e)).permutation(10))
    assert not np.array_equal(got[:10], got[10:20])  # epochs differ
    assert sorted(got[10:20]) == list(range(10))


def test_same_seed_same_batches_other_seed_other_batches():
    a = take(data.make_iterator(ArraySource(), global_batch=4, seed=1, num_workers=0), 5)
    b = take(data.make_iterator(ArraySource(), global_batch=4, seed=1, num_workers=1), 5)
    c = take(data.make_iterator(ArraySource(), global_batch=4, seed=2, num_workers=0), 5)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["image"], y["image"])
        np.testing.assert_array_equal(x["label"], y["label"])
    assert any(not np.array_equal(x["image"], z["image"]) for x, z in zip(a, c))


def test_labels_are_one_hot_of_the_source_labels():
    batch = next(data.make_iterator(ArraySource(), global_batch=8, seed=0, num_workers=0))
    one_hot = np.eye(3, dtype=np.float32)[indices_of(batch) % 3]
    np.testing.assert_array_equal(batch["label"], one_hot)


def test_resume_at_nimg_reproduces_the_uninterrupted_stream():
    # Batch 4 does not divide the 10 images, so batches straddle epoch boundaries. (With
    # worker processes, and after a kill -9: tests/test_grain_loader.py.)
    full = take(data.make_iterator(ArraySource(), global_batch=4, seed=5, num_workers=0), 8)
    resumed = take(data.make_iterator(ArraySource(), global_batch=4, seed=5, start_nimg=12,
                                      num_workers=0), 5)
    for x, y in zip(full[3:], resumed):
        np.testing.assert_array_equal(x["image"], y["image"])
        np.testing.assert_array_equal(x["label"], y["label"])


def test_process_slices_concatenate_to_the_global_batch():
    full = take(data.make_iterator(ArraySource(), global_batch=6, seed=0, num_workers=0), 4)
    parts = [take(data.make_iterator(ArraySource(), global_batch=6, seed=0, process_index=p,
                                     process_count=3, num_workers=0), 4) for p in range(3)]
    for k in range(4):
        assert parts[0][k]["image"].shape == (2, 4, 4, 1)
        np.testing.assert_array_equal(np.concatenate([p[k]["image"] for p in parts]),
                                      full[k]["image"])
        np.testing.assert_array_equal(np.concatenate([p[k]["label"] for p in parts]),
                                      full[k]["label"])


def test_iterator_rejects_bad_sharding():
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        data.make_iterator(ArraySource(), global_batch=5, seed=0, process_count=2)
    with pytest.raises(ValueError, match="process_index"):
        data.make_iterator(ArraySource(), global_batch=4, seed=0, process_index=2, process_count=2)


def test_xflip_doubles_with_mirrored_copies():
    img = np.arange(16, dtype=np.uint8).reshape(4, 4, 1)
    flipped = data.XFlip(_ListSource([(img, 1)]))
    assert len(flipped) == 2 and flipped.num_images == 2
    np.testing.assert_array_equal(flipped[0][0], img)
    np.testing.assert_array_equal(flipped[1][0], img[:, ::-1])
    assert flipped[1][1] == 1


class _ListSource:
    name, resolution, num_channels = "list", 4, 1

    def __init__(self, items):
        self.items, self.label_dim = items, 2

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


# --- image folder / zip -------------------------------------------------------------------

@pytest.mark.parametrize("as_zip,compression", [(False, None), (True, zipfile.ZIP_STORED),
                                                (True, zipfile.ZIP_DEFLATED)])
def test_image_folder_reads_images_and_labels(tmp_path, as_zip, compression):
    arrays = rgb_images(5)
    path = make_image_set(tmp_path, arrays, labels=[4, 0, 2, 2, 1], as_zip=as_zip,
                          compression=compression)
    cfg = ml_collections.ConfigDict(dict(source="folder", path=path, use_labels=True))
    s = data.make_source(cfg)
    assert (len(s), s.resolution, s.num_channels, s.label_dim) == (5, 8, 3, 5)  # max label + 1
    for k in range(5):
        image, label = s[k]
        np.testing.assert_array_equal(image, arrays[k])  # PNG is lossless
        assert label == [4, 0, 2, 2, 1][k]
    batch = next(data.make_iterator(s, global_batch=5, seed=0, num_workers=0))
    idx = data.epoch_permutation(0, 0, 5)
    np.testing.assert_allclose(batch["image"], np.stack(arrays)[idx] / 127.5 - 1, atol=1e-6)
    np.testing.assert_array_equal(batch["label"].argmax(1), np.array([4, 0, 2, 2, 1])[idx])


@pytest.mark.parametrize("as_zip", [False, True])
def test_image_folder_without_dataset_json(tmp_path, as_zip):
    path = make_image_set(tmp_path, rgb_images(3), labels=None, as_zip=as_zip)
    s = data.ImageFolder(path, use_labels=False)
    assert s.label_dim == 0 and s[1][1] == data.NO_LABEL
    batch = next(data.make_iterator(s, global_batch=2, seed=0, num_workers=0))
    assert batch["label"].shape == (2, 0) and batch["label"].dtype == np.float32
    with pytest.raises(ValueError) as e:
        data.ImageFolder(path, use_labels=True)
    assert "dataset.json" in str(e.value) and "use_labels=False" in str(e.value)


def test_image_folder_grey_and_jpeg(tmp_path):
    grey = [np.full((8, 8), 10 * k, np.uint8) for k in range(3)]
    s = data.ImageFolder(make_image_set(tmp_path, grey), use_labels=False)
    assert s.num_channels == 1 and s[2][0].shape == (8, 8, 1) and s[2][0].max() == 20
    jpg = [np.full((16, 16, 3), 200, np.uint8)] * 2
    s = data.ImageFolder(make_image_set(tmp_path / "j", jpg, fmt="jpg", as_zip=True),
                         use_labels=False)
    assert s.fnames[0].endswith(".jpg") and s.num_channels == 3
    assert np.abs(s[0][0].astype(int) - 200).max() <= 2  # JPEG of a flat image


def test_png_header_parse_agrees_with_pil():
    from edm2_jax.data.image_folder import _png_header
    for array, mode in [(np.zeros((5, 7), np.uint8), "L"), (np.zeros((5, 7, 3), np.uint8), "RGB"),
                        (np.zeros((5, 7, 4), np.uint8), "RGBA")]:
        raw = png_bytes(array)
        with PIL.Image.open(io.BytesIO(raw)) as img:
            assert _png_header(raw[:33]) == (*img.size, img.mode) == (7, 5, mode)
    raw = png_bytes(np.zeros((5, 7), np.uint8))
    assert raw[23] == 5 and _png_header(raw[:23] + b"\6" + raw[24:33]) is None  # bad IHDR CRC


def test_missing_label_error_names_the_image(tmp_path):
    path = make_image_set(tmp_path, rgb_images(3), labels=[0, 1])  # third image unlabelled
    with pytest.raises(ValueError, match="img00000002.png"):
        data.ImageFolder(path)


def test_corrupt_image_header_fails_at_open_naming_the_file(tmp_path):
    path = make_image_set(tmp_path, rgb_images(2), extra={"00000/bad.png": b"not a png"},
                          as_zip=True)
    with pytest.raises(ValueError, match=r"ds\.zip:00000/bad\.png"):
        data.ImageFolder(path, use_labels=False)


def test_truncated_image_fails_when_decoded_naming_the_file(tmp_path):
    good = png_bytes(rgb_images(1, size=32)[0])
    path = make_image_set(tmp_path, rgb_images(2, size=32),
                          extra={"00000/trunc.png": good[:len(good) // 2]})
    s = data.ImageFolder(path, use_labels=False)  # header is fine: opens
    k = s.fnames.index("00000/trunc.png")
    with pytest.raises(ValueError, match="trunc.png"):
        s[k]
    it = data.make_iterator(s, global_batch=3, seed=0, num_workers=2)  # crosses processes
    with pytest.raises(ValueError, match="trunc.png"):
        next(it)
    it.close()


def test_mismatched_size_or_channels_fail_at_open_naming_the_file(tmp_path):
    path = make_image_set(tmp_path / "a", rgb_images(2, size=8),
                          extra={"00001/odd.png": png_bytes(rgb_images(1, size=16)[0])})
    with pytest.raises(ValueError, match="odd.png.*16x16"):
        data.ImageFolder(path, use_labels=False)
    path = make_image_set(tmp_path / "b", rgb_images(2, size=8),
                          extra={"00001/grey.png": png_bytes(np.zeros((8, 8), np.uint8))})
    with pytest.raises(ValueError, match="grey.png.*'L'"):
        data.ImageFolder(path, use_labels=False)


def test_folder_resolution_must_match(tmp_path):
    path = make_image_set(tmp_path, rgb_images(2, size=8))
    with pytest.raises(ValueError, match="data.resolution=16"):
        data.ImageFolder(path, use_labels=False, resolution=16)


# --- tensorflow-datasets ------------------------------------------------------------------

class FakeTFDS:
    """What `tfds.data_source` returns: a sequence of example dicts with `dataset_info`."""

    def __init__(self, examples, image_shape, num_classes=5):
        self.examples = examples
        features = {"image": types.SimpleNamespace(shape=image_shape),
                    "label": types.SimpleNamespace(num_classes=num_classes)}
        self.dataset_info = types.SimpleNamespace(features=features)

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def test_tfds_fixed_size_passes_images_through():
    arrays = rgb_images(4)
    fake = FakeTFDS([{"image": a, "label": k} for k, a in enumerate(arrays)], (8, 8, 3))
    s = data.TFDSSource(fake, name="cifar[train]")
    assert (len(s), s.resolution, s.num_channels, s.label_dim) == (4, 8, 3, 5)
    np.testing.assert_array_equal(s[2][0], arrays[2])
    assert s[3][1] == 3
    assert data.describe(s) == "cifar[train]: 4 images, 8x8x3, 5 classes"


def test_tfds_center_crop_dhariwal_geometry():
    # 16x32 image, constant on 2x2 blocks: the 2x2 box halving is exact (-> 8x16), the
    # bicubic step is the identity (short side already 8), the crop keeps columns 4..11.
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (8, 16, 3), np.uint8)
    image = blocks.repeat(2, 0).repeat(2, 1)
    fake = FakeTFDS([{"image": image, "label": 1}], (None, None, 3))
    s = data.TFDSSource(fake, name="imagenet", resolution=8)
    np.testing.assert_array_equal(s[0][0], blocks[:, 4:12])
    # 'center-crop': central 12x12 square of a 12x20 image; no resize needed.
    image = rng.integers(0, 256, (12, 20, 3), np.uint8)
    fake = FakeTFDS([{"image": image, "label": 0}], (None, None, 3))
    np.testing.assert_array_equal(
        data.TFDSSource(fake, name="x", resolution=12, transform="center-crop")[0][0],
        image[:, 4:16])
    big = FakeTFDS([{"image": rng.integers(0, 256, (300, 400, 3), np.uint8), "label": 0}],
                   (None, None, 3))
    assert data.TFDSSource(big, name="x", resolution=64)[0][0].shape == (64, 64, 3)
    with pytest.raises(ValueError, match="data.transform"):
        data.TFDSSource(big, name="x", resolution=64, transform="none")[0]


def test_tfds_needs_resolution_for_variable_sizes_and_label_feature():
    fake = FakeTFDS([], (None, None, 3))
    with pytest.raises(ValueError, match="set data.resolution"):
        data.TFDSSource(fake, name="imagenet2012")
    del fake.dataset_info.features["label"]
    with pytest.raises(ValueError, match="use_labels=False"):
        data.TFDSSource(fake, name="x", resolution=8)
    assert data.TFDSSource(fake, name="x", resolution=8, use_labels=False).label_dim == 0


def test_make_source_tfds_calls_data_source(monkeypatch):
    calls = []
    grey = [np.full((28, 28), k, np.uint8) for k in range(3)]  # tfds may give 2-D grey images

    def data_source(name, **kwargs):
        calls.append((name, kwargs))
        return FakeTFDS([{"image": g, "label": k} for k, g in enumerate(grey)], (28, 28, 1),
                        num_classes=10)

    monkeypatch.setitem(sys.modules, "tensorflow_datasets",
                        types.SimpleNamespace(data_source=data_source))
    cfg = configs.base_config().data
    cfg.update(source="tfds", name="fashion_mnist", split="test", data_dir="/data/tfds")
    s = data.make_source(cfg)
    assert calls == [("fashion_mnist", dict(split="test", data_dir="/data/tfds", download=False))]
    assert (s.resolution, s.num_channels, s.label_dim) == (28, 1, 10)
    assert s[2][0].shape == (28, 28, 1) and s[2][1] == 2


def test_missing_tensorflow_datasets_gives_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # makes the import fail
    cfg = configs.base_config().data
    cfg.update(source="tfds", name="imagenet2012")
    with pytest.raises(ImportError, match="pip install tensorflow-datasets"):
        data.make_source(cfg)


def test_make_source_rejects_unknown_source():
    with pytest.raises(ValueError, match="fashion_mnist"):
        data.make_source(ml_collections.ConfigDict(dict(source="lsun")))
