"""fuseblock.norm_from (fuseblock.convert): each source module's own forward is the
reference, values and gradients; the Norm holds the source's Parameters themselves."""
import pytest
import torch
from torch import nn

from fuseblock import Norm
from fuseblock.convert import norm_from

D = 48


def _randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return module


class LlamaStyleRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm, written out: fp32 statistics, rounded, then times w."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class OffsetNorm(nn.Module):
    """Gemma's form, x / rms(x) * (1 + w) in fp32, under a name that says nothing of it."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GemmaNamedRMSNorm(LlamaStyleRMSNorm):
    """Named like Gemma's, computing Llama's: found by what it computes, not its name."""


class Centered(LlamaStyleRMSNorm):
    """Llama's RMSNorm of the centred input: a LayerNorm with a weight and no bias (Cohere's)."""

    def forward(self, x):
        return super().forward(x - x.mean(-1, keepdim=True))


class BiasLayerNorm(nn.Module):
    """A LayerNorm with weight and bias written out in fp32, eps under `eps`."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, unbiased=False, keepdim=True) + self.eps)
        return (h * self.weight.float() + self.bias.float()).to(x.dtype)


class BareLayerNorm(nn.Module):
    """OLMo's form: no parameters, eps written in the forward and stored nowhere."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.normalized_shape, self._e = (d,), eps

    def forward(self, x):
        return torch.nn.functional.layer_norm(x.float(), self.normalized_shape, None, None, self._e).to(x.dtype)


def _sources():
    out = {
        "nn.RMSNorm": lambda: nn.RMSNorm(D),
        "nn.RMSNorm eps": lambda: nn.RMSNorm(D, eps=1e-5),
        "nn.RMSNorm no affine": lambda: nn.RMSNorm(D, elementwise_affine=False),
        "nn.LayerNorm": lambda: nn.LayerNorm(D),
        "nn.LayerNorm no bias": lambda: nn.LayerNorm(D, bias=False),
        "nn.LayerNorm no affine": lambda: nn.LayerNorm(D, elementwise_affine=False),
        "llama-style": lambda: LlamaStyleRMSNorm(D, eps=1e-5),
        "offset": lambda: OffsetNorm(D),
        "gemma-named": lambda: GemmaNamedRMSNorm(D),
        "centered": lambda: Centered(D),
        "layer-norm-bias": lambda: BiasLayerNorm(D, eps=1e-4),
        "layer-norm-bare": lambda: BareLayerNorm(D),
        "layer-norm-bare eps": lambda: BareLayerNorm(D, eps=1e-6),
    }
    try:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    except ImportError:  # the floor environment has no transformers; the written-out twins above stand in
        return out
    out.update({"LlamaRMSNorm": lambda: LlamaRMSNorm(D, eps=1e-5), "Qwen3RMSNorm": lambda: Qwen3RMSNorm(D),
                "GemmaRMSNorm": lambda: GemmaRMSNorm(D)})
    try:
        from transformers.models.cohere.modeling_cohere import CohereLayerNorm
        from transformers.models.olmo.modeling_olmo import OlmoLayerNorm
    except ImportError:
        return out
    out.update({"CohereLayerNorm": lambda: CohereLayerNorm(D, eps=1e-5), "OlmoLayerNorm": lambda: OlmoLayerNorm(D)})
    return out


SOURCES = _sources()
OFFSET = {"offset": 1.0, "GemmaRMSNorm": 1.0}
LAYER = {"nn.LayerNorm", "nn.LayerNorm no bias", "nn.LayerNorm no affine", "centered", "layer-norm-bias",
         "layer-norm-bare", "layer-norm-bare eps", "CohereLayerNorm", "OlmoLayerNorm"}


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", SOURCES)
def test_values_and_gradients_equal_the_source_modules_own(name, dtype):
    source = _randomize(SOURCES[name]()).to(dtype)
    norm = norm_from(source)
    assert isinstance(norm, Norm) and norm.weight_offset == OFFSET.get(name, 0.0)
    assert norm.kind == ("layer" if name in LAYER else "rms")
    x = torch.randn(3, 5, D, dtype=dtype) * 3
    x[0, 0] *= 1e-3  # a row whose size is near sqrt(eps): eps matters
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = source(x1), norm(x2)
    assert got.dtype == want.dtype == dtype
    g = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [x1, *source.parameters()], g)
    got_grads = torch.autograd.grad(got, [x2, *norm.parameters()], g)
    # Llama's form rounds N(x) to bf16 before the weight, fuseblock once after it: 2 bf16 ulps
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 * 2**-8, atol=2 * 2**-8)
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(got_grads, want_grads, strict=True):
        scale = max(1.0, b.abs().max().item())  # dweight sums over 15 rows
        torch.testing.assert_close(a / scale, b / scale, **tol)


@pytest.mark.parametrize("name", SOURCES)
def test_the_norm_holds_the_sources_parameters(name):
    source = SOURCES[name]()
    norm = norm_from(source)
    assert dict(norm.named_parameters()).keys() == dict(source.named_parameters()).keys()
    for key, p in source.named_parameters():
        assert getattr(norm, key) is p  # the Parameter itself: optimizers and tied weights stay valid
    assert norm.state_dict().keys() == source.state_dict().keys()


def test_eps_is_read_from_each_place():
    assert norm_from(nn.RMSNorm(D)).eps is None  # torch's default for the input's dtype, resolved per call
    assert norm_from(nn.RMSNorm(D, eps=1e-3)).eps == 1e-3
    assert norm_from(nn.LayerNorm(D, eps=1e-4)).eps == 1e-4
    assert norm_from(LlamaStyleRMSNorm(D, eps=1e-5)).eps == 1e-5
    assert norm_from(OffsetNorm(D, eps=1e-4)).eps == 1e-4
    assert norm_from(nn.LayerNorm(D)).kind == "layer" and norm_from(nn.RMSNorm(D)).kind == "rms"
    assert norm_from(BiasLayerNorm(D, eps=1e-4)).eps == 1e-4
    # stored nowhere: solved from the probe, exactly the written constant
    assert norm_from(BareLayerNorm(D)).eps == 1e-5 and norm_from(BareLayerNorm(D, eps=3e-6)).eps == 3e-6


def test_a_parameter_free_norm_converts_exactly():
    """OLMo's LayerNorm (F.layer_norm in fp32, cast back): the converted Norm runs the same
    op, so its fp32 output is bitwise the source's; it holds no parameters."""
    source, x = BareLayerNorm(D), torch.randn(4, D) * 3 + 1
    norm = norm_from(source)
    assert norm.weight is None and norm.bias is None and list(norm.parameters()) == []
    assert torch.equal(norm(x), source(x))


