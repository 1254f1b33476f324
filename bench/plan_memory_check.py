"""``agentrl plan memory`` against a real learner: predicted vs measured peak memory.

Builds a random-initialised model from a real config (``bench/configs/``), runs the learner
(``trainer_bench.py step``: ``Learner.train_step``, DeepSpeed ZeRO-3, GRPO) in a fresh process
and compares its peak memory above the process's baseline (after imports, before the model is
loaded) with the plan's total for the same layout. On CPU the measure is the peak resident set
(``VmHWM``) and the layout fp32 (weights, gradients, AdamW moments and DeepSpeed's fp32
partitions); on a GPU ``torch.cuda.max_memory_allocated`` and bf16.

    .venv/bin/python bench/plan_memory_check.py --config bench/configs/smollm2-135m.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch  # noqa: F401  (the baseline includes the libraries the learner needs)
import deepspeed  # noqa: F401
import trainer_bench
from agentrl.trainer import Learner

def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

marks = {}
init, train_step = Learner.__init__, Learner.train_step

def traced_init(self, *a, **kw):
    init(self, *a, **kw)
    marks["after_init"] = rss("VmRSS")

def traced_step(self, *a, **kw):
    marks.setdefault("before_steps", rss("VmRSS"))
    out = train_step(self, *a, **kw)
    marks["after_steps"] = rss("VmRSS")
    return out

Learner.__init__, Learner.train_step = traced_init, traced_step
base = rss("VmRSS")
args = trainer_bench.main_parser().parse_args(sys.argv[2:])
result = trainer_bench.step(args)
print("RESULT " + json.dumps({"baseline": base, "peak": result["peak_memory_bytes"],
                              "params": result["params"], **marks}))
"""


def build_model(config: Path, dest: Path) -> None:
    code = (
        "import json, sys, torch\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "torch.manual_seed(0)\n"
        "cfg = AutoConfig.for_model(**json.load(open(sys.argv[1])))\n"
        "AutoModelForCausalLM.from_config(cfg).to(torch.float32).save_pretrained(sys.argv[2])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(config), str(dest)], check=True)


def measure(folder: Path, args: argparse.Namespace) -> dict:
    argv = ["step", "--model", str(folder), "--seqs", str(args.seqs)]
    argv += ["--seq-len", str(args.seq_len), "--prompt-len", str(args.prompt_len)]
    argv += ["--micro-batch-tokens", str(args.micro_batch_tokens), "--steps", str(args.steps)]
    argv += ["--group-size", str(args.group_size), "--kernels", "torch"]
    if args.gradient_checkpointing:
        argv.append("--gradient-checkpointing")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ROOT / "bench"), *argv],
        check=True,
        capture_output=True,
        text=True,
        # every allocation of 128 KiB or more is its own mapping, returned on free: the
        # resident set then follows live tensors instead of what malloc keeps cached
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "0"},
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def predict(folder: Path, args: argparse.Namespace) -> dict:
    from agentrl.plan import MemorySettings, load_shape, plan_memory

    tokens = min(args.micro_batch_tokens, args.seqs * args.seq_len)
    shape = load_shape(str(folder))
    settings = MemorySettings(
        # a CPU process's resident set holds only the written pages of DeepSpeed's reduce
        # bucket (allocated at 5e8 elements): at most one element per parameter
        reduce_bucket_size=min(500_000_000, shape.params),
        gpus=1,
        dtype="fp32",
        zero=3,
        optimizer_state=args.optimizer_state,
        micro_batch_tokens=tokens,
        checkpointing=args.gradient_checkpointing,
        logprob="chunked",  # --kernels torch: the CPU learner's path
        chunk_size=1024,
    )
    return plan_memory(shape, settings).to_json()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "bench/configs/smollm2-135m.json")
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--optimizer-state", default="fp32-master", choices=["fp32-master", "fp32"])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--tolerance", type=float, default=0.15, help="exit 1 beyond |ratio - 1|")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="agentrl-plan-check-") as tmp:
        folder = Path(tmp) / "model"
        build_model(args.config, folder)
        measured = measure(folder, args)
        plan = predict(folder, args)
    used = measured["peak"] - measured["baseline"]
    ratio = plan["total_bytes"] / used
    c = plan["components"]
    between = plan["model_states_bytes"] + c["reduce_bucket"]
    between_used = measured["after_steps"] - measured["baseline"]
    during = c["activations"] + c["logits"] + c["live_parameters"] + c["unreduced_gradients"]
    during_used = measured["peak"] - measured["after_steps"]
    print(f"between steps (model states, reduce bucket): predicted {between / 2**30:.2f} GiB, "
          f"measured {between_used / 2**30:.2f} GiB ({between / between_used:.3f}); during a "
          f"step (activations, logits, live parameters, unreduced gradients): predicted "
          f"{during / 2**30:.2f} GiB, "
          f"measured {during_used / 2**30:.2f} GiB ({during / during_used:.3f})")  # fmt: skip
    parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in c.items() if v)
    print(f"{args.config.name}: predicted {plan['total_bytes'] / 2**30:.2f} GiB ({parts}), "
          f"measured {used / 2**30:.2f} GiB above a {measured['baseline'] / 2**30:.2f} GiB "
          f"baseline: predicted/measured {ratio:.3f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"plan": plan, "measured": measured, "ratio": ratio}))
    return 0 if abs(ratio - 1) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
