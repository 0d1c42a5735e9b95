"""The byte counters, and the kernels' traffic held at the compulsory minimum."""
import pytest
import torch
from helpers import interpreted_only

from fuseblock.testing import cases, op_traffic
from fuseblock.testing.traffic import EagerTraffic, KernelTraffic, charge, uncounted


def _copy_twice():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_twice(X, Y, N, B: tl.constexpr):
        o = tl.program_id(0) * B + tl.arange(0, B)
        m = o < N
        a = tl.load(X + o, mask=m)
        b = tl.load(X + o, mask=m)  # a re-read: its bytes count once
        tl.store(Y + o, (a + b).to(tl.float16), mask=m & (o % 2 == 0))  # only even elements

    return copy_twice


@pytest.mark.kernel
@interpreted_only
@pytest.mark.parametrize("compact_at", [1 << 23, 100], ids=["whole", "compacted"])
def test_kernel_counter_on_a_kernel_of_known_traffic(monkeypatch, compact_at):
    import fuseblock.testing.traffic as traffic

    monkeypatch.setattr(traffic, "COMPACT_AT", compact_at)  # dedup mid-launch gives the same counts
    copy_twice = _copy_twice()
    x, y = torch.randn(1000), torch.empty(1000, dtype=torch.float16)
    with KernelTraffic() as t:
        copy_twice[(8,)](x, y, 1000, B=128)  # 1024 lanes, the last 24 masked off
        copy_twice[(1,)](x[:10], y, 10, B=16)
    assert [ln.kernel for ln in t.launches] == ["copy_twice"] * 2
    assert t.launches[0].read == {"X": 4000} and t.launches[0].written == {"Y": 1000}
    assert t.launches[1].read == {"X": 40} and t.launches[1].written == {"Y": 10}
    assert t.bytes == 5050 and t.glue_bytes == 0
    assert torch.equal(y[:1000:2], (2 * x[:1000:2]).half())  # the counter changed nothing


@pytest.mark.kernel
@interpreted_only
def test_kernel_counter_compacts_rarely_when_distinct_addresses_pass_the_threshold(monkeypatch):
    import triton

    import fuseblock.testing.traffic as traffic

    calls = []
    monkeypatch.setattr(traffic, "COMPACT_AT", 100)
    monkeypatch.setattr(traffic, "_first", lambda a, q, f=traffic._first: calls.append(a.size) or f(a, q))
    copy_twice = _copy_twice()
    x, y = torch.randn(64 * 1024), torch.empty(64 * 1024, dtype=torch.float16)
    with KernelTraffic() as t:
        copy_twice[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), B=1024)  # 192 accesses of 1024 addresses
    assert t.launches[0].read == {"X": x.nbytes}
    # compaction happens when the held addresses double, not on every access once the
    # distinct count passes COMPACT_AT (that re-sorted everything each time: quadratic)
    assert len(calls) <= 2 * 10 + 3


@pytest.mark.kernel
@interpreted_only
def test_kernel_counter_counts_every_access_and_stray_bytes():
    copy_twice = _copy_twice()
    buf, y = torch.randn(100), torch.empty(100, dtype=torch.float16)
    with KernelTraffic() as t:
        copy_twice[(1,)](buf[:20], y, 30, B=32)  # reads 10 elements past its view of buf
    (ln,) = t.launches
    assert ln.read == {"X": 80, "?": 40} and ln.written == {"Y": 30}
    assert ln.accessed == {"X": 160, "?": 80, "Y": 30}  # the re-read counts here: no cache
    assert t.accessed({"X", "Y"}) == 190 and t.accessed() == 270


@pytest.mark.kernel
@interpreted_only
@pytest.mark.parametrize("compact_at", [1 << 23, 10], ids=["whole", "compacted"])
def test_kernel_counter_reads_after_own_writes_are_free(monkeypatch, compact_at):
    import triton
    import triton.language as tl

    import fuseblock.testing.traffic as traffic

    @triton.jit
    def write_then_read(X, Y, Z, B: tl.constexpr):
        o = tl.arange(0, B)
        tl.store(Y + o, tl.load(X + o) * 2)
        tl.store(Z + o, tl.load(Y + o) + tl.load(Y + B + o))  # Y[:B] this launch wrote; Y[B:] it did not

    monkeypatch.setattr(traffic, "COMPACT_AT", compact_at)
    x, y, z = torch.ones(16), torch.full((32,), 5.0), torch.empty(16)
    with KernelTraffic() as t:
        write_then_read[(1,)](x, y, z, B=16)
    (ln,) = t.launches
    # the written half is in cache when read back; the other half comes from memory
    assert ln.read == {"X": 64, "Y": 64} and ln.written == {"Y": 64, "Z": 64}
    assert ln.accessed == {"X": 64, "Y": 64 + 128, "Z": 64}  # with no cache every access counts
    assert torch.equal(z, torch.full((16,), 7.0))


