"""A sandbox for model-written code: one throwaway process tree per run, fenced in by the kernel.

Each `run` starts this module (`python -m rl.envs.code_repair.sandbox`) as a bootstrap that,
before it executes the command:
- joins the run's control group, when this machine lets Relay make one (see below);
- enters new mount, network, PID, IPC and UTS namespaces (plus a user namespace when not root):
  no network but a loopback that is down, no view of other processes, and no abstract Unix
  sockets (their names live in the network namespace);
- builds an empty root, a tmpfs, that holds only:
  - read-only (nosuid, nodev): the system's programs and libraries (/usr; /bin, /sbin and /lib*
    bound, or linked into /usr as on the host), /etc/ld.so.cache, and the installation of the
    command's program when it lies elsewhere (a Python under /opt or a home directory: the
    directory above its real file's bin/, at its own path; the command then runs by that real
    path, so a virtual environment's own site-packages stay out);
  - /dev with null, zero, random, urandom and the /proc/self/fd links; a /proc of the new PID
    namespace;
  - a fresh tmpfs of `disk_mb` bytes and `inodes` files at /tmp/work, with a copy of the
    caller's directory in it: the run's only writable place, gone when it ends (the caller's
    directory is never written);
  then makes it the root (pivot_root) and detaches the host's: no other host path (/work, /home,
  /root, the host's /tmp and /run, any Unix socket bound in the file system) exists for the
  command, so no host file's text can reach a tool result. Code repair's tests need nothing
  more: the interpreter runs with -I on the task's files and its standard library;
- as root, also drops to an unprivileged uid of its own (so a process-count limit counts this
  run alone) that owns only that tmpfs;
- forks the command as PID 1 of the new namespace with limits on CPU seconds, address space,
  processes, file size and open files, no capabilities (SECBIT_NOROOT: not even as uid 0 of a
  user namespace, where a run without root is), no new privileges, and a seccomp filter that
  refuses user namespaces, setns, the kernel's keyrings (the caller's session keyring is
  inherited) and io_uring (`syscalls.py`: x86_64 and aarch64 only). Without capabilities, a
  process of the run cannot trace or read a non-dumpable one (code_repair's runner relies on
  it). When PID 1 ends, the kernel ends everything it started. File descriptor 3 of the command
  is a pipe to the caller, returned as `Result.channel`: a report channel that the command's
  stdout, which everything it runs shares, cannot disturb.

Totals per run (not per process): disk bytes and inodes by the tmpfs, always. Memory and
processes by a control group when one can be made: cgroup v2 where its memory and pids
controllers are enabled for the caller's group, otherwise cgroup v1 memory and pids hierarchies
(what this project's CI machines offer), as root. Where neither can be made (no root, a
read-only /sys/fs/cgroup), processes are still capped in total by RLIMIT_NPROC on the run's own
uid (as root), but memory only per process, by RLIMIT_AS; `control_group()` says which applies.

The caller enforces the wall-clock limit: on expiry it kills the namespace's PID 1 (so every
process of the run), the bootstrap and the control group's members. Stdout, stderr and the
channel are read while the run goes on, keeping at most `output_kb` of each in memory.

`check()` probes once whether this machine allows the namespaces, with a clear error if not,
and says which control group applies.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from rl.core.paths import ROOT
from rl.envs.code_repair.syscalls import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    PR_SET_SECUREBITS,
    SECBIT_NOROOT,
    SECBIT_NOROOT_LOCKED,
    arch,
    bind,
    install_filter,
    mount,
    pivot_to_cwd,
    prctl,
    unshare,
)

UID_BASE = 200_000  # sandbox uids: UID_BASE + bootstrap pid % UID_SPAN, owning nothing else
UID_SPAN = 100_000
KILLED_EXIT = 137
VIEW = "/tmp/work"  # where the run sees its working directory
CHANNEL_FD = 3


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use."""

    wall_s: float = 10.0
    """Wall-clock seconds before the whole process tree is killed."""
    cpu_s: int = 5
    """CPU seconds per process (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Memory of the whole run (its control group, tmpfs pages included) and address space
    of each of its processes (RLIMIT_AS)."""
    processes: int = 32
    """Processes and threads the run may have at once, in total."""
    file_mb: int = 16
    """Largest file the run may write (RLIMIT_FSIZE)."""
    disk_mb: int = 32
    """Bytes the run's working directory may hold in total (its tmpfs)."""
    inodes: int = 1024
    """Files and directories the working directory may hold in total (its tmpfs)."""
    output_kb: int = 64
    """Stdout, stderr and channel kept, each; the rest is read and dropped."""


@dataclass(frozen=True)
class Result:
    returncode: int
    """The command's exit code; 128 + N when signal N ended it; 137 when the wall limit did."""
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    channel: str = ""
    """What the command wrote to file descriptor 3."""


