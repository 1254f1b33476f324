"""``EngineOptions.device``: the embedded engine on the CPU (the default, unchanged) or on a CUDA
device. Here: the option's checks, ``agentrl serve --device/--dtype``, and two guards that run on
any CPU: the worker thread makes no tensor on torch's *default* device (one made there would sit
on the CPU while the model is on a GPU), and a whole step runs with everything on ``meta``
(no CPU tensor leaks into the forward). The ``gpu`` tests compare a CUDA engine with the CPU
engine on tiny-random; they skip without CUDA."""

from __future__ import annotations

import copy
import dataclasses
import random
import shutil
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from numerics import SPLIT_FP32_UNIT_ROUNDOFF, LogprobError, assert_within, unit_roundoff
from safetensors.torch import save_file
from transformers import AutoTokenizer, PreTrainedModel

from agentrl._errors import EngineError
from agentrl._types import GenerateResult, SamplingParams
from agentrl.engine import EmbeddedEngine, _embedded, _graphs, open_embedded_engine
from agentrl.engine._batch import Row, build_forward_batch
from agentrl.engine._decode import AttentionKernelChooser
from agentrl.engine._device import resolve_device, resolve_dtype
from agentrl.engine._kv import PREFILL_PAD, KVPool
from agentrl.engine._model import CausalLM, ModelConfig, read_safetensors
from agentrl.engine._options import dtype_name, parse_device
from agentrl.engine._server import serve_main
from agentrl.engine._worker import Worker
from agentrl.kernels import triton_available

needs_kernel = pytest.mark.skipif(
    not triton_available("cpu"), reason="needs Triton's interpreter (TRITON_INTERPRET=1)"
)
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
Outcome = tuple[list[int], list[float], str, int]
"""What a run is compared on: ids, logprobs, finish reason, cached tokens."""


@pytest.fixture(scope="module")
def perturbed(tiny_dir: Path) -> dict[str, torch.Tensor]:
    """tiny-random's weights plus seeded noise (CPU tensors), for a weight update."""
    generator = torch.Generator().manual_seed(11)
    state = read_safetensors(tiny_dir)
    return {k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in state.items()}


async def generate_batch(
    engine: EmbeddedEngine, calls: list[tuple[list[int], SamplingParams]]
) -> list[GenerateResult]:
    """Run ``calls`` concurrently, all queued in order before the worker plans a step, so the
    steps (and their last-bit rounding) are the same in every run. The worker's lock is
    reentrant: our tasks submit while we hold it, the worker waits for it."""
    worker, results = engine._worker, {}

    async def one(i: int) -> None:
        results[i] = await engine.generate(*calls[i])

    async with anyio.create_task_group() as tg:
        with worker._cond, anyio.fail_after(30):
            for i in range(len(calls)):
                tg.start_soon(one, i)
                while len(worker._inbox) <= i:  # queued: arrival order is call order
                    await anyio.sleep(0)
    return [results[i] for i in range(len(calls))]


def _contexts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 17, 40, 75)]


def workload_prompts(outcomes: list[Outcome]) -> list[tuple[list[int], bool]]:
    """Each ``workload`` request's prompt, and whether it ran on the updated weights."""
    contexts = _contexts()
    prompts = [(c, False) for c in contexts] + [(contexts[1], False)] * 2
    prompts += [(contexts[2], False)] * 3
    context = contexts[3]
    for _ in range(2):
        prompts.append((context, False))
        context = context + outcomes[len(prompts) - 1][0] + [2, 198]
    return [*prompts, (contexts[0], True)]


def workload_bounds(
    outcomes: list[Outcome], reference: PreTrainedModel, weights: dict, **emulation: Any
) -> list[float]:
    """Per request, how far its logprobs may be from exact (``numerics.LogprobError``, at
    temperature 1: every request samples at 1, greedy ones record the logprobs at 1)."""
    updated = copy.deepcopy(reference)
    missing, unexpected = updated.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    errors = {False: LogprobError(reference, **emulation), True: LogprobError(updated, **emulation)}
    return [
        errors[after](prompt, outcome[0])
        for (prompt, after), outcome in zip(workload_prompts(outcomes), outcomes, strict=True)
    ]


