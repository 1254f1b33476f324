"""The adversarial suite: every case against every backend (local, docker, gvisor).

Each case asserts the status, that the pool keeps serving (a trivial run right after returns ok),
and, through ``sandbox_backend.open()``, that nothing leaks once the pool is closed (containers of
the pool, processes of the sandbox uids, temp dirs, cgroups). Program timeouts are 1-3 s so the
suite takes a few minutes per backend. Reward hacks against the unit-test harness live with the
verifier tests.
"""

from __future__ import annotations

import os
import socket
import time

import anyio
import pytest

from agentrl.sandboxes import PoolBusy, SandboxPool
from agentrl.sandboxes._types import InvalidRequest, RunRequest, RunResult

pytestmark = pytest.mark.anyio

CASE_TIMEOUT_S = 90  # a hung case fails instead of hanging the suite
# gVisor may lose a container to a bomb (see GVisorConfig): a non-ok status, never ok.
GVISOR_EXTRA = {"sandbox_error"}


def py(code: str, **kw) -> RunRequest:
    kw.setdefault("timeout_s", 3.0)
    return RunRequest(language="python", code=code, **kw)


def sh(code: str, **kw) -> RunRequest:
    kw.setdefault("timeout_s", 3.0)
    return RunRequest(language="bash", code=code, **kw)


async def serves(pool: SandboxPool) -> None:
    result = await pool.run(py("print('still here')", timeout_s=20.0))
    assert result.status == "ok", result
    assert result.stdout == "still here\n"


def allowed(backend, statuses: set[str], gvisor_extra: set[str] = GVISOR_EXTRA) -> set[str]:
    return statuses | gvisor_extra if backend.name == "gvisor" else statuses


async def run_case(sandbox_backend, request: RunRequest, statuses: set[str], **pool_kw):
    """Open a pool, run ``request``, check its status and that the pool still serves."""
    with anyio.fail_after(CASE_TIMEOUT_S):
        async with sandbox_backend.open(**pool_kw) as pool:
            start = time.monotonic()
            result = await pool.run(request)
            elapsed = time.monotonic() - start
            assert result.status in allowed(sandbox_backend, statuses), result
            assert elapsed < request.timeout_s + 30, f"took {elapsed:.1f} s"
            await serves(pool)
    return result


# -- runaway programs ------------------------------------------------------------------------------
async def test_infinite_cpu_loop(sandbox_backend):
    result = await run_case(sandbox_backend, py("while True: pass", timeout_s=1.0), {"timeout"})
    assert result.wall_s < 10


async def test_sleep_forever(sandbox_backend):
    await run_case(
        sandbox_backend, py("import time; time.sleep(10_000)", timeout_s=1.0), {"timeout"}
    )


async def test_read_stdin_forever(sandbox_backend):
    # stdin ends (EOF) after the request's bytes: a program spinning on it ends by the deadline
    code = "import os\nwhile True:\n    os.read(0, 1)\n"
    await run_case(sandbox_backend, py(code, stdin="x", timeout_s=1.0), {"timeout"})


async def test_blocking_read_without_stdin(sandbox_backend):
    result = await run_case(
        sandbox_backend, sh("read line; echo got=$line"), {"ok", "nonzero_exit"}
    )
    assert "got=" in result.stdout or result.status == "nonzero_exit"


async def test_fork_bomb_python(sandbox_backend):
    code = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    await run_case(
        sandbox_backend,
        py(code, timeout_s=2.0),
        {"timeout", "oom", "signal", "nonzero_exit"},
    )


async def test_fork_bomb_bash(sandbox_backend):
    await run_case(
        sandbox_backend,
        sh(":(){ :|:& };:; sleep 5", timeout_s=2.0),
        {"timeout", "oom", "signal", "nonzero_exit", "ok"},
    )


async def test_memory_bomb(sandbox_backend):
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))\n"
    result = await run_case(sandbox_backend, py(code, memory_mb=128), {"oom"})
    assert result.stdout == ""


async def test_memory_bomb_single_allocation(sandbox_backend):
    result = await run_case(
        sandbox_backend, py("x = bytearray(4 * 1024**3)", memory_mb=128), {"oom"}
    )
    assert result.status == "oom" or result.status in GVISOR_EXTRA


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
async def test_runaway_output(sandbox_backend, stream):
    code = f"import sys\nwhile True:\n    sys.{stream}.write('x' * 1000 + '\\n')\n"
    result = await run_case(sandbox_backend, py(code, output_limit_bytes=10_000), {"output_limit"})
    assert len(getattr(result, stream)) <= 10_000
    assert getattr(result, f"{stream}_truncated")


async def test_huge_single_line(sandbox_backend):
    code = "import sys\nsys.stdout.write('a' * (64 * 1024 * 1024))\n"
    result = await run_case(
        sandbox_backend, py(code, output_limit_bytes=100_000, memory_mb=512), {"output_limit"}
    )
    assert result.stdout_truncated and len(result.stdout) <= 100_000


