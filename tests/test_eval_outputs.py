"""What `--mode=eval` writes and keeps (`evaluation.commands`, `evaluation.ref_cache`).

The claims:
- An evaluation of a training run keeps its results and its resumable state beside the
  run (`RUN/eval.jsonl`, `RUN/eval.jsonl.partial.p0.npz` while it runs), whatever the
  current directory, which it leaves empty.
- Reference statistics of the `--config` data are computed once: a second evaluation
  reads them from the cache (the statistics are not computed again) and gives the same
  figures bitwise; another number of images, other feature-network weights or changed
  data compute new ones; a cache file that is unreadable or fails its checksum is not
  trusted, one line says so, and the statistics are computed again; a cache that cannot
  be written costs the next evaluation, not this one.
"""
from __future__ import annotations

import json
import os

import numpy as np
import PIL.Image
import pytest

from edm2_jax.evaluation import commands as eval_commands
from edm2_jax.evaluation import fid
from edm2_jax.evaluation import metrics as metrics_lib
from edm2_jax.sampling import seed_images
from edm2_jax.training import loop
from tests.test_train import make_image_folder, tiny_config, xla_cache  # noqa: F401
from edm2_jax.sampling.solvers import Heun


def _features(params, images):
    """A feature network stand-in: the 8 row means of 8x8 grey images, float64 [n, 8]."""
    return np.asarray(images, np.float64)[..., 0].mean(axis=2)


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """The stand-in features for `fid`, the cache in `tmp_path/cache`, and the list of
    the metric sets whose reference statistics were computed (not read)."""
    monkeypatch.setenv("EDM2_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(metrics_lib, "feature_extractor", lambda m, d=None: (None, _features))
    computed = []
    real = fid.stats_from_source_multi

    def counting(source, extractors, *args, **kwargs):
        computed.append(sorted(extractors))
        return real(source, extractors, *args, **kwargs)
    monkeypatch.setattr(fid, "stats_from_source_multi", counting)
    return computed


def _failing_after(batches: int):
    """`seed_images.generate_images` raising RuntimeError after `batches` batches."""
    real = seed_images.generate_images

    def wrapped(*args, **kw):
        for i, batch in enumerate(real(*args, **kw)):
            if i == batches:
                raise RuntimeError("killed")
            yield batch
    return wrapped


# Slow (~20 s on 2 cores): a run trained, then evaluated with its sampler compiled.
@pytest.mark.slow
@pytest.mark.ci
def test_eval_of_a_run_writes_beside_the_run_not_in_the_cwd(tmp_path, monkeypatch, counted,
                                                            xla_cache):  # noqa: F811
    """The tiny run evaluated from another directory: stopped after one batch, its
    state is beside the run; the same command resumes from it, appends the figures to
    `RUN/eval.jsonl` and removes the state; the current directory stays empty."""
    data = make_image_folder(tmp_path / "data")
    run = tmp_path / "run"
    loop.train_and_evaluate(tiny_config(data), str(run))
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    kw = dict(images_dir=None, net_path=str(run), num_images=8, metrics="fid", ref=None,
              data_config=dict(source="folder", path=str(data), use_labels=True),
              sampler=Heun(2), batch_size=4, progress=False)
    with monkeypatch.context() as m:
        m.setattr(seed_images, "generate_images", _failing_after(1))
        with pytest.raises(RuntimeError, match="killed"):
            eval_commands.main_eval(**kw)
    state = run / "eval.jsonl.partial.p0.npz"
    assert state.is_file() and os.listdir(cwd) == []
    res = eval_commands.main_eval(**kw)
    assert res["images_generated"] == 4  # resumed: the other 4 came from the state
    assert os.listdir(cwd) == [] and not state.exists()
    rows = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["net"] == str(run)
    assert rows[0]["fid8"] == res["fid8"] and np.isfinite(res["fid8"])


# --------------------------------------------------------------------------------------
# The reference-statistics cache


def _images(path, n: int = 8, seed: int = 1):
    path.mkdir()
    rng = np.random.default_rng(seed)
    for i in range(n):
        PIL.Image.fromarray(rng.integers(0, 256, (8, 8), np.uint8)).save(path / f"g{i}.png")
    return path


def test_reference_statistics_are_computed_once_and_checked_on_read(
        tmp_path, counted, standin_inception_weights, monkeypatch, capsys):
    data = make_image_folder(tmp_path / "data")
    kw = dict(images_dir=str(_images(tmp_path / "generated")), net_path=None, num_images=8,
              metrics="fid", ref=None, progress=True,
              data_config=dict(source="folder", path=str(data), use_labels=True))
    first = eval_commands.main_eval(**kw)
    assert counted == [["fid"]] and np.isfinite(first["fid8"]) and first["fid8"] > 0
    capsys.readouterr()

    second = eval_commands.main_eval(**kw)
    assert counted == [["fid"]]  # read, not computed
    assert second["fid8"] == first["fid8"]
    cached, = (tmp_path / "cache" / "refstats").iterdir()
    assert f"read from the cache {cached}" in capsys.readouterr().out

    # A cache file cut short, then one whose statistics were altered (its zip intact):
    # each is named, not trusted, computed again and replaced; the figures stay.
    good = cached.read_bytes()
    cached.write_bytes(good[:len(good) // 2])
    again = eval_commands.main_eval(**kw)
    assert f"cache {cached} is not trusted (unreadable" in capsys.readouterr().out
    assert counted == [["fid"]] * 2 and again["fid8"] == first["fid8"]
    with np.load(cached) as z:
        saved = {k: z[k] for k in z.files}
    saved["mean"] = saved["mean"] + 1e-3
    np.savez(cached, **saved)
    again = eval_commands.main_eval(**kw)
    assert f"cache {cached} is not trusted (checksum mismatch)" in capsys.readouterr().out
    assert counted == [["fid"]] * 3 and again["fid8"] == first["fid8"]
    eval_commands.main_eval(**kw)
    assert counted == [["fid"]] * 3  # the replaced file is read

    # What the statistics depend on: the number of images, the feature network's
    # weights file, the data's files.
    eval_commands.main_eval(**dict(kw, num_images=6))
    assert counted == [["fid"]] * 4
    (tmp_path / "other_weights.pt").write_bytes(b"other weights")
    with monkeypatch.context() as m:
        m.setenv("EDM2_INCEPTION_WEIGHTS", str(tmp_path / "other_weights.pt"))
        eval_commands.main_eval(**kw)
    assert counted == [["fid"]] * 5
    PIL.Image.fromarray(np.full((8, 8), 255, np.uint8)).save(data / "img000.png")
    changed = eval_commands.main_eval(**kw)
    assert counted == [["fid"]] * 6
    assert len(list((tmp_path / "cache" / "refstats").iterdir())) == 4

    # A cache that cannot be written: the eval goes on, one line says why.
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("EDM2_JAX_CACHE", str(tmp_path / "a_file" / "cache"))
    capsys.readouterr()
    assert eval_commands.main_eval(**kw)["fid8"] == changed["fid8"]
    assert "Reference statistics (fid) not cached (" in capsys.readouterr().out
