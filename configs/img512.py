"""ImageNet-512 presets in SD-VAE latent space (4x64x64). Variants: xxs, xs, s, m, l,
xl, xxl (default s). The data are the release's pre-encoded latents: a folder or zip of
`.npy` mean/std arrays [8, 64, 64] with dataset.json (its `dataset_tool.py encode`;
edm2_jax/data/latents.py); generating decodes with the SD VAE given as --vae.

    python -m edm2_jax.main --config=configs/img512.py:xs --workdir=runs/img512-xs \
        --config.data.path=datasets/img512-sd.zip
    python -m edm2_jax.main --mode=generate --net=runs/img512-xs --vae=sd-vae-ft-mse/ \
        --seeds=0-63 --outdir=out
"""
from edm2_jax.configs import preset_config


def get_config(variant: str = "s"):
    c = preset_config(f"img512-{variant or 's'}")
    c.data.source = "folder"
    c.data.encoder = "sd-vae"
    return c
