"""Forward-mode autodiff through the EDM2 network (`model/jvp.py`), on every backend.

- The tangent of `denoiser_jvp` is the derivative of the denoiser: against central
  differences of the same network evaluated in float64, on a tiny network with every
  layer (attention, resampling, the noise and label embedding, forced weight
  normalisation; dropout off).
- The clip's tangent is `torch.clamp`'s derivative (1 at the limits) on every kernel set,
  and the reverse-mode residuals are what they were (the packed mask, the bool mask, the
  CPU's barrier residuals).
- Every backend's forward-mode kernel set traces and computes the same tangent; the
  training step's kernels, hand-written backwards included, are kept.
- The EDM2 loss's gradients under each backend are, bit for bit, those of the kernels'
  former `jax.custom_vjp` formulations, frozen below.
- In a bfloat16 network every convolution and matmul of the tangent pass is bfloat16 in
  and out (the precision policy's audit).
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edm2_jax import backends
from edm2_jax.analysis import precision
from edm2_jax.backends import cpu, gpu
from edm2_jax.model import loss, mp
from edm2_jax.model.jvp import denoiser_jvp
from edm2_jax.model.networks import init_variables, precond_from_config
from tests.tolerances import EPS32, reorder_tol, scaled_err

# Two levels (8x8 and 4x4: resampling down and up), attention in two 4x4 blocks, labels.
TINY = dict(img_resolution=8, img_channels=2, label_dim=3, model_channels=8,
            channel_mult=(1, 2), num_blocks=0, attn_resolutions=(4,), channels_per_head=8)


def _variables(net, seed=0, gain=0.7):
    """Random `{'params', 'buffers'}` of `net` without compiling its init (the shapes from
    `jax.eval_shape`): weights N(0, 1) then force-normalised (Eq. 66), the zero-initialised
    gains set to `gain` so that every layer reaches the output, Fourier buffers drawn as
    `MPFourier` draws them."""
    shapes = jax.eval_shape(lambda: init_variables(net, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(seed)

    def draw(path, s):
        name = jax.tree_util.keystr(path[-1:])
        if s.ndim == 0:
            return jnp.float32(gain)
        if "phases" in name:
            return jnp.asarray(2 * np.pi * rng.uniform(size=s.shape), s.dtype)
        scale = 2 * np.pi if "freqs" in name else 1.0
        return jnp.asarray(scale * rng.standard_normal(s.shape), s.dtype)

    v = jax.tree_util.tree_map_with_path(draw, shapes)
    return {"params": mp.force_normalize(v["params"]), "buffers": v["buffers"]}


def _inputs(n=2):
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    sigma = jnp.array([0.3, 2.0])[:n]
    x = jax.random.normal(k[0], (n, 8, 8, 2)) * jnp.sqrt(0.25 + sigma**2)[:, None, None, None]
    tx = jax.random.normal(k[1], x.shape)
    tsigma = jnp.array([0.5, -0.8])[:n]
    labels = jax.nn.one_hot(jnp.arange(n) % 3, 3)
    return x, sigma, tx, tsigma, labels


def _n_fan_in(params):
    """The sum of every layer's fan-in (the reductions of its convolutions and matmuls)."""
    return sum(math.prod(w.shape[:-1]) for w in jax.tree.leaves(params) if w.ndim >= 2)


@pytest.fixture(scope="module")
def tiny():
    """The float32 TINY network with the model's math: `(net, variables, inputs, (D, dD))`
    with `inputs = (x, sigma, tx, tsigma, labels)` and `denoiser_jvp`'s outputs."""
    net = precond_from_config(TINY)
    variables = _variables(net)
    x, sigma, tx, tsigma, labels = inputs = _inputs()
    out = jax.jit(lambda *a: denoiser_jvp(net, variables, *a, labels))(x, sigma, tx, tsigma)
    return net, variables, inputs, out


# The network evaluated in float64: its traced program, every float32 value, constant and
# dtype parameter promoted to float64 (the network casts to float32 wherever it starts).

