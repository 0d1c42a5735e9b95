"""The GPT on its two other stream shapes (docs/gpt.md): n residual streams
(GPTConfig.hc, train.py --hc N) and attention residuals (GPTConfig.attn_res, train.py
--attn-res B). For each: the fused stack equals its naive twin, a meta-device build
equals eager construction, train.py records the flag in its checkpoints and resumes
bit-exact, bad values are one-line usage errors, and a checkpoint written before the
field existed still reads as the plain GPT."""
import json
import math
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file
from trainutil import call, train

from models import settings
from models.gpt import GPT, GPTConfig


@dataclass(frozen=True)
class Shape:
    field: str  # GPTConfig's field, train.py's flag with "_" as "-"
    value: int
    stack: str  # the stack's class
    param: str  # a parameter of each block (its shape in the test config: param_shape)
    param_shape: tuple
    head_param: str
    init: tuple  # (key, value every element holds after init_weights), twice

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


HC = Shape("hc", 4, "HyperConnectionStack", "fn", (24, 64), "fn",
           (("stack.blocks.0.base", 0), ("stack.head.scale", 1)))
ATTN_RES = Shape("attn_res", 2, "AttnResStack", "query", (16,), "query",
                 (("stack.blocks.0.query", 0), ("stack.head.weight", 1)))
SHAPES = pytest.mark.parametrize("shape", [HC, ATTN_RES], ids=lambda s: s.field)


def config(shape: Shape, **kw) -> GPTConfig:
    return GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, **{shape.field: shape.value}, **kw)


@SHAPES
def test_fused_and_naive_gpt_agree_on_logits_and_gradients(shape):
    torch.manual_seed(0)
    model = GPT(config(shape))
    assert type(model.stack).__name__ == shape.stack
    assert getattr(model.stack.blocks[0], shape.param).shape == shape.param_shape
    if shape is ATTN_RES:
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


@SHAPES
def test_meta_build_to_empty_init_weights_equals_eager_construction(shape):
    torch.manual_seed(5)
    eager = GPT(config(shape))
    torch.manual_seed(5)
    with torch.device("meta"):
        model = GPT(config(shape))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(math.nan)
    model.init_weights()
    want, have = eager.state_dict(), model.state_dict()
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)
    for key, value in shape.init:
        assert (have[key] == value).all(), key


@SHAPES
def test_train_records_the_flag_and_resumes_bit_exact(tmp_path, shape):
    args = (shape.flag, str(shape.value), "--eval-interval", "2", "--ckpt-interval", "2", "--warmup-iters", "1",
            "--lr-decay-iters", "4")
    train(tmp_path / "straight", 4, *args)
    train(tmp_path / "halves", 2, *args)
    p = call("train.py", "--out-dir", tmp_path / "halves", "--max-iters", "4", "--resume", "--batch-size", "4",
             "--eval-iters", "2", "--no-progress", "--eval-interval", "2", "--ckpt-interval", "2")
    meta = json.loads((tmp_path / "halves" / "ckpt-000004" / "meta.json").read_text())
    assert meta["config"]["model"][shape.field] == shape.value, p.stdout  # resumed without the flag: the checkpoint's
    a = load_file(tmp_path / "straight" / "ckpt-000004" / "model.safetensors")
    b = load_file(tmp_path / "halves" / "ckpt-000004" / "model.safetensors")
    assert f"stack.blocks.0.{shape.param}" in a and f"stack.head.{shape.head_param}" in a
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    straight = json.loads((tmp_path / "straight" / "ckpt-000004" / "meta.json").read_text())
    assert straight["curve"] == meta["curve"] and len(meta["curve"]) == 4
    if shape is ATTN_RES:  # the queries start at 0 (a uniform mix) and learn
        assert not torch.equal(a["stack.blocks.1.query"], torch.zeros(a["stack.blocks.1.query"].shape))
    else:  # a resume asking for another stream count is refused, naming both
        p = call("train.py", "--out-dir", tmp_path / "halves", "--max-iters", "6", "--resume", "--hc", "2",
                 check=False)
        assert p.returncode == 2 and "hc=4" in p.stderr and "--hc asks for 2" in p.stderr


@pytest.mark.parametrize("args,message", [
    (["--hc", "17"], "argument --hc: must be an int in [0, 16]"),
    (["--hc", "two"], "argument --hc: 'two' is not an integer"),
    (["--hc", "4", "--norm", "layer"], "argument --hc: 4 streams normalize with RMS norms"),
    (["--attn-res", "-1"], "argument --attn-res: must be an int >= 0"),
    (["--attn-res", "2", "--norm", "layer"], "argument --attn-res: needs --norm rms"),
    (["--attn-res", "2", "--hc", "2"], "argument --attn-res: needs --norm rms, no --hc"),
])
def test_bad_values_are_one_line_usage_errors(tmp_path, args, message):
    p = call("train.py", "--out-dir", tmp_path / "x", *args, check=False)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("field,bad,message", [
    ("hc", (-1, 17, True, 2.0), "hc must be an int"),
    ("attn_res", (-1, True, 2.0), "attn_res must be an int"),
])
def test_config_refuses_bad_values(field, bad, message):
    for value in bad:
        with pytest.raises(ValueError, match=message):
            GPTConfig(**{field: value})


def test_config_refuses_what_the_shapes_cannot_take():
    with pytest.raises(ValueError, match="needs norm='rms'"):
        GPTConfig(hc=2, norm="layer")
    with pytest.raises(ValueError, match="residual_dtype"):
        GPTConfig(hc=2, residual_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs hc=0, norm='rms'"):
        GPTConfig(attn_res=2, norm="layer")
    with pytest.raises(ValueError, match="needs hc=0"):
        GPTConfig(attn_res=2, hc=2)
    with pytest.raises(ValueError, match="17 block states .* use attn_res >= 2"):
        GPTConfig(attn_res=1, n_layer=8)


@SHAPES
def test_checkpoints_from_before_the_field_read_as_the_plain_gpt(shape):
    old = GPTConfig().to_json()
    del old[shape.field]
    recorded = dict(settings.TRAIN_DEFAULTS, lr_decay_iters=1000)
    meta = {"format": 3, "step": 1, "config": {"model": old, "train": recorded, "world_size": 1}}
    assert settings.meta_problem(meta) is None and getattr(GPTConfig.from_json(old), shape.field) == 0
    meta["config"]["model"] = dict(old, **{shape.field: str(shape.value)})
    assert f"{shape.field}='{shape.value}'" in settings.meta_problem(meta)
