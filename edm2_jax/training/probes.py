"""Training-dynamics probes: the magnitudes the paper analyses (Sec. 2, Figures 2-3),
measured on a training state.

With `config.diagnostics.enabled`, the training loop calls `Diagnostics` at step 0 and at
every status line, off the training step: one separately jitted forward and backward pass
on a fixed probe batch (`probe_images` training images, each noised at every sigma of
`diagnostics.sigmas` with fixed noise). It logs, as `diag/...` scalars in stats.jsonl and
TensorBoard:

    diag/act/s<sigma>/<block>   RMS of each encoder/decoder block's output (Fig. 2 top),
                                at each sigma of `act_sigmas`
    diag/wrms/<layer>           RMS of each layer's stored weight, per output unit then
                                averaged: ||w_i|| / sqrt(fan_in) (Fig. 2 bottom); exactly 1
                                up to eps before each step under forced weight norm
    diag/efflr/<layer>          effective learning rate ||dw|| / ||w|| of the update Adam
                                takes from this state on the probe batch's gradient, at
                                the weights the step uses (force-normalised with forced_wn)
    diag/gain/<path>            each learned scalar gain (out_gain, emb_gain; config G)
    diag/loss/s<sigma>          EDM2 loss (per element, with logvar; Eq. 21,
                                `loss.uncertainty_loss`) at each sigma
    diag/logvar/s<sigma>        the learned uncertainty logvar(sigma)
    diag/time_s                 wall time of the call

Blocks and layers are named by their parameter path (`enc_16x16_block0`,
`unet/dec_8x8_in0/conv_res1`), i.e. by side, resolution and depth as Figure 2 groups them.
Plots and comparisons of the logged records: `analysis.diagnostics`.
"""
from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from edm2_jax import data as data_lib
from edm2_jax.model import loss as loss_lib
from edm2_jax.model.mp import force_normalize
from edm2_jax.model.networks import Block

Array = jax.Array


def sigma_tag(sigma: float) -> str:
    """The key fragment of a noise level, e.g. 's0.1', 's10'."""
    return f"s{float(sigma):g}"


def _is_block_call(module, method_name) -> bool:
    return isinstance(module, Block) and method_name == "__call__"


