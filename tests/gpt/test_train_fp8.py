"""scripts/train.py --fp8 row: the block norms' fused Linears in fp8 (Norm.linear_quant);
refused where there is no fused norm + Linear."""
from trainutil import call

import fuseblock


def test_fp8_trains_a_few_steps(tmp_path):
    p = call("train.py", "--out-dir", tmp_path / "run", "--fp8", "row", "--max-iters", 2, "--eval-interval", 2,
             "--eval-iters", 1, "--n-layer", 1, "--n-embd", 32, "--n-head", 2, "--batch-size", 2, "--no-progress")
    assert "step 2: train" in p.stdout + p.stderr


def test_fp8_with_the_naive_stack_is_refused(tmp_path):
    p = call("train.py", "--out-dir", tmp_path / "run", "--fp8", "row", "--impl", "naive", check=False)
    assert p.returncode == 2 and "--fp8" in p.stderr and "Traceback" not in p.stderr


FP8_TINY = ["--max-iters", 2, "--eval-interval", 2, "--eval-iters", 1, "--n-layer", 1, "--n-embd", 32,
            "--n-head", 2, "--batch-size", 2, "--no-progress"]


def test_fp8_with_n_streams_is_refused_not_trained_without_fp8(tmp_path):
    p = call("train.py", "--out-dir", tmp_path / "run", "--fp8", "row", "--hc", 2, *FP8_TINY, check=False)
    assert p.returncode == 2 and "--fp8 row" in p.stderr and "--hc 2" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("ckpt-*"))


def test_fp8_is_recorded_and_kept_on_resume_and_cannot_be_added_on_resume(tmp_path):
    from models import checkpoint

    call("train.py", "--out-dir", tmp_path / "fp8", "--fp8", "row", *FP8_TINY)
    meta = checkpoint.read_meta(checkpoint.resolve(tmp_path / "fp8"))
    assert meta["config"]["model"]["fp8"] == "row"
    # a resume without --fp8 keeps it: the restored model's block norms still quantize
    p = call("train.py", "--out-dir", tmp_path / "fp8", "--resume", "--max-iters", 3, "--no-progress")
    assert p.returncode == 0
    assert checkpoint.read_meta(checkpoint.resolve(tmp_path / "fp8"))["config"]["model"]["fp8"] == "row"
    # a run without fp8 resumed with --fp8: a config mismatch, not a silent switch
    call("train.py", "--out-dir", tmp_path / "plain", *FP8_TINY)
    assert checkpoint.read_meta(checkpoint.resolve(tmp_path / "plain"))["config"]["model"]["fp8"] is None
    p = call("train.py", "--out-dir", tmp_path / "plain", "--resume", "--max-iters", 3, "--fp8", "row",
             "--no-progress", check=False)
    assert p.returncode == 2 and "config mismatch" in p.stderr and "fp8" in p.stderr
    # nor can a resume turn the fp8 run's stack naive under it
    p = call("train.py", "--out-dir", tmp_path / "fp8", "--resume", "--max-iters", 4, "--impl", "naive",
             "--no-progress", check=False)
    assert p.returncode == 2 and "--fp8 row" in p.stderr and "--impl naive" in p.stderr


def test_the_fp8_model_quantizes_its_block_norms_linears_and_the_plain_one_does_not():
    from models.gpt import GPT, GPTConfig

    fp8 = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8, fp8="row"))
    plain = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8))
    quant = {m.linear_quant for m in fp8.stack.modules() if isinstance(m, fuseblock.Norm)}
    assert quant == {"fp8_row"}
    assert {m.linear_quant for m in plain.stack.modules() if isinstance(m, fuseblock.Norm)} == {None}
