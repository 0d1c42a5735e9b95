"""Count the bytes a computation moves, without a GPU.

- `KernelTraffic`: under TRITON_INTERPRET=1, records every masked load and store the
  interpreter performs and reports, per kernel launch and per tensor argument, the
  distinct bytes read and the distinct bytes written (a byte read twice counts once: on
  a GPU the second read is a cache hit at best, and never less than one HBM read).
- `EagerTraffic`: a TorchDispatchMode charging each aten op its tensor inputs read and
  its outputs written (views are free): the traffic of an unfused eager composition.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class Launch:
    kernel: str
    read: dict[str, int] = field(default_factory=dict)  # bytes per tensor argument
    written: dict[str, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(self.read.values()) + sum(self.written.values())


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte address a tensor view can touch."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _count(accesses: list, spans: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Distinct bytes of `accesses` [(element addresses, itemsize)] inside each span."""
    out = dict.fromkeys(spans, 0)
    by_size: dict[int, list] = {}
    for addrs, size in accesses:
        by_size.setdefault(size, []).append(addrs)
    for size, chunks in by_size.items():
        uniq = np.unique(np.concatenate(chunks))
        for name, (lo, hi) in spans.items():
            n = np.searchsorted(uniq, hi, "left") - np.searchsorted(uniq, lo, "left")
            out[name] += int(n) * size
    return {k: v for k, v in out.items() if v}


class KernelTraffic(contextlib.AbstractContextManager):
    """Record Triton launches run by the interpreter; `.launches` lists them in order."""

    def __init__(self):
        self.launches: list[Launch] = []

    def __enter__(self):
        from triton.runtime import interpreter as it

        if not hasattr(it, "GridExecutor"):
            raise RuntimeError("KernelTraffic needs triton's interpreter (set TRITON_INTERPRET=1 before importing triton)")
        builder, counter = it.InterpreterBuilder, self
        self._orig = (builder.create_masked_load, builder.create_masked_store, it.GridExecutor.__call__)
        orig_load, orig_store, orig_call = self._orig
        state = {"reads": None, "writes": None}

        def load(b, ptrs, mask, other, *a):
            if state["reads"] is not None:
                size = np.dtype(it._get_np_dtype(ptrs.get_element_ty())).itemsize
                state["reads"].append((ptrs.data[mask.data].astype(np.int64).ravel(), size))
            return orig_load(b, ptrs, mask, other, *a)

        def store(b, ptrs, value, mask, *a):
            if state["writes"] is not None:
                size = np.dtype(it._get_np_dtype(ptrs.get_element_ty())).itemsize
                state["writes"].append((ptrs.data[mask.data].astype(np.int64).ravel(), size))
            return orig_store(b, ptrs, value, mask, *a)

        def call(ex, *args, **kwargs):
            named = inspect.getcallargs(ex.fn, *args, **{k: v for k, v in kwargs.items()
                                                         if k in inspect.signature(ex.fn).parameters})
            spans = {k: _span(v) for k, v in named.items() if isinstance(v, torch.Tensor)}
            state["reads"], state["writes"] = [], []
            try:
                return orig_call(ex, *args, **kwargs)
            finally:
                counter.launches.append(Launch(ex.fn.__name__, _count(state["reads"], spans), _count(state["writes"], spans)))
                state["reads"] = state["writes"] = None

        builder.create_masked_load, builder.create_masked_store, it.GridExecutor.__call__ = load, store, call
        return self

    def __exit__(self, *exc):
        from triton.runtime import interpreter as it

        it.InterpreterBuilder.create_masked_load, it.InterpreterBuilder.create_masked_store, it.GridExecutor.__call__ = self._orig
        return False

    @property
    def bytes(self) -> int:
        return sum(launch.bytes for launch in self.launches)


FREE_OPS = {"view", "_unsafe_view", "reshape", "expand", "t", "transpose", "permute", "unsqueeze", "squeeze",
            "select", "slice", "as_strided", "alias", "detach", "empty", "empty_like", "new_empty",
            "empty_strided", "_to_copy_noop", "lift_fresh", "unbind", "split", "split_with_sizes"}


class EagerTraffic(TorchDispatchMode):
    """Bytes each aten op reads (tensor inputs) and writes (outputs), views free."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in FREE_OPS:
            ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.ops.append((name, sum(t.nbytes for t in ins), sum(t.nbytes for t in outs)))
        return out

    @property
    def bytes(self) -> int:
        return sum(r + w for _, r, w in self.ops)
