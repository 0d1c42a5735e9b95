"""docs/transformers.md's family table and README's count, against the code
(tools/transformers_table.py): current, complete, and what fuse itself says."""
import shutil
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
import timeouts  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from fuseblock.integrations.transformers import FAMILIES, REFUSED, WRAPPERS, fuse  # noqa: E402
from tools.transformers_table import ROW  # noqa: E402
from tools.transformers_table import main as table_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "transformers_table.py"


def check(*args):
    return timeouts.run([sys.executable, str(TOOL), "--check", *map(str, args)], cwd=ROOT, capture_output=True,
                        text=True, seconds=120)


def test_the_table_and_the_count_are_current():
    p = check()
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_stale_table_or_count_fails_the_check(tmp_path, capsys):
    # in this process (the command line itself is the test above): main's exit code and what it prints
    doc, readme = tmp_path / "transformers.md", tmp_path / "README.md"
    shutil.copy(ROOT / "docs" / "transformers.md", doc)
    shutil.copy(ROOT / "README.md", readme)

    def in_process():
        code = table_main(["--check", "--doc", str(doc), "--readme", str(readme)])
        return code, capsys.readouterr().out

    assert in_process()[0] == 0
    text = doc.read_text()
    if f"transformers {transformers.__version__}, " in text:  # the table is compared on its own version only
        doc.write_text(text.replace("| `llama` | fused | pre-norm |\n", ""))
        code, out = in_process()
        assert code == 1 and "family table is stale" in out
        doc.write_text(text)
    text = readme.read_text()
    readme.write_text(text.replace(f"`fuse` takes {len(FAMILIES)} families", "`fuse` takes 3 families"))
    code, out = in_process()
    assert code == 1 and f"FAMILIES has {len(FAMILIES)}" in out
    rows = len(ROW.findall(doc.read_text()))
    readme.write_text(text.replace(f"lists all {rows}", "lists all 189"))
    code, out = in_process()
    assert code == 1 and f"its table has {rows} rows" in out


def test_every_causal_lm_is_fused_or_refused_with_a_reason():
    listed = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert not (set(FAMILIES) | set(WRAPPERS)) & set(REFUSED)
    assert all(REFUSED[m] for m in REFUSED)
    # every family transformers 5.23 ships is named one way or the other: a new one shows up here
    if transformers.__version__ == "5.23.0":
        from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

        from fuseblock.integrations.transformers.families import family_of_class

        by_class = {m for m in listed if family_of_class(MODEL_MAPPING_NAMES.get(m))}  # internlm3 on LlamaModel
        assert not by_class & set(REFUSED)
        named = set(FAMILIES) | set(WRAPPERS) | set(REFUSED) | by_class
        assert listed <= named, sorted(listed - named)


def test_fuse_refuses_a_listed_family_with_the_tables_reason():
    model = transformers.MambaForCausalLM(transformers.MambaConfig(hidden_size=32, num_hidden_layers=1,
                                                                   vocab_size=64))
    with pytest.raises(ValueError) as e:
        fuse(model)
    assert REFUSED["mamba"] in str(e.value) and "\n" not in str(e.value)
