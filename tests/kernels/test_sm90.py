"""Every kernel the launchers pick compiles for an H100 (sm_90), without a GPU.

The interpreter checks the kernels' arithmetic but never runs Triton's compiler, which
rejects some constructs the interpreter accepts; and only a GPU build shows spilled
registers. Triton's compiler and the ptxas and cuobjdump it ships need no GPU.
"""
import os

import pytest
import torch

from fuseblock.kernels.occupancy import H100_SM, resident_programs
from fuseblock.testing.targets import (
    captured_launches,
    compile_for,
    norm_add_launches,
    norm_launches,
    resource_usage,
)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs triton's compiler")

CONFIGS = {  # name: (kwargs for norm_launches, residual dtype or None)
    "rms": (dict(kind="rms"), None),
    "layer_fp32_residual": (dict(kind="layer", residual_dtype=torch.float32), "same"),
    "pre_gate_layer": (dict(kind="layer", gate_position="pre", gate_act="sigmoid"), "same"),
    "post_gate_rms": (dict(kind="rms", gate_position="post"), "same"),
    "groups": (dict(kind="layer", num_groups=4), None),
    # add_norm's branch: alpha, x1 and dropout, the seed by value (drawn on the host)
    "branch_dropout": (dict(kind="layer", alpha=0.5, dropout_p=0.1), "same"),
}


def _launches(config, d, dtype, rows=512, compiled=None):
    kw, res = CONFIGS[config]
    x = torch.empty(rows, d, dtype=dtype)
    w = torch.empty(d, dtype=dtype)
    residual = torch.empty_like(x) if res else None
    gate = torch.empty_like(x) if "gate_position" in kw else None
    x1 = torch.empty_like(x) if "dropout_p" in kw else None
    return norm_launches(x, residual, w, w if kw["kind"] == "layer" else None, gate, x1=x1, compiled=compiled, **kw)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("d", [1000, 20000, 40000])  # tile both ways; tile forward (most), wide backward; wide
def test_core_kernels_compile_for_h100(config, d):
    launches = _launches(config, d, torch.bfloat16)
    names = [ln.name for ln in launches]
    # 512 rows: 8 tile backward programs, whose dw (db) partial rows _bwd_sum adds up. At
    # 20000 (a 32768 tile) the pre-gate, groups and dropout take the loop forward
    # (launch.MAX_TILE_FWD_HEAVY: their tile spilled and timed slower on an H200)
    heavy = config in ("pre_gate_layer", "groups", "branch_dropout")
    fwd_20000 = "fwd_loop" if heavy else "_fwd_tile"
    assert names == {1000: ["_fwd_tile", "_bwd_tile", "_bwd_sum"], 20000: [fwd_20000, "bwd_dots", "bwd_cols"],
                     40000: ["fwd_loop", "bwd_dots", "bwd_cols"]}[d]
    for ln in launches:
        usage = resource_usage(compile_for(ln))
        assert 0 < usage["registers"] <= 255
        # the wide-row kernels and the partial-row sum keep little live: no spills (RMS's
        # bwd_dots kept 8 bytes until it indexed its rows in 32 bits)
        if ln.name in ("fwd_loop", "bwd_dots", "bwd_cols", "_bwd_sum"):
            assert usage["stack"] == 0, (ln.name, usage)


@pytest.mark.parametrize("d", [1000, 40000])
def test_dropout_kernels_with_a_device_seed_compile_for_h100(d):
    """The variant a CUDA graph capture runs: the seed read from a device tensor."""
    x, w = torch.empty(512, d, dtype=torch.bfloat16), torch.empty(d, dtype=torch.bfloat16)
    launches = norm_launches(x, torch.empty_like(x), w, x1=torch.empty_like(x), alpha=0.5, dropout_p=0.1,
                             seed=torch.empty(1, dtype=torch.int64))
    assert [ln.name for ln in launches][:1] == ["_fwd_tile" if d == 1000 else "fwd_loop"]
    for ln in launches:
        usage = resource_usage(compile_for(ln))
        assert 0 < usage["registers"] <= 255, (ln.name, usage)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("second", [True, False], ids=["norm_add_norm", "norm_add"])
