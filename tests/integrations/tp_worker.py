"""fuseblock on DTensors, on 2 gloo ranks (run under torchrun by test_tensor_parallel, once per
path: the kernel path when TRITON_INTERPRET=1 is in the environment). Every check runs on
both ranks against one process's result on the same data; rank 0 writes the findings as
JSON to argv[1] and the test asserts on them."""
import gc
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel import SequenceParallel as TorchSequenceParallel
from torch.utils._python_dispatch import TorchDispatchMode

import fuseblock
from fuseblock.parallel import FusedColwiseParallel, HiddenParallel, SequenceParallel
from fuseblock.testing import interpreter_lang
from fuseblock.testing.interpreter_rounding import install

B, T, D = 2, 4, 6  # T and D even: both ranks hold the same number of rows / columns


def whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel_diff(got, want) -> float:
    """max |got - want| over max(1, max |want|): fp32 values of a few units differ by an ulp or two."""
    got = whole(got)
    return ((got.double() - want.double()).abs().max() / max(1.0, want.abs().max().item())).item()


class Collectives(TorchDispatchMode):
    """Every collective dispatched, with the bytes of the tensor it moves (CommDebugMode counts them only)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional") and \
                not func.__name__.startswith(("wait", "_wrap")):  # a wait or autograd wrapper moves nothing
            t = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            self.calls.append((func.__name__, t.numel() * t.element_size()))
        return func(*args, **(kwargs or {}))


# each op on a dict of tensors: (out or None, new_residual or None); alpha=0.5 for the stream variants
OPS = {
    "norm": lambda t, kind: (fuseblock.norm(t["x"], t["weight"], t.get("bias"), kind=kind), None),
    "add_norm": lambda t, kind: fuseblock.add_norm(t["x"], t["residual"], t["weight"], t.get("bias"), kind=kind),
    "norm_add": lambda t, kind: (None, fuseblock.norm_add(t["x"], t["residual"], t["weight"], t.get("bias"),
                                                          kind=kind, alpha=0.5)),
    "norm_add_norm": lambda t, kind: fuseblock.norm_add_norm(t["x"], t["residual"], t["branch_weight"], t["weight"],
                                                             t.get("branch_bias"), t.get("bias"), kind=kind,
                                                             alpha=0.5),
}


def op_case(mesh, fn: str, kind: str, dim: int, shape=(B, T, D)) -> dict:
    """fuseblock.norm / add_norm / norm_add / norm_add_norm on x of `shape` sharded on `dim`
    (2: the normalized dim, the weights and biases Shard(0) with it; else replicated): values
    and every gradient against one process, the gradients arriving at out and new_residual
    both, and what it communicated."""
    torch.manual_seed(1)
    names = ["x"] + (["residual"] if fn != "norm" else []) + (["branch_weight"] if fn == "norm_add_norm" else [])
    names += ["weight"] + (["bias"] + (["branch_bias"] if fn == "norm_add_norm" else []) if kind == "layer" else [])
    full = {n: torch.randn(shape if n in ("x", "residual") else shape[-1:]) for n in names}
    dy, dz = torch.randn(shape), torch.randn(shape)
    ones = {n: t.clone().requires_grad_() for n, t in full.items()}
    place = [Shard(dim)]
    vec = [Shard(0)] if dim == 2 else [Replicate()]
    shards = {n: distribute_tensor(t, mesh, place if t.dim() == 3 else vec).requires_grad_() for n, t in full.items()}
    dys, dzs = distribute_tensor(dy, mesh, place), distribute_tensor(dz, mesh, place)

    def loss(out, new_res, dy, dz):  # Partial sums added: no int 0 to start from, which would reduce them
        terms = [(t * g).sum() for t, g in ((out, dy), (new_res, dz)) if t is not None]
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]

    out, new_res = OPS[fn](ones, kind)
    loss(out, new_res, dy, dz).backward()
    with CommDebugMode() as comm, Collectives() as coll:
        got, got_res = OPS[fn](shards, kind)
        loss(got, got_res, dys, dzs).backward()
    first = got if got is not None else got_res
    found = {
        "out_placements": str(first.placements),
        "value": rel_diff(first, out if out is not None else new_res),
        "grads": {n: rel_diff(shards[n].grad, ones[n].grad) for n in names},
        "weight_grad_placements": str(shards["weight"].grad.placements),
        "comm_counts": {str(k): v for k, v in comm.get_comm_counts().items()},
        "collectives": coll.calls,
        "rows": first.to_local().numel() // first.to_local().shape[-1],  # this rank's
    }
    if got is not None and got_res is not None:
        found["new_residual"] = rel_diff(got_res, new_res)
    return found


def branch_case(mesh, dim: int) -> dict:
    """add_norm's branch on DTensors: new_residual = residual + alpha * (x + x1), layer norm,
    x and x1 sharded on `dim` (2: the hidden dim), values and every gradient vs one process."""
    torch.manual_seed(8)
    full = [torch.randn(B, T, D) for _ in range(3)] + [torch.randn(D), torch.randn(D)]
    ones = [t.clone().requires_grad_() for t in full]
    vec = [Shard(0)] if dim == 2 else [Replicate()]
    shards = [distribute_tensor(t, mesh, [Shard(dim)] if t.dim() == 3 else vec).requires_grad_() for t in full]

    def run(x, x1, r, w, b):
        return fuseblock.add_norm(x, r, w, b, kind="layer", alpha=-0.7, x1=x1)

    out, res = run(*ones)
    (out.square().sum() + res.sum()).backward()
    got, got_res = run(*shards)
    (got.square().sum() + got_res.sum()).backward()
    return {"value": rel_diff(got, out), "new_residual": rel_diff(got_res, res),
            **{n: rel_diff(s.grad, o.grad) for n, s, o in zip(("x", "x1", "residual", "weight", "bias"), shards, ones,
                                                               strict=True)}}


DROP_P, DROP_ALPHA = 0.3, 0.5
DROP_SHAPE = (2, 32, 64)  # 4096 elements: the kept fraction within 5 binomial sds is +-0.036


def placed(mesh, dim):
    """x's placements and the vectors' for x sharded on `dim` (None: replicated)."""
    if dim is None:
        return [Replicate()], [Replicate()]
    return [Shard(dim)], [Shard(0)] if dim == 2 else [Replicate()]


def masks_of(got_res, r):
    """add_norm's masks decoded from new_residual, x = 1 and x1 = 3 everywhere:
    (new_residual - residual) (1 - p) / alpha = keep_x + 3 keep_x1, in {0, 1, 3, 4}."""
    v = ((whole(got_res) - r) * (1 - DROP_P) / DROP_ALPHA).round()
    return bool(((v == 0) | (v == 1) | (v == 3) | (v == 4)).all()), (v == 1) | (v == 4), v >= 3


def dropout_case(mesh, dims: tuple[int, ...], compiled: bool = False) -> dict[int, tuple[dict, torch.Tensor]]:
    """add_norm with dropout (layer norm, alpha, x1) on DTensors sharded on each of `dims`,
    x = 1 and x1 = 3 so new_residual tells both masks (`masks_of`), eager or under
    torch.compile(fullgraph=True) (one function calling it once per dim: one compile for them
    all). Against one process given those masks (x and x1 pre-scaled, no dropout): values and
    every gradient; the masks: decoded, x's apart from x1's, the kept fraction, the same after
    the same torch.manual_seed and not after another. Per dim, also the whole new_residual,
    which main holds the compiled call's against the eager one's."""
    torch.manual_seed(9)
    r, w, b = torch.randn(DROP_SHAPE), torch.randn(DROP_SHAPE[-1]), torch.randn(DROP_SHAPE[-1])
    full = [torch.ones(DROP_SHAPE), 3 * torch.ones(DROP_SHAPE), r, w, b]
    shards = []
    for dim in dims:
        place, vec = placed(mesh, dim)
        shards += [distribute_tensor(t, mesh, place if t.dim() == 3 else vec).requires_grad_() for t in full]

    def call(*flat):  # per dim: (out, new_residual)
        return [fuseblock.add_norm(x, r, w, b, kind="layer", alpha=DROP_ALPHA, x1=x1, dropout_p=DROP_P)
                for x, x1, r, w, b in (flat[5 * i:5 * i + 5] for i in range(len(dims)))]

    if compiled:
        torch._dynamo.reset()
        call = torch.compile(call, fullgraph=True)
    torch.manual_seed(10)
    got = call(*shards)
    torch.manual_seed(10)
    again = [whole(res) for _, res in call(*shards)]
    torch.manual_seed(11)
    other = [whole(res) for _, res in call(*shards)]
    sum(out.square().sum() + res.sum() for out, res in got).backward()
    results = {}
    for i, dim in enumerate(dims):
        got_out, got_res = got[i]
        decoded, keep_x, keep_x1 = masks_of(got_res, r)
        ones = [t.clone().requires_grad_() for t in full]
        scaled_x, scaled_x1 = ones[0] * keep_x / (1 - DROP_P), ones[1] * keep_x1 / (1 - DROP_P)
        out, res = fuseblock.add_norm(scaled_x, ones[2], ones[3], ones[4], kind="layer", alpha=DROP_ALPHA,
                                      x1=scaled_x1)
        (out.square().sum() + res.sum()).backward()
        found = {"masks_decoded": decoded, "numel": keep_x.numel(),
                 "kept": keep_x.float().mean().item(), "kept_x1": keep_x1.float().mean().item(),
                 "x_and_x1_masks_differ": bool((keep_x != keep_x1).any()),
                 "reproducible": bool(torch.equal(again[i], whole(got_res))),
                 "another_seed_differs": bool(not torch.equal(other[i], whole(got_res))),
                 "value": rel_diff(got_out, out), "new_residual": rel_diff(got_res, res),
                 **{n: rel_diff(s.grad, o.grad) for n, s, o in zip(("x", "x1", "residual", "weight", "bias"),
                                                                    shards[5 * i:5 * i + 5], ones, strict=True)}}
        results[dim] = found, whole(got_res).detach()
    return results


def dropout_layouts(mesh, compiling: bool) -> dict:
    """One dropout call (random fp32 x, x1, residual) on x sharded by rows (Shard(0),
    Shard(1)), on the hidden dim (Shard(2)) and replicated, each after the same
    torch.manual_seed: the whole new_residual and out of each against the replicated one's
    (bit for bit, but the hidden-dim norm's out, whose statistics are all-reduced sums); and
    the call compiled with `fallback_random` (torch's random ops): its masks are the eager
    one's (`compiling`: the kernel path). (With inductor's own random ops they are not: main
    compares dropout_case's compiled and eager calls, whose compile this one would repeat.)"""
    torch.manual_seed(12)
    full = [torch.randn(DROP_SHAPE) for _ in range(3)] + [torch.randn(DROP_SHAPE[-1]) for _ in range(2)]

    def run(dim, fn=fuseblock.add_norm):
        place, vec = placed(mesh, dim)
        x, x1, r, w, b = (distribute_tensor(t, mesh, place if t.dim() == 3 else vec) for t in full)
        torch.manual_seed(13)
        out, res = fn(x, r, w, b, kind="layer", alpha=DROP_ALPHA, x1=x1, dropout_p=DROP_P)
        return whole(out), whole(res)

    found = {}
    want_out, want_res = run(None)
    for dim in (0, 1, 2):
        out, res = run(dim)
        found[f"shard{dim}_new_residual_equal"] = bool(torch.equal(res, want_res))
        found[f"shard{dim}_out_equal"] = bool(torch.equal(out, want_out))
        found[f"shard{dim}_out"] = rel_diff(out, want_out)
    if compiling:
        torch._dynamo.reset()
        with torch._inductor.config.patch(fallback_random=True):
            found["compiled_fallback_random_new_residual_equal"] = bool(torch.equal(
                run(1, torch.compile(fuseblock.add_norm, fullgraph=True))[1], want_res))
    return found


def dropout_bf16(mesh) -> dict:
    """bf16 x, x1 and residual by rows: new_residual and out against the exact (fp64) value
    given the masks, in units of a bf16 ulp of it: at most half of one (the sum rounded once,
    out once from the stored new_residual), where dropping and scaling in bf16 before the sum
    would round twice. The masks decoded from a call on x = 1, x1 = 3 after the same seed:
    they depend on the key and the index, not on the values."""
    torch.manual_seed(14)
    x, x1, r = (torch.randn(DROP_SHAPE).bfloat16() for _ in range(3))
    w, b = torch.randn(DROP_SHAPE[-1]).bfloat16(), torch.randn(DROP_SHAPE[-1]).bfloat16()

    def run(x, x1, r):
        x, x1, r = (distribute_tensor(t, mesh, [Shard(1)]) for t in (x, x1, r))
        wd, bd = distribute_tensor(w, mesh, [Replicate()]), distribute_tensor(b, mesh, [Replicate()])
        torch.manual_seed(15)
        return fuseblock.add_norm(x, r, wd, bd, kind="layer", alpha=DROP_ALPHA, x1=x1, dropout_p=DROP_P)

    zero = torch.zeros(DROP_SHAPE, dtype=torch.bfloat16)
    _, decoder = run(torch.ones_like(x), 3 * torch.ones_like(x), zero)
    decoded, keep_x, keep_x1 = masks_of(decoder.float(), zero.float())
    out, res = (whole(t) for t in run(x, x1, r))
    exact_res = r.double() + DROP_ALPHA * (x.double() * keep_x + x1.double() * keep_x1) / (1 - DROP_P)
    exact_out = torch.nn.functional.layer_norm(res.double(), (DROP_SHAPE[-1],), w.double(), b.double())

    def ulps(got, want):  # |got - want| over the bf16 ulp at want (8 significant bits)
        _, e = torch.frexp(want)
        return ((got.double() - want).abs() / torch.ldexp(torch.ones_like(want), e - 8)).max().item()

    # the contrast: x and x1 dropped and scaled in bf16, then summed (rounded twice)
    twice = (r.float() + DROP_ALPHA * ((x * keep_x / (1 - DROP_P)).float() + (x1 * keep_x1 / (1 - DROP_P)).float()))
    return {"masks_decoded": decoded, "dtypes": [str(out.dtype), str(res.dtype)],
            "new_residual_ulps": ulps(res, exact_res), "out_ulps": ulps(out, exact_out),
            "rounded_twice_ulps": ulps(twice.bfloat16(), exact_res)}


def offsets_case(mesh) -> dict:
    """fuseblock's shard_offsets against DTensor's compute_local_shape_and_global_offset on
    this mesh (even, uneven and empty shards), and the global index of each local element
    (`_Placed.global_index`) against a global arange distributed as x is."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from fuseblock.ops.dtensor import _Placed, shard_offsets

    found = {}
    for shape in ((2, 4, 6), (2, 5, 7), (1, 1, 3)):
        for placements in ([Shard(0)], [Shard(1)], [Shard(2)], [Replicate()]):
            name = f"{shape}_{placements[0]}"
            local, offset = shard_offsets(shape, placements, mesh.shape, mesh.get_coordinate())
            want = compute_local_shape_and_global_offset(shape, mesh, placements)
            index = distribute_tensor(torch.arange(math.prod(shape)).view(shape), mesh, placements)
            got = _Placed(index, {}, {}).global_index()
            found[name] = [(tuple(local), tuple(offset)) == tuple(map(tuple, want)),
                           torch.equal(got, index.to_local())]
    return found


def norm_linear_case(mesh, x_placement, weight_placement) -> dict:
    """fuseblock.norm_linear (layer norm, a residual, a Linear with a bias) on x placed
    `x_placement` and the Linear's weight and bias `weight_placement`: y's placement, values
    and every gradient vs one process, and the shapes of the tensors kept for backward."""
    torch.manual_seed(11)
    full = [torch.randn(B, T, D), torch.randn(B, T, D), torch.randn(D), torch.randn(D), torch.randn(2 * D, D),
            torch.randn(2 * D)]
    ones = [t.clone().requires_grad_() for t in full]
    places = [[x_placement]] * 2 + [[Replicate()]] * 2 + [[weight_placement]] * 2
    shards = [distribute_tensor(t, mesh, pl).requires_grad_() for t, pl in zip(full, places, strict=True)]
    y, res = fuseblock.norm_linear(*ones, kind="layer")
    (y.square().sum() + res.sum()).backward()
    saved = []

    def pack(t):
        saved.append(list(t.shape))
        return t

    with CommDebugMode() as comm:  # the loss, Partial sums added, communicates nothing itself
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            got, got_res = fuseblock.norm_linear(*shards, kind="layer")
        (got.square().sum() + got_res.sum()).backward()
    return {"y_placements": str(got.placements), "comm_counts": {str(k): v for k, v in comm.get_comm_counts().items()},
            "saved_shapes": saved,
            "value": rel_diff(got, y), "new_residual": rel_diff(got_res, res),
            **{n: rel_diff(s.grad, o.grad) for n, s, o in zip(("x", "residual", "norm_weight", "norm_bias",
                                                                "weight", "bias"), shards, ones, strict=True)}}


def gate_case(mesh) -> dict:
    """A gated, grouped add_norm on rows sharded by sequence: the local op takes every option."""
    torch.manual_seed(6)
    x, r, z, w = torch.randn(B, T, D), torch.randn(B, T, D), torch.randn(B, T, D), torch.randn(D)
    opts = dict(gate_position="pre", gate_act="sigmoid", num_groups=2)
    ones = [t.clone().requires_grad_() for t in (x, r, z, w)]
    out, res = fuseblock.add_norm(ones[0], ones[1], ones[3], gate=ones[2], **opts)
    (out.square().sum() + res.sum()).backward()
    shards = [distribute_tensor(t, mesh, [Shard(1)] if t.dim() == 3 else [Replicate()]).requires_grad_()
              for t in (x, r, z, w)]
    got, got_res = fuseblock.add_norm(shards[0], shards[1], shards[3], gate=shards[2], **opts)
    (got.square().sum() + got_res.sum()).backward()
    return {"value": rel_diff(got, out), "new_residual": rel_diff(got_res, res),
            **{n: rel_diff(s.grad, o.grad) for n, s, o in zip(("x", "residual", "gate", "weight"), shards, ones,
                                                               strict=True)}}


COMPILED = {"compiled_shard1": (1, "add_norm"), "compiled_shard2": (2, "add_norm"),
            "compiled_norm_add_norm_shard2": (2, "norm_add_norm")}  # name: (x's dim, op)


def compile_cases(mesh) -> dict:
    """add_norm (or norm_add_norm, alpha 0.5) of layer norms on DTensors sharded on each
    COMPILED case's dim, the calls in one function under torch.compile(fullgraph=True) (one
    compile for them all): no graph break, values and every gradient as one process's."""
    torch.manual_seed(7)
    x, r, w, b = torch.randn(B, T, D), torch.randn(B, T, D), torch.randn(D), torch.randn(D)

    def call(fn, x, r, w, b):
        if fn == "add_norm":
            return fuseblock.add_norm(x, r, w, b, kind="layer")
        return fuseblock.norm_add_norm(x, r, b, w, w, b, kind="layer", alpha=0.5)

    ones, want, shards = {}, {}, {}
    for name, (dim, fn) in COMPILED.items():
        ones[name] = [t.clone().requires_grad_() for t in (x, r, w, b)]
        want[name] = out, res = call(fn, *ones[name])
        (out.square().sum() + res.sum()).backward()
        vec = [Shard(0)] if dim == 2 else [Replicate()]
        shards[name] = [distribute_tensor(t, mesh, [Shard(dim)] if t.dim() == 3 else vec).requires_grad_()
                        for t in (x, r, w, b)]

    def calls(*flat):
        return [call(fn, *flat[4 * i:4 * i + 4]) for i, (_, fn) in enumerate(COMPILED.values())]

    torch._dynamo.reset()
    got = torch.compile(calls, fullgraph=True)(*(t for name in COMPILED for t in shards[name]))
    sum(out.square().sum() + res.sum() for out, res in got).backward()
    found = {}
    for name, (got_out, got_res) in zip(COMPILED, got, strict=True):
        want_out, want_res = want[name]
        found[name] = {"value": rel_diff(got_out, want_out), "new_residual": rel_diff(got_res, want_res),
                       **{n: rel_diff(s.grad, o.grad) for n, s, o in zip(("x", "residual", "weight", "bias"),
                                                                          shards[name], ones[name], strict=True)}}
    return found


def module_case(mesh) -> dict:
    """AddNorm with its weight and bias sharded on the hidden dim, called (x, residual)."""
    torch.manual_seed(2)
    x, r = torch.randn(B, T, D), torch.randn(B, T, D)
    one = fuseblock.AddNorm(D, kind="layer")
    with torch.no_grad():
        one.weight.normal_(), one.bias.normal_()
    sharded = fuseblock.AddNorm(D, kind="layer")
    sharded.weight = nn.Parameter(distribute_tensor(one.weight.detach(), mesh, [Shard(0)]))
    sharded.bias = nn.Parameter(distribute_tensor(one.bias.detach(), mesh, [Shard(0)]))
    out, res = one(x, r)
    (out.square().sum() + res.sum()).backward()
    got, got_res = sharded(distribute_tensor(x, mesh, [Shard(2)]), distribute_tensor(r, mesh, [Shard(2)]))
    (got.square().sum() + got_res.sum()).backward()
    return {"value": rel_diff(got, out), "new_residual": rel_diff(got_res, res),
            "weight": rel_diff(sharded.weight.grad, one.weight.grad),
            "bias": rel_diff(sharded.bias.grad, one.bias.grad)}


def implicit_case(mesh, fn: str) -> dict:
    """Plain-tensor weights and biases beside x sharded by rows, inside torch's
    implicit_replication(): taken as Replicate, as torch's own ops take them. add_norm (layer,
    a residual) or norm_linear (its norm's and its Linear's parameters plain): values and every
    gradient vs one process; each plain parameter's gradient a plain tensor, the sum over
    both ranks' rows."""
    from torch.distributed.tensor.experimental import implicit_replication

    torch.manual_seed(12)
    full = [torch.randn(B, T, D), torch.randn(B, T, D), torch.randn(D), torch.randn(D)]
    names = ["x", "residual", "weight", "bias"]
    if fn == "norm_linear":
        full += [torch.randn(2 * D, D), torch.randn(2 * D)]
        names = ["x", "residual", "norm_weight", "norm_bias", "weight", "bias"]
    call = (lambda *t: fuseblock.add_norm(*t, kind="layer")) if fn == "add_norm" else \
        (lambda *t: fuseblock.norm_linear(*t, kind="layer"))
    ones = [t.clone().requires_grad_() for t in full]
    given = [distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in full[:2]] + \
        [t.clone().requires_grad_() for t in full[2:]]
    out, res = call(*ones)
    (out.square().sum() + res.sum()).backward()
    with implicit_replication():
        got, got_res = call(*given)
        (got.square().sum() + got_res.sum()).backward()
    return {"out_placements": str(got.placements), "value": rel_diff(got, out), "new_residual": rel_diff(got_res, res),
            "plain_grads": [type(t.grad).__name__ for t in given[2:]],
            **{n: rel_diff(g.grad, o.grad) for n, g, o in zip(names, given, ones, strict=True)}}


def refusals(mesh) -> dict:
    """The message of each call fuseblock must refuse: type and first line."""
    x = distribute_tensor(torch.randn(B, T, D), mesh, [Shard(1)])
    xh = distribute_tensor(torch.randn(B, T, D), mesh, [Shard(2)])
    w_rep = distribute_tensor(torch.ones(D), mesh, [Replicate()])
    w_sh = distribute_tensor(torch.ones(D), mesh, [Shard(0)])
    partial = DTensor.from_local(torch.randn(B, T, D), mesh, [Partial()])
    lin_rep = distribute_tensor(torch.ones(2 * D, D), mesh, [Replicate()])
    lin_sh = distribute_tensor(torch.ones(2 * D, D), mesh, [Shard(0)])
    lin_rows = distribute_tensor(torch.ones(2 * D, D), mesh, [Shard(1)])
    torch_style = parallelize_module(fuseblock.AddNorm(D), mesh, TorchSequenceParallel())
    x_local, r_local = torch.randn(B, T // 2, D), torch.randn(B, T // 2, D)
    fusing_norm = parallelize_module(fuseblock.Norm(D), mesh, SequenceParallel())
    torch_colwise = parallelize_module(nn.Linear(D, 2 * D), mesh, ColwiseParallel(input_layouts=Shard(1)))
    calls = {
        "partial_x": lambda: fuseblock.norm(partial, w_rep),
        "weight_sharded_x_by_rows": lambda: fuseblock.norm(x, w_sh),
        "weight_replicated_x_by_hidden": lambda: fuseblock.norm(xh, w_rep),
        "residual_placed_otherwise": lambda: fuseblock.add_norm(x, xh, w_rep),
        "plain_weight": lambda: fuseblock.norm(x, torch.ones(D)),
        "gate_hidden": lambda: fuseblock.norm(xh, w_sh, gate=xh),
        "groups_hidden": lambda: fuseblock.norm(xh, w_sh, num_groups=2),
        "norm_linear_row_sharded_weight": lambda: fuseblock.norm_linear(x, None, w_rep, None, lin_rows),
        "norm_linear_hidden": lambda: fuseblock.norm_linear(xh, None, w_sh, None, lin_sh),
        "norm_linear_bias_placed_otherwise": lambda: fuseblock.norm_linear(x, None, w_rep, None, lin_rep,
                                                                           distribute_tensor(torch.ones(2 * D), mesh,
                                                                                             [Shard(0)])),
        "norm_add_weight_replicated_x_by_hidden": lambda: fuseblock.norm_add(xh, xh, w_rep),
        "norm_add_norm_partial_x": lambda: fuseblock.norm_add_norm(partial, partial, w_rep, w_rep),
        "norm_add_norm_plain_residual": lambda: fuseblock.norm_add_norm(x, torch.randn(B, T, D), w_rep, w_rep),
        # torch's style keeps the first input only: the residual must not vanish silently
        "torch_style_positional_residual": lambda: torch_style(x_local, r_local),
        "norm_linear_uneven_sequence": lambda: fuseblock.norm_linear(
            distribute_tensor(torch.randn(B, T + 1, D), mesh, [Shard(1)]), None, w_rep, None, lin_sh),
        "fused_colwise_on_a_non_linear": lambda: parallelize_module(nn.GELU(), mesh, FusedColwiseParallel()),
        # add_linear never runs the Linear's forward: torch's ColwiseParallel hooks would be skipped
        "torch_colwise_on_a_fused_linear": lambda: fusing_norm.add_linear(x_local, r_local, torch_colwise),
    }
    found = {}
    for name, call in calls.items():
        try:
            call()
            found[name] = None
        except Exception as e:  # noqa: BLE001 - the test asserts the type and the message
            found[name] = [type(e).__name__, str(e)]
    return found


class PrenormMLP(nn.Module):
    """An MLP that fuses the block's norm into its first Linear (norm.add_linear), as the GPT's."""

    fuses_prenorm = True

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x, residual, prenorm):
        h, residual = prenorm.add_linear(x, residual, self.up)
        return self.down(nn.functional.gelu(h)), residual


def mlp_stack(seed: int, prenorm_mlp: bool = False, **shape) -> fuseblock.ResidualStack:
    torch.manual_seed(seed)
    mixers = [PrenormMLP() if prenorm_mlp else nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
              for _ in range(2)]
    return fuseblock.ResidualStack(mixers, D, kind="layer", **shape)


def stack_case(mesh, style, local_blocks: bool = False, **shape) -> dict:
    """A torchtitan-style plan on a fused ResidualStack (of `shape`: sandwich, post_norm, alpha):
    column/row-parallel MLPs, the norms under `style` (torch's SequenceParallel, or
    fuseblock's; the blocks' with use_local_output=local_blocks); x is this rank's sequence shard."""
    one, tp = mlp_stack(3, **shape), mlp_stack(3, **shape)
    with torch.no_grad():
        for p in one.parameters():  # norms away from ones and zeros: their gradients tell
            p.add_(0.1 * torch.randn(p.shape))
        tp.load_state_dict(one.state_dict())
    plan = {"norm_f": style()} if tp.norm_f is not None else {}
    for i, block in enumerate(tp.blocks):
        for norm in ("norm", "branch_norm"):
            if getattr(block, norm, None) is not None:
                plan[f"blocks.{i}.{norm}"] = style(use_local_output=local_blocks)
        up, down = ("up", "down") if shape.get("prenorm_mlp") else ("0", "2")
        # a Linear the norm fuses (add_linear) never runs its forward: weights placed, no hooks
        plan[f"blocks.{i}.mixer.{up}"] = FusedColwiseParallel() if shape.get("prenorm_mlp") else \
            ColwiseParallel(input_layouts=Shard(1))
        plan[f"blocks.{i}.mixer.{down}"] = RowwiseParallel(output_layouts=Shard(1))
    parallelize_module(tp, mesh, plan)
    torch.manual_seed(4)
    x = torch.randn(B, T, D)
    out = one(x.clone())
    out.square().sum().backward()
    rank = dist.get_rank()
    mine = x.chunk(2, dim=1)[rank].clone()
    got = tp(mine)
    got.square().sum().backward()
    grads = {n: rel_diff(p.grad, dict(one.named_parameters())[n].grad) for n, p in tp.named_parameters()}
    return {"value": rel_diff(got, out), "grad_max": max(grads.values()), "grads": grads}


def addnorm_style_case(mesh, style, dim: int, via_add: bool = False) -> dict:
    """A fuseblock style (sequence_dim 1, or the hidden dim 2) on a bare layer AddNorm called
    (x, residual) positionally with this rank's shards, use_local_output=True; via_add: by
    `AddNorm.add`, as a block may call it, not through forward."""
    torch.manual_seed(5)
    one = fuseblock.AddNorm(D, kind="layer")
    with torch.no_grad():
        one.weight.normal_(), one.bias.normal_()
    tp = fuseblock.AddNorm(D, kind="layer")
    tp.load_state_dict(one.state_dict())
    parallelize_module(tp, mesh, style(use_local_output=True))
    x, r = torch.randn(B, T, D), torch.randn(B, T, D)
    out, res = one(x, r)
    (out.square().sum() + res.sum()).backward()
    rank = dist.get_rank()
    got, got_res = (tp.add if via_add else tp)(x.chunk(2, dim)[rank], r.chunk(2, dim)[rank])
    (got.square().sum() + got_res.sum()).backward()
    whole_out, whole_res = torch.cat(_gather(got), dim), torch.cat(_gather(got_res), dim)
    return {"local_output": type(got).__name__, "weight_placements": str(tp.weight.placements),
            "value": rel_diff(whole_out, out), "new_residual": rel_diff(whole_res, res),
            "weight": rel_diff(tp.weight.grad, one.weight.grad), "bias": rel_diff(tp.bias.grad, one.bias.grad)}


def _gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach().contiguous())
    return parts


