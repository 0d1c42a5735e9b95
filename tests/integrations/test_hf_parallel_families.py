"""The parallel stream shape and the families with LayerNorms and dropout (olmo, stablelm,
starcoder2, gpt_neox, cohere, phi) beyond test_transformers.py's generic tests: both
settings of use_parallel_residual (GPT-NeoX, StableLM), the parallel shape's op count,
and training mode with dropout, compared by its statistics (the fused add draws its own
masks: the same distribution is required, not the same masks)."""
import copy
import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from helpers import generator  # noqa: E402
from hf_models import HIDDEN, batch, make, max_diff, pair, run  # noqa: E402

import fuseblock.modules.norm  # noqa: E402
from fuseblock.integrations.transformers import fuse  # noqa: E402

SETTINGS = [("gpt_neox", True), ("gpt_neox", False), ("stablelm", True), ("stablelm", False)]


def _layers(model):
    return model.base_model.layers


# ---------------------------------------------------------------------------- both settings


@pytest.mark.parametrize("arch, parallel", SETTINGS)
def test_both_parallel_residual_settings_are_bitwise_the_unfused_model(arch, parallel):
    """Each setting takes its own shape (the variant of its entry) and is bitwise the unfused
    model in fp32: logits, loss, every gradient, hidden states; greedy generation with the
    KV cache and left padding (GPT-NeoX's attention takes the cache as layer_past)."""
    unfused, fused = pair(arch, use_parallel_residual=parallel)
    family = fused.base_model.fuseblock_family
    assert family.shape.name == ("parallel" if parallel else "pre-norm")
    if arch == "stablelm":  # its per-head LayerNorms inside the attention stay as they are
        assert type(_layers(fused)[0].self_attn.q_layernorm.norms[0]) is torch.nn.LayerNorm
    assert family.requires == {"use_parallel_residual": parallel}
    ids, mask, labels = batch()
    a, b = run(unfused, ids, mask, labels), run(fused, ids, mask, labels)
    assert torch.equal(b[0], a[0]) and torch.equal(b[1], a[1]), (max_diff(b[0], a[0]), max_diff(b[1], a[1]))
    assert all(torch.equal(b[2][n], a[2][n]) for n in a[2])
    assert all(torch.equal(x, y) for x, y in zip(b[3], a[3], strict=True))
    ids, mask, _ = batch(t=8)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(unfused.generate(ids, **kw), fused.generate(ids, **kw))


def test_a_parallel_config_under_the_sequential_entry_is_refused(monkeypatch):
    """GPT-NeoX's two layouts hold the same modules: only the config tells them apart, and
    the check holds each entry to the use_parallel_residual it computes."""
    import fuseblock.integrations.transformers.families as families
    import fuseblock.integrations.transformers.fusion as fusion

    sequential = families._GPT_NEOX[False]
    monkeypatch.setattr(fusion, "FAMILIES", {**fusion.FAMILIES, "gpt_neox": sequential.__class__(
        sequential.shape, sequential.parts, sequential.model_parts, reads=sequential.reads, dropout=sequential.dropout,
        embed=sequential.embed, prepare=sequential.prepare, cache_keyword=sequential.cache_keyword,
        requires=sequential.requires)})  # the sequential entry without its variant
    model = make("gpt_neox", use_parallel_residual=True)
    with pytest.raises(ValueError, match=r"config.use_parallel_residual = True, where its fused forward \(pre-norm\) "
                                         r"takes False"):
        fuse(model)


# ---------------------------------------------------------------------------- the parallel shape's ops


PARALLEL = [("gpt_neox", {}), ("stablelm", dict(use_parallel_residual=True)), ("cohere", {}), ("phi", {})]


