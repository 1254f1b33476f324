"""``agentrl plan memory``: the textbook 7B example, DeepSpeed's own estimators, exact parameter
counts against ``transformers``, and activation bytes against what autograd really saves."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from agentrl.cli import main
from agentrl.plan import MemorySettings, load_shape, plan_memory
from agentrl.plan._memory import activation_bytes
from agentrl.plan._shape import shape_from_config

TEXTBOOK = ["--model", "7B", "--optimizer-state", "bf16", "--zero", "0", "--kl-coef", "0.04"]
TEXTBOOK += ["--reward-model", "same", "--json"]


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", "memory", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("offload", "gpu_gb", "offloaded"),
    [
        ("none", 84, []),
        ("reference,reward", 56, ["reference_weights", "reward_weights"]),
        (
            "reference,reward,optimizer",
            28,
            ["policy_optimizer", "reference_weights", "reward_weights"],
        ),
    ],
)
def test_the_textbook_7b_grpo_example(capsys, offload, gpu_gb, offloaded):
    plan = plan_json(capsys, *TEXTBOOK, "--offload", offload)
    c = plan["components"]
    if offload == "none":
        assert c["policy_weights"] == c["reference_weights"] == c["reward_weights"] == 14e9
        assert c["gradients"] == 14e9 and c["optimizer"] == 28e9
    assert plan["model_states_bytes"] == plan["total_bytes"] == gpu_gb * 10**9
    assert sorted(plan["offloaded"]) == offloaded
    assert all(c[k] == 0 for k in ("activations", "logits", "kv_cache"))  # no architecture


def _tiny(cls, **kw):
    base = dict(vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=3)
    base.update(num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    base.update(kw)
    return cls(**base)


CONFIGS = {
    "llama-untied": (LlamaConfig, LlamaForCausalLM, {}),
    "llama-tied-mha": (
        LlamaConfig,
        LlamaForCausalLM,
        {"tie_word_embeddings": True, "num_key_value_heads": 8},
    ),
    "llama-biases": (LlamaConfig, LlamaForCausalLM, {"attention_bias": True, "mlp_bias": True}),
    "qwen2-tied": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "llama-head-dim": (LlamaConfig, LlamaForCausalLM, {"head_dim": 32}),
}


def _build(name: str):
    cfg_cls, model_cls, kw = CONFIGS[name]
    config = _tiny(cfg_cls, **kw)
    torch.manual_seed(0)
    return config, model_cls(config)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_counts_are_those_transformers_builds(name):
    from deepspeed.runtime.zero.stage3 import model_to_params

    config, model = _build(name)
    shape = shape_from_config(config.to_dict(), name)
    total, largest = model_to_params(model)
    assert (shape.params, shape.largest_layer_params) == (total, largest)


@pytest.mark.parametrize("gpus", [1, 3, 8])
@pytest.mark.parametrize("offload", ["none", "optimizer", "optimizer,params"])
def test_fp32_master_states_agree_with_deepspeeds_zero3_estimator(capsys, tmp_path, gpus, offload):
    from deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs,
        model_to_params,
    )

    config, model = _build("llama-untied")
    (tmp_path / "config.json").write_text(config.to_json_string())
    total, largest = model_to_params(model)
    _, gpu_mem, _ = estimate_zero3_model_states_mem_needs(
        total,
        largest,
        num_gpus_per_node=gpus,
        cpu_offload="optimizer" in offload,
        cpu_offload_params="params" in offload,
    )
    plan = plan_json(
        capsys,
        "--model",
        str(tmp_path),
        "--zero",
        "3",
        "--gpus",
        str(gpus),
        "--offload",
        offload,
        "--json",
    )
    assert abs(plan["model_states_bytes"] - gpu_mem) <= 3  # DeepSpeed rounds 18P/N once


@pytest.mark.parametrize("gpus", [1, 2, 8])
@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_fp32_master_states_agree_with_deepspeeds_zero2_estimator(capsys, tmp_path, gpus, offload):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    config, _ = _build("qwen2-tied")
    (tmp_path / "config.json").write_text(config.to_json_string())
    shape = load_shape(str(tmp_path))
    _, gpu_mem = estimate_zero2_model_states_mem_needs(
        shape.params, num_gpus_per_node=gpus, cpu_offload=offload == "optimizer"
    )
    plan = plan_json(
        capsys,
        "--model",
        str(tmp_path),
        "--zero",
        "2",
        "--gpus",
        str(gpus),
        "--offload",
        offload,
        "--json",
    )
    assert abs(plan["model_states_bytes"] - gpu_mem) <= 3


def _saved_bytes(model, tokens: int, checkpointing: bool) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward (parameters
    excluded): what the activations component predicts."""
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    else:
        model.gradient_checkpointing_disable()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids)
    return sum(seen.values())


