"""`norm_from`: a fuseblock `Norm` that computes what an existing norm module computes.

Sources: torch's `nn.LayerNorm` and `nn.RMSNorm`, and the Hugging Face `*RMSNorm`
classes, which are recognised by what they hold and what they compute rather than by
name: a 1-d `weight`, an eps in `variance_epsilon` or `eps`, and a forward that is
x / rms(x) * w (Llama, Mistral, Qwen) or x / rms(x) * (1 + w) (Gemma, which stores w
around 0). The second becomes `weight_offset=1.0` with the stored weight kept as is, so
checkpoints and state_dict keys do not change. A written-out LayerNorm (ConvNeXt's
channels-last one, Cohere's, DeBERTa's: a 1-d `weight`, a 1-d `bias` or none, an eps) is
found the same way, by a forward that is layer_norm(x) * (w or 1 + w) + b. A subclass of
nn.LayerNorm or nn.RMSNorm with its own forward is probed too, not taken on its class:
Nemotron's LayerNorm1P computes 1 + w, timm's LayerNorm2d normalizes channels-first (a
TypeError). torch's batch, group, instance and local response norms normalize over other
dims and are refused.

The Norm holds the source module's own Parameter objects, not copies: an optimizer
built before the conversion, and parameters tied to other modules, stay valid.
"""
from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import nn

from .modules import Norm

# Hugging Face's RMSNorms store eps under either name (LlamaRMSNorm: variance_epsilon, GemmaRMSNorm: eps)
_EPS_NAMES = ("variance_epsilon", "eps")
# The forms a written-out norm is checked for, (kind, weight offset): x/rms(x) * w (Llama
# and most), x/rms(x) * (1 + w) (Gemma), layer_norm(x) * w + b (ConvNeXt, Cohere, ports),
# layer_norm(x) * (1 + w) + b (Nemotron's LayerNorm1P, an nn.LayerNorm subclass)
_FORMS = (("rms", 0.0), ("rms", 1.0), ("layer", 0.0), ("layer", 1.0))
# torch's norms over other dims than the last (the channels of (N, C, ...), groups of them)
_OTHER_AXIS_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LocalResponseNorm, nn.CrossMapLRN2d)


