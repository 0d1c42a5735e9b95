"""fuseblock.integrations.transformers.fuse against the unfused Hugging Face models.

Tiny configs with random weights (nothing downloaded): logits, loss and every
parameter's gradient of the fused model against its unfused twin, in fp32 (tight) and
bf16 (within the unfused model's own bf16 distance to its fp32 result, times a small
factor); greedy generation with the KV cache and padding; hidden states; the norm call
count (2n + 1) and no separate residual add; state_dicts both ways; gradient
checkpointing; torch.compile(fullgraph=True); the kernel path on two architectures.

`.venv/bin/python tests/integrations/test_transformers.py` prints the table of measured differences that
docs/transformers.md shows.
"""
import copy
import io
import json
import math
import os
import pickle
import re
import sys
import warnings

import pytest
import timeouts
import torch

transformers = pytest.importorskip("transformers")

from helpers import KERNEL_PATH  # noqa: E402
from hf_models import HIDDEN, LAYERS, ROOT, batch, differences, make, max_diff, pair, run, stream_ops  # noqa: E402
from trainutil import env  # noqa: E402

from fuseblock import Norm  # noqa: E402
from fuseblock.integrations.transformers import FAMILIES, fuse  # noqa: E402
from fuseblock.integrations.transformers.attn_res import ATTN_RES  # noqa: E402
from fuseblock.integrations.transformers.tiny import LLAMA_SHAPED, SIZES, TINY, tiny_config  # noqa: E402
from fuseblock.integrations.transformers.unit_sphere import UNIT_SPHERE  # noqa: E402

# every fused family (test_every_family_has_a_tiny_config) but the n-stream ones, whose stream
# is no (p, r) of norms: tests/integrations/test_hf_hyper_families.py holds them to the same guarantees;
# and the Llama-shaped ones of issue 43, one row each of tests/integrations/test_hf_llama_shaped_families.py;
# and inkling2_loop's attention residuals (5.24 only): tests/integrations/test_hf_inkling2_loop.py;
# and dory's unit sphere (5.24 only): tests/integrations/test_hf_dory.py
ARCHS = [f for f in FAMILIES if f in TINY and FAMILIES[f].hyper is None and f not in LLAMA_SHAPED
         and FAMILIES[f].shape is not ATTN_RES and FAMILIES[f].shape is not UNIT_SPHERE]
# Families whose fp32 torch path is not bitwise the unfused model's, and why; held to fp32 rounding instead
NOT_BITWISE = {
    # CohereLayerNorm composes mean, variance and rsqrt in fp32 ops; the Norm runs torch.layer_norm (ulps apart)
    "cohere": dict(rtol=1e-5, atol=1e-5),
}


# Checkpoint keys transformers renames, by its own class names (GPT-NeoX saves lm_head as embed_out): a raw
# load_state_dict of the file, and the tests' subclass of the model class (fusing_class, which transformers
# does not rename for), take the model's own names
KEY_MAPPING = {"gpt_neox": {r"^embed_out\.": "lm_head."}}


def renamed(arch, state):
    import re

    for pattern, name in KEY_MAPPING.get(arch, {}).items():
        state = {re.sub(pattern, name, k): v for k, v in state.items()}
    return state


def no_dropout(arch):
    """Overrides zeroing the family's dropouts (its tiny config sets them > 0): for training-mode
    comparisons that need one function."""
    return {k: 0.0 for k in TINY[arch] if "drop" in k}


def part(model, arch, role="layers"):
    """The inner model's module of `role` (families.Family.model_parts): model.model.layers, GPT-2's transformer.h."""
    return getattr(model.base_model, FAMILIES[arch].model_parts[role])


def identity(arch, name):
    """A norm parameter's value where the norm is the identity map: a bias 0, a weight 1 (0 with Gemma's 1 + w)."""
    return 0.0 if "gemma" in arch or name.endswith("bias") else 1.0


