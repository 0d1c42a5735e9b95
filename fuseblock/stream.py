"""The fused pre-norm residual stream (seed 001, "Fusing Normalize and Residual").

Naive pre-norm stack:  x_k = f_k(norm(x_{k-1})) + x_{k-1},  o = x_n.
Fused stack, carrying (p_k, r_k):

    p_0 = x, r_0 = 0
    r_k = p_{k-1} + r_{k-1}      } one add_norm launch per sublayer
    q_k = norm(r_k)              }
    p_k = f_k(q_k)
    o   = p_n + r_n              (or norm(p_n + r_n): one more add_norm)

By induction r_k = x_{k-1}: r_1 = x + 0 = x_0, and if r_k = x_{k-1} then
r_{k+1} = p_k + r_k = f_k(norm(x_{k-1})) + x_{k-1} = x_k. Hence q_k is the naive
norm input's image, p_k = z_k, and o = p_n + r_n = z_n + x_{n-1} = x_n.
Backward: add_norm returns (out, new_residual); the gradient arriving at r_k (from
later sublayers) adds into the gradient of both inputs p_{k-1} and r_{k-1}, which is
the seeds' dx = dx + dr, done inside the backward kernel.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import Tensor, nn

from .modules import AddNorm, Norm
from .ops.norm import add_norm


class PreNormBlock(nn.Module):
    """One pre-norm sublayer: `forward(hidden, residual=None) -> (hidden, residual)`.

    Computes residual' = hidden + residual, hidden' = mixer(norm(residual')) with one
    fused add_norm. `mixer` is any module mapping (..., dim) to (..., dim).
    """

    def __init__(
        self,
        mixer: nn.Module,
        dim: int,
        *,
        kind: str = "rms",
        eps: float = 1e-6,
        residual_dtype: Optional[torch.dtype] = None,
        bias: bool = False,
    ):
        super().__init__()
        if not isinstance(mixer, nn.Module):
            raise TypeError(f"mixer must be an nn.Module, got {type(mixer).__name__}")
        self.mixer = mixer
        self.norm = Norm(dim, kind=kind, eps=eps, bias=bias)
        self.residual_dtype = residual_dtype

    def forward(self, hidden: Tensor, residual: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        n = self.norm
        normed, residual = add_norm(
            hidden, residual, n.weight, n.bias, kind=n.kind, c=n.c, eps=n.eps, residual_dtype=self.residual_dtype
        )
        return self.mixer(normed), residual

    def naive(self, x: Tensor, act_dtype: Optional[torch.dtype] = None) -> Tensor:
        """The unfused step x + mixer(norm(x)) with the same parameters; the mixer sees
        act_dtype (default x's), as it would in the fused form under an fp32 stream."""
        return x + self.mixer(self.norm.naive(x).to(act_dtype or x.dtype))


class ResidualStack(nn.Module):
    """A stack of PreNormBlocks over one residual stream, fused or naive.

    `fused=False` runs the naive form with the same parameters and state_dict keys, so
    one checkpoint serves both. The output has the input's dtype.
    """

    def __init__(
        self,
        mixers: Iterable[nn.Module],
        dim: int,
        *,
        kind: str = "rms",
        eps: float = 1e-6,
        final_norm: bool = True,
        fused: bool = True,
        residual_dtype: Optional[torch.dtype] = None,
        bias: bool = False,
    ):
        super().__init__()
        self.blocks = nn.ModuleList(
            PreNormBlock(m, dim, kind=kind, eps=eps, residual_dtype=residual_dtype, bias=bias) for m in mixers
        )
        self.norm_f = AddNorm(dim, kind=kind, eps=eps, bias=bias, residual_dtype=residual_dtype) if final_norm else None
        self.fused = bool(fused)
        self.residual_dtype = residual_dtype

    def forward(self, x: Tensor) -> Tensor:
        return self._fused(x) if self.fused else self._naive(x)

    def _fused(self, x: Tensor) -> Tensor:
        hidden, residual = x, None
        for block in self.blocks:
            hidden, residual = block(hidden, residual)
        if self.norm_f is not None:
            return self.norm_f(hidden, residual)[0]
        return hidden if residual is None else (hidden + residual).to(x.dtype)

    def _naive(self, x: Tensor) -> Tensor:
        h = x if self.residual_dtype is None else x.to(self.residual_dtype)
        for block in self.blocks:
            h = block.naive(h, x.dtype)
        if self.norm_f is not None:
            h = self.norm_f.naive(h)
        return h.to(x.dtype)
