"""Image datasets in the EDM2 release's layout: a directory or a zip archive of images.

This is what the release's `dataset_tool.py convert` writes: `00000/img00000000.png`, ...
(uncompressed PNGs; any sub-directory structure is accepted) plus an optional
`dataset.json` at the root,

    {"labels": [["00000/img00000000.png", 6], ["00000/img00000001.png", 9], ...]}

mapping each image path ('/'-separated, relative to the root) to an integer class.
As in the release, images are taken in sorted path order and `label_dim` is
max(label) + 1. PNG and JPEG files are read (`.png`, `.jpg`, `.jpeg`, any case); other files
are ignored.

Everything that can be checked without decoding pixels is checked when the source is
opened, before any network is built or memory allocated: every image header is read
(size and mode must agree across the data set and be square, at most `MAX_RESOLUTION` a
side), and with `use_labels=True` every image needs a label, a class index below
`MAX_LABEL_DIM`. Pixel decoding happens when
an image is requested; a truncated or corrupt file raises an error naming it.
"""
from __future__ import annotations

import io
import json
import os
import struct
import threading
import zipfile
import zlib

import numpy as np
import PIL.Image

from edm2_jax.data.base import NO_LABEL, Source

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
# The largest side of a training image: larger ones are refused when the data set is
# opened, before anything is written or compiled (a 30000x30000 PNG would need 107 GiB).
MAX_RESOLUTION = 4096
# The largest class index + 1 a data set may have: the label embedding is a
# [label_dim, 4 x model_channels] weight, so 10**12 classes would make a network of
# trillions of parameters. ImageNet has 1000 classes, ImageNet-21k 21,841.
MAX_LABEL_DIM = 100_000
# PIL mode -> channels of the uint8 array we return (P, 1 and CMYK are converted on decode).
MODE_CHANNELS = {"L": 1, "1": 1, "RGB": 3, "P": 3, "CMYK": 3, "RGBA": 4}
_CONVERT = {"1": "L", "P": "RGB", "CMYK": "RGB"}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_MODES = {(8, 0): "L", (8, 2): "RGB", (8, 3): "P", (8, 6): "RGBA"}  # (bit depth, colour type)


def _png_header(head: bytes) -> tuple[int, int, str] | None:
    """(width, height, PIL mode) from the first 33 bytes of a PNG (signature + IHDR chunk,
    PNG spec 11.2.2), or None when it is not a well-formed 8-bit PNG header; the caller then
    asks PIL, which reports the exact problem."""
    if len(head) < 33 or head[:8] != _PNG_SIGNATURE or head[12:16] != b"IHDR":
        return None
    if zlib.crc32(head[12:29]) != struct.unpack(">I", head[29:33])[0]:
        return None
    width, height, depth, colour = struct.unpack(">IIBB", head[16:26])
    mode = _PNG_MODES.get((depth, colour))
    return None if mode is None else (width, height, mode)


