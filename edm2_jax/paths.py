"""Every path a run reads or writes: local or a cloud URL (`gs://bucket/...`).

One abstraction, etils' `epath.Path` (what Orbax uses): on a local path it is the OS
(`os`, `shutil`), on `gs://` it is fsspec/gcsfs (`pip install gcsfs`, in the `gcs`
extra). Orbax checkpoints and snapshots use the same URLs through TensorStore's `gcs`
driver. Paths stay strings in the rest of the project; `os.path.join/basename/dirname`
are fine on URLs, everything that touches storage goes through here.

Differences on object storage (no directories, no rename, no append, no locks):
  * `write_text_atomic`: locally a temporary file, fsynced, then renamed over the
    target; on GCS one object write, which is atomic by itself.
  * `rename`: locally `os.replace`; on GCS a copy then delete (not atomic; used only to
    set aside checkpoints and to start over).
  * appending (stats.jsonl) and run locks: see `run.stats.StatsLogger`, `run.lock.RunLock`.

Pointing at a GCS emulator (tests/test_gcs_workdir.py): `STORAGE_EMULATOR_HOST` (gcsfs)
and `TENSORSTORE_GCS_HTTP_URL` (TensorStore), both `http://host:port`.

Output locations are checked before any work (`check_output_dir`, `check_output_file`):
locally a directory that can be made and written (a probe file written, synced and
removed: read-only disks, permissions and a full disk show there), not a file; on
`gs://` gcsfs installed and the bucket answering within `$EDM2_JAX_GCS_PROBE_TIMEOUT_S`
seconds (default 20). They raise `OutputLocationError`, one message naming the
location, the problem and the fix.
"""
from __future__ import annotations

import builtins
import contextlib
import errno
import os
import shutil
import socket
import tempfile
import threading
import urllib.parse

from etils import epath


def is_url(path) -> bool:
    """Whether `path` is a URL (`gs://...`), not a local path."""
    return "://" in os.fspath(path)


def normalize(path) -> str:
    """A local path made absolute (`~` expanded); a URL unchanged (without a trailing /)."""
    path = os.fspath(path)
    if is_url(path):
        return path.rstrip("/")
    return os.path.abspath(os.path.expanduser(path))


def Path(path) -> epath.Path:  # noqa: N802 - a constructor
    """`epath.Path` of `path` (normalised)."""
    return epath.Path(normalize(path))


def exists(path) -> bool:
    return Path(path).exists()


def isfile(path) -> bool:
    return Path(path).is_file()


def isdir(path) -> bool:
    return Path(path).is_dir()


def listdir(path) -> list[str]:
    """The names in directory `path`, sorted; [] when it does not exist."""
    p = Path(path)
    return sorted(c.name for c in p.iterdir()) if p.is_dir() else []


def makedirs(path) -> None:
    """`mkdir -p` (nothing on object storage, where directories are implied)."""
    Path(path).mkdir(parents=True, exist_ok=True)


def open(path, mode: str = "r"):  # noqa: A001 - the file API's name
    return Path(path).open(mode)


def read_text(path) -> str:
    return Path(path).read_text()


def write_text_atomic(path, text: str) -> None:
    """Write `text` to `path` so that readers see the old or the new file, never part:
    locally into `path.tmp`, fsync, `os.replace`; on object storage one object write."""
    if is_url(path):
        Path(path).write_text(text)
        return
    path = normalize(path)
    with builtins.open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def rename(src, dst) -> None:
    """Move file or directory `src` to `dst`: `os.replace` locally; on object storage
    a copy of every object, then their deletion (not atomic)."""
    if not is_url(src):
        os.replace(normalize(src), normalize(dst))
        return
    s, d = Path(src), Path(dst)
    if s.is_dir():
        for child in s.iterdir():
            rename(os.fspath(child), os.path.join(os.fspath(d), child.name))
        try:
            s.rmtree()
        except FileNotFoundError:  # the implied directory went with its last object
            pass
    else:
        s.copy(d, overwrite=True)
        s.unlink()


def copy_file(src, dst) -> None:
    """Copy one file (local or URL, either way), overwriting."""
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    Path(src).copy(Path(dst), overwrite=True)


