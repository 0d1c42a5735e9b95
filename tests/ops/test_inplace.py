"""In-place edits of an op's outputs, as ordinary training code writes them (`y.mul_(2)`,
`y.relu_()`, `y += t`), against the same edit on torch's naive form.

autograd refuses an in-place edit of a custom Function's output that is a view of
something else ("Output 0 of ... is a view and is being modified inplace"), so every
output (and every gradient) of the Triton launchers must be an ordinary tensor, and the
values and gradients after the edit must be the naive form's. Editing new_residual, which
the backward keeps, fails exactly as editing `x + r` before `F.rms_norm` does.
"""
import operator

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from torch import nn

import fuseblock

pytestmark = pytest.mark.kernel

D = 8
EPS = 1e-5
SHAPE = (2, 3, D)  # 3-D: a kernel working on (rows, d) must still hand back an ordinary (2, 3, d) tensor


def _inputs(*shapes):
    torch.manual_seed(1)
    return [torch.randn(s, requires_grad=True) for s in shapes]


def _norm(fused):
    x, w = _inputs(SHAPE, (D,))
    return (fuseblock.norm(x, w, eps=EPS) if fused else F.rms_norm(x, (D,), w, EPS)), [x, w]


def _layer_norm(fused):
    x, w, b = _inputs(SHAPE, (D,), (D,))
    return (fuseblock.norm(x, w, b, kind="layer", eps=EPS) if fused else F.layer_norm(x, (D,), w, b, EPS)), [x, w, b]


def _add_norm_out(fused):
    x, r, w = _inputs(SHAPE, SHAPE, (D,))
    out = fuseblock.add_norm(x, r, w, eps=EPS)[0] if fused else F.rms_norm(x + r, (D,), w, EPS)
    return out, [x, r, w]


def _add_norm_fp32_residual_out(fused):
    # a stored new_residual in another dtype: the kernel writes out and new_residual separately
    x, r, w = _inputs(SHAPE, SHAPE, (D,))
    x16 = x.to(torch.bfloat16)
    if fused:
        out = fuseblock.add_norm(x16, r, w, eps=EPS, residual_dtype=torch.float32)[0]
    else:
        out = F.rms_norm(x16.float() + r, (D,), w, EPS).to(torch.bfloat16)
    return out, [x, r, w]


def _norm_linear(fused):
    x, r, w, lw = _inputs(SHAPE, SHAPE, (D,), (5, D))
    if fused:
        return fuseblock.norm_linear(x, r, w, None, lw, eps=EPS)[0], [x, r, w, lw]
    return F.linear(F.rms_norm(x + r, (D,), w, EPS), lw), [x, r, w, lw]


def _modules(fused):
    torch.manual_seed(2)
    w = torch.randn(D)
    m = fuseblock.Norm(D, eps=EPS) if fused else nn.RMSNorm(D, eps=EPS)
    with torch.no_grad():
        m.weight.copy_(w)
    return m


def _norm_module(fused):
    m = _modules(fused)
    (x,) = _inputs(SHAPE)
    return m(x), [x, m.weight]


def _layer_norm_module(fused):
    m = fuseblock.Norm(D, kind="layer", eps=EPS) if fused else nn.LayerNorm(D, eps=EPS)
    (x,) = _inputs(SHAPE)
    return m(x), [x, m.weight, m.bias]


def _add_norm_module(fused):
    m = fuseblock.AddNorm(D, eps=EPS)
    x, r = _inputs(SHAPE, SHAPE)
    out = m(x, r)[0] if fused else F.rms_norm(x + r, (D,), m.weight, EPS)
    return out, [x, r, m.weight]


def _residual_stack(fused):
    torch.manual_seed(3)
    stack = fuseblock.ResidualStack([nn.Linear(D, D), nn.Linear(D, D)], D, eps=EPS, fused=fused)
    (x,) = _inputs(SHAPE)
    return stack(x), [x, *stack.parameters()]


def _embed_norm(fused):
    (x,) = _inputs(SHAPE)
    return (fuseblock.embed_norm(x, "l2") if fused else F.normalize(x, 2, -1, 1e-12)), [x]


def _group_norm(fused):
    x, w, b = _inputs((2, 4, 3, 2), (4,), (4,))  # (N, C, H, W): the kernel's (N, C, L) view is not the output
    fn = fuseblock.group_norm if fused else F.group_norm
    return fn(x, 2, w, b, EPS), [x, w, b]


