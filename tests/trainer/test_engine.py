"""The DeepSpeed ZeRO-3 learner on CPU (gloo, one process, tiny-random): log-probs equal the
plain HF model's, one ZeRO-3 step over several packed micro-batches equals a plain torch AdamW
step on the full batch, the reference is frozen and in no optimizer, PPO trains its critic."""

from __future__ import annotations

import msgspec
import pytest
import torch
from numerics import (
    EMULATION_SAFETY,
    assert_within,
    emulated_gradients,
    emulated_rounding_error,
    float64_transformers,
    unit_roundoff,
)
from rank_runs import run_worker
from transformers import AutoModelForCausalLM

from agentrl.kernels import interpreting, triton_installed
from agentrl.trainer import (
    OptimizerConfig,
    causal_lm_token_logprobs,
    deepspeed_config,
    group_index,
    grpo_advantages,
    lr_multiplier,
    pack_trajectories,
    policy_loss,
)

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`:FutureWarning"
)


def _plain(tiny_model_path, weights=None):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


def _adam_first_step_bound(grad, grad_error, weight, *, lr: float, eps: float) -> torch.Tensor:
    """How far two fp32 first Adam steps (no weight decay) may put a weight when their
    gradients may differ by ``grad_error``: the step is ``lr·g / (|g| + eps)`` (bias
    corrections cancel at step 1), increasing in ``g``, so it moves by at most ``f(g + δ) -
    f(g - δ)``; plus Adam's own arithmetic (a handful of roundings of the step, ``8u lr``) and
    the subtraction from the weight (``2u |w|``, one rounding in each run)."""
    g, w = grad.double(), weight.double()
    u = unit_roundoff(torch.float32)

    def step(x: torch.Tensor) -> torch.Tensor:
        return lr * x / (x.abs() + eps)

    return step(g + grad_error) - step(g - grad_error) + 8 * u * lr + 2 * u * w.abs()


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_zero3_step_equals_plain_adamw_on_the_full_batch(make_learner, make_groups, rng):
    """Several micro-batches, caller-owned accumulation, the LM head gathered as an external
    parameter: the log-probs, the pre-clip gradient norm and the updated weights all equal a
    plain HF model trained with torch AdamW on the same loss."""
    seed = rng.randrange(2**31)
    # eps 1e-5: Adam's first step is ~lr·sign(g); with eps 1e-8 a gradient of ~1e-9 (rare
    # vocabulary rows) would turn fp32 summation-order noise into a visible update
    learner = make_learner(micro_batch_tokens=40, eps=1e-5)  # grpo, no reference
    trajs = make_groups(seed)
    plain = _plain(learner.settings.model_path)
    batches = pack_trajectories(trajs, 40, pad_id=2)
    assert len(batches) >= 3, f"the test needs gradient accumulation; seed={seed}"
    # the engine's log-probs (ZeRO-3, gathered head) == the plain model's, within twice the
    # emulated fp32 error of each
    plain64 = float64_transformers(plain)
    with torch.no_grad():
        for b in batches:
            ours = learner.policy.score(b).logprobs
            want = causal_lm_token_logprobs(plain, b).logprobs
            _, dev = emulated_rounding_error(
                lambda b=b: causal_lm_token_logprobs(plain64, b).logprobs
            )
            assert_within(ours, want, 2 * EMULATION_SAFETY * dev.max(), f"seed={seed}")

    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
    adv = grpo_advantages(rewards, group_index([t.group_id for t in trajs])).tolist()

    def step_loss(model) -> torch.Tensor:
        """The learner's loss over the step's micro-batches (summed: their gradients add)."""
        total = torch.zeros((), dtype=torch.float64)
        for b in pack_trajectories(trajs, 40, pad_id=2, advantages=adv):
            out = causal_lm_token_logprobs(model, b)
            total = total + policy_loss(
                out.logprobs, b.rollout_logprobs, b.advantages, b.loss_mask,
                surrogate="clip", clip_low=0.2, clip_high=0.2, agg="seq-mean-token-mean",
                sequence_index=b.sequence_index, denominator=b.step_sequences,
                entropy=out.entropy, entropy_coef=0.0,
            ).loss  # fmt: skip
        return total

    opt = torch.optim.AdamW(
        plain.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-5, weight_decay=0.0
    )
    step_loss(plain).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()]).item()
    grads = {k: p.grad.clone() for k, p in plain.named_parameters()}
    before = {k: v.detach().clone() for k, v in plain.named_parameters()}
    opt.step()

    stats = learner.train_step(trajs)
    assert stats.micro_batches == len(batches) and stats.updates == 1
    # each fp32 gradient within S·(its deviation) of exact (numerics.emulated_gradients)
    names, params = zip(*plain64.named_parameters(), strict=True)
    _, deviations = emulated_gradients(lambda: step_loss(plain64), list(params))
    norm_bound = 2 * EMULATION_SAFETY * torch.cat([d.reshape(-1) for d in deviations]).norm()
    assert_within(stats.grad_norm, norm, norm_bound, f"grad norm; seed={seed}")
    got = learner.state_dict()
    for name, dev in zip(names, deviations, strict=True):
        bound = _adam_first_step_bound(
            grads[name], 2 * EMULATION_SAFETY * dev.max(), before[name], lr=1e-3, eps=1e-5
        )
        assert_within(got[name], plain.state_dict()[name], bound, f"{name}; seed={seed}")
    assert learner.version == 1


@pytest.mark.skipif(
    not (triton_installed() and interpreting()),
    reason="fp32 equality of whole steps needs Triton's interpreter (CPU); a GPU learner runs "
    "bf16, covered kernel by kernel in tests/kernels",
)
def test_fused_kernels_train_like_the_torch_paths(make_learner, make_groups, rng):
    """The learner with ``kernels='triton'`` (fused log-prob/entropy through ZeRO-3's gathered
    head, fused policy loss; the interpreter on CPU) takes the same steps as with the torch
    paths: same statistics, same weights within float tolerance."""
    seed = rng.randrange(2**31)
    algorithm = {"kl_coef": 0.05, "entropy_coef": 0.01, "name": "dapo"}
    learners = {k: make_learner(kernels=k, eps=1e-5, **algorithm) for k in ("torch", "triton")}
    stats = {k: [] for k in learners}
    for step in range(2):
        trajs = make_groups(seed + step, version=step)
        for k, learner in learners.items():
            stats[k].append(learner.train_step(trajs).as_dict())
    for a, b in zip(stats["torch"], stats["triton"], strict=True):
        for key in ("loss", "policy_loss", "kl_loss", "kl", "entropy", "grad_norm", "ratio_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), f"{key}; seed={seed}"
    diff = _max_diff(learners["triton"].state_dict(), learners["torch"].state_dict())
    assert diff < 1e-5, f"seed={seed}"


def test_reference_is_frozen_and_in_no_optimizer(make_learner, make_groups, rng):
    seed = rng.randrange(2**31)
    learner = make_learner(kl_coef=0.1)
    assert learner.reference is not None
    ref_params = learner.reference.parameters()
    assert ref_params and not any(p.requires_grad for p in ref_params)
    in_optimizers = {id(p) for p in learner.optimizer_parameters()}
    assert len(in_optimizers) == len(learner.policy.parameters())
    assert not in_optimizers & {id(p) for p in ref_params}
    assert learner.reference.optimizer_parameters() == []
    ref_before, policy_before = learner.reference.state_dict(), learner.state_dict()

    for step in range(2):
        stats = learner.train_step(make_groups(seed + step, version=step))
    assert learner.version == 2
    assert _max_diff(learner.reference.state_dict(), ref_before) == 0.0, f"seed={seed}"
    # Adam's first step moves a weight whose |g| ≥ eps by at least lr / 2 (lr·g / (|g| + eps))
    assert _max_diff(learner.state_dict(), policy_before) > 1e-3 / 2, "the policy did not move"
    record = stats.as_dict()
    assert record["kl"] is not None and record["kl"] > 0, f"seed={seed}"


def test_ppo_trains_the_critic(make_learner, make_groups, rng):
    seed = rng.randrange(2**31)
    learner = make_learner(name="ppo", kl_coef=0.05, kl_mode="reward", kl_estimator="k1")
    assert learner.critic is not None
    critic_ids = {id(p) for p in learner.critic.parameters()}
    assert critic_ids <= {id(p) for p in learner.optimizer_parameters()}
    head = learner.critic.scorer.value_head
    before = head.weight.ds_tensor.clone()  # this rank's ZeRO-3 partition
    stats = learner.train_step(make_groups(seed, groups=2, size=2))
    assert stats.value_loss > 0 and stats.updates == 1, f"seed={seed}"
    assert not torch.equal(head.weight.ds_tensor, before), "the critic did not move"


def test_dapo_drops_groups_with_equal_rewards(make_learner, make_groups, rng):
    seed = rng.randrange(2**31)
    learner = make_learner(name="dapo")
    trajs = make_groups(seed, groups=3, size=3)
    trajs[:3] = [msgspec.structs.replace(t, reward=1.0) for t in trajs[:3]]  # group g0: all equal
    stats = learner.train_step(trajs)
    assert stats.groups_filtered == 1 and stats.trajectories_used == 6, f"seed={seed}"
    assert stats.loss_tokens == sum(sum(t.loss_mask) for t in trajs[3:])


def test_lr_schedule():
    warm = OptimizerConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    f = lr_multiplier(warm, total_updates=14)
    assert [f(u) for u in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # a cosine and a few float64 operations on values ≤ 1: a handful of ulps
    ulps = 16 * unit_roundoff(torch.float64)
    assert f(4) == pytest.approx(1.0, abs=ulps) and f(9) == pytest.approx(0.55, abs=ulps)
    assert f(14) == 0.1 and f(100) == pytest.approx(0.1, abs=ulps)
    linear = lr_multiplier(OptimizerConfig(schedule="linear"), total_updates=10)
    assert [round(linear(u), 6) for u in (0, 5, 10)] == [1.0, 0.5, 0.0]
    assert lr_multiplier(OptimizerConfig(), 10)(7) == 1.0


def test_deepspeed_config_uses_torch_adamw_and_merges_overrides():
    opt = OptimizerConfig(lr=3e-4, weight_decay=0.1, grad_clip=0.5)
    cfg = deepspeed_config(
        optimizer=opt,
        bf16=False,
        overrides={"zero_optimization": {"overlap_comm": False}, "gradient_clipping": 2.0},
    )
    assert cfg["zero_optimization"] == {
        "stage": 3,
        "stage3_gather_16bit_weights_on_model_save": True,
        "overlap_comm": False,
    }
    assert cfg["optimizer"]["params"]["torch_adam"] is True  # no JIT-built CPU Adam
    assert cfg["optimizer"]["params"]["lr"] == 3e-4 and cfg["gradient_clipping"] == 2.0
    assert cfg["managed_gradient_accumulation"] is False
    assert "optimizer" not in deepspeed_config(optimizer=None, bf16=False)


def test_a_lone_learner_binds_no_port(tmp_path):
    """One process, no ``MASTER_PORT`` given: the group needs no port, so a port taken between
    picking it and binding it (another run starting on this machine) cannot fail the run.
    Here the port it would pick is already held."""
    worker = tmp_path / "lone.py"
    worker.write_text(
        "import os, socket, sys\n"
        "import torch\n"
        "import agentrl.trainer._engine as e\n"
        "held = socket.socket(); held.bind(('127.0.0.1', 0)); held.listen()\n"
        "port = held.getsockname()[1]\n"
        "e._free_port = lambda: port\n"
        "info = e.init_distributed(num_threads=1)\n"
        "t = torch.ones(2); torch.distributed.all_reduce(t)\n"
        "torch.save({'world': info.world_size, 'sum': t.tolist(),\n"
        "            'port_kept': os.environ['MASTER_PORT'] == str(port)}, sys.argv[1])\n"
    )
    seen = run_worker(worker, 1, tmp_path / "out.pt", timeout=300)
    assert seen == {"world": 1, "sum": [1.0, 1.0], "port_kept": True}


def test_engines_are_built_without_loading_muon_or_inductor(tmp_path, tiny_model_path):
    """DeepSpeed's ZeRO set-up imports its Muon optimizer, whose ``torch.compile`` wrappers load
    TorchInductor (seconds of CPU on every rank), only to ask whether the optimizer is Muon:
    agentrl's policy and reference engines are built without either, and the real Muon module
    still imports afterwards."""
    worker = tmp_path / "no_muon.py"
    worker.write_text(
        "import sys, torch\n"
        "from agentrl.trainer import OptimizerConfig, init_distributed, open_policy,"
        " open_reference\n"
        "init_distributed(num_threads=1)\n"
        "policy = open_policy(sys.argv[2], optimizer=OptimizerConfig(), total_updates=1,"
        " temperature=1.0)\n"
        "reference = open_reference(sys.argv[2], temperature=1.0)\n"
        "muon = 'deepspeed.runtime.zero.muon.muon_optimizer'\n"
        "loaded = [m for m in (muon, 'torch._inductor.compile_fx') if m in sys.modules]\n"
        "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam\n"
        "torch.save({'loaded': loaded,\n"
        "            'real': issubclass(MuonWithAuxAdam, torch.optim.Optimizer),\n"
        "            'trains': policy.trainable, 'frozen': not reference.trainable},"
        " sys.argv[1])\n"
    )
    seen = run_worker(worker, 1, tmp_path / "out.pt", str(tiny_model_path), timeout=300)
    assert seen == {"loaded": [], "real": True, "trains": True, "frozen": True}


def test_the_schedule_moves_by_a_whole_step_when_a_step_makes_fewer_updates(
    make_learner, make_groups, rng
):
    """mini_batches=4 over 2 groups makes 2 updates; the LR schedule still counts 4, so a
    decay over total_steps × epochs × mini_batches ends at the run's last step."""
    seed = rng.randrange(2**31)
    learner = make_learner(mini_batches=4)
    stats = learner.train_step(make_groups(seed, groups=2, size=2))
    assert stats.updates == 2, f"seed={seed}"
    assert learner.policy.engine.lr_scheduler.updates == 4
    stats = learner.train_step([])  # nothing to train on: no update, a whole step of schedule
    assert stats.updates == 0 and learner.policy.engine.lr_scheduler.updates == 8


def _model_folder(tmp_path, config) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    return str(tmp_path)


def _tiny(kind: str, **extra):
    import transformers

    shapes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64}
    shapes |= {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    if kind == "GPT2Config":
        shapes = {"vocab_size": 64, "n_embd": 32, "n_layer": 1, "n_head": 4}
    return getattr(transformers, kind)(**shapes, **extra)


@pytest.mark.parametrize(
    ("kind", "dropout"),
    [
        ("LlamaConfig", {"attention_dropout": 0.5}),
        ("GPT2Config", {"resid_pdrop": 0.5, "embd_pdrop": 0.5, "attn_pdrop": 0.5}),
    ],
)
def test_the_trained_model_never_drops_out(tmp_path, kind, dropout):
    """A checkpoint whose config asks for dropout would make π_θ and π_old differ on the same
    tokens with nothing trained (ratios ≠ 1): the learner loads it with every dropout at 0."""
    from agentrl.trainer._engine import _load_lm

    path = _model_folder(tmp_path, _tiny(kind, **dropout))
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    plain = AutoModelForCausalLM.from_pretrained(path).train()
    assert not torch.equal(plain(ids).logits, plain(ids).logits), "the test needs dropout"
    lm = _load_lm(path, gradient_checkpointing=False).train()
    for name in dropout:
        assert getattr(lm.config, name) == 0.0, name
    assert torch.equal(lm(ids).logits, lm(ids).logits)


@pytest.mark.parametrize(
    ("kind", "extra", "divisor"),
    [
        ("CohereConfig", {"logit_scale": 0.25}, 4.0),  # logits · 0.25
        ("GraniteConfig", {"logits_scaling": 8.0}, 8.0),  # logits / 8
        ("LlamaConfig", {}, 1.0),
    ],
)
def test_a_head_that_scales_its_logits_is_scored_as_the_model_samples(
    tmp_path, kind, extra, divisor
):
    """The learner's log-probs are softmax(h·Wᵀ/τ): a model whose forward scales its logits
    has the scale folded into τ, giving the log-probs of the model's own logits at τ."""
    from agentrl.trainer._engine import TokenScorer, _load_lm

    lm = _load_lm(_model_folder(tmp_path, _tiny(kind, **extra)), gradient_checkpointing=False)
    scorer = TokenScorer(lm, temperature=0.7, varlen=False, kernels="torch")
    assert scorer.temperature == pytest.approx(0.7 * divisor, rel=1e-15)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    with torch.no_grad():
        hidden = lm.get_decoder()(input_ids=ids).last_hidden_state.double()
        weight = lm.get_output_embeddings().weight.double()
        ours = torch.log_softmax(hidden @ weight.T / scorer.temperature, dim=-1)
        theirs = torch.log_softmax(lm(ids).logits.double() / 0.7, dim=-1)
    # fp32 logits from the model against float64 from its fp32 hidden states: a few ulps of
    # the logits' magnitude, divided by τ
    bound = 64 * unit_roundoff(torch.float32) * float(theirs.abs().max())
    assert float((ours - theirs).abs().max()) <= bound


def test_a_head_the_learner_cannot_reproduce_is_refused(tmp_path):
    from agentrl.trainer._engine import TokenScorer, _load_lm

    gemma = _tiny("Gemma2Config", final_logit_softcapping=30.0, head_dim=8)
    lm = _load_lm(_model_folder(tmp_path / "gemma", gemma), gradient_checkpointing=False)
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0 \\(gemma2\\)"):
        TokenScorer(lm, varlen=False)
    lm = _load_lm(
        _model_folder(tmp_path / "llama", _tiny("LlamaConfig")), gradient_checkpointing=False
    )
    lm.lm_head = torch.nn.Linear(32, 64, bias=True)
    with pytest.raises(ValueError, match="LM head has a bias"):
        TokenScorer(lm, varlen=False)


@pytest.mark.parametrize("damage", ["not-json", "negative-width", "lying-weights", "huge-header"])
def test_a_broken_model_folder_is_a_model_error_naming_it(tmp_path, tiny_model_path, damage):
    """A model folder someone else made: the learner's load raised transformers', torch's or
    safetensors' own errors (a traceback); it is one ``ModelError`` naming the folder."""
    import json
    import shutil
    import struct

    from agentrl._errors import ModelError
    from agentrl.trainer._engine import _load_lm

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "config.json").read_text())
    weights = folder / "model.safetensors"
    if damage == "not-json":
        (folder / "config.json").write_text("{not json")
    elif damage == "negative-width":
        (folder / "config.json").write_text(json.dumps({**config, "hidden_size": -64}))
    elif damage == "lying-weights":
        (folder / "config.json").write_text(
            json.dumps({**config, "vocab_size": 4 * config["vocab_size"]})
        )
    else:
        data = weights.read_bytes()
        weights.write_bytes(struct.pack("<Q", 1 << 62) + data[8:])
    with pytest.raises(ModelError, match=f"the learner cannot load the model in {folder}"):
        _load_lm(str(folder), gradient_checkpointing=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 and CPU-only Triton: a CPU learner")
def test_settings_this_machine_cannot_run_are_named_before_the_first_rollout(
    tmp_path, tiny_model_path
):
    """``deepspeed.fp16.enabled`` passes DeepSpeed's parser and failed in its ``initialize`` with
    a traceback; ``train.kernels: triton`` on a CPU failed at the first update, after a whole
    rollout. Both are one ConfigError now, raised while the learner is built."""
    worker = tmp_path / "cannot.py"
    worker.write_text(
        "import os, sys, torch\n"
        "os.environ.pop('TRITON_INTERPRET', None)  # the interpreter would run it on a CPU\n"
        "from agentrl import ConfigError\n"
        "from agentrl.trainer import init_distributed, open_reference\n"
        "from agentrl.trainer._learner import _check_kernels\n"
        "init_distributed(num_threads=1)\n"
        "said = []\n"
        "try:\n"
        "    fp16 = {'fp16': {'enabled': True}, 'zero_optimization': {'stage': 3}}\n"
        "    open_reference(sys.argv[2], temperature=1.0, overrides=fp16)\n"
        "except ConfigError as exc:\n"
        "    said.append(str(exc))\n"
        "try:\n"
        "    _check_kernels('triton')\n"
        "except ConfigError as exc:\n"
        "    said.append(str(exc))\n"
        "_check_kernels('auto')\n"
        "torch.save(said, sys.argv[1])\n"
    )
    said = run_worker(worker, 1, tmp_path / "out.pt", str(tiny_model_path), timeout=300)
    assert len(said) == 2, said
    assert said[0].startswith("deepspeed: DeepSpeed could not start the learner with "
                              "deepspeed.fp16 set here: "), said  # fmt: skip
    assert said[1].startswith("train.kernels: backend='triton' cannot run here: "), said


def test_a_steps_grad_norm_is_the_largest_of_its_updates(make_learner, make_groups, rng):
    """With several updates a step reported its last update's norm; a spike in an earlier one
    was invisible. The real updates run; their norms are recorded as they return."""
    seed = rng.randrange(2**31)
    learner = make_learner(mini_batches=2)
    norms: list[float] = []
    step = learner.policy.step

    def recorded() -> float:
        norms.append(step())
        return norms[-1]

    learner.policy.step = recorded  # type: ignore[method-assign]
    earlier_larger = 0
    for k in range(6):  # until a step whose first update has the larger norm (last != max)
        norms.clear()
        stats = learner.train_step(make_groups(seed + k, groups=2, size=2))
        assert stats.updates == len(norms) == 2, f"seed={seed}"
        assert stats.grad_norm == max(norms), (norms, f"seed={seed}")
        earlier_larger += norms[0] > norms[1]
        if earlier_larger:
            break
    assert earlier_larger, f"no step's first update had the larger norm; seed={seed}"
