"""ResidualStack in a Llama-style model: the common layers.{i}.{attn,mlp,input_norm,post_norm}
state_dict layout both ways, attention that carries its own layer index and returns its
key/value cache through `return_extras`, and an MLP with a plain forward(x).

The reference is the naive model written on that layout with torch's own nn.RMSNorm and
plain residual adds (no fuseblock code); the stack loads its state_dict through
`layers_to_stack`, so the key map is what makes the two agree.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fuseblock
from fuseblock.stream import layers_to_stack, stack_to_layers

DIM, HEADS, LAYERS, BATCH, SEQ, EPS = 32, 4, 3, 2, 6, 1e-6
HF_NAMES = dict(attn="self_attn", input_norm="input_layernorm", post_norm="post_attention_layernorm")
# max |a - b| / max |b|: fp32 fused and naive forms measure below 1e-6 apart (tests/nn/test_stream.py,
# whose bound for fused vs naive is 2 x 5e-6); the same here against torch's nn.RMSNorm.
TOL = 1e-5


def rotate_half(t):
    a, b = t.chunk(2, -1)
    return torch.cat((-b, a), -1)


def rotary(positions):
    """(cos, sin) of shape (T, DIM / HEADS) for integer positions (T,)."""
    half = DIM // HEADS // 2
    angles = positions.float()[:, None] * 100.0 ** (-torch.arange(half) / half)[None]
    angles = torch.cat((angles, angles), -1)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    """Causal attention with rotary embeddings and a key/value cache. Blocks are sublayers,
    so the layer index is the module's own: it picks its entry of past_key_values and
    returns (out, (k, v)) with the keys and values so far."""

    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, position_embeddings, *, past_key_values=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D/H)
        cos, sin = position_embeddings
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if past_key_values is not None:
            past_k, past_v = past_key_values[self.layer_idx]
            k, v = torch.cat((past_k, k), 2), torch.cat((past_v, v), 2)
        # new queries attend to every cached key and causally among themselves
        mask = torch.ones(T, k.shape[2], dtype=torch.bool).tril(k.shape[2] - T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(B, T, D)), (k, v)


class SwiGLU(nn.Module):
    """Llama's MLP, written as people write it: forward(x), no **kwargs."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, 2 * DIM, bias=False)
        self.up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Layer(nn.Module):
    def __init__(self, i, names):
        super().__init__()
        self.names = names
        for role, module in (("input_norm", nn.RMSNorm(DIM, eps=EPS)), ("attn", Attention(i)),
                             ("post_norm", nn.RMSNorm(DIM, eps=EPS)), ("mlp", SwiGLU())):
            setattr(self, names.get(role, role), module)

    def forward(self, x, position_embeddings, past_key_values):
        get = lambda role: getattr(self, self.names.get(role, role))  # noqa: E731
        a, present = get("attn")(get("input_norm")(x), position_embeddings, past_key_values=past_key_values)
        x = x + a
        return x + get("mlp")(get("post_norm")(x)), present


class NaiveLlama(nn.Module):
    """The naive pre-norm model on the common layout: x = x + attn(input_norm(x)), x = x +
    mlp(post_norm(x)) per layer, then norm(x); torch's RMSNorm, no fuseblock."""

    def __init__(self, names=None):
        super().__init__()
        self.layers = nn.ModuleList(Layer(i, names or {}) for i in range(LAYERS))
        self.norm = nn.RMSNorm(DIM, eps=EPS)
        with torch.no_grad():  # norm weights off their all-ones init, so a swapped norm shows
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.add_(0.3 * torch.randn_like(p))

    def forward(self, x, position_embeddings, past_key_values=None):
        presents = []
        for layer in self.layers:
            x, present = layer(x, position_embeddings, past_key_values)
            presents.append(present)
        return self.norm(x), presents


def stack_model(**kw):
    mixers = [m for i in range(LAYERS) for m in (Attention(i), SwiGLU())]
    return fuseblock.ResidualStack(mixers, DIM, eps=EPS, return_extras=True, **kw)


def run_stack(stack, x, position_embeddings, past_key_values=None):
    """The stack's output and each layer's (k, v): extras[2i] is layer i's attention tail."""
    kw = {} if past_key_values is None else dict(past_key_values=past_key_values)
    out, extras = stack(x, position_embeddings=position_embeddings, **kw)
    assert all(e == () for e in extras[1::2])  # the MLPs return tensors
    return out, [e[0] for e in extras[0::2]]


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------- the key maps
def test_stack_keys_round_trip_through_the_layers_layout():
    stack = stack_model()
    sd = stack.state_dict()
    layers = stack_to_layers(sd)
    assert list(layers) == [k for i in range(LAYERS) for k in (  # a block holds its mixer, then its norm
        f"layers.{i}.attn.qkv.weight", f"layers.{i}.attn.out.weight", f"layers.{i}.input_norm.weight",
        f"layers.{i}.mlp.gate.weight", f"layers.{i}.mlp.up.weight", f"layers.{i}.mlp.down.weight",
        f"layers.{i}.post_norm.weight")] + ["norm.weight"]
    assert all(layers[k] is v for k, v in zip(layers, sd.values(), strict=True))  # the same tensors, in order
    back = layers_to_stack(layers)
    assert list(back) == list(sd) and all(back[k] is sd[k] for k in sd)


