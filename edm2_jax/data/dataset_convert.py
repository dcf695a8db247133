"""What the dataset tool writes: `convert` (images), `encode` (latents) and `decode`.

Formats (what the release's `dataset_tool.py` writes and reads, so that either project
reads the other's files; `data.ImageFolder` / `data.LatentFolder` read them here):
  * a `.zip` (stored, uncompressed) or a folder; image `i` at `{i:08d}[:5]/img{i:08d}.png`
    (uncompressed RGB PNG), e.g. `00000/img00000007.png`; latent `i` at
    `{i:08d}[:5]/img-mean-std-{i:08d}.npy`, float32 `[8, H/8, W/8]` CHW (the SD VAE
    encoder's mean of the 4 latent channels, then their std; `vae.SDVAE.encode_pixels`
    of the image's uint8 pixels);
  * `dataset.json` at the root: `{"labels": [[fname, label], ...]}` when every image has
    a label, else `{"labels": null}`.
A `--dest` ending in `.npy` gets this project's raw format instead (`raw_array`: the same
pixels as one uint8 `[N, H, W, C]` array, labels beside it in `NAME.labels.npy`), which
training reads with no decode; `convert` only (latents stay `.npy` files in a zip).

`convert` writes the images of `--source` (`dataset_inputs.open_source`) after
`--transform` (`dataset_inputs.make_transform`); outputs must be square, power-of-two
sized and all the same size. `encode` writes the SD VAE encoder's mean and std of each
image. `decode` (as the release's): each stored latent drawn once, `mean + N(0, 1) * std`
(NumPy `default_rng(seed)`, or the mean alone with `--mean`), scaled as in training,
decoded by the VAE to uint8 RGB and written as `convert` writes PNGs, with the labels.

Errors (`DatasetToolError`) name the file or flag at fault and the fix: a destination
that exists (a file, or a folder that is not empty), an image of another size; a bad VAE file fails in `vae.load_vae`
before anything is written; a `--dest` with a name longer than its file system allows
(`check_dest_names`) before any work. The destination is written under a temporary name and
renamed when complete (`Dest`): after an error it is as it was, and an OSError while
writing (a full disk, a permission) is a `DatasetToolError` naming the path.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import sys
import zipfile

import numpy as np
import PIL.Image
from tqdm import tqdm

from edm2_jax.data.dataset_inputs import (DatasetToolError, make_transform, open_source,
                                         parse_resolution)
from edm2_jax import paths as paths_lib
from edm2_jax.data import raw_array
from edm2_jax.data.latents import LatentFolder
from edm2_jax.encoders import vae as vae_lib


# --------------------------------------------------------------------------- destination

# The longest name written inside a folder `--dest` ('/00000/img-mean-std-00000000.npy').
_INNER = len("/00000/img-mean-std-00000000.npy")


def check_dest_names(dest: str, paths: list[str]) -> None:
    """Refuse (`DatasetToolError`, before any work) `--dest` when one of the `paths`
    written for it (the data set, its temporary names), with the longest name written
    inside it, is longer than its file system allows (`paths.name_problem`): it would
    fail only when the first item is written."""
    for path in paths:
        problem = paths_lib.name_problem(path, margin=_INNER)
        if problem:
            raise DatasetToolError(f"--dest={dest}: {problem} (the temporary name adds "
                                   f"{len('.unfinished')}); give a shorter one")


def _write_error(path: str, e: OSError) -> DatasetToolError:
    return DatasetToolError(f"cannot write {path} ({e.strerror or e}); free disk space or fix "
                            f"its permissions, or give another --dest")

class Dest:
    """A new `.zip` (stored) or an empty folder (an existing file or non-empty folder is
    refused when the `Dest` is made, before the source is read), written under a temporary name
    (`<dest>.unfinished`, created at the first write) and renamed into place by
    `commit` once complete; `abort` deletes it. So `dest` holds a whole data set or
    nothing: a run stopped by a bad image (or killed; the next run deletes what it
    left) never leaves part of one."""

    def __init__(self, dest: str):
        if not dest:
            raise DatasetToolError("--dest must name a .zip or a folder")
        self.dest = os.path.expanduser(dest)
        self.is_zip = self.dest.lower().endswith(".zip")
        if not self.is_zip and os.path.isdir(self.dest) and os.listdir(self.dest):
            raise DatasetToolError(f"--dest={dest} is a folder that is not empty; give a new "
                                   f"or empty folder, or a .zip")
        if os.path.lexists(self.dest) and not os.path.isdir(self.dest):
            raise DatasetToolError(f"--dest={dest} exists; give a new .zip or folder (or "
                                   f"delete {dest} first to replace it)")
        self.tmp = self.dest.rstrip("/") + ".unfinished"
        check_dest_names(dest, [self.dest, self.tmp])
        self._zip = None
        self._started = False

    def _start(self) -> None:
        """Remove what an interrupted run left at the temporary name; create it."""
        try:
            self._create()
        except OSError as e:
            raise _write_error(self.tmp, e) from None

    def _create(self) -> None:
        self._remove_tmp()
        parent = os.path.dirname(os.path.abspath(self.tmp))
        os.makedirs(parent, exist_ok=True)
        if self.is_zip:
            self._zip = zipfile.ZipFile(self.tmp, "w", compression=zipfile.ZIP_STORED)
        else:
            os.makedirs(self.tmp)
        self._started = True

    def _remove_tmp(self) -> None:
        if os.path.isdir(self.tmp) and not os.path.islink(self.tmp):
            shutil.rmtree(self.tmp)
        elif os.path.lexists(self.tmp):
            os.remove(self.tmp)

    def write(self, fname: str, data: bytes | str) -> None:
        if isinstance(data, str):
            data = data.encode("utf8")
        if not self._started:
            self._start()
        try:
            if self.is_zip:
                self._zip.writestr(fname, data)
            else:
                full = os.path.join(self.tmp, fname)
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "wb") as f:
                    f.write(data)
        except OSError as e:
            raise _write_error(f"{self.tmp}:{fname}" if self.is_zip
                               else os.path.join(self.tmp, fname), e) from None

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()
            self._zip = None

    def commit(self) -> None:
        """Close and rename the complete data set into place (an empty `dest` folder is
        replaced); on an OSError, `abort` and a `DatasetToolError` naming the path."""
        try:
            self.close()
            if not self._started:
                return
            if not self.is_zip and os.path.isdir(self.dest):
                os.rmdir(self.dest)  # empty (checked in __init__)
            os.replace(self.tmp, self.dest)
        except OSError as e:
            self.abort()
            raise _write_error(self.dest, e) from None

    def abort(self) -> None:
        """Close and delete the unfinished data set; `dest` is left as it was. (What
        cannot be deleted stays at the temporary name, which the next run deletes.)"""
        try:
            self.close()
        except OSError:
            pass
        if self._started:
            try:
                self._remove_tmp()
            except OSError:
                pass

    def __enter__(self) -> "Dest":
        return self

    def __exit__(self, kind, value, tb) -> None:
        """`commit` when the block completes, `abort` when it raises (the error goes on)."""
        if kind is None:
            self.commit()
        else:
            self.abort()


class _RawDest(raw_array.RawWriter):
    """`raw_array.RawWriter` with `Dest`'s checks: names the file system takes (before any
    work), an OSError while writing a `DatasetToolError` naming the path (and the
    temporary files deleted)."""

    def __init__(self, dest: str):
        super().__init__(dest)
        check_dest_names(dest, [self.dest, self.tmp, self.labels_dest,
                                self.labels_dest + ".unfinished"])

    def add(self, image: np.ndarray, label: int | None) -> None:
        try:
            super().add(image, label)
        except OSError as e:
            raise _write_error(self.tmp, e) from None

    def commit(self) -> None:
        try:
            super().commit()
        except OSError as e:
            self.abort()
            raise _write_error(self.dest, e) from None

    def abort(self) -> None:
        try:
            super().abort()
        except OSError:
            pass


def archive_name(i: int, kind: str = "png") -> str:
    """The release's file name of item `i`: '00000/img00000007.png' or, for latents,
    '00000/img-mean-std-00000007.npy'."""
    s = f"{i:08d}"
    return f"{s[:5]}/img{s}.png" if kind == "png" else f"{s[:5]}/img-mean-std-{s}.npy"


def _dataset_json(labels: list) -> str:
    return json.dumps({"labels": labels if all(x is not None for x in labels) else None})


def _png(img: np.ndarray) -> bytes:
    """uint8 HWC (or HW) `img` as uncompressed PNG bytes, as the release writes them."""
    buf = io.BytesIO()
    PIL.Image.fromarray(img).save(buf, format="png", compress_level=0, optimize=False)
    return buf.getvalue()


def _no_raw(dest: str, why: str) -> None:
    if raw_array.is_raw(dest):
        raise DatasetToolError(f"--dest={dest}: the raw .npy format is for convert; {why}")


def _progress(total: int, quiet: bool):
    return tqdm(total=total, unit="img", disable=quiet, file=sys.stderr)


# ------------------------------------------------------------------------------ commands

def convert(source: str, dest: str, resolution: str | tuple[int, int] | None = None,
            transform: str | None = None, max_images: int | None = None,
            quiet: bool = False, tfds_dir: str = "") -> int:
    """Images -> PNG data set, or the raw format for a `dest` ending in `.npy` (module
    docstring). Returns the number of images written."""
    res = parse_resolution(resolution) if isinstance(resolution, (str, type(None))) else resolution
    tf = make_transform(transform, res)
    raw = raw_array.is_raw(dest)
    # an existing destination is refused before the source is read
    out = _RawDest(dest) if raw else Dest(dest)
    n, entries = open_source(source, max_images, tfds_dir)
    labels, size, idx = [], None, 0
    with out, _progress(n, quiet) as bar:
        for e in entries:
            bar.update(1)
            img = tf(e.img)
            if img is None:
                continue
            h, w = img.shape[:2]
            if size is None:
                if w != h:
                    raise DatasetToolError(f"{e.name}: {w}x{h} after the transform; images "
                                           f"must be square (use --resolution=NxN or a "
                                           f"--transform)")
                if w & (w - 1):
                    raise DatasetToolError(f"{e.name}: {w}x{h}; sides must be a power of "
                                           f"two (use --resolution, e.g. 64x64)")
                size = (h, w)
            elif (h, w) != size:
                raise DatasetToolError(f"{e.name}: {w}x{h}, but earlier images are "
                                       f"{size[1]}x{size[0]}; give --resolution to make "
                                       f"them all one size")
            if raw:
                out.add(img, e.label)
            else:
                fname = archive_name(idx)
                out.write(fname, _png(img))
                labels.append([fname, e.label] if e.label is not None else None)
            idx += 1
        if not raw:
            out.write("dataset.json", _dataset_json(labels))
    return idx


def encode(source: str, dest: str, vae_path: str, batch: int = 8,
           max_images: int | None = None, quiet: bool = False) -> int:
    """Images -> latent data set with the SD VAE of `vae_path` (module docstring), `batch`
    images per VAE call. Returns the number of latents written."""
    if batch < 1:
        raise DatasetToolError(f"--batch={batch}: must be at least 1")
    _no_raw(dest, "encode writes latents: give a .zip or a folder")
    if not vae_path:
        raise DatasetToolError("encode needs --vae=PATH: the SD VAE's diffusers weights "
                               f"(diffusion_pytorch_model.safetensors of {vae_lib.SD_VAE_URL})")
    out = Dest(dest)
    vae = vae_lib.load_vae(vae_path)  # a bad file fails here, before anything is written
    vae = dataclasses.replace(vae, batch_size=batch)
    n, entries = open_source(source, max_images)
    labels, pending, idx = [], [], 0

    def flush():
        nonlocal idx
        imgs = np.stack([e.img for e in pending])
        m = len(imgs)
        if m < batch:  # one compiled shape: pad the last batch with copies
            imgs = np.concatenate([imgs, np.repeat(imgs[-1:], batch - m, axis=0)])
        raw = vae.encode_pixels(imgs)[:m]  # [m, h, w, 8]
        for e, r in zip(pending, raw):
            fname = archive_name(idx, "npy")
            buf = io.BytesIO()
            np.save(buf, np.ascontiguousarray(r.transpose(2, 0, 1), np.float32))
            out.write(fname, buf.getvalue())
            labels.append([fname, e.label] if e.label is not None else None)
            idx += 1
        bar.update(m)
        pending.clear()

    with out, _progress(n, quiet) as bar:
        for e in entries:
            if pending and e.img.shape != pending[0].img.shape:
                raise DatasetToolError(f"{e.name}: {e.img.shape[1]}x{e.img.shape[0]}, but "
                                       f"earlier images are {pending[0].img.shape[1]}x"
                                       f"{pending[0].img.shape[0]}; convert them to one "
                                       f"size first (dataset_tool convert --resolution)")
            if not pending and idx == 0:
                d = vae.config.downsampling
                if e.img.shape[0] % d or e.img.shape[1] % d:
                    raise DatasetToolError(f"{e.name}: {e.img.shape[1]}x{e.img.shape[0]} "
                                           f"pixels; the VAE needs sides that are multiples "
                                           f"of {d} (convert --resolution, e.g. 512x512)")
            pending.append(e)
            if len(pending) == batch:
                flush()
        if pending:
            flush()
        out.write("dataset.json", _dataset_json(labels))
    return idx


def decode(source: str, dest: str, vae_path: str, batch: int = 8,
           max_images: int | None = None, seed: int = 0, mean: bool = False,
           quiet: bool = False) -> int:
    """Latent data set -> PNG data set with the SD VAE of `vae_path` (module docstring).
    Returns the number of images written."""
    if batch < 1:
        raise DatasetToolError(f"--batch={batch}: must be at least 1")
    _no_raw(dest, "decode writes PNGs: give a .zip or a folder (then convert it to .npy)")
    out = Dest(dest)
    vae = dataclasses.replace(vae_lib.load_vae(vae_path), batch_size=batch)
    try:
        lat = LatentFolder(source, use_labels=True)
    except ValueError as e:
        if "label" not in str(e):
            raise
        lat = LatentFolder(source, use_labels=False)
    n = len(lat) if max_images is None else min(len(lat), max_images)
    rng = np.random.default_rng(seed)
    labels = []
    with out, _progress(n, quiet) as bar:
        for a in range(0, n, batch):
            items = [lat[i] for i in range(a, min(a + batch, n))]
            raw = np.stack([x for x, _ in items]).astype(np.float32)
            m = len(raw)
            if m < batch:
                raw = np.concatenate([raw, np.repeat(raw[-1:], batch - m, axis=0)])
            noise = (np.zeros if mean else lambda shape: rng.standard_normal(shape,
                                                                            np.float32))(
                raw.shape[:-1] + (vae_lib.LATENT_CHANNELS,))
            imgs = vae.decode(vae_lib.encode_latents(raw, noise))[:m]
            for i, (img, (_, label)) in enumerate(zip(imgs, items)):
                fname = archive_name(a + i)
                out.write(fname, _png(img))
                labels.append([fname, int(label)] if lat.label_dim else None)
            bar.update(m)
        out.write("dataset.json", _dataset_json(labels))
    return n
