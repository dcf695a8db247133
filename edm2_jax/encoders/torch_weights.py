"""Weights files of PyTorch models read as NumPy arrays, never running what a file holds,
and without torch: `.safetensors` (`safetensors.numpy`), `torch.save` and TorchScript zip
archives (`load_archive`) and legacy (non-zip) `torch.save` files (`load_legacy`).

A torch file is a pickle whose tensors name raw storages kept beside it (a zip record, or
a record after the pickle in a legacy file). `ArchiveUnpickler` rebuilds each tensor from
its storage's bytes as NumPy (`rebuild_tensor`): each storage is made by
`safe_arrays.array_from_bytes` (a dtype of its table, the byte order the archive's
`byteorder` record states, exactly the record's bytes; a compressed record capped by
`safe_arrays.read_member`), and the tensor's offset, size and strides are checked against
its storage before any view is made, so a damaged or hostile file is a ValueError, never
bytes from outside the storage. Every global other than a storage type, the tensor
constructor and TorchScript's containers is refused; those it reads are
`safe_arrays.Constructor`s and `Sealed` classes, which no BUILD changes.

Used for the SD VAE (`encoders/vae.py`), DINOv2 (`evaluation/dinov2.py`), the FID
Inception network (`evaluation/inception.py`) and the tensors of the release's files
(`release/pickle_io.py`)."""
from __future__ import annotations

import io
import math
import operator
import os
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from edm2_jax.encoders import safe_arrays

# `corrupt(path, expected, error)`: the caller's error for a file its reader refuses,
# naming the file, what was expected and where a good one comes from.
CorruptError = Callable[[Path, str, BaseException], Exception]

DAMAGED = "the file is damaged or not a weights file"
# A legacy torch file: pickles of this number, its protocol and the writer's sys_info,
# the object, its storage keys, then per key an int64 element count and the elements.
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001


class StorageType(NamedTuple):
    """What a storage class (`torch.FloatStorage`) names: the dtype of its elements.
    An instance, not a class: a pickle cannot call it."""
    dtype: type


