"""The GPT's tensor-parallel plan (models/tensor_parallel.py, docs/parallel.md) on gloo ranks
on CPU, fp32. One torchrun launch of gpt_tp_worker.py on 4 ranks per path (TRITON_INTERPRET=1
passed on in the kernel-path run), a (dp 2, tp 2) mesh: tensor parallelism alone and FSDP2
on dp over it, against one process, init bit for bit, one step's loss and every gradient.
Then train.py on the torch path: --tp 2 on 2 ranks and --fsdp --tp 2 on 4, one launch
each, their loss curves and checkpoints against one process's, resuming each other's
checkpoints and resumed by one process."""
import json

import pytest
from helpers import KERNEL_PATH
from trainutil import ROOT, TINY, call, compare_checkpoints, torchrun, train

from fuseblock.ops.dtensor import STRIDED_SPLIT_REDISTRIBUTES

# the plan splits c_attn's columns q | k | v with a _StridedShard, refused before torch 2.12
pytestmark = pytest.mark.skipif(not STRIDED_SPLIT_REDISTRIBUTES, reason="the GPT's plan needs torch >= 2.12")

WORKER = str(ROOT / "tests" / "integrations" / "gpt_tp_worker.py")
TOL = 1e-6  # fp32: the same sums, split across ranks and added in another order


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt_tp")
    torchrun(4, WORKER, out, kernel_path=KERNEL_PATH)
    found = json.loads((out / "gpt_tp.json").read_text())
    assert found["kernel_path"] == KERNEL_PATH  # the path under test ran
    return found


CASES = ["rms_tp", "layer_bias_tp", "rms_fsdp_tp", "layer_fsdp_tp"]


@pytest.mark.kernel
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_values_and_every_gradient_of_a_step_equal_one_process(ranks, case):
    r = ranks[case]
    print(f"{case}: gradients {r['grad_max_abs_diff']:.3g} off at most ({r['worst']}), "
          f"largest {r['grad_max_abs']:.3g}; "
          f"logits {r['logits_max_abs_diff']:.3g}; collectives {r['collectives']}")  # pytest -s
    assert r["init_bit_equal"] and r["tied"]  # each rank's parts of GPT(cfg), the head still wte's table
    # each sublayer's norm and first Linear in one op (fuses_prenorm), as in one process
    assert r["norm_linear_calls"] == 2 * (1 if case.startswith("layer") else 2)
    assert r["logits_plain"] and r["logits_max_abs_diff"] <= TOL and r["loss_diff"] <= TOL
    assert r["grad_max_abs"] > 0.1 and r["grad_max_abs_diff"] <= TOL


@pytest.mark.kernel
@pytest.mark.slow
def test_the_plan_places_each_layer_as_documented(ranks):
    tp = ranks["rms_tp"]["placements"]
    assert tp["wte.weight"] == tp["wpe.weight"] == ["S(0)"]  # row-parallel tables (the head is wte's)
    assert tp["stack.blocks.0.mixer.c_attn.weight"] == ["_S(0, 3)"]  # q | k | v, each split by heads
    assert tp["stack.blocks.1.mixer.c_fc.weight"] == ["S(0)"]
    assert tp["stack.blocks.0.mixer.c_proj.weight"] == tp["stack.blocks.1.mixer.c_proj.weight"] == ["S(1)"]
    assert tp["stack.blocks.0.norm.weight"] == tp["stack.norm_f.weight"] == ["R"]  # sequence-parallel norms
    assert ranks["layer_bias_tp"]["placements"]["stack.blocks.0.mixer.c_attn.bias"] == ["_S(0, 3)"]
    two_d = ranks["rms_fsdp_tp"]["placements"]
    assert two_d["stack.blocks.0.mixer.c_attn.weight"] == ["S(1)", "_S(0, 3)"]  # FSDP2 on the input dim
    assert two_d["stack.blocks.0.mixer.c_proj.weight"] == ["S(0)", "S(1)"]


@pytest.mark.kernel
@pytest.mark.slow
def test_one_all_gather_and_one_reduce_scatter_per_sublayer_each_way(ranks):
    # rms_tp: 2 layers = 4 sublayers. Forward: each sublayer's all-gather of its normed input
    # and reduce-scatter of its output, the 2 embeddings' reduce-scatters, the head's
    # all-gathers of its input and of the logits. Backward: each of those the other way round,
    # but for the logits' (a slice), and each sublayer's normed input gathered again for its
    # first Linear's weight gradient (norm_linear keeps this rank's rows alone). The norms'
    # statistics move nothing.
    assert ranks["rms_tp"]["collectives"] == {"all_gather_into_tensor": (4 + 2) + (4 + 2 + 4),
                                              "reduce_scatter_tensor": (4 + 2) + (4 + 1)}