@pytest.mark.kernel
@interpreted_only
def test_kernel_counter_counts_atomics_and_restores_the_interpreter():
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def atomic_sum(X, S, B: tl.constexpr):
        o = tl.program_id(0) * B + tl.arange(0, B)
        tl.atomic_add(S, tl.sum(tl.load(X + o), 0))  # each program reads and writes S

    before = interpreter.InterpreterBuilder.create_atomic_rmw
    x, s = torch.ones(64), torch.zeros(1)
    with KernelTraffic() as t:
        atomic_sum[(4,)](x, s, B=16)
    assert s.item() == 64
    (ln,) = t.launches
    assert ln.read == {"X": 256, "S": 4} and ln.written == {"S": 4} and ln.accessed["S"] == 4 * 4 * 2
    assert interpreter.InterpreterBuilder.create_atomic_rmw is before


@pytest.mark.kernel
@interpreted_only
def test_kernel_counter_charges_glue_ops_but_not_the_interpreter_copies():
    copy_twice = _copy_twice()
    x, y = torch.randn(1000), torch.empty(1000, dtype=torch.float16)
    with KernelTraffic(glue=True) as t:
        copy_twice[(8,)](x, y, 1000, B=128)
        s = y[::2].float().sum()
    assert [name for name, _, _ in t.glue.ops] == ["_to_copy", "sum"]
    assert t.glue_bytes == (1000 + 2000) + (2000 + 4)  # half in, float out; float in, scalar out
    assert t.bytes == 5000 and torch.isfinite(s)


def test_eager_counter_charges_inputs_and_outputs_not_views():
    x, r = torch.randn(64, 32), torch.randn(64, 32)
    with EagerTraffic() as t:
        p = (x + r).view(32, 64).t()
        p.sum()
    assert [name for name, _, _ in t.ops] == ["add", "sum"]
    assert t.ops[0][1:] == (2 * x.nbytes, x.nbytes) and t.ops[1][1:] == (x.nbytes, 4)


def test_eager_counter_reads_repeated_and_broadcast_inputs_once():
    x, w = torch.randn(64, 32), torch.randn(32)
    with EagerTraffic() as t:
        x * x  # one input, read once
        x + w.expand(64, 32)  # the broadcast weight is 32 distinct floats
        w.detach().clone()
    assert [name for name, _, _ in t.ops] == ["mul", "add", "clone"]
    assert t.ops[0][1:] == (x.nbytes, x.nbytes)
    assert t.ops[1][1:] == (x.nbytes + w.nbytes, x.nbytes)
    assert t.ops[2][1:] == (w.nbytes, w.nbytes)


def test_eager_counter_lists_host_scalars_apart():
    """A CPU value made from no tensor and read back by .item() (the dropout seed's draw)
    is host work, as it is on a GPU machine; a value computed from tensors is an op."""
    x = torch.randn(8)
    with EagerTraffic() as t:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        int(seed)
        x.sum().item()
        int(seed)  # read again (the backward's read of the saved seed)
        torch.zeros(3)  # made from no tensor, never read back: an op
    assert [name for name, _, _ in t.ops] == ["sum", "zeros"]
    assert t.host_ops == ["randint"] + ["_local_scalar_dense"] * 3


def test_charge_models_one_kernel_and_uncounted_hides_its_ops():
    x = torch.randn(8, 16)
    with EagerTraffic() as outer, EagerTraffic() as inner:
        with uncounted():
            y = x.exp().exp()
        charge("two exps", [x, None, x], [y])
    assert outer.ops == inner.ops == [("two exps", 512, 512)]


