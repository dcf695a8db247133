"""One command, one table: edm2-jax against the authors' release on one GPU, for training
and sampling of the released presets, with where our training step's time goes.

    python benchmarks/gpu_table.py --release=/path/to/edm2 --out=gpu_table.md
    python benchmarks/gpu_table.py --presets=img64-s --batch=128 --out=t.md   # ours only
    JAX_PLATFORMS=cpu python benchmarks/gpu_table.py --presets=tiny --batch=8 \
        --sample_batch=4 --steps=4 --out=/tmp/t.md                        # smoke test, CPU
    git worktree add /tmp/before HEAD~1 && python benchmarks/gpu_table.py --presets=img64-s \
        --against=/tmp/before --variant=no_cmdbuf=--xla_gpu_enable_command_buffer=   # A/B

For each preset (`--presets`, default img64-s,img512-s,img64-xs,img512-xs, the S nets
first since the table is rewritten after each preset; `tiny` is a small 16x16 net for
smoke tests), at training batch `--batch` and sampler batch `--sample_batch` (Heun,
`--steps` steps, labels class 0; "guided" = the net guided by itself at `--guidance`,
the cost of classifier-free guidance or autoguidance with a guide of the same size),
it measures:

- img/s of one training step (loss, backward, Adam, EMAs: `compare_release.py`'s
  `Release.train` and our `train_throughput.compiled_step`) and of the sampler, for the
  release (its fp16 mode, as it trains by default) and ours (`--dtype`, bfloat16);
- model TFLOP/s and MFU (convolutions and matmuls counted from the forward jaxpr, x3 for
  a training step, x(2 steps - 1) per sampled image; of `--peak_tflops`, default the
  chip's dense bf16 rate);
- peak device memory of each process (`peak_bytes_in_use`; torch's
  `max_memory_allocated`) and our compiled programs' buffers (`memory_analysis()`:
  temp, and arguments);
- compile time: our training step's lower + compile, and the sampler's first batch
  less a steady batch;
- whether the host's data pipeline keeps up: img/s of the training iterator over 64x64
  PNGs for each of `--data_workers` counts of grain worker processes (`data_pipeline.py`),
  once at the end;
- a `jax.profiler` trace of `--profile_steps` training steps, summed by kernel class:
  convolutions forward / input gradient / weight gradient with their precision, matmuls
  with theirs, reductions, elementwise fusions, transposes, copies, and the idle gaps
  between kernels (`profile_summary`).

A/B of the first preset's training step: `--against=DIR` (a checkout of another commit:
its package), `--variant NAME=XLA_FLAGS` and `--config_variant NAME=FIELD=VALUE,...`
(config fields, e.g. `backend.attention=cudnn`; both repeatable) each add a training worker that
compiles with the others and is measured, then profiled, alone on the device, between two
measurements of the plain step (their mean is the "plain" the variants are compared with;
the two together show the drift); the table gives each variant's compile time, img/s,
memory and kernel classes beside the plain step's.

Each side runs in its own processes (ours: one for training, one for sampling, so each
peak is its own; the release: one, which builds its network when measured). All start
at once: ours compile in parallel (`--serial_compile`: one at a time) while the
release's import torch. Measuring starts when every program has compiled (XLA:GPU
autotunes on the GPU), then every measurement runs alone on the GPU, one process at a
time, each side warmed up first and timed over `--iters` steps or batches.

It needs what the package imports (jax, flax, optax, orbax, ...), ml_collections for the
configs and, with `--release`, torch. GPU images often lack ml_collections: bring its
wheel (`pip install --no-deps --target DIR ml_collections-*.whl`, then `PYTHONPATH=DIR`);
without it the command stops in one `error:` line before starting anything.
The table goes to `--out` as Markdown (and the raw figures to `<out>.json`), rewritten
after every reply of a worker, so that a call cut short keeps what it measured, and is
printed last. A worker that gives no reply within `--measure_timeout` seconds is killed
and its row says so (on one H200 the img64-s step compiled with
`--xla_gpu_autotune_level=0` gave no result in 236 s).

Compile time bounds what one call can measure: on an H200 (jax 0.11.2) the img64-s
training step compiled in 145 s and its sampler in 45 s with the two compiling side by
side; with five programs at once (img64-s and img512-s, two step variants) the step took
306 s, and measuring img64-s against the release took another 90 s (benchmarks/README.md).
Autotuning is about 60% of a cold compile. Our workers use the persistent compilation
cache (`edm2_jax.process.enable_compilation_cache`), so a second call on the same machine
skips the compiles (the img64-s step in 6-8 s), and a preset whose convolutions were
autotuned before compiles in less time (img512-s after img64-s: 42 s, the cache's
per-fusion autotuning results); `--presets` measures a subset and `--budget_s` stops
starting new presets after that many seconds.
"""
from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

DEFAULT_PRESETS = "img64-s,img512-s,img64-xs,img512-xs"
# A small net for smoke tests (16x16x3, 10 classes): not a release preset.
TINY = dict(img_resolution=16, img_channels=3, label_dim=10, model_channels=16,
            channel_mult=(1, 2), num_blocks=1, attn_resolutions=(8,), dropout=0.0)


