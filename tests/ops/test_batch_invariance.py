"""Batch invariance: a row's results do not depend on which other rows share the call.

vLLM's test pattern (its RMSNorm picked a block size from the token count, and 79 of
4,096 rows changed): (a) one row alone against the same row first in a batch of 1 + 3
and of 1 + 299 rows; (b) a 255-row call against the first 255 rows of a 300-row call.
Every output, the new residual and, in backward, every per-row gradient (dx, dresidual,
dx1, dgate) must be bitwise equal (rtol = atol = 0). The weights' gradients are sums
over the rows, different by construction for different batches: test_deterministic.py.

Every op and variant, fp32 / bf16 / fp16, on both paths; rows narrow (the tile kernels)
and wide (`small_wide_rows`: the wide-row kernels at a few dozen columns, kernel path).
One 300-row set of inputs per dtype and width, sliced for each call.
"""
import functools

import pytest
import torch
from helpers import generator

import fuseblock
from fuseblock.compat.flash_attn import layer_norm_fn, rms_norm_fn

pytestmark = pytest.mark.kernel

# one row alone, 1 + 3, then (b)'s two calls, the larger also (a)'s 1 + 299. The wide-row
# kernels loop over every row's column chunks, a slow thing to interpret: there (a) is
# 1 + 3 and 1 + 19, (b) 15 of 20 rows, which still split the rows among different
# program counts (H100_SMS = 2 under small_wide_rows: 1 and 4 forward programs, 1 to 3
# backward ones a column chunk).
SIZES = {"narrow": (1, 4, 255, 300), "wide": (1, 4, 15, 20)}
D = {"narrow": 48, "wide": 40}  # wide: 5 column chunks of 8 under small_wide_rows


