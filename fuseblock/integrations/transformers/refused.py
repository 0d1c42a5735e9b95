"""Why `fuse` refuses the causal-LM families it does not fuse, by `config.model_type`.

Read off each family's model and decoder-layer structure in transformers 5.23, or 5.24
for the families only it has: its modules and config (docs/transformers.md's
table lists every family). A family not named here nor in FAMILIES is refused as not yet
compared. Reasons are grouped by what keeps the family out; "Llama-shaped" families have
Llama's module layout but have not been put through the tests that every fused family
passes, so fuse refuses them rather than trusting the names.
"""
from __future__ import annotations

_LLAMA_SHAPED = ("Llama-shaped layers (input_layernorm, self_attn, post_attention_layernorm, mlp), not yet put "
                 "through fuse's per-family tests")
_MULTI_ROTARY = ("one rotary embedding module per attention type (rotary_embs) where fuse's forward takes one, or one "
                 "per config.layer_types entry: not yet compared")
_INDEXED = ("indexed (sparse) attention layers (config.layer_types 'indexed_attention'), whose masks the fused "
            "model forward does not build yet")
_BLOCK_SPARSE = ("Granite's scaled branches (residual_multiplier) with the MoE block as block_sparse_moe: not yet put "
                 "through fuse's per-family tests")
_OTHER_SANDWICH = ("sandwich layers (a post-norm on each branch) under other names (pre_mlp_layernorm, "
                   "post_mlp_layernorm, post_norm1, post_norm2): not yet put through fuse's per-family tests")
_ENCODER = ("BERT-style layers add the residual inside their output submodules (LayerNorm(dense(h) + x)): "
            "no decoder-layer stream to fuse")
_SEQ2SEQ = "the decoder of an encoder-decoder family: cross-attention between its adds, not a fused shape yet"
_RECURRENT = "a recurrent or state-space block (one norm and one mixer per block): not a fused shape yet"
_HYBRID = "hybrid layers (linear-attention, convolution or state-space mixers beside attention): not a fused shape yet"
_WRAPPER = "a multimodal wrapper or container fuse has not checked: its language model is not one fuse takes yet"
_GROUPS = {
    _LLAMA_SHAPED: ("emu3", "moshi", "minimax_m3_vl_text", "phi4_multimodal", "mellum"),
    _INDEXED: ("deepseek_v32", "glm_moe_dsa"),
    _MULTI_ROTARY: ("granite_swa", "granitemoe_swa", "beam"),
    _BLOCK_SPARSE: ("granitemoe", "granitemoeshared"),
    _OTHER_SANDWICH: ("afmoe", "kolibri1", "hyperclovax"),
    _ENCODER: ("bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
               "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta",
               "xlm-roberta-xl", "xmod", "xlm", "xlnet", "reformer", "cpmant"),
    _SEQ2SEQ: ("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
               "plbart", "prophetnet", "trocr", "whisper", "musicgen", "musicgen_melody"),
    _RECURRENT: ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma", "nemotron_h"),
    _HYBRID: ("bailing_hybrid", "minimax", "jamba", "zamba", "zamba2", "bamba", "falcon_h1", "granitemoehybrid", "lfm2",
              "lfm2_moe", "lfm3",
              "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "kimi_linear",
              "olmo_hybrid", "inkling_text", "inkling2_text", "blt", "hrm_text"),
    _WRAPPER: ("fuyu", "gemma3n", "gemma4", "gemma4_unified", "git", "got_ocr2", "llama4", "mllama",
               "moss_transcribe_diarize", "qwen4_exp", "dots3_note"),
}

