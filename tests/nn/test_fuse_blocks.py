"""fuseblock.fuse_blocks on four host models written from their published structure
(fuseblock/testing/host_models.py: nanoGPT, a timm ViT, litgpt with rotary inputs and a KV cache,
torchtitan's Llama): the fused model against an untouched copy (logits, loss and every
gradient: bit for bit in fp32 on the torch path, in bf16 within the original's own
error against fp64), keys and Parameters unchanged, the hosts' own helpers still run,
a training run with equal losses; refusals by block and reason, with nothing changed."""
import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import KERNEL_PATH
from torch import nn
from torch.utils.checkpoint import checkpoint

from fuseblock import StreamPair, fuse_blocks, unfuse_blocks
from fuseblock.testing.host_models import (
    GPT,
    GPTConfig,
    LitConfig,
    LitGPT,
    TitanArgs,
    Transformer,
    VisionTransformer,
)

V, T, B = 64, 8, 2


def nanogpt():
    return GPT(GPTConfig())


def vit():
    return VisionTransformer()


def litgpt():
    return LitGPT(LitConfig())


def titan():
    return Transformer(TitanArgs())


# each style: build, the one call, (inputs, loss of the output)
def fuse_nanogpt(m):
    return fuse_blocks(m.transformer.h, m.transformer.ln_f)


def fuse_vit(m):
    return fuse_blocks(m.blocks, m.norm)


def fuse_litgpt(m):
    x = torch.randn(1, 4, m.config.n_embd)
    return fuse_blocks(m.transformer.h, m.transformer.ln_f, example=(x, m.cos[:4], m.sin[:4]))


def fuse_titan(m):
    return fuse_blocks(m.layers, m.norm, example=(torch.randn(1, 4, m.args.dim), m.freqs_cis))


STYLES = {"nanogpt": (nanogpt, fuse_nanogpt), "vit": (vit, fuse_vit), "litgpt": (litgpt, fuse_litgpt),
          "torchtitan": (titan, fuse_titan)}


def batch(style, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    if style == "vit":
        return torch.randn(B, 3, 8, 8, generator=gen).to(dtype), torch.randint(0, 10, (B,), generator=gen)
    return torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)


