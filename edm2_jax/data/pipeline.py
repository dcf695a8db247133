"""Deterministic, resumable, host-sharded batches from a `Source`, loaded by grain.

The training data is one infinite stream of images: position `k` (= images consumed
before it, i.e. `nimg`) holds image `perm_e[k mod N]` of epoch `e = k // N`, where
`perm_e = np.random.default_rng((seed, e)).permutation(N)`. Epochs run into each other
(no partial batches, nothing dropped), so the stream depends only on `(seed, N)`.

Global batch `j` of an iterator started at `start_nimg` covers positions
`[start_nimg + j G, start_nimg + (j + 1) G)` for global batch size `G`; process `p` of `P`
takes the contiguous slice `[p G/P, (p + 1) G/P)` of it. Resuming a run from a checkpoint
at `nimg` therefore reproduces exactly the batches the uninterrupted run would have seen;
the checkpoint needs no loader state beyond the step (`nimg = step * G`).

Latent sources (`source.encoder == 'sd-vae'`) hold the SD VAE's mean and std per image;
each time an image is used, the pipeline draws its latents `mean + N(0, 1) * std` and
applies the release's scale and bias (`vae.encode_latents`), as the release does at the
start of each training step. The N(0, 1) draw of stream position `k` comes from
`np.random.default_rng((seed, k, LATENT_NOISE_STREAM))`, so it is new at every use of an
image (every epoch), the same on resume, and independent of process count and workers.
It is drawn here, on the host, rather than in the jitted step: the step stays the
pixel-space one, and half the bytes (4 channels, not 8) go to the devices. The draw costs
~0.3-0.4 ms per 64x64x4 image on one core of a shared 2-core EPYC (2/3 of it the normals);
worker processes spread it over the host's cores.

Loading (google/grain). This process's batches are a random-access data source
(`StreamBatches`: item `j` is its slice of global batch `j`, a pure function of `j`), read
through a `grain.MapDataset`:
  * `num_workers > 0`, a source that decodes (PNG/JPEG zips and folders, latents, tfds):
    grain's `mp_prefetch`, `num_workers` worker processes (started with `spawn`); worker
    `w` loads batches `w, w + W, ...` (`load_batch`: decode, the latents' draws) into
    shared memory, `prefetch` batches ahead, and the training process takes them in stream
    order; a thread of it makes each the training batch (`finish_batch`: pixels to float32,
    one-hot labels), `prefetch` batches ahead. Pixels travel as uint8, a quarter of their
    float32 bytes. The Python work of each image runs outside the training process's
    interpreter lock, so a host's cores add up.
  * `num_workers > 0`, a source stored decoded (`source.decoded`: Fashion-MNIST in memory,
    `raw_array.RawImages`): one grain prefetch thread in the training process, `prefetch`
    batches ahead. A batch is a gather and a conversion (NumPy, outside the lock), cheaper
    than shipping it from a worker (benchmarks/README.md).
  * `num_workers == 0`: every batch built in the calling thread when asked (debugging).
The batches are the same bit for bit in every case. Workers ignore SIGINT and SIGTERM (the
training process decides when to stop: `close()`), and exit within a second of the
training process's end however it ends (SIGKILL included), so none outlives the run. A
batch that fails to build (a corrupt file) raises the source's error, naming the file,
from `next()` and stops the workers; a worker that dies raises `LoaderWorkerError` naming
the data set.
"""
from __future__ import annotations

import atexit
import functools
import os
import re
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

import cloudpickle
import grain
import numpy as np
from absl import flags

from edm2_jax.data.base import Source
from edm2_jax.encoders import vae

LATENT_NOISE_STREAM = 0x1A7E  # third SeedSequence word of the latent draws (module doc)
_PARENT_POLL_S = 0.5          # how often a worker checks that the training process lives
_UNLINK_WAIT_S = 10          # the longest `close` waits for grain to unlink buffered batches
_in_worker = False            # True in a worker process: batches go straight to shared memory
_PARCEL_LOCK = threading.Lock()
_PARCELS: set[str] = set()    # the source files this process wrote for its workers


