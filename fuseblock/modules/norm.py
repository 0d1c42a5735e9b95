"""nn.Module wrappers over the functional ops: `Norm` and `AddNorm`.

They keep torch.nn's habits: parameters named `weight` and `bias` with nn.RMSNorm's and
nn.LayerNorm's defaults, so state_dicts load both ways with no flags; `normalized_shape`
an int or a 1-tuple, and eps the second positional argument, by default torch's (None:
nn.RMSNorm's machine epsilon for the input's dtype, nn.LayerNorm's 1e-5); `reset_parameters`
for deferred (meta-device) initialization.

`Norm.add` is the fused call with the module's own parameters and settings: the stream,
the Hugging Face integration and the GPT call it rather than copying settings into
`add_norm`, so a new Norm option stops in this file. `Norm.norm_add` and
`Norm.norm_add_norm` are the same for the post-norm and sandwich ops, the module being
the branch norm.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.checks import (
    check_flag,
    check_float_dtype,
    check_int,
    check_last_dim,
    check_options,
    check_weight_offset,
    default_eps,
    refuse_positional,
    resolve,
)
from ..ops.dtensor import keeps_inputs
from ..ops.norm import NO_DROPOUT, NO_SCALE, add_norm
from ..ops.norm_add import norm_add, norm_add_norm
from ..ops.norm_linear import norm_linear
from ..reference import norm as reference
from ..spec import DEFAULT_GATE_ACT, DEFAULT_GATE_POSITION


def normalized_dim(normalized_shape) -> int:
    """The normalized (last) dim from an int or a 1-tuple / 1-list / torch.Size, as torch's
    norms take it; fuseblock normalizes over the last dim only."""
    if isinstance(normalized_shape, (tuple, list)):  # torch.Size is a tuple
        if len(normalized_shape) != 1:
            raise ValueError(f"normalized_shape must be an int or a 1-tuple (fuseblock normalizes over the last dim "
                             f"only), got {tuple(normalized_shape)}")
        (normalized_shape,) = normalized_shape
    check_int("normalized_shape", normalized_shape)
    return int(normalized_shape)


class Norm(nn.Module):
    """Normalize over the last dim: RMSNorm (kind="rms"), LayerNorm ("layer") or L2 ("l2").

    `forward(x, *, gate=None)`; a gate applies `gate_act` at `gate_position` (see
    fuseblock.norm). It is keyword-only, so flash-attention's habit `norm(x, residual)`
    is a TypeError rather than a gate. out = N(x) * (weight_offset + weight) + bias.
    bias=None means a bias for kind="layer" only, so nn.LayerNorm(d) and nn.RMSNorm(d)
    state_dicts load with no other flags; `weight=False` / `bias=False` drop one parameter,
    and `elementwise_affine=False` both, whatever `weight` and `bias` say, as in
    nn.LayerNorm(d, elementwise_affine=False) (and nn.RMSNorm's, which has no bias).
    weight_offset (Gemma's 1 + w) makes the weight's initial value zeros. eps=None (the
    default) is torch's, resolved at each call: nn.LayerNorm's 1e-5 for kind="layer", else
    nn.RMSNorm's machine epsilon of the input's computation dtype.
    """

    # the dtype `add` keeps new_residual in when its call names none; AddNorm's is settable
    residual_dtype: torch.dtype | None = None

    def __init__(
        self,
        normalized_shape: int | tuple[int],
        eps: float | None = None,
        *,
        kind: str = "rms",
        c: float | None = None,
        weight: bool = True,
        bias: bool | None = None,
        elementwise_affine: bool = True,
        num_groups: int = 1,
        gate_act: str = DEFAULT_GATE_ACT,
        gate_position: str = DEFAULT_GATE_POSITION,
        weight_offset: float = 0.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        dim = normalized_dim(normalized_shape)
        check_flag("weight", weight)  # whether the parameter exists; a tensor here is a mistaken initial value
        if bias is not None:
            check_flag("bias", bias)
        check_flag("elementwise_affine", elementwise_affine)
        if not elementwise_affine:  # torch's norms then have neither parameter, whatever bias says
            weight, bias = False, False
        check_float_dtype("dtype", dtype)
        # eps=None passes through to the op, which resolves it for each input's dtype
        check_options(dim, kind=kind, c=c, eps=0.0 if eps is None else eps, num_groups=num_groups, gate_act=gate_act,
                      gate_position=gate_position)
        check_weight_offset(weight_offset, bool(weight))
        self.dim, self.normalized_shape = dim, (dim,)
        self.kind, self.c, self.eps = kind, c, None if eps is None else float(eps)
        self.num_groups, self.gate_act, self.gate_position = int(num_groups), gate_act, gate_position
        self.weight_offset = float(weight_offset)
        self.elementwise_affine = bool(elementwise_affine)
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(dim, **factory)) if weight else None
        self.bias = nn.Parameter(torch.empty(dim, **factory)) if (kind == "layer" if bias is None else bias) else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The initial values, for which the module is the plain norm: weight ones (zeros with
        a weight_offset), bias zeros. Called by __init__; call it again after building on the
        meta device and `to_empty` (FSDP2's deferred init), as torch's norms do."""
        if self.weight is not None:
            (nn.init.zeros_ if self.weight_offset != 0.0 else nn.init.ones_)(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, *positional: Tensor, gate: Tensor | None = None) -> Tensor:
        if positional:  # none: flash-attention's `norm(x, residual)` is refused by name
            refuse_positional(f"{type(self).__name__}.forward", "x", 1 + len(positional),
                              "; a residual goes to AddNorm or Norm.add(x, residual)")
        return self.add(x, None, gate=gate)[0]

    def add(self, x: Tensor, residual: Tensor | None = None, *positional: Tensor,
            residual_dtype: torch.dtype | None = None, gate: Tensor | None = None, alpha: float = NO_SCALE,
            x1: Tensor | None = None, dropout_p: float = NO_DROPOUT, residual_scale: float | Tensor = NO_SCALE,
            branch_scale: float | Tensor | None = None) -> tuple[Tensor, Tensor]:
        """fuseblock.add_norm with this module's parameters and settings: (N(r'), r') with
        r' = residual + alpha * (drop(x) + drop(x1)), or with the per-channel scales
        a * residual + b * (drop(x) + drop(x1)). residual_dtype=None keeps new_residual
        in the module's residual_dtype (an AddNorm's), else in the dtype torch's
        `x + residual` has. dropout_p is the caller's to zero in eval. The defaults are
        add_norm's own objects, which its plain lane tests by identity: pass none of the
        three for a plain add."""
        # Written for host time, which is the eager torch path's cost: keywords written out
        # (no dict built per call), and x's width checked up front only where no parameter
        # would catch it; otherwise after the op refuses, to name x rather than the weight.
        if positional:
            refuse_positional(f"{type(self).__name__}.add", "x, residual", 2 + len(positional))
        if residual_dtype is None:
            residual_dtype = self.residual_dtype
        weight, bias = self.weight, self.bias
        if weight is None and bias is None:
            check_last_dim(x, self.dim)
        gated = gate is not None  # the gate settings apply only with a gate
        try:
            return add_norm(
                x, residual, weight, bias, kind=self.kind, c=self.c, eps=self.eps, residual_dtype=residual_dtype,
                gate=gate, gate_act=self.gate_act if gated else DEFAULT_GATE_ACT,
                gate_position=self.gate_position if gated else DEFAULT_GATE_POSITION, num_groups=self.num_groups,
                weight_offset=self.weight_offset, alpha=alpha, x1=x1, dropout_p=dropout_p,
                residual_scale=residual_scale, branch_scale=branch_scale,
            )
        except ValueError:
            check_last_dim(x, self.dim)
            raise

    # add_linear's recipe: None, or "fp8_row" (the Linear in fp8, norm_linear's quant=;
    # scripts/train.py --fp8 row sets it on the block norms). Not a parameter or buffer.
    linear_quant: str | None = None

    def add_linear(self, x: Tensor, residual: Tensor | None, linear: nn.Linear, *,
                   residual_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """fuseblock.norm_linear with this module's parameters and settings and `linear`'s:
        (linear(N(x + residual)), x + residual), the normed activations not kept for
        backward. residual_dtype as in `add`. A gate, groups or a c of its own are not
        norm_linear's: a ValueError."""
        if self.c is not None or self.num_groups != 1:
            raise ValueError(f"add_linear: norm_linear takes no c or num_groups (this norm has c={self.c}, "
                             f"num_groups={self.num_groups}); call add, then the Linear")
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        if linear._forward_pre_hooks or linear._forward_hooks:
            # the fused op reads linear's parameters and never calls its forward, so its hooks
            # (torch's ColwiseParallel's input gather, FSDP2's unshard, a user's) would not run
            raise ValueError(f"add_linear: linear ({linear}) has forward hooks, which the fused norm + Linear would "
                             f"skip: call add, then the Linear (fuses_prenorm off), or remove them (a tensor-parallel "
                             f"plan places the weight alone: docs/parallel.md)")
        return norm_linear(x, residual, self.weight, self.bias, linear.weight, linear.bias, kind=self.kind,
                           eps=self.eps, weight_offset=self.weight_offset,
                           residual_dtype=self.residual_dtype if residual_dtype is None else residual_dtype,
                           quant=self.linear_quant)

    def norm_add(self, x: Tensor, residual: Tensor, *, alpha: float = 1.0,
                 residual_dtype: torch.dtype | None = None, residual_scale: float | Tensor = 1.0,
                 branch_scale: float | Tensor | None = None) -> Tensor:
        """fuseblock.norm_add with this module as the branch norm: residual + alpha * N(x),
        the post-norm step (OLMo2), or a * residual + b * N(x) with the per-channel scales.
        residual_dtype as in `add`."""
        self._check_plain("norm_add")
        return norm_add(x, residual, self.weight, self.bias, kind=self.kind, eps=self.eps,
                        weight_offset=self.weight_offset, alpha=alpha, residual_scale=residual_scale,
                        branch_scale=branch_scale,
                        residual_dtype=self.residual_dtype if residual_dtype is None else residual_dtype)

    def norm_add_norm(self, x: Tensor, residual: Tensor, norm: Norm, *, alpha: float = 1.0,
                      residual_dtype: torch.dtype | None = None, residual_scale: float | Tensor = 1.0,
                      branch_scale: float | Tensor | None = None) -> tuple[Tensor, Tensor]:
        """fuseblock.norm_add_norm with this module as the branch norm and `norm` the one after
        (Gemma2's sandwich): (norm(r'), r') with r' = residual + alpha * self(x), both norms
        in one launch. They share the kind; each keeps its eps, weight_offset and
        parameters. residual_dtype as in `add`, None taking `norm`'s."""
        if not isinstance(norm, Norm):
            raise TypeError(f"norm must be a fuseblock Norm, got {type(norm).__name__}")
        self._check_plain("norm_add_norm")
        norm._check_plain("norm_add_norm")
        if norm.kind != self.kind:
            raise ValueError(f"norm_add_norm: both norms take one kind, got {self.kind!r} (branch) and "
                             f"{norm.kind!r} (norm)")
        if norm.dim != self.dim:
            raise ValueError(f"norm_add_norm: both norms normalize one width, got {self.dim} (branch) and "
                             f"{norm.dim} (norm)")
        return norm_add_norm(x, residual, self.weight, norm.weight, self.bias, norm.bias, kind=self.kind,
                             # the branch's eps=None is torch's for x, not norm's eps
                             eps=norm.eps, branch_eps=default_eps(x.dtype, self.kind) if self.eps is None else self.eps,
                             weight_offset=norm.weight_offset,
                             branch_weight_offset=self.weight_offset, alpha=alpha, residual_scale=residual_scale,
                             branch_scale=branch_scale,
                             residual_dtype=norm.residual_dtype if residual_dtype is None else residual_dtype)

    def _check_plain(self, op: str) -> None:
        # the norm_add ops take no c, groups or gate: a norm with them calls norm, then adds
        if self.c is not None or self.num_groups != 1:
            raise ValueError(f"{op}: takes no c or num_groups (this norm has c={self.c}, "
                             f"num_groups={self.num_groups}); call the norm, then add")

    def naive(self, x: Tensor) -> Tensor:
        """The same function (without a gate) on the torch path's plain ops, never the fused
        kernels: the naive stream's norm."""
        check_last_dim(x, self.dim)
        spec = resolve(x, None, self.weight, self.bias, None, kind=self.kind, c=self.c, eps=self.eps,
                       gate_act=DEFAULT_GATE_ACT, gate_position=DEFAULT_GATE_POSITION, num_groups=self.num_groups,
                       residual_dtype=None, weight_offset=self.weight_offset)
        return reference.norm_fwd(x, None, None, self.weight, self.bias, spec, None, need_stats=False)[0]

    def extra_repr(self) -> str:
        """normalized_shape, kind and eps always (as torch's norms show theirs), then every
        other setting that differs from its default."""
        parts = [f"{self.normalized_shape}", f"kind={self.kind!r}", f"eps={self.eps}"]
        if self.c is not None:
            parts.append(f"c={self.c}")
        if not self.elementwise_affine:
            parts.append("elementwise_affine=False")
        elif self.weight is None:
            parts.append("weight=False")
        if self.elementwise_affine and (self.bias is not None) != (self.kind == "layer"):
            parts.append(f"bias={self.bias is not None}")
        if self.num_groups > 1:
            parts.append(f"num_groups={self.num_groups}")
        if self.gate_act != DEFAULT_GATE_ACT:
            parts.append(f"gate_act={self.gate_act!r}")
        if self.gate_position != DEFAULT_GATE_POSITION:
            parts.append(f"gate_position={self.gate_position!r}")
        if self.weight_offset != 0.0:
            parts.append(f"weight_offset={self.weight_offset}")
        return ", ".join(parts)


class AddNorm(Norm):
    """Fused residual add + normalize: `forward(x, residual=None, *, gate=None) -> (out, new_residual)`.

    new_residual = x + residual, kept in `residual_dtype`: by default the dtype torch's
    `x + residual` has (fuseblock.add_norm's default too), so an fp32 residual is never
    rounded to bf16 activations. out has x's dtype. eps=None resolves for the dtype of
    new_residual, the tensor normalized (fuseblock.add_norm). The other arguments are Norm's.
    """

    def __init__(self, normalized_shape: int | tuple[int], eps: float | None = None, *,
                 residual_dtype: torch.dtype | None = None, **kwargs):
        super().__init__(normalized_shape, eps, **kwargs)
        check_float_dtype("residual_dtype", residual_dtype)
        self.residual_dtype = residual_dtype

    def forward(self, x: Tensor, residual: Tensor | None = None, *positional: Tensor, gate: Tensor | None = None):
        if positional:  # none: a gate passed third is refused by name
            refuse_positional(f"{type(self).__name__}.forward", "x, residual", 2 + len(positional))
        return self.add(x, residual, gate=gate)

    def register_forward_pre_hook(self, hook, **kwargs):
        # a hook that drops the positional residual is refused at the call (fuseblock.ops.dtensor)
        return super().register_forward_pre_hook(keeps_inputs(hook, kwargs.get("with_kwargs", False)), **kwargs)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.residual_dtype is None else f", residual_dtype={self.residual_dtype}")
