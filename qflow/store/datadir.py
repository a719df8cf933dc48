"""The data directory: where one qflowd keeps what survives a restart.

``DataDir.open(path)`` creates the directory if it is missing (mode 0700: the
store holds message bodies) and locks it, so that two brokers never write the
same files. The lock is ``flock`` on ``DIR/lock``, taken without waiting. The
kernel releases it when the process ends however it ends, so a SIGKILLed or
crashed broker leaves no stale lock behind and needs no clean-up. The locker's
PID is written into the lock file only so that a refusal can name the holder;
the PID is never trusted as the lock itself (it outlives its process).

The lock file is never unlinked: a process that opened it just before the
unlink would lock an inode nobody else can see, and two brokers would run.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

LOCK_NAME = "lock"


class StoreError(Exception):
    """The store cannot be used; qflowd turns it into one line on stderr and exit status 1."""


class DataDirLocked(StoreError):
    """Another process holds the data directory's lock."""

    def __init__(self, path: Path, pid: int | None) -> None:
        holder = f"process {pid}" if pid is not None else "another process (its PID is not written yet)"
        super().__init__(f"data directory {path} is locked by {holder}: one qflowd per data directory "
                         "(give this one another --data-dir, or --no-data-dir)")
        self.path = path
        self.pid = pid


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a new name, a rename) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DataDir:
    """An open, locked data directory; :meth:`close` (or the process ending) unlocks it."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._lock_fd: int | None = lock_fd

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> DataDir:
        """Create (mode 0700) and lock ``path``. Raises DataDirLocked if another
        process holds it, StoreError if it cannot be made or used."""
        path = Path(path).expanduser().absolute()
        try:
            created = not path.exists()
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if created:
                fsync_dir(path.parent)
        except OSError as exc:
            raise StoreError(f"cannot create data directory {path}: {exc.strerror or exc}") from None
        if not path.is_dir():
            raise StoreError(f"data directory {path} is not a directory")
        lock_path = path / LOCK_NAME
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StoreError(f"cannot open {lock_path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            pid = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DataDirLocked(path, pid) from None
            raise StoreError(f"cannot lock {lock_path}: {exc.strerror or exc}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise StoreError(f"cannot write {lock_path}: {exc.strerror or exc}") from None
        return cls(path, fd)

    def close(self) -> None:
        """Unlock. The lock file stays (see the module's docstring)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
