"""fuse on transformers 5.24's dory (nGPT on the unit sphere, issue 43) against the unfused
model; skipped where transformers has no dory (5.23 and before).

tiny.py's config: 4 layers, one input layer, two recurrent layers looped twice, one output
layer (6 layer visits a forward), sliding layers and a full one. Each interpolating update
and the norm after it is one norm_add_norm(update="interpolate"): 2 a visit, where the unfused
model runs its 4 stream norms a visit and the model's 4. On the torch path in fp32 the fused
model is the unfused one bitwise (logits, loss, every gradient, every hidden state: the op's
torch path takes DoryDecoderLayer's order); on the kernel path within 1e-5 of each tensor's
scale. Then generation with the cache (both recurrent cache modes), checkpoints, gradient
checkpointing, and the refusals by name.
"""
import copy
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DoryForCausalLM"):
    pytest.skip("transformers has no dory before 5.24", allow_module_level=True)

from helpers import KERNEL_PATH  # noqa: E402
from hf_models import (  # noqa: E402
    assert_checkpoints_load_both_ways,
    assert_generation_equal,
    assert_same_run,
    batch,
    run,
)

import fuseblock.integrations.transformers.unit_sphere as unit_sphere  # noqa: E402
from fuseblock.integrations.transformers import FAMILIES, REFUSED, fuse  # noqa: E402
from fuseblock.integrations.transformers.tiny import tiny_config  # noqa: E402

KIND = "dory"
VISITS = 1 + 2 * 2 + 1  # the layers a forward runs: the input layer, 2 recurrent layers twice, the output layer
STREAM_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")


def build(seed=0, **overrides):
    """The unfused model in eval mode, its 1-d parameters (the rates, logit and attention
    scales) perturbed away from their constant initial values, and the padding token's
    embedding row too: transformers zeroes it, and the unfused model's gradients of the
    first layer are then NaN on a padded batch (the fused model's alike, bit for bit)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(KIND, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
        model.model.embed_tokens.weight[model.config.pad_token_id].normal_()
    return model.eval()


def pair(**overrides):
    model = build(**overrides)
    return model, fuse(copy.deepcopy(model))


@pytest.mark.kernel
def test_dory_fused_equals_the_unfused_model_with_one_op_per_update(monkeypatch):
    unfused, fused = pair()
    assert list(fused.state_dict()) == list(unfused.state_dict())
    calls = []
    real = unit_sphere.norm_add_norm
    monkeypatch.setattr(unit_sphere, "norm_add_norm", lambda *a, **k: calls.append(k["update"]) or real(*a, **k))
    ran = {id(m): 0 for m in (unfused, fused)}  # the stream's DoryL2Norm modules the fused model still runs
    for model in (unfused, fused):
        for name, m in model.named_modules():
            if name == "model.norm" or name.rsplit(".", 1)[-1] in STREAM_NORMS:
                m.register_forward_hook(lambda m, a, o, model=model: ran.__setitem__(id(model), ran[id(model)] + 1))
    ids, mask, labels = batch(t=8)
    a, b = run(unfused, ids, mask, labels), run(fused, ids, mask, labels)
    assert len(a[2]) == len(list(unfused.parameters()))  # every parameter has its gradient
    assert calls == ["interpolate"] * 2 * VISITS
    # unfused: 4 a visit, and the model's (input section, each loop's entry, the final one);
    # fused: layer 0's input norm, each loop's first input norm, the first loop's entry
    assert ran[id(unfused)] == 4 * VISITS + 1 + 2 + 1 and ran[id(fused)] == 1 + 2 + 1
    assert_same_run(b, a, exact=not KERNEL_PATH, states=VISITS + 1)


def test_dory_what_the_op_does_not_compute_stays_as_it_was():
    """The norms (DoryL2Norm), attention, MLP, head stay the modeling code's modules (their
    classes and Parameters); the layers and the model keep their class names, and fuse runs once."""
    model = build()
    before = {n: type(m) for n, m in model.named_modules()}
    params = dict(model.named_parameters())
    fuse(model)
    for name, m in model.named_modules():
        if name == "model" or re.fullmatch(r"model\.layers\.\d+", name):
            assert type(m) is not before[name] and type(m).__name__ == before[name].__name__
            assert isinstance(m, before[name])
        else:
            assert type(m) is before[name], name
    assert all(p is params[n] for n, p in model.named_parameters())
    layer = type(model.model.layers[0])
    assert type(fuse(model).model.layers[0]) is layer


def test_dory_fused_model_copies_and_pickles_fused(tmp_path):
    fused = pair()[1]
    torch.save(fused, tmp_path / "fused.pt")
    ids = batch(t=6)[0]
    for other in (torch.load(tmp_path / "fused.pt", weights_only=False), copy.deepcopy(fused)):
        assert other.model.fuseblock_family is FAMILIES[KIND]
        assert [type(x) for x in other.model.layers] == [type(x) for x in fused.model.layers]
        with torch.no_grad():
            assert torch.equal(other(ids).logits, fused(ids).logits)


@pytest.mark.parametrize("mode", ["per_loop", "last_loop"])
def test_dory_greedy_generation_with_cache_and_padding_is_identical(mode):
    """Both recurrent cache modes: a cache per loop (copies of the recurrent layers' appended
    to the cache), or the last loop's alone, which the earlier loops read."""
    unfused, fused = pair(recurrent_kv_cache_mode=mode)
    ids, mask, _ = batch(t=8)
    assert_generation_equal(unfused, fused, ids, mask)


