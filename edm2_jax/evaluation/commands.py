"""The bodies of `--mode=eval` (metrics of an image folder, a data set split or a network,
generating on the fly) and `--mode=ref` (reference statistics in the release's format).

    # FID (Inception-v3, the release's protocol) of 50k images of a net vs reference stats:
    python -m edm2_jax.main --mode=eval --net=nets/img64-s --ref=img64.pkl --num_images=50000
    # Small-data metrics in a project-trained classifier's features (Fashion-MNIST):
    python -m edm2_jax.main --mode=eval --net=runs/fmnist --metrics=cls,fid --num_images=2000 \
        --config=configs/fashion_mnist.py
    # An image folder instead of a network:
    python -m edm2_jax.main --mode=eval --images=out/ --ref=img64.pkl
    # FD_DINOv2 (and FID) against the release's img512 statistics:
    python -m edm2_jax.main --mode=eval --images=out/ --metrics=fid,fd_dinov2 \
        --ref=img512.pkl --dinov2=dinov2_vitl14_pretrain.pth
    # Reference statistics of a dataset in the release's .pkl format (both metrics):
    python -m edm2_jax.main --mode=ref --images=imagenet512/ --ref=img512.pkl \
        --metrics=fid,fd_dinov2 --dinov2=dinov2_vitl14_pretrain.pth
    # Autoguidance, the seeds of the release's FID protocol:
    python -m edm2_jax.main --mode=eval --net=nets/img64-s --guide=nets/img64-xs \
        --guidance=1.4 --seeds=0-49999 --ref=img64.pkl
    # An image folder instead of a network (a random subset of 50000 when it holds more,
    # the same files as the release's `calculate_metrics.py --seed=0` picks):
    python -m edm2_jax.main --mode=eval --images=out/ --ref=img64.pkl --subset_seed=0

The metric names and what they measure: `evaluation.metrics`.

Latent (img512) networks: their samples are decoded to RGB by the SD VAE (`--vae=PATH`;
`generate.check_vae`: a latent net without it fails before anything heavy, naming
`--vae`) and measured as uint8 RGB. Reference data from a latent data set (no `--ref`)
are the VAE's decodes of each stored latent's mean (`images.DecodedSource`):
reconstructions, not the original pixels; for the paper's figures give `--ref`
(statistics of the real images, `--mode=ref --images=...`).
"""
from __future__ import annotations

import json
import time
from typing import Any, Sequence

from edm2_jax import data as data_lib
from edm2_jax import paths
from edm2_jax.evaluation import dinov2 as dinov2_lib
from edm2_jax.evaluation import fid
from edm2_jax.evaluation import images
from edm2_jax.evaluation import metrics as metrics_lib
from edm2_jax.model import vae as vae_lib
from edm2_jax.sampling import generate


def _is_latent_data(data_config: Any) -> bool:
    return bool(data_config) and str(dict(data_config).get("encoder") or "none") == "sd-vae"


def _vae_for_data(vae_path: str | None, data_config: Any) -> Any:
    """Without a `--net`: the VAE that decodes latent reference / split data, or None.
    Raises ValueError for `--vae` with pixel data (nothing to decode)."""
    if not vae_path:
        return None
    if not _is_latent_data(data_config):
        raise ValueError(f"--vae={vae_path} decodes a latent net's samples or latent data, "
                         f"but there is neither here (no --net, and the --config data are "
                         f"pixels); drop --vae")
    return vae_lib.load_vae(vae_path)


def _append_result(out_json: str, line: str) -> None:
    if paths.is_url(out_json):  # object storage cannot append: rewrite the object
        before = paths.read_text(out_json) if paths.exists(out_json) else ""
        paths.write_text_atomic(out_json, before + line)
    else:
        with open(out_json, "a") as f:
            f.write(line)


