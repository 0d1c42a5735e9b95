"""The peers `make gpu-check` puts beside fuseblock, when importable: the kernels a user
would pick instead. Each is looked for once (`find`), and the report says which were found.

- liger: Liger-Kernel's RMSNorm and LayerNorm (after torch's add), its fused add + RMSNorm,
  and, in the GPT step, its norms patched into the naive model (`liger_patch`, as its
  `apply_liger_kernel_to_llama` patches a Llama's);
- flash_attn: flash-attention's Triton `layer_norm_fn`, the residual fused;
- quack: quack's `rmsnorm` (after torch's add).

torch eager and torch.compile of the naive form are `bench.py gpu`'s own baselines.
GPU machines may have no network: `make peer-wheels` downloads the pure-Python peers'
wheels (Liger-Kernel: Python and Triton) into peer-wheels/, which `make gpu-check`
installs from with no index when the folder is there. flash-attention and quack build or
ship compiled code: install them on the GPU machine itself to have them measured.
"""
from __future__ import annotations

import importlib
import types

# name -> (the module that must import, what is measured)
PEERS = {
    "liger": ("liger_kernel.transformers.functional",
              "Liger-Kernel: RMSNorm, LayerNorm, fused add + RMSNorm; its norms in the GPT step"),
    "flash_attn": ("flash_attn.ops.triton.layer_norm", "flash-attention: Triton layer_norm_fn, residual fused"),
    "quack": ("quack.rmsnorm", "quack: rmsnorm (rms only)"),
}


def find() -> dict[str, dict]:
    """Every peer: {'module', 'what', 'found': bool, 'detail': its version, or why it is missing}."""
    out = {}
    for name, (module, what) in PEERS.items():
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # not installed, or installed without what it needs (a CUDA extension, a GPU)
            out[name] = dict(module=module, what=what, found=False, detail=f"{type(e).__name__}: {str(e)[:100]}")
            continue
        top = importlib.import_module(module.split(".")[0])
        version = getattr(top, "__version__", None) or getattr(mod, "__version__", "version unknown")
        out[name] = dict(module=module, what=what, found=True, detail=str(version))
    return out


def describe(found: dict[str, dict]) -> str:
    """One line per peer: found (version) or missing (why)."""
    return "\n".join(f"  {name}: {'found ' + p['detail'] if p['found'] else 'missing (' + p['detail'] + ')'}"
                     f" - {p['what']}" for name, p in found.items())


def norm_fns(kind: str, found: dict[str, dict]) -> dict:
    """name -> fn(x, r, w) returning (out, x + r), for the peers found that compute `kind`."""
    fns = {}
    if found.get("liger", {}).get("found"):
        from liger_kernel.transformers import functional as lf

        def liger(x, r, w):
            p = x + r
            if kind == "rms":
                return lf.liger_rms_norm(p, w, 1e-6), p
            return lf.liger_layer_norm(p, w, w.new_zeros(w.shape), 1e-6), p

        fns["liger"] = liger
        if kind == "rms":
            fns["liger_fused_add"] = lambda x, r, w: lf.liger_fused_add_rms_norm(x, r, w, 1e-6, in_place=False)
    if found.get("flash_attn", {}).get("found"):
        from flash_attn.ops.triton.layer_norm import layer_norm_fn

        def flash(x, r, w):
            return layer_norm_fn(x, w, None, residual=r, eps=1e-6, prenorm=True, is_rms_norm=kind == "rms")

        fns["flash_attn"] = flash
    if found.get("quack", {}).get("found") and kind == "rms":
        from quack.rmsnorm import rmsnorm

        def quack(x, r, w):
            p = x + r
            return rmsnorm(p, w, eps=1e-6), p

        fns["quack"] = quack
    return fns


def liger_patch(model) -> int:
    """Run every norm of a naive fuseblock stack (its AddNorm modules' `naive`) through
    Liger-Kernel's RMSNorm / LayerNorm, with the module's own parameters, as Liger's
    `apply_liger_kernel_to_*` patches a Hugging Face model's norms. Returns the count."""
    from liger_kernel.transformers import functional as lf

    from fuseblock import AddNorm

    def naive(self, x):
        if self.kind == "rms":
            return lf.liger_rms_norm(x, self.weight, self.eps, offset=self.weight_offset)
        bias = self.bias if self.bias is not None else self.weight.new_zeros(self.weight.shape)
        return lf.liger_layer_norm(x, self.weight, bias, self.eps)

    n = 0
    for m in model.modules():
        if isinstance(m, AddNorm):
            m.naive = types.MethodType(naive, m)
            n += 1
    return n
