"""Training objectives: what a run minimises, one object chosen once from its config.

    objective = objectives.from_config(config)   # the one place that asks which
    loss, aux = objective.loss(params, buffers, net, extras, images, labels, draws, batch_size)
    objective.sampler_kwargs(heun_steps)         # the sampler its networks are sampled with

Two objectives:

- `EDM2` (`edm2.py`): the EDM2 loss with learned uncertainty (paper Eq. 21, `model/loss.py`).
- `ConsistencyDistillation` (`distill.py`): multistep consistency distillation of a
  teacher network (docs/distillation.md), when `config.distill.teacher` is set.

Everything outside this package runs an `Objective` without asking which it is: the
training step calls `loss` with the train-state entries `state_keys` names, the set-up
starts the network from `init_network()` when it names one (a teacher), and the sample
grids, the evaluation, the post-hoc EMA sweep and `--mode=generate` sample with
`sampler_kwargs`. A third objective is a module here with a class of this interface and
its branch in `from_config` (docs/architecture.md).

May import: jax, ml_collections, `edm2_jax.model` and `edm2_jax.sampling`'s samplers.
"""
from __future__ import annotations

from typing import Any, Protocol

import jax

from edm2_jax.objectives.distill import ConsistencyDistillation
from edm2_jax.objectives.edm2 import EDM2

Array = jax.Array


class Objective(Protocol):
    """What a training objective gives the training code.

    Attributes:
      name: short name for logs ('edm2', 'consistency').
      state_keys: the train-state entries beyond `state.init_train_state`'s that `loss`
        reads (e.g. `('teacher',)`), made by `state_extras`; frozen (no gradient).
      metadata_key: the config section a network trained with it records in its
        metadata (`'distill'`), or None.
      init_role, init_flag: what the network of `init_network` is to the run ('teacher')
        and the flag that names it, for messages; None without one.
    """

    name: str
    state_keys: tuple[str, ...]
    metadata_key: str | None
    init_role: str | None
    init_flag: str | None

    def check(self) -> None:
        """Raise ValueError naming the flag when the objective's settings are not valid."""

    def init_network(self) -> tuple[str, str] | None:
        """`(path, ema)` of the network the run's weights and network config start from
        (any network `nets.load_net` reads), or None for a freshly initialised network."""

    def describe(self) -> str | None:
        """A line for the start of the run, or None."""

    def state_extras(self, params: Any) -> dict:
        """The `state_keys` entries of a fresh train state whose weights are `params`."""

    def loss(self, params: Any, buffers: Any, net: Any, extras: dict, images: Array,
             labels: Array | None, *, rnd_normal: Array, noise_unit: Array,
             dropout_rng: Array | None, batch_size: int) -> tuple[Array, dict]:
        """`(sum of per-image losses / batch_size, aux)`: the scalar that the step
        differentiates and the per-batch means it logs as `loss/<name>`."""

    def sampler_kwargs(self, heun_steps: int) -> dict:
        """The sampler its networks are sampled with (`sampling.sampler.sample_images`
        kwargs); `heun_steps` is the caller's step count for the Heun sampler."""


def from_config(config: Any) -> Objective:
    """The objective of `config` (a ConfigDict, or the dict of a run's config.json or of
    a network.json's meta): `ConsistencyDistillation` when `distill.teacher` is set, else
    `EDM2`. The one place that decides which objective a run trains."""
    get = config.get if hasattr(config, "get") else lambda k, d=None: d
    distill = get("distill", None)
    if distill and str(distill.get("teacher", "") or ""):
        return ConsistencyDistillation(distill, _loss_field(config, "sigma_data", 0.5))
    return EDM2(get("loss", None) or {})


def from_metadata(meta: dict, config: dict | None = None) -> Objective:
    """The objective a network was trained with, from its network.json meta (which
    records `metadata_key` sections) or its run's config.json (`config`)."""
    recorded = {"distill": meta["distill"]} if "distill" in meta else {}
    return from_config({**(config or {}), **recorded})


def _loss_field(config: Any, key: str, default: float) -> float:
    loss = (config.get("loss", None) if hasattr(config, "get") else None) or {}
    return float(loss.get(key, default))