def norm_from(module: nn.Module) -> Norm:
    """A fuseblock Norm computing what `module` computes, sharing its parameters.

    Supported: nn.LayerNorm and nn.RMSNorm over one (the last) dim, and Hugging Face
    style RMSNorms and written-out LayerNorms (see the module docstring). Anything else is
    a TypeError naming it. `fuseblock.swap_norms` does this for every norm of a model.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"norm_from needs an nn.Module, got {type(module).__name__}")
    if isinstance(module, _OTHER_AXIS_NORMS):
        raise TypeError(f"norm_from: unsupported module {type(module).__name__}: it normalizes over other dims "
                        f"than the last")
    # a subclass that keeps torch's forward is torch's norm; one with its own is probed below
    if isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward:
        return _shared(module, "layer", module.normalized_shape, module.eps, 0.0)
    if isinstance(module, nn.RMSNorm) and type(module).forward is nn.RMSNorm.forward:
        return _shared(module, "rms", module.normalized_shape, module.eps, 0.0)
    weight, bias, eps = getattr(module, "weight", None), getattr(module, "bias", None), _hf_eps(module)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not (
            bias is None or isinstance(bias, nn.Parameter) and bias.shape == weight.shape):
        raise TypeError(
            f"norm_from: unsupported module {type(module).__name__}: expected nn.LayerNorm, nn.RMSNorm or a "
            f"written-out RMSNorm or LayerNorm (a 1-d `weight` Parameter, a `bias` of its shape or none, eps in "
            f"`variance_epsilon` or `eps`)")
    if eps is None:  # nanoGPT's LayerNorm passes a literal 1e-5: its eps is nowhere to read
        raise TypeError(f"norm_from: unsupported module {type(module).__name__}: it keeps no eps in `eps` or "
                        f"`variance_epsilon`; set `eps` on it to the value its forward uses (the probe checks it)")
    # a Norm holds weight and bias only: anything else the module keeps would leave its state_dict
    extra = sorted({n for n, _ in module.named_parameters()} - {"weight", "bias"}
                   | {n for n, _ in module.named_buffers()})
    if extra:
        raise TypeError(f"norm_from: unsupported module {type(module).__name__}: it holds {', '.join(extra)} "
                        f"besides weight and bias")
    kind, offset = _form(module, weight, bias, eps)
    return _shared(module, kind, weight.shape[0], eps, offset)


def _hf_eps(module: nn.Module) -> float | None:
    for name in _EPS_NAMES:
        eps = getattr(module, name, None)
        if isinstance(eps, numbers.Real) and not isinstance(eps, bool):
            return float(eps)
    return None


def _form(module: nn.Module, weight: nn.Parameter, bias: nn.Parameter | None, eps: float) -> tuple[str, float]:
    """Which (kind, weight offset) of _FORMS the module computes, found by running its
    forward on CPU with a known weight and bias (torch.func.functional_call: the module's
    own parameters are neither read nor copied, so parameters on a GPU or the meta device
    are fine). The probe runs under torch.device("cpu"), so that inside a `with
    torch.device("meta")` block (where from_pretrained builds models) neither the probe nor
    any tensor the forward makes is meta. One row is small enough that eps matters, so a
    misread eps fails the check too."""
    d = weight.shape[0]
    with torch.device("cpu"):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2, d, generator=gen, dtype=torch.float32)
        x[1] *= 1e-3  # mean(x^2) ~ 1e-6: comparable to the usual eps
        w = torch.rand(d, generator=gen, dtype=torch.float32) + 0.5
        params = {"weight": w}
        if bias is not None:
            params["bias"] = torch.randn(d, generator=gen, dtype=torch.float32)
        try:
            with torch.no_grad():
                out = torch.func.functional_call(module, params, (x,))
        # what a forward raises on an input or weight it does not take: not a module this
        # converter understands (anything else, an interrupt or torch's own control flow, passes)
        except (RuntimeError, TypeError, ValueError, AttributeError, IndexError, KeyError) as e:
            raise TypeError(f"norm_from: unsupported module {type(module).__name__}: its forward failed on a probe "
                            f"input ({type(e).__name__}: {e})") from e
        for kind, offset in _FORMS:
            if bias is not None and kind == "rms":
                continue  # a Hugging Face RMSNorm has no bias
            want = F.layer_norm(x, (d,), None, None, eps) if kind == "layer" else F.rms_norm(x, (d,), None, eps)
            want = want * (offset + w) + (params["bias"] if bias is not None else 0.0)
            if isinstance(out, torch.Tensor) and out.shape == x.shape and \
                    torch.allclose(out.float(), want, rtol=1e-4, atol=1e-5):
                return kind, offset
    raise TypeError(f"norm_from: unsupported module {type(module).__name__}: its forward is neither "
                    f"x/rms(x) * (w or 1 + w) nor layer_norm(x) * (w or 1 + w) + b with eps={eps}")


def _shared(module: nn.Module, kind: str, normalized_shape, eps, weight_offset: float) -> Norm:
    """A Norm over `normalized_shape` holding module's weight and bias Parameters.

    Built on the meta device, so nothing is allocated for the parameters it then takes
    over from the module."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    try:
        norm = Norm(normalized_shape, kind=kind, eps=eps, weight=weight is not None, bias=bias is not None,
                    weight_offset=weight_offset, device="meta")
    except ValueError as e:  # e.g. a LayerNorm over the last two dims
        raise TypeError(f"norm_from: unsupported {type(module).__name__}: {e}") from e
    norm.weight, norm.bias = weight, bias
    return norm
