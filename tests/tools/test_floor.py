"""The smoke subset: a few fast tests over the whole public surface, forward and backward.

`make test-floor` runs this file, and only this file, in `.venv-floor`, a second
environment holding the oldest torch, triton and numpy that pyproject.toml declares
(`tools/floor_env.py` reads them from there), once on the torch path and once with
TRITON_INTERPRET=1 on the kernel path. The main suite runs it too. It imports nothing
beyond what an installed fuseblock, the repository's models/ and pytest provide.
"""
import importlib.metadata
import io

import pytest
import torch
import torch.nn.functional as F
from helpers import KERNEL_PATH, assert_close
from ref64 import add_norm64, leaf64
from torch import nn

import fuseblock
from fuseblock.ops.norm import uses_triton
from models.gpt import GPT, GPTConfig

pytestmark = [pytest.mark.floor, pytest.mark.kernel]


def test_versions_and_path():
    """Print what this run tests, and check that the path under test is the one taken."""
    versions = {n: importlib.metadata.version(n) for n in ("torch", "numpy")}
    try:
        versions["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        versions["triton"] = None
    print("floor smoke:", versions, "kernel path" if KERNEL_PATH else "torch path")
    assert versions["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert uses_triton(torch.ones(2)) == KERNEL_PATH


@pytest.mark.parametrize("kind", ["rms", "layer", "l2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["plain", "residual-fp32", "gate-pre", "gate-post-groups"])
def test_add_norm_values_and_gradients_match_fp64(kind, dtype, case):
    d = 48
    x = torch.randn(4, 3, d).to(dtype).requires_grad_(True)
    w = torch.randn(d).to(dtype).requires_grad_(True)
    b = torch.randn(d).to(dtype).requires_grad_(True)
    kw = {"kind": kind, "eps": 1e-5}
    leaves = [x, w, b]
    residual = None
    if case == "residual-fp32":
        residual = torch.randn(4, 3, d).requires_grad_(True)
        kw["residual_dtype"] = torch.float32
        leaves.append(residual)
    elif case.startswith("gate"):
        kw["gate"] = torch.randn(4, 3, d).to(dtype).requires_grad_(True)
        kw["gate_position"] = case.split("-")[1]
        leaves.append(kw["gate"])
        if case.endswith("groups"):
            kw["num_groups"] = 4
    out, new_res = fuseblock.add_norm(x, residual, w, b, **kw)
    ref64_kw = {k: v for k, v in kw.items() if k != "residual_dtype"}
    ref_out, ref_p = add_norm64(x, residual, w, b, residual_dtype=new_res.dtype, **ref64_kw)
    assert_close(out, ref_out, dtype, "out")
    assert_close(new_res, ref_p, new_res.dtype, "new_residual")
    g_out, g_res = torch.randn_like(out), torch.randn_like(new_res)  # cotangents in each output's dtype
    loss = (out.float() * g_out.float()).sum() + (new_res.float() * g_res.float()).sum()
    ref_loss = (ref_out * g_out.double()).sum() + (ref_p * g_res.double()).sum()
    for name, g, rg, leaf in zip(["x", "w", "b", "r"], torch.autograd.grad(loss, leaves),
                                 torch.autograd.grad(ref_loss, leaves), leaves, strict=False):
        assert g.dtype == leaf.dtype, name
        assert_close(g, rg, leaf.dtype, f"d{name}")


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_equals_torch_functions_and_modules(kind):
    d = 32
    x = torch.randn(6, d, requires_grad=True)
    theirs = nn.RMSNorm(d, eps=1e-6) if kind == "rms" else nn.LayerNorm(d, eps=1e-6)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p))
    ours = fuseblock.Norm(d, kind=kind, eps=1e-6, bias=kind == "layer")
    ours.load_state_dict(theirs.state_dict())
    out, ref = ours(x), theirs(x)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    fn = F.rms_norm(x, (d,), theirs.weight, 1e-6) if kind == "rms" else F.layer_norm(
        x, (d,), theirs.weight, theirs.bias, 1e-6)
    torch.testing.assert_close(fuseblock.norm(x, theirs.weight, getattr(theirs, "bias", None), kind=kind), fn,
                               atol=2e-5, rtol=2e-5)
    cot = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *ours.parameters()], cot)
    want = torch.autograd.grad(ref, [x, *theirs.parameters()], cot)
    assert len(got) == len(want) >= 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_fused_stack_equals_naive_twin():
    dim = 16
    mixers = [nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(3)]
    stack = fuseblock.ResidualStack(mixers, dim, kind="rms", eps=1e-6)
    x = torch.randn(2, 5, dim, requires_grad=True)
    fused = stack(x)
    g_fused = torch.autograd.grad(fused.sum(), [x, *stack.parameters()])
    stack.fused = False
    naive = stack(x)
    g_naive = torch.autograd.grad(naive.sum(), [x, *stack.parameters()])
    torch.testing.assert_close(fused, naive, atol=1e-5, rtol=1e-5)
    assert len(g_fused) == len(g_naive) > 3
    for a, b in zip(g_fused, g_naive, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_family_ops_match_torch():
    x = torch.randn(5, 4, 7)
    x64 = leaf64(x)
    for ord, p in (("l1", 1.0), ("l2", 2.0), ("max", float("inf"))):
        xe = x.clone().requires_grad_(True)
        y, ref = fuseblock.embed_norm(xe, ord, 1e-12), F.normalize(x64, p=p, dim=-1, eps=1e-12)
        assert_close(y, ref, torch.float32, f"embed_norm {ord}")
        cot = torch.randn(y.shape, dtype=torch.float64)
        assert_close(torch.autograd.grad(y, xe, cot.float())[0], torch.autograd.grad(ref, x64, cot)[0], torch.float32,
                     f"d embed_norm {ord}")
    w = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    for name, ours, theirs in (
        ("batch_norm", fuseblock.batch_norm(x, None, None, w, b, training=True),
         F.batch_norm(x, None, None, w, b, training=True)),
        ("group_norm", fuseblock.group_norm(x, 2, w, b), F.group_norm(x, 2, w, b)),
        ("instance_norm", fuseblock.instance_norm(x), F.instance_norm(x)),
    ):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5, msg=name)
    module = fuseblock.BatchNorm(4)
    module(x)
    assert module.num_batches_tracked.item() == 1
    torch.testing.assert_close(module.running_mean, 0.1 * x.mean((0, 2)), atol=1e-6, rtol=1e-5)


