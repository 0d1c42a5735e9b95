"""The resolved description of one normalize call, the named modes the kernels read, and
the fp8 recipe (`Fp8Recipe`, quant=) that a call resolves into its spec.

The lowest layer: the Triton kernels, the torch reference and the ops above them all
import this module, and it imports none of them. The math is in docs/math.md.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import KW_ONLY, dataclass, fields, replace
from enum import IntEnum
from typing import ClassVar, get_type_hints

import torch

KINDS = ("rms", "layer", "l2")
_SERIALS = itertools.count()  # NormSpec.serial
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Gate(IntEnum):
    """Where the gate multiplies: out = N(p * g(z)) (PRE) or N(p) * g(z) (POST)."""

    NONE = 0
    PRE = 1
    POST = 2


class Act(IntEnum):
    """The gate function g. UNUSED when there is no gate."""

    UNUSED = 0
    IDENTITY = 1
    SIGMOID = 2
    SILU = 3


class Quant(IntEnum):
    """The scaled fp8 output (docs/low_precision.md): none, one static scale for the
    tensor, a dynamic scale per row, or MX blocks of 32 along the row with e8m0 scales."""

    NONE = 0
    TENSOR = 1
    ROW = 2
    MX = 3


class Ord(IntEnum):
    """The embedding norms' n(x): sum|x|, sqrt(x.x), max|x|."""

    L1 = 1
    L2 = 2
    MAX = 3


# the user-facing names; "none" and "swish" are aliases ("none" was the identity's first name)
GATE_ACTS = {"identity": Act.IDENTITY, "none": Act.IDENTITY, "sigmoid": Act.SIGMOID, "silu": Act.SILU,
             "swish": Act.SILU}
GATE_POSITIONS = {"pre": Gate.PRE, "post": Gate.POST}
QUANTS = {"fp8_tensor": Quant.TENSOR, "fp8_row": Quant.ROW, "mxfp8": Quant.MX}
MX_BLOCK = 32  # elements per MX scale block, along the row
ORDS = {"l1": Ord.L1, "l2": Ord.L2, "max": Ord.MAX}
DEFAULT_GATE_ACT = "silu"
DEFAULT_GATE_POSITION = "post"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # the codes' formats (OCP)
MX_ROUNDINGS = ("floor", "rceil")
QUANT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # x's, and quant_from's


@dataclass(frozen=True)
class Fp8Recipe:
    """How a norm writes its output as scaled fp8 codes (docs/low_precision.md): the
    `quant=` of `norm`, `add_norm`, `norm_add_norm` and `norm_linear`, where the mode's
    name alone (quant="fp8_row") means `Fp8Recipe("fp8_row")`.

    mode: "fp8_tensor" (one static scale, the call's `scale=` tensor), "fp8_row" (a scale
    per row) or "mxfp8" (e8m0 scales per 32 columns). fp8_dtype: the codes'
    (torch.float8_e4m3fn or torch.float8_e5m2). mx_rounding (mxfp8): the block scales
    rounded "floor" (torchao's default) or "rceil". scale_ub (fp8_row): an upper bound on
    each row's amax. quant_from: the dtype the fp32 normed value is rounded to before it
    is cast (an unfused norm-then-cast's rounding points), None for one rounding.
    mx_columnwise (mxfp8): also the copy with blocks of 32 down the columns.

    Frozen and validated here, once: every field of the wrong type or value, and every
    option the mode does not read (it would do nothing), is a TypeError or ValueError
    naming the field. `dataclasses.replace(recipe, ...)` makes a validated variant. What
    depends on the call (x's dtype, the row width, the number of rows) is checked per call.
    """

    mode: str
    _: KW_ONLY
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    mx_rounding: str = "floor"
    scale_ub: float | None = None
    quant_from: torch.dtype | None = None
    mx_columnwise: bool = False

    def __post_init__(self):
        mode = self.mode
        if not isinstance(mode, str) or mode not in QUANTS:
            raise ValueError(f"Fp8Recipe mode must be one of {sorted(QUANTS)}, got {mode!r}")
        if not isinstance(self.fp8_dtype, torch.dtype) or self.fp8_dtype not in FP8_DTYPES:
            raise TypeError(f"Fp8Recipe fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
                            f"got {self.fp8_dtype!r}")
        if not isinstance(self.mx_rounding, str) or self.mx_rounding not in MX_ROUNDINGS:
            raise ValueError(f"Fp8Recipe mx_rounding must be one of {MX_ROUNDINGS}, got {self.mx_rounding!r}")
        if self.mx_rounding != "floor" and mode != "mxfp8":
            raise ValueError(f"Fp8Recipe mx_rounding rounds mxfp8's block scales; it does nothing for "
                             f"mode {mode!r}")
        ub = self.scale_ub
        if ub is not None:
            if mode != "fp8_row":
                raise ValueError(f"Fp8Recipe scale_ub bounds fp8_row's amax; it does nothing for mode {mode!r}")
            if isinstance(ub, bool) or not isinstance(ub, (int, float)) or not 0 < ub < math.inf:
                raise ValueError(f"Fp8Recipe scale_ub must be a positive finite float (an upper bound on each "
                                 f"row's amax), got {ub!r}")
            object.__setattr__(self, "scale_ub", float(ub))
        if self.quant_from is not None and (not isinstance(self.quant_from, torch.dtype)
                                            or self.quant_from not in QUANT_DTYPES):
            raise TypeError(f"Fp8Recipe quant_from must be None or one of {QUANT_DTYPES}, got {self.quant_from!r}")
        if not isinstance(self.mx_columnwise, bool):
            raise TypeError(f"Fp8Recipe mx_columnwise must be a bool, got {type(self.mx_columnwise).__name__}")
        if self.mx_columnwise and mode != "mxfp8":
            raise ValueError(f"Fp8Recipe mx_columnwise is mxfp8's columnwise copy; mode {mode!r} has none")


