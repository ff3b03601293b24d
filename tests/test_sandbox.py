"""The code sandbox: each limit holds against code written to break it, and the run survives.

Every attack runs for real in `rl.envs.code_repair.sandbox` and is followed by a normal run in
the same test, to show that nothing was harmed and nothing of the attack is left running.
"""

from __future__ import annotations

import os
import shutil
import socket
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
