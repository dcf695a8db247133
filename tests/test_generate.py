"""`--mode=generate`: seed parsing, checkpoint loading, and per-seed determinism (images do
not depend on batch size or on the number of devices)."""
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from edm2_jax import nets
from edm2_jax.modes import generate as generate_mode
from edm2_jax.run import network_dir as checkpoint
from edm2_jax.sampling import seed_images
from edm2_jax.model.networks import init_variables, precond_from_config
from edm2_jax.sampling.solvers import Heun

NET = dict(img_resolution=8, img_channels=1, label_dim=3, model_channels=8, channel_mult=(1,),
           num_blocks=1, attn_resolutions=())


def test_parse_seeds():
    assert seed_images.parse_seeds("0-3") == [0, 1, 2, 3]
    assert seed_images.parse_seeds("1,5,7-9") == [1, 5, 7, 8, 9]
    for bad in ("a-b", "5-2", ""):
        with pytest.raises(ValueError):
            seed_images.parse_seeds(bad)


@pytest.fixture(scope="module")
def netdir(tmp_path_factory):
    net = precond_from_config(NET)
    v = init_variables(net, jax.random.PRNGKey(0))
    # Non-zero gains so that the network, not only c_skip, shapes the images.
    v["params"] = jax.tree.map(lambda a: np.full_like(a, 0.7) if a.ndim == 0 else a, v["params"])
    return checkpoint.save_network(str(tmp_path_factory.mktemp("net") / "n"), v, NET)


def _images(netdir, batch, seeds):
    net, v, _ = nets.load_net(netdir)
    out = list(seed_images.generate_images(net, v, seeds, batch_size=batch, class_idx=1,
                                        sampler=Heun(3), progress=False))
    return np.concatenate([imgs for _, imgs in out])


def test_load_net_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a network checkpoint"):
        nets.load_net(str(tmp_path))


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_same_seeds_same_images_batch_1_vs_8_and_1_vs_8_devices(netdir, tmp_path):
    seeds = list(range(10, 18))
    one = _images(netdir, 1, seeds)
    eight = _images(netdir, 8, seeds)
    np.testing.assert_array_equal(one, eight)
    assert one.std() > 0
    # The same on 8 simulated CPU devices (a fresh process: XLA_FLAGS must precede jax).
    out = tmp_path / "dev8.npy"
    code = textwrap.dedent(f"""
        import sys, numpy as np, jax
        sys.path.insert(0, {os.getcwd()!r})
        assert jax.local_device_count() == 8, jax.devices()
        from tests.test_generate import _images
        np.save({str(out)!r}, _images({netdir!r}, 8, {seeds!r}))
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_array_equal(np.load(out), one)


def test_generate_writes_pngs_in_subdirs(netdir, tmp_path):
    import PIL.Image
    generate_mode.main_generate(netdir, "998-1001", str(tmp_path / "out"), subdirs=True,
                           sampler=Heun(2), grid=str(tmp_path / "grid.png"), class_idx=0)
    assert sorted(os.listdir(tmp_path / "out")) == ["000000", "001000"]
    assert sorted(os.listdir(tmp_path / "out" / "001000")) == ["001000.png", "001001.png"]
    img = np.asarray(PIL.Image.open(tmp_path / "out" / "000000" / "000998.png"))
    assert img.shape == (8, 8) and img.dtype == np.uint8
    assert PIL.Image.open(tmp_path / "grid.png").size == (16, 16)
