"""DMD2's GAN head on the 2D toy (edm2_jax/toy/dmd.py; Yin et al. 2024,
arXiv:2405.14867, Sec. 4.3): what the classifier reads and which network each GAN term
trains, on untrained networks."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from edm2_jax.model import mp, networks
from edm2_jax.toy import dmd as toy_dmd
from edm2_jax.toy.data import tree_mixture
from edm2_jax.toy.denoiser import ToyDenoiser, init_denoiser

NET = ToyDenoiser(label_dim=2, hidden=16, num_blocks=1)
GRID = dict(teacher_steps=4, sigma_min=0.002, sigma_max=5.0, rho=7.0)


def _variables(*out_gains: float) -> list[dict]:
    # Untrained denoisers with their output layers on (the gain starts at 0), one per gain.
    v = init_denoiser(NET, jax.random.PRNGKey(0))
    return [{"params": dict(v["params"], out_gain=jnp.float32(g)), "buffers": v["buffers"]}
            for g in out_gains]


@pytest.mark.slow   # ~11 s on 2 cores: out of the quick suite, which is at its budget
@pytest.mark.ci
def test_the_head_reads_what_the_denoisers_output_layer_reads():
    # features() is the last hidden layer: D = c_skip x + c_out out_dense(features).
    v, = _variables(0.7)
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 2))
    sigma = jnp.exp(jax.random.normal(jax.random.PRNGKey(2), (8,)))
    labels = jax.nn.one_hot(jnp.arange(8) % 2, 2)

    @jax.jit
    def both(v, x, sigma, labels):
        h = toy_dmd.features(NET, v["params"], v["buffers"], x, sigma, labels)
        c_skip, c_out, _, _ = networks.precond_coefficients(sigma, NET.sigma_data, 2)
        F = mp.MPConv(NET.hidden, 2).apply({"params": v["params"]["out_dense"]}, h,
                                           gain=v["params"]["out_gain"])
        return h, c_skip * x + c_out * F, NET.apply(v, x, sigma, labels)

    h, from_features, D = both(v, x, sigma, labels)
    assert h.shape == (8, NET.hidden) and h.dtype == jnp.float32
    np.testing.assert_allclose(from_features, D, rtol=1e-5, atol=1e-6)


@pytest.mark.slow   # two compilations of both losses' gradients: ~30 s on 2 cores
@pytest.mark.ci
def test_the_gan_terms_train_the_networks_dmd2_assigns():
    # loss_gen reaches the generator alone (head and features stopped), loss_cls the head
    # and, on DMD2's fake denoiser's features, the fake denoiser (the generator's points
    # stopped); on the frozen teacher's features the fake denoiser's gradient is the one
    # without the head. The distribution-matching and denoising losses route as without
    # the head.
    teacher, fake, gen = _variables(0.7, 0.5, 0.9)
    params = {"gen": gen["params"], "fake": fake["params"],
              "head": toy_dmd.init_head(NET, jax.random.PRNGKey(3))}
    mix, rng = tree_mixture(seed=0), jax.random.PRNGKey(4)

    @functools.partial(jax.jit, static_argnums=2)
    def grads(params, gan_weights, gan_features):
        # The gradients of loss_G and of loss_F, {network: gradient} each.
        def f(p):
            return jnp.stack(toy_dmd.dmd_losses(p, teacher["buffers"], NET, teacher["params"],
                                                mix, rng, batch=64, steps=1, grid=GRID,
                                                gan_weights=gan_weights,
                                                gan_features=gan_features)[:2])
        jac = jax.jacrev(f)(params)
        return [jax.tree.map(lambda g: g[i], jac) for i in (0, 1)]

    def norms(tree):
        return {k: float(optax.tree.norm(v)) for k, v in tree.items()}

    on, off = jnp.ones(2), jnp.zeros(2)
    for features in ("fake", "teacher"):
        (g_on, f_on), (g_off, f_off) = grads(params, on, features), grads(params, off, features)
        loss_g, loss_f = norms(g_on), norms(f_on)
        assert loss_g["head"] == 0 and loss_g["fake"] == 0 and loss_g["gen"] > 0, loss_g
        assert loss_f["gen"] == 0 and loss_f["head"] > 0, loss_f
        plain = norms(g_off)["gen"]
        assert abs(loss_g["gen"] - plain) > 1e-3 * plain, (features, loss_g, plain)
        assert norms(f_off)["head"] == 0   # guidance_cls_loss_weight 0: no classifier
        fake_change = norms(jax.tree.map(jnp.subtract, f_on["fake"], f_off["fake"]))
        if features == "fake":
            assert sum(fake_change.values()) > 0
        else:
            assert sum(fake_change.values()) == 0, fake_change


def test_the_head_reads_the_teacher_or_the_fake_denoiser_only():
    settings = toy_dmd.DMDSettings(gan=True, gan_features="student")
    with pytest.raises(ValueError, match="gan_features='student'"):
        toy_dmd.train_generator(NET, None, None, 1, GRID, settings)
