"""The warp width the launchers divide threads by is the one Triton runs (issue 44, item 14):
32 on NVIDIA; on AMD 64 on CDNA (gfx9) and 32 on RDNA (gfx10 and later), where a fixed 64
launched half the threads each layout was chosen for. Read from GPU 0's arch, here patched."""
import types

import pytest
import torch

from fuseblock.kernels import launch


@pytest.mark.parametrize("arch,warp", [("gfx942:sramecc+:xnack-", 64), ("gfx950", 64), ("gfx90a:xnack-", 64),
                                       ("gfx1030", 32), ("gfx1100", 32), ("gfx1201", 32)])
def test_amd_warp_width_follows_the_arch(monkeypatch, arch, warp):
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(gcnArchName=arch))
    assert launch.gpu_warp() == warp
    monkeypatch.setattr(launch, "WARP", launch.gpu_warp())
    assert launch.warps(256) == 256 // warp  # a 256-thread program: 4 wavefronts of 64, 8 of 32


def test_nvidia_warps_are_32_wide(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert launch.gpu_warp() == 32
