"""Every array read from a file is made by one constructor (`encoders.safe_arrays`): what a
file stores comes back as its values, or as one ValueError line naming the file, the
problem and what to do; never bytes from outside the file, a crash, or a changed class.

- Hostile payloads: a numpy dtype rebuilt by BUILD into a structured dtype whose
  field sits at offset 4096, 2**30 or 2**40 (a release-shaped pickle through
  `--mode=convert`, a statistics pickle through `--ref`); BUILD on an allowlisted class;
  a torch zip whose `byteorder` record says big (read as torch.load reads it); a deflated
  storage of 2**28 zero bytes (refused before it inflates); an `.npy` header claiming
  2**40 items in a 16-byte file; object arrays; bfloat16 tensors (read).
- A grammar of pickles (numpy's array globals with generated dtypes, byte orders,
  shapes, memory orders and BUILD states; BUILD on every allowlisted global and on the
  containers) over the release's reader and the statistics reader, and of torch zip
  records (byte order, dtype, shape, record size, compression) over the four torch
  readers (`torch_weights`, DINOv2, the SD VAE, the release's `torch_load`): each result
  is the stored values or one ValueError naming the file, and no class has changed.
"""
from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edm2_jax.data.latents import LatentFolder
from edm2_jax.encoders import safe_arrays, torch_weights, vae
from edm2_jax.evaluation import dinov2, fid
from edm2_jax.release import pickle_io, unpickler
from tests.test_untrusted_files import Build, Call, Global, New, Persistent, dumps, tensor

REPO = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None
SETTINGS = settings(max_examples=120, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])
NATIVE = "<" if sys.byteorder == "little" else ">"


def one_line_naming(e: BaseException, path) -> str:
    """The message of a refusal: a ValueError of one line naming `path`."""
    message = str(e)
    assert isinstance(e, ValueError), f"{type(e).__name__}: {message}"
    assert "\n" not in message and str(path) in message, message
    return message


def torch_missing(e: BaseException) -> bool:
    """Whether `e` is the one line a reader gives, without torch installed, for a pickle
    naming one of torch's globals (read with torch, the same pickle is read or refused
    as the test expects): `TorchMissingError`, naming the install."""
    if HAS_TORCH or not isinstance(e, unpickler.TorchMissingError):
        return False
    assert "\n" not in str(e) and "pip install" in str(e), str(e)
    return True


def refusal(read, path) -> str:
    with pytest.raises((ValueError, unpickler.TorchMissingError)) as info:
        read(path)
    if torch_missing(info.value):
        return str(info.value)
    return one_line_naming(info.value, path)


# ---------------------------------------------------------------------------------------
# Payload makers: numpy's pickling of arrays, opcode by opcode.

def np_dtype(code, state="plain", order=NATIVE):
    """`numpy.dtype(code, False, True)`, then BUILD of `state` (None: no BUILD)."""
    made = Call(Global("numpy", "dtype"), (code, False, True))
    return made if state is None else Build(made, (3, order, None, None, None, -1, -1, 0)
                                            if state == "plain" else state)


def field_at(offset: int, itemsize: int = 4):
    """numpy's state of a structured dtype of one float32 field `a` at `offset`."""
    return (3, "|", None, ("a",), {"a": (np_dtype("f4"), offset)}, itemsize, 1, 16)


def empty_array(core="numpy.core"):
    """numpy's `_reconstruct(ndarray, (0,), b'b')`: the array its BUILD then fills."""
    return Call(Global(f"{core}.multiarray", "_reconstruct"),
                (Global("numpy", "ndarray"), (0,), b"b"))


def np_array(dtype, shape, raw, fortran=False, core="numpy.core"):
    """An array as numpy pickles it: `_reconstruct(ndarray, (0,), b'b')`, then BUILD."""
    return Build(empty_array(core), (1, tuple(shape), dtype, fortran, raw))


def structured(offset: int, n: int = 4):
    """Weights of n elements whose one field sits `offset` bytes in."""
    return np_array(np_dtype("V4", field_at(offset)), (n,), b"\0" * 4 * n)


