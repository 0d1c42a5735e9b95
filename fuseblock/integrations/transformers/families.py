"""What `fuse` knows of each transformers family, by `config.model_type`.

A `Family` says which stream shape its decoder layers take (layers.py), which module of a
layer plays each role of that shape, what its inner model holds, and which of the config's
block scalars (check.py) its fused forward reads. fuse fuses a model only where the
family is named here *and* the model's structure is what the entry says (check.py): a
name is never enough.

`REFUSED` names families fuse knows and refuses, with the reason; every other causal LM
of transformers is refused as not (yet) checked. docs/transformers.md's table is made
from these two (tools/transformers_table.py).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers.modeling_outputs import BaseModelOutputWithPast

from .layers import POST_NORM, PRE_NORM, SANDWICH, Shape


def embed_tokens(base, input_ids: Tensor) -> Tensor:
    """The token embeddings, by the inner model's `embed_tokens` (Gemma's scaled embedding
    is the embedding module's own)."""
    return base.embed_tokens(input_ids)


def no_change(base, inputs_embeds: Tensor, position_ids: Tensor) -> Tensor:
    """The stream's first p is the embeddings as they are."""
    return inputs_embeds


def positions(base, position_ids: Tensor | None, inputs_embeds: Tensor, past_key_values) -> tuple[Tensor, Tensor]:
    """(the rotary embedding's position ids, the masks' and layers'): both the given ones,
    or 0 .. T-1 after the cached tokens, (1, T)."""
    if position_ids is None:
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen).unsqueeze(0)
    return position_ids, position_ids


# A decoder layer's roles as Llama names its modules
LLAMA_PARTS = {"norm_1": "input_layernorm", "attn": "self_attn", "norm_2": "post_attention_layernorm", "mlp": "mlp"}
# The inner model's parts as Llama names them: the model forward reads each by its role
LLAMA_MODEL = {"embed": "embed_tokens", "layers": "layers", "norm": "norm", "rotary": "rotary_emb"}


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity (fuse keys its layer classes by family)
class Family:
    """One family as fuse fuses it.

    shape: the stream shape (layers.Shape) of its decoder layers.
    parts: role -> the name of the decoder layer's module playing it; the roles are the
        shape's, plus "attn_drop" / "mlp_drop" where the family drops its branches in
        modules of the layer (`dropout`). A layer holds these modules and no other.
    model_parts: role -> the inner model's module: "embed", "layers", "norm" (the final
        norm), "rotary" where it has one, and any other the model forward reads (its
        embedding hooks). The inner model holds these and no other.
    reads: the config's block scalars (check.py) the fused forward handles, beyond those
        every family leaves to modules fuse does not touch.
    alpha: the decoder layer's attribute holding its branch scale (Granite's
        residual_multiplier), or None.
    dropout: role ("attn", "mlp") -> the layer's dropout module of that branch (Phi3's
        resid_attn_dropout), or None.
    embed / prepare: the token embeddings from ids, then what the model does to them before
        the first layer (Granite's embedding_multiplier), each given the inner model.
    rotary: "shared" (one rotary embedding for all layers), "by_layer_type" (Gemma3's, one
        per config.layer_types entry) or None.
    positions: the rotary embedding's and the masks' / layers' position ids from the
        position_ids given (Qwen2-VL's M-RoPE takes 3-D ones), given the inner model.
    window_mask: for a model without config.layer_types, whether its one mask for all
        layers is sliding-window where config.sliding_window is set (Mistral); else it is
        causal whatever the config holds (Llama, Gemma, GLM4, OLMo2 ignore a stray window).
    output: the inner model's output class (MoE families return router logits in theirs).
    """
    shape: Shape
    parts: Mapping[str, str] = field(default_factory=lambda: LLAMA_PARTS)
    model_parts: Mapping[str, str] = field(default_factory=lambda: LLAMA_MODEL)
    reads: frozenset = frozenset()
    alpha: str | None = None
    dropout: Mapping[str, str] | None = None
    embed: Callable = embed_tokens
    prepare: Callable = no_change
    rotary: str | None = "shared"
    output: type = BaseModelOutputWithPast
    positions: Callable = positions
    window_mask: bool = False
    norms: tuple = field(init=False)

    def __deepcopy__(self, memo):  # a copied model shares its family, as its layers' classes do
        return self

    def __post_init__(self):
        missing = self.shape.roles - set(self.parts)
        if missing:
            raise ValueError(f"Family: parts lack the {self.shape.name} shape's roles {sorted(missing)}")
        if self.dropout is not None and not set(self.dropout.values()) <= set(self.parts.values()):
            raise ValueError("Family: dropout names modules that parts does not list")
        # the roles that are the stream's norms: each must convert to a fuseblock Norm
        object.__setattr__(self, "norms", tuple(r for r in self.parts if r.startswith(("norm_", "post_"))))