# -- the file system -------------------------------------------------------------------------------
async def test_disk_fill_scratch(sandbox_backend):
    code = (
        "import os\n"
        "block = b'0' * (1 << 20)\n"
        "n = 0\n"
        "try:\n"
        "    with open('fill.bin', 'wb') as f:\n"
        "        while n < 4096:\n"
        "            f.write(block); f.flush(); n += 1\n"
        "except OSError as exc:\n"
        "    print('stopped', type(exc).__name__)\n"
    )
    await run_case(
        sandbox_backend, py(code, timeout_s=3.0), {"ok", "nonzero_exit", "signal", "timeout"}
    )


async def test_disk_fill_dev_shm_is_not_seen_next(sandbox_backend):
    fill = (
        "import os\n"
        "try:\n"
        "    with open('/dev/shm/fill', 'wb') as f:\n"
        "        for _ in range(4096):\n"
        "            f.write(b'0' * (1 << 20)); f.flush()\n"
        "except OSError as exc:\n"
        "    print('stopped', type(exc).__name__)\n"
    )
    look = "import os\nprint(sorted(os.listdir('/dev/shm')) if os.path.isdir('/dev/shm') else [])"
    with anyio.fail_after(CASE_TIMEOUT_S):
        async with sandbox_backend.open(size=1) as pool:
            result = await pool.run(py(fill))
            assert result.status in {"ok", "nonzero_exit", "signal", "timeout"}, result
            after = await pool.run(py(look))
            assert after.status == "ok", after
            assert after.stdout.strip() == "[]", after


async def test_files_left_for_the_next_run_are_not_visible(sandbox_backend):
    plant = (
        "import os, pathlib\n"
        "pathlib.Path('left.txt').write_text('secret-from-run-1')\n"
        "for d in ('/tmp', '/dev/shm', os.path.expanduser('~')):\n"
        "    try:\n"
        "        pathlib.Path(d, 'left.txt').write_text('secret-from-run-1')\n"
        "    except OSError:\n"
        "        pass\n"
        "print(os.getcwd())\n"
    )
    look = (
        "import os, pathlib, sys\n"
        "cwd = sys.stdin.read().strip()\n"
        "dirs = ['.', '/tmp', '/dev/shm', os.path.expanduser('~'), cwd]\n"
        "print([str(pathlib.Path(d, 'left.txt')) for d in dirs\n"
        "       if d and pathlib.Path(d, 'left.txt').exists()])\n"
    )
    with anyio.fail_after(CASE_TIMEOUT_S):
        async with sandbox_backend.open(size=1) as pool:
            first = await pool.run(py(plant))
            assert first.status == "ok", first
            second = await pool.run(py(look, stdin=first.stdout))
            assert second.status == "ok", second
            assert second.stdout.strip() == "[]", second
            assert "secret-from-run-1" not in second.stdout


async def test_writing_to_system_dirs_fails(sandbox_backend):
    code = (
        "import os\n"
        "for path in ('/etc/agentrl-pwned', '/usr/bin/agentrl-pwned', '/bin/sh', '/root/x',\n"
        "             '/var/agentrl-pwned', '/opt/agentrl-pwned'):\n"
        "    try:\n"
        "        with open(path, 'a') as f:\n"
        "            f.write('pwned')\n"
        "        print('WROTE', path)\n"
        "    except OSError:\n"
        "        print('refused', path)\n"
    )
    result = await run_case(sandbox_backend, py(code), {"ok"})
    assert "WROTE" not in result.stdout, result.stdout
    for path in ("/etc/agentrl-pwned", "/usr/bin/agentrl-pwned", "/var/agentrl-pwned"):
        assert not os.path.exists(path)


@pytest.mark.parametrize(
    "name",
    ["../evil.py", "/etc/passwd", "a/../../evil", "a//b", "./a", "", "a\\b", "a\x00b"],
)
async def test_path_traversal_in_file_names_is_invalid(sandbox_backend, name):
    with anyio.fail_after(CASE_TIMEOUT_S):
        async with sandbox_backend.open(size=1) as pool:
            with pytest.raises(InvalidRequest, match=r"^files\["):
                await pool.run(py("print(1)", files={name: "x"}))
            await serves(pool)


async def test_symlinks_made_by_a_program_do_not_escape(sandbox_backend):
    make = (
        "import os\n"
        "os.symlink('/etc/passwd', 'passwd-link')\n"
        "os.symlink('/', 'root-link')\n"
        "os.makedirs('sub', exist_ok=True)\n"
        "os.symlink('/etc', 'sub/etc-link')\n"
        "print('made')\n"
    )
    check = "import os\nprint(os.path.isfile('/etc/passwd'), os.path.isdir('/etc'))"
    with anyio.fail_after(CASE_TIMEOUT_S):
        async with sandbox_backend.open(size=1) as pool:
            made = await pool.run(py(make, files={"sub/data.txt": "x"}))
            assert made.status == "ok", made
            after = await pool.run(py(check))
            assert after.stdout.strip() == "True True", after
    assert os.path.isfile("/etc/passwd")  # cleanup did not follow a link on the host


