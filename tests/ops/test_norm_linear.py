"""fuseblock.norm_linear / NormLinear: y = Linear(norm(x + residual)) as one autograd node
that keeps p and the row statistics for backward, never the normalized output.

Values and every gradient against the composition in fp64 (tests/ref64.py, then
F.linear) and against the unfused fuseblock.add_norm + F.linear in the same dtype; what
is saved for backward; the torch path's backward (reference.norm_grads) against autograd;
the GPT's activation memory against its naive twin (the figure `bench.py memory`
reports); torch.compile, torch.func, autocast; bad arguments.
"""
import gc

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, KERNEL_PATH, assert_close, generator
from ref64 import add_norm64, leaf64
from trainutil import ROOT

import fuseblock
from fuseblock import NormLinear, norm_linear

D, N = 16, 12  # norm width, Linear outputs


def _inputs(dtype, *, residual, norm_bias, bias, residual_dtype=None, shape=(2, 5)):
    x = torch.randn(*shape, D, dtype=dtype)
    r = torch.randn(*shape, D, dtype=residual_dtype or dtype) if residual else None
    nw = (1 + 0.3 * torch.randn(D)).to(dtype)
    nb = (0.2 * torch.randn(D)).to(dtype) if norm_bias else None
    w = (torch.randn(N, D) / 4).to(dtype)
    b = (0.1 * torch.randn(N)).to(dtype) if bias else None
    return [t if t is None else t.requires_grad_(True) for t in (x, r, nw, nb, w, b)]


def _loss(y, new_res, gy, gr):
    return (y.double() * gy).sum() + (new_res.double() * gr).sum()


def _grads(y, new_res, leaves, seed=1):
    g = generator(seed)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    gr = torch.randn(new_res.shape, generator=g, dtype=torch.float64)
    present = [t for t in leaves if t is not None]
    found = iter(torch.autograd.grad(_loss(y, new_res, gy, gr), present))
    return [None if t is None else next(found) for t in leaves]


