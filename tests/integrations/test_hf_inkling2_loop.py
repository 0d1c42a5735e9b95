"""fuse on transformers 5.24's inkling2_loop (block attention residuals, issue 45) against the
unfused model; skipped where transformers has no inkling2_loop (5.23 and before).

tiny.py's config: 4 layers in blocks of 2 (a sliding then a full-attention layer in each),
layers 2 and 3 looped twice. Each one-query mix and the norm after it is one
attn_res_add_norm (5 a forward: both mixes of the plain sliding layer 2 in its first pass,
every layer's MLP input in the first pass); the full layers' three-query mixes, the second
pass's message gates and the mixes around them, the short convolutions, the message and
final mixes stay the modeling code's. On the torch path in fp32 the fused model is the
unfused one bitwise (logits, loss, every gradient, every hidden state: the op's torch path
takes the modeling code's order, form "inkling2"); on the kernel path within 1e-5 of each
tensor's scale. Then generation with the cache, checkpoints, gradient checkpointing, the
multimodal wrapper, and the refusals by name.
"""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Inkling2LoopForCausalLM"):
    pytest.skip("transformers has no inkling2_loop before 5.24", allow_module_level=True)

from helpers import KERNEL_PATH  # noqa: E402
from hf_models import (  # noqa: E402
    assert_checkpoints_load_both_ways,
    assert_generation_equal,
    assert_same_run,
    batch,
    run,
)

import fuseblock.integrations.transformers.attn_res as fused_attn_res  # noqa: E402
from fuseblock.integrations.transformers import FAMILIES, fuse  # noqa: E402
from fuseblock.integrations.transformers.tiny import SIZES, TINY, tiny_config  # noqa: E402

KIND = "inkling2_loop_text"
VISITS = 4 + 2  # the layers a forward runs: 4, and layers 2 and 3 once more


