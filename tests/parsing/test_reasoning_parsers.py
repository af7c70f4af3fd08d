"""Reasoning parsers on Qwen3 and DeepSeek-R1 replies, whole and streamed at every split."""

from __future__ import annotations

import pytest

from multiserve.parsing import reasoning_parser

CASES = [
    # Qwen3 with thinking on: the reply opens the block itself
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
     "The user greets me.", "Hello! How can I help?"),
    # Qwen3 with enable_thinking=false (the template closed an empty block): no reasoning
    ("qwen3", "Hello! How can I help?", "", "Hello! How can I help?"),
    # cut off while thinking: all reasoning
    ("qwen3", "<think>\nLet me count: 1, 2,", "Let me count: 1, 2,", ""),
    # DeepSeek-R1: the prompt opened <think>, the reply starts inside it
    ("deepseek-r1", "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2 + 2 is 4.",
     "The answer is 4."),
    ("deepseek-r1", "<think>\nHmm.\n</think>\nFour.", "Hmm.", "Four."),
    ("deepseek-r1", "Still thinking about <thi", "Still thinking about <thi", ""),
]


@pytest.mark.parametrize("name,text,reasoning,normal", CASES)
def test_non_streaming(name, text, reasoning, normal):
    assert reasoning_parser(name).parse(text) == (reasoning, normal)


@pytest.mark.parametrize("name,text,reasoning,normal", CASES)
def test_streaming_at_every_split(name, text, reasoning, normal):
    for cut in range(len(text) + 1):
        p = reasoning_parser(name)
        parts = [p.feed(text[:cut]), p.feed(text[cut:]), p.flush()]
        assert ("".join(x.reasoning_text for x in parts),
                "".join(x.normal_text for x in parts)) == (reasoning, normal), cut


def test_unknown_reasoning_parser():
    with pytest.raises(KeyError, match="qwen3"):
        reasoning_parser("r2")
