"""fuseblock.swap_norms on models of several styles: the swapped model against an untouched
copy (outputs and every gradient), the Parameters and state_dict keys kept, and every
norm-like module either swapped or reported left alone with its reason."""
import copy
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import KERNEL_PATH
from torch import nn

import fuseblock
from fuseblock import Norm, SwapReport, swap_norms
from fuseblock.convert import norm_from

D = 32


# ---------------------------------------------------------------- the norms, written out
class HandRMSNorm(nn.Module):
    """The RMSNorm of many from-scratch repos: weight * x * rsqrt(mean(x^2) + eps)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class NanoGPTLayerNorm(nn.Module):
    """nanoGPT's LayerNorm: an optional bias, and its eps a literal in the forward."""

    def __init__(self, d, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class T5StyleNorm(nn.Module):
    """T5's LayerNorm (an RMSNorm): the variance in fp32, no mean taken off, no bias."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(d)), eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class ConvNeXtLayerNorm(nn.Module):
    """ConvNeXt's LayerNorm: F.layer_norm over the last dim for channels_last, the mean and
    variance over dim 1 written out for channels_first."""

    def __init__(self, d, eps=1e-6, data_format="channels_last"):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        self.eps, self.data_format, self.normalized_shape = eps, data_format, (d,)

    def forward(self, x):
        if self.data_format == "channels_last":
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class LayerNorm2d(nn.LayerNorm):
    """timm's LayerNorm2d: an nn.LayerNorm over the channels of (N, C, H, W)."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class LayerNorm1P(nn.LayerNorm):
    """Nemotron's LayerNorm1P: an nn.LayerNorm whose forward takes 1 + w."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


class RankSwitchingNorm(HandRMSNorm):
    """Channels-last for sequences, channels-first (over dim 1) for 4-d input: the same as
    a Norm on the 2-d probe norm_from runs, not on images."""

    def forward(self, x):
        if x.dim() == 4:
            return self.weight * x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + self.eps)
        return super().forward(x)


class DetachedRMSNorm(HandRMSNorm):
    """The same values as an RMSNorm, with the statistics detached: other gradients."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps).detach())


class CountingNorm(HandRMSNorm):
    """An RMSNorm that also keeps a buffer: a Norm would drop it from the state_dict."""

    def __init__(self, d):
        super().__init__(d)
        self.register_buffer("calls", torch.zeros(()))


# ---------------------------------------------------------------- the models
class Attention(nn.Module):
    def __init__(self, d, heads=4, bias=True):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d, bias=bias), nn.Linear(d, d, bias=bias)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d, make_norm, bias=True):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = make_norm(d), Attention(d, bias=bias), make_norm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, bias=bias), nn.GELU(), nn.Linear(4 * d, d, bias=bias))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyLM(nn.Module):
    """nanoGPT's layout: token and position embeddings, pre-norm blocks, a final norm, the
    head tied to the token embedding."""

    def __init__(self, make_norm, d=D, n_layer=2, vocab=64, block=16, bias=True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(Block(d, make_norm, bias) for _ in range(n_layer))
        self.ln_f = make_norm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class ConvNeXtish(nn.Module):
    """ConvNeXt's stem and block: a channels-first norm after the stem conv, a channels-last
    one inside the block (permuted around it), a timm LayerNorm2d at the end."""

    def __init__(self, d=D):
        super().__init__()
        self.stem = nn.Conv2d(3, d, 2, stride=2)
        self.stem_norm = ConvNeXtLayerNorm(d, data_format="channels_first")
        self.dwconv = nn.Conv2d(d, d, 3, padding=1, groups=d)
        self.norm = ConvNeXtLayerNorm(d)
        self.timm_norm = nn.LayerNorm(d, eps=1e-6)
        self.pwconv = nn.Linear(d, d)
        self.head_norm = LayerNorm2d(d)

    def forward(self, x):
        x = self.stem_norm(self.stem(x))
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv(self.timm_norm(self.norm(y)))
        return self.head_norm(x + y.permute(0, 3, 1, 2))


def _randomized(model):
    """Norm weights and biases away from 1 and 0, so a lost weight or bias shows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _lm_input():
    return torch.randint(0, 64, (2, 16))


MODELS = {
    # name: (build, input, swapped names, left-alone names)
    "nanogpt-layernorm-bias": (lambda: TinyLM(lambda d: nn.LayerNorm(d)), _lm_input,
                               ["h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "ln_f"], []),
    "nanogpt-layernorm-no-bias": (lambda: TinyLM(lambda d: nn.LayerNorm(d, bias=False), bias=False), _lm_input,
                                  ["h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "ln_f"], []),
    "nn.RMSNorm": (lambda: TinyLM(lambda d: nn.RMSNorm(d, eps=1e-5), bias=False), _lm_input,
                   ["h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "ln_f"], []),
    "hand-written RMSNorm": (lambda: TinyLM(HandRMSNorm, bias=False), _lm_input,
                             ["h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "ln_f"], []),
    "T5-style norm": (lambda: TinyLM(T5StyleNorm, bias=False), _lm_input,
                      ["h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "ln_f"], []),
    "LayerNorm without affine": (lambda: TinyLM(lambda d: nn.LayerNorm(d, elementwise_affine=False)), _lm_input,
                                 ["h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "ln_f"], []),
    "convnext": (ConvNeXtish, lambda: torch.randn(2, 3, 8, 8), ["norm", "timm_norm"], ["stem_norm", "head_norm"]),
}


def _grads(model, inp):
    torch.manual_seed(2)
    out = model(inp)
    out.backward(torch.randn_like(out))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out.detach(), grads


def _assert_same_function(swapped, untouched, inp, tol):
    out, grads = _grads(swapped, inp)
    want, want_grads = _grads(untouched, inp)
    torch.testing.assert_close(out, want, **tol)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        scale = max(1.0, want_grads[name].abs().max().item())
        torch.testing.assert_close(g / scale, want_grads[name] / scale, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("style", MODELS)
def test_swapped_model_computes_the_same_with_the_same_parameters(style):
    build, make_input, swapped_names, left_names = MODELS[style]
    untouched = _randomized(build())
    model = copy.deepcopy(untouched)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    report = swap_norms(model)

    assert isinstance(report, SwapReport)
    assert sorted(report.swapped) == sorted(swapped_names) and sorted(report.left_alone) == sorted(left_names)
    for name in swapped_names:
        assert isinstance(model.get_submodule(name), Norm)
    for name in left_names:
        assert type(model.get_submodule(name)) is type(untouched.get_submodule(name))
    assert list(model.state_dict()) == keys
    after = dict(model.named_parameters())
    assert after.keys() == params.keys() and all(after[k] is p for k, p in params.items())
    inp = make_input()
    # fp32 on the torch path: torch's LayerNorm and RMSNorm are the Norm's own; the
    # written-out norms round differently, by an ulp or two
    tol = dict(rtol=1e-5, atol=1e-5) if KERNEL_PATH else dict(rtol=1e-6, atol=1e-6)
    _assert_same_function(model, untouched, inp, tol)


@pytest.mark.torch_only("torch's own norms are what the Norm's torch path calls")
@pytest.mark.parametrize("style", ["nanogpt-layernorm-bias", "nn.RMSNorm", "LayerNorm without affine"])
def test_torchs_own_norms_swap_bitwise(style):
    build, make_input, _, _ = MODELS[style]
    untouched = _randomized(build())
    model = copy.deepcopy(untouched)
    swap_norms(model)
    _assert_same_function(model, untouched, make_input(), dict(rtol=0, atol=0))


@pytest.mark.kernel
@pytest.mark.kernel_only("the Triton kernels in place of each norm, through the interpreter")
def test_swapped_model_on_the_kernel_path():
    build, make_input, names, _ = MODELS["nanogpt-layernorm-bias"]
    untouched = _randomized(build())
    model = copy.deepcopy(untouched)
    assert sorted(swap_norms(model).swapped) == sorted(names)
    _assert_same_function(model, untouched, make_input(), dict(rtol=1e-5, atol=1e-5))


def test_an_optimizer_built_before_the_swap_trains_the_swapped_model():
    untouched = _randomized(TinyLM(HandRMSNorm))
    model = copy.deepcopy(untouched)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, untouched)]
    swap_norms(model)
    inp = _lm_input()
    for m, opt in zip((model, untouched), opts, strict=True):
        for _ in range(3):
            opt.zero_grad()
            m(inp).logsumexp(-1).mean().backward()
            opt.step()
    for (name, p), q in zip(model.named_parameters(), untouched.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(model.ln_f.weight, _randomized(TinyLM(HandRMSNorm)).ln_f.weight)  # it did train


def test_a_norm_under_several_names_stays_one_module_and_tied_weights_stay_tied():
    model = TinyLM(nn.RMSNorm, bias=False)
    model.final = model.ln_f  # the same module under a second name
    model.h[1].ln_2.weight = model.h[0].ln_2.weight  # two norms sharing one weight
    keys = list(model.state_dict())
    report = swap_norms(model)
    assert "final" not in report.swapped and "ln_f" in report.swapped  # listed once, under its first name
    assert model.final is model.ln_f and isinstance(model.ln_f, Norm)
    assert model.h[1].ln_2 is not model.h[0].ln_2 and model.h[1].ln_2.weight is model.h[0].ln_2.weight
    assert list(model.state_dict()) == keys


def test_built_on_the_meta_device_then_materialized():
    reference = _randomized(TinyLM(T5StyleNorm, bias=False))
    swap_norms(reference)
    with torch.device("meta"):
        model = TinyLM(T5StyleNorm, bias=False)
    report = swap_norms(model)  # the probes run on CPU, never on the meta parameters
    assert len(report.swapped) == 5 and not report.left_alone
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device=reference.wte.weight.device)
    model.lm_head.weight = model.wte.weight  # to_empty unties; the usual tie_weights step
    model.load_state_dict(reference.state_dict())
    inp = _lm_input()
    torch.testing.assert_close(model(inp), reference(inp), rtol=0, atol=0)


def test_models_gpt_norms_are_fuseblocks_already():
    from models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=D, fused=False))
    inp = torch.randint(0, 64, (2, 16))
    before = model(inp)
    before = before[0] if isinstance(before, tuple) else before
    report = swap_norms(model)
    norms = [n for n, m in model.named_modules() if isinstance(m, Norm)]
    assert report.swapped == () and sorted(report.left_alone) == sorted(norms) and len(norms) == 5
    assert set(report.left_alone.values()) == {"already a fuseblock Norm"}
    after = model(inp)
    torch.testing.assert_close(after[0] if isinstance(after, tuple) else after, before, rtol=0, atol=0)


@pytest.mark.parametrize("module, reason", [
    (RankSwitchingNorm(D), "differs from its forward: output on input of shape \\(2, 3, 2, 32\\)"),
    (DetachedRMSNorm(D), "differs from its forward: d_input"),
    (CountingNorm(D), "holds calls besides weight and bias"),
    (LayerNorm2d(D), "LayerNorm2d: its forward failed"),
    (ConvNeXtLayerNorm(D, data_format="channels_first"), "ConvNeXtLayerNorm: its forward does not return a tensor"),
    (nn.LayerNorm((4, 8)), "last dim only"),
    (nn.GroupNorm(1, D), "GroupNorm: it normalizes over other dims than the last"),
    (nn.BatchNorm1d(D), "BatchNorm1d: it normalizes over other dims than the last"),
    (nn.InstanceNorm1d(D, affine=True), "InstanceNorm1d: it normalizes over other dims than the last"),
])
def test_what_cannot_be_proved_equal_is_left_alone_with_the_reason(module, reason):
    model = nn.Sequential(nn.Linear(D, D), module)
    report = swap_norms(model)
    assert report.swapped == () and list(report.left_alone) == ["1"]
    assert model[1] is module
    assert re.search(reason, report.left_alone["1"]), report.left_alone["1"]


def test_hooks_and_parametrizations_are_not_dropped():
    hooked, parametrized, wrapped = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
    hooked.register_forward_hook(lambda m, i, o: o * 2)
    torch.nn.utils.parametrize.register_parametrization(parametrized, "weight", nn.Identity())
    wrapped.forward = lambda x: x  # what accelerate's hooks do
    model = nn.Sequential(hooked, parametrized, wrapped, nn.LayerNorm(D))
    report = swap_norms(model)
    assert report.swapped == ("3",)
    assert "forward_hooks" in report.left_alone["0"] and "parametrized" in report.left_alone["1"]
    assert "instance-level forward" in report.left_alone["2"]
    assert model[0] is hooked and model[1] is parametrized and model[2] is wrapped


def test_the_model_itself_and_bad_input():
    norm = nn.LayerNorm(D)
    report = swap_norms(norm)
    assert report.swapped == () and "the model itself" in report.left_alone[""]
    for bad in (None, "model", [nn.LayerNorm(D)], nn.LayerNorm):
        with pytest.raises(TypeError, match="swap_norms needs an nn.Module"):
            swap_norms(bad)


@pytest.mark.parametrize("make_norm, noted", [(T5StyleNorm, True), (HandRMSNorm, True), (nn.RMSNorm, False),
                                              (nn.LayerNorm, False)])
def test_notes_name_the_norms_whose_output_dtype_differs_under_mixed_precision(make_norm, noted):
    """A written-out norm multiplying by its fp32 weight last returns fp32 for bf16 input; the
    Norm returns bf16, as torch's own norms do: swapped, and the report says so."""
    untouched = make_norm(D)
    model = nn.Sequential(copy.deepcopy(untouched))
    report = swap_norms(model)
    assert report.swapped == ("0",) and (("0" in report.notes) == noted), report
    x = torch.randn(3, D, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's rms_norm warns of the mixed dtypes (once a process)
        want = untouched(x).dtype
    assert model[0](x).dtype == torch.bfloat16 and (want != torch.bfloat16) == noted
    if noted:
        assert report.notes["0"].startswith("given bf16 input and fp32 weights it returned float32 where the Norm "
                                            "returns bfloat16")
        assert "note: given bf16" in str(report)


@pytest.mark.parametrize("bias", [True, False])
def test_nanogpts_own_layernorm_swaps_with_the_eps_its_forward_uses(bias):
    """nanoGPT's LayerNorm passes a literal 1e-5 and keeps no eps: the probe solves it (and
    checks it on every row); a wrong eps named on the module is checked, not trusted."""
    untouched = _randomized(TinyLM(lambda d: NanoGPTLayerNorm(d, bias=bias), bias=bias))
    model = copy.deepcopy(untouched)
    report = swap_norms(model)
    assert len(report.swapped) == 5 and not report.left_alone
    assert {m.eps for m in model.modules() if isinstance(m, Norm)} == {1e-5}
    _assert_same_function(model, untouched, _lm_input(), dict(rtol=0, atol=0) if not KERNEL_PATH else
                          dict(rtol=1e-5, atol=1e-5))
    wrong = copy.deepcopy(untouched)
    for m in wrong.modules():
        if isinstance(m, NanoGPTLayerNorm):
            m.eps = 1e-4  # a wrong one: the probe's small row tells
    report = swap_norms(wrong)
    assert report.swapped == () and all("neither" in why for why in report.left_alone.values())


def test_the_report_reads_as_a_list():
    model = nn.Sequential(nn.LayerNorm(D), nn.BatchNorm1d(D))
    text = str(swap_norms(model))
    assert text.splitlines()[:2] == ["swapped 1 norm(s) for fuseblock.Norm", "  0"]
    assert "left 1 alone" in text and "1: unsupported module BatchNorm1d" in text


def test_norm_from_takes_a_written_out_layernorm_and_probes_layernorm_subclasses():
    source = _randomized(ConvNeXtLayerNorm(D))
    norm = norm_from(source)
    assert norm.kind == "layer" and norm.eps == 1e-6 and norm.weight is source.weight and norm.bias is source.bias
    x = torch.randn(2, 4, 4, D)
    torch.testing.assert_close(norm(x), source(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="LayerNorm2d: its forward failed"):
        norm_from(LayerNorm2d(D))


def test_a_layernorm_subclass_is_taken_for_what_its_forward_computes():
    """Nemotron's LayerNorm1P is an nn.LayerNorm computing layer_norm(x) * (1 + w) + b: taken
    on its class it was a plain LayerNorm, off by x's normalized value times 1."""
    assert norm_from(LayerNorm1P(D)).weight_offset == 1.0
    untouched = _randomized(nn.Sequential(nn.Linear(D, D), LayerNorm1P(D)))
    model = copy.deepcopy(untouched)
    assert swap_norms(model).swapped == ("1",)
    assert model[1].kind == "layer" and model[1].weight_offset == 1.0
    _assert_same_function(model, untouched, torch.randn(3, 5, D), dict(rtol=1e-6, atol=1e-6))


def _tiny_hf(name):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=96, hidden_size=D, num_attention_heads=4)
    if name == "opt":
        cfg = transformers.OPTConfig(**common, num_hidden_layers=2, ffn_dim=64, max_position_embeddings=64,
                                     word_embed_proj_dim=D, dropout=0.0, attention_dropout=0.0)
        return transformers.OPTForCausalLM(cfg)
    cfg = transformers.BloomConfig(vocab_size=96, hidden_size=D, n_head=4, n_layer=2, hidden_dropout=0.0,
                                   attention_dropout=0.0)
    return transformers.BloomForCausalLM(cfg)


@pytest.mark.parametrize("name, n_norms", [("opt", 5), ("bloom", 6)])
def test_transformers_models_fuse_does_not_take(name, n_norms):
    """fuse() refuses OPT and Bloom; their LayerNorms swap, and logits, loss and every
    gradient stay the same."""
    torch.manual_seed(0)
    untouched = _randomized(_tiny_hf(name).eval())
    model = copy.deepcopy(untouched)
    keys = list(model.state_dict())
    report = swap_norms(model)
    assert len(report.swapped) == n_norms and not report.left_alone and not report.notes, report
    assert list(model.state_dict()) == keys
    ids = torch.randint(0, 96, (2, 12))
    outs = []
    for m in (model, untouched):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        outs.append((out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (logits, loss, grads), (want_logits, want_loss, want_grads) = outs
    tol = dict(rtol=1e-5, atol=1e-5) if KERNEL_PATH else dict(rtol=0, atol=0)
    torch.testing.assert_close(logits, want_logits, **tol)
    torch.testing.assert_close(loss, want_loss, **tol)
    for n, g in grads.items():
        torch.testing.assert_close(g, want_grads[n], **tol, msg=lambda m, n=n: f"{n}: {m}")
    assert not math.isnan(loss.item())


def test_exported_from_fuseblock():
    assert fuseblock.swap_norms is swap_norms and "swap_norms" in fuseblock.__all__
