"""EDM2 training math: loss (Sec. 2), optimiser and schedule (Sec. 2.4), EMA (Sec. 3).

Golden parity against one training step of the authors' release on a tiny conditional
network (`tests/data/edm2_ref/train_step_tiny.npz`, see tests/data/README.md) and
the release's sigma_rel -> gamma / beta values (`phema.npz`), plus closed forms by hand.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from edm2_jax.ema import power as ema
from edm2_jax.model import loss
from edm2_jax.model import mp
from edm2_jax.training import optim
from edm2_jax.model.networks import Precond
from tests.testdata import golden as golden_file
from tests.tolerances import EPS32, tree_err, tree_magnitude

STEP_NPZ = "edm2_ref/train_step_tiny.npz"
PHEMA_NPZ = "edm2_ref/phema.npz"


def _rel(a, b) -> float:
    """max |a - b| / max |b| (relative to the tensor's scale)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _worst(tree_a, tree_b) -> tuple[float, str]:
    """Largest per-tensor relative error between two trees of the same structure."""
    assert jax.tree.structure(tree_a) == jax.tree.structure(tree_b)
    errs = jax.tree_util.tree_flatten_with_path(jax.tree.map(_rel, tree_a, tree_b))[0]
    path, err = max(errs, key=lambda pe: pe[1])
    return err, jax.tree_util.keystr(path)


def _release_to_tree(d, prefix: str) -> tuple[dict, dict]:
    """Release state_dict entries `prefix/<key>` -> (params, buffers) in this project's
    layout: `unet.enc.16x16_block0.x` -> ['unet']['enc_16x16_block0']['x'], conv OIHW ->
    HWIO, dense [out, in] -> [in, out], Fourier freqs/phases -> buffers."""
    params, buffers = {}, {}
    for k in d.files:
        if not k.startswith(prefix + "/"):
            continue
        key = k[len(prefix) + 1:].split(".")
        a = d[k]
        if key[0] == "unet" and key[1] in ("enc", "dec"):
            key = ["unet", f"{key[1]}_{key[2]}"] + key[3:]
        tree = buffers if key[-1] in ("freqs", "phases") else params
        if tree is params:
            a = a.transpose(2, 3, 1, 0) if a.ndim == 4 else a.T if a.ndim == 2 else a
        for p in key[:-1]:
            tree = tree.setdefault(p, {})
        tree[key[-1]] = a
    return params, buffers


@pytest.fixture(scope="module")
def golden():
    d = np.load(golden_file(STEP_NPZ))
    g = {p: _release_to_tree(d, p)[0] for p in ("wn", "g", "w1", "ema0.050", "ema0.100")}
    w0, buffers = _release_to_tree(d, "w0")
    return dict(
        d=d, w0=w0, buffers=buffers, **g,
        net=Precond(img_resolution=16, img_channels=3, label_dim=10, model_channels=32,
                    channel_mult=(1, 2), num_blocks=1, attn_resolutions=(8,)),
        images=d["in/images"].transpose(0, 2, 3, 1), labels=d["in/labels"],
        loss_kw=dict(P_mean=float(d["cfg/P_mean"]), P_std=float(d["cfg/P_std"]),
                     rnd_normal=d["in/rnd_normal"].reshape(-1),
                     noise_unit=d["in/noise_unit"].transpose(0, 2, 3, 1)),
        optim_cfg=dict(ref_lr=float(d["cfg/ref_lr"]), t_ref=float(d["cfg/t_ref_batches"]),
                       rampup_kimg=float(d["cfg/rampup_Mimg"]) * 1e3),
        batch_size=int(d["cfg/batch_size"]), nimg=int(d["cfg/nimg_before"]))


def loss_written_out(params, buffers, net, images, labels, *, rnd_normal, noise_unit, P_mean,
                     P_std, sigma_data=0.5, dropout_rng=None):
    """The EDM2 loss written out from the paper, in `loss.edm2_loss`'s order of operations:
    `(sum of per-image losses / B, per-element loss)`."""
    sigma = jnp.exp(rnd_normal * P_std + P_mean)                   # ln sigma ~ N(P_mean, P_std^2)
    rngs = {} if dropout_rng is None else {"dropout": dropout_rng}
    D, logvar = net.apply({"params": params, "buffers": buffers},
                          images + noise_unit * sigma[:, None, None, None], sigma, labels,
                          train=True, return_logvar=True, rngs=rngs)
    lv = logvar[:, None, None, None]
    s = sigma[:, None, None, None]
    weight = (s**2 + sigma_data**2) / (s * sigma_data) ** 2        # EDM lambda(sigma)
    per_elem = weight / jnp.exp(lv) * jnp.square(D - images) + lv  # Eq. 21
    return jnp.sum(jnp.sum(per_elem, axis=(1, 2, 3))) / images.shape[0], per_elem


def _golden_jit(golden, fn):
    """Force-normalise w0, then `fn(params) -> (objective, aux)` and its gradients at the
    normalised weights, in one jitted call (XLA optimisations off: the graph is compiled
    once and run once, so compile time dominates on CPU)."""
    def step(w0):
        params = mp.force_normalize(w0)
        (obj, aux), grads = jax.value_and_grad(fn, has_aux=True)(params)
        return params, obj, aux, grads

    prev = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        params, obj, aux, grads = jax.device_get(jax.jit(step)(golden["w0"]))
    finally:
        jax.config.update("jax_disable_most_optimizations", prev)
    return dict(params=params, objective=obj, aux=aux, grads=grads)


@pytest.fixture(scope="module")
def golden_step(golden):
    """`loss.edm2_loss` of the golden batch and draws, and its gradients."""
    return _golden_jit(golden, lambda params: loss.edm2_loss(
        params, golden["buffers"], golden["net"], golden["images"], golden["labels"],
        **golden["loss_kw"]))


@pytest.fixture(scope="module")
def golden_written_out(golden):
    """`loss_written_out` of the golden batch and draws (its aux: the per-element loss),
    and its gradients."""
    kw = {k: jnp.asarray(v, jnp.float32) if k in ("rnd_normal", "noise_unit") else v
          for k, v in golden["loss_kw"].items()}
    return _golden_jit(golden, lambda params: loss_written_out(
        params, golden["buffers"], golden["net"], jnp.asarray(golden["images"], jnp.float32),
        golden["labels"], **kw))


# ------------------------------------------------------------------ golden parity

def test_forced_weight_normalisation_matches_release(golden):
    err, where = _worst(jax.jit(mp.force_normalize)(golden["w0"]), golden["wn"])
    assert err <= 1e-5, f"forced WN differs at {where}: {err:.2e}"


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_loss_per_element_and_objective_match_release(golden, golden_step, golden_written_out):
    d = golden["d"]
    ref = d["out/loss"].transpose(0, 2, 3, 1)
    assert _rel(golden_written_out["aux"], ref) <= 1e-5
    # Objective = per-image sum over pixels and channels, averaged over the batch.
    assert golden_step["objective"] == pytest.approx(float(d["out/objective"]), rel=1e-5)
    assert float(golden_step["aux"]["loss"]) == pytest.approx(float(ref.mean()), rel=1e-5)


def test_edm2_loss_is_eqs_14_16_21_written_out_bit_for_bit(golden_step, golden_written_out):
    """`loss.edm2_loss` is the equations' operations in their order: the same objective
    and the same gradients, bit for bit, as the loss written out here by hand."""
    assert np.array_equal(golden_step["objective"], golden_written_out["objective"])
    same = jax.tree.map(np.array_equal, golden_step["grads"], golden_written_out["grads"])
    assert all(jax.tree.leaves(same)), same


# Gradients of the release (PyTorch) and ours agree to this fraction of each tensor's
# scale (scalar gains: of the whole gradient's, tests/tolerances.tree_err); measured on an
# AMD EPYC 1.6e-6 (4.5e-6 for a gain relative to itself).
GRAD_TOL = 1e-4


def test_gradients_at_normalised_weights_match_release(golden, golden_step):
    err, where = tree_err(golden_step["grads"], golden["g"])
    assert err <= GRAD_TOL, f"gradient differs at {where}: {err:.2e}"


def test_learning_rate_matches_release(golden):
    lr = optim.learning_rate(golden["nimg"], batch_size=golden["batch_size"],
                             **golden["optim_cfg"])
    assert float(lr) == pytest.approx(float(golden["d"]["out/lr"]), rel=1e-6)


def test_adam_step_matches_release(golden, golden_step):
    tx = optim.make_optimizer(golden["optim_cfg"], golden["batch_size"])
    wn = golden_step["params"]
    adam_step = jax.jit(lambda g, p, nimg: optax.apply_updates(
        p, tx.update(g, tx.init(p), p, nimg=nimg)[0]))

    # The optimiser alone, fed the release's gradients (fresh state, as in the golden).
    err, where = _worst(adam_step(golden["g"], wn, golden["nimg"]), golden["w1"])
    assert err <= 1e-5, f"Adam step differs at {where}: {err:.2e}"

    # The whole step with our own gradients. Adam's first update is u(g) = lr g / (|g| + eps),
    # whose slope on [g - D, g + D] is at most lr eps / (max(|g| - D, 0) + eps)^2: a
    # gradient within D = GRAD_TOL x its tensor's scale of the release's moves each
    # weight by at most lr D eps / (max(|g| - D, 0) + eps)^2 (up to lr D / eps where
    # |g| ~ eps), plus the step's own float32 rounding, 8 eps32 of the weights' scale.
    # Measured on an AMD EPYC: at most 0.26 of this bound (was a flat 5e-4, measured 8e-5).
    lr, eps = float(golden["d"]["out/lr"]), 1e-8
    ours = jax.device_get(adam_step(golden_step["grads"], wn, golden["nimg"]))
    g_scale = tree_magnitude(golden["g"])
    worst = 0.0
    for (path, o), w, g in zip(jax.tree_util.tree_leaves_with_path(ours),
                               jax.tree.leaves(golden["w1"]), jax.tree.leaves(golden["g"])):
        g = np.asarray(g, np.float64)
        D = GRAD_TOL * (np.abs(g).max() if g.size > 1 else max(abs(float(g)), g_scale))
        bound = (lr * D * eps / (np.maximum(np.abs(g) - D, 0) + eps) ** 2
                 + 8 * EPS32 * np.abs(w).max())
        ratio = np.abs(np.asarray(o, np.float64) - w) / bound
        assert ratio.max() <= 1, f"full step differs at {jax.tree_util.keystr(path)}"
        worst = max(worst, float(ratio.max()))
    print(f"full step: worst error / bound {worst:.2e}")


def test_power_emas_match_release(golden):
    sigma_rels = (0.05, 0.10)
    update = jax.jit(lambda state, params, nimg_after: ema.update_ema(
        state, params, nimg_after, golden["batch_size"], sigma_rels=sigma_rels))
    # EMAs start at w0 and take the post-Adam weights at t = nimg + batch (images seen
    # after the step).
    state = update(ema.init_ema_state(golden["w0"], sigma_rels), golden["w1"],
                   golden["nimg"] + golden["batch_size"])
    for key in ("0.050", "0.100"):
        err, where = _worst(state["power"][key], golden["ema" + key])
        assert err <= 1e-5, f"EMA {key} differs at {where}: {err:.2e}"


def test_gamma_and_beta_match_release():
    d = np.load(golden_file(PHEMA_NPZ))
    np.testing.assert_allclose(ema.sigma_rel_to_gamma(d["sigma_rel"]), d["gamma"], rtol=1e-10)
    gamma = float(ema.sigma_rel_to_gamma(float(d["beta_sigma_rel"])))
    beta = ema.power_ema_beta(d["beta_t_next"], float(d["beta_dt"]), gamma)
    np.testing.assert_allclose(np.asarray(beta), d["beta"], rtol=1e-5, atol=0)


# ------------------------------------------------------------------ loss, by hand

class _StubNet:
    """Stands in for Precond: returns a fixed denoiser output and logvar, and records
    what it was called with."""

    def __init__(self, denoised, logvar):
        self.denoised, self.logvar, self.calls = denoised, logvar, []

    def apply(self, variables, x, sigma, labels, *, train, return_logvar, rngs):
        self.calls.append(dict(x=x, sigma=sigma, labels=labels, train=train, rngs=rngs))
        assert return_logvar
        return jnp.broadcast_to(self.denoised, x.shape), self.logvar


def test_loss_is_uncertainty_weighted_edm_loss_by_hand():
    # Two 1x1x2 images; sigma = 1 and 2 (P_mean 0, P_std ln 2, rnd_normal 0 and 1).
    y = np.array([0.3, -0.2, 0.5, 0.1], np.float32).reshape(2, 1, 1, 2)
    n = np.array([1.0, -1.0, 0.5, 2.0], np.float32).reshape(2, 1, 1, 2)
    logvar = np.array([math.log(2.0), -0.5], np.float32)
    net = _StubNet(denoised=jnp.full((2, 1, 1, 2), 0.4), logvar=jnp.asarray(logvar))
    kw = dict(P_mean=0.0, P_std=math.log(2.0), sigma_data=0.5, rnd_normal=np.array([0.0, 1.0]),
              noise_unit=n)
    objective, aux = loss.edm2_loss({}, {}, net, y, None, **kw)

    # weight = (sigma^2 + 0.25) / (0.25 sigma^2): 5 at sigma 1, 4.25 at sigma 2.
    expected = [5 / 2 * ((0.4 - 0.3) ** 2 + (0.4 + 0.2) ** 2) + 2 * math.log(2.0),
                4.25 / math.exp(-0.5) * ((0.4 - 0.5) ** 2 + (0.4 - 0.1) ** 2) - 2 * 0.5]
    assert float(objective) == pytest.approx(sum(expected) / 2, rel=1e-6)
    np.testing.assert_allclose(net.calls[0]["sigma"], [1.0, 2.0], rtol=1e-6)
    sigma = np.array([1.0, 2.0])[:, None, None, None]
    np.testing.assert_allclose(net.calls[0]["x"], y + n * sigma, rtol=1e-6)
    assert float(aux["loss"]) == pytest.approx(sum(expected) / 4, rel=1e-6)
    assert float(aux["logvar"]) == pytest.approx(float(logvar.mean()), rel=1e-6)
    wmse = [5 * ((0.4 - 0.3) ** 2 + (0.4 + 0.2) ** 2), 4.25 * ((0.4 - 0.5) ** 2 + (0.4 - 0.1) ** 2)]
    assert float(aux["weighted_mse"]) == pytest.approx(sum(wmse) / 4, rel=1e-5)
    # Over the global batch size (micro-batches): the sum of per-image losses over it.
    objective, _ = loss.edm2_loss({}, {}, net, y, None, batch_size=8, **kw)
    assert float(objective) == pytest.approx(sum(expected) / 8, rel=1e-6)


def test_loss_routes_the_dropout_key_and_weights_each_pixel_by_lambda():
    y = jnp.zeros((3, 2, 2, 1))
    rnd = jax.random.normal(jax.random.PRNGKey(0), (3,))
    draws = dict(rnd_normal=rnd, noise_unit=jax.random.normal(jax.random.PRNGKey(1), y.shape))
    net = _StubNet(denoised=0.0, logvar=jnp.zeros(3))
    objective, _ = loss.edm2_loss({}, {}, net, y, None, P_mean=-0.4, P_std=1.0,
                                  dropout_rng=jax.random.PRNGKey(2), **draws)
    assert "dropout" in net.calls[0]["rngs"] and net.calls[0]["train"] is True
    # D = 0 and y = 0 leave a zero loss whatever the draws; with D = 1 every pixel costs
    # weight(sigma) exactly.
    assert float(objective) == 0.0
    net1 = _StubNet(denoised=1.0, logvar=jnp.zeros(3))
    objective, _ = loss.edm2_loss({}, {}, net1, y, None, P_mean=-0.4, P_std=1.0, **draws)
    assert net1.calls[0]["rngs"] == {}
    sigma = net1.calls[0]["sigma"]
    np.testing.assert_allclose(sigma, np.exp(np.asarray(rnd) * 1.0 - 0.4), rtol=1e-6)
    assert float(objective) == pytest.approx(float(jnp.sum(4 * loss.loss_weight(sigma))) / 3,
                                             rel=1e-6)


def test_loss_rejects_misshaped_draws():
    net = _StubNet(denoised=0.0, logvar=jnp.zeros(2))
    y = jnp.zeros((2, 2, 2, 1))
    with pytest.raises(ValueError, match="noise_unit"):
        loss.edm2_loss({}, {}, net, y, None, P_mean=0.0, P_std=1.0, rnd_normal=jnp.zeros(2),
                       noise_unit=jnp.zeros((2, 1, 2, 2)))
    with pytest.raises(ValueError, match="rnd_normal"):
        loss.edm2_loss({}, {}, net, y, None, P_mean=0.0, P_std=1.0, rnd_normal=jnp.zeros(3),
                       noise_unit=jnp.zeros((2, 2, 2, 1)))
    with pytest.raises(ValueError, match="NHWC"):
        loss.edm2_loss({}, {}, net, jnp.zeros((2, 4)), None, P_mean=0.0, P_std=1.0,
                       rnd_normal=jnp.zeros(2), noise_unit=jnp.zeros((2, 4)))


def test_sigma_is_log_normal_with_P_mean_P_std():
    # The noise levels of the step's standard normal draws (`Objective.draws`).
    n = 200_000
    net = _StubNet(denoised=0.0, logvar=jnp.zeros(n))
    rnd = jax.random.normal(jax.random.PRNGKey(1), (n,), jnp.float32)
    loss.edm2_loss({}, {}, net, jnp.zeros((n, 1, 1, 1)), None, P_mean=-0.8, P_std=1.6,
                   rnd_normal=rnd, noise_unit=jnp.zeros((n, 1, 1, 1)))
    sigma = net.calls[0]["sigma"]
    assert sigma.shape == (n,) and sigma.dtype == jnp.float32
    log_sigma = np.log(np.asarray(sigma, np.float64))
    assert log_sigma.mean() == pytest.approx(-0.8, abs=0.02)
    assert log_sigma.std() == pytest.approx(1.6, abs=0.02)


# ------------------------------------------------------------------ schedule and optimiser

def test_learning_rate_closed_form_ramp_plateau_decay():
    kw = dict(batch_size=10, ref_lr=0.01, t_ref=100, rampup_kimg=1.0)  # ramp 1000 imgs
    lr = lambda nimg, **o: float(optim.learning_rate(nimg, **{**kw, **o}))
    assert lr(0) == 0.0                                   # first step: no update
    assert lr(250) == pytest.approx(0.0025, rel=1e-6)     # linear ramp, before decay
    assert lr(500) == pytest.approx(0.005, rel=1e-6)
    assert lr(1000) == pytest.approx(0.01, rel=1e-6)      # ramp done, t = t_ref
    assert lr(4000) == pytest.approx(0.005, rel=1e-6)     # t = 4 t_ref: 1/sqrt(4)
    assert lr(9000) == pytest.approx(0.01 / 3, rel=1e-6)   # t = 9 t_ref
    assert lr(0, rampup_kimg=0) == pytest.approx(0.01)    # no ramp
    assert lr(10**9, t_ref=0) == pytest.approx(0.01)      # no decay
    jitted = jax.jit(lambda n: optim.learning_rate(n, **kw))(jnp.int32(4000))
    assert float(jitted) == pytest.approx(0.005, rel=1e-6)


def test_first_step_does_not_move_the_weights():
    tx = optim.make_optimizer(dict(ref_lr=0.01, t_ref=70, rampup_kimg=1.0), batch_size=8)
    params = {"w": jnp.ones((3, 2))}
    updates, state = tx.update({"w": jnp.full((3, 2), 0.5)}, tx.init(params), params, nimg=0)
    assert np.all(np.asarray(updates["w"]) == 0)
    assert int(optax.tree_utils.tree_get(state, "count")) == 1  # Adam moments did advance


def test_force_finite_zeroes_nan_and_inf_gradient_entries():
    g = {"w": jnp.array([1.0, jnp.nan, jnp.inf, -jnp.inf, -2.0])}
    out, _ = optim.force_finite().update(g, optim.force_finite().init(g))
    np.testing.assert_array_equal(out["w"], [1.0, 0.0, 0.0, 0.0, -2.0])

    # Through the whole chain (with clipping on): the bad entries do not move, the good
    # ones take Adam's first step ~ -lr sign(g), and nothing becomes non-finite.
    cfg = dict(ref_lr=0.01, t_ref=0, rampup_kimg=0, grad_clip=1.0)
    tx = optim.make_optimizer(cfg, batch_size=8)
    params = {"w": jnp.zeros(5)}
    updates, _ = tx.update(g, tx.init(params), params, nimg=8)
    np.testing.assert_allclose(updates["w"], [-0.01, 0, 0, 0, 0.01], rtol=1e-5, atol=1e-9)


def test_optimizer_requires_nimg():
    tx = optim.make_optimizer(dict(ref_lr=0.01, t_ref=70, rampup_kimg=1.0), batch_size=8)
    params = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="nimg"):
        tx.update(params, tx.init(params), params)
    with pytest.raises(KeyError, match="ref_lr"):
        optim.make_optimizer(dict(t_ref=70, rampup_kimg=1.0), batch_size=8)


