"""`--mode=generate`: images for a seed range from any network this project knows.

    python -m edm2_jax.main --mode=generate --net=runs/fmnist --seeds=0-999 --outdir=out
    python -m edm2_jax.main --mode=generate --net=nets/img64-s --seeds=0-49999 --subdirs \
        --guide=nets/img64-xs --guidance=1.4 --outdir=out
    python -m edm2_jax.main --mode=generate --net=runs/fmnist --seeds=0-99 --grid=out/grid.png
    python -m edm2_jax.main --mode=generate --net=nets/img512-s --vae=sd-vae-ft-mse/ \
        --seeds=0-63 --outdir=out       # latent net: decoded to 512x512 RGB PNGs

`--net` may be a network checkpoint (written by `--mode=convert` or post-hoc EMA), a
training run directory (its latest checkpoint; `--ema=0.100` picks the power EMA,
`--ema=online` the raw weights, default the largest sigma_rel), or one EMA snapshot
directory of a run (`RUN/snapshots/<step>`).

A latent network (SD-VAE latents: `network.json` meta or the run's `data.encoder` says
'sd-vae', or a 4-channel net, as every img512 net of the release; `vae.encoder_of`) needs
`--vae=PATH`, the SD VAE whose decoder turns its samples into RGB (`vae.load_vae`,
decoding in batches of `SDVAE.batch_size` per device); a pixel-space net refuses one.
Both are checked from the metadata before any weights are read.

Owns `load_net` (a network and its variables from any of those; reading them is
`run/network_dir.py`'s, `run/snapshots.py`'s and `run/checkpoints.py`'s), `net_encoder`
and `check_vae` (which decoder a net's samples need), `load_guide`, `generate_images`
(seeds to images, split over processes and devices) and the CLI body `main_generate`.
"""
from __future__ import annotations

import os
import re
import time
from typing import Iterable, Sequence

import jax
import numpy as np
import PIL.Image
from tqdm import tqdm

from edm2_jax.run import network_dir as ckpt_lib
from edm2_jax import paths
from edm2_jax.run import checkpoints, layout, snapshots
from edm2_jax.model import vae as vae_lib
from edm2_jax.model.networks import Precond, precond_from_config
from edm2_jax.sampling import consistency
from edm2_jax.sampling.sampler import sample_images, save_image_grid

MAX_SEEDS_PER_DIR = 1000


def parse_seeds(spec: str) -> list[int]:
    """'0-49999' / '1,5,7-9' -> list of ints. Raises ValueError on a malformed range."""
    seeds: list[int] = []
    for part in str(spec).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"bad seed spec {part!r}; use e.g. '0-49999' or '1,5,7-9'")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"seed range {part!r} is empty")
        seeds.extend(range(lo, hi + 1))
    return seeds


def load_net(path: str, ema: str | None = None) -> tuple[Precond, dict, str]:
    """Load `(net, variables, description)` from any checkpoint kind (see module doc).

    Raises FileNotFoundError naming what was looked for, KeyError for an unknown EMA.
    """
    path = paths.normalize(path)  # local or gs://
    if ckpt_lib.is_network_checkpoint(path) and layout.is_run(path):
        raise ValueError(f"{path} is both a training run and a network checkpoint "
                         f"(network.json + variables/, e.g. from --mode=convert into the run); "
                         f"move {ckpt_lib.NETWORK_JSON} and {ckpt_lib.VARIABLES}/ to a "
                         f"directory of their own and pass the one you mean")
    if ckpt_lib.is_network_checkpoint(path):
        cfg, variables, meta = ckpt_lib.load_network(path)
        return precond_from_config(cfg), variables, f"network checkpoint {path}"

    snap = re.fullmatch(rf"(.*)/{layout.SNAPSHOTS}/(\d+)/?", path)
    if snap:
        run_dir, step = snap.group(1), int(snap.group(2))
        tree, meta = snapshots.restore_snapshot(run_dir, step)
        key = ema or max(tree["power"], key=float)
        if key not in tree["power"]:
            raise KeyError(f"snapshot {path} has EMAs {sorted(tree['power'])}, not {key!r}")
        variables = {"params": tree["power"][key], "buffers": snapshots.run_buffers(run_dir)}
        return (precond_from_config(layout.network_config(run_dir)), variables,
                f"EMA {key} of snapshot {step} ({meta['nimg'] / 1000:.1f} kimg) in {run_dir}")

    if layout.is_run(path):
        state = checkpoints.restore_latest_state(path)
        if ema == "online":
            params, what = state["params"], "online weights"
        else:
            key = ema or max(state["ema"]["power"], key=float)
            if key not in state["ema"]["power"]:
                raise KeyError(f"run {path} tracks EMAs {sorted(state['ema']['power'])}, not "
                               f"{key!r} (or use --ema=online)")
            params, what = state["ema"]["power"][key], f"EMA sigma_rel={key}"
        return (precond_from_config(layout.network_config(path)),
                {"params": params, "buffers": state["buffers"]},
                f"{what} of run {path} at step {int(state['step'])}")
    raise FileNotFoundError(
        f"{path} is neither a network checkpoint (network.json + variables/), a training run "
        f"(config.json + checkpoints/), nor an EMA snapshot (RUN/snapshots/<step>)")


