"""`fuse_blocks`: an existing pre-norm model's blocks on the fused residual stream, in place.

A pre-norm block computes `x = x + branch(norm(x))` one or more times, `branch` a chain
of its child modules (timm's `drop_path1(ls1(attn(norm1(x))))`). Fused, each block
carries the pair (hidden, residual) of docs/stream.md: block k adds the previous
branch into the residual and normalizes it in one `add_norm` launch per sublayer, and
the final norm folds in the last add. What changes and what does not:

- Each block's `forward` becomes an instance attribute (its class, children, hooks and
  container stay); nothing else is replaced. The norms stay the modules they were and
  keep their Parameter objects: `norm_from` reads each one's kind, eps, bias and weight
  offset, and the fused call reads the module's weight and bias at each call. So
  state_dict keys, parameter identity and optimizer state are unchanged, and host code
  that iterates, indexes, crops, checkpoints (non-reentrant) or sets caches still runs.
- A block takes a tensor (the stream's start) or a `StreamPair`, and returns a
  `StreamPair`, or `hidden + residual` (a tensor) from the container's last block when
  there is no final norm. The final norm given as `final_norm` takes either, its forward
  an instance attribute too. A `StreamPair` refuses every other use by name.
- The sublayers are read from the block's own forward, traced with torch.fx (its child
  modules left opaque): norm(x), a chain of child calls on its output, and the add, in
  that order, each node used only there. Side inputs of the chain's first module (rotary
  tables, masks, cache positions) are the block's arguments, constants or its
  attributes, passed as the block passed them. `sublayers=` names them instead (for a
  forward fx cannot trace): then the first module of a chain gets the block's side inputs
  that its forward's signature can take.
- Before anything changes every block (and the final norm with the last) is run both ways
  on a probe input, in eval mode: the output and the gradients of the input and every
  parameter must agree to rounding, else nothing is changed and the ValueError names
  the block and the difference.
"""
from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .convert import norm_from
from .ops.norm import add_norm

# the probe's agreement, |fused - original| <= tol * max(1, max|original|), by dtype: rounding only
_PROBE_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


class StreamPair:
    """The fused stream between two fused blocks: `hidden` (the last branch's output, not
    yet added) and `residual` (the stream before it); the stream itself is their sum.
    Only a fused block or the fused final norm takes one: any other use is an error that
    says so, never a silent read of one half."""

    __slots__ = ("hidden", "residual")

    def __init__(self, hidden: Tensor, residual: Tensor):
        self.hidden, self.residual = hidden, residual

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"a StreamPair (the fused stream between fuse_blocks' blocks) has no {name!r}: only a "
                             f"fused block or the final norm given to fuse_blocks takes it; pass final_norm= (or use "
                             f"pair.hidden + pair.residual)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{getattr(func, '__name__', func)} got a StreamPair (the fused stream between "
                        f"fuse_blocks' blocks): only a fused block or the final norm given to fuse_blocks takes it")

    def __repr__(self) -> str:
        return f"StreamPair(hidden={tuple(self.hidden.shape)}, residual={tuple(self.residual.shape)})"


# ---------------------------------------------------------------- the plan of a block
@dataclass(frozen=True)
class Sublayer:
    """One `x = x + chain(norm(x))`: the child names, how the chain's first module is
    called (each side input ("arg", name) of the block's forward, ("const", value) or
    ("attr", dotted name) of the block), and the norm's settings read by norm_from."""

    norm: str
    chain: tuple[str, ...]
    args: tuple[tuple[str, object], ...]
    kwargs: tuple[tuple[str, tuple[str, object]], ...]
    kind: str
    eps: float | None
    weight_offset: float


@dataclass(frozen=True)
class BlockPlan:
    signature: inspect.Signature
    sublayers: tuple[Sublayer, ...]
    last: bool  # the container's last block with no final norm: return the stream as a tensor

    @property
    def side_inputs(self) -> bool:
        return any(a[0] == "arg" for s in self.sublayers for a in (*s.args, *(v for _, v in s.kwargs)))


class Refused(Exception):
    """Why a block is not `x = x + chain(norm(x))` repeated (fuse_blocks' message)."""