def write_through_local(path, write) -> None:
    """Call `write(local_path)` for a writer that only knows local files (PIL, matplotlib):
    locally at a temporary name beside `path` (`.<stem>.tmp<ext>`, the extension kept for
    writers that choose the format by it) then renamed to `path`, so that `path` is
    whole or absent; for a URL at a temporary local file that is then copied there.
    Raises OutputLocationError when the local disk refuses the file (full: naming the
    disk and its free space; read-only; no permission), the temporary file removed."""
    if not is_url(path):
        path = normalize(path)
        directory, name = os.path.split(os.path.abspath(path))
        stem, ext = os.path.splitext(name)
        tmp = os.path.join(directory, f".{stem}.tmp{ext}")
        try:
            os.makedirs(directory, exist_ok=True)
            write(tmp)
            os.replace(tmp, path)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            if not isinstance(e, OSError) or e.errno is None:  # not the disk's (PIL's own)
                raise
            fix = "free space there" if e.errno in FULL_DISK else "make it writable"
            raise OutputLocationError(f"writing {path} failed: {write_problem(directory, e)}; "
                                      f"{fix} and re-run the same command") from None
        return
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, os.path.basename(normalize(path)))
        write(local)
        copy_file(local, path)


# --------------------------------------------------------------------------------------
# Output locations, checked before any work

GCS_PROBE_TIMEOUT_ENV = "EDM2_JAX_GCS_PROBE_TIMEOUT_S"
GCS_PROBE_TIMEOUT_S = 20.0
GCS_ENDPOINT = "https://storage.googleapis.com"
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


class OutputLocationError(ValueError):
    """An output location that cannot be written; the message names it, why, and the fix."""


