"""The trackers' contract without a training run: the moved ``logging.tensorboard`` setting,
a tracker whose package is missing or whose store refuses the run (a ConfigError before
training), a tracker that fails while training (warned about, switched off, the others go on),
and MLflow's param limits."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time

import pytest
import yaml

from agentrl import ConfigError
from agentrl.loop._config import LoggingSection, load_train_config
from agentrl.loop._trackers import (
    MLFLOW_PARAM_VALUE_MAX,
    MlflowTracker,
    TensorBoardTracker,
    Trackers,
    check_trackers,
    mlflow_key,
    mlflow_params,
    open_trackers,
)


def test_the_old_tensorboard_flag_is_refused_with_its_new_home(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"logging": {"tensorboard": False}}))
    with pytest.raises(ConfigError, match=r"logging\.tensorboard.*moved to logging\.trackers"):
        load_train_config(path)
    with pytest.raises(ConfigError, match="wandb listed more than once"):
        load_train_config(path, ["logging={trackers: [wandb, wandb]}"])


@pytest.mark.parametrize(("tracker", "module"), [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_tracker_not_installed_names_its_extra(monkeypatch, tracker, module):
    monkeypatch.setitem(sys.modules, module, None)  # what Python does for a missing package
    with pytest.raises(ConfigError, match=rf"logging.trackers: {tracker}: .*agentrl\[{tracker}\]"):
        check_trackers(["tensorboard", tracker])


def test_a_store_that_refuses_the_run_is_a_config_error(tmp_path):
    logging = LoggingSection(trackers=["mlflow"], mlflow={"tracking_uri": "nosuchscheme://x"})
    with pytest.raises(ConfigError, match=r"logging\.mlflow: .*tracking_uri='nosuchscheme://x'"):
        open_trackers(logging, tmp_path, {"a": 1}, resume=False, purge_step=None)
    assert not (tmp_path / "trackers.json").exists()


def test_a_tracking_server_that_does_not_answer_is_refused_at_once(tmp_path):
    """MLflow's client retries a server that is down for minutes before it fails: the start
    is refused within the probe's bound instead, naming the URI, and nothing is recorded."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: refused
        logging = LoggingSection(trackers=["mlflow"], mlflow={"tracking_uri": uri})
        started = time.monotonic()
        with pytest.raises(
            ConfigError,
            match=rf"^logging\.mlflow: no tracking server answers at tracking_uri='{uri}' "
            r"within 10 s \(ConnectError: .*\): start it, or correct "
            r"logging\.mlflow\.tracking_uri$",
        ):
            open_trackers(logging, tmp_path, {"a": 1}, resume=False, purge_step=None)
    assert time.monotonic() - started < 10
    assert not (tmp_path / "trackers.json").exists()


