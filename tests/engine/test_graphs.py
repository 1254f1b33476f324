"""Captured decode steps (``agentrl.engine._graphs``): buckets, which steps replay, padding
rows that write only the pool's pad block, weights updated in place, and when the engine
captures at all. On the CPU the static-buffer forward runs eagerly (``replay="eager"``) with the
decode kernel in Triton's interpreter; replaying real CUDA graphs is a ``gpu`` test
(tests/engine/test_device.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from agentrl._errors import EngineError
from agentrl._types import SamplingParams
from agentrl.engine import EmbeddedEngine, _embedded
from agentrl.engine._batch import Row
from agentrl.engine._embedded import graph_replay
from agentrl.engine._graphs import DecodeGraphs, capture_sizes
from agentrl.engine._kv import KVPool
from agentrl.engine._model import CausalLM, read_safetensors
from agentrl.engine._options import EngineOptions
from agentrl.kernels import triton_available

needs_kernel = pytest.mark.skipif(
    not triton_available("cpu"), reason="needs Triton's interpreter (TRITON_INTERPRET=1)"
)
BLOCK = 4


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> CausalLM:
    return CausalLM.from_folder(tiny_dir)


def make_pool(model: CausalLM, blocks: int = 24, *, pad_block: bool = True) -> KVPool:
    c = model.config
    return KVPool(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        num_blocks=blocks,
        block_size=BLOCK,
        pad_block=pad_block,
    )


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(128)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-2:] == [120, 128] and len(sizes) == 19


def test_refusals(model: CausalLM) -> None:
    pool = make_pool(model)
    with pytest.raises(EngineError, match="CUDA graphs need a CUDA device, the KV pool is on cpu"):
        DecodeGraphs(model, pool, max_batch_size=4, max_context=32)
    with pytest.raises(EngineError, match="replay must be one of"):
        DecodeGraphs(model, pool, max_batch_size=4, max_context=32, replay="lazy")
    if triton_available("cpu"):
        with pytest.raises(EngineError, match="pad_block=True"):
            DecodeGraphs(
                model, make_pool(model, pad_block=False), max_batch_size=4, max_context=32,
                replay="eager",
            )  # fmt: skip


@needs_kernel
def test_which_steps_replay(model: CausalLM) -> None:
    graphs = DecodeGraphs(model, make_pool(model), max_batch_size=6, max_context=30, replay="eager")
    assert graphs.sizes == [1, 2, 4, 6] and graphs.capacity == 32
    tokens = list(range(10, 40))
    decode = Row(tokens, 9, 1, [0, 1, 2], True)
    assert graphs.accepts([decode] * 6)
    assert [graphs.bucket(n) for n in (1, 2, 3, 5, 6, 7)] == [1, 2, 4, 6, 6, None]
    assert not graphs.accepts([])
    assert not graphs.accepts([decode] * 7)  # no bucket holds 7 rows
    assert not graphs.accepts([decode, Row(tokens, 0, 9, [3, 4, 5], True)])  # a prefill chunk
    assert graphs.accepts([decode, decode._replace(sample=False)])  # a closing turn's feed
    assert not graphs.accepts([decode._replace(extra=(3, 10))])  # input-token logits wanted
    assert not graphs.accepts([decode._replace(start=32)])  # past the captured table


@needs_kernel
def test_the_graphs_read_only_their_own_buffers(model: CausalLM) -> None:
    """Every tensor a bucket's forward reads besides the weights and the pool is a view of the
    graphs' persistent buffers. A tensor made for one capture and then dropped would be freed
    while the graph still reads its address (the eager replay here would never notice)."""
    graphs = DecodeGraphs(model, make_pool(model), max_batch_size=8, max_context=32, replay="eager")
    owned = {
        t.untyped_storage().data_ptr()
        for t in (graphs._vectors, graphs._tables, graphs._rows, graphs._logits)
    }
    assert sorted(graphs.batches) == graphs.sizes
    for size, batch in graphs.batches.items():
        tensors = [batch.input_ids, batch.positions, batch.slots, batch.logits_rows]
        tensors += batch.attention.tensors()
        assert {t.untyped_storage().data_ptr() for t in tensors} <= owned, size
        assert batch.attention.seq_lens == [graphs.capacity] * size
    assert graphs._runs[8]().untyped_storage().data_ptr() in owned  # the logits buffer


@needs_kernel
def test_padding_rows_write_only_the_pad_block(model: CausalLM) -> None:
    """Three decode rows in the 4-row bucket: the step writes each row's new K/V at its slot
    and the padding row's at the pad block's first slot, nothing else in the pool changes
    (unused blocks hold NaN: a read of one would also poison the logits), and the logits are
    finite; a later, smaller step still writes only its own slots."""
    pool = make_pool(model)
    gen = torch.Generator().manual_seed(5)
    pool.k.fill_(float("nan"))
    pool.v.fill_(float("nan"))
    rng = random.Random(2)
    tables = {9: [7, 3, 12], 5: [1, 20], 2: [15]}  # length before the step: its blocks
    rows = []
    for length, blocks in tables.items():
        for b in blocks:  # the rows' existing KV: finite noise
            pool.k[:, b].normal_(generator=gen)
            pool.v[:, b].normal_(generator=gen)
        tokens = [rng.randrange(3, model.config.vocab_size) for _ in range(length + 1)]
        rows.append(Row(tokens, length, 1, blocks, True))
    graphs = DecodeGraphs(model, pool, max_batch_size=4, max_context=16, replay="eager")
    for step in (rows, rows[1:2]):
        before_k, before_v = pool.k.clone(), pool.v.clone()
        logits = graphs.run(step)
        assert logits.shape == (len(step), model.config.vocab_size)
        assert bool(torch.isfinite(logits).all())
        slots = {r.blocks[r.start // BLOCK] * BLOCK + r.start % BLOCK for r in step}
        if graphs.bucket(len(step)) > len(step):
            slots.add(pool.pad_block * BLOCK)
        for before, after in ((before_k, pool.k), (before_v, pool.v)):
            flat_before = before.flatten(1, 2)  # [layers, slots, kv_heads, dim]
            flat_after = after.flatten(1, 2)
            same = (flat_before == flat_after) | (flat_before.isnan() & flat_after.isnan())
            changed = {int(s) for s in (~same).any(dim=(0, 2, 3)).nonzero()[:, 0]}
            assert changed == slots
    assert graphs.replays == 2


@needs_kernel
def test_rows_that_do_not_sample_return_no_logits(model: CausalLM) -> None:
    """A finished session turn's last token only writes its KV: the step returns the other
    rows' logits, in order, as the same step with every row sampling does for them."""
    pool = make_pool(model)
    gen = torch.Generator().manual_seed(8)
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    rows = [Row(list(range(20, 31)), 10, 1, [2 * i, 2 * i + 1, 2 * i + 9], True) for i in range(3)]
    graphs = DecodeGraphs(model, pool, max_batch_size=4, max_context=16, replay="eager")
    every = graphs.run(rows).clone()
    closing = graphs.run([rows[0], rows[1]._replace(sample=False), rows[2]])
    assert closing.shape == (2, model.config.vocab_size)
    assert torch.equal(closing, every[[0, 2]])
    assert graphs.run([rows[1]._replace(sample=False)]).shape == (0, model.config.vocab_size)


