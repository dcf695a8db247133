"""The release's files unpickled without its code: the globals they hold and what each
becomes here (`RELEASE_GLOBALS`), `ReleaseUnpickler`, the reader of a `torch.save` file
(`torch_load`) and the one error of a file that does not read (`read_untrusted`).

The release's network pickles name its persistence loader, dnnlib's `EasyDict`, torch's
module and tensor pickling and numpy's arrays; its `torch.save`d state dicts and training
states hold tensors in `EasyDict`s and `OrderedDict`s. Each of those globals resolves to
a constructor of data: the release's classes to inert stand-ins (`PersistentObject`,
`EasyDict`, `ModuleDict`), whose code is never imported or run; tensors to torch tensors
rebuilt from their storages' bytes by `encoders.torch_weights`, each view checked against
its storage; numpy's arrays through `safe_arrays.NUMPY_GLOBALS` (plain numeric dtypes,
exactly the bytes present). Any other global is refused (`RefusedGlobalError`, a
ValueError naming it) before anything of the file runs. No BUILD of the file changes a
global: the stand-ins are `safe_arrays.Sealed` classes and the functions
`safe_arrays.Constructor`s; only a `ModuleDict` takes a state (a dict of attributes).
torch is needed for PyTorch files (`import_torch`).
"""
from __future__ import annotations

import os
import zipfile
from collections import OrderedDict
from typing import Any, Callable, Mapping

import numpy as np

from edm2_jax.encoders import safe_arrays, torch_weights
from edm2_jax.encoders.safe_arrays import Constructor, Sealed

_TORCH_HINT = "pip install -e '.[torch]' in the checkout (or: pip install torch)"
_EXPECTED = ("expected a released EDM2 network pickle (network-snapshot-*.pkl, edm2-*.pkl), "
             "a torch.save'd Precond state_dict (.pt/.pth) or an .npz with the same keys")


class TorchMissingError(ImportError):
    """torch is not installed (the message names what needed it and the install)."""


class RefusedGlobalError(ValueError):
    """A pickle names a global outside `RELEASE_GLOBALS` (the message names it)."""


def import_torch(purpose: str = "reading PyTorch weights"):
    """The `torch` module; raises `TorchMissingError` naming `purpose` and the install."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise TorchMissingError(f"{purpose} needs torch: {_TORCH_HINT}") from e
    return torch


# ---------------------------------------------------------------------------------------
# Stand-ins for the release's pickled classes, and the constructors of its data.

def _refuse_state(name: str, state) -> ValueError:
    return ValueError(f"the pickle BUILDs a {name} with the state {str(state)[:80]}, which "
                      f"the release's files never hold; the file is hostile or damaged")


class EasyDict(dict, metaclass=Sealed):
    """Stand-in for `dnnlib.util.EasyDict`: a dict with attribute access (its items are
    its attributes, so its pickles carry no state)."""

    def __setstate__(self, state):
        if state not in (None, {}):
            raise _refuse_state("EasyDict", state)

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self[name] = value


class PersistentObject(metaclass=Sealed):
    """Stand-in for an object of a `torch_utils.persistence`-wrapped class.

    Holds what the pickle recorded: `class_name` (e.g. 'Precond', 'MPConv'),
    `module_src` (the authors' source, kept as text and never executed), `version` and
    `state` (the original `__dict__`: `_parameters`, `_buffers`, `_modules`,
    `_init_args`, `_init_kwargs`, plain attributes).
    """

    def __init__(self, meta: Mapping):
        self.class_name = str(meta.get("class_name", "?"))
        self.module_src = meta.get("module_src", "")
        self.version = meta.get("version")
        self.type = meta.get("type")
        self.state = dict(meta.get("state") or {})

    def __repr__(self):
        return f"<persistent {self.class_name}>"

    def __setstate__(self, state):
        raise _refuse_state("persistent object", state)


def _reconstruct_persistent_obj(meta):
    if not isinstance(meta, Mapping):
        raise ValueError(f"a persistent object's record is a {type(meta).__name__}, not a "
                         f"dict")
    return PersistentObject(meta)


class ModuleDict(metaclass=Sealed):
    """Stand-in for `torch.nn.ModuleDict` (the U-Net's `enc` and `dec`): its `__dict__`
    is the module's state (`_parameters`, `_buffers`, `_modules`), which BUILD gives as
    a dict of attribute names."""

    def __setstate__(self, state):
        if not (isinstance(state, dict)
                and all(isinstance(k, str) and not k.startswith("__") for k in state)):
            raise _refuse_state("ModuleDict", state)
        self.__dict__.update(state)


def _rebuild_tensor(storage, offset, size, stride, *_):
    """`torch._utils._rebuild_tensor_v2`: a torch tensor of the elements of `storage` its
    view addresses (`torch_weights.rebuild_tensor`, bounds checked)."""
    array = torch_weights.rebuild_tensor(storage, offset, size, stride)
    if array is None:
        return None
    torch = import_torch()
    if array.dtype == safe_arrays.DTYPES["bfloat16"]:  # numpy's bfloat16 is not torch's
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _rebuild_parameter(data, requires_grad, backward_hooks):
    """`torch._utils._rebuild_parameter`: the parameter's tensor."""
    return data


def _load_from_bytes(data):
    """`torch.storage._load_from_bytes`: the storage a network pickle keeps as the bytes of
    a legacy `torch.save` (`torch_weights.load_legacy`, read by `ReleaseUnpickler`)."""
    if not isinstance(data, bytes):
        raise ValueError(f"a storage's bytes are a {type(data).__name__}")
    storage = torch_weights.load_legacy(data, ReleaseUnpickler)
    if type(storage) is not torch_weights.Storage:
        raise ValueError(f"a storage's bytes hold a {type(storage).__name__}, not a storage")
    return storage


# Every global the release's files hold, and the constructor of data each resolves to
# here. Where each comes from: the release's network pickles (its persistence loader,
# dnnlib's EasyDict around the networks, torch's module and tensor pickling, the numpy
# arrays of its StabilityVAEEncoder's scale and bias), its `torch.save`d state dicts and
# training states. tests/data/release_interop/export_facts.json records the globals of
# one of its pickles. The builtin types (OrderedDict, set) are immutable; the rest are
# `Sealed` classes and `Constructor`s.
RELEASE_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch_utils.persistence", "_reconstruct_persistent_obj"): Constructor(
        "torch_utils.persistence._reconstruct_persistent_obj", _reconstruct_persistent_obj),
    ("dnnlib.util", "EasyDict"): EasyDict,
    ("collections", "OrderedDict"): OrderedDict,
    ("torch.nn.modules.container", "ModuleDict"): ModuleDict,
    ("torch._utils", "_rebuild_tensor_v2"): Constructor("torch._utils._rebuild_tensor_v2",
                                                        _rebuild_tensor),
    ("torch._utils", "_rebuild_parameter"): Constructor("torch._utils._rebuild_parameter",
                                                        _rebuild_parameter),
    ("torch.storage", "_load_from_bytes"): Constructor("torch.storage._load_from_bytes",
                                                       _load_from_bytes),
    ("builtins", "set"): set,      # a module's non-persistent buffer names (protocol 2 of
    ("__builtin__", "set"): set,   # torch.save names it as Python 2 did)
    **safe_arrays.NUMPY_GLOBALS,   # numpy's arrays: the StabilityVAEEncoder's scale, bias
}