def test_one_kernel_rms_norm_is_torchs_rms_norm_and_charged_once():
    x, residual, w, kw = cases.op_inputs("add_norm", 16, 48, torch.float64)
    leaves = cases.leaves(x, residual, w, kw)
    one = cases.naive("add_norm", x, residual, w, kw, one_kernel_norm=True)
    ref = cases.naive("add_norm", x, residual, w, kw)
    grads = [torch.randn_like(t) for t in one]
    for a, b in zip([*one, *torch.autograd.grad(one, leaves, grads)], [*ref, *torch.autograd.grad(ref, leaves, grads)],
                    strict=True):
        torch.testing.assert_close(a, b)
    with EagerTraffic() as t:
        out, _ = cases.naive("add_norm", x, residual, w, kw, one_kernel_norm=True)
        torch.autograd.grad(out, leaves[:3], grads[0])
    n, row, col = 16 * 48 * 8, 16 * 8, 48 * 8  # fp64 activation, rstd, weight
    norm_ops = [op for op in t.ops if "rms_norm" in op[0]]
    assert norm_ops == [("rms_norm (one kernel)", n + col, n + row),
                        ("rms_norm_backward (one kernel)", 2 * n + row + col, n + col)]


@pytest.mark.kernel
@interpreted_only
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_wide_rows_read_each_row_twice_never_more(kind):
    op = "add_norm_layer" if kind == "layer" else "add_norm"
    rows, d = 3, 65536  # past both tile limits: the wide-row kernels
    fwd, bwd, _ = op_traffic.measure_traffic(op, rows, d, torch.bfloat16)
    # forward, one launch: x and residual in, new_residual out, new_residual read back
    # (not x and residual again), out written: 5 tensors where the minimum is 4
    assert fwd["launches"] == 1 and fwd["act_over_min"] == 1.0
    assert 1.25 <= fwd["uncached_over_min"] <= 1.251  # the one-sweep statistics: no third read
    # backward, two launches: p and grad_out for the row constants, then p, grad_out and
    # grad_new_residual in and dx out: 6 tensors where the minimum is 4
    assert bwd["launches"] == 2 and bwd["act_over_min"] == 1.5
    # no cache at all: the same, plus the fp32 row constants and statistics (read by
    # every column chunk), and dw (db): one program per column chunk, which writes them
    # once, in bf16 (no partial rows to sum, and no torch op after the kernels)
    from fuseblock.kernels.norm import COLS_BLOCK

    n_params = 2 if kind == "layer" else 1
    extra = rows * 4 * 4 * (d // COLS_BLOCK + 1) + n_params * d * 2
    assert bwd["uncached_over_min"] * bwd["min_MB"] <= 1.5 * bwd["min_MB"] + extra / 1e6
    assert bwd["glue_ops"] == 0


@pytest.mark.kernel
@interpreted_only
def test_wide_sandwich_rows_move_the_minimum_in_two_launches():
    """norm_add_norm on rows past the tile (the loop kernels, the real block sizes): every
    activation byte once per pass, the re-reads inside a launch only; backward one loop
    kernel and the partial rows' sum (issue 24.5: it was four launches, 1.83x)."""
    from fuseblock.kernels.norm_add import LOOP_ROWS

    rows, d = 2 * LOOP_ROWS, 16400  # two row blocks for the one program (64 rows a program at least)
    fwd, bwd, _ = op_traffic.measure_residual_traffic("norm_add_norm", rows, d, torch.bfloat16)
    assert (fwd["launches"], bwd["launches"], fwd["glue_ops"], bwd["glue_ops"]) == (1, 2, 0, 0)
    assert fwd["act_over_min"] == bwd["act_over_min"] == 1.0
    # besides: the two weights read and their gradients written (bf16), both norms' rstd
    # read, and the program's two fp32 partial rows, written and read by _bwd_sum4
    assert bwd["other_MB"] * 1e6 == pytest.approx(2 * 2 * d * 2 + 2 * rows * 4 + 2 * d * 4 * 2)
    # with no cache: p and dout read twice, x twice, dresidual written and read back
    # (10 row-size accesses of 6), rstd once per norm, and each partial row stored
    # (first block), read and stored (second), read by _bwd_sum4, then dw written
    act, stats, parts = 10 * rows * d * 2, 2 * rows * 4, 2 * (4 * d * 4 + d * 2)
    assert bwd["uncached_over_min"] * bwd["min_MB"] * 1e6 == pytest.approx(act + stats + parts)


@pytest.mark.kernel
@interpreted_only
@pytest.mark.parametrize("op", ["norm", "add_norm", "add_norm_layer", "add_norm_fp32_residual", "pre_gate", "post_gate",
                                "post_gate_residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_traffic_is_the_compulsory_minimum(op, dtype):
    from fuseblock.kernels.norm import MIN_ROWS_PER_PROGRAM

    rows, d = 96, 160
    fwd, bwd, both = op_traffic.measure_traffic(op, rows, d, dtype)
    # the backward: _bwd_tile, then _bwd_sum adding up the partial rows of its 2 programs;
    # no torch op around either
    assert (fwd["launches"], bwd["launches"], fwd["glue_ops"], bwd["glue_ops"]) == (1, 2, 0, 0)
    for r in (fwd, bwd):
        assert r["act_over_min"] == 1.0  # every activation byte once, none more
        # the tile kernels touch each byte once: even with no cache at all (every access
        # counted, the weights aside) they move no more than the distinct bytes
        assert r["uncached_over_min"] <= r["kernel_over_min"]
        assert r["naive_over_kernel"] > 1.2  # and the eager composition moves more
    assert fwd["kernel_over_min"] <= 1.05  # weights and statistics included
    # backward: dw (and db) partial rows of fp32, at least MIN_ROWS_PER_PROGRAM rows per
    # program, each written once and read once by _bwd_sum (dw, db in the weights' dtype
    # and the weights and statistics read: within the 5%)
    n_params = 2 if op == "add_norm_layer" else 1
    partials = 2 * 4 * d * n_params * -(-rows // MIN_ROWS_PER_PROGRAM)
    assert bwd["kernel_MB"] <= 1.05 * bwd["min_MB"] + partials / 1e6


@pytest.mark.kernel
@interpreted_only
@pytest.mark.parametrize("d", [256, 1024])
def test_small_batches_stay_near_the_minimum(d):
    _, _, both = op_traffic.measure_traffic("add_norm", 256, d, torch.bfloat16)
    # forward, backward and the backward's partial-row sum; everything counted, glue ops too
    assert (both["launches"], both["glue_ops"]) == (3, 0) and both["kernel_over_min"] <= 1.25
    assert both["naive_over_kernel"] >= 1.5


@pytest.mark.kernel
@interpreted_only
@pytest.mark.parametrize("op", ["add_norm_scaled", "add_norm_parallel", "add_norm_dropout"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_branch_variants_move_the_compulsory_bytes(op, dtype):
    """add_norm's branch (issue 24.1): forward x (and x1) and residual in, out and
    new_residual out; backward p, grad_out, grad_new_residual in, dx, dresidual (apart
    from dx when alpha != 1 or with dropout) and, with dropout, dx1 out. No mask is
    stored or read, and the seed is drawn on the host and passed by value: no glue op,
    no byte."""
    from fuseblock.kernels.norm import MIN_ROWS_PER_PROGRAM

    rows, d = 96, 160
    fwd, bwd, _ = op_traffic.measure_traffic(op, rows, d, dtype)
    assert (fwd["launches"], bwd["launches"], fwd["glue_ops"], bwd["glue_ops"]) == (1, 2, 0, 0)
    for r in (fwd, bwd):
        assert r["act_over_min"] == 1.0
        assert r["naive_over_kernel"] > 1.2
    assert fwd["kernel_over_min"] <= 1.05
    partials = 2 * 4 * d * -(-rows // MIN_ROWS_PER_PROGRAM)
    assert bwd["kernel_MB"] <= 1.05 * bwd["min_MB"] + partials / 1e6


@pytest.mark.kernel
@interpreted_only
@pytest.mark.parametrize("comb", [True, False], ids=["comb", "no_comb"])
def test_hyper_boundary_reads_and_writes_the_streams_once(comb):
    """hc_add_norm at n = 4: forward, one launch whose activations are the minimum (H, f,
    post, comb in; H', y, post', comb' out), far fewer bytes than the unfused form;
    backward, two launches, H' read by both."""
    from fuseblock.testing.hyper_traffic import measure_hyper_traffic

    fwd, bwd, _ = measure_hyper_traffic(32, 4, 64, torch.bfloat16, comb=comb, iters=3)
    assert fwd["launches"] == 1 and bwd["launches"] == 2
    assert fwd["act_over_min"] == pytest.approx(1.0)
    assert fwd["unfused_over_kernel"] > 3 and bwd["unfused_over_kernel"] > 3
    assert 1.0 <= bwd["act_over_min"] < 1.25  # H' again in the dfn launch: 1 of 6.5 hidden states
    assert fwd["kept_MB"] < fwd["unfused_kept_MB"] / 10
