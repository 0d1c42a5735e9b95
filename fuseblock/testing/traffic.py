"""Count the bytes a computation moves, without a GPU.

- `KernelTraffic`: under TRITON_INTERPRET=1, records every masked load and store (and
  atomic) the interpreter performs and reports, per kernel launch and per tensor
  argument, the distinct bytes read and the distinct bytes written (a byte read twice
  counts once: on a GPU the second read is a cache hit at best, and never less than one
  HBM read; a byte read after the launch wrote it is not a read at all, as it is in
  that cache already). `accessed` also counts every access, repeats included: the traffic with no
  cache at all, an upper bound where a launch's working set outgrows the L2.
  With `glue=True` it also charges the torch ops run between launches (e.g. the sum of
  the dw partial rows), as `EagerTraffic` would.
- `EagerTraffic`: a TorchDispatchMode charging each aten op its distinct tensor inputs
  read and its outputs written (views and allocations are free): the traffic of an
  unfused eager composition. `charge` and `uncounted` model a computation as one kernel
  (e.g. torch's rms_norm, one kernel on CUDA but a composite of ops on the CPU).
"""
from __future__ import annotations

import contextlib
import inspect
import math
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

COMPACT_AT = 1 << 23  # recorded addresses per launch before deduplicating (bounds memory)


@dataclass
class LaunchTraffic:
    kernel: str
    read: dict[str, int] = field(default_factory=dict)  # distinct bytes per tensor argument
    written: dict[str, int] = field(default_factory=dict)
    accessed: dict[str, int] = field(default_factory=dict)  # bytes loaded + stored, repeats counted

    @property
    def bytes(self) -> int:
        return sum(self.read.values()) + sum(self.written.values())


def _tally(tally: dict, spans: dict[str, tuple[int, int]], addrs: np.ndarray, size: int) -> None:
    """Add the bytes of one access to the span (tensor argument) each address falls in."""
    if addrs.size == 0:
        return
    lo, hi = int(addrs.min()), int(addrs.max())
    for name, (a, b) in spans.items():  # the usual case: one argument holds the whole access
        if a <= lo and hi < b:
            tally[name] = tally.get(name, 0) + addrs.size * size
            return
    rest = addrs.size
    for name, (a, b) in spans.items():
        n = int(np.count_nonzero((addrs >= a) & (addrs < b)))
        if n:
            tally[name] = tally.get(name, 0) + n * size
            rest -= n
    if rest:
        tally["?"] = tally.get("?", 0) + rest * size


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte address a tensor view can touch."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _first(addrs: np.ndarray, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct addresses, each with the sequence number of its first access."""
    order = np.lexsort((seqs, addrs))  # by address, then by sequence
    addrs, seqs = addrs[order], seqs[order]
    keep = np.concatenate(([True], addrs[1:] != addrs[:-1])) if addrs.size else np.zeros(0, bool)
    return addrs[keep], seqs[keep]