@pytest.mark.parametrize("arch, overrides", PARALLEL, ids=[a for a, _ in PARALLEL])
def test_a_parallel_layer_is_one_add_norm_with_x1(arch, overrides, monkeypatch):
    """n layers: the embeddings enter at layer 0's norm with no residual; each later layer's
    input norm, and the final norm, add the previous layer's two branch outputs (x and x1)
    in one add_norm: n of them. GPT-NeoX's second norm of r is one plain norm a layer. No
    residual add outside them; the unfused model makes 2 adds a layer."""
    n = 3
    unfused, fused = pair(arch, layers=n, **overrides)
    calls, inside = [], [0]
    real = fuseblock.modules.norm.add_norm

    def counting(x, residual, *args, **kwargs):
        calls.append((residual is not None, kwargs.get("x1") is not None))
        inside[0] += 1
        try:
            return real(x, residual, *args, **kwargs)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(fuseblock.modules.norm, "add_norm", counting)
    ids = batch()[0]
    adds, hidden = [], (*ids.shape, HIDDEN)

    class Adds(TorchDispatchMode):
        """The adds of the hidden state's shape outside fuseblock's add_norm."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not inside[0] and func.overloadpacket is torch.ops.aten.add and getattr(out, "shape", None) == hidden:
                adds.append(func)
            return out

    with torch.no_grad():
        with Adds():
            unfused(ids)
        assert len(adds) == 2 * n and not calls  # the counter sees the unfused model's adds
        adds.clear()
        with Adds():
            fused(ids)
    assert not adds
    assert calls.count((True, True)) == n  # every residual add: one add_norm with x1
    assert calls.count((True, False)) == 0
    second_norms = n if arch == "gpt_neox" else 0
    assert calls.count((False, False)) == 1 + second_norms  # the embeddings' entry, GPT-NeoX's norm_2 of r
    assert len(calls) == n + 1 + second_norms


def test_the_residual_first_order_is_bitwise_and_the_other_is_not():
    """Cohere sums (r + attn) + mlp; add_norm sums (x + x1) + residual. With r in the x slot
    (PARALLEL_RESIDUAL_FIRST) the layer outputs are bitwise the unfused sums; summed as
    (mlp + attn) + r they are not (the check that the order matters at all)."""
    g = generator(0)
    r, a, m = (torch.randn(4096, generator=g) * s for s in (30.0, 1.0, 1e-2))
    assert torch.equal((r + a) + m, r + a + m) and not torch.equal((m + a) + r, r + a + m)
    norm = fuseblock.Norm(4096, kind="layer")
    assert torch.equal(norm.add(r, m, x1=a)[1], r + a + m)


# ---------------------------------------------------------------------------- training: dropout


def _dropout_modules(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]


def _train_minus_eval(model, ids, seeds):
    """(mean(D), mean(D^2)) per seed, D = logits in training mode - logits in eval mode."""
    with torch.no_grad():
        model.eval()
        ref = model(ids).logits.double()
        model.train()
        out = []
        for s in seeds:
            torch.manual_seed(s)
            d = model(ids).logits.double() - ref
            out.append((d.mean().item(), (d * d).mean().item()))
        model.eval()
    return torch.tensor(out, dtype=torch.float64)


DROPPING = [("gpt_neox", dict(use_parallel_residual=True)), ("gpt_neox", dict(use_parallel_residual=False)),
            ("stablelm", dict(use_parallel_residual=True)), ("stablelm", dict(use_parallel_residual=False)),
            ("phi", {}), ("starcoder2", {})]


@pytest.mark.parametrize("arch, overrides", DROPPING, ids=[f"{a}-{o}" if o else a for a, o in DROPPING])
def test_training_mode_dropout_has_the_unfused_models_statistics(arch, overrides):
    """D = logits(train) - logits(eval) over 32 seeds each: the fused model's mean of D and of
    D^2 equal the unfused model's within 4 standard errors of the difference (the
    standard errors estimated from the per-seed spread of each model: a false failure ~1e-4).
    The fused add draws its own masks, so values differ; what must not differ is the
    distribution. The test can tell: the fused model with its dropout at 0.2 instead of 0.1
    is outside the same bound."""
    unfused, fused = pair(arch, **overrides)
    ids = batch(b=4, t=12)[0]
    a = _train_minus_eval(unfused, ids, range(32))
    b = _train_minus_eval(fused, ids, range(1000, 1032))
    assert a[:, 1].min() > 0  # dropout acted

    def far(x, y):
        se = (x.var(0) / len(x) + y.var(0) / len(y)).sqrt()
        return ((x.mean(0) - y.mean(0)).abs() / se).max().item()

    assert far(b, a) < 4.0, far(b, a)
    for m in _dropout_modules(fused):  # the branch dropouts the fused add reads (and any the layers apply)
        m.p = 0.2
    for m in fused.modules():
        if hasattr(m, "residual_dropout") and isinstance(m.residual_dropout, float):  # Starcoder2's, inside modules
            m.residual_dropout = 0.2
    if hasattr(fused.base_model, "embedding_dropout"):
        fused.base_model.embedding_dropout = 0.2
    wrong = _train_minus_eval(fused, ids, range(2000, 2032))
    assert far(wrong, a) > 4.0, far(wrong, a)


@pytest.mark.kernel
@pytest.mark.parametrize("arch, overrides", [("gpt_neox", {}), ("phi", {}), ("gpt_neox",
                                                                              dict(use_parallel_residual=False))],
                         ids=["gpt_neox", "phi", "gpt_neox-sequential"])
def test_the_fused_add_drops_each_branch_with_p_independently(arch, overrides, monkeypatch):
    """In a training step, each add_norm with dropout: where new_residual - residual is 0 x was
    dropped, where it is x1 / (1 - p) only x was, and so on. Over all adds, each branch's
    dropped fraction is p and both are dropped with p^2 (independent masks), each within 5
    binomial standard deviations; every element is one of the four cases."""
    p = 0.1
    _, fused = pair(arch, **overrides)
    seen = []
    real = fuseblock.modules.norm.add_norm

    def recording(x, residual, *args, **kwargs):
        out = real(x, residual, *args, **kwargs)
        if kwargs.get("dropout_p", 0.0):
            assert kwargs["dropout_p"] == p
            seen.append((x.detach(), None if kwargs.get("x1") is None else kwargs["x1"].detach(),
                         residual.detach(), out[1].detach()))
        return out

    monkeypatch.setattr(fuseblock.modules.norm, "add_norm", recording)
    fused.train()
    ids, mask, labels = batch(b=4, t=12)
    for s in range(3):
        torch.manual_seed(s)
        fused(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert seen
    counts, n = torch.zeros(2, 2, dtype=torch.float64), 0
    for x, x1, r, new in seen:
        got = new.double() - r.double()
        x1 = torch.zeros_like(x) if x1 is None else x1
        cases = torch.stack([(kx * x.double() + k1 * x1.double()) / (1 - p) for kx in (0, 1) for k1 in (0, 1)])
        err = (cases - got).abs()
        which = err.argmin(0)
        assert (err.min(0).values <= 1e-4 * (1 + got.abs())).all()  # every element is one of the four cases
        for kx in (0, 1):
            for k1 in (0, 1):
                counts[kx, k1] += (which == 2 * kx + k1).sum()
        n += x.numel()
    frac = counts / n
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(frac[0].sum() - p) < 5 * sd, frac  # x dropped
    if seen[0][1] is not None:
        assert abs(frac[:, 0].sum() - p) < 5 * sd, frac  # x1 dropped
        assert abs(frac[0, 0] - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / n), frac  # both: independent


@pytest.mark.parametrize("arch", ["stablelm", "gpt_neox"])
def test_branch_dropouts_the_add_cannot_share_are_the_layers_own_exactly(arch):
    """add_norm takes one dropout_p for x and x1. StableLM's parallel layer drops its MLP's
    output alone, and a GPT-NeoX whose two branch dropouts differ (0.1 and 0.2) cannot share
    one: the fused layer applies its own dropout modules, in the unfused layer's order of
    random draws, so training mode is bitwise the unfused model under one seed, hidden
    states included."""
    unfused, fused = pair(arch, use_parallel_residual=True)
    if arch == "gpt_neox":
        for model in (unfused, fused):
            for layer in _layers(model):
                layer.post_mlp_dropout.p = 0.2
    unfused.train(), fused.train()
    ids, mask, labels = batch()
    torch.manual_seed(3)
    a = run(unfused, ids, mask, labels)
    torch.manual_seed(3)
    b = run(fused, ids, mask, labels)
    assert not torch.equal(a[0], run(unfused.eval(), ids, mask, labels)[0])  # dropout acted
    assert torch.equal(b[0], a[0]) and torch.equal(b[1], a[1])
    assert all(torch.equal(b[2][n], a[2][n]) for n in a[2])
    assert all(torch.equal(x, y) for x, y in zip(b[3], a[3], strict=True))


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_replays_the_fused_dropout(reentrant):
    """Checkpointing recomputes a layer with the RNG state of its forward: the fused add's
    masks (drawn from a seed it takes from torch's generator) are the same, so a fused model
    with checkpointing equals one without, bitwise, in training with dropout."""
    _, fused = pair("gpt_neox")
    ckpt = copy.deepcopy(fused)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.23 renames it activation_checkpointing_enable
        ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    fused.train(), ckpt.train()
    ids, mask, labels = batch()
    results = []
    for model in (fused, ckpt):
        torch.manual_seed(7)
        results.append(run(model, ids, mask, labels, hidden=False))
    (la, lossa, ga, _), (lb, lossb, gb, _) = results
    assert torch.equal(la, lb) and torch.equal(lossa, lossb)
    assert all(torch.equal(ga[n], gb[n]) for n in ga)
