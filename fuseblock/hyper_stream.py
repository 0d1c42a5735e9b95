"""The fused residual stream on n streams: hyper-connections (mHC), docs/stream.md ("n streams").

A token carries n residual streams H (n, d). The naive layer (DeepSeek-V4's order) forms
its coefficients from the streams it is given, then runs its sublayer and updates them:

    (pre_k, post_k, comb_k) = C_k(H_{k-1}),  f_k = mixer_k(N_k(sum_i pre_k,i H_{k-1},i))
    H_k = post_k (x) f_k + comb_k^T H_{k-1};   o = N_f(sum_i pre_f,i H_n,i)  (pre_f = C_f(H_n))

The fused stack carries (f_k, H_{k-1}, post_k, comb_k) one boundary late, so block k+1's
launch (`fuseblock.hc_add_norm`) does block k's update and its own coefficients, collapse
and norm, reading the streams once; block 1 has no update (`hc_norm`) and the head takes
the last update in with it (`hc_head`): L + 1 launches for L sublayers, as the plain stack.
Both forms compute H_k, f_k and o from the same parameters (the same math, op for op up
to the order of the sums), so one state_dict serves both.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .hyper_spec import HyperSpec, Mode
from .ops.checks import check_eps, check_int, check_number
from .ops.hyper import MAX_STREAMS, hc_add_norm, hc_head, hc_norm
from .reference.hyper import coefficients
from .stream import ResidualStack, check_mixer_output, keywords_accepted, route_keywords, split_output


def naive_coefficients(H: Tensor, fn: Tensor, base: Tensor, scale: Tensor, n: int, iters: int, hc_eps: float,
                       eps: float, post_mult: float):
    """(pre, post, comb) from the streams H (..., n, d): the torch path's coefficients
    (`fuseblock.reference.hyper.coefficients`, the fused form's order), fp32 (fp64 for fp64
    streams); post and comb None for the head (fn of n rows)."""
    mode = Mode.HEAD if fn.shape[0] == n else Mode.PRE_POST_COMB
    spec = HyperSpec(n, H.shape[-1], mode, update=False, comb_in=False, iters=iters, hc_eps=hc_eps, eps=eps,
                     post_mult=post_mult, post_eps=0.0)
    return coefficients(H, fn, base, scale, spec)


def naive_collapse_norm(H: Tensor, pre: Tensor, weight: Tensor, eps: float) -> Tensor:
    """N_w(sum_i pre_i H_i): the collapse in pre's dtype, rounded to H's, then torch's rms_norm."""
    z = (pre.unsqueeze(-1) * H).sum(-2).to(H.dtype)
    return F.rms_norm(z, (z.shape[-1],), weight, eps)


class _HyperParameters(nn.Module):
    """fn (m, n*d), base (m,), scale, the norm's weight (d,): one boundary's parameters,
    initialised as DeepSeek-V4's (fn ~ N(0, init_std), base 0, scale 1, weight 1)."""

    def __init__(self, dim: int, n: int, m: int, scales: int, init_std: float):
        super().__init__()
        self.n, self.init_std = n, init_std
        self.fn = nn.Parameter(torch.empty(m, n * dim))
        self.base = nn.Parameter(torch.empty(m))
        self.scale = nn.Parameter(torch.empty(scales))
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.fn, 0.0, self.init_std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)
        nn.init.ones_(self.weight)


class HyperBlock(_HyperParameters):
    """One sublayer on n streams: `forward(streams, branch=None, post=None, comb=None,
    **kwargs) -> (out, streams', post', comb', *rest)`.

    With branch (the previous block's output) and its post and comb, streams' = post (x)
    branch + comb^T streams; then this block's coefficients (post', comb') and input
    y = N_w(sum_i pre_i streams'_i) in one `hc_add_norm` launch (`hc_norm` without a branch),
    and out = mixer(y, **kwargs). A mixer returning `(out, *rest)` gives rest after comb'.
    `naive(streams, **kwargs) -> (new streams, rest)` is the unfused layer, same parameters.
    """

    def __init__(self, mixer: nn.Module, dim: int, n: int, *, iters: int, hc_eps: float, eps: float,
                 init_std: float = 0.02):
        if not isinstance(mixer, nn.Module):
            raise TypeError(f"mixer must be an nn.Module, got {type(mixer).__name__}")
        super().__init__(dim, n, 2 * n + n * n, 3, init_std)
        self.mixer = mixer
        self.iters, self.hc_eps, self.eps = iters, hc_eps, eps
        self._keywords_cache = (None, None)

    def keywords(self) -> frozenset[str] | None:
        """The keywords mixer.forward accepts (None: all), read once per mixer."""
        if self._keywords_cache[0] is not self.mixer:
            self._keywords_cache = (self.mixer, keywords_accepted(self.mixer, 1))
        return self._keywords_cache[1]

    def forward(self, streams: Tensor, branch: Tensor | None = None, post: Tensor | None = None,
                comb: Tensor | None = None, **kwargs) -> tuple:
        opts = dict(iters=self.iters, hc_eps=self.hc_eps, eps=self.eps)
        if branch is None:
            y, post, comb = hc_norm(streams, self.fn, self.base, self.scale, self.weight, **opts)
        else:
            # a mixer under autocast returns a narrower dtype than the streams keep
            y, streams, post, comb = hc_add_norm(streams, branch.to(streams.dtype), post, comb, self.fn, self.base,
                                                 self.scale, self.weight, **opts)
        out, rest = split_output(self.mixer(y, **kwargs))
        return (out, streams, post, comb, *rest)

    def naive(self, streams: Tensor, **kwargs) -> tuple[Tensor, tuple]:
        pre, post, comb = naive_coefficients(streams, self.fn, self.base, self.scale, self.n, self.iters,
                                             self.hc_eps, self.eps, 2.0)
        out, rest = split_output(self.mixer(naive_collapse_norm(streams, pre, self.weight, self.eps), **kwargs))
        if isinstance(out, Tensor) and out.shape == streams.shape[:-2] + streams.shape[-1:]:
            acc = post.dtype
            mixed = torch.matmul(comb.transpose(-1, -2), streams.to(acc))
            streams = (post.unsqueeze(-1) * out.to(acc).unsqueeze(-2) + mixed).to(streams.dtype)
        return streams, (out, *rest)


