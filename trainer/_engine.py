"""DeepSpeed ZeRO-3 engines: the policy (trained), the frozen reference (ZeRO-3 inference, never
in an optimizer) and the optional PPO critic.

Every model is wrapped in a small module whose ``forward`` runs the decoder and scores the
targets with the chunked log-prob (``_logprob``): under ZeRO-3 the LM head's weight is
partitioned outside its own module's forward, so the wrapper registers it as an *external
parameter* (``deepspeed.zero.register_external_parameter``) and DeepSpeed gathers it for the
wrapper's forward and backward. Tied embeddings (SmolLM2) are the same parameter; nothing changes.

Process set-up (``init_distributed``): a plain ``python`` process becomes rank 0 of 1 over gloo
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` are set when
absent; without them DeepSpeed looks for MPI); torchrun and the DeepSpeed launcher set them. The
first ``init_distributed`` on a CPU host JIT-builds DeepSpeed's shm op (about 1-2 minutes);
``TORCH_EXTENSIONS_DIR`` defaults to ``~/.cache/agentrl/torch_extensions`` so that happens once.
The optimizer is torch's AdamW through DeepSpeed (``"torch_adam": true``): no JIT build.
Precision: fp32 on CPU (this AVX2 host has no fast bf16), bf16 with fp32 master weights on GPU.
"""

from __future__ import annotations

import copy
import datetime
import os
import re
import socket
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ._attention import use_varlen_attention, varlen_kwargs
from ._batch import PackedBatch, model_inputs
from ._config import OptimizerConfig
from ._deepspeed_import import import_deepspeed, initialize
from ._logprob import TokenLogprobs, token_logprobs_and_entropy
from ._schedule import LRSchedule


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _quiet_torch_distributed() -> None:
    # DeepSpeed 0.19 calls the old collective names on every gather; the warning says nothing
    # about our code and would print at every step.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`",
        category=FutureWarning,
    )


def init_distributed(*, num_threads: int | None = None, timeout_s: float | None = None) -> DistInfo:
    """Join (or create) the process group; idempotent. Sets torch's CPU threads to
    ``num_threads`` or ``cpu_count // local world size`` (torchrun's ``OMP_NUM_THREADS=1`` is
    respected when set). ``timeout_s``: the longest a collective waits for the other ranks
    (None: PyTorch's default)."""
    os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/agentrl/torch_extensions")
    )
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    alone = "MASTER_PORT" not in os.environ and os.environ["WORLD_SIZE"] == "1"
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    _quiet_torch_distributed()
    deepspeed = import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
        if torch.cuda.get_device_capability(local_rank)[0] == 9:  # DeepSpeed's op builder
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # fails on Hopper's "9.0a"
    if not torch.distributed.is_initialized():
        extra: dict[str, Any] = {}
        if timeout_s is not None:
            extra["timeout"] = datetime.timedelta(seconds=timeout_s)
        if alone:
            # one process and nobody gave a port: its group lives in an in-process store, so
            # no port is bound (a free port picked here could be taken before it is bound, by
            # another run starting on this machine); DeepSpeed adopts the group
            torch.distributed.init_process_group(
                "nccl" if cuda else "gloo",
                store=torch.distributed.HashStore(),
                rank=0,
                world_size=1,
                **extra,
            )
        deepspeed.init_distributed(
            dist_backend="nccl" if cuda else "gloo",
            auto_mpi_discovery=False,
            verbose=False,
            **extra,
        )
    world = torch.distributed.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if num_threads is None:
        num_threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or max(
            1, (os.cpu_count() or 1) // max(1, local_world)
        )
    torch.set_num_threads(num_threads)
    device = torch.device(get_accelerator().device_name(local_rank) if cuda else "cpu")
    return DistInfo(torch.distributed.get_rank(), local_rank, world, device)