# ----------------------------------------------------------------------------- profile

# Kernel classes of a training step, by the kernel's name or its HLO op (lower case).
CONV_PATTERNS = {"conv forward": r"fprop|cudnn-conv(?!-bw)|cudnn\$convforward|convolution",
                 "conv input-grad": r"dgrad|cudnn-conv-bw-input|convbackwardinput",
                 "conv weight-grad": r"wgrad|cudnn-conv-bw-filter|convbackwardfilter"}
CLASS_PATTERNS = [
    ("matmul", r"gemm|nvjet|cublas|cutlass|\bdot\b|dot[._]|matmul|ynn_fusion"),
    ("reduction", r"reduc"),
    ("transpose", r"transpose"),
    ("copy", r"copy|memcpy|memset|dynamic[-_]update[-_]slice|concatenate"),
]


def _precision(name: str) -> str:
    """A kernel's operand precision from its name (cuDNN/cuBLAS spell it there)."""
    for pat, label in (("tf32", "tf32"), ("bf16", "bf16"), ("f16", "fp16"), ("f32", "f32"),
                       ("s1688|s16816|h1688|h16816", "fp16")):
        if re.search(pat, name):
            return label
    return "?"


def classify(name: str, hlo_op: str = "") -> str:
    """The class of one kernel (`profile_summary`'s rows), from its name and HLO op."""
    text = f"{name} {hlo_op}".lower()
    for label, pat in CONV_PATTERNS.items():
        if re.search(pat, text) and not re.search(r"gemm_fusion|triton_gemm", text):
            if label != "conv forward" or re.search(r"conv|fprop|xmma", text):
                return f"{label} {_precision(name.lower())}"
    for label, pat in CLASS_PATTERNS:
        if re.search(pat, text):
            return f"{label} {_precision(name.lower())}" if label == "matmul" else label
    return "elementwise"


TOP_KERNELS = 40  # kernels listed by name in a profile's JSON (15 in the table)


def _trace_events(logdir: str) -> list[dict]:
    paths = [os.path.join(d, f) for d, _, fs in os.walk(logdir) for f in fs
             if f.endswith("perfetto_trace.json.gz") or f.endswith(".trace.json.gz")]
    if not paths:
        raise FileNotFoundError(f"no trace under {logdir}")
    paths.sort(key=lambda p: ("perfetto" not in p, p))
    with gzip.open(paths[0], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def kernel_events(events: list[dict]) -> tuple[list[dict], dict, str]:
    """`(kernels, device_processes, source)` of a trace's events: on a GPU the device's
    kernels (every stream of every `/device:` process, `{pid: name}` of those), on the
    CPU the XLA ops the runtime records (`hlo_op`), and which of the two it was."""
    procs = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {p: n for p, n in procs.items() if n.startswith("/device:")}
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if devices:
        return [e for e in xs if e.get("pid") in devices], devices, "device kernels"
    return [e for e in xs if e.get("args", {}).get("hlo_op")], devices, "host XLA ops"


def profile_summary(logdir: str, steps: int) -> dict:
    """Kernel time of a `jax.profiler` trace in `logdir` summed by class (`classify`),
    per step: `{'classes': {class: {'ms': .., 'count': ..}}, 'top': [the TOP_KERNELS
    kernels of most time, by name: {'name', 'ms', 'count', 'class', 'hlo_op'}],
    'busy_ms', 'idle_ms', 'span_ms', 'source'}`. On a GPU the device's kernels (every stream); on the CPU the
    XLA ops the runtime records (`hlo_op`), where idle is the time no op runs."""
    kernels, _, source = kernel_events(_trace_events(logdir))
    if not kernels:
        raise ValueError(f"the trace in {logdir} holds no kernels")
    classes: dict[str, dict] = {}
    by_kernel: dict[str, dict] = {}
    intervals = []
    for e in kernels:
        args = e.get("args", {})
        c = classify(e["name"], str(args.get("hlo_op", "")) + " " + str(args.get("long_name", "")))
        d = classes.setdefault(c, {"ms": 0.0, "count": 0})
        d["ms"] += e["dur"] / 1e3 / steps
        d["count"] += 1
        k = by_kernel.setdefault(e["name"], {"ms": 0.0, "count": 0, "class": c,
                                             "hlo_op": str(args.get("hlo_op", ""))[:80]})
        k["ms"] += e["dur"] / 1e3 / steps
        k["count"] += 1
        intervals.append((e["ts"], e["ts"] + e["dur"]))
    intervals.sort()
    busy, end = 0.0, None
    start = intervals[0][0]
    for a, b in intervals:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    span = end - start
    for d in (*classes.values(), *by_kernel.values()):
        d["count"] = d["count"] / steps
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1]["ms"])[:TOP_KERNELS]
    return {"classes": dict(sorted(classes.items(), key=lambda kv: -kv[1]["ms"])),
            "top": [{"name": n[:120], **d} for n, d in top],
            "busy_ms": busy / 1e3 / steps, "idle_ms": (span - busy) / 1e3 / steps,
            "span_ms": span / 1e3 / steps, "source": source}


