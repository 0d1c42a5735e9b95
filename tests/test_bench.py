"""scripts/bench.py runs in its quick mode; its tables parse and say what the targets say."""
import json
import os
import subprocess
import sys

import pytest
from trainutil import ROOT


def _bench(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # bench.py sets it itself
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def parse_tables(text: str) -> dict:
    """{title: [row dicts]} for each '### title' markdown table; every row must have every column."""
    tables, lines, i = {}, text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("### "):
            title, i = lines[i][4:], i + 2
            header = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            assert set(lines[i + 1].replace("|", "")) == {"-"}, lines[i + 1]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                assert len(cells) == len(header), lines[i]
                rows.append(dict(zip(header, cells)))
                i += 1
            tables[title] = rows
        else:
            i += 1
    return tables


def test_parse_tables_rejects_a_ragged_table():
    good = "### t\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert parse_tables(good) == {"t": [{"a": "1", "b": "2"}]}
    with pytest.raises(AssertionError):
        parse_tables(good + "| 3 |\n")


@pytest.mark.slow
def test_traffic_quick():
    tables = parse_tables(_bench("traffic", "--quick"))
    per_pass, both = tables.values()
    assert len(per_pass) == 2 * 2 * (6 * 2 - 1)  # passes x kinds x (ops x dtypes, less fp32-residual in fp32)
    for r in per_pass:
        assert float(r["act/min"]) == 1.0  # every activation byte exactly once
        assert float(r["fused/min"]) <= 1.25  # weights, statistics and partial sums included
        triton, glue = map(int, r["launches"].split("+"))
        assert triton == 1 and (glue == 0 or r["pass"] == "bwd")  # one launch per forward call
    by = {(r["op"], r["kind"], r["dtype"]): r for r in both}
    for kind in ("rms", "layer"):
        for dt in ("fp32", "bf16"):
            r = by["add_norm", kind, dt]
            # against torch's norm as one kernel the byte model's ceiling is 11/8 (see docs/performance.md)
            assert 1.25 <= float(r["naive1/fused"]) <= 11 / 8
    assert float(by["add_norm", "rms", "bf16"]["naive/fused"]) >= 1.5  # CPU's composite rms_norm


def test_traffic_json_rows():
    out = _bench("traffic", "--quick", "--json", "--kinds", "rms", "--dtypes", "bf16", "--rows", "64", "--d", "48")
    rows = [json.loads(line) for line in out.splitlines()]
    assert {(r["op"], r["pass"]) for r in rows} == {(op, p) for op in (
        "norm", "add_norm", "add_norm_fp32_residual", "pre_gate", "post_gate", "post_gate_residual") for p in ("fwd", "bwd")}
    for r in rows:
        assert r["kernel_act_bytes"] == r["min_bytes"] and r["unattributed_bytes"] == 0
        assert r["fused_bytes"] == (r["kernel_act_bytes"] + r["kernel_weight_bytes"] + r["kernel_stat_bytes"]
                                    + r["kernel_partial_bytes"] + r["glue_bytes"])


def test_memory_quick_fused_saves_no_more():
    rows = parse_tables(_bench("memory", "--quick"))
    (rows,) = rows.values()
    by = {(r["norm"], r["precision"], r["impl"]): r for r in rows}
    assert len(by) == 8
    for norm in ("rms", "layer"):
        for prec in ("fp32", "bf16-autocast"):
            fused, naive = by[norm, prec, "fused"], by[norm, prec, "naive"]
            assert 0 < float(fused["bytes"]) <= float(naive["bytes"])
            assert float(fused["mixers"]) == float(naive["mixers"])  # the difference is in the norms
            # per sublayer (two a layer) the fused norm keeps p, 4 B per channel (the stream is
            # fp32 in both precisions), and one or two fp32 statistics per token
            assert 8 <= float(fused["norms per channel"]) < 8.5


def test_speed_quick_runs():
    (rows,) = parse_tables(_bench("speed", "--quick")).values()
    assert {r["impl"] for r in rows} == {"naive", "fused"}
    assert all(float(r["median ms"]) > 0 and float(r["tokens/s"]) > 0 for r in rows)


def test_gpu_without_cuda_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU: the benchmark would run")
    out = _bench("gpu", "--out", str(tmp_path / "g"), timeout=120)
    assert "no CUDA" in out


def test_bad_arguments_are_usage_errors():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "traffic", "--rows", "0"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and "--rows must be positive" in p.stderr
