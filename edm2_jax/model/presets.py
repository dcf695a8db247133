"""Presets of the released EDM2 models (paper Table 2 / docs/recipe.md §3-4), one table.

`NETWORK_PRESETS[name]` gives the `Precond` kwargs; `TRAINING_PRESETS[name]` the
optimiser / loss / duration settings (batch 2048 for all; `t_ref` in batches,
durations in Mi = 2^20 images).
"""
from __future__ import annotations

Mi = 2**20

#                   model_channels  ref_lr   t_ref    dropout  P_mean P_std  duration (Mi)
_TABLE = {
    "img64-xs":   dict(ch=128, ref_lr=0.0120, t_ref=35000, dropout=0.00, P=(-0.8, 1.6), dur=1024),
    "img64-s":    dict(ch=192, ref_lr=0.0100, t_ref=35000, dropout=0.00, P=(-0.8, 1.6), dur=1024),
    "img64-m":    dict(ch=256, ref_lr=0.0090, t_ref=35000, dropout=0.10, P=(-0.8, 1.6), dur=2048),
    "img64-l":    dict(ch=320, ref_lr=0.0080, t_ref=35000, dropout=0.10, P=(-0.8, 1.6), dur=1024),
    "img64-xl":   dict(ch=384, ref_lr=0.0070, t_ref=35000, dropout=0.10, P=(-0.8, 1.6), dur=640),
    "img512-xxs": dict(ch=64,  ref_lr=0.0170, t_ref=70000, dropout=0.00, P=(-0.4, 1.0), dur=2048),
    "img512-xs":  dict(ch=128, ref_lr=0.0120, t_ref=70000, dropout=0.00, P=(-0.4, 1.0), dur=2048),
    "img512-s":   dict(ch=192, ref_lr=0.0100, t_ref=70000, dropout=0.00, P=(-0.4, 1.0), dur=2048),
    "img512-m":   dict(ch=256, ref_lr=0.0090, t_ref=70000, dropout=0.10, P=(-0.4, 1.0), dur=2048),
    "img512-l":   dict(ch=320, ref_lr=0.0080, t_ref=70000, dropout=0.10, P=(-0.4, 1.0), dur=1792),
    "img512-xl":  dict(ch=384, ref_lr=0.0070, t_ref=70000, dropout=0.10, P=(-0.4, 1.0), dur=1280),
    "img512-xxl": dict(ch=448, ref_lr=0.0065, t_ref=70000, dropout=0.10, P=(-0.4, 1.0), dur=896),
}

# Data shapes: img64 = 3-channel 64x64 pixels; img512 = 4-channel 64x64 SD-VAE latents.
_DATA = {"img64": dict(img_resolution=64, img_channels=3, label_dim=1000),
         "img512": dict(img_resolution=64, img_channels=4, label_dim=1000)}

NETWORK_PRESETS = {
    name: dict(**_DATA[name.split("-")[0]], model_channels=p["ch"], channel_mult=(1, 2, 3, 4),
               num_blocks=3, attn_resolutions=(16, 8), dropout=p["dropout"])
    for name, p in _TABLE.items()}

TRAINING_PRESETS = {
    name: dict(batch_size=2048, ref_lr=p["ref_lr"], t_ref=p["t_ref"], rampup_kimg=10_000.0,
               P_mean=p["P"][0], P_std=p["P"][1], total_kimg=p["dur"] * Mi / 1000)
    for name, p in _TABLE.items()}

# Adam's settings in every preset (the paper's Sec. 2.3 and the release's training loop):
# the one source of these values for the run's optimiser and any objective's own.
ADAM = dict(beta1=0.9, beta2=0.99, eps=1e-8)

# Parameter counts of the released networks (docs/recipe.md §3); tests check them.
PARAM_COUNTS = {
    "img64-xs": 124_710_949, "img64-s": 280_209_381, "img64-m": 497_803_173,
    "img64-l": 777_492_325, "img64-xl": 1_119_276_837,
    "img512-xxs": 31_309_029, "img512-xs": 124_713_253, "img512-s": 280_212_837,
    "img512-m": 497_807_781, "img512-l": 777_498_085, "img512-xl": 1_119_283_749,
    "img512-xxl": 1_523_164_773,
}