def _metadata(path: str) -> tuple[dict | None, dict, dict | None]:
    """`(network config, network.json meta, the run's config.json)` of the network at
    `path`, from its metadata only (the run's config.json for a run or its snapshot;
    None where there is none)."""
    path = paths.normalize(path)
    if ckpt_lib.is_network_checkpoint(path):
        cfg, meta = ckpt_lib.read_network_json(path)
        return cfg, meta, None
    snap = re.fullmatch(rf"(.*)/{layout.SNAPSHOTS}/(\d+)/?", path)
    config = layout.read_config(snap.group(1) if snap else path)
    if config is None or "network" not in config:
        return None, {}, None
    return config["network"], {}, config


def net_config(path: str) -> dict:
    """The network config (`Precond` kwargs) of the network at `path` (any kind
    `load_net` reads), from its metadata only. Raises FileNotFoundError as `load_net`
    does when `path` is none of those kinds."""
    cfg, _, _ = _metadata(path)
    if cfg is None:
        load_net(path)  # raises, naming what was looked for
    return cfg


def student_sampler(path: str) -> dict | None:
    """The few-step sampler settings (`sample_images`' `sampler='consistency'`,
    `num_steps` = the student's steps, `teacher_steps`, `sigma_min`, `sigma_max`, `rho`)
    of a distilled student at `path` (a distillation run, its snapshot, or a network
    whose meta records `distill`, as post-hoc EMA writes it), or None for a diffusion
    network (the Heun sampler)."""
    _, meta, config = _metadata(path)
    distill = meta.get("distill") or (config or {}).get("distill")
    if not distill and meta.get("source") and meta.get("phema"):  # post-hoc EMA of a run
        distill = (layout.read_config(str(meta["source"])) or {}).get("distill")
    if not distill or not distill.get("teacher"):
        return None
    return consistency.sampler_kwargs(distill)


def net_encoder(path: str) -> str:
    """The encoder ('none' or 'sd-vae', `vae.ENCODERS`) of the network at `path` (any
    kind `load_net` reads), from its metadata only: network.json, or the run's
    config.json (`vae.encoder_of`). Raises what reading them raises; a path of no known
    kind gives 'none' (`load_net` then names the problem)."""
    path = paths.normalize(path)
    if ckpt_lib.is_network_checkpoint(path):
        cfg, meta = ckpt_lib.read_network_json(path)
        return vae_lib.encoder_of(cfg, meta)
    snap = re.fullmatch(rf"(.*)/{layout.SNAPSHOTS}/(\d+)/?", path)
    config = layout.read_config(snap.group(1) if snap else path)
    if config is None or "network" not in config:
        return "none"
    return vae_lib.encoder_of(config["network"], data_config=config.get("data"))


