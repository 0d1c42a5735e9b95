"""batch_norm and BatchNorm against F.batch_norm and nn.BatchNorm1d in float64: values,
gradients and the running buffers, training and eval."""
import pytest
import torch
import torch.nn.functional as F
from family_helpers import HALF, WIDE, check_grads, loops
from helpers import assert_close
from ref64 import leaf64

import fuseblock


def run_batch_norm(shape, dtype=torch.float32, affine=True, stats=True, training=True, momentum=0.3):
    """fuseblock.batch_norm vs F.batch_norm in fp64: output, running buffers, gradients."""
    c = shape[1]
    x = (torch.randn(shape) * 2 + 1).to(dtype)
    w, b = (torch.randn(c), torch.randn(c)) if affine else (None, None)
    rm, rv = (torch.randn(c), torch.rand(c) + 0.5) if stats else (None, None)
    leaves = [t.requires_grad_(True) for t in (x, w, b) if t is not None]
    mine = [None if t is None else t.clone() for t in (rm, rv)]
    ref_stats = [None if t is None else t.double() for t in (rm, rv)]
    y = fuseblock.batch_norm(x, *mine, w, b, training, momentum, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    refs = [leaf64(t) for t in leaves]
    ref = F.batch_norm(refs[0], *ref_stats, *(refs[1:] if affine else (None, None)), training, momentum, 1e-5)
    assert_close(y, ref, dtype, "y", per_row=True)
    if stats:
        assert_close(mine[0], ref_stats[0], torch.float32, "running_mean", per_row=True)
        assert_close(mine[1], ref_stats[1], torch.float32, "running_var", per_row=True)
        if not training:
            assert torch.equal(mine[0], rm) and torch.equal(mine[1], rv)
    check_grads(y, ref, leaves, refs, dtype, ["x", "w", "b"])


@pytest.mark.kernel
@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 5), (1, 3, 7), (2, 3, 2, 3)], ids=str)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("stats", [True, False])
def test_batch_norm_training_matches_torch(shape, affine, stats):
    run_batch_norm(shape, affine=affine, stats=stats)


@pytest.mark.kernel
@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 5), (2, 3, 2, 3)], ids=str)
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_eval_uses_running_stats(shape, affine):
    run_batch_norm(shape, affine=affine, training=False)


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_half_input_fp32_parameters(dtype, training):
    run_batch_norm((4, 3, 6), dtype=dtype, training=training)


@pytest.mark.kernel
def test_batch_norm_long_channels_loop_kernel():
    assert loops(2 * WIDE)
    run_batch_norm((2, 2, WIDE))  # rows of N*L values: the core op's loop kernels


def test_batch_norm_gradcheck_float64():
    x, w, b = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((4, 3, 2), (3,), (3,)))
    assert torch.autograd.gradcheck(lambda *t: fuseblock.batch_norm(t[0], None, None, t[1], t[2], True), (x, w, b))


@pytest.mark.kernel
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("shape", [(8, 4), (4, 4, 6)], ids=str)
def test_batch_norm_module_tracks_like_nn_batchnorm1d(momentum, shape):
    ref = torch.nn.BatchNorm1d(4, momentum=momentum)
    mod = fuseblock.BatchNorm(4, momentum=momentum)
    assert list(mod.state_dict()) == list(ref.state_dict())
    torch.nn.init.normal_(ref.weight)
    mod.load_state_dict(ref.state_dict())
    for _ in range(3):  # training steps move the running stats
        x = torch.randn(shape) * 3 + 2
        torch.testing.assert_close(mod(x), ref(x), atol=2e-5, rtol=2e-5)
    x = torch.randn(shape, requires_grad=True)
    for m in (mod, ref):
        m.eval()
    out, ref_out = mod(x), ref(x)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x), torch.autograd.grad(ref_out.sum(), x))
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(mod.state_dict()[key], value, atol=1e-6, rtol=1e-5)
    ref.load_state_dict(mod.state_dict())  # and back


@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_module_without_running_stats(affine):
    ref = torch.nn.BatchNorm1d(3, affine=affine, track_running_stats=False)
    mod = fuseblock.BatchNorm(3, affine=affine, track_running_stats=False)
    assert list(mod.state_dict()) == list(ref.state_dict())
    x = torch.randn(5, 3, 4)
    for m in (mod, ref):
        m.eval()  # still batch statistics: there are no running ones
    torch.testing.assert_close(mod(x), ref(x), atol=2e-5, rtol=2e-5)
