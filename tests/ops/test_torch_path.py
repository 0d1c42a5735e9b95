"""The torch path is plain torch (issue 16.1): where the Triton kernels do not run,
`add_norm` runs the same differentiable aten ops as the naive form, forward and backward,
with no custom op or autograd.Function in between; and the add_norm API of issue 14
(eps=None, the residual's promoted dtype)."""
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from ref64 import add_norm64, leaf64
from torch.utils._python_dispatch import TorchDispatchMode

import fuseblock

pytestmark = pytest.mark.torch_only("the torch path's ops")

# metadata ops: which of them a Python wrapper happens to call says nothing about the work
_METADATA = {"view", "_unsafe_view", "reshape", "detach", "alias", "expand", "t", "as_strided", "unsqueeze",
             "squeeze"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _METADATA:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _trace(fn, leaves):
    with _Ops() as mode:
        out, res = fn()
        torch.autograd.grad((out, res), leaves, (torch.ones_like(out), torch.ones_like(res)))
    return mode.ops, out


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_add_norm_runs_the_naive_forms_ops(kind, dtype):
    x, r = (torch.randn(3, 64, dtype=dtype, requires_grad=True) for _ in range(2))
    w = torch.randn(64, dtype=dtype, requires_grad=True)
    b = torch.randn(64, dtype=dtype, requires_grad=True) if kind == "layer" else None
    leaves = [t for t in (x, r, w, b) if t is not None]

    def naive():
        p = x + r
        out = F.layer_norm(p, (64,), w, b) if kind == "layer" else F.rms_norm(p, (64,), w)  # torch's default eps
        return out, p

    fused_ops, out = _trace(lambda: fuseblock.add_norm(x, r, w, b, kind=kind), leaves)
    naive_ops, ref = _trace(naive, leaves)
    assert fused_ops == naive_ops
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert "Eager" not in type(out.grad_fn).__name__  # no autograd.Function of ours


def test_no_custom_op_on_the_torch_path():
    x = torch.randn(2, 16, requires_grad=True)
    for out in (fuseblock.norm(x, kind="l2"), fuseblock.add_norm(x, x, gate=x, gate_position="pre")[0],
                fuseblock.embed_norm(x, "max")):
        assert "fuseblock" not in type(out.grad_fn).__name__ and "Eager" not in type(out.grad_fn).__name__


def test_wide_gated_layer_norm_gradients_stay_exact():
    """The composition (gates, groups, half precision, eps=0) centres on a detached shift:
    through autograd an attached shift gathers d cancelling terms (1e-3 off at d = 65536)."""
    d = 65536
    x, z = torch.randn(2, d), torch.randn(2, d)
    w = torch.randn(d)
    xs, zs, ws = leaf64(x).float(), leaf64(z).float(), leaf64(w).float()
    leaves = [t.detach().requires_grad_() for t in (x, z, w)]
    out, _ = fuseblock.add_norm(*leaves[:1], None, leaves[2], kind="layer", gate=leaves[1], gate_position="pre")
    ref, _ = add_norm64(*[leaf64(t) for t in (xs, )], None, leaf64(ws), kind="layer", gate=leaf64(zs),
                        gate_position="pre")
    cot = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, cot)
    ref_leaves = [leaf64(t) for t in (x, z, w)]
    ref = add_norm64(ref_leaves[0], None, ref_leaves[2], kind="layer", gate=ref_leaves[1], gate_position="pre")[0]
    want = torch.autograd.grad(ref, ref_leaves, cot.double())
    for name, g, rg in zip("xzw", got, want, strict=True):
        assert_close(g, rg, torch.float32, f"d{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_eps_none_is_torchs_default(dtype):
    x = torch.randn(4, 32, dtype=dtype) * 1e-3
    w = torch.randn(32, dtype=dtype)
    torch.testing.assert_close(fuseblock.norm(x, w, eps=None), F.rms_norm(x, (32,), w, None))
    # torch's eps=None is the computation dtype's: fp32's for fp16/bf16 inputs
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(fuseblock.norm(x, w, eps=None), fuseblock.norm(x, w, eps=eps))


def test_residual_defaults_to_the_promoted_dtype():
    """bf16 activations into an fp32 stream: the new residual stays fp32 (it was rounded to
    bf16 before issue 14), as torch's x + residual would; out keeps x's dtype."""
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    r = torch.randn(4, 32) * 1e3
    out, new_res = fuseblock.add_norm(x, r)
    assert new_res.dtype == torch.float32 and out.dtype == torch.bfloat16
    torch.testing.assert_close(new_res, x.float() + r, rtol=0, atol=0)
    out, new_res = fuseblock.add_norm(x, r.bfloat16())
    assert new_res.dtype == torch.bfloat16
    assert fuseblock.add_norm(x)[1] is x


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_the_fused_gpt_compiles_whole_into_plain_ops(norm):
    """torch.compile(fullgraph=True) of the fused GPT's training loss: one graph, no break,
    and no fuseblock op in it, so Inductor fuses the norms as it does the naive form's."""
    from models.gpt import GPT, GPTConfig

    torch._dynamo.reset()
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, norm=norm, fused=True))
    idx = torch.randint(0, 256, (2, 16))
    explained = torch._dynamo.explain(model)(idx, idx)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert "fuseblock" not in str(explained.graphs[0].graph)
    torch._dynamo.reset()


# ---------------------------------------------------------------- the plain call's lane
# A plain add_norm on the CPU torch path skips fuseblock's own checks (its eager cost is
# host time) and leaves to torch's ops what they refuse; what they would let through is
# checked on the lane, and every refusal re-runs the call through the named checks.

