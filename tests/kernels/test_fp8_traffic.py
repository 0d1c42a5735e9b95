"""add_norm with a scaled fp8 output moves the minimum bytes in one launch, and at
least 1.5x fewer than norm-then-cast with an ideal one-kernel cast (fuseblock.testing.quant_traffic)."""
import pytest
import torch
from helpers import interpreted_only

from fuseblock.testing.quant_traffic import QUANT_OPS, measure_quant_traffic


@pytest.mark.kernel
@interpreted_only
@pytest.mark.parametrize("op", QUANT_OPS)
def test_fused_fp8_output_moves_the_minimum_in_one_launch(op):
    row = measure_quant_traffic(op, 64, 128, torch.bfloat16)[0]
    assert row["launches"] == 1 and row["glue_ops"] == 0
    assert row["kernel_over_min"] <= 1.05
    assert row["naive1_over_kernel"] >= 1.5
