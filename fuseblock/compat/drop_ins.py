"""`fuseblock.compat.patch(package)`: the drop-ins of fuseblock.compat put in place of a
package's own fused norm names, in every module of the package that imported them.

A package imports its norm entry points by name into several modules (mamba imports
`RMSNorm, layer_norm_fn, rms_norm_fn` into mamba_simple and mixer_seq_simple), so one
import swapped is not enough: `patch` replaces each attribute, in every loaded module of
the package, that *is* one of the source module's objects with fuseblock's of the same
name. Call it after importing the package and before building the model (a module built
before holds the old class). A module of the package that imported a name of the source
module that fuseblock does not provide (a private `_layer_norm_fwd`, a `layer_norm_ref`)
is a ValueError naming both, and then nothing is patched.
"""
from __future__ import annotations

import importlib
import sys
import types

from . import flash_attn, mamba_ssm

# package -> (source module, fuseblock's module, the names it provides)
_FLASH_NAMES = ("RMSNorm", "layer_norm_fn", "rms_norm_fn", "layer_norm_linear_fn")
_GATED_NAMES = ("RMSNorm", "LayerNorm", "rmsnorm_fn", "layernorm_fn")
SOURCES = {
    "flash_attn": (("flash_attn.ops.triton.layer_norm", flash_attn, _FLASH_NAMES),),
    "mamba_ssm": (("mamba_ssm.ops.triton.layer_norm", flash_attn, _FLASH_NAMES),
                  ("mamba_ssm.ops.triton.layernorm_gated", mamba_ssm, _GATED_NAMES)),
}


def patch(package: str) -> list[str]:
    """Replace `package`'s fused norm names with fuseblock.compat's in every loaded module
    of it; returns the "module.name" attributes replaced (module docstring)."""
    if package not in SOURCES:
        raise ValueError(f"patch: package must be one of {', '.join(map(repr, SOURCES))}, got {package!r}")
    plan = []  # (module, attribute, new object)
    for source_name, ours, names in SOURCES[package]:
        try:
            source = importlib.import_module(source_name)
        except ImportError as e:
            raise ImportError(f"patch({package!r}): cannot import {source_name} ({e}); install {package} first") from e
        provided = {id(getattr(source, n)): (n, getattr(ours, n)) for n in names if hasattr(source, n)}
        own = {id(v): k for k, v in vars(source).items()
               if isinstance(v, (types.FunctionType, type)) and getattr(v, "__module__", None) == source_name}
        for mod_name, module in sorted(_modules_of(package)):
            for attr, value in list(vars(module).items()):
                if id(value) in provided:
                    if value is not provided[id(value)][1]:  # patched already: nothing to do
                        plan.append((module, attr, provided[id(value)][1]))
                elif module is not source and id(value) in own:
                    raise ValueError(f"patch({package!r}): {mod_name} uses {source_name}.{own[id(value)]}, which "
                                     f"fuseblock.compat.{ours.__name__.rsplit('.', 1)[-1]} does not provide: "
                                     f"nothing patched")
    for module, attr, new in plan:
        setattr(module, attr, new)
    return [f"{module.__name__}.{attr}" for module, attr, _ in plan]


def _modules_of(package: str):
    for name, module in list(sys.modules.items()):
        if isinstance(module, types.ModuleType) and (name == package or name.startswith(package + ".")):
            yield name, module
