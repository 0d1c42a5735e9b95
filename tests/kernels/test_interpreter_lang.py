"""Under TRITON_INTERPRET=1 the language is patched into the interpreter once per launch, not once per
helper call (fuseblock/testing/interpreter_lang.py, installed by tests/conftest.py), and the kernels
compute bit for bit what they compute with the interpreter's own per-call patching."""
import pytest
import torch
from helpers import INTERPRETED, generator

import fuseblock
from fuseblock.ops.dispatch import kernels_on_cpu

pytestmark = [pytest.mark.kernel, pytest.mark.kernel_only("the Triton interpreter's patching"),
              pytest.mark.skipif(not INTERPRETED, reason="the interpreter runs only under TRITON_INTERPRET=1 on CPU")]


def add_norm_step():
    g = generator(0)
    x, r = (torch.randn(8, 64, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(64, generator=g, requires_grad=True)
    with kernels_on_cpu():
        y, rr = fuseblock.add_norm(x, r, w)
        (y * torch.arange(64.0)).sum().add(rr.sum()).backward()
    return [t.detach() for t in (y, rr, x.grad, r.grad, w.grad)]


def test_each_launch_walks_the_language_once_not_once_per_helper_call(monkeypatch):
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "once_per_launch", False), "conftest did not install it"
    calls = {"walks": 0, "launches": 0}
    walk, launch = interpreter._patch_builtin, interpreter.GridExecutor.__call__

    def counted_walk(*args, **kwargs):
        calls["walks"] += 1
        return walk(*args, **kwargs)

    def counted_launch(*args, **kwargs):
        calls["launches"] += 1
        return launch(*args, **kwargs)

    add_norm_step()  # the first call of triton's own jit helpers (tl.sum) patches tl.core once a process
    monkeypatch.setattr(interpreter, "_patch_builtin", counted_walk)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted_launch)
    add_norm_step()
    assert calls["launches"] >= 2  # the forward and the backward ran through the interpreter
    # one walk of tl, tl.tensor, tl.math (and, in triton 3.9, the tensor descriptor) per launch; the
    # interpreter alone walks them again at each call of a helper (more than 300 walks here)
    assert calls["walks"] <= 4 * calls["launches"], calls


def test_the_kernels_compute_what_the_interpreters_own_patching_gives(monkeypatch):
    import triton.language as tl
    from triton.runtime import interpreter

    once = add_norm_step()
    assert tl.core.is_builtin(tl.program_id), "a launch left the language patched after it ended"
    again = add_norm_step()  # the next launch patches again, from scratch
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang.original)
    own = add_norm_step()
    for a, b, c in zip(once, again, own, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
