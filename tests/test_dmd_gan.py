"""DMD2's GAN head (objectives/gan.py) in the distribution-matching objective
(objectives/dmd.py) against closed forms.

Claims tested:
- the non-saturating losses' gradients on a linear discriminator `f(x) = w.x + b` are
  the closed forms `d/dx softplus(-f) = -w sigmoid(-f)`, `d/dw [softplus(-f(x_r)) +
  softplus(f(x_f))] = -x_r sigmoid(-f(x_r)) + x_f sigmoid(f(x_f))`; a classifier that
  cannot tell (`f = 0`) has loss `2 ln 2`;
- on the U-Net, each term reaches its own players only: the classifier's loss the head
  and the fake denoiser's encoder (not its decoder, not the generator's images), the
  generator's loss the generator's images alone;
- on Gaussian data, a linear 1-step generator trained on DMD's gradient and the GAN terms
  (a quadratic classifier of noisy samples learned online, in the same gradient) reaches
  the data's mean and covariance; on the GAN terms alone it comes near them;
- the head reads the last encoder block (its name and width from the weights alone);
- the head off is DMD as it was: its draws, state and step (bit for bit); the head on
  trains the head and the fake denoiser on every step and the generator on one step of
  `dfake_gen_update_ratio`, held exactly on the others, the teacher unchanged;
- the settings are checked naming their flag, and the configs of the head validate.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from edm2_jax import configs, objectives
from edm2_jax.model.networks import init_variables, precond_from_config
from edm2_jax.objectives import dmd, gan
from tests.test_dmd import MU, SIGMA, gaussian_denoiser

# ---------------------------------------------------------------------------------------
# By hand: a linear discriminator


def test_gan_gradients_on_a_linear_discriminator_by_hand():
    w, b = jnp.array([1.0, -2.0, 0.5]), 0.25
    def f(x):
        return x @ w + b
    x_r = jnp.array([[0.3, -0.1, 2.0], [-1.0, 0.4, 0.0]])     # "real"
    x_f = jnp.array([[1.0, 1.0, -1.0], [0.2, 0.0, 0.6]])      # "generated"
    sig = jax.nn.sigmoid
    # Generator: d/dx softplus(-f(x)) = -w sigmoid(-f(x)), per image.
    g = jax.grad(lambda x: jnp.sum(gan.generator_loss(f(x))))(x_f)
    np.testing.assert_allclose(g, -w[None] * sig(-f(x_f))[:, None], rtol=1e-6)
    # By hand for the first image: f = 1 - 2 - 0.5 + 0.25 = -1.25, sigmoid(1.25) = 0.77730.
    np.testing.assert_allclose(g[0], -0.777300 * np.array([1.0, -2.0, 0.5]), rtol=1e-5)
    # Classifier, in (w, b): -x_r sigmoid(-f(x_r)) + x_f sigmoid(f(x_f)), summed.
    def cls(wb):
        return jnp.sum(gan.classifier_loss(x_r @ wb[0] + wb[1], x_f @ wb[0] + wb[1]))
    gw, gb = jax.grad(cls)((w, jnp.float32(b)))
    np.testing.assert_allclose(gw, -sig(-f(x_r)) @ x_r + sig(f(x_f)) @ x_f, rtol=1e-6)
    np.testing.assert_allclose(gb, jnp.sum(sig(f(x_f)) - sig(-f(x_r))), rtol=1e-6)
    # At f = 0 on both: loss 2 ln 2 per image; the generator's gradient is -w / 2.
    zero = jnp.zeros(4)
    np.testing.assert_allclose(gan.classifier_loss(zero, zero), 2 * math.log(2), rtol=1e-6)
    g0 = jax.grad(lambda x: jnp.sum(gan.generator_loss(x @ w)))(jnp.zeros((1, 3)))
    np.testing.assert_allclose(g0[0], -w / 2, rtol=1e-6)


def test_gan_sigma_spans_the_whole_edm_schedule():
    # u = Phi(z): z = 0 is the rho-warped midpoint, z -> -inf sigma_max, +inf sigma_min.
    t = np.asarray(gan.gan_sigma(jnp.array([0.0, -40.0, 40.0])))
    np.testing.assert_allclose(t[0], ((80 ** (1 / 7) + 0.002 ** (1 / 7)) / 2) ** 7, rtol=1e-5)
    np.testing.assert_allclose(t[1:], [80.0, 0.002], rtol=1e-5)
    # `gan_sigma_max` moves the top of the schedule alone.
    t = np.asarray(gan.gan_sigma(jnp.array([0.0, -40.0, 40.0]), sigma_max=2.5))
    np.testing.assert_allclose(t, [((2.5 ** (1 / 7) + 0.002 ** (1 / 7)) / 2) ** 7, 2.5, 0.002],
                               rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Gaussian data: a linear generator with the GAN terms


def _train_linear_generator_with_gan(dm: bool, steps: int = 3000, lr: float = 0.02,
                                     batch: int = 1024, seed: int = 0) -> dict:
    """A linear generator `x0 = m + B z` of 2D points trained with Adam on DMD's objective
    with the exact fake denoiser (if `dm`) plus the GAN terms of weight 1: a quadratic
    classifier `f(x; t) = c_in x^T A c_in x + b^T c_in x + c` (`c_in = (t^2 +
    1/4)^-1/2`) of noisy points at `gan.gan_sigma`'s levels, learned online by
    `classifier_loss` on data samples against the generator's, in the same gradient."""
    theta = {"m": jnp.zeros(2), "B": jnp.eye(2),
             "d": {"A": jnp.zeros((2, 2)), "b": jnp.zeros(2), "c": jnp.zeros(())}}
    tx = optax.adam(optax.cosine_decay_schedule(lr, steps))
    real = gaussian_denoiser(MU, SIGMA)
    chol = np.linalg.cholesky(SIGMA)

    def f(d, x, t):
        x = x / jnp.sqrt(t**2 + 0.25)[:, None]
        return jnp.einsum("bi,ij,bj->b", x, d["A"], x) + x @ d["b"] + d["c"]

    def loss(theta, key):
        k = jax.random.split(key, 10)
        x0 = theta["m"] + jax.random.normal(k[0], (batch, 2)) @ theta["B"].T
        y = jax.lax.stop_gradient(x0)
        total = 0.0
        if dm:
            t = dmd.dm_sigma(jax.random.normal(k[1], (batch,)))
            x_t = y + t[:, None] * jax.random.normal(k[2], y.shape)
            th = jax.lax.stop_gradient(theta)
            fake = gaussian_denoiser(th["m"], th["B"] @ th["B"].T)(x_t, t)
            total = jnp.mean(jnp.sum(dmd.dm_loss(x0, dmd.dm_gradient(y, real(x_t, t), fake)),
                                     -1))
        y_r = MU + jax.random.normal(k[3], (batch, 2)) @ chol.T
        t_r, t_c, t_g = (gan.gan_sigma(jax.random.normal(k[4 + i], (batch,))) for i in range(3))
        n_r, n_c, n_g = (jax.random.normal(k[7 + i], (batch, 2)) for i in range(3))
        d = theta["d"]
        cls = gan.classifier_loss(f(d, y_r + t_r[:, None] * n_r, t_r),
                                  f(d, y + t_c[:, None] * n_c, t_c))
        gen = gan.generator_loss(f(jax.lax.stop_gradient(d), x0 + t_g[:, None] * n_g, t_g))
        return total + 2 * jnp.mean(gen + cls)     # N = 2 elements per point

    @jax.jit
    def step(theta, opt, key):
        u, opt = tx.update(jax.grad(loss)(theta, key), opt)
        return optax.apply_updates(theta, u), opt

    opt = tx.init(theta)
    for n in range(steps):
        theta, opt = step(theta, opt, jax.random.fold_in(jax.random.PRNGKey(seed), n))
    return theta


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_linear_generator_with_the_gan_terms_reaches_the_data_mean_and_covariance():
    """With DMD's gradient the GAN terms keep its fixed point: the generator lands on
    N(mu, Sigma) to DMD's own precision (tests/test_dmd.py); on the GAN terms alone,
    from N(0, I), it comes within a few hundredths of it."""
    theta = _train_linear_generator_with_gan(dm=True)
    np.testing.assert_allclose(theta["m"], MU, atol=3e-3)
    np.testing.assert_allclose(theta["B"] @ theta["B"].T, SIGMA, atol=5e-3)
    theta = _train_linear_generator_with_gan(dm=False)
    np.testing.assert_allclose(theta["m"], MU, atol=0.06)
    np.testing.assert_allclose(theta["B"] @ theta["B"].T, SIGMA, atol=0.12)


