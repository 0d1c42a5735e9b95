"""Helpers for the tests that run scripts/train.py and scripts/sample.py as a user would.

`run` starts a real process (for end-to-end and kill tests); `call` runs a script's
`cli()` in this process (same argument parsing and error handling, no interpreter start),
so the many small error-path tests stay fast.
"""
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import timeouts
import torch
from helpers import DEVICE
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--eval-iters", "2", "--no-progress"]


# Runs a script under a file-size limit: writes past it fail with EFBIG ("File too large"),
# a real full disk for one process (Python ignores the SIGXFSZ that comes with it).
_LIMITED = ("import resource, runpy, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); "
            "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def env():
    """A started process's environment: the CPU torch path (no TRITON_INTERPRET), and this
    checkout's root (fuseblock, models/) and scripts/ first on its path, as pytest's are."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    first = [str(ROOT), str(ROOT / "scripts")]
    environ["PYTHONPATH"] = os.pathsep.join(first + ([environ["PYTHONPATH"]] if environ.get("PYTHONPATH") else []))
    return environ


def command(script, *args, fsize=None):
    path = str(ROOT / "scripts" / script)
    head = [sys.executable, path] if fsize is None else [sys.executable, "-c", _LIMITED, str(fsize), path]
    return [*head, *map(str, args)]


def run(script, *args, seconds=180, check=True, fsize=None):
    """Run scripts/<script> in a new process, under timeouts.limit(seconds); fsize: the largest
    file it may write, in bytes."""
    proc = timeouts.run(command(script, *args, fsize=fsize), seconds=seconds, capture_output=True, text=True,
                        env=env(), cwd=ROOT, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def start(script, *args, log, **kw):
    """Start scripts/<script> in a new process, its stdout and stderr into the file `log`."""
    with open(log, "w") as f:
        return subprocess.Popen(command(script, *args), env=env(), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, **kw)


def _module(script):
    name = f"_script_{Path(script).stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / script)
        sys.modules[name] = mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return sys.modules[name]


def call(script, *args, check=True):
    """Run scripts/<script>'s cli() in-process; returns .returncode, .stdout, .stderr."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    try:
        # on the CPU unless told otherwise, as a user's process, whatever default device
        # conftest set for the tests (FUSEBLOCK_TEST_DEVICE=cuda)
        with torch.device("cpu"), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            _module(script).cli([str(a) for a in args])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int) and e.code is not None:
            err.write(str(e.code))
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    res = SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
    if check and code != 0:
        raise AssertionError(f"{script} failed ({code}):\n{res.stdout}\n{res.stderr}")
    return res


def train(out_dir, iters, *extra, check=True):
    return call("train.py", "--out-dir", out_dir, "--max-iters", iters, *TINY, *extra, check=check)


def full_disk_at(monkeypatch, n: int) -> SimpleNamespace:
    """From now on os.replace fails for space on its n-th call (1: the next one), as a disk
    that fills during a write would; the other calls replace as usual. Returns the count
    of calls so far, as `.calls`."""
    real, seen = os.replace, SimpleNamespace(calls=0)

    def replace(a, b):
        seen.calls += 1
        if seen.calls == n:
            raise OSError(28, "No space left on device")
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    return seen


def saved_tiny_gpt(directory, step: int, *, trained: bool = True):
    """A one-layer GPT and its AdamW (after one step when `trained`) saved as checkpoint
    `step` into `directory`: (model, optimizer, rng), for saving again."""
    from models import checkpoint
    from models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16))
    opt = torch.optim.AdamW(model.parameters())
    if trained:
        model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
        opt.step()
    rng = {"torch0": torch.get_rng_state()}
    checkpoint.save(directory, step, model, opt, {"model": model.config.to_json()}, rng)
    return model, opt, rng


def _header(path) -> bytes:
    """A safetensors file's header: every tensor's name, dtype, shape and place, and the metadata."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")  # the format's first 8 bytes: the header's length
        return f.read(size)


def compare_checkpoints(a, b) -> float:
    """Two checkpoints in one format: the same safetensors headers (names, dtypes, shapes,
    layout, metadata: the tied head stored once, as save_model does) and the same meta.json
    but for the world size and the accumulation; returns the largest difference of any
    tensor or loss."""
    diff = 0.0
    for f in ("model.safetensors", "optimizer.safetensors"):
        assert _header(a / f) == _header(b / f), f
        x, y = load_file(a / f), load_file(b / f)
        for k in x:
            diff = max(diff, (x[k].double() - y[k].double()).abs().max().item())
    ma, mb = (json.loads((c / "meta.json").read_text()) for c in (a, b))
    assert ma.keys() == mb.keys() and ma["format"] == mb["format"] and ma["step"] == mb["step"]
    assert ma["config"]["model"] == mb["config"]["model"] and ma["optimizer"] == mb["optimizer"]
    assert {k: v for k, v in ma["config"]["train"].items() if k != "grad_accum"} == \
        {k: v for k, v in mb["config"]["train"].items() if k != "grad_accum"}
    assert len(ma["curve"]) == len(mb["curve"]) == ma["step"]
    diff = max([diff] + [abs(u - v) for u, v in zip(ma["curve"], mb["curve"], strict=True)])
    print(f"{a.parent.name}/{a.name} vs {b.parent.name}/{b.name}: largest difference {diff:.3g}")  # pytest -s
    return diff


def torchrun(n: int, *args, kernel_path: bool = False, seconds: float = 300) -> subprocess.CompletedProcess:
    """`torch.distributed.run` on n CPU ranks (gloo, one thread each) with args, asserting it
    succeeds, under timeouts.limit(seconds); on the kernel path (TRITON_INTERPRET=1) where
    kernel_path, else the torch path. Skipped under FUSEBLOCK_TEST_DEVICE=cuda: the ranks would
    still be CPU processes, testing the interpreter, not the GPU."""
    if DEVICE == "cuda":
        pytest.skip("multi-process tests run their ranks as CPU processes under the interpreter (make test); "
                    "a GPU machine would need one GPU per rank")
    environ = env()
    if kernel_path:
        environ["TRITON_INTERPRET"] = "1"
    environ["OMP_NUM_THREADS"] = "1"
    p = timeouts.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                      *map(str, args)], seconds=seconds, env=environ, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
    return p
