"""The supervisor script, run the way the backends run it: a subprocess with JSON on stdin.

As root it drops each program to ``PROGRAM_UID`` (a uid no host process uses, not 65534: the
supervisor's sweep kills *every* process of the program's uid, and a host may run daemons as
nobody). Programs run under the system ``/usr/bin/python3`` (the uid cannot reach a venv under
/root). Every answer must be exactly one JSON line.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sandbox_procs import host_processes

SUPERVISOR = Path(__file__).resolve().parents[2] / "sandboxes" / "_supervisor.py"
PROGRAM_UID = 64_900
SYSTEM_PYTHON = "/usr/bin/python3"
MB = 1 << 20

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the supervisor drops to another uid: needs root"),
    pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason=f"{SYSTEM_PYTHON} is missing"),
]


def uid_processes(uid: int = PROGRAM_UID) -> list[str]:
    """Host processes (zombies included) whose real uid is ``uid``."""
    return host_processes(uid, uid + 1)


def answer(stdout: bytes) -> dict[str, Any]:
    lines = stdout.splitlines()
    assert len(lines) == 1, f"expected one JSON line, got {stdout[:2000]!r}"
    return as_text(json.loads(lines[0]))


def as_text(doc: dict[str, Any]) -> dict[str, Any]:
    """A supervisor's answer with stdout and stderr (base64 of the raw bytes on the wire) as
    the host shows them: UTF-8 text, an invalid byte replaced."""
    for key in ("stdout", "stderr"):
        doc[key] = base64.b64decode(doc[key], validate=True).decode("utf-8", "replace")
    return doc


def supervise(code: str, language: str = "python", *, scratch: Path, **fields: Any) -> dict:
    """Run one request through a fresh supervisor; the envelope's keys come from ``fields``
    (``uid``, ``cgroup``, ...), the rest is the request."""
    envelope_keys = {"uid", "gid", "cgroup", "max_processes", "rlimit_as_mb", "env"}
    envelope_keys.add("deny_syscalls")
    envelope: dict[str, Any] = {
        "uid": PROGRAM_UID,
        "gid": PROGRAM_UID,
        "cgroup": None,
        "scratch_root": str(scratch),
        "python": SYSTEM_PYTHON,
    }
    request: dict[str, Any] = {"language": language, "code": code, "timeout_s": 5.0}
    for key, value in fields.items():
        (envelope if key in envelope_keys else request)[key] = value
    envelope["request"] = request
    proc = subprocess.run(
        [sys.executable, str(SUPERVISOR)],
        input=json.dumps(envelope).encode(),
        capture_output=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return answer(proc.stdout)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A scratch root the program's uid can traverse (pytest's tmp_path is under a 0700 dir)."""
    path = Path(tempfile.mkdtemp(prefix="agentrl-test-supervisor-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_ok_with_measurements(scratch):
    r = supervise("print(6 * 7)", scratch=scratch)
    assert r["status"] == "ok" and r["exit_code"] == 0 and r["stdout"] == "42\n"
    assert r["stderr"] == "" and not r["stdout_truncated"] and r["error"] is None
    assert 0 < r["wall_s"] < 5 and r["cpu_s"] >= 0 and r["peak_memory_mb"] > 0
    assert list(scratch.iterdir()) == []  # the scratch dir is gone


@pytest.mark.parametrize(
    ("language", "code"), [("python", "import sys; sys.exit(3)"), ("bash", "echo hi; exit 3")]
)
def test_nonzero_exit(scratch, language, code):
    r = supervise(code, language, scratch=scratch)
    assert r["status"] == "nonzero_exit" and r["exit_code"] == 3 and r["signal"] is None


@pytest.mark.parametrize("code", ["while True: pass", "import time; time.sleep(1000)"])
def test_wall_timeout(scratch, code):
    start = time.monotonic()
    r = supervise(code, scratch=scratch, timeout_s=1.0)
    assert r["status"] == "timeout" and r["signal"] == 9
    assert 1.0 <= r["wall_s"] < 7 and time.monotonic() - start < 10


def test_cpu_time_limit(scratch):
    r = supervise("while True: pass", scratch=scratch, timeout_s=20.0, cpu_time_s=1.0)
    assert r["status"] == "timeout" and r["wall_s"] < 10
    assert r["cpu_s"] > 0.5  # rusage samples by ticks: below the limit the kernel enforced


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_limit(scratch, stream):
    code = f"import sys\nwhile True:\n    sys.{stream}.write('x' * 999 + '\\n')\n"
    r = supervise(code, scratch=scratch, output_limit_bytes=10_000)
    assert r["status"] == "output_limit" and r[f"{stream}_truncated"]
    assert r[stream] == ("x" * 999 + "\n") * 10


def test_huge_single_line(scratch):
    r = supervise("import sys; sys.stdout.write('a' * 10**8)", scratch=scratch, memory_mb=512)
    assert r["status"] == "output_limit" and r["stdout"] == "a" * MB and r["stdout_truncated"]


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(300 * 2**20)", "a = []\nwhile True:\n    a.append(' ' * 10**6)\n"],
)
def test_oom_under_rlimit_as(scratch, code):
    r = supervise(code, scratch=scratch, memory_mb=64)
    assert r["status"] == "oom" and "MemoryError" in r["stderr"]


def test_oom_through_a_memory_cgroup(scratch):
    """No RLIMIT_AS: the cgroup's OOM killer ends the program, counted in oom_control."""
    root = Path("/sys/fs/cgroup/memory")
    if not (root / "memory.limit_in_bytes").exists() or not os.access(root, os.W_OK):
        pytest.skip("no writable cgroup v1 memory controller")
    group = root / f"agentrl-test-supervisor-{os.getpid()}"
    group.mkdir()
    try:
        code = "a = []\nwhile True:\n    a.append(bytearray(8 * 2**20))\n"
        r = supervise(code, scratch=scratch, memory_mb=64, rlimit_as_mb=None, cgroup=[str(group)])
        assert r["status"] == "oom" and r["signal"] == 9, r
        assert 50 <= r["peak_memory_mb"] <= 80
        assert (group / "cgroup.procs").read_text() == ""
    finally:
        group.rmdir()


@pytest.mark.parametrize(
    ("code", "signal"),
    [("import os; os.kill(os.getpid(), 9)", 9), ("import ctypes; ctypes.string_at(0)", 11)],
)
def test_signal(scratch, code, signal):
    r = supervise(code, scratch=scratch)
    assert r["status"] == "signal" and r["signal"] == signal and r["exit_code"] is None


def test_stdin_is_fed(scratch):
    r = supervise("import sys; print(sys.stdin.read().upper())", scratch=scratch, stdin="abc")
    assert r["stdout"] == "ABC\n"
    r = supervise("import sys; print(repr(sys.stdin.read()))", scratch=scratch)
    assert r["stdout"] == "''\n"  # no stdin: EOF at once, never a hang


def test_huge_stdin_and_a_program_that_never_reads_it(scratch):
    data = "0123456789" * 800_000
    r = supervise("import sys; print(len(sys.stdin.read()))", scratch=scratch, stdin=data)
    assert r["status"] == "ok" and r["stdout"] == f"{len(data)}\n"
    r = supervise("print('bye')", scratch=scratch, stdin=data)
    assert r["status"] == "ok" and r["stdout"] == "bye\n"


def test_files_are_written_into_the_scratch_dir(scratch):
    code = (
        "import os, helper\n"
        "print(open('data/in.txt').read(), helper.X, os.getcwd().startswith(os.environ['HOME']))"
    )
    files = {"data/in.txt": "hello", "helper.py": "X = 5"}
    r = supervise(code, scratch=scratch, files=files)
    assert r["status"] == "ok" and r["stdout"] == "hello 5 True\n"


@pytest.mark.parametrize(
    "files",
    [
        {"../evil": "x"},
        {"/etc/evil": "x"},
        {"a/../../evil": "x"},
        {"a//b": "x"},
        {"./a": "x"},
        {"": "x"},
        {"a": "x", "a/b": "y"},
    ],
)
def test_bad_file_names_are_refused(scratch, files):
    r = supervise("print('ran')", scratch=scratch, files=files)
    assert r["status"] == "invalid_request" and "files[" in r["error"]
    assert r["stdout"] == "" and list(scratch.iterdir()) == []


def test_symlinks_are_not_followed_when_cleaning_up(scratch, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "keep.txt").write_text("precious")
    code = f"import os; os.symlink({str(outside)!r}, 'link'); os.symlink('/etc', 'etc')"
    r = supervise(code, scratch=scratch)
    assert r["status"] == "ok", r
    assert (outside / "keep.txt").read_text() == "precious"
    assert list(scratch.iterdir()) == []


def test_runs_as_the_uid_with_a_minimal_environment(scratch, monkeypatch):
    monkeypatch.setenv("AGENTRL_SUPERVISOR_SECRET", "s3cret")
    code = (
        "import os, json\n"
        "print(json.dumps([os.getuid(), os.getgid(), os.getgroups(), dict(os.environ)]))"
    )
    r = supervise(code, scratch=scratch)
    uid, gid, groups, env = json.loads(r["stdout"])
    assert (uid, gid, groups) == (PROGRAM_UID, PROGRAM_UID, [])
    assert set(env) <= {"PATH", "HOME", "LANG", "PYTHONDONTWRITEBYTECODE", "TMPDIR"}
    assert "s3cret" not in r["stdout"]


def test_daemons_are_killed_after_the_run(scratch):
    code = (
        "import os, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.write(w, str(os.getpid()).encode())\n"
        "        time.sleep(600)\n"  # keeps stdout open: the run must not wait for it
        "    os._exit(0)\n"
        "print(os.read(r, 32).decode())\n"
    )
    r = supervise(code, scratch=scratch, timeout_s=30.0)
    assert r["status"] == "ok" and r["wall_s"] < 5
    daemon = int(r["stdout"])
    with pytest.raises(ProcessLookupError):
        os.kill(daemon, 0)
    assert uid_processes() == []


@pytest.mark.parametrize("timeout", [False, True])
def test_a_process_named_with_bytes_that_are_not_utf8_is_swept(scratch, timeout):
    """``PR_SET_NAME`` takes any bytes and /proc shows them raw: the sweep read them as strict
    UTF-8 and the run ended as a sandbox_error, its output lost, its daemon and scratch dir
    left behind."""
    code = (
        "import ctypes, os, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    ctypes.CDLL(None).prctl(15, b'\\xff\\xfeevil', 0, 0, 0)\n"  # PR_SET_NAME
        "    os.write(w, str(os.getpid()).encode())\n"
        "    time.sleep(600)\n"
        "print(os.read(r, 32).decode(), flush=True)\n"
    )
    if timeout:
        code += "time.sleep(600)\n"
    r = supervise(code, scratch=scratch, timeout_s=2.0)
    assert r["status"] == ("timeout" if timeout else "ok"), r
    daemon = int(r["stdout"])
    with pytest.raises(ProcessLookupError):
        os.kill(daemon, 0)
    assert uid_processes() == [] and list(scratch.iterdir()) == []


def test_file_names_up_to_the_validated_limits_are_written(scratch):
    """The request's validation allows 1024 bytes and 255 per component; the supervisor
    refused any name over 255 characters in all, calling it a '..' component."""
    deep = "/".join(["d" * 60] * 16)[:1000]
    files = {"a" * 255 + "/" + "b" * 200: "long", deep: "deep"}
    r = supervise("import os; print(sum(len(f) for _, _, f in os.walk('.')))", scratch=scratch,
                  files=files)  # fmt: skip
    assert r["status"] == "ok" and r["stdout"] == "2\n", r
    for name, why in [
        ("a" * 256, "longer than 255 bytes"),
        ("é" * 128, "longer than 255 bytes"),
        ("/".join(["a"] * 17), "16 levels"),
        ("/".join(["a" * 200] * 6), "1024 bytes"),
    ]:
        r = supervise("print('ran')", scratch=scratch, files={name: "x"})
        assert r["status"] == "invalid_request" and why in r["error"], r
        assert r["stdout"] == "" and list(scratch.iterdir()) == []


def test_zombies_are_reaped(scratch):
    code = "import os\nfor _ in range(50):\n    if os.fork() == 0:\n        os._exit(0)\n"
    r = supervise(code, scratch=scratch)
    assert r["status"] == "ok"
    assert uid_processes() == []


def test_rlimit_nproc_bounds_a_fork_bomb(scratch):
    code = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "        n += 1\n"
        "except OSError:\n"
        "    print(n)\n"
    )
    r = supervise(code, scratch=scratch, max_processes=20)
    assert r["status"] == "ok" and int(r["stdout"]) < 20
    assert uid_processes() == []


