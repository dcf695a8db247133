"""The images an evaluation measures, as uint8 NHWC batches: an image folder (the release's
seeded random subset), a network's samples for a list of seeds, a random subset of a data
set split, and a latent data set decoded to RGB by the SD VAE (`DecodedSource`).
"""
from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import numpy as np
import PIL.Image

from edm2_jax import data as data_lib
from edm2_jax import nets, paths
from edm2_jax.encoders import vae as vae_lib
from edm2_jax.sampling import seed_images

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def folder_subset(path: str, num_images: int, seed: int = 0) -> list[str]:
    """The image files of a folder (recursive; `IMAGE_SUFFIXES`) that an evaluation of
    `num_images` of them uses, in sorted order: all of them when there are exactly
    `num_images`, else the release's seeded random subset (`calculate_metrics.py --seed`:
    the sorted file list indexed by the sorted first `num_images` entries of
    `np.random.RandomState(seed mod 2^31).permutation(count)`).

    Raises ValueError when the folder holds fewer than `num_images` images.
    """
    if paths.is_url(path):  # gs://...: the same relative names, listed through epath
        root, todo, found = paths.Path(path), [paths.Path(path)], []
        while todo:  # breadth first: epath refuses `**` patterns on GCS
            for p in todo.pop().iterdir():
                if p.is_dir():
                    todo.append(p)
                elif p.name.lower().endswith(IMAGE_SUFFIXES):
                    found.append(str(p.relative_to(root)))
        files = sorted(found)
    else:
        files = sorted(os.path.relpath(os.path.join(r, f), path) for r, _, fs in os.walk(path)
                       for f in fs if f.lower().endswith(IMAGE_SUFFIXES))
    if len(files) < num_images:
        raise ValueError(f"{path} holds {len(files)} images, fewer than --num_images="
                         f"{num_images}; generate more or lower --num_images")
    idx = np.arange(len(files))
    if len(files) > num_images:
        idx = np.sort(np.random.RandomState(seed % (1 << 31)).permutation(len(files))[:num_images])
    return [f"{path.rstrip('/')}/{files[i]}" if paths.is_url(path) else os.path.join(path, files[i])
            for i in idx]


def _read_image(path: str) -> np.ndarray:
    if not paths.is_url(path):
        return np.asarray(PIL.Image.open(path))
    with paths.open(path, "rb") as fh:
        return np.asarray(PIL.Image.open(fh))


def folder_images(path: str, num_images: int, batch_size: int = 64,
                  seed: int = 0) -> Iterator[np.ndarray]:
    """uint8 NHWC batches of `num_images` images of a folder, the seeded random subset of
    `folder_subset`. Raises its ValueError."""
    files = folder_subset(path, num_images, seed)
    for i in range(0, num_images, batch_size):
        batch = [_read_image(f) for f in files[i:i + batch_size]]
        yield np.stack([b[..., None] if b.ndim == 2 else b for b in batch])


def net_images(net_path: str, seeds: Sequence[int], batch_size: int = 64,
               ema: str | None = None, guide_path: str | None = None,
               guide_ema: str | None = None, guidance: float = 1.0, vae: Any = None,
               **gen_kw) -> Iterator[np.ndarray]:
    """uint8 NHWC batches of the images `net_path` generates for `seeds` (guided by
    `guide_path` with weight `guidance`; `nets.load_guide`), decoded to RGB by `vae`
    (an `SDVAE`, for a latent net; `nets.check_vae`); `gen_kw`: the other
    arguments of `seed_images.generate_images` (class_idx, `sampler`, rng)."""
    net, variables, desc = nets.load_net(net_path, ema)
    guide = nets.load_guide(guide_path, guide_ema, guidance)
    print(f"Generating {len(seeds)} images from {desc}")
    for _, imgs in seed_images.generate_images(net, variables, list(seeds), batch_size=batch_size,
                                            guide=guide, guidance=guidance,
                                            vae=vae, **gen_kw):
        yield imgs


class DecodedSource:
    """A latent data `Source` (`LatentFolder`) seen as uint8 RGB images: item `i` is the
    SD VAE's decode of its stored mean (`encode_latents(raw, noise=0)`), with its label;
    the reference images of metrics on a latent data set (reconstructions, not the
    original pixels). Decodes `chunk` items at a time and keeps the last chunk."""

    def __init__(self, source: Any, vae: Any, chunk: int = 64):
        self.source, self.vae, self.chunk = source, vae, int(chunk)
        self.name = f"{getattr(source, 'name', 'latents')} (VAE-decoded)"
        self.label_dim = getattr(source, "label_dim", 0)
        self._cache: tuple[int, np.ndarray, list] | None = None

    def __len__(self) -> int:
        return len(self.source)

    @property
    def num_images(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for {self.name} with {len(self)} items")
        a = i - i % self.chunk
        if self._cache is None or self._cache[0] != a:
            items = [self.source[j] for j in range(a, min(a + self.chunk, len(self)))]
            raw = np.stack([x for x, _ in items]).astype(np.float32)
            x = vae_lib.encode_latents(raw, np.zeros(raw.shape[:-1] + (vae_lib.LATENT_CHANNELS,),
                                                     np.float32))
            self._cache = (a, self.vae.decode(x), [lab for _, lab in items])
        return self._cache[1][i - a], self._cache[2][i - a]


def _random_batches(src: Any, num_images: int, seed: int,
                    batch_size: int) -> Iterator[np.ndarray]:
    """uint8 batches of `num_images` items of `src` drawn without replacement (seeded), in
    index order. Raises ValueError when `src` holds fewer."""
    if len(src) < num_images:
        raise ValueError(f"{src.name} has {len(src)} images, fewer than --num_images={num_images}")
    idx = np.sort(np.random.RandomState(seed).choice(len(src), num_images, replace=False))
    for i in range(0, num_images, batch_size):
        yield np.stack([src[j][0] for j in idx[i:i + batch_size]])


def source_images(data_config: Any, split: str, num_images: int, seed: int = 0,
                  batch_size: int = 64) -> Iterator[np.ndarray]:
    """uint8 batches of `num_images` random images (seeded) of a dataset split.
    Raises ValueError (on the first batch) without `data_config` or when the split holds
    fewer images."""
    if data_config is None:
        raise ValueError("--data_split_images needs --config (its data section)")
    src = data_lib.make_source(dict(data_config, split=split))
    yield from _random_batches(src, num_images, seed, batch_size)


def decoded_source_images(data_config: Any, split: str, num_images: int, vae: Any,
                          batch_size: int) -> Iterator[np.ndarray]:
    """`source_images` (seed 0) of a latent data set, decoded to RGB by `vae`
    (`DecodedSource`). Raises ValueError (on the first batch) when the split holds fewer
    images."""
    src = DecodedSource(data_lib.make_source(dict(data_config, split=split)), vae, batch_size)
    yield from _random_batches(src, num_images, 0, batch_size)
