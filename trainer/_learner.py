"""One learner step: trajectories → rewards → advantages → micro-batches → DeepSpeed updates.

Order inside ``Learner.train_step`` (each phase is timed for the ledger):

1. keep trajectories with a reward (errors carry no signal); algorithm masks: DAPO's dynamic
   sampling (all-equal groups) and overlong filter, combined with each ``loss_mask`` by packing;
2. split the groups into ``mini_batches`` and pack each (``pack_shared_prefix`` by default: a
   group's prompt once per micro-batch; ``pack_trajectories``; or the padded fallback) into
   micro-batches of at most ``micro_batch_tokens`` positions;
3. ``reference``: the frozen reference's logprobs (only when ``kl_coef > 0``);
4. ``logprob``: with ``old_logprobs: recompute``, the policy's own logprobs before the update
   (π_old; TIS then corrects π_old/π_rollout); the critic's values (GAE algorithms);
5. advantages: group estimators per trajectory (the KL folded into the reward first when
   ``kl_mode: reward``), or GAE over the sampled tokens with the critic (the algorithm's
   estimator, from the table in ``_algorithms``);
6. ``update``: per mini-batch, forward + ``policy_loss`` + backward on every micro-batch, then
   one optimizer ``step``; the loss of each micro-batch is divided by the *mini-batch's*
   token/sequence count (``PackedBatch.step_loss_tokens`` / ``step_sequences``, summed over
   ranks and multiplied by the world size, since DeepSpeed averages gradients over ranks), so
   gradient accumulation and data parallelism give exactly the full-batch gradient.

All ranks run the same number of micro-batches (ZeRO-3 gathers parameters collectively): a rank
with fewer pads with an empty one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentrl._types import Trajectory

from ._advantages import dynamic_sampling_mask, gae_advantages, group_index, terminal_rewards
from ._batch import PackedBatch, overlong_filter, pack_trajectories, pad_trajectories
from ._config import AlgorithmConfig, OptimizerConfig
from ._dist import rank_world
from ._engine import ModelEngine, open_critic, open_policy, open_reference
from ._kl import kl_estimate, kl_in_reward
from ._losses import policy_loss, value_loss
from ._prefix import pack_shared_prefix
from ._stats import StepStats


@dataclass(frozen=True)
class LearnerSettings:
    """Everything the learner needs besides its engines' process group."""

    model_path: str
    algorithm: AlgorithmConfig
    optimizer: OptimizerConfig
    total_steps: int
    """Learner steps of the whole run (the LR schedule's horizon)."""
    temperature: float
    """The rollout's sampling temperature: logprobs are scored at it."""
    pad_id: int
    micro_batch_tokens: int = 4096
    packing: bool = True
    varlen_attention: bool = True
    """Per-sequence attention (``_attention``) instead of a dense block-causal mask."""
    share_prefix: bool = True
    """Store each group's common prompt once per micro-batch (``_prefix``; packed + varlen)."""
    gradient_checkpointing: bool = False
    chunk_size: int = 1024
    kernels: str = "auto"
    """Fused Triton kernels for log-probs and the policy loss: auto (on CUDA), triton, torch."""
    norm_length: float = 1024.0
    """Dr.GRPO's constant when ``algorithm.norm_length`` is unset (the generation budget)."""
    deepspeed: dict[str, Any] = dataclasses.field(default_factory=dict)


def _all_reduce(value: float, op: str = "sum") -> float:
    if rank_world()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist = torch.distributed
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return float(t.item())


def _check_kernels(kernels: str) -> None:
    """``kernels="triton"`` where Triton cannot run is a ``ConfigError`` before any model loads
    (not at the first update, after a whole rollout)."""
    if kernels != "triton":
        return
    from agentrl._errors import ConfigError
    from agentrl.kernels import use_triton

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        use_triton("triton", device, "train.kernels")
    except RuntimeError as exc:
        raise ConfigError(f"{exc} (train.kernels: auto picks what runs)") from None


