"""The paper's ablation switches (Sec. 2, configs C-G) and the training-dynamics
diagnostics, each against a fact that holds independently of this code: scale invariance
of weight-normalised layers (Eq. 66), He's uniform init, the group norm's unit RMS per
group, the plain sum, Adam's first step (|update| = lr per element), and the unit-RMS
band of a fresh config-G network (tests/test_networks.py).

One 8x8 network with 8/16 channels, so that each compile takes a few seconds.
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edm2_jax import configs
from edm2_jax.analysis import diagnostics
from edm2_jax.model import mp
from edm2_jax.model import loss as loss_lib
from edm2_jax.training import optim as optim_lib
from edm2_jax.training import probes
from edm2_jax.training.state import init_train_state, make_network
from edm2_jax.training.step import make_train_step
from edm2_jax.model.networks import Block, Precond, init_variables

REPO = Path(__file__).resolve().parents[1]
NET = dict(img_resolution=8, img_channels=1, label_dim=0, model_channels=8,
           channel_mult=(1, 2), num_blocks=1, attn_resolutions=(), logvar_channels=8)


def rms(x):
    return float(jnp.sqrt(jnp.mean(jnp.square(x))))


def _ablation_config(variant):
    spec = importlib.util.spec_from_file_location("ablation_config", REPO / "configs" / "ablation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(variant)


# --- configs/ablation.py ----------------------------------------------------------------

def test_ablation_letters_turn_off_one_step_each():
    want = {  # (mp_learned_layers, forced_wn, group_norm, mp_fixed_layers)
        "g": (True, True, False, True), "f": (True, True, False, False),
        "e": (True, True, True, False), "d": (True, False, True, False),
        "c": (False, False, True, False)}
    g = _ablation_config("g")
    for letter, (learned, fwn, gn, fixed) in want.items():
        c = _ablation_config(letter)
        configs.validate(c)
        assert (c.network.mp_learned_layers, c.optim.forced_wn, c.network.group_norm,
                c.network.mp_fixed_layers) == (learned, fwn, gn, fixed)
        assert c.network.get("res_balance", 0.3) == (0.5 if gn else 0.3)  # Precond: 0.3
        assert c.optim.t_ref == (g.optim.t_ref if fwn else 0)
        assert c.optim.ref_lr == pytest.approx(g.optim.ref_lr / (1 if learned else 10))
    assert _ablation_config("c,tiny").total_kimg == _ablation_config("g,tiny").total_kimg < 1
    assert _ablation_config("e,img64-s").network.model_channels == 192
    with pytest.raises(ValueError, match="unknown variant 'h'"):
        _ablation_config("h")


def test_forced_wn_of_standard_layers_is_refused():
    c = _ablation_config("c")
    c.optim.forced_wn = True
    with pytest.raises(ValueError, match="optim.forced_wn.*mp_learned_layers=False"):
        configs.validate(c)


# --- C -> D: weight normalisation in the forward pass -----------------------------------

@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_standard_layer_has_he_uniform_init_and_is_linear_in_its_weight():
    conv = mp.MPConv(64, 32, (3, 3), normalize_weight=False)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 6, 64))
    v = conv.init(jax.random.PRNGKey(1), x)
    w = v["params"]["weight"]
    bound = math.sqrt(6 / (3 * 3 * 64))  # He uniform: U(-sqrt(6/fan_in), sqrt(6/fan_in))
    assert float(jnp.max(jnp.abs(w))) <= bound
    assert abs(float(jnp.var(w)) / (bound**2 / 3) - 1) < 0.05  # var of U(-b, b) = b^2/3
    y = conv.apply(v, x)
    y2 = conv.apply({"params": {"weight": 2 * w}}, x)
    np.testing.assert_allclose(y2, 2 * y, rtol=1e-6, atol=1e-6)
    # Normalised in the forward pass (configs D-G): scale-free, up to normalize's eps
    # (x / (1e-4 + rms)): relative 1e-4 * (1 - 1/2) on a unit-RMS weight.
    mpconv = mp.MPConv(64, 32, (3, 3))
    w = mpconv.init(jax.random.PRNGKey(1), x)["params"]["weight"]
    np.testing.assert_allclose(mpconv.apply({"params": {"weight": 2 * w}}, x),
                               mpconv.apply({"params": {"weight": w}}, x), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("learned", [True, False])
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_scaling_a_stored_weight_changes_a_block_only_without_forward_wn(learned):
    blk = Block(16, 16, 8, flavor="dec", mp_learned_layers=learned)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 4, 16))
    emb = jax.random.normal(jax.random.PRNGKey(1), (2, 8))
    v = blk.init(jax.random.PRNGKey(2), x, emb)
    v = jax.tree_util.tree_map(lambda a: jnp.full_like(a, 0.5) if a.ndim == 0 else a, v)
    scaled = jax.tree_util.tree_map(lambda a: a, v)
    scaled["params"]["conv_res1"]["weight"] *= 3.0
    diff = float(jnp.max(jnp.abs(blk.apply(scaled, x, emb) - blk.apply(v, x, emb))))
    if learned:
        assert diff < 1e-3  # Eq. 66: scale-free up to normalize's eps (1e-4 of the RMS)
    else:
        assert diff > 1e-1

# --- D -> E: forced weight normalisation in the training step -----------------------------

@pytest.fixture(scope="module")
def steps():
    """Three steps of G (forced WN) and of D (none) on one batch; lr 0 at the first step
    (ramp-up from nimg = 0), then positive."""
    out = {}
    images = jax.random.uniform(jax.random.PRNGKey(5), (4, 8, 8, 1), minval=-1, maxval=1)
    batch = {"image": images, "label": jnp.zeros((4, 0))}
    for forced in (True, False):
        c = configs.base_config()
        c.network.update(NET)
        c.batch_size = 4
        c.optim.update(ref_lr=0.01, t_ref=100, rampup_kimg=0.008, forced_wn=forced)
        net = make_network(c)
        tx = optim_lib.make_optimizer(c.optim, 4)
        state = init_train_state(c, net, tx, jax.random.PRNGKey(0))
        step = jax.jit(make_train_step(c, net, tx))
        states = [state]
        for _ in range(3):
            states.append(step(states[-1], batch)[0])
        out[forced] = (c, net, tx, states)
    return out


def _unit_norms(w):
    return jnp.sqrt(jnp.sum(jnp.square(w.reshape(-1, w.shape[-1])), axis=0))


@pytest.mark.slow  # two train-step compiles
def test_forced_wn_keeps_sqrt_fan_in_through_steps_and_plain_adam_does_not(steps):
    _, _, _, fwn = steps[True]
    _, _, _, plain = steps[False]
    w0 = probes.weight_leaves(fwn[0]["params"])
    # First step at lr 0: forced WN stores normalize(W0); plain Adam stores W0 untouched.
    for name, w in probes.weight_leaves(fwn[1]["params"]).items():
        np.testing.assert_allclose(  # jitted vs eager: a few float32 roundings apart
            w, mp.normalize(w0[name], axis=tuple(range(w.ndim - 1))), rtol=1e-6, atol=1e-7)
    for name, w in probes.weight_leaves(plain[1]["params"]).items():
        np.testing.assert_array_equal(w, w0[name])
    for t in (1, 2, 3):
        before = probes.weight_leaves(fwn[t - 1]["params"])
        after = probes.weight_leaves(fwn[t]["params"])
        for name, w in before.items():
            fan_in = math.prod(w.shape[:-1])
            used = mp.force_normalize({"weight": w})["weight"]
            # The weights every step uses: norm sqrt(fan_in) up to normalize's eps = 1e-4
            # (x / (eps + rms)) and float32 rounding.
            np.testing.assert_allclose(_unit_norms(used), math.sqrt(fan_in), rtol=2e-4)
            # The stored ones differ from them by one Adam step (triangle inequality), up
            # to the float32 error of the norms (sums of fan_in <= 144 terms: relative
            # eps * sqrt(fan_in) ~ 1.4e-6 each; a missing normalisation is ~1e-2 off).
            drift = jnp.abs(_unit_norms(after[name]) - _unit_norms(used))
            step_norm = _unit_norms(after[name] - used)
            assert bool(jnp.all(drift <= step_norm + 1e-5 * _unit_norms(used))), name
    # Plain Adam: the stored weights are what the updates made of them, never renormalised.
    grew = [float(jnp.mean(_unit_norms(w)) / jnp.mean(_unit_norms(w0[n])))
            for n, w in probes.weight_leaves(plain[3]["params"]).items()]
    assert max(abs(g - 1) for g in grew) > 1e-4


@pytest.mark.slow
def test_diagnostics_weight_rms_is_one_under_forced_wn(steps):
    c, net, tx, states = steps[True]
    fn = jax.jit(probes.make_diagnostics_fn(net, tx, sigmas=(0.5, 2.0), act_sigmas=(2.0,),
                                            batch_size=4))
    probe = {"image": jnp.zeros((2, 8, 8, 1)), "label": jnp.zeros((2, 0)),
             "noise": jax.random.normal(jax.random.PRNGKey(2), (2, 2, 8, 8, 1))}
    out = fn(states[3]["params"], states[3]["buffers"], states[3]["opt_state"],
             states[3]["step"], probe)
    wrms = {k: float(v) for k, v in out.items() if k.startswith("diag/wrms/")}
    assert len(wrms) == len(probes.weight_leaves(states[3]["params"]))
    # One Adam step of lr <= 0.01 off the unit sphere: |rms - 1| <= ~lr^2 per element.
    assert all(abs(v - 1) < 1e-3 for v in wrms.values()), wrms


# --- E -> F: group normalisation ------------------------------------------------------------

def test_group_rms_norm_gives_unit_rms_per_group_by_hand():
    x = (jax.random.normal(jax.random.PRNGKey(0), (2, 4, 4, 48)) + 2.0) * (1 + jnp.arange(48) % 3)
    y = np.asarray(mp.group_rms_norm(x))  # gcd(32, 48) = 16 groups of 3 channels
    xn = np.asarray(x).reshape(2, 4, 4, 16, 3)
    want = xn / (1e-4 + np.sqrt(np.mean(xn**2, axis=(1, 2, 4), keepdims=True)))
    np.testing.assert_allclose(y.reshape(2, 4, 4, 16, 3), want, rtol=1e-5)
    g = y.reshape(2, 4, 4, 16, 3)
    np.testing.assert_allclose(np.sqrt(np.mean(g**2, axis=(1, 2, 4))), 1.0, rtol=1e-3)
    assert float(np.mean(g)) > 0.5  # no mean subtraction (config C's simplification)


@pytest.mark.parametrize("group_norm", [False, True])
def test_encoder_block_normalises_its_input_where_the_config_says(group_norm):
    """F/G: the encoder's main path is pixel-normalised, so the block is invariant to the
    input's scale. C-E: the residual branch starts with a group norm (scale invariant),
    the main path does not, so out(k x) - out(x) is the skip path's share of (k - 1) x."""
    t = 0.3
    blk = Block(16, 16, 8, flavor="enc", res_balance=t, group_norm=group_norm)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 4, 16))
    emb = jax.random.normal(jax.random.PRNGKey(1), (2, 8))
    v = blk.init(jax.random.PRNGKey(2), x, emb)
    v = jax.tree_util.tree_map(lambda a: jnp.full_like(a, 0.5) if a.ndim == 0 else a, v)
    a, b = blk.apply(v, x, emb), blk.apply(v, 5.0 * x, emb)
    # Both up to the normalisations' eps (x / (1e-4 + rms)): 1e-4 of unit-RMS values.
    if not group_norm:
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-3)
    else:
        skip = (1 - t) / math.sqrt((1 - t) ** 2 + t**2)  # mp_sum's weight of the main path
        np.testing.assert_allclose(b - a, skip * 4.0 * x, rtol=1e-3, atol=1e-3)


