"""fuseblock on DTensors (docs/parallel.md), on 2 gloo ranks on CPU: one torchrun launch of
tests/integrations/tp_worker.py per path (TRITON_INTERPRET=1 passed on in the kernel-path
run), whose findings the tests below read. Against one process on the same data (fp32):
norm, add_norm (its branch: alpha, x1, dropout), norm_add and norm_add_norm sharded by
rows (Shard(0), Shard(1)) and on the normalized dim (Shard(2), the weights and biases
Shard(0)), and norm_linear by rows or with a column-parallel Linear, values and every gradient; the replicated
weight's gradient a Partial sum; what each communicates; the placements refused; the
dropout's masks, the same on every layout, eager and (on the kernel path) compiled; and the parallel styles on
a fused ResidualStack, whose residual must not be dropped."""
import json

import pytest
from helpers import KERNEL_PATH
from trainutil import ROOT, torchrun

pytestmark = pytest.mark.kernel
WORKER = str(ROOT / "tests" / "integrations" / "tp_worker.py")
TOL = 1e-6  # relative to max(1, the largest reference value): fp32 sums in another order
OPS = ("norm", "add_norm", "norm_add", "norm_add_norm")
CASES = [f"{fn}_{kind}_shard{dim}" for fn in OPS for kind in ("rms", "layer") for dim in (0, 1, 2)]
CASES += ["add_norm_layer_uneven_shard1", "add_norm_layer_uneven_shard2"]  # (2, 5, 7): shards of 3 + 2 and 4 + 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    torchrun(2, WORKER, out, kernel_path=KERNEL_PATH, seconds=240)
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
        fn = case.split("_rms_")[0].split("_layer_")[0]
        expected = {"x", "weight"} | ({"residual"} if fn != "norm" else set()) | \
            ({"bias"} if "_layer_" in case else set())
        if fn == "norm_add_norm":
            expected |= {"branch_weight"} | ({"branch_bias"} if "_layer_" in case else set())
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
    norms = 2 if case.startswith("norm_add_norm") else 1
    for rank in ranks:
        r = rank[case]
        # one all-reduce per norm forward, one backward; no all-gather
        assert r["comm_counts"] == {"c10d_functional.all_reduce": 2 * norms}, r
        assert r["collectives"] == [["all_reduce.default", per_row * r["rows"]]] * (2 * norms), r
        assert r["weight_grad_placements"] == "(Shard(dim=0),)", r


def test_addnorm_module_with_weight_and_bias_sharded_on_the_hidden_dim(ranks):
    for rank in ranks:
        assert max(rank["module_hidden"].values()) <= TOL, rank["module_hidden"]


def test_row_sharded_takes_gates_and_groups(ranks):
    for rank in ranks:
        r = rank["gate_groups_rows"]
        assert len(r) == 6 and max(r.values()) <= TOL, r  # out, new_residual; x, residual, gate, weight


@pytest.mark.parametrize("case", ["branch_shard1", "branch_shard2"])
def test_add_norm_branch_alpha_and_x1_equal_one_process(ranks, case):
    for rank in ranks:
        r = rank[case]
        assert len(r) == 7 and max(r.values()) <= TOL, r  # out, new_residual; x, x1, residual, weight, bias


# tp_worker compiles on the kernel path only (Dynamo traces the same DTensor dispatch and seed draw on
# both; the kernel path's custom ops too): its compiled cases are kernel_only here
ON_KERNEL_PATH = pytest.mark.kernel_only("tp_worker compiles on the kernel path only (the torch path's compiled "
                                         "DTensor calls are test_one_rank_mesh's)")


@pytest.mark.parametrize("case", ["dropout_shard1", "dropout_shard2",
                                  pytest.param("dropout_compiled_shard1", marks=ON_KERNEL_PATH),
                                  pytest.param("dropout_compiled_shard2", marks=ON_KERNEL_PATH)])
def test_dropout_masks_and_given_them_one_process(ranks, case):
    """Decoded from new_residual (x = 1, x1 = 3), eager and under torch.compile(fullgraph=True):
    every element kept or dropped, x's and x1's masks apart, the kept fraction within 5
    binomial sds of 1 - p, the same after the same manual_seed and not after another; and
    given those masks, values and every gradient as one process's."""
    for rank in ranks:
        r = rank[case]
        assert r["masks_decoded"] and r["x_and_x1_masks_differ"], r
        assert r["reproducible"] and r["another_seed_differs"], r
        p, n = 0.3, r["numel"]
        sd = (p * (1 - p) / n) ** 0.5
        assert abs(r["kept"] - (1 - p)) <= 5 * sd and abs(r["kept_x1"] - (1 - p)) <= 5 * sd, r
        assert max(r[k] for k in ("value", "new_residual", "x", "x1", "residual", "weight", "bias")) <= TOL, r
    assert ranks[0][case] == ranks[1][case]  # both ranks see one global result


