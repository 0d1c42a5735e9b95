"""The fused pre-norm residual stream (docs/stream.md).

Naive pre-norm stack:  x_k = x_{k-1} + f_k(norm_k(x_{k-1})),  o = x_n  (or norm_f(x_n)).
Fused stack, carrying (p_k, r_k):

    p_0 = x, r_0 = 0
    r_k = p_{k-1} + r_{k-1}      } one add_norm launch per sublayer
    q_k = norm_k(r_k)            }
    p_k = f_k(q_k)
    o   = p_n + r_n              (or norm_f(p_n + r_n): one more add_norm)

Claim: r_k = x_{k-1} for k = 1..n+1. r_1 = x + 0 = x_0; if r_k = x_{k-1} then
p_k = f_k(norm_k(x_{k-1})) and r_{k+1} = p_k + r_k = x_k. So o = p_n + r_n = x_n.
Backward: r_k feeds both norm_k and r_{k+1}, so the gradient arriving at r_k from
later sublayers adds to the one through the norm, and the sum is the gradient of both
summands p_{k-1} and r_{k-1} (docs/stream.md: dx = dx + dr, done in the backward kernel).
docs/stream.md has the long form.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from .modules import AddNorm
from .ops.checks import check_float_dtype, check_int


def _first(out):
    """The new hidden state of a mixer's output: the first element of a tuple (Hugging Face
    attention returns (out, weights)), else the output itself."""
    return out[0] if isinstance(out, tuple) else out


class PreNormBlock(nn.Module):
    """One pre-norm sublayer: `forward(hidden, residual=None, *args, **kwargs) -> (hidden, residual)`.

    residual' = hidden + residual, hidden' = mixer(norm(residual'), *args, **kwargs), the
    add and the norm in one launch. `mixer` is any module mapping (..., dim) to (..., dim);
    the extra arguments (rotary embeddings, masks, caches, position ids) go to it
    unchanged. A mixer that returns a tuple `(out, *rest)` (Hugging Face attention returns
    (out, weights)) makes the block return `(out, residual, *rest)`: the first element is
    the new hidden state, the rest follow the residual untouched.

    `norm` is an AddNorm (a Norm): the residual is kept in residual_dtype, by default the
    dtype of torch's `hidden + residual`. kind, eps, bias and weight_offset are Norm's
    (bias=None: a bias for kind="layer" only; eps=None: torch's default for the residual's dtype).

    A mixer with `fuses_prenorm = True` is called as `mixer(hidden, residual, *args,
    prenorm=norm, **kwargs) -> (hidden', residual')` instead: it applies `norm` itself,
    fused into its first Linear (fuseblock.norm_linear), so the normed activations are not
    kept for backward. The call goes through the mixer's __call__, so its hooks (FSDP2's
    gathering of its parameters among them) run as for any call. The naive form still
    calls `mixer(norm(x))`.
    """

    def __init__(
        self,
        mixer: nn.Module,
        dim: int,
        *,
        kind: str = "rms",
        eps: float | None = 1e-6,
        residual_dtype: torch.dtype | None = None,
        bias: bool | None = None,
        weight_offset: float = 0.0,
    ):
        super().__init__()
        if not isinstance(mixer, nn.Module):
            raise TypeError(f"mixer must be an nn.Module, got {type(mixer).__name__}")
        check_int("dim", dim)
        self.mixer = mixer
        self.norm = AddNorm(dim, kind=kind, eps=eps, bias=bias, residual_dtype=residual_dtype,
                            weight_offset=weight_offset)

    @property
    def residual_dtype(self) -> torch.dtype | None:
        return self.norm.residual_dtype

    def forward(self, hidden: Tensor, residual: Tensor | None = None, *args, **kwargs) -> tuple:
        # A mixer whose first op is a Linear on the normed input may take the norm in
        # with it (fuseblock.norm_linear, docs/stream.md): it is handed the un-normed sum.
        if getattr(self.mixer, "fuses_prenorm", False):
            return self.mixer(hidden, residual, *args, prenorm=self.norm, **kwargs)
        normed, residual = self.norm(hidden, residual)
        out = self.mixer(normed, *args, **kwargs)
        if isinstance(out, tuple):
            return (out[0], residual, *out[1:])
        return out, residual

    def naive(self, x: Tensor, *args, **kwargs):
        """The unfused step x + mixer(norm(x), *args, **kwargs) with the same parameters:
        x's new value, or `(new x, *rest)` for a mixer that returns `(out, *rest)`."""
        out = self.mixer(self.norm.naive(x), *args, **kwargs)
        if isinstance(out, tuple):
            return (x + out[0], *out[1:])
        return x + out

    def _naive_step(self, x: Tensor, act_dtype: torch.dtype, kwargs: dict) -> Tensor:
        """The naive stack's step on a stream x that may be wider than the activations: the
        mixer sees act_dtype, as it does in the fused form."""
        return x + _first(self.mixer(self.norm.naive(x).to(act_dtype), **kwargs))


class ResidualStack(nn.Module):
    """Pre-norm sublayers over one residual stream, then an optional final norm.

    `forward(x, **kwargs) -> Tensor`, with x's dtype; the keyword arguments (masks, rotary
    embeddings, position ids) go to every mixer. Of a mixer that returns a tuple the stack
    keeps the first element, the new hidden state, and drops the rest (attention weights,
    caches): run the blocks in a loop of your own to keep them. `fused=False` runs the
    naive form with the same parameters and state_dict keys, so one checkpoint serves both;
    the flag may be flipped on a built stack. kind, eps, bias, weight_offset and
    residual_dtype go to every norm (see PreNormBlock).
    """

    def __init__(
        self,
        mixers: Iterable[nn.Module],
        dim: int,
        *,
        kind: str = "rms",
        eps: float | None = 1e-6,
        final_norm: bool = True,
        fused: bool = True,
        residual_dtype: torch.dtype | None = None,
        bias: bool | None = None,
        weight_offset: float = 0.0,
    ):
        super().__init__()
        # nn.ModuleList and nn.Sequential iterate over their sublayers; any other single
        # module is a mistake (it would silently become a stack of its children).
        if isinstance(mixers, nn.Module) and not isinstance(mixers, (nn.ModuleList, nn.Sequential)):
            raise TypeError(f"mixers must be an iterable of nn.Module (one per sublayer), got {type(mixers).__name__}")
        try:
            mixers = list(mixers)
        except TypeError:
            raise TypeError(f"mixers must be an iterable of nn.Module, got {type(mixers).__name__}") from None
        for i, m in enumerate(mixers):
            if not isinstance(m, nn.Module):
                raise TypeError(f"mixers[{i}] must be an nn.Module, got {type(m).__name__}")
        for name, flag in (("final_norm", final_norm), ("fused", fused)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        check_int("dim", dim)
        check_float_dtype("residual_dtype", residual_dtype)
        norm_kw = dict(kind=kind, eps=eps, bias=bias, residual_dtype=residual_dtype, weight_offset=weight_offset)
        self.blocks = nn.ModuleList(PreNormBlock(m, dim, **norm_kw) for m in mixers)
        self.norm_f = AddNorm(dim, **norm_kw) if final_norm else None
        self.fused = fused
        self.residual_dtype = residual_dtype

    def forward(self, x: Tensor, **kwargs) -> Tensor:
        return self._fused(x, kwargs) if self.fused else self._naive(x, kwargs)

    def _fused(self, x: Tensor, kwargs: dict) -> Tensor:
        hidden, residual = x, None
        for block in self.blocks:
            hidden, residual = block(hidden, residual, **kwargs)[:2]
        if self.norm_f is not None:  # o = norm_f(p_n + r_n), one more launch
            out = self.norm_f(hidden, residual)[0]
        else:
            out = hidden if residual is None else hidden + residual
        return out.to(x.dtype)

    def _naive(self, x: Tensor, kwargs: dict) -> Tensor:
        h = x if self.residual_dtype is None else x.to(self.residual_dtype)
        for block in self.blocks:
            h = block._naive_step(h, x.dtype, kwargs)
        if self.norm_f is not None:
            h = self.norm_f.naive(h)
        return h.to(x.dtype)

    def extra_repr(self) -> str:
        extra = "" if self.residual_dtype is None else f", residual_dtype={self.residual_dtype}"
        return f"fused={self.fused}" + extra
