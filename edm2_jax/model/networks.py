"""The EDM2 U-Net (paper Figure 21) and EDM preconditioning with learned uncertainty.

NHWC throughout. Parameter tree of `Precond` (names mirror the authors' release so
that `release/convert.py` is a renaming, not a re-derivation):

    params['unet']['out_gain']                              scalar
    params['unet']['emb_noise' | 'emb_label']['weight']     [in, out]
    params['unet']['enc_16x16_conv']['weight']              [3, 3, C+1, ch]
    params['unet']['enc_8x8_block0']['conv_res0']['weight'] [3, 3, in, out]
    params['unet']['dec_8x8_in0']['attn_qkv']['weight']     [1, 1, out, 3*out]
    params['logvar_linear']['weight']                       [128, 1]
    buffers['unet']['emb_fourier']['freqs' | 'phases'], buffers['logvar_fourier'][...]

The `attn_qkv` output channels are laid out [head][channel-in-head][q, k, v], as in
the release.

Each hyperparameter is declared once, with the release's name and default: `BlockFields`
(what every block shares) and `UNetFields` (the U-Net's own) are inherited by `Block`,
`UNet` and `Precond`, so `Precond(**cfg)` takes the flat names of a config.json
`network` or a network.json (`CONFIG_FIELDS`). The field `kernels` (`mp.Kernels`) is how
the network is computed, never part of its config: the model's own math by default, a
backend's set from `edm2_jax.backends` (the same function).

The paper's ablation (Sec. 2, Table 1) as three switches of the one network, their
defaults being config G (the release; bit-identical to the network without them). The
fourth, forced weight normalisation with the learning-rate decay (D -> E), is the
training step's (`config.optim.forced_wn`, `config.optim.t_ref`). docs/ablation.md.

    mp_learned_layers  C -> D  Sec. 2.2 "magnitude-preserving learned layers": every conv
                       and dense layer normalises its weight in the forward pass (MPConv,
                       Eq. 47/66); False = standard bias-free layers, He uniform init.
    group_norm         E -> F  Sec. 2.4 "removing group normalizations": True = a group
                       norm (mean-free, no learned scale, as config C) before both 3x3
                       convs of each block's residual branch and before the output conv
                       (followed by SiLU there), and no pixel norm of the encoder's main
                       path; False = the pixel norm of F/G. F also weakens the residual
                       path (`res_balance` 0.3, 0.5 in C-E; a separate field).
    mp_fixed_layers    F -> G  Sec. 2.5 "magnitude-preserving fixed-function layers":
                       MP SiLU (Eq. 81), MP sum (Eq. 88), MP concat (Eq. 103), MP Fourier
                       features (Eq. 75), the zero-initialised learned gains of the output
                       (`out_gain`) and of the embedding (`emb_gain`); False = SiLU,
                       `plain_sum`, `plain_cat`, cos features, no gains (those two
                       parameters do not exist).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import flax.linen as nn

from edm2_jax.model.mp import (MODEL_MATH, Kernels, MPConv, MPFourier, group_rms_norm, mp_cat,
                               mp_sum, normalize, pixel_norm, plain_cat, plain_sum, resample)

Array = jax.Array


# The U-Net's hyperparameters, each declared once (release names and defaults).

class BlockFields(nn.Module):
    """The hyperparameters every block shares; `Block`, `UNet` and `Precond` inherit them
    (keyword-only). `kernels` is the backend's kernel set (`mp.Kernels`, default the
    model's own math); it is how the network is computed, not part of its config."""

    _: dataclasses.KW_ONLY
    channels_per_head: int = 64
    dropout: float = 0.0
    res_balance: float = 0.3
    attn_balance: float = 0.3
    clip_act: float | None = 256
    dtype: Any = jnp.float32
    mp_learned_layers: bool = True      # the ablation's switches (module docstring)
    group_norm: bool = False
    mp_fixed_layers: bool = True
    kernels: Kernels = MODEL_MATH


class UNetFields(BlockFields):
    """The U-Net's own hyperparameters on top of `BlockFields`; `UNet` and `Precond`
    inherit them."""

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


def fields_of(module: nn.Module, cls: type) -> dict:
    """`{name: value}` of `module` for the fields `cls` declares (an ancestor of it)."""
    return {f.name: getattr(module, f.name) for f in dataclasses.fields(cls)
            if f.name not in ("parent", "name")}


# Encoder and decoder blocks (Figure 21).