def test_dropout_masks_are_the_same_on_every_layout(ranks):
    """The masks are a hash of one key drawn per call and each element's global index: by
    rows, on the hidden dim or replicated (one process's layout), the same call after the same
    manual_seed gives the same new_residual bit for bit, and out too but on the hidden dim
    (its statistics are all-reduced fp64 sums: 1e-6). Compiled, inductor draws its random ops
    from its own generator, so the key, and the masks, differ from eager's; with
    torch._inductor.config.fallback_random (torch's randint) they are eager's. (The compiled
    calls with inductor's random ops are test_dropout_masks_and_given_them_one_process's,
    against their eager twins, on rows and on the hidden dim.)"""
    for rank in ranks:
        r = rank["dropout_layouts"]
        assert all(r[f"shard{d}_new_residual_equal"] for d in (0, 1, 2)), r
        assert r["shard0_out_equal"] and r["shard1_out_equal"] and r["shard2_out"] <= TOL, r
        if KERNEL_PATH:  # compiled there only
            assert not r["compiled_shard1_new_residual_equal"] and not r["compiled_shard2_new_residual_equal"], r
            assert r["compiled_fallback_random_new_residual_equal"], r
        else:
            assert not any(k.startswith("compiled") for k in r), r


def test_dropout_in_bf16_rounds_new_residual_once(ranks):
    """bf16 by rows: the dropped x and x1 reach the op in fp32, so new_residual is the exact
    sum given the masks rounded once (half a bf16 ulp; fp32's own rounding adds at most
    1/256 of one) and out once from it; dropped and scaled in bf16 first, it would not be.
    On both paths: the worker makes the Triton interpreter round as a GPU does."""
    for rank in ranks:
        r = rank["dropout_bf16"]
        once = 0.51
        assert r["masks_decoded"] and r["dtypes"] == ["torch.bfloat16"] * 2, r
        assert r["new_residual_ulps"] <= once and r["out_ulps"] <= once and r["rounded_twice_ulps"] > 1, r


def test_shard_offsets_are_dtensors(ranks):
    """The dropout's global index: each shard's offsets as DTensor computes them (even, uneven
    and empty shards on this mesh), and the index of every local element that of a global
    arange distributed alike."""
    for rank in ranks:
        assert all(all(v) for v in rank["offsets"].values()), rank["offsets"]


