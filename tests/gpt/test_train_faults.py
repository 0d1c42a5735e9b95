"""What a real run meets: a full disk, an earlier run in its directory, a second writer, an
unusable --out-dir, Ctrl-C and SIGTERM, a changed command line on --resume, tampered
checkpoints; and what --help and the closing line say. Real processes, signals and
writer errors where the point is the process (issue 12, points 7 to 14)."""
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from timeouts import run as run_limited
from timeouts import wait, wait_for
from trainutil import (
    ROOT,
    TINY,
    _module,
    call,
    command,
    env,
    full_disk_at,
    run,
    saved_tiny_gpt,
    start,
    train,
)

from models import checkpoint, data
from models.gpt import GPT


def _snapshot(out: Path) -> dict:
    """Every file under `out` (through symlinks) and its bytes."""
    files = (p for p in sorted(out.rglob("*")) if p.is_file())
    return {str(p.relative_to(out)): p.read_bytes() for p in files}


def _latest_step(out: Path) -> int:
    try:
        return int(json.loads((out / "latest").read_text())["checkpoint"][5:])
    except (OSError, ValueError, KeyError):
        return 0


def _loads(out: Path) -> dict:
    """The checkpoint `latest` names, loaded as train.py and sample.py load it; its meta."""
    ckpt = checkpoint.resolve(out)
    meta = checkpoint.read_meta(ckpt)
    model = GPT(checkpoint.read_config(ckpt, meta))
    checkpoint.load_weights(ckpt, model)
    checkpoint.load_training_state(ckpt, meta, torch.optim.AdamW(model.optimizer_groups(0.1)))
    return meta


def _one_line_error(p, *needles):
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _full_disk(tensors, filename, *a, **k):
    """The safetensors writer on a full disk: a partial file, then its own error type."""
    Path(filename).write_bytes(b"partial")
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


# ----------------------------------------------------------------------------- 7: a real full disk


