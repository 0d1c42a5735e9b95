"""scripts/bench.py runs in its quick mode and its tables say what the targets say."""
import json
import os
import subprocess
import sys

import pytest
from trainutil import ROOT


def _run_bench(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *args],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, check=True)
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def _bench(*args):
    return _run_bench(*args, "--quick", "--json")


def test_traffic_quick():
    # every op is held at the minimum by test_traffic; here the script end to end, on two ops
    rows = _bench("traffic", "--ops", "add_norm,post_gate_residual")
    assert len(rows) == 2 * 2 * 2 * 3  # ops x dtypes x row counts x (fwd, bwd, fwd+bwd)
    for r in rows:
        # the backward is _bwd_tile and _bwd_sum (several programs' partial rows of dw), no torch op
        assert r["act_over_min"] == 1.0 and r["launches"] == {"fwd": 1, "bwd": 2, "fwd+bwd": 3}[r["pas"]]
        assert r["glue_ops"] == 0
        assert 1.0 <= r["kernel_over_min"] < 1.1
        assert r["naive_over_kernel"] > 1.5  # the naive composition moves more
        assert r["kernel_MB"] >= r["min_MB"] and r["naive_MB"] >= r["min_MB"]
    assert {r["rows"] for r in rows} == {256, 2048} and {r["d"] for r in rows} == {256}


def test_memory_quick_fused_saves_no_more():
    rows = _bench("memory")
    for norm in ("rms", "layer"):
        by = {r["impl"]: r for r in rows if r["norm"] == norm}
        assert 0 < by["fused"]["bytes_per_layer_per_token"] <= by["naive"]["bytes_per_layer_per_token"]
        # a layer keeps at least its two norm inputs (d fp32 each) and at most a few dozen d
        assert 2 <= by["fused"]["in_units_of_d_fp32"] < 64


def test_speed_quick_runs():
    rows = _bench("speed", "--repeats", "2")
    assert {r["impl"] for r in rows} == {"naive", "fused"} and all(r["median_ms"] > 0 for r in rows)
    for r in rows:  # the spread over the two runs
        assert r["runs"] == 2 and 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["speedup_min"] <= r["speedup_vs_naive"] <= r["speedup_max"]


@pytest.mark.slow
def test_gpu_code_path_smoke_run_on_cpu(tmp_path):
    # the GPU benchmark's own code at toy sizes on the CPU, torch.compile included
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "gpu", "--device", "cpu", "--d", "64",
                        "--rows", "32", "--out", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    bw = [r for r in rows if r["kind"] in ("rms", "layer")]
    assert len(bw) == 2 and not any(k.endswith("_error") for r in rows for k in r)
    for r in bw:
        assert all(r[f"{impl}_{pas}_TBps"] > 0 for impl in ("fuseblock", "eager", "compile") for pas in ("fwd", "bwd"))
    assert rows[-1]["naive"] > 0 and rows[-1]["fused"] > 0  # GPT step ms
    assert {f.name for f in tmp_path.iterdir()} == {"gpu.md", "gpu.json", "gpu_rms.png", "gpu_layer.png"}


def test_gpu_without_cuda_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "gpu"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0 and "no CUDA" in p.stdout


def test_sm90_quick_persistent_grids_fit_one_wave():
    rows = _bench("sm90")
    assert {r["d"] for r in rows} == {1024, 65536} and {r["kind"] for r in rows} == {"rms", "layer"}
    assert {r["kernel"] for r in rows} == {"_fwd_tile", "_bwd_tile", "_bwd_sum", "_fwd_loop", "_bwd_dots",
                                           "_bwd_cols"}
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["resident_per_sm"] >= 1
        # persistent: once the launch knows what fits, one wave at most (_fwd_tile has a
        # program per row block, _bwd_sum one per column chunk)
        if r["kernel"] not in ("_fwd_tile", "_bwd_sum"):
            assert r["waves"] <= 1.0 and r["waves"] <= r["waves_first"]


def test_overhead_quick_times_the_host_side_alone():
    rows = _bench("overhead")
    assert {r["kind"] for r in rows} == {"rms", "layer"}
    for r in rows:  # the eager step includes both launchers, plus autograd and argument checks
        assert 0 < r["launcher_fwd_us"] and 0 < r["launcher_bwd_us"]
        assert r["eager_fwd_bwd_us"] > r["launcher_fwd_us"] + r["launcher_bwd_us"]


def test_traffic_options_before_the_subcommand_measure_the_kernels():
    # bench.py once chose the interpreter from argv[1]: `--quick traffic` ran the torch
    # path (0 launches) and reported it as the kernels' traffic
    args = ["--ops", "add_norm", "--rows", "64", "--d", "64"]
    first = _run_bench("--quick", "--json", *args, "traffic")
    # 64 rows: one backward program, which writes dw itself (no _bwd_sum)
    assert len(first) == 2 * 3 and all(r["launches"] == (2 if r["pas"] == "fwd+bwd" else 1) for r in first)
    assert all(r["act_over_min"] == 1.0 for r in first)
    assert first == _run_bench("traffic", *args, "--quick", "--json")


def test_unknown_ops_are_a_usage_error():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--ops", "add_norm,nope", "traffic"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and "--ops: unknown ['nope']" in p.stderr


def test_cpu_bench_takes_do_benchs_budgets_in_ms(monkeypatch):
    # gpu --device cpu times with cpu_bench where a GPU uses triton's do_bench: warmup and
    # rep are budgets in ms, turned into call counts from the mean of 5 timed calls
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchmarks import common

    clock = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])
    w = torch.zeros(3, requires_grad=True)
    seen = []

    def fn():  # 0.5 s a call, exact in binary; records whether the gradient was cleared
        clock[0] += 0.5
        seen.append(w.grad is None)
        w.grad = torch.ones(3)

    ms = common.cpu_bench(fn, warmup=1500, rep=2500, grad_to_none=[w])
    assert ms == 500.0
    assert len(seen) == 1 + 5 + 3 + 5  # untimed first call, 5 to estimate, then 1500 and 2500 ms of calls
    assert seen[-5:] == [True] * 5  # cleared before each timed call
    assert common.cpu_bench(fn, warmup=0, rep=0) == 500.0  # at least one call of each
