"""`--mode=eval` / `--mode=generate` options: guidance and seeds in eval, the
release's seeded random subset of an image folder, the sampler's schedule settings on
the command line.
"""
from __future__ import annotations

import json

import jax
import numpy as np
import PIL.Image
import pytest

from edm2_jax.run import network_dir as checkpoint
from edm2_jax.evaluation import commands as eval_commands
from edm2_jax.evaluation import images as eval_images
from edm2_jax import main as main_lib
from edm2_jax import nets
from edm2_jax.modes import generate as generate_mode
from edm2_jax.model.networks import init_variables, precond_from_config
from edm2_jax.sampling import solvers
from edm2_jax.sampling.sampler import sample_images
from tests.testdata import golden

NET = dict(img_resolution=8, img_channels=1, label_dim=3, model_channels=8, channel_mult=(1,),
           num_blocks=1, attn_resolutions=())


@pytest.fixture(scope="module")
def net_paths(tmp_path_factory):
    """A main and a guide network (different weights, non-zero gains)."""
    paths = []
    for k in (0, 1):
        net = precond_from_config(NET)
        v = init_variables(net, jax.random.PRNGKey(k))
        v["params"] = jax.tree.map(lambda a: np.full_like(a, 0.7) if a.ndim == 0 else a,
                                   v["params"])
        paths.append(checkpoint.save_network(str(tmp_path_factory.mktemp("n") / "n"), v, NET))
    return paths


@pytest.mark.slow  # ~40 s on 2 cores: two tiny networks written, three sampler compiles
def test_eval_generates_with_guidance_seeds_and_schedule(net_paths):
    """`net_images` (what `--mode=eval --net` measures) gives exactly `sample_images`
    with the guide, guidance weight, seeds and schedule it was asked for."""
    net_path, guide_path = net_paths
    kw = dict(sampler=solvers.Heun(3, sigma_min=0.01, sigma_max=20.0, rho=3.0))
    got = np.concatenate(list(eval_images.net_images(
        net_path, [7, 3], batch_size=2, guide_path=guide_path, guidance=2.0, class_idx=1,
        progress=False, **kw)))
    net, v, _ = nets.load_net(net_path)
    gnet, gv, _ = nets.load_net(guide_path)
    want = np.asarray(sample_images(net, v, [7, 3], 1, guide_net=gnet, guide_variables=gv,
                                    guidance=2.0, **kw))
    np.testing.assert_array_equal(got, want)
    plain = np.asarray(sample_images(net, v, [7, 3], 1, **kw))
    assert np.abs(got.astype(int) - plain).max() > 8  # the guidance is not ignored
    with pytest.raises(ValueError, match="--guidance=2 needs --guide"):
        list(eval_images.net_images(net_path, [0], guidance=2.0))


def dispatch(argv, monkeypatch):
    """Run main.py's dispatch on `argv`, returning the kwargs it passed to the mode."""
    got = {}
    monkeypatch.setattr(eval_commands, "main_eval", lambda **kw: got.update(kw))
    monkeypatch.setattr(generate_mode, "main_generate", lambda *a, **kw: got.update(kw, args=a))
    main_lib.FLAGS.unparse_flags()
    try:
        main_lib.FLAGS(["edm2_jax.main"] + argv)
        main_lib._dispatch()
    finally:
        main_lib.FLAGS.unparse_flags()
    return got


def test_command_line_passes_guidance_seeds_and_schedule(monkeypatch):
    ev = dispatch(["--mode=eval", "--net=N", "--guide=G", "--guidance=1.4", "--seeds=5-9",
                   "--rho=5", "--sigma_max=40", "--S_churn=3", "--metrics=cls"], monkeypatch)
    assert (ev["guide_path"], ev["guidance"], ev["seeds"], ev["num_images"]) == ("G", 1.4, "5-9", None)
    assert ev["sampler"] == solvers.Heun(32, sigma_min=0.002, sigma_max=40.0, rho=5.0,
                                         S_churn=3.0)
    ev = dispatch(["--mode=eval", "--images=D", "--subset_seed=123"], monkeypatch)
    assert (ev["subset_seed"], ev["seeds"], ev["num_images"]) == (123, None, 50000)
    gen = dispatch(["--mode=generate", "--net=N", "--outdir=O", "--sigma_min=0.05", "--rho=9",
                    "--S_noise=1.003", "--rng=release"], monkeypatch)
    assert gen["sampler"] == solvers.Heun(32, sigma_min=0.05, rho=9.0, S_noise=1.003)
    assert gen["rng"] == "release" and ev["rng"] == "jax"