@pytest.mark.parametrize("names", [{}, HF_NAMES], ids=["common", "hf"])
def test_layers_keys_round_trip_through_the_stack(names):
    naive = NaiveLlama(names)
    sd = naive.state_dict()
    stack_sd = layers_to_stack(sd, **names)
    assert set(stack_sd) == set(stack_model().state_dict())
    back = stack_to_layers(stack_sd, **names)
    assert list(back) == list(sd) and all(back[k] is sd[k] for k in sd)


@pytest.mark.kernel
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("names", [{}, HF_NAMES], ids=["common", "hf"])
def test_a_common_layout_state_dict_loads_into_a_stack_and_gives_the_naive_models_outputs(fused, names):
    """Output and the gradient of the input and of every parameter (matched by the key map)."""
    naive = NaiveLlama(names)
    stack = stack_model(fused=fused)
    x, pos = torch.randn(BATCH, SEQ, DIM), rotary(torch.arange(SEQ))
    assert rel_err(run_stack(stack, x, pos)[0], naive(x, pos)[0]) > 1e-2  # before the load they differ
    stack.load_state_dict(layers_to_stack(naive.state_dict(), **names))  # strict
    cot = torch.randn_like(x)
    xs, xn = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_s, kv_s = run_stack(stack, xs, pos)
    out_n, kv_n = naive(xn, pos)
    assert rel_err(out_s, out_n) <= TOL
    for (ks, vs), (kn, vn) in zip(kv_s, kv_n, strict=True):
        assert rel_err(ks, kn) <= TOL and rel_err(vs, vn) <= TOL
    params_s = stack_to_layers(dict(stack.named_parameters()), **names)
    params_n = dict(naive.named_parameters())
    assert sorted(params_s) == sorted(params_n)
    params_s = {name: params_s[name] for name in params_n}
    grads_s = torch.autograd.grad(out_s, [xs, *params_s.values()], cot)
    grads_n = torch.autograd.grad(out_n, [xn, *params_n.values()], cot)
    for name, gs, gn in zip(["x", *params_n], grads_s, grads_n, strict=True):
        assert gn.abs().max() > 0 and rel_err(gs, gn) <= TOL, name


@pytest.mark.kernel
def test_a_stack_state_dict_loads_into_the_naive_model():
    stack, naive = stack_model(), NaiveLlama()
    with torch.no_grad():
        for name, p in stack.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    naive.load_state_dict(stack_to_layers(stack.state_dict()))  # strict
    x, pos = torch.randn(BATCH, SEQ, DIM), rotary(torch.arange(SEQ))
    assert rel_err(run_stack(stack, x, pos)[0], naive(x, pos)[0]) <= TOL


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: stack_to_layers({"embed.weight": torch.zeros(1)}), "'embed.weight' is not a ResidualStack's"),
        (lambda: stack_to_layers({"blocks.01.norm.weight": torch.zeros(1)}), "'blocks.01.norm.weight'"),
        (lambda: layers_to_stack({"layers.0.self_attn.q.weight": torch.zeros(1)}), "'layers.0.self_attn.q.weight'"),
        (lambda: layers_to_stack({"model.norm.weight": torch.zeros(1)}), "'model.norm.weight'"),
        (lambda: stack_to_layers({}, attn="mlp"), "must differ"),
        (lambda: layers_to_stack({}, final_norm="layers"), "must differ"),
        (lambda: layers_to_stack({}, mlp="a.b"), "mlp must be a module name"),
        (lambda: stack_to_layers({}, input_norm=None), "input_norm must be a module name"),
    ],
)
def test_bad_keys_and_names_are_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------- decoding with a cache
@pytest.mark.kernel
@pytest.mark.parametrize("fused", [True, False])
def test_decoding_with_the_cache_the_stack_returns_equals_the_full_forward(fused):
    """Prefill SEQ - 1 tokens, then one token with the (k, v) the stack returned: the last
    position's output is the full forward's, and the naive model's step gives the same."""
    naive = NaiveLlama()
    stack = stack_model(fused=fused)
    stack.load_state_dict(layers_to_stack(naive.state_dict()))
    x = torch.randn(BATCH, SEQ, DIM)
    full, _ = run_stack(stack, x, rotary(torch.arange(SEQ)))
    _, past = run_stack(stack, x[:, :-1], rotary(torch.arange(SEQ - 1)))
    assert [k.shape[2] for k, _ in past] == [SEQ - 1] * LAYERS
    step, present = run_stack(stack, x[:, -1:], rotary(torch.tensor([SEQ - 1])), past_key_values=past)
    assert [k.shape[2] for k, _ in present] == [SEQ] * LAYERS
    assert rel_err(step[:, 0], full[:, -1]) <= TOL
    _, naive_past = naive(x[:, :-1], rotary(torch.arange(SEQ - 1)))
    naive_step, _ = naive(x[:, -1:], rotary(torch.tensor([SEQ - 1])), naive_past)
    assert rel_err(step, naive_step) <= TOL
    # each attention took its own layer's cache: a cache with the layers' order reversed differs
    wrong, _ = run_stack(stack, x[:, -1:], rotary(torch.tensor([SEQ - 1])), past_key_values=past[::-1])
    assert rel_err(wrong, step) > 1e-2
