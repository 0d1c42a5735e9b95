"""Core op: norm / add_norm values and gradients against the fp64 seed reference and torch."""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, run_case
from ref64 import tolerances

import fuseblock
from fuseblock.ops.norm import norm_op, uses_triton
from fuseblock.spec import Act, Gate, NormSpec


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer", "l2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [1, 3, 1000])
@pytest.mark.parametrize("affine", ["none", "w", "wb"])
@pytest.mark.parametrize("res", ["none", "same", "fp32"])
def test_add_norm_matches_fp64_reference(kind, dtype, d, affine, res):
    x = torch.randn(3, 5, d).to(dtype)
    residual = None if res == "none" else torch.randn(3, 5, d).to(dtype)
    weight = torch.randn(d).to(dtype) if affine != "none" else None
    bias = torch.randn(d).to(dtype) if affine == "wb" else None
    rdtype = torch.float32 if res == "fp32" else None
    run_case(x, residual, weight, bias, kind=kind, eps=1e-5, residual_dtype=rdtype)


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer", "l2"])
@pytest.mark.parametrize("res", ["none", "same"])
def test_wide_rows_loop_over_column_blocks(kind, res):
    d = 131072
    x = torch.randn(2, d)
    residual = torch.randn(2, d) if res == "same" else None
    run_case(x, residual, torch.randn(d), torch.randn(d), kind=kind)


@pytest.mark.kernel
@pytest.mark.parametrize("c", [0.5, 3.0])
def test_scale_c_overrides_kind_default(c):
    x = torch.randn(4, 7)
    run_case(x, None, torch.randn(7), None, kind="layer", c=c)


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [3, 256])
def test_rms_and_layer_equal_torch_functions(dtype, d):
    x, w, b = torch.randn(6, d).to(dtype), torch.randn(d).to(dtype), torch.randn(d).to(dtype)
    atol, rtol = tolerances(dtype)
    ref_rms = F.rms_norm(x.double(), (d,), w.double(), eps=1e-5)
    torch.testing.assert_close(fuseblock.norm(x, w, kind="rms", eps=1e-5).double(), ref_rms, atol=atol * 4, rtol=rtol)
    ref_ln = F.layer_norm(x.double(), (d,), w.double(), b.double(), eps=1e-5)
    out = fuseblock.norm(x, w, b, kind="layer", eps=1e-5)
    torch.testing.assert_close(out.double(), ref_ln, atol=atol * 4, rtol=rtol)
    # and their gradients, via torch's own autograd of its own functions
    xs = x.float().requires_grad_()
    ws = w.float().requires_grad_()
    g = torch.randn(6, d)
    ours = torch.autograd.grad((fuseblock.norm(xs, ws, kind="rms", eps=1e-5) * g).sum(), (xs, ws))
    theirs = torch.autograd.grad((F.rms_norm(xs, (d,), ws, eps=1e-5) * g).sum(), (xs, ws))
    for a, b_ in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b_, atol=1e-4, rtol=1e-4)


@pytest.mark.kernel
def test_l2_is_unit_norm_direction():
    x = torch.randn(5, 64)
    out = fuseblock.norm(x, kind="l2", eps=0.0)
    torch.testing.assert_close(out, F.normalize(x, dim=-1), atol=1e-6, rtol=1e-5)


@pytest.mark.kernel
def test_no_gradient_to_new_residual_is_fine():
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    run_case(x, r, torch.randn(32), None, grad_res=False)


@pytest.mark.kernel
def test_non_contiguous_inputs():
    base = torch.randn(40, 6)
    x = base.t()  # (6, 40): last-dim stride 6
    residual = torch.randn(6, 80)[:, ::2]
    run_case(x, residual, torch.randn(40), torch.randn(40), kind="layer")


@pytest.mark.kernel
def test_empty_batch_returns_empty_outputs():
    x = torch.randn(0, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    out, res = fuseblock.add_norm(x, torch.randn(0, 16), w)
    assert out.shape == (0, 16) and res.shape == (0, 16)
    out.sum().backward()
    assert x.grad.shape == (0, 16) and torch.equal(w.grad, torch.zeros(16))


@pytest.mark.kernel
def test_residual_none_returns_x_itself_without_a_copy():
    x = torch.randn(3, 8)
    out, res = fuseblock.add_norm(x)
    assert res is x


@pytest.mark.kernel
@pytest.mark.kernel_only("launch counts are a property of the Triton path")
def test_one_launch_forward_one_backward(launches):
    x, r = torch.randn(8, 64, requires_grad=True), torch.randn(8, 64, requires_grad=True)
    w, b = torch.ones(64, requires_grad=True), torch.zeros(64, requires_grad=True)
    assert uses_triton(x)
    launches.reset()
    out, res = fuseblock.add_norm(x, r, w, b, kind="layer", residual_dtype=torch.float32)
    assert launches["fwd"] == 1
    (out.sum() + res.sum()).backward()
    assert launches["bwd"] == 1


@pytest.mark.kernel
@pytest.mark.kernel_only("the registered op serves the Triton path; the torch path keeps no statistics")
def test_statistics_stored_only_when_a_gradient_is_needed():
    x = torch.randn(4, 16)
    spec = NormSpec(center=False, scale=1.0, eps=1e-6, gate=Gate.NONE, act=Act.UNUSED, groups=1)
    args = (x, None, None, None, None, spec.pack(), None)
    _, _, rstd, _ = norm_op.fwd_op(*args, False)
    assert rstd.numel() == 0
    _, _, rstd, _ = norm_op.fwd_op(*args, True)
    torch.testing.assert_close(rstd[:, 0], torch.rsqrt(x.square().mean(-1) + 1e-6))


@pytest.mark.parametrize("kind", ["rms", "layer", "l2"])
@pytest.mark.parametrize("gate_position", [None, "pre", "post"])
def test_gradcheck_float64_torch_path(kind, gate_position):
    x, r = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    w, b = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    gate = torch.randn(3, 6, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (x, r, w, b, gate)]
    gate_kw = {} if gate_position is None else dict(gate=gate, gate_position=gate_position, gate_act="silu")

    def f(x, r, w, b, gate):
        kw = dict(gate_kw, gate=gate) if gate_position else {}
        out, res = fuseblock.add_norm(x, r, w, b, kind=kind, eps=1e-3, **kw)
        return out, res * 1.5

    assert torch.autograd.gradcheck(f, leaves)


def test_eps_placement_inside_the_square_root():
    # an all-zero row gives exactly the bias, and the eps is inside sqrt(q.q/d + eps)
    x = torch.zeros(2, 5)
    x[1] = torch.tensor([1.0, -1.0, 2.0, 0.0, 0.0])
    b = torch.arange(5.0)
    out = fuseblock.norm(x, None, b, kind="rms", eps=0.5)
    assert torch.equal(out[0], b)
    expected = x[1] / math.sqrt(x[1].square().mean().item() + 0.5) + b
    torch.testing.assert_close(out[1], expected)
