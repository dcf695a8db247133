"""Pixel data sets as one raw uint8 array: nothing to decode, random access, local or gs://.

The format (`dataset_tool convert --dest=NAME.npy` writes it, `RawImages` reads it):
  * `NAME.npy`: a NumPy `.npy` file (format version 1.0), uint8 `[N, H, W, C]` in C order,
    H == W, C in {1, 3, 4}: image `i` is the `H W C` bytes at `offset + i H W C`, so
    `np.load(NAME.npy, mmap_mode='r')[i]` is image `i`;
  * `NAME.labels.npy` beside it: int64 `[N]`, the class of each image; absent when the data
    set is unlabelled (the release's `{"labels": null}`).
The pixels are those of the PNGs `convert` writes from the same source, so a zip of PNGs
converted to this format holds the same images bit for bit, in the same (sorted) order.

Opening reads both headers and the labels and checks them against the files' sizes: a
header that claims more (or less) than its file holds is one ValueError naming the file,
before anything is allocated; so is a label of `image_folder.MAX_LABEL_DIM` or more (the
number of classes sizes the network's label embedding). Images are read when asked: locally from a memory map (a
batch is one gather, `read_batch`); on `gs://` (etils epath, fsspec/gcsfs: the `gcs`
extra) by one ranged read per image, the reads of a batch issued together (fsspec's
`cat_ranges`). The data set is `decoded`: the pipeline gathers its batches in the
training process (`pipeline.py`).
"""
from __future__ import annotations

import io
import math
import os
import struct

import numpy as np

from edm2_jax import paths
from edm2_jax.data.base import NO_LABEL, Source
from edm2_jax.data.image_folder import MAX_LABEL_DIM, MAX_RESOLUTION

LABELS_SUFFIX = ".labels.npy"
_MAGIC = b"\x93NUMPY\x01\x00"  # format version 1.0
_HEAD_BYTES = 65536            # a header's longest (version 1.0: 2-byte length)
_MAX_COUNT = 10**12            # the writer reserves header room for this many images


def is_raw(path: str) -> bool:
    """Whether `path` names a data set in this format (it ends with `.npy`)."""
    return os.fspath(path).lower().endswith(".npy")


def labels_path(path: str) -> str:
    """`NAME.labels.npy` of `NAME.npy`."""
    return os.fspath(path)[:-len(".npy")] + LABELS_SUFFIX


def npy_header(shape: tuple[int, ...], dtype, size: int = 0) -> bytes:
    """The `.npy` (version 1.0) header of a C-order array, padded with spaces to `size`
    bytes (0: the format's own multiple of 64). ValueError if it does not fit in `size`."""
    text = (f"{{'descr': {np.dtype(dtype).str!r}, 'fortran_order': False, "
            f"'shape': {tuple(int(s) for s in shape)!r}, }}")
    need = len(_MAGIC) + 2 + len(text) + 1
    size = size or -(-need // 64) * 64
    if need > size:
        raise ValueError(f"a .npy header of {need} bytes does not fit in {size}")
    body = (text + " " * (size - need) + "\n").encode("latin1")
    return _MAGIC + struct.pack("<H", len(body)) + body


def read_npy_header(head: bytes, where: str) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    """(shape, dtype, fortran_order, data offset) from the first bytes of a `.npy` file
    (NumPy's format: magic, version, header length, a dict literal). ValueError naming
    `where` if it is not one."""
    f = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(f)
        read = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}[version]
        shape, fortran, dtype = read(f, max_header_size=_HEAD_BYTES)
    except Exception as e:  # noqa: BLE001 - NumPy raises several types for a bad header
        raise ValueError(f"{where} is not a readable .npy array ({type(e).__name__}: {e}); "
                         f"re-create it (python -m edm2_jax.data.dataset_tool convert "
                         f"--dest=NAME.npy)") from None
    return tuple(int(s) for s in shape), np.dtype(dtype), bool(fortran), f.tell()


def _head_and_size(path: str) -> tuple[bytes, int]:
    p = paths.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data.path {path} does not exist")
    size = os.path.getsize(path) if not paths.is_url(path) else int(p.stat().length)
    with p.open("rb") as f:
        return f.read(_HEAD_BYTES), size


