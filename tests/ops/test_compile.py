"""torch.compile(fullgraph=True): on the kernel path it traces the custom ops whole,
forward and backward; on the torch path it sees the plain torch ops, with no fuseblock op."""
import contextlib

import pytest
import torch
from helpers import DEVICE, INTERPRETED, KERNEL_PATH

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
    """Inductor, not only aot_eager. Under the interpreter the compiled code calls the
    custom ops, whose launchers run, one launch forward; on a GPU the graph holds the
    kernels (triton_ops), which Inductor launches itself: fuseblock's launchers ran once,
    while the graph was traced, and run no more."""
    torch._dynamo.reset()
    compiled = torch.compile(_fn, fullgraph=True)
    inputs = _inputs()
    _grads(compiled, inputs)  # compiles
    if KERNEL_PATH:
        from helpers import Launches

        from fuseblock.ops.registry import TRITON_OPS

        launches = Launches()
    got = _grads(compiled, inputs)
    if KERNEL_PATH and TRITON_OPS:
        assert launches["fwd"] == launches["bwd"] == 0, "a launcher ran in the compiled step"
    elif KERNEL_PATH:
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


# ---------------------------------------------------------------- the kernels in the compiled graph
# Where torch has triton_op (fuseblock.ops.registry.TRITON_OPS: not under the interpreter, whose
# kernels wrap_triton cannot record), a compiled call's graph holds the Triton kernels themselves.
# Traced here under kernels_on_cpu: CPU tensors go to the launchers, which run once on fake tensors
# while the graph is captured; nothing is launched (the compiled functions below never run).
def _graph_tests_problem():
    if INTERPRETED:
        return "under the interpreter the ops are custom ops (wrap_triton cannot record its kernels)"
    try:
        from fuseblock.ops.registry import TRITON_OPS
        from fuseblock.testing.targets import backend_problem
    except ImportError as e:
        return f"no triton ({e})"
    if not TRITON_OPS:
        return f"torch {torch.__version__} has no torch.library.triton_op: the ops are custom ops"
    return backend_problem("sm_90")


graph_only = pytest.mark.skipif(_graph_tests_problem() is not None, reason=str(_graph_tests_problem()))


class _Captured(Exception):
    """Raised by the compiled graphs instead of running them."""


@contextlib.contextmanager
def _sm90_driver():
    """Triton's active driver as an H100's, with no GPU: torch.compile's analysis of what a
    kernel writes compiles it to TTIR for the active target (with none it assumes every
    tensor argument is written, and the graph clones every input). A GPU keeps its own."""
    import triton
    from triton.backends.compiler import GPUTarget

    if torch.cuda.is_available():
        yield
        return

    class Driver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    config = triton.runtime.driver
    before = config._active  # None until a launch asks: reset_active() would create one, and fail
    config.set_active(Driver())
    try:
        yield
    finally:
        config.set_active(before)


def _joint_graph(fn, *args):
    """The AOT joint (forward + backward) graph of torch.compile(fn, fullgraph=True) on args,
    traced on the kernel path (kernels_on_cpu): a torch.fx.Graph."""
    from functorch.compile import default_partition
    from torch._dynamo.backends.common import aot_autograd

    from fuseblock.ops.dispatch import kernels_on_cpu

    joint = []

    def partition(gm, inputs, **kwargs):
        joint.append(gm)
        return default_partition(gm, inputs, **kwargs)

    def never_run(gm, example_inputs):
        def run(*_):
            raise _Captured

        return run

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=never_run, bw_compiler=never_run, partition_fn=partition)
    with kernels_on_cpu(), _sm90_driver(), pytest.raises(_Captured):
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert len(joint) == 1, "one graph: no graph break"
    return joint[0].graph


def _kernel_nodes(graph):
    return [n for n in graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]


