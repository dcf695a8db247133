"""FD_DINOv2 extractor: measured parity with the oracles and CPU throughput.

    PYTHONPATH=$PWD python benchmarks/dinov2_parity.py [--vitl14] [--batch=8]

Prints, for random uint8 images: the relative difference (max |a - b| / max |b|) of
`evaluation.dinov2.preprocess_uint8` against the release's torch preprocessing in float64
and in float32 (what the release runs); of the tiny / ViT-L/14 (`--vitl14`) features
against timm's DINOv2 ViT on random weights (the oracle set-up of tests/test_dinov2.py);
and, with `--vitl14`, ViT-L/14 images per second of `features_uint8` after compilation.
Needs torch and timm.
"""
from __future__ import annotations

import argparse
import time

if __name__ == "__main__":  # first, before JAX starts: the XLA flags of edm2_jax.main
    from edm2_jax import process
    process.add_default_xla_flags()

import numpy as np

from edm2_jax.evaluation import dinov2 as dv
from tests import test_dinov2 as t
from tests.tolerances import scaled_err


def feature_parity(config: dv.ViTConfig, n: int, seed: int) -> tuple[float, dv.DINOv2, np.ndarray]:
    import torch
    model = t._timm_vit(config, img_size=config.pos_grid * config.patch_size)
    t._randomise(model, seed)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    net = dv.DINOv2(config, dv.params_from_state_dict(sd, config))
    images = np.random.default_rng(seed).integers(0, 256, (n, 64, 64, 3), dtype=np.uint8)
    got = np.asarray(net.features_uint8(images))
    oracle = t._timm_vit(config, img_size=224)
    sd_t = dict(model.state_dict())
    sd_t["pos_embed"] = t._official_pos_embed(sd_t["pos_embed"], 16)
    oracle.load_state_dict(sd_t)
    with torch.no_grad():
        want = oracle(t._release_preprocess(images, torch.float32)).numpy()
    return scaled_err(got, want), net, images


def main():
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--vitl14", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    for shape in [(4, 64, 64, 3), (4, 512, 512, 3), (4, 256, 384, 3)]:
        images = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
        got = np.asarray(dv.preprocess_uint8(images))
        errs = [scaled_err(got, t._release_preprocess(images, d).permute(0, 2, 3, 1).numpy())
                for d in (torch.float64, torch.float32)]
        print(f"preprocess {shape[1]}x{shape[2]}: rel diff vs torch float64 {errs[0]:.2e}, "
              f"vs torch float32 (the release) {errs[1]:.2e}")
    err, _, _ = feature_parity(t.TINY, 4, 0)
    print(f"tiny DINOv2 (width 128, 2 blocks) vs timm: rel diff {err:.2e}")
    if args.vitl14:
        err, net, _ = feature_parity(dv.VITL14, 2, 1)
        print(f"ViT-L/14 (random weights) vs timm: rel diff {err:.2e}")
        images = np.random.default_rng(2).integers(0, 256, (args.batch, 512, 512, 3), np.uint8)
        net.features_uint8(images).block_until_ready()
        t0 = time.time()
        net.features_uint8(images).block_until_ready()
        print(f"ViT-L/14 features of 512x512 uint8 images: {args.batch / (time.time() - t0):.2f} "
              f"images/s (batch {args.batch})")


if __name__ == "__main__":
    main()
