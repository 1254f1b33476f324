"""The in-flight rule over HTTP: ``agentrl serve`` (the aiohttp app in process on a real loopback
port, the real embedded engine on tiny-random) reports its rule and, when a reply's tokens span
weight versions, their versions in an extra ``meta_info`` field; ``SGLangEngine`` reads them,
fills them from ``weight_version`` where a server sends none (SGLang), and refuses a rule a
server does not run. asyncio only (aiohttp is asyncio-only)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from aiohttp.test_utils import TestServer
from serve_helpers import perturbed_copy
from transformers import AutoTokenizer

from agentrl._errors import EngineError
from agentrl._types import SamplingParams
from agentrl.engine import _wire as w
from agentrl.engine import open_embedded_engine
from agentrl.engine._server import create_app
from agentrl.engine._sglang import SGLangEngine
from agentrl.engine._sglang_http import to_result

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("asyncio")]

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]
LONG = 1500  # long enough that the weights land mid-request on a loaded machine


@asynccontextmanager
async def serving(model_dir: Path, in_flight: str) -> AsyncIterator[tuple[str, object]]:
    async with open_embedded_engine(model_dir, num_threads=2, in_flight=in_flight) as engine:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        server = TestServer(create_app(engine, tokenizer, model_dir), host="127.0.0.1", port=0)
        await server.start_server()
        try:
            yield str(server.make_url("")).rstrip("/"), engine
        finally:
            await server.close()


async def test_partial_versions_travel_over_http(tiny_dir: Path, tmp_path: Path) -> None:
    noisy = perturbed_copy(tiny_dir, tmp_path / "noisy")
    async with serving(tiny_dir, "partial") as (url, served):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            info = (await client.get("/get_model_info")).json()
            assert info["agentrl"]["in_flight"] == "partial"
            # one version only: the reply is exactly SGLang's shape, no extra key
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
            plain = (await client.post("/generate", json=body)).json()
            assert "token_versions" not in plain["meta_info"]

        engine = SGLangEngine(url, in_flight="partial")
        results = []

        async def run() -> None:
            greedy = SamplingParams(max_new_tokens=LONG, temperature=0)
            results.append(await engine.generate(PROMPT, greedy))

        async with engine, anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(60):
                while served.statistics().tokens_generated < 8:  # type: ignore[attr-defined]
                    await anyio.sleep(0.002)
            await engine.update_weights(4, str(noisy))
        (result,) = results
        # the new weights may sample EOS before LONG tokens (where depends on when they came)
        n = len(result.token_ids)
        assert n == LONG or result.finish_reason == "stop", (n, result.finish_reason)
        k = result.token_versions.index(4)
        assert 0 < k < n
        assert result.token_versions == [0] * k + [4] * (n - k)
        assert result.weight_version == 0


async def test_a_rule_the_server_does_not_run_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(EngineError, match="in_flight: expected one of finish, abort, partial"):
        SGLangEngine("http://127.0.0.1:9", in_flight="later")
    async with serving(tiny_dir, "finish") as (url, _):
        for rule in ("partial", "abort"):
            engine = SGLangEngine(url, in_flight=rule)
            with pytest.raises(
                EngineError, match=f"in_flight='{rule}' cannot be honoured: .* runs 'finish'"
            ):
                await engine.generate(PROMPT, SamplingParams(max_new_tokens=2))
            await engine.aclose()
        async with SGLangEngine(url) as engine:  # the rule it runs is accepted
            result = await engine.generate(PROMPT, SamplingParams(max_new_tokens=3))
            assert result.token_versions == [0, 0, 0]


def _reply(
    logprobs: list[float], versions: list[int] | None = None, weight_version: str = "6"
) -> w.WireGenerateResp:
    """An SGLang reply to a 2-token prompt: ids 5, 6, ... with these logprobs, cut by length."""
    ids = list(range(5, 5 + len(logprobs)))
    meta = w.WireMetaInfo(
        id="r",
        finish_reason=w.WireFinishReason("length", length=len(ids)),
        prompt_tokens=2,
        completion_tokens=len(ids),
        cached_tokens=0,
        weight_version=weight_version,
        output_token_logprobs=[(lp, i, None) for lp, i in zip(logprobs, ids, strict=True)],
        token_versions=versions,
    )
    return w.WireGenerateResp(text="", meta_info=meta, output_ids=ids)


def test_a_reply_without_versions_counts_every_token_as_its_weight_version() -> None:
    """SGLang's reply carries one ``weight_version``; the client fills each token with it, and
    refuses an extension list that does not fit the tokens."""
    sampling = SamplingParams(max_new_tokens=3)

    def reply(versions: list[int] | None) -> w.WireGenerateResp:
        return _reply([-1.0, -2.0, -0.5], versions)

    result = to_result(reply(None), sampling, 0, "http://s", True, [1, 2])
    assert (result.weight_version, result.token_versions) == (6, [6, 6, 6])
    result = to_result(reply([5, 6, 6]), sampling, 0, "http://s", True, [1, 2])
    assert (result.weight_version, result.token_versions) == (5, [5, 6, 6])
    for bad in ([6, 6], [6, 5, 6]):
        with pytest.raises(EngineError, match="token_versions has"):
            to_result(reply(bad), sampling, 0, "http://s", True, [1, 2])


def test_a_reply_from_a_server_no_publication_reached_counts_as_the_oldest_version() -> None:
    """A fresh SGLang worker (one a router took on since the last publication, or restarted)
    reports ``weight_version`` ``"default"`` and serves the weights it started with: its tokens
    are version 0, never the engine's current version; a reply with no version at all takes
    the engine's."""
    sampling = SamplingParams(max_new_tokens=2)
    fresh = to_result(
        _reply([-1.0, -2.0], weight_version="default"), sampling, 7, "u", True, [1, 2]
    )
    assert (fresh.weight_version, fresh.token_versions) == (0, [0, 0])
    silent = _reply([-1.0, -2.0])
    silent.meta_info.weight_version = None
    result = to_result(silent, sampling, 7, "u", True, [1, 2])
    assert (result.weight_version, result.token_versions) == (7, [7, 7])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_reply_with_a_logprob_that_is_not_finite_is_an_engine_error(bad: float) -> None:
    """A NaN or infinite sampled logprob (broken weights on the server) would reach the
    learner's ratio: the reply is refused, so the trajectory records the failure."""
    reply = _reply([-1.0, bad], weight_version="0")
    with pytest.raises(EngineError, match="not finite"):
        to_result(reply, SamplingParams(max_new_tokens=2), 0, "http://s", True, [1, 2])
