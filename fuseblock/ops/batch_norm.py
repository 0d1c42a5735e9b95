"""Channel norms of (N, C, *) inputs, built on the core op's row kernels.

- `batch_norm`: "layer norm is the transpose of batch norm" (docs/family.md). Training mode
  views the batch as C rows of N*L values, x -> (C, N*L), and runs the core layer norm
  (forward and backward kernels, kind="layer", no affine) on those rows. Its per-row
  statistics are the per-channel batch statistics that update the running buffers.
- `group_norm`, `instance_norm`: no transpose needed. Each sample (C*L values) is one
  row split into num_groups contiguous groups, so group norm is the core op with
  num_groups, and instance norm is group norm with one group per channel. The
  per-channel weight becomes a per-column one by repeating it L times, so the affine
  stays fused in the kernel.

Why batch norm reuses the row kernels rather than a column kernel of its own: it
shares the forward, the backward (docs/family.md: its formula is the core op's layer-norm
backward) and their tests. The cost: two transposing copies (in, as fp32, and out),
the per-channel affine as separate elementwise torch ops (it is per row in the
transposed view, so it cannot be the core op's per-column weight), and few rows: the
row kernels parallelize over rows, so C channels of N*L values use about C programs.
A split-reduction column kernel would avoid all three on a GPU, with the same results.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..spec import Act, Gate, NormSpec, acc_dtype
from .checks import check_eps, check_int, check_number, check_tensor
from .norm import apply_norm, norm


def _check_input(x, what: str, min_dim: int) -> tuple[int, int, int]:
    """(N, C, L) of an (N, C, *) input, L the product of the trailing dims."""
    check_tensor("x", x)
    if x.dim() < min_dim:
        raise ValueError(f"x must be {what}, got shape {tuple(x.shape)}")
    n, n_ch = x.shape[0], x.shape[1]
    length = math.prod(x.shape[2:])
    if n_ch < 1 or length < 1:
        raise ValueError(f"x must have at least one channel and one value per channel, got shape {tuple(x.shape)}")
    return n, n_ch, length


def _check_channel_vectors(x: Tensor, n_ch: int, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None:
            check_tensor(name, t, x)
            if tuple(t.shape) != (n_ch,):
                raise ValueError(f"{name} must have shape ({n_ch},) (one value per channel of x), got {tuple(t.shape)}")


def check_momentum(momentum, *, allow_none: bool = False) -> None:
    if momentum is None and allow_none:
        return
    check_number("momentum", momentum)
    if not 0 <= momentum <= 1:
        raise ValueError(f"momentum must be in [0, 1], got {momentum}")


def _dense(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t in dtype and contiguous, in one copy (`to` alone keeps the strides, and
    returns t itself, strides and all, when the dtype already matches)."""
    return t.to(dtype, memory_format=torch.contiguous_format).contiguous()


def batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """torch.nn.functional.batch_norm for (N, C) and (N, C, L) inputs (any (N, C, *)).

    Training: normalize each channel by its batch mean and biased variance, and, when
    running buffers are given, update them in place: r = (1 - momentum) * r + momentum * s,
    with the unbiased variance for running_var. Eval: normalize by the running stats.
    Math in fp32 (fp64 for fp64 x), one rounding to x's dtype.
    """
    n, n_ch, length = _check_input(x, "(N, C) or (N, C, L)", 2)
    _check_channel_vectors(x, n_ch, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias)
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool, got {type(training).__name__}")
    check_momentum(momentum)
    check_eps(eps)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must be given together (or both None)")
    affine_shape = (n_ch,) + (1,) * (x.dim() - 2)  # broadcasts a channel vector over (N, C, *)

    if not training:
        if running_mean is None:
            raise ValueError("running_mean and running_var are required when training=False")
        # y = x * s + t with s = w / sqrt(var + eps), t = b - mean * s: elementwise, no reduction
        s = torch.rsqrt(running_var.to(acc_dtype(x.dtype)) + eps)
        if weight is not None:
            s = s * weight
        t = -running_mean * s if bias is None else bias - running_mean * s
        return torch.addcmul(t.view(affine_shape), x.to(s.dtype), s.view(affine_shape)).to(x.dtype)

    rows = n * length
    if rows < 2:
        raise ValueError(f"x: expected more than 1 value per channel when training, got shape {tuple(x.shape)}")
    # (N, C, *) -> (C, N, *) in fp32, one copy; then each channel is one contiguous row
    xt = _dense(x.transpose(0, 1), acc_dtype(x.dtype))
    # the core layer norm (scale c/sqrt(d) = 1, no gate, one group, no residual), with
    # the row statistics
    spec = NormSpec(center=True, scale=1.0, eps=float(eps), gate=Gate.NONE, act=Act.UNUSED, groups=1)
    out, _, rstd, mean = apply_norm(xt.view(n_ch, rows), None, None, None, None, spec, None, True)
    if running_mean is not None:
        with torch.no_grad():
            # biased variance back from rstd = 1/sqrt(var + eps); clamp the rounding at 0
            var = (rstd.view(n_ch).reciprocal().square() - eps).clamp_min(0)
            running_mean.mul_(1 - momentum).add_(mean.view(n_ch) * momentum)
            running_var.mul_(1 - momentum).add_(var * (momentum * rows / (rows - 1)))
    y = out.view(xt.shape)  # (C, N, *)
    t_shape = (n_ch,) + (1,) * (x.dim() - 1)
    if weight is not None:
        y = y * weight.view(t_shape)
    if bias is not None:
        y = y + bias.view(t_shape)
    return _dense(y.transpose(0, 1), x.dtype)


def group_norm(
    x: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5
) -> Tensor:
    """torch.nn.functional.group_norm for (N, C, *) inputs: the core layer norm of each
    sample's C*L values in num_groups groups of whole channels."""
    n, n_ch, length = _check_input(x, "(N, C) or (N, C, *)", 2)
    _check_channel_vectors(x, n_ch, weight=weight, bias=bias)
    check_int("num_groups", num_groups)
    if n_ch % num_groups:
        raise ValueError(f"num_groups must be >= 1 and divide the channel count {n_ch}, got {num_groups}")
    check_eps(eps)
    if length > 1:  # per channel -> per column of the flattened sample
        weight = None if weight is None else weight.repeat_interleave(length)
        bias = None if bias is None else bias.repeat_interleave(length)
    out = norm(x.reshape(n, n_ch * length), weight, bias, kind="layer", eps=eps, num_groups=int(num_groups))
    return out.view(x.shape)


def instance_norm(
    x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5
) -> Tensor:
    """torch.nn.functional.instance_norm (no running stats) for (N, C, L) inputs (any (N, C, *)):
    group norm with one group per channel."""
    _, n_ch, length = _check_input(x, "(N, C, L)", 3)
    if length < 2:
        raise ValueError(f"x: expected more than 1 value per instance (N, C), got shape {tuple(x.shape)}")
    return group_norm(x, n_ch, weight, bias, eps)