def test_code_longer_than_an_argument_goes_through_a_file(scratch):
    code = "print('big')\n" + "# padding\n" * 20_000
    r = supervise(code, scratch=scratch)
    assert r["status"] == "ok" and r["stdout"] == "big\n"


def test_a_missing_interpreter_is_a_sandbox_error(scratch):
    envelope = {"request": {"language": "python", "code": "1"}, "python": "/nonexistent/python"}
    proc = subprocess.run(
        [sys.executable, str(SUPERVISOR)], input=json.dumps(envelope).encode(), capture_output=True
    )
    r = answer(proc.stdout)
    assert r["status"] == "sandbox_error" and "exec" in r["error"]


@pytest.mark.parametrize("data", [b"not json", b"[1, 2]", b'{"request": 5}'])
def test_bad_input_still_gives_one_line(data):
    proc = subprocess.run([sys.executable, str(SUPERVISOR)], input=data, capture_output=True)
    assert proc.returncode == 0
    assert answer(proc.stdout)["status"] in {"sandbox_error", "invalid_request"}


def test_serve_mode_answers_each_line(scratch):
    jobs = [
        {"request": {"language": "python", "code": f"print({i})"}, "python": SYSTEM_PYTHON,
         "uid": PROGRAM_UID, "scratch_root": str(scratch)}
        for i in range(3)
    ]  # fmt: skip
    data = "".join(json.dumps(job) + "\n" for job in jobs).encode()
    proc = subprocess.run(
        [sys.executable, str(SUPERVISOR), "--serve"], input=data, capture_output=True, timeout=60
    )
    results = [as_text(json.loads(line)) for line in proc.stdout.splitlines()]
    assert [r["stdout"] for r in results] == ["0\n", "1\n", "2\n"]


