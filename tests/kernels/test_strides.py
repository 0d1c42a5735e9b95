"""Any strides, every tensor argument: the launchers index weight and bias by column and
rows by their stride, so a view must give exactly what its contiguous copy gives.

Each case passes one argument (or all at once) as a strided view: every other element of
a wider buffer, one column of a matrix (column stride 3), or an expanded stride-0 tensor,
and compares outputs and gradients with the same values laid out contiguously. On the
kernel path the two runs take the same kernels on the same values, so they agree to the
bit; a view read as if contiguous gives other values entirely.
"""
import pytest
import torch

import fuseblock

HOWS = ["slice", "column", "expand"]
ARGS = ["x", "residual", "gate", "weight", "bias", "dout", "dres"]


def view_of(t: torch.Tensor, how: str) -> torch.Tensor:
    """A tensor of t's shape with other strides: t's values for "slice" and "column";
    for "expand" (stride 0), the first row (or element) of t repeated."""
    if how == "slice":  # every other element of the last dim of a wider buffer
        buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        buf[..., ::2] = t
        return buf[..., ::2]
    if how == "column":  # one column of a (..., 3) matrix: last-dim stride 3
        buf = torch.zeros(*t.shape, 3, dtype=t.dtype)
        buf[..., 1] = t
        return buf[..., 1]
    return t.reshape(-1)[:1].expand(t.shape) if t.dim() == 1 else t[:1].expand(t.shape)


def run(args: dict, kind: str, gate_position):
    leaves = {k: v.requires_grad_() for k, v in args.items() if k not in ("dout", "dres")}
    gate = leaves.pop("gate")
    out, new_res = fuseblock.add_norm(
        leaves["x"], leaves["residual"], leaves["weight"], leaves["bias"], kind=kind,
        gate=gate if gate_position else None, **({"gate_position": gate_position} if gate_position else {}),
    )
    names = [k for k in ("x", "residual", "weight", "bias") if leaves[k] is not None]
    inputs = [leaves[k] for k in names] + ([gate] if gate_position else [])
    grads = torch.autograd.grad((out, new_res), inputs, (args["dout"], args["dres"]))
    return [out, new_res, *grads]


CONFIGS = [("rms", None), ("layer", "pre"), ("rms", "post")]


def check(arg: str, how: str, kind: str, gate_position, rows: int = 6, d: int = 24) -> None:
    base = dict(x=torch.randn(rows, d), residual=torch.randn(rows, d), gate=torch.randn(rows, d),
                weight=torch.randn(d), bias=torch.randn(d), dout=torch.randn(rows, d), dres=torch.randn(rows, d))
    views = {k: view_of(v, how) if arg in (k, "all") else v.clone() for k, v in base.items()}
    dense = {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in views.items()}
    assert arg == "all" or views[arg].is_contiguous() is False
    got, want = run(views, kind, gate_position), run(dense, kind, gate_position)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=lambda m, i=i: f"result {i}: {m}")


@pytest.mark.kernel
@pytest.mark.parametrize("kind,gate_position", CONFIGS, ids=["rms", "layer-pregate", "rms-postgate"])
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("arg", ARGS + ["all"])
def test_every_tensor_argument_takes_any_strides(arg, how, kind, gate_position):
    if arg == "gate" and gate_position is None:
        pytest.skip("no gate in this configuration")
    check(arg, how, kind, gate_position)


@pytest.mark.kernel
@pytest.mark.kernel_only("the Triton kernels' layouts")
@pytest.mark.usefixtures("small_wide_rows")
@pytest.mark.parametrize("kind,gate_position", CONFIGS, ids=["rms", "layer-pregate", "rms-postgate"])
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("arg", ["weight", "bias", "all"])
def test_wide_row_kernels_take_any_strides(arg, how, kind, gate_position):
    check(arg, how, kind, gate_position, rows=9, d=37)


# ------------------------------------------------------------------ the family ops
@pytest.mark.kernel
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("ord", ["l1", "l2", "max"])
def test_embed_norm_takes_any_strides(how, ord):
    x, dy = torch.randn(6, 24), torch.randn(6, 24)
    for xs, dys in ((view_of(x, how), dy), (x, view_of(dy, how))):
        xd, dyd = xs.contiguous(), dys.contiguous()
        xs, xd = xs.detach().requires_grad_(), xd.requires_grad_()
        ys, yd = fuseblock.embed_norm(xs, ord), fuseblock.embed_norm(xd, ord)
        torch.testing.assert_close(ys, yd, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(torch.autograd.grad(ys, xs, dys)[0], torch.autograd.grad(yd, xd, dyd)[0],
                                   rtol=1e-6, atol=1e-6)


def _channel_case(fn, how: str, shape, **tensors):
    """fn(x, **tensors) with x and every per-channel tensor strided, against contiguous copies."""
    x = torch.randn(*shape)
    c = shape[1]
    # a variance above 0: randn + 1 went negative on the GPU's draws, NaN in both runs
    vecs = {k: view_of(torch.rand(c) + 0.5 if k == "running_var" else torch.randn(c), how) for k in tensors}
    runs = []
    for variant in (lambda t: t, lambda t: t.contiguous()):
        xi = variant(view_of(x, how)).detach().requires_grad_()
        vi = {k: variant(v).detach().clone() if k.startswith("running") else variant(v).detach().requires_grad_()
              for k, v in vecs.items()}
        if how == "expand":  # an expanded running buffer cannot be updated in place: torch refuses too
            vi = {k: v.contiguous() if k.startswith("running") else v for k, v in vi.items()}
        y = fn(xi, **vi)
        params = [xi] + [v for k, v in vi.items() if not k.startswith("running")]
        runs.append([y, *torch.autograd.grad(y, params, torch.ones_like(y)),
                     *[v for k, v in vi.items() if k.startswith("running")]])
    for g, w in zip(*runs, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.kernel
@pytest.mark.parametrize("how", HOWS)
def test_channel_norms_take_any_strides(how):
    _channel_case(lambda x, **t: fuseblock.batch_norm(x, training=True, momentum=0.1, **t), how, (8, 5, 3),
                  running_mean=1, running_var=1, weight=1, bias=1)
    _channel_case(lambda x, **t: fuseblock.batch_norm(x, training=False, **t), how, (8, 5),
                  running_mean=1, running_var=1, weight=1, bias=1)
    _channel_case(lambda x, **t: fuseblock.group_norm(x, 5, **t), how, (4, 5), weight=1, bias=1)
    _channel_case(lambda x, **t: fuseblock.group_norm(x, 5, **t), how, (4, 5, 3), weight=1, bias=1)
    _channel_case(lambda x, **t: fuseblock.instance_norm(x, **t), how, (4, 5, 3), weight=1, bias=1)
