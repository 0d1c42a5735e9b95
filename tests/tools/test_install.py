"""fuseblock as a user installs it: without triton (macOS, Windows), and as a wheel in a clean venv."""
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import timeouts
import torch

from fuseblock.triton_support import interpreter_numpy_problem, missing_triton_error

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: refuse `import triton` (and its submodules) before anything else.
BLOCK_TRITON = textwrap.dedent("""
    import sys

    class NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)

    sys.meta_path.insert(0, NoTriton())
    try:
        import triton.language  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("the block let triton through")
""")

API_WITHOUT_TRITON = BLOCK_TRITON + textwrap.dedent("""
    import torch
    import fuseblock
    from torch import nn
    from models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    x = torch.randn(3, 4, 32, requires_grad=True)
    r = torch.randn(3, 4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    outs = [fuseblock.norm(x, w, kind=k) for k in ("rms", "layer", "l2")]
    outs += list(fuseblock.add_norm(x, r, w, kind="layer"))
    outs.append(fuseblock.norm(x, w, gate=r, gate_position="pre", num_groups=4))
    outs.append(fuseblock.Norm(32, kind="layer", bias=True)(x, gate=r))
    outs += list(fuseblock.AddNorm(32)(x, r))
    outs.append(fuseblock.ResidualStack([nn.Linear(32, 32), nn.Linear(32, 32)], 32)(x))
    outs.append(fuseblock.PreNormBlock(nn.Linear(32, 32), 32)(x, r)[0])
    outs += [fuseblock.embed_norm(x, o) for o in ("l1", "l2", "max")]
    c = x.transpose(1, 2)  # (N, C=32, L=4)
    outs += [fuseblock.batch_norm(c, None, None, training=True), fuseblock.group_norm(c, 4),
             fuseblock.instance_norm(c), fuseblock.BatchNorm(32)(c), fuseblock.InstanceNorm(32)(c)]
    sum(o.double().square().sum() for o in outs).backward()
    assert all(t.grad is not None and t.grad.isfinite().all() for t in (x, r, w))

    model = GPT(GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16))
    idx = torch.randint(0, 256, (2, 8))
    _, loss = model(idx, idx)
    loss.backward()
    assert loss.isfinite() and all(p.grad is not None for p in model.parameters())
    assert model.generate(idx[:, :2], 3).shape == (2, 5)

    assert sys.modules.get("triton") is None, "triton was imported"
    assert not any(m.startswith("fuseblock.kernels.norm") or m.startswith("fuseblock.kernels.embed")
                   for m in sys.modules)
    print("ok:", len(outs), "outputs")
""")


def _python(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
    return timeouts.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT,
                        env={**environ, **env}, seconds=300)


def test_public_api_and_gpt_run_without_triton():
    proc = _python(API_WITHOUT_TRITON)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok: 19 outputs" in proc.stdout


def test_kernel_call_without_triton_says_what_to_install():
    # TRITON_INTERPRET=1 sends CPU tensors to the kernels: the same dispatch a CUDA tensor takes
    proc = _python(BLOCK_TRITON + "import torch, fuseblock\nfuseblock.norm(torch.ones(2, 8))", TRITON_INTERPRET="1")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: TRITON_INTERPRET=1 runs fuseblock's Triton kernels"), last
    assert "pip install triton" in last and "unset TRITON_INTERPRET" in last
    assert "Traceback" in proc.stderr and proc.stderr.count("During handling") == 0  # `from None`: one error


def test_cuda_without_triton_error_names_the_package():
    err = missing_triton_error(torch.device("cuda", 0))
    assert isinstance(err, ModuleNotFoundError) and err.name == "triton"
    assert "CUDA tensors" in str(err) and "pip install triton" in str(err) and "\n" not in str(err)


@pytest.mark.parametrize("triton,numpy,need", [
    ("3.1.0", "1.26.4", None), ("3.1.0", "2.0.2", "numpy<2"), ("3.2.0", "2.3.5", None),
    ("3.6.0", "2.4.0", "numpy<2.4"), ("3.6.0", "2.4.6", "numpy<2.4"), ("3.7.1", "2.4.6", None),
    ("3.9.0+git1234", "2.5.0", None),
])
def test_interpreter_numpy_requirement(triton, numpy, need):
    assert interpreter_numpy_problem(triton, numpy) == need


