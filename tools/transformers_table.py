"""docs/transformers.md's family table, made from the code: every causal-LM family of the
installed transformers, fused (with its stream shape; a config-only family with the fused
family whose classes it builds) or refused (with the reason fuse gives).

    python tools/transformers_table.py           # print the table
    python tools/transformers_table.py --write   # rewrite it in docs/transformers.md
    python tools/transformers_table.py --check   # exit 1 when the docs' table is stale

The table is written for one transformers version, named in its first line; the check
compares against the installed version's table only when they are the same version (the
families differ between versions), and otherwise says so and passes.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "transformers.md"
README = DOC.parents[1] / "README.md"
# the README's count of fused families, which --check holds to FAMILIES as well, and its
# count of the table's rows
COUNT = re.compile(r"`fuse` takes (\d+) families")
LISTED = re.compile(r"docs/transformers.md lists all (\d+)")
ROW = re.compile(r"^\| `[\w-]+` \| (?:fused|refused) \|", re.MULTILINE)
BEGIN, END = "<!-- family table: begin -->", "<!-- family table: end -->"
_VERSION = re.compile(r"transformers (\S+), ")


def families() -> list[tuple[str, str, str]]:
    """(model_type, "fused" or "refused", the stream shape or the reason), for every causal
    LM of the installed transformers and every family fuse names, sorted by model_type."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    from fuseblock.integrations.transformers import FAMILIES, WRAPPERS
    from fuseblock.integrations.transformers.families import family_of_class
    from fuseblock.integrations.transformers.fusion import refusal

    rows = []
    for model_type in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(FAMILIES) | set(WRAPPERS)):
        owner = family_of_class(MODEL_MAPPING_NAMES.get(model_type))
        if model_type in FAMILIES:
            rows.append((model_type, "fused", shapes(FAMILIES[model_type])))
        elif owner is not None:  # a config-only family on a fused family's classes
            rows.append((model_type, "fused", f"{shapes(FAMILIES[owner])}: `{owner}`'s classes "
                                              f"({MODEL_MAPPING_NAMES[model_type]})"))
        elif model_type in WRAPPERS:
            rows.append((model_type, "fused", f"a multimodal wrapper: its `{WRAPPERS[model_type]}` is fused, the "
                                              f"vision tower and projector left as they are"))
        else:
            rows.append((model_type, "refused", refusal(model_type)))
    # a family fuse names that this transformers lacks (5.24's, listed from 5.23) is fused only where it exists
    absent = f" (not in transformers {transformers.__version__}: fused on the versions that have it)"
    return [(m, verdict, why + absent if m not in CONFIG_MAPPING_NAMES else why) for m, verdict, why in rows]


def shapes(family) -> str:
    """A family's stream shape; where a config flag picks the layout, each with its flag."""
    variants = getattr(family.variant, "variants", None)
    if variants is None:
        return family.shape.name
    return ", ".join(f"{v.shape.name} ({k} = {v.requires[k]})" for v in variants.values() for k in v.requires)


def table() -> str:
    import transformers

    rows = families()
    fused = sum(1 for _, verdict, _ in rows if verdict == "fused")
    lines = [BEGIN,
             "Made by `.venv/bin/python tools/transformers_table.py --write` for transformers "
             f"{transformers.__version__}, from `FAMILIES`, `WRAPPERS` and `REFUSED`: {fused} fused of "
             f"{len(rows)} families (the causal LMs and the multimodal wrappers fuse takes).",
             "",
             "| `model_type` | fuse | stream shape, or why not |",
             "|---|---|---|"]
    lines += [f"| `{m}` | {verdict} | {why} |" for m, verdict, why in rows]
    return "\n".join([*lines, END])


def written(doc: Path) -> str:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no family table (markers {BEGIN} ... {END})")
    return text[text.index(BEGIN):text.index(END) + len(END)]


def stale(doc: Path, readme: Path) -> list[str]:
    """What is out of date in doc's table and readme's count; [] when both are current."""
    import transformers

    from fuseblock.integrations.transformers import FAMILIES

    found = []
    counts = COUNT.findall(readme.read_text())
    if counts != [str(len(FAMILIES))]:
        found.append(f"{readme.name} says `fuse` takes {', '.join(counts) or 'no'} families; FAMILIES has "
                     f"{len(FAMILIES)}")
    old = written(doc)
    rows = str(len(ROW.findall(old)))
    listed = LISTED.findall(readme.read_text())
    if listed != [rows]:
        found.append(f"{readme.name} says docs/transformers.md lists all {', '.join(listed) or 'no'} families; "
                     f"its table has {rows} rows")
    version = _VERSION.search(old)
    if version is None or version.group(1) != transformers.__version__:
        print(f"{doc.name}'s table is for transformers {version and version.group(1)}; installed is "
              f"{transformers.__version__}: the table is not compared")
    elif old != table():
        found.append(f"{doc.name}'s family table is stale: run .venv/bin/python tools/transformers_table.py --write")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the table in docs/transformers.md")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 when docs/transformers.md's table or README's count is stale")
    p.add_argument("--doc", type=Path, default=DOC, help="the document holding the table (default %(default)s)")
    p.add_argument("--readme", type=Path, default=README, help="the README naming the count (default %(default)s)")
    args = p.parse_args(argv)
    if args.write:
        args.doc.write_text(args.doc.read_text().replace(written(args.doc), table()))
    elif args.check:
        found = stale(args.doc, args.readme)
        for line in found:
            print(line)
        return 1 if found else 0
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
