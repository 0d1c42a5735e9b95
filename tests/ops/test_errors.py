"""Bad input gets a ValueError/TypeError naming the argument, before any kernel runs.

Each row here is one row of the "Bad input" table of docs/api.md.
"""
import pytest
import torch

import fuseblock

X = torch.randn(4, 8)


def _call(**kw):
    args = dict(x=X)
    args.update(kw)
    x = args.pop("x")
    residual = args.pop("residual", None)
    return fuseblock.add_norm(x, residual, **args)


CASES = [
    # (argument, kwargs, exception)
    ("x", dict(x=[1.0, 2.0]), TypeError),
    ("x", dict(x=torch.ones(4, 8, dtype=torch.int64)), TypeError),
    ("x", dict(x=torch.ones(4, 8, dtype=torch.bool)), TypeError),
    ("x", dict(x=torch.tensor(1.0)), ValueError),
    ("kind", dict(kind="batch"), ValueError),
    ("kind", dict(kind=None), ValueError),
    ("eps", dict(eps=-1e-6), ValueError),
    ("eps", dict(eps=float("nan")), ValueError),
    ("eps", dict(eps="1e-6"), TypeError),
    ("c", dict(c=float("inf")), ValueError),
    ("c", dict(c="2"), TypeError),
    ("weight", dict(weight=torch.ones(7)), ValueError),
    ("weight", dict(weight=torch.ones(1, 8)), ValueError),
    ("weight", dict(weight=torch.ones(8, dtype=torch.int32)), TypeError),
    ("bias", dict(bias=torch.ones(9)), ValueError),
    ("residual", dict(residual=torch.ones(4, 7)), ValueError),
    ("residual", dict(residual=torch.ones(8)), ValueError),
    ("residual", dict(residual=torch.ones(4, 8, dtype=torch.int32)), TypeError),
    ("residual_dtype", dict(residual_dtype=torch.int8), TypeError),
    ("residual_dtype", dict(residual_dtype="float32"), TypeError),
    ("out_dtype", dict(out_dtype=torch.int8), TypeError),
    ("out_dtype", dict(out_dtype="float32"), TypeError),
    ("gate", dict(gate=torch.ones(4, 1)), ValueError),
    ("gate_act", dict(gate=torch.ones(4, 8), gate_act="relu"), ValueError),
    ("gate_position", dict(gate=torch.ones(4, 8), gate_position="middle"), ValueError),
    ("gate_act", dict(gate_act="sigmoid"), ValueError),  # no gate given
    ("gate_position", dict(gate_position="pre"), ValueError),  # no gate given
    ("num_groups", dict(num_groups=3), ValueError),
    ("num_groups", dict(num_groups=0), ValueError),
    ("num_groups", dict(num_groups=2.0), TypeError),
]


@pytest.mark.parametrize("argument,kwargs,exc", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_names_the_argument(argument, kwargs, exc):
    with pytest.raises(exc, match=argument):
        _call(**kwargs)


def test_device_mismatch_is_a_value_error():
    meta = torch.ones(8, device="meta")
    with pytest.raises(ValueError, match="weight"):
        fuseblock.norm(X, meta)


def test_norm_module_rejects_bad_config():
    with pytest.raises(ValueError, match="normalized_shape"):
        fuseblock.Norm(0)
    with pytest.raises(ValueError, match="kind"):
        fuseblock.Norm(8, kind="nope")
    with pytest.raises(ValueError, match="eps"):
        fuseblock.Norm(8, eps=-1.0)


def test_modules_blame_x_for_a_last_dim_that_does_not_match():
    for module in (fuseblock.Norm(8), fuseblock.AddNorm(8), fuseblock.Norm(8, weight=False),
                   fuseblock.Norm(8, kind="layer", weight=False), fuseblock.AddNorm(8, kind="layer", bias=False),
                   fuseblock.Norm(8, weight=False, bias=False)):
        with pytest.raises(ValueError, match=r"x's last dim 16 does not match the module's dim 8"):
            module(torch.randn(2, 16))


@pytest.mark.parametrize("make,argument", [
    (lambda: fuseblock.BatchNorm(4, affine="no"), "affine"),
    (lambda: fuseblock.BatchNorm(4, track_running_stats="no"), "track_running_stats"),
    (lambda: fuseblock.InstanceNorm(4, affine="x"), "affine"),
    (lambda: fuseblock.BatchNorm(4, affine=1), "affine"),
    (lambda: fuseblock.Norm(8, dtype=torch.int64), "dtype"),
    (lambda: fuseblock.AddNorm(8, dtype=torch.bool), "dtype"),
    (lambda: fuseblock.BatchNorm(4, dtype=torch.int32), "dtype"),
    (lambda: fuseblock.InstanceNorm(4, affine=True, dtype=torch.int64), "dtype"),
])
def test_module_switches_and_dtypes_are_type_checked(make, argument):
    with pytest.raises(TypeError, match=argument):
        make()


def _sparse(t):
    return t.to_sparse()


def _jagged(t):
    return torch.nested.nested_tensor(list(t.unbind(0)), layout=torch.jagged)


W8, X4 = torch.ones(8), torch.randn(2, 4, 3)
NOT_DENSE = [
    # (call, the argument named): every op, a sparse or nested tensor where a dense one goes
    (lambda f: fuseblock.norm(f(X)), "x"),
    (lambda f: fuseblock.norm(X, f(W8)), "weight"),
    (lambda f: fuseblock.add_norm(f(X), f(X)), "x"),
    (lambda f: fuseblock.add_norm(X, f(X)), "residual"),
    (lambda f: fuseblock.Norm(8)(f(X)), "x"),
    (lambda f: fuseblock.embed_norm(f(X)), "x"),
    (lambda f: fuseblock.group_norm(f(X4), 2), "x"),
    (lambda f: fuseblock.batch_norm(f(X4), None, None, training=True), "x"),
    (lambda f: fuseblock.norm_linear(f(X), None, None, None, torch.ones(3, 8)), "x"),
    (lambda f: fuseblock.norm_add(f(X), X, W8), "x"),
]


@pytest.mark.kernel
@pytest.mark.parametrize("form", [_sparse, _jagged], ids=["sparse", "nested"])
@pytest.mark.parametrize("call,argument", NOT_DENSE, ids=[f"{i}-{c[1]}" for i, c in enumerate(NOT_DENSE)])
def test_a_sparse_or_nested_tensor_is_a_type_error_naming_it(call, argument, form):
    """Not torch's internal errors from deep inside (sparse), nor a silent run (a jagged x
    went through torch's rms_norm, a sparse residual through the plain lane's add)."""
    if form is _jagged and argument == "weight":
        pytest.skip("a nested tensor needs rows of at least one dim")
    with pytest.raises(TypeError, match=rf"^{argument} must be a dense \(strided\) tensor"):
        call(form)
