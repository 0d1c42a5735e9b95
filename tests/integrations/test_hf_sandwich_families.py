"""fuse on the sandwich and post-norm families (gemma3_text, glm4, olmo2) and inside the
multimodal wrappers (Llava, Gemma3, Mistral3), against the unfused models.

test_transformers.py runs its generic tests (fp32 bitwise, generate, checkpoints,
checkpointing, compile, init, bf16) on the three families; this file holds what is theirs:
the ops each stream shape makes per layer, the flags they refuse, and the wrappers: the
language model fused, the vision tower and projector untouched, fp32 bitwise on a
text + image batch, generate with an image, checkpoints both ways.
"""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import generator  # noqa: E402
from hf_models import HIDDEN, SIZES, batch, make, max_diff, meta_pair, pair, stream_ops  # noqa: E402

from fuseblock import Norm  # noqa: E402
from fuseblock.integrations.transformers import WRAPPERS, fuse  # noqa: E402
from fuseblock.integrations.transformers.tiny import TINY  # noqa: E402

# ---------------------------------------------------------------------------- ops per layer


def _ops(arch, n, monkeypatch):
    """(unfused adds, unfused hidden-width norms, fused op calls): fused calls as (op name,
    x's last dim, with a residual), in order."""
    unfused, fused = pair(arch, layers=n)
    u, f, calls = stream_ops(unfused, fused, batch()[0], monkeypatch)
    assert f.adds == 0 and f.norms == 0  # no residual add and no norm left outside fuseblock's ops
    return u.adds, u.norms, [(name, shape[-1], res) for name, shape, res in calls]


def test_post_norm_makes_one_norm_add_per_residual_add(monkeypatch):
    """OLMo2: unfused, each layer makes 2 norms and 2 adds on the stream (4 ops), the model
    a final norm; fused, each layer makes 2 norm_adds (one per add), the model one plain norm.
    q_norm / k_norm (over the whole projection, 64 and 32 wide here) stay plain norms."""
    n = 3
    adds, norms, calls = _ops("olmo2", n, monkeypatch)
    assert (adds, norms) == (2 * n, 4 * n + 1)  # per layer 2 stream norms, q_norm and k_norm; the final norm
    kv = SIZES["num_key_value_heads"] * HIDDEN // SIZES["num_attention_heads"]
    layer = [("add_norm", HIDDEN, False), ("add_norm", kv, False),  # q_norm, k_norm
             ("norm_add", HIDDEN, True), ("norm_add", HIDDEN, True)]  # attention's post-norm + add, MLP's
    assert calls == layer * n + [("add_norm", HIDDEN, False)]


@pytest.mark.parametrize("arch", ["glm4", "gemma3_text"])
def test_sandwich_makes_three_ops_per_layer(arch, monkeypatch):
    """GLM4 and Gemma3: unfused, each layer makes 4 norms and 2 adds on the stream (6 ops);
    fused, 3: the input norm's add_norm (which takes the previous layer's MLP output in),
    the attention's post-norm + add + MLP pre-norm in one norm_add_norm, and the MLP's
    post-norm; the final norm is one add_norm taking the last layer's output in."""
    n = 3
    adds, norms, calls = _ops(arch, n, monkeypatch)
    assert (adds, norms) == (2 * n, 4 * n + 1)
    stream = [c for c in calls if c[1] == HIDDEN]
    layer = [("add_norm", HIDDEN, True), ("norm_add_norm", HIDDEN, True), ("add_norm", HIDDEN, False)]
    assert stream == [("add_norm", HIDDEN, False)] + layer[1:] + layer * (n - 1) + [("add_norm", HIDDEN, True)]


# ---------------------------------------------------------------------------- what the families refuse


def test_gemma3_tiny_config_takes_both_layer_types_with_their_own_rotary():
    """What makes the fp32 comparisons of test_transformers.py test the per-layer-type
    rotary embeddings and masks: both layer types, with different rope thetas, and a
    window shorter than the test sequence."""
    model = make("gemma3_text", layers=3)
    config = model.config
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    thetas = {k: config.rope_parameters[k]["rope_theta"] for k in ("sliding_attention", "full_attention")}
    assert thetas["sliding_attention"] != thetas["full_attention"]
    assert config.sliding_window < batch()[0].shape[1]