def test_weight_updates_keep_the_captured_tensors(tiny_dir: Path, model: CausalLM) -> None:
    """New weights are copied into the tensors a graph captured (their addresses stay), and the
    model then computes with the new values."""
    model = CausalLM.from_folder(tiny_dir)
    tensors = [model.embed, model.lm_head, model.norm]
    tensors += [t for layer in model.layers for t in vars(layer).values() if t is not None]
    addresses = [t.data_ptr() for t in tensors]
    gen = torch.Generator().manual_seed(3)
    state = {
        k: v + 0.1 * torch.randn(v.shape, generator=gen)
        for k, v in read_safetensors(tiny_dir).items()
    }
    model.load_state_dict(state)
    now = [model.embed, model.lm_head, model.norm]
    now += [t for layer in model.layers for t in vars(layer).values() if t is not None]
    assert [t.data_ptr() for t in now] == addresses
    fresh = CausalLM(model.config, state)
    assert torch.equal(model.embed, fresh.embed) and torch.equal(model.lm_head, fresh.lm_head)
    for mine, theirs in zip(model.layers, fresh.layers, strict=True):
        for name, value in vars(theirs).items():
            assert (value is None and getattr(mine, name) is None) or torch.equal(
                getattr(mine, name), value
            ), name


@pytest.mark.anyio
async def test_a_failed_capture_warns_and_runs_uncaptured(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Broken(DecodeGraphs):
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("no capture here")

    monkeypatch.setattr(_embedded, "graph_replay", lambda options, device: "eager")
    monkeypatch.setattr(_embedded, "DecodeGraphs", Broken)
    want = r"capturing CUDA graphs .* failed \(RuntimeError: no capture here\); decode steps run"
    with pytest.warns(RuntimeWarning, match=want):
        engine = EmbeddedEngine.from_pretrained(tiny_dir, num_threads=1, max_batch_size=2)
    try:
        assert engine.cuda_graph_sizes == []
        assert engine.cuda_graph_error == "RuntimeError: no capture here"
        greedy = SamplingParams(max_new_tokens=3, temperature=0)
        result = await engine.generate([5, 6, 7], greedy)
        assert len(result.token_ids) == 3 and engine.statistics().graph_steps == 0
    finally:
        await engine.aclose()


def test_when_the_engine_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(_embedded, "triton_available", lambda device: True)
    options = EngineOptions()
    assert options.cuda_graph and options.cuda_graph_max_bs is None
    assert graph_replay(options, cuda) == "cuda"
    assert graph_replay(options.replace(decode_attention="triton"), cuda) == "cuda"
    assert graph_replay(options, cpu) is None
    assert graph_replay(options.replace(cuda_graph=False), cuda) is None
    assert graph_replay(options.replace(decode_attention="sdpa"), cuda) is None
    monkeypatch.setattr(_embedded, "triton_available", lambda device: False)
    assert graph_replay(options, cuda) is None
