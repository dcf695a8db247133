"""The three weight-gradient paths of the CPU backend's 3x3 convolution (XLA's filter-gradient
convolution by autodiff, the same convolution on operands relaid out outside XLA's
fusions, and the shifted-matmul custom VJP) compute the same gradients.

All are the exact gradient of a 3x3 'same' convolution; they differ only in the order
of the float32 sums (the weight gradient sums N*H*W products per element, the input
gradient 3*3*C_out). The bound is `reorder_tol(N*H*W*C_in*C_out)` = 1.0e-5 of each
gradient's scale (tests/tolerances.py; n counts every product of the layer's weight
gradient, a conservative n). Measured here: matmul dw 6.4e-7, dx 0; relayout 0 and 0
(it runs the very convolution autodiff runs, on the same operands).
A wrong kernel flip or transposed weight gradient is O(1) off (negative control below).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edm2_jax import backends
from edm2_jax.backends import cpu
from edm2_jax.model import mp
from tests.tolerances import reorder_tol, scaled_err

N, H, CI, CO = 4, 8, 6, 5


def _grads(fn, x, w):
    return jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w))), argnums=(0, 1)))(x, w)


@pytest.fixture(scope="module")
def inputs():
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    return jax.random.normal(kx, (N, H, H, CI)), jax.random.normal(kw, (3, 3, CI, CO))


@pytest.mark.parametrize("path", ["matmul", "relayout"])
def test_custom_vjp_equals_xla_gradient(inputs, path):
    x, w = inputs
    fn = {"matmul": cpu.conv_matmul, "relayout": cpu.conv_relayout}[path]
    dx_ref, dw_ref = _grads(mp.conv_same, x, w)
    dx, dw = _grads(fn, x, w)
    tol = reorder_tol(N * H * H * CI * CO)
    assert scaled_err(dx, dx_ref) <= tol
    assert scaled_err(dw, dw_ref) <= tol
    # Negative control: a kernel flipped in space is a different (wrong) gradient.
    assert scaled_err(jnp.flip(dw, (0, 1)), dw_ref) > 1000 * tol


def test_relayout_rectangular_kernel(inputs):
    # A rectangular 5x3 kernel and one output channel: the relayout's padding and the
    # [C_in, kh, kw, C_out] -> HWIO transpose are per axis.
    x, _ = inputs
    w53 = jax.random.normal(jax.random.PRNGKey(3), (5, 3, CI, 1))
    dx_ref, dw_ref = _grads(mp.conv_same, x, w53)
    dx, dw = _grads(cpu.conv_relayout, x, w53)
    tol = reorder_tol(N * H * H * CI * CO)
    assert scaled_err(dw, dw_ref) <= tol and scaled_err(dx, dx_ref) <= tol


def test_backend_option_selects_the_path(inputs):
    x, w = inputs
    assert backends.select("cpu").cpu_conv_grad == "relayout"
    assert backends.select("cpu").kernels.conv is cpu.conv_relayout
    for mode in ("relayout", "xla", "matmul"):
        conv = backends.select("cpu", cpu_conv_grad=mode).kernels.conv
        jaxpr = str(jax.make_jaxpr(jax.grad(lambda w: jnp.sum(conv(x, w))))(w))
        assert ("dot_general" in jaxpr) == (mode == "matmul")  # shifted matmuls
        assert ("cond" in jaxpr) == (mode == "relayout")  # the fusion boundary
    # The 'xla' backend's convolution is the model's own, whatever the CPU option.
    assert backends.select("xla", cpu_conv_grad="matmul").kernels.conv is mp.conv_same
    with pytest.raises(ValueError, match="cpu_conv_grad"):
        backends.select("cpu", cpu_conv_grad="fast")
