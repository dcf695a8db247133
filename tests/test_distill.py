"""Few-step generation: multistep consistency distillation (objectives/distill.py) and its
sampler (sampling/consistency.py), against closed forms.

Claims tested:
- on Gaussian data the probability-flow ODE has a closed-form flow and the ideal
  multistep consistency student is known: the distillation target of the ideal student
  with an exact teacher is the ideal student itself (zero loss), the teacher's Heun step
  converges to the flow at third order, and the few-step sampler of the ideal student
  lands on the ODE's solution for every step count;
- a student trained on the objective for a 2D Gaussian lands on the ideal student;
- the target on values computed by hand; the grid and the segments by hand;
- a distillation run from a converted release pickle (a tiny random one) trains, resumes
  bitwise, and its images depend only on their seeds; generate finds its sampler.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import PIL.Image
import pytest
from jax import enable_x64

from edm2_jax import configs, nets
from edm2_jax.sampling import consistency
from edm2_jax.sampling import sampler as sampling
from edm2_jax.objectives import distill
from edm2_jax.sampling import solvers
from tests.cpu_devices import tree_from_process
from tests.test_train import xla_cache  # noqa: F401  (a fixture: the runs share compiles)

# ---------------------------------------------------------------------------------------
# Gaussian data y ~ N(mu, diag(a^2)): the ideal denoiser and the PF-ODE's flow.

MU = np.array([1.0, -2.0])
A = np.array([0.5, 2.0])


def ideal_denoiser(x, sigma):
    """E[y | y + sigma n = x] for Gaussian y: mu + a^2 / (a^2 + sigma^2) (x - mu)."""
    s = jnp.reshape(sigma, jnp.shape(sigma) + (1,) * (x.ndim - jnp.ndim(sigma)))
    return MU + A**2 / (A**2 + s**2) * (x - MU)


def flow(x_t, t, s):
    """The PF-ODE dx/dsigma = (x - D(x; sigma)) / sigma from t to s, in closed form:
    x_s - mu = sqrt((a^2 + s^2) / (a^2 + t^2)) (x_t - mu)."""
    t = jnp.reshape(t, jnp.shape(t) + (1,) * (x_t.ndim - jnp.ndim(t)))
    s = jnp.reshape(s, jnp.shape(s) + (1,) * (x_t.ndim - jnp.ndim(s)))
    return MU + jnp.sqrt((A**2 + s**2) / (A**2 + t**2)) * (x_t - MU)


def ideal_student(sigmas, bounds):
    """The clean image whose DDIM step from (x_t, t) to the end s of t's segment lands on
    the flow: (flow(x_t, t, s) - (s/t) x_t) / (1 - s/t). The segment is that of the
    grid point nearest to t (t off the grid: a value the objective discards)."""
    grid = jnp.asarray(sigmas[:-1])
    ends = jnp.asarray(sigmas)[consistency.segment_end(jnp.arange(grid.size), bounds)]

    def D(x, sigma):
        t = jnp.asarray(sigma, x.dtype)
        s = ends[jnp.argmin(jnp.abs(grid[:, None] - jnp.atleast_1d(t)[None]), axis=0)]
        s = s.reshape(t.shape).astype(x.dtype)
        tt = jnp.reshape(t, t.shape + (1,) * (x.ndim - t.ndim))
        ss = jnp.reshape(s, s.shape + (1,) * (x.ndim - s.ndim))
        return (flow(x, t, s) - ss / tt * x) / (1 - ss / tt)
    return D


# ---------------------------------------------------------------------------------------
# The grid, the segments, DDIM


def test_segments_and_grid_by_hand():
    np.testing.assert_array_equal(consistency.segment_bounds(4, 32), [0, 8, 16, 24, 32])
    np.testing.assert_array_equal(consistency.segment_bounds(3, 32), [0, 11, 21, 32])
    np.testing.assert_array_equal(consistency.segment_bounds(1, 8), [0, 8])
    b = consistency.segment_bounds(2, 8)
    ends = consistency.segment_end(jnp.arange(8, dtype=jnp.int32), b)
    np.testing.assert_array_equal(ends, [4, 4, 4, 4, 8, 8, 8, 8])
    for bad in (0, 9, 2.5):
        with pytest.raises(ValueError, match="steps"):
            consistency.segment_bounds(bad, 8)
    g = consistency.grid_sigmas(3, 0.5, 8.0, 2.0)  # (sqrt(8) + i/2 (sqrt(.5) - sqrt(8)))^2
    np.testing.assert_allclose(g, [8.0, ((8**0.5 + 0.5**0.5) / 2) ** 2, 0.5, 0.0], rtol=1e-12)


def test_grid_index_is_uniform_over_the_teacher_steps():
    N = 8
    centres = jax.scipy.special.ndtri((jnp.arange(N) + 0.5) / N)
    np.testing.assert_array_equal(distill.grid_index(centres, N), np.arange(N))
    z = jax.random.normal(jax.random.PRNGKey(0), (80_000,))
    counts = np.bincount(np.asarray(distill.grid_index(z, N)), minlength=N)
    # Each count is Binomial(80000, 1/8): sd = sqrt(80000 * 1/8 * 7/8) = 93.5; 5 sd.
    assert np.all(np.abs(counts - 10_000) < 5 * 93.5), counts


def test_ddim_step_is_the_euler_step_of_the_pf_ode():
    x, x0 = jnp.array([[3.0, -1.0]]), jnp.array([[0.5, 0.25]])
    t, s = 2.0, 0.5
    euler = x + (s - t) * (x - x0) / t          # dx/dsigma = (x - D) / sigma
    np.testing.assert_allclose(consistency.ddim_step(x, x0, t, s), euler, rtol=1e-6)
    np.testing.assert_allclose(consistency.ddim_step(x, x0, t, 0.0), x0)  # s = 0: x0_hat


# ---------------------------------------------------------------------------------------
# The objective on Gaussian data


def test_target_by_hand():
    """x_t = 3 at t = 2, teacher D(x; sigma) = x / (1 + sigma^2) (mu 0, a 1), student
    D(x; sigma) = x / 2. Heun to r = 1: d_t = (3 - 3/5) / 2 = 1.2, x_e = 3 - 1.2 = 1.8,
    d_r = (1.8 - 0.9) / 1 = 0.9, x_r = 3 - (1.2 + 0.9) / 2 = 1.95. To s = 0.5: the
    student's x0_hat(1.95) = 0.975, DDIM x_s = 0.975 + 0.5 (1.95 - 0.975) = 1.4625,
    target (1.4625 - 0.25 * 3) / 0.75 = 0.95. With s = r = 1: (1.95 - 0.5 * 3) / 0.5 = 0.9.
    With s = 0: the student's x0_hat at r, 0.975."""
    teacher = lambda x, sigma: x / (1 + distill._bcast(sigma, x) ** 2)  # noqa: E731
    student = lambda x, sigma: 0.5 * x  # noqa: E731
    x_t = jnp.full((3, 1, 1, 1), 3.0)
    t, r = jnp.full(3, 2.0), jnp.full(3, 1.0)
    x_r = solvers.heun_step(teacher, x_t, t, r)
    np.testing.assert_allclose(x_r.ravel(), 1.95, rtol=1e-6)
    s = jnp.array([0.5, 1.0, 0.0])
    target = distill.consistency_target(student, x_t, x_r, t, r, s)
    np.testing.assert_allclose(target.ravel(), [0.95, 0.9, 0.975], rtol=1e-6)
    # r = 0: Euler to 0 lands on the teacher's x0_hat, 3 / 5.
    x_0 = solvers.heun_step(teacher, x_t, t, jnp.zeros(3))
    np.testing.assert_allclose(x_0.ravel(), 0.6, rtol=1e-6)