@pytest.mark.parametrize("name", ["llama-untied", "qwen2-tied", "llama-head-dim"])
def test_activation_bytes_are_what_autograd_saves(name):
    """Without checkpointing the prediction is exact (every saved tensor is accounted for); with
    checkpointing the forward saves each layer's input (and the final norm), and the prediction
    adds one layer recomputed during backward, so it exceeds the forward's saved bytes by
    exactly that layer."""
    from agentrl.plan._memory import layer_activation_bytes

    config, model = _build(name)
    model = model.to(torch.bfloat16)
    config._attn_implementation = "sdpa"
    shape = shape_from_config(config.to_dict(), name)
    for tokens in (16, 48):
        assert _saved_bytes(model, tokens, False) == activation_bytes(shape, tokens, 2, False)
        recompute = tokens * (layer_activation_bytes(shape, 2) + 2 * 2 * shape.head_dim)
        predicted = activation_bytes(shape, tokens, 2, True) - recompute
        assert _saved_bytes(model, tokens, True) == predicted


def test_the_table_and_the_exit_code_say_whether_it_fits(capsys):
    assert main(["plan", "memory", *TEXTBOOK[:-1], "--gpu-memory", "80GB"]) == 1
    captured = capsys.readouterr()
    out = captured.out
    assert re.search(r"^total\s+84\.00\s+78\.23$", out, re.M), out
    assert re.search(r"^left of 74\.51 GiB\s+-4\.00", out, re.M), out
    assert "does not fit: 3.73 GiB over --gpu-memory 80GB per GPU" in captured.err, captured.err
    assert main(["plan", "memory", *TEXTBOOK[:-1], "--gpu-memory", "90GB"]) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--model", "7B", "--offload", "params", "--zero", "2"],
            "--offload params needs --zero 3",
        ),
        (["--model", "7B", "--offload", "gradients"], "--offload ['gradients']: not offloadable"),
        (["--model", "7B", "--offload", "reward"], "there is no reward model"),
        (["--model", "7B", "--gpu-memory", "lots"], "--gpu-memory 'lots': not a size"),
        (["--model", "7B", "--algorithm", "nope"], "--algorithm 'nope': one of"),
        (["--model", "0B"], "must be positive"),
        (["--model", "no-such-model"], "not a parameter count"),
        (["--model", "7B", "--gpus", "0"], "--gpus 0: at least 1"),
        (["--model", "7B", "--kl-coef", "nan"], "--kl-coef nan: must be a finite number >= 0"),
        (["--model", "7B", "--reward-model", "0B"], "--reward-model '0B': a parameter count must"),
        (["--model", "7B", "--seq-len", "0"], "--seq-len 0: at least 1"),
        (["--model", "7B", "--micro-batch-tokens", "0"], "--micro-batch-tokens 0: at least 1"),
        (["--model", "7B", "--offload", "reference"], "--offload reference: there is no refer"),
        (["--model", "9" * 400], "at most 1e+16 parameters"),
        (["--model", "7B", "--gpu-memory", "9" * 400], "--gpu-memory '999"),
    ],
)
def test_bad_options_are_named(capsys, argv, message):
    assert main(["plan", "memory", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_attention_heads", 0, "num_attention_heads 0: expected 1 to 2147483648"),
        ("num_hidden_layers", -200, "num_hidden_layers -200: expected 1 to"),
        ("num_key_value_heads", "x", "num_key_value_heads 'x': expected a whole number"),
        ("num_attention_heads", 4.9, "num_attention_heads 4.9: expected a whole number"),
        ("hidden_size", True, "hidden_size True: expected a whole number"),
        ("head_dim", 1e400, "head_dim inf: expected a whole number"),
        ("vocab_size", None, "lacks a usable 'vocab_size'"),
    ],
)
def test_a_config_json_dimension_that_is_not_a_size_is_named(
    tmp_path, capsys, field, value, message
):
    """A downloaded config.json sized nonsense (negative memory) or failed with a traceback
    (a division by zero heads, an overflow); each field is a whole number in range."""
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000,
              field: value}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    for flag in ("--model", "--reward-model"):
        argv = (
            [flag, str(tmp_path)] if flag == "--model" else ["--model", "7B", flag, str(tmp_path)]
        )
        assert main(["plan", "memory", *argv]) == 2
        err = capsys.readouterr().err
        assert f"{flag} {tmp_path}: config.json " in err and message in err, err


