"""Continuous-time consistency models (objectives/scm.py: sCD and sCT of Lu & Song 2024,
arXiv:2410.11081) against closed forms.

Claims tested:
- the EDM network is a TrigFlow network: `F` from the denoiser, `(cos t x_t - D(x_t /
  cos t; sigma_data tan t)) / (sigma_data sin t)`, is minus the raw U-Net output at
  `c_in x = x_t / sigma_data`, `c_noise = ln(sigma_data tan t) / 4` (random weights);
- on Gaussian data, where the PF-ODE and the consistency function are closed-form, the
  objective's tangent `g` (r = 1, unnormalised) is `cos t df/dt` along the teacher's
  ODE (sCD) and along the data's velocity (sCT), and vanishes at the ideal consistency
  function;
- a 1-step student trained on the objective maps noise to the data's mean and variance;
- the sampler: one step is the denoiser at sigma_max, two re-noise at t_mid with each
  seed's own noise; images follow their seeds;
- the teacher autoguided by a frozen guide is `D_g + w (D - D_g)` (random weights);
- bad settings are refused naming the flag, before anything is built; a guide of
  another architecture, in one line before the step compiles;
- a tiny sCD run trains, resumes bitwise, and generates with its own sampler; its
  autoguided twin carries the guide frozen and resumes bitwise too.
(The jvp of the network itself against float64 differences is tests/test_jvp.py's.)
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from edm2_jax import configs, objectives
from edm2_jax.model.networks import precond_coefficients, precond_from_config
from edm2_jax.objectives import scm
from edm2_jax.sampling import sampler as sampling
from edm2_jax.sampling import solvers
from tests.tolerances import EPS32

SD = 0.5   # sigma_data

# ---------------------------------------------------------------------------------------
# The EDM <-> TrigFlow identity


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_edm_network_is_a_trigflow_network_with_F_minus_the_raw_output():
    """On random weights (every layer reaching the output), `F` computed from the
    denoiser equals `-F_raw`, the U-Net's output at `c_in x = x_t / sigma_data` and
    `c_noise = ln(sigma) / 4`; and the preconditioning coefficients are TrigFlow's
    (`c_skip x = cos t x_t`, `c_out = sigma_data sin t`). Float32 error of the
    difference form: its numerator `cos t x_t - D` rounds by ~4 eps |x_t| (D = c_skip x
    + c_out F_raw, x = x_t / cos t), divided by sigma_data sin t; measured 3.3e-5 at
    t = 0.01 (bound 3.8e-4), ~1e-7 elsewhere."""
    from tests.test_jvp import TINY, _variables
    net = precond_from_config(TINY)
    variables = _variables(net)
    t = jnp.array([0.01, 0.5, 1.2, 1.56])
    x_t = 0.5 * jax.random.normal(jax.random.PRNGKey(0), (4, 8, 8, 2))
    labels = jax.nn.one_hot(jnp.arange(4) % 3, 3)
    x, sigma = scm.edm_point(x_t, t, SD)
    F = scm.trigflow_F(net.apply(variables, x, sigma, labels), x_t, t, SD)
    c_skip, c_out, c_in, c_noise = precond_coefficients(sigma, SD, 4)
    b = lambda v: v[:, None, None, None]  # noqa: E731
    np.testing.assert_allclose(c_in * x, x_t / SD, rtol=4 * EPS32, atol=4 * EPS32)
    np.testing.assert_allclose(c_skip * x, b(jnp.cos(t)) * x_t, rtol=8 * EPS32,
                               atol=8 * EPS32)
    np.testing.assert_allclose(c_out, b(SD * jnp.sin(t)), rtol=8 * EPS32)
    raw = net.apply(variables, c_in * x, c_noise, labels, False,
                    method=lambda m, *a: m.unet(*a))
    assert float(jnp.std(raw)) > 0.1   # the output gain reaches the output
    tol = 8 * EPS32 * (b(jnp.cos(t)) * jnp.abs(x_t) / b(SD * jnp.sin(t)) + jnp.abs(raw))
    assert bool(jnp.all(jnp.abs(F + raw) <= tol)), float(jnp.max(jnp.abs(F + raw) / tol))


# ---------------------------------------------------------------------------------------
# Gaussian data: x_0 ~ N(mu, s^2) per channel, independent pixels.

MU = np.array([0.4, -0.3])
S = np.array([0.3, 0.8])


def ideal_denoiser(x, sigma, xp=jnp):
    """E[x_0 | x_0 + sigma n = x]: mu + s^2 / (s^2 + sigma^2) (x - mu)."""
    s2 = xp.reshape(sigma, (-1, 1, 1, 1)) ** 2
    return MU + S**2 / (S**2 + s2) * (x - MU)


def consistency_function(x, sigma, xp=jnp):
    """The PF-ODE's end from (x, sigma) to 0: mu + s / sqrt(s^2 + sigma^2) (x - mu)."""
    s2 = xp.reshape(sigma, (-1, 1, 1, 1)) ** 2
    return MU + S / xp.sqrt(S**2 + s2) * (x - MU)


