"""`norm_from`: a fuseblock `Norm` that computes what an existing norm module computes.

Sources: torch's `nn.LayerNorm` and `nn.RMSNorm`, and the Hugging Face `*RMSNorm`
classes, which are recognised by what they hold and what they compute rather than by
name: a 1-d `weight`, an eps in `variance_epsilon` or `eps`, and a forward that is
x / rms(x) * w (Llama, Mistral, Qwen) or x / rms(x) * (1 + w) (Gemma, which stores w
around 0). The second becomes `weight_offset=1.0` with the stored weight kept as is, so
checkpoints and state_dict keys do not change.

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
# The weight offsets a Hugging Face RMSNorm is checked for: w (Llama and most) and 1 + w (Gemma)
_OFFSETS = (0.0, 1.0)


def norm_from(module: nn.Module) -> Norm:
    """A fuseblock Norm computing what `module` computes, sharing its parameters.

    Supported: nn.LayerNorm and nn.RMSNorm over one (the last) dim, and Hugging Face
    style RMSNorms (see the module docstring). Anything else is a TypeError naming it.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"norm_from needs an nn.Module, got {type(module).__name__}")
    if isinstance(module, nn.LayerNorm):
        return _shared(module, "layer", module.normalized_shape, module.eps, 0.0)
    if isinstance(module, nn.RMSNorm):
        return _shared(module, "rms", module.normalized_shape, module.eps, 0.0)
    weight, eps = getattr(module, "weight", None), _hf_eps(module)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps is None \
            or getattr(module, "bias", None) is not None:
        raise TypeError(
            f"norm_from: unsupported module {type(module).__name__}: expected nn.LayerNorm, nn.RMSNorm or a "
            f"Hugging Face style RMSNorm (a 1-d `weight` Parameter, no bias, eps in `variance_epsilon` or `eps`)")
    return _shared(module, "rms", weight.shape[0], eps, _weight_offset(module, weight, eps))


def _hf_eps(module: nn.Module) -> float | None:
    for name in _EPS_NAMES:
        eps = getattr(module, name, None)
        if isinstance(eps, numbers.Real) and not isinstance(eps, bool):
            return float(eps)
    return None


def _weight_offset(module: nn.Module, weight: nn.Parameter, eps: float) -> float:
    """Which of x/rms(x) * (offset + w) the module computes, found by running its forward
    on CPU with a known weight (torch.func.functional_call: the module's own weight is
    neither read nor copied, so a weight on a GPU or the meta device is fine). The probe
    runs under torch.device("cpu"), so that inside a `with torch.device("meta")` block
    (where from_pretrained builds models) neither the probe nor any tensor the forward
    makes is meta. One row is small enough that eps matters, so a misread eps fails the
    check too."""
    d = weight.shape[0]
    with torch.device("cpu"):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2, d, generator=gen, dtype=torch.float32)
        x[1] *= 1e-3  # mean(x^2) ~ 1e-6: comparable to the usual eps
        w = torch.rand(d, generator=gen, dtype=torch.float32) + 0.5
        try:
            with torch.no_grad():
                out = torch.func.functional_call(module, {"weight": w}, (x,))
        # what a forward raises on an input or weight it does not take: not a module this
        # converter understands (anything else, an interrupt or torch's own control flow, passes)
        except (RuntimeError, TypeError, ValueError, AttributeError, IndexError, KeyError) as e:
            raise TypeError(f"norm_from: unsupported module {type(module).__name__}: its forward failed on a probe "
                            f"input ({type(e).__name__}: {e})") from e
        base = F.rms_norm(x, (d,), None, eps)
    for offset in _OFFSETS:
        if isinstance(out, torch.Tensor) and out.shape == x.shape and \
                torch.allclose(out.float(), base * (offset + w), rtol=1e-4, atol=1e-5):
            return offset
    raise TypeError(f"norm_from: unsupported module {type(module).__name__}: its forward is neither "
                    f"x/rms(x) * w nor x/rms(x) * (1 + w) with eps={eps}")


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