@pytest.mark.kernel
@pytest.mark.slow
def test_refused_layouts_name_the_problem(ranks):
    assert ranks["odd_heads_error"].startswith("n_head (3) must be divisible by the tensor-parallel size (2)")
    assert "use bias=False" in ranks["fsdp_bias_error"]


def test_tp_needs_torchrun_and_a_world_it_divides(tmp_path, monkeypatch):
    p = call("train.py", "--out-dir", tmp_path / "x", "--tp", "2", check=False)
    assert p.returncode == 2 and "usage:" in p.stderr and "torchrun --standalone --nproc_per_node=2" in p.stderr
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets them; the flags are refused before any group forms
    p = call("train.py", "--out-dir", tmp_path / "x", "--tp", "2", check=False)
    assert p.returncode == 2 and "without --fsdp the tensor-parallel group is every rank (--tp 4)" in p.stderr
    p = call("train.py", "--out-dir", tmp_path / "x", "--tp", "3", "--fsdp", check=False)
    assert p.returncode == 2 and "--tp must divide the world size" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_tp_and_2d_training_equal_one_process_and_resume_across_layouts(tmp_path):
    """One process with 2x accumulation is the reference. --tp 2 (dp 1: one process's batches,
    the same accumulation) trains steps 1-2; --fsdp --tp 2 on 4 ranks (dp 2, no accumulation)
    resumes its checkpoint for steps 3-4; one process resumes that for step 5."""
    common = ["--eval-interval", "1000", "--ckpt-interval", "2", "--grad-clip", "0.1"]  # clipping at work
    single, tp = tmp_path / "single", tmp_path / "tp"
    train(single, 2, "--grad-accum", "2", *common)
    train(single, 4, "--resume")  # the schedule of a 2-step run, as every resumed run below keeps
    run = [ROOT / "scripts" / "train.py", "--device", "cpu", "--out-dir", tp]
    torchrun(2, *run, "--tp", 2, "--max-iters", 2, "--grad-accum", 2, *common, *TINY)
    assert compare_checkpoints(tp / "ckpt-000002", single / "ckpt-000002") <= TOL
    p = torchrun(4, *run, "--fsdp", "--tp", 2, "--resume", "--max-iters", 4, "--grad-accum", 1, "--no-progress")
    assert "world 4 (dp 2 x tp 2)" in p.stdout and "world_size 1 -> 2" in p.stdout and "iters 2..4" in p.stdout
    assert compare_checkpoints(tp / "ckpt-000004", single / "ckpt-000004") <= TOL
    train(single, 5, "--resume")
    p = call("train.py", "--out-dir", tp, "--resume", "--max-iters", "5", "--grad-accum", "2", "--no-progress")
    assert "world_size 2 -> 1" in p.stdout and "iters 4..5" in p.stdout
    assert compare_checkpoints(tp / "ckpt-000005", single / "ckpt-000005") <= TOL


@pytest.mark.kernel
@pytest.mark.kernel_only("Dynamo traces the same DTensor dispatch on both paths, and the kernel path's custom ops "
                         "on its local shards too; the torch path's compiled DTensor calls are test_one_rank_mesh's")
@pytest.mark.slow
def test_compiled_tp_training_equals_one_process(tmp_path):
    """train.py --tp 2 --compile against one process compiled: the sharded model under
    torch.compile (Dynamo traces fuseblock's DTensor calls, the strided q | k | v columns of
    the fused norm + c_attn included, and the kernel path's custom ops on DTensors' local
    shards), the same loss curve, weights and AdamW state after 3 steps. The kernel path
    only: three compiles of a model (two ranks and the reference), the suite's dearest test."""
    common = ["--eval-interval", "1000", "--ckpt-interval", "3", "--compile", *TINY]
    single, tp = tmp_path / "single", tmp_path / "tp"
    torchrun(2, ROOT / "scripts" / "train.py", "--device", "cpu", "--out-dir", tp, "--tp", 2, "--max-iters", 3,
             *common, kernel_path=KERNEL_PATH)  # first: where torchrun skips (on a GPU) nothing has run
    train(single, 3, *common[:-len(TINY)])
    assert compare_checkpoints(tp / "ckpt-000003", single / "ckpt-000003") <= TOL
