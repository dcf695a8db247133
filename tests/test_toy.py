"""The 2D toy (edm2_jax/toy/: data.py, denoiser.py, autoguidance.py): its density, a
trained denoiser, and what guidance does (Karras et al. 2024, arXiv:2406.02507, Fig. 1) on the tiny setting (`ToySettings.tiny`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edm2_jax.toy import autoguidance, data, denoiser


@pytest.fixture(scope="module")
def mix():
    return data.tree_mixture()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny run of the whole toy (three denoisers trained, five sample sets)."""
    import matplotlib
    matplotlib.use("Agg")
    return autoguidance.run(str(tmp_path_factory.mktemp("toy")), autoguidance.ToySettings.tiny(),
                            verbose=False)


def test_samples_of_the_density_lie_on_its_branches(mix):
    x, cls = data.sample_mixture(mix, jax.random.PRNGKey(0), 4096)
    x, cls = np.asarray(x), np.asarray(cls)
    assert 0.4 < np.mean(cls == 0) < 0.6                       # two classes of equal mass
    d = data.distance_to_branches(mix, x[cls == 0], 0)
    assert np.mean(d < 0.03) > 0.95
    # ... and not on the other class's tree, nor anywhere in the plane:
    assert np.mean(data.distance_to_branches(mix, x[cls == 1], 0) < 0.03) < 0.05
    uniform = np.asarray(jax.random.uniform(jax.random.PRNGKey(1), (4096, 2), minval=-1.3, maxval=1.3))
    assert np.mean(data.distance_to_branches(mix, uniform) < 0.03) < 0.25


def test_log_prob_is_a_normalised_density(mix):
    # Riemann sum of p_sigma over a grid covering the data (spacing a third of the
    # thinnest component's width at this sigma): 1, each class alone and the whole.
    lin = np.linspace(-1.6, 1.6, 321, dtype=np.float32)
    gx, gy = np.meshgrid(lin, lin)
    pts = np.stack([gx.ravel(), gy.ravel()], -1)
    cell = (lin[1] - lin[0]) ** 2
    density = jax.jit(data.log_prob)
    for cls in (None, 0, 1):
        mass = sum(float(jnp.sum(jnp.exp(density(mix, chunk, 0.03, cls))))
                   for chunk in np.array_split(pts, 16)) * cell
        assert abs(mass - 1) < 0.01, (cls, mass)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_ideal_denoiser_is_the_posterior_mean(mix):
    # Tweedie: E[x0 | x] from the closed form equals a Monte-Carlo posterior mean near a
    # branching point, where the posterior is far from Gaussian.
    sigma = 0.15
    x0, cls = data.sample_mixture(mix, jax.random.PRNGKey(2), 1_000_000)
    x0 = np.asarray(x0)[np.asarray(cls) == 0]
    x = x0 + sigma * np.asarray(jax.random.normal(jax.random.PRNGKey(3), x0.shape))
    query = np.asarray(mix.segments[0, 1])                     # end of class 0's trunk
    near = np.sum(np.square(x - query), -1) < 0.02 ** 2
    assert near.sum() > 500
    mc = x0[near].mean(0)
    exact = np.asarray(data.ideal_denoiser(mix, query[None], sigma, 0))[0]
    assert np.linalg.norm(mc - exact) < 0.02, (mc, exact)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_untrained_denoiser_is_c_skip_x():
    net = denoiser.ToyDenoiser(label_dim=2)
    variables = denoiser.init_denoiser(net, jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 2))
    sigma = jnp.linspace(0.01, 10, 16)
    D = net.apply(variables, x, sigma, jax.nn.one_hot(jnp.zeros(16, jnp.int32), 2))
    np.testing.assert_allclose(D, 0.25 / (sigma[:, None] ** 2 + 0.25) * x, rtol=1e-6)


