"""End to end: train, resume bit-exactly, sample; bad CLI values fail before any work."""
import json

import pytest
from safetensors.torch import load_file
from trainutil import TINY, call, run, train


def test_train_resume_sample_end_to_end(tmp_path):
    out = tmp_path / "run"
    p = run("train.py", "--out-dir", out, "--max-iters", 6, *TINY, "--eval-interval", "3", "--ckpt-interval", "3")
    assert "step 6: train" in p.stdout
    assert json.loads((out / "latest").read_text()) == {"checkpoint": "ckpt-000006"}
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = json.loads((out / "ckpt-000006" / "meta.json").read_text())
    assert meta["step"] == 6 and [h["step"] for h in meta["history"]] == [3, 6]
    p = train(out, 8, "--resume", "--eval-interval", "4", "--ckpt-interval", "4")
    assert "iters 6..8" in p.stdout
    assert json.loads((out / "latest").read_text()) == {"checkpoint": "ckpt-000008"}
    s = run("sample.py", "--ckpt", out, "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "1")
    assert s.stdout.startswith("ROMEO:") and len(s.stdout.encode()) >= 40
    assert run("sample.py", "--ckpt", out, "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "1").stdout == s.stdout


def test_resume_is_bit_exact_on_cpu(tmp_path):
    args = ("--eval-interval", "5", "--ckpt-interval", "5", "--dropout", "0.1")
    train(tmp_path / "straight", 10, *args)
    train(tmp_path / "halves", 5, *args)
    train(tmp_path / "halves", 10, "--resume", *args)
    a = load_file(tmp_path / "straight" / "ckpt-000010" / "model.safetensors")
    b = load_file(tmp_path / "halves" / "ckpt-000010" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    oa = load_file(tmp_path / "straight" / "ckpt-000010" / "optimizer.safetensors")
    ob = load_file(tmp_path / "halves" / "ckpt-000010" / "optimizer.safetensors")
    assert all((oa[k] == ob[k]).all() for k in oa)
    ha = json.loads((tmp_path / "straight" / "ckpt-000010" / "meta.json").read_text())["history"]
    hb = json.loads((tmp_path / "halves" / "ckpt-000010" / "meta.json").read_text())["history"]
    assert ha == hb


@pytest.mark.parametrize("args,message", [
    (["--n-embd", "10", "--n-head", "3"], "--n-embd"),
    (["--block-size", "100000000"], "--block-size"),
    (["--device", "cuda:7"], "--device"),
    (["--device", "nonsense"], "--device"),
    (["--max-iters", "0"], "--max-iters"),
    (["--lr", "-1"], "--lr"),
    (["--batch-size", "two"], "--batch-size"),
])
def test_bad_cli_values_fail_like_argparse(tmp_path, args, message):
    p = call("train.py", "--out-dir", tmp_path / "x", *args, check=False)
    assert p.returncode == 2 and "usage:" in p.stderr and message in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "x").exists()


def test_sample_rejects_bad_values(tmp_path):
    p = call("sample.py", "--ckpt", tmp_path, "--top-k", "0", check=False)
    assert p.returncode == 2 and "--top-k" in p.stderr and "Traceback" not in p.stderr
