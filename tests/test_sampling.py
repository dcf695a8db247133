"""EDM sampler and guidance (docs/recipe.md §6; Karras et al. 2022, Algorithm 2;
arXiv:2406.02507, Eq. 1)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest

from edm2_jax.model.networks import Precond, init_variables
from edm2_jax.sampling.guidance import make_denoiser
from edm2_jax.sampling.sampler import decode_uint8, sample_images, save_image_grid
from edm2_jax.sampling.schedule import edm_sigma_steps
from edm2_jax.sampling.seeds import random_labels, seed_noise
from edm2_jax.sampling.solvers import Heun, edm_sampler
from tests.testdata import golden
from tests.tolerances import forward_terms, reorder_tol


def gaussian_denoiser(s):
    """Exact denoiser for data ~ N(0, s^2 I): E[y | y + sigma n] = x s^2 / (s^2 + sigma^2)."""
    return lambda x, sigma, labels=None: x * s**2 / (s**2 + sigma**2)


def tiny_net(label_dim, seed):
    """A 8x8 Precond with N(0, 1) weights (as at init) and every `*gain` non-zero, so that
    F and the labels matter. Filled from numpy: flax's own init is slow on a busy CPU."""
    net = Precond(8, 3, label_dim, 16, (1,), num_blocks=1, attn_resolutions=(),
                  channels_per_head=16)
    shapes = jax.eval_shape(lambda k: init_variables(net, k), jax.random.PRNGKey(0))
    rng = np.random.default_rng(seed)
    fill = lambda p, a: jnp.asarray(0.8 if str(p[-1].key).endswith("gain") else
                                    rng.standard_normal(a.shape), jnp.float32)
    return net, jax.tree_util.tree_map_with_path(fill, dict(shapes))


@pytest.fixture(scope="module")
def nets():
    return tiny_net(5, 0), tiny_net(5, 1), tiny_net(0, 2)


# --- Schedule --------------------------------------------------------------------------

def test_sigma_steps_closed_form():
    t = edm_sigma_steps(num_steps=32, sigma_min=0.002, sigma_max=80, rho=7)
    assert t.shape == (33,)
    np.testing.assert_allclose([t[0], t[31], t[32]], [80.0, 0.002, 0.0], rtol=1e-12)
    assert np.all(np.diff(t) < 0)
    # Middle step by hand: (80^(1/7) + 0.5 (0.002^(1/7) - 80^(1/7)))^7 for N = 3.
    mid = (80 ** (1 / 7) + 0.5 * (0.002 ** (1 / 7) - 80 ** (1 / 7))) ** 7
    np.testing.assert_allclose(edm_sigma_steps(3)[1], mid, rtol=1e-12)


def test_sigma_steps_reject_bad_input():
    with pytest.raises(ValueError, match="num_steps"):
        edm_sigma_steps(1)
    with pytest.raises(ValueError, match="sigma_min < sigma_max"):
        edm_sigma_steps(8, sigma_min=1.0, sigma_max=0.5)


# --- Sampler on Gaussian data (exact probability-flow ODE) -----------------------------

def _pf_ode_error(num_steps, s=0.5, sigma_max=80.0):
    noise = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 4, 3))
    x0 = jax.jit(lambda n: edm_sampler(gaussian_denoiser(s), n, num_steps=num_steps))(noise)
    # dx/dsigma = (x - D) / sigma has x(sigma) ∝ sqrt(s^2 + sigma^2): x_0 = x_T s / sqrt(s^2 + T^2).
    exact = noise * sigma_max * s / math.sqrt(s**2 + sigma_max**2)
    assert x0.dtype == jnp.float32
    return float(jnp.abs(x0 - exact).max() / jnp.abs(exact).max())


def test_heun_solves_the_probability_flow_ode_of_gaussian_data():
    assert _pf_ode_error(128) < 2e-3


def test_heun_converges_at_second_order():
    ratio = _pf_ode_error(32) / _pf_ode_error(64)
    assert 3.5 < ratio < 4.7, ratio  # Euler would halve the error, Heun quarters it