# -- network ---------------------------------------------------------------------------------------
async def test_network_egress_fails(sandbox_backend):
    code = (
        "import socket\n"
        "for host, port in (('1.1.1.1', 80), ('deb.debian.org', 80), ('10.0.0.1', 80)):\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=1).close()\n"
        "        print('CONNECTED', host)\n"
        "    except OSError:\n"
        "        print('blocked', host)\n"
    )
    result = await run_case(sandbox_backend, py(code), {"ok"})
    assert "CONNECTED" not in result.stdout
    assert result.stdout.count("blocked") == 3


async def test_bound_port_stays_private(sandbox_backend):
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    code = (
        "import socket, time\n"
        f"s = socket.socket(); s.bind(('0.0.0.0', {port})); s.listen()\n"
        "print('listening', flush=True)\n"
        "time.sleep(2)\n"
    )

    def host_can_connect() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    connected = []
    with anyio.fail_after(CASE_TIMEOUT_S):
        async with sandbox_backend.open(size=1) as pool:
            async with anyio.create_task_group() as tg:

                async def knock() -> None:
                    for _ in range(20):
                        connected.append(await anyio.to_thread.run_sync(host_can_connect))
                        await anyio.sleep(0.1)

                tg.start_soon(knock)
                result = await pool.run(py(code, timeout_s=3.0))
            assert result.status in {"ok", "nonzero_exit"}, result
            await serves(pool)
    assert not any(connected), "the host reached a port bound inside the sandbox"


# -- secrets ---------------------------------------------------------------------------------------
async def test_host_secrets_are_not_visible(sandbox_backend, monkeypatch, tmp_path):
    secret = f"agentrl-secret-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv("AGENTRL_TEST_SECRET", secret)
    host_file = tmp_path / "host-secret.txt"
    host_file.write_text(secret)
    code = (
        "import os, glob\n"
        "print(dict(os.environ))\n"
        "for path in ['/proc/self/environ', '/proc/1/environ', '/etc/shadow', '/root/.bashrc',\n"
        f"             {str(host_file)!r}, '/proc/1/cmdline']:\n"
        "    try:\n"
        "        print(path, open(path, 'rb').read()[:4000])\n"
        "    except OSError as exc:\n"
        "        print(path, 'refused', type(exc).__name__)\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        try:\n"
        "            print(pid, open(f'/proc/{pid}/environ', 'rb').read()[:4000])\n"
        "        except OSError:\n"
        "            pass\n"
    )
    result = await run_case(sandbox_backend, py(code), {"ok"})
    assert secret not in result.stdout and secret not in result.stderr
    assert "root:" not in result.stdout.split("/etc/shadow", 1)[1].split("\n", 1)[0]


# -- processes -------------------------------------------------------------------------------------
async def test_daemons_do_not_outlive_the_run(sandbox_backend):
    code = (
        "import os, subprocess, time\n"
        "subprocess.Popen(['setsid', 'nohup', 'sh', '-c', 'while :; do sleep 0.05; done'],\n"
        "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.closerange(0, 3)\n"
        "        while True:\n"
        "            time.sleep(0.05)\n"
        "    os._exit(0)\n"
        "print('spawned', flush=True)\n"
    )
    with anyio.fail_after(CASE_TIMEOUT_S):
        async with sandbox_backend.open(size=1) as pool:
            result = await pool.run(py(code))
            assert result.status == "ok", result
            sandbox_backend.assert_no_sandbox_processes(timeout_s=3.0)
            ps = await pool.run(
                py(
                    "import os\n"
                    "mine = {'1', str(os.getpid()), str(os.getppid())}  # init of a pid ns, us\n"
                    "print([p for p in os.listdir('/proc') if p.isdigit() and p not in mine\n"
                    "       and os.stat('/proc/' + p).st_uid == os.getuid()])"
                )
            )
            assert ps.status == "ok", ps
            assert ps.stdout.strip() == "[]", ps  # no daemon of an earlier run
            await serves(pool)


async def test_killing_its_own_supervisor(sandbox_backend):
    code = (
        "import os, signal\n"
        "for target in (os.getppid(), 1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "        print('killed', target, flush=True)\n"
        "    except OSError as exc:\n"
        "        print('refused', target, type(exc).__name__, flush=True)\n"
        "os.kill(-1, signal.SIGKILL)\n"
    )
    await run_case(sandbox_backend, py(code), {"ok", "nonzero_exit", "signal", "sandbox_error"})


