"""A training run's settings, and the check of what a checkpoint's meta.json records of a run.

One table serves the command line and meta.json alike: each setting's default, its kind
(type and bounds) and the checks across settings. scripts/train.py builds its flags from
it; models/checkpoint.py validates every meta.json it reads with `meta_problem`, so a
setting that no flag accepts is no more accepted from a file; `resume` merges the
recorded settings with the flags given on --resume.

meta.json's fields: format, step, config {model, train, world_size}, optimizer
{param_groups, scalars}, files {name: {bytes, sha256}}, history, curve, update {largest,
step, limit, passed} (train.py's update check; absent before it), meta_sha256.
world_size is the data-parallel size, the number of distinct batch streams (a --tp N run
on N ranks records 1: its tensor-parallel ranks read one stream). This
module checks the run's record (step, config, history, curve); checkpoint.py the rest,
which is about the files and the optimizer they are loaded into.
"""
from __future__ import annotations

import argparse
import math
import re

from .gpt import GPTConfig

# The model flags' values for a fresh run; on --resume they come from the checkpoint.
MODEL_DEFAULTS = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "norm": "rms", "hc": 0, "attn_res": 0,
                  "fp8": None}

# Training settings: recorded in every checkpoint and restored by --resume. A flag given
# on --resume replaces the recorded value and the run prints the change. BOOKKEEPING
# ones only move the end and the reports; the others change the optimisation itself, so
# the resumed run is then no longer the run that was started. --seed cannot change (the
# checkpoint holds the RNG states that the seed started).
TRAIN_DEFAULTS = {
    "max_iters": 1000, "batch_size": 32, "grad_accum": 1, "lr": 2e-3, "min_lr": 2e-4, "warmup_iters": 50,
    "lr_decay_iters": None, "weight_decay": 0.1, "grad_clip": 1.0, "dropout": 0.0, "impl": "fused",
    "seed": 1337, "eval_interval": 250, "eval_iters": 25, "ckpt_interval": 250,
}
BOOKKEEPING = ("max_iters", "eval_interval", "eval_iters", "ckpt_interval")
FIXED_ON_RESUME = ("seed",)

# Sequences a rank holds for one step (--batch-size x --grad-accum): far beyond this GPT's
# runs, and a bound that stops a huge recorded batch before it reaches the allocator.
MAX_SEQUENCES = 2**20

# What each setting must be, for the command line and for a checkpoint's meta.json alike.
KINDS = {"n_layer": "count", "n_head": "count", "n_embd": "count", "block_size": "count", "norm": "norm",
         "hc": "streams", "attn_res": "nonneg_int", "fp8": "fp8",
         "max_iters": "count", "batch_size": "size", "grad_accum": "size", "lr": "positive", "min_lr": "nonneg",
         "warmup_iters": "nonneg_int", "lr_decay_iters": "count", "weight_decay": "nonneg", "grad_clip": "nonneg",
         "dropout": "probability", "impl": "impl", "seed": "seed", "eval_interval": "count", "eval_iters": "count",
         "ckpt_interval": "count"}
KIND_TEXT = {"count": "an int >= 1", "size": f"an int in [1, {MAX_SEQUENCES}]", "nonneg_int": "an int >= 0",
             "seed": "an int in [-2**63, 2**64)", "positive": "a positive number", "nonneg": "a number >= 0",
             "probability": "a number in [0, 1)", "impl": "fused or naive", "norm": "rms or layer",
             "streams": "an int in [0, 16] (0: one plain stream)", "fp8": "row"}
_CHOICES = {"impl": ("fused", "naive"), "norm": ("rms", "layer"), "fp8": ("row",)}
_INT_RANGES = {"count": (1, 2**64), "size": (1, MAX_SEQUENCES + 1), "nonneg_int": (0, 2**64),
               "streams": (0, 17),
               "seed": (-(2**63), 2**64)}  # [lo, hi)


class SettingsError(RuntimeError):
    """Flags that cannot apply to the checkpoint being resumed, or a checkpoint that --resume
    cannot continue."""


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def kind_ok(kind: str, v) -> bool:
    """Whether `v` (already an int, float or str) is a valid value of this kind."""
    if kind in _INT_RANGES:
        lo, hi = _INT_RANGES[kind]
        return is_int(v) and lo <= v < hi
    if kind in _CHOICES:
        return v in _CHOICES[kind]
    if not is_number(v) or not math.isfinite(v):
        return False
    return {"positive": v > 0, "nonneg": v >= 0, "probability": 0 <= v < 1}[kind]


