"""The GGUF header parse (pdserve/model/gguf_header.py `_PlainReader`): its one-pass
arrays give every field exactly as gguf's own reader does, part by part, on the shipped
model and on a tiny one, and a file cut inside an array is refused."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from helpers.tiny_models import make_tiny_gguf

from pdserve.errors import ModelLoadError
from pdserve.model.gguf_header import _PlainReader, open_gguf
from pdserve.model.source import resolve_model


def assert_same_parse(path: Path) -> None:
    want, got = gguf.GGUFReader(path), _PlainReader(path)
    assert list(got.fields) == list(want.fields)
    for name, field in want.fields.items():
        mine = got.fields[name]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types)
        assert len(mine.parts) == len(field.parts), name
        for a, b in zip(mine.parts, field.parts, strict=True):
            assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), name
        assert mine.contents() == field.contents(), name
    assert got.data_offset == want.data_offset
    assert [(t.name, t.tensor_type, t.data_offset) for t in got.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in want.tensors
    ]


@pytest.mark.slow
def test_the_shipped_models_header_parses_as_ggufs_own_reader_does() -> None:
    path = resolve_model(None)
    reader = _PlainReader(path)
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 49152
    assert len(reader.fields["tokenizer.ggml.merges"].data) == 48900
    assert_same_parse(path)


def test_a_tiny_models_header_parses_as_ggufs_own_reader_does(tmp_path: Path) -> None:
    assert_same_parse(make_tiny_gguf(tmp_path))


@pytest.mark.parametrize("array", ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type"])
def test_a_file_cut_inside_an_array_is_refused(tmp_path: Path, array: str) -> None:
    """An array of strings and one of int32s, each cut 64 bytes in."""
    path = make_tiny_gguf(tmp_path)
    field = _PlainReader(path).fields[array]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: field.offset + 64])
    with pytest.raises(ModelLoadError) as info:
        open_gguf(cut)
    assert str(info.value) == f"{cut}: truncated or corrupt GGUF file"
