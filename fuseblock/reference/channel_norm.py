"""The torch path of batch norm (fuseblock.ops.channel_norm): the core layer norm of the
transposed batch, and the running statistics' update that both paths share."""
from __future__ import annotations

import torch
from torch import Tensor

from ..spec import Act, Gate, NormSpec, acc_dtype
from .norm import norm_fwd


def _dense(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t in dtype and contiguous, in one copy (`to` alone keeps the strides, and
    returns t itself, strides and all, when the dtype already matches)."""
    return t.to(dtype, memory_format=torch.contiguous_format).contiguous()


def update_running(running_mean, running_var, mean, rstd, momentum, eps, rows):
    """r = (1 - momentum) r + momentum s from the batch statistics, the variance unbiased."""
    with torch.no_grad():
        # biased variance back from rstd = 1/sqrt(var + eps); clamp the rounding at 0
        var = (rstd.view(-1).reciprocal().square() - eps).clamp_min(0)
        running_mean.mul_(1 - momentum).add_(mean.view(-1) * momentum)
        running_var.mul_(1 - momentum).add_(var * (momentum * rows / (rows - 1)))


def batch_norm_fwd(x, running_mean, running_var, weight, bias, momentum, eps):
    """Training-mode batch norm on the torch path: the core layer norm of the transposed batch."""
    n_ch = x.shape[1]
    rows = x.numel() // n_ch
    # (N, C, *) -> (C, N, *) in fp32, one copy; then each channel is one contiguous row
    xt = _dense(x.transpose(0, 1), acc_dtype(x.dtype))
    # the core layer norm (scale c/sqrt(d) = 1, no gate, one group, no residual), with
    # the row statistics
    spec = NormSpec(center=True, scale=1.0, eps=eps, gate=Gate.NONE, act=Act.UNUSED, groups=1)
    out, _, rstd, mean = norm_fwd(xt.view(n_ch, rows), None, None, None, None, spec, None, True)
    if running_mean is not None:
        update_running(running_mean, running_var, mean, rstd, momentum, eps, rows)
    y = out.view(xt.shape)  # (C, N, *)
    t_shape = (n_ch,) + (1,) * (x.dim() - 1)
    if weight is not None:
        y = y * weight.view(t_shape)
    if bias is not None:
        y = y + bias.view(t_shape)
    return _dense(y.transpose(0, 1), x.dtype)
