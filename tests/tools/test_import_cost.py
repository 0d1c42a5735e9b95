"""`import fuseblock` imports no torch._dynamo (2 s of an import that torch itself takes 2 s
for): not torch.compiler's decorators, nor the ops' registration as triton_ops
(`torch.library.triton_op` imports it), which waits for the ops' first use. The quant= path
and the DTensor calls import it on their first call, and work there; a compiled model's
first trace registers the ops it reaches, with no graph break."""
import sys

import timeouts

CHECK = """
import sys
import torch
import fuseblock
assert "torch._dynamo" not in sys.modules, "import fuseblock imported torch._dynamo"
q, _ = fuseblock.add_norm(torch.randn(2, 32), torch.randn(2, 32), torch.ones(32), None, quant="fp8_row")
assert q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (2, 1)
assert "torch._dynamo" in sys.modules  # ops/fp8.py, imported by that call, took it in

from fuseblock.ops.dispatch import kernels_on_cpu
from fuseblock.ops.norm import norm_op

graphs = []


class Captured(Exception):
    pass


def record(gm, example_inputs):  # the traced graph, never run
    graphs.append(gm)

    def run(*args):
        raise Captured

    return run


try:  # the kernel path's first use is under Dynamo: its trace registers the op, fullgraph
    with kernels_on_cpu():
        torch.compile(lambda x, r, w: fuseblock.add_norm(x, r, w), backend=record, fullgraph=True)(
            torch.randn(2, 32), torch.randn(2, 32), torch.ones(32))
except Captured:
    pass
assert [n.target for n in graphs[0].graph.nodes].count(norm_op.fwd_op) == 1, graphs[0].graph
print("ok")
"""


def test_import_fuseblock_imports_no_dynamo():
    p = timeouts.run([sys.executable, "-c", CHECK], capture_output=True, text=True, seconds=180)
    assert p.returncode == 0 and p.stdout.split() == ["ok"], p.stderr[-2000:]
