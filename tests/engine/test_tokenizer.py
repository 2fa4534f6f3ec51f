"""Tokenizer, chat template and streaming detokenisation."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2 import TemplateError

from venusrl.engine.tokenizer import (
    IncrementalDecoder,
    Tokenizer,
    cut_at_stop,
    write_byte_level_tokenizer,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_byte_level_tokenizer(path, 512)
    loaded = Tokenizer.load(path)
    assert loaded is not None
    return loaded


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("ab é€😀\n")), max_size=40),
    stop=st.lists(st.sampled_from(["b", "é€", "a a", "😀", "zz"]), max_size=2),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=60),
)
def test_streamed_pieces_add_up_to_the_whole_text_cut_at_the_first_stop(
    tok: Tokenizer, text: str, stop: list[str], chunks: list[int]
) -> None:
    ids = tok.encode(text)  # byte-level: multi-byte characters span several tokens
    decoder = IncrementalDecoder(tok, stop)
    pieces, at = [], 0
    for size in chunks:
        if at >= len(ids):
            break
        pieces.append(decoder.push(ids[at : at + size]))
        at += size
    pieces.append(decoder.push(ids[at:], final=True))
    expected, stopped = cut_at_stop(tok.decode(ids), stop)
    assert "".join(pieces) == expected
    assert all("\ufffd" not in p for p in pieces)
    assert decoder.stopped == stopped


def test_chat_template_renders_chatml_and_can_refuse(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    strict = Tokenizer(
        tok._tok, chat_template="{{ raise_exception('roles must alternate') }}", eos_token="x"
    )
    with pytest.raises(TemplateError, match="alternate"):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_directory_without_tokenizer_json_has_no_tokenizer(tmp_path: Path) -> None:
    assert Tokenizer.load(tmp_path) is None
