"""The training loader on grain (data/pipeline.py): the stream its docstring defines, bit
for bit, whatever the worker processes, process count or resume point; errors that name
their file and never hang; workers that end with the run.

Worker processes start with `spawn` (each imports JAX through grain: ~2-5 s on 2 shared
cores), so the tests that need them build as few iterators as they can. Run as a script
(`python -m tests.test_grain_loader JSON`), this file is the consumer process of the
kill / SIGTERM / error tests and each process of the two-process test."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import zipfile
from concurrent import futures
from pathlib import Path

import numpy as np
import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import data_pipeline  # noqa: E402  (its stand-in data sets: what the dataset tools write)
from edm2_jax import data  # noqa: E402
from edm2_jax.data import pipeline  # noqa: E402
from edm2_jax.encoders import vae  # noqa: E402

N, G, SEED = 26, 8, 3   # 26 images, batches of 8: batches straddle epochs
WAIT_S = 60             # no step here takes this long; a hang fails instead of stalling


@pytest.fixture(scope="module")
def pngs(tmp_path_factory) -> str:
    """A zip of 26 random 8x8 RGB PNGs with 5 classes, as `dataset_tool convert` writes."""
    return data_pipeline.write_standin(str(tmp_path_factory.mktemp("png") / "d.zip"), N, 8, 5)


def definition(source, first: int, count: int) -> dict[str, np.ndarray]:
    """Stream positions `[first, first + count)` image by image, as pipeline.py's docstring
    defines them: position k holds image perm_e[k mod N] of epoch e = k // N, x = u8 / 127.5
    - 1 (a latent source: its draw mean + N(0, 1) std at k, scaled), labels one-hot."""
    images, labels = [], []
    for k in range(first, first + count):
        e, r = divmod(k, len(source))
        i = np.random.default_rng((SEED, e)).permutation(len(source))[r]
        item, label = source[int(i)]
        if source.encoder == "sd-vae":
            noise = pipeline.latent_noise(SEED, k, item.shape[:-1] + (vae.LATENT_CHANNELS,))
            images.append(np.float32(vae.encode_latents(item, noise)))
        else:
            images.append(item.astype(np.float32) / np.float32(127.5) - np.float32(1))
        labels.append(label)
    return {"image": np.stack(images), "label": np.eye(source.label_dim, dtype=np.float32)[labels]}


def assert_same(batches: list[dict], want: dict) -> None:
    for key in ("image", "label"):
        got = np.concatenate([b[key] for b in batches])
        assert got.dtype == np.float32 and type(got) is np.ndarray
        np.testing.assert_array_equal(got, want[key])  # bit for bit


def call_within(fn, seconds: float = WAIT_S):
    """`fn()`, or a failure if it takes longer than `seconds` (a hang)."""
    with futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result(timeout=seconds)


def loader_workers(pid: int | None = None) -> list[psutil.Process]:
    """The worker processes (multiprocessing's spawn children) of process `pid` (this one)."""
    return [c for c in psutil.Process(pid).children(recursive=True)
            if "spawn_main" in " ".join(c.cmdline())]


def gone(pids: list[int], seconds: float = 15) -> list[int]:
    """The processes of `pids` still running after up to `seconds`."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


# --- the stream -----------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 1, 2])
def test_the_stream_is_its_definition_bit_for_bit_with_0_1_2_worker_processes(pngs, workers):
    """Eight batches of 8 from 26 PNGs (three epochs, batches across their ends) equal the
    stream's definition bit for bit, whether built in the calling thread or in 1 or 2
    worker processes that take turns by batch."""
    src = data.ImageFolder(pngs)
    with data.make_iterator(src, global_batch=G, seed=SEED, num_workers=workers) as it:
        batches = call_within(lambda: [next(it) for _ in range(8)])
        if workers:
            assert len(loader_workers()) == workers
    assert_same(batches, definition(src, 0, 8 * G))
    assert next(it, None) is None  # closed: StopIteration, the workers gone
    assert not loader_workers()


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_latent_draws_are_the_same_in_worker_processes(tmp_path):
    """Latents (the img512 presets' data): each position's own draw, in 2 workers."""
    path = data_pipeline.write_standin(str(tmp_path / "lat.zip"), 10, 4, 3, latents=True)
    src = data.LatentFolder(path)
    with data.make_iterator(src, global_batch=4, seed=SEED, num_workers=2) as it:
        batches = call_within(lambda: [next(it) for _ in range(4)])
    assert_same(batches, definition(src, 0, 16))


def test_sources_stored_decoded_are_gathered_in_this_process(tmp_path):
    """Fashion-MNIST-like arrays in memory (`decoded`): no worker process is started, and
    the one gather per batch (`read_batch`, with XFlip's mirrored half) gives the same
    batches as item-by-item reads."""
    class InMemory(data.Source):
        name, resolution, num_channels, label_dim, decoded = "mem", 4, 1, 3, True
        images = np.random.default_rng(0).integers(0, 256, (7, 4, 4, 1), np.uint8)

        def __len__(self):
            return 7

        def _load(self, i):
            return self.images[i], i % 3

        def read_batch(self, indices):
            return self.images[indices], indices % 3
    src = data.XFlip(InMemory())
    assert src.decoded
    with data.make_iterator(src, global_batch=G, seed=SEED, num_workers=2) as it:
        batches = [next(it) for _ in range(4)]
        assert not loader_workers()
    assert_same(batches, definition(src, 0, 4 * G))


def test_the_quick_start_sees_the_batches_the_thread_pool_gave():
    """All 1,000 batches of the quick start (configs/fashion_mnist.py: 64 kimg at batch 64)
    equal, bit for bit, those of the thread pool that loaded them before grain (kept in
    benchmarks/data_pipeline.py), so its losses are those the README quotes."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("fmnist", REPO / "configs/fashion_mnist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    src = data.make_source(cfg.data)
    steps = round(cfg.total_kimg * 1000) // cfg.batch_size
    assert (steps, cfg.data.num_workers, src.decoded) == (1000, 2, True)
    old = data_pipeline.threaded_reference(src, global_batch=cfg.batch_size, seed=cfg.seed,
                                           workers=2)
    with data.make_iterator(src, global_batch=cfg.batch_size, seed=cfg.seed,
                            num_workers=cfg.data.num_workers) as it:
        for _ in range(steps):
            a, b = next(it), next(old)
            np.testing.assert_array_equal(a["image"], b["image"])
            np.testing.assert_array_equal(a["label"], b["label"])
    old.close()


def test_put_yields_the_batches_on_the_devices():
    """`put` (the training loop's `sharding.global_batch`, here `jax.device_put`): the
    same batches as device arrays, put ahead by a thread."""
    import jax
    src = data.XFlip(_Uint8Array())
    with data.make_iterator(src, global_batch=4, seed=SEED, num_workers=0,
                            put=jax.device_put) as it:
        batches = [next(it) for _ in range(3)]
    assert all(isinstance(b["image"], jax.Array) for b in batches)
    assert_same([jax.device_get(b) for b in batches], definition(src, 0, 12))


class _Uint8Array(data.Source):
    name, resolution, num_channels, label_dim = "arr", 2, 3, 2

    def __len__(self):
        return 5

    def _load(self, i):
        return np.full((2, 2, 3), 40 * i, np.uint8), i % 2


# --- errors: one, naming the file, never a hang -----------------------------------------------

def test_a_file_that_fails_to_decode_in_a_worker_is_one_error_line_naming_it(tmp_path, capsys):
    from edm2_jax.modes import common
    path = data_pipeline.write_standin(str(tmp_path / "d.zip"), 6, 8, 2)
    with zipfile.ZipFile(path) as z:
        good = z.read("00000/img00000002.png")
    with zipfile.ZipFile(path, "a") as z:  # sorted after img00000002: index 3
        z.writestr("00000/img00000002b.png", good[:len(good) // 2])
    src = data.ImageFolder(path, use_labels=False)
    it = data.make_iterator(src, global_batch=7, seed=0, num_workers=2)
    status = call_within(lambda: common.report_errors(lambda: next(it)))
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: cannot decode image ") and "img00000002b.png" in lines[0]
    it.close()
    assert not loader_workers()


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_a_worker_that_dies_is_one_error_naming_the_data_set_never_a_hang(pngs):
    src = data.ImageFolder(pngs)
    it = data.make_iterator(src, global_batch=G, seed=SEED, num_workers=2)
    call_within(lambda: [next(it) for _ in range(2)])  # one from each: both run
    workers = loader_workers()
    assert len(workers) == 2
    workers[1].kill()  # SIGKILL, as the kernel's out-of-memory killer does

    def drain():
        for _ in range(20):  # the batches already in the buffers come first
            next(it)
    with pytest.raises(data.LoaderWorkerError) as e:
        call_within(drain)
    assert pngs in str(e.value) and "signal 9 (SIGKILL), e.g. by the kernel" in str(e.value)
    assert "lower data.num_workers" in str(e.value) and "\n" not in str(e.value)
    assert gone([w.pid for w in workers]) == []  # the other one stopped with it


# --- the run's end: no orphans; resume after kill -9 -------------------------------------------

def _consume(args: dict) -> int:
    """The consumer process: the pids of its loader's processes on stdout once its 2
    workers run, then `batches` batches into `out` (npz) and the line 'saved', then either
    the data's error (a file that does not decode) printed by the entry points'
    `report_errors`, or a wait to be killed."""
    import threading
    from edm2_jax.modes import common
    src = data.ImageFolder(args["path"], use_labels=args["labels"])

    def announce():
        while len(loader_workers()) < 2:
            time.sleep(0.05)
        print(json.dumps([p.pid for p in psutil.Process().children(recursive=True)]),
              flush=True)

    def run():
        threading.Thread(target=announce, daemon=True).start()
        it = data.make_iterator(src, global_batch=G, seed=SEED, num_workers=2)
        got = [next(it) for _ in range(args["batches"])]
        np.savez(args["out"], **{k: np.concatenate([b[k] for b in got]) for k in got[0]})
        print("saved", flush=True)
        while True:
            next(it) if args["then"] == "error" else time.sleep(1)
    return common.report_errors(run)


def _distributed(args: dict) -> None:
    """One of `count` processes (`jax.distributed` on CPU): its batches into `out`."""
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{args['port']}", num_processes=args["count"],
                               process_id=args["index"])
    src = data.ImageFolder(args["path"])
    with data.make_iterator(src, global_batch=G, seed=SEED, num_workers=2,
                            process_index=jax.process_index(),
                            process_count=jax.process_count()) as it:
        got = [next(it) for _ in range(args["batches"])]
    np.savez(args["out"], **{k: np.stack([b[k] for b in got]) for k in got[0]})


def _start(args: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.test_grain_loader", json.dumps(args)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("end", ["SIGKILL", "SIGTERM", "error"])
def test_workers_end_with_the_run_and_a_killed_run_resumes_mid_epoch(pngs, tmp_path, end):
    """A run that holds 2 workers ends by kill -9, by SIGTERM (Python's default: no
    clean-up runs) or by a corrupt file (one `error:` line naming it, exit status 1): no
    process of its loader is left. After the kill -9 at 16 images (mid-epoch), the
    iterator started at nimg=16, as the checkpoint's step makes it, carries on the
    stream bit for bit."""
    path = pngs
    if end == "error":  # a PNG whose header reads (the zip opens) but whose pixels do not
        path = data_pipeline.write_standin(str(tmp_path / "bad.zip"), N, 8, 5)
        with zipfile.ZipFile(path, "a") as z:
            good = z.read("00000/img00000009.png")
            z.writestr("00000/img00000009b.png", good[:len(good) // 2])
    out = str(tmp_path / "first.npz")
    proc = _start(dict(mode="consume", path=path, labels=end != "error", batches=2, out=out,
                       then="error" if end == "error" else "wait"))
    try:
        line = call_within(proc.stdout.readline, 120)
        assert line, proc.communicate()[1][-3000:]
        family = json.loads(line)  # the 2 workers and multiprocessing's resource tracker
        assert len(family) >= 2
        if end != "error":
            assert call_within(proc.stdout.readline, WAIT_S) == "saved\n"
            proc.send_signal(getattr(signal, end))
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert gone(family) == [], "orphaned loader processes"
    if end == "error":
        assert proc.returncode == 1
        lines = err.strip().splitlines()
        assert lines[-1].startswith("error: cannot decode image ") and "img00000009b" in lines[-1]
        assert "Traceback" not in err
        return
    assert proc.returncode == -getattr(signal, end)
    src = data.ImageFolder(pngs)
    first = np.load(out)
    assert_same([first], definition(src, 0, 2 * G))
    with data.make_iterator(src, global_batch=G, seed=SEED, start_nimg=2 * G,
                            num_workers=1) as it:
        assert_same(call_within(lambda: [next(it) for _ in range(3)]),
                    definition(src, 2 * G, 3 * G))


@pytest.mark.slow
@pytest.mark.ci
def test_workers_that_cannot_start_are_one_error_not_a_hang(pngs):
    """A script read from stdin: spawn's workers cannot import its main module and exit at
    once. The training process gets one error naming the data set (the message that
    starts a worker is small: it cannot block on a pipe nobody reads)."""
    script = (f"from edm2_jax import data\n"
              f"it = data.make_iterator(data.ImageFolder({pngs!r}), global_batch=8, seed=0, "
              f"num_workers=2)\n"
              f"try:\n    next(it)\nexcept data.LoaderWorkerError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"reading {pngs} died with exit code 1 (its error is printed above)" in proc.stdout
    assert "No such file or directory" in proc.stderr  # spawn's own words for <stdin>


@pytest.mark.slow
@pytest.mark.ci
def test_two_processes_take_their_slices_of_the_one_process_stream(pngs, tmp_path):
    """Two processes joined by `jax.distributed` (CPU, gloo), 2 workers each: process p's
    batch j is rows [4p, 4p + 4) of the one-process stream's batch j, bit for bit."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    outs = [str(tmp_path / f"p{i}.npz") for i in range(2)]
    procs = [_start(dict(mode="distributed", path=pngs, port=port, count=2, index=i,
                         batches=5, out=outs[i])) for i in range(2)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    parts = [np.load(o) for o in outs]
    assert parts[0]["image"].shape == (5, G // 2, 8, 8, 3)
    whole = definition(data.ImageFolder(pngs), 0, 5 * G)
    for key in ("image", "label"):
        joined = np.concatenate([parts[0][key], parts[1][key]], axis=1).reshape(whole[key].shape)
        np.testing.assert_array_equal(joined, whole[key])


if __name__ == "__main__":
    arguments = json.loads(sys.argv[1])
    if arguments["mode"] == "consume":
        sys.exit(_consume(arguments))
    _distributed(arguments)