def torch_zip(path: Path, storage: str, numel: int, size, raw: bytes, *,
              byteorder: bytes | None = None, deflate: bool = False, key: str = "w"):
    """A `torch.save` zip archive of `{key: tensor}`, its one storage record `raw`."""
    pid = ("storage", Global("torch", storage), "0", "cpu", numel)
    stride = tuple(math.prod(size[i + 1:]) for i in range(len(size)))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", dumps({key: tensor(Persistent(pid), 0, size, stride)}))
        if byteorder is not None:
            z.writestr("archive/byteorder", byteorder)
        z.writestr("archive/data/0", raw,
                   zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED)
        z.writestr("archive/version", "3\n")


def npy_bytes(descr: str, shape, data: bytes) -> bytes:
    """A `.npy` file (format 1.0) whose header states `descr` and `shape`, then `data`."""
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": descr, "fortran_order": False,
                                             "shape": tuple(shape)})
    return f.getvalue() + data


def _corrupt(path, expected, e):
    return ValueError(f"{path} is not {expected} ({' '.join(str(e).split())})")


def _release_pickle(path):
    def load():
        with open(path, "rb") as f:
            return unpickler.ReleaseUnpickler(f).load()
    return unpickler.read_untrusted(str(path), load)


# The torch readers, each `path -> the float32 values of tensor 'w'`.
ZIP_READERS = {
    "torch_weights": lambda p: torch_weights.read_state_dict(p, _corrupt)["w"],
    "dinov2": lambda p: dinov2.read_state_dict(p)["w"],
    "vae": lambda p: vae.read_state_dict(p)["w"],
}
if HAS_TORCH:
    ZIP_READERS["release"] = lambda p: pickle_io.to_numpy(unpickler.torch_load(str(p))["w"])


# ---------------------------------------------------------------------------------------
# The hostile cases.

ISSUE_STRUCTURED = r"""
import contextlib, io, json, sys
from edm2_jax.evaluation import fid
from edm2_jax.modes import common
from edm2_jax.release import convert
out = []
for net, ref, workdir in json.load(sys.stdin):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = common.report_errors(lambda: convert.main_convert(net, workdir))
    try:
        fid.load_ref_stats(ref)
        got = ["returned", ""]
    except BaseException as e:
        got = [type(e).__name__, str(e)]
    out.append([rc, err.getvalue().strip().splitlines(), got])
print(json.dumps(out))
"""


def test_a_dtype_rebuilt_into_a_field_at_any_offset_is_one_error_line(tmp_path):
    """Heap bytes as weights (4096), a segfault in `to_numpy` (2**30) and an
    OverflowError (2**40) before: now `--mode=convert` and `--ref` refuse the dtype in one
    line naming the file. The loads run in a subprocess, so a crash fails the test."""
    cases = []
    for offset in (4096, 2**30, 2**40):
        net = tmp_path / f"edm2-img64-s-0000001-{offset}.pkl"
        net.write_bytes(dumps({"ema": {"unet.enc.conv.weight": structured(offset)}}))
        ref = tmp_path / f"ref-{offset}.pkl"
        ref.write_bytes(dumps({"fid": {"mu": structured(offset),
                                       "sigma": np_array(np_dtype("V4", field_at(offset)),
                                                         (4, 4), b"\0" * 64)}}))
        cases.append([str(net), str(ref), str(tmp_path / f"out-{offset}")])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", ISSUE_STRUCTURED], input=json.dumps(cases),
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for (net, ref, workdir), (rc, err, got) in zip(cases, json.loads(r.stdout.splitlines()[-1])):
        assert rc == 1 and len(err) == 1 and err[0].startswith(f"error: {net}"), err
        assert "dtype 'V4' is not read" in err[0], err
        assert not os.path.exists(workdir)
        assert got[0] == "ValueError" and "\n" not in got[1], got
        assert ref in got[1] and "dtype 'V4' is not read" in got[1], got
    # The same field through a plain float32 code, and one inside a sub-array: refused.
    for state in (field_at(4096), (3, "|", (np_dtype("f4"), (2,)), None, None, 8, 1, 0),
                  (3, NATIVE, None, None, None, 2**30, 1, 0)):
        path = tmp_path / "f4.pkl"
        path.write_bytes(dumps({"ema": {"unet.w": np_array(np_dtype("f4", state), (4,),
                                                           b"\0" * 16)}}))
        assert "not a plain dtype's" in refusal(pickle_io.load_state_dict, path)