def test_a_real_full_disk_warns_trains_on_and_keeps_the_previous_checkpoint(tmp_path):
    """A run resumed under a file-size limit that model.safetensors fits and
    optimizer.safetensors does not: the real writer fails with SafetensorError (EFBIG) at
    every checkpoint. It warns, trains to the end, exits 2 with one error line, and the
    step-2 checkpoint is byte-for-byte as it was."""
    out = tmp_path / "run"
    data.prepare()  # the data cache is written here, not under the limit
    train(out, 2, "--eval-interval", "2", "--ckpt-interval", "2")
    sizes = [(out / "ckpt-000002" / f).stat().st_size for f in ("model.safetensors", "optimizer.safetensors")]
    assert sizes[0] < sizes[1]
    before = _snapshot(out)
    p = run("train.py", "--out-dir", out, "--resume", "--max-iters", 4, "--ckpt-interval", 1, "--no-progress",
            fsize=sum(sizes) // 2, check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[0] == f"warning: checkpoint at step 3 not written (File too large); {out}/latest still holds step 2"
    want = f"error: {out}: checkpoint at step 4 not written (File too large); {out}/latest still holds step 2"
    assert lines[-1] == want
    assert "step 4: train" in p.stdout  # it trained to the end
    assert _snapshot(out) == before and _loads(out)["step"] == 2
    assert not list(out.glob(".*.tmp*"))


# ----------------------------------------------------------------------------- 8: an earlier run


@pytest.mark.parametrize("earlier", [4, 2], ids=["other-names", "same-name-as-latest"])
def test_a_fresh_run_whose_checkpoints_all_fail_leaves_the_earlier_run_intact(tmp_path, monkeypatch, earlier):
    """Every write fails for space: the earlier run's ckpt-000002, when it is not the one
    `latest` names, is freed for the second try; `latest` and what it names stay."""
    out = tmp_path / "run"
    train(out, earlier, "--eval-interval", "2", "--ckpt-interval", "2")
    before = _snapshot(out)
    monkeypatch.setattr(checkpoint, "save_file", _full_disk)
    p = train(out, 2, "--eval-interval", "2", "--ckpt-interval", "1", "--seed", "7", "--overwrite", check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.splitlines()[-1] == (f"error: {out}: checkpoint at step 2 not written (No space left on device); "
                                         "the earlier run's latest checkpoint is intact")
    freed = "ckpt-000002/" if earlier == 4 else "nothing"
    assert _snapshot(out) == {k: v for k, v in before.items() if not k.startswith(freed)}
    assert _loads(out)["step"] == earlier


def test_a_fresh_run_replaces_an_earlier_run_that_ended_on_the_same_step(tmp_path):
    """`make train` twice: the second run's checkpoints have the first one's names, the
    last of them the one `latest` names."""
    out = tmp_path / "run"
    train(out, 2, "--eval-interval", "2", "--ckpt-interval", "2")
    train(out, 2, "--eval-interval", "2", "--ckpt-interval", "2", "--seed", "7", "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["ckpt-000002", "latest", "loss.png"]
    assert _loads(out)["config"]["train"]["seed"] == 7


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4])
def test_replacing_the_checkpoint_latest_names_is_safe_at_every_rename(tmp_path, monkeypatch, fail_at):
    """Checkpoint ckpt-000002 is `latest`; writing a new ckpt-000002 fails at its 1st to
    4th rename. Whatever the moment, `latest` names a complete checkpoint."""
    torch.manual_seed(0)
    model, opt, rng = saved_tiny_gpt(tmp_path, 2, trained=False)
    full_disk_at(monkeypatch, fail_at)
    with contextlib.suppress(checkpoint.CheckpointWriteError):
        checkpoint.save(tmp_path, 2, model, opt, {"model": model.config.to_json()}, rng)
    monkeypatch.undo()
    ckpt = checkpoint.resolve(tmp_path)
    checkpoint.read_meta(ckpt)
    checkpoint.load_weights(ckpt, GPT(model.config))


# ----------------------------------------------------------------------------- 9: one writer per --out-dir


def test_a_second_run_into_a_busy_out_dir_stops_at_once_and_the_first_goes_on(tmp_path):
    """Also when the file an older train.py locked, `.lock`, is deleted: the lock is on the
    directory itself."""
    out = tmp_path / "run"
    first = start("train.py", "--out-dir", out, "--max-iters", 100000, "--eval-interval", 100000,
                  "--ckpt-interval", 1, *TINY, log=tmp_path / "first.log")
    try:
        wait_for(lambda: _latest_step(out) >= 1, what="the first run's first checkpoint", log=tmp_path / "first.log")
        (out / ".lock").unlink(missing_ok=True)  # before: the lock was this file's, and deleting it let a run in
        for extra in ([], ["--resume"]):
            p = call("train.py", "--out-dir", out, "--max-iters", 3, *TINY, *extra, check=False)
            _one_line_error(p, f"--out-dir {out}: another run is writing to it")
            assert "GPT" not in p.stdout  # no training started
        seen = _latest_step(out)
        wait_for(lambda: _latest_step(out) > seen + 2, what="the first run's next checkpoints",
                 log=tmp_path / "first.log")
    finally:
        first.send_signal(signal.SIGTERM)
        wait(first, seconds=120, log=tmp_path / "first.log")
    log = (tmp_path / "first.log").read_text()
    assert first.returncode == 128 + signal.SIGTERM and "warning" not in log and "Traceback" not in log, log
    assert _loads(out)["step"] > seen + 2


# ----------------------------------------------------------------------------- 10: an unusable --out-dir


@contextlib.contextmanager
def _unprivileged():
    """Root ignores file modes: drop to nobody's effective uid for the block."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.mark.parametrize("case", ["a-file", "under-a-file", "read-only", "read-only-resume"])
def test_an_unusable_out_dir_is_one_line_before_any_training(case):
    base = Path(tempfile.mkdtemp())  # not under tmp_path: nobody must be able to reach it
    try:
        base.chmod(0o755)
        out = base / "run"
        if case == "a-file":
            out.write_text("not a directory")
        elif case == "under-a-file":
            (base / "file").write_text("not a directory")
            out = base / "file" / "run"
        else:
            if case == "read-only-resume":
                train(out, 2, "--eval-interval", "2", "--ckpt-interval", "2")
            out.mkdir(exist_ok=True)
            out.chmod(0o555)
        before = _snapshot(out) if out.is_dir() else None
        extra = ["--resume", "--max-iters", "4"] if case == "read-only-resume" else ["--max-iters", "2"]
        with _unprivileged():
            p = call("train.py", "--out-dir", out, *TINY, *extra, check=False)
        _one_line_error(p, f"--out-dir {out}: ")
        assert "GPT" not in p.stdout  # before any training
        if before is not None:
            assert _snapshot(out) == before
    finally:
        shutil.rmtree(base)


# ----------------------------------------------------------------------------- 11: Ctrl-C and SIGTERM


def _stop(proc, sig, out, after, log):
    """Send `sig` to a run once it has written a checkpoint past `after`; its exit status."""
    wait_for(lambda: _latest_step(out) > after, what=f"a checkpoint after step {after}", log=log)
    proc.send_signal(sig)
    return wait(proc, seconds=120, log=log)


def test_sigint_and_sigterm_write_a_checkpoint_and_resume_bit_exactly(tmp_path):
    """100 straight iterations equal a run stopped by SIGINT, resumed, stopped by SIGTERM,
    and resumed to the end: weights, optimizer state, loss curve and evaluations. Dropout
    on, a live cosine; the only settings given on --resume are this invocation's."""
    args = ("--max-iters", 100, "--eval-interval", 7, "--ckpt-interval", 5, "--dropout", 0.1, "--warmup-iters", 2,
            "--threads", 1, *TINY)
    out = tmp_path / "stopped"
    steps = []
    for n, sig in enumerate((signal.SIGINT, signal.SIGTERM)):
        again = ["--resume", "--threads", 1, "--no-progress"] if n else list(args)
        proc = start("train.py", "--out-dir", out, *again, log=tmp_path / f"{sig.name}.log")
        code = _stop(proc, sig, out, steps[-1] if steps else 0, tmp_path / f"{sig.name}.log")
        log = (tmp_path / f"{sig.name}.log").read_text()
        steps.append(_latest_step(out))
        assert code == 128 + sig, log
        assert f"stopped by {sig.name} after step {steps[-1]}: checkpoint {out}/ckpt-{steps[-1]:06d} written" in log
        assert "Traceback" not in log and steps[-1] < 100
    call("train.py", "--out-dir", out, "--resume", "--threads", 1, "--no-progress")
    call("train.py", "--out-dir", tmp_path / "straight", *args)
    a, b = (tmp_path / d / "ckpt-000100" for d in ("straight", "stopped"))
    for f in ("model.safetensors", "optimizer.safetensors"):
        ta, tb = load_file(a / f), load_file(b / f)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), f
    ma, mb = (json.loads((d / "meta.json").read_text()) for d in (a, b))
    assert ma["history"] == mb["history"] and ma["curve"] == mb["curve"] and len(ma["curve"]) == 100