# --- F -> G: magnitude-preserving fixed-function layers --------------------------------------

def test_plain_versions_of_the_mp_ops():
    a, b = jnp.array([1.0, -2.0, 3.5]), jnp.array([0.25, 4.0, -1.0])
    np.testing.assert_array_equal(mp.plain_sum(a, b), a + b)
    np.testing.assert_allclose(mp.plain_sum(a, b, 0.3), a + (3 / 7) * b, rtol=1e-6)
    np.testing.assert_array_equal(mp.plain_cat(a[None], b[None]), jnp.concatenate([a, b])[None])
    f = mp.MPFourier(4096, magnitude_preserving=False)
    v = f.init(jax.random.PRNGKey(0), jnp.zeros((1,)))
    y = f.apply(v, jnp.array([0.3]))
    np.testing.assert_allclose(y * math.sqrt(2), mp.MPFourier(4096).apply(v, jnp.array([0.3])),
                               rtol=1e-6)
    assert abs(rms(y) - 1 / math.sqrt(2)) < 0.02  # cos of a uniform phase


def test_no_learned_gains_without_mp_fixed_layers():
    shapes = lambda **kw: jax.eval_shape(  # noqa: E731
        lambda r: init_variables(Precond(**NET, **kw), r), jax.random.PRNGKey(0))["params"]
    scalar = lambda tree: sorted("/".join(str(getattr(k, "key", k)) for k in p)  # noqa: E731
                                 for p, l in jax.tree_util.tree_flatten_with_path(tree)[0]
                                 if l.ndim == 0)
    assert "unet/out_gain" in scalar(shapes())
    assert any(s.endswith("emb_gain") for s in scalar(shapes()))
    assert scalar(shapes(mp_fixed_layers=False)) == []


