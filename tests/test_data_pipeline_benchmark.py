"""benchmarks/data_pipeline.py: its stand-in data set is what the dataset tools write (a
zip of 64x64 PNGs with labels that `ImageFolder` reads back pixel for pixel), and the
command measures, in one call, the training iterator and the thread baseline over each
kind of data and writes its figures."""
from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import data_pipeline  # noqa: E402
from edm2_jax.data import pipeline  # noqa: E402
from edm2_jax.data.image_folder import ImageFolder  # noqa: E402


def test_standin_data_set_reads_back_as_written(tmp_path):
    path = data_pipeline.write_standin(str(tmp_path / "d.zip"), images=12, resolution=64,
                                       classes=5)
    src = ImageFolder(path)
    assert (len(src), src.resolution, src.num_channels, src.label_dim) == (12, 64, 3, 5)
    with zipfile.ZipFile(path) as zf:
        names = sorted(n for n in zf.namelist() if n.endswith(".png"))
        labels = dict(json.loads(zf.read("dataset.json"))["labels"])
        for i, name in enumerate(names):
            with zf.open(name) as f:
                want = np.asarray(PIL.Image.open(f))
            img, label = src[i]
            np.testing.assert_array_equal(img, want)
            assert label == labels[name] == i % 5
    # compression level 0: the image data stored, so each PNG is at least its pixels
    assert data_pipeline.mean_file_bytes(path) >= 64 * 64 * 3
    assert not (tmp_path / "d.zip.part").exists()


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_command_measures_each_loader_of_each_kind(tmp_path, capsys):
    """One call: for PNGs and their raw conversion, the thread baseline and the worker
    processes (raw: also gathered in-process), img/s, per-core img/s and memory per row,
    the floors checked, everything in the JSON it writes."""
    out = tmp_path / "d.json"
    res = data_pipeline.main([f"--workdir={tmp_path}", "--kinds=png,raw", "--images=40",
                              "--resolution=16", "--classes=3", "--batch=8", "--batches=2",
                              "--repeats=2", "--threads=1", "--workers=1", "--target=1e12",
                              f"--out={out}"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["fresh_shm_us_per_kib"] > 0
    assert [(r["kind"], r["loader"]) for r in res["rows"]] == [
        ("png", "threads:1"), ("png", "workers:1"),
        ("raw", "threads:1"), ("raw", "in-process"), ("raw", "workers:1")]
    for r in res["rows"]:
        assert len(r["all"]) == 2 and r["img_per_s"] == pytest.approx(np.median(r["all"]))
        assert r["img_per_s"] > 0 and r["meets_target"] is False and r["memory_mib"] > 10
        assert r["cpu_s_per_img"] >= 0
        assert r["workers"] == (1 if r["loader"] == "workers:1" else None)
    assert all(r["processes"] >= 2 for r in res["rows"] if r["loader"] == "workers:1")
    assert set(res["floors"]["meets"]) == {"png_2_over_1_workers >= 1.8",
                                           "raw_over_png_per_core >= 5"}
    assert res["floors"]["png_2_over_1_workers"] is None  # no 2-worker row asked for
    text = capsys.readouterr().out
    assert "40 items 16x16x3, 3 classes" in text and "workers:1:" in text
    # the batches it timed are the training iterator's, and the baseline's are the same
    src = ImageFolder(res["data"]["png"])
    ref = data_pipeline.threaded_reference(src, global_batch=8, seed=0, workers=2)
    with pipeline.make_iterator(src, global_batch=8, seed=0, num_workers=0) as it:
        for _ in range(6):
            a, b = next(it), next(ref)
            np.testing.assert_array_equal(a["image"], b["image"])
            np.testing.assert_array_equal(a["label"], b["label"])
    ref.close()


def test_latent_standin_is_drawn_by_the_pipeline(tmp_path):
    """--kinds=latents: raw [8, R, R] latents that `LatentFolder` reads, and batches of the
    pipeline's 4-channel draws, mean + N(0, 1) std scaled as `vae.encode_latents`."""
    from edm2_jax.data.latents import LatentFolder
    from edm2_jax.encoders import vae
    res = data_pipeline.main([f"--workdir={tmp_path}", "--kinds=latents", "--images=8",
                              "--resolution=8", "--classes=2", "--batch=4", "--batches=1",
                              "--repeats=1", "--threads=1", "--workers="])
    assert [r["loader"] for r in res["rows"]] == ["threads:1"]
    assert res["rows"][0]["item_bytes"] >= 8 * 8 * 8 * 4
    src = LatentFolder(res["data"]["latents"], use_labels=True)
    raw, label = src[3]
    assert raw.shape == (8, 8, 8) and label == 1 and (raw[..., 4:] >= 0.1).all()
    batch = next(pipeline.make_iterator(src, global_batch=4, seed=0, num_workers=0))
    assert batch["image"].shape == (4, 8, 8, 4)
    for position, i in enumerate(pipeline.StreamOrder(8, 0).indices(0, 4)):
        want = vae.encode_latents(src[int(i)][0], pipeline.latent_noise(0, position, (8, 8, 4)))
        np.testing.assert_array_equal(batch["image"][position], want)


def test_bad_lists_are_one_error_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: --workers='0' must list counts >= 1"):
        data_pipeline.main([f"--workdir={tmp_path}", "--workers=0"])
    with pytest.raises(SystemExit, match=r"^error: --kinds='jpeg': choose from png,raw,latents"):
        data_pipeline.main([f"--workdir={tmp_path}", "--kinds=jpeg"])
