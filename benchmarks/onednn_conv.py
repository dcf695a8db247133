"""Experiment: XLA:CPU's oneDNN convolution thunk, called directly, against XLA's own
convolution (Eigen) on the 3x3 layers of the EDM2 U-Net.

    python benchmarks/onednn_conv.py                       # per-layer fwd / dx / dw times
    python benchmarks/onednn_conv.py --step                # whole fashion_mnist training step
    taskset -c 0 python benchmarks/onednn_conv.py          # one core (trace times add up)

Not used by edm2_jax. jaxlib 0.10.2's CPU runtime links oneDNN and executes a custom
call named `__onednn$convolution` through its `OneDnnOpThunk`, but the pass that would
rewrite convolutions into it (`OneDnnContractionRewriter`) is compiled out of this build
(`--xla_cpu_experimental_onednn_custom_call` and `--xla_cpu_use_onednn` change nothing).
Emitting the custom call from JAX with a `backend_config` that is an
`xla.cpu.BackendConfig` proto in JSON (`onednn_conv_config`: dims, data/filter layouts by
axis index, window pads/strides, dilations stored +1) runs oneDNN's forward convolution
on our NHWC/HWIO buffers. The encoding is XLA-internal and has changed between XLA
versions (spatial axes were once stored 1-based, pads and strides +1; a wrong encoding
crashed the process with SIGILL, not an error), which is why the product does not
depend on it. The input gradient is a forward convolution with the flipped kernel and
in/out swapped, so oneDNN runs it too; the weight gradient as a oneDNN forward
convolution (a kernel the size of the image) fell to its reference implementation,
100-300x slower, so it stays XLA's (the 'relayout' path of `edm2_jax/backends/cpu.py`).

Measured on a 2-core AMD EPYC (quiet machine; benchmarks/README.md, "Tried on CPU"):
forward 32x32x16 at batch 64, 3.3 ms XLA vs 2.3 ms oneDNN; fwd+dx+dw per layer 0.8-1.0x
of XLA's time; the whole fashion_mnist step no faster (two alternated rounds: XLA
620/569 ms, oneDNN 639/597 ms).
Values: forward and input gradient within float32 round-off of XLA's (relative 1e-6;
bitwise equal at 16 channels), weight gradient bitwise equal (the same XLA convolution).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __name__ == "__main__":  # first, before JAX starts: the XLA flags of edm2_jax.main
    from edm2_jax import process
    process.add_default_xla_flags()

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import mlir as _mlir
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import mlir

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from edm2_jax.backends import cpu  # noqa: E402

_conv_p = Primitive("onednn_conv2d")
_conv_p.def_abstract_eval(lambda x, w, *, out_shape, config: ShapedArray(out_shape, x.dtype))


def _lower(ctx, x, w, *, out_shape, config):
    out_type = _mlir.aval_to_ir_type(ctx.module_context, ctx.avals_out[0])
    row_major = (3, 2, 1, 0)
    return _mlir.custom_call("__onednn$convolution", result_types=[out_type], operands=[x, w],
                             backend_config=config, api_version=1,
                             operand_layouts=[row_major, row_major],
                             result_layouts=[row_major]).results


mlir.register_lowering(_conv_p, _lower, platform="cpu")


def _config(src, filt, dst, pad) -> str:
    """`src`/`dst`: (batch axis, feature axis, spatial axes); `filt`: (out axis, in
    axis, spatial axes), all 0-based axis indices of the stored arrays; `pad` per side."""
    def data(b, f, s):
        return {"dims": 4, "data": {"batchDim": b, "featureDim": f, "spatialDims": list(s)}}
    o, i, s = filt
    return json.dumps({"onednnConvConfig": {
        "dims": 4, "featureGroups": 1, "input": data(*src), "output": data(*dst),
        "kernel": {"dims": 4, "filter": {"inputFeatureDim": i, "outputFeatureDim": o,
                                         "spatialDims": list(s)}},
        "window": {"strides": [1, 1], "padLeft": list(pad), "padRight": list(pad),
                   "windowDilations": [1, 1]}}})


NHWC = (0, 3, (1, 2))


def onednn_forward(x, w):
    """'same' 3x3 (odd k) convolution NHWC x HWIO -> NHWC through oneDNN."""
    kh, kw, _, co = w.shape
    return _conv_p.bind(x, w, out_shape=(*x.shape[:3], co),
                        config=_config(NHWC, (3, 2, (0, 1)), NHWC, (kh // 2, kw // 2)))


def onednn_input_grad(dy, w):
    """dx of `onednn_forward`: the flipped kernel with in/out swapped (no transpose)."""
    kh, kw, ci, _ = w.shape
    return _conv_p.bind(dy, jnp.flip(w, (0, 1)), out_shape=(*dy.shape[:3], ci),
                        config=_config(NHWC, (2, 3, (0, 1)), NHWC, (kh // 2, kw // 2)))


@jax.custom_vjp
def onednn_conv(x, w):
    return onednn_forward(x, w)


def _fwd(x, w):
    return onednn_forward(x, w), (x, w)


_XLA_RELAYOUT = cpu.conv_relayout  # XLA's weight gradient ('relayout'), kept below


def _bwd(res, dy):
    x, w = res
    dw = jax.vjp(lambda w_: _XLA_RELAYOUT(x, w_), w)[1](dy)[0]
    return onednn_input_grad(dy, w), dw


onednn_conv.defvjp(_fwd, _bwd)


def _time(fn, *args, iters=10):
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / iters * 1e3


def per_layer():
    rng = np.random.default_rng(0)
    for n, h, ci, co in [(64, 32, 16, 16), (64, 16, 32, 32), (64, 8, 64, 64), (32, 32, 64, 64)]:
        x = jnp.asarray(rng.standard_normal((n, h, h, ci), np.float32))
        w = jnp.asarray(rng.standard_normal((3, 3, ci, co), np.float32))
        dy = jnp.asarray(rng.standard_normal((n, h, h, co), np.float32))
        row = {}
        for name, f in (("xla", _XLA_RELAYOUT), ("onednn", onednn_conv)):
            fwd = jax.jit(f)
            both = jax.jit(lambda x, w, f=f: (f(x, w), *jax.vjp(f, x, w)[1](dy)))
            row[name] = (_time(fwd, x, w), _time(both, x, w), [np.asarray(a) for a in both(x, w)])
        err = [float(np.abs(a - b).max() / np.abs(b).max())
               for a, b in zip(row["onednn"][2], row["xla"][2])]
        print(f"batch {n} {h}x{h} {ci}->{co}: forward xla {row['xla'][0]:.2f} ms onednn "
              f"{row['onednn'][0]:.2f} ms | fwd+dx+dw xla {row['xla'][1]:.2f} ms onednn "
              f"{row['onednn'][1]:.2f} ms | max rel diff y/dx/dw {err[0]:.1e}/{err[1]:.1e}/{err[2]:.1e}")


def whole_step(config_path: str, steps: int):
    from train_throughput import compiled_step, load_config
    for name in ("xla", "onednn", "xla", "onednn"):
        # The CPU backend's kernel set reads `cpu.conv_relayout` when the step is built.
        if name == "onednn":
            cpu.conv_relayout = onednn_conv
        try:
            step, state, batch, info = compiled_step(load_config(config_path))
        finally:
            cpu.conv_relayout = _XLA_RELAYOUT
        for _ in range(2):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
        t = time.perf_counter()
        for _ in range(steps):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
        dt = (time.perf_counter() - t) / steps
        print(f"{name:7s} step {dt * 1e3:.0f} ms  {batch['image'].shape[0] / dt:.1f} img/s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--step", action="store_true", help="time the whole training step")
    ap.add_argument("--config", default=os.path.join(os.path.dirname(HERE), "configs/fashion_mnist.py"))
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if jax.default_backend() != "cpu":
        raise SystemExit("this experiment is about XLA:CPU")
    whole_step(args.config, args.steps) if args.step else per_layer()


if __name__ == "__main__":
    main()
