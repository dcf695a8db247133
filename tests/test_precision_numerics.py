"""A bfloat16 network computes what the float32 one does, within bfloat16 rounding:
the training loss step by step, and the sampler's images per seed.

The bounds are those `benchmarks/precision_numerics.py` derives (its module docstring):
one bf16 evaluation of the U-Net output F has a relative RMS error of at most
eps = u sqrt(R / 3), u = 2^-8 the bfloat16 unit roundoff and R the roundings to a
bfloat16 result counted on the traced forward program; the objective then moves by at
most eps |dobjective/dF| |F| (Cauchy-Schwarz: the rounded weights are common to every
pixel); the sampler's image by at most eps sum_k w_k c_out(t_k) RMS(F_k) (RMS over
pixels), w_k the Heun coefficients of its 2N - 1 denoiser evaluations, where the
probability-flow ODE does not expand differences. On the Fashion-MNIST config's tiny
variant (`configs/fashion_mnist.py:tiny`) cut to one resolution, the U-Net's encoder
block, decoder blocks with their skip connections and output convolution: the compiles
of the two networks' training steps, probe and samplers take most of the time.
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edm2_jax.sampling import schedule, solvers
from edm2_jax.training import state as state_lib

from tests.tolerances import forward_terms, reorder_tol

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks import precision_numerics as numerics  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    """The config and its initial train state (`state.init_train_state`, on the host)."""
    config = numerics.with_dtype(
        numerics.load_config(str(REPO / "configs" / "fashion_mnist.py") + ":tiny"), "float32")
    config.network.channel_mult = (1,)
    return config, numerics.initial_state(config)


# Slow (~25 s on 2 cores): the training step compiled in float32 and bfloat16, 12 steps each.
@pytest.mark.slow
@pytest.mark.ci
def test_bf16_training_loss_stays_within_rounding_bound_of_f32(setup):
    """Twelve steps of the real jitted step from one initial state on the same batches
    and draws: at every step the bf16 run's objective is within the rounding bound of the
    f32 run's (the weights' divergence during the learning-rate ramp-up stays below it),
    and so is the bf16 objective at the f32 run's own weights; the bound is below the
    objective's minibatch sampling noise. Both objectives are float32 sums of B H W C
    terms, which the two programs may add in different orders: `reorder_tol` of that is
    added. The runs differ (bf16 was used) once the output gain, 0 at initialisation, has
    grown."""
    config, state0 = setup
    batches, _ = numerics.make_batches(config, 12)
    f32, _, probes = numerics.train(config, state0, batches, numerics.make_probe(config), 1)
    bf16, _, _ = numerics.train(numerics.with_dtype(config, "bfloat16"), state0, batches)

    image = batches[0]["image"]
    reorder = reorder_tol(image.size)
    for k, p in probes:
        summed = reorder * abs(p["objective"])
        assert abs(p["objective"] - f32["objective"][k]) <= summed, (k, p)
        diff = abs(bf16["objective"][k] - f32["objective"][k])
        assert diff <= p["rounding"] + summed, (k, diff, p)
        assert abs(p["tf"] - p["objective"]) <= p["rounding"] + summed, (k, p)
        assert p["rounding"] < p["noise"], (k, p)
    assert bf16["objective"][-1] != f32["objective"][-1]
    assert probes[-1][1]["tf"] != probes[-1][1]["objective"]
    assert 0 < probes[0][1]["eps"] < 0.1


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_bf16_sampler_images_within_rounding_bound_of_f32(setup):
    """The deterministic Heun sampler (32 steps, 63 evaluations) on the same weights (the
    net's initialisation with its zero-initialised gains set to 1, so that F and the
    embedding count): per seed, the bf16 image's RMS difference from the f32 image is
    within the ODE bound, its largest difference within the Gaussian-tail bound and its
    uint8 levels within ceil(127.5 max); the measured per-evaluation error of F is within
    eps; and every image differs (bf16 was used)."""
    config, state = setup
    params = jax.tree_util.tree_map_with_path(
        lambda path, w: np.ones_like(w) if str(getattr(path[-1], "key", "")).endswith("gain")
        else w, state["params"])
    variables = {"params": params, "buffers": state["buffers"]}
    s = numerics.sampler_comparison(config, variables, np.arange(8), num_steps=32)

    assert s["max_step_ratio"] <= 3  # where the Heun weights bound the sampler's
    # The bound's F_k come from a loop of its own over the sampler's schedule: the same
    # float32 images up to evaluation order, each evaluation's reorder error (of scale 1,
    # images in [-1, 1]) carried with the evaluation's weight.
    _, ws = numerics.heun_weights(schedule.edm_sigma_steps(32))
    assert s["trajectory_rms_err"] <= reorder_tol(forward_terms(params)) * ws.sum()
    assert 0 < s["eps_measured"] <= s["eps"]
    assert np.all(s["rms"] <= s["rms_bound"]), (s["rms"], s["rms_bound"])
    assert np.all(s["max"] <= s["max_bound"]), (s["max"], s["max_bound"])
    assert np.all(s["u8_max"] <= s["u8_bound"]), (s["u8_max"], s["u8_bound"])
    assert np.all(s["rms"] > 0)
    net32 = state_lib.make_network(config)
    assert numerics.bf16_roundings(net32, variables) == 0  # a float32 network rounds nothing


def test_heun_weights_are_the_samplers_response_to_a_denoiser_offset():
    """With D(x; t) = x + delta f(t) (J = I, the flow neither contracts nor expands) the
    sampler's result moves by exactly delta sum_k w_k f(t_k): the weights of the bound
    are the sampler's own coefficients."""
    num_steps = 6
    t_steps = schedule.edm_sigma_steps(num_steps)
    ts, ws = numerics.heun_weights(t_steps)
    assert len(ts) == 2 * num_steps - 1
    f = lambda t: jnp.sqrt(t)  # noqa: E731
    delta = 1e-2

    def denoise(x, t, labels=None, guided=True):
        return x + delta * f(t)

    noise = jnp.zeros((1, 2, 2, 1), jnp.float32)
    x = solvers.edm_sampler(denoise, noise, num_steps=num_steps)
    want = delta * float(np.sum(ws * np.sqrt(ts)))
    # float32: 2N - 1 positive terms, each through at most 8 roundings of relative
    # eps32 / 2 of a value no larger than the final sum
    tol = 8 * (2 * num_steps - 1) * np.finfo(np.float32).eps / 2 * want
    np.testing.assert_allclose(np.asarray(x), want, rtol=0, atol=tol)