@pytest.mark.parametrize("steps", [1, 2, 3, 8])
def test_ideal_student_is_its_own_target_with_an_exact_teacher(steps):
    """Loss zero at the ideal consistency function: with the teacher's step replaced by
    the exact flow, the target of the ideal student is the ideal student, at every grid
    index (segment ends, r = s, and s = 0 included)."""
    with enable_x64():
        N = 8
        sigmas = consistency.grid_sigmas(N, 0.002, 80.0, 7.0)
        bounds = consistency.segment_bounds(steps, N)
        D = ideal_student(sigmas, bounds)
        i = jnp.repeat(jnp.arange(N, dtype=jnp.int32), 16)
        t, r = jnp.asarray(sigmas)[i], jnp.asarray(sigmas)[i + 1]
        s = jnp.asarray(sigmas)[consistency.segment_end(i, bounds)]
        y = MU + A * jax.random.normal(jax.random.PRNGKey(1), (i.size, 2), jnp.float64)
        x_t = y + t[:, None] * jax.random.normal(jax.random.PRNGKey(2), y.shape, jnp.float64)
        target = distill.consistency_target(D, x_t, flow(x_t, t, r), t, r, s)
        want = D(x_t, t)
        np.testing.assert_allclose(target, want, rtol=1e-9, atol=1e-9 * float(A.max()))


