"""``GET /server_info`` (and the older ``/get_server_info``) for ``agentrl serve``.

SGLang answers with its server arguments, its scheduler's limits, ``internal_states`` and its
version; this is the subset a client reads, with this server's real values: ``model_path``,
``tokenizer_path``, ``served_model_name``, ``context_length``, ``page_size``,
``max_total_num_tokens`` (KV pool tokens), ``max_req_input_len``, ``max_running_requests``,
``chunked_prefill_size`` (the engine's ``max_step_tokens``: decode rows count in it),
``disable_radix_cache``, ``disable_cuda_graph`` (true where decode steps run without captured
graphs, the CPU included), ``cuda_graph_max_bs_decode`` and ``cuda_graph_bs_decode`` (the
captured batch sizes, ``null`` without graphs; SGLang 0.5.17's names, also given under the older
names ``cuda_graph_max_bs`` and ``cuda_graph_bs``), ``decode_attention_backend`` and
``prefill_attention_backend`` (the engine's ``decode_attention``/``prefill_attention``: ``auto``,
``sdpa`` or ``triton``), ``incremental_streaming_output``, ``stream_interval``,
``weight_version``, ``version`` (agentrl's) and ``internal_states`` (``last_gen_throughput`` in
tokens/s of the last finished request, and the numbers of running and waiting requests).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ._server_metrics import engine_statistics, kv_facts

if TYPE_CHECKING:
    from ._server import _Server


def load(server: _Server) -> list[dict[str, Any]]:
    """``GET /get_load``: SGLang 0.5.17's shape (one entry per data-parallel rank; this server
    has one), which ``sglang-router``'s ``power_of_two`` policy reads (``num_tokens``) to send
    each request to the less loaded of two workers. ``num_tokens``: KV tokens the pool cannot
    give back (what running requests hold, their prompt pages in the radix tree included;
    SGLang's "used" tokens) plus the context tokens of waiting ones, ``num_pending_tokens`` the
    latter."""
    stats = engine_statistics(server.engine)

    def read(name: str) -> int:  # an engine without statistics (or a field) reports 0
        return int(getattr(stats, name, 0) or 0)

    running, waiting, pending = read("running"), read("waiting"), read("waiting_tokens")
    held = read("kv_blocks") - read("kv_blocks_free") - read("kv_blocks_evictable")
    in_use = max(0, held) * read("block_size")  # the reads are not one snapshot
    return [
        {
            "dp_rank": 0,
            "num_reqs": running + waiting,
            "num_waiting_reqs": waiting,
            "num_tokens": in_use + pending,
            "num_pending_tokens": pending,
            "ts_tic": time.perf_counter(),
        }
    ]


def server_info(server: _Server) -> dict[str, Any]:
    import agentrl

    engine = server.engine
    stats = engine_statistics(engine)
    options = getattr(engine, "options", None)
    page = kv_facts(engine)["page_size"]
    pool_tokens = None
    if stats is not None and getattr(stats, "kv_blocks", None) is not None:
        pool_tokens = int(stats.kv_blocks) * int(stats.block_size)
    context = engine.max_context
    graphs = list(getattr(engine, "cuda_graph_sizes", []))
    largest = max(graphs) if graphs else None
    return {
        "model_path": server.model_path,
        "tokenizer_path": server.tokenizer_path,
        "served_model_name": server.served_name,
        "context_length": context,
        "page_size": page,
        "max_total_num_tokens": pool_tokens,
        "max_req_input_len": context - 1,
        "max_running_requests": getattr(options, "max_batch_size", None),
        "chunked_prefill_size": getattr(engine, "max_step_tokens", None),
        "disable_radix_cache": not getattr(options, "radix_cache", True),
        "disable_cuda_graph": not graphs,
        "cuda_graph_max_bs_decode": largest,
        "cuda_graph_bs_decode": graphs or None,
        "cuda_graph_max_bs": largest,
        "cuda_graph_bs": graphs or None,
        "decode_attention_backend": getattr(options, "decode_attention", None),
        "prefill_attention_backend": getattr(options, "prefill_attention", None),
        "incremental_streaming_output": server.incremental_streaming_output,
        "stream_interval": server.stream_interval,
        "enable_streaming_session": True,
        "skip_tokenizer_init": False,
        "weight_version": str(engine.weight_version),
        "version": agentrl.__version__,
        "internal_states": [
            {
                "last_gen_throughput": server.last_gen_throughput,
                "num_running_reqs": getattr(stats, "running", None),
                "num_queue_reqs": getattr(stats, "waiting", None),
            }
        ],
    }