@pytest.mark.parametrize("mesh_shape", [(2, 3), (3, 2), (4,), (2, 2, 2)])
def test_shard_offsets_compose_as_dtensors_on_larger_meshes(mesh_shape):
    """shard_offsets against DTensor's own layout function, with no process group: every
    coordinate of meshes larger than the worker's, several mesh dims sharding one tensor dim
    (each splits the one before's chunk), uneven and empty chunks. An empty shard's offset is
    the global size in DTensor's, where a mesh dim splits an empty chunk; it indexes nothing,
    so there the local sizes alone are compared."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from fuseblock.ops.dtensor import shard_offsets

    shape = (5, 7, 3)
    options = [Replicate(), Shard(0), Shard(1), Shard(2)]
    for placements in itertools.product(options, repeat=len(mesh_shape)):
        for coordinate in itertools.product(*map(range, mesh_shape)):
            local, offset = shard_offsets(shape, placements, mesh_shape, list(coordinate))
            want_local, want_offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate),
                                                                             placements)
            assert tuple(local) == tuple(want_local), (placements, coordinate)
            if 0 not in local:
                assert tuple(offset) == tuple(want_offset), (placements, coordinate)


# forward's all-gather of the normed rows, backward's again (for the weight's gradient) and its reduce-scatter
GATHER = {"c10d_functional.all_gather_into_tensor": 2, "c10d_functional.reduce_scatter_tensor": 1}


@pytest.mark.parametrize(("case", "y_placement", "comm"), [("norm_linear_rows", "Shard(dim=1)", {}),
                                                           ("norm_linear_columns", "Shard(dim=2)", {}),
                                                           ("norm_linear_sequence", "Shard(dim=2)", GATHER)])
def test_norm_linear_by_rows_or_with_a_column_parallel_weight(ranks, case, y_placement, comm):
    """x Shard(1) with the Linear replicated; x replicated with the Linear's weight and bias
    Shard(0) (column-parallel: y sharded on its last dim, and the gradients at x and at the
    norm's weight Partial sums, new_residual's own gradient counted once); x Shard(1) with the
    Linear column-parallel (sequence parallelism: the norm's output all-gathered forward, and
    again backward for the weight's gradient rather than kept, its gradient reduce-scattered;
    nothing else moves). No tensor of the gathered rows' size is kept for backward: the fused
    op keeps this rank's rows (B, T/2, D) alone (the unfused pair keeps the gathered (B, T, D))."""
    B, T, D = 2, 4, 6  # tp_worker's
    for rank in ranks:
        r = rank[case]
        assert r["y_placements"] == f"({y_placement},)" and r["comm_counts"] == comm, r
        assert max(v for v in r.values() if isinstance(v, float)) <= TOL, r
        assert len(r) == 11, r  # y, new_residual; x, residual, norm_weight, norm_bias, weight, bias
        if case != "norm_linear_columns":  # (there x is replicated: every rank's rows are its own)
            assert [B, T // 2, D] in r["saved_shapes"], r  # p, this rank's rows
            assert [B, T, D] not in r["saved_shapes"] and [B * T, D] not in r["saved_shapes"], r


@ON_KERNEL_PATH
@pytest.mark.parametrize("case", ["compiled_shard1", "compiled_shard2", "compiled_norm_add_norm_shard2"])
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
    ("norm_linear_row_sharded_weight", "ValueError", "weight's placement Shard(dim=1) on mesh dim 0"),
    ("norm_linear_hidden", "ValueError", "norm_linear is not supported with x sharded on its last dim"),
    ("norm_linear_bias_placed_otherwise", "ValueError", "bias's placement Shard(dim=0)"),
    ("norm_add_weight_replicated_x_by_hidden", "ValueError", "branch_weight's placement Replicate()"),
    ("norm_add_norm_partial_x", "ValueError", "Partial(sum)"),
    ("norm_add_norm_plain_residual", "TypeError", "residual is a Tensor"),
    ("torch_style_positional_residual", "ValueError", "use fuseblock.parallel.SequenceParallel"),
    ("norm_linear_uneven_sequence", "ValueError", "x's dim 1 (5) must divide evenly over its shards"),
    ("fused_colwise_on_a_non_linear", "TypeError", "FusedColwiseParallel applies to an nn.Linear, got GELU"),
    ("torch_colwise_on_a_fused_linear", "ValueError", "has forward hooks, which the fused norm + Linear would skip"),
])
def test_other_placements_are_refused_naming_them(ranks, case, error, names):
    for rank in ranks:
        got = rank["refusals"][case]
        assert got is not None, case  # it ran instead of refusing
        assert got[0] == error and names in got[1] and "\n" not in got[1], got


@pytest.mark.parametrize(("case", "params"), [("stack_fuseblock_style", 14), ("stack_sandwich", 18),
                                              ("stack_prenorm_mlp", 14), ("stack_post_norm", 14)])
def test_sequence_parallel_plan_on_a_fused_stack_keeps_the_residual(ranks, case, params):
    """Column/row-parallel MLPs and sequence-parallel norms, torchtitan's plan, with
    fuseblock's SequenceParallel on the norms: exact. Gradients: the Linears' sums split
    across ranks, hence 1e-5. The sandwich stack (alpha 0.5) runs norm_add_norm through the
    style's wrapped `Norm.norm_add_norm` (before: a ValueError, the local x beside the
    sharded residual). The MLPs that fuse the norm into their first Linear (`fuses_prenorm`,
    the GPT's) run norm_linear through the wrapped `Norm.add_linear`, sequence-parallel (before:
    a TypeError, the local x beside DTensor weights). The post-norm stack (norm_add), its
    blocks' norms with use_local_output=True."""
    for rank in ranks:
        r = rank[case]
        assert r["value"] <= TOL and r["grad_max"] <= 1e-5, r
        # every parameter: 2 blocks x (norm w, b, 2 Linears' w, b) + norm_f's; sandwich: + 2 branch norms' w, b
        assert len(r["grads"]) == params, r


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


@pytest.mark.parametrize("case", ["implicit_add_norm", "implicit_norm_linear"])
def test_plain_parameters_inside_implicit_replication_are_replicate(ranks, case):
    """torch's implicit_replication() takes a plain tensor beside DTensors as Replicate, and
    so do fuseblock's ops there: x by rows, plain weights and biases, equal to one process;
    each plain parameter's gradient a plain tensor summed over both ranks' rows (refused
    outside the context: the refusals' plain_weight)."""
    for rank in ranks:
        r = rank[case]
        assert r["out_placements"] == "(Shard(dim=1),)", r
        assert set(r["plain_grads"]) == {"Tensor"}, r
        assert max(v for k, v in r.items() if isinstance(v, float)) <= TOL, r
