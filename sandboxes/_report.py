"""What each sandbox backend can do on this host, without starting a pool (``agentrl doctor``)."""

from __future__ import annotations

import os
import shutil

from ._backend import Guarantee
from ._config import DEFAULT_DOCKER_HOST, DEFAULT_IMAGE, DockerConfig, GVisorConfig, LocalConfig


def _docker_facts(host: str) -> tuple[bool, str, set[str], bool]:
    """(reachable, detail, runtimes, image present) for the daemon at ``host``."""
    try:
        import docker
    except ImportError:
        return (
            False,
            "the docker SDK is not installed: pip install 'agentrl[sandbox]'",
            set(),
            False,
        )
    try:
        client = docker.DockerClient(base_url=host, timeout=5)
    except Exception as exc:
        return (
            False,
            f"no Docker daemon at {host} ({exc}); run scripts/services start",
            set(),
            False,
        )
    try:
        info = client.info()
        runtimes = set((info.get("Runtimes") or {}).keys())
        try:
            client.images.get(DEFAULT_IMAGE)
            image = True
        except Exception:
            image = False
        return True, f"Docker {info.get('ServerVersion', '?')} at {host}", runtimes, image
    except Exception as exc:
        return False, f"Docker daemon at {host} does not answer ({exc})", set(), False
    finally:
        client.close()


def host_report() -> list[tuple[str, bool, str, list[Guarantee]]]:
    """One row per backend: (name, available, why / how, guarantees on this host)."""
    from ._docker import ContainerBackend
    from ._hostcheck import local_guarantees, probe_host

    rows: list[tuple[str, bool, str, list[Guarantee]]] = []
    local = LocalConfig()
    facts = probe_host(local.uid_base if os.geteuid() == 0 else None)
    guarantees = local_guarantees(
        facts,
        cgroups=local.cgroups,
        max_processes=local.max_processes,
        cpus=local.cpus,
        sizes_mb={"/work": local.scratch_mb, "/tmp": local.tmp_mb, "/dev/shm": local.shm_mb},
    )
    ok = facts.bwrap is not None and facts.userns
    detail = facts.userns_detail if ok else (facts.userns_detail or "bubblewrap is not installed")
    rows.append(("local", ok, detail, guarantees))

    host = os.environ.get("AGENTRL_DOCKER_HOST", DEFAULT_DOCKER_HOST)
    reachable, detail, runtimes, image = _docker_facts(host)
    if reachable and not image:
        detail += f"; image {DEFAULT_IMAGE} missing: agentrl sandbox image build"
    rows.append(
        ("docker", reachable and image, detail, ContainerBackend(DockerConfig()).guarantees())
    )
    if not reachable:
        gdetail = detail
    elif "runsc" not in runtimes:
        which = shutil.which("runsc")
        gdetail = (
            "runsc is installed but not registered with this daemon (scripts/services start "
            "registers it with --platform=ptrace --network=none)"
            if which
            else "runsc is not installed (apt-get install runsc)"
        )
    else:
        gdetail = detail + "; runtime runsc (--platform=ptrace --network=none)"
    rows.append(
        (
            "gvisor",
            reachable and image and "runsc" in runtimes,
            gdetail,
            ContainerBackend(GVisorConfig()).guarantees(),
        )
    )
    return rows


def gaps(rows: list[tuple[str, bool, str, list[Guarantee]]]) -> list[tuple[str, str, str]]:
    """(backend, what, why) for each thing a backend does not guarantee on this host, from
    ``host_report()``'s rows: a backend that cannot run here, and every guarantee of one that
    can but is not given."""
    out = []
    for backend, available, detail, guarantees in rows:
        if not available:
            out.append((backend, "unavailable", detail))
            continue
        out += [(backend, g.name, g.detail) for g in guarantees if not g.available]
    return out