def human_bytes(n: float) -> str:
    """`n` bytes as '1.5 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _existing_ancestor(path: str) -> str:
    """`path` or its nearest ancestor that exists (local)."""
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _mount_point(path: str) -> str:
    path = os.path.realpath(_existing_ancestor(path))
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def disk_space(path) -> str:
    """'the disk mounted at M (F free of T)' for the local `path` (or its ancestor)."""
    where = _existing_ancestor(normalize(path))
    usage = shutil.disk_usage(where)
    return (f"the disk mounted at {_mount_point(where)} ({human_bytes(usage.free)} free of "
            f"{human_bytes(usage.total)})")


def disk_free(path: str) -> str:
    """`mount point (X GiB free of Y GiB)` of the disk holding `path` (a URL: itself)."""
    if is_url(path):
        return path
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    mount = p
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    try:
        u = shutil.disk_usage(p)
        return f"{mount} ({u.free / 2**30:.2f} GiB free of {u.total / 2**30:.2f} GiB)"
    except OSError:
        return mount


def write_problem(path, err: OSError) -> str:
    """Why writing at the local `path` failed with `err`, as a phrase: a read-only file
    system, a full disk (named, with its free space), no permission, or `err` itself."""
    path = normalize(path)
    if err.errno == errno.EROFS:
        return f"{path} is on a read-only file system (mounted at {_mount_point(path)})"
    if err.errno in FULL_DISK:
        return f"{disk_space(path)} is full"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"no permission to write in {path}"
    return f"cannot write in {path} ({err.strerror or err})"


def _probe_write(directory: str) -> None:
    """Write, sync and remove a small file in the existing local `directory`; raises
    the OSError of a disk that refuses (read-only, full, no permission)."""
    fd, tmp = tempfile.mkstemp(prefix=".edm2-write-check-", dir=directory)
    try:
        os.write(fd, b"\0" * 4096)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(tmp)


def _check_local(path: str, flag: str, is_dir: bool) -> None:
    given = f"{flag}={path}"
    path = normalize(path)
    if is_dir and os.path.exists(path) and not os.path.isdir(path):
        raise OutputLocationError(f"{given} is a file, not a directory; pass a directory "
                                  f"(a new one, or one this command wrote before)")
    if not is_dir and os.path.isdir(path):
        raise OutputLocationError(f"{given} is a directory; pass the path of a file to "
                                  f"write (a new name, or a file this command wrote before)")
    parent = _existing_ancestor(path if is_dir else os.path.dirname(path))
    if not os.path.isdir(parent):
        raise OutputLocationError(f"{given}: {parent} is a file, so no directory can be made "
                                  f"there; pass a path under a directory")
    try:
        _probe_write(parent)
    except OSError as e:
        fix = ("free space there or pass a {} on another disk" if e.errno in FULL_DISK
               else "make it writable or pass a {} on a writable disk").format(flag)
        raise OutputLocationError(f"{given}: {write_problem(parent, e)}; {fix}") from None


_REACHED: set[str] = set()


def _gcs_endpoint() -> tuple[str, int]:
    url = urllib.parse.urlparse(os.environ.get("STORAGE_EMULATOR_HOST") or GCS_ENDPOINT)
    return url.hostname or "storage.googleapis.com", url.port or (
        443 if url.scheme == "https" else 80)


def _probe_gcs(path: str, timeout: float) -> None:
    """The network reaches the GCS endpoint (unless a proxy is set), then `path` is
    looked up there (credentials and bucket); raises what fails."""
    proxied = any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY"))
    if not proxied:
        host, port = _gcs_endpoint()
        try:
            socket.create_connection((host, port), timeout=min(timeout, 10.0)).close()
        except OSError as e:
            raise ConnectionError(f"cannot connect to {host}:{port} "
                                  f"({e.strerror or type(e).__name__})") from None
    Path(path).exists()


def _check_url(path: str, flag: str) -> None:
    given = f"{flag}={path}"
    try:
        import gcsfs  # noqa: F401 - fsspec's gs:// file system, loaded by etils on first use
    except ImportError:
        raise OutputLocationError(f"{given} needs gcsfs (gs:// support), which is not "
                                  f"installed: pip install -e '.[gcs]' (or pip install gcsfs)"
                                  ) from None
    bucket = urllib.parse.urlparse(path).netloc
    if bucket in _REACHED:
        return
    timeout = float(os.environ.get(GCS_PROBE_TIMEOUT_ENV) or GCS_PROBE_TIMEOUT_S)
    outcome: dict = {}

    def probe():
        try:
            _probe_gcs(path, timeout)
            outcome["ok"] = True
        except BaseException as e:  # noqa: BLE001 - reported below, in the caller's thread
            outcome["error"] = e

    # A daemon thread: gcsfs retries an unreachable endpoint for about a minute.
    thread = threading.Thread(target=probe, name="gcs-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    fix = ("check the network and the credentials (gcloud auth application-default login, "
           "or GOOGLE_APPLICATION_CREDENTIALS), or pass a local path")
    if "error" in outcome:
        e = outcome["error"]
        why = " ".join(str(e).split())[:200] or type(e).__name__
        raise OutputLocationError(f"{given}: cannot reach the bucket gs://{bucket} "
                                  f"({type(e).__name__}: {why}); {fix}")
    if not outcome.get("ok"):
        raise OutputLocationError(f"{given}: the bucket gs://{bucket} did not answer within "
                                  f"{timeout:g} s (${GCS_PROBE_TIMEOUT_ENV}); {fix}")
    _REACHED.add(bucket)


def name_problem(path: str, margin: int = 0) -> str | None:
    """What keeps the local `path` from being written on the file system of its nearest
    existing folder, None when nothing: a name in it longer than `PC_NAME_MAX` (255
    bytes on most; "the name zzz... is 300 bytes long, more than the 255 its file system
    allows"), or the whole path, with `margin` bytes more written inside it, than
    `PC_PATH_MAX` (4096). Checked before any work: the write would fail only at the first
    file."""
    path = os.path.abspath(path)
    probe = path
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)

    def limit(key: str, default: int) -> int:
        try:
            return os.pathconf(probe, key)
        except (OSError, ValueError):
            return default
    name_max = limit("PC_NAME_MAX", 255)
    for name in path.split(os.sep):
        if len(os.fsencode(name)) > name_max:
            return (f"the name {name[:24]}... is {len(os.fsencode(name))} bytes long, more "
                    f"than the {name_max} its file system allows")
    path_max = limit("PC_PATH_MAX", 4096)
    if len(os.fsencode(path)) + margin >= path_max:
        return f"the path is longer than the {path_max} bytes its file system allows"
    return None


def check_output_dir(path, flag: str) -> None:
    """Check, before any work, that the directory `path` (given as `flag`, e.g.
    '--outdir') can be made and written: locally not a file, under a directory, on a
    disk that accepts a write (not read-only, not full, permitted); on `gs://` gcsfs
    installed and the bucket reachable. Writes nothing that stays. Raises
    OutputLocationError naming the location, the problem and the fix."""
    path = os.fspath(path)
    if is_url(path):
        _check_url(path, flag)
    else:
        _check_local(path, flag, is_dir=True)


def check_output_file(path, flag: str) -> None:
    """`check_output_dir` for a file to be written at `path`: not a directory, its
    directory makeable and writable (or its bucket reachable)."""
    path = os.fspath(path)
    if is_url(path):
        _check_url(path, flag)
    else:
        _check_local(path, flag, is_dir=False)
