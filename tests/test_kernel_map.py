"""benchmarks/kernel_map.py: a profile's kernels joined to the model operations they
compute, through the optimised HLO's instructions and their op_names; and the training
step names its own parts (force_normalize, optimizer, ema, logged_norms, draws) so that
the join can tell them apart."""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import kernel_map  # noqa: E402

ROOT = "jit(train_step)"
BWD = f"{ROOT}/transpose(jvp(Precond))/unet/enc_16x16_block0/jvp(Precond)/unet/enc_16x16_block0"

# An optimised module as XLA:GPU prints it: an EMA fusion, a fusion of the backward pass of
# a block's MP-SiLU, a cuDNN weight-gradient convolution and a plain transpose.
HLO = f"""HloModule jit_train_step, entry_computation_layout={{(f32[8]{{0}})->f32[8]{{0}}}}

%fused_ema (p0: f32[8], p1: f32[8]) -> f32[8] {{
  %p0 = f32[8]{{0}} parameter(0)
  %p1 = f32[8]{{0}} parameter(1)
  %m = f32[8]{{0}} multiply(f32[8]{{0}} %p0, f32[8]{{0}} %p1), metadata={{op_name="{ROOT}/ema/mul"}}
  ROOT %a = f32[8]{{0}} add(f32[8]{{0}} %m, f32[8]{{0}} %p1), metadata={{op_name="{ROOT}/ema/add"}}
}}

%fused_silu (p0: bf16[8]) -> bf16[8] {{
  %p0 = bf16[8]{{0}} parameter(0)
  %l = bf16[8]{{0}} logistic(bf16[8]{{0}} %p0), metadata={{op_name="{BWD}/checkpoint/jit(silu)/logistic"}}
  ROOT %s = bf16[8]{{0}} multiply(bf16[8]{{0}} %l, bf16[8]{{0}} %p0), metadata={{op_name="{BWD}/checkpoint/jit(silu)/mul"}}
}}

ENTRY %main (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  %loop_add_fusion.2 = f32[8]{{0}} fusion(f32[8]{{0}} %x, f32[8]{{0}} %x), kind=kLoop, calls=%fused_ema, metadata={{op_name="{ROOT}/ema/add"}}
  %loop_multiply_fusion.7 = bf16[8]{{0}} fusion(bf16[8]{{0}} %x), kind=kLoop, calls=%fused_silu
  %cudnn-conv-bw-filter.3 = (bf16[3,3,4,4]{{3,2,1,0}}, u8[0]{{0}}) custom-call(bf16[8]{{0}} %x), custom_call_target="__cudnn$convBackwardFilter", metadata={{op_name="{BWD}/conv_res0/conv_general_dilated"}}
  ROOT %transpose.1 = f32[8]{{0}} transpose(f32[8]{{0}} %loop_add_fusion.2), dimensions={{0}}
}}
"""


def _events():
    meta = [{"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
    k = lambda name, op, dur, pid=2: {"ph": "X", "pid": pid, "ts": 0, "dur": dur,  # noqa: E731
                                      "name": name, "args": {"hlo_op": op}}
    return meta + [
        k("loop_add_fusion_2", "loop_add_fusion.2", 100.0),
        # inside a command buffer: traced under the buffer's thunk, named as its fusion
        k("loop_add_fusion_2", "command_buffer_5", 60.0),
        k("loop_multiply_fusion_7", "loop_multiply_fusion.7", 40.0),
        k("sm90_xmma_wgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc",
          "cudnn-conv-bw-filter.3", 300.0),
        k("transpose_kernel", "transpose.1", 10.0),
        k("memcpy128", "command_buffer_5", 8.0),          # in no instruction
        k("host_thing", "loop_add_fusion.2", 1e6, pid=1),  # a host event: not a kernel
    ]


def test_kernels_are_joined_to_operations_pass_and_class():
    instrs, comps = kernel_map.parse_hlo(HLO)
    assert instrs["loop_add_fusion.2"]["calls"] == ["fused_ema"]
    assert instrs["cudnn-conv-bw-filter.3"]["opcode"] == "custom-call"
    r = kernel_map.attribute(_events(), instrs, comps, steps=2)
    rows = {(x["pass"], x["operation"], x["class"]): x for x in r["rows"]}
    # microseconds over 2 steps -> ms per step
    assert rows["step", "ema", "elementwise"]["ms"] == pytest.approx((100 + 60) / 2e3)
    assert rows["step", "ema", "elementwise"]["kernels"] == 1.0
    assert rows["backward", "MP-SiLU", "elementwise"]["ms"] == pytest.approx(40 / 2e3)
    assert rows["backward", "MP-SiLU", "elementwise"]["modules"][0][0] == "unet/enc_RxR_blockN"
    assert rows["backward", "convolution", "conv weight-grad bf16"]["ms"] == pytest.approx(0.15)
    assert rows["step", "other", "transpose"]["ms"] == pytest.approx(10 / 2e3)
    assert r["total_ms"] == pytest.approx((100 + 60 + 40 + 300 + 10 + 8) / 2e3)
    assert r["unmatched_ms"] == pytest.approx(8 / 2e3)
    assert sum(r["by_operation"].values()) == pytest.approx(r["total_ms"])
    assert "| ema | 0.08 |" in kernel_map.render(r, "t")


@pytest.mark.parametrize("names,want", [
    ([f"{ROOT}/force_normalize/checkpoint/div"], "force_normalize"),
    ([f"{ROOT}/optimizer/mul", f"{ROOT}/optimizer/sqrt"], "optimizer (Adam)"),
    ([f"{ROOT}/logged_norms/reduce_sum"], "logged norms"),
    ([f"{BWD}/jit(unpackbits)/and", f"{BWD}/mul"], "clip_act (mask packing)"),
    ([f"{BWD}/conv_res0/checkpoint/div", f"{BWD}/conv_res0/checkpoint/mul",
      f"{ROOT}/force_normalize/checkpoint/div"], "weight normalisation"),
    ([f"{ROOT}/jvp(Precond)/unet/enc_16x16_block0/checkpoint/reduce_sum"], "pixel norm"),
    ([], "other"),
])
def test_operation_is_the_majority_of_a_kernels_op_names(names, want):
    assert kernel_map.operation_of(names) == want


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_the_training_step_names_its_parts():
    """The step's lowered program carries the named scopes the join reads."""
    import gpu_table
    from edm2_jax.training import optim as optim_lib, state as state_lib, step as step_lib
    from train_throughput import random_train_state
    config = gpu_table.build_config("tiny", 4, "float32")
    net = state_lib.make_network(config)
    tx = optim_lib.make_optimizer(config.optim, 4)
    state = jax.eval_shape(lambda: random_train_state(config, net, tx))
    batch = {"image": jax.ShapeDtypeStruct((4, 16, 16, 3), "float32"),
             "label": jax.ShapeDtypeStruct((4, 10), "float32")}
    text = jax.jit(step_lib.make_train_step(config, net, tx)).lower(state, batch).as_text(
        debug_info=True)
    for scope in ("draws", "force_normalize", "optimizer", "ema", "logged_norms"):
        assert f"jit(train_step)/{scope}/" in text, scope
