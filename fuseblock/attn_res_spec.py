"""The resolved description of one attention-residual call (`fuseblock.attn_res_norm`).

A token holds S source states v_j (d,): the finished blocks' states and, at a block
boundary, the running partial block updated by the branch output (partial' = partial +
branch, the last source). With a learned query q (d,) and the next sublayer's norm weight w:

    r_j = rsqrt(mean(v_j^2) + key_eps),  k_j = r_j v_j          (unweighted RMS keys)
    s_j = scale (q . k_j),  a = softmax_j(s)
    mixed = sum_j a_j u_j,  u_j = k_j (normed_values) or v_j     (rounded to the sources' dtype)
    y = mixed rsqrt(mean(mixed^2) + eps) w

`form` picks the torch path's order of operations, as HyperSpec's does: FUSED
(fuseblock's own: the scores a matrix-vector product, the mix a weighted sum) or
INKLING2 (transformers' Inkling2BlockAttentionResidual: eager attention of one query
over the S keys, two batched matmuls), so that path reproduces that modeling code bit
for bit; the math, and the kernels' order, are the same in both.
Like HyperSpec, the spec crosses the custom-op boundary packed as floats.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from enum import IntEnum

MAX_SOURCES = 16


class Form(IntEnum):
    """Whose order of operations the torch path follows (the kernels: FUSED's)."""

    FUSED = 0
    INKLING2 = 1


FORMS = {"fused": Form.FUSED, "inkling2": Form.INKLING2}


@dataclass(frozen=True)
class AttnResSpec:
    s: int  # sources mixed, the partial' included
    d: int
    update: bool  # a branch is added: partial' = partial + branch (or branch alone), the last source
    has_partial: bool  # the update adds to a running partial block (False: the block's first sublayer)
    normed_values: bool  # mix the keys k_j (inkling2_loop) rather than the states v_j (Kimi)
    scale: float
    key_eps: float
    eps: float
    form: Form = Form.FUSED

    @property
    def bank(self) -> int:
        """Sources read from the bank tensor (the partial' is not in it)."""
        return self.s - 1 if self.update else self.s

    def pack(self) -> list[float]:
        # .value: torch.compile traces this, and float() of an IntEnum member recurses in Dynamo
        return [float(v.value if isinstance(v, IntEnum) else v) for v in (getattr(self, f) for f in _NAMES)]

    @classmethod
    def unpack(cls, values: list[float]) -> AttnResSpec:
        return _unpack(tuple(values))


_NAMES = tuple(f.name for f in fields(AttnResSpec))


@functools.lru_cache(maxsize=256)
def _unpack(v: tuple[float, ...]) -> AttnResSpec:
    s, d, update, has_partial, normed_values, scale, key_eps, eps, form = v
    return AttnResSpec(int(s), int(d), bool(update), bool(has_partial), bool(normed_values), scale, key_eps, eps,
                       Form(int(form)))
