"""The code sandbox: each limit holds against code written to break it, and the run survives.

Every attack runs for real in `rl.envs.code_repair.sandbox` and is followed by a normal run in
the same test, to show that nothing was harmed and nothing of the attack is left running.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rl.envs.code_repair import sandbox, syscalls
from tests.support.runs import ROOT

PY = "/usr/bin/python3"
LIMITS = sandbox.Limits(wall_s=5.0, cpu_s=3, memory_mb=256, processes=16)


def run_python(workdir: Path, code: str, limits: sandbox.Limits = LIMITS) -> sandbox.Result:
    (workdir / "main.py").write_text(code)
    return sandbox.run([PY, "-I", "main.py"], workdir, limits)


def assert_unharmed(workdir: Path) -> None:
    result = run_python(workdir, "print(sum(range(10)))")
    assert result.returncode == 0 and result.stdout.strip() == "45", result
    if os.getuid() == 0:
        assert (
            sandbox.processes_of(range(sandbox.UID_BASE, sandbox.UID_BASE + sandbox.UID_SPAN)) == []
        )


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    return work


def test_a_normal_run_writes_in_a_copy_of_its_directory_and_reports_output(
    workdir: Path,
) -> None:
    (workdir / "data.txt").write_text("given")
    code = (
        "open('out.txt', 'w').write('hi'); print(open('data.txt').read(), open('out.txt').read())"
        "\nimport os; os.write(3, b'report'); exit(3)"
    )
    result = run_python(workdir, code)
    assert (result.returncode, result.stdout, result.timed_out) == (3, "given hi\n", False)
    assert result.channel == "report"
    assert not (workdir / "out.txt").exists()  # the caller's directory is only read


def test_the_run_sees_only_its_own_processes(workdir: Path) -> None:
    result = run_python(workdir, "import os; print(os.getpid(), sorted(os.listdir('/proc'))[:1])")
    assert result.stdout.split()[0] == "1", result  # PID 1 of its own namespace


def test_an_infinite_loop_is_killed(workdir: Path) -> None:
    result = run_python(workdir, "while True:\n    pass\n")
    # The CPU limit (SIGXCPU/SIGKILL) or the wall-clock limit ends it, whichever comes first.
    assert result.timed_out or result.returncode in (128 + 9, 128 + 24), result
    assert_unharmed(workdir)


def test_a_sleeping_process_tree_is_killed_at_the_wall_clock_limit(workdir: Path) -> None:
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(60)\n"
    result = run_python(workdir, code, sandbox.Limits(wall_s=2.0))
    assert result.timed_out and result.returncode == sandbox.KILLED_EXIT
    assert_unharmed(workdir)


def test_a_fork_bomb_hits_the_process_limit(workdir: Path) -> None:
    code = (
        "import os, sys, time\nforks = failed = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        if os.fork() == 0:\n            time.sleep(30)\n            os._exit(0)\n"
        "        forks += 1\n"
        "    except OSError:\n        failed += 1\n"
        "print(forks, failed, flush=True)\ntime.sleep(30)\n"
    )
    result = run_python(workdir, code, sandbox.Limits(wall_s=4.0, processes=16))
    forks, failed = map(int, result.stdout.split())
    assert forks < 16 and failed == 200 - forks, result
    assert result.timed_out
    assert_unharmed(workdir)


def test_a_memory_hog_gets_memory_error(workdir: Path) -> None:
    result = run_python(workdir, "x = bytearray(2 * 1024**3)\nprint('allocated')")
    assert result.returncode == 1 and "MemoryError" in result.stderr, result
    assert "allocated" not in result.stdout
    assert_unharmed(workdir)


def test_writes_outside_the_directory_fail(workdir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    targets = [str(outside), "/tmp/relay-sandbox-escape", "/dev/shm/relay-sandbox-escape"]
    code = (
        "import sys\nfor path in sys.argv[1:]:\n"
        "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
        "    except OSError as err:\n        print('refused', path, err.strerror)\n"
    )
    (workdir / "main.py").write_text(code)
    result = sandbox.run([PY, "-I", "main.py", *targets], workdir, LIMITS)
    assert "wrote" not in result.stdout and result.stdout.count("refused") == 3, result
    assert not any(Path(t).exists() for t in targets)
    assert_unharmed(workdir)


def test_socket_connect_fails_and_reaches_nobody(workdir: Path) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(3.0)
    port = server.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        try:
            accepted.append(server.accept())
        except TimeoutError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    code = (
        "import socket\nfor host in ('127.0.0.1', '1.1.1.1'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {port}), timeout=2)\n"
        "        print('connected', host)\n"
        "    except OSError as err:\n        print('failed', host, err)\n"
    )
    result = run_python(workdir, code)
    thread.join()
    server.close()
    assert result.stdout.count("failed") == 2 and "connected" not in result.stdout, result
    assert accepted == []
    assert_unharmed(workdir)


def test_a_huge_file_is_cut_by_the_file_size_limit(workdir: Path) -> None:
    code = (
        "import os\ntry:\n    open('big', 'wb').write(b'x' * (64 * 1024 * 1024))\n"
        "except OSError as err:\n    print('refused', err.strerror)\n"
        "print(os.path.getsize('big'))\n"
    )
    result = run_python(workdir, code, sandbox.Limits(file_mb=1))
    assert result.stdout.startswith("refused File too large"), result
    assert int(result.stdout.split()[-1]) <= 1024 * 1024
    assert_unharmed(workdir)


def test_output_is_capped(workdir: Path) -> None:
    result = run_python(workdir, "print('y' * 500_000)", sandbox.Limits(output_kb=4))
    assert result.returncode == 0 and len(result.stdout) == 4096


@pytest.fixture
def host_file() -> Iterator[Path]:
    """A file anyone may read, in the checkout (outside /tmp, which the run never saw)."""
    parent = ROOT / ".pytest_cache"
    parent.mkdir(exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="relay-host-file-", dir=parent)
    os.write(fd, b"host text")
    os.close(fd)
    os.chmod(name, 0o644)
    yield Path(name)
    os.unlink(name)


LOOK = (
    "import os, sys\n"
    "print(os.getcwd(), *sorted(os.listdir('/tmp')), *sorted(os.listdir('/etc')))\n"
    "print(*sorted(os.listdir('/')))\n"
    "for path in sys.argv[1:]:\n"
    "    try:\n"
    "        found = open(path).read() if os.path.isfile(path) else os.listdir(path)\n"
    "        print('found', path, found)\n"
    "    except OSError as err:\n        print('refused', path, err.strerror)\n"
)


def test_the_run_sees_its_directory_and_the_system_only(workdir: Path, host_file: Path) -> None:
    """A file anyone may read in the checkout, the checkout and /etc/passwd do not exist for the
    run; it works in /tmp/work, and /tmp and /etc hold nothing else."""
    host = [host_file, ROOT / "README.md", ROOT, Path("/etc/passwd")]
    assert all(path.exists() for path in host)
    (workdir / "main.py").write_text(LOOK)
    result = sandbox.run([PY, "-I", "main.py", *map(str, host)], workdir, LIMITS)
    cwd, root, *lines = result.stdout.splitlines()
    assert cwd == "/tmp/work work ld.so.cache", result
    system = {Path(path).name for path in sandbox.SYSTEM}
    assert set(root.split()) <= system | {"etc", "dev", "proc", "tmp"}, result
    assert lines == [f"refused {path} No such file or directory" for path in host], result
    assert_unharmed(workdir)


def test_a_python_outside_the_system_brings_its_installation_only(workdir: Path) -> None:
    """This test's own interpreter (a virtual environment's, in the checkout, here): the run
    sees its installation, by its real path, and still not the checkout."""
    code = "import os, sys\nprint(sys.executable, os.path.exists(sys.argv[1]))"
    (workdir / "main.py").write_text(code)
    result = sandbox.run([sys.executable, "-I", "main.py", str(ROOT)], workdir, LIMITS)
    assert result.stdout.split() == [os.path.realpath(sys.executable), "False"], result


def test_the_run_cannot_make_or_join_a_user_namespace(workdir: Path) -> None:
    """unshare refused, clone3 unknown (so threads and processes start by clone), setns refused
    (EINVAL without the filter: the run's own user namespace)."""
    code = (
        "import ctypes, os, subprocess, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def error(ret):\n    return os.strerror(ctypes.get_errno()) if ret < 0 else 'done'\n"
        f"print(error(libc.unshare({syscalls.CLONE_NEWUSER})))\n"
        f"print(error(libc.syscall({syscalls.arch().clone3}, None, 0)))\n"
        "own = os.open('/proc/self/ns/user', os.O_RDONLY)\n"
        f"print(error(libc.setns(own, {syscalls.CLONE_NEWUSER})))\n"
        "thread = threading.Thread(target=print, args=('thread',))\n"
        "thread.start()\nthread.join()\n"
        "print(subprocess.run(['echo', 'process'], capture_output=True).stdout.decode(), end='')\n"
    )
    result = run_python(workdir, code)
    refused, unknown = "Operation not permitted", "Function not implemented"
    lines = result.stdout.splitlines()
    assert lines == [refused, unknown, refused, "thread", "process"], result
    if shutil.which("unshare"):  # util-linux's, found in the run's /usr too
        result = sandbox.run(["unshare", "--user", "true"], workdir, LIMITS)
        assert result.returncode != 0 and "Operation not permitted" in result.stderr, result
    assert_unharmed(workdir)


SYSCALL = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "def said(ret):\n    return os.strerror(ctypes.get_errno()) if ret < 0 else 'done'\n"
)


