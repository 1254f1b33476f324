"""Our forward pass (``_model``) against transformers on the same weights.

The yardstick is transformers run in float64; our fp32 logits, and transformers' own fp32
logits, must each lie within the error an fp32 evaluation of this network on these ids can make
(``numerics.emulated_rounding_error``: every operation's rounding propagated through the float64
network by Monte Carlo). transformers passing is the check that the error model holds; a wrong
rope, norm or weight moves the logits far past it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
import transformers
from numerics import (
    EMULATION_SAFETY,
    assert_within,
    dot_bound,
    emulated_rounding_error,
    float64_transformers,
    unit_roundoff,
)
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config

from agentrl._errors import EngineError
from agentrl._models import resolve_model
from agentrl.engine import _model as model_module
from agentrl.engine._batch import Row, build_forward_batch
from agentrl.engine._kv import KVPool
from agentrl.engine._model import SKINNY_ROWS, CausalLM, ModelConfig, rope_frequencies


def our_logits(model: CausalLM, ids: list[int], chunks: list[int], block_size: int = 16):
    """Logits ``[len(ids), vocab]`` (float32) from our model, feeding ``ids`` in ``chunks``."""
    c = model.config
    pool = KVPool(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        num_blocks=len(ids) // block_size + 2,
        block_size=block_size,
        dtype=model.dtype,
    )
    blocks = list(reversed(pool.alloc(pool.num_blocks)))  # a non-trivial block table
    out, start = [], 0
    for count in chunks:
        batch = build_forward_batch([Row(ids, start, count, blocks, True)], block_size)
        batch = batch._replace(logits_rows=torch.arange(count))  # every position's logits
        out.append(model.forward(batch, pool))
        start += count
    assert start == len(ids)
    return torch.cat(out)


def hf_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


_FLOAT64: dict[tuple[int, tuple[int, ...]], tuple[PreTrainedModel, torch.Tensor, float, float]] = {}


def assert_matches_transformers(
    make: Callable[[torch.dtype], CausalLM],
    hf: PreTrainedModel,
    ids: list[int],
    chunks: list[int],
    what: str = "",
) -> None:
    """Our model (``make(dtype)``, fed in ``chunks``) against transformers in float64 (``want``,
    ``numerics.float64_transformers``).

    Both compute their rope tables in fp32, so even in float64 each errs by up to ``S e64``
    (``S = EMULATION_SAFETY``; ``e64``: float64 operations emulated at float64, fp32 ones at
    fp32). An fp32 evaluation of the network errs by up to ``S e32`` (every operation emulated
    at fp32). So:

    - ours in float64 is within ``2 S e64`` of ``want``, plus the rounding of its logits to
      fp32 (``forward`` returns fp32): the network itself, checked sharply;
    - ours and transformers in fp32 are within ``S (e32 + e64)``: the fp32 path, and (for
      transformers) the error model.
    """
    key = (id(hf), tuple(ids))
    cached = _FLOAT64.get(key)
    # parametrized tests share one model and one set of ids; the entry holds its model, so
    # that a later model given the same id() (the first one freed) is never taken for it
    if cached is None or cached[0] is not hf:
        hf64 = float64_transformers(hf)
        want, e32 = emulated_rounding_error(lambda: hf_logits(hf64, ids))
        _, e64 = emulated_rounding_error(
            lambda: hf_logits(hf64, ids), emulate=torch.float64, reference=want
        )
        _FLOAT64.clear()
        _FLOAT64[key] = hf, want, float(e32.max()), float(e64.max())
    _, want, e32, e64 = _FLOAT64[key]
    # CausalLM.forward returns fp32 logits whatever its dtype: one more rounding of each
    float64_bound = 2 * EMULATION_SAFETY * e64 + unit_roundoff(torch.float32) * want.abs()
    fp32_bound = EMULATION_SAFETY * (e32 + e64)
    ours64 = our_logits(make(torch.float64), ids, chunks)
    assert_within(ours64, want, float64_bound, f"{what} ours in float64")
    assert_within(hf_logits(hf, ids), want, fp32_bound, f"{what} transformers in fp32")
    assert_within(our_logits(make(torch.float32), ids, chunks), want, fp32_bound, f"{what} ours")


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=generator).tolist()


@pytest.mark.parametrize(
    "chunks", [[150], [37, 43, 70], [1] * 20 + [130], [64, 64, 1, 1, 20]], ids=str
)
def test_tiny_random_matches_transformers(
    tiny_dir: Path, reference_model: PreTrainedModel, chunks: list[int]
) -> None:
    ids = random_ids(150, reference_model.config.vocab_size, seed=1)
    make = partial(CausalLM.from_folder, tiny_dir)
    assert_matches_transformers(make, reference_model, ids, chunks)


@pytest.mark.slow
def test_smollm2_matches_transformers() -> None:
    folder = resolve_model("smollm2-135m")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = random_ids(100, reference.config.vocab_size, seed=2)
    assert_matches_transformers(partial(CausalLM.from_folder, folder), reference, ids, [60, 39, 1])


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_each_projection_path_is_the_product(bias: bool) -> None:
    # one row (run as two), the skinny rows of decode steps, and prefill's F.linear on either
    # side of SKINNY_ROWS: each within the fp32 accumulation bound of the float64 product
    model = ours_of(small_hf(Qwen2Config(**SMALL, rope_theta=1e4), seed=11))(torch.float32)
    assert model.rows_out  # HF's [out, in] on the CPU
    generator = torch.Generator().manual_seed(12)
    weight = torch.randn(384, 96, generator=generator)
    b = torch.randn(384, generator=generator) if bias else None
    for rows in (1, 2, 3, SKINNY_ROWS, SKINNY_ROWS + 1, 200):
        x = torch.randn(rows, 96, generator=generator)
        got = model.project(x, weight, b)
        assert got.shape == (rows, 384) and got.is_contiguous()
        want = x.double() @ weight.double().T + (b.double() if bias else 0)
        bound = dot_bound(x, weight.T, u=unit_roundoff(torch.float32))
        bound = bound + unit_roundoff(torch.float32) * want.abs() * (2 if bias else 1)
        assert_within(got, want, bound, f"{rows} rows")
        # a row's result does not depend on which rows share its step
        alone = torch.cat([model.project(x[i : i + 1], weight, b) for i in range(rows)])
        assert_within(alone, want, bound, f"{rows} rows, one at a time")


def test_the_transposed_layout_a_gpu_uses_matches_transformers(
    tiny_dir: Path, reference_model: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # on a GPU the projections are stored [in, out]: the same forward, checked here on the CPU
    monkeypatch.setattr(model_module, "_rows_out", lambda device: False)
    made = CausalLM.from_folder(tiny_dir)
    assert not made.rows_out and made.lm_head.shape[0] == made.config.hidden_size
    ids = random_ids(90, reference_model.config.vocab_size, seed=13)
    make = partial(CausalLM.from_folder, tiny_dir)
    assert_matches_transformers(make, reference_model, ids, [70, 1, 19], "[in, out]")


def test_a_tied_head_is_the_embedding_on_the_cpu(tiny_dir: Path) -> None:
    model = CausalLM.from_folder(tiny_dir)
    assert model.config.tie_word_embeddings
    assert model.lm_head.data_ptr() == model.embed.data_ptr()  # one copy in memory


def small_hf(config: LlamaConfig | Qwen2Config, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF initialises biases to zero: make them count
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    return model


def ours_of(hf: PreTrainedModel) -> Callable[[torch.dtype], CausalLM]:
    """``dtype -> CausalLM`` on ``hf``'s config and weights."""
    config = ModelConfig.from_dict(hf.config.to_dict())
    return lambda dtype: CausalLM(config, hf.state_dict(), dtype=dtype)


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


