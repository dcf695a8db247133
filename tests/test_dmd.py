"""Distribution matching (objectives/dmd.py: DMD2 without its GAN head) against closed
forms.

Claims tested:
- the distribution-matching gradient and the per-example loss on values computed by
  hand; the noise levels' schedule by hand;
- the generator's output at its last step is the few-step sampler's image (backward
  simulation runs the sampler);
- on Gaussian data the real and fake denoisers are closed-form: with the generator's
  covariance equal to the data's, they differ by the constant `t^2 (Sigma + t^2)^-1
  (m - mu)` for every noised image, and the objective's gradient is that over DMD's
  normaliser; at the data's distribution the gradient is zero for every draw;
- a linear generator of a 2D Gaussian trained on the objective with the exact fake
  denoiser reaches the data's mean and covariance; so does one trained jointly with a
  fake Gaussian denoiser learned online by the denoising loss (the algorithm's two
  players, one gradient);
- the jitted step: micro-batches give the one-batch gradients, the teacher is carried
  unchanged; a run from a saved network trains, resumes bitwise, and its images depend
  only on their seeds, sampled with the generator's few-step sampler.
"""
from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from edm2_jax import configs, objectives
from edm2_jax.objectives import dmd
from edm2_jax.sampling import consistency, solvers
from edm2_jax.sampling.solvers import Heun
from tests.test_train import xla_cache  # noqa: F401  (a fixture: the runs share compiles)

# ---------------------------------------------------------------------------------------
# By hand


