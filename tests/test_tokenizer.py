"""Tokenizer: the shipped SmolLM2 GGUF tokenizer and tiny HF folder tokenizers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.tiny_models import make_tiny_gguf, make_tiny_model

import pdserve.model.tokenizer as tokenizer_module
from pdserve.errors import InvalidRequestError, ModelLoadError
from pdserve.model.source import resolve_model
from pdserve.model.tokenizer import CACHE_ENV, Tokenizer, _load_backend, tokenizer_cache_dir

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def shipped() -> Tokenizer:
    return Tokenizer.from_model_path(None)


@pytest.mark.slow
def test_shipped_chat_template_adds_smollm2_system_prompt(shipped: Tokenizer) -> None:
    assert shipped.has_chat_template
    assert shipped.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = shipped.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert no_prompt.endswith("<|im_start|>user\nHi<|im_end|>\n")


@pytest.mark.slow
def test_shipped_encode_decode(shipped: Tokenizer) -> None:
    assert shipped.encode("Hello world") == [19556, 905]  # no BOS: add_bos_token is false
    text = "Prefill, then decode: héllo wörld 123!"
    assert shipped.decode(shipped.encode(text)) == text
    ids = shipped.encode("<|im_start|>user")
    assert ids[0] == 1
    assert shipped.decode(ids) == "user"
    assert shipped.decode(ids, skip_special_tokens=False) == "<|im_start|>user"


@pytest.mark.slow
def test_shipped_special_ids(shipped: Tokenizer) -> None:
    assert (shipped.eos_token_id, shipped.bos_token_id) == (2, 1)
    assert shipped.stop_token_ids == (2,)
    assert shipped.vocab_size == 49152


def test_tiny_folder_tokenizer(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "Qwen2ForCausalLM")
    tok = Tokenizer.from_model_path(folder)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 384)
    text = "The quick brown fox, 日本"
    assert tok.decode(tok.encode(text)) == text
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_stop_ids_include_generation_config_eos(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    file = folder / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "eos_token_id": [0, 2]}))
    assert Tokenizer.from_model_path(folder).stop_token_ids == (2, 0)


def test_chat_template_in_tokenizer_config(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "MistralForCausalLM")
    template_file = folder / "chat_template.jinja"
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = "{{ messages[0]['content'] | upper }}"
    config_file.write_text(json.dumps(config))
    template_file.unlink()
    tok = Tokenizer.from_model_path(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "HI"


def test_no_chat_template(tmp_path: Path) -> None:
    tok = Tokenizer.from_model_path(
        make_tiny_model(tmp_path, "LlamaForCausalLM", chat_template=False)
    )
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequestError) as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert info.value.message == "this model has no chat template; send a plain prompt instead"
    assert info.value.param == "messages"


def test_template_error_is_invalid_request(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    tok = Tokenizer.from_model_path(folder)
    with pytest.raises(InvalidRequestError) as info:
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])
    assert (info.value.message, info.value.param) == ("chat template error: user first", "messages")


def test_tiny_gguf_tokenizer_matches_folder(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path)
    from_gguf = Tokenizer.from_model_path(path)
    from_folder = Tokenizer.from_model_path(path.with_suffix(""))
    text = "Hello world! Paged attention, décodé."
    assert from_gguf.encode(text) == from_folder.encode(text)
    assert from_gguf.stop_token_ids == from_folder.stop_token_ids == (2,)
    messages = [{"role": "user", "content": "hi"}]
    assert from_gguf.apply_chat_template(messages) == from_folder.apply_chat_template(messages)


def test_folder_without_tokenizer_files(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink()
    with pytest.raises(ModelLoadError) as info:
        Tokenizer.from_model_path(folder)
    assert str(info.value).startswith(f"{folder}: cannot load the tokenizer (")


TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "Prefill, then decode: héllo wörld 123! 日本語 🚀",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "line one\n\n\tline two . , ; don't can't",
]


@pytest.mark.slow
@pytest.mark.parametrize("special", [True, False])
def test_direct_rust_path_equals_transformers(shipped: Tokenizer, special: bool) -> None:
    """encode/decode call the Rust tokenizer directly; transformers' wrappers agree."""
    hf = shipped.backend
    for text in TEXTS:
        ids = shipped.encode(text, add_special_tokens=special)
        assert ids == hf.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert shipped.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


# The tokenizer cache (pdserve/model/tokenizer.py): a GGUF's converted tokenizer is saved
# once and every later process loads the saved folder. tests/conftest.py points the whole
# suite at a fresh cache; these tests each take their own.


def _fresh(path: Path) -> Tokenizer:
    """`path`'s tokenizer as a new process would get it (the in-process memo cleared)."""
    _load_backend.cache_clear()
    return Tokenizer.from_model_path(path)