# --- Diagnostics ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fresh_diag():
    c = configs.base_config()
    c.network.update(NET, channel_mult=(1,))  # one level: the quickest compile
    net = make_network(c)
    c.optim.update(rampup_kimg=0.0)  # lr = ref_lr at step 0
    tx = optim_lib.make_optimizer(c.optim, 4)
    v = init_variables(net, jax.random.PRNGKey(0))
    params = mp.force_normalize(v["params"])  # as the first step will use them
    state = {"params": params, "buffers": v["buffers"], "opt_state": tx.init(params),
             "step": jnp.zeros((), jnp.int32)}
    sigmas = (0.1, 1.0, 10.0)
    probe = {"image": jax.random.uniform(jax.random.PRNGKey(3), (4, 8, 8, 1), minval=-1, maxval=1),
             "label": jnp.zeros((4, 0)),
             "noise": jax.random.normal(jax.random.PRNGKey(4), (3, 4, 8, 8, 1))}
    fn = jax.jit(probes.make_diagnostics_fn(net, tx, sigmas=sigmas, act_sigmas=sigmas,
                                            batch_size=4))
    run = lambda params: {k: float(v) for k, v in fn(  # noqa: E731
        params, state["buffers"], state["opt_state"], state["step"], probe).items()}
    # Fresh (gains 0: the U-Net gets no gradient), and with every gain 1.
    gains = jax.tree_util.tree_map(lambda a: jnp.ones_like(a) if a.ndim == 0 else a,
                                   state["params"])
    return c, net, state, probe, run(state["params"]), run(gains)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_fresh_g_network_activations_are_in_the_unit_band(fresh_diag):
    out = fresh_diag[4]
    act = {k: v for k, v in out.items() if k.startswith("diag/act/")}
    # 3 sigmas x (encoder: 8x8_block0; decoder: 8x8_in0, 8x8_in1, 8x8_block0-1): every
    # Block of the network.
    assert len(act) == 3 * (1 + 4)
    assert all(0.5 < v < 2.0 for v in act.values()), act  # tests/test_networks.py's band
    assert out["diag/gain/unet/out_gain"] == 0  # zero-initialised (config G)


