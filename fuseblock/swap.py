"""`swap_norms`: every norm of any model swapped in place for a fuseblock `Norm`.

Each norm-like module (torch's norms, or a module without submodules named *Norm* or
holding an `eps` or `variance_epsilon`) is converted by `norm_from` and kept only when the
conversion is proved on probes: the Norm's output and every gradient (input, weight,
bias) match the module's own forward on inputs of 2, 3 and 4 dims, and the state_dict
keys are the same. The Norm holds the module's own Parameter objects, so an optimizer
built before the swap and weights tied elsewhere stay valid, and a module reachable under
several names is replaced by one Norm everywhere. Anything not proved is left in place,
with the reason, in the returned `SwapReport`: a swap is never a silent change.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from .convert import OTHER_AXIS_NORMS, hf_eps, norm_from
from .modules.norm import Norm

# The hooks a module can carry that its replacement would not (torch's names for them)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
# The probe's leading dims: rows, a sequence, an image's height and width. A module that
# treats one rank otherwise (a channels-first branch for 4-d input) differs on that one.
_PROBE_SHAPES = ((5,), (2, 3), (2, 3, 2))
# What a forward raises on an input it does not take (norm_from's probe catches the same):
# anything else, an interrupt or someone's control flow, passes
_FORWARD_ERRORS = (RuntimeError, TypeError, ValueError, AttributeError, IndexError, KeyError)


@dataclass(frozen=True)
class SwapReport:
    """What `swap_norms` did: `swapped`, the qualified names of the modules now a fuseblock
    Norm; `left_alone`, each norm-like module it kept, by name, with the reason; `notes`,
    for a swapped module, what differs outside the probes' fp32 (the output dtype of a
    written-out norm given bf16 input and fp32 weights). A module reachable under several
    names is listed under the first `named_modules` gives."""

    swapped: tuple[str, ...] = ()
    left_alone: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"swapped {len(self.swapped)} norm(s) for fuseblock.Norm"]
        lines += [f"  {name}" + (f" (note: {self.notes[name]})" if name in self.notes else "")
                  for name in self.swapped]
        lines += [f"left {len(self.left_alone)} alone"] if self.left_alone else []
        lines += [f"  {name or '(the model)'}: {why}" for name, why in self.left_alone.items()]
        return "\n".join(lines)


def swap_norms(model: nn.Module) -> SwapReport:
    """Replace, in place, every norm of `model` that a fuseblock Norm computes exactly
    (nn.LayerNorm and nn.RMSNorm over the last dim, Hugging Face style RMSNorms, written-out
    RMSNorms and LayerNorms, see the module docstring), sharing its Parameters. Returns a
    SwapReport naming what was swapped and what was left alone, and why.

    Exact means the same function with the same parameters: on the torch path in fp32
    the outputs and gradients match the module's to rounding (a written-out norm rounds
    differently from torch's fused one); in bf16 and fp16 a Norm rounds once, after the
    weight, where some forms round before it. Given bf16 input and fp32 weights a Norm
    returns bf16, as nn.RMSNorm does, where a written-out norm that multiplies by the
    weight last returns fp32: `report.notes` names those. References to a norm held
    outside the module tree (a list attribute, a closure) still point at the old module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"swap_norms needs an nn.Module (the model), got {type(model).__name__}")
    swapped, left, notes, replacement = [], {}, {}, {}
    for name, module in model.named_modules():  # each module once, under its first name
        if not _norm_like(module):
            continue
        norm = _replacement(module, name)
        if isinstance(norm, str):  # why there is none
            left[name] = norm
            continue
        replacement[id(module)] = norm
        swapped.append(name)
        note = _dtype_note(module, norm)
        if note:
            notes[name] = note
    # every edge into a swapped module, so a module under several names stays one
    for parent in list(model.modules()):
        for key, child in parent._modules.items():
            if child is not None and id(child) in replacement:
                parent._modules[key] = replacement[id(child)]
    return SwapReport(tuple(swapped), left, notes)


