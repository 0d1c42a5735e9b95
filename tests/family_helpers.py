"""What the tests of the normalization family share (tests/ops/test_embed_norm.py,
test_group_norm.py, test_batch_norm.py): the half dtypes, a row wide enough for the loop
kernels, the embedding norms' orders, and one gradient check.

assert_close(..., per_row=True) throughout: rows of very different sizes (a clamped zero
row's gradient is dy / eps) are each held to their own scale.
"""
import torch
from helpers import assert_close

from fuseblock.kernels.launch import MAX_TILE_FWD, fwd_layout

HALF = [torch.float16, torch.bfloat16]
WIDE = MAX_TILE_FWD + 8  # a row the core op's and embed_norm's layouts hand to the loop kernels
P = {"l1": 1.0, "l2": 2.0, "max": float("inf")}  # embed_norm's orders as F.normalize's p


def loops(d, groups=1):
    """Whether rows of d in `groups` take the loop kernels (forward, hence backward too)."""
    return not fwd_layout(d, groups).tile


def check_grads(out, ref_out, leaves, refs, dtype, names):
    """Backprop one random cotangent through both and compare every leaf's gradient."""
    g = torch.randn(out.shape, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * g).sum(), leaves)
    ref_grads = torch.autograd.grad((ref_out * g).sum(), refs)
    for name, a, b, leaf in zip(names, grads, ref_grads, leaves, strict=False):
        assert a.dtype == leaf.dtype, name
        assert_close(a, b, dtype, f"d{name}", per_row=True)
