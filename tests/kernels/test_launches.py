"""Launches per call, Triton kernels and torch ops together: one for the forward, at most
two for the backward (issue 16), for every dtype, variant and layout of the core op, and
for embed_norm. Counted by helpers.AllLaunches; the gradients are checked against the fp64
reference too, since these are the cases where dw and db are summed in a kernel. The channel
norms (batch, group, instance norm) too: one launch forward, one or two backward."""
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, AllLaunches, assert_close
from ref64 import add_norm64, leaf64

import fuseblock

pytestmark = [pytest.mark.kernel, pytest.mark.kernel_only("counts the Triton path's launches")]

class Case(NamedTuple):
    kind: str
    bias: bool = False
    res: str = "none"  # the residual: none, same (x's dtype), fp32
    gate: str | None = None  # its position
    groups: int = 1
    weight: bool = True

    @property
    def params(self) -> bool:
        return self.weight or self.bias


CASES = {
    "rms": Case("rms"),
    "layer_bias": Case("layer", bias=True),
    "l2": Case("l2"),
    "rms_residual": Case("rms", res="same"),
    "layer_fp32_residual": Case("layer", bias=True, res="fp32"),
    "pre_gate": Case("layer", bias=True, res="same", gate="pre"),
    "post_gate": Case("rms", res="same", gate="post"),
    "groups": Case("layer", bias=True, groups=4),
    "no_weight_no_bias": Case("layer", res="same", weight=False),
}


def _inputs(case, dtype, rows, d):
    kind, bias, res, gate, groups, weight = CASES[case]
    x = torch.randn(rows, d).to(dtype) * 2 + 1
    residual = {"none": None, "same": torch.randn(rows, d).to(dtype), "fp32": torch.randn(rows, d)}[res]
    w = torch.randn(d).to(dtype) if weight else None
    b = torch.randn(d).to(dtype) if bias else None
    kw = dict(kind=kind, num_groups=groups, residual_dtype=torch.float32 if res == "fp32" else None)
    if gate:
        kw.update(gate=torch.randn(rows, d).to(dtype), gate_position=gate)
    named = {k: t for k, t in dict(x=x, residual=residual, weight=w, bias=b, gate=kw.get("gate")).items()
             if t is not None}
    for t in named.values():
        t.requires_grad_(True)
    return x, residual, w, b, kw, named


def _count(case, dtype, rows, d):
    """(forward launches, backward launches) of one add_norm, its gradients checked."""
    x, residual, w, b, kw, named = _inputs(case, dtype, rows, d)
    with AllLaunches() as fwd:
        out, new_res = fuseblock.add_norm(x, residual, w, b, **kw)
    # new_residual gets a gradient when it is an output of its own (else it is x itself,
    # and autograd would add the two gradients of x: its work, not the op's)
    outs = [out, new_res] if residual is not None else [out]
    grads = [torch.randn_like(t) for t in outs]
    with AllLaunches() as bwd:
        got = torch.autograd.grad(outs, list(named.values()), grads)

    ref = {k: leaf64(t) for k, t in named.items()}
    ref_kw = dict(kw, gate=ref.get("gate"), residual_dtype=kw["residual_dtype"] or dtype)
    ref_outs = add_norm64(ref["x"], ref.get("residual"), ref.get("weight"), ref.get("bias"), **ref_kw)
    ref_outs = ref_outs[: len(outs)]
    ref_grads = torch.autograd.grad(ref_outs, list(ref.values()), [g.double() for g in grads])
    for (name, leaf), g, rg in zip(named.items(), got, ref_grads, strict=True):
        assert g.dtype == leaf.dtype, name  # in the parameter's own dtype, no cast launched after
        assert_close(g, rg, leaf.dtype, f"d{name}")
    for counted in (fwd, bwd):  # the launchers count what the interpreter ran
        assert counted.names is None or len(counted.names) == counted.kernels
    return fwd, bwd


def _by_rows(rows_one, rows_several):
    """(case, dtype, rows): one program in every case and dtype (the host's launches and
    casts); several programs (the partial rows' sum) in every case, the dtypes in turn."""
    one = [pytest.param(c, d, rows_one, id=f"{c}-{d}-one_program") for c in CASES for d in DTYPES]
    turn = [(c, DTYPES[i % len(DTYPES)]) for i, c in enumerate(CASES)]
    several = [pytest.param(c, d, rows_several, id=f"{c}-{d}-several_programs") for c, d in turn]
    return one + several


