"""The SmolLM2 tokenizer is built from what its GGUF states, not by transformers' GGUF conversion
(which misreads that file in some releases): checked on small GGUF files written here."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agentrl._errors import ModelError
from agentrl._gguf_tokenizer import byte_level_tokenizer_from_gguf
from agentrl._models import load_tokenizer, tokenizer_fingerprint

gguf = pytest.importorskip("gguf")

# SmolLM2's layout in miniature: control tokens first, then a byte-level vocabulary ("Ġ" is the
# space byte, "Ċ" the newline) and its merges.
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "Ġ", "ab", "Ġab", "Ċ"]
TYPES = [3, 3, 3, 1, 1, 1, 1, 1, 1]
MERGES = ["a b", "Ġ ab"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_gguf(path: Path, *, model: str = "gpt2", tokens: list[str] = TOKENS) -> Path:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(TYPES[: len(tokens)])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tokenizer(tmp_path: Path):  # noqa: ANN202
    return byte_level_tokenizer_from_gguf(_write_gguf(tmp_path / "t.gguf"), model_max_length=64)


def test_the_tokenizer_is_what_the_file_states(tmp_path: Path) -> None:
    tokenizer = _tokenizer(tmp_path)
    specials = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token)
    assert specials == ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 2)
    assert len(tokenizer) == len(TOKENS) and tokenizer.model_max_length == 64
    text = "ab ab<|im_end|>\n"
    ids = tokenizer(text)["input_ids"]
    assert ids == [6, 7, 2, 8]  # merged, the control token whole, no BOS or EOS added
    assert tokenizer.decode(ids) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "a", "content": "b"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>a\nb<|im_end|>\n<|im_start|>assistant\n"


def test_the_saved_folder_loads_back_as_the_same_tokenizer(tmp_path: Path) -> None:
    tokenizer = _tokenizer(tmp_path)
    tokenizer.save_pretrained(tmp_path / "folder")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "folder")
    assert type(loaded) is type(load_tokenizer(tmp_path / "folder")) is type(tokenizer)
    assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(tokenizer)
    assert loaded("ab ab<|im_end|>")["input_ids"] == [6, 7, 2]
    assert loaded.model_max_length == 64


def test_other_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not a byte-level"):
        byte_level_tokenizer_from_gguf(
            _write_gguf(tmp_path / "spm.gguf", model="llama"), model_max_length=64
        )
    with pytest.raises(ModelError, match="outside the byte-level alphabet"):
        byte_level_tokenizer_from_gguf(
            _write_gguf(tmp_path / "spaces.gguf", tokens=[*TOKENS[:-1], " a"]), model_max_length=64
        )