def test_dory_checkpoints_keep_their_keys_and_load_both_ways(tmp_path):
    unfused, fused = pair()
    assert_checkpoints_load_both_ways(unfused, fused, batch(t=6)[0], tmp_path)


@pytest.mark.parametrize("reentrant", [False, True])
def test_dory_gradient_checkpointing_in_training_mode(reentrant):
    unfused, fused = pair()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        fused.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert all(layer.gradient_checkpointing for layer in fused.model.layers)
    fused.train(), unfused.train()
    calls, mlp = [], fused.model.layers[0].mlp
    mlp.forward = lambda *a, forward=mlp.forward, **k: calls.append(1) or forward(*a, **k)
    ids, mask, labels = batch(t=6)
    a, b = run(unfused, ids, mask, labels, hidden=False), run(fused, ids, mask, labels, hidden=False)
    assert len(calls) == 2  # forward, then again in backward: checkpointing ran
    assert_same_run(b, a, states=VISITS + 1)


def test_dory_what_the_fused_forward_does_not_compute_is_refused_by_name():
    """A stream norm other than DoryL2Norm, input norms of another eps than the model's (each
    layer's last op applies the next one's), a layer without its rates, residual_dtype: each
    a one-line ValueError naming it, the model left as it was."""
    model = build()
    model.model.layers[1].post_attention_layernorm = torch.nn.RMSNorm(64)
    with pytest.raises(ValueError, match=r"layers\[1\]\.post_attention_layernorm is a RMSNorm, where the op "
                                         r"computes the unit-sphere L2 norm of DoryL2Norm") as e:
        fuse(model)
    assert "\n" not in str(e.value) and not hasattr(model.model, "fuseblock_family")
    assert type(model.model.layers[0]) is transformers.models.dory.modeling_dory.DoryDecoderLayer
    model = build()
    model.model.layers[2].input_layernorm.eps = 1e-5
    with pytest.raises(ValueError, match=r"the layers' input_layernorm and the model's norm take several eps "
                                         r"\(\[1e-06, 1e-05\]\)"):
        fuse(model)
    model = build()
    del model.model.layers[0].lambda_2
    with pytest.raises(ValueError, match=r"layers\[0\] holds tensors \['lambda_1'\].*the rates lambda_1 and "
                                         r"lambda_2 \(64,\)"):
        fuse(model)
    with pytest.raises(ValueError, match=r"residual_dtype: DoryModel's stream is kept in the model's dtype"):
        fuse(build(), residual_dtype=torch.float32)
    assert KIND not in REFUSED


# What the fused forwards compute, as DoryDecoderLayer, DoryL2Norm and DoryModel compute it
# (their source, which a transformers release could change: this then fails)
SOURCE = (r"class DoryL2Norm\(torch\.nn\.Module\):[^$]*?def __init__\(self, eps: float = 1e-6\):",
          r"return x \* torch\.rsqrt\(x\.pow\(2\)\.sum\(-1, keepdim=True\) \+ self\.eps\)",
          r"hidden_states = self\.input_layernorm\(hidden_states\)",  # the normed value is the stream
          r"attn_output = self\.post_attention_layernorm\(attn_output\)\s+"
          r"attention_rate = \(self\.lambda_1 \* self\.lambda_scale\)\.abs\(\)\s+"
          r"hidden_states = hidden_states \+ attention_rate \* \(attn_output - hidden_states\)\s+"
          r"hidden_states = self\.pre_feedforward_layernorm\(hidden_states\)",
          r"mlp_output = self\.post_feedforward_layernorm\(self\.mlp\(hidden_states\)\)\s+"
          r"mlp_rate = \(self\.lambda_2 \* self\.lambda_scale\)\.abs\(\)\s+"
          r"hidden_states = hidden_states \+ mlp_rate \* \(mlp_output - hidden_states\)\s+return hidden_states",
          r"input_hidden_states = self\.norm\(hidden_states\)\s+for loop_idx in range\(n_loops\):\s+"
          r"hidden_states = self\.norm\(hidden_states\) \+ input_hidden_states",
          r"hidden_states = self\.norm\(hidden_states\)\s+return BaseModelOutputWithPast")


def test_dory_source_computes_what_the_fused_forwards_take():
    import inspect

    source = inspect.getsource(transformers.models.dory.modeling_dory)
    assert not [p for p in SOURCE if not re.search(p, source)]
