"""The interface every training objective implements (`Objective`), with the EDM2 run's
behaviour as its defaults, so that an objective writes only what its method changes.

An objective is built from a config (`Objective(config)`: the run's ConfigDict, the
dict of a run's config.json, or a network.json's meta merged over it) and gives:

- `section`, `section_fields()`, `check()`: its own config section, its fields'
  defaults, and their validation (ValueError naming the flag);
- `start()`: the network the run starts from (a teacher), or None;
- `frozen_networks()`: further networks of the run's architecture it reads frozen (a
  guide), each loaded into the train-state entry of its name at a fresh start;
- `init_state(params)`, `trained`: the train-state entries it adds (frozen networks, its
  own trained networks and their optimiser states) and those of them its loss trains;
- `draws(...)`, `loss(...)`, `update(...)`: the step's random draws, the scalar it
  differentiates, and the update of its own trained entries;
- `trains_weights(step)`: whether a step updates the weights (default: every step);
- `sampler(num_steps)`: the sampler its networks are sampled with (a `solvers` value);
- `flops_per_image(forward_flops)`: the model flops one training image costs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from edm2_jax.sampling import solvers

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class StartNetwork:
    """The network a run starts from: `path` (any network `nets.load_net` reads), `ema`
    (a run's EMA, '' for its default), what it is to the run (`role`, e.g. 'teacher')
    and the flag that names it (`flag`), for the run's messages."""
    path: str
    ema: str
    role: str
    flag: str


def field(config: Any, dotted: str, default: Any = None) -> Any:
    """`config`'s value at `dotted` ('distill.steps'), a ConfigDict or a plain dict, or
    `default` where it has none."""
    value = config
    for part in dotted.split("."):
        get = getattr(value, "get", None)
        if get is None:
            return default
        value = get(part, None)
        if value is None:
            return default
    return value


class Objective:
    """A training objective; the defaults are the EDM2 run's (no section, no entries of
    its own, the step's draws `rnd_normal` `[B]` and `noise_unit` `[B, H, W, C]`, the
    Heun sampler, three forward passes per image). Subclasses set `name` and override
    what their method changes; `objectives.register` makes one selectable by
    `config.objective`."""

    name: ClassVar[str] = ""
    # The config section the objective reads and validates (None: none of its own).
    section: ClassVar[str | None] = None
    # The `init_state` entries its loss trains: the step differentiates the loss in them
    # too and passes those gradients to `update`, which owns their optimiser.
    trained: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any):
        self.config = config

    def get(self, dotted: str, default: Any = None) -> Any:
        """The config's value at `dotted`, or `default` (`field`)."""
        return field(self.config, dotted, default)

    @classmethod
    def section_fields(cls) -> dict:
        """The fields of `section` and their defaults (`configs.base_config` adds them)."""
        return {}

    def check(self) -> None:
        """Raise ValueError naming the flag when the objective's settings are not valid."""

    def start(self) -> StartNetwork | None:
        """The network whose weights and config the run starts from, or None (a freshly
        initialised network)."""
        return None

    def frozen_networks(self) -> dict[str, StartNetwork]:
        """Further networks the loss reads frozen, by train-state entry: a fresh state
        holds at `state[name]` the `{'params', 'buffers'}` of the network `start()`
        gives (or the fresh one), replaced, before the first step, by the arrays of the
        named network, which must be of the same architecture (its shapes are checked
        before anything compiles); a resumed state restores them. Default: none."""
        return {}

    def describe(self) -> str | None:
        """A line for the start of the run, or None."""
        return None

    def init_state(self, params: Any) -> dict:
        """The train-state entries the objective adds to a fresh state whose weights are
        `params` (float32; checkpointed and sharded like the weights)."""
        return {}

    def draws(self, keys: tuple[Array, Array], images_shape: tuple[int, ...]) -> dict:
        """The step's random draws for a batch of `images_shape` `[B, H, W, C]`, a dict
        of arrays each with leading axis `B` (the micro-batches split them along it),
        from `keys`, two independent PRNG keys of the step (split them further as a
        method needs). EDM2's: standard normal `rnd_normal` `[B]` (the noise levels,
        from the first key) and `noise_unit` `[B, H, W, C]` (from the second)."""
        k_sigma, k_noise = keys
        return {"rnd_normal": jax.random.normal(k_sigma, images_shape[:1], jnp.float32),
                "noise_unit": jax.random.normal(k_noise, images_shape, jnp.float32)}

    def loss(self, params: Any, buffers: Any, net: Any, state: dict, images: Array,
             labels: Array | None, *, draws: dict, dropout_rng: Array | None,
             batch_size: int) -> tuple[Array, dict]:
        """`(sum of per-image losses / batch_size, aux)`: the scalar the step
        differentiates (in `params`, the force-normalised weights, and in the `trained`
        entries of `state`) and the per-batch means it logs as `loss/<name>`. `state`:
        the `init_state` entries; `draws`: `draws(...)`'s."""
        raise NotImplementedError

    def update(self, state: dict, grads: dict, nimg: Array) -> tuple[dict, dict]:
        """`(entries, metrics)`: the new values of the entries of its own that it
        trains, from the loss's gradient `grads` in its `trained` entries of `state`
        (the state's before the step, `nimg` images seen before it), and float32 scalars
        to log. `({}, {})` without `trained` entries."""
        return {}, {}

    def trains_weights(self, step: Array) -> bool | Array:
        """Whether the step after `step` steps (int32 scalar) updates the weights and
        their Adam state: Python True for every step (the step then adds nothing), or a
        bool scalar (the EMAs follow the weights, held or not, on every step)."""
        return True

    def sampler(self, num_steps: int = 32) -> solvers.Sampler:
        """The sampler its networks are sampled with (a `solvers.Sampler` value, built in
        or registered); `num_steps`: the caller's step count for a sampler whose steps
        are free (EDM2's: `solvers.Heun(num_steps)`); a method whose networks are
        sampled in steps of their own (a distilled student) ignores it."""
        return solvers.Heun(num_steps)

    def flops_per_image(self, forward_flops: float) -> float:
        """Model flops per training image of one step, from the network's forward pass's
        `forward_flops` per image: a forward and a backward pass (counted as two)."""
        return 3 * forward_flops