def test_diagnostics_loss_and_logvar_per_sigma_are_the_edm2_loss(fresh_diag):
    c, net, state, probe, out, _ = fresh_diag
    @jax.jit
    def loss_at(log_sigma, noise):
        return loss_lib.edm2_loss(
            state["params"], state["buffers"], net, probe["image"], None, P_mean=0.0,
            P_std=1.0, rnd_normal=jnp.full(4, log_sigma), noise_unit=noise, train=False)[1]

    for i, s in enumerate((0.1, 1.0, 10.0)):
        aux = loss_at(math.log(s), probe["noise"][i])
        np.testing.assert_allclose(out[f"diag/loss/s{s:g}"], float(aux["loss"]), rtol=1e-4)
        np.testing.assert_allclose(out[f"diag/logvar/s{s:g}"], float(aux["logvar"]), rtol=1e-4,
                                   atol=1e-6)


def test_effective_lr_of_adams_first_step_is_the_learning_rate(fresh_diag):
    """Adam's first update is lr * g / (|g| + eps) per element, i.e. lr in magnitude
    wherever g != 0, so on a weight of unit RMS ||dw|| / ||w|| = lr. With the fresh
    network's zero out_gain no U-Net weight gets a gradient: 0."""
    c, _, _, _, fresh, gains = fresh_diag
    eff = {k: v for k, v in gains.items() if k.startswith("diag/efflr/")}
    assert len(eff) > 10
    for k, v in eff.items():
        np.testing.assert_allclose(v, c.optim.ref_lr, rtol=0.02, err_msg=k)
    assert all(v == 0 for k, v in fresh.items() if k.startswith("diag/efflr/unet/"))


