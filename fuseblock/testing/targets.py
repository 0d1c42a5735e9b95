"""Compile the Triton kernels for GPUs this machine does not have (NVIDIA and AMD).

The interpreter runs the kernels' arithmetic, not the compiler: a construct it accepts
may still fail to compile, and a layout may spill registers to local memory (scratch on
AMD), which only a GPU build shows. Triton's compilers, and the ptxas and the linker they
ship, need no GPU, so:

- `TARGETS`: the GPUs compiled for (sm_90 H100, sm_100 B200, sm_120 RTX 5090, gfx942
  MI300X, gfx950 MI355X), each with its SM (CU) count and the resources one SM holds;
- `captured_launches()`: a context in which the launchers (`norm_fwd`, `norm_bwd`, ...)
  record their kernel launches instead of running them: the exact kernels, arguments,
  constexprs and `num_warps` a GPU would get for those inputs; `for_target(name)` makes
  the launchers choose as on that target's GPU (its warp width, SM count, tables);
- `compile_for(launch, target)`: that launch's signature (with the 16-byte divisibility
  hints Triton's JIT would add) compiled to a cubin (NVIDIA) or an hsaco (AMD);
- `resource_usage(kernel)`: registers and spilled bytes per thread (lane), shared
  memory (LDS) per program, read from the binary (`fuseblock.kernels.occupancy` turns
  them into programs per SM or CU).

Needs triton's compiler: not under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from ..kernels import occupancy
from ..spec import new_residual_dtype, residual_grad_dtype, stored_dtype


class Target(NamedTuple):
    gpu: str  # the GPU whose SM (CU) count and limits are assumed
    backend: str  # triton's: "cuda" or "hip"
    arch: int | str
    warp: int  # threads per warp (wavefront)
    sms: int  # SMs (CUs)
    sm: dict  # what one SM (CU) holds: fuseblock.kernels.occupancy


TARGETS = {
    "sm_90": Target("H100 SXM", "cuda", 90, 32, 132, occupancy.H100_SM),
    "sm_100": Target("B200", "cuda", 100, 32, 148, occupancy.B200_SM),
    "sm_120": Target("RTX 5090", "cuda", 120, 32, 170, occupancy.RTX5090_SM),
    "gfx942": Target("MI300X", "hip", "gfx942", 64, 304, occupancy.MI300X_CU),
    "gfx950": Target("MI355X", "hip", "gfx950", 64, 256, occupancy.MI355X_CU),
}
MAIN_TARGETS = ("sm_90", "sm_100", "gfx942")  # the ones held to zero spills


def backend_problem(target: str) -> str | None:
    """Why this machine cannot compile for `target` (a line), or None when it can."""
    try:
        import triton
        from triton.backends import backends
    except ImportError as e:
        return f"no triton ({e})"
    t = TARGETS[target]
    name = {"cuda": "nvidia", "hip": "amd"}[t.backend]
    if name not in backends:
        return f"triton {triton.__version__} has no {name} backend"
    return None

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
           torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


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


def launch_signature(launch: CapturedLaunch):
    """(signature, constexprs, attrs, options) as Triton's JIT would build them."""
    fn = launch.fn
    values = dict(zip(fn.arg_names, launch.args, strict=False))  # the rest passed by keyword
    values.update({k: v for k, v in launch.kwargs.items() if k in fn.arg_names})
    options = {k: v for k, v in launch.kwargs.items() if k not in fn.arg_names}
    signature, constexprs, attrs = {}, {}, {}
    for param in fn.params:
        name = param.name
        v = values[name] if name in values else param.default  # an argument left to its default, as the JIT binds it
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


