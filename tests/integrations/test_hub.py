"""fuseblock.hub: the kernel-hub layers through the `kernels` package's own machinery.

transformers 5.23 marks its norms for the hub only with kernels >= 0.18.2 installed
(`use_kernel_forward_from_hub` is a no-op otherwise); the newest on PyPI here is 0.17.2,
so the tests mark the classes as that decorator would, with kernels' own
`replace_kernel_forward_from_hub` (undone after each test). The rest is kernels' code:
its layer validation, LocalLayerRepository loading the repository that
`fuseblock.hub.repository` writes, and kernelize.
"""
import copy
from pathlib import Path

import pytest
import torch
from helpers import DEVICE

kernels = pytest.importorskip("kernels")
if not hasattr(kernels, "LocalLayerRepository"):  # another package's `kernels` (a namespace package on one GPU image)
    pytest.skip("the installed `kernels` is not Hugging Face's (no LocalLayerRepository): pip install 'fuseblock[hub]'",
                allow_module_level=True)
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated  # noqa: E402

from fuseblock.hub import layers  # noqa: E402
from fuseblock.hub.repository import write  # noqa: E402

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    path = tmp_path_factory.mktemp("hub")
    write(path)
    return path


def _mark(monkeypatch, cls, name):
    """What transformers' @use_kernel_forward_from_hub(name) does with a kernels it accepts."""
    for attr in ("kernel_layer_name", "kernel_condition"):
        monkeypatch.delattr(cls, attr, raising=False)
        monkeypatch.setattr(cls, attr, None, raising=False)
    kernels.replace_kernel_forward_from_hub(cls, name)


def _mapping(repo, name):
    local = LocalLayerRepository(repo_path=Path(repo), layer_name=name)
    return {name: {DEVICE: {Mode.TRAINING: local, Mode.INFERENCE: local}}}


def test_repository_layers_pass_kernels_validation(repo):
    from kernels.layer.layer import _validate_layer

    for name, check in (("RMSNorm", LlamaRMSNorm), ("RMSNorm", Qwen3RMSNorm), ("RMSNormGated", Qwen3NextRMSNormGated),
                        ("RMSNormZeroCentered", Qwen3_5RMSNorm)):
        local = LocalLayerRepository(repo_path=Path(repo), layer_name=name)
        cls = local.load()
        assert cls is getattr(layers, name)
        _validate_layer(check_cls=check, cls=cls, repo=local)  # raises TypeError on a bad layer
        assert cls.has_backward and cls.can_torch_compile


def test_validation_would_refuse_a_stateful_layer(repo):
    # kernels' validation is live: a layer with a member of its own fails it
    from kernels.layer.layer import _validate_layer

    class Stateful(layers.RMSNorm):
        def helper(self):
            return 1

    with pytest.raises(TypeError, match="additional members"):
        _validate_layer(check_cls=LlamaRMSNorm, cls=Stateful, repo="test")


def _tiny(family):
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)), LlamaRMSNorm
    return Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common)), Qwen3RMSNorm