class TokenScorer(torch.nn.Module):
    """``forward(input_ids, position_ids, attention_mask, targets, loss_mask)`` →
    ``(logprobs, entropy)``, both ``[B, T]`` float32, 0 off ``loss_mask``: the decoder of an
    HF causal LM and the chunked log-prob of ``targets`` at ``temperature``. With
    ``value_head`` (the PPO critic) it returns ``(values [B, T], zeros)`` instead. With
    ``varlen`` (default) attention is ``agentrl_varlen`` (``_attention``): ``segments``
    (boundaries) and ``parents`` (shared prefixes) describe a packed row and no mask is built;
    otherwise the dense 4D block-causal mask."""

    def __init__(
        self,
        lm: torch.nn.Module,
        *,
        temperature: float = 1.0,
        chunk_size: int = 1024,
        value_head: bool = False,
        varlen: bool = True,
        kernels: str = "auto",
    ) -> None:
        super().__init__()
        self.varlen = varlen
        self.kernels = kernels
        if varlen:
            use_varlen_attention(lm)
        # the critic keeps only the decoder (an untied LM head would be dead weight)
        self.lm = lm.get_decoder() if value_head else lm  # type: ignore[operator]
        # h·Wᵀ/τ below: a model whose head transforms its logits has that folded into τ
        self.temperature = float(temperature) * (1.0 if value_head else _logit_divisor(lm))
        self.chunk_size = int(chunk_size)
        hidden = lm.config.hidden_size  # type: ignore[union-attr]
        self.value_head = torch.nn.Linear(hidden, 1) if value_head else None
        if self.value_head is not None:
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
        else:
            deepspeed = import_deepspeed()

            head = lm.get_output_embeddings()  # type: ignore[operator]
            deepspeed.zero.register_external_parameter(self, head.weight)

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        targets,
        loss_mask,
        segments=None,
        parents=None,
    ):
        decoder = self.lm if self.value_head is not None else self.lm.get_decoder()
        extra = varlen_kwargs(segments, parents) if segments is not None else {}
        hidden = decoder(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
            **extra,
        ).last_hidden_state
        b, t, h = hidden.shape
        if self.value_head is not None:
            values = self.value_head(hidden).squeeze(-1).float()
            return values * loss_mask, torch.zeros_like(values)
        head = self.lm.get_output_embeddings()  # type: ignore[operator]
        out = token_logprobs_and_entropy(
            hidden.reshape(b * t, h),
            head.weight,
            targets.reshape(-1),
            temperature=self.temperature,
            chunk_size=self.chunk_size,
            mask=loss_mask.reshape(-1),
            kernels=self.kernels,
        )
        return out.logprobs.view(b, t).float(), out.entropy.view(b, t).float()


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def deepspeed_config(
    *,
    optimizer: OptimizerConfig | None,
    lr: float | None = None,
    bf16: bool,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config: ZeRO-3, one micro-batch per ``backward`` with caller-owned
    accumulation (``managed_gradient_accumulation: false``: each ``step()`` is an optimizer
    update over everything accumulated since the last one, so a step may have any number of
    packed micro-batches), torch AdamW, clipping; ``overrides`` (the config's ``deepspeed``
    section) are merged on top, key by key."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if optimizer is not None:
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": lr if lr is not None else optimizer.lr,
                "betas": list(optimizer.betas),
                "eps": optimizer.eps,
                "weight_decay": optimizer.weight_decay,
                "torch_adam": True,
            },
        }
        # always explicit: DeepSpeed's ZeRO-3 otherwise clips at 1.0
        cfg["gradient_clipping"] = optimizer.grad_clip or 0.0
    return _merge(cfg, overrides or {})


class ModelEngine:
    """One DeepSpeed engine around a ``TokenScorer``: ``score`` a micro-batch, ``backward``,
    ``step``; ``state_dict`` gathers the full HF-named weights on every rank."""

    def __init__(self, engine: Any, scorer: TokenScorer, *, trainable: bool) -> None:
        self.engine = engine
        self.scorer = scorer
        self.trainable = trainable

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def score(self, batch: PackedBatch) -> TokenLogprobs:
        """Per-token logprobs and entropies ``[B, T]`` of ``batch.targets`` (0 off the mask)."""
        batch = batch.to(self.device)
        segments = parents = mask = None
        if self.scorer.varlen:  # no mask: segment boundaries (packed) or causal rows (padded)
            if batch.packed:
                segments, parents = batch.attention_segments
        elif batch.segment_bounds is not None:
            raise ValueError("the shared-prefix layout needs varlen attention")
        else:
            dtype = next(self.scorer.parameters()).dtype
            mask = model_inputs(batch, dtype=dtype)["attention_mask"]
        logprobs, entropy = self.engine(
            batch.input_ids, batch.position_ids, mask, batch.targets, batch.loss_mask,
            segments, parents,
        )  # fmt: skip
        return TokenLogprobs(logprobs, entropy)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float | None:
        """One optimizer update over the accumulated gradients; returns the pre-clip norm
        (None when DeepSpeed reports none)."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else None

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    @property
    def lr_schedule(self) -> LRSchedule | None:
        """The engine's LR schedule (None: a frozen engine)."""
        return getattr(self.engine, "lr_scheduler", None)

    def advance_schedule(self, updates: int) -> None:
        """Advance the LR schedule past ``updates`` that this step did not make."""
        schedule = getattr(self.engine, "lr_scheduler", None)
        if schedule is not None:
            schedule.advance(updates)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32/bf16 weights under HF names (``lm.`` stripped; tied heads once), gathered
        layer by layer on every rank, as CPU tensors."""
        deepspeed = import_deepspeed()

        lm = self.scorer.lm
        out: dict[str, torch.Tensor] = {}
        for prefix, module in lm.named_modules():
            params = list(module.named_parameters(recurse=False))
            if not params:
                continue
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
                for name, param in params:
                    full = f"{prefix}.{name}" if prefix else name
                    out[full] = param.detach().to("cpu", copy=True)
        # named_modules visits a shared (tied) parameter under each owner; keep the first name
        seen: dict[int, str] = {}
        for name, param in lm.named_parameters():
            seen.setdefault(id(param), name)
        keep = set(seen.values())
        return {k: v for k, v in out.items() if k in keep}

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.scorer.parameters())

    def optimizer_parameters(self) -> list[torch.nn.Parameter]:
        """The model parameters this engine's optimizer updates (empty when frozen)."""
        opt = getattr(self.engine, "optimizer", None)
        groups = getattr(opt, "fp16_groups", None) if opt is not None else None
        if not groups:
            return []
        return [p for group in groups for p in group]


