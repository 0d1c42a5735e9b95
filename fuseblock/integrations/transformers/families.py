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
    "mistral": Family(PRE_NORM),
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

# Families fuse knows and refuses: model_type -> why. Every other causal LM is refused as
# not checked (fuse's error says so).
REFUSED: Mapping[str, str] = {}