def test_norm_add_loop_kernels_compile_for_h100_without_spills(kind, second):
    """norm_add and norm_add_norm on rows past the tile: `_fwd_loop`, `_bwd_loop` and the
    partial rows' sum keep everything in registers (tests/ops/test_norm_add.py compiles
    the tile kernels)."""
    x, w = torch.empty(512, 20000, dtype=torch.bfloat16), torch.empty(20000, dtype=torch.bfloat16)
    launches = norm_add_launches(x, torch.empty_like(x), w, w, kind=kind, second=second)
    assert [ln.name for ln in launches] == ["_fwd_loop", "_bwd_loop", "_bwd_sum4"]
    for ln in launches:
        usage = resource_usage(compile_for(ln))
        assert 0 < usage["registers"] <= 255 and usage["stack"] <= 16, (ln.name, usage)


@pytest.mark.parametrize("update", ["add", "interpolate"])
@pytest.mark.parametrize("d", [2048, 20000])  # the tile kernels, the loop kernels
def test_norm_add_kernels_with_a_vector_branch_scale_compile_for_h100(d, update):
    """norm_add_norm with a [d] branch_scale (b read from memory: a block where alpha is a
    scalar, which Triton's compiler refuses as two return types of one function, where the
    interpreter runs it), plain and update="interpolate" (the residual read again for b's
    gradient): every launch compiles, none spills."""
    from fuseblock.kernels import launch
    from fuseblock.kernels import norm_add as kernels
    from fuseblock.spec import NormSpec

    x = torch.empty(512, d, dtype=torch.bfloat16)
    r, b = torch.empty_like(x), torch.empty(d)
    spec = NormSpec.of(d, kind="l2", c=None, eps=1e-6, num_groups=1, gate_act=None, gate_position=None)
    bspec, nspec = (spec.interpolating(True), spec.interpolating(False)) if update == "interpolate" else (spec, spec)
    with captured_launches(kernels, launch) as launches:
        new_r, _, rstd_b, mean_b, rstd, mean = kernels.norm_add_fwd(x, r, None, None, None, None, bspec, nspec, 1.0,
                                                                    x.dtype, True, True, bscale=b)
        kernels.norm_add_bwd(torch.empty_like(x), torch.empty_like(x), x, new_r, None, None, None, None, rstd_b,
                             mean_b, rstd, mean, bspec, nspec, 1.0, x.dtype, True, True, residual=r, bscale=b)
    assert [ln.name for ln in launches] == (["_fwd_tile", "_bwd_tile", "_bwd_sum4"] if d == 2048
                                            else ["_fwd_loop", "_bwd_loop", "_bwd_sum4"])
    for ln in launches:
        usage = resource_usage(compile_for(ln))
        assert 0 < usage["registers"] <= 255 and usage["stack"] == 0, (ln.name, usage)


def test_fp32_and_embed_norm_kernels_compile_for_h100():
    import fuseblock.kernels.embed_norm as ek

    launches = _launches("rms", 1000, torch.float32) + _launches("rms", 40000, torch.float32)
    for d in (1000, 40000):
        x = torch.empty(64, d)
        with captured_launches(ek) as got:
            n = ek.embed_norm_fwd(x, 2, 1e-6)[1]
            ek.embed_norm_bwd(torch.empty_like(x), x, n, 2, 1e-6)
        launches += got
    assert {ln.name for ln in launches} >= {"_fwd_tile", "_bwd_tile", "fwd_loop", "_fwd_loop", "_bwd_loop"}
    for ln in launches:
        assert resource_usage(compile_for(ln))["registers"] > 0


@pytest.mark.parametrize("sets", ["batch", "group"])
@pytest.mark.parametrize("shape", [(32, 64, 1000), (256, 64)], ids=str)  # full [BR, BL] blocks, and L = 1
def test_channel_norm_kernels_compile_for_h100(sets, shape):
    import fuseblock.kernels.channel_norm as ck

    batch, groups = sets == "batch", 0 if sets == "batch" else 8
    x = torch.empty(shape, dtype=torch.bfloat16)
    w, running = torch.empty(64, dtype=torch.bfloat16), torch.empty(64) if batch else None
    with captured_launches() as launches:  # all kernel modules: the sum is launch.py's `_bwd_sum`
        _, mean, rstd = ck.channel_norm_fwd(x, w, w, batch, groups, 1e-5, running, running, 0.1)
        ck.channel_norm_bwd(torch.empty_like(x), x, w, w, mean, rstd, batch, groups)
    assert [ln.name for ln in launches] == ["_channel_fwd", "_channel_bwd"] + ([] if batch else ["_bwd_sum"])
    for ln in launches:
        usage = resource_usage(compile_for(ln))
        assert 0 < usage["registers"] <= 255 and usage["stack"] == 0, (ln.name, usage)  # no spills


