"""The README's Python examples run verbatim, in order, in one namespace, so the docs cannot rot."""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.kernel
def test_readme_python_blocks_run():
    blocks = _blocks()
    assert len(blocks) >= 2
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md block {i}", "exec"), namespace)
