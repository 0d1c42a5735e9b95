"""The host's work around each kernel-path launch, which bounds small calls on a GPU
(`bench.py overhead`): a repeated call re-derives nothing it already worked out.

The launches are recorded rather than run (`captured_launches`, CPU tensors sent to the
launchers by `kernels_on_cpu`), so what is counted is fuseblock's own work: this needs the
JIT kernels themselves, not the interpreter's.
"""
import os
import sys

import pytest
import torch

import fuseblock
from fuseblock.kernels import launch
from fuseblock.ops.dispatch import kernels_on_cpu
from fuseblock.testing.targets import captured_launches

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="records the JIT kernels' launches")

ROOT = os.path.dirname(fuseblock.__file__)


def _leaves(d=64):
    x = torch.randn(8, d, device="cpu", requires_grad=True)
    return x, torch.randn_like(x, requires_grad=True), torch.randn(d, device="cpu", requires_grad=True)


def _steps():
    """add_norm and norm_add forward + backward, as a training step runs them."""
    x, r, w = _leaves()

    def add_norm():
        out, res = fuseblock.add_norm(x, r, w)
        torch.autograd.grad((out, res), [x, r, w], (out, res))

    def norm_add():
        res = fuseblock.norm_add(x, r, w)
        torch.autograd.grad(res, [x, r, w], res)

    return {"add_norm": add_norm, "norm_add": norm_add}


@pytest.fixture
def recorded():
    from fuseblock.kernels import norm, norm_add

    with kernels_on_cpu(), captured_launches(norm, norm_add, launch) as got:
        yield got


@pytest.mark.parametrize("op", ["add_norm", "norm_add"])
def test_a_repeated_step_allocates_no_placeholders_and_packs_no_spec(recorded, monkeypatch, op):
    # The eager Function's absent outputs are None, not an empty tensor each (a custom op
    # needs those, eager code does not); a spec already packed is not packed again.
    import fuseblock.spec

    step = _steps()[op]
    step()
    assert recorded, "the launches were recorded"
    calls = []
    new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda *a, **k: calls.append("new_empty") or new_empty(*a, **k))
    pack = fuseblock.spec._pack
    monkeypatch.setattr(fuseblock.spec, "_pack", lambda v: calls.append("_pack") or pack(v))
    step()
    assert calls == []