def _k_and_dk(kind, sigma):
    """`f = mu + k(sigma) (x - mu)`: k and dk/dsigma, float64 `[B, 1, 1, C]`."""
    s2 = sigma.reshape(-1, 1, 1, 1) ** 2
    if kind == "denoiser":
        return S**2 / (S**2 + s2), -2 * S**2 * np.sqrt(s2) / (S**2 + s2) ** 2
    return S / np.sqrt(S**2 + s2), -S * np.sqrt(s2) / (S**2 + s2) ** 1.5


def analytic_g(kind, x_t, t, dxdt):
    """cos t df/dt of `f(x_t, t) = mu + k(sigma) (x_t / cos t - mu)`, sigma = sigma_data
    tan t, along `dx_t/dt`, differentiated by hand (float64):
    df/dt = k'(sigma) sigma_data / cos^2 t (x - mu) + k (dx_t/dt / cos t + x_t sin t / cos^2 t)."""
    c, s = np.cos(t).reshape(-1, 1, 1, 1), np.sin(t).reshape(-1, 1, 1, 1)
    k, dk = _k_and_dk(kind, SD * np.tan(t))
    df = dk * SD / c**2 * (x_t / c - MU) + k * (dxdt / c + x_t * s / c**2)
    return c * df


def _gaussian_draws(n=4096, seed=0):
    """`(x_0, z, t)` float64, t of the proposal (P_mean -1.0, P_std 1.6)."""
    rng = np.random.default_rng(seed)
    x0 = MU + S * rng.standard_normal((n, 2, 2, 2))
    z = SD * rng.standard_normal(x0.shape)
    t = np.arctan(np.exp(-1.0 + 1.6 * rng.standard_normal(n)) / SD)
    return x0, z, t


@pytest.mark.parametrize("mode", ["sCD", "sCT"])
@pytest.mark.parametrize("kind", ["denoiser", "consistency"])
def test_tangent_is_cos_t_df_dt_on_gaussian_data(mode, kind):
    """`scm_tangent` with r = 1 (no normalisation) at a student `f = mu + k(sigma) (x -
    mu)` (the ideal denoiser, or the ideal consistency function) along the teacher's
    PF-ODE `dx_t/dt = (cos t x_t - D*(x_t / cos t)) / sin t` (sCD) or the data's velocity
    `cos t z - sin t x_0` (sCT) equals `cos t df/dt` by hand. Float32 error: `F` and its
    tangent are differences `cos t x_t - D` divided by `sigma_data sin t`, so each term of
    g is off by a few eps (|x_t| + |dx_t/dt| + |mu|) / sin t; bound 16 eps that (measured:
    at most 0.23 of it, over the four cases)."""
    x0, z, t = _gaussian_draws()
    x_t = np.cos(t)[:, None, None, None] * x0 + np.sin(t)[:, None, None, None] * z
    x_t, t = x_t.astype(np.float32), t.astype(np.float32)      # what the objective sees
    student = ideal_denoiser if kind == "denoiser" else consistency_function
    teacher_F = scm.trigflow_fn(ideal_denoiser, SD)
    c64 = np.cos(t.astype(np.float64))[:, None, None, None]
    s64 = np.sin(t.astype(np.float64))[:, None, None, None]
    if mode == "sCD":
        dxdt = SD * teacher_F(jnp.asarray(x_t), jnp.asarray(t))
        denoised = ideal_denoiser(x_t / c64, SD * np.tan(t.astype(np.float64)), np)
        dxdt64 = (c64 * x_t - denoised) / s64
    else:
        x0, z = x0.astype(np.float32), z.astype(np.float32)
        dxdt = scm.data_velocity(jnp.asarray(x0), jnp.asarray(z), jnp.asarray(t))
        dxdt64 = c64 * z - s64 * x0
    _, g = jax.jit(lambda x, t, v: scm.scm_tangent(scm.trigflow_fn(student, SD), x, t, v,
                                                   1.0, SD))(x_t, t, dxdt)
    want = analytic_g(kind, x_t.astype(np.float64), t.astype(np.float64), dxdt64)
    scale = (np.abs(x_t) + np.abs(dxdt64) + np.abs(MU)) / np.sin(t)[:, None, None, None]
    err = np.abs(np.asarray(g, np.float64) - want) / (16 * EPS32 * scale)
    assert err.max() <= 1, err.max()
    if kind == "consistency" and mode == "sCD":
        # The ideal consistency function is constant along the ODE: df/dt = 0.
        assert np.abs(want).max() < 1e-12
    else:
        assert np.abs(want).max() > 0.1   # a tangent of substance, not a zero


