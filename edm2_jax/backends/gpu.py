"""XLA:GPU kernels the 'xla' backend may take in place of the model's own math
(`mp.Kernels`), each the same function computed another way:

  attention 'cudnn': the blocks' attention as cuDNN's fused attention
      (`jax.nn.dot_product_attention(..., implementation='cudnn')`): one kernel where the
      model's math runs two matmuls, the softmax, and the reshapes between them (16.2 ms
      of the img64-s step at batch 128 on an H200, benchmarks/README.md). bfloat16 and
      float16 networks only: a float32 network keeps `mp.attention`, unchanged. The
      matmuls take and give the compute dtype with float32 accumulation, as the
      precision policy asks; the logits stay float32 inside the kernel, where
      `mp.attention` rounds them to the compute dtype before the softmax, so the two
      differ at that rounding.
  clip_mask 'bytes': `clip_act` keeps its gradient's mask as one bool per element
      instead of packed bits (`mp.clip_act`), sparing the packing reductions (1.9 ms of
      that step) for 7/8 of a byte per clipped element of saved memory. The same
      gradient, bit for bit.

  grad_layout 'stored': the training step's gradients of the weights held in the layout
      the train state stores them in (row-major, `with_layout_constraint`) before Adam
      and the EMAs read them. cuDNN's weight-gradient kernels write `[out, kh, kw, in]`;
      left to itself XLA:GPU carries that layout into Adam and transposes the new
      weights back to the stored HWIO in the EMAs' fusions (9.6 ms of transposes in the
      img64-s step, benchmarks/README.md). The same values: a layout is not a value.

The defaults ('xla', 'bits', 'xla') are the model's math and XLA's own layouts;
`backends.select` builds the set.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from edm2_jax.model import mp
from edm2_jax.model.mp import Array, Kernels

ATTENTIONS = ("xla", "cudnn")
CLIP_MASKS = ("bits", "bytes")
GRAD_LAYOUTS = ("xla", "stored")
DEFAULT_ATTENTION, DEFAULT_CLIP_MASK, DEFAULT_GRAD_LAYOUT = "xla", "bits", "xla"


def fused_attention(q: Array, k: Array, v: Array, implementation: str = "cudnn") -> Array:
    """`mp.attention` as one fused kernel (`jax.nn.dot_product_attention`, whose
    `[batch, length, heads, head_dim]` layout is `mp.attention`'s) for bfloat16 and
    float16 `q`, `k`, `v`; float32 ones take `mp.attention` itself. `implementation`:
    'cudnn' (GPUs only), or 'xla' (any device: JAX's own composition)."""
    if q.dtype == jnp.float32:
        return mp.attention(q, k, v)
    return jax.nn.dot_product_attention(q, k, v, scale=1 / math.sqrt(q.shape[-1]),
                                        implementation=implementation)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def clip_act_bytes(x: Array, limit: float) -> Array:
    """`mp.clip_act` (`torch.clamp`'s derivative, in both modes) with its mask kept as
    bools (the residual of the backward pass)."""
    return jnp.clip(x, -limit, limit)


@clip_act_bytes.defjvp
def _clip_jvp(limit, primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.clip(x, -limit, limit), mp.pass_inside(mp.clip_mask(x, limit), t)


def kernels(attention: str = DEFAULT_ATTENTION, clip_mask: str = DEFAULT_CLIP_MASK) -> Kernels:
    """The model's kernels with `attention` ('xla': `mp.attention`; 'cudnn':
    `fused_attention`) and `clip_mask` ('bits': `mp.clip_act`; 'bytes':
    `clip_act_bytes`). cuDNN's attention has a backward and no forward-mode rule (a
    `jax.custom_vjp` inside JAX): it is named in `reverse_only`, and a `jax.jvp` takes
    `Kernels.forward_mode()`, with `mp.attention` in its place. Raises ValueError for
    other values, naming the valid ones."""
    if attention not in ATTENTIONS:
        raise ValueError(f"backend attention={attention!r}: expected one of {ATTENTIONS}")
    if clip_mask not in CLIP_MASKS:
        raise ValueError(f"backend clip_mask={clip_mask!r}: expected one of {CLIP_MASKS}")
    return Kernels(attention=fused_attention if attention == "cudnn" else mp.attention,
                   clip_act=clip_act_bytes if clip_mask == "bytes" else mp.clip_act,
                   reverse_only=("attention",) if attention == "cudnn" else ())


def grad_placement(grad_layout: str = DEFAULT_GRAD_LAYOUT):
    """What the training step applies to the weights' gradients for `grad_layout`:
    'xla' the identity, 'stored' `grads_in_stored_layout`. Raises ValueError for another
    value, naming the valid ones."""
    if grad_layout not in GRAD_LAYOUTS:
        raise ValueError(f"backend grad_layout={grad_layout!r}: expected one of {GRAD_LAYOUTS}")
    return grads_in_stored_layout if grad_layout == "stored" else identity


def grads_in_stored_layout(grads):
    """`grads` (a pytree of arrays), each of rank >= 2 constrained to the row-major
    layout the train state stores its arrays in; the same values."""
    from jax.experimental.layout import Layout, with_layout_constraint

    def place(g):
        if getattr(g, "ndim", 0) < 2:
            return g
        return with_layout_constraint(g, Layout(major_to_minor=tuple(range(g.ndim))))
    return jax.tree.map(place, grads)


def identity(tree):
    return tree
