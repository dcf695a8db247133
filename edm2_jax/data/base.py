"""What every training-data source provides, and the image fitting shared by sources.

A *source* is a random-access sequence of labelled images (the same contract as a
`torch.utils.data.Dataset` of the release, or grain's `RandomAccessDataSource`):

    len(source)                -> number of images N
    source[i]                  -> (image uint8 [H, W, C] with H == W == resolution, label int)
    source.resolution          -> H (== W), pixels
    source.num_channels        -> C
    source.label_dim           -> number of classes L; 0 = unconditional (labels are then -1)
    source.num_images          -> N
    source.name                -> short human-readable name for logs
    source.encoder             -> optional: 'none' (default, pixels) or 'sd-vae' (latents)
    source.read_batch(indices) -> optional: (items stacked [n, ...], int64 labels [n]) in one
                                  gather (`Source.read_batch`; the default reads item by item)
    source.decoded             -> optional: True when items are stored as arrays (in memory or
                                  a raw array file), so that a batch is a gather with no decode

A latent source (`encoder == 'sd-vae'`, `latents.LatentFolder`) returns float32 raw
latents `[R, R, 8]` instead of uint8 pixels; its `num_channels` is the 4 channels the
network sees (`vae.encode_latents`, drawn by the batch pipeline).

Sources validate what they can when they are opened (file lists, image sizes, labels)
so that a bad dataset fails before the first training step; per-image decoding errors
are raised lazily but always name the offending file.
"""
from __future__ import annotations

import abc

import numpy as np
import PIL.Image

NO_LABEL = -1  # label returned by sources opened with use_labels=False (label_dim == 0)
TRANSFORMS = ("center-crop-dhariwal", "center-crop", "none")


class Source(abc.ABC):
    """Random-access labelled images; see the module docstring for the contract.

    A subclass sets `name`, `resolution`, `num_channels` and `label_dim` (attributes or
    properties) and implements `__len__` and `_load(i)`, which is called only with
    `0 <= i < len(self)`. `source[i]` outside that range raises IndexError naming the
    source and its size.
    """

    name: str
    resolution: int       # H == W, pixels (latent sources: latent pixels)
    num_channels: int     # C the network sees
    label_dim: int        # number of classes L; 0 = unconditional
    encoder: str = "none"  # 'none' (pixels) or 'sd-vae' (raw latents, `latents.LatentFolder`)
    # Items stored as arrays (Fashion-MNIST in memory, `raw_array.RawImages`): a batch is one
    # gather, which the pipeline does in the training process rather than in workers.
    decoded: bool = False

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def _load(self, i: int) -> tuple[np.ndarray, int]:
        """Item `i` (already range-checked) -> (image, label)."""

    @property
    def num_images(self) -> int:
        return len(self)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for {self.name} with {len(self)} images")
        return self._load(i)

    def read_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Items `indices` (int64 [n], each in range) stacked: (items [n, ...] as `self[i]`
        gives them, int64 labels [n]). Sources whose items are arrays override it with one
        gather; this default reads item by item (and serves any object with `__getitem__`
        and `name`, called as `Source.read_batch(obj, indices)`). ValueError naming the item
        whose shape or dtype differs from the first's."""
        items = [self[int(i)] for i in indices]
        first = np.asarray(items[0][0])
        for i, (x, _) in zip(indices, items):
            if np.shape(x) != first.shape or np.asarray(x).dtype != first.dtype:
                raise ValueError(f"{self.name}[{i}] is {np.asarray(x).dtype} {np.shape(x)}, but "
                                 f"{self.name}[{indices[0]}] is {first.dtype} {first.shape}; the "
                                 f"source breaks the Source contract")
        return (np.stack([x for x, _ in items]),
                np.array([int(label) for _, label in items], np.int64))


def describe(source: Source) -> str:
    """One line for logs, e.g. 'fashion_mnist[train]: 60000 images, 32x32x1, 10 classes'."""
    classes = f"{source.label_dim} classes" if source.label_dim else "unlabelled"
    return (f"{source.name}: {len(source)} images, {source.resolution}x{source.resolution}"
            f"x{source.num_channels}, {classes}")


def network_kwargs(source: Source) -> dict:
    """The `networks.Precond` keyword arguments dictated by the data:
    `{'img_resolution', 'img_channels', 'label_dim'}`."""
    return dict(img_resolution=int(source.resolution), img_channels=int(source.num_channels),
                label_dim=int(source.label_dim))


