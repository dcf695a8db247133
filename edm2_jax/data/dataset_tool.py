"""Make training data sets in the EDM2 release's formats: `convert` (images) and `encode` (latents).

    python -m edm2_jax.data.dataset_tool convert --source=DIR|ZIP|fashion_mnist[:test]|tfds:NAME[:SPLIT] \
        --dest=OUT.zip|OUTDIR [--resolution=WxH] \
        [--transform=center-crop|center-crop-dhariwal|center-crop-wide] [--max-images=N]
    python -m edm2_jax.data.dataset_tool encode --source=IMAGES.zip|DIR --dest=LATENTS.zip|DIR \
        --vae=PATH [--batch=N] [--max-images=N]
    python -m edm2_jax.data.dataset_tool decode --source=LATENTS.zip|DIR --dest=IMAGES.zip|DIR \
        --vae=PATH [--batch=N] [--max-images=N] [--seed=S | --mean]

Formats (what the release's `dataset_tool.py` writes and reads, so that either project
reads the other's files; `data.ImageFolder` / `data.LatentFolder` read them here):
  * a `.zip` (stored, uncompressed) or a folder; image `i` at `{i:08d}[:5]/img{i:08d}.png`
    (uncompressed RGB PNG), e.g. `00000/img00000007.png`; latent `i` at
    `{i:08d}[:5]/img-mean-std-{i:08d}.npy`, float32 `[8, H/8, W/8]` CHW (the SD VAE
    encoder's mean of the 4 latent channels, then their std; `vae.SDVAE.encode_pixels`
    of the image's uint8 pixels);
  * `dataset.json` at the root: `{"labels": [[fname, label], ...]}` when every image has
    a label, else `{"labels": null}`.

Sources: a folder searched recursively, or a `.zip`, of images (any extension Pillow
reads; converted to RGB), taken in sorted path order. Labels come from the source's
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
ImageNet crop, square resolutions only): halve with a box filter while the short side is
at least twice the target, resize the short side to the target (bicubic, sizes rounded),
take the central square; `center-crop-wide`: crop the height to `W * h / w`, resize to
WxH, paste into the middle rows of a black WxW canvas (images smaller than that are
skipped). Outputs must be square, power-of-two sized and all the same size.

`decode` (as the release's): each stored latent drawn once, `mean + N(0, 1) * std` (NumPy
`default_rng(seed)`, or the mean alone with `--mean`), scaled as in training, decoded by
the VAE to uint8 RGB and written as `convert` writes PNGs, with the labels.

Errors (`DatasetToolError`, printed as one `error:` line, exit status 1) name the file or
flag at fault and the fix: a missing source, an unreadable image, a bad `--resolution`,
a non-empty destination folder, an image of another size; a bad VAE file fails in
`vae.load_vae` before anything is written.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import re
import sys
import zipfile
from typing import Callable, Iterator

import numpy as np
import PIL.Image

FASHION_MNIST = "fashion_mnist"


class DatasetToolError(ValueError):
    """A bad input or flag; the message names it and the fix."""


@dataclasses.dataclass
class Entry:
    img: np.ndarray  # uint8 [H, W, 3]
    label: int | None
    name: str        # where it came from, for error messages


# ------------------------------------------------------------------------------- sources

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


def _decode(data: bytes | str, name: str) -> np.ndarray:
    try:
        with PIL.Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as im:
            return np.array(im.convert("RGB"))
    except (OSError, ValueError, SyntaxError) as e:
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
    from edm2_jax.data.tfds_source import PIP_HINT
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
                img = np.asarray(ex["image"], np.uint8)
                if img.ndim == 2 or img.shape[-1] == 1:
                    img = np.repeat(img.reshape(img.shape[:2] + (1,)), 3, axis=-1)
                label = ex.get("label") if hasattr(ex, "get") else None
                yield Entry(img, None if label is None else int(label), f"{source}[{i}]")
        return n, tfds_iter()
    if source.split(":")[0] == FASHION_MNIST:
        from edm2_jax.data.fashion_mnist import FashionMNIST
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


def center_crop_dhariwal(img: np.ndarray, size: int) -> np.ndarray:
    """ADM's ImageNet crop (Dhariwal & Nichol 2021): box-filter halvings while the short
    side is >= 2 * size, a bicubic resize of the short side to `size` (both sides scaled
    by the same factor, rounded), then the central `size x size` square."""
    im = PIL.Image.fromarray(img)
    while min(im.size) >= 2 * size:
        im = im.resize(tuple(s // 2 for s in im.size), resample=PIL.Image.Resampling.BOX)
    scale = size / min(im.size)
    im = im.resize(tuple(round(s * scale) for s in im.size),
                   resample=PIL.Image.Resampling.BICUBIC)
    a = np.array(im)
    y, x = (a.shape[0] - size) // 2, (a.shape[1] - size) // 2
    return a[y:y + size, x:x + size]


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


# --------------------------------------------------------------------------- destination

class Dest:
    """A `.zip` (stored) or an empty folder, created at the first write."""

    def __init__(self, dest: str):
        if not dest:
            raise DatasetToolError("--dest must name a .zip or a folder")
        self.dest = os.path.expanduser(dest)
        self.is_zip = self.dest.lower().endswith(".zip")
        if not self.is_zip and os.path.isdir(self.dest) and os.listdir(self.dest):
            raise DatasetToolError(f"--dest={dest} is a folder that is not empty; give a new "
                                   f"or empty folder, or a .zip")
        self._zip = None

    def write(self, fname: str, data: bytes | str) -> None:
        if isinstance(data, str):
            data = data.encode("utf8")
        if self.is_zip:
            if self._zip is None:
                if os.path.dirname(self.dest):
                    os.makedirs(os.path.dirname(self.dest), exist_ok=True)
                self._zip = zipfile.ZipFile(self.dest, "w", compression=zipfile.ZIP_STORED)
            self._zip.writestr(fname, data)
        else:
            full = os.path.join(self.dest, fname)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(data)

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()
            self._zip = None


def archive_name(i: int, kind: str = "png") -> str:
    """The release's file name of item `i`: '00000/img00000007.png' or, for latents,
    '00000/img-mean-std-00000007.npy'."""
    s = f"{i:08d}"
    return f"{s[:5]}/img{s}.png" if kind == "png" else f"{s[:5]}/img-mean-std-{s}.npy"


def _dataset_json(labels: list) -> str:
    return json.dumps({"labels": labels if all(x is not None for x in labels) else None})


def _progress(total: int, quiet: bool):
    from tqdm import tqdm
    return tqdm(total=total, unit="img", disable=quiet, file=sys.stderr)


# ------------------------------------------------------------------------------ commands

def convert(source: str, dest: str, resolution: str | tuple[int, int] | None = None,
            transform: str | None = None, max_images: int | None = None,
            quiet: bool = False, tfds_dir: str = "") -> int:
    """Images -> PNG data set (module docstring). Returns the number of images written."""
    res = parse_resolution(resolution) if isinstance(resolution, (str, type(None))) else resolution
    tf = make_transform(transform, res)
    n, entries = open_source(source, max_images, tfds_dir)
    out = Dest(dest)
    labels, size, idx = [], None, 0
    try:
        with _progress(n, quiet) as bar:
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
                fname = archive_name(idx)
                buf = io.BytesIO()
                PIL.Image.fromarray(img).save(buf, format="png", compress_level=0,
                                              optimize=False)
                out.write(fname, buf.getvalue())
                labels.append([fname, e.label] if e.label is not None else None)
                idx += 1
        out.write("dataset.json", _dataset_json(labels))
    finally:
        out.close()
    return idx


def encode(source: str, dest: str, vae_path: str, batch: int = 8,
           max_images: int | None = None, quiet: bool = False) -> int:
    """Images -> latent data set with the SD VAE of `vae_path` (module docstring), `batch`
    images per VAE call. Returns the number of latents written."""
    from edm2_jax.model import vae as vae_lib
    if batch < 1:
        raise DatasetToolError(f"--batch={batch}: must be at least 1")
    if not vae_path:
        raise DatasetToolError("encode needs --vae=PATH: the SD VAE's diffusers weights "
                               f"(diffusion_pytorch_model.safetensors of {vae_lib.SD_VAE_URL})")
    vae = vae_lib.load_vae(vae_path)  # a bad file fails here, before anything is written
    vae = dataclasses.replace(vae, batch_size=batch)
    n, entries = open_source(source, max_images)
    out = Dest(dest)
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

    try:
        with _progress(n, quiet) as bar:
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
    finally:
        out.close()
    return idx


def decode(source: str, dest: str, vae_path: str, batch: int = 8,
           max_images: int | None = None, seed: int = 0, mean: bool = False,
           quiet: bool = False) -> int:
    """Latent data set -> PNG data set with the SD VAE of `vae_path` (module docstring).
    Returns the number of images written."""
    from edm2_jax.model import vae as vae_lib
    from edm2_jax.data.latents import LatentFolder
    if batch < 1:
        raise DatasetToolError(f"--batch={batch}: must be at least 1")
    vae = dataclasses.replace(vae_lib.load_vae(vae_path), batch_size=batch)
    try:
        lat = LatentFolder(source, use_labels=True)
    except ValueError as e:
        if "label" not in str(e):
            raise
        lat = LatentFolder(source, use_labels=False)
    n = len(lat) if max_images is None else min(len(lat), max_images)
    rng = np.random.default_rng(seed)
    out = Dest(dest)
    labels = []
    try:
        with _progress(n, quiet) as bar:
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
                    buf = io.BytesIO()
                    PIL.Image.fromarray(img).save(buf, format="png", compress_level=0,
                                                  optimize=False)
                    out.write(fname, buf.getvalue())
                    labels.append([fname, int(label)] if lat.label_dim else None)
                bar.update(m)
        out.write("dataset.json", _dataset_json(labels))
    finally:
        out.close()
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edm2_jax.data.dataset_tool",
                                description="Make data sets in the EDM2 release's formats.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="images -> zip/folder of PNGs + dataset.json")
    c.add_argument("--source", required=True,
                   help=f"folder or .zip of images, {FASHION_MNIST}[:test], or tfds:NAME[:SPLIT]")
    c.add_argument("--tfds-dir", default="", help="tfds:...: the prepared data_dir")
    c.add_argument("--dest", required=True, help="output .zip or (empty) folder")
    c.add_argument("--resolution", help="output WxH, e.g. 64x64")
    c.add_argument("--transform",
                   choices=["center-crop", "center-crop-dhariwal", "center-crop-wide"])
    c.add_argument("--max-images", type=int)
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    e = sub.add_parser("encode", help="images -> zip/folder of SD-VAE latents (.npy)")
    e.add_argument("--source", required=True, help="folder or .zip of images")
    e.add_argument("--dest", required=True, help="output .zip or (empty) folder")
    e.add_argument("--vae", required=True, help="SD VAE weights (diffusers file or folder)")
    e.add_argument("--batch", type=int, default=8, help="images per VAE call")
    e.add_argument("--max-images", type=int)
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    d = sub.add_parser("decode", help="latents (.npy) -> zip/folder of PNGs, with the VAE")
    d.add_argument("--source", required=True, help="folder or .zip of latents")
    d.add_argument("--dest", required=True, help="output .zip or (empty) folder")
    d.add_argument("--vae", required=True, help="SD VAE weights (diffusers file or folder)")
    d.add_argument("--batch", type=int, default=8, help="latents per VAE call")
    d.add_argument("--max-images", type=int)
    d.add_argument("--seed", type=int, default=0, help="seed of the mean + N(0,1) * std draw")
    d.add_argument("--mean", action="store_true", help="decode the means (no draw)")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    try:
        if a.command == "convert":
            n = convert(a.source, a.dest, a.resolution, a.transform, a.max_images, a.quiet,
                        a.tfds_dir)
        elif a.command == "encode":
            n = encode(a.source, a.dest, a.vae, a.batch, a.max_images, a.quiet)
        else:
            n = decode(a.source, a.dest, a.vae, a.batch, a.max_images, a.seed, a.mean, a.quiet)
    except (ValueError, FileNotFoundError, ImportError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {n} {'latents' if a.command == 'encode' else 'images'} to {a.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
