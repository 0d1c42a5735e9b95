"""Scaled fp8 outputs (quant=...): codes and scales bitwise equal to torchao's casts of the
unfused normed output, on both paths; the integer encoding against torch's casts over
every e4m3/e5m2 code, the ties between them, subnormals and the saturation edge; bad input.

fp8 data is compared as uint8 views (NaN codes compare too)."""
import os

import pytest
import torch
from helpers import generator

import fuseblock
from fuseblock import Fp8Recipe, Quantized

torchao = pytest.importorskip("torchao")
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import LinearMMConfig, hp_tensor_and_scale_to_float8  # noqa: E402
from torchao.float8.float8_utils import amax_to_scale  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
MODES = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}


def u8(t):
    return t.view(torch.uint8)


def case(rows=6, d=96, dtype=torch.float32, seed=0):
    """x with a zero row, and a weight spanning 2**-30..2**20 with a zero block of 32
    columns: amax-0 rows and blocks, subnormal codes, scales far from 1, saturation."""
    g = generator(seed)
    x = torch.randn(rows, d, generator=g)
    x[1] = 0.0
    w = torch.randn(d, generator=g) * torch.exp2(torch.randint(-30, 21, (d,), generator=g).float())
    w[32:64] = 0.0
    return x.to(dtype), w.to(dtype)


def unfused(x, w, quant_from=None, **kw):
    """The unfused pipeline: the same path's norm stored in fp32 (or rounded to
    quant_from, as torch rounds), then cast by torchao."""
    o = fuseblock.norm(x, w, out_dtype=torch.float32, **kw)
    return o if quant_from is None else o.to(quant_from).float()


@pytest.mark.kernel
@pytest.mark.parametrize("fp8_dtype", [E4, E5])
@pytest.mark.parametrize("quant_from", [None, torch.bfloat16])
def test_fp8_row_equals_torchao_rowwise(fp8_dtype, quant_from):
    x, w = case(dtype=torch.bfloat16 if quant_from else torch.float32)
    q = fuseblock.norm(x, w, quant=Fp8Recipe("fp8_row", fp8_dtype=fp8_dtype, quant_from=quant_from))
    assert isinstance(q, Quantized) and q.data.dtype == fp8_dtype and q.scale.shape == (6, 1)
    ref = hp_tensor_to_float8_dynamic(unfused(x, w, quant_from), fp8_dtype, LinearMMConfig(),
                                      scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1)
    assert torch.equal(u8(q.data), u8(ref._data))
    assert torch.equal(q.scale, ref._scale.reciprocal())  # the dequantization scale ~ amax/fmax


@pytest.mark.kernel
def test_norm_takes_scale_ub_as_add_norm():
    x, w = case()
    q = fuseblock.norm(x, w, quant=Fp8Recipe("fp8_row", scale_ub=0.25))
    o = unfused(x, w)
    s = amax_to_scale(o.abs().amax(-1, keepdim=True).clamp(max=0.25), E4)
    ref = hp_tensor_and_scale_to_float8(o, s, E4, axiswise_dim=-1)
    assert torch.equal(u8(q.data), u8(ref._data)) and torch.equal(q.scale, s.reciprocal())


@pytest.mark.kernel
def test_fp8_row_with_residual_and_scale_ub():
    x, w = case()
    res = torch.randn_like(x)
    q, new_res = fuseblock.add_norm(x, res, w, quant=Fp8Recipe("fp8_row", scale_ub=0.5))
    o = fuseblock.add_norm(x, res, w, out_dtype=torch.float32)[0]
    s = amax_to_scale(o.abs().amax(-1, keepdim=True).clamp(max=0.5), E4)
    ref = hp_tensor_and_scale_to_float8(o, s, E4, axiswise_dim=-1)
    assert torch.equal(u8(q.data), u8(ref._data)) and torch.equal(q.scale, s.reciprocal())
    assert torch.equal(new_res, x + res)
    assert (u8(q.data) & 0x7F).max() == 126  # rows bounded below their amax saturate at 448


@pytest.mark.kernel
@pytest.mark.parametrize("fp8_dtype", [E4, E5])
def test_fp8_tensor_equals_torchao_tensorwise(fp8_dtype):
    x, w = case()
    scale = torch.tensor([3e-3])
    q = fuseblock.norm(x, w, quant=Fp8Recipe("fp8_tensor", fp8_dtype=fp8_dtype), scale=scale)
    ref = hp_tensor_and_scale_to_float8(unfused(x, w), torch.reciprocal(scale), fp8_dtype)
    assert torch.equal(u8(q.data), u8(ref._data)) and q.scale is scale
    assert (u8(q.data) & 0x7F).max() == (126 if fp8_dtype == E4 else 123)  # saturated, not wrapped to NaN


