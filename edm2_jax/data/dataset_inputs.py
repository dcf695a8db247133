"""What the dataset tool reads: `--source` as a stream of images, and `--transform`.

Sources: a folder searched recursively, or a `.zip`, of images (any extension Pillow
reads; converted to RGB), taken in sorted path order. An image of more than 8 bits a
channel (PIL modes 'I;16', 'I', 'F': 16-bit grey PNGs, float TIFFs) is refused naming it
(`check_mode`), as training's reader refuses it, since converting it to RGB would clip
its values to 255. Labels come from the source's
`dataset.json` when it has labels, else from the top-level subfolder names (sorted, index
= label) when there are at least two; otherwise there are none. `fashion_mnist` (or
`fashion_mnist:test`) reads the offline Fashion-MNIST files (`data.FashionMNIST`: 28x28
grey-scale zero-padded to 32x32), written as RGB with their class labels.
`tfds:NAME[:SPLIT]` (e.g. `tfds:imagenet2012:train`) reads a tensorflow-datasets data set
prepared beforehand in `--tfds-dir` (`tfds.data_source`: array_record files, nothing
downloaded; `pip install tensorflow-datasets array_record`), images at their own sizes
(then `--transform`) with their labels.

Transforms (as the release's): none: resize to `--resolution` with Lanczos when given;
`center-crop`: the central square, resized (Lanczos); `center-crop-dhariwal` (ADM's
ImageNet crop, square resolutions only; `base.center_crop_dhariwal`): halve with a box
filter while the short side is at least twice the target, resize the short side to the
target (bicubic, sizes rounded), take the central square; `center-crop-wide`: crop the
height to `W * h / w`, resize to WxH, paste into the middle rows of a black WxW canvas
(images smaller than that are skipped).

Errors are `DatasetToolError` (a ValueError) naming the file or flag at fault and the fix.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import zipfile
from typing import Callable, Iterator

import numpy as np
import PIL.Image
import PIL.ImageMode

from edm2_jax.data.base import center_crop_dhariwal
from edm2_jax.data.fashion_mnist import FashionMNIST
from edm2_jax.data.image_folder import MODE_CHANNELS as TRAINING_MODES
from edm2_jax.data.tfds_source import PIP_HINT

FASHION_MNIST = "fashion_mnist"


class DatasetToolError(ValueError):
    """A bad input or flag; the message names it and the fix."""


@dataclasses.dataclass
class Entry:
    """One image read from `--source`."""

    img: np.ndarray  # uint8 [H, W, 3]
    label: int | None
    name: str        # where it came from, for error messages


def parse_resolution(s: str | None) -> tuple[int, int] | None:
    """'512x512' or '512,512' -> (width, height); None -> None."""
    if s is None or s == "":
        return None
    m = re.fullmatch(r"(\d+)[x,](\d+)", s.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise DatasetToolError(f"--resolution={s}: expected WxH with positive integers, "
                               f"e.g. --resolution=64x64")
    return int(m.group(1)), int(m.group(2))


def _is_image(fname: str) -> bool:
    PIL.Image.init()
    return os.path.splitext(fname)[1].lower() in PIL.Image.EXTENSION


def check_mode(mode: str, name: str) -> None:
    """Refuse an image whose PIL `mode` has more than 8 bits a channel ('I;16', 'I', 'F'):
    `convert("RGB")` would clip its values to 255 and write wrong pixels. Taken: the modes
    training's reader takes (`image_folder`'s, shared), and the other 8-bit modes ('LA',
    'YCbCr', 'RGBX', ...), which convert to RGB as they are."""
    if mode in TRAINING_MODES:
        return
    try:
        eight_bit = PIL.ImageMode.getmode(mode).typestr == "|u1"
    except KeyError:
        eight_bit = False
    if not eight_bit:
        raise DatasetToolError(
            f"image {name} has PIL mode {mode!r} (not 8 bits a channel), whose values "
            f"converting to RGB would clip to 0..255; supported modes are "
            f"{sorted(TRAINING_MODES)} and other 8-bit ones: convert the images to 8-bit "
            f"first (e.g. 16-bit: (x >> 8).astype(np.uint8); ImageMagick: -depth 8)")


def _decode(data: bytes | str, name: str) -> np.ndarray:
    try:
        with PIL.Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as im:
            check_mode(im.mode, name)
            return np.array(im.convert("RGB"))
    except (OSError, ValueError, SyntaxError, PIL.Image.DecompressionBombError) as e:
        if isinstance(e, DatasetToolError):
            raise
        raise DatasetToolError(f"cannot read image {name} ({e}); remove or replace it") from None


def _labels_from_json(text: bytes | str, where: str) -> dict[str, int]:
    try:
        data = json.loads(text)["labels"]
    except (ValueError, KeyError, TypeError) as e:
        raise DatasetToolError(f"{where}: not a dataset.json with a 'labels' field ({e}); fix "
                               f"or remove it (labels then come from subfolder names)") from None
    if data is None:
        return {}
    try:
        return {str(f): int(l) for f, l in data}
    except (ValueError, TypeError) as e:
        raise DatasetToolError(f"{where}: 'labels' must be [[fname, int], ...] or null "
                               f"({e})") from None


def _labels_from_folders(fnames: list[str]) -> dict[str, int]:
    top = {f: f.split("/")[0] if "/" in f else "" for f in fnames}
    index = {name: i for i, name in enumerate(sorted(set(top.values())))}
    return {f: index[t] for f, t in top.items()} if len(index) > 1 else {}


def _tfds_data_source(name: str, split: str, data_dir: str):
    """`tfds.data_source(name, split, data_dir)`, prepared beforehand (array_record);
    nothing is downloaded. Errors name the pip or `tfds build` command."""
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise DatasetToolError(f"--source=tfds:... needs tensorflow-datasets (not TensorFlow): "
                               f"`{PIP_HINT}`") from None
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
    except Exception as e:  # tfds raises many kinds for a data set that is not prepared
        raise DatasetToolError(f"cannot open tfds data set {name!r} split {split!r} in "
                               f"--tfds-dir={data_dir or '(default)'} ({e}); prepare it once: "
                               f"`tfds build {name} --data_dir=DIR --file_format=array_record`"
                               ) from None


def open_source(source: str, max_images: int | None = None,
                tfds_dir: str = "") -> tuple[int, Iterator[Entry]]:
    """(number of images, iterator of `Entry`) for `--source` (module docstring)."""
    if source.startswith("tfds:"):
        parts = source.split(":")
        if len(parts) not in (2, 3) or not parts[1]:
            raise DatasetToolError(f"--source={source}: expected tfds:NAME or tfds:NAME:SPLIT, "
                                   f"e.g. tfds:imagenet2012:train")
        ds = _tfds_data_source(parts[1], parts[2] if len(parts) == 3 else "train", tfds_dir)
        n = len(ds) if max_images is None else min(len(ds), max_images)

        def tfds_iter():
            for i in range(n):
                ex = ds[i]
                img = np.asarray(ex["image"])
                if img.dtype != np.uint8:  # a cast would wrap 16-bit values around
                    raise DatasetToolError(
                        f"{source}[{i}]: a {img.dtype} image, not 8-bit (uint8); convert "
                        f"the data set's images to 8-bit first")
                if img.ndim == 2 or img.shape[-1] == 1:
                    img = np.repeat(img.reshape(img.shape[:2] + (1,)), 3, axis=-1)
                label = ex.get("label") if hasattr(ex, "get") else None
                yield Entry(img, None if label is None else int(label), f"{source}[{i}]")
        return n, tfds_iter()
    if source.split(":")[0] == FASHION_MNIST:
        split = source.split(":", 1)[1] if ":" in source else "train"
        fm = FashionMNIST(split)
        n = len(fm) if max_images is None else min(len(fm), max_images)

        def fm_iter():
            for i in range(n):
                img, label = fm[i]
                yield Entry(np.repeat(img, 3, axis=-1), int(label), f"{fm.name}[{i}]")
        return n, fm_iter()

    path = os.path.expanduser(source)
    if os.path.isdir(path):
        fnames = sorted(os.path.relpath(os.path.join(root, f), path).replace(os.sep, "/")
                        for root, _dirs, files in os.walk(path) for f in files)
        meta = os.path.join(path, "dataset.json")
        labels = (_labels_from_json(open(meta, "rb").read(), meta)
                  if os.path.isfile(meta) else {})

        def read(f):
            return _decode(os.path.join(path, f), os.path.join(path, f))
        opener = None
    elif os.path.isfile(path):
        if not path.lower().endswith(".zip"):
            raise DatasetToolError(f"--source={source}: a file source must be a .zip archive "
                                   f"(or give a folder of images, or '{FASHION_MNIST}')")
        try:
            with zipfile.ZipFile(path) as z:
                fnames = sorted(n for n in z.namelist() if not n.endswith("/"))
                labels = (_labels_from_json(z.read("dataset.json"), f"{path}:dataset.json")
                          if "dataset.json" in fnames else {})
        except zipfile.BadZipFile as e:
            raise DatasetToolError(f"--source={source} is not a readable zip ({e})") from None
        opener = path
        read = None
    else:
        raise DatasetToolError(f"--source={source} does not exist (give a folder of images, "
                               f"a .zip, or '{FASHION_MNIST}')")
    fnames = [f for f in fnames if _is_image(f)]
    if not fnames:
        raise DatasetToolError(f"no images found in --source={source} (extensions Pillow "
                               f"reads: .png, .jpg, ...)")
    labels = labels or _labels_from_folders(fnames)
    n = len(fnames) if max_images is None else min(len(fnames), max_images)

    def it():
        z = zipfile.ZipFile(opener) if opener else None
        try:
            for f in fnames[:n]:
                img = _decode(z.read(f), f"{opener}:{f}") if z else read(f)
                yield Entry(img, labels.get(f), f)
        finally:
            if z:
                z.close()
    return n, it()


# ---------------------------------------------------------------------------- transforms

def _lanczos(img: np.ndarray, width: int, height: int) -> np.ndarray:
    return np.array(PIL.Image.fromarray(img, "RGB").resize((width, height),
                                                           PIL.Image.Resampling.LANCZOS))


def make_transform(transform: str | None, resolution: tuple[int, int] | None
                   ) -> Callable[[np.ndarray], np.ndarray | None]:
    """The `--transform` at `--resolution` as `uint8 HWC -> uint8 HWC` (None: skip the
    image, as center-crop-wide does for images too small)."""
    if transform is None:
        if resolution is None:
            return lambda img: img
        w, h = resolution
        return lambda img: img if img.shape[:2] == (h, w) else _lanczos(img, w, h)
    if resolution is None:
        raise DatasetToolError(f"--transform={transform} needs --resolution=WxH")
    w, h = resolution
    if transform == "center-crop":
        def crop(img):
            c = min(img.shape[:2])
            y, x = (img.shape[0] - c) // 2, (img.shape[1] - c) // 2
            return _lanczos(img[y:y + c, x:x + c], w, h)
        return crop
    if transform == "center-crop-wide":
        def wide(img):
            ch = int(np.round(w * img.shape[0] / img.shape[1]))
            if img.shape[1] < w or ch < h:
                return None
            img = _lanczos(img[(img.shape[0] - ch) // 2:(img.shape[0] + ch) // 2], w, h)
            canvas = np.zeros([w, w, 3], np.uint8)
            canvas[(w - h) // 2:(w + h) // 2] = img
            return canvas
        return wide
    if transform == "center-crop-dhariwal":
        if w != h:
            raise DatasetToolError(f"--transform=center-crop-dhariwal needs a square "
                                   f"--resolution, got {w}x{h}")
        return lambda img: center_crop_dhariwal(img, w)
    raise DatasetToolError(f"--transform={transform}: valid are center-crop, "
                           f"center-crop-dhariwal, center-crop-wide")
