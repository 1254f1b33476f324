"""The experiment trackers the ledger streams to (``logging.trackers``): TensorBoard, Weights &
Biases, MLflow — one interface, one implementation each.

Every tracker gets the same scalars under the same names (``reward/mean``,
``policy/kl_to_reference``, ``runtime/buffer_backlog`` …; see ``step_scalars``) at the
training step, the interval records (``interval/…``, ``interval_scalars``) at the seconds since
the run first started (``trackers.json`` keeps that time, so a resumed run goes on from it),
and the run's resolved config (W&B: the run config; MLflow: params, flattened with dots). The
ids of the tracker runs are kept in ``OUT/trackers.json`` so that ``--resume`` appends to the
same W&B run (``resume="allow"`` with its id) and the same MLflow run (its ``run_id``).

A tracker that cannot start (its package is not installed, a bad setting, a store that refuses
the run) stops the run before training with a ``ConfigError`` naming the setting and the extra
to install. A tracker that fails while training is switched off with a warning on stderr: the
ledger (the run's record of truth) and the other trackers go on, and training is never
stopped by a dashboard. Nor held up by one: the trackers run on their own thread (``Trackers``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import math
import os
import queue
import re
import secrets
import string
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from agentrl._config_file import read_json_value
from agentrl._errors import ConfigError, exception_chain
from agentrl._outfiles import write_file, writing

TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The module each tracker imports (its extra: ``_extras.missing_dependency_message``)."""
_EXTRAS = {"tensorboard": "train", "wandb": "wandb", "mlflow": "mlflow"}
IDS_FILE = "trackers.json"
"""Where a run keeps its tracker run ids (``OUT/trackers.json``)."""

# MLflow's limits (mlflow.utils.validation), fixed here so the params are cut the same way
# whatever version is installed
MLFLOW_PARAM_VALUE_MAX = 6000
MLFLOW_KEY_MAX = 250
_MLFLOW_BATCH_PARAMS = 100
_MLFLOW_BATCH_METRICS = 1000
_MLFLOW_KEY_BAD = re.compile(r"[^\w\-. /:]")


class Tracker(Protocol):
    """One experiment tracker (a sink of the ledger's scalars)."""

    name: str

    def log_step(self, step: int, scalars: dict[str, float], rewards: Sequence[float]) -> None:
        """One ledger record's scalars at training step ``step`` (and the step's rewards)."""

    def log_interval(self, time_s: float, step: int, scalars: dict[str, float]) -> None:
        """One interval record's scalars (``interval/…``), ``time_s`` seconds since the run
        first started (across resumes), while the learner is at step ``step``."""

    def close(self) -> None: ...


def check_trackers(names: Sequence[str]) -> None:
    """Refuse a tracker whose package is not installed, naming the extra that installs it."""
    from agentrl._extras import missing_dependency_message

    for name in names:
        module = TRACKER_MODULES[name]
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise  # the package is there but broken: its own error says why
            hint = missing_dependency_message(exc, "train") or (
                f"{module!r} is not installed: pip install 'agentrl[{_EXTRAS[name]}]'"
            )
            raise ConfigError(f"logging.trackers: {name}: {hint}") from None


_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")
"""The URI schemes of MLflow's database stores (a driver may follow: ``postgresql+psycopg2``)."""