def test_teacher_heun_step_converges_to_the_flow_at_third_order():
    """Heun's local error is O(h^3): halving the step divides it by about 8."""
    with enable_x64():
        x_t = jnp.array([[2.5, -7.0], [0.0, 4.0]])
        t = jnp.full(2, 3.0)
        errs = []
        for h in (0.4, 0.2, 0.1, 0.05):
            r = t - h
            errs.append(float(jnp.max(jnp.abs(solvers.heun_step(ideal_denoiser, x_t, t, r)
                                               - flow(x_t, t, r)))))
        ratios = np.array(errs[:-1]) / np.array(errs[1:])
        assert np.all((ratios > 6.5) & (ratios < 9.5)), (errs, ratios)


@pytest.mark.parametrize("steps", [1, 2, 4, 8])
def test_sampler_of_the_ideal_student_lands_on_the_ode_solution(steps):
    """From x = sigma_max n, `steps` evaluations of the ideal student reach the flow's
    end, mu + a / sqrt(a^2 + sigma_max^2) (sigma_max n - mu), for every step count."""
    sigmas = consistency.grid_sigmas(32, 0.002, 80.0, 7.0)
    D = ideal_student(sigmas, consistency.segment_bounds(steps, 32))
    noise = jax.random.normal(jax.random.PRNGKey(3), (64, 2))
    x = consistency.consistency_sampler(lambda x, sigma, labels: D(x, sigma), noise,
                                        num_steps=steps, teacher_steps=32)
    want = MU + A / np.sqrt(A**2 + 80.0**2) * (80.0 * noise - MU)
    np.testing.assert_allclose(x, want, rtol=2e-5, atol=2e-5 * float(A.max()))