_GEMMA2_PARTS = {**LLAMA_PARTS, "post_attn": "post_attention_layernorm", "norm_2": "pre_feedforward_layernorm",
                 "post_mlp": "post_feedforward_layernorm"}

# GLM4's sandwich: its post_attention_layernorm is the MLP's pre-norm
_GLM4_PARTS = {**LLAMA_PARTS, "post_attn": "post_self_attn_layernorm", "norm_2": "post_attention_layernorm",
               "post_mlp": "post_mlp_layernorm"}
# OLMo2 normalizes each branch's output only (q_norm / k_norm sit inside its attention)
_OLMO2_PARTS = {"attn": "self_attn", "post_attn": "post_attention_layernorm", "mlp": "mlp",
                "post_mlp": "post_feedforward_layernorm"}

FAMILIES: Mapping[str, Family] = {
    "llama": Family(PRE_NORM),
    "mistral": Family(PRE_NORM, window_mask=True),
    "qwen2": Family(PRE_NORM),
    "qwen3": Family(PRE_NORM),
    "gemma": Family(PRE_NORM),
    "gemma2": Family(SANDWICH, _GEMMA2_PARTS),
    # gemma3_text, glm4, olmo2 (issue 25): Gemma3 is Gemma2's layer with one rotary
    # embedding per layer type; GLM4 the sandwich under other names; OLMo2 post-norm only
    "gemma3_text": Family(SANDWICH, _GEMMA2_PARTS, rotary="by_layer_type"),
    "glm4": Family(SANDWICH, _GLM4_PARTS),
    "olmo2": Family(POST_NORM, _OLMO2_PARTS),
}
SUPPORTED = tuple(FAMILIES)


def mrope_positions(base, position_ids: Tensor | None, inputs_embeds: Tensor, past_key_values):
    """Qwen2-VL's and Qwen2.5-VL's language model (Qwen2VLTextModel.forward): its rotary
    embedding (M-RoPE) takes (3, B, T) position ids, temporal, height and width, equal for
    text tokens (the wrapper computes them for images); 2-D ones are taken for all three.
    (4, B, T) ids carry the text positions first (packed sequences), which the masks and
    the layers take; otherwise they take none."""
    if position_ids is None:
        position_ids = positions(base, None, inputs_embeds, past_key_values)[0]
        position_ids = position_ids.view(1, 1, -1).expand(3, inputs_embeds.shape[0], -1)
    elif position_ids.ndim == 2:
        position_ids = position_ids[None, ...].expand(3, position_ids.shape[0], -1)
    if position_ids.ndim == 3 and position_ids.shape[0] == 4:
        return position_ids[1:], position_ids[0]
    return position_ids, None


# Language models transformers ships only inside a multimodal wrapper (no causal-LM class
# of their own, so no tiny config and none of FAMILIES' generic tests: the wrappers' tests
# cover them): model_type -> Family, as FAMILIES
WRAPPED: Mapping[str, Family] = {"qwen2_vl_text": Family(PRE_NORM, positions=mrope_positions),
                                  "qwen2_5_vl_text": Family(PRE_NORM, positions=mrope_positions)}

# Multimodal wrappers (issue 25): the wrapper's config.model_type -> the attribute of its
# base model holding the language model. fuse fuses that language model as its own family
# (one of FAMILIES or WRAPPED) and leaves the rest (vision tower, projector, their norms)
# as it is: the wrapper's forward merges the image features into inputs_embeds and calls
# the language model with them, its attention mask (Gemma3's: a dict per layer type, with
# the images' bidirectional blocks) and its position ids, all of which the fused model
# forward takes as the unfused one does.
WRAPPERS: Mapping[str, str] = {"llava": "language_model", "gemma3": "language_model", "mistral3": "language_model",
                               "qwen2_vl": "language_model", "qwen2_5_vl": "language_model"}

# Families fuse knows and refuses: model_type -> why. Every other causal LM is refused as
# not checked (fuse's error says so).
REFUSED: Mapping[str, str] = {}
