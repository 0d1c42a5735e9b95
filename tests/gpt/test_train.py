"""End to end: train, resume bit-exactly, sample; bad CLI values and missing data fail
before any work."""
import hashlib
import json
import lzma
import sys
import textwrap

import numpy as np
import pytest
import timeouts
from safetensors.torch import load_file
from trainutil import ROOT, TINY, call, env, full_disk_at, run, train

from models import data, settings
from models.gpt import GPTConfig


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
    sample = ("sample.py", "--ckpt", out, "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "1",
              "--threads", "1")
    s = run(*sample)
    assert s.stdout.startswith("ROMEO:") and len(s.stdout.encode()) >= 40
    again = call(*sample)  # the same seed in another process (this one): the same text
    assert again.stdout == s.stdout


def test_resume_is_bit_exact_on_cpu(tmp_path):
    """10 straight iterations == 5, then --resume to 10: weights, optimizer state, losses.
    Dropout on (the RNG state is restored), a short warmup so the cosine is live, and one
    schedule length (--lr-decay-iters) for both, so where a run stops changes nothing."""
    args = ("--eval-interval", "5", "--ckpt-interval", "5", "--dropout", "0.1", "--warmup-iters", "2",
            "--lr-decay-iters", "10")
    train(tmp_path / "straight", 10, *args)
    train(tmp_path / "halves", 5, *args)
    train(tmp_path / "halves", 10, "--resume", *args)
    a = load_file(tmp_path / "straight" / "ckpt-000010" / "model.safetensors")
    b = load_file(tmp_path / "halves" / "ckpt-000010" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    oa = load_file(tmp_path / "straight" / "ckpt-000010" / "optimizer.safetensors")
    ob = load_file(tmp_path / "halves" / "ckpt-000010" / "optimizer.safetensors")
    assert oa.keys() == ob.keys() and all((oa[k] == ob[k]).all() for k in oa)
    ma = json.loads((tmp_path / "straight" / "ckpt-000010" / "meta.json").read_text())
    mb = json.loads((tmp_path / "halves" / "ckpt-000010" / "meta.json").read_text())
    assert ma["history"] == mb["history"] and ma["curve"] == mb["curve"] and len(ma["curve"]) == 10


def test_resume_takes_the_model_config_from_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    train(out, 2, "--eval-interval", "2", "--ckpt-interval", "2", "--norm", "layer")
    # no model flags: the checkpoint's (1 layer, n_embd 16, block 16, layer norm), not the defaults
    p = call("train.py", "--out-dir", out, "--max-iters", "3", "--resume", "--batch-size", "2", "--eval-iters", "1",
             "--no-progress")
    assert "0.01M params" in p.stdout and "iters 2..3" in p.stdout
    cfg = json.loads((out / "ckpt-000003" / "meta.json").read_text())["config"]["model"]
    assert (cfg["n_layer"], cfg["n_embd"], cfg["block_size"], cfg["norm"]) == (1, 16, 16, "layer")
    p = call("train.py", "--out-dir", out, "--max-iters", "3", "--resume", check=False)
    assert p.returncode == 2 and "already at step 3" in p.stderr


def test_a_fresh_run_replaces_an_earlier_runs_checkpoints(tmp_path):
    out = tmp_path / "run"
    train(out, 6, "--eval-interval", "6", "--ckpt-interval", "3")
    p = train(out, 2, "--eval-interval", "2", "--ckpt-interval", "2", "--overwrite")
    assert "another run's checkpoints" in p.stdout and "--overwrite" in p.stdout
    assert sorted(x.name for x in out.iterdir()) == ["ckpt-000002", "latest", "loss.png"]


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


@pytest.mark.parametrize("train,flags", [
    ({"batch_size": 2**20 + 1}, ["--batch-size", 2**20 + 1]),
    ({"grad_accum": 2**20 + 1}, ["--grad-accum", 2**20 + 1]),
    ({"batch_size": 2**10, "grad_accum": 2**11}, ["--batch-size", 2**10, "--grad-accum", 2**11]),
    ({"min_lr": 0.5}, ["--min-lr", 0.5]),
    ({"dropout": 1.0}, ["--dropout", 1.0]),
])
def test_one_table_bounds_the_command_line_and_meta_json_alike(tmp_path, train, flags):
    """models/settings.py holds each setting's kind and bounds once: a value the command line
    refuses, meta.json's check refuses too (before: --batch-size had no upper bound, and a
    recorded 10**12 reached the allocator)."""
    p = call("train.py", "--out-dir", tmp_path / "x", *flags, check=False)
    assert p.returncode == 2 and "usage:" in p.stderr and str(flags[0]) in p.stderr, p.stderr
    recorded = dict(settings.TRAIN_DEFAULTS, lr_decay_iters=1000)
    meta = {"format": 3, "step": 1, "config": {"model": GPTConfig().to_json(), "train": recorded, "world_size": 1}}
    assert settings.meta_problem(meta) is None
    recorded.update(train)
    problem, field = settings.meta_problem(meta), next(iter(train))
    assert problem is not None and problem.startswith("bad training setting"), problem
    assert f"{field}=" in problem or f"--{field.replace('_', '-')} " in problem, problem


def test_sample_rejects_bad_values(tmp_path):
    p = call("sample.py", "--ckpt", tmp_path, "--top-k", "0", check=False)
    assert p.returncode == 2 and "--top-k" in p.stderr and "Traceback" not in p.stderr


def test_data_cache_is_rebuilt_when_the_source_changes(tmp_path):
    src, cache = tmp_path / "text.xz", tmp_path / "cache"
    src.write_bytes(lzma.compress(bytes(range(256)) * 40))
    paths = data.prepare(src, cache)
    train_bytes = np.fromfile(paths["train"], dtype=np.uint8)
    assert len(train_bytes) == int(256 * 40 * 0.9) and train_bytes[:256].tolist() == list(range(256))
    assert len(np.fromfile(paths["val"], dtype=np.uint8)) == 256 * 40 - len(train_bytes)
    src.write_bytes(lzma.compress(b"to be or not to be " * 100))  # a rebuilt corpus: the cache is stale
    data.prepare(src, cache)
    assert paths["train"].read_bytes().startswith(b"to be or not")


@pytest.mark.parametrize("damage,needle", [
    ("missing", "is missing: restore it with `git checkout --"),
    ("corrupt", "cannot decompress"),
])
def test_missing_or_unreadable_data_says_how_to_fix_it(tmp_path, monkeypatch, damage, needle):
    src = tmp_path / "shakespeare.txt.xz"
    if damage == "corrupt":
        src.write_bytes(b"this is not xz")
    monkeypatch.setattr(data, "SOURCE", src)
    monkeypatch.setattr(data, "CACHE", tmp_path / "cache")
    data.load.cache_clear()
    try:
        with pytest.raises(data.DataError, match="scripts/prepare_data.py"):
            data.prepare()
        p = call("train.py", "--out-dir", tmp_path / "x", check=False)
    finally:
        data.load.cache_clear()
    assert p.returncode == 2 and "usage:" in p.stderr and needle in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "x").exists()


