"""benchmarks/gpu_table.py: the GPU speed table's command runs end to end (here on the CPU,
at a tiny size) and writes its table; its profile summary classifies the kernels that
cuDNN, cuBLAS and XLA:GPU name, and sums their time and the idle gaps exactly."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_table  # noqa: E402


@pytest.mark.parametrize("name,hlo_op,want", [
    # cuDNN convolutions, as XLA:GPU runs them on an H100 (kernel names from its traces).
    ("sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x32",
     "cudnn-conv.12", "conv forward tf32"),
    ("sm90_xmma_wgrad_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc", "cudnn-conv-bw-filter.3",
     "conv weight-grad tf32"),
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "cudnn-conv.7",
     "conv forward bf16"),
    ("sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nchw", "cudnn-conv-bw-input.1",
     "conv input-grad bf16"),
    # cuBLAS / Triton matmuls, reductions, transposes, copies, elementwise fusions.
    ("nvjet_tst_128x192_64x4_1x2_h_bz_coopA_NNT", "custom-call.5", "matmul ?"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "cublas-gemm.2",
     "matmul bf16"),
    ("gemm_fusion_dot_1", "gemm_fusion_dot.1", "matmul ?"),
    ("input_reduce_fusion_3", "reduce.4", "reduction"),
    ("loop_transpose_fusion", "transpose.9", "transpose"),
    ("copy_fusion_2", "copy.1", "copy"),
    ("loop_multiply_fusion_17", "multiply.3", "elementwise"),
])
def test_classify_names_kernels_by_class_and_precision(name, hlo_op, want):
    assert gpu_table.classify(name, hlo_op) == want


def _write_trace(tmp_path, events):
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_profile_summary_sums_device_kernels_and_idle_gaps(tmp_path):
    k = lambda name, ts, dur, pid=2: {"ph": "X", "pid": pid, "tid": 7, "ts": ts,  # noqa: E731
                                      "dur": dur, "name": name, "args": {}}
    _write_trace(tmp_path, [
        k("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32", 0, 100),
        k("loop_add_fusion", 50, 100),          # overlaps the conv on another stream: 0-150 busy
        k("input_reduce_fusion", 200, 50),      # gap 150-200
        k("host_side_launch", 0, 1000, pid=1),  # host events are not the device's time
        k("sm90_xmma_wgrad_implicit_gemm_bf16bf16_bf16f32_f32", 300, 100),  # gap 250-300
    ])
    s = gpu_table.profile_summary(str(tmp_path), steps=2)
    assert s["source"] == "device kernels"
    assert s["span_ms"] == pytest.approx(400 / 1e3 / 2)
    assert s["busy_ms"] == pytest.approx(300 / 1e3 / 2)
    assert s["idle_ms"] == pytest.approx(100 / 1e3 / 2)
    assert s["classes"]["conv forward bf16"] == {"ms": pytest.approx(0.05), "count": 0.5}
    assert s["classes"]["conv weight-grad bf16"]["ms"] == pytest.approx(0.05)
    assert s["classes"]["elementwise"]["ms"] == pytest.approx(0.05)
    assert s["classes"]["reduction"]["ms"] == pytest.approx(0.025)


# About 35 s of CPU time, 20 s on 2 quiet cores: the benchmark's two worker processes
# each start JAX and compile a training step, or a sampler with and without a guide.
@pytest.mark.slow
@pytest.mark.ci
def test_gpu_table_command_writes_its_table_on_cpu(tmp_path):
    out = tmp_path / "table.md"
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path),  # traces, data set
               EDM2_JAX_COMPILATION_CACHE=str(tmp_path / "xla_cache"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_table.py"), "--presets=tiny", "--batch=4",
         "--sample_batch=2", "--steps=2", "--iters=1", "--warmup=1", "--repeats=1",
         "--profile_steps=1", "--data_workers=1,2", f"--out={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = out.read_text()
    row = next(line for line in table.splitlines() if line.startswith("| tiny | edm2-jax |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[2]) > 0 and float(cells[7]) > 0 and float(cells[8]) > 0, row
    assert "## Where our tiny training step goes (host XLA ops" in table
    assert "| idle gaps |" in table
    figures = json.loads((tmp_path / "table.md.json").read_text())
    ours = figures["presets"]["tiny"]["ours"]
    assert ours["train_img_s"] > 0 and ours["temp_gib"] > 0
    assert ours["profile"]["classes"], ours["profile"]
    data = figures["data_pipeline"]
    assert [r["workers"] for r in data["rows"]] == [1, 2] and data["resolution"] == 64
    assert all(r["img_per_s"] > 0 for r in data["rows"])
    assert "Data pipeline (`benchmarks/data_pipeline.py`" in table
    assert (tmp_path / "edm2_jax_data_bench").is_dir()


def test_gpu_table_rejects_an_unknown_preset_before_starting_workers(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_table.py"), "--presets=img64-q",
         f"--out={tmp_path / 't.md'}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown presets ['img64-q']")
    assert not (tmp_path / "t.md").exists()


def test_gpu_table_names_a_missing_package_before_starting_workers(tmp_path):
    """On a GPU machine whose image lacks ml_collections (the configs' ConfigDict), the
    command stops in one line naming the package and how to bring it, not in a worker's
    traceback after the other workers have compiled."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'ml_collections':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, _Hide())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_table.py"), "--presets=tiny",
         f"--out={tmp_path / 't.md'}"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ml_collections not installed here"), proc.stderr[-2000:]
    assert "pip install --no-deps" in last
    assert "READY" not in proc.stdout and not (tmp_path / "t.md").exists()