class LoaderWorkerError(ValueError):
    """A worker process of the loader died (killed, out of memory); the message names the
    data set. A ValueError, so that the entry points print it as one `error:` line."""


def epoch_permutation(seed: int, epoch: int, num_images: int) -> np.ndarray:
    """Order of the dataset in `epoch`: int64 [num_images]."""
    return np.random.default_rng((seed, epoch)).permutation(num_images)


class StreamOrder:
    """Dataset index of every stream position (see module docstring); caches two epochs."""

    def __init__(self, num_images: int, seed: int):
        self.num_images, self.seed = num_images, seed
        self._perms: dict[int, np.ndarray] = {}

    def __getstate__(self):  # sent to workers without its cache
        return {"num_images": self.num_images, "seed": self.seed, "_perms": {}}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = epoch_permutation(self.seed, epoch, self.num_images)
        return self._perms[epoch]

    def indices(self, first: int, count: int) -> np.ndarray:
        """Dataset indices of stream positions `[first, first + count)`: int64 [count]."""
        pos = np.arange(first, first + count, dtype=np.int64)
        epochs, offsets = np.divmod(pos, self.num_images)
        out = np.empty(count, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[offsets[sel]]
        return out


def latent_noise(seed: int, position: int, shape: tuple[int, ...]) -> np.ndarray:
    """The N(0, 1) draw (float32 `shape`) of the latents at stream `position`."""
    rng = np.random.default_rng((seed, position, LATENT_NOISE_STREAM))
    return rng.standard_normal(shape, dtype=np.float32)


def _empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An output array: in a worker, in shared memory (grain hands it over uncopied)."""
    if _in_worker and np.prod(shape):
        return grain.multiprocessing.SharedMemoryArray(shape, dtype)
    return np.empty(shape, dtype)


def load_batch(source: Source, indices: np.ndarray, positions: np.ndarray, seed: int,
               shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The items of `source` for `indices` (int64 [n]) at stream `positions`, as compact as
    they travel from a worker: `{'image': uint8 [n, H, W, C] pixels as stored, or for a
    latent source float32 `shape` [n, H, W, 4], one draw of its latents per position
    (module doc), 'label': int64 [n], 'label_dim': L}` (`finish_batch` makes the training
    batch of it). A source stored decoded is read in one gather (`read_batch`), any other
    item by item.
    ValueError naming the item for a source that breaks its contract or a label out of
    range, plus the source's own errors (a file that does not decode, named)."""
    n, latent = len(indices), getattr(source, "encoder", "none") == "sd-vae"
    item_shape = shape[1:-1] + (vae.RAW_CHANNELS,) if latent else shape[1:]
    want = np.dtype(np.float32 if latent else np.uint8)
    label_dim = int(source.label_dim)
    if getattr(source, "decoded", False):  # one gather
        items, labels = source.read_batch(indices)
        if items.shape != (n,) + item_shape or items.dtype != want:
            _broken(source, indices[0], items.dtype, items.shape[1:], want, item_shape, latent)
        image = _empty(shape, np.float32) if latent else items
        for j in range(n if latent else 0):
            image[j] = vae.encode_latents(items[j], latent_noise(seed, int(positions[j]),
                                                                 shape[1:]))
    else:  # item by item, each straight into the batch (no stacked copy)
        image = _empty(shape if latent else (n,) + item_shape, np.float32 if latent else want)
        labels = np.empty(n, np.int64)
        try:
            for j, i in enumerate(indices):
                item, labels[j] = source[int(i)]
                if np.shape(item) != item_shape or np.asarray(item).dtype != want:
                    _broken(source, i, np.asarray(item).dtype, np.shape(item), want,
                            item_shape, latent)
                image[j] = (vae.encode_latents(item, latent_noise(seed, int(positions[j]),
                                                                  shape[1:]))
                            if latent else item)
        except BaseException:
            _discard(image)
            raise
    bad = ((labels < 0) | (labels >= label_dim)) if label_dim else np.zeros(n, bool)
    if bad.any():
        j = int(np.argmax(bad))
        _discard(image)
        raise ValueError(f"{source.name}[{indices[j]}] has label {labels[j]}, outside [0, "
                         f"{label_dim}); fix the data set's labels")
    return {"image": image, "label": np.asarray(labels, np.int64), "label_dim": label_dim}


def _discard(array: np.ndarray) -> None:
    """Unlink the shared memory of a batch that will not be sent (a worker's failed batch)."""
    if isinstance(array, grain.multiprocessing.SharedMemoryArray):
        array.shm.unlink()


def _broken(source, i, dtype, shape, want, item_shape, latent) -> None:
    raise ValueError(f"{source.name}[{i}] is {dtype} {tuple(shape)}, expected {want} "
                     f"{item_shape}{' raw latents' if latent else ''}; the source breaks the "
                     f"Source contract")


def finish_batch(batch: dict) -> dict[str, np.ndarray]:
    """`load_batch`'s items as the training batch: `{'image': float32 [n, H, W, C]
    (pixels x = u8 / 127.5 - 1; latents as drawn), 'label': float32 one-hot [n, L]}`, in
    memory of this process (the pixels' float32 is 4x their bytes: made here, not shipped
    from a worker through shared memory)."""
    image, labels, label_dim = batch["image"], batch["label"], int(batch["label_dim"])
    if image.dtype == np.uint8:  # the same bits as u8.astype(f32) / f32(127.5) - f32(1)
        pixels, image = image, np.empty(image.shape, np.float32)
        np.copyto(image, pixels, casting="unsafe")
        np.divide(image, np.float32(127.5), out=image)
        np.subtract(image, np.float32(1), out=image)
    label = np.zeros((len(labels), label_dim), np.float32)
    if label_dim:
        label[np.arange(len(labels)), labels] = 1
    return {"image": image, "label": label}


def build_batch(source: Source, indices: np.ndarray, positions: np.ndarray, seed: int,
                shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The training batch of `source[i]` for `indices` at stream `positions`:
    `finish_batch(load_batch(...))` in one process."""
    return finish_batch(load_batch(source, indices, positions, seed, shape))


class StreamBatches:
    """This process's batches of the stream as a random-access data source (grain's
    `RandomAccessDataSource`): item `j` is its slice of global batch `j` of an iterator
    started at `start_nimg` (module docstring), loaded by `load_batch` (where the workers
    are) and finished by `finish_batch` (in the training process). Endless: its length is
    `sys.maxsize`.

    Pickled for the workers, it carries its source as a file (`parcel`, in the temporary
    directory; `drop_parcel` deletes it once every worker has read it): the message that
    starts a worker stays small. multiprocessing's spawn writes that message into a pipe
    the worker reads only after importing the main module, and a worker that dies first
    (a script without `if __name__ == "__main__":`, a script on stdin) would leave a
    message larger than the pipe's 64 KiB blocking the training process forever."""

    def __init__(self, source: Source, *, global_batch: int, seed: int, start_nimg: int,
                 process_index: int, process_count: int):
        self.source, self.global_batch, self.seed = source, global_batch, seed
        self.start_nimg, self.local = start_nimg, global_batch // process_count
        self.offset = process_index * self.local
        self.order = StreamOrder(len(source), seed)
        self.shape = (self.local, source.resolution, source.resolution, source.num_channels)
        self.parcel = None

    def __getstate__(self):
        with _PARCEL_LOCK:  # grain pickles one copy per worker, from a thread each
            if self.parcel is None:
                fd, self.parcel = tempfile.mkstemp(prefix="edm2-loader-source-", suffix=".pkl")
                _PARCELS.add(self.parcel)
                with os.fdopen(fd, "wb") as f:
                    cloudpickle.dump(self.source, f)
        return {k: v for k, v in self.__dict__.items() if k != "source"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        with open(self.parcel, "rb") as f:
            self.source = cloudpickle.load(f)

    def drop_parcel(self) -> None:
        parcel, self.parcel = self.parcel, None
        if parcel is not None:
            _drop(parcel)

    def __len__(self) -> int:
        return sys.maxsize

    def positions(self, j: int) -> np.ndarray:
        """Stream positions of this process's slice of batch `j`: int64 [B]."""
        first = self.start_nimg + j * self.global_batch + self.offset
        return np.arange(first, first + self.local, dtype=np.int64)

    def __getitem__(self, j: int) -> dict[str, np.ndarray]:
        """`load_batch` of this process's slice of batch `j` (`finish_batch` completes it)."""
        positions = self.positions(int(j))
        indices = self.order.indices(int(positions[0]), self.local)
        return load_batch(self.source, indices, positions, self.seed, self.shape)


def _drop(parcel: str) -> None:
    _PARCELS.discard(parcel)
    if os.path.exists(parcel):
        os.remove(parcel)


@atexit.register
def _drop_parcels() -> None:  # those of iterators never closed
    for parcel in list(_PARCELS):
        _drop(parcel)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)  # the training process is gone: nothing will take our batches


def _worker_init(parent_pid: int, worker_index: int, worker_count: int) -> None:
    """Run first in each worker (grain's `worker_init_fn`; module docstring)."""
    global _in_worker
    _in_worker = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True,
                     name=f"edm2-loader-{worker_index}-of-{worker_count}-watchdog").start()