@contextlib.contextmanager
def for_target(target: str):
    """Within the context the launchers choose as on `target`'s GPU: its warp width, its SM
    (CU) count, its vendor's compile options (`launch.NO_SPILL`) and what
    `fuseblock.kernels.occupancy.learn` assumes one holds."""
    from ..kernels import launch

    t = TARGETS[target]
    saved = launch.WARP, launch.H100_SMS, launch.NO_SPILL, occupancy.MACHINE
    no_spill = {"maxnreg": 255} if t.backend == "cuda" else {}
    launch.WARP, launch.H100_SMS, launch.NO_SPILL, occupancy.MACHINE = t.warp, t.sms, no_spill, t.sm
    try:
        yield t
    finally:
        launch.WARP, launch.H100_SMS, launch.NO_SPILL, occupancy.MACHINE = saved


def compile_for(launch: CapturedLaunch, target: str = "sm_90"):
    """The launch compiled for `target` (a key of TARGETS): a triton CompiledKernel, its
    binary in `.asm['cubin']` (NVIDIA) or `.asm['hsaco']` and `['amdgcn']` (AMD)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t = TARGETS[target]
    signature, constexprs, attrs, options = launch_signature(launch)
    options.setdefault("enable_fp_fusion", True)  # Triton 3.9's default, which the JIT uses
    src = ASTSource(fn=launch.fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget(t.backend, t.arch, t.warp), options=options)


def _amd_field(text: str, name: str) -> int:
    found = re.search(rf"^\s*\.{name}:\s+(\d+)", text, re.M)
    if found is None:
        raise RuntimeError(f"no .{name} in the kernel's AMDGPU metadata")
    return int(found.group(1))


def resource_usage(kernel) -> dict[str, int]:
    """{'registers' per thread (VGPRs per lane on AMD), 'stack' bytes per thread (spilled
    registers live there: local memory on NVIDIA, scratch on AMD), 'shared' bytes (LDS) per
    program} of a compiled kernel, from its binary: cuobjdump's resource usage on NVIDIA,
    the code object's metadata on AMD (which adds 'sgprs', 'vgpr_spills', 'sgpr_spills')."""
    if "amdgcn" in kernel.asm:
        text = kernel.asm["amdgcn"]
        usage = {"registers": "vgpr_count", "stack": "private_segment_fixed_size", "sgprs": "sgpr_count",
                 "vgpr_spills": "vgpr_spill_count", "sgpr_spills": "sgpr_spill_count"}
        return dict({k: _amd_field(text, v) for k, v in usage.items()}, shared=int(kernel.metadata.shared))
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


def norm_linear_launches(x, residual, weight, bias=None, *, kind="rms", compiled=None) -> list[CapturedLaunch]:
    """The norm kernels' launches of one norm_linear forward and backward (the Linear is
    torch's): the forward with statistics, the backward with new_residual's gradient added
    in, and the normalized rows rebuilt without statistics for the Linear's weight gradient."""
    from ..kernels import launch
    from ..kernels import norm as kernels
    from ..ops.checks import resolve

    spec = resolve(x, residual, weight, bias, None, kind=kind, c=None, eps=1e-6, gate_act="silu",
                   gate_position="post", num_groups=1, residual_dtype=None)
    rdtype = None if residual is None else new_residual_dtype(x.dtype, residual.dtype, None)
    with captured_launches(kernels, launch, compiled=compiled) as out:
        _, new_res, rstd, mean = kernels.norm_fwd(x, residual, None, weight, bias, spec, rdtype, True)
        p = x if new_res is None else new_res
        kernels.norm_bwd(torch.empty_like(x), None if new_res is None else torch.empty_like(p), p, None, weight, bias,
                         rstd, mean, spec, x.dtype, None)
        kernels.norm_fwd(p, None, None, weight, bias, spec, None, False)
    return out


def embed_norm_launches(x, ord=2, compiled=None) -> list[CapturedLaunch]:
    """The launches of one embed_norm forward and backward (rows of x scaled to unit norm)."""
    from ..kernels import embed_norm as kernels

    with captured_launches(kernels, compiled=compiled) as out:
        _, n = kernels.embed_norm_fwd(x, ord, 1e-6)
        kernels.embed_norm_bwd(torch.empty_like(x), x, n, ord, 1e-6)
    return out


