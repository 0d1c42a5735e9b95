"""The weight gradients' bits, independent of the GPU under torch.use_deterministic_algorithms(True).

The backward sums dweight and dbias in fp32 partial rows, one per program, then adds
those up. By default the program count follows the GPU (SM count x programs per SM),
so an H100 and a B200 give different bits. In deterministic mode it is fixed by the
shape alone (`fuseblock.kernels.launch.row_programs`, `sum_cols`). Here the SM count is
simulated (launch.H100_SMS, what the interpreter assumes) and the bits compared; the
n-stream boundary's (`fuseblock.kernels.hyper`) programs and token splits too.
"""
import pytest
import torch
from helpers import generator

import fuseblock

pytestmark = [pytest.mark.kernel, pytest.mark.kernel_only("the kernels' partial-row sums")]

SMS = (1, 2, 132)  # a lone SM, two, an H100's: 4, 8 and 10 partial rows by default at 300 rows


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _hyper_grads(rows, n, d, dtype):
    """hc_add_norm's gradients (comb in and out): dw from _bwd's partial rows, dfn, dbase and
    dscale from _bwd_params' token splits."""
    g = generator(7)
    m = 2 * n + n * n
    H, f = torch.randn(rows, n, d, generator=g).to(dtype), torch.randn(rows, d, generator=g).to(dtype)
    post, comb = torch.rand(rows, n, generator=g), torch.softmax(torch.randn(rows, n, n, generator=g), -1)
    fn, base = torch.randn(m, n * d, generator=g) / (n * d) ** 0.5, torch.randn(m, generator=g)
    scale, w = torch.rand(3, generator=g) + 0.5, torch.randn(d, generator=g) + 1
    leaves = [t.requires_grad_(True) for t in (H, f, post, comb, fn, base, scale, w)]
    out = fuseblock.hc_add_norm(*leaves, iters=2)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in out)
    return [t.clone() for t in torch.autograd.grad(loss, leaves)]


def _grads(op, rows, d, dtype):
    if op == "hc_add_norm":
        return _hyper_grads(rows, 2, d, dtype)
    g = generator(7)
    x, r, dout = (torch.randn(rows, d, generator=g).to(dtype) for _ in range(3))
    w, b, w2, b2 = (torch.randn(d, generator=g).to(dtype).requires_grad_(True) for _ in range(4))
    x.requires_grad_(True)
    if op == "layer":
        out = fuseblock.norm(x, w, b, kind="layer")
    elif op == "add_norm_gate":
        out = fuseblock.add_norm(x, r, w, b, kind="layer", gate=dout * 0.5, gate_act="silu")[0]
    elif op == "norm_add_norm":
        out = fuseblock.norm_add_norm(x, r, w, w2, b, b2, kind="layer")[0]
    else:  # norm_add
        out = fuseblock.norm_add(x, r, w, b, kind="layer")
    params = [w, b] + ([w2, b2] if op == "norm_add_norm" else [])
    grads = torch.autograd.grad((out.float() * dout.float()).sum(), [x, *params])
    return [t.clone() for t in grads]


def _by_sms(monkeypatch, op, rows, d, dtype):
    import fuseblock.kernels.hyper as HC
    import fuseblock.kernels.launch as L
    import fuseblock.kernels.norm as K
    import fuseblock.kernels.norm_add as NA

    monkeypatch.setattr(HC, "MIN_SPLIT_BLOCKS", 1)  # _bwd_params splits its token sums at 40 rows
    monkeypatch.setattr(HC, "fit_per_sm", lambda num_warps: 1)  # into as many as the SMs (7 at most)
    found = {}
    for sms in SMS:
        # num_sms where the launchers read it: H100_SMS stands in only where there is no
        # GPU (a GPU run asks its own, which the first H200 run showed left the check blind)
        monkeypatch.setattr(L, "H100_SMS", sms)
        for module in (L, K, NA, HC):
            monkeypatch.setattr(module, "num_sms", lambda device, n=sms: n)
        found[sms] = _grads(op, rows, d, dtype)
    return found


def _same(found):
    first = found[SMS[0]]
    return {sms: all(torch.equal(a, b) for a, b in zip(first, g, strict=True)) for sms, g in found.items()}


CASES = [
    pytest.param("layer", 300, 48, torch.float32, id="norm-tile-fp32"),
    pytest.param("add_norm_gate", 300, 48, torch.bfloat16, id="add_norm-gated-tile-bf16"),
    pytest.param("norm_add_norm", 300, 48, torch.float32, id="norm_add_norm-tile-fp32"),
    # the n-stream boundary: 3 token blocks (the last ragged), 2, 3 and 3 programs and 1, 2
    # and 3 token splits by default
    pytest.param("hc_add_norm", 40, 16, torch.bfloat16, id="hc_add_norm-bf16"),
]


@pytest.mark.parametrize("op,rows,d,dtype", CASES)
def test_weight_gradients_do_not_depend_on_the_sm_count(monkeypatch, deterministic, op, rows, d, dtype):
    import fuseblock.kernels.norm as K
    import fuseblock.kernels.norm_add as NA

    for module in (K, NA):  # up to 10 tile programs at 300 rows (blocks of 32), as 64 rows each would at 600
        monkeypatch.setattr(module, "MIN_ROWS_PER_PROGRAM", 30)
    assert all(_same(_by_sms(monkeypatch, op, rows, d, dtype)).values())
    if op in ("layer", "hc_add_norm"):
        # the simulation reaches the split: without deterministic mode the partial rows
        # follow the SM count and the bits change (what was checked above rules out)
        torch.use_deterministic_algorithms(False)
        found = _by_sms(monkeypatch, op, rows, d, dtype)
        assert not all(_same(found).values()), "every SM count gave the same bits: the check above would be blind"
        assert all(torch.equal(found[SMS[0]][0], g[0]) for g in found.values())  # dx is per row: never changes
        if op == "hc_add_norm":  # each of dw (_bwd's partial rows) and dbase (the token splits) did change;
            # dfn's dots add block after block in either order under the interpreter (a GPU's need not)
            assert not torch.equal(found[SMS[0]][-1], found[SMS[-1]][-1])
            assert not torch.equal(found[SMS[0]][5], found[SMS[-1]][5])


@pytest.mark.parametrize("op,rows,d", [("layer", 24, 20), ("norm_add_norm", 24, 20)], ids=["norm", "norm_add_norm"])
def test_wide_row_weight_gradients_do_not_depend_on_the_sm_count(monkeypatch, small_wide_rows, deterministic, op,
                                                                 rows, d):
    import fuseblock.kernels.norm_add as NA

    monkeypatch.setattr(NA, "MIN_ROWS_PER_PROGRAM", 4)  # several loop programs at 24 rows, as small_wide_rows does
    assert all(_same(_by_sms(monkeypatch, op, rows, d, torch.float32)).values())


def test_deterministic_mode_changes_nothing_but_the_split(deterministic, monkeypatch):
    # the same values up to the fp32 sums' rounding: against the default order
    import fuseblock.kernels.launch as L

    monkeypatch.setattr(L, "H100_SMS", 1)
    monkeypatch.setattr(L, "num_sms", lambda device: 1)
    fixed = _grads("norm_add_norm", 300, 48, torch.float32)
    torch.use_deterministic_algorithms(False)
    default = _grads("norm_add_norm", 300, 48, torch.float32)
    assert torch.equal(fixed[0], default[0])
    for a, b in zip(fixed[1:], default[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
