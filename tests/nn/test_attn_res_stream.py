"""AttnResStack (fuseblock/attn_res_stream.py, docs/stream.md "Attention residuals"): the fused
stack equals its naive twin (fused=False, same parameters and state_dict) and an fp64 stack
written out here from the formulas, values and every gradient, on both paths; side inputs
reach the mixers that accept them; launches per stack; bad arguments refused."""
import copy

import pytest
import torch
from helpers import MLP, KeywordMixer, assert_close

import fuseblock
from fuseblock.attn_res_stream import AttnResStack

D, SHAPE, EPS = 16, (2, 3, 16), 1e-5



def stack(block_size: int, n: int = 5, **kw) -> AttnResStack:
    s = AttnResStack([KeywordMixer(D) if i % 2 else MLP(D) for i in range(n)], D, block_size=block_size, eps=EPS, **kw)
    with torch.no_grad():  # away from the init's uniform mix and unit weights
        for name, p in s.named_parameters():
            if name.endswith("query") or name.endswith("weight") and p.dim() == 1:
                p.add_(0.5 * torch.randn_like(p))
    return s


def stack64(s: AttnResStack, x, scale=1.0):
    """The stack in fp64 from the formulas: blocks b_0 = x, b_n = sum of block n's outputs;
    sublayer k mixes the finished blocks and its block's partial sum (when not empty)."""
    def mix(states, p):
        v = torch.stack(states, -2)
        k = v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-6)
        a = torch.softmax(k @ p.query.double(), -1)
        m = (a[..., None] * v).sum(-2)
        return m / torch.sqrt((m * m).mean(-1, keepdim=True) + EPS) * p.weight.double()

    m64 = copy.deepcopy(s).double()
    blocks, partial = [x.double()], None
    for i, block in enumerate(m64.blocks):
        if i and i % s.block_size == 0:
            blocks, partial = [*blocks, partial], None
        out = block.mixer(mix(blocks + ([partial] if partial is not None else []), block),
                          **({"scale": scale} if isinstance(block.mixer, KeywordMixer) else {}))
        out = out[0] if isinstance(out, tuple) else out
        partial = out if partial is None else partial + out
    return mix([*blocks, partial], m64.head), m64


@pytest.mark.kernel
@pytest.mark.parametrize("block_size", [1, 2, 5])
def test_fused_equals_naive_and_fp64(block_size):
    torch.manual_seed(block_size)
    s = stack(block_size)
    naive = copy.deepcopy(s)
    naive.fused = False
    x = torch.randn(SHAPE, requires_grad=True)
    y, yn = s(x, scale=0.5), naive(x, scale=0.5)
    want, m64 = stack64(s, x, scale=0.5)
    assert_close(y, want, torch.float32, "fused")
    assert_close(yn, want, torch.float32, "naive")
    cot = torch.randn(SHAPE)
    g = torch.autograd.grad((y * cot).sum(), [x, *s.parameters()])
    gn = torch.autograd.grad((yn * cot).sum(), [x, *naive.parameters()])
    g64 = torch.autograd.grad((want * cot.double()).sum(), [x, *m64.parameters()])
    names = ["x"] + [n for n, _ in s.named_parameters()]
    for name, a, b, c in zip(names, g, gn, g64, strict=True):
        assert_close(a, c, torch.float32, f"d{name} fused", cond=2.0)
        assert_close(b, c, torch.float32, f"d{name} naive", cond=2.0)


def test_one_state_dict_and_extras():
    s = stack(2, return_extras=True)
    naive = AttnResStack([KeywordMixer(D) if i % 2 else MLP(D) for i in range(5)], D, block_size=2, eps=EPS,
                         fused=False, return_extras=True)
    naive.load_state_dict(s.state_dict())
    assert list(s.state_dict()) == list(naive.state_dict())
    assert fuseblock.AttnResStack is AttnResStack
    x = torch.randn(SHAPE)
    (y, ex), (yn, exn) = s(x, scale=2.0), naive(x, scale=2.0)
    torch.testing.assert_close(y, yn, rtol=1e-5, atol=1e-5)
    assert len(ex) == 5 and ex[0] == () and len(ex[1]) == 1  # the keyword mixers' extra
    torch.testing.assert_close(ex[1][0], exn[1][0], rtol=1e-4, atol=1e-4)


@pytest.mark.kernel
@pytest.mark.kernel_only("counts the Triton launches")
def test_one_launch_per_sublayer_and_head(launches):
    """L sublayers: L + 1 forward launches (the first attn_res_norm, the rest and the head
    attn_res_add_norm), two backward each."""
    s = stack(2)
    x = torch.randn(SHAPE, requires_grad=True)
    y = s(x)
    assert launches["attn_res_fwd"] == 6
    y.sum().backward()
    assert launches["attn_res_bwd"] == 12


def test_bad_arguments():
    with pytest.raises(ValueError, match="more than 16: use block_size >= 2"):
        AttnResStack([MLP(D) for _ in range(16)], D, block_size=1)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        AttnResStack([MLP(D)], D, block_size=0)
    with pytest.raises(ValueError, match="at least one"):
        AttnResStack([], D, block_size=1)
    with pytest.raises(TypeError, match="mixers must be an iterable"):
        AttnResStack(MLP(D), D, block_size=1)
    with pytest.raises(TypeError, match="no mixer's forward accepts"):
        stack(2)(torch.randn(SHAPE), nope=1)
    with pytest.raises(ValueError, match="key_eps must be finite"):
        AttnResStack([MLP(D)], D, block_size=1, key_eps=float("nan"))

