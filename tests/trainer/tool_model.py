"""A tiny model taught to call a tool: tiny-random fine-tuned (real gradient steps, no mocks)
until, after an environment's prompt, it samples one fixed tool call at temperature 1.

tiny-random never writes a tool call by chance, so a test that needs real tool calls in a
training run (a sandbox that really runs the model's code) starts from this model: the loop's
engine samples the call, the runtime parses it, the env's tool runs it in the sandbox.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import torch

MAX_STEPS = 500
TARGET_NLL = 1e-3
"""Mean negative log-likelihood per target token where teaching stops: a 35-token call is
then sampled whole at τ = 1 with probability ≈ exp(-35 · 1e-3) ≈ 0.97."""


async def _prompts(env_id: str, env_kwargs: dict, fmt, tasks: list) -> list[list[int]]:
    import agentrl
    from agentrl._tools import collect_tools

    env = agentrl.make(env_id, **env_kwargs)
    schemas = [b.spec.schema() for b in collect_tools(env).values()]
    out = []
    for task in tasks:
        messages = fmt.prepare(await env.reset(task), schemas)
        out.append(list(fmt.render_prompt(messages).token_ids))
    return out


def teach_tool_call(
    src: Path, dst: Path, env_id: str, call: str, env_kwargs: dict, tasks: list
) -> Path:
    """Copy the model folder ``src`` to ``dst`` and fine-tune it so that it answers the
    prompts of ``tasks`` (of ``env_id`` made with ``env_kwargs``) with the text ``call``;
    returns ``dst``. A 2-layer model learns the prompts it is taught, not the skill: teach it
    the tasks the run will draw."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.formats import get_format

    tokenizer = AutoTokenizer.from_pretrained(str(src))
    fmt = get_format("chatml-hermes", tokenizer)
    prompts = anyio.run(_prompts, env_id, env_kwargs, fmt, tasks)
    target = tokenizer.encode(call, add_special_tokens=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    nll = float("inf")
    for _ in range(MAX_STEPS):
        nll = _step(model, optimizer, prompts, target)
        if nll < TARGET_NLL:
            break
    assert nll < TARGET_NLL, f"the model did not learn the call (nll {nll:.2e})"
    shutil.copytree(src, dst)
    model.save_pretrained(str(dst), safe_serialization=True)
    (dst / "agentrl_model.json").unlink(missing_ok=True)  # not the registry's tiny-random
    return dst


def _step(model, optimizer, prompts: list[list[int]], target: list[int]) -> float:
    """One Adam step on every prompt + target; the loss covers only the target tokens (their
    logits alone are computed: the vocabulary is 49k wide)."""
    optimizer.zero_grad()
    total = torch.zeros(())
    for prompt in prompts:
        ids = torch.tensor([prompt + target])
        hidden = model.model(input_ids=ids).last_hidden_state[0]
        logits = model.lm_head(hidden[len(prompt) - 1 : -1])
        total = total + torch.nn.functional.cross_entropy(logits, torch.tensor(target))
    loss = total / len(prompts)
    loss.backward()
    optimizer.step()
    return loss.item()
