"""models/atomic.py, the one atomic writer behind checkpoints and the data cache: a write
that fails at any step leaves the previous file byte-for-byte and no temporary file."""
import json
import os

import pytest

from models import atomic


def test_write_replaces_the_file_and_leaves_nothing_else(tmp_path):
    target = tmp_path / "f.bin"
    atomic.write_bytes(target, b"first")
    atomic.write_bytes(target, b"second, longer")
    assert target.read_bytes() == b"second, longer"
    obj = {"checkpoint": "ckpt-000002", "n": [1, 2.5]}
    atomic.write_json(tmp_path / "latest", obj, indent=1)
    assert (tmp_path / "latest").read_text() == json.dumps(obj, indent=1)  # the checkpoints' format
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin", "latest"]


def _fail_once(real, exc):
    calls = []

    def fake(*args):
        calls.append(args)
        if len(calls) == 1:
            raise exc
        return real(*args)

    return fake


@pytest.mark.parametrize("step,exc", [
    ("fsync", OSError(28, "No space left on device")),
    ("replace", OSError(28, "No space left on device")),
    ("fsync", KeyboardInterrupt()),  # not only OSError: any exception cleans up
])
def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch, step, exc):
    target = tmp_path / "f.bin"
    atomic.write_bytes(target, b"old contents")
    monkeypatch.setattr(os, step, _fail_once(getattr(os, step), exc))
    with pytest.raises(type(exc)):
        atomic.write_bytes(target, b"new contents that never land")
    monkeypatch.undo()
    assert target.read_bytes() == b"old contents"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]