SEALED = {("dnnlib.util", "EasyDict"): unpickler.EasyDict,
          ("torch.nn.modules.container", "ModuleDict"): unpickler.ModuleDict,
          ("numpy", "ndarray"): safe_arrays.NdarrayName}


def class_state() -> dict:
    """What a pickle must never change: every attribute of the classes and functions a
    pickle's globals resolve to, the containers they make, and the globals' table."""
    classes = (unpickler.EasyDict, unpickler.ModuleDict, unpickler.PersistentObject,
               safe_arrays.NdarrayName, safe_arrays.Constructor, safe_arrays.Sealed,
               safe_arrays._Dtype, safe_arrays._PickledArray, torch_weights.ScriptObject,
               torch_weights.StorageType, torch_weights.Storage, OrderedDict, dict, set,
               np.ndarray, np.dtype)
    out = {c.__qualname__: dict(vars(c)) for c in classes}
    tables = {**unpickler.RELEASE_GLOBALS, **fid._StatsUnpickler._ALLOWED,
              **torch_weights._STORAGE_TYPES}
    out["tables"] = dict(tables)
    for key, g in tables.items():
        fn = getattr(g, "_fn", g)
        out[key] = (getattr(g, "name", None), fn, getattr(fn, "__defaults__", None),
                    getattr(fn, "__kwdefaults__", None), getattr(fn, "__code__", None),
                    dict(getattr(fn, "__dict__", {})))
    return out


def test_build_on_an_allowlisted_class_or_constructor_is_refused_and_changes_nothing(
        tmp_path):
    before = class_state()
    path = tmp_path / "net.pkl"
    targets = [Global(*k) for k in (*SEALED, ("numpy", "dtype"), ("collections", "OrderedDict"),
                                    ("numpy._core.multiarray", "_reconstruct"),
                                    ("torch_utils.persistence", "_reconstruct_persistent_obj"))]
    meta = {"class_name": "Precond", "state": {}}
    persistent = Call(Global("torch_utils.persistence", "_reconstruct_persistent_obj"), (meta,))
    targets.append(persistent)  # an instance: its record comes by its call, never by BUILD
    for target in targets:
        for state in ((None, {"get": Global("builtins", "set")}), {"get": 1},
                      (None, {"__class__": Global("dnnlib.util", "EasyDict")})):
            path.write_bytes(dumps({"ema": {"unet.w": Build(target, state)}}))
            refusal(pickle_io.load_release, path)
            ref = tmp_path / "ref.pkl"
            ref.write_bytes(dumps({"fid": {"mu": np.zeros(2), "sigma": np.eye(2)},
                                   "x": Build(target, state)}))
            refusal(fid.load_ref_stats, ref)
    assert class_state() == before
    assert unpickler.EasyDict.get is dict.get
    assert unpickler.EasyDict(a=1).get("a") == 1


def test_a_big_endian_torch_zip_reads_its_values(tmp_path):
    """`[0.5, 1.5, 2.5, 3.5]` stored big-endian, as the archive's byteorder record says:
    every reader gives those values (and torch.load agrees)."""
    values = np.array([0.5, 1.5, 2.5, 3.5], np.float32)
    path = tmp_path / "big.pth"
    torch_zip(path, "FloatStorage", 4, (4,), values.astype(">f4").tobytes(), byteorder=b"big")
    if HAS_TORCH:
        import torch
        with warnings.catch_warnings():  # our writer's pickle protocol 3, not torch's 2
            warnings.simplefilter("ignore", UserWarning)
            np.testing.assert_array_equal(torch.load(path, weights_only=True)["w"].numpy(),
                                          values)
    for name, read in ZIP_READERS.items():
        got = read(path)
        assert got.dtype == np.float32 and got.tolist() == values.tolist(), name
    torch_zip(path, "FloatStorage", 4, (4,), values.tobytes(), byteorder=b"middle")
    for read in ZIP_READERS.values():
        assert "byteorder record says" in refusal(read, path)


