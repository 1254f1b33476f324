"""``POST /generate`` for ``agentrl serve``: SGLang request -> engine requests -> SGLang response.

``plan_generate`` validates a decoded request and expands it into one ``Item`` per sample (batch
prompts x ``n``, prompt-major, as SGLang orders them); ``render_result`` turns an engine result
into SGLang's response object (text trimming rules: see ``_server``'s module docs).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl._config import short_repr
from agentrl._errors import EngineError
from agentrl._types import GenerateResult, LogprobQuery, SamplingParams

from . import _wire as w
from ._server_schema import unsupported

MAX_N = 64
"""Most samples one prompt may ask for (``sampling_params.n``)."""


class BadRequest(EngineError):
    """Invalid ``/generate`` input; ``field`` names the offending field (HTTP 400)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def decodes_by_joining_bytes(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s text of some ids is the UTF-8 of their tokens' bytes joined, no
    more: a fast tokenizer of transformers' own (no class that decodes its own way), whose
    decoder is byte-level BPE's alone, with no clean-up of spaces (SmolLM2, Qwen, GPT-2...).
    Then the text of ``a + b`` is the text of ``a`` followed by that of ``b`` wherever ``a``'s
    ends a character. A SentencePiece decoder (a token's leading space depends on what precedes
    it) or a clean-up step (``" ."`` → ``"."``) is not."""
    try:
        from tokenizers.decoders import ByteLevel
    except ImportError:  # pragma: no cover - transformers' fast tokenizers need it
        return False
    if not type(tokenizer).__module__.startswith("transformers."):
        return False
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    return isinstance(getattr(backend, "decoder", None), ByteLevel)


@dataclass(frozen=True)
class ModelFacts:
    """What request validation and rendering need to know about the served model."""

    tokenizer: Any
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    """Ids that stop generation unless ``ignore_eos`` (config + generation config + tokenizer)."""
    bos_token_id: int | None
    max_context: int
    max_text_chars: int = 0
    """The most characters of text one request may send to be tokenized (0: no bound): twice
    what ``max_context`` tokens of the longest vocabulary entry can cover, for each text, and
    twice that for all the texts of a request together. Longer text could never fit the
    context; it is refused before the tokenizer spends time and memory on it."""
    joins_bytes: bool = False
    """The tokenizer's text of ``a + b`` is the text of ``a`` followed by that of ``b`` wherever
    ``a``'s text ends a character (``decodes_by_joining_bytes``): a stream decodes only the ids
    each chunk adds (``RenderMemo.text``)."""
    pieces: dict[int, str] = field(default_factory=dict, compare=False, repr=False)
    """Each token decoded alone, as ``return_text_in_logprobs`` shows it, once per token id (a
    stream renders its lists again at every chunk)."""

    def piece(self, token: int) -> str:
        """``token`` decoded alone (cached; at most one entry per vocabulary id)."""
        text = self.pieces.get(token)
        if text is None:
            text = self.pieces[token] = self.tokenizer.decode([token])
        return text

    @classmethod
    def read(cls, folder: Path, tokenizer: Any, max_context: int) -> ModelFacts:
        config = _read_json(folder / "config.json")
        eos: list[int] = []
        for source in (config, _read_json(folder / "generation_config.json")):
            value = source.get("eos_token_id")
            eos += value if isinstance(value, list) else [value] if isinstance(value, int) else []
        if isinstance(getattr(tokenizer, "eos_token_id", None), int):
            eos.append(tokenizer.eos_token_id)
        vocab = int(config.get("vocab_size") or len(tokenizer))
        bos = getattr(tokenizer, "bos_token_id", None)
        try:
            longest = max(len(entry) for entry in tokenizer.get_vocab())
        except (AttributeError, TypeError, ValueError):  # a tokenizer without a vocabulary
            longest = 0
        return cls(
            tokenizer,
            vocab,
            tuple(dict.fromkeys(eos)),
            bos,
            max_context,
            2 * max_context * longest,
            decodes_by_joining_bytes(tokenizer),
        )

    def check_text(self, texts: list[str], field: str, batch: bool) -> None:
        """``BadRequest`` for text longer than ``max_text_chars`` (per text, and twice that for
        all of them), before anything is tokenized."""
        if not self.max_text_chars:
            return
        for index, text in enumerate(texts):
            if len(text) > self.max_text_chars:
                where = f"{field}[{index}]" if batch else field
                raise BadRequest(
                    f"{where}: {len(text)} characters exceed the maximum allowed length of "
                    f"text ({self.max_text_chars} characters: the context length of "
                    f"{self.max_context} tokens can never hold more)",
                    where,
                )
        total = sum(len(text) for text in texts)
        if total > 2 * self.max_text_chars:
            raise BadRequest(
                f"{field}: {total} characters in all exceed the maximum allowed length of text "
                f"in one request ({2 * self.max_text_chars} characters): split the batch",
                field,
            )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class Item:
    """One sample to generate."""

    input_ids: list[int]
    """The whole context, or inside a session the new suffix."""
    sampling: SamplingParams
    rid: str
    return_logprob: bool
    logprob_start_len: int
    text_in_logprobs: bool
    no_stop_trim: bool
    skip_special_tokens: bool
    session: w.WireSessionParams | None
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    prompt_field: str = "input_ids"
    """The request field the prompt came from (``input_ids``, or ``text`` once tokenized)."""
    max_new_tokens_given: bool = False
    """``sampling_params.max_new_tokens`` was sent (checked against the context length) rather
    than defaulted (capped to it)."""
    stream_interval: int | None = None
    """``sampling_params.stream_interval``: tokens per streamed chunk (None: the server's)."""


def plan_generate(req: w.WireGenerateReq, facts: ModelFacts) -> tuple[list[Item], bool]:
    """Validate ``req``; return its samples and whether the response is a single object."""
    problem = unsupported(req)
    if problem is not None:
        raise BadRequest(*problem)
    prompts, batch = _prompts(req, facts)
    logprob_args = _logprob_args(req, len(prompts), batch, facts)
    params = req.sampling_params
    if isinstance(params, list):
        if not batch or len(params) != len(prompts):
            raise BadRequest(
                f"a list of sampling_params needs a batch of as many prompts ({len(prompts)})",
                "sampling_params",
            )
    else:
        params = [params or w.WireSamplingParams()] * len(prompts)
    rids = _rids(req.rid, len(prompts), batch)
    session = req.session_params
    if session is not None and session.id is None:
        raise BadRequest("session_params.id is required", "session_params.id")
    items: list[Item] = []
    for index, (prompt, wire, rid) in enumerate(zip(prompts, params, rids, strict=True)):
        field = f"sampling_params[{index}]" if isinstance(req.sampling_params, list) else None
        sampling, n, no_stop_trim, skip = _sampling(wire, facts, field or "sampling_params")
        if session is not None and (batch or n > 1):
            raise BadRequest("session_params needs a single prompt and n=1", "session_params")
        return_logprob, start, top_k, token_ids = logprob_args[index]
        if n > 1 and any(isinstance(getattr(req, f), list) for f in _PER_PROMPT):
            raise BadRequest(
                "per-prompt logprob lists need n=1 (as in SGLang)", "sampling_params.n"
            )
        for sample in range(n):
            seed = sampling.seed
            items.append(
                Item(
                    input_ids=prompt,
                    sampling=_with_seed(sampling, None if seed is None else seed + sample),
                    rid=rid if n == 1 else f"{rid}-{sample}",
                    return_logprob=return_logprob,
                    logprob_start_len=start,
                    text_in_logprobs=bool(req.return_text_in_logprobs),
                    no_stop_trim=no_stop_trim,
                    skip_special_tokens=skip,
                    session=session,
                    top_logprobs_num=top_k,
                    token_ids_logprob=token_ids,
                    prompt_field="text" if req.text is not None else "input_ids",
                    max_new_tokens_given=wire.max_new_tokens is not None,
                    stream_interval=wire.stream_interval,
                )
            )
    return items, not batch and len(items) == 1


_PER_PROMPT = ("return_logprob", "logprob_start_len", "top_logprobs_num")


def _logprob_args(
    req: w.WireGenerateReq, count: int, batch: bool, facts: ModelFacts
) -> list[tuple[bool, int, int, tuple[int, ...] | None]]:
    """Per prompt: ``(return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob)``
    (SGLang's batch forms: one value for all prompts, or a list with one per prompt)."""

    def per_prompt(name: str, default: Any) -> list[Any]:
        value = getattr(req, name)
        if value is None:
            return [default] * count
        if not isinstance(value, list):
            return [value] * count
        if not batch or len(value) != count:
            raise BadRequest(f"{name} lists need one value per prompt ({count})", name)
        return [default if v is None else v for v in value]

    returns = per_prompt("return_logprob", False)
    starts = per_prompt("logprob_start_len", -1)
    tops = per_prompt("top_logprobs_num", 0)
    for top in tops:
        if not 0 <= top <= facts.vocab_size:
            raise BadRequest(
                f"top_logprobs_num must be in [0, {facts.vocab_size}] (the vocabulary), got {top}",
                "top_logprobs_num",
            )
    for start in starts:
        if start < -1:
            raise BadRequest(
                f"logprob_start_len must be -1 or >= 0, got {start}", "logprob_start_len"
            )
    ids = req.token_ids_logprob or None
    if ids is None:
        chosen: list[tuple[int, ...] | None] = [None] * count
    elif all(isinstance(t, int) for t in ids):
        chosen = [tuple(ids)] * count  # type: ignore[arg-type]
    elif all(isinstance(t, list) for t in ids) and batch and len(ids) == count:
        chosen = [tuple(t) or None for t in ids]  # type: ignore[arg-type]
    else:
        raise BadRequest(
            f"token_ids_logprob must be a list of token ids, or one list per prompt ({count})",
            "token_ids_logprob",
        )
    for group in {id(g): g for g in chosen}.values():  # a list shared by all: checked once
        if group is not None and len(group) > facts.vocab_size:
            raise BadRequest(
                f"token_ids_logprob: {len(group)} ids, more than the vocabulary "
                f"({facts.vocab_size})",
                "token_ids_logprob",
            )
        bad = next((t for t in group or () if not 0 <= t < facts.vocab_size), None)
        if bad is not None:
            raise BadRequest(
                f"token_ids_logprob: token id {bad} is out of range [0, {facts.vocab_size})",
                "token_ids_logprob",
            )
    return [(bool(r), s, t, c) for r, s, t, c in zip(returns, starts, tops, chosen, strict=True)]


def _with_seed(sampling: SamplingParams, seed: int | None) -> SamplingParams:
    if seed == sampling.seed:
        return sampling
    fields = {f: getattr(sampling, f) for f in sampling.__struct_fields__}
    return SamplingParams(**{**fields, "seed": seed})


def _prompts(req: w.WireGenerateReq, facts: ModelFacts) -> tuple[list[list[int]], bool]:
    if (req.input_ids is None) == (req.text is None):
        raise BadRequest("give exactly one of input_ids and text", "input_ids")
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        if not texts:
            raise BadRequest("text is an empty batch", "text")
        batch, field = not isinstance(req.text, str), "text"
        facts.check_text(texts, field, batch)
        prompts = [list(facts.tokenizer.encode(t)) for t in texts]
    else:
        ids = req.input_ids or []
        lists = [isinstance(x, list) for x in ids]
        if any(lists) and not all(lists):
            raise BadRequest("input_ids mixes token ids and lists of token ids", "input_ids")
        batch, field = bool(ids) and all(lists), "input_ids"
        prompts = [list(x) for x in ids] if batch else [list(ids)]  # type: ignore[arg-type]
    for index, prompt in enumerate(prompts):
        where = f"{field}[{index}]" if batch else field
        if not prompt:
            raise BadRequest(f"{where} is empty", where)
        bad = next((t for t in prompt if not 0 <= t < facts.vocab_size), None)
        if bad is not None:
            raise BadRequest(
                f"{where}: token id {bad} is out of range [0, {facts.vocab_size})", where
            )
    return prompts, batch


def _rids(rid: str | list[str] | None, count: int, batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        return [rid] if not batch else [f"{rid}-{i}" for i in range(count)]
    if len(rid) != count:
        raise BadRequest(f"rid needs {count} ids (one per sample), got {len(rid)}", "rid")
    duplicates = sorted({r for r in rid if rid.count(r) > 1})
    if duplicates:  # SGLang's words, which clients match
        raise BadRequest(f"Duplicate request IDs detected within the request: {duplicates}", "rid")
    return list(rid)


def _sampling(
    wire: w.WireSamplingParams, facts: ModelFacts, field: str
) -> tuple[SamplingParams, int, bool, bool]:
    def bad(name: str, why: str, value: object) -> BadRequest:
        return BadRequest(f"{field}.{name} {why}, got {short_repr(value)}", f"{field}.{name}")

    max_new = 128 if wire.max_new_tokens is None else wire.max_new_tokens
    if max_new < 0:
        raise bad("max_new_tokens", "must be >= 0", max_new)
    temperature = 1.0 if wire.temperature is None else wire.temperature
    if not (math.isfinite(temperature) and temperature >= 0):
        raise bad("temperature", "must be finite and >= 0", temperature)
    top_p = 1.0 if wire.top_p is None else wire.top_p
    if not 0 < top_p <= 1:
        raise bad("top_p", "must be in (0, 1]", top_p)
    top_k = -1 if wire.top_k is None or wire.top_k >= facts.vocab_size else wire.top_k
    if top_k != -1 and top_k < 1:
        raise bad("top_k", "must be -1 (off) or >= 1", top_k)
    min_p = 0.0 if wire.min_p is None else wire.min_p
    if not 0 <= min_p <= 1:
        raise bad("min_p", "must be in [0, 1]", min_p)
    stop = [wire.stop] if isinstance(wire.stop, str) else list(wire.stop or [])
    if any(not s for s in stop):
        raise bad("stop", "must hold non-empty strings", stop)
    stop_ids = list(wire.stop_token_ids or [])
    if any(not 0 <= t < facts.vocab_size for t in stop_ids):
        raise bad("stop_token_ids", f"must be in [0, {facts.vocab_size})", stop_ids)
    n = 1 if wire.n is None else wire.n
    if not 1 <= n <= MAX_N:
        raise bad("n", f"must be in [1, {MAX_N}]", n)
    if wire.stream_interval is not None and wire.stream_interval < 1:
        raise bad("stream_interval", "must be >= 1", wire.stream_interval)
    seed = wire.sampling_seed
    if seed is not None and not -(2**63) <= seed <= 2**64 - n:  # sample i draws from seed + i
        raise bad("sampling_seed", f"must be in [-2**63, 2**64 - n] (n={n})", seed)
    # SGLang: ignore_eos turns off EOS *and* stop_token_ids; otherwise both stop generation.
    stop_ids = [] if wire.ignore_eos else list(dict.fromkeys(stop_ids + list(facts.eos_token_ids)))
    sampling = SamplingParams(
        max_new_tokens=max_new,
        temperature=0.0 if temperature < 1e-6 else temperature,  # SGLang: greedy below 1e-6
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        stop=stop,
        stop_token_ids=stop_ids,
        seed=wire.sampling_seed,
    )
    skip = True if wire.skip_special_tokens is None else wire.skip_special_tokens
    return sampling, n, bool(wire.no_stop_trim), skip


def prepare_run(
    item: Item, context_len: int, facts: ModelFacts, *, streaming_session: bool = False
) -> tuple[SamplingParams, LogprobQuery | None]:
    """Check ``item`` against its whole context (in a session: history + suffix) and the
    context length; return its sampling (``max_new_tokens`` capped to the room left) and what
    it asks of the engine beyond the sampled tokens' logprobs. In a streaming session
    ``logprob_start_len`` is ignored (-1), as SGLang 0.5.17 does, so the turn keeps reusing
    the session's KV."""
    limit, sampling = facts.max_context, item.sampling
    if context_len >= limit:
        raise BadRequest(
            f"the input ({context_len} tokens) exceeds the maximum allowed length: the model's "
            f"context length is {limit} tokens",
            item.prompt_field,
        )
    wanted = sampling.max_new_tokens
    if item.max_new_tokens_given and len(item.input_ids) + wanted > limit:
        # as SGLang: checked against the request's own input_ids (a session's suffix)
        raise BadRequest(
            f"{len(item.input_ids)} input tokens + max_new_tokens {wanted} exceed the model's "
            f"maximum context length of {limit} tokens; shorten the input or lower "
            f"max_new_tokens",
            "sampling_params.max_new_tokens",
        )
    if wanted > limit - context_len:
        fields = {f: getattr(sampling, f) for f in sampling.__struct_fields__}
        sampling = SamplingParams(**{**fields, "max_new_tokens": limit - context_len})
    if not item.return_logprob:
        return sampling, None  # SGLang ignores the other logprob fields then
    start = -1 if streaming_session else item.logprob_start_len
    if start > context_len:
        raise BadRequest(
            f"logprob_start_len ({start}) is larger than the number of input tokens "
            f"({context_len})",
            "logprob_start_len",
        )
    query = LogprobQuery(
        input_start=None if start == -1 else start,
        top_k=item.top_logprobs_num,
        token_ids=item.token_ids_logprob,
    )
    if query == LogprobQuery():
        return sampling, None
    return sampling, query


class RenderMemo:
    """What a stream already rendered for one sample, so that each chunk renders only what is
    new: the logprob lists (a chunk at ``n`` tokens would otherwise build ``n`` entries, and
    their top-k, again) and the text (``text``). Output-side lists grow with the ids; input-side
    ones are rendered once. A restart of the request (new ids or logprobs under the rendered
    prefix) starts it over. A fresh memo renders every list (a whole answer, whose text is
    always decoded whole)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.lists: dict[str, list[Any]] = {}
        self.done = 0
        """Output positions rendered (for the chunk being rendered: before it)."""
        self.text_ids: list[int] = []
        self.decoded = ""
        """The text of ``text_ids[:read]``, which ends a character."""
        self.read = 0

    def text(self, facts: ModelFacts, ids: list[int], skip_special_tokens: bool) -> str:
        """The text of ``ids`` (a chunk's), as ``facts.tokenizer.decode`` gives it. Where the
        tokenizer joins its tokens' bytes, only the ids since the text last ended a character
        are decoded (a stream's chunks cost in proportion to what they add, not to the whole
        output); otherwise, or after a restart of the request, all of them."""
        decode = facts.tokenizer.decode
        if not facts.joins_bytes:
            return decode(ids, skip_special_tokens=skip_special_tokens)
        if ids[: self.read] != self.text_ids[: self.read]:
            self.decoded, self.read = "", 0
        self.text_ids = ids
        new = decode(ids[self.read :], skip_special_tokens=skip_special_tokens)
        if not new or new.endswith("\ufffd"):
            return self.decoded + new  # a character may still be incomplete: decode it again
        self.decoded += new
        self.read = len(ids)
        return self.decoded

    def begin(self, ids: list[int], logprobs: list[float]) -> None:
        k = len(self.ids)
        if ids[:k] != self.ids or logprobs[:k] != self.logprobs:
            self.lists, k = {}, 0
        self.ids, self.logprobs, self.done = ids, logprobs, k  # the caller's own copies

    def grown(self, key: str, make: Callable[[int], list[Any]]) -> list[Any]:
        """The output list ``key``: what was rendered plus ``make(first new position)``."""
        rendered = self.lists.setdefault(key, [])
        rendered.extend(make(self.done))
        return list(rendered)

    def once(self, key: str, make: Callable[[], list[Any]]) -> list[Any]:
        """The input list ``key``, rendered the first time."""
        if key not in self.lists:
            self.lists[key] = make()
        return list(self.lists[key])


def render_result(
    item: Item,
    context: list[int],
    result: GenerateResult,
    facts: ModelFacts,
    started: float,
    memo: RenderMemo | None = None,
) -> w.WireGenerateResp:
    """SGLang's response object for one sample; ``memo`` (a stream's chunks before the last)
    keeps what earlier chunks rendered of the logprob lists."""
    tokenizer, ids = facts.tokenizer, list(result.token_ids)
    matched = result.matched_stop if result.finish_reason == "stop" else None
    text_ids = ids[:-1] if isinstance(matched, int) and not item.no_stop_trim and ids else ids
    if memo is None:
        text = tokenizer.decode(text_ids, skip_special_tokens=item.skip_special_tokens)
    else:  # a stream's chunk
        text = memo.text(facts, text_ids, item.skip_special_tokens)
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos != -1:
            text = text[: pos + len(matched)] if item.no_stop_trim else text[:pos]
    if result.finish_reason == "stop":
        finish = w.WireFinishReason("stop", matched=matched)
    elif result.finish_reason == "length":
        # the limit that ended it: a defaulted max_new_tokens is capped to the room left
        limit = min(item.sampling.max_new_tokens, len(result.token_ids))
        finish = w.WireFinishReason("length", length=limit)
    else:
        finish = w.WireFinishReason("abort", message="request aborted")
    meta = w.WireMetaInfo(
        id=item.rid,
        finish_reason=finish,
        prompt_tokens=len(context),
        completion_tokens=len(ids),
        cached_tokens=int(result.cached_tokens),
        weight_version=str(result.weight_version),
        e2e_latency=time.perf_counter() - started,
    )
    versions = result.token_versions
    if versions.count(result.weight_version) != len(versions):  # (in C: a stream's chunks)
        meta.token_versions = list(versions)  # the tokens span weight versions
    if item.return_logprob:
        lists = RenderMemo() if memo is None else memo
        lists.begin(ids, result.logprobs)

        def piece(token: int) -> str | None:
            return facts.piece(token) if item.text_in_logprobs else None

        logprobs = result.logprobs
        meta.output_token_logprobs = lists.grown(
            "output_token",
            lambda lo: [
                (float(lp), int(t), piece(t)) for t, lp in zip(ids[lo:], logprobs[lo:], strict=True)
            ],
        )
        meta.output_token_logprobs_length = len(ids)
        render_logprob_details(meta, item, context, result, piece, lists)
    return w.WireGenerateResp(text=text, meta_info=meta, output_ids=ids)


def render_logprob_details(
    meta: w.WireMetaInfo,
    item: Item,
    context: list[int],
    result: GenerateResult,
    piece: Any,
    lists: RenderMemo,
) -> None:
    """SGLang's input, top-k and chosen-id logprob lists from ``result.details``."""
    details = result.details
    start = details.input_start if details is not None else None
    reported = context[start:] if start is not None else []
    values = details.input_logprobs if details is not None else []
    meta.input_token_logprobs = lists.once(
        "input_token",
        lambda: [(lp, int(t), piece(t)) for lp, t in zip(values, reported, strict=True)],
    )

    def entries(pairs: list[tuple[float, int]] | None) -> list[w.LogprobEntry] | None:
        return None if pairs is None else [(float(v), int(t), piece(t)) for v, t in pairs]

    chosen = item.token_ids_logprob

    def pick(values: list[float] | None) -> list[w.LogprobEntry] | None:
        if values is None or chosen is None:
            return None
        return entries(list(zip(values, chosen, strict=True)))

    if item.top_logprobs_num > 0:
        input_top = (details.input_top or []) if details else []
        output_top = (details.output_top or []) if details else []
        meta.input_top_logprobs = lists.once("input_top", lambda: [entries(p) for p in input_top])
        meta.output_top_logprobs = lists.grown(
            "output_top", lambda lo: [entries(p) for p in output_top[lo:]]
        )
    if chosen is not None:
        input_ids = (details.input_token_ids or []) if details else []
        output_ids = (details.output_token_ids or []) if details else []
        meta.input_token_ids_logprobs = lists.once(
            "input_chosen", lambda: [pick(v) for v in input_ids]
        )
        meta.output_token_ids_logprobs = lists.grown(
            "output_chosen", lambda lo: [pick(v) for v in output_ids[lo:]]
        )