def test_device_and_dtype_follow_the_source_meta_included():
    source = LlamaStyleRMSNorm(D).to(torch.bfloat16)
    assert norm_from(source).weight.dtype == torch.bfloat16
    with torch.device("meta"):
        meta = OffsetNorm(D)
    norm = norm_from(meta)  # the check runs the forward on a CPU probe, never on the module's weight
    assert norm.weight.is_meta and norm.weight_offset == 1.0


@pytest.mark.parametrize("source", [OffsetNorm, LlamaStyleRMSNorm])
def test_converts_inside_the_meta_device_context(source):
    """Where from_pretrained builds its models: tensors made without a device are meta there,
    and the probe that tells w from 1 + w must still run on CPU."""
    with torch.device("meta"):
        norm = norm_from(source(D))
    assert norm.weight.is_meta and norm.weight_offset == (1.0 if source is OffsetNorm else 0.0)


class Scaled(LlamaStyleRMSNorm):
    def forward(self, x):
        return 2 * super().forward(x)


class Shifted(LlamaStyleRMSNorm):
    """Llama's RMSNorm plus 1: a bias it does not hold."""

    def forward(self, x):
        return super().forward(x) + 1


class MeanOnly(nn.Module):
    """Parameter-free, centres without scaling: no eps makes it a LayerNorm."""

    def __init__(self, d):
        super().__init__()
        self.normalized_shape = (d,)

    def forward(self, x):
        return x - x.mean(-1, keepdim=True)


class HoldsMore(LlamaStyleRMSNorm):
    """An RMSNorm holding a parameter besides its weight (and ignoring it): not a norm by what it holds."""

    def __init__(self, d):
        super().__init__(d)
        self.gain = nn.Parameter(torch.ones(1))


class BiasOnly(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.bias, self.eps = nn.Parameter(torch.zeros(d)), 1e-5

    def forward(self, x):
        return x + self.bias


class Broken(LlamaStyleRMSNorm):
    def forward(self, x):
        raise RuntimeError("no")


class WrongEps(LlamaStyleRMSNorm):
    """Stores eps where it is read, but computes with another one."""

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-2))


@pytest.mark.parametrize("module, match", [
    (nn.Linear(4, 4), "Linear"),
    (nn.BatchNorm1d(4), "BatchNorm1d"),
    (nn.GroupNorm(2, 4), "GroupNorm"),
    (nn.LayerNorm((4, 8)), "LayerNorm.*last dim"),
    (Scaled(D), "Scaled.*neither"),
    (Shifted(D), "Shifted.*neither"),
    (MeanOnly(D), "MeanOnly.*neither"),
    (HoldsMore(D), "HoldsMore.*holds gain besides weight and bias"),
    (BiasOnly(D), "BiasOnly.*no submodules"),
    (nn.Sequential(nn.LayerNorm(D)), "Sequential.*no submodules"),
    (WrongEps(D), "WrongEps.*neither"),
    (Broken(D), "Broken.*forward failed"),
    ("RMSNorm", "str"),
])
def test_unsupported_modules_are_a_type_error_naming_them(module, match):
    with pytest.raises(TypeError, match=match):
        norm_from(module)


def test_a_centered_rmsnorm_is_a_layernorm_without_bias():
    """x - mean(x) over its rms is layer_norm(x): found by what it computes, whatever it is named."""
    source = _randomize(Centered(D))
    norm = norm_from(source)
    assert norm.kind == "layer" and norm.bias is None and norm.weight is source.weight
    x = torch.randn(3, D) * 3
    torch.testing.assert_close(norm(x), source(x), rtol=1e-5, atol=1e-5)


class _Signal(Exception):
    """An exception of someone else's control flow (as torch.utils.checkpoint's early stop)."""


class Signalling(LlamaStyleRMSNorm):
    def forward(self, x):
        raise _Signal


def test_the_probe_catches_only_what_a_forward_raises_on_input_it_does_not_take():
    """A failed forward is a TypeError naming the module; an exception of another kind is
    not the converter's to swallow and passes unchanged."""
    with pytest.raises(_Signal):
        norm_from(Signalling(D))
