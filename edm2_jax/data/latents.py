"""Latent datasets in the EDM2 release's layout: a directory or zip of `.npy` raw latents.

This is what the release's `dataset_tool.py encode` writes for img512: one
`00000/img-mean-std-00000000.npy` per image, a float32 array `[8, 64, 64]` (CHW: the SD
VAE encoder's mean of the 4 latent channels, then their std; `vae.RAW_CHANNELS`) of a
512x512 image, plus `dataset.json` at the root,

    {"labels": [["00000/img-mean-std-00000000.npy", 6], ...]}    or    {"labels": null}

(`null` when any image had no label: the data set is then unlabelled). As in the release,
files are taken in sorted path order, any leading unit axes of an array are dropped
(`reshape(-1, H, W)`), and `label_dim` is max(label) + 1.

The source (`LatentFolder`, `data.source='folder'` with `data.encoder='sd-vae'`) returns
the raw latents channels-last, float32 `[R, R, 8]`; the batch pipeline turns them into
the network's 4 channels with one draw `mean + N(0, 1) * std` per image per step and the
release's scale and bias (`vae.encode_latents`, `pipeline.build_batch`). `num_channels` is
therefore 4 (what the network sees) and `raw_channels` 8 (what is stored).

Opening reads every file's `.npy` header (shape and dtype, ~100 bytes, no data), so a
wrong-shaped file, one larger than `MAX_LATENT_RESOLUTION` a side, or one whose header
declares other than the bytes it holds fails before training, naming the file and the
expected shape; a latent holding NaN or infinite values is refused as it is read,
naming the file (not later as a loss that diverged). Headers
and arrays are read by `encoders.safe_arrays` (`npy_header`, `read_npy`: a plain numeric
dtype, exactly the bytes the header names).
"""
from __future__ import annotations

import math
import os

import numpy as np

from edm2_jax.data.base import NO_LABEL
from edm2_jax.data.image_folder import IMAGE_EXTENSIONS, MAX_RESOLUTION, ImageFolder
from edm2_jax.encoders import safe_arrays, vae

_HEADER_BYTES = 4096  # a .npy header is a multiple of 64 bytes, ~128 for these arrays


# The largest side of a latent array: that of the SD VAE's latents (1/8 of the pixels)
# of the largest training image.
MAX_LATENT_RESOLUTION = MAX_RESOLUTION // 8


def _npy_header(head: bytes) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, offset of the data) from the start of a `.npy` file
    (`safe_arrays.npy_header`). Raises ValueError if it is not one of an array of plain
    numbers."""
    shape, dtype, _layout, offset = safe_arrays.npy_header(head)
    return shape, dtype, offset


class LatentFolder(ImageFolder):
    """A directory or `.zip` of `.npy` raw latents (+ optional dataset.json) as a `Source`.

    Args: as `ImageFolder` (path, use_labels, resolution: 0 = the latents' own side,
      else it must equal it, e.g. 64 for img512).
    `source[i]` -> (float32 `[R, R, 8]` raw latents, label). Raises FileNotFoundError
    (missing path), ValueError (no `.npy` files, an unreadable header, an array that is
    not `[8, R, R]` float or differs from the others, wrong resolution, missing or
    malformed labels); every message names the file and the fix.
    """

    EXTENSIONS = (".npy",)
    encoder = "sd-vae"
    raw_channels = vae.RAW_CHANNELS

    def _nothing_found(self, all_files: list[str]) -> str:
        msg = f"no .npy latents found in {self.path}"
        if any(f.lower().endswith(IMAGE_EXTENSIONS) for f in all_files):
            msg += ("; it holds images: encode them into SD-VAE latents first (the release's "
                    "dataset_tool.py encode), or set data.encoder='none' to train on pixels")
        return msg

    def _expected(self, resolution: int | str = "R") -> str:
        return (f"float32 ({self.raw_channels}, {resolution}, {resolution}) (CHW: mean and "
                f"std of the {vae.LATENT_CHANNELS} SD-VAE latent channels, as the release's "
                f"dataset_tool.py encode writes)")

    def _shape(self, fname: str, shape: tuple[int, ...], dtype: np.dtype,
               side: int | None) -> int:
        """The side R of a latent array of `shape` (leading unit axes dropped) after
        checking it; ValueError naming the file and the expected shape otherwise."""
        lead = int(np.prod(shape[:-2])) if len(shape) >= 2 else 0
        ok = (len(shape) >= 3 and lead == self.raw_channels and shape[-1] == shape[-2]
              and (side is None or shape[-1] == side) and dtype.kind == "f")
        if not ok:
            want = self._expected(side if side is not None else "R")
            raise ValueError(f"latent {self._where(fname)} is {dtype} {shape}, expected {want}; "
                             f"re-encode it or remove it")
        if shape[-1] > MAX_LATENT_RESOLUTION:
            raise ValueError(f"latent {self._where(fname)} is {dtype} {shape}: larger than the "
                             f"{MAX_LATENT_RESOLUTION} a side of the latents of a "
                             f"{MAX_RESOLUTION}x{MAX_RESOLUTION} image (img512's are 64); "
                             f"re-encode it or remove it")
        return int(shape[-1])

    def _size(self, fname: str) -> int:
        """The size in bytes of `fname` (from the zip's directory, or the file system)."""
        if self._zip_path is None:
            return os.path.getsize(os.path.join(self.path, fname))
        return self._zip().getinfo(fname).file_size

    def _header(self, fname: str) -> tuple[tuple[int, ...], np.dtype, int]:
        try:
            try:
                return _npy_header(self._read(fname, _HEADER_BYTES))
            except ValueError:  # a header longer than the bytes read, or no .npy at all
                return _npy_header(self._read(fname))
        except Exception as e:  # noqa: BLE001 - NumPy raises several types for bad files
            raise ValueError(f"cannot read {self._where(fname)} as a .npy array "
                             f"({type(e).__name__}: {e}); delete or re-encode it") from e

    def _check_headers(self) -> None:
        side = None
        for fname in self.fnames:
            shape, dtype, offset = self._header(fname)
            side = self._shape(fname, shape, dtype, side)
            declared, size = offset + math.prod(shape) * dtype.itemsize, self._size(fname)
            if declared != size:  # what the header claims is more (or less) than is there
                raise ValueError(f"latent {self._where(fname)}: its header declares {dtype} "
                                 f"{shape} ({declared:,} bytes with the header), but the file "
                                 f"holds {size:,} bytes; re-encode it or remove it")
        self.resolution, self.num_channels = side, vae.LATENT_CHANNELS

    def _load(self, i: int) -> tuple[np.ndarray, int]:
        """Raw latents `i` -> (float32 `[R, R, 8]` channels-last, label). ValueError
        naming the file if it cannot be read or does not have the data set's shape."""
        fname = self.fnames[i]
        try:
            array = safe_arrays.read_npy(self._read(fname))
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"cannot load {self._where(fname)} ({type(e).__name__}: {e}); "
                             f"the file is corrupt: delete or re-encode it") from e
        self._shape(fname, array.shape, array.dtype, self.resolution)
        bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
        if bad:  # a data problem, not one of training: named before it reaches a loss
            raise ValueError(f"latent {self._where(fname)} holds {bad} NaN or infinite values "
                             f"(of {array.size}); re-encode it (dataset_tool.py encode) or "
                             f"remove it")
        array = array.reshape(self.raw_channels, self.resolution, self.resolution)
        latents = np.ascontiguousarray(array.transpose(1, 2, 0), np.float32)
        return latents, (int(self.labels[i]) if self.labels is not None else NO_LABEL)
