"""One training step (docs/recipe.md §4) and its jitting over a device mesh.

    train_step = make_train_step(config, net, tx, num_accum)
    step_fn = jit_train_step(train_step, mesh, state_sharding)
    state, metrics = step_fn(state, batch)

One step: force-normalise the online weights (Eq. 66) -> the objective's loss (the EDM2
loss, or another of `edm2_jax.objectives`, with the train-state entries it adds) and
gradients (accumulated over micro-batches with `lax.scan` when `batch_per_device` is set)
-> Adam with the inverse-sqrt learning rate at the images seen *before* the step (on the
steps the objective trains the weights, `Objective.trains_weights`, by default every one)
-> power EMAs with the post-update weights at the images seen *after* it.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax

from edm2_jax import backends, objectives
from edm2_jax.ema import power as ema_lib
from edm2_jax.model.mp import force_normalize
from edm2_jax.model.networks import Precond
from edm2_jax.training import optim as optim_lib
from edm2_jax.training import sharding as shard_lib
from edm2_jax.training import state as state_lib


def num_micro_batches(config: ml_collections.ConfigDict, num_devices: int) -> int:
    """Gradient-accumulation rounds per step; raises ValueError for inconsistent batches."""
    batch = int(config.batch_size)
    if batch % num_devices:
        raise ValueError(f"batch_size {batch} is not divisible by the {num_devices} devices")
    per_device = int(config.batch_per_device or 0) or batch // num_devices
    if batch % (per_device * num_devices):
        raise ValueError(f"batch_size {batch} is not a multiple of batch_per_device "
                         f"{per_device} x {num_devices} devices")
    return batch // (per_device * num_devices)


def batch_splits(config: ml_collections.ConfigDict, num_devices: int) -> bool:
    """Whether the step of `config` runs on `num_devices` devices: its batch (and
    micro-batches) split over them and `config.mesh.fsdp` divides them."""
    try:
        num_micro_batches(config, num_devices)
        return num_devices % int((config.get("mesh") or {}).get("fsdp", 1)) == 0
    except ValueError:
        return False


def global_norm(tree) -> jax.Array:
    """The L2 norm of all leaves of `tree` taken together (float32 scalar), as one
    reduction over their concatenation, where a norm per leaf and their sum
    (`optax.tree.norm`) take one per leaf, 200-300 for an EDM2 U-Net. The same value up
    to float32 summation order. Which of the two the step logs is the backend's choice
    (`backends.Backend.norms_in_one_reduction`)."""
    leaves = [jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)]
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(jnp.sum(jnp.square(jnp.concatenate(leaves))))


def make_train_step(config: ml_collections.ConfigDict, net: Precond,
                    tx: optax.GradientTransformation, num_accum: int = 1,
                    objective: objectives.Objective | None = None,
                    lr_fn: Callable | None = None) -> Callable:
    """Build `train_step(state, batch) -> (state, metrics)` (not yet jitted).

    `batch` = `{'image': f32 [B, H, W, C] in [-1, 1], 'label': f32 [B, L]}` with
    `B = config.batch_size`. The objective's random draws are drawn for the whole global
    batch from the state's rng, so the result does not depend on device count or on
    `num_accum` (identical math, different summation order). `objective`: what the step
    minimises (default `objectives.from_config(config)`); the train-state entries beyond
    `state.BASE_KEYS` are its own, those of `objective.trained` trained by its `update`.
    `lr_fn`: the learning rate at `nimg` that `tx` applies, logged as `lr` (default the
    schedule of `config.optim`, `optim.learning_rate_schedule`). Metrics are a flat dict
    of float32 scalars.
    """
    batch_size = int(config.batch_size)
    sigma_rels = tuple(config.ema.sigma_rels)
    forced_wn = bool(config.optim.get("forced_wn", True))  # False: config D and before
    ema_kw = dict(sigma_rels=sigma_rels, trad_halflife_kimg=float(config.ema.trad_halflife_kimg),
                  trad_rampup_ratio=config.ema.trad_rampup_ratio)
    # The logged norms' form is the backend's choice (`backends.Backend`): equal values.
    backend = backends.from_config(config)
    norm = global_norm if backend.norms_in_one_reduction else optax.tree.norm
    objective = objective or objectives.from_config(config)
    lr_fn = lr_fn or optim_lib.learning_rate_schedule(config.optim, batch_size)
    gradients = _gradients_fn(net, objective, batch_size, num_accum,
                              num_accum if backend.unroll_micro_batches else 1)

    def train_step(state, batch):
        images, labels = batch["image"], batch["label"]
        rng, k_sigma, k_noise, k_drop = jax.random.split(state["rng"], 4)
        with jax.named_scope("draws"):
            draws = objective.draws((k_sigma, k_noise), images.shape)
        with jax.named_scope("force_normalize"):
            params = force_normalize(state["params"]) if forced_wn else state["params"]
        own = {k: v for k, v in state.items() if k not in state_lib.BASE_KEYS}
        trained = {k: own[k] for k in objective.trained}
        frozen = {k: v for k, v in own.items() if k not in trained}
        (loss, aux), (grads, tgrads) = gradients(params, trained, frozen, state["buffers"],
                                                 images, labels, draws, k_drop)
        nimg = state["step"].astype(jnp.float32) * batch_size
        grads = backend.place_grads(grads)   # the same values (backends.Backend)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, state["opt_state"], params, nimg=nimg)
            new_params = optax.apply_updates(params, updates)
        trains = objective.trains_weights(state["step"])
        if trains is not True:   # the objective's other steps hold the weights as stored
            new_params, opt_state, updates = jax.tree.map(
                lambda new, old: jnp.where(trains, new, old), (new_params, opt_state, updates),
                (state["params"], state["opt_state"], jax.tree.map(jnp.zeros_like, updates)))
        with jax.named_scope("ema"):
            ema = ema_lib.update_ema(state["ema"], new_params, nimg + batch_size, batch_size,
                                     **ema_kw)
        updated, obj_metrics = objective.update(own, tgrads, nimg)
        with jax.named_scope("logged_norms"):
            norms = {"grad_norm": norm(grads), "update_norm": norm(updates),
                     "param_norm": norm(new_params)}
        metrics = {"objective": loss, "lr": jnp.asarray(lr_fn(nimg), jnp.float32), **norms,
                   **{f"loss/{k}": v for k, v in aux.items()}, **obj_metrics}
        new_state = dict(state, step=state["step"] + 1, params=new_params, opt_state=opt_state,
                         ema=ema, rng=rng, **updated)
        return new_state, metrics

    return train_step


def _gradients_fn(net: Precond, objective: objectives.Objective, batch_size: int,
                  num_accum: int, unroll: int) -> Callable:
    """`gradients(params, trained, frozen, buffers, images, labels, draws, dropout_rng)
    -> ((loss, aux), (grads, trained_grads))`: the objective's loss and its gradients in
    the weights and in its `trained` entries, summed over `num_accum` micro-batches
    (`lax.scan`, unrolled `unroll` times; the sums are the same in the same order
    either way) and the logged means averaged over them."""
    def loss_fn(params, trained, buffers, images, labels, draws, dropout_rng, frozen):
        return objective.loss(params, buffers, net, {**frozen, **trained}, images,
                              labels if net.label_dim else None, draws=draws,
                              dropout_rng=dropout_rng, batch_size=batch_size)

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

    def gradients(params, trained, frozen, buffers, images, labels, draws, k_drop):
        if num_accum == 1:
            return grad_fn(params, trained, buffers, images, labels, draws, k_drop, frozen)

        def split(x):
            # Micro-batch k takes every num_accum-th image, so each device's shard of
            # the batch contributes equally to every micro-batch (no resharding).
            return jnp.swapaxes(x.reshape(batch_size // num_accum, num_accum, *x.shape[1:]), 0, 1)
        micro = jax.tree.map(split, (images, labels, draws))
        drop_keys = jax.random.split(k_drop, num_accum)

        def body(carry, xs):
            (img, lab, drw), dk = xs
            (l, a), g = grad_fn(params, trained, buffers, img, lab, drw, dk, frozen)
            return (jax.tree.map(jnp.add, carry[0], g), carry[1] + l), a

        zeros = (jax.tree.map(jnp.zeros_like, (params, trained)), jnp.zeros((), jnp.float32))
        (grads, loss), auxs = jax.lax.scan(body, zeros, (micro, drop_keys), unroll=unroll)
        return (loss, jax.tree.map(lambda a: jnp.mean(a, axis=0), auxs)), grads

    return gradients


def jit_train_step(train_step: Callable, mesh, state_sharding=None) -> Callable:
    """`jax.jit` the step over `mesh`: batch split over the whole mesh, state on
    `state_sharding` (one sharding or a pytree of them like the state, e.g.
    `sharding.state_shardings`; default replicated) and donated, metrics replicated."""
    rep = shard_lib.replicated(mesh)
    bs = shard_lib.batch_sharding(mesh)
    if state_sharding is None:
        state_sharding = rep
    return jax.jit(train_step, in_shardings=(state_sharding, bs),
                   out_shardings=(state_sharding, rep), donate_argnums=(0,))
