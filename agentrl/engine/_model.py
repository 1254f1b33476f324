"""Our own Llama / Qwen2-family forward pass over the paged KV pool (fp32 on CPU by default; any
dtype on one CUDA device with ``device=``: weights and rope tables live there).

Covers what these families share: token embeddings, pre-norm decoder layers with RMSNorm,
rotary position embeddings (RoPE, ``rotate_half`` layout) with the scaling rules listed in
``rope_frequencies``, grouped-query attention, a SwiGLU MLP, a final RMSNorm and an LM head that
may be tied to the embeddings. Qwen2 adds biases on the q/k/v projections; Llama's
``attention_bias`` / ``mlp_bias`` flags add them on every projection of the block.

Weights load from Hugging Face names (``model.layers.{i}.self_attn.q_proj.weight`` ...), are
checked by name and shape before anything is replaced, and are stored fused: q, k and v as one
matrix of ``(heads + 2 * kv_heads) * head_dim`` outputs, gate and up as one of
``2 * intermediate`` outputs, so a layer runs four GEMMs over all tokens of a step. On the CPU the
matrices keep HF's ``[out, in]`` layout and a tied LM head is the embedding matrix itself; on a
GPU they are stored transposed (``[in, out]``) and a tied head is a transposed copy
(``CausalLM.project`` multiplies in either layout).

A step's tokens from every sequence (decode rows and prefill chunks alike) are packed into one
``[tokens, hidden]`` matrix: the GEMMs see one batch, only attention is per sequence (``_kv``).
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from agentrl._errors import EngineError
from agentrl.kernels import _fused_ops as fused

from ._decode import AttentionKernelChooser
from ._kv import AttentionBatch, KVPool, paged_attention
from ._weight_values import check_weight_values

_FAMILIES = ("llama", "qwen2", "mistral")
SKINNY_ROWS = 64
"""On the CPU, the most rows a step may have to project as ``(weight @ x.T).T``."""


def _rows_out(device: torch.device) -> bool:
    """Whether a model on ``device`` keeps its projections ``[out, in]`` (``CausalLM.project``)."""
    return device.type == "cpu"


@dataclass(frozen=True)
class ModelConfig:
    """The architecture numbers of one model (read from an HF ``config.json``)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_theta: float
    rope: dict[str, Any] = field(default_factory=dict)
    """The rope parameters (``rope_type`` plus its factors), already normalized."""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse an HF config dict; ``EngineError`` for an unsupported architecture."""
        model_type = raw.get("model_type", "")
        if model_type not in _FAMILIES:
            raise EngineError(f"unsupported model_type {model_type!r} (supported: {_FAMILIES})")
        if model_type == "mistral" and raw.get("sliding_window") is not None:
            raise EngineError("sliding-window attention is not supported")
        if raw.get("use_sliding_window"):
            raise EngineError("sliding-window attention is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise EngineError(f"unsupported hidden_act {raw.get('hidden_act')!r}")
        heads = int(raw["num_attention_heads"])
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        if float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1:
            raise EngineError("partial rotary embeddings are not supported")
        bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bias,
            o_bias=bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            rope_theta=theta,
            rope=rope,
        )

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> ModelConfig:
        return cls.from_dict(json.loads(_regular(Path(folder) / "config.json").read_text()))

    @property
    def max_context(self) -> int:
        """Positions this engine serves: ``max_position_embeddings`` (for dynamic NTK rope, the
        pre-scaling length, where dynamic rope equals the default)."""
        if self.rope["rope_type"] == "dynamic":
            original = self.rope.get("original_max_position_embeddings")
            return int(original or self.max_position_embeddings)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """KV cache bytes one token costs: layers x (k, v) x kv_heads x head_dim x element size
        (SmolLM2-135M in fp32: 30 x 2 x 3 x 64 x 4 = 46,080)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` (float32) and the cos/sin scale, following the HF
    rules for rope types ``default``, ``linear`` (positions divided by ``factor``), ``llama3``
    (wavelength-dependent interpolation) and ``dynamic`` (NTK scaling: equal to ``default`` up to
    the original length, the only range served, see ``ModelConfig.max_context``)."""
    rope, dim = config.rope, config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    kind = rope["rope_type"]
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(rope["factor"]), 1.0
    if kind == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old = float(rope.get("original_max_position_embeddings", config.max_position_embeddings))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled), 1.0
    raise EngineError(f"unsupported rope_type {kind!r} (default, linear, llama3, dynamic)")


class ForwardBatch(NamedTuple):
    """One step's packed tokens (``T`` of them, from ``B`` sequences).

    ``input_ids``/``positions``/``slots``: ``[T]`` int64; ``slots[t]`` is the flat KV slot
    (``block * block_size + offset``) token ``t`` writes. ``attention`` describes the sequences.
    ``logits_rows``: ``[R]`` int64, the token rows whose next-token logits are wanted. Every
    tensor is on the model's device.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    attention: AttentionBatch
    logits_rows: torch.Tensor


@dataclass
class _Layer:
    """One decoder layer's weights (model dtype): fused ``qkv`` (``(H + 2K) * D`` outputs),
    ``o``, fused ``gate_up`` (``2 * I`` outputs), ``down``; norms ``[hidden]``; biases ``None``
    when the architecture has none. Projections are ``[out, in]`` as HF stores them on the CPU
    and ``[in, out]`` (transposed) on a GPU: see ``CausalLM.project``."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class CausalLM:
    """Weights plus the packed forward pass. Not an ``nn.Module``: no autograd, no hooks.

    Weights, rope tables and every tensor ``forward`` makes are on ``device`` (a state dict on
    any device is copied there); the rope tables are computed on the CPU in float32 first, so
    they are the same numbers on every device."""

    def __init__(
        self,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.rows_out = _rows_out(self.device)
        """Projection weights (and the LM head) are ``[out, in]``, HF's layout (on the CPU),
        else ``[in, out]``; ``project`` multiplies either way."""
        self.fused_ops = False
        """Run RMSNorm (with its residual add), rotary embedding and SiLU·mul as the fused
        Triton kernels of ``agentrl.kernels`` (``EngineOptions.fused_ops``; the engine sets it)."""
        self.layers: list[_Layer] = []
        self.load_state_dict(state)
        inv_freq, scale = rope_frequencies(config)
        positions = torch.arange(config.max_context, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * scale).to(dtype).to(self.device)  # [max_context, head_dim]
        self.sin = (emb.sin() * scale).to(dtype).to(self.device)

    @classmethod
    def from_folder(
        cls,
        folder: str | os.PathLike[str],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> CausalLM:
        """Load ``config.json`` and every ``*.safetensors`` of an HF folder (read on the CPU,
        then copied to ``device``)."""
        config = ModelConfig.from_folder(folder)
        return cls(config, read_safetensors(folder), dtype, device)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape, for every tensor a full state dict holds."""
        c = self.config
        hidden, inter = c.hidden_size, c.intermediate_size
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (c.vocab_size, hidden),
            "model.norm.weight": (hidden,),
            "lm_head.weight": (c.vocab_size, hidden),
        }
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            shapes.update(
                {
                    p + "input_layernorm.weight": (hidden,),
                    p + "post_attention_layernorm.weight": (hidden,),
                    p + "self_attn.q_proj.weight": (q, hidden),
                    p + "self_attn.k_proj.weight": (kv, hidden),
                    p + "self_attn.v_proj.weight": (kv, hidden),
                    p + "self_attn.o_proj.weight": (hidden, q),
                    p + "mlp.gate_proj.weight": (inter, hidden),
                    p + "mlp.up_proj.weight": (inter, hidden),
                    p + "mlp.down_proj.weight": (hidden, inter),
                }
            )
            if c.qkv_bias:
                for name, size in (("q", q), ("k", kv), ("v", kv)):
                    shapes[f"{p}self_attn.{name}_proj.bias"] = (size,)
            if c.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (hidden,)
            if c.mlp_bias:
                for name, size in (("gate", inter), ("up", inter), ("down", hidden)):
                    shapes[f"{p}mlp.{name}_proj.bias"] = (size,)
        return shapes

    def check_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Raise ``EngineError`` when ``state`` is not a full HF state dict of this model: an
        unknown name, a wrong shape or a missing tensor (a tied ``lm_head.weight`` may be
        omitted; old checkpoints' ``rotary_emb.inv_freq`` buffers are ignored), or a tensor
        whose values cannot be this model's weights (``check_weight_values``: not floating
        point, NaN/Inf, beyond the model dtype's range)."""
        want = self.expected_shapes()
        names = {k for k in state if not k.endswith("rotary_emb.inv_freq")}
        unexpected = sorted(names - set(want))
        if unexpected:
            raise EngineError(f"weight update has unknown tensors: {unexpected[:5]}")
        for name in names:
            if tuple(state[name].shape) != want[name]:
                raise EngineError(
                    f"weight update: {name} has shape {tuple(state[name].shape)}, "
                    f"model expects {want[name]}"
                )
        optional = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        missing = sorted(set(want) - names - optional)
        if missing:
            raise EngineError(f"weight update lacks tensors: {missing[:5]}")
        check_weight_values(state, sorted(names), self.dtype)

    def load_state_dict(self, state: dict[str, torch.Tensor], *, check: bool = True) -> None:
        """Replace every weight from an HF-named state dict (values are copied to the model's
        device and cast; the source may be on any device).

        Checks first (``check_state_dict``; ``check=False`` when the caller just did): on
        ``EngineError`` nothing has changed. The new weights are built before the old ones are
        replaced: the device briefly holds both. A model that has weights keeps its tensors and
        copies the new values into them, so whatever holds their addresses (captured CUDA
        graphs, ``_graphs``) runs on the new weights.
        """
        if check:
            self.check_state_dict(state)
        device, dtype = self.device, self.dtype

        def get(name: str) -> torch.Tensor:
            return state[name].detach().to(device=device, dtype=dtype).contiguous().clone()

        def cat(*names: str) -> torch.Tensor:
            parts = [state[n].detach().to(device=device, dtype=dtype) for n in names]
            return torch.cat(parts).contiguous()

        def laid_out(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> this device's layout
            return weight if self.rows_out else weight.t().contiguous()

        c = self.config
        layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            attn = [f"{p}self_attn.{n}_proj" for n in "qkv"]
            mlp = [f"{p}mlp.{n}_proj" for n in ("gate", "up")]
            layers.append(
                _Layer(
                    input_norm=get(p + "input_layernorm.weight"),
                    qkv=laid_out(cat(*(n + ".weight" for n in attn))),
                    qkv_bias=cat(*(n + ".bias" for n in attn)) if c.qkv_bias else None,
                    o=laid_out(get(p + "self_attn.o_proj.weight")),
                    o_bias=get(p + "self_attn.o_proj.bias") if c.o_bias else None,
                    post_norm=get(p + "post_attention_layernorm.weight"),
                    gate_up=laid_out(cat(*(n + ".weight" for n in mlp))),
                    gate_up_bias=cat(*(n + ".bias" for n in mlp)) if c.mlp_bias else None,
                    down=laid_out(get(p + "mlp.down_proj.weight")),
                    down_bias=get(p + "mlp.down_proj.bias") if c.mlp_bias else None,
                )
            )
        embed = get("model.embed_tokens.weight")
        head = state.get("lm_head.weight") if not c.tie_word_embeddings else None
        # tied on the CPU: the head is the embedding itself, as in HF (one copy in memory)
        lm_head = laid_out(embed if head is None else get("lm_head.weight"))
        norm = get("model.norm.weight")
        if not self.layers:
            self.embed, self.lm_head, self.norm, self.layers = embed, lm_head, norm, layers
            return
        pairs = [(self.embed, embed), (self.lm_head, lm_head), (self.norm, norm)]
        for old, new in zip(self.layers, layers, strict=True):
            for name in _Layer.__dataclass_fields__:
                target, value = getattr(old, name), getattr(new, name)
                if target is not None:
                    pairs.append((target, value))
        for target, value in pairs:
            target.copy_(value)

    def project(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [T, in]`` times a projection weight (``+ bias``): ``[T, out]``, contiguous.

        On a GPU the weight is ``[in, out]``: ``x @ weight``. On the CPU it is ``[out, in]``,
        and a step of up to ``SKINNY_ROWS`` rows (a decode step) is computed as
        ``(weight @ x.T).T``: MKL streams a tall weight against a few columns close to memory
        bandwidth, where ``x @ weight.T`` with few rows ran 2-4x slower (bench/projection_bench.py;
        a single row runs as two, which beats the matrix-vector kernels there). Longer steps
        (prefill) take ``F.linear``."""
        if not self.rows_out:
            return torch.matmul(x, weight) if bias is None else torch.addmm(bias, x, weight)
        rows = x.shape[0]
        if rows > SKINNY_ROWS:
            return F.linear(x, weight, bias)
        cols = torch.cat([x, x]) if rows == 1 else x  # one row runs as two: the same kernel
        if bias is None:
            out = torch.mm(weight, cols.t())
        else:
            out = torch.addmm(bias.unsqueeze(1), weight, cols.t())
        return out[:, :rows].t().contiguous()

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + self.config.rms_norm_eps))

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv: KVPool,
        attention: AttentionKernelChooser | str | None = None,
    ) -> torch.Tensor:
        """Run one step: write the step's K/V into ``kv`` and return float32 logits ``[R, vocab]``
        for ``batch.logits_rows`` (on the model's device; ``batch`` and ``kv`` must be there
        too). ``attention`` picks the attention kernels: a chooser (decode rows and prefill
        chunks), a kernel name for the decode rows (``"sdpa"`` or ``"triton"``; prefill chunks
        then run SDPA) or ``None`` (SDPA)."""
        if self.fused_ops:
            return self._forward_fused(batch, kv, attention)
        c = self.config
        heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim
        tokens = batch.input_ids.shape[0]
        x = self.embed.index_select(0, batch.input_ids)  # [T, hidden]
        cos = self.cos.index_select(0, batch.positions).unsqueeze(1)  # [T, 1, D]
        sin = self.sin.index_select(0, batch.positions).unsqueeze(1)
        split = [(heads + kv_heads) * dim, kv_heads * dim]
        for index, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.input_norm)
            qk, v = self.project(h, layer.qkv, layer.qkv_bias).split(split, dim=-1)
            # q and k rotate together: one set of elementwise kernels per layer, not two
            qk = _rotate(qk.view(tokens, heads + kv_heads, dim), cos, sin)
            o = self._attend(index, qk, v, batch, kv, attention)
            x = x + self.project(o, layer.o, layer.o_bias)
            h = self._rms_norm(x, layer.post_norm)
            gate, up = self.project(h, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            x = x + self.project(F.silu(gate) * up, layer.down, layer.down_bias)
        x = self._rms_norm(x.index_select(0, batch.logits_rows), self.norm)
        return self.project(x, self.lm_head, None).float()

    def _forward_fused(
        self, batch: ForwardBatch, kv: KVPool, attention: AttentionKernelChooser | str | None
    ) -> torch.Tensor:
        """``forward`` with the fused kernels: each residual add rides in the next RMSNorm's
        kernel, rotary embedding looks up its cos/sin rows itself, SiLU·mul is one kernel."""
        c = self.config
        heads, kv_heads, dim, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        tokens = batch.input_ids.shape[0]
        split = [(heads + kv_heads) * dim, kv_heads * dim]
        x = self.embed.index_select(0, batch.input_ids)  # [T, hidden]
        layers = self.layers
        _, h = fused.rms_norm(x, layers[0].input_norm, eps) if layers else (None, x)
        for index, layer in enumerate(layers):
            qk, v = self.project(h, layer.qkv, layer.qkv_bias).split(split, dim=-1)
            qk = fused.rotary(
                qk.view(tokens, heads + kv_heads, dim), batch.positions, self.cos, self.sin
            )
            o = self._attend(index, qk, v, batch, kv, attention)
            x, h = fused.rms_norm(x, layer.post_norm, eps, self.project(o, layer.o, layer.o_bias))
            act = fused.silu_mul(self.project(h, layer.gate_up, layer.gate_up_bias))
            down = self.project(act, layer.down, layer.down_bias)
            if index + 1 < len(layers):
                x, h = fused.rms_norm(x, layers[index + 1].input_norm, eps, down)
            else:
                x = x + down
        _, x = fused.rms_norm(x.index_select(0, batch.logits_rows), self.norm, eps)
        return self.project(x, self.lm_head, None).float()

    def _attend(
        self,
        index: int,
        qk: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        kv: KVPool,
        attention: AttentionKernelChooser | str | None,
    ) -> torch.Tensor:
        """Layer ``index``'s attention: write the step's rotated K and V into ``kv``, attend
        the rotated queries (``qk [T, heads + kv_heads, D]``, queries first); ``[T, H * D]``."""
        c = self.config
        heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim
        tokens = qk.shape[0]
        q, k = qk[:, :heads], qk[:, heads:]
        kv.write(index, batch.slots, k, v.view(tokens, kv_heads, dim))
        k_cache, v_cache = kv.layer(index)
        scale = 1.0 / math.sqrt(dim)
        attn = batch.attention
        if attention is None or isinstance(attention, str):
            kernel, prefill = attention or "sdpa", "sdpa"
        else:
            kernel = attention.choose(q, k_cache, v_cache, attn, scale)
            prefill = attention.choose_prefill(q, k_cache, v_cache, attn, scale)
        o = paged_attention(  # [T, H, D]
            q, k_cache, v_cache, attn, scale, decode_kernel=kernel, prefill_kernel=prefill
        )
        return o.reshape(tokens, heads * dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the ``rotate_half`` layout: ``x [T, heads, D]``, ``cos``/``sin`` ``[T, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _regular(file: Path) -> Path:
    """``file`` if it is a regular file (after symlinks); otherwise ``EngineError`` before it
    is opened: opening a FIFO blocks until a writer comes, a device may never end."""
    try:
        mode = file.stat().st_mode
    except OSError as exc:
        raise EngineError(f"cannot read {file}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(mode):
        raise EngineError(f"cannot read {file}: not a regular file")
    return file


def read_safetensors(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``folder`` (``EngineError`` if none)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors in {folder}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        _regular(file)  # safetensors opens it holding the GIL: a FIFO would stop every thread
        try:
            tensors = load_file(file)
        except Exception as exc:  # safetensors' own error, OSError, a header that is not JSON
            raise EngineError(f"cannot read {file}: {exc}") from exc
        clash = sorted(state.keys() & tensors.keys())
        if clash:
            raise EngineError(f"{file} repeats tensors of another file in {folder}: {clash[:5]}")
        state.update(tensors)
    return state
