"""fuse on Phi3 (residual dropout in the layer) and GPT-2 (its own names, Conv1D, absolute
positions), beyond the generic tests of test_transformers.py (which run both in eval mode).

Phi3 drops each branch before its add; fused, the add_norm drops it (dropout_p), drawing
its masks its own way on the kernel path. So in training the masks are not the unfused
model's, their distribution is: a probe sees each fused add drop a fraction p of a branch
of ones and scale the rest by 1/(1 - p), with independent masks per add, and the logits'
deviation from eval has the unfused model's mean and mean square over seeds. GPT-2's
dropouts all sit in modules fuse leaves untouched, so a seed gives it the unfused model's
masks: training is the unfused model's bitwise (torch path).
"""
import copy
import math
import statistics
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import KERNEL_PATH, generator  # noqa: E402
from hf_models import batch, make, max_diff, pair, run  # noqa: E402

from fuseblock import Norm  # noqa: E402
from fuseblock.integrations.transformers import fuse  # noqa: E402
from fuseblock.integrations.transformers.tiny import tiny_config  # noqa: E402

P = 0.1  # the tiny configs' resid_pdrop


def _equal_or_close(b, a):
    """Bitwise on the torch path (the unfused model's ops in its order); the kernels within 1e-5."""
    if KERNEL_PATH:
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(b, a), max_diff(b, a)


# ---------------------------------------------------------------------------- phi3: the dropout probe


def _probe(model, fused, ids):
    """drop(ones) of each branch add of one forward: every attention and MLP output is set
    to ones (forward hooks), and the add's r' - r is read off the fused norms' add calls
    (the unfused model's off its dropout modules). A list of (B, T, hidden) tensors in the
    order of the adds."""
    base = model.model
    seen, handles = [], []
    for layer in base.layers:
        handles.append(layer.self_attn.register_forward_hook(lambda m, a, out: (torch.ones_like(out[0]), out[1])))
        handles.append(layer.mlp.register_forward_hook(lambda m, a, out: torch.ones_like(out)))
        if not fused:
            for drop in (layer.resid_attn_dropout, layer.resid_mlp_dropout):
                handles.append(drop.register_forward_hook(lambda m, a, out: seen.append(out.detach())))
    norms = [n for layer in base.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)] + [base.norm]
    if fused:
        for norm in norms:
            def add(x, residual=None, *args, real=norm.add, **kwargs):
                out = real(x, residual, *args, **kwargs)
                if residual is not None:
                    seen.append((out[1] - residual).detach())
                return out
            norm.add = add  # an instance attribute: the fused layers call norm.add
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
        for norm in norms:
            norm.__dict__.pop("add", None)
    return seen