@pytest.mark.slow
def test_ctrl_c_under_ddp_stops_every_rank_at_one_step(tmp_path):
    """Ctrl-C reaches torchrun and both ranks (one process group); torchrun then sends
    SIGTERM too. Both ranks stop after the same step (else one would wait forever in the
    next all-reduce), rank 0 writes it, nothing hangs."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *command("train.py", "--out-dir", out, "--device", "cpu", "--max-iters", 100000, "--eval-interval", 100000,
                    "--ckpt-interval", 3, *TINY)[1:]]
    e = dict(env(), OMP_NUM_THREADS="1")
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(cmd, env=e, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: _latest_step(out) >= 3, what="the first checkpoint", log=tmp_path / "log")
            os.killpg(proc.pid, signal.SIGINT)
            wait(proc, seconds=120, log=tmp_path / "log")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "log").read_text()
    step = _latest_step(out)
    assert f"stopped by SIGINT after step {step}: checkpoint" in text, text
    assert _loads(out)["step"] == step and step >= 3


# ----------------------------------------------------------------------------- 12: --resume as started


def test_resume_restores_every_training_setting(tmp_path):
    """Started with non-default settings, resumed with none: the same run as one that was
    never stopped (before: the default batch, accumulation and implementation)."""
    args = ("--batch-size", 7, "--grad-accum", 3, "--impl", "naive", "--lr", 3e-3, "--min-lr", 1e-4,
            "--warmup-iters", 1, "--lr-decay-iters", 5, "--weight-decay", 0.05, "--grad-clip", 0.5, "--dropout", 0.1,
            "--eval-interval", 2, "--ckpt-interval", 2, "--seed", 5)
    tiny = TINY[:8] + ["--eval-iters", "1", "--no-progress"]  # no --batch-size
    call("train.py", "--out-dir", tmp_path / "straight", "--max-iters", 4, *tiny, *args)
    call("train.py", "--out-dir", tmp_path / "halves", "--max-iters", 2, *tiny, *args)
    p = call("train.py", "--out-dir", tmp_path / "halves", "--resume", "--max-iters", 4, "--no-progress")
    assert "naive" in p.stdout and f"{7 * 16 * 3} tokens/iter" in p.stdout
    assert [s for s in p.stdout.splitlines() if s.startswith("resume:")] == [
        "resume: flags replace the checkpoint's max_iters 2 -> 4"]
    a, b = (load_file(tmp_path / d / "ckpt-000004" / "model.safetensors") for d in ("straight", "halves"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = (json.loads((tmp_path / d / "ckpt-000004" / "meta.json").read_text()) for d in ("straight", "halves"))
    assert ma["config"]["train"] == mb["config"]["train"] and ma["curve"] == mb["curve"]


def _lr(out: Path, step: int) -> float:
    meta = json.loads((out / f"ckpt-{step:06d}" / "meta.json").read_text())
    return meta["optimizer"]["param_groups"][0]["lr"]


def test_a_longer_max_iters_keeps_the_learning_rate_schedule(tmp_path):
    """4 steps decay to --min-lr; --resume --max-iters 6 stays there (before: the cosine
    restarted over 6 steps and the rate jumped up), unless --lr-decay-iters says otherwise."""
    out = tmp_path / "run"
    train(out, 4, "--eval-interval", "2", "--ckpt-interval", "1", "--warmup-iters", "1")
    assert _lr(out, 4) > 2e-4  # the rate of step 4, not yet the floor
    train(out, 5, "--resume", "--eval-interval", "2", "--ckpt-interval", "1")
    assert _lr(out, 5) == 2e-4
    p = train(out, 6, "--resume", "--lr-decay-iters", "8")
    assert "lr_decay_iters 4 -> 8" in p.stdout and _lr(out, 6) > 2e-4


def test_resume_says_which_settings_changed_and_keeps_the_seed(tmp_path):
    out = tmp_path / "run"
    train(out, 2, "--eval-interval", "2", "--ckpt-interval", "2")
    p = call("train.py", "--out-dir", out, "--resume", "--max-iters", 3, "--lr", 1e-3, "--weight-decay", 0,
             "--eval-interval", 1, "--no-progress")
    lines = [s for s in p.stdout.splitlines() if s.startswith("resume:")]
    assert lines == ["resume: flags replace the checkpoint's max_iters 2 -> 3, eval_interval 2 -> 1",
                     ("resume: flags change the training itself (no longer the run as started): lr 0.002 -> 0.001, "
                      "weight_decay 0.1 -> 0.0")]
    meta = json.loads((out / "ckpt-000003" / "meta.json").read_text())
    assert meta["optimizer"]["param_groups"][0]["weight_decay"] == 0.0 and meta["config"]["train"]["lr"] == 1e-3
    p = call("train.py", "--out-dir", out, "--resume", "--max-iters", 4, "--seed", 9, check=False)
    _one_line_error(p, "--seed 9 cannot change on --resume")
    p = call("train.py", "--out-dir", out, "--resume", "--max-iters", 4, "--min-lr", 0.01, check=False)
    _one_line_error(p, "--min-lr 0.01 is above --lr 0.001")


# ----------------------------------------------------------------------------- 13: validate what is loaded


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "run"
    train(out, 4, "--eval-interval", "2", "--ckpt-interval", "2")
    return out


def _retensor(ckpt: Path, name: str, key: str, change) -> None:
    """Rewrite one tensor of a checkpoint file and re-record the file's size and sha256,
    so that loading gets past the integrity check to the tensor itself."""
    tensors = load_file(ckpt / name)
    tensors[key] = change(tensors[key])
    save_file(tensors, str(ckpt / name))
    _remeta(ckpt, lambda m: m["files"][name].update(bytes=(ckpt / name).stat().st_size,
                                                    sha256=hashlib.sha256((ckpt / name).read_bytes()).hexdigest()))


def _remeta(ckpt: Path, change) -> None:
    """Change meta.json and re-record its own sha256, so that loading gets past the
    checksum to the fields themselves."""
    meta = json.loads((ckpt / "meta.json").read_text())
    change(meta)
    meta["meta_sha256"] = checkpoint.meta_digest(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))


TAMPER = {
    "weight-as-int32": (lambda c: _retensor(c, "model.safetensors", "wpe.weight", lambda t: t.view(torch.int32)),
                        "wpe.weight is int32 (16, 16), expected float32 (16, 16)"),
    "weight-nan": (lambda c: _retensor(c, "model.safetensors", "wpe.weight", lambda t: t * float("nan")),
                   "wpe.weight holds NaN or inf"),
    "adam-as-int32": (lambda c: _retensor(c, "optimizer.safetensors", "state.0.exp_avg", lambda t: t.view(torch.int32)),
                      "state.0.exp_avg is int32"),
    "adam-shape": (lambda c: _retensor(c, "optimizer.safetensors", "state.0.exp_avg_sq", lambda t: t[:1].clone()),
                   "state.0.exp_avg_sq is float32 (1, 16)"),
    "adam-step": (lambda c: _retensor(c, "optimizer.safetensors", "state.3.step", lambda t: t - 9),
                  "state.3.step is -5"),
    "step-negative": (lambda c: _remeta(c, lambda m: m.update(step=-5)), "step must be an int >= 1, got -5"),
    "history-string": (lambda c: _remeta(c, lambda m: m.update(history="oops")), "malformed history"),
    "curve-short": (lambda c: _remeta(c, lambda m: m.update(curve=m["curve"][:2])), "malformed curve"),
    "batch-negative": (lambda c: _remeta(c, lambda m: m["config"]["train"].update(batch_size=-7)),
                       "bad training setting batch_size=-7"),
    "bias-string": (lambda c: _remeta(c, lambda m: m["config"]["model"].update(bias="yes")), "bias='yes'"),
    "huge-model": (lambda c: _remeta(c, lambda m: m["config"]["model"].update(n_layer=10**6)),
                   "does not fit the model"),
    "eps-negative": (lambda c: _remeta(c, lambda m: m["optimizer"]["param_groups"][0].update(eps=-1)), "bad eps -1"),
    # issue 22 item 6: these four got through (tracebacks, or a curve the next checkpoint failed on)
    "rng-random-bytes": (lambda c: _retensor(c, "optimizer.safetensors", "rng.batches", lambda t: torch.randint(
        0, 256, t.shape, dtype=torch.uint8, device="cpu", generator=torch.Generator().manual_seed(0))),
        "rng.batches is not a random generator state"),
    "curve-empty": (lambda c: _remeta(c, lambda m: m.update(curve=[])), "malformed curve"),
    "batch-huge": (lambda c: _remeta(c, lambda m: m["config"]["train"].update(batch_size=10**12)),
                   "bad training setting batch_size=1000000000000"),
    "model-a-directory": (lambda c: ((c / "model.safetensors").unlink(), (c / "model.safetensors").mkdir()),
                          "model.safetensors: not a file"),
    # meta.json's own sha256: an edit that every other check passes (n_embd 16 is divisible by 1 head)
    "n-head-edited": (lambda c: (c / "meta.json").write_text((c / "meta.json").read_text().replace(
        '"n_head": 2', '"n_head": 1')), "meta.json: corrupt or edited (sha256 mismatch)"),
}
SAMPLE_TOO = ("weight-as-int32", "weight-nan", "step-negative", "history-string", "bias-string", "huge-model",
              "curve-empty", "batch-huge", "model-a-directory", "n-head-edited")


@pytest.mark.parametrize("damage", list(TAMPER))
def test_tampered_checkpoints_are_one_line_errors(trained, tmp_path, damage):
    """Each file still matches its recorded sha256: the tensors and fields themselves are
    checked by dtype, shape, type and range (before: an int32 tensor loaded as floats, a
    negative step resumed at -5, a string history was a traceback, ...)."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    tamper, needle = TAMPER[damage]
    tamper(checkpoint.resolve(out))
    p = call("train.py", "--out-dir", out, "--max-iters", 6, "--resume", "--no-progress", check=False)
    _one_line_error(p, needle)
    if damage in SAMPLE_TOO:
        _one_line_error(call("sample.py", "--ckpt", out, "--max-new-tokens", 3, check=False), needle)


