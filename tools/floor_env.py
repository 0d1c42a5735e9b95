"""Install the oldest versions pyproject.toml declares into the running environment.

    .venv-floor/bin/python tools/floor_env.py --extra triton --extra train   # what `make test-floor` does
    .venv-floor/bin/python tools/floor_env.py --pin torch==2.6.0 --pin triton==3.2.0

Each runtime dependency (and each of the named extras) with a `>=` floor whose marker
holds here is installed at exactly that version; `--pin` overrides one (for bisecting).
torch is installed with `--no-deps`, then everything it requires except its own triton
pin, so that the floor's triton is the one tested. A torch from PyPI is a CUDA build
that will not import without its nvidia-* libraries, so those come too (about 2.7 GB,
a minute or two; pip's cache keeps them for the next run). The test tools (the `test`
extra) install at their newest. Run it with the environment's own python: it installs
into sys.executable's prefix.
"""
from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = re.compile(r"^(triton|pytorch-triton)$")  # torch's own triton pin: the floor's triton replaces it


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args]
    print("+ pip install", " ".join(args), flush=True)
    proc = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # pip warns that the torch installed with --no-deps lacks its own triton pin: expected here
    noise = re.compile(r"^(WARNING: Location .* is ignored|ERROR: pip's dependency resolver|torch .* requires triton)")
    print("".join(line for line in proc.stdout.splitlines(True) if not noise.match(line)), end="", flush=True)
    if proc.returncode:
        raise SystemExit(f"floor_env: pip install failed (exit {proc.returncode})")
    importlib.invalidate_caches()  # so this process sees what was just installed


def project() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def floors(requirements: list[str]) -> dict[str, str]:
    """{name: floor version} for each requirement with a `>=` bound whose marker holds here."""
    from packaging.requirements import Requirement

    out = {}
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        lows = [s.version for s in req.specifier if s.operator == ">="]
        if not lows:
            raise SystemExit(f"floor_env: {text!r} in pyproject.toml has no '>=' floor to test")
        out[req.name.lower()] = max(lows, key=lambda v: tuple(int(p) for p in re.findall(r"\d+", v)))
    return out


def torch_requirements() -> list[str]:
    """The installed torch's own requirements for this platform, less the CUDA-only ones."""
    from importlib import metadata

    from packaging.requirements import Requirement

    keep = []
    for text in metadata.requires("torch") or []:
        req = Requirement(text)
        if SKIP.match(req.name.lower()):
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        keep.append(str(req).split(";")[0].strip())
    return keep


def installed(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extra", action="append", default=[], metavar="NAME",
                    help="also install the floors of this optional-dependencies group (repeatable)")
    ap.add_argument("--pin", action="append", default=[], metavar="NAME==VERSION",
                    help="install this version instead of the declared floor (repeatable)")
    args = ap.parse_args()
    meta = project()
    pip("packaging", *meta["optional-dependencies"]["test"])
    pins = floors(meta["dependencies"] + [r for extra in args.extra for r in meta["optional-dependencies"][extra]])
    for pin in args.pin:
        name, sep, version = pin.partition("==")
        if not sep or not version:
            ap.error(f"--pin must look like NAME==VERSION, got {pin!r}")
        pins[name.lower()] = version
    torch_version = pins.pop("torch")
    if (installed("torch") or "").split("+")[0] != torch_version:
        pip("--no-deps", f"torch=={torch_version}")
    pip(*torch_requirements(), *(f"{name}=={version}" for name, version in pins.items()))
    shown = {name: installed(name) for name in ["torch", *pins]}
    print("floor environment:", ", ".join(f"{k} {v}" for k, v in shown.items()), flush=True)


if __name__ == "__main__":
    main()
