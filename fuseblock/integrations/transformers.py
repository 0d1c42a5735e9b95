"""Hugging Face transformers models on the fused residual stream: `fuse(model)`.

A pre-norm decoder layer of transformers computes

    h = x + attn(norm_1(x));  x' = h + mlp(norm_2(h))

and its model ends with norm_f(x_n): per layer two residual adds and two norms, each
reading the whole hidden state. Fused, each layer carries (p, r) as docs/stream.md
describes: it receives the previous layer's MLP output p un-added and the residual r,
and each add meets the norm after it in one `add_norm`:

    normed, r = add_norm(p, r, norm_1);  p = attn(normed)
    normed, r = add_norm(p, r, norm_2);  p = mlp(normed)        -> (p, r) to the next layer

and the model's final norm folds in the last add: norm_f(p + r) is one more add_norm.
n layers make 2n + 1 add_norm calls per forward and no separate residual add. Gemma2's
sandwich norms (post_attention_layernorm, post_feedforward_layernorm) normalize the
sublayer's output before the add: they belong to the sublayer, and the pre-norms fuse.

`fuse` works in place, on one model instance, with no class of transformers patched: a
fused and an unfused model live side by side in one process. It
- replaces every `*RMSNorm` module by a fuseblock Norm (fuseblock.convert.norm_from)
  holding the same Parameter, so state_dict keys, checkpoints, tied weights and
  optimizers stay as they were (Qwen3's q_norm / k_norm too; Gemma's x * (1 + w) is
  weight_offset=1);
- moves each decoder layer to a subclass of its own class (same name, created once per
  class) whose forward is the fused one: isinstance checks, gradient checkpointing
  (transformers' GradientCheckpointingLayer) and output-recording hooks still apply;
- binds a fused forward to the inner model instance (LlamaModel and friends), which
  keeps its other duties: embeddings (Gemma's scaled embedding is the embedding
  module's own), rotary embeddings, causal / sliding-window masks, the KV cache,
  output_hidden_states and output_attentions;
- binds an `_init_weights` to the model and its base model that initialises the Norms as
  transformers initialises the RMSNorms they replaced (it finds those by class name), so
  init_weights, post_init and from_pretrained's missing keys work on a fused model built
  on the meta device. fuse runs inside `with torch.device("meta")`, where from_pretrained
  builds its models.
"""
from __future__ import annotations

import types

import torch
from torch import Tensor, nn

from ..convert import norm_from
from ..modules import Norm
from ..ops.checks import check_float_dtype

try:
    import transformers
    from transformers import PreTrainedModel
    from transformers import initialization as hf_init
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.utils.generic import merge_with_config_defaults
    from transformers.utils.output_capturing import capture_outputs
except ImportError as e:
    raise ImportError("fuseblock.integrations.transformers needs transformers 5.17 to 5.23 "
                      f"(pip install 'transformers>=5.17,<5.24'): {e}") from e
if tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 17):  # layers returned tuples before 5
    raise ImportError(f"fuseblock.integrations.transformers needs transformers >= 5.17, found "
                      f"{transformers.__version__}")

__all__ = ["fuse", "SUPPORTED"]

# The private keyword the fused model forward gives its layers when hidden states are
# recorded: the layer then also returns p + r, its output in unfused terms (see _out).
_SUM = "fuseblock_hidden_state"


def _out(hidden: Tensor, residual: Tensor, want_sum: bool):
    """A fused layer's output (sum, p, r). transformers records a layer's hidden state
    from element 0 of its output (its output_hidden_states hooks), so element 0 is the
    unfused layer's output p + r when it is recorded, else None (no add)."""
    return (hidden + residual if want_sum else None), hidden, residual


def _pre_norm_forward(self, hidden_states: Tensor, residual: Tensor | None = None, **kwargs):
    """Llama, Mistral, Qwen2, Qwen3, Gemma: (p, r) -> (sum, p', r'), see _out.
    kwargs (masks, rotary embeddings, cache, ...) go to the attention, as in the unfused layer."""
    want_sum = kwargs.pop(_SUM, False)
    rdtype = self.fuseblock_residual_dtype
    normed, residual = self.input_layernorm.add(hidden_states, residual, residual_dtype=rdtype)
    attn = self.self_attn(hidden_states=normed, **kwargs)[0]
    normed, residual = self.post_attention_layernorm.add(attn, residual, residual_dtype=rdtype)
    return _out(self.mlp(normed), residual, want_sum)


