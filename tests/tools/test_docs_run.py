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
folder (HUB_NAMES maps each name the docs use to its family). A block written for torchrun
(it calls `init_process_group`) runs as the one rank of a one-process world, with the
environment `torchrun --nproc_per_node=1` would give it. Bash blocks are not run.
"""
import contextlib
import os
import pathlib
import re
import socket
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
            from transformers import AutoModelForCausalLM

            from fuseblock.integrations.transformers.tiny import tiny_config

            assert name in HUB_NAMES, f"{name!r}: add it to HUB_NAMES with the family that stands in for it"
            torch.manual_seed(0)
            saved[name] = tmp_path_factory.mktemp("hub") / name.replace("/", "--")
            AutoModelForCausalLM.from_config(tiny_config(HUB_NAMES[name])).save_pretrained(saved[name])
        return str(saved[name])

    return path


def run(block, hub):
    """Run one block alone; its namespace afterwards."""
    if "cuda" in block.code and CUDA_BY_AVAILABILITY not in block.code:
        pytest.fail(f"{block.id}: pick the device by availability: device = {CUDA_BY_AVAILABILITY}", pytrace=False)
    code = HUB_CALL.sub(lambda m: m.group(0).replace(m.group(1), hub(m.group(1))), block.code)
    ns = {"__name__": "__doc_block__"}
    with one_rank_world(block):
        exec(compile(code, f"{block.doc.name} (block at line {block.line})", "exec"), ns)
    return ns


@contextlib.contextmanager
def one_rank_world(block):
    """For a block written for torchrun (it calls init_process_group): the environment
    `torchrun --nproc_per_node=1` gives, and the group destroyed after."""
    if "init_process_group" not in block.code:
        yield
        return
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def named(name):
    found = [b for b in RUN if b.name == name]
    assert len(found) == 1, f"{len(found)} blocks marked <!-- name: {name} -->"
    return found[0]


CHECKED = ("own-transformer", "hf-quickstart")  # run by their own tests below, on both paths


@pytest.mark.parametrize("block", [b for b in RUN if b.name not in CHECKED], ids=lambda b: b.id)
def test_block_runs_as_printed(block, hub):
    run(block, hub)


@pytest.mark.kernel
def test_the_worked_transformer_runs_and_is_what_it_says(hub):
    # docs/stream.md: your own attention and MLP as a ResidualStack and as the written-out
    # loop; the block asserts fused == loop == naive itself. Here: it ran a real model in
    # both forms, gradients included, and left the stack fused
    ns = run(named("own-transformer"), hub)
    logits, naive = ns["logits"], ns["logits_naive"]
    assert logits.shape == (*ns["idx"].shape, ns["vocab"]) and torch.isfinite(logits).all() and logits.std() > 0
    torch.testing.assert_close(naive, logits, rtol=1e-4, atol=1e-4)
    assert ns["model"].stack.fused and ns["loop"].blocks[0].mixer is not ns["model"].stack.blocks[0].mixer
    assert len(ns["grads"]) == len(list(ns["model"].parameters()))
    assert all(g.abs().sum() > 0 for g in ns["grads"])


@pytest.mark.kernel
def test_the_hugging_face_example_runs_the_fused_model(hub):
    pytest.importorskip("transformers")
    ns = run(named("hf-quickstart"), hub)
    # it ran the fused model (not only the unfused one) and generated past the prompt
    assert type(ns["fused"].model.layers[0]) is not type(ns["llama"].model.layers[0])
    assert ns["tokens"].shape == (1, 12) and ns["out"].loss.requires_grad
    assert all(p.grad is not None for p in ns["fused"].parameters())


@pytest.mark.slow
def test_train_hf_output_in_the_docs_is_what_the_script_prints():
    # docs/transformers.md prints the default run's output; the loss rows do not depend on
    # --iters (a constant learning rate), so a 5-step run gives the first row as it
    # are, and every other line with its numbers masked
    import sys

    from timeouts import run as run_limited

    doc = (ROOT / "docs" / "transformers.md").read_text()
    printed = doc.split("<!-- train_hf output -->\n```\n", 1)[1].split("```", 1)[0].splitlines()
    p = run_limited([sys.executable, str(ROOT / "scripts" / "train_hf.py"), "--iters", "5"], seconds=180,
                    capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""}, check=False)
    assert p.returncode == 0, p.stderr
    got = p.stdout.splitlines()
    assert got[:3] == printed[:3]  # the model line, the header, step 5
    def shape(lines):
        return [re.sub(r"\d+(\.\d+)?(e[-+]\d+)?", "N", ln) for ln in lines if not re.match(r"\s+\d+\s", ln)]
    assert shape(got) == shape(printed)
