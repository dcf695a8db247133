"""What `--mode=eval` writes and keeps (`evaluation.commands`).

The claim: an evaluation of a training run keeps its results and its resumable state
beside the run (`RUN/eval.jsonl`, `RUN/eval.jsonl.partial.p0.npz` while it runs),
whatever the current directory, which it leaves empty.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from edm2_jax.evaluation import commands as eval_commands
from edm2_jax.evaluation import fid
from edm2_jax.evaluation import metrics as metrics_lib
from edm2_jax.sampling import generate
from edm2_jax.training import loop
from tests.test_train import make_image_folder, tiny_config, xla_cache  # noqa: F401


def _features(params, images):
    """A feature network stand-in: the 8 row means of 8x8 grey images, float64 [n, 8]."""
    return np.asarray(images, np.float64)[..., 0].mean(axis=2)


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """The stand-in features for `fid`, the cache in `tmp_path/cache`, and the list of
    the metric sets whose reference statistics were computed."""
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
    """`generate.generate_images` raising RuntimeError after `batches` batches."""
    real = generate.generate_images

    def wrapped(*args, **kw):
        for i, batch in enumerate(real(*args, **kw)):
            if i == batches:
                raise RuntimeError("killed")
            yield batch
    return wrapped


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
              num_steps=2, batch_size=4, progress=False)
    with monkeypatch.context() as m:
        m.setattr(generate, "generate_images", _failing_after(1))
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
