"""The bytes one attention-residual boundary moves: the kernels against the unfused torch form.

The boundary (`fuseblock.attn_res_add_norm`): partial' = partial + branch, a softmax mix
over the S - 1 finished blocks' states and partial', then the next sublayer's RMS norm.
Unfused is the torch code Kimi's Attention Residuals write for it (the finished blocks a
list of tensors, `torch.stack`ed with partial' each sublayer, keys by `F.rms_norm`, the
scores by einsum, softmax, the weighted sum by einsum, then the next norm `F.rms_norm`),
each aten op one kernel reading its distinct inputs and writing its outputs (EagerTraffic);
"unfused1" charges each rms_norm one kernel each way, as CUDA runs it (the CPU's is a composite).
Fused: `attn_res_add_norm`'s launches, their distinct bytes counted by the Triton
interpreter (KernelTraffic). Cotangents go to y and partial', what the next layer uses.

The compulsory minimum: forward reads the S - 1 states, partial and branch and writes
partial', mixed and y; backward reads the states, partial', dy and dpartial'' and writes
the states' gradients and dpartial (= dbranch, one tensor). The query, weight, their
gradients, the per-token softmax weights and statistics and the partial rows are "other".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import fuseblock

from .cases import OneKernelRMSNorm
from .hyper_traffic import kept_bytes
from .traffic import EagerTraffic, KernelTraffic

KEY_EPS = EPS = 1e-6
# the kernels' arguments that hold the per-token activations (the launchers' names)
ACTIVATION_ARGS = {"SRC", "P", "BR", "Y", "MIX", "PN", "DY", "DMIX", "DPN", "DSRC", "DP"}


def boundary_inputs(rows: int, s: int, d: int, dtype) -> dict:
    """bank (rows, s - 1, d), the same states as a list `blocks`, partial, branch (rows, d),
    query and weight (d,) in fp32; every tensor requires grad."""
    bank = torch.randn(rows, s - 1, d).to(dtype)
    blocks = [bank[:, j].clone().requires_grad_() for j in range(s - 1)]
    return dict(bank=bank.requires_grad_(), blocks=blocks, partial=torch.randn(rows, d).to(dtype).requires_grad_(),
                branch=torch.randn(rows, d).to(dtype).requires_grad_(),
                query=(torch.randn(d) / d ** 0.5).requires_grad_(), weight=(1 + 0.1 * torch.randn(d)).requires_grad_())


def unfused(blocks, partial, branch, query, weight, one_kernel_norm: bool = False) -> list[torch.Tensor]:
    """[y, partial', mixed] in Kimi's torch form, in the states' dtype. one_kernel_norm:
    each rms_norm charged as one kernel each way, as CUDA runs it (the CPU's is a composite)."""
    partial = partial + branch
    v = torch.stack([*blocks, partial])  # (S, rows, d): a copy of S rows per token
    d = v.shape[-1]
    if one_kernel_norm:
        k = OneKernelRMSNorm.apply(v.view(-1, d), torch.ones(d, dtype=v.dtype)).view(v.shape)
    else:
        k = F.rms_norm(v, (d,), None, KEY_EPS)
    a = torch.einsum("d,srd->sr", query.to(v.dtype), k).softmax(0)
    mixed = torch.einsum("sr,srd->rd", a, v)
    w = weight.to(v.dtype)
    y = OneKernelRMSNorm.apply(mixed, w) if one_kernel_norm else F.rms_norm(mixed, (d,), w, EPS)
    return [y, partial, mixed]


def fused(t) -> list[torch.Tensor]:
    """[y, partial', mixed] of `attn_res_add_norm`."""
    y, mixed, new = fuseblock.attn_res_add_norm(t["bank"], t["branch"], t["partial"], t["query"], t["weight"],
                                                key_eps=KEY_EPS, eps=EPS)
    return [y, new, mixed]


def minimum_bytes(t) -> tuple[int, int]:
    """Compulsory (forward, backward) bytes, in the module docstring's model."""
    bank, row = t["bank"].nbytes, t["partial"].nbytes
    return bank + 2 * row + 3 * row, (bank + 3 * row) + (bank + row)


def _activation_bytes(kt: KernelTraffic, names=ACTIVATION_ARGS) -> int:
    parts = (part for ln in kt.launches for part in (ln.read, ln.written))
    return sum(v for part in parts for k, v in part.items() if k in names)


def measure_attn_res_traffic(rows: int, s: int, d: int, dtype) -> list[dict]:
    """Rows for fwd, bwd and fwd+bwd of one boundary of S sources (S - 1 finished blocks and
    partial'): kernel, unfused and minimum bytes, launches and the unfused ops, bytes kept
    for backward, and (fwd) the sources' bytes read over their size."""
    torch.manual_seed(0)
    t = boundary_inputs(rows, s, d, dtype)
    fused_leaves = [t["bank"], t["partial"], t["branch"], t["query"], t["weight"]]
    unfused_leaves = [*t["blocks"], t["partial"], t["branch"], t["query"], t["weight"]]
    with KernelTraffic(glue=True) as kf:
        kept, outs = kept_bytes(fused_leaves, lambda: fused(t))
    grads = [torch.randn_like(o) for o in outs[:2]]
    with KernelTraffic(glue=True) as kb:
        torch.autograd.grad(outs[:2], fused_leaves, grads)
    counted = []
    for one_kernel in (False, True):
        with EagerTraffic() as uf:
            ukept, uouts = kept_bytes(unfused_leaves, lambda one_kernel=one_kernel: unfused(
                t["blocks"], t["partial"], t["branch"], t["query"], t["weight"], one_kernel))
        with EagerTraffic() as ub:
            torch.autograd.grad(uouts[:2], unfused_leaves, grads)
        counted.append((uf, ub, ukept))
    (uf, ub, ukept), (u1f, u1b, _) = counted
    min_f, min_b = minimum_bytes(t)
    parts = {"fwd": ([kf], [uf], [u1f], min_f), "bwd": ([kb], [ub], [u1b], min_b),
             "fwd+bwd": ([kf, kb], [uf, ub], [u1f, u1b], min_f + min_b)}
    out = []
    for pas, (kts, uts, u1s, mn) in parts.items():
        kernel = sum(k.bytes + k.glue_bytes for k in kts)
        act = sum(map(_activation_bytes, kts))
        unfused_b = sum(u.bytes for u in uts)
        out.append(dict(
            op=f"attn_res_add_norm S={s}", dtype=str(dtype).removeprefix("torch."), rows=rows, d=d, pas=pas,
            kernel_MB=kernel / 1e6, unfused_MB=unfused_b / 1e6, min_MB=mn / 1e6, other_MB=(kernel - act) / 1e6,
            kernel_over_min=kernel / mn, act_over_min=act / mn, unfused_over_kernel=unfused_b / kernel,
            unfused1_over_kernel=sum(u.bytes for u in u1s) / kernel,
            sources_read_over_size=_activation_bytes(kf, {"SRC"}) / t["bank"].nbytes if pas == "fwd" else None,
            launches=sum(len(k.launches) + len(k.glue.ops) for k in kts), unfused_ops=sum(len(u.ops) for u in uts),
            unfused1_ops=sum(len(u.ops) for u in u1s),
            kept_MB=kept / 1e6 if pas == "fwd" else None, unfused_kept_MB=ukept / 1e6 if pas == "fwd" else None,
        ))
    return out
