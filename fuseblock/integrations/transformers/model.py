"""The inner model's forward (LlamaModel.forward and its kin) on the fused stream.

It keeps the model's duties (embeddings, rotary embeddings, causal / sliding-window masks,
the KV cache, hidden-state and attention recording through transformers' own decorators)
and changes only the stream: the layers pass (p, r) on, and the final norm folds in the
last add through the shape's `enter`. n layers of a
pre-norm family make 2n + 1 add_norm calls per forward and no separate residual add.
The n-stream (hyper-connection) families have a forward of their own (`hyper_forward`):
n layers make 2n hc ops and the head one more.
"""
from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from ...ops.hyper import hc_head
from .layers import SUM, branch
from .versions import CACHE, one_cache

# The private keyword under which a family's model forward hands its prepare step inputs
# of its own (GPT-2's token_type_ids), which the layers do not take
PREPARE = "fuseblock_prepare"

# The mask each attention layer type reads (config.layer_types), as the models build them
_MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def _layer_masks(config, family, attention_mask, inputs_embeds, cache, position_ids) -> list:
    """One attention mask per decoder layer. Models with config.layer_types (Qwen2, Qwen3,
    Gemma2) use one mask per layer type, which generate() may have prepared as a dict;
    the others one mask for all layers, sliding-window where the family's model reads the
    config's window (Mistral: family.window_mask), else causal."""
    n, kinds = config.num_hidden_layers, getattr(config, "layer_types", None)
    if kinds is not None and isinstance(attention_mask, dict):
        return [attention_mask[k] for k in kinds[:n]]
    kw = {"config": config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask, CACHE: cache,
          "position_ids": position_ids}
    if kinds is None:
        sliding = family.window_mask and getattr(config, "sliding_window", None) is not None
        return [(create_sliding_window_causal_mask if sliding else create_causal_mask)(**kw)] * n
    made = {k: _MASKS[k](**kw) for k in dict.fromkeys(kinds[:n])}
    return [made[k] for k in kinds[:n]]


def _rotary(base, family, hidden: Tensor, position_ids: Tensor, n: int) -> list:
    """Each layer's position_embeddings keyword: one rotary embedding for all layers, one
    per layer type (Gemma3: config.layer_types), or none."""
    if family.rotary is None:
        return [None] * n
    rotary = getattr(base, family.model_parts["rotary"])
    if family.rotary == "shared":
        return [rotary(hidden, position_ids)] * n
    kinds = base.config.layer_types[:n]
    made = {k: rotary(hidden, position_ids, k) for k in dict.fromkeys(kinds)}
    return [made[k] for k in kinds]


def _final_norm(base, family, last, hidden: Tensor, residual: Tensor | None, *rest: Tensor) -> Tensor:
    """norm_f(r + b(p)) in one op (the shape's enter). Its output has the first argument's
    dtype; by default the stream's, as the unfused model's norm of its stream (an fp32
    stream under autocast gives an fp32 last_hidden_state); with an explicit residual_dtype
    the activations' (a bf16 model with an fp32 stream feeds its bf16 head bf16). Where the
    branch is plain the two may swap places to give the wider dtype: the sum is the same.
    A stream with more terms (`rest`: the parallel shape's p1) has its branch outputs cast
    to the wider dtype instead (x1 takes x's dtype), exactly."""
    rdtype, norm = base.fuseblock_residual_dtype, getattr(base, family.model_parts["norm"])
    if (rdtype is None and residual is not None and torch.promote_types(hidden.dtype, residual.dtype) != hidden.dtype):
        if rest:
            hidden, rest = hidden.to(residual.dtype), tuple(t.to(residual.dtype) for t in rest)
        elif not branch(last, "mlp"):
            hidden, residual = residual, hidden
    return family.shape.enter(last, hidden, residual, norm, rdtype, *rest)[0]


def _embeddings_and_cache(base, family, input_ids, inputs_embeds, cache, use_cache):
    """(the input embeddings, the cache), as the unfused model forwards begin: exactly one
    of input_ids and inputs_embeds, and a DynamicCache when one is wanted and none given."""
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = family.embed(base, input_ids)
    if use_cache and cache is None:
        cache = DynamicCache(config=base.config)
    return inputs_embeds, cache


def _record_sums(base, kwargs: dict) -> None:
    """Ask the layers for their unfused outputs (SUM) when hidden states are recorded:
    transformers' capture_outputs records them when this is truthy (its own test)."""
    if kwargs.get("output_hidden_states", getattr(base.config, "output_hidden_states", False)):
        kwargs[SUM] = True