def check_mlflow_store(logging: Any) -> None:
    """Refuse, before any model loads, an MLflow database store where MLflow's server-side
    packages are missing: the ``agentrl[mlflow]`` extra is the client (``mlflow-skinny``),
    which speaks to a tracking server or a folder store only."""
    if "mlflow" not in logging.trackers:
        return
    uri = logging.mlflow.tracking_uri
    if not uri:  # MLFLOW_TRACKING_URI, else MLflow's default (a database in MLflow 3)
        import mlflow

        uri = mlflow.get_tracking_uri()
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower()
    missing = [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
    if scheme in _DATABASES and missing:
        given = (
            f"logging.mlflow.tracking_uri {uri!r}"
            if logging.mlflow.tracking_uri
            else f"logging.mlflow.tracking_uri is not set, and MLflow's store is then {uri!r}"
        )
        raise ConfigError(
            f"{given}: a database store needs the full MLflow (pip install mlflow); the "
            "agentrl[mlflow] extra installs its client, which logs to a tracking server "
            "(tracking_uri: http://host:5000) or a folder (file:///path/mlruns)"
        )


CLOSE_TIMEOUT_S = 120.0
"""How long closing the trackers waits for the points still queued (a stuck tracker is left)."""


class Trackers:
    """The run's trackers; a tracker that raises is warned about once and switched off.

    The trackers are called on one worker thread, in order, never on the training loop's: a
    tracker whose server is gone or hangs (MLflow retries a refused connection for minutes,
    and waits 120 s for each answer) delays its own points, never the rollouts or the step.
    ``close`` waits for the points still queued at most ``close_timeout_s``."""

    def __init__(
        self,
        trackers: Sequence[Tracker],
        *,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
        started: float | None = None,
    ):
        """``started``: when the run first started (``time.time()``; its resumes keep it), the
        origin of the interval records' time axis."""
        self.trackers = list(trackers)
        self.started = time.time() if started is None else started
        self.failed: dict[str, str] = {}
        """Trackers switched off while training → the error that did it."""
        self.close_timeout_s = close_timeout_s
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        if self.trackers:
            self._worker = threading.Thread(
                target=self._drain, name="agentrl-trackers", daemon=True
            )
            self._worker.start()

    def log_step(self, step: int, scalars: dict[str, float], rewards: Sequence[float]) -> None:
        self._send(f"step {step}", lambda t: t.log_step(step, scalars, rewards))

    def log_interval(self, step: int, scalars: dict[str, float]) -> None:
        """An interval record's scalars, placed at the seconds since the run first started."""
        run_s = max(0.0, time.time() - self.started)
        self._send(f"{run_s:.0f} s", lambda t: t.log_interval(run_s, step, scalars))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every point queued so far is delivered (or failed); False on timeout."""
        if self._worker is None:
            return True
        done = threading.Event()
        self._queue.put(done.set)
        return done.wait(timeout_s)

    def close(self) -> None:
        """Deliver what is queued and close each tracker (at most ``close_timeout_s``)."""
        worker, self._worker = self._worker, None
        if worker is None:
            return
        self._queue.put(lambda: self._each("close", lambda t: t.close()))
        self._queue.put(None)
        worker.join(self.close_timeout_s)
        if worker.is_alive():  # a daemon thread: it does not keep the process alive
            names = ", ".join(t.name for t in self.trackers)
            print(
                f"warning: tracker {names} did not finish within {self.close_timeout_s:g} s; "
                "its last points may be missing (ledger.jsonl has them)",
                file=sys.stderr,
                flush=True,
            )
        else:
            self.trackers = []

    def _send(self, where: str, call: Callable[[Tracker], None]) -> None:
        if self._worker is not None:
            self._queue.put(lambda: self._each(where, call))

    def _drain(self) -> None:
        while (job := self._queue.get()) is not None:
            job()

    def _each(self, where: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # a dashboard never stops training
                self.trackers.remove(tracker)
                self.failed[tracker.name] = f"{type(exc).__name__}: {exc}"
                print(
                    f"warning: tracker {tracker.name} failed at {where} "
                    f"({type(exc).__name__}: {exc}); it is off for the rest of this run "
                    "(ledger.jsonl and the other trackers go on)",
                    file=sys.stderr,
                    flush=True,
                )


def read_tracker_ids(out: Path) -> dict[str, Any]:
    """The tracker runs ``OUT/trackers.json`` records (``{}`` when absent); ``ConfigError``
    naming the file when it is not a JSON object of objects."""
    path = out / IDS_FILE
    if not path.is_file():
        return {}
    ids = read_json_value(path, "--resume")
    if not isinstance(ids, dict) or not all(isinstance(v, dict) for v in ids.values()):
        raise ConfigError(
            f'--resume: {path} must be a JSON object of tracker runs ({{"wandb": {{...}}}}); '
            "restore it, or delete it to start new tracker runs"
        )
    return ids


def open_trackers(
    logging: Any,
    out: Path,
    config: dict[str, Any],
    *,
    resume: bool,
    purge_step: int | None,
) -> Trackers:
    """Start ``logging.trackers`` for the run in ``out`` (``config``: the resolved config as
    plain data). ``resume``: continue the tracker runs recorded in ``OUT/trackers.json``."""
    check_trackers(logging.trackers)
    ids_path = out / IDS_FILE
    ids = read_tracker_ids(out) if resume else {}
    ids["run"] = {"started": _started(ids)}
    opened: list[Tracker] = []
    try:
        for name in logging.trackers:
            if name == "tensorboard":
                opened.append(TensorBoardTracker(out / "tensorboard", purge_step))
            elif name == "wandb":
                opened.append(WandbTracker(logging.wandb, out, config, ids))
            else:
                opened.append(MlflowTracker(logging.mlflow, out, config, ids))
    except BaseException:
        Trackers(opened).close()
        raise
    try:
        with writing(ids_path):
            write_file(ids_path, json.dumps(ids, indent=2) + "\n")
    except BaseException:
        Trackers(opened).close()
        raise
    return Trackers(opened, started=ids["run"]["started"])


def _started(ids: dict[str, Any]) -> float:
    """When the run first started, as ``trackers.json`` recorded it (a time on this clock or
    another host's); now for a new run, one that predates the record, or a value that is no
    time."""
    started = (ids.get("run") or {}).get("started")
    if isinstance(started, bool) or not isinstance(started, int | float):
        return time.time()
    try:
        started = float(started)
    except OverflowError:
        return time.time()
    return started if math.isfinite(started) and started >= 0 else time.time()


def histogram_values(rewards: Sequence[float]) -> Any:
    """The step's rewards a histogram can bin (numpy float64): the finite ones, or None when
    none is left or their range overflows (±1e308 from an env: binning them raised, and the
    tracker was switched off for the rest of the run)."""
    import numpy as np

    values = np.asarray(rewards, dtype=np.float64)
    values = values[np.isfinite(values)]
    if not values.size:
        return None
    with np.errstate(over="ignore"):
        if not np.isfinite(values.max() - values.min()):
            return None
    return values


class TensorBoardTracker:
    """Event files in ``OUT/tensorboard`` at the training step; interval records in
    ``OUT/tensorboard/interval`` (a run of their own: another x axis, which a resume's
    ``purge_step`` must not cut) at whole seconds since the run first started."""

    name = "tensorboard"

    def __init__(self, folder: Path, purge_step: int | None) -> None:
        """``purge_step`` (a resumed run: the first step it will write again): TensorBoard
        discards the earlier run's events at steps >= it, so the steps redone after a resume
        are not shown twice."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder), purge_step=purge_step)
        self.folder = folder
        self.intervals: Any = None
        """The interval records' writer, made with the first of them."""

    def log_step(self, step: int, scalars: dict[str, float], rewards: Sequence[float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        values = histogram_values(rewards)
        if values is not None:
            self.writer.add_histogram("reward/histogram", values, step)
        self.writer.flush()

    def log_interval(self, time_s: float, step: int, scalars: dict[str, float]) -> None:
        if self.intervals is None:
            from torch.utils.tensorboard import SummaryWriter

            self.intervals = SummaryWriter(str(self.folder / "interval"))
        for tag, value in scalars.items():
            self.intervals.add_scalar(tag, value, int(time_s))
        self.intervals.flush()

    def close(self) -> None:
        self.writer.close()
        if self.intervals is not None:
            self.intervals.close()


class WandbTracker:
    """A W&B run (online, or offline files under ``logging.wandb.dir``, synced later with
    ``wandb sync``). Every scalar is plotted against ``train/step``; interval records carry
    ``train/step`` (the step the learner is at) and ``interval/run_s`` (seconds since the run
    first started)."""

    name = "wandb"

    def __init__(self, options: Any, out: Path, config: dict[str, Any], ids: dict) -> None:
        import wandb

        self._wandb = wandb
        known = ids.get("wandb") or {}
        run_id = known.get("id") or _new_id()
        folder = Path(options.dir) if options.dir else out
        folder.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=options.project,
                entity=options.entity,
                name=options.name or out.name,
                group=options.group,
                tags=list(options.tags) or None,
                dir=str(folder),
                mode=options.mode,
                id=run_id,
                resume="allow",
            )
        except Exception as exc:
            raise ConfigError(f"logging.wandb: could not start the W&B run: {exc}") from exc
        self.run.config.update(config, allow_val_change=True)
        self.run.define_metric("train/step")
        self.run.define_metric("*", step_metric="train/step")
        ids["wandb"] = {"id": run_id, "project": options.project, "entity": options.entity}

    def log_step(self, step: int, scalars: dict[str, float], rewards: Sequence[float]) -> None:
        row: dict[str, Any] = {**scalars, "train/step": step}
        values = histogram_values(rewards)
        if values is not None:
            row["reward/histogram"] = self._wandb.Histogram(values.tolist())
        self.run.log(row)

    def log_interval(self, time_s: float, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**scalars, "train/step": step, "interval/run_s": time_s})

    def close(self) -> None:
        self.run.finish()


MLFLOW_PROBE_S = 10.0
"""How long a tracking server may take to accept a connection and answer before the run's start
is refused (MLflow's own client retries a server that is down for minutes first)."""


_CA_VARIABLES = ("MLFLOW_TRACKING_SERVER_CERT_PATH", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


def _check_server_answers(uri: str | None) -> None:
    """Refuse an ``http(s)`` tracking URI whose server does not answer within
    ``MLFLOW_PROBE_S``: any HTTP answer (also 401 or 404 from a proxy) passes; other stores
    (a database, ``file:``, the default) are MLflow's to check."""
    if not uri or not uri.lower().startswith(("http://", "https://")):
        return
    import ssl

    import httpx

    # TLS as MLflow's client is told to do it (its own environment variables)
    verify: bool | ssl.SSLContext = False
    if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() not in ("true", "1"):
        try:
            import certifi

            cafile = next(  # as MLflow's client (requests) picks its certificate authorities
                (os.environ[name] for name in _CA_VARIABLES if os.environ.get(name)),
                certifi.where(),
            )
            verify = ssl.create_default_context(cafile=cafile)
            if client := os.environ.get("MLFLOW_TRACKING_CLIENT_CERT_PATH"):
                verify.load_cert_chain(client)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"logging.mlflow: the TLS files MLflow's environment names cannot be used "
                f"(MLFLOW_TRACKING_SERVER_CERT_PATH / MLFLOW_TRACKING_CLIENT_CERT_PATH: {exc})"
            ) from None
    try:
        httpx.get(uri.rstrip("/") + "/health", timeout=MLFLOW_PROBE_S, verify=verify)
    except httpx.HTTPError as exc:
        if any(isinstance(e, ssl.SSLError) for e in exception_chain(exc)):
            raise ConfigError(
                f"logging.mlflow: the tracking server at tracking_uri={uri!r} answered, but its "
                f"TLS certificate was not accepted ({exc}): set MLFLOW_TRACKING_SERVER_CERT_PATH "
                "to its CA bundle (or MLFLOW_TRACKING_INSECURE_TLS=true), as for MLflow itself"
            ) from None
        raise ConfigError(
            f"logging.mlflow: no tracking server answers at tracking_uri={uri!r} within "
            f"{MLFLOW_PROBE_S:g} s ({type(exc).__name__}: {exc}): start it, or correct "
            "logging.mlflow.tracking_uri"
        ) from None


class MlflowTracker:
    """An MLflow run at ``logging.mlflow.tracking_uri`` (any store MLflow supports: a tracking
    server, a database, a ``file:`` store). Metrics at the training step; interval records at
    whole seconds since the start (as TensorBoard). The config is logged as params (flattened
    with dots; a value longer than MLflow's limit is cut, and the whole config is the run's
    ``config.json`` artifact)."""

    name = "mlflow"

    def __init__(self, options: Any, out: Path, config: dict[str, Any], ids: dict) -> None:
        from mlflow.tracking import MlflowClient

        known = ids.get("mlflow") or {}
        uri = known.get("tracking_uri") or options.tracking_uri
        _check_server_answers(uri)
        try:
            self.client = MlflowClient(tracking_uri=uri)
            if known.get("run_id"):
                self.run_id = known["run_id"]
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                experiment = self.client.get_experiment_by_name(options.experiment)
                experiment_id = (
                    experiment.experiment_id
                    if experiment is not None
                    else self.client.create_experiment(options.experiment)
                )
                run = self.client.create_run(experiment_id, run_name=options.run_name or out.name)
                self.run_id = run.info.run_id
            self._log_config(config)
        except Exception as exc:
            raise ConfigError(
                f"logging.mlflow: could not start the MLflow run at tracking_uri={uri!r}: {exc}"
            ) from exc
        ids["mlflow"] = {"run_id": self.run_id, "tracking_uri": self.client.tracking_uri}

    def _log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = mlflow_params(config)
        logged = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:  # a resume with changed settings: MLflow params are immutable
            print(
                f"warning: tracker mlflow: params are write-once; the run keeps its first "
                f"value of {', '.join(changed)} (the run's config.yaml has the current ones)",
                file=sys.stderr,
                flush=True,
            )
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), _MLFLOW_BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=new[i : i + _MLFLOW_BATCH_PARAMS])
        self.client.log_dict(self.run_id, config, "config.json")

    def _log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), float(v), stamp, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), _MLFLOW_BATCH_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + _MLFLOW_BATCH_METRICS])

    def log_step(self, step: int, scalars: dict[str, float], rewards: Sequence[float]) -> None:
        self._log(scalars, step)

    def log_interval(self, time_s: float, step: int, scalars: dict[str, float]) -> None:
        self._log(scalars, int(time_s))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _new_id() -> str:
    """A W&B run id (8 lowercase letters and digits, as W&B makes its own)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def mlflow_key(name: str) -> str:
    """A metric or param name MLflow accepts (letters, digits, ``_ - . space / :``; at most
    250 characters). A name that has other characters (they become ``_``) or is longer ends in
    ``_`` and 8 hex digits of its hash, so two names never share a key (``a+b``, ``a*b``)."""
    key = _MLFLOW_KEY_BAD.sub("_", name)
    if key == name and len(key) <= MLFLOW_KEY_MAX:
        return key
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{key[: MLFLOW_KEY_MAX - 9]}_{digest}"


def mlflow_params(config: dict[str, Any]) -> dict[str, str]:
    """The config as MLflow params: nested keys joined with dots, lists and empty mappings as
    JSON, values cut to MLflow's 6000 characters (ending in a note that says so)."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
            return
        text = value if isinstance(value, str) else json.dumps(value)
        if len(text) > MLFLOW_PARAM_VALUE_MAX:
            note = f"… [{len(text)} characters; whole value in config.json]"
            text = text[: MLFLOW_PARAM_VALUE_MAX - len(note)] + note
        key = mlflow_key(prefix)
        if key in flat:  # a dotted key beside the nesting it reads as ({"a.b": 1, "a": {"b": 2}})
            key = mlflow_key(prefix + "\0")
        flat[key] = text

    walk("", config)
    return flat