class Block(BlockFields):
    """Encoder or decoder block of the EDM2 U-Net (Figure 21).

    Call: `x` `[N, H, W, in]`, `emb` `[N, emb_channels]` float32, `train` enables
    dropout (needs the `'dropout'` rng) -> `[N, H', W', out]` of the compute `dtype`,
    clipped to `[-clip_act, clip_act]`. The activations are `dtype` throughout; the
    embedding's per-channel scale is computed in float32 and cast to `dtype` where it
    multiplies them (the precision policy, docs/recipe.md).
    """

    in_channels: int
    out_channels: int
    emb_channels: int
    flavor: str = "enc"                 # 'enc' or 'dec'
    resample_mode: str = "keep"         # 'keep', 'down' or 'up'
    attention: bool = False

    def _conv(self, cin: int, cout: int, kernel: tuple, name: str, dtype: Any = None) -> MPConv:
        return MPConv(cin, cout, kernel, self.dtype if dtype is None else dtype,
                      normalize_weight=self.mp_learned_layers, conv=self.kernels.conv, name=name)

    @nn.compact
    def __call__(self, x: Array, emb: Array, train: bool = False) -> Array:
        cin, cout = self.in_channels, self.out_channels
        if self.flavor not in ("enc", "dec"):
            raise ValueError(f"Block.flavor must be 'enc' or 'dec', got {self.flavor!r}")
        act = self.kernels.mp_silu if self.mp_fixed_layers else jax.nn.silu
        add = mp_sum if self.mp_fixed_layers else plain_sum
        x = resample(x, self.resample_mode)
        if self.flavor == "enc":
            if cin != cout:
                x = self._conv(cin, cout, (1, 1), "conv_skip")(x)
            if not self.group_norm:
                x = pixel_norm(x)

        # Residual branch.
        y = self._conv(cout if self.flavor == "enc" else cin, cout, (3, 3), "conv_res0")(
            act(group_rms_norm(x) if self.group_norm else x))
        # The embedding path stays float32 whatever `dtype` is, as the release's fp16 mode
        # keeps it (a [N, cemb] x [cemb, cout] matmul: negligible cost).
        emb_linear = self._conv(self.emb_channels, cout, (), "emb_linear", jnp.float32)
        if self.mp_fixed_layers:
            emb_gain = self.param("emb_gain", nn.initializers.zeros, (), jnp.float32)
            c = emb_linear(emb, gain=emb_gain) + 1
        else:
            c = emb_linear(emb) + 1
        if self.group_norm:
            y = group_rms_norm(y)
        y = act(y * c[:, None, None, :].astype(y.dtype))
        if train and self.dropout > 0:
            y = nn.Dropout(self.dropout, deterministic=False)(y)
        y = self._conv(cout, cout, (3, 3), "conv_res1")(y)

        if self.flavor == "dec" and cin != cout:
            x = self._conv(cin, cout, (1, 1), "conv_skip")(x)
        x = add(x, y, self.res_balance)

        # As in the release, heads = out // channels_per_head; zero heads = no attention.
        if self.attention and cout // self.channels_per_head > 0:
            x = add(x, self._attention(x), self.attn_balance)
        if self.clip_act:
            x = self.kernels.clip_act(x, float(self.clip_act))
        return x

    def _attention(self, x: Array) -> Array:
        """Multi-head self-attention with cosine (pixel-normalised) q, k, v."""
        n, h, w, c = x.shape
        heads = c // self.channels_per_head
        if c % heads:
            raise ValueError(f"attention: {c} channels do not split into {heads} heads of "
                             f"channels_per_head={self.channels_per_head}; change channels_per_head")
        cph = c // heads
        qkv = self._conv(c, 3 * c, (1, 1), "attn_qkv")(x)
        qkv = normalize(qkv.reshape(n, h * w, heads, cph, 3), axis=3)
        q, k, v = (qkv[..., i].astype(self.dtype) for i in range(3))
        y = self.kernels.attention(q, k, v)   # `mp.attention`: in `dtype`
        return self._conv(c, c, (1, 1), "attn_proj")(y.reshape(n, h, w, c))


# The U-Net (Figure 21).

