"""Files from others are data: reading one runs nothing of it and reads nothing beyond it.

- A release pickle (`.pkl`, or the pickle inside a `.pt` zip archive or legacy torch file)
  whose globals name any callable of numpy, builtins, os, subprocess or torch outside
  `unpickler.RELEASE_GLOBALS` (names generated from those modules, called by REDUCE,
  NEWOBJ, INST or STACK_GLOBAL, at the top or deep inside a network's record) is refused
  with a ValueError naming that global: no file is written, no code runs, nothing is
  returned. The loads run in a subprocess, so a crash fails the test.
- A tensor of a weights archive (zip or legacy; generated shape, strides, offset, storage
  size and dtype) is either exactly the elements numpy's indexing of the same storage
  bytes gives, or a ValueError naming its storage and the fix; never a crash, never a byte
  from outside its storage. Both readers: `encoders.torch_weights` and the release's.
- The globals the release's own pickle names (golden facts) are all read; the CLI prints a
  refusal as one `error:` line; a legacy file whose storage list leaves one out, and a
  tensor re-pointed at a longer view by BUILD, are refused.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import io
import itertools
import json
import math
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edm2_jax.encoders import torch_weights
from edm2_jax.release import pickle_io, unpickler

REPO = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None
SETTINGS = settings(max_examples=4, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------------------
# Writing pickles opcode by opcode: globals by name, whatever they are.

class Global(NamedTuple):
    module: str
    name: str


class StackGlobal(NamedTuple):  # protocol 4's STACK_GLOBAL: the names pushed as strings
    module: str
    name: str


class Call(NamedTuple):  # REDUCE: fn(*args)
    fn: object
    args: tuple


class New(NamedTuple):  # NEWOBJ: cls.__new__(cls, *args)
    cls: object
    args: tuple


class Inst(NamedTuple):  # INST: the class named on the opcode, called with args
    module: str
    name: str
    args: tuple


class Build(NamedTuple):  # BUILD: obj.__setstate__(state)
    obj: object
    state: object


class Persistent(NamedTuple):  # BINPERSID
    pid: tuple


class _Writer(pickle._Pickler):  # noqa: SLF001 - the Python pickler's dispatch table
    def persistent_id(self, obj):
        return obj.pid if type(obj) is Persistent else None

    def _global(self, obj):
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())

    def _stack_global(self, obj):
        self.save(obj.module)
        self.save(obj.name)
        self.write(pickle.STACK_GLOBAL)

    def _call(self, obj):
        self.save(obj.fn)
        self.save(obj.args)
        self.write(pickle.REDUCE)

    def _new(self, obj):
        self.save(obj.cls)
        self.save(obj.args)
        self.write(pickle.NEWOBJ)

    def _inst(self, obj):
        self.write(pickle.MARK)
        for a in obj.args:
            self.save(a)
        self.write(pickle.INST + f"{obj.module}\n{obj.name}\n".encode())

    def _build(self, obj):
        self.save(obj.obj)
        self.save(obj.state)
        self.write(pickle.BUILD)

    dispatch = dict(pickle._Pickler.dispatch)  # noqa: SLF001
    dispatch.update({Global: _global, StackGlobal: _stack_global, Call: _call, New: _new,
                     Inst: _inst, Build: _build})


def dumps(obj) -> bytes:
    f = io.BytesIO()
    _Writer(f, protocol=3).dump(obj)
    return f.getvalue()


def tensor(storage, offset, size, stride):
    return Call(Global("torch._utils", "_rebuild_tensor_v2"),
                (storage, offset, tuple(size), tuple(stride), False,
                 Call(Global("collections", "OrderedDict"), ())))


def zip_file(obj, records: dict[str, bytes]) -> bytes:
    """A `torch.save` zip archive of the pickle of `obj` and the storage records."""
    f = io.BytesIO()
    with zipfile.ZipFile(f, "w") as z:
        z.writestr("archive/data.pkl", dumps(obj))
        for key, raw in records.items():
            z.writestr(f"archive/data/{key}", raw)
        z.writestr("archive/version", "3\n")
    return f.getvalue()


def legacy_file(obj, records: dict[str, tuple[int, bytes]]) -> bytes:
    """A legacy `torch.save` file: header, the pickle of `obj`, its storage keys, then
    per key its element count and bytes."""
    info = {"protocol_version": 1001, "little_endian": True,
            "type_sizes": {"short": 2, "int": 4, "long": 4}}
    out = [pickle.dumps(v, protocol=2) for v in (torch_weights.LEGACY_MAGIC, 1001, info)]
    out += [dumps(obj), pickle.dumps(sorted(records), protocol=2)]
    for key in sorted(records):
        count, raw = records[key]
        out += [count.to_bytes(8, "little", signed=True), raw]
    return b"".join(out)


def run_python(code: str, stdin: str, cwd: Path) -> list:
    """`code` run by a fresh interpreter in `cwd` with `stdin`; its JSON output. A crash
    (a signal, a traceback) fails the test with what it printed."""
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True,
                       text=True, cwd=cwd, env=env, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.splitlines()[-1])


# ---------------------------------------------------------------------------------------
# (a) Pickles naming callables outside the allowlist.

_HOSTILE_MODULES = ("builtins", "os", "subprocess", "shutil", "pickle", "io", "numpy",
                    "numpy.testing", "numpy.testing._private.utils", "numpy.lib",
                    "numpy.lib.npyio", "numpy.ctypeslib")
_TORCH_MODULES = ("torch", "torch.hub", "torch.serialization", "torch.storage",
                  "torch._utils", "torch.nn.modules.container", "torch.jit")


@functools.lru_cache
def hostile_names() -> tuple[tuple[str, str], ...]:
    """Every callable reachable by module path from those modules (as the module exports
    it and where it is defined), but the globals the release's files hold."""
    names = {("numpy.testing._private.utils", "runstring"), ("numpy", "save"),
             ("builtins", "exec"), ("builtins", "eval"), ("os", "system"),
             ("subprocess", "Popen"), ("torch", "load"), ("torch.serialization", "load")}
    for mod_name in _HOSTILE_MODULES + (_TORCH_MODULES if HAS_TORCH else ()):
        mod = importlib.import_module(mod_name)
        for attr in dir(mod):
            obj = getattr(mod, attr, None)
            if not callable(obj):
                continue
            names.add((mod_name, attr))
            where, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
            if isinstance(where, str) and isinstance(qual, str) and "." not in qual:
                names.add((where, qual))
    return tuple(sorted(n for n in names if n not in unpickler.RELEASE_GLOBALS
                        and torch_weights.storage_type(*n) is None))