def _batch_norm(fused):
    x, w, b = _inputs((3, 4, 5), (4,), (4,))
    rm, rv = torch.zeros(4), torch.ones(4)
    fn = fuseblock.batch_norm if fused else F.batch_norm
    return fn(x, rm, rv, w, b, True, 0.1, EPS), [x, w, b]


CASES = {f.__name__[1:]: f for f in (_norm, _layer_norm, _add_norm_out, _add_norm_fp32_residual_out, _norm_linear,
                                      _norm_module, _layer_norm_module, _add_norm_module, _residual_stack, _embed_norm,
                                      _group_norm, _batch_norm)}


def _add_t(y):
    torch.manual_seed(4)
    return operator.iadd(y, torch.randn(y.shape))  # y += t


EDITS = {"mul_": lambda y: y.mul_(2.0), "relu_": lambda y: y.relu_(), "iadd": _add_t}


def _edited(case, edit, fused):
    """The output after the edit, and the leaves' gradients of a weighted sum of it."""
    y, leaves = CASES[case](fused)
    y = EDITS[edit](y)
    torch.manual_seed(5)
    grads = torch.autograd.grad((y * torch.randn(y.shape)).sum(), leaves)
    return y.detach(), grads


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_take_in_place_edits_as_the_naive_form_does(case, edit):
    y, grads = _edited(case, edit, fused=True)
    ref, ref_grads = _edited(case, edit, fused=False)
    assert_close(y, ref, y.dtype, "y")  # bf16 for the fp32-residual case: its tolerance for the grads too
    for i, (g, rg) in enumerate(zip(grads, ref_grads, strict=True)):
        assert_close(g, rg, y.dtype, f"grad {i}")


@pytest.mark.parametrize("op", ["add_norm", "norm_linear"])
@pytest.mark.parametrize("residual_dtype", [None, torch.float32], ids=["same_dtype", "fp32_residual"])
def test_editing_new_residual_fails_as_editing_x_plus_r_before_rms_norm_does(residual_dtype, op):
    # both keep p = x + r for their backward: an edit of it must not pass silently
    dtype = torch.float32 if residual_dtype is None else torch.bfloat16

    def run(fused):
        x, r, w = _inputs(SHAPE, SHAPE, (D,))
        x = x.to(dtype)
        if fused and op == "norm_linear":
            out, p = fuseblock.norm_linear(x, r, w, None, torch.eye(D, dtype=dtype), eps=EPS,
                                           residual_dtype=residual_dtype)
        elif fused:
            out, p = fuseblock.add_norm(x, r, w, eps=EPS, residual_dtype=residual_dtype)
        else:
            p = x.float() + r
            out = F.rms_norm(p, (D,), w, EPS).to(dtype)
        p.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (out.float().sum() + p.sum()).backward()

    run(fused=False)
    run(fused=True)


@pytest.mark.kernel_only("the launchers' outputs and gradients: the torch path's are torch's own")
def test_launchers_return_no_views():
    x, r, w, b = _inputs(SHAPE, SHAPE, (D,), (D,))
    out, new_res = fuseblock.add_norm(x, r, w, b, kind="layer", eps=EPS, residual_dtype=torch.float64)
    y_e = fuseblock.embed_norm(x, "l1")
    xg, wg, bg = _inputs((2, 4, 3, 2), (4,), (4,))
    y_g = fuseblock.group_norm(xg, 2, wg, bg, EPS)
    y_b = fuseblock.batch_norm(xg, None, None, wg, bg, True)
    outputs = [out, new_res, y_e, y_g, y_b]
    assert [t._is_view() for t in outputs] == [False] * len(outputs)
    loss = sum(t.double().sum() for t in outputs)
    grads = torch.autograd.grad(loss, [x, r, w, b, xg, wg, bg])
    assert [g._is_view() for g in grads] == [False] * len(grads)


@pytest.mark.parametrize("same_dtype", [True, False])
def test_x_and_residual_gradients_are_separate_tensors(same_dtype):
    # the kernel writes one dx for both when their dtypes agree; editing one leaf's .grad
    # (gradient clipping in place, a hook) must leave the other's alone
    x, r = _inputs(SHAPE, SHAPE)
    if not same_dtype:
        r = r.detach().double().requires_grad_(True)
    out, new_res = fuseblock.add_norm(x, r, eps=EPS, residual_dtype=None if same_dtype else torch.float64)
    (out.sum() + new_res.sum()).backward()
    before = r.grad.clone()
    x.grad.mul_(2.0)
    assert torch.equal(r.grad, before)
