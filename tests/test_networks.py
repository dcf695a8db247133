"""The paper's claims about the magnitude-preserving network, as tests.

Each MP op keeps unit RMS for unit-variance input (Appendix B), forced weight
normalisation fixes each output unit's norm at sqrt(fan_in) (Eq. 66), a fresh network
(out_gain = 0) is the identity skip `c_skip x` (EDM Table 1), activations stay near unit
RMS through a fresh U-Net, and the twelve released presets have the parameter counts of
docs/recipe.md §3.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edm2_jax import backends
from edm2_jax.model import mp
from edm2_jax.model import presets
from edm2_jax.model.networks import Block, Precond, UNet, count_params, init_variables, precond_from_config

TINY = dict(img_resolution=16, img_channels=3, label_dim=10, model_channels=32,
            channel_mult=(1, 2), num_blocks=1, attn_resolutions=(8,))


def rms(x):
    return float(jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)))))


@pytest.fixture(scope="module")
def tiny():
    net = Precond(**TINY)
    return net, init_variables(net, jax.random.PRNGKey(0))


def set_gains(params, value):
    """Every learned scalar gain (emb_gain, out_gain) to `value`: no branch is silent."""
    return jax.tree_util.tree_map(lambda a: jnp.full_like(a, value) if a.ndim == 0 else a, params)


# --- MP primitives -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_normalize_gives_unit_rms_over_axes():
    x = 3.7 * jax.random.normal(jax.random.PRNGKey(1), (4, 5, 6, 7))
    y = mp.normalize(x, axis=(1, 2))
    per = jnp.sqrt(jnp.mean(y**2, axis=(1, 2)))
    np.testing.assert_allclose(per, 1.0, atol=1e-3)
    # By hand for one vector: x / (eps + ||x|| / sqrt(n)).
    v = jnp.array([[3.0, 4.0]])
    np.testing.assert_allclose(mp.normalize(v, axis=1), v / (1e-4 + 5.0 / math.sqrt(2)), rtol=1e-6)


def test_pixel_norm_is_over_channels_only():
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 3, 16)) * jnp.arange(1, 17)
    y = mp.pixel_norm(x)
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(y**2, axis=-1)), 1.0, atol=1e-3)


def test_mp_silu_keeps_unit_rms():
    x = jax.random.normal(jax.random.PRNGKey(3), (1_000_000,))
    assert abs(rms(mp.mp_silu(x)) - 1.0) < 0.01


@pytest.mark.parametrize("t", [0.0, 0.3, 0.5, 0.9])
def test_mp_sum_unit_variance_eq88(t):
    ka, kb = jax.random.split(jax.random.PRNGKey(4))
    a, b = jax.random.normal(ka, (400_000,)), jax.random.normal(kb, (400_000,))
    y = mp.mp_sum(a, b, t)
    assert abs(float(jnp.var(y)) - 1.0) < 0.01
    # Eq. 88 by hand on scalars.
    np.testing.assert_allclose(mp.mp_sum(jnp.float32(2.0), jnp.float32(-1.0), t),
                               ((1 - t) * 2 - t) / math.sqrt((1 - t) ** 2 + t**2), rtol=1e-6)


@pytest.mark.parametrize("na,nb,t", [(32, 32, 0.5), (64, 16, 0.5), (10, 70, 0.3)])
def test_mp_cat_unit_rms_eq103(na, nb, t):
    ka, kb = jax.random.split(jax.random.PRNGKey(5))
    a = jax.random.normal(ka, (2000, na))
    b = jax.random.normal(kb, (2000, nb))
    y = mp.mp_cat(a, b, t)
    assert y.shape == (2000, na + nb)
    assert abs(rms(y) - 1.0) < 0.01
    # Per-channel scales of Eq. 103 evaluated by hand.
    c = math.sqrt((na + nb) / ((1 - t) ** 2 + t**2))
    ones = mp.mp_cat(jnp.ones((1, na)), jnp.ones((1, nb)), t)
    np.testing.assert_allclose(ones[0, 0], c * (1 - t) / math.sqrt(na), rtol=1e-6)
    np.testing.assert_allclose(ones[0, -1], c * t / math.sqrt(nb), rtol=1e-6)


def test_mp_fourier_unit_rms_and_buffers_not_trained():
    m = mp.MPFourier(256)
    v = m.init({"params": jax.random.PRNGKey(0)}, jnp.zeros((1,)))
    assert "params" not in v and set(v["buffers"]) == {"freqs", "phases"}
    x = jax.random.normal(jax.random.PRNGKey(7), (512,))
    y = m.apply(v, x)
    assert y.shape == (512, 256) and y.dtype == jnp.float32
    assert abs(rms(y) - 1.0) < 0.03
    np.testing.assert_allclose(y, math.sqrt(2) * jnp.cos(jnp.outer(x, v["buffers"]["freqs"])
                                                         + v["buffers"]["phases"]), atol=1e-5)
    v2 = m.init({"params": jax.random.PRNGKey(1)}, jnp.zeros((1,)))
    assert not np.allclose(v["buffers"]["freqs"], v2["buffers"]["freqs"])


@pytest.mark.parametrize("kernel", [(), (1, 1), (3, 3)])
def test_mp_conv_preserves_unit_rms(kernel):
    conv = mp.MPConv(64, 48, kernel)
    shape = (16, 64) if not kernel else (4, 16, 16, 64)
    x = jax.random.normal(jax.random.PRNGKey(8), shape)
    v = conv.init(jax.random.PRNGKey(9), x)
    assert v["params"]["weight"].shape == (*kernel, 64, 48)
    y = conv.apply(v, x)
    assert abs(rms(y) - 1.0) < 0.1
    np.testing.assert_allclose(conv.apply(v, x, gain=0.5), 0.5 * y, rtol=1e-5, atol=1e-6)


def test_resample_down_is_average_up_is_nearest():
    x = jnp.arange(16.0).reshape(1, 4, 4, 1)
    d = mp.resample(x, "down")
    np.testing.assert_allclose(d[0, :, :, 0], [[2.5, 4.5], [10.5, 12.5]])
    u = mp.resample(d, "up")
    np.testing.assert_allclose(u[0, :2, :2, 0], 2.5)
    with pytest.raises(ValueError, match="unknown mode"):
        mp.resample(x, "sideways")


# --- Forced weight normalisation ------------------------------------------------------

@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_forced_weight_norm_fixes_unit_norm_and_is_idempotent(tiny):
    _, v = tiny
    params = jax.tree_util.tree_map(lambda a: a * 3.0 + 0.1, v["params"])
    wn = mp.force_normalize(params)
    n_weights = 0
    for path, w in jax.tree_util.tree_flatten_with_path(wn)[0]:
        if w.ndim >= 2:
            n_weights += 1
            fan_in = math.prod(w.shape[:-1])
            norms = jnp.sqrt(jnp.sum(jnp.square(w.reshape(-1, w.shape[-1])), axis=0))
            np.testing.assert_allclose(norms, math.sqrt(fan_in), rtol=1e-3)
        else:  # gains are not weights and stay untouched
            orig = jax.tree_util.tree_flatten_with_path(params)[0]
            assert any(p == path and np.array_equal(o, w) for p, o in orig)
    assert n_weights > 20
    twice = mp.force_normalize(wn)
    for a, b in zip(jax.tree_util.tree_leaves(wn), jax.tree_util.tree_leaves(twice)):
        np.testing.assert_allclose(a, b, rtol=1e-3)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_forward_unchanged_by_forced_weight_norm(tiny):
    """The forward normalises again, so forcing the stored weights changes nothing."""
    net, v = tiny
    params = set_gains(v["params"], 0.7)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 16, 16, 3))
    sigma = jnp.array([0.5, 3.0])
    labels = jax.nn.one_hot(jnp.array([1, 4]), 10)
    a = net.apply({"params": params, "buffers": v["buffers"]}, x, sigma, labels)
    b = net.apply({"params": mp.force_normalize(params), "buffers": v["buffers"]}, x, sigma, labels)
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)  # eps=1e-4 of the double normalisation


# --- Precond / U-Net ------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_fresh_precond_is_exactly_c_skip_x(tiny):
    net, v = tiny
    x = jax.random.normal(jax.random.PRNGKey(11), (4, 16, 16, 3))
    sigma = jnp.array([0.002, 0.3, 2.0, 80.0])
    labels = jax.nn.one_hot(jnp.arange(4), 10)
    D = net.apply(v, x, sigma, labels)
    c_skip = 0.25 / (np.asarray(sigma) ** 2 + 0.25)
    np.testing.assert_array_equal(np.asarray(D), np.asarray(x) * c_skip[:, None, None, None].astype(np.float32))


@pytest.mark.slow
@pytest.mark.ci  # ~30 s on 2 cores: CI runs it after the quick suite
def test_activations_stay_near_unit_rms_in_fresh_unet():
    net = UNet(img_resolution=32, img_channels=3, label_dim=10, model_channels=32,
               channel_mult=(1, 2, 2), num_blocks=2, attn_resolutions=(16, 8))
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 32, 32, 3))
    c_noise = jnp.log(jnp.array([0.1, 0.5, 1.0, 5.0])) / 4
    labels = jax.nn.one_hot(jnp.arange(4), 10)
    v = net.init(jax.random.PRNGKey(1), x, c_noise, labels)
    _, state = net.apply(v, x, c_noise, labels, capture_intermediates=lambda m, meth: isinstance(m, Block) and meth == "__call__")
    outs = jax.tree_util.tree_leaves(state["intermediates"])
    assert len(outs) == 8 + 13  # encoder blocks (2 + 3 + 3) + decoder blocks (5 + 4 + 4)
    for y in outs:
        assert 0.5 < rms(y) < 2.0


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_jit_and_grad(tiny):
    net, v = tiny
    x = jax.random.normal(jax.random.PRNGKey(12), (2, 16, 16, 3))
    sigma = jnp.array([0.5, 2.0])
    labels = jax.nn.one_hot(jnp.array([0, 9]), 10)

    @jax.jit
    def loss(params):
        D, logvar = net.apply({"params": params, "buffers": v["buffers"]}, x, sigma, labels,
                              return_logvar=True)
        return jnp.mean((D - x) ** 2) + jnp.mean(logvar)

    params = set_gains(v["params"], 0.5)
    g = jax.grad(loss)(params)
    leaves = jax.tree_util.tree_leaves(g)
    assert all(bool(jnp.all(jnp.isfinite(l))) for l in leaves)
    assert float(jnp.abs(g["unet"]["out_gain"])) > 0
    assert float(jnp.abs(g["unet"]["enc_8x8_block0"]["attn_qkv"]["weight"]).max()) > 0
    assert float(jnp.abs(g["logvar_linear"]["weight"]).max()) > 0


def test_mp_silu_gradient_is_the_closed_form():
    # d/dx [x sigmoid(x)] / 0.596 = (s + x s (1 - s)) / 0.596, evaluated in float64.
    x = np.linspace(-12, 12, 97).astype(np.float32)
    s = 1 / (1 + np.exp(-x.astype(np.float64)))
    want = (s + x * s * (1 - s)) / 0.596
    got = np.asarray(jax.jit(jax.grad(lambda x: mp.mp_silu(x).sum()))(jnp.asarray(x)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(mp.mp_silu(jnp.asarray(x))), x * s / 0.596, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("backend", ["xla", "cpu"])
def test_clip_act_gradient_is_torch_clamps(backend):
    # torch.clamp passes the gradient where min <= x <= max (the limits included), on
    # every backend's kernels.
    clip_act = backends.select(backend).kernels.clip_act
    x = jnp.array([-300.0, -256.0, -255.9, 0.0, 255.9, 256.0, 1e4])
    y, vjp = jax.vjp(lambda x: clip_act(x, 256.0), x)
    np.testing.assert_array_equal(np.asarray(y), np.float32([-256, -256, -255.9, 0, 255.9, 256, 256]))
    g = vjp(jnp.full_like(x, 3.0))[0]
    np.testing.assert_array_equal(np.asarray(g), [0, 3, 3, 3, 3, 3, 0])


def test_clip_act_keeps_its_mask_packed_eight_to_a_byte():
    # The backward pass keeps where the clip passes the gradient as bits, ceil(C / 8)
    # bytes a pixel, and gets the closed-form gradient from them: 1 for -L <= x <= L
    # (the limits included), else 0, with C = 13 not a multiple of 8.
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, (2, 3, 5, 13)).astype(np.float32)
    x.flat[::7] = np.float32(1.0)
    x.flat[3::11] = np.float32(-1.0)
    dy = rng.normal(size=x.shape).astype(np.float32)
    y, vjp = jax.vjp(lambda x: mp.clip_act(x, 1.0), jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(y), np.clip(x, -1, 1))
    np.testing.assert_array_equal(np.asarray(vjp(jnp.asarray(dy))[0]),
                                  np.where((x >= -1) & (x <= 1), dy, 0))
    kept = jax.tree.leaves(vjp)
    assert [(a.shape, a.dtype) for a in kept] == [((2, 3, 5, 2), jnp.uint8)]


@pytest.mark.slow
@pytest.mark.ci  # ~30 s on 2 cores: CI runs it after the quick suite
def test_cpu_fusion_barriers_leave_gradients_unchanged(tiny):
    # mp_silu / clip_act residuals behind lax.cond (backends.cpu.barrier) vs plain
    # autodiff: the same gradients up to float32 rounding of SiLU's derivative.
    _, v = tiny
    x = 3 * jax.random.normal(jax.random.PRNGKey(12), (2, 16, 16, 3))
    sigma = jnp.array([0.5, 2.0])
    labels = jax.nn.one_hot(jnp.array([0, 9]), 10)
    params = set_gains(v["params"], 0.5)

    def grads(barriers):
        net = Precond(**TINY, kernels=backends.select("cpu", cpu_barriers=barriers).kernels)

        def loss(params):
            D = net.apply({"params": params, "buffers": v["buffers"]}, x, sigma, labels)
            return jnp.mean((D - x) ** 2)
        return jax.jit(jax.grad(loss))(params)

    g0 = grads(False)
    g1 = grads(True)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree_util.tree_leaves(g1)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        # a few ulps per element, summed over ~1e3-1e4 terms: 1e-5 of the gradient's norm
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(a) + 1e-12, path


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_dropout_only_in_training(tiny):
    net = Precond(**{**TINY, "dropout": 0.5})
    v = init_variables(net, jax.random.PRNGKey(0))
    params = set_gains(v["params"], 0.7)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 16, 3))
    args = (x, jnp.array([1.0, 1.0]), jax.nn.one_hot(jnp.array([0, 1]), 10))
    ev1 = net.apply({"params": params, "buffers": v["buffers"]}, *args)
    ev2 = net.apply({"params": params, "buffers": v["buffers"]}, *args)
    tr = net.apply({"params": params, "buffers": v["buffers"]}, *args, train=True,
                   rngs={"dropout": jax.random.PRNGKey(3)})
    np.testing.assert_array_equal(ev1, ev2)
    assert float(jnp.abs(tr - ev1).max()) > 1e-3


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_bfloat16_path_close_to_float32(tiny):
    _, v = tiny
    params = set_gains(v["params"], 0.8)
    x = jax.random.normal(jax.random.PRNGKey(13), (4, 16, 16, 3))
    c_noise = jnp.log(jnp.array([0.01, 0.3, 2.0, 40.0])) / 4
    labels = jax.nn.one_hot(jnp.arange(4), 10)
    unet_kw = {k: val for k, val in TINY.items()}
    outs = {}
    for dt in (jnp.float32, jnp.bfloat16):
        unet = UNet(**unet_kw, dtype=dt)
        outs[dt] = unet.apply({"params": params["unet"], "buffers": v["buffers"]["unet"]},
                              x, c_noise, labels)
        assert outs[dt].dtype == dt  # the raw network returns its compute dtype
    ref = outs[jnp.float32]
    rel = float(jnp.abs(outs[jnp.bfloat16].astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
    assert 0 < rel <= 5e-2, rel  # > 0: bf16 really was used
    # The preconditioned denoiser and its uncertainty are float32 whatever the dtype.
    net = Precond(**TINY, dtype=jnp.bfloat16)
    d, logvar = net.apply({"params": params, "buffers": v["buffers"]}, x, jnp.exp(4 * c_noise),
                          labels, return_logvar=True)
    assert d.dtype == jnp.float32 and logvar.dtype == jnp.float32


def test_precond_from_config_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown network config fields"):
        precond_from_config({**TINY, "model_chanels": 3})


@pytest.mark.parametrize("name", sorted(presets.PARAM_COUNTS))
def test_parameter_counts_of_released_presets(name):
    net = precond_from_config(presets.NETWORK_PRESETS[name])
    assert count_params(net) == presets.PARAM_COUNTS[name]
