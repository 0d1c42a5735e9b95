"""The pre-norm families under Llama's names beyond Llama's own (ministral, mixtral, qwen2_moe,
qwen3_moe, smollm3, helium, granite): what each adds to Llama's layout, fused against the
unfused model. test_transformers.py runs every family through the generic guarantees; here
the family-specific ones: the MoE families' router logits and auxiliary loss, Granite's
scaled branch and embeddings at several multipliers (and a per-layer scale refused),
SmolLM3's NoPE and sliding layers, Ministral's mixed layer types, Mixtral's router jitter
in training. The torch path is bitwise; tests marked kernel also run the Triton kernels.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import KERNEL_PATH  # noqa: E402
from hf_models import batch, make, max_diff, pair, run  # noqa: E402

from fuseblock import Norm  # noqa: E402
from fuseblock.integrations.transformers import FAMILIES, fuse  # noqa: E402

MOE = [f for f in ("mixtral", "qwen2_moe", "qwen3_moe") if f in FAMILIES]


def assert_same_run(a, b, *, exact=True):
    """(logits, loss, grads, hidden states) of run(): bitwise on the torch path, else within
    the kernel path's 1e-5 relative (the loss) and 1e-4 (logits, grads, hidden states)."""
    def same(x, y, tol):
        if exact:
            assert torch.equal(x, y), max_diff(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=tol, atol=tol)

    same(b[0], a[0], 1e-4)
    same(b[1], a[1], 1e-5)
    assert b[2].keys() == a[2].keys()
    for name in a[2]:
        same(b[2][name], a[2][name], 1e-4)
    if a[3] is not False:
        assert len(a[3]) == len(b[3])
        for x, y in zip(a[3], b[3], strict=True):
            same(y, x, 1e-4)


# ---------------------------------------------------------------------------- MoE


def sparse_blocks(model):
    """The layers whose mlp routes tokens (a router in it), in order."""
    return [layer for layer in model.model.layers if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")]


@pytest.mark.parametrize("where", ["argument", "config"])
@pytest.mark.parametrize("arch", MOE)
def test_router_logits_aux_loss_and_total_loss_match_the_unfused_model(arch, where):
    """output_router_logits (as the forward's argument, or the config's): each routing
    layer's router logits, the load-balancing loss and the total loss (cross entropy + coef *
    aux) are the unfused model's, bitwise, and so is every gradient (the routers' through
    the aux loss too: coef 1)."""
    unfused, fused = pair(arch, layers=3, router_aux_loss_coef=1.0, output_router_logits=where == "config")
    kw = {"output_router_logits": True} if where == "argument" else {}
    ids, mask, labels = batch()
    out = {}
    for name, model in (("unfused", unfused), ("fused", fused)):
        model.zero_grad(set_to_none=True)
        o = model(input_ids=ids, attention_mask=mask, labels=labels, **kw)
        o.loss.backward()
        out[name] = o, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    (a, ga), (b, gb) = out["unfused"], out["fused"]
    n_routers = len(sparse_blocks(unfused))
    assert n_routers == len(sparse_blocks(fused)) >= 2
    assert len(a.router_logits) == len(b.router_logits) == n_routers
    for x, y in zip(a.router_logits, b.router_logits, strict=True):
        experts = sparse_blocks(unfused)[0].mlp.gate.weight.shape[0]
        assert x.shape == (ids.numel(), experts) and torch.equal(x, y), max_diff(x, y)
    assert a.aux_loss > 0 and torch.equal(a.aux_loss, b.aux_loss)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.logits, b.logits)
    routers = [n for n in ga if ".mlp.gate." in n]
    assert len(routers) == n_routers and all(ga[n].abs().sum() > 0 for n in routers)
    assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)
    # without the argument and the config, no router logits and no aux loss, on both
    if where == "argument":
        plain = fused(input_ids=ids, attention_mask=mask, labels=labels)
        assert plain.router_logits is None and plain.aux_loss is None
        assert torch.equal(plain.loss, unfused(input_ids=ids, attention_mask=mask, labels=labels).loss)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("arch", MOE)
