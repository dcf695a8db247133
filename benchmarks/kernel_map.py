"""Where a training step's kernel time goes, by the model operation each kernel computes.

    python benchmarks/kernel_map.py --preset=img64-s --batch=128 --out=DIR     # on a GPU
    JAX_PLATFORMS=cpu python benchmarks/kernel_map.py --preset=tiny --batch=8 --out=DIR
    python benchmarks/kernel_map.py --from=DIR          # the table again from DIR's files

Compiles the training step of a preset (`gpu_table.build_config`: the release's network
at `--batch`, `--dtype`, synthetic batch, random weights; `train_throughput.compiled_step`),
times `--steps` steps, traces `--profile_steps` more with `jax.profiler`, and writes to
`--out`:

- `step.hlo.gz`: the optimised HLO of the compiled step (`compiled.as_text()`), whose
  instructions carry the JAX name stack of the operation they come from
  (`op_name="jit(train_step)/transpose(jvp(Precond))/unet/enc_64x64_block0/conv_res0/..."`:
  backward pass of that Flax module; the step's own parts are named by
  `jax.named_scope` in `training/step.py`: draws, force_normalize, optimizer, ema,
  logged_norms);
- `kernels.json.gz`: the kernels of the profiler's trace (name, HLO op, start, duration);
- `kernel_map.json` and `kernel_map.md`: every kernel of the trace joined to its HLO
  instruction (the trace's `hlo_op`), the instruction's operation read from the op_names
  of everything it computes (a fusion's fused instructions), and the time summed by
  pass (forward, backward, step), by operation (`OPERATIONS`: weight normalisation,
  pixel norm, MP-SiLU, clip, MP-sum/cat, attention, resampling, convolution, loss, Adam,
  EMA, logged norms, ...) and by the kernel's class (`gpu_table.classify`: convolution,
  matmul, elementwise, reduction, transpose, copy).

On a GPU the trace's kernels are the device's; on the CPU, XLA's thunks (`hlo_op`), so
the same table reads either machine.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

# Operations of an EDM2 step: each op_name of what one kernel computes takes the first
# label whose pattern it matches; the label most of them take names the kernel.
OPERATIONS = [
    ("convolution", r"/conv_general_dilated$"),
    ("attention", r"_attention|/attn|/qkv|softmax"),
    ("clip_act (mask packing)", r"packbits|unpackbits"),
    ("clip_act", r"jit\(clip\)|/clamp|/clip"),
    ("force_normalize", r"^force_normalize/|/force_normalize/"),
    ("optimizer (Adam)", r"^optimizer/|/optimizer/"),
    ("ema", r"^ema/|/ema/"),
    ("logged norms", r"^logged_norms/|/logged_norms/"),
    ("draws (sigma, noise)", r"^draws/|/draws/|_normal|threefry|_uniform"),
    ("weight normalisation", r"/(conv_\w+|emb_\w+|\w+_conv|\w+_linear|in_conv|out_conv|"
                             r"emb_label|emb_noise|emb_fourier_\w*)/checkpoint/"),
    ("MP-SiLU", r"silu|logistic"),
    ("pixel norm", r"_block\d+/checkpoint/|/checkpoint/(reduce_sum|sqrt|div|square)"),
    ("embedding (Fourier, labels)", r"emb_fourier|cos|emb_noise|emb_label|emb_gain"),
    ("MP-cat", r"concatenate"),
    ("resampling", r"reduce_window|/repeat|_down/|_up/"),
    ("matmul (1x1 conv, dense)", r"/dot_general$"),
    ("dropout", r"dropout|bernoulli"),
    ("MP-sum, gains, modulation", r"_block\d+/|/(add|mul|sub|div)$"),
    ("loss", r"jvp\(\)|loss|logvar"),
]

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^(?:\([^=]*?\)|[\w\[\]{}:,\s/()*]*?)\s([\w\-]+)\(")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)="
                    r"(\{[^}]*\}|%?[\w.\-]+)")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def parse_hlo(text: str) -> dict:
    """`{instruction name: {'opcode', 'op_name', 'calls': [computation names],
    'computation'}}` and `{computation name: [instruction names]}` of an HLO module's
    text (`compiled.as_text()`), as `(instructions, computations)`."""
    instrs: dict[str, dict] = {}
    comps: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if not line.strip() or line.startswith("HloModule"):
            continue
        if current is None or (not line.startswith(" ") and line.rstrip().endswith("{")):
            m = _COMP.match(line)
            if m and line.rstrip().endswith("{"):
                current = m.group(1)
                comps[current] = []
                continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m or current is None:
            continue
        name, rest = m.group(1), m.group(2)
        op = _OPCODE.match(rest)
        calls = []
        for c in _CALLS.findall(rest):
            calls += [x.strip().lstrip("%") for x in c.strip("{}").split(",") if x.strip()]
        on = _OPNAME.search(rest)
        instrs[name] = {"opcode": op.group(1) if op else "", "calls": calls,
                        "op_name": on.group(1) if on else "", "computation": current}
        comps[current].append(name)
    return instrs, comps


def op_names(name: str, instrs: dict, comps: dict, _seen=None) -> list[str]:
    """The op_names of instruction `name` and of every instruction of the computations
    it calls (a fusion's fused computation, recursively)."""
    seen = _seen if _seen is not None else set()
    if name in seen or name not in instrs:
        return []
    seen.add(name)
    ins = instrs[name]
    out = [ins["op_name"]] if ins["op_name"] else []
    for c in ins["calls"]:
        for sub in comps.get(c, []):
            out += op_names(sub, instrs, comps, seen)
    return out


def _strip(op_name: str) -> str:
    """An op_name without its `jit(train_step)/` root; a backward op's name keeps the
    inner (forward) path only: `transpose(jvp(Precond))/a/b/jvp(Precond)/a/b/mul` ->
    `a/b/mul`."""
    s = re.sub(r"^jit\([^)]*\)/", "", op_name)
    if "jvp(Precond)/" in s:
        s = s[s.rfind("jvp(Precond)/") + len("jvp(Precond)/"):]
    return s


def pass_of(names: list[str]) -> str:
    """'backward', 'forward' or 'step' (outside the network's autodiff)."""
    if any("transpose(jvp(" in n for n in names):
        return "backward"
    if any("jvp(" in n for n in names):
        return "forward"
    return "step"


def operation_of(names: list[str], opcode: str = "") -> str:
    """The model operation a kernel computes: the `OPERATIONS` label most of its op_names
    match (each op_name takes the first label whose pattern it matches)."""
    stripped = [_strip(n) for n in names]
    if opcode in ("convolution", "custom-call") and any(
            n.endswith("conv_general_dilated") for n in stripped):
        return "convolution"
    votes = collections.Counter()
    for n in stripped:
        label = next((lab for lab, pat in OPERATIONS if re.search(pat, n)), "")
        if label:
            votes[label] += 1
    return votes.most_common(1)[0][0] if votes else "other"


def module_of(names: list[str]) -> str:
    """The Flax module path most of a kernel's op_names share, with resolutions and
    block indices replaced by `R` and `N` (`unet/enc_RxR_blockN/conv_res0`)."""
    paths = collections.Counter()
    for n in names:
        s = _strip(n)
        parts = s.split("/")[:-1]
        parts = [p for p in parts if not p.startswith(("jit(", "checkpoint", "jvp(",
                                                        "transpose("))]
        path = "/".join(parts)
        path = re.sub(r"\d+x\d+", "RxR", path)
        path = re.sub(r"block\d+", "blockN", path)
        paths[path] += 1
    return paths.most_common(1)[0][0] if paths else ""


def attribute(events: list[dict], instrs: dict, comps: dict, steps: int) -> dict:
    """Per-kernel rows and sums by (pass, operation, class), per step, from the trace
    `events` (those with a `dur`, on the device's streams where there are any)."""
    import gpu_table
    kernels, _, _ = gpu_table.kernel_events(events)
    rows: dict[tuple, dict] = {}
    total = 0.0
    unmatched = 0.0
    for e in kernels:
        args = e.get("args", {})
        hlo_op = str(args.get("hlo_op", ""))
        if hlo_op not in instrs:
            # A kernel inside a command buffer is traced under the buffer's thunk; its
            # name is its fusion's (`loop_add_fusion_3` for `loop_add_fusion.3`; kernels
            # of identical fusions are emitted once and share the first one's name).
            alias = re.sub(r"_(\d+)$", r".\1", e["name"])
            hlo_op = alias if alias in instrs else (e["name"] if e["name"] in instrs else hlo_op)
        ins = instrs.get(hlo_op, {})
        names = op_names(hlo_op, instrs, comps) if ins else []
        if not ins:
            unmatched += e["dur"]
        cls = gpu_table.classify(e["name"], hlo_op + " " + str(args.get("long_name", "")))
        key = (pass_of(names), operation_of(names, ins.get("opcode", "")), cls)
        r = rows.setdefault(key, {"ms": 0.0, "count": 0, "modules": collections.Counter(),
                                  "ops": collections.Counter()})
        r["ms"] += e["dur"] / 1e3 / steps
        r["count"] += 1
        r["modules"][module_of(names)] += e["dur"] / 1e3 / steps
        r["ops"][hlo_op.split(".")[0]] += e["dur"] / 1e3 / steps
        total += e["dur"]
    out = []
    for (p, op, cls), r in sorted(rows.items(), key=lambda kv: -kv[1]["ms"]):
        out.append({"pass": p, "operation": op, "class": cls, "ms": r["ms"],
                    "kernels": r["count"] / steps,
                    "modules": [[m, ms] for m, ms in r["modules"].most_common(4)],
                    "hlo_ops": [[o, ms] for o, ms in r["ops"].most_common(4)]})
    by_op = collections.defaultdict(float)
    for r in out:
        by_op[r["operation"]] += r["ms"]
    return {"rows": out, "by_operation": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
            "total_ms": total / 1e3 / steps, "unmatched_ms": unmatched / 1e3 / steps}


def render(result: dict, title: str) -> str:
    lines = [f"# {title}", "",
             f"Kernel time per step {result['total_ms']:.2f} ms (kernels whose HLO "
             f"instruction was not found: {result['unmatched_ms']:.2f} ms).", "",
             "## By operation", "", "| operation | ms/step | % |", "|---|---|---|"]
    for op, ms in result["by_operation"].items():
        lines.append(f"| {op} | {ms:.2f} | {100 * ms / result['total_ms']:.1f} |")
    lines += ["", "## By pass, operation and kernel class", "",
              "| pass | operation | class | ms/step | kernels/step | modules (ms) | HLO ops (ms) |",
              "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        mods = ", ".join(f"{m or '-'} {ms:.2f}" for m, ms in r["modules"][:3])
        ops = ", ".join(f"{o} {ms:.2f}" for o, ms in r["hlo_ops"][:3])
        lines.append(f"| {r['pass']} | {r['operation']} | {r['class']} | {r['ms']:.2f} | "
                     f"{r['kernels']:.0f} | {mods} | {ops} |")
    return "\n".join(lines) + "\n"


def write_kernels(logdir: str, path: str) -> None:
    """The kernels of the `jax.profiler` trace in `logdir` (the device's, else XLA's
    thunks) as a compact trace at `path`: their name, HLO op, start and duration."""
    import gpu_table
    kernels, devices, _ = gpu_table.kernel_events(gpu_table._trace_events(logdir))
    slim = [{"ph": "X", "pid": e.get("pid"), "name": e["name"], "ts": e["ts"], "dur": e["dur"],
             "args": {k: e["args"][k] for k in ("hlo_op", "long_name") if k in e.get("args", {})}}
            for e in kernels]
    meta = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": n}}
            for p, n in devices.items()]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + slim}, f)


