"""`norm_from`: a fuseblock `Norm` that computes what an existing norm module computes.

Sources: torch's `nn.LayerNorm` and `nn.RMSNorm`, and the Hugging Face norm classes,
which are recognised by what they hold and what they compute rather than by name: a 1-d
`weight` (and optionally a `bias` of its size) or no parameters at all and a 1-d
`normalized_shape`, no submodules, an eps in `variance_epsilon` or `eps` (or none stored:
then it is solved from the forward), and a forward that is x / rms(x) * w (Llama,
Mistral, Qwen), x / rms(x) * (1 + w) (Gemma, which stores w around 0), or a LayerNorm
(x - mean) / std(x) * (w or 1 + w) + b with or without w and b (Cohere's weight-only one,
OLMo's parameter-free one, ConvNeXt's channels-last one, nanoGPT's). 1 + w becomes
`weight_offset=1.0` with the stored weight kept as is, so checkpoints and state_dict keys
do not change. A subclass of nn.LayerNorm or nn.RMSNorm with its own forward is probed
too, not taken on its class: Nemotron's LayerNorm1P computes 1 + w, timm's LayerNorm2d
normalizes channels-first (a TypeError). torch's batch, group, instance and local
response norms normalize over other dims and are refused.

The Norm holds the source module's own Parameter objects, not copies: an optimizer
built before the conversion, and parameters tied to other modules, stay valid.
"""
from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import nn

from .modules.norm import Norm

# Hugging Face's RMSNorms store eps under either name (LlamaRMSNorm: variance_epsilon, GemmaRMSNorm: eps)
_EPS_NAMES = ("variance_epsilon", "eps")
# The weight offsets a written-out norm is checked for: w (Llama and most) and 1 + w (Gemma,
# Nemotron's LayerNorm1P)
_OFFSETS = (0.0, 1.0)
# torch's norms over other dims than the last (the channels of (N, C, ...), groups of them)
OTHER_AXIS_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LocalResponseNorm, nn.CrossMapLRN2d)


