"""Every op and module at the end of an activation-checkpointed segment, both kinds.

Non-reentrant checkpointing stops its recomputation early by raising an exception of
torch's own from a saved-tensor hook, once the last tensor it needs is saved again: code
inside the segment that catches broad exceptions swallows it and torch fails with
"Unexpected state: target_frame.early_stop is set". A segment that ends in the op is
where that happens. Each case checks the gradients against the same code run without
checkpointing. (Hugging Face's gradient checkpointing of fused models is in
test_transformers.py::test_gradient_checkpointing.)
"""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fuseblock

pytestmark = pytest.mark.kernel

D = 8


def _first(out):
    return out[0] if isinstance(out, tuple) else out


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return self.lin(x)


def _cases():
    """(name, build) pairs: build() -> (module holding every parameter, f(t) -> output)."""
    w, b = nn.Parameter(torch.rand(D) + 0.5), nn.Parameter(torch.randn(D))
    lw = nn.Parameter(torch.randn(5, D) / D)

    def params(*ps):
        holder = nn.Module()
        holder.ps = nn.ParameterList(ps)
        return holder

    r = torch.randn(2, 3, D)
    cases = {
        "norm": lambda: (params(w), lambda t: fuseblock.norm(t, w)),
        "norm-layer": lambda: (params(w, b), lambda t: fuseblock.norm(t, w, b, kind="layer")),
        "add_norm-out": lambda: (params(w), lambda t: fuseblock.add_norm(t, r, w)[0]),
        "add_norm-both": lambda: (params(w), lambda t: sum(fuseblock.add_norm(t, r, w))),
        "norm-gate": lambda: (params(w), lambda t: fuseblock.norm(t, w, gate=t.tanh())),
        "norm-groups": lambda: (params(w), lambda t: fuseblock.norm(t, w, kind="layer", num_groups=2)),
        "embed_norm": lambda: (params(), lambda t: fuseblock.embed_norm(t)),
        "group_norm": lambda: (params(w, b), lambda t: fuseblock.group_norm(t.transpose(1, 2), 2, w, b)),
        "instance_norm": lambda: (params(w, b), lambda t: fuseblock.instance_norm(t.transpose(1, 2), w, b)),
        "batch_norm": lambda: (params(w, b), lambda t: fuseblock.batch_norm(t.transpose(1, 2), None, None, w, b,
                                                                            training=True)),
        "norm_linear": lambda: (params(w, lw), lambda t: fuseblock.norm_linear(t, r, w, None, lw)[0]),
    }
    for name, make in {
        "Norm": lambda: fuseblock.Norm(D),
        "Norm-layer": lambda: fuseblock.Norm(D, kind="layer"),
        "AddNorm": lambda: fuseblock.AddNorm(D),
        "NormLinear": lambda: fuseblock.NormLinear(D, 5),
        "PreNormBlock": lambda: fuseblock.PreNormBlock(Mixer(), D),
        "ResidualStack": lambda: fuseblock.ResidualStack([Mixer(), Mixer()], D),
        "InstanceNorm": lambda: fuseblock.InstanceNorm(D, affine=True),
        "BatchNorm": lambda: fuseblock.BatchNorm(D, track_running_stats=False),
    }.items():
        def build(make=make, name=name):
            module = make()
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(torch.randn_like(p) * 0.1)  # not the identity norm
            if name in ("InstanceNorm", "BatchNorm"):  # channels first
                return module, lambda t: module(t.transpose(1, 2))
            if name in ("AddNorm", "NormLinear", "PreNormBlock"):
                return module, lambda t: _first(module(t, r))
            return module, module
        cases[name] = build
    return cases


CASES = _cases()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_segment_ending_in_the_op_checkpoints(name, reentrant):
    torch.manual_seed(0)
    module, op = CASES[name]()
    lin = nn.Linear(D, D)
    x = torch.randn(2, 3, D, requires_grad=True)
    leaves = [x, *lin.parameters(), *module.parameters()]

    def segment(t):
        return op(lin(t))

    def grads(run):  # .backward(): reentrant checkpointing refuses torch.autograd.grad
        for t in leaves:
            t.grad = None
        (run(x) * g_out).sum().backward()
        return [t.grad for t in leaves]

    g_out = torch.randn_like(segment(x))
    want = grads(segment)
    got = grads(lambda t: checkpoint(segment, t, use_reentrant=reentrant))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{name}: gradient of leaf {i}")
