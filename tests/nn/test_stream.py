"""The fused residual stream equals the naive pre-norm stack, forward and every gradient.

Fused: r_k = p_{k-1} + r_{k-1}, q_k = norm(r_k), p_k = f_k(q_k), o = norm_f(p_n + r_n).
Naive: x_k = x_{k-1} + f_k(norm(x_{k-1})), o = norm_f(x_n). Same parameters (a deep copy
with fused=False). Both are also checked against the naive stack run in float64, which
shares no code with fuseblock's kernels (torch ops and autograd only).
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import KERNEL_PATH
from torch import nn

import fuseblock
from fuseblock.ops.norm import norm_op

DIM, HEADS, BATCH, SEQ = 32, 4, 2, 5

# Error measure: max |a - b| / max |b| over a whole tensor (output or one gradient).
#
# fp32: measured below 1e-6 for every tensor here (fused vs naive, and each vs fp64);
# the bound leaves 5x for other summation orders.
TOL_FP32 = 5e-6
# bf16 keeps 8 significant bits, so every stored value is off by up to 2^-9 relative
# (on the kernel path too: conftest makes the Triton interpreter round as a GPU does).
# Each form rounds each mixer's inputs, weights' products and outputs, the residual
# stream (unless it is fp32) and every gradient; those errors add up over sublayers
# and over the rows a weight gradient sums. Measured over 20 seeds (torch path) and 6
# (kernel path), the naive bf16 stack itself is up to 2.2e-2 (5.5 * 2^-8) away from
# fp64 and the fused one up to 1.8e-2 (on the kernel path 1.4e-2; 2.1e-2 when the
# interpreter truncated). We require each to be within 2^-5 (8 * 2^-8) of
# fp64, the same bar for both: fusing costs no accuracy. The two forms round in
# different places (the fused norm adds and normalizes in fp32 and rounds once), so
# they may differ by the sum of their errors: 2 * 2^-5 (measured up to 2.6e-2).
# A 1% logic error hides under this noise; catching those is the fp32 tests' job.
TOL_BF16 = 2.0**-5


class CausalAttention(nn.Module):
    """A tiny multi-head causal self-attention: (B, T, D) -> (B, T, D)."""

    def __init__(self, dim, heads=HEADS):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    """(B, T, D) -> (B, T, D)"""

    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


def make_mixers(n, first="attn"):
    kinds = [CausalAttention, MLP] if first == "attn" else [MLP, CausalAttention]
    return [kinds[i % 2](DIM) for i in range(n)]


def make_stack(n, first="attn", *, kind="rms", dtype=torch.float32, residual_dtype=None, **kw):
    # LayerNorm with a bias (nanoGPT's), so bias gradients are covered too
    stack = fuseblock.ResidualStack(
        make_mixers(n, first), DIM, kind=kind, bias=kind == "layer", residual_dtype=residual_dtype, **kw
    )
    with torch.no_grad():  # norm weights off their all-ones init, so their gradients matter
        for name, p in stack.named_parameters():
            if ".norm" in name or name.startswith("norm_f"):
                p.add_(0.3 * torch.randn_like(p))
    return stack.to(dtype)


def naive_twin(stack, dtype=None):
    twin = copy.deepcopy(stack)
    twin.fused = False
    return twin if dtype is None else twin.to(dtype)


def forward_backward(stack, x, cot, **kwargs):
    """[output, d input, d every parameter] for a cotangent `cot` on the output; kwargs go to the stack."""
    x = x.detach().requires_grad_(True)
    out = stack(x, **kwargs)
    assert out.dtype == x.dtype and out.shape == x.shape
    params = list(stack.parameters())
    return [out, *torch.autograd.grad(out, [x, *params], cot)]


def names(stack):
    return ["out", "dx"] + ["d" + n for n, _ in stack.named_parameters()]


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def cast(value, dtype):
    """Tensors in value (a tensor, or a tuple / dict of them) in dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    if isinstance(value, tuple):
        return tuple(cast(v, dtype) for v in value)
    return {k: cast(v, dtype) for k, v in value.items()}