def test_a_config_that_is_not_a_llama_family_model_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768}))
    assert main(["plan", "memory", "--model", str(tmp_path)]) == 2
    assert "model_type 'gpt2' is not sized" in capsys.readouterr().err
    # a model_type that is not text is named briefly (a 300 KB list was printed whole)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": ["x" * 100] * 3000}))
    assert main(["plan", "memory", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not sized" in err and len(err) < 600, len(err)


def test_dimensions_each_in_range_whose_model_is_too_large_are_refused(tmp_path, capsys):
    """Every dimension at 2^31 passed each check; the parameter count (past 10^16) was not
    checked and the table's columns ran together."""
    big = 2**31
    config = {"model_type": "llama", "hidden_size": big, "num_hidden_layers": big,
              "num_attention_heads": big, "intermediate_size": big, "vocab_size": big}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", "memory", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "parameters: at most 1e+16" in err and err.count("\n") == 1, err


def test_ppo_counts_a_critic_with_its_own_states():
    shape = load_shape("1B")
    grpo = plan_memory(shape, MemorySettings(zero=0))
    ppo = plan_memory(shape, MemorySettings(zero=0, critic=True))
    assert ppo.components["critic_weights"] == grpo.components["policy_weights"]
    assert ppo.components["optimizer"] == 2 * grpo.components["optimizer"]


def test_zero3_runtime_buffers_are_counted_beside_the_model_states():
    """DeepSpeed's reduce bucket and the parameters ZeRO-3 keeps gathered are in the total, not
    in the model states its estimators describe; offloading the optimizer drops the bucket."""
    shape = load_shape("2B")
    plan = plan_memory(shape, MemorySettings(zero=3, gpus=8))
    assert plan.components["reduce_bucket"] == 2 * 500_000_000
    small = plan_memory(load_shape("100M"), MemorySettings(zero=3))
    assert small.components["reduce_bucket"] == 2 * 500_000_000  # allocated whole
    assert small.components["unreduced_gradients"] == 2 * 100_000_000  # one per parameter
    assert plan.components["live_parameters"] == 2 * 1_000_000_000
    assert plan.components["unreduced_gradients"] == 2 * 500_000_000
    assert plan.total_bytes == plan.model_states_bytes + 4 * 10**9
    offloaded = plan_memory(shape, MemorySettings(zero=3, gpus=8, offload=frozenset({"optimizer"})))
    assert offloaded.components["reduce_bucket"] == offloaded.components["unreduced_gradients"] == 0
    assert plan_memory(shape, MemorySettings(zero=1)).components["live_parameters"] == 0