# ----------------------------------------------------------------------------- workers


def set_fields(config, assignments) -> None:
    """Apply `key.sub=value` assignments (`--config_variant`'s) to `config`: the value
    read as a Python literal where it is one ('True', '0.5'), else as a string."""
    import ast
    for a in assignments:
        key, _, text = a.partition("=")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[leaf] = value


def build_config(preset: str, batch: int, dtype: str, assignments=()):
    from edm2_jax.model.presets import NETWORK_PRESETS, TRAINING_PRESETS
    from train_throughput import load_config
    config = load_config(os.path.join(os.path.dirname(HERE), "configs", "fashion_mnist.py"))
    if preset == "tiny":
        config.network.update(TINY)
    else:
        config.network.update(dict(NETWORK_PRESETS[preset]))
        tp = TRAINING_PRESETS[preset]
        config.loss.P_mean, config.loss.P_std = tp["P_mean"], tp["P_std"]
        config.optim.ref_lr, config.optim.t_ref = tp["ref_lr"], tp["t_ref"]
    config.batch_size = batch
    config.batch_per_device = 0
    config.network.dtype = dtype
    set_fields(config, assignments)
    return config


def _mem(compiled) -> dict:
    try:
        m = compiled.memory_analysis()
        return {"temp_gib": m.temp_size_in_bytes / 2**30, "arg_gib": m.argument_size_in_bytes / 2**30}
    except Exception:  # noqa: BLE001 - not every backend reports it
        return {}


class OursTrain:
    def __init__(self, args):
        import jax
        from compare_release import forward_flops
        from train_throughput import compiled_step
        self.jax, self.args = jax, args
        self.config = build_config(args.preset, args.batch, args.dtype, args.set)
        self.step, self.state, self.batch, info = compiled_step(self.config)
        self.bs = args.batch
        self.info = {"compile_s": info["compile_s"], "params": info["n_params"],
                     "backend": self.config.backend.to_dict(),
                     "flops_per_img": 3 * forward_flops(info["net"], 1), **_mem(self.step)}

    def run(self, iters: int) -> float:
        t = time.perf_counter()
        for _ in range(iters):
            self.state, metrics = self.step(self.state, self.batch)
        self.jax.block_until_ready((self.state, metrics))
        return self.bs * iters / (time.perf_counter() - t)

    def measure(self) -> dict:
        t = time.perf_counter()
        self.run(self.args.warmup)
        _progress(f"warm-up, {self.args.warmup} steps: {time.perf_counter() - t:.1f} s")
        img_s = max(self.run(self.args.iters) for _ in range(self.args.repeats))
        _progress(f"{self.args.repeats} x {self.args.iters} steps: best {img_s:.1f} img/s")
        return {"train_img_s": img_s, "peak_gib": _peak_gib(self.jax)}

    def profile(self) -> dict:
        import tempfile
        steps = self.args.profile_steps
        logdir = tempfile.mkdtemp(prefix="edm2_jax_trace_")
        try:
            t = time.perf_counter()
            with self.jax.profiler.trace(logdir, create_perfetto_trace=True):
                self.run(steps)
            _progress(f"trace of {steps} steps: {time.perf_counter() - t:.1f} s")
            return {"profile": profile_summary(logdir, steps)}
        except Exception as e:  # noqa: BLE001 - the table says why it has no profile
            return {"profile": {"error": f"{type(e).__name__}: {e}"}}


class OursSample:
    def __init__(self, args):
        import jax
        import numpy as np
        from compare_release import forward_flops
        from forward import random_variables
        from edm2_jax.sampling.sampler import sample_images
        from edm2_jax.sampling.solvers import Heun
        self.Heun = Heun
        from edm2_jax.sampling.seeds import split_seeds
        from edm2_jax.training import state as state_lib
        self.jax, self.np, self.args = jax, np, args
        config = build_config(args.preset, args.batch, args.dtype)
        self.net = state_lib.make_network(config)
        v = random_variables(self.net)
        v["params"]["unet"]["out_gain"] = v["params"]["unet"]["out_gain"] * 0 + 0.1
        self.v, self.sample_images, self.split_seeds = v, sample_images, split_seeds
        self.seed0 = 0
        self.info = {"flops_per_img": forward_flops(self.net, 1) * (2 * args.steps - 1)}
        for guided in (False, True):  # compile both programs now (first batch - steady)
            first = self._batch(guided)
            steady = self._batch(guided)
            self.info[f"compile_s{'_guided' if guided else ''}"] = max(first - steady, 0.0)

    def _batch(self, guided: bool) -> float:
        b = self.args.sample_batch
        seeds = self.split_seeds(self.np.arange(self.seed0, self.seed0 + b))
        self.seed0 += b
        kw = dict(guide_net=self.net, guide_variables=self.v,
                  guidance=self.args.guidance) if guided else {}
        t = time.perf_counter()
        self.jax.block_until_ready(self.sample_images(
            self.net, self.v, seeds, 0 if self.net.label_dim else None,
            sampler=self.Heun(self.args.steps), **kw))
        return time.perf_counter() - t

    def measure(self) -> dict:
        out = {}
        for guided in (False, True):
            key = "guided" if guided else "sample"
            t = min(sum(self._batch(guided) for _ in range(self.args.sample_iters))
                    for _ in range(self.args.repeats))
            out[f"{key}_img_s"] = self.args.sample_batch * self.args.sample_iters / t
            out[f"{key}_peak_gib"] = _peak_gib(self.jax)
        return out


