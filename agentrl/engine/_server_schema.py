"""The parts of SGLang's ``/generate`` request schema that ``agentrl serve`` accepts but does
not implement: each is served at its neutral value (the value that changes nothing) and any
other value is a 400 naming the field and the value.

SGLang 0.5.17 declares these fields on ``GenerateReqInput`` and ``SamplingParams``; an
unmodified SGLang client sends several of them at their defaults (``lora_path: null``,
``return_hidden_states: false``, ``custom_logit_processor: null`` ...). Per-request batch forms
(a list with one value per prompt) are neutral when every element is. Fields that only label or
route a request on a single server (``log_metrics``, ``no_logs``, ``custom_labels``,
``conversation_id``, ``routing_key``, ``external_trace_header``, ``received_time``,
``routed_experts_start_len`` without ``return_routed_experts``) are accepted with any value and
have no effect.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentrl._config import short_repr

from . import _wire as w


def _unset(value: Any) -> bool:
    """None, or a per-prompt list of None (SGLang's batch form)."""
    return value is None or (isinstance(value, list) and all(v is None for v in value))


def _false(value: Any) -> bool:
    return (
        value is None
        or value is False
        or (isinstance(value, list) and all(v is None or v is False for v in value))
    )


def _no_data(value: Any) -> bool:
    """No multimodal data: None, ``[]`` or a list of None / ``[]`` (SGLang treats these alike)."""
    return value is None or (isinstance(value, list) and all(v in (None, []) for v in value))


def _rank_zero(value: Any) -> bool:
    """One server is data-parallel rank 0 of a DP group of one."""
    return value is None or (type(value) is int and value == 0)


def _empty(value: Any) -> bool:
    return value is None or value == "" or value == {} or value == []


def _anything(value: Any) -> bool:
    return True


_REQUEST: dict[str, tuple[Callable[[Any], bool], str]] = {
    "session_id": (_unset, "null"),
    "input_embeds": (_unset, "null"),
    "image_data": (_no_data, "null"),
    "video_data": (_no_data, "null"),
    "audio_data": (_no_data, "null"),
    "mm_hashes": (_no_data, "null"),
    "use_audio_in_video": (_false, "false"),
    "modalities": (_no_data, "null"),
    "positional_embed_overrides": (_unset, "null"),
    "return_sampling_mask": (_false, "false"),
    "return_flat_raw_top_logprobs": (_false, "false"),
    "return_flat_raw_top_logprobs_b64": (_false, "false"),
    "return_hidden_states": (_false, "false"),
    "return_routed_experts": (_false, "false"),
    "return_indexer_topk": (_false, "false"),
    "lora_path": (_unset, "null"),
    "lora_id": (_unset, "null"),
    "custom_logit_processor": (_unset, "null"),
    "bootstrap_host": (_unset, "null"),
    "bootstrap_port": (_unset, "null"),
    "bootstrap_room": (_unset, "null"),
    "bootstrap_pair_key": (_unset, "null"),
    "decode_tp_size": (_unset, "null"),
    "routed_dp_rank": (_rank_zero, "null or 0"),
    "data_parallel_rank": (_rank_zero, "null or 0"),
    "disagg_prefill_dp_rank": (_rank_zero, "null or 0"),
    "http_worker_ipc": (_unset, "null"),
    "background": (_false, "false"),
    "require_reasoning": (_false, "false"),
    "max_thinking_tokens": (_unset, "null"),
    "priority": (_unset, "null"),
    "extra_key": (_unset, "null"),
    "return_bytes": (_false, "false"),
    "return_entropy": (_false, "false"),
    "return_prompt_token_ids": (_false, "false"),
    "need_wait_for_mm_inputs": (_false, "null or false"),
    "num_items_assigned": (_unset, "null"),
    "mm_data_mooncake": (_unset, "null"),
    "encoder_urls": (_unset, "null"),
    "max_dynamic_patch": (_unset, "null"),
    "min_dynamic_patch": (_unset, "null"),
    "image_max_dynamic_patch": (_unset, "null"),
    "video_max_dynamic_patch": (_unset, "null"),
    "images_config": (_unset, "null"),
    "multi_item_delimiter_indices": (_unset, "null"),
    # labels and routing hints: no effect on one server
    "routing_key": (_anything, ""),
    "conversation_id": (_anything, ""),
    "no_logs": (_anything, ""),
    "custom_labels": (_anything, ""),
    "external_trace_header": (_anything, ""),
    "received_time": (_anything, ""),
    "routed_experts_start_len": (_anything, ""),
}

_SAMPLING: dict[str, tuple[Callable[[Any], bool], str]] = {
    "frequency_penalty": (lambda v: v is None or v == 0, "0.0"),
    "presence_penalty": (lambda v: v is None or v == 0, "0.0"),
    "repetition_penalty": (lambda v: v is None or v == 1, "1.0"),
    "min_new_tokens": (lambda v: v is None or v == 0, "0"),
    "stop_regex": (_empty, "null"),
    "json_schema": (_empty, "null"),
    "regex": (_empty, "null"),
    "ebnf": (_empty, "null"),
    "structural_tag": (_empty, "null"),
    "logit_bias": (_empty, "null"),
    "custom_params": (_empty, "null"),
}


def unsupported(req: w.WireGenerateReq) -> tuple[str, str] | None:
    """``(message, field)`` for the first field set to a value agentrl serve cannot serve."""
    for name, (neutral, expected) in _REQUEST.items():
        value = getattr(req, name)
        if not neutral(value):
            return (
                f"{name}={short_repr(value)} is not supported by agentrl serve (only {expected})",
                name,
            )
    params = req.sampling_params
    listed = isinstance(params, list)
    for index, wire in enumerate(params if isinstance(params, list) else [params]):
        if wire is None:
            continue
        where = f"sampling_params[{index}]" if listed else "sampling_params"
        for name, (neutral, expected) in _SAMPLING.items():
            value = getattr(wire, name)
            if not neutral(value):
                message = f"{where}.{name}={short_repr(value)} is not supported by agentrl serve"
                return f"{message} (only {expected})", f"{where}.{name}"
    return None
