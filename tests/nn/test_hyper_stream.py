"""HyperConnectionStack (fuseblock/hyper_stream.py, docs/stream.md "n streams"): the fused
stack equals its naive twin (fused=False, same parameters and state_dict) and an fp64
stack written out here from the formulas, values and every gradient, on both paths; side
inputs reach the mixers that accept them; launches per stack; bad arguments refused."""
import copy

import pytest
import torch
from helpers import KERNEL_PATH, MLP, AllLaunches, KeywordMixer, assert_close
from torch import nn

import fuseblock

D, SHAPE, EPS, HC_EPS = 16, (2, 3, 16), 1e-5, 1e-6



def stack(n: int, iters: int = 3, **kw) -> fuseblock.HyperConnectionStack:
    s = fuseblock.HyperConnectionStack([KeywordMixer(D), MLP(D), KeywordMixer(D)], D, streams=n, iters=iters, eps=EPS,
                                       hc_eps=HC_EPS, init_std=0.3, **kw)
    with torch.no_grad():  # away from the init's symmetric base and unit scales
        for p in s.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return s


def coefficients64(H, p, n, iters, post_mult):
    flat = H.flatten(-2)
    mix = (flat @ p.fn.T) / torch.sqrt((flat * flat).mean(-1, keepdim=True) + EPS)
    pre = 1 / (1 + torch.exp(-(mix[..., :n] * p.scale[0] + p.base[:n]))) + HC_EPS
    if p.fn.shape[0] == n:
        return pre, None, None
    post = post_mult / (1 + torch.exp(-(mix[..., n:2 * n] * p.scale[1] + p.base[n:2 * n])))
    logits = (mix[..., 2 * n:] * p.scale[2] + p.base[2 * n:]).reshape(*mix.shape[:-1], n, n)
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    comb = e / e.sum(-1, keepdim=True) + HC_EPS
    comb = comb / (comb.sum(-2, keepdim=True) + HC_EPS)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + HC_EPS)
        comb = comb / (comb.sum(-2, keepdim=True) + HC_EPS)
    return pre, post, comb


def collapse_norm64(H, pre, w):
    z = (pre[..., None] * H).sum(-2)
    return z / torch.sqrt((z * z).mean(-1, keepdim=True) + EPS) * w


def stack64(s, x, n, iters, **kw):
    """The naive layer in fp64 from the formulas: coefficients, sublayer, update; the head."""
    s = copy.deepcopy(s).double()
    H = x.double()[..., None, :].expand(*x.shape[:-1], n, x.shape[-1])
    for block in s.blocks:
        pre, post, comb = coefficients64(H, block, n, iters, 2.0)
        out = block.mixer(collapse_norm64(H, pre, block.weight), **({} if isinstance(block.mixer, MLP) else kw))
        out = out[0] if isinstance(out, tuple) else out
        H = post[..., None] * out[..., None, :] + torch.einsum("...ji,...jd->...id", comb, H)
    pre, _, _ = coefficients64(H, s.head, n, 1, 1.0)
    return collapse_norm64(H, pre, s.head.weight), list(s.parameters())


@pytest.mark.kernel
@pytest.mark.parametrize("n", [1, 4])
def test_fused_equals_naive_and_fp64_values_and_gradients(n):
    s = stack(n)
    x = torch.randn(SHAPE, requires_grad=True)
    dy = torch.randn(SHAPE)
    results = []
    for fused in (True, False):
        s.fused = fused
        y = s(x, scale=1.5)
        grads = torch.autograd.grad(y, [x, *s.parameters()], dy)
        results.append((y, grads))
    x64 = x.detach().double().requires_grad_()
    y64, params64 = stack64(s, x64, n, 3, scale=1.5)
    want = torch.autograd.grad(y64, [x64, *params64], dy.double())
    names = ["x"] + [k for k, _ in s.named_parameters()]
    for y, grads in results:
        assert_close(y, y64, torch.float32, "out")
        for name, g, g64 in zip(names, grads, want, strict=True):
            assert_close(g, g64, torch.float32, f"grad {name}", cond=4.0)
    if not KERNEL_PATH:  # the torch path runs the naive twin's ops in the same order
        assert torch.equal(results[0][0], results[1][0])


def test_one_state_dict_and_extras_in_both_forms():
    s = stack(2, return_extras=True)
    x = torch.randn(SHAPE)
    out_f, extras_f = s(x, scale=2.0)
    s.fused = False
    out_n, extras_n = s(x, scale=2.0)
    assert [len(e) for e in extras_f] == [1, 0, 1] == [len(e) for e in extras_n]
    torch.testing.assert_close(extras_f[0][0], extras_n[0][0])
    twin = stack(2, fused=False, return_extras=True)
    twin.load_state_dict(s.state_dict())  # one checkpoint serves both forms
    assert s.state_dict().keys() == twin.state_dict().keys()
    assert torch.equal(twin(x, scale=2.0)[0], out_n)
    keys = set(s.state_dict())
    assert {"blocks.0.fn", "blocks.0.base", "blocks.0.scale", "blocks.0.weight", "head.fn", "head.weight"} <= keys
    assert s.blocks[0].fn.shape == (2 * 2 + 4, 2 * D) and s.head.fn.shape == (2, 2 * D)


@pytest.mark.kernel
@pytest.mark.kernel_only("counts the Triton launches")
def test_one_launch_per_boundary_forward():
    s = fuseblock.HyperConnectionStack([nn.Identity() for _ in range(3)], D, streams=4)
    x = torch.randn(SHAPE, requires_grad=True)
    with AllLaunches() as fwd:
        out = s(x)
    with AllLaunches() as bwd:
        out.sum().backward()
    assert fwd.kernels == 4  # 3 sublayers and the head
    assert bwd.kernels <= 3 * 4


def test_bad_arguments_refused_by_name():
    mixers = [nn.Identity()]
    for kw, word in [(dict(streams=0), "streams"), (dict(streams=17), "streams"), (dict(iters=0), "iters"),
                     (dict(hc_eps=-1.0), "hc_eps"), (dict(eps=-1.0), "eps")]:
        with pytest.raises(ValueError, match=word):
            fuseblock.HyperConnectionStack(mixers, D, **kw)
    with pytest.raises(ValueError, match="at least one"):
        fuseblock.HyperConnectionStack([], D)
    with pytest.raises(TypeError, match="mixers"):
        fuseblock.HyperConnectionStack(nn.Linear(D, D), D)
    for fused in (True, False):
        s = fuseblock.HyperConnectionStack([nn.Identity(), nn.Linear(D, 4)], D, fused=fused)
        with pytest.raises(ValueError, match=r"mixers\[1\] \(Linear\)"):
            s(torch.randn(SHAPE))
    with pytest.raises(TypeError, match="'mask'"):
        stack(2)(torch.randn(SHAPE), mask=None)