REFUSED: dict[str, str] = {model_type: why for why, names in _GROUPS.items() for model_type in names}
REFUSED.update({
    # Per-channel residual updates (zaya, qwen4_exp_text): what each layer computes in place of r + f, by
    # its modeling source (tests/integrations/test_hf_hyper_families.py checks each reason against it). Muse
    # Spark's gates are fused (gated.py), dory's interpolation on the unit sphere too (unit_sphere.py)
    "zaya": "ZAYA's residual update (ZayaResidualScaling): (f + b_f) * s_f + (r + b_r) * s_r, a per-channel bias and "
            "scale on each side of the add, the biases added before the scales, which per-channel scales alone "
            "(a * r + b * f) do not compute; and each layer hands the next its router's hidden states "
            "(prev_router_hidden_states), a second stream beside the residual",
    "qwen4_exp_text": "Qwen4-Exp's gated residual (Qwen4ExpTextGatedResidual): config.hc_count streams whose sublayer "
                      "input is their mean under input-dependent per-channel gates (the sigmoid of a low-rank MLP of "
                      "the normed streams, input_mix_weight_down / up) with no norm after it, and whose update adds "
                      "the branch to each stream at an input-dependent weight (2 sigmoid(block_inject_weight)): "
                      "neither the mHC boundary the hc ops fuse (a weighted norm after the collapse) nor fixed "
                      "per-channel scales; beside linear-attention layers and per-layer embeddings (ple)",
    "doge": "learned residual scales in the decoder layer (input_residual, post_attention_residual Parameters): a "
            "per-channel residual update, not a fused shape yet",
    "jetmoe": "a mixture of attention heads as self_attention and a MoE as mlp, with router losses of both: not yet "
              "compared",
    "minicpm3": "branches scaled by scale_depth / sqrt(num_hidden_layers) and embeddings by scale_emb: not yet put "
                "through fuse's per-family tests",
    "nanochat": "RMSNorms with no weight and no normalized_shape (NanoChatRMSNorm(eps)): not a norm fuseblock "
                "converts yet",
    "persimmon": "a final norm named final_layernorm and LayerNorms on q and k: not yet compared",
    "gpt_neox_japanese": "GPT-NeoX-Japanese's layers (attention with its dense_bias added after the residual) and "
                         "final_layer_norm: not a fused shape yet",
    "axk2": "gated RMSNorms (AXK2GatedRMSNorm) in the stream: not a norm fuseblock computes",
    "cohere_compass_text": "Cohere's parallel layer (one input_layernorm for both branches) in a model whose forward "
                           "fuse's does not run yet (a KeyError on its layer types): not yet compared",
    "bloom": "ALiBi attention, a LayerNorm on the embeddings and apply_residual_connection_post_layernorm: "
             "its block differs from every fused shape",
    "falcon": "parallel attention with one or two input norms by config (new_decoder_architecture, "
              "num_ln_in_parallel_attn): not yet compared",
    "opt": "OPTDecoder's do_layer_norm_before flag switches pre- and post-norm, and its layers sit in a decoder "
           "submodule: not yet compared",
    "gpt_neo": "GPT-2-shaped blocks with local and global attention layers: not yet compared",
    "gptj": "one ln_1 feeding attention and MLP in parallel with GPT-2 names (ln_f, wte): not yet compared",
    "codegen": "GPT-J-shaped parallel blocks: not yet compared",
    "gpt_bigcode": "GPT-2-shaped blocks with multi-query attention: not yet compared",
    "openai-gpt": "post-norm blocks (ln_1 after the attention's add) and no final norm",
    "ctrl": "pre-norm blocks with their own names and dropouts (layernorm1, dropout1, ...): not yet compared",
    "mpt": "pre-norm blocks with ALiBi and a residual dropout on the attention branch only: not yet compared",
    "biogpt": "fairseq-style layers (self_attn_layer_norm, fc1, fc2, final_layer_norm): not yet compared",
    "xglm": "fairseq-style layers (self_attn_layer_norm, fc1, fc2, final_layer_norm): not yet compared",
    "modernbert-decoder": "an Identity first norm and a LayerNorm on the embeddings: not yet compared",
    "longcat_flash": "two attention and two MLP sublayers per layer (ModuleLists of norms): not a fused shape",
    "gemma3n_text": "AltUp and per-layer embeddings around the residual: not a fused shape",
    "gemma4_text": "per-layer embeddings and projections added to the stream: not a fused shape",
    "gemma4_unified_text": "per-layer inputs beside the residual stream: not yet compared",
    "gemma4_assistant": "an assistant head over a Gemma4 model: not a fused shape",
    "gemma4_unified_assistant": "an assistant head over a Gemma4 model: not a fused shape",
    "dots3_note_text": "not yet compared",
    "dbrx": "norms nested with the attention in one submodule (norm_attn_norm): not a fused shape",
    "llama4_text": "interleaved dense and MoE layers with chunked attention: not yet compared",
})
