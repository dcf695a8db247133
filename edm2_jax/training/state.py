"""The network a config describes and the train state it starts from.

    net = make_network(config)
    state = init_train_state(config, net, optim.make_optimizer(config.optim, B), rng)

The train state is one plain pytree (a dict):

    {'step': int32 [] optimiser steps taken (nimg = step * batch_size),
     'params': online weights, 'buffers': MPFourier buffers (never trained),
     'opt_state': optax state, 'ema': {'power': {'0.050': ..., '0.100': ...}[, 'traditional']},
     'rng': PRNG key}
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

from edm2_jax import backends, configs
from edm2_jax.ema import power as ema_lib
from edm2_jax.model.networks import Precond, init_variables, precond_from_config

Array = jax.Array


def make_network(config: ml_collections.ConfigDict) -> Precond:
    """The `Precond` of `config.network`, built with the kernels of `config.backend`
    (`backends.from_config`: the XLA:CPU kernels on the CPU backend by default; the same
    function everywhere). A `network.dtype` of 'auto' (a config not resolved at start-up,
    as a benchmark's) computes in this platform's dtype (`configs.compute_dtype`). Raises
    ValueError for unknown network or backend fields."""
    backend = backends.from_config(config)
    net_config = config.network.to_dict()
    net_config["dtype"] = configs.compute_dtype(net_config["dtype"], jax.default_backend())
    return precond_from_config(net_config, kernels=backend.kernels)


def init_train_state(config: ml_collections.ConfigDict, net: Precond,
                     tx: optax.GradientTransformation, rng: Array) -> dict:
    """Fresh train state: network init from `rng`, Adam state, EMAs equal to the weights."""
    init_rng, state_rng = jax.random.split(rng)
    variables = init_variables(net, init_rng)
    params = variables["params"]
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "buffers": variables.get("buffers", {}),
        "opt_state": tx.init(params),
        "ema": ema_lib.init_ema_state(params, tuple(config.ema.sigma_rels),
                                      float(config.ema.trad_halflife_kimg)),
        "rng": state_rng,
    }
