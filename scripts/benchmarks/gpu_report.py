"""`bench.py gpu-report --out DIR`: the one report of `make gpu-check`, written to DIR/report.md
and printed. It reads what the check's parts left in DIR (each part's exit status in
<part>.rc, its output in <part>.log; the bandwidth table in gpu.json), records the
environment, and judges the GPU targets below PASS or FAIL. A target with a figure
missing (a part that failed, a configuration that errored, no GPU) is a FAIL. Exit status
1 when a part failed or a target was missed, else 0; NO_GPU (3) where no GPU is present:
the parts ran as far as they can without one, and the report's first line says so (make
then stops with "Error 3")."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from .common import markdown

# The targets (an H100, bf16). Bandwidth is compulsory bytes / time, as `bench.py gpu` reports it.
BANDWIDTH_TBPS = 2.7  # fuseblock's forward and backward, rms and layer, at every d of BANDWIDTH_D
BANDWIDTH_D = (4096, 262144)  # every power of two from .. to, inclusive
COMPILE_D = (1024, 262144)  # fuseblock at least torch.compile's figure, forward and backward, at every d here
# GPT step, for each model of STEP_MODELS: (contender, baseline, the least ratio of the baseline's
# median step time to the contender's). The fused stream must beat naive eager by 5%, and compiled
# and under CUDA graphs, not lose to naive compiled / reduce-overhead.
STEP_MODELS = ("gpt2", "llama")
GPT_TARGETS = (("fused", "naive", 1.05), ("fused+compile", "naive+compile", 1.0),
               ("fused+reduce-overhead", "naive+reduce-overhead", 1.0))
# and, judged only where Liger-Kernel was found (gpt-step then runs "naive+liger"): not lose to it
GPT_PEER_TARGETS = (("fused", "naive+liger", 1.0),)
# add_norm's forward + backward time per call at bench.py gpu's latency shape (140 x 4096 bf16,
# do_bench's: launch and host bound there) at most this many times eager's
LATENCY_VS_EAGER = 2.0
NO_GPU = 3  # the exit status where no GPU is present

KINDS = ("rms", "layer")
PASSES = ("fwd", "bwd")
# name in DIR (the Makefile's), what it is
PARTS = (("tests", "kernel tests on the compiled kernels (pytest -m kernel, FUSEBLOCK_TEST_DEVICE=cuda)"),
         ("gpu", "add_norm bandwidth (bench.py gpu)"),
         ("gpt_step", "GPT-2-small and Llama-shaped training steps (bench.py gpt-step)"),
         ("tile", "forward tile against the loop kernel at d = 32768, bf16 and fp32 (tools/tile_vs_loop.py)"))
ROOT = Path(__file__).resolve().parents[2]


def _powers_of_two(lo: int, hi: int) -> list[int]:
    return [1 << k for k in range(lo.bit_length() - 1, hi.bit_length()) if lo <= 1 << k <= hi]


def _verdict(name: str, bad: list[str], measured: str, missing: list[int] | None = None) -> dict:
    if missing:
        bad = [*bad, "not measured at d=" + ", ".join(map(str, missing))]
    return dict(target=name, verdict="FAIL" if bad else "PASS", measured=measured, falls_short="; ".join(bad))


def _bandwidth_target(rows: list[dict], kind: str, pas: str) -> dict:
    by_d = {r["d"]: r for r in rows if r.get("kind") == kind}
    got, bad, missing = {}, [], []
    for d in _powers_of_two(*BANDWIDTH_D):
        v = by_d.get(d, {}).get(f"fuseblock_{pas}_TBps")
        if v is None:
            missing.append(d)
        else:
            got[d] = v
            if v < BANDWIDTH_TBPS:
                bad.append(f"d={d}: {v:.2f}")
    worst = min(got, key=got.get) if got else None
    measured = f"min {got[worst]:.2f} TB/s (d={worst})" if got else "nothing"
    name = f"{kind} {pas} >= {BANDWIDTH_TBPS} TB/s, d {BANDWIDTH_D[0]}..{BANDWIDTH_D[1]}"
    return _verdict(name, bad, measured, missing)


def _compile_target(rows: list[dict], kind: str, pas: str) -> dict:
    by_d = {r["d"]: r for r in rows if r.get("kind") == kind}
    got, bad, missing = {}, [], []
    for d in _powers_of_two(*COMPILE_D):
        ours, theirs = (by_d.get(d, {}).get(f"{impl}_{pas}_TBps") for impl in ("fuseblock", "compile"))
        if ours is None or theirs is None:
            missing.append(d)
        else:
            got[d] = ours / theirs
            if ours < theirs:
                bad.append(f"d={d}: {ours:.2f} < {theirs:.2f}")
    worst = min(got, key=got.get) if got else None
    measured = f"min {got[worst]:.2f}x compile (d={worst})" if got else "nothing"
    return _verdict(f"{kind} {pas} >= torch.compile, d {COMPILE_D[0]}..{COMPILE_D[1]}", bad, measured, missing)


def _latency_target(rows: list[dict], kind: str) -> dict:
    row = next((r for r in rows if r.get("kind") == kind), {})
    name = f"{kind} add_norm fwd+bwd time <= {LATENCY_VS_EAGER:.1f}x eager's, 140 x 4096"
    cols = [f"{impl}_{pas}_us" for impl in ("fuseblock", "eager") for pas in PASSES]
    if any(row.get(c) is None for c in cols):
        return _verdict(name, ["not measured"], "nothing")
    ours, eager = row[cols[0]] + row[cols[1]], row[cols[2]] + row[cols[3]]
    ratio = ours / eager
    return _verdict(name, [] if ratio <= LATENCY_VS_EAGER else [f"{ratio:.2f}x"],
                    f"{ours:.1f} against {eager:.1f} us ({ratio:.2f}x)")


def _gpt_target(rows: list[dict], model: str, impl: str, base: str, least: float) -> dict:
    # rows of a gpt-step from before --model (no "model" key) are GPT-2's
    ms = {r["impl"]: r["median_ms"] for r in rows if "median_ms" in r and r.get("model", "gpt2") == model}
    name = f"{model} step {impl} >= {least:.2f}x {base}"
    if impl not in ms or base not in ms:
        return _verdict(name, ["not measured"], "nothing")
    ratio = ms[base] / ms[impl]
    return _verdict(name, [] if ratio >= least else [f"{ratio:.3f}x"], f"{ratio:.3f}x (median step times)")


def judge(bandwidth_rows: list[dict], step_rows: list[dict], latency_rows: list[dict] = ()) -> list[dict]:
    """Every target's verdict, from `bench.py gpu` (bandwidth and latency tables) and `bench.py
    gpt-step` rows."""
    return ([_bandwidth_target(bandwidth_rows, k, p) for k in KINDS for p in PASSES]
            + [_compile_target(bandwidth_rows, k, p) for k in KINDS for p in PASSES]
            + [_latency_target(list(latency_rows), k) for k in KINDS]
            + [_gpt_target(step_rows, m, *t) for m in STEP_MODELS for t in GPT_TARGETS]
            + [_gpt_target(step_rows, m, *t) for m in STEP_MODELS for t in GPT_PEER_TARGETS
               if any(r.get("impl") == t[1] and r.get("model", "gpt2") == m for r in step_rows)])


def fp8_verdicts(rows: list[dict]) -> list[dict]:
    """Each fp8 row's correctness: the fused codes and scales equal norm-then-cast's."""
    return [_verdict(f"{r['op']} codes equal norm-then-cast", [] if r.get("codes_equal") else [r["op"]],
                     r.get("error") or f"codes_equal={r.get('codes_equal')}"
                     + (f", {r['codes_differ']} codes (widest step {r['max_code_step']}) and {r['scales_differ']} "
                        "scales differ" if "codes_differ" in r else "")) for r in rows]


def environment() -> dict:
    import torch

    env = {"python": sys.version.split()[0], "torch": f"{torch.__version__} (CUDA {torch.version.cuda})"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        env["GPU"] = f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}, {torch.cuda.device_count()} visible)"
    else:
        env["GPU"] = "none (torch.cuda.is_available() is False)"
    try:
        import hypothesis  # noqa: F401

        env["hypothesis"] = "installed"
    except ImportError:
        env["hypothesis"] = "not installed: make gpu-check leaves tests/ops/test_properties.py out"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                                timeout=10)
        env["commit"] = commit.stdout.strip() or "unknown (no git checkout)"
    except (OSError, subprocess.SubprocessError):
        env["commit"] = "unknown (no git)"
    return env


def _status(out: Path, part: str) -> int | None:
    try:
        return int((out / f"{part}.rc").read_text().strip())
    except (OSError, ValueError):
        return None  # not run, or cut off before its status was written


def _json_lines(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line that stderr broke into: the part's status says the rest
                    pass
    return rows


def pytest_summary(log: str) -> tuple[str, list[str]]:
    """pytest's closing line ("600 passed, 2 skipped in 95.1s") and its FAILED / ERROR lines."""
    summary = "no pytest summary line in the log"
    for line in log.splitlines():
        if re.search(r"\b(passed|failed|errors?|skipped|deselected|no tests ran)\b.* in [\d.]+s", line):
            summary = line.strip(" =")
    return summary, [ln for ln in log.splitlines() if ln.startswith(("FAILED ", "ERROR "))]


def _json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def report(out: Path, env: dict, gpu: bool = True) -> tuple[str, bool]:
    """The report's text, and whether every part ran clean and every target passed (gpu
    False: the report opens with NO GPU)."""
    status = {part: _status(out, part) for part, _ in PARTS}
    bandwidth = json.loads((out / "gpu.json").read_text()) if (out / "gpu.json").exists() else []
    steps = _json_lines(out / "gpt_step.log")
    fp8 = _json(out / "gpu_fp8.json") or []
    latency = _json(out / "gpu_latency.json") or []
    verdicts = judge(bandwidth, steps, latency) + fp8_verdicts(fp8)
    parts_failed = [p for p, rc in status.items() if rc != 0]
    missed = [v for v in verdicts if v["verdict"] == "FAIL"]
    ok = not parts_failed and not missed
    found = _json(out / "peers.json") or {}
    hyper = _json(out / "gpu_hyper.json") or []
    tile = (_json(out / "tile_bf16.json") or []) + (_json(out / "tile_fp32.json") or [])
    head = [] if gpu else ["**NO GPU**: no CUDA device is present (torch.cuda.is_available() is False). The parts "
                           "ran as far as they can without one; nothing below was measured on a GPU.", ""]
    lines = ["# make gpu-check", "", *head,
             f"**{'PASS' if ok else 'FAIL'}**: parts failed: {', '.join(parts_failed) or 'none'}; "
             f"targets missed: {len(missed)} of {len(verdicts)}.", "", "## Environment", "",
             markdown([dict(what=k, value=v) for k, v in env.items()]), "## Parts", "",
             markdown([dict(part=p, what=what, exit_status="not run" if status[p] is None else status[p],
                            output=f"{out}/{p}.log") for p, what in PARTS])]
    log = (out / "tests.log").read_text(errors="replace") if (out / "tests.log").exists() else ""
    summary, failures = pytest_summary(log)
    lines += ["## Kernel tests", "", f"    {summary}", ""]
    if failures:
        lines += [f"    {ln}" for ln in failures[:30]] + ([f"    ... {len(failures) - 30} more"] if len(failures) > 30
                                                          else []) + [""]
    lines += ["## Peers found", "",
              markdown([dict(peer=k, found=v["found"], detail=v["detail"], what=v["what"]) for k, v in found.items()])
              if found else "not looked for (see gpu.log)\n"]
    lines += ["## Targets", "", markdown(verdicts),
              "## add_norm bandwidth, bf16, TB/s (bench.py gpu)", "",
              markdown(bandwidth) if bandwidth else "no rows (see gpu.log)\n",
              "## add_norm latency, 140 x 4096 bf16, microseconds (bench.py gpu)", "",
              markdown(latency) if latency else "no rows (see gpu.log)\n",
              "## add_norm + fp8 cast, fused vs norm-then-cast, bf16 forward GB/s (bench.py gpu)", "",
              markdown(fp8) if fp8 else "no rows (see gpu.log)\n",
              "## The mHC boundary (hc_add_norm, n = 4), fused vs unfused, bf16 GB/s (bench.py gpu)", "",
              markdown(hyper) if hyper else "no rows (see gpu.log)\n",
              "## Forward tile against the loop kernel, d = 32768, ms (tools/tile_vs_loop.py)", "",
              markdown(tile) if tile else "no rows (see tile.log)\n",
              "## GPT-2-small and Llama-shaped training steps, bf16 autocast (bench.py gpt-step)", "",
              markdown(steps) if steps else "no rows (see gpt_step.log)\n"]
    return "\n".join(lines), ok


def gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


def run(args) -> list[dict]:
    out = Path(args.out)
    if not out.is_dir():
        raise SystemExit(f"gpu-report: {out} is not a folder (make gpu-check fills it)")
    gpu = gpu_present()
    text, ok = report(out, environment(), gpu)
    (out / "report.md").write_text(text)
    print(text)
    print(f"written to {out / 'report.md'}")
    if not gpu:
        print(f"NO GPU: make gpu-check ran as far as it can without one (exit status {NO_GPU})")
        raise SystemExit(NO_GPU)
    raise SystemExit(0 if ok else 1)