async def test_writing_into_the_supervisors_stream(sandbox_backend):
    # A warm supervisor answers over its own stdin/stdout (the local backend's pipes, the
    # container backends' attached exec stream). The program holds nothing but its own three
    # pipes, and every fd of another process it manages to open gets a forged answer line: none
    # may reach the supervisor's answers, so the same sandbox keeps serving true results.
    forged = '{"seq": 2, "result": {"status": "ok", "stdout": "forged"}, "status": "ok"}\\n'
    code = (
        "import glob, os\n"
        "extra = []\n"
        "for fd in range(3, 1024):\n"
        "    try:\n"
        "        os.fstat(fd)\n"
        "        extra.append(fd)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('extra fds', extra)\n"
        "for path in glob.glob('/proc/[0-9]*/fd/*'):\n"
        "    if path.split('/')[2] in (str(os.getpid()), 'self'):\n"
        "        continue\n"
        "    try:\n"
        "        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)\n"
        "    except OSError:\n"
        "        continue\n"
        "    try:\n"
        f"        os.write(fd, b'{forged}' * 4)\n"
        "    except OSError:\n"
        "        pass\n"
        "    os.close(fd)\n"
        f"print('{forged}', end='')\n"
    )
    with anyio.fail_after(CASE_TIMEOUT_S):
        async with sandbox_backend.open(size=1) as pool:
            result = await pool.run(py(code))
            assert result.status == "ok", result
            assert result.stdout.startswith("extra fds []\n"), result
            for _ in range(2):
                again = await pool.run(py("print('true result')", timeout_s=20.0))
                assert again.status == "ok" and again.stdout == "true result\n", again
                assert again.sandbox_id == result.sandbox_id
            assert pool.statistics().recycles == 0


async def test_zombie_accumulation(sandbox_backend):
    code = (
        "import os, time\n"
        "for _ in range(100):\n"
        "    if os.fork() == 0:\n"
        "        os._exit(0)\n"
        "time.sleep(0.2)\n"
        "zombies = 0\n"
        "for p in os.listdir('/proc'):\n"
        "    try:\n"
        "        stat = open(f'/proc/{p}/stat').read() if p.isdigit() else ') ?'\n"
        "        zombies += stat.split(') ')[1][0] == 'Z'\n"
        "    except OSError:\n"
        "        pass\n"
        "print('zombies', zombies)\n"
    )
    with anyio.fail_after(CASE_TIMEOUT_S):
        async with sandbox_backend.open(size=1) as pool:
            for _ in range(3):
                result = await pool.run(py(code, timeout_s=10.0))  # forks are slow in gVisor
                assert result.status == "ok", result
            await serves(pool)
            sandbox_backend.assert_no_sandbox_processes(timeout_s=3.0)


# -- stdin -----------------------------------------------------------------------------------------
async def test_huge_stdin(sandbox_backend):
    data = "0123456789abcdef" * (8 * 1024 * 1024 // 16)  # 8 MiB
    code = "import sys\nprint(len(sys.stdin.buffer.read()))\n"
    result = await run_case(sandbox_backend, py(code, stdin=data, timeout_s=10.0), {"ok"})
    assert result.stdout.strip() == str(len(data))


async def test_program_exits_before_stdin_is_written(sandbox_backend):
    data = "x" * (4 * 1024 * 1024)
    result = await run_case(sandbox_backend, py("print('bye')", stdin=data), {"ok"})
    assert result.stdout == "bye\n"
    result = await run_case(sandbox_backend, sh("exit 3", stdin=data), {"nonzero_exit"})
    assert result.exit_code == 3


# -- capacity --------------------------------------------------------------------------------------
async def test_storm_beyond_capacity_gets_pool_busy(sandbox_backend):
    outcomes: list[RunResult | PoolBusy] = []

    async def one() -> None:
        try:
            outcomes.append(await pool.run(py("import time; time.sleep(0.5); print('done')")))
        except PoolBusy as exc:
            assert exc.retry_after_s > 0
            outcomes.append(exc)

    with anyio.fail_after(CASE_TIMEOUT_S):
        async with sandbox_backend.open(size=2, max_queue=2, queue_timeout_s=20.0) as pool:
            async with anyio.create_task_group() as tg:
                for _ in range(24):
                    tg.start_soon(one)
            busy = [o for o in outcomes if isinstance(o, PoolBusy)]
            done = [o for o in outcomes if isinstance(o, RunResult)]
            assert len(outcomes) == 24
            assert len(done) >= 4 and len(busy) >= 1, (len(done), len(busy))
            assert all(r.status == "ok" for r in done), [r for r in done if r.status != "ok"]
            stats = pool.statistics()
            assert stats.queued == 0 and stats.in_use == 0
            await serves(pool)
