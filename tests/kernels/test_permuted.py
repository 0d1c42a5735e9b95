"""Permuted inputs: every launcher outside the n-stream one allocates its outputs and
gradients contiguous and writes them by rows (issue 44, item 2: `torch.empty_like` of a
permuted input keeps its strides while the kernel writes as if contiguous, which scrambles
the result; none of these launchers allocates so, and these tests hold that). A
sequence-first tensor transposed to batch-first and its contiguous copy give the same
outputs and gradients: on the kernel path value for value (the same kernels on the same
values), every output contiguous; on the torch path within 1e-5 (torch's ops keep a
permuted input's layout, and its weight-gradient sums follow it).
"""
import pytest
import torch
from helpers import KERNEL_PATH

import fuseblock

T, B, D = 5, 3, 32


def permuted(*shape):
    """A (B, T, ...) tensor laid out sequence-first: (T, B, ...) transposed."""
    return torch.randn(shape[1], shape[0], *shape[2:]).transpose(0, 1)


def same(op, inputs: list, grads_of: list[int]):
    """op on the permuted inputs and on their contiguous copies: outputs and the gradients
    of inputs[i] for i in grads_of, equal."""
    results = []
    for make in (lambda t: t.detach().clone(), lambda t: t.detach().contiguous()):
        args = [make(t).requires_grad_(i in grads_of) if torch.is_tensor(t) else t for i, t in enumerate(inputs)]
        outs = op(*args)
        outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if o is not None]
        assert not KERNEL_PATH or all(o.is_contiguous() for o in outs)
        g = [torch.ones_like(o) + torch.arange(o.numel(), dtype=o.dtype).view(o.shape) / o.numel() for o in outs]
        grads = torch.autograd.grad(outs, [args[i] for i in grads_of], g)
        results.append([*outs, *grads])
    assert not inputs[0].is_contiguous()
    tol = 0 if KERNEL_PATH else 1e-5  # torch's weight-gradient sums follow the memory order
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, i=i: f"result {i}: {m}")


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_add_norm_of_permuted_inputs(kind):
    x, r, w, b = permuted(B, T, D), permuted(B, T, D), torch.randn(D), torch.randn(D)
    same(lambda x, r, w, b: fuseblock.add_norm(x, r, w, b, kind=kind), [x, r, w, b], [0, 1, 2, 3])


@pytest.mark.kernel
def test_norm_add_norm_of_permuted_inputs():
    x, r, bw, w = permuted(B, T, D), permuted(B, T, D), torch.randn(D), torch.randn(D)
    same(lambda x, r, bw, w: fuseblock.norm_add_norm(x, r, bw, w), [x, r, bw, w], [0, 1, 2, 3])


@pytest.mark.kernel
@pytest.mark.parametrize("ord", ["l2", "max"])
def test_embed_norm_of_a_permuted_input(ord):
    same(lambda x: fuseblock.embed_norm(x, ord=ord), [permuted(B, T, D)], [0])


@pytest.mark.kernel
def test_group_norm_of_a_permuted_input():
    x, w, b = permuted(2, 8, 3, 4), torch.randn(8), torch.randn(8)  # (N, C, H, W) stored channel-first
    same(lambda x, w, b: fuseblock.group_norm(x, 2, w, b), [x, w, b], [0, 1, 2])


@pytest.mark.kernel
def test_fp8_row_output_of_a_permuted_input():
    x, r, w = permuted(B, T, D), permuted(B, T, D), torch.randn(D)
    outs = []
    for make in (torch.Tensor.clone, torch.Tensor.contiguous):
        q, new_r = fuseblock.add_norm(make(x), make(r), w, quant="fp8_row")
        outs.append((q.data.view(torch.uint8), q.scale, new_r))
    for a, b in zip(*outs, strict=True):
        assert (a.is_contiguous() or not KERNEL_PATH) and torch.equal(a, b)
