"""The parsers on token ids (multiserve/parsing/token_ids.py), with the default model's
real tokenizer: the same answers as on the decoded text, whole and streamed one id at a
time (multi-byte characters split across ids included)."""

from __future__ import annotations

from typing import Any

import pytest

from multiserve.parsing import (
    IncrementalDecoder,
    parse_tool_call_ids,
    separate_reasoning_ids,
    tool_call_parser,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
REPLY = ('Je vérifie ☀️ 東京.\n<tool_call>\n{"name": "get_weather", "arguments": '
         '{"city": "Zürich 東京"}}\n</tool_call>')


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    from multiserve.model.loading.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def test_tool_calls_from_ids_equal_those_from_text(tok: Any) -> None:
    ids = tok.encode(REPLY, add_special_tokens=False)
    want = tool_call_parser("hermes", [WEATHER]).parse(REPLY)
    assert want[1] and want[1][0].parameters == '{"city": "Zürich 東京"}'
    assert parse_tool_call_ids(ids, tok, "hermes", [WEATHER]) == want
    # any ids -> text callable works as the decoder
    assert parse_tool_call_ids(ids, lambda x: tok.decode(list(x)), "hermes", [WEATHER]) == want


def test_streamed_one_id_at_a_time(tok: Any) -> None:
    ids = tok.encode(REPLY, add_special_tokens=False)
    dec = IncrementalDecoder(tok)
    parser = tool_call_parser("hermes", [WEATHER])
    pieces, normal = [], []
    for t in ids:
        piece = dec.feed([t])
        assert "\ufffd" not in piece
        pieces.append(piece)
        normal.append(parser.feed(piece).normal_text)
    pieces.append(dec.flush())
    normal.append(parser.feed(pieces[-1]).normal_text + parser.flush().normal_text)
    assert "".join(pieces) == tok.decode(ids)
    assert ("".join(normal), parser.calls) == tool_call_parser("hermes", [WEATHER]).parse(REPLY)


def test_reasoning_from_ids_and_special_tokens(tok: Any) -> None:
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("<think>\nsix times seven\n</think>\n\n42", add_special_tokens=False)
    assert separate_reasoning_ids(ids + [end], tok, "qwen3") == ("six times seven", "42")
    # special tokens are skipped unless asked for
    _, answer = separate_reasoning_ids(ids + [end], tok, "qwen3", skip_special_tokens=False)
    assert answer == "42<|im_end|>"


def test_a_decoder_must_decode() -> None:
    with pytest.raises(TypeError, match="decode"):
        parse_tool_call_ids([1, 2], object())