class ReleaseSide:
    """The release's side of one preset. Starting imports torch and the release's modules
    (CPU work, done while our programs compile); the network and its optimiser are built
    on the device when measured, so a waiting worker holds no device memory."""

    def __init__(self, args):
        import compare_release
        import torch
        sys.path.insert(0, os.path.abspath(args.release))
        importlib.import_module("training.networks_edm2")  # now, while ours compile
        ns = argparse.Namespace(release=args.release, device="", dtype=args.dtype,
                                work=["train", "sample"], threads=0, steps=args.steps)
        self.make = lambda: compare_release.Release(
            build_config(args.preset, args.batch, args.dtype), ns)
        self.torch, self.args, self.rel = torch, args, None
        self.info = {}

    def _reset(self):
        if self.rel.device.type == "cuda":
            self.torch.cuda.reset_peak_memory_stats(self.rel.device)

    def _sample(self, iters: int, guided: bool) -> float:
        return self.rel.sample(iters, self.args.sample_batch,
                               self.args.guidance if guided else 1.0)

    def measure(self) -> dict:
        self.rel = self.make()
        self._reset()
        self.rel.train(self.args.warmup)
        out = {"train_img_s": max(self.rel.train(self.args.iters)
                                  for _ in range(self.args.repeats)),
               "peak_gib": self.rel.peak_device_gib()}
        for guided in (False, True):
            key = "guided" if guided else "sample"
            self._reset()
            self._sample(1, guided)
            out[f"{key}_img_s"] = max(self._sample(self.args.sample_iters, guided)
                                      for _ in range(self.args.repeats))
            out[f"{key}_peak_gib"] = self.rel.peak_device_gib()
        return out


def _peak_gib(jax) -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", float("nan")) / 2**30


