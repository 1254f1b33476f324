"""The docker and gvisor backends against the real daemon: container settings, the exec path,
failures of the sandbox itself (container lost, exec hung), the orphan reaper, the image."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import anyio
import pytest

from agentrl.sandboxes import (
    BackendUnavailable,
    DockerConfig,
    GVisorConfig,
    PoolConfig,
    SandboxError,
    build_image,
    open_sandbox_pool,
)
from agentrl.sandboxes._config import DEFAULT_IMAGE, docker_host_from_env
from agentrl.sandboxes._docker import CAPABILITIES, ContainerBackend
from agentrl.sandboxes._types import InvalidRequest, RunRequest

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


def py(code: str, **kw) -> RunRequest:
    kw.setdefault("timeout_s", 5.0)
    return RunRequest(language="python", code=code, **kw)


@pytest.fixture
def client():
    import docker

    c = docker.DockerClient(base_url=docker_host_from_env(), timeout=60)
    yield c
    c.close()


async def test_container_is_locked_down(container_backend, client):
    async with container_backend.open(size=1) as pool:
        result = await pool.run(py("print('hi')"))
        assert result.status == "ok" and result.stdout == "hi\n"
        assert result.backend == container_backend.name
        attrs = client.containers.get(result.sandbox_id).attrs
        host = attrs["HostConfig"]
        assert host["ReadonlyRootfs"] is True
        assert host["NetworkMode"] == "none"
        assert host["CapDrop"] == ["ALL"] and sorted(host["CapAdd"]) == sorted(CAPABILITIES)
        assert "no-new-privileges" in host["SecurityOpt"]
        assert host["Memory"] == 512 * 2**20 and host["MemorySwap"] == 512 * 2**20
        assert host["NanoCpus"] == 10**9
        tmpfs = host["Tmpfs"]
        assert set(tmpfs) == {"/scratch", "/tmp", "/dev/shm"}
        assert "nr_inodes=65536" in tmpfs["/scratch"] and "nr_inodes=4096" in tmpfs["/dev/shm"]
        assert host["Sysctls"]["kernel.shmall"] == str(16 * 256)  # pages of shm_mb
        labels = attrs["Config"]["Labels"]
        assert labels["agentrl.sandbox"] == "1" and labels["agentrl.pool"] == pool._backend.pool_id
        if container_backend.name == "gvisor":
            assert host["Runtime"] == "runsc" and host["PidsLimit"] == 1024
        else:
            assert host["PidsLimit"] == 512
        names = {g.name: g.available for g in pool.guarantees()}
        assert names["network_isolation"] and names["readonly_root"]
        assert names["kernel_isolation"] is (container_backend.name == "gvisor")
        assert names["pids_limit"] and names["seccomp"] and names["kernel_objects"]
        assert not names["memory_hard_limit"]  # a gap, said plainly
        gvisor = container_backend.name == "gvisor"
        for gap in ("tmpfs_inodes", "posix_mqueue", "cpu_time_per_request"):
            assert names[gap] is not gvisor, gap


async def test_starting_containers_leaves_the_hosts_dev_null_alone(container_backend):
    """runsc hands a container's stdio files to its sandbox user: started with the host's
    /dev/null as stdin it chowned that to nobody (65534) on every start, and a host whose
    /dev/null changes breaks every other program there (the local backend's included)."""
    before = os.stat("/dev/null")
    async with container_backend.open(size=2) as pool:
        assert (await pool.run(py("print('hi')"))).status == "ok"
    after = os.stat("/dev/null")
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        before.st_uid,
        before.st_gid,
        before.st_mode,
    ), "the host's /dev/null changed"
    assert container_backend.name != "gvisor" or after.st_uid != 65534


async def test_program_identity_and_environment(container_backend):
    code = (
        "import os\n"
        "print(os.getuid(), os.getgid(), os.getcwd().startswith('/scratch/'))\n"
        "print(open('/proc/1/status').read().split('Uid:')[1].split()[0])\n"
    )
    async with container_backend.open(size=1) as pool:
        result = await pool.run(py(code))
        assert result.status == "ok", result
        ids, init_uid = result.stdout.split("\n")[:2]
        uid, gid, in_scratch = ids.split()
        assert 300_000 <= int(uid) < 350_000 and uid == gid and in_scratch == "True"
        assert init_uid == "65532"
        bash = await pool.run(RunRequest(language="bash", code="echo $((6*7)) $0", timeout_s=5))
        assert bash.status == "ok" and bash.stdout.startswith("42"), bash


