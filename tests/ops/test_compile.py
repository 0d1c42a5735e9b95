"""torch.compile(fullgraph=True): on the kernel path it traces the custom ops whole,
forward and backward; on the torch path it sees the plain torch ops, with no fuseblock op."""
import pytest
import torch
from helpers import DEVICE, KERNEL_PATH

import fuseblock
from fuseblock.ops.norm import norm_op
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


@pytest.mark.kernel
def test_fullgraph_inductor_forward_and_backward():
    """Inductor, not only aot_eager: on the kernel path (the interpreter too) the compiled
    code calls the custom ops, so the Triton kernels run, one launch forward."""
    torch._dynamo.reset()
    compiled = torch.compile(_fn, fullgraph=True)
    inputs = _inputs()
    _grads(compiled, inputs)  # compiles
    if KERNEL_PATH:
        from helpers import Launches

        launches = Launches()
    got = _grads(compiled, inputs)
    if KERNEL_PATH:
        assert launches["fwd"] == 1 and launches["bwd"] >= 1
    for a, b in zip(got, _grads(_fn, inputs), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.kernel
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graphs_capture_the_op_forward_and_backward():
    """A CUDA graph captured around add_norm's forward and backward (eager, the
    autograd.Function over the launchers) replays them: no host sync or host read inside;
    and torch.compile's reduce-overhead mode, which captures the compiled graph with
    the custom ops in it, matches eager."""
    inputs = [t.detach().requires_grad_() for t in _inputs()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up: compile the kernels, fill the caching allocator
            got = _grads(_fn, inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _grads(_fn, inputs)
    with torch.no_grad():
        for t in inputs:
            t.copy_(torch.randn_like(t))
    graph.replay()
    for a, b in zip(captured, _grads(_fn, inputs), strict=True):
        torch.testing.assert_close(a, b)

    torch._dynamo.reset()
    compiled = torch.compile(_fn, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # reduce-overhead records on the second call and replays after
        got = _grads(compiled, inputs)
    for a, b in zip(got, _grads(_fn, inputs), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    skips = torch._dynamo.utils.counters["inductor"]
    assert not any(k.startswith("cudagraph_skips") and v for k, v in skips.items()), dict(skips)


@pytest.mark.kernel
@pytest.mark.kernel_only("the custom op serves the Triton path")
def test_opcheck_fake_implementations():
    x, r = torch.randn(3, 16, requires_grad=True), torch.randn(3, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    torch.library.opcheck(
        norm_op.fwd_op,
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
    _, _, rstd, mean = norm_op.fwd_op(x, None, None, w, b, spec, None, True)
    args = (torch.randn_like(x), None, x, None, w, b, rstd, mean, spec, x.dtype, None)
    torch.library.opcheck(norm_op.bwd_op, args, test_utils=("test_schema", "test_faketensor"))
    dw, db = norm_op.bwd_op(*args)[3:5]
    assert (dw.dtype, db.dtype) == (torch.bfloat16, torch.float16)


@pytest.mark.kernel
@pytest.mark.kernel_only("the custom op serves the Triton path")
def test_opcheck_fake_stores_out_in_the_specs_out_dtype():
    """The spec's out_dtype is the output's dtype, in the kernel's store and in the fake."""
    x, w = torch.randn(3, 16).bfloat16(), torch.randn(16)
    spec = NormSpec(False, 1.0, 1e-6, Gate.NONE, Act.UNUSED, 1, out_dtype=torch.float32).pack()
    args = (x, None, None, w, None, spec, None, False)
    torch.library.opcheck(norm_op.fwd_op, args, test_utils=("test_schema", "test_faketensor"))
    assert norm_op.fwd_op(*args)[0].dtype == torch.float32


@pytest.mark.kernel
def test_fullgraph_traces_add_norm_with_out_dtype():
    """add_norm(out_dtype=fp32) on bf16 x under torch.compile(fullgraph=True): one graph,
    out in fp32, values and gradients equal to eager."""
    torch._dynamo.reset()

    def fn(x, r, w):
        out, res = fuseblock.add_norm(x, r, w, out_dtype=torch.float32)
        return out * 2 + res

    inputs = [torch.randn(3, 16).bfloat16().requires_grad_(), torch.randn(3, 16, requires_grad=True),
              torch.randn(16, requires_grad=True)]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = _grads(compiled, inputs), _grads(fn, inputs)
    assert got[0].dtype == torch.float32
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
