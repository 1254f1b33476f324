"""The one YAML file of a training run (pydantic: every field documented, extras refused).

The file is also what ``agentrl rollout --config`` reads (its ``rollout`` section). Overrides
``--set dotted.key=value`` are applied to the parsed mapping before validation, values parsed as
YAML scalars (``--set algorithm.kl_coef=0.01 --set rollout.env_kwargs.levels=[0,1]``).

Every setting has one home: a key written where it used to live (``MOVED_SETTINGS``) is refused
with the path of its home. Derived values are computed when the file is read, never by the
validator rewriting the model: ``rollout.max_context_tokens`` defaults to
``train.micro_batch_tokens`` (a trajectory must fit one micro-batch).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import pydantic
import pydantic_core

from agentrl._config import (
    ROLLOUT_LEGACY_VALUES,
    NumbersNotBools,
    RolloutConfig,
    short_repr,
    validate_config,
)
from agentrl._config_file import ConfigSyntaxError, load_yaml
from agentrl._config_file import read_config_file as read_any_config_file
from agentrl._env import Split
from agentrl._errors import ConfigError, EngineError
from agentrl._types import GREEDY_BELOW
from agentrl.engine import EngineOptions
from agentrl.envs import SandboxSpec, sandbox_spec
from agentrl.sandboxes import PoolConfig
from agentrl.trainer import (
    AlgorithmConfig,
    DeepSpeedSection,
    OptimizerConfig,
    check_in_flight_objective,
)

MOVED_SETTINGS: dict[tuple[str, ...], str] = {
    ("env_kwargs",): "rollout.env_kwargs",
    ("algorithm", "group_size"): "rollout.group_size",
    ("logging", "tensorboard"): "logging.trackers (a list: [tensorboard], or [] for none)",
}
"""Settings that used to live in two places, at their old path → their one home."""


_YEAR_S = 365 * 24 * 3600
"""The longest collective timeout (``datetime.timedelta``, which torch takes, ends near 3e6
years; a year is already no limit)."""


class _Section(NumbersNotBools):
    model_config = pydantic.ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False
    )


class TrainSection(_Section):
    """How long and how much per step."""

    max_steps: int = pydantic.Field(100, ge=1)
    """Learner steps (each: rollout, update, publish one policy version)."""
    tasks_per_step: int = pydantic.Field(8, ge=1)
    """Training tasks per step; each is sampled ``rollout.group_size`` times."""
    micro_batch_tokens: int = pydantic.Field(4096, ge=16)
    """Positions per packed micro-batch. A trajectory must fit one: the rollout's
    ``max_context_tokens`` defaults to this and may not exceed it."""
    packing: bool = True
    """Sequence packing (no padding); False: the padded fallback."""
    refill_rounds: int = pydantic.Field(0, ge=0)
    """DAPO dynamic sampling with refill (Yu et al. 2025, §3.2; verl's ``max_num_gen_batches``):
    when groups whose rewards are all equal are dropped, sample up to this many extra rounds of
    fresh tasks until the step has ``tasks_per_step`` informative groups (0: only drop them).
    Needs ``algorithm.dynamic_sampling`` (on for dapo)."""
    share_prefix: bool = True
    """Compute a group's shared prompt once per micro-batch (needs packing and varlen
    attention; on calc-v0 the prompt is ~88% of every sequence)."""
    attention: Literal["varlen", "dense"] = "varlen"
    """varlen: each packed sequence attends on its own (no mask, Σ L² work); dense: one
    block-causal T × T mask per micro-batch (T² work and, on CPU, T² memory per layer)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward (less memory, ~30% more compute)."""
    logprob_chunk_size: int = pydantic.Field(1024, ge=1)
    """Tokens per chunk of the chunked log-prob (at most chunk × vocab logits at a time)."""
    kernels: Literal["auto", "triton", "torch"] = "auto"
    """Fused Triton kernels (agentrl.kernels) for the log-prob/entropy and the policy loss:
    auto uses them on a CUDA GPU and the torch paths on CPU; triton or torch force one."""
    seed: int = 0
    """Seed of the task order (shuffled per epoch) and of the training task list."""
    pass_threshold: float = 1.0
    """A trajectory with reward >= this counts as passed (pass rate)."""
    num_threads: int | None = pydantic.Field(None, ge=1)
    """Torch CPU threads of the learner (default: cores / local ranks)."""
    collective_timeout_s: float | None = pydantic.Field(None, gt=0, le=_YEAR_S)
    """Several ranks: the longest one collective operation may wait for the other ranks, so a
    hung or lost node ends the run after this long (an error, not a hang). It must exceed the
    ranks' largest difference in a step's rollout time (at most a year). None: PyTorch's
    default (30 min for gloo, 10 min for NCCL)."""
    max_steps_without_update: int = pydantic.Field(3, ge=0)
    """Stop the run (non-zero exit, ``stop_reason`` in the ledger) after this many consecutive
    steps that trained on nothing: every trajectory failed (e.g. the env's ``reward()`` raises)
    or dynamic sampling dropped every group. 0: never stop."""
    mode: Literal["sync", "async"] = "sync"
    """sync: each step samples with the newest policy (version lag 0; actors wait while the
    learner trains). async: actors keep sampling while the learner trains, up to
    ``max_version_lag`` versions ahead of it."""
    max_version_lag: int = pydantic.Field(1, ge=0)
    """async: the most policy versions a trained-on sample may lag the learner (k). Actors
    start the groups of step ``s + j`` (j ≤ k) while step ``s`` trains; a sample older than k
    versions when the learner takes it is discarded and counted, never trained on. 0 is the
    synchronous schedule."""
    partial_groups: Literal["wait", "drop", "fill"] = "wait"
    """Groups with failed members or unfinished at ``group_timeout_s``: wait (train on every
    group as it ends; failed members carry no reward), drop (train without them, counted in the
    ledger), fill (drop them and sample as many fresh tasks once, in their place)."""
    group_timeout_s: float | None = pydantic.Field(None, gt=0)
    """drop/fill: seconds the learner waits for a step's groups once it asks for them; groups
    still running then are cancelled and counted (``groups_timed_out``). None: no limit beyond
    each trajectory's own ``rollout.trajectory_timeout_s``."""


class CheckpointSection(_Section):
    """Loop checkpoints (DeepSpeed state + loop state, written atomically)."""

    dir: str | None = None
    """Folder of the checkpoints (default: OUT/checkpoints; a relative path is taken from
    OUT)."""
    every_steps: int = pydantic.Field(10, ge=0)
    """Save after every N steps (0: only at the end)."""
    keep: int = pydantic.Field(2, ge=1)
    """Newest checkpoints kept."""
    at_end: bool = True
    """Also save after the last step."""
    at_stop: bool = True
    """On Ctrl-C or SIGTERM (under torchrun: all ranks together), save the last complete step
    before exiting when no checkpoint holds it yet, so a preempted run resumes where it
    stopped."""


class WandbSection(_Section):
    """The Weights & Biases run (``logging.trackers: [wandb]``; ``pip install 'agentrl[wandb]'``).
    Credentials and the server come from W&B's own environment (``WANDB_API_KEY``,
    ``wandb login``)."""

    project: str = "agentrl"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user; default: the account's)."""
    name: str | None = None
    """Display name of the run (default: the name of the output folder)."""
    group: str | None = None
    """W&B group of related runs."""
    tags: list[str] = pydantic.Field(default_factory=list)
    """W&B tags of the run."""
    mode: Literal["online", "offline"] | None = None
    """online, or offline (files under ``dir``, uploaded later with ``wandb sync``); None:
    W&B's own choice (``WANDB_MODE``, else online)."""
    dir: str | None = None
    """Folder W&B writes its files in (default: OUT, i.e. OUT/wandb)."""


class MlflowSection(_Section):
    """The MLflow run (``logging.trackers: [mlflow]``; ``pip install 'agentrl[mlflow]'``)."""

    tracking_uri: str | None = None
    """Tracking store: a server (``http://host:5000``), a folder (``file:///path/mlruns``;
    MLflow 3 asks for ``MLFLOW_ALLOW_FILE_STORE=true`` to use one), or a database
    (``sqlite:///mlflow.db``: needs the full ``mlflow`` package, not the extra's
    ``mlflow-skinny``; refused at the start without it). None: MLflow's own default
    (``MLFLOW_TRACKING_URI``, …)."""
    experiment: str = "agentrl"
    """Experiment name (created when missing)."""
    run_name: str | None = None
    """Display name of the run (default: the name of the output folder)."""


class LoggingSection(_Section):
    """What the run writes besides the ledger."""

    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = pydantic.Field(
        default_factory=lambda: ["tensorboard"]
    )
    """Experiment trackers the ledger streams to, each with the same metric names at the
    training step and the run config attached: tensorboard (event files in OUT/tensorboard),
    wandb (``logging.wandb``), mlflow (``logging.mlflow``). A resumed run appends to the same
    tracker runs (their ids are kept in OUT/trackers.json). A tracker that fails while training
    is switched off with a warning; training goes on. []: none."""
    wandb: WandbSection = pydantic.Field(default_factory=WandbSection)
    """Weights & Biases settings (used when ``trackers`` lists wandb)."""
    mlflow: MlflowSection = pydantic.Field(default_factory=MlflowSection)
    """MLflow settings (used when ``trackers`` lists mlflow)."""

    @pydantic.field_validator("trackers")
    @classmethod
    def _once(cls, value: list[str]) -> list[str]:
        twice = sorted({name for name in value if value.count(name) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once")
        return value

    progress: bool = True
    """A rich progress bar with ETA (on a terminal) and one line per step."""
    trajectories: bool = True
    """Append every training trajectory to OUT/trajectories.jsonl."""
    interval_s: float = pydantic.Field(10.0, ge=0)
    """Seconds between the runtime's interval records (``runtime.jsonl`` and the trackers'
    ``interval/``: tokens generated and trained, buffer backlog, in-flight groups, version lag,
    idle fractions); 0: per step only."""
    dashboard_every_steps: int = pydantic.Field(0, ge=0)
    """Rewrite OUT/dashboard.html (the run's interactive page, as ``agentrl dashboard OUT``
    writes it) after every N steps and after the last one; 0: only on demand. Needs the
    ``dashboard`` extra (plotly). Each rewrite reads the run files in a worker thread, so its
    cost grows with ``trajectories.jsonl``: pick N so it stays small beside a step."""


class ServerSection(_Section):
    """Rollouts on inference servers instead of the colocated embedded engine: SGLang 0.5.17
    (or ``agentrl serve``) at ``urls``, weights published as safetensors snapshots loaded
    through ``/update_weights_from_disk`` under each new policy version."""

    urls: list[str] = pydantic.Field(default_factory=list)
    """Server base URLs (``http://host:port``); empty: the embedded engine in this process.
    A URL may be an ``sglang-router``: plain requests go through it, sessions and weight
    publication go to the workers it lists (docs/scaling.md). Each is given once."""

    @pydantic.field_validator("urls")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        """Checked now, not after the model has loaded: the engine's own rule."""
        from agentrl.engine._sglang_servers import server_urls

        try:
            if urls:
                server_urls(urls)
        except EngineError as exc:
            raise ValueError(str(exc)) from None
        return urls

    model: str | None = None
    """The policy's model id behind an ``sglang-router`` that serves several models (the
    ``model_id`` its ``GET /workers`` lists: the workers' ``--served-model-name``). Only those
    workers get the run's requests and weights; a router that lists several models is refused
    without it."""

    @pydantic.field_validator("model")
    @classmethod
    def _model(cls, model: str | None) -> str | None:
        if model is not None and not model.strip():
            raise ValueError("expected a model id (the router's model_id), got an empty string")
        return model

    snapshot_dir: str | None = None
    """Where snapshots are written; every server must read this path (default: OUT/weights)."""
    keep_snapshots: int = pydantic.Field(2, ge=1)
    """Newest snapshots kept (older ones are deleted after a publish)."""
    request_timeout_s: float = pydantic.Field(600.0, gt=0)
    """The limit of each request to a server: a generate call, opening a session, loading a
    published version. A server that stops answering (hung, paused) fails the request after
    this long: a generate call's failure is recorded on its trajectory, a weight update's stops
    the run."""


class EvalSection(_Section):
    """Held-out evaluation on the env's eval split."""

    every_steps: int = pydantic.Field(0, ge=0)
    """Evaluate after every N steps (0: never during training)."""
    at_start: bool = False
    """Evaluate the initial policy before step 1."""
    num_tasks: int = pydantic.Field(32, ge=1)
    """The first N tasks of the split, one sample each."""
    split: Split = "eval"
    """The split evaluated: ``eval`` (the env's held-out tasks) or ``train``, the two every
    environment's ``tasks(split)`` serves."""
    temperature: float = pydantic.Field(0.0, ge=0.0)
    """Sampling temperature for evaluation (0: greedy)."""


class TrainConfig(_Section):
    """A training run: model, environment, rollout, algorithm, optimizer, DeepSpeed,
    checkpointing, logging, evaluation."""

    model: str = "smollm2-135m"
    """A registered model name (``agentrl models list``) or an HF folder."""
    env: str = "calc-v0"
    """Environment id (``name-vN`` or ``module:name-vN``); its factory arguments are
    ``rollout.env_kwargs``."""
    rollout: RolloutConfig = pydantic.Field(default_factory=RolloutConfig)
    """How trajectories are sampled: samples per task, budgets, the env's arguments (the section
    ``agentrl rollout --config`` reads)."""
    algorithm: AlgorithmConfig = pydantic.Field(default_factory=AlgorithmConfig)
    """The RL algorithm (``agentrl.trainer.AlgorithmConfig``)."""
    optimizer: OptimizerConfig = pydantic.Field(default_factory=OptimizerConfig)
    """AdamW, clipping and the LR schedule (``agentrl.trainer.OptimizerConfig``)."""
    deepspeed: DeepSpeedSection = pydantic.Field(default_factory=DeepSpeedSection)
    """Merged key by key over the generated DeepSpeed config (ZeRO-3, AdamW, clipping); checked
    against DeepSpeed's own parser when the file is read."""
    engine: EngineOptions = pydantic.Field(default_factory=EngineOptions)
    """The embedded engine (the colocated rollout engine): batch size, KV cache, device..."""
    server: ServerSection = pydantic.Field(default_factory=ServerSection)
    """Inference servers for the rollouts (empty: the embedded engine)."""
    train: TrainSection = pydantic.Field(default_factory=TrainSection)
    """Steps, tasks per step, micro-batches, layout, seed."""
    checkpoint: CheckpointSection = pydantic.Field(default_factory=CheckpointSection)
    """Where and how often the loop is checkpointed."""
    logging: LoggingSection = pydantic.Field(default_factory=LoggingSection)
    """Trackers (TensorBoard, W&B, MLflow), progress, trajectory files."""
    eval: EvalSection = pydantic.Field(default_factory=EvalSection)
    """Held-out evaluation."""
    sandbox: SandboxSpec | None = None
    """Where an environment that runs code (``python-math-v0``, ``code-tests-v0``) runs it:
    ``local`` | ``docker`` | ``gvisor`` (an in-process pool of warm sandboxes),
    ``http(s)://HOST:PORT[,HOST:PORT…]`` (``agentrl sandbox serve``; the least busy address
    takes each request), a path to a pool file (.json, .yaml), or the pool's options as a
    mapping (``{backend: {type: docker}, size: 8}``). Opened once per run, shared by training
    and evaluation, closed at the end. Required by an environment that runs code, refused for
    one that takes no sandbox. ``agentrl rollout --sandbox`` wins over it."""

    @pydantic.field_validator("sandbox", mode="before")
    @classmethod
    def _sandbox(cls, value: Any) -> Any:
        """A backend name, service addresses or a file path, checked (the pool's options are
        validated with their field names in ``_read``)."""
        if value is None or isinstance(value, dict | PoolConfig):
            return value
        return sandbox_spec(value, where="")  # the error is located at `sandbox` already

    @pydantic.model_validator(mode="before")
    @classmethod
    def _read(cls, data: Any) -> Any:
        """Refuse settings at their old place; default ``rollout.max_context_tokens`` to
        ``train.micro_batch_tokens`` and, for an algorithm that compares a group of samples,
        ``rollout.group_size`` to ``TRAIN_GROUP_SIZE``. Returns a new mapping (the input is not
        modified)."""
        if not isinstance(data, dict):
            return data
        errors = []
        for path, home in MOVED_SETTINGS.items():
            found, value = _lookup(data, path)
            if found:
                errors.append(
                    {
                        "type": pydantic_core.PydanticCustomError(
                            "moved_setting",
                            "moved to {home} (every setting has one home): write it there",
                            {"home": home},
                        ),
                        "loc": path,
                        "input": value,
                    }
                )
        errors += _sandbox_option_errors(data.get("sandbox"))
        if errors:
            raise pydantic_core.ValidationError.from_exception_data(cls.__name__, errors)
        rollout = _default_context(data.get("rollout"), data.get("train"))
        return {**data, "rollout": _default_group_size(rollout, data.get("algorithm"))}

    @pydantic.model_validator(mode="after")
    def _check(self) -> TrainConfig:
        rollout, limit = self.rollout, self.train.micro_batch_tokens
        if rollout.max_context_tokens is not None and rollout.max_context_tokens > limit:
            raise ValueError(
                f"rollout.max_context_tokens={rollout.max_context_tokens} is above "
                f"train.micro_batch_tokens={limit}: a trajectory must fit one micro-batch"
            )
        if rollout.temperature < GREEDY_BELOW:  # engines sample greedily below it
            raise ValueError(
                f"rollout.temperature must be >= {GREEDY_BELOW:g} for training (logprobs at τ; "
                "engines sample greedily below it, as SGLang does)"
            )
        if self.algorithm.spec.needs_groups and rollout.group_size < 2:
            raise ValueError(
                f"algorithm {self.algorithm.name} needs groups: set rollout.group_size >= 2"
            )
        dynamic = self.algorithm.resolved().dynamic_sampling
        if dynamic and rollout.group_size < 2:  # a group of one has equal rewards: all dropped
            raise ValueError(
                "algorithm.dynamic_sampling drops groups whose rewards are all equal: with "
                f"rollout.group_size={rollout.group_size} that is every group (set it >= 2)"
            )
        if self.train.refill_rounds and not dynamic:
            raise ValueError(
                f"train.refill_rounds={self.train.refill_rounds} refills the groups dynamic "
                f"sampling drops, and algorithm {self.algorithm.name} has "
                "algorithm.dynamic_sampling off: set it, or leave refill_rounds at 0"
            )
        lag = self.train.max_version_lag if self.train.mode == "async" else 0
        try:
            check_in_flight_objective(self.engine.in_flight, self.algorithm, max_version_lag=lag)
        except ConfigError as exc:
            raise ValueError(f"train.mode: {self.train.mode}: {exc}") from None
        return self

    def hash(self) -> str:
        """sha256 (16 hex) of what decides the training trajectory: everything except
        ``train.max_steps``/``num_threads``/``collective_timeout_s``/``max_steps_without_update``,
        checkpointing,
        logging, eval, engine options, the servers, the sandbox and rollout concurrency (those
        may change on resume)."""
        data = self.model_dump(mode="json")
        data["algorithm"] = self.algorithm.resolved().model_dump(mode="json")
        for section in ("checkpoint", "logging", "eval", "engine", "server", "sandbox"):
            data.pop(section)
        data["train"].pop("max_steps")
        data["train"].pop("num_threads")
        data["train"].pop("collective_timeout_s")
        data["train"].pop("max_steps_without_update")
        data["rollout"].pop("concurrency")
        for dotted, legacy in LEGACY_VALUES.items():  # as a run from before the field hashed
            *parents, leaf = dotted.split(".")
            node = data
            for part in parents:
                node = node[part]
            if leaf in node and node[leaf] == legacy:
                del node[leaf]
        blob = json.dumps(data, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def training_notes(cfg: TrainConfig) -> list[str]:
    """Settings a run may use that make its update something else than what it looks like:
    said once when training starts (not refused: other trainers allow them too)."""
    rollout, notes = cfg.rollout, []
    filters = [
        f"rollout.{name}={value:g}"
        for name, value, off in (
            ("top_p", rollout.top_p, 1.0),
            ("top_k", rollout.top_k, -1),
            ("min_p", rollout.min_p, 0.0),
        )
        if value != off
    ]
    if filters:
        notes.append(
            f"{', '.join(filters)}: tokens are sampled from the filtered distribution while "
            "their logprobs, the learner's included, are of the unfiltered one: the update is "
            "off-policy by the filter"
        )
    return notes


def _sandbox_option_errors(value: Any) -> list[Any]:
    """The errors of a ``sandbox:`` mapping as ``PoolConfig`` options, located under
    ``sandbox`` (``sandbox.backend.type``, ``sandbox.size``)."""
    if not isinstance(value, dict):
        return []
    try:
        PoolConfig.model_validate(value)
    except pydantic.ValidationError as exc:
        return [
            {
                "type": err["type"],
                "loc": ("sandbox", *err["loc"]),
                "input": err["input"],
                **({"ctx": err["ctx"]} if "ctx" in err else {}),
            }
            for err in exc.errors()
        ]
    return []


def _lookup(data: dict[str, Any], path: tuple[str, ...]) -> tuple[bool, Any]:
    node: Any = data
    for part in path:
        if isinstance(node, pydantic.BaseModel):
            if part not in node.model_fields_set and part not in (node.model_extra or {}):
                return False, None
            node = getattr(node, part)
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return False, None
    return True, node


TRAIN_GROUP_SIZE = 4
"""``rollout.group_size`` of a training run whose algorithm needs groups and whose config names
none (a rollout's default, 1, would leave GRPO nothing to compare)."""


def _default_group_size(rollout: Any, algorithm: Any) -> Any:
    """``rollout`` with ``group_size`` defaulting to ``TRAIN_GROUP_SIZE`` when the algorithm
    needs groups and the config does not set it (else unchanged; validation names bad values)."""
    try:
        algo = (
            algorithm
            if isinstance(algorithm, AlgorithmConfig)
            else AlgorithmConfig.model_validate(algorithm or {})
        )
        needs_groups = algo.spec.needs_groups
    except (pydantic.ValidationError, ValueError, KeyError):
        return rollout
    return _fill(rollout, "group_size", TRAIN_GROUP_SIZE) if needs_groups else rollout


def _default_context(rollout: Any, train: Any) -> Any:
    """``rollout`` (a mapping, a ``RolloutConfig`` or absent) with ``max_context_tokens``
    defaulting to the micro-batch size, when that size is valid (else validation names it)."""
    try:
        section = (
            train if isinstance(train, TrainSection) else TrainSection.model_validate(train or {})
        )
    except pydantic.ValidationError:
        return rollout
    return _fill(rollout, "max_context_tokens", section.micro_batch_tokens)


def _fill(rollout: Any, field: str, value: Any) -> Any:
    """``rollout`` (a mapping, a ``RolloutConfig`` or absent) with ``field`` set to ``value``
    where the config leaves it unset (or null, where null is the field's own default meaning
    "choose for me"); anything else is returned for validation to judge."""
    null_is_unset = RolloutConfig.model_fields[field].default is None
    if rollout is None:
        return {field: value}
    if isinstance(rollout, RolloutConfig):
        current = getattr(rollout, field)
        if field in rollout.model_fields_set and not (null_is_unset and current is None):
            return rollout
        return rollout.model_copy(update={field: value})
    if isinstance(rollout, dict) and (
        field not in rollout or (null_is_unset and rollout[field] is None)
    ):
        return {**rollout, field: value}
    return rollout


def parse_overrides(sets: list[str]) -> list[tuple[list[str], Any]]:
    """``["a.b=1", ...]`` → ``[(["a", "b"], 1), ...]``; values are YAML scalars/flow (text that
    is not YAML stays a string; a repeated key or an alias bomb is refused like in a file)."""
    out = []
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
            raise ConfigError(f"--set expects dotted.key=value, got {short_repr(item)}")
        try:
            value = load_yaml(raw, f"--set {key.strip()}") if raw.strip() else ""
        except ConfigSyntaxError:
            value = raw
        out.append((key.strip().split("."), value))
    return out


def apply_overrides(data: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``--set`` applied (creating intermediate mappings)."""
    import copy

    data = copy.deepcopy(data)
    for path, value in parse_overrides(sets):
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(path[: i + 1])
                raise ConfigError(f"--set {'.'.join(path)}: {where} is not a mapping")
            node = child
        node[path[-1]] = value
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a YAML (or JSON) file into a mapping (``agentrl.read_config_file``: strict UTF-8,
    no repeated keys, bounded aliases); errors name the file."""
    file = Path(path)
    data = read_any_config_file(file)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a mapping at the top level")
    return data


LEGACY_VALUES: dict[str, Any] = {
    "algorithm.clip_ratio_c": None,
    **{f"rollout.{name}": value for name, value in ROLLOUT_LEGACY_VALUES.items()},
}
"""Training fields added after runs were made with this package, each with the value that
reproduces those runs. A run's own ``config.yaml`` that lacks one takes that value (the run
resumes as it was trained), and a configuration holding it hashes without the field, so its
checkpoints still match (``TrainConfig.hash``)."""


def load_train_config(
    path: str | Path | None = None,
    sets: list[str] | None = None,
    *,
    recorded: bool = False,
    **shortcuts: Any,
) -> TrainConfig:
    """Read ``path`` (or start from the defaults), apply ``--set`` overrides and the CLI
    shortcuts (``model``, ``max_steps``), validate. Errors name the field and value.
    ``recorded``: ``path`` is a run's ``config.yaml``; a field it lacks that was added later
    takes its ``LEGACY_VALUES`` value, not the default."""
    data = read_config_file(path) if path is not None else {}
    if recorded:
        data = _with_legacy_values(data)
    data = apply_overrides(data, list(sets or []))
    if shortcuts.get("model") is not None:
        data["model"] = shortcuts["model"]
    if shortcuts.get("max_steps") is not None:
        data.setdefault("train", {})
        if not isinstance(data["train"], dict):
            raise ConfigError("train: expected a mapping")
        data["train"]["max_steps"] = shortcuts["max_steps"]
    return validate_config(TrainConfig, data)


def _with_legacy_values(data: Any) -> Any:
    """``data`` with every ``LEGACY_VALUES`` field it lacks set to that value (a mapping of
    mappings; anything else is left for validation to refuse)."""
    if not isinstance(data, dict):
        return data
    for dotted, legacy in LEGACY_VALUES.items():
        *parents, leaf = dotted.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf not in node:
            node[leaf] = legacy
    return data


def dump_config(cfg: TrainConfig) -> str:
    """The resolved configuration as YAML (re-loadable with ``--config``)."""
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
