"""The on-disk kernel cache shared by the llvm, CUDA and host-C builds.

An entry is a folder named by a hash of everything its contents depend on. It is built in a
temporary sibling and renamed into place, so an entry is either complete or absent: a build that
fails or is killed leaves no half-written entry behind, and of two processes that build the same
entry at once the first rename wins and the other discards its copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE = Path(os.environ.get("MEXC_CACHE_DIR", Path(tempfile.gettempdir()) / "mexc-cache"))


def sources_digest(paths: Iterable[Path]) -> str:
    """Hash of the code a cache entry's builder runs. Call it when that code is imported: the
    code this process runs, even if the files change while it runs (an entry keyed by newer
    sources would otherwise hold what the older code built)."""
    h = hashlib.sha256()
    for path in paths:
        h.update(path.read_bytes())
    return h.hexdigest()


def build_entry(folder: Path, build: Callable[[Path], None]) -> Path:
    """Run `build(tmp)` into a fresh temporary folder beside `folder`, then rename it to
    `folder` (kept as it is when another process finished first). Returns `folder`."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, folder)  # atomic on one file system
    except OSError:  # another process finished the same build first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@contextmanager
def entry_lock(folder: Path) -> Iterator[None]:
    """Held while one process builds cache entry `folder`: another that needs the same entry
    (a data-parallel job's workers compile the same step) waits here and then loads it,
    instead of building it again on the same cores. The lock file's lock goes with the
    process (an exclusive flock), so a builder that dies releases it. A cache where no lock
    can be taken (read-only, no flock) is used without one: an existing entry still loads."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        f = open(folder.parent / f"{folder.name}.lock", "a")  # noqa: SIM115 - closed below
    except OSError:
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Run `write(tmp)` to a fresh temporary file beside `path`, then rename it to `path`:
    readers see the old file or the whole new one, never part of it."""
    fd, name = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