KEY_CALLS = {"x86_64": (250, 248, 249), "aarch64": (219, 217, 218)}
"""keyctl, add_key and request_key by machine: the kernel's numbers, written here apart from
syscalls.py's so that a wrong number there fails here."""
IO_URING_CALLS = (425, 426, 427)  # io_uring_setup, _enter and _register, on both machines


def key_calls() -> str:
    """Names for the keyring calls and constants, in code run inside the sandbox and beside."""
    keyctl, add_key, request_key = KEY_CALLS[os.uname().machine]
    return (
        "JOIN, SEARCH, READ, SESSION = 1, 10, 11, -3\n"  # KEYCTL_*, KEY_SPEC_SESSION_KEYRING
        f"keyctl, add_key, request_key = {keyctl}, {add_key}, {request_key}\n"
    )


def test_the_run_cannot_use_the_callers_keyrings(workdir: Path) -> None:
    """Keyrings are not namespaced, and the run inherits its caller's session keyring: it must
    neither find the caller's key nor plant one the caller sees (keyctl, add_key and
    request_key: ENOSYS). The caller is a process of its own, with a session keyring of its
    own, so that no key outlives the test."""
    preamble = SYSCALL + key_calls()
    probe = preamble + (
        "found = libc.syscall(keyctl, SEARCH, SESSION, b'user', b'relay-key', 0)\n"
        "print(said(found))\n"
        "if found >= 0:\n"
        "    secret = ctypes.create_string_buffer(64)\n"
        "    libc.syscall(keyctl, READ, found, secret, 64)\n"
        "    print(secret.value)\n"
        "print(said(libc.syscall(add_key, b'user', b'relay-planted', b'x', 1, SESSION)))\n"
        "print(said(libc.syscall(request_key, b'user', b'relay-key', None, 0)))\n"
    )
    (workdir / "main.py").write_text(probe)
    caller = preamble + (
        "import json\nfrom pathlib import Path\nfrom rl.envs.code_repair import sandbox\n"
        "libc.syscall(keyctl, JOIN, None)\n"  # a new session keyring, this process's alone
        "key = libc.syscall(add_key, b'user', b'relay-key', b'secret', 6, SESSION)\n"
        f"result = sandbox.run([{PY!r}, '-I', 'main.py'], Path(sys.argv[1]))\n"
        "seen = libc.syscall(keyctl, SEARCH, SESSION, b'user', b'relay-planted', 0)\n"
        "print(json.dumps([said(key), result.stdout, said(seen)]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", caller, str(workdir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    added, inside, seen = json.loads(done.stdout)
    if added != "done":
        pytest.skip(f"this kernel keeps no keys for the test to hide: {added}")
    refused = ["Function not implemented"] * 3  # search, add_key, request_key: ENOSYS
    assert (inside.splitlines(), seen) == (refused, "Required key not available")  # not planted


def test_the_run_cannot_use_io_uring(workdir: Path) -> None:
    """io_uring_setup, io_uring_enter and io_uring_register: ENOSYS, as on a kernel without
    io_uring (without the filter, setup makes a ring, and the others refuse fd -1 otherwise)."""
    setup, enter, register = IO_URING_CALLS
    code = SYSCALL + (
        "params = ctypes.create_string_buffer(120)\n"  # struct io_uring_params, zeroed
        f"print(said(libc.syscall({setup}, 8, params)))\n"
        f"print(said(libc.syscall({enter}, -1, 1, 0, 0, None, 0)))\n"
        f"print(said(libc.syscall({register}, -1, 0, None, 0)))\n"
    )
    result = run_python(workdir, code)
    assert result.stdout.splitlines() == ["Function not implemented"] * 3, result
    assert_unharmed(workdir)


CAPABILITIES = (
    "for line in open('/proc/self/status'):\n"
    "    if line.startswith(('CapPrm', 'CapEff')):\n"
    "        print(line.split()[1])\n"
)
UNPRIVILEGED_CALLER = (
    "import sys, tempfile\nfrom pathlib import Path\nfrom rl.envs.code_repair import sandbox\n"
    "with tempfile.TemporaryDirectory() as tmp:\n"
    "    Path(tmp, 'main.py').write_text(sys.argv[1])\n"
    f"    result = sandbox.run([{PY!r}, '-I', 'main.py'], Path(tmp))\n"
    "print(result.stdout + result.stderr, end='')\n"
)
NOBODY = 65534


def test_the_run_holds_no_capabilities(workdir: Path) -> None:
    """Neither as the run's own uid (under root) nor as uid 0 of its own user namespace, where
    a caller without root runs it (tried as nobody when the test runs as root): with no
    CAP_SYS_PTRACE, a process of the run cannot trace or read a non-dumpable one."""
    none = ["0000000000000000"] * 2
    assert run_python(workdir, CAPABILITIES).stdout.split() == none
    if os.getuid() != 0:
        return  # the run above was the unprivileged kind already
    if not _readable_by_all(ROOT):
        pytest.skip(f"{ROOT} is not readable by an unprivileged user")
    done = subprocess.run(
        [PY, "-I", "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n{UNPRIVILEGED_CALLER}"]
        + [CAPABILITIES],
        cwd="/",
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    if "sandbox: unshare" in done.stdout:
        pytest.skip(f"no unprivileged user namespaces here: {done.stdout}")
    assert done.stdout.split() == none, done.stdout


def _readable_by_all(path: Path) -> bool:
    """Whether any user may read `path` and pass through each directory above it."""
    above = all(os.stat(p).st_mode & 0o001 for p in path.parents)
    return above and os.stat(path).st_mode & 0o005 == 0o005
