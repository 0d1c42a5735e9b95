"""fuseblock.serve: vLLM's in-place entry points, bitwise the training op's forward."""
import pytest
import torch
from helpers import INTERPRETED, KERNEL_PATH, generator

import fuseblock
from fuseblock import serve

pytestmark = pytest.mark.kernel

EPS = 1e-6


def _data(rows, d, dtype, rdtype=None, seed=0):
    g = generator(seed)
    x = torch.randn(rows, d, generator=g).to(dtype) * 2 + 0.5
    r = torch.randn(rows, d, generator=g).to(rdtype or dtype)
    w = (torch.randn(d, generator=g) * 0.1 + 1).to(dtype)
    b = torch.randn(d, generator=g).to(dtype)
    return x, r, w, b


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype,rdtype", [(torch.float32, None), (torch.bfloat16, None),
                                          (torch.bfloat16, torch.float32), (torch.float16, None)],
                         ids=["fp32", "bf16", "bf16-fp32-residual", "fp16"])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0], ids=["w", "1+w"])
def test_fused_add_norm_is_the_training_forward_bitwise(kind, dtype, rdtype, weight_offset):
    x, r, w, b = _data(37, 48, dtype, rdtype)
    bias = b if kind == "layer" else None
    out, new_res = fuseblock.add_norm(x, r, w, bias, kind=kind, eps=EPS, weight_offset=weight_offset,
                                      residual_dtype=r.dtype)
    xi, ri = x.clone(), r.clone()
    with torch.inference_mode():
        if kind == "rms":
            got = serve.fused_add_rms_norm(xi, ri, w, EPS, weight_offset=weight_offset)
        else:
            got = serve.fused_add_layer_norm(xi, ri, w, bias, EPS, weight_offset=weight_offset)
    assert got is None
    assert torch.equal(ri, new_res) and torch.equal(xi, out)
    # and the training op against the fp64 math: the serving entry inherits its accuracy
    p = x.double() + r.double()
    ref = (torch.nn.functional.layer_norm(p, (48,), eps=EPS) if kind == "layer" else
           p * torch.rsqrt(p.square().mean(-1, keepdim=True) + EPS)) * (weight_offset + w.double())
    if bias is not None:
        ref = ref + bias.double()
    torch.testing.assert_close(xi.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_into_out_and_in_place(kind, dtype):
    x, _, w, b = _data(3 * 5, 40, dtype)
    x = x.view(3, 5, 40)
    bias = b if kind == "layer" else None
    want = fuseblock.norm(x, w, bias, kind=kind, eps=EPS)
    out = torch.full_like(x, float("nan"))
    call = (lambda o, i: serve.rms_norm(o, i, w, EPS)) if kind == "rms" else (
        lambda o, i: serve.layer_norm(o, i, w, bias, EPS))
    with torch.no_grad():
        call(out, x)
        assert torch.equal(out, want)
        y = x.clone()
        call(y, y)  # out is input: the documented in-place norm
    assert torch.equal(y, want)


def test_rows_by_stride():
    # a row-strided input (every other row of a buffer) and out: no copy, the same bits
    buf, _, w, _ = _data(20, 48, torch.float32)
    x = buf[::2]
    out = torch.empty(20, 48)[1::2]
    with torch.no_grad():
        serve.rms_norm(out, x, w, EPS)
    assert torch.equal(out, fuseblock.norm(x, w, eps=EPS))


@pytest.mark.kernel_only("the wide-row kernel's two passes over rows written in place")
def test_in_place_wide_rows(small_wide_rows):
    x, r, w, b = _data(9, 40, torch.float32)
    out, new_res = fuseblock.add_norm(x, r, w, b, kind="layer", eps=EPS, residual_dtype=r.dtype)
    xi, ri = x.clone(), r.clone()
    with torch.no_grad():
        serve.fused_add_layer_norm(xi, ri, w, b, EPS)
        y = x.clone()
        serve.layer_norm(y, y, w, b, EPS)
    assert torch.equal(ri, new_res) and torch.equal(xi, out)
    assert torch.equal(y, fuseblock.norm(x, w, b, kind="layer", eps=EPS))


def test_overlapping_storage_is_refused():
    x, r, w, _ = _data(8, 48, torch.float32)
    buf = torch.randn(9, 48)
    with torch.no_grad():
        with pytest.raises(ValueError, match="input and residual must not share memory"):
            serve.fused_add_rms_norm(x, x, w, EPS)
        with pytest.raises(ValueError, match="input and residual must not share memory"):
            serve.fused_add_rms_norm(buf[:8], buf[1:], w, EPS)
        with pytest.raises(ValueError, match="out overlaps input in part"):
            serve.rms_norm(buf[1:], buf[:8], w, EPS)
        with pytest.raises(ValueError, match="out overlaps input in part"):
            serve.rms_norm(buf[:8, :47], buf[:8, 1:], w[1:], EPS)
        # disjoint rows of one buffer are fine
        top, bottom = torch.randn(16, 48).split(8)
        want = fuseblock.norm(bottom, w, eps=EPS)
        serve.rms_norm(top, bottom, w, EPS)
        assert torch.equal(top, want)


def test_bad_arguments_are_named():
    x, r, w, _ = _data(4, 48, torch.float32)
    with torch.no_grad():
        with pytest.raises(ValueError, match="residual must have input's shape"):
            serve.fused_add_rms_norm(x, r[:2], w, EPS)
        with pytest.raises(ValueError, match="out must have input's dtype"):
            serve.rms_norm(x.half(), x, w, EPS)
        with pytest.raises(ValueError, match="unit stride in its last dim"):
            serve.rms_norm(torch.empty(48, 4).t(), x, w, EPS)
        with pytest.raises(TypeError, match="eps"):
            serve.rms_norm(torch.empty_like(x), x, w, "1e-6")
        with pytest.raises(ValueError, match="weight"):
            serve.rms_norm(torch.empty_like(x), x, w[:3], EPS)
    with pytest.raises(ValueError, match="no autograd"):
        serve.rms_norm(torch.empty_like(x), x.requires_grad_(), w, EPS)


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op a call dispatches outside the Triton interpreter's own launches (the
    interpreter wraps each argument's storage in a new tensor, which a GPU launch does not)."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.kernel_only("the kernel path's promise: the torch path allocates as eager torch does")
def test_a_call_allocates_nothing(monkeypatch):
    from triton.runtime import interpreter

    x, r, w, b = _data(16, 48, torch.float32)
    out = torch.empty_like(x)
    with torch.no_grad():
        serve.fused_add_layer_norm(x, r, w, b, EPS)  # the first call of a shape validates its spec
        serve.rms_norm(out, x, w, EPS)
    mode = _Ops()
    launched = []
    if INTERPRETED:  # the interpreter's own tensors are not the call's ops; it counts the launches
        real = interpreter.GridExecutor.__call__

        def launch(self, *a, **k):
            mode.paused += 1
            try:
                return real(self, *a, **k)
            finally:
                mode.paused -= 1

        monkeypatch.setattr(interpreter.GridExecutor, "__call__", launch)
        monkeypatch.setattr(interpreter.GridExecutor, "__init__", lambda s, *a, f=interpreter.GridExecutor.__init__,
                            **k: launched.append(1) or f(s, *a, **k))
    with torch.no_grad(), mode:
        serve.fused_add_layer_norm(x, r, w, b, EPS)
        serve.rms_norm(out, x, w, EPS)
        serve.rms_norm(x, x, w, EPS)
    # views of the caller's tensors only: no factory, copy or out-of-place op
    assert {str(f) for f in mode.ops} <= {"aten.view.default"}, mode.ops
    assert len(launched) == (3 if INTERPRETED else 0)  # one launch a call (counted under the interpreter)
    mode.ops.clear()
    with torch.no_grad(), mode:  # the count sees allocations: the training op's, for one
        fuseblock.add_norm(x, r, w, b, kind="layer", eps=EPS)
    assert any("empty" in str(f) for f in mode.ops), mode.ops


def test_torch_path_matches_too_and_says_which_path_ran():
    # the same bits on whichever path this run tests (KERNEL_PATH: the Triton kernels)
    from fuseblock.ops.dispatch import uses_triton

    x, r, w, _ = _data(5, 48, torch.float32)
    assert uses_triton(x) == KERNEL_PATH
    out, new_res = fuseblock.add_norm(x, r, w, eps=EPS, residual_dtype=r.dtype)
    with torch.no_grad():
        serve.fused_add_rms_norm(x, r, w, EPS)
    assert torch.equal(x, out) and torch.equal(r, new_res)


def test_written_tensors_that_overlap_themselves_are_refused():
    # an expanded (stride-0) residual, input or out: every token would write one row
    x, r, w, _ = _data(6, 48, torch.float32)
    row = torch.randn(1, 48)
    with torch.no_grad():
        with pytest.raises(ValueError, match="residual overlaps itself"):
            serve.fused_add_rms_norm(x, row.expand(6, 48), w, EPS)
        with pytest.raises(ValueError, match="input overlaps itself"):
            serve.fused_add_rms_norm(row.expand(6, 48), r, w, EPS)
        with pytest.raises(ValueError, match="out overlaps itself"):
            serve.rms_norm(row.expand(6, 48), x, w, EPS)
        with pytest.raises(ValueError, match="out overlaps itself"):  # rows of 48 every 24 elements
            serve.rms_norm(torch.randn(200).as_strided((6, 48), (24, 1)), x, w, EPS)
        with pytest.raises(ValueError, match="residual overlaps itself"):  # (2, 3, 48), the batch dim expanded
            serve.fused_add_layer_norm(x.view(2, 3, 48), r[:3].expand(2, 3, 48), w, None, EPS)
        # an expanded input that is only read is fine, and so is a row-strided out
        out = torch.zeros(6, 96)[:, :48]
        serve.rms_norm(out, row.expand(6, 48), w, EPS)
        assert torch.equal(out, fuseblock.norm(row.expand(6, 48).contiguous(), w, eps=EPS))


def test_a_compiled_graph_holds_the_serving_entries():
    # vLLM compiles the whole graph (fullgraph): each entry is one op declaring what it writes
    def step(x, r, w, b, out):
        serve.fused_add_rms_norm(x, r, w, EPS)
        serve.rms_norm(out, x, w, EPS)
        serve.fused_add_layer_norm(out, r, w, b, EPS, weight_offset=1.0)
        serve.layer_norm(x, x, w, b, EPS)  # in place
        return x * 2

    x, r, w, b = _data(6, 48, torch.float32)
    args = (x, r, w, b, torch.empty_like(x))
    eager, compiled = [t.clone() for t in args], [t.clone() for t in args]
    torch._dynamo.reset()
    with torch.no_grad():
        want = step(*eager)
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled)
    assert torch.equal(got, want)
    for a, b_ in zip(compiled, eager, strict=True):
        assert torch.equal(a, b_)
