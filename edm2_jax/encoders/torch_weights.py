"""Weights files of PyTorch models read as NumPy arrays, never running what a file holds:
`.safetensors` (`safetensors.numpy`), `torch.save` and TorchScript zip archives (read
without torch: `ArchiveUnpickler` rebuilds tensors from the archive's raw storages and
refuses every other global), and legacy (non-zip) torch files (`torch.load(weights_only=
True)`, which needs torch). Used for the SD VAE (`encoders/vae.py`), DINOv2
(`evaluation/dinov2.py`) and the FID Inception network (`evaluation/inception.py`)."""
from __future__ import annotations

import io
import os
import pickle
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import numpy as np

# `corrupt(path, expected, error)`: the caller's error for a file its reader refuses,
# naming the file, what was expected and where a good one comes from.
CorruptError = Callable[[Path, str, BaseException], Exception]

_STORAGE_DTYPES = {"FloatStorage": np.float32, "DoubleStorage": np.float64,
                   "HalfStorage": np.float16, "BFloat16Storage": None,
                   "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
                   "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}


class ScriptObject:
    """Inert stand-in for a TorchScript module class (`__torch__.*`); keeps its state."""

    def __setstate__(self, state):
        self.__dict__.update(state)


def _rebuild_tensor(storage, offset, size, stride, *_):
    itemsize = storage.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * itemsize for s in stride))
    return np.array(view)


class ArchiveUnpickler(pickle.Unpickler):
    """Reads `<archive>/data.pkl` of a TorchScript / torch.save zip: tensors become numpy
    arrays read from `<archive>/data/<key>`; module classes become `_ScriptObject`s; every
    other global is refused."""

    def __init__(self, file, zf: zipfile.ZipFile, prefix: str):
        super().__init__(file)
        self._zf, self._prefix, self._storages = zf, prefix, {}

    def find_class(self, module, name):
        if module.startswith("__torch__"):
            return ScriptObject
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and _STORAGE_DTYPES.get(name) is not None:
            return _STORAGE_DTYPES[name]
        if module == "torch.jit._pickle" and name.startswith("build_"):
            return lambda items: items
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"unexpected global {module}.{name} in the weights "
                                     f"archive")

    def persistent_load(self, pid):
        kind, dtype, key, _location, numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        if key not in self._storages:
            raw = self._zf.read(f"{self._prefix}/data/{key}")
            self._storages[key] = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"),
                                                count=numel)
        return self._storages[key]


class _StateDictUnpickler(ArchiveUnpickler):
    """`data.pkl` of a `torch.save`d state dict: dicts of tensors (as numpy arrays) only."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return lambda data, requires_grad, backward_hooks: data
        try:
            return super().find_class(module, name)
        except pickle.UnpicklingError:
            raise pickle.UnpicklingError(f"{module}.{name}: only a state dict of tensors is "
                                         f"read") from None


def read_state_dict(path: str | os.PathLike, corrupt: CorruptError,
                    torch_hint: str = "") -> dict[str, np.ndarray]:
    """All tensors of a weights file as `{name: float32 ndarray}` in torch layout.

    `.safetensors`: `safetensors.numpy`. A `torch.save` zip archive: read without torch.
    A legacy (non-zip) torch file, which starts with pickle protocol 2: `torch.load(...,
    weights_only=True)` if torch is installed; any other file is refused without torch.
    A wrapping `{'model': ...}`, `{'state_dict': ...}` or `{'teacher': ...}` is
    unwrapped; entries that are no arrays are left out. Raises ImportError naming the package to install (`torch_hint` added:
    e.g. a torch-free file of the same weights), or `corrupt(path, expected, error)` for a
    file that is none of these or holds no state dict of tensors.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        try:
            from safetensors.numpy import load_file
        except ImportError as e:
            raise ImportError(f"reading {path} needs safetensors: pip install safetensors") from e
        try:
            sd = load_file(str(path))
        except Exception as e:  # noqa: BLE001 - the reader raises its own error types
            raise corrupt(path, "a readable .safetensors file", e) from None
    elif zipfile.is_zipfile(path):
        sd = _read_zip(path, corrupt)
    else:
        sd = _read_legacy(path, corrupt, torch_hint)
    for key in ("model", "state_dict", "teacher"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict):
        raise corrupt(path, "a state dict", TypeError(f"it holds a {type(sd).__name__}"))
    return {str(k): np.asarray(v, np.float32) for k, v in sd.items()
            if isinstance(v, np.ndarray) or hasattr(v, "__array__")}


def _read_zip(path: Path, corrupt: CorruptError) -> object:
    try:
        with zipfile.ZipFile(path) as zf:
            pkl = [n for n in zf.namelist() if n.endswith("data.pkl")]
            if len(pkl) != 1:
                raise ValueError(f"expected one data.pkl, found {pkl}")
            prefix = pkl[0][: -len("/data.pkl")]
            return _StateDictUnpickler(io.BytesIO(zf.read(pkl[0])), zf, prefix).load()
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, OSError, KeyError,
            ValueError, TypeError) as e:
        raise corrupt(path, "a torch.save archive of a state dict", e) from None


def _read_legacy(path: Path, corrupt: CorruptError, torch_hint: str) -> object:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic != b"\x80\x02":  # torch's legacy format is pickle protocol 2; else a zip
        raise corrupt(path, "a torch zip archive, .safetensors or legacy torch file",
                      ValueError(f"it starts with {magic!r}"))
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"{path} is a legacy (non-zip) torch file; reading it needs torch "
                          f"(pip install torch){torch_hint}") from e
    try:
        with warnings.catch_warnings():  # the error below is the one line a user gets
            warnings.simplefilter("ignore")
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any reader failure means "not weights"
        raise corrupt(path, "a torch weights file", e) from None
    if isinstance(sd, dict):
        sd = {k: v.float().numpy() if hasattr(v, "float") and hasattr(v, "numpy") else v
              for k, v in sd.items()}
    return sd