def test_fuseblock_runs_few_python_calls_per_add_norm_step(recorded):
    # fuseblock's own Python calls in a forward + backward of add_norm (its frames only:
    # torch's autograd is counted by `bench.py overhead`). 161 before the launchers stopped
    # re-deriving specs, layouts and views per call; 78 after; 9 once a plain call is
    # validated and laid out once per signature (the fast lane, the launchers' plans).
    step = _steps()["add_norm"]
    step()
    frames = []

    def count(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(ROOT) and not name.startswith(os.path.join(ROOT, "testing")):
            frames.append(frame.f_code.co_name)

    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
    assert 0 < len(frames) <= 12, sorted(frames)


def test_a_gpus_sm_count_is_asked_once(monkeypatch):
    asked = []

    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(launch, "_CUDA_SMS", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: asked.append(device) or Props)
    assert [launch.num_sms(torch.device("cuda", 0)) for _ in range(3)] == [132] * 3
    assert len(asked) == 1
    launch.num_sms(torch.device("cuda"))  # the current device, whichever it is: asked each time
    launch.num_sms(torch.device("cuda"))
    assert len(asked) == 3


def test_a_layout_follows_the_constants_it_reads(monkeypatch):
    # layouts are kept per call shape, and keyed by the limits too, which tests shrink
    assert launch.fwd_layout(64).tile
    monkeypatch.setattr(launch, "MAX_TILE_FWD", 16)
    assert not launch.fwd_layout(64).tile
    monkeypatch.setattr(launch, "MAX_ROWS", 4)
    assert launch.bwd_layout(64).br == 4


def test_a_cached_call_still_refuses_what_resolve_refuses(recorded):
    # the fast lane validates a call once per signature; a call that differs in what resolve
    # checks (a residual of another shape, a weight on another dtype, eps) is checked anew
    x, r, w = _leaves()
    fuseblock.add_norm(x, r, w, eps=1e-6)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        fuseblock.add_norm(x, r[:, :32], w, eps=1e-6)
    with pytest.raises(ValueError, match=r"weight must have shape \(64,\)"):
        fuseblock.add_norm(x, r, w[:32], eps=1e-6)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        fuseblock.add_norm(x, r, w, eps=-1e-6)
    with pytest.raises(TypeError, match="weight must be a floating tensor"):
        fuseblock.add_norm(x, r, w.to(torch.int32), eps=1e-6)


def test_a_launch_laid_out_once_follows_the_constants_and_the_mode_it_read(recorded, monkeypatch):
    # a plan is keyed by the layout constants (tests shrink them), deterministic mode and
    # the occupancy learned: each change lays the launch out anew
    from fuseblock.kernels import norm as K
    from fuseblock.kernels import occupancy

    x, r, w = _leaves(d=64)
    x2, r2 = torch.randn(4096, 64, requires_grad=True), torch.randn(4096, 64, requires_grad=True)

    def step(a, b):
        recorded.clear()
        out, res = fuseblock.add_norm(a, b, w)
        torch.autograd.grad((out, res), [a, b, w], (out, res))
        return [(ln.name, ln.grid) for ln in recorded]

    assert [n for n, _ in step(x, r)] == ["_fwd_tile", "_bwd_tile"]
    monkeypatch.setattr(launch, "MAX_TILE_FWD", 16)
    monkeypatch.setattr(launch, "MAX_TILE_BWD", 16)
    assert [n for n, _ in step(x, r)] == ["fwd_loop", "bwd_dots", "bwd_cols"]
    monkeypatch.undo()
    free = step(x2, r2)
    assert [n for n, _ in free] == ["_fwd_tile", "_bwd_tile", "_bwd_sum"]
    monkeypatch.setattr(launch, "DETERMINISTIC_PROGRAMS", 3)
    torch.use_deterministic_algorithms(True)
    try:
        assert step(x2, r2)[1] == ("_bwd_tile", (3,))
    finally:
        torch.use_deterministic_algorithms(False)
    assert step(x2, r2) == free
    # a GPU's first launch teaches what fits (here 1 program an SM, at 255 registers a
    # thread): the plan made before it is not used after it
    from types import SimpleNamespace

    monkeypatch.setattr(occupancy, "_RESIDENT", {})
    monkeypatch.setattr(launch, "H100_SMS", 2)
    before = step(x2, r2)
    assert before[1] == ("_bwd_tile", (16,))  # 2 SMs x 8 programs of 256 threads (d = 64)
    variant = next(plan[4] for plan in K._BWD_PLANS.values() if plan[1] is not None and plan[2] == 16)
    occupancy.learn(x2.device, variant, SimpleNamespace(n_regs=255, metadata=SimpleNamespace(shared=0)), 8)
    assert step(x2, r2)[1] == ("_bwd_tile", (2,))


def test_the_tile_kernels_take_their_flags_folded_into_one_argument(recorded):
    # Triton's launcher binds and keys every argument on every launch: the tile kernels
    # take their eleven (nine) constexpr flags as one, FLAGS (40 arguments a launch of
    # _fwd_tile before, 42 of _bwd_tile). The per-channel scales added 3 to the forward (RS, BS,
    # rscale) and 11 to the backward (R, X, X1 and their strides, RS, BS, DRSP, DBSP, rscale),
    # passed as None / 1.0 on a plain call: the backward's 45 are more than its 42 before the fold
    x, r, w = _leaves()
    out, res = fuseblock.add_norm(x, r, w)
    torch.autograd.grad((out, res), [x, r, w], (out, res))
    passed = {ln.name: len(ln.args) + len([k for k in ln.kwargs if k != "num_warps"]) for ln in recorded}
    assert passed["_fwd_tile"] == 33 and passed["_bwd_tile"] == 45
    names = {ln.name: ln.fn.arg_names for ln in recorded}
    assert "FLAGS" in names["_fwd_tile"] and "HAS_R" not in names["_fwd_tile"] and "HAS_DRO" not in names["_bwd_tile"]


def test_norm_adds_fast_lane_follows_the_path_of_each_call():
    # a plain norm_add is validated once per signature; the path (torch's ops, or the kernels
    # kernels_on_cpu sends CPU tensors to) is the call's own: a signature first met on the
    # torch path then launches under kernels_on_cpu, and back
    from fuseblock.kernels import norm_add

    x, r, w = (t.detach() for t in _leaves(d=48))
    want = fuseblock.norm_add(x, r, w, eps=1e-6)  # the torch path
    with kernels_on_cpu(), captured_launches(norm_add, launch) as got:
        fuseblock.norm_add(x, r, w, eps=1e-6)
    assert [ln.name for ln in got] == ["_fwd_tile"]
    torch.testing.assert_close(fuseblock.norm_add(x, r, w, eps=1e-6), want, rtol=0, atol=0)