class UNet(UNetFields):
    """EDM2 U-Net, config G of the paper (Figure 21), or C-F by the switches of the module
    docstring. Raw network `F`.

    Call: `x` `[N, H, W, img_channels]`, `c_noise` `[N]`, `labels` `[N, label_dim]`
    one-hot (or None when `label_dim == 0`) -> `[N, H, W, img_channels]` of the compute
    `dtype` (the embedding is float32 whatever `dtype` is; docs/recipe.md, "Precision").
    """

    def setup(self):
        mc = self.model_channels
        cblock = [mc * m for m in self.channel_mult]
        cnoise = mc * self.channel_mult_noise if self.channel_mult_noise else cblock[0]
        cemb = mc * self.channel_mult_emb if self.channel_mult_emb else max(cblock)
        bkw = dict(fields_of(self, BlockFields), emb_channels=cemb)
        nw = dict(normalize_weight=self.mp_learned_layers, conv=self.kernels.conv)

        if self.mp_fixed_layers:
            self.out_gain = self.param("out_gain", nn.initializers.zeros, (), jnp.float32)
        self.emb_fourier = MPFourier(cnoise, magnitude_preserving=self.mp_fixed_layers)
        # Noise/label embedding in float32 whatever `dtype` is (as the release's fp16 mode).
        self.emb_noise = MPConv(cnoise, cemb, (), jnp.float32, **nw)
        self.emb_label = MPConv(self.label_dim, cemb, (), jnp.float32, **nw) if self.label_dim else None

        # Encoder. Names follow the release: '{res}x{res}_{conv|down|blockN}'.
        enc, skips = {}, []
        cout = self.img_channels + 1
        for level, channels in enumerate(cblock):
            res = self.img_resolution >> level
            if level == 0:
                cin, cout = cout, channels
                enc[f"{res}x{res}_conv"] = MPConv(cin, cout, (3, 3), self.dtype, **nw)
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
        self.out_conv = MPConv(cout, self.img_channels, (3, 3), self.dtype, **nw)

    def __call__(self, x: Array, c_noise: Array, labels: Array | None = None,
                 train: bool = False) -> Array:
        act, add, cat = ((self.kernels.mp_silu, mp_sum, mp_cat) if self.mp_fixed_layers
                         else (jax.nn.silu, plain_sum, plain_cat))
        emb = self.emb_noise(self.emb_fourier(c_noise))
        if self.emb_label is not None:
            if labels is None:
                raise ValueError(f"UNet with label_dim={self.label_dim} needs labels [N, {self.label_dim}]")
            labels = labels.astype(jnp.float32)
            emb = add(emb, self.emb_label(labels * math.sqrt(labels.shape[-1])),
                      self.label_balance)
        emb = act(emb)

        x = jnp.concatenate([x, jnp.ones_like(x[..., :1])], axis=-1)
        skips = []
        for name in self.enc_order:
            block = self.enc[name]
            x = block(x) if name.endswith("_conv") else block(x, emb, train)
            skips.append(x)
        for name in self.dec_order:
            block = self.dec[name]
            if "_block" in name:
                x = cat(x, skips.pop(), self.concat_balance)
            x = block(x, emb, train)
        if self.group_norm:
            x = act(group_rms_norm(x))
        if not self.mp_fixed_layers:
            return self.out_conv(x)
        return self.out_conv(x, gain=self.out_gain)


# EDM preconditioning with the learned uncertainty (EDM Table 1; EDM2 Sec. 2).

class Precond(UNetFields):
    """EDM preconditioning (Karras et al. 2022, Table 1) around the EDM2 U-Net, with
    the learned uncertainty head of EDM2 (Sec. 2, Eq. 21 of the paper's appendix).

    `D(x, sigma) = c_skip x + c_out F(c_in x, c_noise, labels)` with
    `c_skip = sd^2 / (sigma^2 + sd^2)`, `c_out = sigma sd / sqrt(sigma^2 + sd^2)`,
    `c_in = 1 / sqrt(sd^2 + sigma^2)`, `c_noise = ln(sigma) / 4`, `sd = sigma_data`.
    `logvar(sigma) = MPConv_dense(MPFourier(logvar_channels)(c_noise))`; the uncertainty
    head is config G's whatever the ablation's switches.

    Fields: those of `UNetFields` and `BlockFields`, plus `sigma_data` and
    `logvar_channels`. Call: `x` `[N, H, W, C]`, `sigma` `[N]` or scalar (> 0), `labels`
    `[N, label_dim]` (None -> zeros when the net is conditional, i.e. the unconditional
    slot), `train` (dropout), `return_logvar` -> `D` `[N, H, W, C]` float32 (and
    `logvar` `[N]` float32). Preconditioning and the output are float32 whatever `dtype` is.
    """

    sigma_data: float = 0.5
    logvar_channels: int = 128

    def setup(self):
        self.unet = UNet(**fields_of(self, UNetFields))
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


# The fields a network config (config.json's `network`, network.json) may hold: every
# field of `Precond` but the kernels, which are the backend's choice, not the network's.
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(Precond)
                      if f.name not in ("parent", "name", "kernels"))


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


def precond_from_config(net_cfg: Any, dtype: Any = None, kernels: Kernels | None = None
                        ) -> Precond:
    """Build a `Precond` from a network config (a flat mapping or ConfigDict with names of
    `CONFIG_FIELDS`, as config.json and network.json hold them), computed with `kernels`
    (default the model's own math; `edm2_jax.backends.select(...).kernels`). `dtype`
    overrides the config's (a string such as 'bfloat16' is accepted there). Unknown
    keys, `kernels` among them, raise `ValueError` naming them."""
    fields = set(CONFIG_FIELDS)
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
    return Precond(**kw, kernels=MODEL_MATH if kernels is None else kernels)


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
