"""Code from outside the package: the modules in which a researcher defines an objective
(`objectives.register`) or a sampler (`sampling.solvers.register`), imported only when
the user allowed them.

A module registers what it defines when it is imported. A run records the modules of its
objective and sampler (`plugins` in its config.json and in the network.json of every
network made from it), so that every later mode finds them from the run alone. But a run
directory or a network is a file, and nothing a file names is imported unless the user
asked for it. A module is allowed when

- the user's own command names it: `--plugins=MODULE[,MODULE...]` (any mode), or the
  environment of the process that runs the command, `EDM2_JAX_PLUGINS=MODULE[,...]`
  (read by the entry point, `modes/common.py`, and passed to `allow`), or the
  `plugins` field of the `--config` file the user runs;
- an installed distribution declares it as an entry point of group `edm2_jax.plugins`
  (`[project.entry-points."edm2_jax.plugins"] my_method = "my_pkg.my_method"`):
  installing it was allowing it.

A network or run that names another module is refused (`PluginNotAllowedError`, one
line naming the module and how to allow it) before anything of it is imported.

    plugins.allow(["my_method"])         # what --plugins / EDM2_JAX_PLUGINS do
    plugins.load(["my_method"], source="runs/rf/config.json")   # imports it, once

Importing this module imports nothing and reads no environment variable.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
from typing import Iterable

# The entry-point group through which an installed distribution allows its modules.
ENTRY_POINT_GROUP = "edm2_jax.plugins"
# The environment variable the command line reads (`modes/common.py`).
ENV_VAR = "EDM2_JAX_PLUGINS"
# A module name: dotted Python identifiers, nothing else (no paths, no attributes).
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

_allowed: set[str] = set()


class PluginNotAllowedError(ValueError):
    """A file names a module the user has not allowed to be imported."""


def check_name(module: str, where: str) -> str:
    """`module` if it is a dotted Python module name; raises ValueError naming `where`."""
    if not isinstance(module, str) or not _MODULE.fullmatch(module) or len(module) > 200:
        raise ValueError(f"{where}: {module!r} is not a Python module name (dotted "
                         f"identifiers, e.g. my_pkg.my_method)")
    return module


def parse(text: str | Iterable[str] | None, where: str) -> list[str]:
    """The module names of `--plugins` / `EDM2_JAX_PLUGINS` text ('a,b.c') or of a
    sequence of names, each checked (`check_name`); [] for None or ''."""
    if not text:
        return []
    items = text.split(",") if isinstance(text, str) else list(text)
    return [check_name(m.strip(), where) for m in items if str(m).strip()]


def allow(modules: Iterable[str]) -> None:
    """Allow `modules` (names) to be imported by `load` for the rest of the process."""
    _allowed.update(check_name(m, "plugins") for m in modules)


def entry_point_modules() -> set[str]:
    """The modules installed distributions allow (entry points of `ENTRY_POINT_GROUP`;
    each entry's value is a module name)."""
    return {ep.value.split(":")[0].strip()
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def is_allowed(module: str) -> bool:
    return module in sys.modules or module in _allowed or module in entry_point_modules()


def load(modules: Iterable[str], source: str) -> None:
    """Import each of `modules` (names) not yet imported, where allowed (see the module
    doc). `source`: what names them (a file, a flag), for the messages. Raises
    PluginNotAllowedError (one line, naming the module and how to allow it) for a module
    not allowed, before importing any of them; ValueError for one that does not import."""
    names = [check_name(m, source) for m in modules]
    refused = [m for m in names if not is_allowed(m)]
    if refused:
        listed = ",".join(refused)
        raise PluginNotAllowedError(
            f"{source} names the module{'s' * (len(refused) > 1)} {listed} (its objective or "
            f"sampler), which you have not allowed to be imported: a file's module is never "
            f"imported on its own. If you trust that code, pass --plugins={listed} or set "
            f"{ENV_VAR}={listed} (or install it with an '{ENTRY_POINT_GROUP}' entry point)")
    for m in names:
        if m in sys.modules:
            continue
        try:
            importlib.import_module(m)
        except ImportError as e:
            raise ValueError(f"{source}: the module {m} does not import ({e}); put its "
                             f"directory on PYTHONPATH or install it") from None


def load_allowed() -> None:
    """Import every allowed module (`allow`, entry points): what the command line does
    at start-up, so that `--sampler` and `--config.objective` can name what they define."""
    load(sorted(_allowed | entry_point_modules()), "--plugins")


def module_of(cls: type) -> str | None:
    """The module `load` must import for `cls` to be registered: its module, or None for
    a class of this package (registered by importing the package)."""
    module = cls.__module__
    return None if module == "edm2_jax" or module.startswith("edm2_jax.") else module