BOMB_RSS = r"""
import re, sys
from edm2_jax.encoders import torch_weights
try:
    torch_weights.read_state_dict(sys.argv[1], lambda p, what, e: ValueError(f"{p}: {e}"))
    print("read")
except ValueError as e:  # the peak memory of this process (ru_maxrss counts its parent's)
    peak = re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read())
    print(int(peak[1]) // 1024 if peak else 0, str(e))
"""


def test_a_deflated_storage_is_capped_by_its_compressed_size_before_it_inflates(tmp_path):
    """2**28 zero bytes deflate to well under 1 MB; the record says so, and no reader
    inflates it (the subprocess's peak memory stays far below the 256 MiB it would take).
    A small deflated storage reads as its values."""
    path = tmp_path / "bomb.pth"
    numel = 2**26
    pid = ("storage", Global("torch", "FloatStorage"), "0", "cpu", numel)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", dumps({"w": tensor(Persistent(pid), 0, (numel,), (1,))}))
        with z.open("archive/data/0", "w", force_zip64=True) as f:
            zeros = bytes(1 << 24)
            for _ in range(numel * 4 // len(zeros)):
                f.write(zeros)
    assert path.stat().st_size < 1 << 20
    for read in ZIP_READERS.values():
        assert "would expand to 268435456" in refusal(read, path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", BOMB_RSS, str(path)], capture_output=True,
                       text=True, env=env, timeout=300)
    rss, message = r.stdout.split(" ", 1)
    assert "would expand" in message and int(rss) < 200, r.stdout
    values = np.arange(1000, dtype=np.float32) % 3
    torch_zip(path, "FloatStorage", 1000, (10, 100), values.tobytes(), deflate=True)
    for read in ZIP_READERS.values():
        np.testing.assert_array_equal(read(path), values.reshape(10, 100))


def test_an_npy_header_claiming_more_than_its_bytes_is_refused(tmp_path):
    """2**40 items in a 16-byte file: a ValueError naming the file (an .npz of reference
    statistics or weights, a latent data set), not a raw `_ArrayMemoryError`."""
    claim = npy_bytes("<f4", (2**40,), b"\0" * 16)
    npz = tmp_path / "ref.npz"
    with zipfile.ZipFile(npz, "w") as z:
        z.writestr("mu.npy", claim)
        z.writestr("sigma.npy", npy_bytes("<f8", (1, 1), b"\0" * 8))
    assert "holds 16 bytes, not the 1099511627776 x 4" in refusal(fid.load_ref_stats, npz)
    weights = tmp_path / "w.npz"
    with zipfile.ZipFile(weights, "w") as z:
        z.writestr("w/unet.x.npy", claim)
    assert "holds 16 bytes" in refusal(pickle_io.load_release, weights)
    latents = tmp_path / "latents"
    (latents / "00000").mkdir(parents=True)
    (latents / "00000" / "img-mean-std-00000000.npy").write_bytes(
        npy_bytes("<f4", (8, 2**19, 2**19), b"\0" * 16))
    # A latent data set checks the header against the file when it is opened (before a
    # network is built at the side it declares); read anyway, the array is refused too.
    message = refusal(lambda p: LatentFolder(str(p), use_labels=False), latents)
    assert "larger than the 512 a side" in message and "img-mean-std-00000000.npy" in message
    assert "holds 16 bytes" in refusal(
        lambda p: safe_arrays.read_npy((p / "00000" / "img-mean-std-00000000.npy").read_bytes(),
                                       str(p)), latents)


def test_object_arrays_are_refused_naming_the_file_and_the_dtype(tmp_path):
    npz = tmp_path / "ref.npz"
    np.savez(npz, mu=np.array([1.0, None], dtype=object), sigma=np.eye(2))
    assert "dtype 'object' is not read" in refusal(fid.load_ref_stats, npz)
    weights = tmp_path / "w.npz"
    np.savez(weights, **{"w/unet.x": np.array([1.0, None], dtype=object)})
    assert "dtype 'object' is not read" in refusal(pickle_io.load_release, weights)
    pkl = tmp_path / "net.pkl"
    pkl.write_bytes(dumps({"ema": {"unet.x": np_array(np_dtype("O8"), (1,), b"\0" * 8)}}))
    assert "dtype 'O8' is not read" in refusal(pickle_io.load_release, pkl)
    latents = tmp_path / "latents"
    latents.mkdir()
    (latents / "a.npy").write_bytes(npy_bytes("|O", (8, 2, 2), b"\0" * 256))
    assert "dtype 'object' is not read" in refusal(lambda p: LatentFolder(str(p), use_labels=False),
                                                 latents)


def test_bfloat16_tensors_are_read_and_other_dtypes_refused_by_name(tmp_path):
    values = np.array([0.5, 1.5, -2.0, 3.0], np.float32)
    path = tmp_path / "bf16.pth"
    torch_zip(path, "BFloat16Storage", 4, (2, 2),
              values.astype(ml_dtypes.bfloat16).tobytes(), byteorder=b"little")
    for name, read in ZIP_READERS.items():
        np.testing.assert_array_equal(read(path), values.reshape(2, 2), err_msg=name)
    if HAS_TORCH:
        import torch
        assert unpickler.torch_load(str(path))["w"].dtype == torch.bfloat16
    torch_zip(path, "ComplexFloatStorage", 4, (4,), b"\0" * 32)
    for read in ZIP_READERS.values():
        assert "ComplexFloatStorage" in refusal(read, path)


# ---------------------------------------------------------------------------------------
# A grammar of pickles over the release's reader and the statistics reader.

CODES = ("b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8")
BAD_CODES = ("V4", "O8", "c8", "M8", "U2", "S3", "f4,i4", "", "bfloat16")
DTYPE_STATES = ("plain",) * 10 + ("none", "none", "fields", "far", "subarray", "elsize",
                                  "version4", "list")
ARRAY_STATES = ("numpy",) * 14 + ("version0", "list", "text", "short", "twice", "negative",
                                  "huge", "float_shape")
REFUSE, EITHER = "refuse", "either"


class Expect(NamedTuple):
    """What a reader must give for a node: `value` (`kind` 'ok'), a refusal ('refuse'),
    or either of the two ('either': a second BUILD of the same state)."""
    kind: str
    value: object = None


def _all_ok(parts):
    kinds = {p.kind for p in parts}
    return REFUSE if REFUSE in kinds else EITHER if EITHER in kinds else "ok"


def typed_values(dt: np.dtype, count: int, seed: int) -> np.ndarray:
    vals = np.random.default_rng(seed).integers(-50, 50, count)
    return (vals.astype(np.float32) if dt.name == "bfloat16" else vals).astype(dt)


def file_bytes(typed: np.ndarray, order: str, fortran: bool = False) -> bytes:
    """`typed`'s elements in byte order `order` ('<', '>')."""
    k = typed.dtype.itemsize
    swap = np.dtype(f"u{k}").newbyteorder(order)
    data = typed if k == 1 else typed.view(f"u{k}").astype(swap)
    return data.tobytes(order="F" if fortran else "C")


@st.composite
def pickled_arrays(draw, shape=None, how=None):
    """(numpy's pickle of an array, possibly altered, and what a reader must give)."""
    code = draw(st.sampled_from(CODES * 2 + BAD_CODES))
    dstate = draw(st.sampled_from(DTYPE_STATES))
    order = draw(st.sampled_from("<>|="))
    how = how or draw(st.sampled_from(("reconstruct",) * 4 + ("frombuffer", "scalar")))
    if shape is None:
        shape = () if how == "scalar" else tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    fortran = how != "scalar" and draw(st.booleans())
    astate = draw(st.sampled_from(ARRAY_STATES))
    extra = draw(st.sampled_from((0,) * 10 + (-1, 1, 4096)))
    core = draw(st.sampled_from(("numpy.core", "numpy._core")))
    ok = code in CODES
    dt = np.dtype(code if ok else "f4")
    state = {"plain": (3, order, None, None, None, -1, -1, 0), "none": None,
             "fields": field_at(0, dt.itemsize), "far": field_at(draw(st.sampled_from(
                 (4096, 2**30, 2**40, -8)))), "subarray": (3, "|", (np_dtype("f4"), (2,)),
                                                         None, None, 8, 1, 0),
             "elsize": (3, order, None, None, None, 2 * dt.itemsize, 1, 0),
             "version4": (4, order, None, None, None, -1, -1, 0, {"k": 1}),
             "list": [3, order, None, None, None, -1, -1, 0]}[dstate]
    ok = ok and (dstate == "none" or (dstate == "plain" and (order != "|" or dt.itemsize == 1)))
    file_order = order if dstate == "plain" and order in "<>" else NATIVE
    typed = typed_values(dt, math.prod(shape), draw(st.integers(0, 2**16))).reshape(shape)
    raw = file_bytes(typed, file_order, fortran)
    raw = raw + b"\0" * extra if extra >= 0 else raw[:extra]
    ok = ok and len(raw) == typed.nbytes
    dtype_obj = np_dtype(code, state)
    bad_shape = {"negative": (-1,) + shape, "huge": (2**40, 2**30) + shape,
                 "float_shape": (1.5,) + shape}.get(astate)
    bad_raw = {"list": list(raw), "text": raw.decode("latin1")}.get(astate)
    if how == "scalar":
        obj = Call(Global(f"{core}.multiarray", "scalar"),
                   (dtype_obj, raw if bad_raw is None else bad_raw))
        ok = ok and bad_raw is None
    elif how == "frombuffer":
        obj = Call(Global(f"{core}.numeric", "_frombuffer"),
                   (raw if bad_raw is None else bad_raw, dtype_obj,
                    shape if bad_shape is None else bad_shape, "F" if fortran else "C"))
        ok = ok and bad_raw is None and bad_shape is None
    else:
        array_state = (1, shape if bad_shape is None else bad_shape, dtype_obj, fortran,
                       raw if bad_raw is None else bad_raw)
        array_state = {"version0": array_state[1:], "short": array_state[:4]}.get(
            astate, array_state)
        obj = Build(empty_array(core), array_state)
        if astate == "twice":
            obj = Build(obj, array_state)
        ok = ok and (astate in ("numpy", "twice"))
        if astate == "twice" and ok:
            return obj, Expect(EITHER, typed)
    return obj, Expect("ok", typed) if ok else Expect(REFUSE)


ATTRS = ("get", "__init__", "__new__", "__setstate__", "__call__", "__defaults__", "_fn",
         "name", "__class__", "x")
RELEASE_TARGETS = [("dnnlib.util", "EasyDict"), ("torch.nn.modules.container", "ModuleDict"),
                   ("builtins", "set")] + ([
                       ("torch_utils.persistence", "_reconstruct_persistent_obj"),
                       ("torch._utils", "_rebuild_tensor_v2"),
                       ("torch._utils", "_rebuild_parameter"),
                       ("torch.storage", "_load_from_bytes")] if HAS_TORCH else [])
SHARED_TARGETS = [("collections", "OrderedDict"), ("numpy", "ndarray"), ("numpy", "dtype"),
                  ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray",
                                                              "scalar"),
                  ("numpy.core.numeric", "_frombuffer")]