def _check_size(path: str, shape: tuple[int, ...], dtype: np.dtype, offset: int,
                size: int) -> None:
    need = math.prod(shape) * dtype.itemsize  # exact: a header may claim anything
    if size - offset != need:
        raise ValueError(f"{path}: its header says {dtype} {shape}, {need} bytes after the "
                         f"{offset}-byte header, but the file holds {size - offset}: it is "
                         f"{'truncated' if size - offset < need else 'longer than its header'};"
                         f" re-create it (python -m edm2_jax.data.dataset_tool convert "
                         f"--dest=NAME.npy)")


class RawImages(Source):
    """A `NAME.npy` raw uint8 array (+ `NAME.labels.npy`) as a `Source` (module docstring).

    Args:
      path: the `.npy` file, local or `gs://` (config field `data.path`).
      use_labels: True requires `NAME.labels.npy`; False ignores it (label_dim 0, labels -1).
      resolution: 0 = whatever the images are; otherwise they must be this size.
    Raises FileNotFoundError (missing file), ValueError (not a .npy file, not uint8
    [N, R, R, C], sizes that disagree with the headers, labels that are not int [N] >= 0,
    missing labels, wrong resolution); every message names the file and the fix.
    """

    decoded = True

    def __init__(self, path: str, *, use_labels: bool = True, resolution: int = 0):
        self.path = paths.normalize(path)
        head, size = _head_and_size(self.path)
        shape, dtype, fortran, self.offset = read_npy_header(head, self.path)
        if (len(shape) != 4 or dtype != np.uint8 or fortran or shape[1] != shape[2]
                or shape[3] not in (1, 3, 4) or shape[0] < 1):
            raise ValueError(f"{self.path} holds {dtype} {shape}"
                             f"{' in Fortran order' if fortran else ''}; a raw data set is "
                             f"uint8 [N, R, R, C] (C = 1, 3 or 4) in C order, as dataset_tool "
                             f"convert --dest=NAME.npy writes it")
        if shape[1] > MAX_RESOLUTION:
            raise ValueError(f"{self.path} holds {shape[1]}x{shape[2]} images, larger than "
                             f"the {MAX_RESOLUTION} pixels a side a training image may have")
        _check_size(self.path, shape, dtype, self.offset, size)
        self.shape = shape
        self.resolution, self.num_channels = shape[1], shape[3]
        self.name = os.path.splitext(os.path.basename(self.path))[0]
        if resolution and resolution != self.resolution:
            raise ValueError(f"images in {self.path} are {self.resolution}x{self.resolution}, "
                             f"but data.resolution={resolution}; set data.resolution=0 or "
                             f"re-create the data set at {resolution}x{resolution} "
                             f"(dataset_tool convert --resolution)")
        self.labels = self._read_labels() if use_labels else None
        self.label_dim = int(self.labels.max()) + 1 if use_labels else 0
        self._map = self._fs = None

    def _read_labels(self) -> np.ndarray:
        where = labels_path(self.path)
        if not paths.exists(where):
            raise ValueError(f"data.use_labels=True but {self.path} has no labels beside it "
                             f"({where}); set data.use_labels=False to train unconditionally, "
                             f"or convert a labelled source")
        head, size = _head_and_size(where)
        shape, dtype, fortran, offset = read_npy_header(head, where)
        if shape != (self.shape[0],) or dtype.kind not in "iu" or fortran:
            raise ValueError(f"{where} holds {dtype} {shape}; the labels of {self.path} are "
                             f"int [{self.shape[0]}], one class per image")
        _check_size(where, shape, dtype, offset, size)
        with paths.open(where, "rb") as f:
            f.seek(offset)
            labels = np.frombuffer(f.read(size - offset), dtype).astype(np.int64)
        if labels.min() < 0:
            raise ValueError(f"{where}: label {labels.min()} of image "
                             f"{int(np.argmin(labels))} is negative; labels are classes >= 0")
        if labels.max() >= MAX_LABEL_DIM:  # label_dim sizes the network's label embedding
            raise ValueError(f"{where}: label {labels.max()} of image {int(np.argmax(labels))} "
                             f"is more classes than a network's label embedding takes (indices "
                             f"below {MAX_LABEL_DIM:,}; ImageNet has 1000): number the classes "
                             f"0, 1, 2, ... or set data.use_labels=False")
        return labels

    def __getstate__(self):  # picklable: the memory map and file system are reopened
        return {k: v for k, v in self.__dict__.items() if k not in ("_map", "_fs")}

    def __setstate__(self, state):
        self.__dict__.update(state, _map=None, _fs=None)

    def __len__(self) -> int:
        return self.shape[0]

    def _pixels(self, indices: np.ndarray) -> np.ndarray:
        """uint8 [n, R, R, C] of images `indices` (each in range)."""
        if not paths.is_url(self.path):
            if self._map is None:
                self._map = np.memmap(self.path, np.uint8, "r", offset=self.offset,
                                      shape=self.shape)
            return np.take(self._map, indices, axis=0)
        if self._fs is None:
            import fsspec  # what etils epath reads gs:// with
            self._fs = fsspec.core.url_to_fs(self.path)
        fs, where = self._fs
        item = math.prod(self.shape[1:])
        starts = [self.offset + int(i) * item for i in indices]
        blobs = fs.cat_ranges([where] * len(starts), starts, [s + item for s in starts])
        for i, b in zip(indices, blobs):
            if isinstance(b, Exception) or len(b) != item:
                raise ValueError(f"cannot read image {i} of {self.path} "
                                 f"({b if isinstance(b, Exception) else f'{len(b)} bytes'})")
        return np.frombuffer(b"".join(blobs), np.uint8).reshape((len(starts),) + self.shape[1:])

    def _load(self, i: int) -> tuple[np.ndarray, int]:
        image = self._pixels(np.array([i]))[0]
        return image, (int(self.labels[i]) if self.labels is not None else NO_LABEL)

    def read_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(indices, np.int64)
        labels = (self.labels[indices] if self.labels is not None
                  else np.full(len(indices), NO_LABEL, np.int64))
        return self._pixels(indices), labels