# quant="fp8_row" and the other names: the recipe with the defaults, one instance each
RECIPES = {mode: Fp8Recipe(mode) for mode in QUANTS}


def stored_dtype(x_dtype: torch.dtype, residual: torch.dtype | None, residual_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype new_residual = x + residual is stored in: residual_dtype when given, else
    the dtype torch's `x + residual` has (residual: the residual's dtype, None for none)."""
    if residual_dtype is not None:
        return residual_dtype
    if residual is None or residual == x_dtype:  # torch.promote_types is a dispatcher call: skip it here
        return x_dtype
    return torch.promote_types(x_dtype, residual)


def new_residual_dtype(x_dtype: torch.dtype, residual: torch.dtype | None,
                       residual_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype add_norm writes new_residual in, or None where it writes none: with no
    residual and no dtype change, new_residual is x itself (and p is x)."""
    dtype = stored_dtype(x_dtype, residual, residual_dtype)
    return dtype if residual is not None or dtype != x_dtype else None


def residual_grad_dtype(x_dtype: torch.dtype, residual: torch.dtype | None) -> torch.dtype | None:
    """The dtype of a dresidual written apart from dx: the residual's, where it differs
    from x's (an fp32 stream under bf16 activations). None where there is no residual,
    or where dx, in the same dtype, is dresidual too (d new_residual / d residual = 1)."""
    return residual if residual is not None and residual != x_dtype else None


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics and math run in fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class NormSpec:
    """What the kernels need to know, resolved from the user's keywords.

    `scale` is c / sqrt(group size): o = (c/sqrt(d)) * q/sigma * (weight_offset + w) + b
    with sigma = sqrt(q.q/d + eps) (docs/math.md). weight_offset + w is formed in fp32.

    Custom-op schemas take primitive arguments only, so a spec crosses the op boundary as
    `pack()`, a list of floats, and is rebuilt by `unpack`: a new field is added here and
    read by the kernels, and nothing between them changes.
    """

    center: bool  # subtract the mean (LayerNorm) or not (RMS, L2)
    scale: float
    eps: float
    gate: Gate
    act: Act
    groups: int
    weight_offset: float = 0.0  # Gemma's (1 + w): the stored weight is the offset from weight_offset
    # add_norm's branch, p = residual_scale * residual + alpha * (drop(x) + drop(x1)): the
    # branch's float scale (the float form of branch_scale), the dropout probability (the
    # seed is drawn per call, not part of the spec) and the residual's float scale. A [d]
    # tensor scale is an argument of the call, not a field; its float here is then 1.
    alpha: float = 1.0
    dropout_p: float = 0.0
    residual_scale: float = 1.0
    # norm_add's update="interpolate" (nGPT, transformers' Dory), a field of the branch spec:
    # new_residual = residual + b * (N_b(x) - residual), b the branch scale (alpha or the [d]
    # branch_scale), in place of a * residual + b * N_b(x)
    interpolate: bool = False
    # nGPT's unit-sphere L2 norm, q * rsqrt(q.q + eps): eps added to the sum of squares, not to
    # their mean (update="interpolate"'s norms). The kernels compute it as the l2 norm with eps / d.
    eps_on_sum: bool = False
    # the dtype the output is stored in, None for x's: an fp32 out of bf16 x is the fp32
    # composition stored once (not rounded to x's dtype first), and its gradient is read as
    # it comes (flash-attention's out_dtype)
    out_dtype: torch.dtype | None = None
    # the scaled fp8 output in place of out (docs/low_precision.md): its mode, e5m2 rather
    # than e4m3fn codes, MX scales rounded up (torchao's rceil) rather than down (floor),
    # the dtype the normed value is rounded to before it is quantized (None: quantized from
    # fp32, one rounding; set: the unfused pipeline's rounding points, bit for bit) and
    # fp8_row's upper bound on the row amax (0: none)
    quant: Quant = Quant.NONE
    fp8_e5m2: bool = False
    mx_rceil: bool = False
    quant_from: torch.dtype | None = None
    scale_ub: float = 0.0
    mx_columnwise: bool = False  # mxfp8 also down the columns (blocks of 32 rows), the weight gradient's operand

    # This instance's number, unique in the process (a copy keeps it: equal fields): the
    # launchers key the launches they lay out by it, an attribute read where hashing the
    # fields would be a Python call on every launch. Not a field: equality, hashing and
    # pack() ignore it. None for a spec made while torch.compile traces (no global counter
    # moves there): the launchers lay such a call out anew.
    serial: ClassVar[int | None] = None

    def __post_init__(self):
        if not torch.compiler.is_compiling():
            object.__setattr__(self, "serial", next(_SERIALS))

    def pack(self) -> list[float]:
        if torch.compiler.is_compiling():  # traced into the graph: nothing kept on the instance
            return [_pack(getattr(self, name)) for name in _NAMES]
        # A kernel-path call packs its spec twice (forward, backward), and a model reuses a
        # few: the values are computed once per instance (frozen) and kept beside its fields
        packed = self.__dict__.get("_packed")
        if packed is None:
            packed = tuple(_pack(getattr(self, name)) for name in _NAMES)
            object.__setattr__(self, "_packed", packed)
        return list(packed)

    def with_branch(self, alpha: float, dropout_p: float, residual_scale: float = 1.0) -> NormSpec:
        """This spec with add_norm's validated branch options."""
        return replace(self, alpha=float(alpha), dropout_p=float(dropout_p), residual_scale=float(residual_scale))

    def interpolating(self, branch: bool) -> NormSpec:
        """This spec as one of update="interpolate"'s norms (eps on the sum of squares), and
        for the branch norm with the interpolation itself: one instance per spec (`_interpolating`;
        traced by torch.compile, a new one, where the cache is not read)."""
        if torch.compiler.is_compiling():
            return replace(self, eps_on_sum=True, interpolate=branch)
        return _interpolating(self, branch)

    def with_out_dtype(self, out_dtype: torch.dtype | None) -> NormSpec:
        """This spec storing its output in out_dtype (a validated float dtype; None: x's)."""
        return self if out_dtype is None else replace(self, out_dtype=out_dtype)

    def unquantized(self) -> NormSpec:
        """This spec without its fp8 output: the plain op whose backward a quantized call's is."""
        return replace(self, quant=Quant.NONE, fp8_e5m2=False, mx_rceil=False, quant_from=None, scale_ub=0.0,
                       mx_columnwise=False)

    def out_dtype_for(self, x_dtype: torch.dtype) -> torch.dtype:
        """The dtype the output of a call on x of x_dtype is stored in."""
        return x_dtype if self.out_dtype is None else self.out_dtype

    @classmethod
    def unpack(cls, values: list[float]) -> NormSpec:
        return _unpack(tuple(values))

    @classmethod
    def of(cls, d: int, *, kind: str, c, eps: float, num_groups: int, gate_act: str | None,
           gate_position: str | None, weight_offset: float = 0.0) -> NormSpec:
        """The spec of validated options for rows of d; gate_act/gate_position None: no gate."""
        group = d // num_groups
        if c is None:
            c = 1.0 if kind == "l2" else math.sqrt(group)
        gated = gate_position is not None
        return cls(
            center=kind == "layer",
            scale=float(c) / math.sqrt(group),
            eps=float(eps),
            gate=GATE_POSITIONS[gate_position] if gated else Gate.NONE,
            act=GATE_ACTS[gate_act] if gated else Act.UNUSED,
            groups=int(num_groups),
            weight_offset=float(weight_offset),
        )