def test_eval_seeds_and_num_images_must_agree(tmp_path):
    kw = dict(images_dir=None, net_path="N", metrics="fid", ref=None, data_config=None)
    with pytest.raises(ValueError, match="gives 5 seeds but --num_images=4"):
        eval_commands.main_eval(num_images=4, seeds="0-4", **kw)
    with pytest.raises(ValueError, match="--subset_seed"):
        eval_commands.main_eval(**dict(kw, net_path=None, images_dir=str(tmp_path)),
                                num_images=4, seeds="0-3")


def test_image_folder_subset_is_the_releases(tmp_path):
    """The files `--images` evaluates are those the release's `calculate_metrics.py`
    (`ImageFolderDataset(max_size=N, random_seed=seed)`) selects: golden lists recorded
    from it on the same 26-file folder (`tests/data/release_interop/folder_subset.json`)."""
    gold = json.loads(golden("release_interop/folder_subset.json").read_text())
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    names = [f"{d}/{i:03d}.png" for d in ("a", "b") for i in range(13)]
    assert gold["folder"] == names
    for i, n in enumerate(names):
        PIL.Image.fromarray(np.full((4, 4, 3), i, np.uint8)).save(tmp_path / n)
    assert [(s["num"], s["seed"]) for s in gold["subsets"]] == [(26, 0), (5, 0), (5, 7), (20, 2**31 + 7)]
    for s in gold["subsets"]:
        want = [str(tmp_path / f) for f in s["files"]]
        assert eval_images.folder_subset(str(tmp_path), s["num"], s["seed"]) == want
    assert (eval_images.folder_subset(str(tmp_path), 5, 0)
            != eval_images.folder_subset(str(tmp_path), 5, 1))
    first = np.concatenate(list(eval_images.folder_images(str(tmp_path), 5, 2, seed=7)))
    want = [int(n.split("/")[1][:3]) + 13 * (n.split("/")[0] == "b")
            for n in (p[len(str(tmp_path)) + 1:] for p in eval_images.folder_subset(str(tmp_path), 5, 7))]
    np.testing.assert_array_equal(first[:, 0, 0, 0], want)


@pytest.mark.slow  # ~12 s: two sampler compiles
def test_release_rng_feeds_the_release_draws_to_the_sampler(net_paths):
    """`rng='release'`: the image is the sampler run on the release's draws for the seed
    (noise, class, churn noise at the steps where the release adds it)."""
    from edm2_jax.sampling import sampler as sampling
    from edm2_jax.sampling.guidance import make_denoiser
    from edm2_jax.sampling.schedule import edm_sigma_steps
    from edm2_jax.sampling.solvers import edm_sampler
    net, v, _ = nets.load_net(net_paths[0])
    kw = dict(num_steps=3, S_churn=2.0, S_min=3.0, S_max=100.0)
    heun = solvers.Heun(**kw)
    got = np.asarray(sampling.sample_images(net, v, [4, 2**32 + 9], rng="release", sampler=heun))
    noise, labels, table = sampling.release_seed_draws([4, 2**32 + 9], (8, 8, 1), 3, heun)
    t = edm_sigma_steps(3)  # 80, 2.5, 0.002: churn at step 0 only
    assert np.all(table[1:] == 0) and np.all(table[0] != 0)
    x = edm_sampler(make_denoiser(net, v), noise, labels,
                             churn_noise=lambda i: jax.numpy.asarray(table)[i], **kw)
    np.testing.assert_array_equal(got, np.asarray(sampling.decode_uint8(x)))
    assert t[1] < kw["S_min"] < t[0]
    with pytest.raises(ValueError, match="rng='torch'"):
        sampling.sample_images(net, v, [0], rng="torch")
