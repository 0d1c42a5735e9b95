"""What the test modules share: which path this run tests, a seeded generator on its
device, the fp64 comparison, the core op's full check (`run_case`), a count of Triton
launches and one of every launch, and two small mixers the stream tests build stacks of.

Test modules import these from here, never from one another or from conftest; conftest
holds the fixtures and hooks (the `launches` fixture, the `kernel_only` / `torch_only`
markers). ref64 stays apart: the independent fp64 reference these checks compare against.

fuseblock (and through it triton) is imported inside the functions that use it:
conftest imports this module before any test module, and before it has moved tensors
to FUSEBLOCK_TEST_DEVICE.
"""
import contextlib
import os

import pytest
import torch
from ref64 import add_norm64, tolerances

DEVICE = os.environ.get("FUSEBLOCK_TEST_DEVICE", "cpu")
# The kernel path: the Triton kernels run, through the interpreter on CPU or compiled on a GPU.
KERNEL_PATH = os.environ.get("TRITON_INTERPRET") == "1" or DEVICE == "cuda"
# The interpreter runs the kernels (CPU tensors, TRITON_INTERPRET=1): the byte counters
# (fuseblock.testing.traffic.KernelTraffic) read its loads and stores, which a GPU run has not.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and DEVICE == "cpu"
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="counts the interpreter's loads and stores")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def generator(seed: int) -> torch.Generator:
    """A generator seeded with `seed` on DEVICE, where the test tensors are drawn: a CPU
    generator cannot draw CUDA tensors. On CPU it draws what torch.Generator().manual_seed(seed)
    draws, so the values (and the expectations built on them) are the same."""
    return torch.Generator(device=DEVICE).manual_seed(seed)


def assert_close(actual, expected, dtype, what, *, cond=1.0, per_row=False):
    """|actual - expected| <= cond * atol * scale + rtol * |expected|, elementwise, with
    (atol, rtol) = ref64.tolerances(dtype).

    scale is max(1, max|expected|) over the whole tensor, or with per_row=True
    max(1, max|expected row|) for each row (last dim), which lets one tensor hold rows of
    very different sizes (a clamped zero row's gradient is dy / eps). cond > 1 widens atol
    for ill-conditioned cases (see run_case). An empty tensor is close to an empty one."""
    atol, rtol = tolerances(dtype)
    atol *= cond
    expected = expected.detach().double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    err = (actual.detach().double() - expected).abs() - rtol * expected.abs()
    if per_row:
        row = expected.abs().amax(-1, keepdim=True).clamp_min(1.0) if expected.dim() else 1.0
        excess = (err - atol * row).max().item()
        assert excess <= 0, f"{what}: worst excess error {excess:.3g} (atol {atol:.3g} x max(1, max|row|))"
    else:
        bound = atol * max(1.0, expected.abs().max().item())
        worst = err.max().item()
        assert worst <= bound, f"{what}: error {worst:.3g} > {bound:.3g}"


def run_case(x, residual, weight, bias, *, residual_dtype=None, grad_res=True, **kw):
    """fuseblock.add_norm forward + backward against the fp64 reference (ref64.add_norm64):
    output, new residual and the gradient of every leaf given (gate too, if in kw)."""
    import fuseblock

    given = {"x": x, "residual": residual, "weight": weight, "bias": bias, "gate": kw.get("gate")}
    named = {name: t for name, t in given.items() if t is not None}
    leaves = list(named.values())
    for t in leaves:
        t.requires_grad_(True)
    out, new_res = fuseblock.add_norm(x, residual, weight, bias, residual_dtype=residual_dtype, **kw)
    assert out.dtype == x.dtype and out.shape == x.shape
    rdtype = residual_dtype or x.dtype
    assert new_res.dtype == rdtype and new_res.shape == x.shape

    ref_out, ref_p = add_norm64(x, residual, weight, bias, residual_dtype=rdtype, **kw)
    assert_close(out, ref_out, x.dtype, "out")
    assert_close(new_res, ref_p, rdtype, "new_residual")

    g_out = torch.randn_like(out)
    g_res = torch.randn_like(new_res) if grad_res else None
    loss = (out.float() * g_out.float()).sum() + ((new_res.float() * g_res.float()).sum() if grad_res else 0)
    grads = torch.autograd.grad(loss, leaves)
    ref_loss = (ref_out * g_out.double()).sum() + ((ref_p * g_res.double()).sum() if grad_res else 0)
    ref_grads = torch.autograd.grad(ref_loss, leaves)
    # A layer norm of d = 1 is constant: sigma = sqrt(eps), so intermediates are 1/sqrt(eps)
    # (~316 at eps=1e-5) times the gradient and cancel exactly only in exact arithmetic. On a
    # GPU, FMA contraction (or ATen's Welford mean on CPU) leaves an ulp or two of those
    # large terms, so allow 16x more there.
    cond = 16.0 if kw.get("kind") == "layer" and x.shape[-1] == 1 else 1.0
    for (name, leaf), g, rg in zip(named.items(), grads, ref_grads, strict=True):
        assert g.dtype == leaf.dtype, name
        assert_close(g, rg, leaf.dtype, f"d{name}", cond=cond)
    return out, new_res