@pytest.mark.parametrize("fails", [False, True], ids=["replaced", "full-disk"])
def test_an_earlier_run_with_a_symlinked_checkpoint(trained, tmp_path, monkeypatch, fails):
    """The earlier run's `latest` is a symlink to a directory elsewhere. A fresh run that
    cannot write leaves it loadable (before: `latest` was gone while the warning said
    "intact"); one that can replaces the link, and leaves what it pointed to alone."""
    out, moved = tmp_path / "run", tmp_path / "elsewhere"
    shutil.copytree(trained, out)
    (out / "ckpt-000004").rename(moved)
    (out / "ckpt-000004").symlink_to(moved)
    assert _loads(out)["step"] == 4  # --resume and sample.py read through the link
    kept = _snapshot(moved)
    if fails:
        monkeypatch.setattr(checkpoint, "save_file", _full_disk)
    p = train(out, 2, "--eval-interval", "2", "--ckpt-interval", "1", "--overwrite", check=False)
    assert p.returncode == (2 if fails else 0) and "Traceback" not in p.stderr, p.stderr
    assert _loads(out)["step"] == (4 if fails else 2)
    assert (out / "ckpt-000004").is_symlink() == fails and _snapshot(moved) == kept


def test_a_format_1_checkpoint_samples_but_does_not_resume(trained, tmp_path):
    """Format 1 recorded its training settings as strings and meta.json no sha256 of its
    own: --resume cannot restore the run, sample.py reads it."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    meta_path = checkpoint.resolve(out) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.update(format=1, config=dict(meta["config"], train={k: str(v) for k, v in meta["config"]["train"].items()}))
    del meta["meta_sha256"], meta["config"]["world_size"]
    meta_path.write_text(json.dumps(meta))
    p = call("train.py", "--out-dir", out, "--max-iters", 6, "--resume", "--no-progress", check=False)
    _one_line_error(p, "format 1 was written by an older train.py", "--resume needs format 2")
    assert call("sample.py", "--ckpt", out, "--max-new-tokens", 3).stdout


def test_sample_refuses_nan_weights_in_one_line(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    ckpt = checkpoint.resolve(out)
    for key in load_file(ckpt / "model.safetensors"):
        _retensor(ckpt, "model.safetensors", key, lambda t: torch.full_like(t, float("nan")))
    _one_line_error(call("sample.py", "--ckpt", out, "--max-new-tokens", 3, check=False), "holds NaN or inf")


# ----------------------------------------------------------------------------- 14: help and figures


def _help_entries(text: str) -> dict[str, str]:
    """--flag -> its whole help text, from argparse's --help output."""
    entries, current = {}, None
    for line in text.splitlines():
        m = re.match(r"  (-\S+)", line)
        if m:
            current = m.group(1).rstrip(",")
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_every_flag_shows_its_default_and_meaning(script):
    p = call(script, "--help", check=False)
    assert p.returncode == 0
    entries = _help_entries(p.stdout)
    assert "--out-dir" in entries or "--ckpt" in entries
    for flag, text in entries.items():
        if flag not in ("-h", "--help"):  # a sentence of meaning, and the default
            assert re.search(r"\(default: [^)]+\)|\(required\)", text) and len(text.split()) >= 6, (flag, text)


