"""Names, read from the source and the docs: no module uses another's private names, a
package's attribute named like one of its submodules is that submodule, and every dotted
`fuseblock.` name the docs give resolves."""
import ast
import importlib
import pkgutil
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("fuseblock", "models", "scripts")  # scripts/ imports its own benchmarks/ package


def _module_file(dotted: str) -> Path | None:
    """The file of a project module by its dotted name (scripts' modules from scripts/), or None."""
    for base in (ROOT, ROOT / "scripts"):
        path = base.joinpath(*dotted.split("."))
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _dotted(path: Path) -> str:
    base = ROOT / "scripts" if path.is_relative_to(ROOT / "scripts") else ROOT
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _crossings(path: Path) -> list[str]:
    """`from X import _name` and `X._name` of another project module X in `path`."""
    here = _dotted(path)
    package = here.split(".") if path.name == "__init__.py" else here.split(".")[:-1]
    modules: dict[str, str] = {}  # local name -> the project module it is bound to
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                source = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if _module_file(source) is None:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if _module_file(sub) is not None:
                    modules[alias.asname or alias.name] = sub
                elif _private(alias.name):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {source} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _module_file(alias.name) is not None:
                    if alias.asname:
                        modules[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        modules[top] = top
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in modules:
                owner = ".".join([modules[value.id], *chain])
                if _module_file(owner) is not None and owner != here:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {owner}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    sources = sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))
    assert len(sources) > 60  # the scan finds the tree
    found = [c for p in sources for c in _crossings(p)]
    assert found == [], "private names used across modules (make them public, or move them):\n" + "\n".join(found)


def test_the_scan_sees_both_forms(tmp_path, monkeypatch):
    probe = ROOT / "fuseblock" / "testing" / "_probe_for_test_names.py"
    probe.write_text("from ..ops.norm import _plain_call\nfrom ..kernels import launch\nlaunch._x\n"
                     "import fuseblock.ops.norm as N\nN._y\n")
    try:
        found = _crossings(probe)
    finally:
        probe.unlink()
    assert [f.split(": ", 1)[1] for f in found] == ["from fuseblock.ops.norm import _plain_call",
                                                     "fuseblock.kernels.launch._x", "fuseblock.ops.norm._y"]


def test_a_submodules_name_is_that_module():
    """Every submodule imported (the optional integrations where their package is installed),
    `package.name` must be the module `package.name`, never an object rebound over it:
    `import fuseblock.x as m` would silently give the object."""
    import fuseblock

    for info in pkgutil.walk_packages(fuseblock.__path__, "fuseblock."):
        try:
            importlib.import_module(info.name)
        except ImportError as e:
            if (e.name or "fuseblock").split(".")[0] == "fuseblock":
                raise
    loaded = {name: m for name, m in sys.modules.items() if name.startswith("fuseblock.") and m is not None}
    assert len(loaded) > 50  # the walk imported the package
    bad = [f"{parent}.{child} is {getattr(sys.modules[parent], child, None)!r}"
           for name, module in sorted(loaded.items())
           for parent, _, child in [name.rpartition(".")] if getattr(sys.modules[parent], child, None) is not module]
    assert bad == []


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOTTED = re.compile(r"(?<![\w./])fuseblock(?:\.[A-Za-z_]\w*)+")


def _resolves(dotted: str) -> bool:
    """The longest prefix that is a module of this checkout, imported, then attributes."""
    parts = dotted.split(".")
    i = max(i for i in range(1, len(parts) + 1) if _module_file(".".join(parts[:i])) is not None)
    try:
        obj = importlib.import_module(".".join(parts[:i]))
    except ModuleNotFoundError as e:  # an optional dependency (transformers, kernels)
        pytest.skip(f"{dotted} needs {e.name}")
    for attr in parts[i:]:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_docs_dotted_names_resolve(doc):
    names = sorted(set(DOTTED.findall(doc.read_text())))
    unresolved = [n for n in names if not _resolves(n.rstrip("."))]
    assert unresolved == [], f"{doc.name} names what fuseblock does not have: {unresolved}"