@pytest.mark.parametrize("steps", [1, 3, 8])
def test_sampler_traces_the_student_once_and_evaluates_it_at_each_segment_start(steps):
    """One traced evaluation whatever K (one copy of the network in the program), run K
    times, at the noise levels sigma_{b_k} where the segments begin."""
    traced, calls = [], []

    def denoise(x, sigma, labels):
        traced.append(sigma)
        jax.debug.callback(lambda t: calls.append(float(t)), sigma, ordered=True)
        return 0.5 * x

    jax.jit(lambda n: consistency.consistency_sampler(denoise, n, num_steps=steps,
                                                      teacher_steps=16))(jnp.ones((1, 2)))
    jax.effects_barrier()
    sigmas = consistency.grid_sigmas(16, 0.002, 80.0, 7.0)
    assert len(traced) == 1
    np.testing.assert_allclose(calls, sigmas[consistency.segment_bounds(steps, 16)[:-1]],
                               rtol=1e-6)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_trained_student_lands_on_the_ideal_student():
    """A per-grid-point affine student x0_hat = alpha_i x + beta_i (the ideal student's
    form on Gaussian data), trained on the distillation objective with an exact teacher
    (the flow; the Heun step's own error is the test above), reaches the ideal alpha_i,
    beta_i: the objective's fixed point is the ideal consistency function."""
    N, K = 8, 2
    kw = dict(steps=K, teacher_steps=N, sigma_min=0.02, sigma_max=10.0, rho=7.0)
    sigmas = consistency.grid_sigmas(N, 0.02, 10.0, 7.0)
    bounds = consistency.segment_bounds(K, N)

    def student(theta):
        def D(x, sigma):
            i = jnp.searchsorted(-jnp.asarray(sigmas[:-1], jnp.float32), -sigma)
            return theta["alpha"][i] * x + theta["beta"][i]
        return D

    def loss(theta, key):
        k1, k2, k3 = jax.random.split(key, 3)
        z = jax.random.normal(k1, (2048,))
        t, r, s = distill.consistency_draws(z, **kw)
        y = MU + A * jax.random.normal(k2, (2048, 2))
        x_t = y + t[:, None] * jax.random.normal(k3, y.shape)
        target = distill.consistency_target(student(jax.lax.stop_gradient(theta)),
                                            x_t, flow(x_t, t, r), t, r, s)
        return jnp.mean(jnp.sum((student(theta)(x_t, t) - target) ** 2, axis=-1)
                        / (t**2 + 0.25))  # a weight ~ EDM's lambda(t), for conditioning

    theta = {"alpha": jnp.ones((N, 2)), "beta": jnp.zeros((N, 2))}
    tx = optax.adam(optax.cosine_decay_schedule(0.05, 3000))
    opt = tx.init(theta)

    @jax.jit
    def step(theta, opt, key):
        g = jax.grad(loss)(theta, key)
        u, opt = tx.update(g, opt)
        return optax.apply_updates(theta, u), opt

    for n in range(3000):
        theta, opt = step(theta, opt, jax.random.PRNGKey(n))
    # The ideal alpha, beta at each grid point (from ideal_student, affine in x).
    D = ideal_student(sigmas, bounds)
    t = jnp.asarray(sigmas[:-1], jnp.float32)
    beta = jnp.stack([D(jnp.zeros((1, 2)), v)[0] for v in t])
    alpha = jnp.stack([D(jnp.ones((1, 2)), v)[0] for v in t]) - beta
    # At the ideal student every draw's residual is zero, so the minibatch gradient
    # vanishes there and Adam settles on it to float32 rounding (~1e-7); 1e-4 is slack
    # for the last steps of the schedule.
    np.testing.assert_allclose(theta["alpha"], alpha, atol=1e-4)
    np.testing.assert_allclose(theta["beta"] / A, beta / A, atol=1e-4)
    # Not the starting point: the ideal student is far from the identity it started at.
    assert float(jnp.max(jnp.abs(alpha - 1))) > 0.5


# ---------------------------------------------------------------------------------------
# A distillation run from a converted release pickle


def _rgb_folder(path: Path, n: int = 16, resolution: int = 16) -> Path:
    path.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for k in range(n):
        PIL.Image.fromarray(rng.integers(0, 256, (resolution, resolution, 3), np.uint8)).save(
            path / f"img{k:03d}.png")
    return path


@pytest.fixture(scope="module")
def distill_runs(tmp_path_factory, xla_cache):
    """A tiny random release pickle (unconditional, 16x16x3) converted, and two
    distillation runs of it: 4 steps in one go, and the same stopped after 2."""
    pytest.importorskip("torch")
    from tests.test_convert import golden as convert_golden, write_release_pickle
    from tests.test_train import tiny_config
    from edm2_jax.release import convert as C
    from edm2_jax.release import pickle_io as P
    from edm2_jax.training import loop
    root = tmp_path_factory.mktemp("distill")
    pkl = root / "edm2-tiny-0000008-0.100.pkl"
    write_release_pickle(pkl, P.load_state_dict(convert_golden("uncond")), label_dim=0)
    teacher = C.convert(str(pkl), str(root / "teacher"))
    data = _rgb_folder(root / "data")
    over = {"objective": "consistency", "distill.teacher": teacher, "distill.steps": 2,
            "distill.teacher_steps": 4, "data.use_labels": False, "optim.ref_lr": 0.005, "optim.t_ref": 0}
    full, half = root / "full", root / "half"
    r_full = loop.train_and_evaluate(tiny_config(data, **over), str(full))
    loop.train_and_evaluate(tiny_config(data, total_kimg=0.016, **over), str(half))
    r_half = loop.train_and_evaluate(tiny_config(data, **over), str(half))
    return dict(root=root, teacher=teacher, full=full, half=half, r_full=r_full,
                r_half=r_half, config=tiny_config(data, **over))