def main():
    dump = Path(sys.argv[1])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mine = {"kernel_path": fuseblock.ops.dispatch.uses_triton(torch.empty(1))}
    for fn in ("norm", "add_norm", "norm_add", "norm_add_norm"):
        for kind in ("rms", "layer"):
            for dim in (0, 1, 2):
                mine[f"{fn}_{kind}_shard{dim}"] = op_case(mesh, fn, kind, dim)
    # torch.compile on the kernel path only: Dynamo traces the same DTensor dispatch and the same
    # seed draw on both paths, the kernel path's custom ops on the local shards too (each compile
    # is seconds on a CPU, per rank; test_one_rank_mesh compiles the torch path's DTensor calls)
    compiling = mine["kernel_path"]
    mine["dropout_layouts"] = dropout_layouts(mesh, compiling)
    compiled = dropout_case(mesh, (1, 2), compiled=True) if compiling else {}
    for dim in (1, 2):
        mine[f"branch_shard{dim}"] = branch_case(mesh, dim)
        mine[f"dropout_shard{dim}"], eager = dropout_case(mesh, (dim,))[dim]
        if compiling:
            mine[f"dropout_compiled_shard{dim}"], compiled_res = compiled[dim]
            # the same call after the same seed: compiled, inductor draws the key from its own generator
            mine["dropout_layouts"][f"compiled_shard{dim}_new_residual_equal"] = bool(torch.equal(compiled_res,
                                                                                                   eager))
    mine["dropout_bf16"] = dropout_bf16(mesh)
    mine["offsets"] = offsets_case(mesh)
    mine["norm_linear_rows"] = norm_linear_case(mesh, Shard(1), Replicate())
    mine["norm_linear_columns"] = norm_linear_case(mesh, Replicate(), Shard(0))
    mine["norm_linear_sequence"] = norm_linear_case(mesh, Shard(1), Shard(0))
    for dim in (1, 2):  # 5 rows split 3 + 2, 7 columns 4 + 3
        mine[f"add_norm_layer_uneven_shard{dim}"] = op_case(mesh, "add_norm", "layer", dim, (2, 5, 7))
    mine["module_hidden"] = module_case(mesh)
    mine["gate_groups_rows"] = gate_case(mesh)
    if compiling:
        mine.update(compile_cases(mesh))
    mine["refusals"] = refusals(mesh)
    mine["implicit_add_norm"], mine["implicit_norm_linear"] = implicit_case(mesh, "add_norm"), \
        implicit_case(mesh, "norm_linear")
    try:  # the stream calls its norms' `add`, which torch's forward hooks never see: refused, not wrong
        mine["stack_torch_style"] = stack_case(mesh, TorchSequenceParallel)
    except TypeError as e:
        mine["stack_torch_style"] = {"error": [type(e).__name__, str(e).splitlines()[0]]}
    mine["stack_fuseblock_style"] = stack_case(mesh, SequenceParallel)
    mine["stack_sandwich"] = stack_case(mesh, SequenceParallel, sandwich=True, alpha=0.5)
    mine["stack_prenorm_mlp"] = stack_case(mesh, SequenceParallel, prenorm_mlp=True)
    # post-norm: the stream is the blocks' output, which the stack checks against its local input
    mine["stack_post_norm"] = stack_case(mesh, SequenceParallel, local_blocks=True, post_norm=True)
    mine["addnorm_sequence_style"] = addnorm_style_case(mesh, SequenceParallel, 1)
    mine["addnorm_hidden_style"] = addnorm_style_case(mesh, HiddenParallel, 2)
    mine["addnorm_sequence_style_add"] = addnorm_style_case(mesh, SequenceParallel, 1, via_add=True)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        (dump / "tp.json").write_text(json.dumps(ranks, indent=1))
    gc.collect()  # the DTensors and their pending collectives before the process group
    dist.destroy_process_group()


if __name__ == "__main__":
    install()  # the interpreter rounds as a GPU does, as in the tests' own process (conftest)
    interpreter_lang.install()  # and patches its language once per launch (conftest)
    main()
