"""msgspec structs for the SGLang HTTP subset that ``agentrl serve`` and ``SGLangEngine`` speak.

Field names and defaults follow SGLang 0.5.17 (``io_struct.py``, ``sampling_params.py``,
``http_server.py``). Request structs refuse unknown fields so a typo fails loudly with the path of
the field (``$.sampling_params.top_q``); response structs ignore unknown fields so the client
keeps decoding when SGLang adds some. Encoders and decoders are built once, here.
"""

from __future__ import annotations

import re

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

    max_new_tokens: int | None = 128
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


class WireGenerateReq(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /generate``. ``input_ids`` is one prompt or a batch (list of lists)."""

    input_ids: list[int | list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: WireSamplingParams | list[WireSamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | None = False
    logprob_start_len: int | None = -1
    return_text_in_logprobs: bool | None = False
    session_params: WireSessionParams | None = None
    stream: bool | None = False
    log_metrics: bool | None = True
    top_logprobs_num: int | None = 0


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
    """SGLang's ``weight_version`` is a string (``"default"`` until set); ours are integers."""
    if value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default
