"""Write fuseblock's hub layers out as a local kernel repository.

    python -m fuseblock.hub.repository OUT_DIR        (make hub-repo: out/hub)

gives OUT_DIR/build/torch-cpu and OUT_DIR/build/torch-cuda, the `kernels` package's
noarch build variants: each a metadata.json and an __init__.py whose `layers` is
`fuseblock.hub.layers` (the layers stay in the installed fuseblock, so the repository
is the entry point, not a copy). Use it with `kernels.LocalLayerRepository(
repo_path=Path(OUT_DIR), layer_name="RMSNorm")` in a kernelize mapping; pushed to the
Hub, the same tree is a kernel repository (its users then need fuseblock installed).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

NAME = "fuseblock-norms"
BACKENDS = ("cpu", "cuda")  # noarch variants: pure Python, Triton compiled at run time

_INIT = '''"""fuseblock's norms as kernel-hub layers: RMSNorm, RMSNormZeroCentered, RMSNormGated
(fuseblock.hub.layers)."""
from fuseblock.hub import layers

__all__ = ["layers"]
'''


def write(out: str | Path) -> list[Path]:
    """Write the repository under `out`; returns the variant directories written."""
    from .. import __version__

    written = []
    for backend in BACKENDS:
        variant = Path(out) / "build" / f"torch-{backend}"
        variant.mkdir(parents=True, exist_ok=True)
        metadata = {"name": NAME, "id": f"fuseblock_norms_{__version__.replace('.', '_')}", "version": 1,
                    "license": "MIT", "python-depends": [], "backend": {"type": backend}}
        (variant / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
        (variant / "__init__.py").write_text(_INIT)
        written.append(variant)
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write the repository into")
    args = parser.parse_args(argv)
    for variant in write(args.out):
        print(variant)


if __name__ == "__main__":
    main()
