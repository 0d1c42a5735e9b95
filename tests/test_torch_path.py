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
        out = F.layer_norm(p, (64,), w, b, 1e-6) if kind == "layer" else F.rms_norm(p, (64,), w, 1e-6)
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
