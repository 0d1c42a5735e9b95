"""scripts/bench.py runs in its quick mode and its tables say what the targets say."""
import json
import os
import sys

import pytest
import timeouts
from trainutil import ROOT


def _run_bench(*args, stderr=None):
    """The JSON rows bench.py printed; stderr: a list that gets what it wrote there."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = timeouts.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *args],
                     capture_output=True, text=True, seconds=600, env=env, cwd=ROOT, check=True)
    if stderr is not None:
        stderr.append(p.stderr)
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def _bench(*args, stderr=None):
    return _run_bench(*args, "--quick", "--json", stderr=stderr)


def _main_here(monkeypatch, capsys, *args):
    """bench.py's main() in this process (no interpreter start-up, seconds of imports for
    each): its exit status (argparse's usage errors exit 2), stdout and stderr."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    # main() sets TRITON_INTERPRET for the interpreted subcommands: put back as it was after the test
    was = os.environ.get("TRITON_INTERPRET")
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", was or "")
    if was is None:
        monkeypatch.delitem(os.environ, "TRITON_INTERPRET")
    spec = importlib.util.spec_from_file_location("_bench_script", ROOT / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    capsys.readouterr()
    code = 0
    try:
        bench.main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


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
    stderr = []
    rows = _bench("memory", stderr=stderr)
    assert "USDT:" not in stderr[0]  # the profiler's trace lines, 16 of them, are held back
    for norm in ("rms", "layer"):
        by = {r["impl"]: r for r in rows if r["norm"] == norm}
        assert 0 < by["fused"]["bytes_per_layer_per_token"] <= by["naive"]["bytes_per_layer_per_token"]
        # a layer keeps at least its two norm inputs (d fp32 each) and at most a few dozen d
        assert 2 <= by["fused"]["in_units_of_d_fp32"] < 64


def test_speed_quick_runs(monkeypatch):
    rows = _bench("speed")
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchmarks import speed

    assert set(rows[0]) - {"impl"} == set(speed.COLUMNS)  # the table's legend explains every measured column
    assert {r["impl"] for r in rows} == {"naive", "fused"} and all(r["median_ms"] > 0 for r in rows)
    for r in rows:  # the spread over the default three runs
        assert r["runs"] == 3 and 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["speedup_min"] <= r["speedup_vs_naive"] <= r["speedup_max"]


def test_gpt_step_quick_on_cpu_times_four_contenders_of_each_model():
    # the GPU benchmark's own code on toy models (GPT-2's and the Llama's), torch.compile included
    rows = _bench("gpt-step", "--device", "cpu")
    impls = ["naive", "naive+compile", "fused", "fused+compile"]
    assert [(r["model"], r["impl"]) for r in rows] == [(m, i) for m in ("gpt2", "llama") for i in impls]
    for r in rows:
        assert r["runs"] == 3 and 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["tokens_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["median_ms"] * 1e3)
        assert r["steps_per_s"] == pytest.approx(1e3 / r["median_ms"])
        assert r["steps_per_s_min"] == pytest.approx(1e3 / r["max_ms"])
        assert r["steps_per_s_max"] == pytest.approx(1e3 / r["min_ms"])
        assert r["speedup_min"] <= r["speedup_vs_naive"] <= r["speedup_max"]
        assert "peak_mib" not in r  # torch.cuda's memory counters: a GPU's figure alone
    assert rows[0]["speedup_vs_naive"] == rows[4]["speedup_vs_naive"] == 1.0
    assert {(r["n_layer"], r["n_embd"]) for r in rows[4:]} == {(2, 64)}  # the Llama's toy shape


def test_gpt_step_llama_fused_and_naive_are_one_function(monkeypatch):
    # the two Llama contenders gpt-step compares: same seed, same weights, same loss and gradients
    # (the torch path here; the kernel path is the stream's own tests'), against the model by hand
    import torch
    import torch.nn.functional as F

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchmarks import gpt_step

    shape = gpt_step.LLAMA_TOY
    idx, targets = (torch.randint(0, shape["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(s))
                    for s in (1, 2))
    models = {k: gpt_step._contender(k, "llama", shape, torch.device("cpu"))[0] for k in ("naive", "fused")}
    losses, grads = {}, {}
    for k, m in models.items():
        losses[k] = m(idx, targets)[1]
        losses[k].backward()
        grads[k] = {n: p.grad for n, p in m.named_parameters()}
    m = models["naive"]  # by hand: x + attn(rms(x)), then + w2(silu(g) * u) of rms, final rms, head
    x = m.tok(idx).double()
    for i in range(shape["n_layer"]):  # the stack's blocks: attention, then SwiGLU, each layer
        for blk in m.stack.blocks[2 * i:2 * i + 2]:
            h = F.rms_norm(x, (shape["n_embd"],), blk.norm.weight.double(), 1e-5)
            x = x + blk.mixer(h.float()).double()
    logits = m.lm_head(F.rms_norm(x, (shape["n_embd"],), m.stack.norm_f.weight.double(), 1e-5).float())
    want = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    assert losses["naive"].item() == pytest.approx(want.item(), rel=1e-5)
    assert losses["fused"].item() == pytest.approx(losses["naive"].item(), rel=1e-5)
    # per layer: c_attn, c_proj, w13, w2, two norms; then embedding, head, final norm
    assert grads["fused"].keys() == grads["naive"].keys() and len(grads["naive"]) == 6 * shape["n_layer"] + 3
    for n, g in grads["naive"].items():
        torch.testing.assert_close(grads["fused"][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_gpt_step_model_flag_is_checked():
    p = timeouts.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "gpt-step", "--model", "gpt3"],
                     capture_output=True, text=True, seconds=60, cwd=ROOT)
    assert p.returncode == 2 and "--model: invalid choice: 'gpt3'" in p.stderr


@pytest.mark.slow
def test_gpu_code_path_smoke_run_on_cpu(tmp_path):
    # the GPU benchmark's own code at toy sizes on the CPU, torch.compile included
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = timeouts.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "gpu", "--device", "cpu", "--d", "64",
                      "--rows", "32", "--out", str(tmp_path), "--json"],
                     capture_output=True, text=True, seconds=600, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    bw = [r for r in rows if "fuseblock_fwd_TBps" in r]  # the bandwidth rows; then the small-row latency's
    latency = [r for r in rows if "fuseblock_fwd_us" in r]
    assert len(bw) == 2 and len(latency) == 2 and not any(k.endswith("_error") for r in rows for k in r)
    for r in bw:
        assert all(r[f"{impl}_{pas}_TBps"] > 0 for impl in ("fuseblock", "fuseblock-deterministic", "eager", "compile")
                   for pas in ("fwd", "bwd"))
    for r in latency:
        assert all(r[f"{impl}_{pas}_us"] > 0 for impl in ("fuseblock", "eager") for pas in ("fwd", "bwd"))
    # the fp8 rows: fused add_norm + cast against norm-then-cast, codes equal bit for bit
    fp8 = [r for r in rows if r.get("op", "").startswith("add_norm+")]
    assert [r["op"] for r in fp8] == ["add_norm+fp8_row", "add_norm+mxfp8"]
    assert all(r["codes_equal"] is True and r["fused_fwd_GBps"] > 0 and r["unfused_fwd_GBps"] > 0 for r in fp8)
    # the mHC boundary: fused against the unfused torch form (no compile on the CPU)
    hyper = [r for r in rows if r.get("op") == "hc_add_norm"]
    assert len(hyper) == 1 and all(hyper[0][f"{impl}_{pas}_GBps"] > 0 for impl in ("fused", "eager")
                                   for pas in ("fwd", "bwd"))
    assert hyper[0]["x_eager_fwd"] == hyper[0]["fused_fwd_GBps"] / hyper[0]["eager_fwd_GBps"]
    assert {f.name for f in tmp_path.iterdir()} == {"gpu.md", "gpu.json", "gpu_latency.json", "gpu_fp8.json",
                                                    "gpu_hyper.json", "peers.json", "gpu_rms.png", "gpu_layer.png"}


def test_gpu_compiles_afresh_for_each_shape(monkeypatch):
    # one compiled function reused across shapes turns dynamic after the first (slower,
    # shape-generic kernels): each row must reset dynamo and compile anew with dynamic=False
    import types

    import torch

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchmarks import gpu

    events = []

    def fake_compile(fn, dynamic=None, **kw):
        n = sum(e[0] == "compile" for e in events)
        events.append(("compile", dynamic))

        def compiled(*a):
            events.append(("call", n))
            return fn(*a)

        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: events.append(("reset",)))
    args = types.SimpleNamespace(no_compile=False, rows=[4])

    def once(fn, **kw):
        fn()
        return 1.0

    for d in (8, 16):
        row = gpu._bandwidth_row("rms", d, args, torch.device("cpu"), once, {})  # no peers on the CPU
        assert row["compile_fwd_TBps"] > 0 and row["compile_bwd_TBps"] > 0
    assert [e for e in events if e[0] != "call"] == [("reset",), ("compile", False)] * 2
    first, second = events.index(("compile", False)), len(events) - 1 - events[::-1].index(("compile", False))
    assert {e for e in events[first:second] if e[0] == "call"} == {("call", 0)}  # d = 8 on the first
    assert {e for e in events[second:] if e[0] == "call"} == {("call", 1)}  # d = 16 on its own


def test_gpu_without_cuda_says_so(monkeypatch, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    code, out, _ = _main_here(monkeypatch, capsys, "gpu")
    assert code == 0 and "no CUDA" in out


def test_sm90_quick_persistent_grids_fit_one_wave():
    rows = _bench("sm90")
    assert {r["d"] for r in rows} == {1024, 65536} and {r["kind"] for r in rows} == {"rms", "layer"}
    assert {r["kernel"] for r in rows} == {"_fwd_tile", "_bwd_tile", "_bwd_sum", "fwd_loop", "bwd_dots",
                                           "bwd_cols"}
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["resident_per_sm"] >= 1
        # persistent: once the launch knows what fits, one wave at most (_fwd_tile has a
        # program per row block, _bwd_sum one per column chunk)
        if r["kernel"] not in ("_fwd_tile", "_bwd_sum"):
            assert r["waves"] <= 1.0 and r["waves"] <= r["waves_first"]


def test_overhead_quick_times_the_host_side_alone():
    rows = _bench("overhead")
    torch_rows = [r for r in rows if r.get("path") == "torch"]
    op_rows = [r for r in rows if r.get("path") == "ops"]
    rows = [r for r in rows if r.get("path") not in ("torch", "ops")]
    # per op, on the CPU (no GPU here): its launches recorded, calls counted and timed
    assert [r["op"] for r in op_rows] == ["add_norm", "add_norm_layer", "norm", "norm_add"]
    for r in op_rows:
        assert r["device"] == "cpu"
        for form in ("", "eager_"):
            assert 0 < r[f"{form}fwd_calls"] < r[f"{form}fwd_bwd_calls"]
            assert 0 < r[f"{form}fwd_us"] and 0 < r[f"{form}fwd_bwd_us"]
    # issue 42's budget for an eager add_norm (40 and 120), against the naive form's 18 and 84
    # (126 and 251 before the fast lane and the launchers' plans)
    add_norm = op_rows[0]
    assert add_norm["fwd_calls"] <= 40 and add_norm["fwd_bwd_calls"] <= 120, add_norm
    # norm_add's fast lane: 53 and 169 (138 and 263 before it), against the naive form's 18 and 60
    norm_add = op_rows[3]
    assert norm_add["fwd_calls"] <= 60 and norm_add["fwd_bwd_calls"] <= 175, norm_add
    assert {r["kind"] for r in rows} == {"rms", "layer"}
    assert sorted((r["kind"], r["form"]) for r in torch_rows) == [
        ("layer", "function"), ("layer", "module"), ("rms", "function"), ("rms", "module")]
    for r in torch_rows:  # the torch path against the naive form, side by side
        assert r["fused_min_us"] <= r["fused_us"] <= r["fused_max_us"]
        assert r["naive_min_us"] <= r["naive_us"] <= r["naive_max_us"]
        assert r["ratio_min"] <= r["fused_over_naive"] <= r["ratio_max"]
    for r in rows:  # the eager step includes both launchers, plus autograd and argument checks
        assert 0 < r["launcher_fwd_us"] and 0 < r["launcher_bwd_us"]
        assert r["eager_fwd_bwd_us"] > r["launcher_fwd_us"] + r["launcher_bwd_us"]
        assert 0 < r["serve_us"] and 0 < r["train_fwd_us"]


def test_overhead_ops_picks_the_per_op_rows():
    rows = _bench("overhead", "--ops", "norm", "--device", "cpu")
    assert [(r["op"], r["path"]) for r in rows] == [("norm", "ops")]


def test_overhead_unknown_ops_are_a_usage_error(monkeypatch, capsys):
    code, _, err = _main_here(monkeypatch, capsys, "--ops", "nope", "overhead")
    assert code == 2 and "--ops: unknown ['nope']" in err


def test_traffic_options_before_the_subcommand_measure_the_kernels():
    # bench.py once chose the interpreter from argv[1]: `--quick traffic` ran the torch
    # path (0 launches) and reported it as the kernels' traffic
    args = ["--ops", "add_norm", "--rows", "64", "--d", "64"]
    first = _run_bench("--quick", "--json", *args, "traffic")
    # 64 rows: one backward program, which writes dw itself (no _bwd_sum)
    assert len(first) == 2 * 3 and all(r["launches"] == (2 if r["pas"] == "fwd+bwd" else 1) for r in first)
    assert all(r["act_over_min"] == 1.0 for r in first)
    assert first == _run_bench("traffic", *args, "--quick", "--json")


@pytest.mark.parametrize("what", ["traffic", "targets"])
def test_unknown_ops_are_a_usage_error(what, monkeypatch, capsys):
    code, _, err = _main_here(monkeypatch, capsys, "--ops", "add_norm,nope", what)
    assert code == 2 and "--ops: unknown ['nope']" in err


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


def _fake_bandwidth(override=None):
    """bench.py gpu rows for every d of the full run: fuseblock 2.8 TB/s, torch.compile 1.0,
    with override[(kind, d, column)] = value (None: the column missing)."""
    override = override or {}
    rows = []
    for kind in ("rms", "layer"):
        for d in [1 << k for k in range(10, 19)]:
            row = dict(kind=kind, d=d, rows=4096, fuseblock_fwd_TBps=2.8, fuseblock_bwd_TBps=2.8,
                       compile_fwd_TBps=1.0, compile_bwd_TBps=1.0)
            for (k, dd, col), v in override.items():
                if (k, dd) == (kind, d):
                    row.pop(col) if v is None else row.__setitem__(col, v)
            rows.append(row)
    return rows


def _fake_steps(naive=100.0, fused=94.0, naive_c=80.0, fused_c=80.0, naive_ro=70.0, fused_ro=70.0, model="gpt2",
                **more):
    """bench.py gpt-step rows of one model; more: other contenders' median ms (naive_liger=...)."""
    steps = (("naive", naive), ("naive+compile", naive_c), ("fused", fused), ("fused+compile", fused_c),
             ("naive+reduce-overhead", naive_ro), ("fused+reduce-overhead", fused_ro),
             *((k.replace("_", "+"), v) for k, v in more.items()))
    return [dict(model=model, impl=k, median_ms=v, min_ms=v, max_ms=v) for k, v in steps]


def _fake_latency(fuseblock_us=(20.0, 40.0), eager_us=(13.0, 17.0)):
    """bench.py gpu's latency rows (140 x 4096): fuseblock's and eager's fwd and bwd microseconds."""
    return [dict(kind=kind, rows=140, d=4096, fuseblock_fwd_us=fuseblock_us[0], fuseblock_bwd_us=fuseblock_us[1],
                 eager_fwd_us=eager_us[0], eager_bwd_us=eager_us[1]) for kind in ("rms", "layer")]


def test_gpu_report_judges_the_targets(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchmarks import gpu_report as R

    steps = _fake_steps() + _fake_steps(model="llama")
    verdicts = R.judge(_fake_bandwidth(), steps, _fake_latency())
    assert len(verdicts) == 16 and {v["verdict"] for v in verdicts} == {"PASS"}
    # d = 1024 is outside the bandwidth target but inside the torch.compile one
    by = {v["target"]: v for v in R.judge(
        _fake_bandwidth({("rms", 1024, "fuseblock_fwd_TBps"): 0.9,  # below compile's 1.0 only
                           ("layer", 65536, "fuseblock_bwd_TBps"): 2.69,  # just below 2.7, above compile
                           ("layer", 262144, "fuseblock_fwd_TBps"): None}),  # not measured: a FAIL
        _fake_steps(fused=100 / 1.04, fused_c=81.0)  # GPT-2 misses eager and compiled
        + _fake_steps(model="llama", fused_ro=71.0, naive_liger=90.0, fused=92.0),  # Llama: CUDA graphs, Liger
        _fake_latency(fuseblock_us=(30.0, 31.0)))}  # 61 against 30 us: just over 2x
    failed = {t for t, v in by.items() if v["verdict"] == "FAIL"}
    assert failed == {"rms fwd >= torch.compile, d 1024..262144", "layer bwd >= 2.7 TB/s, d 4096..262144",
                      "layer fwd >= 2.7 TB/s, d 4096..262144", "layer fwd >= torch.compile, d 1024..262144",
                      "gpt2 step fused >= 1.05x naive", "gpt2 step fused+compile >= 1.00x naive+compile",
                      "llama step fused+reduce-overhead >= 1.00x naive+reduce-overhead",
                      "llama step fused >= 1.00x naive+liger",
                      "rms add_norm fwd+bwd time <= 2.0x eager's, 140 x 4096",
                      "layer add_norm fwd+bwd time <= 2.0x eager's, 140 x 4096"}
    assert by["layer bwd >= 2.7 TB/s, d 4096..262144"]["falls_short"] == "d=65536: 2.69"
    assert by["layer fwd >= 2.7 TB/s, d 4096..262144"]["falls_short"] == "not measured at d=262144"
    assert by["rms fwd >= 2.7 TB/s, d 4096..262144"]["verdict"] == "PASS"
    assert by["gpt2 step fused >= 1.05x naive"]["falls_short"] == "1.040x"
    assert by["llama step fused >= 1.00x naive+liger"]["falls_short"] == "0.978x"
    assert "gpt2 step fused >= 1.00x naive+liger" not in by  # Liger judged only where it was measured
    assert by["rms add_norm fwd+bwd time <= 2.0x eager's, 140 x 4096"]["falls_short"] == "2.03x"
    assert len(by) == 17
    assert R.judge([], [])[0]["verdict"] == "FAIL"  # no figures at all (no GPU): never a pass
    # no Llama rows (a gpt-step of one model): its targets are FAILs, not left out
    missing = {v["target"]: v for v in R.judge(_fake_bandwidth(), _fake_steps(), _fake_latency())
               if v["verdict"] == "FAIL"}
    assert set(missing) == {f"llama step {a} >= {x:.2f}x {b}" for a, b, x in R.GPT_TARGETS}
    assert {v["falls_short"] for v in missing.values()} == {"not measured"}
    # rows from before --model (no model key) are GPT-2's
    old = [{k: v for k, v in r.items() if k != "model"} for r in _fake_steps(fused=100 / 1.04)]
    by = {v["target"]: v for v in R.judge([], old)}
    assert by["gpt2 step fused >= 1.05x naive"]["falls_short"] == "1.040x"
    # the fp8 rows' correctness: fused codes equal norm-then-cast's, else a FAIL (an error too)
    fp8 = R.fp8_verdicts([dict(op="add_norm+fp8_row", codes_equal=True), dict(op="add_norm+mxfp8", codes_equal=False),
                          dict(op="add_norm+mxfp8", error="OutOfMemoryError: ...")])
    assert [v["verdict"] for v in fp8] == ["PASS", "FAIL", "FAIL"] and "OutOfMemoryError" in fp8[2]["measured"]


def test_gpu_report_writes_one_report_and_fails_on_any_part_or_target(monkeypatch, tmp_path, capsys):
    import types

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchmarks import gpu_report as R

    monkeypatch.setattr(R, "environment", lambda: {"GPU": "NVIDIA H100 (fake)", "torch": "2.11.0"})
    monkeypatch.setattr(R, "gpu_present", lambda: True)
    (tmp_path / "gpu.json").write_text(json.dumps(_fake_bandwidth()))
    (tmp_path / "gpu_latency.json").write_text(json.dumps(_fake_latency()))
    (tmp_path / "gpt_step.log").write_text("a warning on stderr\n" + "\n".join(
        map(json.dumps, _fake_steps() + _fake_steps(model="llama"))))
    (tmp_path / "tests.log").write_text("tests/ops/test_norm.py ....\n=== short test summary info ===\n"
                                        "FAILED tests/ops/test_norm.py::test_x - AssertionError\n"
                                        "======= 1 failed, 599 passed, 3 skipped in 95.12s (0:01:35) =======\n")
    (tmp_path / "tile_fp32.json").write_text(json.dumps([dict(variant="post_gate", dtype="fp32", loop_over_tile=0.9)]))
    for part, rc in (("tests", 1), ("gpu", 0), ("gpt_step", 0), ("tile", 0)):
        (tmp_path / f"{part}.rc").write_text(f"{rc}\n")
    args = types.SimpleNamespace(out=str(tmp_path))
    with pytest.raises(SystemExit) as e:
        R.run(args)
    assert e.value.code == 1  # the tests failed, every target passed
    text = (tmp_path / "report.md").read_text()
    assert text in capsys.readouterr().out
    assert text.startswith("# make gpu-check\n\n**FAIL**: parts failed: tests; targets missed: 0 of 16.")
    assert "NVIDIA H100 (fake)" in text and "1 failed, 599 passed, 3 skipped in 95.12s (0:01:35)" in text
    assert "FAILED tests/ops/test_norm.py::test_x" in text and text.count("| PASS |") == 16
    assert "| llama | fused+compile | 80.0" in text.replace("80.000", "80.0")  # the GPT step table
    assert "| post_gate | fp32 | 0.9" in text  # the tile against the loop

    (tmp_path / "tests.rc").write_text("0\n")
    with pytest.raises(SystemExit) as e:
        R.run(args)
    assert e.value.code == 0 and "**PASS**" in (tmp_path / "report.md").read_text()

    (tmp_path / "gpt_step.rc").unlink()  # cut off before its status was written
    (tmp_path / "gpt_step.log").write_text("Traceback ...\n")
    with pytest.raises(SystemExit) as e:
        R.run(args)
    text = (tmp_path / "report.md").read_text()
    assert e.value.code == 1 and "parts failed: gpt_step; targets missed: 6 of 16" in text
    assert "| gpt_step |" in text and "not run" in text and "no rows (see gpt_step.log)" in text


def test_make_gpu_check_prints_its_commands():
    # PY given on the command line: no .venv install (the GPU image has no network)
    # --no-print-directory: under a parent make (CI's make test) it would print Entering/Leaving lines
    p = timeouts.run(["make", "--no-print-directory", "-n", "gpu-check", "PY=python"], capture_output=True, text=True,
                     seconds=60,
                     cwd=ROOT, check=True)
    lines = p.stdout.splitlines()
    # the one pip line installs the peers' wheels from a folder, never from an index
    assert not any(("pip" in ln and "--no-index" not in ln) or "venv" in ln for ln in lines)
    for command in ("FUSEBLOCK_TEST_DEVICE=cuda python -m pytest -m kernel tests/",
                    "python scripts/bench.py gpu --out out/gpu-check",
                    "python scripts/bench.py gpt-step --json",
                    "python tools/tile_vs_loop.py --dtype fp32 --json out/gpu-check/tile_fp32.json"):
        line = next(ln for ln in lines if command in ln)  # each part's status is kept, and make goes on
        assert "echo $? >out/gpu-check/" in line and "| tee out/gpu-check/" in line
    assert lines[-1] == "python scripts/bench.py gpu-report --out out/gpu-check"


def test_step_tables_say_what_each_column_is(capsys, monkeypatch):
    # --quick once showed fused slower in median_ms and faster in speedup_vs_naive (a median
    # of per-run ratios): the table is followed by what each column is
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchmarks import common, gpt_step, speed

    rows = [dict(impl="naive", runs=3, median_ms=10.0, speedup_vs_naive=1.0),
            dict(impl="fused", runs=3, median_ms=10.2, speedup_vs_naive=1.03)]
    common.emit(rows, False, speed.COLUMNS)
    out = capsys.readouterr().out
    assert out.startswith("| impl | runs | median_ms | speedup_vs_naive |")
    legend = out.split("\n\n", 1)[1].strip().splitlines()
    assert [ln.split(":")[0] for ln in legend] == ["- runs", "- median_ms", "- speedup_vs_naive"]
    assert "median over runs of (naive's step / this step) within the same run" in out
    common.emit(rows, True, speed.COLUMNS)
    assert [json.loads(ln) for ln in capsys.readouterr().out.splitlines()] == rows  # JSON: the rows alone
    assert set(gpt_step.COLUMNS) >= set(speed.COLUMNS) | {"steps_per_run"}


def test_help_says_which_subcommands_take_rows_and_d_and_that_traffic_is_slow():
    p = timeouts.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--help"], capture_output=True,
                     text=True, seconds=60, cwd=ROOT, check=True)
    text = " ".join(p.stdout.split())
    options = text[text.index("options:"):]  # past the usage line, which names them too
    rows_help = options[options.index("--rows ROWS"):options.index("--d D")]
    d_help = options[options.index("--d D"):]
    assert "traffic" in rows_help and "gpu" in rows_help
    assert all(name in d_help for name in ("traffic", "sm90", "gpu"))
    assert "about 23 minutes" in text and "--quick" in text


def test_stream_quick_fused_moves_fewer_hidden_stream_bytes_in_every_shape():
    from fuseblock.testing.stream_traffic import STREAM_SHAPES

    rows = _bench("stream", "--rows", "64", "--d", "128")
    assert [r["shape"] for r in rows[::3]] == STREAM_SHAPES  # every shape, in the table's order
    by = {(r["shape"], r["pas"]): r for r in rows}
    assert len(by) == len(rows) == 3 * len(STREAM_SHAPES)
    for shape in STREAM_SHAPES:
        fwd, bwd, both = (by[shape, pas] for pas in ("fwd", "bwd", "fwd+bwd"))
        for r in (fwd, both):
            assert 0 < r["fused_MB"] < r["untouched_MB"], r
        # one launch per join forward: two joins a layer, one for parallel (whose two branches
        # join at once); dropout's seed is drawn on the host
        assert fwd["fused_launches"] == {"parallel": 1}.get(shape, 2), fwd
        assert both["fused_MB"] == pytest.approx(fwd["fused_MB"] + bwd["fused_MB"])
        # post-norm's backward is level: norm_add passes the residual's gradient through, as the
        # untouched add does (it wrote a copy of it: 1.24x the untouched bytes), and its weight
        # gradient's partial rows are the rest (measured 1.014x at 128 x 256)
        assert bwd["fused_MB"] < (1.05 if shape == "post-norm" else 1.0) * bwd["untouched_MB"], bwd


@pytest.mark.parametrize("shape", ["pre-norm", "scaled", "parallel", "post-norm", "sandwich"])
def test_stream_layers_fused_and_untouched_compute_the_same(shape):
    # the two forms bench.py stream counts are one function (dropout: each its own masks)
    import torch

    from fuseblock.testing.stream_traffic import _leaves, layer, layer_inputs

    stream, branches, weights = layer_inputs(shape, 8, 64, torch.float32)
    leaves = _leaves(stream, branches, weights)
    fused, untouched = (layer(shape, stream, branches, weights, fused=f) for f in (True, False))
    assert len(fused) == len(untouched) == (2 if shape in ("parallel", "post-norm") else 3)
    grads = [torch.randn_like(t) for t in fused]
    for a, b in zip(fused, untouched, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(fused, leaves, grads), torch.autograd.grad(untouched, leaves, grads),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_targets_quick_reports_every_kernel_for_both_vendors_without_spills():
    from fuseblock.testing.targets import backend_problem

    problem = backend_problem("sm_90") or backend_problem("gfx942")
    if problem:
        pytest.skip(f"triton cannot compile for both vendors here: {problem}")
    rows = _bench("targets")
    assert {(r["target"], r["d"], r["op"]) for r in rows} == {
        (t, d, op) for t in ("sm_90", "gfx942") for d in (1024, 65536) for op in ("add_norm_layer", "norm_add_norm")}
    fields = {"target", "kernel", "d", "dtype", "registers", "spill_bytes", "shared", "resident_per_sm", "waves"}
    for r in rows:
        assert fields <= set(r) and r["dtype"] == "bfloat16"
        assert 0 < r["registers"] <= (255 if r["target"] == "sm_90" else 512) and r["resident_per_sm"] >= 1, r
        assert r["spill_bytes"] == 0 and r["fills"], r
    assert {r["kernel"] for r in rows if r["d"] == 65536 and r["op"] == "add_norm_layer"} == {
        "fwd_loop", "bwd_dots", "bwd_cols"}


def test_peer_discovery_says_which_peers_it_found_and_why_one_is_missing(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchmarks import peers

    monkeypatch.setattr(peers, "PEERS", {"present": ("json", "a module every Python has"),
                                         "absent": ("no_such_peer_module_xyz.ops", "a peer not installed")})
    found = peers.find()
    assert found["present"]["found"] and found["present"]["module"] == "json"
    assert not found["absent"]["found"] and "No module named 'no_such_peer_module_xyz'" in found["absent"]["detail"]
    text = peers.describe(found)
    assert "present: found" in text and "absent: missing (ModuleNotFoundError" in text
    assert peers.norm_fns("rms", found) == {}  # neither is a norm peer: nothing to measure


@pytest.mark.slow
def test_make_gpu_check_without_a_gpu_runs_what_it_can_and_exits_3(tmp_path):
    import torch
    from timeouts import run

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    out = tmp_path / "gpu-check"
    p = run(["make", "--no-print-directory", "gpu-check", f"PY={sys.executable}", f"GPU_OUT={out}",
             f"PEER_WHEELS={tmp_path / 'none'}"], seconds=300, capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "Error 3" in p.stderr  # make's own status; the report step's is 3
    assert "no kernel test can run" in (out / "tests.log").read_text()
    assert (out / "tests.rc").read_text().strip() == "3"
    assert "peers:" in (out / "gpu.log").read_text() and "no CUDA device" in (out / "gpu.log").read_text()
    assert "no CUDA device" in (out / "tile.log").read_text() and (out / "tile.rc").read_text().strip() == "0"
    text = (out / "report.md").read_text()
    assert text.startswith("# make gpu-check\n\n**NO GPU**: no CUDA device is present")
    assert "## Peers found" in text and "| liger |" in text
    assert "NO GPU: make gpu-check ran as far as it can without one (exit status 3)" in p.stdout


def test_fuse_blocks_quick_times_each_host_model(monkeypatch):
    rows = _bench("fuse-blocks", "--repeats", "2")
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchmarks import fuse_blocks

    assert [r["style"] for r in rows] == ["nanogpt", "vit", "litgpt", "torchtitan"]
    for r in rows:
        assert set(r) - {"style"} == set(fuse_blocks.COLUMNS)
        assert r["original_ms"] > 0 and r["fused_ms"] > 0 and r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
