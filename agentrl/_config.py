"""Rollout configuration (pydantic: people write it; every field documented, extras refused)."""

from __future__ import annotations

from typing import Any

import pydantic

from ._errors import ConfigError


class RolloutConfig(pydantic.BaseModel):
    """How trajectories are generated. ``None`` means "the environment's default"."""

    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=True)

    max_turns: int | None = pydantic.Field(None, ge=1)
    """Assistant turns per trajectory (default: the env spec's ``max_turns``)."""
    max_new_tokens: int | None = pydantic.Field(None, ge=1)
    """Tokens the model may sample per turn (default: the env spec's ``max_new_tokens``)."""
    max_context_tokens: int | None = pydantic.Field(None, ge=16)
    """Total tokens per trajectory (default: the engine's context window)."""
    temperature: float = pydantic.Field(1.0, ge=0.0)
    """Sampling temperature. RL default 1.0: the sampling distribution is the trained one."""
    top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    """-1 disables top-k."""
    min_p: float = pydantic.Field(0.0, ge=0.0, le=1.0)
    seed: int = 0
    """Base seed; each trajectory derives its own from (seed, task id, sample index)."""
    group_size: int = pydantic.Field(1, ge=1)
    """Samples per task (G for GRPO); a group shares one prompt."""
    concurrency: int = pydantic.Field(16, ge=1)
    """Trajectories in flight at once."""
    turn_timeout_s: float = pydantic.Field(300.0, gt=0)
    """Deadline for one generate call."""
    tool_timeout_s: float = pydantic.Field(10.0, gt=0)
    """Deadline for one tool call (a tool's own ``timeout_s`` wins)."""
    trajectory_timeout_s: float = pydantic.Field(1800.0, gt=0)
    """Wall-clock deadline for a whole trajectory."""
    tool_error_budget: int = pydantic.Field(3, ge=0)
    """A trajectory ends (``tool_error_budget``) after more failed tool calls than this."""
    max_tool_argument_bytes: int = pydantic.Field(16_384, ge=64)
    """Tool-call argument text above this size is refused (``oversize_arguments``)."""
    tool_threads: int = pydantic.Field(8, ge=1)
    """Worker threads shared by all synchronous tool calls of one rollout."""
    use_sessions: bool = True
    """Open an engine session per trajectory so KV survives tool waits."""
    env_kwargs: dict[str, Any] = pydantic.Field(default_factory=dict)
    """Keyword arguments for the environment factory."""

    @pydantic.model_validator(mode="after")
    def _check_top_k(self) -> RolloutConfig:
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        return self


def validate_config(model: type[pydantic.BaseModel], data: dict[str, Any]) -> Any:
    """Validate ``data``; raise ConfigError naming each offending field and value."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"])
            parts.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("invalid config: " + "; ".join(parts)) from None
