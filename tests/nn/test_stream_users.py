"""The stream modules take what users have: an existing norm module as
PreNormBlock's norm (its own Parameters), positional side inputs through ResidualStack,
the stack as the container it replaces, gradient checkpointing per block, and the key
maps for any `prefix.{i}.` layout. Each against the unfused computation written in the
test with the original modules, values and every gradient."""
import pytest
import torch
import torch.nn.functional as F
from helpers import KERNEL_PATH, generator
from torch import nn

from fuseblock import PreNormBlock, ResidualStack
from fuseblock.stream import layers_to_stack, stack_to_layers

D = 16
TOL = dict(rtol=1e-5, atol=1e-5) if KERNEL_PATH else dict(rtol=1e-6, atol=1e-6)


class GemmaNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), w stored around 0."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.zeros(d))

    def forward(self, x):
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
        return out.type_as(x)


class Rotary(nn.Module):
    """An attention-like mixer fed positional side inputs (cos, sin), as litgpt's is."""

    def __init__(self, d):
        super().__init__()
        self.q, self.o = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, cos, sin):
        q = self.q(x)
        q1, q2 = q.chunk(2, -1)
        return self.o(q * cos + torch.cat((-q2, q1), -1) * sin)


def mlp():
    return nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))


def _grads(out, tensors):
    return torch.autograd.grad(out, tensors, torch.ones_like(out))


@pytest.mark.kernel
@pytest.mark.parametrize("make", [lambda: nn.LayerNorm(D), lambda: nn.RMSNorm(D, eps=1e-6), lambda: GemmaNorm(D),
                                  lambda: nn.LayerNorm(D, elementwise_affine=False)],
                         ids=["layer", "rms", "gemma", "no-affine"])