def test_fullgraph_compile_traces_the_custom_op():
    torch._dynamo.reset()

    def fn(x, r, w):
        out, res = fuseblock.add_norm(x, r, w, kind="layer")
        return out * 2 + res

    inputs = [torch.randn(*s, requires_grad=True) for s in ((3, 16), (3, 16), (16,))]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    a, b = compiled(*inputs), fn(*inputs)
    torch.testing.assert_close(a, b)
    grads_a, grads_b = torch.autograd.grad(a.square().sum(), inputs), torch.autograd.grad(b.square().sum(), inputs)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb)


def test_gpt_training_step_fused_equals_naive():
    cfg = {"block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16, "vocab_size": 256}
    fused, naive = GPT(GPTConfig(**cfg)), GPT(GPTConfig(**cfg, fused=False))
    naive.load_state_dict(fused.state_dict())
    idx, targets = torch.randint(0, 256, (3, 8)), torch.randint(0, 256, (3, 8))
    losses = []
    for model in (fused, naive):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        losses.append((loss.item(), model(idx, targets)[1].item()))
    (before, after), (naive_before, naive_after) = losses
    assert after < before  # one step on one batch lowers its loss
    assert before == pytest.approx(naive_before, rel=1e-6) and after == pytest.approx(naive_after, rel=1e-5)
    out = fused.generate(idx[:1, :2], max_new_tokens=3, top_k=5)
    assert out.shape == (1, 5)


def test_train_extra_at_its_floor(tmp_path):
    """What the GPT's checkout code uses from the `train` extra: safetensors round trips
    of a model with tied weights (models/checkpoint.py), a progress bar and a loss plot
    (models/plot.py)."""
    st = pytest.importorskip("safetensors.torch")
    tqdm = pytest.importorskip("tqdm").tqdm
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16)
    saved, loaded = GPT(cfg), GPT(cfg)
    st.save_model(saved, str(tmp_path / "model.safetensors"))
    st.load_model(loaded, str(tmp_path / "model.safetensors"))
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    st.save_file({"step": torch.tensor([7])}, str(tmp_path / "t.safetensors"))
    assert st.load_file(str(tmp_path / "t.safetensors"))["step"].item() == 7

    out = io.StringIO()
    with tqdm(total=3, file=out, unit="it") as bar:
        bar.update(3)
    assert "3/3" in out.getvalue()
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([1, 2, 3], [3.0, 2.0, 1.5], label="train")
    ax.legend()
    fig.savefig(tmp_path / "loss.png")
    plt.close(fig)
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