def _logit_divisor(lm: torch.nn.Module) -> float:
    """What the model's own forward divides ``h·Wᵀ`` by before the softmax, from its config:
    Cohere's ``logit_scale`` multiplies, Granite's ``logits_scaling`` divides, Falcon-H1's
    ``lm_head_multiplier`` multiplies. A head the learner cannot reproduce as ``h·Wᵀ/τ`` (a
    final soft-cap, a bias) is refused, naming the field: its log-probs would be another
    distribution than the engine samples from."""
    config = lm.config  # type: ignore[union-attr]
    model = getattr(config, "model_type", "?")
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        raise ValueError(
            f"the model's config sets final_logit_softcapping={cap} ({model}): the learner's "
            "log-probs are softmax(h·Wᵀ/τ) and do not soft-cap; such models cannot be trained"
        )
    head = lm.get_output_embeddings()  # type: ignore[operator]
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            f"the model's LM head has a bias ({model}): the learner's log-probs are "
            "softmax(h·Wᵀ/τ) without one; such models cannot be trained"
        )
    divisor = 1.0
    for field, inverse in (("logit_scale", True), ("lm_head_multiplier", True),
                           ("logits_scaling", False)):  # fmt: skip
        value = getattr(config, field, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"the model's config sets {field}={value!r}: expected a number > 0")
        divisor = divisor / value if inverse else divisor * value
    return divisor


_DROPOUT = re.compile(r"dropout|pdrop|layerdrop|drop_rate")


def _without_dropout(config: Any) -> None:
    """Set every dropout probability of an HF config (and its sub-configs) to 0: the learner
    scores π_old and π_θ on the same tokens and their ratio must be 1 where nothing changed
    (TRL's ``disable_dropout``, OpenRLHF's); the engines never drop out."""
    for name, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _without_dropout(value)
        elif _DROPOUT.search(name) and type(value) in (int, float):
            setattr(config, name, 0.0)


def _load_lm(model_path: str, *, gradient_checkpointing: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentrl._errors import ModelError

    try:
        config = AutoConfig.from_pretrained(model_path)
        _without_dropout(config)
        lm = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=torch.float32)
    except MemoryError:
        raise
    except Exception as exc:  # a broken folder: config.json, weights, a size they disagree on
        text = " ".join(str(exc).split())
        text = text if len(text) <= 400 else text[:400] + " …"
        raise ModelError(
            f"the learner cannot load the model in {model_path} ({type(exc).__name__}: {text}); "
            "check its config.json and weights, or name another model"
        ) from exc
    for module in lm.modules():  # a dropout a model hard-codes rather than reads from config
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    lm.config.use_cache = False
    if gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return lm