def test_tangent_normalisation_warmup_and_loss_by_hand():
    """g / (||g|| + c) per image; r = min(1, iters * batch / (1000 H)); the loss is
    e^{-u} ||F_theta - F- - g||^2 / D + u, whose residual's value is -g."""
    g = jnp.array([[[[3.0, 4.0]]], [[[0.0, 0.0]]]])
    np.testing.assert_allclose(scm.normalize_tangent(g, 0.1)[0].ravel(), [3 / 5.1, 4 / 5.1],
                               rtol=1e-6)
    assert float(jnp.abs(scm.normalize_tangent(g, 0.1)[1]).max()) == 0
    np.testing.assert_allclose(scm.tangent_warmup(jnp.int32(5), 64, 1.28), 0.25, rtol=1e-6)
    assert float(scm.tangent_warmup(jnp.int32(500), 64, 1.28)) == 1.0
    assert float(scm.tangent_warmup(jnp.int32(0), 64, 0.0)) == 1.0
    # A student D(x; sigma) = x / 2 with logvar 0.7, sCT: mse = ||g_n||^2 / D.
    x0 = jnp.full((2, 1, 1, 2), 0.3)
    draws = dict(rnd_normal=jnp.array([0.0, 1.0]), noise_unit=jnp.array(
        [[[[1.0, -0.5]]], [[[0.2, 2.0]]]]))
    student = lambda x, s: (0.5 * x, jnp.full(x.shape[:1], 0.7))  # noqa: E731
    loss, aux = scm.scm_loss_per_image(student, lambda x, s: 0.5 * x, None, x0, r=1.0,
                                       P_mean=-1.0, P_std=1.6, sigma_data=SD, **draws)
    sigma = np.exp(-1.0 + 1.6 * np.array([0.0, 1.0]))
    t = np.arctan(sigma / SD)
    z = SD * np.asarray(draws["noise_unit"])
    x_t = np.cos(t)[:, None, None, None] * 0.3 + np.sin(t)[:, None, None, None] * z
    v = np.cos(t)[:, None, None, None] * z - np.sin(t)[:, None, None, None] * 0.3
    # f = x_t / (2 cos t): df/dt = v / (2 cos t) + x_t sin t / (2 cos^2 t).
    c = np.cos(t)[:, None, None, None]
    g = c * (v / (2 * c) + x_t * np.sin(t)[:, None, None, None] / (2 * c**2))
    gn = g / (np.sqrt((g**2).sum(axis=(1, 2, 3), keepdims=True)) + 0.1)
    mse = (gn**2).mean(axis=(1, 2, 3))
    np.testing.assert_allclose(aux["mse"], mse, rtol=1e-5)
    np.testing.assert_allclose(loss, np.exp(-0.7) * mse + 0.7, rtol=1e-5)
    np.testing.assert_allclose(aux["sigma"], sigma, rtol=1e-6)
    # The RMS norm and the prior weighting 1 / sigma: the same error otherwise.
    loss, aux = scm.scm_loss_per_image(student, lambda x, s: 0.5 * x, None, x0, r=1.0,
                                       P_mean=-1.0, P_std=1.6, sigma_data=SD,
                                       tangent_norm="rms", prior_weighting=True, **draws)
    gn = g / (np.sqrt((g**2).mean(axis=(1, 2, 3), keepdims=True)) + 0.1)
    mse = (gn**2).mean(axis=(1, 2, 3))
    np.testing.assert_allclose(aux["mse"], mse, rtol=1e-5)
    np.testing.assert_allclose(loss, np.exp(-0.7) / sigma * mse + 0.7, rtol=1e-5)


def test_rms_normalisation_is_the_l2_one_with_c_scaled_by_the_root_of_the_size():
    """g / (||g|| / sqrt(D) + c) = sqrt(D) g / (||g|| + c sqrt(D)), D = 4 here."""
    g = jnp.array([[[[1.0, 2.0], [2.0, 4.0]]]])
    np.testing.assert_allclose(scm.normalize_tangent(g, 0.1, "rms"),
                               2 * scm.normalize_tangent(g, 0.2, "l2"), rtol=1e-6)


# ---------------------------------------------------------------------------------------
# A 1-step student trained on Gaussian data


