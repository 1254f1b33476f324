"""msgspec structs for the SGLang HTTP subset that ``agentrl serve`` and ``SGLangEngine`` speak.

Field names and defaults follow SGLang 0.5.17 (``io_struct.py``, ``sampling_params.py``,
``http_server.py``). Request structs refuse unknown fields so a typo fails loudly with the path of
the field (``$.sampling_params.top_q``); response structs ignore unknown fields so the client
keeps decoding when SGLang adds some. Encoders and decoders are built once, here.
"""

from __future__ import annotations

import contextlib
import gc
import re
import threading
from collections.abc import Iterator
from typing import Any, Literal

import msgspec

# --- requests -------------------------------------------------------------------------------


class WireSessionParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``session_params``: which session, which parent request, how to splice the new suffix."""

    id: str | None = None
    rid: str | None = None
    """Parent request in the session (classic sessions); ``None`` starts a new root."""
    offset: int | None = None
    """Nonzero: ``context[:offset] + input_ids`` instead of ``context + input_ids``."""
    replace: bool | None = None
    drop_previous_output: bool | None = None


class WireSamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``sampling_params`` (SGLang names and defaults; ``top_k=-1`` or ``>= 2**30`` is off)."""

    max_new_tokens: int | None = None
    """``None``: 128, capped to the context length (an explicit value is checked against it)."""
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    min_p: float | None = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = 1
    no_stop_trim: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    ignore_eos: bool | None = False
    sampling_seed: int | None = None
    # Accepted only at their neutral values (agentrl serve does not implement them).
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    min_new_tokens: int | None = 0
    stop_regex: Any = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    logit_bias: Any = None
    custom_params: Any = None
    stream_interval: int | None = None
    """Streaming granularity (tokens per chunk); no effect on a non-streaming reply."""


