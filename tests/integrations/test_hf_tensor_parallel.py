"""A fused Hugging Face Llama under transformers' own tensor-parallel plan (`model.tp_plan`) on
2 gloo ranks on CPU: tests/integrations/hf_tp_worker.py under torchrun, once per path
(TRITON_INTERPRET=1 passed on in the kernel-path run). The plan shards the attention and
MLP Linears column/row-wise, the embedding and the head; the fused norms get each rank's
whole, replicated activations, so they run as in one process. Logits, loss and every
gradient against one process's fused model on the same checkpoint (fp32, 1e-6 of the
largest value), with fuse before and after the plan is applied. docs/parallel.md."""
import json

import pytest
from helpers import KERNEL_PATH
from trainutil import ROOT, torchrun

transformers = pytest.importorskip("transformers")
if not hasattr(pytest.importorskip("transformers.distributed"), "initialize_distributed_mesh"):  # the worker's
    pytest.skip(f"transformers {transformers.__version__} has no transformers.distributed.initialize_distributed_mesh "
                "(5.23 has)", allow_module_level=True)
pytestmark = pytest.mark.kernel
WORKER = str(ROOT / "tests" / "integrations" / "hf_tp_worker.py")
TOL = 1e-6


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_tp")
    torchrun(2, WORKER, out, kernel_path=KERNEL_PATH, seconds=240)
    found = json.loads((out / "hf_tp.json").read_text())
    assert len(found) == 2 and all(r["kernel_path"] == KERNEL_PATH for r in found)  # the path under test ran
    return found


@pytest.mark.parametrize("order", ["fuse_then_plan", "plan_then_fuse"])
def test_fused_llama_under_transformers_tp_plan_equals_one_process(ranks, order):
    for rank in ranks:
        r = rank[order]
        # transformers' plan ran: column-parallel q_proj and head, row-parallel o_proj and down_proj
        assert r["placements"] == {"q_proj": "(Shard(dim=0),)", "o_proj": "(Shard(dim=1),)",
                                   "down_proj": "(Shard(dim=1),)", "lm_head": "(Shard(dim=0),)"}, r
        assert r["norms_fused"] and r["all_params"], r
        assert r["logits"] <= TOL and r["loss"] <= TOL * max(1.0, r["loss_value"]), r
        assert r["grad_max"] <= TOL, r["grads"]
