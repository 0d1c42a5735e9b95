"""The attention-residual shape (transformers 5.24's inkling2_loop) on fuseblock's attn_res ops.

An Inkling2Loop decoder layer reads the stream through block attention residuals
(docs/stream.md, "Attention residuals"): per token, a softmax mix with one learned query
over the finished blocks' states B and the running partial block, its normed keys as the
values (scale d^-1/2), then the sublayer's RMSNorm:

    x = attn_res_a(B, h);          a = conv_a(attn(N1(x)))
    r = h + a                      (r = a at a block boundary, where h joins B)
    z = attn_res_m(B, r);          h' = r + conv_m(mlp(N2(z)))

Fused, each mix and the norm after it are one `attn_res_add_norm`, which reads B as the
model forward keeps it (no stacked copy of B and the partial block): for the attention's
input with h as the partial' (the branch alone, no add), for the MLP's with the add
r = h + a in the same op, which returns r. The torch path takes the modeling code's order of operations
(form "inkling2": its eager attention of one query), so fp32 is the unfused model bit for
bit. What the op does not compute stays the modeling code's, run as the unfused layer
runs it: the short convolutions after each sublayer, the full-attention layers' three-query
mix (one mix each for q, k and v, then three norms: the op takes one query), the loop
passes' message gates (between a mix and its norm: there the layer's own modules compute
both), the model forward with its loop passes, messages and the final mix and norm.

A model the fused layer would compute otherwise is refused by name (`refusals`): a mix
the fused forward takes with several queries, a norm that is not a weighted RMSNorm, more
sources than the op takes (S <= 16).

Nothing here imports the family's modeling code (5.23 has none): layers are told by
their modules.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ...attn_res_spec import MAX_SOURCES
from ...ops.attn_res import attn_res_add_norm
from .layers import Shape, module

# the layer classes the fused forward takes, sliding-window and full attention, plain and looped
LAYER_CLASSES = frozenset({"Inkling2LoopSlidingDecoderLayer", "Inkling2LoopFullDecoderLayer",
                           "Inkling2LoopSlidingLoopDecoderLayer", "Inkling2LoopFullLoopDecoderLayer"})
_GATES = ("q_message_gate", "k_message_gate", "v_message_gate", "mlp_message_gate")


def _options(mix: nn.Module, norm: nn.Module, d: int) -> dict:
    """The attn_res ops' keywords for an Inkling2BlockAttentionResidual and the RMSNorm after
    it, as their forwards read them: the keys' unweighted norm's eps, the norm's eps,
    scale = hidden_size^-1/2, the normed keys as values, the modeling code's order."""
    return dict(scale=d ** -0.5, key_eps=mix.norm.eps, eps=norm.variance_epsilon, normed_values=True,
                form="inkling2")


def _mix_norm(mix: nn.Module, norm: nn.Module, block_states: Tensor, partial: Tensor) -> Tensor:
    """norm(mix(B, h)): h the partial block, the last source (the op's partial' = h)."""
    d = partial.shape[-1]
    return attn_res_add_norm(block_states.float(), partial.float(), None, mix.query, norm.weight,
                             **_options(mix, norm, d))[0]


def _add_mix_norm(mix: nn.Module, norm: nn.Module, block_states: Tensor, branch: Tensor,
                  partial: Tensor | None) -> tuple[Tensor, Tensor]:
    """(norm(mix(B, r)), r) with r = partial + branch (branch alone without a partial) in the same op."""
    d = branch.shape[-1]
    y, _, r = attn_res_add_norm(block_states.float(), branch.float(), None if partial is None else partial.float(),
                                mix.query, norm.weight, **_options(mix, norm, d))
    return y, r


