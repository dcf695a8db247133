"""Arrays from the bytes of a file from elsewhere, through one constructor that reads
nothing beyond those bytes.

Every reader of such files builds its arrays with `array_from_bytes`: the tensors of a
torch file (`torch_weights`: zip archives and legacy files, for the SD VAE, DINOv2,
Inception-v3 and the release's files), numpy's arrays inside a pickle (`NUMPY_GLOBALS`:
the release's pickles, `release/unpickler.py`, and reference statistics,
`evaluation/fid.py`), `.npy` files and the members of `.npz` archives (`read_npy`,
`read_npz`). (`.safetensors` files are read by the safetensors package, which checks
its own offsets.) What it guarantees:

- the dtype is one of `DTYPES` (bool, int8-int64, uint8-uint64, float16/32/64 and
  bfloat16), looked up by name: no structured, sub-array, object or datetime dtype is
  ever made from a file, so no field can sit at an offset outside an element;
- the file's byte order is honoured: big-endian bytes come back converted to native;
- the shape's elements times the itemsize are exactly the bytes present, counted in
  Python integers (no overflow), before any array is made;
- a member of a zip archive (`read_member`) may expand to at most `MAX_EXPANSION` times
  its compressed size or `FREE_BYTES`, whichever is larger, checked before it inflates;
- BUILD (`__setstate__`) of a pickle runs only on the plain data containers whose
  pickles need it, each with its state checked: a global resolves to a `Constructor`
  or a class of the `Sealed` metaclass, which no BUILD and no attribute can change.

Each refusal is one ValueError line naming what was refused and what to do; the readers
add the file's name.
"""
from __future__ import annotations

import io
import math
import operator
import re
import zipfile
from typing import Callable

import ml_dtypes
import numpy as np

# The dtypes a file's arrays may have, by name, in native byte order.
DTYPES: dict[str, np.dtype] = {name: np.dtype(t) for name, t in {
    "bool": np.bool_, "int8": np.int8, "int16": np.int16, "int32": np.int32,
    "int64": np.int64, "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32,
    "uint64": np.uint64, "float16": np.float16, "float32": np.float32,
    "float64": np.float64, "bfloat16": ml_dtypes.bfloat16}.items()}
# numpy's type codes (`dtype.str` without the byte order: what its pickles and .npy
# headers write) of those dtypes; bfloat16 has none (a pickle names it by class).
_CODES = {f"{d.kind}{d.itemsize}": name for name, d in DTYPES.items() if name != "bfloat16"}
_DESCR = re.compile(r"([<>|=]?)([a-z]\d+)")
MAX_DIMS = 32                # numpy 1's limit on an array's dimensions
MAX_EXPANSION = 64           # a compressed zip member inflates to at most 64x its size,
FREE_BYTES = 64 << 20        # or to 64 MiB whatever its compression
FIX = "re-download the file, or re-save it with numpy or torch.save from a trusted copy"


def _refuse(what: str, problem: str, fix: str = FIX) -> ValueError:
    return ValueError(" ".join(f"{what}: {problem}; {fix}".split()))


def plain_dtype(dtype, what: str = "an array") -> tuple[np.dtype, str]:
    """`(the DTYPES entry, the byte order '<' or '>' of its bytes)` that `dtype` names:
    a name (`'float32'`), numpy's code with its byte order (`'>f4'`, `'|b1'`, as .npy
    headers and pickles write them) or a numpy dtype. '=' and '|' are this machine's
    order. Raises ValueError naming `dtype` for any other (object, structured, complex,
    datetime ...)."""
    order, name = "=", None
    if isinstance(dtype, np.dtype):
        if dtype.fields is None and dtype.subdtype is None and dtype.name in DTYPES:
            order, name = dtype.byteorder, dtype.name
    elif isinstance(dtype, str):
        m = _DESCR.fullmatch(dtype)
        if dtype in DTYPES:
            name = dtype
        elif m:
            order, name = m[1] or "=", _CODES.get(m[2])
    if name is None:
        raise _refuse(what, f"dtype {str(dtype)[:60]!r} is not read (only plain numbers: "
                      f"{', '.join(DTYPES)})", "re-save the arrays in one of those dtypes "
                      "(e.g. float32)")
    if order in "=|":
        order = "<" if np.little_endian else ">"
    return DTYPES[name], order


