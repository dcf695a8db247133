"""Make training data sets in the EDM2 release's formats: the command line.

    python -m edm2_jax.data.dataset_tool convert --source=DIR|ZIP|fashion_mnist[:test]|tfds:NAME[:SPLIT] \
        --dest=OUT.zip|OUTDIR|OUT.npy [--resolution=WxH] \
        [--transform=center-crop|center-crop-dhariwal|center-crop-wide] [--max-images=N]
    python -m edm2_jax.data.dataset_tool encode --source=IMAGES.zip|DIR --dest=LATENTS.zip|DIR \
        --vae=PATH [--batch=N] [--max-images=N]
    python -m edm2_jax.data.dataset_tool decode --source=LATENTS.zip|DIR --dest=IMAGES.zip|DIR \
        --vae=PATH [--batch=N] [--max-images=N] [--seed=S | --mean]

`--dest=OUT.npy` writes the raw format training reads with no decode (`raw_array`: one
uint8 `[N, H, W, C]` array, labels in `OUT.labels.npy`; the same pixels as the PNGs).
What `--source` and `--transform` accept: `dataset_inputs`; the formats written and what
`convert`, `encode` and `decode` do: `dataset_convert`. Both are re-exported here, so
`dataset_tool.convert(...)` etc. can be called from Python.

Errors (`DatasetToolError`, and the ValueError / OSError / ImportError / RuntimeError of
the readers) are printed as one `error:` line with exit status 1; each names the file or
flag at fault and the fix: a missing source, an unreadable image, an image of more than 8
bits a channel (a 16-bit grey PNG, which RGB would clip), a bad `--resolution`, a
destination that exists (a file, or a folder that is not empty) or whose name is longer
than its file system allows (before any work), a write that fails (a full disk), an
image of another size; a bad VAE file fails in `vae.load_vae` before anything is written.
"""
from __future__ import annotations

import argparse
import sys

from edm2_jax.data.base import center_crop_dhariwal
from edm2_jax.data.dataset_convert import Dest, archive_name, convert, decode, encode
from edm2_jax.data.dataset_inputs import (FASHION_MNIST, DatasetToolError, Entry,
                                          make_transform, open_source, parse_resolution)

__all__ = ["FASHION_MNIST", "DatasetToolError", "Dest", "Entry", "archive_name",
           "center_crop_dhariwal", "convert", "decode", "encode", "main", "make_transform",
           "open_source", "parse_resolution"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edm2_jax.data.dataset_tool",
                                description="Make data sets in the EDM2 release's formats.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="images -> zip/folder of PNGs + dataset.json, or .npy")
    c.add_argument("--source", required=True,
                   help=f"folder or .zip of images, {FASHION_MNIST}[:test], or tfds:NAME[:SPLIT]")
    c.add_argument("--tfds-dir", default="", help="tfds:...: the prepared data_dir")
    c.add_argument("--dest", required=True,
                   help="new output .zip or (empty) folder of PNGs, or .npy (raw uint8 array)")
    c.add_argument("--resolution", help="output WxH, e.g. 64x64")
    c.add_argument("--transform",
                   choices=["center-crop", "center-crop-dhariwal", "center-crop-wide"])
    c.add_argument("--max-images", type=int)
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    e = sub.add_parser("encode", help="images -> zip/folder of SD-VAE latents (.npy)")
    e.add_argument("--source", required=True, help="folder or .zip of images")
    e.add_argument("--dest", required=True, help="new output .zip or (empty) folder")
    e.add_argument("--vae", required=True, help="SD VAE weights (diffusers file or folder)")
    e.add_argument("--batch", type=int, default=8, help="images per VAE call")
    e.add_argument("--max-images", type=int)
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    d = sub.add_parser("decode", help="latents (.npy) -> zip/folder of PNGs, with the VAE")
    d.add_argument("--source", required=True, help="folder or .zip of latents")
    d.add_argument("--dest", required=True, help="new output .zip or (empty) folder")
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
    except (ValueError, OSError, ImportError, RuntimeError) as err:
        print(f"error: {err} (nothing was written to {a.dest})", file=sys.stderr)
        return 1
    print(f"wrote {n} {'latents' if a.command == 'encode' else 'images'} to {a.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
