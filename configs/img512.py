"""ImageNet-512 presets in SD-VAE latent space (4x64x64). Variants: xxs, xs, s, m, l,
xl, xxl (default s), and `tiny` (a CPU smoke run of the latent path, docs/latent_demo.md).
The data are the release's pre-encoded latents: a folder or zip of `.npy` mean/std arrays
[8, 64, 64] with dataset.json (its `dataset_tool.py encode`, or ours:
`python -m edm2_jax.data.dataset_tool encode`; edm2_jax/data/latents.py); generating and
evaluating decode with the SD VAE given as --vae (config.eval.vae during training).
Compute dtype `network.dtype='auto'`: bfloat16 on GPU/TPU, float32 on CPU
(`configs.resolve_dtype`); `--config.network.dtype=float32` trains in float32.

    python -m edm2_jax.main --config=configs/img512.py:xs --workdir=runs/img512-xs \
        --config.data.path=datasets/img512-sd.zip
    python -m edm2_jax.main --mode=generate --net=runs/img512-xs --vae=sd-vae-ft-mse/ \
        --seeds=0-63 --outdir=out

`tiny`: 8x8x4 latents (64x64 RGB through an 8x VAE), 10 classes, a 2-level U-Net of
width 16, batch 32, 1.024 kimg, float32; minutes on CPU.
"""
from edm2_jax.configs import preset_config


def get_config(variant: str = "s"):
    tiny = variant == "tiny"
    c = preset_config("img512-xs" if tiny else f"img512-{variant or 's'}")
    c.data.source = "folder"
    c.data.encoder = "sd-vae"
    if tiny:
        c.network.update(img_resolution=8, img_channels=4, label_dim=10, model_channels=16,
                         channel_mult=(1, 2), num_blocks=1, attn_resolutions=(), dropout=0.0,
                         dtype="float32")
        c.batch_size = 32
        c.optim.ref_lr, c.optim.t_ref, c.optim.rampup_kimg = 0.01, 1000, 0.256
        c.total_kimg = 1.024
        c.status_kimg = 0.256
        c.checkpoint_kimg = c.snapshot_kimg = 0.512
        c.sample.num_steps = 8
        c.sample.grid_rows, c.sample.grid_cols = 2, 5
    return c