def check_equivalent(stack, x, *, tol, **kwargs):
    """Fused vs naive vs fp64 naive, output and every gradient; kwargs (side inputs) go to every mixer."""
    assert stack.fused
    cot = torch.randn_like(x)
    fused = forward_backward(stack, x, cot, **kwargs)
    naive = forward_backward(naive_twin(stack), x, cot, **kwargs)
    exact = forward_backward(naive_twin(stack, torch.float64), x.double(), cot.double(), **cast(kwargs, torch.float64))
    assert len(fused) == len(naive) == len(exact) == len(names(stack))
    for name, f, n, e in zip(names(stack), fused, naive, exact, strict=True):
        assert f.dtype == n.dtype, name
        assert rel_err(f, e) <= tol, f"{name}: fused is {rel_err(f, e):.3g} from fp64 (> {tol:.3g})"
        assert rel_err(n, e) <= tol, f"{name}: naive is {rel_err(n, e):.3g} from fp64 (> {tol:.3g})"
        assert rel_err(f, n) <= 2 * tol, f"{name}: fused vs naive {rel_err(f, n):.3g} (> {2 * tol:.3g})"
    return fused


DEPTHS = [(1, "attn"), (1, "mlp"), (2, "attn"), (2, "mlp"), (6, "attn")]
DEPTH_IDS = [f"{n}-{first}" for n, first in DEPTHS]


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("n,first", DEPTHS, ids=DEPTH_IDS)
def test_fused_equals_naive_fp32(n, first, kind):
    stack = make_stack(n, first, kind=kind)
    check_equivalent(stack, torch.randn(BATCH, SEQ, DIM), tol=TOL_FP32)


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("n,first", DEPTHS, ids=DEPTH_IDS)
def test_fused_equals_naive_bf16(n, first, kind):
    stack = make_stack(n, first, kind=kind, dtype=torch.bfloat16)
    check_equivalent(stack, torch.randn(BATCH, SEQ, DIM).bfloat16(), tol=TOL_BF16)


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("n,first", DEPTHS, ids=DEPTH_IDS)
def test_fused_equals_naive_fp32_residual_stream(n, first, kind):
    # bf16 parameters and activations, the residual stream carried in fp32
    stack = make_stack(n, first, kind=kind, dtype=torch.bfloat16, residual_dtype=torch.float32)
    check_equivalent(stack, torch.randn(BATCH, SEQ, DIM).bfloat16(), tol=TOL_BF16)


@pytest.mark.kernel
def test_residual_stream_dtypes():
    """The stream is carried in residual_dtype while the mixers see the activations' dtype."""
    stack = make_stack(3, dtype=torch.bfloat16, residual_dtype=torch.float32)
    seen = []
    for blk in stack.blocks:
        blk.mixer.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    h, r = torch.randn(BATCH, SEQ, DIM).bfloat16(), None
    for blk in stack.blocks:
        h, r = blk(h, r)
        assert h.dtype == torch.bfloat16 and r.dtype == torch.float32
    assert seen == [torch.bfloat16] * 3
    # without residual_dtype, a block keeps the dtype torch's h + r would have (no silent bf16 rounding)
    blk = fuseblock.PreNormBlock(MLP(DIM).bfloat16(), DIM).bfloat16()
    h2, r2 = blk(h, r)
    assert blk.residual_dtype is None and h2.dtype == torch.bfloat16 and r2.dtype == torch.float32
    torch.testing.assert_close(r2, h.float() + r, rtol=0, atol=0)


