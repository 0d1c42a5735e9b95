"""The Llama-shaped families (issue 43), one table row each: Llama's pre-norm layer under its
names or others (Apertus, VaultGemma), OLMo2's post-norm layer (OLMo3, EXAONE-4, FlexOlmo),
Cohere's parallel one (Cohere2), each with its own attention and MoE left as it is. Each row
is held to what the families of test_transformers.py are, in one test to keep the suite's
CPU time: fp32 logits, loss, every gradient and every hidden state bitwise the unfused
model's (the torch path), no residual add outside the fused ops, the output class, greedy
generation with the cache and padding, save_pretrained's keys both ways, gradient
checkpointing; the kernel path within test_transformers.py's bounds on a few.
"""
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import KERNEL_PATH  # noqa: E402
from hf_models import batch, max_diff, pair, run, stream_ops  # noqa: E402

from fuseblock.integrations.transformers import FAMILIES  # noqa: E402
from fuseblock.integrations.transformers.tiny import LLAMA_SHAPED  # noqa: E402

ROWS = sorted(LLAMA_SHAPED)
# CohereLayerNorm's fp32 ops against torch.layer_norm: ulps apart (test_transformers.py's NOT_BITWISE)
NOT_BITWISE = {"cohere2": dict(rtol=1e-5, atol=1e-5), "cohere2_moe": dict(rtol=1e-5, atol=1e-5)}
# the kernel path on one row of each shape and kind: MLA + MoE, sinks + MoE, post-norm, parallel
KERNEL_ROWS = ["deepseek_v3", "gpt_oss", "olmo3", "cohere2"]


def same(x, y, arch):
    if arch in NOT_BITWISE:
        torch.testing.assert_close(x, y, **NOT_BITWISE[arch])
    else:
        assert torch.equal(x, y), max_diff(x, y)


@pytest.mark.parametrize("arch", ROWS)
def test_family_row(arch, tmp_path, monkeypatch):
    unfused, fused = pair(arch)
    assert list(fused.state_dict()) == list(unfused.state_dict())
    ids, mask, labels = batch(t=8)
    a, b = run(unfused, ids, mask, labels), run(fused, ids, mask, labels)
    assert b[2].keys() == a[2].keys() and len(b[3]) == len(a[3]) == 3
    for x, y in [*zip(b[:2], a[:2], strict=True), *((b[2][n], a[2][n]) for n in a[2]), *zip(b[3], a[3], strict=True)]:
        same(x, y, arch)
    # fused: the stream's 2n residual adds (a parallel layer's one) are inside the stream ops, which
    # take a residual that many times (the adds left are the MoE blocks' own: shared experts)
    u, f, calls = stream_ops(unfused, fused, ids, monkeypatch)
    parallel = FAMILIES[arch].shape.name == "parallel"
    assert u.adds - f.adds == 4, (u.adds, f.adds)
    assert sum(c[2] for c in calls) == (2 if parallel else 4)
    with torch.no_grad():
        assert type(fused.base_model(ids)) is type(unfused.base_model(ids))
    # greedy generation with the cache, left padding
    g_ids, g_mask, _ = batch(t=5)
    kw = dict(attention_mask=g_mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(unfused.generate(g_ids, **kw), fused.generate(g_ids, **kw))
    # save_pretrained: the unfused model's keys, loading into the unfused class
    from safetensors.torch import load_file

    unfused.save_pretrained(tmp_path / "unfused")
    fused.save_pretrained(tmp_path / "fused")
    assert load_file(tmp_path / "fused" / "model.safetensors").keys() == \
        load_file(tmp_path / "unfused" / "model.safetensors").keys()
    back = type(unfused).from_pretrained(tmp_path / "fused").eval()
    with torch.no_grad():
        same(back(ids).logits, unfused(ids).logits, arch)
    # gradient checkpointing in training mode: the forward recomputed, the same loss and gradients
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.23 renames it activation_checkpointing_enable
        fused.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in fused.model.layers)
    unfused.train(), fused.train()
    # (one seed for both: the dropouts and router noise inside the attention and MoE draw alike)
    a, b = (torch.manual_seed(0) and run(m, ids, mask, labels, hidden=False) for m in (unfused, fused))
    assert b[2].keys() == a[2].keys()
    torch.testing.assert_close(b[1], a[1], rtol=1e-6, atol=1e-6)
    for name in a[2]:
        torch.testing.assert_close(b[2][name], a[2][name], rtol=1e-5, atol=1e-5)


@pytest.mark.kernel
@pytest.mark.parametrize("arch", KERNEL_ROWS)
def test_kernel_path_matches_the_unfused_model(arch):
    unfused, fused = pair(arch)
    ids, mask, labels = batch(t=6)
    a, b = run(unfused, ids, mask, labels, hidden=False), run(fused, ids, mask, labels, hidden=False)
    # test_transformers.py's kernel-path bounds: 1e-5 on the loss, 1e-4 on logits and gradients
    close = KERNEL_PATH or arch in NOT_BITWISE
    for x, y, tol in [(b[0], a[0], 1e-4), (b[1], a[1], 1e-5), *((b[2][n], a[2][n], 1e-4) for n in a[2])]:
        torch.testing.assert_close(x, y, rtol=tol if close else 0, atol=tol if close else 0)
