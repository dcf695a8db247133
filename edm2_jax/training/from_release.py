"""A release training state as our train state (`train_state_from_release`).

`release.training_state.read_training_state` reads the release's `training-state-*.pt`
(online params, Adam's moments and step, the power EMAs); this module puts them into the
train state of `state.init_train_state`: the online params, Adam's moments and count
(torch's `step`; both count the updates done, optax's bias correction `1 - beta^count`
is torch's), every power EMA under its sigma_rel key (`ema.power.ema_key`). Not carried
over: the data order (the release's sampler and ours differ) and the training RNG (drawn
from `config.seed` as for a new run).
"""
from __future__ import annotations

from typing import Mapping

import jax
import numpy as np
import optax

from edm2_jax.ema import power as ema_lib
from edm2_jax.release import convert
from edm2_jax.training import optim as optim_lib
from edm2_jax.training import state as state_lib  # make_network, init_train_state


def _variables(sd: Mapping, net_config: Mapping) -> dict:
    """Release state dict -> this project's variables, checked against the shapes of
    `net_config`'s Precond (`convert.state_dict_to_variables`)."""
    _, variables = convert.state_dict_to_variables(sd, net_config)
    return variables


def train_state_from_release(release: Mapping, config) -> tuple[int, dict]:
    """`(step, state)`: the train state of `state.init_train_state(config, ...)`'s
    structure and dtypes (host numpy) holding the release training state `release`
    (`release.training_state.read_training_state`), at step `cur_nimg /
    config.batch_size`.

    Raises ValueError when the release state does not fit `config`: another network
    (listing the keys), EMA widths other than `config.ema.sigma_rels`, a traditional EMA
    in the config, Adam betas/eps other than `config.optim`'s, or a `cur_nimg` that is
    not a whole number of `config.batch_size` batches.
    """
    batch = int(config.batch_size)
    if release["cur_nimg"] % batch:
        raise ValueError(f"the release state is at nimg {release['cur_nimg']}, not a whole "
                         f"number of --config.batch_size={batch} batches; use the release "
                         f"run's batch size")
    want = sorted(ema_lib.ema_key(s) for s in config.ema.sigma_rels)
    have = sorted(ema_lib.ema_key(s) for s in release["ema"])
    if want != have:
        raise ValueError(f"the release state tracks power EMAs {have}, the config "
                         f"ema.sigma_rels {want}; set --config.ema.sigma_rels to "
                         f"({', '.join(have)})")
    if float(config.ema.trad_halflife_kimg) > 0:
        raise ValueError("the release state has no traditional EMA; set "
                         "--config.ema.trad_halflife_kimg=0")
    adam = release["adam"]
    ours = (float(config.optim.beta1), float(config.optim.beta2), float(config.optim.eps))
    if not np.allclose(adam["betas"] + (adam["eps"],), ours, rtol=1e-6, atol=0):
        raise ValueError(f"the release state's Adam has betas {adam['betas']} and eps "
                         f"{adam['eps']}, the config optim.beta1/beta2/eps {ours}; set them to "
                         f"the release's")

    net_config = config.network.to_dict()
    variables = _variables(release["net"], net_config)
    params = variables["params"]
    buffers = {k: v for k, v in release["net"].items()
               if convert.release_key_to_path(k)[0] == "buffers"}
    mu = _variables({**buffers, **adam["exp_avg"]}, net_config)["params"]
    nu = _variables({**buffers, **adam["exp_avg_sq"]}, net_config)["params"]
    emas = {ema_lib.ema_key(s): _variables(sd, net_config)["params"]
            for s, sd in release["ema"].items()}

    net = state_lib.make_network(config)
    tx = optim_lib.make_optimizer(config.optim, batch)
    abstract = jax.eval_shape(lambda r: state_lib.init_train_state(config, net, tx, r),
                              jax.random.PRNGKey(config.seed))
    opt_state = tuple(
        s._replace(count=np.asarray(adam["step"], np.int32), mu=mu, nu=nu)
        if isinstance(s, optax.ScaleByAdamState) else s
        for s in jax.eval_shape(tx.init, params))
    state = {
        "step": np.asarray(release["cur_nimg"] // batch, np.int32),
        "params": params,
        "buffers": variables["buffers"],
        "opt_state": opt_state,
        "ema": {"power": emas},
        "rng": np.asarray(jax.random.split(jax.random.PRNGKey(config.seed))[1]),
    }
    try:
        state = jax.tree.map(lambda x, a: np.asarray(x, a.dtype).reshape(a.shape), state,
                             abstract)
    except ValueError as e:
        raise ValueError(f"the converted state does not have the arrays of the config's "
                         f"train state ({e})") from None
    return int(state["step"]), state