class AffineNet(nn.Module):
    """A stand-in of `Precond`'s call signature: EDM preconditioning around a raw output
    `F_raw = a(c_noise) c_in x + b(c_noise)` per channel, `a`, `b` and the uncertainty
    `logvar` linear in 16 Gaussian bumps of `c_noise` over [-2.5, 1.5] (sigma from
    e^-10 to e^6): the ideal consistency function of Gaussian data has this form."""

    @nn.compact
    def __call__(self, x, sigma, labels=None, train=False, return_logvar=False):
        sigma = jnp.broadcast_to(jnp.asarray(sigma, jnp.float32).reshape(-1), x.shape[:1])
        c_skip, c_out, c_in, c_noise = precond_coefficients(sigma, SD, x.ndim)
        centres = jnp.linspace(-2.5, 1.5, 16)
        h = jnp.exp(-0.5 * jnp.square((c_noise[:, None] - centres) / 0.25))
        ab = nn.Dense(2 * x.shape[-1], kernel_init=nn.initializers.zeros)(h)
        a, b = ab[:, None, None, : x.shape[-1]], ab[:, None, None, x.shape[-1]:]
        D = c_skip * x + c_out * (a * c_in * x + b)
        if not return_logvar:
            return D
        return D, nn.Dense(1, kernel_init=nn.initializers.zeros)(h)[:, 0]


@pytest.mark.parametrize("mode, num_steps, batch, slack", [("sCD", 600, 256, 0.05),
                                                           ("sCT", 1000, 512, 0.1)])
def test_a_one_step_student_maps_noise_to_the_data_mean_and_variance(mode, num_steps,
                                                                      batch, slack):
    """The stand-in student trained from `F_raw = 0` on the objective (the proposal
    P_mean -1.0, P_std 1.6, c = 0.1, r = 1, adaptive weighting), by sCD with the exact
    teacher (the ideal denoiser) or by sCT, until its 1-step sample `D(80 n; 80)` has
    the data's mean and standard deviation per channel (the ideal 1-step student's: mu +
    s n up to s / 80): 4096 samples, within 4 standard errors plus a training slack of
    `slack` s (sCT's velocity is one draw of the ODE's, a noisier target). Measured:
    sCD mean and std within 0.03 s, sCT within 0.08 s."""
    net = AffineNet()
    x = jnp.zeros((1, 1, 1, 2))
    params = net.init(jax.random.PRNGKey(0), x, jnp.ones(1), return_logvar=True)["params"]
    tx = optax.adam(optax.cosine_decay_schedule(1e-2, num_steps))
    opt = tx.init(params)
    teacher = ideal_denoiser if mode == "sCD" else None

    def loss(p, key):
        k1, k2, k3 = jax.random.split(key, 3)
        x0 = MU + S * jax.random.normal(k1, (batch, 1, 1, 2))
        per_image, _ = scm.scm_loss_per_image(
            lambda x, s: net.apply({"params": p}, x, s, return_logvar=True),
            lambda x, s: net.apply({"params": jax.lax.stop_gradient(p)}, x, s),
            teacher, x0, rnd_normal=jax.random.normal(k2, (batch,)),
            noise_unit=jax.random.normal(k3, x0.shape), r=1.0, P_mean=-1.0, P_std=1.6,
            sigma_data=SD)
        return jnp.mean(per_image)

    @jax.jit
    def steps(p, opt, key):
        def body(carry, k):
            p, opt = carry
            u, opt = tx.update(jax.grad(loss)(p, k), opt)
            return (optax.apply_updates(p, u), opt), None
        return jax.lax.scan(body, (p, opt), jax.random.split(key, 100))[0]

    def sample(p):
        n = jax.random.normal(jax.random.PRNGKey(99), (4096, 1, 1, 2))
        return np.asarray(scm.ScmSampler(1)(lambda x, s, l: net.apply({"params": p}, x, s),
                                            n)).reshape(-1, 2)

    before = sample(params)
    for i in range(num_steps // 100):
        params, opt = steps(params, opt, jax.random.PRNGKey(i))
    after = sample(params)
    # The start is far from the data: D(80 n; 80) = c_skip 80 n ~ 0.003 n.
    assert np.all(before.std(0) < 0.01)
    tol = 4 * S / np.sqrt(len(after)) + slack * S
    np.testing.assert_array_less(np.abs(after.mean(0) - MU), tol)
    np.testing.assert_array_less(np.abs(after.std(0) - S), tol)


# ---------------------------------------------------------------------------------------
# The sampler


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_sampler_steps_by_hand_and_images_follow_their_seeds():
    """One step: D(sigma_max n; sigma_max). Two: x_0 = D(80 n; 80), then x = x_0 +
    sigma_data tan(1.1) eps_0, x_0 = D(x; sigma_data tan 1.1). K steps at t_mid (K - k) /
    (K - 1). With the image functions, an image depends on its seed alone."""
    D = lambda x, s, labels: 0.5 * x / (1 + s)  # noqa: E731
    n = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 2, 1))
    eps = jax.random.normal(jax.random.PRNGKey(1), (4, 3, 2, 2, 1))
    one = scm.ScmSampler(1, sigma_max=80.0)(D, n)
    np.testing.assert_allclose(one, 0.5 * 80 * n / 81, rtol=1e-6)
    s1 = SD * np.tan(1.1)
    two = scm.ScmSampler(2)(D, n, churn_noise=lambda k: eps[k])
    x0 = 0.5 * 80 * n / 81
    np.testing.assert_allclose(two, 0.5 * (x0 + s1 * eps[0]) / (1 + s1), rtol=1e-5)
    np.testing.assert_allclose(scm.ScmSampler(4).times()[1:], [1.1, 1.1 * 2 / 3, 1.1 / 3])
    assert scm.ScmSampler(4).sigmas()[0] == np.float32(80) and scm.ScmSampler(4).sigmas()[-1] == 0
    assert scm.ScmSampler(2).stochastic and not scm.ScmSampler(1).stochastic
    with pytest.raises(ValueError, match="churn_noise"):
        scm.ScmSampler(2)(D, n)
    with pytest.raises(ValueError, match="t_mid"):
        scm.ScmSampler(2, t_mid=1.6)
    assert solvers.SAMPLERS["scm"] is scm.ScmSampler
    assert solvers.from_settings(scm.ScmSampler(3).settings()) == scm.ScmSampler(3)
    # Seeds: the image functions draw each seed's own noise for every step.
    from tests.test_jvp import TINY, _variables
    net = precond_from_config(dict(TINY, label_dim=0))
    variables = _variables(net)
    a = np.asarray(sampling.sample_images(net, variables, np.arange(5), raw=True,
                                          sampler=scm.ScmSampler(3)))
    b = np.asarray(sampling.sample_images(net, variables, np.array([3, 1]), raw=True,
                                          sampler=scm.ScmSampler(3)))
    np.testing.assert_allclose(a[[3, 1]], b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[0], a[1])


