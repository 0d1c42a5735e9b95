"""Training through quant=: the op's backward takes the gradient at the normed output in
high precision (given to `Quantized.anchor`) and returns the same dx, dresidual, dweight
and dbias as the unquantized op given the same incoming gradients, bit for bit, on both
paths: add_norm (with a residual, a gate, alpha and x1), norm and norm_add_norm, the
three quant modes. `Quantized.dequantize()` is the differentiable way in."""
import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, generator

import fuseblock

MODES = ["fp8_tensor", "fp8_row", "mxfp8"]
D = 64


def _leaves(dtype, g, *names):
    made = {n: torch.randn(4, D, generator=g) for n in ("x", "residual", "x1", "gate")}
    made["weight"] = 1 + 0.2 * torch.randn(D, generator=g)
    made["bias"] = 0.1 * torch.randn(D, generator=g)
    made["branch_weight"] = 1 + 0.2 * torch.randn(D, generator=g)
    return {n: made[n].to(dtype).requires_grad_() for n in names}


def _grads(call, leaves: dict, dout, dres):
    for t in leaves.values():
        t.grad = None
    out, new_res = call()
    o = out.anchor if isinstance(out, fuseblock.Quantized) else out
    torch.autograd.backward([o, new_res], [dout, dres])
    return [t.grad.clone() for t in leaves.values()]


def _quant_kw(mode):
    return dict(quant=mode, scale=torch.tensor([0.02])) if mode == "fp8_tensor" else dict(quant=mode)


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_backward_equals_the_unquantized_ops(mode, dtype):
    g = generator(0)
    t = _leaves(dtype, g, "x", "residual", "weight", "bias", "gate", "x1")
    dout, dres = torch.randn(4, D, generator=g), torch.randn(4, D, generator=g).to(dtype)
    kw = dict(kind="layer", gate=t["gate"], alpha=0.5, x1=t["x1"])

    def call(**q):
        return fuseblock.add_norm(t["x"], t["residual"], t["weight"], t["bias"], **kw, **q)

    # the gradient at the anchor is read in the unquantized output's dtype, as autograd
    # casts it for the plain op: the same incoming fp32 dout for both
    got = _grads(lambda: call(**_quant_kw(mode)), t, dout, dres)
    want = _grads(call, t, dout.to(dtype), dres)
    for name, a, b in zip(t, got, want, strict=True):
        _same_gradient(a, b, name)


def _same_gradient(a, b, name):
    """Bit for bit on the CPU (torch path and interpreter). Compiled for a GPU the quantized
    forward is a kernel of its own, whose saved statistics may round otherwise: on the H200
    the fp32 gradients differed in their last bits (bf16 ones were equal), so there they are
    held to fp32's rounding."""
    if DEVICE == "cpu":
        assert torch.equal(a, b), name
    else:
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.kernel
@pytest.mark.parametrize("mode", MODES)
def test_norm_add_norm_backward_equals_the_unquantized_ops(mode):
    g = generator(1)
    t = _leaves(torch.float32, g, "x", "residual", "branch_weight", "weight")
    dout, dres = torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)

    def call(**q):
        return fuseblock.norm_add_norm(t["x"], t["residual"], t["branch_weight"], t["weight"], alpha=0.5, **q)

    got = _grads(lambda: call(**_quant_kw(mode)), t, dout, dres)
    want = _grads(call, t, dout, dres)
    for name, a, b in zip(t, got, want, strict=True):
        _same_gradient(a, b, name)


@pytest.mark.kernel
def test_norm_without_residual_trains_and_its_codes_are_the_no_grad_calls():
    g = generator(2)
    t = _leaves(torch.bfloat16, g, "x", "weight")
    recipe = fuseblock.Fp8Recipe("fp8_row", quant_from=torch.bfloat16)
    q = fuseblock.norm(t["x"], t["weight"], quant=recipe)
    with torch.no_grad():
        q0 = fuseblock.norm(t["x"], t["weight"], quant=recipe)
    assert q0.anchor is None and q.anchor.requires_grad and not q.data.requires_grad
    assert torch.equal(q.data.view(torch.uint8), q0.data.view(torch.uint8)) and torch.equal(q.scale, q0.scale)
    assert q.anchor.dtype == torch.bfloat16 and q.anchor.shape == (4, D) and q.anchor.isnan().all()
    dout = torch.randn(4, D, generator=g).bfloat16()
    q.anchor.backward(dout)
    got = [t["x"].grad.clone(), t["weight"].grad.clone()]
    t["x"].grad = t["weight"].grad = None
    fuseblock.norm(t["x"], t["weight"]).backward(dout)
    _same_gradient(got[0], t["x"].grad, "x")
    _same_gradient(got[1], t["weight"].grad, "weight")


@pytest.mark.kernel
@pytest.mark.parametrize("mode", ["fp8_row", "mxfp8"])
def test_dequantize_is_differentiable_and_exact(mode):
    """F.linear(q.dequantize(), W): the gradient at the dequantized rows passes to the norm
    unchanged, so x's and the norm weight's gradients are the unquantized norm's given
    dout = dy W (the gradient autograd delivered there, not a product of our own: a GPU's
    matmuls need not round dy @ W as the Linear's backward did); the values are data * scale
    (per block for mxfp8), exactly."""
    g = generator(3)
    t = _leaves(torch.float32, g, "x", "residual", "weight")
    W, dy = torch.randn(16, D, generator=g), torch.randn(4, 16, generator=g)
    q, new_res = fuseblock.add_norm(t["x"], t["residual"], t["weight"], quant=mode)
    deq = q.dequantize()
    blocks = q.data.float().reshape(4, -1, 32 if mode == "mxfp8" else D)
    scale = q.scale.float().unsqueeze(-1) if mode == "mxfp8" else q.scale.unsqueeze(-1)
    assert deq.dtype == torch.float32 and torch.equal(deq, (blocks * scale).reshape(4, D))
    deq.retain_grad()
    torch.autograd.backward([F.linear(deq, W), new_res], [dy, torch.zeros(4, D)])
    torch.testing.assert_close(deq.grad, dy @ W)
    got = [v.grad.clone() for v in t.values()]
    for v in t.values():
        v.grad = None
    out, new_res = fuseblock.add_norm(t["x"], t["residual"], t["weight"])
    torch.autograd.backward([out, new_res], [deq.grad, torch.zeros(4, D)])
    for name, a, v in zip(t, got, t.values(), strict=True):
        _same_gradient(a, v.grad, name)


@pytest.mark.kernel
def test_double_backward_through_the_anchor_equals_the_unquantized_ops():
    g = generator(4)
    t = _leaves(torch.float32, g, "x", "weight")
    dout = torch.randn(4, D, generator=g)

    def second(out):
        dx, = torch.autograd.grad(out, t["x"], dout, create_graph=True)
        return torch.autograd.grad((dx * dx).sum(), t["weight"])[0]

    got = second(fuseblock.norm(t["x"], t["weight"], quant="mxfp8").anchor)
    torch.testing.assert_close(got, second(fuseblock.norm(t["x"], t["weight"])), rtol=1e-6, atol=1e-6)


def test_dequantize_dtype_is_checked():
    q = fuseblock.norm(torch.randn(2, 64), quant="fp8_row")
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    for bad in ("bf16", torch.int32, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="dtype must be"):
            q.dequantize(bad)