# ---------------------------------------------------------------------------------------
# On the U-Net

NET = dict(img_resolution=8, img_channels=1, label_dim=2, model_channels=8,
           channel_mult=(1, 2), num_blocks=1, attn_resolutions=(), logvar_channels=8)


def test_the_bottleneck_is_the_last_encoder_block():
    """Name and width from the weights alone: the lowest resolution's last block."""
    for kw, want in ((NET, ("enc_4x4_block0", 16)),
                     (dict(NET, num_blocks=0), ("enc_4x4_down", 8)),
                     (dict(NET, channel_mult=(1,), num_blocks=2), ("enc_8x8_block1", 8)),
                     (dict(NET, img_resolution=64, img_channels=3, label_dim=0,
                           model_channels=192, channel_mult=(1, 2, 3, 4), num_blocks=3),
                      ("enc_8x8_block2", 768))):                       # img64-s
        shapes = jax.eval_shape(lambda k, kw=kw: init_variables(precond_from_config(kw), k),
                                jax.random.PRNGKey(0))
        assert gan.bottleneck(shapes["params"]["unet"]) == want, kw


@pytest.fixture(scope="module")
def tiny_net():
    """The network of `NET` with N(0, 1) weights and gains 0.7 (filled from numpy, as
    `test_train.random_state`: flax's own init runs op by op)."""
    net = precond_from_config(NET)
    shapes = jax.eval_shape(lambda k: init_variables(net, k), jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)

    def fill(path, leaf):
        if str(path[-1].key).endswith("gain"):
            return np.float32(0.7)
        return rng.standard_normal(leaf.shape).astype(np.float32)
    return net, jax.tree_util.tree_map_with_path(fill, dict(shapes))