def channel_norm_launches(x, weight, bias=None, *, batch=True, groups=0, compiled=None) -> list[CapturedLaunch]:
    """The launches of one batch norm (batch, running statistics updated) or group norm
    (groups) forward and backward on x of (N, C, ...)."""
    from ..kernels import channel_norm as kernels
    from ..kernels import launch

    running = torch.empty(x.shape[1]) if batch else None
    with captured_launches(kernels, launch, compiled=compiled) as out:
        _, mean, rstd = kernels.channel_norm_fwd(x, weight, bias, batch, groups, 1e-5, running, running, 0.1)
        kernels.channel_norm_bwd(torch.empty_like(x), x, weight, bias, mean, rstd, batch, groups)
    return out


def quant_launches(x, residual, weight, *, quant="fp8_row", second=False, compiled=None) -> list[CapturedLaunch]:
    """The forward launches of add_norm (rms; second: norm_add_norm) with a scaled fp8
    output (`quant` as the ops take it: a mode's name or an Fp8Recipe); the backward is the
    plain op's."""
    from ..kernels import launch
    from ..kernels import norm as kernels
    from ..kernels import norm_add as pair_kernels
    from ..ops.checks import recipe_of, resolve
    from ..spec import DEFAULT_GATE_ACT, DEFAULT_GATE_POSITION

    def spec_of(quant, scale):
        return resolve(x, residual, weight, None, None, kind="rms", c=None, eps=1e-6, gate_act=DEFAULT_GATE_ACT,
                       gate_position=DEFAULT_GATE_POSITION, num_groups=1, residual_dtype=None, quant=quant,
                       scale=scale)

    scale = torch.ones((), dtype=torch.float32) if recipe_of(quant).mode == "fp8_tensor" else None
    plain = spec_of(None, None)
    spec = spec_of(quant, scale)
    rdtype = stored_dtype(x.dtype, residual.dtype, None)
    with captured_launches(kernels, pair_kernels, launch, compiled=compiled) as out:
        if second:
            pair_kernels.norm_add_fwd(x, residual, weight, None, weight, None, plain, spec, 0.5, rdtype, True, True,
                                      qscale=scale)
        else:
            kernels.norm_fwd(x, residual, None, weight, None, spec, rdtype, True, qscale=scale)
    return out


def hyper_launches(rows: int, n: int, d: int, dtype, compiled=None) -> list[CapturedLaunch]:
    """The launches of one hyper-connection boundary (pre, post and comb out, the branch
    added through comb; `fuseblock.hc_add_norm`), forward and backward, n streams of d."""
    from ..hyper_spec import HyperSpec, Mode
    from ..kernels import hyper as kernels
    from ..kernels import launch

    spec = HyperSpec(n=n, d=d, mode=Mode.PRE_POST_COMB, update=True, comb_in=True, iters=20, hc_eps=1e-6, eps=1e-6,
                     post_mult=2.0, post_eps=0.0)
    m, f32 = spec.m, torch.float32
    H, f = torch.empty(rows, n, d, dtype=dtype), torch.empty(rows, d, dtype=dtype)
    post, comb = torch.empty(rows, n, dtype=f32), torch.empty(rows, n, n, dtype=f32)
    fn, base, scale, w = torch.empty(m, n * d, dtype=f32), torch.empty(m, dtype=f32), torch.empty(3), torch.empty(d)
    with captured_launches(kernels, launch, compiled=compiled) as out:
        kernels.hyper_fwd(H, f, post, comb, fn, base, scale, w, spec)
        mix, rho = torch.empty(rows, m, dtype=f32), torch.empty(rows, dtype=f32)
        kernels.hyper_bwd(torch.empty_like(f), torch.empty_like(H), torch.empty_like(post), torch.empty_like(comb),
                          H, f, post, comb, torch.empty_like(H), fn, base, scale, w, mix, rho, spec)
    return out
