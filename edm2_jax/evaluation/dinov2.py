"""DINOv2 ViT feature extractor for FD_DINOv2, as the EDM2 release evaluates it.

FD_DINOv2 (Stein et al. 2023, "Exposing flaws of generative model evaluation metrics",
adopted by the EDM2 paper Sec. 5 / Table 2) is the Frechet distance between Gaussians fitted
to the 1024-d features of DINOv2 ViT-L/14 (Oquab et al. 2023) of generated and reference
images. The release (`calculate_metrics.py`) loads `dinov2_vitl14` from torch.hub and
takes its output, which is the class token after the final LayerNorm (the hub model's head
is the identity). This module is a Flax (linen) port of that vision transformer, NHWC,
with the parameter names of the official checkpoint, and a loader for its weights.

Network (`DINOv2ViT`, `ViTConfig`; ViT-L/14: 24 blocks, width 1024, 16 heads of 64):
  patch embedding (14x14 conv, stride 14) -> prepend the class token -> add the position
  embedding -> blocks `x += ls1 * attn(norm1(x)); x += ls2 * mlp(norm2(x))` (pre-norm,
  LayerNorm eps 1e-6, layer scale `ls*`, exact-erf GELU MLP of ratio 4) -> LayerNorm ->
  token 0. The checkpoint's position embedding covers a 37x37 patch grid (518x518 input);
  at 224x224 (16x16 patches) it is resampled as the official code does it: torch bicubic
  (Keys a = -0.75, no antialiasing, edge-clamped taps) with the *scale factor*
  `(16 + 0.1) / 37`, so source coordinate `(i + 0.5) * 37 / 16.1 - 0.5`
  (`interpolate_pos_embed`; the 0.1 is DINOv2's `interpolate_offset`). timm resamples
  with the output *size* (and antialiasing) instead, which gives different embeddings.

Preprocessing (`preprocess_uint8`), the release's default `resize_mode='torch'`:
  1. uint8 RGB -> float32 (grayscale `[.., 1]` repeated to 3 channels), values 0..255;
  2. resize to 224x224 with torch's `interpolate(mode='bicubic', antialias=True)`: the
     separable filter of PIL's BICUBIC (Keys a = -0.5), stretched by the shrink factor
     when shrinking, weights renormalised where the filter leaves the image
     (`resize_bicubic_antialias`); no rounding or clipping;
  3. `/ 255`, then ImageNet normalisation `(x - (0.485, 0.456, 0.406)) / (0.229, 0.224, 0.225)`.
  (The release's optional `resize_mode='pil'` rounds the resized image to uint8 first.)

Weights: the official `dinov2_vitl14_pretrain.pth` (a `torch.save`d state dict,
https://dl.fbaipublicfiles.com/dinov2/dinov2_vitl14/dinov2_vitl14_pretrain.pth) or a
`.safetensors` file with the same names (timm's `vit_large_patch14_dinov2.lvd142m`
`model.safetensors`). Both are read without torch: the `.pth` (a zip archive, or a
pre-1.6 non-zip file) with a restricted unpickler (tensors only, each checked against its
storage, nothing executed), `.safetensors` with the `safetensors` package. The training
layout with block chunks (`blocks.<chunk>.<i>.*`) is accepted too. Nothing is
downloaded: pass the file (`--dinov2=PATH`, or EDM2_DINOV2_WEIGHTS).

    net = load_dinov2('dinov2_vitl14_pretrain.pth')
    feats = net.features_uint8(images_uint8_nhwc)       # float32 [N, 1024]
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from edm2_jax.encoders import torch_weights

WEIGHTS_ENV = "EDM2_DINOV2_WEIGHTS"
WEIGHTS_URL = "https://dl.fbaipublicfiles.com/dinov2/dinov2_vitl14/dinov2_vitl14_pretrain.pth"
RESOLUTION = 224
FEATURE_DIM = 1024
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Geometry of a DINOv2 vision transformer (defaults: ViT-L/14 of the release).

    `pos_grid`: side of the patch grid the position embedding was trained for (37 =
    518 / 14); other grids are resampled (`interpolate_pos_embed`). `interpolate_offset`:
    DINOv2's 0.1 added to the target grid to form the bicubic scale factor (0 = resample
    to the target size instead, as later DINOv2 variants do)."""
    patch_size: int = 14
    embed_dim: int = 1024
    depth: int = 24
    num_heads: int = 16
    mlp_ratio: float = 4.0
    pos_grid: int = 37
    interpolate_offset: float = 0.1
    layer_norm_eps: float = 1e-6