# Slow: the distillation runs from a release pickle (~40 s on 2 cores, built once for these tests).
@pytest.mark.slow
@pytest.mark.ci
def test_distillation_from_a_release_pickle_trains_and_resumes_bitwise(distill_runs):
    from tests.test_train import _restore
    from edm2_jax.run import network_dir
    assert distill_runs["r_full"]["finished"] and distill_runs["r_half"]["finished"]
    (sa, a), (sb, b) = _restore(distill_runs["full"]), _restore(distill_runs["half"])
    assert sa == sb == 4
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(x, y)
    # The teacher rides along unchanged; the student moved away from it.
    _, teacher, _ = network_dir.load_network(distill_runs["teacher"])
    for x, y in zip(jax.tree.leaves(a["teacher"]), jax.tree.leaves(teacher["params"]),
                    strict=True):
        assert np.array_equal(x, y)
    moved = [np.max(np.abs(x - y)) for x, y in zip(jax.tree.leaves(a["params"]),
                                                   jax.tree.leaves(a["teacher"]))]
    assert max(moved) > 0
    saved = json.loads((distill_runs["full"] / "config.json").read_text())
    assert saved["network"]["img_resolution"] == 16 and saved["network"]["model_channels"] == 32
    assert saved["distill"]["teacher"] == distill_runs["teacher"]
    assert (distill_runs["full"] / "samples" / "000000000032.png").exists()


@pytest.mark.slow
@pytest.mark.ci
def test_student_images_depend_only_on_the_seed_and_generate_finds_its_sampler(
        distill_runs, tmp_path):
    run = str(distill_runs["full"])
    kw = nets.net_sampler(run)
    assert kw == solvers.FewStep(num_steps=2, teacher_steps=4, sigma_min=0.002,
                                 sigma_max=80.0, rho=7.0)
    assert nets.net_sampler(distill_runs["teacher"]) == solvers.Heun(32)  # a diffusion net
    net, variables, _ = nets.load_net(run)
    a = np.asarray(sampling.sample_images(net, variables, np.arange(6), sampler=kw))
    b = np.asarray(sampling.sample_images(net, variables, np.array([4, 1]), sampler=kw))
    np.testing.assert_array_equal(a[[4, 1]], b)
    assert a.std() > 0
    # The student's 2 steps are not the Heun sampler's.
    heun = np.asarray(sampling.sample_images(net, variables, np.array([4, 1]), sampler=solvers.Heun(2)))
    assert not np.array_equal(heun, b)
    # A copy of the run elsewhere is still a student.
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    assert nets.net_sampler(str(dst)) == kw


@pytest.mark.slow
@pytest.mark.ci
def test_post_hoc_ema_of_a_student_is_sampled_as_a_student(distill_runs, tmp_path):
    from edm2_jax.ema import reconstruction, sweep
    run = str(distill_runs["full"])
    out, = reconstruction.reconstruct(run, [0.07], out_dir=str(tmp_path / "phema"), progress=False)
    assert nets.net_sampler(out) == nets.net_sampler(run)
    net, variables, _ = nets.load_net(out)
    imgs = np.asarray(sampling.sample_images(net, variables, np.arange(2),
                                             sampler=nets.net_sampler(out)))
    assert imgs.shape == (2, 16, 16, 3)
    # `--mode=phema_sweep` measures each post-hoc EMA of a distillation run with the
    # student's few-step sampler, not with 32 Heun steps (63 evaluations of a network
    # trained for 2); a teacher keeps the Heun sampler; --steps replaces either's steps.
    assert sweep.net_sampler(out) == nets.net_sampler(run)
    assert isinstance(sweep.net_sampler(out), solvers.FewStep)
    assert sweep.net_sampler(out, 4) == dataclasses.replace(nets.net_sampler(run), num_steps=4)
    assert sweep.net_sampler(distill_runs["teacher"]) == solvers.Heun(32)
    assert sweep.net_sampler(distill_runs["teacher"], 8) == solvers.Heun(8)