# ------------------------------------------------------------------ EMA, by hand

def test_sigma_rel_gamma_round_trip_and_known_values():
    # Exact points of Eq. 123: gamma 0 -> sqrt(1/12), 1 -> sqrt(1/18), 2 -> sqrt(3/80).
    np.testing.assert_allclose(ema.gamma_to_sigma_rel([0.0, 1.0, 2.0]),
                               np.sqrt([1 / 12, 1 / 18, 3 / 80]), rtol=1e-14)
    np.testing.assert_allclose(ema.sigma_rel_to_gamma(np.sqrt([1 / 12, 1 / 18, 3 / 80])),
                               [0.0, 1.0, 2.0], atol=1e-9)
    gamma = ema.sigma_rel_to_gamma([0.05, 0.10])
    np.testing.assert_allclose(gamma, [16.9721986, 6.93720394], rtol=1e-8)
    for g, s in zip(gamma, (0.05, 0.10)):  # gamma is a root of the cubic of Eq. 126
        c = s**-2
        assert abs(g**3 + 7 * g**2 + (16 - c) * g + (12 - c)) < 1e-8 * c * g
    s = np.linspace(0.01, 0.29, 29)
    np.testing.assert_allclose(ema.gamma_to_sigma_rel(ema.sigma_rel_to_gamma(s)), s, rtol=1e-10)
    for bad in (0.0, -0.1, 0.31):
        with pytest.raises(ValueError, match="sigma_rel"):
            ema.sigma_rel_to_gamma(bad)


