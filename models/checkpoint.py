"""Checkpoints as safetensors + JSON, written atomically; loading never unpickles anything.

Layout of an output directory:

    latest                  JSON {"checkpoint": "ckpt-000100"}: the newest complete checkpoint
    ckpt-000100/
        model.safetensors       weights (shared tensors such as the tied head stored once)
        optimizer.safetensors   optimizer state tensors and RNG states
        meta.json               config, step, optimizer hyperparameters, loss history, the
                                size and sha256 of both safetensors files, and its own
                                sha256 (meta_sha256, over its other fields)

A checkpoint is written into a temporary directory, every file fsynced, then renamed
into place, and only then does `latest` (itself written to a temp file, fsynced and
renamed) move to it. A crash or a full disk at any moment leaves the previous checkpoint
and pointer intact; an earlier run's checkpoints are removed only after that. A write
that fails for space frees the oldest checkpoint but the one `latest` names and tries
once more. Weights or optimizer state holding NaN or inf are not written at all: the
loader would refuse them. A checkpoint the caller marks as not passed (train.py's update
check, models/update_check.py) is written as a suspect: `latest` stays where it is, and
neither pruning nor freeing space ever removes the checkpoint `latest` names.

Everything loaded is checked before use: meta.json against its own sha256, the files
against their recorded size and sha256, meta.json's fields by type and range
(models/settings.py), every tensor's name, dtype and shape against the model and
optimizer it is loaded into, and the RNG states by loading them into a generator.

A model sharded by FSDP2, by tensor parallelism (models/tensor_parallel.py) or by both
(DTensor parameters) is gathered whole to write, in the files a plain model makes; to
load, each rank checks the whole tensors and keeps its part, as its placements say. So
every layout and a single process resume each other's checkpoints.
"""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file, save_model

from . import sharded
from .atomic import fsync_dir, fsync_file, write_json
from .gpt import GPTConfig
from .settings import is_int, is_number, meta_problem

# 2: meta.json records the training settings (typed), so --resume can restore them;
# 3: and its own sha256, so that an edit of a field no other check can judge (n_head) is seen
FORMAT = 3
READABLE = (1, 2, 3)  # sample.py reads format 1 too: its weights and model config are unchanged
KEEP = 2  # complete checkpoints kept on disk; older ones are pruned
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # what freeing a checkpoint can cure (a file-size limit it cannot)
_NAME = re.compile(r"ckpt-\d+")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated, corrupt or does not fit; names the file."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (full disk, file too large, permissions);
    `reason` is the system's words. `latest` and what it names are as they were. `placed`:
    the checkpoint directory, complete, when only the move of `latest` to it failed, else
    None; `freed`: the older checkpoints removed to make room before the second try."""

    def __init__(self, reason: str, placed: Path | None = None, freed: tuple[str, ...] = ()):
        super().__init__(reason)
        self.reason, self.placed, self.freed = reason, placed, freed


class NonFiniteError(ValueError):
    """Weights or optimizer state holding NaN or inf, which save() does not write."""


# ----------------------------------------------------------------------------- writing


def _digest(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _write_failure(e: BaseException) -> tuple[str, int | None]:
    """The system's words and errno for a failed write. The safetensors writer raises
    SafetensorError ("Error while serializing: I/O error: File too large (os error 27)"),
    not OSError."""
    if isinstance(e, OSError):
        return e.strerror or str(e), e.errno
    m = re.search(r"I/O error: (.*?) \(os error (\d+)\)", str(e))
    return (m.group(1), int(m.group(2))) if m else (str(e), None)


def _optimizer_tensors(sd: dict) -> tuple[dict, dict]:
    """Split an optimizer state_dict into safetensors tensors and JSON-able rest."""
    tensors, scalars = {}, {}
    for i, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"state.{i}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{i}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _remove(path: Path) -> None:
    """Remove a checkpoint entry: a symlink only as a link (what it points to is not ours)."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path)


def _one_name_each(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict | None]:
    """Gathered tensors as safetensors' save_model stores a plain model's: a tensor held
    under several names (the tied head) under the first of them in sorted order, with the
    metadata {dropped name: kept name}."""
    names: dict[int, list[str]] = {}
    for k, t in tensors.items():
        names.setdefault(id(t), []).append(k)
    kept, metadata = {}, {}
    for group in names.values():
        keep, *dropped = sorted(group)
        kept[keep] = tensors[keep].contiguous()
        metadata.update(dict.fromkeys(dropped, keep))
    return kept, metadata or None