def test_features_are_the_last_encoder_blocks_output(tiny_net):
    net, v = tiny_net
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 8, 8, 1))
    labels = jnp.eye(2)[jnp.array([0, 1, 1])]
    head = jax.eval_shape(lambda k: gan.init_head(v["params"]["unet"], k),
                          jax.random.PRNGKey(2))

    def run(v, head, x, labels):
        e = gan.features(net, v["params"], v["buffers"], x, jnp.full((3,), 1.5), labels)
        return e, gan.Head().apply({"params": head}, e)
    e, logits = jax.eval_shape(run, v, head, x, labels)
    assert (e.shape, e.dtype) == ((3, 4, 4, 16), jnp.float32)
    assert (logits.shape, logits.dtype) == ((3,), jnp.float32)


# Slow (~40 s on 2 cores): a U-Net step compiled; in the end-to-end ci stage.
@pytest.mark.slow
@pytest.mark.ci
def test_each_gan_term_reaches_its_own_players_only(tiny_net):
    """`loss_cls` trains the head and the fake denoiser's encoder, never its decoder nor
    the generator's images; `loss_gen` reaches the generator's images alone."""
    net, v = tiny_net
    fake, buffers = v["params"], v["buffers"]
    head = gan.init_head(fake["unet"], jax.random.PRNGKey(2))
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    B = 4
    x0 = jax.random.normal(keys[0], (B, 8, 8, 1))
    images = jax.random.uniform(keys[1], (B, 8, 8, 1), minval=-1, maxval=1)
    labels = jnp.eye(2)[jnp.arange(B) % 2]
    draws = dict(rnd_normal=jax.random.normal(keys[2], (B, 3)),
                 noise_unit=jax.random.normal(keys[3], (B, 3, 8, 8, 1)))

    @jax.jit
    def gradients(fake, head, x0):   # of sum(loss_gen) and of sum(loss_cls), one compile
        def f(fake, head, x0):
            gen, cls, _ = gan.gan_losses(net, buffers, fake, head, x0, images, labels,
                                         dropout_rng=None, **draws)
            return jnp.sum(gen), jnp.sum(cls)
        _, pullback = jax.vjp(f, fake, head, x0)
        one, zero = jnp.float32(1), jnp.float32(0)
        return pullback((one, zero)), pullback((zero, one))

    grads = dict(zip(("gen", "cls"), gradients(fake, head, x0)))

    def norms(tree):
        return {jax.tree_util.keystr(k): float(jnp.max(jnp.abs(x)))
                for k, x in jax.tree_util.tree_leaves_with_path(tree)}

    g_fake, g_head, g_x0 = grads["cls"]
    assert float(jnp.max(jnp.abs(g_x0))) == 0.0
    assert all(n > 0 for n in norms(g_head).values())
    unet = norms(g_fake["unet"])
    enc = {k: n for k, n in unet.items() if k.startswith("['enc_")}
    dec = {k: n for k, n in unet.items() if k.startswith(("['dec_", "['out_"))}
    assert enc and max(enc.values()) > 0
    assert dec and max(dec.values()) == 0.0, dec      # the decoder and output layer
    g_fake, g_head, g_x0 = grads["gen"]
    assert max(norms(g_fake).values()) == 0.0 and max(norms(g_head).values()) == 0.0
    assert float(jnp.max(jnp.abs(g_x0))) > 0