async def workload(engine: EmbeddedEngine, weights: dict[str, torch.Tensor]) -> list[Outcome]:
    """Greedy and seeded sampled requests in one batch (chunked prefill, batched decode, a GRPO
    group sharing a prompt's KV), a two-turn session, then a weight update and one request."""
    contexts = _contexts()
    calls = [(c, GREEDY) for c in contexts]
    calls += [
        (contexts[1], SamplingParams(max_new_tokens=8, top_p=0.9, seed=seed)) for seed in (1, 2)
    ]
    calls += [
        (contexts[2], SamplingParams(max_new_tokens=6, top_k=20, seed=seed)) for seed in range(3)
    ]
    done = await generate_batch(engine, calls)
    session = await engine.open_session()
    context = contexts[3]
    for _ in range(2):
        done.append(await engine.generate(context, GREEDY, session=session))
        context = context + done[-1].token_ids + [2, 198]
    await engine.close_session(session)
    await engine.update_weights(1, weights)
    done.append(await engine.generate(contexts[0], GREEDY))
    assert done[-1].weight_version == 1
    return [(r.token_ids, r.logprobs, r.finish_reason, r.cached_tokens) for r in done]


async def run(tiny_dir: Path, weights: dict[str, torch.Tensor], **options: Any) -> list[Outcome]:
    options = {"max_batch_size": 4, "max_step_tokens": 32, "num_threads": 2, **options}
    async with open_embedded_engine(tiny_dir, **options) as engine:
        return await workload(engine, weights)


# -- the CPU ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_explicit_cpu_is_the_default(tiny_dir: Path, perturbed: dict) -> None:
    default = await run(tiny_dir, perturbed)
    explicit = await run(tiny_dir, perturbed, device="cpu")
    assert explicit == default  # ids, logprobs (bit for bit), finish reasons, cached tokens


@pytest.mark.anyio
@pytest.mark.parametrize(
    "attention",
    [
        pytest.param({"decode_attention": "sdpa"}, id="sdpa"),
        pytest.param({"decode_attention": "triton"}, marks=needs_kernel, id="triton"),
        pytest.param({"prefill_attention": "triton"}, marks=needs_kernel, id="triton-prefill"),
    ],
)
async def test_worker_names_the_device_of_every_tensor(
    tiny_dir: Path, perturbed: dict, monkeypatch: pytest.MonkeyPatch, attention: dict
) -> None:
    """Inside the worker thread torch's default device is ``meta``: a tensor made there without
    naming its device (the engine's, or the CPU on purpose) breaks the step or its numbers."""
    plain = await run(tiny_dir, perturbed, **attention)
    main = Worker._main

    def on_meta(self: Worker) -> None:
        with torch.device("meta"):
            main(self)

    monkeypatch.setattr(Worker, "_main", on_meta)
    assert await run(tiny_dir, perturbed, device="cpu", **attention) == plain


