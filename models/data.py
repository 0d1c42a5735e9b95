"""Byte-level Shakespeare: uint8 memmaps built on first use from data/shakespeare.txt.xz.

The cache records the size and sha256 of the text it was built from, so a rebuilt or
restored corpus replaces a stale cache instead of silently training on the old one.
"""
from __future__ import annotations

import functools
import hashlib
import json
import lzma
from pathlib import Path

import numpy as np
import torch

from .atomic import write_bytes, write_json

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "data" / "shakespeare.txt.xz"
CACHE = ROOT / "data" / "cache"
VAL_FRACTION = 0.1


class DataError(RuntimeError):
    """Missing or unreadable training data; the message says how to fix it."""


def _stamp(source: Path) -> dict:
    raw = source.read_bytes()
    return {"source": source.name, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def prepare(source: Path | None = None, cache: Path | None = None) -> dict[str, Path]:
    """Decompress the corpus (default SOURCE) and split it 90/10 into train.bin / val.bin
    under `cache` (default CACHE), unless the cache already holds this very source's split."""
    source, cache = Path(source or SOURCE), Path(cache or CACHE)
    out = {"train": cache / "train.bin", "val": cache / "val.bin"}
    rel = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
    fix = f"restore it with `git checkout -- {rel}` or rebuild it with scripts/prepare_data.py (see data/README.md)"
    if not source.exists():
        raise DataError(f"training text {source} is missing: {fix}")
    try:
        stamp = _stamp(source)
    except OSError as e:
        raise DataError(f"cannot read {source} ({e.strerror or e}): {fix}") from None
    try:
        if json.loads((cache / "meta.json").read_text()) == stamp and all(p.exists() for p in out.values()):
            return out
    except (OSError, ValueError):
        pass  # no cache yet, or an unreadable one: rebuild
    try:
        text = lzma.decompress(source.read_bytes())
    except (lzma.LZMAError, OSError) as e:
        raise DataError(f"cannot decompress {source} ({e}): {fix}") from None
    cut = int(len(text) * (1 - VAL_FRACTION))
    try:
        cache.mkdir(parents=True, exist_ok=True)
        write_bytes(out["train"], text[:cut])  # each atomic: a failure leaves no partial file
        write_bytes(out["val"], text[cut:])
        write_json(cache / "meta.json", stamp)  # last: marks the cache complete
    except OSError as e:
        raise DataError(f"cannot write the data cache in {cache} ({e.strerror or e}): "
                        "make it writable or free some space") from None
    return out


@functools.cache
def load(split: str) -> np.memmap:
    """The split ("train" or "val") as a read-only uint8 memmap: tokens are bytes, vocab 256."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    return np.memmap(prepare()[split], dtype=np.uint8, mode="r")


def batch(data: np.ndarray, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 tensors of shape (len(starts), block_size): y is x shifted by one."""
    idx = starts.numpy()[:, None] + np.arange(block_size + 1)[None, :]  # (n, block_size + 1)
    chunk = torch.from_numpy(data[idx].astype(np.int64))
    return chunk[:, :-1], chunk[:, 1:]
