"""DDP on CPU (gloo): 2 processes hold identical weights after training steps, and match one
process that accumulates the same 2 micro-batches."""
import json
import sys

import pytest
import timeouts
import torch
from safetensors.torch import load_file
from trainutil import ROOT, TINY, _module, env

WORKER = str(ROOT / "tests" / "integrations" / "ddp_worker.py")


def _env():
    return {**env(), "OMP_NUM_THREADS": "1"}  # the CPU torch path, this checkout first on the path


@pytest.mark.slow
def test_two_cpu_ranks_match_one_process_with_two_accumulation_steps(tmp_path):
    common = ["--max-iters", "2", "--eval-interval", "1000", "--ckpt-interval", "1000", *TINY]
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    ddp.mkdir()
    timeouts.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER,
                  str(ddp), "--out-dir", str(ddp / "run"), "--device", "cpu", *common],
                 check=True, env=_env(), cwd=ROOT, capture_output=True, seconds=240)
    # one process: train.py's main() here, as the worker runs it in each rank (no start-up of its own)
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    try:
        with torch.device("cpu"):
            result = _module("train.py").main(["--out-dir", str(single / "run"), "--device", "cpu",
                                               "--grad-accum", "2", *map(str, common)])
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    r0, r1 = (load_file(str(ddp / f"rank{r}.safetensors")) for r in (0, 1))
    one = {k: v.detach() for k, v in result["model"].state_dict().items() if k != "lm_head.weight"}
    assert r0.keys() == r1.keys() == one.keys()
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k  # DDP keeps the replicas identical
        # all-reduce averages (g0 + g1) / 2 where accumulation adds g0/2 + g1/2: fp32 rounding only
        torch.testing.assert_close(r0[k], one[k], atol=1e-5, rtol=1e-4, msg=k)
    curve_ddp = json.loads((ddp / "rank0.json").read_text())["curve"]
    assert curve_ddp == json.loads((ddp / "rank1.json").read_text())["curve"]  # the all-reduced loss
    curve_one = result["curve"]
    assert len(curve_ddp) == len(curve_one) == 2
    assert curve_ddp == pytest.approx(curve_one, abs=1e-5)