def test_the_closing_tokens_per_second_count_training_time_only(monkeypatch, tmp_path):
    """A clock that jumps 1000 s in every evaluation and every checkpoint: the closing
    tokens/s stays that of the training steps, and the evaluation and checkpoint times are
    reported apart."""
    mod, real_clock, jump = _module("train.py"), __import__("time").perf_counter, [0.0]
    real_eval, real_save = mod.evaluate, checkpoint.save

    def slow(f):
        def wrapped(*a, **k):
            jump[0] += 1000.0
            return f(*a, **k)
        return wrapped

    monkeypatch.setattr(mod, "evaluate", slow(real_eval))
    monkeypatch.setattr(checkpoint, "save", slow(real_save))
    monkeypatch.setattr(mod.time, "perf_counter", lambda: real_clock() + jump[0])
    p = train(tmp_path / "run", 3, "--eval-interval", "1", "--ckpt-interval", "1")
    monkeypatch.undo()
    done = next(s for s in p.stdout.splitlines() if s.startswith("done:"))
    rate = int(re.search(r"\(([\d,]+) tokens/s\)", done).group(1).replace(",", ""))
    assert rate > 3 * 4 * 16 / 60, done  # 3 steps of 64 tokens took less than a minute, not 6000 s
    assert re.search(r"evaluation 300\d\.\ds, checkpoints 300\d\.\ds", done), done


