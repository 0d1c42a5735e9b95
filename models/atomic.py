"""Atomic file writes, for checkpoints and the data cache.

A file is written to a temporary name beside it, fsynced, renamed over the target with
os.replace, and the directory fsynced so that the rename itself survives a crash. Readers
see the old file or the complete new one, never a partial one; any failure removes the
temporary file and leaves the target as it was. The temporary name, `.{name}.tmp{pid}`,
is unique to the process (DDP ranks may write the same file) and matches the `.*.tmp*`
leftovers that checkpoint pruning removes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Make the contents of a file written by someone else (a library's writer) durable."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably (see the module docstring).
    Raises OSError on failure, with `path` untouched and no temporary file left."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json(path: Path, obj: Any, *, indent: int | None = None) -> None:
    """write_bytes of json.dumps(obj, indent=indent)."""
    write_bytes(path, json.dumps(obj, indent=indent).encode())
