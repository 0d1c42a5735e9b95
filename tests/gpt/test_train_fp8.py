"""scripts/train.py --fp8 row: the block norms' fused Linears in fp8 (Norm.linear_quant);
refused where there is no fused norm + Linear."""
from trainutil import call


def test_fp8_trains_a_few_steps(tmp_path):
    p = call("train.py", "--out-dir", tmp_path / "run", "--fp8", "row", "--max-iters", 2, "--eval-interval", 2,
             "--eval-iters", 1, "--n-layer", 1, "--n-embd", 32, "--n-head", 2, "--batch-size", 2, "--no-progress")
    assert "step 2: train" in p.stdout + p.stderr


def test_fp8_with_the_naive_stack_is_refused(tmp_path):
    p = call("train.py", "--out-dir", tmp_path / "run", "--fp8", "row", "--impl", "naive", check=False)
    assert p.returncode == 2 and "--fp8" in p.stderr and "Traceback" not in p.stderr