@pytest.mark.kernel
def test_backward_rule_gradient_at_the_residual_adds_into_dx():
    """r' = h + r, q = N(r'): dh = dr = J_N^T dq + dr' (seed 001: dx = dx + dr)."""
    blk = fuseblock.PreNormBlock(nn.Identity(), DIM, eps=1e-5)  # identity mixer: the block's output is q
    with torch.no_grad():
        blk.norm.weight.add_(0.3 * torch.randn(DIM))
    h, r = torch.randn(BATCH, SEQ, DIM, requires_grad=True), torch.randn(BATCH, SEQ, DIM, requires_grad=True)
    q, r_new = blk(h, r)
    dq, dr_new = torch.randn_like(q), torch.randn_like(r_new)
    dh, dr = torch.autograd.grad([q, r_new], [h, r], [dq, dr_new])
    assert torch.equal(dh, dr)
    p = (h.double() + r.double()).detach().requires_grad_(True)
    (through_norm,) = torch.autograd.grad(F.rms_norm(p, (DIM,), blk.norm.weight.double(), 1e-5), p, dq.double())
    assert rel_err(dh, through_norm + dr_new.double()) <= TOL_FP32
    assert rel_err(dh, through_norm) > 0.1  # the residual's share is really there


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_without_final_norm(kind):
    # o = p_n + r_n = x_n
    stack = make_stack(3, kind=kind, final_norm=False)
    assert stack.norm_f is None
    check_equivalent(stack, torch.randn(BATCH, SEQ, DIM), tol=TOL_FP32)


@pytest.mark.kernel
def test_explicit_loop_equals_stack():
    """h, r = blk(h, r) over the blocks, then one add_norm: the ResidualStack forward, exactly."""
    stack = make_stack(4)
    x = torch.randn(BATCH, SEQ, DIM)
    h, r = x, None
    for blk in stack.blocks:
        h, r = blk(h, r)
    out, _ = stack.norm_f.add(h, r)
    assert torch.equal(out, stack(x))
    assert torch.equal(stack.norm_f(h, r)[0], out)


@pytest.mark.kernel
def test_naive_twin_is_not_the_fused_code(launches):
    """The naive form must not go through the fused kernels (else fused == naive proves nothing)."""
    stack = naive_twin(make_stack(2))
    launches.reset()
    x = torch.randn(BATCH, SEQ, DIM, requires_grad=True)
    stack(x).sum().backward()
    assert launches["fwd"] == launches["bwd"] == 0


@pytest.mark.kernel
@pytest.mark.kernel_only("LAUNCHES counts Triton launches only")
@pytest.mark.parametrize("n", [1, 2, 6])
@pytest.mark.parametrize("final_norm", [True, False])
def test_one_norm_launch_per_sublayer(n, final_norm, launches):
    """n sublayers plus a final norm: n + 1 forward launches and n + 1 backward launches."""
    stack = make_stack(n, final_norm=final_norm)
    expected = n + int(final_norm)
    x = torch.randn(BATCH, SEQ, DIM, requires_grad=True)
    launches.reset()
    out = stack(x)
    assert launches("fwd", "bwd") == (expected, 0)
    out.sum().backward()
    assert launches("fwd", "bwd") == (expected, expected)


def test_state_dict_keys_identical_in_both_modes():
    fused = make_stack(4, kind="layer")
    naive = fuseblock.ResidualStack(make_mixers(4), DIM, kind="layer", bias=True, fused=False)
    assert list(fused.state_dict()) == list(naive.state_dict())
    assert "norm_f.weight" in fused.state_dict() and "blocks.3.norm.bias" in fused.state_dict()


@pytest.mark.kernel
def test_checkpoint_from_fused_loads_into_naive(tmp_path):
    from safetensors.torch import load_file, save_file

    fused = make_stack(4, kind="layer")
    path = tmp_path / "stack.safetensors"
    save_file(fused.state_dict(), str(path))
    torch.manual_seed(1)  # a differently initialized stack, so the load has to do the work
    naive = fuseblock.ResidualStack(make_mixers(4), DIM, kind="layer", bias=True, fused=False)
    x = torch.randn(BATCH, SEQ, DIM)
    assert rel_err(naive(x), fused(x)) > 1e-2
    naive.load_state_dict(load_file(str(path)))  # strict
    assert rel_err(naive(x), fused(x)) <= TOL_FP32


