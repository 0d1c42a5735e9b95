"""Helpers for the tests that run scripts/train.py and scripts/sample.py as a user would.

`run` starts a real process (for end-to-end and kill tests); `call` runs a script's
`cli()` in this process (same argument parsing and error handling, no interpreter start),
so the many small error-path tests stay fast.
"""
import contextlib
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--eval-iters", "2", "--no-progress"]


def run(script, *args, timeout=180, check=True):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CPU torch path
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


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
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
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