class SandboxUnavailable(RuntimeError):
    """This machine does not let Relay build the sandbox (no namespaces)."""


def run(argv: list[str], workdir: Path, limits: Limits | None = None, stdin: str = "") -> Result:
    """Run `argv` on a copy of `workdir` inside the sandbox; `workdir` itself is only read."""
    limits = limits or Limits()
    group = ControlGroup.create(limits)
    spec = {
        "argv": argv,
        "workdir": str(workdir.resolve()),
        "limits": asdict(limits),
        "cgroups": [str(d) for d in group.dirs] if group else [],
    }
    try:
        return _run(spec, limits, stdin)
    finally:
        if group:
            group.destroy()


def _run(spec: dict, limits: Limits, stdin: str) -> Result:
    t0 = time.monotonic()
    channel_read, channel_write = os.pipe()
    spec["channel"] = channel_write
    with tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        # `__name__` is this module's dotted name here: the caller imported it (only the
        # bootstrap runs it as __main__, and never gets here).
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, json.dumps(spec)],
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(channel_write,),
            start_new_session=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": _package_root()},
        )
    os.close(channel_write)
    assert proc.stdout is not None and proc.stderr is not None
    streams = [proc.stdout.fileno(), proc.stderr.fileno(), channel_read]
    reader = CappedReader(streams, limits.output_kb * 1024)
    deadline = t0 + limits.wall_s
    try:
        timed_out = not reader.read_until(deadline) or _still_running(proc, deadline)
        if timed_out:
            _kill_tree(proc.pid)
            reader.read_until(time.monotonic() + 5.0)  # what was written before the end
    finally:
        os.close(channel_read)
        proc.stdout.close()
        proc.stderr.close()
    proc.wait()
    if os.getuid() == 0:  # PID 1 is gone; the kernel is ending the rest of the namespace
        _wait_gone(UID_BASE + proc.pid % UID_SPAN)
    out, err, channel = (reader.text(fd) for fd in streams)
    return Result(
        returncode=KILLED_EXIT if timed_out else _exit_code(proc.returncode),
        stdout=out,
        stderr=err,
        timed_out=timed_out,
        wall_s=time.monotonic() - t0,
        channel=channel,
    )


class CappedReader:
    """Reads pipes until each is closed, keeping at most `cap` bytes of each and dropping the
    rest: a writer never blocks, and memory stays bounded however much it writes."""

    def __init__(self, fds: list[int], cap: int) -> None:
        self.kept = {fd: bytearray() for fd in fds}
        self.open = set(fds)
        self.cap = cap

    def read_until(self, deadline: float) -> bool:
        """Read until every pipe is closed (True) or `deadline`, monotonic, passes (False)."""
        with selectors.DefaultSelector() as selector:
            for fd in self.open:
                selector.register(fd, selectors.EVENT_READ)
            while self.open:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fd)
                        self.open.discard(key.fd)
                    kept = self.kept[key.fd]
                    kept += chunk[: self.cap - len(kept)]
        return True

    def text(self, fd: int) -> str:
        return self.kept[fd].decode(errors="replace")


def _still_running(proc: subprocess.Popen, deadline: float) -> bool:
    """Wait for the bootstrap until `deadline`; True when it is still running then."""
    try:
        proc.wait(max(0.0, deadline - time.monotonic()))
        return False
    except subprocess.TimeoutExpired:
        return True


def check() -> str:
    """Raise SandboxUnavailable, saying why, when sandboxed runs cannot work here; else say
    what caps memory and processes per run here (`control_group()`)."""
    with tempfile.TemporaryDirectory(prefix="relay-sandbox-check-") as tmp:
        result = run(["/bin/sh", "-c", "echo ok > probe && cat probe"], Path(tmp))
    if result.stdout.strip() != "ok":
        raise SandboxUnavailable(
            "the code sandbox needs Linux mount, network and PID namespaces (root, or "
            f"unprivileged user namespaces); the probe said: {result.stderr.strip()[-400:]}"
        )
    return control_group()