def test_resident_programs_follow_the_occupancy_rule():
    # registers bind: 166 -> 168 per thread, x 32 x 4 warps = 21504 per program: 3 fit in 64K
    assert resident_programs({"registers": 166, "shared": 4096}, 4) == 3
    assert resident_programs({"registers": 128, "shared": 0}, 4) == 4
    # threads bind: 16 warps = 512 threads, 4 per SM of 2048
    assert resident_programs({"registers": 24, "shared": 0}, 16) == 4
    # shared memory binds
    assert resident_programs({"registers": 32, "shared": 100 * 1024}, 4) == H100_SM["shared"] // (101 * 1024)
    # the 32-block limit
    assert resident_programs({"registers": 16, "shared": 0}, 1) == 32


def _compiled(launch):
    """What a GPU launch returns: the compiled kernel, with its registers once loaded."""
    from types import SimpleNamespace

    kernel = compile_for(launch)
    return SimpleNamespace(n_regs=resource_usage(kernel)["registers"], metadata=kernel.metadata)


@pytest.mark.parametrize("config,d", [("layer_fp32_residual", 1024), ("pre_gate_layer", 1024), ("post_gate_rms", 4096),
                                      ("pre_gate_layer", 65536)])
def test_persistent_grids_shrink_to_one_wave_once_compiled(monkeypatch, config, d):
    from fuseblock.kernels import occupancy
    from fuseblock.kernels.launch import H100_SMS

    monkeypatch.setattr(occupancy, "_RESIDENT", {})

    def waves(launches):
        out = {}
        for ln in launches:
            usage = resource_usage(compile_for(ln))
            slots = H100_SMS * resident_programs(usage, ln.kwargs["num_warps"])
            out[ln.name] = (ln.grid[0] * (ln.grid[1] if len(ln.grid) > 1 else 1)) / slots
        return out

    first = _launches(config, d, torch.bfloat16, rows=32768)
    learned = _launches(config, d, torch.bfloat16, rows=32768)  # nothing compiled yet: the same grids
    assert [ln.grid for ln in learned] == [ln.grid for ln in first]
    _launches(config, d, torch.bfloat16, rows=32768, compiled=_compiled)  # "runs" once on a GPU: learns
    again = _launches(config, d, torch.bfloat16, rows=32768)
    before, after = waves(first), waves(again)
    persistent = [name for name in after if name != "_fwd_tile"]  # _fwd_tile has a program per row block
    assert any(before[name] > 1.05 for name in persistent)  # a second, partly idle wave: the default's cost
    for name in persistent:
        assert after[name] <= 1.0, (name, before[name], after[name])


@pytest.mark.parametrize("x_dtype,res_dtype,residual_dtype", [
    (torch.bfloat16, None, None), (torch.bfloat16, None, torch.float32), (torch.bfloat16, torch.bfloat16, None),
    (torch.bfloat16, torch.float32, None), (torch.float32, torch.bfloat16, None),
    (torch.bfloat16, torch.bfloat16, torch.float32),
], ids=str)
def test_the_launches_store_what_add_norm_stores(x_dtype, res_dtype, residual_dtype):
    """norm_launches compiles the variants add_norm runs: new_residual written (RO) only
    where add_norm stores one, in its dtype; its gradient read (DRO) only then; a
    separate dresidual (DR) only in a residual dtype other than x's."""
    import fuseblock

    x, w = torch.randn(8, 64, dtype=x_dtype), torch.randn(64, dtype=x_dtype)
    residual = None if res_dtype is None else torch.randn(8, 64, dtype=res_dtype)
    _, new_res = fuseblock.add_norm(x, residual, w, residual_dtype=residual_dtype)
    stored = None if new_res is x else new_res.dtype
    fwd, bwd = (dict(zip(ln.fn.arg_names, ln.args, strict=False)) for ln in
                norm_launches(x, residual, w, residual_dtype=residual_dtype)[:2])
    assert (None if fwd["RO"] is None else fwd["RO"].dtype) == stored
    assert (bwd["DRO"] is None) == (stored is None)
    separate = res_dtype if res_dtype not in (None, x_dtype) else None
    assert (None if bwd["DR"] is None else bwd["DR"].dtype) == separate