# Slow (~40 s on 2 cores): a U-Net step compiled; in the end-to-end ci stage.
@pytest.mark.slow
@pytest.mark.ci
def test_a_head_on_the_teachers_features_leaves_the_fake_denoiser_to_its_own_loss(tiny_net):
    """With `gan_features='teacher'` the fake denoiser's gradient is the head-off one
    (its denoising loss alone), exactly; the head's is not zero, the teacher's is never
    taken (a frozen entry)."""
    net, v = tiny_net
    B = 4
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    params = v["params"]
    fake = jax.tree.map(lambda x: x * 1.01, params)     # a fake unlike the teacher
    extras = {"teacher": params, "fake": fake,
              "gan_head": gan.init_head(params["unet"], jax.random.PRNGKey(2))}
    labels = jnp.eye(2)[jnp.arange(B) % 2]
    images = jax.random.uniform(keys[0], (B, 8, 8, 1), minval=-1, maxval=1)
    draws = dict(rnd_normal=jax.random.normal(keys[1], (B, 6)),
                 noise_unit=jax.random.normal(keys[2], (B, 6, 8, 8, 1)))
    grid = dict(steps=1, teacher_steps=8, sigma_min=0.002, sigma_max=2.5, rho=7.0)

    @functools.partial(jax.jit, static_argnums=0)
    def grads(gan_weights, trained):
        def f(trained):
            loss, _ = dmd.dmd_objective(params, v["buffers"], net, {**extras, **trained},
                                        labels, images=images, gan_weights=gan_weights,
                                        gan_features="teacher", dropout_rng=None,
                                        **draws, **grid)
            return loss
        return jax.grad(f)(trained)

    trained = {"fake": fake, "gan_head": extras["gan_head"]}
    on, off = grads((0.03, 0.01), trained), grads(None, trained)
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), on["fake"], off["fake"])
    assert all(jax.tree.leaves(same))
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(on["gan_head"])) > 0


# ---------------------------------------------------------------------------------------
# The objective and its settings


def dmd_config(**distill):
    return {"objective": "dmd", "seed": 0,
            "distill": {"teacher": "t", "steps": 1, "teacher_steps": 8, "sigma_min": 0.002,
                        "sigma_max": 2.5, "rho": 7.0, "fake_lr": 0.02, **distill}}


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_the_head_adds_its_entries_draws_and_generator_steps(tiny_net):
    _, v = tiny_net
    off = objectives.from_config(dmd_config())
    assert off.trained == ("fake",) and off.trains_weights(jnp.int32(3)) is True
    assert set(jax.eval_shape(off.init_state, v["params"])) == {"teacher", "fake", "fake_opt"}
    assert off.draws(tuple(jax.random.split(jax.random.PRNGKey(0))), (2, 8, 8, 1))[
        "noise_unit"].shape == (2, 3, 8, 8, 1)
    assert off.flops_per_image(1.0) == 8
    assert objectives.from_config({"objective": "edm2"}).trains_weights(jnp.int32(1)) is True
    on = objectives.from_config(dmd_config(gan=True))
    assert on.trained == ("fake", "gan_head")
    state = jax.eval_shape(on.init_state, v["params"])
    assert set(state) == {"teacher", "fake", "fake_opt", "gan_head", "gan_head_opt"}
    assert state["gan_head"]["Conv_0"]["kernel"].shape == (4, 4, 16, 16)
    # Sharded by the one rule, as the fake denoiser: split over 'fsdp' where it divides.
    from edm2_jax.training.sharding import FSDP, state_spec
    specs = jax.tree_util.tree_map_with_path(lambda p, x: state_spec(p, x.shape, 2), state)
    assert FSDP in tuple(specs["gan_head"]["Conv_0"]["kernel"])
    assert FSDP in tuple(specs["gan_head_opt"][1].mu["Conv_0"]["kernel"])
    assert on.draws(tuple(jax.random.split(jax.random.PRNGKey(0))), (2, 8, 8, 1))[
        "rnd_normal"].shape == (2, 6)
    # DMD2's ratio 5: the generator on steps 0, 5, 10, ...; ratio 1: every step.
    assert [bool(on.trains_weights(jnp.int32(s))) for s in range(7)] == [
        True, False, False, False, False, True, False]
    ratio1 = objectives.from_config(dmd_config(gan=True, dfake_gen_update_ratio=1))
    assert ratio1.trains_weights(jnp.int32(3)) is True
    assert on.flops_per_image(1.0) == pytest.approx(8 + 9 * gan.ENCODER_SHARE)