# ---------------------------------------------------------------------------------------
# The objective: settings, refusals, cost


def _config(**distill):
    from tests.test_train import tiny_config
    c = tiny_config("/nowhere", objective="scm")
    c.distill.update(distill)
    return c


def test_objective_is_registered_with_its_section_sampler_and_cost():
    c = _config(teacher="runs/t", steps=2)
    obj = objectives.check_config(c)
    assert isinstance(obj, scm.ContinuousConsistency)
    assert obj.sampler(32) == scm.ScmSampler(2, sigma_max=80.0, t_mid=1.1, sigma_data=0.5)
    assert obj.start().path == "runs/t" and obj.start().role == "teacher"
    assert set(obj.init_state({"w": jnp.ones(2)})) == {"teacher", "iters"}
    assert obj.flops_per_image(1.0) == 6
    c.distill.update(guidance=1.5)
    assert objectives.check_config(c).flops_per_image(1.0) == 7
    sct = objectives.check_config(_config(training=True))
    assert sct.start() is None and set(sct.init_state({})) == {"iters"}
    assert sct.flops_per_image(1.0) == 5
    assert objectives.check_config(_config(training=True, teacher="n")).start().path == "n"
    entries, _ = sct.update({"iters": jnp.int32(4)}, {}, jnp.float32(0))
    assert int(entries["iters"]) == 5
    # A record of the section is sampled as trained.
    meta = objectives.record(c)
    assert objectives.from_metadata(meta).sampler() == obj.sampler()


@pytest.mark.parametrize("name, value", [
    ("steps", 0), ("P_std", 0.0), ("P_mean", float("nan")), ("tangent_c", 0.0),
    ("warmup_kimg", -1.0), ("t_mid", 1.6), ("t_mid", 0.0), ("sigma_max", 0.0),
    ("guidance", 0.5), ("tangent_norm", "l1")])
def test_bad_settings_are_refused_naming_the_flag(name, value):
    """One ValueError whose message starts with the flag, from `configs.validate`
    (before anything is built or compiled)."""
    with pytest.raises(ValueError, match=rf"^--config\.distill\.{name}="):
        configs.validate(_config(**{name: value}))


@pytest.mark.parametrize("name, value", [("steps", 1.5), ("steps", True),
                                         ("training", "yes"), ("teacher", 3),
                                         ("prior_weighting", 1), ("guide", 3),
                                         ("guide_ema", 0.1)])
def test_mistyped_settings_of_a_config_json_are_refused_naming_the_flag(name, value):
    """A config.json's section (a dict: no ConfigDict type check) is checked too."""
    c = _config().to_dict()
    c["distill"][name] = value
    with pytest.raises(ValueError, match=rf"^--config\.distill\.{name}="):
        objectives.check_config(c)


