"""Guidance interval (Kynkaeaenniemi et al. 2024, arXiv:2404.07724) in the EDM sampler:
`guidance.guided_steps`, `edm_sampler(guidance_interval=...)` (and `Heun`'s call),
`sample_images`. Step `i` is guided, both of its evaluations, iff
`sigma_lo < t_i <= sigma_hi`; the other steps evaluate the main net alone."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edm2_jax import process
from edm2_jax.sampling import sampler
from edm2_jax.sampling.guidance import guided_steps, make_denoiser
from edm2_jax.sampling.sampler import sample_images
from edm2_jax.sampling.schedule import edm_sigma_steps
from edm2_jax.sampling.seeds import split_seeds
from edm2_jax.sampling.solvers import Heun, edm_sampler, heun_sampler_reference
from tests.test_sampling import tiny_net
from tests.tolerances import EPS32, forward_terms, reorder_tol

T32 = edm_sigma_steps(32)   # the default schedule, float64
INF = float("inf")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- Which steps are guided -------------------------------------------------------------

def test_the_authors_step_ranges_as_sigma_intervals():
    # The default schedule's noise levels around the authors' ranges (hand-checked with
    # (80^(1/7) + i/31 (0.002^(1/7) - 80^(1/7)))^7).
    np.testing.assert_allclose(T32[[12, 13, 16, 17, 19, 20, 22, 23]],
                               [6.4637, 4.9991, 2.1739, 1.6086, 0.8446, 0.5977, 0.2830,
                                0.1886], atol=1e-4)
    # Their EDM2-XXL settings, inclusive step ranges: FID [17, 22], FD_DINOv2 [13, 19].
    assert guided_steps((0.28, 1.61), T32) == (17, 23)
    assert guided_steps((0.60, 5.0), T32) == (13, 20)
    assert guided_steps(None, T32) == guided_steps((0, INF), T32) == (0, 32)
    # t_i == sigma_hi is guided, t_i == sigma_lo is not.
    assert guided_steps((T32[22], T32[17]), T32) == (17, 22)
    assert guided_steps((0.0, T32[31]), T32) == (31, 32)    # the last (Euler) step only
    # An interval between two noise levels, or above t_0, guides no step.
    a, b = guided_steps((0.19, 0.28), T32)
    assert a == b
    a, b = guided_steps((100.0, 200.0), T32)
    assert a == b


@pytest.mark.parametrize("interval, match", [
    ((1.0, 0.5), "sigma_lo < sigma_hi"), ((0.5, 0.5), "sigma_lo < sigma_hi"),
    ((-0.1, 1.0), "sigma_lo < sigma_hi"), ((math.nan, 1.0), "sigma_lo < sigma_hi"),
    ((1.0,), "two noise levels"), ((0.1, 0.2, 0.3), "two noise levels"),
    ("ab", "two noise levels"), (1.0, "two noise levels")])
def test_bad_intervals_raise_with_the_fix(interval, match):
    with pytest.raises(ValueError, match=match):
        guided_steps(interval, T32)


# --- Closed form: linear denoisers ------------------------------------------------------

class Linear:
    """`D(x; sigma) = c x` in the `Precond.apply` signature, logging `(c, sigma)` of each
    evaluation that really runs (an ordered callback: never dropped, and only run on the
    branch taken)."""

    def __init__(self, c, log, label_dim=0):
        self.c, self.log, self.label_dim = c, log, label_dim

    def apply(self, variables, x, sigma, labels=None):
        jax.debug.callback(lambda s: self.log.append((self.c, float(s))), sigma[0],
                           ordered=True)
        return self.c * x


A, B, W = 0.5, 0.25, 2.5        # main D = A x, guide D_g = B x: guided D_w = 0.875 x
C_GUIDED = B + W * (A - B)      # all exact in float32


def reference_by_evaluation(noise, coefs):
    """Algorithm 1 (`heun_sampler_reference`, 32 steps) with `D = coefs[k] x` at its
    evaluation `k`: the predictor of step `i` is evaluation `2 i`, its corrector `2 i + 1`,
    the last step's Euler step evaluation 62."""
    calls = iter(coefs)
    x = heun_sampler_reference(lambda x, sigma, labels=None: next(calls) * x,
                               jnp.asarray(noise), num_steps=32)
    assert next(calls, None) is None, "one coefficient per evaluation"
    return np.asarray(x, np.float64)


def heun_reference(noise, c):
    """Algorithm 1 for `D = c[i] x` on both evaluations of step `i`."""
    return reference_by_evaluation(noise, [c[i] for i in range(31) for _ in "pc"] + [c[31]])


def run_linear(interval, **kw):
    log = []
    denoise = make_denoiser(Linear(A, log), {}, Linear(B, log), {}, W)
    noise = jax.random.normal(jax.random.PRNGKey(0), (4, 2, 2, 1))
    x = jax.jit(lambda n: edm_sampler(denoise, n, guidance_interval=interval, **kw))(noise)
    jax.effects_barrier()
    return np.asarray(x, np.float64), np.asarray(noise), log