class WireGenerateReq(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /generate``. ``input_ids`` is one prompt or a batch (list of lists).

    Every field of SGLang 0.5.17's ``GenerateReqInput`` is declared; the ones typed ``Any``
    are accepted at their neutral values only (``_server_schema`` checks them and names the
    field and value it cannot serve)."""

    input_ids: list[int | list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: WireSamplingParams | list[WireSamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int | list[int]] | None = None
    return_text_in_logprobs: bool | None = False
    session_params: WireSessionParams | None = None
    stream: bool | None = False
    log_metrics: bool | None = True
    # Accepted only at their neutral values (see _server_schema).
    session_id: Any = None
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: Any = None
    use_audio_in_video: Any = False
    return_sampling_mask: Any = None
    return_flat_raw_top_logprobs: Any = False
    return_flat_raw_top_logprobs_b64: Any = False
    return_hidden_states: Any = False
    return_routed_experts: Any = False
    routed_experts_start_len: Any = 0
    return_indexer_topk: Any = False
    modalities: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    positional_embed_overrides: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    routed_dp_rank: Any = None
    data_parallel_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    routing_key: Any = None
    conversation_id: Any = None
    http_worker_ipc: Any = None
    background: Any = False
    require_reasoning: Any = False
    max_thinking_tokens: Any = None
    priority: Any = None
    extra_key: Any = None
    no_logs: Any = False
    custom_labels: Any = None
    return_bytes: Any = False
    return_entropy: Any = False
    return_prompt_token_ids: Any = False
    external_trace_header: Any = None
    received_time: Any = None
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None
    mm_data_mooncake: Any = None
    encoder_urls: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    images_config: Any = None
    multi_item_delimiter_indices: Any = None


class WireOpenSessionReq(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    capacity_of_str_len: int | None = None
    session_id: str | None = None
    streaming: bool | None = None
    timeout: float | None = None


class WireCloseSessionReq(msgspec.Struct, forbid_unknown_fields=True):
    session_id: str


class WireAbortReq(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /abort_request``: one ``rid`` (and the samples it expands to) or ``abort_all``."""

    rid: str | None = ""
    abort_all: bool | None = False
    finished_reason: dict[str, object] | None = None
    abort_message: str | None = None


class WirePauseGenerationReq(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /pause_generation`` (SGLang's ``PauseGenerationReqInput``)."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class WireContinueGenerationReq(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /continue_generation``; ``torch_empty_cache`` is accepted (the engine's caching
    allocator keeps its blocks)."""

    torch_empty_cache: bool = True


class WireUpdateWeightsFromDiskReq(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    model_path: str
    weight_version: str | None = None
    flush_cache: bool | None = True
    abort_all_requests: bool | None = False
    load_format: str | None = None


# --- responses ------------------------------------------------------------------------------


class WireFinishReason(msgspec.Struct, omit_defaults=True):
    """SGLang's ``finish_reason``: ``{"type": "stop", "matched": id|str}``, ``{"type":
    "length", "length": n}`` or ``{"type": "abort", "message": ...}``."""

    type: str
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None


LogprobEntry = tuple[float | None, int, str | None]
"""``(logprob, token_id, token_text | None)``; SGLang's first input position has logprob None."""
TopEntries = list[LogprobEntry] | None
"""One position's top-k or chosen-id entries (None: the first input position)."""


class WireMetaInfo(msgspec.Struct, omit_defaults=True):
    id: str
    finish_reason: WireFinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str | int | None = None
    e2e_latency: float = 0.0
    output_token_logprobs: list[LogprobEntry] | None = None
    input_token_logprobs: list[LogprobEntry] | None = None
    output_token_logprobs_length: int | None = None
    input_top_logprobs: list[TopEntries] | None = None
    output_top_logprobs: list[TopEntries] | None = None
    input_token_ids_logprobs: list[TopEntries] | None = None
    output_token_ids_logprobs: list[TopEntries] | None = None
    token_versions: list[int] | None = None
    """agentrl's extension (SGLang clients ignore it): the weight version of each output token,
    sent only when they differ (``in_flight="partial"``); absent: all are ``weight_version``."""


class WireGenerateResp(msgspec.Struct, omit_defaults=True):
    text: str
    meta_info: WireMetaInfo
    output_ids: list[int] | None = None
    index: int | None = None
    """Streamed chunks of a batch or of ``n > 1``: which sample (prompt-major) this chunk is."""


class WireUpdateWeightsResp(msgspec.Struct):
    success: bool
    message: str = ""
    num_paused_requests: int = 0


class WireModelInfo(msgspec.Struct):
    """``GET /get_model_info`` (SGLang's keys; ``agentrl`` is our extension)."""

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: str | None = None
    weight_version: str | int | None = None
    agentrl: dict[str, int | bool | str | None] | None = None


class WireModelCard(msgspec.Struct):
    id: str
    object: str = "model"
    created: int = 0
    """When the server started (Unix seconds), as OpenAI's and SGLang's model cards say."""
    owned_by: str = "agentrl"
    root: str | None = None
    max_model_len: int | None = None


class WireModelList(msgspec.Struct):
    data: list[WireModelCard]
    object: str = "list"


class WireErrorBody(msgspec.Struct, omit_defaults=True):
    message: str
    field: str | None = None


class WireError(msgspec.Struct):
    """Error body: ``{"error": {"message": ..., "field": ...}}`` as SGLang's /generate errors."""

    error: WireErrorBody
    object: str = "error"
    code: int = 400


encoder = msgspec.json.Encoder()
generate_req_decoder = msgspec.json.Decoder(WireGenerateReq)
open_session_decoder = msgspec.json.Decoder(WireOpenSessionReq)
close_session_decoder = msgspec.json.Decoder(WireCloseSessionReq)
abort_req_decoder = msgspec.json.Decoder(WireAbortReq)
update_weights_req_decoder = msgspec.json.Decoder(WireUpdateWeightsFromDiskReq)
pause_req_decoder = msgspec.json.Decoder(WirePauseGenerationReq)
continue_req_decoder = msgspec.json.Decoder(WireContinueGenerationReq)
generate_resp_decoder = msgspec.json.Decoder(WireGenerateResp | list[WireGenerateResp])
update_weights_resp_decoder = msgspec.json.Decoder(WireUpdateWeightsResp)
model_info_decoder = msgspec.json.Decoder(WireModelInfo)
model_list_decoder = msgspec.json.Decoder(WireModelList)
session_id_decoder = msgspec.json.Decoder(str | None)


_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_FIELD = re.compile(r"field `([^`]+)`")


def error_field(exc: msgspec.MsgspecError) -> str | None:
    """The field a msgspec validation error names (``sampling_params.top_q``, ``input_ids[1]``)."""
    text = str(exc)
    at, field = _AT.search(text), _FIELD.search(text)
    parts = [at.group(1) if at else "", field.group(1) if field else ""]
    return ".".join(p for p in parts if p) or None


def parse_weight_version(value: str | int | None, default: int = 0) -> int:
    """SGLang's ``weight_version`` is a string (``"default"`` until set); ours are integers.

    ``default`` stands in only where the server reports no version at all. A version that is
    not an integer (``"default"``: a server no publication of ours reached, such as a worker
    registered with a router since the last one, serving the weights it started with) is 0,
    the oldest: counting its tokens as the engine's current version would train on them as
    if the current policy had sampled them."""
    if value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic GC off while the block runs (any thread; nested and concurrent uses keep
    it off until the last one leaves). Decoding a body of millions of small lists otherwise
    runs the collector over the growing tree again and again: 15 s instead of 0.4 s for 2M
    one-id prompts, all of it holding the GIL. Decoded JSON holds no reference cycles, so the
    pause leaves nothing for the collector to find later."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()