def test_the_scm_configs_validate():
    """configs/distill.py:scm, :scm-tiny, :sct and :scm-<preset> for every release
    preset are valid 2-step sCM configs: sCT only for 'sct'; the presets with the paper's
    proposal (img64: -1.0, 1.6; img512: -0.8, 1.6), c = 0.1, warmup 10k steps of 2048
    images, the learning rate 1/100 of the teacher's; 'scm' and 'sct' at 1/10 of the
    teacher's rate, 'scm' for 192 kimg decaying from 48 kimg (t_ref 750 batches of 64),
    'sct' constant for 48 kimg, the RMS-normalised tangent and the 1 / sigma weight,
    sampled through t_mid 1.45 ('scm') and 1.1 ('sct')."""
    from edm2_jax.model import presets
    from tests.test_train import _config_file
    for variant in ["scm", "scm-tiny", "sct"] + [f"scm-{p}" for p in presets.NETWORK_PRESETS]:
        c = _config_file("distill", variant)
        c.distill.teacher = "teacher"
        configs.validate(c)
        obj = objectives.from_config(c)
        assert obj.name == "scm" and c.distill.steps == 2, variant
        assert obj.training == (variant == "sct"), variant
        if variant in ("scm", "sct"):  # the teacher's 0.01 / 10 (configs/fashion_mnist.py)
            teacher = _config_file("fashion_mnist", "default").optim.ref_lr
            assert c.optim.ref_lr == pytest.approx(teacher / 10, rel=1e-9), variant
            length = (750, 192) if variant == "scm" else (0, 48)
            assert (c.optim.t_ref, c.total_kimg) == length, variant
            assert c.batch_size == 64, variant
            assert (c.distill.tangent_norm, c.distill.prior_weighting) == ("rms", True)
            # The run's own sampler: sCD through t_mid 1.45 (results entry scm-t-mid),
            # sCT through the paper's 1.1.
            t_mid = 1.45 if variant == "scm" else 1.1
            assert obj.sampler() == scm.ScmSampler(2, sigma_max=80.0, t_mid=t_mid,
                                                   sigma_data=0.5), variant
        preset = variant[4:]
        if preset in presets.NETWORK_PRESETS:
            want = scm.PROPOSALS["img512" if preset.startswith("img512") else "img64"]
            assert (c.distill.P_mean, c.distill.P_std) == want, variant
            assert c.distill.warmup_kimg == 20480 and c.distill.tangent_c == 0.1
            ref_lr = presets.TRAINING_PRESETS[preset]["ref_lr"]
            assert c.optim.ref_lr == pytest.approx(ref_lr / 100, rel=1e-9), variant


@pytest.mark.slow
@pytest.mark.ci  # two tiny networks traced and run: ~10 s on 2 cores
def test_autoguided_teacher_is_the_guide_plus_w_times_the_difference():
    """With a guide, `guided_teacher` is `D_g + w (D - D_g)` of the two networks'
    denoisers at the same labels (not the teacher's unconditional slot), float32 and
    stopped; w = 1 is the teacher alone."""
    from tests.test_jvp import TINY, _variables
    net = precond_from_config(TINY)
    teacher, guide = _variables(net, seed=0), _variables(net, seed=1, gain=0.5)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 8, 8, 2)), jnp.float32)
    sigma = jnp.asarray([0.1, 1.0, 20.0], jnp.float32)
    labels = jax.nn.one_hot(jnp.asarray([0, 2, 1]), 3)
    d_t = np.asarray(net.apply(teacher, x, sigma, labels), np.float64)
    d_g = np.asarray(net.apply(guide, x, sigma, labels), np.float64)
    got = scm.guided_teacher(net, teacher, labels, 1.5, guide=guide)(x, sigma)
    assert got.dtype == jnp.float32
    # Two float32 network outputs combined: a few ulps of their magnitude.
    np.testing.assert_allclose(np.asarray(got), d_g + 1.5 * (d_t - d_g), rtol=0,
                               atol=8 * EPS32 * (np.abs(d_t).max() + np.abs(d_g).max()))
    assert np.abs(d_t - d_g).max() > 0.1  # the guide is another network
    cfg = np.asarray(scm.guided_teacher(net, teacher, labels, 1.5)(x, sigma))
    assert np.abs(cfg - np.asarray(got)).max() > 0.01
    np.testing.assert_array_equal(
        np.asarray(scm.guided_teacher(net, teacher, labels, 1.0, guide=guide)(x, sigma)),
        np.asarray(net.apply(teacher, x, sigma, labels)))
    grad = jax.grad(lambda v: jnp.sum(scm.guided_teacher(net, v, labels, 1.5,
                                                         guide=guide)(x, sigma)))(teacher)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grad))


