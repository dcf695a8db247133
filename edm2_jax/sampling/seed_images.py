"""Images for a seed range from a network: `generate_images` (seeds to uint8 images, split
over processes and devices, optionally written as `seed%06d.png` files) and `parse_seeds`
(the text of `--seeds`).

Reading a network from a path (and which sampler and decoder it needs) is `nets.py`'s;
the body of `--mode=generate` is `modes/generate.py`'s.
"""
from __future__ import annotations

import os
import re
from typing import Iterable, Sequence

import jax
import numpy as np
import PIL.Image
from tqdm import tqdm

from edm2_jax import paths
from edm2_jax.encoders import vae as vae_lib
from edm2_jax.model.networks import Precond
from edm2_jax.sampling import solvers
from edm2_jax.sampling.sampler import sample_images

MAX_SEEDS_PER_DIR = 1000


# Seeds are 32-bit (a JAX key's and the release's torch generator's): larger ones would
# wrap onto small ones.
MAX_SEED = 2**32 - 1
MAX_SEEDS = 2**31   # the most seeds one command takes


def parse_seeds(spec: str) -> list[int]:
    """'0-49999' / '1,5,7-9' -> list of ints in `[0, MAX_SEED]`. Raises ValueError on a
    malformed or empty range, a seed above `MAX_SEED`, or more than `MAX_SEEDS` seeds."""
    seeds: list[int] = []
    for part in str(spec).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d{1,20})(?:-(\d{1,20}))?", part)
        if not m:
            raise ValueError(f"bad seed spec {part!r}; use e.g. '0-49999' or '1,5,7-9'")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"seed range {part!r} is empty")
        if hi > MAX_SEED:
            raise ValueError(f"seed {hi} in {part!r} is above {MAX_SEED}: seeds are 32-bit "
                             f"(a larger one would give a smaller seed's image)")
        if len(seeds) + hi - lo + 1 > MAX_SEEDS:
            raise ValueError(f"--seeds={spec} names more than {MAX_SEEDS} seeds")
        seeds.extend(range(lo, hi + 1))
    return seeds


def generate_images(net: Precond, variables: dict, seeds: Sequence[int], *, outdir: str | None = None,
                    batch_size: int = 64, class_idx: int | None = None, subdirs: bool = False,
                    guide: tuple[Precond, dict] | None = None, guidance: float = 1.0,
                    rng: str = "jax",
                    progress: bool = True, all_processes: bool = True,
                    vae: vae_lib.SDVAE | None = None,
                    guidance_interval: tuple[float, float] | None = None,
                    sampler: solvers.Sampler | None = None
                    ) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    """Yield `(seeds [b], images uint8 [b, H, W, C])` batches; write `seed%06d.png` files
    to `outdir` (in `outdir/000000/`, `outdir/001000/`, ... with `subdirs`) if given.
    The sampler (`sampler`, a `solvers.Sampler` value, e.g. a network's own,
    `nets.net_sampler`; None: `solvers.Heun()`), guidance, the guidance interval
    `(sigma_lo, sigma_hi)` (guidance only on the steps with `sigma_lo < t_i <= sigma_hi`,
    `guidance.guided_steps`) and the per-seed random stream `rng` ('jax' or the
    release's, 'release'): `sampler.sample_images`. With
    `vae` (a latent net, `nets.check_vae`), the samples are decoded to RGB uint8
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
        imgs, finite = sample_images(
            net, variables, seeds_dev, class_idx, guide_net=guide_net, guide_variables=guide_vars,
            guidance=guidance, rng=rng, raw=vae is not None, guidance_interval=guidance_interval,
            sampler=sampler, return_finite=True)
        imgs, finite = np.asarray(imgs)[:len(b)], np.asarray(finite)[:len(b)]
        if not finite.all():
            bad = [s for s, ok in zip(b, finite) if not ok]
            raise ValueError(f"the samples of seeds {bad[:8]}{' ...' if len(bad) > 8 else ''} are "
                             f"not finite (they overflowed): nothing written for them; check the "
                             f"sampler's settings (--guidance, --sigma_max, --S_noise, --steps) "
                             f"and the network")
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