def main_eval(*, images_dir: str | None, net_path: str | None, num_images: int | None,
              metrics: str, ref: str | None, data_config: Any, ema: str | None = None,
              batch_size: int = 64, num_steps: int = 32, out_json: str | None = None,
              ref_split: str = "test", data_split_images: str | None = None,
              classifier_config: Any = None, seeds: str | Sequence[int] | None = None,
              subset_seed: int = 0, dinov2: str | None = None, vae_path: str | None = None,
              **gen_kw) -> dict:
    """CLI body of `--mode=eval` (see module doc). Prints and returns the results.

    `seeds` (`'0-49999'` or ints; default `0 .. num_images - 1`) are the seeds a `--net`
    generates; `num_images` None means `len(seeds)`. `subset_seed` picks the random
    subset of an `--images` folder (`images.folder_subset`). `vae_path`: `--vae`, the SD
    VAE that decodes a latent net's samples (checked first, `generate.check_vae`) and
    latent reference data. `gen_kw`: `images.net_images`'s (guide_path, guide_ema,
    guidance, class_idx, sampler settings). With `out_json`, appends the results as one
    JSON line. Raises ValueError when `seeds` and `num_images` disagree, for a latent net
    without `--vae` or a pixel-space net with one."""
    names = [m.strip() for m in metrics.split(",") if m.strip()]
    if net_path:  # before anything heavy: a latent net needs --vae, an RGB net refuses it
        vae = generate.check_vae(net_path, vae_path, gen_kw.get("guide_path"))
    else:
        vae = _vae_for_data(vae_path, data_config)
    if seeds is not None:
        seeds = generate.parse_seeds(seeds) if isinstance(seeds, str) else list(seeds)
        if not net_path:
            raise ValueError("--seeds chooses the seeds a --net generates; for --images the "
                             "random subset is chosen by --subset_seed")
        num_images = len(seeds) if num_images is None else num_images
        if len(seeds) != num_images:
            raise ValueError(f"--seeds gives {len(seeds)} seeds but --num_images={num_images}; "
                             f"give one of them, or make them agree")
    num_images = 50000 if num_images is None else num_images
    if num_images < 2:
        raise ValueError(f"--num_images={num_images}: the metrics need at least 2 images "
                         f"(FID-50k: --num_images=50000)")
    for metric in (m for m in metrics_lib.FD_METRICS if m in names):
        # A bad file fails now, not after generating the images.
        if ref:
            fid.load_ref_stats(ref, metric)
        if metric == "fd_dinov2":
            dinov2_lib.load_dinov2(dinov2)
    if sum(map(bool, (images_dir, net_path, data_split_images))) != 1:
        raise ValueError("--mode=eval needs exactly one of --images=DIR, --net=PATH or "
                         "--data_split_images=SPLIT")
    if data_split_images:
        imgs = images.source_images(data_config, data_split_images, num_images,
                                    batch_size=batch_size)
    elif images_dir:
        imgs = images.folder_images(images_dir, num_images, batch_size, seed=subset_seed)
    else:
        imgs = images.net_images(net_path, seeds or range(num_images), batch_size, ema=ema,
                                 num_steps=num_steps, vae=vae, **gen_kw)
    if data_split_images and vae is None and _is_latent_data(data_config):
        raise ValueError(f"--data_split_images={data_split_images}: the --config data are "
                         f"SD-VAE latents; pass --vae=PATH to decode them to RGB")
    if data_split_images and vae is not None:
        imgs = images.decoded_source_images(data_config, data_split_images, num_images, vae,
                                            batch_size)
    res = metrics_lib.evaluate(imgs, num_images, names, ref=ref, data_config=data_config,
                               ref_split=ref_split, classifier_config=classifier_config,
                               dinov2=dinov2, vae=vae)
    print(json.dumps(res, indent=2))
    if out_json:
        _append_result(out_json, json.dumps(dict(
            res, images=images_dir or data_split_images, net=net_path, ref_split=ref_split,
            guide=gen_kw.get("guide_path"), guidance=gen_kw.get("guidance", 1.0))) + "\n")
    return res


def main_ref(*, dest: str, images_dir: str | None, data_config: Any, split: str,
             metrics: str = "fid,fd_dinov2", num_images: int | None = None,
             batch_size: int = 64, dinov2: str | None = None, seed: int = 0) -> dict:
    """CLI body of `--mode=ref`: reference statistics of a dataset, written to `dest` in
    the release's format (`calculate_metrics.py ref`: a `.pkl` `{'num_images': N, 'fid':
    {'mu', 'sigma'}, 'fd_dinov2': {'mu', 'sigma'}}`, readable by the release and by
    `--ref`).

    Args: dest: `.pkl` (or `.npz` for `fid` alone); images_dir: a folder of images, else
      the `split` split of `data_config`; metrics: comma list of `fid`, `fd_dinov2`;
      num_images: a random subset (seeded) of this many images, None = all (the release
      uses all); dinov2: the DINOv2 weights file.
    Returns `{'num_images': N, 'time_s': seconds}`.
    Raises ValueError for another metric, a missing source or too few images;
    FileNotFoundError for missing weights.
    """
    names = [m.strip() for m in metrics.split(",") if m.strip()]
    bad = sorted(set(names) - set(metrics_lib.FD_METRICS))
    if bad or not names:
        raise ValueError(f"--mode=ref computes statistics of "
                         f"{', '.join(metrics_lib.FD_METRICS)}; got --metrics={metrics}")
    if not dest.lower().endswith((".pkl", ".npz")):
        raise ValueError(f"--ref={dest}: the statistics are written to a .pkl (the release's "
                         f"format) or an .npz (fid only)")
    t = time.time()
    # The source is checked (missing, latent) before any weights load, so that its error
    # is the one the user sees; the extractors then load before any image is read.
    if images_dir:
        source = data_lib.make_source({"source": "folder", "path": images_dir,
                                       "use_labels": False})
    elif data_config is not None:
        source = data_lib.make_source(dict(dict(data_config), split=split))
        if getattr(source, "encoder", "none") == "sd-vae":
            raise ValueError(f"{source.path} holds SD-VAE latents; reference statistics are of "
                             f"the real RGB images: give --images=the PNG data set they were "
                             f"encoded from (dataset_tool convert's output)")
    else:
        raise ValueError("--mode=ref needs the dataset: --images=DIR|ZIP or --config")
    extractors = {m: metrics_lib.feature_extractor(m, dinov2) for m in names}
    stats = fid.stats_from_source_multi(source, extractors, num_images=num_images,
                                        batch_size=batch_size, seed=seed)
    fid.save_ref_stats(dest, stats)
    n = next(iter(stats.values())).num_items
    print(f"Reference statistics of {n} images ({', '.join(names)}) -> {dest}")
    return {"num_images": n, "time_s": time.time() - t}
