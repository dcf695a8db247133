"""The raw data set format (data/raw_array.py): a zip of PNGs converted to `NAME.npy` is the
same images bit for bit; its headers are checked against its files before anything is
read; it reads from gs:// as locally; the dataset tool writes all of it or nothing."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import data_pipeline  # noqa: E402
from edm2_jax import data  # noqa: E402
from edm2_jax.data import dataset_tool, raw_array  # noqa: E402


@pytest.fixture
def zipped(tmp_path) -> str:
    """13 random 8x8 RGB PNGs, 4 classes, as `dataset_tool convert` writes them."""
    return data_pipeline.write_standin(str(tmp_path / "d.zip"), 13, 8, 4)


def test_a_png_zip_converted_is_the_same_images_bit_for_bit(zipped, tmp_path):
    """Image i and label i of the .npy are those ImageFolder decodes from the zip; the
    file is a plain .npy (np.load reads it); the training batches are the same."""
    assert dataset_tool.convert(zipped, str(tmp_path / "d.npy"), quiet=True) == 13
    png = data.ImageFolder(zipped)
    raw = data.make_source(dict(source="folder", path=str(tmp_path / "d.npy")))
    assert isinstance(raw, data.RawImages) and raw.decoded
    assert data.describe(raw) == data.describe(png) == "d: 13 images, 8x8x3, 4 classes"
    whole = np.load(tmp_path / "d.npy")
    assert whole.dtype == np.uint8 and whole.shape == (13, 8, 8, 3)
    np.testing.assert_array_equal(np.load(tmp_path / "d.labels.npy"), png.labels)
    for i in range(13):
        np.testing.assert_array_equal(raw[i][0], png[i][0])
        np.testing.assert_array_equal(whole[i], png[i][0])
        assert raw[i][1] == png[i][1]
    idx = np.array([12, 0, 5, 5, 3])
    images, labels = raw.read_batch(idx)
    np.testing.assert_array_equal(images, whole[idx])
    np.testing.assert_array_equal(labels, png.labels[idx])
    kw = dict(global_batch=5, seed=1, num_workers=0)
    with data.make_iterator(png, **kw) as a, data.make_iterator(raw, **kw) as b:
        for _ in range(4):
            x, y = next(a), next(b)
            np.testing.assert_array_equal(x["image"], y["image"])
            np.testing.assert_array_equal(x["label"], y["label"])


def test_one_source_to_png_and_to_raw_gives_the_same_pixels(tmp_path):
    """The same source (a folder of odd-sized grey and RGB images, resized and cropped)
    written as PNGs and as a raw array holds the same pixels; unlabelled: no labels file."""
    import PIL.Image
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for k, shape in enumerate([(20, 30, 3), (24, 16), (16, 16, 3)]):
        PIL.Image.fromarray(rng.integers(0, 256, shape, np.uint8)).save(src / f"{k}.png")
    kw = dict(resolution="8x8", transform="center-crop", quiet=True)
    dataset_tool.convert(str(src), str(tmp_path / "o.zip"), **kw)
    dataset_tool.convert(str(src), str(tmp_path / "o.npy"), **kw)
    assert not (tmp_path / "o.labels.npy").exists()
    png = data.ImageFolder(str(tmp_path / "o.zip"), use_labels=False)
    raw = data.RawImages(str(tmp_path / "o.npy"), use_labels=False)
    assert raw.label_dim == 0 and raw[1][1] == data.NO_LABEL
    for i in range(3):
        np.testing.assert_array_equal(raw[i][0], png[i][0])
    with pytest.raises(ValueError, match=r"no labels beside it .*o\.labels\.npy.*use_labels=False"):
        data.RawImages(str(tmp_path / "o.npy"))


def _write(path, header: bytes, payload: bytes = b"") -> str:
    with open(path, "wb") as f:
        f.write(header + payload)
    return str(path)


def test_a_header_claiming_more_than_its_file_holds_is_one_error_naming_it(tmp_path):
    """A trillion 64x64 images announced in a file of 12 KiB: ValueError naming the file,
    from the sizes alone (nothing allocated); likewise a truncated file, a file longer
    than its header, labels that disagree, a wrong dtype, and bytes that are no .npy."""
    img = np.zeros((64, 64, 3), np.uint8).tobytes()
    huge = _write(tmp_path / "huge.npy", raw_array.npy_header((10**12, 64, 64, 3), np.uint8), img)
    with pytest.raises(ValueError, match=r"huge\.npy: its header says uint8 \(1000000000000, "
                                         r"64, 64, 3\).*truncated"):
        data.RawImages(huge, use_labels=False)
    longer = _write(tmp_path / "long.npy", raw_array.npy_header((1, 64, 64, 3), np.uint8),
                    img + b"\0")
    with pytest.raises(ValueError, match=r"long\.npy.*longer than its header"):
        data.RawImages(longer, use_labels=False)
    ok = _write(tmp_path / "ok.npy", raw_array.npy_header((2, 64, 64, 3), np.uint8), img * 2)
    _write(tmp_path / "ok.labels.npy", raw_array.npy_header((10**15,), np.int64), b"\0" * 16)
    with pytest.raises(ValueError, match=r"ok\.labels\.npy holds int64 \(1000000000000000,\)"):
        data.RawImages(ok)
    _write(tmp_path / "ok.labels.npy", raw_array.npy_header((2,), np.int64), b"\0" * 8)
    with pytest.raises(ValueError, match=r"ok\.labels\.npy.*truncated"):
        data.RawImages(ok)
    np.save(tmp_path / "ok.labels.npy", np.array([0, -3]))
    with pytest.raises(ValueError, match=r"ok\.labels\.npy: label -3 of image 1 is negative"):
        data.RawImages(ok)
    np.save(tmp_path / "ok.labels.npy", np.array([10**12, 1]))  # a network of 10**12 classes
    with pytest.raises(ValueError, match=r"ok\.labels\.npy: label 1000000000000 of image 0 is "
                                         r"more classes than a network's label embedding"):
        data.RawImages(ok)
    assert data.RawImages(ok, use_labels=False).label_dim == 0
    np.save(tmp_path / "f.npy", np.zeros((2, 8, 8, 3), np.float32))
    with pytest.raises(ValueError, match=r"f\.npy holds float32 \(2, 8, 8, 3\); a raw data set"):
        data.RawImages(str(tmp_path / "f.npy"), use_labels=False)
    junk = _write(tmp_path / "junk.npy", b"PK\x03\x04 not an array")
    with pytest.raises(ValueError, match=r"junk\.npy is not a readable \.npy array"):
        data.RawImages(junk, use_labels=False)
    with pytest.raises(FileNotFoundError, match="missing.npy does not exist"):
        data.RawImages(str(tmp_path / "missing.npy"))


def test_the_dataset_tool_writes_a_whole_data_set_or_nothing(tmp_path, capsys):
    """`convert --dest=X.npy` prints what it wrote; an existing destination is refused
    before the source is read; an image of another size stops it with nothing left;
    `encode` and `decode` refuse a .npy destination."""
    src = tmp_path / "src"
    src.mkdir()
    import PIL.Image
    for k in range(3):
        PIL.Image.fromarray(np.full((8, 8, 3), k, np.uint8)).save(src / f"{k}.png")
    dest = str(tmp_path / "x.npy")
    assert dataset_tool.main(["convert", f"--source={src}", f"--dest={dest}", "--quiet"]) == 0
    assert f"wrote 3 images to {dest}" in capsys.readouterr().out
    assert data.RawImages(dest, use_labels=False)[2][0].max() == 2
    assert dataset_tool.main(["convert", f"--source={src}", f"--dest={dest}", "--quiet"]) == 1
    assert "x.npy exists" in capsys.readouterr().err
    PIL.Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(src / "3.png")
    bad = str(tmp_path / "y.npy")
    assert dataset_tool.main(["convert", f"--source={src}", f"--dest={bad}", "--quiet"]) == 1
    assert "16x16, but earlier images are 8x8" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["src", "x.npy"]
    for command in ("encode", "decode"):
        assert dataset_tool.main([command, f"--source={src}", f"--dest={bad}", "--vae=v"]) == 1
        assert "the raw .npy format is for convert" in capsys.readouterr().err


def test_latents_are_not_a_raw_array(zipped, tmp_path):
    dataset_tool.convert(zipped, str(tmp_path / "d.npy"), quiet=True)
    with pytest.raises(ValueError, match="raw array of pixels"):
        data.make_source(dict(source="folder", path=str(tmp_path / "d.npy"), encoder="sd-vae"))
    with pytest.raises(ValueError, match="data.resolution=16"):
        data.make_source(dict(source="folder", path=str(tmp_path / "d.npy"), resolution=16))


@pytest.mark.skipif(importlib.util.find_spec("gcp_storage_emulator") is None
                    or importlib.util.find_spec("gcsfs") is None,
                    reason="needs gcp-storage-emulator and gcsfs (the test extra)")
def test_read_from_gcs_as_from_local_disk(zipped, tmp_path):
    """The same data set in a bucket (the GCS emulator of tests/test_gcs_workdir.py):
    the same images and labels, item by item and by batch, and the same header checks."""
    from tests import test_gcs_workdir
    local = str(tmp_path / "d.npy")
    dataset_tool.convert(zipped, local, quiet=True)
    with _emulator(test_gcs_workdir) as (bucket, fs):
        for name in ("d.npy", "d.labels.npy"):
            fs.put(str(tmp_path / name), f"{bucket}/sets/{name}")
        remote = data.make_source(dict(source="folder", path=f"{bucket}/sets/d.npy"))
        near = data.RawImages(local)
        assert data.describe(remote) == data.describe(near)
        idx = np.array([4, 11, 0, 4])
        for a, b in zip(remote.read_batch(idx), near.read_batch(idx)):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(remote[7][0], near[7][0])
        with fs.open(f"{bucket}/sets/cut.npy", "wb") as f:
            f.write(open(local, "rb").read()[:-5])
        with pytest.raises(ValueError, match=r"sets/cut\.npy.*truncated"):
            data.RawImages(f"{bucket}/sets/cut.npy", use_labels=False)


def _emulator(module):
    """`test_gcs_workdir.gcs`'s emulator (bucket URL, fsspec file system) as a context."""
    import contextlib
    return contextlib.contextmanager(module.gcs.__wrapped__)()


def test_a_release_zip_stays_readable_beside_the_raw_format(zipped):
    src = data.make_source(dict(source="folder", path=zipped))
    assert isinstance(src, data.ImageFolder) and not src.decoded
    with zipfile.ZipFile(zipped) as z:
        assert len(json.loads(z.read("dataset.json"))["labels"]) == 13
