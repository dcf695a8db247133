"""The precision policy (edm2_jax/analysis/precision.py, docs/recipe.md "Precision"), checked
on the traced programs without a GPU: in a bfloat16 network every convolution and matmul
of the training step (forward and backward) and of the sampler takes bfloat16 operands
and gives a bfloat16 result, except the float32 embedding and uncertainty layers; a
float32 network stays float32 throughout.

XLA:GPU runs a convolution of bfloat16 operands with a float32 result as a float32 TF32
kernel, and the float32 cotangent it produces makes the backward pass float32: on an
H100 that alone halves the training speed. The dtypes are read off `jax.make_jaxpr`, the
program every backend compiles.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from edm2_jax.analysis import precision
from edm2_jax.model import mp
from edm2_jax.model.networks import precond_from_config
from edm2_jax.sampling import sampler as sampler_lib
from edm2_jax.sampling import schedule, solvers
from edm2_jax.training import optim as optim_lib
from edm2_jax.training import state as state_lib
from edm2_jax.training import step as step_lib

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import memory  # noqa: E402  (benchmarks/memory.py: what the loss keeps for its backward pass)


def _config(dtype: str, kernels: str = "xla", batch_per_device: int = 0):
    spec = importlib.util.spec_from_file_location("fmnist_config",
                                                  REPO / "configs" / "fashion_mnist.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()
    c.network.dtype = dtype
    c.backend.kernels = kernels
    c.batch_size = 8
    c.batch_per_device = batch_per_device
    return c


def _step_jaxpr(config, net=None):
    net = net or state_lib.make_network(config)
    tx = optim_lib.make_optimizer(config.optim, int(config.batch_size))
    num_accum = step_lib.num_micro_batches(config, 1)
    r, ch, L = net.img_resolution, net.img_channels, net.label_dim
    state = jax.eval_shape(lambda: state_lib.init_train_state(config, net, tx,
                                                              jax.random.PRNGKey(0)))
    batch = {"image": jax.ShapeDtypeStruct((config.batch_size, r, r, ch), jnp.float32),
             "label": jax.ShapeDtypeStruct((config.batch_size, L), jnp.float32)}
    return jax.make_jaxpr(step_lib.make_train_step(config, net, tx, num_accum))(state, batch)


def _sampler_jaxpr(net, guide_net=None, guidance=1.0, interval=None):
    from edm2_jax.model.networks import init_variables
    v = jax.eval_shape(lambda: init_variables(net, jax.random.PRNGKey(0)))
    gv = v if guide_net is not None else None
    labels = jax.ShapeDtypeStruct((4, net.label_dim), jnp.float32)
    seeds = jax.ShapeDtypeStruct((4,), jnp.uint32)
    fn = functools.partial(sampler_lib._sample, net, guide_net=guide_net, guidance=guidance,
                           sampler=solvers.Heun(4), guidance_interval=interval)
    return jax.make_jaxpr(lambda v, gv, s, l: fn(variables=v, guide_variables=gv, seeds=s,
                                                 labels=l))(v, gv, seeds, labels)


def _num_3x3_layers(config) -> int:
    """The network's 3x3 convolution layers, counted from its parameter shapes."""
    from edm2_jax.model.networks import init_variables
    net = precond_from_config(config.network.to_dict())
    v = jax.eval_shape(lambda: init_variables(net, jax.random.PRNGKey(0)))
    return sum(leaf.shape[:2] == (3, 3) for leaf in jax.tree.leaves(v["params"])
               if leaf.ndim == 4)


def _report(bad):
    return f"{len(bad)} convolutions/matmuls break the precision policy:\n" + "\n".join(
        str(m) for m in bad[:20])