def _norm_like(module: nn.Module) -> bool:
    """Whether the report should account for `module`: one of torch's norms (a parametrized
    one holds its parametrizations as a child), or a leaf named like a norm or holding an eps."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, Norm, *OTHER_AXIS_NORMS)):
        return True
    return next(module.children(), None) is None and (
        "norm" in type(module).__name__.lower() or hf_eps(module) is not None)


def _replacement(module: nn.Module, name: str) -> Norm | str:
    """The Norm to put in `module`'s place, or why there is none."""
    if name == "":
        return "the model itself is a norm: swap_norms replaces submodules (fuseblock.norm_from converts one)"
    if isinstance(module, Norm):
        return "already a fuseblock Norm"
    hooks = [h.strip("_") for h in _HOOKS if getattr(module, h, None)]
    if hooks or "forward" in module.__dict__:
        what = ", ".join(hooks) or "an instance-level forward"
        return f"it carries {what}, which the swap would drop"
    if parametrize.is_parametrized(module):
        return "its parameters are parametrized (torch.nn.utils.parametrize)"
    try:
        norm = norm_from(module)
    except TypeError as e:
        return str(e).removeprefix("norm_from: ")
    keys, norm_keys = module.state_dict(keep_vars=True).keys(), norm.state_dict(keep_vars=True).keys()
    if set(keys) != set(norm_keys):
        return f"its state_dict keys {sorted(keys)} differ from the Norm's {sorted(norm_keys)}"
    mismatch = _mismatch(module, norm)
    if mismatch:
        return f"the Norm built for it ({_describe(norm)}) differs from its forward: {mismatch}"
    norm.train(module.training)
    return norm


def _dtype_note(module: nn.Module, norm: Norm) -> str | None:
    """How the output dtypes of module and norm differ for bf16 input with fp32 weights
    (mixed precision by hand, or autocast, which leaves norms in fp32), or None."""
    params = dict(module.named_parameters())
    if not params:
        return None
    with torch.device("cpu"), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's rms_norm warns of the mixed dtypes it is given
        x = torch.randn(2, norm.dim, dtype=torch.bfloat16)
        probe = {k: torch.ones(p.shape) for k, p in params.items()}
        dtypes = []
        for m in (module, norm):
            try:
                dtypes.append(str(torch.func.functional_call(m, probe, (x,)).dtype).removeprefix("torch."))
            except _FORWARD_ERRORS as e:
                dtypes.append(f"{type(e).__name__}")
    if dtypes[0] == dtypes[1]:
        return None
    return (f"given bf16 input and fp32 weights it returned {dtypes[0]} where the Norm returns {dtypes[1]} "
            f"(x's dtype, as nn.RMSNorm)")


def _describe(norm: Norm) -> str:
    offset = f", weight_offset={norm.weight_offset}" if norm.weight_offset else ""
    return f"kind={norm.kind!r}, eps={norm.eps}{offset}"


def _mismatch(module: nn.Module, norm: Norm) -> str | None:
    """What differs between module and norm on fp32 probes of each of _PROBE_SHAPES, values
    and the gradients of the input and every parameter; None when nothing does. Both run on
    CPU copies of the parameters (functional_call), so the module's own, on a GPU or the
    meta device, are neither read nor changed."""
    d = norm.dim
    with torch.device("cpu"):
        gen = torch.Generator().manual_seed(1)
        params = {k: p for k, p in module.named_parameters()}
        probe = {k: (torch.rand(p.shape, generator=gen) + 0.5 if k == "weight" else torch.randn(p.shape, generator=gen))
                 for k, p in params.items()}
        for lead in _PROBE_SHAPES:
            x = 3 * torch.randn(*lead, d, generator=gen)
            x.view(-1, d)[0] *= 1e-3  # a row whose size is near sqrt(eps): eps matters
            g = torch.randn(*lead, d, generator=gen)
            runs = []
            for m in (module, norm):
                xi = x.clone().requires_grad_()
                pi = {k: v.clone().requires_grad_() for k, v in probe.items()}
                try:
                    out = torch.func.functional_call(m, pi, (xi,))
                    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
                        return f"on input of shape {tuple(x.shape)} it returns " + (
                            f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__)
                    grads = torch.autograd.grad(out, [xi, *pi.values()], g, allow_unused=True)
                except _FORWARD_ERRORS as e:
                    return f"on input of shape {tuple(x.shape)} it raised {type(e).__name__}: {e}"
                runs.append((out, grads))
            (want, want_grads), (got, got_grads) = runs
            for what, a, b in [("output", got, want), *zip(["d_input", *(f"d_{k}" for k in probe)],
                                                          got_grads, want_grads, strict=True)]:
                if a is None and b is None:
                    continue
                a = torch.zeros_like(b) if a is None else a  # no path to it: a zero gradient
                b = torch.zeros_like(a) if b is None else b
                scale = max(1.0, b.abs().max().item())
                if not torch.allclose(a.float() / scale, b.float() / scale, rtol=1e-4, atol=1e-5):
                    return f"{what} on input of shape {tuple(x.shape)}, max difference {(a - b).abs().max():.3g}"
    return None