@st.composite
def builds_on_globals(draw, targets):
    """BUILD on a global itself, with a dict state or a (dict, slots) one: refused."""
    target = Global(*draw(st.sampled_from(targets)))
    attr = draw(st.sampled_from(ATTRS))
    value = draw(st.sampled_from([Global("collections", "OrderedDict"), 1, (), "x"]))
    state = draw(st.sampled_from([{attr: value}, (None, {attr: value}), ({attr: value}, None)]))
    return Build(target, state), Expect(REFUSE)


@st.composite
def containers(draw):
    """The release's stand-ins, made as its pickles make them, with good or bad state."""
    kind = draw(st.sampled_from(["module", "easydict", "persistent"]))
    good = draw(st.booleans())
    if kind == "module":
        arr, want = draw(pickled_arrays(how="reconstruct"))
        state = {"_parameters": {"weight": arr}, "training": False} if good else draw(
            st.sampled_from([{"__class__": 1}, {1: 2}, [("a", 1)], "state"]))
        obj = Build(New(Global("torch.nn.modules.container", "ModuleDict"), ()), state)
        if not good:
            return obj, Expect(REFUSE)
        return obj, Expect(want.kind, ("module", {"_parameters": {"weight": want.value},
                                                  "training": False}))
    if kind == "easydict":
        obj = New(Global("dnnlib.util", "EasyDict"), ())
        return (Build(obj, {}), Expect("ok", unpickler.EasyDict())) if good else \
            (Build(obj, {"a": 1}), Expect(REFUSE))
    if not HAS_TORCH:
        return Call(Global("collections", "OrderedDict"), ()), Expect("ok", OrderedDict())
    meta = {"class_name": "Precond", "version": 6, "state": {"sigma_data": 0.5}}
    obj = Call(Global("torch_utils.persistence", "_reconstruct_persistent_obj"), (meta,))
    return (obj, Expect("ok", ("persistent", "Precond", {"sigma_data": 0.5}))) if good else \
        (Build(obj, (None, {"__class__": Global("dnnlib.util", "EasyDict")})), Expect(REFUSE))