_STORAGE_TYPES = {name: StorageType(safe_arrays.DTYPES[t]) for name, t in {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool"}.items()}


def storage_type(module: str, name: str) -> StorageType | None:
    """The `StorageType` a global `torch.<Name>Storage` names; None for any other global
    (complex and quantized storages: a dtype outside `safe_arrays.DTYPES`)."""
    return _STORAGE_TYPES.get(name) if module == "torch" else None


class Storage(NamedTuple):
    """One storage of a torch file: its key, element dtype and count, and its elements
    (1-D, read-only, native byte order; None while a legacy file is only surveyed)."""
    key: str
    dtype: np.dtype
    numel: int
    array: np.ndarray | None


def _storage_id(pid) -> tuple[str, np.dtype, int]:
    """`(key, dtype, numel)` of a persistent id `('storage', StorageType, key, location,
    numel)` (zip archives) or with a sixth entry `view_metadata`, None (legacy files)."""
    if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"
            and (len(pid) == 5 or pid[5] is None)):
        raise ValueError(f"persistent id {str(pid)[:80]} is no storage of a torch file; "
                         f"{DAMAGED}")
    _, stype, key, _location, numel = pid[:5]
    if not isinstance(key, str) or type(stype) is not StorageType:
        raise ValueError(f"storage {str(key)[:40]!r}: no key and storage type; {DAMAGED}")
    if type(numel) is not int or numel < 0:
        raise ValueError(f"storage {key!r}: element count {str(numel)[:40]}; {DAMAGED}")
    return key, np.dtype(stype.dtype), numel


def check_record(key: str, dtype: np.dtype, numel: int, nbytes: int) -> None:
    """Raises ValueError naming `key` unless its record's `nbytes` are `numel` elements."""
    if nbytes != numel * dtype.itemsize:
        raise ValueError(f"storage {key!r}: its record holds {nbytes} bytes, not the "
                         f"{numel} x {dtype.itemsize} its tensors name; {DAMAGED}")


def storage_from_bytes(key: str, dtype: np.dtype, numel: int, raw,
                       byteorder: str = "little") -> Storage:
    """The storage `key` of `numel` `dtype` elements from the bytes of its record, in
    `byteorder` ('little' or 'big'), which must hold exactly that many (`check_record`,
    `safe_arrays.array_from_bytes`)."""
    check_record(key, dtype, numel, len(raw))
    array = safe_arrays.array_from_bytes(raw, dtype, (numel,), byteorder=byteorder,
                                         what=f"storage {key!r}")
    return Storage(key, dtype, numel, array)


def check_view(key: str, numel: int, offset, size, stride) -> tuple[int, tuple, tuple]:
    """`(offset, size, stride)` of a tensor (in elements) as ints, checked to address only
    elements `0 .. numel-1` of its storage `key` and no more elements than it holds.
    Raises ValueError naming `key` for a negative, non-integer or out-of-bounds view."""
    try:
        offset = operator.index(offset)
        size, stride = tuple(map(operator.index, size)), tuple(map(operator.index, stride))
    except TypeError:
        raise ValueError(f"storage {key!r}: a tensor's offset, size and stride are not "
                         f"integers; {DAMAGED}") from None
    if len(size) != len(stride) or offset < 0 or min(size + stride, default=0) < 0:
        raise ValueError(f"storage {key!r}: a tensor of offset {offset}, size {size[:8]} "
                         f"and stride {stride[:8]}; {DAMAGED}")
    count = math.prod(size)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if count > numel or offset > numel or (count and last >= numel):
        raise ValueError(f"storage {key!r}: a tensor of offset {offset}, size {size[:8]} "
                         f"and stride {stride[:8]} reaches beyond its {numel} elements; "
                         f"{DAMAGED}")
    return offset, size, stride


def rebuild_tensor(storage, offset, size, stride, *_) -> np.ndarray | None:
    """`torch._utils._rebuild_tensor_v2` in NumPy: a copy of the elements of `storage` the
    view `(offset, size, stride)` addresses, after `check_view`; None while a legacy file
    is surveyed. Raises ValueError when `storage` is no storage of the file."""
    if type(storage) is not Storage:
        raise ValueError(f"a tensor names {type(storage).__name__}, not a storage of the "
                         f"file; {DAMAGED}")
    offset, size, stride = check_view(storage.key, storage.numel, offset, size, stride)
    if storage.array is None:
        return None
    if math.prod(size) == 0:
        return np.zeros(size, storage.dtype)
    # A dimension of one element never steps: its stride is any number, so 0 here.
    steps = tuple(s * storage.dtype.itemsize if n > 1 else 0 for n, s in zip(size, stride))
    view = np.lib.stride_tricks.as_strided(storage.array[offset:], shape=size, strides=steps,
                                           writeable=False)
    return np.array(view)


class ScriptObject(metaclass=safe_arrays.Sealed):
    """Inert stand-in for a TorchScript module class (`__torch__.*`); keeps its state,
    a dict of attributes."""

    def __setstate__(self, state):
        if not (isinstance(state, dict)
                and all(isinstance(k, str) and not k.startswith("__") for k in state)):
            raise ValueError(f"a TorchScript object's state is a {type(state).__name__}, "
                             f"not a dict of attributes; {DAMAGED}")
        self.__dict__.update(state)


def _items(items):
    return items


class ArchiveUnpickler(pickle.Unpickler):
    """Reads the pickle of a torch file: tensors become NumPy arrays (`rebuild_tensor`)
    read from the storages of `zf` (`<prefix>/data/<key>` of a zip archive, or the
    `LegacyRecords` of a legacy file); TorchScript module classes become `ScriptObject`s;
    every other global is refused (`pickle.UnpicklingError`)."""

    def __init__(self, file, zf, prefix: str = ""):
        super().__init__(file)
        self._records = zf if isinstance(zf, LegacyRecords) or zf is None else \
            _ZipRecords(zf, prefix)

    def find_class(self, module, name):
        stype = storage_type(module, name)
        if stype is not None:
            return stype
        if module.startswith("__torch__"):
            return ScriptObject
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _REBUILD_TENSOR
        if module == "torch.jit._pickle" and name.startswith("build_"):
            return safe_arrays.Constructor(f"torch.jit._pickle.{name}", _items)
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"unexpected global {module}.{name} in the weights "
                                     f"archive")

    def persistent_load(self, pid):
        if self._records is None:
            raise ValueError(f"a plain pickle names a storage ({str(pid)[:80]}); {DAMAGED}")
        return self._records.storage(*_storage_id(pid))