# ---------------------------------------------------------------------------- fp32


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_logits_loss_grads_hidden_states_match_the_unfused_model(arch):
    unfused, fused = pair(arch)
    assert list(fused.state_dict()) == list(unfused.state_dict())
    ids, mask, labels = batch()
    a, b = run(unfused, ids, mask, labels), run(fused, ids, mask, labels)
    assert b[2].keys() == a[2].keys()
    assert len(b[3]) == len(a[3]) == LAYERS + 1  # the embeddings, then each layer's output (the last one normed)
    if arch in NOT_BITWISE:
        pairs = [*zip(b[:2], a[:2], strict=True), *((b[2][n], a[2][n]) for n in a[2])]
        for x, y in [*pairs, *zip(b[3], a[3], strict=True)]:
            torch.testing.assert_close(x, y, **NOT_BITWISE[arch])
        return
    # bitwise: the torch path computes each add and norm as the unfused model does, in its order
    assert torch.equal(b[0], a[0]) and torch.equal(b[1], a[1]), (max_diff(b[0], a[0]), max_diff(b[1], a[1]))
    differ = {name: max_diff(b[2][name], a[2][name]) for name in a[2] if not torch.equal(b[2][name], a[2][name])}
    assert not differ, differ
    for hf, hu in zip(b[3], a[3], strict=True):
        assert torch.equal(hf, hu), max_diff(hf, hu)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_rms_norm_is_a_fuseblock_norm_holding_the_same_parameters(arch):
    model = make(arch)
    params = dict(model.named_parameters())
    fuse(model)
    kinds = {type(m).__name__ for m in model.modules()}
    assert not any(k.endswith("RMSNorm") for k in kinds) and "Norm" in kinds
    family = model.base_model.fuseblock_family  # every stream norm, whatever its class was (LayerNorms too)
    assert isinstance(part(model, arch, "norm"), Norm)
    assert all(isinstance(getattr(layer, family.parts[r]), Norm) for layer in part(model, arch) for r in family.norms)
    assert all(p is params[n] for n, p in model.named_parameters())  # the Parameter objects themselves
    offsets = {m.weight_offset for m in model.modules() if isinstance(m, Norm)}
    assert offsets == ({1.0} if arch.startswith("gemma") else {0.0})
    if arch == "qwen3":
        assert isinstance(model.model.layers[0].self_attn.q_norm, Norm)


