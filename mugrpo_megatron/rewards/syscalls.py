"""The OS sandbox's system-call filter and keyring: what a program under test never needs, denied.

The filter is a seccomp program built with libseccomp (through ``pyseccomp``, its ctypes binding,
API-compatible with libseccomp's own Python module) and handed to bubblewrap (``--seccomp FD``),
which loads it just before it executes the program (and ``setpriv``, run as root). Everything
else is allowed. Denied, each answering EPERM unless said:

- the kernel keyrings: ``keyctl``, ``add_key``, ``request_key`` (keyrings are not namespaced: a
  program could read and clear the scorer's session keyring, or pass keys from one completion to
  the next in its user's keyring);
- memory the address-space limit does not see: System V shared memory, message queues and
  semaphores (``shmget``, ``shmat``, ``shmctl``, ``msgget``, ``semget``), ``memfd_create``,
  ``memfd_secret``;
- kernel interfaces of large attack surface: ``io_uring_*``, ``userfaultfd``,
  ``perf_event_open``, ``bpf``, ``ptrace``, ``process_vm_readv``/``writev``, the module and
  kexec calls, ``open_by_handle_at``, ``fanotify_init``, ``lookup_dcookie``;
- namespaces and mounts: ``unshare``, ``setns``, ``mount``, ``umount2``, ``pivot_root``, the new
  mount API (``fsopen`` ...), ``clone`` with any namespace flag, and ``clone3`` (ENOSYS: its
  flags sit in memory a filter cannot read; glibc falls back to ``clone``);
- ``socket`` of family AF_VSOCK (EAFNOSUPPORT): a channel to the host's hypervisor. The
  family is compared on the 32 bits the kernel reads (an ``int``): libseccomp compares all 64 of
  the register, and ``socket(0x1_0000_0028)`` made an AF_VSOCK socket past an equality test;
  every argument compare here is masked to the width the kernel reads;
- the page cache's state, a channel between runs (one program evicts or loads a file's pages,
  the next reads which are cached): ``mincore``, ``cachestat``, ``fadvise64``, ``readahead``,
  and ``preadv2`` / ``pwritev2`` with ``RWF_NOWAIT`` (which fail fast on an uncached page). The
  timing of an ordinary read still tells a cached page from one on disk: that channel remains,
  at the resolution of the program's clock and against a host that reads the same files;
- Linux AIO (``io_setup`` ...): a kernel interface of its own (its rings are kernel memory
  outside the address-space limit) that no program under test needs.

The scorer's session keyring is replaced for each run as well (``fresh_session_keyring``, in the
child before bwrap starts): even a call the filter missed finds an empty keyring of its own.
"""

from __future__ import annotations

import ctypes
import errno
import os
import tempfile

DENIED = (
    "keyctl", "add_key", "request_key",
    "shmget", "shmat", "shmctl", "msgget", "semget", "memfd_create", "memfd_secret",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "perf_event_open",
    "bpf", "ptrace", "process_vm_readv", "process_vm_writev", "init_module", "finit_module",
    "delete_module", "kexec_load", "kexec_file_load", "open_by_handle_at", "name_to_handle_at",
    "fanotify_init", "lookup_dcookie", "unshare", "setns", "mount", "umount2", "pivot_root",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    "swapon", "swapoff", "reboot", "acct", "quotactl",
    "mincore", "cachestat", "fadvise64", "fadvise64_64", "readahead",
    "io_setup", "io_submit", "io_getevents", "io_pgetevents", "io_destroy", "io_cancel",
)
"""System calls every program is refused (EPERM)."""
CLONE_NAMESPACES = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000,
                    "CLONE_NEWUTS": 0x04000000, "CLONE_NEWIPC": 0x08000000,
                    "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
                    "CLONE_NEWNET": 0x40000000, "CLONE_NEWTIME": 0x00000080}
"""linux/sched.h: ``clone`` with any of these is refused."""
AF_VSOCK = 40
INT_BITS = 0xFFFF_FFFF
"""What the kernel reads of an ``int`` argument (``socket``'s family)."""
RWF_NOWAIT = 0x0000_0008
"""linux/fs.h: a ``preadv2``/``pwritev2`` flag (its sixth argument, an ``int``)."""
KEYCTL_JOIN_SESSION_KEYRING = 1

_cache: bytes | None = None


class FilterUnavailable(RuntimeError):
    """libseccomp (or its binding) is missing; the message names the package."""


def _library():
    try:
        import pyseccomp
    except (ImportError, OSError, AttributeError) as e:  # no libseccomp.so: pyseccomp fails to load
        raise FilterUnavailable(
            f"the OS sandbox's system-call filter needs libseccomp (Debian/Ubuntu libseccomp2, "
            f"Fedora libseccomp) and the pyseccomp package ({type(e).__name__}: {e})") from None
    return pyseccomp


def filter_program() -> bytes:
    """The compiled filter (classic BPF, as ``seccomp_export_bpf`` writes it, which bwrap's
    ``--seccomp`` reads), built once a process."""
    global _cache
    if _cache is not None:
        return _cache
    sc = _library()
    f = sc.SyscallFilter(sc.ALLOW)
    arch = sc.system_arch()
    for name in DENIED:
        try:
            sc.resolve_syscall(arch, name)
        except Exception:  # noqa: BLE001 - a call this architecture or libseccomp lacks
            continue
        f.add_rule(sc.ERRNO(errno.EPERM), name)
    for flag in CLONE_NAMESPACES.values():
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.MASKED_EQ, INT_BITS, AF_VSOCK))
    for name in ("preadv2", "pwritev2"):
        f.add_rule(sc.ERRNO(errno.EPERM), name, sc.Arg(5, sc.MASKED_EQ, RWF_NOWAIT, RWF_NOWAIT))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        _cache = out.read()
    return _cache


def fresh_session_keyring():
    """A function for the child to call before exec (its library and system-call number looked
    up here, in the parent: nothing is loaded between fork and exec), which joins a new
    anonymous session keyring (``keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)``), so nothing of
    the scorer's session keyring is the program's. A kernel without keyrings (ENOSYS) has
    nothing to hide."""
    sc = _library()
    number = ctypes.c_long(sc.resolve_syscall(sc.system_arch(), "keyctl"))
    libc = ctypes.CDLL(None, use_errno=True)
    join, none = ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None)

    def call() -> None:
        if libc.syscall(number, join, none) < 0 and ctypes.get_errno() != errno.ENOSYS:
            raise OSError(ctypes.get_errno(), "keyctl(KEYCTL_JOIN_SESSION_KEYRING)")
    return call


def filter_fd() -> int:
    """A file descriptor holding the filter (an unlinked temporary file, at offset 0), for
    bwrap's ``--seccomp``; the caller closes it."""
    fd, path = tempfile.mkstemp(prefix="mugrpo-seccomp-")
    os.unlink(path)
    os.write(fd, filter_program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
