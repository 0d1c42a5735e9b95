"""Kernel-hub layers: forwards that `kernels.kernelize` puts in place of a transformers
module's own, in the `kernels` package's layer format.

A hub layer is an nn.Module subclass with no constructor and no members but `forward`
(and the flags `has_backward`, `can_torch_compile`): kernelize binds its forward to the
module it replaces, which keeps its own parameters and attributes, so forward reads
those by the names the replaced class uses:

- `RMSNorm` for `@use_kernel_forward_from_hub("RMSNorm")` classes (LlamaRMSNorm,
  Qwen3RMSNorm, ...): `weight`, `variance_epsilon`; out = x / rms(x) * weight, in the
  dtype those classes return: the promotion of the input's and the weight's (fp32 for a
  bf16 input and an fp32 weight), from the fp32 product rounded once.
- `RMSNormZeroCentered` for `"RMSNormZeroCentered"` (Qwen3_5RMSNorm, Qwen3_5MoeRMSNorm:
  transformers 5.24 names the hub layer and maps no kernel to it): `weight`, `eps`;
  out = x / rms(x) * (1 + weight) in fp32, in x's dtype (weight_offset = 1).
- `RMSNormGated` for `"RMSNormGated"` (Qwen3NextRMSNormGated and its copies): `weight`,
  `variance_epsilon`, `activation`; out = (x / rms(x) * weight) * act(gate), the gate
  after the norm, as those classes compute it.

All run `fuseblock.norm`: its Triton kernels on CUDA (and CPU under TRITON_INTERPRET=1),
its torch path elsewhere, with their backward and torch.compile support. The add before
the norm stays the model's own here: `fuseblock.integrations.transformers.fuse` fuses it
too (docs/transformers.md says when to use which).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.norm import norm

__all__ = ["RMSNorm", "RMSNormGated", "RMSNormZeroCentered"]


def rms_norm_forward(module: nn.Module, hidden_states: Tensor) -> Tensor:
    w = module.weight
    out = None if w is None or w.dtype == hidden_states.dtype else torch.promote_types(hidden_states.dtype, w.dtype)
    return norm(hidden_states, w, eps=module.variance_epsilon, out_dtype=out)


def zero_centered_rms_norm_forward(module: nn.Module, hidden_states: Tensor) -> Tensor:
    return norm(hidden_states, module.weight, eps=module.eps, weight_offset=1.0).to(hidden_states.dtype)


def gated_rms_norm_forward(module: nn.Module, hidden_states: Tensor, gate: Tensor | None) -> Tensor:
    act = getattr(module, "activation", "silu")
    if act not in ("silu", "swish", "sigmoid"):
        raise ValueError(f"fuseblock's RMSNormGated takes activation 'silu', 'swish' or 'sigmoid', got {act!r}")
    return norm(hidden_states, module.weight, eps=module.variance_epsilon, gate=gate, gate_act=act,
                gate_position="post")


class RMSNorm(nn.Module):
    """LlamaRMSNorm's forward(hidden_states) on fuseblock.norm (module docstring)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm_forward(self, hidden_states)


class RMSNormZeroCentered(nn.Module):
    """Qwen3_5RMSNorm's forward(x) on fuseblock.norm: the weight stored as w, applied as 1 + w."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centered_rms_norm_forward(self, x)


class RMSNormGated(nn.Module):
    """Qwen3NextRMSNormGated's forward(hidden_states, gate) on fuseblock.norm."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        return gated_rms_norm_forward(self, hidden_states, gate)
