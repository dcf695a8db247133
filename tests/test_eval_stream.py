"""`--mode=eval --net` in one streamed, resumable pass (`evaluation.stream`): the same
figures as generating PNGs and evaluating the folder, after a kill and a resume (no seed
generated twice), on 2 devices and on 2 processes.

Setup: a tiny unconditional 8x8x1 net (random weights, 4 Heun steps), a labelled folder
of 32 8x8 grey images as the data (reference statistics and the classifier of `cls`,
trained for one epoch and cached in the test's directory), 16 seeds in batches of 4.

Tolerance of the figures (`fd_tolerance`): each path computes the same features (float32
networks) of the same uint8 images, possibly in other batches, so a feature differs by
at most `delta = reorder_tol(forward_terms(params)) * max|x|` (tests/tolerances.py); the
statistics are float64, whose rounding is negligible beside it. As tests/tolerances.py
does for sums, the roundings are modelled as independent zero-mean errors (lam = 1), so
an inner product `<A, dX>` of a fixed array with the feature errors is at most
`||A||_F delta`. With `X` the centred generated features (`N x D`), to first order the
terms of the Frechet distance move by at most

    |mu_g - mu_r|^2            2 |mu_g - mu_r| delta / sqrt(N)    (+ D delta^2, 2nd order)
    tr Sigma_g = ||X||_F^2 / (N - 1)      2 ||X||_F delta / (N - 1)   (+ E^2 / (N - 1))
    2 tr (Sigma_g Sigma_r)^½              2 sqrt(tr Sigma_r) delta / sqrt(N - 1)

with `E = 2 sqrt(N D) delta` the worst-case `||dX||_F`; the last because
`tr (Sigma_g Sigma_r)^½ = ||Sigma_r^½ X^T||_* / sqrt(N - 1)` (polar decomposition of
X), whose derivative is `<Sigma_r^½ G, dX^T>` with `G` the polar factor, and
`||Sigma_r^½ G||_F <= ||Sigma_r^½||_F ||G||_2 = sqrt(tr Sigma_r)`.
Measured: the streamed, `--images`, 2-device and resumed paths agree bitwise (same
batches, same order); the direct library computation of whole arrays is 3.8e-7 off in
FID-16 (bound 0.008) and 0 in fd_cls (bound 3e-4). One image of the 16 repeated in
place of another moves FID-16 by 0.96 and fd_cls by 1.05 (the negative controls).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import PIL.Image
import pytest

from edm2_jax import data as data_lib
from edm2_jax import nets, process
from edm2_jax.evaluation import classifier as cls_lib
from edm2_jax.evaluation import classifier_metrics, fid, inception, stream
from edm2_jax.evaluation import commands as eval_commands
from edm2_jax.evaluation.metrics import GeneratedFeatures
from edm2_jax.model.networks import init_variables, precond_from_config
from edm2_jax.modes import generate as generate_mode
from edm2_jax.run import network_dir as checkpoint
from edm2_jax.sampling import seed_images
from edm2_jax.sampling.solvers import Heun
from tests.tolerances import forward_terms, reorder_tol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NET = dict(img_resolution=8, img_channels=1, label_dim=0, model_channels=8, channel_mult=(1,),
           num_blocks=1, attn_resolutions=())
NUM, BATCH, STEPS = 16, 4, 4
CLASSIFIER = cls_lib.TrainConfig(epochs=1, batch_size=8)
_GENERATE_IMAGES = seed_images.generate_images  # the real one, under the tests' wrappers


def _tiny_net(path, key: int) -> str:
    net = precond_from_config(NET)
    v = init_variables(net, jax.random.PRNGKey(key))
    v["params"] = jax.tree.map(lambda a: np.full_like(a, 0.7) if a.ndim == 0 else a,
                               v["params"])
    return checkpoint.save_network(str(path), v, NET)


def _setup(root):
    """The tiny net (and a guide: other weights), the labelled data folder under `root`."""
    net_path = _tiny_net(root / "net", 0)
    _tiny_net(root / "guide", 1)
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(32):
        # two classes: dark and bright noise, so that the classifier learns something
        PIL.Image.fromarray(rng.integers(0, 128, (8, 8), np.uint8) + 127 * (i % 2)).save(
            data / f"img{i:03d}.png")
    (data / "dataset.json").write_text(json.dumps(
        {"labels": [[f"img{i:03d}.png", i % 2] for i in range(32)]}))
    return net_path, dict(source="folder", path=str(data), use_labels=True)


def _eval_kw(data, metrics="cls,fid", **kw):
    return dict(dict(images_dir=None, num_images=NUM, metrics=metrics, ref=None,
                     data_config=data, classifier_config=CLASSIFIER, sampler=Heun(STEPS),
                     batch_size=BATCH, progress=False), **kw)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDM2_JAX_CACHE", str(root / "cache"))
        net_path, data = _setup(root)
        yield root, net_path, data


@pytest.fixture(scope="module")
def streamed(setup):
    """The uninterrupted streamed eval (cls and fid) of seeds 0..15, in one process."""
    root, net_path, data = setup
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDM2_JAX_CACHE", str(root / "cache"))
        return eval_commands.main_eval(net_path=net_path, out_json=str(root / "full.json"),
                                       outdir=str(root / "png_streamed"), **_eval_kw(data))


def _centred(x):
    x = np.asarray(x, np.float64)
    return x - x.mean(axis=0)


def fd_tolerance(gen_feats, ref_mu, ref_sigma, n_terms: int) -> float:
    """The bound of the module docstring on the change of a Frechet distance when every
    generated feature moves by float32 rounding of a network of `n_terms`."""
    x = np.asarray(gen_feats, np.float64)
    n, d = x.shape
    delta = reorder_tol(n_terms) * np.abs(x).max()
    e = 2 * np.sqrt(n * d) * delta
    first = (2 * np.linalg.norm(x.mean(axis=0) - ref_mu) * delta / np.sqrt(n)
             + 2 * np.linalg.norm(_centred(x)) * delta / (n - 1)
             + 2 * np.sqrt(max(np.trace(ref_sigma), 0.0)) * delta / np.sqrt(n - 1))
    return float(first + d * delta ** 2 + e * e / (n - 1))


def _reference(root, data, images, repeat_first: bool = False):
    """The figures of `images` computed directly with the library (whole arrays, no
    stream) and their tolerances: `{key: (value, tolerance)}`. The classifier comes from
    the cache of `$EDM2_JAX_CACHE`. `repeat_first`: the negative control, image 1's
    features in place of image 0's."""
    folder = data_lib.make_source(dict(data, split="test"))
    params = inception.load_inception_params()
    ref = fid.stats_from_source(folder, params, num_images=NUM, progress=False)
    feats = np.asarray(inception.features_uint8(params, images), np.float64)
    feats[0] = feats[int(repeat_first)]
    gen = fid.FeatureStats.from_features(feats)
    out = {f"fid{NUM}": (fid.fid_from_stats(gen, ref),
                         fd_tolerance(feats, *ref.mean_cov(), forward_terms(params)))}
    clf, _ = cls_lib.get_classifier(folder, folder, config=CLASSIFIER, log=False)
    gen_cls = clf.features(images)
    gen_cls[0] = gen_cls[int(repeat_first)]
    ref_cls = clf.features(cls_lib.source_arrays(folder)[0])
    m = classifier_metrics.features_metrics(gen_cls, ref_cls)
    ref_stats = fid.FeatureStats.from_features(ref_cls)
    out["fd_cls"] = (m["fd_cls"], fd_tolerance(gen_cls, *ref_stats.mean_cov(),
                                               forward_terms(clf.params)))
    return out