def test_denoiser_is_evaluated_2N_minus_1_times_under_jit():
    calls = []

    def denoise(x, sigma, labels):
        jax.debug.callback(lambda t: calls.append(float(t)), sigma, ordered=True)
        return gaussian_denoiser(0.5)(x, sigma)

    N = 5
    jax.jit(lambda n: edm_sampler(denoise, n, num_steps=N))(jnp.ones((1, 2, 2, 1)))
    jax.effects_barrier()
    assert len(calls) == 2 * N - 1
    t = edm_sigma_steps(N)
    # Euler at t_i, Heun correction at t_{i+1}; the last step (to t_N = 0) is Euler only.
    expected = [v for i in range(N - 1) for v in (t[i], t[i + 1])] + [t[N - 1]]
    np.testing.assert_allclose(calls, expected, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_churn_keeps_the_data_distribution():
    # Stochastic sampling with the exact denoiser still ends at N(0, s^2): adding
    # sqrt(t_hat^2 - t^2) of noise moves x exactly from noise level t to t_hat.
    s = 0.5
    noise = jax.random.normal(jax.random.PRNGKey(2), (64, 16, 16, 3))
    x0 = jax.jit(lambda n: edm_sampler(gaussian_denoiser(s), n, num_steps=128, S_churn=160,
                                       rng=jax.random.PRNGKey(5)))(noise)
    assert abs(float(x0.std()) / s - 1) < 0.02
    # ...and, with the maximal gamma at every step, forgets its starting noise.
    assert abs(float(jnp.corrcoef(x0.ravel(), noise.ravel())[0, 1])) < 0.05


def test_churn_only_inside_S_min_S_max():
    noise = jax.random.normal(jax.random.PRNGKey(3), (2, 4, 4, 3))
    run = lambda **kw: jax.jit(lambda n: edm_sampler(
        gaussian_denoiser(0.5), n, num_steps=8, rng=jax.random.PRNGKey(0), **kw))(noise)
    plain = run()
    np.testing.assert_array_equal(run(S_churn=10, S_min=100.0), plain)  # window above t_0
    assert float(jnp.abs(run(S_churn=10, S_max=1.0) - plain).max()) > 1e-3


def test_churn_without_noise_source_is_an_error():
    with pytest.raises(ValueError, match="churn_noise"):
        edm_sampler(gaussian_denoiser(0.5), jnp.ones((1, 2, 2, 1)), S_churn=1.0)


# --- Golden parity with the authors' release --------------------------------------------

def _load_release_net(kind):
    """Release state_dict (NCHW / OIHW, [out, in]) -> Precond variables (HWIO, [in, out])."""
    d = np.load(golden(f"edm2_ref/precond_tiny_{kind}.npz"))
    variables = {"params": {}, "buffers": {}}
    for k in d.files:
        if not k.startswith("w/"):
            continue
        path, a = k[2:].split("."), d[k]
        if path[0] == "unet" and path[1] in ("enc", "dec"):
            path = ["unet", f"{path[1]}_{path[2]}"] + path[3:]
        tree = variables["buffers" if path[-1] in ("freqs", "phases") else "params"]
        if path[-1] not in ("freqs", "phases"):
            a = a.transpose(2, 3, 1, 0) if a.ndim == 4 else a.T if a.ndim == 2 else a
        for p in path[:-1]:
            tree = tree.setdefault(p, {})
        tree[path[-1]] = jnp.asarray(a)
    net = Precond(16, 3, 10 if kind == "cond" else 0, 32, (1, 2), num_blocks=1,
                  attn_resolutions=(8,))
    return net, variables


@pytest.mark.parametrize("key, guidance", [("out/x_plain", 1.0), ("out/x_guided", 1.4)])
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_matches_release_sampler(key, guidance):
    d = np.load(golden("edm2_ref/sampler_tiny.npz"))
    assert int(d["cfg/num_steps"]) == 8 and (key == "out/x_plain" or d["cfg/guidance"] == guidance)
    net, variables = _load_release_net("cond")
    guide, guide_variables = _load_release_net("uncond")
    denoise = make_denoiser(net, variables, guide, guide_variables, guidance)
    x0 = jax.jit(lambda n, l: edm_sampler(denoise, n, l, num_steps=8))(
        d["in/noise"].transpose(0, 2, 3, 1), d["in/labels"])
    ref = d[key].transpose(0, 2, 3, 1)
    assert np.abs(np.asarray(x0) - ref).max() / np.abs(ref).max() <= 1e-4


# --- Guidance ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_guidance_interpolates_between_guide_and_main(nets):
    """D_g + w (D_main - D_g) for w = 1, 0, 1.4. The nets run inside another jit than
    the references, so XLA may order their reductions differently: the bound is
    eps32 sqrt(n) of the output's scale, n = `tolerances.forward_terms` = 13824
    (1.4e-5; measured on an AMD EPYC <= 1.1e-6), 1000x below the difference between
    the two nets that a wrong weight or swapped nets would show."""
    (net, v), (g_net, g_v), (u_net, u_v) = nets
    x = jax.random.normal(jax.random.PRNGKey(4), (2, 8, 8, 3))
    sigma, labels = jnp.float32(1.3), jax.nn.one_hot(jnp.array([1, 3]), 5)
    D_main = jax.jit(net.apply)(v, x, jnp.full((2,), sigma), labels)
    tol = reorder_tol(max(forward_terms(n[1]["params"]) for n in nets))
    for guide, gv, g_labels in ((g_net, g_v, labels), (u_net, u_v, None)):  # autoguidance, CFG
        D_g = jax.jit(guide.apply)(gv, x, jnp.full((2,), sigma), g_labels)
        atol = tol * float(jnp.maximum(jnp.abs(D_main).max(), jnp.abs(D_g).max()))
        assert float(jnp.abs(D_main - D_g).max()) > 1000 * atol  # the two nets really differ
        den = jax.jit(lambda w: make_denoiser(net, v, guide, gv, guidance=w)(x, sigma, labels))
        np.testing.assert_allclose(den(jnp.float32(1.0)), D_main, rtol=0, atol=atol)
        np.testing.assert_allclose(den(jnp.float32(0.0)), D_g, rtol=0, atol=atol)
        np.testing.assert_allclose(den(jnp.float32(1.4)), D_g + 1.4 * (D_main - D_g), rtol=0,
                                   atol=2.4 * atol)  # |1.4 D_main - 0.4 D_g|: 2.4x the scale
    # A Python weight of 1 never evaluates the guide (its empty variables would raise).
    main_only = jax.jit(make_denoiser(net, v, g_net, {}, guidance=1.0))
    np.testing.assert_allclose(main_only(x, sigma, labels), D_main, rtol=0,
                               atol=tol * float(jnp.abs(D_main).max()))


def test_guidance_without_guide_is_an_error(nets):
    (net, v), _, _ = nets
    with pytest.raises(ValueError, match="guide"):
        make_denoiser(net, v, guidance=2.0)


# --- Per-seed randomness and images ---------------------------------------------------

def test_seed_noise_and_labels_do_not_depend_on_the_batch():
    seeds = [3, 7, 11, 2**32 + 42]
    batch = seed_noise(seeds, (4, 4, 3))
    assert batch.shape == (4, 4, 4, 3) and batch.dtype == jnp.float32
    for i, seed in enumerate(seeds):
        np.testing.assert_array_equal(seed_noise([seed], (4, 4, 3))[0], batch[i])
    labels = random_labels(seeds, 10)
    np.testing.assert_array_equal(labels.sum(-1), 1.0)
    np.testing.assert_array_equal(random_labels(seeds[2:], 10), labels[2:])
    assert float(jnp.abs(batch[0] - batch[1]).max()) > 0.1


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_sample_images_same_seed_same_image_at_batch_1_and_4(nets):
    (net, v), _, _ = nets
    seeds = [3, 7, 11, 42]
    kw = dict(sampler=Heun(num_steps=4, S_churn=5.0))  # churn noise must follow the seed too
    batch = np.asarray(sample_images(net, v, seeds, **kw))
    assert batch.shape == (4, 8, 8, 3) and batch.dtype == np.uint8
    single = np.concatenate([np.asarray(sample_images(net, v, [s], **kw)) for s in seeds])
    np.testing.assert_array_equal(single, batch)
    assert np.abs(batch[0].astype(int) - batch[1]).max() > 0  # different seeds differ


def test_sample_images_label_handling(nets):
    (net, v), _, (u_net, u_v) = nets
    kw = dict(sampler=Heun(num_steps=4, S_churn=5.0))  # as above: reuses that compilation
    a = sample_images(net, v, [1, 2, 5, 6], labels=3, **kw)
    b = sample_images(net, v, [1, 2, 5, 6], labels=jax.nn.one_hot(jnp.full(4, 3), 5), **kw)
    np.testing.assert_array_equal(a, b)
    c = sample_images(net, v, [1, 2, 5, 6], labels=0, **kw)
    assert np.abs(np.asarray(a, int) - np.asarray(c)).max() > 0  # the class matters
    with pytest.raises(ValueError, match="labels=None"):
        sample_images(u_net, u_v, [1], labels=0, sampler=Heun(2))
    with pytest.raises(ValueError, match="labels must be"):
        sample_images(net, v, [1, 2], labels=jnp.zeros((2, 4)), sampler=Heun(2))


def test_decode_uint8_rounds_to_nearest_and_clips():
    x = jnp.array([-2.0, -1.0, 0.0, 1.0 / 127.5, 0.996, 1.0, 3.0])
    # x*127.5 + 128 = -127, 0.5, 128, 129, 254.99, 255.5, 510.5 -> truncated after clipping.
    np.testing.assert_array_equal(decode_uint8(x), [0, 0, 128, 129, 254, 255, 255])


@pytest.mark.parametrize("channels", [1, 3])
def test_save_image_grid_places_images_row_major(tmp_path, channels):
    images = np.arange(5, dtype=np.uint8)[:, None, None, None] * 40 + np.zeros(
        (5, 2, 3, channels), np.uint8)
    path = tmp_path / "grid.png"
    save_image_grid(images, path, rows=2, cols=3)
    grid = np.asarray(PIL.Image.open(path))
    assert grid.shape == ((4, 9) if channels == 1 else (4, 9, 3))
    grid = grid.reshape(4, 9, channels)
    for k in range(6):
        r, c = divmod(k, 3)
        assert np.all(grid[2 * r:2 * r + 2, 3 * c:3 * c + 3] == (40 * k if k < 5 else 0))
    with pytest.raises(ValueError, match="do not fit"):
        save_image_grid(images, path, rows=1, cols=3)
