"""The most-used kernels compile for NVIDIA (sm_90 an H100, sm_100 a B200) and AMD (gfx942,
an MI300X) with no GPU, without spilling a register, and their persistent launches fill a wave:
the wide-row backward's column pass too, whose stream-K split launches exactly one wave
whatever its column-chunk count (it filled 0.86 of a B200's when it split its programs
evenly among the chunks: docs/performance.md).

A handful of the cases `scripts/bench.py targets` sweeps (every kernel, every target, d
from 64 to 262144): the layer norm's (the heavier of the two: a mean and a bias) tile and
wide-row kernels, RMS's wide-row backward (its bwd_dots spilled 8 bytes on sm_90), the
gated backward (the most live blocks), norm_add_norm's tile and loop kernels, the
n-stream boundary at n = 4 and 16 (whose backward spilled up to 1.7 KB a thread before its
Sinkhorn denominators left the registers) and an mxfp8 output. Skipped, with the reason, where triton's
compiler for a vendor is missing. From a warm Triton cache the three targets take seconds;
cold, about a minute each on a loaded 2-core machine.
"""
import os

import pytest
import torch

from fuseblock.testing import targets as T
from fuseblock.testing.targets import backend_problem

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs triton's compiler")

CASES = [("add_norm_layer", 1024), ("add_norm_layer", 4096), ("pre_gate", 4096), ("add_norm_layer", 65536),
         ("add_norm", 65536), ("norm_add_norm_layer", 4096), ("norm_add_norm_layer", 65536), ("hc_n4", 4096),
         ("hc_n16", 1024), ("mxfp8", 4096)]


@pytest.fixture(scope="module")
def bench():
    from benchmarks import targets
    return targets


@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942"])
def test_most_used_kernels_compile_without_spills_and_fill_a_wave(bench, target):
    problem = backend_problem(target)
    if problem:
        pytest.skip(f"cannot compile for {target} here: {problem}")
    ops = bench._ops(False)
    comp = bench._Compiler()
    # Known and left: at n = 16, d = 1024, sm_90, the split _bwd_params spills 16 B a thread
    # (the token split's partial sums, added after the last sweep)
    SPILLS = {("hc_n16", 1024, "_bwd_params")}
    rows = []
    for op, d in CASES:
        rows += bench._rows(target, op, ops[op], d, torch.bfloat16, 32768 if d <= 16384 else (1 << 29) // d, comp)
    kernels = {}
    for r in rows:
        kernels.setdefault((r["op"], r["d"]), []).append(r["kernel"])
    assert kernels[("add_norm_layer", 4096)] == ["_fwd_tile", "_bwd_tile", "_bwd_sum"]
    assert kernels[("add_norm_layer", 65536)] == ["fwd_loop", "bwd_dots", "bwd_cols"]
    assert kernels[("norm_add_norm_layer", 65536)] == ["_fwd_loop", "_bwd_loop", "_bwd_sum4"]
    assert kernels[("hc_n4", 4096)] == ["_fwd", "_bwd", "_bwd_params"]
    assert kernels[("mxfp8", 4096)] == ["_fwd_tile"]
    for r in rows:
        where = (r["op"], r["d"], r["kernel"], r["block"], r["num_warps"], r["registers"])
        if (r["op"], r["d"], r["kernel"]) in SPILLS:
            continue
        assert r["spill_bytes"] == 0, where
        assert r["resident_per_sm"] >= 1, where
        assert r["fills"], (where, r["grid"], r["waves"])
        if r["kernel"] == "bwd_cols":  # stream-K: exactly one wave, whatever the d / 2048 column chunks
            assert r["grid"] == T.TARGETS[target].sms * r["resident_per_sm"], where
        if target == "gfx942":  # a workgroup holds at most 1024 threads: 16 wavefronts of 64
            assert r["num_warps"] <= 16, where


@pytest.mark.parametrize("variant,heavy", [
    (dict(), False), (dict(kind="layer"), False), (dict(gate_position="post"), False),
    (dict(dropout_p=0.1), True), (dict(gate_position="pre"), True), (dict(num_groups=8), True),
], ids=["rms", "layer", "post_gate", "dropout", "pre_gate", "groups"])
def test_rows_of_32768_leave_the_tile_where_its_spills_cost_more_than_the_loop(variant, heavy):
    """At d = MAX_TILE_FWD the variants whose tile spilled most and timed slower than the loop
    kernel on an H200 (dropout, pre-gate, groups: launch.MAX_TILE_FWD_HEAVY) take the loop;
    the others keep the tile. At half that width every variant takes the tile. Nothing runs:
    the launches are captured (fuseblock.testing.targets)."""
    from fuseblock.kernels.launch import MAX_TILE_FWD

    for d, loop in ((MAX_TILE_FWD, heavy), (MAX_TILE_FWD // 2, False)):
        x, r, w, b, gate = torch.randn(2, d), torch.randn(2, d), torch.randn(d), torch.randn(d), torch.randn(2, d)
        kw = dict(variant)
        gated = "gate_position" in kw
        launches = T.norm_launches(x, r, w, b if kw.get("kind") == "layer" else None, gate if gated else None, **kw)
        assert launches[0].name == ("fwd_loop" if loop else "_fwd_tile"), (d, launches[0].name)


@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942"])
def test_n_stream_parameter_gradients_take_every_sm(target):
    """_bwd_params at n = 4, d = 4096, 8192 tokens (what `bench.py targets` launches) splits
    its token sums so that dfn's 64 column chunks take every SM: it launched 69 programs
    (64 chunks, 4 of dw, one for dbase and dscale over every token), half an H100's SMs.
    Nothing runs: the launches are captured."""
    with T.for_target(target) as t:
        launches = {ln.name: ln for ln in T.hyper_launches(8192, 4, 4096, torch.bfloat16)}
    assert launches["_bwd_params"].grid[0] >= 2 * t.sms, launches["_bwd_params"].grid


def test_n_stream_parameter_gradients_fit_sm_120_shared_memory():
    """_bwd_params at n = 16 in fp32, the most shared memory of the n-stream kernels (its
    dot's [512, 16] fp32 dv operand; m = 288 rows of fn padded to 512), fits one program's
    limit on sm_120 (an RTX 5090: 99 KB a block, 100 KB an SM): Triton's compiler does not
    check it, a launch past it fails on the GPU alone."""
    problem = backend_problem("sm_120")
    if problem:
        pytest.skip(f"cannot compile for sm_120 here: {problem}")
    with T.for_target("sm_120") as t:
        launches = {ln.name: ln for ln in T.hyper_launches(2048, 16, 1024, torch.float32)}
    shared = T.resource_usage(T.compile_for(launches["_bwd_params"], "sm_120"))["shared"]
    limit = t.sm["shared"] - t.sm["shared_per_block_reserved"]  # 101,376 B
    assert shared <= limit, (shared, limit)
