"""Byte-level Shakespeare: uint8 memmaps built on first use from data/shakespeare.txt.xz."""
from __future__ import annotations

import lzma
import os
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "data" / "shakespeare.txt.xz"
CACHE = ROOT / "data" / "cache"
VAL_FRACTION = 0.1


class DataError(RuntimeError):
    """Missing or unreadable training data; the message says how to fix it."""


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prepare(source: Path = SOURCE, cache: Path = CACHE) -> dict[str, Path]:
    """Decompress the corpus and split it 90/10 into train.bin / val.bin (once)."""
    out = {"train": cache / "train.bin", "val": cache / "val.bin"}
    if all(p.exists() for p in out.values()):
        return out
    if not source.exists():
        raise DataError(
            f"training text {source} is missing: restore it with `git checkout -- {source.relative_to(ROOT)}`, "
            "or rebuild it with scripts/prepare_data.py (see data/README.md)"
        )
    try:
        data = lzma.decompress(source.read_bytes())
    except (lzma.LZMAError, OSError) as e:
        raise DataError(f"cannot read {source} ({e}): restore it with git or rebuild it with scripts/prepare_data.py")
    cache.mkdir(parents=True, exist_ok=True)
    cut = int(len(data) * (1 - VAL_FRACTION))
    _write_atomic(out["train"], data[:cut])
    _write_atomic(out["val"], data[cut:])
    return out


def load(split: str) -> np.memmap:
    """The split's bytes as a read-only uint8 memmap (tokens are bytes: vocab 256)."""
    path = prepare()[split]
    return np.memmap(path, dtype=np.uint8, mode="r")


def batch(data: np.memmap, starts: torch.Tensor, block_size: int):
    """(x, y) int64 tensors of shape (len(starts), block_size): y is x shifted by one."""
    idx = starts.numpy()[:, None] + np.arange(block_size + 1)[None, :]
    chunk = torch.from_numpy(data[idx].astype(np.int64))
    return chunk[:, :-1], chunk[:, 1:]