def _gather(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict] | None:
    """A sharded (FSDP2, tensor-parallel) model's state_dict and its optimizer's, whole and on the CPU, laid
    out as a plain model's: the tied names share one tensor, and the optimizer state is
    keyed by parameter index (torch's Optimizer.state_dict). Each distinct tensor is one
    all-gather, which every rank joins in the same order; rank 0 keeps the results, the
    others get None."""
    rank0 = torch.distributed.get_rank() == 0
    whole: dict[int, torch.Tensor | None] = {}

    def get(t: torch.Tensor) -> torch.Tensor | None:
        if id(t) not in whole:  # the tied head is wte's parameter: gathered once
            whole[id(t)] = sharded.gather(t, keep=rank0)
        return whole[id(t)]

    tensors = {k: get(t) for k, t in model.state_dict(keep_vars=True).items()}
    sd = optimizer.state_dict()
    state = {i: {k: get(v) if torch.is_tensor(v) else v for k, v in st.items()} for i, st in sd["state"].items()}
    return (tensors, dict(sd, state=state)) if rank0 else None


def _write_dir(tmp: Path, step: int, model, optimizer, config: dict, rng: dict, extra: dict | None,
               whole: tuple[dict, dict] | None) -> None:
    """The complete checkpoint in `tmp`, every file fsynced; `whole`: a sharded model's
    gathered state (_gather), written in the layout of a plain model's."""
    tmp.mkdir()
    if whole is None:
        save_model(model, str(tmp / "model.safetensors"))
        optimizer_state = optimizer.state_dict()
    else:
        model_tensors, optimizer_state = whole
        tensors, metadata = _one_name_each(model_tensors)
        save_file(tensors, str(tmp / "model.safetensors"), metadata=metadata)
    opt_tensors, opt_meta = _optimizer_tensors(optimizer_state)
    tensors = dict(opt_tensors, **{f"rng.{k}": v.cpu().contiguous() for k, v in rng.items()})
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    files = {}
    for f in ("model.safetensors", "optimizer.safetensors"):
        fsync_file(tmp / f)
        files[f] = _digest(tmp / f)
    meta = {"format": FORMAT, "step": step, "config": config, "optimizer": opt_meta, "files": files, **(extra or {})}
    write_json(tmp / "meta.json", dict(meta, meta_sha256=meta_digest(meta)), indent=1)


def meta_digest(meta: dict) -> str:
    """sha256 of meta.json's fields but meta_sha256 itself, in a canonical JSON form."""
    rest = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _all_finite(model, optimizer, whole: tuple[dict, dict] | None) -> bool:
    """Whether every floating tensor to be written is finite: one sync per device (AdamW
    keeps its step counts on the CPU beside moments on the GPU)."""
    tensors, optimizer_state = whole or (model.state_dict(), optimizer.state_dict())
    floats = [t.detach() for t in tensors.values() if t.is_floating_point()]
    floats += [v.detach() for st in optimizer_state["state"].values() for v in st.values()
               if torch.is_tensor(v) and v.is_floating_point()]
    by_device: dict[torch.device, list] = {}
    for t in floats:
        by_device.setdefault(t.device, []).append(torch.isfinite(t).all())
    return all(bool(torch.stack(flags).all()) for flags in by_device.values())