def _sandwich_forward(self, hidden_states: Tensor, residual: Tensor | None = None, **kwargs):
    """Gemma2: the post-norms normalize each sublayer's output before it reaches the
    residual add, so they stay with the sublayer; the pre-norms fuse with the add."""
    want_sum = kwargs.pop(_SUM, False)
    rdtype = self.fuseblock_residual_dtype
    normed, residual = self.input_layernorm.add(hidden_states, residual, residual_dtype=rdtype)
    attn = self.post_attention_layernorm(self.self_attn(hidden_states=normed, **kwargs)[0])
    normed, residual = self.pre_feedforward_layernorm.add(attn, residual, residual_dtype=rdtype)
    return _out(self.post_feedforward_layernorm(self.mlp(normed)), residual, want_sum)


_PRE_NORM = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_SANDWICH = _PRE_NORM + ("pre_feedforward_layernorm", "post_feedforward_layernorm")
# config.model_type -> (fused decoder-layer forward, the submodules it uses)
_ARCHITECTURES = {
    "llama": (_pre_norm_forward, _PRE_NORM),
    "mistral": (_pre_norm_forward, _PRE_NORM),
    "qwen2": (_pre_norm_forward, _PRE_NORM),
    "qwen3": (_pre_norm_forward, _PRE_NORM),
    "gemma": (_pre_norm_forward, _PRE_NORM),
    "gemma2": (_sandwich_forward, _SANDWICH),
}
SUPPORTED = tuple(_ARCHITECTURES)
_MODEL_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")

# The mask each attention layer type reads (config.layer_types), as the models build them
_MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def _layer_masks(config, attention_mask, inputs_embeds, past_key_values, position_ids) -> list:
    """One attention mask per decoder layer. Models with config.layer_types (Qwen2, Qwen3,
    Gemma2) use one mask per layer type, which generate() may have prepared as a dict;
    the others one mask for all layers, sliding-window where the config has a window
    (Mistral)."""
    n, kinds = config.num_hidden_layers, getattr(config, "layer_types", None)
    if kinds is not None and isinstance(attention_mask, dict):
        return [attention_mask[k] for k in kinds[:n]]
    kw = dict(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
              past_key_values=past_key_values, position_ids=position_ids)
    if kinds is None:
        sliding = getattr(config, "sliding_window", None) is not None
        return [(create_sliding_window_causal_mask if sliding else create_causal_mask)(**kw)] * n
    made = {k: _MASKS[k](**kw) for k in dict.fromkeys(kinds[:n])}
    return [made[k] for k in kinds[:n]]


def _final_norm(norm: Norm, hidden: Tensor, residual: Tensor | None, rdtype: torch.dtype | None) -> Tensor:
    """norm_f(p + r) in one add_norm. add_norm's output has its first argument's dtype;
    by default the stream's, as the unfused model's norm of its stream (an fp32 stream
    under autocast gives an fp32 last_hidden_state); with an explicit residual_dtype the
    activations' (a bf16 model with an fp32 stream feeds its bf16 head bf16)."""
    if rdtype is None and residual is not None and torch.promote_types(hidden.dtype, residual.dtype) != hidden.dtype:
        hidden, residual = residual, hidden  # the sum is the same; out takes the wider dtype
    return norm.add(hidden, residual, residual_dtype=rdtype)[0]


def _model_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: Tensor | dict | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values=None,
    inputs_embeds: Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs,
) -> BaseModelOutputWithPast:
    """The inner model's forward (LlamaModel.forward and its kin) on the fused stream."""
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = self.embed_tokens(input_ids)
    if use_cache and past_key_values is None:
        past_key_values = DynamicCache(config=self.config)
    if position_ids is None:
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen).unsqueeze(0)
    masks = _layer_masks(self.config, attention_mask, inputs_embeds, past_key_values, position_ids)
    position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
    # transformers' capture_outputs records hidden states when this is truthy (its own test)
    if kwargs.get("output_hidden_states", getattr(self.config, "output_hidden_states", False)):
        kwargs[_SUM] = True
    hidden, residual = inputs_embeds, None
    for i, layer in enumerate(self.layers[: self.config.num_hidden_layers]):
        # hidden and residual positional: reentrant gradient checkpointing passes gradients to positional tensors only
        _, hidden, residual = layer(hidden, residual, attention_mask=masks[i], position_embeddings=position_embeddings,
                                    position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                                    **kwargs)
    hidden = _final_norm(self.norm, hidden, residual, self.fuseblock_residual_dtype)
    return BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values if use_cache else None)


# The decorators of the models' own forward: use_cache from the config, and the
# output_hidden_states / output_attentions recording (hooks on the layers) and return_dict
_FUSED_MODEL_FORWARD = merge_with_config_defaults(capture_outputs(_model_forward))

_FUSED_LAYER_CLASSES: dict[tuple[type, object], type] = {}


