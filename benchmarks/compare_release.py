"""Side-by-side speed of edm2-jax and the authors' PyTorch release on one machine.

    python benchmarks/compare_release.py --release=/path/to/edm2 --work=train,sample
    python benchmarks/compare_release.py --release=/path/to/edm2 --work=train \
        --net=ch64 --batch=32                       # the 9.8M-param 32x32x3 net
    python benchmarks/compare_release.py --release=/path/to/edm2 --preset=img64-xs \
        --batch=256 --dtype=bfloat16 --work=train   # GPU: release fp16 vs ours bf16
    python benchmarks/compare_release.py --work=train   # ours only (no --release)

`--release` is a checkout of NVlabs/edm2 that the user has; its modules are imported from
that path at run time only (nothing of it is vendored or downloaded). Both sides run the
same network config, batch and device, on random data already in memory:

- **train**: one optimiser step as the release's `training_loop` does it — EDM2 loss
  (`EDM2Loss`), backward, `learning_rate_schedule`, `nan_to_num` of the gradients, Adam
  (betas 0.9/0.99), two power-function EMAs (`PowerFunctionEMA`, sigma_rel 0.05/0.10);
  forced weight normalisation happens inside the release's training-mode forward. Ours
  is `step.make_train_step` jitted by `step.jit_train_step` (the step of
  `loop.train_and_evaluate`).
- **sample**: the EDM Heun sampler, `--steps` steps (2 steps - 1 network evaluations),
  the release's `generate_images.edm_sampler` vs our `sampling.sample_images`.

Each side runs in its own process (no shared thread pools; in one process torch's
OpenMP threads and XLA's pool slowed each other by ~25% on 2 cores), and measurements
alternate A B A B (`--pairs` pairs, each timing `--iters` steps / batches after
warm-up) so that drift in machine load hits both sides alike; each pair prints both
img/s and the ratio ours / release, and the last line the medians. Model FLOPs (for
TFLOP/s and, on a GPU, MFU) are counted from the forward jaxpr (convolutions and
matmuls, x3 for a training step), since XLA's cost analysis leaves out cuDNN convs. On CPU the release
runs with `torch.set_num_threads(--threads)` (default: all cores, as XLA uses). On a GPU
the release runs at its own settings (fp16 where `use_fp16`, cudnn.benchmark) and ours
at `--dtype`.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

# Named nets (besides --config and --preset) that benchmarks/README.md reports.
NETS = {
    # 32x32x3, ch 64, mult 1,2,2,2, 2 blocks, attention at 16 and 8: 9.8M params.
    "ch64": dict(img_resolution=32, img_channels=3, label_dim=10, model_channels=64,
                 channel_mult=(1, 2, 2, 2), num_blocks=2, attn_resolutions=(16, 8), dropout=0.0),
}
RELEASE_NET_KEYS = ("img_resolution", "img_channels", "label_dim", "model_channels",
                    "channel_mult", "channel_mult_noise", "channel_mult_emb", "num_blocks",
                    "attn_resolutions", "label_balance", "concat_balance", "channels_per_head",
                    "dropout", "res_balance", "attn_balance", "clip_act", "sigma_data",
                    "logvar_channels")


def build_config(args):
    from edm2_jax.model.presets import NETWORK_PRESETS
    from train_throughput import load_config
    config = load_config(args.config)
    if args.preset:
        config.network.update(dict(NETWORK_PRESETS[args.preset]))
    elif args.net:
        config.network.update(NETS[args.net])
    if args.batch:
        config.batch_size = args.batch
    config.network.dtype = args.dtype
    return config


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# Dense bf16/fp16 tensor-core peaks (TFLOP/s) for MFU; --peak_tflops overrides.
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def peak_tflops(args, device_kind: str) -> float:
    if args.peak_tflops:
        return args.peak_tflops
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_kind), float("nan"))


# ----------------------------------------------------------------------------- ours


class Ours:
    def __init__(self, config, args):
        import jax
        from forward import random_variables
        from train_throughput import compiled_step
        from edm2_jax.training import state as state_lib
        self.jax, self.args, self.config = jax, args, config
        self.bs = int(config.batch_size)
        if "train" in args.work:
            self.step_fn, self.state, self.batch, info = compiled_step(config)
            self.net, self.compile_s = info["net"], info["compile_s"]
        else:
            self.net = state_lib.make_network(config)
        if "sample" in args.work:
            from edm2_jax.sampling.sampler import sample_images
            from edm2_jax.sampling.solvers import Heun
            self.Heun = Heun
            v = random_variables(self.net)
            v["params"]["unet"]["out_gain"] = v["params"]["unet"]["out_gain"] * 0 + 0.1
            self.sample_vars, self.sample_images = v, sample_images
            self.seed0 = 0

    def peak_device_gib(self) -> float:
        stats = self.jax.devices()[0].memory_stats() or {}
        return stats.get("peak_bytes_in_use", float("nan")) / 2**30

    def train(self, iters: int) -> float:
        jax = self.jax
        t = time.perf_counter()
        for _ in range(iters):
            self.state, metrics = self.step_fn(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        return self.bs * iters / (time.perf_counter() - t)

    def sample(self, iters: int, batch: int) -> float:
        labels = 0 if self.net.label_dim else None
        t = time.perf_counter()
        for _ in range(iters):
            # Split over the devices as `--mode=generate` and the training grids do.
            from edm2_jax.sampling.seeds import split_seeds
            seeds = split_seeds(np.arange(self.seed0, self.seed0 + batch))
            self.seed0 += batch
            self.jax.block_until_ready(self.sample_images(
                self.net, self.sample_vars, seeds, labels, sampler=self.Heun(self.args.steps)))
        return batch * iters / (time.perf_counter() - t)


# ----------------------------------------------------------------------------- release


class Release:
    def __init__(self, config, args):
        if not os.path.isfile(os.path.join(args.release, "training", "networks_edm2.py")):
            raise SystemExit(f"--release={args.release!r} is not a checkout of NVlabs/edm2 "
                             "(no training/networks_edm2.py there)")
        sys.path.insert(0, os.path.abspath(args.release))
        import torch
        from training import networks_edm2, phema as rel_phema, training_loop as rel_loop
        self.torch, self.args, self.config = torch, args, config
        self.device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu"
                                   else "cpu")
        if self.device.type == "cpu":
            torch.set_num_threads(args.threads or os.cpu_count())
        else:
            torch.backends.cudnn.benchmark = True
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        ncfg = config.network.to_dict()
        kw = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ncfg.items()
              if k in RELEASE_NET_KEYS}
        use_fp16 = self.device.type == "cuda" and args.dtype != "float32"
        torch.manual_seed(0)
        self.net = networks_edm2.Precond(use_fp16=use_fp16, **kw).to(self.device)
        self.bs = int(config.batch_size)
        r, c, L = kw["img_resolution"], kw["img_channels"], kw.get("label_dim", 0)
        self.shape, self.label_dim = (c, r, r), L
        self.images = torch.rand(self.bs, c, r, r, device=self.device) * 2 - 1
        self.labels = (torch.eye(L, device=self.device)[torch.randint(0, L, (self.bs,))]
                       if L else None)
        self.loss_fn = rel_loop.EDM2Loss(P_mean=float(config.loss.P_mean),
                                         P_std=float(config.loss.P_std))
        self.lr_fn = rel_loop.learning_rate_schedule
        self.optimizer = torch.optim.Adam(self.net.parameters(), betas=(0.9, 0.99), eps=1e-8)
        self.ema = rel_phema.PowerFunctionEMA(self.net, stds=list(config.ema.sigma_rels))
        self.cur_nimg = 0
        if "sample" in args.work:
            spec = importlib.util.spec_from_file_location(
                "release_generate_images", os.path.join(args.release, "generate_images.py"))
            gen = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(gen)
            self.edm_sampler = gen.edm_sampler

    def peak_device_gib(self) -> float:
        if self.device.type != "cuda":
            return float("nan")
        return self.torch.cuda.max_memory_allocated(self.device) / 2**30

    def _sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def train(self, iters: int) -> float:
        torch, net = self.torch, self.net
        net.train().requires_grad_(True)
        self._sync()
        t = time.perf_counter()
        for _ in range(iters):
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(net=net, images=self.images, labels=self.labels)
            loss.sum().mul(1 / self.bs).backward()
            lr = self.lr_fn(cur_nimg=self.cur_nimg, batch_size=self.bs,
                            ref_lr=float(self.config.optim.ref_lr),
                            ref_batches=float(self.config.optim.t_ref),
                            rampup_Mimg=float(self.config.optim.rampup_kimg) / 1000)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            for p in net.parameters():
                if p.grad is not None:
                    torch.nan_to_num(p.grad, nan=0, posinf=0, neginf=0, out=p.grad)
            self.optimizer.step()
            self.cur_nimg += self.bs
            self.ema.update(cur_nimg=self.cur_nimg, batch_size=self.bs)
        self._sync()
        return self.bs * iters / (time.perf_counter() - t)

    def sample(self, iters: int, batch: int, guidance: float = 1.0) -> float:
        """img/s of `edm_sampler` over `iters` batches; `guidance != 1`: the net guided
        by itself (a guide of the same size: the cost of CFG or autoguidance)."""
        torch = self.torch
        self.net.eval().requires_grad_(False)
        with torch.no_grad():
            self.net.unet.out_gain.fill_(0.1)  # as ours: a non-silent output layer
            self._sync()
            t = time.perf_counter()
            for _ in range(iters):
                noise = torch.randn(batch, *self.shape, device=self.device)
                labels = (torch.eye(self.label_dim, device=self.device)[
                    torch.zeros(batch, dtype=torch.long)] if self.label_dim else None)
                kw = dict(gnet=self.net, guidance=guidance) if guidance != 1 else {}
                x = self.edm_sampler(self.net, noise, labels, num_steps=self.args.steps, **kw)
                (x * 127.5 + 128).clip(0, 255).to(torch.uint8).cpu()
            self._sync()
        return batch * iters / (time.perf_counter() - t)


# ----------------------------------------------------------------------------- main


def run_pairs(name, fa, fb, pairs, label_a="release", label_b="edm2-jax") -> float:
    """Alternate `fa` (None: ours only) and `fb` `pairs` times; print each pair and the
    medians; return the median img/s of `fb`."""
    ratios, a_all, b_all = [], [], []
    for p in range(pairs):
        a = fa() if fa else float("nan")
        b = fb()
        a_all.append(a)
        b_all.append(b)
        if fa:
            ratios.append(b / a)
            print(f"{name} pair {p}: {label_a} {a:.2f} img/s  {label_b} {b:.2f} img/s  "
                  f"ratio {b / a:.2f}x", flush=True)
        else:
            print(f"{name} run {p}: {label_b} {b:.2f} img/s", flush=True)
    if fa:
        print(f"{name} median: {label_a} {statistics.median(a_all):.2f} img/s  {label_b} "
              f"{statistics.median(b_all):.2f} img/s  ratio {statistics.median(ratios):.2f}x",
              flush=True)
    else:
        print(f"{name} median: {label_b} {statistics.median(b_all):.2f} img/s", flush=True)
    return statistics.median(b_all)


def forward_flops(net, batch: int) -> float:
    """Model FLOPs of one forward pass of `net` on `batch` images: 2 x multiply-adds of
    every convolution and matmul in its jaxpr (elementwise work not counted;
    `edm2_jax.planner.plan.forward_flops`). The paper's Table 2 "Gflops" are
    multiply-adds, half of this (img512-xs: 89.9 GFLOP here, 46 there)."""
    from edm2_jax.planner import plan
    return plan.forward_flops(net, batch)


def worker(args) -> None:
    """One side in its own process: build it, then answer 'train N' / 'sample N B' /
    'info' / 'quit' lines on stdin with one JSON line each on stdout."""
    import json
    from edm2_jax import process
    process.add_default_xla_flags()  # before JAX starts: the XLA flags of edm2_jax.main
    config = build_config(args)
    side = Release(config, args) if args.worker == "release" else Ours(config, args)
    info = {"peak_rss_gib": 0.0}
    info["malloc"] = process.malloc_in_effect()
    if args.worker == "ours":
        import jax
        dev = jax.devices()[0]
        info.update(device=f"{dev.platform}:{dev.device_kind} x{jax.device_count()}",
                    compile_s=getattr(side, "compile_s", float("nan")),
                    platform=dev.platform,
                    train_flops_per_img=3 * forward_flops(side.net, 1))
    print("READY " + json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "train":
            out = {"img_s": side.train(int(cmd[1]))}
        elif cmd[0] == "sample":
            out = {"img_s": side.sample(int(cmd[1]), int(cmd[2]))}
        else:
            out = {"peak_rss_gib": peak_rss_gib(), "peak_device_gib": side.peak_device_gib()}
        print("RESULT " + json.dumps(out), flush=True)


class Worker:
    """The orchestrator's handle on a worker process (`--worker=KIND` of `script`, this
    file by default: 'ours' or 'release'; benchmarks/scm_side_by_side.py runs its own)."""

    def __init__(self, kind: str, argv: list[str], env: dict, script: str = __file__):
        import subprocess
        self.kind = kind
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(script), *argv,
                                      f"--worker={kind}"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read("READY")

    def _read(self, tag: str) -> dict:
        import json
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        raise SystemExit(f"the {self.kind} worker exited (code {self.proc.wait()}); "
                         "its error is above")

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read("RESULT")

    def img_s(self, cmd: str) -> float:
        out = self.ask(cmd)["img_s"]
        time.sleep(0.5)  # let this side's thread pools go idle before the other side runs
        return out

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait()


def worker_envs(env: dict, peer_malloc: str = "default") -> tuple[dict, dict]:
    """The environments of the two workers: ours under the settings `python -m
    edm2_jax.main` re-executes itself with (edm2_jax/process.py: host allocator, CPU
    devices); the peer's (the release, or a fork of it) under the allocator it is started
    with, unless `peer_malloc='ours'` gives it ours."""
    from edm2_jax import process
    env_ours = dict(env)
    env_ours.update(process.default_xla_flags(env_ours))
    env_ours.update(process.launch_env(env_ours), **{process.APPLIED: "1"})
    env_peer = dict(env)
    if peer_malloc == "ours":
        env_peer.update({k: v for k, v in env_ours.items()
                         if k in ("LD_PRELOAD", "GLIBC_TUNABLES") or k.startswith("TCMALLOC")})
    return env_ours, env_peer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", default="", help="path to a checkout of NVlabs/edm2")
    ap.add_argument("--config", default="configs/fashion_mnist.py")
    ap.add_argument("--preset", default="", help="a released preset's network instead")
    ap.add_argument("--net", default="", choices=["", *NETS], help="a named net instead")
    ap.add_argument("--batch", type=int, default=0, help="training batch (0 = config's)")
    ap.add_argument("--sample_batch", type=int, default=100)
    ap.add_argument("--steps", type=int, default=32, help="sampler steps")
    ap.add_argument("--work", default="train,sample", help="train, sample or both")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--iters", type=int, default=5, help="train steps per measurement")
    ap.add_argument("--sample_iters", type=int, default=1, help="sampler batches per measurement")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="ours; the release uses fp16 on a GPU unless float32")
    ap.add_argument("--device", default="", help="'cpu' forces the release onto the CPU")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = all cores)")
    ap.add_argument("--peak_tflops", type=float, default=0.0,
                    help="device peak for MFU (default: dense bf16 of a known GPU)")
    ap.add_argument("--release_malloc", default="default", choices=["default", "ours"],
                    help="the release's host allocator: the one this process has (default) "
                         "or ours ($EDM2_JAX_MALLOC, edm2_jax/process.py)")
    ap.add_argument("--worker", default="", choices=["", "ours", "release"],
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.work = [w.strip() for w in args.work.split(",") if w.strip()]
    if args.worker:
        return worker(args)

    # Each side runs in its own process (no shared thread pools or allocators); the
    # other side is idle, blocked on its stdin, while one is timed.
    argv = [a for a in sys.argv[1:] if not a.startswith("--worker")]
    env = dict(os.environ)
    if args.release:
        # Two processes on one GPU: JAX must not take 75% of its memory up front.
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
    env_ours, env_rel = worker_envs(env, args.release_malloc)
    ours = Worker("ours", argv, env_ours)
    rel = Worker("release", argv, env_rel) if args.release else None
    info = ours.info
    print(f"net={args.preset or args.net or args.config} "
          f"batch={args.batch or build_config(args).batch_size} device={info['device']} "
          f"dtype={args.dtype} cpus={os.cpu_count()} host allocator: edm2-jax "
          f"{info['malloc']}" + (f", release {rel.info['malloc']}" if rel else ""), flush=True)
    if "train" in args.work:
        print(f"edm2-jax train-step compile {info['compile_s']:.1f} s; model FLOPs "
              f"{info['train_flops_per_img'] / 1e9:.2f} GFLOP per training image "
              f"(3 x forward)", flush=True)
        for w in (rel, ours):
            if w:
                w.img_s(f"train {args.warmup}")
        med = run_pairs("train", rel and (lambda: rel.img_s(f"train {args.iters}")),
                        lambda: ours.img_s(f"train {args.iters}"), args.pairs)
        tflops = info["train_flops_per_img"] * med / 1e12
        line = f"edm2-jax train: {tflops:.2f} model TFLOP/s"
        if info["platform"] == "gpu":
            peak = peak_tflops(args, info["device"])
            line += f", MFU {100 * tflops / peak:.1f}% of {peak:.0f} TFLOP/s"
        print(line, flush=True)
    if "sample" in args.work:
        b = args.sample_batch
        for w in (rel, ours):
            if w:
                w.img_s(f"sample 1 {b}")
        run_pairs(f"sample({args.steps} steps, batch {b})",
                  rel and (lambda: rel.img_s(f"sample {args.sample_iters} {b}")),
                  lambda: ours.img_s(f"sample {args.sample_iters} {b}"), args.pairs)
    for w in (rel, ours):
        if w:
            st = w.ask("info")
            print(f"{'release' if w is rel else 'edm2-jax'}: peak host RSS "
                  f"{st['peak_rss_gib']:.2f} GiB, peak device memory "
                  f"{st['peak_device_gib']:.2f} GiB", flush=True)
            w.close()


if __name__ == "__main__":
    main()