def _package_root() -> str:
    """The directory that holds `rl`, for the bootstrap's import path."""
    return str(ROOT)


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
        _kill(int(pid))
    try:
        os.killpg(bootstrap, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
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


# Control groups: the run's memory and process totals.


@dataclass(frozen=True)
class ControlGroup:
    """The control group(s) of one run: one directory under cgroup v2, or one per v1
    hierarchy (memory, pids). The bootstrap joins them before it starts anything."""

    dirs: tuple[Path, ...]

    @classmethod
    def create(cls, limits: Limits) -> ControlGroup | None:
        """A fresh group capped at `limits`; None where this machine will not make one."""
        name = f"relay-sandbox-{uuid.uuid4().hex[:12]}"
        memory = str(limits.memory_mb * 1024 * 1024)
        v2 = _v2_parent()
        if v2 is not None:
            settings = {"memory.max": memory, "memory.swap.max": "0"}
            return cls._make([(v2 / name, {**settings, "pids.max": str(limits.processes)})])
        v1 = {c: _v1_parent(c) for c in ("memory", "pids")}
        if None in v1.values():
            return None
        memory_files = {"memory.limit_in_bytes": memory, "memory.memsw.limit_in_bytes": memory}
        return cls._make(
            [
                (v1["memory"] / name, memory_files),  # type: ignore[operator]
                (v1["pids"] / name, {"pids.max": str(limits.processes)}),  # type: ignore[operator]
            ]
        )

    @classmethod
    def _make(cls, plan: list[tuple[Path, dict[str, str]]]) -> ControlGroup | None:
        made: list[Path] = []
        try:
            for path, settings in plan:
                path.mkdir()
                made.append(path)
                for file, value in settings.items():
                    if (path / file).exists():  # memsw and swap.max exist only with swap
                        (path / file).write_text(value)
        except OSError:
            ControlGroup(tuple(made)).destroy()
            return None
        return cls(tuple(made))

    def destroy(self, timeout: float = 10.0) -> None:
        """Kill whatever is left in the group and remove it (bounded wait)."""
        deadline = time.monotonic() + timeout
        for path in self.dirs:
            while path.exists():
                try:
                    members = (path / "cgroup.procs").read_text().split()
                    for pid in members:
                        _kill(int(pid))
                    if not members:
                        path.rmdir()
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    break
                time.sleep(0.005)


def control_group() -> str:
    """Which per-run memory and process caps this machine gives: "cgroup v2", "cgroup v1" or
    "none" (see the module docstring)."""
    group = ControlGroup.create(Limits())
    if group is None:
        return "none"
    group.destroy()
    return "cgroup v2" if len(group.dirs) == 1 else "cgroup v1"


def _cgroup_mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, super options) of each cgroup mount."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        fstype, options = fields[fields.index("-") + 1], fields[-1]
        if fstype in ("cgroup", "cgroup2"):
            found.append((fields[4], fstype, set(options.split(","))))
    return found


def _own_cgroup(controller: str) -> str | None:
    """This process's group path in the hierarchy of `controller` ("" for cgroup v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return None


def _v2_parent() -> Path | None:
    """This process's cgroup v2 group, when memory and pids are enabled for its children."""
    path = _own_cgroup("")
    for point, fstype, _ in _cgroup_mounts():
        if fstype == "cgroup2" and path is not None:
            parent = Path(point) / path.lstrip("/")
            try:
                enabled = (parent / "cgroup.subtree_control").read_text().split()
            except OSError:
                return None
            return parent if {"memory", "pids"} <= set(enabled) else None
    return None


def _v1_parent(controller: str) -> Path | None:
    path = _own_cgroup(controller)
    for point, fstype, options in _cgroup_mounts():
        if fstype == "cgroup" and controller in options and path is not None:
            return Path(point) / path.lstrip("/")
    return None


# The bootstrap: runs as `python -m rl.envs.code_repair.sandbox <spec>`, then becomes the
# command.

SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""The system's programs and libraries: bound where a directory, linked alike where a link."""
SYSTEM_FILES = ("/etc/ld.so.cache",)  # the dynamic linker's index of those libraries
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
DEVICE_LINKS = {
    "/dev/fd": "/proc/self/fd",
    "/dev/stdin": "/proc/self/fd/0",
    "/dev/stdout": "/proc/self/fd/1",
    "/dev/stderr": "/proc/self/fd/2",
}
STAGE = "/tmp"  # where the new root is built, over the host's /tmp, before it becomes /
STAGE_SIZE = "size=64k,nr_inodes=256,mode=0755"  # mount points and links only


def _enter_namespaces(root: bool) -> None:
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    unshare(flags | (0 if root else CLONE_NEWUSER))
    if not root:  # be root of the new user namespace, mapped to the caller outside
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
        Path("/proc/self/gid_map").write_text(f"0 {gid} 1")


def _installation(program: str) -> str | None:
    """What to bind, beyond the system, for the command's program (its argv[0]): the directory
    above the real file's bin/ (a Python installation, say), or else the real file alone; None
    when the system holds it, or when it is a relative path (into the run's directory)."""
    if not os.path.isabs(program):
        return None
    real = os.path.realpath(program)
    if any(real.startswith(os.path.realpath(d) + "/") for d in SYSTEM):
        return None
    bin_dir = os.path.dirname(real)
    return os.path.dirname(bin_dir) if os.path.basename(bin_dir) == "bin" else real


