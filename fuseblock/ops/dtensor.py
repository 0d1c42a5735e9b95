"""fuseblock's ops on DTensors (torch.distributed.tensor), both paths: `norm`, `add_norm`
(its branch too: alpha, x1, dropout_p), `norm_add`, `norm_add_norm` and `norm_linear`;
the hc ops by tokens (`hyper`). docs/parallel.md.

For each mesh dim, x's placement decides what runs there:
- Replicate, or Shard on a row dim (any dim but the last): the op runs on each rank's
  local rows, unchanged (the kernels or the torch path). A replicated weight or bias
  gets a Partial gradient on the row-sharded mesh dims, which DTensor sums across them.
- Shard on the normalized (last) dim, the weights and biases sharded the same way
  (Shard(0)): each rank sums its part of every row (the sum of squares; and the sum, for
  a layer norm) and one all-reduce of those fp64 sums completes each norm's statistics:
  8 bytes a row (rms, l2), 16 (layer). The backward all-reduces its two (or one) row dot
  products the same way. Rows are never gathered. This path is torch ops on the local
  shards under an autograd.Function, on both paths; gates, num_groups > 1 and norm_linear
  are refused there.
- anything else (Partial, a strided shard, a weight placed otherwise): a ValueError naming it.

Dropout (add_norm's dropout_p) is applied here, before the op, as torch integer ops: each
element's mask is a hash of one key drawn per call and the element's index in the global
tensor (`fuseblock.ops.seed.hash_keep`), so the masks are the same whatever the layout (rows, columns, replicas,
one process), need no generator state per shard, and trace under torch.compile.

The custom ops' sharding is not registered with DTensor (register_sharding): the calls
are unwrapped here, before any op, which serves both paths (the torch path has no custom
op) and the hidden-dim case (whose all-reduce a sharding rule cannot express: DTensor would
gather the rows), and torch.compile(fullgraph=True) traces it (docs/parallel.md).

Nothing here imports torch.distributed until a call passes a DTensor (importing it
costs about a second), and the ops hand in their own local forms, so this module does
not import them.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch
from torch import Tensor

from ..spec import acc_dtype, new_residual_dtype, stored_dtype
from .checks import check_branch, check_tensor, resolve
from .seed import draw_seed, hash_keep

NO_SCALES = "residual_scale and branch_scale do not take DTensor inputs yet (alpha does)"


def refuse_scales(x, residual, rscale, bscale) -> None:
    """The per-channel scales on DTensors (inputs or the [d] scales themselves): a ValueError."""
    if has_dtensor(x, residual, rscale, bscale, None):
        raise ValueError(NO_SCALES)


def has_dtensor(x, residual, weight, bias, gate, x1=None) -> bool:
    """Whether any argument is a DTensor: 0.09 us a call while torch.distributed.tensor is not
    loaded, 0.27 us once it is (this project's CPU). Written out, not looped over the
    arguments: on the eager torch path this is part of every small call's host time.
    norm_add and norm_linear pass their own tensors in the six slots."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return False
    cls = module.DTensor
    return (isinstance(x, cls) or isinstance(weight, cls) or (residual is not None and isinstance(residual, cls))
            or (bias is not None and isinstance(bias, cls)) or (gate is not None and isinstance(gate, cls))
            or (x1 is not None and isinstance(x1, cls)))


def _implicitly_replicated(*tensors):
    """The arguments, with each plain tensor among them a Replicate DTensor on the mesh of
    the DTensors inside torch's `implicit_replication()` context, as torch's own ops take
    them there (its gradient, summed over the ranks where it is Partial, comes back to the
    plain tensor); unchanged outside it, where _Placed refuses a plain tensor by name."""
    from torch.distributed.tensor import DTensor, Replicate

    from .dtensor_constants import implicit_replication

    if all(t is None or isinstance(t, DTensor) for t in tensors) or not implicit_replication():
        return tensors
    mesh = next(t.device_mesh for t in tensors if isinstance(t, DTensor))
    return tuple(DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
                 if isinstance(t, Tensor) and not isinstance(t, DTensor) else t for t in tensors)


class _Placed:
    """An op's DTensor arguments, checked. For each mesh dim, x's placement decides:
    Replicate or Shard on a row dim (the latter recorded in `rows`), or Shard on the last dim
    (`hidden`); the tensors `like` x must be placed as x is, the `vectors` (a norm's weight
    and bias) Replicate where x is by rows and Shard(0) where x is by columns, and `others`
    (a Linear's weight and bias, which the op checks itself) only be DTensors on x's mesh.
    `unwrap()` gives the local tensors; `placed` makes a local result a DTensor."""

    def __init__(self, x, like: dict, vectors: dict, others: dict | None = None):
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        others = others or {}
        tensors = {"x": x, **like, **vectors, **others}
        for name, t in tensors.items():
            if t is not None and not isinstance(t, DTensor):
                raise TypeError(f"{name} is a {type(t).__name__}, but another argument is a DTensor: pass every "
                                f"tensor as a DTensor on one mesh (DTensor.from_local, distribute_tensor; for a "
                                f"norm's inputs, shard it with fuseblock.parallel.SequenceParallel or HiddenParallel), "
                                f"or call inside torch's implicit_replication(), which takes it as Replicate")
        self.mesh, last = x.device_mesh, x.ndim - 1
        for name, t in tensors.items():
            if t is not None and t.device_mesh != self.mesh:
                raise ValueError(f"{name} is on mesh {t.device_mesh}, x on {self.mesh}: one mesh for every argument")
        self.rows, self.hidden = [], []
        for i, p in enumerate(x.placements):
            if _is_shard(p) and p.dim % x.ndim == last:
                self.hidden.append(i)
                vector = Shard(0)
            elif _is_shard(p) or isinstance(p, Replicate):
                if _is_shard(p):
                    self.rows.append(i)
                vector = Replicate()
            else:
                raise ValueError(f"x's placement {p!r} on mesh dim {i} is not supported: fuseblock's norms take x "
                                 f"Replicate, Shard on a row dim, or Shard({last}) (the normalized dim); "
                                 f"redistribute it first (docs/parallel.md)")
            for name, t in like.items():
                if t is not None and t.placements[i] != p:
                    raise ValueError(f"{name}'s placement {t.placements[i]!r} on mesh dim {i} differs from x's "
                                     f"{p!r}: {name} must be placed as x is")
            for name, t in vectors.items():
                if t is not None and t.placements[i] != vector:
                    raise ValueError(f"{name}'s placement {t.placements[i]!r} on mesh dim {i} does not fit x's "
                                     f"{p!r}: with x {p!r} the {name} must be {vector!r}")
        self.x, self.groups = x, [(self.mesh, i) for i in self.hidden]  # the all-reduces' (mesh, mesh dim)s
        self._tensors, self._vectors, self._others, self._partial = tensors, set(vectors), set(others), Partial()

    def unwrap(self, partial: tuple[int, ...] = (), gathered: tuple[int, ...] = ()) -> dict:
        """Each argument's local tensor by name (None where absent). The vectors' gradients
        are Partial on the row-sharded mesh dims (every rank's rows use the whole vector);
        on the mesh dims in `partial` (where each rank's result is a part of a sum: a
        column-parallel Linear after the norm) those of x, the tensors like it and the norm's
        vectors are too. The others' (a Linear's) are Partial on the row-sharded mesh dims
        but those `gathered` (where the Linear reads every rank's rows)."""
        def grads(name, t):
            if name in self._others:  # the Linear's weight and bias
                summed = [i for i in self.rows if i not in gathered]
            elif name in self._vectors:
                summed = (*self.rows, *partial)
            else:
                summed = partial
            return [self._partial if i in summed else p for i, p in enumerate(t.placements)]

        return {name: None if t is None else _plain(t.to_local(grad_placements=grads(name, t)))
                for name, t in self._tensors.items()}

    def placed(self, t: Tensor, placements=None, shape=None):
        """t, a local result, as the DTensor of the global `shape` (x's) placed as x is (or
        `placements`), contiguous: the ops' outputs are new tensors."""
        from torch.distributed.tensor import DTensor

        shape = self.x.shape if shape is None else torch.Size(shape)
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(_plain(t), self.mesh, self.x.placements if placements is None else placements,
                                  run_check=False, shape=shape, stride=stride)

    def global_index(self) -> Tensor:
        """The index in the global x (contiguous) of each element of this rank's local x:
        int64, of the local shape."""
        shape, offset = shard_offsets(self.x.shape, self.x.placements, self.mesh.shape, self.mesh.get_coordinate())
        device, ndim = self.x.device, self.x.ndim
        # a 0-d start: each term varies along one dim only, so the adds broadcast to the
        # local shape without a pass of their own (and a 0-d x, which the op refuses, gets one)
        index = torch.zeros((), dtype=torch.int64, device=device)
        for d, (n, o) in enumerate(zip(shape, offset, strict=True)):
            term = (torch.arange(n, dtype=torch.int64, device=device) + o) * math.prod(self.x.shape[d + 1:])
            index = index + term.view([n if i == d else 1 for i in range(ndim)])
        return index


def shard_offsets(shape, placements, mesh_shape, coordinate) -> tuple[list[int], list[int]]:
    """(local shape, global offset of the local block) of a tensor of the global `shape`
    placed `placements` on a mesh of `mesh_shape`, on the rank at `coordinate`: each Shard
    splits the tensor dim's current extent as torch.chunk does (chunks of ceil(n / k), the
    last ones shorter or empty), the mesh dims in order, so a second mesh dim on one tensor
    dim splits the first's chunk; Replicate leaves it. DTensor's own layout (its private
    compute_local_shape_and_global_offset, which the tests hold this to), in plain ints."""
    local, offset = list(shape), [0] * len(shape)
    for i, p in enumerate(placements):
        if p.is_shard():
            d = p.dim % len(shape)
            chunk = -(-local[d] // mesh_shape[i])
            start = min(coordinate[i] * chunk, local[d])
            offset[d] += start
            local[d] = min(local[d] - start, chunk)
    return local, offset


def _dropped(at: _Placed, x, residual, x1, loc: dict, options: dict) -> None:
    """add_norm's dropout on this rank's x and x1 (x1's indices after x's: its masks are
    others), in place of the op's own: loc's x and x1 become the kept elements scaled by
    1/(1 - p), in acc_dtype(x's) so the op still rounds new_residual once; options get
    dropout_p 0 and the residual_dtype the op would have stored new_residual in."""
    p = options["dropout_p"]
    check_tensor("x", x)  # the op would refuse an x of no floating dtype; its wide copy would pass
    check_branch(x, x1, options["alpha"], p)
    wide, scale = acc_dtype(x.dtype), 1.0 / (1.0 - p)
    # the kernels' key (draw_seed): one draw of the CPU generator, which advances alike on
    # every rank (DTensor expects every rank seeded alike), so the same key everywhere
    key = draw_seed(loc["x"]).to(loc["x"].device)
    index = at.global_index()
    loc["x"] = torch.where(hash_keep(key, index, p), loc["x"].to(wide) * scale, 0.0)
    if x1 is not None:
        loc["x1"] = torch.where(hash_keep(key, index + x.numel(), p), loc["x1"].to(wide) * scale, 0.0)
    options["residual_dtype"] = stored_dtype(x.dtype, None if residual is None else residual.dtype,
                                             options["residual_dtype"])
    options["dropout_p"] = 0.0


def add_norm(local_add_norm: Callable, x, residual, weight, bias, gate, x1=None, **options):
    """`local_add_norm(x, residual, weight, bias, gate=gate, **options)` (fuseblock's add_norm)
    on DTensor arguments: (out, new_residual) as DTensors placed as x is. x1 is placed as x;
    dropout is applied here (`_dropped`), its masks keyed by the global index (`hash_keep`)."""
    x, residual, weight, bias, gate, x1 = _implicitly_replicated(x, residual, weight, bias, gate, x1)
    at = _Placed(x, {"residual": residual, "gate": gate, "x1": x1}, {"weight": weight, "bias": bias})
    loc = at.unwrap()
    xl = loc["x"]
    if options["dropout_p"] != 0.0:
        _dropped(at, x, residual, x1, loc, options)
    if not at.hidden:
        if x1 is not None:
            options["x1"] = loc["x1"]
        out, new_res = local_add_norm(loc["x"], loc["residual"], loc["weight"], loc["bias"], gate=loc["gate"],
                                      **options)
    else:
        out, new_res = _hidden_add_norm(at, loc, x, residual, weight, bias, gate, x1, **options)
    # no residual and no dtype change: new_residual is x itself, as add_norm's; out in x's
    # dtype (or out_dtype) where dropout handed the op a wide x
    out_dtype = options.get("out_dtype") or x.dtype
    return at.placed(out.to(out_dtype)), (x if new_res is xl else at.placed(new_res))


def hyper(local_apply: Callable, streams, branch, post, comb, fn, base, scale, weight):
    """`local_apply(streams, branch, post, comb, fn, base, scale, weight)` (an hc op on
    validated arguments, the kernels or the torch path) on DTensors: (y, new_streams,
    post_next, comb_next), each placed as streams is (new_streams `streams` itself where
    the op returns its input; post_next, comb_next None where it does). Every per-token
    quantity of a boundary reads its own token's n streams alone, so streams by tokens
    (Shard on a lead dim, not on n or d) or replicated runs on each rank's tokens,
    unchanged; branch, post and comb placed as streams, fn, base, scale and weight
    replicated (their gradients Partial on the token-sharded mesh dims). Anything else is
    refused by name. (The torch path's ops on the DTensors themselves would flatten the token
    dims for their matmuls, which torch 2.11's DTensor refuses where a dim after the first
    is sharded: tokens by sequence.)"""
    from torch.distributed.tensor import DTensor, Replicate

    streams, branch, post, comb, fn, base, scale, weight = _implicitly_replicated(
        streams, branch, post, comb, fn, base, scale, weight)
    if not isinstance(streams, DTensor):
        raise TypeError(f"streams is a {type(streams).__name__}, but another argument is a DTensor: pass every "
                        f"tensor as a DTensor on one mesh, or call inside torch's implicit_replication()")
    lead = streams.ndim - 2
    for i, p in enumerate(streams.placements):
        if not (isinstance(p, Replicate) or (_is_shard(p) and p.dim % streams.ndim < lead)):
            raise ValueError(f"streams' placement {p!r} on mesh dim {i} is not supported: fuseblock's hc ops take "
                             f"streams (..., n, d) Replicate or Shard on a token dim (one of its first {lead}); "
                             f"redistribute it first (docs/parallel.md)")
    at = _Placed(streams, {"branch": branch, "post": post, "comb": comb},
                 {"fn": fn, "base": base, "scale": scale, "weight": weight})
    loc = at.unwrap()
    y, hn, post_n, comb_n = local_apply(loc["x"], loc["branch"], loc["post"], loc["comb"], loc["fn"], loc["base"],
                                        loc["scale"], loc["weight"])
    tokens, n = tuple(streams.shape[:-2]), streams.shape[-2]
    return (at.placed(y, shape=(*tokens, streams.shape[-1])), streams if hn is loc["x"] else at.placed(hn),
            None if post_n is None else at.placed(post_n, shape=(*tokens, n)),
            None if comb_n is None else at.placed(comb_n, shape=(*tokens, n, n)))


def _hidden_add_norm(at: _Placed, loc: dict, x, residual, weight, bias, gate, x1, *, kind, c, eps, residual_dtype,
                     gate_act, gate_position, num_groups, weight_offset, alpha=1.0, dropout_p=0.0, out_dtype=None):
    """add_norm on columns: new_residual by the torch path's own sum (reference.residual_sum,
    or branch_sum for alpha, x1), then the norm of its rows from all-reduced row sums
    (_HiddenNorm). dropout_p is 0 here: add_norm applied it (`_dropped`), loc's x and x1
    then wide, so the dtypes stored follow loc's x as the op's would."""
    if gate is not None or num_groups != 1:
        raise ValueError(f"a gate and num_groups > 1 are not supported with x sharded on its last dim (x's "
                         f"placements {tuple(x.placements)}): shard x by rows, or replicate it")
    # the global shapes: the spec's scale c/sqrt(d) and eps are the whole row's
    spec = resolve(x, residual, weight, bias, None, kind=kind, c=c, eps=eps, gate_act=gate_act,
                   gate_position=gate_position, num_groups=1, residual_dtype=residual_dtype,
                   weight_offset=weight_offset)
    from ..reference import norm as reference

    xl, rl, x1l = loc["x"], loc["residual"], loc["x1"]
    rin = None if residual is None else residual.dtype
    if x1 is not None or alpha != 1.0:
        check_branch(x, x1, alpha, dropout_p)
        spec = spec.with_branch(alpha, dropout_p)
        new_res = reference.branch_sum(xl, x1l, rl, stored_dtype(xl.dtype, rin, residual_dtype), spec)
    else:
        new_res = reference.residual_sum(xl, rl, new_residual_dtype(xl.dtype, rin, residual_dtype))
    p = xl if new_res is None else new_res  # differentiable: autograd routes dnew_residual
    out = _HiddenNorm.apply(p, loc["weight"], loc["bias"], spec, x.shape[-1], at.groups)  # fp32: stored once
    return out.to(out_dtype or x.dtype), (xl if new_res is None else new_res)


def norm_add(local_apply: Callable, x, residual, branch_weight, branch_bias, weight, bias, branch_spec, spec,
             alpha: float, residual_dtype, second: bool):
    """`local_apply` (fuseblock.ops.norm_add._apply, on validated arguments) on DTensors:
    (new_residual, out or None) placed as x is. On columns each norm is a _HiddenNorm (one
    all-reduce of its row sums each way), the sum as the torch path forms it."""
    x, residual, branch_weight, branch_bias, weight, bias = _implicitly_replicated(
        x, residual, branch_weight, branch_bias, weight, bias)
    at = _Placed(x, {"residual": residual}, {"branch_weight": branch_weight, "branch_bias": branch_bias,
                                              "weight": weight, "bias": bias})
    loc = at.unwrap()
    if not at.hidden:
        new_res, out = local_apply(loc["x"], loc["residual"], loc["branch_weight"], loc["branch_bias"],
                                   loc["weight"], loc["bias"], branch_spec, spec, alpha, residual_dtype, second)
    else:
        d = x.shape[-1]
        y = _HiddenNorm.apply(loc["x"], loc["branch_weight"], loc["branch_bias"], branch_spec, d, at.groups)
        if alpha != 1.0:
            y = y * alpha
        r = loc["residual"]
        wide = torch.promote_types(torch.promote_types(y.dtype, r.dtype), residual_dtype)
        new_res = (r.to(wide) + y.to(wide)).to(residual_dtype)  # rounded once, as reference.norm_add_fwd
        out = _HiddenNorm.apply(new_res, loc["weight"], loc["bias"], spec, d, at.groups).to(x.dtype) \
            if second else None
    return at.placed(new_res), (None if out is None else at.placed(out))


def norm_linear(local_norm_linear: Callable, add_norm: Callable, x, residual, norm_weight, norm_bias, weight, bias,
                **options):
    """`local_norm_linear` (fuseblock.norm_linear) on DTensors: (y, new_residual). x by rows
    or replicated on each mesh dim (not on its last dim: the Linear would need the whole row);
    the Linear's weight (and its bias, placed as it) on each mesh dim:
    - Replicate: y is placed as x there; the Linear's gradients Partial where x is by rows.
    - column-parallel, Shard(0) or a strided shard of dim 0 (q | k | v split by heads,
      `_StridedShard(0, sf)`): y sharded on its last dim the same way (Shard(-1),
      `_StridedShard(-1, sf)`): each rank's Linear is its rows of the weight, whatever their
      order. With x replicated there, the fused op runs on each rank: each rank's gradient
      at the norm's output is a part of the sum over the Linear's outputs, so those of x,
      residual and the norm's weight and bias are Partial there; new_residual's own
      gradient (replicated) enters that sum on the first rank alone.
    - column-parallel with x by rows there (sequence parallelism: a norm before a
      column-parallel Linear): the fused op on each rank's rows, its normalized rows
      all-gathered for this rank's Linear (`_GatheredRows`), and all-gathered again in
      backward for the weight's gradient rather than kept: only this rank's rows are.
    """
    from torch.distributed.tensor import Replicate

    x, residual, norm_weight, norm_bias, weight, bias = _implicitly_replicated(
        x, residual, norm_weight, norm_bias, weight, bias)
    at = _Placed(x, {"residual": residual}, {"norm_weight": norm_weight, "norm_bias": norm_bias},
                 {"weight": weight, "bias": bias})
    if at.hidden:
        raise ValueError(f"norm_linear is not supported with x sharded on its last dim (x's placements "
                         f"{tuple(x.placements)}): shard x by rows, or replicate it")
    y_placements, columns, gathered = [], [], []
    for i, p in enumerate(x.placements):
        wp = weight.placements[i]
        if wp == Replicate():
            y_placements.append(p)
        else:
            y_placements.append(_column_output(wp, i, x.ndim))
            (columns if p == Replicate() else gathered).append(i)
        if bias is not None and bias.placements[i] != wp:
            raise ValueError(f"bias's placement {bias.placements[i]!r} on mesh dim {i} differs from weight's {wp!r}: "
                             f"the Linear's bias must be placed as its weight")
    y_shape = (*x.shape[:-1], weight.shape[0])
    if gathered:
        loc = at.unwrap(gathered=tuple(gathered))
        rows = _GatheredRows(at, loc["x"].shape[:-1], gathered, columns)
        y, new_res = local_norm_linear(loc["x"], loc["residual"], loc["norm_weight"], loc["norm_bias"], loc["weight"],
                                       loc["bias"], rows=rows, **options)
        y = at.placed(y, y_placements, y_shape)
        return (y, x) if new_res is loc["x"] else (y, at.placed(new_res))
    loc = at.unwrap(tuple(columns))  # x replicated on every column-parallel mesh dim
    y, new_res = local_norm_linear(loc["x"], loc["residual"], loc["norm_weight"], loc["norm_bias"], loc["weight"],
                                   loc["bias"], **options)
    y = at.placed(y, y_placements, y_shape)
    if new_res is loc["x"]:  # no residual and no dtype change: new_residual is x itself, as norm_linear's
        return y, x
    coordinate = at.mesh.get_coordinate()
    if any(coordinate[i] != 0 for i in columns):
        new_res = _NoGrad.apply(new_res)
    return y, at.placed(new_res)


def _column_output(wp, i: int, ndim: int):
    """The placement of a Linear's output on mesh dim i, its weight placed `wp` there: Shard(0)
    or _StridedShard(0, sf) (column-parallel) give the output's last dim the same split;
    anything else (a row-parallel Shard(1), Partial) is refused by name."""
    from torch.distributed.tensor import Shard

    from .dtensor_constants import split_factor

    if _is_shard(wp) and wp.dim == 0:
        return Shard(ndim - 1)
    strided = _strided_shard()
    if strided is not None and isinstance(wp, strided) and wp.dim == 0:
        check_strided_split(f"norm_linear: weight's placement on mesh dim {i}", wp)
        return strided(ndim - 1, split_factor=split_factor(wp))
    raise ValueError(f"weight's placement {wp!r} on mesh dim {i} is not supported by norm_linear: the Linear's weight "
                     f"must be Replicate() or split by its rows (Shard(0), or _StridedShard(0): column-parallel)")


def check_strided_split(what: str, placement) -> None:
    """Refuse `placement`, a _StridedShard alone on its tensor dim (a column split in another
    order: q | k | v by heads), on a torch whose DTensor cannot move one: torch 2.12 is the
    first whose redistributions (full_tensor, an op's gradient) take it. In those of 2.11
    every _StridedShard is read as the order of nested shards, which raises on a split factor
    no mesh order gives (sf 3 on a 1-D mesh); 2.10 fails an assertion; 2.9 moves it as a
    plain Shard, silently out of order. One line, naming the torch needed."""
    strided = _strided_shard()
    if strided is None or not isinstance(placement, strided) or STRIDED_SPLIT_REDISTRIBUTES:
        return
    raise ValueError(f"{what} is {placement!r}, a strided column split, which needs torch >= 2.12: the DTensor "
                     f"of torch {torch.__version__} cannot redistribute a _StridedShard alone; use Shard(0)")


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


STRIDED_SPLIT_REDISTRIBUTES = _release(torch.__version__) >= (2, 12)  # check_strided_split


def _is_shard(p) -> bool:
    """Whether placement p is a Shard and no _StridedShard (a subclass of Shard up to torch
    2.9): by isinstance, which Dynamo traces on torch 2.12's placements where it cannot
    trace `type(p) is Shard`."""
    from torch.distributed.tensor import Shard

    strided = _strided_shard()
    return isinstance(p, Shard) and not (strided is not None and isinstance(p, strided))


def _strided_shard():
    """torch's _StridedShard (a private placement: the q | k | v rows split by heads), or None
    where this torch has none."""
    from torch.distributed.tensor import placement_types

    return getattr(placement_types, "_StridedShard", None)


class _GatheredRows:
    """norm_linear's Linear under sequence parallelism (its `rows`): `gather` all-gathers the
    normalized rows of every rank on the `gathered` mesh dims, in forward before the Linear
    and again in backward for the weight's gradient (the gathered rows are not kept: the
    activation norm_linear spares, T / tp times this rank's rows, as Megatron-LM's sequence
    parallelism regathers its Linear's input); `scatter` reduce-scatters the gradient at the
    gathered rows back to this rank's, and all-reduces it over the `columns` mesh dims (x
    replicated, the Linear split), where it is a part of the sum over the Linear's outputs.
    Functional collectives, as _HiddenNorm's: traceable. Each gathered dim must divide
    evenly: all-gather takes equal parts."""

    def __init__(self, at: _Placed, lead: torch.Size, gathered: list[int], columns: list[int]):
        x, mesh = at.x, at.mesh
        # nested shards of one dim: DTensor splits by the mesh dims in order, so the parts are
        # gathered last mesh dim first and scattered first mesh dim first
        self.steps = [(x.placements[i].dim, mesh.get_group(i)) for i in gathered]
        lead_all, self.factor = list(lead), 1
        for i in gathered:
            lead_all[x.placements[i].dim] *= mesh.size(i)
            self.factor *= mesh.size(i)
        for dim, n in enumerate(lead_all):
            if n != x.shape[dim]:
                raise ValueError(f"norm_linear sequence-parallel: x's dim {dim} ({x.shape[dim]}) must divide evenly "
                                 f"over its shards (x's placements {tuple(x.placements)})")
        self.columns = [(mesh, i) for i in columns]  # _all_reduce's groups
        self.lead, self.lead_all = tuple(lead), tuple(lead_all)

    def gathered(self, m: int) -> int:
        """The gathered row count of m local rows."""
        return m * self.factor

    def gather(self, t: Tensor) -> Tensor:
        """This rank's rows (x's local shape, or flattened to 2-D) -> every rank's, in that form."""
        import torch.distributed._functional_collectives as funcol

        d = t.shape[-1]
        g = t.reshape(*self.lead, d)
        for dim, group in reversed(self.steps):
            g = _waited(_funcol(funcol, "all_gather")(g, dim, group))
        return g.reshape(-1, d) if t.dim() == 2 else g

    def scatter(self, t: Tensor) -> Tensor:
        """The gradient at every rank's rows, flattened (rows, d) -> at this rank's, summed."""
        import torch.distributed._functional_collectives as funcol

        d = t.shape[-1]
        g = t.reshape(*self.lead_all, d)
        for dim, group in self.steps:
            g = _waited(_funcol(funcol, "reduce_scatter")(g, "sum", dim, group))
        return _all_reduce(g, self.columns).reshape(-1, d)


def _funcol(funcol, name: str) -> Callable:
    """funcol's `<name>_single` (torch 2.13 deprecates `<name>_tensor` for it; older torch,
    2.5 the floor, has only `<name>_tensor`, of the same arguments)."""
    return getattr(funcol, f"{name}_single", None) or getattr(funcol, f"{name}_tensor")


def _waited(t: Tensor) -> Tensor:
    """A functional collective's result, waited for (it may come as an AsyncCollectiveTensor)."""
    return t.wait() if _is_async(t) else t


class _NoGrad(torch.autograd.Function):
    """The identity, whose gradient is zero: a replicated gradient that enters a Partial sum
    on one rank only."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad)


def _plain(t: Tensor) -> Tensor:
    """t, and the gradient it is given, as plain tensors: a DTensor that an async collective
    made (a row-parallel Linear's reduce-scatter; in backward, a column-parallel Linear's
    all-gather) holds an AsyncCollectiveTensor, a subclass the kernels cannot read."""
    return _Plain.apply(t)


class _Plain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.wait() if _is_async(t) else t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.wait() if _is_async(grad) else grad


def _is_async(t) -> bool:
    import torch.distributed._functional_collectives as funcol

    return isinstance(t, funcol.AsyncCollectiveTensor)


def _all_reduce(t: Tensor, groups) -> Tensor:
    """The sum of t over the ranks of each (mesh, mesh dim) in groups (functional collectives:
    traceable, and counted by CommDebugMode)."""
    import torch.distributed._functional_collectives as funcol

    for mesh, dim in groups:
        t = _waited(funcol.all_reduce(t, "sum", mesh.get_group(dim)))
    return t


class _HiddenNorm(torch.autograd.Function):
    """out = scale * (p - mean) * rstd * (weight_offset + w) + b over rows split across ranks
    on their last dim: the statistics from all-reduced fp64 row sums (docs/math.md's
    formulas; the gradients of docs/math.md with the row means all-reduced too)."""

    @staticmethod
    def forward(ctx, p: Tensor, w: Tensor | None, b: Tensor | None, spec, d: int, groups):
        a = acc_dtype(p.dtype)
        p64 = p.to(torch.float64)  # a temporary: nothing of the forward is kept but p and the statistics
        sums = [p64.sum(-1)] if spec.center else []
        sums.append(p64.square().sum(-1))
        total = _all_reduce(torch.stack(sums, -1), groups)
        mean = total[..., 0] / d if spec.center else None
        var = total[..., -1] / d - (mean.square() if spec.center else 0.0)
        rstd = torch.rsqrt(var.clamp_min(0.0) + spec.eps).to(a)
        mean = None if mean is None else mean.to(a)
        pa = p.to(a)
        r = ((pa - mean[..., None]) if spec.center else pa) * rstd[..., None]
        out = _affine(r, w, b, spec, a)
        ctx.save_for_backward(p, w, rstd, mean)
        ctx.spec, ctx.d, ctx.groups, ctx.bias_dtype = spec, d, groups, None if b is None else b.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # a second derivative would need the collectives' own
    def backward(ctx, dout: Tensor):
        p, w, rstd, mean = ctx.saved_tensors
        spec, d = ctx.spec, ctx.d
        a = rstd.dtype
        g = dout.to(a)
        pa = p.to(a)
        r = ((pa - mean[..., None]) if spec.center else pa) * rstd[..., None]
        dr = g * spec.scale
        lead = tuple(range(r.dim() - 1))
        dw = (dr * r).sum(lead).to(w.dtype) if w is not None and ctx.needs_input_grad[1] else None
        db = g.sum(lead).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        if w is not None:
            dr = dr * (w.to(a) + spec.weight_offset)
        dots = [dr.sum(-1, dtype=torch.float64)] if spec.center else []
        dots.append((dr * r).sum(-1, dtype=torch.float64))
        total = _all_reduce(torch.stack(dots, -1), ctx.groups) / d
        dp = dr - r * total[..., -1:].to(a)
        if spec.center:
            dp = dp - total[..., :1].to(a)
        dp = (dp * rstd[..., None]).to(p.dtype)
        return dp, dw, db, None, None, None


def _affine(r: Tensor, w: Tensor | None, b: Tensor | None, spec, a: torch.dtype) -> Tensor:
    o = r * spec.scale if spec.scale != 1.0 else r
    if w is not None:
        o = o * (w.to(a) + spec.weight_offset)
    if b is not None:
        o = o + b.to(a)
    return o


def keeps_inputs(hook: Callable, with_kwargs: bool) -> Callable:
    """`hook`, a module's forward pre-hook, refused where it drops positional inputs of a call
    that has more than one: torch's SequenceParallel style keeps only the first, which on an
    AddNorm would normalize x alone, the residual silently lost. A hook with kwargs returns
    (args, kwargs) and is left as it is."""
    if with_kwargs:
        return hook

    def checked(module, args):
        out = hook(module, args)
        if out is not None and len(args) > 1 and len(out if isinstance(out, tuple) else (out,)) < len(args):
            raise ValueError(f"a forward pre-hook of {type(module).__name__} dropped its residual (torch's "
                             f"SequenceParallel keeps only the first input): use fuseblock.parallel.SequenceParallel")
        return out

    return checked