def test_dm_gradient_and_loss_by_hand():
    # One 1x2x1 image: x0 = (1, -1), D_real = (0.5, -0.5), D_fake = (1, 0).
    # DMD's normaliser mean|x0 - D_real| = (0.5 + 0.5) / 2 = 0.5, so
    # g = (D_fake - D_real) / 0.5 = (1, 1); the loss is g^2 / 2 = (0.5, 0.5) and its
    # gradient in x0 is g.
    x0 = jnp.array([1.0, -1.0]).reshape(1, 1, 2, 1)
    real = jnp.array([0.5, -0.5]).reshape(1, 1, 2, 1)
    fake = jnp.array([1.0, 0.0]).reshape(1, 1, 2, 1)
    g = dmd.dm_gradient(x0, real, fake)
    np.testing.assert_allclose(np.ravel(g), [1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(np.ravel(dmd.dm_loss(x0, g)), [0.5, 0.5], rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(dmd.dm_loss(x, g)))(x0)
    np.testing.assert_allclose(np.ravel(grad), [1.0, 1.0], rtol=1e-6)
    # A second image of twice the distance to D_real gets half the gradient (Eq. 8).
    x0b = jnp.concatenate([x0, 2 * x0 - real])   # |x0 - real| doubled
    g2 = dmd.dm_gradient(x0b, jnp.concatenate([real, real]), jnp.concatenate([fake, fake]))
    np.testing.assert_allclose(np.ravel(g2[1]), [0.5, 0.5], rtol=1e-6)


def test_dm_sigma_is_the_edm_schedule_at_uniform_time_by_hand():
    # u = 0.02 + 0.96 Phi(z): z = 0 is u = 0.5, the rho-warped midpoint
    # ((80^(1/7) + 0.002^(1/7)) / 2)^7 = ((1.87012 + 0.41156) / 2)^7 = 2.5152;
    # z -> -inf is u = 0.02: (1.87012 - 0.02 * 1.45856)^7 = 71.66.
    kw = dict(sigma_min=0.002, sigma_max=80.0, rho=7.0)
    t = np.asarray(dmd.dm_sigma(jnp.array([0.0, -40.0, 40.0]), **kw))
    np.testing.assert_allclose(t[0], ((80 ** (1 / 7) + 0.002 ** (1 / 7)) / 2) ** 7, rtol=1e-5)
    np.testing.assert_allclose(t[0], 2.5152, rtol=1e-4)
    np.testing.assert_allclose(t[1], 71.66, rtol=1e-4)
    np.testing.assert_allclose(t[2], (80 ** (1 / 7) - 0.98 * (80 ** (1 / 7) - 0.002 ** (1 / 7))) ** 7,
                               rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Gaussian data: the denoisers in closed form

MU = np.array([1.0, -2.0])
SIGMA = np.array([[1.0, 0.6], [0.6, 0.5]])     # full covariance


def gaussian_denoiser(m, C):
    """E[y | y + t n = x] for y ~ N(m, C): m + C (C + t^2 I)^-1 (x - m), x `[B, 2]`."""
    def D(x, t):
        M = C[None] @ jnp.linalg.inv(C[None] + (t**2)[:, None, None] * jnp.eye(2))
        return m + jnp.einsum("bij,bj->bi", M, x - m)
    return D


def test_with_matched_covariance_the_scores_differ_by_a_closed_form_constant():
    # N(m, Sigma) against N(mu, Sigma): D_fake(x) - D_real(x) = (I - A)(m - mu) with
    # A = Sigma (Sigma + t^2 I)^-1, the same for every x; the score difference is that
    # over t^2, and the objective's gradient is it over DMD's per-image normaliser.
    m = jnp.array([0.3, 0.4])
    real, fake = gaussian_denoiser(MU, SIGMA), gaussian_denoiser(m, SIGMA)
    key = jax.random.PRNGKey(0)
    x0 = m + jax.random.normal(key, (256, 2)) @ jnp.linalg.cholesky(SIGMA).T
    t = dmd.dm_sigma(jax.random.normal(jax.random.PRNGKey(1), (256,)), sigma_min=0.002,
                     sigma_max=80.0, rho=7.0)
    x_t = x0 + t[:, None] * jax.random.normal(jax.random.PRNGKey(2), x0.shape)
    r = real(x_t, t)
    g = dmd.dm_gradient(x0, r, fake(x_t, t))
    A = SIGMA[None] @ np.linalg.inv(SIGMA[None] + np.asarray(t)[:, None, None] ** 2 * np.eye(2))
    want = np.einsum("bij,j->bi", np.eye(2)[None] - A, np.asarray(m) - MU)
    scale = np.mean(np.abs(np.asarray(x0 - r)), axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(g) * scale, want, rtol=2e-4, atol=1e-5)
    # At the data's distribution the two denoisers agree: zero gradient for every draw.
    g0 = dmd.dm_gradient(x0, r, gaussian_denoiser(MU, SIGMA)(x_t, t))
    assert float(jnp.max(jnp.abs(g0))) == 0.0


def _train_linear_generator(fake_fn, steps=3000, lr=0.02, batch=1024, seed=0):
    """A linear generator `x0 = m + B z` (`z ~ N(0, I)`) trained with Adam on the mean of
    `dm_loss` (`fake_fn(theta, x_t, t, x0)` gives the fake denoiser and its own loss).
    Returns the generator's and the fake's parameters."""
    theta = {"m": jnp.zeros(2), "B": jnp.eye(2), "fake": {"m": jnp.zeros(2), "L": jnp.eye(2)}}
    tx = optax.adam(optax.cosine_decay_schedule(lr, steps))
    opt = tx.init(theta)
    real = gaussian_denoiser(MU, SIGMA)
    kw = dict(sigma_min=0.002, sigma_max=80.0, rho=7.0)

    def loss(theta, key):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        x0 = theta["m"] + jax.random.normal(k1, (batch, 2)) @ theta["B"].T
        t = dmd.dm_sigma(jax.random.normal(k2, (batch,)), **kw)
        y = jax.lax.stop_gradient(x0)
        x_t = y + t[:, None] * jax.random.normal(k3, y.shape)
        fake, loss_f = fake_fn(theta, x_t, t, y, (k4, k5))
        g = dmd.dm_gradient(y, real(x_t, t), fake)
        return jnp.mean(jnp.sum(dmd.dm_loss(x0, g), -1)) + loss_f

    @jax.jit
    def step(theta, opt, key):
        u, opt = tx.update(jax.grad(loss)(theta, key), opt)
        return optax.apply_updates(theta, u), opt

    for n in range(steps):
        theta, opt = step(theta, opt, jax.random.fold_in(jax.random.PRNGKey(seed), n))
    return theta


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_linear_generator_reaches_the_data_mean_and_covariance_with_the_exact_fake():
    """The fake denoiser is the exact one of the generator's current N(m, B B^T)
    (stopped gradient): the generator trained on DMD's objective lands on N(mu, Sigma)."""
    def exact(theta, x_t, t, y, keys):
        th = jax.lax.stop_gradient(theta)
        return gaussian_denoiser(th["m"], th["B"] @ th["B"].T)(x_t, t), 0.0
    theta = _train_linear_generator(exact)
    np.testing.assert_allclose(theta["m"], MU, atol=2e-3)
    np.testing.assert_allclose(theta["B"] @ theta["B"].T, SIGMA, atol=5e-3)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_linear_generator_and_online_fake_denoiser_reach_the_data_together():
    """The algorithm's two players: the fake denoiser is the denoiser of a Gaussian model
    N(m_f, L_f L_f^T) learned online by the EDM denoising loss `lambda(t_f) |D_fake(y +
    t_f n) - y|^2` on the generator's (stopped) images, in the same loss, one gradient
    (as the jitted step). Both reach the data's mean and covariance."""
    def learned(theta, x_t, t, y, keys):
        f = theta["fake"]
        fake_sg = jax.lax.stop_gradient(f)
        D = gaussian_denoiser(fake_sg["m"], fake_sg["L"] @ fake_sg["L"].T)
        t_f = dmd.dm_sigma(jax.random.normal(keys[0], t.shape), sigma_min=0.002,
                           sigma_max=80.0, rho=7.0)
        x_f = y + t_f[:, None] * jax.random.normal(keys[1], y.shape)
        d = gaussian_denoiser(f["m"], f["L"] @ f["L"].T)(x_f, t_f)
        lam = (t_f**2 + 0.25) / (t_f * 0.5) ** 2
        return D(x_t, t), jnp.mean(lam * jnp.sum((d - y) ** 2, -1))
    theta = _train_linear_generator(learned, steps=4000)
    np.testing.assert_allclose(theta["m"], MU, atol=0.03)
    np.testing.assert_allclose(theta["B"] @ theta["B"].T, SIGMA, atol=0.05)
    f = theta["fake"]
    np.testing.assert_allclose(f["m"], MU, atol=0.03)
    np.testing.assert_allclose(f["L"] @ f["L"].T, SIGMA, atol=0.05)


# ---------------------------------------------------------------------------------------
# The generator and the sampler


def test_generator_output_at_the_last_step_is_the_samplers_image():
    """Backward simulation: at k = K - 1 the generator's input is the sampler's state,
    so its output is `consistency_sampler`'s image of the same noise; at k = 0 it is
    the denoiser at sigma_max of sigma_max n."""
    D = gaussian_denoiser(MU, SIGMA)
    def D4(x, t):  # [B, 1, 1, 2] images
        t = jnp.broadcast_to(jnp.asarray(t, jnp.float32).reshape(-1), (x.shape[0],))
        return D(x.reshape(-1, 2), t).reshape(x.shape)
    noise = jax.random.normal(jax.random.PRNGKey(3), (5, 1, 1, 2))
    grid = dict(teacher_steps=8, sigma_min=0.002, sigma_max=80.0, rho=7.0)
    for K in (1, 2, 4):
        ends = dmd.segment_sigmas(K, **grid)
        x0, t_k = dmd.generator_images(D4, D4, noise, jnp.full((5,), K - 1), ends)
        ref = consistency.consistency_sampler(lambda x, t, _: D4(x, t), noise, num_steps=K,
                                              **grid)
        np.testing.assert_allclose(x0, ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(t_k, ends[K - 1])
        first, _ = dmd.generator_images(D4, D4, noise, jnp.zeros((5,), jnp.int32), ends)
        np.testing.assert_allclose(first, D4(80.0 * noise, 80.0), rtol=1e-6)


def test_from_config_picks_the_objective_and_its_sampler():
    """`config.objective` picks the objective (a config naming none trains EDM2's)."""
    c = {"objective": "dmd", "distill": {"teacher": "t", "steps": 2, "teacher_steps": 8,
                                         "sigma_min": 0.002, "sigma_max": 80.0, "rho": 7.0,
                                         "fake_lr": 0.02}}
    obj = objectives.from_config(c)
    assert isinstance(obj, dmd.DistributionMatching) and obj.trained == ("fake",)
    assert obj.sampler(32) == solvers.FewStep(num_steps=2, teacher_steps=8, sigma_min=0.002,
                                              sigma_max=80.0, rho=7.0)
    assert objectives.from_config(dict(c, objective="consistency")).name == "consistency"
    assert objectives.from_config({"distill": c["distill"]}).name == "edm2"
    c["distill"]["fake_lr"] = 0.0
    with pytest.raises(ValueError, match="distill.fake_lr"):
        objectives.from_config(c).check()


def test_dmd_configs_validate_and_a_bad_objective_is_named():
    """configs/distill.py:dmd, :dmd-tiny and :dmd-img64-s are valid DMD configs (a 1-step
    generator from sigma 2.5); an unknown variant is named; an unknown `distill.objective`
    or a fake learning rate of 0 is refused naming the flag."""
    from tests.test_train import _config_file
    for variant, kimg in (("dmd", 32), ("dmd-tiny", 0.256)):
        c = _config_file("distill", variant)
        c.distill.teacher = "teacher"
        configs.validate(c)
        assert objectives.from_config(c).name == "dmd" and c.total_kimg == kimg
        assert c.distill.steps == 1 and c.distill.sigma_max == 2.5
    # A preset's generator: the teacher's final rate (img64-s: 0.01 at t_ref 35000 batches
    # of 2048, decayed as 1/sqrt over 2^30 images), the fake denoiser at ten times it.
    p = _config_file("distill", "dmd-img64-s")
    p.distill.teacher = "teacher"
    configs.validate(p)
    end_lr = 0.01 / (2**30 / 2048 / 35000) ** 0.5
    assert objectives.from_config(p).name == "dmd" and p.network.model_channels == 192
    assert p.distill.steps == 1 and p.distill.sigma_max == 2.5
    assert p.optim.ref_lr == pytest.approx(end_lr, rel=1e-12)
    assert p.distill.fake_lr == pytest.approx(10 * end_lr, rel=1e-12)
    with pytest.raises(ValueError, match="dmd-img64-xxl"):
        _config_file("distill", "dmd-img64-xxl")
    c.objective = "gan"
    with pytest.raises(ValueError, match="--config.objective='gan'.*consistency, dmd, edm2"):
        configs.validate(c)
    configs.with_objective(c, "dmd")
    c.distill.fake_lr = 0.0
    with pytest.raises(ValueError, match="distill.fake_lr"):
        configs.validate(c)


# ---------------------------------------------------------------------------------------
# Where a network's sampler comes from


def test_a_post_hoc_ema_is_sampled_from_its_own_record(tmp_path):
    """A network checkpoint's sampler is read from its own network.json: the objective's
    record a post-hoc EMA copies from its run (`objectives.record`); one without it (its
    source run alone could say) is refused naming the fix, never sampled with Heun."""
    from edm2_jax import nets
    from edm2_jax.model.networks import init_variables, precond_from_config
    from edm2_jax.objectives.distill import network_config
    from edm2_jax.run import network_dir
    net = precond_from_config(dict(img_resolution=8, img_channels=1, label_dim=0,
                                   model_channels=8, channel_mult=(1,), num_blocks=1,
                                   attn_resolutions=(), logvar_channels=8))
    variables = init_variables(net, jax.random.PRNGKey(0))
    config = {"objective": "dmd", "distill": {"teacher": "t", "steps": 1, "teacher_steps": 8,
                                              "sigma_min": 0.002, "sigma_max": 2.5,
                                              "rho": 7.0, "fake_lr": 0.02}}
    rec = objectives.record(config)
    assert rec == config
    meta = {"phema": True, "source": str(tmp_path / "gone")}
    good = network_dir.save_network(str(tmp_path / "good"), variables, network_config(net),
                                    dict(meta, **rec))
    assert nets.net_sampler(good) == solvers.FewStep(1, 8, 0.002, 2.5, 7.0)
    old = network_dir.save_network(str(tmp_path / "old"), variables, network_config(net), meta)
    with pytest.raises(ValueError, match="records no objective.*--mode=phema"):
        nets.net_sampler(old)
    assert objectives.record({}) == {"objective": "edm2"}


# ---------------------------------------------------------------------------------------
# The jitted step


def dmd_step(num_accum: int = 1):
    """One jitted DMD step from a random generator and fake and a different random
    teacher (`test_train.random_state`); numpy."""
    from edm2_jax.training import sharding as shard_lib
    from edm2_jax.training import step as step_lib
    from tests.test_train import random_batch, random_state, step_config
    config = step_config()
    configs.with_objective(config, "dmd")
    config.distill.update(teacher="(in the state)", steps=2, teacher_steps=4)
    obj = objectives.from_config(config)
    state, net, tx = random_state(config, seed=0)
    state.update(jax.device_get(obj.init_state(state["params"])))  # numpy: donated
    state["teacher"] = random_state(config, seed=7)[0]["params"]
    fn = step_lib.jit_train_step(step_lib.make_train_step(config, net, tx, num_accum),
                                 shard_lib.make_mesh(1))
    return state, jax.device_get(fn(state, random_batch(config, 0)))


# Slow (~40 s on 2 cores): the step compiled with and without micro-batches.
@pytest.mark.slow
@pytest.mark.ci
def test_dmd_step_trains_both_networks_and_does_not_depend_on_micro_batches():
    """Two micro-batches give the one-batch gradients of the generator and of the fake
    denoiser (Adam's moments, the fake's weights) to float32 summation-order error; the
    teacher rides along unchanged; the fake denoiser moved."""
    from tests.test_train import STEP_TOL, gradient_scale
    from tests.tolerances import tree_err
    start, (ref, ref_m) = dmd_step()
    _, (acc, acc_m) = dmd_step(num_accum=2)
    assert np.isfinite(ref_m["objective"]) and ref_m["grad_norm"] > 0
    assert ref_m["fake_grad_norm"] > 0
    for k in ("opt_state", "fake_opt"):
        err, where = tree_err(gradient_scale(acc[k]), gradient_scale(ref[k]))
        assert err <= STEP_TOL, (k, err, where)
    err, where = tree_err(acc["fake"], ref["fake"])
    assert err <= STEP_TOL, (err, where)
    for a, b in zip(jax.tree.leaves(ref["teacher"]), jax.tree.leaves(start["teacher"])):
        assert np.array_equal(a, b)
    assert max(float(np.max(np.abs(a - b))) for a, b in
               zip(jax.tree.leaves(ref["fake"]), jax.tree.leaves(start["fake"]))) > 0


# ---------------------------------------------------------------------------------------
# A run from a saved network


@pytest.fixture(scope="module")
def dmd_runs(tmp_path_factory, xla_cache):
    """A tiny random teacher (8x8 grey, 2 classes, saved as a network) and two 2-step
    DMD runs of it on an image folder: 4 steps in one go, and the same stopped after 2
    and resumed."""
    from edm2_jax.model.networks import init_variables, precond_from_config
    from edm2_jax.objectives.distill import network_config
    from edm2_jax.run import network_dir
    from edm2_jax.training import loop
    from tests.test_train import make_image_folder, tiny_config
    root = tmp_path_factory.mktemp("dmd")
    cfg = dict(img_resolution=8, img_channels=1, label_dim=2, model_channels=8,
               channel_mult=(1,), num_blocks=1, attn_resolutions=(), logvar_channels=8)
    net = precond_from_config(cfg)
    teacher = network_dir.save_network(str(root / "teacher"),
                                       init_variables(net, jax.random.PRNGKey(0)),
                                       network_config(net))
    data = make_image_folder(root / "data", n=16, resolution=8)
    over = {"distill.teacher": teacher, "objective": "dmd", "distill.steps": 2,
            "distill.teacher_steps": 4, "optim.ref_lr": 0.005, "optim.t_ref": 0}
    full, half = root / "full", root / "half"
    r_full = loop.train_and_evaluate(tiny_config(data, **over), str(full))
    loop.train_and_evaluate(tiny_config(data, total_kimg=0.016, **over), str(half))
    r_half = loop.train_and_evaluate(tiny_config(data, **over), str(half))
    return dict(teacher=teacher, full=full, half=half, r_full=r_full, r_half=r_half)


# Slow (~40 s on 2 cores): two tiny runs, built once for these tests.
@pytest.mark.slow
@pytest.mark.ci
def test_dmd_run_trains_and_resumes_bitwise(dmd_runs):
    """The run stopped at step 2 and resumed ends with the arrays of the run that never
    stopped: generator, EMAs, Adam, the fake denoiser and its Adam; the teacher rides
    along unchanged, the generator and the fake moved away from it."""
    from edm2_jax.run import network_dir
    from tests.test_train import _restore
    assert dmd_runs["r_full"]["finished"] and dmd_runs["r_half"]["finished"]
    (sa, a), (sb, b) = _restore(dmd_runs["full"]), _restore(dmd_runs["half"])
    assert sa == sb == 4
    assert {"teacher", "fake", "fake_opt"} <= set(a)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(x, y)
    _, teacher, _ = network_dir.load_network(dmd_runs["teacher"])
    for x, y in zip(jax.tree.leaves(a["teacher"]), jax.tree.leaves(teacher["params"]),
                    strict=True):
        assert np.array_equal(x, y)
    for k in ("params", "fake"):
        moved = [np.max(np.abs(x - y)) for x, y in zip(jax.tree.leaves(a[k]),
                                                       jax.tree.leaves(a["teacher"]))]
        assert max(moved) > 0, k


@pytest.mark.slow
@pytest.mark.ci
def test_dmd_generator_images_depend_only_on_the_seed_and_generate_finds_its_sampler(
        dmd_runs):
    from edm2_jax import nets
    from edm2_jax.sampling import sampler as sampling
    run = str(dmd_runs["full"])
    kw = nets.net_sampler(run)
    assert kw == solvers.FewStep(num_steps=2, teacher_steps=4, sigma_min=0.002,
                                 sigma_max=80.0, rho=7.0)
    net, variables, _ = nets.load_net(run)
    a = np.asarray(sampling.sample_images(net, variables, np.arange(6), sampler=kw))
    b = np.asarray(sampling.sample_images(net, variables, np.array([4, 1]), sampler=kw))
    np.testing.assert_array_equal(a[[4, 1]], b)
    assert a.std() > 0


@pytest.mark.slow
@pytest.mark.ci
def test_post_hoc_ema_of_a_generator_is_sampled_as_the_generator(dmd_runs, tmp_path):
    """A post-hoc EMA of a DMD run is a generator: `nets.net_sampler` and the post-hoc EMA
    sweep give it the run's few-step sampler, and its image of a seed is the sampler's."""
    from edm2_jax import nets
    from edm2_jax.ema import reconstruction, sweep
    from edm2_jax.sampling import sampler as sampling
    run = str(dmd_runs["full"])
    out, = reconstruction.reconstruct(run, [0.07], out_dir=str(tmp_path / "phema"), progress=False)
    kw = nets.net_sampler(run)
    assert nets.net_sampler(out) == kw and isinstance(kw, solvers.FewStep)
    assert sweep.net_sampler(out) == kw
    # Its network.json carries what its sampler needs: the run moved away, it is still
    # sampled as the generator.
    moved = tmp_path / "moved"
    shutil.move(run, moved)
    try:
        assert nets.net_sampler(out) == kw
    finally:
        shutil.move(moved, run)
    net, variables, _ = nets.load_net(out)
    a = np.asarray(sampling.sample_images(net, variables, np.arange(3), sampler=kw))
    b = np.asarray(sampling.sample_images(net, variables, np.array([2]), sampler=kw))
    np.testing.assert_array_equal(a[[2]], b)
    heun = np.asarray(sampling.sample_images(net, variables, np.array([2]), sampler=Heun(2)))
    assert a.shape == (3, 8, 8, 1) and not np.array_equal(heun, b)


# Slow (~70 s on 2 cores): four steps compiled.
@pytest.mark.slow
@pytest.mark.ci
def test_forward_passes_are_the_ratio_of_xla_flop_counts():
    """`Objective.flops_per_image` (the plan's model flops, in forward passes)
    relative to the EDM2 step's 3 is the ratio of XLA's own flop counts of the compiled
    steps (`cost_analysis`, the model's kernels on XLA:CPU): 6/3 for a consistency
    student, (K + 7)/3 for a K-step generator. XLA counts a forward pass alone at 0.90 to
    0.91 of the model's count (a forward and backward pass at 0.99 of 3: measured on
    this network), so the ratios come out 1.91, 2.64 and 3.55 against 2, 2.67 and 3.67;
    a count off by one pass moves them by a third or more. Bound: 10 %."""
    from edm2_jax.planner import plan
    from edm2_jax.training import sharding as shard_lib
    from edm2_jax.training import state as state_lib
    from edm2_jax.training import optim as optim_lib
    from edm2_jax.training import step as step_lib
    from tests.test_train import step_config
    B = 64   # images enough that the per-image work outweighs the per-weight (Adam, EMAs)
    config = step_config(batch_size=B)
    config.backend.kernels = "xla"
    net = state_lib.make_network(config)
    tx = optim_lib.make_optimizer(config.optim, B)
    mesh = shard_lib.make_mesh(1)
    r, c, L = net.img_resolution, net.img_channels, net.label_dim
    batch = {"image": jax.ShapeDtypeStruct((B, r, r, c), jnp.float32),
             "label": jax.ShapeDtypeStruct((B, L), jnp.float32)}
    flops, passes = {}, {}
    for name, objective, steps in (("edm2", "edm2", 4), ("consistency", "consistency", 2),
                                   ("dmd1", "dmd", 1), ("dmd4", "dmd", 4)):
        cfg = config.copy_and_resolve_references()
        configs.with_objective(cfg, objective)
        if objective != "edm2":
            cfg.distill.update(teacher="(in the state)", teacher_steps=4, steps=steps)
        obj = objectives.from_config(cfg)
        state = jax.eval_shape(lambda k: state_lib.init_train_state(cfg, net, tx, k,
                                                                    objective=obj),
                               jax.random.PRNGKey(0))
        fn = step_lib.jit_train_step(step_lib.make_train_step(cfg, net, tx, 1, objective=obj), mesh)
        flops[name] = plan.Program.of(fn.lower(state, batch).compile(), 0.0, 0.0).xla_flops
        passes[name] = obj.flops_per_image(1.0)
    assert passes == {"edm2": 3, "consistency": 6, "dmd1": 8, "dmd4": 11}
    for name in ("consistency", "dmd1", "dmd4"):
        assert flops[name] / flops["edm2"] == pytest.approx(passes[name] / 3, rel=0.1), (
            name, flops)