def _rope_kwargs(rope: dict[str, float | str]) -> dict[str, object]:
    """``rope`` as this transformers' config takes it: ``rope_parameters`` (transformers 5), or
    ``rope_theta`` beside ``rope_scaling`` (transformers 4, which ignores ``rope_parameters``);
    the engine reads both spellings from ``config.json``."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": rope}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_theta": rope["rope_theta"], "rope_scaling": scaling}


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
    hf = small_hf(LlamaConfig(**SMALL, **_rope_kwargs(rope)), seed=3)
    ids = random_ids(400, 512, seed=4)  # past original_max_position_embeddings
    assert_matches_transformers(ours_of(hf), hf, ids, [300, 100], str(rope["rope_type"]))


def test_qwen2_biases_and_untied_head_match_transformers() -> None:
    config = Qwen2Config(**{**SMALL, "tie_word_embeddings": False}, rope_theta=10000.0)
    hf = small_hf(config, seed=5)
    model = ours_of(hf)(torch.float32)
    assert model.config.qkv_bias and not model.config.o_bias
    assert model.lm_head is not model.embed
    ids = random_ids(120, 512, seed=6)
    assert_matches_transformers(ours_of(hf), hf, ids, [100, 1, 19])


def test_llama_attention_and_mlp_bias_match_transformers() -> None:
    hf = small_hf(LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True), seed=7)
    ids = random_ids(80, 512, seed=8)
    assert_matches_transformers(ours_of(hf), hf, ids, [50, 30])


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