def test_gemma3_bidirectional_attention_is_refused():
    model = make("gemma3_text", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match=r"'gemma3_text'.*config.use_bidirectional_attention = True, which its fused "
                                         r"forward does not read"):
        fuse(model)
    assert not any(isinstance(m, Norm) for m in model.modules())


def test_post_norm_layer_takes_no_residual():
    _, fused = pair("olmo2")
    x = torch.randn(1, 4, HIDDEN)
    with pytest.raises(ValueError, match="post-norm layer takes the whole stream"):
        fused.model.layers[0](x, x)


@pytest.mark.parametrize("arch", ["glm4", "olmo2", "llama", "gemma", "mistral"])
def test_a_window_in_the_config_masks_as_the_unfused_model_does(arch):
    """A config holding sliding_window (configs carry stray keys): GLM4, OLMo2, Llama and
    Gemma build a causal mask whatever it says, Mistral a sliding-window one; the fused
    model builds what its unfused model does (before Family.window_mask it slid for all,
    7 to 11 off on these logits)."""
    unfused, fused = pair(arch, sliding_window=3)
    ids, mask, _ = batch()
    a = unfused(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(fused(input_ids=ids, attention_mask=mask).logits, a)
    causal = make(arch, sliding_window=None)(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a, causal) != (arch == "mistral")  # the window is read by Mistral alone


# ---------------------------------------------------------------------------- multimodal wrappers

IMAGE_TOKEN, IMAGE_TOKENS = 3, 4  # the image placeholder id and the tokens one 8 x 8 image makes
TEXT = {"llava": ("llama", transformers.LlamaConfig), "gemma3": ("gemma3_text", transformers.Gemma3TextConfig),
        "mistral3": ("mistral", transformers.MistralConfig), "qwen2_vl": ("qwen2", transformers.Qwen2VLTextConfig),
        "qwen2_5_vl": ("qwen2", transformers.Qwen2_5_VLTextConfig)}
# Qwen2-VL's M-RoPE splits a head's 8 rotary frequencies into temporal, height and width sections
MROPE = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=8)


def test_every_wrapper_is_tested_here_or_with_the_n_stream_families():
    """(glm5_next and hy_v4_vl, the n-stream wrappers: tests/integrations/test_hf_hyper_families.py;
    inkling2_loop, attention residuals: tests/integrations/test_hf_inkling2_loop.py; muse_spark,
    per-channel gates: tests/integrations/test_hf_muse_spark.py)"""
    assert set(TEXT) | {"glm5_next", "hy_v4_vl", "inkling2_loop", "muse_spark"} == set(WRAPPERS)


def wrapper_config(kind, **text_overrides):
    """A tiny config of the wrapper: fuseblock's tiny text config of its language model's
    family (then text_overrides) and a 2-layer vision tower making IMAGE_TOKENS tokens of
    an 8 x 8 image."""
    family, text_class = TEXT[kind]
    text = text_class(**{**SIZES, **TINY[family], **(MROPE if kind.startswith("qwen") else {}),
                         **text_overrides}).to_dict()
    if kind == "llava":  # CLIP: 4 patches of 4 x 4 and a CLS token, which the default strategy drops
        vision = transformers.CLIPVisionConfig(**VISION, patch_size=4).to_dict()
        return transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                                        vision_feature_layer=-1)
    if kind == "gemma3":  # SigLIP: 16 patches of 2 x 2, pooled to 4 tokens
        vision = transformers.SiglipVisionConfig(**VISION, patch_size=2).to_dict()
        return transformers.Gemma3Config(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                                         mm_tokens_per_image=IMAGE_TOKENS, boi_token_index=4, eoi_token_index=5)
    if kind == "qwen2_vl":  # 16 patches of 2 x 2 (x 2 frames), merged 2 x 2 into 4 tokens
        vision = transformers.Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=HIDDEN, num_heads=2, patch_size=2,
                                                  spatial_merge_size=2, temporal_patch_size=2).to_dict()
        return transformers.Qwen2VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                                          video_token_id=4, vision_start_token_id=5, vision_end_token_id=6)
    if kind == "qwen2_5_vl":  # the same, with windowed attention over 2 x 2 merged tokens in its first layer
        vision = transformers.Qwen2_5_VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                                     patch_size=2, spatial_merge_size=2, temporal_patch_size=2,
                                                     window_size=8, out_hidden_size=HIDDEN,
                                                     fullatt_block_indexes=[1]).to_dict()
        return transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                                             video_token_id=4, vision_start_token_id=5, vision_end_token_id=6)
    # Pixtral: 16 patches of 2 x 2, merged 2 x 2 into 4 tokens
    vision = transformers.PixtralVisionConfig(**VISION, patch_size=2, head_dim=16).to_dict()
    return transformers.Mistral3Config(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                                       spatial_merge_size=2, vision_feature_layer=-1)


