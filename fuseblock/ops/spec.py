"""Argument checking and the resolved description of one normalize call.

Every public entry point validates here, before any kernel runs, so bad input gets a
ValueError/TypeError that names the argument instead of a crash inside Triton.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch

KINDS = ("rms", "layer", "l2")
GATE_ACTS = {"none": 1, "sigmoid": 2, "silu": 3, "swish": 3}  # 0 means "no gate"
GATE_POSITIONS = {"pre": 1, "post": 2}  # 0 means "no gate"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DEFAULT_GATE_ACT = "silu"
DEFAULT_GATE_POSITION = "post"


@dataclass(frozen=True)
class NormSpec:
    """What the kernels need to know, resolved from the user's keywords.

    `scale` is c / sqrt(group size): the seeds' numerically safer form
    o = (c/sqrt(d)) * q/sigma * w + b with sigma = sqrt(q.q/d + eps).
    """

    center: bool  # subtract the mean (LayerNorm) or not (RMS, L2)
    scale: float
    eps: float
    gate_mode: int  # 0 none, 1 pre-gate f(p * g(y)), 2 post-gate f(p) * g(y)
    act: int  # 0 none, 1 identity, 2 sigmoid, 3 silu
    groups: int


def check_tensor(name: str, t, x: Optional[torch.Tensor] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {t.dtype}")
    if x is not None and t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}; all tensors must share one device")


def check_number(name: str, v, *, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")


def check_options(d: int, *, kind, c, eps, num_groups, gate_act, gate_position) -> None:
    """Checks of the non-tensor options, shared by the functions and the modules."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    check_number("c", c, allow_none=True)
    check_number("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, numbers.Integral):
        raise TypeError(f"num_groups must be an int, got {type(num_groups).__name__}")
    if num_groups < 1 or d % num_groups != 0:
        raise ValueError(f"num_groups must be >= 1 and divide the last dim {d}, got {num_groups}")
    if not isinstance(gate_act, str) or gate_act not in GATE_ACTS:
        raise ValueError(f"gate_act must be one of {sorted(GATE_ACTS)}, got {gate_act!r}")
    if not isinstance(gate_position, str) or gate_position not in GATE_POSITIONS:
        raise ValueError(f"gate_position must be one of {sorted(GATE_POSITIONS)}, got {gate_position!r}")


def resolve(
    x,
    residual,
    weight,
    bias,
    gate,
    *,
    kind: str,
    c,
    eps,
    gate_act: str,
    gate_position: str,
    num_groups,
    residual_dtype,
) -> NormSpec:
    """Validate every argument of norm/add_norm and return the kernel-level spec."""
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalized last dim)")
    d = x.shape[-1]
    if d < 1:
        raise ValueError("x's last dimension must be >= 1")
    check_options(d, kind=kind, c=c, eps=eps, num_groups=num_groups, gate_act=gate_act, gate_position=gate_position)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(name, t, x)
            if tuple(t.shape) != (d,):
                raise ValueError(f"{name} must have shape ({d},), got {tuple(t.shape)}")
    for name, t in (("residual", residual), ("gate", gate)):
        if t is not None:
            check_tensor(name, t, x)
            if t.shape != x.shape:
                raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(t.shape)}")
    if residual_dtype is not None:
        if not isinstance(residual_dtype, torch.dtype):
            raise TypeError(f"residual_dtype must be a torch.dtype or None, got {type(residual_dtype).__name__}")
        if residual_dtype not in FLOAT_DTYPES:
            raise TypeError(f"residual_dtype must be a floating dtype, got {residual_dtype}")
    if gate is None and (gate_act != DEFAULT_GATE_ACT or gate_position != DEFAULT_GATE_POSITION):
        raise ValueError("gate_act and gate_position only apply when a gate tensor is given (gate is None)")

    group = d // num_groups
    if c is None:
        c = 1.0 if kind == "l2" else math.sqrt(group)
    return NormSpec(
        center=kind == "layer",
        scale=float(c) / math.sqrt(group),
        eps=float(eps),
        gate_mode=0 if gate is None else GATE_POSITIONS[gate_position],
        act=0 if gate is None else GATE_ACTS[gate_act],
        groups=int(num_groups),
    )
