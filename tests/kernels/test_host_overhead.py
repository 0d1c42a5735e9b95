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
    # re-deriving specs, layouts and views per call; 78 after.
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
    assert 20 < len(frames) <= 100, sorted(frames)


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