def pointer_target(out_dir: Path) -> str | None:
    """The name `latest` holds, or None when there is none (or it cannot be read)."""
    try:
        name = json.loads((out_dir / "latest").read_text())["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) else None


def _second_name(src: Path, alias: Path) -> None:
    """`alias` holds the same checkpoint as `src` without copying its data: hard links
    (a copy where the filesystem has none), or a second symlink for a symlinked one."""
    def link_or_copy(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    _remove(alias)
    if src.is_symlink():
        os.symlink(os.readlink(src), alias)
    else:
        shutil.copytree(src, alias, copy_function=link_or_copy)
        fsync_dir(alias)
    fsync_dir(alias.parent)


def _put_in_place(out_dir: Path, tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` to `final`. A directory already named `final` is an
    earlier run's, or one a killed writer never pointed `latest` at. When `latest` names
    it (a fresh run reaching the step an earlier run ended on), `latest` first moves to a
    second name of it, so that at every moment `latest` names a complete checkpoint."""
    if final.exists() or final.is_symlink():
        if pointer_target(out_dir) == final.name:
            alias = final.with_name(final.name + ".old")
            _second_name(final, alias)
            write_json(out_dir / "latest", {"checkpoint": alias.name}, indent=1)
        _remove(final)
    os.replace(tmp, final)
    fsync_dir(out_dir)


def save(
    out_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: dict,
    rng: dict[str, torch.Tensor],
    extra: dict | None = None,
    supersedes: tuple[str, ...] = (),
    passed: bool = True,
) -> Path | None:
    """Write checkpoint `ckpt-{step}` atomically, then point `latest` at it; only then
    remove the checkpoints named in `supersedes` (an earlier run's) and prune old ones.
    A write that fails for space frees the oldest checkpoint but the one `latest` names
    and tries once more (a disk that holds KEEP checkpoints but not one more keeps
    going). Any failure to write raises CheckpointWriteError and leaves `latest` and
    what it names as they were; NaN or inf anywhere in the state raises NonFiniteError
    and writes nothing. The caller holds the directory's lock (one writer at a time).

    A sharded model (FSDP2, tensor-parallel) is gathered whole first and written as a plain one is, so
    one process loads it: every rank calls save then (the gathers are collectives), rank
    0 writes, and the others return None.

    passed=False writes a suspect: the directory only, `latest` and the earlier run's
    checkpoints (`supersedes`) stay. A suspect never replaces the checkpoint `latest`
    names: when it would have that name, nothing is written and save returns None."""
    whole = None
    if any(sharded.is_shard(p) for p in model.parameters()):
        whole = _gather(model, optimizer)
        if whole is None:
            return None
    if not _all_finite(model, optimizer, whole):
        raise NonFiniteError(f"step {step}: the weights or the optimizer state hold NaN or inf")
    out_dir = Path(out_dir)
    name = f"ckpt-{step:06d}"
    if not passed and pointer_target(out_dir) == name:
        return None
    final = out_dir / name
    tmp = out_dir / f".{name}.tmp{os.getpid()}"
    placed, freed = False, ()
    try:
        while True:
            try:
                if not placed:
                    _remove(tmp)
                    _write_dir(tmp, step, model, optimizer, config, rng, extra, whole)
                    _put_in_place(out_dir, tmp, final)
                    placed = True
                if passed:
                    write_json(out_dir / "latest", {"checkpoint": name}, indent=1)
                break
            except (OSError, SafetensorError) as e:
                reason, code = _write_failure(e)
                shutil.rmtree(tmp, ignore_errors=True)
                if code in _NO_SPACE and not freed:
                    freed = _free_oldest(out_dir, keep=name)
                    if freed:
                        continue
                raise CheckpointWriteError(reason, final if placed else None, freed) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in supersedes if passed else ():
        if old != name:
            _remove(out_dir / old)
    _prune(out_dir, keep=name)
    return final


def _checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoint directories, oldest step first (by number: ckpt-1000000 > ckpt-999999)."""
    found = [p for p in Path(out_dir).glob("ckpt-*") if p.is_dir() and _NAME.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def kept(out_dir: Path) -> list[tuple[str, bool | None]]:
    """The complete checkpoints in `out_dir`, oldest first, each with whether it passed the
    update check as its meta.json records (True for one written before the check; None
    when meta.json cannot be read: the loader says why)."""
    out = []
    for p in _checkpoints(out_dir):
        try:
            meta = json.loads((p / "meta.json").read_text())
            passed = meta.get("update", {"passed": True}).get("passed")
            out.append((p.name, passed if isinstance(passed, bool) else None))
        except (OSError, ValueError, AttributeError):
            out.append((p.name, None))
    return out


def checkpoint_names(out_dir: Path) -> tuple[str, ...]:
    """The checkpoints in `out_dir` (symlinked ones included), and second names left by an
    interrupted replacement: what a fresh run supersedes once its first checkpoint is safe."""
    old = [p.name for p in Path(out_dir).glob("ckpt-*.old")]
    return tuple(p.name for p in _checkpoints(out_dir)) + tuple(old)


def _step_of(name: str) -> int:
    return int(name[5:].removesuffix(".old"))


def _free_oldest(out_dir: Path, keep: str) -> tuple[str, ...]:
    """Remove the oldest checkpoint but `keep` and the one `latest` names, to make room;
    its name, or () when there is none to remove (or it could not be removed)."""
    spare = sorted(set(checkpoint_names(out_dir)) - {keep, pointer_target(out_dir)}, key=_step_of)
    if not spare:
        return ()
    try:
        _remove(out_dir / spare[0])
    except OSError:
        return ()
    return (spare[0],)


def _prune(out_dir: Path, keep: str) -> None:
    """Drop all but the newest KEEP checkpoints, second names, and temp files a killed
    writer left behind (one writer per output directory: its lock says so); never `keep`
    nor the checkpoint `latest` names, the last that passed, however many suspects follow it."""
    spared = {keep, pointer_target(out_dir)}
    for p in _checkpoints(out_dir)[:-KEEP]:
        if p.name not in spared:
            _remove(p)
    for p in [*out_dir.glob("ckpt-*.old"), *out_dir.glob(".*.tmp*")]:
        if p.name in spared:
            continue
        try:
            _remove(p)
        except OSError:
            pass  # a leftover we could not remove costs space, not correctness


# ----------------------------------------------------------------------------- reading


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
    if not isinstance(name, str) or "/" in name or name.startswith(".") or not name:
        raise CheckpointError(f"{pointer}: invalid checkpoint name {name!r}")
    return path / name


# "update": train.py's update check (models/update_check.py); checkpoints written before it
# have none and count as passed
_FIELDS = {"format", "step", "config", "optimizer", "files", "history", "curve", "update", "meta_sha256"}


def _integrity_problem(meta: dict) -> str | None:
    """What is wrong with meta.json's own checksum and its record of the files, or None."""
    if set(meta) - _FIELDS:
        return f"malformed (unknown fields {sorted(set(meta) - _FIELDS)})"
    if meta["format"] >= 3 or "meta_sha256" in meta:  # older formats recorded none
        if meta.get("meta_sha256") != meta_digest(meta):
            return "corrupt or edited (sha256 mismatch)"
    files = meta.get("files")
    if not (isinstance(files, dict) and set(files) == {"model.safetensors", "optimizer.safetensors"}
            and all(isinstance(w, dict) and is_int(w.get("bytes")) and w["bytes"] >= 0
                    and isinstance(w.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", w["sha256"])
                    for w in files.values())):
        return "malformed (no size and sha256 for each file)"
    if not isinstance(meta.get("optimizer"), dict):
        return "malformed (no optimizer section)"
    return None


def read_meta(ckpt: Path) -> dict:
    """meta.json of a checkpoint, checked against its own sha256 and its fields by type and
    range, and its files checked against their recorded size and hash."""
    meta_path = ckpt / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{meta_path}: missing") from None
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{meta_path}: corrupt JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") not in READABLE:
        raise CheckpointError(f"{meta_path}: not a fuseblock checkpoint of format {' or '.join(map(str, READABLE))}")
    problem = _integrity_problem(meta) or meta_problem(meta)
    if problem:
        raise CheckpointError(f"{meta_path}: {problem}")
    for f, want in meta["files"].items():
        p = ckpt / f
        if not p.is_file():
            raise CheckpointError(f"{p}: {'not a file' if p.exists() else 'missing'}")
        try:
            got = _digest(p)
        except OSError as e:
            raise CheckpointError(f"{p}: unreadable ({e.strerror or e})") from None
        if got["bytes"] != want["bytes"]:
            raise CheckpointError(f"{p}: truncated or resized ({got['bytes']} bytes, expected {want['bytes']})")
        if got["sha256"] != want["sha256"]:
            raise CheckpointError(f"{p}: corrupt (sha256 mismatch)")
    return meta


def _header(path: Path) -> dict[str, tuple]:
    """name -> shape of every tensor in a safetensors file, from its header alone."""
    try:
        with safe_open(str(path), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (a safe_open handle is not a dict)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None


def read_config(ckpt: Path, meta: dict) -> GPTConfig:
    """The GPTConfig recorded in a checkpoint's meta.json (read_meta checked its fields),
    checked against the weights' header, so that a wrong size fails here, before a model
    of that size is built."""
    cfg = GPTConfig.from_json(meta["config"]["model"])
    weights = ckpt / "model.safetensors"
    shapes = _header(weights)
    layers = {int(k.split(".")[2]) for k in shapes if re.match(r"stack\.blocks\.\d+\.", k)}
    found = {"wpe.weight": shapes.get("wpe.weight"), "blocks": len(layers)}
    want = {"wpe.weight": (cfg.block_size, cfg.n_embd), "blocks": 2 * cfg.n_layer}
    if found != want:
        raise CheckpointError(f"{weights}: does not fit the model config in meta.json "
                              f"(file: {found}; config: {want})")
    return cfg


def _tied(model: torch.nn.Module) -> dict[str, set]:
    """state_dict name -> the other names of the same tensor (the tied LM head): a
    safetensors file stores each shared tensor under one of its names only."""
    groups: dict[int, set] = {}
    # the objects themselves (keep_vars): a tied parameter is one object under two names,
    # and a DTensor shard has no data pointer to compare
    for k, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), set()).add(k)
    return {k: g - {k} for g in groups.values() for k in g}


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"


def _check_tensor(path: Path, key: str, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape:
        raise CheckpointError(
            f"{path}: does not fit the {what} ({key} is {_describe(got)}, expected {_describe(want)})")


def load_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """Load model.safetensors into `model`: every name, dtype and shape must match (no
    silent casts), and every value must be finite (a diverged run is refused here rather
    than sampling NaN)."""
    path = ckpt / "model.safetensors"
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    expected, tied = model.state_dict(), _tied(model)
    unexpected = sorted(set(tensors) - set(expected))
    missing = sorted(k for k in expected if k not in tensors and not tied[k] & set(tensors))
    if missing or unexpected:
        raise CheckpointError(f"{path}: does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    for k, t in tensors.items():
        _check_tensor(path, k, t, expected[k], "model")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(f"{path}: {k} holds NaN or inf: the run this came from diverged")
    # tied names share the tensor just loaded; a sharded model takes each rank's part
    model.load_state_dict({k: sharded.shard_like(t, expected[k]) for k, t in tensors.items()}, strict=False)


def _expected_optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """name -> a tensor of the dtype and shape the AdamW state of each parameter must have."""
    out = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        out[f"state.{i}.step"] = torch.zeros((), dtype=torch.float32)
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if optimizer.defaults.get("amsgrad") else ())
        for k in keys:
            out[f"state.{i}.{k}"] = p.detach()
    return out


def _param_groups_problem(saved, fresh: list[dict]) -> str | None:
    """How saved param_groups differ in shape or type from the optimizer's own, or None."""
    if not isinstance(saved, list) or len(saved) != len(fresh):
        return f"{len(fresh)} param groups expected"
    for i, (s, f) in enumerate(zip(saved, fresh, strict=True)):
        if not isinstance(s, dict) or set(s) != set(f):
            return f"param group {i} has fields {sorted(s) if isinstance(s, dict) else s!r}, expected {sorted(f)}"
        for k, want in f.items():
            got = s[k]
            if k == "params":
                ok = got == want
            elif isinstance(want, bool) or want is None:
                ok = type(got) is type(want)
            elif isinstance(want, (tuple, list)):
                ok = isinstance(got, list) and len(got) == len(want) and all(is_number(x) and 0 <= x < 1 for x in got)
            elif is_number(want):
                ok = is_number(got) and math.isfinite(got) and (got > 0 if k == "eps" else got >= 0)
            else:
                ok = type(got) is type(want)
            if not ok:
                return f"param group {i}: bad {k} {got!r}"
    return None


def load_training_state(ckpt: Path, meta: dict, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Restore the optimizer, every state tensor checked by name, dtype and shape against
    its parameters and its step count against the checkpoint's; return the saved RNG
    states by name (checked against the shape and dtype of torch's)."""
    path = ckpt / "optimizer.safetensors"
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    rng_like = torch.get_rng_state()
    expected = dict(_expected_optimizer_tensors(optimizer), **{"rng.batches": rng_like, "rng.torch0": rng_like})
    if set(tensors) != set(expected):
        missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        raise CheckpointError(
            f"{path}: does not fit the optimizer (missing {missing[:3]}, unexpected {unexpected[:3]})")
    for k, t in tensors.items():
        _check_tensor(path, k, t, expected[k], "optimizer")
        if k.startswith("rng."):
            try:  # a generator checks its state in full (the mt19937 words and their position)
                torch.Generator().set_state(t)
            except RuntimeError:
                raise CheckpointError(f"{path}: {k} is not a random generator state") from None
        if k.endswith(".step") and t.item() != meta["step"]:
            raise CheckpointError(
                f"{path}: does not fit the optimizer ({k} is {t.item()}, the checkpoint's step {meta['step']})")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(f"{path}: {k} holds NaN or inf: the run this came from diverged")
    opt_meta = meta["optimizer"]
    problem = _param_groups_problem(opt_meta.get("param_groups"), optimizer.state_dict()["param_groups"])
    if problem or opt_meta.get("scalars") != {}:
        raise CheckpointError(
            f"{ckpt / 'meta.json'}: optimizer section does not fit the optimizer ({problem or 'scalars'})")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for key, v in tensors.items():
        if key.startswith("state."):
            _, i, k = key.split(".", 2)
            # a moment of a sharded parameter: each rank takes its part; the step stays whole
            state.setdefault(int(i), {})[k] = v if k == "step" else sharded.shard_like(v, params[int(i)])
    optimizer.load_state_dict({"state": state, "param_groups": opt_meta["param_groups"]})
    return {k[len("rng."):]: v for k, v in tensors.items() if k.startswith("rng.")}


# ----------------------------------------------------------------------------- which checkpoint --resume takes


def latest_step(out_dir: Path) -> int:
    """The step of the checkpoint `latest` names, 0 for none."""
    name = pointer_target(out_dir)
    try:
        return int(name[5:].removesuffix(".old")) if name and name.startswith("ckpt-") else 0
    except ValueError:
        return 0


def resume_point(out: Path, resume: str, resume_step: int | None) -> Path:
    """The checkpoint to resume: the one `latest` names (plain --resume), or a kept one
    named by --resume (a name in --out-dir, or a path to it) or --resume-step. A name that
    is no kept checkpoint is a one-line error that lists the kept ones."""
    named = None if resume == "latest" else Path(resume)
    if named is not None and len(named.parts) > 1 and named.resolve() == out.resolve():
        named = None  # the output directory itself: its latest
    if named is None and resume_step is None:
        return resolve(out)
    flag = f"--resume {resume}" if named is not None else f"--resume-step {resume_step}"
    listed = kept(out)

    def refuse(problem: str):
        marks = {False: " (suspect)", None: " (unreadable)", True: ""}
        listing = ", ".join(name + marks[ok] for name, ok in listed) or "none"
        raise CheckpointError(f"argument {flag}: {problem}; the checkpoints kept in {out}: {listing}")

    names = {name for name, _ in listed}
    name = None
    if named is not None:
        if len(named.parts) > 1 and named.parent.resolve() != out.resolve():
            refuse(f"{named} is not in --out-dir {out} (a run resumes in its own directory)")
        name = named.name
        if name not in names:
            refuse(f"no checkpoint {name} in {out}")
    if resume_step is not None:
        by_step = f"ckpt-{resume_step:06d}"
        if name is not None and name != by_step:
            refuse(f"--resume-step {resume_step} names {by_step}, another checkpoint")
        if by_step not in names:
            refuse(f"no checkpoint of step {resume_step} in {out}")
        name = by_step
    return out / name


def resume_notes(out: Path, ckpt: Path, meta: dict) -> list[str]:
    """What a resumed run says of its checkpoint when it is not the one `latest` names."""
    latest = pointer_target(out)
    if ckpt.name == latest:
        return []
    notes = [f"resume: from {ckpt.name}; latest names {latest or 'none'}"]
    update = meta.get("update")
    if update and not update["passed"]:
        notes.append(f"note: {ckpt.name} did not pass the update check (step {update['step']} moved the weights by "
                     f"{update['largest']:.3g} times their size, limit {update['limit']:g}); resuming from it as asked")
    return notes