def _norm_settings(module: nn.Module, what: str) -> tuple[str, float | None, float]:
    if module._forward_hooks or module._forward_pre_hooks:
        raise Refused(f"{what} has forward hooks, which the fused call (add_norm on its parameters) would skip")
    try:
        norm = norm_from(module)
    except TypeError as e:
        raise Refused(f"{what} is not a norm fuseblock computes ({str(e).removeprefix('norm_from: ')})") from None
    return norm.kind, norm.eps, norm.weight_offset


class _Leaves(torch.fx.Tracer):
    """Traces a block's own forward with every child module one opaque call."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True


def _describe(node: torch.fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {target}"


def _traced_sublayers(block: nn.Module) -> list[Sublayer]:
    try:
        graph = _Leaves().trace(block)
    except Exception as e:  # fx raises many kinds (TraceError, TypeError on a Proxy in control flow, ...)
        raise Refused(f"its forward cannot be traced by torch.fx ({type(e).__name__}: {str(e).splitlines()[0]}); "
                      f"name its sublayers with sublayers=") from None
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if not placeholders:
        raise Refused("its forward takes no input")
    names = {n: n.target.lstrip("*") for n in placeholders}
    body = [n for n in nodes if n.op not in ("placeholder", "output", "get_attr")]
    output = next(n for n in nodes if n.op == "output")

    def side(value, where: str):
        if isinstance(value, torch.fx.Node):
            if value.op == "placeholder" and value is not placeholders[0]:
                return ("arg", names[value])
            if value.op == "get_attr":
                return ("attr", value.target)
            raise Refused(f"{where} takes {_describe(value)}, which is neither an argument of the block nor an "
                          f"attribute of it")
        if isinstance(value, (tuple, list, dict, slice)):
            raise Refused(f"{where} takes a {type(value).__name__} side input, which fuse_blocks does not pass")
        return ("const", value)

    stream, i, subs = placeholders[0], 0, []
    while i < len(body):
        norm = body[i]
        if norm.op != "call_module" or norm.args != (stream,) or norm.kwargs:
            raise Refused(f"it computes {_describe(norm)} where a norm of the stream was expected (the pattern is "
                          f"x = x + branch(norm(x)), repeated)")
        kind, eps, offset = _norm_settings(block.get_submodule(norm.target), f"its {norm.target!r}")
        chain, prev, i = [], norm, i + 1
        while i < len(body) and body[i].op == "call_module" and body[i].args and body[i].args[0] is prev:
            call = body[i]
            if chain and (len(call.args) > 1 or call.kwargs):
                raise Refused(f"{call.target!r} takes side inputs after the first module of the branch")
            if len(prev.users) != 1:
                raise Refused(f"the output of {prev.target!r} is used by {len(prev.users)} nodes, not only the "
                              f"branch's next step")
            chain.append(call)
            prev, i = call, i + 1
        if not chain:
            raise Refused(f"the output of its {norm.target!r} goes to no module (the branch must be a chain of "
                          f"child modules)")
        add = body[i] if i < len(body) else None
        if (add is None or add.op != "call_function" or add.target not in (operator.add, torch.add) or add.kwargs
                or set(add.args) != {stream, prev} or len(add.args) != 2):
            what = "nothing" if add is None else _describe(add)
            raise Refused(f"after the branch {' -> '.join(c.target for c in chain)} it computes {what}, not the "
                          f"residual add x + branch")
        if len(prev.users) != 1 or len(stream.users) != 2:
            raise Refused(f"the stream or the output of {prev.target!r} is used beyond x + branch(norm(x))")
        first = chain[0]
        where = f"{first.target!r}"
        args = tuple(side(a, where) for a in first.args[1:])
        kwargs = tuple((k, side(v, where)) for k, v in first.kwargs.items())
        subs.append(Sublayer(norm.target, tuple(c.target for c in chain), args, kwargs, kind, eps, offset))
        stream, i = add, i + 1
    if output.args[0] is not stream:
        raise Refused("it does not return the stream after its last residual add")
    if not subs:
        raise Refused("it has no x = x + branch(norm(x))")
    return subs


def _named_sublayers(block: nn.Module, sublayers) -> list[Sublayer]:
    """The sublayers named by the caller: each (norm, branch, ...) of child names. The
    first branch module gets the block's side inputs its forward's signature takes."""
    try:
        params = list(inspect.signature(block.forward).parameters.values())
    except (TypeError, ValueError):
        raise Refused("its forward has no signature to read") from None
    side_names = [p.name for p in params[1:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kw_names = [p.name for p in params[1:] if p.kind is p.KEYWORD_ONLY]
    subs = []
    for names in sublayers:
        norm_name, *chain = names
        for name in names:
            if not isinstance(getattr(block, name, None), nn.Module):
                raise Refused(f"it has no child module {name!r} (sublayers names (norm, branch, ...) attributes)")
        kind, eps, offset = _norm_settings(getattr(block, norm_name), f"its {norm_name!r}")
        try:
            first = [p for p in inspect.signature(getattr(block, chain[0]).forward).parameters.values()]
        except (TypeError, ValueError):
            first = []
        var_pos = any(p.kind is p.VAR_POSITIONAL for p in first)
        n_pos = len([p for p in first if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) - 1
        var_kw = any(p.kind is p.VAR_KEYWORD for p in first)
        takes = {p.name for p in first}
        args = tuple(("arg", n) for n in (side_names if var_pos else side_names[:max(n_pos, 0)]))
        kwargs = tuple((n, ("arg", n)) for n in kw_names if var_kw or n in takes)
        subs.append(Sublayer(norm_name, tuple(chain), args, kwargs, kind, eps, offset))
    return subs


def fused_forward(block: nn.Module, plan: BlockPlan, x, *args, **kwargs):
    """A block's fused forward (fuse_blocks installs it as `block.forward`): each sublayer
    one add_norm on the norm module's own parameters, then its chain."""
    if isinstance(x, StreamPair):
        h, r = x.hidden, x.residual
        if not torch.is_grad_enabled() and (h.requires_grad or r.requires_grad):
            # a reentrant checkpoint runs its function under no_grad, and sees no tensor in a StreamPair
            raise RuntimeError("a fused block got a StreamPair that requires grad with grad disabled (a reentrant "
                               "torch.utils.checkpoint?): checkpoint with use_reentrant=False")
    else:
        h, r = x, None
    values = None
    if plan.side_inputs:
        bound = plan.signature.bind(x, *args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments

    def get(spec):
        how, what = spec
        if how == "arg":
            return values[what]
        return functools.reduce(getattr, what.split("."), block) if how == "attr" else what

    for sub in plan.sublayers:
        norm = getattr(block, sub.norm)
        normed, r = add_norm(h, r, getattr(norm, "weight", None), getattr(norm, "bias", None), kind=sub.kind,
                             eps=sub.eps, weight_offset=sub.weight_offset)
        first, *rest = (getattr(block, name) for name in sub.chain)
        h = first(normed, *(get(a) for a in sub.args), **{k: get(v) for k, v in sub.kwargs})
        for module in rest:
            h = module(h)
    return r + h if plan.last else StreamPair(h, r)


def final_forward(module: nn.Module, settings: tuple[str, float | None, float], x, *args, **kwargs):
    """The final norm's forward (fuse_blocks installs it): a StreamPair's last add and the
    norm in one add_norm; a tensor goes to the module's own forward, as before."""
    if not isinstance(x, StreamPair):
        return type(module).forward(module, x, *args, **kwargs)
    kind, eps, offset = settings
    return add_norm(x.hidden, x.residual, getattr(module, "weight", None), getattr(module, "bias", None), kind=kind,
                    eps=eps, weight_offset=offset)[0]


# ---------------------------------------------------------------- the probe
def _probe_inputs(block: nn.Module, sub: Sublayer, example, example_kwargs) -> tuple[tuple, dict]:
    if example is not None:
        return (tuple(example) if isinstance(example, (tuple, list)) else (example,)), dict(example_kwargs or {})
    norm = getattr(block, sub.norm)
    ref = next((t for t in (getattr(norm, "weight", None), getattr(norm, "bias", None)) if t is not None), None)
    ref = ref if ref is not None else next(block.parameters(), None)
    d = norm_from(norm).dim
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, d, generator=gen)
    if ref is not None:
        x = x.to(ref.device, ref.dtype)
    return (x,), dict(example_kwargs or {})