@pytest.mark.parametrize("mode", ["training", "inference"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kernelize_swaps_every_norm_and_changes_nothing(monkeypatch, repo, family, mode):
    model, norm_cls = _tiny(family)
    _mark(monkeypatch, norm_cls, "RMSNorm")
    with torch.no_grad():  # weights away from 1, so the norm's weight matters
        for m in model.modules():
            if isinstance(m, norm_cls):
                m.weight.normal_(1.0, 0.2)
    untouched = copy.deepcopy(model)
    if mode == "inference":
        model.eval(), untouched.eval()
    with use_kernel_mapping(_mapping(repo, "RMSNorm"), inherit_mapping=False):
        kernelize(model, mode=Mode.TRAINING if mode == "training" else Mode.INFERENCE, device=DEVICE)
    norms = [m for m in model.modules() if isinstance(m, norm_cls)]
    assert norms and all(m.forward.__func__ is layers.RMSNorm.forward for m in norms)  # q/k norms too (qwen3)
    ids = torch.randint(0, 96, (2, 9))
    got, want = model(ids, labels=ids), untouched(ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    if mode == "training":
        got.loss.backward()
        want.loss.backward()
        for (name, p), q in zip(model.named_parameters(), untouched.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_kernelize_gated_norm(monkeypatch, repo):
    _mark(monkeypatch, Qwen3NextRMSNormGated, "RMSNormGated")
    model = torch.nn.Sequential(Qwen3NextRMSNormGated(24, eps=1e-6))
    with torch.no_grad():
        model[0].weight.normal_(1.0, 0.2)
    untouched = copy.deepcopy(model)
    with use_kernel_mapping(_mapping(repo, "RMSNormGated"), inherit_mapping=False):
        kernelize(model, mode=Mode.TRAINING, device=DEVICE)
    assert model[0].forward.__func__ is layers.RMSNormGated.forward
    x, gate = torch.randn(5, 24, requires_grad=True), torch.randn(5, 24, requires_grad=True)
    got, want = model[0](x, gate), untouched[0](x, gate)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(got)
    g1 = torch.autograd.grad(got, (x, gate, model[0].weight), dy)
    g2 = torch.autograd.grad(want, (x, gate, untouched[0].weight), dy)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernelize_zero_centered_norm(monkeypatch, repo, dtype):
    """Qwen3.5's RMSNorm (x / rms(x) * (1 + w), in fp32, out in x's dtype), which transformers
    5.24 marks "RMSNormZeroCentered": the layer gives its output, dtype and gradients (fp32
    within 1e-5; bf16 within one bf16 rounding of the unfused output)."""
    _mark(monkeypatch, Qwen3_5RMSNorm, "RMSNormZeroCentered")
    model = torch.nn.Sequential(Qwen3_5RMSNorm(24, eps=1e-6))
    with torch.no_grad():
        model[0].weight.normal_(0.0, 0.2)  # stored as w, applied as 1 + w: zeros are the identity
    model.to(dtype)
    untouched = copy.deepcopy(model)
    with use_kernel_mapping(_mapping(repo, "RMSNormZeroCentered"), inherit_mapping=False):
        kernelize(model, mode=Mode.TRAINING, device=DEVICE)
    assert model[0].forward.__func__ is layers.RMSNormZeroCentered.forward
    x = torch.randn(5, 24, dtype=dtype, requires_grad=True)
    got, want = model[0](x), untouched[0](x)
    assert got.dtype == want.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(got, want, **tol)
    assert not torch.allclose(got.float(), torch.nn.functional.rms_norm(x.float(), (24,), eps=1e-6) *
                              model[0].weight.float(), atol=1e-2)  # the offset matters: 1 + w, not w
    if dtype == torch.float32:
        dy = torch.randn_like(got)
        g1 = torch.autograd.grad(got, (x, model[0].weight), dy)
        g2 = torch.autograd.grad(want, (x, untouched[0].weight), dy)
        for a, b in zip(g1, g2, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.bfloat16)], ids=["bf16_x_fp32_w", "fp32_x_bf16_w", "bf16"])
def test_rms_norm_returns_the_dtype_llama_returns(dtypes):
    # LlamaRMSNorm: weight * normed.to(input dtype), so an fp32 weight on bf16 input gives fp32
    x_dtype, w_dtype = dtypes
    module = LlamaRMSNorm(64, eps=1e-6).to(device=DEVICE, dtype=w_dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(64) * 0.5 + 1)
    x = torch.randn(3, 5, 64, device=DEVICE).to(x_dtype).requires_grad_()
    want = module(x)
    got = layers.rms_norm_forward(module, x)
    assert got.dtype == want.dtype
    # fuseblock rounds the fp32 product once, Llama the normed x to the input's dtype first
    tol = 1e-2 if torch.bfloat16 in dtypes else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    g = torch.randn_like(want)
    (dx,) = torch.autograd.grad(got, x, g)
    (dx_want,) = torch.autograd.grad(want, x, g)
    assert dx.dtype == x.dtype
    torch.testing.assert_close(dx.float(), dx_want.float(), rtol=2e-2, atol=2e-2)