class Learner:
    """The policy (and reference, critic) engines and the step that trains them. ``version``
    counts published policy versions: 0 is the initial weights, each ``train_step`` adds 1."""

    def __init__(self, settings: LearnerSettings) -> None:
        _check_kernels(settings.kernels)
        alg = settings.algorithm.resolved()
        self.settings = dataclasses.replace(settings, algorithm=alg)
        self.version = 0
        updates = settings.total_steps * alg.epochs * alg.mini_batches
        self.policy: ModelEngine = open_policy(
            settings.model_path,
            optimizer=settings.optimizer,
            total_updates=updates,
            temperature=settings.temperature,
            chunk_size=settings.chunk_size,
            gradient_checkpointing=settings.gradient_checkpointing,
            varlen=settings.varlen_attention,
            kernels=settings.kernels,
            overrides=settings.deepspeed,
        )
        self.reference: ModelEngine | None = None
        if alg.needs_reference:
            self.reference = open_reference(
                settings.model_path,
                temperature=settings.temperature,
                chunk_size=settings.chunk_size,
                varlen=settings.varlen_attention,
                kernels=settings.kernels,
                overrides=settings.deepspeed,
            )
        self.critic: ModelEngine | None = None
        if alg.spec.needs_critic:
            self.critic = open_critic(
                settings.model_path,
                optimizer=settings.optimizer,
                lr=alg.critic_lr or settings.optimizer.lr,
                total_updates=updates,
                gradient_checkpointing=settings.gradient_checkpointing,
                varlen=settings.varlen_attention,
                overrides=settings.deepspeed,
            )

    # -- batching -----------------------------------------------------------------------------

    def _pack(self, trajs: Sequence[Trajectory], masks: Sequence[float]) -> list[PackedBatch]:
        s = self.settings
        pack = pack_trajectories if s.packing else pad_trajectories
        if s.packing and s.varlen_attention and s.share_prefix:
            pack = pack_shared_prefix
        batches = pack(trajs, s.micro_batch_tokens, pad_id=s.pad_id, algorithm_mask=masks)
        target = int(_all_reduce(len(batches), "max"))
        while len(batches) < target:  # keep ZeRO-3's collective gathers in step across ranks
            batches.append(self._empty_batch(batches))
        return batches

    def _empty_batch(self, batches: list[PackedBatch]) -> PackedBatch:
        one = torch.ones(1, 1, dtype=torch.long)
        zero_i, zero_f = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1)
        steps = (batches[0].step_loss_tokens, batches[0].step_sequences) if batches else (0, 0)
        return PackedBatch(
            input_ids=one * self.settings.pad_id,
            position_ids=zero_i,
            attention_mask=one.bool(),
            sequence_index=zero_i,
            targets=one * self.settings.pad_id,
            loss_mask=zero_i.bool(),
            rollout_logprobs=zero_f,
            advantages=zero_f,
            trajectory_index=torch.full((1,), -1, dtype=torch.long),
            sequence_row=torch.zeros(1, dtype=torch.long),
            sequence_start=torch.zeros(1, dtype=torch.long),
            sequence_lengths=torch.ones(1, dtype=torch.long),
            packed=True,
            step_loss_tokens=steps[0],
            step_sequences=steps[1],
        )

    def _denominator(self, batch: PackedBatch, *, tokens: bool = False) -> float:
        """The loss denominator of ``batch``'s mini-batch over all ranks, divided by the world
        size (DeepSpeed averages gradients over ranks)."""
        agg = "token-mean" if tokens else self.settings.algorithm.agg
        local = batch.step_loss_tokens if agg == "token-mean" else batch.step_sequences
        world = rank_world()[1]
        return max(1.0, _all_reduce(float(local))) / world

    # -- the step -----------------------------------------------------------------------------

    def train_step(self, trajectories: Sequence[Trajectory]) -> StepStats:
        """Train on one step's trajectories (all sampled by ``self.version``) and advance
        ``version``. Returns the step's statistics (see ``StepStats``)."""
        alg = self.settings.algorithm
        stats = StepStats(trajectories_in=len(trajectories))
        lr = self.policy.lr()  # the rate this step's first update uses
        trajs = [t for t in trajectories if t.reward is not None and t.status != "error"]
        rewards = torch.tensor([float(t.reward) for t in trajs], dtype=torch.float64)  # type: ignore[arg-type]
        groups = group_index([t.group_id for t in trajs])
        masks = torch.ones(len(trajs), dtype=torch.float64)
        if alg.overlong_filter:
            masks *= torch.tensor(overlong_filter(trajs), dtype=torch.float64)
        if alg.dynamic_sampling and len(trajs):
            keep = dynamic_sampling_mask(rewards, groups)
            stats.groups_filtered = int(groups[~keep].unique().numel())
            masks *= keep.to(torch.float64)
        # every rank makes the same number of updates (each one a ZeRO-3 collective), however
        # many groups it holds: a rank with fewer takes empty mini-batches
        local_groups = int(groups.max()) + 1 if groups.numel() else 0
        parts = int(_all_reduce(float(min(alg.mini_batches, local_groups)), "max"))
        order = _mini_batch_split(groups, parts)
        mini = [self._pack([trajs[i] for i in idx], masks[idx].tolist()) for idx in order]
        stats.trajectories_used = int((masks > 0).sum())

        started = time.perf_counter()
        ref = [[self._score(self.reference, b) for b in mb] for mb in mini]
        stats.reference_s = time.perf_counter() - started
        started = time.perf_counter()
        recompute = alg.old_logprobs == "recompute"
        old = [
            [self._score(self.policy, b) if recompute else b.rollout_logprobs for b in mb]
            for mb in mini
        ]
        values = [[self._score(self.critic, b) for b in mb] for mb in mini]
        stats.logprob_s = time.perf_counter() - started

        filled = self._advantages(mini, order, rewards, groups, old, ref, values)
        started = time.perf_counter()
        for epoch in range(alg.epochs):
            for k, batches in enumerate(filled):
                # before the first update every forward runs on π_old: the exact mismatch
                exact = epoch == 0 and k == 0 and not recompute
                self._update(batches, old[k], ref[k], values[k], stats, epoch == 0, exact)
        stats.update_s = time.perf_counter() - started
        # fewer updates than epochs × mini_batches (fewer groups, nothing left to train on):
        # the LR schedule still moves by a whole step, so it ends where total_steps says
        missing = alg.epochs * alg.mini_batches - stats.updates
        for engine in (self.policy, self.critic):
            if engine is not None and missing > 0:
                engine.advance_schedule(missing)
        if recompute:  # the exact rollout↔trainer gap, every token
            for mb, old_mb in zip(mini, old, strict=True):
                for b, lp in zip(mb, old_mb, strict=True):
                    stats.mismatch.add(lp, b.rollout_logprobs, b.loss_mask)
        self.version += 1
        return stats.finish(lr)

    @torch.no_grad()
    def _score(self, engine: ModelEngine | None, batch: PackedBatch) -> torch.Tensor | None:
        if engine is None:
            return None
        return engine.score(batch).logprobs.detach().cpu()

    def _advantages(self, mini, order, rewards, groups, old, ref, values) -> list[list]:
        """Per mini-batch, ``(batch with advantages, returns or None)`` per micro-batch."""
        alg = self.settings.algorithm
        estimator = alg.spec.advantages
        if estimator == "gae":
            return self._gae(mini, order, rewards, old, ref, values)
        rewards = rewards.clone()
        if alg.kl_mode == "reward" and self.reference is not None:
            for mb, idx, old_mb, ref_mb in zip(mini, order, old, ref, strict=True):
                for b, lp, rlp in zip(mb, old_mb, ref_mb, strict=True):
                    kl = kl_estimate(lp.double(), rlp.double(), alg.kl_estimator)
                    seq_kl = _per_sequence(b, torch.where(b.loss_mask, kl, 0.0))
                    for s, traj in enumerate(b.trajectory_index.tolist()):
                        if traj >= 0:
                            rewards[idx[traj]] -= alg.kl_coef * float(seq_kl[s])
        adv = estimator(rewards, groups)
        out = []
        for mb, idx in zip(mini, order, strict=True):
            local = adv[idx]
            out.append([(_fill(b, local), None) for b in mb])
        return out

    def _gae(self, mini, order, rewards, old, ref, values) -> list[list]:
        """GAE: outcome reward on each sequence's last sampled token (KL folded in per token
        with ``kl_mode: reward``), GAE over sampled tokens, whitened over the whole step."""
        alg = self.settings.algorithm
        out = []
        for mb, idx, old_mb, ref_mb, val_mb in zip(mini, order, old, ref, values, strict=True):
            local = rewards[idx]
            filled = []
            for b, lp, rlp, val in zip(mb, old_mb, ref_mb, val_mb, strict=True):
                index = b.trajectory_index.clamp(min=0)
                seq_rewards = local[index] if local.numel() else rewards.new_zeros(len(index))
                token_rewards = terminal_rewards(seq_rewards, b.loss_mask, b.sequence_index)
                if alg.kl_mode == "reward" and rlp is not None:
                    token_rewards = kl_in_reward(
                        token_rewards, lp.double(), rlp.double(), b.loss_mask,
                        kl_coef=alg.kl_coef, estimator=alg.kl_estimator,
                    )  # fmt: skip
                gae = gae_advantages(
                    token_rewards, val.double(), b.loss_mask,
                    gamma=alg.gamma, lam=alg.lam, sequence_index=b.sequence_index,
                )  # fmt: skip
                filled.append((b, gae))
            out.append(filled)
        mean, std = 0.0, 1.0
        if alg.whiten_advantages:  # over the whole step: every rank's tokens (one collective)
            pieces = [g.advantages[b.loss_mask].double() for mb in out for b, g in mb]
            selected = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64)
            moments = torch.stack([torch.tensor(float(selected.numel()), dtype=torch.float64),
                                   selected.sum(), selected.square().sum()])  # fmt: skip
            if rank_world()[1] > 1:
                torch.distributed.all_reduce(moments)
            n, total, squares = moments.tolist()
            if n > 1:
                mean = total / n
                std = max((squares - total * mean) / (n - 1), 0.0) ** 0.5  # Bessel, like .std()
        return [
            [
                (
                    dataclasses.replace(
                        b,
                        advantages=torch.where(
                            b.loss_mask, (g.advantages - mean) / (std + 1e-8), 0.0
                        ).float(),
                    ),
                    g.returns.float(),
                )
                for b, g in mb
            ]
            for mb in out
        ]

    def _update(self, batches, old, ref, values, stats, first: bool, exact: bool) -> None:
        """One optimizer update over a mini-batch's micro-batches (and the critic's); none when
        nothing is left to train on (every rank then has no micro-batch either)."""
        if not batches:
            return
        alg = self.settings.algorithm
        device = self.policy.device
        for (batch, returns), old_lp, ref_lp, val in zip(batches, old, ref, values, strict=True):
            out = self.policy.score(batch)
            b = batch.to(device)
            loss = policy_loss(
                out.logprobs,
                old_lp.to(device),
                b.advantages,
                b.loss_mask,
                surrogate=alg.surrogate,
                clip_low=alg.clip_low,  # type: ignore[arg-type]
                clip_high=alg.clip_high,
                agg=alg.agg,  # type: ignore[arg-type]
                sequence_index=b.sequence_index,
                denominator=self._denominator(batch),
                norm_length=alg.norm_length or self.settings.norm_length,
                ref_logprobs=ref_lp.to(device) if ref_lp is not None else None,
                kl_coef=alg.kl_coef if alg.kl_mode == "loss" else 0.0,
                kl_estimator=alg.kl_estimator,
                entropy=out.entropy,
                entropy_coef=alg.entropy_coef,
                rollout_logprobs=b.rollout_logprobs,
                tis_cap=alg.tis_cap,
                clip_ratio_c=alg.clip_ratio_c,
                kernels=self.settings.kernels,
            )
            self.policy.backward(loss.loss)
            stats.add_loss(loss, batch.loss_mask)
            lp = out.logprobs.detach().cpu()
            if first:
                stats.tokens.add(lp, batch.rollout_logprobs, batch.loss_mask, ref_lp)
            if exact:
                stats.mismatch.add(lp, batch.rollout_logprobs, batch.loss_mask)
            if self.critic is not None and returns is not None:
                v = self.critic.score(batch).logprobs
                vl = value_loss(
                    v, val.to(device), returns.to(device), b.loss_mask,
                    clip_range=alg.value_clip, denominator=self._denominator(batch, tokens=True),
                )  # fmt: skip
                self.critic.backward(vl.loss)
                stats.value_loss += float(vl.loss.detach())
        norm = self.policy.step()
        if norm is not None:  # None: DeepSpeed reported no norm for this update
            stats.norms.append(norm)
        stats.updates += 1
        if self.critic is not None:
            self.critic.step()

    # -- publication and checkpoints ----------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full weights under HF names (every rank), for publication."""
        return self.policy.state_dict()

    def save(self, directory: str) -> None:
        """DeepSpeed checkpoints of the trained engines (model, optimizer, LR schedule) under
        ``directory/policy`` (and ``critic``); every rank must call it."""
        self.policy.engine.save_checkpoint(directory, tag="policy", client_state={})
        if self.critic is not None:
            self.critic.engine.save_checkpoint(directory, tag="critic", client_state={})

    def load(self, directory: str, version: int, *, universal: bool = False) -> None:
        """Restore the trained engines from ``directory`` (``save``'s layout); ``universal``:
        it holds DeepSpeed universal checkpoints (another world size's state, re-partitioned
        for this one at load time)."""
        for tag, engine in (("policy", self.policy), ("critic", self.critic)):
            if engine is None:
                continue
            config = engine.engine._config  # DeepSpeed reads this flag at load time only
            config.load_universal_checkpoint, before = universal, config.load_universal_checkpoint
            try:
                path, _ = engine.engine.load_checkpoint(
                    directory, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
                )
            finally:
                config.load_universal_checkpoint = before
            if path is None:
                raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {directory}")
        self.version = version

    def optimizer_parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter any optimizer of this learner updates."""
        engines = (self.policy, self.critic, self.reference)
        return [p for e in engines if e is not None for p in e.optimizer_parameters()]


def _mini_batch_split(groups: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Trajectory indices of each of ``parts`` mini-batches: whole groups, in order, as even as
    possible; some are empty when there are fewer groups than parts."""
    num = int(groups.max()) + 1 if groups.numel() else 0
    if parts == 0:
        return []
    bounds = [round(num * k / parts) for k in range(parts + 1)]
    return [
        torch.nonzero((groups >= bounds[k]) & (groups < bounds[k + 1])).flatten()
        for k in range(parts)
    ]


def _per_sequence(batch: PackedBatch, values: torch.Tensor) -> torch.Tensor:
    seq = batch.sequence_index.flatten()
    keep = seq >= 0
    out = values.new_zeros(batch.num_sequences)
    return out.index_add_(0, seq[keep], values.flatten()[keep])


def _fill(batch: PackedBatch, per_trajectory: torch.Tensor) -> PackedBatch:
    """``batch`` with every loss token's advantage set to its trajectory's value."""
    if batch.num_sequences == 0 or per_trajectory.numel() == 0:
        return batch
    traj = batch.trajectory_index.clamp(min=0)
    seq = batch.sequence_index.clamp(min=0)
    values = per_trajectory.to(torch.float32)[traj][seq]
    return dataclasses.replace(batch, advantages=torch.where(batch.loss_mask, values, 0.0))