def test_a_worker_without_a_reply_is_killed_at_the_timeout():
    """A measurement that never ends (on one H200 a step variant ran 16 steps in more than
    236 s) costs `--measure_timeout` seconds and its row, not the rest of the call."""
    w = gpu_table.Worker.__new__(gpu_table.Worker)
    w.kind = w.name = "train"
    w.preset, w.info = "tiny", None
    w._start([sys.executable, "-c", "import sys, time; print('READY {\"compile_s\": 1}', "
              "flush=True); sys.stdin.readline(); time.sleep(600)"], dict(os.environ))
    assert w.ready() == {"compile_s": 1}
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="train worker of tiny gave no RESULT in 2 s"):
        w.ask("measure", timeout=2)
    assert time.monotonic() - t < 30
    assert w.proc.wait(timeout=30) != 0  # killed
    w.close()


def test_variants_are_parsed_with_the_code_change_first(tmp_path):
    (tmp_path / "edm2_jax" / "training").mkdir(parents=True)
    (tmp_path / "edm2_jax" / "training" / "step.py").write_text("")
    v = gpu_table.parse_variants(["no_cmdbuf=--xla_gpu_enable_command_buffer="], str(tmp_path))
    assert list(v) == ["against", "no_cmdbuf"]
    assert v["against"]["code"] == str(tmp_path) and v["against"]["xla_flags"] == ""
    assert v["no_cmdbuf"] == {"xla_flags": "--xla_gpu_enable_command_buffer=", "code": "",
                              "what": "--xla_gpu_enable_command_buffer=", "set": []}
    v = gpu_table.parse_variants([], "", ["cudnn=backend.attention=cudnn,backend.clip_mask=bytes"])
    assert v["cudnn"]["set"] == ["backend.attention=cudnn", "backend.clip_mask=bytes"]
    for bad in (["cudnn"], ["cudnn=attention"], ["x y=a=b"], ["train=a=b"], ["c=a=b", "c=a=c"]):
        with pytest.raises(SystemExit, match="error: --config_variant="):
            gpu_table.parse_variants([], "", bad)
    config = gpu_table.build_config("tiny", 4, "float32", ["backend.clip_mask=bytes",
                                                           "backend.cpu_barriers=False"])
    assert config.backend.clip_mask == "bytes" and config.backend.cpu_barriers is False
    for bad in (["x"], ["a b=--f"], ["x=f"], ["release=--f"], ["x=--f", "x=--g"]):
        with pytest.raises(SystemExit, match="error: --variant="):
            gpu_table.parse_variants(bad, "")
    with pytest.raises(SystemExit, match="is not an edm2-jax checkout"):
        gpu_table.parse_variants([], str(tmp_path / "nowhere"))


@pytest.mark.slow
@pytest.mark.ci
def test_gpu_table_measures_a_variant_and_another_checkout_beside_the_plain_step(tmp_path):
    """`--against=DIR` runs the training step of the package in DIR (here a copy of this
    one), `--variant` the step under other XLA flags, `--config_variant` with other config
    fields (the GPU's clip mask, on the 'xla' backend); the rows, their kernel classes and
    the plain step measured before and after them are in the table."""
    import shutil
    shutil.copytree(REPO / "edm2_jax", tmp_path / "other" / "edm2_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "table.md"
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path),
               EDM2_JAX_COMPILATION_CACHE=str(tmp_path / "xla_cache"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_table.py"), "--presets=tiny", "--batch=4",
         "--sample_batch=2", "--steps=2", "--iters=1", "--warmup=1", "--repeats=1",
         "--profile_steps=1", "--data_workers=", f"--out={out}",
         f"--against={tmp_path / 'other'}", "--variant=fast_math=--xla_cpu_enable_fast_math=false",
         "--config_variant=bytes=backend.kernels=xla,backend.clip_mask=bytes"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((tmp_path / "table.md.json").read_text())
    tiny = figures["presets"]["tiny"]
    assert list(tiny["variants"]) == ["against", "fast_math", "bytes"]
    assert tiny["variants"]["bytes"]["backend"]["clip_mask"] == "bytes"
    assert tiny["variants"]["fast_math"]["backend"]["clip_mask"] == "bits"
    assert tiny["variants"]["against"]["package"] == str(tmp_path / "other" / "edm2_jax")
    assert tiny["variants"]["fast_math"]["package"] == str(REPO / "edm2_jax")
    for row in tiny["variants"].values():
        assert row["train_img_s"] > 0 and row["profile"]["classes"], row
    assert tiny["ours"]["train_img_s"] > 0 and tiny["ours"]["train_img_s_again"] > 0
    table = out.read_text()
    assert "## Variants of the tiny training step" in table
    assert "| class | plain | against | fast_math | bytes |" in table