def _capture_backend(graphs):
    """aot_eager (AOTAutograd with no-op compilers) that also keeps the forward and backward graphs."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))


def _count(gm, op):
    return sum(1 for node in gm.graph.nodes if node.target is op)


@pytest.mark.kernel
def test_compile_fullgraph_forward_and_backward():
    """fullgraph=True raises on any graph break; both graphs hold the n + 1 fused ops whole."""
    torch._dynamo.reset()
    n = 2
    stack = make_stack(n)
    x = torch.randn(BATCH, SEQ, DIM)
    cot = torch.randn_like(x)
    graphs = {}
    compiled = torch.compile(stack, fullgraph=True, backend=_capture_backend(graphs))
    got = forward_backward(compiled, x, cot)
    want = forward_backward(stack, x, cot)
    for name, g, w in zip(names(stack), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)
    # the kernel path's ops whole: custom ops under the interpreter, else (triton_ops) their
    # Triton kernels, one node each forward (tests/ops/test_compile.py); the torch path's
    # plain ops, no fuseblock op
    from fuseblock.ops.registry import TRITON_OPS

    if KERNEL_PATH and TRITON_OPS:
        kernel = torch.ops.higher_order.triton_kernel_wrapper_functional
        assert _count(graphs["fw"], kernel) == n + 1 and _count(graphs["bw"], kernel) >= n + 1
        assert _count(graphs["fw"], norm_op.fwd_op) == _count(graphs["bw"], norm_op.bwd_op) == 0
    else:
        assert _count(graphs["fw"], norm_op.fwd_op) == (n + 1 if KERNEL_PATH else 0)
        assert _count(graphs["bw"], norm_op.bwd_op) == (n + 1 if KERNEL_PATH else 0)
    torch._dynamo.reset()


@pytest.mark.torch_only("inductor compile time; the kernel path checks the graphs above")
def test_compile_inductor_forward_and_backward():
    # ~20 s on 2 CPU cores, mostly inductor's C++ compile
    torch._dynamo.reset()
    stack = make_stack(2)
    x = torch.randn(BATCH, SEQ, DIM)
    cot = torch.randn_like(x)
    got = forward_backward(torch.compile(stack, fullgraph=True), x, cot)
    want = forward_backward(stack, x, cot)
    for name, g, w in zip(names(stack), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
    torch._dynamo.reset()


# ----------------------------------------------------------------- weight_offset
@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_fused_equals_naive_with_weight_offset(kind):
    # norm weights near 0 (make_stack's 0.3 * randn from the zeros init): the offset is most of each scale
    stack = make_stack(2, kind=kind, weight_offset=1.0)
    assert all(n.weight_offset == 1.0 for n in stack.modules() if isinstance(n, fuseblock.Norm))
    check_equivalent(stack, torch.randn(BATCH, SEQ, DIM), tol=TOL_FP32)


@pytest.mark.kernel
def test_fused_equals_naive_with_weight_offset_bf16_fp32_stream():
    stack = make_stack(2, dtype=torch.bfloat16, residual_dtype=torch.float32, weight_offset=1.0)
    check_equivalent(stack, torch.randn(BATCH, SEQ, DIM).bfloat16(), tol=TOL_BF16)


@pytest.mark.kernel
@pytest.mark.parametrize("fused", [True, False])
def test_fresh_stack_with_offset_is_the_plain_stack(fused):
    """reset_parameters zeros the weights under an offset: (1 + 0) is the plain norm's 1."""
    mixers = make_mixers(2)
    plain = fuseblock.ResidualStack(mixers, DIM, fused=fused)
    offset = fuseblock.ResidualStack(mixers, DIM, fused=fused, weight_offset=1.0)
    x = torch.randn(BATCH, SEQ, DIM)
    assert rel_err(offset(x), plain(x)) <= TOL_FP32
    with torch.no_grad():  # and the weight is read as (1 + w)
        offset.norm_f.weight.fill_(1.0)
    assert rel_err(offset(x), 2 * plain(x)) <= TOL_FP32