NAMES = ("x", "residual", "norm_weight", "norm_bias", "weight", "bias")


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("residual", [False, True], ids=["no-residual", "residual"])
@pytest.mark.parametrize("affine", ["plain", "biases", "offset"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_values_and_every_gradient_match_the_composition_in_fp64(kind, residual, affine, dtype):
    """affine: "plain" (norm weight, Linear without bias), "biases" (norm and Linear
    biases), "offset" (weight_offset=1: Gemma's 1 + w, with a Linear bias)."""
    offset = 1.0 if affine == "offset" else 0.0
    leaves = _inputs(dtype, residual=residual, norm_bias=affine == "biases", bias=affine != "plain")
    x, r, nw, nb, w, b = leaves
    y, new_res = norm_linear(x, r, nw, nb, w, b, kind=kind, weight_offset=offset)
    assert y.shape == (2, 5, N) and y.dtype == dtype and new_res.dtype == dtype
    if not residual:
        assert new_res is x  # nothing stored: new_residual is x itself, as in add_norm

    refs = [leaf64(t) for t in leaves]
    x64, r64, nw64, nb64, w64, b64 = refs
    out64, p64 = add_norm64(x64, r64, nw64 + offset, nb64, kind=kind)
    y64 = F.linear(out64, w64, b64)
    assert_close(y, y64, dtype, "y")
    assert_close(new_res, p64, dtype, "new_residual")
    for name, g, rg, t in zip(NAMES, _grads(y, new_res, leaves), _grads(y64, p64, refs), leaves, strict=True):
        if t is not None:
            assert g.dtype == t.dtype, name
            assert_close(g, rg, dtype, f"d{name}")


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_bf16_activations_over_an_fp32_stream(kind):
    """The GPT's mixed case: bf16 x and Linear, fp32 residual. new_residual is exactly the
    unfused add_norm's and y the unfused Linear's to an ulp of the bf16 output; y and
    every gradient within bf16's tolerance of the fp64 composition, and every gradient
    the unfused ops' to fp32 rounding: the backward rebuilds the norm's bf16 output, which
    rounds as the forward's did (bit for bit on the kernel path, 20 seeds; under an
    interpreter that truncated the forward's output dW moved by up to 7.8e-3 of its largest)."""
    leaves = _inputs(torch.bfloat16, residual=True, norm_bias=True, bias=True, residual_dtype=torch.float32)
    x, r, nw, nb, w, b = leaves
    y, new_res = norm_linear(x, r, nw, nb, w, b, kind=kind)
    assert y.dtype == torch.bfloat16 and new_res.dtype == torch.float32
    out, res2 = fuseblock.add_norm(x, r, nw, nb, kind=kind, residual_dtype=torch.float32)
    torch.testing.assert_close(new_res, res2, atol=0, rtol=0)
    torch.testing.assert_close(y, F.linear(out, w, b), atol=2e-2, rtol=2e-2)
    grads = _grads(y, new_res, leaves)
    for name, g, u in zip(NAMES, grads, _grads(F.linear(out, w, b), res2, leaves), strict=True):
        torch.testing.assert_close(g, u, atol=1e-6, rtol=1e-6, msg=lambda m, name=name: f"d{name}: {m}")
    refs = [leaf64(t) for t in leaves]
    out64, p64 = add_norm64(refs[0], refs[1], refs[2], refs[3], kind=kind, residual_dtype=torch.float32)
    y64 = F.linear(out64, refs[4], refs[5])
    assert_close(y, y64, torch.bfloat16, "y", cond=2.0)
    for name, g, rg, t in zip(NAMES, grads, _grads(y64, p64, refs), leaves, strict=True):
        assert g.dtype == t.dtype, name
        assert_close(g, rg, torch.bfloat16, f"d{name}", cond=2.0)


@pytest.mark.kernel
@pytest.mark.kernel_only("counts Triton launches")
def test_kernel_path_one_forward_launch_and_one_recompute_in_backward(launches):
    x, r, nw, nb, w, b = _inputs(torch.float32, residual=True, norm_bias=True, bias=True)
    y, new_res = norm_linear(x, r, nw, nb, w, b, kind="layer")
    assert launches("fwd", "bwd") == (1, 0)
    _grads(y, new_res, [x, r, nw, nb, w, b])
    assert launches("fwd", "bwd") == (2, 1)  # the rebuilt output for dW, then the norm's backward


@pytest.mark.parametrize("kind,c,offset,native", [
    ("rms", None, 0.0, False), ("layer", None, 1.0, False), ("layer", None, 1.0, True), ("l2", None, 0.0, False),
    ("rms", 2.0, 0.5, False),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_the_torch_paths_backward_is_autograds(kind, c, offset, native, dtype):
    """reference.norm_grads, the one torch backward of the norm (norm_linear's, and the
    traffic tool's RMS norm's), from what norm_and_stats saved: the closed form (any
    norm) and torch's layer norm backward (the plain layer norm), against autograd
    through the reference's composition in fp64. c=2 and l2: a scale other than 1."""
    from fuseblock.reference import norm as reference
    from fuseblock.spec import NormSpec

    spec = NormSpec.of(D, kind=kind, c=c, eps=1e-6, num_groups=1, gate_act=None, gate_position=None,
                       weight_offset=offset)
    p, do = torch.randn(6, D, dtype=dtype), torch.randn(6, D, dtype=dtype)
    w, b = (1 + 0.3 * torch.randn(D)).to(dtype), (0.2 * torch.randn(D)).to(dtype)
    _, _, rstd, mean, ran_native = reference.norm_and_stats(p, None, w, b, spec, None)
    assert ran_native == (kind == "layer")
    r = None if native else reference.normalized(p, rstd, mean, spec)
    got = reference.norm_grads(do, p, r, rstd, mean, w, b, spec, native, True, True)
    leaves = [leaf64(t) for t in (p, w, b)]
    out64 = reference.norm_out(leaves[0], None, leaves[1], leaves[2], spec)[0]
    for name, g, e in zip(("dp", "dw", "db"), got, torch.autograd.grad(out64, leaves, do.double()), strict=True):
        assert g.dtype == dtype, name
        assert_close(g, e, dtype, name)


def _saved(fn):
    """The tensors autograd saves while fn runs, and fn's result."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return saved, result


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_saves_p_and_row_statistics_not_the_normalized_output(kind):
    x, r, nw, nb, w, b = _inputs(torch.float32, residual=True, norm_bias=True, bias=True, shape=(8,))
    params = {t.data_ptr() for t in (nw, nb, w, b)}
    saved, (y, new_res) = _saved(lambda: norm_linear(x, r, nw, nb, w, b, kind=kind))
    activations = [t for t in saved if t.data_ptr() not in params]
    rows = [t for t in activations if t.numel() == x.numel()]
    stats = [t for t in activations if t.numel() == 8]
    assert len(rows) == 1 and rows[0].data_ptr() == new_res.data_ptr()  # p, which the stream keeps anyway
    assert len(stats) == (2 if kind == "layer" else 1) and len(activations) == len(rows) + len(stats)

    # the unfused ops keep the norm's output alive for the Linear's weight gradient
    saved2, out = _saved(lambda: fuseblock.add_norm(x, r, nw, nb, kind=kind)[0])
    saved2 += _saved(lambda: F.linear(out, w, b))[0]
    assert any(t.data_ptr() == out.data_ptr() for t in saved2)
    bytes_saved = sum(t.numel() * t.element_size() for t in activations)
    bytes_naive = sum({t.data_ptr(): t.numel() * t.element_size() for t in saved2 if t.data_ptr() not in params}
                      .values())
    assert bytes_naive - bytes_saved >= out.numel() * out.element_size()


# bench.py memory measures models on the CPU (the CPU profiler's memory events, a batch drawn
# by a CPU generator): under FUSEBLOCK_TEST_DEVICE=cuda it has nothing of the GPU's to count
ON_THE_CPU = pytest.mark.skipif(DEVICE != "cpu", reason="bench.py memory measures models on the CPU only")


@pytest.mark.kernel
@ON_THE_CPU
@pytest.mark.parametrize("norm,target", [("rms", 0.80), ("layer", 0.90)])
def test_gpt_activation_memory_per_layer_against_naive(norm, target, monkeypatch):
    """The fused GPT keeps at most 0.80x (RMS) / 0.90x (LayerNorm) of the naive twin's
    activation memory per layer per token, by both of `bench.py memory`'s measures,
    which agree."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchmarks.memory import per_layer

    naive, fused = (per_layer(norm, f, quick=True) for f in (False, True))
    for r in (naive, fused):
        assert r["bytes_per_layer_per_token"] == r["allocated_per_layer_per_token"] > 0
    assert fused["bytes_per_layer_per_token"] <= target * naive["bytes_per_layer_per_token"]


@pytest.mark.kernel
@ON_THE_CPU
@pytest.mark.parametrize("collector", ["off", "every_allocation"])
def test_the_memory_measures_agree_whenever_the_collector_runs(collector, monkeypatch):
    """Triton's interpreter leaves storages in reference cycles; `bench.py memory`'s
    allocated count must not depend on when the collector frees them (it did: the
    test above failed now and then in the full suite)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchmarks.memory import per_layer

    enabled, threshold = gc.isenabled(), gc.get_threshold()
    try:
        if collector == "off":
            gc.disable()
        else:
            gc.set_threshold(1, 1, 1)
        r = per_layer("layer", True, quick=True)
    finally:
        gc.set_threshold(*threshold)
        (gc.enable if enabled else gc.disable)()
    assert r["bytes_per_layer_per_token"] == r["allocated_per_layer_per_token"] > 0


def _fn(x, r, nw, nb, w, b):
    y, new_res = norm_linear(x, r, nw, nb, w, b, kind="layer")
    return y.sum(-1, keepdim=True) * new_res


@pytest.mark.kernel
def test_fullgraph_compile_matches_eager():
    torch._dynamo.reset()
    leaves = _inputs(torch.float32, residual=True, norm_bias=True, bias=True)
    explained = torch._dynamo.explain(_fn)(*leaves)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    # dynamo traces the Function's forward and backward into subgraphs of the one graph
    code = "".join(str(m.graph) for m in explained.graphs[0].modules() if hasattr(m, "graph"))
    if KERNEL_PATH:  # the kernels stay whole custom ops: the forward, the rebuilt output, the backward
        assert code.count("fuseblock.norm_fwd") == 2 and code.count("fuseblock.norm_bwd") == 1
    else:  # torch's own layer norm ops, which Inductor knows
        assert "fuseblock" not in code and "native_layer_norm_backward" in code
    compiled = torch.compile(_fn, fullgraph=True, backend="aot_eager")
    out, expected = compiled(*leaves), _fn(*leaves)
    torch.testing.assert_close(out, expected)
    got = torch.autograd.grad(out.square().sum(), leaves)
    for a, e in zip(got, torch.autograd.grad(expected.square().sum(), leaves), strict=True):
        torch.testing.assert_close(a, e)


@pytest.mark.kernel
def test_double_backward_is_refused():
    x, r, nw, nb, w, b = _inputs(torch.float32, residual=True, norm_bias=False, bias=True)
    y, _ = norm_linear(x, r, nw, nb, w, b)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


@pytest.mark.kernel
def test_torch_func_grad_sees_the_composition():
    x, r, nw, nb, w, b = (t.detach() for t in _inputs(torch.float32, residual=True, norm_bias=True, bias=True)
                          if t is not None)

    def loss(x):
        y, new_res = norm_linear(x, r, nw, nb, w, b, kind="layer")
        return y.square().sum() + new_res.sum()

    xr = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(loss(xr), xr)
    torch.testing.assert_close(torch.func.grad(loss)(x), expected)


@pytest.mark.kernel
def test_autocast_lowers_the_linear_as_it_does_unfused():
    """Under bf16 autocast with fp32 weights (train.py on CUDA): y in bf16, and every
    gradient in its parameter's dtype, close to the unfused ops under the same autocast."""
    leaves = _inputs(torch.float32, residual=True, norm_bias=True, bias=True)
    x, r, nw, nb, w, b = leaves
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y, new_res = norm_linear(x, r, nw, nb, w, b)
    # a region of its own: torch 2.5's autocast would reuse the weight's bf16 copy cast
    # without grad inside norm_linear's forward, and the unfused w and b get no gradient
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out, res2 = fuseblock.add_norm(x, r, nw, nb)
        y2 = F.linear(out, w, b)
    assert y.dtype == y2.dtype == torch.bfloat16
    torch.testing.assert_close(y, y2)
    for name, g, g2, t in zip(NAMES, _grads(y, new_res, leaves), _grads(y2, res2, leaves), leaves, strict=True):
        assert g.dtype == t.dtype, name
        torch.testing.assert_close(g, g2, atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.kernel
def test_module_parameters_forward_and_state_dict():
    m = NormLinear(D, N, kind="layer", norm_bias=True, weight_offset=1.0, residual_dtype=torch.float64)
    assert set(m.state_dict()) == {"weight", "bias", "norm_weight", "norm_bias"}
    assert torch.equal(m.norm_weight, torch.zeros(D))  # weight_offset + norm_weight = 1
    ref = torch.nn.Linear(D, N)
    assert m.weight.shape == ref.weight.shape and m.bias.shape == ref.bias.shape
    missing = m.load_state_dict(ref.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["norm_bias", "norm_weight"] and torch.equal(m.weight, ref.weight)
    with torch.no_grad():
        m.norm_weight.normal_()
        m.norm_bias.normal_()
    x, r = torch.randn(3, D), torch.randn(3, D)
    y, new_res = m(x, r)
    out, res2 = fuseblock.add_norm(x, r, m.norm_weight, m.norm_bias, kind="layer", weight_offset=1.0,
                                   residual_dtype=torch.float64)
    assert new_res.dtype == torch.float64 and torch.equal(new_res, res2)
    torch.testing.assert_close(y, F.linear(out, m.weight, m.bias))
    assert "kind='layer'" in repr(m) and "weight_offset=1.0" in repr(m)


@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_meta_build_to_empty_and_reset_parameters_equals_eager(weight_offset):
    """FSDP2's deferred init: every parameter, the norm's too, comes back from
    reset_parameters() (the norm's were left uninitialised memory before)."""
    torch.manual_seed(0)
    eager = NormLinear(D, N, kind="layer", norm_bias=True, weight_offset=weight_offset)
    meta = NormLinear(D, N, kind="layer", norm_bias=True, weight_offset=weight_offset, device="meta")
    meta.to_empty(device="cpu")
    with torch.no_grad():
        for p in meta.parameters():
            p.fill_(float("nan"))
    torch.manual_seed(0)
    meta.reset_parameters()
    for name, p in eager.state_dict().items():
        assert torch.equal(meta.state_dict()[name], p), name


def test_bad_arguments_name_the_argument():
    x, r, nw, nb, w, b = (t.detach() for t in _inputs(torch.float32, residual=True, norm_bias=True, bias=True))
    with pytest.raises(ValueError, match="weight must have shape"):
        norm_linear(x, r, nw, nb, w.t(), b)
    with pytest.raises(TypeError, match="weight must have x's dtype"):
        norm_linear(x, r, nw, nb, w.double(), b.double())
    with pytest.raises(ValueError, match="bias must be"):
        norm_linear(x, r, nw, nb, w, b[:3])
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        norm_linear(x, r, nw[:3], nb, w, b)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        norm_linear(x, r[:1], nw, nb, w, b)
    with pytest.raises(ValueError, match="kind"):
        norm_linear(x, r, nw, nb, w, b, kind="batch")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        norm_linear(x.tolist(), r, nw, nb, w, b)
    with pytest.raises(ValueError, match="in_features"):
        NormLinear(0, 3)
    with pytest.raises(TypeError, match="norm_bias"):
        NormLinear(4, 3, norm_bias="yes")
    with pytest.raises(ValueError, match="eps"):
        NormLinear(4, 3, eps=-1.0)
    with pytest.raises(ValueError, match="last dim"):
        NormLinear(4, 3)(torch.randn(2, 5))
