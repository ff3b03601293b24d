"""A sandbox for model-written code: one throwaway process tree per run, fenced in by the kernel.

Each `run` starts this module (`python -m rl.envs.code_repair.sandbox`) as a bootstrap that,
before it executes the command:
- enters new mount, network, PID, IPC and UTS namespaces (plus a user namespace when not root):
  no network but a loopback that is down, no view of other processes;
- remounts every file system read-only except the run's working directory, bind-mounted
  writable at a fresh directory under /tmp that any uid may enter, so nothing outside it can be
  written, /tmp and /dev/shm included;
- as root, also drops to an unprivileged uid of its own (so a process-count limit counts this
  run alone) that owns only the working directory;
- forks the command as PID 1 of the new namespace with limits on CPU seconds, address space,
  processes, file size and open files. When PID 1 ends, the kernel ends everything it started.
The caller enforces the wall-clock limit: on expiry it kills the namespace's PID 1 (so every
process of the run) and the bootstrap. Output is capped.

`check()` probes once whether this machine allows the namespaces, with a clear error if not.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
UID_BASE = 200_000  # sandbox uids: UID_BASE + bootstrap pid % UID_SPAN, owning nothing else
UID_SPAN = 100_000
KILLED_EXIT = 137


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use."""

    wall_s: float = 10.0
    """Wall-clock seconds before the whole process tree is killed."""
    cpu_s: int = 5
    """CPU seconds per process (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS)."""
    processes: int = 32
    """Processes and threads the run may have at once (RLIMIT_NPROC, per sandbox uid as root)."""
    file_mb: int = 16
    """Largest file the run may write (RLIMIT_FSIZE)."""
    output_kb: int = 64
    """Stdout and stderr kept, each; the rest is cut."""


@dataclass(frozen=True)
class Result:
    returncode: int
    """The command's exit code; 128 + N when signal N ended it; 137 when the wall limit did."""
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float


class SandboxUnavailable(RuntimeError):
    """This machine does not let Relay build the sandbox (no namespaces)."""


def run(argv: list[str], workdir: Path, limits: Limits | None = None, stdin: str = "") -> Result:
    """Run `argv` in `workdir` inside the sandbox; the only writable place is `workdir`."""
    limits = limits or Limits()
    # Where the run sees `workdir`: a directory anyone may enter, whatever `workdir`'s parents
    # allow; the bind mount exists only inside the run's mount namespace.
    view = Path(tempfile.mkdtemp(prefix="relay-sandbox-"))
    view.chmod(0o755)
    spec = {"argv": argv, "workdir": str(workdir.resolve()), "view": str(view)}
    try:
        return _run(json.dumps({**spec, "limits": asdict(limits)}), limits, stdin)
    finally:
        view.rmdir()


