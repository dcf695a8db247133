"""Fashion-MNIST (Xiao et al. 2017) from local IDX files: the offline default data set.

The Debian/Ubuntu package `dataset-fashion-mnist` installs the four gzipped IDX files in
`/usr/share/datasets/fashion-mnist/`. Images are 28x28 grey-scale; they are zero-padded
(pixel value 0, black) by 2 px on every side to 32x32 so that the U-Net can halve the
resolution several times. 10 classes: 0 T-shirt/top, 1 Trouser, 2 Pullover, 3 Dress,
4 Coat, 5 Sandal, 6 Shirt, 7 Sneaker, 8 Bag, 9 Ankle boot.
"""
from __future__ import annotations

import gzip
import os

import numpy as np

from edm2_jax.data.base import NO_LABEL, Source

DEFAULT_PATH = "/usr/share/datasets/fashion-mnist"
INSTALL_HINT = "sudo apt-get install dataset-fashion-mnist"
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
_PREFIX = {"train": "train", "test": "t10k"}
_PAD = 2  # 28 + 2 * 2 = 32


def _find(path: str, fname: str) -> str | None:
    for candidate in (fname + ".gz", fname):
        if os.path.isfile(os.path.join(path, candidate)):
            return os.path.join(path, candidate)
    return None


def _read_idx(fname: str, magic: int, dims: tuple[int, ...]) -> np.ndarray:
    """IDX file (LeCun's MNIST format; gzipped or not) -> uint8 [N, *dims].

    Header: big-endian int32 magic (2049 labels, 2051 images), N, then the `dims`.
    Raises ValueError naming the file if the header or size is wrong.
    """
    opener = gzip.open if fname.endswith(".gz") else open
    try:
        with opener(fname, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise ValueError(f"cannot read {fname} ({e}); reinstall it with "
                         f"`sudo apt-get install --reinstall dataset-fashion-mnist`") from e
    header = np.frombuffer(data[:4 * (2 + len(dims))], ">i4")
    n = int(header[1]) if header.size > 1 else -1
    if (header.size != 2 + len(dims) or header[0] != magic or tuple(header[2:]) != dims
            or len(data) != header.nbytes + n * int(np.prod(dims, dtype=np.int64))):
        raise ValueError(f"{fname} is not an IDX file of uint8 [N, {', '.join(map(str, dims))}] "
                         f"(magic {magic}); reinstall it with "
                         f"`sudo apt-get install --reinstall dataset-fashion-mnist`")
    return np.frombuffer(data, np.uint8, offset=header.nbytes).reshape(n, *dims)


class FashionMNIST(Source):
    """Fashion-MNIST split as a `Source`: uint8 [32, 32, 1] images, labels in [0, 10).

    Args:
      split: 'train' (60,000 images) or 'test' (10,000).
      path: directory holding `{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`;
        '' = /usr/share/datasets/fashion-mnist (config field `data.path`).
      use_labels: False -> label_dim 0 and every label is -1.
    Raises FileNotFoundError (with the apt-get command) if the files are missing,
    ValueError for an unknown split or a corrupt file.
    """

    resolution = 32
    num_channels = 1
    decoded = True  # all images in memory: a batch is one gather

    def __init__(self, split: str = "train", path: str = "", use_labels: bool = True):
        if split not in _PREFIX:
            raise ValueError(f"Fashion-MNIST split must be one of {list(_PREFIX)}, got {split!r} "
                             f"(config field data.split)")
        path = path or DEFAULT_PATH
        names = [f"{_PREFIX[split]}-images-idx3-ubyte", f"{_PREFIX[split]}-labels-idx1-ubyte"]
        found = [_find(path, n) for n in names]
        if None in found:
            missing = [n + ".gz" for n, f in zip(names, found) if f is None]
            raise FileNotFoundError(
                f"Fashion-MNIST files {missing} not found in {path}. Install them with "
                f"`{INSTALL_HINT}` (Debian/Ubuntu), or point data.path (--config.data.path) "
                f"at a directory holding the IDX files from "
                f"https://github.com/zalandoresearch/fashion-mnist.")
        raw = _read_idx(found[0], 2051, (28, 28))
        labels = _read_idx(found[1], 2049, ())
        if len(raw) != len(labels):
            raise ValueError(f"{found[0]} has {len(raw)} images but {found[1]} has "
                             f"{len(labels)} labels; reinstall the package")
        self.images = np.pad(raw, ((0, 0), (_PAD, _PAD), (_PAD, _PAD)))[..., None]  # zeros
        self.labels = labels.astype(np.int64)
        self.label_dim = len(CLASSES) if use_labels else 0
        self.name = f"fashion_mnist[{split}]"
        self.path = path

    def __len__(self) -> int:
        return len(self.images)

    def _load(self, i: int) -> tuple[np.ndarray, int]:
        return self.images[i], (int(self.labels[i]) if self.label_dim else NO_LABEL)

    def read_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(indices, np.int64)
        labels = self.labels[indices] if self.label_dim else np.full(len(indices), NO_LABEL)
        return self.images[indices], labels
