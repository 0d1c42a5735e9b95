"""Every ```python block of README.md and docs/*.md runs as printed, on the CPU.

Each block runs alone, in a fresh namespace, in this process: a reader copies one block,
not the page. Two marks in the markdown, on the line just before a fence, change that:

- `<!-- fragment: REASON -->`: the block is a fragment by design (a signature, a sketch
  that needs a model of yours) and is not run; REASON must say why.
- `<!-- name: NAME -->`: a name for the block, which the checks below use to find the
  namespace it left (the worked examples, whose results they inspect further).

A block that uses CUDA picks its device by availability, as printed:
`device = "cuda" if torch.cuda.is_available() else "cpu"`; a block that names "cuda"
without that test fails here. A block may load a model from the Hugging Face hub by name
(`from_pretrained("owner/name")`): nothing is downloaded here, the name is replaced by the
path of a tiny model of the same family built from `tiny_config` and saved in a temporary
folder (HUB_NAMES maps each name the docs use to its family). Bash blocks are not run.
"""
import pathlib
import re
from dataclasses import dataclass

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# the hub names the docs load, and the family of the tiny model that stands in for each
HUB_NAMES = {"Qwen/Qwen3-0.6B": "qwen3"}
HUB_CALL = re.compile(r"""from_pretrained\(\s*["']([\w.-]+/[\w.-]+)["']""")
MARK = re.compile(r"<!--\s*(fragment|name):\s*(.*?)\s*-->")
CUDA_BY_AVAILABILITY = '"cuda" if torch.cuda.is_available() else "cpu"'


@dataclass
class Block:
    doc: pathlib.Path
    line: int  # of the opening fence, 1-based
    code: str
    fragment: str | None  # the reason, when marked a fragment
    name: str | None

    @property
    def id(self):
        return f"{self.doc.name}:{self.name or self.line}"


def blocks(doc: pathlib.Path) -> list[Block]:
    """The ```python blocks of doc, with the mark on the line before each (indented fences too)."""
    lines = doc.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("```"):
            indent = len(lines[i]) - len(lines[i].lstrip())
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            if stripped == "```python":
                mark = MARK.search(lines[i - 1]) if i else None
                code = "\n".join(ln[indent:] for ln in lines[i + 1:end]) + "\n"
                found.append(Block(doc, i + 1, code,
                                   mark.group(2) if mark and mark.group(1) == "fragment" else None,
                                   mark.group(2) if mark and mark.group(1) == "name" else None))
            i = end
        i += 1
    return found


ALL = [b for doc in DOCS for b in blocks(doc)]
RUN = [b for b in ALL if b.fragment is None]


def test_the_blocks_are_found_and_fragments_say_why():
    assert len(ALL) >= 20 and len(RUN) >= len(ALL) // 2, (len(ALL), len(RUN))
    for b in ALL:
        if b.fragment is not None:
            assert len(b.fragment.split()) >= 3, f"{b.id}: a fragment mark gives its reason: <!-- fragment: why -->"
    names = [b.id for b in ALL if b.name]
    assert len(names) == len(set(names)), names


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """{hub name: the path of a tiny saved model of its family}, built on first use."""
    saved = {}

    def path(name):
        if name not in saved:
            from fuseblock.integrations.transformers.tiny import tiny_config
            from transformers import AutoModelForCausalLM

            assert name in HUB_NAMES, f"{name!r}: add it to HUB_NAMES with the family that stands in for it"
            torch.manual_seed(0)
            saved[name] = tmp_path_factory.mktemp("hub") / name.replace("/", "--")
            AutoModelForCausalLM.from_config(tiny_config(HUB_NAMES[name])).save_pretrained(saved[name])
        return str(saved[name])

    return path


def run(block, hub):
    """Run one block alone; its namespace afterwards."""
    assert "cuda" not in block.code or CUDA_BY_AVAILABILITY in block.code, \
        f"{block.id}: pick the device by availability: device = {CUDA_BY_AVAILABILITY}"
    code = HUB_CALL.sub(lambda m: m.group(0).replace(m.group(1), hub(m.group(1))), block.code)
    ns = {"__name__": "__doc_block__"}
    exec(compile(code, f"{block.doc.name} (block at line {block.line})", "exec"), ns)
    return ns


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.id)
def test_block_runs_as_printed(block, hub):
    run(block, hub)
