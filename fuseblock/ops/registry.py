"""One registration for a fused op's forward and backward: `torch.library` ops that
torch.compile(fullgraph=True) traces, forward and backward, the autograd formula tying
them together, and an eager autograd.Function over the same implementations, which skips
the dispatcher's per-call cost (~0.15 ms, more than a kernel on small inputs). `norm`,
`embed_norm` and the channel norms (`fuseblock.ops.channel_norm`) are registered here.

Where torch has `torch.library.triton_op` (2.6 and later) the ops are triton_ops: while
torch.compile traces one, its launcher runs once on fake tensors and each kernel launch
in it is recorded as a Triton kernel node (`fuseblock.kernels.launch.traced`), which
Inductor compiles and launches itself; the launcher's Python (specs, layouts, grids) is
then gone from the compiled step. Else (torch 2.5, and under TRITON_INTERPRET=1, whose
kernels `wrap_triton` cannot record) they are opaque custom ops with fake
implementations, which the compiled code calls, launcher and all.

The ops are registered on first need, not at import: `torch.library.triton_op` imports
torch._dynamo (about 2 s, as much as `import torch`), which an eager call never needs.
The first read of a `FusedOp`'s `fwd_op` or `bwd_op`, or of its name in `torch.ops.fuseblock`
(`LazyNamespace`: Dynamo reads a namespace's attributes for real while it traces, so a
compiled model's first call registers the ops it reaches; so do a saved graph's lookups and
`torch.library.opcheck`), registers that op's forward, backward and autograd formula, once.
"""
from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable

import torch

from ..triton_support import TRACING
from .dispatch import INTERPRET

# Whether FusedOp registers triton_ops (else custom ops): fixed per process
TRITON_OPS = hasattr(torch.library, "triton_op") and not INTERPRET


def _traced_body(impl: Callable) -> Callable:
    """impl as a triton_op's body: the launcher with `TRACING` on, so that each launch
    goes through `wrap_triton` (a kernel node while tracing; a plain launch when torch
    runs the body on real tensors). Its signature is impl's, annotations evaluated
    (the schema is inferred from it)."""

    @functools.wraps(impl)
    def body(*args, **kwargs):
        before, TRACING.on = TRACING.on, True
        try:
            return impl(*args, **kwargs)
        finally:
            TRACING.on = before

    body.__signature__ = inspect.signature(impl, eval_str=True)
    return body


def register(name: str, impl: Callable, fake: Callable):
    """`fuseblock::name` as a triton_op (`TRITON_OPS`) or a custom op with `fake`."""
    if TRITON_OPS:
        return torch.library.triton_op(f"fuseblock::{name}", _traced_body(impl), mutates_args=())
    op = torch.library.custom_op(f"fuseblock::{name}", impl, mutates_args=())
    op.register_fake(fake)
    return op


_LOCK = threading.RLock()  # held while a FusedOp registers (re-entered by torch's own lookups during it)
_UNREGISTERED: dict[str, FusedOp] = {}  # the FusedOps not yet registered, by each of their op names


class LazyNamespace(type(torch.ops.aten)):
    """`torch.ops.fuseblock`: a name of a FusedOp not yet registered registers it first, then
    torch's lookup (which caches the op on the namespace: later reads are attribute reads)."""

    # torch's: the ops take their `__module__` from their namespace's class, by which a pickler
    # (Inductor's graph cache) finds them again
    __module__ = type(torch.ops.aten).__module__

    def __getattr__(self, name: str):
        op = _UNREGISTERED.get(name)
        if op is not None:
            op.registered()
        return super().__getattr__(name)


torch.ops.fuseblock.__class__ = LazyNamespace  # torch's namespace object itself (a module: its class can change)

# torch's C `Function.apply` and its unwrapping of a dead functorch wrapper: what
# `torch.autograd.Function.apply` runs outside a torch.func transform, after a setup_context
# check (the Functions here define none) and a generator over every argument (~20 Python
# calls an op). `FusedOp.eager` runs these two directly; torch's own apply stays the way
# where either is missing.
_C_APPLY = vars(torch._C._FunctionBase).get("apply")
_unwrap_if_dead = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)