def trees(leaves):
    """Dicts and lists of leaves, (pickle object, Expect)."""
    def combine(children, as_dict):
        objs = [c[0] for c in children]
        want = [c[1] for c in children]
        kind = _all_ok(want)
        if as_dict:
            keys = [f"k{i}" for i in range(len(objs))]
            return dict(zip(keys, objs)), Expect(kind, dict(zip(keys, [w.value for w in want])))
        return list(objs), Expect(kind, [w.value for w in want])
    return st.recursive(leaves, lambda inner: st.builds(
        combine, st.lists(inner, max_size=3), st.booleans()), max_leaves=5)


def assert_same(got, want, where=""):
    """`got` (what a reader returned) is `want` (the values the file stores)."""
    if isinstance(want, np.ndarray):
        got_a = np.asarray(got)
        assert (got_a.dtype, got_a.shape) == (want.dtype, want.shape), (where, got_a, want)
        assert got_a.dtype.byteorder in "=|" and got_a.tobytes() == want.tobytes(), where
    elif isinstance(want, tuple) and want[0] == "module":
        assert type(got) is unpickler.ModuleDict, where
        assert set(vars(got)) == set(want[1]), where
        for k, v in want[1].items():
            assert_same(vars(got)[k], v, f"{where}.{k}")
    elif isinstance(want, tuple) and want[0] == "persistent":
        assert type(got) is unpickler.PersistentObject, where
        assert (got.class_name, got.state) == want[1:], where
    elif isinstance(want, dict):
        assert type(got) is type(want) and list(got) == list(want), (where, got, want)
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, list):
        assert type(got) is list and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want and type(got) is type(want), (where, got, want)