def test_router_logits_under_gradient_checkpointing(arch, reentrant):
    """Checkpointed layers in training: the recomputation records no second set of router
    logits (the hooks record inside the forward only), on the fused model as on the
    unfused one: the same count, aux loss, loss and gradients, bitwise."""
    import warnings

    unfused, fused = pair(arch, layers=3, router_aux_loss_coef=1.0)
    ids, mask, labels = batch()
    out = []
    for model in (unfused, fused):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # 5.23 renames it activation_checkpointing_enable
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        o = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        o.loss.backward()
        out.append((o, {n: p.grad for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = out
    assert len(a.router_logits) == len(b.router_logits) == len(sparse_blocks(unfused))
    assert torch.equal(a.aux_loss, b.aux_loss) and torch.equal(a.loss, b.loss)
    assert all(torch.equal(ga[n], gb[n]) for n in ga)


def test_qwen2_moe_shared_expert_and_gate_are_the_mlps_own():
    """Qwen2-MoE's shared expert and its sigmoid gate live inside the layer's mlp (fuse leaves
    it whole): the layer holds Llama's four modules and nothing else, the MoE block is the
    unfused one's class, and their gradients are bitwise the unfused ones."""
    unfused, fused = pair("qwen2_moe")
    layer = fused.model.layers[0]
    assert set(layer._modules) == {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
    assert type(layer.mlp) is type(unfused.model.layers[0].mlp)
    assert {"shared_expert", "shared_expert_gate", "gate", "experts"} <= set(layer.mlp._modules)
    ids, mask, labels = batch()
    a, b = run(unfused, ids, mask, labels), run(fused, ids, mask, labels)
    assert_same_run(a, b)
    shared = [n for n in a[2] if "shared_expert" in n]
    assert shared and all(a[2][n].abs().sum() > 0 for n in shared)


@pytest.mark.kernel
def test_mixtral_router_jitter_in_training_draws_what_the_unfused_model_draws():
    """Mixtral's router jitter (training) multiplies the MoE block's input in place by
    uniform noise: the fused model takes the same draws in the same order (the same seed
    gives the same noise), and the in-place product on the fused norm's output leaves
    autograd right. Torch path bitwise, kernel path within 1e-5 relative on the loss."""
    unfused, fused = pair("mixtral", router_jitter_noise=0.3)
    unfused.train(), fused.train()
    ids, mask, labels = batch()
    torch.manual_seed(7)
    a = run(unfused, ids, mask, labels, hidden=False)
    torch.manual_seed(7)
    b = run(fused, ids, mask, labels, hidden=False)
    assert_same_run(a, b, exact=not KERNEL_PATH)
    torch.manual_seed(8)  # the noise changes the result: the comparison above saw it
    assert not torch.equal(run(unfused, ids, mask, labels, hidden=False)[1], a[1])


# ---------------------------------------------------------------------------- Granite


@pytest.mark.parametrize("residual, embedding", [(0.22, 12.0), (1.0, 1.0), (2.5, 0.5), (1.0, 3.0), (0.5, 1.0)])
def test_granite_scaled_branch_and_embeddings_at_several_multipliers(residual, embedding):
    """r + residual_multiplier * b at every add (add_norm's alpha) and the embeddings times
    embedding_multiplier before layer 0: logits, loss, every gradient and hidden state
    bitwise the unfused model's, the first hidden state the scaled embeddings."""
    unfused, fused = pair("granite", residual_multiplier=residual, embedding_multiplier=embedding)
    assert {layer.residual_multiplier for layer in fused.model.layers} == {residual}
    ids, mask, labels = batch()
    a, b = run(unfused, ids, mask, labels), run(fused, ids, mask, labels)
    assert_same_run(a, b)
    assert torch.equal(b[3][0], fused.model.embed_tokens(ids) * embedding)


def test_granite_given_embeddings_are_scaled_as_the_unfused_model_scales_them():
    """GraniteModel.forward multiplies inputs_embeds given by the caller too."""
    unfused, fused = pair("granite")
    ids, mask, _ = batch()
    embeds = unfused.model.embed_tokens(ids).detach()
    a = unfused(inputs_embeds=embeds, attention_mask=mask).logits
    b = fused(inputs_embeds=embeds, attention_mask=mask).logits
    assert torch.equal(a, b)
    assert not torch.equal(b, fused(inputs_embeds=embeds * 12.0, attention_mask=mask).logits)


def test_granite_layers_with_different_residual_multipliers_are_refused():
    """The branch scale is read off the layer that receives p (layers.py), so it must be
    one for all layers: a model whose layers differ is refused, left as it was."""
    model = make("granite", layers=3)
    model.model.layers[1].residual_multiplier = 0.5
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"model_type 'granite'\).*its layers' residual_multiplier differ "
                                         r"\(\[0\.22, 0\.5\]\)"):
        fuse(model)
    assert not any(isinstance(m, Norm) for m in model.modules())
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())


# ---------------------------------------------------------------------------- layer types


@pytest.mark.parametrize("sliding, interval", [(True, 2), (False, 2), (False, 4), (True, 4)])
def test_smollm3_nope_and_sliding_layers(sliding, interval):
    """SmolLM3: every `interval`-th layer without rotary embedding (NoPE: the attention's
    use_rope), and with use_sliding_window those layers sliding (config.layer_types, one mask
    per type): fp32 bitwise and the same greedy generation with the cache past the window."""
    unfused, fused = pair("smollm3", use_sliding_window=sliding, no_rope_layer_interval=interval, sliding_window=4)
    nope = [i for i, layer in enumerate(fused.model.layers) if not layer.self_attn.use_rope]
    assert nope == ([1] if interval == 2 else [])
    assert fused.config.layer_types == ["full_attention", "sliding_attention" if sliding and nope else "full_attention"]
    ids, mask, labels = batch()
    assert_same_run(run(unfused, ids, mask, labels), run(fused, ids, mask, labels))
    ids, mask, _ = batch(t=6)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(unfused.generate(ids, **kw), fused.generate(ids, **kw))


@pytest.mark.parametrize("kinds", [["full_attention", "sliding_attention"], ["sliding_attention", "full_attention"]])
def test_ministral_mixed_layer_types(kinds):
    """Ministral's layer_types: a sliding layer and a full one each get their own mask
    (a window of 4 tokens, shorter than the sequence): fp32 bitwise, and greedy generation
    with the cache and left padding (generate's masks by layer type) the same."""
    unfused, fused = pair("ministral", layer_types=kinds, sliding_window=4)
    ids, mask, labels = batch()
    assert_same_run(run(unfused, ids, mask, labels), run(fused, ids, mask, labels))
    ids, mask, _ = batch(t=8)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(unfused.generate(ids, **kw), fused.generate(ids, **kw))
