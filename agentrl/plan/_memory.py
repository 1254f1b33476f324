"""Per-GPU memory of an RL training layout: which models sit on the GPU, what ZeRO and
offloading leave of their states, activations, the logits buffer and a colocated KV cache.

Model states follow one of two conventions (``optimizer_state``):

- ``bf16``: the textbook count. Weights, gradients and two Adam moments in 16 bits, no fp32
  master copy: 8 bytes per trained parameter (7B: 14 GB weights, 14 GB gradients, 28 GB Adam).
  ``fp32`` is the same without mixed precision (moments of 4 bytes; with ``dtype: fp32``, plain
  fp32 AdamW: 16 bytes per parameter).
- ``fp32-master``: DeepSpeed's mixed-precision Adam, counted as its own estimators count
  (``estimate_zero2_model_states_mem_needs``, ``estimate_zero3_model_states_mem_needs``):
  16-bit weights (2), 16-bit gradients (2), fp32 master weights and moments (12); under ZeRO-2
  and ZeRO-3 DeepSpeed also keeps an fp32 gradient partition (4), and under ZeRO-3 one gathered
  layer (4 bytes per parameter of the largest module) while the 16-bit gradients are not counted.

ZeRO partitions the optimizer state from stage 1, gradients from 2, weights from 3; frozen models
(reference, reward) are partitioned under stage 3. Offloading ``optimizer`` moves the optimizer
state to host memory and, from stage 2 (where DeepSpeed streams gradients to the host), the
gradient partitions too; ``params`` (stage 3 only) leaves one gathered layer on the GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from .._errors import ConfigError
from ._shape import ModelShape

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
OFFLOADABLE = ("reference", "reward", "optimizer", "params")
COMPONENTS = (
    "policy_weights",
    "reference_weights",
    "reward_weights",
    "critic_weights",
    "engine_weights",
    "gradients",
    "optimizer",
    "reduce_bucket",
    "unreduced_gradients",
    "live_parameters",
    "activations",
    "logits",
    "kv_cache",
)


@dataclass(frozen=True)
class MemorySettings:
    """The layout to size (the ``agentrl plan memory`` options)."""

    gpus: int = 1
    gpu_memory: int | None = None
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    zero: int = 3
    offload: frozenset[str] = frozenset()
    optimizer_state: Literal["fp32-master", "bf16", "fp32"] = "fp32-master"
    """``fp32-master``: DeepSpeed's mixed-precision Adam; ``bf16``/``fp32``: no master copy,
    the two Adam moments at that width (weights and gradients at ``dtype``)."""
    reference: bool = False
    critic: bool = False
    reward: ModelShape | None = None
    micro_batch_tokens: int = 4096
    checkpointing: bool = False
    logprob: Literal["fused", "chunked", "naive"] = "fused"
    chunk_size: int = 1024
    reduce_bucket_size: int = 500_000_000
    """DeepSpeed's ``zero_optimization.reduce_bucket_size`` (elements; its default)."""
    max_live_parameters: int = 1_000_000_000
    """DeepSpeed's ``stage3_max_live_parameters`` (its default): gathered parameters kept."""
    colocate: bool = False
    rollout_batch: int = 64
    context: int = 4096

    def check(self) -> None:
        """``ConfigError`` naming the option and value of an impossible layout."""
        if self.gpus < 1:
            raise ConfigError(f"--gpus {self.gpus}: at least 1")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"--zero {self.zero}: one of 0, 1, 2, 3")
        unknown = sorted(self.offload - set(OFFLOADABLE))
        if unknown:
            raise ConfigError(f"--offload {unknown}: not offloadable (choose from {OFFLOADABLE})")
        if "params" in self.offload and self.zero != 3:
            raise ConfigError(f"--offload params needs --zero 3 (got --zero {self.zero})")
        if "reward" in self.offload and self.reward is None:
            raise ConfigError("--offload reward: there is no reward model (--reward-model none)")
        if "reference" in self.offload and not self.reference:
            raise ConfigError(
                "--offload reference: there is no reference model (one is kept only with a KL "
                "coefficient > 0: --kl-coef)"
            )
        for name, flag in (("micro_batch_tokens", "--micro-batch-tokens"),
                           ("chunk_size", "--chunk-size"), ("rollout_batch", "--rollout-batch"),
                           ("context", "--seq-len")):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag} {getattr(self, name)}: at least 1")