# ----------------------------------------------------------------------------- issue 22: divergence, disk, restarts


def test_a_diverged_run_stops_unsaved_and_resume_continues_from_the_last_good_step(tmp_path):
    """--resume with a learning rate of 1e4: the update of step 5 is 8.9e3 times the
    weights, training losses reach 4.2e8 at the step-6 checkpoint, and the gradient norm
    is inf at step 8 (torch 2.13 on CPU; the test was written where it was NaN at step 6).
    The run stops there with one line naming the step, the checkpoint to go on from and
    the command, exit 3; nothing of the diverged step is written, and the step-6
    checkpoint is a suspect that `latest` does not name (before: `latest` moved to it; and
    before that, NaN weights were saved at steps 6 and 8, the good checkpoints pruned, exit
    0). A plain --resume then goes on from step 4 with the recorded settings."""
    out = tmp_path / "run"
    train(out, 4, "--eval-interval", "2", "--ckpt-interval", "2")
    before = _snapshot(out)
    p = call("train.py", "--out-dir", out, "--resume", "--max-iters", 8, "--lr", 1e4, "--lr-decay-iters", 8,
             "--no-progress", check=False)
    assert p.returncode == 3 and "Traceback" not in p.stderr, p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert re.match(rf"error: {re.escape(str(out))}: training diverged at step [68] \(loss ", line), line
    assert "; ckpt-000004 is the last checkpoint that passed the update check (latest names it)" in line, line
    assert line.endswith(f"train.py --out-dir {out} --resume ckpt-000004 --max-iters 8 --lr-decay-iters 8 "
                         "--no-progress"), line
    after = _snapshot(out)
    assert {k: v for k, v in before.items() if k == "latest" or k.startswith("ckpt-000004/")}.items() <= after.items()
    assert not any(k.startswith(("ckpt-000007", "ckpt-000008")) for k in after)
    p = call("train.py", "--out-dir", out, "--resume", "--max-iters", 8, "--no-progress")
    assert "iters 4..8" in p.stdout and _loads(out)["step"] == 8


