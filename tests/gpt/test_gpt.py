"""The GPT: fused against naive, against a nanoGPT-style reference, and 50 training steps."""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, generator
from torch import nn

from models.gpt import GPT, GPTConfig

TINY = dict(block_size=8, n_layer=2, n_head=2, n_embd=16, vocab_size=256)


def _grads(model, idx, targets):
    model.zero_grad()
    logits, loss = model(idx, targets)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.kernel
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_fused_equals_naive_logits_loss_and_every_gradient(norm):
    cfg = GPTConfig(**TINY, norm=norm, bias=norm == "layer")
    fused = GPT(cfg)
    naive = GPT(GPTConfig(**{**cfg.__dict__, "fused": False}))
    assert fused.state_dict().keys() == naive.state_dict().keys()
    naive.load_state_dict(fused.state_dict())
    idx = torch.randint(0, 256, (3, 8))
    targets = torch.randint(0, 256, (3, 8))
    a, b = _grads(fused, idx, targets), _grads(naive, idx, targets)
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[1], b[1], atol=1e-6, rtol=1e-6)
    assert a[2].keys() == b[2].keys() and len(a[2]) > 10
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], atol=1e-5, rtol=1e-4, msg=name)


class _NanoGPT(nn.Module):
    """nanoGPT's GPT (GPT-2 layout, LayerNorm with bias, eps 1e-5), written here from scratch
    as an independent reference: explicit masked-softmax attention, no fuseblock."""

    def __init__(self, vocab, block, n_layer, n_head, c):
        super().__init__()
        self.n_head = n_head
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, c), wpe=nn.Embedding(block, c), ln_f=nn.LayerNorm(c, eps=1e-5),
            h=nn.ModuleList(nn.ModuleDict(dict(
                ln_1=nn.LayerNorm(c, eps=1e-5), c_attn=nn.Linear(c, 3 * c), attn_proj=nn.Linear(c, c),
                ln_2=nn.LayerNorm(c, eps=1e-5), c_fc=nn.Linear(c, 4 * c), mlp_proj=nn.Linear(4 * c, c),
            )) for _ in range(n_layer)),
        ))
        self.lm_head = nn.Linear(c, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def attn(self, blk, x):
        B, T, C = x.shape
        q, k, v = blk.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.n_head)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return blk.attn_proj((att @ v).transpose(1, 2).reshape(B, T, C))

    @staticmethod
    def mlp(blk, x):
        h = blk.c_fc(x)
        return blk.mlp_proj(0.5 * h * (1 + torch.erf(h / math.sqrt(2))))  # exact GELU

    def forward(self, idx, targets):
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
        for blk in tr.h:
            x = x + self.attn(blk, blk.ln_1(x))
            x = x + self.mlp(blk, blk.ln_2(x))
        logits = self.lm_head(tr.ln_f(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _nano_key(name: str) -> str:
    """Our state_dict key for a reference (nanoGPT-layout) key."""
    parts = name.split(".")
    if parts[0] == "lm_head":
        return name
    if parts[1] in ("wte", "wpe"):
        return ".".join(parts[1:])
    if parts[1] == "ln_f":
        return "stack.norm_f." + parts[-1]
    i, sub, leaf = int(parts[2]), parts[3], parts[4]
    block, mixer = {"ln_1": (2 * i, None), "c_attn": (2 * i, "c_attn"), "attn_proj": (2 * i, "c_proj"),
                    "ln_2": (2 * i + 1, None), "c_fc": (2 * i + 1, "c_fc"), "mlp_proj": (2 * i + 1, "c_proj")}[sub]
    return f"stack.blocks.{block}." + ("norm" if mixer is None else f"mixer.{mixer}") + f".{leaf}"


@pytest.mark.kernel
@pytest.mark.parametrize("fused", [True, False])
def test_layer_norm_config_computes_nanogpt(fused):
    """Same weights (every norm weight and bias perturbed off its init): same logits, loss
    and gradient of every parameter as the nanoGPT-layout reference."""
    cfg = GPTConfig(**TINY, norm="layer", bias=True, norm_eps=1e-5, fused=fused)
    ours = GPT(cfg)
    ref = _NanoGPT(256, TINY["block_size"], TINY["n_layer"], TINY["n_head"], TINY["n_embd"])
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ours_sd = ours.state_dict()
    ref_names = [n for n, _ in ref.named_parameters()]
    assert sorted(map(_nano_key, ref_names)) == sorted(n for n, _ in ours.named_parameters())
    ref.load_state_dict({n: ours_sd[_nano_key(n)] for n in ref.state_dict()})

    idx, targets = torch.randint(0, 256, (3, 8)), torch.randint(0, 256, (3, 8))
    logits, loss, grads = _grads(ours, idx, targets)
    ref_logits, ref_loss, ref_grads = _grads(ref, idx, targets)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    for n in ref_names:
        torch.testing.assert_close(grads[_nano_key(n)], ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)


def test_config_validation_and_json_round_trip():
    with pytest.raises(ValueError, match="n_embd"):
        GPTConfig(n_embd=10, n_head=3)
    with pytest.raises(ValueError, match="norm"):
        GPTConfig(norm="batch")
    with pytest.raises(ValueError, match="norm_eps"):
        GPTConfig(norm_eps=0.0)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.0)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=0)
    with pytest.raises(TypeError, match="residual_dtype"):
        GPTConfig(residual_dtype="float32")
    with pytest.raises(TypeError, match="cfg"):
        GPT(dict(TINY))
    cfg = GPTConfig(**TINY, residual_dtype=torch.float32)
    assert GPTConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        GPTConfig.from_json({**cfg.to_json(), "n_experts": 8})


