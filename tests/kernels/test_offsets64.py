"""Offsets that can pass 2**31 are 64-bit in the compiled kernels (issue 44, item 6).

The interpreter computes offsets in numpy's int64 whatever the kernel asks, so a 32-bit
product that wraps on a GPU is invisible there: this reads the compiled IR instead. Each
kernel is compiled for sm_90 (no GPU needed) and every pointer a load or store takes is
traced back to its kernel argument: each offset added on the way (`tt.addptr`) must be
i64 for the arguments listed.

- mxfp8's columnwise copy (OT, QST): column * rows wraps from 2**31 / d rows (8.4M at
  d = 256);
- the channel norms' reads of X and DY: a channels_last sample has column stride C, so
  column * C wraps once a sample holds 2**31 elements.
"""
import os
import re

import pytest
import torch

import fuseblock
from fuseblock.testing import targets as T

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs triton's compiler"),
              pytest.mark.skipif(T.backend_problem("sm_90") is not None,
                                 reason=f"cannot compile for sm_90 here: {T.backend_problem('sm_90')}")]

DEF = re.compile(r"^\s*(%[\w.]+) = (\S+) ([^:]*?)(?: :(.*?))?(?: loc\(.*)?$")
ACCESS = re.compile(r"^\s*(?:%[\w.]+ = )?tt\.(load|store) (%[\w.]+)")
PASS_THROUGH = {"tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape"}


def offset_widths(ttir: str) -> dict[str, set[str]]:
    """{kernel argument: the element types of every offset added to it on the way to a
    load or store} of a kernel's TTIR. A name may be defined again in a sibling region
    (two loops): a use reads the latest definition above it."""
    lines = ttir.splitlines()
    defs: dict[str, list] = {}
    for i, line in enumerate(lines):
        m = DEF.match(line)
        if m:
            defs.setdefault(m.group(1), []).append((i, m.group(2), m.group(3).split(",")[0].strip(), m.group(4) or ""))
    widths: dict[str, set[str]] = {}
    for i, line in enumerate(lines):
        m = ACCESS.match(line)
        if not m:
            continue
        name, at, seen = m.group(2), i, set()
        while True:
            found = [d for d in defs.get(name, []) if d[0] < at]
            if not found:  # a kernel argument
                widths.setdefault(name.lstrip("%"), set()).update(seen)
                break
            at, op, name, types = found[-1]
            if op == "tt.addptr":
                seen.add(re.findall(r"x?(i\d+)>?\s*$", types.split(",")[-1])[0])
            elif op not in PASS_THROUGH:
                break
    return widths


def compiled_widths(launches, kernel: str) -> dict[str, set[str]]:
    (launch,) = [launch for launch in launches if launch.name == kernel]
    return offset_widths(T.compile_for(launch, "sm_90").asm["ttir"])


def test_the_ir_reader_sees_32_bit_offsets():
    # the column offsets of a plain norm's weight are i32 (< d), its rows' i64
    x = torch.empty(64, 256)
    w = offset_widths(T.compile_for(T.norm_launches(x, weight=torch.empty(256))[0], "sm_90").asm["ttir"])
    assert w["W"] == {"i32"} and "i64" in w["X"]


def test_mxfp8_columnwise_store_offsets_are_64_bit():
    x = torch.empty(64, 256)
    w = compiled_widths(T.quant_launches(x, torch.empty(64, 256), torch.empty(256), quant=fuseblock.Fp8Recipe(
        "mxfp8", mx_columnwise=True)), "_fwd_tile")
    assert w["OT"] == {"i64"} and w["QST"] == {"i64"}, w


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "group"])
def test_channel_norm_reads_of_a_channels_last_sample_are_64_bit(batch):
    x = torch.empty(2, 8, 4, 4).to(memory_format=torch.channels_last)
    launches = T.channel_norm_launches(x, torch.empty(8), torch.empty(8), batch=batch, groups=0 if batch else 2)
    fwd, bwd = compiled_widths(launches, "_channel_fwd"), compiled_widths(launches, "_channel_bwd")
    assert fwd["X"] == {"i64"}, fwd
    assert bwd["X"] == {"i64"} and bwd["DY"] == {"i64"}, bwd