# ------------------------------------------------------------------------------ the wheel
USE_WHEEL = textwrap.dedent("""
    import importlib.metadata as md, importlib.util, pathlib, sys
    import torch, fuseblock

    here = pathlib.Path(fuseblock.__file__).resolve()
    assert "site-packages" in here.parts, here
    assert importlib.util.find_spec("models") is None, "a top-level models package is installed"
    files = md.files("fuseblock")
    tops = {f.parts[0] for f in files}
    assert tops == {"fuseblock", f"fuseblock-{fuseblock.__version__}.dist-info"}, tops
    assert any(f.name == "LICENSE" for f in files) and any(f.name == "py.typed" for f in files)
    assert md.version("fuseblock") == fuseblock.__version__
    requires = md.requires("fuseblock")
    assert not any(r.startswith("einops") for r in requires), requires
    # the CPU torch requires no triton, and fuseblock only in its `triton` extra: none installed
    assert importlib.util.find_spec("triton") is None, "triton was installed"
    x, r = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64)
    out, res = fuseblock.add_norm(x, r, torch.ones(64), kind="layer")
    out.square().sum().backward()
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x + r, (64,), eps=1e-6), rtol=1e-5, atol=1e-5)
    assert x.grad is not None and x.grad.isfinite().all()
    print("wheel ok", fuseblock.__version__, md.metadata("fuseblock")["License-Expression"])
""")


def _link_torch(venv: Path) -> None:
    """Put this interpreter's torch and what it requires (its own requirements, not its
    extras'; numpy, which fuseblock requires) on `venv`'s path, as links in one folder that
    a .pth file names, as `pip install torch` would have installed them: unpacking the torch
    wheel again was most of the wheel test's time. What is not here (triton above all: the
    CPU torch requires none) the venv does not see, and pip installs a requirement it lacks
    from the index, as before."""
    import importlib.metadata as md
    import re
    import sysconfig

    links = venv / "torch-links"
    links.mkdir()
    todo, seen = ["torch", "numpy"], set()
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        root = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or ()} - {"..", "__pycache__"}:
            if not top.endswith(".pth") and not (links / top).exists():
                (links / top).symlink_to(root / top)
        todo += [re.match(r"[\w.-]+", r).group() for r in dist.requires or () if "extra ==" not in r]
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    (site / "torch-links.pth").write_text(f"{links}\n")


@pytest.mark.slow
def test_wheel_holds_only_fuseblock_and_runs_from_another_directory(tmp_path):
    """Build the wheel from a copy of the tree, install it into a clean venv that sees the CPU
    torch (`_link_torch`), and use it from a directory with no checkout in sight."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "out", "*.egg-info", "__pycache__", "cache", ".pytest_cache", ".hypothesis"))

    def run(*cmd):
        return timeouts.run(cmd, check=True, capture_output=True, text=True, seconds=900)

    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", str(src), "-w", str(tmp_path / "dist"))
    (wheel,) = (tmp_path / "dist").glob("fuseblock-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"fuseblock", wheel.name.split("-py3")[0] + ".dist-info"}, names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "fuseblock/py.typed" in names and not any(n.startswith(("models/", "data/", "scripts/")) for n in names)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: MIT" in metadata
    triton = [ln for ln in metadata.splitlines() if ln.startswith("Requires-Dist: triton")]
    assert triton == ['Requires-Dist: triton>=3.1; platform_system == "Linux" and extra == "triton"'], triton

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv))  # this pip installs into it (--python)
    py = str(venv / "bin" / "python")
    _link_torch(venv)
    run(sys.executable, "-m", "pip", "--python", py, "install", "--quiet", str(wheel))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    proc = timeouts.run([py, "-c", USE_WHEEL], check=False, cwd=elsewhere, env=env, capture_output=True, text=True,
                        seconds=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("wheel ok") and proc.stdout.split()[-1] == "MIT"


# ------------------------------------------------------------------------------ what installs triton
def _project() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _make_recipe(target_line: str) -> str:
    text = (ROOT / "Makefile").read_text()
    return text[text.index(target_line):].split("\n\n", 1)[0]


def test_triton_comes_from_torch_or_the_triton_extra_and_make_installs_that_extra():
    # fuseblock requires no triton (PyPI's CUDA torch brings its own); what runs the kernels
    # without a GPU, make test's interpreter run, installs it through the extra
    import re

    project = _project()
    assert not any(r.startswith("triton") for r in project["dependencies"]), project["dependencies"]
    extras = project["optional-dependencies"]
    assert extras["triton"] == ["triton>=3.1; platform_system == 'Linux'"]
    (installed,) = re.findall(r'pip install --quiet -e "\.\[([\w,]+)\]"', _make_recipe("$(STAMP): pyproject.toml"))
    assert {"triton", "test"} <= set(installed.split(",")), installed
    (dev_self,) = [r for r in extras["dev"] if r.startswith("fuseblock[")]
    assert set(dev_self[len("fuseblock["):-1].split(",")) == set(installed.split(",")), "dev: what make test installs"
    assert any(r.startswith("pre-commit") for r in extras["dev"])


def test_the_floor_environment_installs_the_triton_floor(monkeypatch):
    # make test-floor's floor_env.py call names the extras whose floors it installs: triton's among them
    import re

    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import floor_env

    recipe = _make_recipe("$(FLOOR_STAMP):")
    extras = re.findall(r"--extra (\w+)", recipe)
    project = _project()
    pins = floor_env.floors(project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]])
    assert pins["torch"] == "2.5" and pins["numpy"] == "1.24"
    assert pins.get("triton") == ("3.1" if sys.platform == "linux" else None)
