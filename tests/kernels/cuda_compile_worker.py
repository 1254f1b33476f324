"""Compile every Triton kernel of ``agentrl.kernels`` ahead of time for a CUDA target — TTIR,
TTGIR, LLVM IR, PTX and a cubin through the ptxas that ships with Triton — without a GPU.

The CPU interpreter accepts things the GPU compiler refuses (non-constexpr globals, ``tl.dot``
shapes below 16, mixed dtypes in a ``tl.where``, ...), so this is what tells us, on a machine with
no GPU, that the kernels will build on one. Run in a process *without* ``TRITON_INTERPRET`` (the
kernels must be decorated as compiled functions)::

    python tests/kernels/cuda_compile_worker.py [--arch 90]

Prints one line per compiled variant and exits non-zero on the first failure. ``--report``
also runs Triton's bundled ptxas with ``-v`` on each PTX and prints registers and spill bytes
(how the GPU tiles of the log-prob kernel were chosen without a GPU).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: the kernels must be decorated for compilation")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from agentrl.kernels import _fused_ops_triton as fo  # noqa: E402
from agentrl.kernels import _logprob_triton as lp  # noqa: E402
from agentrl.kernels import _paged_attention_triton as pa  # noqa: E402
from agentrl.kernels import _policy_loss_triton as pl  # noqa: E402


def signature(fn, pointers: dict[str, str], floats: set[str], constexprs: dict) -> dict[str, str]:
    """Triton's signature for ``fn``: ``*dtype`` pointers, ``fp32`` floats, ``i32`` otherwise."""
    out = {}
    for name in fn.arg_names:
        if name in constexprs:
            out[name] = "constexpr"
        elif name in pointers:
            out[name] = "*" + pointers[name]
        else:
            out[name] = "fp32" if name in floats else "i32"
    return out