# ----------------------------------------------------------------- side channels
def rotate_half(t):
    a, b = t.chunk(2, -1)
    return torch.cat((-b, a), -1)


class SideAttention(nn.Module):
    """Causal attention fed what a Hugging Face decoder layer is fed: rotary (cos, sin)
    embeddings, positional or by keyword, and an additive mask, by keyword and required.
    With return_weights it returns (out, weights), as Hugging Face attention does."""

    def __init__(self, dim, heads=HEADS, return_weights=False):
        super().__init__()
        self.heads, self.return_weights = heads, return_weights
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, position_embeddings, *, attention_mask):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        cos, sin = position_embeddings  # (T, D/H) each
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D // self.heads) + attention_mask, dim=-1)
        out = self.proj((w @ v).transpose(1, 2).reshape(B, T, D))
        return (out, w) if self.return_weights else out


class SideMLP(MLP):
    """An MLP in a stack whose mixers all receive the side inputs: it takes and ignores them."""

    def forward(self, x, **kwargs):
        return super().forward(x)


def side_inputs(mask=True):
    """{position_embeddings: (cos, sin), attention_mask}: rotary angles for SEQ positions and a causal mask."""
    half = DIM // HEADS // 2
    angles = torch.arange(SEQ, dtype=torch.float32)[:, None] * 100.0 ** (-torch.arange(half) / half)[None]
    angles = torch.cat((angles, angles), -1)
    causal = torch.full((SEQ, SEQ), float("-inf")).triu(1) if mask else torch.zeros(SEQ, SEQ)
    return dict(position_embeddings=(angles.cos(), angles.sin()), attention_mask=causal)


@pytest.mark.kernel
def test_block_passes_positional_and_keyword_arguments_to_its_mixer():
    block = fuseblock.PreNormBlock(SideAttention(DIM), DIM)
    side = side_inputs()
    pos, mask = side["position_embeddings"], side["attention_mask"]
    h, r = torch.randn(BATCH, SEQ, DIM), torch.randn(BATCH, SEQ, DIM)
    out, new_r = block(h, r, pos, attention_mask=mask)
    normed, want_r = block.norm(h, r)
    assert torch.equal(new_r, want_r)
    assert torch.equal(out, block.mixer(normed, pos, attention_mask=mask))
    assert torch.equal(block(h, r, **side)[0], out)  # the same by keyword
    assert not torch.allclose(block(h, r, **side_inputs(mask=False))[0], out)  # the mask reached the mixer
    x = torch.randn(BATCH, SEQ, DIM)
    assert torch.equal(block.naive(x, pos, attention_mask=mask), x + block.mixer(block.norm.naive(x), **side))


@pytest.mark.kernel
def test_block_with_a_tuple_returning_mixer():
    """A mixer returning (out, weights): the block returns (out, residual, weights)."""
    block = fuseblock.PreNormBlock(SideAttention(DIM, return_weights=True), DIM)
    h, r, side = torch.randn(BATCH, SEQ, DIM), torch.randn(BATCH, SEQ, DIM), side_inputs()
    got = block(h, r, **side)
    assert isinstance(got, tuple) and len(got) == 3
    out, new_r, weights = got
    normed, want_r = block.norm(h, r)
    want_out, want_w = block.mixer(normed, **side)
    assert torch.equal(out, want_out) and torch.equal(new_r, want_r) and torch.equal(weights, want_w)
    assert weights.shape == (BATCH, HEADS, SEQ, SEQ) and torch.all(weights.triu(1) == 0)  # causal
    x = torch.randn(BATCH, SEQ, DIM)
    naive_x, naive_w = block.naive(x, **side)
    want_out, want_w = block.mixer(block.norm.naive(x), **side)
    assert torch.equal(naive_x, x + want_out) and torch.equal(naive_w, want_w)


