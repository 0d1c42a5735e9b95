"""The pure-PyTorch path of the hyper-connection (mHC) boundary: plain differentiable torch ops.

Same contract as the Triton launchers in `fuseblock.kernels.hyper`; autograd differentiates
these ops (the backward the kernels implement is derived in docs/math.md). The math is in
`fuseblock.hyper_spec`. `spec.form` picks whose order of operations runs, so that a
family's decoder layer built on this path is bitwise equal to its modeling code in fp32:

- where the rms of flat(H') multiplies: before the projection (DeepSeek-V4, GLM-5-next:
  fn . (rho x)) or after it (HY-V4 and fuseblock's own: rho (fn . x));
- the update: in the streams' dtype with torch.matmul (DeepSeek-V4, GLM-5-next:
  post.to(dtype) f + comb.to(dtype)^T H, two roundings in bf16) or in fp32, rounded once
  (HY-V4, fuseblock's);
- the norm N_w: DeepSeek-V4 multiplies the weight in fp32 and rounds once, HY-V4 and
  GLM-5-next round the normalized row first and multiply after (Llama's order),
  fuseblock's is `fuseblock.norm`'s (torch's rms_norm);
- GLM-5-next's head is an unweighted mean of the streams (Mode.MEAN_HEAD).

Everything else is the same in all: fp32 coefficients (fp64 for fp64 streams), Sinkhorn
as softmax rows + hc_eps, one column pass, then (iters - 1) row and column passes, each
dividing by (sum + hc_eps); the collapse sum_i pre_i H'_i in fp32, rounded to the streams' dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..hyper_spec import Form, HyperSpec, Mode
from ..spec import NormSpec, acc_dtype
from . import norm as reference


def update(H: Tensor, f: Tensor, post: Tensor, comb: Tensor | None, spec: HyperSpec) -> Tensor:
    """H' = post (x) f + comb^T H (comb None: H + post (x) f), in H's dtype."""
    if spec.form in (Form.DEEPSEEK_V4, Form.GLM5_NEXT):
        mixed = H if comb is None else torch.matmul(comb.to(H.dtype).transpose(-1, -2), H)
        return post.to(H.dtype).unsqueeze(-1) * f.unsqueeze(-2) + mixed
    acc = acc_dtype(H.dtype)
    mixed = H.to(acc) if comb is None else torch.matmul(comb.to(acc).transpose(-1, -2), H.to(acc))
    return (post.to(acc).unsqueeze(-1) * f.to(acc).unsqueeze(-2) + mixed).to(H.dtype)


def sinkhorn(logits: Tensor, iters: int, hc_eps: float) -> Tensor:
    """softmax over rows + hc_eps, a column pass, then (iters - 1) row and column passes."""
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return comb


def coefficients(H: Tensor, fn: Tensor, base: Tensor, scale: Tensor, spec: HyperSpec):
    """(pre, post, comb) of the next sublayer from the streams H (..., n, d), in the
    accumulation dtype; post None for the head, comb None without it."""
    n, acc = spec.n, acc_dtype(H.dtype)
    flat = H.flatten(-2).to(acc)
    rho = torch.rsqrt(flat.square().mean(-1, keepdim=True) + spec.eps)
    if spec.form in (Form.DEEPSEEK_V4, Form.GLM5_NEXT):
        mix = F.linear(flat * rho, fn.to(acc))
    else:
        mix = F.linear(flat, fn.to(acc)) * rho
    base, scale = base.to(acc), scale.to(acc)
    if spec.head:
        return torch.sigmoid(mix * scale + base) + spec.hc_eps, None, None
    split = [n, n, n * n] if spec.mode == Mode.PRE_POST_COMB else [n, n]
    ws, bs, ss = mix.split(split, dim=-1), base.split(split), scale.unbind(0)
    pre = torch.sigmoid(ws[0] * ss[0] + bs[0]) + spec.hc_eps
    post = spec.post_mult * torch.sigmoid(ws[1] * ss[1] + bs[1])
    if spec.post_eps != 0.0:
        post = post + spec.post_eps
    if spec.mode != Mode.PRE_POST_COMB:
        return pre, post, None
    logits = ws[2].view(*ws[2].shape[:-1], n, n) * ss[2] + bs[2].view(n, n)
    return pre, post, sinkhorn(logits, spec.iters, spec.hc_eps)


def collapse(H: Tensor, pre: Tensor | None) -> Tensor:
    """sum_i pre_i H_i in the accumulation dtype, rounded to H's (pre None: the mean)."""
    if pre is None:
        return H.mean(dim=-2)
    return (pre.unsqueeze(-1) * H).sum(dim=-2).to(H.dtype)


def out_norm(z: Tensor, weight: Tensor | None, spec: HyperSpec) -> Tensor:
    """y = N_w(z), an RMS norm in the form's order."""
    if spec.form == Form.FUSED:
        nspec = NormSpec.of(spec.d, kind="rms", c=None, eps=spec.eps, num_groups=1, gate_act=None,
                            gate_position=None)
        return reference.norm_fwd(z, None, None, weight, None, nspec, None, False)[0]
    h = z.to(acc_dtype(z.dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + spec.eps)
    if weight is None:
        return h.to(z.dtype)
    if spec.form == Form.DEEPSEEK_V4:
        return (weight * h).to(z.dtype)
    return weight * h.to(z.dtype)


def hyper_fwd(streams: Tensor, branch: Tensor | None, post: Tensor | None, comb: Tensor | None, fn: Tensor | None,
              base: Tensor | None, scale: Tensor | None, weight: Tensor | None, spec: HyperSpec):
    """(y, new_streams, post_next, comb_next) of one boundary; new_streams is `streams`
    itself where there is no update, post_next and comb_next None where not formed."""
    H = update(streams, branch, post, comb, spec) if spec.update else streams
    if spec.mode == Mode.MEAN_HEAD:
        pre = post_next = comb_next = None
    else:
        pre, post_next, comb_next = coefficients(H, fn, base, scale, spec)
    return out_norm(collapse(H, pre), weight, spec), H, post_next, comb_next