@pytest.mark.anyio
@needs_kernel
async def test_captured_decode_steps_match_plain_steps(
    tiny_dir: Path,
    perturbed: dict,
    reference_model: PreTrainedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The workload with its decode steps replayed through ``DecodeGraphs`` (eagerly here: the
    same static buffers, buckets and padding rows a CUDA graph replays) gives the plain Triton
    steps' ids, finish reasons and reuse, logprobs within the two runs' bounds: steps of 1, 2
    (two padding rows) and 4 rows replayed, before and after the weight update, the session
    turns' last tokens (KV written, no logits read) included."""
    plain = await run(tiny_dir, perturbed, decode_attention="triton")
    made: list[_graphs.DecodeGraphs] = []

    class Recording(_graphs.DecodeGraphs):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rows_seen: set[int] = set()
            self.closing_rows = 0
            made.append(self)

        def run(self, rows: Any) -> torch.Tensor:
            self.rows_seen.add(len(rows))
            self.closing_rows += sum(not r.sample for r in rows)
            return super().run(rows)

    monkeypatch.setattr(_embedded, "graph_replay", lambda options, device: "eager")
    # buckets 1 and 4 only: steps of 2 (and 3) rows replay with padding rows
    monkeypatch.setattr(_graphs, "capture_sizes", lambda largest: [1, largest])
    monkeypatch.setattr(_embedded, "DecodeGraphs", Recording)
    replayed = await run(tiny_dir, perturbed, decode_attention="triton")
    (graphs,) = made
    assert graphs.sizes == [1, 4] and graphs.rows_seen >= {1, 2, 4}
    assert graphs.closing_rows == 2  # each session turn's last token, fed without sampling
    bounds = workload_bounds(plain, reference_model, perturbed)
    assert_close_runs(replayed, plain, [2 * b for b in bounds])


@pytest.mark.anyio
@needs_kernel
async def test_fused_ops_match_torch_ops(
    tiny_dir: Path, perturbed: dict, reference_model: PreTrainedModel
) -> None:
    """The forward with the fused Triton kernels (RMSNorm with its residual add, rotary
    embedding, SiLU·mul; here in Triton's interpreter) gives the torch operations' greedy ids,
    finish reasons and reuse, logprobs within the two runs' bounds, through the whole workload.

    The fused kernels round less often: logits ~1e-6 from the torch path's, enough to move a
    sampled draw across a boundary now and then (``assert_close_runs``)."""
    plain = await run(tiny_dir, perturbed, decode_attention="triton", fused_ops="torch")
    fused = await run(tiny_dir, perturbed, decode_attention="triton", fused_ops="triton")
    bounds = workload_bounds(plain, reference_model, perturbed)
    assert_close_runs(fused, plain, [2 * b for b in bounds])


@pytest.mark.usefixtures("no_weight_loading")
def test_fused_ops_triton_without_gpu_or_interpreter_is_refused(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(EngineError, match="fused_ops='triton' cannot run on cpu"):
        EmbeddedEngine.from_pretrained(tiny_dir, fused_ops="triton")


def test_fused_ops_for_shapes_the_kernels_do_not_take(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model too wide for one program per row, or in a dtype the kernels do not take:
    "auto" keeps torch's operations, "triton" is refused with the reason."""
    config = ModelConfig.from_folder(tiny_dir)
    assert _embedded.use_fused_ops("auto", torch.device("cpu"), config) is False  # CPU: torch
    cuda = torch.device("cuda")
    monkeypatch.setattr(_embedded, "triton_available", lambda device: True)
    assert _embedded.use_fused_ops("auto", cuda, config) is True
    wide = dataclasses.replace(config, hidden_size=1 << 17)
    assert _embedded.use_fused_ops("auto", cuda, wide) is False
    with pytest.raises(EngineError, match="cannot run this model: hidden size 131072"):
        _embedded.use_fused_ops("triton", cuda, wide)
    assert _embedded.use_fused_ops("auto", cuda, config, torch.float64) is False
    with pytest.raises(EngineError, match="take float32, float16 and bfloat16, not torch.float64"):
        _embedded.use_fused_ops("triton", cuda, config, torch.float64)


@pytest.mark.anyio
async def test_fused_ops_auto_is_torch_on_the_cpu(tiny_dir: Path) -> None:
    async with open_embedded_engine(tiny_dir, num_threads=1) as engine:
        assert engine._worker.model.fused_ops is False  # the interpreter is for tests only


# -- the option's checks ---------------------------------------------------------------------


@pytest.fixture
def no_weight_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "agentrl.engine._embedded.CausalLM.from_folder",
        lambda *a, **k: pytest.fail("loaded weights"),
    )


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with two CUDA devices, the current one 0 (only the device checks ask)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.usefixtures("no_weight_loading")
@pytest.mark.parametrize("device", ["tpu", "meta", "cuda:x", "mps", ""])
def test_unknown_device_is_refused_before_loading(tiny_dir: Path, device: str) -> None:
    with pytest.raises(EngineError, match="device must be 'cpu', 'cuda' or 'cuda:N', got"):
        EmbeddedEngine.from_pretrained(tiny_dir, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
@pytest.mark.usefixtures("no_weight_loading")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_refused_before_loading(tiny_dir: Path, device: str) -> None:
    with pytest.raises(EngineError, match=f"device='{device}': CUDA is not available here"):
        EmbeddedEngine.from_pretrained(tiny_dir, device=device)


@pytest.mark.usefixtures("no_weight_loading")
@pytest.mark.parametrize("dtype", ["int64", "bool", "complex64", "float8_e4m3fn", "finfo"])
def test_a_dtype_the_engine_cannot_run_is_refused_before_loading(tiny_dir: Path, dtype: str):
    with pytest.raises(
        EngineError, match="dtype must be one of float32, bfloat16, float16, float64"
    ):
        EmbeddedEngine.from_pretrained(tiny_dir, dtype=dtype)


def test_a_kv_pool_larger_than_the_device_names_its_options(tiny_dir: Path) -> None:
    """A pool no machine could hold, or blocks longer than any request, are refused naming the
    option and the bytes asked for (they were the allocator's raw error)."""
    with pytest.raises(EngineError, match=r"kv_cache_tokens=100000000000\) asks for \d+ bytes, "
                       r"more than cpu has \(\d+ bytes\): lower kv_cache_tokens"):  # fmt: skip
        EmbeddedEngine.from_pretrained(tiny_dir, kv_cache_tokens=10**11, num_threads=1)
    with pytest.raises(EngineError, match=r"block_size=100000000 is larger than the context"):
        EmbeddedEngine.from_pretrained(tiny_dir, block_size=10**8, num_threads=1)


@pytest.mark.skipif(
    Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1",
    reason="this kernel grants any allocation (vm.overcommit_memory=1)",
)
def test_a_kv_pool_the_allocator_refuses_is_an_engine_error(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_embedded, "device_memory_bytes", lambda device: None)  # size unknown
    with pytest.raises(EngineError, match=r"asks for \d+ bytes, which cpu cannot allocate"):
        EmbeddedEngine.from_pretrained(tiny_dir, kv_cache_tokens=10**11, num_threads=1)


@pytest.mark.usefixtures("no_weight_loading", "fake_cuda")
def test_missing_cuda_index_is_refused_before_loading(tiny_dir: Path) -> None:
    with pytest.raises(EngineError, match=r"device='cuda:2': no such CUDA device.* has 2"):
        EmbeddedEngine.from_pretrained(tiny_dir, device="cuda:2")


@pytest.mark.usefixtures("fake_cuda")
def test_cuda_means_the_current_device() -> None:
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)


_DEVICE_STRINGS = [
    "cpu", "cuda", "cpu:0", "cuda:0", "cuda:7", "cuda:10", "cuda:127", "CUDA", "Cpu", " cuda",
    "cuda ", "cuda:", "cuda:-1", "cuda:01", "cuda: 1", "cuda:+1", "cuda:1:2", "cuda:1e3",
    "cuda:0x1", "cuda:\u0663", "cuda:99999999999999999999", "", "meta", "mps", "tpu", "cuda:x",
]  # fmt: skip


@pytest.mark.parametrize("text", _DEVICE_STRINGS)
def test_the_torch_free_device_check_is_torchs_syntax(text: str) -> None:
    """Configs are checked without torch: ``parse_device`` accepts exactly the cpu/cuda
    strings ``torch.device`` parses, with the index torch would keep."""
    try:
        expected = torch.device(text)
    except RuntimeError:
        expected = None
    if expected is not None and expected.type not in ("cpu", "cuda"):
        expected = None
    try:
        got = parse_device(text)
    except ValueError as exc:
        assert expected is None, f"{text!r} is a torch device ({expected}) but refused: {exc}"
    else:
        assert expected is not None, f"{text!r} is not a torch device but accepted as {got}"
        assert got == (expected.type, expected.index)


@pytest.mark.parametrize("index", [128, 255, 1000])
def test_a_device_index_torch_would_wrap_is_refused(index: int) -> None:
    """torch keeps the index in 8 bits (``cuda:128`` is index -128 there): refused by name."""
    with pytest.raises(EngineError, match=f"got 'cuda:{index}'"):
        resolve_device(f"cuda:{index}")


@pytest.mark.parametrize("name", ["float32", "float", "bfloat16", "float16", "half", "double"])
def test_dtype_names_are_torchs(name: str) -> None:
    assert resolve_dtype(name) is getattr(torch, name)
    assert resolve_dtype(getattr(torch, name)) is getattr(torch, name)
    assert dtype_name(name) == str(getattr(torch, name)).removeprefix("torch.")


@pytest.mark.anyio
@pytest.mark.usefixtures("fake_cuda")
async def test_cuda_is_the_opening_threads_device(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``open_embedded_engine`` loads in another thread; "cuda" still means the device current
    where it was called (a torchrun rank's), not that thread's."""
    opener = threading.get_ident()
    monkeypatch.setattr(
        torch.cuda, "current_device", lambda: 1 if threading.get_ident() == opener else 0
    )
    loaded_on = []

    def from_folder(folder: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
        loaded_on.append(device)
        raise EngineError("seen enough")

    monkeypatch.setattr(CausalLM, "from_folder", from_folder)
    with pytest.raises(EngineError, match="seen enough"):
        async with open_embedded_engine(tiny_dir, device="cuda"):
            pass
    assert loaded_on == [torch.device("cuda", 1)]


def test_constructor_checks_the_device(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model passed in is checked too, before the worker thread starts."""
    model = CausalLM.from_folder(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    monkeypatch.setattr(
        "threading.Thread.start", lambda self: pytest.fail("started the worker thread")
    )
    with pytest.raises(EngineError, match="device must be"):
        EmbeddedEngine(model, tokenizer, device="tpu")
    with monkeypatch.context() as patched:
        patched.setattr(torch.cuda, "is_available", lambda: True)
        patched.setattr(torch.cuda, "device_count", lambda: 1)
        patched.setattr(torch.cuda, "current_device", lambda: 0)
        with pytest.raises(EngineError, match="the model is on cpu but device='cuda'"):
            EmbeddedEngine(model, tokenizer, device="cuda")


# -- agentrl serve ---------------------------------------------------------------------------


def test_serve_passes_device_and_dtype(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    @asynccontextmanager
    async def opened(path: Path, options: Any = None, **overrides: Any) -> AsyncIterator[None]:
        seen.update(overrides)
        raise EngineError("seen enough")
        yield

    monkeypatch.setattr(_embedded, "open_embedded_engine", opened)
    argv = ["--model", str(tiny_dir), "--port", "0", "--device", "cuda:1", "--dtype", "bfloat16"]
    assert serve_main(argv) == 1
    assert seen == {"device": "cuda:1", "dtype": "bfloat16"}


def test_serve_refuses_a_bad_device(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_main(["--model", str(tiny_dir), "--port", "0", "--device", "tpu"]) == 1
    assert "agentrl serve: device must be 'cpu', 'cuda' or 'cuda:N'" in capsys.readouterr().err


# -- on a GPU --------------------------------------------------------------------------------


CUDA_FP32 = {"overrides": {"bmm": 2 * SPLIT_FP32_UNIT_ROUNDOFF}}
"""How a CUDA fp32 engine may round beyond fp32: its GEMMs are IEEE fp32 (torch's default,
``allow_tf32=False``), its fp32 attention (SDPA's memory-efficient kernel) multiplies split
tf32 products (``numerics.SPLIT_FP32_UNIT_ROUNDOFF`` each, on both operands' behalf: twice it
as the products' unit roundoff)."""


SAMPLED = range(len(_contexts()), len(_contexts()) + 5)
"""``workload``'s seeded top-p and top-k requests."""


def assert_close_runs(got: list[Outcome], want: list[Outcome], bounds: list[float]) -> None:
    """Same ids, finish reasons and reuse; logprobs within ``bounds[i]`` (the two runs'
    error bounds added).

    Two correct evaluations that round differently give logits ~1e-6 apart. A seeded sampled
    request draws by inverse CDF over tiny-random's near-uniform 49k-token distribution
    (boundaries ~2e-5 apart), so a difference that small moves a draw across a boundary now
    and then, and the continuations part. Sampled requests (``SAMPLED``) are held to the same
    reuse and the same logprobs up to the first token the two runs drew differently."""
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        if index in SAMPLED and a[0] != b[0]:
            pairs = zip(a[0], b[0], strict=False)
            shorter = min(len(a[0]), len(b[0]))  # one stopped early: the rest is the same
            same = next((n for n, (x, y) in enumerate(pairs) if x != y), shorter)
            assert a[3] == b[3], f"request {index}: cached tokens differ"
            assert_within(a[1][:same], b[1][:same], bounds[index], f"request {index}")
            continue
        assert a[0] == b[0], f"request {index}: ids differ"
        assert a[2:] == b[2:], f"request {index}: finish reason or cached tokens differ"
        assert_within(a[1], b[1], bounds[index], f"request {index}")


@pytest.mark.gpu
@pytest.mark.anyio
async def test_cuda_fp32_matches_the_cpu(
    tiny_dir: Path, perturbed: dict, reference_model: PreTrainedModel
) -> None:
    """Same ids (greedy and seeded sampling: the generators stay on the CPU), logprobs within
    the two runs' error bounds, same reuse, through batching, chunked prefill, a GRPO group, a
    session and a weight update from CPU tensors."""
    cpu = await run(tiny_dir, perturbed)
    cuda = await run(tiny_dir, perturbed, device="cuda", decode_attention="sdpa")
    cpu_bounds = workload_bounds(cpu, reference_model, perturbed)
    cuda_bounds = workload_bounds(cpu, reference_model, perturbed, **CUDA_FP32)
    assert_close_runs(cuda, cpu, [a + b for a, b in zip(cpu_bounds, cuda_bounds, strict=True)])


@pytest.mark.gpu
@pytest.mark.anyio
async def test_cuda_triton_decode_equals_sdpa(
    tiny_dir: Path, perturbed: dict, reference_model: PreTrainedModel
) -> None:
    """The Triton kernel and "auto" (which times both kernels with CUDA events in the worker
    thread) give SDPA's results on the GPU, within the two runs' error bounds."""
    sdpa = await run(tiny_dir, perturbed, device="cuda", decode_attention="sdpa")
    bounds = workload_bounds(sdpa, reference_model, perturbed, **CUDA_FP32)
    for mode in ("triton", "auto"):
        got = await run(tiny_dir, perturbed, device="cuda", decode_attention=mode)
        assert_close_runs(got, sdpa, [2 * b for b in bounds])


@pytest.mark.gpu
@pytest.mark.anyio
async def test_cuda_graphs_equal_uncaptured_steps(
    tiny_dir: Path, perturbed: dict, reference_model: PreTrainedModel
) -> None:
    """Decode steps replayed from CUDA graphs (the default on a GPU) give the uncaptured
    steps' results within the two runs' bounds; the graphs did run, before and after the
    weight update (copied into the captured tensors)."""
    plain = await run(
        tiny_dir, perturbed, device="cuda", decode_attention="triton", cuda_graph=False
    )
    bounds = workload_bounds(plain, reference_model, perturbed, **CUDA_FP32)
    options = {"max_batch_size": 4, "max_step_tokens": 32, "num_threads": 2}
    async with open_embedded_engine(
        tiny_dir, device="cuda", decode_attention="triton", **options
    ) as engine:
        assert engine.cuda_graph_sizes == [1, 2, 4]
        got = await workload(engine, perturbed)
        assert engine.statistics().graph_steps > 0
    assert_close_runs(got, plain, [2 * b for b in bounds])


@pytest.mark.gpu
@pytest.mark.anyio
async def test_cuda_fused_ops_match_torch_ops(
    tiny_dir: Path, perturbed: dict, reference_model: PreTrainedModel
) -> None:
    """On the GPU (graphs on) the fused elementwise kernels give the torch operations' results
    within the two runs' bounds."""
    options = {"device": "cuda", "decode_attention": "triton"}
    plain = await run(tiny_dir, perturbed, fused_ops="torch", **options)
    bounds = workload_bounds(plain, reference_model, perturbed, **CUDA_FP32)
    fused = await run(tiny_dir, perturbed, fused_ops="triton", **options)
    assert_close_runs(fused, plain, [2 * b for b in bounds])


@pytest.mark.gpu
@pytest.mark.anyio
async def test_cuda_bf16_logprobs_are_close_to_fp32(
    tiny_dir: Path, reference_model: PreTrainedModel
) -> None:
    """bf16 on the GPU: each greedy pick is (nearly) the fp32 argmax, and its logprob is within
    the error bounds of a bf16 evaluation (bf16 weights, every result rounded to bf16, sums
    accumulated in fp32, the final log-softmax in fp32) plus an fp32 one of an fp32 CPU forward
    over the same tokens."""
    rng = random.Random(3)
    contexts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 23, 40, 70)]
    async with open_embedded_engine(
        tiny_dir, device="cuda", dtype="bfloat16", max_batch_size=4
    ) as engine:
        results = await generate_batch(engine, [(c, GREEDY) for c in contexts])
        model, pool = engine._worker.model, engine._worker.scheduler.kv.pool
        assert model.embed.dtype == pool.k.dtype == torch.bfloat16
        assert model.embed.device == pool.k.device == engine.device
    u32 = unit_roundoff(torch.float32)
    bf16 = LogprobError(
        reference_model, emulate=torch.bfloat16, accumulate=torch.float32, round_weights=True,
        overrides={"_log_softmax": u32, "div": u32},
    )  # fmt: skip
    fp32 = LogprobError(reference_model)
    for i, context in enumerate(contexts):
        output = results[i].token_ids
        assert len(output) == GREEDY.max_new_tokens
        with torch.no_grad():  # fp32 on the CPU, over the same tokens
            logits = reference_model(torch.tensor([context + output])).logits[0]
        logprobs = logits[len(context) - 1 : -1].float().log_softmax(-1)
        want = logprobs.gather(1, torch.tensor(output)[:, None])[:, 0]
        bound = bf16(context, output) + fp32(context, output)
        assert_within(results[i].logprobs, want, bound, f"context {i}")
        # bf16's argmax: no fp32 logprob above it by more than both sides' errors, twice
        best = logprobs.max(-1).values
        assert bool((want >= best - 2 * bound).all()), f"context {i}: a pick far below the argmax"


@pytest.mark.gpu
@pytest.mark.anyio
async def test_cuda_weights_and_kv_live_on_the_device(
    tiny_dir: Path, perturbed: dict, tmp_path: Path, reference_model: PreTrainedModel
) -> None:
    """Loading and both kinds of weight update (CUDA tensors, as a trainer on the GPU sends;
    a folder) put every weight on the engine's device; results match a fresh engine."""
    folder = tmp_path / "perturbed"
    shutil.copytree(tiny_dir, folder)
    save_file(perturbed, folder / "model.safetensors", metadata={"format": "pt"})
    context = [1, 9690, 198, 2683, 359, 253, 5356]

    def on_device(engine: EmbeddedEngine) -> None:
        model = engine._worker.model
        tensors = [model.embed, model.lm_head, model.norm, model.cos, model.sin]
        tensors += [t for layer in model.layers for t in vars(layer).values() if t is not None]
        tensors += [engine._worker.scheduler.kv.pool.k, engine._worker.scheduler.kv.pool.v]
        assert {t.device for t in tensors} == {engine.device}

    async with open_embedded_engine(tiny_dir, device="cuda") as engine:
        assert engine.device.type == "cuda" and engine.device.index is not None
        on_device(engine)
        await engine.update_weights(1, {k: v.to(engine.device) for k, v in perturbed.items()})
        on_device(engine)
        from_tensors = await engine.generate(context, GREEDY)
        await engine.update_weights(2, str(folder))
        on_device(engine)
        from_folder = await engine.generate(context, GREEDY)
    async with open_embedded_engine(folder, device="cuda") as engine:
        fresh = await engine.generate(context, GREEDY)
    updated = copy.deepcopy(reference_model)
    updated.load_state_dict(perturbed, strict=False)
    bound = 2 * LogprobError(updated, **CUDA_FP32)(context, fresh.token_ids)
    for result in (from_tensors, from_folder):  # two fp32 evaluations on the GPU
        assert result.token_ids == fresh.token_ids
        assert_within(result.logprobs, fresh.logprobs, bound)


def test_a_step_runs_on_a_device_other_than_the_cpu(tiny_dir: Path) -> None:
    """The model, the pool and a step on ``meta`` (shapes only, no numbers): a CPU tensor
    mixed into the forward (a mask, a table, a rope slice) raises, as it would on a GPU.
    Decode rows of different lengths (the mask), prefill chunks in one run of blocks and not."""
    model = CausalLM.from_folder(tiny_dir, device="meta")
    c = model.config
    pool = KVPool(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        num_blocks=64,
        block_size=4,
        device="meta",
    )
    rows = [
        Row(list(range(10, 40)), 29, 1, [5, 6, 7, 8, 9, 10, 11, 12], True),
        Row(list(range(10, 30)), 19, 1, [20, 22, 21, 23, 24], True),
        Row(list(range(10, 50)), 10, 25, [30, 31, 32, 33, 34, 35, 36, 37, 38, 39], True),
        Row(list(range(10, 25)), 0, 15, [40, 45, 41, 42], False),
    ]
    decode = AttentionKernelChooser("auto", pool.device, model.dtype)
    for pad, groups in ((PREFILL_PAD, 1), (0.0, 2)):  # the two prefill rows together, alone
        batch = build_forward_batch(rows, 4, pool.device, prefill_pad=pad)
        attention = batch.attention
        tensors = [batch.input_ids, batch.positions, batch.slots, batch.logits_rows]
        assert attention.decode_mask is not None and len(attention.prefill_groups) == groups
        assert {t.device.type for t in [*tensors, *attention.tensors()]} == {"meta"}
        logits = model.forward(batch, pool, decode)
        assert logits.shape == (3, c.vocab_size) and logits.device.type == "meta"
    pool.copy_block(1, 2)


def test_serve_on_a_port_in_use_says_to_pick_another(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert serve_main(["--model", str(tiny_dir), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"another process serves on port {port}: pass another --port, or 0" in err, err
