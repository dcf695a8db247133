"""Offline default: class-conditional EDM2 on Fashion-MNIST (32x32x1, 10 classes), sized
to train on 2 CPU cores in well under 30 minutes.

    python -m edm2_jax.main --config=configs/fashion_mnist.py --workdir=runs/fmnist
    python -m edm2_jax.main --config=configs/fashion_mnist.py:tiny --workdir=/tmp/t   # smoke test

Data: the Debian package dataset-fashion-mnist (/usr/share/datasets/fashion-mnist).
"""
from edm2_jax.configs import base_config


def get_config(variant: str = "default"):
    c = base_config()
    c.data.source = "fashion_mnist"
    c.network.update(img_resolution=32, img_channels=1, label_dim=10, model_channels=16,
                     channel_mult=(1, 2, 4), num_blocks=1, attn_resolutions=(8,), dropout=0.0)
    c.loss.P_mean, c.loss.P_std = -0.8, 1.6
    c.batch_size = 64
    c.optim.ref_lr = 0.01
    c.optim.t_ref = 1000          # batches
    c.optim.rampup_kimg = 2
    c.ema.sigma_rels = (0.05, 0.10)
    c.total_kimg = 64            # ~1 epoch; its time: results entry quickstart-train (docs/results.json)
    c.status_kimg = 4
    c.checkpoint_kimg = 16
    c.snapshot_kimg = 16
    c.sample.num_steps = 32
    c.sample.grid_rows, c.sample.grid_cols = 10, 10
    if variant == "tiny":  # seconds, for smoke tests
        c.network.update(model_channels=16, channel_mult=(1, 2), attn_resolutions=())
        c.batch_size = 32
        c.total_kimg = 0.256
        c.status_kimg = c.checkpoint_kimg = c.snapshot_kimg = 0.128
        c.sample.num_steps = 4
        c.sample.grid_rows, c.sample.grid_cols = 2, 5
    elif variant not in ("default", ""):
        raise ValueError(f"unknown variant {variant!r}; use 'default' or 'tiny'")
    return c
