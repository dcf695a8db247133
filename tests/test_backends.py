"""Every backend computes the same network: the kernels change how the gradients are
computed, never the function.

`backends.select` resolves 'auto' from the machine and rejects unknown names and options;
`backends.from_config` reads `config.backend` and gives configs without one the defaults;
the clip's gradient is `torch.clamp`'s (1 at the limits) on every kernel set; a network
built with the CPU kernels has the parameter tree and the outputs of the model's own math,
and its kernels never enter the network config.
"""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from edm2_jax import backends
from edm2_jax.backends import cpu
from edm2_jax.model import mp
from edm2_jax.model.networks import CONFIG_FIELDS, Precond, init_variables, precond_from_config

TINY = dict(img_resolution=16, img_channels=3, label_dim=10, model_channels=32,
            channel_mult=(1, 2), num_blocks=1, attn_resolutions=(8,))


def test_auto_is_cpu_on_the_cpu_backend_and_xla_elsewhere():
    b = backends.select()
    assert b.name == ("cpu" if jax.default_backend() == "cpu" else "xla")
    assert b.unroll_micro_batches == (b.name == "cpu")
    assert backends.select("xla").kernels == mp.MODEL_MATH
    assert not backends.select("xla").unroll_micro_batches
    assert backends.select("cpu").unroll_micro_batches


def test_cpu_kernels_follow_the_options():
    k = backends.select("cpu").kernels
    assert (k.mp_silu, k.clip_act, k.conv) == (cpu.mp_silu, cpu.clip_act, cpu.conv_relayout)
    k = backends.select("cpu", cpu_barriers=False, cpu_conv_grad="xla").kernels
    assert k == mp.MODEL_MATH
    assert backends.select("cpu", cpu_conv_grad="matmul").kernels.conv is cpu.conv_matmul


def test_bad_values_name_the_valid_ones():
    with pytest.raises(ValueError, match="'auto', 'xla', 'cpu'"):
        backends.select("gpu")
    with pytest.raises(ValueError, match="'relayout', 'xla', 'matmul'"):
        backends.select("cpu", cpu_conv_grad="fast")
    with pytest.raises(ValueError, match="cpu_barrier"):
        backends.from_config({"backend": {"cpu_barrier": False}})


def test_from_config_reads_config_backend_with_defaults():
    auto = backends.select()
    assert backends.from_config({}) == auto  # an old run's config.json: no `backend`
    assert backends.from_config(ml_collections.ConfigDict({"batch_size": 8})) == auto
    cfg = ml_collections.ConfigDict({"backend": {"kernels": "cpu", "cpu_conv_grad": "matmul",
                                                 "cpu_barriers": False}})
    b = backends.from_config(cfg)
    assert (b.name, b.cpu_conv_grad, b.cpu_barriers) == ("cpu", "matmul", False)
    assert b.kernels == backends.select("cpu", cpu_conv_grad="matmul", cpu_barriers=False).kernels
    assert backends.from_config({"backend": {"kernels": "xla"}}).kernels == mp.MODEL_MATH


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_clip_gradient_at_the_limits_is_torch_clamps():
    # Closed form: d clip(x, -L, L) / dx = 1 for -L <= x <= L (the limits included), else 0.
    limit = 4.0
    x = np.float32([-5.0, -4.0, -3.999, 0.0, 3.999, 4.0, 5.0])
    want = ((x >= -limit) & (x <= limit)).astype(np.float32)
    assert want[1] == want[5] == 1.0
    for kernels in (mp.MODEL_MATH, backends.select("xla").kernels, backends.select("cpu").kernels):
        g = jax.grad(lambda x: jnp.sum(kernels.clip_act(x, limit)))(jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(g), want)
    torch = pytest.importorskip("torch")
    xt = torch.tensor(x, requires_grad=True)
    torch.clamp(xt, -limit, limit).sum().backward()
    np.testing.assert_array_equal(xt.grad.numpy(), want)


def test_cpu_kernels_compute_the_model_function():
    # MP-SiLU: equal values; its derivative from the closed form the CPU kernel keeps
    # as residual and by autodiff, within float32 rounding.
    x = jnp.linspace(-12.0, 12.0, 97)
    np.testing.assert_array_equal(np.asarray(cpu.mp_silu(x)), np.asarray(mp.mp_silu(x)))
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(cpu.mp_silu(x)))(x),
                               jax.grad(lambda x: jnp.sum(mp.mp_silu(x)))(x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["xla", "cpu"])
@pytest.mark.slow
@pytest.mark.ci  # ~40 s each on 2 cores: CI runs them after the quick suite
def test_network_with_backend_kernels_is_the_same_network(name):
    kernels = backends.select(name).kernels
    net, ref = precond_from_config(TINY, kernels=kernels), precond_from_config(TINY)
    assert net.kernels == kernels and ref.kernels == mp.MODEL_MATH
    v = init_variables(net, jax.random.PRNGKey(0))
    v_ref = init_variables(ref, jax.random.PRNGKey(0))
    assert jax.tree.structure(v) == jax.tree.structure(v_ref)
    for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(v_ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    params = jax.tree.map(lambda a: jnp.full_like(a, 0.5) if a.ndim == 0 else a, v["params"])
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 16, 3))
    args = (x, jnp.array([0.5, 2.0]), jax.nn.one_hot(jnp.array([0, 9]), 10))
    D = net.apply({"params": params, "buffers": v["buffers"]}, *args)
    D_ref = ref.apply({"params": params, "buffers": v["buffers"]}, *args)
    np.testing.assert_array_equal(np.asarray(D), np.asarray(D_ref))


def test_kernels_are_not_a_network_config_field():
    assert "kernels" not in CONFIG_FIELDS
    assert set(CONFIG_FIELDS) | {"kernels", "parent", "name"} == set(Precond.__dataclass_fields__)
    with pytest.raises(ValueError, match="kernels"):
        precond_from_config(dict(TINY, kernels=mp.MODEL_MATH))
