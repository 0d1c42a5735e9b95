"""Second derivatives and torch.func transforms through norm / add_norm, on both paths.

create_graph=True rebuilds the first derivatives from differentiable torch ops (the
kernels' gradients are not differentiable), so a second derivative is right: checked by
gradgradcheck in fp64 and against the independent fp64 reference's autograd in fp32.
torch.func (vmap, grad, jvp) runs the same plain ops.
"""
import pytest
import torch
from ref64 import add_norm64
from torch.autograd import gradcheck, gradgradcheck

import fuseblock

CASES = [
    dict(kind="rms"), dict(kind="layer"), dict(kind="l2"),
    dict(kind="rms", gate_position="pre", gate_act="sigmoid"), dict(kind="layer", gate_position="post"),
    dict(kind="layer", num_groups=2), dict(kind="rms", c=2.0, eps=0.0),
]
IDS = ["rms", "layer", "l2", "rms-pregate", "layer-postgate", "layer-groups", "rms-c-eps0"]


def _inputs(dtype, d=6, rows=3, gated=False):
    t = dict(x=torch.randn(rows, d, dtype=dtype), residual=torch.randn(rows, d, dtype=dtype),
             weight=torch.randn(d, dtype=dtype), bias=torch.randn(d, dtype=dtype))
    if gated:
        t["gate"] = torch.randn(rows, d, dtype=dtype)
    return {k: v.requires_grad_() for k, v in t.items()}


def _fn(case, impl):
    def f(x, residual, weight, bias, gate=None):
        return impl(x, residual, weight, bias, gate=gate, **case)
    return f


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradgradcheck_float64(case):
    t = _inputs(torch.float64, gated="gate_position" in case)
    f = _fn(case, fuseblock.add_norm)
    assert gradcheck(f, tuple(t.values()))
    assert gradgradcheck(f, tuple(t.values()))


@pytest.mark.kernel
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_second_derivatives_match_the_fp64_reference(case):
    # a gradient penalty: the second derivative of |d loss / d x|^2 with respect to
    # every input, against the same through the independent fp64 reference
    t = _inputs(torch.float32, gated="gate_position" in case)
    cot = torch.randn(3, 6), torch.randn(3, 6)

    def second(impl, leaves):
        out, new_res = _fn(case, impl)(**leaves)
        loss = (out * cot[0].to(out.dtype)).sum() + (new_res * cot[1].to(new_res.dtype)).sum()
        gx, gw = torch.autograd.grad(loss, (leaves["x"], leaves["weight"]), create_graph=True)
        found = torch.autograd.grad((gx ** 2).sum() + (gw ** 3).sum(), list(leaves.values()), allow_unused=True)
        # bias enters linearly: no second derivative, so autograd returns None for it
        return [torch.zeros_like(v) if g is None else g for g, v in zip(found, leaves.values(), strict=True)]

    got = second(fuseblock.add_norm, t)
    want = second(add_norm64, {k: v.detach().double().requires_grad_() for k, v in t.items()})
    for name, g, w in zip(t, got, want, strict=True):
        scale = max(1.0, w.abs().max().item())
        assert (g.double() - w).abs().max().item() <= 2e-4 * scale, name


@pytest.mark.kernel
def test_first_derivatives_with_create_graph_equal_the_plain_ones():
    t = _inputs(torch.float32)
    out, new_res = fuseblock.add_norm(t["x"], t["residual"], t["weight"], t["bias"], kind="layer")
    cot = torch.randn_like(out), torch.randn_like(new_res)
    plain = torch.autograd.grad((out, new_res), list(t.values()), cot, retain_graph=True)
    graphed = torch.autograd.grad((out, new_res), list(t.values()), cot, create_graph=True)
    assert graphed[0].requires_grad  # dx depends on x: a graph to differentiate again
    for p, g in zip(plain, graphed, strict=True):
        torch.testing.assert_close(g, p, rtol=1e-5, atol=1e-5)


@pytest.mark.kernel
def test_bf16_activations_with_an_fp32_residual_double_backward():
    x = torch.randn(3, 8).bfloat16().requires_grad_()
    r = torch.randn(3, 8, requires_grad=True)
    out, new_res = fuseblock.add_norm(x, r, residual_dtype=torch.float32)
    gx, gr = torch.autograd.grad(out.float().sum() + new_res.sum(), (x, r), create_graph=True)
    assert gx.dtype == torch.bfloat16 and gr.dtype == torch.float32
    hx, hr = torch.autograd.grad((gx.float() ** 2).sum(), (x, r))
    x6, r6 = x.detach().double().requires_grad_(), r.detach().double().requires_grad_()
    o6, p6 = add_norm64(x6, r6, residual_dtype=torch.float32)
    g6 = torch.autograd.grad(o6.sum() + p6.sum(), x6, create_graph=True)[0]
    h6 = torch.autograd.grad((g6 ** 2).sum(), (x6, r6))
    for got, want in zip((hx, hr), h6, strict=True):
        assert (got.double() - want).abs().max() <= 0.05 * max(1.0, want.abs().max().item())


# ------------------------------------------------------------------ torch.func
@pytest.mark.kernel
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torch_func_vmap_grad_jvp(case):
    t = _inputs(torch.float32, gated="gate_position" in case)
    x, others = t["x"].detach(), {k: v.detach() for k, v in t.items() if k != "x"}
    f = _fn(case, fuseblock.add_norm)

    def out(xi):
        return f(xi, **others)[0]

    eager = out(x)
    gate = others.get("gate")
    in_dims = (0, 0, None, None, None if gate is None else 0)
    batched = torch.func.vmap(f, in_dims=in_dims)(x, others["residual"], others["weight"], others["bias"], gate)
    torch.testing.assert_close(batched[0], eager, rtol=1e-5, atol=1e-5)
    xr = x.clone().requires_grad_()
    want = torch.autograd.grad(out(xr).square().sum(), xr)[0]
    torch.testing.assert_close(torch.func.grad(lambda xi: out(xi).square().sum())(x), want, rtol=1e-4, atol=1e-5)
    v = torch.randn_like(x)
    _, tangent = torch.func.jvp(out, (x,), (v,))
    ref = torch.func.jvp(lambda xi: add_norm64(xi, **{**others, **case})[0], (x.double(),), (v.double(),))[1]
    torch.testing.assert_close(tangent.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.kernel
def test_torch_func_through_the_family_ops():
    x = torch.randn(2, 4, 6, 5)  # vmapped over the first dim: each call sees (N, C, L) = (4, 6, 5)
    for f in (fuseblock.embed_norm, lambda t: fuseblock.group_norm(t, 3), fuseblock.instance_norm,
              lambda t: fuseblock.batch_norm(t, None, None, training=True)):
        batched = torch.func.vmap(f)(x)
        torch.testing.assert_close(batched, torch.stack([f(xi) for xi in x]), rtol=1e-5, atol=1e-5)
        g = torch.func.grad(lambda t, f=f: f(t).pow(3).sum())(x[0])
        xr = x[0].clone().requires_grad_()
        torch.testing.assert_close(g, torch.autograd.grad(f(xr).pow(3).sum(), xr)[0], rtol=1e-4, atol=1e-5)