@functools.cache
def _inputs(dtype, d):
    g = generator(1234)

    def t(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(dtype)

    acts = dict(x=t(300, d, scale=2.0, shift=0.5), r=t(300, d), x1=t(300, d), z=t(300, d),
                dout=t(300, d), dres=t(300, d))
    params = dict(w=t(d, shift=1.0), b=t(d), bw=t(d, shift=1.0), bb=t(d))
    return acts, params


# Each variant: (activations sliced to n rows, parameters) -> its outputs, a tuple.
# The activations it differentiates by are named in GRAD.
VARIANTS = {
    "norm_rms": lambda a, p: (fuseblock.norm(a["x"], p["w"]),),
    "norm_layer": lambda a, p: (fuseblock.norm(a["x"], p["w"], p["b"], kind="layer"),),
    "norm_l2": lambda a, p: (fuseblock.norm(a["x"], p["w"], kind="l2"),),
    "norm_groups": lambda a, p: (fuseblock.norm(a["x"], p["w"], p["b"], kind="layer", num_groups=4),),
    "norm_gate": lambda a, p: (fuseblock.norm(a["x"], p["w"], gate=a["z"], gate_act="silu", gate_position="post"),),
    "add_norm_rms": lambda a, p: fuseblock.add_norm(a["x"], a["r"], p["w"]),
    "add_norm_layer": lambda a, p: fuseblock.add_norm(a["x"], a["r"], p["w"], p["b"], kind="layer"),
    "add_norm_fp32_residual": lambda a, p: fuseblock.add_norm(a["x"], a["r"], p["w"],
                                                              residual_dtype=torch.float32),
    "add_norm_alpha_x1": lambda a, p: fuseblock.add_norm(a["x"], a["r"], p["w"], alpha=0.75, x1=a["x1"]),
    "add_norm_gate_pre": lambda a, p: fuseblock.add_norm(a["x"], a["r"], p["w"], gate=a["z"], gate_act="sigmoid",
                                                         gate_position="pre"),
    "add_norm_groups": lambda a, p: fuseblock.add_norm(a["x"], a["r"], p["w"], kind="rms", num_groups=2),
    "add_norm_weight_offset": lambda a, p: fuseblock.add_norm(a["x"], a["r"], p["w"], p["b"], kind="layer",
                                                              weight_offset=1.0),
    "norm_add_rms": lambda a, p: (fuseblock.norm_add(a["x"], a["r"], p["w"], alpha=0.5),),
    "norm_add_layer": lambda a, p: (fuseblock.norm_add(a["x"], a["r"], p["w"], p["b"], kind="layer"),),
    "norm_add_norm_rms": lambda a, p: fuseblock.norm_add_norm(a["x"], a["r"], p["bw"], p["w"], weight_offset=1.0),
    "norm_add_norm_layer": lambda a, p: fuseblock.norm_add_norm(a["x"], a["r"], p["bw"], p["w"], p["bb"], p["b"],
                                                                kind="layer"),
    "flash_attn_rms_norm_fn": lambda a, p: rms_norm_fn(a["x"], p["w"], None, residual=a["r"], prenorm=True,
                                                       zero_centered_weight=True),
    "flash_attn_layer_norm_fn": lambda a, p: layer_norm_fn(a["x"], p["w"], p["b"], residual=a["r"], x1=a["x1"],
                                                           prenorm=True, residual_in_fp32=False),
}
GRAD = {name: ("x",) for name in VARIANTS}
for name in VARIANTS:
    if name.startswith(("add_norm", "norm_add", "flash")):
        GRAD[name] = ("x", "r")
GRAD["add_norm_alpha_x1"] = ("x", "r", "x1")
GRAD["flash_attn_layer_norm_fn"] = ("x", "r", "x1")
GRAD["norm_gate"] = ("x", "z")
GRAD["add_norm_gate_pre"] = ("x", "r", "z")

# Every variant at fp32 and narrow rows; the half dtypes and the wide-row kernels on the
# variants whose kernel code differs (a representative of each kernel and flag family).
HALF = ["norm_layer", "norm_gate", "add_norm_fp32_residual", "add_norm_alpha_x1", "add_norm_groups",
        "norm_add_rms", "norm_add_norm_layer", "flash_attn_rms_norm_fn"]
FP16 = ["norm_layer", "add_norm_alpha_x1", "norm_add_norm_layer"]
# The torch path's gates are not invariant: torch's CPU sigmoid and silu round differently
# in their SIMD body and in the scalar code of a tensor's tail, and which elements fall
# in the tail depends on the tensor's size (docs/math.md, "Batch invariance").
GATED = pytest.mark.kernel_only("torch's CPU sigmoid/silu: SIMD body and scalar tail round differently")


def _marks(name):
    return [GATED] if "gate" in name else []


CASES = [pytest.param(name, torch.float32, "narrow", id=f"{name}-fp32-narrow", marks=_marks(name))
         for name in VARIANTS]
CASES += [pytest.param(name, dt, "narrow", id=f"{name}-{str(dt)[6:]}-narrow", marks=_marks(name))
          for name in HALF for dt in (torch.bfloat16, torch.float16) if dt == torch.bfloat16 or name in FP16]
WIDE = [("norm_layer", torch.float32), ("norm_gate", torch.bfloat16), ("add_norm_alpha_x1", torch.float32),
        ("add_norm_groups", torch.bfloat16), ("norm_add_layer", torch.float32), ("norm_add_norm_rms", torch.bfloat16)]
CASES += [pytest.param(name, dt, "wide", id=f"{name}-{str(dt)[6:]}-wide",
                       marks=pytest.mark.kernel_only("the wide-row kernels: the torch path has one form"))
          for name, dt in WIDE]


def _run(name, dtype, d, n):
    """The variant on the first n rows: (outputs, per-row gradients), all detached."""
    acts, params = _inputs(dtype, d)
    a = {k: v[:n].clone().requires_grad_(k in GRAD[name]) for k, v in acts.items()}
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    outs = VARIANTS[name](a, p)
    seeds = [a["dout"], a["dres"]]
    loss = sum((o.float() * s.float()).sum() for o, s in zip(outs, seeds, strict=False))
    grads = torch.autograd.grad(loss, [a[k] for k in GRAD[name]])
    return [o.detach() for o in outs], [g.detach() for g in grads]


def _equal(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    same = got.view(torch.uint8 if got.element_size() == 1 else torch.int16 if got.element_size() == 2
                    else torch.int32 if got.element_size() == 4 else torch.int64)
    ref = want.view(same.dtype)
    bad = (same != ref).reshape(-1, got.shape[-1]).any(-1)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} rows differ bitwise"


@pytest.mark.parametrize("name,dtype,width", CASES)
def test_batch_invariant(name, dtype, width, request):
    if width == "wide":
        request.getfixturevalue("small_wide_rows")
    d = D[width]
    one, few, part, full = SIZES[width]
    runs = {n: _run(name, dtype, d, n) for n in SIZES[width]}
    lone_outs, lone_grads = runs[one]
    for n in (few, full):  # (a): the lone row, first in a batch of 1 + 3 and 1 + 299
        outs, grads = runs[n]
        for i, (got, want) in enumerate(zip(outs, lone_outs, strict=True)):
            _equal(got[:1], want, f"output {i}, row 0 of {n} against it alone")
        for k, got, want in zip(GRAD[name], grads, lone_grads, strict=True):
            _equal(got[:1], want, f"d{k}, row 0 of {n} against it alone")
    outs, grads = runs[full]  # (b): 255 rows against the first 255 of 300
    for i, (got, want) in enumerate(zip(runs[part][0], outs, strict=True)):
        _equal(got, want[:part], f"output {i}, {part} rows against the first {part} of {full}")
    for k, got, want in zip(GRAD[name], runs[part][1], grads, strict=True):
        _equal(got, want[:part], f"d{k}, {part} rows against the first {part} of {full}")


@pytest.mark.kernel_only("the kernels' layouts: a launcher that picked blocks from the row count would fail")
def test_invariance_check_catches_a_row_count_dependent_layout(monkeypatch):
    # The check above must be able to fail: a launcher that sends a lone row to the
    # wide-row kernel (a layout chosen by the row count, as vLLM's was) breaks it.
    import fuseblock.kernels.launch as L
    import fuseblock.kernels.norm as K

    monkeypatch.setattr(L, "LOOP_BLOCK", 16)
    real = K.fwd_layout
    rows = {"n": 0}
    monkeypatch.setattr(K, "fwd_layout",
                        lambda d, groups=1, **kw: L.loop_layout(d) if rows["n"] == 1 else real(d, groups, **kw))
    x, w = torch.randn(20, 96), torch.randn(96)
    rows["n"] = 20
    full = fuseblock.norm(x, w, kind="layer")
    rows["n"] = 1
    alone = fuseblock.norm(x[:1], w, kind="layer")
    assert not torch.equal(alone[0], full[0]), "a different layout gave the same bits: the check would be blind"