@dataclass
class MemoryPlan:
    """Bytes per GPU by component; what was offloaded (bytes per GPU, held in host memory)."""

    model: str
    settings: MemorySettings
    components: dict[str, int]
    offloaded: dict[str, int] = field(default_factory=dict)
    alternatives: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def model_states_bytes(self) -> int:
        keys = ("policy_weights", "reference_weights", "reward_weights", "critic_weights")
        return sum(self.components[k] for k in (*keys, "gradients", "optimizer"))

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())

    @property
    def left_bytes(self) -> int | None:
        memory = self.settings.gpu_memory
        return None if memory is None else memory - self.total_bytes

    def to_json(self) -> dict[str, Any]:
        settings = dataclasses.asdict(self.settings)
        settings["offload"] = sorted(self.settings.offload)
        settings["reward"] = None if self.settings.reward is None else self.settings.reward.name
        return {
            "model": self.model,
            "settings": settings,
            "components": dict(self.components),
            "offloaded": dict(self.offloaded),
            "model_states_bytes": self.model_states_bytes,
            "total_bytes": self.total_bytes,
            "gpu_memory_bytes": self.settings.gpu_memory,
            "left_bytes": self.left_bytes,
            "alternatives": self.alternatives,
            "notes": list(self.notes),
        }


@dataclass
class _States:
    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    offloaded: dict[str, int] = field(default_factory=dict)


def _trained_states(shape: ModelShape, s: MemorySettings, who: str) -> _States:
    """Weights, gradients and optimizer state of one trained model on one GPU."""
    p, n, b = shape.params, s.gpus, DTYPE_BYTES[s.dtype]
    if s.optimizer_state == "fp32-master":
        weights, grads, grads_partition, optim = b * p, b * p, 4 * p, 12 * p
    else:  # no master copy: two moments of the optimizer state's width
        weights, grads, grads_partition = b * p, b * p, 0
        optim = 2 * DTYPE_BYTES[s.optimizer_state] * p
    optim = optim // n if s.zero >= 1 else optim
    if s.zero < 2:
        grads_partition = 0
    elif s.zero == 2:
        grads = (grads + grads_partition) // n
    elif s.optimizer_state == "fp32-master":
        grads = grads_partition // n  # DeepSpeed's ZeRO-3 count: the fp32 partition only
    else:
        grads = grads // n
    gathered = 4 * shape.largest_layer_params if s.zero == 3 else 0
    if s.zero == 3:
        weights = weights // n
    st = _States(weights + gathered, grads, optim)
    if "optimizer" in s.offload:
        st.offloaded[f"{who}_optimizer"], st.optimizer = st.optimizer, 0
        if s.zero >= 2:
            st.offloaded[f"{who}_gradients"], st.gradients = st.gradients, 0
    if "params" in s.offload:
        st.offloaded[f"{who}_weights"], st.weights = weights, gathered
    return st


def _frozen_weights(shape: ModelShape, s: MemorySettings) -> int:
    weights = DTYPE_BYTES[s.dtype] * shape.params
    return weights // s.gpus if s.zero == 3 else weights


def layer_activation_bytes(shape: ModelShape, b: int) -> int:
    """Bytes one decoder layer saves for backward per token (Llama family, SDPA/flash
    attention: no sequence-squared term): the two RMSNorms (an fp32 copy of the input, the
    fp32 rsqrt, the normed input and its product with the weight), q, k, v after RoPE, the
    attention output and its fp32 log-sum-exp, the MLP's gate, up, SiLU and product."""
    h, inter = shape.hidden, shape.intermediate
    heads, kv, hd = shape.heads, shape.kv_heads, shape.head_dim
    assert None not in (h, inter, heads, kv, hd)
    norms = 2 * (4 * h + 4 + 2 * b * h)  # type: ignore[operator]
    attention = b * (2 * heads * hd + 2 * kv * hd) + 4 * heads  # type: ignore[operator]
    return norms + attention + 4 * b * inter  # type: ignore[operator]


def activation_bytes(shape: ModelShape, tokens: int, b: int, checkpointing: bool) -> int:
    """What a micro-batch of ``tokens`` saves for backward; with activation checkpointing, each
    layer's input plus one layer recomputed at a time."""
    assert shape.layers is not None and shape.hidden is not None and shape.head_dim is not None
    final = 4 * shape.hidden + 4 + b * shape.hidden  # the final norm, its output to the head
    rope = 2 * b * shape.head_dim  # cos and sin per position, shared by the layers
    layer = layer_activation_bytes(shape, b)
    if checkpointing:
        per_token = shape.layers * b * shape.hidden + layer + rope + final + 8
    else:
        per_token = shape.layers * layer + rope + final + 8
    return tokens * per_token


