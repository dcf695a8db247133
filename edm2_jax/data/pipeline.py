"""Deterministic, resumable, host-sharded batches from a `Source`.

The training data is one infinite stream of images: position `k` (= images consumed
before it, i.e. `nimg`) holds image `perm_e[k mod N]` of epoch `e = k // N`, where
`perm_e = np.random.default_rng((seed, e)).permutation(N)`. Epochs run into each other
(no partial batches, nothing dropped), so the stream depends only on `(seed, N)`.

Global batch `j` of an iterator started at `start_nimg` covers positions
`[start_nimg + j G, start_nimg + (j + 1) G)` for global batch size `G`; process `p` of `P`
takes the contiguous slice `[p G/P, (p + 1) G/P)` of it. Resuming a run from a checkpoint
at `nimg` therefore reproduces exactly the batches the uninterrupted run would have seen.

Loading runs in a pool of `num_workers` threads that fill the next `prefetch` batches while
the current one trains (PIL/zlib decoding and numpy release the GIL).

Latent sources (`source.encoder == 'sd-vae'`) hold the SD VAE's mean and std per image;
each time an image is used, the pipeline draws its latents `mean + N(0, 1) * std` and
applies the release's scale and bias (`vae.encode_latents`), as the release does at the
start of each training step. The N(0, 1) draw of stream position `k` comes from
`np.random.default_rng((seed, k, LATENT_NOISE_STREAM))`, so it is new at every use of an
image (every epoch), the same on resume, and independent of process count and workers.
It is drawn here, on the host and in the loader threads, rather than in the jitted step:
the step stays the pixel-space one, and half the bytes (4 channels, not 8) go to the
devices. The draw costs ~0.3-0.4 ms per 64x64x4 image on one core of a shared 2-core EPYC
(2/3 of it the normals), i.e. ~0.4 s per 2048 images on 2 loader threads, hidden by
prefetching when a step takes longer; raise `data.num_workers` on hosts with more cores.
"""
from __future__ import annotations

import collections
import concurrent.futures
from typing import Iterator

import numpy as np

from edm2_jax.data.base import Source
from edm2_jax.encoders import vae

LATENT_NOISE_STREAM = 0x1A7E  # third SeedSequence word of the latent draws (module doc)


def epoch_permutation(seed: int, epoch: int, num_images: int) -> np.ndarray:
    """Order of the dataset in `epoch`: int64 [num_images]."""
    return np.random.default_rng((seed, epoch)).permutation(num_images)


