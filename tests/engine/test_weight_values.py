"""Weight values are checked before they replace the served ones: the embedded engine's
``update_weights`` (state dicts from the learner, folders from disk) refuses what would break
generation, names the tensor, and keeps serving the old weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agentrl._errors import EngineError
from agentrl._types import SamplingParams
from agentrl.engine import open_embedded_engine
from agentrl.engine._weight_values import check_weight_values

pytestmark = [pytest.mark.anyio]

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
EMBED = "model.embed_tokens.weight"


def _edited(state: dict[str, torch.Tensor], value: float, dtype: torch.dtype) -> dict:
    tensor = state[EMBED].to(dtype).clone()
    tensor[7, 1] = value
    return {**state, EMBED: tensor}


async def test_update_weights_refuses_bad_values_and_keeps_serving(tiny_dir: Path) -> None:
    state = load_file(tiny_dir / "model.safetensors")
    async with open_embedded_engine(tiny_dir, num_threads=1) as engine:
        before = await engine.generate(PROMPT, GREEDY)
        cases = {
            "NaN": _edited(state, float("nan"), torch.float32),
            "non-finite": _edited(state, float("inf"), torch.float32),
            "float32": _edited(state, 1e300, torch.float64),
            "int64": {**state, EMBED: state[EMBED].to(torch.int64)},
            "bool": {**state, EMBED: state[EMBED] > 0},
        }
        for word, bad in cases.items():
            with pytest.raises(EngineError, match=EMBED) as caught:
                await engine.update_weights(9, bad)
            assert word in str(caught.value)
            after = await engine.generate(PROMPT, GREEDY)
            assert after.token_ids == before.token_ids and after.weight_version == 0
        await engine.update_weights(1, {**state, EMBED: state[EMBED].to(torch.float16)})
        assert (await engine.generate(PROMPT, GREEDY)).weight_version == 1


def test_values_beyond_the_model_dtype_are_refused() -> None:
    """float32's largest values overflow bfloat16 (max 3.3895e38) when cast: refused for a
    bfloat16 model, accepted for a float32 one."""
    big = torch.full((4,), 3.4e38, dtype=torch.float32)
    assert torch.isinf(big.to(torch.bfloat16)).all()  # what the cast would have served
    check_weight_values({"w": big}, ["w"], torch.float32)
    with pytest.raises(EngineError, match=r"w holds a value of magnitude 3.4e\+38"):
        check_weight_values({"w": big}, ["w"], torch.bfloat16)
    check_weight_values({"w": torch.empty(0)}, ["w"], torch.bfloat16)
    with pytest.raises(EngineError, match="not a tensor"):
        check_weight_values({"w": [1.0]}, ["w"], torch.float32)