VITL14 = ViTConfig()


# ----------------------------------------------------------------------------------------
# Preprocessing.

def _keys_cubic(x: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel (Keys 1981, Eq. 15) with parameter `a`, float64."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def antialias_bicubic_matrix(in_size: int, out_size: int) -> np.ndarray:
    """Resampling matrix `[out_size, in_size]` (float64) of torch's
    `interpolate(mode='bicubic', antialias=True, align_corners=False)` along one axis.

    Output `i` has centre `c = (i + 0.5) s` in input coordinates, `s = in / out`; input
    pixel `j` (centre `j + 0.5`) gets weight `k(((j + 0.5) - c) / max(s, 1))`, `k` Keys'
    cubic with a = -0.5 (PIL's BICUBIC), for `j` in `[trunc(c - r + 0.5), trunc(c + r +
    0.5))` clipped to the image, `r = 2 max(s, 1)`; each row is normalised to sum 1 (so the
    taps a border cuts off are redistributed, not clamped). At `in == out` this is the
    identity."""
    scale = in_size / out_size
    support = 2.0 * max(scale, 1.0)
    inv = 1.0 / max(scale, 1.0)
    w = np.zeros((out_size, in_size), np.float64)
    for i in range(out_size):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        j = np.arange(lo, hi)
        k = _keys_cubic((j - center + 0.5) * inv, -0.5)
        w[i, lo:hi] = k / k.sum() if k.sum() != 0 else k
    return w


def resize_bicubic_antialias(x: jax.Array, size: int | tuple[int, int] = RESOLUTION
                             ) -> jax.Array:
    """Antialiased bicubic resize of float `[N, H, W, C]` to `[N, out_h, out_w, C]`
    float32, torch's `interpolate(mode='bicubic', antialias=True)` (see
    `antialias_bicubic_matrix`), as two exact-float32 matrix products. No clipping: values
    may overshoot the input range slightly, as in torch. Raises ValueError unless x is 4-D.
    """
    if x.ndim != 4:
        raise ValueError(f"resize_bicubic_antialias expects NHWC images [N, H, W, C], got "
                         f"shape {x.shape}")
    out_h, out_w = (size, size) if isinstance(size, int) else size
    wh = jnp.asarray(antialias_bicubic_matrix(x.shape[1], out_h), jnp.float32)
    ww = jnp.asarray(antialias_bicubic_matrix(x.shape[2], out_w), jnp.float32)
    x = jnp.einsum("ph,nhwc->npwc", wh, jnp.asarray(x, jnp.float32), precision=HIGHEST)
    return jnp.einsum("qw,npwc->npqc", ww, x, precision=HIGHEST)


def _check_uint8(images) -> None:
    if images.dtype != np.uint8:
        raise ValueError(f"DINOv2 features expect uint8 images, got {images.dtype}; decode "
                         f"[-1, 1] floats with clip(x * 127.5 + 128, 0, 255).astype(uint8)")
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(f"DINOv2 features expect NHWC images with 1 or 3 channels, got shape "
                         f"{images.shape}; transpose NCHW with x.transpose(0, 2, 3, 1)")


def preprocess_uint8(images) -> jax.Array:
    """uint8 RGB `[N, H, W, 3]` (or grayscale `[N, H, W, 1]`) -> float32
    `[N, 224, 224, 3]`: antialiased bicubic resize of the 0..255 values, `/ 255`, ImageNet
    mean/std normalisation (the release's DINOv2Detector, `resize_mode='torch'`).
    Raises ValueError on a non-uint8 dtype or a shape that is not NHWC with 1 or 3 channels.
    """
    _check_uint8(images)
    x = jnp.asarray(images, jnp.float32)
    if x.shape[-1] == 1:
        x = jnp.repeat(x, 3, axis=-1)
    x = resize_bicubic_antialias(x, RESOLUTION) / 255.0
    return (x - jnp.asarray(IMAGENET_MEAN, jnp.float32)) / jnp.asarray(IMAGENET_STD, jnp.float32)


# ----------------------------------------------------------------------------------------
# Position-embedding resampling.

def bicubic_matrix(in_size: int, out_size: int, scale_factor: float | None = None
                   ) -> np.ndarray:
    """Resampling matrix `[out_size, in_size]` (float64) of torch's
    `interpolate(mode='bicubic', align_corners=False, antialias=False)` along one axis:
    output `i` reads source coordinate `t = (i + 0.5) / f - 0.5` with `f = scale_factor`
    when given (torch then uses it, not `out / in`), else `out / in`; four taps
    `floor(t) - 1 .. floor(t) + 2` with Keys' weights (a = -0.75), indices clamped to the
    edge."""
    f = scale_factor if scale_factor is not None else out_size / in_size
    w = np.zeros((out_size, in_size), np.float64)
    for i in range(out_size):
        t = (i + 0.5) / f - 0.5
        t0 = math.floor(t)
        for j in range(t0 - 1, t0 + 3):
            w[i, min(max(j, 0), in_size - 1)] += _keys_cubic(np.float64(t - j), -0.75)
    return w


def interpolate_pos_embed(pos_embed: jax.Array, grid: tuple[int, int],
                          offset: float = 0.1) -> jax.Array:
    """Resample a ViT position embedding to another patch grid, as DINOv2 does.

    Args: pos_embed float `[1, 1 + M*M, D]` (class-token entry first, then the M x M grid
      row-major); grid `(gh, gw)` target patch grid; offset: DINOv2's
      `interpolate_offset` (scale factors `(g + offset) / M`; 0 = resize to `g` exactly).
    Returns: float32 `[1, 1 + gh*gw, D]`; `pos_embed` itself when the grid is `M x M`.
    Raises ValueError when `pos_embed` holds no square grid.
    """
    n, d = pos_embed.shape[1] - 1, pos_embed.shape[2]
    m = math.isqrt(n)
    if m * m != n:
        raise ValueError(f"position embedding of {n} patch entries is not a square grid")
    gh, gw = grid
    if (gh, gw) == (m, m):
        return pos_embed
    mats = [bicubic_matrix(m, g, (g + offset) / m if offset else None) for g in (gh, gw)]
    wh, ww = (jnp.asarray(a, jnp.float32) for a in mats)
    patch = pos_embed[0, 1:].reshape(m, m, d).astype(jnp.float32)
    patch = jnp.einsum("ij,jkd,lk->ild", wh, patch, ww, precision=HIGHEST)
    return jnp.concatenate([pos_embed[:, :1].astype(jnp.float32),
                            patch.reshape(1, gh * gw, d)], axis=1)


# ----------------------------------------------------------------------------------------
# The network (parameter names follow the official checkpoint: blocks_3/attn/qkv is
# `blocks.3.attn.qkv`).

class LayerScale(nn.Module):
    """`x * gamma`, gamma float32 `[D]` (CaiT's layer scale, Touvron et al. 2021)."""

    @nn.compact
    def __call__(self, x):
        return x * self.param("gamma", nn.initializers.constant(1e-5), (x.shape[-1],))


class Attention(nn.Module):
    """Multi-head self-attention, `softmax(q k^T / sqrt(d_head)) v` (Vaswani et al. 2017,
    Eq. 1) with a joint qkv projection. `[N, T, D]` -> `[N, T, D]`."""
    num_heads: int

    @nn.compact
    def __call__(self, x):
        n, t, d = x.shape
        hd = d // self.num_heads
        qkv = nn.Dense(3 * d, precision=HIGHEST, name="qkv")(x)
        q, k, v = jnp.moveaxis(qkv.reshape(n, t, 3, self.num_heads, hd), 2, 0)
        logits = jnp.einsum("nqhc,nkhc->nhqk", q * hd ** -0.5, k, precision=HIGHEST)
        out = jnp.einsum("nhqk,nkhc->nqhc", jax.nn.softmax(logits, axis=-1), v,
                         precision=HIGHEST)
        return nn.Dense(d, precision=HIGHEST, name="proj")(out.reshape(n, t, d))


class Block(nn.Module):
    """Pre-norm transformer block with layer scale:
    `x += ls1(attn(norm1(x))); x += ls2(fc2(gelu(fc1(norm2(x)))))`, GELU exact (erf)."""
    num_heads: int
    mlp_ratio: float
    eps: float

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        norm = functools.partial(nn.LayerNorm, epsilon=self.eps, use_fast_variance=False)
        x = x + LayerScale(name="ls1")(Attention(self.num_heads, name="attn")(
            norm(name="norm1")(x)))
        h = norm(name="norm2")(x)
        h = nn.Dense(int(d * self.mlp_ratio), precision=HIGHEST, name="fc1")(h)
        h = nn.Dense(d, precision=HIGHEST, name="fc2")(nn.gelu(h, approximate=False))
        return x + LayerScale(name="ls2")(h)


class DINOv2ViT(nn.Module):
    """DINOv2 vision transformer (Oquab et al. 2023; Dosovitskiy et al. 2021 ViT).

    Input: float `[N, H, W, 3]` NHWC, already normalised (see `preprocess_uint8`); H, W
    multiples of `patch_size` (a remainder is cropped off by the strided patch conv, as in
    torch). Output: float32 `[N, embed_dim]`, the class token after the final LayerNorm
    (the release's FD_DINOv2 feature)."""
    config: ViTConfig = VITL14

    @nn.compact
    def __call__(self, x):
        c = self.config
        p, d = c.patch_size, c.embed_dim
        x = nn.Conv(d, (p, p), strides=(p, p), padding="VALID", precision=HIGHEST,
                    name="patch_embed")(jnp.asarray(x, jnp.float32))
        n, gh, gw, _ = x.shape
        cls = self.param("cls_token", nn.initializers.normal(1e-6), (1, 1, d))
        pos = self.param("pos_embed", nn.initializers.normal(0.02), (1, 1 + c.pos_grid ** 2, d))
        x = jnp.concatenate([jnp.broadcast_to(cls, (n, 1, d)), x.reshape(n, gh * gw, d)], 1)
        x = x + interpolate_pos_embed(pos, (gh, gw), c.interpolate_offset)
        for i in range(c.depth):
            x = Block(c.num_heads, c.mlp_ratio, c.layer_norm_eps, name=f"blocks_{i}")(x)
        x = nn.LayerNorm(epsilon=c.layer_norm_eps, use_fast_variance=False, name="norm")(x)
        return x[:, 0]


@functools.partial(jax.jit, static_argnames=("config",))
def _features_uint8(params, images, config):
    return DINOv2ViT(config).apply({"params": params}, preprocess_uint8(images))


@dataclasses.dataclass
class DINOv2:
    """A DINOv2 network with its weights. `features_uint8(images)`: uint8 `[N, H, W, 3|1]`
    -> float32 `[N, embed_dim]` (resize to 224x224 and normalise, then the network)."""
    config: ViTConfig
    params: Any
    path: str = ""

    @property
    def feature_dim(self) -> int:
        return self.config.embed_dim

    def features_uint8(self, images) -> jax.Array:
        """FD_DINOv2 features of uint8 images (see the module docstring). Raises
        ValueError on a non-uint8 dtype or a shape that is not NHWC with 1 or 3 channels."""
        images = jnp.asarray(images)
        _check_uint8(images)
        return _features_uint8(self.params, images, self.config)


def features_uint8(net: DINOv2, images) -> jax.Array:
    """`net.features_uint8(images)`, in the `(params, images)` form of
    `fid.stats_from_images`'s `feature_fn`."""
    return net.features_uint8(images)


# ----------------------------------------------------------------------------------------
# Weights.

def read_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a DINOv2 weights file as `{name: float32 ndarray}` in torch layout
    (`encoders.torch_weights.read_state_dict`: `.safetensors`, a `torch.save` zip archive
    or a legacy torch file, read without torch), the chunked block layout
    renamed to the plain one. Raises FileNotFoundError, ImportError naming the package to
    install, or ValueError for a file that is corrupt or holds no state dict of tensors
    (naming the file and where to download a good one)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"DINOv2 weights file {path} not found; download "
                                f"{WEIGHTS_URL} and pass its path with --dinov2=PATH")
    sd = torch_weights.read_state_dict(path, _corrupt)
    # DINOv2's chunked block layout (block_chunks > 0) numbers blocks globally inside
    # each chunk: blocks.<chunk>.<i>.* is block i.
    return {re.sub(r"^blocks\.\d+\.(\d+)\.", r"blocks.\1.", k): v for k, v in sd.items()}