@pytest.mark.parametrize("flag, value", [
    ("gan", "yes"), ("gen_cls_loss_weight", -1e-3), ("guidance_cls_loss_weight", "1e-2"),
    ("dfake_gen_update_ratio", 0), ("dfake_gen_update_ratio", 2.0), ("gan_head_lr", -1.0),
    ("gan_features", "real"), ("gan_sigma_max", 0.001), ("gan_sigma_max", "80")])
def test_a_bad_setting_of_the_head_is_refused_naming_its_flag(flag, value):
    with pytest.raises(ValueError, match=f"--config.distill.{flag}="):
        objectives.check_config(dmd_config(**{"gan": True, flag: value}))


def test_the_gan_configs_validate():
    """configs/distill.py:dmd-gan (Fashion-MNIST, 1 step, the head on, the settings of
    docs/distillation.md's measured generator), :dmd-gan-tiny and the presets'
    :dmd-gan-img64-s, :dmd-gan-img512-s (DMD2's recipe: its GAN weights, sigma 80, one
    learning rate, 5 fake updates per generator update) are valid DMD configs with the
    head; 'dmd' keeps it off."""
    from tests.test_train import _config_file
    for variant in ("dmd-gan", "dmd-gan-tiny", "dmd-gan-img64-s", "dmd-gan-img512-s"):
        c = _config_file("distill", variant)
        c.distill.teacher = "teacher"
        configs.validate(c)
        obj = objectives.from_config(c)
        assert obj.name == "dmd" and obj.gan and c.distill.steps == 1, variant
        base = _config_file("distill", variant.replace("dmd-gan", "dmd", 1))
        assert c.optim.ref_lr == base.optim.ref_lr
        if variant == "dmd-gan":   # docs/distillation.md's measured one-step generator
            assert (c.distill.gen_cls_loss_weight, c.distill.guidance_cls_loss_weight,
                    c.distill.gan_features, c.distill.gan_head_lr) == (
                        0.3, 1e-2, "teacher", c.optim.ref_lr)
            assert c.distill.fake_lr == base.distill.fake_lr == 10 * c.optim.ref_lr
            assert (c.batch_size, c.total_kimg) == (32, 128) and base.batch_size == 64
            continue
        assert (c.distill.gen_cls_loss_weight, c.distill.guidance_cls_loss_weight,
                c.distill.gan_features) == (3e-3, 1e-2, "fake")
        assert c.total_kimg == base.total_kimg and c.batch_size == base.batch_size
        if variant.endswith("-s"):
            assert c.distill.sigma_max == 80.0 and obj.update_ratio == 5
            assert c.distill.fake_lr == c.optim.ref_lr and obj.head_tx is not None
    assert objectives.from_config(_config_file("distill", "dmd-gan")).update_ratio == 1
    assert objectives.from_config(_config_file("distill", "dmd-gan-tiny")).update_ratio == 5
    assert not objectives.from_config(_config_file("distill", "dmd")).gan
    with pytest.raises(ValueError, match="dmd-gan-img64-xxl"):
        _config_file("distill", "dmd-gan-img64-xxl")


# ---------------------------------------------------------------------------------------
# The jitted step


def gan_step_config(**distill):
    from tests.test_train import step_config
    config = step_config()
    configs.with_objective(config, "dmd")
    config.distill.update(teacher="(in the state)", steps=1, teacher_steps=2, **distill)
    return config


