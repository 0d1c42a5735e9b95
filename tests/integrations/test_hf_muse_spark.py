"""fuse on transformers' muse_spark (per-channel residual gates, issue 43; in 5.23 and 5.24)
against the unfused model; skipped where transformers has no muse_spark.

Its text model (muse_spark_text) comes inside the MuseSparkForConditionalGeneration wrapper
(no causal LM of its own): a tiny one here, 2 text layers (a sliding-window RoPE layer with a
dense MLP, then a full-attention NoPE layer with the MoE), one vision layer, random weights.
Per layer, the attention's gate and the MLP's pre-norm are one add_norm with [d]
residual_scale / branch_scale, the MLP's input-scaled post-norm and its gate one norm_add,
the input norm one norm (gated.py); the MuseSparkRMSNorms and the model forward stay the
modeling code's. On the torch path in fp32 the fused model is the unfused one bitwise
(logits, loss, every gradient, every hidden state) on a text + image batch; on the kernel
path within 1e-5 of each tensor's scale. Then generation with the cache, checkpoints,
gradient checkpointing, the bare text model, and the refusals by name.
"""
import copy
import warnings
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "MuseSparkForConditionalGeneration"):
    pytest.skip(f"transformers {transformers.__version__} has no muse_spark", allow_module_level=True)

from helpers import KERNEL_PATH, generator  # noqa: E402
from hf_models import (  # noqa: E402
    assert_checkpoints_load_both_ways,
    assert_generation_equal,
    assert_same_run,
    batch,
    max_diff,
    run,
)

import fuseblock.integrations.transformers.gated as gated  # noqa: E402
from fuseblock import Norm  # noqa: E402
from fuseblock.integrations.transformers import REFUSED, WRAPPERS, fuse  # noqa: E402
from fuseblock.integrations.transformers.families import WRAPPED  # noqa: E402
from fuseblock.integrations.transformers.tiny import SIZES  # noqa: E402
from fuseblock.integrations.transformers.versions import CACHE  # noqa: E402

KIND = "muse_spark_text"
LAYERS = 2
TEXT = dict(SIZES, head_dim=16, sliding_window=5, moe_intermediate_size=32, moe_hidden_size=32, num_local_experts=4,
            num_experts_per_tok=2, mlp_layer_types=["dense", "sparse"],
            layer_types=["sliding_attention", "full_attention"], layer_rope_theta=[10000.0, 0])
VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1, patch_size=2,
              pos_emb_height=4, pos_emb_width=4)
AUDIO = dict(hidden_sizes=(8, 16), patch_sizes=(2, 2), depths=(1, 1), num_hidden_layers=2,
             out_hidden_size=SIZES["hidden_size"])


def build(seed=0, **text_overrides):
    """The unfused wrapper in eval mode, every 1-d parameter perturbed (the norms' weights and
    the gates away from their init)."""
    config = transformers.MuseSparkConfig(text_config={**TEXT, **text_overrides}, vision_config=VISION,
                                          audio_config=AUDIO, image_token_id=3, video_token_id=4, audio_token_id=5,
                                          out_hidden_size=4 * VISION["hidden_size"], projector_hidden_size=64)
    torch.manual_seed(seed)
    model = transformers.MuseSparkForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def pair(**overrides):
    model = build(**overrides)
    return model, fuse(copy.deepcopy(model))


def text_batch(t=12):
    """hf_models.batch with no token the wrapper takes for an image, video or audio placeholder (3, 4, 5)."""
    ids, mask, labels = batch(t=t)
    ids = torch.where((ids >= 3) & (ids <= 5), ids + 3, ids)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def with_image(ids):
    """One 4 x 4 grid of 2 x 2 patches (2 frames) per row, merged 2 x 2 into the 4 image tokens at
    positions 3 to 6 (after row 0's padding)."""
    g = generator(2)
    ids = ids.clone()
    ids[:, 3:7] = 3
    return ids, dict(pixel_values=torch.randn(ids.shape[0] * 16, 2 * 3 * 2 * 2, generator=g),
                     image_grid_thw=torch.tensor([[1, 4, 4]] * ids.shape[0]))


