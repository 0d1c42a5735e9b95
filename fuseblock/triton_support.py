"""Triton, imported only when a kernel is about to run.

triton has wheels for Linux only. On macOS and Windows (or wherever it is missing) every
call on a CPU tensor takes the pure-PyTorch path and triton is never imported; a call
that needs the kernels (a CUDA tensor, or TRITON_INTERPRET=1) raises an error saying
what to install. The kernel modules import triton at their top, so the ops load them
through `kernel_module` on first use instead of importing them.
"""
from __future__ import annotations

import importlib
import os
import re
import threading
from types import ModuleType

import torch


class _Tracing(threading.local):
    on = False  # while torch.compile traces a triton_op's launcher (`fuseblock.ops.registry`)


# Set by a triton_op's body (`fuseblock.ops.registry`), read at each launch call site as
# `(traced(k) if TRACING.on else k)[grid](...)` (`fuseblock.kernels.launch.traced`): an
# attribute read, no call, so an eager launch pays nothing for it.
TRACING = _Tracing()

_loaded: dict[str, ModuleType] = {}  # kernel modules imported and checked: kernel_module runs on every call


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def interpreter_numpy_problem(triton_version: str, numpy_version: str) -> str | None:
    """The numpy requirement Triton's interpreter (TRITON_INTERPRET=1) has and this numpy
    breaks, else None. Triton 3.1's interpreter returns garbage under numpy 2 (its integer
    promotion changed); 3.2 to 3.6 raise "only 0-dimensional arrays can be converted to
    Python scalars" under numpy 2.4, from loops bounded by a kernel argument. The compiled
    GPU path uses neither, and Triton 3.7 fixed both."""
    t, n = _release(triton_version), _release(numpy_version)
    if t < (3, 2) and n >= (2,):
        return "numpy<2"
    if t < (3, 7) and n >= (2, 4):
        return "numpy<2.4"
    return None


def missing_triton_error(device: torch.device | str) -> ModuleNotFoundError:
    """The one-line error for a call that needs the Triton kernels where triton is missing."""
    if torch.device(device).type == "cuda":
        msg = ("fuseblock runs CUDA tensors on its Triton kernels, and triton is not installed: "
               "pip install triton (Linux), or use CPU tensors (the pure-PyTorch path)")
    else:
        msg = ("TRITON_INTERPRET=1 runs fuseblock's Triton kernels on the CPU, and triton is not installed: "
               "pip install triton (Linux), or unset TRITON_INTERPRET for the pure-PyTorch path")
    return ModuleNotFoundError(msg, name="triton")


def kernel_module(name: str, device: torch.device) -> ModuleType:
    """`fuseblock.kernels.<name>`, imported now (and triton with it) for a call on `device`."""
    module = _loaded.get(name)
    if module is None:
        module = _loaded[name] = _load(name, device)
    return module


def _load(name: str, device: torch.device) -> ModuleType:
    try:
        module = importlib.import_module(f"fuseblock.kernels.{name}")
    except ImportError as e:
        if (e.name or "").partition(".")[0] != "triton":
            raise
        raise missing_triton_error(device) from None
    if os.environ.get("TRITON_INTERPRET") == "1":
        import numpy
        import triton

        need = interpreter_numpy_problem(triton.__version__, numpy.__version__)
        if need is not None:
            raise RuntimeError(f"TRITON_INTERPRET=1: the interpreter of triton {triton.__version__} fails under "
                               f"numpy {numpy.__version__}: pip install '{need}', or triton>=3.7")
    return module