def test_a_guide_is_a_frozen_network_of_the_sCD_run():
    """`distill.guide` names the objective's one frozen network (`'guide'`, its flag
    and EMA), costs the guided pass, and shows in the run's description; bad guide
    settings are refused naming the flag."""
    c = _config(teacher="runs/t", guide="runs/t/snapshots/250", guide_ema="0.050",
                guidance=1.5)
    c.data.use_labels = False  # autoguidance needs no unconditional slot
    obj = objectives.check_config(c)
    assert obj.frozen_networks() == {"guide": objectives.StartNetwork(
        "runs/t/snapshots/250", "0.050", "guide", "--config.distill.guide")}
    assert obj.flops_per_image(1.0) == 7
    assert "autoguided by runs/t/snapshots/250 at 1.5" in obj.describe()
    assert objectives.check_config(_config(teacher="runs/t")).frozen_networks() == {}
    for name, bad, what in [("guide", dict(guide="g"), "guidance > 1"),
                            ("guide", dict(guide="g", training=True), "sCT")]:
        with pytest.raises(ValueError, match=rf"^--config\.distill\.{name}=.*{what}"):
            configs.validate(_config(**bad))


def test_guidance_needs_a_teacher_and_labels():
    with pytest.raises(ValueError, match="^--config.distill.guidance=.*sCT"):
        configs.validate(_config(training=True, guidance=2.0))
    c = _config(guidance=2.0)
    c.data.use_labels = False
    with pytest.raises(ValueError, match="^--config.distill.guidance=.*conditional"):
        configs.validate(c)


# ---------------------------------------------------------------------------------------
# A tiny sCD run: trains, resumes bitwise, generates with its own sampler


@pytest.fixture(scope="module")
def scm_runs(tmp_path_factory, xla_cache):
    """A random teacher (every gain 0.7: its output reaches the images) saved as a
    network checkpoint, and two tiny sCD runs of it on 8x8 grey images with 2 classes:
    4 steps in one go, and the same stopped after 2 and resumed; the tangent warmed up
    over the first 2 steps."""
    from edm2_jax.model.networks import precond_from_config
    from edm2_jax.objectives import distill
    from edm2_jax.run import network_dir
    from edm2_jax.training import loop
    from tests.test_jvp import _variables
    from tests.test_train import make_image_folder, tiny_config
    root = tmp_path_factory.mktemp("scm")
    data = make_image_folder(root / "data", n=16, resolution=8)
    cfg = dict(tiny_config(data).network.to_dict(), img_resolution=8, img_channels=1,
               label_dim=2, dtype="float32")
    net = precond_from_config(cfg)
    teacher = network_dir.save_network(str(root / "teacher"), _variables(net),
                                       distill.network_config(net))
    over = {"objective": "scm", "distill.teacher": teacher, "distill.steps": 2,
            "distill.warmup_kimg": 0.016, "optim.ref_lr": 0.005, "optim.t_ref": 0}
    full, half = root / "full", root / "half"
    r_full = loop.train_and_evaluate(tiny_config(data, **over), str(full))
    loop.train_and_evaluate(tiny_config(data, total_kimg=0.016, **over), str(half))
    r_half = loop.train_and_evaluate(tiny_config(data, **over), str(half))
    return dict(teacher=teacher, full=full, half=half, r_full=r_full, r_half=r_half,
                data=data, over=over, net_config=cfg)


@pytest.fixture(scope="module")
def guided_runs(scm_runs, tmp_path_factory):
    """The tiny sCD runs' teacher autoguided at w = 2 by another random network of its
    architecture: 4 steps in one go, and the same stopped after 2 and resumed."""
    from edm2_jax.model.networks import precond_from_config
    from edm2_jax.objectives import distill
    from edm2_jax.run import network_dir
    from edm2_jax.training import loop
    from tests.test_jvp import _variables
    from tests.test_train import tiny_config
    root = tmp_path_factory.mktemp("scm-guided")
    cfg = scm_runs["net_config"]
    net = precond_from_config(cfg)
    guide = network_dir.save_network(str(root / "guide"), _variables(net, seed=5, gain=0.5),
                                     distill.network_config(net))
    over = dict(scm_runs["over"], **{"distill.guide": guide, "distill.guidance": 2.0})
    full, half = root / "full", root / "half"
    r_full = loop.train_and_evaluate(tiny_config(scm_runs["data"], **over), str(full))
    loop.train_and_evaluate(tiny_config(scm_runs["data"], total_kimg=0.016, **over), str(half))
    r_half = loop.train_and_evaluate(tiny_config(scm_runs["data"], **over), str(half))
    return dict(guide=guide, full=full, half=half, r_full=r_full, r_half=r_half, root=root)


