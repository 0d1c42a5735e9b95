"""What `fuse` knows of each transformers family, by `config.model_type`.

A `Family` says which stream shape its decoder layers take (layers.py), which module of a
layer plays each role of that shape, what its inner model holds, and which of the config's
block scalars (check.py) its fused forward reads. fuse fuses a model only where the
family is named here *and* the model's structure is what the entry says (check.py): a
name is never enough.

refused.py says why fuse refuses the others; docs/transformers.md's table is made from
both (tools/transformers_table.py).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    BaseModelOutputWithPastAndCrossAttentions,
    MoeModelOutputWithPast,
)
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .attn_res import ATTN_RES
from .gated import GATED
from .layers import HYPER, PARALLEL, PARALLEL_RESIDUAL_FIRST, POST_NORM, PRE_NORM, SANDWICH, Hyper, Shape
from .model import FUSED_MODEL_FORWARD, HYPER_MODEL_FORWARD, PREPARE, stream_forward
from .unit_sphere import UNIT_SPHERE, UNIT_SPHERE_MODEL_FORWARD
from .versions import CACHE, LINEAR_CACHE, one_cache


def embed_tokens(base, input_ids: Tensor) -> Tensor:
    """The token embeddings, by the inner model's `embed_tokens` (Gemma's scaled embedding
    is the embedding module's own)."""
    return base.embed_tokens(input_ids)


def no_change(base, inputs_embeds: Tensor, position_ids: Tensor) -> Tensor:
    """The stream's first p is the embeddings as they are."""
    return inputs_embeds