@pytest.mark.kernel
@pytest.mark.parametrize("return_weights", [False, True], ids=["tensor", "tuple"])
def test_stack_forwards_keyword_arguments_fused_equals_naive(return_weights):
    """forward(x, **kwargs) gives every mixer the side inputs, in both forms, with every
    gradient; of a tuple the stack keeps the first element."""
    mixers = [SideAttention(DIM, return_weights=return_weights), SideMLP(DIM), SideAttention(DIM)]
    stack = fuseblock.ResidualStack(mixers, DIM, kind="layer")
    with torch.no_grad():
        for name, p in stack.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(BATCH, SEQ, DIM)
    fused = check_equivalent(stack, x, tol=TOL_FP32, **side_inputs())
    assert isinstance(fused[0], torch.Tensor)
    assert rel_err(stack(x, **side_inputs(mask=False)), fused[0]) > 1e-2  # the mask reached the mixers
    with pytest.raises(TypeError, match="attention_mask"):
        stack(x, position_embeddings=side_inputs()["position_embeddings"])


class PlainMLP(MLP):
    """An MLP as people write it: forward(x), no **kwargs to swallow a stack's side inputs."""


class RecordingMixer(nn.Module):
    """Takes **kwargs, so it is handed every keyword; keeps their names."""

    def __init__(self, dim):
        super().__init__()
        self.lin, self.seen = nn.Linear(dim, dim), []

    def forward(self, x, **kwargs):
        self.seen.append(sorted(kwargs))
        return self.lin(x)


@pytest.mark.kernel
def test_each_mixer_gets_the_keywords_its_forward_accepts():
    """An MLP with forward(x) beside attention fed a mask and rotary embeddings: fused equals
    naive equals fp64, every gradient; a **kwargs mixer is handed them all."""
    mixers = [SideAttention(DIM), PlainMLP(DIM), SideAttention(DIM, return_weights=True), RecordingMixer(DIM)]
    stack = fuseblock.ResidualStack(mixers, DIM, kind="layer")
    x = torch.randn(BATCH, SEQ, DIM)
    fused = check_equivalent(stack, x, tol=TOL_FP32, **side_inputs())
    assert rel_err(stack(x, **side_inputs(mask=False)), fused[0]) > 1e-2  # the mask reached the attention
    assert mixers[3].seen and all(s == ["attention_mask", "position_embeddings"] for s in mixers[3].seen)


def test_a_keyword_no_mixer_accepts_is_a_type_error():
    stack = fuseblock.ResidualStack([SideAttention(DIM), PlainMLP(DIM)], DIM)
    with pytest.raises(TypeError, match="'atention_mask'.*no mixer"):
        stack(torch.randn(BATCH, SEQ, DIM), position_embeddings=side_inputs()["position_embeddings"],
              atention_mask=side_inputs()["attention_mask"])
    with pytest.raises(TypeError, match="'x'"):  # the block's own argument is never a side input
        fuseblock.ResidualStack([PlainMLP(DIM)], DIM)(torch.randn(BATCH, SEQ, DIM), x=1)


class PrenormMixer(nn.Module):
    """A mixer that fuses the block's norm (fuses_prenorm) and takes a scale by keyword."""

    fuses_prenorm = True

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x, residual=None, prenorm=None, *, scale=1.0):
        if prenorm is None:
            return scale * self.lin(x)
        normed, residual = prenorm(x, residual)
        return scale * self.lin(normed), residual


@pytest.mark.kernel
def test_a_fuses_prenorm_mixer_gets_its_keywords_but_never_residual_or_prenorm():
    stack = fuseblock.ResidualStack([PrenormMixer(DIM), PlainMLP(DIM)], DIM)
    x = torch.randn(BATCH, SEQ, DIM)
    check_equivalent(stack, x, tol=TOL_FP32, scale=torch.tensor(0.5))
    assert rel_err(stack(x, scale=0.5), stack(x)) > 1e-2
    for name in ("residual", "prenorm"):
        with pytest.raises(TypeError, match=f"'{name}'.*no mixer"):
            stack(x, **{name: None})