class _Loads:
    """Every load the tokenizer module makes, as (folder, converted from a GGUF?): its
    conversions (`_convert`) and its loads of cache entries (`_load_entry`), passed on:
    what shows a load came from the cache and not from a conversion."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, bool]] = []
        convert, load_entry = tokenizer_module._convert, tokenizer_module._load_entry

        def converting(path: Path) -> Any:
            self.calls.append((str(path.parent), True))
            return convert(path)

        def loading(entry: Path) -> Any:
            self.calls.append((str(entry), False))
            return load_entry(entry)

        monkeypatch.setattr(tokenizer_module, "_convert", converting)
        monkeypatch.setattr(tokenizer_module, "_load_entry", loading)

    def take(self) -> list[tuple[str, bool]]:
        calls, self.calls = self.calls, []
        return calls


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "tokenizers").iterdir()) if (cache / "tokenizers").exists() else []


def _assert_same(got: Tokenizer, want: Tokenizer) -> None:
    """Same class, ids, texts, specials and chat prompts: what serving reads of it."""
    assert type(got.backend) is type(want.backend)
    assert (got.bos_token_id, got.eos_token_id, got.vocab_size, got.stop_token_ids) == (
        want.bos_token_id,
        want.eos_token_id,
        want.vocab_size,
        want.stop_token_ids,
    )
    assert got.backend.all_special_tokens == want.backend.all_special_tokens
    assert got.backend.added_tokens_decoder == want.backend.added_tokens_decoder
    for special in (True, False):
        for text in TEXTS:
            ids = want.encode(text, add_special_tokens=special)
            assert got.encode(text, add_special_tokens=special) == ids, text
            assert got.backend.encode(text, add_special_tokens=special) == ids, text
            assert got.decode(ids, skip_special_tokens=special) == want.decode(ids, special)
            assert got.backend.decode(ids) == want.backend.decode(ids)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    for prompt in (True, False):
        assert got.apply_chat_template(messages, prompt) == want.apply_chat_template(
            messages, prompt
        )


@pytest.mark.slow
def test_the_shipped_tokenizer_from_the_cache_is_the_converted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    loads = _Loads(monkeypatch)
    path = resolve_model(None)
    converted = _fresh(path)
    assert loads.take() == [(str(path.parent), True)]
    [entry] = _entries(tmp_path)
    assert (entry / "tokenizer.json").is_file()
    cached = _fresh(path)
    assert loads.take() == [(str(entry), False)]  # no conversion
    assert _entries(tmp_path) == [entry]
    _assert_same(cached, converted)


@pytest.fixture
def tiny_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Tokenizer]:
    """A tiny GGUF, its tokenizer as converted, and the cache's folder, which now holds
    that conversion's one entry."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    path = make_tiny_gguf(tmp_path)
    converted = _fresh(path)
    assert len(_entries(cache)) == 1
    return path, cache, converted


def test_a_tiny_gguf_tokenizer_from_the_cache_is_the_converted_one(
    tiny_cached: tuple[Path, Path, Tokenizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, cache, converted = tiny_cached
    [entry] = _entries(cache)
    loads = _Loads(monkeypatch)
    _assert_same(_fresh(path), converted)
    assert loads.take() == [(str(entry), False)]
    # A changed file is another entry; the old one is left (it may serve another copy).
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    _assert_same(_fresh(path), converted)
    assert loads.take() == [(str(path.parent), True)]
    assert len(_entries(cache)) == 2 and entry in _entries(cache)


def test_a_damaged_cache_entry_is_converted_again(
    tiny_cached: tuple[Path, Path, Tokenizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, cache, converted = tiny_cached
    [entry] = _entries(cache)
    (entry / "tokenizer.json").write_text("{not json")
    loads = _Loads(monkeypatch)
    _assert_same(_fresh(path), converted)
    assert loads.take() == [(str(entry), False), (str(path.parent), True)]
    assert _entries(cache) == [entry]  # replaced by a whole one, which loads
    assert json.loads((entry / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    _assert_same(_fresh(path), converted)
    assert loads.take() == [(str(entry), False)]


def test_no_cache_or_an_unwritable_one_costs_only_the_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_tiny_gguf(tmp_path)
    monkeypatch.setenv(CACHE_ENV, "")
    assert tokenizer_cache_dir() is None
    converted = _fresh(path)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocked))  # its "tokenizers" folder cannot be made
    _assert_same(_fresh(path), converted)
    assert blocked.read_text() == ""


def test_the_cache_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "/x/cache")
    assert tokenizer_cache_dir() == Path("/x/cache/pdserve/tokenizers")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tokenizer_cache_dir() == Path.home() / ".cache/pdserve/tokenizers"
    monkeypatch.setenv(CACHE_ENV, "/y")
    assert tokenizer_cache_dir() == Path("/y/tokenizers")


def test_a_cached_load_does_not_import_auto_tokenizer(
    tiny_cached: tuple[Path, Path, Tokenizer],
) -> None:
    """A process whose tokenizer is in the cache loads it by the class the entry names:
    transformers' AutoTokenizer module (~0.7 s of import on top of torch, ~3 s without
    it) stays unloaded. (A conversion, on a cache miss, imports it.)"""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.__module__
    assert auto == "transformers.models.auto.tokenization_auto"
    path, cache, _ = tiny_cached
    code = (
        "import sys\n"
        "from pdserve.model.tokenizer import Tokenizer\n"
        f"tok = Tokenizer.from_model_path({str(path)!r})\n"
        f"print(type(tok.backend).__name__, {auto!r} in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, CACHE_ENV: str(cache)},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "TokenizersBackend False\n"