def test_prenorm_block_takes_an_existing_norm(make):
    torch.manual_seed(0)
    norm, mixer = make(), mlp()
    for p in norm.parameters():
        nn.init.normal_(p, 0.0, 0.3)
    block = PreNormBlock(mixer, norm=norm)
    assert [id(p) for p in block.norm.parameters()] == [id(p) for p in norm.parameters()]  # its own Parameters
    x = torch.randn(3, 5, D, generator=generator(1)).requires_grad_()
    params = [x, *norm.parameters(), *mixer.parameters()]
    want = x + mixer(norm(x))  # the unfused step with the original module
    h, r = block(x)
    got = r + h
    torch.testing.assert_close(got, want, **TOL)
    for g, w in zip(_grads(got, params), _grads(want, params), strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_existing_norm_refusals():
    with pytest.raises(ValueError, match="norm= carries its own kind, eps.*pass kind or norm="):
        PreNormBlock(mlp(), norm=nn.LayerNorm(D), kind="layer")
    with pytest.raises(ValueError, match="dim is 8 but norm= normalizes 16"):
        PreNormBlock(mlp(), 8, norm=nn.LayerNorm(D))
    with pytest.raises(ValueError, match="norm= with post_norm"):
        PreNormBlock(mlp(), norm=nn.LayerNorm(D), post_norm=True)
    with pytest.raises(TypeError, match="unsupported module Linear"):
        PreNormBlock(mlp(), norm=nn.Linear(D, D))
    with pytest.raises(TypeError, match="norm must be an nn.Module"):
        PreNormBlock(mlp(), norm="ln")
    with pytest.raises(TypeError, match="dim must be"):
        PreNormBlock(mlp())


@pytest.mark.kernel
@pytest.mark.parametrize("fused", [True, False])
def test_stack_positional_side_inputs(fused):
    torch.manual_seed(0)
    mixers = [Rotary(D), mlp(), Rotary(D), mlp()]
    stack = ResidualStack(mixers, D, fused=fused)
    x = torch.randn(2, 4, D, generator=generator(2)).requires_grad_()
    cos = torch.randn(4, D, generator=generator(3)).requires_grad_()
    sin = torch.randn(4, D, generator=generator(4)).requires_grad_()
    h = x
    for blk in stack.blocks:  # written out with the stack's norms: each Rotary gets (cos, sin), each MLP none
        side = (cos, sin) if isinstance(blk.mixer, Rotary) else ()
        h = h + blk.mixer(F.rms_norm(h, (D,), blk.norm.weight), *side)
    want = F.rms_norm(h, (D,), stack.norm_f.weight)
    got = stack(x, cos, sin)
    torch.testing.assert_close(got, want, **TOL)
    params = [x, cos, sin, *stack.parameters()]
    for g, w in zip(_grads(got, params), _grads(want, params), strict=True):
        torch.testing.assert_close(g, w, **TOL)
    with pytest.raises(TypeError, match="1 positional side input.* no mixer"):
        ResidualStack([mlp()], D)(x, cos)


def test_stack_is_its_blocks_container():
    stack = ResidualStack([mlp(), mlp(), mlp()], D)
    assert len(stack) == 3 and list(stack) == list(stack.blocks)
    assert stack[1] is stack.blocks[1] and stack[-1] is stack.blocks[2]
    assert list(stack[:2]) == list(stack.blocks)[:2]
    assert [blk.mixer for blk in stack] == [blk.mixer for blk in stack.blocks]


@pytest.mark.kernel
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_checkpoint_per_block_equal_gradients(dropout):
    torch.manual_seed(0)
    mixers = [Rotary(D), mlp(), Rotary(D), mlp()]
    plain = ResidualStack(mixers, D, dropout=dropout)
    ckpt = ResidualStack(mixers, D, dropout=dropout, checkpoint=True)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(2, 4, D, generator=generator(5)).requires_grad_()
    cos, sin = torch.randn(4, D, generator=generator(6)), torch.randn(4, D, generator=generator(7))
    runs = []
    for stack in (plain, ckpt):
        saved = []

        def keep(t, saved=saved):
            saved.append(t)
            return t
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            torch.manual_seed(1)  # the same dropout masks, drawn again in the recompute (checkpoint keeps the RNG)
            out = stack(x, cos, sin)
        runs.append((out, _grads(out, [x, *stack.parameters()]), len(saved)))
    (out0, g0, n0), (out1, g1, n1) = runs
    assert torch.equal(out1, out0)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert n1 < n0 / 2  # it kept each block's inputs, not its activations
    assert "checkpoint=True" in repr(ckpt)
    with pytest.raises(TypeError, match="checkpoint must be a bool"):
        ResidualStack([mlp()], D, checkpoint=1)


def test_key_maps_for_any_prefix():
    stack = ResidualStack([mlp(), mlp(), mlp(), mlp()], D)
    sd = stack.state_dict()
    mapped = stack_to_layers(sd, layers="transformer.h", input_norm="ln_1", post_norm="ln_2", final_norm="ln_f")
    assert "transformer.h.1.ln_2.weight" in mapped and "transformer.h.0.attn.0.weight" in mapped
    assert "ln_f.weight" in mapped
    back = layers_to_stack(mapped, layers="transformer.h", input_norm="ln_1", post_norm="ln_2", final_norm="ln_f")
    assert list(back) == list(sd) and all(back[k] is sd[k] for k in sd)
    with pytest.raises(ValueError, match="not in the layers layout \\(model.layers"):
        layers_to_stack(mapped, layers="model.layers")
    with pytest.raises(ValueError, match="layers must be a module path"):
        stack_to_layers(sd, layers="transformer..h")


@pytest.mark.kernel
@pytest.mark.parametrize("fused", [True, False])
def test_parallel_with_two_norms_gpt_neox(fused):
    """GPT-NeoX's block: x + attn(ln_1(x)) + mlp(ln_2(x)), two norms of the same x."""
    torch.manual_seed(0)
    attns, mlps = [Rotary(D), Rotary(D)], [mlp(), mlp()]
    stack = ResidualStack(attns, D, kind="layer", parallel=mlps, parallel_norm=True, fused=fused)
    for p in stack.parameters():
        if p.dim() == 1:
            nn.init.normal_(p, 0.5, 0.2, generator=generator(8))
    x = torch.randn(2, 4, D, generator=generator(9)).requires_grad_()
    cos, sin = torch.randn(4, D, generator=generator(10)), torch.randn(4, D, generator=generator(11))
    h = x
    for blk in stack.blocks:
        n1, n2 = blk.norm, blk.parallel_norm
        h = (h + blk.mixer(F.layer_norm(h, (D,), n1.weight, n1.bias), cos, sin)
             + blk.parallel(F.layer_norm(h, (D,), n2.weight, n2.bias)))
    want = F.layer_norm(h, (D,), stack.norm_f.weight, stack.norm_f.bias)
    got = stack(x, cos, sin)
    torch.testing.assert_close(got, want, **TOL)
    params = [x, *stack.parameters()]
    for g, w in zip(_grads(got, params), _grads(want, params), strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_parallel_norm_existing_modules_and_refusals():
    ln1, ln2, attn, ff = nn.LayerNorm(D), nn.LayerNorm(D), mlp(), mlp()
    block = PreNormBlock(attn, norm=ln1, parallel=ff, parallel_norm=ln2)
    assert block.parallel_norm.weight is ln2.weight and block.norm.bias is ln1.bias
    x = torch.randn(3, D, generator=generator(12))
    (h, h1), r = block(x)
    torch.testing.assert_close(r + h + h1, x + attn(ln1(x)) + ff(ln2(x)), **TOL)
    with pytest.raises(ValueError, match="parallel_norm is the parallel module's norm: it needs parallel="):
        PreNormBlock(attn, D, parallel_norm=True)
    with pytest.raises(ValueError, match="parallel_norm normalizes 8, the block 16"):
        PreNormBlock(attn, D, parallel=ff, parallel_norm=nn.LayerNorm(8))
    with pytest.raises(TypeError, match="parallel_norm must be a bool or an nn.Module"):
        PreNormBlock(attn, D, parallel=ff, parallel_norm="ln_2")