def check_shape(shape, what: str = "an array") -> tuple[int, ...]:
    """`shape` as a tuple of at most `MAX_DIMS` non-negative ints; ValueError otherwise."""
    try:
        shape = tuple(map(operator.index, shape))
    except TypeError:
        raise _refuse(what, f"its shape {str(shape)[:60]} is not a tuple of integers") \
            from None
    if len(shape) > MAX_DIMS or any(n < 0 for n in shape):
        raise _refuse(what, f"its shape {str(shape)[:60]} has a negative size or more than "
                      f"{MAX_DIMS} dimensions")
    return shape


def array_from_bytes(raw, dtype, shape, *, byteorder: str | None = None,
                     order: str = "C", what: str = "an array") -> np.ndarray:
    """The array of `shape` (C or Fortran `order`) whose elements are the bytes `raw`
    (bytes, bytearray or memoryview) in `dtype` (`plain_dtype`), read in `byteorder`
    ('little' or 'big'; None: the one `dtype` states), in native byte order.

    A read-only view of `raw` where its bytes are already native, else a converted copy;
    bool elements are 0 or 1. Raises ValueError naming `what` for a dtype outside
    `DTYPES`, a bad shape, or bytes that are not exactly the shape's elements."""
    dt, file_order = plain_dtype(dtype, what)
    if byteorder is not None:
        if byteorder not in ("little", "big"):
            raise _refuse(what, f"byte order {str(byteorder)[:20]!r} is neither little nor big")
        file_order = "<" if byteorder == "little" else ">"
    shape = check_shape(shape, what)
    if order not in ("C", "F"):
        raise _refuse(what, f"memory order {str(order)[:10]!r} is neither C nor F")
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise _refuse(what, f"its data is a {type(raw).__name__}, not bytes")
    count, nbytes = math.prod(shape), memoryview(raw).nbytes
    if count * dt.itemsize != nbytes:
        raise _refuse(what, f"it holds {nbytes} bytes, not the {count} x {dt.itemsize} "
                      f"of its {dt.name} shape {shape[:8]}")
    if count == 0:
        empty = np.zeros(shape, dt, order=order)
        empty.flags.writeable = False
        return empty
    native = file_order == ("<" if np.little_endian else ">")
    if native or dt.itemsize == 1:
        flat = np.frombuffer(raw, dt, count)
    else:  # swapped as unsigned integers of the same size: every dtype of DTYPES has one
        swapped = np.dtype(f"u{dt.itemsize}").newbyteorder(file_order)
        flat = np.frombuffer(raw, swapped, count).astype(f"=u{dt.itemsize}").view(dt)
    if dt == np.bool_:
        flat = flat.view(np.uint8) != 0
    flat.flags.writeable = False
    return flat.reshape(shape, order=order)


# ---------------------------------------------------------------------------------------
# Members of zip archives, .npy and .npz files.

def read_member(zf: zipfile.ZipFile, name: str, nbytes: int | None = None,
                what: str | None = None) -> bytes:
    """The bytes of the member `name` of `zf`, `nbytes` of them when given. Refused
    before it inflates (ValueError naming `what`, default the member): a member whose
    size is not `nbytes`, or that would expand to more than `MAX_EXPANSION` times its
    compressed size and more than `FREE_BYTES`."""
    what = what or f"member {name!r}"
    info = zf.getinfo(name)
    if nbytes is not None and info.file_size != nbytes:
        raise _refuse(what, f"it holds {info.file_size} bytes, not the {nbytes} it should")
    if info.compress_type != zipfile.ZIP_STORED and \
            info.file_size > max(MAX_EXPANSION * info.compress_size, FREE_BYTES):
        raise _refuse(what, f"its {info.compress_size} compressed bytes would expand to "
                      f"{info.file_size}, more than {MAX_EXPANSION} times as many (and over "
                      f"{FREE_BYTES >> 20} MiB)", "store it uncompressed (as torch.save and "
                      "np.savez do) if it is what you expect")
    raw = zf.read(name)
    if len(raw) != info.file_size:
        raise _refuse(what, f"it holds {len(raw)} bytes, not the {info.file_size} its "
                      f"record states")
    return raw


