"""Text <-> token ids and chat templates, by the model's own transformers fast tokenizer.

A GGUF carries its tokenizer in metadata; transformers converts it (4-10 s for the shipped
model: it parses the whole GGUF header in Python). Every process that serves a model
needs its tokenizer (the API server, each engine instance), so the conversion is saved
once, as a HF tokenizer folder, in the tokenizer cache (`tokenizer_cache_dir`), and
loaded from there (~0.4 s) by every later process; loaded tokenizers are also kept for
the life of the process.

`AutoTokenizer` is imported only by a conversion or a HF folder's load: its module costs
~0.7 s a process on top of torch (~3 s with torch, which it imports). A cache entry is
loaded by the class its save recorded, so a process whose tokenizer is cached does not
import it (tests/test_tokenizer.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import tokenizers
import transformers

from pdserve.errors import InvalidRequestError, ModelLoadError
from pdserve.model.source import ModelPath, ModelSource, load_config, load_generation_defaults

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Tokenizer:
    """A transformers fast tokenizer plus the ids that end a generation.

    Not mutated after construction; safe to share between requests.
    """

    def __init__(self, backend: PreTrainedTokenizerBase, extra_stop_ids: Sequence[int] = ()):
        self._backend = backend
        # transformers' encode/decode wrap the Rust `tokenizers` object in ~0.3 ms of
        # Python per call (a third of the server's per-request CPU); call it directly.
        # Decoding goes direct only if transformers would not post-process the text.
        rust = getattr(backend, "backend_tokenizer", None)
        self._rust_encode = rust
        cleanup = getattr(backend, "clean_up_tokenization_spaces", False)
        self._rust_decode = None if cleanup else rust
        eos = () if backend.eos_token_id is None else (int(backend.eos_token_id),)
        # dict.fromkeys: deduplicate, keep order (the tokenizer's eos first).
        self._stop_ids = tuple(dict.fromkeys((*eos, *(int(i) for i in extra_stop_ids))))

    @classmethod
    def from_model_path(cls, path: ModelPath | ModelSource) -> Tokenizer:
        """The tokenizer of a HF folder or GGUF file (None: the shipped default model).

        Stop ids: the tokenizer's eos, generation_config.json's eos ids, config eos ids.
        """
        src = ModelSource.resolve(path)
        backend = _load_backend(src.path, src.format, src.path.stat().st_mtime_ns)
        stops = [*_ids(load_generation_defaults(src).get("eos_token_id"))]
        stops += load_config(src).eos_token_ids
        return cls(backend, stops)

    @property
    def backend(self) -> PreTrainedTokenizerBase:
        """The wrapped transformers tokenizer (for what this class does not cover)."""
        return self._backend

    @property
    def has_chat_template(self) -> bool:
        return bool(self._backend.chat_template)

    @property
    def eos_token_id(self) -> int | None:
        return self._backend.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._backend.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Size of the full vocabulary, added tokens included."""
        return len(self._backend)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: eos first, then the generation config's."""
        return self._stop_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS where the model's tokenizer does."""
        if self._rust_encode is not None:
            return list(self._rust_encode.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens))

    def encode_many(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> list[tokenizers.Encoding] | list[list[int]]:
        """Each text's encoding, as `encode` gives its ids. A fast tokenizer encodes them by
        the Rust `encode_batch_fast`, which releases the GIL while it works (and skips the
        offsets: 2x faster); call it off the event loop for a large text. A slow tokenizer
        gives id lists (Python, which yields the GIL anyway)."""
        if self._rust_encode is not None:
            batch = getattr(self._rust_encode, "encode_batch_fast", None)
            encode = batch or self._rust_encode.encode_batch
            return list(encode(texts, add_special_tokens=add_special_tokens))
        return [self.encode(t, add_special_tokens) for t in texts]

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt as the engine takes it: text is encoded, token ids are copied.
        Empty text raises InvalidRequestError (empty id lists are the core's to refuse)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            return self.encode(prompt)
        return list(prompt)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._rust_decode is not None:
            return str(self._rust_decode.decode(list(ids), skip_special_tokens=skip_special_tokens))
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @property
    def template_knows_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself."""
        return "tools" in (self._backend.chat_template or "")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for a chat; InvalidRequestError if the model has no template
        or the template refuses the messages (e.g. roles out of order). `tools`: OpenAI
        tool specs, for a template that renders them (`template_knows_tools`)."""
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt instead", param="messages"
            )
        try:
            text = self._backend.apply_chat_template(
                messages,
                tools=tools,  # type: ignore[arg-type]
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template error: {e}", param="messages") from e
        return str(text)


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


@functools.lru_cache(maxsize=4)
def _load_backend(path: Path, fmt: str, mtime_ns: int) -> PreTrainedTokenizerBase:
    """Load once per (file, modification time)."""
    try:
        if fmt == "gguf":
            return _gguf_backend(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({first_line})") from e


# The tokenizer cache's folder; empty: no cache (every process converts the GGUF's).
CACHE_ENV = "PDSERVE_CACHE_DIR"
log = logging.getLogger(__name__)


def tokenizer_cache_dir() -> Path | None:
    """Where converted GGUF tokenizers are kept: `$PDSERVE_CACHE_DIR/tokenizers`, else
    `$XDG_CACHE_HOME/pdserve/tokenizers` (`~/.cache/pdserve/tokenizers`); None when
    `PDSERVE_CACHE_DIR` is set empty."""
    root = os.environ.get(CACHE_ENV)
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "pdserve")
    return Path(root) / "tokenizers" if root else None


def tokenizer_json(path: Path) -> Path | None:
    """The fast tokenizer's own file for the model at `path` (`resolve_model`'s), where one
    is on disk: an HF folder's `tokenizer.json`, or a GGUF's converted entry in the
    tokenizer cache. None: none (yet). Read as text, it needs no transformers load, which
    holds the GIL for up to ~0.3 s (structured outputs build llguidance's tokenizer from it
    beside a running step loop)."""
    if path.is_dir():
        file = path / "tokenizer.json"
        return file if file.is_file() else None
    root = tokenizer_cache_dir()
    if root is None:
        return None
    file = root / _cache_key(path) / "tokenizer.json"
    return file if file.is_file() else None


def converts(path: ModelPath | ModelSource) -> bool:
    """Whether loading the model's tokenizer here would convert a GGUF's (transformers'
    converter imports torch, ~2.5 CPU-s): a GGUF file with no cache entry yet, and a
    cache to keep one in."""
    src = ModelSource.resolve(path)
    cache = tokenizer_cache_dir() is not None
    return src.format == "gguf" and cache and tokenizer_json(src.path) is None


def convert_into_cache(path: Path) -> None:
    """Convert a GGUF's tokenizer into the cache, for processes that then load it from
    there: `pdserve serve` runs this in a child of its fork server on a first start
    (server/launch.py), so that its own process loads no torch."""
    _gguf_backend(path)


def _cache_key(path: Path) -> str:
    """One entry per GGUF file as it is now and per converter: its resolved path, size and
    modification time, and the transformers and tokenizers versions that converted it."""
    st = path.stat()
    file = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    parts = (*file, transformers.__version__, tokenizers.__version__)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _gguf_backend(path: Path) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer: from the cache, else converted by transformers (and saved).

    A cache entry is a complete `save_pretrained` folder or absent: it is written under a
    temporary name and renamed into place (an entry another process renamed first wins).
    An entry that does not load, or a cache that cannot be written, costs only the
    conversion; the served tokenizer is the same either way (tests/test_tokenizer.py)."""
    root = tokenizer_cache_dir()
    entry = None if root is None else root / _cache_key(path)
    if entry is not None and entry.is_dir():
        try:
            return _load_entry(entry)
        except Exception as e:  # a damaged entry: convert again and replace it
            log.warning("tokenizer cache entry %s does not load (%s); converting again", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    backend = _convert(path)
    if entry is not None:
        _save_entry(backend, entry)
    return backend


def _convert(path: Path) -> PreTrainedTokenizerBase:
    """transformers' conversion of a GGUF's tokenizer (seconds: it parses the header)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _load_entry(entry: Path) -> PreTrainedTokenizerBase:
    """A cache entry, by the class `save_pretrained` recorded in it (the class that was
    converted): transformers then imports that class's module alone, not AutoTokenizer's
    (which imports every auto mapping, and torch). A name transformers does not export
    raises, and the caller converts again."""
    config = json.loads((entry / "tokenizer_config.json").read_text())
    backend_class = getattr(transformers, config["tokenizer_class"])
    return backend_class.from_pretrained(str(entry))


def _save_entry(backend: PreTrainedTokenizerBase, entry: Path) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    except OSError as e:
        log.warning("tokenizer cache %s is not writable (%s)", entry.parent, e)
        return
    try:
        backend.save_pretrained(str(tmp))
        tmp.rename(entry)
    except OSError:  # another process saved the same entry first, or the disk is full
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone once renamed
