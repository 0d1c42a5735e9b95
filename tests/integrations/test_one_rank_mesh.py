"""fuseblock's DTensor calls on a one-rank mesh of the test device, in this process: under
`make gpu-check` (FUSEBLOCK_TEST_DEVICE=cuda) a CUDA mesh, where the Triton kernels run
compiled on the DTensors' local shards, eagerly and under torch.compile(fullgraph=True);
on CPU the same calls through the interpreter (kernel path) or the torch path. One rank
holds every shard, so each call must equal the plain-tensor call: values and every
gradient, fp32. The multi-rank cases are test_tensor_parallel.py's (gloo, CPU)."""
import copy

import pytest
import torch
import torch.distributed as dist
from helpers import DEVICE

import fuseblock
from fuseblock.ops.dtensor import STRIDED_SPLIT_REDISTRIBUTES

pytestmark = pytest.mark.kernel
B, T, D = 2, 6, 8
TOL = 1e-6  # relative to max(1, the largest plain value): the hidden-dim path's torch ops


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("cpu:gloo,cuda:nccl" if DEVICE == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        yield init_device_mesh(DEVICE, (1,))
    finally:
        dist.destroy_process_group()


def _column_split(mesh, t, strided: bool):
    """A Linear's weight (or bias) split by rows: Shard(0), or q | k | v by heads as the GPT plan."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return distribute_tensor(t, mesh, [_StridedShard(0, split_factor=3) if strided else Shard(0)])


# (call, x's placement dim: 1 by rows, 2 the normalized dim)
CASES = {
    "add_norm_rows": (lambda x, r, w, b, lw, lb: fuseblock.add_norm(x, r, w, b, kind="layer"), 1),
    "add_norm_hidden": (lambda x, r, w, b, lw, lb: fuseblock.add_norm(x, r, w, b, kind="layer"), 2),
    "add_norm_branch_rows": (lambda x, r, w, b, lw, lb: fuseblock.add_norm(x, r, w, b, kind="rms", alpha=0.5, x1=r),
                             1),
    "norm_add_norm_hidden": (lambda x, r, w, b, lw, lb: fuseblock.norm_add_norm(x, r, b, w, w, b, kind="layer",
                                                                                alpha=0.5), 2),
    "norm_linear_sequence": (lambda x, r, w, b, lw, lb: fuseblock.norm_linear(x, r, w, b, lw, lb), 1),
}


def _inputs(mesh, case):
    """A case's plain tensors and the same placed on the mesh, each requiring its gradient."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dim = CASES[case][1]
    torch.manual_seed(0)
    plain = [torch.randn(B, T, D), torch.randn(B, T, D), torch.randn(D), torch.randn(D),
             torch.randn(3 * D, D), torch.randn(3 * D)]
    vector = [Shard(0)] if dim == 2 else [Replicate()]
    strided = case == "norm_linear_sequence"
    placed = [distribute_tensor(t, mesh, [Shard(dim)]) for t in plain[:2]] + \
        [distribute_tensor(t, mesh, vector) for t in plain[2:4]] + \
        [_column_split(mesh, t, strided) for t in plain[4:]]
    return [t.requires_grad_() for t in plain], [t.requires_grad_() for t in placed]


def _refused_before_212(case) -> bool:
    return case == "norm_linear_sequence" and not STRIDED_SPLIT_REDISTRIBUTES


@pytest.fixture(scope="module")
def compiled(mesh):
    """Every case's call (but one its torch refuses) in one function under
    torch.compile(fullgraph=True), one compile for them all: each case's outputs and its
    placed inputs' gradients (the loss a sum over the cases, each of its own inputs alone)."""
    cases = [c for c in CASES if not _refused_before_212(c)]
    placed = {c: _inputs(mesh, c)[1] for c in cases}

    def calls(*flat):
        return [CASES[c][0](*flat[6 * i:6 * i + 6]) for i, c in enumerate(cases)]

    torch._dynamo.reset()
    got = torch.compile(calls, fullgraph=True)(*(t for c in cases for t in placed[c]))
    sum(o.square().sum() for outs in got for o in outs).backward()
    return {c: (outs, placed[c]) for c, outs in zip(cases, got, strict=True)}


@pytest.mark.parametrize("compiled_call", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", list(CASES))
def test_dtensor_calls_on_a_one_rank_mesh_equal_plain_tensors(mesh, case, compiled_call, request):
    from torch.distributed.tensor import DTensor

    call = CASES[case][0]
    plain, placed = _inputs(mesh, case)
    want = call(*plain)
    if _refused_before_212(case):  # torch < 2.12: refused, naming the torch that can
        if compiled_call:
            torch._dynamo.reset()
            call = torch.compile(call, fullgraph=True)
        # compiled, Dynamo reports the ValueError as its own exception, the message within
        with pytest.raises((ValueError, torch._dynamo.exc.Unsupported),
                           match=r"norm_linear: weight's placement on mesh dim 0 is _StridedShard.* needs torch "
                                 r">= 2\.12: the DTensor of torch 2\."):
            call(*placed)
        return
    if compiled_call:  # the compiled fixture's: its outputs, its placed inputs' gradients
        got, placed = request.getfixturevalue("compiled")[case]
    else:
        got = call(*placed)
        sum(o.square().sum() for o in got).backward()
    assert all(isinstance(t, DTensor) for t in got)
    sum(o.square().sum() for o in want).backward()
    for what, g, w in [("out", got[0], want[0]), ("new_residual", got[1], want[1])] + [
            (f"grad {i}", a.grad, b.grad) for i, (a, b) in enumerate(zip(placed, plain, strict=True))
            if b.grad is not None]:
        g = g.full_tensor() if isinstance(g, DTensor) else g
        err = (g.double() - w.double()).abs().max().item() / max(1.0, w.abs().max().item())
        assert err <= TOL, f"{case}: {what} {err:.3g} off"


@pytest.mark.parametrize("op", ["add_norm", "norm_add_norm"])
def test_plain_parameters_inside_implicit_replication_are_replicate(mesh, op):
    """Inside torch's implicit_replication() a plain weight or bias beside a DTensor x is
    taken as Replicate, as torch's own ops take it: the values and every gradient (the plain
    ones plain tensors) equal the plain-tensor call. Outside it, a TypeError naming the
    argument and the context."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    def call(x, r, w, b):
        if op == "add_norm":
            return fuseblock.add_norm(x, r, w, b, kind="layer")
        return fuseblock.norm_add_norm(x, r, w, w, b, b, kind="layer", alpha=0.5)

    torch.manual_seed(0)
    plain = [torch.randn(B, T, D), torch.randn(B, T, D), torch.randn(D), torch.randn(D)]
    given = [distribute_tensor(t, mesh, [Shard(1)]) for t in plain[:2]] + [t.clone() for t in plain[2:]]
    with pytest.raises(TypeError, match="weight is a Tensor, but another argument is a DTensor.*implicit_replication"):
        call(*given)
    plain = [t.requires_grad_() for t in plain]
    given = [t.requires_grad_() for t in given]
    want = call(*plain)
    with implicit_replication():
        got = call(*given)
        assert all(isinstance(t, DTensor) for t in got)
        sum(o.square().sum() for o in got).backward()
    sum(o.square().sum() for o in want).backward()
    pairs = [("out", got[0].full_tensor(), want[0]), ("new_residual", got[1].full_tensor(), want[1])]
    pairs += [(f"grad {i}", a.grad.full_tensor() if isinstance(a, DTensor) else a.grad, b.grad)
              for i, (a, b) in enumerate(zip(given, plain, strict=True))]
    assert type(given[2].grad) is torch.Tensor and type(given[3].grad) is torch.Tensor
    for what, g, w in pairs:
        err = (g.double() - w.double()).abs().max().item() / max(1.0, w.abs().max().item())
        assert err <= TOL, f"{op}: {what} {err:.3g} off"


@pytest.mark.parametrize("dim", [1, 2], ids=["rows", "hidden"])
def test_out_dtype_on_dtensors_equals_the_plain_call(mesh, dim):
    """add_norm(out_dtype=fp32) of bf16 x: by rows the op on the local rows, on the hidden
    dim the all-reduced statistics' fp32 result; stored once in fp32 either way, as the
    plain-tensor call (values and every gradient)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    plain = [torch.randn(B, T, D).bfloat16(), torch.randn(B, T, D), torch.randn(D)]
    vector = [Shard(0)] if dim == 2 else [Replicate()]
    given = [distribute_tensor(t, mesh, [Shard(dim)]) for t in plain[:2]] + [distribute_tensor(plain[2], mesh, vector)]
    plain = [t.requires_grad_() for t in plain]
    given = [t.requires_grad_() for t in given]
    want = fuseblock.add_norm(*plain, kind="layer", out_dtype=torch.float32)
    got = fuseblock.add_norm(*given, kind="layer", out_dtype=torch.float32)
    assert got[0].dtype == want[0].dtype == torch.float32
    sum(o.square().sum() for o in want).backward()
    sum(o.square().sum() for o in got).backward()
    for what, g, w in [("out", got[0].full_tensor(), want[0]), ("new_residual", got[1].full_tensor(), want[1])] + [
            (f"grad {i}", a.grad.full_tensor(), b.grad) for i, (a, b) in enumerate(zip(given, plain, strict=True))]:
        # x's gradient is rounded to bf16 once, by the kernels or by torch (the hidden dim's ops):
        # one bf16 ulp apart at most where the interpreter truncates
        tol = TOL if g.dtype != torch.bfloat16 else 2 ** -7
        err = (g.double() - w.double()).abs().max().item() / max(1.0, w.abs().max().item())
        assert err <= tol, f"{what} {err:.3g} off"


class _TokenLinear(torch.nn.Linear):
    """A Linear of each token by a broadcast product: nn.Linear's own forward flattens the
    token dims (a view), which torch 2.11's DTensor refuses on tokens sharded by sequence."""

    def forward(self, x):
        return (x.unsqueeze(-2) * self.weight).sum(-1) + self.bias


def test_hyper_connection_stack_on_row_sharded_tokens_equals_plain_tensors(mesh):
    """HyperConnectionStack with its tokens sharded by sequence (Shard(1)) and its parameters
    replicated: the hc ops run on each rank's tokens (fuseblock.ops.dtensor.hyper), the
    sublayers' torch ops on the DTensors; values and every gradient."""
    from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor

    torch.manual_seed(3)
    plain = fuseblock.HyperConnectionStack([_TokenLinear(D, D), _TokenLinear(D, D)], D, streams=2, iters=3,
                                           init_std=0.3).to(DEVICE)
    placed = distribute_module(copy.deepcopy(plain), mesh)  # every parameter replicated
    x = torch.randn(B, T, D, device=DEVICE)
    want = plain(x)
    got = placed(distribute_tensor(x, mesh, [Shard(1)]))
    assert isinstance(got, DTensor) and got.placements == (Shard(1),)
    want.square().sum().backward()
    got.square().sum().backward()
    # one rank: both calls run the same path (the kernels or the torch path) on the same rows
    assert (got.full_tensor() - want).abs().max().item() <= TOL * max(1.0, want.abs().max().item())
    for (name, p), q in zip(placed.named_parameters(), plain.parameters(), strict=True):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert (g - q.grad).abs().max().item() <= TOL * max(1.0, q.grad.abs().max().item()), name


def test_a_strided_column_split_is_refused_only_by_the_torch_that_cannot_move_it():
    """FusedColwiseParallel with a _StridedShard (the GPT's q | k | v by heads): the DTensor of
    torch before 2.12 cannot redistribute one alone (2.10 and 2.11 raise, 2.9 moves it out
    of order), so there it is refused in one line naming the torch needed; from 2.12 it is
    taken."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from fuseblock.parallel import FusedColwiseParallel

    placement = _StridedShard(0, split_factor=3)
    if STRIDED_SPLIT_REDISTRIBUTES:
        assert FusedColwiseParallel(placement).placement == placement
    else:
        with pytest.raises(ValueError, match=r"^FusedColwiseParallel: placement is _StridedShard\(dim=0, sf=3\), a "
                                             r"strided column split, which needs torch >= 2\.12: the DTensor of "):
            FusedColwiseParallel(placement)


@pytest.mark.parametrize("dim", [2, 3], ids=["n", "d"])
def test_hc_ops_refuse_streams_split_across_a_token(mesh, dim):
    """The hc ops run on each rank's tokens: streams sharded on n or d (a token's streams
    split over ranks) are refused by name, as are plain streams beside DTensor parameters."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    n, m = 2, 2 * 2 + 2 * 2
    streams = torch.randn(B, T, n, D, device=DEVICE)
    params = [torch.randn(m, n * D, device=DEVICE) / 4, torch.randn(m, device=DEVICE), torch.ones(3, device=DEVICE),
              torch.ones(D, device=DEVICE)]
    placed = [distribute_tensor(t, mesh, [Replicate()]) for t in params]
    with pytest.raises(ValueError, match=rf"^streams' placement Shard\(dim={dim}\) on mesh dim 0 is not supported"):
        fuseblock.hc_norm(distribute_tensor(streams, mesh, [Shard(dim)]), *placed, iters=3)
    with pytest.raises(TypeError, match="^streams is a Tensor, but another argument is a DTensor"):
        fuseblock.hc_norm(streams, *placed, iters=3)


def test_the_per_channel_scales_refuse_dtensors(mesh):
    """residual_scale / branch_scale on DTensor inputs, or as DTensors beside plain inputs:
    refused by name on each op (a float branch_scale, alpha by another name, is taken)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    x, r, a = torch.randn(B, T, D, device=DEVICE), torch.randn(B, T, D, device=DEVICE), torch.full((D,), 0.5)
    dx, dr, da = (distribute_tensor(t.to(DEVICE), mesh, [Replicate()]) for t in (x, r, a))
    ops = [lambda x, r, a: fuseblock.add_norm(x, r, residual_scale=a),
           lambda x, r, a: fuseblock.norm_add(x, r, residual_scale=a),
           lambda x, r, a: fuseblock.norm_add_norm(x, r, None, None, kind="l2", residual_scale=a)]
    for op in ops:
        for args in ((dx, dr, 0.5), (x, r, da)):
            with pytest.raises(ValueError, match=r"^residual_scale and branch_scale do not take DTensor inputs yet"):
                op(*args)


def test_interpolate_refuses_dtensors(mesh):
    """update='interpolate' on DTensor inputs (with a float rate, which the scales' refusal
    does not see): refused by name on both ops."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    dx, dr = (distribute_tensor(torch.randn(B, T, D, device=DEVICE), mesh, [Replicate()]) for _ in range(2))
    for op in (lambda: fuseblock.norm_add(dx, dr, kind="l2", branch_scale=0.5, update="interpolate"),
               lambda: fuseblock.norm_add_norm(dx, dr, None, None, kind="l2", branch_scale=0.5, update="interpolate")):
        with pytest.raises(ValueError, match=r"^update='interpolate' does not take DTensor inputs yet"):
            op()
