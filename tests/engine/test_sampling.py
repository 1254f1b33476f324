"""sample_token: unfiltered logprobs, filters, per-request generators."""

from __future__ import annotations

import collections
import math
import random

import pytest
import torch
from numerics import LAMBDA, assert_within, emulated_std, unit_roundoff

from agentrl._errors import EngineError
from agentrl._types import SamplingParams
from agentrl.engine import sample_token
from agentrl.engine._sampling import check_sampling, make_generator, match_stop_string

PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])
LOGITS = PROBS.log() + 1.5  # an offset changes nothing


def draw(sampling: SamplingParams, n: int = 2000, seed: int = 0) -> collections.Counter[int]:
    generator = make_generator(seed)
    return collections.Counter(sample_token(LOGITS, sampling, generator)[0] for _ in range(n))


def test_logprob_is_unfiltered_log_softmax_at_temperature() -> None:
    for temperature in (1.0, 0.7, 2.0):
        want = torch.log_softmax(LOGITS / temperature, dim=-1)
        for sampling in (
            SamplingParams(temperature=temperature),
            SamplingParams(temperature=temperature, top_k=2, top_p=0.5, min_p=0.3),
        ):
            generator = make_generator(1)
            for _ in range(20):
                token, logprob = sample_token(LOGITS, sampling, generator)
                assert logprob == want[token].item()  # the same fp32 operations: same bits


def test_greedy_takes_argmax_with_temperature_one_logprob() -> None:
    token, logprob = sample_token(LOGITS, SamplingParams(temperature=0), make_generator(0))
    assert token == 0
    # fp32 all the way from 0.4 (its rounding moves log p by u) to log_softmax: emulated
    _, std = emulated_std(lambda: torch.log_softmax(PROBS.double().log() + 1.5, dim=-1)[0])
    bound = LAMBDA * std + unit_roundoff(torch.float32)
    assert_within(logprob, math.log(0.4), bound)


def test_filters_restrict_the_support() -> None:
    assert set(draw(SamplingParams(top_k=1))) == {0}
    assert set(draw(SamplingParams(top_k=2))) == {0, 1}
    # top_p keeps tokens while the mass above them is < p: 0 (0.0), 1 (0.4) for p = 0.5
    assert set(draw(SamplingParams(top_p=0.5))) == {0, 1}
    assert set(draw(SamplingParams(top_p=0.3))) == {0}
    # min_p keeps p >= min_p * p_max: 0.6 * 0.4 = 0.24 keeps 0 and 1
    assert set(draw(SamplingParams(min_p=0.6))) == {0, 1}
    assert set(draw(SamplingParams())) == {0, 1, 2, 3}


def test_frequencies_follow_the_renormalized_distribution() -> None:
    n, p = 4000, 4 / 7  # 0.4 / 0.7 after renormalization
    counts = draw(SamplingParams(top_k=2), n=n, seed=3)
    # a binomial share: λ standard deviations (λ = 6; a renormalization bug moves it by 0.17)
    assert abs(counts[0] / n - p) < LAMBDA * math.sqrt(p * (1 - p) / n), counts


def test_same_seed_same_draws() -> None:
    sampling = SamplingParams()
    assert draw(sampling, seed=42) == draw(sampling, seed=42)
    sequences = []
    for _ in range(2):
        generator = make_generator(5)
        sequences.append([sample_token(LOGITS, sampling, generator)[0] for _ in range(50)])
    assert sequences[0] == sequences[1]
    other = make_generator(6)
    assert [sample_token(LOGITS, sampling, other)[0] for _ in range(50)] != sequences[0]


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=float("nan")),
        SamplingParams(top_p=1.5),
        SamplingParams(top_k=-2),
        SamplingParams(min_p=-0.1),
    ],
)
def test_invalid_params_are_rejected(sampling: SamplingParams) -> None:
    with pytest.raises(EngineError):
        check_sampling(sampling)


def test_seed_out_of_range() -> None:
    with pytest.raises(EngineError, match="seed"):
        make_generator(2**70)


def _full_text_match(tokenizer, output: list[int], stop: list[str]) -> str | None:
    """The reference: search the whole decoded output, the earliest-starting stop string."""
    text = tokenizer.decode(output, skip_special_tokens=False)
    found = [(text.find(s), i) for i, s in enumerate(stop) if s in text]
    return stop[min(found)[1]] if found else None


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_match_on_the_tail_as_on_the_whole_text(tokenizer, seed: int) -> None:
    """Checked after each token (as the worker does), the tail-only match stops at the same
    token with the same string as searching the whole decoded output: byte tokens of 2-4 byte
    characters, leading spaces, stop strings longer than a token, several at once."""
    rng = random.Random(seed)
    pieces = [
        "The answer is",
        " 42",
        "\n",
        "Observation:",
        " ünïcødé",
        " 数学题",
        " 🙂🚀",
        "```",
        "x",
    ]
    text = "".join(rng.choice(pieces) for _ in range(60))
    output = tokenizer.encode(text, add_special_tokens=False)
    decoded = tokenizer.decode(output)
    for _ in range(25):
        stops = []
        for _ in range(rng.randint(1, 4)):
            start = rng.randrange(len(decoded) - 1)
            stops.append(decoded[start : start + rng.randint(1, 12)])
        stops = [s for s in stops if s.strip("\ufffd")] or ["\n"]
        for end in range(1, len(output) + 1):
            want = _full_text_match(tokenizer, output[:end], stops)
            assert match_stop_string(tokenizer, output[:end], stops) == want, (stops, end)
            if want is not None:
                break
