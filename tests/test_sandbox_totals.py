"""The code sandbox's totals per run and its reach: output read with a cap while the program
runs, memory, disk bytes and inodes capped for the whole run (not per process), and no Unix
socket of the host reachable, whether bound in the file system or abstract."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rl.envs.code_repair import sandbox
from tests.support.runs import ROOT

PY = "/usr/bin/python3"
MB = 1024 * 1024


def run_python(workdir: Path, code: str, limits: sandbox.Limits) -> sandbox.Result:
    (workdir / "main.py").write_text(code)
    return sandbox.run([PY, "-I", "main.py"], workdir, limits)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    return work


def test_output_is_capped_while_the_program_writes(workdir: Path) -> None:
    """256 MiB on stdout and on stderr leave the caller's memory well below either."""
    code = (
        "import os, sys\nchunk = b'y' * (1 << 20)\n"
        "for _ in range(256):\n    os.write(1, chunk)\n    os.write(2, chunk)\n"
        "os.write(3, chunk)\nprint('done', file=sys.stderr)\n"
    )
    (workdir / "main.py").write_text(code)
    caller = (
        "import json, sys\nfrom pathlib import Path\n"
        "from rl.envs.code_repair import sandbox\n"
        f"r = sandbox.run([{PY!r}, '-I', 'main.py'], Path(sys.argv[1]),"
        " sandbox.Limits(wall_s=60, output_kb=8))\n"
        "print(json.dumps([r.returncode, len(r.stdout), len(r.stderr), len(r.channel),"
        " Path('/proc/self/status').read_text().split('VmHWM:')[1].split()[0]]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", caller, str(workdir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    code, out, err, channel, peak_kb = json.loads(done.stdout)
    assert (code, out, err, channel) == (0, 8192, 8192, 8192)
    assert int(peak_kb) * 1024 < 128 * MB, peak_kb  # the caller never held the output


needs_cgroup = pytest.mark.skipif(
    sandbox.control_group() == "none", reason="no control group can be made on this machine"
)


@needs_cgroup
def test_memory_is_capped_for_the_whole_run_not_per_process(workdir: Path) -> None:
    """8 processes of 100 MiB each, all holding it at once for 2 s, may not all live under
    memory_mb=256, though each is under the per-process limit: the run's control group kills
    all but at most two. (Which ones it kills is the kernel's choice: an early one may go to
    make room for a later one, so survivors are counted, not allocations.)"""
    code = (
        "import os, time\n"
        "pids = []\n"
        "for _ in range(8):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = b'x' * (100 * 1024 * 1024)\n"
        "        time.sleep(2)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "print('survived', sum(os.waitpid(pid, 0)[1] == 0 for pid in pids))\n"
    )
    limits = sandbox.Limits(wall_s=10.0, memory_mb=256, processes=16)
    result = run_python(workdir, code, limits)
    assert "survived" in result.stdout, result
    assert int(result.stdout.split()[-1]) <= 2, result


def test_disk_bytes_are_capped_for_the_whole_run(workdir: Path) -> None:
    code = (
        "written = 0\nfor i in range(20):\n"
        "    try:\n        open(f'f{i}', 'wb').write(b'x' * (4 * 1024 * 1024))\n"
        "        written += 1\n"
        "    except OSError as err:\n        print('refused', err.strerror)\n        break\n"
        "print(written)\n"
    )
    limits = sandbox.Limits(file_mb=16, disk_mb=16)
    result = run_python(workdir, code, limits)
    assert "refused No space left on device" in result.stdout, result
    assert int(result.stdout.split()[-1]) * 4 <= 16  # MiB


def test_inodes_are_capped_for_the_whole_run(workdir: Path) -> None:
    code = (
        "made = 0\nfor i in range(5000):\n"
        "    try:\n        open(f'e{i}', 'w').close()\n        made += 1\n"
        "    except OSError as err:\n        print('refused', err.strerror)\n        break\n"
        "print(made)\n"
    )
    result = run_python(workdir, code, sandbox.Limits(inodes=200))
    assert "refused No space left on device" in result.stdout, result
    assert int(result.stdout.split()[-1]) < 200


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A directory anyone may enter, outside /tmp: in the checkout, which the run must not see
    either."""
    parent = ROOT / ".pytest_cache"
    parent.mkdir(exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="relay-sock-", dir=parent))
    directory.chmod(0o777)
    yield directory
    shutil.rmtree(directory)


def listen(address: str) -> socket.socket:
    """A Unix socket server open to anyone; a connection attempt would wait in its backlog."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    if not address.startswith("\0"):  # abstract names have no file
        os.chmod(address, 0o777)
    server.listen()
    server.setblocking(False)
    return server


def connected(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
    except BlockingIOError:
        return False
    return True


CONNECT = (
    "import socket, sys\nfor address in sys.argv[1:]:\n"
    "    address = address.replace('@', '\\0', 1)\n"
    "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
    "    try:\n        s.connect(address)\n        print('connected', repr(address))\n"
    "    except OSError as err:\n        print('failed', repr(address), err.strerror)\n"
)


def test_unix_sockets_of_the_host_are_unreachable(
    workdir: Path, tmp_path: Path, socket_dir: Path
) -> None:
    abstract = f"\0relay-sandbox-test-{uuid.uuid4().hex}"
    addresses = [str(socket_dir / "s.sock"), str(tmp_path / "t.sock"), abstract]
    servers = [listen(a) for a in addresses]
    (workdir / "main.py").write_text(CONNECT)
    argv = [PY, "-I", "main.py", *(a.replace("\0", "@") for a in addresses)]
    result = sandbox.run(argv, workdir, sandbox.Limits(wall_s=5.0))
    reached = [connected(server) for server in servers]
    for server in servers:
        server.close()
    assert "connected" not in result.stdout and result.stdout.count("failed") == 3, result
    assert reached == [False, False, False]
