"""The Llama-shaped families (issue 43), one table row each: Llama's pre-norm layer under its
names or others (Apertus, VaultGemma), OLMo2's post-norm layer (OLMo3, EXAONE-4, FlexOlmo),
Cohere's parallel one (Cohere2), each with its own attention and MoE left as it is. Each row
is held to what the families of test_transformers.py are, in one test to keep the suite's
CPU time: fp32 logits, loss, every gradient and every hidden state bitwise the unfused
model's (the torch path), no residual add outside the fused ops, the output class, greedy
generation with the cache and padding, save_pretrained's keys and tensors, gradient
checkpointing; the kernel path within test_transformers.py's bounds on a few.
"""
import copy
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import KERNEL_PATH  # noqa: E402
from hf_models import batch, max_diff, pair, run, stream_ops  # noqa: E402

from fuseblock import Norm  # noqa: E402
from fuseblock.integrations.transformers import FAMILIES, fuse, refused  # noqa: E402
from fuseblock.integrations.transformers.tiny import LLAMA_SHAPED, SIZES  # noqa: E402

ROWS = sorted(LLAMA_SHAPED)
# CohereLayerNorm's fp32 ops against torch.layer_norm: ulps apart (test_transformers.py's NOT_BITWISE)
NOT_BITWISE = {"cohere2": dict(rtol=1e-5, atol=1e-5), "cohere2_moe": dict(rtol=1e-5, atol=1e-5)}
# the kernel path on two rows: GPT-OSS (pre-norm; the MLP's (out, scores)), Cohere2 (parallel); the
# post-norm and pre-norm kernels' other callers are test_transformers.py's (olmo2, qwen3, ...): about
# 11 s under the interpreter, where deepseek_v3 and olmo3 would add 35 s
KERNEL_ROWS = ["gpt_oss", "cohere2"]


def same(x, y, arch):
    if arch in NOT_BITWISE:
        torch.testing.assert_close(x, y, **NOT_BITWISE[arch])
    else:
        assert torch.equal(x, y), max_diff(x, y)


@pytest.mark.parametrize("arch", ROWS)
def test_family_row(arch, tmp_path, monkeypatch):
    unfused, fused = pair(arch)
    assert list(fused.state_dict()) == list(unfused.state_dict())
    ids, mask, labels = batch(t=8)
    a, b = run(unfused, ids, mask, labels), run(fused, ids, mask, labels)
    assert b[2].keys() == a[2].keys() and len(b[3]) == len(a[3]) == 3
    for x, y in [*zip(b[:2], a[:2], strict=True), *((b[2][n], a[2][n]) for n in a[2]), *zip(b[3], a[3], strict=True)]:
        same(x, y, arch)
    # fused: the stream's 2n residual adds (a parallel layer's one) are inside the stream ops, which
    # take a residual that many times (the adds left are the MoE blocks' own: shared experts)
    u, f, calls = stream_ops(unfused, fused, ids, monkeypatch)
    parallel = FAMILIES[arch].shape.name == "parallel"
    assert u.adds - f.adds == 4, (u.adds, f.adds)
    assert sum(c[2] for c in calls) == (2 if parallel else 4)
    with torch.no_grad():
        assert type(fused.base_model(ids)) is type(unfused.base_model(ids))
    # greedy generation with the cache, left padding
    g_ids, g_mask, _ = batch(t=5)
    kw = dict(attention_mask=g_mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(unfused.generate(g_ids, **kw), fused.generate(g_ids, **kw))
    # save_pretrained: the unfused model's keys and tensors
    from safetensors.torch import load_file

    unfused.save_pretrained(tmp_path / "unfused")
    fused.save_pretrained(tmp_path / "fused")
    written, expected = (load_file(tmp_path / m / "model.safetensors") for m in ("fused", "unfused"))
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)
    # gradient checkpointing in training mode: the forward recomputed, the same loss and gradients
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.23 renames it activation_checkpointing_enable
        fused.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in fused.model.layers)
    unfused.train(), fused.train()
    # (one seed for both: the dropouts and router noise inside the attention and MoE draw alike)
    a, b = (torch.manual_seed(0) and run(m, ids, mask, labels, hidden=False) for m in (unfused, fused))
    assert b[2].keys() == a[2].keys()
    torch.testing.assert_close(b[1], a[1], rtol=1e-6, atol=1e-6)
    for name in a[2]:
        torch.testing.assert_close(b[2][name], a[2][name], rtol=1e-5, atol=1e-5)