def arg_type(kind: str):
    """An argparse type for one kind: parses, then checks the range."""
    def parse(s: str):
        try:
            v = int(s) if kind in _INT_RANGES else float(s)
        except ValueError:
            what = "an integer" if kind in _INT_RANGES else "a number"
            raise argparse.ArgumentTypeError(f"{s!r} is not {what}") from None
        if not kind_ok(kind, v):
            raise argparse.ArgumentTypeError(f"must be {KIND_TEXT[kind]}, got {s}")
        return v

    parse.__name__ = kind
    return parse


# What each flag means, for --help (its default is added)
HELP = {
    "n_layer": "transformer layers", "n_head": "attention heads", "n_embd": "width, divisible by --n-head",
    "block_size": "context length in bytes", "norm": "RMSNorm or LayerNorm",
    "hc": "residual streams: N >= 1 hyper-connections (mHC, Sinkhorn) on N streams, 0 the plain stream",
    "attn_res": "B >= 1: each sublayer's input an attention residual over blocks of B sublayers (Kimi's Block "
                "AttnRes), 0 the plain stream",
    "fp8": "the Linear after each block norm in fp8, rowwise recipe (fuseblock.norm_linear quant='fp8_row'); "
           "needs --impl fused, without --hc, --attn-res or --tp",
    "max_iters": "optimizer steps in all, counted from step 0", "batch_size": "sequences per micro-batch and rank",
    "grad_accum": "micro-batches per step and rank", "lr": "peak learning rate, after warmup",
    "min_lr": "the cosine's floor, at most --lr", "warmup_iters": "steps of linear warmup",
    "lr_decay_iters": "step at which the cosine reaches --min-lr",
    "weight_decay": "AdamW decay of matrices and embeddings", "grad_clip": "max gradient norm, 0 for none",
    "dropout": "dropout probability", "impl": "fused residual stream, or its naive twin (same weights)",
    "seed": "seeds weights, batches and dropout; fixed on --resume",
    "eval_interval": "steps between train/val evaluations, and at the end",
    "eval_iters": "batches per split and evaluation", "ckpt_interval": "steps between checkpoints, and at the end",
}


def add_flags(group, names) -> None:
    """A flag for each setting in `names`. Its default is None, so that --resume can tell
    the flags given from the unset ones; the help shows the fresh-run value."""
    for k in names:
        default = {"lr_decay_iters": "--max-iters of a fresh run", "fp8": "off"}.get(
            k, {**MODEL_DEFAULTS, **TRAIN_DEFAULTS}.get(k))
        kind = KINDS[k]
        parse = {"choices": _CHOICES[kind]} if kind in _CHOICES else {"type": arg_type(kind)}
        group.add_argument(f"--{k.replace('_', '-')}", default=None, help=f"{HELP[k]} (default: {default})", **parse)


def model_conflict(s, tp: int) -> str | None:
    """A conflict of the model settings with the training ones (--impl, which --resume may
    change) or with this invocation's --tp, or None; it starts with the flag to blame."""
    if s.fp8:  # only the plain fused stack has block norms fused with the Linear after them
        without = [f"--impl {s.impl}"] * (s.impl == "naive") + [f"--hc {s.hc}"] * bool(s.hc) + \
            [f"--attn-res {s.attn_res}"] * bool(s.attn_res) + [f"--tp {tp}"] * (tp > 1)
        if without:
            return (f"--fp8 {s.fp8} runs through the fused norm + Linear of the plain stack: not with "
                    f"{', '.join(without)}")
    return None


def conflict(s) -> str | None:
    """A conflict between settings that are each valid alone, or None; it starts with the
    flag to blame (train.py's usage errors name it)."""
    if s.min_lr > s.lr:
        return f"--min-lr {s.min_lr} is above --lr {s.lr}"
    if s.batch_size * s.grad_accum > MAX_SEQUENCES:
        return (f"--batch-size {s.batch_size} times --grad-accum {s.grad_accum} is above {MAX_SEQUENCES} "
                "sequences per step and rank")
    return None


# ----------------------------------------------------------------------------- meta.json


# GPTConfig fields as meta.json records them: the type each must have
_CONFIG_TYPES = {"vocab_size": is_int, "block_size": is_int, "n_layer": is_int, "n_head": is_int, "n_embd": is_int,
                 "dropout": is_number, "bias": lambda v: isinstance(v, bool), "norm": lambda v: isinstance(v, str),
                 "norm_eps": lambda v: is_number(v) and math.isfinite(v), "fused": lambda v: isinstance(v, bool),
                 "residual_dtype": lambda v: v is None or v in ("float32", "float16", "bfloat16", "float64"),
                 "hc": is_int, "attn_res": is_int, "fp8": lambda v: v is None or v in _CHOICES["fp8"]}