# An argument of a generated call, by name; `arg_value` makes it for a sandbox.
ARGS = ("code", "marker", "command", "zero", "bytes", "namespace", "list", "none")


def arg_value(token: str, sandbox: Path):
    marker = str(sandbox / "ran")
    return {"code": f"open({marker!r}, 'w').write('ran')", "marker": marker,
            "command": f"touch {marker}", "zero": 0, "bytes": b"\x80\x02",
            "namespace": {}, "list": [marker, 1], "none": None}[token]


# "as_storage" names torch's tensor constructor first, which asks for torch.
SHAPES = ("call", "new", "inst", "stack_global", "in_a_network", "build") + (
    ("as_storage",) if HAS_TORCH else ())


def payload(shape: str, module: str, name: str, args: tuple):
    """A pickle's object calling `module.name(*args)` in one of `SHAPES`."""
    g = Global(module, name)
    if shape == "call":
        return Call(g, args)
    if shape == "new":
        return New(g, args)
    if shape == "inst":
        return Inst(module, name, args)
    if shape == "stack_global":
        return Call(StackGlobal(module, name), args)
    if shape == "in_a_network":  # deep in a Precond's record, as the release pickles it
        meta = {"type": "class", "version": 6, "module_src": "", "class_name": "Precond",
                "state": {"_parameters": {}, "_modules": {"unet": Call(g, args)}}}
        return {"ema": Call(Global("torch_utils.persistence", "_reconstruct_persistent_obj"),
                            (meta,))}
    if shape == "build":
        return Build(Call(Global("collections", "OrderedDict"), ()), Call(g, args))
    return {"w": tensor(Call(g, args), 0, (1,), (1,))}  # as_storage: a tensor's storage