@pytest.mark.kernel
@pytest.mark.parametrize("arch", KERNEL_ROWS)
def test_kernel_path_matches_the_unfused_model(arch):
    unfused, fused = pair(arch)
    ids, mask, labels = batch(t=6)
    a, b = run(unfused, ids, mask, labels, hidden=False), run(fused, ids, mask, labels, hidden=False)
    # test_transformers.py's kernel-path bounds: 1e-5 on the loss, 1e-4 on logits and gradients
    close = KERNEL_PATH or arch in NOT_BITWISE
    for x, y, tol in [(b[0], a[0], 1e-4), (b[1], a[1], 1e-5), *((b[2][n], a[2][n], 1e-4) for n in a[2])]:
        torch.testing.assert_close(x, y, rtol=tol if close else 0, atol=tol if close else 0)


# ---------------------------------------------------------------------------- the refusals left

# What each reason given for a family once refused as Llama-shaped says its modeling source holds:
# every pattern must be found there (the module of its causal-LM class, as transformers maps it)
_LAYER = (r"self\.input_layernorm =", r"self\.self_attn =", r"self\.post_attention_layernorm =", r"self\.mlp =")
EVIDENCE = {
    refused._LLAMA_SHAPED: _LAYER,
    refused._MULTI_ROTARY: (r"rotary_embs|layer_type",),
    refused._BLOCK_SPARSE: (r"self\.block_sparse_moe =", r"residual_multiplier"),
    refused._OTHER_SANDWICH: (r"self\.(post_mlp_layernorm|post_norm1) =",),
    refused._INDEXED: (r"indexed_attention",),
    refused._HYBRID: (r"linear_attention|LinearAttention|Mamba|mamba|conv|Conv",),
    refused.REFUSED["doge"]: (r"self\.input_residual = nn\.Parameter",
                              r"self\.post_attention_residual = nn\.Parameter"),
    refused.REFUSED["jetmoe"]: (r"self\.self_attention =", r"self\.mlp ="),
    refused.REFUSED["minicpm3"]: (r"scale_depth / math\.sqrt\(self\.num_hidden_layers\)|scale_depth", r"scale_emb"),
    refused.REFUSED["nanochat"]: (r"class NanoChatRMSNorm\(torch\.nn\.Module\):\s+def __init__\(self, eps",),
    refused.REFUSED["persimmon"]: (r"self\.final_layernorm =", r"q_layernorm"),
    refused.REFUSED["gpt_neox_japanese"]: (r"dense_bias", r"self\.final_layer_norm ="),
    refused.REFUSED["axk2"]: (r"class AXK2GatedRMSNorm",),
    refused.REFUSED["cohere_compass_text"]: (r"self\.input_layernorm =", r"hidden_states_attention"),
}
# the 65 families refused as Llama-shaped before issue 43: each fused now (by name or by its class), or
# refused for a reason EVIDENCE checks
ONCE_LLAMA_SHAPED = ("arcee axk1 bailing_hybrid bitnet cwm deepseek_v2 deepseek_v3 deepseek_v32 diffllama doge "
                     "ernie4_5 ernie4_5_moe exaone_moe flint glm glm4_moe glm4_moe_lite glm_moe_dsa gpt_oss hy_v3 "
                     "internlm3 iquestcoder laguna mellum mimo_v2_flash minicpm3 minimax minimax_m2 "
                     "minimax_m3_vl_text nanochat olmoe seed_oss solar_open youtu aria_text ministral3 jetmoe moshi "
                     "hunyuan_v1_dense hunyuan_v1_moe dots1 granitemoe granitemoe_swa granitemoeshared granite_swa "
                     "emu3 phimoe jais2 persimmon nemotron gpt_neox_japanese phi4_multimodal cohere2 cohere2_moe "
                     "cohere_compass_text exaone4 olmo3 flex_olmo vaultgemma afmoe beam apertus axk2 hyperclovax "
                     "kolibri1").split()


def modeling_source(model_type: str) -> str | None:
    import inspect
    import sys

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        return None
    return inspect.getsource(sys.modules[getattr(transformers, name).__module__])


REFUSED_LEFT = [m for m in ONCE_LLAMA_SHAPED if m in refused.REFUSED and refused.REFUSED[m] in EVIDENCE]