@pytest.mark.kernel
def test_phi3_each_fused_branch_add_drops_a_fraction_p_with_independent_masks():
    """b=4, t=32: 8192 elements per add. The dropped fraction of one add is within 5 sigma of
    p (sigma = sqrt(p(1-p)/8192) = 0.0033), the kept elements are 1/(1-p) (to fp32 rounding
    of r + 1/(1-p) - r, |r| < 10), and two adds drop the same element with probability p^2
    (sigma = 0.0011): a mask drawn once and reused would give p. Eval mode drops nothing."""
    unfused, fused = pair("phi3")
    ids = torch.randint(3, 128, (4, 32), generator=generator(2))
    n = ids.numel() * 64
    for model in (unfused, fused):
        model.train()
        drops = _probe(model, model is fused, ids)
        assert len(drops) == 4  # 2 layers x (attention, MLP)
        masks = []
        for d in drops:
            dropped = d.abs() < 0.5
            assert abs(dropped.double().mean().item() - P) < 5 * math.sqrt(P * (1 - P) / n)
            torch.testing.assert_close(d[~dropped], torch.full_like(d[~dropped], 1 / (1 - P)), rtol=0, atol=1e-5)
            assert (d[dropped] == 0).all() if model is unfused else (d[dropped].abs() < 1e-5).all()
            masks.append(dropped)
        for i in range(len(masks)):
            for j in range(i):
                both = (masks[i] & masks[j]).double().mean().item()
                assert abs(both - P * P) < 5 * math.sqrt(P * P * (1 - P * P) / n), (i, j, both)
    fused.eval()
    for d in _probe(fused, True, ids):
        torch.testing.assert_close(d, torch.ones_like(d), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------- phi3: the output's distribution


def _deviations(model, seeds, ids, mask):
    """Per seed, the mean and the mean square of (training logits - eval logits): iid over seeds."""
    with torch.no_grad():
        model.eval()
        ref = model(input_ids=ids, attention_mask=mask).logits
        model.train()
        found = []
        for s in seeds:
            torch.manual_seed(s)
            d = (model(input_ids=ids, attention_mask=mask).logits - ref).double()
            found.append((d.mean().item(), d.pow(2).mean().item()))
    model.eval()
    return found


def _same_mean(a, b, k=5.0):
    """|mean(a) - mean(b)| within k standard errors of the difference of two means of iid samples."""
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    return abs(statistics.fmean(a) - statistics.fmean(b)) <= k * se, (statistics.fmean(a), statistics.fmean(b), se)


@pytest.mark.kernel
def test_phi3_training_logits_deviate_from_eval_as_the_unfused_models_do():
    """16 seeds each (the fused model's not the unfused's, so its masks are independent of them
    on both paths): the mean and the mean square of (train - eval) logits agree within 5
    standard errors, from the seeds' own spread (mean square ~1.1, its sd ~0.11 per seed:
    5 se = 0.19). The test can fail: the unfused model at resid_pdrop 0.2 is 0.67 away."""
    unfused, fused = pair("phi3")
    ids, mask, _ = batch()
    u = _deviations(unfused, range(16), ids, mask)
    f = _deviations(fused, range(100, 116), ids, mask)
    for k in (0, 1):
        ok, found = _same_mean([x[k] for x in f], [x[k] for x in u])
        assert ok, (("mean", "mean square")[k], found)
    other = make("phi3", resid_pdrop=2 * P)  # the same weights (seed), twice the dropout
    twice = _deviations(other, range(200, 216), ids, mask)
    assert not _same_mean([x[1] for x in twice], [x[1] for x in u])[0]


@pytest.mark.torch_only("the torch path's add_norm drops with torch's own dropout, in the unfused model's order")
def test_phi3_training_on_the_torch_path_draws_the_unfused_models_masks():
    unfused, fused = pair("phi3")
    unfused.train(), fused.train()
    ids, mask, labels = batch()
    torch.manual_seed(7)
    a = run(unfused, ids, mask, labels, hidden=False)
    torch.manual_seed(7)
    b = run(fused, ids, mask, labels, hidden=False)
    assert torch.equal(b[0], a[0]) and torch.equal(b[1], a[1])
    assert all(torch.equal(b[2][n], a[2][n]) for n in a[2])
    torch.manual_seed(8)  # and another seed other masks: dropout is on
    assert not torch.equal(run(fused, ids, mask, labels, hidden=False)[0], a[0])


@pytest.mark.kernel
def test_phi3_gradient_checkpointing_redraws_the_forwards_masks():
    """Training with dropout: the recompute of a checkpointed layer must drop what its forward
    dropped (the kernels' seed comes from torch's generator, which checkpointing restores)."""
    _, fused = pair("phi3")
    plain = copy.deepcopy(fused)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.23 renames it activation_checkpointing_enable
        fused.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fused.train(), plain.train()
    ids, mask, labels = batch(t=6)
    torch.manual_seed(3)
    a = run(plain, ids, mask, labels, hidden=False)
    torch.manual_seed(3)
    b = run(fused, ids, mask, labels, hidden=False)
    assert torch.equal(b[1], a[1])
    for name in a[2]:
        torch.testing.assert_close(b[2][name], a[2][name], rtol=1e-6, atol=1e-7)


def test_phi3_hidden_states_while_training_with_dropout_are_refused_in_one_line():
    unfused, fused = pair("phi3")
    ids = batch()[0]
    fused.train()
    with pytest.raises(ValueError, match="output_hidden_states while training with residual dropout") as e:
        fused(input_ids=ids, output_hidden_states=True)
    assert "\n" not in str(e.value)
    fused.eval()  # eval mode, or training without dropout, records them
    assert len(fused(input_ids=ids, output_hidden_states=True).hidden_states) == 3
    unfused, fused = pair("phi3", resid_pdrop=0.0)
    unfused.train(), fused.train()
    a, b = (m(input_ids=ids, output_hidden_states=True).hidden_states for m in (unfused, fused))
    assert all(torch.equal(x, y) for x, y in zip(b, a, strict=True))


def test_phi3_embedding_dropout_is_unused_as_in_the_unfused_model():
    """Phi3Model ignores config.embd_pdrop (its forward has no embedding dropout); the fused
    forward reads it as that: training without residual dropout is deterministic and equal."""
    unfused, fused = pair("phi3", resid_pdrop=0.0, embd_pdrop=0.5)
    unfused.train(), fused.train()
    ids = batch()[0]
    torch.manual_seed(1)
    a = unfused(input_ids=ids).logits
    torch.manual_seed(2)
    assert torch.equal(unfused(input_ids=ids).logits, a)  # no dropout anywhere: the premise
    _equal_or_close(fused(input_ids=ids).logits, a)


# ---------------------------------------------------------------------------- gpt2


@pytest.mark.kernel
def test_gpt2_training_with_dropout_draws_the_unfused_models_masks():
    """Every GPT-2 dropout (embeddings, attention weights, the branches' resid_pdrop) is in a
    module fuse leaves untouched, drawn in the unfused order, and the fused ops draw none."""
    unfused, fused = pair("gpt2")
    unfused.train(), fused.train()
    ids, mask, labels = batch()
    torch.manual_seed(7)
    a = run(unfused, ids, mask, labels)
    torch.manual_seed(7)
    b = run(fused, ids, mask, labels)
    _equal_or_close(b[0], a[0])
    _equal_or_close(b[1], a[1])
    for name in a[2]:
        _equal_or_close(b[2][name], a[2][name])
    for x, y in zip(b[3], a[3], strict=True):
        _equal_or_close(x, y)
    with torch.no_grad():  # dropout is on: another seed, other logits
        torch.manual_seed(8)
        assert not torch.equal(fused(input_ids=ids, attention_mask=mask).logits, b[0])


def test_gpt2_cross_attention_is_refused():
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("gpt2", add_cross_attention=True))
    with pytest.raises(ValueError, match=r"model_type 'gpt2'\) is not the layout .*does not know "
                                         r"\(crossattention, ln_cross_attn\).*config.add_cross_attention = True"):
        fuse(model)
    assert not any(isinstance(m, Norm) for m in model.modules())