def _attn_res(self, hidden_states: Tensor, block_states: Tensor, messages: Tensor | None = None,
              attention_mask=None, relative_distance=None, conv_mask=None, cache=None, cache_offset: int = 0,
              **kwargs) -> Tensor:
    """An Inkling2Loop decoder layer (any of its four classes) with each one-query mix and
    its norm in one attn_res op; see the module docstring. Takes and returns what the
    unfused layer does (the stream is the modeling code's: h, and B the model forward keeps)."""
    dtype = hidden_states.dtype
    h = hidden_states
    full = self.attention_type == "full_attention"
    looped = hasattr(self, _GATES[0])
    mix_a, attn = module(self, "attn_input"), module(self, "attn")
    if messages is not None:
        query_message, key_message, value_message, mlp_message = messages.unbind(-2)
    if full:  # three queries: the module's own mix, the message gates, then q / k / v's norms
        qkv = (h, h, h) if mix_a is None else mix_a(block_states, h)
        if messages is not None:
            qkv = tuple(getattr(self, g)(x, m) for g, x, m in zip(_GATES[:3], qkv, (query_message, key_message,
                                                                                      value_message), strict=True))
        q, k, v = (getattr(self, n)(x).to(dtype) for n, x in
                   zip(("q_input_layernorm", "k_input_layernorm", "v_input_layernorm"), qkv, strict=True))
        inputs = dict(hidden_states=q, key_hidden_states=k, value_hidden_states=v)
    else:
        norm_1 = module(self, "norm_1")
        if mix_a is None:  # layer 0 reads the embeddings as they are
            x = norm_1(h)
            inputs = dict(hidden_states=x.to(dtype))
        elif messages is None:
            inputs = dict(hidden_states=_mix_norm(mix_a, norm_1, block_states, h).to(dtype))
        else:  # the message gates sit between the mix and its norm: the layer's own modules
            x = mix_a(block_states, h)[0]
            q, k, v = (norm_1(getattr(self, g)(x, m)).to(dtype) for g, m in
                       zip(_GATES[:3], (query_message, key_message, value_message), strict=True))
            inputs = dict(hidden_states=q, key_hidden_states=k, value_hidden_states=v)
    offset = {"cache_offset": cache_offset} if looped else {}
    a, _ = attn(**inputs, attention_mask=attention_mask, relative_distance=relative_distance, conv_mask=conv_mask,
                cache=cache, **offset, **kwargs)
    a = self.post_attention_convolution(a, cache=cache, conv_mask=conv_mask, **offset, **kwargs)
    partial = None if self.is_block_boundary else h
    if self.is_block_boundary:  # h completes its block: a source from here on
        block_states = torch.cat([block_states, h.unsqueeze(-2)], dim=-2)
    mix_m, norm_2 = module(self, "mlp_input"), module(self, "norm_2")
    if messages is None:
        z, residual = _add_mix_norm(mix_m, norm_2, block_states, a, partial)
    else:
        residual = a.float() if partial is None else partial.float() + a.float()
        z = norm_2(self.mlp_message_gate(mix_m(block_states, residual)[0], mlp_message))
    out = module(self, "mlp")(z.to(dtype))
    out = self.post_mlp_convolution(out, cache=cache, conv_mask=conv_mask, **offset, **kwargs)
    return (residual + out).to(dtype)


ATTN_RES = Shape("attention residuals", _attn_res, None,
                 frozenset({"attn_input", "norm_1", "attn", "mlp_input", "norm_2", "mlp"}))


def max_sources(config) -> int:
    """The most sources a fused mix takes: the blocks begun by the last layer, and the partial."""
    n, block = config.num_hidden_layers, config.n_layers_per_attn_res_block
    return (n - 1) // block + 1 + 1


def refusals(base: nn.Module, family) -> list[str]:
    """Where an Inkling2Loop text model differs from what the fused layers compute; empty
    when it does not. Each one-query mix the fused forward takes (the sliding layers'
    attention input, every layer's MLP input) must hold one query of the hidden size and
    be followed by a weighted RMSNorm; the mixes may take at most MAX_SOURCES sources."""
    found = []
    layers = getattr(base, family.model_parts["layers"], None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return [f"{type(base).__name__} has no decoder layers in {family.model_parts['layers']!r}"]
    config, d = base.config, base.config.hidden_size
    for i, layer in enumerate(layers):
        name = f"{family.model_parts['layers']}[{i}]"
        if type(layer).__name__ not in LAYER_CLASSES:
            found.append(f"{name} is a {type(layer).__name__}, not one of the decoder layers the fused forward "
                         f"computes ({', '.join(sorted(LAYER_CLASSES))})")
            break
        pairs = [("mlp_input", "norm_2")]
        if layer.attention_type != "full_attention":
            pairs.insert(0, ("attn_input", "norm_1"))
        for mix_role, norm_role in pairs:
            mix, norm = (getattr(layer, family.parts[r], None) for r in (mix_role, norm_role))
            mix_name = f"{name}.{family.parts[mix_role]}"
            if mix is None:
                continue  # layer 0's attention reads the embeddings unmixed
            query = getattr(mix, "query", None)
            if query is None or tuple(query.shape) != (d,):
                shape = None if query is None else tuple(query.shape)
                found.append(f"{mix_name}.query has shape {shape}, where attn_res_norm mixes with one query "
                             f"({d},) (several queries: one mix each, which the op does not compute)")
            elif getattr(getattr(mix, "norm", None), "eps", None) is None:
                found.append(f"{mix_name} has no unweighted key norm (norm.eps) the op computes")
            weight = getattr(norm, "weight", None)
            if (not type(norm).__name__.endswith("RMSNorm") or weight is None or tuple(weight.shape) != (d,)
                    or getattr(norm, "variance_epsilon", None) is None):
                found.append(f"the norm after {mix_name} ({name}.{family.parts[norm_role]}) is not a weighted "
                             f"RMSNorm of width {d} (the op's norm)")
        if found:
            break
    s = max_sources(config)
    if s > MAX_SOURCES:
        found.append(f"config.num_hidden_layers = {config.num_hidden_layers} in blocks of "
                     f"config.n_layers_per_attn_res_block = {config.n_layers_per_attn_res_block} gives mixes of up "
                     f"to {s} sources, where attn_res_norm takes 1 to {MAX_SOURCES}")
    return found