def _disk_for_two(out: Path, what: str):
    """A disk with room for two checkpoints and not three, full when a third is being
    written: `what` is the write that finds it full, the optimizer tensors (the safetensors
    writer's own error) or `latest` (the atomic writer's OSError)."""
    def full() -> bool:
        return len(list(out.rglob("optimizer.safetensors"))) > 2

    real_save_file, real_write_json = checkpoint.save_file, checkpoint.write_json

    def save_file(tensors, filename, *a, **k):
        real_save_file(tensors, filename, *a, **k)
        if what == "tensors" and full():
            _full_disk(tensors, filename)

    def write_json(path, obj, **k):
        if what == "latest" and Path(path).name == "latest" and full():
            raise OSError(28, "No space left on device")
        real_write_json(path, obj, **k)

    return save_file, write_json


@pytest.mark.parametrize("what", ["tensors", "latest"])
def test_a_disk_that_holds_two_checkpoints_but_not_three_keeps_every_step(tmp_path, monkeypatch, what):
    """A checkpoint every step on a disk with room for two: each write after the second
    finds it full, frees the oldest checkpoint (never the one `latest` names) and succeeds
    on the second try (before: every step after the second was lost, exit 2)."""
    out = tmp_path / "run"
    save_file, write_json = _disk_for_two(out, what)
    monkeypatch.setattr(checkpoint, "save_file", save_file)
    monkeypatch.setattr(checkpoint, "write_json", write_json)
    p = train(out, 5, "--eval-interval", "5", "--ckpt-interval", "1", check=False)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert sorted(x.name for x in out.glob("ckpt-*")) == ["ckpt-000004", "ckpt-000005"]
    monkeypatch.undo()
    assert _loads(out)["step"] == 5