class StreamOrder:
    """Dataset index of every stream position (see module docstring); caches two epochs."""

    def __init__(self, num_images: int, seed: int):
        self.num_images, self.seed = num_images, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = epoch_permutation(self.seed, epoch, self.num_images)
        return self._perms[epoch]

    def indices(self, first: int, count: int) -> np.ndarray:
        """Dataset indices of stream positions `[first, first + count)`: int64 [count]."""
        pos = np.arange(first, first + count, dtype=np.int64)
        epochs, offsets = np.divmod(pos, self.num_images)
        out = np.empty(count, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[offsets[sel]]
        return out


def latent_noise(seed: int, position: int, shape: tuple[int, ...]) -> np.ndarray:
    """The N(0, 1) draw (float32 `shape`) of the latents at stream `position`."""
    rng = np.random.default_rng((seed, position, LATENT_NOISE_STREAM))
    return rng.standard_normal(shape, dtype=np.float32)


def _fill(source: Source, indices: np.ndarray, image: np.ndarray, label: np.ndarray,
          positions: np.ndarray | None = None, seed: int = 0) -> None:
    """Load `source[i]` for `indices` into `image` float32 [n, H, W, C] (x = u8 / 127.5 - 1;
    for a latent source one draw of its latents at the stream `positions`, module doc)
    and one-hot `label` float32 [n, L] (views into the batch arrays)."""
    shape = image.shape[1:]
    latent = getattr(source, "encoder", "none") == "sd-vae"
    raw_shape = shape[:-1] + (vae.RAW_CHANNELS,)
    u8 = None if latent else np.empty(image.shape, np.uint8)
    for j, i in enumerate(indices):
        img, lab = source[int(i)]
        if latent:
            if img.shape != raw_shape or img.dtype != np.float32:
                raise ValueError(f"{source.name}[{i}] is {img.dtype} {img.shape}, expected "
                                 f"float32 {raw_shape} raw latents; the source breaks the "
                                 f"Source contract")
            image[j] = vae.encode_latents(img, latent_noise(seed, int(positions[j]), shape))
        elif img.shape != shape or img.dtype != np.uint8:
            raise ValueError(f"{source.name}[{i}] is {img.dtype} {img.shape}, expected uint8 "
                             f"{shape}; the source breaks the Source contract")
        else:
            u8[j] = img
        if label.shape[1]:
            if not 0 <= lab < label.shape[1]:
                raise ValueError(f"{source.name}[{i}] has label {lab}, outside [0, "
                                 f"{label.shape[1]}); fix the data set's labels")
            label[j, lab] = 1
    if not latent:
        np.subtract(u8.astype(np.float32) / np.float32(127.5), np.float32(1), out=image)


def make_iterator(source: Source, *, global_batch: int, seed: int, start_nimg: int = 0,
                  process_index: int = 0, process_count: int = 1, num_workers: int = 2,
                  prefetch: int = 2) -> Iterator[dict[str, np.ndarray]]:
    """Infinite iterator of this process's share of each global batch.

    Yields `{'image': float32 [B, H, W, C] in [-1, 1] (uint8 / 127.5 - 1; for a latent
    source the drawn, scaled latents, module doc), 'label': float32 one-hot
    [B, label_dim] ([B, 0] when unlabelled)}` with
    `B = global_batch / process_count`. Fresh arrays every batch. `num_workers=0` loads in
    the calling thread (no prefetch); the batches are identical either way.
    Raises ValueError for a batch not divisible by `process_count`, a bad process index,
    a negative seed or start_nimg, or an empty source; errors of the source (e.g. a corrupt
    file) surface from `next()`. Call `.close()` to stop the worker threads early.
    """
    n = len(source)
    if n == 0:
        raise ValueError(f"data source {source.name} is empty")
    if global_batch <= 0 or global_batch % process_count:
        raise ValueError(f"global batch {global_batch} must be a positive multiple of the "
                         f"number of processes {process_count}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if seed < 0 or start_nimg < 0:
        raise ValueError(f"seed ({seed}) and start_nimg ({start_nimg}) must be >= 0")
    local = global_batch // process_count
    order = StreamOrder(n, seed)
    shape = (local, source.resolution, source.resolution, source.num_channels)

    def batch_at(step: int):
        first = start_nimg + step * global_batch + process_index * local
        return order.indices(first, local), first + np.arange(local, dtype=np.int64), {
            "image": np.empty(shape, np.float32),
            "label": np.zeros((local, source.label_dim), np.float32)}

    return (_serial(source, batch_at, seed) if num_workers == 0 else
            _threaded(source, batch_at, seed, num_workers, max(1, prefetch)))


def _serial(source, batch_at, seed: int):
    step = 0
    while True:
        indices, positions, batch = batch_at(step)
        _fill(source, indices, batch["image"], batch["label"], positions, seed)
        yield batch
        step += 1


def _threaded(source, batch_at, seed: int, num_workers: int, prefetch: int):
    pending = collections.deque()  # (batch, futures) in stream order
    with concurrent.futures.ThreadPoolExecutor(num_workers, "edm2-data") as pool:
        step = 0
        try:
            while True:
                while len(pending) < prefetch:
                    indices, positions, batch = batch_at(step)
                    step += 1
                    # A few chunks per worker keeps the threads busy when decode times vary.
                    bounds = np.linspace(0, len(indices), 4 * num_workers + 1).astype(int)
                    futures = [pool.submit(_fill, source, indices[a:b], batch["image"][a:b],
                                           batch["label"][a:b], positions[a:b], seed)
                               for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
                    pending.append((batch, futures))
                batch, futures = pending.popleft()
                for f in futures:
                    f.result()
                yield batch
        finally:
            for _, futures in pending:
                for f in futures:
                    f.cancel()
