"""A byte-level BPE tokenizer exactly as a GGUF file states it, built with ``tokenizers``.

transformers' own GGUF tokenizer conversion has changed from release to release, and for
SmolLM2's GGUF several releases disagree with the file: 4.56 and 5.17 make ``<|im_start|>`` the
end-of-sequence token and leave no pad token (the file says ``<|im_end|>`` for both), 4.56 also
adds a BOS to every encoding and a byte-fallback decoder, and 5.0 builds a CodeLlama tokenizer of
49157 tokens. The model folder must not depend on which transformers converted it, so the
tokenizer is built here from the file's vocabulary, merges, control tokens, special-token ids and
chat template, and handed to transformers' generic fast tokenizer class (``TokenizersBackend`` in
transformers 5, ``PreTrainedTokenizerFast`` in 4), which saves it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentrl._errors import ModelError

_CONTROL = 3
"""``tokenizer.ggml.token_type`` of a control token (``<|im_start|>``...): a special token."""


def _byte_alphabet() -> set[str]:
    """The characters GPT-2's byte-level BPE spells the 256 bytes with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [256 + n for n in range(256 - len(printable))]
    return {chr(c) for c in printable + shifted}


def _fields(path: Path) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF file, strings decoded, arrays as lists."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[-1]
        values = [
            bytes(field.parts[i]).decode("utf-8")
            if kind == GGUFValueType.STRING
            else field.parts[i].tolist()[0]
            for i in field.data
        ]
        out[name] = values if field.types[0] == GGUFValueType.ARRAY else values[0]
    return out


def byte_level_tokenizer_from_gguf(path: Path, *, model_max_length: int) -> Any:
    """The tokenizer a byte-level (``tokenizer.ggml.model == "gpt2"``) GGUF file describes.

    Text is split by GPT-2's byte-level rule and no special token is added on encoding (the chat
    template writes them). Raises ``ModelError`` for a file of another tokenizer kind.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    meta = _fields(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelError(f"{path.name}: tokenizer.ggml.model is {kind!r}, not a byte-level 'gpt2'")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    alphabet = _byte_alphabet()
    if misspelled := [t for t in tokens if not set(t) <= alphabet][:3]:
        raise ModelError(f"{path.name}: tokens outside the byte-level alphabet: {misspelled}")
    bpe = models.BPE(
        vocab={token: index for index, token in enumerate(tokens)},
        merges=[tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]],
        continuing_subword_prefix="",
        end_of_word_suffix="",
    )
    backend = Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A:0 $B:1")
    types = meta.get("tokenizer.ggml.token_type") or []
    backend.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, token_type in zip(tokens, types, strict=False)
            if token_type == _CONTROL
        ]
    )

    def special(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if isinstance(index, int) else None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=special("bos_token_id"),
        eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"),
        pad_token=special("padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