def _run(fn, block: nn.Module, args, kwargs, seed: int):
    """Output and gradients (of the input when it is a float tensor, and of every
    parameter that takes one) of fn(*args, **kwargs), with .grad untouched."""
    x = args[0]
    leaf = x.detach().requires_grad_(x.is_floating_point())
    params = [p for p in block.parameters() if p.requires_grad]
    with torch.enable_grad():
        out = fn(leaf, *args[1:], **kwargs)
        if not isinstance(out, Tensor):
            raise Refused(f"its forward returned {type(out).__name__} on the probe, not a tensor")
        wrt = ([leaf] if leaf.requires_grad else []) + params
        if not out.requires_grad or not wrt:
            return out.detach(), []
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
        grads = torch.autograd.grad(out, wrt, g, allow_unused=True)
    names = (["input"] if leaf.requires_grad else []) + [n for n, p in block.named_parameters() if p.requires_grad]
    return out.detach(), list(zip(names, grads, strict=True))


def _difference(want, got) -> str | None:
    (out0, grads0), (out1, grads1) = want, got
    pairs = [("output", out0, out1)] + [(f"d_{n}", a, b) for (n, a), (_, b) in zip(grads0, grads1, strict=True)]
    for what, a, b in pairs:
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        if a.shape != b.shape:
            return f"{what} has shape {tuple(b.shape)} fused, {tuple(a.shape)} unfused"
        tol = _PROBE_TOL.get(a.dtype, 1e-5) * max(1.0, a.double().abs().max().item())
        diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        if not diff <= tol:
            return f"{what} differs by {diff:.3g} (more than rounding, {tol:.3g})"
    return None


