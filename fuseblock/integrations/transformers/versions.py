"""The transformers versions fuse is tested with, and what changes between them.

fuse is tested with transformers 5.17 to 5.24 (`TESTED`; pyproject's hf extra holds the
same range) and refuses to run on another version (`check_version`): a fused forward
calls transformers' masks, caches and modules by their keywords, and a release that
renames one (5.24 renamed past_key_values to cache) would otherwise run with the cache
dropped and generate other tokens, silently.

What differs within the range:
- the KV cache's keyword (`CACHE`): the models, decoder layers, attention modules, mask
  builders and output classes of 5.24 take it as `cache` (the old name deprecated until
  5.40); those of 5.23 and before as `past_key_values` (linear attention: `cache_params`,
  `LINEAR_CACHE`). The fused forwards take either (`one_cache`) and pass it on under the
  installed version's.
"""
from __future__ import annotations

import sys

import transformers

# [first, last] minor versions fuse is tested with
TESTED = ((5, 17), (5, 24))


def minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "5.24.0" -> (5, 24), "5.25.0.dev0" -> (5, 25)."""
    major, minor_, *_ = version.split(".")
    return int(major), int("".join(c for c in minor_ if c.isdigit()) or 0)


def tested_range() -> str:
    (a, b), (c, d) = TESTED
    return f"transformers {a}.{b} to {c}.{d}"


def check_version(version: str | None = None) -> None:
    """A RuntimeError naming the tested range where the installed transformers (or
    `version`) is outside it. The installed one is the module `import transformers` gives
    now: transformers' processing_utils re-runs its __init__ on first import
    (direct_transformers_import) and puts that new module in sys.modules."""
    version = sys.modules["transformers"].__version__ if version is None else version
    if not TESTED[0] <= minor(version) <= TESTED[1]:
        (c, d) = TESTED[1]
        raise RuntimeError(f"fuse is tested with {tested_range()}, found transformers {version}: install "
                           f"'transformers>={TESTED[0][0]}.{TESTED[0][1]},<{c}.{d + 1}' (an untested version may "
                           f"pass the cache or the masks under other names: a silently different model)")


_RENAMED = minor(transformers.__version__) >= (5, 24)
# the KV cache's keyword for the models, layers, attention modules, masks and outputs
CACHE = "cache" if _RENAMED else "past_key_values"
# ... and for the linear-attention modules (GLM-5-next's)
LINEAR_CACHE = "cache" if _RENAMED else "cache_params"


def one_cache(cache, kwargs: dict):
    """The cache a fused forward was given, under either name: `cache` (5.24's) or
    `past_key_values` (popped from kwargs); both given is a ValueError."""
    old = kwargs.pop("past_key_values", None)
    if cache is not None and old is not None:
        raise ValueError("pass the KV cache as cache or as past_key_values (its name before transformers 5.24), "
                         "not both")
    return old if cache is None else cache