@pytest.mark.parametrize("arch", ARCHS)
def test_output_attentions_match(arch):
    unfused, fused = pair(arch)
    for m in (unfused, fused):
        m.config._attn_implementation = "eager"  # attention weights come from the eager kernel only
    ids, mask, _ = batch()
    a = unfused(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    b = fused(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(a) == len(b) == LAYERS
    for x, y in zip(b, a, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.kernel
@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt_neox", "olmo2", "gemma2"])
def test_output_attentions_answers_as_the_unfused_model_under_each_implementation(arch):
    """output_attentions=True, as the forward's argument or the config's, under each attention
    implementation set after fusing (set_attn_implementation on both models): eager returns
    one weight tensor per layer, the unfused model's (bitwise on the torch path, within 1e-5
    on the kernel path); sdpa returns none, as the unfused model does (an empty tuple; its
    config refuses output_attentions); an implementation the family lacks is the same
    ValueError on both (Gemma2's sdpa)."""
    unfused, fused = pair(arch)
    ids, mask, _ = batch(t=6)
    for impl in ("eager", "sdpa"):
        try:
            unfused.set_attn_implementation(impl)
        except ValueError as e:
            with pytest.raises(ValueError, match=re.escape(str(e).split(".")[0])):
                fused.set_attn_implementation(impl)
            continue
        fused.set_attn_implementation(impl)
        for where in ("argument", "config") if impl == "eager" else ("argument",):  # (sdpa's config refuses it)
            kw = {"output_attentions": True} if where == "argument" else {}
            with torch.no_grad():
                for m in (unfused, fused):
                    m.config.output_attentions = where == "config"
                a, b = (m(input_ids=ids, attention_mask=mask, **kw).attentions for m in (unfused, fused))
                for m in (unfused, fused):
                    m.config.output_attentions = False
            assert type(a) is type(b) and len(a) == len(b) == (LAYERS if impl == "eager" else 0), (impl, where)
            for x, y in zip(b, a, strict=True):
                if KERNEL_PATH:
                    torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
                else:
                    assert torch.equal(x, y), max_diff(x, y)


# Block scalars of other families' configs (BERT's, BART's) that no fused family's code
# reads: configs carry such keys, and fuse once refused every model holding them
STRAY = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, activation_dropout=0.1)


@pytest.mark.kernel
@pytest.mark.parametrize("arch", ARCHS)
def test_config_keys_the_unfused_model_does_not_read_are_no_reason_to_refuse(arch):
    """A model whose config holds STRAY fuses, and computes what the unfused one does:
    logits, loss and every gradient, bitwise on the torch path (fp32 rounding for
    NOT_BITWISE; the kernel path within its 1e-4). The premise, that the unfused model
    reads none of them, is checked too: its logits are those of the same weights without
    the keys."""
    plain = make(arch)
    unfused, fused = pair(arch, **STRAY)
    assert all(getattr(fused.config, k) == v for k, v in STRAY.items())
    assert fused.base_model.fuseblock_family is not None
    ids, mask, labels = batch(t=6)
    with torch.no_grad():
        assert torch.equal(unfused(input_ids=ids, attention_mask=mask).logits,
                           plain(input_ids=ids, attention_mask=mask).logits)
    a, b = run(unfused, ids, mask, labels, hidden=False), run(fused, ids, mask, labels, hidden=False)
    pairs = [*zip(b[:2], a[:2], strict=True), *((b[2][n], a[2][n]) for n in a[2])]
    if KERNEL_PATH or arch in NOT_BITWISE:
        for x, y in pairs:
            torch.testing.assert_close(x, y, **NOT_BITWISE.get(arch, dict(rtol=1e-4, atol=1e-4)))
    else:
        assert all(torch.equal(x, y) for x, y in pairs), max(max_diff(x, y) for x, y in pairs)


# ---------------------------------------------------------------------------- the fused stream's shape


@pytest.mark.parametrize("arch", ARCHS)
def test_two_n_plus_one_stream_ops_and_no_separate_residual_add(arch, monkeypatch):
    n = 3
    unfused, fused = pair(arch, layers=n)
    ids = batch()[0]
    # the stream's adds before the first layer, which no norm follows: GPT-2's token + position embeddings
    before = 1 if arch == "gpt2" else 0
    shape = (*ids.shape, HIDDEN)
    u, f, calls = stream_ops(unfused, fused, ids, monkeypatch)
    assert u.adds == 2 * n + before  # the counter sees the unfused model's adds
    assert f.adds == before
    # every add of the stream but the embedding's (which has none) meets its norms in one op:
    # 2n of the stream's ops take a residual; plain norms (Qwen3's q/k norms per head) take none
    # (a parallel layer's two branch outputs enter in one op: n of them)
    with_residual = [c for c in calls if c[2]]
    parallel = fused.base_model.fuseblock_family.shape.name == "parallel"
    assert [c[1:] for c in with_residual] == [(shape, True)] * (n if parallel else 2 * n)
    assert {c[0] for c in with_residual} == STREAM_OPS[fused.base_model.fuseblock_family.shape.name]


# The fused ops that take a residual, per stream shape: a sandwich's attention post-norm,
# add and MLP pre-norm are one norm_add_norm; a post-norm layer's two adds are norm_adds;
# a parallel layer's two branch outputs enter in one add_norm with x1
STREAM_OPS = {"pre-norm": {"add_norm"}, "sandwich": {"add_norm", "norm_add_norm"}, "post-norm": {"norm_add"},
              "parallel": {"add_norm"}}


# ---------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("mode", ["bf16", "bf16+fp32_stream", "autocast"])
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_error_within_the_unfused_models_own(arch, mode):
    """bf16 weights (the stream bf16, or fp32 with residual_dtype), or fp32 weights under
    bf16 autocast: the fused model's distance to the unfused fp32 result is at most twice
    the unfused bf16 model's own, plus bf16's unit roundoff (2^-8) of the value's scale
    (the unfused model's error can be small by luck: a loss is one number)."""
    d = differences(arch, torch.bfloat16, residual_dtype=torch.float32 if "fp32" in mode else None,
                    autocast=mode == "autocast")
    for what in ("logits", "loss", "grads"):
        assert d["fused"][what] <= 2 * d["unfused"][what] + 2**-8 * max(1.0, d["scale"][what]), (what, d)
    assert d["unfused"]["logits"] > 0  # bf16 did round: the comparison means something


def test_bf16_fp32_stream_keeps_activations_bf16():
    _, fused = pair("llama")
    fused.to(torch.bfloat16)
    fuse(fused, residual_dtype=torch.float32)
    seen = []
    fused.model.layers[1].self_attn.q_proj.register_forward_hook(lambda m, a, o: seen.append(a[0].dtype))
    out = fused(batch()[0], output_hidden_states=True)
    assert seen == [torch.bfloat16] and out.logits.dtype == torch.bfloat16
    assert out.hidden_states[1].dtype == torch.float32  # p + r in the stream's dtype


# ---------------------------------------------------------------------------- generation, checkpoints


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_with_cache_and_padding_is_identical(arch):
    unfused, fused = pair(arch)
    ids, mask, _ = batch(t=8)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    a, b = unfused.generate(ids, **kw), fused.generate(ids, **kw)
    assert a.shape == (2, 18) and torch.equal(a, b)


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoints_load_both_ways(arch, tmp_path):
    unfused, fused = pair(arch)
    with torch.no_grad():  # a fused model that has moved away from the unfused one
        for p in fused.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ids = batch()[0]
    fused.save_pretrained(tmp_path / "fused")
    back = type(unfused).from_pretrained(tmp_path / "fused")
    assert type(part(back, arch)[0]) is type(part(unfused, arch)[0])
    torch.testing.assert_close(back(ids).logits, fused(ids).logits, rtol=1e-5, atol=1e-5)

    unfused.save_pretrained(tmp_path / "unfused")
    loaded = fuse(type(unfused).from_pretrained(tmp_path / "unfused"))
    torch.testing.assert_close(loaded(ids).logits, unfused(ids).logits, rtol=1e-5, atol=1e-5)
    from safetensors.torch import load_file

    written = load_file(tmp_path / "unfused" / "model.safetensors")
    assert written.keys() == load_file(tmp_path / "fused" / "model.safetensors").keys()
    fresh = pair(arch, seed=5)[1]  # strict load of the original checkpoint file into a fused model
    written = renamed(arch, written)
    if written.keys() != unfused.state_dict().keys():  # transformers writes MoE experts as released, one by one
        written = unfused.state_dict()
    fresh.load_state_dict(written, strict=True)
    torch.testing.assert_close(fresh(ids).logits, unfused(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_checkpointing(arch, reentrant):
    unfused, fused = pair(arch, **no_dropout(arch))  # training mode: one function (dropout: own test files)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.23 renames it activation_checkpointing_enable
        fused.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert all(layer.gradient_checkpointing for layer in part(fused, arch))
    fused.train(), unfused.train()
    calls, mlp = [], part(fused, arch)[0].mlp
    mlp.forward = lambda x, forward=mlp.forward: calls.append(1) or forward(x)  # (the recompute runs no hooks)
    ids, mask, labels = batch()
    a, b = run(unfused, ids, mask, labels), run(fused, ids, mask, labels)
    assert len(calls) == 2  # forward, then again in backward: checkpointing ran
    torch.testing.assert_close(b[1], a[1], rtol=1e-6, atol=1e-6)
    for name in a[2]:
        torch.testing.assert_close(b[2][name], a[2][name], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- initialization


def config_of(arch):
    return tiny_config(arch)


def model_class(arch):
    """The family's causal-LM class (LlamaForCausalLM, ...)."""
    return transformers.AutoModelForCausalLM._model_mapping[type(config_of(arch))]


def fusing_class(arch):
    """The model class under its own name, fusing itself in __init__ (docs/transformers.md):
    from_pretrained then builds the fused model on the meta device and initialises what the
    checkpoint lacks on the fused model."""
    base = model_class(arch)

    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        fuse(self)

    # In transformers' module: transformers initialises a class defined elsewhere as custom code,
    # which skips modules holding no parameter of their own, and with them GPT-2's scaled
    # c_proj init (GPT2Attention's, GPT2MLP's); a subclass that does not fuse loses it too
    return type(base.__name__, (base,), {"__init__": __init__, "__module__": base.__module__})


def norms(model):
    """{name: tensor} of the norms' parameters (none for OLMo's, which have none)."""
    names = {f"{m}.{p}" for m, mod in model.named_modules()
             if isinstance(mod, (Norm, torch.nn.LayerNorm)) or type(mod).__name__.endswith(("RMSNorm", "LayerNorm"))
             for p, _ in mod.named_parameters(recurse=False)}
    return {n: t for n, t in model.state_dict().items() if n in names}



def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("init", ["init_weights", "post_init"])
@pytest.mark.parametrize("arch", ARCHS)
def test_meta_device_init_gives_the_norms_what_the_unfused_model_gets(arch, init):
    """Built on meta (fused there, as from_pretrained would), to_empty, then transformers'
    init: every parameter equals the unfused model's after the same steps, the norms are
    the eager model's (ones, zeros for Gemma's 1 + w), and the loss is finite."""
    config, cls = config_of(arch), model_class(arch)
    with torch.device("meta"):
        unfused, fused = cls(config), fuse(cls(config))
    for model in (unfused, fused):
        model.eval()  # the losses compared below: no dropout
        model.to_empty(device="cpu")
        with torch.no_grad():  # what to_empty's memory may hold: init must leave none of it
            for p in model.parameters():
                p.fill_(math.nan)
        torch.manual_seed(3)
        getattr(model, init)()
    assert {type(m) for m in fused.modules()} >= {Norm}
    assert_same_state(fused, unfused)
    torch.manual_seed(3)
    eager = norms(cls(config))
    assert norms(fused).keys() == eager.keys()
    for name, t in norms(fused).items():
        assert torch.equal(t, eager[name]) and torch.equal(t, torch.full_like(t, identity(arch, name))), name
    ids, mask, labels = batch()
    fused.eval(), unfused.eval()  # (the tiny configs' dropouts)
    loss = fused(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(loss, unfused(input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert math.isfinite(loss.item())


@pytest.mark.parametrize("arch", ARCHS)
def test_init_weights_leaves_initialised_norms_alone_as_the_unfused_model_does(arch):
    """An eager model is initialised: its init_weights (post_init, after any change) skips every
    module, the norms replaced by fuse included, so trained norm weights survive it."""
    unfused, fused = pair(arch)
    for model in (unfused, fused):
        model.init_weights()
    assert_same_state(fused, unfused)
    assert all((t != identity(arch, n)).all() for n, t in norms(fused).items())  # make() perturbed them


@pytest.mark.parametrize("arch", ARCHS)
def test_from_pretrained_initialises_missing_norm_keys_of_the_fused_class(arch, tmp_path):
    """A checkpoint lacking half its norm weights, loaded by a class that fuses in __init__:
    the loaded ones are the checkpoint's, the missing ones what the unfused class gives them
    (its test_can_init_all_missing_weights, on the norms); every parameter as the unfused class loads it."""
    from safetensors.torch import load_file, save_file

    source = make(arch)
    source.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = renamed(arch, load_file(path))
    dropped = sorted(norms(source))[::2]
    save_file({k: v for k, v in state.items() if k not in dropped}, path, metadata={"format": "pt"})
    unfused = model_class(arch).from_pretrained(tmp_path)
    fused = fusing_class(arch).from_pretrained(tmp_path)
    assert isinstance(part(fused, arch, "norm"), Norm)
    assert type(part(fused, arch)[0]) is not type(part(unfused, arch)[0])
    assert_same_state(fused, unfused)
    for name, t in norms(fused).items():
        assert torch.equal(t, torch.full_like(t, identity(arch, name)) if name in dropped else state[name]), name


@pytest.mark.parametrize("arch", ARCHS)
def test_from_pretrained_without_weights_equals_the_unfused_class(arch):
    """transformers' test_can_init_all_missing_weights: from_pretrained(None, state_dict={})
    initialises every parameter on the meta-built model; the fused class gets what the unfused one does."""
    config = config_of(arch)
    torch.manual_seed(4)
    unfused = model_class(arch).from_pretrained(None, config=config, state_dict={})
    torch.manual_seed(4)
    fused = fusing_class(arch).from_pretrained(None, config=config, state_dict={})
    assert isinstance(part(fused, arch, "norm"), Norm)
    assert_same_state(fused, unfused)


def test_fsdp2_meta_init_on_two_cpu_ranks_equals_the_unfused_model(tmp_path):
    """fully_shard between fuse and to_empty: tests/integrations/transformers_fsdp_worker.py on 2 gloo
    ranks, Llama and Gemma2 (weights with an offset); every parameter as the unfused
    sharded model's, no NaN left, the norms the identity's, the losses equal and finite."""
    out = tmp_path / "found.json"
    p = timeouts.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                      os.path.join(ROOT, "tests", "integrations", "transformers_fsdp_worker.py"), str(out)],
                     env={**env(), "OMP_NUM_THREADS": "1"}, cwd=ROOT, capture_output=True, text=True, seconds=240)
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
    found = json.loads(out.read_text())
    assert set(found) == {"llama", "gemma2"}
    for arch, f in found.items():
        assert f["same_names"] and f["differing"] == [] and f["nan"] == [], (arch, f)
        assert f["norm_values"] == ([0.0] if arch == "gemma2" else [1.0]), (arch, f)
        assert f["losses"][0] == f["losses"][1] and math.isfinite(f["losses"][1]), (arch, f)


# ---------------------------------------------------------------------------- torch.compile


def covering(archs: list[str]) -> list[str]:
    """The families to compile: few (greedily chosen) whose Family entries (families.py) hold,
    field by field, every value any of `archs` holds, the names of the submodules read
    (parts, model_parts, reads) aside. What a fused forward traces is picked by those fields
    (the shape, the embedding, rotary and output steps, the dropout and alpha, the model
    forward, the cache keyword, ...); a family whose every field is a compiled one's traces
    nothing they do not. Each compile is several seconds on a 2-core CPU."""
    def field(v):
        return getattr(v, "__qualname__", None) or repr(v)

    values = {a: {(k, field(v)) for k, v in vars(FAMILIES[a]).items()
                  if not k.startswith("_") and k not in ("parts", "model_parts", "reads")} for a in archs}
    chosen, left = [], set().union(*values.values())
    while left:
        best = max(archs, key=lambda a: len(values[a] & left))  # ties: the first in ARCHS
        chosen.append(best)
        left -= values[best]
    return [a for a in archs if a in chosen]


COMPILED = covering(ARCHS)


@pytest.mark.parametrize("arch", COMPILED)
def test_compile_fullgraph_forward_and_backward(arch):
    torch._dynamo.reset()
    unfused, fused = pair(arch)
    for model in (unfused, fused):  # GPT2LMHeadModel's name names no loss: transformers' loss_function
        model.loss_type = model.loss_type or "ForCausalLM"  # then warns, a graph break of the unfused model's own
    ids, mask, labels = batch()
    # fullgraph=True: a graph break is an error naming its reason (no separate explain() trace)
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    # (output_hidden_states installs transformers' hooks under a lock, which Dynamo cannot trace)
    a = run(unfused, ids, mask, labels, hidden=False)
    try:
        b = run(compiled, ids, mask, labels, hidden=False)
    except torch._dynamo.exc.BackendCompilerFailed:
        try:  # transformers 5.17's MoE experts (grouped_mm's fallback) compile for neither model
            run(torch.compile(unfused, fullgraph=True, backend="aot_eager"), ids, mask, labels, hidden=False)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            pytest.skip(f"the unfused model does not compile either: {str(e).splitlines()[0]}")
        raise
    torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-5)
    for name in a[2]:
        torch.testing.assert_close(b[2][name], a[2][name], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- the Triton kernels


@pytest.mark.kernel
@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "granite", "phi3", "gpt2", "gpt_neox", "olmo2"])
def test_kernel_path_matches_the_unfused_model(arch):
    unfused, fused = pair(arch)
    ids, mask, labels = batch(t=6)
    a, b = run(unfused, ids, mask, labels), run(fused, ids, mask, labels)
    torch.testing.assert_close(b[0], a[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b[1], a[1], rtol=1e-5, atol=1e-5)
    for name in a[2]:
        torch.testing.assert_close(b[2][name], a[2][name], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- the API


def test_unsupported_architectures_and_bad_arguments():
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(hidden_size=32, num_hidden_layers=1,
                                                                   vocab_size=64))
    with pytest.raises(ValueError, match=r"MambaForCausalLM \(model_type 'mamba'\) is refused: .*llama, mistral"):
        fuse(mamba)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        fuse(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="residual_dtype"):
        fuse(make("llama"), residual_dtype=torch.int32)


# Families registered with Llama's forward, as the docs once suggested: each differs from
# Llama in its structure or its config, and the check says where rather than fusing
WRONG_FORWARD = {
    "granite": (dict(residual_multiplier=0.22, embedding_multiplier=12.0),
                r"config.embedding_multiplier = 12.0.*config.residual_multiplier = 0.22"),
    "glm4": ({}, r"modules the fused forward does not know \(post_mlp_layernorm, post_self_attn_layernorm\)"),
    "phi3": (dict(resid_pdrop=0.1), r"does not know \(resid_attn_dropout, resid_mlp_dropout\).*config.resid_pdrop"),
    "stablelm": (dict(use_parallel_residual=True, hidden_dropout=0.1),
                 r"does not know \(dropout\) and lacks post_attention_layernorm.*config.hidden_dropout = 0.1.*"
                 r"config.use_parallel_residual = True"),
}


def test_every_family_has_a_tiny_config():
    assert set(TINY) == set(FAMILIES)
    with pytest.raises(ValueError, match="'mamba' is not a family fuse fuses"):
        tiny_config("mamba")


@pytest.mark.parametrize("model_type", WRONG_FORWARD)
def test_a_family_registered_with_a_wrong_forward_is_refused(model_type, monkeypatch):
    import fuseblock.integrations.transformers.fusion as fusion
    extra, why = WRONG_FORWARD[model_type]
    config = transformers.AutoConfig.for_model(model_type, **{**SIZES, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    monkeypatch.setattr(fusion, "FAMILIES", {**fusion.FAMILIES, model_type: fusion.FAMILIES["llama"]})
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=rf"model_type '{model_type}'\) is not the layout fuse fuses as "
                                         rf"{model_type} \(pre-norm\): .*{why}"):
        fuse(model)
    assert not any(isinstance(m, Norm) for m in model.modules())  # refused before anything changed
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())


def test_fuse_is_per_instance_and_idempotent():
    cls = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    forward, model_forward = cls.forward, transformers.LlamaModel.forward
    unfused, fused = pair("llama")
    assert cls.forward is forward and transformers.LlamaModel.forward is model_forward
    assert type(unfused.model.layers[0]) is cls and isinstance(fused.model.layers[0], cls)
    assert type(fused.model.layers[0]).__name__ == cls.__name__  # transformers finds layers by class name
    copied = copy.deepcopy(fused)  # what fuse gave the instances the copies have
    assert copied._init_weights.__self__ is copied and copied.model._init_weights.__self__ is copied.model
    assert copied.model.forward.__self__ is copied.model
    again = fuse(copied)
    assert type(again.model.layers[0]) is type(fused.model.layers[0])
    ids = batch()[0]
    torch.testing.assert_close(again(ids).logits, unfused(ids).logits, rtol=1e-5, atol=1e-5)


PICKLED = ["llama", "gpt2", "gpt_neox"]  # Llama's names, GPT-2's own model forward, a variant entry
# Loads the models the test saved, in a fresh process (none of fuse's classes made yet), and
# saves their logits on the ids saved beside them, and whether each is still fused
_LOAD = """
import sys, torch
from fuseblock.integrations.transformers.families import registered
ids = torch.load(sys.argv[1] + "/ids.pt")
found = {}
for arch in sys.argv[2:]:
    model = torch.load(f"{sys.argv[1]}/{arch}.pt", weights_only=False)
    family = model.base_model.fuseblock_family
    layers = getattr(model.base_model, family.model_parts["layers"])
    fused = (any(family is f for f in registered().values()) and all(type(m)._fuseblock_fused for m in layers)
             and type(model.base_model)._fuseblock_fused)
    with torch.no_grad():
        found[arch] = (fused, model(input_ids=ids).logits)
torch.save(found, sys.argv[1] + "/found.pt")
"""


def test_torch_save_of_a_fused_model_loads_fused(tmp_path):
    """torch.save(fused) and torch.load(..., weights_only=False), in this process and in a
    fresh one: the loaded model's layers, inner model and model are fuse's classes (its
    registered family, the Norms' init), and its logits and gradients are the fused
    model's, bitwise. (A bare PicklingError before: fuse's classes were not importable.)"""
    ids, mask, labels = batch()
    torch.save(ids, tmp_path / "ids.pt")
    expected = {}
    for arch in PICKLED:
        unfused, fused = pair(arch)
        torch.save(fused, tmp_path / f"{arch}.pt")
        loaded = torch.load(tmp_path / f"{arch}.pt", weights_only=False)
        assert type(loaded) is type(fused) and type(loaded).__name__ == type(unfused).__name__
        assert type(part(loaded, arch)[0]) is type(part(fused, arch)[0])
        assert type(loaded.base_model) is type(fused.base_model)
        assert loaded.base_model.fuseblock_family is fused.base_model.fuseblock_family
        assert loaded._init_weights.__func__ is fused._init_weights.__func__ is not type(unfused)._init_weights
        a, b = run(fused, ids, mask, labels, hidden=False), run(loaded, ids, mask, labels, hidden=False)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert all(torch.equal(a[2][n], b[2][n]) for n in a[2])
        with torch.no_grad():
            expected[arch] = fused(input_ids=ids).logits
            unfused(input_ids=ids)
        # after a forward as before it, pickling goes as it goes for the unfused model (in
        # transformers 5.23 both refuse: its output-recording hooks are local functions)
        outcome = []
        for model in (unfused, fused):
            try:
                torch.save(model, io.BytesIO())
                outcome.append(None)
            except (AttributeError, pickle.PicklingError, TypeError) as e:
                outcome.append((type(e), str(e)))
        assert outcome[0] == outcome[1], outcome
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = timeouts.run([sys.executable, "-c", _LOAD, str(tmp_path), *PICKLED], seconds=120, capture_output=True,
                     text=True, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    found = torch.load(tmp_path / "found.pt")
    for arch in PICKLED:
        assert found[arch][0], arch
        assert torch.equal(found[arch][1], expected[arch]), max_diff(found[arch][1], expected[arch])


@pytest.mark.slow
def test_train_hf_script_smoke():
    """scripts/train_hf.py: fused and unfused loss curves side by side, equal to fp32 noise."""
    p = timeouts.run([sys.executable, os.path.join(ROOT, "scripts", "train_hf.py"), "--iters", "3",
                      "--eval-every", "1"], capture_output=True, text=True, seconds=120,
                     env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr
    rows = [ln.split() for ln in p.stdout.splitlines() if ln.split() and ln.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    assert all(math.isfinite(float(r[1])) and abs(float(r[1]) - float(r[2])) < 1e-4 for r in rows)
    assert "max |fused - unfused|" in p.stdout


def main():
    """The table of docs/transformers.md: max differences against the unfused fp32 model."""
    print("| architecture | dtype | logits | loss | grads (rel) | unfused model's own: logits | loss | grads |")
    print("|---|---|---|---|---|---|---|---|")
    for arch in ARCHS:
        for label, kw in (("fp32", dict(dtype=torch.float32)), ("bf16", dict(dtype=torch.bfloat16)),
                          ("bf16, fp32 stream", dict(dtype=torch.bfloat16, residual_dtype=torch.float32)),
                          ("bf16 autocast", dict(dtype=torch.bfloat16, autocast=True))):
            d = differences(arch, **kw)
            f, u = d["fused"], d["unfused"]
            own = "-" if label == "fp32" else f"{u['logits']:.2e} | {u['loss']:.2e} | {u['grads']:.2e}"
            own = own if label != "fp32" else "- | - | -"
            print(f"| {arch} | {label} | {f['logits']:.2e} | {f['loss']:.2e} | {f['grads']:.2e} | {own} |")


if __name__ == "__main__":
    from fuseblock.testing.interpreter_rounding import install

    install()  # under TRITON_INTERPRET=1, round as a GPU does, as the tests do (conftest)
    main()
