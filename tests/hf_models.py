"""The Hugging Face models the integration tests share: fuseblock's tiny config of a
family with random weights (make), its fused twin (pair), a padded batch, and one
forward + backward (run), with the distances the tests hold them to."""
import copy
import os
from contextlib import nullcontext

import torch
import transformers
from helpers import DEVICE, generator
from torch.utils._python_dispatch import TorchDispatchMode

import fuseblock.modules.norm
from fuseblock.integrations.transformers import fuse
from fuseblock.integrations.transformers.tiny import SIZES, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN, LAYERS, VOCAB = SIZES["hidden_size"], SIZES["num_hidden_layers"], SIZES["vocab_size"]
T = 12  # sequence length


def make(arch, *, layers=LAYERS, seed=0, **overrides):
    """The unfused model with random weights (fuseblock's tiny config of the family): every
    norm weight perturbed too (transformers initializes them to the identity), so a
    misplaced or missing norm shows. In eval mode, as from_pretrained gives it: the tiny
    configs set their dropouts above 0, and the comparisons of fused and unfused models are
    of one function (tests of training mode call .train() and compare statistics, or zero
    the dropouts)."""
    config = tiny_config(arch, num_hidden_layers=layers, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def pair(arch, **kw):
    model = make(arch, **kw)
    return model, fuse(copy.deepcopy(model))


def batch(seed=1, b=2, t=T):
    """Token ids, an attention mask with left padding on the first row, labels ignoring the pads."""
    g = generator(seed)
    ids = torch.randint(3, VOCAB, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, :3] = 0
    ids[0, :3] = SIZES["pad_token_id"]
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def run(model, ids, mask, labels, hidden=True, **inputs):
    """(logits, loss, {name: grad}, hidden states or None) of one forward and backward (with
    any other `inputs`: pixel values, say); the grads of the parameters that get one (a MoE's
    experts no token of the batch reaches, DeepSeek-V3's routing bias, get none: the key sets
    of two runs are compared)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=hidden, **inputs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in getattr(model, "_orig_mod", model).named_parameters()
             if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads, hidden and [h.detach() for h in out.hidden_states]


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


def rel(a, b):
    """|a - b| / max(1, |b|), the largest over the tensor: an error scaled as assert_close scales its atol."""
    return max_diff(a, b) / max(1.0, b.double().abs().max().item())


def assert_same(b, a, exact):
    """b is a bit for bit (exact), else within 1e-5 of a's scale (rel)."""
    if exact:
        assert torch.equal(b, a), max_diff(b, a)
    else:
        assert b.shape == a.shape and rel(b, a) <= 1e-5, rel(b, a)


def assert_same_run(b, a, exact=True, states=None):
    """Two `run`s the same (assert_same): logits, loss, every gradient, and the hidden states
    when they were asked for (`states` of them)."""
    for x, y in zip(b[:2], a[:2], strict=True):
        assert_same(x, y, exact)
    assert b[2].keys() == a[2].keys()
    for name, g in a[2].items():
        assert_same(b[2][name], g, exact)
    if a[3] is not False:
        assert len(b[3]) == len(a[3]) == states
        for x, y in zip(b[3], a[3], strict=True):
            assert_same(x, y, exact)


def assert_generation_equal(unfused, fused, ids, mask):
    """Greedy generation with the cache, 4 tokens after a left-padded batch: the same tokens."""
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    a, b = unfused.generate(ids, **kw), fused.generate(ids, **kw)
    assert a.shape == (ids.shape[0], ids.shape[1] + 4) and torch.equal(a, b)


def assert_checkpoints_load_both_ways(unfused, fused, ids, path, layers=lambda m: m.model.layers):
    """save_pretrained of the fused model (moved away from the unfused one first) has the
    unfused model's keys and loads as the unfused class, the same logits; an unfused
    checkpoint loads and fuses to the unfused model's logits. `layers`: a model's decoder layers."""
    from safetensors.torch import load_file

    with torch.no_grad():
        for p in fused.parameters():
            p.add_(0.01 * torch.randn_like(p))
    fused.save_pretrained(path / "fused")
    unfused.save_pretrained(path / "unfused")
    assert load_file(path / "fused" / "model.safetensors").keys() == \
        load_file(path / "unfused" / "model.safetensors").keys()
    back = type(unfused).from_pretrained(path / "fused").eval()
    assert type(layers(back)[0]) is type(layers(unfused)[0])
    loaded = fuse(type(unfused).from_pretrained(path / "unfused").eval())
    with torch.no_grad():
        assert torch.equal(back(ids).logits, fused(ids).logits)
        assert torch.equal(loaded(ids).logits, unfused(ids).logits)


def differences(arch, dtype=torch.float32, *, residual_dtype=None, autocast=False):
    """Max abs differences of the fused and the unfused model against the unfused fp32
    model: {"logits", "loss", "grads"} for each, the grads the largest rel() over all
    parameters. fp32 and no options: the fused model against its unfused twin."""
    ref = make(arch)
    ids, mask, labels = batch()
    ref_logits, ref_loss, ref_grads, _ = run(ref, ids, mask, labels)
    unfused = copy.deepcopy(ref) if autocast else copy.deepcopy(ref).to(dtype)
    fused = fuse(copy.deepcopy(unfused), residual_dtype=residual_dtype)
    result = {"scale": {"logits": ref_logits.abs().max().item(), "loss": abs(ref_loss.item()), "grads": 1.0}}
    for name, model in (("unfused", unfused), ("fused", fused)):
        ctx = torch.autocast(ids.device.type, dtype=dtype) if autocast else nullcontext()
        with ctx:
            logits, loss, grads, _ = run(model, ids, mask, labels)
        result[name] = {"logits": max_diff(logits, ref_logits), "loss": abs(loss.item() - ref_loss.item()),
                        "grads": max(rel(grads[n], ref_grads[n]) for n in ref_grads)}
    return result


class StreamOps(TorchDispatchMode):
    """Counts, outside fuseblock's stream ops, the aten adds with the hidden state's shape
    (the residual adds) and the rsqrt calls on it (the unfused RMSNorms at hidden width)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.adds, self.norms, self.inside = tuple(shape), 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside and getattr(out, "shape", None) is not None:
            if func.overloadpacket is torch.ops.aten.add and tuple(out.shape) == self.shape:
                self.adds += 1
            if func.overloadpacket is torch.ops.aten.rsqrt and tuple(out.shape) == (*self.shape[:-1], 1):
                self.norms += 1
        return out


def stream_ops(unfused, fused, ids, monkeypatch):
    """(the unfused model's StreamOps, the fused model's, and the fused model's calls of
    fuseblock's stream ops in order: (op name, x's shape, with a residual)), one forward
    of each on ids. The ops are what Norm.add, .norm_add and .norm_add_norm call; the
    unfused model calls none of them."""
    shape, calls, mode = (*ids.shape, unfused.config.hidden_size), [], None

    def counting(name, real):
        def op(*args, **kwargs):
            calls.append((name, args[0].shape, args[1] is not None))
            mode.inside += 1
            try:
                return real(*args, **kwargs)
            finally:
                mode.inside -= 1
        return op

    for name in ("add_norm", "norm_add", "norm_add_norm"):
        monkeypatch.setattr(fuseblock.modules.norm, name, counting(name, getattr(fuseblock.modules.norm, name)))
    with torch.no_grad():
        with StreamOps(shape) as mode:
            unfused(ids)
        assert not calls
        before = mode
        with StreamOps(shape) as mode:
            fused(ids)
    return before, mode, calls


def meta_pair(cls, config):
    """(unfused, fused) models of cls built on the meta device (fused there, as
    from_pretrained would), moved with to_empty to DEVICE, every parameter NaN first (what to_empty's
    memory may hold), then init_weights from one seed."""
    with torch.device("meta"):
        unfused, fused = cls(config), fuse(cls(config))
    for model in (unfused, fused):
        model.to_empty(device=DEVICE)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        torch.manual_seed(3)
        model.init_weights()
    return unfused, fused

