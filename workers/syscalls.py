"""The seccomp filter of every sandbox: system calls an agent never needs, refused (``bwrap --seccomp FD``).

Without it a sandboxed agent reached kernel state shared beyond its session: kernel keyrings are per uid
and a slot's uid is fixed, so a key stored with ``add_key`` by one session survived its DELETE and was
read (``request_key``/``keyctl``) by the next session placed in that slot; and ``unshare -Ur`` gave it
new user namespaces (a large kernel attack surface). The filter is modelled on Docker's default profile
(what it denies to a container without capabilities) and built with libseccomp (Debian package
``libseccomp2``) through the ctypes binding ``pyseccomp``, once per worker (``build_bpf``); each spawn
only copies the program into a memfd (``bpf_fd``).

Refused with ``EPERM`` (the default action stays ``ALLOW``, so everything else works as before: Python,
shells, subprocesses, threads):

* kernel keyrings: ``add_key``, ``keyctl``, ``request_key``;
* namespaces: ``unshare``, ``setns``, and ``clone`` with any ``CLONE_NEW*`` flag; ``clone3`` answers
  ``ENOSYS`` (its flags sit in memory a filter cannot read), so libc falls back to ``clone``;
* mounts: ``mount``, ``umount2``, ``pivot_root``, ``move_mount``, ``open_tree``, ``fsopen``, ``fsconfig``,
  ``fsmount``, ``fspick``, ``mount_setattr``;
* other processes' memory: ``ptrace``, ``process_vm_readv``/``writev``, ``kcmp``, ``pidfd_getfd``;
* kernel attack surface: ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_*``, ``kexec_load``,
  ``kexec_file_load``, module loading, ``open_by_handle_at``, ``fanotify_init``, ``lookup_dcookie``,
  ``uselib``, ``iopl``/``ioperm``, ``acct``, ``swapon``/``swapoff``, ``reboot``, ``quotactl``,
  ``syslog``, clock and host-name setters, ``vhangup``;
* ``personality`` except the values Docker allows (``0``, ``PER_LINUX32`` ``0x8``, ``UNAME26``
  ``0x20000``, both ``0x20008``, and the query ``0xffffffff``): no ``ADDR_NO_RANDOMIZE`` and the like.

Behind the filter, ``clear_uid_keyrings`` empties a slot uid's keyrings whenever its slot is reset (at
start and on every release), should a key ever get there.

Argument checks read the native calling convention (x86_64, aarch64: ``clone``'s flags are its first
argument).
"""

from __future__ import annotations

import errno
import functools
import os
from typing import Any

#: Debian package that provides libseccomp.so.2
LIBSECCOMP_PACKAGE = "libseccomp2"

DENIED = (
    "add_key", "keyctl", "request_key",
    "unshare", "setns",
    "mount", "umount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "create_module",
    "open_by_handle_at", "fanotify_init", "lookup_dcookie", "uselib", "iopl", "ioperm", "acct",
    "swapon", "swapoff", "reboot", "quotactl", "quotactl_fd", "syslog", "nfsservctl", "_sysctl",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname", "vhangup",
)
#: clone flags that make a new namespace (CLONE_NEWTIME collides with CSIGNAL in clone's first argument)
CLONE_NAMESPACE_FLAGS = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
                         "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
                         "CLONE_NEWNET": 0x40000000}
#: personality values allowed (Docker's default profile); all others are refused
PERSONALITY_ALLOWED = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

_BIT31 = 0x80000000


class SeccompUnavailable(RuntimeError):
    """libseccomp (or its binding) is missing or cannot build the filter; the message says what to install."""