# Each of the 2N - 1 evaluations and its Heun arithmetic adds at most ~16 float32
# roundings of x's own scale (every multiplier lies in (0.5, 1]: no cancellation), and
# relative errors of a product add up: the sampler and the reference are each within
# 16 eps32 (2N - 1) max|ref| of the exact value, |x - ref| <= 32 eps32 (2N - 1) max|ref|
# = 2.4e-4 of the scale at N = 32 (measured on an Intel Xeon: <= 2.4e-7). Guiding any one
# step more or less moves x_0 by >= 6.4e-2 of it.
TOL = 32 * EPS32 * (2 * 32 - 1)


@pytest.mark.parametrize("interval, guided", [
    ((0.28, 1.61), range(17, 23)),            # the authors' FID setting
    ((T32[22], T32[17]), range(17, 22)),      # t_17 == sigma_hi in, t_22 == sigma_lo out
    ((0.0, T32[30]), range(30, 32)),          # ends with a guided Euler step
    ((T32[1], INF), range(0, 1)),             # the first step alone
    ((0.0, INF), range(0, 32)),
    ((0.19, 0.28), range(0, 0)),              # no step
])
def test_each_step_is_guided_or_not_as_the_interval_says(interval, guided):
    x, noise, _ = run_linear(interval)
    c = [C_GUIDED if i in guided else A for i in range(32)]
    ref = heun_reference(noise, c)
    scale = np.abs(ref).max()
    assert np.abs(x - ref).max() <= TOL * scale
    # The test tells a guided step from an unguided one: one step flipped is far off.
    for flip in {guided.start - 1, guided.start, guided.stop - 1, guided.stop} & set(range(32)):
        other = list(c)
        other[flip] = A if other[flip] == C_GUIDED else C_GUIDED
        assert np.abs(x - heun_reference(noise, other)).max() > 100 * TOL * scale, flip


def test_the_heun_correction_of_a_guided_step_is_guided_below_sigma_lo():
    # Step 21 of (t_22, t_17] is guided; its correction is evaluated at t_22 == sigma_lo.
    x, noise, _ = run_linear((T32[22], T32[17]))
    # A sampler that decided per evaluation, by the sigma it is evaluated at, would use
    # the main net alone for that one correction.
    per_eval = reference_by_evaluation(noise, [
        C_GUIDED if 17 <= i < (22 if k == 0 else 21) else A for i in range(31) for k in (0, 1)]
        + [A])
    ref = heun_reference(noise, [C_GUIDED if 17 <= i < 22 else A for i in range(32)])
    scale = np.abs(ref).max()
    assert np.abs(x - ref).max() <= TOL * scale
    assert np.abs(x - per_eval).max() > 100 * TOL * scale


def test_the_guide_runs_only_on_guided_steps():
    # Interval (t_22, t_17]: the guide runs at t_17, t_18; t_18, t_19; ...; t_21, t_22
    # (both evaluations of steps 17..21) and nowhere else; the main net on all 2N - 1.
    _, _, log = run_linear((T32[22], T32[17]))
    main = [s for c, s in log if c == A]
    guide = [s for c, s in log if c == B]
    t = T32
    np.testing.assert_allclose(main, [v for i in range(31) for v in (t[i], t[i + 1])]
                               + [t[31]], rtol=1e-6)
    np.testing.assert_allclose(guide, [v for i in range(17, 22) for v in (t[i], t[i + 1])],
                               rtol=1e-6)
    # Without an interval the guide runs 2N - 1 times too.
    _, _, log = run_linear(None)
    assert sum(c == B for c, _ in log) == 63


def test_churn_raises_the_noise_but_the_step_decides_by_t_i():
    # With churn, step 17 (t_17 == sigma_hi) is evaluated at t_hat = (1 + gamma) t_17,
    # above sigma_hi, and is still guided; step 16 (t_hat_16 > t_16 > sigma_hi) is not.
    gamma = math.sqrt(2) - 1     # min(S_churn / N, sqrt(2) - 1) at S_churn = 40, N = 32
    _, _, log = run_linear((T32[22], T32[17]), S_churn=40.0, rng=jax.random.PRNGKey(1))
    guide = [s for c, s in log if c == B]
    assert len(guide) == 10
    np.testing.assert_allclose(guide[0], (1 + gamma) * T32[17], rtol=1e-6)
    assert guide[0] > T32[17]
    np.testing.assert_allclose(guide[1::2], T32[18:23], rtol=1e-6)   # the corrections


def test_the_interval_is_an_argument_of_the_sampler_call():
    log = []
    noise = jnp.ones((1, 2, 2, 1))
    denoise = make_denoiser(Linear(A, log), {}, Linear(B, log), {}, W)
    a = edm_sampler(denoise, noise, num_steps=32, guidance_interval=(0.28, 1.61))
    b = Heun(32)(denoise, noise, guidance_interval=(0.28, 1.61))
    np.testing.assert_array_equal(a, b)
    assert np.abs(np.asarray(a) - np.asarray(Heun(32)(denoise, noise))).max() > 1e-3