def _kernel_of(node):
    """(the JITFunction, its constant arguments) of a Triton kernel node."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    return getattr(kernel, "fn", kernel), kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])


def _stack(dim=16, depth=1, dropout=0.25):
    torch.manual_seed(0)
    return fuseblock.ResidualStack([torch.nn.Linear(dim, dim) for _ in range(depth)], dim, dropout=dropout)


@graph_only
def test_compiled_stack_holds_the_stream_kernels_with_fresh_dropout_keys():
    """A ResidualStack with dropout, compiled whole: its joint graph holds the stream's
    kernels as Triton kernel nodes (the first norm and the add_norm into the final norm,
    forward and backward) and no fuseblock:: op, so Inductor launches them itself. The
    graph clones no input: only the buffers a kernel writes, allocated for it.

    No seed is frozen into it (CUDA graphs replay it): the dropout kernel reads its key
    from a tensor the graph draws, randint on x's device (a CUDA graph records it as a draw
    of the device generator, new at each replay), and the backward regenerates the masks
    from that same tensor."""
    stack = _stack()
    x = torch.randn(2, 3, 16, requires_grad=True)
    graph = _joint_graph(lambda t: stack(t).square().sum(), x)
    assert not [n for n in graph.nodes if "fuseblock" in str(n.target)]
    nodes = _kernel_nodes(graph)
    names = [_kernel_of(n)[0].fn.__name__ for n in nodes]
    assert names == ["_fwd_tile", "_fwd_tile", "_bwd_tile", "_bwd_tile"], names
    inputs = {n for n in graph.nodes if n.op == "placeholder"}
    for n in nodes:
        written = n.kwargs["tensors_to_clone"]
        assert written, f"{n}: the write analysis found nothing written"
        for name in written:
            arg = n.kwargs["kwargs"][name]
            assert arg not in inputs and arg.target is torch.ops.aten.empty.memory_format, (n.name, name, arg)
    from fuseblock.kernels.norm import fold_flags

    seeds = {}
    for n in nodes:
        kernel, constants = _kernel_of(n)
        assert constants.get("SEED") is None, "a constant key: every replay would draw the same masks"
        args = constants | n.kwargs["kwargs"]  # the tile kernels take DROPOUT folded into FLAGS
        if args["FLAGS"] & fold_flags({"DROPOUT": True}):
            seeds[kernel.fn.__name__] = n.kwargs["kwargs"]["SEED"]
    assert seeds.keys() == {"_fwd_tile", "_bwd_tile"}
    assert seeds["_fwd_tile"] is seeds["_bwd_tile"]
    assert seeds["_fwd_tile"].target is torch.ops.aten.randint.low and seeds["_fwd_tile"].kwargs["device"] == x.device


def _eager_launches(fn, *args):
    """The launches of fn(*args) and its backward in eager mode, recorded, not run."""
    from fuseblock.ops.dispatch import kernels_on_cpu
    from fuseblock.testing.targets import captured_launches

    with kernels_on_cpu(), captured_launches() as got:
        fn(*args).backward()
    return got


def _values(fn, given: dict) -> dict:
    """The non-tensor arguments of a launch by name, defaults filled in (None: absent), less
    the dropout key (an int in eager, drawn on the host; a tensor in the graph)."""
    every = {p.name: p.default for p in fn.params if p.has_default} | given
    return {k: v for k, v in every.items()
            if k in fn.arg_names and k != "SEED" and not isinstance(v, (torch.Tensor, torch.fx.Node))}


@graph_only
@pytest.mark.parametrize("case", ["layer_gate", "dropout_x1", "wide_dropout"])
def test_compiled_graph_launches_what_eager_launches(case, request):
    """The graph's kernel nodes are the launches the eager call makes, in order: the same
    kernels, grids, constexprs and scalars, tensors in the same arguments; the wide rows'
    dropout backward (`bwd_cols`, launched with maxnreg) included, through its one-config
    autotuner."""
    if case == "wide_dropout":
        request.getfixturevalue("small_wide_rows")
    d = 40 if case == "wide_dropout" else 16
    x, r, x1, g = (torch.randn(3, 4, d, requires_grad=True) for _ in range(4))
    w, b = torch.randn(d, requires_grad=True), torch.randn(d, requires_grad=True)

    def fn(x, r, x1, g, w, b):
        if case == "layer_gate":
            out, res = fuseblock.add_norm(x, r, w, b, kind="layer", gate=g, gate_act="silu")
        else:
            out, res = fuseblock.add_norm(x, r, w, x1=x1, alpha=0.5, dropout_p=0.25)
        return out.square().sum() + res.sum()

    args = (x, r, x1, g, w, b)
    eager = _eager_launches(fn, *args)
    nodes = _kernel_nodes(_joint_graph(fn, *args))
    assert [n.fn.__name__ for n in eager] == [_kernel_of(n)[0].fn.__name__ for n in nodes]
    if case == "wide_dropout":  # launched with maxnreg: torch.compile takes it in a triton.Config
        cols = [n for n in nodes if _kernel_of(n)[0].fn.__name__ == "bwd_cols"]
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

        (config,) = kernel_side_table.get_kernel(cols[0].kwargs["kernel_idx"]).configs
        assert config.maxnreg == 255 and config.num_warps == 8
    for launch, node in zip(eager, nodes, strict=True):
        kernel, constants = _kernel_of(node)
        named = dict(zip(kernel.arg_names, launch.args, strict=False)) | launch.kwargs
        traced = node.kwargs["kwargs"] | constants
        assert node.kwargs["grid"] == [tuple(launch.grid) + (1,) * (3 - len(launch.grid))]
        assert _values(kernel, traced) == _values(kernel, named), kernel.fn.__name__
        tensors = {k for k, v in named.items() if isinstance(v, torch.Tensor)} - {"SEED"}
        assert tensors == {k for k, v in traced.items() if isinstance(v, torch.fx.Node)} - {"SEED"}


@pytest.mark.kernel
def test_compiled_code_draws_the_dropout_key_on_xs_device():
    """Under torch.compile the dropout key is a draw on x's device, an op of the graph
    (a CPU draw, as eager's host key, would keep a CUDA graph from being recorded, or
    freeze the key into it): here x on the meta device, whatever the machine."""
    from fuseblock.ops.seed import draw_seed

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(draw_seed, backend=capture, fullgraph=True)(torch.empty(2, device="meta"))
    (draw,) = [n for n in graphs[0].nodes if n.target is torch.randint]
    assert torch.device(draw.kwargs["device"]) == torch.device("meta")


@pytest.mark.kernel
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_draw_new_dropout_masks():
    """Dropout in a captured CUDA graph (the eager launchers) and under reduce-overhead:
    each replay draws new masks, as each eager step does, and its backward regenerates
    that replay's masks: dx = keep / (1 - p) is zero exactly where new_residual is the
    residual alone. No cudagraph skip (a CPU op, a host read would cause one)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 256, device="cuda", generator=g).requires_grad_()
    r, w = torch.randn(64, 256, device="cuda", generator=g), torch.randn(256, device="cuda", generator=g)

    def step(x, r, w):
        _, res = fuseblock.add_norm(x, r, w, dropout_p=0.5)
        (dx,) = torch.autograd.grad(res.sum(), [x])
        return res, dx

    def check(replays):
        for res, dx in replays:
            torch.testing.assert_close(dx, torch.where(res == r, 0.0, 2.0))
        assert not torch.equal(replays[0][1], replays[1][1]), "a replay reused the last one's masks"

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(x, r, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(x, r, w)
    replays = []
    for _ in range(2):
        graph.replay()
        replays.append([t.clone() for t in captured])
    check(replays)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda x, r, w: fuseblock.add_norm(x, r, w, dropout_p=0.5)[1], fullgraph=True,
                             mode="reduce-overhead")
    replays = []
    for _ in range(4):  # recorded on the second call, replayed after (forward and backward)
        torch.compiler.cudagraph_mark_step_begin()
        res = compiled(x, r, w)
        (dx,) = torch.autograd.grad(res.sum(), [x])
        replays.append([res.clone(), dx.clone()])
    check(replays[2:])
    skips = torch._dynamo.utils.counters["inductor"]
    assert not any(k.startswith("cudagraph_skips") and v for k, v in skips.items()), dict(skips)
