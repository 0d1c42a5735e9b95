"""Checkpoints: nothing is unpickled, writes are atomic and kill-safe, bad files get one-line errors."""
import json
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from timeouts import wait_for
from trainutil import ROOT, TINY, call, saved_tiny_gpt, train

from models import checkpoint
from models.gpt import GPT


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "run"
    train(out, 4, "--eval-interval", "2", "--ckpt-interval", "2")
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


class _Bomb:
    """Unpickling this creates a marker file: proof that code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_planted_pickle_files_are_never_executed(trained, tmp_path):
    out = _copy(trained, tmp_path / "planted")
    ckpt = checkpoint.resolve(out)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Bomb(marker))
    for name in ("model.safetensors", "optimizer.safetensors"):
        (ckpt / name).write_bytes(payload)
    for name in ("model.pt", "optimizer.pt", "pytorch_model.bin", "rng.pkl"):
        (ckpt / name).write_bytes(payload)
    meta = json.loads((ckpt / "meta.json").read_text())
    for f in meta["files"].values():  # make the recorded sizes/hashes agree, so loading gets as far as parsing
        f.update(bytes=len(payload), sha256=__import__("hashlib").sha256(payload).hexdigest())
    (ckpt / "meta.json").write_text(json.dumps(dict(meta, meta_sha256=checkpoint.meta_digest(meta))))
    for script in ("sample.py", "train.py"):
        resume = ["--out-dir", out, "--max-iters", "6", "--resume", *TINY]
        extra = ["--max-new-tokens", "5"] if script == "sample.py" else resume
        args = ["--ckpt", out, *extra] if script == "sample.py" else extra
        p = call(script, *args, check=False)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "model.safetensors" in p.stderr
    assert not marker.exists()


def test_load_paths_contain_no_pickle_and_no_unsafe_torch_load():
    sources = [*(ROOT / "models").glob("*.py"), *(ROOT / "scripts").glob("*.py"), *(ROOT / "fuseblock").rglob("*.py")]
    for path in sources:
        src = path.read_text()
        assert not re.search(r"^\s*import pickle|^\s*from pickle|cPickle", src, re.MULTILINE), path
        for load in re.findall(r"torch\.load\([^)]*\)", src):
            assert "weights_only=True" in load, f"{path}: {load}"


@pytest.mark.parametrize("damage,needle", [
    ("truncate_model", "model.safetensors: truncated"),
    ("corrupt_model", "model.safetensors: corrupt"),
    ("corrupt_meta", "meta.json: corrupt JSON"),
    ("missing_meta", "meta.json: missing"),
    ("malformed_meta", "meta.json: malformed"),
    ("bad_pointer", "latest: unreadable pointer"),
    ("mismatch", "does not fit the model"),
])
def test_damaged_checkpoints_get_one_line_errors(trained, tmp_path, damage, needle):
    out = _copy(trained, tmp_path / damage)
    ckpt = checkpoint.resolve(out)
    if damage == "truncate_model":
        data = (ckpt / "model.safetensors").read_bytes()
        (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "corrupt_model":
        data = bytearray((ckpt / "model.safetensors").read_bytes())
        data[-5] ^= 0xFF
        (ckpt / "model.safetensors").write_bytes(bytes(data))
    elif damage == "corrupt_meta":
        (ckpt / "meta.json").write_text("{not json")
    elif damage == "missing_meta":
        (ckpt / "meta.json").unlink()
    elif damage == "malformed_meta":  # valid JSON, its own sha256 re-recorded, but no record of the files
        meta = json.loads((ckpt / "meta.json").read_text())
        del meta["files"]
        (ckpt / "meta.json").write_text(json.dumps(dict(meta, meta_sha256=checkpoint.meta_digest(meta))))
    elif damage == "bad_pointer":
        (out / "latest").write_text("garbage")
    elif damage == "mismatch":  # a checkpoint of another model under the same config (sha256 re-recorded)
        meta = json.loads((ckpt / "meta.json").read_text())
        meta["config"]["model"]["n_embd"] = 32
        (ckpt / "meta.json").write_text(json.dumps(dict(meta, meta_sha256=checkpoint.meta_digest(meta))))
    for script, args in (("sample.py", ["--ckpt", out, "--max-new-tokens", "3"]),
                         ("train.py", ["--out-dir", out, "--max-iters", "6", "--resume", *TINY[6:]])):
        p = call(script, *args, check=False)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines


def test_resume_with_a_conflicting_model_flag_is_refused(trained, tmp_path):
    out = _copy(trained, tmp_path / "conflict")
    p = call("train.py", "--out-dir", out, "--max-iters", "6", "--resume", *TINY[:4], "--n-embd", "32",
             "--block-size", "16", check=False)
    assert p.returncode == 2 and "config mismatch" in p.stderr and "n_embd" in p.stderr


def test_full_disk_during_a_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, rng = saved_tiny_gpt(tmp_path, 1)
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    def full_disk(tensors, filename, *a, **k):
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    with pytest.raises(checkpoint.CheckpointWriteError, match="No space left on device"):
        checkpoint.save(tmp_path, 2, model, opt, {"model": model.config.to_json()}, rng)
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # no temp dir left behind, pointer and checkpoint untouched
    ckpt = checkpoint.resolve(tmp_path)
    checkpoint.read_meta(ckpt)
    checkpoint.load_weights(ckpt, GPT(model.config))


def _latest_step(out: Path) -> int:
    try:
        return int(json.loads((out / "latest").read_text())["checkpoint"][5:])
    except (OSError, ValueError, KeyError):
        return 0


def test_sigkill_at_random_moments_always_leaves_a_loadable_checkpoint(tmp_path):
    """A run checkpointing every iteration is SIGKILLed at random moments, three times
    (a fresh run, then two resumed ones: each a train.py start-up, seconds of imports);
    each time `latest` loads, and the next --resume run starts from exactly its step."""
    out = tmp_path / "killed"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    rnd = random.Random(0)
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--out-dir", str(out), "--max-iters", "100000",
           "--eval-interval", "100000", "--ckpt-interval", "1", *TINY]
    steps = []
    for attempt in range(3):
        log = tmp_path / f"attempt{attempt}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd + (["--resume"] if attempt else []), env=env, cwd=ROOT, stdout=f,
                                    stderr=subprocess.STDOUT)
            try:
                wait_for(lambda: _latest_step(out) > (steps[-1] if steps else 0), what="a new checkpoint", log=log)
                time.sleep(rnd.uniform(0.0, 0.8))  # then kill at a random moment
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        if attempt:  # it resumed from the checkpoint the previous check loaded
            assert f"iters {steps[-1]}..100000" in log.read_text(), log.read_text()
        ckpt = checkpoint.resolve(out)
        meta = checkpoint.read_meta(ckpt)
        model = GPT(checkpoint.read_config(ckpt, meta))
        checkpoint.load_weights(ckpt, model)
        checkpoint.load_training_state(ckpt, meta, torch.optim.AdamW(model.optimizer_groups(0.1)))
        steps.append(meta["step"])
    assert steps == sorted(steps) and steps[0] >= 1 and steps[-1] > steps[0], steps
    p = train(out, steps[-1] + 2, "--resume", "--eval-interval", "1000", "--ckpt-interval", "1")
    assert f"iters {steps[-1]}..{steps[-1] + 2}" in p.stdout
    assert json.loads((out / "latest").read_text()) == {"checkpoint": f"ckpt-{steps[-1] + 2:06d}"}
    assert not list(out.glob(".*.tmp*")), list(out.glob(".*"))  # temp files of the killed writers are gone


def _failing_save_file(fail_at):
    """A safetensors writer that runs out of disk midway through the given saves (1-based)."""
    real, calls = checkpoint.save_file, 0

    def save_file(tensors, filename, *a, **k):
        nonlocal calls
        calls += 1
        if calls in fail_at:
            Path(filename).write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        return real(tensors, filename, *a, **k)

    return save_file


@pytest.mark.parametrize("fail_at,code", [((2,), 0), ((3, 4), 2)])
def test_full_disk_during_training_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fail_at, code):
    """Saves at steps 2, 4, 6; one fails (at step 4 there is no older checkpoint to free;
    at step 6 the second try, after ckpt-000002 is freed, fails too). Training goes on; a
    failed last save is a one-line error with exit status 2, and `latest` is then the
    step-4 checkpoint, intact."""
    out = tmp_path / "run"
    monkeypatch.setattr(checkpoint, "save_file", _failing_save_file(fail_at))
    p = train(out, 6, "--eval-interval", "6", "--ckpt-interval", "2", check=False)
    assert p.returncode == code and "Traceback" not in p.stderr
    freed = "; ckpt-000002 removed to make room" if code else ""
    assert f"warning: checkpoint at step {2 * fail_at[0]} not written (No space left on device{freed})" in p.stderr
    assert "step 6: train" in p.stdout  # it trained to the end
    last = 6 if code == 0 else 4
    ckpt = checkpoint.resolve(out)
    assert ckpt.name == f"ckpt-{last:06d}"
    checkpoint.load_weights(ckpt, GPT(checkpoint.read_config(ckpt, checkpoint.read_meta(ckpt))))
    if code:
        assert p.stderr.strip().splitlines()[-1].startswith(f"error: {out}: checkpoint at step 6 not written")
    assert not list(out.glob(".*.tmp*"))


def test_prune_orders_checkpoints_by_step_number(tmp_path):
    for step in (999_998, 999_999, 1_000_000):
        (tmp_path / f"ckpt-{step:06d}").mkdir()
    checkpoint._prune(tmp_path, keep="ckpt-1000000")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1000000", "ckpt-999999"]


@pytest.mark.parametrize("where", ["weights", "adam"])
def test_save_writes_no_nan_state(tmp_path, where):
    """What the loader would refuse is never written (before: a diverged run's NaN weights
    became the newest checkpoint and pruned the good ones): NonFiniteError, nothing new on
    disk, the earlier checkpoint still `latest`."""
    model, opt, rng = saved_tiny_gpt(tmp_path, 1)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with torch.no_grad():
        (model.wpe.weight if where == "weights" else opt.state[model.wpe.weight]["exp_avg"])[0, 0] = float("inf")
    with pytest.raises(checkpoint.NonFiniteError):
        checkpoint.save(tmp_path, 2, model, opt, {"model": model.config.to_json()}, rng)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert checkpoint.resolve(tmp_path).name == "ckpt-000001"


@pytest.mark.parametrize("change,needle", [
    (lambda m: m.update(n_experts=4), "unknown field n_experts"),
    (lambda m: m.pop("n_head"), "missing field n_head"),
    (lambda m: (m.update(colour=1, size=2), m.pop("norm")), "unknown fields colour, size; missing field norm"),
])
def test_a_model_config_with_a_wrong_field_names_that_field(trained, tmp_path, change, needle):
    out = _copy(trained, tmp_path / "fields")
    ckpt = checkpoint.resolve(out)
    meta = json.loads((ckpt / "meta.json").read_text())
    change(meta["config"]["model"])
    (ckpt / "meta.json").write_text(json.dumps(dict(meta, meta_sha256=checkpoint.meta_digest(meta))))
    p = call("sample.py", "--ckpt", out, "--max-new-tokens", "5", check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"bad model config ({needle})" in p.stderr and "vocab_size" not in p.stderr, p.stderr