def _absl_flags_readable() -> None:
    """grain 0.2.18 reads an absl flag (worker profiling, default off) as it starts worker
    processes, which raises UnparsedFlagAccessError outside an absl app (notebooks, tests,
    the benchmarks); there, mark it given so that its default is read."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS["grain_enable_multiprocess_worker_profiling"].present = True


def _received(batch: dict) -> dict[str, np.ndarray]:
    """Plain ndarray views of grain's shared-memory arrays, each segment's name unlinked at
    once: its pages live (mapped) as long as the batch does, and a batch still held when
    the interpreter exits leaves nothing in /dev/shm for the resource tracker."""
    for v in batch.values():
        if isinstance(v, grain.multiprocessing.SharedMemoryArray) and v._unlink_on_del:
            v.shm.unlink()
            v._unlink_on_del = False
    return {k: np.asarray(v) for k, v in batch.items()}


def _quiet_shm_teardown() -> None:
    """At exit (before modules are torn down): grain's `SharedMemoryArray.__del__` raises
    when it runs during the teardown (its module's globals are gone by then) and prints
    "Exception ignored" once per batch still alive; from now on those are ignored."""
    delete = grain.multiprocessing.SharedMemoryArray.__del__

    def quiet(self):
        try:
            delete(self)
        except Exception:  # noqa: BLE001
            pass
    grain.multiprocessing.SharedMemoryArray.__del__ = quiet


atexit.register(_quiet_shm_teardown)


class Batches(Iterator[dict]):
    """The iterator `make_iterator` returns: `next()` gives the next batch; `close()` (or
    leaving a `with` block) stops the workers and threads, after which `next()` raises
    StopIteration. Closing twice is fine."""

    def __init__(self, it: Any, batches: StreamBatches, num_workers: int):
        self._it, self._batches, self._workers = it, batches, num_workers
        self._source, self._received = batches.source, 0

    def __next__(self) -> Any:
        if self._it is None:
            raise StopIteration
        try:
            batch = next(self._it)
            self._received += 1
            if self._received == self._workers:  # batch w came from worker w: all started
                self._batches.drop_parcel()
            return batch
        except Exception as e:
            self.close()  # a batch that failed ends the loader: its workers stop now
            died = isinstance(e, RuntimeError) and re.search(  # grain's words for a dead worker
                r"terminated unexpectedly with exit code (-?\d+)", str(e))
            if died:
                raise LoaderWorkerError(self._died(int(died.group(1)))) from None
            raise

    def _died(self, code: int) -> str:
        where = getattr(self._source, "path", "") or self._source.name
        how = f"exit code {code} (its error is printed above)"
        if code < 0:
            how = f"signal {-code} ({signal.Signals(-code).name})"
            if -code == signal.SIGKILL:
                how += ", e.g. by the kernel for lack of memory: lower data.num_workers or the batch"
        return (f"a data loader worker process (1 of data.num_workers={self._workers}) reading "
                f"{where} died with {how}; the run stops here (rerun it to resume from its "
                f"last checkpoint)")

    def close(self) -> None:
        it, self._it = self._it, None  # grain's iterators go now, not at interpreter exit
        if it is not None:
            try:
                it.close()
            finally:
                self._batches.drop_parcel()
            # The batches still buffered are unlinked by grain's deletion thread; wait for
            # it (its tasks run in order), or a run that ends now leaves them to the
            # resource tracker.
            pool = grain.multiprocessing.SharedMemoryArray._del_thread_pool
            if pool is not None and not sys.is_finalizing():
                pool.apply_async(int).wait(_UNLINK_WAIT_S)

    def __enter__(self) -> "Batches":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit grain's modules may be gone
            pass


def make_iterator(source: Source, *, global_batch: int, seed: int, start_nimg: int = 0,
                  process_index: int = 0, process_count: int = 1, num_workers: int = 2,
                  prefetch: int = 1, put: Callable[[dict], Any] | None = None,
                  device_prefetch: int = 2) -> Batches:
    """Infinite iterator of this process's share of each global batch.

    Yields `{'image': float32 [B, H, W, C] in [-1, 1] (uint8 / 127.5 - 1; for a latent
    source the drawn, scaled latents, module doc), 'label': float32 one-hot
    [B, label_dim] ([B, 0] when unlabelled)}` with `B = global_batch / process_count`;
    fresh arrays every batch, the same whatever `num_workers` (module doc: worker processes
    for a source that decodes, a prefetch thread for one stored decoded, 0 = the calling
    thread) and `prefetch` (batches each worker or the thread keeps ready). With `put`
    (e.g. `functools.partial(sharding.global_batch, mesh)`: this process's rows onto its
    devices), yields `put(batch)` instead, `device_prefetch` batches put ahead by a thread.
    Raises ValueError for a batch not divisible by `process_count`, a bad process index,
    a negative seed, start_nimg or num_workers, or an empty source; errors of the source
    (e.g. a corrupt file, named) and `LoaderWorkerError` surface from `next()`. Call
    `.close()` to stop the workers.
    """
    n = len(source)
    if n == 0:
        raise ValueError(f"data source {source.name} is empty")
    if global_batch <= 0 or global_batch % process_count:
        raise ValueError(f"global batch {global_batch} must be a positive multiple of the "
                         f"number of processes {process_count}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if seed < 0 or start_nimg < 0:
        raise ValueError(f"seed ({seed}) and start_nimg ({start_nimg}) must be >= 0")
    if num_workers < 0:
        raise ValueError(f"data.num_workers={num_workers}: must be >= 0 (0 = load in the "
                         f"training process)")
    batches = StreamBatches(source, global_batch=global_batch, seed=seed, start_nimg=start_nimg,
                            process_index=process_index, process_count=process_count)
    prefetch = max(1, int(prefetch))
    workers = num_workers > 0 and not getattr(source, "decoded", False)
    if workers:
        _absl_flags_readable()
        ds = grain.MapDataset.source(batches).to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(
            num_workers=num_workers, per_worker_buffer_size=prefetch),
            worker_init_fn=functools.partial(_worker_init, os.getpid()))
        # The float32 conversion and one-hot labels, `prefetch` batches ahead in a thread.
        ds = grain.experimental.ThreadPrefetchIterDataset(ds.map(_received).map(finish_batch),
                                                          prefetch_buffer_size=prefetch)
    else:
        threads = min(num_workers, 1)  # 0: the calling thread; else one prefetch thread
        ds = grain.MapDataset.source(batches).map(finish_batch).to_iter_dataset(
            grain.ReadOptions(num_threads=threads, prefetch_buffer_size=threads * prefetch))
    if put is not None:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=1)
        ds = grain.experimental.ThreadPrefetchIterDataset(ds.map(put),
                                                          prefetch_buffer_size=device_prefetch)
    return Batches(iter(ds), batches, num_workers if workers else 0)