def test_unwritable_cache_is_a_clear_error(tmp_path):
    src = tmp_path / "text.xz"
    src.write_bytes(lzma.compress(b"abc" * 100))
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    with pytest.raises(data.DataError, match="cannot write the data cache"):
        data.prepare(src, blocker)


# A failed cache build leaves no partial file. A guard: the cache writer was atomic before
# models/atomic.py (a temporary file, fsync, os.replace), so these passed before it too.
OLD, NEW = bytes(range(256)) * 400, b"to be or not to be " * 5000


def _splits(text):
    cut = int(len(text) * (1 - data.VAL_FRACTION))
    return {"train.bin": text[:cut], "val.bin": text[cut:]}


def _assert_no_partial_file(cache, new_xz, earlier=None):
    """Only whole files in `cache`: no temporaries; train.bin and val.bin absent or exactly a
    split of the new text or of the earlier one; meta.json absent or the earlier build's,
    never marking the failed build complete."""
    names = sorted(p.name for p in cache.iterdir())
    assert set(names) <= {"train.bin", "val.bin", "meta.json"}, names
    texts = [NEW] + ([earlier[0]] if earlier else [])
    for name in set(names) - {"meta.json"}:
        assert (cache / name).read_bytes() in [_splits(t)[name] for t in texts], f"{name} is partial"
    if "meta.json" in names:
        sha = json.loads((cache / "meta.json").read_text())["sha256"]
        assert earlier, "meta.json marks a failed build complete"
        assert sha == hashlib.sha256(earlier[1]).hexdigest() != hashlib.sha256(new_xz).hexdigest(), "meta.json"