@pytest.mark.kernel
def test_muse_spark_fused_equals_the_unfused_model_with_its_gates_in_the_ops(monkeypatch):
    unfused, fused = pair()
    assert list(fused.state_dict()) == list(unfused.state_dict())
    calls = []
    for name in ("norm", "add_norm", "norm_add"):
        real = getattr(gated, name)
        monkeypatch.setattr(gated, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    ran = {id(m): [] for m in (unfused, fused)}  # the modeling code's gates and norms each model runs
    for model in (unfused, fused):
        for m in model.model.language_model.modules():
            if type(m).__name__.startswith("MuseSpark") and type(m).__name__.endswith(("Gate", "Norm")):
                m.register_forward_hook(lambda m, a, o, model=model: ran[id(model)].append(type(m).__name__))
    ids, mask, labels = text_batch()
    ids, image = with_image(ids)
    a, b = run(unfused, ids, mask, labels, **image), run(fused, ids, mask, labels, **image)
    assert sum(n.startswith("model.vision_tower.") for n in a[2]) > 0  # the image reached the loss
    assert sum(n.startswith("model.language_model.") for n in a[2]) == \
        len(list(unfused.model.language_model.parameters()))  # every text parameter has its gradient
    assert calls == ["norm", "add_norm", "norm_add"] * LAYERS
    # fused, the layers' gates, input and pre-feedforward norms and post-feedforward norms never run; every
    # MuseSparkRMSNorm does (the embeddings', the attention's q/k and o norms and post-norm, the final norm),
    # and so do the MoE's own norms
    u, f = Counter(ran[id(unfused)]), Counter(ran[id(fused)])
    assert u["MuseSparkResidualGate"] == 2 * LAYERS and f["MuseSparkResidualGate"] == 0
    assert u["MuseSparkTextCenteredRMSNorm"] - f["MuseSparkTextCenteredRMSNorm"] == 2 * LAYERS
    assert u["MuseSparkTextInputScaledRMSNorm"] - f["MuseSparkTextInputScaledRMSNorm"] == LAYERS
    assert f["MuseSparkRMSNorm"] == u["MuseSparkRMSNorm"] >= 4 * LAYERS + 2
    assert_same_run(b, a, exact=not KERNEL_PATH, states=LAYERS + 1)


def test_muse_spark_what_the_ops_do_not_compute_stays_as_it_was():
    """The norms and gates stay the modeling code's modules (their classes and Parameters), and
    so do the inner model's class and forward, the vision and audio towers; the layers keep their
    class names, and fuse runs once. The bare text model (MuseSparkTextModel) fuses alone too:
    its last hidden state and every gradient bitwise."""
    model = build()
    before = {n: type(m) for n, m in model.named_modules()}
    params = dict(model.named_parameters())
    fuse(model)
    base = model.model.language_model
    assert base.fuseblock_family is WRAPPED[KIND] and WRAPPERS["muse_spark"] == "language_model"
    assert not {KIND, "muse_spark"} & set(REFUSED)
    for name, m in model.named_modules():
        if name.startswith("model.language_model.layers.") and name.count(".") == 3:
            assert type(m).__name__ == before[name].__name__ and isinstance(m, before[name]) and type(m) is not \
                before[name]
        else:
            assert type(m) is before[name], name
    assert not any(isinstance(m, Norm) for m in model.modules())
    assert all(p is params[n] for n, p in model.named_parameters())
    layer = type(base.layers[0])
    assert type(fuse(model).model.language_model.layers[0]) is layer

    unfused = build().model.language_model
    fused = fuse(copy.deepcopy(unfused))
    ids, mask, _ = text_batch()
    outs = []
    for m in (unfused, fused):
        h = m(input_ids=ids, attention_mask=mask).last_hidden_state
        h.square().sum().backward()
        outs.append((h.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert torch.equal(outs[1][0], outs[0][0])
    assert all(g is not None for g in outs[0][1].values())
    assert all(torch.equal(outs[1][1][n], g) for n, g in outs[0][1].items())


def test_muse_spark_norm_stays_the_modeling_codes_its_gradient_is_pows():
    """Why MuseSparkRMSNorm is not converted: norm_from takes it (its forward is the Norm's,
    bitwise in fp32) and its input gradient differs (pow's backward, where the op's is rsqrt's);
    the same norm in rsqrt's form is the Norm's, gradient too (the difference is pow's alone)."""
    from transformers.models.muse_spark import modeling_muse_spark

    from fuseblock.convert import norm_from

    g = generator(0)
    norm = modeling_muse_spark.MuseSparkRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
    x = torch.randn(2, 9, 64, generator=g, requires_grad=True)
    dy = torch.randn(2, 9, 64, generator=g)
    fused = norm_from(norm)
    out, out_f = norm(x), fused(x)
    assert torch.equal(out, out_f)
    dx, dx_f = (torch.autograd.grad(y, x, dy)[0] for y in (out, out_f))
    assert 0 < max_diff(dx, dx_f) <= 2.4e-7
    rsqrt = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert torch.equal(torch.autograd.grad(rsqrt, x, dy)[0], dx_f)


def test_muse_spark_fused_model_copies_and_pickles_fused(tmp_path):
    fused = pair()[1]
    torch.save(fused, tmp_path / "fused.pt")
    ids = text_batch(t=6)[0]
    for other in (torch.load(tmp_path / "fused.pt", weights_only=False), copy.deepcopy(fused)):
        assert other.model.language_model.fuseblock_family is WRAPPED[KIND]
        assert [type(x) for x in other.model.language_model.layers] == \
            [type(x) for x in fused.model.language_model.layers]
        with torch.no_grad():
            assert torch.equal(other(ids).logits, fused(ids).logits)


def test_muse_spark_greedy_generation_with_cache_and_padding_is_identical():
    unfused, fused = pair()
    ids, mask, _ = text_batch(t=8)
    with torch.no_grad():
        caches = [getattr(m(input_ids=ids, attention_mask=mask, use_cache=True), CACHE) for m in (unfused, fused)]
    assert type(caches[1]) is type(caches[0]) and caches[1].get_seq_length() == caches[0].get_seq_length() == 8
    assert_generation_equal(unfused, fused, ids, mask)


def test_muse_spark_checkpoints_keep_their_keys_and_load_both_ways(tmp_path):
    unfused, fused = pair()
    assert_checkpoints_load_both_ways(unfused, fused, text_batch(t=6)[0], tmp_path,
                                      layers=lambda m: m.model.language_model.layers)


def test_muse_spark_gradient_checkpointing_in_training_mode():
    unfused, fused = pair()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        fused.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert all(layer.gradient_checkpointing for layer in fused.model.language_model.layers)
    fused.train(), unfused.train()
    calls, mlp = [], fused.model.language_model.layers[0].mlp
    mlp.forward = lambda *a, forward=mlp.forward, **k: calls.append(1) or forward(*a, **k)
    ids, mask, labels = text_batch(t=6)
    a, b = run(unfused, ids, mask, labels, hidden=False), run(fused, ids, mask, labels, hidden=False)
    assert len(calls) == 2  # forward, then again in backward: checkpointing ran
    assert_same_run(b, a, states=LAYERS + 1)


def test_muse_spark_what_the_ops_cannot_express_is_refused_by_name():
    """A gate or a norm that does not compute what its op is given, and residual_dtype: each a
    one-line ValueError naming it, the model left as it was."""
    model = build()
    layer = model.model.language_model.layers[1]
    cls = type(layer)
    layer.post_feedforward_residual_gate.temperature = "0.3"
    with pytest.raises(ValueError, match=r"layers\[1\]\.post_feedforward_residual_gate has no temperature and eps "
                                         r"\(the residual_scale and branch_scale the op takes\)") as e:
        fuse(model)
    assert "\n" not in str(e.value) and not hasattr(model.model.language_model, "fuseblock_family")
    assert type(layer) is cls
    model = build()
    gate = model.model.language_model.layers[0].post_attention_residual_gate
    gate.forward = lambda residual, hidden_states: residual + hidden_states  # (an instance's own forward)
    with pytest.raises(ValueError, match=r"layers\[0\]\.post_attention_residual_gate does not compute alpha \* r "
                                         r"\+ beta \* f"):
        fuse(model)
    model = build()
    model.model.language_model.layers[0].pre_feedforward_layernorm = torch.nn.RMSNorm(64, eps=1e-5)
    with pytest.raises(ValueError, match=r"layers\[0\]\.pre_feedforward_layernorm is not x / rms\(x\) \* \(1 \+ w\) "
                                         r"at its eps"):
        fuse(model)
    model = build()
    model.model.language_model.layers[0].post_feedforward_layernorm = \
        copy.deepcopy(model.model.language_model.layers[0].input_layernorm)
    with pytest.raises(ValueError, match=r"layers\[0\]\.post_feedforward_layernorm is not N\(\(1 \+ w\) \* m\)"):
        fuse(model)
    with pytest.raises(ValueError, match=r"residual_dtype: MuseSparkTextModel's stream is its gates' output"):
        fuse(build(), residual_dtype=torch.float32)