def test_generate_appends_tokens_and_respects_top_k():
    model = GPT(GPTConfig(**TINY)).eval()
    idx = torch.randint(0, 256, (2, 3))
    out = model.generate(idx, 12, temperature=1.0, top_k=1)
    assert out.shape == (2, 15) and torch.equal(out[:, :3], idx)
    greedy = model.generate(idx, 12, temperature=0.0)
    assert torch.equal(out, greedy)  # top_k=1 sampling is greedy decoding
    long = model.generate(idx, 20, temperature=0.0)  # past block_size (8): the context slides
    assert long.shape == (2, 23) and torch.equal(long[:, :15], greedy)
    a = model.generate(idx, 10, generator=generator(3))
    b = model.generate(idx, 10, generator=generator(3))
    assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs,name", [
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(idx=torch.zeros(4, dtype=torch.long)), "idx"),
    (dict(idx=torch.zeros(1, 3)), "idx"),
])
def test_generate_rejects_bad_arguments(kwargs, name):
    model = GPT(GPTConfig(**TINY)).eval()
    args = dict(idx=torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2) | kwargs
    with pytest.raises(ValueError, match=name):
        model.generate(**args)


def test_fifty_training_steps_fused_and_naive_agree():
    """Same seed, same batches: the loss curves agree to fp32 rounding (stated: 1e-4 abs)."""
    from models import data

    train = data.load("train")
    curves = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**TINY, "block_size": 16, "fused": fused}))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(50):
            # the starts on the CPU, where data.batch indexes the token array; the batch on DEVICE
            starts = torch.randint(len(train) - 17, (8,), generator=gen, device="cpu")
            x, y = (t.to(DEVICE) for t in data.batch(train, starts, 16))
            loss = model(x, y)[1]
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[fused] = torch.tensor(losses)
    assert curves[True][-1] < curves[True][0] - 1.0  # it learns
    # fp32 differences between the two forms (~1e-7 per step) compound through Adam over
    # 50 steps; 1e-4 absolute on a loss of ~3-5 nats is far below any real discrepancy
    torch.testing.assert_close(curves[True], curves[False], atol=1e-4, rtol=0)


@pytest.mark.parametrize("mixer", ["attn", "mlp"])
def test_mixers_fuse_every_setting_of_the_blocks_norm(mixer):
    """The mixers apply the block's norm themselves (prenorm=): a weight_offset on it
    (Gemma's 1 + w) must reach the fused call, or fused and naive differ."""
    import fuseblock
    from models.gpt import MLP, CausalSelfAttention

    cfg = GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    block = fuseblock.PreNormBlock((CausalSelfAttention if mixer == "attn" else MLP)(cfg), 16, weight_offset=1.0)
    with torch.no_grad():
        block.norm.weight.normal_()
    x = torch.randn(2, 8, 16)
    out, residual = block(x)
    torch.testing.assert_close(out + residual, block.naive(x))
