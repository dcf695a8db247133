"""Stability's SD VAE in Flax, and the EDM2 release's latent conventions (img512).

The paper's ImageNet-512 models (Sec. 5) run in the latent space of Stability's
`stabilityai/sd-vae-ft-mse`, the KL autoencoder of Rombach et al. 2022 ("High-Resolution
Image Synthesis with Latent Diffusion Models", Sec. 3 and App. G) as diffusers'
`AutoencoderKL` holds it. This module is that network in Flax linen, NHWC, written from
the architecture: diffusers deprecated its Flax models in 2025 (announced for removal in
0.40) and its current release (0.42.1, checked) has no `FlaxAutoencoderKL`; an older
diffusers pinned for an unmaintained class was not worth a dependency.
Parity with diffusers' PyTorch `AutoencoderKL` is tested on random weights
(tests/test_vae.py).

Network (`AutoencoderKL`, `VAEConfig`; SD: channels 128/256/512/512, 2 resnets per level,
32 norm groups, 4 latent channels, downsampling 8x):
  encoder: conv_in 3x3 -> per level `layers_per_block` resnets (+ a stride-2 3x3 conv
    after zero-padding one row/column at the bottom/right, except at the last level) ->
    mid block (resnet, single-head self-attention, resnet) -> GroupNorm, SiLU, conv_out
    3x3 to 2 x latent channels -> quant_conv 1x1 -> (mean, logvar), logvar clamped to
    [-30, 20], std = exp(logvar / 2).
  decoder: post_quant_conv 1x1 -> conv_in 3x3 -> mid block -> per level (reversed)
    `layers_per_block + 1` resnets (+ nearest 2x upsampling and a 3x3 conv, except at
    the last level) -> GroupNorm, SiLU, conv_out 3x3.
  resnet: `x + conv2(silu(gn2(conv1(silu(gn1(x))))))`, a 1x1 `conv_shortcut` on `x`
    when the width changes; every GroupNorm has eps 1e-6.

The release's conventions (`training/encoders.py`, `StabilityVAEEncoder`), exactly:
  * encode: uint8 pixels `/ 255` in [0, 1] (not [-1, 1]: the release feeds the VAE [0, 1]
    and decodes with a clamp to [0, 1]) -> encoder -> "raw latents" = mean and std
    concatenated, 8 channels (what `dataset_tool.py encode` stores);
  * every training step (`encode_latents`): `x = mean + N(0, 1) * std` per image, then
    `x * scale + bias` per channel with `scale = final_std / raw_std`,
    `bias = final_mean - raw_mean * scale` (float32), raw_mean (5.81, 3.25, 0.12, -2.15),
    raw_std (4.17, 4.62, 3.71, 3.28), final_mean 0, final_std 0.5;
  * decode (`SDVAE.decode`): `(x - bias) / scale` -> decoder -> clamp to [0, 1] -> `* 255`
    -> uint8 by truncation (torch's `.to(torch.uint8)`).
  diffusers' `scaling_factor` (0.18215) is not used anywhere in this path.

Encoders (`ENCODERS`): `'none'` = pixels in [-1, 1] (the release's StandardRGBEncoder),
`'sd-vae'` = the latents above. The data config names one (`data.encoder`), and
`encoder_of` tells which a network wants from its config and metadata.

Weights: the user's file, never downloaded (`--vae=PATH`): diffusers'
`diffusion_pytorch_model.safetensors` (read with `safetensors.numpy`), its `.bin`
(`torch.save`d; read without torch), or a diffusers folder holding either (a pipeline's
`vae/` subfolder too), with its `config.json` when present. The architecture comes from
the weights' shapes; the number of GroupNorm groups, which no shape shows, from
config.json (default 32, SD's). Both attention namings are read (`to_q`/`to_k`/`to_v`/
`to_out.0` and the older `query`/`key`/`value`/`proj_attn` of the 2022 uploads).

    vae = load_vae('sd-vae-ft-mse/')                  # folder, .safetensors or .bin
    raw = vae.encode_pixels(images_uint8)              # f32 [N, H/8, W/8, 8]: mean, std
    x = encode_latents(raw, noise)                     # f32 [N, H/8, W/8, 4], the net's data
    images = vae.decode(x)                             # uint8 [N, H, W, 3]
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from edm2_jax.encoders import torch_weights

HIGHEST = jax.lax.Precision.HIGHEST

# ----------------------------------------------------------------------------------------
# Encoders and the release's latent conventions.

ENCODERS = ("none", "sd-vae")
LATENT_CHANNELS = 4                       # what the network sees
RAW_CHANNELS = 2 * LATENT_CHANNELS        # what a latent dataset stores: mean, std
RAW_MEAN = (5.81, 3.25, 0.12, -2.15)      # assumed mean of the raw latents (per channel)
RAW_STD = (4.17, 4.62, 3.71, 3.28)        # assumed std of the raw latents
FINAL_MEAN = 0.0                          # mean of the latents the network sees
FINAL_STD = 0.5                           # their std (= sigma_data)
LATENT_SCALE = (np.float32(FINAL_STD) / np.asarray(RAW_STD, np.float32)).astype(np.float32)
LATENT_BIAS = (np.float32(FINAL_MEAN)
               - np.asarray(RAW_MEAN, np.float32) * LATENT_SCALE).astype(np.float32)
VAE_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin",
             "diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.fp16.bin")
SD_VAE_URL = "https://huggingface.co/stabilityai/sd-vae-ft-mse"


def check_encoder(name: str) -> str:
    """`name` if it is one of `ENCODERS`, else ValueError naming the valid ones."""
    if name not in ENCODERS:
        raise ValueError(f"unknown encoder {name!r}; valid: {list(ENCODERS)} ('none' = RGB "
                         f"pixels, 'sd-vae' = Stable Diffusion VAE latents)")
    return name


def encoder_of(net_config: Mapping, meta: Mapping | None = None,
               data_config: Mapping | None = None) -> str:
    """Which encoder a network's images are in: `meta['encoder']` (network checkpoints),
    else `data_config['encoder']` (a training run's config.json), else by the channel
    count: 4-channel networks are SD-VAE latent nets (every img512 network of the
    release), others RGB ('none')."""
    for source in (meta, data_config):
        if source and source.get("encoder"):
            return check_encoder(str(source["encoder"]))
    return "sd-vae" if int(net_config.get("img_channels", 3)) == LATENT_CHANNELS else "none"


def encode_latents(raw, noise):
    """Raw latents -> the network's latents, one draw (the release's `encode_latents`).

    Args: raw float `[..., 8]` channels-last (mean, std), noise float `[..., 4]`
      N(0, 1) (drawn per image per step). NumPy or JAX arrays.
    Returns: float32 `[..., 4]` `(mean + noise * std) * LATENT_SCALE + LATENT_BIAS`.
    """
    mean, std = raw[..., :LATENT_CHANNELS], raw[..., LATENT_CHANNELS:]
    x = mean + noise * std
    return x * LATENT_SCALE + LATENT_BIAS


def unscale_latents(x):
    """The network's latents `[..., 4]` -> the VAE's latent `z`: `(x - bias) / scale`."""
    return (x - LATENT_BIAS) / LATENT_SCALE


# ----------------------------------------------------------------------------------------
# The network (module names follow diffusers' state dict: `down_blocks_0/resnets_1/conv1`
# is `down_blocks.0.resnets.1.conv1`).

@dataclasses.dataclass(frozen=True)
class VAEConfig:
    """Geometry of an `AutoencoderKL` (defaults: `stabilityai/sd-vae-ft-mse`)."""
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = LATENT_CHANNELS
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32
    mid_block_add_attention: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True

    @property
    def downsampling(self) -> int:
        """Pixels per latent along each side (8 for SD)."""
        return 2 ** (len(self.block_out_channels) - 1)


SD_VAE = VAEConfig()


def _conv(features: int, kernel: int, name: str, stride: int = 1, padding=None) -> nn.Conv:
    pad = kernel // 2 if padding is None else padding
    pad = ((pad, pad), (pad, pad)) if isinstance(pad, int) else pad
    return nn.Conv(features, (kernel, kernel), strides=(stride, stride), padding=pad,
                   precision=HIGHEST, name=name)


def _norm(groups: int, name: str) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=groups, epsilon=1e-6, use_fast_variance=False, name=name)


class ResnetBlock(nn.Module):
    """`x + conv2(silu(gn2(conv1(silu(gn1(x))))))`, a 1x1 `conv_shortcut` on `x` when
    the width changes (He et al. 2016's pre-activation block with GroupNorm)."""
    out_channels: int
    groups: int

    @nn.compact
    def __call__(self, x):
        h = nn.silu(_norm(self.groups, "norm1")(x))
        h = _conv(self.out_channels, 3, "conv1")(h)
        h = nn.silu(_norm(self.groups, "norm2")(h))
        h = _conv(self.out_channels, 3, "conv2")(h)
        if x.shape[-1] != self.out_channels:
            x = _conv(self.out_channels, 1, "conv_shortcut")(x)
        return x + h


class Attention(nn.Module):
    """Single-head self-attention over all positions, `x + to_out(softmax(q k^T /
    sqrt(C)) v)` with q, k, v linear maps of `group_norm(x)`. `[N, H, W, C]` in and out."""
    groups: int

    @nn.compact
    def __call__(self, x):
        n, h, w, c = x.shape
        t = _norm(self.groups, "group_norm")(x).reshape(n, h * w, c)
        dense = functools.partial(nn.Dense, c, precision=HIGHEST)
        q, k, v = dense(name="to_q")(t), dense(name="to_k")(t), dense(name="to_v")(t)
        logits = jnp.einsum("nqc,nkc->nqk", q * c ** -0.5, k, precision=HIGHEST)
        out = jnp.einsum("nqk,nkc->nqc", jax.nn.softmax(logits, axis=-1), v,
                         precision=HIGHEST)
        return x + dense(name="to_out_0")(out).reshape(n, h, w, c)


class MidBlock(nn.Module):
    """resnet -> attention (if enabled) -> resnet, at constant width."""
    groups: int
    attention: bool

    @nn.compact
    def __call__(self, x):
        c = x.shape[-1]
        x = ResnetBlock(c, self.groups, name="resnets_0")(x)
        if self.attention:
            x = Attention(self.groups, name="attentions_0")(x)
        return ResnetBlock(c, self.groups, name="resnets_1")(x)


class Downsample(nn.Module):
    """Stride-2 3x3 conv after one row and column of zeros at the bottom and right."""
    out_channels: int

    @nn.compact
    def __call__(self, x):
        return _conv(self.out_channels, 3, "conv", stride=2, padding=((0, 1), (0, 1)))(x)


class Upsample(nn.Module):
    """Nearest-neighbour 2x upsampling, then a 3x3 conv."""
    out_channels: int

    @nn.compact
    def __call__(self, x):
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return _conv(self.out_channels, 3, "conv")(x)


class DownBlock(nn.Module):
    """`num_layers` resnets to `out_channels`, then (unless the last level) a stride-2
    3x3 conv after one row and column of zeros at the bottom and right."""
    out_channels: int
    num_layers: int
    groups: int
    downsample: bool

    @nn.compact
    def __call__(self, x):
        for j in range(self.num_layers):
            x = ResnetBlock(self.out_channels, self.groups, name=f"resnets_{j}")(x)
        if self.downsample:
            x = Downsample(self.out_channels, name="downsamplers_0")(x)
        return x


class UpBlock(nn.Module):
    """`num_layers` resnets to `out_channels`, then (unless the last level) nearest 2x
    upsampling and a 3x3 conv."""
    out_channels: int
    num_layers: int
    groups: int
    upsample: bool

    @nn.compact
    def __call__(self, x):
        for j in range(self.num_layers):
            x = ResnetBlock(self.out_channels, self.groups, name=f"resnets_{j}")(x)
        if self.upsample:
            x = Upsample(self.out_channels, name="upsamplers_0")(x)
        return x


class Encoder(nn.Module):
    """Pixels `[N, H, W, in]` -> `[N, H/d, W/d, 2 latent]` (mean, logvar before
    quant_conv), `d = config.downsampling`."""
    config: VAEConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        ch = c.block_out_channels
        x = _conv(ch[0], 3, "conv_in")(x)
        for i, width in enumerate(ch):
            x = DownBlock(width, c.layers_per_block, c.norm_num_groups,
                          downsample=i < len(ch) - 1, name=f"down_blocks_{i}")(x)
        x = MidBlock(c.norm_num_groups, c.mid_block_add_attention, name="mid_block")(x)
        x = nn.silu(_norm(c.norm_num_groups, "conv_norm_out")(x))
        return _conv(2 * c.latent_channels, 3, "conv_out")(x)


class Decoder(nn.Module):
    """Latent `z` `[N, h, w, latent]` -> `[N, h d, w d, out]` (after post_quant_conv)."""
    config: VAEConfig

    @nn.compact
    def __call__(self, z):
        c = self.config
        ch = tuple(reversed(c.block_out_channels))
        x = _conv(ch[0], 3, "conv_in")(z)
        x = MidBlock(c.norm_num_groups, c.mid_block_add_attention, name="mid_block")(x)
        for i, width in enumerate(ch):
            x = UpBlock(width, c.layers_per_block + 1, c.norm_num_groups,
                        upsample=i < len(ch) - 1, name=f"up_blocks_{i}")(x)
        x = nn.silu(_norm(c.norm_num_groups, "conv_norm_out")(x))
        return _conv(c.out_channels, 3, "conv_out")(x)


class AutoencoderKL(nn.Module):
    """The KL autoencoder (Rombach et al. 2022), diffusers' `AutoencoderKL` layout.
    `encode(x)` -> `(mean, std)`, `decode(z)` -> pixels; NHWC float32 throughout; the
    pixel range is whatever the weights were trained on (the release uses [0, 1])."""
    config: VAEConfig = SD_VAE

    def setup(self):
        c = self.config
        self.encoder = Encoder(c)
        self.decoder = Decoder(c)
        self.quant_conv = (_conv(2 * c.latent_channels, 1, "quant_conv")
                           if c.use_quant_conv else None)
        self.post_quant_conv = (_conv(c.latent_channels, 1, "post_quant_conv")
                                if c.use_post_quant_conv else None)

    def encode(self, x):
        """`[N, H, W, in]` -> `(mean, std)`, each `[N, H/d, W/d, latent]`; the log-variance
        is clamped to [-30, 20] before `std = exp(logvar / 2)`."""
        moments = self.encoder(x)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return mean, jnp.exp(0.5 * jnp.clip(logvar, -30.0, 20.0))

    def decode(self, z):
        """`[N, h, w, latent]` -> `[N, h d, w d, out]`, unclamped."""
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    def __call__(self, x):
        mean, _ = self.encode(x)
        return self.decode(mean)


# ----------------------------------------------------------------------------------------
# The release's encode and decode, jitted.

@functools.partial(jax.jit, static_argnames=("config",))
def _encode_pixels(params, images_uint8, config):
    x = images_uint8.astype(jnp.float32) / 255
    mean, std = AutoencoderKL(config).apply({"params": params}, x, method="encode")
    return jnp.concatenate([mean, std], axis=-1)


@functools.partial(jax.jit, static_argnames=("config",))
def _decode_uint8(params, latents, config):
    z = unscale_latents(latents.astype(jnp.float32))
    x = AutoencoderKL(config).apply({"params": params}, z, method="decode")
    return (jnp.clip(x, 0, 1) * 255).astype(jnp.uint8)  # truncation, as torch's uint8 cast


def _run_batched(fn, params, x: np.ndarray, config, batch_size: int, sharding) -> np.ndarray:
    """`fn(params, chunk, config)` over chunks of `batch_size` images per device of `x`,
    each put on the batch-axis `sharding` when given; host results. Chunks are padded
    (with copies of their last image) to the full chunk size when there are several,
    so one shape compiles, and to a multiple of the device count."""
    n_dev = len(sharding.device_set) if sharding is not None else 1
    step = batch_size * n_dev
    out = []
    for a in range(0, len(x), step):
        chunk = x[a:a + step]
        m = len(chunk)
        size = step if len(x) > step else -(-m // n_dev) * n_dev
        if m < size:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], size - m, axis=0)])
        chunk = jax.device_put(chunk, sharding) if sharding is not None else chunk
        out.append(np.asarray(fn(params, chunk, config))[:m])
    return np.concatenate(out)