def test_a_server_that_answers_is_mlflows_to_judge(tmp_path):
    """Any HTTP answer passes the probe (a proxy's 404 too): what the server then says about
    the run is MLflow's error, under the same ``logging.mlflow`` name."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()  # answers every request with 501
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        logging = LoggingSection(trackers=["mlflow"], mlflow={"tracking_uri": uri})
        with pytest.raises(ConfigError) as info:
            open_trackers(logging, tmp_path, {"a": 1}, resume=False, purge_step=None)
        assert str(info.value).startswith(
            f"logging.mlflow: could not start the MLflow run at tracking_uri='{uri}': "
        ), info.value
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_tracker_failing_mid_run_is_switched_off_and_the_others_go_on(
    tmp_path, monkeypatch, capsys
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "mlruns"
    logging = LoggingSection(
        trackers=["tensorboard", "mlflow"], mlflow={"tracking_uri": store.as_uri()}
    )
    trackers = open_trackers(logging, tmp_path, {"a": 1}, resume=False, purge_step=None)
    assert [type(t) for t in trackers.trackers] == [TensorBoardTracker, MlflowTracker]
    trackers.log_step(1, {"reward/mean": 0.5}, [0.5])
    assert trackers.flush(60)  # delivered on the trackers' thread
    shutil.rmtree(store)  # the store disappears under the run
    trackers.log_step(2, {"reward/mean": 0.75}, [0.75])
    trackers.log_step(3, {"reward/mean": 1.0}, [1.0])
    trackers.close()
    err = capsys.readouterr().err
    assert "warning: tracker mlflow failed at step 2" in err and err.count("warning") == 1
    assert list(trackers.failed) == ["mlflow"]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [
        (1, 0.5),
        (2, 0.75),
        (3, 1.0),
    ]
    assert set(json.loads((tmp_path / "trackers.json").read_text())) == {"mlflow", "run"}


def test_a_tracker_that_hangs_never_holds_the_training_loop(capsys):
    """A tracker's server that stops answering (MLflow then waits 120 s per try, 8 tries)
    delays its own points only: logging returns at once, and closing gives up after
    ``close_timeout_s`` with a warning, leaving the stuck call on its daemon thread."""
    release = threading.Event()
    seen: list[int] = []

    class Stuck:
        name = "stuck"

        def log_step(self, step, scalars, rewards) -> None:
            release.wait(30)
            seen.append(step)

        def log_interval(self, time_s, step, scalars) -> None:
            pass

        def close(self) -> None:
            pass

    trackers = Trackers([Stuck()], close_timeout_s=0.2)
    started = time.perf_counter()
    for step in range(1, 4):
        trackers.log_step(step, {"reward/mean": 1.0}, [])
    assert time.perf_counter() - started < 1.0
    assert not trackers.flush(0.1) and seen == []
    trackers.close()
    assert "warning: tracker stuck did not finish within 0.2 s" in capsys.readouterr().err
    release.set()  # the points still arrive, in order
    deadline = time.monotonic() + 10
    while seen != [1, 2, 3]:
        assert time.monotonic() < deadline, seen
        time.sleep(0.01)


def test_mlflow_params_are_flat_and_within_mlflow_limits():
    long = "x" * (3 * MLFLOW_PARAM_VALUE_MAX)
    params = mlflow_params(
        {"a": {"b": 1, "c": [1, 2], "d": {}, "e": None}, "long": long, "bad key!": "v"}
    )
    assert params["a.b"] == "1" and params["a.c"] == "[1, 2]" and params["a.d"] == "{}"
    assert params["a.e"] == "null" and params[mlflow_key("bad key!")] == "v"
    assert mlflow_key("bad key!").startswith("bad key__")
    assert len(params["long"]) == MLFLOW_PARAM_VALUE_MAX
    assert params["long"].startswith("x" * 1000) and "whole value in config.json" in params["long"]


def test_names_mlflow_cannot_take_never_share_a_key():
    """``a+b`` and ``a*b`` both became ``a_b`` (a reward breakdown's two keys logged into one
    metric, two values per step); a dotted key beside the nesting it reads as lost a param."""
    names = ["reward/a+b", "reward/a*b", "reward/a_b", "x" * 300, "x" * 301]
    keys = [mlflow_key(n) for n in names]
    assert len(set(keys)) == len(keys) and keys[2] == "reward/a_b", keys
    assert all(len(k) <= 250 and mlflow_key(n) == k for n, k in zip(names, keys, strict=True))
    params = mlflow_params({"a": {"b": 1}, "a.b": 2})
    assert sorted(params.values()) == ["1", "2"] and params["a.b"] == "1"


@pytest.mark.parametrize(
    "uri", ["sqlite:///mlflow.db", "postgresql+psycopg2://u@db/mlflow", "MySQL://db/mlflow"]
)
def test_an_mlflow_database_store_without_its_packages_is_refused_before_the_model(uri):
    """The mlflow extra is the client (mlflow-skinny): a database store failed only once the
    model and the learner had loaded, in MLflow's words about its model registry."""
    import importlib.util

    from agentrl.loop._trackers import check_mlflow_store

    logging = LoggingSection.model_validate(
        {"trackers": ["mlflow"], "mlflow": {"tracking_uri": uri}}
    )
    if importlib.util.find_spec("sqlalchemy") and importlib.util.find_spec("alembic"):
        check_mlflow_store(logging)  # the full MLflow is installed: MLflow's to judge
        return
    with pytest.raises(ConfigError, match="a database store needs the full MLflow"):
        check_mlflow_store(logging)
    for fine in ("http://127.0.0.1:5000", "file:///tmp/mlruns"):
        check_mlflow_store(LoggingSection.model_validate(
            {"trackers": ["mlflow"], "mlflow": {"tracking_uri": fine}}))  # fmt: skip


