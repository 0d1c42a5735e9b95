"""One run per output directory: an OS lock on the directory itself, held for the run's life.

The lock is flock on an open descriptor of the directory, not on a file in it: a lock file
can be deleted while it is held, and the next run then creates and locks a new file of
the same name and gets in, after which each run prunes the other's checkpoints. The
directory cannot be swapped that way while it holds a run's files. The kernel drops the
lock when the descriptor closes or the process dies, however it dies, so a killed run
leaves nothing to clean up.
"""
from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path


class OutDirError(RuntimeError):
    """An output directory that cannot be used: not creatable, not writable, held by another
    run, or holding another run's checkpoints."""


class OutDirLock:
    """The flock on an output directory, held until release()."""

    def __init__(self, fd: int):
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1


def claim(out_dir: Path, create: bool = True) -> OutDirLock:
    """Check that `out_dir` is a directory this process can write (creating it when asked),
    and lock it, before any training: a second run into it, or an unusable one, is an
    OutDirError at once instead of a lost run at its end."""
    out_dir = Path(out_dir)
    if create:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise OutDirError(f"--out-dir {out_dir}: exists and is not a directory") from None
        except OSError as e:
            raise OutDirError(f"--out-dir {out_dir}: cannot create it ({e.strerror or e})") from None
    try:
        fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        raise OutDirError(f"--out-dir {out_dir}: not a directory") from None
    except OSError as e:
        raise OutDirError(f"--out-dir {out_dir}: cannot open it ({e.strerror or e})") from None
    lock = OutDirLock(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        lock.release()
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise OutDirError(f"--out-dir {out_dir}: another run is writing to it; wait for it to end or choose "
                              "another --out-dir") from None
        raise OutDirError(f"--out-dir {out_dir}: cannot lock it ({e.strerror or e})") from None
    try:  # the lock needs no write permission: prove that new files can be made here
        probe = out_dir / f".probe.tmp{os.getpid()}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        probe.unlink()
    except OSError as e:
        lock.release()
        raise OutDirError(f"--out-dir {out_dir}: not writable ({e.strerror or e})") from None
    return lock