def open_policy(
    model_path: str,
    *,
    optimizer: OptimizerConfig,
    total_updates: int,
    temperature: float,
    chunk_size: int = 1024,
    gradient_checkpointing: bool = False,
    varlen: bool = True,
    kernels: str = "auto",
    overrides: dict[str, Any] | None = None,
) -> ModelEngine:
    """The trained policy: HF weights from ``model_path``, AdamW, the LR schedule
    (``LRSchedule`` over ``total_updates``, checkpointed with the engine, its length too)."""
    scorer = TokenScorer(
        _load_lm(model_path, gradient_checkpointing=gradient_checkpointing),
        temperature=temperature,
        chunk_size=chunk_size,
        varlen=varlen,
        kernels=kernels,
    )
    config = deepspeed_config(
        optimizer=optimizer, bf16=torch.cuda.is_available(), overrides=overrides
    )
    return _trained_engine(scorer, optimizer, config, total_updates, overrides)


def _trained_engine(
    scorer: TokenScorer,
    optimizer: OptimizerConfig,
    config: dict[str, Any],
    total_updates: int,
    overrides: dict[str, Any] | None,
) -> ModelEngine:
    """DeepSpeed around a trained ``scorer``: its trainable parameters, the LR schedule."""
    scorer.train()
    engine, *_ = _initialize(
        overrides,
        model=scorer,
        model_parameters=[p for p in scorer.parameters() if p.requires_grad],
        config=config,
        lr_scheduler=lambda opt: LRSchedule(opt, optimizer, total_updates),
    )
    return ModelEngine(engine, scorer, trainable=True)


def _initialize(overrides: dict[str, Any] | None, **kwargs: Any) -> tuple[Any, ...]:
    """``initialize``; a failure while the config's ``deepspeed`` section sets keys of its own
    is a ``ConfigError`` naming them (DeepSpeed's parser accepts some settings this machine
    cannot run: ``fp16`` on a CPU fails only here)."""
    try:
        return initialize(**kwargs)
    except (ValueError, AssertionError, TypeError, KeyError, NotImplementedError) as exc:
        # what DeepSpeed raises for a setting it cannot honour; an out-of-memory or a
        # collective's failure (RuntimeError) is not a config error and goes up as it is
        keys = _user_deepspeed_keys(overrides)
        if not keys:
            raise
        from agentrl._errors import ConfigError

        raise ConfigError(
            f"deepspeed: DeepSpeed could not start the learner with {', '.join(keys)} set "
            f"here: {type(exc).__name__}: {exc}"
        ) from exc


def _user_deepspeed_keys(overrides: dict[str, Any] | None) -> list[str]:
    """The dotted DeepSpeed keys a config's ``deepspeed`` section sets beyond ZeRO-3's stage."""
    keys = []
    for key, value in (overrides or {}).items():
        if key == "zero_optimization" and isinstance(value, dict):
            keys += [f"deepspeed.{key}.{k}" for k in value if k != "stage"]
        else:
            keys.append(f"deepspeed.{key}")
    return keys


def open_reference(
    model_path: str,
    *,
    temperature: float,
    chunk_size: int = 1024,
    varlen: bool = True,
    kernels: str = "auto",
    overrides: dict[str, Any] | None = None,
) -> ModelEngine:
    """The frozen reference: every parameter ``requires_grad=False``, no optimizer section in
    its DeepSpeed config (ZeRO-3 inference), eval mode, scored under ``torch.no_grad``."""
    import_deepspeed()
    lm = _load_lm(model_path, gradient_checkpointing=False)
    lm.requires_grad_(False)
    scorer = TokenScorer(
        lm, temperature=temperature, chunk_size=chunk_size, varlen=varlen, kernels=kernels
    )
    scorer.eval()
    overrides = {k: v for k, v in (overrides or {}).items() if k not in ("optimizer", "scheduler")}
    config = deepspeed_config(optimizer=None, bf16=torch.cuda.is_available(), overrides=overrides)
    engine, *_ = _initialize(overrides, model=scorer, config=config)
    engine.eval()
    return ModelEngine(engine, scorer, trainable=False)


def open_critic(
    model_path: str,
    *,
    optimizer: OptimizerConfig,
    lr: float,
    total_updates: int,
    gradient_checkpointing: bool = False,
    varlen: bool = True,
    overrides: dict[str, Any] | None = None,
) -> ModelEngine:
    """The PPO critic: the policy's decoder (initialized from ``model_path``) with a zero-init
    scalar head; its own AdamW at ``lr``."""
    scorer = TokenScorer(
        _load_lm(model_path, gradient_checkpointing=gradient_checkpointing),
        value_head=True,
        varlen=varlen,
    )
    config = deepspeed_config(
        optimizer=optimizer, lr=lr, bf16=torch.cuda.is_available(), overrides=overrides
    )
    return _trained_engine(scorer, optimizer, config, total_updates, overrides)
