"""A divergence leaves a checkpoint to resume from (issue 35, item 2): the update check
keeps `latest` on weights that no ruinous step touched, pruning keeps them, the error
prints the command that continues from them, and --resume / --resume-step name any kept
checkpoint."""
import json
import math
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from trainutil import TINY, call, saved_tiny_gpt, train

from models import checkpoint, update_check


def _latest(out: Path) -> str | None:
    return checkpoint.pointer_target(out)


def _meta(ckpt: Path) -> dict:
    return json.loads((ckpt / "meta.json").read_text())


def _names(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("ckpt-*"))


def _diverged(p) -> str:
    """The error line of a diverged run (exit 3, no traceback)."""
    assert p.returncode == 3 and "Traceback" not in p.stderr, p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "training diverged at step" in line, line
    return line


def _printed_command(line: str) -> list[str]:
    """The flags of the train.py command an error line ends with."""
    words = shlex.split(line.split(": ")[-1])
    assert words[0] == "python" and words[1].endswith("train.py"), words
    return words[2:]


def _same_files(a: Path, b: Path) -> None:
    for f in ("model.safetensors", "optimizer.safetensors"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert _meta(a)["curve"] == _meta(b)["curve"] and _meta(a)["history"] == _meta(b)["history"]


# A ruinous learning rate: the first step at it moves every weight by about 1e30, so the next
# step's products overflow and its gradient is NaN on any machine (a rate such as 1000 also
# diverges, but at a step that depends on the CPU's rounding: 18 on one machine, 12 on another).
RUINOUS = 1e30


def test_a_ruinous_lr_after_10_good_steps_resumes_from_the_last_good_checkpoint(tmp_path):
    """10 good steps (checkpoints 5 and 10), then --resume --lr 1e30 to 20 with a checkpoint
    every step. Step 11, from good weights, has a finite loss and moves the weights by about
    1e31 times their size, so ckpt-000011 is written as a suspect and `latest` stays at
    ckpt-000010 (before the update check: `latest` named the ruined weights); step 12's
    gradient norm is NaN. The printed command resumes ckpt-000010 and ends at step 20
    bit-exactly as the run that never saw the ruinous lr; resuming the suspect instead, at a
    sane lr, diverges at once: its weights are ruined."""
    out, straight = tmp_path / "run", tmp_path / "straight"
    flags = ("--eval-interval", "5", "--ckpt-interval", "5")
    train(out, 10, *flags)
    p = call("train.py", "--out-dir", out, "--resume", "--max-iters", 20, "--lr", RUINOUS, "--ckpt-interval", 1,
             "--no-progress", check=False)
    line = _diverged(p)
    assert "training diverged at step 12 (loss " in line and "gradient norm nan" in line, line
    assert "ckpt-000010 is the last checkpoint that passed the update check (latest names it)" in line, line
    assert "step 11 moved the weights by" in line, line
    assert p.stderr.startswith(f"warning: {out}: step 11 moved the weights by"), p.stderr
    suspect = checkpoint.read_meta(out / "ckpt-000011")  # validated: a finite ratio, as meta.json must hold
    assert suspect["update"]["passed"] is False and suspect["update"]["step"] == 11
    assert 1e20 < suspect["update"]["largest"] < math.inf
    good = _meta(out / "ckpt-000010")["update"]
    assert good["passed"] and good["largest"] < 0.01 and good["limit"] == update_check.LIMIT
    assert _latest(out) == "ckpt-000010" and _names(out) == ["ckpt-000010", "ckpt-000011"]

    # the suspect's weights are ruined: from them, at a sane lr, the very next step diverges
    ruined = tmp_path / "ruined"
    shutil.copytree(out, ruined)
    p = call("train.py", "--out-dir", ruined, "--resume", "ckpt-000011", "--max-iters", 20, "--lr", 1e-4,
             "--min-lr", 1e-5, "--no-progress", check=False)
    assert "note: ckpt-000011 did not pass the update check" in p.stdout, p.stdout
    assert "training diverged at step 12 " in _diverged(p)

    args = _printed_command(line)
    assert args == ["--out-dir", str(out), "--resume", "ckpt-000010", "--max-iters", "20", "--ckpt-interval", "1",
                    "--no-progress"], args
    p = call("train.py", *args)
    assert "iters 10..20" in p.stdout and p.stderr == "", p.stderr
    assert _latest(out) == "ckpt-000020"
    train(straight, 10, *flags)
    call("train.py", "--out-dir", straight, "--resume", "--max-iters", 20, "--no-progress")
    _same_files(out / "ckpt-000020", straight / "ckpt-000020")


def test_a_ruinous_lr_from_step_0_starts_again_by_the_printed_command(tmp_path):
    """--lr 1e30 from the first step, a checkpoint every step: step 1 moves the weights by
    about 1e31 times their size, its checkpoint is a suspect and does not become `latest`;
    the gradient norm of step 2 is NaN. The error says no checkpoint passed and prints a fresh
    run's command: the same settings with the default lr and --overwrite, which runs to the
    end and equals a run started that way."""
    out, straight = tmp_path / "run", tmp_path / "straight"
    p = train(out, 8, "--lr", RUINOUS, "--eval-interval", 8, "--ckpt-interval", 1, check=False)
    line = _diverged(p)
    assert "training diverged at step 2 " in line, line
    assert "this run has no checkpoint that passed the update check (step 1 moved the weights by" in line, line
    assert _latest(out) is None and _names(out) == ["ckpt-000001"]
    assert not checkpoint.read_meta(out / "ckpt-000001")["update"]["passed"]

    args = _printed_command(line)
    assert args == ["--out-dir", str(out), "--overwrite", *TINY[:8], "--max-iters", "8", "--batch-size", "4",
                    "--eval-interval", "8", "--eval-iters", "2", "--ckpt-interval", "1", "--no-progress"], args
    p = call("train.py", *args)
    assert "iters 0..8" in p.stdout and p.stderr == "", p.stderr
    assert _latest(out) == "ckpt-000008" and _names(out) == ["ckpt-000007", "ckpt-000008"]
    train(straight, 8, "--eval-interval", 8, "--ckpt-interval", 1)
    _same_files(out / "ckpt-000008", straight / "ckpt-000008")


def test_pruning_and_suspects_never_drop_the_last_checkpoint_that_passed(tmp_path):
    """Checkpoint 1 passed; suspects at 2 to 5: pruning keeps the newest two and the one
    `latest` names, however many suspects follow it, and a suspect that would take its
    name is not written. The next checkpoint that passes moves `latest` and the usual
    pruning resumes."""
    torch.manual_seed(0)
    model, opt, rng = saved_tiny_gpt(tmp_path, 1)
    config = {"model": model.config.to_json()}
    kept = (tmp_path / "ckpt-000001" / "model.safetensors").read_bytes()
    for step in range(2, 6):
        assert checkpoint.save(tmp_path, step, model, opt, config, rng, passed=False) == tmp_path / f"ckpt-{step:06d}"
    assert _names(tmp_path) == ["ckpt-000001", "ckpt-000004", "ckpt-000005"] and _latest(tmp_path) == "ckpt-000001"
    assert checkpoint.save(tmp_path, 1, model, opt, config, rng, passed=False) is None
    assert (tmp_path / "ckpt-000001" / "model.safetensors").read_bytes() == kept
    checkpoint.save(tmp_path, 6, model, opt, config, rng)
    assert _names(tmp_path) == ["ckpt-000005", "ckpt-000006"] and _latest(tmp_path) == "ckpt-000006"


def test_resumed_with_a_ruinous_lr_and_a_checkpoint_every_step_keeps_the_good_one(tmp_path):
    """Through train.py: after 4 good steps, --lr 100 with a checkpoint every step writes
    suspects at 5 and 6 (each step would otherwise have pruned ckpt-000004 away) and
    ckpt-000004 stays `latest`."""
    out = tmp_path / "run"
    train(out, 4, "--eval-interval", 4, "--ckpt-interval", 2)
    p = call("train.py", "--out-dir", out, "--resume", "--max-iters", 6, "--lr", 100, "--ckpt-interval", 1,
             "--no-progress")
    assert "latest names ckpt-000004, not this run's last checkpoint" in p.stderr, p.stderr
    assert _names(out) == ["ckpt-000004", "ckpt-000005", "ckpt-000006"] and _latest(out) == "ckpt-000004"


def test_a_fresh_run_that_writes_only_suspects_leaves_the_earlier_run(tmp_path):
    """With --overwrite, an earlier run's checkpoints go once the new run's first
    checkpoint that passed is written: suspects do not count, and a suspect of the step
    `latest` names does not replace it."""
    out = tmp_path / "run"
    train(out, 2, "--eval-interval", 2, "--ckpt-interval", 2)
    before = (out / "ckpt-000002" / "model.safetensors").read_bytes()
    # lr 100: step 1 moves the weights by about 24 times their size, and no step diverges
    p = train(out, 3, "--lr", 100, "--eval-interval", 3, "--ckpt-interval", 1, "--overwrite")
    assert "suspect checkpoint at step 2 not written: ckpt-000002 is the last that passed" in p.stderr, p.stderr
    assert _latest(out) == "ckpt-000002" and (out / "ckpt-000002" / "model.safetensors").read_bytes() == before
    assert _names(out) == ["ckpt-000002", "ckpt-000003"]
    assert not _meta(out / "ckpt-000003")["update"]["passed"]


def test_training_that_learns_never_trips_the_check(tmp_path):
    """60 steps of the tiny model with dropout, through the warmup's peak (step 51): every
    checkpoint passes, with a largest update under a tenth of the limit (measured 0.0153)."""
    out = tmp_path / "run"
    train(out, 60, "--dropout", 0.1, "--eval-interval", 60, "--ckpt-interval", 20)
    for name in _names(out):
        update = _meta(out / name)["update"]
        assert update["passed"] and update["largest"] < update_check.LIMIT / 10, (name, update)
    assert _latest(out) == "ckpt-000060"


# ----------------------------------------------------------------------------- --resume NAME, --resume-step N


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "run"
    train(out, 4, "--eval-interval", "2", "--ckpt-interval", "2")
    return out


@pytest.mark.parametrize("flags, problem", [
    (["--resume", "ckpt-000003"], "argument --resume ckpt-000003: no checkpoint ckpt-000003 in {out}"),
    (["--resume", "loss.png"], "argument --resume loss.png: no checkpoint loss.png in {out}"),
    (["--resume", "/elsewhere/ckpt-000002"], "/elsewhere/ckpt-000002 is not in --out-dir {out}"),
    (["--resume-step", "3"], "argument --resume-step 3: no checkpoint of step 3 in {out}"),
    (["--resume", "ckpt-000002", "--resume-step", "4"], "--resume-step 4 names ckpt-000004, another checkpoint"),
])
def test_a_resume_point_that_is_not_kept_is_one_line_listing_the_kept_ones(four, flags, problem):
    p = call("train.py", "--out-dir", four, "--max-iters", 6, "--no-progress", *flags, check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and problem.format(out=four) in lines[0], lines
    assert lines[0].endswith(f"the checkpoints kept in {four}: ckpt-000002, ckpt-000004"), lines
    assert "GPT" not in p.stdout


def test_resume_step_with_overwrite_is_a_usage_error(four):
    p = call("train.py", "--out-dir", four, "--resume-step", 2, "--overwrite", check=False)
    assert p.returncode == 2 and "argument --resume-step: not allowed with argument --overwrite" in p.stderr


@pytest.mark.parametrize("how", ["name", "path", "step"])
def test_resume_from_a_kept_checkpoint_by_name_path_or_step_is_bit_exact(four, tmp_path, how):
    """From ckpt-000002 to step 4 again: the same ckpt-000004 as the straight run."""
    out = tmp_path / "run"
    shutil.copytree(four, out)
    pick = {"name": ["--resume", "ckpt-000002"], "path": ["--resume", str(out / "ckpt-000002")],
            "step": ["--resume-step", "2"]}[how]
    p = call("train.py", "--out-dir", out, "--max-iters", 4, "--no-progress", *pick)
    assert "resume: from ckpt-000002; latest names ckpt-000004" in p.stdout and "iters 2..4" in p.stdout, p.stdout
    _same_files(out / "ckpt-000004", four / "ckpt-000004")
    assert _latest(out) == "ckpt-000004"


def test_a_checkpoint_from_before_the_update_check_resumes_as_one_that_passed(four, tmp_path):
    """meta.json gained `update`; a checkpoint written before it has none: it resumes and
    is listed as passed. A malformed `update` is a one-line error."""
    out = tmp_path / "run"
    shutil.copytree(four, out)
    for name in ("ckpt-000002", "ckpt-000004"):
        meta = _meta(out / name)
        del meta["update"]
        meta["meta_sha256"] = checkpoint.meta_digest(meta)
        (out / name / "meta.json").write_text(json.dumps(meta))
    assert checkpoint.kept(out) == [("ckpt-000002", True), ("ckpt-000004", True)]
    p = call("train.py", "--out-dir", out, "--resume", "--max-iters", 5, "--no-progress")
    assert "iters 4..5" in p.stdout and _latest(out) == "ckpt-000005"

    meta = _meta(out / "ckpt-000005")
    meta["update"]["passed"] = False  # but its largest is within the limit
    meta["meta_sha256"] = checkpoint.meta_digest(meta)
    (out / "ckpt-000005" / "meta.json").write_text(json.dumps(meta))
    p = call("train.py", "--out-dir", out, "--resume", "--max-iters", 6, "--no-progress", check=False)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "meta.json: malformed update check" in p.stderr, p.stderr
