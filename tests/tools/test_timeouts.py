"""tests/timeouts.py: every limit scales by FUSEBLOCK_TEST_TIMEOUT_SCALE, and a limit that is hit
fails in one line that names the limit, the factor and how to raise it, with the last lines
the process printed (before: a bare subprocess.TimeoutExpired traceback)."""
import os
import subprocess
import sys

import pytest
import timeouts

# prints 30 numbered lines, then hangs
CHATTY_HANG = "import time\nfor i in range(30): print('line', i, flush=True)\ntime.sleep(60)"


@pytest.fixture
def fast(monkeypatch):
    """A factor that turns 100 s into one second."""
    monkeypatch.setenv(timeouts.SCALE_VAR, "0.01")


def _first_line_and_tail(excinfo):
    text = str(excinfo.value)
    first, _, rest = text.partition("\n")
    return first, rest


@pytest.mark.parametrize("value, seconds", [("", 3 * 240), ("1", 240), ("6", 6 * 240), ("0.5", 120)])
def test_every_limit_is_scaled_by_the_one_factor(monkeypatch, value, seconds):
    monkeypatch.setenv(timeouts.SCALE_VAR, value)
    assert timeouts.limit(240) == seconds


@pytest.mark.parametrize("value", ["0", "-2", "nan", "inf", "fast"])
def test_a_bad_factor_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(timeouts.SCALE_VAR, value)
    with pytest.raises(pytest.UsageError, match=f"{timeouts.SCALE_VAR}='{value}': expected a positive number"):
        timeouts.limit(1)


def test_a_run_past_its_limit_is_one_line_with_the_output_tail(fast):
    with pytest.raises(pytest.fail.Exception) as excinfo:
        # 10 s: time for the interpreter to start and print on a busy machine
        timeouts.run([sys.executable, "-c", CHATTY_HANG], seconds=1000, capture_output=True, text=True)
    first, tail = _first_line_and_tail(excinfo)
    python = os.path.basename(sys.executable)
    assert first.startswith(f"{python} -c import time for i in range(30): print... ran past its limit")
    assert "ran past its limit of 10 s (1000 s x FUSEBLOCK_TEST_TIMEOUT_SCALE=0.01)" in first
    assert "Raise FUSEBLOCK_TEST_TIMEOUT_SCALE (for example FUSEBLOCK_TEST_TIMEOUT_SCALE=0.02)" in first
    lines = tail.splitlines()
    assert lines[0] == "Last lines it printed:" and lines[-1] == "line 29"
    assert len(lines) == 1 + timeouts.TAIL_LINES and "Traceback" not in tail


def test_a_run_within_its_limit_returns_as_subprocess_run_does(fast):
    p = timeouts.run([sys.executable, "-c", "print('ok')"], seconds=2000, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == "ok\n"


def test_a_wait_past_its_limit_kills_the_process_and_shows_its_log(fast, tmp_path):
    log = tmp_path / "log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", CHATTY_HANG], stdout=f, stderr=subprocess.STDOUT)
    timeouts.wait_for(lambda: log.read_text().endswith("line 29\n"), seconds=6000, what="the lines")
    with pytest.raises(pytest.fail.Exception) as excinfo:
        timeouts.wait(proc, seconds=200, log=log)
    first, tail = _first_line_and_tail(excinfo)
    assert "ran past its limit of 2 s (200 s x" in first and tail.endswith("line 29")
    assert proc.poll() is not None  # killed, not left running


def test_wait_for_names_what_it_waited_for(fast, tmp_path):
    (tmp_path / "log").write_text("starting\nstep 3\n")
    with pytest.raises(pytest.fail.Exception) as excinfo:
        timeouts.wait_for(lambda: False, seconds=20, what="the first checkpoint", log=tmp_path / "log")
    first, tail = _first_line_and_tail(excinfo)
    assert first.startswith("waiting for the first checkpoint ran past its limit of 0.2 s (20 s x")
    assert tail == "Last lines it printed:\nstarting\nstep 3"


# starts a child in a session of its own (as torchrun's ranks run), prints its pid, then hangs
SPAWNS_AND_HANGS = ("import subprocess, sys, time\n"
                    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
                    "                     start_new_session=True)\n"
                    "print('child', c.pid, flush=True)\ntime.sleep(120)")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_a_run_past_its_limit_kills_the_processes_below_it_too(fast):
    with pytest.raises(pytest.fail.Exception) as excinfo:
        timeouts.run([sys.executable, "-c", SPAWNS_AND_HANGS], seconds=500, capture_output=True, text=True)
    child = int(str(excinfo.value).split("child ")[1].split()[0])
    assert not timeouts.running(child), f"process {child}, started by the one that timed out, is still running"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_a_wait_past_its_limit_kills_the_processes_below_it_too(fast, tmp_path):
    log = tmp_path / "log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", SPAWNS_AND_HANGS], stdout=f, stderr=subprocess.STDOUT)
    timeouts.wait_for(lambda: "child" in log.read_text(), seconds=6000, what="the child's pid")
    child = int(log.read_text().split("child ")[1].split()[0])
    with pytest.raises(pytest.fail.Exception):
        timeouts.wait(proc, seconds=200, log=log)
    assert not timeouts.running(child), f"process {child}, started by the one that timed out, is still running"
