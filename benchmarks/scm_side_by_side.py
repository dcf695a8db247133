"""Side-by-side step time of sCD (continuous-time consistency distillation): our `scm`
objective's jitted training step against the sCD loss of EpiGenomicsCode/edm2_sCM, a
PyTorch fork of the EDM2 release, in one call on the same CPU and network config.

    python benchmarks/scm_side_by_side.py --fork=PATH/TO/edm2_sCM --steps=3 --repeats=3 \
        --out=/tmp/scm_side_by_side.json

`--fork` is a checkout of EpiGenomicsCode/edm2_sCM that you have (CC BY-NC-SA: nothing of
it is vendored here); its `training/loss_scm.py` (`TrigFlowSCMLoss`) and
`training/networks_trigflow.py` (`TrigFlowPrecond`), with the `torch_utils` and `dnnlib`
they import, are imported from that path at run time only. Both sides run the network
of `--config` (default `configs/fashion_mnist.py:tiny`: 32x32x1, 10 classes, model
channels 16, mult 1,2, one block per level, no attention at 16/8), batch `--batch`
(default the config's, 32), float32, on the CPU, random data already in memory, random
weights, the teacher a frozen copy of the student's initial weights:

- **fork**: one optimiser step as its `training_loop_trigflow` takes it with the sCD
  loss: `loss_fn.cur_iter` set, `TrigFlowSCMLoss(mode='scd')` (the teacher's forward
  under `no_grad`, the student's primal and tangent in one `torch.func.jvp`),
  `loss.sum() / batch` backward, the learning rate set, the gradient norm and NaN
  count it reports, `nan_to_num` of the gradients, Adam (betas 0.9/0.99, eps 1e-11,
  its non-CIFAR setting), then two power-function EMAs (sigma_rel 0.05/0.10: the
  update ours makes; the fork's own EMA class is not needed for the loss, so this
  benchmark updates them itself).
- **ours**: the `scm` objective's training step (`objective_cost.objective_step`:
  `step.make_train_step` jitted by `step.jit_train_step`, one device), which does the
  teacher's forward, the student's jvp and its forward and backward pass, Adam, forced
  weight normalisation and the two EMAs in one compiled program.

Each side runs in its own process (as `compare_release.py`: in one process torch's
OpenMP threads and XLA's pool slow each other down), torch with
`torch.set_num_threads(--threads)` (default: all cores, as XLA uses); measurements
alternate fork, ours, `--repeats` times, each timing `--steps` steps after `--warmup`
steps, so drift in machine load hits both sides alike. Each pair prints both img/s and
the ratio ours / fork (above 1: ours faster), the last line the medians; `--out` writes
them with the machine, load average and commit as JSON. On a loaded machine run `--threads=1` too:
with 2 torch threads on 2 oversubscribed cores the fork's step collapsed (README).

The two steps are not the same function (benchmarks/README.md, "sCD against
EpiGenomicsCode/edm2_sCM"): the fork's network is its TrigFlow U-Net (a positional
embedding of t, adaptive double normalisation: a normalised scale and shift per block,
a logvar head on a positional embedding of t), ours the EDM2 network as it is (MP-Fourier
embedding of ln(sigma)/4, EDM2's multiplicative modulation and logvar head) read as a
TrigFlow F; the fork's loss is elementwise in float64 with the logvar counted once per
pixel (unless `logvar_per_sample`), ours per image in the network's dtype.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

# Keys of our network config that the fork's TrigFlowPrecond / TrigFlowUNet / Block take
# under the same names and meanings.
FORK_NET_KEYS = ("img_resolution", "img_channels", "label_dim", "model_channels",
                 "channel_mult", "channel_mult_noise", "channel_mult_emb", "num_blocks",
                 "attn_resolutions", "label_balance", "concat_balance", "channels_per_head",
                 "dropout", "res_balance", "attn_balance", "clip_act", "sigma_data",
                 "logvar_channels")
FORK_FILES = ("training/loss_scm.py", "training/networks_trigflow.py",
              "torch_utils/persistence.py", "torch_utils/misc.py")


def check_fork(path: str) -> str:
    """`path` made absolute, or SystemExit with one `error:` line when it is not a
    checkout of EpiGenomicsCode/edm2_sCM with the files the sCD loss needs."""
    if not path:
        raise SystemExit("error: --fork=PATH is required: a checkout of "
                         "EpiGenomicsCode/edm2_sCM (training/loss_scm.py there)")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise SystemExit(f"error: --fork={path!r} is not a directory")
    missing = [f for f in FORK_FILES if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise SystemExit(f"error: --fork={path!r} is not a checkout of "
                         f"EpiGenomicsCode/edm2_sCM (no {', '.join(missing)} there)")
    with open(os.path.join(path, "training/loss_scm.py"), encoding="utf-8") as f:
        if "class TrigFlowSCMLoss" not in f.read():
            raise SystemExit(f"error: --fork={path!r}: its training/loss_scm.py has no "
                             "TrigFlowSCMLoss (not EpiGenomicsCode/edm2_sCM)")
    return path


def build_config(args):
    from train_throughput import load_config
    path, sep, variant = args.config.partition(":")
    if not os.path.isfile(path) and os.path.isfile(os.path.join(ROOT, path)):
        path = os.path.join(ROOT, path)  # the repo's configs from any directory
    config = load_config(path + sep + variant)
    if args.batch:
        config.batch_size = args.batch
    config.network.dtype = "float32"
    config.batch_per_device = 0
    return config


# ----------------------------------------------------------------------------- ours


class Ours:
    def __init__(self, config, args):
        import jax
        from objective_cost import objective_step
        self.jax, self.bs = jax, int(config.batch_size)
        net = config.network.to_dict()
        # What the fork's side builds (it imports no JAX): the network, batch, EMAs, lr.
        self.spec = {"network": {k: (list(v) if isinstance(v, tuple) else v)
                                 for k, v in net.items() if k in FORK_NET_KEYS},
                     "batch": self.bs, "sigma_rels": list(config.ema.sigma_rels),
                     "optim": {k: float(config.optim[k])
                               for k in ("ref_lr", "t_ref", "rampup_kimg")}}
        fn, self.state, self.batch = objective_step(config, "scm", abstract=False)
        t = time.perf_counter()
        self.fn = fn.lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - t
        self.params = sum(int(x.size) for x in jax.tree_util.tree_leaves(self.state["params"]))
        dev = jax.devices()[0]
        self.device = f"{dev.platform} x{jax.device_count()}"

    def train(self, steps: int) -> float:
        t = time.perf_counter()
        for _ in range(steps):
            self.state, metrics = self.fn(self.state, self.batch)
        self.jax.block_until_ready((self.state, metrics))
        return self.bs * steps / (time.perf_counter() - t)


# ----------------------------------------------------------------------------- fork


class Fork:
    def __init__(self, spec: dict, args):
        sys.path.insert(0, args.fork)
        import torch
        from training.loss_scm import TrigFlowSCMLoss
        from training.networks_trigflow import TrigFlowPrecond
        torch.set_num_threads(args.threads or os.cpu_count())
        self.torch, self.optim = torch, spec["optim"]
        kw = spec["network"]
        torch.manual_seed(0)
        self.net = TrigFlowPrecond(use_fp16=False, **kw).train().requires_grad_(True)
        teacher = copy.deepcopy(self.net).eval().requires_grad_(False)
        # The fork's defaults: P_mean -1.0, P_std 1.6, c 0.1, warmup 10k iterations (ours:
        # the same proposal and c, `objectives/scm.py`); none changes the step's work.
        self.loss_fn = TrigFlowSCMLoss(mode="scd", sigma_data=float(kw.get("sigma_data", 0.5)),
                                       teacher_net=teacher)
        self.bs = int(spec["batch"])
        r, c, L = kw["img_resolution"], kw["img_channels"], kw.get("label_dim", 0)
        self.images = torch.rand(self.bs, c, r, r) * 2 - 1
        self.labels = torch.eye(L)[torch.randint(0, L, (self.bs,))] if L else None
        self.optimizer = torch.optim.Adam(self.net.parameters(), betas=(0.9, 0.99), eps=1e-11)
        self.params = sum(p.numel() for p in self.net.parameters())
        # Two power-function EMAs (Karras et al. 2024, eq. 3): gamma from sigma_rel.
        self.gammas = [self._gamma(s) for s in spec["sigma_rels"]]
        with torch.no_grad():
            self.emas = [[p.detach().clone() for p in self.net.parameters()]
                         for _ in self.gammas]
        self.step = 0
        self.device = f"cpu ({torch.get_num_threads()} torch threads)"

    @staticmethod
    def _gamma(sigma_rel: float) -> float:
        import numpy as np
        t = sigma_rel ** -2
        return float(np.roots([1, 7, 16 - t, 12 - t]).real.max())

    def train(self, steps: int) -> float:
        torch, net, optim = self.torch, self.net, self.optim
        t0 = time.perf_counter()
        for _ in range(steps):
            self.optimizer.zero_grad(set_to_none=True)
            self.loss_fn.cur_iter = self.step
            loss = self.loss_fn(net=net, images=self.images, labels=self.labels)
            loss.sum().mul(1 / self.bs).backward()
            # Inverse-square-root decay after t_ref batches, linear ramp-up (EDM2's form).
            nimg = self.step * self.bs
            lr = optim["ref_lr"] / max(self.step / optim["t_ref"], 1) ** 0.5
            if optim["rampup_kimg"] > 0:
                lr *= min(nimg / (optim["rampup_kimg"] * 1000), 1)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            sq, bad = torch.zeros([]), torch.zeros([])
            for p in net.parameters():
                if p.grad is not None:
                    g = p.grad.float()
                    nonfinite = (~torch.isfinite(g)).any()
                    bad += nonfinite
                    sq += torch.where(nonfinite, torch.zeros_like(sq), g.square().sum())
                    torch.nan_to_num(p.grad, nan=0, posinf=0, neginf=0, out=p.grad)
            float(bad)  # the fork's loop reads the count back every step
            self.optimizer.step()
            self.step += 1
            with torch.no_grad():
                params = [p.detach() for p in net.parameters()]
                for gamma, ema in zip(self.gammas, self.emas):
                    beta = (1 - 1 / (self.step + 1)) ** (gamma + 1)
                    torch._foreach_lerp_(ema, params, 1 - beta)
        return self.bs * steps / (time.perf_counter() - t0)


# ----------------------------------------------------------------------------- workers


def worker(args) -> None:
    """One side in its own process: build it, then answer 'train N' / 'quit' lines on
    stdin with one JSON line each on stdout."""
    from edm2_jax import process
    if args.worker == "fork":
        side = Fork(json.loads(args.spec), args)
    else:
        process.add_default_xla_flags()  # before JAX starts: the XLA flags of edm2_jax.main
        side = Ours(build_config(args), args)
    info = {"params": side.params, "device": side.device, "malloc": process.malloc_in_effect(),
            "compile_s": getattr(side, "compile_s", None), "spec": getattr(side, "spec", None)}
    print("READY " + json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        print("RESULT " + json.dumps({"img_s": side.train(int(cmd[1]))}), flush=True)


def Worker(kind: str, argv: list[str], env: dict):
    """A worker process of this file (`--worker=ours|fork`), as compare_release.py runs its
    own: `.img_s("train N")`, `.close()`."""
    import compare_release
    return compare_release.Worker(kind, argv, env, script=__file__)


def machine() -> dict:
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f
                          if ln.startswith("model name")), model)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"cpu": model, "cores": os.cpu_count(), "loadavg": list(os.getloadavg()),
            "commit": commit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fork", default="", help="path to a checkout of EpiGenomicsCode/edm2_sCM")
    ap.add_argument("--config", default="configs/fashion_mnist.py:tiny",
                    help="config file[:variant] whose network both sides build")
    ap.add_argument("--batch", type=int, default=0, help="training batch (0 = config's)")
    ap.add_argument("--steps", type=int, default=3, help="training steps per measurement")
    ap.add_argument("--repeats", type=int, default=3, help="alternated fork/ours pairs")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = all cores)")
    ap.add_argument("--fork_malloc", default="default", choices=["default", "ours"],
                    help="the fork's host allocator: this process's (default) or ours")
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    ap.add_argument("--worker", default="", choices=["", "ours", "fork"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if min(args.steps, args.repeats) < 1 or min(args.warmup, args.batch, args.threads) < 0:
        raise SystemExit("error: --steps and --repeats must be >= 1; --warmup, --batch "
                         "and --threads >= 0")
    args.fork = check_fork(args.fork)
    if args.worker:
        return worker(args)

    argv = [f"--fork={args.fork}", f"--config={args.config}", f"--batch={args.batch}",
            f"--threads={args.threads}"]
    import compare_release
    env_ours, env_fork = compare_release.worker_envs(dict(os.environ), args.fork_malloc)
    ours = Worker("ours", argv, env_ours)  # first: it reads the config, the fork gets its spec
    spec = ours.info["spec"]
    fork = Worker("fork", [*argv, "--spec=" + json.dumps(spec)], env_fork)
    m = machine()
    print(f"config={args.config} batch={spec['batch']} float32; cpu {m['cpu']!r}, "
          f"{m['cores']} cores, load average {m['loadavg'][0]:.2f}; commit {m['commit']}",
          flush=True)
    print(f"ours: {ours.info['device']}, {ours.info['params']} params, step compiled in "
          f"{ours.info['compile_s']:.1f} s, allocator {ours.info['malloc']}; fork: "
          f"{fork.info['device']}, {fork.info['params']} params, allocator "
          f"{fork.info['malloc']}", flush=True)
    if args.warmup:
        for w in (fork, ours):
            w.img_s(f"train {args.warmup}")
    pairs = []
    for i in range(args.repeats):
        f, o = fork.img_s(f"train {args.steps}"), ours.img_s(f"train {args.steps}")
        pairs.append({"fork_img_s": f, "ours_img_s": o, "ratio": o / f})
        print(f"pair {i}: fork {f:.2f} img/s  ours {o:.2f} img/s  ratio {o / f:.2f}x",
              flush=True)
    med = {k: statistics.median(p[k] for p in pairs) for k in pairs[0]}
    print(f"median: fork {med['fork_img_s']:.2f} img/s  ours {med['ours_img_s']:.2f} img/s  "
          f"ratio (ours / fork) {med['ratio']:.2f}x", flush=True)
    for w in (fork, ours):
        w.close()
    m["loadavg_end"] = list(os.getloadavg())
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"command": " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
                       "config": args.config, "batch": spec["batch"],
                       "dtype": "float32", "steps": args.steps, "repeats": args.repeats,
                       "machine": m, "ours": ours.info, "fork": fork.info,
                       "pairs": pairs, "median": med}, fh, indent=1)
        print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