CONTAINERS = ("pkl", "zip", "legacy") if HAS_TORCH else ("pkl",)


def write_payload(path: Path, container: str, obj) -> None:
    if container == "pkl":
        path.write_bytes(dumps(obj))
    elif container == "zip":
        path.write_bytes(zip_file(obj, {}))
    else:
        path.write_bytes(legacy_file(obj, {}))


LOAD_RELEASE = r"""
import json, sys
from edm2_jax.release import pickle_io
out = []
for path in json.load(sys.stdin):
    try:
        got = pickle_io.load_release(path)
        out.append(["returned", repr(got)[:300]])
    except BaseException as e:
        out.append([type(e).__name__, str(e)])
print(json.dumps(out))
"""

hostile_call = st.tuples(st.sampled_from(SHAPES), st.integers(min_value=0),
                         st.lists(st.sampled_from(ARGS), max_size=3),
                         st.sampled_from(CONTAINERS))


@SETTINGS
@given(st.lists(hostile_call, min_size=25, max_size=30))
@example([(shape, i, ["code", "namespace"], c) for shape in SHAPES for c in CONTAINERS
          for i in (-1,)])  # -1: numpy.testing._private.utils.runstring, below
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_pickles_naming_any_other_callable_are_refused_and_run_nothing(tmp_path_factory,
                                                                       calls):
    sandbox = tmp_path_factory.mktemp("sandbox")
    names = hostile_names()
    paths, want = [], []
    for n, (shape, i, tokens, container) in enumerate(calls):
        module, name = (("numpy.testing._private.utils", "runstring") if i == -1
                        else names[i % len(names)])
        args = tuple(arg_value(t, sandbox) for t in tokens)
        path = sandbox / f"payload{n}.{container}"
        write_payload(path, container, payload(shape, module, name, args))
        paths.append(str(path))
        want.append(f"{module}.{name}")
    before = sorted(os.listdir(sandbox))
    results = run_python(LOAD_RELEASE, json.dumps(paths), sandbox)
    assert sorted(os.listdir(sandbox)) == before, "a payload wrote a file"
    for path, name, (kind, message) in zip(paths, want, results):
        assert kind == "RefusedGlobalError", (path, name, kind, message)
        assert f"the pickle names {name}," in message and path in message, message
        assert "\n" not in message


# ---------------------------------------------------------------------------------------
# (b) Tensor headers against their storages.

_ITEMSIZE = {name: np.dtype(t.dtype).itemsize for name, t in torch_weights._STORAGE_TYPES.items()}


class Header(NamedTuple):
    storage: str   # torch storage class name
    numel: int     # elements the persistent id names
    record: int    # the record's elements beyond (+) or short of (-) numel
    offset: int
    size: tuple
    stride: tuple
    fmt: str       # "zip" or "legacy"


@st.composite
def headers(draw):
    ndim = draw(st.integers(0, 3))
    big = st.sampled_from([2**31, 2**62, 2**63 - 1, 2**64])
    size = draw(st.lists(st.one_of(st.integers(0, 5), st.just(-1)), min_size=ndim,
                         max_size=ndim))
    n_stride = ndim + draw(st.sampled_from([0] * 9 + [1]))
    stride = draw(st.lists(st.one_of(st.integers(0, 8), st.integers(-2, -1), big),
                           min_size=n_stride, max_size=n_stride))
    return Header(storage=draw(st.sampled_from(sorted(_ITEMSIZE))),
                  numel=draw(st.integers(0, 24)),
                  record=draw(st.sampled_from([0] * 6 + [-1, 1])),
                  offset=draw(st.one_of(st.integers(0, 26), st.just(-1), big)),
                  size=tuple(size), stride=tuple(stride),
                  fmt=draw(st.sampled_from(["zip", "legacy"])))


