"""Read back what the trackers wrote in their offline / local-file modes: W&B's offline run
files (``OUT/wandb/offline-run-*/run-ID.wandb``: a LevelDB-style log of protobuf ``Record``s
behind a 7-byte ``:W&B`` header) and an MLflow file store (through ``MlflowClient``)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7  # checksum (4), length (2), type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_chunks(path: Path) -> list[bytes]:
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    out, pos, pending = [], 7, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            out.append(pending + chunk)
    return out


def wandb_offline_runs(folder: Path) -> list[dict[str, Any]]:
    """Each offline run under ``folder`` (in the order they were started): its id, its config
    and its history rows (``{name: value}``, W&B's own keys dropped)."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted(folder.glob("offline-run-*/run-*.wandb")):
        run: dict[str, Any] = {"config": {}, "history": []}
        for chunk in _wandb_chunks(path):
            record = pb.Record()
            record.ParseFromString(chunk)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                for item in record.run.config.update:
                    run["config"][item.key] = json.loads(item.value_json)
            elif kind == "config":
                for item in record.config.update:
                    run["config"][item.key] = json.loads(item.value_json)
            elif kind == "history":
                row = {}
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        row[key] = json.loads(item.value_json)
                run["history"].append(row)
        runs.append(run)
    return runs


def mlflow_run(tracking_uri: str, run_id: str) -> tuple[Any, dict[str, list[Any]]]:
    """The MLflow run and every metric's history (``{key: [Metric …]}`` in logging order)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    return run, {key: client.get_metric_history(run_id, key) for key in run.data.metrics}
