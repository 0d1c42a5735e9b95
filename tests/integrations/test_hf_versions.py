"""fuse across the transformers versions it is tested with (5.17 to 5.24): the KV cache under
either of its names (5.24 renamed past_key_values to cache), and a version outside the range
refused in one line. `make test` runs these on 5.23 (.venv) and 5.24 (`make test-hf524`)."""
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import batch, pair  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

from fuseblock.integrations.transformers import fuse  # noqa: E402
from fuseblock.integrations.transformers.versions import CACHE, TESTED, check_version, minor  # noqa: E402


@pytest.mark.parametrize("version", ["5.16.2", "5.25.0", "5.25.0.dev0", "6.0.0", "4.57.1"])
def test_a_version_outside_the_tested_range_is_refused_in_one_line(version, monkeypatch):
    model = pair("llama")[0]
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)  # the module import gives now
    with pytest.raises(RuntimeError, match=rf"^fuse is tested with transformers 5\.17 to 5\.24, found transformers "
                                           rf"{version}: install 'transformers>=5\.17,<5\.25'") as e:
        fuse(model)
    assert "\n" not in str(e.value)
    assert not any(type(m).__name__ == "Norm" for m in model.modules())  # refused before anything changed


def test_the_version_checked_is_the_module_import_gives_now(monkeypatch):
    # transformers' processing_utils re-runs transformers/__init__ on its first import
    # (direct_transformers_import) and puts that module in sys.modules: a multimodal model's
    # first use swaps the module under code that imported the first (this test, run after
    # test_hf_muse_spark's, failed so)
    import types

    fresh = types.ModuleType("transformers")
    fresh.__version__ = "5.25.0"
    monkeypatch.setitem(sys.modules, "transformers", fresh)
    with pytest.raises(RuntimeError, match="found transformers 5.25.0"):
        check_version()


@pytest.mark.parametrize("version", ["5.17.0", "5.23.0", "5.24.0", "5.24.3"])
def test_every_version_of_the_range_passes(version):
    check_version(version)


def test_the_installed_version_is_tested_and_the_cache_keyword_is_its_own():
    import inspect

    assert TESTED[0] <= minor(transformers.__version__) <= TESTED[1]
    assert CACHE in inspect.signature(transformers.LlamaModel.forward).parameters
    assert CACHE == ("cache" if minor(transformers.__version__) >= (5, 24) else "past_key_values")


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox", "deepseek_v4"])
def test_the_fused_model_takes_the_cache_under_either_name(arch):
    """The inner model's forward given a cache as `cache` or as `past_key_values`, prefilling 8
    tokens then taking 2 more: the same last hidden state as the unfused inner model given it
    under the installed version's name, the cache grown by the tokens (not a fresh one made
    inside), and both names at once a ValueError."""
    unfused, fused = pair(arch)
    ids = batch(t=10)[0]
    expected, grown = None, []
    for model, name in ((unfused.base_model, CACHE), (fused.base_model, "cache"),
                        (fused.base_model, "past_key_values")):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :8], use_cache=True, **{name: cache})
            logits = model(input_ids=ids[:, 8:], use_cache=True, **{name: cache}).last_hidden_state
        grown.append(cache.get_seq_length())
        if expected is None:
            expected = logits
        assert torch.equal(logits, expected), (arch, name)
    assert grown == [10, 10, 10]
    with pytest.raises(ValueError, match="cache or as past_key_values .* not both"):
        fused.base_model(input_ids=ids, use_cache=True, cache=DynamicCache(config=fused.config),
              past_key_values=DynamicCache(config=fused.config))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v4"])
def test_greedy_generate_with_the_cache_equals_the_untouched_model(arch):
    """The issue's report: on 5.24 the fused forwards dropped the cache generate passes as
    `cache`, and greedy generation gave other tokens. 12 new tokens, left padding."""
    unfused, fused = pair(arch)
    ids, mask, _ = batch(t=6)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    a, b = unfused.generate(ids, **kw), fused.generate(ids, **kw)
    assert a.shape == (2, 18) and torch.equal(a, b), (a, b)