def header_bytes(h: Header, seed: int) -> bytes:
    n = max(h.numel + h.record, 0) * _ITEMSIZE[h.storage]
    return np.random.default_rng(seed).integers(0, 256, n, np.uint8).tobytes()


def write_header(path: Path, h: Header, raw: bytes) -> None:
    if h.fmt == "zip":
        pid = ("storage", Global("torch", h.storage), "0", "cpu", h.numel)
        path.write_bytes(zip_file({"w": tensor(Persistent(pid), h.offset, h.size, h.stride)},
                                  {"0": raw}))
    else:
        pid = ("storage", Global("torch", h.storage), "0", "cpu", h.numel, None)
        path.write_bytes(legacy_file({"w": tensor(Persistent(pid), h.offset, h.size, h.stride)},
                                     {"0": (h.numel, raw)}))


def numpy_view(h: Header, raw: bytes) -> np.ndarray | None:
    """The tensor the header names, by numpy's indexing of the storage's elements; None
    where it names elements outside the storage, more elements than it holds, or a
    storage whose record is not its size."""
    dtype = np.dtype(torch_weights._STORAGE_TYPES[h.storage].dtype).newbyteorder("<")
    short = h.record < 0 or (h.fmt == "zip" and h.record != 0)
    if (short or len(h.size) != len(h.stride) or h.offset < 0
            or min(h.size + h.stride, default=0) < 0 or math.prod(h.size) > h.numel
            or h.offset > h.numel):
        return None
    elements = np.frombuffer(raw[:h.numel * dtype.itemsize], dtype)
    index = [h.offset + sum(i * s for i, s in zip(ix, h.stride))
             for ix in itertools.product(*map(range, h.size))]
    if any(i >= h.numel for i in index):
        return None
    return elements[np.array(index, np.int64)].reshape(h.size)


READ_TENSORS = r"""
import json, sys, zipfile
from edm2_jax.encoders import torch_weights
try:
    from edm2_jax.release import unpickler
    import torch
except ImportError:
    unpickler = None

def read(path):
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            return torch_weights.load_archive(zf)["w"]
    return torch_weights.load_legacy(open(path, "rb").read())["w"]

def outcome(load, path):
    try:
        a = load(path)
        return ["ok", a.dtype.str, list(a.shape), a.tobytes().hex()]
    except BaseException as e:
        return [type(e).__name__, str(e)]

def release_read(path):  # numpy has no bfloat16 of torch's: its bits, as ml_dtypes's
    t = unpickler.torch_load(path)["w"]
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()

out = []
for path in json.load(sys.stdin):
    release = outcome(release_read, path) if unpickler else None
    out.append([outcome(read, path), release])
print(json.dumps(out))
"""

_THE_ISSUE = [Header("FloatStorage", 4, 0, 0, (4096,), (1,), "zip"),   # heap as weights
              Header("FloatStorage", 4, 0, -1, (2,), (1,), "zip"),      # negative offset
              Header("FloatStorage", 4, 0, 0, (2,), (2**62,), "zip"),   # huge stride
              Header("HalfStorage", 8, 0, 2, (2, 3), (1, 2), "legacy"),  # in bounds
              Header("FloatStorage", 4, 0, 0, (4096,), (1,), "legacy"),
              Header("BFloat16Storage", 6, 0, 1, (2, 2), (2, 1), "zip")]  # read, as torch