# Slow: the trained tiny toy (three denoisers, ~50 s on 2 cores, built once for these tests).
@pytest.mark.slow
@pytest.mark.ci
def test_trained_denoiser_beats_the_trivial_one(tiny_run):
    mix = tiny_run["mix"]
    for name in ("main", "uncond"):
        net, variables = tiny_run["nets"][name]
        trivial = denoiser.eval_loss(net, None, mix)
        trained = denoiser.eval_loss(net, variables, mix)
        assert trained < 0.25 * trivial, (name, trained, trivial)
    # The autoguide is the weaker model, as autoguidance needs.
    main = denoiser.eval_loss(*tiny_run["nets"]["main"], mix)
    guide = denoiser.eval_loss(*tiny_run["nets"]["guide"], mix)
    assert guide > 1.5 * main, (guide, main)


@pytest.mark.slow
@pytest.mark.ci
def test_autoguidance_moves_samples_onto_the_data(tiny_run):
    m = tiny_run["metrics"]
    assert m["autoguidance"]["mean_logp"] > m["unguided"]["mean_logp"] + 0.5, m
    assert m["autoguidance"]["on_branches"] > m["unguided"]["on_branches"], m


@pytest.mark.slow
@pytest.mark.ci
def test_cfg_collapses_variety_autoguidance_less(tiny_run):
    m = tiny_run["metrics"]
    assert m["cfg"]["coverage"] < m["unguided"]["coverage"] - 0.1, m
    assert m["autoguidance"]["coverage"] > m["cfg"]["coverage"], m


@pytest.mark.slow
@pytest.mark.ci
def test_run_writes_the_plot_and_metrics(tiny_run):
    import json
    import os
    out = os.path.dirname(tiny_run["plot"])
    assert os.path.getsize(tiny_run["plot"]) > 10_000
    saved = json.load(open(os.path.join(out, "metrics.json")))
    assert saved["metrics"]["cfg"] == pytest.approx(tiny_run["metrics"]["cfg"])


@pytest.mark.slow
@pytest.mark.ci
def test_run_writes_the_guidance_interval_row(tiny_run):
    import json
    import os
    saved = json.load(open(os.path.join(os.path.dirname(tiny_run["plot"]), "metrics.json")))
    row = saved["metrics"]["cfg_interval"]
    assert set(row) == {"on_branches", "coverage", "mean_logp"}
    assert np.all(np.isfinite(list(row.values()))), row
    assert row == pytest.approx(tiny_run["metrics"]["cfg_interval"])
    interval = autoguidance.ToySettings.guidance_interval
    assert tuple(saved["settings"]["guidance_interval"]) == interval


@pytest.mark.slow
@pytest.mark.ci
def test_guidance_interval_sample_is_cfg_over_all_steps_unguided_over_none(tiny_run):
    # Same noise (seed 1) and weight as the run's samples: the interval (0, inf) guides
    # every step (CFG, bit for bit); (1e-4, 1e-3), below sigma_min = 0.002, none.
    settings = autoguidance.ToySettings.tiny()
    net, variables = tiny_run["nets"]["main"]
    sample = lambda interval: autoguidance.sample_points(
        net, variables, settings.num_samples, 0, guide=tiny_run["nets"]["uncond"],
        guidance=settings.guidance, num_steps=settings.num_steps, seed=1,
        guidance_interval=interval)
    np.testing.assert_array_equal(sample((0.0, float("inf"))), tiny_run["samples"]["cfg"])
    np.testing.assert_array_equal(sample((1e-4, 1e-3)), tiny_run["samples"]["unguided"])
    x = tiny_run["samples"]["cfg_interval"]
    assert np.abs(x - tiny_run["samples"]["unguided"]).max() > 1e-3   # some steps guided
    with pytest.raises(ValueError, match="sigma_lo < sigma_hi"):
        sample((0.3, 0.1))


@pytest.mark.slow
@pytest.mark.ci
def test_cfg_in_the_low_noise_interval_keeps_the_variety_cfg_loses(tiny_run):
    # The toy's interval (the lowest noise levels) leaves the high ones, where CFG drops
    # branches (arXiv:2404.07724, Sec. 3), unguided.
    m = tiny_run["metrics"]
    assert m["cfg_interval"]["coverage"] > m["cfg"]["coverage"] + 0.05, m
