"""tensorflow-datasets data sets (imagenet2012, cifar10, ...) read by random access.

`tfds.data_source(name, split=..., data_dir=...)` reads a data set prepared in `data_dir` in
the `array_record` file format, one decoded example (a dict with 'image' uint8 [H, W, C] and
'label' int) per index, without TensorFlow. Preparation happens beforehand, once:

    pip install tensorflow-datasets array_record
    tfds build cifar10 --data_dir=DIR --file_format=array_record
    tfds build imagenet2012 --data_dir=DIR --file_format=array_record --manual_dir=DIR_WITH_TARS

Images of another size than `resolution` are fitted on the fly by `transform`; for
ImageNet-64 use the default 'center-crop-dhariwal', the preprocessing of the EDM2 release
(see `base.center_crop_dhariwal`). tensorflow-datasets is imported only when this source
is opened.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from edm2_jax.data.base import NO_LABEL, Source, check_transform, fit_resolution

PIP_HINT = "pip install tensorflow-datasets array_record"


def open_tfds(name: str, *, split: str = "train", data_dir: str = "", use_labels: bool = True,
              resolution: int = 0, transform: str = "center-crop-dhariwal") -> "TFDSSource":
    """`tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)`
    wrapped as a `TFDSSource`. Nothing is downloaded.

    Raises ImportError with the pip command if tensorflow-datasets is missing, ValueError if
    `name` is empty, RuntimeError with the `tfds build` command if the data set is not
    prepared (or cannot be opened) in `data_dir`.
    """
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError(f"data.source='tfds' needs tensorflow-datasets (TensorFlow itself is "
                          f"not needed): `{PIP_HINT}`; or use data.source='fashion_mnist' / "
                          f"'folder'") from e
    if not name:
        raise ValueError("data.source='tfds' needs data.name, e.g. 'imagenet2012' or 'cifar10'")
    try:
        ds = tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
    except Exception as e:
        raise RuntimeError(
            f"cannot open tfds data set {name!r} split {split!r} in data_dir "
            f"{data_dir or '(default ~/tensorflow_datasets)'} ({type(e).__name__}: {e}). Prepare "
            f"it once with `tfds build {name} --data_dir={data_dir or 'DIR'} "
            f"--file_format=array_record` (ImageNet also needs --manual_dir holding the "
            f"ILSVRC2012 tars) and set data.data_dir") from e
    return TFDSSource(ds, name=f"{name}[{split}]", use_labels=use_labels,
                      resolution=resolution, transform=transform)


class TFDSSource(Source):
    """A random-access tfds data source (anything with `__len__`, `__getitem__ -> dict` and
    `dataset_info.features`) as a `Source`.

    Args:
      data_source: e.g. the result of `tfds.data_source(...)`; examples are dicts with an
        'image' (uint8 [H, W, C] or [H, W]) and, when `use_labels`, an int 'label' whose
        feature has `num_classes`.
      name: for logs.
      use_labels: False -> label_dim 0, labels -1.
      resolution: output size; 0 = the data set's own, which must then be fixed and square.
      transform: how other sizes are fitted (`base.TRANSFORMS`).
    Raises ValueError (naming the fix) when the features lack 'image' / 'label', or the
    resolution cannot be determined.
    """

    def __init__(self, data_source: Any, *, name: str, use_labels: bool = True,
                 resolution: int = 0, transform: str = "center-crop-dhariwal"):
        self._ds = data_source
        self.name = name
        self.transform = check_transform(transform)
        features = data_source.dataset_info.features
        keys = list(features.keys())
        if "image" not in keys:
            raise ValueError(f"tfds data set {name} has no 'image' feature (features: {keys}); "
                             f"choose an image data set")
        shape = tuple(features["image"].shape)  # (H, W, C); None where sizes vary
        self.num_channels = int(shape[2]) if len(shape) == 3 and shape[2] else 3
        if not resolution:
            if shape[0] is None or shape[0] != shape[1]:
                raise ValueError(f"images of tfds data set {name} have shape {shape} (not a fixed "
                                 f"square size); set data.resolution, e.g. 64 for ImageNet-64")
            resolution = int(shape[0])
        self.resolution = int(resolution)
        if use_labels:
            if "label" not in keys:
                raise ValueError(f"tfds data set {name} has no 'label' feature (features: {keys}); "
                                 f"set data.use_labels=False")
            self.label_dim = int(features["label"].num_classes)
        else:
            self.label_dim = 0

    def __len__(self) -> int:
        return len(self._ds)

    def _load(self, i: int) -> tuple[np.ndarray, int]:
        """Example `i` -> (uint8 [R, R, C] image, label); ValueError naming the example if
        its image is not uint8 with `num_channels` channels."""
        example = self._ds[i]
        image = np.asarray(example["image"])
        image = image[..., None] if image.ndim == 2 else image
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != self.num_channels:
            raise ValueError(f"example {i} of tfds data set {self.name} has image "
                             f"{image.dtype} {image.shape}, expected uint8 [H, W, "
                             f"{self.num_channels}]")
        image = fit_resolution(image, self.resolution, self.transform,
                               f"example {i} of tfds data set {self.name}")
        return image, (int(example["label"]) if self.label_dim else NO_LABEL)