def _png_images(folder, seeds):
    return np.stack([np.asarray(PIL.Image.open(os.path.join(folder, f"{s:06d}.png")))[..., None]
                     for s in seeds])


def _assert_figures(got: dict, want: dict, what: str) -> None:
    for key, (value, tol) in want.items():
        assert abs(got[key] - value) <= tol, (f"{what}: {key} {got[key]!r} vs {value!r}, "
                                              f"tolerance {tol:.3g}")


# --------------------------------------------------------------------------------------
# Pieces: seeds, shares, the accumulator, the partial state


def test_seeds_spec_is_what_parse_seeds_reads():
    for seeds in ([0], list(range(50000)), [1, 5, 7, 8, 9], [3, 2, 1], [4, 5, 9, 10, 11, 0]):
        spec = stream.seeds_spec(seeds)
        assert seed_images.parse_seeds(spec) == seeds
    assert stream.seeds_spec(range(50000)) == "0-49999"
    assert stream.seeds_spec([1, 5, 7, 8, 9]) == "1,5,7-9"


def test_process_shares_cover_every_seed_once_as_generate_images_splits_them():
    seeds = list(range(100, 123))
    for count in (1, 2, 3):
        shares = [stream.process_share(seeds, 5, p, count) for p in range(count)]
        assert sorted(s for sh in shares for s in sh) == seeds
    # generate_images with all_processes=True takes the batches [p::count] of size 5:
    assert stream.process_share(seeds, 5, 1, 2) == list(range(105, 110)) + list(range(115, 120))


