"""Compile the Triton kernels for an H100 (sm_90) on a machine with no GPU.

The interpreter runs the kernels' arithmetic, not the compiler: a construct it accepts
may still fail to compile, and a layout may spill registers to local memory, which only
a GPU build shows. Triton's compiler and the ptxas it ships need no GPU, so:

- `captured_launches()`: a context in which the launchers (`norm_fwd`, `norm_bwd`, ...)
  record their kernel launches instead of running them: the exact kernels, arguments,
  constexprs and `num_warps` a GPU would get for those inputs;
- `compile_sm90(launch)`: that launch's signature (with the 16-byte divisibility hints
  Triton's JIT would add) compiled to PTX and a cubin for sm_90;
- `resource_usage(kernel)`: registers and stack (spill) bytes per thread, shared bytes,
  read from the cubin (`fuseblock.kernels.occupancy` turns them into programs per SM).

Needs triton's compiler: not under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..spec import new_residual_dtype, residual_grad_dtype, stored_dtype

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
           torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.bool: "i1"}


@dataclass
class CapturedLaunch:
    fn: object  # the triton.JITFunction
    grid: tuple
    args: tuple
    kwargs: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.fn.__name__


class _Recorder:
    def __init__(self, fn, out: list, compiled, originals):
        self.fn, self.out, self.compiled, self.originals = fn, out, compiled, originals

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.out.append(CapturedLaunch(self.fn, tuple(grid), args, kwargs))
            if self.compiled is None:
                return None
            with self.originals():  # the kernel being compiled calls the real helpers
                return self.compiled(self.out[-1])

        return launch


@contextlib.contextmanager
def captured_launches(*modules, compiled=None):
    """Within the context, every JIT kernel in `modules` (default: fuseblock's kernel
    modules) records its launches into the yielded list instead of running.
    compiled(launch): what a launch returns, as a GPU launch returns its compiled kernel."""
    import triton

    if not modules:
        from ..kernels import channel_norm, embed_norm, launch, norm

        modules = (norm, embed_norm, channel_norm, launch)
    out: list[CapturedLaunch] = []
    saved = [(mod, name, obj) for mod in modules for name, obj in list(vars(mod).items())
             if isinstance(obj, triton.runtime.JITFunction)]

    def install(recording: bool) -> None:
        for mod, name, obj in saved:
            setattr(mod, name, _Recorder(obj, out, compiled, originals) if recording else obj)

    @contextlib.contextmanager
    def originals():
        install(False)
        try:
            yield
        finally:
            install(True)

    install(True)
    try:
        yield out
    finally:
        install(False)


def _signature(launch: CapturedLaunch):
    """(signature, constexprs, attrs, options) as Triton's JIT would build them."""
    fn = launch.fn
    values = dict(zip(fn.arg_names, launch.args, strict=False))  # the rest passed by keyword
    values.update({k: v for k, v in launch.kwargs.items() if k in fn.arg_names})
    options = {k: v for k, v in launch.kwargs.items() if k not in fn.arg_names}
    signature, constexprs, attrs = {}, {}, {}
    for param in fn.params:
        name, v = param.name, values[param.name]
        if param.is_constexpr or v is None:
            signature[name], constexprs[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _DTYPES[v.dtype]
            if v.data_ptr() % 16 == 0 and not param.do_not_specialize_on_alignment:
                attrs[(param.num,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            signature[name] = "i1"
        elif isinstance(v, int):
            if v == 1 and not param.do_not_specialize:  # the JIT makes 1 a constant
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0 and not param.do_not_specialize:
                attrs[(param.num,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{launch.name}: cannot type argument {name} = {v!r}")
    return signature, constexprs, attrs, options


def compile_sm90(launch: CapturedLaunch):
    """The launch compiled for an H100: a triton CompiledKernel (`.asm['ptx']`, `['cubin']`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = _signature(launch)
    options.setdefault("enable_fp_fusion", True)  # Triton 3.9's default, which the JIT uses
    src = ASTSource(fn=launch.fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def resource_usage(kernel) -> dict[str, int]:
    """{'registers' per thread, 'stack' bytes per thread (spilled registers live there),
    'shared' bytes per program} of a compiled kernel, from its cubin (cuobjdump)."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
                             capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if found is None:
        raise RuntimeError(f"unexpected cuobjdump output:\n{out}")
    return {"registers": int(found.group(1)), "stack": int(found.group(2)), "shared": int(kernel.metadata.shared)}


# A dropout seed as the launchers get it from the host (an int64 past 2**31: the i64 variant)
HOST_SEED = 0x1234_5678_9ABC


def norm_launches(x, residual=None, weight=None, bias=None, gate=None, *, kind="rms", residual_dtype=None,
                  gate_position="post", gate_act="silu", num_groups=1, alpha=1.0, x1=None, dropout_p=0.0,
                  seed=HOST_SEED, compiled=None) -> list[CapturedLaunch]:
    """The kernel launches of one add_norm forward and backward on these inputs (CPU
    tensors are fine: nothing runs). alpha, x1, dropout_p: add_norm's branch, its seed
    an int (drawn on the host) or a one-element int64 tensor (drawn on the device while
    a CUDA graph is captured). compiled: as for `captured_launches`."""
    from ..kernels import launch
    from ..kernels import norm as kernels
    from ..ops.checks import resolve

    spec = resolve(x, residual, weight, bias, gate, kind=kind, c=None, eps=1e-6, gate_act=gate_act,
                   gate_position=gate_position, num_groups=num_groups, residual_dtype=residual_dtype)
    rin = None if residual is None else residual.dtype
    rdtype = new_residual_dtype(x.dtype, rin, residual_dtype)  # what add_norm stores: None, or its dtype
    rgrad = residual_grad_dtype(x.dtype, rin)
    branch = x1 is not None or alpha != 1.0 or dropout_p > 0
    if branch:  # as add_norm: new_residual always stored, dresidual apart from dx when scaled
        spec = spec.with_branch(alpha, dropout_p)
        rdtype = stored_dtype(x.dtype, rin, residual_dtype)
        if alpha != 1.0 or dropout_p > 0:
            rgrad = rin
    seed = seed if dropout_p > 0 else None
    with captured_launches(kernels, launch, compiled=compiled) as out:  # launch: the partial-row sum
        _, new_res, rstd, mean = kernels.norm_fwd(x, residual, gate, weight, bias, spec, rdtype, True, x1, seed)
        p = x if new_res is None else new_res
        dres = None if new_res is None else torch.empty_like(p)
        kernels.norm_bwd(torch.empty_like(x), dres, p, gate, weight, bias, rstd, mean, spec, x.dtype, rgrad, seed,
                         x1 is not None)
    return out


def norm_add_launches(x, residual, branch_weight, weight=None, *, kind="rms", second=True, alpha=0.5,
                      compiled=None) -> list[CapturedLaunch]:
    """The kernel launches of one norm_add_norm (second) or norm_add forward and backward,
    the branch bias and the second norm's bias given where kind="layer"."""
    from ..kernels import launch
    from ..kernels import norm_add as kernels
    from ..spec import NormSpec

    spec = NormSpec.of(x.shape[-1], kind=kind, c=None, eps=1e-6, num_groups=1, gate_act=None, gate_position=None)
    layer = kind == "layer"  # a bias each, the weights' tensors standing in (nothing runs)
    bb, b, w = branch_weight if layer else None, weight if layer and second else None, weight if second else None
    rdtype = stored_dtype(x.dtype, residual.dtype, None)
    with captured_launches(kernels, launch, compiled=compiled) as out:
        new_res, _, rstd_b, mean_b, rstd, mean = kernels.norm_add_fwd(x, residual, branch_weight, bb, w, b, spec,
                                                                      spec, alpha, rdtype, second, True)
        kernels.norm_add_bwd(torch.empty_like(x) if second else None, torch.empty_like(new_res), x, new_res,
                             branch_weight, bb, w, b, rstd_b, mean_b, rstd, mean, spec, spec, alpha, rdtype, second)
    return out
