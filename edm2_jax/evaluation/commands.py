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

A `--net` (or a `--preset`, which names one) is measured in one streamed pass
(`evaluation.stream`): generate -> decode -> features batch by batch, float64 statistics
accumulated, no image set held whole; PNGs only with `--outdir`. Seeds are split over the
local devices and over the processes of a multi-host job, whose statistics are summed at
the end. Its results are appended to `--out_json`, by default beside the net
(`RUN/eval.jsonl` for a run or its snapshot, `NET/eval.jsonl` for a network directory:
`run.layout.eval_results_path`). The pass is resumable: a partial state
(`<out_json>.partial.p<process>.npz`) is saved every 1000 images or 60 s and when the
run stops; the same command then generates only the seeds not done yet. The results add
`preset`, `seeds` (a range string), `num_steps`,
`guidance`, `guidance_interval`, the `net` and `guide` paths, and the stream's
`time_per_image_s` / `images_per_s`.

    # FID-50k of a preset's autoguided net, resumable, PNGs kept:
    python -m edm2_jax.main --mode=eval --preset=edm2-img64-s-autog-fid --models=models/ \
        --out_json=results.jsonl --outdir=out

Latent (img512) networks: their samples are decoded to RGB by the SD VAE (`--vae=PATH`;
`nets.check_vae`: a latent net without it fails before anything heavy, naming
`--vae`) and measured as uint8 RGB. Reference data from a latent data set (no `--ref`)
are the VAE's decodes of each stored latent's mean (`images.DecodedSource`):
reconstructions, not the original pixels; for the paper's figures give `--ref`
(statistics of the real images, `--mode=ref --images=...`).
"""
from __future__ import annotations

import json
import math
import time
from typing import Any, Sequence

import jax
import numpy as np

from edm2_jax import data as data_lib
from edm2_jax import nets, paths
from edm2_jax.encoders import vae as vae_lib
from edm2_jax.evaluation import dinov2 as dinov2_lib
from edm2_jax.evaluation import fid
from edm2_jax.evaluation import images
from edm2_jax.evaluation import metrics as metrics_lib
from edm2_jax.evaluation import stream
from edm2_jax.run import layout
from edm2_jax.sampling import seed_images, solvers


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


def _nonfinite_fields(tree: Any, prefix: str = "") -> list[str]:
    """`'name=value'` of every float of the results `tree` (nested dicts and lists) that
    is NaN or infinite."""
    if isinstance(tree, dict):
        return [f for k, v in tree.items() for f in _nonfinite_fields(v, f"{prefix}{k}.")]
    if isinstance(tree, (list, tuple)):
        return [f for i, v in enumerate(tree) for f in _nonfinite_fields(v, f"{prefix}{i}.")]
    if isinstance(tree, (float, np.floating)) and not math.isfinite(tree):
        return [f"{prefix[:-1]}={float(tree)}"]
    return []


def check_results(res: dict, out_json: str | None, inputs: str) -> None:
    """Raise ValueError, before any figure is printed or written, when a figure of the
    results `res` is NaN or infinite (a row of `out_json` must be a true figure, and
    JSON): naming the figures and `inputs`, what to check."""
    bad = _nonfinite_fields(res)
    if bad:
        where = f"no row is appended to {out_json}" if out_json else "nothing is reported"
        raise ValueError(f"the figures {', '.join(bad[:4])} are not finite, so {where}: "
                         f"check {inputs}")


def _append_result(out_json: str, res: dict) -> None:
    """Append the results `res` to `out_json` as one JSON line (strict JSON: a NaN or
    infinite figure is refused, `check_results`)."""
    line = json.dumps(res, allow_nan=False) + "\n"
    if paths.is_url(out_json):  # object storage cannot append: rewrite the object
        before = paths.read_text(out_json) if paths.exists(out_json) else ""
        paths.write_text_atomic(out_json, before + line)
    else:
        with open(out_json, "a") as f:
            f.write(line)


def main_eval(*, images_dir: str | None, net_path: str | None, num_images: int | None,
              metrics: str, ref: str | None, data_config: Any, ema: str | None = None,
              batch_size: int = 64, sampler: solvers.Sampler | None = None,
              out_json: str | None = None,
              ref_split: str = "test", data_split_images: str | None = None,
              classifier_config: Any = None, seeds: str | Sequence[int] | None = None,
              subset_seed: int = 0, dinov2: str | None = None, vae_path: str | None = None,
              preset: str | None = None, outdir: str | None = None, **gen_kw) -> dict:
    """CLI body of `--mode=eval` (see module doc). Prints and returns the results.

    A `--net` is measured in one streamed, resumable pass (`evaluation.stream`): its
    samples for `seeds` (`'0-49999'` or ints; default `0 .. num_images - 1`; `num_images`
    None means `len(seeds)`) go batch by batch through the VAE (a latent net) and the
    feature networks, split over the local devices and the processes; PNGs are written
    to `outdir` only when given; a partial state beside `out_json` (or in the current
    directory) lets the same command resume after a kill. `preset`: the name of the
    release preset that chose net, guide and guidance (recorded in the results only).
    `subset_seed` picks the random subset of an `--images` folder
    (`images.folder_subset`). `vae_path`: `--vae`, the SD VAE that decodes a latent net's
    samples (checked first, `nets.check_vae`) and latent reference data. `gen_kw`:
    guide_path, guide_ema, guidance, guidance_interval, class_idx and `rng` of
    `seed_images.generate_images` (`progress=False` silences the bars). `sampler`: a
    `solvers.Sampler` value (default `solvers.Heun()`, 32 steps).
    Appends the results as one JSON line to `out_json` (of a net by default
    `layout.eval_results_path(net_path)`, beside it; with the net also preset, seeds as a
    range string, num_steps, guidance, guidance_interval, net and guide paths,
    `time_per_image_s` and `images_per_s` of the stream). Raises ValueError when `seeds`
    and `num_images` disagree, for a latent net without `--vae` or a pixel-space net
    with one, for `outdir` without a net; OutputLocationError for an unwritable
    `outdir` or partial-state location; all before any image is generated."""
    names = [m.strip() for m in metrics.split(",") if m.strip()]
    log = bool(gen_kw.pop("progress", True))
    if net_path:  # before anything heavy: a latent net needs --vae, an RGB net refuses it
        vae = nets.check_vae(net_path, vae_path, gen_kw.get("guide_path"))
    else:
        vae = _vae_for_data(vae_path, data_config)
    if seeds is not None:
        seeds = seed_images.parse_seeds(seeds) if isinstance(seeds, str) else list(seeds)
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
        # A bad file (or one of other features) fails now, not after generating the images.
        if ref:
            metrics_lib.check_ref(ref, metric, dinov2)
        elif metric == "fd_dinov2":
            dinov2_lib.load_dinov2(dinov2)
    if sum(map(bool, (images_dir, net_path, data_split_images))) != 1:
        raise ValueError("--mode=eval needs exactly one of --images=DIR, --net=PATH or "
                         "--data_split_images=SPLIT")
    if outdir and not net_path:
        raise ValueError(f"--outdir={outdir} keeps the PNGs a --net generates while it is "
                         f"measured; drop it for --images / --data_split_images")
    if outdir:
        paths.check_output_dir(outdir, "--outdir")
    if data_split_images and vae is None and _is_latent_data(data_config):
        raise ValueError(f"--data_split_images={data_split_images}: the --config data are "
                         f"SD-VAE latents; pass --vae=PATH to decode them to RGB")
    kw = dict(ref=ref, data_config=data_config, ref_split=ref_split,
              classifier_config=classifier_config, dinov2=dinov2, vae=vae)
    if net_path:
        res = _eval_net(net_path, list(seeds or range(num_images)), names, ema=ema,
                        batch_size=batch_size, sampler=sampler or solvers.Heun(),
                        out_json=out_json,
                        preset=preset, outdir=outdir, log=log, gen_kw=gen_kw, **kw)
    else:
        if data_split_images and vae is not None:
            imgs = images.decoded_source_images(data_config, data_split_images, num_images,
                                                vae, batch_size)
        elif data_split_images:
            imgs = images.source_images(data_config, data_split_images, num_images,
                                        batch_size=batch_size)
        else:
            imgs = images.folder_images(images_dir, num_images, batch_size, seed=subset_seed)
        what = images_dir or f"the {data_split_images} split of the --config data"
        res = metrics_lib.evaluate(imgs, num_images, names, log=log, what=what, **kw)
        res.update(images=images_dir or data_split_images, net=None,
                   guide=gen_kw.get("guide_path"), guidance=gen_kw.get("guidance", 1.0))
    state_path = res.pop("_partial_state", None)
    out_json = res.pop("_out_json", out_json)
    inputs = " and ".join(x for x in (
        f"--ref={ref}" if ref else None, f"--net={net_path}" if net_path else None,
        f"--images={images_dir}" if images_dir else None,
        f"--data_split_images={data_split_images}" if data_split_images else None,
        f"--dinov2={dinov2}" if dinov2 and "fd_dinov2" in names else None) if x)
    check_results(res, out_json, inputs)  # the partial state stays: nothing is lost
    if jax.process_index() == 0:
        print(json.dumps(res, indent=2))
        if out_json:
            _append_result(out_json, dict(res, ref_split=ref_split))
            print(f"Results appended to {out_json}")
    if state_path:
        stream.sync_processes("edm2_eval_written")  # every figure out before any state goes
        stream.remove_partial(state_path)
    return res


def _eval_net(net_path: str, seeds: list[int], names: list[str], *, ema: str | None,
              batch_size: int, sampler: solvers.Sampler, out_json: str | None,
              preset: str | None,
              outdir: str | None, log: bool, gen_kw: dict, **metric_kw) -> dict:
    """`main_eval` of a network: the streamed, resumable pass of `evaluation.stream`.
    Returns the results, with `_partial_state` (the path to remove once they are out)."""
    gen_kw = dict(gen_kw)
    num_steps = sampler.num_steps
    guide_path, guide_ema = gen_kw.pop("guide_path", None), gen_kw.pop("guide_ema", None)
    guidance = gen_kw.pop("guidance", 1.0)
    interval = gen_kw.pop("guidance_interval", None)
    if interval is not None:
        gen_kw["guidance_interval"] = interval = tuple(float(x) for x in interval)
    print(f"Loading the network {net_path}" + (f" (preset {preset})" if preset else ""))
    net, variables, desc = nets.load_net(net_path, ema)
    guide = nets.load_guide(guide_path, guide_ema, guidance)
    data_config = metric_kw.get("data_config")
    settings = dict(
        net=desc, guide=guide_path and f"{guide_path} ema={guide_ema}", guidance=guidance,
        guidance_interval=interval, seeds=stream.seeds_spec(seeds), num_images=len(seeds),
        metrics=sorted(names), num_steps=num_steps,
        sampler={**gen_kw, **{k: v for k, v in sampler.settings().items()
                              if k != "num_steps"}},
        vae=getattr(metric_kw.get("vae"), "path", None),
        dinov2=metric_kw.get("dinov2") if "fd_dinov2" in names else None,
        cls=[data_config, repr(metric_kw.get("classifier_config"))] if "cls" in names else None,
        processes=[jax.process_index(), jax.process_count()]
        + ([batch_size] if jax.process_count() > 1 else []))
    if out_json:
        flag = "--out_json"
    else:  # beside the net
        out_json = layout.eval_results_path(net_path)
        flag = (f"the results and the resumable state kept beside the net ({out_json}; "
                f"--out_json=PATH puts them elsewhere)")
    state_path = stream.partial_path(out_json)
    paths.check_output_file(out_json, flag)
    paths.check_output_file(state_path, flag)
    suite = metrics_lib.Metrics(names, len(seeds), log=log, **metric_kw)
    share = stream.process_share(seeds, batch_size)
    gen = suite.features()
    if stream.load_partial(state_path, settings, gen, share):
        print(f"Resuming from {state_path}: {gen.num_items} of {len(share)} images done")
    done = set(gen.ids.tolist())
    todo = [s for s in share if s not in done]
    vae = metric_kw.get("vae")
    print(f"Generating and measuring {len(todo)} images from {desc}"
          + (f", decoded by the SD VAE {vae.path}" if vae else "")
          + (f" -> {outdir}" if outdir else "")
          + " (the first batch includes compiling the sampler and the feature networks)")
    batches = seed_images.generate_images(net, variables, todo, outdir=outdir,
                                       batch_size=batch_size, guide=guide, guidance=guidance,
                                       sampler=sampler, all_processes=False, vae=vae,
                                       progress=log, **gen_kw)
    run = stream.stream_features(gen, batches, state_path, settings, len(share))
    images_here, seconds = stream.sum_over_processes([run["images"], run["seconds"]])
    gen = stream.gather_processes(gen, suite.features)
    res = {"num_images": len(seeds), **suite.info, **suite.results(gen, order=seeds)}
    wall = seconds / jax.process_count()
    res.update(preset=preset, net=net_path, guide=guide_path, guidance=guidance,
               guidance_interval=list(interval) if interval else None,
               seeds=stream.seeds_spec(seeds), num_steps=num_steps,
               images_generated=int(images_here), time_stream_s=wall,
               time_per_image_s=wall / images_here if images_here else None,
               images_per_s=images_here / wall if images_here else None,
               _partial_state=state_path, _out_json=out_json)
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
    FileNotFoundError for missing weights; FileExistsError when `dest` exists (before any
    work: statistics are never replaced).
    """
    names = [m.strip() for m in metrics.split(",") if m.strip()]
    bad = sorted(set(names) - set(metrics_lib.FD_METRICS))
    if bad or not names:
        raise ValueError(f"--mode=ref computes statistics of "
                         f"{', '.join(metrics_lib.FD_METRICS)}; got --metrics={metrics}")
    if not dest.lower().endswith((".pkl", ".npz")):
        raise ValueError(f"--ref={dest}: the statistics are written to a .pkl (the release's "
                         f"format) or an .npz (fid only)")
    if paths.exists(dest):  # a command never replaces a file: the statistics of a data set
        raise FileExistsError(f"--ref={dest} exists; give a new file name (or delete it "
                              f"first): --mode=ref never replaces statistics")
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
    print(f"Loading the feature networks of {', '.join(names)}")
    extractors = {m: metrics_lib.feature_extractor(m, dinov2) for m in names}
    stats = fid.stats_from_source_multi(source, extractors, num_images=num_images,
                                        batch_size=batch_size, seed=seed)
    fid.save_ref_stats(dest, stats)
    n = next(iter(stats.values())).num_items
    print(f"Reference statistics of {n} images ({', '.join(names)}) -> {dest}")
    return {"num_images": n, "time_s": time.time() - t}
