"""The precision policy of the network, and its check on a traced program.

The policy (docs/recipe.md, "Precision"), the release's fp16 mode with bfloat16 in its
place:

- A network of compute dtype `dtype` (`Precond(dtype=...)`, `config.network.dtype`)
  runs every convolution and matmul of its U-Net, forward and backward, on `dtype`
  operands with a `dtype` result; GPUs and TPUs accumulate in float32 inside the kernel.
  The activations between layers are `dtype` (`MPConv.dtype` is the compute and output
  dtype, as Flax's `nn.Conv(dtype=...)`).
- Float32 whatever `dtype` is: the stored parameters and their forced normalisation,
  the noise and label embedding (`FLOAT32_LAYERS`, the layers computed in float32, and
  the Fourier features before them), the learned uncertainty (`logvar_linear`), the
  preconditioning `c_skip x + c_out F`, the loss, the gradients, Adam's state and the
  EMAs. Reductions (the norms of `mp.normalize`, the softmax of attention) compute in
  float32 and return `dtype`.
- A float32 network computes in float32 throughout, bit for bit as it always has.

`audit(jaxpr, dtype)` lists every convolution and matmul of a traced program
(`jax.make_jaxpr` of a training step or a sampler) that breaks the policy; the test
suite runs it on the bfloat16 training step and sampler (tests/test_precision.py).
`audit_hlo(text, dtype)` does the same on a compiled program's HLO (`compiled.as_text()`,
e.g. XLA's TPU program: tests/test_tpu_compile.py), where the compiler has the last word.

It reads programs; nothing of the network imports it.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator

import jax.numpy as jnp
import numpy as np

# The layers of `networks.Precond` computed in float32 whatever the compute dtype: the
# noise and label embedding (`UNet.emb_noise`, `UNet.emb_label`, each block's
# `emb_linear`) and the uncertainty head (`Precond.logvar_linear`). Each is a dense
# [N, in] x [in, out] matmul, a negligible cost.
FLOAT32_LAYERS = ("emb_noise", "emb_label", "emb_linear", "logvar_linear")

MATMUL_PRIMITIVES = ("conv_general_dilated", "dot_general")


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One convolution or matmul of a traced program.

    Attributes:
      primitive: 'conv_general_dilated' or 'dot_general'.
      operand_dtypes: the two operands' dtypes, e.g. ('bfloat16', 'bfloat16').
      result_dtype: the result's dtype.
      shapes: the operands' shapes.
      name_stack: where it was traced, e.g. 'transpose(jvp(Precond))/unet/enc_8x8_block0/
        conv_res1' (Flax module names; 'transpose(...)' marks the backward pass).
    """

    primitive: str
    operand_dtypes: tuple[str, ...]
    result_dtype: str
    shapes: tuple[tuple[int, ...], ...]
    name_stack: str

    @property
    def layer(self) -> str:
        """The innermost Flax module (or op name) of `name_stack`."""
        return self.name_stack.rsplit("/", 1)[-1]

    @property
    def float32_path(self) -> bool:
        """Whether it belongs to a layer the policy keeps in float32 (`FLOAT32_LAYERS`)."""
        return any(part in FLOAT32_LAYERS for part in self.name_stack.split("/"))

    @property
    def backward(self) -> bool:
        """Whether it is part of a backward pass (traced under `transpose(...)`)."""
        return "transpose(" in self.name_stack

    def __str__(self) -> str:
        op = "conv" if self.primitive in ("conv_general_dilated", "convolution") else "dot"
        ins = (" x ".join(f"{d}{list(s)}" for d, s in zip(self.operand_dtypes, self.shapes))
               if self.shapes else " x ".join(self.operand_dtypes))
        return f"{op} {ins} -> {self.result_dtype} at {self.name_stack}"


def sub_jaxprs(params: dict) -> Iterator[Any]:
    """The programs nested in an equation's `params` (jit, scan, while, cond branches,
    custom_vjp, remat), as `Jaxpr`s."""
    for value in params.values():
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(getattr(v, "jaxpr", None), "eqns"):
                yield v.jaxpr


def matmuls(jaxpr: Any) -> list[Matmul]:
    """Every `conv_general_dilated` and `dot_general` of `jaxpr` (a `ClosedJaxpr` from
    `jax.make_jaxpr`, or a `Jaxpr`), in program order, nested programs included (jit,
    scan, fori_loop, cond, custom_vjp, remat)."""
    out: list[Matmul] = []

    def walk(jp):
        for eqn in jp.eqns:
            if eqn.primitive.name in MATMUL_PRIMITIVES:
                out.append(Matmul(
                    eqn.primitive.name,
                    tuple(str(v.aval.dtype) for v in eqn.invars[:2]),
                    str(eqn.outvars[0].aval.dtype),
                    tuple(tuple(v.aval.shape) for v in eqn.invars[:2]),
                    str(eqn.source_info.name_stack)))
            for sub in sub_jaxprs(eqn.params):
                walk(sub)

    walk(getattr(jaxpr, "jaxpr", jaxpr))
    return out