def test_plot_command_draws_a_png_and_refuses_a_run_without_diagnostics(fresh_diag, tmp_path):
    out = fresh_diag[5]
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "stats.jsonl", "w") as f:
        f.write(json.dumps({"kimg": 1.0, "loss/loss": 1.0}) + "\n")
        for kimg in (0.0, 2.0, 4.0):
            f.write(json.dumps(dict(kimg=kimg, step=0, **out)) + "\n")
    assert diagnostics.main([str(run)]) == 0
    png = run / "diagnostics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bare").mkdir()
    with open(tmp_path / "bare" / "stats.jsonl", "w") as f:
        f.write(json.dumps({"kimg": 1.0, "loss/loss": 1.0}) + "\n")
    assert diagnostics.main([str(tmp_path / "bare")]) == 1


def test_a_run_recorded_before_the_switches_resumes_as_config_g():
    """A config.json written before the switches existed records config G."""
    from edm2_jax.training import resume
    current = json.loads(configs.base_config().to_json_best_effort())
    saved = json.loads(json.dumps(current))
    for field in ("mp_learned_layers", "group_norm", "mp_fixed_layers"):
        del saved["network"][field]
    del saved["optim"]["forced_wn"]
    assert resume.config_differences(saved, current) == ([], [])
    current["network"]["group_norm"] = True
    refused, _ = resume.config_differences(saved, current)
    assert refused == ["network.group_norm: checkpoint False vs now True"]


# --- comparing the configs' runs (python -m edm2_jax.analysis.diagnostics --compare) -----------

def test_ranking_stable_since_by_hand():
    kimg = [0, 8, 16, 24, 32]
    # runs a, b, c; lower is better. Order a<b<c from 16 kimg on (b<a before).
    v = np.array([[3.0, 2.0, 1.0, 0.9, 0.8],
                  [2.0, 1.5, 1.1, 1.0, 0.9],
                  [5.0, 4.0, 3.0, 2.0, 1.0]])
    assert diagnostics.ranking_stable_since(kimg, v) == 16
    v[2, 3] = 0.5  # c best at 24 kimg: the final order only holds from 32 on
    assert diagnostics.ranking_stable_since(kimg, v) == 32
    assert diagnostics.ranking_stable_since([0], v[:, :1]) is None


