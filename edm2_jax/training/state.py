"""The network a config describes and the train state it starts from.

    net = make_network(config)
    state = init_train_state(config, net, optim.make_optimizer(config.optim, B), rng)

The train state is one plain pytree (a dict):

    {'step': int32 [] optimiser steps taken (nimg = step * batch_size),
     'params': online weights, 'buffers': MPFourier buffers (never trained),
     'opt_state': optax state, 'ema': {'power': {'0.050': ..., '0.100': ...}[, 'traditional']},
     'rng': PRNG key, plus the entries the run's objective adds (a distillation run's
     frozen 'teacher' weights: `edm2_jax.objectives`, `Objective.init_state`)}
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from edm2_jax import backends
from edm2_jax.ema import power as ema_lib
from edm2_jax.model.networks import Precond, init_variables, precond_from_config

Array = jax.Array

# The entries of every train state; any other is the objective's own (`init_state`).
BASE_KEYS = ("step", "params", "buffers", "opt_state", "ema", "rng")


def make_network(config: ml_collections.ConfigDict) -> Precond:
    """The `Precond` of `config.network`, built with the kernels of `config.backend`
    (`backends.from_config`: the XLA:CPU kernels on the CPU backend by default; the same
    function everywhere). `network.dtype` must be concrete: 'auto' is resolved once, where
    a run or a benchmark starts (`configs.resolve_dtype`). Raises ValueError for 'auto' and
    for unknown network or backend fields."""
    if str(config.network.dtype) == "auto":
        raise ValueError("network.dtype='auto' is not resolved: pass the config through "
                         "configs.resolve_dtype(config, jax.default_backend()) first")
    backend = backends.from_config(config)
    return precond_from_config(config.network.to_dict(), kernels=backend.kernels)


def init_train_state(config: ml_collections.ConfigDict, net: Precond,
                     tx: optax.GradientTransformation, rng: Array,
                     variables: dict | None = None, objective: Any = None,
                     frozen: dict | None = None) -> dict:
    """Fresh train state: the weights of a network initialised from `rng` or, when
    `variables` (`{'params', 'buffers'}`, e.g. a distillation run's teacher) are given,
    those as float32 (`rng` is then the state's key itself: nothing is drawn for an
    init); Adam's state; every EMA equal to the weights; and the entries `objective`
    adds (`objectives.Objective.init_state` of the weights; none when None), with, for
    each of its `frozen_networks`, that network's `{'params', 'buffers'}` from `frozen`
    (by name; `setup.load_frozen_network`), or without `frozen` a placeholder of the
    weights and buffers (the abstract state's shapes)."""
    if variables is None:
        init_rng, state_rng = jax.random.split(rng)
        variables = init_variables(net, init_rng)
        params = variables["params"]
    else:
        state_rng = rng
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), variables["params"])
    buffers = jax.tree.map(jnp.asarray, variables.get("buffers", {}))
    names = objective.frozen_networks() if objective is not None else {}
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "buffers": buffers,
        "opt_state": tx.init(params),
        "ema": ema_lib.init_ema_state(params, tuple(config.ema.sigma_rels),
                                      float(config.ema.trad_halflife_kimg)),
        "rng": state_rng,
        **(objective.init_state(params) if objective is not None else {}),
        **{name: frozen[name] if frozen else {"params": params, "buffers": buffers}
           for name in names},
    }