def _fused_layer_class(cls: type, forward) -> type:
    """A subclass of the decoder layer class cls with the fused forward, created once per
    class. It keeps cls's name (transformers finds layers by class name, e.g.
    _no_split_modules), and being a subclass, transformers' GradientCheckpointingLayer
    wraps its forward for checkpointing as it does cls's."""
    if getattr(cls, "_fuseblock_fused", False):
        return cls
    key = (cls, forward)
    if key not in _FUSED_LAYER_CLASSES:
        _FUSED_LAYER_CLASSES[key] = type(cls.__name__, (cls,), {
            "forward": forward, "_fuseblock_fused": True, "__module__": __name__, "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__name__} on the fused residual stream: forward(p, r, **kwargs) -> (sum, p', r'); "
                       "see fuseblock.integrations.transformers."})
    return _FUSED_LAYER_CLASSES[key]


def _is_rms_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")


def _convert_norms(model: nn.Module) -> None:
    """Every RMSNorm of model becomes a fuseblock Norm with the same parameters; a module
    reachable under several names stays one module. A norm transformers has initialised
    (the flag its init_weights sets, and skips a module by) stays marked so: a later
    init_weights or post_init leaves it alone, as it would the original."""
    converted: dict[int, Norm] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_rms_norm(child):
                if id(child) not in converted:
                    norm = converted[id(child)] = norm_from(child)
                    if getattr(child, "_is_hf_initialized", False):
                        norm._is_hf_initialized = True
                setattr(parent, name, converted[id(child)])


def _init_weights(self: PreTrainedModel, module: nn.Module) -> None:
    """`_init_weights` of each PreTrainedModel of a fused model, bound to the instance by fuse.

    transformers initialises weights through this one method: init_weights and post_init,
    and the keys from_pretrained finds missing (all of them on a model built on the meta
    device and moved with to_empty). It recognises a norm by its class name (*RMSNorm,
    *LayerNorm), which a fuseblock Norm does not carry, so the class's method would leave
    a Norm as it finds it: uninitialised memory. A Norm gets the initial values of the
    function it computes, which are what transformers gives the RMSNorm it replaced: the
    identity map, weight ones, or zeros where the weight has an offset (Gemma's 1 + w, which
    Gemma's _init_weights zeroes); bias zeros (Norm.reset_parameters' values). Through
    transformers' init functions, which leave a tensor flagged as loaded alone. Every other
    module goes to the class's own method."""
    if not isinstance(module, Norm):
        type(self)._init_weights(self, module)
        return
    if module.weight is not None:
        (hf_init.zeros_ if module.weight_offset != 0.0 else hf_init.ones_)(module.weight)
    if module.bias is not None:
        hf_init.zeros_(module.bias)


def fuse(model: PreTrainedModel, *, residual_dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Put a transformers model on the fused residual stream, in place; returns it.

    model: a PreTrainedModel of a supported architecture (`SUPPORTED`: Llama, Mistral,
    Qwen2, Qwen3, Gemma, Gemma2), the bare model (LlamaModel) or one with a head
    (LlamaForCausalLM, ...). Its state_dict keys do not change: its save_pretrained output
    loads into the unfused class, and checkpoints of the unfused class load into it.

    residual_dtype: the dtype of the residual stream. None (default) is what the unfused
    model's own adds give (torch's type promotion: under bf16 autocast with fp32
    parameters the stream is fp32 already); torch.float32 keeps an fp32 stream in a bf16
    model. Calling fuse again on a fused model only changes residual_dtype.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    check_float_dtype("residual_dtype", residual_dtype)
    base = model.base_model
    model_type = getattr(base.config, "model_type", None)
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"fuse supports the architectures {', '.join(SUPPORTED)} (config.model_type); "
                         f"{type(model).__name__} has model_type {model_type!r}")
    layer_forward, parts = _ARCHITECTURES[model_type]
    missing = [p for p in _MODEL_PARTS if not hasattr(base, p)]
    missing += [f"layers[{i}].{p}" for i, layer in enumerate(getattr(base, "layers", ())) for p in parts
                if not hasattr(layer, p)]
    if missing:
        raise ValueError(f"{type(base).__name__} ({model_type}) lacks {', '.join(missing)}: not the layout fuse "
                         f"supports")
    _convert_norms(model)
    for module in model.modules():
        if isinstance(module, PreTrainedModel):  # the model and its base model each initialise their own modules
            module._init_weights = types.MethodType(_init_weights, module)
    for layer in base.layers:
        layer.__class__ = _fused_layer_class(type(layer), layer_forward)
        layer.fuseblock_residual_dtype = residual_dtype
    base.fuseblock_residual_dtype = residual_dtype
    base.forward = types.MethodType(_FUSED_MODEL_FORWARD, base)
    return model
