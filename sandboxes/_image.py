"""Build the sandbox image without a registry: debootstrap minbase + python3 → ``docker import``.

``build_image()`` is what ``agentrl sandbox image build`` (and ``python -m agentrl.sandboxes image
build``) runs. The debootstrapped root filesystem is cached under ``/var/cache/agentrl`` so a
rebuild (e.g. after ``docker rmi`` or a fresh data root) only re-imports it; an image already
tagged is reused unless ``force``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from ._config import DEFAULT_IMAGE, check_docker_socket, docker_host_from_env
from ._errors import BackendUnavailable

CACHE_DIR = Path("/var/cache/agentrl")
SUITE = "bookworm"
PACKAGES = ("python3",)
_COMPLETE = ".agentrl-rootfs-complete"
_PER_PACKAGE = re.compile(
    r"^I: (Retrieving|Validating|Extracting|Unpacking|Configuring) \S+\.\.\.$"
)
# Left out of the image: package caches and docs (about 40 MB), nothing a program needs.
_EXCLUDES = (
    "./var/cache/apt/archives/*.deb",
    "./var/lib/apt/lists/*",
    "./usr/share/doc/*",
    "./usr/share/man/*",
    "./usr/share/locale/*",
)


def _rootfs(suite: str, progress: Callable[[str], object], mirror: str | None) -> Path:
    """The cached debootstrap root, made (into a temp dir, then renamed) when missing."""
    root = CACHE_DIR / f"rootfs-{suite}-minbase-{'-'.join(PACKAGES)}"
    if (root / _COMPLETE).exists():
        progress(f"reusing cached root filesystem {root}")
        return root
    if shutil.which("debootstrap") is None:
        raise BackendUnavailable(
            "debootstrap is not installed (scripts/services start installs it)"
        )
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{root.name}.", dir=CACHE_DIR))
    cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", suite, str(work)]
    if mirror:
        cmd.append(mirror)
    progress(f"debootstrap {suite} (minbase + {', '.join(PACKAGES)}) into {work}")
    try:
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                if _PER_PACKAGE.match(line):
                    continue  # hundreds of per-package lines; keep the phases
                progress(f"  {line.rstrip()}")
        if proc.returncode != 0:
            raise BackendUnavailable(f"debootstrap failed with exit code {proc.returncode}")
        (work / _COMPLETE).write_text("ok\n")
        if root.exists():
            shutil.rmtree(root)
        work.rename(root)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return root


def build_image(
    tag: str = DEFAULT_IMAGE,
    *,
    progress: Callable[[str], object] = print,
    force: bool = False,
    docker_host: str | None = None,
    suite: str = SUITE,
    mirror: str | None = None,
) -> str:
    """Build (or reuse) the sandbox image ``tag`` and return its image id.

    ``progress`` receives one human-readable line per step. ``force`` re-imports even when the
    tag exists (the cached root filesystem is still reused; delete ``/var/cache/agentrl`` to
    debootstrap afresh)."""
    import docker  # the service and the local backend run without the SDK

    host = docker_host or docker_host_from_env()
    try:
        check_docker_socket(host)
    except OSError as exc:
        raise BackendUnavailable(
            f"Docker daemon at {host} unreachable ({exc}); start it with scripts/services start"
        ) from exc
    client = docker.DockerClient(base_url=host)
    try:
        try:
            client.ping()
        except docker.errors.DockerException as exc:
            raise BackendUnavailable(
                f"Docker daemon at {host} unreachable ({exc}); start it with scripts/services start"
            ) from exc
        if not force:
            try:
                image = client.images.get(tag)
            except docker.errors.ImageNotFound:
                pass
            else:
                progress(f"image {tag} already present ({image.short_id}); reusing it")
                return image.id
        root = _rootfs(suite, progress, mirror)
        repository, _, version = tag.rpartition(":")
        if not repository or "/" in version:
            repository, version = tag, "latest"
        progress(f"importing {root} as {repository}:{version}")
        excludes = [f"--exclude={pattern}" for pattern in (*_EXCLUDES, f"./{_COMPLETE}")]
        tar_cmd = ["tar", "-C", str(root), "--numeric-owner", *excludes, "-c", "."]
        with subprocess.Popen(tar_cmd, stdout=subprocess.PIPE) as tar:
            assert tar.stdout is not None
            reply = client.api.import_image(
                src=tar.stdout,
                repository=repository,
                tag=version,
                changes=['ENV PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"'],
                stream_src=True,
            )
        if tar.returncode != 0:
            raise BackendUnavailable(f"tar of {root} failed with exit code {tar.returncode}")
        image = client.images.get(f"{repository}:{version}")
        size_mb = (image.attrs.get("Size") or 0) / 1e6
        progress(f"built {repository}:{version} ({image.short_id}, {size_mb:.0f} MB)")
        del reply
        return image.id
    finally:
        client.close()