def test_the_signature_is_read_once_per_mixer(monkeypatch):
    import fuseblock.stream as stream

    reads = []
    monkeypatch.setattr(stream.inspect, "signature", lambda f, s=stream.inspect.signature: reads.append(f) or s(f))
    stack = fuseblock.ResidualStack([SideAttention(DIM), PlainMLP(DIM)], DIM)
    assert len(reads) == 2
    x = torch.randn(BATCH, SEQ, DIM)
    for _ in range(3):
        stack(x, **side_inputs())
    stack.fused = False
    stack(x, **side_inputs())
    assert len(reads) == 2
    stack.blocks[1].mixer = RecordingMixer(DIM)  # a replaced mixer is read anew, once
    for _ in range(2):
        stack(x, **side_inputs())
    assert len(reads) == 3 and stack.blocks[1].mixer.seen[-1] == ["attention_mask", "position_embeddings"]


@pytest.mark.kernel
@pytest.mark.parametrize("fused", [True, False])
def test_return_extras_gives_each_mixers_tail(fused):
    """return_extras=True: (out, extras), extras[k] the tail of mixers[k]'s tuple, () for a
    tensor; the same out as without, and the weights those the mixers see in a loop of blocks."""
    mixers = [SideAttention(DIM, return_weights=True), PlainMLP(DIM), SideAttention(DIM, return_weights=True)]
    stack = make_side_stack(mixers, fused=fused)
    x, side = torch.randn(BATCH, SEQ, DIM), side_inputs()
    plain = stack(x, **side)
    stack.return_extras = True
    out, extras = stack(x, **side)
    assert isinstance(plain, torch.Tensor) and torch.equal(out, plain)
    assert isinstance(extras, tuple) and len(extras) == 3 and extras[1] == ()
    assert all(len(e) == 1 and e[0].shape == (BATCH, HEADS, SEQ, SEQ) for e in (extras[0], extras[2]))
    # the loop of blocks, written out (fused) or naive, sees the same weights
    h, r, want = x, None, []
    for blk in stack.blocks:
        h, r, *rest = blk(h, r, **{k: v for k, v in side.items() if not isinstance(blk.mixer, PlainMLP)})
        want.append(tuple(rest))
    for got, w in zip(extras, want, strict=True):
        assert len(got) == len(w) and all(rel_err(g, ww) <= TOL_FP32 for g, ww in zip(got, w, strict=True))
    # and the gradient flows through an extra: d|weights|^2/dx equals the other form's
    x.requires_grad_(True)
    twin = naive_twin(stack)
    twin.fused = not fused
    g = torch.autograd.grad((stack(x, **side)[1][2][0] ** 2).sum(), x)[0]
    g_naive = torch.autograd.grad((twin(x, **side)[1][2][0] ** 2).sum(), x)[0]
    assert rel_err(g, g_naive) <= 2 * TOL_FP32 and g.abs().max() > 0


def make_side_stack(mixers, **kw):
    stack = fuseblock.ResidualStack(mixers, DIM, **kw)
    with torch.no_grad():
        for name, p in stack.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return stack


@pytest.mark.kernel
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("final_norm", [True, False])
def test_a_mixer_of_the_wrong_width_is_named(fused, final_norm):
    """Not "x's last dim": the mixer, its index and both widths."""
    x = torch.randn(BATCH, SEQ, 8)
    stack = fuseblock.ResidualStack([nn.Linear(8, 4)], 8, fused=fused, final_norm=final_norm)
    with pytest.raises(ValueError, match=r"mixers\[0\] \(Linear\) maps last dim 8 to 4"):
        stack(x)
    stack = fuseblock.ResidualStack([nn.Linear(8, 8), nn.Linear(8, 16)], 8, fused=fused, final_norm=final_norm)
    with pytest.raises(ValueError, match=r"mixers\[1\] \(Linear\) maps last dim 8 to 16"):
        stack(x)


class ReturnsNone(nn.Module):
    def forward(self, x):
        return None