def test_first_ema_update_copies_params():
    params = {"a": jnp.arange(4.0), "b": {"c": jnp.full((2, 2), -3.0)}}
    state = ema.init_ema_state(jax.tree.map(jnp.zeros_like, params), (0.05, 0.10),
                               trad_halflife_kimg=0)
    assert sorted(state) == ["power"] and sorted(state["power"]) == ["0.050", "0.100"]
    new = ema.update_ema(state, params, 16, 16, sigma_rels=(0.05, 0.10))
    for key in ("0.050", "0.100"):
        for got, want in zip(jax.tree.leaves(new["power"][key]), jax.tree.leaves(params)):
            np.testing.assert_array_equal(got, want)


def test_power_ema_update_is_beta_lerp_and_accurate_late_in_training():
    gamma = float(ema.sigma_rel_to_gamma(0.05))
    # Mid-training, by hand in float64.
    t, dt = 800.0, 8.0
    beta = (1 - dt / t) ** (gamma + 1)
    state = {"power": {"0.050": {"w": jnp.array([2.0, -1.0])}}}
    new = jax.jit(lambda s, p, t: ema.update_ema(s, p, t, 8, sigma_rels=(0.05,)))(
        state, {"w": jnp.array([1.0, 3.0])}, t)
    np.testing.assert_allclose(new["power"]["0.050"]["w"],
                               [beta * 2 + (1 - beta) * 1, beta * -1 + (1 - beta) * 3], rtol=1e-6)
    # At 2^31 images with batch 2048, 1 - beta ~ 1.7e-5; a float32 evaluation of
    # 1 - (1 - dt/t)^(gamma+1) would be off by ~2e-3 relative (rounding of 1 - dt/t).
    t, dt = 2.0**31, 2048.0
    one_minus_beta = -math.expm1((gamma + 1) * math.log1p(-dt / t))
    state = {"power": {"0.050": {"w": jnp.zeros(1)}}}
    new = ema.update_ema(state, {"w": jnp.ones(1)}, jnp.float32(t), dt, sigma_rels=(0.05,))
    assert float(new["power"]["0.050"]["w"][0]) == pytest.approx(one_minus_beta, rel=1e-4)