def matmul_flops(jaxpr: Any) -> float:
    """Flops of every `conv_general_dilated` and `dot_general` of `jaxpr` (nested programs
    included, each counted once: a loop body once): 2 x their multiply-adds. The paper's
    Table 2 "Gflops" of a network are the multiply-adds of its forward pass, half of this."""
    total = 0.0

    def walk(jp):
        nonlocal total
        for eqn in jp.eqns:
            out = float(np.prod(eqn.outvars[0].aval.shape)) if eqn.outvars else 0.0
            if eqn.primitive.name == "conv_general_dilated":
                rhs = eqn.invars[1].aval.shape
                window = np.prod([rhs[d] for d in eqn.params["dimension_numbers"].rhs_spec[1:]])
                total += 2.0 * out * window / eqn.params["feature_group_count"]
            elif eqn.primitive.name == "dot_general":
                (contract, _), _ = eqn.params["dimension_numbers"]
                total += 2.0 * out * np.prod([eqn.invars[0].aval.shape[d] for d in contract])
            for sub in sub_jaxprs(eqn.params):
                walk(sub)

    walk(getattr(jaxpr, "jaxpr", jaxpr))
    return total


def audit(jaxpr: Any, dtype: Any) -> list[Matmul]:
    """The convolutions and matmuls of `jaxpr` that break the policy for a network of
    compute dtype `dtype` (module docstring): outside `FLOAT32_LAYERS`, one with an
    operand of another dtype than `dtype` or a result of another dtype than `dtype`
    (a float32 result of bfloat16 operands makes XLA:GPU run a float32 TF32 kernel, and
    its backward pass float32). Inside `FLOAT32_LAYERS`, one with a bfloat16/float16
    operand. An empty list: the program keeps the policy. For `dtype` float32 every
    convolution and matmul must be float32."""
    want = str(jnp.dtype(dtype))
    bad = []
    for m in matmuls(jaxpr):
        expect = "float32" if m.float32_path else want
        if any(d != expect for d in m.operand_dtypes) or m.result_dtype != expect:
            bad.append(m)
    return bad


def summary(jaxpr: Any) -> dict[str, int]:
    """Counts of the convolutions and matmuls of `jaxpr` by kind, pass and precision, e.g.
    `{'conv fwd bfloat16->bfloat16': 20, 'dot bwd float32->float32 (float32 path)': 8}`."""
    counts: dict[str, int] = {}
    for m in matmuls(jaxpr):
        op = "conv" if m.primitive == "conv_general_dilated" else "dot"
        key = (f"{op} {'bwd' if m.backward else 'fwd'} {'/'.join(sorted(set(m.operand_dtypes)))}"
               f"->{m.result_dtype}" + (" (float32 path)" if m.float32_path else ""))
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


HLO_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}
_HLO_VALUE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (\w+)\[", re.M)
_HLO_MATMUL = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = (\w+)\[[^\n]*? (convolution|dot)"
                         r"\(%([\w.\-]+), %([\w.\-]+)\)([^\n]*)$", re.M)


def hlo_matmuls(text: str) -> list[Matmul]:
    """Every `convolution` and `dot` of an HLO module's text (`compiled.as_text()`), as
    `Matmul`s: `primitive` the HLO op, dtypes in HLO's names ('bf16', 'f32'), `shapes`
    empty, `name_stack` the op_name of its metadata (the jaxpr's name stack; '' if none).
    XLA's TPU compiler writes dots as convolutions."""
    dtypes = {m.group(1): m.group(2) for m in _HLO_VALUE.finditer(text)}
    out = []
    for m in _HLO_MATMUL.finditer(text):
        result, op, a, b, rest = m.groups()
        name = re.search(r'op_name="([^"]*)"', rest)
        out.append(Matmul(op, (dtypes.get(a, "?"), dtypes.get(b, "?")), result, (),
                          name.group(1) if name else ""))
    return out


def audit_hlo(text: str, dtype: Any) -> list[Matmul]:
    """The convolutions and dots of a compiled HLO module (`hlo_matmuls`) outside
    `FLOAT32_LAYERS` whose operands are not of `dtype`: an empty list when every one
    the compiler kept runs on `dtype` operands. Inside the float32 layers the compiler
    may fold an exact bfloat16-to-float32 conversion into the convolution (a bfloat16
    operand, float32 arithmetic); those are not listed."""
    want = HLO_DTYPES[str(jnp.dtype(dtype))]
    return [m for m in hlo_matmuls(text)
            if not m.float32_path and any(d != want for d in m.operand_dtypes)]