class ReleaseUnpickler(torch_weights.ArchiveUnpickler):
    """Unpickler for the release's files without the authors' code: a plain pickle
    (`zf` None) or the pickle of a torch file (`zf` its zip archive or `LegacyRecords`,
    whose storage types it also reads). Resolves only `RELEASE_GLOBALS` (importing torch
    first for torch's: `import_torch`); any other global raises `RefusedGlobalError`
    before anything of the pickle runs."""

    def __init__(self, file, zf=None, prefix: str = ""):
        super().__init__(file, zf, prefix)
        self._archive = zf is not None

    def find_class(self, module: str, name: str):
        stype = torch_weights.storage_type(module, name) if self._archive else None
        if stype is not None:
            return stype
        found = RELEASE_GLOBALS.get((module, name))
        if found is None:
            raise RefusedGlobalError(
                f"refused: the pickle names {str(module)[:80]}.{str(name)[:80]}, which is "
                f"not one of the data constructors a release file holds; nothing of it "
                f"was run")
        if module.split(".")[0] == "torch":
            import_torch()
        return found


def torch_load(path: str):
    """The object of a `torch.save` file (zip archive or legacy), read by
    `ReleaseUnpickler` (tensors as torch tensors; never the authors' code). Raises
    ImportError without torch, `RefusedGlobalError` naming a global outside
    `RELEASE_GLOBALS`, ValueError for a damaged file (`read_untrusted`)."""
    import_torch()

    def load():
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                return torch_weights.load_archive(zf, ReleaseUnpickler)
        with open(path, "rb") as f:
            return torch_weights.load_legacy(f.read(), ReleaseUnpickler)

    return read_untrusted(path, load)


def read_untrusted(path: str | os.PathLike, read: Callable[[], Any]):
    """`read()` of the file `path`: any error it raises, but a missing torch, as one
    ValueError naming `path` (a `RefusedGlobalError` stays one, naming the global)."""
    try:
        return read()
    except TorchMissingError:
        raise
    except RefusedGlobalError as e:
        raise RefusedGlobalError(f"{path} is not a file this converter reads: {e}; "
                                 f"{_EXPECTED}") from None
    except Exception as e:  # noqa: BLE001 - whatever a damaged file makes a reader raise
        why = " ".join(f"{type(e).__name__}: {e}".split())[:600]
        raise ValueError(f"{path} is not a file this converter reads ({why}): {_EXPECTED}; "
                         f"check the file (a truncated download?)") from None
