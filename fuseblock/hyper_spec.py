"""The resolved description of one hyper-connection (mHC) boundary call.

A token carries n residual streams H (n, d). One boundary (docs/stream.md, "n streams"):

    H' = post (x) f + comb^T H            (comb None: H' = H + post (x) f)
    x = flat(H'),  rho = rsqrt(mean(x^2) + eps),  mix = rho * (fn . x)            (m = len(mix))
    pre  = sigmoid(mix[:n] * s0 + b[:n]) + hc_eps
    post' = post_mult * sigmoid(mix[n:2n] * s1 + b[n:2n]) + post_eps
    comb' = sinkhorn(softmax_rows(mix[2n:] * s2 + b[2n:]) + hc_eps, iters)
    y = N_w(sum_i pre_i H'_i)

m = 2n + n^2 (comb), 2n (no comb, HY-V4) or n (the head: pre only). `form` picks the
torch path's order of operations, so it reproduces one family's modeling code bit for
bit (FUSED: fuseblock's own, the order the kernels follow); the math is the same in all.
Like NormSpec, the spec crosses the custom-op boundary packed as floats.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from enum import IntEnum

import torch


class Form(IntEnum):
    """Whose order of operations the torch path follows (the kernels: FUSED's)."""

    FUSED = 0
    DEEPSEEK_V4 = 1
    HY_V4 = 2
    GLM5_NEXT = 3


FORMS = {"fused": Form.FUSED, "deepseek_v4": Form.DEEPSEEK_V4, "hy_v4": Form.HY_V4, "glm5_next": Form.GLM5_NEXT}


class Mode(IntEnum):
    """Which boundary: the sublayer coefficients out (pre, post, comb) or the head's pre only."""

    PRE_POST_COMB = 0  # m = 2n + n^2
    PRE_POST = 1  # m = 2n (HY-V4)
    HEAD = 2  # m = n: pre only; y is the model's last normalized hidden state
    MEAN_HEAD = 3  # no fn: pre = 1/n (GLM-5-next's head, an unweighted mean)


def coefficient_count(n: int, mode: Mode) -> int:
    """m, the rows of fn (0: no fn)."""
    return {Mode.PRE_POST_COMB: 2 * n + n * n, Mode.PRE_POST: 2 * n, Mode.HEAD: n, Mode.MEAN_HEAD: 0}[mode]


@dataclass(frozen=True)
class HyperSpec:
    n: int
    d: int
    mode: Mode
    update: bool  # a branch f is added: H' = post (x) f + comb^T H (else H' = H)
    comb_in: bool  # the update mixes the streams with comb (else H' = H + post (x) f)
    iters: int  # Sinkhorn passes (mode PRE_POST_COMB)
    hc_eps: float
    eps: float  # the rms of flat(H') and the norm N_w (the families hold one rms_norm_eps for both)
    post_mult: float  # DeepSeek-V4: 2; HY-V4: config.hc_magnitude
    post_eps: float  # HY-V4 adds hc_eps to post; DeepSeek-V4 and GLM-5-next add nothing
    form: Form = Form.FUSED

    @property
    def m(self) -> int:
        return coefficient_count(self.n, self.mode)

    @property
    def head(self) -> bool:
        return self.mode in (Mode.HEAD, Mode.MEAN_HEAD)

    def pack(self) -> list[float]:
        # .value: torch.compile traces this, and float() of an IntEnum member recurses in Dynamo
        return [float(v.value if isinstance(v, IntEnum) else v) for v in (getattr(self, f) for f in _NAMES)]

    @classmethod
    def unpack(cls, values: list[float]) -> HyperSpec:
        return _unpack(tuple(values))

    @property
    def weight_last(self) -> bool:
        """N_w rounds the normalized row to the streams' dtype, then multiplies the weight
        (Llama's `w * h.to(dtype)`: HY-V4, GLM-5-next); else one rounding of w h."""
        return self.form in (Form.HY_V4, Form.GLM5_NEXT)

    def y_dtype(self, streams: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
        """y's dtype, the same on both paths: the streams', or with `weight_last` the promotion
        of the streams' and the weight's, as the families' modeling code returns (an fp32
        weight on bf16 streams: fp32)."""
        if self.weight_last and weight is not None:
            return torch.promote_types(streams.dtype, weight.dtype)
        return streams.dtype


_NAMES = tuple(f.name for f in fields(HyperSpec))


@functools.lru_cache(maxsize=256)
def _unpack(v: tuple[float, ...]) -> HyperSpec:
    n, d, mode, update, comb_in, iters, hc_eps, eps, post_mult, post_eps, form = v
    return HyperSpec(int(n), int(d), Mode(int(mode)), bool(update), bool(comb_in), int(iters), hc_eps, eps,
                     post_mult, post_eps, Form(int(form)))