def positions(base, position_ids: Tensor | None, inputs_embeds: Tensor, cache) -> tuple[Tensor, Tensor]:
    """(the rotary embedding's position ids, the masks' and layers'): both the given ones,
    or 0 .. T-1 after the cached tokens, (1, T)."""
    if position_ids is None:
        past_seen = cache.get_seq_length() if cache is not None else 0
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
        the first layer (Granite's embedding_multiplier), each given the inner model; prepare
        also takes what its family's model forward hands it (GPT-2's token_type_ids).
    rotary: "shared" (one rotary embedding for all layers), "by_layer_type" (Gemma3's, one
        per config.layer_types entry) or None.
    positions: the rotary embedding's and the masks' / layers' position ids from the
        position_ids given (Qwen2-VL's M-RoPE takes 3-D ones), given the inner model.
    window_mask: for a model without config.layer_types, whether its one mask for all
        layers is sliding-window where config.sliding_window is set (Mistral); else it is
        causal whatever the config holds (Llama, Gemma, GLM4, OLMo2 ignore a stray window).
    output: the inner model's output class (MoE families return router logits in theirs), or a
        function of its fields making it (CWM's class, imported where a CWM model runs).
    model_forward: the inner model's fused forward, its class's by fuse: model.py's, or a
        family's own where its model's signature differs (GPT-2's), mapping onto model.py's;
        None where the inner model keeps its class and forward (the attention-residual shape).
    cache_keyword: the keyword under which the decoder layers (and their attention) take
        the KV cache: None for the installed transformers' own (versions.CACHE:
        past_key_values, 5.24's cache), GPT-NeoX's "layer_past".
    variant: config -> the entry a model of that config takes, where a config flag changes
        the layout (GPT-NeoX's and StableLM's use_parallel_residual pick their shape), or None.
    requires: config key -> the value this entry's forward computes with (each variant's
        use_parallel_residual): the check refuses any other value.
    mlp_output: the MLP module's output -> the branch output (GPT-OSS's MLP returns it with
        its router scores, which its layer drops); the pre-norm shape's.
    hyper: for the n-stream shape (layers.HYPER), what its forwards need beyond its
        modules (layers.Hyper); None for the others. fuse then converts the stream's norms
        only, leaving every module inside the layers as it is.
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
    output: Callable = BaseModelOutputWithPast
    model_forward: Callable | None = FUSED_MODEL_FORWARD
    cache_keyword: str | None = None
    variant: Callable | None = None
    requires: Mapping[str, object] = field(default_factory=dict)
    positions: Callable = positions
    window_mask: bool = False
    mlp_output: Callable = lambda out: out
    hyper: Hyper | None = None
    norms: tuple = field(init=False)

    def __deepcopy__(self, memo):  # a copied model shares its family, as its layers' classes do
        return self

    def __reduce__(self):
        """Pickled by its name in FAMILIES or WRAPPED (and its variant's key): a loaded model
        shares the registered entry, as a copied one does."""
        for name, entry in registered().items():
            if entry is self:
                return registered_family, name
        raise TypeError("a Family outside FAMILIES and WRAPPED cannot be pickled (it is pickled by its name); save "
                        "the model's state_dict or use save_pretrained")

    def __post_init__(self):
        missing = self.shape.roles - set(self.parts)
        if missing:
            raise ValueError(f"Family: parts lack the {self.shape.name} shape's roles {sorted(missing)}")
        if self.dropout is not None and not set(self.dropout.values()) <= set(self.parts.values()):
            raise ValueError("Family: dropout names modules that parts does not list")
        if (self.hyper is None) != (self.shape is not HYPER):
            raise ValueError("Family: hyper is given for the n-stream shape, and only for it")
        # the roles that are the stream's norms: each must convert to a fuseblock Norm
        object.__setattr__(self, "norms", tuple(r for r in self.parts if r.startswith(("norm_", "post_"))))


# ---------------------------------------------------------------- phi3, gpt2


def _gpt2_embed(base, input_ids: Tensor) -> Tensor:
    return base.wte(input_ids)


def _gpt2_prepare(base, inputs_embeds: Tensor, position_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
    """GPT-2's absolute position embeddings added to the token embeddings, then the token
    types' embeddings (rows of wte) where given, then its embedding dropout
    (config.embd_pdrop): GPT2Model.forward's adds in its order."""
    hidden = inputs_embeds + base.wpe(position_ids).to(inputs_embeds.device)
    if token_type_ids is not None:
        hidden = hidden + base.wte(token_type_ids)
    return base.drop(hidden)


def _gpt2_model_forward(self, input_ids=None, cache=None, attention_mask=None, token_type_ids=None,
                        position_ids=None, inputs_embeds=None, encoder_hidden_states=None,
                        encoder_attention_mask=None, use_cache=None, **kwargs):
    """GPT2Model.forward's signature (the cache second, positionally: cache in 5.24,
    past_key_values before, by keyword either) on model.py's forward. Token types go to
    the embedding step (`_gpt2_prepare`); cross-attention inputs
    are refused: they need the cross-attention blocks fuse refuses. Like GPT2Model, ids of
    more than two dims (GPT2DoubleHeadsModel's choices) run as one batch and come back in
    their shape, and so do token types."""
    for name, value in (("encoder_hidden_states", encoder_hidden_states),
                        ("encoder_attention_mask", encoder_attention_mask)):
        if value is not None:
            raise ValueError(f"{type(self).__name__} on the fused stream takes no {name} (fuse does not fuse GPT-2's "
                             f"cross-attention); call it without {name}, or unfused")
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if input_ids is not None:
        shape = input_ids.shape
        self.warn_if_padding_and_no_attention_mask(input_ids, attention_mask)
        input_ids = input_ids.view(-1, shape[-1])
    else:
        shape = inputs_embeds.shape[:-1]
    if token_type_ids is not None:
        kwargs[PREPARE] = {"token_type_ids": token_type_ids.view(-1, shape[-1])}
    if attention_mask is not None and attention_mask.ndim < 4:
        attention_mask = attention_mask.view((input_ids if inputs_embeds is None else inputs_embeds).shape[0], -1)
    out = stream_forward(self, input_ids, attention_mask, position_ids, one_cache(cache, kwargs), inputs_embeds,
                         use_cache, **kwargs)
    out.last_hidden_state = out.last_hidden_state.view(-1, *shape[1:], out.last_hidden_state.shape[-1])
    return out


# Phi3: Llama's layer with nn.Dropout on each branch before its add (config.resid_pdrop),
# which the fused add_norm applies (dropout_p) in training. Phi3Model never applies
# config.embd_pdrop (transformers' forward has no embedding dropout), so neither does the
# fused forward (check.py passes a key the unfused model does not read).
_PHI3_DROPOUT = {"attn": "resid_attn_dropout", "mlp": "resid_mlp_dropout"}
_PHI3 = Family(PRE_NORM, {**LLAMA_PARTS, "attn_drop": "resid_attn_dropout", "mlp_drop": "resid_mlp_dropout"},
               dropout=_PHI3_DROPOUT, reads=frozenset({"resid_pdrop"}), window_mask=True)
# GPT-2: pre-norm with LayerNorms (bias), Conv1D projections and the residual dropout
# (config.resid_pdrop) inside its attention and MLP modules, which fuse leaves untouched;
# learned absolute positions and the embedding dropout (config.embd_pdrop) before layer 0
# (prepare); no rotary embedding. add_cross_attention (a cross-attention block in each
# layer) is refused by the check: extra modules, and a block scalar away from neutral.
_GPT2 = Family(PRE_NORM, {"norm_1": "ln_1", "attn": "attn", "norm_2": "ln_2", "mlp": "mlp"},
               {"embed": "wte", "layers": "h", "norm": "ln_f", "position": "wpe", "dropout": "drop"},
               reads=frozenset({"resid_pdrop", "embd_pdrop"}), embed=_gpt2_embed, prepare=_gpt2_prepare,
               rotary=None, output=BaseModelOutputWithPastAndCrossAttentions,
               model_forward=merge_with_config_defaults(capture_outputs(_gpt2_model_forward)))


_GEMMA2_PARTS = {**LLAMA_PARTS, "post_attn": "post_attention_layernorm", "norm_2": "pre_feedforward_layernorm",
                 "post_mlp": "post_feedforward_layernorm"}


def granite_embeddings(base, inputs_embeds: Tensor, position_ids: Tensor) -> Tensor:
    """GraniteModel.forward's first p: inputs_embeds * the model's embedding_multiplier (given
    embeddings too), the product in its order."""
    return inputs_embeds * base.embedding_multiplier

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
    # phi3, gpt2 (issue 25)
    "phi3": _PHI3,
    "gpt2": _GPT2,
    # ministral, mixtral, qwen2_moe, qwen3_moe, smollm3, helium, granite: pre-norm under Llama's
    # names. A MoE block (router, experts, Qwen2-MoE's gated shared expert) is its layer's mlp,
    # untouched: transformers' hooks on its router record the router logits (output_router_logits).
    # SmolLM3's NoPE layers and the sliding windows are the attention's and the masks' (model.py).
    "ministral": Family(PRE_NORM),
    "mixtral": Family(PRE_NORM, output=MoeModelOutputWithPast, window_mask=True),
    "qwen2_moe": Family(PRE_NORM, output=MoeModelOutputWithPast),
    "qwen3_moe": Family(PRE_NORM, output=MoeModelOutputWithPast, window_mask=True),
    "smollm3": Family(PRE_NORM),
    "helium": Family(PRE_NORM),
    "granite": Family(PRE_NORM, reads=frozenset({"residual_multiplier", "embedding_multiplier"}),
                      alpha="residual_multiplier", prepare=granite_embeddings),
    # gemma3_text, glm4, olmo2 (issue 25): Gemma3 is Gemma2's layer with one rotary
    # embedding per layer type; GLM4 the sandwich under other names; OLMo2 post-norm only
    "gemma3_text": Family(SANDWICH, _GEMMA2_PARTS, rotary="by_layer_type"),
    "glm4": Family(SANDWICH, _GLM4_PARTS),
    "olmo2": Family(POST_NORM, _OLMO2_PARTS),
}

def first(out: tuple) -> Tensor:
    """The MLP's output of a (output, router scores) pair (GPT-OSS's MLP)."""
    return out[0]


# The Llama-shaped families (issue 43): Llama's decoder layer, each with its own attention, MLP or
# MoE (routers, shared experts, MLA attention, sinks, q/k norms: modules fuse leaves as they are),
# or OLMo2's post-norm layer, or Cohere's parallel one. Their MoE models return router logits in
# MoeModelOutputWithPast; by_layer_type: one rotary embedding per config.layer_types entry.
_MOE = dict(output=MoeModelOutputWithPast)


def _cwm_output(**fields):
    """CwmModel's output class (BaseModelOutputWithPast's subclass), imported where a CWM model runs."""
    from transformers.models.cwm.modeling_cwm import CwmModelOutputWithPast

    return CwmModelOutputWithPast(**fields)


_COHERE_PARTS = {"norm_1": "input_layernorm", "attn": "self_attn", "mlp": "mlp"}
FAMILIES.update({
    "cwm": Family(PRE_NORM, output=_cwm_output),
    **dict.fromkeys(("arcee", "bitnet", "diffllama", "ernie4_5", "glm", "seed_oss", "hunyuan_v1_dense",
                     "jais2", "nemotron"), Family(PRE_NORM)),
    **dict.fromkeys(("ernie4_5_moe", "exaone_moe", "glm4_moe", "minimax_m2", "olmoe", "hunyuan_v1_moe", "dots1",
                     "flint", "hy_v3", "solar_open", "aria_text", "deepseek_v3", "deepseek_v2", "glm4_moe_lite",
                     "axk1"), Family(PRE_NORM, **_MOE)),
    "youtu": Family(PRE_NORM),
    # Ministral3's one mask for all layers is sliding where config.sliding_window is set
    "ministral3": Family(PRE_NORM, window_mask=True),
    "phimoe": Family(PRE_NORM, **_MOE, window_mask=True),
    "laguna": Family(PRE_NORM, **_MOE, rotary="by_layer_type"),
    "mimo_v2_flash": Family(PRE_NORM, **_MOE, rotary="by_layer_type"),
    "gpt_oss": Family(PRE_NORM, **_MOE, mlp_output=first),
    # Apertus and VaultGemma name their two pre-norms otherwise
    "apertus": Family(PRE_NORM, {**LLAMA_PARTS, "norm_1": "attention_layernorm", "norm_2": "feedforward_layernorm"}),
    "vaultgemma": Family(PRE_NORM, {**LLAMA_PARTS, "norm_2": "pre_feedforward_layernorm"}),
    # OLMo3, EXAONE-4, FlexOlmo: OLMo2's post-norm layer
    "olmo3": Family(POST_NORM, _OLMO2_PARTS, rotary="by_layer_type"),
    "exaone4": Family(POST_NORM, _OLMO2_PARTS),
    "flex_olmo": Family(POST_NORM, _OLMO2_PARTS, **_MOE),
})

# olmo, stablelm, starcoder2, gpt_neox, cohere, phi: LayerNorms (with bias, weight only,
# none), parallel branches, dropout modules and model-level embedding dropout


def _embed_in(base, input_ids: Tensor) -> Tensor:
    """GPT-NeoX's token embeddings (its `embed_in`)."""
    return base.embed_in(input_ids)


def _emb_dropout(base, inputs_embeds: Tensor, position_ids: Tensor) -> Tensor:
    """GPT-NeoX's embedding dropout module (its own training flag)."""
    return base.emb_dropout(inputs_embeds)


def _embed_dropout(base, inputs_embeds: Tensor, position_ids: Tensor) -> Tensor:
    """Phi's embedding dropout module."""
    return base.embed_dropout(inputs_embeds)


def _embedding_dropout(base, inputs_embeds: Tensor, position_ids: Tensor) -> Tensor:
    """Starcoder2's embedding dropout: a probability the model holds, applied with its training flag."""
    return F.dropout(inputs_embeds, p=base.embedding_dropout, training=base.training)


class _ByParallelResidual:
    """A family's `variant`: config.use_parallel_residual -> the entry of that layout
    (`variants`, which docs/transformers.md's table lists)."""

    def __init__(self, variants: Mapping[bool, Family]):
        self.variants = variants

    def __call__(self, config) -> Family:
        return self.variants[bool(config.use_parallel_residual)]


_NEOX_DROPOUT = {"attn": "post_attention_dropout", "mlp": "post_mlp_dropout"}
_NEOX = dict(parts={"norm_1": "input_layernorm", "attn": "attention", "norm_2": "post_attention_layernorm",
                    "mlp": "mlp", "attn_drop": "post_attention_dropout", "mlp_drop": "post_mlp_dropout"},
             model_parts={"embed": "embed_in", "layers": "layers", "norm": "final_layer_norm",
                          "rotary": "rotary_emb", "embed_dropout": "emb_dropout"},
             reads=frozenset({"hidden_dropout"}), dropout=_NEOX_DROPOUT, embed=_embed_in,
             prepare=_emb_dropout, cache_keyword="layer_past")
_GPT_NEOX: dict[bool, Family] = {}
_GPT_NEOX.update({flag: Family(PARALLEL if flag else PRE_NORM, **_NEOX, variant=_ByParallelResidual(_GPT_NEOX),
                               requires={"use_parallel_residual": flag}) for flag in (True, False)})
# StableLM drops its MLP's output alone (hidden_dropout); its parallel layers have one norm
_STABLELM_LAYERS: dict[bool, Family] = {}
_STABLELM_LAYERS.update({
    flag: Family(PARALLEL_RESIDUAL_FIRST if flag else PRE_NORM,
                 {"norm_1": "input_layernorm", "attn": "self_attn", "mlp": "mlp", "mlp_drop": "dropout"} if flag
                 else {**LLAMA_PARTS, "mlp_drop": "dropout"},
                 reads=frozenset({"hidden_dropout"}), dropout={"mlp": "dropout"},
                 variant=_ByParallelResidual(_STABLELM_LAYERS), requires={"use_parallel_residual": flag})
    for flag in (True, False)})
FAMILIES.update({
    "olmo": Family(PRE_NORM),
    "stablelm": _STABLELM_LAYERS[False],
    # residual_dropout acts inside its attention and MLP, which fuse leaves as they are
    "starcoder2": Family(PRE_NORM, reads=frozenset({"residual_dropout", "embedding_dropout"}),
                         prepare=_embedding_dropout, window_mask=True),
    "gpt_neox": _GPT_NEOX[True],
    "cohere": Family(PARALLEL_RESIDUAL_FIRST, _COHERE_PARTS),
    # Cohere2's parallel layer is Cohere's (r + attn) + mlp, with sliding layers (config.layer_types)
    "cohere2": Family(PARALLEL_RESIDUAL_FIRST, _COHERE_PARTS),
    "cohere2_moe": Family(PARALLEL_RESIDUAL_FIRST, _COHERE_PARTS, **_MOE),
    "phi": Family(PARALLEL, {"norm_1": "input_layernorm", "attn": "self_attn", "mlp": "mlp", "drop": "resid_dropout"},
                  {**LLAMA_MODEL, "norm": "final_layernorm", "embed_dropout": "embed_dropout"},
                  reads=frozenset({"resid_pdrop", "embd_pdrop"}),
                  dropout={"attn": "resid_dropout", "mlp": "resid_dropout"}, prepare=_embed_dropout),
})


# deepseek_v4, hy_v4, glm5_next_text (issue 31): n residual streams (hyper-connections, mHC).
# Each layer's attn_hc / ffn_hc and input_layernorm / post_attention_layernorm meet in one hc
# op per boundary (layers.HYPER), the model's hc_head and norm in one more. Attention (its
# compressors, indexers, linear attention), the MoE and its routers (hash routing included)
# and their norms are modules fuse leaves as they are; so are the caches they keep.


def _deepseek_v4_options(hc) -> dict:
    """DeepseekV4HyperConnection's constants: Sinkhorn passes, hc_eps, post = 2 sigmoid(...)."""
    return dict(iters=hc.hc_sinkhorn_iters, hc_eps=hc.hc_eps, post_mult=2.0, post_eps=0.0)


def _hy_v4_options(hc) -> dict:
    """HYV4HyperConnection's: no comb (no Sinkhorn), post = hc_magnitude sigmoid(...) + hc_eps."""
    return dict(iters=1, hc_eps=hc.hc_eps, post_mult=hc.hc_post_magnitude, post_eps=hc.hc_eps)


def _deepseek_v4_attend(layer, normed: Tensor, input_ids: Tensor | None = None, **kwargs):
    """DeepseekV4DecoderLayer's attention call: every keyword but input_ids (its MLP's)."""
    return layer.self_attn(normed, **kwargs)[0], None


def _deepseek_v4_feed(layer, normed: Tensor, kwargs: dict) -> Tensor:
    """DeepSeek-V4's MoE routes its hash layers by token id."""
    return layer.mlp(normed, input_ids=kwargs.get("input_ids"))


def _indexed_attend(layer, normed: Tensor, attention_mask=None, position_ids=None, use_cache=False,
                    position_embeddings=None, prev_topk_indices=None, **kwargs):
    """HYV4DecoderLayer's and Glm5NextTextDecoderLayer's attention call (the latter's linear
    attention layers take the cache as cache_params, 5.24's cache, and return no top-k)."""
    cache = kwargs.pop(CACHE, None)
    if getattr(layer, "block_type", None) == "linear_attention":
        return layer.self_attn(hidden_states=normed, attention_mask=attention_mask, **{LINEAR_CACHE: cache},
                               **kwargs), None
    out, _, topk = layer.self_attn(hidden_states=normed, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=use_cache, position_embeddings=position_embeddings,
                                   prev_topk_indices=prev_topk_indices, **{CACHE: cache}, **kwargs)
    return out, topk


def _plain_feed(layer, normed: Tensor, kwargs: dict) -> Tensor:
    return layer.mlp(normed)


def _deepseek_v4_inputs(base, input_ids, inputs_embeds, attention_mask, position_ids, cache, use_cache):
    """DeepseekV4Model.forward's layer keywords: one sliding-window mask (generate's dict holds
    it under each layer type), the main and the compressors' rotary embeddings."""
    if isinstance(attention_mask, dict):
        mask = next(iter(attention_mask.values()))
    else:
        mask = create_sliding_window_causal_mask(config=base.config, inputs_embeds=inputs_embeds,
                                                 attention_mask=attention_mask, position_ids=position_ids,
                                                 **{CACHE: cache})
    rotary = {k: base.rotary_emb(inputs_embeds, position_ids=position_ids, layer_type=k) for k in ("main", "compress")}
    return [{"position_embeddings": rotary, "position_ids": position_ids, "attention_mask": mask,
             "input_ids": input_ids, CACHE: cache}] * base.config.num_hidden_layers


def _hy_v4_inputs(base, input_ids, inputs_embeds, attention_mask, position_ids, cache, use_cache):
    """HYV4Model.forward's: one causal mask, always built (its indexer reads it), one rotary embedding."""
    return _indexed_layer_inputs(base, inputs_embeds, attention_mask, position_ids, position_ids, cache, use_cache)


def _indexed_layer_inputs(base, inputs_embeds, attention_mask, mask_ids, rotary_ids, cache, use_cache):
    """HY-V4's layer keywords: the causal mask of mask_ids, always built; the rotary embedding of
    rotary_ids, which the layers take as their position ids too."""
    masks = attention_mask
    if not isinstance(masks, dict):
        masks = {"indexed_attention": create_causal_mask(
            config=base.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=mask_ids,
            allow_is_causal_skip=False, **{CACHE: cache})}
    rotary = base.rotary_emb(inputs_embeds, position_ids=rotary_ids)
    return [{"attention_mask": masks["indexed_attention"], "position_embeddings": rotary,
             "position_ids": rotary_ids, CACHE: cache, "use_cache": use_cache}] * base.config.num_hidden_layers


def _glm5_next_inputs(base, input_ids, inputs_embeds, attention_mask, position_ids, cache, use_cache):
    """Glm5NextTextModel.forward's: the 2-d padding mask (boolean, all ones where none is
    given) for both layer types, no rotary embedding (NoPE)."""
    from transformers.masking_utils import create_recurrent_attention_mask

    kinds = base.config.layer_types[:base.config.num_hidden_layers]
    masks = attention_mask
    if not isinstance(masks, dict):
        mask = create_recurrent_attention_mask(config=base.config, inputs_embeds=inputs_embeds,
                                               attention_mask=attention_mask, **{CACHE: cache})
        if mask is None:
            mask = torch.ones(inputs_embeds.shape[:2], dtype=torch.bool, device=inputs_embeds.device)
        # keyed by the config's names: 5.17 calls the sparse layers deepseek_sparse_attention, 5.23 indexed_attention
        masks = dict.fromkeys(kinds, mask.bool())
    return [{"attention_mask": masks[k], "position_ids": position_ids, "position_embeddings": None,
             "input_ids": input_ids, CACHE: cache} for k in kinds]


_HYPER_PARTS = {"hc_1": "attn_hc", "norm_1": "input_layernorm", "attn": "self_attn", "hc_2": "ffn_hc",
                "norm_2": "post_attention_layernorm", "mlp": "mlp"}
_HYPER_MODEL = {**LLAMA_MODEL, "head": "hc_head"}
_HYPER_FAMILY = dict(parts=_HYPER_PARTS, model_parts=_HYPER_MODEL, output=MoeModelOutputWithPast,
                     model_forward=HYPER_MODEL_FORWARD)
FAMILIES.update({
    "deepseek_v4": Family(HYPER, **_HYPER_FAMILY, hyper=Hyper(
        "deepseek_v4", _deepseek_v4_options, _deepseek_v4_attend, _deepseek_v4_feed, _deepseek_v4_inputs,
        topk=False, weighted_head=True)),
    "hy_v4": Family(HYPER, **_HYPER_FAMILY, hyper=Hyper(
        "hy_v4", _hy_v4_options, _indexed_attend, _plain_feed, _hy_v4_inputs, topk=True, weighted_head=True)),
})


# inkling2_loop_text (issue 45, transformers 5.24): block attention residuals (attn_res.py). Its
# layers are of four classes (sliding and full attention, plain and looped), fused by one forward;
# its model forward (the loop passes, the messages, the final mix and norm) and its norms stay
# the modeling code's (model_forward None: the inner model keeps its class)
FAMILIES.update({
    "inkling2_loop_text": Family(
        ATTN_RES, {"attn_input": "attention_input", "norm_1": "input_layernorm", "attn": "self_attn",
                   "mlp_input": "mlp_input", "norm_2": "post_attention_layernorm", "mlp": "mlp"},
        {"embed": "embed_tokens", "layers": "layers", "norm": "norm", "final": "final_input",
         "messages": "message_input"}, rotary=None, output=MoeModelOutputWithPast, model_forward=None),
})

# dory (issue 43, transformers 5.24): nGPT's layers on the unit sphere (unit_sphere.py), each
# update and the norm after it one interpolating norm_add_norm; its norms stay the modeling
# code's DoryL2Norm modules, its model forward (the recurrent loops) is unit_sphere's
FAMILIES["dory"] = Family(
    UNIT_SPHERE, {"norm_1": "input_layernorm", "attn": "self_attn", "post_attn": "post_attention_layernorm",
                  "norm_2": "pre_feedforward_layernorm", "mlp": "mlp", "post_mlp": "post_feedforward_layernorm"},
    rotary="by_layer_type", model_forward=UNIT_SPHERE_MODEL_FORWARD)

SUPPORTED = tuple(FAMILIES)

def mrope_positions(base, position_ids: Tensor | None, inputs_embeds: Tensor, cache):
    """Qwen2-VL's and Qwen2.5-VL's language model (Qwen2VLTextModel.forward): its rotary
    embedding (M-RoPE) takes (3, B, T) position ids, temporal, height and width, equal for
    text tokens (the wrapper computes them for images); 2-D ones are taken for all three.
    (4, B, T) ids carry the text positions first (packed sequences), which the masks and
    the layers take; otherwise they take none."""
    if position_ids is None:
        position_ids = positions(base, None, inputs_embeds, cache)[0]
        position_ids = position_ids.view(1, 1, -1).expand(3, inputs_embeds.shape[0], -1)
    elif position_ids.ndim == 2:
        position_ids = position_ids[None, ...].expand(3, position_ids.shape[0], -1)
    if position_ids.ndim == 3 and position_ids.shape[0] == 4:
        return position_ids[1:], position_ids[0]
    return position_ids, None


def given_positions(base, position_ids: Tensor | None, inputs_embeds: Tensor, cache):
    """The position ids as given (None included), for a family whose inputs step makes its own
    (HY-V4-VL's, `_hy_v4_vl_inputs`)."""
    return position_ids, position_ids


def _hy_v4_vl_inputs(base, input_ids, inputs_embeds, attention_mask, position_ids, cache, use_cache):
    """HYV4VLTextModel.forward's: HY-V4's (`_hy_v4_inputs`) with Qwen2-VL's M-RoPE positions
    (`mrope_positions`): the rotary embedding and the layers take the (3, B, T) ids, the mask
    the text positions of (4, B, T) ones, else none."""
    rotary_ids, text_ids = mrope_positions(base, position_ids, inputs_embeds, cache)
    return _indexed_layer_inputs(base, inputs_embeds, attention_mask, text_ids, rotary_ids, cache, use_cache)


# Language models transformers ships only inside a multimodal wrapper (no causal-LM class
# of their own, so no tiny config and none of FAMILIES' generic tests: the wrappers' tests
# cover them): model_type -> Family, as FAMILIES
WRAPPED: Mapping[str, Family] = {
    "qwen2_vl_text": Family(PRE_NORM, positions=mrope_positions),
    "qwen2_5_vl_text": Family(PRE_NORM, positions=mrope_positions),
    # GLM-5-next's text model: DeepSeek-V4's boundary, linear-attention layers beside indexed ones, no rotary
    # embedding, and a head that is the streams' mean
    "glm5_next_text": Family(HYPER, parts=_HYPER_PARTS, model_parts={k: v for k, v in _HYPER_MODEL.items()
                                                                      if k != "rotary"},
                             output=MoeModelOutputWithPast, model_forward=HYPER_MODEL_FORWARD, rotary=None,
                             hyper=Hyper("glm5_next", _deepseek_v4_options, _indexed_attend, _plain_feed,
                                         _glm5_next_inputs, topk=True, weighted_head=False)),
    # HY-V4-VL's text model (transformers 5.24): HY-V4's layers and head, M-RoPE positions
    "hy_v4_vl_text": Family(HYPER, **_HYPER_FAMILY, positions=given_positions, hyper=Hyper(
        "hy_v4", _hy_v4_options, _indexed_attend, _plain_feed, _hy_v4_vl_inputs, topk=True, weighted_head=True)),
    # Muse Spark's text model (transformers 5.23 and 5.24): per-channel gates and sandwich norms (gated.py),
    # each layer's adds in its own ops; its model forward (NoPE layers, the final MuseSparkRMSNorm)
    # and its norms' modules stay the modeling code's (model_forward None: the inner model keeps its class);
    # config.post_norm_eps is its post-norms' eps, which the fused layer reads off them
    "muse_spark_text": Family(
        GATED, {"norm_1": "input_layernorm", "attn": "self_attn", "attn_norm": "post_attention_layernorm",
                "attn_gate": "post_attention_residual_gate", "norm_2": "pre_feedforward_layernorm", "mlp": "mlp",
                "mlp_norm": "post_feedforward_layernorm", "mlp_gate": "post_feedforward_residual_gate"},
        reads=frozenset({"post_norm_eps"}), output=MoeModelOutputWithPast, model_forward=None),
}

# Multimodal wrappers (issue 25): the wrapper's config.model_type -> the attribute of its
# base model holding the language model. fuse fuses that language model as its own family
# (one of FAMILIES or WRAPPED) and leaves the rest (vision tower, projector, their norms)
# as it is: the wrapper's forward merges the image features into inputs_embeds and calls
# the language model with them, its attention mask (Gemma3's: a dict per layer type, with
# the images' bidirectional blocks) and its position ids, all of which the fused model
# forward takes as the unfused one does.
WRAPPERS: Mapping[str, str] = {"llava": "language_model", "gemma3": "language_model", "mistral3": "language_model",
                               "qwen2_vl": "language_model", "qwen2_5_vl": "language_model",
                               "glm5_next": "language_model", "inkling2_loop": "language_model",
                               "hy_v4_vl": "language_model", "muse_spark": "language_model"}


def family_of_class(name: str) -> str | None:
    """The fused family (a FAMILIES key) whose inner model is transformers' class `name`
    (LlamaModel -> "llama"), or None: how fuse finds the entry of a config-only family (one
    with a config of its own and another family's modeling classes: internlm3 and
    iquestcoder build a LlamaModel, 5.24's exaone too, sarvam_moe a Glm4MoeModel,
    sarvam_mla a DeepseekV3Model) and of a model_type it does not know on such a class. The
    structural check (check.py) then holds the model to that entry, as for the family's own
    models."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    if name is None:  # (a family the installed transformers lacks, 5.23's inkling2_loop_text, maps to None too)
        return None
    return next((m for m in FAMILIES if MODEL_MAPPING_NAMES.get(m) == name), None)


def registered() -> dict[tuple, Family]:
    """Every entry fuse fuses with, by (model_type, variant key or None): FAMILIES, WRAPPED
    and their variants' entries (GPT-NeoX's and StableLM's by use_parallel_residual)."""
    found = {}
    for model_type, family in (*FAMILIES.items(), *WRAPPED.items()):
        found[model_type, None] = family
        for key, entry in getattr(family.variant, "variants", {}).items():
            found[model_type, key] = entry
    return found


def registered_family(model_type: str, key) -> Family:
    """The entry `registered()` names (model_type, key): what a pickled Family loads as."""
    return registered()[model_type, key]
