"""The training config's ``deepspeed`` section: typed where agentrl relies on a key, checked
against DeepSpeed's own parser for the rest, so that a typo fails when the config is loaded.

The learner generates the DeepSpeed config (``_engine.deepspeed_config``: ZeRO-3, caller-owned
accumulation, torch AdamW, clipping) and merges this section over it key by key. Three kinds of
keys:

- keys agentrl sets from its own sections are refused, naming their home (one home per setting):
  the batch and accumulation keys, the optimizer, the scheduler, the gradient clip;
- keys agentrl relies on are typed here (``zero_optimization.stage`` is 3);
- every other key is handed to DeepSpeed's own config parser
  (``deepspeed.runtime.config.DeepSpeedConfig``, which needs no GPU and no process group): its
  pydantic sections (``zero_optimization``, ``bf16``, ``fp16``...) refuse unknown fields, it
  refuses removed features by name, and a top-level key it never reads is refused here, by name.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Literal

import pydantic
import pydantic_core

from ._config import OptimizerConfig

_ACCUMULATION = (
    "agentrl packs micro-batches and owns gradient accumulation: set train.micro_batch_tokens "
    "and algorithm.mini_batches"
)
OWNED_KEYS: dict[str, str] = {
    "train_batch_size": _ACCUMULATION,
    "train_micro_batch_size_per_gpu": _ACCUMULATION,
    "gradient_accumulation_steps": _ACCUMULATION,
    "managed_gradient_accumulation": _ACCUMULATION,
    "optimizer": "the optimizer is the optimizer section (optimizer.lr, betas, eps, weight_decay)",
    "scheduler": "the LR schedule is optimizer.schedule, optimizer.warmup_steps and "
    "optimizer.min_lr_ratio",
    "gradient_clipping": "the gradient clip is optimizer.grad_clip",
    "steps_per_print": "agentrl reports every step itself (the console and ledger.jsonl); "
    "DeepSpeed's own periodic log stays off",
}
"""DeepSpeed keys whose value agentrl sets from another section: each maps to that home."""

_READ_BY_INITIALIZE = frozenset({"sequence_parallel_size", "data_parallel_size"})
"""Top-level keys ``deepspeed.initialize`` reads itself, outside the config parser."""


class ZeroSection(pydantic.BaseModel):
    """``deepspeed.zero_optimization``: ZeRO stage 3 and any other DeepSpeed ZeRO field
    (offload, bucket sizes, ``overlap_comm``...), checked by DeepSpeed's ``DeepSpeedZeroConfig``."""

    model_config = pydantic.ConfigDict(extra="allow", frozen=True, use_attribute_docstrings=True)

    stage: Literal[3] = 3
    """The learner is ZeRO-3: parameters are partitioned and gathered on use (the LM head is a
    registered external parameter; the reference is a ZeRO-3 inference engine)."""


class DeepSpeedSection(pydantic.BaseModel):
    """Merged key by key over the DeepSpeed config the learner generates (ZeRO-3, caller-owned
    accumulation, torch AdamW from ``optimizer``, ``optimizer.grad_clip``, bf16 on a GPU).
    Besides ``zero_optimization``, any DeepSpeed key is accepted and checked against DeepSpeed's
    own parser when the config is loaded (bf16, fp16, activation_checkpointing, ...); keys that
    another section sets are refused with that section's name."""

    model_config = pydantic.ConfigDict(extra="allow", frozen=True, use_attribute_docstrings=True)

    zero_optimization: ZeroSection = pydantic.Field(default_factory=ZeroSection)
    """ZeRO settings (stage 3 and DeepSpeed's other ZeRO fields)."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _refuse_owned(cls, data: Any) -> Any:
        if isinstance(data, dict):
            errors = [
                _line(key, f"set elsewhere: {home}", data[key])
                for key, home in OWNED_KEYS.items()
                if key in data
            ]
            # DeepSpeed reads its config as JSON, where inf and nan are null: say what was set
            errors += [
                _line(path, "a finite number is due here", value)
                for path, value in _non_finite(data)
            ]
            if errors:
                raise pydantic_core.ValidationError.from_exception_data(cls.__name__, errors)
        return data

    @pydantic.model_validator(mode="after")
    def _check_with_deepspeed(self) -> DeepSpeedSection:
        if not self.model_extra and not self.zero_optimization.model_extra:
            return self  # nothing beyond agentrl's own settings (and no 5 s deepspeed import)
        errors = deepspeed_errors(self.overrides())
        if errors:
            raise pydantic_core.ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def overrides(self) -> dict[str, Any]:
        """The section as a plain mapping, to merge over the generated config."""
        return self.model_dump(mode="json")


def _non_finite(data: dict[str, Any]) -> list[tuple[tuple[Any, ...], float]]:
    """Every infinite or NaN number in ``data`` with its key path (iteratively: any depth)."""
    found = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            found.append((path, value))
        elif isinstance(value, dict):
            stack.extend(((*path, k), v) for k, v in value.items())
        elif isinstance(value, list | tuple):
            stack.extend(((*path, i), v) for i, v in enumerate(value))
    return sorted(found, key=lambda item: [str(p) for p in item[0]])


def _line(key: str | tuple[Any, ...], message: str, value: Any) -> Any:
    loc = key if isinstance(key, tuple) else (key,)
    return {
        "type": pydantic_core.PydanticCustomError("deepspeed", message),
        "loc": loc,
        "input": value,
    }


class _ReadTracker(dict):
    """A mapping that remembers which keys were looked up (DeepSpeed's parser reads its config
    with ``get``, ``[]`` and ``in``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.looked_up: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.looked_up.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.looked_up.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.looked_up.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)


def deepspeed_errors(overrides: dict[str, Any]) -> list[Any]:
    """What DeepSpeed's own parser refuses in ``overrides`` merged over the generated config, as
    pydantic line errors located at the offending key. Empty when DeepSpeed is not installed
    (the learner then cannot start, and says so)."""
    from ._deepspeed_import import import_deepspeed

    try:
        import_deepspeed()
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        return []
    from ._engine import _merge, deepspeed_config

    base = deepspeed_config(optimizer=OptimizerConfig(), bf16=False)
    errors: list[Any] = []
    for key, value in overrides.items():  # one key at a time: each error names its key
        try:
            DeepSpeedConfig(_merge(base, {key: value}))
        except pydantic.ValidationError as exc:
            for err in exc.errors():
                errors.append(_line((key, *err["loc"]), err["msg"], err.get("input")))
        except Exception as exc:  # DeepSpeed's own checks: asserts, ValueError, config errors
            errors.append(_line(key, f"DeepSpeed refuses it: {exc}", value))
    if errors:
        return errors
    tracked = _ReadTracker(_merge(base, overrides))
    try:
        DeepSpeedConfig(tracked)
    except Exception as exc:  # keys fine alone that DeepSpeed refuses together
        return [_line((), f"DeepSpeed refuses these keys together: {exc}", overrides)]
    for key in overrides:
        if key not in tracked.looked_up and key not in _READ_BY_INITIALIZE:
            known = sorted(k for k in tracked.looked_up if isinstance(k, str))
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            message = f"not a DeepSpeed config key (DeepSpeed never reads it){hint}"
            errors.append(_line(key, message, overrides[key]))
    return errors
