"""A seccomp filter for sandboxed commands: the syscalls agent code never needs fail with EPERM.

The BPF program is compiled by libseccomp (the system library bubblewrap's own users rely on, called through ctypes:
no Python binding is needed) and handed to `bwrap --seccomp FD`, which installs it just before running the command.
libseccomp's filter allows only the native architecture: 32-bit (i386) and x32 syscalls kill the process, so the
list cannot be bypassed through another syscall table. Where libseccomp is missing, sandboxes run without the filter
and `Sandbox` warns (`seccomp_program()` returns None, `seccomp_unavailable_reason()` says why).
"""

import ctypes
import ctypes.util
import errno
import functools
import os
import termios

DENIED_SYSCALLS = (
    # mounts, namespaces and roots: the sandbox's view of the filesystem is fixed by bwrap
    "mount", "umount", "umount2", "pivot_root", "chroot", "unshare", "setns", "fsopen", "fsconfig", "fsmount",
    "fspick", "move_mount", "open_tree", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    # the kernel, its modules, the clock and the machine
    "init_module", "finit_module", "delete_module", "create_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname",
    "setdomainname", "syslog", "quotactl", "quotactl_fd", "ioperm", "iopl", "uselib", "ustat", "sysfs", "_sysctl",
    "nfsservctl", "vhangup", "lookup_dcookie", "get_kernel_syms", "query_module",
    # other processes' memory, and kernel interfaces with a history of exploits
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key",
)  # fmt: skip
"""Syscalls that fail with EPERM in a sandbox (names unknown to this kernel's architecture are skipped)."""
DENIED_IOCTLS = (termios.TIOCSTI, getattr(termios, "TIOCLINUX", 0x541C))
"""ioctl requests that fail with EPERM: pushing input into a terminal, console control."""

_ACT_ALLOW = 0x7FFF0000
_ACT_ERRNO = 0x00050000
_CMP_MASKED_EQ = 7
_NR_SCMP_ERROR = -1


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


@functools.cache
def _libseccomp() -> ctypes.CDLL | str:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        return f"libseccomp is not installed ({e}; Debian package: libseccomp2)"
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp),
    ]  # fmt: skip
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise OSError(-rc, f"libseccomp {what}: {os.strerror(-rc)}")


def _add_rules(lib: ctypes.CDLL, ctx: int) -> None:
    deny = _ACT_ERRNO | errno.EPERM
    for name in DENIED_SYSCALLS:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number == _NR_SCMP_ERROR:
            continue
        rc = lib.seccomp_rule_add_array(ctx, deny, number, 0, None)
        if rc == -errno.EDOM:  # a pseudo-syscall that does not exist on this architecture
            continue
        _check(rc, f"rule for {name}")
    ioctl = lib.seccomp_syscall_resolve_name(b"ioctl")
    for request in DENIED_IOCTLS:
        cmp = _ArgCmp(1, _CMP_MASKED_EQ, 0xFFFFFFFF, request)
        _check(lib.seccomp_rule_add_array(ctx, deny, ioctl, 1, ctypes.byref(cmp)), f"ioctl rule {request:#x}")


@functools.cache
def seccomp_program() -> bytes | None:
    """The compiled BPF program (cached), or None where libseccomp is unavailable."""
    lib = _libseccomp()
    if isinstance(lib, str):
        return None
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise OSError(ctypes.get_errno(), "libseccomp seccomp_init failed")
    fd = os.memfd_create("slipstream-seccomp")
    try:
        _add_rules(lib, ctx)
        _check(lib.seccomp_export_bpf(ctx, fd), "export")
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
        lib.seccomp_release(ctx)


def seccomp_unavailable_reason() -> str | None:
    """Why sandboxes run without the filter here, or None when they get it."""
    lib = _libseccomp()
    return lib if isinstance(lib, str) else None