async def test_files_and_stdin_reach_the_program(container_backend):
    code = "import sys\nprint(open('pkg/data.txt').read(), sys.stdin.read())"
    async with container_backend.open(size=1) as pool:
        result = await pool.run(py(code, files={"pkg/data.txt": "from-file"}, stdin="from-stdin"))
        assert result.status == "ok", result
        assert result.stdout == "from-file from-stdin\n"


async def test_the_supervisors_copy_of_stdin_is_not_the_programs_memory(container_backend):
    """The container meter counts the supervisor too: stdin was encoded after the request's
    baseline, so 12 MB of stdin to ``cat`` read as a 12 MB program (an ``oom`` under gVisor
    at ``memory_mb=16``)."""
    stdin = "x" * (12 << 20)
    request = RunRequest(language="bash", code="cat >/dev/null; echo read", stdin=stdin,
                         memory_mb=16)  # fmt: skip
    async with container_backend.open(size=1) as pool:
        result = await pool.run(request)
    assert result.status == "ok" and result.stdout == "read\n", result
    if container_backend.name == "docker":  # gVisor's meminfo moves with its own caches too
        assert result.peak_memory_mb is not None and result.peak_memory_mb < 8, result


async def test_memory_above_the_container_cap_is_clamped(container_backend):
    # the container has 512 MB: asking for 4 GB gets 448 MB, so 1 GB fails as oom in the program
    code = "x = bytearray(1024**3)\nprint('allocated')"
    async with container_backend.open(size=1) as pool:
        result = await pool.run(py(code, memory_mb=4096))
        assert result.status == "oom", result
        small = await pool.run(py("x = bytearray(200 * 1024**2)\nprint('ok')", memory_mb=4096))
        assert small.status == "ok", small


async def test_network_flag_is_refused(container_backend):
    async with container_backend.open(size=1) as pool:
        with pytest.raises(InvalidRequest, match="^network: "):
            await pool.run(py("print(1)", network=True))


async def test_concurrent_runs_use_distinct_sandboxes(container_backend):
    async with container_backend.open(size=3) as pool:
        results = await pool.run_batch([py("import time; time.sleep(0.3)") for _ in range(6)])
        assert [r.status for r in results] == ["ok"] * 6
        assert len({r.sandbox_id for r in results}) == 3
        assert pool.statistics().execs == 6


async def test_lost_container_gives_sandbox_error_then_pool_recovers(container_backend, client):
    async with container_backend.open(size=1) as pool:
        first = await pool.run(py("print(1)"))
        client.containers.get(first.sandbox_id).kill()
        lost = await pool.run(py("print(2)"))
        assert lost.status == "sandbox_error" and lost.error, lost
        with anyio.fail_after(60):
            again = await pool.run(py("print(3)", timeout_s=20))
        assert again.status == "ok" and again.sandbox_id != first.sandbox_id
        assert pool.statistics().failures == {"sandbox_error": 1}


@pytest.mark.parametrize("anyio_backend", ["trio", "asyncio"])
async def test_hung_exec_hits_the_host_deadline(client, anyio_backend):
    # A frozen container never answers: the host deadline (timeout + margin) ends the request.
    config = PoolConfig(backend=DockerConfig(exec_margin_s=1.0, memory_mb=512), size=1)
    async with open_sandbox_pool(config) as pool:
        first = await pool.run(py("print(1)"))
        container = client.containers.get(first.sandbox_id)
        start = time.monotonic()
        async with anyio.create_task_group() as tg:

            async def freeze() -> None:
                await anyio.sleep(0.3)
                await anyio.to_thread.run_sync(container.pause)

            tg.start_soon(freeze)
            # the program outlasts the pause's landing (a Docker API call) on a loaded machine
            hung = await pool.run(py("import time; time.sleep(3); print('late')", timeout_s=4.0))
        assert hung.status == "sandbox_error", hung
        assert "no answer" in hung.error or "stopped" in hung.error, hung
        assert time.monotonic() - start < 15  # the deadline: 4 s + 1 s of margin
        with anyio.fail_after(60):
            assert (await pool.run(py("print(2)"))).status == "ok"
    assert pool.statistics().recycles >= 1


