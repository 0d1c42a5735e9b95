"""fuseblock on DTensors (docs/parallel.md), on 2 gloo ranks on CPU: one torchrun launch of
tests/integrations/tp_worker.py per path (TRITON_INTERPRET=1 passed on in the kernel-path
run), whose findings the tests below read. Against one process on the same data (fp32):
norm and add_norm sharded by rows (Shard(0), Shard(1)) and on the normalized dim
(Shard(2), the weight and bias Shard(0)), values and every gradient; the replicated
weight's gradient a Partial sum; what each communicates; the placements refused; and
the parallel styles on a fused ResidualStack, whose residual must not be dropped."""
import json
import os
import subprocess
import sys

import pytest
from helpers import KERNEL_PATH
from trainutil import ROOT

pytestmark = pytest.mark.kernel
WORKER = str(ROOT / "tests" / "integrations" / "tp_worker.py")
TOL = 1e-6  # relative to max(1, the largest reference value): fp32 sums in another order
CASES = [f"{fn}_{kind}_shard{dim}" for fn in ("norm", "add_norm") for kind in ("rms", "layer") for dim in (0, 1, 2)]
CASES += ["add_norm_layer_uneven_shard1", "add_norm_layer_uneven_shard2"]  # (2, 5, 7): shards of 3 + 2 and 4 + 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if KERNEL_PATH:
        env["TRITON_INTERPRET"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER,
                        str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
    found = json.loads((out / "tp.json").read_text())
    assert len(found) == 2 and all(r["kernel_path"] == KERNEL_PATH for r in found)  # the path under test ran
    return found


@pytest.mark.parametrize("case", CASES)
def test_values_and_every_gradient_equal_one_process(ranks, case):
    for rank in ranks:
        r = rank[case]
        dim = case[-1]
        assert r["out_placements"] == f"(Shard(dim={dim}),)", r  # DTensor in, DTensor out, placed as x
        assert r["value"] <= TOL and r.get("new_residual", 0.0) <= TOL, r
        expected = {"x", "weight"} | ({"residual"} if case.startswith("add_norm") else set()) | \
            ({"bias"} if "_layer_" in case else set())
        assert set(r["grads"]) == expected and max(r["grads"].values()) <= TOL, r


@pytest.mark.parametrize("case", [c for c in CASES if not c.endswith("2")])
def test_row_sharded_runs_locally_and_leaves_a_partial_weight_gradient(ranks, case):
    for rank in ranks:
        r = rank[case]
        # no communication at all: each rank's rows are its own; the replicated weight's
        # gradient is each rank's part, which DTensor sums when it is read (full_tensor,
        # redistribute, an optimizer step), as torch's own norms leave it
        assert r["collectives"] == [] and r["comm_counts"] == {}, r
        assert r["weight_grad_placements"] == "(Partial(sum),)", r


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("2")])
def test_hidden_sharded_all_reduces_bytes_per_row_and_gathers_nothing(ranks, case):
    per_row = 16 if "_layer_" in case else 8  # fp64 sums: (sum, sum of squares) or the sum of squares alone
    for rank in ranks:
        r = rank[case]
        assert r["comm_counts"] == {"c10d_functional.all_reduce": 2}, r  # one forward, one backward; no all-gather
        assert r["collectives"] == [["all_reduce.default", per_row * r["rows"]]] * 2, r
        assert r["weight_grad_placements"] == "(Shard(dim=0),)", r


def test_addnorm_module_with_weight_and_bias_sharded_on_the_hidden_dim(ranks):
    for rank in ranks:
        assert max(rank["module_hidden"].values()) <= TOL, rank["module_hidden"]


def test_row_sharded_takes_gates_and_groups(ranks):
    for rank in ranks:
        r = rank["gate_groups_rows"]
        assert len(r) == 6 and max(r.values()) <= TOL, r  # out, new_residual; x, residual, gate, weight


@pytest.mark.parametrize("case", ["compiled_shard1", "compiled_shard2"])
def test_torch_compile_fullgraph_traces_the_dtensor_calls(ranks, case):
    for rank in ranks:
        r = rank[case]
        assert len(r) == 6 and max(r.values()) <= TOL, r  # out, new_residual; x, residual, weight, bias


@pytest.mark.parametrize(("case", "error", "names"), [
    ("partial_x", "ValueError", "Partial(sum)"),
    ("weight_sharded_x_by_rows", "ValueError", "weight's placement Shard(dim=0)"),
    ("weight_replicated_x_by_hidden", "ValueError", "weight's placement Replicate()"),
    ("residual_placed_otherwise", "ValueError", "residual's placement Shard(dim=2)"),
    ("plain_weight", "TypeError", "weight is a Tensor"),
    ("gate_hidden", "ValueError", "gate"),
    ("groups_hidden", "ValueError", "num_groups"),
    ("norm_linear", "TypeError", "norm_linear does not take DTensors"),
    ("torch_style_positional_residual", "ValueError", "use fuseblock.parallel.SequenceParallel"),
])
def test_other_placements_are_refused_naming_them(ranks, case, error, names):
    for rank in ranks:
        got = rank["refusals"][case]
        assert got is not None, case  # it ran instead of refusing
        assert got[0] == error and names in got[1] and "\n" not in got[1], got


def test_sequence_parallel_plan_on_a_fused_stack_keeps_the_residual(ranks):
    """Column/row-parallel MLPs and sequence-parallel norms, torchtitan's plan, with
    fuseblock's SequenceParallel on the norms: exact. Gradients: the Linears' sums split
    across ranks, hence 1e-5."""
    for rank in ranks:
        r = rank["stack_fuseblock_style"]
        assert r["value"] <= TOL and r["grad_max"] <= 1e-5, r
        assert len(r["grads"]) == 14, r  # every parameter: 2 blocks x (norm w, b, 2 Linears' w, b) + norm_f's


def test_torchs_sequence_parallel_on_a_fused_stack_is_refused_not_wrong(ranks):
    """With torch's SequenceParallel on the norms the residual was lost (PreNormBlock passed it
    positionally, torch's input hook keeps the first input only): 5.24 off, silently. The
    stream now calls its norms' `add`, which a forward hook never sees: the norm gets a plain
    x beside DTensor weights, a one-line TypeError that names fuseblock's style."""
    for rank in ranks:
        assert rank["stack_torch_style"].get("error") is not None, rank["stack_torch_style"]  # it ran
        kind, message = rank["stack_torch_style"]["error"]
        assert kind == "TypeError" and "fuseblock.parallel.SequenceParallel" in message, message


@pytest.mark.parametrize(("case", "weight"), [("addnorm_sequence_style", "Replicate()"),
                                             ("addnorm_sequence_style_add", "Replicate()"),  # AddNorm.add
                                             ("addnorm_hidden_style", "Shard(dim=0)")])
def test_fuseblock_styles_shard_a_bare_addnorm_s_positional_residual(ranks, case, weight):
    for rank in ranks:
        r = rank[case]
        assert r["local_output"] == "Tensor" and r["weight_placements"] == f"({weight},)", r  # use_local_output=True
        assert max(v for v in r.values() if isinstance(v, float)) <= TOL, r
