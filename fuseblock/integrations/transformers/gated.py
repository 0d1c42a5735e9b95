"""The per-channel gated sandwich (transformers' muse_spark, 5.23 and 5.24) on fuseblock's [d]-scale ops.

A Muse Spark decoder layer gates each residual update per channel (MuseSparkResidualGate:
r' = alpha * r + beta * f, alpha and beta [d] vectors made from one fp32 gate Parameter)
and normalizes each branch's output before its gate:

    x = N1(h);                   a = P_a(attn(x))        (P_a: MuseSparkRMSNorm, weightless)
    h1 = alpha_a * h + beta_a * a;   z = N2(h1)             (N1, N2: x / rms(x) * (1 + w))
    h' = alpha_m * h1 + beta_m * N_m((1 + w_m) * mlp(z))   (MuseSparkTextInputScaledRMSNorm)

Fused, the attention's gate and the MLP's pre-norm are one `add_norm` with the gate's
alpha and beta as its residual_scale and branch_scale, and the MLP's input-scaled post-norm
and gate one `norm_add` (the weightless norm of (1 + w_m) * m, the input scaling done first
as the modeling code does it); the input norm is one `norm`. The torch path is then the
unfused layer bit for bit in fp32, gradients included. What would not be stays the
modeling code's, run as the unfused layer runs it: MuseSparkRMSNorm (the attention's
post-norm and its q/k/o norms, the embeddings' norm, the model's final norm) computes
x * pow(mean(x^2) + eps, -0.5), whose forward is the op's bitwise and whose input gradient
is not (pow's backward); the attention and the MoE (its own norms included) are untouched.
Each layer's adds complete in the layer, on its own parameters: the layer takes and returns
the stream h, and the inner model keeps its class and forward (its NoPE layers, masks,
cache, recording and final norm are the modeling code's).

The norms stay the modeling code's modules too (their state_dict keys and init as they
were): the ops read their weights. A model the fused layer would compute otherwise is
refused by name (`refusals`): a gate or a norm that does not compute what the op is given.

Nothing here imports the family's modeling code (older versions have none): modules are
told by what they compute.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn

from ...convert import norm_from
from ...ops.norm import add_norm, norm
from ...ops.norm_add import norm_add
from .layers import Shape, module


def gate_scales(gate: nn.Module) -> tuple[Tensor, Tensor]:
    """(alpha, beta) of a MuseSparkResidualGate, as its forward computes them from its gate
    Parameter (fp32), temperature and eps: beta = sigmoid(g / t), alpha = sqrt(max(sigmoid(-g / t)
    * (1 + beta), eps))."""
    w = gate.gate / gate.temperature
    beta = torch.sigmoid(w)
    return torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=gate.eps)), beta


def _input_scaled(post: nn.Module, m: Tensor) -> Tensor:
    """(1 + w) * m, rounded to m's dtype: the first step of MuseSparkTextInputScaledRMSNorm,
    whose weightless norm the fused norm_add computes."""
    return (m.float() * (1.0 + post.weight).float()).type_as(m)


def _gated(self, hidden_states: Tensor, **kwargs) -> Tensor:
    """A Muse Spark decoder layer with its gates and the norms around them in the ops (see
    the module docstring). Takes and returns what the unfused layer does: the stream h, the
    attention's keywords (masks, rotary embeddings or None on a NoPE layer, cache) passed on."""
    n1, n2, post = module(self, "norm_1"), module(self, "norm_2"), module(self, "mlp_norm")
    h = hidden_states
    x = norm(h, n1.weight, eps=n1.eps, weight_offset=1.0)
    a = module(self, "attn_norm")(module(self, "attn")(hidden_states=x, **kwargs)[0])
    alpha, beta = gate_scales(module(self, "attn_gate"))
    z, h = add_norm(a, h, n2.weight, eps=n2.eps, weight_offset=1.0, residual_dtype=h.dtype, residual_scale=alpha,
                    branch_scale=beta)
    m = _input_scaled(post, module(self, "mlp")(z))
    alpha, beta = gate_scales(module(self, "mlp_gate"))
    return norm_add(m, h, eps=post.eps, residual_dtype=h.dtype, residual_scale=alpha, branch_scale=beta)