@pytest.mark.parametrize("anyio_backend", ["trio", "asyncio"])
async def test_cancelled_run_recycles_the_container(anyio_backend):
    config = PoolConfig(backend=DockerConfig(memory_mb=512), size=1)
    async with open_sandbox_pool(config) as pool:
        with anyio.move_on_after(0.5):
            await pool.run(py("import time; time.sleep(30)", timeout_s=30))
        with anyio.fail_after(60):
            result = await pool.run(py("print('next')"))
        assert result.status == "ok"
        assert pool.statistics().recycles == 1


# Run as root beside the serve exec (inside the container, or on the host for runc): wait until
# the serve process has a child (a request is running), then kill it or write into its stream.
_SERVE_TOOL = r"""
import os, signal, sys, time

def serve_pid():
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != os.getpid():
            try:
                if b"serve_fds" in open(f"/proc/{p}/cmdline", "rb").read():
                    return int(p)
            except OSError:
                pass
    sys.exit("no serve process")

def running(pid):
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == pid:
                return True
        except OSError:
            pass
    return False

pid = serve_pid() if sys.argv[1] == "find" else int(sys.argv[1])
deadline = time.monotonic() + 30
while not running(str(pid)):
    assert time.monotonic() < deadline, "no request running"
    time.sleep(0.01)
if sys.argv[2] == "kill":
    os.kill(pid, signal.SIGKILL)
else:  # the serve stream's write end: writable, blocking, above stderr
    for fd in os.listdir(f"/proc/{pid}/fd"):
        info = open(f"/proc/{pid}/fdinfo/{fd}").read()
        flags = int(info.split("flags:")[1].split()[0], 8)
        if int(fd) > 2 and flags & 3 == os.O_WRONLY and not flags & os.O_NONBLOCK:
            out = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY)
            os.write(out, sys.argv[3].encode())
            break
    else:
        sys.exit("no serve stream found")
print("done", sys.argv[2])
"""


async def _serve_tool(client, container_id: str, action: str, data: str = "") -> None:
    """Run ``_SERVE_TOOL`` against the container's serve exec (there is exactly one)."""

    def run() -> tuple[int, str]:
        execs = client.api.inspect_container(container_id)["ExecIDs"]
        assert len(execs) == 1, execs
        runtime = client.api.inspect_container(container_id)["HostConfig"]["Runtime"]
        if action == "write" and runtime != "runsc":
            # runc: the serve process is a host process; it is not dumpable, so /proc/PID/fd
            # needs CAP_SYS_PTRACE, which no exec gets under no-new-privileges
            pid = client.api.exec_inspect(execs[0])["Pid"]
            argv = [sys.executable, "-c", _SERVE_TOOL, str(pid), action, data]
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            return proc.returncode, proc.stdout + proc.stderr
        # the docker CLI, not docker-py's exec_run: with stdin attached (a pipe: without one
        # runsc gets, and chowns, the host's /dev/null) exec_run never closes it, and under
        # gVisor its stream was seen to stay open after the exec had ended, hanging the test;
        # here stdin ends at once and the call has a deadline
        argv = ["docker", "-H", docker_host_from_env(), "exec", "-i", "-u", "0"]
        if action == "write":
            argv.append("--privileged")  # gVisor: CAP_SYS_PTRACE for /proc/PID/fd
        argv += [container_id, "python3", "-c", _SERVE_TOOL, "find", action, data]
        try:
            proc = subprocess.run(argv, input="", capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"the helper exec ({action}) did not end in 120 s") from exc
        return proc.returncode, proc.stdout + proc.stderr

    code, output = await anyio.to_thread.run_sync(run)
    # after a kill, or garbage written on the stream, the pool recycles the container, which
    # can happen before this exec has exited: the exec then ends with SIGKILL (137) too, once
    # it has said it is done, or the CLI finds no exit status to report (the container is gone)
    assert f"done {action}" in output, (code, output)
    if code not in (0, 137):
        import docker

        try:
            state = client.api.inspect_container(container_id)["State"]["Status"]
        except docker.errors.NotFound:
            state = "removed"
        assert state != "running", (code, output)


async def test_each_container_serves_every_request_through_one_exec(container_backend, client):
    async with container_backend.open(size=1) as pool:
        results = [await pool.run(py(f"print({i})")) for i in range(5)]
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(5)]
        assert len({r.sandbox_id for r in results}) == 1
        execs = client.api.inspect_container(results[0].sandbox_id)["ExecIDs"]
        assert len(execs) == 1, execs  # the health check and the five runs: one serve exec
        assert client.api.exec_inspect(execs[0])["Running"]


