"""The README's commands, layout and pointers, and docs/'s, say what the repository holds, so
the docs cannot rot (tests/tools/test_docs_run.py runs their Python blocks)."""
import ast
import pathlib
import re

import pytest
import timeouts

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


BARE = ("python", "python3.11", "pip", "pytest", "torchrun")  # not installed outside .venv


def _commands():
    """Each shell command of the README: the ```bash blocks' lines, and inline code spans
    that start with a program name, split at &&."""
    text = README.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    lines = [ln.split(" #")[0].strip() for b in blocks for ln in b.splitlines()]
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    lines += re.findall(r"`((?:[A-Z_]+=\S+ )*(?:\.venv/bin/|make |python|pip|pytest|torchrun)[^` ]* [^`]*)`", prose)
    return [c.strip() for ln in lines for c in ln.split("&&") if c.strip() and not c.startswith("#")]


def test_readme_commands_run_as_printed():
    commands = _commands()
    assert len(commands) >= 10
    targets = set(re.findall(r"^([a-z][\w-]*):", (README.parent / "Makefile").read_text(), re.MULTILINE))
    for cmd in commands:
        words = [w for w in cmd.split() if "=" not in w or w.startswith("-")]  # drop VAR=value prefixes
        assert words[0] not in BARE, f"{cmd!r}: use .venv/bin/{words[0]} or a make target"
        assert "..." not in cmd, f"{cmd!r}: a placeholder, not a command"
        if words[0] == "make":
            assert set(words[1:]) <= targets, f"{cmd!r}: no such make target"


def test_readme_wheel_name_has_the_current_version():
    import fuseblock

    names = re.findall(r"fuseblock-([\w.]+)-py3-none-any\.whl", (README.parent / "docs" / "install.md").read_text())
    assert names and set(names) == {fuseblock.__version__}


def _layout_entries() -> dict[str, str]:
    """The README's layout block as {path at the line's start: the text describing it}."""
    section = README.read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        if line[:1].strip():
            current = line.split()[0]
            entries[current] = line[len(current):]
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


def test_readme_layout_names_every_module_of_the_package():
    # A file is named by its own path, or by its name (relative to the folder) in the text of
    # its folder's entry. The subpackages' __init__.py files are left out where they hold only
    # a docstring (their folder is named); one that holds code is named like any module.
    entries = _layout_entries()
    package = README.parent / "fuseblock"
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(README.parent).as_posix()
        if path.name == "__init__.py" and path.parent != package:
            body = ast.parse(path.read_text()).body
            if len(body) == 1 and isinstance(body[0], ast.Expr):
                continue
        named = rel in entries or any(
            folder.endswith("/") and rel.startswith(folder)
            and re.search(r"(?<![\w/.])" + re.escape(rel[len(folder):]) + r"(?!\w)", text)
            for folder, text in entries.items())
        if not named:
            missing.append(rel)
    assert not missing, f"README.md's layout section names none of {missing}"


DOCS = [README, *sorted((README.parent / "docs").glob("*.md"))]


def test_readme_is_the_front_door():
    # install and the three quick wins first, the reference in docs/ with an index
    text = README.read_text()
    assert len(text.splitlines()) <= 400, f"README.md has {len(text.splitlines())} lines: move reference to docs/"
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections[:2] == ["Install", "Three quick wins"], sections
    wins = text.split("\n## Three quick wins\n", 1)[1].split("\n## ", 1)[0]
    for needed in ("fuse(AutoModelForCausalLM.from_pretrained(", "from fuseblock.compat.flash_attn import",
                   "fuseblock.PreNormBlock("):
        assert needed in wins, f"the quick wins lack {needed!r}"
    index = text.split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    missing = [d.name for d in DOCS[1:] if f"(docs/{d.name})" not in index]
    assert not missing, f"README's Documentation index lacks {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_point_only_into_the_repository(doc):
    # a reader has the repository: no path above it (the spec is docs/math.md), no issue numbers
    text = doc.read_text()
    for ref in re.findall(r"\.\./[\w./-]*", text):
        target = (doc.parent / ref).resolve()
        assert target.is_relative_to(README.parent) and target.exists(), f"{doc.name}: {ref} is outside the repository"
    found = re.findall(r"\bissues?[ -]#?\d[\d.]*", text, re.IGNORECASE)
    assert not found, f"{doc.name}: {found}: say what changed (or the version), not the issue"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_run_python_from_the_venv(doc):
    # a bare `python` has no torch (nothing is installed outside .venv); `python3 -m venv`
    # makes one, and PY=python is make's own option for an interpreter already set up
    bare = re.findall(r"(?<![\w/.=\\-])python3?(?= (?:scripts/|tools/|-m (?!venv)|-c ))", doc.read_text())
    assert not bare, f"{doc.name}: {len(bare)} commands with a bare python: use .venv/bin/python"


@pytest.mark.parametrize("script", ["train.py", "sample.py", "train_hf.py"])
def test_script_help_gives_every_options_default(script):
    # README: "--help gives each one's meaning and default"; a switch (no value) has none to
    # give, and a required option says so instead
    import sys

    p = timeouts.run([sys.executable, str(README.parent / "scripts" / script), "--help"], capture_output=True,
                     text=True, seconds=120, check=True)
    options = re.split(r"\n  (?=-)", p.stdout.split("options:", 1)[1])[1:]
    takes_value = [o for o in options if re.match(r"(?:-\w, )?--[\w-]+ [A-Z_{]", o)]
    assert takes_value, p.stdout
    missing = [o.split()[0] for o in takes_value if not re.search(r"\(default|\(required\)", " ".join(o.split()))]
    assert not missing, f"{script} --help gives no default for {missing}"
