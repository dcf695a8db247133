"""Training objectives: what a run minimises, one object chosen once from its config.

    objective = objectives.from_config(config)   # config.objective names it
    loss, aux = objective.loss(params, buffers, net, state, images, labels, draws=...)
    objective.sampler(num_steps)                 # the sampler its networks are sampled with

An objective is a class of the `base.Objective` interface in a module of its own,
registered under its `name` (`register`, one line); `config.objective` picks it. An
objective defined outside the package is found again from what its run recorded: the
run records its module (`config.plugins`, and `record` in each network.json), which
`from_config` imports where the user allowed it (`edm2_jax.plugins`). Three built in:

- `EDM2` (`edm2.py`, 'edm2'): the EDM2 loss with learned uncertainty (paper Eq. 21).
- `ConsistencyDistillation` (`distill.py`, 'consistency'): multistep consistency
  distillation of the teacher `config.distill.teacher` (docs/distillation.md).
- `DistributionMatching` (`dmd.py`, 'dmd'): DMD2's distribution matching of a teacher,
  a fake denoiser trained beside the generator (docs/distillation.md).

Everything outside this package runs an `Objective` without asking which it is: the
config has its section (`section_fields`) and its checks (`check`), the set-up starts
the network from `start()` and the state with `init_state`, the training step calls
`draws`, `loss` and `update`, sample grids, evaluation, the post-hoc EMA sweep and
`--mode=generate` sample with `sampler()`, and the plan counts `flops_per_image`.
"""
from __future__ import annotations

import json
from typing import Any

from edm2_jax import plugins
from edm2_jax.objectives.base import Objective, StartNetwork, field
from edm2_jax.objectives.distill import ConsistencyDistillation
from edm2_jax.objectives.dmd import DistributionMatching
from edm2_jax.objectives.edm2 import EDM2
from edm2_jax.objectives.scm import ContinuousConsistency

__all__ = ["Objective", "StartNetwork", "REGISTRY", "register", "from_config",
           "from_metadata", "name_of", "objective_class", "record", "check_config"]

# The objectives by `config.objective` name.
REGISTRY: dict[str, type[Objective]] = {}


def register(cls: type[Objective]) -> type[Objective]:
    """Make `cls` selectable as `config.objective = cls.name` (usable as a decorator).
    Raises ValueError for a class without a name or a name taken by another class."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name: set its class attribute `name`")
    if REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"objective name {cls.name!r} is taken by "
                         f"{REGISTRY[cls.name].__name__}")
    REGISTRY[cls.name] = cls
    return cls


for _cls in (EDM2, ConsistencyDistillation, DistributionMatching, ContinuousConsistency):
    register(_cls)


def name_of(config: Any) -> str:
    """The objective a config trains: `config.objective` ('edm2' where it names none)."""
    return str(field(config, "objective") or EDM2.name)


def objective_class(name: str) -> type[Objective]:
    """The registered class of objective `name`. Raises ValueError naming the registered
    ones."""
    if name not in REGISTRY:
        raise ValueError(f"objective {name!r} is not registered; registered: "
                         f"{', '.join(sorted(REGISTRY))} (an objective of your own: register "
                         f"it in a module and name that module with --plugins=MODULE)")
    return REGISTRY[name]


def from_config(config: Any, source: str = "--config") -> Objective:
    """The objective of `config` (a ConfigDict, or the dict of a run's config.json or of
    a network.json's meta over it), `REGISTRY[name_of(config)]`; one not registered yet
    is looked for in the modules `config.plugins` records (`plugins.load`: only those
    the user allowed). `source`: what `config` came from, for the messages. Raises
    plugins.PluginNotAllowedError for a recorded module the user did not allow (nothing
    imported), ValueError naming the registered names for an unknown objective."""
    name = name_of(config)
    if name not in REGISTRY and field(config, "plugins"):
        plugins.load(list(field(config, "plugins")), source)
    if name not in REGISTRY:
        where = ("--config.objective" if source == "--config"
                 else f"{source}: its objective")
        raise ValueError(f"{where}={name!r}: not an objective; registered: "
                         f"{', '.join(sorted(REGISTRY))} (an objective of your own: register "
                         f"it in a module and name that module with --plugins=MODULE)")
    return REGISTRY[name](config)


def modules_of(objective: Objective, sampler: Any = None) -> tuple[str, ...]:
    """The modules outside the package that define `objective` and `sampler` (what a run
    records in `config.plugins`, so that it is found again: `from_config`)."""
    found = [plugins.module_of(type(x)) for x in (objective, sampler) if x is not None]
    return tuple(sorted({m for m in found if m}))


def record(config: Any) -> dict:
    """What a network trained under `config` records of its objective in its
    network.json meta, so that it is sampled as trained wherever it is moved:
    `{'objective': name}` and the objective's config section, if it has one."""
    objective = from_config(config)
    out = {"objective": objective.name}
    if field(config, "plugins"):
        out["plugins"] = list(field(config, "plugins"))
    if objective.section:
        section = field(config, objective.section, {})
        out[objective.section] = json_dict(section)
    return out


def json_dict(section: Any) -> dict:
    """A config section (ConfigDict or dict) as a plain JSON-able dict."""
    to_dict = getattr(section, "to_dict", None)
    return dict(to_dict() if to_dict else section)


def from_metadata(meta: dict, config: dict | None = None, source: str = "the network"
                  ) -> Objective:
    """The objective a network was trained with, from its network.json meta (its
    `objective`, `plugins` and its objective's section, `record`) over its run's
    config.json (`config`). `source`: the file they came from, for the messages."""
    merged = dict(config or {})
    if "objective" in meta:
        merged["objective"] = meta["objective"]
    if "plugins" in meta:
        merged["plugins"] = meta["plugins"]
    if name_of(merged) not in REGISTRY:  # its module, where allowed, registers it
        from_config(merged, source)
    section = REGISTRY[name_of(merged)].section
    if section and section in meta:
        merged[section] = meta[section]
    return from_config(merged, source)


def check_config(config: Any) -> Objective:
    """The objective of `config`, its settings checked (`Objective.check`). Raises
    ValueError naming the flag."""
    objective = from_config(config)
    objective.check()
    return objective