@pytest.mark.parametrize("case,dtype,rows", _by_rows(8, 130))
def test_tile_kernels_launch_once_forward_at_most_twice_backward(case, dtype, rows, monkeypatch):
    import fuseblock.kernels.launch as L

    monkeypatch.setattr(L, "SUM_TILE", 64)  # 2 partial rows per block: _bwd_sum loops, ragged
    fwd, bwd = _count(case, dtype, rows, 40)  # 40 columns: _bwd_sum's second column block is ragged
    assert (fwd.total, fwd.ops) == (1, [])
    assert bwd.total <= 2 and bwd.ops == []
    # 130 rows: 3 programs of 64 rows, whose partial rows _bwd_sum adds up; 8 rows: one
    # program, which writes dw and db itself
    expected = ["_bwd_tile"] + (["_bwd_sum"] if CASES[case].params and rows > 64 else [])
    assert bwd.names in (None, expected)


@pytest.mark.usefixtures("small_wide_rows")
@pytest.mark.parametrize("case,dtype,rows", _by_rows(3, 29))
def test_wide_row_kernels_launch_once_forward_at_most_twice_backward(case, dtype, rows):
    # 20 columns, past the shrunken tile limits: 3 chunks of 8 (the last ragged); 29 rows
    # are 8 row blocks over 5 programs per chunk, more than one block of partial rows (4)
    # for the last of them to sum
    fwd, bwd = _count(case, dtype, rows, 20)
    assert (fwd.total, fwd.ops) == (1, [])
    assert (bwd.total, bwd.ops) == (2, [])
    if bwd.names is not None:
        assert bwd.names == ["bwd_dots", "bwd_cols"]
        # with several programs per chunk, the arrival counters (zeroed by bwd_dots) pick
        # the last, which sums the partial rows
        assert ("CNT" in bwd.launches[1].written) == (CASES[case].params and rows == 29)


@pytest.mark.parametrize("layout", ["tile", "wide"])
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no_dropout", "dropout"])
def test_branch_launches_once_forward_at_most_twice_backward(layout, p, request):
    # add_norm's branch (alpha, x1, dropout): with dropout the seed is drawn on the host
    # and passed by value, so the device runs the kernel alone (issue 24: a torch.randint
    # on x's device was a second launch); its masks are regenerated in backward from it
    if layout == "wide":
        request.getfixturevalue("small_wide_rows")
    rows, d = (130, 40) if layout == "tile" else (29, 20)
    x, x1, r = (torch.randn(rows, d, requires_grad=True) for _ in range(3))
    w = torch.randn(d, requires_grad=True)
    with AllLaunches() as fwd:
        out, new_res = fuseblock.add_norm(x, r, w, alpha=0.7, x1=x1, dropout_p=p)
    grads = (torch.randn_like(out), torch.randn_like(new_res))
    with AllLaunches() as bwd:
        torch.autograd.grad((out, new_res), (x, x1, r, w), grads)
    assert (fwd.total, fwd.ops) == (1, []) and (bwd.total, bwd.ops) == (2, [])
    assert fwd.host_ops == (["randint", "_local_scalar_dense"] if p else [])
    assert bwd.host_ops == (["_local_scalar_dense"] if p else [])
    if fwd.names is not None:
        assert fwd.names == ["_fwd_tile" if layout == "tile" else "fwd_loop"]
        assert bwd.names == (["_bwd_tile", "_bwd_sum"] if layout == "tile" else ["bwd_dots", "bwd_cols"])


@pytest.mark.parametrize("layout", ["tile", "wide"])
def test_empty_batch_backward_fills_zeros_in_the_parameter_dtypes(layout, request):
    if layout == "wide":
        request.getfixturevalue("small_wide_rows")
    x, residual, w, b, kw, named = _inputs("layer_fp32_residual", torch.bfloat16, 0, 20)
    with AllLaunches() as fwd:
        out, new_res = fuseblock.add_norm(x, residual, w, b, **kw)
    with AllLaunches() as bwd:
        got = torch.autograd.grad([out, new_res], list(named.values()), [out, new_res])
    assert fwd.total == 0
    assert bwd.kernels == 0 and bwd.ops == ["zeros", "zeros"]  # dw and db: no rows, no kernel, a fill each
    for leaf, g in zip(named.values(), got, strict=True):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape and not g.any()


