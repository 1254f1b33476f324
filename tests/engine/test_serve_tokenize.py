"""``agentrl serve``'s ``/tokenize`` and ``/detokenize`` (and ``/v1/``) against the served
tokenizer: SGLang's fields and shapes, round trips, and bad input as 400s naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_helpers import serving
from transformers import AutoTokenizer

TEXT = "Hello SGLang world! 123 😊, ñ"


@pytest.fixture(scope="module")
def url(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving(tiny_dir, tmp_path_factory.mktemp("serve") / "serve.log") as base:
        yield base


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_dir))


def post(url: str, path: str, status: int = 200, **body: Any) -> Any:
    response = httpx.post(url + path, json=body, timeout=60)
    assert response.status_code == status, response.text
    return response.json()


@pytest.mark.parametrize("prefix", ["", "/v1"])
@pytest.mark.parametrize("special", [True, False])
def test_tokenize_and_detokenize_round_trip(url, tokenizer, prefix, special):
    out = post(url, prefix + "/tokenize", model="m", prompt=TEXT, add_special_tokens=special)
    assert out["tokens"] == tokenizer.encode(TEXT, add_special_tokens=special)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
    text = post(url, prefix + "/detokenize", tokens=out["tokens"], skip_special_tokens=True)
    assert text["text"] == tokenizer.decode(out["tokens"], skip_special_tokens=True)


def test_lists_empty_prompts_and_messages(url, tokenizer):
    out = post(url, "/tokenize", prompt=[TEXT, "", "b"])
    assert out["tokens"] == [tokenizer.encode(p) for p in (TEXT, "", "b")]
    assert out["count"] == [len(t) for t in out["tokens"]]
    assert post(url, "/detokenize", tokens=out["tokens"])["text"] == [
        tokenizer.decode(t, skip_special_tokens=True) for t in out["tokens"]
    ]
    assert post(url, "/tokenize", prompt="")["tokens"] == tokenizer.encode("")
    assert post(url, "/detokenize", tokens=[])["text"] == ""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    chat = post(url, "/tokenize", messages=messages)["tokens"]
    expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert chat == list(expected["input_ids"] if hasattr(expected, "keys") else expected)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/tokenize", {"prompt": 12345}, "prompt"),
        ("/tokenize", {"model": "m"}, "prompt"),
        ("/detokenize", {"tokens": ["a", "b"]}, "tokens"),
        ("/detokenize", {"tokens": [1, -1, 2]}, "tokens"),
        ("/detokenize", {"tokens": [[1], [10**9]]}, "tokens"),
        ("/detokenize", {"tokens": [1, [2]]}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(url, path, body, field):
    error = post(url, path, 400, **body)
    assert (error["error"].get("field") or "").startswith(field), error


def test_chat_with_tools_renders_as_the_template_does(url, tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [
        {
            "type": "function",
            "function": {"name": "weather", "description": "Look it up.", "parameters": city},
        }
    ]
    chat = post(url, "/tokenize", messages=messages, tools=tools)["tokens"]
    expected = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=True
    )
    assert chat == list(expected["input_ids"] if hasattr(expected, "keys") else expected)


@pytest.mark.parametrize("where", ["role", "name", "tools"])
def test_every_field_the_template_renders_counts_against_the_text_cap(url, where):
    """Only ``content`` was measured: 3M characters in ``role`` took seconds of tokenizer time
    and gigabytes for a 1.5M-token answer no context can hold."""
    huge = "x" * 400_000  # over the tiny model's cap (its 2,048-token context)
    message: dict[str, Any] = {"role": "user", "content": "hi"}
    body: dict[str, Any] = {"messages": [message]}
    if where == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f", "description": huge}}]
    else:
        message[where] = huge
    error = post(url, "/tokenize", 400, **body)
    assert error["error"]["field"] == "messages and tools", error
    assert "exceed the maximum allowed length of text" in error["error"]["message"]
