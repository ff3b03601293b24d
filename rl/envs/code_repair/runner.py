"""code_repair's test runner: the program each sandboxed test run executes, a trusted parent that
never imports the package under test, with a child per case that does.

The environment copies this file into the run's directory and starts it with `python -I` (so
neither the run's directory nor anything the package writes is on the parent's import path),
the package's name and the calls to make as JSON on stdin (never in the run's files). It holds
only the standard library, as the sandbox's interpreter may not be the caller's.

Why a child per case: the package's code must not run in, or write for, the process that
reports. The parent:
- runs as PID 1 of the sandbox's PID namespace (it refuses to run otherwise) and keeps no
  signal handler, so the kernel drops every signal a process of the run sends it, SIGKILL
  included;
- makes itself non-dumpable (PR_SET_DUMPABLE 0) before it starts anything. A process without
  CAP_SYS_PTRACE (the sandbox gives the run no capabilities) can then neither trace it, nor
  read or write its memory, nor open or take what its descriptors hold (/proc/1/fd,
  pidfd_getfd): no child reaches the parent's report channel, file descriptor 3, or its state;
- for each call forks a child with a pipe of its own. The child first closes the report
  channel and its stdin, then imports the package, evaluates the call, writes to its pipe what
  it returned (a repr) or raised, as JSON, and exits;
- waits for the child, kills whatever else of the run is left (so no process of one case lives
  on into the next), reads at most `CHILD_BYTES` of the pipe, and writes one line to the report
  channel: `[case index, "returned" or "raised", text]`. A child that wrote nothing readable
  (it exited early, say) raised, as far as the report goes. A child killed by a limit (SIGKILL
  or SIGXCPU: CPU time, or the run's memory) ends the run, exit status 128 + that signal, as
  when the package ran in one process: every case would spend that limit in turn.

So the most a package can claim is what its own functions returned, case by case; the
expected values are never in the run, and the verdicts are made outside it (`environment.py`),
from lines only this parent writes.
"""

import ctypes
import json
import os
import signal
import sys

REPORT_FD = 3
REPORT_CHARS = 500
"""Kept of one returned value's repr or error: far more than any expected value's, and short
enough that 16 cases' lines at their longest (6 bytes a character, as JSON escapes control
characters) fit the sandbox's 64 KiB channel."""
CHILD_BYTES = 6 * REPORT_CHARS + 64
"""A child's JSON at its longest: under a page, so that its write never waits for the parent."""
PR_SET_DUMPABLE = 4
LIMIT_SIGNALS = (signal.SIGKILL, signal.SIGXCPU)  # how the CPU-time and memory limits end one


def main() -> None:
    if os.getpid() != 1:
        sys.exit("runner.py runs as PID 1 of a PID namespace of its own (the code sandbox's)")
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        sys.exit(f"prctl(PR_SET_DUMPABLE): {os.strerror(ctypes.get_errno())}")
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python's one handler: see the docstring
    package, calls = json.loads(sys.stdin.read())
    for index, call in enumerate(calls):
        kind, text = run_case(package, call)
        line = json.dumps([index, kind, text], ensure_ascii=False) + "\n"
        os.write(REPORT_FD, line.encode(errors="backslashreplace"))


def run_case(package: str, call: str) -> tuple[str, str]:
    """What `call` returned or raised, evaluated in a child of its own."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(REPORT_FD)  # first: none of the package's code runs with it open
            os.close(read_end)
            said = json.dumps(answer(package, call), ensure_ascii=False)
            os.write(write_end, said.encode(errors="backslashreplace"))
        finally:
            os._exit(0)  # whatever happened, the child never goes on as the parent
    os.close(write_end)
    status = os.waitpid(pid, 0)[1]  # its answer, under a page, is in the pipe by then
    end_the_rest()
    message = read_held(read_end)
    os.close(read_end)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in LIMIT_SIGNALS:
        sys.exit(128 + os.WTERMSIG(status))
    return outcome(message, status)


def answer(package: str, call: str) -> list[str]:
    """["returned", repr] or ["raised", error] of `call` on the package: the child's work."""
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.path.insert(0, ".")
        names: dict = {}
        exec(f"from {package} import *", names)
        return ["returned", repr(eval(call, names))[:REPORT_CHARS]]
    except BaseException as err:  # noqa: BLE001 - whatever the package does is its outcome
        return ["raised", describe(err)[:REPORT_CHARS]]


def describe(err: BaseException) -> str:
    try:
        return f"{type(err).__name__}: {err}"
    except BaseException:  # noqa: BLE001 - an exception whose message itself raises
        return type(err).__name__


def end_the_rest() -> None:
    """Kill every other process of the run and reap it. From a PID namespace's PID 1, kill(-1)
    reaches every process of the namespace but the caller, and nothing outside; each is a
    descendant of this one, so waiting reaps them all in the end."""
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return  # none left, zombies included
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def read_held(fd: int) -> bytes:
    """Up to CHILD_BYTES of what the pipe `fd` holds now, without waiting for more."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, CHILD_BYTES)
    except BlockingIOError:
        return b""


def outcome(message: bytes, status: int) -> tuple[str, str]:
    """A child's (kind, text) from what it wrote; "raised", with how it ended, when that is not
    an answer."""
    try:
        said = json.loads(message)
    except (ValueError, RecursionError):
        said = None
    if isinstance(said, list) and len(said) == 2 and said[0] in ("returned", "raised"):
        if isinstance(said[1], str):
            return said[0], said[1][:REPORT_CHARS]
    if os.WIFSIGNALED(status):
        return "raised", f"the case's process was killed by signal {os.WTERMSIG(status)}"
    return "raised", f"the case's process ended without an answer (exit {os.WEXITSTATUS(status)})"


if __name__ == "__main__":
    main()