def npy_header(head, what: str = "a .npy file") -> tuple[tuple[int, ...], np.dtype, str, int]:
    """`(shape, dtype, byte order, offset of the data)` from the start of a `.npy`
    file (numpy's format 1.0 or 2.0), its dtype checked by `plain_dtype`. Raises
    ValueError naming `what` for anything else."""
    f = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(f)
        read = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read is None:
            raise ValueError(f"format version {version} is not read here")
        shape, fortran, dtype = read(f)
    except (ValueError, SyntaxError, TypeError) as e:
        raise _refuse(what, f"not a .npy array ({type(e).__name__}: {str(e)[:200]})") from None
    dt, byteorder = plain_dtype(dtype, what)
    return check_shape(shape, what), dt, ("F" if fortran else "C") + byteorder, f.tell()


def read_npy(data, what: str = "a .npy file") -> np.ndarray:
    """The array of the `.npy` file whose bytes are `data` (`npy_header`, then
    `array_from_bytes` of exactly the bytes after it), read-only."""
    shape, dt, layout, offset = npy_header(data, what)
    byteorder = "little" if layout[1] == "<" else "big"
    return array_from_bytes(memoryview(data)[offset:], dt, shape, byteorder=byteorder,
                            order=layout[0], what=what)


def read_npz(path, what: str | None = None) -> dict[str, np.ndarray]:
    """`{name: array}` of the `.npy` members of the `.npz` archive `path` (`name`
    without `.npy`; `read_member`, then `read_npy`), writeable copies. Raises
    ValueError naming the file and the member it refuses."""
    what = what or str(path)
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise _refuse(what, f"not an .npz archive ({type(e).__name__}: {e})") from None
    with zf:
        out = {}
        for name in zf.namelist():
            if name.endswith(".npy"):
                where = f"{what}, array {name[:-4]!r}"
                try:
                    out[name[:-4]] = np.array(read_npy(read_member(zf, name, what=where),
                                                       where))
                except (zipfile.BadZipFile, EOFError, OSError, NotImplementedError) as e:
                    raise _refuse(where, f"its bytes do not read ({type(e).__name__}: "
                                  f"{e})") from None
        return out


# ---------------------------------------------------------------------------------------
# Pickles: globals that no BUILD changes, and numpy's arrays through array_from_bytes.

class Sealed(type):
    """The metaclass of every class a file's pickle may name (the stand-ins of
    `release/unpickler.py`, `torch_weights.ScriptObject`): BUILD on the class itself and
    setting or deleting any of its attributes raise ValueError, so no file changes a
    class for the rest of the process. Its instances keep their own `__setstate__`."""

    def __setattr__(cls, name, value):
        raise _refuse(f"class {cls.__name__}", f"a file may not set its attribute "
                      f"{str(name)[:40]!r}", "the file is hostile or damaged; do not use it")

    def __delattr__(cls, name):
        raise _refuse(f"class {cls.__name__}", f"a file may not delete its attribute "
                      f"{str(name)[:40]!r}", "the file is hostile or damaged; do not use it")

    @property
    def __setstate__(cls):  # a data descriptor: BUILD on the class finds this first
        def refuse(state):
            raise _refuse(f"class {cls.__name__}", "the pickle BUILDs the class itself, "
                          "which no file of data does", "the file is hostile or damaged; "
                          "do not use it")
        return refuse


class Constructor:
    """A global of a pickle as a callable of data: calls `fn(*args)`. No BUILD and no
    attribute change it (a plain function's `__defaults__` could be set by BUILD)."""
    __slots__ = ("name", "_fn")

    def __init__(self, name: str, fn: Callable):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args):
        return self._fn(*args)

    def __setattr__(self, name, value):
        raise _refuse(self.name, f"a file may not set its attribute {str(name)[:40]!r}",
                      "the file is hostile or damaged; do not use it")

    def __setstate__(self, state):
        raise _refuse(self.name, "the pickle BUILDs this constructor, which no file of "
                      "data does", "the file is hostile or damaged; do not use it")

    def __repr__(self):
        return f"<constructor {self.name}>"