class RawWriter:
    """Writes `dest` (`NAME.npy`) and its labels in this format, image by image (`add`),
    under temporary names (`.unfinished`), renamed into place by `commit` (the labels
    first: an images file in place is a whole data set); `abort` deletes them. As a context
    manager: `commit` when the block completes, `abort` when it raises. Local files only.
    Raises ValueError when `dest` or its labels file exists, or an image's shape differs
    from the first's."""

    def __init__(self, dest: str):
        self.dest = os.path.expanduser(dest)
        self.labels_dest = labels_path(self.dest)
        for p in (self.dest, self.labels_dest):
            if os.path.lexists(p):
                raise ValueError(f"--dest={dest}: {p} exists; give a new name (or delete it "
                                 f"first to replace it)")
        self.count, self.labels, self.item_shape = 0, [], None
        self.tmp, self._f, self._header = self.dest + ".unfinished", None, 0

    def add(self, image: np.ndarray, label: int | None) -> None:
        image = np.ascontiguousarray(image, np.uint8)
        image = image[..., None] if image.ndim == 2 else image
        if self._f is None:
            self.item_shape = image.shape
            os.makedirs(os.path.dirname(os.path.abspath(self.tmp)), exist_ok=True)
            self._f = open(self.tmp, "wb")
            # The final header (written by commit, padded to this length) has room for
            # any count up to a trillion images.
            header = npy_header((_MAX_COUNT,) + image.shape, np.uint8)
            self._header = len(header)
            self._f.write(header)
        elif image.shape != self.item_shape:
            raise ValueError(f"image {self.count} is {image.shape}, but the first is "
                             f"{self.item_shape}; a raw data set holds images of one size")
        self._f.write(image.tobytes())
        self.labels.append(label)
        self.count += 1

    def commit(self) -> None:
        if self._f is None:
            raise ValueError(f"no images to write to {self.dest}")
        self._f.seek(0)
        self._f.write(npy_header((self.count,) + self.item_shape, np.uint8, self._header))
        self._f.truncate(self._header + self.count * math.prod(self.item_shape))
        self._f.close()
        if all(label is not None for label in self.labels):
            with open(self.labels_dest + ".unfinished", "wb") as f:
                labels = np.array(self.labels, np.int64)
                f.write(npy_header(labels.shape, labels.dtype) + labels.tobytes())
            os.replace(self.labels_dest + ".unfinished", self.labels_dest)
        os.replace(self.tmp, self.dest)

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
        for p in (self.tmp, self.labels_dest + ".unfinished"):
            if os.path.lexists(p):
                os.remove(p)

    def __enter__(self) -> "RawWriter":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()