def test_traditional_ema_half_life_and_ramp_up():
    # Half-life 1 kimg, batch 100: beta = 0.5^(100/1000); ramped at 1000 imgs: 0.5^(100/90).
    assert float(ema.traditional_ema_beta(10**6, 100, 1.0, rampup_ratio=None)) == \
        pytest.approx(0.5**0.1, rel=1e-6)
    assert float(ema.traditional_ema_beta(1000, 100, 1.0, rampup_ratio=0.09)) == \
        pytest.approx(0.5 ** (100 / 90), rel=1e-6)
    state = ema.init_ema_state({"w": jnp.zeros(1)}, (0.1,), trad_halflife_kimg=1.0)
    new = ema.update_ema(state, {"w": jnp.ones(1)}, 10**6, 100, sigma_rels=(0.1,),
                         trad_halflife_kimg=1.0, trad_rampup_ratio=0.09)
    assert float(new["traditional"]["w"][0]) == pytest.approx(1 - 0.5**0.1, rel=1e-5)


def test_ema_state_mismatch_and_bad_times_raise():
    state = ema.init_ema_state({"w": jnp.zeros(1)}, (0.05, 0.10))
    with pytest.raises(ValueError, match="sigma_rels"):
        ema.update_ema(state, {"w": jnp.ones(1)}, 16, 8, sigma_rels=(0.05,))
    with pytest.raises(ValueError, match="trad_halflife_kimg"):
        ema.update_ema(state, {"w": jnp.ones(1)}, 16, 8, sigma_rels=(0.05, 0.10),
                       trad_halflife_kimg=500.0)
    with pytest.raises(ValueError, match="nimg_after"):
        ema.update_ema(state, {"w": jnp.ones(1)}, 4, 8, sigma_rels=(0.05, 0.10))
    with pytest.raises(ValueError, match="collide"):
        ema.init_ema_state({"w": jnp.zeros(1)}, (0.1, 0.1001))