class HyperHead(_HyperParameters):
    """The head: pre = C_f(H) (fn of n rows), o = N_w(sum_i pre_i H_i), the last block's
    update fused in (`hc_head`)."""

    def __init__(self, dim: int, n: int, *, hc_eps: float, eps: float, init_std: float = 0.02):
        super().__init__(dim, n, n, 1, init_std)
        self.hc_eps, self.eps = hc_eps, eps

    def forward(self, streams: Tensor, branch: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        return hc_head(streams, self.fn, self.base, self.scale, self.weight, branch=branch.to(streams.dtype),
                       post=post, comb=comb,
                       hc_eps=self.hc_eps, eps=self.eps)[0]

    def naive(self, streams: Tensor) -> Tensor:
        pre, _, _ = naive_coefficients(streams, self.fn, self.base, self.scale, self.n, 1, self.hc_eps, self.eps, 1.0)
        return naive_collapse_norm(streams, pre, self.weight, self.eps)


class HyperConnectionStack(nn.Module):
    """Sublayers on n residual streams (mHC, DeepSeek-V4's form with Sinkhorn), then the head.

    `forward(x, **kwargs) -> Tensor` of x's shape and dtype (or `(Tensor, extras)` with
    return_extras=True, as ResidualStack). x (..., dim) enters as n copies (H_0 = x on every
    stream); each mixer maps (..., dim) to (..., dim) and gets the keyword arguments its
    forward accepts (a keyword none accepts: TypeError). `fused=False` runs the naive form
    with the same parameters and state_dict keys. `.blocks[k]` is a HyperBlock (`.mixer`,
    `.fn` (2n + n^2, n*dim), `.base`, `.scale` (3,), `.weight` (dim,)), `.head` a HyperHead
    (fn (n, n*dim), base (n,), scale (1,), weight). iters: Sinkhorn passes; hc_eps: the
    coefficients' epsilon; eps: the rms norms' (of flat(H) and of the collapse). The norms
    are RMS norms, as in every mHC family.
    """

    def __init__(self, mixers: Iterable[nn.Module], dim: int, *, streams: int = 4, iters: int = 20,
                 hc_eps: float = 1e-6, eps: float = 1e-6, fused: bool = True, return_extras: bool = False,
                 init_std: float = 0.02):
        super().__init__()
        mixers = ResidualStack.modules_of("mixers", mixers)
        if not mixers:
            raise ValueError("mixers must hold at least one nn.Module (one per sublayer), got none")
        check_int("dim", dim)
        check_int("streams", streams)
        if streams > MAX_STREAMS:
            raise ValueError(f"streams must be in 1..{MAX_STREAMS}, got {streams}")
        check_int("iters", iters)
        check_number("hc_eps", hc_eps)
        if not 0.0 <= hc_eps < float("inf"):
            raise ValueError(f"hc_eps must be a finite number >= 0, got {hc_eps}")
        check_eps(eps)
        check_number("init_std", init_std)
        for name, flag in (("fused", fused), ("return_extras", return_extras)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        opts = dict(hc_eps=float(hc_eps), eps=float(eps), init_std=float(init_std))
        self.blocks = nn.ModuleList(HyperBlock(m, dim, streams, iters=iters, **opts) for m in mixers)
        self.head = HyperHead(dim, streams, **opts)
        self.streams, self.fused, self.return_extras = streams, fused, return_extras

    def forward(self, x: Tensor, **kwargs):
        routed = self._route(kwargs)
        H = x.unsqueeze(-2).expand(*x.shape[:-1], self.streams, x.shape[-1]).contiguous()
        out, extras = self._fused(x, H, routed) if self.fused else self._naive(x, H, routed)
        return (out, extras) if self.return_extras else out

    def _route(self, kwargs: dict) -> list[dict]:
        return route_keywords(kwargs, self.blocks, lambda block: block.keywords(), "HyperConnectionStack")

    def _fused(self, x: Tensor, H: Tensor, routed: list[dict]) -> tuple[Tensor, tuple]:
        f = post = comb = None
        extras = []
        for i, (block, kwargs) in enumerate(zip(self.blocks, routed, strict=True)):
            # through the block's __call__, so its hooks run (FSDP2's gathering among them)
            f, H, post, comb, *rest = block(H, f, post, comb, **kwargs)
            check_mixer_output(i, self.blocks[i].mixer, f, x)
            extras.append(tuple(rest))
        return self.head(H, f, post, comb).to(x.dtype), tuple(extras)

    def _naive(self, x: Tensor, H: Tensor, routed: list[dict]) -> tuple[Tensor, tuple]:
        extras = []
        for i, (block, kwargs) in enumerate(zip(self.blocks, routed, strict=True)):
            H, (out, *rest) = block.naive(H, **kwargs)
            check_mixer_output(i, self.blocks[i].mixer, out, x)
            extras.append(tuple(rest))
        return self.head.naive(H).to(x.dtype), tuple(extras)

    def extra_repr(self) -> str:
        return f"streams={self.streams}, fused={self.fused}" + (", return_extras=True" if self.return_extras else "")
