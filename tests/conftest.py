"""Fixtures and hooks; what test modules import lives in helpers.py.

`make test` runs the suite twice: every test on the pure-PyTorch path, then the
tests marked `kernel` again with TRITON_INTERPRET=1, where CPU tensors run the
Triton kernels through the interpreter (helpers.KERNEL_PATH says which run this is).
A test that means something on one path only is marked `kernel_only(reason)` (it must
be marked `kernel` too, or it would run nowhere) or `torch_only(reason)`; it is
skipped on the other path.

On a GPU machine, FUSEBLOCK_TEST_DEVICE=cuda makes every test tensor a CUDA tensor,
so `pytest -m kernel` runs the compiled kernels for real.
"""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tests/, the root and scripts/ are on the path (pyproject's pythonpath): the tests import helpers,
# ref64 and friends, the GPT from the checkout's models/ (not in the wheel), and scripts' benchmarks/
from helpers import DEVICE, KERNEL_PATH, Launches  # noqa: E402

NO_GPU = DEVICE == "cuda" and not torch.cuda.is_available()  # make gpu-check on a machine with no GPU
if DEVICE != "cpu" and not NO_GPU:
    torch.set_default_device(DEVICE)

# The interpreter truncates fp32 -> bf16 (and misrounds fp8) where a GPU rounds to nearest
# even: make it round as a GPU does, so that kernel-path checks hold the kernels to a GPU's
# accuracy. The kernels are untouched (fuseblock/testing/interpreter_rounding.py says how).
from fuseblock.testing.interpreter_rounding import install  # noqa: E402

INTERPRETER_ROUNDING = install()  # None, or why the interpreter could not be made to round

# The interpreter re-patches its language at every helper call of a kernel: once per launch is
# enough (fuseblock/testing/interpreter_lang.py); about half the kernel path's CPU time.
from fuseblock.testing import interpreter_lang  # noqa: E402

interpreter_lang.install()


def pytest_addoption(parser):
    parser.addoption("--busy", type=int, default=0, metavar="N",
                     help="start N CPU-bound processes for the whole run, to check that the time limits "
                          "(tests/timeouts.py) hold on a busy machine")


def pytest_sessionstart(session):
    if NO_GPU:  # one line and status 3 (as the gpu-check report's), not an error per test
        pytest.exit("FUSEBLOCK_TEST_DEVICE=cuda and no CUDA device is present: no kernel test can run", returncode=3)
    n = session.config.getoption("busy")
    if n < 0:
        raise pytest.UsageError(f"--busy {n}: expected a count of processes, 0 or more")
    session.config.busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def pytest_sessionfinish(session):
    for proc in getattr(session.config, "busy", []):
        proc.kill()
        proc.wait()


def pytest_configure(config):
    config.addinivalue_line("markers", "kernel_only(reason): a property of the Triton kernels; skipped on the torch "
                                       "path (mark the test `kernel` too)")
    config.addinivalue_line("markers", "torch_only(reason): a property of the torch path; skipped on the kernel path")


def pytest_report_header(config):
    if INTERPRETER_ROUNDING is not None:
        return f"interpreter rounding not patched: {INTERPRETER_ROUNDING}"


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name, skipped in (("kernel_only", not KERNEL_PATH), ("torch_only", KERNEL_PATH)):
            mark = item.get_closest_marker(name)
            if mark is None:
                continue
            if name == "kernel_only" and item.get_closest_marker("kernel") is None:
                raise pytest.UsageError(f"{item.nodeid}: marked kernel_only but not kernel: neither run would run it")
            if skipped:
                item.add_marker(pytest.mark.skip(reason=mark.args[0] if mark.args else f"{name} test"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def launches():
    """A helpers.Launches started at the test's setup: `launches["fwd"]`, `launches("fwd", "bwd")`,
    `launches.reset()`. Importing the kernels needs triton: use it in kernel_only tests or where
    the torch path has triton too."""
    return Launches()


@pytest.fixture
def small_wide_rows(monkeypatch):
    """Shrink the tile limits and chunk sizes so rows of a few dozen columns take the
    wide-row kernels (`fwd_loop`, `bwd_dots` + `bwd_cols`), with ragged chunks and
    several programs: fast enough for the interpreter. Up to 16 `bwd_cols` programs, so
    a column chunk of a few row blocks has several, whose partial rows it sums."""
    import fuseblock.kernels.launch as L
    import fuseblock.kernels.norm as K

    for name, value in dict(MAX_TILE_FWD=16, MAX_TILE_FWD_HEAVY=16, MAX_TILE_BWD=16, MAX_TILE_PAIR_FWD=16,
                            MAX_TILE_PAIR_BWD=16, LOOP_BLOCK=8, H100_SMS=2).items():
        monkeypatch.setattr(L, name, value)
    for name, value in dict(COLS_BLOCK=8, COLS_TILE=32, COLS_TILE_DROPOUT=16, MIN_ROWS_PER_PROGRAM=4,
                             COLS_PROGRAMS_PER_SM=8).items():
        monkeypatch.setattr(K, name, value)