@pytest.mark.parametrize("layout", ["tile", "wide"])
@pytest.mark.parametrize("ord", ["l1", "l2", "max"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embed_norm_launches_once_each_way(layout, ord, dtype, request):
    if layout == "wide":
        request.getfixturevalue("small_wide_rows")
    x = torch.randn(6, 20).to(dtype).requires_grad_()
    with AllLaunches() as fwd:
        y = fuseblock.embed_norm(x, ord)
    dy = torch.randn_like(y)
    with AllLaunches() as bwd:
        torch.autograd.grad(y, x, dy)
    assert (fwd.total, bwd.total) == (1, 1) and fwd.ops == bwd.ops == []
    if bwd.names is not None:
        assert bwd.names == (["_bwd_tile"] if layout == "tile" else ["_bwd_loop"])


# ------------------------------------------------------------------ the channel norms
CHANNEL_OPS = ["batch_norm", "batch_norm_running", "group_norm", "instance_norm"]


def _channel_call(op, x, w, b, running, fn=None):
    """One channel norm: fuseblock's (fn None), else torch's `fn` (F), on running buffers."""
    if op.startswith("batch_norm"):
        return (fn or fuseblock).batch_norm(x, *running, w, b, training=True, momentum=0.3)
    if op == "group_norm":
        return (fn or fuseblock).group_norm(x, 2, w, b, eps=1e-5)
    return (fn or fuseblock).instance_norm(x, weight=w, bias=b, eps=1e-5)


@pytest.mark.parametrize("op", CHANNEL_OPS)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("n", [1, 3], ids=["one_sample", "three_samples"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_channel_norms_launch_once_forward_at_most_twice_backward(op, affine, n, dtype):
    # batch norm: one program per channel, which owns it and writes dw[c], db[c]: one launch
    # each way, the running buffers updated in the forward's; group and instance norm: the
    # per-sample partials of dw, db summed by _bwd_sum, one launch more with several samples
    x = (torch.randn(n, 4, 5) * 2 + 1).to(dtype).requires_grad_()
    w, b = (torch.randn(4).to(dtype).requires_grad_(), torch.randn(4).to(dtype).requires_grad_()) if affine \
        else (None, None)
    running = (torch.randn(4), torch.rand(4) + 0.5) if op == "batch_norm_running" else (None, None)
    mine = [None if t is None else t.clone() for t in running]
    with AllLaunches() as fwd:
        y = _channel_call(op, x, w, b, mine)
    leaves = [t for t in (x, w, b) if t is not None]
    dy = torch.randn_like(y)
    with AllLaunches() as bwd:
        got = torch.autograd.grad(y, leaves, dy)

    refs = [leaf64(t) for t in leaves]
    ref64 = [None if t is None else t.double() for t in running]
    ref = _channel_call(op, refs[0], *(refs[1:] if affine else (None, None)), ref64, fn=F)
    assert_close(y, ref, dtype, "y")
    for name, leaf, g, rg in zip("xwb", leaves, got, torch.autograd.grad(ref, refs, dy.double()), strict=False):
        assert g.dtype == leaf.dtype, name
        assert_close(g, rg, dtype, f"d{name}")
    for buf, rbuf in zip(mine, ref64, strict=True):
        if buf is not None:
            assert_close(buf, rbuf, torch.float32, "running buffer")
    assert (fwd.total, fwd.ops) == (1, [])
    assert fwd.names in (None, ["_channel_fwd"])
    summed = affine and n > 1 and not op.startswith("batch_norm")
    assert (bwd.total, bwd.ops) == (2 if summed else 1, [])
    assert bwd.names in (None, ["_channel_bwd"] + (["_bwd_sum"] if summed else []))


def test_a_call_resolves_no_types_and_imports_nothing_anew(monkeypatch):
    # The host work around each launch is what bounds small kernels (bench.py overhead):
    # a spec already seen is not rebuilt (get_type_hints evaluates string annotations) and
    # the kernel module is not imported again, on any forward or backward.
    import importlib

    import fuseblock.spec

    x, residual, w, b, kw, named = _inputs("pre_gate", torch.float32, 4, 8)

    def step():
        out, res = fuseblock.add_norm(x, residual, w, b, **kw)
        torch.autograd.grad((out, res), list(named.values()), (out, res))

    step()  # the first call imports the kernel module
    calls = []
    monkeypatch.setattr(fuseblock.spec, "get_type_hints", lambda *a, **k: calls.append("get_type_hints"))
    monkeypatch.setattr(importlib, "import_module", lambda *a, **k: calls.append("import_module"))
    step()
    assert calls == []
