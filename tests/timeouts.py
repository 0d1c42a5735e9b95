"""One rule for every time limit in the tests.

A limit in the tests is a guard against a hang, never a speed check: each one is written
as the seconds an idle 2-core machine needs with ample margin, and `limit` scales it by
FUSEBLOCK_TEST_TIMEOUT_SCALE (default 3). On a busy machine (a load average well above the
core count, a shared CI runner, one core) raise the factor:

    FUSEBLOCK_TEST_TIMEOUT_SCALE=8 make test

When a limit is hit, the test fails with one line that names the limit, the factor and
how to raise it, followed by the last lines the process printed (`run`, `wait`,
`wait_for`), instead of subprocess's TimeoutExpired traceback. The process is killed with
every process below it (`kill_tree`): torchrun's ranks run in process groups of their own,
so killing torchrun alone, as subprocess.run does, left them running.
"""
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

SCALE_VAR = "FUSEBLOCK_TEST_TIMEOUT_SCALE"
DEFAULT_SCALE = 3.0
TAIL_LINES = 20


def scale() -> float:
    """The factor every limit is multiplied by: FUSEBLOCK_TEST_TIMEOUT_SCALE, else 3."""
    text = os.environ.get(SCALE_VAR, "").strip()
    if not text:
        return DEFAULT_SCALE
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise pytest.UsageError(f"{SCALE_VAR}={text!r}: expected a positive number, such as 4")
    return value


def limit(seconds: float) -> float:
    """The limit for something an idle machine does in well under `seconds`."""
    return seconds * scale()


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _tail(*outputs) -> str:
    lines = "\n".join(_text(o) for o in outputs if o).rstrip().splitlines()
    return "\n".join(lines[-TAIL_LINES:]) if lines else "(it printed nothing)"


def timed_out(what: str, seconds: float, *outputs) -> None:
    """Fail the test: `what` ran past its limit. One line first, then the output's last lines."""
    pytest.fail(f"{what} ran past its limit of {limit(seconds):.4g} s ({seconds:g} s x {SCALE_VAR}={scale():g}): "
                f"a slow or busy machine? Raise {SCALE_VAR} (for example {SCALE_VAR}={2 * scale():g}) to give it "
                f"longer.\nLast lines it printed:\n{_tail(*outputs)}", pytrace=False)


def _name(cmd) -> str:
    """The command, short and on one line: file names without their folders, long arguments cut."""
    parts = [" ".join(os.path.basename(str(c)).split()) for c in (cmd if isinstance(cmd, (list, tuple)) else [cmd])]
    parts = [p if len(p) <= 40 else p[:37] + "..." for p in parts]
    return " ".join(parts[:6]) + (" ..." if len(parts) > 6 else "")


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, children first (Linux's /proc; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()  # after "pid (comm)": state, ppid, ...
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(0), [])
        found += below
        todo += below
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL proc and every process below it. The tree is stopped first (SIGSTOP), read again
    until no new process shows (a stopped process starts none), then killed: killed at once, an
    orphan's parent becomes 1 and it is no longer found under proc."""
    stopped: set[int] = set()
    while True:
        found = [pid for pid in (proc.pid, *descendants(proc.pid)) if pid not in stopped]
        if not found:
            break
        for pid in found:
            _signal(pid, signal.SIGSTOP)
        stopped.update(found)
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    proc.wait()
    # SIGKILL is sent, not done: a busy machine may run a process's exit a while later. Wait
    # (10 s at most) until each one has exited, so that none outlives the call
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in stopped) and time.monotonic() < deadline:
        time.sleep(0.01)


def running(pid: int) -> bool:
    """pid is a process that has not exited (a zombie has: only its entry waits for its parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):  # gone already
        pass


def run(cmd, *, seconds: float, input=None, capture_output: bool = False, check: bool = False,
        **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, ...) under limit(seconds), killing the whole tree on a timeout."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with subprocess.Popen(cmd, **kwargs) as proc:
        try:
            out, err = proc.communicate(input, timeout=limit(seconds))
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            out, err = proc.communicate()
            timed_out(_name(cmd), seconds, out, err)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def wait(proc: subprocess.Popen, *, seconds: float, log=None) -> int:
    """proc.wait() under limit(seconds); on a timeout the process and every process below it
    are killed and `log` (a path its output went to) gives the last lines."""
    try:
        return proc.wait(timeout=limit(seconds))
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        timed_out(_name(proc.args), seconds, _read(log))


def _read(path) -> str:
    try:
        return Path(path).read_text(errors="replace") if path else ""
    except OSError:
        return ""


def wait_for(condition, *, seconds: float = 120, what: str = "condition", log=None) -> None:
    """Poll until condition() is true, under limit(seconds)."""
    deadline = time.monotonic() + limit(seconds)
    while not condition():
        if time.monotonic() > deadline:
            timed_out(f"waiting for {what}", seconds, _read(log))
        time.sleep(0.02)