def placeholder(x: torch.Tensor) -> torch.Tensor:
    """An empty fp32 tensor on x's device: what a custom op returns for an absent output
    (it cannot return None)."""
    return x.new_empty(0, dtype=torch.float32)


def placeholders(x: torch.Tensor, outputs) -> tuple[torch.Tensor, ...]:
    """outputs with a `placeholder` for each None."""
    return tuple(t if t is not None else placeholder(x) for t in outputs)


class FusedOp:
    """A forward `fwd(*tensors, *options) -> outputs` and backward `bwd(...) -> grads`.

    - `setup(ctx, inputs, output)` (torch's names) saves what `grads` needs; in eager mode
      it may return indices of outputs that carry no gradient for these inputs (added to
      `stats`), such as a sum of inputs none of which requires a gradient;
    - `grads(ctx, grad_outputs, bwd)` returns the gradients of the leading tensor
      inputs, calling `bwd` (the custom op when compiled, the plain function in eager);
      the trailing options get None, counted from `fwd`'s signature;
    - `stats`: indices of outputs that carry no gradient (row statistics);
    - `graph_grads(ctx, grad_outputs)`, if given, serves create_graph=True in eager mode
      with differentiable ops, so a second derivative is right;
    - `eager_fwd(*inputs, **extra)`, if given, is the eager forward when a call passes
      keywords `extra`: side effects the custom op cannot declare (torch.library gives no
      autograd formula to an op that mutates its arguments), such as batch norm updating
      its running buffers in the forward's own launch. Compiled code passes none.
    - `launch_fwd`, `launch_bwd`, if given, are `fwd` and `bwd` with None for an absent
      output, where those return an empty placeholder (`placeholders`: a custom op cannot
      return None): the eager Function calls these, and allocates no placeholders, a
      tensor each on every call. `setup` and `grads` take either.


    `fwd_op` and `bwd_op` are the registered ops, triton_ops or custom ops (`register`), registered
    on their first read (`registered`, the module's docstring):
    `torch.ops.fuseblock.<name>_fwd` and `_bwd`, the overloads Dynamo's graph holds: code that calls the launchers under
    torch.compile, and tests that look for the ops in a graph, take them from here
    rather than naming them by string. `setup`, `grads`, `bwd` and `graph_grads` are the
    pieces given here, for a node that shares this op's backward.
    """

    def __init__(self, name: str, fwd: Callable, fwd_fake: Callable, bwd: Callable, bwd_fake: Callable,
                 setup: Callable, grads: Callable, stats: tuple[int, ...] = (),
                 graph_grads: Callable | None = None, eager_fwd: Callable | None = None,
                 launch_fwd: Callable | None = None, launch_bwd: Callable | None = None):
        n_inputs = len(inspect.signature(fwd).parameters)

        def pad(found: tuple) -> tuple:
            return found + (None,) * (n_inputs - len(found))

        def register_ops() -> tuple:
            register(f"{name}_fwd", fwd, fwd_fake)
            register(f"{name}_bwd", bwd, bwd_fake)
            # the overloads the CustomOpDefs call, and which a traced graph holds
            fwd_op = getattr(torch.ops.fuseblock, f"{name}_fwd").default
            bwd_op = getattr(torch.ops.fuseblock, f"{name}_bwd").default

            def op_backward(ctx, *grad_outputs):
                return pad(grads(ctx, grad_outputs, bwd_op))

            torch.library.register_autograd(f"fuseblock::{name}_fwd", op_backward, setup_context=setup)
            return fwd_op, bwd_op

        self._register_ops, self._ops, self._registering = register_ops, None, False
        self._names = (f"{name}_fwd", f"{name}_bwd")
        _UNREGISTERED[f"{name}_fwd"] = _UNREGISTERED[f"{name}_bwd"] = self

        eager_bwd = launch_bwd or bwd
        plain_fwd = launch_fwd or fwd

        class Eager(torch.autograd.Function):
            @staticmethod
            def forward(ctx, extra, *inputs):
                outputs = eager_fwd(*inputs, **extra) if extra else plain_fwd(*inputs)
                constant = setup(ctx, inputs, outputs)
                marked = ()  # a loop, not a list comprehension (a call of its own, on every forward)
                for i in (*stats, *constant) if constant else stats:
                    if outputs[i] is not None:
                        marked += (outputs[i],)
                ctx.mark_non_differentiable(*marked)
                # no zero-filled gradients (a memset launch each): set_materialize_grads(False)'s
                # one assignment, without its call on every forward
                ctx.materialize_grads = False
                return outputs

            @staticmethod
            def backward(ctx, *grad_outputs):
                if graph_grads is not None and torch.is_grad_enabled():  # create_graph=True
                    return (None, *pad(graph_grads(ctx, grad_outputs)))
                found = grads(ctx, grad_outputs, eager_bwd)
                return (None, *found, *_NONES[n_inputs - len(found)])  # None: for `extra`; pad's, written out

        Eager.__name__ = Eager.__qualname__ = f"Eager_{name}"
        # eager(None, *inputs): `__call__` with no `extra`, for a caller that has checked it
        # is neither compiling nor under a torch.func transform (where torch's Python apply
        # takes the transform's way), and has passed each tensor through `live`: torch's C
        # apply, one call. (None: the Function's `extra`.)
        self.eager = Eager.apply if _C_APPLY is None else _C_APPLY.__get__(None, Eager)
        # the eager pieces, for an autograd node over the same backward with another
        # forward (a quantized output: `fuseblock.ops.fp8`)
        self.setup, self.grads, self.bwd, self.graph_grads = setup, grads, eager_bwd, graph_grads
        self._eager, self._eager_fwd = Eager, eager_fwd

    def registered(self) -> tuple | None:
        """(fwd_op, bwd_op), registering them on the first call (once, under a lock); None to
        a lookup made by their registration itself (`LazyNamespace`)."""
        if self._ops is None:
            with _LOCK:
                if self._ops is None and not self._registering:
                    self._registering = True
                    try:
                        self._ops = self._register_ops()
                    finally:
                        self._registering = False
                    for name in self._names:
                        _UNREGISTERED.pop(name, None)
        return self._ops

    # Read through the namespace, whose lookup registers (`LazyNamespace`): while Dynamo traces
    # `__call__` it runs that lookup for real, where it could not trace `registered`'s lock.
    @property
    def fwd_op(self):
        return getattr(torch.ops.fuseblock, self._names[0]).default

    @property
    def bwd_op(self):
        return getattr(torch.ops.fuseblock, self._names[1]).default

    def __call__(self, *inputs, **extra):
        """Run the op: the custom op while torch.compile traces, else the eager Function
        (with `extra` for `eager_fwd`: never while compiling)."""
        if torch.compiler.is_compiling():
            if extra:
                raise RuntimeError(f"fuseblock::{self._names[0]}: eager-only arguments {sorted(extra)} while compiling")
            return self.fwd_op(*inputs)
        if extra and self._eager_fwd is None:
            raise TypeError(f"fuseblock::{self._names[0]} takes no eager-only arguments, got {sorted(extra)}")
        return self._eager.apply(extra, *inputs)


_NONES = tuple((None,) * n for n in range(64))  # the Nones that pad a gradient tuple, by count


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


# t, or the tensor inside it if t is a dead functorch wrapper (one that outlived its
# transform): what torch's Function.apply does to each tensor argument, and `FusedOp.eager`
# leaves to its caller, who knows which arguments are tensors. torch's own function, called
# directly: one builtin call a tensor.
live = _same if _unwrap_if_dead is None else _unwrap_if_dead
