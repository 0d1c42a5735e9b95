"""Argument checks, and the spec of a validated normalize call.

Every public entry point validates here, before any kernel runs, so bad input gets a
ValueError/TypeError that names the argument instead of a crash inside Triton. Each
kind of check exists once: the family ops and the modules call these too. One call
skips them: a plain add_norm on the CPU torch path (`fuseblock.ops.norm._plain_call`),
which checks only what torch's ops would let through and sends anything they refuse
back here, so its errors name the argument too.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import fields, replace

import torch

from ..spec import (
    DEFAULT_GATE_ACT,
    DEFAULT_GATE_POSITION,
    FLOAT_DTYPES,
    GATE_ACTS,
    GATE_POSITIONS,
    KINDS,
    MX_BLOCK,
    QUANT_DTYPES,
    QUANTS,
    RECIPES,
    Fp8Recipe,
    NormSpec,
    Quant,
    acc_dtype,
    stored_dtype,
)

# The recipe's options past its mode: each op's keywords before they became one Fp8Recipe (quant=)
RECIPE_FIELDS = tuple(f.name for f in fields(Fp8Recipe))[1:]


def recipe_of(quant) -> Fp8Recipe | None:
    """The call's quant= as a recipe: None, a mode's name (its recipe with the defaults) or
    an Fp8Recipe (validated when it was made)."""
    if quant is None or isinstance(quant, Fp8Recipe):
        return quant
    try:
        return RECIPES[quant]
    except (KeyError, TypeError):  # TypeError: unhashable
        raise ValueError(f"quant must be None, one of {sorted(RECIPES)} or a fuseblock.Fp8Recipe, "
                         f"got {quant!r}") from None


def linear_recipe(quant) -> Fp8Recipe | None:
    """norm_linear's and NormLinear's quant=: None, or a recipe of mode fp8_row or mxfp8
    (the Linear's product) without quant_from or mx_columnwise, which the Linear does not
    read (its two operands are cast from fp32)."""
    recipe = recipe_of(quant)
    if recipe is None:
        return None
    if recipe.mode not in ("fp8_row", "mxfp8"):
        raise ValueError(f"norm_linear takes quant=None, 'fp8_row' (the rowwise recipe) or 'mxfp8', got {quant!r}")
    if recipe.quant_from is not None or recipe.mx_columnwise:
        raise ValueError(f"norm_linear's recipe takes no quant_from and no mx_columnwise (its operands are cast from "
                         f"fp32, in one layout), got {recipe!r}")
    return recipe


def refuse_keywords(call: str, given: dict) -> None:
    """An op's keywords it does not take (its `**removed`): a former fp8 keyword named with
    the recipe that holds it now, anything else as Python names it."""
    for name in given:
        if name in RECIPE_FIELDS:
            raise TypeError(f"{call}() takes no {name}= any more: the fp8 options are one recipe, "
                            f"quant=fuseblock.Fp8Recipe(mode, {name}=...)")
    raise TypeError(f"{call}() got an unexpected keyword argument {next(iter(given))!r}")


def check_tensor(name: str, t, x: torch.Tensor | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided or t.is_nested:  # sparse, jagged: no op here reads those
        form = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise TypeError(f"{name} must be a dense (strided) tensor, got {form}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {t.dtype}")
    if x is not None and t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}; all tensors must share one device")


def refuse_positional(call: str, takes: str, given: int, hint: str = "") -> None:
    """A call of an op with a gate given more positional arguments than `takes`: Python's
    own error would only count them, where the mistake is (flash-attention's habit
    `norm(x, residual)`) a tensor meant for a gate or a residual."""
    raise TypeError(f"{call}() takes {takes} positionally, got {given} positional arguments: gate is keyword-only "
                    f"(gate=...), as is every option{hint}")


def check_number(name: str, v, *, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")


# F.layer_norm's and nn.LayerNorm's default eps
LAYER_NORM_EPS = 1e-5


def default_eps(dtype: torch.dtype, kind: str = "rms") -> float:
    """eps=None: torch's default for normalizing a tensor of dtype. For kind="layer" that
    of F.layer_norm and nn.LayerNorm, 1e-5; for "rms" (and "l2") that of F.rms_norm and
    nn.RMSNorm, the machine epsilon of the computation dtype: fp32's for fp16, bf16 and
    fp32, fp64's for fp64. The one place eps=None is resolved."""
    return LAYER_NORM_EPS if kind == "layer" else torch.finfo(acc_dtype(dtype)).eps


def check_eps(eps) -> None:
    check_number("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def check_int(name: str, v, *, minimum: int = 1) -> None:
    """An int (not a bool) >= minimum."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")


def check_float_dtype(name: str, dtype, *, allow_none: bool = True) -> None:
    """A floating torch.dtype (or None where that means a default)."""
    if dtype is None and allow_none:
        return
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be {'None or ' if allow_none else ''}a floating torch.dtype {FLOAT_DTYPES}, "
                        f"got {dtype!r}")


def check_flag(name: str, flag) -> None:
    """A module switch such as affine=: a bool, never a truthy string or a tensor."""
    if not isinstance(flag, bool):
        raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")


def check_last_dim(x, dim: int) -> None:
    """x's last dim against a module's: named so, rather than blaming weight's shape."""
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[-1] != dim:
        raise ValueError(f"x's last dim {x.shape[-1]} does not match the module's dim {dim}")


def check_weight_offset(weight_offset, has_weight: bool) -> None:
    """A finite number, and only with a weight to add it to: out = N(p) * (weight_offset + weight)."""
    check_number("weight_offset", weight_offset)
    if weight_offset != 0 and not has_weight:
        raise ValueError(f"weight_offset={weight_offset} needs a weight: it is added to the weight (weight is None)")


def check_options(d: int, *, kind, c, eps, num_groups, gate_act, gate_position) -> None:
    """Checks of the non-tensor options, shared by the functions and the modules."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    check_number("c", c, allow_none=True)
    check_eps(eps)
    check_int("num_groups", num_groups)
    if d % num_groups != 0:
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
    weight_offset=0.0,
    out_dtype=None,
    quant=None,
    scale=None,
) -> NormSpec:
    """Validate every argument of norm/add_norm and return the kernel-level spec.
    eps=None is torch's default (default_eps) for the kind and the normalized p = x + residual,
    in the dtype it is stored in: what F.rms_norm(x + residual) or F.layer_norm would use.
    out_dtype (the output's dtype) and quant (None, a mode's name or an Fp8Recipe; scale:
    fp8_tensor's static scale) are part of the spec too."""
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalized last dim)")
    d = x.shape[-1]
    if d < 1:
        raise ValueError("x's last dimension must be >= 1")
    if eps is None:  # the checks below name a bad residual or residual_dtype: leave them out here
        rin = residual.dtype if isinstance(residual, torch.Tensor) and residual.dtype in FLOAT_DTYPES else None
        eps = default_eps(stored_dtype(x.dtype, rin, residual_dtype if residual_dtype in FLOAT_DTYPES else None), kind)
    spec = _option_spec(d, kind, c, eps, num_groups, gate_act, gate_position, weight_offset, weight is not None,
                        gate is not None)
    # written out, not looped over (name, tensor) pairs: on the eager torch path this
    # function's host time is part of every call's
    if weight is not None:
        check_vector("weight", weight, x, d)
    if bias is not None:
        check_vector("bias", bias, x, d)
    if residual is not None:
        _check_like_x("residual", residual, x)
    if gate is not None:
        _check_like_x("gate", gate, x)
    if residual_dtype is not None:
        check_float_dtype("residual_dtype", residual_dtype)
    if out_dtype is not None:
        check_float_dtype("out_dtype", out_dtype)
        spec = spec.with_out_dtype(out_dtype)
    if quant is not None or scale is not None:
        spec = quant_spec(spec, x, quant, scale)
    return spec


def quant_spec(spec: NormSpec, x: torch.Tensor, quant, scale=None) -> NormSpec:
    """spec with the call's fp8 recipe (quant=, with scale= for fp8_tensor): what the recipe
    checked when it was made holds; here what depends on the call, every mistake a
    ValueError or TypeError naming the argument. scale= without quant= is refused (it
    would do nothing)."""
    recipe = recipe_of(quant)
    if recipe is None:
        raise ValueError("scale= is fp8_tensor's static scale, an option of quant=, which is None: pass "
                         "quant='fp8_tensor', or leave scale at None")
    mode, name = QUANTS[recipe.mode], recipe.mode
    if spec.out_dtype is not None:
        raise ValueError(f"out_dtype and quant={name!r} both say how the output is stored: pass one (the recipe's "
                         "quant_from rounds the normed value to a dtype before it is quantized)")
    if x.dtype not in QUANT_DTYPES:
        raise TypeError(f"quant={name!r} needs x in float16, bfloat16 or float32 (the fp32 normed value is cast), "
                        f"got x of {x.dtype}")
    d = x.shape[-1]
    if mode == Quant.MX and (d % MX_BLOCK or (d // spec.groups) % MX_BLOCK):
        raise ValueError(f"quant='mxfp8' needs the last dim (and each of num_groups={spec.groups} groups) to be a "
                         f"multiple of {MX_BLOCK}, got {d}: pad the row to a multiple of {MX_BLOCK}, or use "
                         f"quant='fp8_row'")
    if recipe.mx_columnwise:
        rows = x.numel() // d if d else 0
        if rows % MX_BLOCK:
            raise ValueError(f"mx_columnwise needs the number of rows (x.numel() // d = {rows}) to be a multiple of "
                             f"{MX_BLOCK}: its blocks run down the columns; pad the batch or leave it off")
    if mode == Quant.TENSOR:
        check_static_scale(scale, x)
    elif scale is not None:
        raise ValueError(f"scale= is fp8_tensor's static scale; quant={name!r} computes its own (scale must be None)")
    return replace(spec, quant=mode, fp8_e5m2=recipe.fp8_dtype == torch.float8_e5m2,
                   mx_rceil=recipe.mx_rounding == "rceil", quant_from=recipe.quant_from,
                   scale_ub=recipe.scale_ub or 0.0, mx_columnwise=recipe.mx_columnwise)


def check_static_scale(scale, x: torch.Tensor) -> None:
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"quant='fp8_tensor' needs scale=, a one-element float32 tensor (the static dequantization "
                        f"scale), got {type(scale).__name__}")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(f"scale must be a one-element float32 tensor, got shape {tuple(scale.shape)} {scale.dtype}")
    if scale.device != x.device:
        raise ValueError(f"scale is on {scale.device} but x is on {x.device}")
    if scale.device.type == "cpu" and not (math.isfinite(scale.item()) and scale.item() > 0):
        # a device scale is not read back (no host sync): its value is the caller's to keep positive and finite
        raise ValueError(f"scale must be positive and finite, got {scale.item()}")


def check_branch(x: torch.Tensor, x1, alpha, dropout_p) -> None:
    """add_norm's branch, p = residual + alpha * (drop(x) + drop(x1)): alpha a finite
    number, dropout_p in [0, 1), x1 a tensor of x's shape and dtype. After resolve (x checked)."""
    check_number("alpha", alpha)
    check_number("dropout_p", dropout_p)
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if x1 is not None:
        _check_like_x("x1", x1, x)
        if x1.dtype != x.dtype:
            raise TypeError(f"x1 must have x's dtype {x.dtype}, got {x1.dtype}")


def check_scale(name: str, scale, x: torch.Tensor, like: torch.Tensor | None):
    """A residual_scale or branch_scale: a finite real number, returned as a float, or a
    (d,) tensor on x's device in fp32 or like's dtype (the weight's; x's with no weight),
    returned as it is."""
    if not isinstance(scale, torch.Tensor):
        check_number(name, scale)
        return float(scale)
    check_vector(name, scale, x, x.shape[-1])
    dtype = (x if like is None else like).dtype
    if scale.dtype not in (torch.float32, dtype):
        raise TypeError(f"{name} must be float32 or {dtype} (the weight's dtype, x's without one), got {scale.dtype}")
    return scale


def check_scales(x: torch.Tensor, residual, like, alpha, residual_scale, branch_scale):
    """The residual update's scales, r' = a * r + b * branch: (b's float, a's float, a's
    [d] tensor or None, b's [d] tensor or None). alpha is branch_scale's float form: one
    of the two (alpha 1: not given). like: the tensor whose dtype a [d] scale may have
    besides fp32 (the weight; None: x)."""
    check_number("alpha", alpha)
    if branch_scale is None and (residual_scale is None or residual_scale.__class__ is float and residual_scale == 1.0):
        return float(alpha), 1.0, None, None  # the plain update: what a call without the scales pays
    if branch_scale is not None:
        if alpha != 1.0:
            raise ValueError("alpha and branch_scale are one scale (alpha is branch_scale's float form): give one")
        branch_scale = check_scale("branch_scale", branch_scale, x, like)
    if residual_scale is None:
        residual_scale = 1.0
    residual_scale = check_scale("residual_scale", residual_scale, x, like)
    if residual is None and (isinstance(residual_scale, torch.Tensor) or residual_scale != 1.0):
        raise ValueError("residual_scale scales the residual: it needs one (residual is None)")
    bs = branch_scale if isinstance(branch_scale, torch.Tensor) else None
    rs = residual_scale if isinstance(residual_scale, torch.Tensor) else None
    return (float(alpha) if branch_scale is None or bs is not None else branch_scale,
            1.0 if rs is not None else residual_scale, rs, bs)


def check_vector(name: str, t, x: torch.Tensor, d: int) -> None:
    check_tensor(name, t, x)
    if t.dim() != 1 or t.shape[0] != d:
        raise ValueError(f"{name} must have shape ({d},), got {tuple(t.shape)}")


def _check_like_x(name: str, t, x: torch.Tensor) -> None:
    check_tensor(name, t, x)
    if t.shape != x.shape:
        raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(t.shape)}")


# Validated option tuples and their specs. The eager torch path's cost is host time, and
# checking the same options on every call of a training step would cost as much as the
# norm itself at small sizes. Keys carry the types, so c=True never passes as c=1.
_SPECS: dict = {}


def _option_spec(d, kind, c, eps, num_groups, gate_act, gate_position, weight_offset, has_weight, gated) -> NormSpec:
    # not while torch.compile traces: there d may be symbolic, and the checks are traced once anyway
    key = None if torch.compiler.is_compiling() else (
        d, kind, type(c), c, type(eps), eps, type(num_groups), num_groups, gate_act, gate_position,
        type(weight_offset), weight_offset, has_weight, gated)
    try:
        return _SPECS[key]
    except (KeyError, TypeError):  # new, or unhashable (then invalid: the checks below say how)
        pass
    check_weight_offset(weight_offset, has_weight)
    check_options(d, kind=kind, c=c, eps=eps, num_groups=num_groups, gate_act=gate_act, gate_position=gate_position)
    if not gated and (gate_act != DEFAULT_GATE_ACT or gate_position != DEFAULT_GATE_POSITION):
        raise ValueError("gate_act and gate_position only apply when a gate tensor is given (gate is None)")
    spec = NormSpec.of(d, kind=kind, c=c, eps=eps, num_groups=num_groups, gate_act=gate_act if gated else None,
                       gate_position=gate_position if gated else None, weight_offset=weight_offset)
    if key is not None and len(_SPECS) < 4096:  # bounded: a sweep over eps or c values must not grow it forever
        _SPECS[key] = spec
    return spec
