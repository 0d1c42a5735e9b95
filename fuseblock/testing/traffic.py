"""Byte counters: what Triton kernel launches and eager aten ops move through memory.

`KernelTraffic` (needs TRITON_INTERPRET=1 before triton is imported) hooks the
interpreter's loads, stores and atomics and records, per launch, the set of distinct
bytes read and the set of distinct bytes written. A byte read twice in one launch counts
once (a perfect cache within a launch, none across launches); `accessed` keeps every
access, repeats included (no cache at all). Bytes are attributed to the launch's tensor
arguments by address range, under the kernel's own argument names.

`EagerTraffic` is a TorchDispatchMode that charges each aten op its tensor inputs read
once and its outputs written once: the traffic of an unfused eager composition. Views,
allocations and metadata ops are free. Ops that run inside a kernel launch (the
interpreter's own host copies) are not counted.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import math
from typing import NamedTuple, Optional

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_ACTIVE: Optional["KernelTraffic"] = None  # the counter hooked into the interpreter
_IN_LAUNCH = False  # set while the interpreter runs a grid
_EAGER: list = []  # the active EagerTraffic counters
_UNCOUNTED = 0  # > 0 inside `uncounted()`


# --------------------------------------------------------------------------- kernels
@dataclasses.dataclass
class Launch:
    """One kernel launch: distinct bytes per tensor argument name."""

    kernel: str
    grid: tuple
    read: dict  # argument name -> distinct bytes read
    written: dict  # argument name -> distinct bytes written
    accessed: dict = dataclasses.field(default_factory=dict)  # name -> bytes loaded + stored, repeats too
    unattributed: int = 0  # distinct bytes outside every tensor argument (should be 0)

    @property
    def read_bytes(self) -> int:
        return sum(self.read.values())

    @property
    def write_bytes(self) -> int:
        return sum(self.written.values())

    @property
    def bytes(self) -> int:
        return self.read_bytes + self.write_bytes + self.unattributed

    def bytes_of(self, names) -> int:
        """Distinct bytes read plus written on the arguments `names`."""
        return sum(v for k, v in (*self.read.items(), *self.written.items()) if k in names)

    def accessed_of(self, names=None) -> int:
        """Bytes loaded plus stored on `names` (default all), every repeat counted."""
        return sum(v for k, v in self.accessed.items() if names is None or k in names)


class _Region:
    """The bytes one tensor argument spans, with one bitmap per access kind ("r", "w").

    The bitmaps track units of `unit` bytes (the element size); an access that is
    not unit-aligned switches the region to single bytes, so counts stay exact."""

    def __init__(self, name: str, start: int, end: int, unit: int):
        self.name, self.start, self.end, self.unit = name, start, end, unit
        self.maps: dict = {}
        self.accessed = 0

    def mark(self, kind: str, off: np.ndarray, size: int) -> None:
        if self.unit > 1 and (size % self.unit or np.any(off % self.unit)):
            self.maps = {k: np.repeat(v, self.unit) for k, v in self.maps.items()}
            self.unit = 1
        self.accessed += off.size * size
        bm = self.maps.get(kind)
        if bm is None:
            bm = self.maps[kind] = np.zeros((self.end - self.start) // self.unit, dtype=bool)
        idx = off // self.unit
        for k in range(size // self.unit):
            bm[idx + k] = True

    def count(self, kind: str) -> int:
        bm = self.maps.get(kind)
        return 0 if bm is None else int(np.count_nonzero(bm)) * self.unit


def _extent(t: torch.Tensor):
    """(first byte, one past the last byte) that a strided tensor can touch."""
    if t.numel() == 0:
        return None
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _regions(named) -> list:
    """Regions for (name, tensor) pairs, sorted by address; aliasing tensors merge."""
    spans = []
    for name, t in named:
        ext = _extent(t)
        if ext is not None:
            spans.append((ext[0], ext[1], name, t.element_size()))
    spans.sort()
    out: list = []
    for start, end, name, unit in spans:
        last = out[-1] if out else None
        if last is not None and start < last.end:  # overlaps: one region, both names
            last.unit = math.gcd(last.unit, unit, start - last.start)
            last.end = max(last.end, end)
            last.name = f"{last.name}={name}"
        else:
            out.append(_Region(name, start, end, unit))
    return out


def _union_bytes(starts: np.ndarray, sizes: np.ndarray) -> int:
    """Length of the union of the byte intervals [start, start + size)."""
    if starts.size == 0:
        return 0
    order = np.argsort(starts, kind="stable")
    s = starts[order].astype(np.int64)
    e = s + sizes[order].astype(np.int64)
    reach = np.concatenate([s[:1], np.maximum.accumulate(e)[:-1]])  # furthest end before each
    return int(np.clip(e - np.maximum(s, reach), 0, None).sum())


class KernelTraffic:
    """Context manager: `with KernelTraffic() as kt: ...` then read `kt.launches`.

    Only Triton kernels run by the interpreter are seen, so TRITON_INTERPRET=1 must be
    set before triton is first imported.
    """

    def __init__(self):
        self.launches: list[Launch] = []
        self._regions: list[_Region] = []
        self._starts: list[int] = []
        self._stray: dict = {"r": [], "w": []}  # accesses outside every argument
        self._saved: dict = {}

    # -- summaries
    def count(self, kernel: Optional[str] = None) -> int:
        return sum(1 for ln in self.launches if kernel is None or ln.kernel == kernel)

    @property
    def bytes(self) -> int:
        return sum(ln.bytes for ln in self.launches)

    def bytes_of(self, names) -> int:
        return sum(ln.bytes_of(names) for ln in self.launches)

    def accessed_of(self, names=None) -> int:
        return sum(ln.accessed_of(names) for ln in self.launches)

    @property
    def unattributed(self) -> int:
        return sum(ln.unattributed for ln in self.launches)

    # -- hooks
    def __enter__(self) -> "KernelTraffic":
        global _ACTIVE
        from triton.runtime import interpreter as interp

        if _ACTIVE is not None:
            raise RuntimeError("a KernelTraffic counter is already active")
        if not isinstance(getattr(interp, "interpreter_builder", None), interp.InterpreterBuilder):
            raise RuntimeError("KernelTraffic needs triton's interpreter (TRITON_INTERPRET=1)")
        b, g = interp.InterpreterBuilder, interp.GridExecutor
        self._saved = {
            (b, "create_masked_load"): b.create_masked_load,
            (b, "create_masked_store"): b.create_masked_store,
            (b, "create_atomic_rmw"): b.create_atomic_rmw,
            (b, "create_atomic_cas"): b.create_atomic_cas,
            (g, "__call__"): g.__call__,
            (g, "_init_args_hst"): g._init_args_hst,
        }
        orig = {name: fn for (_, name), fn in self._saved.items()}

        def load(builder, ptrs, mask, *a, **k):
            self._access("r", ptrs, mask)
            return orig["create_masked_load"](builder, ptrs, mask, *a, **k)

        def store(builder, ptrs, value, mask, *a, **k):
            self._access("w", ptrs, mask)
            return orig["create_masked_store"](builder, ptrs, value, mask, *a, **k)

        def atomic_rmw(builder, op, ptr, val, mask, *a, **k):
            self._access("r", ptr, mask)
            self._access("w", ptr, mask)
            return orig["create_atomic_rmw"](builder, op, ptr, val, mask, *a, **k)

        def atomic_cas(builder, ptr, cmp, val, *a, **k):
            self._access("r", ptr, None)
            self._access("w", ptr, None)
            return orig["create_atomic_cas"](builder, ptr, cmp, val, *a, **k)

        def init_args(executor, args_dev, kwargs):
            args_hst, kwargs_hst = orig["_init_args_hst"](executor, args_dev, kwargs)
            named = [*zip(executor.arg_names, args_hst), *kwargs_hst.items()]
            self._open([(n, getattr(a, "base", a)) for n, a in named if hasattr(a, "data_ptr")])
            return args_hst, kwargs_hst

        def call(executor, *a, **k):
            global _IN_LAUNCH
            _IN_LAUNCH = True
            try:
                out = orig["__call__"](executor, *a, **k)
            finally:
                _IN_LAUNCH = False
            self._close(executor.fn.__name__, tuple(interp.interpreter_builder.grid_dim))
            return out

        for (cls, name), fn in zip(self._saved, (load, store, atomic_rmw, atomic_cas, call, init_args)):
            setattr(cls, name, fn)
        _ACTIVE = self
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        for (cls, name), fn in self._saved.items():
            setattr(cls, name, fn)
        _ACTIVE = None

    def _open(self, named) -> None:
        self._regions = _regions(named)
        self._starts = [r.start for r in self._regions]
        self._stray = {"r": [], "w": []}

    def _close(self, kernel: str, grid: tuple) -> None:
        read = {r.name: r.count("r") for r in self._regions if "r" in r.maps}
        written = {r.name: r.count("w") for r in self._regions if "w" in r.maps}
        accessed = {r.name: r.accessed for r in self._regions if r.accessed}
        stray = 0
        for kind in ("r", "w"):
            if self._stray[kind]:
                starts = np.concatenate([s for s, _ in self._stray[kind]])
                sizes = np.concatenate([np.full(s.shape, z, dtype=np.int64) for s, z in self._stray[kind]])
                stray += _union_bytes(starts, sizes)
                accessed["?"] = accessed.get("?", 0) + int(sizes.sum())
        self.launches.append(Launch(kernel, grid, read, written, accessed, stray))
        self._regions, self._starts = [], []

    def _access(self, kind: str, ptrs, mask) -> None:
        p = np.asarray(ptrs.data)
        if mask is not None:
            p = p[np.broadcast_to(np.asarray(mask.data, dtype=bool), p.shape)]
        addrs = p.reshape(-1).astype(np.uint64, copy=False)
        if addrs.size == 0:
            return
        size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        lo, hi = int(addrs.min()), int(addrs.max()) + size
        i = bisect.bisect_right(self._starts, lo) - 1
        if i >= 0 and hi <= self._regions[i].end:  # the usual case: one argument
            reg = self._regions[i]
            reg.mark(kind, (addrs - np.uint64(reg.start)).astype(np.int64), size)
            return
        idx = np.searchsorted(np.asarray(self._starts, dtype=np.uint64), addrs, side="right") - 1
        for j in np.unique(idx):
            sel = addrs[idx == j]
            if j >= 0:
                reg = self._regions[j]
                inside = sel + np.uint64(size) <= np.uint64(reg.end)
                if inside.any():
                    reg.mark(kind, (sel[inside] - np.uint64(reg.start)).astype(np.int64), size)
                sel = sel[~inside]
            if sel.size:
                self._stray[kind].append((sel, size))


# --------------------------------------------------------------------------- aten ops
class Op(NamedTuple):
    name: str
    read: int
    written: int

    @property
    def bytes(self) -> int:
        return self.read + self.written


# Allocation and metadata: no data moves (empty memory is not written).
_FREE = {
    "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted",
    "set_", "resize_", "_unsafe_view", "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
}
# In-place ops that overwrite their first argument without reading it.
_OVERWRITE = {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_"}


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of `t` (an expanded dim, stride 0, counts once)."""
    if t.numel() == 0:
        return 0
    n = 1
    for s, st in zip(t.shape, t.stride()):
        if st != 0:
            n *= s
    return n * t.element_size()


