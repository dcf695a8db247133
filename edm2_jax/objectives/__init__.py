"""Training objectives: what a run minimises, one object chosen once from its config.

    objective = objectives.from_config(config)   # the one place that asks which
    loss, aux = objective.loss(params, buffers, net, extras, images, labels, draws, batch_size)
    objective.sampler_kwargs(heun_steps)         # the sampler its networks are sampled with

Three objectives:

- `EDM2` (`edm2.py`): the EDM2 loss with learned uncertainty (paper Eq. 21, `model/loss.py`).
- `ConsistencyDistillation` (`distill.py`): multistep consistency distillation of a
  teacher network (docs/distillation.md), when `config.distill.teacher` is set.
- `DistributionMatching` (`dmd.py`): DMD2's distribution matching of a teacher
  (docs/distillation.md), when `config.distill.teacher` is set and
  `config.distill.objective` is 'dmd'; a fake denoiser trained beside the generator.

Everything outside this package runs an `Objective` without asking which it is: the
training step calls `loss` with the train-state entries `state_keys` names (and hands
the gradient in those of `trained_keys` to `apply_gradients`), the set-up
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
from edm2_jax.objectives.dmd import DistributionMatching
from edm2_jax.objectives.edm2 import EDM2

Array = jax.Array


class Objective(Protocol):
    """What a training objective gives the training code.

    Attributes:
      name: short name for logs ('edm2', 'consistency').
      state_keys: the train-state entries beyond `state.init_train_state`'s that `loss`
        reads (e.g. `('teacher',)`), made by `state_extras`; frozen (no gradient) but
        for those of `trained_keys`.
      trained_keys: the `state_keys` entries the loss also trains (a second network,
        e.g. `('fake',)`): the step differentiates the loss in them too and passes the
        gradients to `apply_gradients`, which owns their optimiser (its state another
        `state_keys` entry). `()` for none.
      num_draws: the step's random draws per image: 1 gives `rnd_normal` `[B]` and
        `noise_unit` `[B, H, W, C]`; `k > 1` gives `[B, k]` and `[B, k, H, W, C]`.
      metadata_key: the config section a network trained with it records in its
        metadata (`'distill'`), or None.
      init_role, init_flag: what the network of `init_network` is to the run ('teacher')
        and the flag that names it, for messages; None without one.
      forward_passes: the network's forward passes per training image that one step
        computes, a backward pass counted as two (the EDM2 step's: 3); times the
        forward pass's flops, the step's model flops (`analysis.plan`).
    """

    name: str
    state_keys: tuple[str, ...]
    trained_keys: tuple[str, ...]
    num_draws: int
    metadata_key: str | None
    init_role: str | None
    init_flag: str | None
    forward_passes: int

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

    def apply_gradients(self, extras: dict, grads: dict, nimg: Array) -> tuple[dict, dict]:
        """`(entries, metrics)`: the new values of the `state_keys` entries it trains,
        from the loss's gradient `grads` in the `trained_keys` entries of `extras` (the
        state's, before the step; `nimg` images seen before it), and float32 scalars
        to log. `({}, {})` for an objective without `trained_keys`."""

    def sampler_kwargs(self, heun_steps: int) -> dict:
        """The sampler its networks are sampled with (`sampling.sampler.sample_images`
        kwargs); `heun_steps` is the caller's step count for the Heun sampler."""


def from_config(config: Any) -> Objective:
    """The objective of `config` (a ConfigDict, or the dict of a run's config.json or of
    a network.json's meta): when `distill.teacher` is set, `DistributionMatching` if
    `distill.objective` is 'dmd', else `ConsistencyDistillation`; without a teacher
    `EDM2`. The one place that decides which objective a run trains."""
    get = config.get if hasattr(config, "get") else lambda k, d=None: d
    distill = get("distill", None)
    if distill and str(distill.get("teacher", "") or ""):
        sigma_data = _loss_field(config, "sigma_data", 0.5)
        if str(distill.get("objective", "consistency")) == "dmd":
            return DistributionMatching(distill, sigma_data, get("optim", None))
        return ConsistencyDistillation(distill, sigma_data)
    return EDM2(get("loss", None) or {})


def from_metadata(meta: dict, config: dict | None = None) -> Objective:
    """The objective a network was trained with, from its network.json meta (which
    records `metadata_key` sections) or its run's config.json (`config`)."""
    recorded = {"distill": meta["distill"]} if "distill" in meta else {}
    return from_config({**(config or {}), **recorded})


def _loss_field(config: Any, key: str, default: float) -> float:
    loss = (config.get("loss", None) if hasattr(config, "get") else None) or {}
    return float(loss.get(key, default))