def _personality_rules() -> list[tuple[int, int]]:
    """(mask, value) pairs, each one ``MASKED_EQ`` test on ``personality``'s 32-bit argument, whose union
    is exactly "not one of ``PERSONALITY_ALLOWED``" (a libseccomp rule tests an argument only once, so
    "x != a and x != b" is spelled as single-bit tests; the kernel reads only the low 32 bits)."""
    rules = []
    low_allowed = 0x8 | 0x20000  # with bit 31 clear, only these bits may be set
    for k in range(31):
        bit = 1 << k
        # bit 31 set and some lower bit clear: any value but the query 0xffffffff
        rules.append((_BIT31 | bit, _BIT31))
        # bit 31 clear and a bit outside 0x20008 set
        if not bit & low_allowed:
            rules.append((_BIT31 | bit, bit))
    return rules


@functools.cache
def build_bpf() -> bytes:
    """The filter as a BPF program (bytes, for ``bwrap --seccomp``). Built once per process and cached
    (it depends only on this module's rules and the machine's architecture): the local zygote builds it
    before forking, so a forked worker pays nothing for it (~5 ms of a cold start otherwise).

    Raises ``SeccompUnavailable`` when libseccomp or ``pyseccomp`` is missing or refuses the filter."""
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError, OSError) as e:  # pyseccomp raises RuntimeError without libseccomp
        raise SeccompUnavailable(f"libseccomp is not usable ({e}): install the Debian package "
                                 f"`{LIBSECCOMP_PACKAGE}` (apt-get install {LIBSECCOMP_PACKAGE})") from e
    try:
        f: Any = sc.SyscallFilter(defaction=sc.ALLOW)
        eperm = sc.ERRNO(errno.EPERM)
        for name in DENIED:
            try:
                f.add_rule(eperm, name)
            except (OSError, ValueError):  # a call this architecture does not have
                continue
        for flag in CLONE_NAMESPACE_FLAGS.values():
            f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        for mask, value in _personality_rules():
            f.add_rule(eperm, "personality", sc.Arg(0, sc.MASKED_EQ, mask, value))
        fd = os.memfd_create("substrate-seccomp")
        try:
            f.export_bpf(_Fd(fd))
            size = os.lseek(fd, 0, os.SEEK_END)
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)
    except OSError as e:
        raise SeccompUnavailable(f"libseccomp could not build the sandbox's filter: {e}") from e


class _Fd:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


def memfd_with(data: bytes, name: str) -> int:
    """A new descriptor (close-on-exec; pass it with ``pass_fds``) holding ``data`` from offset 0, for one
    bwrap option that reads a descriptor to its end (``--seccomp FD``, ``--args FD``), so each spawn needs
    its own. Raises OSError."""
    fd = os.memfd_create(name)
    try:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


def bpf_fd(program: bytes) -> int:
    """:func:`memfd_with` ``program``, for one ``bwrap --seccomp FD``."""
    return memfd_with(program, "substrate-seccomp")


_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
_KEYCTL_CLEAR = 7
_KEY_SPEC_USER_KEYRING, _KEY_SPEC_USER_SESSION_KEYRING = -4, -5


def clear_uid_keyrings(uid: int) -> bool:
    """Empty the kernel keyrings that belong to ``uid`` (its user and user-session keyrings), which
    outlive every process of that uid: a backstop behind the filter's ``add_key`` ban, for a slot's uid
    between two sessions. Needs root; runs in a forked child that becomes ``uid`` (a few ms; call it from
    a thread, not the event loop). True if the child cleared both (or the uid had none); False if it
    could not run (not root, unknown architecture, fork failed)."""
    nr = _SYS_KEYCTL.get(os.uname().machine)
    if nr is None or os.geteuid() != 0:
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    try:
        pid = os.fork()
    except OSError:
        return False
    if pid == 0:  # the child: only system calls, then _exit (no Python cleanup, no locks of other threads)
        code = 1
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            code = 0
            for ring in (_KEY_SPEC_USER_KEYRING, _KEY_SPEC_USER_SESSION_KEYRING):
                if syscall(ctypes.c_long(nr), ctypes.c_long(_KEYCTL_CLEAR), ctypes.c_long(ring)) != 0:
                    code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0