def _unique(ts):
    seen, out = set(), []
    for t in ts:
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


@contextlib.contextmanager
def uncounted():
    """Aten ops run inside are not charged (see `charge`)."""
    global _UNCOUNTED
    _UNCOUNTED += 1
    try:
        yield
    finally:
        _UNCOUNTED -= 1


def charge(name: str, inputs, outputs) -> None:
    """Charge the active EagerTraffic counters one op reading `inputs` and writing
    `outputs`: models a computation done by one kernel (run it under `uncounted()`)."""
    read = sum(tensor_bytes(t) for t in _unique([t for t in inputs if t is not None]))
    written = sum(tensor_bytes(t) for t in _unique([t for t in outputs if t is not None]))
    for mode in _EAGER:
        mode.ops.append(Op(name, read, written))


class EagerTraffic(TorchDispatchMode):
    """Charges every aten op its inputs read once and outputs written once: `ops`, `bytes`."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []

    def __enter__(self):
        _EAGER.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _EAGER.remove(self)
        return super().__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(op.bytes for op in self.ops)

    def count(self) -> int:
        return len(self.ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if _IN_LAUNCH or _UNCOUNTED or func.is_view or name in _FREE:
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        skip = {id(t) for t in tree_flatten(kwargs.get("out"))[0] if isinstance(t, torch.Tensor)}
        if name in _OVERWRITE and args and isinstance(args[0], torch.Tensor):
            skip.add(id(args[0]))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and id(t) not in skip]
        read = sum(tensor_bytes(t) for t in _unique(ins))
        written = sum(tensor_bytes(t) for t in _unique(outs))
        self.ops.append(Op(str(func), read, written))
        return out