def test_runs_as_python_dash_c_source(scratch):
    envelope = {"request": {"language": "bash", "code": "echo $((6*7))"}, "uid": PROGRAM_UID}
    proc = subprocess.run(
        [SYSTEM_PYTHON, "-c", SUPERVISOR.read_text()],
        input=json.dumps(envelope).encode(),
        capture_output=True,
        timeout=60,
    )
    assert answer(proc.stdout)["stdout"] == "42\n"


def test_selftest():
    proc = subprocess.run(
        [sys.executable, str(SUPERVISOR), "--selftest"], capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout.decode()


# -- seccomp, keyrings, the OOM killer's choice ----------------------------------------------------
def syscall_probe(calls: str, also: str = "") -> str:
    """A program printing ``(succeeded, errno)`` for each ``(number, args)`` of ``calls``."""
    return (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"out = [(libc.syscall(nr, *args) >= 0, ctypes.get_errno()) for nr, args in ({calls})]\n"
        f"print(out{also})\n"
    )


_SYSCALLS = syscall_probe(  # the last: x32 getpid
    "(248, (b'user', b'k', b'v', 1, -3)), (249, (b'user', b'k', None, -3)), (250, (0, -3, 0)), "
    "(0x40000000 | 39, ())",
    also=", open('/proc/self/oom_score_adj').read().strip()",
)


# io_uring_setup(0, NULL), userfaultfd(user-mode-only | an unknown flag), perf_event_open(NULL,
# ...), bpf(BPF_MAP_CREATE, NULL, 0): each fails without the filter too, with an errno of its own
_KERNEL_SURFACE = syscall_probe(
    "(425, (0, None)), (323, (1 | 0x40000000,)), (298, (None, 0, -1, -1, 0)), (321, (0, None, 0))"
)


def _keyring_calls_work(stdout: str) -> bool:
    return stdout.startswith("[(True, 0), (True, 0), (True, 0)")


def _kernel_errnos(stdout: str) -> bool:
    """EFAULT or EINVAL, not EPERM (bpf may be refused by kernel.unprivileged_bpf_disabled)."""
    return all(errno not in (0, 1) for _, errno in eval(stdout.split("]")[0] + "]")[:3])


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64 syscall numbers")
@pytest.mark.parametrize(
    ("probe", "oom_adj", "unfiltered"),
    [(_SYSCALLS, " 1000", _keyring_calls_work), (_KERNEL_SURFACE, "", _kernel_errnos)],
    ids=["keyring-and-x32", "io_uring-userfaultfd-perf-bpf"],
)
def test_the_seccomp_filter_answers_eperm(scratch, probe, oom_adj, unfiltered):
    r = supervise(probe, scratch=scratch)
    assert r["status"] == "ok", r
    assert r["stdout"] == f"[(False, 1), (False, 1), (False, 1), (False, 1)]{oom_adj}\n", r
    # the filter is what refuses them: without it the kernel answers for itself
    r = supervise(probe, scratch=scratch, deny_syscalls=[])
    assert r["status"] == "ok" and unfiltered(r["stdout"]), r


_SOCKET_PROBE = (
    "import socket\n"
    "out = []\n"
    "for family in (40, 38, 17):  # AF_VSOCK, AF_ALG, AF_PACKET\n"
    "    for make in (socket.socket, socket.socketpair):\n"
    "        try:\n"
    "            make(family, socket.SOCK_STREAM)\n"
    "            out.append('created')\n"
    "        except OSError as exc:\n"
    "            out.append(exc.errno)\n"
    "a, b = socket.socketpair()\n"
    "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()\n"
    "print(out)\n"
)


@pytest.mark.parametrize("deny", [None, []], ids=["default", "empty-deny-list"])
def test_the_seccomp_filter_refuses_other_socket_families(scratch, deny):
    """The filter the supervisor installs itself (prctl, as in containers): EAFNOSUPPORT for
    socket and socketpair of any family but AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, whatever
    ``deny_syscalls`` names."""
    fields = {} if deny is None else {"deny_syscalls": deny}
    r = supervise(_SOCKET_PROBE, scratch=scratch, **fields)
    assert r["status"] == "ok" and r["stdout"] == "[97, 97, 97, 97, 97, 97]\n", r


def test_bash_code_starting_with_a_dash_is_code(scratch):
    r = supervise("--version 2>/dev/null; echo ran as code", "bash", scratch=scratch)
    assert r["status"] == "ok" and r["stdout"] == "ran as code\n", r
    r = supervise("-1\nprint('ran as code')", scratch=scratch)  # python's -c takes any code
    assert r["status"] == "ok" and r["stdout"] == "ran as code\n", r


@pytest.mark.parametrize("deny", [["no_such_call"], "keyctl", [5]])
def test_a_bad_deny_list_is_an_invalid_request(scratch, deny):
    r = supervise("print(1)", scratch=scratch, deny_syscalls=deny)
    assert r["status"] == "invalid_request" and "deny_syscalls" in r["error"], r


def test_the_program_does_not_share_the_supervisors_session_keyring(scratch):
    """A supervisor started under a session keyring holding a key (systemd's services, SSH
    logins): its programs get a fresh one and cannot even see that key in /proc/keys."""
    envelope = {
        "request": {"language": "python", "code": "print(open('/proc/keys').read())"},
        "uid": PROGRAM_UID,
        "scratch_root": str(scratch),
        "python": SYSTEM_PYTHON,
        "deny_syscalls": [],  # the fresh keyring alone keeps the key out of reach
    }
    under_a_keyring = (
        "import ctypes, os, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.syscall(250, 1, b'agentrl-test-service') > 0\n"  # JOIN_SESSION_KEYRING
        "assert libc.syscall(248, b'user', b'agentrl-service-secret', b's', 1, -3) > 0\n"
        "os.execv(sys.executable, [sys.executable, sys.argv[1]])\n"
    )
    if os.uname().machine != "x86_64":
        pytest.skip("x86_64 syscall numbers")
    proc = subprocess.run(
        [sys.executable, "-c", under_a_keyring, str(SUPERVISOR)],
        input=json.dumps(envelope).encode(),
        capture_output=True,
        timeout=60,
    )
    r = answer(proc.stdout)
    assert r["status"] == "ok", r
    assert "_ses" in r["stdout"] and "agentrl-service-secret" not in r["stdout"], r


# -- cpu_time_s over all processes, without cgroups ------------------------------------------------
def test_cpu_time_is_summed_over_the_programs_processes(scratch):
    code = (
        "import os\n"
        "for _ in range(4):\n"
        "    if os.fork() == 0:\n"
        "        while True:\n"
        "            pass\n"
        "os.wait()\n"
    )
    r = supervise(code, scratch=scratch, timeout_s=20.0, cpu_time_s=1.0)
    assert r["status"] == "timeout" and r["signal"] == 9, r
    # sampled every 50 ms on this host's CPUs (no quota here): past the limit by little, and by
    # what the four programs burn while a loaded machine stalls the supervisor (up to 1 s)
    limit = 1.0 + (0.05 + 1.0) * min(4, os.cpu_count() or 1)
    assert 1.0 <= r["cpu_s"] <= limit and r["wall_s"] < 10, r
    assert uid_processes() == []


def test_a_program_that_exits_just_past_cpu_time_s_is_a_timeout(scratch):
    """It passes the limit by 2 ms and exits before the next 50 ms check could see it: still
    over its CPU time, so a timeout (with what it printed)."""
    code = (  # os._exit: no interpreter teardown after the loop, so the window is ~2 ms
        "import os, time\nwhile time.process_time() < 0.802:\n    pass\n"
        "print('done', flush=True)\nos._exit(0)\n"
    )
    r = supervise(code, scratch=scratch, timeout_s=20.0, cpu_time_s=0.8)
    assert r["status"] == "timeout" and r["cpu_s"] > 0.8, r
    assert r["stdout"] in ("done\n", ""), r  # ended by the check (empty) or after it exited
    r = supervise(code.replace("0.802", "0.6"), scratch=scratch, timeout_s=20.0, cpu_time_s=0.8)
    assert r["status"] == "ok" and r["stdout"] == "done\n" and r["cpu_s"] <= 0.8, r


def test_without_cpu_time_s_the_wall_clock_decides(scratch):
    # the sum only applies to an explicit cpu_time_s: two busy processes run to the wall clock
    code = "import os\nos.fork()\nwhile True:\n    pass\n"
    r = supervise(code, scratch=scratch, timeout_s=1.5)
    assert r["status"] == "timeout" and r["wall_s"] >= 1.5, r


# -- the container's leftover probe (``_exec_wrapper``), against a real kernel ---------------------
_WRAPPER = SUPERVISOR.with_name("_exec_wrapper.py")
_PROBE_IPC = """
import ctypes, json, sys
wrapper = {"__name__": "agentrl_wrapper"}
exec(compile(open(sys.argv[1]).read(), "wrapper", "exec"), wrapper)
ipc = wrapper["SysvIpc"]()
libc = ctypes.CDLL(None, use_errno=True)
out = {"blind": sorted(ipc.blind)}
unknown = []
out["clean"] = ipc.leftovers(unknown)
libc.msgget(0, 0o1600), libc.shmget(0, 4096, 0o1600), libc.semget(0, 1, 0o1600)
out["left"] = ipc.leftovers(unknown)

class Blind(wrapper["SysvIpc"]):
    def count(self, kind):  # a kernel whose count never moves (cannot look)
        return 0

blind = Blind()
out["blind_kinds"] = sorted(blind.blind)
out["blind_left"] = blind.leftovers(unknown)
out["unknown"] = unknown
print(json.dumps(out))
"""


def test_the_ipc_probe_counts_through_syscalls_and_fails_closed_when_blind():
    """In a fresh IPC namespace: the canary proves the count works, three leftovers are
    counted; a count that cannot see the canary marks every kind unknown (the host recycles)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare(1) is missing")
    proc = subprocess.run(
        [unshare, "--ipc", sys.executable, "-c", _PROBE_IPC, str(_WRAPPER)],
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    out = json.loads(proc.stdout)
    assert out["blind"] == [] and out["clean"] == 0 and out["left"] == 3, out
    assert out["blind_kinds"] == ["msg", "sem", "shm"] and out["blind_left"] == 0, out
    assert [u.split(":")[0] for u in out["unknown"]] == [
        "sysvipc msg",
        "sysvipc shm",
        "sysvipc sem",
    ], out
