"""The EDM2 U-Net (paper Figure 21) and EDM preconditioning with learned uncertainty.

NHWC throughout. Parameter tree of `Precond` (names mirror the authors' release so
that `convert.py` is a renaming, not a re-derivation):

    params['unet']['out_gain']                              scalar
    params['unet']['emb_noise' | 'emb_label']['weight']     [in, out]
    params['unet']['enc_16x16_conv']['weight']              [3, 3, C+1, ch]
    params['unet']['enc_8x8_block0']['conv_res0']['weight'] [3, 3, in, out]
    params['unet']['dec_8x8_in0']['attn_qkv']['weight']     [1, 1, out, 3*out]
    params['logvar_linear']['weight']                       [128, 1]
    buffers['unet']['emb_fourier']['freqs' | 'phases'], buffers['logvar_fourier'][...]

The `attn_qkv` output channels are laid out [head][channel-in-head][q, k, v], as in
the release.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import flax.linen as nn

from edm2_jax.mp import (MPConv, MPFourier, mp_cat, mp_silu, mp_sum, normalize,
                         pixel_norm, resample)

Array = jax.Array


class Block(nn.Module):
    """Encoder or decoder block of the EDM2 U-Net (Figure 21).

    Call: `x` `[N, H, W, in]` float32, `emb` `[N, emb_channels]`, `train` enables
    dropout (needs the `'dropout'` rng) -> `[N, H', W', out]` float32, clipped to
    `[-clip_act, clip_act]`.
    """

    in_channels: int
    out_channels: int
    emb_channels: int
    flavor: str = "enc"                 # 'enc' or 'dec'
    resample_mode: str = "keep"         # 'keep', 'down' or 'up'
    attention: bool = False
    channels_per_head: int = 64
    dropout: float = 0.0
    res_balance: float = 0.3
    attn_balance: float = 0.3
    clip_act: float | None = 256
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array, emb: Array, train: bool = False) -> Array:
        cin, cout = self.in_channels, self.out_channels
        if self.flavor not in ("enc", "dec"):
            raise ValueError(f"Block.flavor must be 'enc' or 'dec', got {self.flavor!r}")
        x = resample(x, self.resample_mode)
        if self.flavor == "enc":
            if cin != cout:
                x = MPConv(cin, cout, (1, 1), self.dtype, name="conv_skip")(x)
            x = pixel_norm(x)

        # Residual branch.
        y = MPConv(cout if self.flavor == "enc" else cin, cout, (3, 3), self.dtype,
                   name="conv_res0")(mp_silu(x))
        emb_gain = self.param("emb_gain", nn.initializers.zeros, (), jnp.float32)
        # The embedding path stays float32 whatever `dtype` is, as the release's fp16 mode
        # keeps it (a [N, cemb] x [cemb, cout] matmul: negligible cost).
        c = MPConv(self.emb_channels, cout, (), jnp.float32, name="emb_linear")(emb, gain=emb_gain) + 1
        y = mp_silu(y * c[:, None, None, :])
        if train and self.dropout > 0:
            y = nn.Dropout(self.dropout, deterministic=False)(y)
        y = MPConv(cout, cout, (3, 3), self.dtype, name="conv_res1")(y)

        if self.flavor == "dec" and cin != cout:
            x = MPConv(cin, cout, (1, 1), self.dtype, name="conv_skip")(x)
        x = mp_sum(x, y, self.res_balance)

        # As in the release, heads = out // channels_per_head; zero heads = no attention.
        if self.attention and cout // self.channels_per_head > 0:
            x = mp_sum(x, self._attention(x), self.attn_balance)
        if self.clip_act:
            x = jnp.clip(x, -self.clip_act, self.clip_act)
        return x

    def _attention(self, x: Array) -> Array:
        """Multi-head self-attention with cosine (pixel-normalised) q, k, v."""
        n, h, w, c = x.shape
        heads = c // self.channels_per_head
        if c % heads:
            raise ValueError(f"attention: {c} channels do not split into {heads} heads of "
                             f"channels_per_head={self.channels_per_head}; change channels_per_head")
        cph = c // heads
        qkv = MPConv(c, 3 * c, (1, 1), self.dtype, name="attn_qkv")(x)
        qkv = normalize(qkv.reshape(n, h * w, heads, cph, 3), axis=3)
        q, k, v = (qkv[..., i].astype(self.dtype) for i in range(3))
        logits = jnp.einsum("nqhc,nkhc->nhqk", q, k / jnp.asarray(math.sqrt(cph), self.dtype),
                            preferred_element_type=jnp.float32)
        weights = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
        y = jnp.einsum("nhqk,nkhc->nqhc", weights, v, preferred_element_type=jnp.float32)
        return MPConv(c, c, (1, 1), self.dtype, name="attn_proj")(y.reshape(n, h, w, c))


class UNet(nn.Module):
    """EDM2 U-Net, config G of the paper (Figure 21). Raw network `F`.

    Call: `x` `[N, H, W, img_channels]`, `c_noise` `[N]`, `labels` `[N, label_dim]`
    one-hot (or None when `label_dim == 0`) -> `[N, H, W, img_channels]` float32.
    """

    img_resolution: int
    img_channels: int
    label_dim: int = 0
    model_channels: int = 192
    channel_mult: Sequence[int] = (1, 2, 3, 4)
    channel_mult_noise: int | None = None
    channel_mult_emb: int | None = None
    num_blocks: int = 3
    attn_resolutions: Sequence[int] = (16, 8)
    label_balance: float = 0.5
    concat_balance: float = 0.5
    channels_per_head: int = 64
    dropout: float = 0.0
    res_balance: float = 0.3
    attn_balance: float = 0.3
    clip_act: float | None = 256
    dtype: Any = jnp.float32

    def setup(self):
        mc = self.model_channels
        cblock = [mc * m for m in self.channel_mult]
        cnoise = mc * self.channel_mult_noise if self.channel_mult_noise else cblock[0]
        cemb = mc * self.channel_mult_emb if self.channel_mult_emb else max(cblock)
        bkw = dict(emb_channels=cemb, channels_per_head=self.channels_per_head,
                   dropout=self.dropout, res_balance=self.res_balance,
                   attn_balance=self.attn_balance, clip_act=self.clip_act, dtype=self.dtype)

        self.out_gain = self.param("out_gain", nn.initializers.zeros, (), jnp.float32)
        self.emb_fourier = MPFourier(cnoise)
        # Noise/label embedding in float32 whatever `dtype` is (as the release's fp16 mode).
        self.emb_noise = MPConv(cnoise, cemb, (), jnp.float32)
        self.emb_label = MPConv(self.label_dim, cemb, (), jnp.float32) if self.label_dim else None

        # Encoder. Names follow the release: '{res}x{res}_{conv|down|blockN}'.
        enc, skips = {}, []
        cout = self.img_channels + 1
        for level, channels in enumerate(cblock):
            res = self.img_resolution >> level
            if level == 0:
                cin, cout = cout, channels
                enc[f"{res}x{res}_conv"] = MPConv(cin, cout, (3, 3), self.dtype)
            else:
                enc[f"{res}x{res}_down"] = Block(cout, cout, flavor="enc", resample_mode="down", **bkw)
            skips.append(cout)
            for idx in range(self.num_blocks):
                cin, cout = cout, channels
                enc[f"{res}x{res}_block{idx}"] = Block(
                    cin, cout, flavor="enc", attention=res in self.attn_resolutions, **bkw)
                skips.append(cout)

        # Decoder.
        dec = {}
        for level, channels in reversed(list(enumerate(cblock))):
            res = self.img_resolution >> level
            if level == len(cblock) - 1:
                dec[f"{res}x{res}_in0"] = Block(cout, cout, flavor="dec", attention=True, **bkw)
                dec[f"{res}x{res}_in1"] = Block(cout, cout, flavor="dec", **bkw)
            else:
                dec[f"{res}x{res}_up"] = Block(cout, cout, flavor="dec", resample_mode="up", **bkw)
            for idx in range(self.num_blocks + 1):
                cin, cout = cout + skips.pop(), channels
                dec[f"{res}x{res}_block{idx}"] = Block(
                    cin, cout, flavor="dec", attention=res in self.attn_resolutions, **bkw)
        self.enc = enc
        self.dec = dec
        self.enc_order = list(enc)  # dict attributes may be re-ordered by flax
        self.dec_order = list(dec)
        self.out_conv = MPConv(cout, self.img_channels, (3, 3), self.dtype)

    def __call__(self, x: Array, c_noise: Array, labels: Array | None = None,
                 train: bool = False) -> Array:
        emb = self.emb_noise(self.emb_fourier(c_noise))
        if self.emb_label is not None:
            if labels is None:
                raise ValueError(f"UNet with label_dim={self.label_dim} needs labels [N, {self.label_dim}]")
            labels = labels.astype(jnp.float32)
            emb = mp_sum(emb, self.emb_label(labels * math.sqrt(labels.shape[-1])),
                         self.label_balance)
        emb = mp_silu(emb)

        x = jnp.concatenate([x, jnp.ones_like(x[..., :1])], axis=-1)
        skips = []
        for name in self.enc_order:
            block = self.enc[name]
            x = block(x) if name.endswith("_conv") else block(x, emb, train)
            skips.append(x)
        for name in self.dec_order:
            block = self.dec[name]
            if "_block" in name:
                x = mp_cat(x, skips.pop(), self.concat_balance)
            x = block(x, emb, train)
        return self.out_conv(x, gain=self.out_gain)


class Precond(nn.Module):
    """EDM preconditioning (Karras et al. 2022, Table 1) around the EDM2 U-Net, with
    the learned uncertainty head of EDM2 (Sec. 2, Eq. 21 of the paper's appendix).

    `D(x, sigma) = c_skip x + c_out F(c_in x, c_noise, labels)` with
    `c_skip = sd^2 / (sigma^2 + sd^2)`, `c_out = sigma sd / sqrt(sigma^2 + sd^2)`,
    `c_in = 1 / sqrt(sd^2 + sigma^2)`, `c_noise = ln(sigma) / 4`, `sd = sigma_data`.
    `logvar(sigma) = MPConv_dense(MPFourier(logvar_channels)(c_noise))`.

    Call: `x` `[N, H, W, C]`, `sigma` `[N]` or scalar (> 0), `labels` `[N, label_dim]`
    (None -> zeros when the net is conditional, i.e. the unconditional slot), `train`
    (dropout), `return_logvar` -> `D` `[N, H, W, C]` float32 (and `logvar` `[N]` float32).
    Preconditioning and the output are float32 whatever `dtype` is.
    """

    img_resolution: int
    img_channels: int
    label_dim: int = 0
    model_channels: int = 192
    channel_mult: Sequence[int] = (1, 2, 3, 4)
    channel_mult_noise: int | None = None
    channel_mult_emb: int | None = None
    num_blocks: int = 3
    attn_resolutions: Sequence[int] = (16, 8)
    label_balance: float = 0.5
    concat_balance: float = 0.5
    channels_per_head: int = 64
    dropout: float = 0.0
    res_balance: float = 0.3
    attn_balance: float = 0.3
    clip_act: float | None = 256
    sigma_data: float = 0.5
    logvar_channels: int = 128
    dtype: Any = jnp.float32

    def setup(self):
        self.unet = UNet(
            img_resolution=self.img_resolution, img_channels=self.img_channels,
            label_dim=self.label_dim, model_channels=self.model_channels,
            channel_mult=tuple(self.channel_mult), channel_mult_noise=self.channel_mult_noise,
            channel_mult_emb=self.channel_mult_emb, num_blocks=self.num_blocks,
            attn_resolutions=tuple(self.attn_resolutions), label_balance=self.label_balance,
            concat_balance=self.concat_balance, channels_per_head=self.channels_per_head,
            dropout=self.dropout, res_balance=self.res_balance, attn_balance=self.attn_balance,
            clip_act=self.clip_act, dtype=self.dtype)
        self.logvar_fourier = MPFourier(self.logvar_channels)
        self.logvar_linear = MPConv(self.logvar_channels, 1, (), jnp.float32)

    def __call__(self, x: Array, sigma: Array, labels: Array | None = None,
                 train: bool = False, return_logvar: bool = False):
        x = x.astype(jnp.float32)
        sigma = jnp.broadcast_to(jnp.asarray(sigma, jnp.float32).reshape(-1), (x.shape[0],))
        if self.label_dim:
            if labels is None:
                labels = jnp.zeros((x.shape[0], self.label_dim), jnp.float32)
            labels = jnp.asarray(labels, jnp.float32).reshape(x.shape[0], self.label_dim)
        else:
            labels = None
        c_skip, c_out, c_in, c_noise = precond_coefficients(sigma, self.sigma_data, x.ndim)
        F_x = self.unet(c_in * x, c_noise, labels, train)
        D_x = c_skip * x + c_out * F_x.astype(jnp.float32)
        if not return_logvar:
            return D_x
        logvar = self.logvar_linear(self.logvar_fourier(c_noise))[:, 0]
        return D_x, logvar


def precond_coefficients(sigma: Array, sigma_data: float, ndim: int):
    """EDM preconditioning coefficients (docs/recipe.md §3; paper Appendix B.6).

    `sigma` `[N]` float32 (> 0) -> `(c_skip, c_out, c_in, c_noise)`: the first three of
    shape `[N, 1, ..., 1]` with `ndim` axes (to broadcast against an `ndim`-axis input),
    `c_noise = ln(sigma) / 4` of shape `[N]`. `c_skip = sd^2 / (sigma^2 + sd^2)`,
    `c_out = sigma sd / sqrt(sigma^2 + sd^2)`, `c_in = 1 / sqrt(sd^2 + sigma^2)`.
    """
    sd = sigma_data
    s = sigma.reshape(sigma.shape + (1,) * (ndim - 1))
    c_skip = sd**2 / (s**2 + sd**2)
    c_out = s * sd / jnp.sqrt(s**2 + sd**2)
    c_in = 1 / jnp.sqrt(sd**2 + s**2)
    return c_skip, c_out, c_in, jnp.log(sigma) / 4


def precond_from_config(net_cfg: Any, dtype: Any = None) -> Precond:
    """Build a `Precond` from a network config (mapping or ConfigDict with the field
    names of `Precond`). Unknown keys raise `ValueError` naming them."""
    fields = {f for f in Precond.__dataclass_fields__ if f not in ("parent", "name")}
    kw = dict(net_cfg)
    unknown = sorted(set(kw) - fields)
    if unknown:
        raise ValueError(f"unknown network config fields {unknown}; valid: {sorted(fields)}")
    for k in ("channel_mult", "attn_resolutions"):
        if k in kw:
            kw[k] = tuple(kw[k])
    if dtype is not None:
        kw["dtype"] = dtype
    elif isinstance(kw.get("dtype"), str):
        kw["dtype"] = jnp.dtype(kw["dtype"])
    return Precond(**kw)


def init_variables(net: Precond, rng: Array, batch: int = 1) -> dict:
    """Initialise `{'params', 'buffers'}` of `net` on dummy inputs of batch `batch`."""
    x = jnp.zeros((batch, net.img_resolution, net.img_resolution, net.img_channels), jnp.float32)
    sigma = jnp.ones((batch,), jnp.float32)
    labels = jnp.zeros((batch, net.label_dim), jnp.float32) if net.label_dim else None
    init = jax.jit(lambda r: net.init({"params": r}, x, sigma, labels, return_logvar=True))
    return dict(init(rng))  # jitted: eager init dispatches thousands of small ops


def count_params(net: Precond, include_buffers: bool = False) -> int:
    """Number of trainable parameters of `net` from `jax.eval_shape` (nothing allocated)."""
    shapes = jax.eval_shape(lambda r: init_variables(net, r), jax.random.PRNGKey(0))
    cols = ["params"] + (["buffers"] if include_buffers else [])
    return sum(math.prod(l.shape) for c in cols for l in jax.tree_util.tree_leaves(shapes[c]))