@pytest.mark.kernel
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("quant_from", [None, torch.bfloat16])
def test_mxfp8_equals_torchao_to_mx(rounding, quant_from):
    x, w = case(dtype=torch.bfloat16 if quant_from else torch.float32)
    q = fuseblock.norm(x, w, quant=Fp8Recipe("mxfp8", mx_rounding=rounding, quant_from=quant_from))
    assert q.scale.dtype == torch.float8_e8m0fnu and q.scale.shape == (6, 3)
    scale, data = to_mx(unfused(x, w, quant_from), E4, 32, MODES[rounding])
    assert torch.equal(u8(q.data), u8(data))
    assert torch.equal(u8(q.scale), u8(scale))
    assert u8(q.scale)[:, 1].tolist() == [0] * 6  # the zero block: the least scale, codes 0


@pytest.mark.kernel
def test_mxfp8_grouped_layer_norm_with_gate():
    x, w = case(d=128)
    z = torch.randn_like(x)
    kw = dict(kind="layer", num_groups=2, gate=z)
    q = fuseblock.norm(x, w, quant="mxfp8", **kw)
    scale, data = to_mx(unfused(x, w, **kw), E4, 32, ScaleCalculationMode.FLOOR)
    assert torch.equal(u8(q.data), u8(data)) and torch.equal(u8(q.scale), u8(scale))


