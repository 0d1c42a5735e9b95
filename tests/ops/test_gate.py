"""Gated norms: pre-gate N(p * g(gate)) and post-gate N(p) * g(gate), with or without residual."""
import pytest
import torch
from helpers import DTYPES, run_case

import fuseblock


@pytest.mark.kernel
@pytest.mark.parametrize("position", ["pre", "post"])
@pytest.mark.parametrize("act", ["none", "sigmoid", "silu", "swish"])
@pytest.mark.parametrize("kind", ["rms", "layer", "l2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_gated_matches_fp64_reference(position, act, kind, dtype, with_residual):
    x = torch.randn(2, 3, 33).to(dtype)
    gate = torch.randn(2, 3, 33).to(dtype)
    residual = torch.randn(2, 3, 33).to(dtype) if with_residual else None
    w, b = torch.randn(33).to(dtype), torch.randn(33).to(dtype)
    run_case(x, residual, w, b, kind=kind, gate=gate, gate_act=act, gate_position=position)


@pytest.mark.kernel
@pytest.mark.parametrize("position", ["pre", "post"])
def test_gated_wide_rows(position):
    d = 20000  # above the tile limit: the column-looping kernels
    run_case(torch.randn(2, d), torch.randn(2, d), torch.randn(d), torch.randn(d), kind="layer",
             gate=torch.randn(2, d), gate_position=position)


@pytest.mark.kernel
def test_new_residual_is_the_ungated_sum():
    x, r, g = torch.randn(4, 16), torch.randn(4, 16), torch.randn(4, 16)
    for position in ("pre", "post"):
        _, res = fuseblock.add_norm(x, r, gate=g, gate_position=position)
        torch.testing.assert_close(res, x + r)


@pytest.mark.kernel
def test_gated_output_norm_example():
    # a linear-attention output: o = RMSNorm(attn_out) * silu(z)
    attn_out, z = torch.randn(2, 10, 64), torch.randn(2, 10, 64)
    w = torch.rand(64) + 0.5
    ours = fuseblock.norm(attn_out, w, gate=z)  # post-gate silu is the default
    ref = torch.nn.functional.rms_norm(attn_out, (64,), w, eps=1e-6) * torch.nn.functional.silu(z)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.kernel
@pytest.mark.kernel_only("launch counts are a property of the Triton path")
def test_gated_one_launch_each_way(launches):
    x, g = torch.randn(8, 32, requires_grad=True), torch.randn(8, 32, requires_grad=True)
    launches.reset()
    out = fuseblock.norm(x, gate=g, gate_position="pre", gate_act="sigmoid")
    out.sum().backward()
    assert launches("fwd", "bwd") == (1, 1)


@pytest.mark.kernel
@pytest.mark.parametrize("position", ["pre", "post"])
@pytest.mark.parametrize("name", ["identity", "none"])
def test_identity_gate_is_named_identity_and_none_is_its_alias(name, position):
    # g(z) = z: against torch's rms_norm with the gate multiplied in by hand, values and gradients
    x, r, z = (torch.randn(4, 24, dtype=torch.float32, requires_grad=True) for _ in range(3))
    w = torch.randn(24, requires_grad=True)
    out, _ = fuseblock.add_norm(x, r, w, eps=1e-6, gate=z, gate_act=name, gate_position=position)
    rms = torch.nn.functional.rms_norm
    ref = rms((x + r) * z, (24,), w, eps=1e-6) if position == "pre" else rms(x + r, (24,), w, eps=1e-6) * z
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, r, z, w), dy)
    want = torch.autograd.grad(ref, (x, r, z, w), dy)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    module = fuseblock.Norm(24, eps=1e-6, gate_act=name, gate_position=position)
    assert f"gate_act={name!r}" in repr(module)
    torch.testing.assert_close(module(x + r, gate=z), fuseblock.norm(x + r, eps=1e-6, gate=z, gate_act="identity",
                                                                     gate_position=position), rtol=0, atol=0)


def test_an_unknown_gate_act_names_identity():
    with pytest.raises(ValueError, match=r"gate_act must be one of .*'identity'.*got 'relu'"):
        fuseblock.norm(torch.ones(2, 8), gate=torch.ones(2, 8), gate_act="relu")