class _Clf:
    """A classifier stand-in: its features are the images' first 3 pixels."""
    feature_dim = 3

    def features(self, images, batch_size=500):
        return np.asarray(images, np.float32).reshape(len(images), -1)[:, :3] / 10


def _fake_extractor(params, images):
    return np.asarray(images, np.float32).reshape(len(images), -1)[:, :4] * params


def test_generated_features_merge_state_and_order():
    """Statistics of batches added, merged from two halves or reloaded from `state()`
    equal those of the whole set (float64: to 1e-12); the classifier features come back
    in the order asked for."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (10, 2, 2, 1), dtype=np.uint8)
    ids = np.array([7, 3, 9, 0, 1, 2, 8, 4, 6, 5])
    whole = GeneratedFeatures({"fid": (2.0, _fake_extractor)}, _Clf())
    for a in range(0, 10, 4):  # batches 4, 4, 2: the last padded for the extractor
        whole.add(images[a:a + 4], ids[a:a + 4])
    want = _fake_extractor(2.0, images).astype(np.float64)
    np.testing.assert_allclose(whole.stats["fid"].mean(), want.mean(0), rtol=1e-12)
    np.testing.assert_allclose(whole.stats["fid"].cov(), np.cov(want, rowvar=False),
                               rtol=1e-12, atol=1e-12)
    first, second = (GeneratedFeatures({"fid": (2.0, _fake_extractor)}, _Clf())
                     for _ in range(2))
    first.add(images[:6], ids[:6])
    second.add(images[6:], ids[6:])
    reloaded = GeneratedFeatures({"fid": (2.0, _fake_extractor)}, _Clf()).load_state(
        first.state())
    merged = reloaded.merge(second)
    assert merged.num_items == 10 and merged.ids.tolist() == ids.tolist()
    np.testing.assert_allclose(merged.stats["fid"].cov(), whole.stats["fid"].cov(),
                               rtol=1e-12, atol=1e-12)
    order = sorted(ids.tolist())
    np.testing.assert_array_equal(merged.cls_features(order),
                                  _Clf().features(images[np.argsort(ids)]))
    with pytest.raises(ValueError, match="not the 9 asked"):
        merged.cls_features(order[:9])
    with pytest.raises(ValueError, match="other counts"):
        GeneratedFeatures({"fid": (2.0, _fake_extractor)}, _Clf()).load_state(
            dict(first.state(), ids=ids[:2]))


def test_partial_state_is_loaded_only_for_the_same_settings(tmp_path):
    gen = GeneratedFeatures({"fid": (1.0, _fake_extractor)})
    gen.add(np.ones((3, 2, 2, 1), np.uint8), [4, 5, 6])
    settings = dict(net="n", seeds="0-9", num_steps=32)
    path = stream.partial_path(str(tmp_path / "r.json"))
    assert path == str(tmp_path / "r.json") + ".partial.p0.npz"
    stream.save_partial(path, settings, gen)
    said = []
    fresh = GeneratedFeatures({"fid": (1.0, _fake_extractor)})
    assert stream.load_partial(path, settings, fresh, range(10), said.append)
    assert fresh.ids.tolist() == [4, 5, 6] and said == []
    other = GeneratedFeatures({"fid": (1.0, _fake_extractor)})
    assert not stream.load_partial(path, dict(settings, num_steps=16), other, range(10),
                                   said.append)
    assert other.num_items == 0
    assert said == [f"Partial state {path} is of other settings (num_steps differ); not used, "
                    f"starting afresh (it will be overwritten)"]
    assert not stream.load_partial(path, settings, other, range(5), said.append)
    assert "outside this process's share" in said[-1] and other.num_items == 0
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04 cut short")
    assert not stream.load_partial(path, settings, other, range(10), said.append)
    assert said[-1] == (f"Partial state {path} is unreadable (BadZipFile); not used, "
                        f"starting afresh (it will be overwritten)")
    stream.remove_partial(path)
    assert not os.path.exists(path)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_guidance_interval_preset_and_outdir_reach_the_stream(setup, tmp_path, monkeypatch):
    """What `modes/evaluate.py` passes (`preset`, `outdir`, the guide, guidance and
    `guidance_interval`) reaches `generate_images`: the PNGs are its images for those
    settings, the interval changes them, and the results record the settings."""
    root, net_path, data = setup
    monkeypatch.setenv("EDM2_JAX_CACHE", str(root / "cache"))
    guided = dict(guide_path=str(root / "guide"), guidance=3.0, guidance_interval=(0.5, 5.0))
    res = eval_commands.main_eval(**_eval_kw(data, metrics="cls", num_images=4, seeds="3-6",
                                             net_path=net_path, preset="tiny-interval",
                                             outdir=str(tmp_path / "png"), **guided))
    net, variables, _ = nets.load_net(net_path)
    guide = nets.load_guide(guided["guide_path"], None, 3.0)
    want = {}
    for interval in ((0.5, 5.0), None):
        want[interval] = np.concatenate([b for _, b in _GENERATE_IMAGES(
            net, variables, [3, 4, 5, 6], batch_size=BATCH, sampler=Heun(STEPS), guide=guide,
            guidance=3.0, guidance_interval=interval, progress=False)])
    np.testing.assert_array_equal(_png_images(tmp_path / "png", range(3, 7)), want[(0.5, 5.0)])
    assert np.abs(want[(0.5, 5.0)].astype(int) - want[None]).max() > 0
    assert (res["preset"], res["guidance"], res["guidance_interval"], res["seeds"]) == (
        "tiny-interval", 3.0, [0.5, 5.0], "3-6")
    assert res["guide"] == guided["guide_path"] and res["net"] == net_path
    with pytest.raises(ValueError, match="--outdir=.* keeps the PNGs a --net generates"):
        eval_commands.main_eval(**_eval_kw(data, net_path=None, images_dir=str(tmp_path),
                                           outdir=str(tmp_path / "o")))


# --------------------------------------------------------------------------------------
# Resume


def _counting(fail_after: int | None = None, seen: list | None = None):
    """A wrapper of `seed_images.generate_images` recording the seeds it yields, raising
    RuntimeError after `fail_after` batches."""
    real = _GENERATE_IMAGES

    def wrapped(*args, **kw):
        for i, (seeds, images) in enumerate(real(*args, **kw)):
            if fail_after is not None and i == fail_after:
                raise RuntimeError("killed")
            seen.extend(int(s) for s in seeds)
            yield seeds, images
    return wrapped


def test_resume_after_an_exception_generates_only_the_rest(setup, tmp_path, monkeypatch,
                                                           capsys):
    """A stream stopped after 2 of 4 batches saves its state; the same command generates
    only seeds 8..15 and gives the uninterrupted figures (the same batches in the same
    order: bitwise), removes the state and writes one JSON line."""
    root, net_path, data = setup
    monkeypatch.setenv("EDM2_JAX_CACHE", str(root / "cache"))
    kw = _eval_kw(data, metrics="cls", net_path=net_path)
    whole = eval_commands.main_eval(out_json=str(tmp_path / "whole.json"), **kw)
    out = str(tmp_path / "r.json")
    seen: list = []
    monkeypatch.setattr(seed_images, "generate_images", _counting(2, seen))
    with pytest.raises(RuntimeError, match="killed"):
        eval_commands.main_eval(out_json=out, **kw)
    state = out + ".partial.p0.npz"
    with np.load(state) as z:
        assert sorted(z["ids"].tolist()) == list(range(8)) == sorted(seen)
    assert not os.path.exists(out)
    capsys.readouterr()
    seen.clear()
    monkeypatch.setattr(seed_images, "generate_images", _counting(None, seen))
    resumed = eval_commands.main_eval(out_json=out, **kw)
    assert seen == list(range(8, 16))  # no seed twice, none skipped
    assert f"Resuming from {state}: 8 of 16 images done" in capsys.readouterr().out
    assert resumed["images_generated"] == 8
    for key in ("fd_cls", "kid_cls", "precision_cls", "recall_cls"):
        assert resumed[key] == whole[key], key
    assert not os.path.exists(state)
    lines = open(out).read().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["fd_cls"] == whole["fd_cls"]
    # negative control: one image repeated in place of another moves fd_cls far beyond
    # the tolerance of the module docstring
    folder = data_lib.make_source(data)
    clf, _ = cls_lib.get_classifier(folder, folder, config=CLASSIFIER, log=False)
    net, variables, _ = nets.load_net(net_path)
    images = np.concatenate([b for _, b in seed_images.generate_images(
        net, variables, list(range(NUM)), batch_size=BATCH, sampler=Heun(STEPS), progress=False)])
    gen, ref = clf.features(images), clf.features(cls_lib.source_arrays(folder)[0])
    tol = fd_tolerance(gen, *fid.FeatureStats.from_features(ref).mean_cov(),
                       forward_terms(clf.params))
    fd = classifier_metrics.features_metrics(gen, ref)["fd_cls"]
    assert abs(fd - whole["fd_cls"]) <= tol
    gen[0] = gen[1]
    assert abs(classifier_metrics.features_metrics(gen, ref)["fd_cls"] - fd) > 10 * tol


def test_partial_state_of_other_settings_is_not_used(setup, tmp_path, monkeypatch, capsys):
    """Without --out_json the results and the state are beside the net
    (`NET/eval.jsonl`, `NET/eval.jsonl.partial.p0.npz`), nothing in the current directory.
    A state of other settings is not used: one line names what differs, and every seed
    is generated."""
    root, net_path, data = setup
    monkeypatch.setenv("EDM2_JAX_CACHE", str(root / "cache"))
    net = tmp_path / "net"
    shutil.copytree(net_path, net, ignore=shutil.ignore_patterns("eval.jsonl*"))  # others' results
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    kw = _eval_kw(data, metrics="cls", net_path=str(net), num_images=8)
    monkeypatch.setattr(seed_images, "generate_images", _counting(1, []))
    with pytest.raises(RuntimeError):
        eval_commands.main_eval(**kw)
    state = net / "eval.jsonl.partial.p0.npz"
    assert state.is_file() and not (net / "eval.jsonl").exists()
    capsys.readouterr()
    seen: list = []
    monkeypatch.setattr(seed_images, "generate_images", _counting(None, seen))
    res = eval_commands.main_eval(**dict(kw, sampler=Heun(3)))
    assert (f"Partial state {state} is of other settings (num_steps differ); not used"
            in capsys.readouterr().out)
    assert seen == list(range(8))
    assert not state.exists() and os.listdir(cwd) == []
    lines = (net / "eval.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["fd_cls"] == res["fd_cls"]


# --------------------------------------------------------------------------------------
# Streamed against generate-then-eval (slow: Inception and 2048-d square roots)


@pytest.mark.slow
def test_streamed_eval_equals_generate_then_eval(setup, streamed, tmp_path, monkeypatch):
    """FID-16 and fd_cls of the streamed eval equal those of `--mode=generate` + `--images`
    and those the library computes from the PNGs as whole arrays."""
    root, net_path, data = setup
    monkeypatch.setenv("EDM2_JAX_CACHE", str(root / "cache"))
    generate_mode.main_generate(net_path, f"0-{NUM - 1}", str(tmp_path / "png"), batch_size=BATCH,
                           sampler=Heun(STEPS))
    images = _png_images(tmp_path / "png", range(NUM))
    np.testing.assert_array_equal(images, _png_images(root / "png_streamed", range(NUM)))
    from_folder = eval_commands.main_eval(**_eval_kw(data, net_path=None,
                                                     images_dir=str(tmp_path / "png")))
    want = _reference(root, data, images)
    _assert_figures(streamed, want, "streamed")
    _assert_figures(from_folder, want, "--images")
    for key, (value, tol) in _reference(root, data, images, repeat_first=True).items():
        assert abs(value - want[key][0]) > 10 * tol, key  # the tolerance sees one image
    assert streamed["seeds"] == f"0-{NUM - 1}" and streamed["num_steps"] == STEPS
    assert streamed["images_generated"] == NUM and streamed["time_per_image_s"] > 0
    line = json.loads(open(root / "full.json").read().splitlines()[-1])
    assert {k: line[k] for k in ("preset", "net", "guide", "guidance", "guidance_interval")} == {
        "preset": None, "net": net_path, "guide": None, "guidance": 1.0,
        "guidance_interval": None}
    assert line[f"fid{NUM}"] == streamed[f"fid{NUM}"]


# --------------------------------------------------------------------------------------
# Subprocesses: a SIGKILL, 2 devices, 2 processes


def _env(devices: int = 1, cache: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", process.DEVICES_SET)}
    env["XLA_FLAGS"] = f"{process.DEVICE_COUNT_FLAG}={devices}" if devices > 1 else ""
    env.update(process.default_xla_flags(env))
    env["EDM2_JAX_CACHE"] = cache
    return env


def _spawn(args: dict, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.test_eval_stream", json.dumps(args)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _finish(p: subprocess.Popen, timeout: float = 600) -> str:
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:  # timed out, or the test stopped: never leave it running
            p.kill()
            p.wait()
    assert p.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
def test_resume_after_sigkill_gives_the_uninterrupted_figures(setup, streamed, tmp_path,
                                                              monkeypatch):
    """A process saving its state every batch, killed (SIGKILL) while stuck in its third
    batch, is resumed by the same command: only the seeds not in the state are generated,
    and the figures are the uninterrupted ones."""
    root, net_path, data = setup
    out = str(tmp_path / "r.json")
    args = dict(net_path=net_path, data=data, out_json=out, hang_after=2, save_every=BATCH)
    p = _spawn(args, _env(cache=str(root / "cache")))
    state = out + ".partial.p0.npz"
    try:
        deadline = time.time() + 300
        while time.time() < deadline and p.poll() is None:
            if os.path.exists(state):
                with np.load(state) as z:
                    if len(z["ids"]) == 2 * BATCH:
                        break
            time.sleep(0.5)
        assert p.poll() is None, p.communicate()[0][-3000:]
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    monkeypatch.setenv("EDM2_JAX_CACHE", str(root / "cache"))
    seen: list = []
    monkeypatch.setattr(seed_images, "generate_images", _counting(None, seen))
    resumed = eval_commands.main_eval(net_path=net_path, out_json=out, **_eval_kw(data))
    assert seen == list(range(2 * BATCH, NUM))
    want = {k: (streamed[k], 0.0) for k in (f"fid{NUM}", "fd_cls")}
    _assert_figures(resumed, want, "resumed")  # same batches, same order: bitwise
    assert not os.path.exists(state)


@pytest.mark.slow
def test_two_devices_give_the_one_device_figures(setup, streamed, tmp_path, monkeypatch):
    """With 2 CPU devices (each sampling half of every batch) the images are those of one
    device and the figures equal the 1-device ones within the tolerance."""
    root, net_path, data = setup
    res = str(tmp_path / "res.json")
    args = dict(net_path=net_path, data=data, out_json=res, outdir=str(tmp_path / "png"),
                devices=2)
    out = _finish(_spawn(args, _env(devices=2, cache=str(root / "cache"))))
    assert "devices=2" in out, out[-2000:]
    images = _png_images(tmp_path / "png", range(NUM))
    np.testing.assert_array_equal(images, _png_images(root / "png_streamed", range(NUM)))
    got = json.loads(open(res).read().splitlines()[-1])
    monkeypatch.setenv("EDM2_JAX_CACHE", str(root / "cache"))
    _assert_figures(got, _reference(root, data, images), "2 devices")


@pytest.mark.slow
def test_two_processes_give_the_one_process_figures(setup, streamed, tmp_path, monkeypatch):
    """Two processes (`jax.distributed`, CPU collectives), each generating every other
    batch into its own partial state: the gathered figures equal one process's (FID
    within the tolerance: the float64 statistics merge in another order; the classifier
    features are put back in seed order, so fd_cls and KID are exact), each process
    removed its state, one JSON line was written."""
    root, net_path, data = setup
    res = str(tmp_path / "res.json")
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [_spawn(dict(net_path=net_path, data=data, out_json=res, distributed=[port, 2, i]),
                    _env(cache=str(root / "cache"))) for i in range(2)]
    try:
        outs = [_finish(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all("process_count=2" in o for o in outs), outs[0][-2000:]
    lines = open(res).read().splitlines()
    assert len(lines) == 1
    got = json.loads(lines[0])
    assert got["images_generated"] == NUM
    monkeypatch.setenv("EDM2_JAX_CACHE", str(root / "cache"))
    want = _reference(root, data, _png_images(root / "png_streamed", range(NUM)))
    want.update({k: (streamed[k], 0.0) for k in ("fd_cls", "kid_cls")})
    _assert_figures(got, want, "2 processes")
    assert not [f for f in os.listdir(tmp_path) if ".partial." in f]


def _main(args: dict) -> None:
    if "distributed" in args:
        port, count, index = args["distributed"]
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"localhost:{port}", num_processes=count, process_id=index)
    print(f"devices={jax.local_device_count()} process_count={jax.process_count()}", flush=True)
    if args.get("save_every"):
        stream.SAVE_EVERY_IMAGES = args["save_every"]
    if args.get("hang_after") is not None:
        real = seed_images.generate_images

        def hanging(*a, **kw):
            for i, batch in enumerate(real(*a, **kw)):
                if i == args["hang_after"]:
                    time.sleep(3600)  # killed here
                yield batch
        seed_images.generate_images = hanging
    eval_commands.main_eval(net_path=args["net_path"], out_json=args["out_json"],
                            outdir=args.get("outdir"), **_eval_kw(args["data"]))


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