def check_outcome(read, path, want: Expect):
    try:
        got = read(path)
    except unpickler.TorchMissingError as e:
        assert torch_missing(e), (path, e)
        return None
    except ValueError as e:
        one_line_naming(e, path)
        assert want.kind != "ok", (path, e, want)
        return None
    assert want.kind != REFUSE, (path, "returned", got)
    return got


release_trees = trees(st.one_of(pickled_arrays(), builds_on_globals(
    RELEASE_TARGETS + SHARED_TARGETS), containers()))
stats_trees = trees(st.one_of(pickled_arrays(), builds_on_globals(
    SHARED_TARGETS + [("builtins", "dict"), ("dnnlib.util", "EasyDict")])))

_ISSUE_TREE = (  # a field at 4096 bytes, BUILD on EasyDict, a plain float32 array
    [structured(4096), Build(Global("dnnlib.util", "EasyDict"), (None, {"get": 1})),
     np_array(np_dtype("f4"), (2,), np.float32([1, 2]).tobytes())],
    Expect(REFUSE))

_BIG_MU = (np_array(np_dtype("f8", order=">"), (3,), np.arange(3.0).astype(">f8").tobytes()),
           Expect("ok", np.arange(3.0)))


@SETTINGS
@given(release_trees, stats_trees, pickled_arrays(shape=(3,), how="reconstruct"))
@example(_ISSUE_TREE, _ISSUE_TREE, _BIG_MU)
@example(([np_array(np_dtype("i4", order=">"), (2,), np.int32([1, -2]).astype(">i4").tobytes())],
          Expect("ok", [np.int32([1, -2])])), ({}, Expect("ok", {})), _BIG_MU)