@dataclasses.dataclass
class SDVAE:
    """An `AutoencoderKL` with its weights, used as the release's `StabilityVAEEncoder`.

    `batch_size`: images per device per VAE call (the release uses 8 when encoding, 4
    when generating); longer inputs run in chunks of it."""
    config: VAEConfig
    params: Any
    path: str = ""
    batch_size: int = 8

    def _check(self, x, channels: int, what: str, multiple: int) -> None:
        if x.ndim and not len(x):
            raise ValueError(f"no {what} given (an empty batch)")
        if x.ndim != 4 or x.shape[-1] != channels:
            raise ValueError(f"{what} must be NHWC [N, H, W, {channels}], got shape "
                             f"{tuple(x.shape)}; transpose NCHW with x.transpose(0, 2, 3, 1)")
        if x.shape[1] % multiple or x.shape[2] % multiple:
            raise ValueError(f"{what} of {x.shape[1]}x{x.shape[2]} pixels: sides must be "
                             f"multiples of {multiple} (the VAE's {multiple}x downsampling)")

    def encode_pixels(self, images, sharding=None) -> np.ndarray:
        """uint8 `[N, H, W, 3]` -> raw latents float32 `[N, H/8, W/8, 8]` (mean, std),
        what a latent dataset stores. `sharding`: a batch-axis sharding to split each
        chunk over devices. Raises ValueError for a non-uint8 or mis-shaped input."""
        images = np.asarray(images)
        if images.dtype != np.uint8:
            raise ValueError(f"encode_pixels expects uint8 pixels, got {images.dtype}")
        self._check(images, self.config.in_channels, "images", self.config.downsampling)
        return _run_batched(_encode_pixels, self.params, images, self.config, self.batch_size,
                            sharding)

    def decode(self, latents, sharding=None) -> np.ndarray:
        """The network's latents float `[N, h, w, 4]` -> uint8 `[N, 8h, 8w, 3]`: undo the
        scale and bias, decoder, clamp to [0, 1], `* 255`, truncate (the release's
        `decode`). Raises ValueError for a mis-shaped input."""
        latents = np.asarray(latents, np.float32)
        self._check(latents, self.config.latent_channels, "latents", 1)
        return _run_batched(_decode_uint8, self.params, latents, self.config, self.batch_size,
                            sharding)


