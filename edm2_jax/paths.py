"""Every path a run reads or writes: local or a cloud URL (`gs://bucket/...`).

One abstraction, etils' `epath.Path` (what Orbax uses): on a local path it is the OS
(`os`, `shutil`), on `gs://` it is fsspec/gcsfs (`pip install gcsfs`, in the `gcs`
extra). Orbax checkpoints and snapshots use the same URLs through TensorStore's `gcs`
driver. Paths stay strings in the rest of the project; `os.path.join/basename/dirname`
are fine on URLs, everything that touches storage goes through here.

Differences on object storage (no directories, no rename, no append, no locks):
  * `write_text_atomic`: locally write-then-fsync-then-rename (as before); on GCS one
    object write, which is atomic by itself.
  * `rename`: locally `os.replace`; on GCS a copy then delete (not atomic; used only to
    set aside checkpoints and to start over).
  * appending (stats.jsonl) and run locks: see `run.stats.StatsLogger`, `run.lock.RunLock`.

Pointing at a GCS emulator (tests/test_gcs_workdir.py): `STORAGE_EMULATOR_HOST` (gcsfs)
and `TENSORSTORE_GCS_HTTP_URL` (TensorStore), both `http://host:port`.
"""
from __future__ import annotations

import builtins
import os
import tempfile

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
    at `path` itself when it is local (its directory made first), else at a temporary
    local file that is then copied to the URL."""
    if not is_url(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write(path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, os.path.basename(normalize(path)))
        write(local)
        copy_file(local, path)