GATED = Shape("per-channel gated sandwich", _gated, None,
              frozenset({"norm_1", "attn", "attn_norm", "attn_gate", "norm_2", "mlp", "mlp_norm", "mlp_gate"}))


def _probe_gate(gate: nn.Module, d: int) -> str | None:
    """Why `gate` is not the residual gate `gate_scales` reads (one [d] Parameter `gate`, a
    temperature and an eps; forward(r, f) = alpha * r + beta * f), or None. Its forward is
    run on CPU inputs with a CPU gate (torch.func.functional_call: the module's own
    Parameter, which may be on the meta device, is not read)."""
    params = dict(gate.named_parameters())
    if set(params) != {"gate"} or tuple(params["gate"].shape) != (d,) or next(gate.buffers(), None) is not None:
        return f"holds {', '.join(sorted(params)) or 'no parameters'}, not one gate Parameter of shape ({d},)"
    if not all(isinstance(getattr(gate, k, None), float | int) for k in ("temperature", "eps")):
        return "has no temperature and eps"
    with torch.device("cpu"):
        g = torch.Generator().manual_seed(0)
        probe = torch.randn(d, generator=g)
        r, f = torch.randn(3, d, generator=g), torch.randn(3, d, generator=g)
        with torch.no_grad():
            out = torch.func.functional_call(gate, {"gate": probe}, (r, f))
            alpha, beta = gate_scales(SimpleNamespace(gate=probe, temperature=gate.temperature, eps=gate.eps))
    if not torch.allclose(out, alpha * r + beta * f, rtol=1e-5, atol=1e-6):
        return "does not compute alpha * r + beta * f with alpha, beta from its gate"
    return None


def _probe_input_scaled(post: nn.Module, d: int) -> bool:
    """Whether `post` computes N((1 + w) * m) with a weightless RMS norm at its `eps`."""
    params = dict(post.named_parameters())
    if set(params) != {"weight"} or tuple(params["weight"].shape) != (d,) or not isinstance(getattr(post, "eps", None),
                                                                                             float):
        return False
    with torch.device("cpu"):
        g = torch.Generator().manual_seed(0)
        probe = {"weight": torch.randn(d, generator=g)}
        m = torch.randn(3, d, generator=g)
        with torch.no_grad():
            out = torch.func.functional_call(post, probe, (m,))
            expected = torch.nn.functional.rms_norm(m * (1.0 + probe["weight"]), (d,), eps=post.eps)
    return torch.allclose(out, expected, rtol=1e-4, atol=1e-5)


def refusals(base: nn.Module, family) -> list[str]:
    """Where a Muse Spark text model's layers differ from what the fused forward computes
    (beyond check.py's generic check of its modules); empty when they do not: each layer's
    N1 and N2 must be x / rms(x) * (1 + w) at their `eps`, its MLP's post-norm N((1 + w) * m)
    at its `eps`, its two gates alpha * r + beta * f from one [d] gate Parameter."""
    found = []
    d = base.config.hidden_size
    for i, layer in enumerate(getattr(base, family.model_parts["layers"])):
        name = f"{family.model_parts['layers']}[{i}]"
        for role in ("norm_1", "norm_2"):
            norm_module = getattr(layer, family.parts[role])
            try:
                fused = norm_from(norm_module)
            except TypeError:
                continue  # check.refusals names it
            if (fused.kind != "rms" or fused.weight is None or fused.bias is not None or fused.weight_offset != 1.0
                    or fused.eps != getattr(norm_module, "eps", None)):
                found.append(f"{name}.{family.parts[role]} is not x / rms(x) * (1 + w) at its eps (the op's norm)")
        post = getattr(layer, family.parts["mlp_norm"])
        if not _probe_input_scaled(post, d):
            found.append(f"{name}.{family.parts['mlp_norm']} is not N((1 + w) * m), a weightless RMS norm of the "
                         f"input-scaled branch at its eps (the norm norm_add is given)")
        for role in ("attn_gate", "mlp_gate"):
            why = _probe_gate(getattr(layer, family.parts[role]), d)
            if why is not None:
                found.append(f"{name}.{family.parts[role]} {why} (the residual_scale and branch_scale the op takes)")
        if found:
            break
    return found
