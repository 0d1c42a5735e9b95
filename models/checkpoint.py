"""Checkpoints as safetensors + JSON, written atomically; loading never unpickles anything.

Layout of an output directory:

    latest                  JSON {"checkpoint": "ckpt-000100"}: the newest complete checkpoint
    ckpt-000100/
        model.safetensors       weights (shared tensors such as the tied head stored once)
        optimizer.safetensors   optimizer state tensors and RNG states
        meta.json               config, step, optimizer hyperparameters, loss history, and
                                the size and sha256 of both safetensors files

A checkpoint is written into a temporary directory, every file fsynced, then renamed
into place, and only then does `latest` (itself written to a temp file, fsynced and
renamed) move to it. A crash or a full disk at any moment leaves the previous checkpoint
and pointer intact.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from .gpt import GPTConfig

FORMAT = 1
KEEP = 2  # complete checkpoints kept on disk; older ones are pruned


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated, corrupt or does not fit; names the file."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _digest(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Split an optimizer state_dict into safetensors tensors and JSON-able rest."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for i, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"state.{i}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{i}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_state_dict(tensors: dict, meta: dict) -> dict:
    state: dict = {}
    for key, v in tensors.items():
        if key.startswith("state."):
            _, i, k = key.split(".", 2)
            state.setdefault(int(i), {})[k] = v
    for key, v in meta["scalars"].items():
        i, k = key.split(".", 1)
        state.setdefault(int(i), {})[k] = v
    return {"state": state, "param_groups": meta["param_groups"]}


def save(
    out_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: dict,
    rng: dict[str, torch.Tensor],
    extra: Optional[dict] = None,
) -> Path:
    """Write checkpoint `ckpt-{step}` atomically, then point `latest` at it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{step:06d}"
    final = out_dir / name
    tmp = out_dir / f".{name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_model(model, str(tmp / "model.safetensors"))
        opt_tensors, opt_meta = _optimizer_tensors(optimizer)
        tensors = dict(opt_tensors, **{f"rng.{k}": v.cpu().contiguous() for k, v in rng.items()})
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        files = {}
        for f in ("model.safetensors", "optimizer.safetensors"):
            _fsync_file(tmp / f)
            files[f] = _digest(tmp / f)
        meta = {"format": FORMAT, "step": step, "config": config, "optimizer": opt_meta, "files": files, **(extra or {})}
        _write_json_atomic(tmp / "meta.json", meta)
        if final.exists():  # left by a run killed before it moved `latest` (never its target)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_json_atomic(out_dir / "latest", {"checkpoint": name})
    _prune(out_dir, keep=name)
    return final


def _checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoint directories, oldest step first (by number: ckpt-1000000 > ckpt-999999)."""
    found = [p for p in Path(out_dir).glob("ckpt-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _prune(out_dir: Path, keep: str) -> None:
    """Drop all but the newest KEEP checkpoints, and temp files a killed writer left behind
    (one writer per output directory: only rank 0 saves)."""
    for p in _checkpoints(out_dir)[:-KEEP]:
        if p.name != keep:
            shutil.rmtree(p, ignore_errors=True)
    for p in out_dir.glob(".*.tmp*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def clear(out_dir: Path) -> int:
    """Remove an earlier run's checkpoints (pointer first, so no half-removed one is ever
    `latest`); returns how many there were. A fresh run calls this before its first save."""
    out_dir = Path(out_dir)
    (out_dir / "latest").unlink(missing_ok=True)
    old = _checkpoints(out_dir)
    for p in old:
        shutil.rmtree(p)
    return len(old)


def resolve(path: Path) -> Path:
    """A checkpoint directory: `path` itself, or the one an output dir's `latest` names."""
    path = Path(path)
    if (path / "meta.json").exists():
        return path
    pointer = path / "latest"
    if not pointer.exists():
        raise CheckpointError(f"{path}: no checkpoint here (no 'latest' pointer and no meta.json)")
    try:
        name = json.loads(pointer.read_text())["checkpoint"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise CheckpointError(f"{pointer}: unreadable pointer file ({e})") from None
    if not isinstance(name, str) or "/" in name or name.startswith("."):
        raise CheckpointError(f"{pointer}: invalid checkpoint name {name!r}")
    return path / name


def read_meta(ckpt: Path) -> dict:
    """meta.json of a checkpoint, with its files checked against their recorded size and hash."""
    meta_path = ckpt / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{meta_path}: missing") from None
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{meta_path}: corrupt JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: not a fuseblock checkpoint of format {FORMAT}")
    files = meta.get("files")
    if (
        not isinstance(files, dict)
        or set(files) != {"model.safetensors", "optimizer.safetensors"}
        or not all(isinstance(w, dict) and {"bytes", "sha256"} <= set(w) for w in files.values())
        or not isinstance(meta.get("step"), int)
    ):
        raise CheckpointError(f"{meta_path}: malformed (no step, or no size and sha256 for each file)")
    for f, want in files.items():
        p = ckpt / f
        if not p.exists():
            raise CheckpointError(f"{p}: missing")
        got = _digest(p)
        if got["bytes"] != want["bytes"]:
            raise CheckpointError(f"{p}: truncated or resized ({got['bytes']} bytes, expected {want['bytes']})")
        if got["sha256"] != want["sha256"]:
            raise CheckpointError(f"{p}: corrupt (sha256 mismatch)")
    return meta


def read_config(ckpt: Path, meta: dict) -> GPTConfig:
    """The GPTConfig recorded in a checkpoint's meta.json."""
    try:
        return GPTConfig.from_json(meta["config"]["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{ckpt / 'meta.json'}: bad model config ({e})") from None


def load_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """Load model.safetensors into `model` (strict: every key and shape must match)."""
    path = ckpt / "model.safetensors"
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    except RuntimeError as e:  # shape mismatch
        raise CheckpointError(f"{path}: does not fit the model ({str(e).splitlines()[-1].strip()})") from None
    if missing or unexpected:
        raise CheckpointError(f"{path}: does not fit the model (missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")


def load_training_state(ckpt: Path, meta: dict, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Restore the optimizer; return the saved RNG states by name."""
    path = ckpt / "optimizer.safetensors"
    try:
        tensors = load_file(str(path))
        optimizer.load_state_dict(_optimizer_state_dict(tensors, meta["optimizer"]))
    except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: does not fit the optimizer ({e})") from None
    return {k[len("rng."):]: v for k, v in tensors.items() if k.startswith("rng.")}