def _assert_next_build_completes(src, cache):
    paths = data.prepare(src, cache)
    assert {path.name: path.read_bytes() for path in paths.values()} == _splits(NEW)
    assert sorted(p.name for p in cache.iterdir()) == ["meta.json", "train.bin", "val.bin"]


@pytest.mark.parametrize("fail_at", [1, 2, 3], ids=["train.bin", "val.bin", "meta.json"])
@pytest.mark.parametrize("earlier", [False, True], ids=["no-cache", "stale-cache"])
def test_a_failed_data_cache_write_leaves_no_partial_file(tmp_path, monkeypatch, fail_at, earlier):
    """The cache build's rename of train.bin, val.bin or meta.json fails (a full disk), into
    an empty cache or over a stale one of an earlier corpus."""
    src, cache = tmp_path / "text.xz", tmp_path / "cache"
    old_xz, new_xz = lzma.compress(OLD), lzma.compress(NEW)
    if earlier:
        src.write_bytes(old_xz)
        data.prepare(src, cache)
    src.write_bytes(new_xz)
    seen = full_disk_at(monkeypatch, fail_at)
    with pytest.raises(data.DataError, match=r"cannot write the data cache .*\(No space left on device\)"):
        data.prepare(src, cache)
    monkeypatch.undo()
    assert seen.calls == fail_at
    _assert_no_partial_file(cache, new_xz, (OLD, old_xz) if earlier else None)
    _assert_next_build_completes(src, cache)


_PREPARE_UNDER_LIMIT = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    from models import data
    limit = int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        data.prepare(Path(sys.argv[1]), Path(sys.argv[2]))
    except data.DataError as e:
        print(e)
        sys.exit(3)
""")


def test_a_real_full_disk_during_the_data_cache_build_leaves_no_partial_file(tmp_path):
    """A new process under a file-size limit that train.bin exceeds: its write fails part
    way (EFBIG) with some of the bytes on disk."""
    src, cache = tmp_path / "text.xz", tmp_path / "cache"
    new_xz = lzma.compress(NEW)
    src.write_bytes(new_xz)
    limit = len(_splits(NEW)["train.bin"]) // 2
    p = timeouts.run([sys.executable, "-c", _PREPARE_UNDER_LIMIT, str(src), str(cache), str(limit)],
                     capture_output=True, text=True, env=env(), cwd=ROOT, seconds=120, check=False)
    assert p.returncode == 3 and "cannot write the data cache" in p.stdout and "File too large" in p.stdout, p
    _assert_no_partial_file(cache, new_xz)
    _assert_next_build_completes(src, cache)


@pytest.mark.parametrize("n_embd", [4_000_000_000])  # torch: size overflow (no allocation tried)
def test_a_model_too_large_to_build_is_one_line_naming_its_size_flags(tmp_path, n_embd):
    p = call("train.py", "--out-dir", tmp_path / "x", "--n-embd", n_embd, "--n-head", 1, "--no-progress",
             check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"--n-embd {n_embd}" in p.stderr and "does not fit" in p.stderr