def stream_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: Tensor | dict | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,
    inputs_embeds: Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs,
):
    """The inner model's forward on the fused stream (see the module docstring). The KV
    cache comes as `cache` (transformers 5.24's name, fourth as in its models' forwards)
    or `past_key_values` (5.23's), and goes to the layers under the installed version's
    name (the family's cache_keyword)."""
    family = self.fuseblock_family
    cache = one_cache(cache, kwargs)
    inputs_embeds, cache = _embeddings_and_cache(self, family, input_ids, inputs_embeds, cache, use_cache)
    rotary_ids, position_ids = family.positions(self, position_ids, inputs_embeds, cache)
    n = self.config.num_hidden_layers
    masks = _layer_masks(self.config, family, attention_mask, inputs_embeds, cache, position_ids)
    hidden = family.prepare(self, inputs_embeds, position_ids, **kwargs.pop(PREPARE, {}))
    rotary = _rotary(self, family, hidden, rotary_ids, n)
    _record_sums(self, kwargs)
    stream, layers = (hidden, None), getattr(self, family.model_parts["layers"])[:n]
    to_layers = {family.cache_keyword or CACHE: cache}
    for i, layer in enumerate(layers):
        # the stream (p, r, and any more a shape carries) positional: reentrant gradient
        # checkpointing passes gradients to positional tensors only
        stream = layer(*stream, attention_mask=masks[i], position_embeddings=rotary[i], position_ids=position_ids,
                       use_cache=use_cache, **to_layers, **kwargs)[1:]
    hidden = _final_norm(self, family, layers[-1], *stream)
    return family.output(last_hidden_state=hidden, **{CACHE: cache if use_cache else None})


# The decorators of the models' own forward: use_cache from the config, and the
# output_hidden_states / output_attentions / router-logits recording (hooks on the
# modules) and return_dict
FUSED_MODEL_FORWARD = merge_with_config_defaults(capture_outputs(stream_forward))


def _hyper_head(base, family, streams: Tensor, branch: Tensor, post: Tensor, comb: Tensor | None) -> Tensor:
    """norm_f(head(H')) with the last layer's update H' = post (x) f + comb^T H in one hc_head:
    the head's own pre (DeepSeek-V4's and HY-V4's hc_head) or the streams' mean (GLM-5-next)."""
    head, norm = (getattr(base, family.model_parts[r]) for r in ("head", "norm"))
    hyper = family.hyper
    weights = (head.hc_fn, head.hc_base, head.hc_scale) if hyper.weighted_head else (None, None, None)
    kw = {"hc_eps": head.eps} if hyper.weighted_head else {}
    return hc_head(streams, *weights, norm.weight, branch=branch, post=post, comb=comb, eps=norm.eps,
                   form=hyper.form, **kw)[0]


def hyper_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: Tensor | dict | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,
    inputs_embeds: Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs,
):
    """The n-stream families' inner-model forward (DeepseekV4Model.forward and its kin) on
    the fused boundaries: the embeddings copied to config.hc_mult streams, the layers
    passing (H, f, post, comb) on (layers.HYPER) and the top-k indices where they share
    them, the head taking the last update in. Masks, rotary embeddings and the cache are
    the family's (its Hyper.inputs), as its unfused forward builds them; the cache comes
    under either name, as stream_forward's."""
    family = self.fuseblock_family
    hyper = family.hyper
    cache = one_cache(cache, kwargs)
    inputs_embeds, cache = _embeddings_and_cache(self, family, input_ids, inputs_embeds, cache, use_cache)
    position_ids = family.positions(self, position_ids, inputs_embeds, cache)[1]
    layers = getattr(self, family.model_parts["layers"])[:self.config.num_hidden_layers]
    inputs = hyper.inputs(self, input_ids, inputs_embeds, attention_mask, position_ids, cache, use_cache)
    _record_sums(self, kwargs)
    streams = inputs_embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
    stream, topk = (streams, None, None, None), None
    for layer, keywords in zip(layers, inputs, strict=True):
        shared = {"prev_topk_indices": topk} if hyper.topk else {}
        # the stream positional (reentrant gradient checkpointing passes gradients to positional tensors only)
        out = layer(*stream, **keywords, **shared, **kwargs)
        stream, topk = out[1:5], out[5]
    hidden = _hyper_head(self, family, *stream)
    return family.output(last_hidden_state=hidden, **{CACHE: cache})


HYPER_MODEL_FORWARD = merge_with_config_defaults(capture_outputs(hyper_forward))
