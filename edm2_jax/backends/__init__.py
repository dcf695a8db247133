"""Hardware backends: the kernels the network receives, chosen for the machine.

Role: the model (`edm2_jax.model`) is the paper's math and never asks which machine it
runs on; a `Backend` names the kernel set (`mp.Kernels`) to build it with
(`precond_from_config(cfg, kernels=backend.kernels)`) and how the training step runs
on that machine (`unroll_micro_batches`, `norms_in_one_reduction`). Every backend computes the same function:
values equal, gradients equal up to float32 summation order (cuDNN's fused attention in
a bfloat16 network: up to the rounding of its logits, `backends/gpu.py`).

    'xla'  the model's own math (plain autodiff): GPU, TPU, and CPU when asked for;
           the logged norms a reduction per parameter. On a GPU it may take the
           kernels of `backends/gpu.py` instead: `attention='cudnn'` (cuDNN's fused
           attention, bfloat16 and float16 networks), `clip_mask='bytes'`, and
           `grad_layout='stored'` (the step's gradients in the train state's layout).
    'cpu'  XLA:CPU kernels (`backends/cpu.py`): fusion barriers and a chosen 3x3-conv
           weight-gradient path; the micro-batch loop unrolled; the logged norms one
           reduction each over all parameters.

Selected by `config.backend` (`kernels`: 'auto' | 'xla' | 'cpu', `cpu_conv_grad`,
`cpu_barriers`, `attention`, `clip_mask`, `grad_layout`): `from_config(config)`, or
`select(...)` directly.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from edm2_jax.backends import cpu, gpu
from edm2_jax.model.mp import MODEL_MATH, Kernels

NAMES = ("auto", "xla", "cpu")
# `config.backend`'s defaults, the one source of them.
DEFAULTS = {"kernels": "auto", "cpu_conv_grad": cpu.DEFAULT_CONV_GRAD,
            "cpu_barriers": cpu.DEFAULT_BARRIERS, "attention": gpu.DEFAULT_ATTENTION,
            "clip_mask": gpu.DEFAULT_CLIP_MASK, "grad_layout": gpu.DEFAULT_GRAD_LAYOUT}


@dataclasses.dataclass(frozen=True)
class Backend:
    """A backend: what the network is built with and how the training step runs.

    Attributes:
      name: 'xla' or 'cpu' (never 'auto': `select` resolves it).
      kernels: the kernel set the network takes (`Precond(kernels=...)`).
      unroll_micro_batches: True: the training step's `lax.scan` over micro-batches is
        unrolled (on XLA:CPU an unrolled body runs faster, the sums are the same in the
        same order); False: the loop stays rolled (compile time grows with unrolling).
      norms_in_one_reduction: True: the step's logged grad/update/param norms are each
        one reduction over the concatenated parameters (`step.global_norm`: XLA:CPU
        runs the Fashion-MNIST step 1.10x faster than with a reduction per parameter);
        False: a reduction per parameter and their sum (`optax.tree.norm`: on an H200
        the img64-s step is 1.015x faster, the concatenation's copies costing 2.7 ms
        against 1.7 ms for the extra reductions, benchmarks/README.md). The same values
        up to float32 summation order; the train state is the same either way.
      cpu_conv_grad, cpu_barriers: the CPU options it was selected with (they change
        the kernels only when `name == 'cpu'`).
      attention, clip_mask, grad_layout: the GPU options it was selected with
        (`backends/gpu.py`; they change the kernels and the step only when
        `name == 'xla'`).
      place_grads: what the training step applies to the weights' gradients before the
        optimiser: the identity, or `gpu.grads_in_stored_layout` (`grad_layout='stored'`):
        the same values either way.
    """

    name: str
    kernels: Kernels
    unroll_micro_batches: bool
    norms_in_one_reduction: bool
    cpu_conv_grad: str = cpu.DEFAULT_CONV_GRAD
    cpu_barriers: bool = cpu.DEFAULT_BARRIERS
    attention: str = gpu.DEFAULT_ATTENTION
    clip_mask: str = gpu.DEFAULT_CLIP_MASK
    grad_layout: str = gpu.DEFAULT_GRAD_LAYOUT
    place_grads: Any = gpu.identity


def select(name: str = "auto", *, cpu_conv_grad: str = cpu.DEFAULT_CONV_GRAD,
           cpu_barriers: bool = cpu.DEFAULT_BARRIERS, attention: str = gpu.DEFAULT_ATTENTION,
           clip_mask: str = gpu.DEFAULT_CLIP_MASK,
           grad_layout: str = gpu.DEFAULT_GRAD_LAYOUT) -> Backend:
    """The backend `name`: 'xla', 'cpu', or 'auto' ('cpu' when `jax.default_backend()` is
    'cpu', else 'xla'). `cpu_conv_grad` ('relayout' | 'xla' | 'matmul') and
    `cpu_barriers` set the CPU kernels (`backends/cpu.py`), `attention` ('xla' |
    'cudnn'), `clip_mask` ('bits' | 'bytes') and `grad_layout` ('xla' | 'stored') the
    GPU ones (`backends/gpu.py`).
    Raises ValueError for any other value, naming the valid ones, and for
    `attention='cudnn'` on a process whose devices are not GPUs."""
    if name not in NAMES:
        raise ValueError(f"backend kernels={name!r}: expected one of {NAMES}")
    if cpu_conv_grad not in cpu.CONV_GRADS:
        raise ValueError(f"backend cpu_conv_grad={cpu_conv_grad!r}: expected one of "
                         f"{cpu.CONV_GRADS} (python benchmarks/conv_grad.py says which is "
                         "faster here)")
    gpu_kernels = gpu.kernels(attention, clip_mask)  # these two raise for unknown values
    place_grads = gpu.grad_placement(grad_layout)
    if attention == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(f"backend attention='cudnn' is cuDNN's fused attention, for GPUs; "
                         f"this process's devices are {jax.default_backend()!r}: use "
                         "--config.backend.attention=xla")
    if name == "auto":
        name = "cpu" if jax.default_backend() == "cpu" else "xla"
    options = dict(cpu_conv_grad=cpu_conv_grad, cpu_barriers=bool(cpu_barriers),
                   attention=attention, clip_mask=clip_mask, grad_layout=grad_layout)
    if name == "cpu":
        return Backend("cpu", cpu.kernels(cpu_conv_grad, bool(cpu_barriers)), True, True,
                       **options)
    default = (attention, clip_mask) == (gpu.DEFAULT_ATTENTION, gpu.DEFAULT_CLIP_MASK)
    return Backend("xla", MODEL_MATH if default else gpu_kernels, False, False, **options,
                   place_grads=place_grads)


def from_config(config: Any) -> Backend:
    """`select` with the fields of `config.backend` (a ConfigDict or mapping with
    `kernels`, `cpu_conv_grad`, `cpu_barriers`, `attention`, `clip_mask`,
    `grad_layout`); a config without `backend`, or a `backend` missing fields, takes
    `DEFAULTS` ('auto', 'relayout', True, 'xla', 'bits', 'xla'). Raises ValueError for
    an unknown field or value."""
    get = config.get if hasattr(config, "get") else lambda k, d=None: getattr(config, k, d)
    fields = dict(DEFAULTS, **dict(get("backend", None) or {}))
    unknown = sorted(set(fields) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown config.backend fields {unknown}; valid: {sorted(DEFAULTS)}")
    return select(fields["kernels"], cpu_conv_grad=fields["cpu_conv_grad"],
                  cpu_barriers=fields["cpu_barriers"], attention=fields["attention"],
                  clip_mask=fields["clip_mask"], grad_layout=fields["grad_layout"])
