"""The sandbox's last step before model code runs: no capabilities, no-new-privs, a seccomp filter.

Stdlib only (ctypes): it runs inside the sandbox's launcher, which has no site-packages. The
filter is a classic BPF program handed to ``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)``: a
deny list that answers EPERM for system calls an ordinary program never needs and an escape
does (tracing or reading other processes, mounts and namespaces, the kernel keyring, anonymous
memory files that slip past the address-space limit, eBPF, io_uring and the AIO calls (whose
`fs.aio-max-nr` quota is host-wide: one run could take it all), kernel modules, clocks). A
socket of a family the sandbox does not need (vsock, which the network namespace does not
cover; packet, netlink, AF_ALG, ...) is refused with EAFNOSUPPORT: only `ALLOWED_FAMILIES`.
A call made through another ABI (i386 ``int 0x80``, x32) kills the process: the deny list
names x86_64 numbers only.
"""

import ctypes
import os
import struct

PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
# BPF opcodes: load word at absolute offset, jump if equal / greater or equal / bits set, return
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
OFFSET_NR, OFFSET_ARCH, OFFSET_ARG0 = 0, 4, 16
# clone flags that make namespaces (a new user namespace would give the code its capabilities back)
CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
X32_SYSCALL_BIT = 0x40000000

# machine -> (AUDIT_ARCH, syscall numbers by name). Only x86_64 for now: another machine's
# numbers differ, and a wrong table would block harmless calls or let harmful ones through.
# fmt: off
SYSCALLS = {
    "x86_64": (
        0xC000003E,
        {
            "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
            "pidfd_getfd": 438, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
            "unshare": 272, "setns": 308, "open_tree": 428, "move_mount": 429, "fsopen": 430,
            "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
            "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "userfaultfd": 323,
            "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298,
            "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
            "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
            "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163,
            "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
            "open_by_handle_at": 304, "name_to_handle_at": 303, "quotactl": 179, "syslog": 103,
            "iopl": 172, "ioperm": 173, "vhangup": 153, "sethostname": 170, "setdomainname": 171,
            "fanotify_init": 300, "lookup_dcookie": 212, "uselib": 134,
            "io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209,
            "io_cancel": 210, "io_pgetevents": 333,
        },
    ),
}
# fmt: on
CLONE, CLONE3 = {"x86_64": (56, 435)}.get(os.uname().machine, (None, None))
SOCKET, SOCKETPAIR = {"x86_64": (41, 53)}.get(os.uname().machine, (None, None))
ALLOWED_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6 (inside the run's network namespace)
EAFNOSUPPORT = 97


def supported() -> str | None:
    """Why the filter cannot be built on this machine, or None."""
    if os.uname().machine not in SYSCALLS:
        return f"seccomp: no system-call table for {os.uname().machine} (only {sorted(SYSCALLS)})"
    return None


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def build_filter() -> bytes:
    """The BPF program (a sequence of `struct sock_filter`)."""
    arch, numbers = SYSCALLS[os.uname().machine]
    eperm = SECCOMP_RET_ERRNO | 1
    prog = [
        _insn(LD_ABS, OFFSET_ARCH),
        _insn(JEQ, arch, jt=1),
        _insn(RET, SECCOMP_RET_KILL_PROCESS),
        _insn(LD_ABS, OFFSET_NR),
        _insn(JGE, X32_SYSCALL_BIT, jf=1),
        _insn(RET, SECCOMP_RET_KILL_PROCESS),
    ]
    for nr in sorted(numbers.values()):
        prog += [_insn(JEQ, nr, jf=1), _insn(RET, eperm)]
    # socket(family, ...) and socketpair(family, ...): only the allowed families; the family is
    # the first argument's low 32 bits (the jumps: skip the family checks for any other call)
    families = len(ALLOWED_FAMILIES)
    for nr in (SOCKET, SOCKETPAIR):
        prog += [_insn(JEQ, nr, jf=families + 3), _insn(LD_ABS, OFFSET_ARG0)]
        prog += [_insn(JEQ, f, jt=families - i) for i, f in enumerate(ALLOWED_FAMILIES)]
        prog += [_insn(RET, SECCOMP_RET_ERRNO | EAFNOSUPPORT), _insn(RET, SECCOMP_RET_ALLOW)]
    # clone3 passes its flags in memory that seccomp cannot read: ENOSYS makes libc use clone
    prog += [_insn(JEQ, CLONE3, jf=1), _insn(RET, SECCOMP_RET_ERRNO | 38)]
    prog += [_insn(JEQ, CLONE, jf=3), _insn(LD_ABS, OFFSET_ARG0), _insn(JSET, CLONE_NEW_ANY, jf=1)]
    prog += [_insn(RET, eperm), _insn(RET, SECCOMP_RET_ALLOW)]
    return b"".join(prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"sandbox: {what}: {os.strerror(errno)}")


def drop_bounding_set(libc) -> None:
    """Empty the capability bounding set: nothing this process starts can gain one (needs
    CAP_SETPCAP: call while still root)."""
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")


def clear_capabilities(libc) -> None:
    """Empty the effective, permitted and inheritable sets (for a process that stays uid 0;
    a change to another uid clears them by itself)."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    data = (ctypes.c_uint32 * 6)()  # {effective, permitted, inheritable} x 2, all zero
    _check(libc.capset(ctypes.byref(header), data), "capset")


def confine(libc) -> None:
    """no-new-privs, then the filter: from here on, this process and its children are bound."""
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no-new-privs")
    program = build_filter()
    buffer = ctypes.create_string_buffer(program)
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(buffer))
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")