def weight_leaves(params: Any) -> dict[str, Array]:
    """`{'unet/enc_8x8_block0/conv_res0': weight}` for every learned weight (rank >= 2)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
        if names[-1] == "weight" and leaf.ndim >= 2:
            out["/".join(names[:-1])] = leaf
    return out


def weight_rms(weight: Array) -> Array:
    """Mean over output units (last axis) of `||w_i|| / sqrt(fan_in)`, float32 scalar:
    1 for a weight under forced weight normalisation (Eq. 66, up to its 1e-4 eps)."""
    w = weight.astype(jnp.float32)
    fan_in = math.prod(w.shape[:-1])
    norms = jnp.sqrt(jnp.sum(jnp.square(w), axis=tuple(range(w.ndim - 1))))
    return jnp.mean(norms) / math.sqrt(fan_in)


def probe_batch(source: data_lib.Source, num_images: int, sigmas, seed: int = 0) -> dict:
    """The fixed probe batch: `num_images` training images (the data stream of seed
    `seed`, so the same for every run on the data) and unit Gaussian noise, fixed per
    (sigma, image). Returns host arrays `{'image': f32 [P, H, W, C], 'label': f32 [P, L],
    'noise': f32 [S, P, H, W, C]}` with `S = len(sigmas)`."""
    it = data_lib.make_iterator(source, global_batch=num_images, seed=seed, num_workers=0)
    batch = next(it)
    it.close()
    noise = np.random.default_rng(seed).standard_normal(
        (len(sigmas),) + batch["image"].shape).astype(np.float32)
    return {"image": batch["image"], "label": batch["label"], "noise": noise}


def make_diagnostics_fn(net: Any, tx: Any, *, sigmas, act_sigmas, batch_size: int,
                        sigma_data: float = 0.5, forced_wn: bool = True):
    """`fn(params, buffers, opt_state, step, probe) -> {key: f32 scalar}` (not jitted): the
    `diag/*` scalars of the module docstring for a train state. `tx` is the training
    optimiser (`optim.make_optimizer`); its update is taken at `nimg = step * batch_size`
    and discarded."""
    sigmas = tuple(float(s) for s in sigmas)
    act_idx = [sigmas.index(float(s)) for s in act_sigmas]

    def fn(params, buffers, opt_state, step, probe):
        used = force_normalize(params) if forced_wn else params
        S, P = probe["noise"].shape[:2]
        y = jnp.broadcast_to(probe["image"], (S,) + probe["image"].shape).reshape(
            (S * P,) + probe["image"].shape[1:])
        sigma = jnp.repeat(jnp.asarray(sigmas, jnp.float32), P)
        labels = None
        if net.label_dim:
            labels = jnp.tile(probe["label"], (S, 1))
        x = y + probe["noise"].reshape(y.shape) * sigma[:, None, None, None]

        def objective(p):
            (D, logvar), inter = net.apply(
                {"params": p, "buffers": buffers}, x, sigma, labels, train=False,
                return_logvar=True, capture_intermediates=_is_block_call,
                mutable=["intermediates"])
            per_elem = loss_lib.uncertainty_loss(D, y, sigma, logvar, sigma_data)
            return jnp.sum(per_elem) / (S * P), (per_elem, logvar, inter["intermediates"])

        (_, (per_elem, logvar, inter)), grads = jax.value_and_grad(objective, has_aux=True)(used)
        updates, _ = tx.update(grads, opt_state, used, nimg=step.astype(jnp.float32) * batch_size)

        out = {}
        loss_s = jnp.mean(per_elem.reshape(S, -1), axis=1)
        logvar_s = jnp.mean(logvar.reshape(S, P), axis=1)
        for i, s in enumerate(sigmas):
            out[f"diag/loss/{sigma_tag(s)}"] = loss_s[i]
            out[f"diag/logvar/{sigma_tag(s)}"] = logvar_s[i]
        for name, calls in inter["unet"].items():  # 'enc_16x16_block0', 'dec_8x8_in0', ...
            a = calls["__call__"][0].astype(jnp.float32).reshape(S, -1)
            rms = jnp.sqrt(jnp.mean(jnp.square(a), axis=1))
            for i in act_idx:
                out[f"diag/act/{sigma_tag(sigmas[i])}/{name}"] = rms[i]
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            if leaf.ndim == 0:  # the learned gains (out_gain, emb_gain) of config G
                out["diag/gain/" + "/".join(str(getattr(k, "key", k)) for k in path)] = leaf
        stored, used_w, upd = (weight_leaves(t) for t in (params, used, updates))
        for layer, w in stored.items():
            out[f"diag/wrms/{layer}"] = weight_rms(w)
            out[f"diag/efflr/{layer}"] = (jnp.linalg.norm(upd[layer].ravel())
                                          / jnp.linalg.norm(used_w[layer].ravel()))
        return out

    return fn


class Diagnostics:
    """`config.diagnostics` for a training run: the probe batch (on the devices) and the
    jitted diagnostics function. Call `diag(state) -> {key: float}` on every process (the
    state may be sharded); only the main process need log the result."""

    def __init__(self, config: Any, net: Any, tx: Any, source: data_lib.Source):
        d = config.diagnostics
        self.probe = jax.device_put(probe_batch(source, int(d.probe_images), d.sigmas,
                                                int(d.seed)))
        self.fn = jax.jit(make_diagnostics_fn(
            net, tx, sigmas=d.sigmas, act_sigmas=d.act_sigmas,
            batch_size=int(config.batch_size), sigma_data=float(config.network.sigma_data),
            forced_wn=bool(config.optim.get("forced_wn", True))))

    def __call__(self, state: dict) -> dict:
        t = time.time()
        out = self.fn(state["params"], state["buffers"], state["opt_state"], state["step"],
                      self.probe)
        out = {k: float(v) for k, v in jax.device_get(out).items()}
        out["diag/time_s"] = time.time() - t
        return out