@SETTINGS
@given(st.lists(headers(), min_size=25, max_size=30))
@example(_THE_ISSUE)
@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_a_tensor_is_numpys_view_of_its_storage_or_an_error(tmp_path_factory, batch):
    folder = tmp_path_factory.mktemp("tensors")
    paths, raws = [], []
    for n, h in enumerate(batch):
        raws.append(header_bytes(h, n))
        paths.append(folder / f"t{n}.pth")
        write_header(paths[-1], h, raws[-1])
    results = run_python(READ_TENSORS, json.dumps([str(p) for p in paths]), folder)
    for h, raw, outcomes in zip(batch, raws, results):
        want = numpy_view(h, raw)
        for got in filter(None, outcomes):
            if want is None:
                assert got[0] == "ValueError", (h, got)
                assert "storage '0'" in got[1] and torch_weights.DAMAGED in got[1], (h, got)
            else:
                assert got[0] == "ok", (h, got)
                assert got[1:] == [want.dtype.str, list(want.shape), want.tobytes().hex()], h


# ---------------------------------------------------------------------------------------
# The release's formats, the command line, and two ways around the storage.

def test_every_global_the_releases_own_pickle_names_is_read():
    facts = json.loads((REPO / "tests/data/release_interop/export_facts.json").read_text())
    assert [tuple(g) for g in facts["pickle_globals"]]
    assert all(tuple(g) in unpickler.RELEASE_GLOBALS for g in facts["pickle_globals"])


def test_a_refused_pickle_is_one_error_line_of_convert(tmp_path, capsys, monkeypatch):
    from edm2_jax.modes import common
    from edm2_jax.release import convert
    monkeypatch.setitem(sys.modules, "torch", None)  # refused before torch is asked for
    evil = tmp_path / "edm2-img64-s-0000001-0.100.pkl"
    code = f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')"
    evil.write_bytes(dumps(Call(Global("numpy.testing._private.utils", "runstring"),
                                (code, {}))))
    rc = common.report_errors(lambda: convert.main_convert(str(evil), str(tmp_path / "out")))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith(f"error: {evil}"), err
    assert "the pickle names numpy.testing._private.utils.runstring," in err[0]
    assert sorted(os.listdir(tmp_path)) == [evil.name]


def test_a_legacy_file_whose_storage_list_leaves_one_out_is_refused(tmp_path):
    """torch's own reader hands out the storage's uninitialized memory as its values."""
    pid = ("storage", Global("torch", "FloatStorage"), "0", "cpu", 4096, None)
    good = legacy_file({"w": tensor(Persistent(pid), 0, (4096,), (1,))},
                       {"0": (4096, np.arange(4096, dtype="<f4").tobytes())})
    np.testing.assert_array_equal(torch_weights.load_legacy(good)["w"], np.arange(4096))
    keys = pickle.dumps(["0"], protocol=2)
    bad = good.replace(keys, pickle.dumps([], protocol=2), 1)
    with pytest.raises(ValueError, match=r"storage keys \[\] are not the 1 storages"):
        torch_weights.load_legacy(bad)
    path = tmp_path / "bad.pth"
    path.write_bytes(bad)
    with pytest.raises(ValueError, match=rf"{path} is not a torch zip archive.*storage keys"):
        torch_weights.read_state_dict(path, lambda p, what, e: ValueError(
            f"{p} is not {what} ({e})"))


def test_a_tensor_set_to_a_longer_view_of_its_storage_is_refused(tmp_path):
    """A pickle can BUILD a rebuilt tensor with a legacy state `(source, offset, size,
    stride)`, which torch's `Tensor.__setstate__` hands to `set_`: the 4 stored floats
    never become 4,096."""
    pytest.importorskip("torch")
    pid = ("storage", Global("torch", "FloatStorage"), "0", "cpu", 4, None)
    storage = Call(Global("torch.storage", "_load_from_bytes"),
                   (legacy_file(Persistent(pid), {"0": (4, b"\0" * 16)}),))
    four = tensor(storage, 0, (4,), (1,))
    path = tmp_path / "net.pkl"
    path.write_bytes(dumps({"ema": {"unet.w": Build(four, (four, 0, (4096,), (1,)))}}))
    with pytest.raises(ValueError, match=rf"{path} is not a file this converter reads"):
        pickle_io.load_release(path)
    path.write_bytes(dumps({"ema": {"unet.w": four}}))
    np.testing.assert_array_equal(pickle_io.load_state_dict(path)["unet.w"], np.zeros(4))
