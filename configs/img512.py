"""ImageNet-512 presets in SD-VAE latent space (4x64x64). Variants: xxs, xs, s, m, l,
xl, xxl (default s). The data must already be encoded latents (a folder/zip of
pre-encoded arrays); the VAE encoder is not part of this project yet.

    python -m edm2_jax.main --config=configs/img512.py:xs --workdir=runs/img512-xs \
        --config.data.path=datasets/img512-sd.zip
"""
from edm2_jax.configs import preset_config


def get_config(variant: str = "s"):
    c = preset_config(f"img512-{variant or 's'}")
    c.data.source = "folder"
    return c
