"""`tiny_config(model_type)`: a small config of a fused family, for trying and testing fuse.

Every family in FAMILIES has an entry (tests/integrations/test_transformers.py checks),
so `scripts/train_hf.py --family NAME` and the tests build any of them the same way, with
random weights and nothing downloaded. The sizes are transformers' names (configs map
them to their own, GPT-2's n_embd for hidden_size); each family's entry adds what makes
its model exercise its whole layout at this size: sliding windows shorter than a test
sequence, a head_dim the hidden size divides into, its block scalars away from neutral.
"""
from __future__ import annotations

import transformers

from .families import FAMILIES

# hidden 64 in 4 heads of 16, 2 of them key/value heads; ids 0, 1, 2 are pad, eos and bos
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, initializer_range=0.2,
             pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)

# model_type -> what its tiny config sets beyond SIZES
TINY: dict[str, dict] = {
    "llama": {},
    "mistral": dict(sliding_window=5, head_dim=16),
    "qwen2": dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen3": dict(head_dim=16),  # q_norm / k_norm
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=16),
    # phi3, gpt2 (issue 25): residual dropout on (the tests' models are in eval mode where
    # they compare bitwise; tests/integrations/test_hf_gpt2_phi3.py trains with it)
    "phi3": dict(resid_pdrop=0.1, sliding_window=5),
    "gpt2": dict(n_inner=128, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
    # ministral, mixtral, qwen2_moe, qwen3_moe, smollm3, helium, granite
    "ministral": dict(head_dim=16, sliding_window=5),  # every layer sliding (layer_types fix the depth)
    "mixtral": dict(head_dim=16, sliding_window=5, num_local_experts=4, num_experts_per_tok=2),
    # a sliding layer then a full one; layer 1 a dense MLP, layer 0 experts and the gated shared expert
    "qwen2_moe": dict(use_sliding_window=True, sliding_window=5, max_window_layers=1, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      mlp_only_layers=[1]),
    "qwen3_moe": dict(head_dim=16, use_sliding_window=True, sliding_window=5, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True),
    # layer 1 without rotary embedding (NoPE) and sliding
    "smollm3": dict(use_sliding_window=True, sliding_window=5, no_rope_layer_interval=2),
    "helium": dict(head_dim=16),
    "granite": dict(residual_multiplier=0.22, embedding_multiplier=12.0, attention_multiplier=0.25,
                    logits_scaling=4.0),
    # olmo, stablelm, starcoder2, gpt_neox, cohere, phi: every dropout the fused forward
    # reads at 0.1 (training tests; eval ignores it); the flag's other setting in tests
    "olmo": dict(clip_qkv=8.0),
    "stablelm": dict(hidden_dropout=0.1, qk_layernorm=True),  # per-head LayerNorms inside the attention
    "starcoder2": dict(residual_dropout=0.1, embedding_dropout=0.1, sliding_window=5),
    "gpt_neox": dict(hidden_dropout=0.1, rotary_pct=0.5),
    "cohere": dict(),
    "phi": dict(resid_pdrop=0.1, embd_pdrop=0.1),
    # gemma3_text, glm4, olmo2: Gemma3's layers alternate sliding and full attention, each
    # type with its own rope theta (10^4, 10^6); GLM4 rotates half of each head
    "gemma3_text": dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=16, sliding_window_pattern=2),
    "glm4": dict(head_dim=16),
    "olmo2": {},
    # deepseek_v4, hy_v4 (issue 31): 4 streams; the small MoE, MLA attention and indexer
    # sizes their configs need at hidden 64. DeepSeek-V4: a compressed-sparse then a heavily
    # compressed attention layer (compression rates a test sequence spans), a hash-routed
    # then a top-k MoE layer, 3 Sinkhorn passes; HY-V4: hc_magnitude away from 2, its second
    # layer reusing the first one's top-k indices (indexer_types "shared")
    "deepseek_v4": dict(num_key_value_heads=1, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, index_n_heads=2,
                        index_head_dim=16, index_topk=4, sliding_window=4, hc_sinkhorn_iters=3,
                        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                        mlp_layer_types=["hash_moe", "moe"]),
    "hy_v4": dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                  moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, index_topk=4,
                  index_head_dim=16, index_n_heads=2, hc_magnitude=1.5, indexer_types=["full", "shared"]),
    # inkling2_loop_text (issue 45, transformers 5.24): blocks of 2 layers, a sliding then a full
    # layer in each (the full ones mix with three queries); layers 2 and 3 looped twice, so the
    # second pass runs the message gates; a small MoE, sink attention and relative bias
    "inkling2_loop_text": dict(num_hidden_layers=4, n_layers_per_attn_res_block=2, loop_layer_index_start=2,
                               loop_layer_index_end=4, loop_num_passes=2, loop_gate_rank=8, head_dim=16,
                               swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                               sliding_window_size=5, d_rel=4, rel_extent=8, log_scaling_n_floor=8,
                               moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                               unpadded_vocab_size=128, eos_token_id=1,
                               layer_types=["hybrid_sliding", "hybrid"] * 2),
    # dory (issue 43, transformers 5.24): one input layer, two recurrent layers looped twice, one
    # output layer; sliding layers (window shorter than a test sequence) and a full one (layer 3)
    "dory": dict(num_hidden_layers=4, n_input_layers=1, n_output_layers=1, n_recurrent_loops=2, head_dim=16,
                 sliding_window=5),
}

