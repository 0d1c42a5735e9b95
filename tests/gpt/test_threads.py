"""`make train THREADS=N` and `make sample THREADS=N` pass --threads N; sample.py takes
--threads as train.py does."""
import re

import torch
from timeouts import run
from trainutil import ROOT, call, saved_tiny_gpt


def make_n(*args):
    """The commands `make` would run for args, none of them run (-n), with .venv taken as built."""
    p = run(["make", "-n", "-o", ".venv/.installed", *args], seconds=30, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_make_passes_threads_to_train_and_sample():
    for target, script in (("train", "scripts/train.py"), ("sample", "scripts/sample.py")):
        line = next(ln for ln in make_n(target, "THREADS=3").splitlines() if script in ln)
        assert re.search(r" --threads 3$", line), line
        plain = next(ln for ln in make_n(target).splitlines() if script in ln)
        assert "--threads" not in plain, plain


def test_sample_threads_sets_torchs_threads(tmp_path, monkeypatch):
    saved_tiny_gpt(tmp_path, 1)
    asked = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: asked.append(n))
    p = call("sample.py", "--ckpt", tmp_path, "--max-new-tokens", 4, "--threads", 1)
    # the last call is trainutil.call's, restoring the test process's threads
    assert asked[:-1] == [1] and p.stdout.startswith("\n")
    asked.clear()
    call("sample.py", "--ckpt", tmp_path, "--max-new-tokens", 4)
    assert asked[:-1] == []  # torch's own choice


def test_sample_refuses_threads_below_one(tmp_path):
    saved_tiny_gpt(tmp_path, 1)
    p = call("sample.py", "--ckpt", tmp_path, "--threads", 0, check=False)
    assert p.returncode == 2 and "--threads: must be >= 1" in p.stderr and "Traceback" not in p.stderr
