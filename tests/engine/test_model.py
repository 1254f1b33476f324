"""Our forward pass (``_model``) against transformers on the same weights (|Δ logprob| ≤ 1e-4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config

from agentrl._errors import EngineError
from agentrl._models import resolve_model
from agentrl.engine._batch import Row, build_forward_batch
from agentrl.engine._kv import KVPool
from agentrl.engine._model import CausalLM, ModelConfig, rope_frequencies

TOLERANCE = 1e-4


def our_logprobs(model: CausalLM, ids: list[int], chunks: list[int], block_size: int = 16):
    """Log-probs ``[len(ids), vocab]`` from our model, feeding ``ids`` in ``chunks`` (sizes)."""
    c = model.config
    pool = KVPool(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        num_blocks=len(ids) // block_size + 2,
        block_size=block_size,
    )
    blocks = list(reversed(pool.alloc(pool.num_blocks)))  # a non-trivial block table
    out, start = [], 0
    for count in chunks:
        batch = build_forward_batch([Row(ids, start, count, blocks, True)], block_size)
        batch = batch._replace(logits_rows=torch.arange(count))  # every position's logits
        out.append(model.forward(batch, pool))
        start += count
    assert start == len(ids)
    return torch.cat(out).log_softmax(-1)


def hf_logprobs(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=generator).tolist()


@pytest.mark.parametrize(
    "chunks", [[150], [37, 43, 70], [1] * 20 + [130], [64, 64, 1, 1, 20]], ids=str
)
def test_tiny_random_matches_transformers(
    tiny_dir: Path, reference_model: PreTrainedModel, chunks: list[int]
) -> None:
    model = CausalLM.from_folder(tiny_dir)
    ids = random_ids(150, model.config.vocab_size, seed=1)
    delta = (our_logprobs(model, ids, chunks) - hf_logprobs(reference_model, ids)).abs().max()
    assert delta <= TOLERANCE, f"max |Δ logprob| = {delta}"


@pytest.mark.slow
def test_smollm2_matches_transformers() -> None:
    folder = resolve_model("smollm2-135m")
    model = CausalLM.from_folder(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = random_ids(300, model.config.vocab_size, seed=2)
    delta = (our_logprobs(model, ids, [200, 99, 1]) - hf_logprobs(reference, ids)).abs().max()
    assert delta <= TOLERANCE, f"max |Δ logprob| = {delta}"


def small_hf(config: LlamaConfig | Qwen2Config, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF initialises biases to zero: make them count
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    return model


SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 500000.0,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_matches_transformers(rope: dict[str, float | str]) -> None:
    hf = small_hf(LlamaConfig(**SMALL, rope_parameters=rope), seed=3)
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()), hf.state_dict())
    ids = random_ids(400, 512, seed=4)  # past original_max_position_embeddings
    delta = (our_logprobs(model, ids, [300, 100]) - hf_logprobs(hf, ids)).abs().max()
    assert delta <= TOLERANCE, f"{rope['rope_type']}: max |Δ logprob| = {delta}"


def test_qwen2_biases_and_untied_head_match_transformers() -> None:
    config = Qwen2Config(**{**SMALL, "tie_word_embeddings": False}, rope_theta=10000.0)
    hf = small_hf(config, seed=5)
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()), hf.state_dict())
    assert model.config.qkv_bias and not model.config.o_bias
    assert model.lm_head is not model.embed
    ids = random_ids(120, 512, seed=6)
    delta = (our_logprobs(model, ids, [100, 1, 19]) - hf_logprobs(hf, ids)).abs().max()
    assert delta <= TOLERANCE, f"max |Δ logprob| = {delta}"


def test_llama_attention_and_mlp_bias_match_transformers() -> None:
    hf = small_hf(LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True), seed=7)
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()), hf.state_dict())
    ids = random_ids(80, 512, seed=8)
    delta = (our_logprobs(model, ids, [50, 30]) - hf_logprobs(hf, ids)).abs().max()
    assert delta <= TOLERANCE, f"max |Δ logprob| = {delta}"


def test_config_errors() -> None:
    base = LlamaConfig(**SMALL).to_dict()
    with pytest.raises(EngineError, match="model_type"):
        ModelConfig.from_dict({**base, "model_type": "gpt2"})
    with pytest.raises(EngineError, match="rope_type"):
        rope_frequencies(
            ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "longrope"}})
        )
    dynamic = ModelConfig.from_dict(
        {
            **base,
            "rope_parameters": {
                "rope_type": "dynamic",
                "factor": 2.0,
                "original_max_position_embeddings": 256,
            },
        }
    )
    assert dynamic.max_context == 256  # served only where dynamic NTK equals the default rope
    assert ModelConfig.from_dict(base).kv_bytes_per_token() == 2 * 2 * 2 * 16 * 4


def test_smollm2_kv_cost_matches_design() -> None:
    config = ModelConfig.from_folder(resolve_model("smollm2-135m"))
    assert config.kv_bytes_per_token() == 46_080  # DESIGN.md: ~46 KB/token in fp32


def test_weight_checks(tiny_dir: Path) -> None:
    model = CausalLM.from_folder(tiny_dir)
    state = {k: v.clone() for k, v in model_state(tiny_dir).items()}
    with pytest.raises(EngineError, match="shape"):
        model.load_state_dict({**state, "model.norm.weight": torch.ones(3)})
    with pytest.raises(EngineError, match="lacks"):
        model.load_state_dict({"model.norm.weight": torch.ones(64)})
    with pytest.raises(EngineError, match="unknown"):
        model.load_state_dict({**state, "nope": torch.ones(1)})
    state["model.norm.weight"] = torch.full((64,), 2.0)
    model.load_state_dict(state)
    assert torch.equal(model.norm, torch.full((64,), 2.0))


def model_state(folder: Path) -> dict[str, torch.Tensor]:
    from agentrl.engine._model import read_safetensors

    return read_safetensors(folder)
