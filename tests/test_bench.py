"""scripts/bench.py runs in its quick mode and its tables say what the targets say."""
import json
import os
import subprocess
import sys

import pytest
from trainutil import ROOT


def _bench(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *args, "--quick", "--json"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, check=True)
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_traffic_quick():
    rows = _bench("traffic")
    assert len(rows) == 6 * 2 * 2  # ops x dtypes x passes
    for r in rows:
        assert r["launches"] == 1 and r["kernel_over_min"] == pytest.approx(1.0)
        assert r["naive_over_kernel"] > 1.5  # the naive composition moves more
    add_norm = [r for r in rows if r["op"] == "add_norm"]
    assert sum(r["naive_MB"] for r in add_norm) / sum(r["kernel_act_MB"] + r["other_MB"] for r in add_norm) >= 1.5


def test_memory_quick_fused_saves_no_more():
    rows = _bench("memory")
    for norm in ("rms", "layer"):
        by = {r["impl"]: r["saved_MB"] for r in rows if r["norm"] == norm}
        assert by["fused"] <= by["naive"]


def test_speed_quick_runs():
    rows = _bench("speed")
    assert {r["impl"] for r in rows} == {"naive", "fused"} and all(r["median_ms"] > 0 for r in rows)


def test_gpu_without_cuda_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "gpu"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0 and "no CUDA" in p.stdout