# Slow (~50 s on 2 busy cores): the two tiny runs, built once for these tests.
@pytest.mark.slow
@pytest.mark.ci
def test_a_tiny_scd_run_trains_and_resumes_bitwise(scm_runs):
    """The run stopped after 2 steps and resumed ends on the arrays of the run that never
    stopped, bit for bit (the warmup counter 'iters' included: 4); the teacher rides
    along unchanged, the student moved; the loss is finite and the tangent warmed up."""
    from edm2_jax.run import network_dir
    from tests.test_train import _restore
    r = scm_runs["r_full"]
    assert r["finished"] and scm_runs["r_half"]["finished"]
    assert np.isfinite(r["loss/loss"]) and r["loss/tangent_warmup"] == 1.0
    (sa, a), (sb, b) = _restore(scm_runs["full"]), _restore(scm_runs["half"])
    assert sa == sb == 4 and int(a["iters"]) == 4
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(x, y)
    _, teacher, _ = network_dir.load_network(scm_runs["teacher"])
    for x, y in zip(jax.tree.leaves(a["teacher"]), jax.tree.leaves(teacher["params"]),
                    strict=True):
        assert np.array_equal(x, y)
    moved = [np.max(np.abs(x - y)) for x, y in zip(jax.tree.leaves(a["params"]),
                                                   jax.tree.leaves(a["teacher"]))]
    assert max(moved) > 0


@pytest.mark.slow
@pytest.mark.ci
def test_a_student_is_sampled_with_its_own_sampler_and_images_follow_seeds(scm_runs):
    """`nets.net_sampler` of the run is its 2-step sCM sampler (no flag needed), and an
    image depends on its seed alone."""
    from edm2_jax import nets
    run = str(scm_runs["full"])
    sampler = nets.net_sampler(run)
    assert sampler == scm.ScmSampler(2, sigma_max=80.0, t_mid=1.1, sigma_data=0.5)
    assert nets.net_sampler(scm_runs["teacher"]) == solvers.Heun(32)
    net, variables, _ = nets.load_net(run)
    a = np.asarray(sampling.sample_images(net, variables, np.arange(5), sampler=sampler))
    b = np.asarray(sampling.sample_images(net, variables, np.array([4, 1]), sampler=sampler))
    np.testing.assert_array_equal(a[[4, 1]], b)
    assert a.std() > 0


@pytest.mark.slow
@pytest.mark.ci
def test_an_autoguided_scd_run_carries_its_guide_frozen_and_resumes_bitwise(
        scm_runs, guided_runs):
    """The guide rides in the train state as `'guide'`, the guide network's arrays bit
    for bit, untouched by the steps; the run stopped after 2 steps and resumed ends on
    the arrays of the one that never stopped; the guide changes what the student
    learns (another student than the unguided run's)."""
    from edm2_jax.run import network_dir
    from tests.test_train import _restore
    r = guided_runs["r_full"]
    assert r["finished"] and guided_runs["r_half"]["finished"] and np.isfinite(r["loss/loss"])
    (sa, a), (sb, b) = _restore(guided_runs["full"]), _restore(guided_runs["half"])
    assert sa == sb == 4
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(x, y)
    _, guide, _ = network_dir.load_network(guided_runs["guide"])
    for col in ("params", "buffers"):
        for x, y in zip(jax.tree.leaves(a["guide"][col]), jax.tree.leaves(guide[col]),
                        strict=True):
            assert np.array_equal(x, y)
    _, unguided = _restore(scm_runs["full"])
    assert max(np.max(np.abs(x - y)) for x, y in zip(jax.tree.leaves(a["params"]),
                                                      jax.tree.leaves(unguided["params"]))) > 0


@pytest.mark.slow
@pytest.mark.ci
def test_a_guide_of_another_architecture_is_refused_before_the_step_compiles(
        scm_runs, guided_runs, capsys):
    """A guide whose arrays are not of the teacher's shapes: one ValueError line naming
    the flag, the path and the first differing array, raised before the train state is
    built (no checkpoint written)."""
    from edm2_jax.model.networks import precond_from_config
    from edm2_jax.objectives import distill
    from edm2_jax.run import network_dir
    from edm2_jax.training import loop
    from tests.test_jvp import _variables
    from tests.test_train import tiny_config
    cfg = scm_runs["net_config"]
    net = precond_from_config(dict(cfg, model_channels=2 * cfg["model_channels"]))
    root = guided_runs["root"]
    wide = network_dir.save_network(str(root / "wide"), _variables(net),
                                    distill.network_config(net))
    over = dict(scm_runs["over"], **{"distill.guide": wide, "distill.guidance": 2.0})
    with pytest.raises(ValueError) as e:
        loop.train_and_evaluate(tiny_config(scm_runs["data"], **over), str(root / "bad"))
    msg = str(e.value)
    assert msg.startswith(f"--config.distill.guide={wide}: ") and "\n" not in msg
    assert "not of the architecture this run trains (params/" in msg
    assert "Compiling the training step" not in capsys.readouterr().out
    assert not (root / "bad" / "checkpoints").exists() or not any(
        (root / "bad" / "checkpoints").iterdir())