def _pack(value) -> float:
    """A spec field as a float: a dtype as 1 + its index in FLOAT_DTYPES, None as 0."""
    if value is None:
        return 0.0
    if isinstance(value, torch.dtype):
        return float(FLOAT_DTYPES.index(value) + 1)
    # .value: torch.compile traces this, and float() of an IntEnum member recurses in Dynamo
    return float(value.value if isinstance(value, IntEnum) else value)


def _cast(name: str, kind, value: float):
    if name in _DTYPE_FIELDS:
        return None if value == 0 else FLOAT_DTYPES[int(value) - 1]
    return kind(int(value)) if issubclass(kind, int) else kind(value)  # bool and the IntEnums are ints


# pack and unpack run on every kernel-path call, forward and backward: the fields' names
# are read once, and a spec is rebuilt only from values not seen before (get_type_hints
# evaluates the string annotations anew, ~50 us). A model has a few specs; they are
# frozen, so one instance serves every call.
_NAMES = tuple(f.name for f in fields(NormSpec))
_DTYPE_FIELDS = ("out_dtype", "quant_from")  # fields holding a dtype or None, which _pack and _cast encode


@functools.lru_cache(maxsize=256)
def _unpack(values: tuple[float, ...]) -> NormSpec:
    hints = get_type_hints(NormSpec)
    return NormSpec(*(_cast(name, hints[name], v) for name, v in zip(_NAMES, values, strict=True)))


@functools.lru_cache(maxsize=256)
def _interpolating(spec: NormSpec, branch: bool) -> NormSpec:
    # cached: the launchers lay a launch out once per spec instance (NormSpec.serial)
    return replace(spec, eps_on_sum=True, interpolate=branch)
