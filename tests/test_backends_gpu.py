"""backends/gpu.py: the GPU kernels compute the model's functions. `clip_mask='bytes'`
gives `mp.clip_act`'s values and gradients bit for bit; the fused attention takes
`mp.attention`'s layout and scale (checked through JAX's own composition of
`jax.nn.dot_product_attention`, the function cuDNN's kernel implements), leaves a float32
network's attention as it is, and is refused off a GPU in one line naming the flag."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edm2_jax import backends, configs
from edm2_jax.backends import gpu
from edm2_jax.model import mp


def _qkv(dtype, n=2, length=16, heads=3, c=8, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    # Unit-RMS per head and channel, as the blocks' pixel-normalised q, k, v.
    return tuple(mp.normalize(jax.random.normal(k, (n, length, heads, c)), axis=-1)
                 .astype(dtype) for k in ks)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_fused_attention_has_the_models_layout_and_scale():
    q, k, v = _qkv(jnp.float32)
    # The function cuDNN's kernel implements, in JAX's own composition, against ours.
    theirs = jax.nn.dot_product_attention(q, k, v, scale=1 / math.sqrt(q.shape[-1]),
                                          implementation="xla")
    np.testing.assert_allclose(theirs, mp.attention(q, k, v), rtol=1e-5, atol=1e-6)
    # By hand for one query of one head: softmax(q.k / sqrt(c)) v.
    w = jax.nn.softmax(jnp.einsum("c,kc->k", q[1, 5, 2], k[1, :, 2]) / math.sqrt(8))
    np.testing.assert_allclose(mp.attention(q, k, v)[1, 5, 2], w @ v[1, :, 2], rtol=1e-5,
                               atol=1e-6)


def test_a_float32_network_keeps_the_models_attention():
    q, k, v = _qkv(jnp.float32)
    np.testing.assert_array_equal(gpu.fused_attention(q, k, v), mp.attention(q, k, v))


def test_bfloat16_fused_attention_is_the_models_up_to_the_logits_rounding():
    """Both against the float32 attention of the same bfloat16 inputs: each within the
    bound that rounding the logits (|logit| <= sqrt(c) for unit-RMS q, k: half an ulp,
    2**-7 relative) and the bfloat16 result (2**-8) give, times max |v|."""
    q, k, v = _qkv(jnp.bfloat16)
    ref = mp.attention(*(x.astype(jnp.float32) for x in (q, k, v)))
    bound = (2 * math.sqrt(8) * 2.0 ** -8 + 2.0 ** -7) * float(jnp.max(jnp.abs(
        v.astype(jnp.float32))))
    for out in (gpu.fused_attention(q, k, v, implementation="xla"), mp.attention(q, k, v)):
        assert out.dtype == jnp.bfloat16 and out.shape == q.shape
        assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) < bound


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_clip_mask_as_bytes_is_the_same_function_bit_for_bit(dtype):
    x = jnp.array([-300.0, -256.0, -255.5, 0.0, 3.0, 256.0, 256.5, 1e4] * 4, dtype)
    x = x.reshape(4, 8) * jnp.linspace(0.9, 1.1, 8, dtype=dtype)
    x = x.at[0, :2].set(jnp.array([256.0, -256.0], dtype))   # the limits themselves
    dy = jax.random.normal(jax.random.PRNGKey(1), x.shape).astype(dtype)
    for fn in (mp.clip_act, gpu.clip_act_bytes):
        y, vjp = jax.vjp(lambda t, fn=fn: fn(t, 256.0), x)
        np.testing.assert_array_equal(y, mp.clip_act(x, 256.0))
        g, = vjp(dy)
        # torch.clamp's gradient: passes where -256 <= x <= 256, the limits included.
        np.testing.assert_array_equal(g, jnp.where(jnp.abs(x) <= 256.0, dy, 0))


def test_the_backend_takes_the_gpu_kernels_by_name():
    assert backends.select("xla").kernels is mp.MODEL_MATH
    b = backends.select("xla", clip_mask="bytes")
    assert b.kernels.clip_act is gpu.clip_act_bytes and b.kernels.attention is mp.attention
    assert (b.attention, b.clip_mask) == ("xla", "bytes")
    # A config.json of a run from before these fields: the defaults.
    assert backends.from_config({"backend": {"kernels": "xla"}}).kernels is mp.MODEL_MATH
    with pytest.raises(ValueError, match="attention='flash'"):
        backends.select("xla", attention="flash")
    with pytest.raises(ValueError, match="clip_mask='nibbles'"):
        backends.select("xla", clip_mask="nibbles")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the refusal is for other devices")
def test_cudnn_attention_off_a_gpu_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--config.backend.attention=xla"):
        backends.select("xla", attention="cudnn")


@pytest.mark.parametrize("field, value", [("attention", "flash"), ("clip_mask", "nibbles")])
def test_config_validation_names_the_backend_flag(field, value):
    c = configs.base_config()
    c.backend[field] = value
    with pytest.raises(ValueError, match=f"backend.{field}"):
        configs.validate(c)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_grads_in_the_stored_layout_are_the_same_values_and_reach_the_step():
    tree = {"w": jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 4, 5),
            "gain": jnp.float32(2.0), "b": jnp.ones((3,))}
    out = jax.jit(gpu.grads_in_stored_layout)(tree)
    jax.tree.map(np.testing.assert_array_equal, out, tree)
    text = jax.jit(gpu.grads_in_stored_layout).lower(tree).as_text()
    assert text.count("@LayoutConstraint") == 1   # the rank-4 weight alone

    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_table
    from edm2_jax.training import optim as optim_lib, state as state_lib, step as step_lib
    from train_throughput import random_train_state
    for layout, want in (("xla", 0), ("stored", None)):
        config = gpu_table.build_config("tiny", 4, "float32", [
            "backend.kernels=xla", f"backend.grad_layout={layout}"])
        net = state_lib.make_network(config)
        tx = optim_lib.make_optimizer(config.optim, 4)
        state = jax.eval_shape(lambda: random_train_state(config, net, tx))
        batch = {"image": jax.ShapeDtypeStruct((4, 16, 16, 3), "float32"),
                 "label": jax.ShapeDtypeStruct((4, 10), "float32")}
        text = jax.jit(step_lib.make_train_step(config, net, tx)).lower(state, batch).as_text()
        n = text.count("@LayoutConstraint")
        weights = sum(x.ndim >= 2 for x in jax.tree.leaves(state["params"]))
        assert n == (weights if want is None else want), (layout, n, weights)