def test_a_pickle_reads_as_its_stored_values_or_one_refusal(tmp_path, release, stats, mu):
    before = class_state()
    (obj, want) = release
    path = tmp_path / "net.pkl"
    path.write_bytes(dumps(obj))
    got = check_outcome(_release_pickle, path, want)
    if got is not None:
        assert_same(got, want.value)
    # Statistics: the generated mu beside an identity sigma, and the generated tree.
    (extra, extra_want), (mu_obj, mu_want) = stats, mu
    ref = tmp_path / "ref.pkl"
    ref.write_bytes(dumps({"fid": {"mu": mu_obj, "sigma": np.eye(3)}, "extra": extra}))
    got = check_outcome(fid.load_ref_stats, ref, Expect(_all_ok([extra_want, mu_want]),
                                                       mu_want.value))
    if got is not None:
        np.testing.assert_array_equal(got[0], np.asarray(mu_want.value, np.float64))
        np.testing.assert_array_equal(got[1], np.eye(3))
    assert class_state() == before


# ---------------------------------------------------------------------------------------
# A grammar of torch zip records over the four torch readers.

class Record(NamedTuple):
    storage: str           # torch storage class name
    size: tuple            # the tensor's size (contiguous, from element 0)
    spare: int             # storage elements beyond the tensor's
    byteorder: str | None  # the archive's byteorder record (None: no record)
    record: int            # record bytes beyond (+) or short of (-) the storage's
    deflate: bool
    seed: int


@st.composite
def records(draw):
    return Record(storage=draw(st.sampled_from(sorted(torch_weights._STORAGE_TYPES) * 2 + [
                      "ComplexFloatStorage", "QInt8Storage", "UntypedStorage"])),
                  size=tuple(draw(st.lists(st.integers(0, 4), max_size=3))),
                  spare=draw(st.integers(0, 3)),
                  byteorder=draw(st.sampled_from([None, "little", "big", "big", "middle",
                                                  "BIG"])),
                  record=draw(st.sampled_from((0,) * 8 + (-1, 1))),
                  deflate=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


@SETTINGS
@given(records())
@example(Record("FloatStorage", (4,), 0, "big", 0, False, 0))
@example(Record("BFloat16Storage", (2, 3), 1, "big", 0, True, 1))
@example(Record("DoubleStorage", (3,), 0, "little", 1, True, 2))
def test_a_torch_zip_reads_as_its_stored_values_or_one_refusal(tmp_path, rec):
    before = class_state()
    stype = torch_weights._STORAGE_TYPES.get(rec.storage)
    dt = np.dtype(stype.dtype if stype else np.float32)
    numel = math.prod(rec.size) + rec.spare
    typed = typed_values(dt, numel, rec.seed)
    raw = file_bytes(typed, ">" if rec.byteorder == "big" else "<")
    raw = raw + b"\0" * rec.record if rec.record >= 0 else raw[:rec.record]
    path = tmp_path / "w.pth"
    torch_zip(path, rec.storage, numel, rec.size, raw, deflate=rec.deflate,
              byteorder=None if rec.byteorder is None else rec.byteorder.encode())
    ok = stype is not None and rec.byteorder in (None, "little", "big") and (
        len(raw) == numel * dt.itemsize)
    want = typed[:math.prod(rec.size)].reshape(rec.size).astype(np.float32)
    for name, read in ZIP_READERS.items():
        got = check_outcome(read, path, Expect("ok" if ok else REFUSE))
        if got is not None:
            assert got.dtype == np.float32 and got.shape == want.shape, name
            np.testing.assert_array_equal(got, want, err_msg=name)
    assert class_state() == before