def _build_root(
    workdir: int, installation: str | None, limits: dict[str, float], owner: int
) -> None:
    """At STAGE, an empty tmpfs given only what the module docstring lists, all read-only but
    the run's tmpfs at VIEW, which holds the copy of the directory open as `workdir`."""
    os.umask(0o022)  # the mount points must be reachable by the run's uid
    mount(None, "/", MS_REC | MS_PRIVATE)
    links = {path: os.readlink(path) for path in SYSTEM if os.path.islink(path)}
    binds = [p for p in (*SYSTEM, *SYSTEM_FILES) if os.path.exists(p) and p not in links]
    binds += [installation] if installation else []
    # Opened before the host's /tmp is covered, where a program's installation may lie.
    sources = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in [*binds, *DEVICES]}
    mount("tmpfs", STAGE, MS_NOSUID | MS_NODEV, "tmpfs", STAGE_SIZE)
    for path, source in sources.items():
        bind(source, STAGE + path, read_only=path not in DEVICES)
        os.close(source)
    for path, target in {**links, **DEVICE_LINKS}.items():
        os.symlink(target, STAGE + path)
    os.mkdir(STAGE + "/proc")
    _working_tmpfs(workdir, limits, owner)
    mount(None, STAGE, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _working_tmpfs(workdir: int, limits: dict[str, float], owner: int) -> None:
    """A tmpfs capped at the run's disk bytes and inodes at VIEW of the new root, with a copy
    of the directory open as `workdir` (directories, regular files and links only) owned by
    `owner`. The descriptor reaches the directory where its path, under /tmp for example, is
    covered now."""
    view = STAGE + VIEW
    os.makedirs(view)
    size = f"size={int(limits['disk_mb'])}m,nr_inodes={int(limits['inodes'])},mode=0755"
    mount("tmpfs", view, MS_NOSUID | MS_NODEV, "tmpfs", size)
    shutil.copytree(
        f"/proc/self/fd/{workdir}", view, symlinks=True, dirs_exist_ok=True, ignore=_special_files
    )
    for path in [view, *(str(p) for p in Path(view).rglob("*"))]:
        os.lchown(path, owner, owner)


def _special_files(directory: str, names: list[str]) -> list[str]:
    """Sockets, pipes and devices: not copied into the run."""
    kinds = (os.path.isdir, os.path.isfile, os.path.islink)
    return [n for n in names if not any(kind(os.path.join(directory, n)) for kind in kinds)]


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
    for group in spec["cgroups"]:  # first: everything started from here on is counted
        Path(group, "cgroup.procs").write_text(str(os.getpid()))
    arch()  # a machine the seccomp filter knows, or a clear error now
    argv, limits = spec["argv"], spec["limits"]
    root = os.getuid() == 0
    sandbox_uid = UID_BASE + os.getpid() % UID_SPAN if root else 0
    installation = _installation(argv[0])
    program = os.path.realpath(argv[0]) if installation else argv[0]  # as bound in the root
    workdir = os.open(spec["workdir"], os.O_RDONLY | os.O_DIRECTORY)
    _enter_namespaces(root)
    _build_root(workdir, installation, limits, sandbox_uid)
    os.close(workdir)
    pid = os.fork()  # the first child is PID 1 of the new PID namespace
    if pid == 0:
        try:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            # A /proc of the new PID namespace: the run sees its own processes only. Mounted
            # while the host's /proc is in view, which a user namespace requires.
            mount("proc", STAGE + "/proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "proc")
            os.chdir(STAGE)
            pivot_to_cwd()  # the bootstrap's root moves too: it only waits from here on
            os.chdir(VIEW)
            # Uid 0 gains no capabilities by exec, for good: as root of its user namespace (no
            # root here), the command would otherwise hold them all there.
            prctl(PR_SET_SECUREBITS, SECBIT_NOROOT | SECBIT_NOROOT_LOCKED)
            if root:
                os.setgroups([])
                os.setgid(sandbox_uid)
                os.setuid(sandbox_uid)
            _limit(limits)
            os.dup2(spec["channel"], CHANNEL_FD)
            env = {"PATH": "/usr/bin:/bin", "HOME": VIEW, "LANG": "C.UTF-8"}
            env["PYTHONDONTWRITEBYTECODE"] = "1"
            prctl(PR_SET_NO_NEW_PRIVS, 1)
            install_filter()
            os.execvpe(program, [program, *argv[1:]], env)
        except BaseException as err:  # noqa: BLE001 - report and leave the child now
            os.write(2, f"sandbox: {err}\n".encode())
        os._exit(126)
    os.close(spec["channel"])
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