def _f64(v):
    return jnp.asarray(v, jnp.float64) if getattr(v, "dtype", None) == jnp.float32 else v


def _eval_float64(jaxpr, consts, *args):
    env = dict(zip(jaxpr.constvars, map(_f64, consts)))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: _f64(v.val) if hasattr(v, "val") else env[v]  # a Literal has .val
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        inner = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr") if k in eqn.params), None)
        if inner is not None:  # jit, remat, custom_jvp_call, custom_vjp_call: the primal, inline
            outs = _eval_float64(getattr(inner, "jaxpr", inner), getattr(inner, "consts", ()),
                                 *ins)
        else:
            assert not list(precision.sub_jaxprs(eqn.params)), eqn.primitive.name
            params = {k: jnp.dtype(jnp.float64) if isinstance(v, np.dtype) and v == jnp.float32
                      else v for k, v in eqn.params.items()}
            outs = eqn.primitive.bind(*ins, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _denoiser_float64(net, variables, x, sigma, labels):
    """The float32 network's program (traced here), to be evaluated under
    `jax.enable_x64` on float64 `(x, sigma)`."""
    closed = jax.make_jaxpr(lambda x, s: net.apply(variables, x, s, labels))(x, sigma)
    return lambda x, s: _eval_float64(closed.jaxpr, closed.consts, x, s)[0]


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_tangent_is_the_derivative_of_the_denoiser_float64_central_differences(tiny):
    """dD against central differences of the same network in float64.

    Tolerance. With `g(h) = D(x + h tx, sigma + h tsigma)`, the central difference
    `(g(h) - g(-h)) / 2h` is off from `g'(0)` by its truncation `h^2 / 6 max|g'''|` plus
    the rounding of the two float64 evaluations over 2h, `<= eps64 sqrt(N) max|g| / h`
    (N below: each evaluation off by the reduction bound of tests/tolerances.py). `g'''`
    is bounded by the third central difference at step 10h. With h = 1e-4 this is
    1e-8 of dD's scale or less: the comparison is dominated by the float32 rounding of
    `denoiser_jvp` itself, a chain of reductions through the network whose lengths sum
    to at most N (every layer's fan-in, all layers counted: an upper bound of any path):
    `reorder_tol(N) = eps32 sqrt(N)` of the scale (tests/tolerances.py, one evaluation
    against the exact value: half of that, the factor 2 being margin). For TINY,
    N = 1702: 4.9e-6. Measured: 1.1e-7 (the float32 tangent), 7.6e-9 (the truncation
    bound; the central differences at h and h/10 differ by 7.5e-9, as h^2 predicts).
    """
    net, variables, (x, sigma, tx, tsigma, labels), (D, dD) = tiny
    n_fan_in = _n_fan_in(variables["params"])
    h = 1e-4
    d64 = _denoiser_float64(net, variables, x, sigma, labels)
    with jax.enable_x64(True):
        d64 = jax.jit(d64)
        x64, s64, tx64, ts64 = (jnp.asarray(a, jnp.float64) for a in (x, sigma, tx, tsigma))
        g = lambda t, ts=ts64: np.asarray(d64(x64 + t * tx64, s64 + t * ts))
        fd = (g(h) - g(-h)) / (2 * h)
        H = 10 * h
        d3 = np.abs(g(2 * H) - 2 * g(H) + 2 * g(-H) - g(-2 * H)).max() / (2 * H**3)
        g0 = g(0.0)
        # Negative control: the derivative in the image alone (the noise level's part
        # dropped) is far from the tangent.
        fd_x = (g(h, 0 * ts64) - g(-h, 0 * ts64)) / (2 * h)
    scale = np.abs(fd).max()
    eps64 = float(np.finfo(np.float64).eps)
    fd_err = (h**2 / 6 * d3 + eps64 * math.sqrt(n_fan_in) * np.abs(g0).max() / h) / scale
    tol = reorder_tol(n_fan_in) + fd_err
    # The float64 network is the float32 one: the same values up to float32 rounding.
    assert scaled_err(D, g0) <= reorder_tol(n_fan_in)
    assert fd_err < 0.01 * reorder_tol(n_fan_in), fd_err
    err = scaled_err(dD, fd)
    assert err <= tol, (err, tol)
    assert scaled_err(dD, fd_x) > 100 * tol


@pytest.mark.parametrize("kernels", [mp.MODEL_MATH, backends.select("cpu").kernels,
                                     gpu.kernels("xla", "bytes")], ids=["xla", "cpu", "bytes"])
def test_clip_tangent_is_torch_clamps_derivative_limits_included(kernels):
    limit = 4.0
    x = jnp.float32([[-5.0, -4.0, -3.999, 0.0, 3.999, 4.0, 5.0, 0.5, 9.0]])
    t = jnp.arange(1.0, 10.0)[None]
    y, ty = jax.jvp(lambda x: kernels.clip_act(x, limit), (x,), (t,))
    np.testing.assert_array_equal(y, jnp.clip(x, -limit, limit))
    np.testing.assert_array_equal(ty, np.where(np.abs(np.asarray(x)) <= limit, t, 0.0))


def test_cpu_mp_silu_tangent_is_the_models():
    x = jnp.linspace(-12.0, 12.0, 97)
    t = jnp.cos(x)
    y, ty = jax.jvp(cpu.mp_silu, (x,), (t,))
    y_ref, ty_ref = jax.jvp(mp.mp_silu, (x,), (t,))
    np.testing.assert_array_equal(y, y_ref)
    assert scaled_err(ty, ty_ref) <= 4 * EPS32  # two formulas of one derivative, a few roundings


# The kernels' former formulations: `jax.custom_vjp`s with hand-written backwards (the
# code before forward mode), frozen here as the reference of the training gradients.

@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _clip_bits_vjp(x, limit):
    return jnp.clip(x, -limit, limit)


def _clip_bits_bwd(limit, packed, dy):
    inside = jnp.unpackbits(packed, axis=-1, count=dy.shape[-1]).astype(jnp.bool_)
    return (jnp.where(inside, dy, jnp.zeros_like(dy)),)


_clip_bits_vjp.defvjp(lambda x, limit: (jnp.clip(x, -limit, limit),
                                        jnp.packbits(mp.clip_mask(x, limit), axis=-1)),
                      _clip_bits_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _clip_mask_vjp(x, limit):
    return jnp.clip(x, -limit, limit)


def _clip_mask_bwd(limit, inside, dy):
    return (jnp.where(inside, dy, jnp.zeros_like(dy)),)


_clip_mask_vjp.defvjp(lambda x, limit: (jnp.clip(x, -limit, limit), mp.clip_mask(x, limit)),
                      _clip_mask_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _cpu_clip_vjp(x, limit):
    return jnp.clip(x, -limit, limit)


_cpu_clip_vjp.defvjp(lambda x, limit: (jnp.clip(x, -limit, limit),
                                       cpu.barrier(lambda x: mp.clip_mask(x, limit), x)),
                     _clip_mask_bwd)


def _silu_derivative(x):
    s = jax.nn.sigmoid(x)
    return (s + x * (s * (1 - s))) / 0.596


@jax.custom_vjp
def _cpu_silu_vjp(x):
    return mp.mp_silu(x)


_cpu_silu_vjp.defvjp(lambda x: (mp.mp_silu(x), cpu.barrier(_silu_derivative, x)),
                     lambda g, dy: (dy * g.astype(dy.dtype),))

FORMER = {
    "xla": mp.Kernels(clip_act=_clip_bits_vjp),
    "cpu": mp.Kernels(mp_silu=_cpu_silu_vjp, clip_act=_cpu_clip_vjp, conv=cpu.conv_relayout),
    "bytes": mp.Kernels(clip_act=_clip_mask_vjp),
}
NOW = {"xla": backends.select("xla").kernels, "cpu": backends.select("cpu").kernels,
       "bytes": gpu.kernels("xla", "bytes")}


@pytest.mark.parametrize("name", sorted(FORMER))
def test_reverse_mode_residuals_are_the_former_ones(name):
    # The backward pass keeps what the custom_vjp kept: the packed bits, the bool mask,
    # the CPU's barrier outputs (shapes and dtypes of the vjp's residuals).
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 4, 24), jnp.bfloat16) * 3

    def residuals(k):
        f = lambda x: k.clip_act(k.mp_silu(x), 2.0)
        return sorted((l.shape, str(l.dtype)) for l in jax.tree.leaves(jax.vjp(f, x)[1]))
    assert residuals(NOW[name]) == residuals(FORMER[name])
    if name == "xla":
        assert ((2, 4, 4, 3), "uint8") in residuals(NOW[name])


def _loss_grads(kernels, dtype):
    """Gradients of the EDM2 loss (Eq. 21 per element, summed over the batch's pixels
    and channels, over the batch size) in the weights, jitted alone as the training step
    differentiates it. One level (three blocks, two with attention: a quicker compile);
    clip_act=1 clips a share of the activations; dropout is on."""
    net = precond_from_config(dict(TINY, channel_mult=(1,), attn_resolutions=(8,),
                                   clip_act=1.0, dropout=0.1), dtype=dtype, kernels=kernels)
    variables = _variables(net)
    k = jax.random.split(jax.random.PRNGKey(3), 3)
    images = jax.random.normal(k[0], (2, 8, 8, 2))
    sigma = jnp.exp(jax.random.normal(k[1], (2,)) - 0.4)
    noisy = images + jax.random.normal(k[2], images.shape) * sigma[:, None, None, None]
    labels = jax.nn.one_hot(jnp.array([0, 2]), 3)

    def objective(params):
        D, logvar = net.apply({"params": params, "buffers": variables["buffers"]}, noisy,
                              sigma, labels, train=True, return_logvar=True,
                              rngs={"dropout": jax.random.PRNGKey(4)})
        return jnp.sum(loss.uncertainty_loss(D, images, sigma, logvar)) / images.shape[0]
    return jax.jit(jax.grad(objective))(variables["params"])


@pytest.mark.parametrize("name,dtype", [
    ("xla", "float32"), ("cpu", "bfloat16"), ("cpu", "float32"), ("bytes", "bfloat16")])
@pytest.mark.slow
@pytest.mark.ci  # ~30 s each on 2 cores: CI runs them after the quick suite
def test_training_gradients_are_the_former_kernels_bit_for_bit(name, dtype):
    now, former = _loss_grads(NOW[name], dtype), _loss_grads(FORMER[name], dtype)
    assert jax.tree.structure(now) == jax.tree.structure(former)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(now), jax.tree.leaves(former)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    assert any(np.abs(np.asarray(a)).max() > 0 for a in jax.tree.leaves(now))


def test_forward_mode_kernels_replace_only_the_reverse_only_ones():
    assert mp.MODEL_MATH.forward_mode() == mp.MODEL_MATH
    for conv_grad in cpu.CONV_GRADS:
        for barriers in (True, False):
            k = backends.select("cpu", cpu_conv_grad=conv_grad, cpu_barriers=barriers).kernels
            f = k.forward_mode()
            assert f.conv is mp.conv_same and f.reverse_only == ()
            assert (f.mp_silu, f.clip_act, f.attention) == (k.mp_silu, k.clip_act, k.attention)
    k = gpu.kernels("cudnn", "bytes")
    assert k.reverse_only == ("attention",)
    f = k.forward_mode()
    assert (f.attention, f.clip_act, f.conv) == (mp.attention, gpu.clip_act_bytes, mp.conv_same)


def test_a_reverse_only_kernel_refuses_jvp_and_its_forward_mode_set_traces():
    # The CPU's 3x3 convolution with its hand-written weight gradient: jax.jvp of the
    # training kernels is refused; `denoiser_jvp` takes the forward-mode set.
    net = precond_from_config(TINY, kernels=backends.select("cpu").kernels)
    variables = _variables(net)
    x, sigma, tx, tsigma, labels = _inputs()
    with pytest.raises(TypeError, match="custom_vjp"):  # raised when lowered
        jax.jit(lambda x: jax.jvp(lambda x: net.apply(variables, x, sigma, labels),
                                  (x,), (tx,))).lower(x)
    jax.jit(lambda x: denoiser_jvp(net, variables, x, sigma, tx, tsigma, labels)).lower(x)


@pytest.mark.parametrize("name", ["cpu", "cpu-matmul", "bytes"])
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_every_backend_computes_the_same_tangent(tiny, name):
    kernels = {"cpu": backends.select("cpu").kernels,
               "cpu-matmul": backends.select("cpu", cpu_conv_grad="matmul").kernels,
               "bytes": gpu.kernels("xla", "bytes")}[name]
    _, variables, (x, sigma, tx, tsigma, labels), (D_ref, dD_ref) = tiny
    net = precond_from_config(TINY, kernels=kernels)
    D, dD = jax.jit(lambda *a: denoiser_jvp(net, variables, *a, labels))(x, sigma, tx, tsigma)
    # The same function; the CPU's MP-SiLU derivative is another formula of the same
    # value (a few roundings apart), carried through the network.
    tol = reorder_tol(_n_fan_in(variables["params"]))
    assert scaled_err(D, D_ref) <= tol and scaled_err(dD, dD_ref) <= tol


@pytest.mark.parametrize("name", ["xla", "cpu", "cudnn"])
def test_bfloat16_tangent_pass_keeps_the_precision_policy(tiny, name):
    """Every convolution and matmul of the bfloat16 network's jvp is bfloat16 in and out
    (the float32 layers apart). cuDNN's attention cannot trace off a GPU; its
    forward-mode set (the model's attention in its place) traces anywhere.

    The model's math also runs, against the float32 network's tangent. Tolerance: each
    rounding of an activation to bfloat16 (relative 2^-8) an independent error, L of them
    along the network with L the bfloat16 convolutions and matmuls of the forward pass
    (each rounds its output), `lam sqrt(L) 2^-8`, with lam = 1 and a factor 2 of margin
    as tests/tolerances.py takes: `eps_bf16 sqrt(L)` = 3.7e-2 (L = 23). Measured: 3.5e-3.
    """
    kernels = {"xla": mp.MODEL_MATH, "cpu": backends.select("cpu").kernels,
               "cudnn": gpu.kernels("cudnn")}[name]
    _, variables, (x, sigma, tx, tsigma, labels), (_, dD_f32) = tiny
    net = precond_from_config(TINY, dtype="bfloat16", kernels=kernels)
    fn = lambda *a: denoiser_jvp(net, variables, *a, labels)
    jaxpr = jax.make_jaxpr(fn)(x, sigma, tx, tsigma)
    assert precision.audit(jaxpr, jnp.bfloat16) == []
    counts = precision.summary(jaxpr)
    # The tangent pass repeats the forward pass's bfloat16 convolutions (linear in the
    # tangent) and takes two matmuls for each of attention's bilinear ones.
    forward = precision.summary(jax.make_jaxpr(lambda x, s: net.clone(
        kernels=mp.MODEL_MATH).apply(variables, x, s, labels))(x, sigma))
    conv, dot = "conv fwd bfloat16->bfloat16", "dot fwd bfloat16->bfloat16"
    assert counts[conv] == 2 * forward[conv] > 0 and counts[dot] > 2 * forward[dot] > 0
    if name == "xla":
        _, dD = jax.jit(fn)(x, sigma, tx, tsigma)
        n_roundings = forward[conv] + forward[dot]
        assert scaled_err(dD, dD_f32) <= float(jnp.finfo(jnp.bfloat16).eps) * math.sqrt(n_roundings)


def test_tangent_shapes_must_match():
    net = precond_from_config(TINY)
    x, sigma, tx, tsigma, labels = _inputs()
    with pytest.raises(ValueError, match="tangents"):
        denoiser_jvp(net, {}, x, sigma, tx, tsigma[0], labels)
