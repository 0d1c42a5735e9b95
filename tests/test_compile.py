"""torch.compile(fullgraph=True): on the kernel path it traces the custom ops whole,
forward and backward; on the torch path it sees the plain torch ops, with no fuseblock op."""
import pytest
import torch
from helpers import KERNEL_PATH

import fuseblock
from fuseblock.spec import Act, Gate, NormSpec


def _fn(x, r, w, b, g):
    out, res = fuseblock.add_norm(x, r, w, b, kind="layer", gate=g, gate_position="pre")
    return out * 2 + res


def _inputs():
    return [torch.randn(*s, requires_grad=True) for s in ((3, 5, 16), (3, 5, 16), (16,), (16,), (3, 5, 16))]


def _grads(fn, inputs):
    out = fn(*inputs)
    return [out] + list(torch.autograd.grad(out.square().sum(), inputs))


@pytest.mark.kernel
def test_fullgraph_aot_eager_matches_eager_and_keeps_the_op_whole():
    torch._dynamo.reset()
    inputs = _inputs()
    explained = torch._dynamo.explain(_fn)(*inputs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    graph = str(explained.graphs[0].graph)
    if KERNEL_PATH:
        assert "fuseblock.norm_fwd" in graph
    else:  # plain torch ops, which Inductor fuses as it would the naive form
        assert "fuseblock" not in graph and "rsqrt" in graph
    compiled = torch.compile(_fn, fullgraph=True, backend="aot_eager")
    for a, b in zip(_grads(compiled, inputs), _grads(_fn, inputs), strict=True):
        torch.testing.assert_close(a, b)


def test_fullgraph_inductor_forward_and_backward():
    torch._dynamo.reset()
    compiled = torch.compile(_fn, fullgraph=True)
    inputs = _inputs()
    for a, b in zip(_grads(compiled, inputs), _grads(_fn, inputs), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.kernel
@pytest.mark.kernel_only("the custom op serves the Triton path")
def test_opcheck_fake_implementations():
    x, r = torch.randn(3, 16, requires_grad=True), torch.randn(3, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    torch.library.opcheck(
        torch.ops.fuseblock.norm_fwd.default,
        (x, r, None, w, None, NormSpec(True, 1.0, 1e-6, Gate.NONE, Act.UNUSED, 1).pack(), torch.float32, True),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.kernel
@pytest.mark.kernel_only("the custom op serves the Triton path")
def test_backward_fake_gives_dw_db_the_parameters_dtypes():
    # the backward returns dw and db in the weight's and the bias's dtypes (no cast after
    # it, where the kernels would need a launch for it): its fake says so
    x, w, b = torch.randn(3, 16).bfloat16(), torch.randn(16).bfloat16(), torch.randn(16).half()
    spec = NormSpec(True, 1.0, 1e-6, Gate.NONE, Act.UNUSED, 1).pack()
    _, _, rstd, mean = torch.ops.fuseblock.norm_fwd(x, None, None, w, b, spec, None, True)
    args = (torch.randn_like(x), None, x, None, w, b, rstd, mean, spec, x.dtype, None)
    torch.library.opcheck(torch.ops.fuseblock.norm_bwd.default, args, test_utils=("test_schema", "test_faketensor"))
    dw, db = torch.ops.fuseblock.norm_bwd(*args)[3:]
    assert (dw.dtype, db.dtype) == (torch.bfloat16, torch.float16)