class _Dtype:
    """What `numpy.dtype(code, align, copy)` makes in a pickle here: a `DTYPES` entry
    named by numpy's code, whose byte order the BUILD that follows may state."""
    __slots__ = ("dtype", "byteorder")

    def __init__(self, code, align=False, copy=False):
        if not isinstance(code, str) or code not in _CODES:
            raise _refuse("numpy.dtype of the pickle", f"dtype {str(code)[:40]!r} is not "
                          f"read (only plain numbers: {', '.join(DTYPES)})")
        self.dtype, self.byteorder = DTYPES[_CODES[code]], "="

    def __setstate__(self, state):
        """numpy's state of a plain dtype, `(3, byteorder, None, None, None, -1, -1, 0)`:
        anything else (fields, sub-arrays, another size) is refused."""
        if not (type(state) is tuple and len(state) == 8 and state[0] == 3
                and state[1] in ("<", ">", "|", "=") and state[2:] == (None,) * 3 + (-1, -1, 0)
                and (state[1] != "|" or self.dtype.itemsize == 1)):
            raise _refuse("numpy.dtype of the pickle", f"the state {str(state)[:80]} of "
                          f"dtype {self.dtype.name} is not a plain dtype's (a structured, "
                          f"sub-array or resized dtype)")
        self.byteorder = state[1]

    def file_dtype(self) -> np.dtype:
        return self.dtype.newbyteorder(self.byteorder)


def _file_dtype(dtype) -> np.dtype:
    if type(dtype) is not _Dtype:
        raise _refuse("a numpy array of the pickle", f"its dtype is a {type(dtype).__name__}, "
                      f"not numpy.dtype of a plain number")
    return dtype.file_dtype()


class _PickledArray(np.ndarray):
    """What numpy's `_reconstruct(ndarray, (0,), b'b')` makes here: the empty array that
    numpy's pickles fill by one BUILD of `(1, shape, dtype, is_fortran, bytes)`, checked
    and made by `array_from_bytes`."""

    def __setstate__(self, state):
        if not (type(state) is tuple and len(state) == 5 and state[0] == 1
                and type(state[3]) is bool and self.shape == (0,) and self.dtype == np.int8):
            raise _refuse("a numpy array of the pickle", f"its state {str(state)[:80]} is not "
                          f"numpy's (1, shape, dtype, is_fortran, bytes), given once")
        _, shape, dtype, fortran, raw = state
        a = array_from_bytes(raw, _file_dtype(dtype), shape, order="F" if fortran else "C",
                             what="a numpy array of the pickle")
        super().__setstate__((1, a.shape, a.dtype, False, np.ascontiguousarray(a).tobytes()))


def _reconstruct(subtype, shape, code):
    if subtype is not NdarrayName or shape != (0,) or code != b"b":
        raise _refuse("numpy's _reconstruct in the pickle", "it is only read as numpy writes "
                      "it: (numpy.ndarray, (0,), b'b')")
    return np.ndarray.__new__(_PickledArray, (0,), np.int8)


def _scalar(dtype, raw):
    """numpy's `scalar(dtype, bytes)`: one element."""
    return array_from_bytes(raw, _file_dtype(dtype), (), what="a numpy scalar of the "
                            "pickle")[()]


def _frombuffer(buf, dtype, shape, order):
    """numpy's `_frombuffer(bytes, dtype, shape, order)` (pickle protocol 5)."""
    return np.array(array_from_bytes(buf, _file_dtype(dtype), shape, order=order,
                                     what="a numpy array of the pickle"))


class NdarrayName(metaclass=Sealed):
    """What the global `numpy.ndarray` names here: the first argument of numpy's
    `_reconstruct`, not a class a pickle can call."""

    def __new__(cls, *args, **kwargs):
        raise _refuse("numpy.ndarray in the pickle", "it is only an argument of numpy's "
                      "_reconstruct here")


# numpy's pickling globals (numpy 1 and 2 module names), each through array_from_bytes.
NUMPY_GLOBALS: dict[tuple[str, str], object] = {("numpy", "ndarray"): NdarrayName,
                                                ("numpy", "dtype"): Constructor("numpy.dtype",
                                                                                _Dtype)}
for _core in ("numpy.core", "numpy._core"):
    NUMPY_GLOBALS.update({
        (f"{_core}.multiarray", "_reconstruct"): Constructor("numpy _reconstruct", _reconstruct),
        (f"{_core}.multiarray", "scalar"): Constructor("numpy scalar", _scalar),
        (f"{_core}.numeric", "_frombuffer"): Constructor("numpy _frombuffer", _frombuffer)})
