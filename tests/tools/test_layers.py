"""The package's layers, read from its source: imports point one way
(spec -> kernels and reference -> ops -> modules -> stream -> integrations and compat, the
tools above them all) with no cycle, and only `fuseblock/ops/` names the registered custom ops
by string (everything else takes them from the ops' `FusedOp.fwd_op` / `bwd_op`)."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fuseblock"
# rank of each module, by its dotted name under fuseblock (the longest prefix listed wins)
RANKS = {"spec": 0, "hyper_spec": 0, "attn_res_spec": 0, "triton_support": 0, "kernels": 1, "reference": 1,
         "ops": 2, "modules": 3, "convert": 3, "serve": 3, "stream": 4, "hyper_stream": 4, "attn_res_stream": 4,
         "blocks": 4, "parallel": 5, "integrations": 5, "compat": 5, "hub": 5, "testing": 6, "": 7}


def _name(path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _rank(name: str) -> int:
    return next(RANKS[p] for p in sorted(RANKS, key=len, reverse=True) if name == p or name.startswith(p + ".")
                or p == "")


def _imports(path) -> set[str]:
    """The fuseblock modules `path` imports (at any depth: the lazy imports inside functions too)."""
    name, found = _name(path), set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "fuseblock":
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:  # `from . import reference`: a module; `from .spec import X`: spec
                sub = ".".join([*base, alias.name])
                found.add(sub if (PACKAGE / sub.replace(".", "/")).with_suffix(".py").exists() else ".".join(base))
        elif isinstance(node, ast.Import):
            found |= {".".join(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == "fuseblock"}
    return found


def _graph() -> dict[str, set[str]]:
    return {_name(path): _imports(path) for path in PACKAGE.rglob("*.py")}


def test_imports_point_one_way():
    graph = _graph()
    assert {"ops.norm_linear", "modules.norm_linear", "reference.norm", "spec"} <= set(graph)
    # the parser sees them
    assert "reference.norm" in graph["ops.norm_linear"] and "ops.norm_linear" in graph["modules.norm_linear"]
    upward = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                    if a != "" and b != "" and _rank(b) > _rank(a))  # "" (the package): what `import fuseblock` runs
    assert upward == []


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            assert state.get(dep) != 1, " -> ".join([*path, node, dep])
            if dep not in state:
                visit(dep, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


# the ops' namespace read off torch.ops, as an attribute or through getattr; the needle
# is assembled here so that this file does not match it
NAMES_THE_OPS = re.compile(r"torch\.ops\s*\.\s*" + "fuseblock" + r"|getattr\(\s*torch\.ops\s*,\s*['\"]fuseblock")


def test_only_the_ops_name_the_registered_ops_by_string():
    sources = [p for d in ("fuseblock", "models", "scripts", "tests", "tools") for p in (ROOT / d).rglob("*.py")]
    naming = {str(p.relative_to(ROOT)) for p in sources if NAMES_THE_OPS.search(p.read_text())}
    assert "fuseblock/ops/registry.py" in naming  # the search finds what it looks for
    assert sorted(n for n in naming if not n.startswith("fuseblock/ops/")) == []


def test_the_tests_are_grouped_by_area_and_import_no_test_module():
    """Test modules live in a folder of their area and import shared code from the helper
    modules at tests/ (helpers, ref64, trainutil, family_helpers, hf_models, timeouts), never from conftest or
    from one another."""
    tests = ROOT / "tests"
    loose = sorted(p.name for p in tests.glob("test_*.py"))
    assert loose == [], f"test modules outside an area folder: {loose}"
    modules = {p.stem for p in tests.rglob("*.py")}
    test_modules = {m for m in modules if m.startswith("test_")} | {"conftest"}
    assert len(test_modules) > 30  # the search finds the suite
    importing = {}
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            found = [n for n in names if n.split(".")[0] in test_modules]
            if found:
                importing[str(path.relative_to(ROOT))] = found
    assert importing == {}
