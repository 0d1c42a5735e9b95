"""Every launcher entry makes its tensors' GPU current before it launches (issue 44, item 4).

Triton launches on the current device and its current stream, not on the tensors': with
tensors on cuda:1 and cuda:0 current a launch crashes, or with peer access runs on GPU 0's
stream, unordered with GPU 1's work. `launch.on_device` guards each entry. No second GPU
is needed to see its choice: a tensor that claims to live on cuda:1, the current-device
query answering 0, and `torch.cuda.device` recording the device it is asked for (and
stopping there, before anything launches).

The entries are found in the source, as the ops (and `fuseblock.serve`) call them
(`kernels("norm", x).norm_fwd(...)`): a new entry without the guard fails here.
"""
import contextlib
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

import fuseblock
from fuseblock.kernels import launch

SOURCES = Path(fuseblock.__file__).parent
CALL = re.compile(r"""kernels\(\s*["'](\w+)["']\s*,\s*\w+\s*\)\s*\.\s*(\w+)""")


def entries() -> list[tuple[str, str]]:
    """(kernel module, function) of every launcher the library calls through `kernels(...)`."""
    found = set()
    for path in SOURCES.rglob("*.py"):
        found.update(CALL.findall(path.read_text()))
    return sorted(found)


ENTRIES = entries()


class OnGpu1(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1 (what the guard reads)."""

    @property
    def is_cuda(self):
        return True

    def get_device(self):
        return 1


class Switched(Exception):
    pass


@pytest.fixture
def gpus(monkeypatch):
    """The current device (settable) and the devices the guard switched to: the switch
    raises Switched, so that nothing past it runs."""
    state = {"current": 0, "set": []}
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: state["current"], raising=False)

    @contextlib.contextmanager
    def device(index):
        state["set"].append(index)
        raise Switched
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    return state


def test_the_library_calls_every_kernel_family_through_an_entry():
    assert {"norm_fwd", "norm_bwd", "norm_add_fwd", "norm_add_bwd", "embed_norm_fwd", "embed_norm_bwd",
            "channel_norm_fwd", "channel_norm_bwd", "hyper_fwd", "hyper_bwd"} <= {f for _, f in ENTRIES}


@pytest.mark.parametrize("module,name", ENTRIES)
def test_every_entry_makes_the_tensors_device_current(gpus, module, name):
    fn = getattr(importlib.import_module(f"fuseblock.kernels.{module}"), name)
    assert hasattr(fn, "device_arg"), f"{module}.{name} has no device guard (fuseblock.kernels.launch.on_device)"
    required = [p for p in inspect.signature(fn).parameters.values() if p.default is p.empty]
    args = [None] * len(required)  # the guard is the entry's first statement: it reads only its tensor
    args[fn.device_arg] = torch.zeros(2, 8).as_subclass(OnGpu1)
    with pytest.raises(Switched):
        fn(*args)
    assert gpus["set"] == [1]


def test_the_guard_switches_only_off_the_current_device(gpus):
    ran = []

    @launch.on_device(1)
    def launcher(a, t, *, k=None):
        if t.is_cuda and t.get_device() != torch._C._cuda_getDevice():  # the entries' guard, as they write it
            return launch.on_its_device(launcher, t, locals())
        ran.append((a, t, k))
        return "launched"

    t = torch.zeros(3).as_subclass(OnGpu1)
    gpus["current"] = 1  # already current: no switch, the launcher runs with its arguments
    assert launcher("a", t, k=2) == "launched" and gpus["set"] == [] and ran == [("a", t, 2)]
    cpu = torch.zeros(3)  # a CPU tensor (the interpreter): no device query, no switch
    gpus["current"] = 0
    assert launcher("a", cpu) == "launched" and gpus["set"] == []
    with pytest.raises(Switched):  # off the current device: switch to it before anything runs
        launcher("a", t)
    assert gpus["set"] == [1] and len(ran) == 2


def test_an_entry_without_the_guard_is_refused():
    with pytest.raises(TypeError, match="starts with the device guard"):
        launch.on_device(0)(lambda x: x)