def test_mlflows_default_store_is_checked_too(monkeypatch, tmp_path):
    """No tracking_uri: MLflow 3's store is then ``sqlite:///mlflow.db``, which its client
    alone cannot open; the run failed after the model had loaded."""
    import importlib.util

    from agentrl.loop._trackers import check_mlflow_store

    monkeypatch.chdir(tmp_path)
    logging = LoggingSection.model_validate({"trackers": ["mlflow"]})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///tmp/mlruns")
    check_mlflow_store(logging)  # the environment names a folder store: fine
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    if importlib.util.find_spec("sqlalchemy") and importlib.util.find_spec("alembic"):
        check_mlflow_store(logging)
        return
    with pytest.raises(ConfigError, match="tracking_uri is not set, and MLflow's store is then"):
        check_mlflow_store(logging)


@pytest.fixture
def https_server(tmp_path):
    """An HTTPS server on loopback with a self-signed certificate (``openssl``), answering 200
    to every GET; yields (url, certificate file)."""
    import http.server
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("needs openssl (scripts/setup installs it with the test dependencies)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
         "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
         "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", cert
    finally:
        server.shutdown()
        server.server_close()


def test_the_mlflow_probe_verifies_tls_as_mlflow_is_told_to(https_server, monkeypatch):
    """A tracking server with a private CA: the start-up probe ignored MLflow's own TLS
    variables and called it a server that does not answer."""
    from agentrl.loop._trackers import _check_server_answers

    url, cert = https_server
    for name in ("MLFLOW_TRACKING_INSECURE_TLS", "MLFLOW_TRACKING_SERVER_CERT_PATH"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="answered, but its TLS certificate was not accepted"):
        _check_server_answers(url)
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(cert))
    _check_server_answers(url)
    monkeypatch.delenv("MLFLOW_TRACKING_SERVER_CERT_PATH")
    monkeypatch.setenv("MLFLOW_TRACKING_INSECURE_TLS", "true")
    _check_server_answers(url)


def test_rewards_a_histogram_cannot_bin_skip_the_histogram_not_the_tracker(tmp_path):
    """Rewards of ±1.7e308 (an env's) made TensorBoard's histogram raise ("The histogram is
    empty"), and the tracker was switched off for the rest of the run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from agentrl.loop._trackers import TensorBoardTracker, histogram_values

    assert histogram_values([1.7e308, -1.7e308]) is None
    assert histogram_values([float("nan"), float("inf")]) is None
    assert histogram_values([0.5, float("nan"), 1.0]).tolist() == [0.5, 1.0]
    tracker = TensorBoardTracker(tmp_path / "tb", None)
    tracker.log_step(1, {"reward/mean": 0.0}, [1.7e308, -1.7e308])
    tracker.log_step(2, {"reward/mean": 0.5}, [0.0, 1.0])
    tracker.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2]
    assert [e.step for e in acc.Histograms("reward/histogram")] == [2]


@pytest.mark.parametrize("recorded", [10**400, "yesterday", True, -5, float("nan"), None])
def test_a_run_start_that_is_no_time_starts_the_interval_axis_again(recorded):
    """``trackers.json``'s run start (the interval records' time origin) is someone else's
    file too: a 400-digit integer raised OverflowError on every resume."""
    from agentrl.loop._trackers import _started

    before = time.time()
    assert before <= _started({"run": {"started": recorded}}) <= time.time()
    assert _started({"run": {"started": 1.5e9}}) == 1.5e9
    ahead = time.time() + 3600  # a host whose clock was ahead: kept (points at 0 until then)
    assert _started({"run": {"started": ahead}}) == ahead