def analyse(out: str, steps: int, title: str) -> dict:
    with gzip.open(os.path.join(out, "step.hlo.gz"), "rt") as f:
        instrs, comps = parse_hlo(f.read())
    with gzip.open(os.path.join(out, "kernels.json.gz"), "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    result = attribute(events, instrs, comps, steps)
    result["title"] = title
    with open(os.path.join(out, "kernel_map.json"), "w") as f:
        json.dump(result, f, indent=1)
    table = render(result, title)
    with open(os.path.join(out, "kernel_map.md"), "w") as f:
        f.write(table)
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="img64-s", help="a release preset, or 'tiny'")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after 3 warm-up)")
    ap.add_argument("--profile_steps", type=int, default=3)
    ap.add_argument("--out", default="kernel_map", help="output folder")
    ap.add_argument("--from", dest="from_dir", default="",
                    help="analyse the step.hlo.gz and kernels.json.gz of this folder again")
    args = ap.parse_args(argv)
    if args.from_dir:
        meta = json.load(open(os.path.join(args.from_dir, "run.json")))
        print(render(analyse(args.from_dir, meta["profile_steps"], meta["title"]),
                     meta["title"]))
        return
    from edm2_jax import process
    process.setup_entry_point()
    import jax
    from gpu_table import build_config
    from train_throughput import compiled_step
    os.makedirs(args.out, exist_ok=True)
    config = build_config(args.preset, args.batch, args.dtype)
    compiled, state, batch, info = compiled_step(config)
    print(f"compiled in {info['compile_s']:.1f} s", flush=True)
    with gzip.open(os.path.join(args.out, "step.hlo.gz"), "wt") as f:
        f.write(compiled.as_text())
    for _ in range(3):
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    t = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    img_s = args.batch * args.steps / (time.perf_counter() - t)
    logdir = tempfile.mkdtemp(prefix="edm2_jax_trace_")
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _ in range(args.profile_steps):
            state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
    write_kernels(logdir, os.path.join(args.out, "kernels.json.gz"))
    shutil.rmtree(logdir, ignore_errors=True)
    dev = jax.devices()[0]
    title = (f"{args.preset} training step, batch {args.batch}, {args.dtype}, "
             f"{dev.platform}:{dev.device_kind}, jax {jax.__version__}: "
             f"{img_s:.1f} img/s, compile {info['compile_s']:.1f} s")
    meta = {"title": title, "profile_steps": args.profile_steps, "img_s": img_s,
            "compile_s": info["compile_s"], "xla_flags": os.environ.get("XLA_FLAGS", "")}
    with open(os.path.join(args.out, "run.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(title, flush=True)
    print(render(analyse(args.out, args.profile_steps, title), title))


if __name__ == "__main__":
    main()