def _probe(block: nn.Module, plan: BlockPlan, final: nn.Module | None, settings, example, example_kwargs) -> None:
    args, kwargs = _probe_inputs(block, plan.sublayers[0], example, example_kwargs)
    modes = [(m, m.training) for m in (block, *(() if final is None else (final,))) for m in m.modules()]
    for m, _ in modes:
        m.training = False
    try:
        def original(*a, **k):
            out = block(*a, **k)
            return out if final is None else final(out)

        def fused(*a, **k):
            out = fused_forward(block, plan, *a, **k)  # the stream's start: a tensor in, as from the embeddings
            if final is not None:
                return final_forward(final, settings, out)
            return out.residual + out.hidden if isinstance(out, StreamPair) else out
        try:
            want = _run(original, block, args, kwargs, 1)
        except Refused:
            raise
        except Exception as e:
            raise Refused(f"its forward failed on the probe input ({type(e).__name__}: {str(e).splitlines()[0]}); "
                          f"pass example= (the block's positional inputs) and example_kwargs=") from None
        try:
            got = _run(fused, block, args, kwargs, 1)
        except Exception as e:
            raise Refused(f"fused, it failed on the probe input ({type(e).__name__}: {str(e).splitlines()[0]})") \
                from None
    finally:
        for m, mode in modes:
            m.training = mode
    diff = _difference(want, got)
    if diff:
        raise Refused(f"fused it differs from its own forward on the probe: {diff}")


# ---------------------------------------------------------------- the entry point
def _blocks_of(blocks) -> list[nn.Module]:
    if isinstance(blocks, nn.ModuleDict):
        blocks = list(blocks.values())
    elif isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise TypeError(f"blocks must be a container of blocks (nn.ModuleList, nn.Sequential, nn.ModuleDict or a "
                        f"list of modules), got {type(blocks).__name__}")
    elif isinstance(blocks, Mapping):
        blocks = list(blocks.values())
    elif isinstance(blocks, Iterable) and not isinstance(blocks, (str, bytes, Tensor)):
        blocks = list(blocks)
    else:
        raise TypeError(f"blocks must be a container of blocks, got {type(blocks).__name__}")
    if not blocks:
        raise ValueError("blocks is empty: fuse_blocks needs at least one block")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"blocks[{i}] must be an nn.Module, got {type(b).__name__}")
    return blocks