_REBUILD_TENSOR = safe_arrays.Constructor("torch._utils._rebuild_tensor_v2", rebuild_tensor)


class _ZipRecords:
    """The storages of a zip archive: record `<prefix>/data/<key>`, read once per view,
    in the byte order of the record `<prefix>/byteorder` (little where there is none,
    as torch before 2.1 wrote every archive)."""

    def __init__(self, zf: zipfile.ZipFile, prefix: str):
        self._zf, self._prefix, self._read = zf, prefix, {}
        self._byteorder = "little"
        if f"{prefix}/byteorder" in zf.namelist():
            order = safe_arrays.read_member(zf, f"{prefix}/byteorder", what="the archive's "
                                            "byteorder record")
            if order not in (b"little", b"big"):
                raise ValueError(f"the archive's byteorder record says {order[:20]!r}, not "
                                 f"little or big; {DAMAGED}")
            self._byteorder = order.decode()

    def storage(self, key: str, dtype: np.dtype, numel: int) -> Storage:
        if (key, dtype, numel) not in self._read:
            name = f"{self._prefix}/data/{key}"
            # The size the archive states for the record, checked before it is inflated.
            check_record(key, dtype, numel, self._zf.getinfo(name).file_size)
            raw = safe_arrays.read_member(self._zf, name, numel * dtype.itemsize,
                                          what=f"storage {key!r}")
            self._read[key, dtype, numel] = storage_from_bytes(key, dtype, numel, raw,
                                                               self._byteorder)
        return self._read[key, dtype, numel]


class LegacyRecords:
    """The storages of a legacy torch file. Surveying (`arrays` None) notes the storages
    the pickle names (`wanted`: key -> (dtype, numel)); reading hands out `arrays`."""

    def __init__(self, arrays: dict[str, Storage] | None = None):
        self.arrays, self.wanted = arrays, {}

    def storage(self, key: str, dtype: np.dtype, numel: int) -> Storage:
        if self.arrays is None:
            if self.wanted.setdefault(key, (dtype, numel)) != (dtype, numel):
                raise ValueError(f"storage {key!r} is named with two types or sizes; "
                                 f"{DAMAGED}")
            return Storage(key, dtype, numel, None)
        storage = self.arrays[key]
        if (storage.dtype, storage.numel) != (dtype, numel):
            raise ValueError(f"storage {key!r} is named with two types or sizes; {DAMAGED}")
        return storage


class _StateDictUnpickler(ArchiveUnpickler):
    """The pickle of a `torch.save`d state dict: dicts of tensors (as NumPy arrays) only."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _REBUILD_PARAMETER
        try:
            return super().find_class(module, name)
        except pickle.UnpicklingError:
            raise pickle.UnpicklingError(f"{module}.{name}: only a state dict of tensors is "
                                         f"read") from None


def _parameter_data(data, requires_grad, backward_hooks):
    return data


_REBUILD_PARAMETER = safe_arrays.Constructor("torch._utils._rebuild_parameter",
                                             _parameter_data)


class _DataUnpickler(pickle.Unpickler):
    """Plain data (numbers, strings, lists, dicts): every global refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"unexpected global {module}.{name} in a legacy torch "
                                     f"file's header")


def load_archive(zf: zipfile.ZipFile, unpickler: type = _StateDictUnpickler):
    """The object a `torch.save` zip archive holds, read by `unpickler` (an
    `ArchiveUnpickler`) from its one `<prefix>/data.pkl`."""
    pkl = [n for n in zf.namelist() if n.endswith("data.pkl")]
    if len(pkl) != 1:
        raise ValueError(f"expected one data.pkl, found {pkl[:4]}")
    prefix = pkl[0][: -len("/data.pkl")]
    data = safe_arrays.read_member(zf, pkl[0], what="the archive's data.pkl")
    return unpickler(io.BytesIO(data), zf, prefix).load()