def _corrupt(path: Path, expected: str, e: BaseException) -> ValueError:
    """The error for a weights file its reader refuses: named, with a good one's source."""
    why = " ".join(str(e).split())[:300].split(". ")[0] or type(e).__name__
    return ValueError(f"--dinov2={path} is corrupt or not a DINOv2 checkpoint (not {expected}: "
                      f"{type(e).__name__}: {why}); download {WEIGHTS_URL} again (or timm's "
                      f"vit_large_patch14_dinov2 model.safetensors) and pass it with "
                      f"--dinov2=PATH")


_IGNORED = ("mask_token",)  # used by DINOv2's masked-image training only


def config_from_state_dict(sd: dict[str, np.ndarray], source: str = "state dict") -> ViTConfig:
    """The `ViTConfig` of a DINOv2 state dict (head width 64, as every DINOv2 model has).
    Raises ValueError naming what is wrong for a file of another network (transformers'
    layout, register tokens, the SwiGLU MLP of ViT-g)."""
    if any(k.startswith(("embeddings.", "encoder.layer.")) for k in sd):
        raise ValueError(f"{source} is in Hugging Face transformers' layout (embeddings.*, "
                         f"encoder.layer.*); use the official {WEIGHTS_URL.rsplit('/', 1)[1]} "
                         f"or timm's vit_large_patch14_dinov2 model.safetensors")
    if "register_tokens" in sd or "reg_token" in sd:
        raise ValueError(f"{source} is a DINOv2 model with register tokens; FD_DINOv2 uses "
                         f"the plain dinov2_vitl14 ({WEIGHTS_URL})")
    if any(".mlp.w12." in k for k in sd):
        raise ValueError(f"{source} uses the SwiGLU MLP (ViT-g/14), which this port does not "
                         f"implement; FD_DINOv2 uses dinov2_vitl14 ({WEIGHTS_URL})")
    try:
        w = sd["patch_embed.proj.weight"]
        pos = sd["pos_embed"]
        fc1 = sd["blocks.0.mlp.fc1.weight"]
    except KeyError as e:
        raise ValueError(f"{source} is not a DINOv2 ViT state dict: no {e.args[0]!r} "
                         f"(found {sorted(sd)[:6]}...)") from None
    depth = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k)))
    d = int(w.shape[0])
    grid = math.isqrt(pos.shape[1] - 1)
    return ViTConfig(patch_size=int(w.shape[2]), embed_dim=d, depth=depth,
                     num_heads=max(d // 64, 1), mlp_ratio=fc1.shape[0] / d, pos_grid=grid)


def params_from_state_dict(sd: dict[str, np.ndarray], config: ViTConfig,
                           source: str = "state dict") -> dict:
    """Torch-layout tensors -> the `DINOv2ViT(config)` params tree (Linear weights
    transposed to `[in, out]`, the patch conv OIHW -> HWIO, LayerNorm weight -> scale).
    Raises ValueError listing missing, unexpected or mis-shaped tensors."""
    expected = jax.eval_shape(lambda: DINOv2ViT(config).init(
        jax.random.PRNGKey(0), jnp.zeros((1, config.patch_size, config.patch_size, 3))))
    flat_expected = {"/".join(k.key for k in path): leaf.shape for path, leaf
                     in jax.tree_util.tree_flatten_with_path(expected["params"])[0]}
    params, missing, bad_shape, used = {}, [], [], set()
    for key, shape in flat_expected.items():
        *mods, leaf = key.split("/")
        torch_mods = [m.replace("blocks_", "blocks.") for m in mods]
        if torch_mods and torch_mods[-1] in ("fc1", "fc2"):
            torch_mods.insert(-1, "mlp")
        if torch_mods == ["patch_embed"]:
            torch_mods = ["patch_embed", "proj"]
        torch_leaf = {"kernel": "weight", "scale": "weight"}.get(leaf, leaf)
        name = ".".join(torch_mods + [torch_leaf])
        if name not in sd:
            missing.append(name)
            continue
        used.add(name)
        value = sd[name]
        if leaf == "kernel":
            value = value.transpose(2, 3, 1, 0) if value.ndim == 4 else value.T
        if value.shape != tuple(shape):
            bad_shape.append(f"{name} {sd[name].shape}")
            continue
        node = params
        for m in mods:
            node = node.setdefault(m, {})
        node[leaf] = jnp.asarray(value, jnp.float32)
    unexpected = sorted(set(sd) - used - set(_IGNORED))
    if missing or bad_shape or unexpected:
        parts = [f"{what} ({len(v)}): {', '.join(v[:4])}{' ...' if len(v) > 4 else ''}"
                 for what, v in (("missing", missing), ("wrong shape", bad_shape),
                                 ("unexpected", unexpected)) if v]
        raise ValueError(f"{source} does not match a DINOv2 ViT of {config}: "
                         + "; ".join(parts) + f". Expected the official {WEIGHTS_URL}")
    return params


def weights_path(path: str | os.PathLike | None = None) -> Path:
    """`path`, else `$EDM2_DINOV2_WEIGHTS`. Raises FileNotFoundError naming the download
    and the flag when neither is given or the file does not exist."""
    path = path or os.environ.get(WEIGHTS_ENV) or None
    if path is None:
        raise FileNotFoundError(f"FD_DINOv2 needs the DINOv2 ViT-L/14 weights: download "
                                f"{WEIGHTS_URL} and pass --dinov2=PATH (in a training "
                                f"config: eval.dinov2=PATH; or set {WEIGHTS_ENV})")
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"DINOv2 weights file {path} not found; download "
                                f"{WEIGHTS_URL} and pass its path with --dinov2=PATH")
    return path


@functools.lru_cache(maxsize=2)
def _load_cached(path: str) -> DINOv2:
    sd = read_state_dict(path)
    config = config_from_state_dict(sd, path)
    return DINOv2(config, jax.device_put(params_from_state_dict(sd, config, path)), path)


def load_dinov2(path: str | os.PathLike | None = None, require_vitl14: bool = True) -> DINOv2:
    """Load DINOv2 weights (see the module docstring for the formats) as a `DINOv2`.

    Args: path: the weights file (default `$EDM2_DINOV2_WEIGHTS`); require_vitl14: refuse
      other geometries (FD_DINOv2 is defined with ViT-L/14; tests load small ones).
    Returns: `DINOv2` with float32 params, cached per path.
    Raises FileNotFoundError naming the download and `--dinov2`, ValueError for a file of
    another network or with missing / mis-shaped tensors.
    """
    net = _load_cached(str(weights_path(path).resolve()))
    c = net.config
    if require_vitl14 and (c.patch_size, c.embed_dim, c.depth) != (14, FEATURE_DIM, 24):
        raise ValueError(f"{net.path} is a DINOv2 ViT of width {c.embed_dim}, depth {c.depth}, "
                         f"patch {c.patch_size}; FD_DINOv2 is defined with ViT-L/14 (1024, "
                         f"24, 14): use {WEIGHTS_URL}")
    return net


__all__ = ["DINOv2", "DINOv2ViT", "FEATURE_DIM", "VITL14", "ViTConfig",
           "antialias_bicubic_matrix", "bicubic_matrix", "config_from_state_dict",
           "features_uint8", "interpolate_pos_embed", "load_dinov2", "params_from_state_dict",
           "preprocess_uint8", "read_state_dict", "resize_bicubic_antialias", "weights_path"]