# fields a checkpoint written before they existed may lack (GPTConfig's default then applies)
_CONFIG_ADDED = {"hc", "attn_res", "fp8"}


def _model_problem(model) -> str | None:
    if not isinstance(model, dict):
        return f"bad model config ({model!r}, not a dict of its fields)"
    unknown, missing = set(model) - set(_CONFIG_TYPES), set(_CONFIG_TYPES) - _CONFIG_ADDED - set(model)
    if unknown or missing:
        return "bad model config (" + "; ".join(
            f"{what} field{'s' if len(names) > 1 else ''} {', '.join(sorted(names))}"
            for what, names in (("unknown", unknown), ("missing", missing)) if names) + ")"
    for k, ok in _CONFIG_TYPES.items():
        if k in model and not ok(model[k]):
            return f"bad model config ({k}={model[k]!r})"
    if model["vocab_size"] != 256:
        return f"bad model config (vocab_size {model['vocab_size']}; bytes need 256)"
    try:
        GPTConfig.from_json(model)
    except (TypeError, ValueError) as e:
        return f"bad model config ({e})"
    return None


def _train_problem(train, world) -> str | None:
    if not isinstance(train, dict) or set(train) != set(TRAIN_DEFAULTS):
        return f"bad training settings (expected the fields {sorted(TRAIN_DEFAULTS)})"
    for k, v in train.items():
        if not kind_ok(KINDS[k], v):
            return f"bad training setting {k}={v!r} (must be {KIND_TEXT[KINDS[k]]})"
    problem = conflict(argparse.Namespace(**train))
    if problem:
        return f"bad training settings ({problem})"
    if not kind_ok("count", world):
        return f"bad world_size {world!r}"
    return None


def meta_problem(meta: dict) -> str | None:
    """What is wrong with the run's record in a parsed meta.json (step, config, history,
    curve), or None. The training settings and the curve are optional (checkpoint.save
    records what it is given); `resume` requires them. Format 1 recorded the settings as
    untyped strings: only its step and model config are checked, all that sample.py reads."""
    step = meta.get("step")
    if not is_int(step) or step < 1:
        return f"malformed (step must be an int >= 1, got {step!r})"
    config = meta.get("config")
    if meta["format"] < 2:
        return _model_problem(config.get("model")) if isinstance(config, dict) else "malformed config"
    history = meta.get("history", [])
    if not isinstance(history, list) or not all(
        isinstance(h, dict) and set(h) == {"step", "train", "val"} and is_int(h["step"]) and 1 <= h["step"] <= step
        and all(is_number(h[s]) and math.isfinite(h[s]) for s in ("train", "val")) for h in history
    ) or [h["step"] for h in history] != sorted({h["step"] for h in history}):
        return "malformed history (a list of {step, train, val} with increasing steps up to the checkpoint's)"
    curve = meta.get("curve", [])
    if "curve" in meta and (not isinstance(curve, list) or len(curve) != step
                            or not all(is_number(c) and math.isfinite(c) for c in curve)):
        return f"malformed curve (a list of {step} finite numbers, one loss per step)"
    update = meta.get("update", {})
    if "update" in meta and not (
        isinstance(update, dict) and set(update) == {"largest", "step", "limit", "passed"}
        and is_number(update["largest"]) and math.isfinite(update["largest"]) and update["largest"] >= 0
        and is_int(update["step"]) and 0 <= update["step"] <= step
        and is_number(update["limit"]) and math.isfinite(update["limit"]) and update["limit"] > 0
        and update["passed"] is (update["largest"] <= update["limit"])
    ):
        return ("malformed update check (a dict of largest >= 0, its step, the limit, and passed: whether "
                "largest is within the limit)")
    if not isinstance(config, dict) or not set(config) <= {"model", "train", "world_size"}:
        return "malformed config (a dict of model, and train and world_size when recorded)"
    problem = _model_problem(config.get("model"))
    if problem is None and ("train" in config or "world_size" in config):
        problem = _train_problem(config.get("train"), config.get("world_size"))
    return problem