def build(seed=0, **overrides):
    """The unfused model in eval mode, its 1-d parameters and its attention-residual queries
    perturbed (transformers initialises the queries to zeros: uniform mixes)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(KIND, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("query"):
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def pair(**overrides):
    model = build(**overrides)
    return model, fuse(copy.deepcopy(model))


@pytest.mark.kernel
def test_inkling2_loop_fused_equals_the_unfused_model_with_one_op_per_mix(monkeypatch):
    unfused, fused = pair()
    assert list(fused.state_dict()) == list(unfused.state_dict())
    calls = []
    real = fused_attn_res.attn_res_add_norm
    monkeypatch.setattr(fused_attn_res, "attn_res_add_norm",
                        lambda *a, **k: calls.append(a[0].shape[-2]) or real(*a, **k))
    ran = {id(m): 0 for m in (unfused, fused)}  # the modeling code's mixes the fused model still runs
    for model in (unfused, fused):
        for m in model.modules():
            if type(m).__name__.endswith("BlockAttentionResidual"):
                m.register_forward_hook(lambda m, a, o, model=model: ran.__setitem__(id(model), ran[id(model)] + 1))
    ids, mask, labels = batch(t=8)
    a, b = run(unfused, ids, mask, labels), run(fused, ids, mask, labels)
    assert len(a[2]) == len(list(unfused.parameters()))  # every parameter has its gradient
    # the banks: layer 0's MLP (its input joins B), layer 1's, layer 2's attention (2 blocks) and MLP, layer 3's
    assert calls == [1, 1, 1, 2, 2]
    # unfused: 2 mixes a layer visit, layer 0's attention none, and the final one; fused: the 5 less
    assert ran[id(unfused)] == 2 * VISITS - 1 + 1 and ran[id(fused)] == ran[id(unfused)] - 5
    assert_same_run(b, a, exact=not KERNEL_PATH, states=VISITS + 1)


def test_inkling2_loop_what_the_op_does_not_compute_stays_as_it_was():
    """The norms, convolutions, message gates and mixes stay the modeling code's modules (their
    classes and Parameters); the layers keep their class names, and fuse runs once."""
    model = build()
    before = {n: type(m) for n, m in model.named_modules()}
    params = dict(model.named_parameters())
    fuse(model)
    for name, m in model.named_modules():
        if name.count(".") > 2 or not name.startswith("model.layers."):
            assert type(m) is before[name], name
        else:
            assert type(m).__name__ == before[name].__name__ and isinstance(m, before[name])
    assert all(p is params[n] for n, p in model.named_parameters())
    layer = type(model.model.layers[0])
    assert type(fuse(model).model.layers[0]) is layer


def test_inkling2_loop_fused_model_copies_and_pickles_fused(tmp_path):
    """Copied or pickled whole (torch.save), a fused model is fused: its layers' classes, its
    family the registered entry, its logits."""
    fused = pair()[1]
    torch.save(fused, tmp_path / "fused.pt")
    ids = batch(t=6)[0]
    for other in (torch.load(tmp_path / "fused.pt", weights_only=False), copy.deepcopy(fused)):
        assert other.model.fuseblock_family is FAMILIES[KIND]
        assert [type(x) for x in other.model.layers] == [type(x) for x in fused.model.layers]
        with torch.no_grad():
            assert torch.equal(other(ids).logits, fused(ids).logits)


def test_inkling2_loop_greedy_generation_with_cache_and_padding_is_identical():
    unfused, fused = pair()
    ids, mask, _ = batch(t=8)
    assert_generation_equal(unfused, fused, ids, mask)


def test_inkling2_loop_checkpoints_keep_their_keys_and_load_both_ways(tmp_path):
    unfused, fused = pair()
    assert_checkpoints_load_both_ways(unfused, fused, batch(t=6)[0], tmp_path)


def test_inkling2_loop_gradient_checkpointing_in_training_mode():
    unfused, fused = pair()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        fused.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in fused.model.layers)
    fused.train(), unfused.train()
    calls, mlp = [], fused.model.layers[0].mlp
    mlp.forward = lambda *a, forward=mlp.forward, **k: calls.append(1) or forward(*a, **k)
    ids, mask, labels = batch(t=6)
    a, b = run(unfused, ids, mask, labels, hidden=False), run(fused, ids, mask, labels, hidden=False)
    assert len(calls) == 2  # forward, then again in backward: checkpointing ran
    assert_same_run(b, a, states=VISITS + 1)


def test_inkling2_loop_multimodal_wrapper_fuses_its_language_model():
    """Inkling2LoopForConditionalGeneration: its language model fused, the vision tower as it
    was; the logits of a text batch bitwise."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=2,
                  projection_hidden_dim=64, text_hidden_size=SIZES["hidden_size"], posemb_grid_size=4)
    config = transformers.Inkling2LoopConfig(text_config={**SIZES, **TINY[KIND]}, vision_config=vision,
                                             image_token_id=3)
    torch.manual_seed(0)
    unfused = transformers.Inkling2LoopForConditionalGeneration(config).eval()
    fused = fuse(copy.deepcopy(unfused))
    assert fused.model.language_model.fuseblock_family is FAMILIES[KIND]
    assert type(fused.model.vision_tower) is type(unfused.model.vision_tower)
    ids = batch(t=6)[0]
    with torch.no_grad():
        assert torch.equal(fused(input_ids=ids).logits, unfused(input_ids=ids).logits)


def test_inkling2_loop_what_the_op_cannot_express_is_refused_by_name(monkeypatch):
    """A mix the fused forward takes given several queries (one mix each: the op takes one),
    more sources than the op takes, a norm other than a weighted RMSNorm, residual_dtype:
    each a one-line ValueError naming it, the model left as it was."""
    model = build()
    model.model.layers[0].mlp_input.query = torch.nn.Parameter(torch.zeros(3, SIZES["hidden_size"]))
    with pytest.raises(ValueError, match=r"layers\[0\]\.mlp_input\.query has shape \(3, 64\), where attn_res_norm "
                                         r"mixes with one query \(64,\)") as e:
        fuse(model)
    assert "\n" not in str(e.value) and not hasattr(model.model, "fuseblock_family")
    assert type(model.model.layers[0]) is transformers.models.inkling2_loop.modeling_inkling2_loop \
        .Inkling2LoopSlidingDecoderLayer
    model = build()
    model.model.layers[2].input_layernorm = torch.nn.LayerNorm(SIZES["hidden_size"])
    with pytest.raises(ValueError, match=r"the norm after layers\[2\]\.attention_input "
                                         r"\(layers\[2\]\.input_layernorm\) is not a weighted RMSNorm"):
        fuse(model)
    monkeypatch.setattr(fused_attn_res, "MAX_SOURCES", 2)
    with pytest.raises(ValueError, match=r"config\.num_hidden_layers = 4 in blocks of "
                                         r"config\.n_layers_per_attn_res_block = 2 gives mixes of up to 3 sources, "
                                         r"where attn_res_norm takes 1 to 2"):
        fuse(build())
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"residual_dtype: Inkling2LoopTextModel's partial blocks"):
        fuse(build(), residual_dtype=torch.float32)
