"""The optimised EDM sampler equals Algorithm 1 (and 2, with churn) of Karras et al. 2022
as the paper writes it: `edm_sampler` (one `fori_loop` of predictor/corrector by parity)
against `heun_sampler_reference` (a Python loop over the steps), on a tiny random network,
unguided, guided, with a guidance interval and with churn."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edm2_jax.sampling.guidance import make_denoiser
from edm2_jax.sampling.schedule import edm_sigma_steps
from edm2_jax.sampling.seeds import seed_churn_noise, seed_noise
from edm2_jax.sampling.solvers import edm_sampler, heun_sampler_reference
from tests.test_sampling import tiny_net
from tests.tolerances import EPS32, forward_terms, reorder_tol

N = 4                       # 2N - 1 = 7 evaluations
SIGMA_MAX = 80.0
SEEDS = np.arange(3)
SHAPE = (8, 8, 3)


@pytest.fixture(scope="module")
def nets():
    return tiny_net(5, 0), tiny_net(5, 1), tiny_net(0, 2)


def _run(sampler, denoise, **kw):
    """`sampler`'s `x_0` under `jax.jit` on the noise of `SEEDS`, as float64."""
    noise, labels = seed_noise(SEEDS, SHAPE), jax.nn.one_hot(jnp.array([0, 2, 4]), 5)
    return np.asarray(jax.jit(lambda n, l: sampler(
        denoise, n, l, num_steps=N, sigma_max=SIGMA_MAX, **kw))(noise, labels), np.float64)


def _reference(denoise, **kw):
    return _run(heun_sampler_reference, denoise, **kw)


def _both(denoise, **kw):
    """`(edm_sampler, heun_sampler_reference, noise)` as float64."""
    return (_run(edm_sampler, denoise, **kw), _reference(denoise, **kw),
            np.asarray(seed_noise(SEEDS, SHAPE)))


def _tol(noise, x, nets, guided):
    """Bound on |edm_sampler - heun_sampler_reference| for the same arithmetic compiled
    into two programs. XLA may round each operation of the two differently (a multiply-add
    fused in one, a constant folded or a division by a constant turned into a product in
    the other): each of the 2N - 1 evaluations has about 8 roundings in Heun's arithmetic
    around it, each at most eps32 / 2 of x's largest magnitude M = t_0 max|noise| (the ODE
    shrinks x with t; churn adds less than that), 4 eps32 M in all. The network may order
    its reductions differently too: `reorder_tol(forward_terms)` of its output's scale,
    taken as the sample's max|x_0|, 3x that for a guided evaluation (|w D - (w - 1) D_g|
    at w = 2). The map carries both without growth (its contraction t_{i+1} / t_i < 1):

        |edm - ref| <= (2N - 1) (4 eps32 M + g reorder_tol(n) max|x_0|),   g = 3 or 1,

    2.0e-3 (unguided) to 2.2e-2 (churn) here, M = 282. Measured on an Intel Xeon
    (XLA:CPU): 3.3e-5 unguided, 2.3e-4 guided, 1.2e-4 with the interval, 9.7e-4 with
    churn, 23x to 61x below the bound (3.0e-6 to 1.3e-5 of max|x_0|; 1 to 32 float32
    ulps of M); the two are not bitwise equal under XLA:CPU."""
    n = max(forward_terms(v["params"]) for _, v in nets)
    M = SIGMA_MAX * np.abs(noise).max()
    return (2 * N - 1) * (4 * EPS32 * M + (3 if guided else 1) * reorder_tol(n) *
                          np.abs(x).max())


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_unguided_sampler_equals_algorithm_1(nets):
    (net, v), _, _ = nets
    fast, ref, noise = _both(make_denoiser(net, v))
    assert np.abs(fast - ref).max() <= _tol(noise, ref, nets, guided=False)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_guided_sampler_equals_algorithm_1(nets):
    (net, v), (g_net, g_v), _ = nets
    fast, ref, noise = _both(make_denoiser(net, v, g_net, g_v, 2.0))   # autoguidance
    assert np.abs(fast - ref).max() <= _tol(noise, ref, nets, guided=True)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_guidance_interval_sampler_equals_algorithm_1(nets):
    """Steps 1 and 2 of 4 guided (`t_3 < sigma_lo < t_2`, `t_1 <= sigma_hi`); guiding
    step 3 as well (the last, Euler step) moves x_0 by more than 5x the bound (measured:
    9.7x, 0.085)."""
    (net, v), _, (u_net, u_v) = nets
    t = edm_sigma_steps(N, sigma_max=SIGMA_MAX)
    interval = (0.5 * (t[2] + t[3]), t[1])
    denoise = make_denoiser(net, v, u_net, u_v, 2.0)
    fast, ref, noise = _both(denoise, guidance_interval=interval)
    tol = _tol(noise, ref, nets, guided=True)
    assert np.abs(fast - ref).max() <= tol
    one_more = _reference(denoise, guidance_interval=(0.0, t[1]))
    assert np.abs(one_more - ref).max() > 5 * tol


@pytest.mark.slow
@pytest.mark.ci
def test_churn_sampler_equals_algorithm_2(nets):
    """Churn on the steps with `S_min <= t_i <= S_max` only (steps 1 and 2 of 4), from
    each seed's own churn stream, with a guidance interval."""
    (net, v), (g_net, g_v), _ = nets
    t = edm_sigma_steps(N, sigma_max=SIGMA_MAX)
    denoise = make_denoiser(net, v, g_net, g_v, 2.0)
    fast, ref, noise = _both(denoise, S_churn=5.0, S_min=0.5 * (t[2] + t[3]), S_max=t[1],
                             churn_noise=seed_churn_noise(SEEDS, SHAPE),
                             guidance_interval=(t[3], t[1]))
    assert np.abs(fast - ref).max() <= _tol(noise, ref, nets, guided=True)


def test_the_reference_raises_as_the_sampler_does():
    denoise = make_denoiser(*tiny_net(0, 2))
    with pytest.raises(ValueError, match="S_churn > 0 needs churn noise"):
        heun_sampler_reference(denoise, jnp.ones((1, 8, 8, 3)), S_churn=1.0)