def load_legacy(data: bytes, unpickler: type = _StateDictUnpickler):
    """The object a legacy (non-zip) `torch.save` file holds, read by `unpickler` (an
    `ArchiveUnpickler`). The pickle is read twice: once to learn the storages it names,
    whose records follow it, and once with them. Raises ValueError unless the header is
    torch's, every storage named has one record of exactly its size, and no other."""
    f = io.BytesIO(data)
    magic, protocol, info = (_DataUnpickler(f).load() for _ in range(3))
    if magic != LEGACY_MAGIC or protocol != LEGACY_PROTOCOL or not isinstance(info, dict):
        raise ValueError(f"not a legacy torch file (magic number {str(magic)[:30]}, "
                         f"protocol {str(protocol)[:10]})")
    if info.get("little_endian") is not True:
        raise ValueError("a big-endian legacy torch file; re-save it on a little-endian "
                         "machine")
    start, survey = f.tell(), LegacyRecords()
    unpickler(f, survey).load()
    keys = _DataUnpickler(f).load()
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)
            and sorted(keys) == sorted(survey.wanted)):
        raise ValueError(f"its storage keys {str(keys)[:80]} are not the "
                         f"{len(survey.wanted)} storages its tensors name; {DAMAGED}")
    buf, at, arrays = memoryview(data), f.tell(), {}
    for key in keys:
        dtype, numel = survey.wanted[key]
        count = int.from_bytes(buf[at:at + 8], "little", signed=True)
        if count != numel:
            raise ValueError(f"storage {key!r}: its record counts {count} elements, its "
                             f"tensors name {numel}; {DAMAGED}")
        raw = buf[at + 8:at + 8 + numel * dtype.itemsize]
        arrays[key] = storage_from_bytes(key, dtype, numel, raw)
        at += 8 + len(raw)
    f.seek(start)
    return unpickler(f, LegacyRecords(arrays)).load()


def read_state_dict(path: str | os.PathLike, corrupt: CorruptError) -> dict[str, np.ndarray]:
    """All tensors of a weights file as `{name: float32 ndarray}` in torch layout.

    `.safetensors`: `safetensors.numpy`. A `torch.save` zip archive (`load_archive`) or a
    legacy non-zip torch file, which starts with pickle protocol 2 (`load_legacy`): read
    without torch. A wrapping `{'model': ...}`, `{'state_dict': ...}` or
    `{'teacher': ...}` is unwrapped; entries that are no arrays are left out. Raises
    ImportError naming the package to install (safetensors), or `corrupt(path, expected,
    error)` for a file that is none of these or holds no state dict of tensors (`error`
    names a damaged storage by its key).
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
        sd = _read(path, corrupt, "a torch.save archive of a state dict")
    else:
        sd = _read(path, corrupt, "a torch zip archive, .safetensors or legacy torch file")
    for key in ("model", "state_dict", "teacher"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict):
        raise corrupt(path, "a state dict", TypeError(f"it holds a {type(sd).__name__}"))
    return {str(k): np.asarray(v, np.float32) for k, v in sd.items()
            if isinstance(v, np.ndarray)}


def _read(path: Path, corrupt: CorruptError, expected: str) -> object:
    """The object of the torch file `path` (zip or legacy), or `corrupt(...)`."""
    data = None if zipfile.is_zipfile(path) else path.read_bytes()
    try:
        if data is None:
            with zipfile.ZipFile(path) as zf:
                return load_archive(zf)
        if data[:2] != b"\x80\x02":  # torch's legacy format is pickle protocol 2; else a zip
            raise ValueError(f"it starts with {data[:2]!r}")
        return load_legacy(data)
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, OSError, KeyError,
            ValueError, TypeError, IndexError, OverflowError, RecursionError,
            UnicodeDecodeError) as e:
        raise corrupt(path, expected, e) from None