def worker(args) -> None:
    """One side of one preset in its own process: build (and compile) it, print `READY
    {info}`, then on 'measure' (timings) or 'profile' (a training worker's kernel
    profile) print `RESULT {figures}`; anything else ends it. Progress goes to stderr.
    With `--code=DIR` the package is imported from that checkout."""
    if args.code:  # --against: another commit's package, first on the path
        sys.path.insert(0, os.path.abspath(args.code))
    from edm2_jax import process
    process.add_default_xla_flags()
    process.enable_compilation_cache()  # a second run on the machine skips the compiles
    side = {"train": OursTrain, "sample": OursSample, "release": ReleaseSide}[args.worker](args)
    info = dict(side.info)
    if args.worker != "release":
        import jax
        dev = jax.devices()[0]
        info["device"] = f"{dev.platform}:{dev.device_kind}"
        info["platform"] = dev.platform
        info["versions"] = {"jax": jax.__version__, "jaxlib": _version("jaxlib"),
                            "flax": _version("flax"), "optax": _version("optax")}
        info["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    info["package"] = os.path.dirname(process.__file__)
    print("READY " + json.dumps(info), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command not in ("measure", "profile"):
            break
        print("RESULT " + json.dumps(getattr(side, command)()), flush=True)


def _progress(message: str) -> None:
    """One progress line of a worker on stderr (the orchestrator's log shows where a
    measurement stands, or where it stopped)."""
    print(f"  [{os.environ.get('EDM2_JAX_BENCH_WORKER', 'worker')}] {message}",
          file=sys.stderr, flush=True)


def _version(dist: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


class Worker:
    """The orchestrator's handle on one worker process. A thread reads its stdout, so
    that a worker never blocks on a full pipe and a reply can be waited for with a
    timeout."""

    def __init__(self, kind: str, preset: str, argv: list[str], env: dict, name: str = ""):
        self.kind, self.preset, self.name = kind, preset, name or kind
        self.info = None
        self._start([sys.executable, os.path.abspath(__file__), *argv, f"--worker={kind}",
                     f"--preset={preset}"], dict(env, EDM2_JAX_BENCH_WORKER=f"{preset} {self.name}"))

    def _start(self, command: list[str], env: dict) -> None:
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # end of output: the worker exited

    def _read(self, tag: str, timeout: float | None = None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=None if deadline is None
                                      else max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                self.proc.kill()
                raise TimeoutError(f"the {self.name} worker of {self.preset} gave no {tag} in "
                                   f"{timeout:.0f} s (--measure_timeout); killed") from None
            if line is None:
                raise RuntimeError(f"the {self.name} worker of {self.preset} exited "
                                   f"(code {self.proc.wait()}); its error is above")
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])

    def ready(self) -> dict:
        if self.info is None:
            self.info = self._read("READY")
        return self.info

    def ask(self, command: str, timeout: float | None = None) -> dict:
        """The worker's reply to `command` ('measure' or 'profile'), waited for at most
        `timeout` seconds (then the worker is killed and TimeoutError raised)."""
        self.ready()
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read("RESULT", timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            self.proc.wait()


# ----------------------------------------------------------------------------- table

PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "B200": 2250.0, "A100": 312.0}


def _f(x, fmt="{:.1f}") -> str:
    return "–" if x is None or x != x else fmt.format(x)


def render(results: dict, args) -> str:
    lines = [f"# edm2-jax vs the release: {results.get('device', '?')}", "",
             f"Training batch {args.batch}, ours {args.dtype}, release fp16 (its default) "
             f"on a GPU; sampler: Heun {args.steps} steps ({2 * args.steps - 1} evaluations), "
             f"batch {args.sample_batch}, guided = guidance {args.guidance} by a guide of "
             f"the same size. MFU of {results.get('peak_tflops', float('nan')):.0f} TFLOP/s. "
             f"Versions: {results.get('versions')}. "
             f"Command: `{results.get('command', '')}`", "",
             "| preset | side | train img/s | train TFLOP/s | MFU % | peak GiB (train) | "
             "compile s | sample img/s | guided img/s | peak GiB (sampler) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    peak = results.get("peak_tflops", float("nan"))
    for preset, r in results["presets"].items():
        ours, rel = r.get("ours", {}), r.get("release", {})
        fl = r.get("train_flops_per_img", float("nan"))
        for side, d in (("release", rel), ("edm2-jax", ours)):
            if not d:
                continue
            tf = d.get("train_img_s", float("nan")) * fl / 1e12
            comp = (f"{_f(d.get('compile_s'))} / {_f(d.get('sample_compile_s'))} / "
                    f"{_f(d.get('guided_compile_s'))}" if side == "edm2-jax" else "–")
            lines.append(
                f"| {preset} | {side} | {_f(d.get('train_img_s'))} | {_f(tf)} | "
                f"{_f(100 * tf / peak)} | {_f(d.get('peak_gib'), '{:.2f}')} | {comp} | "
                f"{_f(d.get('sample_img_s'), '{:.2f}')} | {_f(d.get('guided_img_s'), '{:.2f}')} | "
                f"{_f(d.get('guided_peak_gib', d.get('sample_peak_gib')), '{:.2f}')} |")
        if ours and rel:
            ratio = lambda k: ours.get(k, float("nan")) / rel.get(k, float("nan"))  # noqa: E731
            lines.append(f"| {preset} | **ratio** | **{ratio('train_img_s'):.2f}x** | | | | | "
                         f"**{ratio('sample_img_s'):.2f}x** | **{ratio('guided_img_s'):.2f}x** | |")
        for key in ("error", "release_error"):
            if key in r:
                lines.append(f"| {preset} | {key.replace('_', ' ')} | {r[key]} | | | | | | | |")
    lines += ["", "Compile s: training step / sampler / guided sampler (first batch less a "
              "steady one). Our programs' buffers (`memory_analysis`, GiB): " + "; ".join(
                  f"{p}: step temp {_f(r.get('ours', {}).get('temp_gib'), '{:.2f}')}, "
                  f"arguments {_f(r.get('ours', {}).get('arg_gib'), '{:.2f}')}"
                  for p, r in results["presets"].items()), ""]
    for preset, r in results["presets"].items():
        prof = r.get("ours", {}).get("profile")
        if not prof:
            continue
        if "error" in prof:
            lines += [f"Profile of {preset}: unavailable ({prof['error']})", ""]
            continue
        step_ms = prof["span_ms"]
        lines += [f"## Where our {preset} training step goes ({prof['source']}, per step, "
                  f"mean of {args.profile_steps}: span {step_ms:.1f} ms, busy "
                  f"{prof['busy_ms']:.1f} ms)", "",
                  "| kernel class | ms/step | % of span | kernels/step |", "|---|---|---|---|"]
        for c, d in prof["classes"].items():
            lines.append(f"| {c} | {d['ms']:.2f} | {100 * d['ms'] / step_ms:.1f} | "
                         f"{d['count']:.0f} |")
        lines += [f"| idle gaps | {prof['idle_ms']:.2f} | {100 * prof['idle_ms'] / step_ms:.1f} | |",
                  ""]
        if prof.get("top"):
            lines += [f"The {min(15, len(prof['top']))} kernels of most time ({preset}, per step):",
                      "", "| kernel | class | HLO op | ms/step | launches/step |", "|---|---|---|---|---|"]
            lines += [f"| `{k['name'][:60]}` | {k['class']} | {k['hlo_op'][:40]} | {k['ms']:.2f} | "
                      f"{k['count']:.0f} |" for k in prof["top"][:15]]
            lines.append("")
    for preset, r in results["presets"].items():
        lines += _render_variants(preset, r)
    data = results.get("data_pipeline")
    if data:
        best = max((r.get("ours", {}).get("train_img_s", 0.0)
                    for r in results["presets"].values()), default=0.0)
        lines += [f"Data pipeline (`benchmarks/data_pipeline.py`: the training iterator over "
                  f"{data['images']} 64x64 PNGs, batch {data['batch']}, {data['cpus']} CPUs), "
                  f"img/s by worker processes: " + ", ".join(
                      f"{r['workers']}: {r['img_per_s']:.0f}" for r in data["rows"])
                  + f"; our fastest training step above takes {best:.0f} img/s.", ""]
    return "\n".join(lines)


def _render_variants(preset: str, r: dict) -> list[str]:
    """The A/B rows of the first preset: each variant's step against the plain step
    (the mean of its measurements before and after the variants), and the kernel classes
    whose time moved."""
    variants, ours = r.get("variants"), r.get("ours", {})
    if not variants or not ours:
        return []
    base = [x for x in (ours.get("train_img_s"), ours.get("train_img_s_again")) if x]
    base_img_s = sum(base) / len(base)
    lines = [f"## Variants of the {preset} training step, each alone on the device", "",
             f"Plain step: {' then '.join(f'{x:.1f}' for x in base)} img/s (before and after "
             f"the variants), compile {_f(ours.get('compile_s'))} s.", "",
             "| variant | what | compile s | train img/s | vs plain | peak GiB | temp GiB | "
             "profile span ms |", "|---|---|---|---|---|---|---|---|"]
    for name, v in variants.items():
        what = v["what"] + (f" (error: {v['error'][:200]})" if "error" in v else "")
        prof = v.get("profile") or {}
        img_s = v.get("train_img_s")
        lines.append(f"| {name} | {what} | {_f(v.get('compile_s'))} | {_f(img_s)} | "
                     f"{f'{img_s / base_img_s:.3f}x' if img_s else '–'} | "
                     f"{_f(v.get('peak_gib'), '{:.2f}')} | {_f(v.get('temp_gib'), '{:.2f}')} | "
                     f"{_f(prof.get('span_ms'))} |")
    base_prof = (ours.get("profile") or {}).get("classes")
    profs = {n: (v.get("profile") or {}).get("classes") for n, v in variants.items()}
    profs = {n: c for n, c in profs.items() if c}
    if base_prof and profs:
        names = sorted(set(base_prof).union(*profs.values()),
                       key=lambda c: -base_prof.get(c, {}).get("ms", 0.0))
        lines += ["", "Kernel classes, ms/step (kernels/step):", "",
                  "| class | plain | " + " | ".join(profs) + " |",
                  "|---|---|" + "---|" * len(profs)]
        cell = lambda d: f"{d['ms']:.2f} ({d['count']:.0f})" if d else "–"  # noqa: E731
        for c in names:
            lines.append(f"| {c} | {cell(base_prof.get(c))} | "
                         + " | ".join(cell(p.get(c)) for p in profs.values()) + " |")
    return lines + [""]


def write_table(results: dict, args) -> str:
    """Render `results`, write it to `args.out` (and the figures to `<out>.json`)."""
    table = render(results, args)
    with open(args.out, "w") as f:
        f.write(table + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1, default=float)
    return table


def parse_variants(specs: list[str], against: str,
                   config_specs: list[str] = ()) -> dict[str, dict]:
    """`{name: {'xla_flags', 'code', 'what', 'set'}}` of `--variant NAME=FLAGS`,
    `--against DIR` and `--config_variant NAME=field=value,...`; exits with one `error:`
    line for a malformed spec or a DIR without edm2_jax."""
    variants: dict[str, dict] = {}
    if against:  # first: a code change is what an A/B is most often for
        if not os.path.isfile(os.path.join(against, "edm2_jax", "training", "step.py")):
            raise SystemExit(f"error: --against={against!r} is not an edm2-jax checkout (no "
                             "edm2_jax/training/step.py there); e.g. git worktree add DIR HEAD~1")
        variants["against"] = {"xla_flags": "", "code": os.path.abspath(against),
                               "what": f"the code of {against}", "set": []}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not re.fullmatch(r"[\w.-]+", name) or not flags.strip().startswith("--") \
                or name in variants or name in ("train", "sample", "release", "against"):
            raise SystemExit(f"error: --variant={spec!r}: expected NAME=--xla_flag=VALUE... "
                             "with a new NAME of letters, digits, '.', '_' or '-'")
        variants[name] = {"xla_flags": flags.strip(), "code": "", "what": flags.strip(),
                          "set": []}
    for spec in config_specs:
        name, sep, rest = spec.partition("=")
        fields = [f.strip() for f in rest.split(",") if f.strip()]
        if not sep or not re.fullmatch(r"[\w.-]+", name) or name in variants \
                or name in ("train", "sample", "release", "against") \
                or not fields or not all(re.fullmatch(r"[\w.]+=\S+", f) for f in fields):
            raise SystemExit(f"error: --config_variant={spec!r}: expected "
                             "NAME=field.sub=value[,field.sub=value] with a new NAME, e.g. "
                             "cudnn=backend.attention=cudnn")
        variants[name] = {"xla_flags": "", "code": "", "what": ", ".join(fields),
                          "set": fields}
    return variants


def measure_variants(variants: dict, ours: dict, preset: str, t0: float, timeout: float,
                     save) -> dict:
    """Measure each compiled variant's training step alone on the device, one after
    another (timings, then its profile), calling `save(rows)` after each reply; a
    variant that failed or gave no reply within `timeout` s keeps its error."""
    out: dict[str, dict] = {}
    for name, v in variants.items():
        row = out[name] = {"what": v["what"]}
        if "error" in v:
            row["error"] = v["error"]
            continue
        w = ours[preset, name]
        try:
            info = w.ready()
            row.update(compile_s=info["compile_s"], temp_gib=info.get("temp_gib"),
                       package=info.get("package"), backend=info.get("backend"))
            row.update(w.ask("measure", timeout))
            save(out)
            row.update(w.ask("profile", timeout))
        except Exception as e:  # noqa: BLE001 - the table says why
            row["error"] = f"{type(e).__name__}: {e}"
        finally:
            w.close()
        save(out)
        print(f"[{time.time() - t0:.0f} s] {preset} {name}: "
              f"{ {k: x for k, x in row.items() if k != 'profile'} }", flush=True)
    return out


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", default="", help="a checkout of NVlabs/edm2 (none: ours only)")
    ap.add_argument("--presets", default=DEFAULT_PRESETS,
                    help=f"comma-separated release presets, or 'tiny' (default {DEFAULT_PRESETS})")
    ap.add_argument("--batch", type=int, default=128, help="training batch")
    ap.add_argument("--sample_batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="sampler steps")
    ap.add_argument("--guidance", type=float, default=2.0)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="ours; the release runs fp16 on a GPU unless float32")
    ap.add_argument("--iters", type=int, default=10, help="training steps per measurement")
    ap.add_argument("--sample_iters", type=int, default=1, help="sampler batches per measurement")
    ap.add_argument("--repeats", type=int, default=2, help="measurements (the best is kept)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile_steps", type=int, default=3, help="0: no profile")
    ap.add_argument("--peak_tflops", type=float, default=0.0,
                    help="peak for MFU (default: the GPU's dense bf16 rate)")
    ap.add_argument("--serial_compile", action="store_true",
                    help="start our workers one at a time instead of compiling in parallel")
    ap.add_argument("--budget_s", type=float, default=0.0,
                    help="start no preset's measurement after this many seconds (0: no "
                         "limit); the table holds the presets measured by then")
    ap.add_argument("--data_workers", default="1,2,4",
                    help="after the presets, the data pipeline's img/s of 64x64 images with "
                         "these counts of grain worker processes (benchmarks/data_pipeline.py); '' skips")
    ap.add_argument("--measure_timeout", type=float, default=240.0,
                    help="seconds a worker has for one measurement or profile; then it is "
                         "killed and its row says so (0: no limit)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=XLA_FLAGS",
                    help="also measure the first preset's training step with these XLA flags "
                         "added (repeatable), between two measurements of the plain step")
    ap.add_argument("--config_variant", action="append", default=[],
                    metavar="NAME=FIELD=VALUE,...",
                    help="also measure the first preset's training step with these config "
                         "fields set (repeatable), e.g. cudnn=backend.attention=cudnn")
    ap.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--against", default="", metavar="DIR",
                    help="also measure the first preset's training step of the edm2-jax "
                         "checkout DIR (another commit), likewise")
    ap.add_argument("--out", default="gpu_table.md", help="Markdown table; raw figures to <out>.json")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="", help=argparse.SUPPRESS)
    ap.add_argument("--code", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    variants = parse_variants(args.variant, args.against, args.config_variant)
    from edm2_jax.model.presets import NETWORK_PRESETS
    unknown = [p for p in presets if p != "tiny" and p not in NETWORK_PRESETS]
    if unknown:
        raise SystemExit(f"error: unknown presets {unknown}; choose from "
                         f"{sorted(NETWORK_PRESETS)} or 'tiny'")
    if args.release and not os.path.isfile(os.path.join(args.release, "training",
                                                        "networks_edm2.py")):
        raise SystemExit(f"error: --release={args.release!r} is not a checkout of NVlabs/edm2 "
                         "(no training/networks_edm2.py there)")

    missing = [m for m in ("ml_collections",) + (("torch",) if args.release else ())
               if not _installed(m)]
    if missing:
        raise SystemExit(f"error: {', '.join(missing)} not installed here (the configs are "
                         "ml_collections ConfigDicts; the release runs on torch); on a machine "
                         "without an index, install their wheels: pip install --no-deps "
                         "--target DIR WHEELS, then PYTHONPATH=DIR")

    argv = [a for a in sys.argv[1:] if not a.startswith(
        ("--worker", "--preset=", "--code=", "--set="))]
    argv.append(f"--batch={args.batch}")
    env = dict(os.environ)
    # Several processes share the GPU: none takes memory up front, each takes its own.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    t0 = time.time()
    # Every worker starts now: ours compile side by side, the release's import torch.
    ours, release = {}, {}
    for p in presets:
        for kind in ("train", "sample"):
            ours[p, kind] = Worker(kind, p, argv, env)
            if args.serial_compile:
                ours[p, kind].ready()
        if args.release:
            release[p] = Worker("release", p, argv, env)
        if p == presets[0]:  # the variants of the first preset's step compile now too
            for name, v in variants.items():
                venv = dict(env, XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} {v['xla_flags']}".strip())
                ours[p, name] = Worker("train", p, argv + ([f"--code={v['code']}"]
                                                           if v["code"] else [])
                                       + [f"--set={a}" for a in v["set"]], venv, name)
    results = {"presets": {p: {} for p in presets},
               "command": "python benchmarks/gpu_table.py " + " ".join(sys.argv[1:])}
    # Measurements start once every program is compiled: XLA:GPU autotunes by running
    # kernels on the GPU, which would share it with a measurement.
    for p in presets:
        try:
            info_t, info_s = ours[p, "train"].ready(), ours[p, "sample"].ready()
            print(f"[{time.time() - t0:.0f} s] {p}: compiled (step {info_t['compile_s']:.1f} s, "
                  f"sampler {info_s['compile_s']:.1f} s)", flush=True)
            results["versions"] = info_t.get("versions")
        except Exception as e:  # noqa: BLE001 - one preset's failure leaves the others' rows
            results["presets"][p]["error"] = f"{type(e).__name__}: {e}"
            print(f"{p}: {results['presets'][p]['error']}", flush=True)
    for name in variants:
        try:
            info = ours[presets[0], name].ready()
            print(f"[{time.time() - t0:.0f} s] {presets[0]} {name}: compiled (step "
                  f"{info['compile_s']:.1f} s, package {info['package']})", flush=True)
        except Exception as e:  # noqa: BLE001 - a variant's failure leaves the table
            variants[name]["error"] = f"{type(e).__name__}: {e}"
            print(f"{presets[0]} {name}: {variants[name]['error']}", flush=True)
    for p in presets:
        r = results["presets"][p]
        workers = [w for (q, _), w in ours.items() if q == p] + (
            [release[p]] if p in release else [])
        if "error" in r or (args.budget_s and time.time() - t0 > args.budget_s):
            r.setdefault("error", f"not measured: --budget_s={args.budget_s:.0f} s spent")
            for w in workers:
                w.proc.kill()
            continue
        def save() -> None:  # after every reply: a cut-off call keeps what it measured
            dev = results.get("device", "")
            results["peak_tflops"] = args.peak_tflops or next(
                (v for k, v in PEAK_TFLOPS.items() if k in dev), float("nan"))
            write_table(results, args)

        def say(what: str, figures: dict) -> None:
            print(f"[{time.time() - t0:.0f} s] {p} {what}: "
                  f"{ {k: v for k, v in figures.items() if k != 'profile'} }", flush=True)

        timeout = args.measure_timeout or None
        try:
            tr, sa = ours[p, "train"], ours[p, "sample"]
            info_t, info_s = tr.ready(), sa.ready()
            results["device"] = info_t["device"]
            r["train_flops_per_img"] = info_t["flops_per_img"]
            r["sample_flops_per_img"] = info_s["flops_per_img"]
            if p in release:
                try:
                    r["release"] = release[p].ask("measure", timeout)
                    say("release", r["release"])
                except Exception as e:  # noqa: BLE001 - ours are measured all the same
                    r["release_error"] = f"{type(e).__name__}: {e}"
                    print(f"{p} release: {r['release_error']}", flush=True)
                finally:
                    release[p].close()
                save()
            o = r["ours"] = dict(compile_s=info_t["compile_s"], temp_gib=info_t.get("temp_gib"),
                                 arg_gib=info_t.get("arg_gib"),
                                 sample_compile_s=info_s["compile_s"],
                                 guided_compile_s=info_s["compile_s_guided"])
            o.update(tr.ask("measure", timeout))
            save()
            o.update(sa.ask("measure", timeout))
            sa.close()
            save()
            say("edm2-jax", o)
            if args.profile_steps:
                o.update(tr.ask("profile", timeout))
                save()
            if p == presets[0] and variants:
                r["variants"] = measure_variants(
                    variants, ours, p, t0, timeout,
                    lambda rows: (r.__setitem__("variants", rows), save()))
                again = tr.ask("measure", timeout)  # the plain step once more: the drift
                o["train_img_s_again"] = again["train_img_s"]
                say("edm2-jax again", again)
        except Exception as e:  # noqa: BLE001 - one preset's failure leaves the others' rows
            r["error"] = f"{type(e).__name__}: {e}"
            print(f"{p}: {r['error']}", flush=True)
        finally:
            for w in workers:
                w.close()
        save()
    if args.data_workers:
        import data_pipeline
        results["data_pipeline"] = data_pipeline.main([
            "--images=2048", "--resolution=64", "--batch=256", "--batches=4", "--repeats=2",
            f"--workers={args.data_workers}"])
    print(write_table(results, args))
    print(f"(written to {args.out} and {args.out}.json in {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
