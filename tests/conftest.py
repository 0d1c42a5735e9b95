"""Shared test setup.

`make test` runs the suite twice: every test on the pure-PyTorch path, then the
tests marked `kernel` again with TRITON_INTERPRET=1, where CPU tensors run the
Triton kernels through the interpreter. KERNEL_PATH says which run this is.

On a GPU machine, FUSEBLOCK_TEST_DEVICE=cuda makes every test tensor a CUDA tensor,
so `pytest -m kernel` runs the compiled kernels for real.
"""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests import ref64 and friends
sys.path.insert(1, ROOT)  # and the GPT from the checkout's models/, which the wheel does not install

DEVICE = os.environ.get("FUSEBLOCK_TEST_DEVICE", "cpu")
if DEVICE != "cpu":
    torch.set_default_device(DEVICE)
KERNEL_PATH = os.environ.get("TRITON_INTERPRET") == "1" or DEVICE == "cuda"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def small_wide_rows(monkeypatch):
    """Shrink the tile limits and chunk sizes so rows of a few dozen columns take the
    wide-row kernels (`_fwd_loop`, `_bwd_dots` + `_bwd_cols`), with ragged chunks and
    several programs: fast enough for the interpreter."""
    import fuseblock.kernels.norm as K

    for name, value in dict(MAX_TILE_FWD=16, MAX_TILE_BWD=16, LOOP_BLOCK=8, COLS_BLOCK=8, COLS_TILE=32,
                            MIN_ROWS_PER_PROGRAM=4, H100_SMS=2).items():
        monkeypatch.setattr(K, name, value)