@pytest.mark.slow
@pytest.mark.ci
def test_a_distillation_run_resumes_without_its_teacher(distill_runs, tmp_path):
    """The teacher is frozen in the train state: a run stopped after 2 steps resumes with
    its teacher's folder gone, to the arrays of the run that never stopped."""
    import ml_collections
    from tests.test_train import _restore
    from edm2_jax.training import loop
    teacher = tmp_path / "teacher"
    shutil.copytree(distill_runs["teacher"], teacher)
    config = ml_collections.ConfigDict(distill_runs["config"].to_dict())
    config.distill.teacher = str(teacher)
    run = tmp_path / "run"
    loop.train_and_evaluate(ml_collections.ConfigDict(dict(config.to_dict(),
                                                           total_kimg=0.016)), str(run))
    shutil.rmtree(teacher)
    assert loop.train_and_evaluate(config, str(run))["finished"]
    (sa, a), (sb, b) = _restore(run), _restore(distill_runs["full"])
    assert sa == sb == 4
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(x, y)


@pytest.mark.slow
@pytest.mark.ci
def test_teacher_errors_are_named_before_anything_is_built(distill_runs, tmp_path):
    """A missing teacher, or data of another kind than the teacher's, fail at set-up with
    the flag named, before the step compiles; the output directory holds no state."""
    import ml_collections
    from edm2_jax.training import loop
    config = ml_collections.ConfigDict(distill_runs["config"].to_dict())
    missing = tmp_path / "nowhere"
    config.distill.teacher = str(missing)
    with pytest.raises(FileNotFoundError, match="--config.distill.teacher="):
        loop.train_and_evaluate(config, str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()  # no workdir, no train.lock left behind
    # The teacher is 16x16x3; Fashion-MNIST-like data of 8x8 grey images are not its kind.
    from tests.test_train import make_image_folder
    config.distill.teacher = distill_runs["teacher"]
    config.data.path = str(make_image_folder(tmp_path / "grey", n=4, resolution=8))
    with pytest.raises(ValueError, match="the teacher .* has network.img_resolution=16"):
        loop.train_and_evaluate(config, str(tmp_path / "b"))
    assert not (tmp_path / "b" / "checkpoints").exists()
    with pytest.raises(ValueError, match="distill.steps"):
        config.distill.steps = 0
        configs.validate(config)


# ---------------------------------------------------------------------------------------
# The distillation step: independent of the device count and of micro-batching


def _distill_step_config():
    from tests.test_train import step_config
    c = step_config()
    configs.with_objective(c, "consistency")
    c.distill.update(teacher="(in the state)", steps=2, teacher_steps=4)
    return c


def distill_steps(num_accum: int = 1, num_devices: int = 1):
    """One jitted distillation step from a random student and a different random teacher
    (`test_train.random_state` with two seeds) on `num_devices` devices; numpy."""
    from edm2_jax.training import sharding as shard_lib
    from edm2_jax.training import step as step_lib
    from tests.test_train import random_batch, random_state
    config = _distill_step_config()
    state, net, tx = random_state(config, seed=0)
    state["teacher"] = random_state(config, seed=7)[0]["params"]
    fn = step_lib.jit_train_step(step_lib.make_train_step(config, net, tx, num_accum),
                                 shard_lib.make_mesh(num_devices))
    return jax.device_get(fn(state, random_batch(config, 0)))


def _distill_step_npz(out: str) -> None:
    """In a process with 8 simulated CPU devices: the step on all 8."""
    assert jax.device_count() == 8, jax.devices()
    np.savez(out, *jax.tree.leaves(distill_steps(num_devices=8)))


# Slow (~30 s on 2 cores): the step compiled on 1 and 2 devices, with and without micro-batches.
@pytest.mark.slow
@pytest.mark.ci
def test_distillation_step_does_not_depend_on_devices_or_micro_batches(tmp_path):
    """The same step split over 8 devices, or in 2 micro-batches, gives the one-device
    weights, EMAs and Adam moments to float32 summation-order error (`STEP_TOL` of
    test_train: the batch's gradient sums are the only reductions that change order;
    the teacher's and the target's evaluations are per image). The teacher is carried
    through unchanged."""
    from tests.test_train import STEP_TOL, state_err
    ref, ref_m = distill_steps()
    assert np.isfinite(ref_m["objective"]) and ref_m["grad_norm"] > 0
    acc, _ = distill_steps(num_accum=2)
    err, where = state_err(acc, ref)
    assert err <= STEP_TOL, (err, where)
    state, _ = tree_from_process("tests.test_distill:_distill_step_npz",
                                 tmp_path / "dev8.npz", (ref, ref_m))
    err, where = state_err(state, ref)
    assert err <= STEP_TOL, (err, where)
    for a, b in zip(jax.tree.leaves(state["teacher"]), jax.tree.leaves(ref["teacher"])):
        assert np.array_equal(a, b)


# Slow (~20 s on 2 cores): a latent run distilled and its student sampled.
@pytest.mark.slow
@pytest.mark.ci
def test_a_latent_network_distils_on_latents_and_its_student_stays_latent(tmp_path):
    """An img512-style teacher (a 4-channel SD-VAE latent net, saved as a network
    checkpoint) distils on a latent data set; the student is a latent net (generate asks
    for the VAE) sampled with its few-step sampler."""
    from edm2_jax.model.networks import init_variables, precond_from_config
    from edm2_jax.run import network_dir
    from edm2_jax.training import loop
    from tests.test_train import tiny_config
    from tests.test_vae import R, _arrays, _write_latent_set
    cfg = dict(img_resolution=R, img_channels=4, label_dim=0, model_channels=8,
               channel_mult=(1,), num_blocks=1, attn_resolutions=(), logvar_channels=8)
    net = precond_from_config(cfg)
    teacher = network_dir.save_network(
        str(tmp_path / "latent-teacher"), init_variables(net, jax.random.PRNGKey(0)),
        distill.network_config(net), meta={"encoder": "sd-vae"})
    data = _write_latent_set(tmp_path / "lat", _arrays(8), None, as_zip=False)
    config = tiny_config(data, **{"data.encoder": "sd-vae", "data.use_labels": False,
                                  "objective": "consistency", "distill.teacher": teacher, "distill.steps": 2,
                                  "distill.teacher_steps": 4, "total_kimg": 0.016})
    r = loop.train_and_evaluate(config, str(tmp_path / "student"))
    assert r["finished"] and np.isfinite(r["loss/loss"])
    run = str(tmp_path / "student")
    assert nets.net_encoder(run) == "sd-vae"
    with pytest.raises(ValueError, match="--vae"):
        nets.check_vae(run, None)
    net, variables, _ = nets.load_net(run)
    x = sampling.sample_images(net, variables, np.arange(2), raw=True,
                               sampler=nets.net_sampler(run))
    assert x.shape == (2, R, R, 4) and np.all(np.isfinite(x))


def test_distill_configs_validate_for_every_preset():
    """configs/distill.py builds a valid config for Fashion-MNIST, its tiny variant and
    every img64/img512 preset; a preset student fine-tunes at the teacher's final
    learning rate `ref_lr / sqrt(total_steps / t_ref)` (img64-s: 0.010 / sqrt(2^30 /
    2048 / 35000) = 0.010 / sqrt(14.98)), constant; the Fashion-MNIST one decays."""
    from edm2_jax.model import presets
    from tests.test_train import _config_file
    for variant in ["fashion_mnist", "tiny", *presets.NETWORK_PRESETS]:
        c = _config_file("distill", variant)
        c.distill.teacher = "teacher"
        configs.validate(c)
        assert c.optim.t_ref == (94 if variant == "fashion_mnist" else 0)
    # Fashion-MNIST: 0.005 decaying as 1/sqrt(t) from 94 batches of 64 (6.016 kimg), by
    # hand 0.005 / sqrt(24000 / 6016) = 0.0025032 at the end of its 24 kimg.
    from edm2_jax.training import optim as optim_lib
    c = _config_file("distill", "fashion_mnist")
    end = optim_lib.learning_rate(c.total_kimg * 1000, batch_size=c.batch_size,
                                  ref_lr=c.optim.ref_lr, t_ref=c.optim.t_ref,
                                  rampup_kimg=c.optim.rampup_kimg)
    assert c.total_kimg == 24 and float(end) == pytest.approx(0.0025032, rel=1e-4)
    c = _config_file("distill", "img64-s")
    assert c.optim.ref_lr == pytest.approx(0.010 / np.sqrt(2**30 / 2048 / 35000), rel=1e-12)
    assert _config_file("distill", "img512-xs").data.encoder == "sd-vae"
    with pytest.raises(ValueError, match="unknown variant"):
        _config_file("distill", "img32")