@pytest.mark.parametrize("kernels,batch_per_device", [("xla", 0), ("xla", 4), ("cpu", 0)])
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_bf16_training_step_runs_every_conv_and_matmul_in_bf16(kernels, batch_per_device):
    jaxpr = _step_jaxpr(_config("bfloat16", kernels, batch_per_device))
    ops = precision.matmuls(jaxpr)
    bad = precision.audit(jaxpr, jnp.bfloat16)
    assert not bad, _report(bad)
    # Not vacuous: the step has the forward and backward convolutions of every 3x3 layer
    # in bf16 (input and weight gradient), and the float32 path exists with its backward.
    n3x3 = _num_3x3_layers(_config("bfloat16"))
    bf16_convs = [m for m in ops if m.primitive == "conv_general_dilated"
                  and m.operand_dtypes == ("bfloat16", "bfloat16")]
    assert len([m for m in bf16_convs if not m.backward]) == n3x3
    # (autodiff leaves out the first layer's input gradient: only weights are
    # differentiated; the CPU kernels' custom VJP computes it and traces more)
    backward = len([m for m in bf16_convs if m.backward])
    assert backward == 2 * n3x3 - 1 if kernels == "xla" else backward >= 2 * n3x3
    f32 = [m for m in ops if m.float32_path]
    assert f32 and all(m.operand_dtypes == ("float32", "float32") for m in f32)
    assert any(m.backward for m in f32)
    assert {m.layer for m in f32} == set(precision.FLOAT32_LAYERS)


@pytest.mark.parametrize("guided", [False, True])
def test_bf16_sampler_runs_every_conv_and_matmul_in_bf16(guided):
    net = precond_from_config(_config("bfloat16").network.to_dict())
    guide = net if guided else None
    jaxpr = _sampler_jaxpr(net, guide, 2.0 if guided else 1.0,
                           (0.3, 2.0) if guided else None)
    bad = precision.audit(jaxpr, jnp.bfloat16)
    assert not bad, _report(bad)
    convs = [m for m in precision.matmuls(jaxpr) if m.primitive == "conv_general_dilated"]
    # Every 3x3 layer once per network traced: the sampler's loop evaluates the net once
    # per iteration (predictor or corrector). With the guide, 4 steps and the interval
    # (0.3, 2.0) give three loops, unguided / guided / unguided (steps 0-1, 2, 3): the
    # main net in each, the guide in the middle one.
    if guided:
        from edm2_jax.sampling import guidance
        assert guidance.guided_steps((0.3, 2.0), schedule.edm_sigma_steps(4)) == (2, 3)
    assert len(convs) == _num_3x3_layers(_config("bfloat16")) * (4 if guided else 1)
    assert all(m.operand_dtypes == ("bfloat16", "bfloat16") for m in convs)


def test_float32_network_stays_float32():
    jaxpr = _step_jaxpr(_config("float32"))
    ops = precision.matmuls(jaxpr)
    assert ops and not precision.audit(jaxpr, jnp.float32), _report(
        precision.audit(jaxpr, jnp.float32))
    assert all(m.operand_dtypes == ("float32", "float32") and m.result_dtype == "float32"
               for m in ops)


def _conv_float32_result(x, w):
    """A convolution that asks for a float32 result of its operands whatever their dtype:
    on bf16 operands, the program the policy rules out."""
    return jax.lax.conv_general_dilated(
        x, w, window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        preferred_element_type=jnp.float32).astype(x.dtype)


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_audit_finds_a_float32_result_and_its_float32_backward():
    config = _config("bfloat16")
    net = precond_from_config(config.network.to_dict(),
                              kernels=mp.Kernels(conv=_conv_float32_result))
    bad = precision.audit(_step_jaxpr(config, net), jnp.bfloat16)
    fwd = [m for m in bad if not m.backward]
    # Every 3x3 convolution of the forward pass has a float32 result ...
    assert len(fwd) == _num_3x3_layers(config) and all(m.operand_dtypes == ("bfloat16", "bfloat16")
                                  and m.result_dtype == "float32" for m in fwd)
    # ... and its backward pass runs on float32 operands.
    assert any(m.backward and "float32" in m.operand_dtypes for m in bad)
    assert "conv bfloat16[" in str(fwd[0]) and "-> float32 at " in str(fwd[0])


