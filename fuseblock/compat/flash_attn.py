"""flash-attention's fused norm entry points (`flash_attn.ops.triton.layer_norm`, and
mamba's copy of it), with the same signatures, on top of `fuseblock.add_norm` and
`fuseblock.norm_linear`: code that calls them swaps one import.

    from fuseblock.compat.flash_attn import RMSNorm, layer_norm_fn, layer_norm_linear_fn, rms_norm_fn

What the two norms compute (N a layer norm, or an RMS norm with is_rms_norm / rms_norm_fn):

    residual_out = residual + drop(x) + drop(x1)      (residual, x1 optional; dropout_p)
    y = N(residual_out) * (zero_centered_weight + weight) + bias
    returns y, or (y, residual_out) with prenorm=True

residual_out is kept in residual's dtype, or with no residual in fp32 when
residual_in_fp32, else in x's (then it is x itself when there is nothing to add, as
flash-attention returns it). y has x's dtype, or out_dtype: computed in fp32 and stored
once in it, its gradient read in it (add_norm's out_dtype). eps defaults to 1e-6 as
there. Dropout masks are independent for x and x1, drawn from torch's default generator
(fuseblock.add_norm); the caller zeroes dropout_p in eval, as RMSNorm does from
self.training. return_dropout_mask=True appends the masks to what is returned, as
flash-attention does: at dropout_p=0 it has none to return, and returns None for each.

layer_norm_linear_fn(x, norm_weight, norm_bias, linear_weight, linear_bias, ...) is
`F.linear(N(residual + x), linear_weight, linear_bias)`, or (that, residual_out) with
prenorm: one `fuseblock.norm_linear` call, which keeps p and the row statistics for
backward rather than N's output.

What fuseblock does not do is an error naming the argument, never a silent
difference: rowscale, the second output norm (weight1, bias1), return_dropout_mask with
dropout_p > 0 (the kernel path keeps no mask: it regenerates it in backward), and the
preallocated outputs out= and residual_out=.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.checks import check_flag, check_float_dtype, check_tensor
from ..ops.norm import add_norm
from ..ops.norm_linear import norm_linear

# (argument, what fuseblock lacks): refused when given anything but its default
_UNSUPPORTED = (
    ("rowscale", "a per-row scale of x"),
    ("weight1", "a second output norm (parallel norms' y1)"),
    ("bias1", "a second output norm (parallel norms' y1)"),
    ("out", "a preallocated output"),
    ("residual_out", "a preallocated residual output"),
)


def layer_norm_fn(x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None = None,
                  x1: Tensor | None = None, weight1: Tensor | None = None, bias1: Tensor | None = None,
                  eps: float = 1e-6, dropout_p: float = 0.0, rowscale: Tensor | None = None, prenorm: bool = False,
                  residual_in_fp32: bool = False, zero_centered_weight: bool = False, is_rms_norm: bool = False,
                  return_dropout_mask: bool = False, out_dtype: torch.dtype | None = None, out: Tensor | None = None,
                  residual_out: Tensor | None = None):
    """flash-attention's layer_norm_fn: y = N(residual + drop(x) + drop(x1)), or
    (y, residual_out) with prenorm=True (module docstring). One add_norm call."""
    given = dict(rowscale=rowscale, weight1=weight1, bias1=bias1, out=out, residual_out=residual_out)
    for name, what in _UNSUPPORTED:
        if given[name] is not None:
            raise ValueError(f"{name} is not supported by fuseblock.compat.flash_attn ({what}); pass {name}=None")
    for name, flag in (("prenorm", prenorm), ("residual_in_fp32", residual_in_fp32),
                       ("zero_centered_weight", zero_centered_weight), ("is_rms_norm", is_rms_norm),
                       ("return_dropout_mask", return_dropout_mask)):
        check_flag(name, flag)
    if return_dropout_mask and dropout_p != 0.0:
        raise ValueError("return_dropout_mask=True with dropout_p > 0 is not supported by "
                         "fuseblock.compat.flash_attn: the kernel path keeps no mask (it regenerates it in backward); "
                         "pass return_dropout_mask=False")
    check_float_dtype("out_dtype", out_dtype)
    y, new_residual = add_norm(x, residual, weight, bias, kind="rms" if is_rms_norm else "layer", eps=eps,
                               residual_dtype=_residual_dtype(residual, residual_in_fp32),
                               weight_offset=1.0 if zero_centered_weight else 0.0, x1=x1, dropout_p=dropout_p,
                               out_dtype=out_dtype)
    outs = (y, new_residual) if prenorm else (y,)
    if return_dropout_mask:  # dropout_p is 0: flash-attention allocates no mask, and returns None for each
        outs += (None, None)
    return outs if len(outs) > 1 else y


def _residual_dtype(residual: Tensor | None, residual_in_fp32: bool) -> torch.dtype | None:
    """flash-attention's dtype of residual_out: the residual's, else fp32 with
    residual_in_fp32, else None (x's, and then residual_out is x itself)."""
    if residual is not None:
        return residual.dtype
    return torch.float32 if residual_in_fp32 else None


def rms_norm_fn(x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None = None,
                x1: Tensor | None = None, weight1: Tensor | None = None, bias1: Tensor | None = None,
                eps: float = 1e-6, dropout_p: float = 0.0, rowscale: Tensor | None = None, prenorm: bool = False,
                residual_in_fp32: bool = False, zero_centered_weight: bool = False,
                return_dropout_mask: bool = False, out_dtype: torch.dtype | None = None, out: Tensor | None = None,
                residual_out: Tensor | None = None):
    """flash-attention's rms_norm_fn: layer_norm_fn with is_rms_norm=True."""
    return layer_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                         residual_in_fp32, zero_centered_weight, True, return_dropout_mask, out_dtype, out,
                         residual_out)


