"""FSDP2 (fully_shard) with meta-device init. One process: the GPT built on the meta device,
moved with to_empty and given init_weights() equals eager construction bit for bit. Two gloo
ranks on CPU (tests/integrations/fsdp_worker.py under torchrun): fuseblock's ResidualStack and the GPT
shard, initialise with no garbage left, and their sharded gradients match one process's.
train.py --fsdp: its checkpoints are the single-process format, and resume either way."""
import json
import math
import shutil
import sys

import pytest
import timeouts
import torch
from trainutil import ROOT, TINY, call, compare_checkpoints, env, train

from models.gpt import GPT, GPTConfig

WORKER = str(ROOT / "tests" / "integrations" / "fsdp_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _env():
    return {**env(), "OMP_NUM_THREADS": "1"}  # the CPU torch path, this checkout first on the path


def _torchrun(*args):
    p = timeouts.run([*TORCHRUN, *map(str, args)], env=_env(), cwd=ROOT, capture_output=True, text=True,
                     seconds=240)
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
    return p


@pytest.mark.parametrize("cfg", [
    GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8),
    GPTConfig(n_layer=1, n_head=2, n_embd=12, block_size=8, bias=True, norm="layer", fused=False),
])
def test_meta_build_to_empty_init_weights_equals_eager_construction(cfg):
    torch.manual_seed(5)
    eager = GPT(cfg)
    after_eager = torch.get_rng_state()
    torch.manual_seed(5)
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():  # what to_empty's memory may hold: init must leave none of it
        for p in model.parameters():
            p.fill_(math.nan)
    model.init_weights()
    assert model.lm_head.weight is model.wte.weight  # to_empty untied them; init_weights ties them again
    want, got = eager.state_dict(), model.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert torch.equal(torch.get_rng_state(), after_eager)  # the same draws, no more


def test_init_weights_draws_gpt2s_initialisation():
    cfg = GPTConfig(n_layer=4, n_head=2, n_embd=64, block_size=8, bias=True, norm="layer")
    torch.manual_seed(0)
    model = GPT(cfg)
    proj = 0.02 / math.sqrt(2 * cfg.n_layer)  # the residual projections, scaled by depth
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif p.dim() == 1:  # biases: Linear's and the norms'
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            std = proj if name.endswith("c_proj.weight") else 0.02
            assert abs(p.mean().item()) < 0.1 * std and abs(p.std().item() / std - 1) < 0.1, (name, p.std().item())


def test_fsdp_needs_torchrun(tmp_path):
    p = call("train.py", "--out-dir", tmp_path / "x", "--fsdp", check=False)
    assert p.returncode == 2 and "usage:" in p.stderr and "--fsdp" in p.stderr and "torchrun" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_stack_and_gpt_shard_on_two_cpu_ranks_and_match_one_process(tmp_path):
    _torchrun(WORKER, tmp_path)
    ranks = json.loads((tmp_path / "fsdp.json").read_text())
    assert len(ranks) == 2
    for name, r in ranks[0].items():  # shown by pytest -s
        print(f"{name}: gradients differ by {r['grad_max_abs_diff']:.3g} at most (largest {r['grad_max_abs']:.3g})")
    for rank in ranks:
        for name in ("stack_fused_block_units", "stack_naive_mixer_units"):
            r = rank[name]
            assert r["norms_reset"] and r["linears_reset"], (name, r)  # no NaN left from to_empty
            assert r["loaded_diff"] == 0.0, (name, r)
            assert r["grad_max_abs"] > 0.1, (name, r)  # gradients worth comparing
            # the same fp32 sums on one rank and in one process, up to reduction order
            assert r["grad_max_abs_diff"] <= 1e-6 and r["input_grad_max_abs_diff"] <= 1e-6, (name, r)
            assert r["loss_diff"] <= 1e-6, (name, r)
        for name in ("gpt_fused_block_units", "gpt_naive_mixer_units", "gpt_fused_mixer_units",
                     "gpt_hc_fused_block_units", "gpt_hc_naive_mixer_units"):
            r = rank[name]
            assert r["init_bit_equal"] and r["tied"], (name, r)  # the shards of GPT(cfg), seed for seed
            assert r["grad_max_abs"] > 0.01 and r["grad_max_abs_diff"] <= 1e-6 and r["loss_diff"] <= 1e-6, (name, r)


@pytest.mark.slow
def test_fsdp_checkpoints_resume_in_one_process_and_back(tmp_path):
    """2 ranks with --fsdp equal one process with 2x accumulation (same data per step, the
    global gradient norm clipped); an --fsdp checkpoint resumes in one process, and a
    one-process checkpoint under --fsdp."""
    common = ["--eval-interval", "1000", "--ckpt-interval", "2", "--grad-clip", "0.1"]  # clipping at work (norm ~0.5)
    single, fsdp, back = tmp_path / "single", tmp_path / "fsdp", tmp_path / "back"
    train(single, 2, "--grad-accum", "2", *common)
    shutil.copytree(single, back)
    _torchrun(ROOT / "scripts" / "train.py", "--fsdp", "--out-dir", fsdp, "--max-iters", 2, "--device", "cpu",
              *common, *TINY)
    assert compare_checkpoints(fsdp / "ckpt-000002", single / "ckpt-000002") <= 1e-6
    train(single, 4, "--resume")
    p = call("train.py", "--out-dir", fsdp, "--resume", "--max-iters", "4", "--grad-accum", "2", "--no-progress")
    assert "world_size 2 -> 1" in p.stdout and "iters 2..4" in p.stdout
    assert compare_checkpoints(fsdp / "ckpt-000004", single / "ckpt-000004") <= 1e-6
    p = _torchrun(ROOT / "scripts" / "train.py", "--fsdp", "--out-dir", back, "--resume", "--max-iters", 4,
                  "--grad-accum", 1, "--device", "cpu", "--no-progress")
    assert "world_size 1 -> 2" in p.stdout and "iters 2..4" in p.stdout
    assert compare_checkpoints(back / "ckpt-000004", single / "ckpt-000004") <= 1e-6