def _check_sublayers(sublayers) -> list[tuple[str, ...]] | None:
    if sublayers is None:
        return None
    if isinstance(sublayers, (str, bytes)) or not isinstance(sublayers, Iterable):
        raise TypeError(f"sublayers must be a list of (norm, branch, ...) child names, got {type(sublayers).__name__}")
    out = []
    for entry in sublayers:
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        if len(names) < 2 or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"each entry of sublayers is (norm, branch, ...): at least two child names, got {entry!r}")
        out.append(names)
    if not out:
        raise ValueError("sublayers is empty: name at least one (norm, branch, ...)")
    return out


def fuse_blocks(blocks, final_norm: nn.Module | None = None, sublayers=None, *, example=None,
                example_kwargs: dict | None = None) -> list[tuple[tuple[str, ...], ...]]:
    """Put an existing pre-norm model's blocks on the fused residual stream, in place.

    blocks: the container the model iterates (nn.ModuleList, nn.Sequential, nn.ModuleDict,
    a list), each block computing `x = x + branch(norm(x))` one or more times. final_norm:
    the norm the model applies to the last block's output (it then folds in the last
    add); None when the stream leaves the blocks unnormed. sublayers: the (norm, branch,
    ...) child names of each sublayer, the same for every block; None to read them from
    each block's forward (torch.fx). example / example_kwargs: one block's inputs for the
    probe (the positional ones, x first; needed where a block takes side inputs such as
    rotary tables); by default x = randn(2, 4, d) alone.

    Returns each block's sublayers as child names. A block that is not that pattern,
    or whose fused form differs from its own forward on the probe, is a ValueError naming
    it and why, and then nothing is changed (module docstring).
    """
    blocks = _blocks_of(blocks)
    sublayers = _check_sublayers(sublayers)
    if final_norm is not None and not isinstance(final_norm, nn.Module):
        raise TypeError(f"final_norm must be an nn.Module (the model's final norm) or None, got "
                        f"{type(final_norm).__name__}")
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise TypeError(f"example_kwargs must be a dict of keyword inputs, got {type(example_kwargs).__name__}")
    settings = None
    if final_norm is not None:
        if "forward" in final_norm.__dict__:
            raise ValueError(f"final_norm ({type(final_norm).__name__}) has an instance-level forward (fused "
                             f"already?)")
        try:
            settings = _norm_settings(final_norm, "final_norm")
        except Refused as e:
            raise ValueError(f"fuse_blocks: {e}") from None
    plans, refused = [], []
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        try:
            if "forward" in block.__dict__:
                raise Refused("it has an instance-level forward (fused already?)")
            subs = _traced_sublayers(block) if sublayers is None else _named_sublayers(block, sublayers)
            signature = inspect.signature(type(block).forward.__get__(block))
            plan = BlockPlan(signature, tuple(subs), last and final_norm is None)
            _probe(block, plan, final_norm if last else None, settings, example, example_kwargs)
            plans.append(plan)
        except Refused as e:
            refused.append(f"block {i} ({type(block).__name__}): {e}")
    if refused:
        raise ValueError("fuse_blocks changed nothing: " + "; ".join(refused))
    for block, plan in zip(blocks, plans, strict=True):
        block.forward = functools.partial(fused_forward, block, plan)
    if final_norm is not None:
        final_norm.forward = functools.partial(final_forward, final_norm, settings)
    return [tuple((s.norm, *s.chain) for s in plan.sublayers) for plan in plans]


def unfuse_blocks(blocks, final_norm: nn.Module | None = None) -> None:
    """Undo fuse_blocks: each block's and the final norm's own forward back."""
    for block in _blocks_of(blocks):
        if getattr(block.__dict__.get("forward"), "func", None) is fused_forward:
            del block.forward
    if final_norm is not None and getattr(final_norm.__dict__.get("forward"), "func", None) is final_forward:
        del final_norm.forward

