"""A reasoning parser's stream (what /v1/chat/completions and /v1/responses stream) and
its parse of the whole text (what they return without streaming) agree, for every
parser and every way the text arrives in pieces. Found by a probe: with no reasoning
section the stream dropped the output's leading whitespace, which parse keeps."""

from __future__ import annotations

import pytest

from plait.reasoning import REASONING_PARSERS

TEXTS = [" plain answer", "\n\nanswer", "answer ", "<think>why</think>\n\nanswer", "  <think> why </think> answer",
         "<think>unfinished", "why</think>answer", "<thi", " ", "", "a <think> b", "<think></think>", "x</think",
         "</think> after"]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streamed_pieces_concatenate_to_the_parse(name, size):
    parser = REASONING_PARSERS[name]
    for text in TEXTS:
        stream = parser.stream()
        reasoning = content = ""
        for i in range(0, len(text), size):
            r, c = stream.feed(text[i:i + size])
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        reasoning, content = reasoning + r, content + c
        want_reasoning, want_content = parser.parse(text)
        assert (reasoning, content) == (want_reasoning or "", want_content), (name, size, text)