def test_when_only_latest_cannot_be_written_the_error_says_so(tmp_path, monkeypatch):
    """The checkpoint directory is written and renamed into place, and only `latest` fails
    (before: "checkpoint at step 2 not written", which was false): the line says where the
    checkpoint is and that `latest` did not move."""
    out = tmp_path / "run"
    real = checkpoint.write_json

    def write_json(path, obj, **k):
        if Path(path).name == "latest":
            raise OSError(28, "No space left on device")
        real(path, obj, **k)

    monkeypatch.setattr(checkpoint, "write_json", write_json)
    p = train(out, 2, "--eval-interval", "2", "--ckpt-interval", "2", check=False)
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: {out}: checkpoint at step 2 written to {out}/ckpt-000002 but latest not moved to it "
        f"(No space left on device); {out} has no latest yet")
    monkeypatch.undo()
    assert not (out / "latest").exists() and _loads(out / "ckpt-000002")["step"] == 2


def test_a_fresh_run_into_another_runs_checkpoints_needs_overwrite(tmp_path):
    """Refused in one line naming --resume and --overwrite, before any training, and the
    earlier run untouched (before: its checkpoints went once the new run's first was
    written, with only a note)."""
    out = tmp_path / "run"
    train(out, 2, "--eval-interval", "2", "--ckpt-interval", "2")
    before = _snapshot(out)
    p = train(out, 2, "--seed", "7", check=False)
    _one_line_error(p, f"--out-dir {out} holds another run's checkpoints", "--resume", "--overwrite")
    assert "GPT" not in p.stdout and _snapshot(out) == before
    p = call("train.py", "--out-dir", out, "--resume", "--overwrite", check=False)
    assert p.returncode == 2 and "not allowed with argument" in p.stderr


def test_make_train_twice_works(tmp_path):
    """The Makefile's train command, run twice into one directory (tiny and short here):
    the second run starts over, as the README says."""
    printed = run_limited(["make", "--no-print-directory", "-n", "train", "THREADS=1"], seconds=60, cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout
    recipe = next(line for line in printed.splitlines() if "scripts/train.py" in line)
    flags = recipe.split("scripts/train.py")[1].split()
    assert flags[-2:] == ["--threads", "1"], recipe
    out = tmp_path / "run"
    flags[flags.index("--out-dir") + 1] = str(out)
    for seed in (1, 2):
        call("train.py", *flags, "--max-iters", 2, "--eval-interval", 2, "--ckpt-interval", 2, "--seed", seed,
             *TINY)
    assert _loads(out)["config"]["train"]["seed"] == 2


def _importing_torch(pid: int) -> bool:
    """Whether the process has begun loading torch's libraries (so it runs train.py)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps")
def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    """SIGINT while train.py imports torch (seconds), and at moments after it up to the
    first steps: one line and exit 130, never a traceback (before: a KeyboardInterrupt
    traceback from inside the imports). Two moments: as torch's libraries load, and 2 s
    later (the moments 0.5 and 1 s once tried too met the same held signal on a 2-core
    machine, each process paying the whole import before it exits)."""
    for n, delay in enumerate((0.0, 2.0)):
        log = tmp_path / f"{n}.log"
        proc = start("train.py", "--out-dir", tmp_path / f"run{n}", "--max-iters", 100000, *TINY, log=log,
                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        wait_for(lambda p=proc: _importing_torch(p.pid) or p.poll() is not None, what="the import of torch", log=log)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        code = wait(proc, seconds=120, log=log)
        text = log.read_text()
        lines = [s for s in text.splitlines() if s.startswith(("error", "stopped"))]
        assert code == 130 and "Traceback" not in text and len(lines) == 1, (delay, text)