def test_audit_finds_a_float32_operand_outside_the_float32_layers():
    def f(x, w):
        return jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32)).astype(jnp.bfloat16)
    x = jnp.ones((2, 8), jnp.bfloat16)
    w = jnp.ones((8, 4), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(f)(x, w)
    assert [m.operand_dtypes for m in precision.audit(jaxpr, jnp.bfloat16)] == [
        ("float32", "float32")]
    # The same matmul inside a layer the policy keeps in float32 is allowed.
    def g(x, w):
        with jax.named_scope("emb_linear"):
            return f(x, w)
    jaxpr = jax.make_jaxpr(g)(x, w)
    assert precision.audit(jaxpr, jnp.bfloat16) == []
    assert precision.summary(jaxpr) == {"dot fwd float32->float32 (float32 path)": 1}


def test_float32_layers_exist_in_the_network():
    """`FLOAT32_LAYERS` names layers of the network (a rename would silently make the
    audit stricter or looser): each one's matmul is in the traced bf16 training step,
    forward and backward, in float32."""
    jaxpr = _step_jaxpr(_config("bfloat16"))
    f32 = [m for m in precision.matmuls(jaxpr) if m.float32_path]
    for name in precision.FLOAT32_LAYERS:
        mine = [m for m in f32 if m.layer == name]
        assert any(m.backward for m in mine) and any(not m.backward for m in mine), name
    assert {m.layer for m in f32} == set(precision.FLOAT32_LAYERS)


def _saved_for_backward(dtype: str, batch: int = 8) -> list:
    """Shapes and dtypes of what the training loss keeps for its backward pass (the
    residuals `jax.vjp` closes over: `benchmarks/memory.py`'s `saved_for_backward`), for
    a bf16/f32 net of the fashion_mnist config."""
    return memory.saved_for_backward(precond_from_config(_config(dtype).network.to_dict()),
                                     batch)


def test_bf16_step_keeps_its_activations_for_the_backward_pass_in_bf16():
    """The activations the backward pass needs are the bulk of the step's memory: a bf16
    network keeps them in bf16, half the bytes of the float32 network's, and no float32
    copy of a feature map (only the per-example embeddings and scalars, and the
    image-sized input and output of the float32 preconditioning and loss)."""
    batch = 8
    per_example = {}
    for dtype in ("float32", "bfloat16"):
        acts = [a for a in _saved_for_backward(dtype, batch) if a.ndim >= 2 and a.shape[0] == batch]
        per_example[dtype] = acts
    net = precond_from_config(_config("float32").network.to_dict())
    image = net.img_resolution ** 2 * net.img_channels
    f32_in_bf16 = [a for a in per_example["bfloat16"] if a.dtype == jnp.float32]
    assert all(a.size // batch <= max(image, 4 * net.model_channels) for a in f32_in_bf16), [
        (a.shape, str(a.dtype)) for a in f32_in_bf16 if a.size // batch > image]
    def nbytes(acts, floating):
        return sum(a.size * a.dtype.itemsize for a in acts
                   if jnp.issubdtype(a.dtype, jnp.floating) == floating)
    # Floats halve (the float32 ones of the bf16 net aside); the clip masks (bits packed
    # in uint8) are the same in both.
    small = sum(a.size * a.dtype.itemsize for a in f32_in_bf16)
    floats = {k: nbytes(v, True) for k, v in per_example.items()}
    assert floats["bfloat16"] <= floats["float32"] / 2 + small, floats
    assert nbytes(per_example["bfloat16"], False) == nbytes(per_example["float32"], False)
    assert any(a.dtype == jnp.bfloat16 for a in per_example["bfloat16"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_keeps_one_map_per_layer_for_the_backward_pass(dtype):
    """Of the attention maps `[N, heads, q, k]` (the largest arrays of the attention
    layers), the backward pass keeps the logits alone, in the compute dtype: the softmax
    weights that both gradients need are recomputed from them (`mp._attend`)."""
    from flax import traverse_util
    from edm2_jax.model.networks import init_variables
    batch = 8
    cfg = _config(dtype).network
    net = precond_from_config(cfg.to_dict())
    variables = jax.eval_shape(lambda: init_variables(net, jax.random.PRNGKey(0)))
    layers = [k for k in traverse_util.flatten_dict(variables["params"]) if "attn_qkv" in k]
    (resolution,) = cfg.attn_resolutions
    tokens = resolution ** 2
    assert layers, "the fashion_mnist net has attention layers"
    maps = [a for a in _saved_for_backward(dtype, batch)
            if a.ndim == 4 and a.shape[0] == batch and a.shape[2:] == (tokens, tokens)]
    assert len(maps) == len(layers), [(a.shape, str(a.dtype)) for a in maps]
    assert all(a.dtype == jnp.dtype(dtype) for a in maps)