def step(style, model, inputs, targets, seed=0):
    """Logits, loss and every parameter's gradient (in named_parameters order) of one step;
    the RNG seeded, so drop path draws the same masks in both models."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(inputs)
    logits = out[0] if isinstance(out, tuple) else out
    loss = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def pair(style, seed=0):
    torch.manual_seed(seed)
    build, fuse = STYLES[style]
    original = build()
    fused = copy.deepcopy(original)
    return original, fused, fuse


def bitwise(a, b, what):
    assert torch.equal(a, b), f"{what}: max difference {(a.double() - b.double()).abs().max().item():.3g}"


@pytest.mark.torch_only("bit for bit is the torch path's: its norms are torch's own")
@pytest.mark.parametrize("style", list(STYLES))
def test_fp32_bitwise_keys_and_parameters(style):
    original, fused, fuse = pair(style)
    keys, params = list(fused.state_dict()), {n: p for n, p in fused.named_parameters()}
    fused.train(), original.train()
    fuse(fused)
    assert list(fused.state_dict()) == keys
    assert all(p is params[n] for n, p in fused.named_parameters())  # the same Parameter objects
    assert [type(m) for m in fused.modules()] == [type(m) for m in original.modules()]
    x, y = batch(style)
    want, got = step(style, original, x, y), step(style, fused, x, y)
    if style == "litgpt":  # its RMSNorm is written out: x * rsqrt(mean(x^2) + eps) * w, where fused is torch's
        torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=2e-6)
        for n in want[2]:
            torch.testing.assert_close(got[2][n], want[2][n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
        return
    bitwise(got[0], want[0], "logits")
    bitwise(got[1], want[1], "loss")
    for n in want[2]:
        bitwise(got[2][n], want[2][n], f"d {n}")


@pytest.mark.torch_only("the bf16 error of the torch path; the kernel path's is tests/ops'")
@pytest.mark.parametrize("style", list(STYLES))
def test_bf16_within_the_originals_own_error(style):
    original, fused, fuse = pair(style)
    fuse(fused)
    exact = copy.deepcopy(original).double()  # the fp64 truth: the original's code in fp64
    original, fused = original.bfloat16(), fused.bfloat16()
    if style == "torchtitan":  # its rotary table stays complex64, as torchtitan keeps it
        exact.freqs_cis = original.freqs_cis.to(torch.complex128)
    x, y = batch(style, 1, torch.bfloat16)
    ref = step(style, exact, x.double() if x.is_floating_point() else x, y)
    want, got = step(style, original, x, y), step(style, fused, x, y)
    for what, r, a, b in [("logits", ref[0], want[0], got[0]),
                          *((f"d {n}", ref[2][n], want[2][n], got[2][n]) for n in ref[2])]:
        err_orig = (a.double() - r).abs().max().item()
        err_fused = (b.double() - r).abs().max().item()
        scale = max(1e-3, r.abs().max().item())
        assert err_fused <= 2 * err_orig + 2 ** -8 * scale, f"{what}: fused {err_fused:.3g}, original {err_orig:.3g}"


@pytest.mark.kernel
@pytest.mark.parametrize("style", list(STYLES))
def test_kernel_path_tiny(style):
    original, fused, fuse = pair(style)
    fuse(fused)
    original.eval(), fused.eval()
    x, y = batch(style, 2)
    want, got = step(style, original, x, y), step(style, fused, x, y)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    for n in want[2]:
        torch.testing.assert_close(got[2][n], want[2][n], rtol=1e-3, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


# ---------------------------------------------------------------- the hosts' own helpers
def test_nanogpt_crop_and_no_final_norm():
    original, fused, _ = pair("nanogpt")
    fuse_blocks(fused.transformer.h)  # no final norm: the last block returns the stream, ln_f runs as it was
    for m in (original, fused):
        m.crop_block_size(4)
    idx = torch.randint(0, V, (B, 4))
    torch.testing.assert_close(fused(idx)[0], original(idx)[0], rtol=0, atol=0 if not KERNEL_PATH else 1e-5)


@pytest.mark.kernel
def test_vit_grad_checkpointing_and_attn_mask():
    original, fused, fuse = pair("vit")
    fuse(fused)
    x, y = batch("vit", 3)
    want = step("vit", original, x, y)
    fused.set_grad_checkpointing(True)  # timm's checkpoint_seq, non-reentrant, over the fused blocks
    got = step("vit", fused, x, y)
    tol = dict(rtol=1e-4, atol=1e-5) if KERNEL_PATH else dict(rtol=0, atol=0)
    torch.testing.assert_close(got[0], want[0], **tol)
    for n in want[2]:
        torch.testing.assert_close(got[2][n], want[2][n], **(dict(rtol=1e-3, atol=1e-5) if KERNEL_PATH else tol))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    original.eval(), fused.eval()
    torch.testing.assert_close(fused(x, attn_mask=mask), original(x, attn_mask=mask), **tol)


def test_reentrant_checkpoint_is_refused():
    _, fused, fuse = pair("nanogpt")
    fuse(fused)
    x = torch.randn(B, T, 32, requires_grad=True)
    h = fused.transformer.h
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        checkpoint(h[1], h[0](x), use_reentrant=True)


@pytest.mark.kernel
def test_litgpt_kv_cache_decoding():
    original, fused, fuse = pair("litgpt")
    fuse(fused)
    idx = torch.randint(0, V, (1, 6))
    tol = dict(rtol=1e-4, atol=1e-5) if KERNEL_PATH else dict(rtol=2e-6, atol=2e-6)
    with torch.no_grad():
        outs = []
        for m in (original, fused):
            m.set_kv_cache(batch_size=1)  # litgpt's own: a KVCache in every block's attention
            prefill = m(idx[:, :5], input_pos=torch.arange(5))
            next_token = m(idx[:, 5:], input_pos=torch.tensor([5]), input_pos_maxp1=6)
            outs.append((prefill, next_token))
            m.clear_kv_cache()
        full = fused(idx)
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, **tol)
    torch.testing.assert_close(outs[1][1][:, 0], full[:, 5], **tol)  # decoding equals the full forward


@pytest.mark.torch_only("the training run compares bit for bit")
def test_training_run_equal_losses():
    """200 AdamW steps each; the optimizer built before fuse_blocks keeps working (its state is
    keyed by the same Parameters)."""
    style = "nanogpt"
    original, fused, fuse = pair(style)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (original, fused)]
    losses = [[], []]
    for i in range(200):
        if i == 10:
            fuse(fused)  # mid-run: parameters and optimizer state carry on
        x, y = batch(style, 100 + i % 8)
        for m, opt, out in zip((original, fused), opts, losses, strict=True):
            out.append(step(style, m, x, y)[1].item())
            opt.step()
    assert losses[0] == losses[1]
    assert losses[0][-1] < losses[0][0] - 0.5  # it learnt (a fixed set of 8 batches)


def test_unfuse_blocks():
    original, fused, fuse = pair("torchtitan")
    fuse(fused)
    unfuse_blocks(fused.layers, fused.norm)
    assert all("forward" not in m.__dict__ for m in fused.modules())
    fused.init_weights()  # torchtitan's own re-init runs on the blocks (and after fusing too)
    torch.manual_seed(5)
    original.init_weights()
    torch.manual_seed(5)
    fused.init_weights()
    x, _ = batch("torchtitan")
    assert torch.equal(fused(x), original(x))


# ---------------------------------------------------------------- refusals
class PostNormBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.mlp = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return self.ln(x + self.mlp(x))


class ScaledBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.mlp, self.gamma = nn.LayerNorm(d), nn.Linear(d, d), nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x + self.gamma * self.mlp(self.ln(x))


class ThreeDimNorm(nn.Module):
    """A LayerNorm on norm_from's 2-d probe that scales 3-d input: only the block probe sees it."""

    def __init__(self, d):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        out = F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)
        return out * 1.01 if x.dim() == 3 else out


