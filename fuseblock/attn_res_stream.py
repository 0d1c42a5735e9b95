"""The residual stream as attention residuals (Kimi's Block AttnRes), docs/stream.md
("Attention residuals").

Each sublayer's input is a learned softmax mix over the states of the earlier blocks,
not their running sum. The sublayers are grouped in blocks of `block_size`; b_0 = x (the
embedding) and b_n the sum of block n's sublayer outputs. Sublayer k of block n mixes
the finished blocks and its block's running partial sum p (absent at the block's first
sublayer, where the block just finished is the last source):

    sources_k = [b_0, ..., b_{n-1}] + [p]   (p = f_{k0} + ... + f_{k-1}, the block's outputs so far)
    y_k = N_{w_k}(sum_j a_j v_j),  a = softmax_j(q_k . rmsnorm(v_j)),  f_k = mixer_k(y_k)
    o = N_{w_f}(the same mix over every block, with the head's query)

The fused stack carries (f_{k-1}, p) one sublayer late, so sublayer k's launch
(`fuseblock.attn_res_add_norm`) does the add p' = p + f_{k-1}, the mix and the norm
reading each state once; sublayer 0 has no add (`attn_res_norm`). At a block's end p'
joins the bank of finished states (`torch.cat`: one copy of the bank per block, not per
sublayer). The naive form is Kimi's torch code (a stack of the states each sublayer),
with the same parameters, so one state_dict serves both.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attn_res_spec import MAX_SOURCES
from .ops.attn_res import attn_res_add_norm, attn_res_norm
from .ops.checks import check_eps, check_int, check_number
from .stream import ResidualStack, check_mixer_output, keywords_accepted, route_keywords, split_output


def head_states(sublayers: int, block_size: int) -> int:
    """The states the head mixes: the embedding and one per block, ceil(sublayers / block_size)."""
    return 1 + -(-sublayers // block_size)


def naive_attn_res(states: list[Tensor], query: Tensor, weight: Tensor, *, key_eps: float, eps: float) -> Tensor:
    """N_w(sum_j a_j v_j) in plain torch ops (Kimi's form): the states stacked, keys by rms_norm."""
    v = torch.stack(states, dim=-2)
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    k = F.rms_norm(v.to(acc), (v.shape[-1],), None, key_eps)
    a = torch.softmax(torch.einsum("...sd,d->...s", k, query.to(acc)), dim=-1)
    mixed = torch.einsum("...s,...sd->...d", a, v.to(acc)).to(v.dtype)
    return F.rms_norm(mixed, (mixed.shape[-1],), weight.to(mixed.dtype), eps)


class _Mix(nn.Module):
    """query (d,) and the norm's weight (d,): one mix's parameters, initialised as Kimi's
    (query 0: a uniform mix at the start; weight 1)."""

    def __init__(self, dim: int):
        super().__init__()
        self.query = nn.Parameter(torch.empty(dim))
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)
        nn.init.ones_(self.weight)


class AttnResBlock(_Mix):
    """One sublayer: `forward(bank, branch=None, partial=None, **kwargs) -> (out, partial', *rest)`.

    bank (..., S, d): the finished blocks' states; branch: the previous sublayer's output
    and partial the running sum it adds to (None at a block's first sublayer). y =
    N_w(mix) in one `attn_res_add_norm` launch (`attn_res_norm` without a branch, partial'
    then None) and out = mixer(y, **kwargs). A mixer returning `(out, *rest)` gives rest last.
    """

    def __init__(self, mixer: nn.Module, dim: int, *, key_eps: float, eps: float):
        if not isinstance(mixer, nn.Module):
            raise TypeError(f"mixer must be an nn.Module, got {type(mixer).__name__}")
        super().__init__(dim)
        self.mixer = mixer
        self.key_eps, self.eps = key_eps, eps
        self._keywords_cache = (None, None)

    def keywords(self) -> frozenset[str] | None:
        """The keywords mixer.forward accepts (None: all), read once per mixer."""
        if self._keywords_cache[0] is not self.mixer:
            self._keywords_cache = (self.mixer, keywords_accepted(self.mixer, 1))
        return self._keywords_cache[1]

    def forward(self, bank: Tensor, branch: Tensor | None = None, partial: Tensor | None = None, **kwargs) -> tuple:
        opts = dict(key_eps=self.key_eps, eps=self.eps)
        if branch is None:
            y, _ = attn_res_norm(bank, self.query, self.weight, **opts)
        else:  # a mixer under autocast returns a narrower dtype than the states keep
            y, _, partial = attn_res_add_norm(bank, branch.to(bank.dtype), partial, self.query, self.weight, **opts)
        out, rest = split_output(self.mixer(y, **kwargs))
        return (out, partial, *rest)

    def naive(self, states: list[Tensor], **kwargs) -> tuple[Tensor, tuple]:
        """(out, rest) of the mixer on the mix of `states` (the finished blocks and the partial)."""
        return split_output(self.mixer(naive_attn_res(states, self.query, self.weight, key_eps=self.key_eps,
                                                      eps=self.eps), **kwargs))


