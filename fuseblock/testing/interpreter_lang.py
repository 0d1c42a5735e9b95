"""Patch Triton's language into its interpreter once per launch, not once per helper call (for tests).

Why: under TRITON_INTERPRET=1, every call of a nested `@triton.jit` helper (`_rstd`, `_load_p`, ...)
runs `triton.runtime.interpreter._patch_lang` again, which walks every member of `triton.language`,
`tl.tensor` and `tl.math` (`inspect.getmembers`) to wrap the builtins for the interpreter. The
launch has already done that for the whole grid (triton 3.9 patches at the launch and restores after
it; triton 3.1 patches and never restores), so each helper call repeats work whose result is
already in place: about a third of the CPU time of a small add_norm forward + backward
(tests/kernels/test_interpreter_lang.py measures the walks). `install()` makes `_patch_lang` skip a
function whose languages are patched already; a launch still patches on entry and, on triton 3.9,
restores on exit, so what the kernels compute is unchanged.
"""
from __future__ import annotations

import importlib.util
import inspect
import os


def install() -> None:
    """Under TRITON_INTERPRET=1, make this process's interpreter patch its language once per launch
    (idempotent; tests/conftest.py and the workers the tests start call it)."""
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    if getattr(original, "once_per_launch", False):
        return
    patched: set[int] = set()  # the ids of the language modules whose patch is in effect
    seen: dict[int, frozenset[int]] = {}  # a module's globals -> the language modules among them

    def patch_lang(fn):
        langs = seen.get(id(fn.__globals__))
        if langs is None:
            langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
            seen[id(fn.__globals__)] = langs
        if langs and langs <= patched:
            # in effect already: an empty scope (3.9: nothing to restore) or None, as the original gives
            return interpreter._LangPatchScope() if hasattr(interpreter, "_LangPatchScope") else None
        scope = original(fn)
        patched.update(langs)
        if scope is not None:  # triton 3.9: the launch restores the language when its grid ends
            restore = scope.restore

            def restore_and_forget():
                restore()
                patched.difference_update(langs)

            scope.restore = restore_and_forget
        return scope

    patch_lang.once_per_launch = True
    patch_lang.original = original
    interpreter._patch_lang = patch_lang
