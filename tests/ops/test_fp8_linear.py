"""norm_linear(quant="fp8_row") / NormLinear(quant="fp8_row"): the rowwise fp8 recipe.

Its backward is the unquantized one (the gradient at the normed output in high
precision): every gradient equals norm_linear's without quant, bit for bit, for the same
incoming gradient. Its outputs and gradients match torchao's Float8Linear (rowwise recipe)
applied to the unfused norm's output within the SQNR bounds torchao's own Float8Linear
tests use (18 dB outputs, 20 dB gradients)."""
import copy

import pytest
import torch

import fuseblock

pytest.importorskip("torchao")
from torchao.float8 import Float8LinearConfig  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_utils import compute_error  # noqa: E402


def _grads(fn, leaves, dy):
    for t in leaves:
        t.grad = None
    y, new_res = fn()
    torch.autograd.backward([y, new_res], [dy, torch.ones_like(new_res)])
    return y, [t.grad.clone() for t in leaves]


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_fp8_backward_equals_the_unquantized_one(kind):
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(6, 64, generator=g).requires_grad_() for _ in range(2))
    nw = (1 + 0.1 * torch.randn(64, generator=g)).requires_grad_()
    nb = (0.1 * torch.randn(64, generator=g)).requires_grad_() if kind == "layer" else None
    w = (0.1 * torch.randn(48, 64, generator=g)).requires_grad_()
    b = torch.randn(48, generator=g).requires_grad_()
    dy = torch.randn(6, 48, generator=g)
    leaves = [t for t in (x, res, nw, nb, w, b) if t is not None]
    run = {q: _grads(lambda q=q: fuseblock.norm_linear(x, res, nw, nb, w, b, kind=kind, quant=q), leaves, dy)
           for q in (None, "fp8_row")}
    for got, want in zip(run["fp8_row"][1], run[None][1], strict=True):
        assert torch.equal(got, want)
    y8, y = run["fp8_row"][0], run[None][0]
    assert not torch.equal(y8, y) and compute_error(y, y8) > 25  # the forward is quantized, and close


@pytest.mark.kernel
def test_fp8_norm_linear_matches_torchao_float8_linear_rowwise():
    torch.manual_seed(0)
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    ours = fuseblock.NormLinear(128, 96, bias=False, quant="fp8_row", dtype=torch.bfloat16)
    with torch.no_grad():
        ours.norm_weight.uniform_(0.5, 1.5)
    lin = torch.nn.Linear(128, 96, bias=False, dtype=torch.bfloat16)
    lin.weight.data.copy_(ours.weight.data)
    theirs = Float8Linear.from_float(copy.deepcopy(lin), config=Float8LinearConfig.from_recipe_name("rowwise"))
    nw = ours.norm_weight.detach().clone().requires_grad_()
    dy = torch.randn(64, 96, dtype=torch.bfloat16)

    xa = x.clone().requires_grad_()
    ya, _ = ours(xa)
    ya.backward(dy)
    xb = x.clone().requires_grad_()
    yb = theirs(fuseblock.norm(xb, nw))  # the unfused norm's output into torchao's fp8 Linear
    yb.backward(dy)
    assert compute_error(yb, ya) >= 18
    assert compute_error(xb.grad, xa.grad) >= 20
    assert compute_error(theirs.weight.grad, ours.weight.grad) >= 20
    assert compute_error(nw.grad, ours.norm_weight.grad) >= 20


def test_norm_linear_quant_bad_input():
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    with pytest.raises(ValueError, match="'fp8_row'"):
        fuseblock.norm_linear(x, None, None, None, w, quant="mxfp8")
    with pytest.raises(TypeError, match="weight in x's dtype"):
        fuseblock.norm_linear(x, None, None, None, w.double(), quant="fp8_row")
    with pytest.raises(ValueError, match="quant must be"):
        fuseblock.NormLinear(64, 8, quant="fp8")


def test_norm_linear_quant_attribute_routes_add_linear_to_fp8():
    """Norm.linear_quant (set by scripts/train.py --fp8 row) makes add_linear the fp8 recipe."""
    torch.manual_seed(0)
    x, lin, n = torch.randn(4, 64), torch.nn.Linear(64, 32), fuseblock.Norm(64)
    plain = n.add_linear(x, None, lin)[0]
    n.linear_quant = "fp8_row"
    got = n.add_linear(x, None, lin)[0]
    want = fuseblock.norm_linear(x, None, n.weight, None, lin.weight, lin.bias, quant="fp8_row")[0]
    assert torch.equal(got, want) and not torch.equal(got, plain)