def resume(args, meta: dict, saved_cfg: GPTConfig, world: int, ckpt) -> tuple[list, list]:
    """Fill `args` from a checkpoint's meta.json (checked by meta_problem) and its model
    config (read_config): model flags given must agree; training flags given win. Returns
    the changes, as (name, recorded, now), to bookkeeping and to the training itself."""
    where = ckpt / "meta.json"
    if meta["format"] < 2 or "train" not in meta["config"]:
        raise SettingsError(f"{where}: format {meta['format']} was written by an older train.py that did not record "
                            "its training settings; --resume needs format 2 or later")
    if "curve" not in meta or "history" not in meta:
        raise SettingsError(f"{where}: no loss curve or history recorded; --resume needs a checkpoint of train.py")
    for k in sorted(args.explicit & set(MODEL_DEFAULTS)):
        if getattr(saved_cfg, k) != getattr(args, k):
            raise SettingsError(f"{where}: config mismatch: checkpoint has {k}={getattr(saved_cfg, k)}, "
                                f"--{k.replace('_', '-')} asks for {getattr(args, k)}")
    for k in MODEL_DEFAULTS:
        setattr(args, k, getattr(saved_cfg, k))
    saved = meta["config"]["train"]
    for k in FIXED_ON_RESUME:
        if k in args.explicit and getattr(args, k) != saved[k]:
            raise SettingsError(f"--{k.replace('_', '-')} {getattr(args, k)} cannot change on --resume: the checkpoint "
                                f"holds the random states that {k} {saved[k]} started")
    bookkeeping, training = [], []
    for k in TRAIN_DEFAULTS:
        if k in args.explicit and getattr(args, k) != saved[k]:
            (bookkeeping if k in BOOKKEEPING else training).append((k, saved[k], getattr(args, k)))
        else:
            setattr(args, k, saved[k])
    if world != meta["config"]["world_size"]:
        training.append(("world_size", meta["config"]["world_size"], world))
    problem = conflict(args)
    if problem:
        raise SettingsError(f"{problem} (on --resume, unset flags take the checkpoint's values)")
    if meta["step"] >= args.max_iters:
        raise SettingsError(f"{ckpt}: already at step {meta['step']}; pass a --max-iters above it to go on")
    return bookkeeping, training


def describe_changes(bookkeeping: list, training: list) -> list[str]:
    """The lines that tell a resumed run which recorded settings the flags replaced."""
    def fmt(changes):
        return ", ".join(f"{k} {old} -> {new}" for k, old, new in changes)

    lines = []
    if bookkeeping:
        lines.append(f"resume: flags replace the checkpoint's {fmt(bookkeeping)}")
    if training:
        lines.append(f"resume: flags change the training itself (no longer the run as started): {fmt(training)}")
    return lines


# ----------------------------------------------------------------------------- the way back


def continue_flags(args, recorded: dict | None, good: str | None, default_device: str) -> list[str]:
    """train.py's flags that continue a diverged run: from `good`, the checkpoint that passed
    the update check (whose training settings are `recorded`), with the flags this run
    changed of them; or, with none, a fresh run's every setting that is not the default,
    with --overwrite. The learning rate: the checkpoint's own where the run had raised it,
    else a tenth of the run's (at most the default)."""
    if recorded is not None:  # what this run changed of the checkpoint's settings
        flags = {k: getattr(args, k) for k in TRAIN_DEFAULTS if getattr(args, k) != recorded[k]}
        base = recorded
    else:  # a fresh run's every setting that is not the default
        flags = {k: getattr(args, k) for k in MODEL_DEFAULTS if getattr(args, k) != MODEL_DEFAULTS[k]}
        flags.update({k: getattr(args, k) for k in TRAIN_DEFAULTS if getattr(args, k) != TRAIN_DEFAULTS[k]})
        if args.lr_decay_iters == args.max_iters:
            flags.pop("lr_decay_iters", None)  # what a fresh run sets it to
        base = TRAIN_DEFAULTS
    lr = base["lr"] if recorded is not None and args.lr > base["lr"] else min(args.lr / 10, TRAIN_DEFAULTS["lr"])
    flags.pop("lr", None)
    if lr != base["lr"]:
        flags["lr"] = lr
    if flags.get("min_lr", base["min_lr"]) > lr:
        flags.pop("min_lr", None)
        if base["min_lr"] > lr:
            flags["min_lr"] = lr / 10
    # by name, unless `latest` holds the second name of an interrupted replacement, which --resume cannot name
    point = ["--resume", good] if good and re.fullmatch(r"ckpt-\d+", good) else ["--resume"]
    head = ["--out-dir", str(args.out_dir), *(point if good else ["--overwrite"])]
    for k, v in flags.items():
        head += [f"--{k.replace('_', '-')}", str(v)]
    head += ["--fsdp"] * args.fsdp + (["--tp", str(args.tp)] if args.tp > 1 else []) + ["--compile"] * args.compile
    head += (["--threads", str(args.threads)] if args.threads else []) + ["--no-progress"] * args.no_progress
    if args.device != default_device:
        head += ["--device", args.device]
    return head
