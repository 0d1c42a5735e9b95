"""The GPT with attention residuals (GPTConfig.attn_res, train.py --attn-res B; docs/gpt.md):
the fused stack equals its naive twin, a meta-device build equals eager construction,
train.py records attn_res in its checkpoints and resumes bit-exact, bad values are one-line
usage errors, and a checkpoint written before attn_res existed still reads as the plain GPT."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from trainutil import call, train

from models import settings
from models.gpt import GPT, GPTConfig

CFG = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, attn_res=2)


def test_fused_and_naive_gpt_agree_on_logits_and_gradients():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    assert type(model.stack).__name__ == "AttnResStack" and model.stack.blocks[0].query.shape == (16,)
    with torch.no_grad():  # away from the init's uniform mix
        for b in [*model.stack.blocks, model.stack.head]:
            b.query.normal_()
    idx = torch.randint(0, 256, (2, 8))
    got = []
    for fused in (True, False):
        model.stack.fused = fused
        logits, loss = model(idx, idx)
        got.append((logits, torch.autograd.grad(loss, list(model.parameters()))))
    torch.testing.assert_close(got[0][0], got[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[0][1], got[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_meta_build_to_empty_init_weights_equals_eager_construction():
    torch.manual_seed(5)
    eager = GPT(GPTConfig(**CFG))
    torch.manual_seed(5)
    with torch.device("meta"):
        model = GPT(GPTConfig(**CFG))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(math.nan)
    model.init_weights()
    want, have = eager.state_dict(), model.state_dict()
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)
    assert (have["stack.blocks.0.query"] == 0).all() and (have["stack.head.weight"] == 1).all()


def test_train_attn_res_records_it_and_resumes_bit_exact(tmp_path):
    args = ("--attn-res", "2", "--eval-interval", "2", "--ckpt-interval", "2", "--warmup-iters", "1",
            "--lr-decay-iters", "4")
    train(tmp_path / "straight", 4, *args)
    train(tmp_path / "halves", 2, *args)
    p = call("train.py", "--out-dir", tmp_path / "halves", "--max-iters", "4", "--resume", "--batch-size", "4",
             "--eval-iters", "2", "--no-progress", "--eval-interval", "2", "--ckpt-interval", "2")
    meta = json.loads((tmp_path / "halves" / "ckpt-000004" / "meta.json").read_text())
    assert meta["config"]["model"]["attn_res"] == 2, p.stdout  # resumed without --attn-res: the checkpoint's
    a = load_file(tmp_path / "straight" / "ckpt-000004" / "model.safetensors")
    b = load_file(tmp_path / "halves" / "ckpt-000004" / "model.safetensors")
    assert "stack.blocks.0.query" in a and "stack.head.query" in a
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["stack.blocks.1.query"], torch.zeros(a["stack.blocks.1.query"].shape))  # it learns
    straight = json.loads((tmp_path / "straight" / "ckpt-000004" / "meta.json").read_text())
    assert straight["curve"] == meta["curve"] and len(meta["curve"]) == 4


@pytest.mark.parametrize("args,message", [
    (["--attn-res", "-1"], "argument --attn-res: must be an int >= 0"),
    (["--attn-res", "2", "--norm", "layer"], "argument --attn-res: needs --norm rms"),
    (["--attn-res", "2", "--hc", "2"], "argument --attn-res: needs --norm rms, no --hc"),
])
def test_bad_attn_res_values_are_one_line_usage_errors(tmp_path, args, message):
    p = call("train.py", "--out-dir", tmp_path / "x", *args, check=False)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "x").exists()


def test_config_checks_and_checkpoints_from_before_attn_res():
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="attn_res must be an int"):
            GPTConfig(attn_res=bad)
    with pytest.raises(ValueError, match="needs hc=0, norm='rms'"):
        GPTConfig(attn_res=2, norm="layer")
    with pytest.raises(ValueError, match="needs hc=0"):
        GPTConfig(attn_res=2, hc=2)
    with pytest.raises(ValueError, match="17 block states .* use attn_res >= 2"):
        GPTConfig(attn_res=1, n_layer=8)
    old = GPTConfig().to_json()
    del old["attn_res"]  # a checkpoint written before the field existed: the plain GPT
    recorded = dict(settings.TRAIN_DEFAULTS, lr_decay_iters=1000)
    meta = {"format": 3, "step": 1, "config": {"model": old, "train": recorded, "world_size": 1}}
    assert settings.meta_problem(meta) is None and GPTConfig.from_json(old).attn_res == 0
    meta["config"]["model"] = dict(old, attn_res="2")
    assert "attn_res='2'" in settings.meta_problem(meta)
