"""A streamed ``/generate`` costs about its output's size, not its square.

SGLang's native stream events carry everything so far (text, output ids, logprob
lists). Sent once per chunk, a long output with top logprobs cost the square of its
size (n=8 x 500 tokens x top-20 logprobs sent 582 MB) on the front's event loop.
The logprob entries sent are budgeted (``NativeStreamState``): past a free allowance an
event goes out only once a quarter more has arrived; every event still holds
everything so far, and streams without logprobs send every chunk.
"""

from __future__ import annotations

import json

from plait import protocol as P
from plait.runtime.server.http_api import NativeStreamState

TOP = 20


def _chunk(i: int) -> P.StreamChunk:
    return P.StreamChunk(rid="r", text=f"t{i} ", token_ids=[i], meta={
        "output_token_logprobs": [[-0.5, i]],
        "output_top_logprobs": [[[-0.5 - j / 10, j] for j in range(TOP)]],
        "completion_tokens": i + 1,
    })


def test_events_hold_everything_so_far_and_cost_about_the_output_size():
    state = NativeStreamState("r")
    tokens = 3000
    events, sent = [], 0
    for i in range(tokens):
        event = state.add(_chunk(i))
        if event is not None:
            sent += len(json.dumps(event))
            events.append((i, json.loads(json.dumps(event))))
    final = len(json.dumps(state.out))
    # cumulative: each event is the whole output up to its chunk
    for i, event in events:
        assert event["output_ids"] == list(range(i + 1))
        assert event["text"] == "".join(f"t{k} " for k in range(i + 1))
        assert len(event["meta_info"]["output_top_logprobs"]) == i + 1
        assert event["meta_info"]["completion_tokens"] == i + 1 and event["meta_info"]["finish_reason"] is None
    # the first chunks go out one by one (their events' entries within the free budget),
    # then the events thin out
    per_token = 1 + TOP  # the token's logprob entry and its top row
    first = int((2 * NativeStreamState.FREE_ENTRIES / per_token) ** 0.5)
    assert [i for i, _ in events[:first]] == list(range(first))
    assert len(events) < tokens / 4
    # everything sent is a few times the final output, not its square (~tokens / 2 times)
    assert sent < 8 * final, (sent, final)


def test_short_outputs_send_every_chunk():
    state = NativeStreamState("r")
    assert all(state.add(_chunk(i)) is not None for i in range(60))


def test_streams_without_logprobs_send_every_chunk():
    state = NativeStreamState("r")
    chunks = [P.StreamChunk(rid="r", text="word ", token_ids=[i], meta={"completion_tokens": i + 1})
              for i in range(20_000)]
    assert all(state.add(c) is not None for c in chunks)