def layer_norm_linear_fn(x: Tensor, norm_weight: Tensor | None, norm_bias: Tensor | None, linear_weight: Tensor,
                         linear_bias: Tensor | None, residual: Tensor | None = None, eps: float = 1e-6,
                         prenorm: bool = False, residual_in_fp32: bool = False, is_rms_norm: bool = False):
    """flash-attention's layer_norm_linear_fn: out = F.linear(N(residual + x), linear_weight,
    linear_bias), or (out, residual_out) with prenorm=True; residual_out as layer_norm_fn
    keeps it. One fuseblock.norm_linear call: backward rebuilds N's output from p and the
    row statistics. As in flash-attention the Linear runs in N's output dtype (x's, or
    autocast's): a linear_weight and linear_bias of another dtype are cast to it."""
    for name, flag in (("prenorm", prenorm), ("residual_in_fp32", residual_in_fp32), ("is_rms_norm", is_rms_norm)):
        check_flag(name, flag)
    check_tensor("x", x)
    check_tensor("linear_weight", linear_weight, x)  # by flash-attention's names (norm_linear says weight, bias)
    if linear_bias is not None:
        check_tensor("linear_bias", linear_bias, x)
    if not torch.is_autocast_enabled(x.device.type):
        linear_weight = linear_weight.to(x.dtype)
        linear_bias = None if linear_bias is None else linear_bias.to(x.dtype)
    out, new_residual = norm_linear(x, residual, norm_weight, norm_bias, linear_weight, linear_bias,
                                    kind="rms" if is_rms_norm else "layer", eps=eps,
                                    residual_dtype=_residual_dtype(residual, residual_in_fp32))
    return (out, new_residual) if prenorm else out


class RMSNorm(nn.Module):
    """flash-attention's RMSNorm module: `forward(x, residual=None, prenorm=False,
    residual_in_fp32=False)` is rms_norm_fn with the module's weight, eps, and `drop.p`
    in training (0 in eval). `drop` is flash-attention's: an nn.Dropout(dropout_p), or
    None at dropout_p=0 (code reads `norm.drop.p`, or sets it). Its state_dict is
    flash-attention's: `weight` (zeros with zero_centered_weight, else ones), no bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dropout_p: float = 0.0,
                 zero_centered_weight: bool = False, device=None, dtype=None):
        super().__init__()
        check_flag("zero_centered_weight", zero_centered_weight)
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p must be a probability in [0, 1), got {dropout_p!r}")
        self.eps, self.zero_centered_weight = eps, zero_centered_weight
        self.drop = nn.Dropout(float(dropout_p)) if dropout_p > 0.0 else None
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        (nn.init.zeros_ if self.zero_centered_weight else nn.init.ones_)(self.weight)

    def forward(self, x: Tensor, residual: Tensor | None = None, prenorm: bool = False,
                residual_in_fp32: bool = False):
        return rms_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps,
                           dropout_p=self.dropout_p if self.training else 0.0, prenorm=prenorm,
                           residual_in_fp32=residual_in_fp32, zero_centered_weight=self.zero_centered_weight)

    @property
    def dropout_p(self) -> float:
        """The dropout probability: `drop.p`, 0 with no `drop`."""
        return 0.0 if self.drop is None else float(self.drop.p)

    def extra_repr(self) -> str:  # dropout_p shows as the `drop` child's p
        return f"{self.weight.shape[0]}, eps={self.eps}" + (
            ", zero_centered_weight=True" if self.zero_centered_weight else "")