@pytest.mark.parametrize("model_type", REFUSED_LEFT)
def test_each_refusal_left_is_what_the_familys_source_holds(model_type):
    source = modeling_source(model_type)
    if source is None:
        pytest.skip(f"transformers {transformers.__version__} has no causal LM for {model_type}")
    missing = [p for p in EVIDENCE[refused.REFUSED[model_type]] if not re.search(p, source)]
    assert not missing, (model_type, refused.REFUSED[model_type], missing)


def test_every_family_once_refused_as_llama_shaped_is_fused_or_refused_for_a_checked_reason():
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    from fuseblock.integrations.transformers.families import family_of_class
    from fuseblock.integrations.transformers.fusion import refusal

    unchecked = [m for m in ONCE_LLAMA_SHAPED if m not in FAMILIES and refusal(m) not in EVIDENCE
                 and family_of_class(MODEL_MAPPING_NAMES.get(m)) is None]
    assert not unchecked, unchecked
    # the generic reason is kept for layers that are Llama's four modules (its evidence) and nothing else
    assert len([m for m in ONCE_LLAMA_SHAPED if m in FAMILIES]) >= 38


# ---------------------------------------------------------------------------- families keyed by class

# config-only families: a config of their own, a fused family's modeling classes (by the
# installed transformers' auto mapping: internlm3 and iquestcoder build a LlamaModel, gpt-sw3 a
# GPT2Model; 5.24 adds
# exaone, sarvam_moe on GLM4-MoE's classes, sarvam_mla on DeepSeek-V3's)
CONFIG_ONLY = ["internlm3", "iquestcoder", "gpt-sw3", "exaone", "sarvam_moe", "sarvam_mla"]


@pytest.mark.parametrize("model_type", CONFIG_ONLY)
def test_a_config_only_family_fuses_as_the_family_of_its_class(model_type):
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    from fuseblock.integrations.transformers.families import family_of_class
    from fuseblock.integrations.transformers.tiny import TINY

    if model_type not in MODEL_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    owner = family_of_class(MODEL_MAPPING_NAMES[model_type])
    assert owner in FAMILIES and model_type not in refused.REFUSED
    config = transformers.AutoConfig.for_model(model_type, **{**SIZES, **TINY[owner]})
    assert config.model_type in (model_type, owner)  # (gpt-sw3's config is GPT2Config: model_type gpt2)
    unfused = make_from(config)
    fused = fuse(copy.deepcopy(unfused))
    assert fused.base_model.fuseblock_family is FAMILIES[owner]
    ids, mask, labels = batch(t=8)
    a, b = run(unfused, ids, mask, labels), run(fused, ids, mask, labels)
    for x, y in [*zip(b[:2], a[:2], strict=True), *((b[2][n], a[2][n]) for n in a[2]), *zip(b[3], a[3], strict=True)]:
        assert torch.equal(x, y), max_diff(x, y)
    g_ids, g_mask, _ = batch(t=5)
    kw = dict(attention_mask=g_mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(unfused.generate(g_ids, **kw), fused.generate(g_ids, **kw))


def make_from(config):
    """hf_models.make's model from a config (a family tiny_config does not know)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def test_an_unknown_model_type_on_a_fused_class_is_checked_by_its_structure():
    """A model_type fuse has never heard of, on LlamaForCausalLM: fused as llama, bitwise; the
    same with one layer's norm replaced by a module fuseblock does not compute: refused by
    what differs, not by name, and left as it was."""
    config = transformers.LlamaConfig(**SIZES)
    config.model_type = "my_llama"
    unfused = make_from(config)
    fused = fuse(copy.deepcopy(unfused))
    ids, mask, labels = batch(t=8)
    a, b = run(unfused, ids, mask, labels, hidden=False), run(fused, ids, mask, labels, hidden=False)
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[2][n], b[2][n]) for n in a[2])
    odd = copy.deepcopy(unfused)
    odd.model.layers[1].post_attention_layernorm = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"LlamaModel \(model_type 'my_llama'\) is not the layout fuse fuses as llama "
                                         r"\(pre-norm\): layers\[1\]\.post_attention_layernorm is no norm"):
        fuse(odd)
    assert not any(isinstance(m, Norm) for m in odd.modules())
    # a class of the same name that is not transformers' own is no known class
    renamed = type("LlamaModel", (torch.nn.Module,), {})
    assert family_of_class_for(renamed) is None


def family_of_class_for(cls):
    from fuseblock.integrations.transformers.families import family_of_class

    return family_of_class(cls.__name__) if getattr(transformers, cls.__name__, None) is cls else None
