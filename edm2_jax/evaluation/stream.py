"""Metrics of a network's samples in one streamed, resumable pass: generate -> decode (a
latent net: the SD VAE) -> features (Inception-v3, DINOv2, the classifier), batch by
batch, so that FID-50k never holds 50,000 images (`metrics.GeneratedFeatures`: float64
feature statistics, the classifier's features).

Seeds: the seed list is cut into batches as `seed_images.generate_images` cuts it (the batch
size rounded up to a multiple of the local devices) and each process of a multi-host job
takes every `process_count`-th batch (`process_share`); within a batch the seeds are
split over the local devices. At the end the processes' statistics are summed
(`gather_processes`); with one process nothing is exchanged.

Partial state (resumable): every `SAVE_EVERY_IMAGES` images or `SAVE_EVERY_S` seconds,
and when the stream stops on an exception (SIGTERM and Ctrl-C included: `--mode=eval`
raises them there, `modes.common.Interrupted`; a signal waits for the update of the
statistics or the save in progress, `signals_held`), each process writes what
it has accumulated (the statistics per metric, the classifier features, the seeds done)
with the eval's settings to its own file beside the results (`partial_path`):

    <out_json>.partial.p<process>.npz     (out_json: --out_json, else beside the net,
                                           `run.layout.eval_results_path`)

atomically (a `.tmp` file renamed over it; one object write on a bucket). A later run
with the same settings (net, guide, guidance, interval, seeds, sampler settings,
metrics, number of images, the random stream, the processes) loads it and generates
only the seeds not done yet: none twice, none skipped. A file of other settings is not
used (one line says which settings differ) and is overwritten. The file is deleted once
the final figures are written.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import threading
import time
import zipfile
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from tqdm import tqdm

from edm2_jax import paths
from edm2_jax.evaluation.metrics import GeneratedFeatures

SAVE_EVERY_IMAGES = 1000  # a process saves its partial state after this many images ...
SAVE_EVERY_S = 60.0       # ... or this many seconds, whichever comes first
STATE_VERSION = 1         # bump when the partial state's arrays change meaning


def seeds_spec(seeds: Sequence[int]) -> str:
    """The compact text of a seed list, as `seed_images.parse_seeds` reads it: runs of
    consecutive seeds as ranges, `[0, ..., 49999]` -> `'0-49999'`, `[1, 5, 7, 8, 9]` ->
    `'1,5,7-9'`."""
    parts: list[str] = []
    seeds = [int(s) for s in seeds]
    i = 0
    while i < len(seeds):
        j = i
        while j + 1 < len(seeds) and seeds[j + 1] == seeds[j] + 1:
            j += 1
        parts.append(str(seeds[i]) if i == j else f"{seeds[i]}-{seeds[j]}")
        i = j + 1
    return ",".join(parts)


def process_share(seeds: Sequence[int], batch_size: int, process_index: int | None = None,
                  process_count: int | None = None) -> list[int]:
    """The seeds one process generates: the list cut into batches of `batch_size` rounded
    up to a multiple of the local device count (as `seed_images.generate_images` cuts it),
    every `process_count`-th batch from the `process_index`-th (default: this process of
    this job)."""
    pi = jax.process_index() if process_index is None else process_index
    pc = jax.process_count() if process_count is None else process_count
    n_dev = jax.local_device_count()
    batch = max(n_dev, (batch_size + n_dev - 1) // n_dev * n_dev)
    batches = [list(seeds[i:i + batch]) for i in range(0, len(seeds), batch)]
    return [s for b in batches[pi::pc] for s in b]


def partial_path(out_json: str, process_index: int | None = None) -> str:
    """Where a process keeps its partial state (see the module doc): beside the results
    file `out_json`."""
    pi = jax.process_index() if process_index is None else process_index
    return f"{out_json}.partial.p{pi}.npz"


def _json_settings(settings: dict) -> dict:
    return json.loads(json.dumps(dict(settings, state_version=STATE_VERSION), sort_keys=True,
                                 default=str))


def save_partial(path: str, settings: dict, gen: GeneratedFeatures) -> None:
    """Write `gen`'s state with `settings` to `path` (`.npz`) so that a reader sees the
    previous file or this one, never part of one."""
    buf = io.BytesIO()
    np.savez(buf, settings=np.asarray(json.dumps(_json_settings(settings), sort_keys=True)),
             **gen.state())
    if paths.is_url(path):
        paths.Path(path).write_bytes(buf.getvalue())
        return
    with open(path + ".tmp", "wb") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def load_partial(path: str, settings: dict, gen: GeneratedFeatures,
                 share: Sequence[int], log: Callable[[str], Any] = tqdm.write) -> bool:
    """Load the partial state at `path` into the empty `gen` when it exists and was
    written with `settings` and of seeds of `share` only; else leave `gen` empty and,
    for a file that exists, say in one line why it is not used. Returns whether it was
    loaded."""
    if not paths.exists(path):
        return False
    try:
        with paths.open(path, "rb") as f:
            with np.load(io.BytesIO(f.read())) as z:
                state = {k: z[k] for k in z.files}
        saved = json.loads(str(state.pop("settings")))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        log(f"Partial state {path} is unreadable ({type(e).__name__}); not used, starting "
            f"afresh (it will be overwritten)")
        return False
    want = _json_settings(settings)
    if saved != want:
        differ = sorted(k for k in set(saved) | set(want) if saved.get(k) != want.get(k))
        log(f"Partial state {path} is of other settings ({', '.join(differ)} differ); not "
            f"used, starting afresh (it will be overwritten)")
        return False
    ids = np.asarray(state.get("ids", np.zeros(0, np.int64))).tolist()
    if not set(ids) <= set(int(s) for s in share) or len(set(ids)) != len(ids):
        log(f"Partial state {path} holds seeds outside this process's share (or twice); "
            f"not used, starting afresh")
        return False
    try:
        gen.load_state(state)
    except (KeyError, ValueError) as e:
        log(f"Partial state {path} does not fit these metrics ({e}); starting afresh")
        return False
    return True


def remove_partial(path: str) -> None:
    """Delete the partial state at `path` (and its temporary file), if any."""
    for p in (path, path + ".tmp"):
        if paths.exists(p):
            paths.Path(p).unlink()


def stream_features(gen: GeneratedFeatures, batches, state_path: str, settings: dict,
                    total: int) -> dict:
    """Add the `(seeds, uint8 images)` batches of `batches` (`seed_images.generate_images`
    of the seeds not yet in `gen`) to `gen`, saving the partial state to `state_path`
    every `SAVE_EVERY_IMAGES` images or `SAVE_EVERY_S` seconds, at the end, and when the
    stream stops on an exception (re-raised). `total`: this process's share. Returns
    `{'images': generated here, 'seconds': wall time of the stream}`."""
    t0 = last_t = time.time()
    last_n, count = gen.num_items, 0

    def save() -> None:
        nonlocal last_n, last_t
        if count == 0 or gen.num_items == last_n:
            return
        if last_t == t0:
            tqdm.write(f"Partial state (resumable) -> {state_path}")
        save_partial(state_path, settings, gen)
        last_n, last_t = gen.num_items, time.time()

    try:
        for seeds, images in batches:
            with signals_held():  # a signal waits for the statistics to be whole
                gen.add(images, seeds)
                count += len(seeds)
            if (gen.num_items - last_n >= SAVE_EVERY_IMAGES
                    or time.time() - last_t >= SAVE_EVERY_S):
                with signals_held():
                    save()
    except BaseException as e:
        if count and gen.num_items > last_n:
            with signals_held():  # a second signal: once the state is written
                save()
            tqdm.write(f"Stopped after {gen.num_items} of {total} images; the same command "
                       f"resumes from {state_path}")
        if isinstance(e, KeyboardInterrupt) and gen.num_items:  # a signal: say what is kept
            e.kept = (f"{gen.num_items} of the {total} images are measured and kept in "
                      f"{state_path}, from which the same command resumes")
        raise
    seconds = time.time() - t0
    save()  # the figures are still to be computed (and gathered): keep what was done
    return {"images": count, "seconds": seconds}


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Within: SIGTERM and SIGINT are held, then acted on at its end by the handlers in
    place before (a command's `modes.common.Interrupted`, or Python's own), so that an
    update of the statistics or a save of the partial state is never cut in half. Does
    nothing outside the main thread (where signals are not handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    held = (signal.SIGTERM, signal.SIGINT)
    before = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if got:
            handler = before[got[0]]
            if callable(handler):
                handler(got[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(got[0])


def _to_bytes(gen: GeneratedFeatures) -> np.ndarray:
    buf = io.BytesIO()
    np.savez(buf, **gen.state())
    return np.frombuffer(buf.getvalue(), np.uint8)


def gather_processes(gen: GeneratedFeatures, empty: Callable[[], GeneratedFeatures]
                     ) -> GeneratedFeatures:
    """`gen` of every process merged, in process order (the same result in each); `gen`
    itself with one process. A collective: every process must call it. `empty()` makes
    an accumulator of the same metrics. The states travel as bytes (`.npz`), so float64
    sums stay float64 whatever JAX's x64 setting."""
    if jax.process_count() == 1:
        return gen
    from jax.experimental import multihost_utils
    raw = _to_bytes(gen)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([raw.size], np.int32)))
    sizes = sizes.reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:raw.size] = raw
    every = np.asarray(multihost_utils.process_allgather(padded))
    merged = empty()
    for p, size in enumerate(sizes):
        with np.load(io.BytesIO(every[p, :int(size)].tobytes())) as z:
            merged.merge(empty().load_state({k: z[k] for k in z.files}))
    return merged


def sum_over_processes(values: Sequence[float]) -> np.ndarray:
    """Element-wise sum of float `values` over every process (a collective), float64 via
    bytes; `values` itself with one process."""
    values = np.asarray(values, np.float64)
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils
    every = np.asarray(multihost_utils.process_allgather(values.view(np.uint8)))
    return every.reshape(jax.process_count(), -1).view(np.float64).sum(axis=0)


def sync_processes(name: str) -> None:
    """Wait until every process gets here (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