class _Accesses:
    """Element addresses seen in one launch, per element size, with the sequence number
    of the access that first touched each; deduplicated lazily."""

    def __init__(self):
        self.chunks: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self.pending = 0  # addresses held
        self.kept = 0  # distinct addresses after the last compaction

    def add(self, addrs: np.ndarray, size: int, seq: int) -> None:
        self.chunks.setdefault(size, []).append((addrs, np.full(addrs.size, seq, dtype=np.int64)))
        self.pending += addrs.size
        # Compact when the held addresses double: a fixed threshold below the distinct
        # count would re-sort everything on every access (quadratic on wide launches).
        if self.pending > max(COMPACT_AT, 2 * self.kept):
            self.chunks = {s: [self._merged(s)] for s in self.chunks}
            self.pending = self.kept = sum(c[0][0].size for c in self.chunks.values())

    def _merged(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        chunks = self.chunks.get(size, [])
        if not chunks:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return _first(np.concatenate([a for a, _ in chunks]), np.concatenate([q for _, q in chunks]))

    def count(self, spans: dict[str, tuple[int, int]], after: _Accesses | None = None) -> dict[str, int]:
        """Distinct bytes inside each span; bytes outside every span go to '?'.
        after: leave out addresses that `after` touched first (reads of bytes written earlier)."""
        out = dict.fromkeys([*spans, "?"], 0)
        for size in self.chunks:
            uniq, seq = self._merged(size)
            if after is not None:
                w_addr, w_seq = after._merged(size)
                i = np.minimum(np.searchsorted(w_addr, uniq), max(w_addr.size - 1, 0))
                earlier = (w_addr[i] == uniq) & (w_seq[i] < seq) if w_addr.size else np.zeros(uniq.size, bool)
                uniq = uniq[~earlier]
            inside = 0
            for name, (lo, hi) in spans.items():
                n = int(np.searchsorted(uniq, hi, "left") - np.searchsorted(uniq, lo, "left"))
                out[name] += n * size
                inside += n
            out["?"] += (uniq.size - inside) * size
        return {k: v for k, v in out.items() if v}


class KernelTraffic(contextlib.AbstractContextManager):
    """Record Triton launches run by the interpreter; `.launches` lists them in order.

    Assumes aligned, non-overlapping element accesses (true of pointer arithmetic on one
    dtype per buffer), so distinct bytes = distinct element addresses * element size.
    """

    def __init__(self, glue: bool = False):
        self.launches: list[LaunchTraffic] = []
        self.glue = EagerTraffic() if glue else None

    def __enter__(self):
        from triton.runtime import interpreter as it

        if not hasattr(it, "GridExecutor"):
            raise RuntimeError("KernelTraffic needs triton's interpreter "
                               "(set TRITON_INTERPRET=1 before importing triton)")
        builder, counter = it.InterpreterBuilder, self
        self._orig = (builder.create_masked_load, builder.create_masked_store, builder.create_atomic_rmw,
                      builder.create_atomic_cas, it.GridExecutor.__call__)
        orig_load, orig_store, orig_rmw, orig_cas, orig_call = self._orig
        state = {"reads": None, "writes": None, "spans": {}, "accessed": {}, "seq": 0}

        def record(kind, ptrs, mask):
            if state[kind] is not None:
                size = np.dtype(it._get_np_dtype(ptrs.get_element_ty())).itemsize
                data = np.asarray(ptrs.data)
                m = np.ones(data.shape, dtype=bool) if mask is None else np.asarray(mask.data, dtype=bool)
                addrs = data[np.broadcast_to(m, data.shape)].astype(np.int64).ravel()
                state["seq"] += 1
                state[kind].add(addrs, size, state["seq"])
                _tally(state["accessed"], state["spans"], addrs, size)

        def load(b, ptrs, mask, other, *a):
            record("reads", ptrs, mask)
            return orig_load(b, ptrs, mask, other, *a)

        def store(b, ptrs, value, mask, *a):
            record("writes", ptrs, mask)
            return orig_store(b, ptrs, value, mask, *a)

        def atomic_rmw(b, op, ptr, val, mask, *a):  # a read and a write of each address
            record("reads", ptr, mask)
            record("writes", ptr, mask)
            return orig_rmw(b, op, ptr, val, mask, *a)

        def atomic_cas(b, ptr, cmp, val, *a):
            record("reads", ptr, None)
            record("writes", ptr, None)
            return orig_cas(b, ptr, cmp, val, *a)

        def call(ex, *args, **kwargs):
            params = inspect.signature(ex.fn).parameters
            named = inspect.getcallargs(ex.fn, *args, **{k: v for k, v in kwargs.items() if k in params})
            spans = {k: _span(v) for k, v in named.items() if isinstance(v, torch.Tensor)}
            state["reads"], state["writes"], state["spans"], state["accessed"] = _Accesses(), _Accesses(), spans, {}
            if counter.glue is not None:
                counter.glue.paused += 1  # the interpreter's own host copies are not traffic
            try:
                return orig_call(ex, *args, **kwargs)
            finally:
                if counter.glue is not None:
                    counter.glue.paused -= 1
                read, written = state["reads"].count(spans, after=state["writes"]), state["writes"].count(spans)
                counter.launches.append(LaunchTraffic(ex.fn.__name__, read, written, state["accessed"]))
                state["reads"] = state["writes"] = None

        self._set(it, (load, store, atomic_rmw, atomic_cas, call))
        if self.glue is not None:
            self.glue.__enter__()
        return self

    def __exit__(self, *exc):
        from triton.runtime import interpreter as it

        if self.glue is not None:
            self.glue.__exit__(*exc)
        self._set(it, self._orig)
        return False

    @staticmethod
    def _set(it, fns) -> None:
        b = it.InterpreterBuilder
        (b.create_masked_load, b.create_masked_store, b.create_atomic_rmw, b.create_atomic_cas,
         it.GridExecutor.__call__) = fns

    @property
    def bytes(self) -> int:
        """Bytes moved by the kernel launches (glue ops excluded)."""
        return sum(launch.bytes for launch in self.launches)

    @property
    def glue_bytes(self) -> int:
        return 0 if self.glue is None else self.glue.bytes

    def accessed(self, names=None) -> int:
        """Bytes loaded plus stored on the arguments `names` (default all), repeats counted."""
        return sum(v for ln in self.launches for k, v in ln.accessed.items() if names is None or k in names)


# Allocations and metadata-only ops move no bytes (views are caught by `func.is_view`).
FREE_OPS = {"_unsafe_view", "reshape", "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
            "lift_fresh", "set_", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size"}


def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a view addresses (broadcast dims count once)."""
    return t.element_size() * math.prod(s for s, st in zip(t.shape, t.stride(), strict=True) if st != 0)


_EAGER: list = []  # the active EagerTraffic counters


@contextlib.contextmanager
def uncounted():
    """The aten ops run inside are charged to no active EagerTraffic counter."""
    active = list(_EAGER)
    for mode in active:
        mode.paused += 1
    try:
        yield
    finally:
        for mode in active:
            mode.paused -= 1


def charge(name: str, inputs, outputs) -> None:
    """Charge the active EagerTraffic counters one op that reads `inputs` and writes
    `outputs` (None entries skipped): a computation modelled as one kernel."""
    ins = {(t.data_ptr(), t.dtype, tuple(t.shape), t.stride()): t for t in inputs if t is not None}
    read, written = sum(map(distinct_bytes, ins.values())), sum(t.nbytes for t in outputs if t is not None)
    for mode in _EAGER:
        if not mode.paused:
            mode.ops.append((name, read, written))


class EagerTraffic(TorchDispatchMode):
    """Bytes each aten op reads (distinct tensor inputs) and writes (outputs), views free.

    Host arithmetic is listed apart, in `host_ops`: a CPU tensor read back by `.item()`
    (`_local_scalar_dense`), and the op that made it when that op read no tensor (a draw
    such as the dropout seed's `torch.randint`, or a constant). On a GPU machine such a
    value never leaves the CPU: no launch, no device bytes. (Under the interpreter every
    tensor is a CPU tensor; a value computed from tensors, as `x.sum().item()`, stays an op.)
    """

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int, int]] = []
        self.host_ops: list[str] = []
        self.paused = 0
        self._made: dict[int, tuple] = {}  # id of a CPU tensor an op made from no tensor -> (weakref, its entry)

    def __enter__(self):
        _EAGER.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _EAGER.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in FREE_OPS:
            if name == "_local_scalar_dense" and args[0].is_cpu:
                self._to_host(args[0])
                return out
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            ins = {(t.data_ptr(), t.dtype, tuple(t.shape), t.stride()): t for t in tensors}
            outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            entry = (name, sum(map(distinct_bytes, ins.values())), sum(t.nbytes for t in outs))
            self.ops.append(entry)
            if not tensors and len(outs) == 1 and outs[0].is_cpu:
                self._made[id(outs[0])] = (weakref.ref(outs[0]), entry)
        return out

    def _to_host(self, t: torch.Tensor) -> None:
        """`t.item()` on a CPU tensor: host work, and so is the op that made t from no tensor."""
        ref, entry = self._made.pop(id(t), (None, None))
        if ref is not None and ref() is t:
            for i in range(len(self.ops) - 1, -1, -1):
                if self.ops[i] is entry:
                    del self.ops[i]
                    self.host_ops.append(entry[0])
                    break
        self.host_ops.append("_local_scalar_dense")

    @property
    def bytes(self) -> int:
        return sum(r + w for _, r, w in self.ops)