# ----------------------------------------------------------------------------------------
# Weights.

def find_weights(path: str | os.PathLike) -> tuple[Path, Path | None]:
    """`(weights file, config.json or None)` for `path`: a weights file itself, or a
    diffusers folder holding one of `VAE_FILES` (directly or in `vae/`). Raises
    FileNotFoundError naming what was looked for and `--vae`."""
    path = Path(path).expanduser()
    if path.is_file():
        config = path.parent / "config.json"
        return path, config if config.is_file() else None
    if path.is_dir():
        for folder in (path, path / "vae"):
            for name in VAE_FILES:
                if (folder / name).is_file():
                    config = folder / "config.json"
                    return folder / name, config if config.is_file() else None
        raise FileNotFoundError(
            f"--vae={path}: no {' / '.join(VAE_FILES[:2])} in it or in {path / 'vae'}; pass "
            f"the SD VAE's weights file or its diffusers folder ({SD_VAE_URL})")
    raise FileNotFoundError(f"--vae={path} does not exist; pass the SD VAE's "
                            f"diffusion_pytorch_model.safetensors (or .bin, or its folder) "
                            f"from {SD_VAE_URL}")


def read_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of an SD VAE weights file as `{name: float32 ndarray}` in torch layout
    (`torch_weights.read_state_dict`: `.safetensors`, `torch.save` zip archives and legacy
    torch files, without torch; nothing in the file runs). Raises ImportError naming the
    package, ValueError for a file that holds no state dict of tensors (or a damaged one)."""
    return torch_weights.read_state_dict(path, _not_weights)


def _not_weights(path: Path, expected: str, e: BaseException) -> ValueError:
    why = " ".join(str(e).split())[:300]
    return ValueError(f"{path} is not {expected} ({type(e).__name__}: {why})")


def _diffusers_config(path: Path | None) -> dict:
    """The AutoencoderKL fields of a diffusers config.json ({} without one, or for a
    config.json of something else). Raises ValueError for a variant this port lacks."""
    if path is None:
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} ({e}); fix or remove it (the architecture is "
                         f"then read from the weights, with 32 norm groups)") from None
    if not isinstance(cfg, dict) or "block_out_channels" not in cfg:
        return {}
    for field, allowed in (("act_fn", ("silu",)), ("norm_type", ("group",))):
        if cfg.get(field, allowed[0]) not in allowed:
            raise ValueError(f"{path}: {field}={cfg[field]!r}; this port implements "
                             f"{field}={allowed[0]!r} (the SD VAE's)")
    for field, allowed in (("down_block_types", "DownEncoderBlock2D"),
                           ("up_block_types", "UpDecoderBlock2D")):
        if any(t != allowed for t in cfg.get(field, [allowed])):
            raise ValueError(f"{path}: {field}={cfg[field]}; this port implements only "
                             f"{allowed} (the SD VAE's)")
    return cfg


def _indices(sd: Mapping, prefix: str) -> list[int]:
    pat = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for k in sd if (m := pat.match(k))})


def config_from_state_dict(sd: Mapping[str, np.ndarray], config_json: Mapping | None = None,
                           source: str = "state dict") -> VAEConfig:
    """The `VAEConfig` of an AutoencoderKL state dict: channels, levels, resnets per
    level, latent width, attention and quant convs from the shapes and names; the norm
    groups from `config_json` (diffusers' config.json fields; default 32), whose other
    fields must agree with the weights. Raises ValueError naming what is wrong."""
    if any(k.startswith(("first_stage_model.", "encoder.down.")) for k in sd):
        raise ValueError(f"{source} is in the original LDM/CompVis layout (encoder.down.*, "
                         f"e.g. vae-ft-mse-840000-ema-pruned); use the diffusers format: "
                         f"diffusion_pytorch_model.safetensors of {SD_VAE_URL}")
    levels = _indices(sd, "encoder.down_blocks.")
    try:
        channels = tuple(int(sd[f"encoder.down_blocks.{i}.resnets.0.conv1.weight"].shape[0])
                         for i in levels)
        latent = int(sd["decoder.conv_in.weight"].shape[1])
        in_ch = int(sd["encoder.conv_in.weight"].shape[1])
        out_ch = int(sd["decoder.conv_out.weight"].shape[0])
    except KeyError as e:
        raise ValueError(f"{source} is not an AutoencoderKL (diffusers) state dict: no "
                         f"{e.args[0]!r} (found {sorted(sd)[:4]}...); use the SD VAE's "
                         f"diffusion_pytorch_model.safetensors ({SD_VAE_URL})") from None
    if not levels or levels != list(range(len(levels))):
        raise ValueError(f"{source}: encoder.down_blocks numbered {levels}, expected 0..n-1")
    cj = dict(config_json or {})
    config = VAEConfig(
        in_channels=in_ch, out_channels=out_ch, latent_channels=latent,
        block_out_channels=channels,
        layers_per_block=len(_indices(sd, "encoder.down_blocks.0.resnets.")),
        norm_num_groups=int(cj.get("norm_num_groups", 32)),
        mid_block_add_attention=any(k.startswith("encoder.mid_block.attentions.") for k in sd),
        use_quant_conv="quant_conv.weight" in sd,
        use_post_quant_conv="post_quant_conv.weight" in sd)
    for field in ("in_channels", "out_channels", "latent_channels", "block_out_channels",
                  "layers_per_block", "mid_block_add_attention", "use_quant_conv",
                  "use_post_quant_conv"):
        if field in cj and _json_value(cj[field]) != _json_value(getattr(config, field)):
            raise ValueError(f"{source}: its config.json says {field}={cj[field]}, the weights "
                             f"say {getattr(config, field)}; they belong to different VAEs")
    bad = [c for c in channels if c % config.norm_num_groups]
    if bad:
        raise ValueError(f"{source}: widths {bad} are not divisible by norm_num_groups="
                         f"{config.norm_num_groups}; give the VAE's config.json beside the "
                         f"weights (its norm_num_groups)")
    return config


def _json_value(x):
    return list(x) if isinstance(x, (list, tuple)) else x


_OLD_ATTENTION = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}


def _torch_name(flax_path: str) -> str:
    """'encoder/down_blocks_0/downsamplers_0/conv/kernel' ->
    'encoder.down_blocks.0.downsamplers.0.conv.weight'."""
    *mods, leaf = flax_path.split("/")
    mods = [re.sub(r"_(\d+)$", r".\1", m) for m in mods]
    return ".".join(mods + [{"kernel": "weight", "scale": "weight"}.get(leaf, leaf)])


def params_from_state_dict(sd: Mapping[str, np.ndarray], config: VAEConfig,
                           source: str = "state dict") -> dict:
    """Torch-layout tensors -> the `AutoencoderKL(config)` params tree (convs OIHW ->
    HWIO, linear weights transposed, GroupNorm weight -> scale; 1x1-conv attention
    weights of old files squeezed). Raises ValueError listing every missing,
    mis-shaped and unexpected tensor, naming `source`."""
    expected = jax.eval_shape(lambda: AutoencoderKL(config).init(
        jax.random.PRNGKey(0), jnp.zeros((1, config.downsampling, config.downsampling,
                                          config.in_channels))))
    flat = {"/".join(k.key for k in path): leaf.shape for path, leaf
            in jax.tree_util.tree_flatten_with_path(expected["params"])[0]}
    params, missing, bad_shape, used = {}, [], [], set()
    for key, shape in flat.items():
        name = _torch_name(key)
        if name not in sd:
            old = name
            for new, legacy in _OLD_ATTENTION.items():
                old = old.replace(f".attentions.0.{new}.", f".attentions.0.{legacy}.")
            if old not in sd:
                missing.append(name)
                continue
            name = old
        used.add(name)
        value = np.asarray(sd[name], np.float32)
        leaf = key.rsplit("/", 1)[1]
        if leaf == "kernel":
            if len(shape) == 2 and value.ndim == 4 and value.shape[2:] == (1, 1):
                value = value[:, :, 0, 0]
            value = value.transpose(2, 3, 1, 0) if value.ndim == 4 else value.T
        if value.shape != tuple(shape):
            bad_shape.append(f"{name} {tuple(sd[name].shape)}")
            continue
        node = params
        for m in key.split("/")[:-1]:
            node = node.setdefault(m, {})
        node[leaf] = value
    unexpected = sorted(set(sd) - used)
    if missing or bad_shape or unexpected:
        parts = [f"{what} ({len(v)}): {', '.join(v[:6])}{' ...' if len(v) > 6 else ''}"
                 for what, v in (("missing", missing), ("wrong shape", bad_shape),
                                 ("unexpected", unexpected)) if v]
        raise ValueError(f"{source} does not match an AutoencoderKL of {config}: "
                         + "; ".join(parts) + f". Expected the diffusers weights of the SD "
                         f"VAE ({SD_VAE_URL}) or a VAE of the same layout")
    return params


@functools.lru_cache(maxsize=2)
def _load_cached(weights: str, config_json: str | None) -> SDVAE:
    sd = read_state_dict(weights)
    cj = _diffusers_config(Path(config_json) if config_json else None)
    config = config_from_state_dict(sd, cj, weights)
    params = params_from_state_dict(sd, config, weights)
    return SDVAE(config, jax.device_put(params), weights)


def load_vae(path: str | os.PathLike, require_sd: bool = True) -> SDVAE:
    """Load an SD VAE from the user's file or diffusers folder (module docstring).

    Args: path: `--vae=PATH`; require_sd: refuse VAEs whose image or latent channels
      are not the SD VAE's (3 and 4; tests load smaller ones with False).
    Returns: `SDVAE` with float32 params, cached per file.
    Raises FileNotFoundError naming `--vae`, ImportError naming the package a format
    needs, ValueError for another network or missing / mis-shaped tensors (one message
    listing them all, naming the file).
    """
    weights, config_json = find_weights(path)
    vae = _load_cached(str(weights.resolve()), str(config_json) if config_json else None)
    c = vae.config
    if require_sd and (c.in_channels, c.out_channels, c.latent_channels) != (3, 3, 4):
        raise ValueError(f"{weights} is a VAE with {c.in_channels} image and "
                         f"{c.latent_channels} latent channels; EDM2's img512 latents are "
                         f"those of the SD VAE (3 and 4): {SD_VAE_URL}")
    return vae


__all__ = ["ENCODERS", "LATENT_BIAS", "LATENT_CHANNELS", "LATENT_SCALE", "RAW_CHANNELS",
           "RAW_MEAN", "RAW_STD", "FINAL_MEAN", "FINAL_STD", "SD_VAE", "AutoencoderKL",
           "SDVAE", "VAEConfig", "check_encoder", "config_from_state_dict", "encode_latents",
           "encoder_of", "find_weights", "load_vae", "params_from_state_dict",
           "read_state_dict", "unscale_latents"]
