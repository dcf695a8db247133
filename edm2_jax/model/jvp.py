"""Forward-mode derivative of the EDM2 denoiser in its inputs: what continuous-time
consistency training (sCM, Lu & Song, arXiv:2410.11081) needs of its network.

`denoiser_jvp` is `jax.jvp` of `D(x, sigma) = Precond(x, sigma, labels)` in the image
and the noise level together, with the network's weights held fixed. The network is
computed with `net.kernels.forward_mode()` (`mp.Kernels`): the backend's kernels, except
those with a hand-written backward and no forward-mode rule, for which the model's own
math stands in (the same function).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from edm2_jax.model.networks import Precond

Array = jax.Array


def denoiser_jvp(net: Precond, variables: Any, x: Array, sigma: Array, tx: Array,
                 tsigma: Array, labels: Array | None = None) -> tuple[Array, Array]:
    """`(D, dD)`: the denoiser and its directional derivative `dD = dD/dx tx +
    dD/dsigma tsigma` (`jax.jvp` in `(x, sigma)` at tangents `(tx, tsigma)`).

    A pure function of its arguments (jit it with `net` static, e.g. by closing over it);
    no derivative flows to `variables` unless the caller takes one (sCM's target holds
    `dD` under `jax.lax.stop_gradient`). Dropout is off (`train=False`).

    Args:
      net: a `Precond`, float32 or bfloat16 (`dtype`); its kernels are replaced by
        `net.kernels.forward_mode()`. Under the precision policy
        (`edm2_jax/analysis/precision.py`) every convolution and matmul of the tangent
        pass takes and gives the compute dtype, as the forward pass does.
      variables: `{'params': ..., 'buffers': ...}` of `net`.
      x: noisy images `[N, H, W, C]`, any float dtype (cast to float32).
      sigma: noise levels `[N]` or a scalar, > 0 (cast to float32).
      tx: the image tangent, `x`'s shape; tsigma: the noise-level tangent, `sigma`'s.
      labels: `[N, label_dim]` or None, as `Precond` takes them (no tangent).
    Returns:
      `(D, dD)`, each `[N, H, W, C]` float32. With cuDNN's attention (a bfloat16 network
      on a GPU, `backends/gpu.py`) `D` is the model's attention's, which differs from the
      fused kernel's at the rounding of the logits.
    Raises:
      ValueError: a tangent's shape differs from its primal's.
    """
    x, tx = jnp.asarray(x, jnp.float32), jnp.asarray(tx, jnp.float32)
    sigma, tsigma = jnp.asarray(sigma, jnp.float32), jnp.asarray(tsigma, jnp.float32)
    if tx.shape != x.shape or tsigma.shape != sigma.shape:
        raise ValueError(f"denoiser_jvp: tangents of shapes {tx.shape}, {tsigma.shape} for "
                         f"x {x.shape} and sigma {sigma.shape}: each must be its primal's")
    net = net.clone(kernels=net.kernels.forward_mode())
    return jax.jvp(lambda x, sigma: net.apply(variables, x, sigma, labels), (x, sigma),
                   (tx, tsigma))
