"""``agentrl doctor``: what this host can do, with the reason for every gap."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
from typing import Any


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def checks() -> list[tuple[str, bool, str]]:
    """(name, ok, detail) rows; never raises."""
    rows: list[tuple[str, bool, str]] = []
    rows.append(("python", True, platform.python_version()))
    rows.append(("cpu", True, f"{os.cpu_count()} cores, {platform.machine()}"))
    try:
        import torch

        rows.append(("torch", True, torch.__version__))
        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            rows.append(("gpu", True, ", ".join(names)))
        else:
            rows.append(("gpu", False, "no CUDA device: the embedded engine and learner use CPU"))
    except Exception as exc:  # pragma: no cover - torch is a dependency
        rows.append(("torch", False, f"import failed: {exc}"))
    for dist, why in (
        ("transformers", "required"),
        ("triton", "the Triton kernels need it; CPU runs use the torch path"),
        ("deepspeed", "the learner needs it: pip install 'agentrl[train]'"),
        ("aiohttp", "agentrl serve / sandbox serve need it: pip install 'agentrl[serve]'"),
        ("gguf", "converting SmolLM2 from its GGUF needs it: pip install 'agentrl[gguf]'"),
    ):
        v = _version(dist)
        rows.append((dist, v is not None, v or f"not installed: {why}"))
    try:
        from ._models import list_models

        for info in list_models():
            detail = (
                str(info.path) if info.cached else f"not cached: agentrl models pull {info.name}"
            )
            rows.append((f"model {info.name}", info.cached, detail))
    except Exception as exc:
        rows.append(("models", False, f"cannot list: {exc}"))
    for tool, why in (
        ("docker", "the docker/gvisor sandbox backends"),
        ("runsc", "the gvisor sandbox backend"),
        ("bwrap", "the local sandbox backend"),
        ("chromium", "the HTML report browser test"),
    ):
        path = shutil.which(tool)
        rows.append((tool, path is not None, path or f"not found: needed for {why}"))
    # each sandbox backend and its guarantees follow in their own tables (agentrl.cli)
    return rows


def run_doctor(console: Any) -> int:
    from rich.table import Table

    table = Table("check", "ok", "detail")
    for name, ok, detail in checks():
        table.add_row(name, "[green]yes[/]" if ok else "[yellow]no[/]", detail)
    console.print(table)
    return 0