def variants():
    """(label, kernel, pointer dtypes, float scalars, constexprs, options)."""
    for dtype, dot_fp32, width in (("bf16", False, 2), ("fp16", False, 2), ("fp32", True, 4)):
        bt, bv, bh, warps = lp._CUDA_TILES[width]  # the tiles the GPU launches use
        ptrs = {"HIDDEN": dtype, "WEIGHT": dtype, "TARGETS": "i64"}
        ptrs |= {k: "fp32" for k in ("LOGPROB", "ENTROPY", "LSE")}
        blocks = {"BLOCK_T": bt, "BLOCK_V": bv, "BLOCK_H": bh, "DOT_FP32": dot_fp32}
        options = {"num_warps": warps}
        fwd = lp._fused_logprob_fwd_kernel
        yield f"logprob fwd {dtype}", fwd, ptrs, {"inv_temperature"}, blocks, options
        ptrs = {"HIDDEN": dtype, "WEIGHT": dtype, "TARGETS": "i64"}
        ptrs |= {k: "fp32" for k in ("LSE", "ENTROPY", "GRAD_LOGPROB", "GRAD_ENTROPY")}
        ptrs |= {"GRAD_HIDDEN": "fp32", "GRAD_WEIGHT": "fp32"}
        for need_h, need_w in ((True, True), (True, False), (False, True)):
            const = blocks | {"NEED_HIDDEN": need_h, "NEED_WEIGHT": need_w}
            label = f"logprob bwd {dtype} dh={need_h} dw={need_w}"
            yield label, lp._fused_logprob_bwd_kernel, ptrs, {"inv_temperature"}, const, options
    floats = {"clip_low", "clip_high", "max_log_ratio", "kl_coef", "entropy_coef", "tis_cap"}
    for dtype in ("fp32", "bf16"):
        ptrs = {k: dtype for k in ("LOGPROB", "OLD_LOGPROB", "ADVANTAGE", "REF_LOGPROB")}
        ptrs |= {k: dtype for k in ("ENTROPY", "ROLLOUT_LOGPROB")}
        ptrs |= {"KEEP": "i8", "WEIGHT": "fp32", "SEQ_LOG_RATIO": "fp32", "PARTIALS": "fp32"}
        ptrs |= {"GRAD_LOGPROB": "fp32", "GRAD_ENTROPY": "fp32"}
        for algo in pl.ALGOS.values():
            for kl in pl.KL_ESTIMATORS.values():
                const = {"ALGO": algo, "KL_ESTIMATOR": kl, "HAS_ENTROPY": kl % 2 == 0}
                const |= {"HAS_TIS": kl >= 2, "BLOCK": 1024, "STATS": pl.STATS_PAD}
                label = f"policy loss {dtype} algo={algo} kl={kl}"
                yield label, pl._fused_policy_loss_fwd_kernel, ptrs, floats, const, {}
    # (query heads per KV head, head_dim): SmolLM2-135M, Qwen2-0.5B, MHA, Llama-3-8B-like
    for group, dim in ((3, 64), (7, 64), (1, 96), (4, 128)):
        for dtype in ("bf16", "fp32"):
            block_group = triton.next_power_of_2(group)
            block_d = triton.next_power_of_2(dim)
            tile_n = max(16, min(64, pa._TILE_ELEMENTS // (block_group * block_d)))
            ptrs = {"Q": dtype, "K_CACHE": dtype, "V_CACHE": dtype, "OUT": dtype}
            ptrs |= {"BLOCK_TABLES": "i64", "SEQ_LENS": "i32"}
            ptrs |= {"PARTIAL_OUT": "fp32", "PARTIAL_LSE": "fp32"}
            const = {"GROUP": group, "BLOCK_GROUP": block_group, "HEAD_DIM": dim}
            const |= {"BLOCK_D": block_d, "KV_BLOCK_SIZE": 16, "TILE_N": tile_n}
            const |= {"PRECISE": dtype == "fp32"}  # fp32: libdevice exp2 and division
            options = {"num_warps": 4, **pa.COMPILE_OPTIONS}
            for splits in (1, 4):
                label = f"paged decode {dtype} group={group} dim={dim} splits={splits}"
                yield (label, pa._paged_decode_fwd_kernel, ptrs, {"qk_scale"},
                       const | {"NUM_SPLITS": splits}, options)  # fmt: skip
            ptrs = {"PARTIAL_OUT": "fp32", "PARTIAL_LSE": "fp32", "OUT": dtype}
            const = {"HEAD_DIM": dim, "BLOCK_D": block_d, "NUM_SPLITS": 4, "BLOCK_SPLITS": 4}
            const |= {"PRECISE": dtype == "fp32"}
            label = f"paged decode merge {dtype} dim={dim}"
            options = {"num_warps": 4, **pa.COMPILE_OPTIONS}
            yield label, pa._paged_decode_reduce_kernel, ptrs, set(), const, options
            for max_query_len in (1, 16, 512):
                block_m, tile_n, warps = pa.prefill_tiles(
                    group, dim, max_query_len, dtype == "fp32"
                )
                ptrs = {"Q": dtype, "K_CACHE": dtype, "V_CACHE": dtype, "OUT": dtype}
                ptrs |= {"BLOCK_TABLES": "i64", "SEQ_LENS": "i32", "QUERY_STARTS": "i32"}
                const = {"GROUP": group, "HEAD_DIM": dim, "BLOCK_D": max(16, block_d)}
                const |= {"KV_BLOCK_SIZE": 16, "BLOCK_M": block_m, "TILE_N": tile_n}
                const |= {"PRECISE": dtype == "fp32"}
                const |= {"DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32"}
                label = f"paged prefill {dtype} group={group} dim={dim} block_m={block_m}"
                options = {"num_warps": warps, **pa.COMPILE_OPTIONS}
                yield label, pa._paged_prefill_kernel, ptrs, {"qk_scale"}, const, options


def fused_op_variants():
    """The engine's fused elementwise kernels with the blocks and warps their launchers pick:
    rows of 64-256 (1 warp), 576-1024 (SmolLM2-135M, Qwen2.5-0.5B: 4) and 8192 (8) elements;
    rotary over 16 heads of 64 (512 elements) and 128 of 128 (8192)."""
    for dtype in ("bf16", "fp32"):
        for block in (256, 1024, 8192):
            options = {"num_warps": fo.warps(block), **fo.COMPILE_OPTIONS}
            for has_delta in (True, False):
                ptrs = {k: dtype for k in ("X", "DELTA", "WEIGHT", "OUT_SUM", "OUT")}
                const = {"HAS_DELTA": has_delta, "BLOCK": block}
                label = f"rms_norm {dtype} block={block} delta={has_delta}"
                yield label, fo._rms_norm_kernel, ptrs, {"eps"}, const, options
        for heads, half in ((16, 32), (128, 64)):
            options = {"num_warps": fo.warps(heads * half), **fo.COMPILE_OPTIONS}
            ptrs = {"X": dtype, "POSITIONS": "i64", "COS": dtype, "SIN": dtype, "OUT": dtype}
            const = {"HALF": half, "BLOCK_HEADS": heads, "BLOCK_HALF": half}
            label = f"rotary {dtype} heads<={heads} half={half}"
            yield label, fo._rotary_kernel, ptrs, set(), const, options
        for block in (256, fo.SILU_BLOCK):
            options = {"num_warps": fo.warps(block), **fo.COMPILE_OPTIONS}
            ptrs = {"GATE_UP": dtype, "OUT": dtype}
            label = f"silu_mul {dtype} block={block}"
            yield label, fo._silu_mul_kernel, ptrs, set(), {"BLOCK": block}, options


def ptxas_report(ptx: str, arch: int) -> str:
    """``registers=N spill=B`` from ``ptxas -v`` (Triton's bundled ptxas that accepts its PTX)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        for name in ("ptxas-blackwell", "ptxas"):
            if not (bin_dir / name).exists():
                continue
            cmd = [str(bin_dir / name), f"-arch=sm_{arch}a", "-v", str(src), "-o", f"{tmp}/k.o"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0:
                regs = re.search(r"Used (\d+) registers", proc.stderr)
                spill = re.search(r"(\d+) bytes spill stores", proc.stderr)
                regs_n = regs.group(1) if regs else "?"
                return f"registers={regs_n} spill={spill.group(1) if spill else '?'}B"
    return "ptxas report unavailable"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: H100)")
    parser.add_argument("--report", action="store_true", help="registers and spills (ptxas -v)")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    count = 0
    for label, fn, ptrs, floats, const, options in [*variants(), *fused_op_variants()]:
        start = time.perf_counter()
        src = ASTSource(fn=fn, signature=signature(fn, ptrs, floats, const), constexprs=const)
        try:
            compiled = triton.compile(src, target=target, options=options)
        except Exception as exc:
            print(f"FAILED {label}: {type(exc).__name__}: {exc}", flush=True)
            raise SystemExit(1) from exc
        assert compiled.asm.get("cubin"), f"{label}: no cubin"
        # an fp32 "ieee" tl.dot is itself a chain of FMAs (its accumulation, not a contraction)
        ieee_dot = const.get("DOT_PRECISION") == "ieee"
        fused = "fma.rn.f32" in compiled.asm["ptx"]
        if options.get("enable_fp_fusion") is False and fused and not ieee_dot:
            print(f"FAILED {label}: fp fusion is off yet the PTX has fma.rn.f32", flush=True)
            raise SystemExit(1)
        count += 1
        report = f" {ptxas_report(compiled.asm['ptx'], args.arch)}" if args.report else ""
        print(
            f"ok {label} ({time.perf_counter() - start:.2f} s, sm_{args.arch}){report}", flush=True
        )
    print(f"compiled {count} kernel variants for sm_{args.arch}")


if __name__ == "__main__":
    main()
