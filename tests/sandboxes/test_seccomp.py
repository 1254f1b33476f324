"""The supervisor's seccomp filter, run through a small classic-BPF interpreter: every
architecture it knows (not only the one the tests run on), without root or a kernel.

The kernel runs the same program on ``struct seccomp_data``: ``nr`` at offset 0, ``arch`` at 4,
the instruction pointer at 8, ``args[i]`` (64 bits each, little-endian here) from 16.
"""

from __future__ import annotations

import struct

import pytest

from agentrl.sandboxes import _supervisor
from agentrl.sandboxes._supervisor import DEFAULT_DENY, SOCKET_FAMILIES, seccomp_program

X86_64, I386, AARCH64 = 0xC000003E, 0x40000003, 0xC00000B7
ALLOW, EPERM, EAFNOSUPPORT = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 97
SOCKET = {X86_64: (41, 53), I386: (359, 360), AARCH64: (198, 199)}  # socket, socketpair
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
AF_PACKET, AF_ALG, AF_VSOCK = 17, 38, 40


def run_filter(program: bytes, arch: int, nr: int, args: tuple[int, ...] = ()) -> int:
    """What the filter answers for one call (the kernel's ``seccomp_run_filters`` on one
    filter), with the operations the supervisor emits; any other is a failure."""
    args = (*args, *[0] * (6 - len(args)))
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(a & (2**64 - 1) for a in args))
    code = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    for _ in range(len(code)):  # forward jumps only: at most one pass
        op, jt, jf, k = code[pc]
        if op == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif op in (0x15, 0x35):  # BPF_JMP | BPF_JEQ / BPF_JGE | BPF_K
            taken = acc == k if op == 0x15 else acc >= k
            pc += 1 + (jt if taken else jf)
        elif op == 0x06:  # BPF_RET | BPF_K
            return k
        else:
            raise AssertionError(f"unexpected BPF operation {op:#x} at {pc}")
    raise AssertionError("the program ran off its end")


@pytest.fixture(scope="module")
def program() -> bytes:
    return seccomp_program(DEFAULT_DENY)


@pytest.mark.parametrize("arch", [X86_64, I386, AARCH64], ids=["x86_64", "i386", "aarch64"])
@pytest.mark.parametrize("family", [AF_VSOCK, AF_ALG, AF_PACKET, 3, 0, 46, 2**31 + 1])
def test_other_socket_families_answer_eafnosupport(program, arch, family):
    for nr in SOCKET[arch]:
        assert run_filter(program, arch, nr, (family, 1, 0)) == EAFNOSUPPORT
        # the kernel reads the family as an int: high bits set change nothing it sees
        assert run_filter(program, arch, nr, ((1 << 32) | family, 1, 0)) == EAFNOSUPPORT


@pytest.mark.parametrize("arch", [X86_64, I386, AARCH64], ids=["x86_64", "i386", "aarch64"])
def test_unix_inet_inet6_and_netlink_sockets_are_allowed(program, arch):
    assert SOCKET_FAMILIES == (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)
    for nr in SOCKET[arch]:
        for family in SOCKET_FAMILIES:
            assert run_filter(program, arch, nr, (family, 1, 0)) == ALLOW
            assert run_filter(program, arch, nr, ((7 << 32) | family, 1, 0)) == ALLOW


def test_i386_socketcall_is_refused(program):
    """socketcall(call, args) hides the family behind a pointer the filter cannot read."""
    for call in (1, 8):  # SYS_SOCKET, SYS_SOCKETPAIR
        assert run_filter(program, I386, 102, (call, 0)) == EPERM
    assert run_filter(program, X86_64, 102, (0,)) == ALLOW  # getuid on x86_64


def test_the_other_rules_hold(program):
    assert run_filter(program, X86_64, 39) == ALLOW  # getpid
    assert run_filter(program, X86_64, 0x40000000 | 41, (AF_UNIX,)) == EPERM  # x32
    assert run_filter(program, 0x40000028, 281, (AF_UNIX,)) == EPERM  # arm (32-bit): unknown
    for arch, calls in _supervisor._SYSCALLS.items():
        for name in DEFAULT_DENY:
            assert run_filter(program, arch, calls[name]) == EPERM, (hex(arch), name)


def test_an_empty_deny_list_keeps_the_socket_family_rule():
    program = seccomp_program(())
    assert run_filter(program, X86_64, 250) == ALLOW  # keyctl: nothing named
    assert run_filter(program, X86_64, 41, (AF_VSOCK, 1, 0)) == EAFNOSUPPORT
    assert _supervisor._seccomp_for([]) is not None


def test_every_deny_name_still_fits_one_filter():
    """Jump offsets are 8 bits: the longest list the supervisor accepts still builds."""
    program = seccomp_program(tuple(_supervisor._SYSCALLS[X86_64]))
    assert run_filter(program, AARCH64, 198, (AF_VSOCK,)) == EAFNOSUPPORT
    assert run_filter(program, I386, 288) == EPERM