def check_vae(net_path: str, vae_path: str | None,
              guide_path: str | None = None) -> vae_lib.SDVAE | None:
    """The SD VAE that decodes the samples of the network at `net_path`, or None for a
    pixel-space net. Raises ValueError when a latent net comes without `--vae`, a
    pixel-space net with one, or the guide's space differs from the net's; the errors
    of `vae.load_vae` for a bad VAE file. Reads metadata and the VAE only."""
    encoder = net_encoder(net_path)
    if guide_path and net_encoder(guide_path) != encoder:
        raise ValueError(f"--guide={guide_path} works in encoder {net_encoder(guide_path)!r} "
                         f"space but --net={net_path} in {encoder!r}; guide a net with one "
                         f"trained on the same data")
    if encoder == "sd-vae" and not vae_path:
        raise ValueError(f"{net_path} is a latent network (SD-VAE latents): its samples are "
                         f"decoded by the SD VAE; pass --vae=PATH (the "
                         f"diffusion_pytorch_model.safetensors or folder of "
                         f"{vae_lib.SD_VAE_URL})")
    if encoder == "none" and vae_path:
        raise ValueError(f"--vae={vae_path} given, but {net_path} is a pixel-space network "
                         f"(encoder 'none'): its samples are images already; drop --vae")
    return vae_lib.load_vae(vae_path) if encoder == "sd-vae" else None


def load_guide(guide_path: str | None, guide_ema: str | None, guidance: float
               ) -> tuple[Precond, dict] | None:
    """`(net, variables)` of the guide network for `guidance` (`load_net`), or None
    without `guide_path`. Raises ValueError for guidance != 1 without a guide (it would
    be ignored)."""
    if not guide_path:
        if guidance != 1:
            raise ValueError(f"--guidance={guidance:g} needs --guide=PATH (an unconditional "
                             f"net for CFG, a smaller or earlier one for autoguidance)")
        return None
    gnet, gvars, gdesc = load_net(guide_path, guide_ema)
    print(f"Guidance {guidance:g} with guide {gdesc}")
    return gnet, gvars


