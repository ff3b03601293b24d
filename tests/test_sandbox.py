"""The code sandbox: each limit holds against code written to break it, and the run survives.

Every attack runs for real in `rl.envs.code_repair.sandbox` and is followed by a normal run in
the same test, to show that nothing was harmed and nothing of the attack is left running.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from rl.envs.code_repair import sandbox

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