@pytest.mark.kernel
def test_gpt2_token_types_are_added_as_the_unfused_model_adds_them():
    """token_type_ids: GPT2Model adds their wte rows after the position embeddings, before
    the embedding dropout; the fused model the same: logits, loss and every gradient (wte's
    takes the token types' share) bitwise on the torch path, and (batch, choices, T) token
    types of GPT2DoubleHeadsModel as well."""
    unfused, fused = pair("gpt2")
    ids, mask, labels = batch()
    types = torch.randint(0, 3, ids.shape, generator=generator(3))
    with torch.no_grad():  # the premise: the unfused model reads them
        assert not torch.equal(unfused(input_ids=ids, token_type_ids=types).logits, unfused(input_ids=ids).logits)
    out = []
    for model in (unfused, fused):
        model.zero_grad(set_to_none=True)
        o = model(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
        o.loss.backward()
        out.append((o.logits, o.loss, {n: p.grad for n, p in model.named_parameters()}))
    (la, lossa, ga), (lb, lossb, gb) = out
    _equal_or_close(lb, la)
    _equal_or_close(lossb, lossa)
    assert ga.keys() == gb.keys()
    for name in ga:
        _equal_or_close(gb[name], ga[name])
    config = tiny_config("gpt2")
    torch.manual_seed(0)
    heads = transformers.GPT2DoubleHeadsModel(config).eval()
    fused_heads = fuse(copy.deepcopy(heads))
    kw = dict(input_ids=ids.view(1, 2, -1), attention_mask=mask.view(1, 2, -1), token_type_ids=types.view(1, 2, -1),
              mc_token_ids=torch.tensor([[11, 11]]))
    with torch.no_grad():
        a, b = heads(**kw), fused_heads(**kw)
    _equal_or_close(b.logits, a.logits)
    _equal_or_close(b.mc_logits, a.mc_logits)


def test_gpt2_encoder_states_are_refused_in_one_line():
    _, fused = pair("gpt2")
    ids = batch()[0]
    for name, value in (("encoder_hidden_states", torch.zeros(2, 3, 64)), ("encoder_attention_mask", torch.ones(2, 3))):
        with pytest.raises(ValueError, match=f"GPT2Model on the fused stream takes no {name}") as e:
            fused(input_ids=ids, **{name: value})
        assert "\n" not in str(e.value)


def test_gpt2_model_signature_and_double_heads():
    """GPT2Model's positional order (past_key_values second), and GPT2DoubleHeadsModel's
    (batch, choices, T) ids, which GPT2Model runs as one batch and returns in their shape."""
    unfused, fused = pair("gpt2")
    ids, mask, _ = batch()
    with torch.no_grad():
        a = unfused.transformer(ids, None, mask).last_hidden_state
        assert torch.equal(fused.transformer(ids, None, mask).last_hidden_state, a)
    config = tiny_config("gpt2")
    torch.manual_seed(0)
    heads = transformers.GPT2DoubleHeadsModel(config).eval()
    fused_heads = fuse(copy.deepcopy(heads))
    choices = ids.view(1, 2, -1)
    cls = torch.tensor([[11, 11]])
    with torch.no_grad():
        a, b = (m(input_ids=choices, attention_mask=mask.view(1, 2, -1), mc_token_ids=cls)
                for m in (heads, fused_heads))
    assert b.logits.shape == (1, 2, ids.shape[1], 128)
    assert torch.equal(b.logits, a.logits) and torch.equal(b.mc_logits, a.mc_logits)


def test_gpt2_registered_with_llamas_forward_is_refused(monkeypatch):
    import fuseblock.integrations.transformers.fusion as fusion

    model = make("gpt2")
    monkeypatch.setattr(fusion, "FAMILIES", {**fusion.FAMILIES, "gpt2": fusion.FAMILIES["llama"]})
    with pytest.raises(ValueError, match=r"GPT2Model holds modules the fused forward does not know \(drop, h, "
                                         r"ln_f, wpe, wte\) and lacks embed_tokens, layers, norm, rotary_emb"):
        fuse(model)
