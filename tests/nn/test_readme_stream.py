"""The worked example "Example: your own transformer" runs verbatim, so the docs cannot rot.

The example is the one ```python block in the README's section under that heading.
"""
import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADING = "Example: your own transformer"
SOURCES = [ROOT / "README.md"]


def heading(line):
    """(level, title) of a markdown heading line, else None."""
    m = re.fullmatch(r"(#+)\s+(.*?)\s*", line)
    return (len(m.group(1)), m.group(2)) if m else None


def extract(text):
    """The ```python blocks of the section titled HEADING (None when there is no such section)."""
    blocks, current, level, in_fence = [], None, None, False
    for line in text.splitlines():
        if line.startswith("```"):
            if level is not None and not in_fence and line.strip() == "```python":
                current = []
            elif in_fence and current is not None:
                blocks.append("\n".join(current) + "\n")
                current = None
            in_fence = not in_fence
        elif in_fence:
            if current is not None:
                current.append(line)
        elif heading(line):
            lvl, title = heading(line)
            if title == HEADING:
                assert level is None, f"heading {HEADING!r} appears twice"
                level = lvl
            elif level is not None and lvl <= level:
                break  # the section ends at the next heading of its level or above
    return None if level is None else blocks


def sources():
    return [p for p in SOURCES if p.exists() and extract(p.read_text()) is not None]


def test_the_example_is_found():
    assert sources(), f"no section {HEADING!r} in {[str(p) for p in SOURCES]}"


@pytest.mark.kernel
@pytest.mark.parametrize("path", sources(), ids=lambda p: p.name)
def test_example_runs_verbatim(path):
    blocks = extract(path.read_text())
    assert len(blocks) == 1, f"expected one ```python block under {HEADING!r}, found {len(blocks)}"
    ns = {"__name__": "doc_example"}
    exec(compile(blocks[0], str(path), "exec"), ns)  # the example asserts fused == loop == naive itself
    # ... and here: it ran a real model in both forms, gradients included, and left the stack fused
    logits, naive = ns["logits"], ns["logits_naive"]
    assert logits.shape == (*ns["idx"].shape, ns["vocab"]) and torch.isfinite(logits).all() and logits.std() > 0
    torch.testing.assert_close(naive, logits, rtol=1e-4, atol=1e-4)
    assert ns["model"].stack.fused and ns["loop"].blocks[0].mixer is not ns["model"].stack.blocks[0].mixer
    assert len(ns["grads"]) == len(list(ns["model"].parameters()))
    assert all(g.abs().sum() > 0 for g in ns["grads"])