# The Llama-shaped families (issue 43): what their MoE blocks (routers, shared experts, a dense
# first layer), MLA attention and sliding layers need at hidden 64. Each family takes the keys
# its config has (`_own`): the families name the same sizes differently. Their tests are one
# row each of tests/integrations/test_hf_llama_shaped_families.py's table, not every generic test
# of test_transformers.py (the suite's CPU time)
_MOE = dict(head_dim=16, moe_intermediate_size=32, num_experts=4, n_routed_experts=4, num_local_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, shared_expert_intermediate_size=64,
            sliding_window=5)
# MLA: as many key/value heads as query heads, its own head sizes (no head_dim)
_MLA = dict({k: v for k, v in _MOE.items() if k != "head_dim"}, num_key_value_heads=4, kv_lora_rank=16,
            q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1)
LLAMA_SHAPED = {
    **dict.fromkeys(("arcee", "bitnet", "cwm", "diffllama", "ernie4_5", "glm", "seed_oss", "hunyuan_v1_dense", "jais2",
                     "nemotron", "apertus", "vaultgemma", "olmo3", "exaone4", "cohere2"), dict(head_dim=16,
                                                                                               sliding_window=5)),
    **dict.fromkeys(("ernie4_5_moe", "exaone_moe", "glm4_moe", "minimax_m2", "olmoe", "hunyuan_v1_moe", "dots1",
                     "flint", "hy_v3", "solar_open", "aria_text", "phimoe", "laguna", "mimo_v2_flash", "gpt_oss",
                     "flex_olmo", "cohere2_moe"), _MOE),
    **dict.fromkeys(("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "axk1", "youtu"), _MLA),
    "ministral3": dict(head_dim=16, sliding_window=5),
}


TINY.update(LLAMA_SHAPED)


def _own(model_type: str, sizes: dict) -> dict:
    """The entries of `sizes` that model_type's config has (the Llama-shaped families take
    the shared sizes they name); the others' TINY entries are their own already."""
    if model_type not in LLAMA_SHAPED:
        return sizes
    defaults = transformers.AutoConfig.for_model(model_type, **SIZES).to_dict()
    return {k: v for k, v in sizes.items() if k in defaults}


def tiny_config(model_type: str, **overrides) -> transformers.PretrainedConfig:
    """A small config of a fused family: SIZES, the family's TINY entry, then overrides."""
    if model_type not in FAMILIES:
        raise ValueError(f"tiny_config: {model_type!r} is not a family fuse fuses ({', '.join(FAMILIES)})")
    return transformers.AutoConfig.for_model(model_type, **{**SIZES, **_own(model_type, TINY[model_type]), **overrides})