class AttnResHead(_Mix):
    """The head: o = N_w(mix over every block), the last sublayer's add fused in."""

    def __init__(self, dim: int, *, key_eps: float, eps: float):
        super().__init__(dim)
        self.key_eps, self.eps = key_eps, eps

    def forward(self, bank: Tensor, branch: Tensor, partial: Tensor | None) -> Tensor:
        return attn_res_add_norm(bank, branch.to(bank.dtype), partial, self.query, self.weight, key_eps=self.key_eps,
                                 eps=self.eps)[0]

    def naive(self, states: list[Tensor]) -> Tensor:
        return naive_attn_res(states, self.query, self.weight, key_eps=self.key_eps, eps=self.eps)


class AttnResStack(nn.Module):
    """Sublayers whose inputs are attention residuals over blocks of `block_size` sublayers, then the head.

    `forward(x, **kwargs) -> Tensor` of x's shape and dtype (or `(Tensor, extras)` with
    return_extras=True, as ResidualStack). Each mixer maps (..., dim) to (..., dim) and
    gets the keyword arguments its forward accepts (a keyword none accepts: TypeError).
    `fused=False` runs the naive form with the same parameters and state_dict keys.
    `.blocks[k]` is an AttnResBlock (`.mixer`, `.query` (dim,), `.weight` (dim,)),
    `.head` an AttnResHead (the final norm). The head mixes 1 + ceil(L / block_size)
    states (L sublayers): at most 16.
    """

    def __init__(self, mixers: Iterable[nn.Module], dim: int, *, block_size: int, key_eps: float = 1e-6,
                 eps: float = 1e-6, fused: bool = True, return_extras: bool = False):
        super().__init__()
        mixers = ResidualStack.modules_of("mixers", mixers)
        if not mixers:
            raise ValueError("mixers must hold at least one nn.Module (one per sublayer), got none")
        check_int("dim", dim)
        check_int("block_size", block_size)
        states = head_states(len(mixers), block_size)
        if states > MAX_SOURCES:
            raise ValueError(f"block_size {block_size} for {len(mixers)} sublayers makes {states} states for the "
                             f"head to mix, more than {MAX_SOURCES}: use block_size >= "
                             f"{-(-len(mixers) // (MAX_SOURCES - 1))}")
        check_number("key_eps", key_eps)
        if key_eps < 0:
            raise ValueError(f"key_eps must be >= 0, got {key_eps}")
        check_eps(eps)
        for name, flag in (("fused", fused), ("return_extras", return_extras)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        opts = dict(key_eps=float(key_eps), eps=float(eps))
        self.blocks = nn.ModuleList(AttnResBlock(m, dim, **opts) for m in mixers)
        self.head = AttnResHead(dim, **opts)
        self.block_size, self.fused, self.return_extras = block_size, fused, return_extras

    def forward(self, x: Tensor, **kwargs):
        routed = route_keywords(kwargs, self.blocks, lambda block: block.keywords(), "AttnResStack")
        out, extras = self._fused(x, routed) if self.fused else self._naive(x, routed)
        return (out, extras) if self.return_extras else out

    def _fused(self, x: Tensor, routed: list[dict]) -> tuple[Tensor, tuple]:
        bank, f, partial = x.unsqueeze(-2), None, None
        extras = []
        for i, (block, kwargs) in enumerate(zip(self.blocks, routed, strict=True)):
            # through the block's __call__, so its hooks run (FSDP2's gathering among them)
            f, partial, *rest = block(bank, f, partial, **kwargs)
            if partial is not None and i % self.block_size == 0:  # partial' finished block i // bs - 1
                bank, partial = torch.cat([bank, partial.unsqueeze(-2)], dim=-2), None
            check_mixer_output(i, self.blocks[i].mixer, f, x)
            extras.append(tuple(rest))
        return self.head(bank, f, partial).to(x.dtype), tuple(extras)

    def _naive(self, x: Tensor, routed: list[dict]) -> tuple[Tensor, tuple]:
        blocks, partial = [x], None
        extras = []
        for i, (block, kwargs) in enumerate(zip(self.blocks, routed, strict=True)):
            if i and i % self.block_size == 0:
                blocks, partial = [*blocks, partial], None
            out, rest = block.naive(blocks + ([partial] if partial is not None else []), **kwargs)
            check_mixer_output(i, self.blocks[i].mixer, out, x)
            partial = out.to(x.dtype) if partial is None else partial + out.to(x.dtype)
            extras.append(tuple(rest))
        return self.head.naive([*blocks, partial]).to(x.dtype), tuple(extras)

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, fused={self.fused}" + (", return_extras=True" if self.return_extras
                                                                      else "")