def wrapper(kind, seed=0, **text_overrides):
    """The unfused wrapper with random weights, every 1-d parameter perturbed (norm weights
    away from their initial values, as hf_models.make does) and every zero one made random
    (Gemma3's mm_input_projection_weight starts at zeros: no image would reach the logits)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(wrapper_config(kind, **text_overrides))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 or not p.any():
                p.add_(0.3 * torch.randn_like(p))
    return model


def image_batch(kind, b=2, t=12):
    """Text with one image (IMAGE_TOKENS placeholders after 3 tokens), left padding of 2 on
    the first row, and what the wrapper needs besides (labels ignoring the pads)."""
    g = generator(1)
    ids = torch.randint(6, SIZES["vocab_size"], (b, t), generator=g)
    ids[:, 3:3 + IMAGE_TOKENS] = IMAGE_TOKEN
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[0, :2] = SIZES["pad_token_id"]
    kw = dict(input_ids=ids, attention_mask=mask, pixel_values=torch.randn(b, 3, 8, 8, generator=g))
    if kind.startswith("qwen"):  # flattened patches (3 channels x 2 frames x 2 x 2) of a 1 x 4 x 4 grid per image
        kw["pixel_values"] = torch.randn(b * 16, 3 * 2 * 2 * 2, generator=g)
        kw["image_grid_thw"] = torch.tensor([[1, 4, 4]] * b)
        base = transformers.Qwen2VLModel if kind == "qwen2_vl" else transformers.Qwen2_5_VLModel
        if "mm_token_type_ids" in inspect.signature(base.forward).parameters:
            kw["mm_token_type_ids"] = (ids == IMAGE_TOKEN).long()  # where transformers asks which tokens are images
    if kind == "mistral3":
        kw["image_sizes"] = torch.tensor([[8, 8]] * b)
    if kind == "gemma3":  # the image's tokens attend to each other both ways
        kw["token_type_ids"] = (ids == IMAGE_TOKEN).long()
    return kw, ids.masked_fill(mask == 0, -100)


VISION_TOWER = ("model.vision_tower.", "model.visual.")  # (Qwen2-VL's name)


def _outside(model, inner):
    """{name: module class} of every module outside the language model `inner`: for the
    models around it, which fuse moves to a subclass of their own class (the Norms' init),
    the class it extends."""
    inside = {id(m) for m in inner.modules()}
    return {n: getattr(type(m), "_fuseblock_key", (type(m),))[0] for n, m in model.named_modules()
            if id(m) not in inside}


@pytest.mark.parametrize("kind", list(TEXT))
def test_wrapper_fuses_its_language_model_bitwise_on_text_and_image(kind):
    unfused = wrapper(kind)
    classes = _outside(unfused, unfused.model.language_model)
    fused = fuse(copy.deepcopy(unfused))
    inner = fused.model.language_model
    assert inner.fuseblock_family is not None and isinstance(inner.norm, Norm)
    assert not any(type(m).__name__.endswith("RMSNorm") for m in inner.modules())
    assert _outside(fused, inner) == classes  # vision tower, projector and their norms as they were
    # fuse moves the wrapper, its base model and its language model (and its layers) to subclasses
    moved = {n for n, m in fused.named_modules() if getattr(type(m), "_fuseblock_fused", False)}
    assert {n for n in moved if not n.startswith("model.language_model.")} == {"", "model", "model.language_model"}
    assert list(fused.state_dict()) == list(unfused.state_dict())
    kw, labels = image_batch(kind)
    outs = []
    for model in (unfused, fused):
        model.zero_grad(set_to_none=True)
        out = model(**kw, labels=labels, output_hidden_states=True)
        out.loss.backward()
        outs.append((out.logits, out.loss, {n: p.grad for n, p in model.named_parameters()}, out.hidden_states))
    a, b = outs
    assert torch.equal(b[0], a[0]) and torch.equal(b[1], a[1]), (max_diff(b[0], a[0]), max_diff(b[1], a[1]))
    assert b[2].keys() == a[2].keys()
    # the image went through the vision tower (Llava reads the last layer before CLIP's post_layernorm)
    assert any(a[2][n] is not None and a[2][n].abs().max() > 0 for n in a[2] if n.startswith(VISION_TOWER))
    differ = {n: max_diff(b[2][n], a[2][n]) for n in a[2]
              if (a[2][n] is None) != (b[2][n] is None) or (a[2][n] is not None and not torch.equal(b[2][n], a[2][n]))}
    assert not differ, differ
    assert len(a[3]) == len(b[3]) == SIZES["num_hidden_layers"] + 1
    assert all(torch.equal(x, y) for x, y in zip(b[3], a[3], strict=True))
    # the image changes the logits: the comparison covers the image path
    kw["pixel_values"] = kw["pixel_values"] + 1
    assert not torch.equal(fused(**kw).logits, b[0])


# Block scalars of other families' configs that no fused language model's code reads
STRAY = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, activation_dropout=0.1)


@pytest.mark.parametrize("kind", list(TEXT))
def test_wrapper_whose_text_config_holds_keys_nothing_reads_fuses(kind, tmp_path):
    """A wrapper whose text config holds STRAY fuses (once refused for them) and gives the
    unfused wrapper's logits and loss, bitwise, on text and image; pickled whole with
    torch.save it loads fused (its model, base model and language model fuse's classes)
    with the same logits."""
    unfused = wrapper(kind, **STRAY)
    assert all(getattr(unfused.model.language_model.config, k) == v for k, v in STRAY.items())
    fused = fuse(copy.deepcopy(unfused))
    assert fused.model.language_model.fuseblock_family is not None
    # saved before any forward: transformers' output-recording hooks, installed at the first
    # one, are local functions, which pickle refuses for the unfused model as well
    torch.save(fused, tmp_path / "fused.pt")
    loaded = torch.load(tmp_path / "fused.pt", weights_only=False)
    kw, labels = image_batch(kind)
    with torch.no_grad():
        a, b = (m(**kw, labels=labels) for m in (unfused, fused))
    assert torch.equal(b.logits, a.logits) and torch.equal(b.loss, a.loss), max_diff(b.logits, a.logits)
    assert all(type(m) is type(n) for m, n in ((loaded, fused), (loaded.model, fused.model),
                                               (loaded.model.language_model, fused.model.language_model)))
    assert type(loaded.model.language_model)._fuseblock_fused and type(loaded)._fuseblock_fused
    with torch.no_grad():
        assert torch.equal(loaded(**kw).logits, b.logits)


@pytest.mark.kernel
@pytest.mark.parametrize("kind", list(TEXT))
def test_wrapper_on_the_kernel_path_matches_the_unfused_one(kind):
    """As test_transformers.py's kernel-path test, on a text + image batch: the language
    model's norms on fuseblock's kernels (bitwise on the torch path, above)."""
    unfused = wrapper(kind)
    fused = fuse(copy.deepcopy(unfused))
    kw, labels = image_batch(kind)
    outs = []
    for model in (unfused, fused):
        out = model(**kw, labels=labels)
        out.loss.backward()
        outs.append((out.logits, out.loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    a, b = outs
    torch.testing.assert_close(b[0], a[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b[1], a[1], rtol=1e-5, atol=1e-5)
    assert b[2].keys() == a[2].keys()
    for name in a[2]:  # relative to each gradient's scale, as hf_models.rel
        scale = max(1.0, a[2][name].abs().max().item())
        torch.testing.assert_close(b[2][name] / scale, a[2][name] / scale, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", list(TEXT))
def test_wrapper_generates_as_the_unfused_one(kind):
    unfused = wrapper(kind)
    fused = fuse(copy.deepcopy(unfused))
    kw, _ = image_batch(kind)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=SIZES["pad_token_id"])
    a, b = unfused.generate(**kw, **gen), fused.generate(**kw, **gen)
    assert a.shape == (2, 18) and torch.equal(a, b)


@pytest.mark.parametrize("kind", list(TEXT))
def test_wrapper_checkpoints_load_both_ways(kind, tmp_path):
    unfused = wrapper(kind)
    fused = fuse(copy.deepcopy(unfused))
    with torch.no_grad():
        for p in fused.parameters():
            p.add_(0.01 * torch.randn_like(p))
    kw, _ = image_batch(kind)
    fused.save_pretrained(tmp_path / "fused")
    back = type(unfused).from_pretrained(tmp_path / "fused")
    assert list(back.state_dict()) == list(fused.state_dict())
    assert type(back.model.language_model.layers[0]) is type(unfused.model.language_model.layers[0])
    assert torch.equal(back(**kw).logits, fused(**kw).logits)
    unfused.save_pretrained(tmp_path / "unfused")
    loaded = fuse(type(unfused).from_pretrained(tmp_path / "unfused"))
    assert isinstance(loaded.model.language_model.norm, Norm)
    assert torch.equal(loaded(**kw).logits, unfused(**kw).logits)


def test_wrapper_init_weights_gives_the_language_model_norms_what_the_unfused_wrapper_gets():
    """Built on meta, fused there, to_empty and init_weights: every parameter, vision tower's
    included, equals the unfused wrapper's after the same steps (Gemma3: norms with 1 + w)."""
    config = wrapper_config("gemma3")
    cls = transformers.Gemma3ForConditionalGeneration
    unfused, fused = meta_pair(cls, config)
    a, b = unfused.state_dict(), fused.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    assert torch.equal(fused.model.language_model.norm.weight, torch.zeros(HIDDEN))


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("layout", ["none", "1-d", "3-d", "text + 3-d"])
def test_qwen2_vl_language_model_takes_its_position_ids_as_the_unfused_one(layout, kind):
    """Qwen2VLTextModel's position ids, each layout its forward takes: none (0 .. T-1 for all
    three M-RoPE sections), (B, T) (the same), (3, B, T) (temporal, height, width: what the
    wrapper gives for images), and (4, B, T), the text positions first (packed sequences,
    which the masks read): the fused language model's output equals the unfused one's."""
    unfused = wrapper(kind).model.language_model
    fused = fuse(copy.deepcopy(unfused))
    ids, mask, _ = batch()
    b, t = ids.shape
    text = torch.arange(t).expand(b, t)
    grid = torch.stack([text, text + torch.arange(t) % 3, text + torch.arange(t) % 2])  # differing sections
    packed = torch.arange(t) % (t // 2)  # two sequences of t / 2 tokens in each row
    kw = {"none": {}, "1-d": dict(position_ids=text), "3-d": dict(position_ids=grid),
          "text + 3-d": dict(position_ids=torch.cat([packed.expand(b, t)[None], grid]))}[layout]
    # packed: the masks come from the text positions, with no mask and no cache (training)
    kw.update(attention_mask=None if layout == "text + 3-d" else mask, use_cache=False)
    a = unfused(input_ids=ids, **kw).last_hidden_state
    c = fused(input_ids=ids, **kw).last_hidden_state
    assert torch.equal(c, a), max_diff(c, a)
    # what the layout's ids mean matters: the sections' positions (M-RoPE), the text positions (the packed masks)
    if layout in ("3-d", "text + 3-d"):
        other = dict(position_ids=text) if layout == "3-d" else dict(position_ids=torch.cat([text[None], grid]))
        assert not torch.equal(a, unfused(input_ids=ids, **{**kw, **other}).last_hidden_state)


def test_a_wrapper_fuse_has_not_checked_is_refused():
    vision = transformers.SiglipVisionConfig(**VISION, patch_size=2).to_dict()
    text = transformers.GemmaConfig(**{**SIZES, **TINY["gemma"]}).to_dict()
    model = transformers.PaliGemmaForConditionalGeneration(
        transformers.PaliGemmaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN))
    with pytest.raises(ValueError, match=r"PaliGemmaForConditionalGeneration \(model_type 'paligemma'\) is refused: a "
                                         r"multimodal wrapper fuse has not checked.*llava, gemma3, mistral3, qwen2_vl, "
                                         r"qwen2_5_vl"):
        fuse(model)
    assert not any(isinstance(m, Norm) for m in model.modules())