def _no_checks(*args, **kwargs):
    raise AssertionError("the general checks ran")


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plain_calls_take_the_lane_and_equal_the_naive_form(monkeypatch, kind, dtype):
    monkeypatch.setattr(fuseblock.ops.norm, "resolve", _no_checks)
    x, r = torch.randn(3, 5, 64, dtype=dtype), torch.randn(3, 5, 64, dtype=dtype)
    w, b = torch.randn(64, dtype=dtype), torch.randn(64, dtype=dtype)
    bias = b if kind == "layer" else None

    def norm(p, eps, w):
        if kind == "layer":  # eps=None: torch's default, F.layer_norm's 1e-5 or F.rms_norm's for p
            return F.layer_norm(p, (64,), w, bias, 1e-5 if eps is None else eps)
        return F.rms_norm(p, (64,), w, eps)

    for eps in (1e-5, None):
        out, res = fuseblock.add_norm(x, r, w, bias, kind=kind, eps=eps)
        torch.testing.assert_close(res, x + r, rtol=0, atol=0)
        torch.testing.assert_close(out, norm(x + r, eps, w), rtol=0, atol=0)
    out, res = fuseblock.add_norm(x, None, None, bias, kind=kind)
    assert res is x
    torch.testing.assert_close(out, norm(x, None, None), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs", [
    dict(gate=torch.randn(4, 8)), dict(num_groups=2), dict(c=1.0), dict(weight_offset=1.0),
    dict(residual_dtype=torch.float64), dict(kind="l2"), dict(eps=0.0), dict(eps=1),
    dict(x=torch.randn(4, 8, dtype=torch.bfloat16)), dict(residual=torch.randn(4, 8, dtype=torch.float16)),
    dict(bias=torch.randn(8)), dict(weight=torch.randn(8, dtype=torch.float16)),
], ids=lambda kw: next(iter(kw)) + "-" + str(next(iter(kw.values())))[:12].replace(" ", ""))
def test_every_other_call_takes_the_checked_path(monkeypatch, kwargs):
    monkeypatch.setattr(fuseblock.ops.norm, "resolve", _no_checks)
    args = dict(x=torch.randn(4, 8), residual=torch.randn(4, 8), weight=torch.randn(8)) | kwargs
    with pytest.raises(AssertionError, match="the general checks ran"):
        fuseblock.add_norm(args.pop("x"), args.pop("residual"), **args)


LANE_MISTAKES = [
    # (kind, kwargs, exception, what the message names): each is a call the lane takes up
    ("rms", dict(residual=torch.ones(1, 8)), ValueError, "residual"),  # would broadcast to x
    ("layer", dict(residual=torch.ones(1, 8)), ValueError, "residual"),
    ("rms", dict(residual=torch.ones(4, 8, dtype=torch.int64)), TypeError, "residual"),  # would promote
    ("rms", dict(weight=torch.ones(1, 8)), ValueError, "weight"),  # would broadcast
    ("rms", dict(weight=torch.ones(1)), ValueError, "weight"),
    ("rms", dict(weight=torch.ones(8, dtype=torch.int32)), TypeError, "weight"),  # would promote
    ("layer", dict(weight=torch.ones(1, 8)), ValueError, "weight"),  # torch refuses: the checks name it
    ("layer", dict(bias=torch.ones(9)), ValueError, "bias"),
    ("layer", dict(bias=torch.ones(8, dtype=torch.int32)), TypeError, "bias"),
    ("layer", dict(weight=torch.ones(8, device="meta")), ValueError, "weight"),
    ("rms", dict(x=torch.ones(4, 0), residual=None, weight=None), ValueError, "last dimension"),
    ("rms", dict(x=torch.tensor(1.0), residual=None, weight=None), ValueError, "x must have at least one"),
    ("layer", dict(x=torch.ones(4, 8, dtype=torch.complex64), residual=None, weight=None), TypeError, "x must"),
    ("rms", dict(eps=float("inf")), ValueError, "eps"),
    ("rms", dict(eps=True), TypeError, "eps"),
    ("rms", dict(num_groups=True), TypeError, "num_groups"),
    ("rms", dict(weight_offset=False), TypeError, "weight_offset"),
]


@pytest.mark.parametrize("kind,kwargs,exc,named", LANE_MISTAKES, ids=[f"{c[0]}-{c[3]}-{i}"
                                                                     for i, c in enumerate(LANE_MISTAKES)])
def test_mistakes_on_the_lane_are_named(kind, kwargs, exc, named):
    args = dict(x=torch.randn(4, 8), residual=torch.randn(4, 8), weight=torch.randn(8)) | kwargs
    with pytest.raises(exc, match=named):
        fuseblock.add_norm(args.pop("x"), args.pop("residual"), kind=kind, **args)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_a_weight_in_another_float_dtype_is_cast_as_the_checked_path_does(kind):
    """torch's layer_norm refuses an fp16 weight for fp32 x, and its rms_norm would
    promote an fp64 one; the checked path casts both to p's dtype, as before the lane."""
    x, r = torch.randn(4, 8), torch.randn(4, 8)
    for wdtype in (torch.float16, torch.float64):
        w = torch.randn(8, dtype=wdtype)
        out, _ = fuseblock.add_norm(x, r, w, kind=kind)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, fuseblock.add_norm(x, r, w.float(), kind=kind)[0], rtol=0, atol=0)