class Launches:
    """Triton launches by kind ("fwd", "bwd", "embed_fwd", "embed_bwd"), counted by
    fuseblock.kernels.launch.LAUNCHES since this object was made or last reset():
    `launches["fwd"]`, or `launches("fwd", "bwd")` for a tuple. The `launches` fixture
    gives a test one, started at its setup."""

    def __init__(self):
        import fuseblock.kernels.launch  # here, not at the top: triton may be absent

        self._module = fuseblock.kernels.launch
        self.reset()

    def reset(self):
        self._start = dict(self._module.LAUNCHES)

    def __getitem__(self, kind):
        return self._module.LAUNCHES.get(kind, 0) - self._start.get(kind, 0)

    def __call__(self, *kinds):
        return tuple(self[k] for k in kinds)

    def total(self) -> int:
        """Launches of every kind."""
        return sum(self._module.LAUNCHES.values()) - sum(self._start.values())


class AllLaunches(contextlib.AbstractContextManager):
    """Every launch the code run inside makes, Triton kernels and torch ops together: what a
    GPU would run for it. `kernels`: Triton launches (fuseblock.kernels.launch.LAUNCHES); under
    the interpreter also `names`, those the interpreter really ran (else None). `ops`: the
    aten ops that compute or copy, as fuseblock.testing.traffic.EagerTraffic (a
    TorchDispatchMode) sees them. It passes over views (view, t, transpose, as_strided,
    detach, alias: `func.is_view`), which only make new metadata, and allocations and
    metadata queries (empty, empty_strided, new_empty, _unsafe_view, sym_size...:
    traffic.FREE_OPS): none of them launches a kernel on a GPU, where the caching allocator
    hands out memory without one. A reshape that must copy reaches it as clone: counted.
    Under the interpreter, its own host copies inside a launch are not counted
    (traffic.KernelTraffic pauses the eager counter there)."""

    def __enter__(self):
        from fuseblock.testing.traffic import EagerTraffic, KernelTraffic

        self._launches = Launches()
        self._kernel = KernelTraffic(glue=True) if INTERPRETED else None
        self._counter = self._kernel if INTERPRETED else EagerTraffic()
        self._counter.__enter__()
        return self

    def __exit__(self, *exc):
        self._counter.__exit__(*exc)
        self.kernels = self._launches.total()
        eager = self._kernel.glue if self._kernel is not None else self._counter
        self.ops = [name for name, _, _ in eager.ops]
        self.host_ops = eager.host_ops  # host arithmetic, no launch (traffic.EagerTraffic)
        self.launches = None if self._kernel is None else self._kernel.launches  # with bytes per argument
        self.names = None if self._kernel is None else [ln.kernel for ln in self.launches]
        return False

    @property
    def total(self) -> int:
        return self.kernels + len(self.ops)


class MLP(torch.nn.Module):
    """A mixer: (..., dim) -> (..., dim)."""

    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, h):
        return self.down(torch.nn.functional.gelu(self.up(h)))


class KeywordMixer(torch.nn.Module):
    """A mixer fed a keyword, returning (out, extra) as Hugging Face attention does."""

    def __init__(self, dim: int):
        super().__init__()
        self.v = torch.nn.Linear(dim, dim)

    def forward(self, h, *, scale=1.0):
        out = self.v(h) * scale
        return out, out.sum()
