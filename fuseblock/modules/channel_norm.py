"""The channel norms as modules: `BatchNorm` and `InstanceNorm` (the functions: fuseblock.ops.channel_norm).

Parameter and buffer names follow nn.BatchNorm1d / nn.InstanceNorm1d (weight, bias,
running_mean, running_var, num_batches_tracked), so state_dicts load both ways.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.channel_norm import batch_norm, check_momentum, instance_norm
from ..ops.checks import check_eps, check_flag, check_float_dtype, check_int

__all__ = ["BatchNorm", "InstanceNorm"]


def _check_config(num_features, eps) -> None:
    check_int("num_features", num_features)
    check_eps(eps)


def _check_channels(x, num_features: int) -> None:
    """(N, C) or (N, C, L), as nn.BatchNorm1d and nn.InstanceNorm1d take (the functions take any (N, C, *))."""
    if isinstance(x, Tensor) and (x.dim() not in (2, 3) or x.shape[1] != num_features):
        raise ValueError(f"x must be (N, {num_features}) or (N, {num_features}, L), got shape {tuple(x.shape)}")


def _reset_affine(module: nn.Module) -> None:
    if module.weight is not None:
        nn.init.ones_(module.weight)
    if module.bias is not None:
        nn.init.zeros_(module.bias)


class BatchNorm(nn.Module):
    """Batch norm over (N, C) or (N, C, L), like nn.BatchNorm1d (see fuseblock.batch_norm).

    momentum=None uses the cumulative average of all batches seen, as nn.BatchNorm1d does.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        _check_config(num_features, eps)
        check_momentum(momentum, allow_none=True)
        check_flag("affine", affine)
        check_flag("track_running_stats", track_running_stats)
        check_float_dtype("dtype", dtype)
        self.num_features, self.eps, self.momentum = int(num_features), float(eps), momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        factory = dict(device=device, dtype=dtype)
        if affine:
            self.weight = nn.Parameter(torch.empty(num_features, **factory))
            self.bias = nn.Parameter(torch.empty(num_features, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", torch.empty(num_features, **factory))
            self.register_buffer("running_var", torch.empty(num_features, **factory))
            self.register_buffer("num_batches_tracked", torch.empty((), dtype=torch.long, device=device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        """Running stats (mean 0, var 1, no batches) and weight ones, bias zeros, as
        nn.BatchNorm1d's; called by __init__, and again after a meta-device build and `to_empty`."""
        self.reset_running_stats()
        _reset_affine(self)

    def forward(self, x: Tensor) -> Tensor:
        _check_channels(x, self.num_features)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        # batch statistics when training, or when there are no running ones to use
        use_batch = self.training or self.running_mean is None
        update = not self.training or self.track_running_stats
        return batch_norm(
            x,
            self.running_mean if update else None,
            self.running_var if update else None,
            self.weight,
            self.bias,
            use_batch,
            momentum,
            self.eps,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}"
        )


class InstanceNorm(nn.Module):
    """Instance norm over (N, C, L), like nn.InstanceNorm1d without running stats."""

    def __init__(self, num_features: int, eps: float = 1e-5, affine: bool = False, device=None, dtype=None):
        super().__init__()
        _check_config(num_features, eps)
        check_flag("affine", affine)
        check_float_dtype("dtype", dtype)
        self.num_features, self.eps, self.affine = int(num_features), float(eps), affine
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(num_features, **factory)) if affine else None
        self.bias = nn.Parameter(torch.empty(num_features, **factory)) if affine else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """weight ones, bias zeros; called by __init__, and again after a meta-device build and `to_empty`."""
        _reset_affine(self)

    def forward(self, x: Tensor) -> Tensor:
        _check_channels(x, self.num_features)
        return instance_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, affine={self.affine}"
