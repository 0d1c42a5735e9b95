"""`import fuseblock` imports no torch._dynamo (torch.compiler's decorators would: 2 s of an
import that torch itself takes 2 s for); the quant= path and the DTensor calls import it on
their first call, and work there."""
import sys

import pytest
import timeouts

from fuseblock.ops.registry import TRITON_OPS

CHECK = """
import sys
import torch
import fuseblock
assert "torch._dynamo" not in sys.modules, "import fuseblock imported torch._dynamo"
q, _ = fuseblock.add_norm(torch.randn(2, 32), torch.randn(2, 32), torch.ones(32), None, quant="fp8_row")
assert q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (2, 1)
assert "torch._dynamo" in sys.modules  # ops/fp8.py, imported by that call, took it in
print("ok")
"""


@pytest.mark.skipif(TRITON_OPS, reason="registering the ops as torch.library.triton_op (torch >= 2.6, not under "
                    "the interpreter) imports torch._dynamo at import: known, left (the triton_ops' "
                    "registration is not yet deferred)")
def test_import_fuseblock_imports_no_dynamo():
    p = timeouts.run([sys.executable, "-c", CHECK], capture_output=True, text=True, seconds=120)
    assert p.returncode == 0 and p.stdout.split() == ["ok"], p.stderr[-2000:]