def _run(spec: str, limits: Limits, stdin: str) -> Result:
    t0 = time.monotonic()
    # `__name__` is this module's dotted name here: the caller imported it (only the bootstrap
    # runs it as __main__, and never gets here).
    proc = subprocess.Popen(
        [sys.executable, "-m", __name__, spec],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": _package_root()},
    )
    timed_out = False
    try:
        out, err = proc.communicate(stdin.encode(), timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(proc.pid)
        out, err = proc.communicate()
    if os.getuid() == 0:  # PID 1 is gone; the kernel is ending the rest of the namespace
        _wait_gone(UID_BASE + proc.pid % UID_SPAN)
    cap = limits.output_kb * 1024
    return Result(
        returncode=KILLED_EXIT if timed_out else _exit_code(proc.returncode),
        stdout=out[:cap].decode(errors="replace"),
        stderr=err[:cap].decode(errors="replace"),
        timed_out=timed_out,
        wall_s=time.monotonic() - t0,
    )


def check() -> None:
    """Raise SandboxUnavailable, saying why, when sandboxed runs cannot work here."""
    with tempfile.TemporaryDirectory(prefix="relay-sandbox-check-") as tmp:
        result = run(["/bin/sh", "-c", "echo ok > probe && cat probe"], Path(tmp))
    if result.stdout.strip() != "ok":
        raise SandboxUnavailable(
            "the code sandbox needs Linux mount, network and PID namespaces (root, or "
            f"unprivileged user namespaces); the probe said: {result.stderr.strip()[-400:]}"
        )


def _package_root() -> str:
    """The directory that holds `rl`, for the bootstrap's import path."""
    return str(Path(__file__).resolve().parents[__name__.count(".")])


def _exit_code(status: int) -> int:
    return 128 - status if status < 0 else status


def _kill_tree(bootstrap: int) -> None:
    """SIGKILL the namespace's PID 1 (the kernel then ends every process in it) and the
    bootstrap, whatever process groups the run made."""
    try:
        children = Path(f"/proc/{bootstrap}/task/{bootstrap}/children").read_text().split()
    except OSError:
        children = []
    for pid in children:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(bootstrap, signal.SIGKILL)
    except ProcessLookupError:
        pass


def processes_of(uids: range) -> list[int]:
    """Live processes owned by any of `uids` on this machine."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid in uids:
                found.append(int(entry.name))
        except FileNotFoundError:
            continue
    return found


def _wait_gone(uid: int, timeout: float = 10.0) -> None:
    """Wait (bounded) until no process of sandbox uid `uid` is left."""
    deadline = time.monotonic() + timeout
    while processes_of(range(uid, uid + 1)) and time.monotonic() < deadline:
        time.sleep(0.01)


# The bootstrap: runs as `python -m rl.envs.code_repair.sandbox <spec>`, then becomes the
# command.

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, flags: int, fstype: str | None = None) -> None:
    def enc(text: str | None) -> bytes | None:
        return text.encode() if text is not None else None

    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, None), f"mount {target}")


def _enter_namespaces(root: bool) -> None:
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    _check(_libc.unshare(flags | (0 if root else CLONE_NEWUSER)), "unshare")
    if not root:  # be root of the new user namespace, mapped to the caller outside
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
        Path("/proc/self/gid_map").write_text(f"0 {gid} 1")


def _mount_flags(options: str) -> int:
    """The locked flags a read-only remount must keep (the kernel refuses to drop them)."""
    names = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    return sum(flag for name, flag in names.items() if name in options.split(","))


def _read_only_except(workdir: str, view: str) -> None:
    """Everything read-only but `workdir`, which appears (writable) at `view`."""
    _mount(None, "/", MS_REC | MS_PRIVATE)
    _mount(workdir, view, MS_BIND | MS_REC)
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mounts.append((fields[4], fields[5]))
    for target, options in mounts:
        if target == view:
            continue
        target = target.encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | _mount_flags(options)
        try:
            _mount(None, target, flags)
        except OSError:
            # A mount hidden under another one cannot be reached, so cannot be written either.
            if target in ("/", "/tmp", "/dev/shm", "/var/tmp") or os.path.ismount(target):
                if not _is_read_only(target):
                    raise


def _is_read_only(path: str) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def _limit(limits: dict[str, float]) -> None:
    mb = 1024 * 1024
    for kind, value in (
        (resource.RLIMIT_CPU, int(limits["cpu_s"])),
        (resource.RLIMIT_AS, int(limits["memory_mb"]) * mb),
        (resource.RLIMIT_NPROC, int(limits["processes"])),
        (resource.RLIMIT_FSIZE, int(limits["file_mb"]) * mb),
        (resource.RLIMIT_NOFILE, 256),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(kind, (value, value))


def _bootstrap(spec: dict) -> int:
    workdir, view, argv = spec["workdir"], spec["view"], spec["argv"]
    root = os.getuid() == 0
    sandbox_uid = UID_BASE + os.getpid() % UID_SPAN
    if root:
        for path in [workdir, *(str(p) for p in Path(workdir).rglob("*"))]:
            os.lchown(path, sandbox_uid, sandbox_uid)
    _enter_namespaces(root)
    _read_only_except(workdir, view)
    pid = os.fork()  # the first child is PID 1 of the new PID namespace
    if pid == 0:
        try:
            _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
            _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")
            # A /proc of the new PID namespace: the run sees its own processes only.
            _mount("proc", "/proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "proc")
            os.chdir(view)
            if root:
                os.setgroups([])
                os.setgid(sandbox_uid)
                os.setuid(sandbox_uid)
            _limit(spec["limits"])
            env = {"PATH": "/usr/bin:/bin", "HOME": view, "LANG": "C.UTF-8"}
            env["PYTHONDONTWRITEBYTECODE"] = "1"
            os.execvpe(argv[0], argv, env)
        except BaseException as err:  # noqa: BLE001 - report and leave the child now
            os.write(2, f"sandbox: {err}\n".encode())
        os._exit(126)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        code = _bootstrap(spec)
    except OSError as err:
        print(f"sandbox: {err}", file=sys.stderr)
        code = 125
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