async def test_a_container_takes_one_request_at_a_time(container_backend):
    # The pool leases a sandbox to one request; a second exec on a busy sandbox is refused
    # (nothing sent) and the sandbox is recycled, the first request unharmed.
    async with container_backend.open(size=1) as pool:
        (sandbox,) = pool._live.values()
        results = {}

        async def run(name: str, request: RunRequest) -> None:
            results[name] = await sandbox.exec(request)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "first", py("import time; time.sleep(1); print('first')"))
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(run, "second", py("print('second')"))
        assert results["first"].status == "ok" and results["first"].stdout == "first\n"
        assert results["second"].status == "sandbox_error", results["second"]
        assert "already running" in results["second"].error
        assert not await sandbox.is_clean()


async def test_serve_process_killed_mid_request(container_backend, client):
    async with container_backend.open(size=1) as pool:
        first = await pool.run(py("print(1)"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(_serve_tool, client, first.sandbox_id, "kill")
            lost = await pool.run(py("import time; time.sleep(30); print('late')", timeout_s=40))
        assert lost.status == "sandbox_error", lost
        assert "serve process ended during the run" in lost.error, lost
        assert lost.sandbox_id == first.sandbox_id and lost.wall_s < 30
        with anyio.fail_after(60):
            again = await pool.run(py("print(3)", timeout_s=20))
        assert again.status == "ok" and again.stdout == "3\n", again
        assert again.sandbox_id != first.sandbox_id
        stats = pool.statistics()
        assert stats.recycles == 1 and stats.failures == {"sandbox_error": 1}


_PROBE = '{"processes": [], "n_processes": 0, "files": [], "n_files": 0, "ipc": 0}'


@pytest.mark.parametrize(
    "garbage, error",
    [
        ("not an answer\n", "unreadable answer"),
        # a well-formed answer (its stdout "forged", in base64 as the supervisor sends it),
        # but to the request before (the health check was seq 1)
        (
            '{"seq": 1, "result": {"status": "ok", "stdout": "Zm9yZ2Vk"}, "probe": '
            + _PROBE
            + "}\n",
            "answered request 1, not 3",
        ),
    ],
    ids=["garbage", "stale-seq"],
)
async def test_garbage_on_the_serve_stream_recycles(container_backend, client, garbage, error):
    async with container_backend.open(size=1) as pool:
        first = await pool.run(py("print(1)"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(_serve_tool, client, first.sandbox_id, "write", garbage)
            bad = await pool.run(py("import time; time.sleep(30); print('late')", timeout_s=40))
        assert bad.status == "sandbox_error" and error in bad.error, bad
        assert "forged" not in bad.stdout and bad.wall_s < 30
        with anyio.fail_after(60):
            again = await pool.run(py("print(3)", timeout_s=20))
        assert again.status == "ok" and again.stdout == "3\n", again
        assert again.sandbox_id != first.sandbox_id
        assert pool.statistics().recycles == 1


def _dead_owner() -> str:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return f"{socket.gethostname()}:{proc.stdout.strip()}:1"


async def test_orphan_reaper_removes_containers_of_dead_owners(client):
    labels = {"agentrl.sandbox": "1", "agentrl.pool": "orphan-test"}
    orphan = client.containers.create(
        DEFAULT_IMAGE,
        ["sleep", "60"],
        labels={**labels, "agentrl.owner": _dead_owner()},
        network_mode="none",
    )
    backend = ContainerBackend(DockerConfig())
    alive = client.containers.create(
        DEFAULT_IMAGE,
        ["sleep", "60"],
        labels={**labels, "agentrl.owner": backend.owner},
        network_mode="none",
    )
    try:
        await backend.start()
        try:
            listed = client.api.containers(all=True, filters={"label": "agentrl.pool=orphan-test"})
            ids = {c["Id"] for c in listed}
            assert orphan.id not in ids, "the orphan survived"
            assert alive.id in ids, "a container of a live process was reaped"
        finally:
            await backend.aclose()
    finally:
        for container in (orphan, alive):
            try:
                container.remove(force=True)
            except Exception:
                pass


async def test_unavailable_backends_say_why(client):
    with pytest.raises(BackendUnavailable, match="unreachable"):
        async with open_sandbox_pool(
            {"backend": {"type": "docker", "docker_host": "unix:///nonexistent.sock"}}
        ):
            pass
    with pytest.raises(BackendUnavailable, match="image build"):
        async with open_sandbox_pool(
            {"backend": {"type": "docker", "image": "agentrl-missing:none"}}
        ):
            pass
    with pytest.raises(BackendUnavailable, match="runtime"):
        async with open_sandbox_pool(PoolConfig(backend=GVisorConfig(runtime="no-such-runtime"))):
            pass


def test_image_build_reuses_the_tagged_image():
    lines: list[str] = []
    image_id = build_image(DEFAULT_IMAGE, progress=lines.append)
    assert image_id.startswith("sha256:") and any("reusing" in line for line in lines)


def test_image_build_command_runs_as_a_user_would():
    env = {**os.environ, "AGENTRL_DOCKER_HOST": docker_host_from_env()}
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.sandboxes", "image", "build"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert DEFAULT_IMAGE in proc.stdout


async def test_a_probe_that_cannot_look_fails_closed(container_backend, monkeypatch):
    """The leftover probe must list every writable dir: one it cannot list (here a dir that
    does not exist) leaves it blind, and a blind probe never hands a container out: not even
    the health check of a new one passes."""
    from agentrl.sandboxes import _docker

    for name in ("PROBE_DIRS", "GVISOR_PROBE_DIRS"):
        monkeypatch.setattr(_docker, name, [*getattr(_docker, name), "/nonexistent-dir"])
    with pytest.raises(SandboxError, match="unknown=.*/nonexistent-dir"):
        async with container_backend.open(size=1):
            pass


async def test_a_program_that_fills_the_container_is_the_one_killed(container_backend):
    """Memory no process's RSS shows (a memfd) past the request's memory_mb, which is clamped
    to the container's cap less the supervisor's share: the program ends as oom and the same
    container keeps serving (the supervisor was neither the sampler's nor the kernel's victim).
    Under gVisor the host sees one runsc sandbox: when the writes outrun the ~40 ms sampling
    past the cap, the kernel stops the whole container; that too is the program's oom."""
    code = (
        "import os\n"
        "while True:\n"  # memfds of 128 MB each (RLIMIT_FSIZE caps a file at 256 MB)
        "    fd = os.memfd_create('fill')\n"
        "    for _ in range(32):\n"
        "        os.write(fd, b'1' * (4 << 20))\n"
    )
    async with container_backend.open(size=1) as pool:
        result = await pool.run(py(code, memory_mb=4096, timeout_s=20))
        assert result.status == "oom", result
        again = await pool.run(py("print('same container')", timeout_s=20))
        assert again.status == "ok", again
        if container_backend.name == "gvisor" and result.peak_memory_mb is None:
            assert "OOM killer stopped it" in result.error, result
            assert result.wall_s < 10 and again.sandbox_id != result.sandbox_id, (result, again)
        else:
            assert 400 <= result.peak_memory_mb <= 512, result
            assert again.sandbox_id == result.sandbox_id, again


async def test_memory_past_the_cap_in_one_write_is_the_programs_oom(container_backend):
    """200 MB copied into a memfd per write: the third write takes the container past its cap
    (512 MB) inside one syscall, between two samples. Under runc the kernel's OOM killer takes
    the program and the container serves on; under gVisor it stops the whole runsc sandbox,
    which Docker reports as OOM-killed: the request is still the program's ``oom``, known
    within about a second (not at the request's deadline), and the pool replaces the container."""
    code = (
        "import os\n"
        "buf = b'1' * (200 << 20)\n"
        "for i in range(3):\n"
        "    os.write(os.memfd_create('f%d' % i), buf)\n"
        "print('survived')\n"
    )
    async with container_backend.open(size=1) as pool:
        result = await pool.run(py(code, memory_mb=4096, timeout_s=30))
        assert result.status == "oom" and "survived" not in result.stdout, result
        assert result.wall_s < 10, result
        # longer than gVisor's container checks' period (1 s): a new container answers it
        again = await pool.run(py("import time\ntime.sleep(1.5)\nprint('next')", timeout_s=20))
        assert again.status == "ok" and again.stdout == "next\n", again
        if container_backend.name == "gvisor":
            assert result.peak_memory_mb is None and result.signal == 9, result
            assert "OOM killer stopped it" in result.error, result
            assert again.sandbox_id != result.sandbox_id, again
        else:
            assert again.sandbox_id == result.sandbox_id, again
