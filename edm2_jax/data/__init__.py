"""Training data: sources behind one interface (`base.Source`), the batch pipeline, and
the dataset tool that writes data sets in the EDM2 release's formats.

Layer: above `edm2_jax.encoders`, below the run directory and everything after it.
Modules here may import `edm2_jax.paths`, `edm2_jax.model` and `edm2_jax.encoders` (the
SD-VAE: `vae.check_encoder`, the latent channel counts, and the encoder/decoder of
`dataset_tool encode` / `decode`), never run/, training/ or any later layer.

  base.py            the `Source` base class, `XFlip`, the image-fitting transforms
  fashion_mnist.py, image_folder.py, latents.py, tfds_source.py    the sources
  raw_array.py       pixel data sets as one raw uint8 array (`RawImages`, and its writer)
  pipeline.py        shuffled, sharded, resumable batches (`make_iterator`; grain workers)
  dataset_tool.py    `python -m edm2_jax.data.dataset_tool convert|encode|decode`
  dataset_inputs.py, dataset_convert.py    what the dataset tool reads and writes

    from edm2_jax import configs, data
    cfg = configs.base_config()
    source = data.make_source(cfg.data)   # Fashion-MNIST from the Debian package
    print(data.describe(source))          # fashion_mnist[train]: 60000 images, 32x32x1, 10 classes
    it = data.make_iterator(source, global_batch=cfg.batch_size, seed=cfg.seed,
                            start_nimg=nimg, process_index=jax.process_index(),
                            process_count=jax.process_count(),
                            num_workers=cfg.data.num_workers)
    batch = next(it)  # {'image': f32 [B, H, W, C] in [-1, 1], 'label': f32 one-hot [B, L]}
    it.close()        # stops the loader's worker processes

Sources (`cfg.data.source`):
  'fashion_mnist'  `FashionMNIST`: /usr/share/datasets/fashion-mnist (apt-get install
                   dataset-fashion-mnist) or `data.path`; 28x28 padded to 32x32, 10 classes.
  'tfds'           `TFDSSource` via `tfds.data_source(data.name, split=data.split,
                   data_dir=data.data_dir)`; optional dependency tensorflow-datasets.
  'folder'         `ImageFolder`: directory or zip in the EDM2 release's layout (`data.path`);
                   with `data.encoder='sd-vae'`, `LatentFolder`: the release's pre-encoded
                   SD-VAE latents (`.npy`, dataset_tool.py encode), drawn per step into the
                   network's 4 channels by the pipeline (batch 'image' then holds latents);
                   a `data.path` ending in `.npy`: `RawImages`, the raw uint8 array that
                   `dataset_tool convert --dest=NAME.npy` writes (local or gs://; no decode).
"""
from __future__ import annotations

from typing import Any

from edm2_jax.data.base import (NO_LABEL, Source, XFlip, center_crop, center_crop_dhariwal,
                                check_transform, describe, network_kwargs)
from edm2_jax.data.fashion_mnist import FashionMNIST
from edm2_jax.data.image_folder import ImageFolder
from edm2_jax.data.latents import LatentFolder
from edm2_jax.data.pipeline import (Batches, LoaderWorkerError, StreamOrder, epoch_permutation,
                                    make_iterator)
from edm2_jax.data.raw_array import RawImages, is_raw
from edm2_jax.data.tfds_source import TFDSSource, open_tfds
from edm2_jax.encoders.vae import check_encoder

SOURCES = ("fashion_mnist", "tfds", "folder")


def make_source(data_config: Any) -> Source:
    """Open the source described by `config.data` (an ml_collections.ConfigDict or dict with
    the fields of `configs.base_config().data`: source, path, name, split, data_dir,
    use_labels, num_workers, resolution, transform, xflip, encoder; missing fields take
    defaults).

    Raises ValueError for an unknown source or encoder, latents asked of a source other
    than 'folder', or a resolution the source cannot give, plus the errors of the chosen
    source (missing files, bad images or latents, missing labels, missing
    tensorflow-datasets), each naming the fix.
    """
    get = data_config.get
    kind = get("source", "fashion_mnist")
    encoder = check_encoder(get("encoder", "none") or "none")
    if encoder == "sd-vae" and kind != "folder":
        raise ValueError(f"data.encoder='sd-vae' reads pre-encoded SD-VAE latents from a folder "
                         f"or zip of .npy files (data.source='folder', data.path=...), not "
                         f"data.source={kind!r}; encode the images first (the release's "
                         f"dataset_tool.py encode)")
    use_labels = bool(get("use_labels", True))
    resolution = int(get("resolution", 0) or 0)
    transform = check_transform(get("transform", "center-crop-dhariwal"))
    if kind == "fashion_mnist":
        if resolution not in (0, FashionMNIST.resolution):
            raise ValueError(f"Fashion-MNIST is 32x32 (28x28 padded); data.resolution="
                             f"{resolution} is not available: set it to 0 or 32")
        source = FashionMNIST(split=get("split", "train") or "train", path=get("path", ""),
                              use_labels=use_labels)
    elif kind == "tfds":
        source = open_tfds(get("name", ""), split=get("split", "train") or "train",
                           data_dir=get("data_dir", ""), use_labels=use_labels,
                           resolution=resolution, transform=transform)
    elif kind == "folder" and is_raw(get("path", "") or ""):
        if encoder == "sd-vae":
            raise ValueError(f"data.path={get('path')!r} is a raw array of pixels (.npy); "
                             f"latents are a folder or zip of .npy files (dataset_tool.py "
                             f"encode): set data.encoder='none', or point data.path at those")
        source = RawImages(get("path"), use_labels=use_labels, resolution=resolution)
    elif kind == "folder":
        folder = LatentFolder if encoder == "sd-vae" else ImageFolder
        source = folder(get("path", ""), use_labels=use_labels, resolution=resolution)
    else:
        raise ValueError(f"unknown data.source {kind!r}; valid: {list(SOURCES)}")
    return XFlip(source) if get("xflip", False) else source


__all__ = ["NO_LABEL", "SOURCES", "Batches", "FashionMNIST", "ImageFolder", "LatentFolder",
           "LoaderWorkerError", "RawImages", "Source", "StreamOrder", "TFDSSource", "XFlip",
           "center_crop", "center_crop_dhariwal", "describe", "epoch_permutation", "is_raw",
           "make_iterator", "make_source", "network_kwargs", "open_tfds"]