@pytest.mark.kernel
@pytest.mark.parametrize("fused", [True, False])
def test_a_mixer_that_returns_no_tensor_is_named(fused):
    stack = fuseblock.ResidualStack([nn.Linear(8, 8), ReturnsNone()], 8, fused=fused)
    with pytest.raises(TypeError, match=r"mixers\[1\] \(ReturnsNone\) returned NoneType"):
        stack(torch.randn(BATCH, SEQ, 8))


@pytest.mark.kernel
def test_compile_fullgraph_with_side_inputs_and_extras():
    """The keyword routing and the extras compile with no graph break."""
    torch._dynamo.reset()
    stack = fuseblock.ResidualStack([SideAttention(DIM, return_weights=True), PlainMLP(DIM)], DIM, return_extras=True)
    x, side = torch.randn(BATCH, SEQ, DIM), side_inputs()
    got, got_extras = torch.compile(stack, fullgraph=True, backend="aot_eager")(x, **side)
    want, want_extras = stack(x, **side)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_extras[1] == () and len(got_extras[0]) == 1
    torch.testing.assert_close(got_extras[0][0], want_extras[0][0], rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


# ----------------------------------------------------------------- bad arguments
@pytest.mark.parametrize(
    "arg,call,exc",
    [
        ("mixer", lambda: fuseblock.PreNormBlock(lambda x: x, DIM), TypeError),
        ("residual_dtype", lambda: fuseblock.PreNormBlock(MLP(DIM), DIM, residual_dtype="fp32"), TypeError),
        ("kind", lambda: fuseblock.PreNormBlock(MLP(DIM), DIM, kind="batch"), ValueError),
        ("dim", lambda: fuseblock.PreNormBlock(MLP(DIM), 0), ValueError),
        ("dim", lambda: fuseblock.ResidualStack([MLP(DIM)], 2.0), TypeError),
        ("weight_offset", lambda: fuseblock.PreNormBlock(MLP(DIM), DIM, weight_offset="1"), TypeError),
        ("bias", lambda: fuseblock.ResidualStack([MLP(DIM)], DIM, bias="yes"), TypeError),
        ("mixers", lambda: fuseblock.ResidualStack(MLP(DIM), DIM), TypeError),
        ("mixers", lambda: fuseblock.ResidualStack(3, DIM), TypeError),
        ("mixers", lambda: fuseblock.ResidualStack([], DIM), ValueError),
        ("mixers", lambda: fuseblock.ResidualStack(nn.ModuleList(), DIM), ValueError),
        (r"mixers\[1\]", lambda: fuseblock.ResidualStack([MLP(DIM), "mlp"], DIM), TypeError),
        ("fused", lambda: fuseblock.ResidualStack([MLP(DIM)], DIM, fused="yes"), TypeError),
        ("final_norm", lambda: fuseblock.ResidualStack([MLP(DIM)], DIM, final_norm=None), TypeError),
        ("return_extras", lambda: fuseblock.ResidualStack([MLP(DIM)], DIM, return_extras=1), TypeError),
        ("residual_dtype", lambda: fuseblock.ResidualStack([MLP(DIM)], DIM, residual_dtype=torch.int8), TypeError),
        ("eps", lambda: fuseblock.ResidualStack([MLP(DIM)], DIM, eps=-1.0), ValueError),
    ],
)
def test_bad_arguments(arg, call, exc):
    with pytest.raises(exc, match=arg):
        call()


def test_module_containers_are_stacks_of_their_children():
    mixers = make_mixers(3)
    for container in (nn.ModuleList(mixers), nn.Sequential(*mixers)):
        stack = fuseblock.ResidualStack(container, DIM)
        assert [b.mixer for b in stack.blocks] == mixers
        assert all(isinstance(b, fuseblock.PreNormBlock) and isinstance(b.norm, fuseblock.Norm) for b in stack.blocks)
    assert isinstance(stack.blocks, nn.ModuleList) and isinstance(stack.norm_f, fuseblock.Norm)