class ImageFolder(Source):
    """A directory or `.zip` of same-sized square images (+ optional dataset.json) as a `Source`.

    Args:
      path: directory or zip archive (config field `data.path`).
      use_labels: True requires a label for every image in `dataset.json`; False ignores
        labels (label_dim 0, every label -1).
      resolution: 0 = whatever the images are; otherwise they must already be this size.
    Raises FileNotFoundError (missing path), ValueError (no images, an unreadable image
    header, sizes or modes that differ, non-square images, wrong resolution, missing or
    malformed labels); every message names the file and the fix.
    """

    EXTENSIONS = IMAGE_EXTENSIONS  # the files this source reads; others are ignored

    def __init__(self, path: str, *, use_labels: bool = True, resolution: int = 0):
        if not path:
            raise ValueError("data.source='folder' needs data.path: a directory or .zip of images "
                             "(as written by the EDM2 release's dataset_tool.py)")
        self.path = os.path.abspath(os.path.expanduser(path))
        self._local = threading.local()
        if os.path.isdir(self.path):
            self._zip_path = None
            all_files = [os.path.relpath(os.path.join(root, f), self.path).replace(os.sep, "/")
                         for root, _dirs, files in os.walk(self.path) for f in files]
        elif os.path.isfile(self.path) and self.path.lower().endswith(".zip"):
            self._zip_path = self.path
            try:
                all_files = [n for n in self._zip().namelist() if not n.endswith("/")]
            except zipfile.BadZipFile as e:
                raise ValueError(f"{self.path} is not a readable zip archive ({e}); "
                                 f"re-create it (e.g. with dataset_tool.py convert)") from e
        elif os.path.exists(self.path):
            raise ValueError(f"data.path {self.path} must be a directory or a .zip archive")
        else:
            raise FileNotFoundError(f"data.path {self.path} does not exist")
        self.fnames = sorted(f for f in all_files if f.lower().endswith(self.EXTENSIONS))
        if not self.fnames:
            raise ValueError(self._nothing_found(all_files))
        self.name = os.path.splitext(os.path.basename(self.path))[0]

        self._check_headers()
        if resolution and resolution != self.resolution:
            raise ValueError(f"images in {self.path} are {self.resolution}x{self.resolution}, "
                             f"but data.resolution={resolution}; set data.resolution=0 (use the "
                             f"images as they are) or re-export the data set at {resolution}x"
                             f"{resolution} (dataset_tool.py --resolution)")
        if use_labels:
            self.labels = self._read_labels("dataset.json" in set(all_files))
            self.label_dim = int(self.labels.max()) + 1
        else:
            self.labels, self.label_dim = None, 0

    def _nothing_found(self, all_files: list[str]) -> str:
        msg = f"no {'/'.join(IMAGE_EXTENSIONS)} images found in {self.path}"
        if any(f.lower().endswith(".npy") for f in all_files):
            msg += ("; it holds .npy latents (dataset_tool.py encode): set "
                    "data.encoder='sd-vae' to train on them")
        return msg

    # --- file access --------------------------------------------------------------------

    def _zip(self) -> zipfile.ZipFile:
        # One handle per thread: a shared ZipFile serialises reads behind a lock.
        zf = getattr(self._local, "zip", None)
        if zf is None:
            zf = self._local.zip = zipfile.ZipFile(self._zip_path)
        return zf

    def _read(self, fname: str, size: int = -1) -> bytes:
        """Bytes of `fname`; only the first `size` if `size >= 0`."""
        if self._zip_path is None:
            with open(os.path.join(self.path, fname), "rb") as f:
                return f.read(size)
        info = self._zip().getinfo(fname)
        if size >= 0 and info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 1:
            # Seek straight to the stored bytes: ZipFile.open costs ~10x more, which matters
            # when the headers of a million images are checked at start-up.
            raw = getattr(self._local, "raw", None)
            if raw is None:
                raw = self._local.raw = open(self._zip_path, "rb")
            raw.seek(info.header_offset)
            local = raw.read(30)
            if len(local) == 30 and local[:4] == b"PK\x03\x04":
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                raw.seek(info.header_offset + 30 + name_len + extra_len)
                return raw.read(min(size, info.file_size))
        with self._zip().open(info) as f:
            return f.read(size)

    def _where(self, fname: str) -> str:
        return f"{self._zip_path}:{fname}" if self._zip_path else os.path.join(self.path, fname)

    def __getstate__(self):  # picklable for multi-process loaders: drop the open handles
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()

    # --- validation when opening ----------------------------------------------------------

    def _header(self, fname: str) -> tuple[int, int, str]:
        """(width, height, PIL mode) of an image without decoding its pixels."""
        try:
            if fname.lower().endswith(".png"):
                header = _png_header(self._read(fname, 33))
                if header is not None:
                    return header
            with PIL.Image.open(io.BytesIO(self._read(fname))) as img:
                return img.size[0], img.size[1], img.mode
        except Exception as e:  # PIL raises many types for bad files
            raise ValueError(f"cannot read image {self._where(fname)} ({type(e).__name__}: {e}); "
                             f"delete or re-export it") from e

    def _check_headers(self) -> None:
        # ~15 us per PNG (read 33 bytes, parse IHDR): ~20 s for ImageNet's 1.28M images.
        headers = [self._header(f) for f in self.fnames]
        w0, h0, mode0 = headers[0]
        first = self._where(self.fnames[0])
        if mode0 not in MODE_CHANNELS:
            raise ValueError(f"image {first} has PIL mode {mode0!r}; supported modes are "
                             f"{sorted(MODE_CHANNELS)} (8-bit grey-scale, RGB or RGBA); "
                             f"convert the data set")
        if w0 != h0:
            raise ValueError(f"image {first} is {w0}x{h0} (WxH); images must be square: "
                             f"re-export with dataset_tool.py --transform=center-crop")
        if w0 > MAX_RESOLUTION:
            raise ValueError(f"image {first} is {w0}x{h0}, larger than the {MAX_RESOLUTION} "
                             f"pixels a side that a training image may have (the release's "
                             f"largest nets train at 512, on latents 64); resize the data set "
                             f"(dataset_tool.py convert --resolution=512x512)")
        for fname, (w, h, mode) in zip(self.fnames, headers):
            if (w, h) != (w0, h0) or MODE_CHANNELS.get(mode) != MODE_CHANNELS[mode0]:
                raise ValueError(
                    f"image {self._where(fname)} is {w}x{h} mode {mode!r}, but {first} is "
                    f"{w0}x{h0} mode {mode0!r}; all images of a data set must have the same size "
                    f"and channels: re-export them (dataset_tool.py --resolution) or remove it")
        self.resolution, self.num_channels = w0, MODE_CHANNELS[mode0]

    def _read_labels(self, has_json: bool) -> np.ndarray:
        fix = ('add dataset.json with {"labels": [["<image path>", <class>], ...]} at the root '
               'of the data set, or set data.use_labels=False to train unconditionally')
        where = self._where("dataset.json")
        if not has_json:
            raise ValueError(f"data.use_labels=True but {self.path} has no dataset.json; {fix}")
        try:
            labels = json.loads(self._read("dataset.json").decode("utf-8"))["labels"]
            table = None if labels is None else {str(name): value for name, value in labels}
        except Exception as e:
            raise ValueError(f"cannot parse {where} ({type(e).__name__}: {e}); {fix}") from e
        if table is None:  # what the release writes when any image lacks a label
            raise ValueError(f'{where} says {{"labels": null}}: {self.path} is unlabelled; '
                             f'set data.use_labels=False to train unconditionally')
        out = np.empty(len(self.fnames), np.int64)
        for k, fname in enumerate(self.fnames):
            if fname not in table:
                raise ValueError(f"{where} has no label for image {self._where(fname)}; add "
                                 f"[\"{fname}\", <class>] to its \"labels\", or set "
                                 f"data.use_labels=False to train unconditionally")
            value = table[fname]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: label of {fname} is {value!r}, expected a class "
                                 f"index >= 0 (vector labels are not supported); {fix}")
            if value >= MAX_LABEL_DIM:
                raise ValueError(f"{where}: label of {fname} is {value}, more classes than a "
                                 f"network's label embedding takes (indices below "
                                 f"{MAX_LABEL_DIM:,}; ImageNet has 1000): number the classes "
                                 f"0, 1, 2, ... or set data.use_labels=False")
            out[k] = value
        return out

    # --- Source -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.fnames)

    def _load(self, i: int) -> tuple[np.ndarray, int]:
        """Decode image `i` -> (uint8 [R, R, C], label). ValueError naming the file if it
        cannot be decoded or does not match the size seen when the data set was opened."""
        fname = self.fnames[i]
        try:
            with PIL.Image.open(io.BytesIO(self._read(fname))) as img:
                img = img.convert(_CONVERT[img.mode]) if img.mode in _CONVERT else img
                image = np.array(img)
        except Exception as e:
            raise ValueError(f"cannot decode image {self._where(fname)} ({type(e).__name__}: "
                             f"{e}); the file is corrupt: delete or re-export it") from e
        image = image.reshape(*image.shape[:2], -1)
        expected = (self.resolution, self.resolution, self.num_channels)
        if image.shape != expected or image.dtype != np.uint8:
            raise ValueError(f"image {self._where(fname)} decodes to {image.dtype} {image.shape}, "
                             f"expected uint8 {expected}; re-export it")
        return image, (int(self.labels[i]) if self.labels is not None else NO_LABEL)