class Untraceable(nn.Module):
    def __init__(self, d, norm=nn.LayerNorm):
        super().__init__()
        self.ln, self.mlp = norm(d), nn.Linear(d, d)

    def forward(self, x):
        if x.sum() > -1e30:  # data-dependent control flow: fx cannot trace it
            x = x + self.mlp(self.ln(x))
        return x


@pytest.mark.parametrize("bad, why", [
    (PostNormBlock, "its 'mlp' is not a norm fuseblock computes"),
    (ScaledBlock, "not the residual add x \\+ branch"),
    (lambda d: Untraceable(d, ThreeDimNorm), "cannot be traced by torch.fx"),
])
def test_refused_by_block_and_reason_nothing_changed(bad, why):
    _, fused, _ = pair("nanogpt")
    fused.transformer.h.append(bad(32))
    with pytest.raises(ValueError, match=rf"changed nothing: block 2 \({bad(32).__class__.__name__}\): .*{why}"):
        fuse_blocks(fused.transformer.h, fused.transformer.ln_f)
    assert all("forward" not in m.__dict__ for m in fused.modules())


def test_probe_catches_a_difference_and_sublayers_names_them():
    blocks = nn.ModuleList([Untraceable(32), Untraceable(32, ThreeDimNorm)])
    with pytest.raises(ValueError, match=r"block 1 \(Untraceable\): fused it differs .* output differs by"):
        fuse_blocks(blocks, sublayers=[("ln", "mlp")])
    assert all("forward" not in m.__dict__ for m in blocks.modules())
    good = nn.ModuleList([Untraceable(32), Untraceable(32)])
    want = copy.deepcopy(good)
    assert fuse_blocks(good, sublayers=[("ln", "mlp")]) == [(("ln", "mlp"),)] * 2
    x = torch.randn(2, 3, 32)
    out = x
    for b in good:
        out = b(out)
    ref = x
    for b in want:
        ref = b(ref)
    torch.testing.assert_close(out, ref, rtol=0 if not KERNEL_PATH else 1e-5, atol=0 if not KERNEL_PATH else 1e-5)


def test_side_inputs_need_an_example():
    m = litgpt()
    with pytest.raises(ValueError, match=r"block 0 \(LitBlock\): its forward failed on the probe .*pass example="):
        fuse_blocks(m.transformer.h, m.transformer.ln_f)


def test_stream_pair_refuses_other_uses():
    m = nanogpt()
    fuse_blocks(m.transformer.h[:1])  # block 0 is this container's last, and there is no final norm
    out = m.transformer.h[0](torch.randn(1, 2, 32))
    assert isinstance(out, torch.Tensor)
    m = nanogpt()
    fuse_blocks(m.transformer.h, m.transformer.ln_f)
    p = m.transformer.h[0](torch.randn(1, 2, 32))
    assert isinstance(p, StreamPair)
    with pytest.raises(AttributeError, match="StreamPair .* has no 'shape'"):
        _ = p.shape
    with pytest.raises(TypeError, match="layer_norm got a StreamPair"):
        F.layer_norm(p, (32,))
    assert m.transformer.ln_f(p).shape == (1, 2, 32)  # the final norm takes both
    assert m.transformer.ln_f(torch.randn(3, 32)).shape == (3, 32)


def test_bad_arguments():
    m = nanogpt()
    with pytest.raises(TypeError, match="blocks must be a container"):
        fuse_blocks(m.transformer.h[0])
    with pytest.raises(ValueError, match="blocks is empty"):
        fuse_blocks([])
    with pytest.raises(TypeError, match=r"blocks\[1\] must be an nn.Module"):
        fuse_blocks([m.transformer.h[0], "x"])
    with pytest.raises(TypeError, match="final_norm must be an nn.Module"):
        fuse_blocks(m.transformer.h, "ln_f")
    with pytest.raises(ValueError, match="final_norm is not a norm"):
        fuse_blocks(m.transformer.h, m.lm_head)
    with pytest.raises(ValueError, match="each entry of sublayers"):
        fuse_blocks(m.transformer.h, sublayers=["ln_1"])
    with pytest.raises(ValueError, match="no child module 'ln_3'"):
        fuse_blocks(m.transformer.h, sublayers=[("ln_3", "attn")])
    handle = m.transformer.h[1].ln_2.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match=r"block 1 \(Block\): its 'ln_2' has forward hooks"):
        fuse_blocks(m.transformer.h)
    handle.remove()
    fuse_blocks(m.transformer.h, m.transformer.ln_f)
    with pytest.raises(ValueError, match="fused already"):
        fuse_blocks(m.transformer.h)