def run_dmd_steps(config, steps: int, objective=None):
    """`steps` jitted steps from a random generator and fake and a different random
    teacher (`test_train.random_state`); the states before and after each, numpy."""
    from edm2_jax.training import sharding as shard_lib
    from edm2_jax.training import step as step_lib
    from tests.test_train import random_batch, random_state
    obj = objective or objectives.check_config(config)
    state, net, tx = random_state(config, seed=0)
    state.update(jax.device_get(obj.init_state(state["params"])))  # numpy: donated
    state["teacher"] = random_state(config, seed=7)[0]["params"]
    fn = step_lib.jit_train_step(
        step_lib.make_train_step(config, net, tx, objective=obj), shard_lib.make_mesh(1))
    states, metrics = [jax.tree.map(np.copy, state)], []
    for i in range(steps):
        state, m = jax.device_get(fn(state, random_batch(config, i)))
        states.append(jax.tree.map(np.copy, state))
        metrics.append(m)
    return states, metrics


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


# ~40 s on 2 loaded cores: one compile of the tiny step, three steps.
# Slow (~40 s on 2 cores): a U-Net step compiled; in the end-to-end ci stage.
@pytest.mark.slow
@pytest.mark.ci
def test_the_head_on_step_trains_the_head_and_holds_the_generator_between_updates():
    """Ratio 2: the generator (weights and Adam state) moves on steps 0 and 2 and is
    held exactly on step 1 (its logged update 0); the head and the fake denoiser move on every step; the
    teacher rides along unchanged; the EMAs follow the held weights on every step."""
    states, metrics = run_dmd_steps(gan_step_config(gan=True, dfake_gen_update_ratio=2), 3)
    s0, s1, s2, s3 = states
    for m in metrics:
        assert all(np.isfinite(v) for v in m.values())
        assert m["gan_head_grad_norm"] > 0 and m["fake_grad_norm"] > 0
        assert 0 < m["loss/real_prob"] < 1 and 0 < m["loss/fake_prob"] < 1
    assert not same(s1["params"], s0["params"]) and not same(s3["params"], s2["params"])
    assert same(s2["params"], s1["params"]) and same(s2["opt_state"], s1["opt_state"])
    assert [m["update_norm"] > 0 for m in metrics] == [True, False, True]
    for a, b in ((s0, s1), (s1, s2), (s2, s3)):
        assert not same(b["gan_head"], a["gan_head"]) and not same(b["fake"], a["fake"])
        assert not same(b["ema"], a["ema"])
        assert b["step"] == a["step"] + 1
    assert same(s3["teacher"], s0["teacher"])


class PreHeadDMD(objectives.Objective):
    """DMD as it was before the head: `dmd_loss_per_element`'s two losses summed, the
    fake denoiser's update, every step training the generator (the base class's
    `trains_weights`)."""

    def __init__(self, config):
        super().__init__(config)
        self.inner = dmd.DistributionMatching(config)
        self.trained = self.inner.trained

    def init_state(self, params):
        return self.inner.init_state(params)

    def draws(self, *args):
        return self.inner.draws(*args)

    def update(self, state, grads, nimg):
        return self.inner.update(state, grads, nimg)

    def loss(self, params, buffers, net, state, images, labels, *, draws, dropout_rng,
             batch_size):
        from edm2_jax.model import loss as loss_lib
        from edm2_jax.objectives.distill import grid_settings
        loss_g, loss_f, aux = dmd.dmd_loss_per_element(
            params, buffers, net, state, labels, rnd_normal=draws["rnd_normal"],
            noise_unit=draws["noise_unit"], dropout_rng=dropout_rng,
            sigma_data=float(self.get("network.sigma_data", 0.5)), **grid_settings(self.config))
        per_image = jnp.sum(loss_g + loss_f, axis=(1, 2, 3))
        fake = loss_lib.loss_metrics(loss_f, aux["logvar"], aux["t_f"])
        metrics = {"loss": jnp.mean(loss_g + loss_f), "dm": jnp.mean(loss_g),
                   "fake_loss": fake.pop("loss"), "dm_scale": jnp.mean(aux["scale"]), **fake}
        return jnp.sum(per_image) / batch_size, metrics


# Slow (~40 s on 2 cores): the tiny step compiled twice.
@pytest.mark.slow
@pytest.mark.ci
def test_the_head_off_step_is_the_dmd_step_bit_for_bit():
    """`distill.gan=False` (its settings present, the ratio's 5 too) gives the arrays
    and metrics of DMD without the head, over two steps."""
    config = gan_step_config(gan=False, dfake_gen_update_ratio=5)
    states, metrics = run_dmd_steps(config, 2)
    ref_states, ref_metrics = run_dmd_steps(config, 2, objective=PreHeadDMD(config))
    assert same(states, ref_states) and same(metrics, ref_metrics)