# --- Errors of the public entry points --------------------------------------------------

def test_interval_without_guidance_is_an_error(monkeypatch):
    log = []
    with pytest.raises(ValueError, match="sigma_lo < sigma_hi"):
        edm_sampler(make_denoiser(Linear(A, log), {}, Linear(B, log), {}, W),
                    jnp.ones((1, 2, 2, 1)), guidance_interval=(2.0, 1.0))
    # sample_images checks before it compiles anything.
    monkeypatch.setattr(sampler, "_sample", lambda *a, **k: pytest.fail("compiled"))
    net, v = tiny_net(0, 2)
    with pytest.raises(ValueError, match="guidance_interval.*guidance=1"):
        sample_images(net, v, [0], guidance=1.0, guidance_interval=(0.28, 1.61))
    with pytest.raises(ValueError, match="guidance=2.0 needs guide_net"):
        sample_images(net, v, [0], guidance=2.0, guidance_interval=(0.28, 1.61))
    with pytest.raises(ValueError, match="sigma_lo < sigma_hi"):
        sample_images(net, v, [0], guide_net=net, guide_variables=v, guidance=2.0,
                      guidance_interval=(0.5, 0.1))


# --- A real (tiny) Precond, through sample_images ---------------------------------------

@pytest.fixture(scope="module")
def nets():
    return tiny_net(5, 0), tiny_net(5, 1), tiny_net(0, 2)


@pytest.mark.parametrize("guide, kw", [
    ("auto", dict(sampler=Heun(4, S_churn=5.0))),
    ("cfg", dict(sampler=Heun(4, S_churn=5.0), rng="release")),
])
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_whole_interval_and_no_step_match_plain_sampling_bitwise(nets, guide, kw):
    """`(0, inf)` is the guided sampler and an interval with no step the unguided one,
    bit for bit (the same program), for CFG and autoguidance, with churn and the
    release's per-seed random stream; an interval of some steps is neither."""
    (net, v), (g_net, g_v), (u_net, u_v) = nets
    gn, gv = (u_net, u_v) if guide == "cfg" else (g_net, g_v)
    run = lambda **k: np.asarray(sample_images(
        net, v, [3, 8], guide_net=gn, guide_variables=gv, raw=True, **kw, **k))
    t = edm_sigma_steps(4)
    guided = run(guidance=2.0)
    np.testing.assert_array_equal(run(guidance=2.0, guidance_interval=(0, INF)), guided)
    unguided = run(guidance=1.0)
    np.testing.assert_array_equal(run(guidance=2.0, guidance_interval=(1e-4, 1e-3)), unguided)
    some = run(guidance=2.0, guidance_interval=(t[2], t[1]))   # step 1 of 4
    assert np.abs(some - guided).max() > 1e-3 and np.abs(some - unguided).max() > 1e-3


def _device_images(out: str) -> None:
    """Run in a subprocess: images of seeds 0..3 with an interval, seeds split over the
    process's devices (`split_seeds`), saved to `out`."""
    (net, v), (u_net, u_v) = tiny_net(5, 0), tiny_net(0, 2)
    x = sample_images(net, v, split_seeds(np.arange(4)), guide_net=u_net, guide_variables=u_v,
                      guidance=2.0, sampler=Heun(4, S_churn=5.0), raw=True,
                      guidance_interval=(0.5, 20.0))
    np.save(out, np.asarray(x))
    print(f"devices={jax.device_count()}")


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_interval_images_equal_on_1_and_2_devices(tmp_path, nets):
    """Per-seed images with an interval do not depend on the device split. Tolerance: each
    of the 2N - 1 = 7 evaluations may reorder its reductions (`reorder_tol` of
    `forward_terms`, 1.4e-5 of its scale), a guided one on |w D - (w - 1) D_g| <= 3x the
    scale at w = 2, and the sampler's map carries them without growth: 7 x 3 x 1.4e-5 =
    2.9e-4 of the images' scale (measured on an AMD EPYC: 4.3e-6); a wrong split is O(1)."""
    (net, v), _, (u_net, u_v) = nets
    ref = np.asarray(sample_images(net, v, np.arange(4), guide_net=u_net, guide_variables=u_v,
                                   guidance=2.0, sampler=Heun(4, S_churn=5.0), raw=True,
                                   guidance_interval=(0.5, 20.0)))
    env = {k: val for k, val in os.environ.items()
           if k not in ("XLA_FLAGS", process.DEVICES_SET)}
    env["XLA_FLAGS"] = f"{process.DEVICE_COUNT_FLAG}=2"
    env.update(process.default_xla_flags(env))
    out = str(tmp_path / "x.npy")
    r = subprocess.run([sys.executable, "-m", "tests.test_guidance_interval", out], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "devices=2" in r.stdout, r.stdout
    got = np.load(out)
    tol = 7 * 3 * reorder_tol(max(forward_terms(n[1]["params"]) for n in nets))
    assert np.abs(got - ref).max() <= tol * np.abs(ref).max()


if __name__ == "__main__":
    _device_images(sys.argv[1])
