"""ImageNet-64 presets (pixel space). Variants: xs, s, m, l, xl (default s).
Compute dtype `network.dtype='auto'`: bfloat16 on GPU/TPU, float32 on CPU
(`configs.resolve_dtype`); `--config.network.dtype=float32` trains in float32.

    python -m edm2_jax.main --config=configs/img64.py:xs --workdir=runs/img64-xs \
        --config.data.source=tfds --config.data.name=imagenet2012 --config.data.data_dir=~/tfds
    python -m edm2_jax.main --config=configs/img64.py:s --workdir=runs/img64-s \
        --config.data.source=folder --config.data.path=datasets/img64.zip
"""
from edm2_jax.configs import preset_config


def get_config(variant: str = "s"):
    c = preset_config(f"img64-{variant or 's'}")
    c.data.source = "tfds"
    c.data.name = "imagenet2012"
    return c