@pytest.mark.kernel
@pytest.mark.parametrize("fp8_dtype", [E4, E5])
def test_every_code_tie_subnormal_and_saturation_edge(fp8_dtype):
    """Values at every fp8 code, halfway between neighbours (ties to even, the carry into
    the exponent), an fp32 ulp either side, fp32 subnormals and beyond +-fmax, through
    fp8_tensor with scale 1 on an RMS norm that passes them through: x = v, weight = 1,
    c = sqrt(d) * rms(v) cannot pass them exactly, so the values enter as the weight of a
    constant-magnitude row instead (out = sign(x) * w)."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float()
    pos = codes[(codes >= 0) & codes.isfinite()].unique().sort().values
    mids = (pos[1:] + pos[:-1]) / 2
    fmax = torch.finfo(fp8_dtype).max
    v = torch.cat([pos, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                   torch.tensor([1e-40, 1e-45, fmax * 1.03, fmax * 1.07, 1e30, float("inf")])])
    v = torch.cat([v, -v[v != 0]])  # no -0.0: the kernel forms 0.0 + w (weight_offset), which is +0
    v = torch.nn.functional.pad(v, (0, (-v.numel()) % 32))
    x = torch.ones(1, v.numel())
    q = fuseblock.norm(x, v, eps=0.0, quant=Fp8Recipe("fp8_tensor", fp8_dtype=fp8_dtype), scale=torch.tensor([1.0]))
    assert torch.equal(u8(q.data[0]), u8(v.clamp(-fmax, fmax).to(fp8_dtype)))


@pytest.mark.kernel
def test_wide_rows_quantize_the_same():
    """A row wider than the forward tile takes the loop kernel and the cast after it."""
    from fuseblock.kernels.launch import MAX_TILE_FWD
    x = torch.randn(2, MAX_TILE_FWD + 32)
    q = fuseblock.norm(x, quant="mxfp8")
    scale, data = to_mx(fuseblock.norm(x, out_dtype=torch.float32), E4, 32, ScaleCalculationMode.FLOOR)
    assert torch.equal(u8(q.data), u8(data)) and torch.equal(u8(q.scale), u8(scale))


@pytest.mark.parametrize("kw, err, says", [
    (dict(quant="fp8"), ValueError, "quant must be"),
    (dict(quant=("fp8_row",)), ValueError, "quant must be"),
    (dict(quant="fp8_tensor"), TypeError, "scale="),
    (dict(quant="fp8_tensor", scale=torch.tensor([1.0, 2.0])), ValueError, "scale must be a one-element"),
    (dict(quant="fp8_tensor", scale=torch.tensor([1.0], dtype=torch.float64)), ValueError, "float32"),
    (dict(quant="fp8_tensor", scale=torch.tensor([float("inf")])), ValueError, "positive and finite"),
    (dict(quant="fp8_tensor", scale=torch.tensor([0.0])), ValueError, "positive and finite"),
    (dict(quant="fp8_row", scale=torch.tensor([1.0])), ValueError, "scale must be None"),
    (dict(quant="fp8_row", out_dtype=torch.float32), ValueError, "out_dtype and quant"),
    # scale= (the call's tensor, not a recipe option) without quant= would do nothing: refused by name
    (dict(scale=torch.tensor([1.0])), ValueError, "scale= is fp8_tensor's static scale, an option of quant="),
    # the former keywords: a TypeError naming the recipe that holds them now
    (dict(quant="fp8_row", scale_ub=1.0), TypeError, r"no scale_ub= any more.*Fp8Recipe\(mode, scale_ub="),
    (dict(fp8_dtype=torch.float8_e5m2), TypeError, "no fp8_dtype= any more"),
    (dict(quant="mxfp8", mx_rounding="rceil"), TypeError, "no mx_rounding= any more"),
    (dict(quant_from=torch.bfloat16), TypeError, "no quant_from= any more"),
    (dict(mx_columnwise=True), TypeError, "no mx_columnwise= any more"),
    (dict(epsilon=1e-6), TypeError, "unexpected keyword argument 'epsilon'"),  # any other, as Python says it
])
def test_bad_options_name_the_argument(kw, err, says):
    x = torch.randn(2, 64)
    for call in (lambda: fuseblock.add_norm(x, None, **kw), lambda: fuseblock.norm(x, **kw),
                 lambda: fuseblock.norm_add_norm(x, x, torch.ones(64), torch.ones(64), **kw)):
        with pytest.raises(err, match=says):
            call()


@pytest.mark.parametrize("kw, err, says", [
    (dict(mode="fp8"), ValueError, "mode must be one of"),
    (dict(mode=None), ValueError, "mode must be one of"),
    (dict(mode="fp8_row", fp8_dtype=torch.bfloat16), TypeError, "fp8_dtype must be"),
    (dict(mode="fp8_row", fp8_dtype="e4m3"), TypeError, "fp8_dtype must be"),
    (dict(mode="mxfp8", mx_rounding="even"), ValueError, "mx_rounding must be one of"),
    (dict(mode="fp8_row", mx_rounding="rceil"), ValueError, "mx_rounding rounds mxfp8's.*'fp8_row'"),
    (dict(mode="fp8_row", scale_ub=-1.0), ValueError, "scale_ub must be a positive finite"),
    (dict(mode="fp8_row", scale_ub=float("inf")), ValueError, "scale_ub must be a positive finite"),
    (dict(mode="fp8_row", scale_ub=True), ValueError, "scale_ub must be"),
    (dict(mode="fp8_row", scale_ub=torch.tensor(1.0)), ValueError, "scale_ub must be"),
    (dict(mode="mxfp8", scale_ub=1.0), ValueError, "scale_ub bounds fp8_row's amax.*'mxfp8'"),
    (dict(mode="fp8_row", quant_from=torch.float64), TypeError, "quant_from must be"),
    (dict(mode="fp8_row", quant_from="bf16"), TypeError, "quant_from must be"),
    (dict(mode="mxfp8", mx_columnwise=1), TypeError, "mx_columnwise must be a bool"),
    (dict(mode="fp8_row", mx_columnwise=True), ValueError, "mxfp8's columnwise copy; mode 'fp8_row'"),
])
def test_the_recipe_is_validated_when_made_naming_the_field(kw, err, says):
    with pytest.raises(err, match=says):
        Fp8Recipe(**kw)


def test_the_recipe_is_one_frozen_hashable_value_and_a_mode_names_its_defaults():
    from dataclasses import FrozenInstanceError, replace
    r = Fp8Recipe("fp8_row", scale_ub=1)
    assert r.scale_ub == 1.0 and type(r.scale_ub) is float  # stored as the float it is compared as
    assert r == Fp8Recipe("fp8_row", scale_ub=1.0) and hash(r) == hash(Fp8Recipe("fp8_row", scale_ub=1.0))
    with pytest.raises(FrozenInstanceError):
        r.scale_ub = 2.0
    with pytest.raises(ValueError, match="scale_ub bounds"):  # a variant is validated too
        replace(r, mode="mxfp8")
    with pytest.raises(TypeError):  # every option but the mode is keyword-only
        Fp8Recipe("fp8_row", torch.float8_e5m2)
    x, w = case()
    # the mode's name is its recipe with the defaults: the same codes, the same spec
    for mode in ("fp8_row", "mxfp8"):
        a, b = fuseblock.norm(x, w, quant=mode), fuseblock.norm(x, w, quant=Fp8Recipe(mode))
        assert torch.equal(u8(a.data), u8(b.data)) and torch.equal(a.scale, b.scale)
    # each option reaches the spec the kernels read
    from fuseblock.ops.checks import quant_spec
    from fuseblock.spec import NormSpec, Quant
    spec = quant_spec(NormSpec(False, 1.0, 1e-6, 0, 0, 1), x.bfloat16(),
                      Fp8Recipe("mxfp8", fp8_dtype=E5, mx_rounding="rceil", quant_from=torch.bfloat16))
    assert (spec.quant, spec.fp8_e5m2, spec.mx_rceil, spec.quant_from, spec.scale_ub) == (
        Quant.MX, True, True, torch.bfloat16, 0.0)
    assert quant_spec(NormSpec(False, 1.0, 1e-6, 0, 0, 1), x, Fp8Recipe("fp8_row", scale_ub=0.5)).scale_ub == 0.5


def test_bad_shapes_and_dtypes_say_what_to_do():
    with pytest.raises(ValueError, match="multiple of 32.*pad the row"):
        fuseblock.norm(torch.randn(2, 48), quant="mxfp8")
    with pytest.raises(ValueError, match="num_groups=2"):
        fuseblock.norm(torch.randn(2, 96), quant="mxfp8", num_groups=2)
    with pytest.raises(TypeError, match="x in float16, bfloat16 or float32"):
        fuseblock.norm(torch.randn(2, 64, dtype=torch.float64), quant="fp8_row")
    with pytest.raises(ValueError, match="dropout_p"):
        fuseblock.add_norm(torch.randn(2, 64), torch.randn(2, 64), quant="fp8_row", dropout_p=0.1)



def test_rceil_is_the_exact_ceiling_where_torchaos_eager_log2_rounds():
    """torchao's eager rceil takes ceil(log2(amax / 448)) of an fp32 log2, which rounds to
    k for amax / 448 = 2**k * (1 + 2**-23): the scale 2**k then saturates that block's
    largest value. fuseblock (as the cvt.rp instruction torchao uses when compiled for
    sm_100) takes the exact ceiling, k + 1; everywhere else the two agree."""
    from dataclasses import replace

    from fuseblock.reference.fp8 import quantize
    from fuseblock.spec import NormSpec, Quant
    spec = replace(NormSpec(False, 1.0, 1e-6, 0, 0, 1), quant=Quant.MX, mx_rceil=True)
    block = torch.full((1, 32), 0.5)
    block[0, 0] = 448 * 2.0 ** 60 * (1 + 2 ** -23)
    ours = quantize(block, spec)
    scale, _ = to_mx(block, E4, 32, ScaleCalculationMode.RCEIL)
    assert u8(ours.scale).item() == 127 + 61 and u8(scale).item() == 127 + 60
    block[0, 0] = 448 * 2.0 ** 60 * 1.5  # away from the power of two: equal
    assert torch.equal(u8(quantize(block, spec).scale), u8(to_mx(block, E4, 32, ScaleCalculationMode.RCEIL)[0]))


@pytest.mark.kernel
def test_quant_under_torch_compile_runs_eagerly_and_equals_eager():
    x, w = case()
    recipe = Fp8Recipe("mxfp8", mx_rounding="rceil")  # a recipe object through Dynamo
    compiled = torch.compile(lambda x, w: fuseblock.add_norm(x, x, w, quant=recipe))
    got, want = compiled(x, w)[0], fuseblock.add_norm(x, x, w, quant=recipe)[0]
    assert torch.equal(u8(got.data), u8(want.data)) and torch.equal(u8(got.scale), u8(want.scale))


@pytest.mark.kernel
@pytest.mark.parametrize("quant", ["fp8_row", "mxfp8"])
def test_norm_add_norm_quantizes_its_second_norm(quant):
    x, w = case()
    res, bw = torch.randn_like(x), torch.randn_like(w)
    q, new_res = fuseblock.norm_add_norm(x, res, bw, w, kind="layer", alpha=0.5, quant=quant)
    out, want_res = fuseblock.norm_add_norm(x, res, bw, w, kind="layer", alpha=0.5, out_dtype=torch.float32)
    assert torch.equal(new_res, want_res)
    if quant == "mxfp8":
        scale, data = to_mx(out, E4, 32, ScaleCalculationMode.FLOOR)
        assert torch.equal(u8(q.scale), u8(scale))
    else:
        ref = hp_tensor_to_float8_dynamic(out, E4, LinearMMConfig(), scaling_granularity=ScalingGranularity.AXISWISE,
                                          axiswise_dim=-1)
        data = ref._data
        assert torch.equal(q.scale, ref._scale.reciprocal())
    assert torch.equal(u8(q.data), u8(data))


@pytest.mark.kernel
@pytest.mark.parametrize("rounding,d", [("floor", 96), ("rceil", 96), ("floor", 288)])
def test_mxfp8_columnwise_copy_equals_to_mx_of_the_transpose(rounding, d):
    # d = 288: past the fused columnwise tile (32 rows of 256), normed then quantized apart
    x, w = case(rows=64, d=d)
    x[5:40] *= 1e-3  # the first column blocks' amax differ from the second's
    q, _ = fuseblock.add_norm(x, x, w, quant=Fp8Recipe("mxfp8", mx_rounding=rounding, mx_columnwise=True))
    o = fuseblock.add_norm(x, x, w, out_dtype=torch.float32)[0]
    scale, data = to_mx(o, E4, 32, MODES[rounding])
    scale_t, data_t = to_mx(o.t().contiguous(), E4, 32, MODES[rounding])
    assert q.data_t.shape == (d, 64) and q.scale_t.shape == (d, 2)
    assert torch.equal(u8(q.data), u8(data)) and torch.equal(u8(q.scale), u8(scale))
    assert torch.equal(u8(q.data_t), u8(data_t)) and torch.equal(u8(q.scale_t), u8(scale_t))


def test_mx_columnwise_needs_whole_blocks_of_rows():
    with pytest.raises(ValueError, match="multiple of 32.*pad the batch"):
        fuseblock.norm(torch.randn(40, 64), quant=Fp8Recipe("mxfp8", mx_columnwise=True))
    with pytest.raises(ValueError, match="no columnwise copy"):  # norm_add_norm's output has none
        fuseblock.norm_add_norm(torch.randn(64, 64), torch.randn(64, 64), torch.ones(64), torch.ones(64),
                                quant=Fp8Recipe("mxfp8", mx_columnwise=True))


def test_the_fp8_options_are_one_recipe_argument():
    """Every op that takes quant= takes the recipe (or a mode's name) as one keyword, with
    fp8_tensor's scale tensor beside it where the op has that mode; none takes a former
    fp8 keyword."""
    import inspect

    from fuseblock.ops.checks import RECIPE_FIELDS
    takes = {fuseblock.norm: ("quant", "scale"), fuseblock.add_norm: ("quant", "scale"),
             fuseblock.norm_add_norm: ("quant", "scale"), fuseblock.norm_linear: ("quant",)}
    for fn, names in takes.items():
        params = inspect.signature(fn).parameters
        assert not set(RECIPE_FIELDS) & set(params), fn.__name__
        assert [n for n in ("quant", "scale") if n in params] == list(names), fn.__name__
        for n in names:
            assert params[n].kind is inspect.Parameter.KEYWORD_ONLY and params[n].default is None, (fn.__name__, n)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="records the JIT kernels' launches")
def test_mxfp8_columnwise_fallback_norms_in_the_plain_layout():
    # Rows past the fused columnwise tile are normed by the plain kernel, then quantized:
    # that kernel takes the plain layout's rows a program, not the columnwise tile's 32
    # (32 rows of 1024 to 8192 spilled 0.7 to 8.6 KB a thread, compiled for sm_90)
    from fuseblock.kernels.launch import fwd_layout
    from fuseblock.testing.targets import quant_launches

    x, w = torch.empty(64, 288), torch.empty(288)
    got = quant_launches(x, torch.empty_like(x), w, quant=Fp8Recipe("mxfp8", mx_columnwise=True))
    assert [ln.name for ln in got] == ["_fwd_tile"] and "QUANT" not in got[0].kwargs
    assert got[0].kwargs["BR"] == fwd_layout(288).br