def norm_from(module: nn.Module) -> Norm:
    """A fuseblock Norm computing what `module` computes, sharing its parameters.

    Supported: nn.LayerNorm and nn.RMSNorm over one (the last) dim, and Hugging Face
    style RMSNorms and LayerNorms (see the module docstring). Anything else is a TypeError
    naming it. `fuseblock.swap_norms` does this for every norm of a model.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"norm_from needs an nn.Module, got {type(module).__name__}")
    if isinstance(module, OTHER_AXIS_NORMS):
        raise TypeError(f"norm_from: unsupported module {type(module).__name__}: it normalizes over other dims "
                        f"than the last")
    # a subclass that keeps torch's forward is torch's norm; one with its own is probed below
    # (Nemotron's LayerNorm1P computes 1 + w; timm's LayerNorm2d normalizes channels-first)
    if isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward:
        return _shared(module, "layer", module.normalized_shape, module.eps, 0.0)
    if isinstance(module, nn.RMSNorm) and type(module).forward is nn.RMSNorm.forward:
        return _shared(module, "rms", module.normalized_shape, module.eps, 0.0)
    # a Norm holds weight and bias only: anything else the module keeps would leave its state_dict
    extra = sorted({n for n, _ in module.named_parameters(recurse=False)} - {"weight", "bias"}
                   | {n for n, _ in module.named_buffers(recurse=False)})
    if extra:
        raise TypeError(f"norm_from: unsupported module {type(module).__name__}: it holds {', '.join(extra)} "
                        f"besides weight and bias")
    d = _hf_dim(module)
    if d is None:
        raise TypeError(
            f"norm_from: unsupported module {type(module).__name__}: expected nn.LayerNorm, nn.RMSNorm or a "
            f"Hugging Face style RMSNorm or LayerNorm (a 1-d `weight` Parameter, optionally a `bias` of its size, "
            f"or no parameters and a 1-d `normalized_shape`; no submodules or buffers)")
    kind, offset, eps = _probe(module, d, hf_eps(module))
    return _shared(module, kind, d, eps, offset)


def _hf_dim(module: nn.Module) -> int | None:
    """The normalized width of a module shaped like a Hugging Face norm: what it holds is a
    1-d `weight` Parameter and optionally a `bias` of its shape (Llama's RMSNorm, Cohere's
    LayerNorm), or nothing and a 1-d `normalized_shape` (OLMo's LayerNorm); None for
    anything else (other parameters, buffers, submodules: a Norm holds weight and bias
    only, so anything else the module keeps would leave its state_dict)."""
    if next(module.children(), None) is not None or next(module.buffers(), None) is not None:
        return None
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.pop("weight", None), params.pop("bias", None)
    if params or (weight is None and bias is not None):
        return None
    if weight is None:
        shape = getattr(module, "normalized_shape", None)
        shape = (shape,) if isinstance(shape, int) else shape
        ok = isinstance(shape, (tuple, list)) and len(shape) == 1 and isinstance(shape[0], int) and shape[0] > 0
        return int(shape[0]) if ok else None
    if weight.dim() != 1 or (bias is not None and bias.shape != weight.shape):
        return None
    return weight.shape[0]


def hf_eps(module: nn.Module) -> float | None:
    """The eps a Hugging Face RMSNorm stores (under one of `_EPS_NAMES`), or None."""
    for name in _EPS_NAMES:
        eps = getattr(module, name, None)
        if isinstance(eps, numbers.Real) and not isinstance(eps, bool):
            return float(eps)
    return None


def _probe(module: nn.Module, d: int, eps: float | None) -> tuple[str, float, float]:
    """(kind, weight_offset, eps) of the function the module computes: found by running its
    forward on CPU with a known weight and bias (torch.func.functional_call: the module's
    own parameters are neither read nor copied, so parameters on a GPU or the meta device
    are fine) and comparing it with N(x) * (offset + w) + b for each kind (RMS, Layer) and
    offset (`_OFFSETS`). The probe runs under torch.device("cpu"), so that inside a `with
    torch.device("meta")` block (where from_pretrained builds models) neither the probe
    nor any tensor the forward makes is meta. One row is small enough that eps matters, so
    a misread eps fails the check too. An eps the module does not store (OLMo's LayerNorm
    writes 1e-5 in its forward) is solved from that row and rounded to 3 digits; the
    comparison then checks it on every row."""
    with torch.device("cpu"):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, d, generator=gen, dtype=torch.float32) + 0.5  # a mean away from 0 tells Layer from RMS
        x[1] *= 1e-3  # mean(x^2) ~ 1e-6: comparable to the usual eps
        params = {name: torch.rand(d, generator=gen, dtype=torch.float32) + 0.5
                  for name, _ in module.named_parameters(recurse=False)}
        try:
            with torch.no_grad():
                out = torch.func.functional_call(module, params, (x,))
        # what a forward raises on an input or weight it does not take: not a module this
        # converter understands (anything else, an interrupt or torch's own control flow, passes)
        except (RuntimeError, TypeError, ValueError, AttributeError, IndexError, KeyError) as e:
            raise TypeError(f"norm_from: unsupported module {type(module).__name__}: its forward failed on a probe "
                            f"input ({type(e).__name__}: {e})") from e
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            raise TypeError(f"norm_from: unsupported module {type(module).__name__}: its forward does not return "
                            f"a tensor of its input's shape")
        out = out.float()
        w, b = params.get("weight"), params.get("bias")
        for kind in ("rms", "layer"):
            for offset in _OFFSETS if w is not None else (0.0,):
                scale = 1.0 if w is None else offset + w
                shift = 0.0 if b is None else b
                e = eps if eps is not None else _solve_eps(x[1], (out[1] - shift) / scale, kind)
                if e is None:
                    continue
                fn = F.layer_norm if kind == "layer" else F.rms_norm
                if torch.allclose(out, fn(x, (d,), None, eps=e) * scale + shift, rtol=1e-4, atol=1e-5):
                    return kind, offset, e
    terms = "x/rms(x) * w, x/rms(x) * (1 + w), (x - mean)/std(x) * w (each + b where it has a bias)"
    raise TypeError(f"norm_from: unsupported module {type(module).__name__}: its forward is neither of "
                    f"{terms}" + (f" with eps={eps}" if eps is not None else " for any eps"))


def _solve_eps(x: torch.Tensor, z: torch.Tensor, kind: str) -> float | None:
    """The eps for which z = c / sqrt(mean(c^2) + eps), c = x centred for a LayerNorm: c = s z
    in least squares gives s^2 = mean(c^2) + eps. Rounded to 3 significant digits (eps is a
    written constant: 1e-5 comes back exactly); None where no eps >= 0 fits."""
    c = x.double() - x.double().mean() if kind == "layer" else x.double()
    z = z.double()
    zz = (z * z).sum()
    if not torch.isfinite(zz) or zz == 0:
        return None
    eps = ((c * z).sum() / zz) ** 2 - (c * c).mean()
    eps = float(f"{eps.item():.2e}")
    return max(eps, 0.0) if eps > -1e-9 else None


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
