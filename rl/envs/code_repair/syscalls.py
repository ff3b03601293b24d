"""The Linux calls the code sandbox makes that Python does not wrap: mounts (a bind mount made
read-only with all it holds), pivot_root, securebits, and a seccomp filter that keeps the
command out of user namespaces, the kernel's keyrings and io_uring.

The filter (classic BPF, installed after PR_SET_NO_NEW_PRIVS, inherited by every process the
command starts and kept across exec) refuses:
- unshare and clone with CLONE_NEWUSER, with EPERM: as root of a user namespace of its own, the
  command would hold every capability there, and with them mounts, namespaces and kernel code
  an unprivileged process never reaches;
- clone3, with ENOSYS: its flags lie in a struct the filter cannot read, and on ENOSYS glibc
  falls back to clone, whose flags it can;
- setns, with EPERM: no joining another namespace either;
- add_key, request_key and keyctl, with ENOSYS: keyrings are not namespaced, and the command
  inherits the caller's session keyring, so it could read the caller's keys and plant its own;
- io_uring_setup, io_uring_enter and io_uring_register, with ENOSYS: io_uring's operations run
  in the kernel without passing through this filter (container runtimes refuse it alike);
- any call of another ABI (i386 or x32 on x86_64), by killing the process: the numbers the
  filter checks are those of the native ABI only.
ENOSYS is what a kernel built without keyrings or io_uring answers, so a program that probes
for them falls back as it would there.

The filter names calls by number, and numbers differ between architectures: `ARCHES` holds them
for x86_64 and aarch64. On any other machine `arch()` raises, so the sandbox refuses to start
rather than run without the filter.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
PR_SET_SECUREBITS, SECBIT_NOROOT, SECBIT_NOROOT_LOCKED = 28, 1 << 0, 1 << 1
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x50000, 0x7FFF0000
BPF_LD_W_ABS, BPF_JEQ, BPF_JGE, BPF_JSET, BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x06
NR, ARCH, ARG0 = 0, 4, 16  # offsets in struct seccomp_data (ARG0: its low 32 bits)


@dataclass(frozen=True)
class Arch:
    """An architecture's audit tag and the numbers of the calls the sandbox makes or filters."""

    audit: int
    """AUDIT_ARCH_* of the native ABI, as seccomp reports it."""
    clone: int
    unshare: int
    setns: int
    pivot_root: int
    add_key: int
    request_key: int
    keyctl: int
    clone3: int = 435
    io_uring: tuple[int, ...] = (425, 426, 427)
    """io_uring_setup, io_uring_enter and io_uring_register."""
    foreign: int | None = None
    """Call numbers from this one up belong to another ABI on the same tag (x32 on x86_64)."""

    def not_implemented(self) -> tuple[int, ...]:
        """The calls the filter answers with ENOSYS."""
        return (self.clone3, self.add_key, self.request_key, self.keyctl, *self.io_uring)


ARCHES = {
    "x86_64": Arch(
        0xC000003E,
        clone=56,
        unshare=272,
        setns=308,
        pivot_root=155,
        add_key=248,
        request_key=249,
        keyctl=250,
        foreign=1 << 30,
    ),
    "aarch64": Arch(
        0xC00000B7,
        clone=220,
        unshare=97,
        setns=268,
        pivot_root=41,
        add_key=217,
        request_key=218,
        keyctl=219,
    ),
}

_libc = ctypes.CDLL(None, use_errno=True)


def arch() -> Arch:
    machine = os.uname().machine
    if machine not in ARCHES:
        raise OSError(
            errno.ENOSYS,
            f"the code sandbox's seccomp filter knows the system calls of {', '.join(ARCHES)}; "
            f"this machine is {machine}",
        )
    return ARCHES[machine]


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(
    source: str | None, target: str, flags: int, fstype: str | None = None, data: str = ""
) -> None:
    def enc(text: str | None) -> bytes | None:
        return text.encode() if text is not None else None

    ret = _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data or None))
    check(ret, f"mount {target}")


def unshare(flags: int) -> None:
    check(_libc.unshare(flags), "unshare")


def bind(source: int, target: str, read_only: bool) -> None:
    """Bind what the O_PATH descriptor `source` names at `target`, made for it; when
    `read_only`, read-only (and nosuid, nodev) with all that is mounted under it."""
    path = f"/proc/self/fd/{source}"
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    mount(path, target, MS_BIND | MS_REC)
    if read_only:
        for point, options in _mounts():
            if point == target or point.startswith(target + "/"):
                flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
                mount(None, point, flags | _mount_flags(options))


def _mounts() -> list[tuple[str, str]]:
    """(mount point, mount options) of each mount this process sees."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        # mountinfo escapes spaces as \040
        found.append((fields[4].encode().decode("unicode_escape"), fields[5]))
    return found


def _mount_flags(options: str) -> int:
    """The locked flags a read-only remount must keep (the kernel refuses to drop them)."""
    names = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    return sum(flag for name, flag in names.items() if name in options.split(","))


def prctl(option: int, value: int) -> None:
    check(_libc.prctl(option, value, 0, 0, 0), "prctl")


def pivot_to_cwd() -> None:
    """Make the working directory, a mount point, the root, and detach the old root: no path
    reaches it any more."""
    check(_libc.syscall(arch().pivot_root, b".", b"."), "pivot_root")
    check(_libc.umount2(b".", MNT_DETACH), "umount the old root")  # stacked on the new one
    os.chdir("/")


class _Instruction(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Instruction))]


def seccomp_program(native: Arch) -> list[tuple[int, int, int, int]]:
    """The filter's BPF, as (code, jump if true, jump if false, constant) instructions."""
    eperm, enosys = SECCOMP_RET_ERRNO | errno.EPERM, SECCOMP_RET_ERRNO | errno.ENOSYS
    program = [
        (BPF_LD_W_ABS, 0, 0, ARCH),
        (BPF_JEQ, 1, 0, native.audit),
        (BPF_RET, 0, 0, SECCOMP_RET_KILL_PROCESS),
        (BPF_LD_W_ABS, 0, 0, NR),
    ]
    if native.foreign is not None:
        program += [(BPF_JGE, 0, 1, native.foreign), (BPF_RET, 0, 0, SECCOMP_RET_KILL_PROCESS)]
    for number in native.not_implemented():
        program += [(BPF_JEQ, 0, 1, number), (BPF_RET, 0, 0, enosys)]
    return program + [
        (BPF_JEQ, 0, 1, native.setns),
        (BPF_RET, 0, 0, eperm),
        (BPF_JEQ, 1, 0, native.unshare),
        (BPF_JEQ, 0, 3, native.clone),
        (BPF_LD_W_ABS, 0, 0, ARG0),  # the flags of both
        (BPF_JSET, 0, 1, CLONE_NEWUSER),
        (BPF_RET, 0, 0, eperm),
        (BPF_RET, 0, 0, SECCOMP_RET_ALLOW),
    ]


def install_filter() -> None:
    """Install the filter on this process, and so on all it starts; needs no_new_privs set."""
    instructions = seccomp_program(arch())
    code = (_Instruction * len(instructions))(*instructions)
    program = _Program(len(instructions), code)
    check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0), "seccomp")