class XFlip(Source):
    """Doubles a source with mirrored copies, as the release's `--xflip`: index `i < N` is
    `source[i]`, index `N + i` is `source[i]` flipped left-right. Off by default."""

    def __init__(self, source: Source):
        self.source = source
        self.name = f"{source.name}+xflip"
        self.resolution, self.num_channels = source.resolution, source.num_channels
        self.label_dim = source.label_dim
        self.encoder = getattr(source, "encoder", "none")
        self.decoded = getattr(source, "decoded", False)

    def __len__(self) -> int:
        return 2 * len(self.source)

    def _load(self, i: int) -> tuple[np.ndarray, int]:
        n = len(self.source)
        image, label = self.source[i % n]
        return (image[:, ::-1] if i >= n else image), label

    def read_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(indices, np.int64)
        n = len(self.source)
        read = getattr(self.source, "read_batch", None) or (
            lambda idx: Source.read_batch(self.source, idx))
        images, labels = read(indices % n)
        flip = indices >= n
        images[flip] = images[flip][:, :, ::-1]
        return images, labels


def _to_pil(image: np.ndarray) -> PIL.Image.Image:
    return PIL.Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)


def _from_pil(pil: PIL.Image.Image) -> np.ndarray:
    arr = np.asarray(pil)
    return arr[..., None] if arr.ndim == 2 else arr


def center_crop_dhariwal(image: np.ndarray, resolution: int) -> np.ndarray:
    """ImageNet preprocessing of ADM (Dhariwal & Nichol 2021), which the EDM2 release uses for
    ImageNet-64 (`dataset_tool.py --transform=center-crop-dhariwal --resolution=64x64`).

    Halve both sides with a 2x2 box filter while the short side is at least 2 * resolution,
    bicubic-resize so that the short side equals `resolution` (long side rounded), then take
    the central `resolution x resolution` crop (offsets floor((size - resolution) / 2)).
    uint8 [H, W, C] -> uint8 [resolution, resolution, C].
    """
    pil = _to_pil(image)
    while min(pil.size) >= 2 * resolution:
        pil = pil.resize((pil.size[0] // 2, pil.size[1] // 2), PIL.Image.Resampling.BOX)
    scale = resolution / min(pil.size)
    pil = pil.resize(tuple(round(s * scale) for s in pil.size), PIL.Image.Resampling.BICUBIC)
    arr = _from_pil(pil)
    top, left = (arr.shape[0] - resolution) // 2, (arr.shape[1] - resolution) // 2
    return arr[top:top + resolution, left:left + resolution]


def center_crop(image: np.ndarray, resolution: int) -> np.ndarray:
    """The release's `--transform=center-crop`: the central square of side min(H, W)
    (offsets floor((size - side) / 2)), resized to `resolution` with a Lanczos filter.
    uint8 [H, W, C] -> uint8 [resolution, resolution, C]."""
    side = min(image.shape[:2])
    top, left = (image.shape[0] - side) // 2, (image.shape[1] - side) // 2
    square = image[top:top + side, left:left + side]
    if side == resolution:
        return square
    return _from_pil(_to_pil(square).resize((resolution, resolution),
                                            PIL.Image.Resampling.LANCZOS))


def fit_resolution(image: np.ndarray, resolution: int, transform: str, what: str) -> np.ndarray:
    """Bring uint8 [H, W, C] to [resolution, resolution, C] with `transform` (one of
    TRANSFORMS); `what` names the image in errors. Images already at the resolution are
    returned unchanged. Raises ValueError for transform 'none' on a size mismatch."""
    if image.shape[:2] == (resolution, resolution):
        return image
    if transform == "center-crop-dhariwal":
        return center_crop_dhariwal(image, resolution)
    if transform == "center-crop":
        return center_crop(image, resolution)
    raise ValueError(f"{what} is {image.shape[0]}x{image.shape[1]}, not {resolution}x{resolution}, "
                     f"and data.transform='none'; set data.transform to 'center-crop-dhariwal' "
                     f"or 'center-crop', or data.resolution=0 to keep the native size")


def check_transform(transform: str) -> str:
    if transform not in TRANSFORMS:
        raise ValueError(f"unknown data.transform {transform!r}; valid: {list(TRANSFORMS)}")
    return transform