def logits_bytes(shape: ModelShape, tokens: int, b: int, path: str, chunk: int) -> int:
    """Peak bytes of the log-prob computation over ``tokens`` positions. Naive: the 16-bit
    logits, their fp32 copy and the fp32 log-softmax at once (``tokens x vocab``). Chunked (the
    torch path): one chunk of fp32 logits and its gradient. Fused (the Triton backend): fp32
    per-token results (log-prob, entropy, log-sum-exp); with 16-bit weights its GEMM path also
    holds one chunk of fp32 logits and of 16-bit ``dL/dz``, and the fp32 head gradient with
    one chunk's product being added to it (fp32 weights: the tile kernel, no logits)."""
    assert shape.vocab is not None
    if path == "naive":
        return tokens * shape.vocab * (b + 8)
    if path == "chunked":
        return min(tokens, chunk) * shape.vocab * 8
    if b == 4:
        return tokens * 12
    head = 2 * 4 * shape.vocab * shape.hidden  # type: ignore[operator]
    return min(tokens, chunk) * shape.vocab * (4 + b) + head + tokens * 12


def kv_cache_bytes(shape: ModelShape, sequences: int, context: int, b: int) -> int:
    """K and V of every layer for ``sequences`` x ``context`` tokens."""
    assert shape.layers is not None and shape.kv_heads is not None
    return sequences * context * shape.layers * shape.kv_heads * shape.head_dim * 2 * b  # type: ignore[operator]


def plan_memory(shape: ModelShape, s: MemorySettings) -> MemoryPlan:
    """The per-GPU memory plan of training ``shape`` under ``s``."""
    s.check()
    comp = dict.fromkeys(COMPONENTS, 0)
    plan = MemoryPlan(shape.name, s, comp)
    policy = _trained_states(shape, s, "policy")
    comp["policy_weights"] = policy.weights
    comp["gradients"], comp["optimizer"] = policy.gradients, policy.optimizer
    plan.offloaded.update(policy.offloaded)
    if s.critic:
        critic = _trained_states(shape.value_head(), s, "critic")
        comp["critic_weights"] = critic.weights
        comp["gradients"] += critic.gradients
        comp["optimizer"] += critic.optimizer
        plan.offloaded.update(critic.offloaded)
    for key, model in (("reference", shape if s.reference else None), ("reward", s.reward)):
        if model is not None:
            weights = _frozen_weights(model, s)
            if key in s.offload:
                plan.offloaded[f"{key}_weights"] = weights
            else:
                comp[f"{key}_weights"] = weights
    _runtime_buffers(plan, shape, s)
    return plan


def _runtime_buffers(plan: MemoryPlan, shape: ModelShape, s: MemorySettings) -> None:
    comp, b, t = plan.components, DTYPE_BYTES[s.dtype], s.micro_batch_tokens
    if s.zero >= 2 and "optimizer" not in s.offload:
        # gradients pass through DeepSpeed's reduce bucket, allocated at reduce_bucket_size
        # elements (on a CPU only the written pages are resident: at most the parameters)
        comp["reduce_bucket"] = b * s.reduce_bucket_size
        # and each parameter's .grad lives until the bucket it is copied into is reduced
        comp["unreduced_gradients"] = b * min(s.reduce_bucket_size, shape.params)
    if s.zero == 3:
        # ZeRO-3 keeps gathered (whole) parameters alive during forward and backward, up to
        # stage3_max_live_parameters of them: beyond DeepSpeed's estimators' one layer
        comp["live_parameters"] = b * min(s.max_live_parameters, shape.params)
    if s.colocate:
        comp["engine_weights"] = b * shape.params
    if not shape.has_architecture:
        plan.notes.append(
            "activations, logits and KV cache need the architecture: pass a config.json or a "
            "model folder (counted 0 here)"
        )
        if s.zero == 3:
            plan.notes.append("the largest layer is unknown: ZeRO-3's gathered layer counted 0")
        return
    acts = {f"checkpointing={on}": activation_bytes(shape, t, b, on) for on in (False, True)}
    comp["activations"] = acts[f"checkpointing={s.checkpointing}"]
    paths = ("naive", "chunked", "fused")
    logits = {p: logits_bytes(shape, t, b, p, s.chunk_size) for p in paths}
    comp["logits"] = logits[s.logprob]
    plan.alternatives = {"activations": acts, "logits": logits}
    if s.colocate:
        comp["kv_cache"] = kv_cache_bytes(shape, s.rollout_batch, s.context, b)