def test_probe_wmse_inverts_the_uncertainty_loss():
    # loss = wmse / exp(logvar) + logvar  =>  wmse = (loss - logvar) exp(logvar)
    wmse, logvar = 0.37, -1.3
    rec = {"diag/loss/s1": wmse / math.exp(logvar) + logvar, "diag/logvar/s1": logvar,
           "diag/loss/s0.1": 2.0, "diag/logvar/s0.1": 0.0}
    got = diagnostics.probe_wmse(rec)
    assert got[1.0] == pytest.approx(wmse, rel=1e-12) and got[0.1] == pytest.approx(2.0)


def test_compare_runs_table_and_order(tmp_path):
    def run(name, wmse_end, act_dec):
        w = tmp_path / name
        w.mkdir()
        recs = []
        for i, kimg in enumerate([0.0, 1.0, 2.0, 3.0]):
            wm = 1.0 + (wmse_end - 1.0) * i / 3  # probe wMSE, logvar 0: loss = wmse
            recs.append({"kimg": kimg, "diag/loss/s1": wm, "diag/logvar/s1": 0.0,
                         "diag/loss/s10": 2 * wm, "diag/logvar/s10": 0.0,
                         "diag/act/s1/enc_8x8_block0": 1.0, "diag/act/s1/enc_8x8_down": 3.0,
                         "diag/act/s1/dec_8x8_block0": act_dec * (1 + i)})
            if kimg:
                recs.append({"kimg": kimg, "loss/loss": 10 * wm, "loss/weighted_mse": wm})
        (w / "stats.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
        return str(w)
    a, b = run("a", 0.5, 1.0), run("b", 0.25, 2.0)
    (tmp_path / "b" / "phema").mkdir()
    (tmp_path / "b" / "phema" / "sweep-0000003-fd_cls.csv").write_text(
        "sigma_rel,kimg,fd_cls,profile_error,path\n0.05,3,9.5,0.01,p1\n0.1,3,7.25,0.02,p2\n")
    (tmp_path / "b" / "eval.jsonl").write_text(json.dumps({"fd_cls": 7.0, "fid500": 40.0}) + "\n")
    (tmp_path / "b" / "phema_ext").mkdir()  # an extension of the sweep's range, merged
    (tmp_path / "b" / "phema_ext" / "sweep-0000003-fd_cls.csv").write_text(
        "sigma_rel,kimg,fd_cls,profile_error,path\n0.02,3,8.0,0.01,p0\n")
    rows = diagnostics.compare_runs([a, b], ["A", "B"], out=str(tmp_path / "c.png"), smooth=2)
    assert rows[1]["sweep"] == {0.02: 8.0, 0.05: 9.5, 0.1: 7.25}
    ra, rb = rows
    # probe wMSE at the end: mean over sigma 1 and 10 = 1.5 x the sigma=1 value
    assert ra["probe_wmse"] == pytest.approx(0.75) and ra["probe_wmse_s1"] == pytest.approx(0.5)
    # training wMSE, trailing mean of the last 2 of (5/6, 2/3, 1/2) for A
    assert ra["train_wmse"] == pytest.approx((2 / 3 + 0.5) / 2)
    assert ra["act_enc"] == (2.0, 2.0) and ra["act_dec"] == (1.0, 4.0) and rb["act_dec_max"] == 8.0
    assert "best_sigma_rel" not in ra and rb["best_sigma_rel"] == 0.1 and rb["eval"]["fid500"] == 40
    # equal at 0 kimg (a stable sort keeps A first), B below A from 1 kimg on
    assert ra["order_probe"] == ["B", "A"] and ra["stable_since_probe"] == 1.0
    assert (tmp_path / "c.png").stat().st_size > 0
    table = diagnostics.format_table(rows)
    assert "| B | 3 |" in table and "7.00" in table and "40.0 (fid500)" in table