def generate_images(net: Precond, variables: dict, seeds: Sequence[int], *, outdir: str | None = None,
                    batch_size: int = 64, class_idx: int | None = None, subdirs: bool = False,
                    guide: tuple[Precond, dict] | None = None, guidance: float = 1.0,
                    num_steps: int = 32, sigma_min: float = 0.002, sigma_max: float = 80.0,
                    rho: float = 7.0, S_churn: float = 0.0, S_min: float = 0.0,
                    S_max: float = float("inf"), S_noise: float = 1.0, rng: str = "jax",
                    progress: bool = True, all_processes: bool = True,
                    vae: vae_lib.SDVAE | None = None,
                    guidance_interval: tuple[float, float] | None = None,
                    sampler: str = "heun", teacher_steps: int = 32
                    ) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    """Yield `(seeds [b], images uint8 [b, H, W, C])` batches; write `seed%06d.png` files
    to `outdir` (in `outdir/000000/`, `outdir/001000/`, ... with `subdirs`) if given.
    Sampler settings (`num_steps` ... `S_noise`), guidance, the guidance interval
    `(sigma_lo, sigma_hi)` (guidance only on the steps with `sigma_lo < t_i <= sigma_hi`,
    `guidance.guided_steps`) and the per-seed random stream `rng` ('jax' or the
    release's, 'release'), and `sampler` ('heun', or 'consistency': a few-step student's
    `num_steps` evaluations on the grid of `teacher_steps`, `student_sampler`):
    `sampler.sample_images`. With
    `vae` (a latent net, `check_vae`), the samples are decoded to RGB uint8
    `[b, 8H, 8W, 3]` by `vae.decode`, split over the same devices.

    Each process of a multi-host job takes every `process_count`-th batch (with
    `all_processes=False` the calling process takes them all); within a batch the seeds
    are split over the local devices (sampling is per seed, so images do not depend on
    batch size or device count).
    """
    n_dev = jax.local_device_count()
    batch_size = max(n_dev, (batch_size + n_dev - 1) // n_dev * n_dev)
    batches = [list(seeds[i:i + batch_size]) for i in range(0, len(seeds), batch_size)]
    mine = batches[jax.process_index()::jax.process_count()] if all_processes else batches
    mesh = jax.sharding.Mesh(np.asarray(jax.local_devices()), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    guide_net, guide_vars = guide if guide else (None, None)
    bar = tqdm(total=sum(len(b) for b in mine), unit="img", disable=not progress,
               dynamic_ncols=True)
    for b in mine:
        padded = np.asarray(b + [b[-1]] * (batch_size - len(b)), np.int64)
        seeds_dev = jax.device_put(padded.astype(np.uint32), sharding)
        imgs = np.asarray(sample_images(
            net, variables, seeds_dev, class_idx, guide_net=guide_net, guide_variables=guide_vars,
            guidance=guidance, num_steps=num_steps, sigma_min=sigma_min, sigma_max=sigma_max,
            rho=rho, S_churn=S_churn, S_min=S_min, S_max=S_max, S_noise=S_noise,
            rng=rng, raw=vae is not None, guidance_interval=guidance_interval,
            sampler=sampler, teacher_steps=teacher_steps))[:len(b)]
        if vae is not None:
            imgs = vae.decode(imgs, sharding=sharding)
        if outdir:
            for seed, img in zip(b, imgs):
                d = os.path.join(outdir, f"{seed - seed % MAX_SEEDS_PER_DIR:06d}") if subdirs else outdir
                paths.makedirs(d)  # outdir may be gs:// (paths.py)
                with paths.open(os.path.join(d, f"{seed:06d}.png"), "wb") as f:
                    PIL.Image.fromarray(img[..., 0] if img.shape[-1] == 1 else img).save(
                        f, format="PNG")
        bar.update(len(b))
        yield np.asarray(b), imgs
    bar.close()


def main_generate(net_path: str, seeds: str, outdir: str | None, *, ema: str | None = None,
                  batch_size: int = 64, class_idx: int | None = None, subdirs: bool = False,
                  guide_path: str | None = None, guide_ema: str | None = None,
                  guidance: float = 1.0, grid: str | None = None, vae_path: str | None = None,
                  **sampler_kw) -> None:
    """CLI body of `--mode=generate` (see module doc). `vae_path`: `--vae`, checked
    first (`check_vae`). `sampler_kw`: `num_steps`, `sigma_min`, `sigma_max`, `rho`,
    `S_churn`, `S_min`, `S_max`, `S_noise`, `rng` of `generate_images`. The outputs
    are checked first (`paths.check_output_dir`: writable, not a file, a reachable
    bucket), before any weights are read or any image sampled."""
    seed_list = parse_seeds(seeds)
    if not outdir and not grid:
        raise ValueError("--mode=generate needs --outdir=DIR and/or --grid=FILE.png")
    if outdir:
        paths.check_output_dir(outdir, "--outdir")
    if grid:
        paths.check_output_file(grid, "--grid")
    vae = check_vae(net_path, vae_path, guide_path)
    net, variables, desc = load_net(net_path, ema)
    steps = sampler_kw.get("num_steps", 32)
    how = (f"the few-step sampler, {steps} evaluation(s)"
           if sampler_kw.get("sampler") == "consistency" else
           f"the Heun sampler, {steps} steps ({2 * steps - 1} evaluations)")
    print(f"Generating {len(seed_list)} images from {desc} with {how}"
          + (f", decoded by the SD VAE {vae.path}" if vae else ""))
    guide = load_guide(guide_path, guide_ema, guidance)
    t = time.time()
    all_imgs = []
    for _, imgs in generate_images(net, variables, seed_list, outdir=outdir, batch_size=batch_size,
                                   class_idx=class_idx, subdirs=subdirs, guide=guide,
                                   guidance=guidance, vae=vae, **sampler_kw):
        if grid:
            all_imgs.append(imgs)
    dt = time.time() - t
    print(f"{len(seed_list)} images in {dt:.1f} s ({len(seed_list) / dt:.2f} img/s)"
          + (f" -> {outdir}" if outdir else ""))
    if grid and jax.process_index() == 0:
        imgs = np.concatenate(all_imgs)
        cols = int(np.ceil(np.sqrt(len(imgs))))
        rows = int(np.ceil(len(imgs) / cols))
        paths.write_through_local(grid, lambda local: save_image_grid(imgs, local, rows, cols))
        print(f"Grid -> {grid}")
